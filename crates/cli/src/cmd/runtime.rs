//! Runtime commands (docs/RUNTIME_API.md): shell, cp, logs, ps, trajectory.

use std::io::{IsTerminal, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use base64::Engine;
use bytes::Bytes;
use dsec_common::api::ProcessInfo;
use http_body_util::{BodyExt, StreamBody};
use hyper::Method;
use hyper::body::{Frame, Incoming};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::api;
use crate::client::{self, Api};
use crate::{ApiArgs, output};

/// Percent-encodes everything but unreserved characters (and '/' when `keep_slash`).
pub(crate) fn encode(s: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        let keep = b.is_ascii_alphanumeric()
            || matches!(b, b'-' | b'.' | b'_' | b'~')
            || (keep_slash && b == b'/');
        if keep {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `/v1/sandboxes/{id}` followed by `rest`.
fn sandbox_path(id: &str, rest: &str) -> String {
    format!("/v1/sandboxes/{}{rest}", encode(id, false))
}

// ---------------------------------------------------------------------------------------
// NDJSON events

/// One event of a process stream.
#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Event {
    Start {
        pid: u32,
    },
    Stdout {
        data: String,
    },
    Stderr {
        data: String,
    },
    Exit(ExitInfo),
    Error {
        code: Value,
        message: String,
    },
    /// Event types added later are skipped.
    #[serde(other)]
    Other,
}

#[derive(Deserialize)]
struct ExitInfo {
    exit_code: i32,
    #[serde(default)]
    timed_out: bool,
    #[serde(default)]
    oom_killed: bool,
    #[serde(default)]
    stdout_truncated: bool,
    #[serde(default)]
    stderr_truncated: bool,
}

/// Reads an NDJSON response body one line at a time.
struct NdjsonReader {
    body: Incoming,
    buf: Vec<u8>,
    done: bool,
}

impl NdjsonReader {
    fn new(body: Incoming) -> NdjsonReader {
        NdjsonReader {
            body,
            buf: Vec::new(),
            done: false,
        }
    }

    /// The next non-empty line (without its newline), or None at the end of the body.
    async fn next_line(&mut self) -> Result<Option<Vec<u8>>> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let mut line: Vec<u8> = self.buf.drain(..=i).collect();
                line.pop();
                if line.iter().any(|b| !b.is_ascii_whitespace()) {
                    return Ok(Some(line));
                }
                continue;
            }
            if self.done {
                // A last line without a newline still counts.
                let rest = std::mem::take(&mut self.buf);
                let blank = rest.iter().all(|b| b.is_ascii_whitespace());
                return Ok(if blank { None } else { Some(rest) });
            }
            match self.body.frame().await {
                Some(f) => {
                    if let Ok(d) = f.context("reading the event stream")?.into_data() {
                        self.buf.extend_from_slice(&d);
                    }
                }
                None => self.done = true,
            }
        }
    }

    /// The next event with its raw JSON line.
    async fn next_event(&mut self) -> Result<Option<(Event, Vec<u8>)>> {
        let Some(line) = self.next_line().await? else {
            return Ok(None);
        };
        let ev = serde_json::from_slice(&line).with_context(|| {
            format!(
                "unexpected event in the stream: {}",
                String::from_utf8_lossy(&line)
            )
        })?;
        Ok(Some((ev, line)))
    }
}

fn decode(data: &str) -> Result<Vec<u8>> {
    base64::engine::general_purpose::STANDARD
        .decode(data.as_bytes())
        .context("output data in the stream is not base64")
}

fn write_out(mut w: impl Write, data: &[u8]) -> Result<()> {
    w.write_all(data)?;
    w.flush()?;
    Ok(())
}

/// Prints a stream's output event; returns the exit at `exit`, and fails at `error`.
fn handle_event(ev: Event) -> Result<Option<ExitInfo>> {
    match ev {
        Event::Stdout { data } => write_out(std::io::stdout().lock(), &decode(&data)?)?,
        Event::Stderr { data } => write_out(std::io::stderr().lock(), &decode(&data)?)?,
        Event::Exit(x) => return Ok(Some(x)),
        Event::Error { code, message } => {
            let code = code
                .as_str()
                .map(str::to_string)
                .unwrap_or(code.to_string());
            bail!("{code}: {message}");
        }
        Event::Start { .. } | Event::Other => {}
    }
    Ok(None)
}

/// The exit code, with notes on stderr for how the process ended.
fn exit_code(x: &ExitInfo) -> i32 {
    super::sandbox::exit_notes(
        x.timed_out,
        x.oom_killed,
        x.stdout_truncated || x.stderr_truncated,
    );
    x.exit_code
}

// ---------------------------------------------------------------------------------------
// shell

#[derive(clap::Args)]
pub struct ShellArgs {
    /// Sandbox id
    pub id: String,
    /// Program to run instead of the login shell (run directly, without a shell)
    #[arg(long = "cmd", value_name = "PROG")]
    pub cmd: Option<String>,
    #[command(flatten)]
    pub api: ApiArgs,
}

/// Puts a terminal into raw mode and restores it when dropped.
struct RawMode {
    fd: i32,
    saved: libc::termios,
}

impl RawMode {
    fn enter(fd: i32) -> Result<RawMode> {
        // SAFETY: termios is plain data; tcgetattr fills it before it is used.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        if unsafe { libc::tcgetattr(fd, &mut t) } != 0 {
            return Err(std::io::Error::last_os_error()).context("reading the terminal mode");
        }
        let saved = t;
        unsafe { libc::cfmakeraw(&mut t) };
        if unsafe { libc::tcsetattr(fd, libc::TCSANOW, &t) } != 0 {
            return Err(std::io::Error::last_os_error()).context("setting the terminal to raw");
        }
        Ok(RawMode { fd, saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        unsafe { libc::tcsetattr(self.fd, libc::TCSADRAIN, &self.saved) };
    }
}

/// The local terminal's size, from stdout (else stdin); 80x24 when neither is a terminal.
fn term_size() -> Value {
    let (cols, rows) = crate::output::term_size();
    json!({"cols": cols, "rows": rows})
}

fn shell_argv(cmd: Option<String>) -> Vec<String> {
    match cmd {
        Some(prog) => vec![prog],
        // `exec bash || exec sh` does not work: a failed exec ends a non-interactive sh.
        None => vec![
            "/bin/sh".into(),
            "-c".into(),
            "if command -v bash >/dev/null 2>&1; then exec bash -l; else exec sh; fi".into(),
        ],
    }
}

/// Reads local stdin in a thread (a blocking read cannot be cancelled) into a channel;
/// the channel closes at end-of-file.
fn stdin_chunks() -> tokio::sync::mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin();
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.blocking_send(buf[..n].to_vec()).is_err() {
                        break;
                    }
                }
            }
        }
    });
    rx
}

/// Forwards local stdin to the process, in order, then closes its stdin. Stops quietly
/// when a write fails (the process has usually ended).
async fn forward_stdin(api: Arc<Api>, id: String, pid: u32) {
    let mut rx = stdin_chunks();
    let path = sandbox_path(&id, &format!("/processes/{pid}/stdin"));
    while let Some(mut chunk) = rx.recv().await {
        // Whatever else is queued (a paste) goes in the same request.
        while let Ok(more) = rx.try_recv() {
            chunk.extend_from_slice(&more);
        }
        let r = api
            .open(
                Method::POST,
                &path,
                "application/octet-stream",
                client::full(chunk),
            )
            .await;
        if r.is_err() {
            return;
        }
    }
    let close = format!("{path}?close=true");
    let _ = api
        .open(
            Method::POST,
            &close,
            "application/octet-stream",
            client::full(Bytes::new()),
        )
        .await;
}

/// Sends the local terminal's size to the process whenever it changes.
async fn forward_resize(api: Arc<Api>, id: String, pid: u32) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut winch) = signal(SignalKind::window_change()) else {
        return;
    };
    let path = sandbox_path(&id, &format!("/processes/{pid}/resize"));
    while winch.recv().await.is_some() {
        let body = client::full(term_size().to_string());
        let _ = api
            .open(Method::POST, &path, "application/json", body)
            .await;
    }
}

/// Reads the `start` event that opens a process stream.
async fn read_start(events: &mut NdjsonReader) -> Result<u32> {
    match events.next_event().await? {
        Some((Event::Start { pid }, _)) => Ok(pid),
        Some((ev, _)) => {
            handle_event(ev)?;
            bail!("the process stream did not start with a `start` event")
        }
        None => bail!("the process stream ended before the process started"),
    }
}

pub async fn shell(a: ShellArgs) -> Result<i32> {
    let api = Arc::new(api(&a.api)?);
    // A terminal only for a terminal: piped input then runs as a plain script.
    let tty = std::io::stdin().is_terminal();
    let mut req = json!({"argv": shell_argv(a.cmd), "stream": true});
    if tty {
        req["pty"] = term_size();
    }
    let resp = api
        .open(
            Method::POST,
            &sandbox_path(&a.id, "/exec"),
            "application/json",
            client::full(req.to_string()),
        )
        .await
        .with_context(|| format!("starting a shell in {}", a.id))?;
    let mut events = NdjsonReader::new(resp.into_body());
    let pid = read_start(&mut events).await?;
    let raw = if tty {
        Some(RawMode::enter(libc::STDIN_FILENO)?)
    } else {
        None
    };
    let stdin = tokio::spawn(forward_stdin(api.clone(), a.id.clone(), pid));
    let resize = tty.then(|| tokio::spawn(forward_resize(api.clone(), a.id.clone(), pid)));
    let r = pump(&mut events).await;
    stdin.abort();
    if let Some(t) = resize {
        t.abort();
    }
    // Restored before anything more is printed.
    drop(raw);
    Ok(exit_code(&r?))
}

/// Prints the stream's output until the process exits.
async fn pump(events: &mut NdjsonReader) -> Result<ExitInfo> {
    while let Some((ev, _)) = events.next_event().await? {
        if let Some(x) = handle_event(ev)? {
            return Ok(x);
        }
    }
    Err(anyhow!("the stream ended before the process exited"))
}

// ---------------------------------------------------------------------------------------
// logs, ps

#[derive(clap::Args)]
pub struct LogsArgs {
    /// Sandbox id
    pub id: String,
    /// Process id (from `dsec ps`)
    pub pid: u32,
    #[command(flatten)]
    pub api: ApiArgs,
}

pub async fn logs(a: LogsArgs) -> Result<i32> {
    let api = api(&a.api)?;
    let path = sandbox_path(&a.id, &format!("/processes/{}/output", a.pid));
    let resp = api
        .open(Method::GET, &path, "application/json", client::full(""))
        .await
        .with_context(|| format!("attaching to process {} in {}", a.pid, a.id))?;
    let mut events = NdjsonReader::new(resp.into_body());
    if !a.api.json {
        return Ok(exit_code(&pump(&mut events).await?));
    }
    // --json: the events as they come, one per line.
    while let Some((ev, line)) = events.next_event().await? {
        let mut out = std::io::stdout().lock();
        out.write_all(&line)?;
        out.write_all(b"\n")?;
        out.flush()?;
        match ev {
            Event::Exit(x) => return Ok(x.exit_code),
            Event::Error { message, .. } => bail!("{message}"),
            _ => {}
        }
    }
    Err(anyhow!("the stream ended before the process exited"))
}

#[derive(clap::Args)]
pub struct PsArgs {
    /// Sandbox id
    pub id: String,
    #[command(flatten)]
    pub api: ApiArgs,
}

#[derive(Deserialize, serde::Serialize)]
struct ProcessList {
    processes: Vec<ProcessInfo>,
}

pub async fn ps(a: PsArgs) -> Result<i32> {
    let api = api(&a.api)?;
    let l: ProcessList = api
        .call(Method::GET, &sandbox_path(&a.id, "/processes"), None::<&()>)
        .await?;
    if a.api.json {
        output::print_json(&l);
        return Ok(0);
    }
    let rows = l
        .processes
        .iter()
        .map(|p| {
            vec![
                p.pid.to_string(),
                if p.running { "yes" } else { "no" }.to_string(),
                p.exit_code.map(|c| c.to_string()).unwrap_or_default(),
                p.tag.clone().unwrap_or_default(),
                one_line(&p.argv.join(" "), 60),
                output::ago_ms(p.started_at_ms),
            ]
        })
        .collect();
    println!(
        "{}",
        output::table(&["pid", "running", "exit", "tag", "argv", "started"], rows)
    );
    Ok(0)
}

// ---------------------------------------------------------------------------------------
// cp

#[derive(clap::Args)]
pub struct CpArgs {
    /// Source: ID:/path in a sandbox, a local path, or - for stdin
    pub src: String,
    /// Destination: ID:/path in a sandbox, a local path, or - for stdout
    pub dst: String,
    #[command(flatten)]
    pub api: ApiArgs,
}

/// `ID:/path` → (ID, path); sandbox ids contain a '-' and no '/' (`local-0123456789ab`).
fn remote(s: &str) -> Option<(&str, &str)> {
    let (id, path) = s.split_once(':')?;
    (id.contains('-') && !id.contains('/') && !path.is_empty()).then_some((id, path))
}

fn file_name(p: &str) -> Option<&str> {
    p.trim_end_matches('/')
        .rsplit('/')
        .next()
        .filter(|n| !n.is_empty())
}

const CHUNK: usize = 256 * 1024;

pub(crate) fn progress(len: Option<u64>, json: bool) -> indicatif::ProgressBar {
    if json || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let (bar, template) = match len {
        Some(n) => (
            indicatif::ProgressBar::new(n),
            "{bytes}/{total_bytes} [{wide_bar}] {binary_bytes_per_sec} {eta}",
        ),
        None => (
            indicatif::ProgressBar::new_spinner(),
            "{spinner} {bytes} {binary_bytes_per_sec}",
        ),
    };
    if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    bar
}

/// A reader as a streamed request body in 256 KiB chunks, counting on `bar`.
pub(crate) fn body_of(
    reader: Box<dyn AsyncRead + Unpin + Send + Sync>,
    bar: indicatif::ProgressBar,
) -> client::Body {
    let s = futures_util::stream::unfold(Some((reader, bar)), |state| async move {
        let (mut r, bar) = state?;
        let mut buf = vec![0u8; CHUNK];
        match r.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                bar.inc(n as u64);
                Some((Ok(Frame::data(Bytes::from(buf))), Some((r, bar))))
            }
            // The error ends the body (and the request).
            Err(e) => Some((Err(e), None)),
        }
    });
    StreamBody::new(s).boxed()
}

struct Copied {
    direction: &'static str,
    sandbox: String,
    path: String,
    bytes: u64,
    seconds: f64,
}

impl Copied {
    fn report(&self, json: bool, to_stderr: bool) {
        let mbps = self.bytes as f64 / 1e6 / self.seconds.max(1e-6);
        let line = if json {
            serde_json::to_string_pretty(&json!({
                "direction": self.direction, "sandbox": self.sandbox, "path": self.path,
                "bytes": self.bytes, "seconds": self.seconds, "mb_per_s": mbps,
            }))
            .unwrap_or_default()
        } else {
            let verb = if self.direction == "upload" {
                "uploaded to"
            } else {
                "downloaded from"
            };
            format!(
                "{verb} {}:{}: {} bytes in {:.2} s ({mbps:.1} MB/s)",
                self.sandbox, self.path, self.bytes, self.seconds
            )
        };
        // With the data on stdout, the summary goes to stderr.
        if to_stderr {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
    }
}

pub async fn cp(a: CpArgs) -> Result<i32> {
    let api = api(&a.api)?;
    let copied = match (remote(&a.src), remote(&a.dst)) {
        (None, Some((id, path))) => upload(&api, &a.src, id, path, a.api.json).await?,
        (Some((id, path)), None) => download(&api, id, path, &a.dst, a.api.json).await?,
        (Some(_), Some(_)) => bail!("both sides are in a sandbox; one must be a local path"),
        (None, None) => bail!(
            "neither side is in a sandbox: write one as ID:/path (e.g. local-0123456789ab:/root/f)"
        ),
    };
    copied.report(a.api.json, a.dst == "-");
    Ok(0)
}

/// The local source: a reader, its size and permission bits (None for stdin).
pub(crate) async fn open_local(
    src: &str,
) -> Result<(
    Box<dyn AsyncRead + Unpin + Send + Sync>,
    Option<u64>,
    Option<u32>,
)> {
    if src == "-" {
        return Ok((Box::new(tokio::io::stdin()), None, None));
    }
    let f = tokio::fs::File::open(src)
        .await
        .with_context(|| format!("opening {src}"))?;
    let meta = f
        .metadata()
        .await
        .with_context(|| format!("reading {src}"))?;
    if meta.is_dir() {
        bail!("{src} is a directory; dsec cp copies one file");
    }
    let mode = meta.permissions().mode() & 0o7777;
    Ok((Box::new(f), Some(meta.len()), Some(mode)))
}

async fn upload(api: &Api, src: &str, id: &str, path: &str, json: bool) -> Result<Copied> {
    let (reader, size, mode) = open_local(src).await?;
    // A directory target (ending in '/') gets the source's file name.
    let path = match (path.ends_with('/'), file_name(src)) {
        (true, Some(name)) if src != "-" => format!("{path}{name}"),
        (true, _) => bail!("{path} is a directory; name the file to write from stdin"),
        _ => path.to_string(),
    };
    let mut q = format!("/files?path={}", encode(&path, true));
    if let Some(m) = mode {
        q.push_str(&format!("&mode={m:o}"));
    }
    let t0 = Instant::now();
    let bar = progress(size, json);
    let resp = api
        .open(
            Method::PUT,
            &sandbox_path(id, &q),
            "application/octet-stream",
            body_of(reader, bar.clone()),
        )
        .await
        .with_context(|| format!("uploading {src} to {id}:{path}"));
    bar.finish_and_clear();
    let reply = resp?.into_body().collect().await?.to_bytes();
    let written: Value = serde_json::from_slice(&reply).unwrap_or_default();
    Ok(Copied {
        direction: "upload",
        sandbox: id.to_string(),
        path: written["path"].as_str().unwrap_or(&path).to_string(),
        bytes: written["size"].as_u64().unwrap_or(bar.position()),
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// The local destination: stdout for `-`; into a directory under the remote file's name.
pub(crate) async fn create_local(
    dst: &str,
    remote_path: &str,
) -> Result<Box<dyn AsyncWrite + Unpin + Send>> {
    if dst == "-" {
        return Ok(Box::new(tokio::io::stdout()));
    }
    let mut target = PathBuf::from(dst);
    if Path::new(dst).is_dir() {
        let name = file_name(remote_path)
            .ok_or_else(|| anyhow!("{remote_path} has no file name to copy into {dst}"))?;
        target.push(name);
    }
    let f = tokio::fs::File::create(&target)
        .await
        .with_context(|| format!("creating {}", target.display()))?;
    Ok(Box::new(f))
}

async fn download(api: &Api, id: &str, path: &str, dst: &str, json: bool) -> Result<Copied> {
    let t0 = Instant::now();
    let q = format!("/files?path={}", encode(path, true));
    let resp = api
        .open(
            Method::GET,
            &sandbox_path(id, &q),
            "application/json",
            client::full(""),
        )
        .await
        .with_context(|| format!("downloading {id}:{path}"))?;
    let len = resp
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    // Only now that the file exists there: a failed request leaves the local file alone.
    let mut out = create_local(dst, path).await?;
    let bar = progress(len, json);
    let r = copy_body(resp.into_body(), &mut out, &bar).await;
    bar.finish_and_clear();
    let bytes = r.with_context(|| format!("downloading {id}:{path} to {dst}"))?;
    Ok(Copied {
        direction: "download",
        sandbox: id.to_string(),
        path: path.to_string(),
        bytes,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Writes a response body to `out` as it arrives; returns the bytes written.
pub(crate) async fn copy_body(
    mut body: Incoming,
    out: &mut (dyn AsyncWrite + Unpin + Send),
    bar: &indicatif::ProgressBar,
) -> Result<u64> {
    let mut n = 0u64;
    while let Some(frame) = body.frame().await {
        if let Ok(d) = frame?.into_data() {
            out.write_all(&d).await?;
            n += d.len() as u64;
            bar.inc(d.len() as u64);
        }
    }
    out.flush().await?;
    Ok(n)
}

// ---------------------------------------------------------------------------------------
// trajectory

#[derive(clap::Args)]
pub struct TrajectoryArgs {
    /// Sandbox id
    pub id: String,
    /// Trajectory name (without it: list the sandbox's trajectories)
    pub name: Option<String>,
    #[command(flatten)]
    pub api: ApiArgs,
}

#[derive(Deserialize)]
struct Step {
    seq: u64,
    kind: String,
    request: Value,
    #[serde(default)]
    result: Option<Value>,
    started_at_ms: u64,
    #[serde(default)]
    finished_at_ms: Option<u64>,
}

/// `s` on one line, at most `max` characters.
fn one_line(s: &str, max: usize) -> String {
    let flat: String = s
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.chars().count() <= max {
        return flat;
    }
    flat.chars().take(max - 1).collect::<String>() + "…"
}

/// What a step asked for: the command, or the path(s) it touched.
fn request_summary(r: &Value) -> String {
    if let Some(c) = r["cmd"].as_str() {
        return c.to_string();
    }
    if let Some(argv) = r["argv"].as_array() {
        let words: Vec<&str> = argv.iter().filter_map(Value::as_str).collect();
        return words.join(" ");
    }
    if let (Some(from), Some(to)) = (r["from"].as_str(), r["to"].as_str()) {
        return format!("{from} -> {to}");
    }
    if let Some(p) = r["path"].as_str() {
        return match r["size"].as_u64() {
            Some(n) => format!("{p} ({n} bytes)"),
            None => p.to_string(),
        };
    }
    r.to_string()
}

/// What a step did: an exit code, a process id, a size, or `ok`.
fn result_summary(r: Option<&Value>) -> String {
    let Some(r) = r else {
        return "(unfinished)".into();
    };
    if let Some(c) = r["exit_code"].as_i64() {
        return format!("exit {c}");
    }
    if let Some(p) = r["pid"].as_u64() {
        return format!("pid {p}");
    }
    if let Some(n) = r["size"].as_u64() {
        return format!("{n} bytes");
    }
    if r.as_object().is_some_and(|o| o.is_empty()) {
        return "ok".into();
    }
    r.to_string()
}

fn duration(s: &Step) -> String {
    match s.finished_at_ms {
        Some(end) => {
            let ms = end.saturating_sub(s.started_at_ms);
            if ms < 1000 {
                format!("{ms} ms")
            } else {
                format!("{:.1} s", ms as f64 / 1000.0)
            }
        }
        None => "-".into(),
    }
}

pub async fn trajectory(a: TrajectoryArgs) -> Result<i32> {
    let api = api(&a.api)?;
    let path = match &a.name {
        Some(n) => sandbox_path(&a.id, &format!("/trajectories/{}", encode(n, false))),
        None => sandbox_path(&a.id, "/trajectories"),
    };
    let v: Value = api.call(Method::GET, &path, None::<&()>).await?;
    if a.api.json {
        output::print_json(&v);
        return Ok(0);
    }
    if a.name.is_none() {
        let rows = v["trajectories"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| {
                vec![
                    t["name"].as_str().unwrap_or_default().to_string(),
                    t["steps"].to_string(),
                ]
            })
            .collect();
        println!("{}", output::table(&["name", "steps"], rows));
        return Ok(0);
    }
    let steps: Vec<Step> = serde_json::from_value(v["steps"].clone())
        .with_context(|| format!("unexpected reply from {path}"))?;
    let rows = steps
        .iter()
        .map(|s| {
            vec![
                s.seq.to_string(),
                s.kind.clone(),
                one_line(&request_summary(&s.request), 60),
                one_line(&result_summary(s.result.as_ref()), 60),
                duration(s),
            ]
        })
        .collect();
    println!(
        "{}",
        output::table(&["seq", "kind", "request", "result", "duration"], rows)
    );
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_paths() {
        assert_eq!(encode("/root/a b+c.txt", true), "/root/a%20b%2Bc.txt");
        assert_eq!(encode("a/b", false), "a%2Fb");
        assert_eq!(encode("ü", true), "%C3%BC");
    }

    #[test]
    fn tells_remote_from_local() {
        assert_eq!(
            remote("local-0123456789ab:/root/f"),
            Some(("local-0123456789ab", "/root/f"))
        );
        assert_eq!(remote("/tmp/a-b:c"), None);
        assert_eq!(remote("file:x"), None);
        assert_eq!(remote("-"), None);
        assert_eq!(remote("local-1:"), None);
    }

    #[test]
    fn summarizes_steps() {
        assert_eq!(request_summary(&json!({"argv": ["ls", "-l"]})), "ls -l");
        assert_eq!(
            request_summary(&json!({"path": "/a", "size": 3})),
            "/a (3 bytes)"
        );
        assert_eq!(result_summary(Some(&json!({"exit_code": 2}))), "exit 2");
        assert_eq!(result_summary(Some(&json!({}))), "ok");
        assert_eq!(result_summary(None), "(unfinished)");
        assert_eq!(one_line("a\nb", 60), "a b");
        assert_eq!(one_line("abcdef", 4), "abc…");
    }
}
