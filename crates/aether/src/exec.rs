//! Running one command: environment, cwd, stdin, bounded stdout/stderr capture, timeout
//! (the whole process group is killed), exit status.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dsec_common::api::ExecResult;
use dsec_common::channel::ExecSpec;

use crate::children::Table;

pub type Env = BTreeMap<String, String>;

/// How long to wait for output pipes after the command exits, for when a background
/// process it started keeps them open.
const PIPE_GRACE: Duration = Duration::from_millis(200);

/// The environment aether was started with (the image's and the sandbox's), which every
/// command inherits before its own variables.
pub fn base_env() -> Env {
    with_defaults(std::env::vars().collect())
}

/// `env` with a `PATH` and a `HOME` if it names none.
pub fn with_defaults(mut env: Env) -> Env {
    env.entry("PATH".into())
        .or_insert_with(|| "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    env.entry("HOME".into()).or_insert_with(|| "/root".into());
    env
}

/// Starts a helper thread; fails (instead of panicking) when the pids limit is reached.
pub fn spawn(f: impl FnOnce() + Send + 'static) -> Result<(), String> {
    std::thread::Builder::new()
        .spawn(f)
        .map(|_| ())
        .map_err(|e| format!("the sandbox is at its process limit (pids_limit): {e}"))
}

/// The command for `spec` (argv, environment, cwd, user), not yet started.
pub fn command(spec: &ExecSpec, base: &Env) -> Result<Command, String> {
    let Some(program) = spec.argv.first() else {
        return Err("empty argv".into());
    };
    let path = spec.env.get("PATH").or(base.get("PATH"));
    let mut cmd = match resolve(program, path).filter(|_| spec.user.is_none()) {
        Some(p) => {
            let mut c = Command::new(p);
            c.arg0(program);
            c
        }
        None => Command::new(program),
    };
    cmd.args(&spec.argv[1..]).env_clear().envs(base);
    if let Some(user) = &spec.user {
        let u = crate::user::lookup(user)?;
        cmd.uid(u.uid).gid(u.gid);
        cmd.env("HOME", &u.home)
            .env("USER", &u.name)
            .env("LOGNAME", &u.name);
    }
    cmd.envs(&spec.env);
    let cwd = spec.cwd.as_deref().unwrap_or("/");
    // Naming aether's own cwd again would keep the standard library from using
    // posix_spawn (the static libc has no posix_spawn_file_actions_addchdir_np).
    if cwd != "/" || !at_root() {
        cmd.current_dir(cwd);
    }
    Ok(cmd)
}

/// Says why a command could not start, in terms of the request.
pub fn spawn_error(spec: &ExecSpec, e: std::io::Error) -> String {
    let program = spec.argv.first().map(String::as_str).unwrap_or("");
    let cwd = spec.cwd.as_deref().unwrap_or("/");
    match e.kind() {
        std::io::ErrorKind::NotFound => format!(
            "cannot run {program:?} in {cwd:?}: the program or the working directory does not exist"
        ),
        std::io::ErrorKind::PermissionDenied => {
            format!("cannot run {program:?} in {cwd:?}: permission denied")
        }
        _ => format!("cannot run {program:?}: {e}"),
    }
}

/// Whether aether's own working directory is `/` (it never changes it; asked once).
fn at_root() -> bool {
    static AT_ROOT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AT_ROOT.get_or_init(|| std::env::current_dir().is_ok_and(|d| d == std::path::Path::new("/")))
}

/// One output pipe of a command, read until end of file into at most `cap` bytes.
struct Output {
    pipe: Option<OwnedFd>,
    data: Vec<u8>,
    cap: usize,
    truncated: bool,
}

impl Output {
    fn new(pipe: Option<OwnedFd>, cap: u64) -> Output {
        Output {
            pipe,
            data: Vec::new(),
            cap: cap as usize,
            truncated: false,
        }
    }

    /// Reads what the pipe has now; closes it at end of file or on an error.
    fn drain(&mut self) {
        let Some(fd) = &self.pipe else { return };
        let mut buf = [0u8; 64 * 1024];
        loop {
            // SAFETY: reading into a buffer we own from a pipe we own.
            let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n > 0 {
                let n = n as usize;
                let room = self.cap.saturating_sub(self.data.len());
                if n > room {
                    self.truncated = true;
                }
                self.data.extend_from_slice(&buf[..n.min(room)]);
                continue;
            }
            let e = std::io::Error::last_os_error();
            if n < 0 && e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            if n < 0 && e.kind() == std::io::ErrorKind::WouldBlock {
                return;
            }
            self.pipe = None;
            return;
        }
    }
}

/// The command's stdin and what is left to write to it.
struct Input {
    pipe: OwnedFd,
    data: Vec<u8>,
    at: usize,
}

impl Input {
    /// Writes what the pipe takes now; `false` once everything is written (or the
    /// command closed its end), when the pipe should be closed.
    fn feed(&mut self) -> bool {
        while self.at < self.data.len() {
            let rest = &self.data[self.at..];
            // SAFETY: writing from a buffer we own to a pipe we own.
            let n = unsafe { libc::write(self.pipe.as_raw_fd(), rest.as_ptr().cast(), rest.len()) };
            if n >= 0 {
                self.at += n as usize;
                continue;
            }
            match std::io::Error::last_os_error().kind() {
                std::io::ErrorKind::Interrupted => continue,
                std::io::ErrorKind::WouldBlock => return true,
                _ => return false,
            }
        }
        false
    }
}

fn nonblocking(fd: &impl AsRawFd) {
    // SAFETY: fcntl on a descriptor we own.
    unsafe {
        let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
}

/// A pidfd for `pid` (a child not yet waited for), readable once it exits; `None` on
/// kernels without pidfd_open (before 5.3), where the exit is polled instead.
fn pidfd(pid: u32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    // SAFETY: a descriptor the kernel just gave us, owned from here on.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `program` as the path `execvp` would run, searching `path` (the command's `PATH`), when
/// it is found in an absolute directory: spawning an explicit path lets the standard library
/// use `posix_spawn` (a vfork, no copy of aether's page tables) rather than fork. `None`
/// leaves the search to exec (a relative `PATH` entry depends on the command's cwd).
fn resolve(program: &str, path: Option<&String>) -> Option<std::path::PathBuf> {
    if program.contains('/') || program.is_empty() {
        return None;
    }
    for dir in path?.split(':') {
        if !dir.starts_with('/') {
            return None;
        }
        let p = std::path::Path::new(dir).join(program);
        if let Ok(m) = std::fs::metadata(&p)
            && m.is_file()
            && m.permissions().mode() & 0o111 != 0
        {
            return Some(p);
        }
    }
    None
}

/// Runs one command to its end in the calling thread: its pipes and its exit (a pidfd)
/// are waited for together with poll(2), so a command costs no helper thread.
pub fn run(spec: ExecSpec, table: &Table, base: &Env) -> Result<ExecResult, String> {
    let mut cmd = command(&spec, base)?;
    cmd.stdin(if spec.stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .process_group(0);
    let started = Instant::now();
    let mut child = {
        let mut managed = table.lock();
        let child = cmd.spawn().map_err(|e| spawn_error(&spec, e))?;
        table.register(&mut managed, child.id());
        child
    };
    let pid = child.id();
    let kill_group = || unsafe {
        // SAFETY: signalling the process group we created for this command.
        libc::kill(-(pid as i32), libc::SIGKILL)
    };
    let mut out = Output::new(
        child.stdout.take().map(OwnedFd::from),
        spec.max_output_bytes,
    );
    let mut err = Output::new(
        child.stderr.take().map(OwnedFd::from),
        spec.max_output_bytes,
    );
    let mut input = child.stdin.take().map(|i| Input {
        pipe: OwnedFd::from(i),
        data: spec.stdin.clone().unwrap_or_default().into_bytes(),
        at: 0,
    });
    for fd in [&out.pipe, &err.pipe].into_iter().flatten() {
        nonblocking(fd);
    }
    if let Some(i) = &input {
        nonblocking(&i.pipe);
    }
    let exited_fd = pidfd(pid);
    let deadline = spec
        .timeout_ms
        .map(|ms| started + Duration::from_millis(ms));
    let mut timed_out = false;
    let mut status = None;
    // Once the command has exited: how long its pipes may stay open (a background child
    // of its may hold them).
    let mut grace: Option<Instant> = None;
    loop {
        if status.is_none() {
            match child.try_wait() {
                Ok(Some(s)) => {
                    status = Some(Ok(s));
                    grace = Some(Instant::now() + PIPE_GRACE);
                }
                Ok(None) => {}
                Err(e) => {
                    status = Some(Err(e));
                    grace = Some(Instant::now());
                }
            }
        }
        if status.is_some() && out.pipe.is_none() && err.pipe.is_none() {
            break;
        }
        let now = Instant::now();
        let until = match (status.is_some(), grace, deadline) {
            (true, Some(g), _) => g,
            (false, _, Some(d)) => d,
            _ => now + Duration::from_secs(3600),
        };
        if now >= until {
            if status.is_some() {
                break;
            }
            timed_out = true;
            kill_group();
            status = Some(child.wait());
            grace = Some(Instant::now() + PIPE_GRACE);
            continue;
        }
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(4);
        let watch = |fds: &mut Vec<libc::pollfd>, fd: i32, events: i16| {
            fds.push(libc::pollfd {
                fd,
                events,
                revents: 0,
            })
        };
        for o in [&out, &err] {
            if let Some(p) = &o.pipe {
                watch(&mut fds, p.as_raw_fd(), libc::POLLIN);
            }
        }
        if let Some(i) = &input {
            watch(&mut fds, i.pipe.as_raw_fd(), libc::POLLOUT);
        }
        // Without a pidfd the exit is looked for every few milliseconds.
        let mut wait_ms = (until - now).as_millis().clamp(1, i32::MAX as u128) as i32;
        match (&exited_fd, status.is_none()) {
            (Some(p), true) => watch(&mut fds, p.as_raw_fd(), libc::POLLIN),
            (None, true) => wait_ms = wait_ms.min(5),
            _ => {}
        }
        // SAFETY: fds is a valid array of pollfd of the length given.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait_ms) };
        if rc < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            let e = std::io::Error::last_os_error();
            // Not left running, nor a zombie the reaper must leave to us.
            kill_group();
            let _ = child.wait();
            table.release(pid);
            return Err(format!("waiting for the command: {e}"));
        }
        out.drain();
        err.drain();
        if let Some(i) = &mut input
            && !i.feed()
        {
            input = None;
        }
    }
    table.release(pid);
    let status = status
        .unwrap_or_else(|| child.wait())
        .map_err(|e| format!("waiting for the command: {e}"))?;
    if timed_out {
        // Whatever the command left behind in its group goes too. Members may still be
        // forking while the signal goes out (a fork bomb), so repeat until none is left.
        for _ in 0..500 {
            if kill_group() != 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let signal = status.signal();
    Ok(ExecResult {
        stdout: String::from_utf8_lossy(&out.data).into_owned(),
        stderr: String::from_utf8_lossy(&err.data).into_owned(),
        exit_code: status.code().unwrap_or_else(|| 128 + signal.unwrap_or(0)),
        signal,
        timed_out,
        oom_killed: false,
        stdout_truncated: out.truncated,
        stderr_truncated: err.truncated,
        duration_ms: started.elapsed().as_millis() as u64,
    })
}
