//! A QMP client (QEMU's JSON control protocol on the VM's `vm.qmp` socket): one command
//! at a time, events skipped, every wait bounded.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use dsec_common::{IoContext, IoFailure};
use serde_json::{Value, json};

/// What goes wrong talking QMP to a VM's QEMU.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("QEMU closed the QMP connection")]
    Closed,
    #[error("QMP sent {line:?}: {source}")]
    Malformed {
        line: String,
        source: serde_json::Error,
    },
    /// QEMU answered a command with an error: its class and description.
    #[error("QMP {cmd}: {desc}")]
    Command {
        cmd: String,
        class: String,
        desc: String,
    },
    #[error("QMP {cmd}: no room for the descriptor")]
    NoRoom { cmd: String },
    /// A wait on QEMU ran out of time: what was waited for.
    #[error("{what} took over {secs} s")]
    Timeout { what: String, secs: u64 },
    /// A migration (a save, a load, a live capture) ended without completing.
    #[error("{what}: {why}")]
    Migration { what: String, why: String },
    #[error(transparent)]
    Io(#[from] IoFailure),
}

impl crate::error::Coded for QmpError {
    fn code(&self) -> dsec_common::ErrorCode {
        match self {
            QmpError::Timeout { .. } | QmpError::Closed => dsec_common::ErrorCode::Unavailable,
            _ => dsec_common::ErrorCode::Internal,
        }
    }
}

impl QmpError {
    /// QEMU's own description of a refused command (None for other failures).
    pub fn refusal(&self) -> Option<&str> {
        match self {
            QmpError::Command { desc, .. } => Some(desc),
            _ => None,
        }
    }
}

/// How long one QMP answer may take.
const READ_WITHIN: Duration = Duration::from_secs(30);

/// The descriptor set a `mapped-ram` save or load passes its file in.
const SAVE_FDSET: u32 = 7;

pub struct Qmp {
    r: BufReader<UnixStream>,
    w: UnixStream,
}

impl Qmp {
    /// Connects (retrying while QEMU is still creating the socket) and negotiates.
    pub fn connect(sock: &Path, within: Duration) -> Result<Qmp, QmpError> {
        let t0 = Instant::now();
        let s = loop {
            match UnixStream::connect(sock) {
                Ok(s) => break s,
                Err(e) if t0.elapsed() >= within => {
                    return Err(IoFailure::new(format!("QMP socket {}", sock.display()), e).into());
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        };
        s.set_read_timeout(Some(READ_WITHIN))
            .ctx(|| "QMP socket".into())?;
        let r = BufReader::new(s.try_clone().ctx(|| "QMP socket".into())?);
        let mut q = Qmp { r, w: s };
        q.read_value()?; // the greeting
        q.execute("qmp_capabilities", Value::Null)?;
        Ok(q)
    }

    fn read_value(&mut self) -> Result<Value, QmpError> {
        let mut line = String::new();
        match self.r.read_line(&mut line) {
            Ok(0) => Err(QmpError::Closed),
            Ok(_) => serde_json::from_str(&line).map_err(|source| QmpError::Malformed {
                line: line.clone(),
                source,
            }),
            Err(e) => Err(IoFailure::new("reading QMP", e).into()),
        }
    }

    /// Runs one command; its `return` value, or QEMU's error as text.
    pub fn execute(&mut self, cmd: &str, args: Value) -> Result<Value, QmpError> {
        let mut req = json!({ "execute": cmd });
        if !args.is_null() {
            req["arguments"] = args;
        }
        writeln!(self.w, "{req}").ctx(|| format!("QMP {cmd}"))?;
        self.reply(cmd)
    }

    /// Hands QEMU the open file `f` under `name` (`getfd`, the descriptor passed with
    /// SCM_RIGHTS), for a `fd:<name>` migration URI: QEMU reads or writes it itself and
    /// runs no helper program (its seccomp filter forbids spawning one).
    pub fn give_fd(&mut self, name: &str, f: &impl AsRawFd) -> Result<(), QmpError> {
        self.with_fd("getfd", json!({ "fdname": name }), f)
            .map(drop)
    }

    /// Puts the open file `f` in QEMU's descriptor set `set` (`add-fd`), for a
    /// `file:/dev/fdset/<set>` URI: QEMU picks the descriptor whose access mode fits.
    /// The set is emptied first (one an interrupted earlier save left behind).
    pub fn add_fd(&mut self, set: u32, f: &impl AsRawFd) -> Result<(), QmpError> {
        let _ = self.execute("remove-fd", json!({ "fdset-id": set }));
        self.with_fd("add-fd", json!({ "fdset-id": set }), f)
            .map(drop)
    }

    /// Runs `cmd` with the descriptor of `f` passed along (SCM_RIGHTS).
    fn with_fd(&mut self, cmd: &str, args: Value, f: &impl AsRawFd) -> Result<Value, QmpError> {
        let line = format!("{}\n", json!({"execute": cmd, "arguments": args}));
        let fd: libc::c_int = f.as_raw_fd();
        let fd_size = std::mem::size_of::<libc::c_int>() as u32;
        // SAFETY: CMSG_SPACE and CMSG_LEN only compute sizes.
        let space = unsafe { libc::CMSG_SPACE(fd_size) } as usize;
        let mut control = vec![0u8; space];
        let mut iov = libc::iovec {
            iov_base: line.as_ptr() as *mut libc::c_void,
            iov_len: line.len(),
        };
        // SAFETY: msghdr is plain data; every pointer set below outlives the sendmsg call
        // (`iov`, `control`, `line` and `fd` are locals), and the one control message fits
        // in `control`, which CMSG_SPACE sized for it.
        let sent = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
            msg.msg_controllen = space as _;
            let c = libc::CMSG_FIRSTHDR(&msg);
            if c.is_null() {
                return Err(QmpError::NoRoom { cmd: cmd.into() });
            }
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(fd_size) as _;
            std::ptr::copy_nonoverlapping(
                &fd as *const libc::c_int as *const u8,
                libc::CMSG_DATA(c),
                fd_size as usize,
            );
            libc::sendmsg(self.w.as_raw_fd(), &msg, 0)
        };
        if sent < 0 {
            return Err(IoFailure::last_os(format!("QMP {cmd}")).into());
        }
        // The descriptor went with the first byte; the rest of the line, if the socket
        // took only part, goes as usual.
        self.w
            .write_all(&line.as_bytes()[sent as usize..])
            .ctx(|| format!("QMP {cmd}"))?;
        self.reply(cmd)
    }

    fn reply(&mut self, cmd: &str) -> Result<Value, QmpError> {
        loop {
            let v = self.read_value()?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                let field = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("error");
                return Err(QmpError::Command {
                    cmd: cmd.into(),
                    class: field("class").into(),
                    desc: field("desc").into(),
                });
            }
            // An asynchronous event: not ours.
        }
    }

    pub fn set_ignore_shared(&mut self, on: bool) -> Result<(), QmpError> {
        self.execute(
            "migrate-set-capabilities",
            json!({ "capabilities": [{ "capability": "x-ignore-shared", "state": on }] }),
        )
        .map(drop)
    }

    /// Turns migration capabilities on or off.
    pub fn set_caps(&mut self, caps: &[(&str, bool)]) -> Result<(), QmpError> {
        let caps: Vec<Value> = caps
            .iter()
            .map(|(c, on)| json!({ "capability": c, "state": on }))
            .collect();
        self.execute("migrate-set-capabilities", json!({ "capabilities": caps }))
            .map(drop)
    }

    /// Waits until something is connected to the socket chardev `id`.
    pub fn wait_connected(&mut self, id: &str, within: Duration) -> Result<(), QmpError> {
        let t0 = Instant::now();
        loop {
            let v = self.execute("query-chardev", Value::Null)?;
            let connected = v.as_array().is_some_and(|all| {
                all.iter().any(|c| {
                    c.get("label").and_then(Value::as_str) == Some(id)
                        && c.get("filename")
                            .and_then(Value::as_str)
                            .is_some_and(|f| !f.starts_with("disconnected:"))
                })
            });
            if connected {
                return Ok(());
            }
            if t0.elapsed() > within {
                return Err(QmpError::Timeout {
                    what: format!("connecting to the VM's {id} channel"),
                    secs: within.as_secs(),
                });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// The VM's run state (`running`, `paused`, `inmigrate`, `postmigrate`, …).
    pub fn status(&mut self) -> Result<String, QmpError> {
        let v = self.execute("query-status", Value::Null)?;
        Ok(v.get("status")
            .and_then(Value::as_str)
            .unwrap_or("unknown")
            .to_string())
    }

    /// Writes the VM's state to `dest` (the VM must be stopped) and waits until it is
    /// complete. With `ignore-shared` on, RAM in a shared file is left out.
    pub fn save(&mut self, dest: &Path, within: Duration) -> Result<(), QmpError> {
        // 7.2 caps migration at 128 MiB/s by default, even for a stopped VM to a file.
        self.execute(
            "migrate-set-parameters",
            json!({ "max-bandwidth": 100u64 << 30 }),
        )?;
        let out = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(dest)
            .ctx(|| format!("creating {}", dest.display()))?;
        self.give_fd("dsec-save", &out)?;
        self.execute("migrate", json!({ "uri": "fd:dsec-save" }))?;
        let t0 = Instant::now();
        loop {
            let v = self.execute("query-migrate", Value::Null)?;
            match v.get("status").and_then(Value::as_str) {
                Some("completed") => return Ok(()),
                Some("failed" | "cancelled") => {
                    return Err(QmpError::Migration {
                        what: "saving the VM failed".into(),
                        why: v
                            .get("error-desc")
                            .and_then(Value::as_str)
                            .unwrap_or("no reason given")
                            .into(),
                    });
                }
                _ if t0.elapsed() > within => {
                    let _ = self.execute("migrate_cancel", Value::Null);
                    return Err(QmpError::Timeout {
                        what: "saving the VM".into(),
                        secs: within.as_secs(),
                    });
                }
                _ => std::thread::sleep(Duration::from_millis(2)),
            }
        }
    }

    /// Migrates the running VM live over the connected socket `to` (the other end given
    /// to a QEMU waiting with `migrate-incoming`), then continues it. Returns how long
    /// it stood still, in ms: QEMU's own downtime (the last pages and the device state)
    /// and the moment until `cont`. Gives up (cancelled, the VM still running) after
    /// `within`.
    pub fn migrate_live(&mut self, to: &impl AsRawFd, within: Duration) -> Result<u64, QmpError> {
        // Told by an event rather than polled: once it completes, the VM stands still
        // until `cont`, and polling would take the VM's main loop from the migration.
        self.execute(
            "migrate-set-capabilities",
            json!({ "capabilities": [{ "capability": "events", "state": true }] }),
        )?;
        self.execute(
            "migrate-set-parameters",
            json!({ "max-bandwidth": 100u64 << 30, "downtime-limit": 5 }),
        )?;
        self.give_fd("dsec-live", to)?;
        self.execute("migrate", json!({ "uri": "fd:dsec-live" }))?;
        self.finish_live(within)
    }

    /// Saves the running VM live into the `mapped-ram` file `to` (open for writing only;
    /// see [`super::mapped`]), then continues it: the VM stands still only for its last
    /// dirty pages and its device state. Returns that time in ms, as
    /// [`Qmp::migrate_live`]. The file is not yet ready to map ([`super::mapped::seal`]).
    pub fn migrate_mapped(
        &mut self,
        to: &std::fs::File,
        within: Duration,
    ) -> Result<u64, QmpError> {
        self.set_caps(&[
            ("events", true),
            ("x-ignore-shared", false),
            ("mapped-ram", true),
            ("multifd", true),
        ])?;
        self.execute(
            "migrate-set-parameters",
            json!({ "max-bandwidth": 100u64 << 30, "downtime-limit": 20, "multifd-channels": 2 }),
        )?;
        self.add_fd(SAVE_FDSET, to)?;
        let uri = json!({ "uri": format!("file:/dev/fdset/{SAVE_FDSET}") });
        // Right after an earlier migration QEMU can still hold its last one's name for
        // a moment ("duplicate yank instance").
        if self.execute("migrate", uri.clone()).is_err() {
            std::thread::sleep(Duration::from_millis(20));
            self.execute("migrate", uri)?;
        }
        let r = self.finish_live(within);
        let _ = self.execute("remove-fd", json!({ "fdset-id": SAVE_FDSET }));
        // Stream saves (pause to disk) cannot use these.
        let _ = self.set_caps(&[("mapped-ram", false), ("multifd", false)]);
        r
    }

    /// Waits for the migration just started to complete (told by an event rather than
    /// polled: once it completes the VM stands still until `cont`, and polling would take
    /// the VM's main loop from the migration), continues the VM and returns how long it
    /// stood still; gives up (cancelled, the VM still running) after `within`.
    fn finish_live(&mut self, within: Duration) -> Result<u64, QmpError> {
        let deadline = Instant::now() + within;
        let status = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let _ = self.execute("migrate_cancel", Value::Null);
                return Err(QmpError::Timeout {
                    what: "the live migration".into(),
                    secs: within.as_secs(),
                });
            }
            self.r
                .get_ref()
                .set_read_timeout(Some(left))
                .ctx(|| "QMP socket".into())?;
            let v = self.read_value();
            let _ = self.r.get_ref().set_read_timeout(Some(READ_WITHIN));
            let v = match v {
                Ok(v) => v,
                Err(_) if Instant::now() >= deadline => continue,
                Err(e) => return Err(e),
            };
            if v.get("event").and_then(Value::as_str) != Some("MIGRATION") {
                continue;
            }
            match v.pointer("/data/status").and_then(Value::as_str) {
                Some(s @ ("completed" | "failed" | "cancelled")) => break s.to_string(),
                _ => continue,
            }
        };
        if status == "completed" {
            let t = Instant::now();
            // QEMU 10 announces `completed` a moment before its migration thread has
            // finished, and refuses `cont` until then ("Migration is not finalized yet").
            while let Err(e) = self.execute("cont", Value::Null) {
                let unfinalized = e.refusal().is_some_and(|d| d.contains("not finalized"));
                if !unfinalized || t.elapsed() > Duration::from_secs(5) {
                    return Err(e);
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            let cont_ms = t.elapsed().as_millis() as u64;
            let v = self.execute("query-migrate", Value::Null)?;
            let downtime = v.get("downtime").and_then(Value::as_u64).unwrap_or(0);
            return Ok(downtime + cont_ms);
        }
        let v = self.execute("query-migrate", Value::Null)?;
        Err(QmpError::Migration {
            what: format!("the live migration {status}"),
            why: v
                .get("error-desc")
                .and_then(Value::as_str)
                .unwrap_or("no reason given")
                .into(),
        })
    }

    /// Loads a saved state into a VM started with `-incoming defer`; the VM ends paused.
    pub fn load(&mut self, src: &Path, within: Duration) -> Result<(), QmpError> {
        let input = std::fs::File::open(src).ctx(|| format!("opening {}", src.display()))?;
        self.give_fd("dsec-load", &input)?;
        self.execute("migrate-incoming", json!({ "uri": "fd:dsec-load" }))?;
        self.wait_loaded(within).map(drop)
    }

    /// Loads the `mapped-ram` file `src` (see [`super::mapped`]) into a VM started with
    /// `-incoming defer` whose memory maps the same file; the VM ends paused. Passed as a
    /// descriptor: QEMU opens the file after it has dropped to its `run-with` user.
    pub fn load_mapped(&mut self, src: &Path, within: Duration) -> Result<(), QmpError> {
        let input = std::fs::File::open(src).ctx(|| format!("opening {}", src.display()))?;
        self.set_caps(&[("mapped-ram", true), ("multifd", true)])?;
        self.add_fd(SAVE_FDSET, &input)?;
        self.execute(
            "migrate-incoming",
            json!({ "uri": format!("file:/dev/fdset/{SAVE_FDSET}") }),
        )?;
        let r = self.wait_loaded(within).map(drop);
        let _ = self.execute("remove-fd", json!({ "fdset-id": SAVE_FDSET }));
        let _ = self.set_caps(&[("mapped-ram", false), ("multifd", false)]);
        r
    }

    /// Waits until a VM receiving a migration (`migrate-incoming`) has all of it; the run
    /// state it is in then.
    pub fn wait_loaded(&mut self, within: Duration) -> Result<String, QmpError> {
        let t0 = Instant::now();
        loop {
            match self.status()?.as_str() {
                "inmigrate" if t0.elapsed() < within => {
                    std::thread::sleep(Duration::from_millis(2))
                }
                "inmigrate" => {
                    return Err(QmpError::Timeout {
                        what: "loading the VM".into(),
                        secs: within.as_secs(),
                    });
                }
                s @ ("paused" | "postmigrate" | "running" | "prelaunch") => return Ok(s.into()),
                other => {
                    let info = self
                        .execute("query-migrate", Value::Null)
                        .ok()
                        .and_then(|v| {
                            v.get("error-desc")
                                .and_then(Value::as_str)
                                .map(String::from)
                        })
                        .unwrap_or_default();
                    return Err(QmpError::Migration {
                        what: format!("loading the VM failed (state {other})"),
                        why: info,
                    });
                }
            }
        }
    }
}
