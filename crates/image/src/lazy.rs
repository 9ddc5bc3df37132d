//! A layer's EROFS image read from a registry by chunk, on first access (lazy start).
//!
//! A lazy blob is the EROFS image of one layer ([`crate::erofs`]), stored in a registry
//! next to the image, with a chunk table: the SHA-256 of every `chunk_size` bytes. A
//! node keeps, per blob, under `lazy/<hex>/`:
//!
//! ```text
//! source.json  where the blob is (registry, repository, digest, login) and its chunk table
//! data         a sparse file of the blob's size: the chunks fetched so far, in place
//! have         one bit per chunk: which of them `data` holds
//! ```
//!
//! A read fetches the chunks it touches that the node lacks (one HTTP Range request
//! each; readers of the same chunk wait for one fetch), checks each against its table
//! digest before a byte of it is used or kept, writes it into `data`, and marks it in
//! `have`. A registry that sends wrong bytes gives a read error, never wrong data.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures_util::StreamExt;
use oci_client::Reference;
use oci_client::client::BlobResponse;
use oci_client::secrets::RegistryAuth;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::pull::Credentials;
use crate::{ImageError, IoContext};

/// Chunks a blob is fetched and checked by.
pub const CHUNK_SIZE: u64 = 1 << 20;
/// The largest blob a chunk table may describe (and so a lazy blob may be).
pub const MAX_BLOB: u64 = 1 << 40;

#[derive(Debug, thiserror::Error)]
pub enum LazyError {
    #[error("fetching bytes {start}-{end} of {digest} from {registry}: {message}")]
    Fetch {
        registry: String,
        digest: String,
        start: u64,
        end: u64,
        message: String,
    },
    #[error("chunk {index} of {digest} does not match its digest (the registry sent other bytes)")]
    Mismatch { digest: String, index: u64 },
    #[error("read of {len} bytes at {offset} is past the end of {digest} ({size} bytes)")]
    OutOfRange {
        digest: String,
        offset: u64,
        len: u64,
        size: u64,
    },
    #[error("{0}")]
    Image(#[from] ImageError),
}

/// The SHA-256 of every `chunk_size` bytes of a blob (the last chunk may be short).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChunkTable {
    pub size: u64,
    pub chunk_size: u64,
    /// Lowercase hex, one per chunk.
    pub chunks: Vec<String>,
}

impl ChunkTable {
    /// The table of a file on disk.
    pub fn of_file(path: &Path, chunk_size: u64) -> Result<ChunkTable, ImageError> {
        let f = std::fs::File::open(path).ctx(|| format!("opening {}", path.display()))?;
        let size = f
            .metadata()
            .ctx(|| format!("reading {}", path.display()))?
            .len();
        let mut buf = vec![0u8; chunk_size as usize];
        let mut chunks = Vec::with_capacity(size.div_ceil(chunk_size) as usize);
        let mut off = 0;
        while off < size {
            let n = chunk_size.min(size - off) as usize;
            f.read_exact_at(&mut buf[..n], off)
                .ctx(|| format!("reading {}", path.display()))?;
            chunks.push(hex::encode(Sha256::digest(&buf[..n])));
            off += n as u64;
        }
        Ok(ChunkTable {
            size,
            chunk_size,
            chunks,
        })
    }

    /// Whether the table is one a node may act on: sizes in bounds, one well-formed
    /// digest per chunk.
    pub fn check(&self) -> Result<(), String> {
        if !(4096..=64 << 20).contains(&self.chunk_size) || !self.chunk_size.is_power_of_two() {
            return Err(format!(
                "chunk size {} is not a power of two from 4 KiB to 64 MiB",
                self.chunk_size
            ));
        }
        if self.size > MAX_BLOB {
            return Err(format!("blob size {} is over {MAX_BLOB}", self.size));
        }
        if self.chunks.len() as u64 != self.size.div_ceil(self.chunk_size) {
            return Err(format!(
                "{} chunk digests for {} bytes in chunks of {}",
                self.chunks.len(),
                self.size,
                self.chunk_size
            ));
        }
        if let Some(c) = self.chunks.iter().find(|c| {
            c.len() != 64
                || !c
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        }) {
            return Err(format!("chunk digest {c:?} is not SHA-256 hex"));
        }
        Ok(())
    }
}

/// Where a lazy blob is fetched from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LazySource {
    /// `host[:port]`.
    pub registry: String,
    pub repository: String,
    /// `sha256:<hex>` of the whole blob.
    pub digest: String,
    #[serde(default)]
    pub plain_http: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_pem: Option<String>,
    /// The project whose registry login (kept in the store) fetches the chunks; none
    /// for an anonymous registry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub login: Option<String>,
    pub table: ChunkTable,
}

impl LazySource {
    pub fn hex(&self) -> &str {
        self.digest.strip_prefix("sha256:").unwrap_or(&self.digest)
    }
}

type Fetched = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Vec<u8>, String>> + Send>>;

/// Fetches a byte range of a blob.
pub trait Fetch: Send + Sync {
    fn fetch(&self, start: u64, len: u64) -> Fetched;
}

/// A registry's blob endpoint, read with `Range` requests (oci-client does the auth
/// dance and keeps the token).
pub struct RegistryFetch {
    client: oci_client::Client,
    reference: Reference,
    auth: RegistryAuth,
    digest: String,
}

impl RegistryFetch {
    pub fn new(src: &LazySource, credentials: Credentials) -> RegistryFetch {
        let client = crate::pull::client(src.plain_http, src.ca_pem.as_deref());
        let auth = match credentials {
            Credentials::Anonymous => RegistryAuth::Anonymous,
            Credentials::Basic { username, password } => RegistryAuth::Basic(username, password),
            Credentials::Token(t) => RegistryAuth::Bearer(t),
        };
        RegistryFetch {
            client,
            reference: Reference::with_digest(
                src.registry.clone(),
                src.repository.clone(),
                src.digest.clone(),
            ),
            auth,
            digest: src.digest.clone(),
        }
    }
}

impl Fetch for RegistryFetch {
    fn fetch(&self, start: u64, len: u64) -> Fetched {
        let client = self.client.clone();
        let reference = self.reference.clone();
        let auth = self.auth.clone();
        let digest = self.digest.clone();
        Box::pin(async move {
            client
                .store_auth_if_needed(reference.resolve_registry(), &auth)
                .await;
            let desc = oci_client::manifest::OciDescriptor {
                digest,
                ..Default::default()
            };
            let resp = client
                .pull_blob_stream_partial(&reference, &desc, start, Some(len))
                .await
                .map_err(|e| e.to_string())?;
            // A registry that ignores Range sends the whole blob: skip to the range.
            let (mut stream, mut skip) = match resp {
                BlobResponse::Partial(s) => (s.stream, 0u64),
                BlobResponse::Full(s) => (s.stream, start),
            };
            let mut out = Vec::with_capacity(len as usize);
            while let Some(piece) = stream.next().await {
                let piece = piece.map_err(|e| e.to_string())?;
                let mut b = &piece[..];
                if skip > 0 {
                    let n = skip.min(b.len() as u64) as usize;
                    skip -= n as u64;
                    b = &b[n..];
                }
                let room = len as usize - out.len();
                out.extend_from_slice(&b[..b.len().min(room)]);
                if out.len() as u64 == len {
                    break;
                }
            }
            if out.len() as u64 != len {
                return Err(format!("the registry sent {} of {len} bytes", out.len()));
            }
            Ok(out)
        })
    }
}

/// What a blob's reads cost so far.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct LazyStats {
    pub fetched_bytes: u64,
    pub fetches: u64,
    pub read_bytes: u64,
}

/// One lazy blob on this node: its cache files and how to fill them.
pub struct LazyBlob {
    src: LazySource,
    data: std::fs::File,
    have_file: std::fs::File,
    have: std::sync::Mutex<Vec<u8>>,
    /// One lock per chunk: the fetch of a chunk happens once however many wait for it.
    locks: Vec<tokio::sync::Mutex<()>>,
    fetch: Arc<dyn Fetch>,
    fetched_bytes: AtomicU64,
    fetches: AtomicU64,
    read_bytes: AtomicU64,
}

/// The directory of a lazy blob in a store.
pub fn blob_dir(store: &Path, hex: &str) -> PathBuf {
    store.join("lazy").join(hex)
}

/// Records a lazy blob in the store (its source and empty cache files); a blob already
/// there is left as it is.
pub fn register(store: &Path, src: &LazySource) -> Result<PathBuf, ImageError> {
    src.table.check().map_err(ImageError::Corrupt)?;
    if !crate::digest::valid_digest(src.hex()) {
        return Err(ImageError::Corrupt(format!(
            "{} is not a digest",
            src.digest
        )));
    }
    let dir = blob_dir(store, src.hex());
    if dir.join("source.json").exists() {
        return Ok(dir);
    }
    let tmp = store
        .join("tmp")
        .join(format!("lazy-{}", dsec_common::id::random_hex(8)));
    std::fs::create_dir_all(&tmp).ctx(|| format!("creating {}", tmp.display()))?;
    let data = std::fs::File::create(tmp.join("data")).ctx(|| "creating a lazy blob".into())?;
    data.set_len(src.table.size)
        .ctx(|| "sizing a lazy blob".into())?;
    let have = std::fs::File::create(tmp.join("have")).ctx(|| "creating a lazy blob".into())?;
    have.set_len(src.table.chunks.len().div_ceil(8) as u64)
        .ctx(|| "sizing a lazy blob".into())?;
    let json = serde_json::to_vec_pretty(src)
        .map_err(|e| ImageError::Corrupt(format!("encoding a lazy source: {e}")))?;
    std::fs::write(tmp.join("source.json"), json).ctx(|| "writing a lazy source".into())?;
    std::fs::create_dir_all(store.join("lazy")).ctx(|| "creating lazy/".into())?;
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        // Another pull registered it first.
        Err(_) if dir.join("source.json").exists() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(e) => Err(ImageError::Io {
            context: format!("moving a lazy blob into {}", dir.display()),
            source: e,
        }),
    }
}

/// The source recorded for a lazy blob.
pub fn source(store: &Path, hex: &str) -> Result<LazySource, ImageError> {
    let p = blob_dir(store, hex).join("source.json");
    let bytes = std::fs::read(&p).ctx(|| format!("reading {}", p.display()))?;
    let src: LazySource = serde_json::from_slice(&bytes)
        .map_err(|e| ImageError::Corrupt(format!("{}: {e}", p.display())))?;
    src.table.check().map_err(ImageError::Corrupt)?;
    Ok(src)
}

impl LazyBlob {
    /// Opens a registered blob, fetching what it lacks through `fetch`.
    pub fn open(store: &Path, hex: &str, fetch: Arc<dyn Fetch>) -> Result<LazyBlob, ImageError> {
        let src = source(store, hex)?;
        let dir = blob_dir(store, hex);
        let rw = |name: &str| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(dir.join(name))
                .ctx(|| format!("opening {}", dir.join(name).display()))
        };
        let data = rw("data")?;
        let have_file = rw("have")?;
        let mut have = vec![0u8; src.table.chunks.len().div_ceil(8)];
        have_file
            .read_exact_at(&mut have, 0)
            .ctx(|| format!("reading {}", dir.join("have").display()))?;
        let locks = (0..src.table.chunks.len())
            .map(|_| tokio::sync::Mutex::new(()))
            .collect();
        Ok(LazyBlob {
            src,
            data,
            have_file,
            have: std::sync::Mutex::new(have),
            locks,
            fetch,
            fetched_bytes: AtomicU64::new(0),
            fetches: AtomicU64::new(0),
            read_bytes: AtomicU64::new(0),
        })
    }

    pub fn size(&self) -> u64 {
        self.src.table.size
    }

    pub fn source(&self) -> &LazySource {
        &self.src
    }

    pub fn stats(&self) -> LazyStats {
        LazyStats {
            fetched_bytes: self.fetched_bytes.load(Ordering::Relaxed),
            fetches: self.fetches.load(Ordering::Relaxed),
            read_bytes: self.read_bytes.load(Ordering::Relaxed),
        }
    }

    fn has(&self, i: u64) -> bool {
        let have = self.have.lock().unwrap_or_else(|e| e.into_inner());
        have[(i / 8) as usize] & (1 << (i % 8)) != 0
    }

    /// Whether every chunk is on the node.
    pub fn complete(&self) -> bool {
        (0..self.src.table.chunks.len() as u64).all(|i| self.has(i))
    }

    /// Makes chunk `i` present: fetched once, checked, written, marked.
    async fn ensure(&self, i: u64) -> Result<(), LazyError> {
        if self.has(i) {
            return Ok(());
        }
        let _held = self.locks[i as usize].lock().await;
        if self.has(i) {
            return Ok(());
        }
        let t = &self.src.table;
        let start = i * t.chunk_size;
        let len = t.chunk_size.min(t.size - start);
        let bytes = self
            .fetch
            .fetch(start, len)
            .await
            .map_err(|message| LazyError::Fetch {
                registry: self.src.registry.clone(),
                digest: self.src.digest.clone(),
                start,
                end: start + len - 1,
                message,
            })?;
        self.fetches.fetch_add(1, Ordering::Relaxed);
        self.fetched_bytes
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        if bytes.len() as u64 != len || hex::encode(Sha256::digest(&bytes)) != t.chunks[i as usize]
        {
            return Err(LazyError::Mismatch {
                digest: self.src.digest.clone(),
                index: i,
            });
        }
        self.data
            .write_all_at(&bytes, start)
            .ctx(|| "writing a fetched chunk".into())?;
        let byte = {
            let mut have = self.have.lock().unwrap_or_else(|e| e.into_inner());
            have[(i / 8) as usize] |= 1 << (i % 8);
            have[(i / 8) as usize]
        };
        self.have_file
            .write_all_at(&[byte], i / 8)
            .ctx(|| "marking a fetched chunk".into())?;
        Ok(())
    }

    /// `len` bytes at `offset` (fewer at the end of the blob), fetching what is missing.
    pub async fn read_at(&self, offset: u64, len: u64) -> Result<Vec<u8>, LazyError> {
        let size = self.src.table.size;
        if offset > size {
            return Err(LazyError::OutOfRange {
                digest: self.src.digest.clone(),
                offset,
                len,
                size,
            });
        }
        let len = len.min(size - offset);
        if len == 0 {
            return Ok(Vec::new());
        }
        let cs = self.src.table.chunk_size;
        let (first, last) = (offset / cs, (offset + len - 1) / cs);
        let wanted = (first..=last).map(|i| self.ensure(i));
        for r in futures_util::future::join_all(wanted).await {
            r?;
        }
        let mut buf = vec![0u8; len as usize];
        self.data
            .read_exact_at(&mut buf, offset)
            .ctx(|| "reading a lazy blob's cache".into())?;
        self.read_bytes.fetch_add(len, Ordering::Relaxed);
        Ok(buf)
    }
}
