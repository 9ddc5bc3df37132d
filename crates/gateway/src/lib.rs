//! The E2B-compatible gateway: E2B's control-plane REST API and its in-sandbox protocol
//! (envd: `/health`, `/files` and the Connect-RPC `process` and `filesystem` services, JSON
//! and binary protobuf codecs) mapped onto the OpenDsec REST API, so programs written for the `e2b` SDKs
//! run unchanged with `E2B_API_URL`, `E2B_SANDBOX_URL` (both this gateway's URL) and
//! `E2B_API_KEY` (an OpenDsec API key).
//!
//! Control-plane calls are made with the caller's key, so IAM, projects and quotas apply
//! as for any OpenDsec call. In-sandbox calls carry no API key, only the sandbox's
//! `envdAccessToken`: an HMAC of the sandbox id under the gateway's secret, handed out by
//! create/connect/get to callers who may see the sandbox; with it the gateway acts on
//! that one sandbox with its own service key.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

pub mod connect;
mod control;
mod envd;
mod events;
mod files;
mod multipart;
mod ports;
mod process;
pub mod proto;
mod snapshots;
mod templates;
pub mod untar;
mod volumes;

/// Inputs each fuzz target runs as a property test under `cargo test` (CI).
#[cfg(test)]
pub(crate) const FUZZ_CASES: usize = 2000;
pub mod upstream;
mod watch;

pub use templates::Builder;

use upstream::{UpErr, Upstream};

/// The `envdVersion` the gateway reports: the SDK turns features on by it, so it is the
/// newest version whose features are all served: octet-stream and gzip uploads (0.5.7),
/// file metadata as `user.e2b.*` extended attributes (0.6.2), entries in watch events
/// (0.6.3), and watches refused on network filesystems unless allowed (0.6.4).
pub const ENVD_VERSION: &str = "0.6.4";
/// The port envd listens on in an E2B sandbox; the SDK names it in `E2b-Sandbox-Port`.
pub const ENVD_PORT: u16 = 49983;
/// The label that keeps a sandbox's E2B template id.
pub const TEMPLATE_LABEL: &str = dsec_common::e2b::TEMPLATE_LABEL;
/// The label of a sandbox the gateway created with `allowPublicTraffic` (E2B's default):
/// its ports are open to anyone with the URL. Every other sandbox's ports want its traffic
/// token or a key that can see it. (A native client may set the label on its own
/// sandboxes; that opens only their ports.)
pub const PUBLIC_LABEL: &str = "e2b.public_traffic";
/// The label of a sandbox made with `network.maskRequestHost`: the `Host` its servers see
/// in requests through the gateway (`${PORT}` is the port).
pub const MASK_HOST_LABEL: &str = "e2b.mask_request_host";
/// `network.httpsPorts`: ports whose servers speak TLS (comma-separated).
pub const HTTPS_PORTS_LABEL: &str = "e2b.https_ports";
/// Labels the gateway keeps for itself start so; they are not shown as metadata.
pub const LABEL_PREFIX: &str = dsec_common::e2b::LABEL_PREFIX;
/// On sandboxes made with `auto_resume`: a request to a port of a paused one goes on to
/// the API, which resumes it.
pub const AUTO_RESUME_LABEL: &str = "e2b.auto_resume";
/// Sandbox lifetime when create names none (E2B's default).
pub const DEFAULT_TIMEOUT_S: u64 = 300;

#[derive(Clone)]
pub struct Config {
    /// The OpenDsec API the gateway calls, e.g. `http://127.0.0.1:7600`.
    pub api_url: String,
    /// The key for in-sandbox calls (an admin key of the deployment).
    pub service_key: String,
    /// Signs sandbox access tokens; keep it across restarts so tokens stay valid.
    pub secret: Vec<u8>,
    /// E2B template id → what it runs. An id not in the map that looks like an image
    /// reference (it has a `/`) is used as one.
    pub templates: BTreeMap<String, Template>,
    /// The sandbox domain create returns, so `get_host(port)` is `{port}-{id}.{domain}`
    /// (a name that resolves to the gateway; `localhost:<port>` works in browsers).
    pub domain: Option<String>,
    /// Builds templates into the node's image store (`Template.build()`); None: builds
    /// are refused.
    pub builder: Option<Arc<dyn Builder>>,
    /// The API's router where the gateway runs in the API's process: calls go to it
    /// directly (see [`upstream`]). None: over HTTP to `api_url`.
    pub in_process: Option<upstream::InProcess>,
}

/// What an E2B template stands for: an OpenDsec image, and the backend to run it on
/// (the deployment's default when None).
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(untagged)]
pub enum Template {
    Image(String),
    Spec {
        image: String,
        #[serde(default)]
        backend: Option<String>,
    },
}

impl Template {
    pub fn image(&self) -> &str {
        match self {
            Template::Image(i) | Template::Spec { image: i, .. } => i,
        }
    }

    pub fn backend(&self) -> Option<&str> {
        match self {
            Template::Image(_) => None,
            Template::Spec { backend, .. } => backend.as_deref(),
        }
    }
}

/// The template map `dsec up` starts with: `base` (E2B's default) and
/// `code-interpreter-v1` (`e2b-code-interpreter`'s default) as containers, and the same
/// images as virtual machines (`base-vm`, `code-interpreter-v1-vm`) and as Firecracker
/// microVMs (`base-microvm`, `code-interpreter-v1-microvm`).
pub fn default_templates() -> BTreeMap<String, Template> {
    let mut m = BTreeMap::new();
    for (name, image) in [
        ("base", "root/py:3.11"),
        ("code-interpreter-v1", "root/code-interpreter:latest"),
    ] {
        m.insert(name.to_string(), Template::Image(image.into()));
        for backend in ["vm", "microvm"] {
            m.insert(
                format!("{name}-{backend}"),
                Template::Spec {
                    image: image.into(),
                    backend: Some(backend.into()),
                },
            );
        }
    }
    m
}

#[derive(Clone)]
pub(crate) struct Gw {
    cfg: Arc<Config>,
    up: Upstream,
    watchers: Arc<std::sync::Mutex<watch::Watchers>>,
    builds: Arc<std::sync::Mutex<templates::Builds>>,
    /// Sandbox id -> whether it has E2B's default user `user` ([`envd`]).
    default_users: Arc<std::sync::Mutex<std::collections::HashMap<String, bool>>>,
    /// Sandbox id -> when the API last said it runs: an envd call within
    /// [`RUNNING_FRESH`] of that skips asking again (one loopback round trip fewer per
    /// call; what the call itself does still fails on a sandbox gone meanwhile).
    seen_running: Arc<std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>>,
}

/// How long an answer that a sandbox runs is taken as still true.
const RUNNING_FRESH: std::time::Duration = std::time::Duration::from_secs(1);

impl Gw {
    fn lock_seen(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, std::time::Instant>> {
        self.seen_running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the API said within [`RUNNING_FRESH`] that sandbox `id` runs.
    pub(crate) fn recently_running(&self, id: &str) -> bool {
        self.lock_seen()
            .get(id)
            .is_some_and(|t| t.elapsed() < RUNNING_FRESH)
    }

    pub(crate) fn saw_running(&self, id: &str) {
        let mut m = self.lock_seen();
        if m.len() >= 65_536 {
            m.retain(|_, t| t.elapsed() < RUNNING_FRESH);
        }
        m.insert(id.to_string(), std::time::Instant::now());
    }

    /// Sandbox `id` was paused or killed through this gateway: the next call asks.
    pub(crate) fn forget_running(&self, id: &str) {
        self.lock_seen().remove(id);
    }

    fn lock_default_users(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, bool>> {
        self.default_users.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One router serves both sides: their paths do not overlap (`/sandboxes`, `/v2/…`,
/// `/events/…` for the control plane; `/health`, `/files`, `/process.Process/…`,
/// `/filesystem.Filesystem/…` for envd), so `E2B_API_URL` and `E2B_SANDBOX_URL` can be
/// the same URL.
pub fn router(cfg: Config) -> Router {
    let gw = Gw {
        up: Upstream::new(&cfg.api_url, cfg.in_process.clone()),
        cfg: Arc::new(cfg),
        watchers: Default::default(),
        builds: Default::default(),
        default_users: Default::default(),
        seen_running: Default::default(),
    };
    control::routes()
        .merge(snapshots::routes())
        .merge(templates::routes())
        .merge(volumes::routes())
        .merge(events::routes())
        .merge(envd::routes())
        .fallback(|| async { e2b_error(404, "no such endpoint on the OpenDsec E2B gateway") })
        .layer(axum::middleware::from_fn(|r, n| {
            dsec_metrics::http::count("gateway", r, n)
        }))
        .layer(axum::extract::DefaultBodyLimit::max(
            connect::MAX_MESSAGE * 2,
        ))
        .layer(axum::middleware::from_fn_with_state(
            gw.clone(),
            ports::dispatch,
        ))
        .with_state(gw)
}

/// The sandbox's `envdAccessToken`: HMAC-SHA256(secret, id), hex.
pub fn access_token(secret: &[u8], id: &str) -> String {
    const B: usize = 64;
    let mut key = [0u8; B];
    if secret.len() > B {
        key[..32].copy_from_slice(&Sha256::digest(secret));
    } else {
        key[..secret.len()].copy_from_slice(secret);
    }
    let mut inner = Sha256::new();
    inner.update(key.map(|b| b ^ 0x36));
    inner.update(id.as_bytes());
    let mut outer = Sha256::new();
    outer.update(key.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    hex(&outer.finalize())
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Why a gzip body could not be unpacked.
pub(crate) enum GunzipError {
    /// It unpacks to more than the limit.
    TooLarge,
    Bad(std::io::Error),
}

/// Unpacks a gzip body of at most `limit` bytes unpacked (reading no further).
pub(crate) fn gunzip(b: &[u8], limit: usize) -> Result<Vec<u8>, GunzipError> {
    use std::io::Read;
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(b)
        .take(limit as u64 + 1)
        .read_to_end(&mut out)
        .map_err(GunzipError::Bad)?;
    if out.len() > limit {
        return Err(GunzipError::TooLarge);
    }
    Ok(out)
}

/// Compares tokens in constant time.
pub(crate) fn same(a: &str, b: &str) -> bool {
    dsec_common::id::same_secret(a.as_bytes(), b.as_bytes())
}

/// A control-plane (and envd plain-HTTP) error: `{"code": <status>, "message"}`, the only
/// error body the SDK parses.
pub(crate) fn e2b_error(status: u16, message: &str) -> Response {
    let s = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        s,
        axum::Json(serde_json::json!({"code": status, "message": message})),
    )
        .into_response()
}

impl IntoResponse for UpErr {
    fn into_response(self) -> Response {
        e2b_error(self.status, &self.message)
    }
}

pub(crate) fn header_str<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::trim)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc4231_case_2() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
        assert_eq!(
            access_token(b"Jefe", "what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert!(same("abc", "abc"));
        assert!(!same("abc", "abd"));
        assert!(!same("abc", "ab"));
    }
}
