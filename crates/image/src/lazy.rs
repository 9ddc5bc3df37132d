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
    #[error("fetching bytes {start}-{end} of {digest} from {registry}: {source}")]
    Fetch {
        registry: String,
        digest: String,
        start: u64,
        end: u64,
        source: FetchError,
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

/// What is wrong with a chunk table (one from a registry is untrusted).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TableError {
    #[error("chunk size {0} is not a power of two from 4 KiB to 64 MiB")]
    ChunkSize(u64),
    #[error("blob size {0} is over {MAX_BLOB}")]
    TooLarge(u64),
    #[error("{digests} chunk digests for {size} bytes in chunks of {chunk_size}")]
    Count {
        digests: usize,
        size: u64,
        chunk_size: u64,
    },
    #[error("chunk digest {0:?} is not SHA-256 hex")]
    Digest(String),
}

/// Why a range of a blob did not come.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(transparent)]
    Registry(#[from] oci_client::errors::OciDistributionError),
    #[error("the registry sent {got} of {want} bytes")]
    Short { got: u64, want: u64 },
    #[error("bytes {start}-{end} are past the blob's end")]
    OutOfRange { start: u64, end: u64 },
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
        Ok(Self::of_file_with_digest(path, chunk_size)?.0)
    }

    /// The table of a file on disk and the file's own `sha256:` digest, in one read.
    pub fn of_file_with_digest(
        path: &Path,
        chunk_size: u64,
    ) -> Result<(ChunkTable, String), ImageError> {
        let f = std::fs::File::open(path).ctx(|| format!("opening {}", path.display()))?;
        let size = f
            .metadata()
            .ctx(|| format!("reading {}", path.display()))?
            .len();
        let mut buf = vec![0u8; chunk_size as usize];
        let mut chunks = Vec::with_capacity(size.div_ceil(chunk_size) as usize);
        let mut whole = Sha256::new();
        let mut off = 0;
        while off < size {
            let n = chunk_size.min(size - off) as usize;
            f.read_exact_at(&mut buf[..n], off)
                .ctx(|| format!("reading {}", path.display()))?;
            chunks.push(hex::encode(Sha256::digest(&buf[..n])));
            whole.update(&buf[..n]);
            off += n as u64;
        }
        let table = ChunkTable {
            size,
            chunk_size,
            chunks,
        };
        Ok((table, format!("sha256:{}", hex::encode(whole.finalize()))))
    }

    /// Whether the table is one a node may act on: sizes in bounds, one well-formed
    /// digest per chunk.
    pub fn check(&self) -> Result<(), TableError> {
        if !(4096..=64 << 20).contains(&self.chunk_size) || !self.chunk_size.is_power_of_two() {
            return Err(TableError::ChunkSize(self.chunk_size));
        }
        if self.size > MAX_BLOB {
            return Err(TableError::TooLarge(self.size));
        }
        if self.chunks.len() as u64 != self.size.div_ceil(self.chunk_size) {
            return Err(TableError::Count {
                digests: self.chunks.len(),
                size: self.size,
                chunk_size: self.chunk_size,
            });
        }
        if let Some(c) = self.chunks.iter().find(|c| {
            c.len() != 64
                || !c
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        }) {
            return Err(TableError::Digest(c.clone()));
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

type Fetched =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Vec<u8>, FetchError>> + Send>>;

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
                .await?;
            // A registry that ignores Range sends the whole blob: skip to the range.
            let (mut stream, mut skip) = match resp {
                BlobResponse::Partial(s) => (s.stream, 0u64),
                BlobResponse::Full(s) => (s.stream, start),
            };
            let mut out = Vec::with_capacity(len as usize);
            while let Some(piece) = stream.next().await {
                let piece = piece.map_err(|e| {
                    FetchError::Registry(oci_client::errors::OciDistributionError::IoError(e))
                })?;
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
                return Err(FetchError::Short {
                    got: out.len() as u64,
                    want: len,
                });
            }
            Ok(out)
        })
    }
}

/// A digest of a chunk table (its size, chunk size and every chunk's digest): two nodes
/// whose tables for a blob have the same one read the same bytes from it. A lazy blob's
/// name is its registry digest, which nothing checks against the bytes read (they are
/// checked against the table), so it is the table that says what a blob holds.
pub fn table_digest(t: &ChunkTable) -> String {
    let mut h = Sha256::new();
    h.update(t.size.to_le_bytes());
    h.update(t.chunk_size.to_le_bytes());
    for c in &t.chunks {
        h.update(c.as_bytes());
    }
    hex::encode(h.finalize())
}

/// What [`PeerChunks::chunk`] gives: a chunk's bytes from whichever peer had it first
/// (not yet checked), or none.
pub type PeerFetched = std::pin::Pin<Box<dyn std::future::Future<Output = Option<Vec<u8>>> + Send>>;

/// Other nodes that may hold a blob's chunks (the cluster's edges): asked before the
/// registry, their bytes checked against the chunk table like the registry's.
pub trait PeerChunks: Send + Sync {
    /// Chunk `index` (`len` bytes) of blob `hex` from a peer that holds it.
    fn chunk(&self, hex: &str, index: u64, len: u64) -> PeerFetched;
}

/// Fetches whole chunks from peers first, and anything they do not give (a chunk none
/// holds, bytes that do not match its digest, a peer that does not answer) from `next`.
pub struct PeerFirst {
    peers: Arc<dyn PeerChunks>,
    hex: String,
    table: Arc<ChunkTable>,
    next: Arc<dyn Fetch>,
}

impl PeerFirst {
    pub fn new(peers: Arc<dyn PeerChunks>, src: &LazySource, next: Arc<dyn Fetch>) -> PeerFirst {
        PeerFirst {
            peers,
            hex: src.hex().to_string(),
            table: Arc::new(src.table.clone()),
            next,
        }
    }
}

impl Fetch for PeerFirst {
    fn fetch(&self, start: u64, len: u64) -> Fetched {
        let (peers, hex, table, next) = (
            self.peers.clone(),
            self.hex.clone(),
            self.table.clone(),
            self.next.clone(),
        );
        Box::pin(async move {
            let t = &table;
            let whole = t.chunk_size > 0
                && start.is_multiple_of(t.chunk_size)
                && start < t.size
                && len == t.chunk_size.min(t.size - start);
            if whole {
                let i = start / t.chunk_size;
                if let Some(b) = peers.chunk(&hex, i, len).await {
                    if b.len() as u64 == len
                        && hex::encode(Sha256::digest(&b)) == t.chunks[i as usize]
                    {
                        tracing::debug!(blob = %hex, chunk = i, "chunk from a peer");
                        return Ok(b);
                    }
                    tracing::warn!(blob = %hex, chunk = i, "a peer sent other bytes than the chunk; fetching it from the registry");
                }
            }
            next.fetch(start, len).await
        })
    }
}

/// Chunk `index` of lazy blob `hex` when this store holds it (what a peer asks for):
/// read from the cache without fetching anything, and only if it still matches its
/// digest (an eviction may punch it out while it is read).
pub fn held_chunk(store: &Path, hex: &str, index: u64) -> Result<Option<Vec<u8>>, ImageError> {
    if !crate::digest::valid_digest(hex) {
        return Ok(None);
    }
    let dir = blob_dir(store, hex);
    let open = |name: &str| {
        std::fs::File::open(dir.join(name)).ctx(|| format!("opening {}", dir.join(name).display()))
    };
    // The bit first: most asks are for chunks not held, and cost no more than this read.
    let Ok(have) = std::fs::File::open(dir.join("have")) else {
        return Ok(None);
    };
    let mut bit = [0u8];
    match have.read_at(&mut bit, index / 8) {
        Ok(1) if bit[0] & (1 << (index % 8)) != 0 => {}
        Ok(_) => return Ok(None),
        Err(e) => return Err(e).ctx(|| "reading which chunks are held".into()),
    }
    let src = source(store, hex)?;
    let t = &src.table;
    let Some(want) = t.chunks.get(index as usize) else {
        return Ok(None);
    };
    let start = index * t.chunk_size;
    let mut b = vec![0u8; t.chunk_size.min(t.size - start) as usize];
    open("data")?
        .read_exact_at(&mut b, start)
        .ctx(|| "reading a held chunk".into())?;
    Ok((hex::encode(Sha256::digest(&b)) == *want).then_some(b))
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
    /// One lock per chunk: a fetch (and an eviction) holds it for writing, so a chunk
    /// is fetched once however many wait for it; a read of the cache holds it for
    /// reading, so that no eviction punches the chunk out under it.
    locks: Vec<tokio::sync::RwLock<()>>,
    /// Chunks held in `data`.
    held: AtomicU64,
    /// Set once a prefetch of the blob has started.
    prefetching: std::sync::atomic::AtomicBool,
    fetch: Arc<dyn Fetch>,
    fetched_bytes: AtomicU64,
    fetches: AtomicU64,
    read_bytes: AtomicU64,
}

/// Whether store layer `layer` is a lazy one (a registered blob).
pub fn is_registered(store: &Path, layer: &str) -> bool {
    crate::digest::valid_digest(layer) && blob_dir(store, layer).join("source.json").exists()
}

/// The directory of a lazy blob in a store.
pub fn blob_dir(store: &Path, hex: &str) -> PathBuf {
    store.join("lazy").join(hex)
}

/// Records a lazy blob in the store (its source and empty cache files); a blob already
/// there is left as it is.
pub fn register(store: &Path, src: &LazySource) -> Result<PathBuf, ImageError> {
    src.table
        .check()
        .map_err(|e| ImageError::Corrupt(e.to_string()))?;
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
    create_private_dir(&store.join("lazy"))?;
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

/// A directory only root reaches (what layers hold may be set-id programs).
fn create_private_dir(p: &Path) -> Result<(), ImageError> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new().mode(0o700).create(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(ImageError::Io {
            context: format!("creating {}", p.display()),
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
    src.table
        .check()
        .map_err(|e| ImageError::Corrupt(e.to_string()))?;
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
            .map(|_| tokio::sync::RwLock::new(()))
            .collect();
        let held = have.iter().map(|b| b.count_ones() as u64).sum();
        Ok(LazyBlob {
            src,
            data,
            have_file,
            have: std::sync::Mutex::new(have),
            locks,
            held: AtomicU64::new(held),
            prefetching: std::sync::atomic::AtomicBool::new(false),
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

    /// Whether chunk `i` is on the node.
    pub fn has(&self, i: u64) -> bool {
        let have = self.have.lock().unwrap_or_else(|e| e.into_inner());
        have[(i / 8) as usize] & (1 << (i % 8)) != 0
    }

    /// Bytes of the blob held on the node.
    pub fn held_bytes(&self) -> u64 {
        self.held.load(Ordering::Relaxed) * self.src.table.chunk_size
    }

    pub fn chunks(&self) -> u64 {
        self.src.table.chunks.len() as u64
    }

    fn mark(&self, i: u64, on: bool) -> Result<(), ImageError> {
        let byte = {
            let mut have = self.have.lock().unwrap_or_else(|e| e.into_inner());
            let b = &mut have[(i / 8) as usize];
            if on {
                *b |= 1 << (i % 8);
            } else {
                *b &= !(1 << (i % 8));
            }
            *b
        };
        if on {
            self.held.fetch_add(1, Ordering::Relaxed);
        } else {
            self.held.fetch_sub(1, Ordering::Relaxed);
        }
        self.have_file
            .write_all_at(&[byte], i / 8)
            .ctx(|| "marking a chunk".into())
    }

    /// Chunk `i`, present on the node while the returned guard is held: fetched once
    /// (however many wait for it), checked, written, marked.
    async fn ensure(&self, i: u64) -> Result<tokio::sync::RwLockReadGuard<'_, ()>, LazyError> {
        let lock = &self.locks[i as usize];
        loop {
            let r = lock.read().await;
            if self.has(i) {
                return Ok(r);
            }
            drop(r);
            let _w = lock.write().await;
            if self.has(i) {
                continue;
            }
            let t = &self.src.table;
            let start = i * t.chunk_size;
            let len = t.chunk_size.min(t.size - start);
            let bytes = self
                .fetch
                .fetch(start, len)
                .await
                .map_err(|source| LazyError::Fetch {
                    registry: self.src.registry.clone(),
                    digest: self.src.digest.clone(),
                    start,
                    end: start + len - 1,
                    source,
                })?;
            self.fetches.fetch_add(1, Ordering::Relaxed);
            self.fetched_bytes
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
            if bytes.len() as u64 != len
                || hex::encode(Sha256::digest(&bytes)) != t.chunks[i as usize]
            {
                return Err(LazyError::Mismatch {
                    digest: self.src.digest.clone(),
                    index: i,
                });
            }
            self.data
                .write_all_at(&bytes, start)
                .ctx(|| "writing a fetched chunk".into())?;
            self.mark(i, true)?;
        }
    }

    /// Fetches chunk `i` unless the node has it (a prefetch).
    pub async fn prefetch(&self, i: u64) -> Result<(), LazyError> {
        self.ensure(i).await.map(drop)
    }

    /// True the first time only: whoever gets it starts the blob's prefetch.
    pub fn start_prefetch(&self) -> bool {
        !self.prefetching.swap(true, Ordering::SeqCst)
    }

    /// Drops chunk `i` from the node (its bytes punched out of `data`) unless a read or
    /// a fetch holds it; whether it was dropped.
    pub fn evict(&self, i: u64) -> Result<bool, ImageError> {
        let Ok(_w) = self.locks[i as usize].try_write() else {
            return Ok(false);
        };
        if !self.has(i) {
            return Ok(false);
        }
        self.mark(i, false)?;
        let cs = self.src.table.chunk_size;
        use std::os::fd::AsRawFd;
        // SAFETY: fallocate(2) on a descriptor this blob owns, within the file.
        let rc = unsafe {
            libc::fallocate(
                self.data.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                (i * cs) as libc::off_t,
                cs.min(self.src.table.size - i * cs) as libc::off_t,
            )
        };
        if rc != 0 {
            return Err(ImageError::Io {
                context: "punching an evicted chunk out".into(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(true)
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
        // In ascending order: two reads waiting on each other's chunks cannot deadlock.
        let mut guards = Vec::with_capacity((last - first + 1) as usize);
        for i in first..=last {
            guards.push(self.ensure(i).await?);
        }
        let mut buf = vec![0u8; len as usize];
        self.data
            .read_exact_at(&mut buf, offset)
            .ctx(|| "reading a lazy blob's cache".into())?;
        drop(guards);
        self.read_bytes.fetch_add(len, Ordering::Relaxed);
        Ok(buf)
    }
}

// ---------------------------------------------------------------------------------
// Publishing: the EROFS layers of an image as an OCI artifact that refers to it.

/// The artifact type of an image's lazy layers.
pub const ARTIFACT_TYPE: &str = "application/vnd.opendsec.erofs.v1";
/// A layer's EROFS image.
pub const EROFS_MEDIA: &str = "application/vnd.opendsec.erofs.layer.v1";
/// A layer's chunk table (JSON, [`ChunkTable`]).
pub const CHUNKS_MEDIA: &str = "application/vnd.opendsec.erofs.chunks.v1+json";
/// On an EROFS layer: the digest of the image layer it was made from.
pub const SOURCE_ANNOTATION: &str = "org.opendsec.erofs.source";
const EMPTY_MEDIA: &str = "application/vnd.oci.empty.v1+json";

#[derive(Debug)]
pub enum PublishError {
    Registry(oci_client::errors::OciDistributionError),
    Image(ImageError),
}

impl From<ImageError> for PublishError {
    fn from(e: ImageError) -> Self {
        PublishError::Image(e)
    }
}

impl From<oci_client::errors::OciDistributionError> for PublishError {
    fn from(e: oci_client::errors::OciDistributionError) -> Self {
        PublishError::Registry(e)
    }
}

#[derive(Debug, Clone, Default)]
pub struct Published {
    pub digest: String,
    pub pushed_blobs: usize,
    pub skipped_blobs: usize,
    pub pushed_bytes: u64,
}

/// The chunk table and digest of store layer `layer`'s EROFS image, as a conversion
/// made before found them (kept under `erofs/`: the builder gives the same bytes for the
/// same tree, so the registry may have the image already).
fn converted_before(store: &crate::ImageStore, layer: &str) -> Option<(ChunkTable, String)> {
    let b = std::fs::read(store.root().join("erofs").join(format!("{layer}.json"))).ok()?;
    serde_json::from_slice(&b).ok()
}

/// Converts store layer `layer` to an EROFS image at `img`; returns its chunk table and
/// digest (also kept, without the image, for the next push).
pub fn convert(
    store: &crate::ImageStore,
    layer: &str,
    img: &Path,
) -> Result<(ChunkTable, String), ImageError> {
    store.ready_layers(&[layer.to_string()])?;
    crate::erofs::build(&store.layer_path(layer), img)?;
    let (table, digest) = ChunkTable::of_file_with_digest(img, CHUNK_SIZE)?;
    let dir = store.root().join("erofs");
    std::fs::create_dir_all(&dir).ctx(|| format!("creating {}", dir.display()))?;
    let json = serde_json::to_vec(&(&table, &digest))
        .map_err(|e| ImageError::Corrupt(format!("encoding a chunk table: {e}")))?;
    crate::store::write_atomic(
        &store.root().join("tmp"),
        &dir.join(format!("{layer}.json")),
        &json,
    )?;
    Ok((table, digest))
}

/// Pushes the EROFS images and chunk tables of `layers` (store layers, bottom first;
/// `sources` the image manifest's layer digests they stand for) and an artifact manifest
/// whose subject is the image's manifest, then lists it under the referrers tag
/// `sha256-<hex>` (the OCI 1.1 fallback for registries without the referrers API,
/// such as distribution 2.8).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn publish(
    store: &crate::ImageStore,
    client: &oci_client::Client,
    r: &Reference,
    layers: &[String],
    sources: &[String],
    subject: &crate::oci::Descriptor,
    work: &Path,
    log: &mut (dyn FnMut(String) + Send),
) -> Result<Published, PublishError> {
    use crate::oci::Descriptor;
    if layers.len() != sources.len() {
        return Err(ImageError::Corrupt(format!(
            "the image has {} layers in the store and {} in its manifest",
            layers.len(),
            sources.len()
        ))
        .into());
    }
    let mut out = Published::default();
    let mut descs = Vec::new();
    for (i, (layer, source)) in layers.iter().zip(sources).enumerate() {
        let started = std::time::Instant::now();
        let img = work.join(format!("{layer}.erofs"));
        // Converted before and in the registry already: nothing to build or send.
        let before = match converted_before(store, layer) {
            Some((t, d)) if client.blob_exists(r, &d).await.unwrap_or(false) => Some((t, d)),
            _ => None,
        };
        let (table, digest, sent) = match before {
            Some((t, d)) => (t, d, false),
            None => {
                let (store2, layer2, img2) = (store.clone(), layer.clone(), img.clone());
                let (t, d) = tokio::task::spawn_blocking(move || convert(&store2, &layer2, &img2))
                    .await
                    .map_err(|e| ImageError::Build(format!("conversion worker failed: {e}")))??;
                (t, d, true)
            }
        };
        let table_bytes = serde_json::to_vec(&table)
            .map_err(|e| ImageError::Corrupt(format!("encoding a chunk table: {e}")))?;
        let table_digest = format!("sha256:{}", hex::encode(Sha256::digest(&table_bytes)));
        let mut annotations = std::collections::BTreeMap::new();
        annotations.insert(SOURCE_ANNOTATION.to_string(), source.clone());
        let erofs = Descriptor {
            media_type: EROFS_MEDIA.into(),
            digest: digest.clone(),
            size: table.size as i64,
            platform: None,
            annotations,
            artifact_type: None,
        };
        let chunks = Descriptor {
            media_type: CHUNKS_MEDIA.into(),
            digest: table_digest.clone(),
            size: table_bytes.len() as i64,
            platform: None,
            annotations: Default::default(),
            artifact_type: None,
        };
        if !sent || client.blob_exists(r, &digest).await.unwrap_or(false) {
            out.skipped_blobs += 1;
        } else {
            crate::push::send_blob(client, r, &img, &erofs).await?;
            out.pushed_blobs += 1;
            out.pushed_bytes += table.size;
        }
        let _ = std::fs::remove_file(&img);
        if client.blob_exists(r, &table_digest).await.unwrap_or(false) {
            out.skipped_blobs += 1;
        } else {
            client
                .push_blob(r, table_bytes.clone(), &table_digest)
                .await?;
            out.pushed_blobs += 1;
            out.pushed_bytes += table_bytes.len() as u64;
        }
        log(format!(
            "lazy layer {}/{}: EROFS {digest} ({:.1} MiB, {} chunks) in {:.1} s",
            i + 1,
            layers.len(),
            table.size as f64 / (1 << 20) as f64,
            table.chunks.len(),
            started.elapsed().as_secs_f64()
        ));
        descs.push(erofs);
        descs.push(chunks);
    }
    let empty = b"{}".to_vec();
    let empty_digest = format!("sha256:{}", hex::encode(Sha256::digest(&empty)));
    if !client.blob_exists(r, &empty_digest).await.unwrap_or(false) {
        client.push_blob(r, empty.clone(), &empty_digest).await?;
    }
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": crate::oci::OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": EMPTY_MEDIA, "digest": empty_digest, "size": 2},
        "layers": descs,
        "subject": subject,
    });
    let bytes = serde_json::to_vec(&manifest)
        .map_err(|e| ImageError::Corrupt(format!("encoding the lazy artifact: {e}")))?;
    let digest = format!("sha256:{}", hex::encode(Sha256::digest(&bytes)));
    let by_digest = r.clone_with_digest(digest.clone());
    client
        .push_manifest_raw(
            &by_digest,
            bytes.clone(),
            http::HeaderValue::from_static(crate::oci::OCI_MANIFEST),
        )
        .await?;
    // The referrers tag: an index of every artifact that refers to the subject; this
    // one replaces an earlier artifact of the same type.
    let tag = Reference::with_tag(
        r.registry().to_string(),
        r.repository().to_string(),
        format!("sha256-{}", subject.digest.trim_start_matches("sha256:")),
    );
    let mut listed: Vec<Descriptor> = match client
        .pull_manifest_raw(&tag, &RegistryAuth::Anonymous, &[crate::oci::OCI_INDEX])
        .await
    {
        Ok((b, _)) if b.len() < 4 << 20 => serde_json::from_slice::<crate::oci::Document>(&b)
            .ok()
            .and_then(|d| d.manifests)
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    listed.retain(|d| d.artifact_type.as_deref() != Some(ARTIFACT_TYPE));
    listed.push(Descriptor {
        media_type: crate::oci::OCI_MANIFEST.into(),
        digest: digest.clone(),
        size: bytes.len() as i64,
        platform: None,
        annotations: Default::default(),
        artifact_type: Some(ARTIFACT_TYPE.into()),
    });
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": crate::oci::OCI_INDEX,
        "manifests": listed,
    });
    let index_bytes = serde_json::to_vec(&index)
        .map_err(|e| ImageError::Corrupt(format!("encoding the referrers index: {e}")))?;
    client
        .push_manifest_raw(
            &tag,
            index_bytes,
            http::HeaderValue::from_static(crate::oci::OCI_INDEX),
        )
        .await?;
    log(format!(
        "lazy layers: artifact {digest}, listed under {}",
        tag.tag().unwrap_or("")
    ));
    out.digest = digest;
    Ok(out)
}

// ---------------------------------------------------------------------------------
// Pulling: an image whose lazy layers a registry has, registered instead of fetched.

/// The largest chunk table a node fetches (64 GiB of layer in 1 MiB chunks fits).
const MAX_TABLE_BYTES: u64 = 8 << 20;

/// An image's lazy layers as its artifact lists them: (EROFS, chunk table) per layer.
pub(crate) struct Artifact {
    pub digest: String,
    pub layers: Vec<(crate::oci::Descriptor, crate::oci::Descriptor)>,
}

fn refused(reference: &str, m: impl Into<String>) -> ImageError {
    ImageError::Pull {
        reference: reference.to_string(),
        kind: crate::pull::PullFailure::Refused,
        message: m.into(),
    }
}

/// The lazy layers published for the manifest `subject` of `r` (found by the referrers
/// tag `sha256-<hex>`), checked against the image's own `layers`: `None` when there are
/// none; an error when what is there is not what it should be.
pub(crate) async fn find_artifact(
    client: &oci_client::Client,
    r: &Reference,
    auth: &RegistryAuth,
    limits: &crate::pull::PullLimits,
    reference: &str,
    subject: &str,
    layers: &[crate::oci::Descriptor],
) -> Result<Option<Artifact>, ImageError> {
    let hex = crate::pull::check_digest(reference, subject)?;
    let tag = Reference::with_tag(
        r.registry().to_string(),
        r.repository().to_string(),
        format!("sha256-{hex}"),
    );
    let Ok((bytes, _)) = crate::pull::document(client, &tag, auth, limits, reference).await else {
        return Ok(None);
    };
    let index: crate::oci::Document = serde_json::from_slice(&bytes)
        .map_err(|e| refused(reference, format!("the referrers index: {e}")))?;
    let Some(entry) = index
        .manifests
        .unwrap_or_default()
        .into_iter()
        .find(|d| d.artifact_type.as_deref() == Some(ARTIFACT_TYPE))
    else {
        return Ok(None);
    };
    crate::pull::check_digest(reference, &entry.digest)?;
    let (bytes, digest) = crate::pull::document(
        client,
        &r.clone_with_digest(entry.digest.clone()),
        auth,
        limits,
        reference,
    )
    .await?;
    let doc: crate::oci::Document = serde_json::from_slice(&bytes)
        .map_err(|e| refused(reference, format!("the lazy layers' manifest: {e}")))?;
    if doc.artifact_type.as_deref() != Some(ARTIFACT_TYPE) {
        return Err(refused(
            reference,
            "the lazy layers' manifest has another artifact type",
        ));
    }
    if doc.subject.as_ref().map(|s| s.digest.as_str()) != Some(subject) {
        return Err(refused(
            reference,
            "the lazy layers' manifest refers to another image",
        ));
    }
    let listed = doc.layers.unwrap_or_default();
    if listed.len() != 2 * layers.len() {
        return Err(refused(
            reference,
            format!(
                "the lazy layers' manifest lists {} blobs for {} layers",
                listed.len(),
                layers.len()
            ),
        ));
    }
    let mut pairs = Vec::with_capacity(layers.len());
    for (i, pair) in listed.chunks(2).enumerate() {
        let (erofs, table) = (&pair[0], &pair[1]);
        let ok = erofs.media_type == EROFS_MEDIA
            && table.media_type == CHUNKS_MEDIA
            && erofs.annotations.get(SOURCE_ANNOTATION) == Some(&layers[i].digest)
            && (0..=MAX_BLOB as i64).contains(&erofs.size)
            && (2..=MAX_TABLE_BYTES as i64).contains(&table.size);
        if !ok {
            return Err(refused(
                reference,
                format!(
                    "lazy layer {} does not stand for image layer {}",
                    i + 1,
                    layers[i].digest
                ),
            ));
        }
        crate::pull::check_digest(reference, &erofs.digest)?;
        crate::pull::check_digest(reference, &table.digest)?;
        pairs.push((erofs.clone(), table.clone()));
    }
    Ok(Some(Artifact {
        digest,
        layers: pairs,
    }))
}

/// What a lazy pull needs besides the request.
pub(crate) struct LazyPull<'a> {
    pub client: &'a oci_client::Client,
    pub r: &'a Reference,
    pub config: &'a crate::oci::Descriptor,
    pub artifact: Artifact,
    pub tmp: &'a Path,
    pub digest: &'a str,
    pub mounter: &'a LazyMounter,
}

/// Registers the image's lazy layers (fetching only their chunk tables), mounts them,
/// and names the image.
pub(crate) async fn pull_lazy(
    store: &crate::ImageStore,
    req: &crate::pull::PullRequest,
    p: LazyPull<'_>,
    log: &mut (dyn FnMut(String) + Send),
    before_tag: Option<crate::pull::BeforeTag>,
) -> Result<crate::pull::Pulled, ImageError> {
    let reference = req.reference.as_str();
    let cfg_path = p.tmp.join("config");
    let mut fetched_bytes =
        crate::pull::fetch_blob(p.client, p.r, p.config, &cfg_path, reference).await?;
    let cfg_bytes = std::fs::read(&cfg_path).ctx(|| format!("reading {}", cfg_path.display()))?;
    let cfg: crate::pull::ConfigFile = serde_json::from_slice(&cfg_bytes)
        .map_err(|e| refused(reference, format!("the image config: {e}")))?;
    let (mut ids, mut size_bytes, mut cached) = (Vec::new(), 0u64, 0usize);
    let n = p.artifact.layers.len();
    for (i, (erofs, table_desc)) in p.artifact.layers.iter().enumerate() {
        let hex = crate::pull::check_digest(reference, &erofs.digest)?;
        let started = std::time::Instant::now();
        let registered = blob_dir(store.root(), &hex).join("source.json").exists();
        // A blob this node has already is used only if this caller may fetch it too.
        if registered
            && p.client
                .blob_exists(p.r, &erofs.digest)
                .await
                .unwrap_or(false)
        {
            cached += 1;
        } else {
            let path = p.tmp.join(format!("chunks-{i}"));
            fetched_bytes +=
                crate::pull::fetch_blob(p.client, p.r, table_desc, &path, reference).await?;
            let bytes = std::fs::read(&path).ctx(|| format!("reading {}", path.display()))?;
            let table: ChunkTable = serde_json::from_slice(&bytes).map_err(|e| {
                refused(reference, format!("lazy layer {}: chunk table: {e}", i + 1))
            })?;
            table
                .check()
                .map_err(|e| refused(reference, format!("lazy layer {}: {e}", i + 1)))?;
            if table.size != erofs.size as u64 || table.size < 4096 {
                return Err(refused(
                    reference,
                    format!(
                        "lazy layer {}: the chunk table is of {} bytes, the layer {}",
                        i + 1,
                        table.size,
                        erofs.size
                    ),
                ));
            }
            register(
                store.root(),
                &LazySource {
                    registry: p.r.registry().to_string(),
                    repository: p.r.repository().to_string(),
                    digest: erofs.digest.clone(),
                    plain_http: req.plain_http,
                    ca_pem: req.ca_pem.clone(),
                    login: req.login.clone(),
                    table,
                },
            )?;
        }
        let dir = store.layer_path(&hex);
        std::fs::create_dir_all(&dir).ctx(|| format!("creating {}", dir.display()))?;
        let (m, h) = (p.mounter.clone(), hex.clone());
        tokio::task::spawn_blocking(move || m.mount(&h))
            .await
            .map_err(|e| ImageError::Build(format!("mount worker failed: {e}")))??;
        log(format!(
            "layer {}/{n} {}: lazy, EROFS {} ({:.1} MiB) mounted in {:.2} s",
            i + 1,
            erofs
                .annotations
                .get(SOURCE_ANNOTATION)
                .map_or("", String::as_str),
            erofs.digest,
            erofs.size as f64 / (1 << 20) as f64,
            started.elapsed().as_secs_f64()
        ));
        size_bytes += erofs.size as u64;
        ids.push(hex);
    }
    let source = format!(
        "pull {}/{}@{} (lazy: {})",
        p.r.resolve_registry(),
        p.r.repository(),
        p.digest,
        p.artifact.digest
    );
    let manifest = crate::pull::image_manifest(cfg, ids, size_bytes, source, None);
    if let Some(hold) = before_tag {
        hold(manifest.size_bytes).await?;
    }
    let image_digest = store.put_manifest(&manifest)?;
    store.tag(&req.target, &image_digest)?;
    log(format!("{} is {image_digest}", req.target));
    Ok(crate::pull::Pulled {
        digest: image_digest,
        source_digest: p.digest.to_string(),
        manifest,
        fetched: n - cached,
        cached,
        fetched_bytes,
        lazy: true,
    })
}

// ---------------------------------------------------------------------------------
// The node's side: the lazy file system's daemon and the layers' mounts.

/// The file in the store naming the running daemon's generation (fresh at each start).
const GENERATION: &str = "lazyfs.gen";

/// `statfs`'s magic of a FUSE mount.
const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

/// Why this node cannot start images lazily, if it cannot.
pub fn unsupported() -> Option<String> {
    let fs = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    let has = |n: &str| fs.lines().any(|l| l.split_whitespace().last() == Some(n));
    if !has("erofs") {
        return Some("the kernel has no EROFS".into());
    }
    if !has("fuse") || !Path::new("/dev/fuse").exists() {
        return Some("the kernel has no FUSE (or /dev/fuse is missing)".into());
    }
    None
}

fn statfs_type(p: &Path) -> Option<i64> {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: a NUL-terminated path and a zeroed statfs the call fills.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    (unsafe { libc::statfs(c.as_ptr(), &mut s) } == 0).then_some(s.f_type as i64)
}

/// Whether `p` is the root of a mount (its device differs from its parent's).
pub fn is_mountpoint(p: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (Ok(a), Some(Ok(b))) = (
        std::fs::symlink_metadata(p),
        p.parent().map(std::fs::symlink_metadata),
    ) else {
        return false;
    };
    a.dev() != b.dev()
}

fn umount(p: &Path, flags: i32) -> bool {
    let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: a NUL-terminated path.
    unsafe { libc::umount2(c.as_ptr(), flags) == 0 }
}

/// Starts the lazy file system of a store when it is not running, and mounts layers
/// from it. Cheap to clone; one per node (the daemon takes a lock on the store).
#[derive(Debug, Clone)]
pub struct LazyMounter {
    /// The `dsec` binary, run as `dsec lazyfs --store <store>`.
    pub exe: PathBuf,
    pub store: PathBuf,
    /// The most MiB of fetched chunks the daemon keeps (0: no bound).
    pub cache_mb: u64,
    /// Fetch the rest of a blob in the background once something reads it.
    pub prefetch: bool,
}

/// The directory of a store the lazy file system serves its blobs in.
const FUSE_DIR: &str = "lazyfs";

/// The store and the blob of a path that is a blob's file on the lazy file system
/// (`<store>/lazyfs/<hex>`), as a VM's root disk is.
pub fn lazyfs_blob(path: &Path) -> Option<(&Path, &str)> {
    let dir = path.parent()?;
    let hex = path.file_name()?.to_str()?;
    (dir.file_name()? == FUSE_DIR && crate::digest::valid_digest(hex))
        .then_some((dir.parent()?, hex))
}

impl LazyMounter {
    pub fn fuse_dir(&self) -> PathBuf {
        self.store.join(FUSE_DIR)
    }

    fn alive(&self) -> bool {
        statfs_type(&self.fuse_dir()) == Some(FUSE_SUPER_MAGIC)
            && std::fs::read_dir(self.fuse_dir()).is_ok()
    }

    /// The daemon is serving `lazyfs/` when this returns.
    pub fn ensure_daemon(&self) -> Result<(), ImageError> {
        static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
        if self.alive() {
            return Ok(());
        }
        let log_path = self.store.join("lazyfs.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .ctx(|| format!("opening {}", log_path.display()))?;
        let err = log.try_clone().ctx(|| "opening the lazyfs log".into())?;
        use std::os::unix::process::CommandExt;
        let mut child = std::process::Command::new(&self.exe)
            .arg("lazyfs")
            .arg("--store")
            .arg(&self.store)
            .arg("--cache-mb")
            .arg(self.cache_mb.to_string())
            .args(self.prefetch.then_some("--prefetch"))
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(err)
            .process_group(0)
            .spawn()
            .ctx(|| format!("starting {} lazyfs", self.exe.display()))?;
        let t0 = std::time::Instant::now();
        while !self.alive() {
            if let Ok(Some(status)) = child.try_wait() {
                // Another node process may have won the lock and be starting it.
                if !status.success() || t0.elapsed() > std::time::Duration::from_secs(10) {
                    return Err(ImageError::Build(format!(
                        "the lazy file system did not start ({status}); see {}",
                        log_path.display()
                    )));
                }
            }
            if t0.elapsed() > std::time::Duration::from_secs(10) {
                let _ = child.kill();
                return Err(ImageError::Build(format!(
                    "the lazy file system did not start within 10 s; see {}",
                    log_path.display()
                )));
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // Reaped when it exits (after `lazyfs/` is unmounted).
        std::thread::spawn(move || child.wait());
        Ok(())
    }

    /// Mounts the EROFS of lazy blob `hex` on its layer directory (in this process's
    /// mount namespace), unless it is, starting the daemon if it is not running.
    pub fn mount(&self, hex: &str) -> Result<(), ImageError> {
        self.ensure_daemon()?;
        self.mount_from(hex, &self.fuse_dir().join(hex))
    }

    /// Mounts lazy layer `hex` in the calling thread's mount namespace when that is not
    /// this process's (the sandboxes' namespace, which host mounts made after it do not
    /// reach): from the lazy file system as the process's main thread sees it. Call
    /// [`LazyMounter::mount`] first, from the process's own namespace.
    pub fn mount_here(&self, hex: &str) -> Result<(), ImageError> {
        let fuse = self
            .fuse_dir()
            .canonicalize()
            .ctx(|| format!("resolving {}", self.fuse_dir().display()))?;
        let rel = fuse.strip_prefix("/").unwrap_or(&fuse);
        let source = PathBuf::from(format!("/proc/{}/root", std::process::id()))
            .join(rel)
            .join(hex);
        self.mount_from(hex, &source)
    }

    /// Mounts `source` (the blob's file on the lazy file system) on the layer directory
    /// in the calling thread's mount namespace, unless a mount made from the running
    /// daemon is there already. Each mount is marked, per namespace, with the daemon's
    /// generation: one left from a daemon that died answers nothing, and is replaced.
    fn mount_from(&self, hex: &str, source: &Path) -> Result<(), ImageError> {
        static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
        let generation = std::fs::read_to_string(self.store.join(GENERATION)).unwrap_or_default();
        let ns = {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata("/proc/thread-self/ns/mnt").map_or(0, |m| m.ino())
        };
        let mark = blob_dir(&self.store, hex).join(format!("mnt-{ns}.gen"));
        let target = self.store.join("layers").join(hex);
        if is_mountpoint(&target) && std::fs::read_to_string(&mark).is_ok_and(|g| g == generation) {
            return Ok(());
        }
        // One from an earlier daemon (it may not even answer a stat).
        umount(&target, libc::MNT_DETACH);
        std::fs::create_dir_all(&target).ctx(|| format!("creating {}", target.display()))?;
        crate::erofs::mount(source, &target)?;
        std::fs::write(&mark, &generation).ctx(|| format!("writing {}", mark.display()))
    }

    /// Mounts every lazy layer of the store (after a reboot, say); returns how many.
    pub fn mount_all(&self) -> Result<usize, ImageError> {
        let mut n = 0;
        for hex in self.registered() {
            if self.store.join("layers").join(&hex).is_dir() {
                self.mount(&hex)?;
                n += 1;
            }
        }
        Ok(n)
    }

    fn registered(&self) -> Vec<String> {
        std::fs::read_dir(self.store.join("lazy"))
            .map(|d| {
                d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .filter(|n| crate::digest::valid_digest(n))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Detaches every lazy layer's mount and the lazy file system (`dsec down`): they
    /// go when nothing uses them, and the daemon exits then.
    pub fn unmount_all(&self) {
        for hex in self.registered() {
            let target = self.store.join("layers").join(&hex);
            if is_mountpoint(&target) {
                umount(&target, libc::MNT_DETACH);
            }
        }
        if is_mountpoint(&self.fuse_dir()) {
            umount(&self.fuse_dir(), libc::MNT_DETACH);
        }
    }

    /// Forgets lazy blob `hex`: its mount (lazily detached) and its cache.
    pub fn remove(store: &Path, hex: &str) -> Result<(), ImageError> {
        let target = store.join("layers").join(hex);
        if is_mountpoint(&target) {
            umount(&target, libc::MNT_DETACH);
        }
        crate::store::remove_tree(&blob_dir(store, hex))
    }
}

/// `dsec lazyfs`: serves the store's lazy blobs on `<store>/lazyfs` until it is
/// unmounted; `peers`, when the node is one of a cluster's edges, are asked for each
/// chunk before the registry. Returns at once when another process serves the store already.
/// `cache_mb`: the most MiB of fetched chunks kept (0: no bound); `prefetch`: fetch the
/// rest of a blob in the background from a second after something first reads it.
pub fn serve(
    store: &Path,
    rt: tokio::runtime::Handle,
    cache_mb: u64,
    prefetch: bool,
    peers: Option<Arc<dyn PeerChunks>>,
) -> Result<(), ImageError> {
    use std::os::fd::AsRawFd;
    let lock_path = store.join("lazyfs.lock");
    let lock =
        std::fs::File::create(&lock_path).ctx(|| format!("creating {}", lock_path.display()))?;
    // SAFETY: a descriptor this function owns.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        tracing::info!("another process serves {}", store.display());
        return Ok(());
    }
    let m = LazyMounter {
        exe: PathBuf::new(),
        store: store.to_path_buf(),
        cache_mb,
        prefetch,
    };
    let dir = m.fuse_dir();
    // A daemon that died leaves its mount there, answering nothing (not even a stat).
    umount(&dir, libc::MNT_DETACH);
    create_private_dir(&dir)?;
    create_private_dir(&store.join("lazy"))?;
    // Mounts of layers made from an earlier daemon are replaced when next used.
    crate::store::write_atomic(
        &store.join("tmp"),
        &store.join(GENERATION),
        dsec_common::id::random_hex(8).as_bytes(),
    )?;
    let registry = crate::lazyfs::registry_fetcher();
    let make: crate::lazyfs::MakeFetch = match peers {
        Some(p) => Arc::new(move |store: &Path, src: &LazySource| {
            Arc::new(PeerFirst::new(p.clone(), src, registry(store, src))) as Arc<dyn Fetch>
        }),
        None => registry,
    };
    let fs = crate::lazyfs::LazyFs::new(store, rt, make)
        .with_cache_limit((cache_mb > 0).then_some(cache_mb << 20))
        .with_prefetch(prefetch.then_some(std::time::Duration::from_secs(1)));
    tracing::info!(
        "serving lazy blobs of {} on {}",
        store.display(),
        dir.display()
    );
    fs.serve(&dir)
        .ctx(|| format!("serving the lazy file system on {}", dir.display()))?;
    drop(lock);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Serves a blob held in memory, or other bytes than it.
    struct Memory(Vec<u8>);

    impl Fetch for Memory {
        fn fetch(&self, start: u64, len: u64) -> Fetched {
            let b = self
                .0
                .get(start as usize..(start + len) as usize)
                .map(<[u8]>::to_vec);
            Box::pin(async move {
                b.ok_or(FetchError::OutOfRange {
                    start,
                    end: start + len,
                })
            })
        }
    }

    fn source(table: ChunkTable) -> LazySource {
        LazySource {
            registry: "127.0.0.1:1".into(),
            repository: "t/t".into(),
            digest: format!("sha256:{}", "ab".repeat(32)),
            plain_http: true,
            ca_pem: None,
            login: None,
            table,
        }
    }

    fn table_of(b: &[u8], cs: u64) -> ChunkTable {
        ChunkTable {
            size: b.len() as u64,
            chunk_size: cs,
            chunks: b
                .chunks(cs as usize)
                .map(|c| hex::encode(Sha256::digest(c)))
                .collect(),
        }
    }

    #[test]
    fn a_chunk_table_is_checked_before_it_is_used() {
        let good = table_of(&[7u8; 10_000], 4096);
        assert!(good.check().is_ok());
        let mut t = good.clone();
        t.chunk_size = 5000;
        assert!(t.check().unwrap_err().to_string().contains("power of two"));
        let mut t = good.clone();
        t.chunks.pop();
        assert!(t.check().unwrap_err().to_string().contains("chunk digests"));
        let mut t = good.clone();
        t.chunks[1] = "Z".repeat(64);
        assert!(t.check().unwrap_err().to_string().contains("SHA-256"));
        let mut t = good.clone();
        t.size = MAX_BLOB + 1;
        assert!(t.check().is_err());
        let store = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(store.path().join("tmp")).unwrap();
        let mut bad = source(good);
        bad.table.chunk_size = 3;
        assert!(register(store.path(), &bad).is_err());
        assert!(!store.path().join("lazy").exists(), "nothing registered");
    }

    #[test]
    fn a_lazy_layer_a_node_cannot_mount_is_an_error_not_an_empty_directory() {
        let t = tempfile::tempdir().unwrap();
        let store = crate::ImageStore::open(t.path()).unwrap();
        let src = source(table_of(&[1u8; 9000], 4096));
        register(store.root(), &src).unwrap();
        std::fs::create_dir_all(store.layer_path(src.hex())).unwrap();
        let plain = "cd".repeat(32);
        std::fs::create_dir_all(store.layer_path(&plain)).unwrap();
        assert_eq!(
            store.ready_layers(std::slice::from_ref(&plain)).unwrap(),
            Vec::<String>::new()
        );
        let e = store
            .ready_layers(&[plain, src.hex().to_string()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("fetched lazily") && e.contains("--no-lazy"),
            "{e}"
        );
    }

    /// Arbitrary bytes as a chunk table, and reads anywhere in the blob it describes
    /// from a source that may disagree with it: an error or the right bytes, never a
    /// panic, never bytes the table does not vouch for.
    #[test]
    fn fuzz_chunk_tables_and_reads() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let store = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(store.path().join("tmp")).unwrap();
        let blob: Vec<u8> = (0..40_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut n = 0u32;
        bolero::check!()
            .with_iterations(300)
            .for_each(|input: &[u8]| {
                n += 1;
                let table = match serde_json::from_slice::<ChunkTable>(input) {
                    Ok(t) => t,
                    // Mostly not JSON: read the bytes as parameters of a table instead.
                    Err(_) if input.len() >= 6 => {
                        let cs = 4096u64 << (input[0] % 3);
                        let size = (u16::from_le_bytes([input[1], input[2]]) as u64) % 40_000;
                        let mut t = table_of(&blob[..size as usize], cs);
                        if input[3] % 2 == 1 && !t.chunks.is_empty() {
                            let k = input[4] as usize % t.chunks.len();
                            t.chunks[k] = "00".repeat(32);
                        }
                        t
                    }
                    Err(_) => return,
                };
                let mut src = source(table);
                src.digest = format!("sha256:{:064x}", n);
                if register(store.path(), &src).is_err() {
                    return;
                }
                let b = LazyBlob::open(store.path(), src.hex(), Arc::new(Memory(blob.clone())))
                    .unwrap();
                let off = input.first().copied().unwrap_or(0) as u64 * 157;
                let len = input.get(1).copied().unwrap_or(1) as u64 * 97;
                if let Ok(got) = rt.block_on(b.read_at(off, len)) {
                    let end = (off + got.len() as u64) as usize;
                    assert_eq!(&got[..], &blob[off as usize..end], "unvouched bytes");
                }
                let _ = std::fs::remove_dir_all(blob_dir(store.path(), src.hex()));
            });
    }

    /// A peer that answers with the bytes it is given for each chunk (or nothing), and
    /// counts what it is asked.
    struct Peer(Option<Vec<u8>>, AtomicU64);

    impl PeerChunks for Peer {
        fn chunk(&self, _hex: &str, index: u64, _len: u64) -> PeerFetched {
            self.1.fetch_add(1, Ordering::SeqCst);
            let b = self.0.as_ref().map(|b| {
                let cs = 4096usize;
                let start = index as usize * cs;
                b[start..(start + cs).min(b.len())].to_vec()
            });
            Box::pin(async move { b })
        }
    }

    struct Counted(Memory, AtomicU64);

    impl Fetch for Counted {
        fn fetch(&self, start: u64, len: u64) -> Fetched {
            self.1.fetch_add(1, Ordering::SeqCst);
            self.0.fetch(start, len)
        }
    }

    /// Chunks come from a peer that holds them, without the registry; a peer's bytes
    /// that are not the chunk's, or a peer without it, send the fetch to the registry;
    /// and what a node serves its peers is only what it holds, checked.
    #[test]
    fn peers_are_asked_first_and_their_bytes_are_checked() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let blob: Vec<u8> = (0..10_000u32).map(|i| (i * 13 % 251) as u8).collect();
        let src = source(table_of(&blob, 4096));
        let registry = Arc::new(Counted(Memory(blob.clone()), AtomicU64::new(0)));
        for (peer_has, from_registry) in [
            (Some(blob.clone()), 0),
            (Some(vec![9u8; blob.len()]), 3),
            (None, 3),
        ] {
            registry.1.store(0, Ordering::SeqCst);
            let peer = Arc::new(Peer(peer_has, AtomicU64::new(0)));
            let f = PeerFirst::new(peer.clone(), &src, registry.clone());
            for (i, start) in [0u64, 4096, 8192].into_iter().enumerate() {
                let len = 4096.min(blob.len() as u64 - start);
                let got = rt.block_on(f.fetch(start, len)).unwrap();
                assert_eq!(
                    got,
                    blob[start as usize..(start + len) as usize],
                    "chunk {i}"
                );
            }
            assert_eq!(registry.1.load(Ordering::SeqCst), from_registry);
            assert_eq!(peer.1.load(Ordering::SeqCst), 3);
        }
        // A range that is not a whole chunk goes to the registry alone.
        let peer = Arc::new(Peer(Some(blob.clone()), AtomicU64::new(0)));
        let f = PeerFirst::new(peer.clone(), &src, registry.clone());
        assert_eq!(rt.block_on(f.fetch(100, 50)).unwrap(), blob[100..150]);
        assert_eq!(peer.1.load(Ordering::SeqCst), 0);

        // Serving peers: a store that registered the blob and read its middle chunk.
        let store = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(store.path().join("tmp")).unwrap();
        register(store.path(), &src).unwrap();
        let hex = src.hex().to_string();
        assert_eq!(held_chunk(store.path(), &hex, 1).unwrap(), None);
        let b = LazyBlob::open(store.path(), &hex, Arc::new(Memory(blob.clone()))).unwrap();
        rt.block_on(b.read_at(5000, 10)).unwrap();
        assert_eq!(
            held_chunk(store.path(), &hex, 1).unwrap().as_deref(),
            Some(&blob[4096..8192])
        );
        for (h, i) in [
            (hex.as_str(), 0),
            (hex.as_str(), 2),
            (hex.as_str(), 3),
            (&"cd".repeat(32)[..], 1),
            ("../x", 1),
        ] {
            assert_eq!(held_chunk(store.path(), h, i).unwrap(), None, "{h} {i}");
        }
        // Punched out under a reader (or otherwise changed): not served.
        let data = blob_dir(store.path(), &hex).join("data");
        let f = std::fs::OpenOptions::new().write(true).open(&data).unwrap();
        f.write_all_at(&[0u8; 16], 4096).unwrap();
        assert_eq!(held_chunk(store.path(), &hex, 1).unwrap(), None);
    }
}
