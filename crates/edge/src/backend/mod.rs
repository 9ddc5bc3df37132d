//! The backend interface every engine implements: containers, QEMU VMs and Firecracker
//! microVMs. Methods block (they drive external runtimes); the edge calls them off the
//! async workers.

pub mod container;
pub mod microvm;
pub mod vm;

use std::path::{Path, PathBuf};

use dsec_common::ApiError;
use dsec_common::api::BackendStatus;

use crate::registry::SandboxRecord;

/// Paths the edge gives a backend for one sandbox.
pub struct SandboxPaths {
    /// The sandbox's private directory.
    pub dir: PathBuf,
    /// Where the channel socket to aether lives (on the host).
    pub channel: PathBuf,
}

pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    fn status(&self) -> BackendStatus;
    /// Whether fork carries process memory.
    fn fork_preserves_memory(&self) -> bool;
    /// Starts the sandbox; `seed` is a filesystem snapshot (from [`Backend::snapshot_fs`])
    /// to start from. Must leave nothing behind on error.
    fn create(
        &self,
        rec: &SandboxRecord,
        paths: &SandboxPaths,
        seed: Option<&Path>,
    ) -> Result<(), ApiError>;
    fn is_alive(&self, rec: &SandboxRecord) -> bool;
    fn pause(&self, rec: &SandboxRecord) -> Result<(), ApiError>;
    fn resume(&self, rec: &SandboxRecord) -> Result<(), ApiError>;
    /// Saves what fork copies start from into `dest` (the caller pauses around it): the
    /// sandbox's writable filesystem, and a VM's memory and device state.
    fn snapshot(
        &self,
        rec: &SandboxRecord,
        paths: &SandboxPaths,
        dest: &Path,
    ) -> Result<(), ApiError>;
    /// Frees what [`Backend::snapshot`] kept outside `dest` (the caller removes `dest`).
    fn discard_snapshot(&self, _dest: &Path) {}
    /// Writes a paused sandbox to disk and ends its processes, freeing its memory.
    fn suspend(&self, _rec: &SandboxRecord, _paths: &SandboxPaths) -> Result<(), ApiError> {
        Err(ApiError::unimplemented(format!(
            "the {} backend cannot pause to disk; pause in place instead (to_disk: false)",
            self.name()
        )))
    }
    /// Starts a sandbox [`Backend::suspend`]ed to disk again where it stopped.
    fn wake(&self, _rec: &SandboxRecord, _paths: &SandboxPaths) -> Result<(), ApiError> {
        Err(ApiError::unimplemented(format!(
            "the {} backend cannot resume from disk",
            self.name()
        )))
    }
    /// Kills every process and removes every mount, cgroup and file of the sandbox.
    /// Idempotent: also cleans up after a half-finished create.
    fn destroy(&self, rec: &SandboxRecord, paths: &SandboxPaths) -> Result<(), ApiError>;
    /// OOM kills counted for the sandbox so far.
    fn oom_kills(&self, rec: &SandboxRecord) -> u64;
    /// What the sandbox printed while starting (a VM's console), to explain a start that
    /// failed.
    fn start_log(&self, _paths: &SandboxPaths) -> Option<String> {
        None
    }
    /// How long aether may take to answer after [`Backend::create`] returns.
    fn start_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(20)
    }
    /// Copies the sandbox's filesystem changes (its writable layer, overlayfs whiteouts
    /// and opaque markers included) into `dest`, for a commit; the caller pauses around
    /// it. A VM keeps its changes inside the guest: the edge asks its agent instead.
    fn copy_changes(
        &self,
        _rec: &SandboxRecord,
        _paths: &SandboxPaths,
        _dest: &Path,
    ) -> Result<(), ApiError> {
        Err(ApiError::unimplemented(format!(
            "the {} backend cannot commit a sandbox",
            self.name()
        )))
    }
}
