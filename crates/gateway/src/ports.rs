//! Sandbox ports through the gateway: a request for `{port}-{id}.{domain}` (what
//! `get_host(port)` returns), or one with `E2b-Sandbox-Port` naming a port other than
//! envd's, goes to that port in the sandbox over OpenDsec's port proxy, as it is
//! (method, path, headers, streamed body; WebSocket and other upgrades pass through).
//!
//! As in E2B, the ports of a sandbox the gateway created are open to anyone with the URL
//! unless it was created with `network.allowPublicTraffic = false`. Any other sandbox
//! (private, or created through the native API) wants the `E2B-Traffic-Access-Token`
//! header that create returned, or an `X-API-Key` that can see the sandbox. The gateway
//! adds the port token OpenDsec's port proxy wants only once one of those holds.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use dsec_common::id::SandboxId;
use http_body_util::BodyExt;

use dsec_common::api::SandboxInfo;
use hyper::Method;

use crate::{ENVD_PORT, Gw, PUBLIC_LABEL, access_token, e2b_error, header_str, same};

/// The sandbox (raw id) and port a sandbox-side request names: `E2b-Sandbox-Id` and
/// `E2b-Sandbox-Port` (with `E2B_SANDBOX_URL`), else a `{port}-{id}.{domain}` host.
/// None when it names neither.
pub(crate) fn addressed(h: &HeaderMap) -> Option<(String, Option<String>)> {
    if let Some(id) = header_str(h, "e2b-sandbox-id") {
        return Some((
            id.to_string(),
            header_str(h, "e2b-sandbox-port").map(str::to_string),
        ));
    }
    let host = header_str(h, "host")?;
    let (first, _domain) = host.split_once('.')?;
    let (port, id) = first.split_once('-')?;
    Some((id.to_string(), Some(port.to_string())))
}

/// A request for a port other than envd's: the sandbox id and the port.
fn for_port(h: &HeaderMap) -> Option<(String, u16)> {
    let (id, port) = addressed(h)?;
    let port: u16 = port?.parse().ok()?;
    (port != ENVD_PORT && port != 0).then_some((id, port))
}

/// The gateway's front: port traffic is proxied, everything else goes to the routes.
pub(crate) async fn dispatch(State(gw): State<Gw>, req: Request, next: Next) -> Response {
    match for_port(req.headers()) {
        Some((id, port)) => proxy(&gw, &id, port, req).await,
        None => next.run(req).await,
    }
}

/// Marks the OpenDsec port proxy's own errors (its value is the error code).
const PORT_ERROR_HEADER: &str = "dsec-port-error";

/// The token a private sandbox's ports want (`trafficAccessToken`).
pub(crate) fn traffic_token(secret: &[u8], id: &str) -> String {
    access_token(secret, &format!("traffic:{id}"))
}

/// Whether the sandbox's ports are open without credentials.
/// The sandbox's `network.httpsPorts`.
pub(crate) fn https_ports(info: &SandboxInfo) -> Vec<u16> {
    info.labels
        .get(crate::HTTPS_PORTS_LABEL)
        .map(|l| l.split(',').filter_map(|p| p.parse().ok()).collect())
        .unwrap_or_default()
}

pub(crate) fn public(info: &SandboxInfo) -> bool {
    info.labels.get(PUBLIC_LABEL).map(String::as_str) == Some("true")
}

/// A non-public sandbox's port: the caller shows its traffic token, or a key that can see
/// the sandbox (the API answers for it with that key).
async fn may_reach(gw: &Gw, id: &str, h: &HeaderMap) -> Result<(), Response> {
    if let Some(t) = header_str(h, "e2b-traffic-access-token") {
        return if same(t, &traffic_token(&gw.cfg.secret, id)) {
            Ok(())
        } else {
            Err(e2b_error(
                403,
                "this E2B-Traffic-Access-Token is not the one for this sandbox",
            ))
        };
    }
    let Some(key) = header_str(h, "x-api-key") else {
        return Err(e2b_error(
            401,
            "this sandbox's ports are not public: send the E2B-Traffic-Access-Token header that create returned, or an X-API-Key that can see the sandbox",
        ));
    };
    let seen: Result<SandboxInfo, crate::UpErr> = gw
        .up
        .call(Method::GET, &format!("/v1/sandboxes/{id}"), key, None)
        .await;
    match seen {
        Ok(_) => Ok(()),
        Err(e) if e.status == 401 => Err(e2b_error(401, &e.message)),
        Err(_) => Err(e2b_error(
            403,
            "this X-API-Key cannot see the sandbox, whose ports are not public",
        )),
    }
}

async fn proxy(gw: &Gw, id: &str, port: u16, mut req: Request) -> Response {
    let Ok(id) = SandboxId::parse(id).map(|p| p.to_string()) else {
        return crate::envd::gone();
    };
    let info = match crate::envd::running_or_waking(gw, &id).await {
        Ok(i) => i,
        Err(r) => return r,
    };
    if !public(&info)
        && let Err(r) = may_reach(gw, &id, req.headers()).await
    {
        return r;
    }
    let path_and_query = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".to_string());
    let mut b = hyper::Request::builder().method(req.method().clone()).uri(
        gw.up
            .url(&format!("/v1/sandboxes/{id}/ports/{port}{path_and_query}")),
    );
    if let Some(hs) = b.headers_mut() {
        for (k, v) in req.headers() {
            let n = k.as_str();
            // An API key that opened the port goes no further than the gateway.
            let dsec_key = n == "x-api-key"
                && (v.as_bytes().starts_with(b"dsk.") || v.as_bytes().starts_with(b"e2b_"));
            if !n.starts_with("e2b-") && n != "x-dsec-token" && n != "x-dsec-port-tls" && !dsec_key
            {
                hs.append(k.clone(), v.clone());
            }
        }
        match HeaderValue::from_str(&info.port_token) {
            Ok(t) => hs.insert("x-dsec-token", t),
            Err(_) => return e2b_error(500, "the sandbox's port token is not a header value"),
        };
        // `network.httpsPorts`: this port's server speaks TLS.
        if https_ports(&info).contains(&port) {
            hs.insert("x-dsec-port-tls", HeaderValue::from_static("1"));
        }
        // `network.maskRequestHost`: the Host its servers see.
        if let Some(mask) = info.labels.get(crate::MASK_HOST_LABEL) {
            match HeaderValue::from_str(&mask.replace("${PORT}", &port.to_string())) {
                Ok(v) => hs.insert(header::HOST, v),
                Err(_) => return e2b_error(500, "the sandbox's host mask is not a header value"),
            };
        }
    }
    let client_upgrade = req
        .headers()
        .contains_key(header::UPGRADE)
        .then(|| hyper::upgrade::on(&mut req));
    let body = req
        .into_body()
        .map_err(std::io::Error::other)
        .boxed_unsync();
    let up_req = match b.body(body) {
        Ok(r) => r,
        Err(e) => return e2b_error(400, &format!("cannot forward this request: {e}")),
    };
    let mut resp = match gw.up.send(up_req).await {
        Ok(r) => r,
        Err(e) => return e2b_error(502, &e.message),
    };
    if let Some(code) = resp.headers().get(PORT_ERROR_HEADER) {
        // the proxy's own failure, not the sandbox server's answer
        return match code.as_bytes() {
            b"not_found" => crate::envd::gone(),
            b"unavailable" => (
                StatusCode::BAD_GATEWAY,
                axum::Json(serde_json::json!({
                    "code": 502,
                    "message": "The sandbox is running but port is not open",
                    "sandboxId": id,
                    "port": port,
                })),
            )
                .into_response(),
            _ => {
                let status = resp.status().as_u16();
                let body = resp.into_body().collect().await.map(|b| b.to_bytes());
                let v: serde_json::Value = body
                    .ok()
                    .and_then(|b| serde_json::from_slice(&b).ok())
                    .unwrap_or_default();
                e2b_error(status, v["message"].as_str().unwrap_or("port proxy error"))
            }
        };
    }
    dsec_common::http::splice_upgrade(client_upgrade, &mut resp);
    resp.map(Body::new).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (k, v) in pairs {
            m.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        m
    }

    #[test]
    fn requests_are_routed_by_header_or_host() {
        let id = "local-0123456789ab";
        assert_eq!(
            for_port(&h(&[("host", &format!("8000-{id}.localhost:17611"))])),
            Some((id.to_string(), 8000))
        );
        // envd's own port, the API's host and headers without a port are not port traffic
        assert_eq!(
            for_port(&h(&[("host", &format!("49983-{id}.sb.example.com"))])),
            None
        );
        assert_eq!(for_port(&h(&[("host", "127.0.0.1:17611")])), None);
        assert_eq!(for_port(&h(&[("e2b-sandbox-id", id)])), None);
        assert_eq!(
            for_port(&h(&[
                ("e2b-sandbox-id", id),
                ("e2b-sandbox-port", "49999"),
                ("host", "8000-other-000000000000.x")
            ])),
            Some((id.to_string(), 49999))
        );
        assert_eq!(
            for_port(&h(&[("host", &format!("99999-{id}.localhost"))])),
            None
        );
        assert_ne!(traffic_token(b"s", id), access_token(b"s", id));
    }
}
