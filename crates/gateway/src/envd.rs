//! The in-sandbox side (E2B's envd): which sandbox a request is for, its access token,
//! `/health`, and the Connect-RPC plumbing shared by the `process` and `filesystem`
//! services.

use std::convert::Infallible;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use dsec_common::api::{SandboxInfo, SandboxState};
use dsec_common::id::SandboxId;
use hyper::Method;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::connect::{self, STREAM_CT};
use crate::upstream::UpErr;
use sha2::{Digest, Sha256};

use crate::{ENVD_PORT, Gw, access_token, e2b_error, header_str, same};

pub(crate) fn routes() -> Router<Gw> {
    Router::new()
        .route("/health", get(health))
        .route("/files", get(crate::files::read).post(crate::files::write))
        .route("/process.Process/{method}", post(process_rpc))
        .route("/filesystem.Filesystem/{method}", post(filesystem_rpc))
}

/// The sandbox an in-sandbox request is for, checked: its id, the caller's user.
#[derive(Clone)]
pub(crate) struct Target {
    pub id: String,
    /// The user the caller named (`Authorization: Basic` on RPC, `username` on files);
    /// E2B's default, `user`, when it named none or `user` and the sandbox has that
    /// account; None (root) when it does not.
    pub user: Option<String>,
}

impl Target {
    pub fn path(&self, rest: &str) -> String {
        format!("/v1/sandboxes/{}{rest}", self.id)
    }

    /// `&user=<user>` for an API call that acts as the user (none for root).
    pub fn user_query(&self) -> String {
        self.user
            .as_deref()
            .map(|u| format!("&user={u}"))
            .unwrap_or_default()
    }

    /// The user's home, for `~` (root's unless another user was named).
    pub fn home(&self) -> String {
        match self.user.as_deref() {
            None | Some("root") => "/root".to_string(),
            Some(u) => format!("/home/{u}"),
        }
    }
}

pub(crate) fn gone() -> Response {
    e2b_error(502, "The sandbox was not found")
}

/// Finds the sandbox (`E2b-Sandbox-Id`/`E2b-Sandbox-Port`, else a `{port}-{id}.{domain}`
/// host), checks the access token, and that the sandbox runs.
pub(crate) async fn target(
    gw: &Gw,
    h: &HeaderMap,
    user: Option<String>,
) -> Result<Target, Response> {
    target_signed(gw, h, user, None).await
}

/// What a signed file URL (`download_url()`, `upload_url()`) carries in its query.
pub(crate) struct Signed {
    /// The `path` query value as sent (before `~` or relative resolution).
    pub path: String,
    /// `read` or `write`.
    pub op: &'static str,
    pub signature: String,
    /// Unix seconds.
    pub expiration: Option<u64>,
}

/// The SDK's file URL signature: `v1_` + base64(sha256("path:op:user:token[:exp]")).
pub(crate) fn file_signature(
    path: &str,
    op: &str,
    user: &str,
    token: &str,
    expiration: Option<u64>,
) -> String {
    use base64::Engine;
    let raw = match expiration {
        Some(e) => format!("{path}:{op}:{user}:{token}:{e}"),
        None => format!("{path}:{op}:{user}:{token}"),
    };
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(Sha256::digest(raw))
    )
}

/// As [`target`], for `/files`, where a signed URL stands in for the header token. A
/// signed URL made with `E2B_SANDBOX_URL` names no sandbox (a browser sends no
/// `E2b-Sandbox-Id`): it is for the running sandbox whose token made the signature.
pub(crate) async fn target_signed(
    gw: &Gw,
    h: &HeaderMap,
    user: Option<String>,
    signed: Option<Signed>,
) -> Result<Target, Response> {
    let addressed = crate::ports::addressed(h);
    let id = match (header_str(h, "x-access-token"), signed) {
        (None, Some(sig)) => signed_id(gw, addressed, user.as_deref().unwrap_or(""), &sig).await?,
        (token, _) => {
            let Some((id, port)) = addressed else {
                return Err(e2b_error(
                    400,
                    "no sandbox named: send E2b-Sandbox-Id (set E2B_SANDBOX_URL to this gateway)",
                ));
            };
            let Ok(id) = SandboxId::parse(&id).map(|p| p.to_string()) else {
                return Err(gone());
            };
            if let Some(p) = port
                && p.parse::<u16>().ok() != Some(ENVD_PORT)
            {
                return Err(e2b_error(
                    502,
                    &format!("The sandbox is running but port {p} is not open"),
                ));
            }
            if !token.is_some_and(|t| same(t, &access_token(&gw.cfg.secret, &id))) {
                return Err(e2b_error(
                    401,
                    "invalid or missing X-Access-Token for this sandbox",
                ));
            }
            id
        }
    };
    if !gw.recently_running(&id) {
        running(gw, &id).await?;
        gw.saw_running(&id);
    }
    let user = match user.as_deref() {
        None | Some("" | "user") => has_default_user(gw, &id).await.then(|| "user".to_string()),
        Some(_) => user,
    };
    if let Some(u) = &user
        && !valid_user(u)
    {
        return Err(e2b_error(
            401,
            &format!("user {u:?} is not a valid user name"),
        ));
    }
    Ok(Target { id, user })
}

/// Whether sandbox `id` has E2B's default user `user` (an account in its /etc/passwd,
/// as images built from templates have), asked once per sandbox.
async fn has_default_user(gw: &Gw, id: &str) -> bool {
    use http_body_util::BodyExt;
    if let Some(k) = gw.lock_default_users().get(id) {
        return *k;
    }
    let resp = gw
        .up
        .open(
            Method::GET,
            &format!("/v1/sandboxes/{id}/files?path=%2Fetc%2Fpasswd"),
            &gw.cfg.service_key,
            None,
            crate::upstream::full(bytes::Bytes::new()),
        )
        .await;
    let found = match resp {
        Ok(r) => match http_body_util::Limited::new(r.into_body(), 1 << 20)
            .collect()
            .await
        {
            Ok(b) => b
                .to_bytes()
                .split(|c| *c == b'\n')
                .any(|l| l.starts_with(b"user:")),
            Err(_) => return false,
        },
        // An image without /etc/passwd has no such user; anything else is asked again.
        Err(e) if e.status == 404 => false,
        Err(_) => return false,
    };
    let mut m = gw.lock_default_users();
    if m.len() >= 65_536 {
        m.clear(); // sandboxes come and go; the next call of each asks again
    }
    m.insert(id.to_string(), found);
    found
}

/// The sandbox a signed URL is for, its signature and expiry checked.
async fn signed_id(
    gw: &Gw,
    addressed: Option<(String, Option<String>)>,
    user: &str,
    sig: &Signed,
) -> Result<String, Response> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    if sig.expiration.is_some_and(|e| e < now) {
        return Err(e2b_error(401, "this signed URL has expired"));
    }
    let signs = |id: &str| {
        let token = access_token(&gw.cfg.secret, id);
        same(
            &file_signature(&sig.path, sig.op, user, &token, sig.expiration),
            &sig.signature,
        )
    };
    let bad = || e2b_error(401, "invalid signature for this file URL");
    if let Some((id, _)) = addressed {
        let Ok(id) = SandboxId::parse(&id).map(|p| p.to_string()) else {
            return Err(gone());
        };
        return if signs(&id) { Ok(id) } else { Err(bad()) };
    }
    let all: Result<dsec_common::api::ListSandboxesResponse, UpErr> = gw
        .up
        .call(Method::GET, "/v1/sandboxes", &gw.cfg.service_key, None)
        .await;
    let all = all.map_err(|e| e2b_error(e.status, &e.message))?;
    all.sandboxes
        .into_iter()
        .filter(|s| matches!(s.state, SandboxState::Running | SandboxState::Creating))
        .map(|s| s.id)
        .find(|id| signs(id))
        .ok_or_else(bad)
}

/// The sandbox's record if it runs; E2B's 502 "not found" if it does not.
pub(crate) async fn running(gw: &Gw, id: &str) -> Result<SandboxInfo, Response> {
    reachable(gw, id, false).await
}

/// As [`running`], and also a paused sandbox made with `auto_resume` (a request to its
/// port resumes it).
pub(crate) async fn running_or_waking(gw: &Gw, id: &str) -> Result<SandboxInfo, Response> {
    reachable(gw, id, true).await
}

async fn reachable(gw: &Gw, id: &str, waking: bool) -> Result<SandboxInfo, Response> {
    let info: Result<SandboxInfo, UpErr> = gw
        .up
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}"),
            &gw.cfg.service_key,
            None,
        )
        .await;
    let wakes = |i: &SandboxInfo| {
        waking
            && i.state == SandboxState::Paused
            && i.labels.get(crate::AUTO_RESUME_LABEL).map(String::as_str) == Some("true")
    };
    match info {
        Ok(i) if matches!(i.state, SandboxState::Running | SandboxState::Creating) => Ok(i),
        Ok(i) if wakes(&i) => Ok(i),
        Ok(_) => Err(gone()),
        Err(e) if e.status == 404 || e.status == 400 => Err(gone()),
        Err(e) => Err(e2b_error(e.status, &e.message)),
    }
}

/// User names as in /etc/passwd (or a numeric uid): nothing that changes a path.
pub(crate) fn valid_user(u: &str) -> bool {
    u.len() <= 32
        && !u.starts_with('-')
        && !u.starts_with('.')
        && u.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

async fn health(State(gw): State<Gw>, h: HeaderMap) -> Response {
    match target(&gw, &h, None).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(r) => r,
    }
}

/// The user of an RPC: `Authorization: Basic base64("user:")`.
fn basic_user(h: &HeaderMap) -> Option<String> {
    use base64::Engine;
    let v = header_str(h, "authorization")?.strip_prefix("Basic ")?;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(v.trim())
        .ok()?;
    let s = String::from_utf8(raw).ok()?;
    Some(s.split(':').next().unwrap_or("").to_string())
}

/// A Connect error, for unary calls: status by code, `{"code","message"}`.
pub(crate) fn unary_error(code: &str, msg: &str) -> Response {
    let code = connect::connect_code(code);
    let s = StatusCode::from_u16(connect::http_status(code))
        .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        s,
        [(header::CONTENT_TYPE, "application/json")],
        json!({"code": code, "message": msg}).to_string(),
    )
        .into_response()
}

pub(crate) fn unary_ok(v: Value) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

impl From<UpErr> for RpcErr {
    fn from(e: UpErr) -> Self {
        RpcErr(e.code, e.message)
    }
}

/// An RPC's error: a Connect code and message.
pub(crate) struct RpcErr(pub String, pub String);

impl RpcErr {
    pub fn new(code: &str, msg: impl Into<String>) -> Self {
        RpcErr(code.to_string(), msg.into())
    }
}

pub(crate) type RpcResult = Result<Value, RpcErr>;

/// A unary request's JSON message.
fn unary_body(h: &HeaderMap, body: &Bytes) -> Result<Value, RpcErr> {
    let ct = header_str(h, "content-type").unwrap_or("application/json");
    if !ct.starts_with("application/json") {
        return Err(RpcErr::new(
            "unimplemented",
            format!("content type {ct:?}: the gateway speaks the Connect JSON codec only"),
        ));
    }
    if body.len() > connect::MAX_MESSAGE {
        return Err(RpcErr::new(
            "resource_exhausted",
            "request message too large",
        ));
    }
    if body.is_empty() {
        return Ok(json!({}));
    }
    serde_json::from_slice(body)
        .map_err(|e| RpcErr::new("invalid_argument", format!("request is not JSON: {e}")))
}

/// A server stream's response: the frames sent on `rx`, as they come.
pub(crate) fn stream_response(rx: mpsc::Receiver<Vec<u8>>) -> Response {
    let s = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, Infallible>(Bytes::from(b)), rx))
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, STREAM_CT)],
        Body::from_stream(s),
    )
        .into_response()
}

/// A stream that fails before its first message: HTTP 200, the error in the end frame.
pub(crate) fn stream_error(code: &str, msg: &str) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, STREAM_CT)],
        connect::end(Some((code, msg))),
    )
        .into_response()
}

/// The binary codec, if the request uses it.
fn is_proto(h: &HeaderMap) -> bool {
    matches!(
        header_str(h, "content-type").map(|c| c.split(';').next().unwrap_or("").trim()),
        Some("application/proto" | "application/connect+proto")
    )
}

async fn process_rpc(State(gw): State<Gw>, Path(method): Path<String>, req: Request) -> Response {
    if is_proto(req.headers()) {
        return crate::proto::serve("process.Process", &method, req, |r| {
            process_json(gw, method.clone(), r)
        })
        .await;
    }
    process_json(gw, method, req).await
}

async fn process_json(gw: Gw, method: String, req: Request) -> Response {
    let h = req.headers().clone();
    let t = match target(&gw, &h, basic_user(&h)).await {
        Ok(t) => t,
        Err(r) => return r,
    };
    match method.as_str() {
        "Start" | "Connect" => {
            let body = match axum::body::to_bytes(req.into_body(), 2 * connect::MAX_MESSAGE).await {
                Ok(b) => b,
                Err(e) => return stream_error("invalid_argument", &e.to_string()),
            };
            let msg = match connect::single(&body) {
                Ok(m) => m,
                Err((c, m)) => return stream_error(&c, &m),
            };
            crate::process::stream(&gw, &t, &h, &method, msg).await
        }
        "StreamInput" => crate::process::stream_input(&gw, &t, req.into_body()).await,
        _ => {
            let body = match axum::body::to_bytes(req.into_body(), 2 * connect::MAX_MESSAGE).await {
                Ok(b) => b,
                Err(e) => return unary_error("invalid_argument", &e.to_string()),
            };
            let r = match unary_body(&h, &body) {
                Ok(msg) => crate::process::unary(&gw, &t, &method, msg).await,
                Err(e) => Err(e),
            };
            match r {
                Ok(v) => unary_ok(v),
                Err(RpcErr(c, m)) => unary_error(&c, &m),
            }
        }
    }
}

async fn filesystem_rpc(
    State(gw): State<Gw>,
    Path(method): Path<String>,
    req: Request,
) -> Response {
    if is_proto(req.headers()) {
        return crate::proto::serve("filesystem.Filesystem", &method, req, |r| {
            filesystem_request(gw, method.clone(), r)
        })
        .await;
    }
    filesystem_request(gw, method, req).await
}

async fn filesystem_request(gw: Gw, method: String, req: Request) -> Response {
    let h = req.headers().clone();
    let t = match target(&gw, &h, basic_user(&h)).await {
        Ok(t) => t,
        Err(r) => return r,
    };
    let body = match axum::body::to_bytes(req.into_body(), 2 * connect::MAX_MESSAGE).await {
        Ok(b) => b,
        Err(e) => return unary_error("invalid_argument", &e.to_string()),
    };
    if method == "WatchDir" {
        return match connect::single(&body) {
            Ok(msg) => crate::watch::watch_dir(&gw, &t, &h, msg).await,
            Err((c, m)) => stream_error(&c, &m),
        };
    }
    let r = match unary_body(&h, &body) {
        Ok(msg)
            if matches!(
                method.as_str(),
                "CreateWatcher" | "GetWatcherEvents" | "RemoveWatcher"
            ) =>
        {
            crate::watch::rpc(&gw, &t, &method, msg).await
        }
        Ok(msg) => crate::files::rpc(&gw, &t, &method, msg).await,
        Err(e) => Err(e),
    };
    match r {
        Ok(v) => unary_ok(v),
        Err(RpcErr(c, m)) => unary_error(&c, &m),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_signatures_match_the_sdk() {
        // values from the e2b SDK's get_signature()
        assert_eq!(
            file_signature("/tmp/a.txt", "read", "", "tok", None),
            "v1_tRlsooM2hvGDgtWWsmSPYkbHGF1tnIIlZnLHK/9lpTk"
        );
        assert_eq!(
            file_signature("~/x y", "write", "bob", "tok2", Some(1_796_332_219)),
            "v1_RcaCu/tx6MvGL2XcF19gfi4MdOG5030MEtsEtbljCMM"
        );
    }

    #[test]
    fn user_names_are_checked() {
        assert!(valid_user("root"));
        assert!(valid_user("bob_1"));
        assert!(!valid_user("../etc"));
        assert!(!valid_user("a/b"));
        assert!(!valid_user(".."));
        assert!(!valid_user(&"a".repeat(40)));
    }
}
