//! The channel over vsock, for Firecracker microVMs. In the guest, aether listens on
//! AF_VSOCK port [`CHANNEL_PORT`] and serves each accepted connection like one on fd 3.
//! On the host, Firecracker exposes the guest's vsock as a unix socket: a host connection
//! to it writes `CONNECT <port>\n`, Firecracker answers `OK <host port>\n`, and from then
//! on the socket is the guest connection. `dsec-aether vsockproxy` accepts the edge's
//! connections on the sandbox's `aether.sock` and does that handshake for each, so the
//! edge talks to a microVM exactly as to a container.
//!
//! The guest learns which link it has from the kernel command line: `dsec.channel=vsock`
//! (Firecracker) or nothing / `dsec.channel=virtio-serial` (QEMU).

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// The guest vsock port aether serves the channel on.
pub const CHANNEL_PORT: u32 = 1024;

/// The kernel command line key that names the guest's channel link.
pub const CMDLINE_KEY: &str = "dsec.channel";

/// Longest reply line Firecracker sends to `CONNECT` (`OK 4294967295\n` is 14 bytes).
const MAX_REPLY: usize = 64;

/// How the guest reaches the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestChannel {
    /// A virtio-serial port carrying [`crate::vmux`] frames (QEMU).
    VirtioSerial,
    /// AF_VSOCK, one connection per channel connection (Firecracker).
    Vsock,
}

/// Reads [`CMDLINE_KEY`] from a kernel command line (`/proc/cmdline`); virtio-serial when
/// absent. Words after `--` belong to init, not to the kernel.
pub fn channel_from_cmdline(cmdline: &str) -> GuestChannel {
    cmdline
        .split_whitespace()
        .take_while(|w| *w != "--")
        .filter_map(|w| w.strip_prefix(CMDLINE_KEY)?.strip_prefix('='))
        .last()
        .map_or(GuestChannel::VirtioSerial, |v| match v {
            "vsock" => GuestChannel::Vsock,
            _ => GuestChannel::VirtioSerial,
        })
}

#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    #[error("connecting to the VM's vsock socket {path}: {source}")]
    Connect { path: String, source: io::Error },
    #[error("vsock handshake for guest port {port}: {source}")]
    Io { port: u32, source: io::Error },
    #[error(
        "vsock handshake for guest port {port}: no answer within {ms} ms (is the guest agent listening?)"
    )]
    Timeout { port: u32, ms: u128 },
    #[error("vsock handshake for guest port {port}: the VM answered {reply:?}, not `OK <port>`")]
    Refused { port: u32, reply: String },
}

/// Sends `CONNECT <port>\n` on a fresh connection to Firecracker's vsock socket and reads
/// its `OK <n>\n` answer one byte at a time (the guest's bytes may follow it at once and
/// must stay in the socket). Returns the host-side port Firecracker names.
pub fn handshake(s: &mut UnixStream, port: u32, within: Duration) -> Result<u32, VsockError> {
    let io_err = |source| VsockError::Io { port, source };
    let t0 = Instant::now();
    s.write_all(format!("CONNECT {port}\n").as_bytes())
        .map_err(io_err)?;
    let mut line = Vec::with_capacity(16);
    let mut b = [0u8; 1];
    loop {
        let left = within.saturating_sub(t0.elapsed());
        if left.is_zero() {
            return Err(VsockError::Timeout {
                port,
                ms: within.as_millis(),
            });
        }
        s.set_read_timeout(Some(left)).map_err(io_err)?;
        match s.read(&mut b) {
            // Firecracker closes the connection when nothing listens on the guest port.
            Ok(0) => {
                return Err(VsockError::Refused {
                    port,
                    reply: String::from_utf8_lossy(&line).into_owned(),
                });
            }
            Ok(_) if b[0] == b'\n' => break,
            Ok(_) if line.len() >= MAX_REPLY => {
                return Err(VsockError::Refused {
                    port,
                    reply: String::from_utf8_lossy(&line).into_owned(),
                });
            }
            Ok(_) => line.push(b[0]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(VsockError::Timeout {
                    port,
                    ms: within.as_millis(),
                });
            }
            Err(e) => return Err(io_err(e)),
        }
    }
    s.set_read_timeout(None).map_err(io_err)?;
    let reply = String::from_utf8_lossy(&line).into_owned();
    reply
        .strip_prefix("OK ")
        .and_then(|n| n.trim().parse::<u32>().ok())
        .ok_or(VsockError::Refused { port, reply })
}

/// Connects to Firecracker's vsock socket `uds` and opens guest port `port` on it.
pub fn connect(uds: &Path, port: u32, within: Duration) -> Result<UnixStream, VsockError> {
    let mut s = UnixStream::connect(uds).map_err(|source| VsockError::Connect {
        path: uds.display().to_string(),
        source,
    })?;
    handshake(&mut s, port, within)?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;
    use std::os::unix::net::UnixListener;

    #[test]
    fn the_command_line_names_the_link() {
        assert_eq!(
            channel_from_cmdline("console=ttyS0 dsec.channel=vsock quiet"),
            GuestChannel::Vsock
        );
        assert_eq!(
            channel_from_cmdline("console=ttyS0 quiet"),
            GuestChannel::VirtioSerial
        );
        assert_eq!(
            channel_from_cmdline("a -- dsec.channel=vsock"),
            GuestChannel::VirtioSerial
        );
        assert_eq!(
            channel_from_cmdline("dsec.channel=vsock dsec.channel=virtio-serial"),
            GuestChannel::VirtioSerial
        );
        assert_eq!(
            channel_from_cmdline("dsec.channelx=vsock"),
            GuestChannel::VirtioSerial
        );
    }

    /// Plays Firecracker's side of one connection: reads `CONNECT <port>\n`, answers
    /// `reply`, then (when it said OK) sends `after` and echoes what comes.
    fn fake_firecracker(
        dir: &Path,
        reply: &'static [u8],
        after: &'static [u8],
    ) -> (std::path::PathBuf, std::thread::JoinHandle<String>) {
        let path = dir.join("v.sock");
        let l = UnixListener::bind(&path).unwrap();
        let t = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut r = std::io::BufReader::new(s.try_clone().unwrap());
            let mut line = String::new();
            r.read_line(&mut line).unwrap();
            let mut w = s;
            w.write_all(reply).unwrap();
            if reply.starts_with(b"OK") {
                w.write_all(after).unwrap();
                let mut buf = [0u8; 5];
                r.read_exact(&mut buf).unwrap();
                w.write_all(&buf).unwrap();
            }
            line
        });
        (path, t)
    }

    #[test]
    fn connect_does_the_handshake_and_keeps_the_bytes_after_it() {
        let d = tempfile::tempdir().unwrap();
        let (p, t) = fake_firecracker(d.path(), b"OK 1073741824\n", b"hello");
        let mut s = connect(&p, CHANNEL_PORT, Duration::from_secs(5)).unwrap();
        let mut got = [0u8; 5];
        s.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hello");
        s.write_all(b"12345").unwrap();
        s.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"12345");
        assert_eq!(t.join().unwrap(), "CONNECT 1024\n");
    }

    #[test]
    fn a_refusal_or_silence_is_a_clear_error() {
        let d = tempfile::tempdir().unwrap();
        let (p, t) = fake_firecracker(d.path(), b"", b"");
        let e = connect(&p, 7, Duration::from_secs(5)).unwrap_err();
        assert!(matches!(e, VsockError::Refused { port: 7, .. }), "{e}");
        t.join().unwrap();

        let d = tempfile::tempdir().unwrap();
        let (p, t) = fake_firecracker(d.path(), b"NO\n", b"");
        let e = connect(&p, 7, Duration::from_secs(5)).unwrap_err();
        assert!(e.to_string().contains("answered \"NO\""), "{e}");
        t.join().unwrap();

        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("v.sock");
        let _l = UnixListener::bind(&path).unwrap();
        let e = connect(&path, 7, Duration::from_millis(200)).unwrap_err();
        assert!(matches!(e, VsockError::Timeout { .. }), "{e}");

        let e = connect(&d.path().join("none"), 7, Duration::from_millis(200)).unwrap_err();
        assert!(
            e.to_string()
                .contains("connecting to the VM's vsock socket")
        );
    }
}
