//! Running one command: environment, cwd, stdin, bounded stdout/stderr capture, timeout
//! (the whole process group is killed), exit status.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, Stdio};
use std::sync::{Arc, mpsc};
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

#[derive(Default)]
struct Capture {
    data: Vec<u8>,
    truncated: bool,
}

/// Starts a helper thread; fails (instead of panicking) when the pids limit is reached.
pub fn spawn(f: impl FnOnce() + Send + 'static) -> Result<(), String> {
    std::thread::Builder::new()
        .spawn(f)
        .map(|_| ())
        .map_err(|e| format!("the sandbox is at its process limit (pids_limit): {e}"))
}

/// A thread that will read one pipe, started before the command so that a sandbox at its
/// pids limit fails the request before anything runs; it gets its pipe through the sender.
type Reader = Box<dyn Read + Send>;

/// What one pipe's reader has so far, and whether it reached end of file. Shared, so a
/// command whose background child keeps the pipe open still returns what it printed.
#[derive(Default)]
struct Captured {
    out: std::sync::Mutex<Capture>,
    eof: std::sync::Condvar,
    done: std::sync::atomic::AtomicBool,
}

impl Captured {
    fn lock(&self) -> std::sync::MutexGuard<'_, Capture> {
        self.out.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until end of file or `deadline`, then takes what was read.
    fn take(&self, deadline: Instant) -> Capture {
        let mut g = self.lock();
        while !self.done.load(std::sync::atomic::Ordering::SeqCst) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            g = match self.eof.wait_timeout(g, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        std::mem::take(&mut *g)
    }
}

fn capture(cap: u64) -> Result<(mpsc::Sender<Reader>, Arc<Captured>), String> {
    let (pipe_tx, pipe_rx) = mpsc::channel::<Reader>();
    let shared = Arc::new(Captured::default());
    let out = shared.clone();
    spawn(move || {
        let Ok(mut r) = pipe_rx.recv() else { return };
        let mut buf = [0u8; 64 * 1024];
        loop {
            match r.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    let mut o = out.lock();
                    let room = (cap as usize).saturating_sub(o.data.len());
                    if n > room {
                        o.truncated = true;
                    }
                    o.data.extend_from_slice(&buf[..n.min(room)]);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        let _g = out.lock();
        out.done.store(true, std::sync::atomic::Ordering::SeqCst);
        out.eof.notify_all();
    })?;
    Ok((pipe_tx, shared))
}

/// The command for `spec` (argv, environment, cwd, user), not yet started.
pub fn command(spec: &ExecSpec, base: &Env) -> Result<Command, String> {
    let Some(program) = spec.argv.first() else {
        return Err("empty argv".into());
    };
    let mut cmd = Command::new(program);
    cmd.args(&spec.argv[1..]).env_clear().envs(base);
    if let Some(user) = &spec.user {
        let u = crate::user::lookup(user)?;
        cmd.uid(u.uid).gid(u.gid);
        cmd.env("HOME", &u.home)
            .env("USER", &u.name)
            .env("LOGNAME", &u.name);
    }
    cmd.envs(&spec.env);
    cmd.current_dir(spec.cwd.as_deref().unwrap_or("/"));
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
    // Every helper thread first: once the command runs, it may use up the pids limit.
    let (out_pipe, out_rx) = capture(spec.max_output_bytes)?;
    let (err_pipe, err_rx) = capture(spec.max_output_bytes)?;
    let (stdin_tx, stdin_rx) = mpsc::channel::<std::process::ChildStdin>();
    if let Some(data) = spec.stdin.clone() {
        spawn(move || {
            if let Ok(mut stdin) = stdin_rx.recv() {
                let _ = stdin.write_all(data.as_bytes());
            }
        })?;
    }
    let (child_tx, child_rx) = mpsc::channel::<std::process::Child>();
    let (done_tx, done_rx) = mpsc::channel();
    spawn(move || {
        if let Ok(mut child) = child_rx.recv() {
            let _ = done_tx.send(child.wait());
        }
    })?;
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
        libc::kill(-(pid as i32), libc::SIGKILL);
    };
    if let Some(o) = child.stdout.take() {
        let _ = out_pipe.send(Box::new(o));
    }
    if let Some(e) = child.stderr.take() {
        let _ = err_pipe.send(Box::new(e));
    }
    if let Some(i) = child.stdin.take() {
        let _ = stdin_tx.send(i);
    }
    drop((out_pipe, err_pipe, stdin_tx));
    let _ = child_tx.send(child);
    let mut timed_out = false;
    let status = match spec.timeout_ms {
        Some(ms) => match done_rx.recv_timeout(Duration::from_millis(ms)) {
            Ok(s) => s,
            Err(_) => {
                timed_out = true;
                kill_group();
                done_rx.recv().map_err(|e| e.to_string())?
            }
        },
        None => done_rx.recv().map_err(|e| e.to_string())?,
    };
    table.release(pid);
    let status = status.map_err(|e| format!("waiting for the command: {e}"))?;
    if timed_out {
        // Whatever the command left behind in its group goes too. Members may still be
        // forking while the signal goes out (a fork bomb), so repeat until none is left.
        for _ in 0..500 {
            // SAFETY: as in kill_group.
            if unsafe { libc::kill(-(pid as i32), libc::SIGKILL) } != 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let deadline = Instant::now() + PIPE_GRACE;
    let out = out_rx.take(deadline);
    let err = err_rx.take(deadline);
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
