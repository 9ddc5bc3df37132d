//! E2B's volumes on OpenDsec's: the control plane's `POST|GET /volumes`,
//! `GET|DELETE /volumes/{id}` (with the caller's key, so a project sees only its own), and
//! the volume content API (`/volumecontent/{id}/…`: file, dir, path), which E2B's SDK
//! calls with the volume's token alone. The token is an HMAC of the volume id under the
//! gateway's secret (as a sandbox's `envdAccessToken` is), handed to callers who may see
//! the volume; with it the gateway acts on that one volume with its service key.

use std::collections::BTreeMap;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use dsec_common::api::{ListVolumesResponse, VolumeEntry, VolumeInfo};
use dsec_common::id::SandboxId;
use hyper::Method;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::control::{key, parse, rfc3339};
use crate::upstream::{UpErr, enc};
use crate::{Gw, access_token, header_str, same};

type Res = Result<Response, UpErr>;

pub(crate) fn routes() -> Router<Gw> {
    Router::new()
        .route("/volumes", get(list).post(create))
        .route("/volumes/{vid}", get(show).delete(destroy))
        .route("/volumecontent/{vid}/file", get(read_file).put(write_file))
        .route("/volumecontent/{vid}/dir", get(list_dir).post(make_dir))
        .route(
            "/volumecontent/{vid}/path",
            get(stat_path).delete(remove_path).patch(update_path),
        )
}

fn not_found(vid: &str) -> UpErr {
    UpErr::new(404, "not_found", format!("volume {vid} not found"))
}

/// An id from a path: a well-formed volume id, or not found (never passed on raw).
fn volume_id(vid: &str) -> Result<String, UpErr> {
    SandboxId::parse(vid)
        .map(|p| p.to_string())
        .map_err(|_| not_found(vid))
}

/// The token of a volume: what its content API takes instead of a key. Another purpose
/// than a sandbox's token, so neither opens the other.
fn volume_token(gw: &Gw, vid: &str) -> String {
    access_token(&gw.cfg.secret, &format!("volume:{vid}"))
}

fn volume_json(gw: &Gw, v: &VolumeInfo) -> Value {
    json!({ "volumeID": v.id, "name": v.name, "token": volume_token(gw, &v.id) })
}

#[derive(Deserialize)]
struct NewVolume {
    name: String,
}

async fn create(State(gw): State<Gw>, h: HeaderMap, body: Bytes) -> Res {
    let k = key(&h)?;
    let b: NewVolume = parse(&body, "create volume")?;
    let v: VolumeInfo = gw
        .up
        .call(
            Method::POST,
            "/v1/volumes",
            &k,
            Some(json!({ "name": b.name })),
        )
        .await?;
    Ok((StatusCode::CREATED, axum::Json(volume_json(&gw, &v))).into_response())
}

async fn list(State(gw): State<Gw>, h: HeaderMap) -> Res {
    let k = key(&h)?;
    let r: ListVolumesResponse = gw.up.call(Method::GET, "/v1/volumes", &k, None).await?;
    let out: Vec<Value> = r
        .volumes
        .iter()
        .map(|v| json!({ "volumeID": v.id, "name": v.name }))
        .collect();
    Ok(axum::Json(out).into_response())
}

async fn show(State(gw): State<Gw>, h: HeaderMap, Path(vid): Path<String>) -> Res {
    let k = key(&h)?;
    let vid = volume_id(&vid)?;
    let v: VolumeInfo = gw
        .up
        .call(Method::GET, &format!("/v1/volumes/{vid}"), &k, None)
        .await?;
    Ok(axum::Json(volume_json(&gw, &v)).into_response())
}

async fn destroy(State(gw): State<Gw>, h: HeaderMap, Path(vid): Path<String>) -> Res {
    let k = key(&h)?;
    let vid = volume_id(&vid)?;
    let _: Value = gw
        .up
        .call(Method::DELETE, &format!("/v1/volumes/{vid}"), &k, None)
        .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// A content call's volume, once its token is checked.
fn authorised(gw: &Gw, h: &HeaderMap, vid: &str) -> Result<String, UpErr> {
    let vid = volume_id(vid)?;
    let token = header_str(h, "authorization")
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if token.is_empty() || !same(token, &volume_token(gw, &vid)) {
        return Err(UpErr::new(
            401,
            "unauthenticated",
            "the volume token is missing or wrong: use the token Volume.create or Volume.connect gave",
        ));
    }
    Ok(vid)
}

fn query(q: Option<&str>) -> BTreeMap<String, String> {
    crate::control::query_pairs(q.unwrap_or(""))
        .into_iter()
        .collect()
}

fn path_of(q: &BTreeMap<String, String>) -> Result<String, UpErr> {
    q.get("path").cloned().ok_or_else(|| {
        UpErr::new(
            400,
            "invalid_argument",
            "the query parameter path is required",
        )
    })
}

/// E2B's default user and group (`user`, 1000:1000), who own what the content API makes
/// unless the call says otherwise: sandboxes work as that user.
const DEFAULT_OWNER: u32 = 1000;

/// `uid`, `gid` and `mode` (E2B sends the mode as a decimal number) as the API's query.
fn owner_query(q: &BTreeMap<String, String>) -> Result<String, UpErr> {
    let mut out = String::new();
    for k in ["uid", "gid"] {
        let n: u32 = match q.get(k) {
            Some(v) => v.parse().map_err(|_| {
                UpErr::new(400, "invalid_argument", format!("{k} must be a number"))
            })?,
            None => DEFAULT_OWNER,
        };
        out.push_str(&format!("&{k}={n}"));
    }
    if let Some(m) = q.get("mode") {
        let n: u32 = m
            .parse()
            .map_err(|_| UpErr::new(400, "invalid_argument", "mode must be a number"))?;
        out.push_str(&format!("&mode={:o}", n & 0o7777));
    }
    Ok(out)
}

/// An entry as E2B's `VolumeEntryStat`.
fn entry_json(e: &VolumeEntry) -> Value {
    let kind = match e.kind.as_str() {
        "file" | "directory" | "symlink" => e.kind.as_str(),
        _ => "unknown",
    };
    let t = |ms: i64| rfc3339(ms.max(0) as u64);
    let mut v = json!({
        "name": e.name, "type": kind, "path": e.path, "size": e.size,
        "mode": e.mode & 0o7777, "uid": e.uid, "gid": e.gid,
        "atime": t(e.atime_ms), "mtime": t(e.mtime_ms), "ctime": t(e.ctime_ms),
    });
    if let Some(target) = &e.target {
        v["target"] = json!(target);
    }
    v
}

/// A content call: its volume (its token checked), its query and the path it names.
struct Target {
    vid: String,
    q: BTreeMap<String, String>,
    path: String,
}

impl Target {
    fn of(gw: &Gw, h: &HeaderMap, vid: &str, q: Option<&str>) -> Result<Target, UpErr> {
        let vid = authorised(gw, h, vid)?;
        let q = query(q);
        let path = path_of(&q)?;
        Ok(Target { vid, q, path })
    }

    /// The API's route `what` for this volume and path, with `extra` query.
    fn api(&self, what: &str, extra: &str) -> String {
        format!(
            "/v1/volumes/{}/{what}?path={}{extra}",
            self.vid,
            enc(&self.path)
        )
    }

    /// A JSON call of the API as the gateway's service.
    async fn call<T: serde::de::DeserializeOwned>(
        &self,
        gw: &Gw,
        method: Method,
        path: &str,
        json: Option<Value>,
    ) -> Result<T, UpErr> {
        gw.up.call(method, path, &gw.cfg.service_key, json).await
    }
}

async fn read_file(
    State(gw): State<Gw>,
    h: HeaderMap,
    Path(vid): Path<String>,
    RawQuery(q): RawQuery,
) -> Res {
    let t = Target::of(&gw, &h, &vid, q.as_deref())?;
    let resp = gw
        .up
        .open(
            Method::GET,
            &t.api("files", ""),
            &gw.cfg.service_key,
            None,
            crate::upstream::full(Bytes::new()),
        )
        .await?;
    let len = resp.headers().get("content-length").cloned();
    let mut r = Response::new(Body::new(resp.into_body()));
    r.headers_mut().insert(
        "content-type",
        hyper::header::HeaderValue::from_static("application/octet-stream"),
    );
    if let Some(l) = len {
        r.headers_mut().insert("content-length", l);
    }
    Ok(r)
}

async fn write_file(
    State(gw): State<Gw>,
    h: HeaderMap,
    Path(vid): Path<String>,
    RawQuery(q): RawQuery,
    body: Body,
) -> Res {
    use http_body_util::BodyExt;
    let t = Target::of(&gw, &h, &vid, q.as_deref())?;
    let resp = gw
        .up
        .open(
            Method::PUT,
            &t.api("files", &owner_query(&t.q)?),
            &gw.cfg.service_key,
            Some("application/octet-stream"),
            body.map_err(std::io::Error::other).boxed_unsync(),
        )
        .await?;
    let e: VolumeEntry = crate::upstream::json_of(resp).await?;
    Ok((StatusCode::CREATED, axum::Json(entry_json(&e))).into_response())
}

async fn list_dir(
    State(gw): State<Gw>,
    h: HeaderMap,
    Path(vid): Path<String>,
    RawQuery(q): RawQuery,
) -> Res {
    let t = Target::of(&gw, &h, &vid, q.as_deref())?;
    let depth: u32 = t.q.get("depth").and_then(|d| d.parse().ok()).unwrap_or(1);
    let path = t.api("list", &format!("&depth={}", depth.clamp(1, 64)));
    let r: Value = t.call(&gw, Method::GET, &path, None).await?;
    let entries: Vec<VolumeEntry> =
        serde_json::from_value(r["entries"].clone()).unwrap_or_default();
    let out: Vec<Value> = entries.iter().map(entry_json).collect();
    Ok(axum::Json(out).into_response())
}

async fn make_dir(
    State(gw): State<Gw>,
    h: HeaderMap,
    Path(vid): Path<String>,
    RawQuery(q): RawQuery,
) -> Res {
    let t = Target::of(&gw, &h, &vid, q.as_deref())?;
    // E2B's `force`: make the directories above it too.
    let parents = matches!(t.q.get("force").map(String::as_str), Some("true" | "1"));
    let path = t.api(
        "mkdir",
        &format!("&parents={parents}{}", owner_query(&t.q)?),
    );
    let e: VolumeEntry = t.call(&gw, Method::POST, &path, None).await?;
    Ok((StatusCode::CREATED, axum::Json(entry_json(&e))).into_response())
}

async fn stat_path(
    State(gw): State<Gw>,
    h: HeaderMap,
    Path(vid): Path<String>,
    RawQuery(q): RawQuery,
) -> Res {
    let t = Target::of(&gw, &h, &vid, q.as_deref())?;
    let e: VolumeEntry = t.call(&gw, Method::GET, &t.api("stat", ""), None).await?;
    Ok(axum::Json(entry_json(&e)).into_response())
}

async fn remove_path(
    State(gw): State<Gw>,
    h: HeaderMap,
    Path(vid): Path<String>,
    RawQuery(q): RawQuery,
) -> Res {
    let t = Target::of(&gw, &h, &vid, q.as_deref())?;
    let _: Value = t
        .call(&gw, Method::DELETE, &t.api("files", ""), None)
        .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Deserialize)]
struct Patch {
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
}

async fn update_path(
    State(gw): State<Gw>,
    h: HeaderMap,
    Path(vid): Path<String>,
    RawQuery(q): RawQuery,
    body: Bytes,
) -> Res {
    let t = Target::of(&gw, &h, &vid, q.as_deref())?;
    let p: Patch = parse(&body, "update")?;
    let body = json!({ "uid": p.uid, "gid": p.gid, "mode": p.mode.map(|m| m & 0o7777) });
    let e: VolumeEntry = t
        .call(&gw, Method::PATCH, &t.api("stat", ""), Some(body))
        .await?;
    Ok(axum::Json(entry_json(&e)).into_response())
}
