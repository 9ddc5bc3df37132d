//! aether over vsock, for Firecracker microVMs (see `dsec_common::vsock`). In the guest it
//! listens on AF_VSOCK port [`CHANNEL_PORT`] and serves every connection like one on fd 3;
//! on the host, `dsec-aether vsockproxy LISTEN FC_UDS PORT [FC_PID]` runs next to
//! Firecracker and carries each connection the edge makes to the sandbox's `aether.sock`
//! to the guest, through Firecracker's vsock unix socket.

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::FromRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dsec_common::vsock::{self, CHANNEL_PORT};

/// How long a host connection waits for the guest to take it. A guest that is still
/// booting has no listener yet; the edge retries until its start timeout.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// A listening AF_VSOCK socket on `port` for any CID.
fn listen(port: u32) -> io::Result<UnixListener> {
    // SAFETY: socket/bind/listen on a fresh fd with a zeroed, filled-in sockaddr_vm; the
    // fd is owned by the returned listener (or closed on error).
    unsafe {
        let fd = libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut addr: libc::sockaddr_vm = std::mem::zeroed();
        addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
        addr.svm_port = port;
        addr.svm_cid = libc::VMADDR_CID_ANY;
        let len = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;
        if libc::bind(fd, (&addr as *const libc::sockaddr_vm).cast(), len) != 0
            || libc::listen(fd, 128) != 0
        {
            let e = io::Error::last_os_error();
            libc::close(fd);
            return Err(e);
        }
        // UnixListener/UnixStream only wrap the fd: accept, read, write, shutdown,
        // setsockopt and poll are the same calls on any stream socket, and aether uses
        // nothing unix-specific (no peer credentials, no fd passing) on the channel.
        Ok(UnixListener::from_raw_fd(fd))
    }
}

fn accept(l: &UnixListener) -> io::Result<UnixStream> {
    use std::os::fd::AsRawFd;
    // SAFETY: accept4 on our listening fd; we do not need the peer address.
    let fd = unsafe {
        libc::accept4(
            l.as_raw_fd(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd from accept4, owned by the stream from here on.
    Ok(unsafe { UnixStream::from_raw_fd(fd) })
}

/// Guest init over vsock: serves the channel until the VM ends. A snapshot resets every
/// vsock connection but not the listener, so restored copies keep serving.
pub fn guest_main(serve: impl Fn(UnixStream) + Send + Sync + Clone + 'static) -> ! {
    let t0 = Instant::now();
    let listener = loop {
        match listen(CHANNEL_PORT) {
            Ok(l) => break l,
            // The transport module may still be binding to its device.
            Err(e) if t0.elapsed() < Duration::from_secs(30) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                eprintln!(
                    "dsec-aether: listening on vsock port {CHANNEL_PORT}: {e}; is vmw_vsock_virtio_transport loaded?"
                );
                std::process::exit(2);
            }
        }
    };
    eprintln!("dsec-aether: serving the channel on vsock port {CHANNEL_PORT}");
    loop {
        match accept(&listener) {
            Ok(stream) => {
                let s = serve.clone();
                // As on fd 3: a connection that gets no thread is dropped, never the agent.
                let _ = std::thread::Builder::new().spawn(move || s(stream));
            }
            Err(e) => {
                eprintln!("dsec-aether: vsock accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Copies `from` into `to` until EOF, then half-closes `to`.
fn pump(mut from: UnixStream, to: UnixStream) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut w = &to;
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if w.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Read);
}

/// Carries one edge connection to the guest port behind `fc_uds`.
fn bridge(edge: UnixStream, fc_uds: &Path, port: u32) -> io::Result<()> {
    let guest = vsock::connect(fc_uds, port, HANDSHAKE_TIMEOUT).map_err(io::Error::other)?;
    let (e2, g2) = (edge.try_clone()?, guest.try_clone()?);
    let t = std::thread::spawn(move || pump(e2, g2));
    pump(guest, edge);
    let _ = t.join();
    Ok(())
}

/// Accepts on `listener` and bridges each connection (see [`bridge`]); a connection the
/// guest does not take is closed, so the edge sees a closed channel and retries.
pub fn proxy(listener: UnixListener, fc_uds: PathBuf, port: u32) {
    for conn in listener.incoming() {
        match conn {
            Ok(c) => {
                let uds = fc_uds.clone();
                let spawned = std::thread::Builder::new().spawn(move || {
                    if let Err(e) = bridge(c, &uds, port) {
                        eprintln!("dsec-aether vsockproxy: {e}");
                    }
                });
                if spawned.is_err() {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            Err(e) => {
                eprintln!("dsec-aether vsockproxy: accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// `dsec-aether vsockproxy LISTEN FC_UDS PORT [FC_PID]`: binds LISTEN (replacing a stale
/// socket) and proxies; with FC_PID, exits once that Firecracker process is gone.
pub fn proxy_main(listen: &str, fc_uds: &str, port: &str, fc_pid: Option<&str>) -> io::Result<()> {
    let port: u32 = port.parse().map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("port {port:?} is not a number"),
        )
    })?;
    let pid: Option<i32> = match fc_pid {
        Some(p) => Some(p.parse().map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("pid {p:?} is not a number"),
            )
        })?),
        None => None,
    };
    let _ = std::fs::remove_file(listen);
    let listener = UnixListener::bind(listen)
        .map_err(|e| io::Error::new(e.kind(), format!("binding {listen}: {e}")))?;
    if let Some(pid) = pid {
        std::thread::spawn(move || {
            loop {
                std::thread::sleep(Duration::from_millis(500));
                // SAFETY: signal 0 only checks that the process exists.
                if unsafe { libc::kill(pid, 0) } != 0 {
                    std::process::exit(0);
                }
            }
        });
    }
    proxy(listener, PathBuf::from(fc_uds), port);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;

    /// Firecracker's side: for each connection, reads `CONNECT <port>\n`, answers OK and
    /// echoes in upper case, so the test sees the bytes went through the guest end.
    fn fake_firecracker(path: &Path) -> std::thread::JoinHandle<Vec<String>> {
        let l = UnixListener::bind(path).unwrap();
        std::thread::spawn(move || {
            let mut seen = Vec::new();
            for _ in 0..2 {
                let (s, _) = l.accept().unwrap();
                let mut r = std::io::BufReader::new(s.try_clone().unwrap());
                let mut line = String::new();
                r.read_line(&mut line).unwrap();
                seen.push(line);
                let mut w = s;
                w.write_all(b"OK 1073741825\n").unwrap();
                let mut data = String::new();
                r.read_line(&mut data).unwrap();
                w.write_all(data.to_uppercase().as_bytes()).unwrap();
            }
            seen
        })
    }

    #[test]
    fn the_proxy_opens_the_guest_port_for_each_connection() {
        let d = tempfile::tempdir().unwrap();
        let fc = d.path().join("fc.vsock");
        let listen = d.path().join("aether.sock");
        let fake = fake_firecracker(&fc);
        let l = UnixListener::bind(&listen).unwrap();
        let fc2 = fc.clone();
        std::thread::spawn(move || proxy(l, fc2, CHANNEL_PORT));
        for word in ["ping\n", "again\n"] {
            let mut c = UnixStream::connect(&listen).unwrap();
            c.write_all(word.as_bytes()).unwrap();
            let mut r = std::io::BufReader::new(c);
            let mut back = String::new();
            r.read_line(&mut back).unwrap();
            assert_eq!(back, word.to_uppercase());
        }
        assert_eq!(fake.join().unwrap(), vec!["CONNECT 1024\n"; 2]);
    }

    #[test]
    fn a_connection_the_guest_does_not_take_is_closed() {
        let d = tempfile::tempdir().unwrap();
        let listen = d.path().join("aether.sock");
        let l = UnixListener::bind(&listen).unwrap();
        let missing = d.path().join("none.vsock");
        std::thread::spawn(move || proxy(l, missing, CHANNEL_PORT));
        let mut c = UnixStream::connect(&listen).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(c.read(&mut buf).unwrap(), 0);
    }
}
