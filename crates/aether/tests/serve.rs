//! `dsec-aether` serving its channel socket (fd 3), as in a container sandbox: a
//! connection that streamed a process's output to its exit carries the next request, and
//! a reader that goes away mid-stream leaves the agent serving.

use std::io::{BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};

use dsec_common::channel::{
    ExecSpec, FRAME_JSON, FRAME_STDOUT, Request, Response, StartSpec, read_frame,
};

struct Agent {
    child: Child,
    sock: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn agent() -> Agent {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("aether.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let fd = listener.as_raw_fd();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dsec-aether"));
    // SAFETY: between fork and exec, the socket onto descriptor 3 (where aether takes it)
    // and kept open across exec (dup2 onto itself would leave close-on-exec set).
    unsafe {
        cmd.pre_exec(move || {
            let r = if fd == 3 {
                libc::fcntl(3, libc::F_SETFD, 0)
            } else {
                libc::dup2(fd, 3)
            };
            if r < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().unwrap();
    drop(listener);
    Agent {
        child,
        sock,
        _dir: dir,
    }
}

fn send(c: &mut UnixStream, req: &Request) {
    let mut line = serde_json::to_vec(req).unwrap();
    line.push(b'\n');
    c.write_all(&line).unwrap();
}

/// Frames up to and including the next JSON one: (stdout bytes, the reply).
fn reply(r: &mut BufReader<UnixStream>) -> (Vec<u8>, Response) {
    let mut out = Vec::new();
    loop {
        match read_frame(r).unwrap() {
            Some((FRAME_STDOUT, d)) => out.extend_from_slice(&d),
            Some((FRAME_JSON, d)) => return (out, serde_json::from_slice(&d).unwrap()),
            Some((_, _)) => {}
            None => panic!("the agent closed the connection"),
        }
    }
}

fn start(argv: &[&str], attach: bool) -> Request {
    Request::Start(StartSpec {
        exec: ExecSpec {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            cwd: Some("/".into()),
            max_output_bytes: 1 << 20,
            ..ExecSpec::default()
        },
        attach,
        ..StartSpec::default()
    })
}

#[test]
fn a_streamed_process_leaves_its_connection_for_the_next_request() {
    let a = agent();
    let mut c = UnixStream::connect(&a.sock).unwrap();
    let mut r = BufReader::new(c.try_clone().unwrap());
    for word in ["one", "two"] {
        send(&mut c, &start(&["echo", word], true));
        let (_, started) = reply(&mut r);
        assert!(
            matches!(started, Response::Started { kept: true, .. }),
            "{started:?}"
        );
        let (out, exit) = reply(&mut r);
        assert_eq!(out, format!("{word}\n").as_bytes());
        assert!(
            matches!(&exit, Response::Exit(e) if e.exit_code == 0),
            "{exit:?}"
        );
    }
    // A process started without a stream, then a plain request: the same connection.
    send(&mut c, &start(&["true"], false));
    assert!(matches!(reply(&mut r).1, Response::Started { .. }));
    send(&mut c, &Request::Ping);
    assert!(matches!(reply(&mut r).1, Response::Pong { .. }));
}

#[test]
fn an_agent_whose_reader_left_mid_stream_serves_new_connections() {
    let a = agent();
    let mut c = UnixStream::connect(&a.sock).unwrap();
    let mut r = BufReader::new(c.try_clone().unwrap());
    send(&mut c, &start(&["sh", "-c", "echo up; sleep 30"], true));
    assert!(matches!(reply(&mut r).1, Response::Started { .. }));
    // The reader goes away while the process still runs.
    c.shutdown(std::net::Shutdown::Both).unwrap();
    let mut rest = Vec::new();
    let _ = r.read_to_end(&mut rest);
    // The agent still serves new connections.
    let mut c2 = UnixStream::connect(&a.sock).unwrap();
    let mut r2 = BufReader::new(c2.try_clone().unwrap());
    send(&mut c2, &Request::Ping);
    assert!(matches!(reply(&mut r2).1, Response::Pong { .. }));
}
