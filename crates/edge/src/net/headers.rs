//! The egress header proxy: sets a sandbox's `egress_headers` on its outbound HTTP and
//! HTTPS requests, so a credential reaches a service without the sandbox ever holding it.
//!
//! Only sandboxes with egress headers are sent here: the node's table sends their TCP
//! connections to ports 80 and 443 of addresses their rules already open (DNS-learned
//! or CIDR rules, never the never-ranges) to this listener on the sandboxes' gateway
//! (`nft::base`, set `h`); nothing else reaches it (the input chain takes only
//! translated connections). For each connection the proxy reads where it was going
//! (`SO_ORIGINAL_DST`) and what it starts with:
//!
//! - TLS: the ClientHello's server name (parsed by rustls from bytes peeked, not read).
//!   A name with headers is answered with a certificate for it from the node's CA, which
//!   the sandbox trusts (installed at create, [`install_trust`]); the proxy then connects
//!   to the original address over TLS, checks the server's certificate for that name
//!   against the system's CAs (and `[edge.network] header_roots`), and relays HTTP/1.1
//!   requests with the headers set. Any other name is relayed untouched, bytes for bytes.
//! - Anything else is read as HTTP/1.1: each request whose `Host` has headers gets them
//!   when the address is one the sandbox's own DNS answer for that name opened
//!   (`Network::headers_for`); the rest go on unchanged.
//!
//! Requests upgraded to other protocols (WebSocket) and HTTP/2 are not relayed through
//! rewritten connections (the proxy offers HTTP/1.1 only, which clients fall back to).

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper::Request;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, pem::PemObject};
use rustls::sign::CertifiedKey;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};

use super::Network;
use super::rules::never_range_of_ip;

/// Where the node's CA is written in a sandbox (and added to its system bundle).
pub const TRUST_PATH: &str = "/usr/local/share/ca-certificates/opendsec-egress.crt";
pub const SYSTEM_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// Environment a sandbox with egress headers gets (unless it sets them), so that
/// programs with trust stores of their own (Node.js, Python's requests) trust the CA too.
pub const TRUST_ENV: [(&str, &str); 3] = [
    ("NODE_EXTRA_CA_CERTS", TRUST_PATH),
    ("REQUESTS_CA_BUNDLE", SYSTEM_BUNDLE),
    ("SSL_CERT_FILE", SYSTEM_BUNDLE),
];

/// How long a connection may take to show what it is, and to reach its server.
const SNIFF_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a request's head may take to arrive.
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
/// Most connections one sandbox may have through the proxy at a time, and all of them.
const MAX_PER_SANDBOX: usize = 512;
const MAX_TOTAL: usize = 16_384;
/// How long a TLS handshake (with the sandbox, with the server) may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a connection checks that its sandbox is still there (a stopped sandbox's
/// connections end within this, though its peer never said goodbye).
const OWNER_CHECK: Duration = Duration::from_secs(10);
/// Most certificates kept made (one per host name asked for).
const MAX_CERTS: usize = 4096;
/// A ClientHello larger than this is relayed untouched.
const MAX_HELLO: usize = 16 * 1024 + 5;

#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    #[error("the egress CA in {path}: {why}")]
    Ca { path: PathBuf, why: String },
    #[error("egress header proxy on {addr}: {why}")]
    Listen { addr: SocketAddr, why: String },
    #[error("[edge.network] header_roots {path}: {why}")]
    Roots { path: String, why: String },
}

/// Why one connection through the proxy failed (logged at debug; the sandbox sees the
/// connection close).
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("not IPv4")]
    NotIpv4,
    #[error("not from a sandbox")]
    NotFromSandbox,
    #[error("no original destination")]
    NoDestination,
    #[error("refused: {0} is never reachable")]
    Unreachable(SocketAddrV4),
    #[error("the proxy is at its connection limit")]
    ProxyFull,
    #[error("too many connections from the sandbox")]
    SandboxFull,
    #[error("its sandbox is gone")]
    SandboxGone,
    #[error("connecting to {dst}: {source}")]
    Connect {
        dst: SocketAddrV4,
        source: std::io::Error,
    },
    #[error("{what}: timed out")]
    Timeout { what: String },
    #[error("TLS with {peer}: {source}")]
    Handshake {
        peer: String,
        source: std::io::Error,
    },
    #[error("a certificate for {host}: {why}")]
    Certificate { host: String, why: String },
    #[error("{0:?} is not a server name")]
    BadName(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Http(#[from] hyper::Error),
    #[error(transparent)]
    Tls(#[from] rustls::Error),
}

/// The node's CA for the certificates the proxy answers with.
struct Ca {
    pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl Ca {
    /// Reads `dir/ca.pem` and `dir/ca.key`, making them the first time (kept across
    /// restarts: sandboxes made before trust the same CA).
    fn load_or_make(dir: &Path, node: &str) -> Result<Ca, HeaderError> {
        let (cert_path, key_path) = (dir.join("ca.pem"), dir.join("ca.key"));
        let err = |why: String| HeaderError::Ca {
            path: dir.to_path_buf(),
            why,
        };
        if !(cert_path.exists() && key_path.exists()) {
            std::fs::create_dir_all(dir).map_err(|e| err(e.to_string()))?;
            let key = KeyPair::generate().map_err(|e| err(e.to_string()))?;
            let mut params = CertificateParams::default();
            params.distinguished_name.push(
                DnType::CommonName,
                format!("OpenDsec egress header proxy CA ({node})"),
            );
            params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
            params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
            dsec_mtls::pki::validity(&mut params, 10);
            let cert = params.self_signed(&key).map_err(|e| err(e.to_string()))?;
            dsec_mtls::pki::write(&key_path, &key.serialize_pem(), true)
                .map_err(|e| err(e.to_string()))?;
            dsec_mtls::pki::write(&cert_path, &cert.pem(), false)
                .map_err(|e| err(e.to_string()))?;
        }
        let pem = std::fs::read_to_string(&cert_path).map_err(|e| err(e.to_string()))?;
        let key_pem = std::fs::read_to_string(&key_path).map_err(|e| err(e.to_string()))?;
        let key = KeyPair::from_pem(&key_pem).map_err(|e| err(e.to_string()))?;
        let issuer = Issuer::from_ca_cert_pem(&pem, key).map_err(|e| err(e.to_string()))?;
        Ok(Ca { pem, issuer })
    }

    /// A certificate for `host` (a name or an address), signed by the CA.
    fn issue(&self, host: &str) -> Result<CertifiedKey, ConnError> {
        let err = |why: String| ConnError::Certificate {
            host: host.to_string(),
            why,
        };
        let key = KeyPair::generate().map_err(|e| err(e.to_string()))?;
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, host);
        params.subject_alt_names = vec![match host.parse::<Ipv4Addr>() {
            Ok(ip) => SanType::IpAddress(ip.into()),
            Err(_) => SanType::DnsName(
                host.try_into()
                    .map_err(|e: rcgen::Error| err(e.to_string()))?,
            ),
        }];
        dsec_mtls::pki::validity(&mut params, 1);
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(|e| err(e.to_string()))?;
        let der = PrivateKeyDer::try_from(key.serialize_der()).map_err(|e| err(e.to_string()))?;
        let signer = rustls::crypto::aws_lc_rs::sign::any_supported_type(&der)?;
        Ok(CertifiedKey::new(vec![cert.der().clone()], signer))
    }
}

/// The proxy's state: the CA, certificates made, TLS to servers, connections per sandbox.
pub struct HeaderProxy {
    ca: Ca,
    certs: Mutex<HashMap<String, Arc<CertifiedKey>>>,
    upstream: Arc<rustls::ClientConfig>,
    open: Mutex<HashMap<Ipv4Addr, usize>>,
    total: tokio::sync::Semaphore,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// The CAs servers are checked against: the system's bundle and `extra` PEM files.
fn roots(extra: &[String]) -> Result<rustls::RootCertStore, HeaderError> {
    let mut store = rustls::RootCertStore::empty();
    for system in [SYSTEM_BUNDLE, "/etc/pki/tls/certs/ca-bundle.crt"] {
        if let Ok(it) = CertificateDer::pem_file_iter(system) {
            for c in it.flatten() {
                let _ = store.add(c);
            }
            break;
        }
    }
    for path in extra {
        let err = |why: String| HeaderError::Roots {
            path: path.clone(),
            why,
        };
        let it = CertificateDer::pem_file_iter(path).map_err(|e| err(e.to_string()))?;
        for c in it {
            store
                .add(c.map_err(|e| err(e.to_string()))?)
                .map_err(|e| err(e.to_string()))?;
        }
    }
    Ok(store)
}

impl HeaderProxy {
    pub fn new(ca_dir: &Path, node: &str, extra_roots: &[String]) -> Result<Self, HeaderError> {
        let ca = Ca::load_or_make(ca_dir, node)?;
        let mut upstream = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| HeaderError::Roots {
                path: String::new(),
                why: e.to_string(),
            })?
            .with_root_certificates(roots(extra_roots)?)
            .with_no_client_auth();
        upstream.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(HeaderProxy {
            ca,
            certs: Mutex::new(HashMap::new()),
            upstream: Arc::new(upstream),
            open: Mutex::new(HashMap::new()),
            total: tokio::sync::Semaphore::new(MAX_TOTAL),
        })
    }

    /// The CA certificate (PEM) sandboxes with egress headers trust.
    pub fn ca_pem(&self) -> &str {
        &self.ca.pem
    }

    fn cert_for(&self, host: &str) -> Result<Arc<CertifiedKey>, ConnError> {
        if let Some(c) = lock(&self.certs).get(host) {
            return Ok(c.clone());
        }
        let c = Arc::new(self.ca.issue(host)?);
        let mut certs = lock(&self.certs);
        if certs.len() >= MAX_CERTS {
            certs.clear();
        }
        certs.insert(host.to_string(), c.clone());
        Ok(c)
    }

    fn server_config(&self, host: &str) -> Result<Arc<rustls::ServerConfig>, ConnError> {
        let key = self.cert_for(host)?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(rustls::sign::SingleCertAndKey::from(key)));
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(cfg))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A connection counted against its sandbox until dropped.
struct Slot<'a> {
    proxy: &'a HeaderProxy,
    src: Ipv4Addr,
}

impl<'a> Slot<'a> {
    fn take(proxy: &'a HeaderProxy, src: Ipv4Addr) -> Option<Slot<'a>> {
        let mut open = lock(&proxy.open);
        let n = open.entry(src).or_default();
        if *n >= MAX_PER_SANDBOX {
            return None;
        }
        *n += 1;
        Some(Slot { proxy, src })
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let mut open = lock(&self.proxy.open);
        if let Some(n) = open.get_mut(&self.src) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.src);
            }
        }
    }
}

/// Listens on the sandboxes' gateway and serves every connection sent here.
pub async fn spawn(
    net: Arc<Network>,
    proxy: Arc<HeaderProxy>,
    gateway: Ipv4Addr,
) -> Result<tokio::task::JoinHandle<()>, HeaderError> {
    let addr = SocketAddr::from((gateway, net.cfg.header_port));
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| HeaderError::Listen {
            addr,
            why: format!("{e} (one node per network namespace, or set [edge.network] header_port)"),
        })?;
    Ok(tokio::spawn(async move {
        loop {
            let Ok((s, from)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let (net, proxy) = (net.clone(), proxy.clone());
            tokio::spawn(async move {
                if let Err(e) = serve(&net, &proxy, s, from).await {
                    tracing::debug!(%from, "egress header proxy: {e}");
                }
            });
        }
    }))
}

/// Where a translated connection was going (`SO_ORIGINAL_DST`).
fn original_dst(s: &TcpStream) -> Option<SocketAddrV4> {
    use std::os::fd::AsRawFd;
    let mut a: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: a sockaddr_in-sized buffer and its length, for the kernel to fill.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_IP,
            libc::SO_ORIGINAL_DST,
            (&mut a as *mut libc::sockaddr_in).cast(),
            &mut len,
        )
    };
    (r == 0 && a.sin_family == libc::AF_INET as libc::sa_family_t).then(|| {
        SocketAddrV4::new(
            Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
            u16::from_be(a.sin_port),
        )
    })
}

async fn serve(
    net: &Network,
    proxy: &HeaderProxy,
    client: TcpStream,
    from: SocketAddr,
) -> Result<(), ConnError> {
    let SocketAddr::V4(from) = from else {
        return Err(ConnError::NotIpv4);
    };
    let src = *from.ip();
    let owner = net.sandbox_id_at(src).ok_or(ConnError::NotFromSandbox)?;
    let dst = original_dst(&client).ok_or(ConnError::NoDestination)?;
    let local = client.local_addr()?;
    // Only translated connections to what a rule opened get here (the table sends no
    // address of the node's own, nor the pool); never back to the node or a sandbox.
    if SocketAddr::V4(dst) == local
        || never_range_of_ip(*dst.ip()).is_some()
        || net.in_pool(*dst.ip())
    {
        return Err(ConnError::Unreachable(dst));
    }
    let _all = proxy
        .total
        .try_acquire()
        .map_err(|_| ConnError::ProxyFull)?;
    let _slot = Slot::take(proxy, src).ok_or(ConnError::SandboxFull)?;
    keepalive(&client);
    let work = async {
        let first = tokio::time::timeout(SNIFF_TIMEOUT, peek_first(&client)).await;
        match first {
            Ok(Some(0x16)) => {
                let name = tokio::time::timeout(SNIFF_TIMEOUT, server_name(&client))
                    .await
                    .ok()
                    .flatten();
                let host = name.unwrap_or_else(|| dst.ip().to_string());
                match net.headers_for(src, *dst.ip(), &host, true) {
                    Some(_) => rewrite_tls(net, proxy, src, client, dst, &host).await,
                    None => relay(client, dst).await,
                }
            }
            Ok(Some(_)) => rewrite_http(net, src, client, dst).await,
            // Says nothing first, or is already gone: relay whatever comes.
            Ok(None) | Err(_) => relay(client, dst).await,
        }
    };
    // A connection lives no longer than its sandbox (whose address may go to another).
    let gone = async {
        loop {
            tokio::time::sleep(OWNER_CHECK).await;
            if net.sandbox_id_at(src).as_deref() != Some(owner.as_str()) {
                return;
            }
        }
    };
    tokio::select! {
        r = work => r,
        () = gone => Err(ConnError::SandboxGone),
    }
}

/// TCP keepalive, so that a peer that vanished (a sandbox's veth removed) is found out.
fn keepalive(s: &TcpStream) {
    use std::os::fd::AsRawFd;
    let fd = s.as_raw_fd();
    for (level, opt, v) in [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 60),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 10),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 6),
    ] {
        let v: libc::c_int = v;
        // SAFETY: an int option on a socket this process owns.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                opt,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
}

async fn peek_first(s: &TcpStream) -> Option<u8> {
    let mut b = [0u8; 1];
    match s.peek(&mut b).await {
        Ok(1) => Some(b[0]),
        _ => None,
    }
}

/// The server name of the ClientHello at the start of `s`, read without consuming it.
async fn server_name(s: &TcpStream) -> Option<String> {
    let mut buf = vec![0u8; MAX_HELLO];
    let mut seen = 0;
    loop {
        let n = s.peek(&mut buf).await.ok()?;
        if n == 0 {
            return None;
        }
        if n > seen {
            seen = n;
            let mut acc = rustls::server::Acceptor::default();
            let mut rd: &[u8] = &buf[..n];
            acc.read_tls(&mut rd).ok()?;
            match acc.accept() {
                Ok(Some(a)) => return a.client_hello().server_name().map(str::to_string),
                Ok(None) if n < buf.len() => {}
                _ => return None,
            }
        }
        // The rest of the hello is on its way.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn connect(dst: SocketAddrV4) -> Result<TcpStream, ConnError> {
    match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(dst)).await {
        Ok(Ok(s)) => {
            keepalive(&s);
            Ok(s)
        }
        Ok(Err(source)) => Err(ConnError::Connect { dst, source }),
        Err(_) => Err(ConnError::Timeout {
            what: format!("connecting to {dst}"),
        }),
    }
}

/// Bytes both ways, unchanged.
async fn relay(mut client: TcpStream, dst: SocketAddrV4) -> Result<(), ConnError> {
    let mut server = connect(dst).await?;
    tokio::io::copy_bidirectional(&mut client, &mut server).await?;
    Ok(())
}

async fn rewrite_tls(
    net: &Network,
    proxy: &HeaderProxy,
    src: Ipv4Addr,
    client: TcpStream,
    dst: SocketAddrV4,
    host: &str,
) -> Result<(), ConnError> {
    let cfg = proxy.server_config(host)?;
    let name =
        ServerName::try_from(host.to_string()).map_err(|_| ConnError::BadName(host.into()))?;
    let accept = tokio_rustls::TlsAcceptor::from(cfg).accept(client);
    let client = handshake(format!("the sandbox for {host}"), accept).await?;
    let tcp = connect(dst).await?;
    let connect = tokio_rustls::TlsConnector::from(proxy.upstream.clone()).connect(name, tcp);
    let server = handshake(format!("{host} at {dst}"), connect).await?;
    // The server proved it is `host`; a request on this connection that names another
    // host (which a front serving many would route by) gets nothing. Looked up per
    // request, so changed headers hold on connections already open.
    proxy_http(client, server, |h| {
        same_host(h, host)
            .then(|| net.headers_for(src, *dst.ip(), h, true))
            .flatten()
            .map(Arc::new)
    })
    .await
}

/// A TLS handshake with `peer`, within [`HANDSHAKE_TIMEOUT`].
async fn handshake<T>(
    peer: String,
    h: impl std::future::Future<Output = std::io::Result<T>>,
) -> Result<T, ConnError> {
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, h).await {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(source)) => Err(ConnError::Handshake { peer, source }),
        Err(_) => Err(ConnError::Timeout {
            what: format!("TLS with {peer}"),
        }),
    }
}

/// Whether two host names are the same name.
fn same_host(a: &str, b: &str) -> bool {
    a.trim_end_matches('.')
        .eq_ignore_ascii_case(b.trim_end_matches('.'))
}

async fn rewrite_http(
    net: &Network,
    src: Ipv4Addr,
    client: TcpStream,
    dst: SocketAddrV4,
) -> Result<(), ConnError> {
    let server = connect(dst).await?;
    proxy_http(client, server, |host| {
        net.headers_for(src, *dst.ip(), host, false).map(Arc::new)
    })
    .await
}

/// The host a request names, without its port: its one `Host` (`name[:port]`), which must
/// be the URI's host when the URI names one (an origin routes by the URI). None when the
/// request is ambiguous: it then gets no headers.
fn host_of<B>(req: &Request<B>) -> Option<String> {
    let mut all = req.headers().get_all(hyper::header::HOST).iter();
    let header = all.next();
    if all.next().is_some() {
        return None;
    }
    let from_uri = req.uri().host();
    let host = match header {
        Some(v) => {
            let v = v.to_str().ok()?.trim();
            let (name, port) = match v.rsplit_once(':') {
                Some((n, p)) => (n, Some(p)),
                None => (v, None),
            };
            let name_ok = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b));
            let port_ok = port.is_none_or(|p| {
                !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit())
            });
            if !(name_ok && port_ok) {
                return None;
            }
            if from_uri.is_some_and(|u| !same_host(u, name)) {
                return None;
            }
            name
        }
        None => from_uri?,
    };
    Some(host.to_string())
}

/// Relays HTTP/1.1 requests from `client` to `server`, setting on each the headers
/// `headers_for` gives for its host.
async fn proxy_http<C, S, F>(client: C, server: S, headers_for: F) -> Result<(), ConnError>
where
    C: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    F: Fn(&str) -> Option<Arc<Vec<(String, String)>>>,
{
    let (sender, conn) =
        hyper::client::conn::http1::handshake::<_, Incoming>(TokioIo::new(server)).await?;
    let upstream = tokio::spawn(conn);
    let sender = Arc::new(tokio::sync::Mutex::new(sender));
    let headers_for = &headers_for;
    let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        let sender = sender.clone();
        // A request that would echo itself back (TRACE) or become a tunnel gets none.
        let plain = !matches!(*req.method(), hyper::Method::TRACE | hyper::Method::CONNECT);
        let set = host_of(&req)
            .filter(|_| plain)
            .and_then(|h| headers_for(&h));
        async move {
            if let Some(set) = set {
                for (name, value) in set.iter() {
                    if let (Ok(n), Ok(v)) = (
                        hyper::header::HeaderName::from_bytes(name.as_bytes()),
                        hyper::header::HeaderValue::from_str(value),
                    ) {
                        req.headers_mut().insert(n, v);
                    }
                }
            }
            let mut s = sender.lock().await;
            s.ready().await?;
            s.send_request(req).await
        }
    });
    let served = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .serve_connection(TokioIo::new(client), service)
        .await;
    upstream.abort();
    Ok(served?)
}

/// Puts the node's CA into the sandbox behind `sock`: its own file, and appended to the
/// system bundle, unless the file already holds this CA (an image made from a sandbox of
/// another node may hold that node's).
pub async fn install_trust(sock: &Path, pem: &str) -> Result<(), dsec_common::ApiError> {
    use crate::channel::{Conn, check};
    use dsec_common::channel::{FRAME_DATA, Request, Response};
    let mut held = Vec::new();
    let mut conn = Conn::open(
        sock,
        &Request::ReadFile {
            path: TRUST_PATH.into(),
        },
    )
    .await?;
    if let Ok(Response::File { size }) = conn.reply().await
        && size <= 64 * 1024
    {
        while let Some((FRAME_DATA, d)) = conn.frame().await? {
            if d.is_empty() {
                break;
            }
            held.extend_from_slice(&d);
        }
    }
    if held.trim_ascii() == pem.as_bytes().trim_ascii() {
        return Ok(());
    }
    for (path, append) in [(SYSTEM_BUNDLE, true), (TRUST_PATH, false)] {
        let req = Request::WriteFile {
            path: path.into(),
            mode: Some(0o644),
            append,
            user: None,
            metadata: None,
        };
        let mut conn = Conn::open(sock, &req).await?;
        conn.data(format!("\n{pem}").as_bytes()).await?;
        conn.data(&[]).await?;
        check(conn.reply().await?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(host: Option<&str>, uri: &str) -> Request<()> {
        let mut b = Request::builder().uri(uri);
        if let Some(h) = host {
            b = b.header("host", h);
        }
        b.body(()).unwrap()
    }

    #[test]
    fn the_host_of_a_request_is_its_one_host_without_the_port() {
        let h = |r: &Request<()>| host_of(r);
        assert_eq!(
            h(&req(Some("api.example.com"), "/")).as_deref(),
            Some("api.example.com")
        );
        assert_eq!(
            h(&req(Some("api.example.com:8080"), "/")).as_deref(),
            Some("api.example.com")
        );
        assert_eq!(
            h(&req(None, "http://h.example.com:81/x")).as_deref(),
            Some("h.example.com")
        );
        assert_eq!(h(&req(None, "/")), None);
        // Ambiguous requests name no host: the URI names another (an origin routes by
        // the URI), two Host headers, a Host that is not name[:port].
        assert_eq!(
            h(&req(Some("api.example.com"), "http://evil.example/")),
            None
        );
        assert_eq!(
            h(&req(Some("api.example.com"), "http://API.example.com/x")).as_deref(),
            Some("api.example.com")
        );
        let mut two = req(Some("api.example.com"), "/");
        two.headers_mut()
            .append("host", "evil.example".parse().unwrap());
        assert_eq!(h(&two), None);
        for bad in [
            "api.example.com:80, evil",
            "api.example.com:x",
            "a b",
            "[2001:db8::1]:80",
            "",
        ] {
            assert_eq!(h(&req(Some(bad), "/")), None, "{bad}");
        }
    }

    #[test]
    fn names_compare_without_case_or_the_root_dot() {
        assert!(same_host("API.example.com.", "api.example.com"));
        assert!(!same_host("api.example.com.evil", "api.example.com"));
    }

    #[test]
    fn certificates_for_names_and_addresses_chain_to_the_ca() {
        use rustls::client::danger::ServerCertVerifier;
        let dir = tempfile::tempdir().unwrap();
        let p = HeaderProxy::new(dir.path(), "t", &[]).unwrap();
        let again = HeaderProxy::new(dir.path(), "t", &[]).unwrap();
        assert_eq!(p.ca_pem(), again.ca_pem(), "the CA is kept across restarts");
        let mode = std::fs::metadata(dir.path().join("ca.key"))
            .unwrap()
            .permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o600
        );
        // A client that trusts only the CA accepts what the proxy answers with.
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(p.ca_pem().as_bytes()) {
            roots.add(c.unwrap()).unwrap();
        }
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            provider(),
        )
        .build()
        .unwrap();
        for host in ["api.example.com", "203.0.113.7"] {
            let key = p.cert_for(host).unwrap();
            let name = ServerName::try_from(host.to_string()).unwrap();
            let now = rustls::pki_types::UnixTime::now();
            verifier
                .verify_server_cert(&key.cert[0], &[], &name, &[], now)
                .unwrap();
            let other = ServerName::try_from("other.example.com".to_string()).unwrap();
            assert!(
                verifier
                    .verify_server_cert(&key.cert[0], &[], &other, &[], now)
                    .is_err()
            );
        }
    }

    #[tokio::test]
    async fn a_client_hello_is_read_without_being_consumed() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let client = tokio::spawn(async move {
            let roots = rustls::RootCertStore::empty();
            let cfg = rustls::ClientConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
            let tcp = TcpStream::connect(addr).await.unwrap();
            let name = ServerName::try_from("api.example.com".to_string()).unwrap();
            let _ = tokio_rustls::TlsConnector::from(Arc::new(cfg))
                .connect(name, tcp)
                .await;
        });
        let (s, _) = l.accept().await.unwrap();
        assert_eq!(peek_first(&s).await, Some(0x16));
        assert_eq!(server_name(&s).await.as_deref(), Some("api.example.com"));
        // Still all there: a second look finds the same.
        assert_eq!(server_name(&s).await.as_deref(), Some("api.example.com"));
        drop(s);
        let _ = client.await;
    }
}
