//! dsec-aether: the first process of every sandbox. It reaps orphans (it is PID 1) and
//! serves the runtime channel on the socket the edge handed it as fd 3. It is statically
//! linked so it runs in any image, and it makes itself non-dumpable so sandboxed processes
//! cannot ptrace it or open its file descriptors through /proc.

mod children;
mod exec;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::FromRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;

use dsec_common::channel::{LISTEN_FD, PROTOCOL_VERSION, Request, Response};

/// A request line longer than this is refused (the edge never sends one).
const MAX_REQUEST_BYTES: u64 = 64 << 20;

fn main() {
    if std::env::args().nth(1).as_deref() == Some("--version") {
        println!("dsec-aether {}", env!("CARGO_PKG_VERSION"));
        return;
    }
    // SAFETY: plain prctl/fcntl calls on our own process and fd.
    unsafe {
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
        if libc::fcntl(LISTEN_FD, libc::F_SETFD, libc::FD_CLOEXEC) != 0 {
            eprintln!(
                "dsec-aether: no channel socket on fd {LISTEN_FD}; started outside a sandbox?"
            );
            std::process::exit(2);
        }
    }
    // SAFETY: fd 3 is the listening socket the edge passed us (checked above).
    let listener = unsafe { UnixListener::from_raw_fd(LISTEN_FD) };
    let table = Arc::new(children::Table::default());
    children::start_reaper(table.clone());
    let base_env = exec::base_env();
    for conn in listener.incoming() {
        match conn {
            Ok(stream) => {
                let (t, e) = (table.clone(), base_env.clone());
                // Threads count against the sandbox's pids limit; when none can be made
                // (a fork bomb), the connection is dropped, never the agent.
                let spawned = std::thread::Builder::new().spawn(move || serve(stream, &t, &e));
                if spawned.is_err() {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
            }
            Err(e) => {
                eprintln!("dsec-aether: accept: {e}");
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
    }
}

fn serve(stream: UnixStream, table: &children::Table, base_env: &exec::Env) {
    let mut line = String::new();
    let read = match stream.try_clone() {
        Ok(s) => BufReader::new(s.take(MAX_REQUEST_BYTES)).read_line(&mut line),
        Err(e) => Err(e),
    };
    let response = match read {
        Ok(0) => return,
        Ok(_) => match serde_json::from_str::<Request>(&line) {
            Ok(Request::Ping) => Response::Pong {
                version: PROTOCOL_VERSION,
                pid: std::process::id(),
            },
            Ok(Request::Exec(spec)) => match exec::run(spec, table, base_env) {
                Ok(r) => Response::Exec(r),
                Err(message) => Response::Error { message },
            },
            Err(e) => Response::Error {
                message: format!("malformed request: {e}"),
            },
        },
        Err(e) => Response::Error {
            message: format!("reading request: {e}"),
        },
    };
    let mut out = match serde_json::to_string(&response) {
        Ok(s) => s,
        Err(e) => format!(r#"{{"type":"error","message":"encoding response: {e}"}}"#),
    };
    out.push('\n');
    let mut stream = stream;
    let _ = stream.write_all(out.as_bytes());
}
