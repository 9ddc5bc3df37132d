//! Images from OCI distribution registries: `pull` resolves a reference (a tag, or a
//! digest) to the manifest for this node's platform (linux/amd64 of an index), checks it
//! against the limits before fetching anything else, fetches the config and each layer
//! (every blob verified by its digest and its declared size), unpacks each layer into
//! the store ([`crate::layer`]) and names the image.
//!
//! A layer already in the store (the same blob pulled before, by any image) is not
//! fetched again, and two pulls of the same blob at once fetch it once. Nothing is named
//! until every layer is in the store, so a failed pull leaves no image behind; what it
//! fetched so far stays as unnamed layers for the next pull (and for `image gc`).

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use futures_util::StreamExt;
use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol};
use oci_client::errors::OciDistributionError;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use serde::Deserialize;

use crate::oci::{DOCKER_LIST, DOCKER_MANIFEST, Descriptor, Document, OCI_INDEX, OCI_MANIFEST};
use sha2::{Digest, Sha256};

use crate::layer::{LayerLimits, unpack_layer_checked};
use crate::store::Manifest;
use crate::{ImageError, ImageRef, ImageStore, IoContext};

/// Whether an image name is one of a registry rather than of this store: store names
/// always begin with a project, and projects with `root/`.
pub fn is_registry_reference(s: &str) -> bool {
    !s.starts_with("root/")
}

/// The store name a build gives a registry image it starts `FROM`, in the building
/// project: `<project>/from-<12 hex of the reference's sha256>:base`.
pub fn base_name(project: &str, reference: &str) -> Result<ImageRef, ImageError> {
    ImageRef::parse(&format!(
        "{project}/from-{}:base",
        &sha256_of(reference.as_bytes())[..12]
    ))
    .map_err(ImageError::from)
}

/// Why a pull failed, for the API to choose its status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullFailure {
    /// The reference is malformed, or the request is not allowed as made.
    Invalid,
    /// No such repository, tag or digest in the registry.
    NotFound,
    /// The registry refused the credentials (or wants some).
    Unauthorized,
    /// What the registry sent breaks a rule: a digest or size that does not match, a
    /// manifest over the limits, a media type this node cannot unpack.
    Refused,
    /// The image does not fit the project's disk quota.
    Quota,
    /// The registry could not be reached, or failed.
    Unreachable,
}

impl From<PullFailure> for dsec_common::ErrorCode {
    fn from(f: PullFailure) -> Self {
        use dsec_common::ErrorCode as C;
        match f {
            PullFailure::Invalid => C::InvalidArgument,
            PullFailure::NotFound => C::NotFound,
            PullFailure::Unauthorized => C::PermissionDenied,
            PullFailure::Refused => C::FailedPrecondition,
            PullFailure::Quota => C::ResourceExhausted,
            PullFailure::Unreachable => C::Unavailable,
        }
    }
}

/// How to log in to the registry.
#[derive(Clone, Default)]
pub enum Credentials {
    #[default]
    Anonymous,
    Basic {
        username: String,
        password: String,
    },
    /// A bearer token the registry accepts as it is.
    Token(String),
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credentials::Anonymous => write!(f, "Anonymous"),
            Credentials::Basic { username, .. } => write!(f, "Basic({username}, ***)"),
            Credentials::Token(_) => write!(f, "Token(***)"),
        }
    }
}

/// Bounds on what one pull accepts; a registry that serves more is refused before the
/// rest is fetched (a manifest) or as soon as it passes the bound (a blob).
#[derive(Debug, Clone, Copy)]
pub struct PullLimits {
    pub max_layers: usize,
    /// Manifests, indexes and configs, each.
    pub max_document_bytes: u64,
    /// All layers' blobs together, as the manifest declares and as they arrive.
    pub max_compressed_bytes: u64,
    /// One layer unpacked: its files' bytes, and its entries.
    pub layer: LayerLimits,
    /// All layers unpacked, their files' bytes together.
    pub max_unpacked_bytes: u64,
    /// The longest a pull may take, waiting for its turn included.
    pub deadline: std::time::Duration,
}

impl Default for PullLimits {
    fn default() -> Self {
        PullLimits {
            // Below the overlay's limit of lower directories for one mount.
            max_layers: 120,
            max_document_bytes: 4 << 20,
            max_compressed_bytes: 64 << 30,
            layer: LayerLimits::default(),
            max_unpacked_bytes: 128 << 30,
            deadline: std::time::Duration::from_secs(3600),
        }
    }
}

#[derive(Debug, Clone)]
pub struct PullRequest {
    /// `[registry/]repository[:tag][@digest]`, as `docker pull` takes it.
    pub reference: String,
    /// The name the image gets in the store.
    pub target: ImageRef,
    pub credentials: Credentials,
    /// Plain HTTP instead of HTTPS (a registry on loopback, say).
    pub plain_http: bool,
    /// PEM certificates to trust besides the system's (a registry with its own CA).
    pub ca_pem: Option<String>,
    pub limits: PullLimits,
    /// The project whose kept registry login `credentials` are (none: given with the
    /// request, or anonymous). A lazy layer fetches its chunks later with that login.
    pub login: Option<String>,
    /// Start the image lazily when the registry has its lazy layers ([`crate::lazy`]).
    pub lazy: Option<crate::lazy::LazyMounter>,
}

#[derive(Debug, Clone)]
pub struct Pulled {
    /// The store's manifest digest of the image.
    pub digest: String,
    /// The registry's digest of the manifest that was pulled (the platform's).
    pub source_digest: String,
    pub manifest: Manifest,
    /// Layers fetched now, and those the store had already.
    pub fetched: usize,
    pub cached: usize,
    pub fetched_bytes: u64,
    /// The image's layers are lazy: fetched by chunk as they are read.
    pub lazy: bool,
}

fn fail(reference: &str, kind: PullFailure, message: impl Into<String>) -> ImageError {
    ImageError::Pull {
        reference: reference.to_string(),
        kind,
        message: message.into(),
    }
}

/// The registry's error, in the terms of [`PullFailure`].
pub(crate) fn registry_error(reference: &str, e: OciDistributionError) -> ImageError {
    use OciDistributionError as E;
    let kind = match &e {
        E::AuthenticationFailure(_) | E::UnauthorizedError { .. } => PullFailure::Unauthorized,
        E::ImageManifestNotFoundError(_) => PullFailure::NotFound,
        E::RegistryError { envelope, .. } => {
            let codes: Vec<String> = envelope
                .errors
                .iter()
                .map(|x| format!("{:?}", x.code))
                .collect();
            if codes.iter().any(|c| c == "TooManyRequests") {
                PullFailure::Unreachable
            } else if codes
                .iter()
                .any(|c| c.contains("Unknown") || c == "NotFound")
            {
                PullFailure::NotFound
            } else if codes.iter().any(|c| c == "Unauthorized" || c == "Denied") {
                PullFailure::Unauthorized
            } else {
                PullFailure::Refused
            }
        }
        E::ServerError { code, .. } if *code == 401 || *code == 403 => PullFailure::Unauthorized,
        E::ServerError { code, .. } if *code == 404 => PullFailure::NotFound,
        E::DigestError(_)
        | E::ManifestParsingError(_)
        | E::UnsupportedMediaTypeError(_)
        | E::UnsupportedSchemaVersionError(_)
        | E::SpecViolationError(_)
        | E::IncompatibleLayerMediaTypeError(_) => PullFailure::Refused,
        E::UrlParseError(_) => PullFailure::Invalid,
        _ => PullFailure::Unreachable,
    };
    let mut message = e.to_string();
    // reqwest's own text hides the cause (connection refused, a certificate not trusted).
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        message.push_str(&format!(": {s}"));
        src = s.source();
    }
    // A registry's error text is its own: kept short, without control characters.
    let mut message: String = message
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(1024)
        .collect();
    if kind == PullFailure::Unauthorized {
        message.push_str(
            "; give the registry's credentials (`dsec image pull --username U --password-stdin`)",
        );
    }
    fail(reference, kind, message)
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "PascalCase")]
pub(crate) struct ImageConfig {
    #[serde(default)]
    env: Option<Vec<String>>,
    #[serde(default)]
    working_dir: Option<String>,
}

/// An image config (OCI or Docker), the parts this node uses.
#[derive(Deserialize)]
pub(crate) struct ConfigFile {
    #[serde(default)]
    pub(crate) created: Option<String>,
    #[serde(default)]
    pub(crate) config: Option<ImageConfig>,
    #[serde(default)]
    pub(crate) rootfs: Option<RootFs>,
}

#[derive(Deserialize)]
pub(crate) struct RootFs {
    #[serde(default)]
    pub(crate) diff_ids: Vec<String>,
}

/// The store's manifest of an image made of `layers` (store digests, bottom first) with
/// `cfg`'s environment, working directory and time.
pub(crate) fn image_manifest(
    cfg: ConfigFile,
    layers: Vec<String>,
    size_bytes: u64,
    source: String,
    start: Option<crate::store::StartCmd>,
) -> Manifest {
    let icfg = cfg.config.unwrap_or_default();
    let mut env = BTreeMap::new();
    for kv in icfg.env.unwrap_or_default() {
        if let Some((k, v)) = kv.split_once('=')
            && !k.is_empty()
        {
            env.insert(k.to_string(), v.to_string());
        }
    }
    Manifest {
        schema_version: 1,
        layers,
        env,
        workdir: icfg.working_dir.filter(|w| w.starts_with('/')),
        start,
        // The image's own time, so that the same image pulled or imported again (by tag
        // or digest, under any name) gives the same manifest and digest here.
        created_ms: cfg.created.as_deref().and_then(rfc3339_ms).unwrap_or(0),
        size_bytes,
        source,
    }
}

/// Milliseconds since the epoch of an RFC 3339 time (`2024-01-02T03:04:05.5Z`, or with
/// an offset), as image configs give `created`.
pub(crate) fn rfc3339_ms(t: &str) -> Option<u64> {
    let b = t.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    let num = |r: std::ops::Range<usize>| t.get(r)?.parse::<i64>().ok();
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, s) = (num(11..13)?, num(14..16)?, num(17..19)?);
    let mut rest = &t[19..];
    let mut ms = 0i64;
    if let Some(frac) = rest.strip_prefix('.') {
        let digits: String = frac.chars().take_while(char::is_ascii_digit).collect();
        ms = format!("{:0<3}", &digits[..digits.len().min(3)])
            .parse()
            .ok()?;
        rest = &frac[digits.len()..];
    }
    let offset_s = match rest {
        "Z" | "z" => 0,
        o if o.len() == 6 && (o.starts_with('+') || o.starts_with('-')) => {
            let v =
                o.get(1..3)?.parse::<i64>().ok()? * 3600 + o.get(4..6)?.parse::<i64>().ok()? * 60;
            if o.starts_with('-') { -v } else { v }
        }
        _ => return None,
    };
    // Days from the civil date (Howard Hinnant's algorithm).
    let (y2, m2) = if mo <= 2 {
        (y - 1, mo + 9)
    } else {
        (y, mo - 3)
    };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let doy = (153 * m2 + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + h * 3600 + mi * 60 + s - offset_s;
    u64::try_from(secs * 1000 + ms).ok()
}

/// `sha256:<64 hex>`, the only digest algorithm this node verifies.
pub(crate) fn check_digest(reference: &str, d: &str) -> Result<String, ImageError> {
    match d.strip_prefix("sha256:") {
        Some(h) if h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()) => {
            Ok(h.to_ascii_lowercase())
        }
        _ => Err(fail(
            reference,
            PullFailure::Refused,
            format!("digest {d:?} is not a sha256 digest"),
        )),
    }
}

fn sha256_of(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

/// A work directory removed when dropped.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = crate::store::remove_tree(&self.0);
    }
}

/// Per-blob locks: two pulls of one layer at once fetch it once.
fn blob_lock(hex: &str) -> Arc<tokio::sync::Mutex<()>> {
    static LOCKS: OnceLock<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>> = OnceLock::new();
    let mut m = LOCKS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    m.retain(|_, l| Arc::strong_count(l) > 1);
    m.entry(hex.to_string()).or_default().clone()
}

/// Where the store remembers which layer a blob unpacked to.
fn blob_record(store: &ImageStore, hex: &str) -> PathBuf {
    store.root().join("blobs").join(format!("sha256-{hex}"))
}

/// The layer a blob unpacked to before (its digest and size), if the store still has it.
/// A record is `<layer digest> <size> <media type> <diff_id>`: a blob is reused only as
/// the same media type (a file that is both a tar and a gzip unpacks differently as each)
/// and with the `diff_id` the image's config names.
fn cached_layer(
    store: &ImageStore,
    hex: &str,
    media_type: &str,
    diff_id: Option<&str>,
) -> Option<(String, u64)> {
    let text = std::fs::read_to_string(blob_record(store, hex)).ok()?;
    let mut f = text.split_whitespace();
    let (d, size, media, diff) = (f.next()?, f.next()?, f.next()?, f.next()?);
    let size = size.parse().ok()?;
    let same = media == media_type && diff_id.is_none_or(|want| want.eq_ignore_ascii_case(diff));
    (same && crate::digest::valid_digest(d) && store.layer_path(d).is_dir())
        .then(|| (d.to_string(), size))
}

/// Pulls under way on this node at once; the rest wait their turn (each holds a
/// connection, a temporary blob and an unpacking thread).
const PULLS_AT_ONCE: usize = 4;

fn pull_turns() -> &'static tokio::sync::Semaphore {
    static TURNS: OnceLock<tokio::sync::Semaphore> = OnceLock::new();
    TURNS.get_or_init(|| tokio::sync::Semaphore::new(PULLS_AT_ONCE))
}

pub fn client_for(req: &PullRequest) -> Result<Client, ImageError> {
    Ok(client(req.plain_http, req.ca_pem.as_deref()))
}

/// A registry client over HTTPS (or plain HTTP), trusting `ca_pem` besides the system.
pub fn client(plain_http: bool, ca_pem: Option<&str>) -> Client {
    let mut cfg = ClientConfig {
        protocol: if plain_http {
            ClientProtocol::Http
        } else {
            ClientProtocol::Https
        },
        connect_timeout: Some(std::time::Duration::from_secs(10)),
        read_timeout: Some(std::time::Duration::from_secs(60)),
        // The index is resolved here (linux/amd64), with its digest checked.
        platform_resolver: None,
        ..ClientConfig::default()
    };
    if let Some(pem) = ca_pem {
        cfg.extra_root_certificates.push(Certificate {
            encoding: CertificateEncoding::Pem,
            data: pem.as_bytes().to_vec(),
        });
    }
    Client::new(cfg)
}

/// Fetches a manifest or index by tag or digest, no larger than the limit, and checks it
/// against the digest it was asked by (or that the registry names).
pub(crate) async fn document(
    client: &Client,
    r: &Reference,
    auth: &RegistryAuth,
    limits: &PullLimits,
    reference: &str,
) -> Result<(Vec<u8>, String), ImageError> {
    let (bytes, digest) = client
        .pull_manifest_raw(
            r,
            auth,
            &[OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST],
        )
        .await
        .map_err(|e| registry_error(reference, e))?;
    if bytes.len() as u64 > limits.max_document_bytes {
        return Err(fail(
            reference,
            PullFailure::Refused,
            format!(
                "the manifest is {} bytes, over the limit of {}",
                bytes.len(),
                limits.max_document_bytes
            ),
        ));
    }
    let actual = sha256_of(&bytes);
    let want = r.digest().map(str::to_string).unwrap_or(digest);
    let want_hex = check_digest(reference, &want)?;
    if actual != want_hex {
        return Err(fail(
            reference,
            PullFailure::Refused,
            format!("the manifest's content is sha256:{actual}, not {want}"),
        ));
    }
    Ok((bytes.to_vec(), format!("sha256:{actual}")))
}

/// Downloads one blob into `dest`, checking its size as it arrives and its digest at the
/// end; returns the bytes fetched.
pub(crate) async fn fetch_blob(
    client: &Client,
    r: &Reference,
    d: &Descriptor,
    dest: &Path,
    reference: &str,
) -> Result<u64, ImageError> {
    let hex = check_digest(reference, &d.digest)?;
    let mut stream = client
        .pull_blob_stream(r, d.digest.as_str())
        .await
        .map_err(|e| registry_error(reference, e))?;
    let mut file = std::fs::File::create(dest).ctx(|| format!("creating {}", dest.display()))?;
    let mut hasher = Sha256::new();
    let mut got: u64 = 0;
    let declared = d.size.max(0) as u64;
    while let Some(chunk) = stream.stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            // The stream ended and the client's own check of the digest failed: said
            // below, from this node's own count and hash.
            Err(e)
                if e.get_ref()
                    .is_some_and(|x| x.is::<oci_client::errors::DigestError>()) =>
            {
                break;
            }
            Err(e) => {
                return Err(fail(
                    reference,
                    PullFailure::Unreachable,
                    format!("fetching blob {}: {e}", d.digest),
                ));
            }
        };
        got += chunk.len() as u64;
        if got > declared {
            return Err(fail(
                reference,
                PullFailure::Refused,
                format!(
                    "blob {} is larger than the {declared} bytes its manifest declares",
                    d.digest
                ),
            ));
        }
        hasher.update(&chunk);
        file.write_all(&chunk)
            .ctx(|| format!("writing {}", dest.display()))?;
    }
    if got != declared {
        return Err(fail(
            reference,
            PullFailure::Refused,
            format!(
                "blob {} ended after {got} of the {declared} bytes its manifest declares",
                d.digest
            ),
        ));
    }
    let actual = hex::encode(hasher.finalize());
    if actual != hex {
        return Err(fail(
            reference,
            PullFailure::Refused,
            format!("blob {} arrived with the content sha256:{actual}", d.digest),
        ));
    }
    Ok(got)
}

fn media_ok(m: &str) -> bool {
    matches!(
        m,
        "application/vnd.oci.image.layer.v1.tar"
            | "application/vnd.oci.image.layer.v1.tar+gzip"
            | "application/vnd.oci.image.layer.v1.tar+zstd"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd"
            | "application/vnd.docker.image.rootfs.diff.tar.gzip"
            | "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip"
    )
}

/// Pulls `req.reference` into `store` as `req.target`; `log` gets a line per step.
/// Called with the image's size (its layers' trees) just before it is named; an error
/// stops the pull there, with nothing named (its layers stay, unnamed, for the next pull
/// or the collector).
pub type BeforeTag = Box<
    dyn FnOnce(
            u64,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<(), ImageError>> + Send>,
        > + Send,
>;

pub async fn pull(
    store: &ImageStore,
    req: &PullRequest,
    log: &mut (dyn FnMut(String) + Send),
) -> Result<Pulled, ImageError> {
    pull_held(store, req, log, None).await
}

/// [`pull`], with `before_tag` (a quota hold, say) run just before the image is named.
pub async fn pull_held(
    store: &ImageStore,
    req: &PullRequest,
    log: &mut (dyn FnMut(String) + Send),
    before_tag: Option<BeforeTag>,
) -> Result<Pulled, ImageError> {
    let deadline = req.limits.deadline;
    match tokio::time::timeout(deadline, async {
        let _turn = pull_turns().acquire().await.map_err(|_| {
            fail(
                &req.reference,
                PullFailure::Unreachable,
                "the node is stopping",
            )
        })?;
        pull_now(store, req, log, before_tag).await
    })
    .await
    {
        Ok(r) => r,
        Err(_) => Err(fail(
            &req.reference,
            PullFailure::Unreachable,
            format!("did not finish within {} s", deadline.as_secs()),
        )),
    }
}

async fn pull_now(
    store: &ImageStore,
    req: &PullRequest,
    log: &mut (dyn FnMut(String) + Send),
    before_tag: Option<BeforeTag>,
) -> Result<Pulled, ImageError> {
    let reference = req.reference.as_str();
    let r: Reference = reference.parse().map_err(|e| {
        fail(
            reference,
            PullFailure::Invalid,
            format!("not an image reference ({e}); e.g. registry.example.com/team/python:3.11"),
        )
    })?;
    let auth = match &req.credentials {
        Credentials::Anonymous => RegistryAuth::Anonymous,
        Credentials::Basic { username, password } => {
            RegistryAuth::Basic(username.clone(), password.clone())
        }
        Credentials::Token(t) => RegistryAuth::Bearer(t.clone()),
    };
    let client = client_for(req)?;
    let limits = &req.limits;
    log(format!("resolving {}", r.whole()));
    let (mut bytes, mut digest) = document(&client, &r, &auth, limits, reference).await?;
    let mut doc: Document = serde_json::from_slice(&bytes).map_err(|e| {
        fail(
            reference,
            PullFailure::Refused,
            format!("the manifest is not JSON the OCI or Docker formats describe: {e}"),
        )
    })?;
    // An index (multi-platform): the linux/amd64 manifest, fetched by its digest.
    if let Some(list) = &doc.manifests {
        let pick = list
            .iter()
            .find(|m| {
                m.platform
                    .as_ref()
                    .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
            })
            .ok_or_else(|| {
                let have: Vec<String> = list
                    .iter()
                    .filter_map(|m| m.platform.as_ref())
                    .map(|p| format!("{}/{}", p.os, p.architecture))
                    .collect();
                fail(
                    reference,
                    PullFailure::NotFound,
                    format!(
                        "the image has no linux/amd64 variant (it has: {})",
                        have.join(", ")
                    ),
                )
            })?;
        check_digest(reference, &pick.digest)?;
        log(format!("index {digest}: linux/amd64 is {}", pick.digest));
        let platform_ref = r.clone_with_digest(pick.digest.clone());
        (bytes, digest) = document(&client, &platform_ref, &auth, limits, reference).await?;
        doc = serde_json::from_slice(&bytes).map_err(|e| {
            fail(
                reference,
                PullFailure::Refused,
                format!("the platform's manifest is not JSON of an image manifest: {e}"),
            )
        })?;
        if doc.manifests.is_some() {
            return Err(fail(
                reference,
                PullFailure::Refused,
                "an index inside an index: not an image",
            ));
        }
    }
    if let Some(mt) = &doc.media_type
        && mt != OCI_MANIFEST
        && mt != DOCKER_MANIFEST
    {
        return Err(fail(
            reference,
            PullFailure::Refused,
            format!("media type {mt} is not an image manifest"),
        ));
    }
    let (Some(config), Some(layers)) = (doc.config, doc.layers) else {
        return Err(fail(
            reference,
            PullFailure::Refused,
            "the manifest has no config or no layers: not a container image",
        ));
    };
    // The limits, before anything else is fetched.
    if layers.len() > limits.max_layers {
        return Err(fail(
            reference,
            PullFailure::Refused,
            format!(
                "the image has {} layers, over the limit of {}",
                layers.len(),
                limits.max_layers
            ),
        ));
    }
    let mut declared: u64 = 0;
    for l in &layers {
        if l.size < 0 {
            return Err(fail(
                reference,
                PullFailure::Refused,
                format!("layer {} declares a negative size", l.digest),
            ));
        }
        declared = declared.saturating_add(l.size as u64);
        if !media_ok(&l.media_type) {
            return Err(fail(
                reference,
                PullFailure::Refused,
                format!(
                    "layer {} has media type {:?}, which is not a layer this node can unpack (tar, tar+gzip or tar+zstd)",
                    l.digest, l.media_type
                ),
            ));
        }
        check_digest(reference, &l.digest)?;
    }
    if declared > limits.max_compressed_bytes {
        return Err(fail(
            reference,
            PullFailure::Refused,
            format!(
                "the layers add up to {declared} bytes, over the limit of {}",
                limits.max_compressed_bytes
            ),
        ));
    }
    if config.size < 0 || config.size as u64 > limits.max_document_bytes {
        return Err(fail(
            reference,
            PullFailure::Refused,
            format!(
                "the image config declares {} bytes, over the limit of {}",
                config.size, limits.max_document_bytes
            ),
        ));
    }
    log(format!(
        "manifest {digest}: {} layers, {:.1} MiB to fetch at most",
        layers.len(),
        declared as f64 / (1 << 20) as f64
    ));
    let tmp = store.temp_dir("pull")?;
    // Removed however the pull ends, a deadline that drops it included.
    let _tmp = TempDir(tmp.clone());
    if let Some(mounter) = &req.lazy {
        // Chunks are fetched later, by the node: with a kept login or none, not with
        // credentials given for this request only.
        let usable = req.login.is_some() || matches!(req.credentials, Credentials::Anonymous);
        let found = if usable {
            crate::lazy::find_artifact(&client, &r, &auth, limits, reference, &digest, &layers)
                .await
        } else {
            Ok(None)
        };
        match found {
            Ok(Some(artifact)) => {
                log(format!(
                    "lazy layers published ({}): starting without fetching the image",
                    artifact.digest
                ));
                let p = crate::lazy::LazyPull {
                    client: &client,
                    r: &r,
                    config: &config,
                    artifact,
                    tmp: &tmp,
                    digest: &digest,
                    mounter,
                };
                return crate::lazy::pull_lazy(store, req, p, log, before_tag).await;
            }
            Ok(None) if !usable => {
                log("credentials given with the request: pulling the image whole".into())
            }
            Ok(None) => log("no lazy layers published: pulling the image whole".into()),
            Err(e) => log(format!(
                "lazy layers unusable ({e}): pulling the image whole"
            )),
        }
    }
    pull_blobs(
        store, req, &client, &r, &config, &layers, &tmp, &digest, log, before_tag,
    )
    .await
}

#[allow(clippy::too_many_arguments)]
async fn pull_blobs(
    store: &ImageStore,
    req: &PullRequest,
    client: &Client,
    r: &Reference,
    config: &Descriptor,
    layers: &[Descriptor],
    tmp: &Path,
    digest: &str,
    log: &mut (dyn FnMut(String) + Send),
    before_tag: Option<BeforeTag>,
) -> Result<Pulled, ImageError> {
    let reference = req.reference.as_str();
    let cfg_path = tmp.join("config");
    fetch_blob(client, r, config, &cfg_path, reference).await?;
    let cfg_bytes = std::fs::read(&cfg_path).ctx(|| format!("reading {}", cfg_path.display()))?;
    let cfg: ConfigFile = serde_json::from_slice(&cfg_bytes).map_err(|e| {
        fail(
            reference,
            PullFailure::Refused,
            format!("the image config is not JSON of an image config: {e}"),
        )
    })?;
    if let Some(rootfs) = &cfg.rootfs
        && !rootfs.diff_ids.is_empty()
        && rootfs.diff_ids.len() != layers.len()
    {
        return Err(fail(
            reference,
            PullFailure::Refused,
            format!(
                "the config lists {} layers and the manifest {}",
                rootfs.diff_ids.len(),
                layers.len()
            ),
        ));
    }
    let diff_ids: Vec<String> = cfg
        .rootfs
        .as_ref()
        .map(|r| r.diff_ids.clone())
        .unwrap_or_default();
    std::fs::create_dir_all(store.root().join("blobs")).ctx(|| "creating blobs/".to_string())?;
    let mut out = Vec::with_capacity(layers.len());
    let (mut fetched, mut cached, mut fetched_bytes, mut size_bytes) = (0, 0, 0u64, 0u64);
    let mut unpacked_bytes = 0u64;
    for (i, l) in layers.iter().enumerate() {
        let hex = check_digest(reference, &l.digest)?;
        let lock = blob_lock(&hex);
        let _held = lock.lock().await;
        let diff_id = diff_ids.get(i).cloned();
        // Reused only if the registry has the blob for this caller too: a layer another
        // project pulled is not handed to one that cannot fetch it.
        let hit = match cached_layer(store, &hex, &l.media_type, diff_id.as_deref()) {
            Some(c) if client.blob_exists(r, &l.digest).await.unwrap_or(false) => Some(c),
            _ => None,
        };
        if let Some((d, size)) = hit {
            log(format!(
                "layer {}/{} {}: in the store already",
                i + 1,
                layers.len(),
                l.digest
            ));
            cached += 1;
            size_bytes += size;
            out.push(d);
            continue;
        }
        let started = std::time::Instant::now();
        let blob = tmp.join(format!("blob-{i}"));
        let n = fetch_blob(client, r, l, &blob, reference).await?;
        fetched_bytes += n;
        let (store2, media, blob2, limits) = (
            store.clone(),
            l.media_type.clone(),
            blob.clone(),
            req.limits.layer,
        );
        let checked = diff_id.clone();
        let unpacked = tokio::task::spawn_blocking(move || {
            let dir = store2.temp_dir("layer")?;
            match unpack_layer_checked(&blob2, &media, &dir, limits, checked.as_deref()) {
                Ok(stats) => {
                    let (d, size) = store2.add_layer(&dir)?;
                    Ok((d, size, stats))
                }
                Err(e) => {
                    let _ = crate::store::remove_tree(&dir);
                    Err(e)
                }
            }
        })
        .await
        .map_err(|e| ImageError::Build(format!("unpacking worker failed: {e}")))?;
        let _ = std::fs::remove_file(&blob);
        let (layer_digest, size, stats) = unpacked.map_err(|e| match e {
            ImageError::BadTree(m) | ImageError::Uncommittable(m) => fail(
                reference,
                PullFailure::Refused,
                format!("layer {}: {m}", l.digest),
            ),
            other => other,
        })?;
        size_bytes += size;
        unpacked_bytes += stats.bytes;
        if unpacked_bytes > req.limits.max_unpacked_bytes {
            return Err(fail(
                reference,
                PullFailure::Refused,
                format!(
                    "the layers unpack to more than {} bytes",
                    req.limits.max_unpacked_bytes
                ),
            ));
        }
        let diff = diff_id.unwrap_or_else(|| "-".to_string());
        crate::store::write_atomic(
            &store.root().join("tmp"),
            &blob_record(store, &hex),
            format!("{layer_digest} {size} {} {diff}", l.media_type).as_bytes(),
        )?;
        log(format!(
            "layer {}/{} {}: {:.1} MiB fetched, {} entries unpacked ({:.1} MiB) in {:.1} s{}",
            i + 1,
            layers.len(),
            l.digest,
            n as f64 / (1 << 20) as f64,
            stats.entries,
            stats.bytes as f64 / (1 << 20) as f64,
            started.elapsed().as_secs_f64(),
            if stats.skipped_devices > 0 {
                format!(", {} device nodes left out", stats.skipped_devices)
            } else {
                String::new()
            }
        ));
        fetched += 1;
        out.push(layer_digest);
    }
    let source = format!("pull {}/{}@{digest}", r.resolve_registry(), r.repository());
    // A layer the store's collector removed meanwhile (an `image rm` of another image)
    // would leave a name pointing at nothing.
    if let Some(gone) = out.iter().find(|d| !store.layer_path(d).is_dir()) {
        return Err(fail(
            reference,
            PullFailure::Unreachable,
            format!("layer {gone} was removed from the store during the pull; pull again"),
        ));
    }
    let manifest = image_manifest(cfg, out, size_bytes, source, None);
    if let Some(hold) = before_tag {
        hold(manifest.size_bytes).await?;
    }
    let image_digest = store.put_manifest(&manifest)?;
    store.tag(&req.target, &image_digest)?;
    log(format!("{} is {image_digest}", req.target));
    Ok(Pulled {
        digest: image_digest,
        source_digest: digest.to_string(),
        manifest,
        fetched,
        cached,
        fetched_bytes,
        lazy: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_times_are_read_as_rfc3339() {
        assert_eq!(rfc3339_ms("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(rfc3339_ms("2023-11-14T22:13:20Z"), Some(1_700_000_000_000));
        assert_eq!(
            rfc3339_ms("2023-11-14T22:13:20.123456789Z"),
            Some(1_700_000_000_123)
        );
        assert_eq!(
            rfc3339_ms("2023-11-15T00:13:20.5+02:00"),
            Some(1_700_000_000_500)
        );
        assert_eq!(rfc3339_ms("yesterday"), None);
        assert_eq!(rfc3339_ms("2023-11-14T22:13:20"), None);
        assert_eq!(rfc3339_ms("2023-11-14T22:13:20+0é00"), None);
        assert_eq!(rfc3339_ms("2023-11-14T22:13:20.éZ"), None);
    }

    #[test]
    fn only_sha256_digests_are_taken() {
        let hex = "ab".repeat(32);
        assert_eq!(check_digest("r", &format!("sha256:{hex}")).unwrap(), hex);
        for bad in ["sha512:00", "sha256:xyz", "", &format!("sha256:{hex}0")] {
            assert!(check_digest("r", bad).is_err(), "{bad}");
        }
    }
}
