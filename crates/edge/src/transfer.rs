//! Moving a VM's saved state between edges: a resume or a fork placed on another edge.
//! The edge that has the state offers it under a random token; the other edge pulls the
//! files (memory, device state, the root disk unless it holds the same one) over the
//! cluster's mutual-TLS channel, restores them, and answers; only then does the first
//! edge let its copy go.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dsec_common::ApiError;
use dsec_common::api::{Capability, ForkRequest, SandboxInfo, SandboxState};
use dsec_common::id::SandboxId;
use serde::{Deserialize, Serialize};

use crate::backend::{Backend, SUSPENDED_DIR, SavedFile};
use crate::registry::{SandboxRecord, now_ms};
use crate::{Edge, blocking, finish, fork_response, port_token, random_hex};

/// How long the receiving edge may take: fetching the memory and restoring it.
const IMPORT_TIMEOUT: Duration = Duration::from_secs(900);

pub type PeerFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, ApiError>> + Send + 'a>>;

/// The other edges of the cluster, reached over mutual TLS (the `edge` role gives this).
pub trait Peers: Send + Sync {
    /// `POST`s JSON to `path` on `edge`; the answer's body on success, its error otherwise.
    fn post(
        &self,
        edge: &str,
        path: &str,
        body: Vec<u8>,
        timeout: Duration,
    ) -> PeerFuture<'_, Vec<u8>>;
    /// `GET`s `path` on `edge` (a small JSON answer).
    fn get(&self, edge: &str, path: &str) -> PeerFuture<'_, Vec<u8>>;
    /// `GET`s the file at `path` on `edge` (sent as its data extents, see
    /// [`ExtentWriter`]) into the new file `dest`, `size` bytes long; returns its size.
    fn download(&self, edge: &str, path: &str, dest: &Path, size: u64) -> PeerFuture<'_, u64>;
}

/// What is asked of the edge that receives a state.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ImportKind {
    /// Take over a sandbox paused to disk and resume it here.
    Resume,
    /// Make `count` copies here of a sandbox snapshotted on the other edge.
    Fork {
        count: u64,
        labels: BTreeMap<String, String>,
    },
}

/// `POST /v1/imports`, from one edge to another.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImportRequest {
    pub kind: ImportKind,
    /// The edge that offers the state, and its token.
    pub from: String,
    pub token: String,
    /// The sandbox the state is of, as its edge records it.
    pub record: SandboxRecord,
}

/// `GET /v1/exports/{token}`: what an offered state is made of.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExportManifest {
    pub files: Vec<SavedFile>,
}

/// Bytes before each extent of a file on the wire: its offset and length, big-endian.
pub const EXTENT_HEADER: usize = 16;

/// The data extents (offset, length) of an open file of `len` bytes, from
/// `SEEK_DATA`/`SEEK_HOLE`: a VM's memory file is mostly holes, which need not travel.
/// The whole file where the filesystem cannot tell.
pub fn data_extents(f: &std::fs::File, len: u64) -> Vec<(u64, u64)> {
    use std::os::fd::AsRawFd;
    let fd = f.as_raw_fd();
    let mut out = Vec::new();
    let mut pos: i64 = 0;
    while (pos as u64) < len {
        // SAFETY: lseek on a descriptor this function borrows.
        let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if data < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO) {
                break; // only a hole is left
            }
            return vec![(0, len)];
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        let hole = if hole < 0 {
            len as i64
        } else {
            hole.min(len as i64)
        };
        if hole > data {
            out.push((data as u64, (hole - data) as u64));
        }
        pos = hole.max(data + 1);
    }
    out
}

/// Why a received file could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ExtentError {
    #[error(
        "an extent at {offset} of {len} bytes is out of order or outside the file's {size} bytes"
    )]
    OutOfPlace { offset: u64, len: u64, size: u64 },
    #[error("the file stopped in the middle of an extent")]
    Cut,
    #[error("writing the received file: {0}")]
    Io(#[from] std::io::Error),
}

/// Writes a file received as extents (each a [`EXTENT_HEADER`] and its bytes, in order,
/// inside the file's size), leaving what no extent covers as holes.
pub struct ExtentWriter {
    f: std::fs::File,
    size: u64,
    header: Vec<u8>,
    /// Bytes of the current extent still to come.
    left: u64,
    /// Where the last extent ended (extents come in order, without overlap).
    end: u64,
}

impl ExtentWriter {
    pub fn new(f: std::fs::File, size: u64) -> ExtentWriter {
        ExtentWriter {
            f,
            size,
            header: Vec::with_capacity(EXTENT_HEADER),
            left: 0,
            end: 0,
        }
    }

    pub fn feed(&mut self, mut data: &[u8]) -> Result<(), ExtentError> {
        use std::io::{Seek, SeekFrom, Write};
        while !data.is_empty() {
            if self.left == 0 {
                let take = (EXTENT_HEADER - self.header.len()).min(data.len());
                self.header.extend_from_slice(&data[..take]);
                data = &data[take..];
                if self.header.len() < EXTENT_HEADER {
                    continue;
                }
                let mut b = [0u8; 8];
                b.copy_from_slice(&self.header[..8]);
                let off = u64::from_be_bytes(b);
                b.copy_from_slice(&self.header[8..]);
                let len = u64::from_be_bytes(b);
                self.header.clear();
                if off < self.end || off.checked_add(len).is_none_or(|e| e > self.size) {
                    return Err(ExtentError::OutOfPlace {
                        offset: off,
                        len,
                        size: self.size,
                    });
                }
                self.f.seek(SeekFrom::Start(off))?;
                self.left = len;
                self.end = off + len;
            } else {
                let take = (self.left.min(data.len() as u64)) as usize;
                self.f.write_all(&data[..take])?;
                self.left -= take as u64;
                data = &data[take..];
            }
        }
        Ok(())
    }

    /// The file, `size` bytes long; an error if the stream stopped inside an extent.
    pub fn finish(self) -> Result<u64, ExtentError> {
        if self.left != 0 || !self.header.is_empty() {
            return Err(ExtentError::Cut);
        }
        self.f.set_len(self.size)?;
        Ok(self.size)
    }
}

/// How long an offer stays open (the whole transfer must start within it).
const OFFER_TTL: Duration = Duration::from_secs(3600);
/// The most files and bytes a state may have.
const MAX_FILES: usize = 32;
const MAX_FILE_BYTES: u64 = 1 << 40;

struct Offer {
    files: Vec<SavedFile>,
    at: Instant,
}

/// States this edge offers to others.
#[derive(Default)]
pub struct Offers {
    map: Mutex<HashMap<String, Offer>>,
}

impl Offers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Offer>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Offers `files` under a new token.
    pub fn open(&self, files: Vec<SavedFile>) -> String {
        let token = random_hex(16);
        let mut m = self.lock();
        m.retain(|_, o| o.at.elapsed() < OFFER_TTL);
        m.insert(
            token.clone(),
            Offer {
                files,
                at: Instant::now(),
            },
        );
        token
    }

    pub fn close(&self, token: &str) {
        self.lock().remove(token);
    }

    fn gone(token: &str) -> ApiError {
        ApiError::not_found(format!(
            "no state is offered under {token:?} (the transfer finished, failed or took too long)"
        ))
    }

    pub fn manifest(&self, token: &str) -> Result<ExportManifest, ApiError> {
        let m = self.lock();
        let o = m
            .get(token)
            .filter(|o| o.at.elapsed() < OFFER_TTL)
            .ok_or_else(|| Self::gone(token))?;
        Ok(ExportManifest {
            files: o.files.clone(),
        })
    }

    /// Where the offered file `name` is on this host.
    pub fn file(&self, token: &str, name: &str) -> Result<PathBuf, ApiError> {
        let m = self.lock();
        let o = m.get(token).ok_or_else(|| Self::gone(token))?;
        o.files
            .iter()
            .find(|f| f.name == name)
            .map(|f| f.path.clone())
            .ok_or_else(|| ApiError::not_found(format!("the offered state has no file {name:?}")))
    }
}

/// Checks a manifest from another edge before anything is fetched.
pub fn check_manifest(m: &ExportManifest) -> Result<(), ApiError> {
    let bad = |s: String| ApiError::invalid(format!("the other edge's state: {s}"));
    if m.files.is_empty() || m.files.len() > MAX_FILES {
        return Err(bad(format!("{} files", m.files.len())));
    }
    let mut seen = std::collections::BTreeSet::new();
    for f in &m.files {
        let plain = !f.name.is_empty()
            && f.name.len() <= 32
            && f.name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
            && !f.name.starts_with('.');
        if !plain {
            return Err(bad(format!("{:?} is not a plain file name", f.name)));
        }
        if !seen.insert(f.name.clone()) {
            return Err(bad(format!("{:?} is listed twice", f.name)));
        }
        if f.size > MAX_FILE_BYTES {
            return Err(bad(format!("{} is {} bytes", f.name, f.size)));
        }
    }
    Ok(())
}

/// Fetches every file of an offered state into `staged` (a new directory), except those
/// `local` finds on this edge already; returns those.
pub async fn fetch(
    peers: &dyn Peers,
    from: &str,
    token: &str,
    staged: &Path,
    local: impl Fn(&SavedFile) -> Option<PathBuf>,
) -> Result<(ExportManifest, BTreeMap<String, PathBuf>), ApiError> {
    let raw = peers.get(from, &format!("/v1/exports/{token}")).await?;
    let manifest: ExportManifest = serde_json::from_slice(&raw).map_err(|e| {
        ApiError::internal(format!(
            "edge {from} sent a manifest that does not parse: {e}"
        ))
    })?;
    check_manifest(&manifest)?;
    std::fs::create_dir_all(staged)
        .map_err(|e| ApiError::internal(format!("creating {}: {e}", staged.display())))?;
    let mut have = BTreeMap::new();
    let t0 = Instant::now();
    let mut fetched = 0u64;
    for f in &manifest.files {
        if let Some(p) = local(f) {
            tracing::info!(file = %f.name, "already here: {}", p.display());
            have.insert(f.name.clone(), p);
            continue;
        }
        let got = peers
            .download(
                from,
                &format!("/v1/exports/{token}/files/{}", f.name),
                &staged.join(&f.name),
                f.size,
            )
            .await?;
        if got != f.size {
            return Err(ApiError::unavailable(format!(
                "edge {from} sent {got} bytes of {} instead of {}; try again",
                f.name, f.size
            )));
        }
        fetched += got;
    }
    tracing::info!(
        from,
        bytes = fetched,
        ms = t0.elapsed().as_millis() as u64,
        "state fetched"
    );
    Ok((manifest, have))
}

impl Edge {
    /// Gives the edge the other edges of its cluster (the `edge` role does, at start).
    pub fn set_peers(&self, peers: Arc<dyn Peers>) {
        let _ = self.peers.set(peers);
    }

    pub(crate) fn peers(&self) -> Result<Arc<dyn Peers>, ApiError> {
        self.peers.get().cloned().ok_or_else(|| {
            ApiError::invalid(
                "this edge is not part of a cluster, so there is no other edge to place it on; leave out edge",
            )
        })
    }

    /// States this edge offers to others (the `/v1/exports` routes serve them).
    pub fn offers(&self) -> &Offers {
        &self.offers
    }

    /// Offers the state saved in `dir` and asks `target` to import it; the offer closes
    /// when `target` has answered. Returns its answer.
    pub(crate) async fn hand_over(
        self: &Arc<Self>,
        peers: &Arc<dyn Peers>,
        backend: &Arc<dyn Backend>,
        dir: &Path,
        target: &str,
        kind: ImportKind,
        rec: &SandboxRecord,
    ) -> Result<Vec<u8>, ApiError> {
        let (b2, d2) = (backend.clone(), dir.to_path_buf());
        let files = blocking(move || b2.saved_files(&d2)).await??;
        let token = self.offers.open(files);
        let req = ImportRequest {
            kind,
            from: self.cfg.name.clone(),
            token: token.clone(),
            record: rec.clone(),
        };
        let body = serde_json::to_vec(&req).map_err(|e| ApiError::internal(e.to_string()))?;
        let r = peers
            .post(target, "/v1/imports", body, IMPORT_TIMEOUT)
            .await;
        self.offers.close(&token);
        r
    }

    /// Resumes sandbox `id` on edge `target`: paused to disk here first if it is not,
    /// pulled by `target`, resumed there under a new id; this edge's copy goes once it
    /// runs there (and stays, paused to disk, if it does not).
    pub async fn resume_on(
        self: &Arc<Self>,
        id: &str,
        target: &str,
    ) -> Result<SandboxInfo, ApiError> {
        let (edge, id, target) = (self.clone(), id.to_string(), target.to_string());
        finish(async move { edge.resume_on_now(&id, &target).await }).await
    }

    async fn resume_on_now(
        self: &Arc<Self>,
        id: &str,
        target: &str,
    ) -> Result<SandboxInfo, ApiError> {
        let e = self.entry(id)?;
        let backend = self.backend(&e.snapshot().backend)?;
        crate::backend::require(backend.as_ref(), Capability::Move, "resume it where it is")?;
        let peers = self.peers()?;
        if !e.snapshot().paused_to_disk {
            self.pause_now(id, true).await?;
        }
        let guard = e.op.lock().await;
        let rec = e.snapshot();
        if rec.state != SandboxState::Paused || !rec.paused_to_disk {
            return Err(ApiError::precondition(format!(
                "sandbox {id} was changed while it was being paused to disk ({:?}); try again",
                rec.state
            )));
        }
        let dir = self.paths(id).dir.join(SUSPENDED_DIR);
        let answer = self
            .hand_over(&peers, &backend, &dir, target, ImportKind::Resume, &rec)
            .await?;
        let info: SandboxInfo = serde_json::from_slice(&answer).map_err(|e| {
            ApiError::internal(format!("edge {target} answered the resume with: {e}"))
        })?;
        tracing::info!(sandbox = %id, to = %info.id, edge = %target, "sandbox moved");
        // It runs there now: this edge's copy goes.
        drop(guard);
        if let Err(err) = self.stop(id).await {
            tracing::warn!(sandbox = %id, "removing the moved sandbox: {}", err.message);
        }
        Ok(info)
    }

    /// Takes a state another edge offers: resumes a sandbox here, or makes fork copies.
    /// Answers a [`SandboxInfo`] or a [`dsec_common::api::ForkResponse`].
    pub async fn import(
        self: &Arc<Self>,
        req: ImportRequest,
    ) -> Result<serde_json::Value, ApiError> {
        let edge = self.clone();
        finish(async move { edge.import_now(req).await }).await
    }

    async fn import_now(
        self: &Arc<Self>,
        req: ImportRequest,
    ) -> Result<serde_json::Value, ApiError> {
        let peers = self.peers()?;
        if req.from == self.cfg.name {
            return Err(ApiError::invalid("an edge cannot import from itself"));
        }
        let backend = self.backend(&req.record.backend)?;
        crate::backend::require(
            backend.as_ref(),
            Capability::Move,
            "restore it on the edge that saved it",
        )?;
        let count = match &req.kind {
            ImportKind::Fork { count, labels } => crate::validate::fork_count(&ForkRequest {
                count: *count as f64,
                labels: labels.clone(),
                edge: None,
            })?,
            ImportKind::Resume => 1,
        };
        let staged = self.fork_tmp.join(format!("import-{}", random_hex(8)));
        let b2 = backend.clone();
        let fetched = fetch(&*peers, &req.from, &req.token, &staged, |f| {
            b2.local_copy(f)
        })
        .await;
        let r = match fetched {
            Ok((manifest, have)) => match req.kind {
                ImportKind::Resume => self
                    .take_over(&backend, req.record, &staged, manifest, have)
                    .await
                    .and_then(|i| to_value(&i)),
                ImportKind::Fork { labels, .. } => {
                    let (b2, st, files) = (backend.clone(), staged.clone(), manifest.files);
                    let adopted = blocking(move || b2.adopt_saved(&st, &st, &files, &have)).await?;
                    match adopted {
                        Ok(()) => {
                            let made = self
                                .copies(&backend, &req.record, &staged, count, &labels, false)
                                .await;
                            made.and_then(|m| to_value(&fork_response(&backend, m, 0)))
                        }
                        Err(e) => Err(e),
                    }
                }
            },
            Err(e) => Err(e),
        };
        if r.is_err() {
            self.discard_seed(&backend, &staged).await;
        }
        r
    }

    /// A sandbox paused to disk on another edge (its state fetched into `staged`) made
    /// this edge's, under a new id, and resumed.
    async fn take_over(
        self: &Arc<Self>,
        backend: &Arc<dyn Backend>,
        old: SandboxRecord,
        staged: &Path,
        manifest: ExportManifest,
        have: BTreeMap<String, PathBuf>,
    ) -> Result<SandboxInfo, ApiError> {
        let now = now_ms();
        let mut rec = SandboxRecord {
            id: SandboxId::generate(&self.cfg.name).to_string(),
            edge: self.cfg.name.clone(),
            state: SandboxState::Paused,
            paused_to_disk: true,
            paused_at_ms: old.paused_at_ms.or(Some(now)),
            moved_from: Some(old.id.clone()),
            pool_waiting: None,
            from_pool: None,
            port_token: port_token(),
            // Its rules come along; its place in this node's network is new.
            network: old.network.as_ref().map(|n| crate::registry::NetRecord {
                slot: None,
                ip: None,
                gateway: None,
                rules: n.rules.clone(),
                egress_headers: n.egress_headers.clone(),
            }),
            last_activity_ms: now,
            ..old
        };
        self.admit()?;
        self.reserve_quota(&rec).await?;
        let paths = self.paths(&rec.id);
        let home = paths.dir.join(SUSPENDED_DIR);
        let placed = async {
            self.registry.save(&rec)?;
            self.attach_network(&mut rec).await?;
            let (b2, st, h2) = (backend.clone(), staged.to_path_buf(), home.clone());
            blocking(move || b2.adopt_saved(&st, &h2, &manifest.files, &have)).await??;
            std::fs::rename(staged, &home)
                .map_err(|e| ApiError::internal(format!("moving the received state: {e}")))
        }
        .await;
        if let Err(e) = placed {
            if let (Some(n), Some(nr)) = (self.net.clone(), rec.network.clone()) {
                let id = rec.id.clone();
                let _ = blocking(move || n.detach(&id, nr.slot)).await;
            }
            let _ = std::fs::remove_dir_all(&paths.dir);
            self.release_quota(&rec.id).await;
            return Err(e);
        }
        let id = rec.id.clone();
        self.insert(rec);
        match self.resume_now(&id).await {
            Ok(info) => {
                tracing::info!(sandbox = %id, from = %info.moved_from.as_deref().unwrap_or(""), "sandbox taken over");
                Ok(info)
            }
            Err(e) => {
                let _ = self.stop(&id).await;
                Err(e)
            }
        }
    }
}

fn to_value<T: Serialize>(v: &T) -> Result<serde_json::Value, ApiError> {
    serde_json::to_value(v).map_err(|e| ApiError::internal(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, size: u64) -> SavedFile {
        SavedFile {
            name: name.into(),
            size,
            sha256: None,
            hint: None,
            path: PathBuf::new(),
        }
    }

    #[test]
    fn manifests_with_odd_names_or_sizes_are_refused() {
        let ok = ExportManifest {
            files: vec![file("vm.json", 10), file("ram", 1 << 30)],
        };
        assert!(check_manifest(&ok).is_ok());
        for bad in [
            vec![],
            vec![file("../etc", 1)],
            vec![file(".hidden", 1)],
            vec![file("a/b", 1)],
            vec![file("ram", 1), file("ram", 2)],
            vec![file("ram", MAX_FILE_BYTES + 1)],
        ] {
            assert!(
                check_manifest(&ExportManifest { files: bad.clone() }).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn files_travel_as_extents_and_keep_their_holes() {
        use std::io::{Read, Seek, SeekFrom, Write};
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("src");
        let mut f = std::fs::File::create(&src).unwrap();
        let size = 64u64 << 20;
        f.set_len(size).unwrap();
        for (off, byte) in [(4096u64, 1u8), (40 << 20, 2), (size - 4096, 3)] {
            f.seek(SeekFrom::Start(off)).unwrap();
            f.write_all(&vec![byte; 8192.min((size - off) as usize)])
                .unwrap();
        }
        drop(f);
        let f = std::fs::File::open(&src).unwrap();
        let ext = data_extents(&f, size);
        let carried: u64 = ext.iter().map(|e| e.1).sum();
        assert!(carried < 4 << 20, "{ext:?}");
        // The wire: each extent's header and bytes, fed in awkward pieces.
        let mut wire = Vec::new();
        let mut r = f;
        for (off, len) in &ext {
            wire.extend_from_slice(&off.to_be_bytes());
            wire.extend_from_slice(&len.to_be_bytes());
            let mut buf = vec![0u8; *len as usize];
            r.seek(SeekFrom::Start(*off)).unwrap();
            r.read_exact(&mut buf).unwrap();
            wire.extend_from_slice(&buf);
        }
        let dst = d.path().join("dst");
        let mut w = ExtentWriter::new(std::fs::File::create(&dst).unwrap(), size);
        for piece in wire.chunks(7777) {
            w.feed(piece).unwrap();
        }
        assert_eq!(w.finish().unwrap(), size);
        assert!(std::fs::read(&src).unwrap() == std::fs::read(&dst).unwrap());
        use std::os::unix::fs::MetadataExt;
        assert!(std::fs::metadata(&dst).unwrap().blocks() * 512 < 4 << 20);
        // Out of the file, out of order, or cut short: refused.
        let mut w = ExtentWriter::new(std::fs::File::create(&dst).unwrap(), 100);
        let mut bad = 90u64.to_be_bytes().to_vec();
        bad.extend_from_slice(&20u64.to_be_bytes());
        assert!(w.feed(&bad).is_err());
        let mut w = ExtentWriter::new(std::fs::File::create(&dst).unwrap(), 100);
        let mut cut = 0u64.to_be_bytes().to_vec();
        cut.extend_from_slice(&10u64.to_be_bytes());
        cut.extend_from_slice(b"abc");
        w.feed(&cut).unwrap();
        assert!(w.finish().is_err());
    }

    #[test]
    fn offers_name_only_their_files_and_close() {
        let o = Offers::default();
        let mut f = file("dev", 3);
        f.path = PathBuf::from("/x/dev");
        let t = o.open(vec![f]);
        assert_eq!(t.len(), 32);
        assert_eq!(o.file(&t, "dev").unwrap(), PathBuf::from("/x/dev"));
        assert!(o.file(&t, "ram").is_err());
        assert!(o.file("nope", "dev").is_err());
        assert_eq!(o.manifest(&t).unwrap().files.len(), 1);
        o.close(&t);
        assert!(o.manifest(&t).is_err());
    }
}
