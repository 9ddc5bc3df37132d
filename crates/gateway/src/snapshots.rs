//! E2B's fork and snapshots on OpenDsec's: `POST /sandboxes/{id}/fork` (copies of a
//! running sandbox, with its memory on the VM backends), `POST /sandboxes/{id}/snapshots`
//! (a snapshot, named by the label [`NAME_LABEL`]), `GET /snapshots` (by source sandbox
//! and name, paged with `x-next-token`), `Sandbox.create(<snapshot id or name>)` (a
//! restore, [`find`] and [`create_from`]) and `DELETE /templates/{id}` (a snapshot's
//! delete: E2B keeps snapshots as templates). All with the caller's own key, so a project
//! sees and uses only its own snapshots.

use std::collections::BTreeMap;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use dsec_common::api::{ForkResponse, ListSnapshotsResponse, SandboxInfo, SnapshotInfo};
use dsec_common::id::SandboxId;
use hyper::Method;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::control::{key, parse, sandbox_id, sandbox_json};
use crate::upstream::UpErr;
use crate::{Gw, TEMPLATE_LABEL};

/// The label that names a snapshot (`create_snapshot(name=)`).
pub const NAME_LABEL: &str = "e2b.snapshot_name";
/// Most copies one fork makes (E2B's bound).
const MAX_FORKS: u64 = 20;
/// A page of `GET /snapshots` when the caller names no limit.
const DEFAULT_PAGE: usize = 100;

type Res = Result<Response, UpErr>;

pub(crate) fn routes() -> Router<Gw> {
    Router::new()
        .route("/sandboxes/{id}/fork", post(fork))
        .route("/sandboxes/{id}/snapshots", post(create))
        .route("/snapshots", get(list))
        .route("/templates/{tid}", delete(remove))
}

#[derive(Deserialize)]
struct ForkBody {
    timeout: Option<u64>,
    count: Option<u64>,
}

/// Gives each of `ids` the timeout `seconds` (from now).
async fn set_timeouts(gw: &Gw, k: &str, ids: &[String], seconds: u64) -> Result<(), UpErr> {
    for id in ids {
        let _: Value = gw
            .up
            .call(
                Method::POST,
                &format!("/v1/sandboxes/{id}/timeout"),
                k,
                Some(json!({"ttl_seconds": seconds})),
            )
            .await?;
    }
    Ok(())
}

/// `POST /sandboxes/{id}/fork`: `count` copies, all from one capture of the source, which
/// goes on running; one `{"sandbox": …}` per copy.
async fn fork(State(gw): State<Gw>, h: HeaderMap, Path(id): Path<String>, body: Bytes) -> Res {
    let k = key(&h)?;
    let id = sandbox_id(&id)?;
    let b: ForkBody = parse(&body, "fork")?;
    let count = b.count.unwrap_or(1);
    if !(1..=MAX_FORKS).contains(&count) {
        return Err(UpErr::new(
            400,
            "invalid_argument",
            format!("count must be 1 to {MAX_FORKS}, not {count}"),
        ));
    }
    let r: ForkResponse = gw
        .up
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/fork"),
            &k,
            Some(json!({ "count": count })),
        )
        .await?;
    if let Some(t) = b.timeout {
        let ids: Vec<String> = r.sandboxes.iter().map(|s| s.id.clone()).collect();
        set_timeouts(&gw, &k, &ids, t).await?;
    }
    let out: Vec<Value> = r
        .sandboxes
        .iter()
        .map(|s| json!({ "sandbox": sandbox_json(&gw, s) }))
        .collect();
    Ok((StatusCode::CREATED, axum::Json(out)).into_response())
}

#[derive(Deserialize)]
struct SnapshotBody {
    name: Option<String>,
    /// False: a filesystem-only snapshot. Containers' are always that; a VM's keeps its
    /// memory either way (restores then start as fast or faster).
    #[serde(default)]
    #[allow(dead_code)]
    memory: Option<bool>,
}

/// A snapshot name as E2B's SDK gives one: a template name, optionally with a tag.
fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 128
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:/".contains(&b))
}

fn snapshot_json(s: &SnapshotInfo) -> Value {
    let names: Vec<&str> = s
        .labels
        .get(NAME_LABEL)
        .map(String::as_str)
        .into_iter()
        .collect();
    json!({ "snapshotID": s.id, "names": names })
}

/// `POST /sandboxes/{id}/snapshots`: a snapshot of the sandbox, which goes on running.
async fn create(State(gw): State<Gw>, h: HeaderMap, Path(id): Path<String>, body: Bytes) -> Res {
    let k = key(&h)?;
    let id = sandbox_id(&id)?;
    let b: SnapshotBody = parse(&body, "snapshot")?;
    let mut labels = BTreeMap::new();
    if let Some(n) = b.name {
        if !valid_name(&n) {
            return Err(UpErr::new(
                400,
                "invalid_argument",
                format!("snapshot name {n:?}: letters, digits and - _ . : / only, at most 128"),
            ));
        }
        labels.insert(NAME_LABEL.to_string(), n);
    }
    let s: SnapshotInfo = gw
        .up
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/snapshot"),
            &k,
            Some(json!({ "labels": labels })),
        )
        .await?;
    Ok((StatusCode::CREATED, axum::Json(snapshot_json(&s))).into_response())
}

/// The snapshots the key sees, newest first.
async fn all(gw: &Gw, k: &str) -> Result<Vec<SnapshotInfo>, UpErr> {
    let r: ListSnapshotsResponse = gw.up.call(Method::GET, "/v1/snapshots", k, None).await?;
    let mut v = r.snapshots;
    v.sort_by(|a, b| b.created_at_ms.cmp(&a.created_at_ms).then(a.id.cmp(&b.id)));
    Ok(v)
}

/// Whether snapshot `s` answers to `name`: its id, or its name with or without a tag
/// (`my-snap` finds `my-snap` and `my-snap:v1`'s untagged form; a project prefix the SDK
/// may add is ignored).
fn answers_to(s: &SnapshotInfo, name: &str) -> bool {
    if s.id == name {
        return true;
    }
    let Some(n) = s.labels.get(NAME_LABEL) else {
        return false;
    };
    let bare = |x: &str| x.rsplit('/').next().unwrap_or(x).to_string();
    let (want, n) = (bare(name), bare(n));
    n == want || n.split(':').next() == Some(want.as_str())
}

/// `GET /snapshots?sandboxID=&name=&limit=&nextToken=`.
async fn list(State(gw): State<Gw>, h: HeaderMap, RawQuery(q): RawQuery) -> Res {
    let k = key(&h)?;
    let q = crate::control::query_pairs(q.as_deref().unwrap_or(""));
    let get = |n: &str| q.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    let limit = match get("limit") {
        Some(l) => l
            .parse::<usize>()
            .ok()
            .filter(|l| (1..=1000).contains(l))
            .ok_or_else(|| UpErr::new(400, "invalid_argument", "limit must be 1 to 1000"))?,
        None => DEFAULT_PAGE,
    };
    let start = match get("nextToken") {
        Some(t) => t.parse::<usize>().map_err(|_| {
            UpErr::new(
                400,
                "invalid_argument",
                "nextToken is not one this gateway gave",
            )
        })?,
        None => 0,
    };
    let source = get("sandboxID");
    let name = get("name");
    let matching: Vec<SnapshotInfo> = all(&gw, &k)
        .await?
        .into_iter()
        .filter(|s| source.as_deref().is_none_or(|src| s.source == src))
        .filter(|s| name.as_deref().is_none_or(|n| answers_to(s, n)))
        .collect();
    let page: Vec<Value> = matching
        .iter()
        .skip(start)
        .take(limit)
        .map(snapshot_json)
        .collect();
    let mut resp = axum::Json(page).into_response();
    if start + limit < matching.len()
        && let Ok(v) = hyper::header::HeaderValue::from_str(&(start + limit).to_string())
    {
        resp.headers_mut().insert("x-next-token", v);
    }
    Ok(resp)
}

/// The snapshot a template id names for this key (its id, or its name), if any.
pub(crate) async fn find(gw: &Gw, k: &str, template: &str) -> Result<Option<SnapshotInfo>, UpErr> {
    if SandboxId::parse(template).is_ok() {
        let s: Result<SnapshotInfo, UpErr> = gw
            .up
            .call(Method::GET, &format!("/v1/snapshots/{template}"), k, None)
            .await;
        return match s {
            Ok(s) => Ok(Some(s)),
            Err(e) if e.status == 404 || e.status == 400 => Ok(None),
            Err(e) => Err(e),
        };
    }
    if !valid_name(template) {
        return Ok(None);
    }
    Ok(all(gw, k)
        .await?
        .into_iter()
        .find(|s| answers_to(s, template)))
}

/// `Sandbox.create(<snapshot>)`: a sandbox restored from it, with the caller's metadata,
/// named after it as its template, for `timeout` seconds.
pub(crate) async fn create_from(
    gw: &Gw,
    k: &str,
    s: &SnapshotInfo,
    template_id: &str,
    metadata: BTreeMap<String, String>,
    timeout: u64,
) -> Result<SandboxInfo, UpErr> {
    // (the caller's metadata holds no key of the gateway's own: checked by the create)
    let mut labels = metadata;
    labels.insert(TEMPLATE_LABEL.to_string(), template_id.to_string());
    let r: ForkResponse = gw
        .up
        .call(
            Method::POST,
            &format!("/v1/snapshots/{}/restore", s.id),
            k,
            Some(json!({ "count": 1, "labels": labels })),
        )
        .await?;
    let info = r
        .sandboxes
        .into_iter()
        .next()
        .ok_or_else(|| UpErr::new(502, "internal", "the restore made no sandbox"))?;
    set_timeouts(gw, k, std::slice::from_ref(&info.id), timeout).await?;
    Ok(info)
}

/// `DELETE /templates/{id}`: a snapshot (by id or name) is deleted; 404 otherwise.
async fn remove(State(gw): State<Gw>, h: HeaderMap, Path(tid): Path<String>) -> Res {
    let k = key(&h)?;
    let Some(s) = find(&gw, &k, &tid).await? else {
        return Err(UpErr::new(
            404,
            "not_found",
            format!("no snapshot {tid:?} of this key's project"),
        ));
    };
    let _: Value = gw
        .up
        .call(Method::DELETE, &format!("/v1/snapshots/{}", s.id), &k, None)
        .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
