//! The control calls between OpenDsec's roles as gRPC (`proto/dsec/v1`): the generated
//! messages and services ([`pb`]), lossless conversions to and from the API's types
//! ([`convert`]), the API's errors as gRPC statuses ([`status`]), and channels that dial
//! over the cluster's mutual TLS ([`channel`]). Servers are served on a role's existing
//! mutual-TLS listener next to its HTTP routes (`dsec_mtls::serve` speaks HTTP/1.1 and
//! HTTP/2): see [`routes`].

pub mod channel;
pub mod convert;
pub mod status;

/// The generated messages and services of package `dsec.v1`.
#[allow(clippy::all, missing_docs)]
pub mod pb {
    tonic::include_proto!("dsec.v1");
}

pub use channel::{Channels, Transport};
pub use convert::Malformed;
pub use status::{CallError, from_status, to_status};
pub use tonic;

/// The metadata entry in which an apiserver (or the watcher) names the caller it acts for:
/// the same encoding as the HTTP header `x-dsec-principal`.
pub const PRINCIPAL_METADATA: &str = "x-dsec-principal";

/// A generated service as an axum router with no fallback, to merge with a listener's HTTP
/// routes (which keep their own fallback). Calls arrive with the request's extensions, the
/// peer's `dsec_mtls::Identity` among them.
pub fn routes<S>(svc: S) -> axum::Router
where
    S: tower::Service<hyper::Request<tonic::body::Body>, Error = std::convert::Infallible>
        + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Response: axum::response::IntoResponse,
    S::Future: Send + 'static,
{
    use tower::ServiceExt;
    axum::Router::new().route_service(
        &format!("/{}/{{*rest}}", S::NAME),
        svc.map_request(|req: hyper::Request<axum::body::Body>| req.map(tonic::body::Body::new)),
    )
}

/// A request carrying `principal` (already encoded) in [`PRINCIPAL_METADATA`].
pub fn with_principal<T>(msg: T, principal: &str) -> Result<tonic::Request<T>, CallError> {
    let mut req = tonic::Request::new(msg);
    let v = principal
        .parse()
        .map_err(|_| CallError::Local("the principal does not fit in gRPC metadata".into()))?;
    req.metadata_mut().insert(PRINCIPAL_METADATA, v);
    Ok(req)
}
