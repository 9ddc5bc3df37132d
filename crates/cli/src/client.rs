//! A small HTTP/1.1 client for the apiserver's REST API, configured from flags, the
//! `DSEC_API_URL`/`DSEC_API_KEY` variables or the client config file.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use bytes::Bytes;
use dsec_common::ApiError;
use dsec_common::client_config::{self, ClientConfig};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use serde::de::DeserializeOwned;

pub struct Api {
    base: String,
    key: String,
    http: Client<HttpConnector, Body>,
}

/// Request bodies: whole (JSON) or streamed (file uploads, stdin).
pub type Body = BoxBody<Bytes, std::io::Error>;

pub fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).map_err(|never| match never {}).boxed()
}

/// Where the client settings come from, in order: flags, environment, `data_dir`'s
/// client.toml (when given), `$DSEC_CONFIG`, `~/.config/dsec/client.toml`.
pub fn resolve(
    url: Option<&str>,
    key: Option<&str>,
    data_dir: Option<&Path>,
) -> Result<ClientConfig> {
    let file = data_dir
        .map(|d| d.join("client.toml"))
        .filter(|p| p.exists())
        .or_else(client_config::resolve_path)
        .filter(|p| p.exists());
    let from_file = match &file {
        Some(p) => Some(ClientConfig::load(p)?),
        None => None,
    };
    let api_url = url
        .map(str::to_string)
        .or_else(|| from_file.as_ref().map(|c| c.api_url.clone()))
        .ok_or_else(|| anyhow!("no API URL: run `dsec up`, or set DSEC_API_URL / --api-url"))?;
    let api_key = key
        .map(str::to_string)
        .or_else(|| from_file.as_ref().map(|c| c.api_key.clone()))
        .ok_or_else(|| anyhow!("no API key: run `dsec up`, or set DSEC_API_KEY / --api-key"))?;
    Ok(ClientConfig { api_url, api_key })
}

impl Api {
    pub fn new(cfg: &ClientConfig) -> Result<Api> {
        let base = cfg.api_url.trim_end_matches('/').to_string();
        if !base.starts_with("http://") {
            bail!("API URL {base} must start with http://");
        }
        let mut conn = HttpConnector::new();
        conn.set_connect_timeout(Some(Duration::from_secs(5)));
        Ok(Api {
            base,
            key: cfg.api_key.clone(),
            http: Client::builder(TokioExecutor::new()).build(conn),
        })
    }

    /// Sends a request and returns the response with its body unread; an error status
    /// becomes an error with the server's message.
    pub async fn open(
        &self,
        method: Method,
        path: &str,
        content_type: &str,
        body: Body,
    ) -> Result<hyper::Response<hyper::body::Incoming>> {
        let req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("authorization", format!("Bearer {}", self.key))
            .header("content-type", content_type)
            .body(body)?;
        let resp = self.http.request(req).await.with_context(|| {
            format!(
                "cannot reach the OpenDsec API at {} (is `dsec up` running?)",
                self.base
            )
        })?;
        if !resp.status().is_success() {
            let status = resp.status();
            let bytes = resp.into_body().collect().await?.to_bytes();
            return Err(error_of(status, &bytes));
        }
        Ok(resp)
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes)> {
        let req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("authorization", format!("Bearer {}", self.key))
            .header("content-type", "application/json")
            .body(full(body.unwrap_or_default()))?;
        let resp = self.http.request(req).await.with_context(|| {
            format!(
                "cannot reach the OpenDsec API at {} (is `dsec up` running?)",
                self.base
            )
        })?;
        let status = resp.status();
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok((status, bytes))
    }

    pub async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&impl Serialize>,
    ) -> Result<T> {
        let body = body.map(serde_json::to_vec).transpose()?;
        let (status, bytes) = self.send(method, path, body).await?;
        if !status.is_success() {
            return Err(error_of(status, &bytes));
        }
        if bytes.is_empty() {
            return Ok(serde_json::from_str("null")?);
        }
        serde_json::from_slice(&bytes).with_context(|| format!("unexpected reply from {path}"))
    }
}

fn error_of(status: StatusCode, bytes: &[u8]) -> anyhow::Error {
    match serde_json::from_slice::<ApiError>(bytes) {
        Ok(e) => anyhow!("{} ({}): {}", e.code.as_str(), status.as_u16(), e.message),
        Err(_) => anyhow!("HTTP {status}: {}", String::from_utf8_lossy(bytes)),
    }
}
