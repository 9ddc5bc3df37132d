//! Client side of the aether channel: a request line out, then frames (see
//! `dsec_common::channel`). Everything read from the sandbox is untrusted input: frame
//! sizes are bounded and malformed replies are errors, never panics.

use std::path::Path;
use std::time::Duration;

use dsec_common::channel::{FRAME_DATA, FRAME_JSON, MAX_FRAME, Request, Response};
use dsec_common::{ApiError, ErrorCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

/// One open channel connection.
pub struct Conn {
    r: BufReader<OwnedReadHalf>,
    w: BufWriter<OwnedWriteHalf>,
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
            r: BufReader::with_capacity(256 << 10, r),
            w: BufWriter::with_capacity(256 << 10, w),
        };
        let mut line = serde_json::to_vec(req)
            .map_err(|e| ApiError::internal(format!("encoding request: {e}")))?;
        line.push(b'\n');
        c.w.write_all(&line).await.map_err(gone)?;
        c.w.flush().await.map_err(gone)?;
        Ok(c)
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

    /// The next frame, which must be a JSON reply; agent errors become `Err`.
    pub async fn reply(&mut self) -> Result<Response, ApiError> {
        match self.frame().await? {
            Some((FRAME_JSON, body)) => check(serde_json::from_slice(&body).map_err(|e| {
                ApiError::internal(format!("malformed reply from the sandbox agent: {e}"))
            })?),
            Some((k, _)) => Err(ApiError::internal(format!(
                "the sandbox agent sent a {:?} frame where a reply was due",
                k as char
            ))),
            None => Err(ApiError::unavailable(
                "the sandbox agent closed the connection (the sandbox may have stopped)",
            )),
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
    tokio::time::timeout(timeout, async {
        Conn::open(sock, req).await?.reply().await
    })
    .await
    .map_err(|_| deadline_error(timeout))?
}

/// Waits until aether answers a ping.
pub async fn wait_ready(sock: &Path, within: Duration) -> Result<(), ApiError> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match call(sock, &Request::Ping, Duration::from_secs(2)).await {
            Ok(Response::Pong { .. }) => return Ok(()),
            Ok(other) => return Err(unexpected(&other)),
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
