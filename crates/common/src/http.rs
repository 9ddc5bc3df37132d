//! HTTP helpers the servers share (feature `http`): the error body, JSON in and out, the
//! API key of a request, health and the API description, query decoding, upgrades.

use std::collections::BTreeMap;

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use hyper::StatusCode;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;

use crate::{ApiError, ErrorCode};

/// The public API's description, served at `/openapi.json` by every apiserver.
pub const OPENAPI: &str = include_str!("../openapi.json");

/// An [`ApiError`] as an HTTP response: its status and `{"code","message"}`.
#[derive(Debug)]
pub struct Failure(pub ApiError);

impl From<ApiError> for Failure {
    fn from(e: ApiError) -> Self {
        Failure(e)
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.0.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, axum::Json(self.0)).into_response()
    }
}

pub type ApiResult<T> = Result<T, Failure>;

pub fn json<T: serde::Serialize>(status: StatusCode, v: &T) -> Response {
    (status, axum::Json(v)).into_response()
}

/// Parses a JSON body, saying what was wrong in terms of the request.
pub fn body<T: DeserializeOwned>(bytes: &Bytes, what: &str) -> Result<T, Failure> {
    if bytes.is_empty() {
        return Err(
            ApiError::invalid(format!("{what} needs a JSON body; see /openapi.json")).into(),
        );
    }
    serde_json::from_slice(bytes).map_err(|e| {
        let kind = if e.is_syntax() || e.is_eof() {
            "is not valid JSON"
        } else {
            "does not match the schema"
        };
        ApiError::invalid(format!("the {what} body {kind}: {e}; see /openapi.json")).into()
    })
}

/// `/healthz`, answered by every listener of every role.
pub fn health<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new().route("/healthz", get(healthz))
}

#[cfg_attr(feature = "openapi", utoipa::path(
    get,
    path = "/healthz",
    summary = "Liveness",
    responses(
        (status = 200, description = "ok"),
    ),
    security(()),
))]
async fn healthz() -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!({"ok": true}))
}

/// The description of what [`health`] serves.
#[cfg(feature = "openapi")]
#[derive(utoipa::OpenApi)]
#[openapi(paths(healthz))]
pub struct HealthDoc;

/// What any apiserver serves without a key: health and the API description.
pub fn public_routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    health().route(
        "/openapi.json",
        get(|| async { ([(header::CONTENT_TYPE, "application/json")], OPENAPI) }),
    )
}

/// The API key of a request: `Authorization: Bearer …` or `X-API-Key`.
pub fn api_key(headers: &HeaderMap) -> Option<&str> {
    if let Some(v) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        return v.strip_prefix("Bearer ").map(str::trim);
    }
    headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

pub fn missing_key() -> Failure {
    Failure(ApiError::new(
        ErrorCode::Unauthenticated,
        "missing API key: send `Authorization: Bearer dsk.…` (dsec up printed one and wrote it to client.toml)",
    ))
}

pub fn unknown_key() -> Failure {
    Failure(ApiError::new(
        ErrorCode::Unauthenticated,
        "API key not recognised (or revoked): check DSEC_API_KEY or client.toml",
    ))
}

/// The answer to a path no route matches, and to a method a route does not take.
pub fn no_such_endpoint() -> Failure {
    Failure(ApiError::not_found(
        "no such endpoint; the API is described at /openapi.json",
    ))
}

pub fn method_not_allowed() -> Failure {
    Failure(ApiError::new(
        ErrorCode::InvalidArgument,
        "method not allowed on this endpoint; see /openapi.json",
    ))
}

/// `label=KEY=VALUE` pairs of a listing's query; any other parameter is refused.
pub fn label_filter(q: Option<&str>) -> ApiResult<crate::api::StringMap> {
    let mut out = BTreeMap::new();
    for pair in q.unwrap_or("").split('&').filter(|s| !s.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if k != "label" {
            return Err(ApiError::invalid(format!(
                "unknown query parameter {k:?}; use label=KEY=VALUE"
            ))
            .into());
        }
        let v = percent_decode(v, true);
        let (lk, lv) = v
            .split_once('=')
            .ok_or_else(|| ApiError::invalid(format!("label filter {v:?} must be KEY=VALUE")))?;
        out.insert(lk.to_string(), lv.to_string());
    }
    Ok(out)
}

/// Decodes one percent-encoded component (`+` as a space when `form`, as in a query); a
/// `%` not followed by two hex digits stays as it is.
pub fn percent_decode(s: &str, form: bool) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' if form => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                match std::str::from_utf8(&b[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    Some(v) => {
                        out.push(v);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Encodes a query value: everything but unreserved characters as `%XX`.
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A query string as decoded `(name, value)` pairs, in order.
pub fn query_pairs(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|s| !s.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k, true), percent_decode(v, true))
        })
        .collect()
}

/// Proxying an upgrade (WebSocket and the like): once the far side answered 101, the
/// client's upgraded connection and the far side's are joined, bytes both ways.
pub fn splice_upgrade<B>(client: Option<OnUpgrade>, resp: &mut hyper::Response<B>) {
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        return;
    }
    let Some(client) = client else { return };
    let far = hyper::upgrade::on(resp);
    tokio::spawn(async move {
        if let (Ok(a), Ok(b)) = (client.await, far.await) {
            let _ = tokio::io::copy_bidirectional(&mut TokioIo::new(a), &mut TokioIo::new(b)).await;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_filters_parse_and_reject_unknown_params() {
        let m = label_filter(Some("label=a%3D1=x&label=b=2")).unwrap();
        assert_eq!(m.get("a"), Some(&"1=x".to_string()));
        assert_eq!(m.get("b"), Some(&"2".to_string()));
        assert!(label_filter(Some("foo=1")).is_err());
        assert!(label_filter(Some("label=novalue")).is_err());
        assert_eq!(percent_decode("a%20b+c%zz", true), "a b c%zz");
        assert_eq!(percent_decode("a+b%2B", false), "a+b+");
        assert_eq!(percent_decode("%zz%4", false), "%zz%4");
        assert_eq!(percent_decode("%", false), "%");
        assert_eq!(
            query_pairs("a=1&&b&c=x%26y+z"),
            [("a", "1"), ("b", ""), ("c", "x&y z")].map(|(k, v)| (k.to_string(), v.to_string()))
        );
    }

    /// Fuzz target: any query string is decoded or refused with a message, never a panic.
    #[test]
    fn fuzz_queries() {
        bolero::check!()
            .with_iterations(crate::FUZZ_CASES)
            .for_each(|input: &[u8]| {
                let q = String::from_utf8_lossy(input);
                let _ = label_filter(Some(&q));
                let _ = query_pairs(&q);
                let _ = body::<serde_json::Value>(&Bytes::copy_from_slice(input), "any");
            });
    }
}
