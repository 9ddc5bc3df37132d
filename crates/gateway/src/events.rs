//! E2B's lifecycle events API and webhooks on OpenDsec's: `GET /events/sandboxes` and
//! `GET /events/sandboxes/{id}` read `GET /v1/events` (newest first by default, `offset`,
//! `limit` up to 100, `orderAsc`, `types`), and `/events/webhooks` keeps webhooks made
//! with `format: "e2b"`, so the node sends them E2B's bodies, headers and signature. Every
//! call is made with the caller's key: a project sees and hooks only its own subtree.

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use dsec_common::api::{ListEventsResponse, WebhookFormat, WebhookInfo};
use dsec_common::e2b;
use dsec_common::http::query_pairs;
use hyper::Method;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::Gw;
use crate::control::{key, parse, rfc3339, sandbox_id};
use crate::upstream::{UpErr, enc};

type Res = Result<Response, UpErr>;

/// E2B's page size when none is asked for, and the most it gives.
const DEFAULT_LIMIT: u64 = 10;
const MAX_LIMIT: u64 = 100;

pub(crate) fn routes() -> Router<Gw> {
    Router::new()
        .route("/events/sandboxes", get(team_events))
        .route("/events/sandboxes/{id}", get(sandbox_events))
        .route("/events/webhooks", get(list_webhooks).post(add_webhook))
        .route(
            "/events/webhooks/{wid}",
            get(show_webhook)
                .patch(update_webhook)
                .delete(remove_webhook),
        )
}

fn invalid(m: impl Into<String>) -> UpErr {
    UpErr::new(400, "invalid_argument", m)
}

/// The OpenDsec types an E2B type list stands for; every type E2B has for none.
fn natives(types: &[String]) -> Result<Vec<&'static str>, UpErr> {
    let mut out = Vec::new();
    if types.is_empty() {
        for (_, n) in e2b::TYPES {
            out.extend_from_slice(n);
        }
        return Ok(out);
    }
    for t in types {
        let n = e2b::native_types(t).ok_or_else(|| {
            invalid(format!(
                "unknown event type {t:?}; the types are {}",
                e2b::TYPES
                    .iter()
                    .map(|(e, _)| *e)
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?;
        for x in n {
            if !out.contains(x) {
                out.push(*x);
            }
        }
    }
    Ok(out)
}

/// `/v1/events` read as E2B's query asks.
async fn events(gw: &Gw, h: &HeaderMap, q: Option<String>, sandbox: Option<String>) -> Res {
    let k = key(h)?;
    let (mut offset, mut limit, mut asc) = (0u64, DEFAULT_LIMIT, false);
    let mut types = Vec::new();
    for (name, v) in query_pairs(q.as_deref().unwrap_or("")) {
        let n = || v.parse::<u64>().ok();
        match name.as_str() {
            "offset" => offset = n().ok_or_else(|| invalid("offset must be 0 or more"))?,
            "limit" => {
                limit = n()
                    .filter(|l| (1..=MAX_LIMIT).contains(l))
                    .ok_or_else(|| invalid(format!("limit must be 1 to {MAX_LIMIT}")))?
            }
            "orderAsc" => {
                asc = v
                    .parse()
                    .map_err(|_| invalid(format!("orderAsc {v:?}: true or false")))?
            }
            "types" => types.push(v),
            _ => {}
        }
    }
    let order = if asc { "asc" } else { "desc" };
    let mut path = format!("/v1/events?limit={limit}&offset={offset}&order={order}");
    for t in natives(&types)? {
        path.push_str(&format!("&type={t}"));
    }
    if let Some(s) = sandbox {
        path.push_str(&format!("&sandbox={}", enc(&s)));
    }
    let r: ListEventsResponse = gw.up.call(Method::GET, &path, &k, None).await?;
    let out: Vec<Value> = r.events.iter().filter_map(e2b::event).collect();
    Ok(axum::Json(out).into_response())
}

async fn team_events(State(gw): State<Gw>, h: HeaderMap, RawQuery(q): RawQuery) -> Res {
    events(&gw, &h, q, None).await
}

async fn sandbox_events(
    State(gw): State<Gw>,
    h: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> Res {
    let id = sandbox_id(&id)?;
    events(&gw, &h, q, Some(id)).await
}

/// A webhook as E2B shows it; `events` in E2B's words (every E2B type for "all").
fn webhook_json(w: &WebhookInfo) -> Value {
    let mut events: Vec<&str> = Vec::new();
    for (e, n) in e2b::TYPES {
        if w.types.is_empty() || n.iter().any(|t| w.types.iter().any(|x| x == t)) {
            events.push(e);
        }
    }
    json!({
        "id": w.id,
        // E2B's documents spell it both ways.
        "teamID": w.project,
        "teamId": w.project,
        "name": w.name.clone().unwrap_or_default(),
        "createdAt": rfc3339(w.created_at_ms),
        "enabled": w.enabled,
        "url": w.url,
        "events": events,
    })
}

fn webhook_not_found(wid: &str) -> UpErr {
    UpErr::new(404, "not_found", format!("webhook {wid} not found"))
}

/// A webhook id from a path: its own characters only, never passed on raw.
fn webhook_id(wid: &str) -> Result<String, UpErr> {
    let ok = wid.len() <= 64
        && !wid.is_empty()
        && wid
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    ok.then(|| wid.to_string())
        .ok_or_else(|| webhook_not_found(wid))
}

/// The caller's E2B webhook `wid` (one made through this API; others are not E2B's).
async fn e2b_webhook(gw: &Gw, k: &str, wid: &str) -> Result<WebhookInfo, UpErr> {
    let wid = webhook_id(wid)?;
    let w: WebhookInfo = gw
        .up
        .call(Method::GET, &format!("/v1/webhooks/{wid}"), k, None)
        .await
        .map_err(|e| {
            if e.status == 404 {
                webhook_not_found(&wid)
            } else {
                e
            }
        })?;
    if w.format != WebhookFormat::E2b {
        return Err(webhook_not_found(&wid));
    }
    Ok(w)
}

async fn list_webhooks(State(gw): State<Gw>, h: HeaderMap) -> Res {
    let k = key(&h)?;
    #[derive(Deserialize)]
    struct List {
        webhooks: Vec<WebhookInfo>,
    }
    let l: List = gw.up.call(Method::GET, "/v1/webhooks", &k, None).await?;
    let out: Vec<Value> = l
        .webhooks
        .iter()
        .filter(|w| w.format == WebhookFormat::E2b)
        .map(webhook_json)
        .collect();
    Ok(axum::Json(out).into_response())
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewWebhook {
    url: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    enabled: Option<bool>,
    #[serde(default)]
    events: Vec<String>,
    #[serde(default)]
    signature_secret: Option<String>,
}

async fn add_webhook(State(gw): State<Gw>, h: HeaderMap, body: Bytes) -> Res {
    let k = key(&h)?;
    let b: NewWebhook = parse(&body, "register webhook")?;
    let types = if b.events.is_empty() {
        Vec::new()
    } else {
        natives(&b.events)?
    };
    let w: WebhookInfo = gw
        .up
        .call(
            Method::POST,
            "/v1/webhooks",
            &k,
            Some(json!({
                "url": b.url,
                "types": types,
                "name": b.name,
                "enabled": b.enabled.unwrap_or(true),
                "secret": b.signature_secret,
                "format": "e2b",
            })),
        )
        .await?;
    let mut v = webhook_json(&w);
    if b.signature_secret.is_none() {
        // None was chosen: the one made is shown now, and never again.
        v["signatureSecret"] = json!(w.secret);
    }
    Ok((StatusCode::CREATED, axum::Json(v)).into_response())
}

async fn show_webhook(State(gw): State<Gw>, h: HeaderMap, Path(wid): Path<String>) -> Res {
    let k = key(&h)?;
    let w = e2b_webhook(&gw, &k, &wid).await?;
    Ok(axum::Json(webhook_json(&w)).into_response())
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WebhookChange {
    #[serde(default)]
    url: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    enabled: Option<bool>,
    #[serde(default)]
    events: Option<Vec<String>>,
}

async fn update_webhook(
    State(gw): State<Gw>,
    h: HeaderMap,
    Path(wid): Path<String>,
    body: Bytes,
) -> Res {
    let k = key(&h)?;
    let c: WebhookChange = parse(&body, "update webhook")?;
    let w = e2b_webhook(&gw, &k, &wid).await?;
    let types = match &c.events {
        Some(e) if e.is_empty() => Some(Vec::new()),
        Some(e) => Some(natives(e)?),
        None => None,
    };
    let w: WebhookInfo = gw
        .up
        .call(
            Method::PATCH,
            &format!("/v1/webhooks/{}", w.id),
            &k,
            Some(json!({
                "url": c.url,
                "name": c.name,
                "enabled": c.enabled,
                "types": types,
            })),
        )
        .await?;
    Ok(axum::Json(webhook_json(&w)).into_response())
}

async fn remove_webhook(State(gw): State<Gw>, h: HeaderMap, Path(wid): Path<String>) -> Res {
    let k = key(&h)?;
    let w = e2b_webhook(&gw, &k, &wid).await?;
    let _: Value = gw
        .up
        .call(Method::DELETE, &format!("/v1/webhooks/{}", w.id), &k, None)
        .await?;
    Ok(StatusCode::OK.into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2b_types_become_opendsec_types_and_back() {
        assert_eq!(
            natives(&["sandbox.lifecycle.killed".into()]).unwrap(),
            ["stopped", "expired"]
        );
        assert!(natives(&["sandbox.lifecycle.nope".into()]).is_err());
        let all = natives(&[]).unwrap();
        assert!(all.contains(&"created") && !all.contains(&"forked"));
        let w = WebhookInfo {
            id: "wh-1".into(),
            url: "https://example.com/h".into(),
            project: "root/t".into(),
            types: vec!["expired".into(), "stopped".into()],
            created_at_ms: 0,
            secret: Some("s".into()),
            name: Some("n".into()),
            enabled: false,
            format: WebhookFormat::E2b,
        };
        let v = webhook_json(&w);
        assert_eq!(v["events"], json!(["sandbox.lifecycle.killed"]));
        assert_eq!(v["enabled"], false);
        assert!(v.get("signatureSecret").is_none() && !v.to_string().contains("\"s\""));
        assert!(webhook_id("wh-1").is_ok());
        assert!(webhook_id("../v1/keys").is_err() && webhook_id("").is_err());
    }
}
