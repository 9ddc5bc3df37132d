//! Volumes: file systems an edge keeps apart from any sandbox, for the sandboxes of a
//! project to mount (many at once; read-only or not) and for the volume file API to read
//! and write, until they are deleted. Each lives in `<state_dir>/volumes/<id>/`:
//! `volume.json`, its disk (`disk.rs`) and the mount point `mnt` (mounted in the
//! sandboxes' mount namespace). Its size counts against its project's disk quota from
//! its creation to its deletion.

pub mod disk;
pub mod fs;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use dsec_common::api::{Capability, CreateVolumeRequest, VolumeInfo, VolumeMount};
use dsec_common::id::SandboxId;
use dsec_common::{ApiError, ErrorCode, IoContext, IoFailure};

use crate::registry::now_ms;
use crate::{Edge, blocking};

/// What goes wrong with a volume's disk and its mounts.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("mkfs.ext4 failed ({status}): {stderr}")]
    Mkfs { status: String, stderr: String },
    #[error("no free loop device after 16 tries")]
    NoFreeLoop,
    #[error("{} has a NUL byte", .0.display())]
    NulInPath(PathBuf),
    #[error("volume {0} does not exist (it was deleted)")]
    Gone(String),
    #[error(transparent)]
    MountNs(#[from] crate::mountns::MountNsError),
    #[error(transparent)]
    Io(#[from] IoFailure),
}

impl crate::error::Coded for VolumeError {
    fn code(&self) -> ErrorCode {
        match self {
            VolumeError::Gone(_) => ErrorCode::NotFound,
            VolumeError::NulInPath(_) => ErrorCode::InvalidArgument,
            VolumeError::NoFreeLoop => ErrorCode::Unavailable,
            VolumeError::MountNs(e) => crate::error::Coded::code(e),
            VolumeError::Mkfs { .. } | VolumeError::Io(_) => ErrorCode::Internal,
        }
    }
}

const META: &str = "volume.json";
const DEFAULT_SIZE_MB: u64 = 1024;
const MAX_SIZE_MB: u64 = 1024 * 1024;
/// Most volumes one sandbox mounts.
pub const MAX_MOUNTS: usize = 16;

/// The volumes an edge keeps, by id.
#[derive(Default)]
pub(crate) struct Volumes {
    map: Mutex<HashMap<String, Kept>>,
}

#[derive(Clone)]
struct Kept {
    info: VolumeInfo,
    /// False while it is being made.
    ready: bool,
    /// Sandboxes being made with it and file calls under way ([`Users`]): a delete is
    /// refused while there are any, as while a sandbox mounts it.
    users: u32,
}

/// Most volumes one node keeps.
const MAX_VOLUMES: usize = 1024;

/// Volumes in use by a sandbox being made or a file call: each counted in its [`Kept`]
/// until this is dropped.
pub(crate) struct Users {
    edge: Arc<Edge>,
    ids: Vec<String>,
}

impl Drop for Users {
    fn drop(&mut self) {
        let mut map = self.edge.volumes.lock();
        for id in &self.ids {
            if let Some(k) = map.get_mut(id) {
                k.users = k.users.saturating_sub(1);
            }
        }
    }
}

impl Volumes {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Kept>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Unmounts (if mounted) and removes a volume's directory, whatever state it is in.
fn discard(dir: &Path) {
    if let Ok(ns) = crate::mountns::get() {
        let _ = ns.run(|| disk::unmount(dir));
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// The one answer for a volume a caller may not use, whether it exists or not.
pub fn missing(name_or_id: &str, project: &str) -> ApiError {
    ApiError::not_found(format!(
        "volume {name_or_id:?} does not exist in project {project} (create it first: POST /v1/volumes)"
    ))
}

/// A volume's name: `[a-z0-9][a-z0-9._-]*`, at most 63 characters.
fn check_name(name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
        && name.as_bytes()[0].is_ascii_alphanumeric();
    if !ok {
        return Err(ApiError::invalid(format!(
            "volume name {name:?} is not valid: use 1-63 characters of [a-z0-9._-], starting with a letter or digit"
        )));
    }
    Ok(())
}

/// Where a volume is mounted in a sandbox: an absolute path, no `.` or `..`, not the root
/// and not where the system's own mounts are.
pub(crate) fn check_mount_path(path: &str) -> Result<(), ApiError> {
    let bad = |why: &str| {
        Err(ApiError::invalid(format!(
            "volume mount path {path:?} {why}: use an absolute path such as \"/mnt/data\""
        )))
    };
    if !path.starts_with('/') || path.len() > 1024 || path.contains('\0') {
        return bad("is not an absolute path of at most 1024 bytes");
    }
    let parts: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
    if parts.is_empty() {
        return bad("is the sandbox's root");
    }
    if parts.iter().any(|c| *c == "." || *c == "..") {
        return bad("has . or .. in it");
    }
    if ["proc", "sys", "dev", ".dsec"].contains(&parts[0])
        || matches!(parts.as_slice(), ["etc", "hosts" | "resolv.conf"])
    {
        return bad("is where the system's own mounts are");
    }
    Ok(())
}

impl Edge {
    fn volumes_dir(&self) -> PathBuf {
        self.cfg.state_dir.join("volumes")
    }

    fn volume_dir(&self, id: &str) -> PathBuf {
        self.volumes_dir().join(id)
    }

    /// Reads the volumes kept in the state directory; removes those a crash left
    /// half-made or half-deleted. At start.
    pub(crate) fn load_volumes(&self) {
        let mut map = self.volumes.lock();
        for e in std::fs::read_dir(self.volumes_dir())
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            let meta = std::fs::read(e.path().join(META))
                .ok()
                .and_then(|b| serde_json::from_slice::<VolumeInfo>(&b).ok());
            match meta {
                Some(info) if info.id == name && !name.starts_with('.') => {
                    map.insert(
                        name,
                        Kept {
                            info,
                            ready: true,
                            users: 0,
                        },
                    );
                }
                _ => {
                    tracing::info!(dir = %e.path().display(), "removing a volume left half-made");
                    discard(&e.path());
                }
            }
        }
    }

    /// The ids of the volumes this edge keeps (each holds disk in its project).
    pub(crate) fn volume_ids(&self) -> Vec<String> {
        self.volumes.lock().keys().cloned().collect()
    }

    pub async fn create_volume(
        self: &Arc<Self>,
        req: CreateVolumeRequest,
    ) -> Result<VolumeInfo, ApiError> {
        check_name(&req.name)?;
        let size_mb = match req.size_mb {
            None => DEFAULT_SIZE_MB,
            Some(v)
                if v.is_finite()
                    && v.fract() == 0.0
                    && (16.0..=MAX_SIZE_MB as f64).contains(&v) =>
            {
                v as u64
            }
            Some(v) => {
                return Err(ApiError::invalid(format!(
                    "size_mb must be a whole number from 16 to {MAX_SIZE_MB} (got {v})"
                )));
            }
        };
        let project = req
            .project
            .clone()
            .unwrap_or_else(dsec_common::api::root_project);
        let info = VolumeInfo {
            id: SandboxId::generate(&self.cfg.name).to_string(),
            edge: self.cfg.name.clone(),
            name: req.name.clone(),
            project,
            size_mb,
            used_bytes: 0,
            created_at_ms: now_ms(),
        };
        {
            let mut map = self.volumes.lock();
            // Volumes are sparse files: what the node has promised them and not yet given
            // is kept free, so one project's volume filling up never fills the node's
            // disk under another's.
            let promised: u64 = map
                .values()
                .map(|k| {
                    use std::os::unix::fs::MetadataExt;
                    let given = std::fs::metadata(self.volume_dir(&k.info.id).join(disk::IMAGE))
                        .map(|m| m.blocks() * 512)
                        .unwrap_or(0);
                    (k.info.size_mb << 20).saturating_sub(given)
                })
                .sum();
            let free = crate::host::disk_free_mb(&self.cfg.state_dir);
            let spare = free.saturating_sub(promised >> 20);
            if size_mb > spare {
                return Err(ApiError::node_full(format!(
                    "node {} cannot give a volume of {size_mb} MiB now: the disk it has free is promised to the volumes it keeps; ask for less",
                    self.cfg.name
                )));
            }
            if map
                .values()
                .any(|k| k.info.project == info.project && k.info.name == info.name)
            {
                return Err(ApiError::new(
                    ErrorCode::AlreadyExists,
                    format!(
                        "project {} has a volume named {} already: use it, or choose another name",
                        info.project, info.name
                    ),
                ));
            }
            if map.len() >= MAX_VOLUMES {
                return Err(ApiError::node_full(format!(
                    "node {} keeps {MAX_VOLUMES} volumes, its most: delete some first",
                    self.cfg.name
                )));
            }
            map.insert(
                info.id.clone(),
                Kept {
                    info: info.clone(),
                    ready: false,
                    users: 0,
                },
            );
        }
        let (edge, i2) = (self.clone(), info.clone());
        let made = crate::finish(async move { edge.make_volume(&i2).await }).await;
        let mut map = self.volumes.lock();
        match made {
            Ok(()) => {
                if let Some(k) = map.get_mut(&info.id) {
                    k.ready = true;
                }
                tracing::info!(volume = %info.id, name = %info.name, project = %info.project, size_mb, "volume created");
                Ok(info)
            }
            Err(e) => {
                map.remove(&info.id);
                Err(e)
            }
        }
    }

    async fn make_volume(self: &Arc<Self>, info: &VolumeInfo) -> Result<(), ApiError> {
        let (s2, p2, n2, bytes) = (
            info.id.clone(),
            info.project.clone(),
            self.cfg.name.clone(),
            info.size_mb * 1024 * 1024,
        );
        self.quota(move |q| q.hold_disk(&s2, &p2, &n2, bytes))
            .await?
            .transpose()?;
        let dir = self.volume_dir(&info.id);
        let part = self.volumes_dir().join(format!(".{}.part", info.id));
        let (i2, d2, p2) = (info.clone(), dir.clone(), part.clone());
        let made = blocking(move || -> Result<(), ApiError> {
            std::fs::create_dir_all(&p2)
                .map_err(|e| ApiError::internal(format!("creating {}: {e}", p2.display())))?;
            disk::make(&p2, i2.size_mb)?;
            let bytes =
                serde_json::to_vec_pretty(&i2).map_err(|e| ApiError::internal(e.to_string()))?;
            dsec_common::private::write(&p2.join(META), &bytes)
                .map_err(|e| ApiError::internal(format!("writing {META}: {e}")))?;
            std::fs::rename(&p2, &d2)
                .map_err(|e| ApiError::internal(format!("keeping the volume: {e}")))?;
            Ok(crate::mountns::within(|| disk::mount(&d2, true))?)
        })
        .await
        .and_then(|r| r);
        if let Err(e) = made {
            let (d2, p2) = (dir, part);
            let _ = blocking(move || {
                discard(&p2);
                discard(&d2);
            })
            .await;
            self.release_quota(&info.id).await;
            return Err(e);
        }
        Ok(())
    }

    /// Every volume this edge keeps, with what each holds now.
    pub async fn list_volumes(self: &Arc<Self>) -> Vec<VolumeInfo> {
        let mut out: Vec<VolumeInfo> = self
            .volumes
            .lock()
            .values()
            .filter(|k| k.ready)
            .map(|k| k.info.clone())
            .collect();
        out.sort_by(|a, b| a.created_at_ms.cmp(&b.created_at_ms).then(a.id.cmp(&b.id)));
        let edge = self.clone();
        blocking(move || {
            let ids: Vec<String> = out.iter().map(|v| v.id.clone()).collect();
            for (v, used) in out.iter_mut().zip(edge.volumes_used(&ids)) {
                v.used_bytes = used;
            }
            out
        })
        .await
        .unwrap_or_default()
    }

    /// Bytes each of volumes `ids` holds (0 for one not mounted: nothing has written it
    /// since the node started), the mount table read once for all.
    fn volumes_used(&self, ids: &[String]) -> Vec<u64> {
        let targets: Vec<PathBuf> = ids
            .iter()
            .map(|id| self.volume_dir(id).join(disk::MOUNT))
            .collect();
        let Ok(ns) = crate::mountns::get() else {
            return vec![0; ids.len()];
        };
        let info = ns.run(disk::mount_table).unwrap_or_default();
        targets
            .iter()
            .map(|t| {
                if crate::mountns::has_mount_within(&info, t) {
                    disk::used_bytes(&ns.view(t))
                } else {
                    0
                }
            })
            .collect()
    }

    fn volume_info(&self, id: &str) -> Result<VolumeInfo, ApiError> {
        self.volumes
            .lock()
            .get(id)
            .filter(|k| k.ready)
            .map(|k| k.info.clone())
            .ok_or_else(|| {
                ApiError::not_found(format!(
                    "volume {id} does not exist (it may have been deleted)"
                ))
            })
    }

    pub async fn get_volume(self: &Arc<Self>, id: &str) -> Result<VolumeInfo, ApiError> {
        let mut info = self.volume_info(id)?;
        let (edge, i2) = (self.clone(), id.to_string());
        info.used_bytes = blocking(move || edge.volumes_used(&[i2]))
            .await?
            .first()
            .copied()
            .unwrap_or(0);
        Ok(info)
    }

    /// The volume `name_or_id` means for a sandbox of `project`: a volume id, or the name
    /// of a volume of `project` or, failing that, of its nearest parent that has one.
    pub fn resolve_volume(&self, name_or_id: &str, project: &str) -> Result<VolumeInfo, ApiError> {
        let map = self.volumes.lock();
        if let Some(k) = map.get(name_or_id).filter(|k| k.ready) {
            return Ok(k.info.clone());
        }
        let mut p = project.to_string();
        loop {
            if let Some(k) = map
                .values()
                .find(|k| k.ready && k.info.project == p && k.info.name == name_or_id)
            {
                return Ok(k.info.clone());
            }
            match p.rsplit_once('/') {
                Some((up, _)) => p = up.to_string(),
                None => break,
            }
        }
        Err(missing(name_or_id, project))
    }

    /// Counts volumes `ids` as in use until the answer is dropped (a sandbox being made
    /// with them, a file call); 404 for one that does not exist or is being deleted.
    pub(crate) fn use_volumes(self: &Arc<Self>, ids: &[String]) -> Result<Users, ApiError> {
        let mut map = self.volumes.lock();
        if let Some(gone) = ids
            .iter()
            .find(|id| !map.get(id.as_str()).is_some_and(|k| k.ready))
        {
            return Err(ApiError::not_found(format!(
                "volume {gone} does not exist (it may have been deleted)"
            )));
        }
        for id in ids {
            if let Some(k) = map.get_mut(id) {
                k.users += 1;
            }
        }
        Ok(Users {
            edge: self.clone(),
            ids: ids.to_vec(),
        })
    }

    /// The sandboxes (live, paused included) that mount volume `id`.
    fn volume_users(&self, id: &str) -> Vec<String> {
        self.sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|e| e.snapshot())
            .filter(|r| r.volumes.iter().any(|v| v.volume == id))
            .map(|r| r.id)
            .collect()
    }

    /// Deletes a volume and everything in it; refused while a sandbox mounts it.
    pub async fn delete_volume(self: &Arc<Self>, id: &str) -> Result<(), ApiError> {
        self.volume_info(id)?;
        let kept = {
            // Under the lock that sandboxes being made and file calls count themselves
            // under: none can start using it between the check and the removal.
            let mut map = self.volumes.lock();
            let mounting = self.volume_users(id);
            let busy = map.get(id).map_or(0, |k| k.users);
            if !mounting.is_empty() || busy > 0 {
                return Err(ApiError::precondition(
                    format!(
                        "volume {id} is in use ({} sandbox(es) mount it{}{}): stop them first",
                        mounting.len(),
                        if mounting.is_empty() { "" } else { ": " },
                        mounting.into_iter().take(3).collect::<Vec<_>>().join(", ")
                    ) + &if busy > 0 {
                        format!("; {busy} sandbox create(s) or file call(s) are using it")
                    } else {
                        String::new()
                    },
                ));
            }
            match map.remove(id) {
                Some(k) => k,
                None => return Err(ApiError::not_found(format!("volume {id} does not exist"))),
            }
        };
        let dir = self.volume_dir(id);
        let gone = self.volumes_dir().join(format!(".{id}.gone"));
        let removed = blocking(move || -> Result<(), VolumeError> {
            crate::mountns::within(|| disk::unmount(&dir))?;
            std::fs::rename(&dir, &gone).ctx(|| "removing the volume".into())?;
            let _ = std::fs::remove_dir_all(&gone);
            Ok(())
        })
        .await?;
        if let Err(e) = removed {
            self.volumes.lock().insert(id.to_string(), kept);
            return Err(e.into());
        }
        self.release_quota(id).await;
        tracing::info!(volume = %id, "volume deleted");
        Ok(())
    }

    /// The volume's root as the node reaches it (mounted first if it is not), open for
    /// the file API.
    pub(crate) async fn volume_root(
        self: &Arc<Self>,
        id: &str,
    ) -> Result<std::os::fd::OwnedFd, ApiError> {
        self.volume_info(id)?;
        let dir = self.volume_dir(id);
        blocking(move || -> Result<_, ApiError> {
            let ns = crate::mountns::get()?;
            ns.run(|| disk::mount(&dir, false))??;
            fs::open_root(&ns.view(&dir.join(disk::MOUNT)))
                .map_err(|e| ApiError::internal(format!("opening the volume: {e}")))
        })
        .await?
    }

    /// A create's volumes, each resolved to its id and checked: known, of a project the
    /// sandbox's is in or over, mounted at a path of its own.
    pub(crate) fn sandbox_volumes(
        &self,
        backend: &dyn crate::backend::Backend,
        project: &str,
        asked: &[VolumeMount],
    ) -> Result<Vec<VolumeMount>, ApiError> {
        if asked.is_empty() {
            return Ok(Vec::new());
        }
        volumes_allowed(backend.name())?;
        if asked.len() > MAX_MOUNTS {
            return Err(ApiError::invalid(format!(
                "a sandbox mounts at most {MAX_MOUNTS} volumes (asked for {})",
                asked.len()
            )));
        }
        let mut out: Vec<VolumeMount> = Vec::new();
        for m in asked {
            check_mount_path(&m.path)?;
            let path = format!("/{}", fs::clean(&m.path)?);
            if out.iter().any(|o| {
                o.path == path
                    || path.starts_with(&format!("{}/", o.path))
                    || o.path.starts_with(&format!("{path}/"))
            }) {
                return Err(ApiError::invalid(format!(
                    "volume mount path {path} is, or is inside, another volume's mount path"
                )));
            }
            let v = self.resolve_volume(&m.volume, project)?;
            if !(dsec_common::project::within(project, &v.project)
                || dsec_common::project::within(&v.project, project))
            {
                return Err(missing(&m.volume, project));
            }
            out.push(VolumeMount {
                volume: v.id,
                path,
                read_only: m.read_only,
            });
        }
        Ok(out)
    }
}

/// Whether sandboxes of `backend` may mount volumes; a create's argument its backend
/// cannot take is a 400, as for any other. Checked before the volumes are looked up.
pub fn volumes_allowed(backend: &str) -> Result<(), ApiError> {
    crate::backend::require_named(backend, Capability::Volumes, "leave out volumes").map_err(|e| {
        ApiError::invalid(format!(
            "{} (Firecracker has no shared-filesystem device)",
            e.message
        ))
    })
}

/// Where each of a sandbox's volumes is mounted in the sandboxes' mount namespace (each
/// mounted first if it is not). Runs in that namespace.
pub(crate) fn mount_points(
    state_dir: &Path,
    mounts: &[VolumeMount],
) -> Result<Vec<PathBuf>, VolumeError> {
    mounts
        .iter()
        .map(|m| {
            let dir = state_dir.join("volumes").join(&m.volume);
            if !dir.join(META).is_file() {
                return Err(VolumeError::Gone(m.volume.clone()));
            }
            disk::mount(&dir, false)?;
            Ok(dir.join(disk::MOUNT))
        })
        .collect()
}

/// The virtio-fs tag of a VM's `i`th volume.
pub fn share_tag(i: usize) -> String {
    format!("dsec_v{i}")
}

/// What a VM's agent mounts: each volume's device at its path.
pub fn guest_mounts(mounts: &[VolumeMount]) -> Vec<dsec_common::channel::GuestMount> {
    mounts
        .iter()
        .enumerate()
        .map(|(i, m)| dsec_common::channel::GuestMount {
            tag: share_tag(i),
            path: m.path.clone(),
            read_only: m.read_only,
        })
        .collect()
}

/// A VM's view of its volumes in the sandboxes' mount namespace: each volume bound at
/// `<shares>/<i>` (read-only where the sandbox mounts it so: the guest cannot undo that),
/// the directory a virtio-fs daemon serves. Runs in that namespace; what is bound already
/// stays. Returns the directories.
pub(crate) fn bind_shares(
    state_dir: &Path,
    mounts: &[VolumeMount],
    shares: &Path,
) -> Result<Vec<PathBuf>, VolumeError> {
    let sources = mount_points(state_dir, mounts)?;
    let table = std::fs::read_to_string("/proc/thread-self/mountinfo").unwrap_or_default();
    let mut out = Vec::with_capacity(mounts.len());
    for (i, (m, src)) in mounts.iter().zip(sources).enumerate() {
        let dst = shares.join(i.to_string());
        out.push(dst.clone());
        let seen = crate::mountns::mountinfo_path(&dst);
        if table
            .lines()
            .any(|l| l.split(' ').nth(4) == Some(seen.as_str()))
        {
            continue;
        }
        std::fs::create_dir_all(&dst).ctx(|| format!("creating {}", dst.display()))?;
        let c = |p: &Path| {
            std::ffi::CString::new(p.as_os_str().as_encoded_bytes())
                .map_err(|_| VolumeError::NulInPath(p.to_path_buf()))
        };
        let (s, d) = (c(&src)?, c(&dst)?);
        let bind = |flags: libc::c_ulong| {
            // SAFETY: mount(2) with NUL-terminated paths that outlive the call.
            let rc = unsafe {
                libc::mount(
                    s.as_ptr(),
                    d.as_ptr(),
                    std::ptr::null(),
                    flags,
                    std::ptr::null(),
                )
            };
            if rc != 0 {
                return Err(VolumeError::from(IoFailure::last_os(format!(
                    "binding volume {} at {}",
                    m.volume,
                    dst.display()
                ))));
            }
            Ok(())
        };
        bind(libc::MS_BIND)?;
        let fixed = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_NOSUID | libc::MS_NODEV;
        let ro = if m.read_only { libc::MS_RDONLY } else { 0 };
        if let Err(e) = bind(fixed | ro) {
            unbind_shares(shares);
            return Err(e);
        }
    }
    Ok(out)
}

/// Undoes [`bind_shares`] (in the sandboxes' mount namespace).
pub(crate) fn unbind_shares(shares: &Path) {
    let Ok(dir) = std::fs::read_dir(shares) else {
        return;
    };
    for e in dir.flatten() {
        if let Ok(c) = std::ffi::CString::new(e.path().as_os_str().as_encoded_bytes()) {
            // SAFETY: umount2 with a NUL-terminated path.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
        let _ = std::fs::remove_dir(e.path());
    }
    let _ = std::fs::remove_dir(shares);
}

/// A volume file being read: its size and its bytes, chunk by chunk.
pub struct VolumeRead {
    file: tokio::fs::File,
    pub size: u64,
    _users: Users,
}

impl VolumeRead {
    /// The next chunk; `None` at the end.
    pub async fn chunk(&mut self) -> Option<Result<bytes::Bytes, ApiError>> {
        use tokio::io::AsyncReadExt;
        let mut buf = vec![0u8; 256 * 1024];
        match self.file.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some(Ok(bytes::Bytes::from(buf)))
            }
            Err(e) => Some(Err(ApiError::internal(format!("reading the volume: {e}")))),
        }
    }
}

impl Edge {
    /// Runs `f` on the root of volume `id` (a blocking thread).
    async fn in_volume<T: Send + 'static>(
        self: &Arc<Self>,
        id: &str,
        path: &str,
        f: impl FnOnce(&std::os::fd::OwnedFd, &str) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let rel = fs::clean(path)?;
        let users = self.use_volumes(&[id.to_string()])?;
        let root = self.volume_root(id).await?;
        let r = blocking(move || f(&root, &rel)).await?;
        drop(users);
        r
    }

    pub async fn volume_stat(
        self: &Arc<Self>,
        id: &str,
        path: &str,
    ) -> Result<dsec_common::api::VolumeEntry, ApiError> {
        self.in_volume(id, path, fs::stat).await
    }

    pub async fn volume_list(
        self: &Arc<Self>,
        id: &str,
        path: &str,
        depth: u32,
    ) -> Result<Vec<dsec_common::api::VolumeEntry>, ApiError> {
        self.in_volume(id, path, move |r, p| fs::list(r, p, depth))
            .await
    }

    pub async fn volume_mkdir(
        self: &Arc<Self>,
        id: &str,
        path: &str,
        parents: bool,
        owner: fs::Owner,
    ) -> Result<dsec_common::api::VolumeEntry, ApiError> {
        self.in_volume(id, path, move |r, p| fs::mkdir(r, p, parents, owner))
            .await
    }

    pub async fn volume_update(
        self: &Arc<Self>,
        id: &str,
        path: &str,
        owner: fs::Owner,
    ) -> Result<dsec_common::api::VolumeEntry, ApiError> {
        self.in_volume(id, path, move |r, p| fs::update(r, p, owner))
            .await
    }

    pub async fn volume_remove(self: &Arc<Self>, id: &str, path: &str) -> Result<(), ApiError> {
        self.in_volume(id, path, fs::remove).await
    }

    pub async fn volume_read(
        self: &Arc<Self>,
        id: &str,
        path: &str,
    ) -> Result<VolumeRead, ApiError> {
        let users = self.use_volumes(&[id.to_string()])?;
        let (f, size) = self.in_volume(id, path, fs::open_read).await?;
        Ok(VolumeRead {
            file: tokio::fs::File::from_std(f),
            size,
            _users: users,
        })
    }

    /// Writes `body` to file `path` of volume `id` (made, with the directories above it,
    /// when missing; replaced when there).
    pub async fn volume_write<S, E>(
        self: &Arc<Self>,
        id: &str,
        path: &str,
        owner: fs::Owner,
        mut body: S,
    ) -> Result<dsec_common::api::VolumeEntry, ApiError>
    where
        S: futures_util::Stream<Item = Result<bytes::Bytes, E>> + Unpin + Send + 'static,
        E: std::fmt::Display + Send + 'static,
    {
        use futures_util::StreamExt;
        use tokio::io::AsyncWriteExt;
        let _users = self.use_volumes(&[id.to_string()])?;
        let mut up = self
            .in_volume(id, path, move |r, p| fs::open_write(r, p, owner))
            .await?;
        let shown = format!("/{}", fs::clean(path)?);
        let mut f = tokio::fs::File::from_std(up.file().map_err(|e| fs::error(e, &shown))?);
        // Any failure from here drops `up`, which removes what was written so far.
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| ApiError::invalid(format!("reading the upload: {e}")))?;
            f.write_all(&chunk)
                .await
                .map_err(|e| fs::error(e, &shown))?;
        }
        f.flush().await.map_err(|e| fs::error(e, &shown))?;
        drop(f);
        blocking(move || up.commit()).await??;
        self.volume_stat(id, path).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_paths_are_places_of_the_sandboxs_own() {
        for ok in [
            "/mnt/data",
            "/data",
            "/home/user/work",
            "/etc/app",
            "/srv/v/",
        ] {
            assert!(check_mount_path(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "/",
            "//",
            "relative",
            "/proc",
            "/proc/1",
            "/sys/x",
            "/dev",
            "/.dsec",
            "/a/../etc",
            "/a/./b",
            "/etc/hosts",
            "/etc/resolv.conf",
            "/a\0b",
        ] {
            assert!(check_mount_path(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn names_are_short_lowercase_tokens() {
        for ok in ["data", "a", "v1.2_x-y", &"a".repeat(63)] {
            assert!(check_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "Data",
            "-x",
            ".x",
            "a/b",
            "a b",
            "../x",
            &"a".repeat(64),
        ] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }
}
