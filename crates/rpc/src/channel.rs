//! The transport of gRPC calls to other roles: one pooled HTTP/2 client (hyper) dialling
//! through `dsec_mtls`'s connector, `https` with this component's certificate (ALPN `h2`),
//! or plain HTTP/2 when the caller has no TLS settings. Every call to a peer is a stream
//! on one connection to it, made on first use and made again after a failure. The
//! generated clients sit directly on it (no queue or worker task in between).

use std::sync::Arc;
use std::time::Duration;

use hyper::Uri;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::ClientConfig;

use crate::CallError;

/// What generated clients are made over: `EdgeClient<Transport>` and the like.
pub type Transport = Client<dsec_mtls::client::Connector, tonic::body::Body>;

/// Clients for the roles' services. Cheap to clone; clones share the connections.
#[derive(Clone)]
pub struct Channels {
    transport: Transport,
    scheme: &'static str,
}

impl Channels {
    pub fn new(tls: Option<Arc<ClientConfig>>) -> Channels {
        let scheme = if tls.is_some() { "https" } else { "http" };
        let connector = dsec_mtls::client::Connector::new(tls.as_ref().map(dsec_mtls::client::h2));
        let transport = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .timer(TokioTimer::new())
            // A peer that went away is noticed within half a minute, not at the next call.
            .http2_keep_alive_interval(Duration::from_secs(20))
            .http2_keep_alive_timeout(Duration::from_secs(10))
            .http2_keep_alive_while_idle(true)
            .pool_idle_timeout(Duration::from_secs(300))
            .build(connector);
        Channels { transport, scheme }
    }

    /// A client of the service at `addr` (`host:port`), e.g.
    /// `channels.client(addr, EdgeClient::with_origin)`.
    pub fn client<C>(
        &self,
        addr: &str,
        make: impl FnOnce(Transport, Uri) -> C,
    ) -> Result<C, CallError> {
        let origin = Uri::try_from(format!("{}://{addr}", self.scheme))
            .map_err(|e| CallError::Local(format!("{addr} is not a host:port: {e}")))?;
        Ok(make(self.transport.clone(), origin))
    }
}
