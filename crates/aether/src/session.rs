//! Persistent shell sessions. Each session is a shell under its own chronus process; a
//! command is sent to the shell as a quoted string it `eval`s, so `cd`, `export` and
//! functions persist, and a syntax error cannot swallow what follows. After each command
//! the shell prints a marker with a per-session random nonce on stdout (with the exit
//! status) and on stderr; the output before the markers is the command's. Output is kept
//! in aether's memory only, never in the sandbox's filesystem.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dsec_common::ErrorCode;
use dsec_common::api::{SessionInfo, SessionResult};

use crate::children::Table;
use crate::exec::{self, Env};

type SessError = (ErrorCode, String);

/// Commands kept per session for later retrieval.
const KEEP_COMMANDS: usize = 64;
/// How long a timed-out command's shell gets to come back after its processes are killed.
const KILL_GRACE: Duration = Duration::from_secs(2);

enum Piece {
    Out(Vec<u8>),
    Err(Vec<u8>),
}

struct Shell {
    pid: u32,
    stdin: ChildStdin,
    rx: Receiver<Piece>,
    exited: Arc<Mutex<Option<i32>>>,
}

impl Shell {
    /// The shell's exit code once chronus has exited, waiting at most `within`.
    fn wait_exit(&self, within: Duration) -> Option<i32> {
        let deadline = Instant::now() + within;
        loop {
            let code = *self.exited.lock().unwrap_or_else(|p| p.into_inner());
            if code.is_some() || Instant::now() >= deadline {
                return code;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

pub struct Session {
    id: String,
    shell: String,
    cwd: Option<String>,
    env: Env,
    max_output: usize,
    current: Mutex<Option<Shell>>,
    /// The current chronus pid, readable while a command holds `current`.
    pid: AtomicU32,
    ended: std::sync::atomic::AtomicBool,
    run_lock: Mutex<()>,
    commands: Mutex<BTreeMap<u64, Arc<Mutex<SessionResult>>>>,
    next_cmd: AtomicU64,
}

#[derive(Default)]
pub struct Sessions {
    map: Mutex<BTreeMap<String, Arc<Session>>>,
    next: AtomicU64,
}

fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn nonce() -> String {
    let mut b = [0u8; 12];
    dsec_common::id::fill_random(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Output of one stream of a running command: text before the end marker, capped.
struct Stream {
    marker: Vec<u8>,
    pending: Vec<u8>,
    done: bool,
    /// After the marker on stdout: the exit status digits up to the closing NUL.
    tail: Vec<u8>,
}

impl Stream {
    fn new(marker: Vec<u8>) -> Stream {
        Stream {
            marker,
            pending: Vec::new(),
            done: false,
            tail: Vec::new(),
        }
    }

    /// Takes bytes in; returns the part that is surely the command's output.
    fn feed(&mut self, d: &[u8]) -> Vec<u8> {
        if self.done {
            self.tail.extend_from_slice(d);
            return Vec::new();
        }
        self.pending.extend_from_slice(d);
        if let Some(pos) = find(&self.pending, &self.marker) {
            self.done = true;
            self.tail = self.pending[pos + self.marker.len()..].to_vec();
            let out = self.pending[..pos].to_vec();
            self.pending.clear();
            return out;
        }
        // Hold back only a tail that could be the start of the marker.
        let keep = (1..self.marker.len().min(self.pending.len() + 1))
            .rev()
            .find(|&k| self.pending.ends_with(&self.marker[..k]))
            .unwrap_or(0);
        let cut = self.pending.len() - keep;
        self.pending.drain(..cut).collect()
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn append(buf: &mut String, truncated: &mut bool, cap: usize, d: &[u8]) {
    let room = cap.saturating_sub(buf.len());
    if d.len() > room {
        *truncated = true;
    }
    buf.push_str(&String::from_utf8_lossy(&d[..d.len().min(room)]));
}

impl Session {
    fn spawn_shell(&self, table: &Arc<Table>) -> Result<Shell, SessError> {
        let me = std::env::current_exe().unwrap_or_else(|_| "/proc/self/exe".into());
        let mut cmd = Command::new("/proc/self/exe");
        cmd.arg0(me)
            .args(["chronus", &self.shell])
            .env_clear()
            .envs(&self.env)
            .current_dir(self.cwd.as_deref().unwrap_or("/"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child: Child = {
            let mut managed = table.lock();
            let c = cmd.spawn().map_err(|e| {
                (
                    ErrorCode::FailedPrecondition,
                    format!("cannot start the session's shell: {e}"),
                )
            })?;
            table.register(&mut managed, c.id());
            c
        };
        let pid = child.id();
        self.pid.store(pid, Ordering::SeqCst);
        let (tx, rx) = mpsc::channel();
        let stdin = child.stdin.take();
        let readers: [(Option<Box<dyn Read + Send>>, bool); 2] = [
            (child.stdout.take().map(|s| Box::new(s) as _), true),
            (child.stderr.take().map(|s| Box::new(s) as _), false),
        ];
        for (r, is_out) in readers {
            let (Some(mut r), tx) = (r, tx.clone()) else {
                continue;
            };
            let _ = exec::spawn(move || {
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n) = r.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    let d = buf[..n].to_vec();
                    let piece = if is_out { Piece::Out(d) } else { Piece::Err(d) };
                    if tx.send(piece).is_err() {
                        break;
                    }
                }
            });
        }
        let exited = Arc::new(Mutex::new(None));
        let (ex2, t2) = (exited.clone(), table.clone());
        let _ = exec::spawn(move || {
            let code = child.wait().ok().and_then(|s| s.code()).unwrap_or(-1);
            t2.release(pid);
            *ex2.lock().unwrap_or_else(|p| p.into_inner()) = Some(code);
        });
        let stdin = stdin.ok_or_else(|| (ErrorCode::Internal, "no shell stdin".to_string()))?;
        Ok(Shell {
            pid,
            stdin,
            rx,
            exited,
        })
    }

    fn info(&self) -> SessionInfo {
        SessionInfo {
            session_id: self.id.clone(),
            pid: self.pid.load(Ordering::SeqCst),
            shell: self.shell.clone(),
            busy: self.run_lock.try_lock().is_err(),
            commands: self.next_cmd.load(Ordering::SeqCst),
        }
    }

    /// Ends the session, also while a command runs: chronus is signalled first (through
    /// the pid, without the shell's lock), so the running command sees its shell go.
    fn end(&self) {
        self.ended.store(true, Ordering::SeqCst);
        let pid = self.pid.load(Ordering::SeqCst);
        if pid != 0 {
            // SAFETY: SIGTERM to our own chronus child: it kills its tree and exits.
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        }
        if let Some(sh) = self
            .current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            sh.wait_exit(Duration::from_secs(5));
        }
    }

    /// Runs one command in the shell; fills `rec` as output arrives.
    fn run(&self, table: &Arc<Table>, cmd: &str, timeout: Duration, rec: &Mutex<SessionResult>) {
        let _g = self.run_lock.lock().unwrap_or_else(|p| p.into_inner());
        let started = Instant::now();
        let set = |f: &mut dyn FnMut(&mut SessionResult)| {
            f(&mut rec.lock().unwrap_or_else(|p| p.into_inner()))
        };
        let mut cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        let Some(sh) = cur.as_mut() else {
            set(&mut |r| {
                r.state = "done".into();
                r.exit_code = None;
                r.stderr = "the session has ended; create a new session".into();
            });
            return;
        };
        let n = nonce();
        let out_marker = format!("\0DSEC{n}:").into_bytes();
        let err_marker = format!("\0DSEC{n}\0").into_bytes();
        let script = format!(
            "__dsec_c={}\neval \"$__dsec_c\" </dev/null\n__dsec_s=$?; printf '\\000DSEC%s:%d\\000' {n} \"$__dsec_s\"; printf '\\000DSEC%s\\000' {n} >&2\n",
            quote(cmd)
        );
        if sh.stdin.write_all(script.as_bytes()).is_err() {
            let code = *sh.exited.lock().unwrap_or_else(|p| p.into_inner());
            set(&mut |r| {
                r.state = "done".into();
                r.exit_code = code;
                r.stderr = "the session's shell has exited; create a new session".into();
            });
            return;
        }
        let (mut out, mut err) = (Stream::new(out_marker), Stream::new(err_marker));
        let mut deadline = started + timeout;
        let mut timed_out = false;
        let mut shell_gone = false;
        let max = self.max_output;
        loop {
            let status_done = out.done && out.tail.contains(&0);
            if status_done && err.done {
                break;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match sh.rx.recv_timeout(left) {
                Ok(Piece::Out(d)) => {
                    let d = out.feed(&d);
                    set(&mut |r| append(&mut r.stdout, &mut r.stdout_truncated, max, &d));
                }
                Ok(Piece::Err(d)) => {
                    let d = err.feed(&d);
                    set(&mut |r| append(&mut r.stderr, &mut r.stderr_truncated, max, &d));
                }
                Err(RecvTimeoutError::Timeout) if !timed_out => {
                    timed_out = true;
                    // SAFETY: SIGUSR1 to our chronus child: kill all but the shell.
                    unsafe { libc::kill(sh.pid as i32, libc::SIGUSR1) };
                    deadline = Instant::now() + KILL_GRACE;
                }
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => {
                    shell_gone = true;
                    break;
                }
            }
        }
        let status = out
            .tail
            .split(|&b| b == 0)
            .next()
            .and_then(|s| std::str::from_utf8(s).ok())
            .and_then(|s| s.parse::<i32>().ok());
        let finished = out.done && err.done && status.is_some();
        let mut restarted = false;
        if !finished {
            if shell_gone {
                sh.wait_exit(Duration::from_secs(2));
            } else {
                // The shell itself is stuck (a builtin loop): start it over.
                // SAFETY: SIGTERM to our chronus child.
                unsafe { libc::kill(sh.pid as i32, libc::SIGTERM) };
            }
        }
        let code = if finished {
            status
        } else if shell_gone {
            *sh.exited.lock().unwrap_or_else(|p| p.into_inner())
        } else {
            Some(137)
        };
        if !finished {
            let old = cur.take();
            drop(old);
            if !shell_gone && !self.ended.load(Ordering::SeqCst) {
                match self.spawn_shell(table) {
                    Ok(s) => {
                        *cur = Some(s);
                        restarted = true;
                    }
                    Err(e) => tracing_free_log(&e.1),
                }
            }
        }
        set(&mut |r| {
            r.state = "done".into();
            r.exit_code = code;
            r.timed_out = timed_out;
            r.session_restarted = restarted;
            r.duration_ms = started.elapsed().as_millis() as u64;
        });
    }
}

fn tracing_free_log(msg: &str) {
    eprintln!("dsec-aether: {msg}");
}

/// The shell a session runs: bash where the image has it, else sh.
fn pick_shell() -> String {
    for s in ["/bin/bash", "/usr/bin/bash", "/bin/sh"] {
        if std::fs::metadata(s).is_ok_and(|m| m.is_file()) {
            return s.to_string();
        }
    }
    "/bin/sh".into()
}

impl Sessions {
    pub fn create(
        &self,
        table: &Arc<Table>,
        base: &Env,
        cwd: Option<String>,
        env: BTreeMap<String, String>,
        max_output: u64,
    ) -> Result<SessionInfo, SessError> {
        if self.map.lock().unwrap_or_else(|p| p.into_inner()).len() >= 256 {
            return Err((
                ErrorCode::ResourceExhausted,
                "this sandbox already has 256 sessions; end some first".into(),
            ));
        }
        let mut full_env = base.clone();
        full_env.extend(env);
        let id = format!("s{}", self.next.fetch_add(1, Ordering::SeqCst) + 1);
        let s = Arc::new(Session {
            id: id.clone(),
            shell: pick_shell(),
            cwd,
            env: full_env,
            max_output: max_output as usize,
            current: Mutex::new(None),
            pid: AtomicU32::new(0),
            ended: std::sync::atomic::AtomicBool::new(false),
            run_lock: Mutex::new(()),
            commands: Mutex::new(BTreeMap::new()),
            next_cmd: AtomicU64::new(0),
        });
        let sh = s.spawn_shell(table)?;
        *s.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(sh);
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, s.clone());
        Ok(s.info())
    }

    fn get(&self, id: &str) -> Result<Arc<Session>, SessError> {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
            .ok_or_else(|| {
                (
                    ErrorCode::NotFound,
                    format!("no session {id:?} in this sandbox (it may have been killed)"),
                )
            })
    }

    pub fn list(&self) -> Vec<SessionInfo> {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.values().map(|s| s.info()).collect()
    }

    pub fn kill(&self, id: &str) -> Result<(), SessError> {
        let s = self.get(id)?;
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        s.end();
        Ok(())
    }

    /// Runs `cmd`; waits for it unless `background`.
    pub fn run(
        &self,
        table: &Arc<Table>,
        id: &str,
        cmd: String,
        timeout: Duration,
        background: bool,
    ) -> Result<SessionResult, SessError> {
        let s = self.get(id)?;
        let cid = s.next_cmd.fetch_add(1, Ordering::SeqCst) + 1;
        let rec = Arc::new(Mutex::new(SessionResult {
            command_id: cid,
            state: "running".into(),
            ..Default::default()
        }));
        {
            let mut cmds = s.commands.lock().unwrap_or_else(|p| p.into_inner());
            cmds.insert(cid, rec.clone());
            while cmds.len() > KEEP_COMMANDS {
                cmds.pop_first();
            }
        }
        if background {
            let (s2, r2, t2) = (s.clone(), rec.clone(), table.clone());
            exec::spawn(move || s2.run(&t2, &cmd, timeout, &r2))
                .map_err(|e| (ErrorCode::ResourceExhausted, e))?;
        } else {
            s.run(table, &cmd, timeout, &rec);
        }
        Ok(rec.lock().unwrap_or_else(|p| p.into_inner()).clone())
    }

    pub fn command(&self, id: &str, cid: u64) -> Result<SessionResult, SessError> {
        let s = self.get(id)?;
        let cmds = s.commands.lock().unwrap_or_else(|p| p.into_inner());
        cmds.get(&cid)
            .map(|r| r.lock().unwrap_or_else(|p| p.into_inner()).clone())
            .ok_or_else(|| {
                (
                    ErrorCode::NotFound,
                    format!(
                        "session {id} has no command {cid} (only the last {KEEP_COMMANDS} are kept)"
                    ),
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_split_output_even_across_chunks() {
        let mut s = Stream::new(b"\0DSECab:".to_vec());
        let mut got = s.feed(b"hello\0DS");
        assert_eq!(
            got, b"hello",
            "text that cannot start the marker is released at once"
        );
        got.extend(s.feed(b"ECab:0\0"));
        assert_eq!(got, b"hello");
        assert!(s.done);
        assert_eq!(s.tail, b"0\0");
        assert_eq!(quote("it's"), r"'it'\''s'");
    }
}
