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
use dsec_common::http::{ApiResult, body, json};
use dsec_common::{ApiError, ErrorCode};
use dsec_edge::transfer::{
    EXTENT_HEADER, ExtentWriter, ImportRequest, PeerFuture, Peers, data_extents,
};
use dsec_mtls::{Identity, Role};
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncSeekExt};

use crate::AppState;

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
        .route("/v1/lazy/{hex}/chunks/{index}", get(lazy_chunk))
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

/// A chunk of a lazy blob this edge holds, for another edge's lazy file system (which
/// checks it against its own chunk table): never fetched for the asker, 404 when not
/// held.
async fn lazy_chunk(
    State(st): State<AppState>,
    peer: Option<Extension<Identity>>,
    Path((hex, index)): Path<(String, u64)>,
) -> ApiResult<Response> {
    from_edge(peer)?;
    if !dsec_image::digest::valid_digest(&hex) {
        return Err(ApiError::invalid(format!("{hex:?} is not a blob digest")).into());
    }
    let store = st.edge.images().root().to_path_buf();
    let hex2 = hex.clone();
    let held =
        tokio::task::spawn_blocking(move || dsec_image::lazy::held_chunk(&store, &hex2, index))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?
            .map_err(|e| ApiError::internal(e.to_string()))?;
    match held {
        Some(b) => Ok((
            [(header::CONTENT_TYPE, "application/octet-stream")],
            Body::from(b),
        )
            .into_response()),
        None => Err(ApiError::new(
            ErrorCode::NotFound,
            format!("this edge does not hold chunk {index} of blob {hex}"),
        )
        .into()),
    }
}

/// How long a peer may take to answer for a chunk before the registry is asked instead:
/// this, and a second for each 32 MiB of the chunk.
const CHUNK_TIMEOUT: Duration = Duration::from_secs(3);
/// How many edges are asked for one chunk: chosen by the chunk, so that the nodes that
/// fetched it first (and hold it) are asked by the others, and a cluster's asks grow with
/// its chunks, not with its chunks times its edges.
const ASKED_PER_CHUNK: usize = 2;

/// Where an edge tells its store's lazy file system (`dsec lazyfs`, a process of its
/// own that outlives the edge) which edges to ask for chunks, and with which
/// certificate: `<store>/lazy/peers.json`.
pub fn lazy_peers_file(store: &FsPath) -> std::path::PathBuf {
    store.join("lazy").join("peers.json")
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct LazyPeersFile {
    tls: dsec_mtls::TlsFiles,
    edges: BTreeMap<String, String>,
}

/// Writes [`lazy_peers_file`] (root's alone, as the directory is).
pub fn write_lazy_peers(
    store: &FsPath,
    tls: &dsec_mtls::TlsFiles,
    edges: &BTreeMap<String, String>,
) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let p = lazy_peers_file(store);
    if let Some(dir) = p.parent() {
        match std::fs::DirBuilder::new().mode(0o700).create(dir) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
            _ => {}
        }
    }
    // Absolute: the lazy file system outlives the edge, in a directory of its own.
    let tls = dsec_mtls::TlsFiles {
        ca: std::path::absolute(&tls.ca)?,
        cert: std::path::absolute(&tls.cert)?,
        key: std::path::absolute(&tls.key)?,
    };
    let body = serde_json::to_vec_pretty(&LazyPeersFile {
        tls,
        edges: edges.clone(),
    })
    .map_err(std::io::Error::other)?;
    let tmp = p.with_extension(format!("tmp-{}", dsec_common::id::random_hex(6)));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(&body)?;
    f.sync_all()?;
    std::fs::rename(&tmp, &p)
}

/// The edges a lazy file system asks for chunks, as [`lazy_peers_file`] names them:
/// read again whenever the file changes (an edge restarted with another cluster), and
/// none while it is missing or unreadable.
pub struct LazyPeers {
    file: std::path::PathBuf,
    current: std::sync::Mutex<(
        Option<std::time::SystemTime>,
        Option<std::sync::Arc<MtlsPeers>>,
    )>,
    /// Edges that did not answer, left out until then (so that a node that is down
    /// costs one timeout, not one per chunk).
    quiet: std::sync::Arc<std::sync::Mutex<BTreeMap<String, std::time::Instant>>>,
}

/// How long an edge that did not answer is left out.
const QUIET_FOR: Duration = Duration::from_secs(30);

impl LazyPeers {
    pub fn new(store: &FsPath) -> LazyPeers {
        LazyPeers {
            file: lazy_peers_file(store),
            current: std::sync::Mutex::new((None, None)),
            quiet: Default::default(),
        }
    }

    fn peers(&self) -> Option<std::sync::Arc<MtlsPeers>> {
        let mtime = std::fs::metadata(&self.file)
            .and_then(|m| m.modified())
            .ok();
        let mut cur = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if cur.0 != mtime || mtime.is_none() {
            let loaded = mtime.and_then(|_| {
                let f: LazyPeersFile = serde_json::from_slice(&std::fs::read(&self.file).ok()?)
                    .map_err(|e| tracing::warn!("{}: {e}", self.file.display()))
                    .ok()?;
                let tls = dsec_mtls::Tls::load(&f.tls)
                    .map_err(|e| tracing::warn!("the certificate for peer edges: {e}"))
                    .ok()?;
                tracing::info!(edges = f.edges.len(), "peer edges for lazy chunks");
                Some(std::sync::Arc::new(MtlsPeers::new(
                    dsec_mtls::Client::new(Some(tls.client.clone())),
                    f.edges,
                )))
            });
            *cur = (mtime, loaded);
        }
        cur.1.clone()
    }
}

impl dsec_image::lazy::PeerChunks for LazyPeers {
    /// Two edges chosen by the chunk, at once; the first to send it wins.
    fn chunk(&self, hex: &str, index: u64, len: u64) -> dsec_image::lazy::PeerFetched {
        let peers = self.peers();
        let within = CHUNK_TIMEOUT + Duration::from_secs(len >> 25);
        // Where in the ring of edges this chunk's asks start.
        let start = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (hex, index).hash(&mut h);
            h.finish() as usize
        };
        let path = format!("/v1/lazy/{hex}/chunks/{index}");
        let quiet = self.quiet.clone();
        Box::pin(async move {
            let peers = peers?;
            let now = std::time::Instant::now();
            let asked: Vec<String> = {
                let mut q = quiet.lock().unwrap_or_else(|e| e.into_inner());
                q.retain(|_, until| *until > now);
                let up: Vec<&String> = peers.edges.keys().filter(|e| !q.contains_key(*e)).collect();
                (0..up.len().min(ASKED_PER_CHUNK))
                    .map(|i| up[(start + i) % up.len()].clone())
                    .collect()
            };
            let (peers, path) = (&peers, &path);
            let mut asks: futures_util::stream::FuturesUnordered<_> = asked
                .iter()
                .map(|edge| async move { (edge, peers.get_within(edge, path, within).await) })
                .collect();
            use futures_util::StreamExt;
            while let Some((edge, r)) = asks.next().await {
                match r {
                    Ok(b) => return Some(b),
                    Err(e) if e.code == ErrorCode::Unavailable => {
                        tracing::info!(
                            "edge {edge} left out of chunk fetches for {QUIET_FOR:?}: {}",
                            e.message
                        );
                        quiet
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(edge.clone(), std::time::Instant::now() + QUIET_FOR);
                    }
                    Err(_) => {}
                }
            }
            None
        })
    }
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

impl MtlsPeers {
    /// `GET`s `path` on `edge`, answer and body within `timeout` each.
    fn get_within(&self, edge: &str, path: &str, timeout: Duration) -> PeerFuture<'_, Vec<u8>> {
        let (edge, url) = (edge.to_string(), self.url(edge, path));
        Box::pin(async move {
            let req = hyper::Request::get(url?)
                .body(Body::empty())
                .map_err(|e| ApiError::internal(e.to_string()))?;
            let resp = self.send(&edge, req, timeout).await?;
            read_all(&edge, resp, timeout).await
        })
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
        self.get_within(edge, path, CALL_TIMEOUT)
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
            w.finish().map_err(|e| local(e.to_string()))
        })
    }
}
