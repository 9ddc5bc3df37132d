//! The cluster CA and component certificates. Each component has one key and one
//! certificate, used both as server and as client; its identity is the URI SAN
//! `spiffe://opendsec/<role>/<name>`. The CA key stays where `dsec certs` ran.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

use crate::{Error, Identity, Role};

pub const CA_CERT: &str = "ca.pem";
pub const CA_KEY: &str = "ca.key";

/// How long issued certificates are valid, in years from today.
const VALID_YEARS: i32 = 10;

fn io(path: &Path, e: std::io::Error) -> Error {
    Error::Io(format!("{}: {e}", path.display()))
}

fn pki(what: &str, e: rcgen::Error) -> Error {
    Error::Certificate(format!("{what}: {e}"))
}

/// Writes a file readable by its owner only (keys) or by all (certificates), through a
/// temporary file (a crash leaves the old one or the new one).
pub fn write(path: &Path, text: &str, private: bool) -> Result<(), Error> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(if private { 0o600 } else { 0o644 })
        .open(&tmp)
        .map_err(|e| io(&tmp, e))?;
    f.write_all(text.as_bytes()).map_err(|e| io(&tmp, e))?;
    f.sync_all().map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| io(path, e))
}

/// Valid from a year ago (a day of slack for clocks that are a little behind, and more)
/// until `years` from now.
pub fn validity(params: &mut CertificateParams, years: i32) {
    // SAFETY: time(NULL) only reads the clock.
    let now = unsafe { libc::time(std::ptr::null_mut()) };
    let year = 1970 + (now / 31_556_952) as i32;
    params.not_before = rcgen::date_time_ymd(year - 1, 1, 1);
    params.not_after = rcgen::date_time_ymd(year + years, 1, 1);
}

/// Creates `dir/ca.pem` and `dir/ca.key` unless they exist. Returns whether it made them.
pub fn init_ca(dir: &Path) -> Result<bool, Error> {
    let (cert_path, key_path) = (dir.join(CA_CERT), dir.join(CA_KEY));
    if cert_path.exists() && key_path.exists() {
        return Ok(false);
    }
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let key = KeyPair::generate().map_err(|e| pki("generating the CA key", e))?;
    let mut params = CertificateParams::default();
    params
        .distinguished_name
        .push(DnType::CommonName, "OpenDsec cluster CA");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    validity(&mut params, VALID_YEARS);
    let cert = params
        .self_signed(&key)
        .map_err(|e| pki("signing the CA certificate", e))?;
    write(&key_path, &key.serialize_pem(), true)?;
    write(&cert_path, &cert.pem(), false)?;
    Ok(true)
}

fn dns_name(h: &str) -> bool {
    h.len() <= 253
        && h.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// What [`issue`] wrote.
#[derive(Debug, Clone)]
pub struct Issued {
    pub identity: Identity,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Issues `dir/<name>.pem` and `dir/<name>.key` for a component, signed by the CA in `dir`.
/// `hosts` are the addresses (IPs) and DNS names others reach it by; `localhost` and
/// `127.0.0.1` are always included.
pub fn issue(dir: &Path, role: Role, name: &str, hosts: &[String]) -> Result<Issued, Error> {
    let identity = Identity::new(role, name)?;
    let ca_cert = std::fs::read_to_string(dir.join(CA_CERT)).map_err(|e| {
        Error::Io(format!(
            "{}: {e} (run `dsec certs init --dir {}` first)",
            dir.join(CA_CERT).display(),
            dir.display()
        ))
    })?;
    let ca_key_pem =
        std::fs::read_to_string(dir.join(CA_KEY)).map_err(|e| io(&dir.join(CA_KEY), e))?;
    let ca_key = KeyPair::from_pem(&ca_key_pem).map_err(|e| pki("reading the CA key", e))?;
    let issuer = Issuer::from_ca_cert_pem(&ca_cert, ca_key)
        .map_err(|e| pki("reading the CA certificate", e))?;

    let mut params = CertificateParams::default();
    params
        .distinguished_name
        .push(DnType::CommonName, format!("{role}/{name}"));
    let mut sans = vec![SanType::URI(
        identity
            .uri()
            .try_into()
            .map_err(|e| pki("the identity URI", e))?,
    )];
    // A monitor (a scraper) is only ever a client: its certificate names no host and
    // cannot serve, so its key cannot pose as a component.
    let monitor = role == Role::Monitor;
    if monitor && !hosts.is_empty() {
        return Err(Error::Invalid(
            "a monitor certificate names no host (--host): it is a scraper's client certificate"
                .into(),
        ));
    }
    let mut all: Vec<String> = if monitor {
        Vec::new()
    } else {
        vec!["localhost".into(), "127.0.0.1".into()]
    };
    all.extend(hosts.iter().cloned());
    all.dedup();
    for h in all {
        match h.parse::<IpAddr>() {
            Ok(ip) => sans.push(SanType::IpAddress(ip)),
            Err(_) if dns_name(&h) => sans.push(SanType::DnsName(
                h.as_str().try_into().map_err(|e| pki("the DNS name", e))?,
            )),
            Err(_) => {
                return Err(Error::Invalid(format!(
                    "--host {h:?} is neither an IP address nor a DNS name"
                )));
            }
        }
    }
    params.subject_alt_names = sans;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = if monitor {
        vec![ExtendedKeyUsagePurpose::ClientAuth]
    } else {
        vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ]
    };
    validity(&mut params, VALID_YEARS);
    let key = KeyPair::generate().map_err(|e| pki("generating the key", e))?;
    let cert = params
        .signed_by(&key, &issuer)
        .map_err(|e| pki("signing the certificate", e))?;
    let cert_path = dir.join(format!("{name}.pem"));
    let key_path = dir.join(format!("{name}.key"));
    write(&key_path, &key.serialize_pem(), true)?;
    write(&cert_path, &cert.pem(), false)?;
    Ok(Issued {
        identity,
        cert: cert_path,
        key: key_path,
    })
}
