//! dsec-aether: the first process of every sandbox. It reaps orphans (it is PID 1) and
//! serves the runtime channel on the socket the edge handed it as fd 3: commands, managed
//! processes, terminals, files, directory watches and shell sessions. It is statically
//! linked so it runs in any image, and it makes itself non-dumpable so sandboxed processes
//! cannot ptrace it or open its file descriptors through /proc. `dsec-aether chronus
//! SHELL` is the per-session process (see chronus.rs).

mod children;
mod chronus;
mod exec;
mod files;
mod forward;
mod guestnet;
mod process;
mod session;
mod user;
mod vm;
mod vsock;
mod watch;

use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::os::fd::FromRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::time::Duration;

use dsec_common::ErrorCode;
use dsec_common::channel::{
    FRAME_DATA, FRAME_STDERR, FRAME_STDOUT, LISTEN_FD, PROTOCOL_VERSION, PtySize, Request,
    Response, read_frame, write_frame, write_json, write_reply,
};

use process::{Attachment, Chunk};

/// A request line longer than this is refused (the edge never sends one).
const MAX_REQUEST_BYTES: u64 = 64 << 20;
/// What a commit of a VM's changes leaves out: aether's own directory and the resolver
/// file it writes for the guest's network (a container's is a bind mount, never in its
/// writable layer either).
const EXPORT_SKIP: &[&str] = &[".dsec", "etc/resolv.conf"];

struct Ctx {
    table: Arc<children::Table>,
    base_env: std::sync::RwLock<exec::Env>,
    /// Where commands run unless they say (the image's working directory).
    workdir: std::sync::RwLock<Option<String>>,
    procs: process::Procs,
    sessions: session::Sessions,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("--version") => {
            println!("dsec-aether {}", env!("CARGO_PKG_VERSION"));
            return;
        }
        Some("chronus") => chronus::main(args.get(2).map(String::as_str).unwrap_or("/bin/sh")),
        Some("vmux") => {
            let (Some(listen), Some(chardev)) = (args.get(2), args.get(3)) else {
                eprintln!(
                    "usage: dsec-aether vmux LISTEN_SOCKET QEMU_CHARDEV_SOCKET [QEMU_WAKE_SOCKET]"
                );
                std::process::exit(2);
            };
            if let Err(e) = vm::vmux_main(listen, chardev, args.get(4).map(String::as_str)) {
                eprintln!("dsec-aether vmux: {e}");
                std::process::exit(1);
            }
            return;
        }
        Some("vsockproxy") => {
            let (Some(listen), Some(fc_uds), Some(port)) = (args.get(2), args.get(3), args.get(4))
            else {
                eprintln!(
                    "usage: dsec-aether vsockproxy LISTEN_SOCKET FIRECRACKER_VSOCK_SOCKET PORT [FIRECRACKER_PID]"
                );
                std::process::exit(2);
            };
            if let Err(e) = vsock::proxy_main(listen, fc_uds, port, args.get(5).map(String::as_str))
            {
                eprintln!("dsec-aether vsockproxy: {e}");
                std::process::exit(1);
            }
            return;
        }
        _ => {}
    }
    // SAFETY: plain prctl/fcntl calls on our own process and fd.
    let have_socket = unsafe {
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
        // A closed connection must be a write error, not a signal that ends PID 1.
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        libc::fcntl(LISTEN_FD, libc::F_SETFD, libc::FD_CLOEXEC) == 0
    };
    // Without a socket on fd 3 only a VM's init has a channel (virtio-serial or vsock).
    if !have_socket && std::process::id() != 1 {
        eprintln!("dsec-aether: no channel socket on fd {LISTEN_FD}; started outside a sandbox?");
        std::process::exit(2);
    }
    let table = children::Table::new();
    let ctx = Arc::new(Ctx {
        table,
        base_env: std::sync::RwLock::new(exec::base_env()),
        workdir: Default::default(),
        procs: process::Procs::default(),
        sessions: session::Sessions::default(),
    });
    if !have_socket {
        vm::guest_main(move |stream| serve(stream, &ctx));
    }
    // SAFETY: fd 3 is the listening socket the edge passed us (checked above).
    let listener = unsafe { UnixListener::from_raw_fd(LISTEN_FD) };
    for conn in listener.incoming() {
        match conn {
            Ok(stream) => {
                let c = ctx.clone();
                // Threads count against the sandbox's pids limit; when none can be made
                // (a fork bomb), the connection is dropped, never the agent.
                let spawned = std::thread::Builder::new().spawn(move || serve(stream, &c));
                if spawned.is_err() {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            Err(e) => {
                eprintln!("dsec-aether: accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

impl Ctx {
    /// A command's working directory: its own, else the image's, else (for a command run
    /// as a user other than root) that user's home, where there is one.
    fn default_cwd(&self, cwd: &mut Option<String>, user: Option<&str>) {
        if cwd.is_none() {
            *cwd = self
                .workdir
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
        }
        if cwd.is_none()
            && let Some(u) = user.and_then(|u| user::lookup(u).ok())
            && u.uid != 0
            && std::path::Path::new(&u.home).is_dir()
        {
            *cwd = Some(u.home);
        }
    }

    /// The environment every new process starts from.
    fn env(&self) -> exec::Env {
        self.base_env
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

fn err((code, message): (ErrorCode, String)) -> Response {
    Response::Error { code, message }
}

fn invalid(message: String) -> Response {
    Response::error(ErrorCode::InvalidArgument, message)
}

/// Serves one connection: request after request for as long as each has a single reply
/// (the edge keeps such connections open between calls); a request that streams or hands
/// the connection over ends it.
fn serve(stream: UnixStream, ctx: &Ctx) {
    let Ok(read_half) = stream.try_clone() else {
        return;
    };
    let mut conn = (BufReader::new(read_half), stream);
    while let Some(next) = serve_one(conn.0, conn.1, ctx) {
        conn = next;
    }
}

/// One request; the connection back when it may carry another.
fn serve_one(
    mut input: BufReader<UnixStream>,
    mut out: UnixStream,
    ctx: &Ctx,
) -> Option<(BufReader<UnixStream>, UnixStream)> {
    let mut line = Vec::new();
    match (&mut input)
        .take(MAX_REQUEST_BYTES)
        .read_until(b'\n', &mut line)
    {
        Ok(0) | Err(_) => return None,
        Ok(_) => {}
    }
    let req = match serde_json::from_slice::<Request>(&line) {
        Ok(r) => r,
        Err(e) => {
            let _ = write_json(&mut out, &invalid(format!("malformed request: {e}")));
            return None;
        }
    };
    let reply = match req {
        Request::Restored {
            sandbox_id,
            unix_ms,
            entropy,
        } => match vm::restored(unix_ms, &entropy) {
            Ok(()) => {
                ctx.base_env
                    .write()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert("DSEC_SANDBOX_ID".into(), sandbox_id);
                Response::Ok
            }
            Err(e) => err((ErrorCode::Internal, e)),
        },
        Request::Environment {
            env,
            workdir,
            mounts,
        } => {
            *ctx.base_env.write().unwrap_or_else(|p| p.into_inner()) = exec::with_defaults(env);
            match workdir.filter(|w| !w.is_empty()) {
                _ if let Err(e) = vm::mount_shares(&mounts) => err((ErrorCode::Internal, e)),
                // Made when the image names one it lacks, as container runtimes do (a VM's
                // root has no runtime to do it).
                Some(w)
                    if !std::path::Path::new(&w).is_dir()
                        && std::fs::create_dir_all(&w).is_err() =>
                {
                    invalid(format!("working directory {w} is not a directory"))
                }
                w => {
                    *ctx.workdir.write().unwrap_or_else(|p| p.into_inner()) = w;
                    Response::Ok
                }
            }
        }
        Request::DiskUsage => match dsec_common::disk::usage(std::path::Path::new("/")) {
            Ok(u) => Response::DiskUsage {
                used_bytes: u.used(),
                total_bytes: u.total,
            },
            Err(e) => err((ErrorCode::Internal, format!("statvfs /: {e}"))),
        },
        Request::Ping => Response::Pong {
            version: PROTOCOL_VERSION,
            pid: std::process::id(),
        },
        Request::Exec(mut spec) => match exec::run(
            {
                ctx.default_cwd(&mut spec.cwd, spec.user.as_deref());
                spec
            },
            &ctx.table,
            &ctx.env(),
        ) {
            Ok(r) => Response::Exec(r),
            Err(message) => invalid(message),
        },
        Request::Start(mut spec) => {
            ctx.default_cwd(&mut spec.exec.cwd, spec.exec.user.as_deref());
            let attach = spec.attach;
            match ctx.procs.start(spec, &ctx.table, &ctx.env()) {
                Ok(p) => {
                    let started = Response::Started {
                        pid: p.pid,
                        kept: true,
                    };
                    if write_json(&mut out, &started).is_err() {
                        return None;
                    }
                    // The connection goes on once the stream has ended with the exit.
                    if attach && !stream_output(p.attach(), &mut out) {
                        return None;
                    }
                    return Some((input, out));
                }
                Err(message) => invalid(message),
            }
        }
        Request::Attach { pid } => match ctx.procs.get(pid) {
            Ok(p) => {
                let started = Response::Started { pid, kept: true };
                if write_json(&mut out, &started).is_ok() && stream_output(p.attach(), &mut out) {
                    return Some((input, out));
                }
                return None;
            }
            Err(e) => err(e),
        },
        Request::Stdin { pid, close } => {
            let p = ctx.procs.get(pid);
            let mut failure = p.as_ref().err().cloned();
            loop {
                match read_frame(&mut input) {
                    Ok(Some((FRAME_DATA, d))) if d.is_empty() => break,
                    Ok(Some((FRAME_DATA, d))) => {
                        if let (Ok(p), None) = (&p, &failure) {
                            failure = p.write_stdin(&d).err();
                        }
                    }
                    _ => return None,
                }
            }
            match (p, failure) {
                (_, Some(e)) => err(e),
                (Ok(p), None) => {
                    if close {
                        p.close_stdin();
                    }
                    Response::Ok
                }
                (Err(e), None) => err(e),
            }
        }
        Request::Signal { pid, signal } => {
            match ctx.procs.get(pid).and_then(|p| p.signal(signal)) {
                Ok(()) => Response::Ok,
                Err(e) => err(e),
            }
        }
        Request::Resize { pid, cols, rows } => {
            match ctx
                .procs
                .get(pid)
                .and_then(|p| p.resize(PtySize { cols, rows }))
            {
                Ok(()) => Response::Ok,
                Err(e) => err(e),
            }
        }
        Request::Processes => Response::Processes {
            processes: ctx.procs.list(),
        },
        Request::ReadFile { path } => {
            match files::check_path(&path).and_then(|p| files::open_read(&p)) {
                Ok((f, size)) => {
                    let mut w = BufWriter::with_capacity(dsec_common::channel::CHUNK + 64, out);
                    if write_json(&mut w, &Response::File { size }).is_ok() {
                        let _ = files::send_file(f, &mut w);
                        let _ = w.flush();
                    }
                    return None;
                }
                Err(e) => err(e),
            }
        }
        Request::WriteFile {
            path,
            mode,
            append,
            user,
            metadata,
        } => {
            let r = files::check_path(&path).and_then(|p| {
                let input = &mut input;
                let metadata = metadata.as_ref();
                files::as_user(user.as_deref(), move || {
                    files::receive_file(&p, mode, append, metadata, input).map(|size| (p, size))
                })
                .and_then(|r| r)
            });
            match r {
                Ok((p, size)) => Response::Written {
                    path: files::stat(&p).map(|s| s.path).unwrap_or(path),
                    size,
                },
                Err(e) => err(e),
            }
        }
        Request::ExportTree { path } => {
            match files::check_path(&path).and_then(|p| files::stat(&p).map(|s| (p, s))) {
                Ok((p, s)) if s.kind == "dir" => {
                    let mut w = BufWriter::with_capacity(dsec_common::channel::CHUNK + 64, out);
                    if write_json(&mut w, &Response::Ok).is_err() {
                        return None;
                    }
                    // The sandbox's own mount points are not part of its changes.
                    let end = match dsec_common::tree::export(&p, EXPORT_SKIP, &mut w) {
                        Ok(s) => Response::Exported {
                            entries: s.entries,
                            bytes: s.bytes,
                        },
                        Err(dsec_common::tree::ExportError::Tree(m)) => {
                            Response::error(ErrorCode::FailedPrecondition, m)
                        }
                        Err(dsec_common::tree::ExportError::Write(_)) => return None,
                    };
                    let _ = write_json(&mut w, &end);
                    let _ = w.flush();
                    return None;
                }
                Ok((p, _)) => invalid(format!("{} is not a directory", p.display())),
                Err(e) => err(e),
            }
        }
        Request::Stat { path } => fs_reply(&path, |p| files::stat(p).map(Response::Stat)),
        Request::List { path, depth } => fs_reply(&path, |p| {
            files::list(p, depth).map(|entries| Response::Entries { entries })
        }),
        Request::Exists { path } => fs_reply(&path, |p| {
            Ok(Response::Exists {
                exists: std::fs::symlink_metadata(p).is_ok(),
            })
        }),
        Request::Mkdir { path, user } => fs_reply(&path, |p| {
            files::as_user(user.as_deref(), || files::mkdir(p).map(Response::Stat)).and_then(|r| r)
        }),
        Request::Remove { path, recursive } => {
            fs_reply(&path, |p| files::remove(p, recursive).map(|_| Response::Ok))
        }
        Request::Rename { from, to } => fs_reply(&from, |f| {
            files::check_path(&to).and_then(|t| files::rename(f, &t).map(Response::Stat))
        }),
        Request::Chmod { path, mode } => {
            fs_reply(&path, |p| files::chmod(p, mode).map(Response::Stat))
        }
        Request::Chown { path, uid, gid } => {
            fs_reply(&path, |p| files::chown(p, uid, gid).map(Response::Stat))
        }
        Request::Watch {
            path,
            recursive,
            entry,
            allow_network_mounts,
        } => {
            let how = watch::Options {
                recursive,
                entry,
                allow_network_mounts,
            };
            match files::check_path(&path).and_then(|p| watch::run(&p, how, &mut out)) {
                Ok(()) => return None,
                Err(e) => err(e),
            }
        }
        Request::SessionCreate {
            mut cwd,
            env,
            max_output_bytes,
        } => {
            ctx.default_cwd(&mut cwd, None);
            match ctx
                .sessions
                .create(&ctx.table, &ctx.env(), cwd, env, max_output_bytes)
            {
                Ok(s) => Response::Session(s),
                Err(e) => err(e),
            }
        }
        Request::SessionList => Response::Sessions {
            sessions: ctx.sessions.list(),
        },
        Request::SessionRun {
            session,
            cmd,
            timeout_ms,
            background,
        } => match ctx.sessions.run(
            &ctx.table,
            &session,
            cmd,
            Duration::from_millis(timeout_ms),
            background,
        ) {
            Ok(r) => Response::Command(r),
            Err(e) => err(e),
        },
        Request::SessionCommand { session, command } => {
            match ctx.sessions.command(&session, command) {
                Ok(r) => Response::Command(r),
                Err(e) => err(e),
            }
        }
        Request::SessionKill { session } => match ctx.sessions.kill(&session) {
            Ok(()) => Response::Ok,
            Err(e) => err(e),
        },
        Request::Connect { port } => match forward::connect(port) {
            Ok(tcp) => {
                if write_json(&mut out, &Response::Ok).is_ok() {
                    forward::splice(input, out, tcp);
                }
                return None;
            }
            Err(e) => err(e),
        },
    };
    // One write for the whole reply, so the edge wakes once for it.
    let mut w = BufWriter::new(&mut out);
    write_reply(&mut w, reply).and_then(|_| w.flush()).ok()?;
    drop(w);
    Some((input, out))
}

fn fs_reply(
    path: &str,
    f: impl FnOnce(&std::path::Path) -> Result<Response, files::FsError>,
) -> Response {
    match files::check_path(path).and_then(|p| f(&p)) {
        Ok(r) => r,
        Err(e) => err(e),
    }
}

/// Writes the kept output, then live output until the process exits or the edge goes.
/// Streams a process's output to `out` until its exit; whether it got there (the
/// connection is then at a request's end, and can carry another).
fn stream_output(a: Attachment, out: &mut UnixStream) -> bool {
    let send = |out: &mut UnixStream, c: &Chunk| match c {
        Chunk::Out(d) => write_frame(out, FRAME_STDOUT, d),
        Chunk::Err(d) => write_frame(out, FRAME_STDERR, d),
        Chunk::Exit(r) => write_json(out, &Response::Exit(r.clone())),
    };
    for (kind, data) in [(FRAME_STDOUT, &a.stdout), (FRAME_STDERR, &a.stderr)] {
        for piece in data.chunks(dsec_common::channel::CHUNK) {
            if write_frame(out, kind, piece).is_err() {
                return false;
            }
        }
    }
    if let Some(exit) = a.exit {
        return write_json(out, &Response::Exit(exit)).is_ok();
    }
    let Some(feed) = a.feed else { return false };
    loop {
        match feed.recv_timeout(Duration::from_secs(1)) {
            Ok(c) => {
                let last = matches!(c, Chunk::Exit(_));
                let sent = send(out, &c).is_ok();
                if !sent || last {
                    return sent && last;
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if peer_gone(out) {
                    return false;
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                let _ = write_json(
                    out,
                    &Response::error(
                        ErrorCode::ResourceExhausted,
                        "this client read the output too slowly and was detached; attach again",
                    ),
                );
                return false;
            }
        }
    }
}

fn peer_gone(s: &UnixStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: s.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no wait.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}
