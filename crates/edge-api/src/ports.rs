//! Port forwarding: `/v1/sandboxes/{id}/ports/{port}/{path}` is proxied as HTTP/1.1 to
//! that port inside the sandbox, over the sandbox channel; WebSocket (any `Upgrade`) works
//! through it. Opened by the API key or by the sandbox's `port_token` (`X-Dsec-Token`
//! header or `dsec_token` query parameter), so a browser can use it. With
//! `X-Dsec-Port-Tls: 1` the server in the sandbox is spoken to over TLS, its certificate
//! not checked (a server of the sandbox's own, self-signed as a rule).

use crate::openapi::SandboxPath;
use dsec_common::error::ErrorReply;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use dsec_common::http::{ApiResult, Failure, api_key};
use dsec_common::{ApiError, ErrorCode};
use hyper_util::rt::TokioIo;

use crate::{AppState, route};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/sandboxes/{id}/ports/{port}", any(proxy_root))
        .route("/v1/sandboxes/{id}/ports/{port}/", any(proxy_root))
        .route("/v1/sandboxes/{id}/ports/{port}/{*rest}", any(proxy_path))
}

/// What these routes serve, for the generated API description.
#[derive(utoipa::OpenApi)]
#[openapi(paths(proxy_path))]
pub(crate) struct Doc;

async fn proxy_root(
    st: State<AppState>,
    Path((id, port)): Path<(String, String)>,
    req: Request,
) -> Response {
    marked(proxy(st, id, port, String::new(), req).await)
}

#[utoipa::path(
    get,
    path = "/v1/sandboxes/{id}/ports/{port}/{path}",
    summary = "Proxy HTTP (and WebSocket upgrades) to a port inside the sandbox; the API key or the sandbox's port_token (X-Dsec-Token or dsec_token) opens it; any method works",
    params(
        SandboxPath,
        ("port" = u64, Path),
        ("path" = String, Path),
        ("dsec_token" = Option<String>, Query),
        ("X-Dsec-Port-Tls" = Option<String>, Header, description = "`1`: speak TLS to the server in the sandbox (its certificate is not checked)"),
    ),
    responses(
        (status = 200, description = "the sandbox server's response"),
        (status = 401, response = ErrorReply),
        (status = 503, response = ErrorReply),
    ),
    security(()),
)]
async fn proxy_path(
    st: State<AppState>,
    Path((id, port, rest)): Path<(String, String, String)>,
    req: Request,
) -> Response {
    marked(proxy(st, id, port, rest, req).await)
}

/// Asks for TLS to the port (see the module's comment).
pub const PORT_TLS_HEADER: &str = "x-dsec-port-tls";

/// Accepts any certificate of the server in the sandbox (the sandbox is the tenant's
/// own; what is checked is only that the handshake is signed by the key it shows).
#[derive(Debug)]
struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// HTTP/1.1 over `s`, upgrades included; its connection runs on its own task.
async fn http_over<S>(s: S) -> Result<hyper::client::conn::http1::SendRequest<Body>, hyper::Error>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = hyper::client::conn::http1::handshake::<_, Body>(TokioIo::new(s)).await?;
    tokio::spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    Ok(sender)
}

fn tls_to_sandbox() -> Result<Arc<rustls::ClientConfig>, rustls::Error> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// The header on the proxy's own errors (as against the sandbox server's answers, which
/// pass unchanged), so a client can tell them apart; its value is the error code.
pub const PORT_ERROR_HEADER: &str = "dsec-port-error";

fn marked(r: ApiResult<Response>) -> Response {
    r.unwrap_or_else(|Failure(e)| {
        let code = HeaderValue::from_str(e.code.as_str()).ok();
        let mut resp = Failure(e).into_response();
        if let Some(code) = code {
            resp.headers_mut().insert(PORT_ERROR_HEADER, code);
        }
        resp
    })
}

/// The query string without our own `dsec_token` parameter, and that token.
fn split_token(query: Option<&str>) -> (Option<String>, Option<String>) {
    let mut token = None;
    let kept: Vec<&str> = query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .filter(|p| match p.strip_prefix("dsec_token=") {
            Some(t) => {
                token = Some(t.to_string());
                false
            }
            None => true,
        })
        .collect();
    ((!kept.is_empty()).then(|| kept.join("&")), token)
}

fn bad_gateway(message: String) -> Failure {
    Failure(ApiError::new(ErrorCode::Unavailable, message))
}

async fn proxy(
    State(st): State<AppState>,
    id: String,
    port: String,
    rest: String,
    mut req: Request,
) -> ApiResult<Response> {
    route(&st, &id)?;
    let port: u16 = port
        .parse()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| ApiError::invalid(format!("{port:?} is not a TCP port (1-65535)")))?;
    let (query, query_token) = split_token(req.uri().query());
    let header_token = req
        .headers()
        .get("x-dsec-token")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    // The API key's headers are ours and are not passed on; with the port token, the
    // client's own `Authorization` (for the server in the sandbox) is.
    let by_key = api_key(req.headers()).and_then(|k| st.iam.authenticate(k));
    let strip_key = by_key.is_some();
    let principal = crate::forwarded_principal(&st, &req).or(by_key);
    if let Some(p) = &principal {
        crate::visible(&st, p, &id)?;
    } else {
        let expected = st.edge.port_token(&id)?;
        let given = header_token.or(query_token);
        let matches = given
            .as_deref()
            .is_some_and(|g| dsec_common::id::same_secret(g.as_bytes(), expected.as_bytes()));
        if !matches || expected.is_empty() {
            return Err(Failure(ApiError::new(
                ErrorCode::Unauthenticated,
                "send the API key (Authorization: Bearer dsk.…) or the sandbox's port_token (X-Dsec-Token or ?dsec_token=)",
            )));
        }
    }
    st.edge.wake_for_request(&id).await?;
    let tls = req.headers_mut().remove(PORT_TLS_HEADER).is_some();
    let stream = st.edge.connect_port(&id, port).await?;
    let mut sender = if tls {
        let cfg = tls_to_sandbox().map_err(|e| bad_gateway(format!("TLS: {e}")))?;
        let name = rustls::pki_types::ServerName::try_from("localhost")
            .map_err(|e| bad_gateway(e.to_string()))?;
        let stream = tokio_rustls::TlsConnector::from(cfg)
            .connect(name, stream)
            .await
            .map_err(|e| bad_gateway(format!("TLS to port {port} in the sandbox: {e}")))?;
        http_over(stream).await
    } else {
        http_over(stream).await
    }
    .map_err(|e| bad_gateway(format!("HTTP to port {port} in the sandbox: {e}")))?;
    let path_and_query = match query {
        Some(q) => format!("/{rest}?{q}"),
        None => format!("/{rest}"),
    };
    *req.uri_mut() = Uri::try_from(path_and_query)
        .map_err(|e| ApiError::invalid(format!("bad path for the sandbox: {e}")))?;
    let headers = req.headers_mut();
    if strip_key {
        headers.remove(header::AUTHORIZATION);
        headers.remove("x-api-key");
    }
    headers.remove("x-dsec-token");
    headers.remove(dsec_iam::http::PRINCIPAL_HEADER);
    if !headers.contains_key(header::HOST) {
        headers.insert(header::HOST, HeaderValue::from_static("localhost"));
    }
    let wants_upgrade = req.headers().contains_key(header::UPGRADE);
    let client_upgrade = wants_upgrade.then(|| hyper::upgrade::on(&mut req));
    let mut resp = sender
        .send_request(req)
        .await
        .map_err(|e| bad_gateway(format!("port {port} in the sandbox: {e}")))?;
    dsec_common::http::splice_upgrade(client_upgrade, &mut resp);
    // The sandbox's pages share the API's origin (and the console's): none may widen a
    // service worker's reach beyond its own port's path, where it could serve the
    // console's pages or see the API calls of this origin.
    resp.headers_mut().remove("service-worker-allowed");
    Ok(resp.map(Body::new).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_is_taken_out_of_the_forwarded_query() {
        assert_eq!(
            split_token(Some("a=1&dsec_token=xyz&b=2")),
            (Some("a=1&b=2".to_string()), Some("xyz".to_string()))
        );
        assert_eq!(split_token(Some("dsec_token=t")), (None, Some("t".into())));
        assert_eq!(split_token(None), (None, None));
    }
}
