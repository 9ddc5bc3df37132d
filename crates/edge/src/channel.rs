//! Client side of the aether channel: a request line out, then frames (see
//! `dsec_common::channel`). Everything read from the sandbox is untrusted input: frame
//! sizes are bounded and malformed replies are errors, never panics.

use std::path::Path;
use std::time::Duration;

use dsec_common::channel::{
    FRAME_DATA, FRAME_JSON, FRAME_STDERR, FRAME_STDOUT, MAX_FRAME, MAX_STREAM_OUTPUT, Request,
    Response, merge_output,
};
use dsec_common::{ApiError, ErrorCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

/// One open channel connection.
pub struct Conn {
    r: BufReader<OwnedReadHalf>,
    w: BufWriter<OwnedWriteHalf>,
    /// Output bytes per stream the reply may carry ahead of it (see [`output_cap`]).
    output_cap: usize,
}

/// How much output per stream a request's reply may bring as `O`/`E` frames: what the
/// request asked aether to keep (three times, for text decoded lossily), else the most any
/// reply carries; none for requests whose replies carry no output.
fn output_cap(req: &Request) -> usize {
    let per_stream = match req {
        Request::Exec(spec) => spec.max_output_bytes.min(MAX_STREAM_OUTPUT),
        Request::SessionRun { .. } | Request::SessionCommand { .. } => MAX_STREAM_OUTPUT,
        _ => 0,
    };
    (per_stream as usize).saturating_mul(3)
}

fn gone(e: std::io::Error) -> ApiError {
    ApiError::unavailable(format!(
        "lost the connection to the sandbox agent (the sandbox may have stopped): {e}"
    ))
}

/// Turns an agent's error reply into an [`ApiError`]; other replies pass through.
pub fn check(r: Response) -> Result<Response, ApiError> {
    match r {
        Response::Error { code, message } => Err(ApiError::new(code, message)),
        other => Ok(other),
    }
}

pub fn unexpected(r: &Response) -> ApiError {
    ApiError::internal(format!("unexpected reply from the sandbox agent: {r:?}"))
}

impl Conn {
    pub async fn open(sock: &Path, req: &Request) -> Result<Conn, ApiError> {
        let s = UnixStream::connect(sock)
            .await
            .map_err(|e| ApiError::unavailable(format!("sandbox agent unreachable: {e}")))?;
        let (r, w) = s.into_split();
        let mut c = Conn {
            r: BufReader::with_capacity(64 << 10, r),
            w: BufWriter::with_capacity(64 << 10, w),
            output_cap: 0,
        };
        c.send(req).await?;
        Ok(c)
    }

    /// Sends a request line on this connection.
    async fn send(&mut self, req: &Request) -> Result<(), ApiError> {
        self.output_cap = output_cap(req);
        let mut line = serde_json::to_vec(req)
            .map_err(|e| ApiError::internal(format!("encoding request: {e}")))?;
        line.push(b'\n');
        self.w.write_all(&line).await.map_err(gone)?;
        self.w.flush().await.map_err(gone)
    }

    /// The next frame; `None` when the agent closed the connection.
    pub async fn frame(&mut self) -> Result<Option<(u8, Vec<u8>)>, ApiError> {
        let mut head = [0u8; 5];
        match self.r.read_exact(&mut head).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(gone(e)),
        }
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]);
        if len > MAX_FRAME {
            return Err(ApiError::internal(format!(
                "the sandbox agent sent a {len}-byte frame, over the {MAX_FRAME}-byte limit"
            )));
        }
        // Grown as bytes arrive, never sized by the header alone: a guest that announces a
        // huge frame costs only what it really sends.
        let mut body = Vec::with_capacity((len as usize).min(1 << 20));
        let got = (&mut self.r)
            .take(len as u64)
            .read_to_end(&mut body)
            .await
            .map_err(gone)?;
        if got != len as usize {
            return Err(gone(std::io::Error::from(
                std::io::ErrorKind::UnexpectedEof,
            )));
        }
        Ok(Some((head[0], body)))
    }

    /// The next reply: the output frames ahead of it (up to the request's cap per
    /// stream), then a JSON frame; agent errors become `Err`.
    pub async fn reply(&mut self) -> Result<Response, ApiError> {
        check(self.whole_reply().await?)
    }

    /// [`Conn::reply`] with an agent's error reply left as it is: `Ok` means the reply
    /// was read to its end, and the connection can carry another request.
    async fn whole_reply(&mut self) -> Result<Response, ApiError> {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        loop {
            match self.frame().await? {
                Some((FRAME_JSON, body)) => {
                    let r = serde_json::from_slice(&body).map_err(|e| {
                        ApiError::internal(format!("malformed reply from the sandbox agent: {e}"))
                    })?;
                    return Ok(merge_output(r, &out, &err));
                }
                Some((k @ (FRAME_STDOUT | FRAME_STDERR), body)) => {
                    let buf = if k == FRAME_STDOUT {
                        &mut out
                    } else {
                        &mut err
                    };
                    if buf.len() + body.len() > self.output_cap {
                        return Err(ApiError::internal(format!(
                            "the sandbox agent sent more than {} bytes of output for one \
                             stream of a reply",
                            self.output_cap
                        )));
                    }
                    buf.extend_from_slice(&body);
                }
                Some((k, _)) => {
                    return Err(ApiError::internal(format!(
                        "the sandbox agent sent a {:?} frame where a reply was due",
                        k as char
                    )));
                }
                None => {
                    return Err(ApiError::unavailable(
                        "the sandbox agent closed the connection (the sandbox may have stopped)",
                    ));
                }
            }
        }
    }

    /// Sends a chunk of data; an empty chunk ends the data.
    pub async fn data(&mut self, d: &[u8]) -> Result<(), ApiError> {
        let mut head = [0u8; 5];
        head[0] = FRAME_DATA;
        head[1..].copy_from_slice(&(d.len() as u32).to_be_bytes());
        self.w.write_all(&head).await.map_err(gone)?;
        self.w.write_all(d).await.map_err(gone)?;
        if d.is_empty() {
            self.w.flush().await.map_err(gone)?;
        }
        Ok(())
    }
}

fn deadline_error(timeout: Duration) -> ApiError {
    ApiError::new(
        ErrorCode::DeadlineExceeded,
        format!(
            "the sandbox agent did not answer within {} s",
            timeout.as_secs_f64()
        ),
    )
}

/// One request, one reply.
pub async fn call(sock: &Path, req: &Request, timeout: Duration) -> Result<Response, ApiError> {
    check(answer(sock, req, timeout).await?)
}

/// [`call`] with an agent's error reply left as it is: `Err` only when no answer came.
async fn answer(sock: &Path, req: &Request, timeout: Duration) -> Result<Response, ApiError> {
    tokio::time::timeout(timeout, async {
        Conn::open(sock, req).await?.whole_reply().await
    })
    .await
    .map_err(|_| deadline_error(timeout))?
}

/// Agent connections of one sandbox kept open between calls: aether serves request after
/// request on a connection until the edge closes it, so a call on a kept connection costs
/// no connect, and aether no new thread. Each kept connection is an idle thread in the
/// sandbox (counted against its pids limit), so few are kept.
#[derive(Default)]
pub struct Kept(std::sync::Mutex<Vec<Conn>>);

const KEPT_MAX: usize = 2;

impl Kept {
    fn take(&self) -> Option<Conn> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).pop()
    }

    /// Forgets every kept connection (the agent they reach has ended).
    pub fn clear(&self) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    pub(crate) fn put(&self, c: Conn) {
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() < KEPT_MAX {
            kept.push(c);
        }
    }
}

/// [`call`] on a kept connection of the sandbox when there is one. A kept connection the
/// agent has closed (it restarted, or an older aether that answers one request per
/// connection) refuses the request line at once (EPIPE), before anything ran, so the
/// request goes out again on a new connection; it is never sent twice.
pub async fn call_kept(
    kept: &Kept,
    sock: &Path,
    req: &Request,
    timeout: Duration,
) -> Result<Response, ApiError> {
    tokio::time::timeout(timeout, async {
        let mut conn = open_kept(kept, sock, req).await?;
        let r = conn.whole_reply().await?;
        kept.put(conn);
        check(r)
    })
    .await
    .map_err(|_| deadline_error(timeout))?
}

/// `req` sent on a kept connection of the sandbox when there is one (see [`call_kept`]),
/// else on a new one.
pub async fn open_kept(kept: &Kept, sock: &Path, req: &Request) -> Result<Conn, ApiError> {
    match kept.take() {
        Some(mut c) => match c.send(req).await {
            Ok(()) => Ok(c),
            Err(_) => Conn::open(sock, req).await,
        },
        None => Conn::open(sock, req).await,
    }
}

/// Waits until aether answers a ping, giving up as soon as `alive` says the sandbox's
/// process is gone (a VM whose guest crashed while booting answers nothing, and would be
/// waited for in vain).
pub async fn wait_ready(
    sock: &Path,
    within: Duration,
    alive: impl Fn() -> bool,
) -> Result<(), ApiError> {
    match wait_ready_with(sock, &Request::Ping, within, alive).await? {
        Response::Pong { .. } => Ok(()),
        other => Err(unexpected(&other)),
    }
}

/// [`wait_ready_with`] for a request the agent answers with `Ok`.
pub async fn wait_ready_ok(
    sock: &Path,
    req: &Request,
    within: Duration,
    alive: impl Fn() -> bool,
) -> Result<(), ApiError> {
    match wait_ready_with(sock, req, within, alive).await? {
        Response::Ok => Ok(()),
        other => Err(unexpected(&other)),
    }
}

/// [`wait_ready`] with `req` as the probe instead of a ping, answered with the agent's
/// reply: a sandbox's first request (its environment, or that it was restored) doubles as
/// the wait, which saves a round trip into a guest that has just started. `req` is sent
/// again after a connection that failed or timed out, so it must be safe to repeat.
pub async fn wait_ready_with(
    sock: &Path,
    req: &Request,
    within: Duration,
    alive: impl Fn() -> bool,
) -> Result<Response, ApiError> {
    let deadline = tokio::time::Instant::now() + within;
    let mut checked = tokio::time::Instant::now();
    loop {
        if checked.elapsed() >= Duration::from_millis(100) {
            checked = tokio::time::Instant::now();
            if !alive() {
                return Err(ApiError::unavailable(
                    "the sandbox's process exited before its agent started",
                ));
            }
        }
        match answer(sock, req, Duration::from_secs(2)).await {
            // The agent answered: an error it replies ends the wait (it would say the same
            // again), only a connection that failed or timed out is tried again.
            Ok(r) => return check(r),
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(ApiError::unavailable(format!(
                    "the sandbox agent did not start within {} s: {}",
                    within.as_secs(),
                    e.message
                )));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_common::api::ExecResult;
    use dsec_common::channel::{ExecSpec, write_frame, write_reply};
    use std::io::Write;

    /// Serves one connection on a fresh socket with `agent`, which gets the request line
    /// and writes what it likes.
    fn agent(
        agent: impl FnOnce(&mut std::os::unix::net::UnixStream) + Send + 'static,
    ) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("aether.sock");
        let l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            let mut line = [0u8; 1];
            while std::io::Read::read(&mut c, &mut line).unwrap_or(0) == 1 && line[0] != b'\n' {}
            agent(&mut c);
            let _ = c.flush();
        });
        (dir, sock)
    }

    fn exec(max: u64) -> Request {
        Request::Exec(ExecSpec {
            argv: vec!["true".into()],
            max_output_bytes: max,
            ..Default::default()
        })
    }

    #[tokio::test]
    async fn output_ahead_of_a_reply_is_put_back_into_it() {
        let (_d, sock) = agent(|c| {
            let r = Response::Exec(ExecResult {
                stdout: "x".repeat(3 << 20),
                stderr: "oops".into(),
                exit_code: 1,
                ..Default::default()
            });
            write_reply(c, r).unwrap();
        });
        let r = call(&sock, &exec(4 << 20), Duration::from_secs(10))
            .await
            .unwrap();
        let Response::Exec(x) = r else {
            panic!("{r:?}")
        };
        assert_eq!(
            (x.stdout.len(), x.stderr.as_str(), x.exit_code),
            (3 << 20, "oops", 1)
        );
    }

    /// A hostile agent that sends more output than the request allowed, or announces a
    /// frame over the limit, gets an error, not an edge holding what it sent.
    #[tokio::test]
    async fn an_agent_cannot_make_the_edge_hold_more_than_it_asked_for() {
        let (_d, sock) = agent(|c| {
            for _ in 0..64 {
                if write_frame(c, FRAME_STDOUT, &[b'x'; 64 << 10]).is_err() {
                    return;
                }
            }
        });
        let e = call(&sock, &exec(1 << 20), Duration::from_secs(10))
            .await
            .unwrap_err();
        assert!(
            e.message.contains("more than 3145728 bytes of output"),
            "{}",
            e.message
        );

        let (_d, sock) = agent(|c| {
            let _ = c.write_all(&[FRAME_JSON]);
            let _ = c.write_all(&(MAX_FRAME + 1).to_be_bytes());
        });
        let e = call(&sock, &Request::Ping, Duration::from_secs(10))
            .await
            .unwrap_err();
        assert!(e.message.contains("over the"), "{}", e.message);

        // Output frames before a reply that carries none are refused outright.
        let (_d, sock) = agent(|c| {
            let _ = write_frame(c, FRAME_STDOUT, b"x");
        });
        let e = call(&sock, &Request::Ping, Duration::from_secs(10))
            .await
            .unwrap_err();
        assert!(e.message.contains("more than 0 bytes"), "{}", e.message);
    }

    /// An agent on a fresh socket that answers `Pong` to each request line, serving
    /// `per_conn` requests per connection (1: an older aether) and counting connections
    /// and requests.
    fn counting_agent(
        per_conn: usize,
    ) -> (
        tempfile::TempDir,
        std::path::PathBuf,
        Arc<std::sync::atomic::AtomicUsize>,
        Arc<std::sync::atomic::AtomicUsize>,
    ) {
        use std::io::BufRead;
        use std::sync::atomic::Ordering::SeqCst;
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("aether.sock");
        let l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let (conns, reqs) = (Arc::default(), Arc::default());
        let (c2, r2): (
            Arc<std::sync::atomic::AtomicUsize>,
            Arc<std::sync::atomic::AtomicUsize>,
        ) = (Arc::clone(&conns), Arc::clone(&reqs));
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(mut c) = c else { return };
                c2.fetch_add(1, SeqCst);
                let mut r = std::io::BufReader::new(c.try_clone().unwrap());
                for _ in 0..per_conn {
                    let mut line = String::new();
                    if r.read_line(&mut line).unwrap_or(0) == 0 {
                        break;
                    }
                    r2.fetch_add(1, SeqCst);
                    let pong = Response::Pong { version: 3, pid: 1 };
                    if write_reply(&mut c, pong).is_err() {
                        break;
                    }
                }
            }
        });
        (dir, sock, conns, reqs)
    }

    use std::sync::Arc;

    #[tokio::test]
    async fn a_kept_connection_carries_the_next_call() {
        use std::sync::atomic::Ordering::SeqCst;
        let (_d, sock, conns, reqs) = counting_agent(usize::MAX);
        let kept = Kept::default();
        for _ in 0..5 {
            let r = call_kept(&kept, &sock, &Request::Ping, Duration::from_secs(10)).await;
            assert!(matches!(r, Ok(Response::Pong { .. })), "{r:?}");
        }
        assert_eq!((conns.load(SeqCst), reqs.load(SeqCst)), (1, 5));
    }

    /// An agent that closes after each reply: every call still gets its answer, on a
    /// new connection, and no request is sent twice.
    #[tokio::test]
    async fn a_connection_the_agent_closed_is_replaced_without_sending_twice() {
        use std::sync::atomic::Ordering::SeqCst;
        let (_d, sock, conns, reqs) = counting_agent(1);
        let kept = Kept::default();
        for _ in 0..5 {
            let r = call_kept(&kept, &sock, &Request::Ping, Duration::from_secs(10)).await;
            assert!(matches!(r, Ok(Response::Pong { .. })), "{r:?}");
            // Let the agent's side of the last connection close before the next call.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!((conns.load(SeqCst), reqs.load(SeqCst)), (5, 5));
    }
}
