//! Edge to edge: the routes through which one edge pulls a saved VM state from another (a
//! resume or fork placed on another edge), and the mutual-TLS client an edge reaches its
//! peers with. Only a peer presenting an edge certificate of the cluster gets in.

use std::collections::BTreeMap;
use std::path::Path as FsPath;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Extension, Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use dsec_common::{ApiError, ErrorCode};
use dsec_edge::transfer::{
    EXTENT_HEADER, ExtentWriter, ImportRequest, PeerFuture, Peers, data_extents,
};
use dsec_mtls::{Identity, Role};
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncSeekExt};

use crate::{ApiResult, AppState, body, json};

/// The most a JSON answer from a peer may be.
const MAX_JSON: usize = 64 << 20;
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// A download may take long, but not stand still.
const STALL: Duration = Duration::from_secs(60);

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/imports", post(import))
        .route("/v1/exports/{token}", get(manifest))
        .route("/v1/exports/{token}/files/{name}", get(file))
}

fn from_edge(peer: Option<Extension<Identity>>) -> ApiResult<()> {
    match peer {
        Some(Extension(i)) if i.role == Role::Edge => Ok(()),
        _ => Err(ApiError::new(
            ErrorCode::PermissionDenied,
            "only the cluster's edges may use this endpoint (mutual TLS with an edge certificate)",
        )
        .into()),
    }
}

async fn import(
    State(st): State<AppState>,
    peer: Option<Extension<Identity>>,
    bytes: Bytes,
) -> ApiResult<Response> {
    from_edge(peer)?;
    let req: ImportRequest = body(&bytes, "import")?;
    Ok(json(StatusCode::OK, &st.edge.import(req).await?))
}

async fn manifest(
    State(st): State<AppState>,
    peer: Option<Extension<Identity>>,
    Path(token): Path<String>,
) -> ApiResult<Response> {
    from_edge(peer)?;
    Ok(json(StatusCode::OK, &st.edge.offers().manifest(&token)?))
}

async fn file(
    State(st): State<AppState>,
    peer: Option<Extension<Identity>>,
    Path((token, name)): Path<(String, String)>,
) -> ApiResult<Response> {
    from_edge(peer)?;
    let path = st.edge.offers().file(&token, &name)?;
    let open = |p: &std::path::Path| -> Result<(std::fs::File, u64), ApiError> {
        let f = std::fs::File::open(p)
            .map_err(|e| ApiError::internal(format!("opening {}: {e}", p.display())))?;
        let len = f
            .metadata()
            .map_err(|e| ApiError::internal(format!("{}: {e}", p.display())))?
            .len();
        Ok((f, len))
    };
    let (f, len) = open(&path)?;
    let extents = data_extents(&f, len);
    let wire_len: u64 = extents.iter().map(|(_, l)| EXTENT_HEADER as u64 + l).sum();
    let f = tokio::fs::File::from_std(f);
    // State: the file, the extents still to send, and the bytes left of the current one.
    let chunks =
        futures_util::stream::unfold(Some((f, extents.into_iter(), 0u64)), |state| async move {
            let (mut f, mut rest, left) = state?;
            if left == 0 {
                let (off, len) = rest.next()?;
                if let Err(e) = f.seek(std::io::SeekFrom::Start(off)).await {
                    return Some((Err(e), None));
                }
                let mut h = off.to_be_bytes().to_vec();
                h.extend_from_slice(&len.to_be_bytes());
                return Some((Ok(Bytes::from(h)), Some((f, rest, len))));
            }
            let mut buf = vec![0u8; left.min(1 << 20) as usize];
            match f.read_exact(&mut buf).await {
                Ok(_) => {
                    let n = buf.len() as u64;
                    Some((
                        Ok::<_, std::io::Error>(Bytes::from(buf)),
                        Some((f, rest, left - n)),
                    ))
                }
                Err(e) => Some((Err(e), None)),
            }
        });
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_LENGTH, wire_len.to_string()),
        ],
        Body::from_stream(chunks),
    )
        .into_response())
}

/// The other edges, by name, over mutual TLS with this edge's certificate.
pub struct MtlsPeers {
    client: dsec_mtls::Client,
    edges: BTreeMap<String, String>,
}

impl MtlsPeers {
    pub fn new(client: dsec_mtls::Client, edges: BTreeMap<String, String>) -> MtlsPeers {
        MtlsPeers { client, edges }
    }

    fn url(&self, edge: &str, path: &str) -> Result<String, ApiError> {
        let addr = self.edges.get(edge).ok_or_else(|| {
            ApiError::invalid(format!(
                "edge {edge:?} is not part of this cluster (known: {})",
                self.edges.keys().cloned().collect::<Vec<_>>().join(", ")
            ))
        })?;
        Ok(format!("{}{path}", self.client.base(addr)))
    }

    async fn send(
        &self,
        edge: &str,
        req: hyper::Request<Body>,
        timeout: Duration,
    ) -> Result<hyper::Response<hyper::body::Incoming>, ApiError> {
        let unreachable = |e: String| {
            ApiError::unavailable(format!("edge {edge} does not answer ({e}); try again"))
        };
        let resp = tokio::time::timeout(timeout, self.client.request(req))
            .await
            .map_err(|_| unreachable(format!("nothing within {timeout:?}")))?
            .map_err(|e| {
                use std::error::Error;
                unreachable(match e.source() {
                    Some(s) => format!("{e}: {s}"),
                    None => e.to_string(),
                })
            })?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        // Its error as it gave it (code and sentence), else its status.
        let status = resp.status();
        let bytes = read_all(edge, resp, CALL_TIMEOUT).await.unwrap_or_default();
        Err(serde_json::from_slice::<ApiError>(&bytes)
            .map(|e| ApiError::new(e.code, format!("edge {edge}: {}", e.message)))
            .unwrap_or_else(|_| ApiError::unavailable(format!("edge {edge} answered {status}"))))
    }
}

async fn read_all(
    edge: &str,
    resp: hyper::Response<hyper::body::Incoming>,
    timeout: Duration,
) -> Result<Vec<u8>, ApiError> {
    let body = http_body_util::Limited::new(resp.into_body(), MAX_JSON);
    let got = tokio::time::timeout(timeout, body.collect())
        .await
        .map_err(|_| ApiError::unavailable(format!("edge {edge}'s answer did not finish")))?
        .map_err(|e| ApiError::unavailable(format!("reading edge {edge}'s answer: {e}")))?;
    Ok(got.to_bytes().to_vec())
}

impl Peers for MtlsPeers {
    fn post(
        &self,
        edge: &str,
        path: &str,
        body: Vec<u8>,
        timeout: Duration,
    ) -> PeerFuture<'_, Vec<u8>> {
        let (edge, url) = (edge.to_string(), self.url(edge, path));
        Box::pin(async move {
            let req = dsec_mtls::client::post_json(&url?, body)
                .map_err(|e| ApiError::internal(e.to_string()))?;
            let resp = self.send(&edge, req, timeout).await?;
            read_all(&edge, resp, timeout).await
        })
    }

    fn get(&self, edge: &str, path: &str) -> PeerFuture<'_, Vec<u8>> {
        let (edge, url) = (edge.to_string(), self.url(edge, path));
        Box::pin(async move {
            let req = hyper::Request::get(url?)
                .body(Body::empty())
                .map_err(|e| ApiError::internal(e.to_string()))?;
            let resp = self.send(&edge, req, CALL_TIMEOUT).await?;
            read_all(&edge, resp, CALL_TIMEOUT).await
        })
    }

    fn download(&self, edge: &str, path: &str, dest: &FsPath, size: u64) -> PeerFuture<'_, u64> {
        let (edge, url, dest) = (edge.to_string(), self.url(edge, path), dest.to_path_buf());
        Box::pin(async move {
            let req = hyper::Request::get(url?)
                .body(Body::empty())
                .map_err(|e| ApiError::internal(e.to_string()))?;
            let resp = self.send(&edge, req, CALL_TIMEOUT).await?;
            let local = |e: String| ApiError::internal(format!("writing {}: {e}", dest.display()));
            let f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&dest)
                .map_err(|e| local(e.to_string()))?;
            let mut w = ExtentWriter::new(f, size);
            let mut body = resp.into_body();
            loop {
                let frame = tokio::time::timeout(STALL, body.frame())
                    .await
                    .map_err(|_| {
                        ApiError::unavailable(format!(
                            "edge {edge} stopped sending {} for {STALL:?}",
                            dest.display()
                        ))
                    })?;
                let Some(frame) = frame else { break };
                let frame = frame.map_err(|e| {
                    ApiError::unavailable(format!("receiving from edge {edge}: {e}"))
                })?;
                if let Some(data) = frame.data_ref() {
                    // Small writes to a local file: not worth a blocking-pool hop each.
                    w.feed(data).map_err(|e| {
                        ApiError::unavailable(format!("edge {edge} sent {}: {e}", dest.display()))
                    })?;
                }
            }
            w.finish().map_err(local)
        })
    }
}
