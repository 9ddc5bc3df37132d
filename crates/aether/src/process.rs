//! Managed processes: started for streaming, in the background or with a terminal, and kept
//! in a table so any connection can attach to their output, write their stdin, signal or
//! resize them. Each keeps its last `max_output_bytes` per stream for late attachers.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::Stdio;
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dsec_common::ErrorCode;
use dsec_common::api::{ExecResult, ProcessInfo};
use dsec_common::channel::{PtySize, StartSpec};

use crate::children::Table;
use crate::exec::{self, Env};

/// Finished processes kept for `processes` and late attach.
const KEEP_FINISHED: usize = 64;
/// Chunks queued for one attached connection before it counts as stalled.
const SUB_QUEUE: usize = 256;
/// How long a stalled attached connection may hold the process's output back.
const SUB_STALL: Duration = Duration::from_secs(10);
/// Time allowed for output pipes to drain after the process exits.
const PIPE_GRACE: Duration = Duration::from_millis(200);

#[derive(Clone, Debug)]
pub enum Chunk {
    Out(Arc<Vec<u8>>),
    Err(Arc<Vec<u8>>),
    Exit(ExecResult),
}

struct Ring {
    buf: VecDeque<u8>,
    cap: usize,
    dropped: bool,
}

impl Ring {
    fn push(&mut self, data: &[u8]) {
        self.buf.extend(data);
        if self.buf.len() > self.cap {
            let extra = self.buf.len() - self.cap;
            self.buf.drain(..extra);
            self.dropped = true;
        }
    }
}

struct State {
    out: Ring,
    err: Ring,
    exit: Option<ExecResult>,
    subs: Vec<(u64, SyncSender<Chunk>)>,
    next_sub: u64,
}

pub struct Proc {
    pub pid: u32,
    argv: Vec<String>,
    tag: Option<String>,
    cwd: Option<String>,
    started_at_ms: u64,
    started: Instant,
    stdin: Mutex<Option<File>>,
    /// The terminal's master side, for resizing.
    master: Option<OwnedFd>,
    state: Mutex<State>,
}

/// What a new attachment sees: the kept output, and the exit or a live feed.
pub struct Attachment {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub exit: Option<ExecResult>,
    pub feed: Option<Receiver<Chunk>>,
}

impl Proc {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends output and hands it to every attached connection. A connection that does
    /// not keep up for [`SUB_STALL`] is dropped (it sees its feed end without an exit).
    fn publish(&self, chunk: Chunk) {
        let subs = {
            let mut st = self.lock();
            match &chunk {
                Chunk::Out(d) => st.out.push(d),
                Chunk::Err(d) => st.err.push(d),
                Chunk::Exit(r) => st.exit = Some(r.clone()),
            }
            st.subs.clone()
        };
        let mut dead = Vec::new();
        for (id, s) in &subs {
            let deadline = Instant::now() + SUB_STALL;
            let mut c = chunk.clone();
            loop {
                match s.try_send(c) {
                    Ok(()) => break,
                    Err(TrySendError::Full(back)) if Instant::now() < deadline => {
                        c = back;
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Err(_) => {
                        dead.push(*id);
                        break;
                    }
                }
            }
        }
        let mut st = self.lock();
        if matches!(chunk, Chunk::Exit(_)) {
            st.subs.clear();
        } else if !dead.is_empty() {
            st.subs.retain(|(id, _)| !dead.contains(id));
        }
    }

    pub fn attach(&self) -> Attachment {
        let mut st = self.lock();
        let stdout = st.out.buf.iter().copied().collect();
        let stderr = st.err.buf.iter().copied().collect();
        if let Some(exit) = st.exit.clone() {
            return Attachment {
                stdout,
                stderr,
                exit: Some(exit),
                feed: None,
            };
        }
        let (tx, rx) = mpsc::sync_channel(SUB_QUEUE);
        st.next_sub += 1;
        let id = st.next_sub;
        st.subs.push((id, tx));
        Attachment {
            stdout,
            stderr,
            exit: None,
            feed: Some(rx),
        }
    }

    pub fn running(&self) -> bool {
        self.lock().exit.is_none()
    }

    pub fn info(&self) -> ProcessInfo {
        let st = self.lock();
        ProcessInfo {
            pid: self.pid,
            argv: self.argv.clone(),
            tag: self.tag.clone(),
            cwd: self.cwd.clone(),
            pty: self.master.is_some(),
            running: st.exit.is_none(),
            exit_code: st.exit.as_ref().map(|e| e.exit_code),
            started_at_ms: self.started_at_ms,
        }
    }

    pub fn write_stdin(&self, data: &[u8]) -> Result<(), (ErrorCode, String)> {
        let mut g = self.stdin.lock().unwrap_or_else(|p| p.into_inner());
        let f = g.as_mut().ok_or_else(|| {
            (
                ErrorCode::FailedPrecondition,
                format!("the stdin of process {} is closed", self.pid),
            )
        })?;
        f.write_all(data).map_err(|e| {
            (
                ErrorCode::FailedPrecondition,
                format!("writing to the stdin of process {}: {e}", self.pid),
            )
        })
    }

    pub fn close_stdin(&self) {
        let mut g = self.stdin.lock().unwrap_or_else(|p| p.into_inner());
        if self.master.is_some() {
            // A terminal has no separate stdin to close: send end-of-file (^D) instead.
            if let Some(f) = g.as_mut() {
                let _ = f.write_all(&[4]);
            }
        } else {
            *g = None;
        }
    }

    /// Signals the process's whole group (it leads one).
    pub fn signal(&self, sig: i32) -> Result<(), (ErrorCode, String)> {
        if !self.running() {
            return Err((
                ErrorCode::FailedPrecondition,
                format!("process {} has already exited", self.pid),
            ));
        }
        // SAFETY: plain kill(2) on the group this process leads.
        if unsafe { libc::kill(-(self.pid as i32), sig) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err((
                ErrorCode::InvalidArgument,
                format!("cannot send signal {sig} to process {}: {e}", self.pid),
            ));
        }
        Ok(())
    }

    pub fn resize(&self, size: PtySize) -> Result<(), (ErrorCode, String)> {
        let m = self.master.as_ref().ok_or_else(|| {
            (
                ErrorCode::InvalidArgument,
                format!(
                    "process {} has no terminal; start it with pty to resize it",
                    self.pid
                ),
            )
        })?;
        let ws = winsize(size);
        // SAFETY: TIOCSWINSZ on a terminal master we own, with a valid winsize.
        if unsafe { libc::ioctl(m.as_raw_fd(), libc::TIOCSWINSZ, &ws) } != 0 {
            return Err((
                ErrorCode::Internal,
                format!("resizing the terminal: {}", std::io::Error::last_os_error()),
            ));
        }
        Ok(())
    }
}

fn winsize(s: PtySize) -> libc::winsize {
    libc::winsize {
        ws_row: s.rows,
        ws_col: s.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

use dsec_common::now_ms;

fn set_cloexec(fd: i32) {
    // SAFETY: fcntl on an fd we own.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
}

fn dup(fd: &OwnedFd) -> Result<OwnedFd, String> {
    fd.try_clone().map_err(|e| format!("dup: {e}"))
}

#[derive(Default)]
pub struct Procs {
    map: Mutex<BTreeMap<u32, Arc<Proc>>>,
}

impl Procs {
    pub fn get(&self, pid: u32) -> Result<Arc<Proc>, (ErrorCode, String)> {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&pid)
            .cloned()
            .ok_or_else(|| {
                (
                    ErrorCode::NotFound,
                    format!(
                        "no process {pid}: only processes started with stream, background or pty can be reached by id"
                    ),
                )
            })
    }

    pub fn list(&self) -> Vec<ProcessInfo> {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.values().map(|p| p.info()).collect()
    }

    fn insert(&self, p: Arc<Proc>) {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.insert(p.pid, p);
        let finished: Vec<(u64, u32)> = map
            .values()
            .filter(|p| !p.running())
            .map(|p| (p.started_at_ms, p.pid))
            .collect();
        if finished.len() > KEEP_FINISHED {
            let mut f = finished;
            f.sort();
            for (_, pid) in &f[..f.len() - KEEP_FINISHED] {
                map.remove(pid);
            }
        }
    }

    /// Starts a managed process and the threads that collect its output and wait for it.
    pub fn start(
        &self,
        spec: StartSpec,
        table: &Arc<Table>,
        base: &Env,
    ) -> Result<Arc<Proc>, String> {
        let mut cmd = exec::command(&spec.exec, base)?;
        let mut master = None;
        let mut readers: Vec<(bool, File)> = Vec::new();
        let stdin_file;
        if let Some(size) = spec.pty {
            let (mut m, mut s) = (0, 0);
            let ws = winsize(size);
            // SAFETY: openpty fills two fds; the name and termios pointers may be null.
            let rc = unsafe {
                libc::openpty(&mut m, &mut s, std::ptr::null_mut(), std::ptr::null(), &ws)
            };
            if rc != 0 {
                return Err(format!(
                    "cannot open a terminal: {}",
                    std::io::Error::last_os_error()
                ));
            }
            set_cloexec(m);
            set_cloexec(s);
            // SAFETY: openpty returned two fresh fds that we now own.
            let (m, s) = unsafe { (OwnedFd::from_raw_fd(m), OwnedFd::from_raw_fd(s)) };
            cmd.stdin(Stdio::from(dup(&s)?))
                .stdout(Stdio::from(dup(&s)?))
                .stderr(Stdio::from(s));
            if !spec.exec.env.contains_key("TERM") {
                cmd.env("TERM", "xterm-256color");
            }
            // SAFETY: setsid and TIOCSCTTY are async-signal-safe; they make the terminal
            // the new session's controlling terminal.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            readers.push((true, File::from(dup(&m)?)));
            stdin_file = Some(File::from(dup(&m)?));
            master = Some(m);
        } else {
            cmd.stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .process_group(0);
            stdin_file = None;
        }
        let mut child = {
            let mut managed = table.lock();
            let child = cmd.spawn().map_err(|e| exec::spawn_error(&spec.exec, e))?;
            table.register(&mut managed, child.id());
            child
        };
        drop(cmd);
        let pid = child.id();
        let stdin = match stdin_file {
            Some(f) => Some(f),
            None => child.stdin.take().map(|s| File::from(OwnedFd::from(s))),
        };
        if let Some(o) = child.stdout.take() {
            readers.push((true, File::from(OwnedFd::from(o))));
        }
        if let Some(e) = child.stderr.take() {
            readers.push((false, File::from(OwnedFd::from(e))));
        }
        let cap = spec.exec.max_output_bytes as usize;
        let ring = || Ring {
            buf: VecDeque::new(),
            cap,
            dropped: false,
        };
        let p = Arc::new(Proc {
            pid,
            argv: spec.exec.argv.clone(),
            tag: spec.tag.clone(),
            cwd: spec.exec.cwd.clone(),
            started_at_ms: now_ms(),
            started: Instant::now(),
            stdin: Mutex::new(stdin),
            master,
            state: Mutex::new(State {
                out: ring(),
                err: ring(),
                exit: None,
                subs: Vec::new(),
                next_sub: 0,
            }),
        });
        if let Some(data) = &spec.exec.stdin {
            let _ = p.write_stdin(data.as_bytes());
            if spec.pty.is_none() {
                p.close_stdin();
            }
        }
        // If a helper thread cannot be made (the pids limit), the process goes: killed,
        // released to the reaper, never listed.
        let kill_group = {
            let table = table.clone();
            move || {
                // SAFETY: signalling the group this process leads.
                unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
                table.release(pid);
            }
        };
        let (drained_tx, drained_rx) = mpsc::channel::<()>();
        let n_readers = readers.len();
        for (is_out, mut f) in readers {
            let (p2, tx) = (p.clone(), drained_tx.clone());
            let started = exec::spawn(move || {
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    match f.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => {
                            let d = Arc::new(buf[..n].to_vec());
                            p2.publish(if is_out { Chunk::Out(d) } else { Chunk::Err(d) });
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        // EIO: the terminal's last user closed it.
                        Err(_) => break,
                    }
                }
                let _ = tx.send(());
            });
            if let Err(e) = started {
                kill_group();
                return Err(e);
            }
        }
        drop(drained_tx);
        let timeout = spec.exec.timeout_ms.map(Duration::from_millis);
        let (p2, table2, kill2) = (p.clone(), table.clone(), kill_group.clone());
        let waiter = exec::spawn(move || {
            let (done_tx, done_rx) = mpsc::channel::<()>();
            let timed_out = Arc::new(std::sync::atomic::AtomicBool::new(false));
            if let Some(t) = timeout {
                let flag = timed_out.clone();
                let _ = exec::spawn(move || {
                    if done_rx.recv_timeout(t).is_err() {
                        flag.store(true, std::sync::atomic::Ordering::SeqCst);
                        // SAFETY: signalling the group this process leads.
                        unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
                    }
                });
            }
            let status = child.wait();
            let _ = done_tx.send(());
            table2.release(pid);
            if timed_out.load(std::sync::atomic::Ordering::SeqCst) {
                kill2();
            }
            let deadline = Instant::now() + PIPE_GRACE;
            for _ in 0..n_readers {
                let left = deadline.saturating_duration_since(Instant::now());
                if drained_rx.recv_timeout(left).is_err() {
                    break;
                }
            }
            let (code, signal) = match status {
                Ok(s) => (
                    s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0)),
                    s.signal(),
                ),
                Err(_) => (-1, None),
            };
            let (so, se) = {
                let st = p2.lock();
                (st.out.dropped, st.err.dropped)
            };
            p2.publish(Chunk::Exit(ExecResult {
                exit_code: code,
                signal,
                timed_out: timed_out.load(std::sync::atomic::Ordering::SeqCst),
                stdout_truncated: so,
                stderr_truncated: se,
                duration_ms: p2.started.elapsed().as_millis() as u64,
                ..Default::default()
            }));
            // Drop the terminal's stdin so the master closes once nobody holds it.
            *p2.stdin.lock().unwrap_or_else(|p| p.into_inner()) = None;
        });
        if let Err(e) = waiter {
            kill_group();
            return Err(e);
        }
        self.insert(p.clone());
        Ok(p)
    }
}
