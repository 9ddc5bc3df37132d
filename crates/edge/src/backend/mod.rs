//! The backend interface every engine implements: containers, QEMU VMs and Firecracker
//! microVMs. Methods block (they drive external runtimes); the edge calls them off the
//! async workers.

pub mod container;
pub(crate) mod detached;
pub mod microvm;
pub(crate) mod moved_disk;
pub mod saved;
pub mod vm;

use std::path::{Path, PathBuf};

use dsec_common::api::{BackendStatus, Capability};
use dsec_common::{ApiError, ErrorCode, IoContext, IoFailure};

use crate::registry::SandboxRecord;

/// Paths the edge gives a backend for one sandbox.
/// Where in a sandbox's directory a sandbox paused to disk keeps its saved state.
pub const SUSPENDED_DIR: &str = "suspended";

/// One file of a saved state (a snapshot or a sandbox paused to disk) as it travels to
/// another edge.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SavedFile {
    /// What the file is: `vm.json`, `dev`, `full`, `ram`, `disk` of a QEMU VM;
    /// `fc.json`, `vmstate`, `mem`, `disk` of a microVM.
    pub name: String,
    pub size: u64,
    /// Given for files the other edge may already hold (a VM's root disk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// Its file name on the sending edge (where the receiver may have the same file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
    /// Where it is on the sending edge.
    #[serde(skip)]
    pub path: PathBuf,
}

impl SavedFile {
    /// A file of a saved state that travels whole (no local copy is looked for).
    pub fn at(name: &str, path: PathBuf) -> Result<SavedFile, StateError> {
        let size = std::fs::metadata(&path)
            .ctx(|| format!("{}", path.display()))?
            .len();
        Ok(SavedFile {
            name: name.into(),
            size,
            sha256: None,
            hint: None,
            path,
        })
    }
}

/// No agent binary to put in sandboxes: every backend needs one.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "no statically linked dsec-aether found (looked at {looked}); build it with `make aether` or set aether_binary"
)]
pub struct NoAether {
    pub looked: String,
}

/// Finds the static `dsec-aether`: the configured path, `$DSEC_AETHER`, next to the running
/// binary, or the static build output of this workspace.
pub fn find_aether(configured: Option<&Path>) -> Result<PathBuf, NoAether> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = configured {
        candidates.push(p.to_path_buf());
    } else {
        if let Some(p) = std::env::var_os("DSEC_AETHER") {
            candidates.push(p.into());
        }
        if let Ok(exe) = std::env::current_exe()
            && let Some(dir) = exe.parent()
        {
            candidates.push(dir.join("dsec-aether"));
            candidates.push(dir.join("../x86_64-unknown-linux-gnu/release/dsec-aether"));
            candidates.push(dir.join("../../x86_64-unknown-linux-gnu/release/dsec-aether"));
        }
        candidates.push("/usr/local/lib/dsec/dsec-aether".into());
    }
    for c in &candidates {
        if c.is_file()
            && container::is_static_elf(c)
            && let Ok(p) = c.canonicalize()
        {
            return Ok(p);
        }
    }
    Err(NoAether {
        looked: candidates
            .iter()
            .map(|c| c.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
    })
}

/// What goes wrong with a saved state's files (written, read, sent to or received from
/// another edge) and with the daemons the VM backends start detached.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("{}: {source}", path.display())]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    /// A saved or received state that this edge cannot restore: what is wrong with it.
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Image(#[from] dsec_image::ImageError),
    #[error(transparent)]
    Io(#[from] IoFailure),
}

impl crate::error::Coded for StateError {
    fn code(&self) -> ErrorCode {
        match self {
            StateError::Invalid(_) => ErrorCode::InvalidArgument,
            _ => ErrorCode::Internal,
        }
    }
}

pub struct SandboxPaths {
    /// The sandbox's private directory.
    pub dir: PathBuf,
    /// Where the channel socket to aether lives (on the host).
    pub channel: PathBuf,
}

/// Refuses (501, naming the capability and what to do instead) a request the backend
/// cannot serve, before any of it is done.
pub fn require(b: &dyn Backend, cap: Capability, instead: &str) -> Result<(), ApiError> {
    require_of(b.name(), b.capabilities(), cap, instead)
}

/// [`require`] for the backend named `name` (known by name, as where a request is read
/// before its backend is looked up).
pub fn require_named(name: &str, cap: Capability, instead: &str) -> Result<(), ApiError> {
    require_of(name, capabilities_of(name), cap, instead)
}

fn require_of(
    name: &str,
    has: &[Capability],
    cap: Capability,
    instead: &str,
) -> Result<(), ApiError> {
    if has.contains(&cap) {
        return Ok(());
    }
    let with: Vec<&str> = ["container", "vm", "microvm"]
        .into_iter()
        .filter(|n| capabilities_of(n).contains(&cap))
        .collect();
    Err(ApiError::unimplemented(format!(
        "the {} backend cannot {} (capability {}; backends that can: {}); {instead}",
        name,
        cap.describe(),
        cap.name(),
        with.join(", ")
    )))
}

/// Each backend's capabilities, known without the backend running (for messages, and
/// for checks made where only the backend's name is at hand).
pub fn capabilities_of(backend: &str) -> &'static [Capability] {
    match backend {
        "container" => container::BACKEND_CAPABILITIES,
        "vm" => vm::BACKEND_CAPABILITIES,
        "microvm" => microvm::BACKEND_CAPABILITIES,
        _ => &[],
    }
}

pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    fn status(&self) -> BackendStatus;
    /// Whether the sandbox's filesystem changes live inside a guest (a VM's writable
    /// layer is a tmpfs in its kernel), so a commit asks its agent for them.
    fn changes_in_guest(&self) -> bool {
        false
    }
    /// What this backend can do that others may not; the edge refuses a request that
    /// needs a capability missing here before doing anything (see [`require`]).
    fn capabilities(&self) -> &'static [Capability];
    /// Whether fork carries process memory.
    fn fork_preserves_memory(&self) -> bool {
        self.capabilities().contains(&Capability::ForkMemory)
    }
    /// Whether agent connections may be kept open between calls. Not for VMs: a kept
    /// connection would be inside the guest's memory when it is snapshotted or forked.
    fn keeps_agent_connections(&self) -> bool {
        false
    }
    /// Starts the sandbox; `seed` is a filesystem snapshot (from [`Backend::snapshot_fs`])
    /// to start from. Must leave nothing behind on error.
    fn create(
        &self,
        rec: &SandboxRecord,
        paths: &SandboxPaths,
        seed: Option<&Path>,
    ) -> Result<(), ApiError>;
    fn is_alive(&self, rec: &SandboxRecord) -> bool;
    /// Whether the sandbox's process is known to have exited, from a check cheap enough
    /// to repeat while its agent starts (a VMM's pid; `false` where there is none).
    fn exited(&self, _rec: &SandboxRecord) -> bool {
        false
    }
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
    /// Saves what [`Backend::snapshot`] does without the caller pausing the sandbox
    /// around it, where the backend can (a VM migrated live into a template), and returns
    /// how long the sandbox was stopped, in ms. `None`: not for this sandbox; the caller
    /// pauses around [`Backend::snapshot`].
    fn snapshot_live(&self, _rec: &SandboxRecord, _dest: &Path) -> Option<Result<u64, ApiError>> {
        None
    }
    /// Lays out in `dest` where [`Backend::snapshot_live`] of the running `rec` will put
    /// its snapshot, so a fork's copies can start (`create` with `dest` as their seed)
    /// while it is taken: they wait for it before they load it, and start over from it
    /// if it came out otherwise (a capture that fell back to a pause). `false`: not
    /// this backend or sandbox; the copies start once the snapshot is done.
    fn plan_snapshot(&self, _rec: &SandboxRecord, _dest: &Path) -> bool {
        false
    }
    /// The part of [`Backend::snapshot`] that needs no pause, done once the caller has
    /// resumed the sandbox (a microVM's Diff laid over a copy of the memory it is a diff
    /// of).
    fn finish_snapshot(&self, _rec: &SandboxRecord, _dest: &Path) -> Result<(), ApiError> {
        Ok(())
    }
    /// Moves what [`Backend::snapshot`] kept outside `dest` into it, for a snapshot kept
    /// for later (not only for the copies of one fork).
    fn keep_snapshot(&self, _dest: &Path) -> Result<(), ApiError> {
        Ok(())
    }
    /// Frees what [`Backend::snapshot`] kept outside `dest` (the caller removes `dest`).
    fn discard_snapshot(&self, _dest: &Path) {}
    /// Ends a paused sandbox's processes, freeing its memory: a VM's memory is written to
    /// disk first; a container keeps only its files.
    fn suspend(&self, _rec: &SandboxRecord, _paths: &SandboxPaths) -> Result<(), ApiError> {
        Err(ApiError::unimplemented(format!(
            "the {} backend cannot pause to disk; pause in place instead (to_disk: false)",
            self.name()
        )))
    }
    /// Starts a sandbox [`Backend::suspend`]ed to disk again: a VM where it stopped, a
    /// container afresh on its files.
    fn wake(&self, _rec: &SandboxRecord, _paths: &SandboxPaths) -> Result<(), ApiError> {
        Err(ApiError::unimplemented(format!(
            "the {} backend cannot resume from disk",
            self.name()
        )))
    }
    /// The files another edge needs to restore the state saved in `saved` (by
    /// [`Backend::snapshot`] or [`Backend::suspend`]).
    fn saved_files(&self, _saved: &Path) -> Result<Vec<SavedFile>, ApiError> {
        Err(ApiError::unimplemented(format!(
            "the {} backend cannot move a sandbox's state to another edge (VM backends can)",
            self.name()
        )))
    }
    /// A file this edge already holds with the content of `f`, so it need not be fetched.
    fn local_copy(&self, _f: &SavedFile) -> Option<PathBuf> {
        None
    }
    /// Makes a state fetched from another edge into `staged` restorable here, once
    /// `staged` has been moved to `home`: checks it, puts shared files in their place
    /// and points its description at them. `have`: files found with [`Backend::local_copy`].
    fn adopt_saved(
        &self,
        _staged: &Path,
        _home: &Path,
        _files: &[SavedFile],
        _have: &std::collections::BTreeMap<String, PathBuf>,
    ) -> Result<(), ApiError> {
        Err(ApiError::unimplemented(format!(
            "the {} backend cannot restore a state from another edge",
            self.name()
        )))
    }
    /// Kills every process and removes every mount, cgroup and file of the sandbox.
    /// Idempotent: also cleans up after a half-finished create.
    fn destroy(&self, rec: &SandboxRecord, paths: &SandboxPaths) -> Result<(), ApiError>;
    /// OOM kills counted for the sandbox so far.
    fn oom_kills(&self, rec: &SandboxRecord) -> u64;
    /// The sandbox's first process on the host, whose exit is the sandbox's death (watched
    /// by [`crate::deaths`]); None where the agent is polled instead.
    fn main_pid(&self, _rec: &SandboxRecord) -> Option<i32> {
        None
    }
    /// Periodic upkeep of a running sandbox's files on the host (a VM's console log is
    /// kept under its cap).
    fn housekeeping(&self, _paths: &SandboxPaths) {}
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
