//! The runtime API on the edge: managed processes (stream, background, attach, stdin,
//! signals, terminals), files, directory watches and shell sessions, forwarded to aether
//! over the sandbox channel. Commands and file mutations go through the trajectory log.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dsec_common::ApiError;
use dsec_common::api::{
    ExecRequest, ExecResult, ProcessInfo, SessionCreateRequest, SessionInfo, SessionResult,
    SessionRunRequest,
};
use dsec_common::api::{SandboxMetrics, SandboxState};
use dsec_common::channel::{
    FRAME_DATA, FRAME_JSON, FRAME_STDERR, FRAME_STDOUT, FsEvent, PtySize, Request, Response,
    StartSpec,
};
use futures_util::{Stream, StreamExt};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::net::UnixStream;

use crate::backend::Backend;
use crate::channel::{self, Conn, check, unexpected};
use crate::registry::SandboxRecord;
use crate::trajectory::{Outcome, StepRef};
use crate::{Edge, Entry, blocking, validate};

/// How long unary runtime calls may take before the edge gives up on the agent.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// File bodies of trajectory steps are hashed before they run, so they are held in memory.
const MAX_STEP_BODY: usize = 64 << 20;

/// One event of a process's output stream.
#[derive(Debug)]
pub enum ProcEvent {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exit(ExecResult),
    Error(ApiError),
}

/// A process's output as it arrives, ending with its exit (or an error).
pub struct ProcessStream {
    conn: Option<Conn>,
    pub pid: u32,
    oom: Option<(Arc<dyn Backend>, SandboxRecord, u64)>,
    done: bool,
    /// Where the connection goes once the exit has been read, when the agent said it
    /// carries more requests: the next exec of the sandbox costs no connect.
    keep: Option<Arc<crate::Entry>>,
}

impl ProcessStream {
    pub async fn next(&mut self) -> Option<ProcEvent> {
        if self.done {
            return None;
        }
        let conn = self.conn.as_mut()?;
        let ev = match conn.frame().await {
            Ok(Some((FRAME_STDOUT, d))) => ProcEvent::Stdout(d),
            Ok(Some((FRAME_STDERR, d))) => ProcEvent::Stderr(d),
            Ok(Some((FRAME_JSON, body))) => {
                match serde_json::from_slice::<Response>(&body).map_err(|e| {
                    ApiError::internal(format!("malformed reply from the sandbox agent: {e}"))
                }) {
                    Ok(Response::Exit(mut r)) => {
                        if let Some((b, rec, before)) = self.oom.take() {
                            let after = b.oom_kills(&rec);
                            r.oom_killed = after > before;
                        }
                        ProcEvent::Exit(r)
                    }
                    Ok(Response::Error { code, message }) => {
                        ProcEvent::Error(ApiError::new(code, message))
                    }
                    Ok(other) => ProcEvent::Error(unexpected(&other)),
                    Err(e) => ProcEvent::Error(e),
                }
            }
            Ok(Some((k, _))) => ProcEvent::Error(ApiError::internal(format!(
                "the sandbox agent sent an unexpected {:?} frame",
                k as char
            ))),
            Ok(None) => ProcEvent::Error(ApiError::unavailable(
                "the sandbox agent closed the stream (the sandbox may have stopped)",
            )),
            Err(e) => ProcEvent::Error(e),
        };
        if matches!(ev, ProcEvent::Exit(_) | ProcEvent::Error(_)) {
            self.done = true;
            if let (ProcEvent::Exit(_), Some(e), Some(conn)) =
                (&ev, self.keep.take(), self.conn.take())
            {
                e.agent.put(conn);
            }
        }
        Some(ev)
    }
}

/// A file being read from a sandbox.
pub struct FileRead {
    conn: Conn,
    pub size: u64,
    done: bool,
}

impl FileRead {
    /// The next chunk; `None` at the end.
    pub async fn chunk(&mut self) -> Option<Result<Bytes, ApiError>> {
        if self.done {
            return None;
        }
        match self.conn.frame().await {
            Ok(Some((FRAME_DATA, d))) if d.is_empty() => {
                self.done = true;
                None
            }
            Ok(Some((FRAME_DATA, d))) => Some(Ok(Bytes::from(d))),
            Ok(_) => {
                self.done = true;
                Some(Err(ApiError::unavailable(
                    "the file stream from the sandbox ended early",
                )))
            }
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}

/// Changes under a watched directory.
pub struct WatchStream {
    conn: Conn,
}

impl WatchStream {
    pub async fn next(&mut self) -> Option<Result<FsEvent, ApiError>> {
        match self.conn.reply().await {
            Ok(Response::Event(e)) => Some(Ok(e)),
            Ok(other) => Some(Err(unexpected(&other))),
            Err(e) if e.code == dsec_common::ErrorCode::Unavailable => None,
            Err(e) => Some(Err(e)),
        }
    }
}

fn to_value<T: serde::Serialize>(v: &T) -> Result<Value, ApiError> {
    serde_json::to_value(v).map_err(|e| ApiError::internal(e.to_string()))
}

fn check_path(what: &str, p: &str) -> Result<(), ApiError> {
    if p.is_empty() || p.contains('\0') || p.len() > 4096 {
        return Err(ApiError::invalid(format!(
            "{what} must be a non-empty path of at most 4096 bytes without NUL (got {p:?})"
        )));
    }
    Ok(())
}

/// How [`Edge::write_file`] writes: the mode of a file it makes, whether it appends, and
/// the user it writes as (what it makes is theirs; default root).
#[derive(Debug, Clone, Default)]
pub struct WriteOptions {
    pub mode: Option<u32>,
    pub append: bool,
    pub user: Option<String>,
    /// The file's metadata after the write; none: a write clears it, an append keeps it.
    pub metadata: Option<std::collections::BTreeMap<String, String>>,
}

/// A user a file operation names: a name as in /etc/passwd or a uid, nothing that could
/// be read as anything else.
fn check_user(u: &str) -> Result<(), ApiError> {
    let ok = !u.is_empty()
        && u.len() <= 32
        && !u.starts_with(['-', '.'])
        && u.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(format!(
            "user {u:?} is not a user name or uid (letters, digits, _ - ., at most 32)"
        )))
    }
}

impl Edge {
    /// A running sandbox's entry and channel socket; counts as activity.
    pub(crate) fn running(&self, id: &str) -> Result<(Arc<Entry>, PathBuf), ApiError> {
        let e = self.entry(id)?;
        match e.snapshot().state {
            SandboxState::Running => {}
            SandboxState::Paused => {
                return Err(ApiError::precondition(format!(
                    "sandbox {id} is paused; resume it first"
                )));
            }
            s => {
                return Err(ApiError::precondition(format!(
                    "sandbox {id} is {s:?}, not running"
                )));
            }
        }
        self.touch(&e);
        Ok((e, self.paths(id).channel))
    }

    /// One request to the sandbox's agent, one reply.
    pub async fn agent(&self, id: &str, req: Request) -> Result<Response, ApiError> {
        let (_, sock) = self.running(id)?;
        channel::call(&sock, &req, CALL_TIMEOUT).await
    }

    /// A mutation: logged as a trajectory step, answered from the log when replayed.
    async fn mutate(
        self: &Arc<Self>,
        id: &str,
        step: Option<StepRef>,
        kind: &str,
        logged: Value,
        req: Request,
    ) -> Result<Outcome, ApiError> {
        self.running(id)?;
        let edge = self.clone();
        let id2 = id.to_string();
        self.trajectories
            .step(
                &self.registry.dir(id),
                step,
                kind,
                logged,
                move || async move {
                    let r = edge.agent(&id2, req).await?;
                    match r {
                        Response::Stat(s) => to_value(&s),
                        Response::Ok => Ok(json!({})),
                        Response::Written { path, size } => Ok(json!({"path": path, "size": size})),
                        Response::Command(c) => to_value(&c),
                        Response::Started { pid, .. } => Ok(json!({ "pid": pid })),
                        other => Err(unexpected(&other)),
                    }
                },
            )
            .await
    }

    /// `POST /exec` without stream or background: run to the end, as a trajectory step.
    pub async fn exec_step(
        self: &Arc<Self>,
        id: &str,
        req: ExecRequest,
        step: Option<StepRef>,
    ) -> Result<Outcome, ApiError> {
        self.running(id)?;
        validate::exec(&self.cfg, &req)?;
        let logged = to_value(&req)?;
        let edge = self.clone();
        let id2 = id.to_string();
        self.trajectories
            .step(
                &self.registry.dir(id),
                step,
                "exec",
                logged,
                move || async move { to_value(&edge.exec(&id2, req).await?) },
            )
            .await
    }

    fn start_spec(&self, req: &ExecRequest, attach: bool) -> Result<StartSpec, ApiError> {
        Ok(StartSpec {
            exec: validate::exec(&self.cfg, req)?,
            pty: req.pty,
            tag: req.tag.clone(),
            attach,
        })
    }

    /// `POST /exec` with `stream`: starts the process and streams its output.
    pub async fn exec_stream(
        self: &Arc<Self>,
        id: &str,
        req: ExecRequest,
    ) -> Result<ProcessStream, ApiError> {
        let (e, sock) = self.running(id)?;
        let spec = self.start_spec(&req, true)?;
        let rec = e.snapshot();
        let backend = self.backend(&rec.backend)?;
        let before = backend.oom_kills(&rec);
        let req = Request::Start(spec);
        let keeps = backend.keeps_agent_connections();
        let mut conn = if keeps {
            channel::open_kept(&e.agent, &sock, &req).await?
        } else {
            Conn::open(&sock, &req).await?
        };
        match conn.reply().await? {
            Response::Started { pid, kept } => Ok(ProcessStream {
                conn: Some(conn),
                pid,
                oom: Some((backend, rec, before)),
                done: false,
                keep: (kept && keeps).then_some(e),
            }),
            other => Err(unexpected(&other)),
        }
    }

    /// `POST /exec` with `background`: starts the process; answers its pid.
    pub async fn exec_background(
        self: &Arc<Self>,
        id: &str,
        req: ExecRequest,
        step: Option<StepRef>,
    ) -> Result<Outcome, ApiError> {
        let spec = self.start_spec(&req, false)?;
        self.mutate(id, step, "exec", to_value(&req)?, Request::Start(spec))
            .await
    }

    pub async fn attach(&self, id: &str, pid: u32) -> Result<ProcessStream, ApiError> {
        let (_, sock) = self.running(id)?;
        let mut conn = Conn::open(&sock, &Request::Attach { pid }).await?;
        match conn.reply().await? {
            Response::Started { pid, .. } => Ok(ProcessStream {
                conn: Some(conn),
                pid,
                oom: None,
                done: false,
                keep: None,
            }),
            other => Err(unexpected(&other)),
        }
    }

    pub async fn processes(&self, id: &str) -> Result<Vec<ProcessInfo>, ApiError> {
        match self.agent(id, Request::Processes).await? {
            Response::Processes { processes } => Ok(processes),
            other => Err(unexpected(&other)),
        }
    }

    /// Streams `body` into a process's stdin.
    pub async fn write_stdin<S, E>(
        &self,
        id: &str,
        pid: u32,
        close: bool,
        mut body: S,
    ) -> Result<(), ApiError>
    where
        S: Stream<Item = Result<Bytes, E>> + Unpin,
        E: std::fmt::Display,
    {
        let (_, sock) = self.running(id)?;
        let mut conn = Conn::open(&sock, &Request::Stdin { pid, close }).await?;
        while let Some(chunk) = body.next().await {
            let chunk =
                chunk.map_err(|e| ApiError::invalid(format!("reading the request body: {e}")))?;
            for piece in chunk.chunks(dsec_common::channel::CHUNK) {
                conn.data(piece).await?;
            }
        }
        conn.data(&[]).await?;
        match conn.reply().await? {
            Response::Ok => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    pub async fn signal(&self, id: &str, pid: u32, signal: i32) -> Result<(), ApiError> {
        if !(1..=64).contains(&signal) {
            return Err(ApiError::invalid(format!(
                "signal {signal} is not a signal number (1-64)"
            )));
        }
        match self.agent(id, Request::Signal { pid, signal }).await? {
            Response::Ok => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    pub async fn resize(&self, id: &str, pid: u32, size: PtySize) -> Result<(), ApiError> {
        if !(1..=1000).contains(&size.cols) || !(1..=1000).contains(&size.rows) {
            return Err(ApiError::invalid(format!(
                "cols and rows must be from 1 to 1000 (got {}x{})",
                size.cols, size.rows
            )));
        }
        let req = Request::Resize {
            pid,
            cols: size.cols,
            rows: size.rows,
        };
        match self.agent(id, req).await? {
            Response::Ok => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    pub async fn read_file(&self, id: &str, path: &str) -> Result<FileRead, ApiError> {
        check_path("path", path)?;
        let (_, sock) = self.running(id)?;
        let mut conn = Conn::open(
            &sock,
            &Request::ReadFile {
                path: path.to_string(),
            },
        )
        .await?;
        match conn.reply().await? {
            Response::File { size } => Ok(FileRead {
                conn,
                size,
                done: false,
            }),
            other => Err(unexpected(&other)),
        }
    }

    /// Streams `body` into a file. As a named trajectory step the body is hashed first
    /// (so a replay can be compared), which holds it in memory: at most 64 MiB.
    pub async fn write_file<S, E>(
        self: &Arc<Self>,
        id: &str,
        path: &str,
        how: WriteOptions,
        mut body: S,
        step: Option<StepRef>,
    ) -> Result<Outcome, ApiError>
    where
        S: Stream<Item = Result<Bytes, E>> + Unpin + Send + 'static,
        E: std::fmt::Display + Send + 'static,
    {
        let WriteOptions {
            mode,
            append,
            user,
            metadata,
        } = how;
        check_path("path", path)?;
        if let Some(u) = &user {
            check_user(u)?;
        }
        if let Some(m) = &metadata {
            dsec_common::api::check_metadata(m)?;
        }
        if mode.is_some_and(|m| m > 0o7777) {
            return Err(ApiError::invalid(
                "mode must be a permission mode (at most 0o7777)",
            ));
        }
        let (_, sock) = self.running(id)?;
        let echo = metadata.clone();
        let req = Request::WriteFile {
            path: path.to_string(),
            mode,
            append,
            user,
            metadata,
        };
        let mut logged = json!({"path": path, "mode": mode, "append": append});
        if let Some(m) = &echo {
            logged["metadata"] = json!(m);
        }
        let buffered = if step.as_ref().is_some_and(|s| s.seq.is_some()) {
            let mut all = Vec::new();
            while let Some(c) = body.next().await {
                let c =
                    c.map_err(|e| ApiError::invalid(format!("reading the request body: {e}")))?;
                if all.len() + c.len() > MAX_STEP_BODY {
                    return Err(ApiError::invalid(format!(
                        "a file written as a trajectory step may have at most {} MiB; write larger files without X-Dsec-Step",
                        MAX_STEP_BODY >> 20
                    )));
                }
                all.extend_from_slice(&c);
            }
            logged["size"] = json!(all.len());
            logged["sha256"] = json!(hex::encode(Sha256::digest(&all)));
            Some(all)
        } else {
            None
        };
        self.trajectories
            .step(
                &self.registry.dir(id),
                step,
                "write_file",
                logged,
                move || async move {
                    let mut conn = Conn::open(&sock, &req).await?;
                    match buffered {
                        Some(all) => {
                            for piece in all.chunks(dsec_common::channel::CHUNK) {
                                conn.data(piece).await?;
                            }
                        }
                        None => {
                            while let Some(c) = body.next().await {
                                let c = c.map_err(|e| {
                                    ApiError::invalid(format!("reading the request body: {e}"))
                                })?;
                                for piece in c.chunks(dsec_common::channel::CHUNK) {
                                    conn.data(piece).await?;
                                }
                            }
                        }
                    }
                    conn.data(&[]).await?;
                    match conn.reply().await? {
                        Response::Written { path, size } => Ok(match echo {
                            Some(m) => json!({"path": path, "size": size, "metadata": m}),
                            None => json!({"path": path, "size": size}),
                        }),
                        other => Err(unexpected(&other)),
                    }
                },
            )
            .await
    }

    /// Read-only file calls: stat, list, exists.
    pub async fn file_query(&self, id: &str, req: Request) -> Result<Value, ApiError> {
        match &req {
            Request::Stat { path } | Request::List { path, .. } | Request::Exists { path } => {
                check_path("path", path)?
            }
            _ => return Err(ApiError::internal("not a file query")),
        }
        match self.agent(id, req).await? {
            Response::Stat(s) => to_value(&s),
            Response::Entries { entries } => Ok(json!({ "entries": entries })),
            Response::Exists { exists } => Ok(json!({ "exists": exists })),
            other => Err(unexpected(&other)),
        }
    }

    /// File mutations: mkdir, remove, rename, chmod, chown.
    pub async fn file_op(
        self: &Arc<Self>,
        id: &str,
        req: Request,
        step: Option<StepRef>,
    ) -> Result<Outcome, ApiError> {
        let kind = match &req {
            Request::Mkdir { path, user } => {
                check_path("path", path)?;
                if let Some(u) = user {
                    check_user(u)?;
                }
                "mkdir"
            }
            Request::Remove { path, .. } => {
                check_path("path", path)?;
                "remove"
            }
            Request::Rename { from, to } => {
                check_path("from", from)?;
                check_path("to", to)?;
                "rename"
            }
            Request::Chmod { path, .. } => {
                check_path("path", path)?;
                "chmod"
            }
            Request::Chown { path, .. } => {
                check_path("path", path)?;
                "chown"
            }
            _ => return Err(ApiError::internal("not a file mutation")),
        };
        let mut logged = to_value(&req)?;
        if let Some(o) = logged.as_object_mut() {
            o.remove("op");
        }
        self.mutate(id, step, kind, logged, req).await
    }

    /// Watches directory `path`: `recursive` into its subdirectories, `entry`: each
    /// event with the entry's stat, `allow_network_mounts`: also on a network filesystem.
    pub async fn watch(
        &self,
        id: &str,
        path: &str,
        recursive: bool,
        entry: bool,
        allow_network_mounts: bool,
    ) -> Result<WatchStream, ApiError> {
        check_path("path", path)?;
        let (_, sock) = self.running(id)?;
        let req = Request::Watch {
            path: path.to_string(),
            recursive,
            entry,
            allow_network_mounts,
        };
        let mut conn = Conn::open(&sock, &req).await?;
        match tokio::time::timeout(CALL_TIMEOUT, conn.reply()).await {
            Ok(Ok(Response::Ready)) => Ok(WatchStream { conn }),
            Ok(Ok(other)) => Err(unexpected(&other)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(ApiError::unavailable(
                "the sandbox agent did not start the watch",
            )),
        }
    }

    pub async fn session_create(
        &self,
        id: &str,
        req: SessionCreateRequest,
    ) -> Result<SessionInfo, ApiError> {
        if let Some(c) = &req.cwd {
            check_path("cwd", c)?;
        }
        for k in req.env.keys() {
            if k.is_empty() || k.contains(['=', '\0']) {
                return Err(ApiError::invalid(format!(
                    "env variable {k:?} is not valid"
                )));
            }
        }
        let r = Request::SessionCreate {
            cwd: req.cwd,
            env: req.env,
            max_output_bytes: self
                .cfg
                .max_output_bytes
                .min(dsec_common::channel::MAX_STREAM_OUTPUT),
        };
        match check(self.agent(id, r).await?)? {
            Response::Session(s) => Ok(s),
            other => Err(unexpected(&other)),
        }
    }

    pub async fn sessions(&self, id: &str) -> Result<Vec<SessionInfo>, ApiError> {
        match self.agent(id, Request::SessionList).await? {
            Response::Sessions { sessions } => Ok(sessions),
            other => Err(unexpected(&other)),
        }
    }

    pub async fn session_run(
        self: &Arc<Self>,
        id: &str,
        session: &str,
        req: SessionRunRequest,
        step: Option<StepRef>,
    ) -> Result<Outcome, ApiError> {
        let timeout = req
            .timeout_seconds
            .unwrap_or(self.cfg.default_exec_timeout_seconds);
        if !timeout.is_finite() || timeout <= 0.0 || timeout > self.cfg.max.ttl_seconds as f64 {
            return Err(ApiError::invalid(format!(
                "timeout_seconds must be more than 0 and at most {} (got {timeout})",
                self.cfg.max.ttl_seconds
            )));
        }
        if req.cmd.contains('\0') {
            return Err(ApiError::invalid("cmd must not contain NUL bytes"));
        }
        let mut logged = to_value(&req)?;
        logged["session"] = json!(session);
        let r = Request::SessionRun {
            session: session.to_string(),
            cmd: req.cmd,
            timeout_ms: (timeout * 1000.0) as u64,
            background: req.background,
        };
        self.mutate(id, step, "session_run", logged, r).await
    }

    pub async fn session_command(
        &self,
        id: &str,
        session: &str,
        command: u64,
    ) -> Result<SessionResult, ApiError> {
        let r = Request::SessionCommand {
            session: session.to_string(),
            command,
        };
        match self.agent(id, r).await? {
            Response::Command(c) => Ok(c),
            other => Err(unexpected(&other)),
        }
    }

    pub async fn session_kill(&self, id: &str, session: &str) -> Result<(), ApiError> {
        let r = Request::SessionKill {
            session: session.to_string(),
        };
        match self.agent(id, r).await? {
            Response::Ok => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    pub async fn trajectories(&self, id: &str) -> Result<Value, ApiError> {
        self.entry(id)?;
        let list = self.trajectories.list(&self.registry.dir(id)).await;
        Ok(json!({
            "trajectories": list.into_iter().map(|(name, steps)| json!({"name": name, "steps": steps})).collect::<Vec<_>>()
        }))
    }

    pub async fn trajectory(&self, id: &str, name: &str) -> Result<Value, ApiError> {
        self.entry(id)?;
        crate::trajectory::valid_name(name)?;
        let steps = self.trajectories.steps(&self.registry.dir(id), name).await;
        Ok(json!({"name": name, "steps": steps}))
    }
}

impl Edge {
    /// A connection to `port` inside the sandbox: after this returns, the stream carries
    /// that TCP connection's bytes. The reply is read without buffering, so no byte of
    /// the forwarded stream is held back.
    /// What a running sandbox uses now: CPU time and memory from its cgroup (a VM's
    /// QEMU included), its writable filesystem as its agent sees `/`.
    pub async fn metrics(&self, id: &str) -> Result<SandboxMetrics, ApiError> {
        let (e, sock) = self.running(id)?;
        let limits = e.snapshot().limits;
        let (disk_used_bytes, disk_total_bytes) =
            match channel::call(&sock, &Request::DiskUsage, CALL_TIMEOUT).await? {
                Response::DiskUsage {
                    used_bytes,
                    total_bytes,
                } => (used_bytes, total_bytes),
                other => return Err(unexpected(&other)),
            };
        let rel = crate::cgroup::sandbox_cgroup_path(id);
        let (mode, rel2) = (self.mode, rel.clone());
        let ((memory_used_bytes, memory_cache_bytes), cpu_used_ns) = blocking(move || {
            (
                crate::cgroup::memory(mode, &rel2),
                crate::cgroup::cpu_usage_ns(mode, &rel2),
            )
        })
        .await?;
        Ok(SandboxMetrics {
            timestamp_ms: crate::registry::now_ms(),
            cpu_cores: limits.cpu_cores,
            cpu_used_ns,
            memory_used_bytes,
            memory_cache_bytes,
            memory_limit_bytes: limits.memory_mb << 20,
            disk_used_bytes,
            disk_total_bytes,
        })
    }

    pub async fn connect_port(&self, id: &str, port: u16) -> Result<UnixStream, ApiError> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (_, sock) = self.running(id)?;
        let mut s = UnixStream::connect(&sock)
            .await
            .map_err(|e| ApiError::unavailable(format!("sandbox agent unreachable: {e}")))?;
        let mut line = serde_json::to_vec(&Request::Connect { port })
            .map_err(|e| ApiError::internal(e.to_string()))?;
        line.push(b'\n');
        let io = |e: std::io::Error| ApiError::unavailable(format!("sandbox agent: {e}"));
        s.write_all(&line).await.map_err(io)?;
        let mut head = [0u8; 5];
        tokio::time::timeout(CALL_TIMEOUT, s.read_exact(&mut head))
            .await
            .map_err(|_| ApiError::unavailable("the sandbox agent did not answer"))?
            .map_err(io)?;
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]);
        if head[0] != FRAME_JSON || len > 64 << 10 {
            return Err(ApiError::internal("malformed reply from the sandbox agent"));
        }
        let mut body = vec![0u8; len as usize];
        s.read_exact(&mut body).await.map_err(io)?;
        let reply: Response = serde_json::from_slice(&body).map_err(|e| {
            ApiError::internal(format!("malformed reply from the sandbox agent: {e}"))
        })?;
        match check(reply)? {
            Response::Ok => Ok(s),
            other => Err(unexpected(&other)),
        }
    }

    /// The token that opens the sandbox's ports without an API key (browsers).
    pub fn port_token(&self, id: &str) -> Result<String, ApiError> {
        Ok(self.entry(id)?.snapshot().port_token)
    }
}
