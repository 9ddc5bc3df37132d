//! Client side of the aether channel: one JSON line out, one back, per connection.

use std::path::Path;
use std::time::Duration;

use dsec_common::ApiError;
use dsec_common::channel::{Request, Response};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// Largest response accepted from a sandbox (it is untrusted input).
const MAX_RESPONSE_BYTES: u64 = 256 << 20;

pub async fn call(sock: &Path, req: &Request, timeout: Duration) -> Result<Response, ApiError> {
    let fut = async {
        let mut s = UnixStream::connect(sock)
            .await
            .map_err(|e| ApiError::unavailable(format!("sandbox agent unreachable: {e}")))?;
        let mut line = serde_json::to_vec(req)
            .map_err(|e| ApiError::internal(format!("encoding request: {e}")))?;
        line.push(b'\n');
        s.write_all(&line)
            .await
            .map_err(|e| ApiError::unavailable(format!("sending to sandbox agent: {e}")))?;
        let mut reader = BufReader::new(s).take(MAX_RESPONSE_BYTES);
        let mut buf = String::new();
        let n = reader
            .read_line(&mut buf)
            .await
            .map_err(|e| ApiError::unavailable(format!("reading from sandbox agent: {e}")))?;
        if n == 0 {
            return Err(ApiError::unavailable(
                "the sandbox agent closed the connection (the sandbox may have stopped)",
            ));
        }
        serde_json::from_str::<Response>(&buf)
            .map_err(|e| ApiError::internal(format!("malformed reply from sandbox agent: {e}")))
    };
    tokio::time::timeout(timeout, fut).await.map_err(|_| {
        ApiError::new(
            dsec_common::ErrorCode::DeadlineExceeded,
            format!(
                "the sandbox agent did not answer within {} s",
                timeout.as_secs_f64()
            ),
        )
    })?
}

/// Waits until aether answers a ping.
pub async fn wait_ready(sock: &Path, within: Duration) -> Result<(), ApiError> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match call(sock, &Request::Ping, Duration::from_secs(2)).await {
            Ok(Response::Pong { .. }) => return Ok(()),
            Ok(other) => {
                return Err(ApiError::internal(format!(
                    "unexpected reply to ping: {other:?}"
                )));
            }
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
