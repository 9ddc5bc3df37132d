//! The OpenDsec REST API as the gateway calls it: a small HTTP/1.1 client whose errors are
//! the API's own `{"code","message"}` (with the HTTP status), unchanged. A gateway that
//! runs in the API's own process (`dsec up`) hands requests to the API's router instead,
//! the same routes and checks with no connection, encoding or second task in between;
//! only [`Upstream::send`] (the port proxy, upgrades included) always goes over HTTP.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::de::DeserializeOwned;

pub type Body = UnsyncBoxBody<Bytes, std::io::Error>;

pub fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// An error the API answered (or the gateway's own, as one): HTTP status, code, message.
#[derive(Debug, Clone)]
pub struct UpErr {
    pub status: u16,
    /// The API's code (`not_found`, `invalid_argument`, …), which is also Connect's.
    pub code: String,
    pub message: String,
}

impl UpErr {
    pub fn new(status: u16, code: &str, message: impl Into<String>) -> Self {
        UpErr {
            status,
            code: code.to_string(),
            message: message.into(),
        }
    }
}

/// An answer's body, from the API's router or over HTTP alike.
pub type UpBody = axum::body::Body;

/// The API's router, once the process that serves it has built it (the gateway is bound
/// first).
pub type InProcess = Arc<OnceLock<axum::Router>>;

#[derive(Clone)]
pub struct Upstream {
    base: String,
    http: Client<HttpConnector, Body>,
    local: Option<InProcess>,
}

impl Upstream {
    pub fn new(base: &str, local: Option<InProcess>) -> Upstream {
        let mut conn = HttpConnector::new();
        conn.set_connect_timeout(Some(Duration::from_secs(5)));
        // Streams of small frames: no waiting for delayed ACKs.
        conn.set_nodelay(true);
        Upstream {
            base: base.trim_end_matches('/').to_string(),
            http: Client::builder(TokioExecutor::new()).build(conn),
            local,
        }
    }

    /// A call of the API: to its router where it is in this process, else over HTTP.
    async fn dispatch(&self, req: Request<Body>) -> Result<Response<UpBody>, UpErr> {
        if let Some(router) = self.local.as_ref().and_then(|l| l.get()) {
            let mut svc = router.clone();
            let req = req.map(axum::body::Body::new);
            let ready = std::future::poll_fn(|cx| {
                tower_service::Service::<Request<axum::body::Body>>::poll_ready(&mut svc, cx)
            })
            .await;
            return match ready {
                Ok(()) => Ok(tower_service::Service::call(&mut svc, req)
                    .await
                    .unwrap_or_else(|never| match never {})),
                Err(never) => match never {},
            };
        }
        Ok(self.send(req).await?.map(axum::body::Body::new))
    }

    /// The URL of an API path.
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// Sends a request as it is; any answer comes back (only a failure to reach the API
    /// is an error).
    pub async fn send(&self, req: Request<Body>) -> Result<Response<Incoming>, UpErr> {
        self.http.request(req).await.map_err(|e| {
            UpErr::new(
                503,
                "unavailable",
                format!("the OpenDsec API does not answer: {e}"),
            )
        })
    }

    /// Sends a request; a success comes back with its body unread.
    pub async fn open(
        &self,
        method: Method,
        path: &str,
        key: &str,
        content_type: Option<&str>,
        body: Body,
    ) -> Result<Response<UpBody>, UpErr> {
        self.open_with(method, path, key, content_type, &[], body)
            .await
    }

    /// [`Upstream::open`] with more request headers.
    pub async fn open_with(
        &self,
        method: Method,
        path: &str,
        key: &str,
        content_type: Option<&str>,
        headers: &[(String, String)],
        body: Body,
    ) -> Result<Response<UpBody>, UpErr> {
        let mut b = Request::builder()
            .method(method)
            .uri(self.url(path))
            .header("authorization", format!("Bearer {key}"));
        if let Some(ct) = content_type {
            b = b.header("content-type", ct);
        }
        for (k, v) in headers {
            b = b.header(k.as_str(), v.as_str());
        }
        let req = b
            .body(body)
            .map_err(|e| UpErr::new(400, "invalid_argument", e.to_string()))?;
        let resp = self.dispatch(req).await?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status().as_u16();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
        Err(UpErr {
            status,
            code: v["code"].as_str().unwrap_or("unknown").to_string(),
            message: v["message"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned()),
        })
    }

    /// A JSON call (body `json` or none); the answer parsed (`null` for 204).
    pub async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        key: &str,
        json: Option<serde_json::Value>,
    ) -> Result<T, UpErr> {
        let (ct, body) = match json {
            Some(v) => (Some("application/json"), full(v.to_string())),
            None => (None, full(Bytes::new())),
        };
        json_of(self.open(method, path, key, ct, body).await?).await
    }
}

/// A successful answer's JSON body (`null` for 204 or an empty body).
pub async fn json_of<T: DeserializeOwned>(resp: Response<UpBody>) -> Result<T, UpErr> {
    let status = resp.status();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| UpErr::new(502, "unavailable", e.to_string()))?
        .to_bytes();
    let bytes = if status == StatusCode::NO_CONTENT || bytes.is_empty() {
        Bytes::from_static(b"null")
    } else {
        bytes
    };
    serde_json::from_slice(&bytes).map_err(|e| {
        UpErr::new(
            500,
            "internal",
            format!("unexpected answer from the OpenDsec API: {e}"),
        )
    })
}

/// Percent-encodes a query value.
pub fn enc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
