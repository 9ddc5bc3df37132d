//! Commit ("pack"): a sandbox's filesystem changes become one more layer on top of its
//! image, tagged with a new reference that any later sandbox (container or vm) can use.
//!
//! - container: the sandbox is frozen, its overlay upper copied into the image store's
//!   `tmp/` (`cp -a`, keeping whiteouts and opaque markers), thawed; the copy is then
//!   cleaned by [`dsec_image::import::normalize_layer`].
//! - vm: the upper is a tmpfs inside the guest, so the agent streams it
//!   ([`Request::ExportTree`] of `/.dsec/rw/upper`) and the edge rebuilds it with
//!   [`dsec_image::import::TreeImport`], which trusts nothing in the stream. The guest
//!   keeps running meanwhile (a frozen guest has no agent to answer).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dsec_common::api::{CommitRequest, CommitResponse, SandboxState};
use dsec_common::channel::{CHUNK, Request, Response};
use dsec_common::tree::MAX_HEADER;
use dsec_common::{ApiError, ErrorCode};
use dsec_image::import::{TreeImport, TreeLimits, normalize_layer};
use dsec_image::store::remove_tree;
use dsec_image::{ImageError, ImageRef, Manifest};

use crate::registry::SandboxRecord;
use crate::{Edge, blocking, channel};

/// Where a VM guest's `/init` leaves the overlay's writable layer for the agent.
const VM_UPPER: &str = "/.dsec/rw/upper";
/// Longest wait for the next frame of a VM's export.
const EXPORT_FRAME_TIMEOUT: Duration = Duration::from_secs(120);
/// Largest frame an export sends: a file chunk or an entry header. Bigger ones are refused
/// before they queue, so the queue to the writer holds a few MiB at most.
const MAX_EXPORT_FRAME: usize = if CHUNK > MAX_HEADER {
    CHUNK
} else {
    MAX_HEADER
};
/// An overlay mount's options must fit in one page; the container backend needs room
/// for the upper and work directories besides the layers.
const MOUNT_OPTIONS_MAX: usize = 4000;

/// An image store error as an API error.
pub(crate) fn image_error(e: ImageError) -> ApiError {
    let code = match &e {
        ImageError::BadReference(_) => ErrorCode::InvalidArgument,
        ImageError::NotFound(_) => ErrorCode::NotFound,
        ImageError::AlreadyExists(_) => ErrorCode::AlreadyExists,
        ImageError::Uncommittable(_) | ImageError::Export(_) => ErrorCode::FailedPrecondition,
        ImageError::Io { source, .. }
            if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) =>
        {
            ErrorCode::ResourceExhausted
        }
        _ => ErrorCode::Internal,
    };
    ApiError::new(code, e.to_string())
}

/// Removes a temporary tree when dropped, unless it was handed on.
struct TempTree(Option<PathBuf>);

impl TempTree {
    fn path(&self) -> &Path {
        self.0.as_deref().unwrap_or(Path::new(""))
    }
    fn keep(mut self) -> PathBuf {
        self.0.take().unwrap_or_default()
    }
}

impl Drop for TempTree {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            // Off the async workers: a big tree takes a while to remove.
            std::thread::spawn(move || {
                let _ = remove_tree(&p);
            });
        }
    }
}

/// The id under which a committed image holds disk in its project's quota: this edge's
/// name, then a digest of the reference (a commit over the same name replaces it).
pub(crate) fn image_hold_id(edge: &str, r: &ImageRef) -> String {
    let d = dsec_image::digest::sha256_hex(r.to_string().as_bytes());
    format!("{edge}-image-{}", &d[..16])
}

/// Layers that something of the edge with state directory `state_dir` still uses: its
/// sandboxes (running, paused, on disk) and its kept snapshots (whose restores start from
/// them). Image garbage collection never removes these.
pub fn layers_in_use(state_dir: &std::path::Path) -> std::collections::HashSet<String> {
    let mut used = std::collections::HashSet::new();
    let sandboxes = state_dir.join("sandboxes");
    if let Ok(reg) = crate::registry::Registry::open(&sandboxes) {
        used.extend(reg.load_all().into_iter().flatten().flat_map(|r| r.layers));
    }
    used.extend(crate::snapshots::kept_layers(&state_dir.join("snapshots")));
    used
}

impl Edge {
    /// Removes image `r` and the layers nothing uses any more (no other image, sandbox
    /// or snapshot), and gives back the disk its commit, build or pull held in its
    /// project's quota. Returns how many layers it freed.
    pub async fn remove_image(self: &Arc<Self>, r: &ImageRef) -> Result<usize, ApiError> {
        let (images, state_dir, r2) = (self.images.clone(), self.cfg.state_dir.clone(), r.clone());
        let freed = blocking(move || images.remove(&r2, &layers_in_use(&state_dir)))
            .await?
            .map_err(image_error)?;
        self.release_quota(&image_hold_id(&self.cfg.name, r)).await;
        tracing::info!(image = %r, freed, "image removed");
        Ok(freed)
    }

    /// The hold ids of the images in the store (see [`image_hold_id`]): commits and
    /// builds on this edge hold disk under them; for other images they hold nothing.
    pub(crate) fn image_hold_ids(&self) -> Vec<String> {
        self.images
            .list()
            .unwrap_or_default()
            .into_iter()
            .filter_map(|i| ImageRef::parse(&i.reference).ok())
            .map(|r| image_hold_id(&self.cfg.name, &r))
            .collect()
    }

    /// Commits sandbox `id`'s filesystem changes as image `req.image`.
    pub async fn commit(
        self: &Arc<Self>,
        id: &str,
        req: CommitRequest,
    ) -> Result<CommitResponse, ApiError> {
        let target = ImageRef::parse(&req.image).map_err(|e| ApiError::invalid(e.to_string()))?;
        let e = self.entry(id)?;
        let src = e.snapshot();
        let backend = self.backend(&src.backend)?;
        if !req.overwrite && self.images.exists(&target) {
            return Err(image_error(ImageError::AlreadyExists(target.to_string())));
        }
        let base = self.base_manifest(&src).await?;
        self.check_layer_count(&src, &base)?;
        let images = self.images.clone();
        let tmp = TempTree(Some(
            blocking(move || images.temp_dir("commit"))
                .await?
                .map_err(image_error)?,
        ));
        let paused_ms;
        {
            let _g = e.op.lock().await;
            let state = e.snapshot().state;
            if state != SandboxState::Running {
                return Err(ApiError::precondition(format!(
                    "sandbox {id} is {}, not running; only a running sandbox can be committed",
                    format!("{state:?}").to_lowercase()
                )));
            }
            self.touch(&e);
            if backend.changes_in_guest() {
                paused_ms = 0;
                let limits = TreeLimits {
                    max_bytes: (src.limits.memory_mb + src.limits.disk_mb).max(64) << 20,
                    ..TreeLimits::default()
                };
                self.export_from_agent(&self.paths(id).channel, tmp.path(), limits)
                    .await?;
            } else {
                let t0 = Instant::now();
                self.copy_container_changes(&src, backend, tmp.path())
                    .await?;
                paused_ms = t0.elapsed().as_millis() as u64;
            }
        }
        // The layer counts against the disk quota of the image's project (replacing what
        // an image of that name committed before held).
        let hold = image_hold_id(&self.cfg.name, &target);
        let existed = self.images.exists(&target);
        if self.quotas.is_some() {
            let t = tmp.path().to_path_buf();
            let bytes = blocking(move || crate::snapshots::dir_size(&t)).await?;
            let (h, p, n) = (hold.clone(), target.project(), self.cfg.name.clone());
            self.quota(move |q| q.hold_disk(&h, &p, &n, bytes))
                .await?
                .transpose()?;
        }
        let images = self.images.clone();
        let dir = tmp.keep();
        let (target2, overwrite) = (target.clone(), req.overwrite);
        // No sandbox id: readers of the image in other projects must not learn one.
        let source = format!(
            "commit of a sandbox of project {} (from {})",
            src.project, src.image
        );
        let committed = blocking(move || {
            let r = images.commit(&base, &dir, &target2, overwrite, source);
            if r.is_err() {
                let _ = remove_tree(&dir);
            }
            r
        })
        .await?;
        let (digest, manifest) = match committed {
            Ok(c) => c,
            Err(e) => {
                if !existed {
                    self.release_quota(&hold).await;
                }
                return Err(image_error(e));
            }
        };
        tracing::info!(sandbox = %id, image = %target, digest = %digest, "sandbox committed");
        Ok(CommitResponse {
            image: target.to_string(),
            digest,
            layers: manifest.layers,
            size_bytes: manifest.size_bytes,
            paused_ms,
        })
    }

    /// A container sandbox's filesystem changes, in layer form, into `dest`: the sandbox is
    /// frozen while its upper is copied.
    pub(crate) async fn copy_container_changes(
        &self,
        src: &SandboxRecord,
        backend: Arc<dyn crate::backend::Backend>,
        dest: &Path,
    ) -> Result<(), ApiError> {
        let (r2, p2, d2) = (src.clone(), self.paths(&src.id), dest.to_path_buf());
        blocking(move || {
            backend.pause(&r2)?;
            let r = backend.copy_changes(&r2, &p2, &d2);
            let resumed = backend.resume(&r2);
            r.and(resumed)
        })
        .await??;
        let d2 = dest.to_path_buf();
        blocking(move || normalize_layer(&d2))
            .await?
            .map_err(image_error)
    }

    /// The manifest the sandbox was made from (by digest: its reference may have moved).
    async fn base_manifest(&self, src: &SandboxRecord) -> Result<Manifest, ApiError> {
        let images = self.images.clone();
        let digest = src.image_digest.clone();
        let m = blocking(move || images.manifest(&digest)).await?;
        match m {
            Ok(m) if m.layers == src.layers => Ok(m),
            Ok(_) => Err(ApiError::internal(format!(
                "the manifest of image {} no longer matches sandbox {}'s layers",
                src.image, src.id
            ))),
            Err(ImageError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                Err(ApiError::precondition(format!(
                    "image {} was removed from the image store after sandbox {} started, so there is no base to commit onto",
                    src.image, src.id
                )))
            }
            Err(e) => Err(image_error(e)),
        }
    }

    /// Refuses a commit whose image would have too many layers for a container's overlay
    /// mount (the limit that binds first).
    fn check_layer_count(&self, src: &SandboxRecord, base: &Manifest) -> Result<(), ApiError> {
        let sandbox_dir = self.registry.dir(&src.id).display().to_string().len();
        let layer = self
            .images
            .layer_path(&"0".repeat(64))
            .display()
            .to_string()
            .len();
        let need = (base.layers.len() + 1) * (layer + 1) + 2 * (sandbox_dir + 16) + 40;
        if need >= MOUNT_OPTIONS_MAX {
            return Err(ApiError::precondition(format!(
                "image {} has {} layers, the most a sandbox's overlay mount can stack, and a commit adds one; commit a sandbox of an image with fewer layers (build it with fewer steps)",
                src.image,
                base.layers.len()
            )));
        }
        Ok(())
    }

    /// Has the agent stream `VM_UPPER` and rebuilds it in `dest`.
    async fn export_from_agent(
        &self,
        sock: &Path,
        dest: &Path,
        limits: TreeLimits,
    ) -> Result<(), ApiError> {
        let req = Request::ExportTree {
            path: VM_UPPER.into(),
        };
        let mut conn = tokio::time::timeout(EXPORT_FRAME_TIMEOUT, async {
            let mut c = channel::Conn::open(sock, &req).await?;
            match c.reply().await? {
                Response::Ok => Ok(c),
                other => Err(channel::unexpected(&other)),
            }
        })
        .await
        .map_err(|_| no_answer())??;
        // Files are written off the async workers; frames go to that thread in order.
        let (tx, mut rx) = tokio::sync::mpsc::channel::<(u8, Vec<u8>)>(16);
        let dest = dest.to_path_buf();
        let writer = tokio::task::spawn_blocking(move || {
            let mut imp = TreeImport::new(&dest, limits)?;
            while let Some((kind, payload)) = rx.blocking_recv() {
                if imp.frame(kind, &payload)? {
                    return imp.finish();
                }
            }
            Err(ImageError::BadTree(
                "the stream ended before the end of the tree".into(),
            ))
        });
        let mut read_err = None;
        // Until the agent closes the connection or the writer stops (done or failed).
        while !tx.is_closed() {
            match tokio::time::timeout(EXPORT_FRAME_TIMEOUT, conn.frame()).await {
                Ok(Ok(Some((_, payload)))) if payload.len() > MAX_EXPORT_FRAME => {
                    read_err = Some(image_error(ImageError::BadTree(format!(
                        "a frame of {} bytes, over the {MAX_EXPORT_FRAME} an export uses",
                        payload.len()
                    ))));
                    break;
                }
                Ok(Ok(Some(f))) => {
                    // A closed receiver: the writer finished or failed; it says which.
                    if tx.send(f).await.is_err() {
                        break;
                    }
                }
                Ok(Ok(None)) => break,
                Ok(Err(e)) => {
                    read_err = Some(e);
                    break;
                }
                Err(_) => {
                    read_err = Some(no_answer());
                    break;
                }
            }
        }
        drop(tx);
        drop(conn);
        let written = writer
            .await
            .map_err(|e| ApiError::internal(format!("commit worker failed: {e}")))?;
        match (written, read_err) {
            (Ok(stats), _) => {
                tracing::debug!(
                    entries = stats.entries,
                    bytes = stats.bytes,
                    "vm changes received"
                );
                Ok(())
            }
            // The connection broke first: that is the cause, not the short stream.
            (Err(ImageError::BadTree(_)), Some(e)) => Err(e),
            (Err(e), _) => Err(image_error(e)),
        }
    }
}

fn no_answer() -> ApiError {
    ApiError::new(
        ErrorCode::DeadlineExceeded,
        format!(
            "the sandbox agent sent nothing for {} s while exporting its files",
            EXPORT_FRAME_TIMEOUT.as_secs()
        ),
    )
}
