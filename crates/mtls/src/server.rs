//! Serving an axum router over mutual TLS. A peer without a certificate from the cluster CA
//! fails the handshake; one whose role is not admitted is dropped right after it. Handlers
//! find the peer's [`Identity`] in the request extensions. Connections speak HTTP/1.1
//! (REST, upgrades) or HTTP/2 (gRPC), as the client's ALPN asks.
//!
//! A peer with a [`Role::Monitor`] certificate (a Prometheus server) is admitted by every
//! listener, but its requests never reach the listener's router: it gets `GET /metrics`
//! (the process's metrics) and a 403 for anything else.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use crate::{Identity, Role, Tls};

/// Calls in flight on one HTTP/2 connection (a create may take minutes).
const MAX_STREAMS: u32 = 16_384;

/// The most a client may take to finish the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Accepts connections on `listener` until `shutdown` completes, admitting peers whose
/// role is in `allowed`.
pub async fn serve(
    listener: TcpListener,
    tls: &Tls,
    allowed: &[Role],
    app: Router,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let acceptor = TlsAcceptor::from(tls.server.clone());
    let allowed: Arc<[Role]> = allowed.into();
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer_addr) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => return Ok(()),
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let allowed = allowed.clone();
        let app = app.clone();
        tokio::spawn(async move {
            let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    tracing::info!(peer = %peer_addr, error = %e, "TLS handshake refused");
                    return;
                }
                Err(_) => {
                    tracing::info!(peer = %peer_addr, "TLS handshake timed out");
                    return;
                }
            };
            let identity = stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .and_then(|c| Identity::from_der(c));
            let Some(identity) =
                identity.filter(|i| i.role == Role::Monitor || allowed.contains(&i.role))
            else {
                tracing::warn!(peer = %peer_addr, "refusing a peer whose certificate names no admitted role");
                return;
            };
            let svc = if identity.role == Role::Monitor {
                monitor()
            } else {
                app.layer(axum::Extension(identity))
            };
            let mut builder = auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(30));
            builder
                .http2()
                .timer(TokioTimer::new())
                // An apiserver multiplexes every call to this node over one connection.
                .max_concurrent_streams(MAX_STREAMS)
                .keep_alive_interval(Duration::from_secs(20))
                .keep_alive_timeout(Duration::from_secs(10));
            let conn = builder.serve_connection_with_upgrades(
                TokioIo::new(stream),
                TowerToHyperService::new(svc),
            );
            if let Err(e) = conn.await {
                tracing::debug!(peer = %peer_addr, error = %e, "connection ended with an error");
            }
        });
    }
}

/// What a monitor's certificate reaches: the metrics, read-only.
fn monitor() -> Router {
    use axum::http::{StatusCode, header};
    use axum::response::IntoResponse;
    Router::new()
        .route(
            "/metrics",
            axum::routing::get(|| async {
                (
                    [(header::CONTENT_TYPE, dsec_metrics::CONTENT_TYPE)],
                    dsec_metrics::scrape(),
                )
            }),
        )
        .fallback(|| async {
            (
                StatusCode::FORBIDDEN,
                [(header::CONTENT_TYPE, "application/json")],
                r#"{"code":"permission_denied","message":"a monitor certificate reaches GET /metrics only"}"#,
            )
                .into_response()
        })
}

/// Runs `serve` in the background with no shutdown (for tests and simple roles).
pub fn spawn(listener: TcpListener, tls: &Tls, allowed: &[Role], app: Router) {
    let tls = tls.clone();
    let allowed = allowed.to_vec();
    tokio::spawn(async move {
        let _ = serve(listener, &tls, &allowed, app, std::future::pending()).await;
    });
}
