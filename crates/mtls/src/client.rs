//! An HTTP client for component-to-component calls: `https://host:port/...` goes over TLS
//! with this component's certificate (the server's certificate must name `host`), plain
//! `http://` over TCP (single-machine mode). Connections are pooled per host; upgrades
//! (WebSocket, port forwarding) work through it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::Uri;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::ClientConfig;
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

/// The most a TCP connect may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A plain or TLS connection.
pub enum Stream {
    Plain(TokioIo<TcpStream>),
    Tls(Box<TokioIo<TlsStream<TcpStream>>>),
}

impl Connection for Stream {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl hyper::rt::Read for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl hyper::rt::Write for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Opens connections for [`Client`] (and for gRPC channels).
#[derive(Clone)]
pub struct Connector {
    tls: Option<TlsConnector>,
}

impl Connector {
    /// `tls` set: `https` URIs go over TLS with it; `None`: plain TCP only.
    pub fn new(tls: Option<Arc<ClientConfig>>) -> Connector {
        Connector {
            tls: tls.map(TlsConnector::from),
        }
    }
}

/// `config` offering HTTP/2 (ALPN `h2`) instead of HTTP/1.1: for gRPC.
pub fn h2(config: &Arc<ClientConfig>) -> Arc<ClientConfig> {
    let mut c = ClientConfig::clone(config);
    c.alpn_protocols = vec![b"h2".to_vec()];
    Arc::new(c)
}

fn io_err(msg: String) -> std::io::Error {
    std::io::Error::other(msg)
}

impl tower_service::Service<Uri> for Connector {
    type Response = Stream;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Stream, std::io::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let tls = self.tls.clone();
        Box::pin(async move {
            let host = uri
                .host()
                .ok_or_else(|| io_err(format!("{uri} names no host")))?
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
            let https = uri.scheme_str() == Some("https");
            let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
            let tcp =
                tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect((host.as_str(), port)))
                    .await
                    .map_err(|_| {
                        std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!("connecting to {host}:{port} timed out"),
                        )
                    })??;
            let _ = tcp.set_nodelay(true);
            if !https {
                return Ok(Stream::Plain(TokioIo::new(tcp)));
            }
            let tls = tls.ok_or_else(|| {
                io_err(format!("{uri}: this client has no TLS settings for https"))
            })?;
            let name = ServerName::try_from(host.clone())
                .map_err(|e| io_err(format!("{host} is not a valid server name: {e}")))?;
            let s = tls.connect(name, tcp).await?;
            Ok(Stream::Tls(Box::new(TokioIo::new(s))))
        })
    }
}

pub type Body = axum::body::Body;

/// A `POST` of a JSON body.
pub fn post_json(url: &str, json: Vec<u8>) -> Result<hyper::Request<Body>, hyper::http::Error> {
    hyper::Request::post(url)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Body::from(json))
}

/// A pooled HTTP/1.1 client. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    inner: hyper_util::client::legacy::Client<Connector, Body>,
    https: bool,
}

impl Client {
    /// `tls` set: `https` with this component's certificate; `None`: plain HTTP.
    pub fn new(tls: Option<Arc<ClientConfig>>) -> Client {
        let https = tls.is_some();
        let connector = Connector::new(tls);
        Client {
            inner: hyper_util::client::legacy::Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(60))
                .build(connector),
            https,
        }
    }

    /// `https://addr` or `http://addr`, as this client speaks.
    pub fn base(&self, addr: &str) -> String {
        format!("{}://{addr}", if self.https { "https" } else { "http" })
    }

    pub async fn request(
        &self,
        req: hyper::Request<Body>,
    ) -> Result<hyper::Response<Incoming>, hyper_util::client::legacy::Error> {
        self.inner.request(req).await
    }
}
