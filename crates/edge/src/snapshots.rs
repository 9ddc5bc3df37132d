//! Snapshots kept for later: a running sandbox's state saved under an id (a VM's memory
//! and devices, a container's writable layer) that any number of new sandboxes start
//! from, here or on another edge, until it is deleted. Each lives in
//! `<state_dir>/snapshots/<id>/`: `meta.json` and the backend's `state/`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use dsec_common::ApiError;
use dsec_common::api::{ForkRequest, ForkResponse, SnapshotInfo};
use dsec_common::id::SandboxId;
use serde::{Deserialize, Serialize};

use crate::registry::{SandboxRecord, now_ms};
use crate::{Edge, blocking, finish, fork_response, transfer, validate};

/// What is kept next to a snapshot's state.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Meta {
    info: SnapshotInfo,
    /// The sandbox as it was: what restored sandboxes are made like.
    template: SandboxRecord,
}

/// The image layers of the snapshots kept under `dir` (each one's sandbox template).
pub(crate) fn kept_layers(dir: &Path) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read(e.path().join("meta.json")).ok())
        .filter_map(|b| serde_json::from_slice::<Meta>(&b).ok())
        .flat_map(|m| m.template.layers)
        .collect()
}

/// Restores hold a snapshot (shared), a delete waits for them (exclusive).
#[derive(Default)]
pub(crate) struct Locks {
    map: std::sync::Mutex<HashMap<String, Arc<tokio::sync::RwLock<()>>>>,
}

impl Locks {
    fn get(&self, id: &str) -> Arc<tokio::sync::RwLock<()>> {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(id.to_string())
            .or_default()
            .clone()
    }

    fn forget(&self, id: &str) {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
    }
}

pub(crate) fn dir_size(p: &Path) -> u64 {
    // Allocated bytes: memory files are mostly holes.
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let mut stack = vec![p.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(m) = e.path().symlink_metadata() else {
                continue;
            };
            if m.is_dir() {
                stack.push(e.path());
            } else {
                total += m.blocks() * 512;
            }
        }
    }
    total
}

impl Edge {
    fn snapshots_dir(&self) -> PathBuf {
        self.cfg.state_dir.join("snapshots")
    }

    fn snapshot_dir(&self, id: &str) -> Result<PathBuf, ApiError> {
        let parsed = SandboxId::parse(id).map_err(|_| {
            ApiError::invalid(format!(
                "'{id}' is not a snapshot id: expected <edge>-<12 characters of [0-9a-z]>, as returned by snapshot"
            ))
        })?;
        if parsed.edge() != self.cfg.name {
            return Err(ApiError::not_found(format!(
                "snapshot {id} is kept by edge {}, not this one ({})",
                parsed.edge(),
                self.cfg.name
            )));
        }
        Ok(self.snapshots_dir().join(id))
    }

    fn read_meta(&self, id: &str) -> Result<Meta, ApiError> {
        let dir = self.snapshot_dir(id)?;
        let bytes = std::fs::read(dir.join("meta.json")).map_err(|_| {
            ApiError::not_found(format!(
                "snapshot {id} does not exist (it may have been deleted)"
            ))
        })?;
        serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::internal(format!("snapshot {id}'s meta.json: {e}")))
    }

    /// Saves running sandbox `id` as a new snapshot (it pauses briefly).
    /// Takes a snapshot of sandbox `id`; its labels are the sandbox's with `labels` over
    /// them (a name to find it by, say).
    pub async fn create_snapshot(
        self: &Arc<Self>,
        id: &str,
        labels: std::collections::BTreeMap<String, String>,
    ) -> Result<SnapshotInfo, ApiError> {
        let e = self.entry(id)?;
        let mut all = e.snapshot().labels;
        all.extend(labels);
        validate::labels(&all)?;
        let (edge, id) = (self.clone(), id.to_string());
        finish(async move { edge.create_snapshot_now(&id, all).await }).await
    }

    async fn create_snapshot_now(
        self: &Arc<Self>,
        id: &str,
        labels: std::collections::BTreeMap<String, String>,
    ) -> Result<SnapshotInfo, ApiError> {
        let e = self.entry(id)?;
        let src = e.snapshot();
        let backend = self.backend(&src.backend)?;
        let sid = SandboxId::generate(&self.cfg.name).to_string();
        let dir = self.snapshots_dir().join(&sid);
        let part = self.snapshots_dir().join(format!(".{sid}.part"));
        std::fs::create_dir_all(&part)
            .map_err(|e| ApiError::internal(format!("creating {}: {e}", part.display())))?;
        let state = part.join("state");
        let made = async {
            let paused_ms = self
                .save_running(&e, &backend, &state, "snapshotted")
                .await?;
            let (b2, s2) = (backend.clone(), state.clone());
            blocking(move || b2.keep_snapshot(&s2)).await??;
            let info = SnapshotInfo {
                id: sid.clone(),
                edge: self.cfg.name.clone(),
                source: src.id.clone(),
                backend: src.backend.clone(),
                image: src.image.clone(),
                project: src.project.clone(),
                labels,
                created_at_ms: now_ms(),
                memory_preserved: backend.fork_preserves_memory(),
                size_bytes: dir_size(&state),
                source_paused_ms: paused_ms,
            };
            let meta = Meta {
                info: info.clone(),
                template: src.clone(),
            };
            let bytes =
                serde_json::to_vec_pretty(&meta).map_err(|e| ApiError::internal(e.to_string()))?;
            std::fs::write(part.join("meta.json"), bytes)
                .map_err(|e| ApiError::internal(format!("writing meta.json: {e}")))?;
            // What it keeps counts against its project's disk quota from now on.
            let (s2, p2, n2, size) = (
                sid.clone(),
                src.project.clone(),
                self.cfg.name.clone(),
                info.size_bytes,
            );
            self.quota(move |q| q.hold_disk(&s2, &p2, &n2, size))
                .await?
                .transpose()?;
            if let Err(e) = std::fs::rename(&part, &dir) {
                self.release_quota(&sid).await;
                return Err(ApiError::internal(format!("keeping the snapshot: {e}")));
            }
            Ok(info)
        }
        .await;
        if made.is_err() {
            self.discard_seed(&backend, &state).await;
            let _ = std::fs::remove_dir_all(&part);
        }
        if let Ok(info) = &made {
            tracing::info!(sandbox = %id, snapshot = %info.id, bytes = info.size_bytes, "snapshot kept");
            if let Ok(e) = self.entry_any(id) {
                self.event(
                    "snapshotted",
                    &e.snapshot(),
                    None,
                    &[("snapshot", info.id.clone().into())],
                );
            }
        }
        made
    }

    /// The ids of the snapshots this edge keeps (each holds disk in its project).
    pub(crate) fn snapshot_ids(&self) -> Vec<String> {
        std::fs::read_dir(self.snapshots_dir())
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().join("meta.json").is_file())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with('.'))
            .collect()
    }

    /// Every snapshot this edge keeps.
    pub fn list_snapshots(&self) -> Vec<SnapshotInfo> {
        let mut out: Vec<SnapshotInfo> = std::fs::read_dir(self.snapshots_dir())
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                self.read_meta(&name).ok().map(|m| m.info)
            })
            .collect();
        out.sort_by(|a, b| a.created_at_ms.cmp(&b.created_at_ms).then(a.id.cmp(&b.id)));
        out
    }

    pub fn get_snapshot(&self, id: &str) -> Result<SnapshotInfo, ApiError> {
        Ok(self.read_meta(id)?.info)
    }

    /// Deletes a snapshot once no restore is reading it (sandboxes restored from it keep
    /// running: they hold what they use).
    pub async fn delete_snapshot(self: &Arc<Self>, id: &str) -> Result<(), ApiError> {
        let meta = self.read_meta(id)?;
        let lock = self.snapshot_locks.get(id);
        let _g = lock.write().await;
        let dir = self.snapshot_dir(id)?;
        let backend = self.backend(&meta.info.backend)?;
        let gone = self.snapshots_dir().join(format!(".{id}.gone"));
        std::fs::rename(&dir, &gone)
            .map_err(|e| ApiError::internal(format!("removing snapshot {id}: {e}")))?;
        self.discard_seed(&backend, &gone.join("state")).await;
        let _ = blocking(move || std::fs::remove_dir_all(&gone)).await;
        self.release_quota(id).await;
        self.snapshot_locks.forget(id);
        tracing::info!(snapshot = %id, "snapshot deleted");
        Ok(())
    }

    /// Starts `req.count` sandboxes from a snapshot, here or (with `req.edge`) on another
    /// edge, which pulls it.
    pub async fn restore_snapshot(
        self: &Arc<Self>,
        id: &str,
        req: ForkRequest,
    ) -> Result<ForkResponse, ApiError> {
        let (edge, id) = (self.clone(), id.to_string());
        finish(async move { edge.restore_snapshot_now(&id, req).await }).await
    }

    async fn restore_snapshot_now(
        self: &Arc<Self>,
        id: &str,
        req: ForkRequest,
    ) -> Result<ForkResponse, ApiError> {
        let count = validate::fork_count(&req)?;
        let meta = self.read_meta(id)?;
        let backend = self.backend(&meta.info.backend)?;
        let lock = self.snapshot_locks.get(id);
        let _g = lock.read().await;
        let state = self.snapshot_dir(id)?.join("state");
        if !state.is_dir() {
            return Err(ApiError::not_found(format!(
                "snapshot {id} does not exist (it was deleted)"
            )));
        }
        match req.edge.clone().filter(|e| *e != self.cfg.name) {
            Some(target) => {
                let peers = self.peers()?;
                let answer = self
                    .hand_over(
                        &peers,
                        &backend,
                        &state,
                        &target,
                        transfer::ImportKind::Fork {
                            count,
                            labels: req.labels.clone(),
                        },
                        &meta.template,
                    )
                    .await?;
                serde_json::from_slice(&answer).map_err(|e| {
                    ApiError::internal(format!("edge {target} answered the restore with: {e}"))
                })
            }
            None => {
                let made = self
                    .copies(&backend, &meta.template, &state, count, &req.labels, true)
                    .await?;
                Ok(fork_response(&backend, made, 0))
            }
        }
    }

    /// Removes snapshots a crash left half-made or half-deleted.
    pub(crate) fn sweep_snapshots(&self) {
        for e in std::fs::read_dir(self.snapshots_dir())
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}
