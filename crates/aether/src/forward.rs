//! Port forwarding: a channel connection becomes a TCP connection to a port inside the
//! sandbox (aether runs in the sandbox's network namespace), bytes copied both ways.

use std::io::{BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use dsec_common::ErrorCode;

pub fn connect(port: u16) -> Result<TcpStream, (ErrorCode, String)> {
    if port == 0 {
        return Err((ErrorCode::InvalidArgument, "port 0 is not a port".into()));
    }
    let mut last = None;
    for addr in [
        SocketAddr::from(([127, 0, 0, 1], port)),
        SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port)),
    ] {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) => last = Some(e),
        }
    }
    Err((
        ErrorCode::Unavailable,
        format!(
            "nothing in the sandbox accepts connections on port {port} (127.0.0.1 or ::1): {}",
            last.map(|e| e.to_string()).unwrap_or_default()
        ),
    ))
}

/// Copies until either side closes. `from_edge` may hold bytes already read past the
/// request line, so it is used as the reader rather than a fresh handle.
pub fn splice(mut from_edge: BufReader<UnixStream>, mut to_edge: UnixStream, tcp: TcpStream) {
    let Ok(mut tcp_in) = tcp.try_clone() else {
        return;
    };
    let mut tcp_out = tcp;
    let up = std::thread::Builder::new().spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from_edge.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tcp_out.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = tcp_out.shutdown(Shutdown::Write);
    });
    if up.is_err() {
        return;
    }
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match tcp_in.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to_edge.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to_edge.shutdown(Shutdown::Write);
}
