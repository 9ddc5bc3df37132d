//! Transport between OpenDsec components: HTTP over TLS where both sides present a
//! certificate signed by the cluster CA. A component's identity (role and name) is the
//! certificate's URI SAN `spiffe://opendsec/<role>/<name>`; each server says which roles
//! may connect, and refuses the rest at the handshake.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde::{Deserialize, Serialize};

pub mod client;
pub mod pki;
pub mod server;

pub use client::Client;
pub use server::serve;

pub const URI_PREFIX: &str = "spiffe://opendsec/";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Io(String),
    #[error("certificate: {0}")]
    Certificate(String),
    #[error("{0}")]
    Invalid(String),
}

/// What a component is; servers admit peers by role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Iam,
    Apiserver,
    Watcher,
    Edge,
    /// Not a component: a scraper's certificate (Prometheus), admitted by every listener
    /// to `GET /metrics` and to nothing else (see `server.rs`).
    Monitor,
}

impl Role {
    /// The components' roles (not [`Role::Monitor`]).
    pub const ALL: [Role; 4] = [Role::Iam, Role::Apiserver, Role::Watcher, Role::Edge];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Iam => "iam",
            Role::Apiserver => "apiserver",
            Role::Watcher => "watcher",
            Role::Edge => "edge",
            Role::Monitor => "monitor",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = Error;
    fn from_str(s: &str) -> Result<Role, Error> {
        Role::ALL
            .into_iter()
            .chain([Role::Monitor])
            .find(|r| r.as_str() == s)
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "unknown role {s:?}: use one of iam, apiserver, watcher, edge (components) or monitor (a metrics scraper)"
                ))
            })
    }
}

/// Who is on the other end of a connection, from its certificate.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identity {
    pub role: Role,
    pub name: String,
}

impl Identity {
    pub fn new(role: Role, name: &str) -> Result<Identity, Error> {
        let ok = !name.is_empty()
            && name.len() <= 63
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !ok {
            return Err(Error::Invalid(format!(
                "component name {name:?} must be 1-63 characters of a-z, 0-9 and '-'"
            )));
        }
        Ok(Identity {
            role,
            name: name.to_string(),
        })
    }

    pub fn uri(&self) -> String {
        format!("{URI_PREFIX}{}/{}", self.role, self.name)
    }

    fn from_uri(uri: &str) -> Option<Identity> {
        let (role, name) = uri.strip_prefix(URI_PREFIX)?.split_once('/')?;
        Identity::new(role.parse().ok()?, name).ok()
    }

    /// The identity in a DER certificate (its first `spiffe://opendsec/` URI SAN).
    pub fn from_der(der: &[u8]) -> Option<Identity> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
        let san = cert.subject_alternative_name().ok()??;
        san.value.general_names.iter().find_map(|n| match n {
            x509_parser::extensions::GeneralName::URI(u) => Identity::from_uri(u),
            _ => None,
        })
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.role, self.name)
    }
}

/// The three PEM files a component needs (the `[tls]` table of its config).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsFiles {
    /// `dir/ca.pem`, `dir/<name>.pem`, `dir/<name>.key`: what `dsec certs issue` writes.
    pub fn in_dir(dir: &Path, name: &str) -> TlsFiles {
        TlsFiles {
            ca: dir.join(pki::CA_CERT),
            cert: dir.join(format!("{name}.pem")),
            key: dir.join(format!("{name}.key")),
        }
    }
}

/// A component's loaded TLS settings: its identity and a server and a client config, both
/// requiring the peer to hold a certificate from the cluster CA.
#[derive(Clone)]
pub struct Tls {
    pub identity: Identity,
    pub server: Arc<ServerConfig>,
    pub client: Arc<ClientConfig>,
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tls({})", self.identity)
    }
}

/// Makes sure a crypto provider is installed (idempotent; every binary should call it once).
pub fn install_provider() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
}

impl Tls {
    pub fn load(files: &TlsFiles) -> Result<Tls, Error> {
        install_provider();
        let read_err = |p: &Path, e: rustls_pki_types::pem::Error| {
            Error::Io(format!(
                "{}: {e} (create it with `dsec certs issue`)",
                p.display()
            ))
        };
        let ca: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.ca)
            .map_err(|e| read_err(&files.ca, e))?
            .collect::<Result<_, _>>()
            .map_err(|e| read_err(&files.ca, e))?;
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
            .map_err(|e| read_err(&files.cert, e))?
            .collect::<Result<_, _>>()
            .map_err(|e| read_err(&files.cert, e))?;
        let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|e| read_err(&files.key, e))?;
        let first = chain.first().ok_or_else(|| {
            Error::Certificate(format!("{} holds no certificate", files.cert.display()))
        })?;
        let identity = Identity::from_der(first).ok_or_else(|| {
            Error::Certificate(format!(
                "{} has no {URI_PREFIX}<role>/<name> identity; issue it with `dsec certs issue`",
                files.cert.display()
            ))
        })?;
        let mut roots = RootCertStore::empty();
        for c in ca {
            roots
                .add(c)
                .map_err(|e| Error::Certificate(format!("{}: {e}", files.ca.display())))?;
        }
        let roots = Arc::new(roots);
        let verifier = WebPkiClientVerifier::builder(roots.clone())
            .build()
            .map_err(|e| Error::Certificate(format!("client verifier: {e}")))?;
        let mut server = ServerConfig::builder()
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|e| Error::Certificate(format!("{}: {e}", files.cert.display())))?;
        server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let mut client = ClientConfig::builder()
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(|e| Error::Certificate(format!("{}: {e}", files.cert.display())))?;
        client.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Tls {
            identity,
            server: Arc::new(server),
            client: Arc::new(client),
        })
    }
}
