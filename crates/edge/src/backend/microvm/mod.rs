//! The `microvm` backend: a Firecracker (v1.16 line) VMM per sandbox, on hosts with
//! hardware KVM. The guest is the one the `vm` backend boots (Debian's cloud kernel, as the
//! ELF vmlinux Firecracker needs, the project's initramfs, the image's layers as
//! read-only EROFS disks under an overlay with a tmpfs writable layer, aether as init), but
//! its channel is vsock: aether listens on a vsock port and `dsec-aether vsockproxy`
//! carries the sandbox's `aether.sock` through Firecracker's vsock unix socket.
//!
//! Each VMM runs in its own network namespace (a tap of the same name and addresses in
//! every one, see [`netns`]) and its own cgroup, jailed ([`jail`]: a mount namespace
//! holding only its own files, as an unprivileged user), with Firecracker's seccomp
//! filters (never `--no-seccomp`). Fork snapshots the paused source (`vmstate` plus a
//! memory file on the RAM directory) and starts each copy in a fresh process with
//! `PUT /snapshot/load`, the memory file mapped MAP_PRIVATE (`mem_backend` File) so copies
//! share unmodified pages, and its own vsock socket (`vsock_override`). Firecracker and the proxy run detached
//! (pids in the sandbox directory), so a restarted edge re-adopts running VMs.

pub mod api;
mod boot;
mod calls;

pub use calls::{
    BootPlan, api_paused, boot_calls, load_calls, pause_call, resume_call, snapshot_call,
};
pub mod jail;
pub mod netns;
pub mod probe;
pub mod snapshot;

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use dsec_common::api::{BackendStatus, Capability};
use dsec_common::{ApiError, ErrorCode, IoContext, IoFailure};
use dsec_image::{ImageStore, guest};

use super::detached::{
    alive, copy_sparse, kill, proc_state, read_json, read_pid, spawn_detached, write_json,
};
use super::vm::Accel;
use super::{Backend, SandboxPaths, SavedFile, moved_disk};
use crate::cgroup::{self, CgroupMode};
use crate::registry::SandboxRecord;
use api::Client;
use probe::Firecracker;
use snapshot::SavedVm;

/// See [`crate::backend::Backend::capabilities`].
pub const BACKEND_CAPABILITIES: &[Capability] = &[
    Capability::ForkMemory,
    Capability::PauseToDisk,
    Capability::Move,
];

/// Files in the sandbox directory. The VMM's own (its sockets, what it writes) are in
/// [`VMM_DIR`], the one directory of the sandbox its jail can see and write.
const VMM_DIR: &str = "vmm";
const API_SOCK: &str = "vmm/fc.api";
const VSOCK_UDS: &str = "vmm/fc.vsock";
/// The empty directory the jail's root is mounted on (in the VMM's namespace only).
const JAIL_ROOT: &str = "jail";
const FC_PID: &str = "firecracker.pid";
const PROXY_PID: &str = "vsockproxy.pid";
const CONSOLE: &str = "console.log";
const INFO: &str = "microvm.json";

/// The guest's vsock context id (any value ≥ 3; each VM has its own device).
const GUEST_CID: u32 = 3;
/// How long saving or loading a snapshot may take (a Full snapshot writes all memory).
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(120);
/// Firecracker's API socket appears within milliseconds of its start.
const API_READY: Duration = Duration::from_secs(10);
/// How long a killed VMM may take to leave its cgroup (it unmaps all guest memory).
const VMM_EXIT: Duration = Duration::from_secs(30);
/// Memory a VMM needs beyond its guest's, in its cgroup.
const VMM_OVERHEAD_MB: u64 = 128;

/// What goes wrong running a Firecracker microVM.
#[derive(Debug, thiserror::Error)]
pub enum MicrovmError {
    /// The backend cannot run here (no hardware KVM, no Firecracker, an unsupported
    /// version, a missing user): what to install or set.
    #[error("{0}")]
    Unavailable(String),
    /// What the VM or its saved state is cannot be done as asked.
    #[error("{0}")]
    Refused(String),
    #[error("{what} took over {secs} s")]
    Timeout { what: String, secs: u64 },
    #[error("{} has a NUL byte", .0.display())]
    NulInPath(PathBuf),
    #[error(transparent)]
    Api(#[from] api::ApiCallError),
    #[error(transparent)]
    State(#[from] crate::backend::StateError),
    #[error(transparent)]
    Net(#[from] crate::net::NetError),
    #[error(transparent)]
    Netlink(#[from] crate::net::NetlinkError),
    #[error(transparent)]
    Image(#[from] dsec_image::ImageError),
    #[error(transparent)]
    Io(#[from] IoFailure),
}

impl crate::error::Coded for MicrovmError {
    fn code(&self) -> ErrorCode {
        match self {
            MicrovmError::Unavailable(_) => ErrorCode::Unavailable,
            MicrovmError::Refused(_) => ErrorCode::FailedPrecondition,
            MicrovmError::Timeout { .. } => ErrorCode::Unavailable,
            MicrovmError::Api(api::ApiCallError::Connect { .. }) => ErrorCode::Unavailable,
            MicrovmError::State(e) => e.code(),
            MicrovmError::Net(e) => e.code(),
            _ => ErrorCode::Internal,
        }
    }
}

/// Where the backend's settings come from (`[edge]` keys).
#[derive(Debug, Clone, Default)]
pub struct MicrovmConfig {
    /// `firecracker_binary`; `None`: `firecracker` on PATH, /usr/local/bin, /usr/bin.
    pub binary: Option<PathBuf>,
    /// `firecracker_diff_snapshots`: track dirty pages and take Diff snapshots on fork.
    pub diff_snapshots: bool,
    /// `firecracker_run_as`: the user the jailed VMM runs as; empty: root, which can leave
    /// the jail's chroot (for debugging only).
    pub run_as: String,
}

/// The VM's own description (`<sandbox dir>/microvm.json`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct VmInfo {
    /// Its root disks (the stage of [`guest::ensure_root_disks`] on top, or a single ext4
    /// disk in a VM saved before roots were layered), memory and vCPUs.
    #[serde(flatten)]
    guest: crate::backend::saved::SavedGuest,
    track_dirty_pages: bool,
}

/// How long the threads of a VMM may take to stop on SIGSTOP (a vCPU leaves KVM_RUN).
const STOP_WITHIN: Duration = Duration::from_secs(10);

/// Sends `sig` (SIGSTOP or SIGCONT) to the process `pid`; for SIGSTOP, waits until every
/// one of its threads is stopped, so that the guest no longer runs when this returns.
fn signal_threads(pid: i32, sig: i32, within: Duration) -> Result<(), MicrovmError> {
    // SAFETY: a signal to the VMM whose pid the sandbox directory records.
    if unsafe { libc::kill(pid, sig) } != 0 {
        return Err(IoFailure::last_os(format!("signalling the microVM's process {pid}")).into());
    }
    if sig != libc::SIGSTOP {
        return Ok(());
    }
    let t0 = std::time::Instant::now();
    loop {
        let running = std::fs::read_dir(format!("/proc/{pid}/task"))
            .ctx(|| format!("reading the threads of {pid}"))?
            .flatten()
            .filter(|t| proc_state(&t.path().join("stat")).is_some_and(|s| s != 'T' && s != 't'))
            .count();
        if running == 0 {
            return Ok(());
        }
        if t0.elapsed() > within {
            return Err(MicrovmError::Timeout {
                what: format!("stopping {running} threads of the microVM's process {pid}"),
                secs: within.as_secs(),
            });
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Moves a file the VMM wrote to where it belongs: a rename, or a sparse copy across
/// filesystems.
fn move_file(from: &Path, to: &Path) -> Result<(), MicrovmError> {
    match std::fs::rename(from, to) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
            copy_sparse(from, to)?;
            let _ = std::fs::remove_file(from);
            Ok(())
        }
        Err(e) => {
            Err(IoFailure::new(format!("moving {} to {}", from.display(), to.display()), e).into())
        }
    }
}

/// vCPUs for a core limit: Firecracker takes 1 or an even count up to 32.
fn vcpus(cores: f64) -> u64 {
    let n = cores.ceil().max(1.0) as u64;
    if n == 1 { 1 } else { (n + n % 2).min(32) }
}

/// What the host lacks for this backend, if anything.
fn kvm_check() -> Result<(), MicrovmError> {
    match Accel::detect() {
        Accel::Kvm => Ok(()),
        Accel::Tcg => Err(MicrovmError::Unavailable(
            "no hardware KVM on this host: Firecracker needs /dev/kvm backed by kvm_intel or kvm_amd on a CPU with vmx/svm (a paravirtual or emulating KVM module cannot run its guests); use backend \"vm\" (QEMU, with TCG emulation here) or \"container\"".into(),
        )),
    }
}

pub struct MicrovmBackend {
    fc: Result<Firecracker, MicrovmError>,
    kvm: Result<(), MicrovmError>,
    aether: Result<PathBuf, crate::backend::NoAether>,
    images: ImageStore,
    sandboxes: PathBuf,
    ram_dir: PathBuf,
    mode: CgroupMode,
    diff_snapshots: bool,
    run_as: Result<Option<jail::RunAs>, MicrovmError>,
    /// The guest vmlinux and initramfs, found (or built) on the first create.
    boot: Mutex<Option<(PathBuf, PathBuf)>>,
}

impl MicrovmBackend {
    pub fn new(
        cfg: &MicrovmConfig,
        aether: Result<PathBuf, crate::backend::NoAether>,
        images: ImageStore,
        sandboxes: &Path,
        ram_dir: &Path,
        mode: CgroupMode,
    ) -> MicrovmBackend {
        let fc = probe::find(cfg.binary.as_deref()).and_then(|p| probe::probe(&p));
        match &fc {
            Ok(f) => tracing::info!(
                "microvm backend: Firecracker {} at {} (snapshot format {})",
                f.version,
                f.path.display(),
                f.snapshot_version
            ),
            Err(e) => tracing::debug!("microvm backend: {e}"),
        }
        MicrovmBackend {
            fc,
            kvm: kvm_check(),
            aether,
            images,
            sandboxes: sandboxes.to_path_buf(),
            ram_dir: ram_dir.to_path_buf(),
            mode,
            diff_snapshots: cfg.diff_snapshots,
            run_as: jail::RunAs::lookup(&cfg.run_as),
            boot: Mutex::new(None),
        }
    }

    /// Firecracker, when every part this backend needs is there; else what is missing.
    fn ready(&self) -> Result<&Firecracker, MicrovmError> {
        let mut missing = Vec::new();
        if let Err(e) = &self.kvm {
            missing.push(e.to_string());
        }
        if let Err(e) = &self.fc {
            missing.push(e.to_string());
        }
        if let Err(e) = &self.aether {
            missing.push(e.to_string());
        }
        if let Err(e) = &self.run_as {
            missing.push(e.to_string());
        }
        match (&self.fc, missing.is_empty()) {
            (Ok(fc), true) => Ok(fc),
            _ => Err(MicrovmError::Unavailable(missing.join("; "))),
        }
    }

    fn boot_files(&self) -> Result<(PathBuf, PathBuf), MicrovmError> {
        let mut b = self.boot.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = b.as_ref() {
            return Ok(k.clone());
        }
        let root = self.images.root();
        let kernel = guest::ensure_kernel(root)?;
        let initrd = guest::ensure_initramfs(root, &kernel)?;
        let vmlinux = guest::ensure_vmlinux(&kernel)?;
        *b = Some((vmlinux.clone(), initrd.clone()));
        Ok((vmlinux, initrd))
    }

    fn aether(&self) -> Result<&Path, MicrovmError> {
        self.aether
            .as_deref()
            .map_err(|e| MicrovmError::Unavailable(e.to_string()))
    }

    fn dir(&self, id: &str) -> PathBuf {
        self.sandboxes.join(id)
    }

    fn client(&self, id: &str) -> Client {
        Client::new(&self.dir(id).join(API_SOCK), SNAPSHOT_TIMEOUT)
    }

    /// The VMM's writable directory in the RAM directory (memory files it saves).
    fn ram_vmm_dir(&self, id: &str) -> PathBuf {
        self.ram_dir.join(format!("vmm-{id}"))
    }

    fn stop_processes(&self, dir: &Path) {
        kill(&dir.join(FC_PID));
        kill(&dir.join(PROXY_PID));
        for f in [API_SOCK, VSOCK_UDS, FC_PID, PROXY_PID] {
            let _ = std::fs::remove_file(dir.join(f));
        }
        // The jail's mount point (empty on the host: the jail lived in the VMM's
        // namespace) and the VMM's own directories.
        let _ = std::fs::remove_dir(dir.join(JAIL_ROOT));
        let _ = std::fs::remove_dir_all(dir.join(VMM_DIR));
        if let Some(id) = dir.file_name().and_then(|n| n.to_str()) {
            let _ = std::fs::remove_dir_all(self.ram_vmm_dir(id));
        }
        // Guest-initiated vsock connections leave `<uds>_<port>` sockets.
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                if e.file_name().to_string_lossy().starts_with("fc.vsock_") {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }

    fn unavailable(&self) -> Result<&Firecracker, ApiError> {
        self.ready().map_err(|why| {
            ApiError::unavailable(format!("backend microvm cannot run on this host: {why}"))
        })
    }

    fn vmm_call(
        &self,
        rec: &SandboxRecord,
        f: impl FnOnce(&Client) -> Result<(), api::ApiCallError>,
    ) -> Result<(), ApiError> {
        f(&self.client(&rec.id)).map_err(|e| match e {
            api::ApiCallError::Connect { .. } => {
                ApiError::unavailable(format!("the microVM's control socket: {e}"))
            }
            e => ApiError::internal(e.to_string()),
        })
    }
}

impl Backend for MicrovmBackend {
    fn name(&self) -> &'static str {
        "microvm"
    }

    fn status(&self) -> BackendStatus {
        let (available, detail) = match self.ready() {
            Ok(fc) => (
                true,
                format!(
                    "Firecracker {} ({}; snapshot format {}), KVM; kernel and root disks built from Debian packages on first use",
                    fc.version,
                    fc.path.display(),
                    fc.snapshot_version
                ),
            ),
            Err(why) => (false, why.to_string()),
        };
        BackendStatus {
            name: "microvm".into(),
            available,
            detail,
            capabilities: BACKEND_CAPABILITIES.to_vec(),
        }
    }

    fn capabilities(&self) -> &'static [Capability] {
        BACKEND_CAPABILITIES
    }

    fn changes_in_guest(&self) -> bool {
        true
    }

    fn exited(&self, rec: &SandboxRecord) -> bool {
        !self.is_alive(rec)
    }

    fn create(
        &self,
        rec: &SandboxRecord,
        paths: &SandboxPaths,
        seed: Option<&Path>,
    ) -> Result<(), ApiError> {
        let fc = self.unavailable()?;
        let started = match seed {
            Some(seed) => self.load(fc, rec, paths, seed).map(|saved| {
                if saved.track_dirty_pages {
                    self.set_base(&rec.id, &saved.mem);
                }
            }),
            None => self.boot(fc, rec, paths),
        };
        started.map_err(|e| {
            let _ = self.destroy(rec, paths);
            crate::error::during("starting the microVM", &e)
        })
    }

    fn is_alive(&self, rec: &SandboxRecord) -> bool {
        let dir = self.dir(&rec.id);
        if snapshot::suspended_dir(&dir).join(snapshot::META).exists() {
            return true;
        }
        [dir.join(FC_PID), dir.join(PROXY_PID)]
            .iter()
            .all(|p| read_pid(p).is_some_and(alive))
    }

    /// Stops every thread of the VMM (SIGSTOP), vCPUs included: the guest stands still
    /// as under `PATCH /vm Paused`. Not that call: after a bare Paused/Resumed cycle,
    /// Firecracker 1.16.x never answers new host-initiated vsock connections (its resume
    /// re-arms a transport-reset gate no reset will clear; fixed after 1.16.1), and the
    /// edge reaches the guest only that way. A save (fork, snapshot, pause to disk) pauses
    /// through the API, since Firecracker snapshots only a VM it paused, and its reset
    /// before the save is acknowledged by the guest.
    fn pause(&self, rec: &SandboxRecord) -> Result<(), ApiError> {
        let pid = read_pid(&self.dir(&rec.id).join(FC_PID))
            .ok_or_else(|| ApiError::unavailable("the microVM's process is not recorded"))?;
        Ok(signal_threads(pid, libc::SIGSTOP, STOP_WITHIN)?)
    }

    /// Continues a stopped VMM and resumes a VM a save left paused.
    fn resume(&self, rec: &SandboxRecord) -> Result<(), ApiError> {
        if let Some(pid) = read_pid(&self.dir(&rec.id).join(FC_PID)) {
            signal_threads(pid, libc::SIGCONT, STOP_WITHIN)?;
        }
        self.vmm_call(rec, |c| {
            if api_paused(c)? {
                resume_call(c)?;
            }
            Ok(())
        })
    }

    fn snapshot(
        &self,
        rec: &SandboxRecord,
        _paths: &SandboxPaths,
        dest: &Path,
    ) -> Result<(), ApiError> {
        let fc = self.unavailable()?;
        std::fs::create_dir_all(&self.ram_dir)
            .map_err(|e| ApiError::internal(format!("creating {}: {e}", self.ram_dir.display())))?;
        let mem = snapshot::seed_mem(&self.ram_dir, dest);
        self.save(fc, rec, dest, &mem).map(drop).map_err(|e| {
            let _ = std::fs::remove_file(&mem);
            crate::error::during("snapshotting the microVM", &e)
        })
    }

    /// A Diff written while the source was paused becomes the snapshot's memory: laid
    /// over a fresh copy of the base (never the base itself, which copies may map), which
    /// the next Diff is then taken against.
    fn finish_snapshot(&self, rec: &SandboxRecord, dest: &Path) -> Result<(), ApiError> {
        let fail = |e: String| ApiError::internal(format!("snapshotting the microVM: {e}"));
        let saved = snapshot::read_meta(dest).map_err(|e| fail(e.to_string()))?;
        let diff = snapshot::pending_diff(&saved.mem);
        if !diff.is_file() {
            return Ok(());
        }
        let base = snapshot::base_mem(&self.ram_dir, &rec.id);
        let merged = copy_sparse(&base, &saved.mem)
            .map_err(crate::backend::StateError::from)
            .and_then(|()| snapshot::merge_diff(&diff, &saved.mem));
        let _ = std::fs::remove_file(&diff);
        let dirty = merged.map_err(|e| fail(e.to_string()))?;
        tracing::info!(sandbox = %rec.id, dirty_bytes = dirty, "microvm: Diff snapshot laid over its base");
        self.set_base(&rec.id, &saved.mem);
        Ok(())
    }

    /// The memory comes into the snapshot's directory, out of the RAM directory's tmpfs
    /// (copies that mapped it keep their pages); what is restored later maps it from there.
    fn keep_snapshot(&self, dest: &Path) -> Result<(), ApiError> {
        let fail = |e: String| ApiError::internal(format!("keeping the microVM snapshot: {e}"));
        let mut saved = snapshot::read_meta(dest).map_err(|e| fail(e.to_string()))?;
        if !saved.mem.starts_with(dest) {
            copy_sparse(&saved.mem, &dest.join(snapshot::MEM)).map_err(|e| fail(e.to_string()))?;
            let _ = std::fs::remove_file(&saved.mem);
            // Relative: the directory is moved into place after this.
            saved.mem = PathBuf::from(snapshot::MEM);
            snapshot::write_meta(dest, &saved).map_err(|e| fail(e.to_string()))?;
        }
        Ok(())
    }

    fn discard_snapshot(&self, dest: &Path) {
        snapshot::discard(dest);
    }

    fn saved_files(&self, saved: &Path) -> Result<Vec<SavedFile>, ApiError> {
        let bad = |e: String| ApiError::internal(format!("reading the saved microVM: {e}"));
        let meta = snapshot::read_meta(saved).map_err(|e| bad(e.to_string()))?;
        let mut out = vec![
            SavedFile::at(snapshot::META, saved.join(snapshot::META))
                .map_err(|e| bad(e.to_string()))?,
            SavedFile::at(snapshot::VMSTATE, saved.join(snapshot::VMSTATE))
                .map_err(|e| bad(e.to_string()))?,
            SavedFile::at(snapshot::MEM, meta.mem).map_err(|e| bad(e.to_string()))?,
        ];
        out.extend(
            moved_disk::saved_files(&meta.guest.disk, &meta.guest.lowers)
                .map_err(|e| bad(e.to_string()))?,
        );
        Ok(out)
    }

    fn local_copy(&self, f: &SavedFile) -> Option<PathBuf> {
        moved_disk::local_copy(&self.images, f)
    }

    /// Checks a microVM state fetched from another edge (its files, format, Firecracker
    /// version and memory size) and points its `fc.json` at its memory and at this edge's
    /// copy of its disk.
    fn adopt_saved(
        &self,
        staged: &Path,
        _home: &Path,
        files: &[SavedFile],
        have: &std::collections::BTreeMap<String, PathBuf>,
    ) -> Result<(), ApiError> {
        let bad =
            |e: String| ApiError::invalid(format!("the microVM state sent by the other edge: {e}"));
        let fc = self.unavailable()?;
        let names = [snapshot::META, snapshot::VMSTATE, snapshot::MEM];
        if let Some(f) = files
            .iter()
            .find(|f| !names.contains(&f.name.as_str()) && !moved_disk::is_name(&f.name))
        {
            return Err(bad(format!("unknown file {:?}", f.name)));
        }
        for n in [snapshot::META, snapshot::VMSTATE, snapshot::MEM] {
            if !staged.join(n).is_file() {
                return Err(bad(format!("{n} is missing")));
            }
        }
        // A format this edge does not read is refused here.
        let mut saved = snapshot::read_meta(staged).map_err(|e| bad(e.to_string()))?;
        if saved.firecracker != fc.version || saved.snapshot_version != fc.snapshot_version {
            return Err(ApiError::precondition(format!(
                "the microVM was saved by Firecracker {} (snapshot format {}) and this edge runs {} (format {}); move it to an edge with the same version",
                saved.firecracker, saved.snapshot_version, fc.version, fc.snapshot_version
            )));
        }
        let g = &saved.guest;
        if g.mem_mb == 0 || g.mem_mb > 1 << 20 || g.cpus == 0 || g.cpus > 32 {
            return Err(bad(format!(
                "{} MiB and {} vCPUs is not a microVM",
                g.mem_mb, g.cpus
            )));
        }
        let len = std::fs::metadata(staged.join(snapshot::MEM))
            .map_err(|e| bad(e.to_string()))?
            .len();
        if len != g.mem_mb << 20 {
            return Err(bad(format!(
                "its memory has {len} bytes, not the guest's {} MiB",
                g.mem_mb
            )));
        }
        // Next to `fc.json` wherever `staged` goes (`home`, for a resume).
        saved.mem = PathBuf::from(snapshot::MEM);
        (saved.guest.disk, saved.guest.lowers) =
            moved_disk::place(self.images.root(), staged, files, have)
                .map_err(|e| bad(e.to_string()))?;
        Ok(snapshot::write_meta(staged, &saved)?)
    }

    fn suspend(&self, rec: &SandboxRecord, paths: &SandboxPaths) -> Result<(), ApiError> {
        let fc = self.unavailable()?;
        let dest = snapshot::suspended_dir(&paths.dir);
        let part = paths.dir.join("suspended.part");
        let _ = std::fs::remove_dir_all(&part);
        let r = self
            .save(fc, rec, &part, &part.join(snapshot::MEM))
            .and_then(|mut saved| {
                // The memory now names its place inside `suspended/`.
                saved.mem = dest.join(snapshot::MEM);
                snapshot::write_meta(&part, &saved)?;
                Ok(std::fs::rename(&part, &dest).ctx(|| "moving the saved VM".into())?)
            });
        if let Err(e) = r {
            let _ = std::fs::remove_dir_all(&part);
            return Err(crate::error::during("saving the microVM to disk", &e));
        }
        self.stop_processes(&paths.dir);
        let _ = std::fs::remove_file(snapshot::base_mem(&self.ram_dir, &rec.id));
        Ok(())
    }

    fn wake(&self, rec: &SandboxRecord, paths: &SandboxPaths) -> Result<(), ApiError> {
        let fc = self.unavailable()?;
        let dir = snapshot::suspended_dir(&paths.dir);
        match self.load(fc, rec, paths, &dir) {
            Ok(_) => {
                // Firecracker maps the memory file; unlinking it keeps its pages.
                let _ = std::fs::remove_dir_all(&dir);
                Ok(())
            }
            Err(e) => {
                // Still suspended: the saved state stays for another try.
                self.stop_processes(&paths.dir);
                Err(crate::error::during("resuming the microVM from disk", &e))
            }
        }
    }

    fn destroy(&self, rec: &SandboxRecord, paths: &SandboxPaths) -> Result<(), ApiError> {
        self.stop_processes(&paths.dir);
        let _ = std::fs::remove_file(snapshot::base_mem(&self.ram_dir, &rec.id));
        let _ = std::fs::remove_dir_all(snapshot::suspended_dir(&paths.dir));
        let _ = std::fs::remove_dir_all(paths.dir.join("suspended.part"));
        let _ = std::fs::remove_file(&paths.channel);
        netns::remove(&netns::name(&rec.id));
        let rel = cgroup::sandbox_cgroup_path(&rec.id);
        cgroup::empty_and_remove(self.mode, &rel, VMM_EXIT);
        // A save cut short by a crash can leave the VMM's aside cgroup.
        cgroup::empty_and_remove(self.mode, &format!("{rel}.save"), VMM_EXIT);
        Ok(())
    }

    fn oom_kills(&self, rec: &SandboxRecord) -> u64 {
        cgroup::oom_kills(self.mode, &cgroup::sandbox_cgroup_path(&rec.id))
    }

    fn housekeeping(&self, paths: &SandboxPaths) {
        // Opened for appending: cut short, Firecracker goes on from the new end.
        crate::backend::vm::cap_console(&paths.dir.join(CONSOLE), crate::backend::vm::CONSOLE_MAX);
    }

    fn start_log(&self, paths: &SandboxPaths) -> Option<String> {
        let text = std::fs::read_to_string(paths.dir.join(CONSOLE)).ok()?;
        let lines: Vec<&str> = text.lines().rev().take(8).collect();
        Some(lines.into_iter().rev().collect::<Vec<_>>().join(" | "))
    }

    /// A microVM boots in well under a second on hardware KVM, but KVM nested in an
    /// emulated CPU (a cloud VM without nested hardware virtualisation, this project's
    /// test harness) runs guests at emulation speed: 10-20 s per boot, more when many
    /// boot at once. Only a guest that never comes up waits this long.
    fn start_timeout(&self) -> Duration {
        Duration::from_secs(120)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn vcpu_counts_are_one_or_even() {
        assert_eq!(vcpus(0.5), 1);
        assert_eq!(vcpus(1.0), 1);
        assert_eq!(vcpus(1.5), 2);
        assert_eq!(vcpus(3.0), 4);
        assert_eq!(vcpus(64.0), 32);
    }

    #[test]
    fn without_firecracker_or_kvm_the_backend_says_what_the_host_needs() {
        let d = tempfile::tempdir().unwrap();
        let images = ImageStore::open(d.path().join("images")).unwrap();
        let b = MicrovmBackend::new(
            &MicrovmConfig {
                binary: Some(d.path().join("no-firecracker")),
                diff_snapshots: false,
                run_as: "nobody".into(),
            },
            Ok(PathBuf::from("/bin/true")),
            images,
            &d.path().join("sandboxes"),
            &d.path().join("ram"),
            CgroupMode::V1,
        );
        let st = b.status();
        assert!(!st.available);
        assert!(st.detail.contains("firecracker_binary"), "{}", st.detail);
        if Accel::detect() == Accel::Tcg {
            assert!(st.detail.contains("no hardware KVM"), "{}", st.detail);
        }
        let e = b.unavailable().unwrap_err();
        assert_eq!(e.code, dsec_common::ErrorCode::Unavailable);
        assert!(
            e.message
                .starts_with("backend microvm cannot run on this host: ")
        );
    }

    /// A stand-in Firecracker (C, built by the test: the jail holds no interpreter):
    /// answers `--version`, and otherwise writes what it finds in its jail to `report`
    /// next to its `--api-sock` (its ids, `no_new_privs`, the root's entries, whether the
    /// host's files and its devices open), logs its argv, and serves 200s (GET) and 204s
    /// on the socket, logging each request line to `calls`.
    const FAKE_FIRECRACKER: &str = r#"
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
static char dir[4096];
static FILE *at(const char *name, const char *mode) {
    char p[4200]; snprintf(p, sizeof p, "%s/%s", dir, name); return fopen(p, mode);
}
static int opens(const char *p, int flags) {
    int fd = open(p, flags); if (fd < 0) return errno; close(fd); return 0;
}
int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--version")) { puts("Firecracker v1.16.1"); return 0; }
    if (argc > 1 && !strcmp(argv[1], "--snapshot-version")) { puts("v10.0.0"); return 0; }
    const char *sock = 0;
    for (int i = 1; i + 1 < argc; i++) if (!strcmp(argv[i], "--api-sock")) sock = argv[i + 1];
    if (!sock) return 2;
    snprintf(dir, sizeof dir, "%s", sock);
    *strrchr(dir, '/') = 0;
    FILE *r = at("report", "w");
    fprintf(r, "uid=%d gid=%d groups=%d nnp=%d\n", getuid(), getgid(), getgroups(0, 0),
            prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0));
    fprintf(r, "root=");
    DIR *d = opendir("/"); struct dirent *e;
    while (d && (e = readdir(d))) if (e->d_name[0] != '.') fprintf(r, "%s,", e->d_name);
    fprintf(r, "\npasswd=%d kvm=%d tun=%d\n", opens("/etc/passwd", O_RDONLY),
            opens("/dev/kvm", O_RDWR), opens("/dev/net/tun", O_RDWR));
    fclose(r);
    FILE *a = at("argv", "w");
    for (int i = 1; i < argc; i++) fprintf(a, "%s ", argv[i]);
    fclose(a);
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", sock);
    unlink(sock);
    if (bind(s, (struct sockaddr *)&sa, sizeof sa) || listen(s, 8)) return 3;
    for (;;) {
        int c = accept(s, 0, 0); if (c < 0) continue;
        char buf[65536]; int n = 0, k;
        while (n < (int)sizeof buf - 1 && (k = read(c, buf + n, sizeof buf - 1 - n)) > 0) {
            n += k; buf[n] = 0;
            char *end = strstr(buf, "\r\n\r\n"); if (!end) continue;
            char *cl = strcasestr(buf, "content-length:");
            int want = (end - buf) + 4 + (cl ? atoi(cl + 15) : 0);
            if (n >= want) break;
        }
        buf[n] = 0;
        char method[16] = "", path[256] = "";
        sscanf(buf, "%15s %255s", method, path);
        FILE *l = at("calls", "a"); fprintf(l, "%s %s\n", method, path); fclose(l);
        const char *ok = !strcmp(method, "GET") ? "HTTP/1.1 200 \r\nContent-Length: 2\r\n\r\n{}"
                                                : "HTTP/1.1 204 \r\n\r\n";
        write(c, ok, strlen(ok)); close(c);
    }
}
"#;

    fn netns_inode(path: &Path) -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(path).map(|m| m.ino()).unwrap_or(0)
    }

    #[test]
    fn the_vmm_starts_jailed_in_its_namespace_and_cgroup_and_is_cleaned_up() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: needs root");
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let bin_dir = d.path().join("bin");
        std::fs::create_dir_all(&bin_dir).unwrap();
        let src = bin_dir.join("standin.c");
        std::fs::write(&src, FAKE_FIRECRACKER).unwrap();
        let fake = bin_dir.join("firecracker");
        let cc = std::process::Command::new("cc")
            .args(["-O", "-o"])
            .arg(&fake)
            .arg(&src)
            .output();
        match cc {
            Ok(o) if o.status.success() => {}
            other => {
                eprintln!("skipped: no C compiler for the stand-in: {other:?}");
                return;
            }
        }
        let b = MicrovmBackend::new(
            &MicrovmConfig {
                binary: Some(fake.clone()),
                diff_snapshots: false,
                run_as: "nobody".into(),
            },
            Ok(PathBuf::from("/bin/true")),
            ImageStore::open(d.path().join("images")).unwrap(),
            &d.path().join("sandboxes"),
            &d.path().join("ram"),
            crate::cgroup::detect(),
        );
        let fc =
            b.fc.as_ref()
                .expect("the stand-in passes the probe")
                .clone();
        let nobody = jail::RunAs::lookup("nobody").unwrap().unwrap();
        let mut r = [0u8; 4];
        dsec_common::id::fill_random(&mut r);
        let id = format!("t-{}", hex::encode(r));
        let rec: SandboxRecord = serde_json::from_value(json!({
            "id": id, "edge": "t", "backend": "microvm", "image": "root/base",
            "image_digest": "", "layers": [], "env": {}, "workdir": null,
            "limits": {"cpu_cores": 1.0, "memory_mb": 128, "disk_mb": 64, "pids": 64},
            "labels": {}, "state": "creating", "created_at_ms": 0, "expires_at_ms": 0,
            "idle_timeout_seconds": null, "last_activity_ms": 0, "forked_from": null,
            "oom_kills": 0
        }))
        .unwrap();
        let dir = d.path().join("sandboxes").join(&id);
        std::fs::create_dir_all(&dir).unwrap();
        // What the VM boots from (stand-ins), and a secret of the sandbox directory the
        // jail must not show.
        let kernel = d.path().join("images/guest/vmlinux");
        std::fs::create_dir_all(kernel.parent().unwrap()).unwrap();
        std::fs::write(&kernel, b"kernel").unwrap();
        std::fs::write(dir.join("state.json"), b"secret").unwrap();
        let paths = SandboxPaths {
            channel: dir.join("aether.sock"),
            dir: dir.clone(),
        };
        /// Destroys the sandbox however the test ends.
        struct Cleanup<'a>(&'a MicrovmBackend, &'a SandboxRecord, &'a SandboxPaths);
        impl Drop for Cleanup<'_> {
            fn drop(&mut self) {
                let _ = self.0.destroy(self.1, self.2);
            }
        }
        let _cleanup = Cleanup(&b, &rec, &paths);

        let c = b
            .spawn_vmm(&fc, &rec, &paths, 128, std::slice::from_ref(&kernel))
            .unwrap();
        pause_call(&c).unwrap();
        let pid = read_pid(&dir.join(FC_PID)).unwrap();
        assert!(alive(pid));
        let ns = netns::name(&id);
        assert_eq!(
            netns_inode(&PathBuf::from(format!("/proc/{pid}/ns/net"))),
            netns_inode(&netns::path(&ns)),
            "Firecracker is not in its namespace"
        );
        assert_ne!(
            netns_inode(&PathBuf::from(format!("/proc/{pid}/ns/mnt"))),
            netns_inode(Path::new("/proc/self/ns/mnt")),
            "Firecracker shares the edge's mount namespace"
        );
        let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
        assert!(cg.contains(&cgroup::sandbox_cgroup_path(&id)), "{cg}");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let field = |k: &str| {
            status
                .lines()
                .find(|l| l.starts_with(k))
                .unwrap_or("")
                .split_whitespace()
                .skip(1)
                .collect::<Vec<_>>()
                .join(" ")
        };
        let n = nobody.uid.to_string();
        assert_eq!(field("Uid:"), format!("{n} {n} {n} {n}"), "{status}");
        assert_eq!(field("CapEff:"), "0000000000000000", "{status}");
        assert_eq!(field("NoNewPrivs:"), "1", "{status}");

        // From inside: its user, no groups, a root with nothing of the host's but what
        // it was given, its own devices.
        let vmm = dir.join(VMM_DIR);
        let report = std::fs::read_to_string(vmm.join("report")).unwrap();
        println!("the stand-in's view from its jail:\n{report}");
        assert!(
            report.starts_with(&format!(
                "uid={} gid={} groups=0 nnp=1",
                nobody.uid, nobody.gid
            )),
            "{report}"
        );
        let root_line = report.lines().nth(1).unwrap();
        let mut entries: Vec<&str> = root_line
            .trim_start_matches("root=")
            .split(',')
            .filter(|e| !e.is_empty())
            .collect();
        entries.sort();
        let top = |p: &Path| {
            p.components()
                .nth(1)
                .unwrap()
                .as_os_str()
                .to_str()
                .unwrap()
                .to_string()
        };
        for want in [
            top(&fake),
            top(&kernel),
            top(&dir),
            "dev".to_string(),
            "usr".to_string(),
        ] {
            assert!(
                entries.contains(&want.as_str()),
                "{want} missing: {entries:?}"
            );
        }
        for never in ["etc", "root", "proc", "sys", "home", "run", "var"] {
            if top(d.path()) != never {
                assert!(
                    !entries.contains(&never),
                    "/{never} is visible in the jail: {entries:?}"
                );
            }
        }
        // The host's files do not exist for it; its devices open as its own.
        assert!(report.contains("passwd=2 "), "{report}");
        assert!(
            report.contains("kvm=0") || report.contains("kvm=6"),
            "{report}"
        );
        assert!(report.contains("tun=0"), "{report}");
        // What the jail holds of the sandbox directory: its own vmm/ only.
        let seen: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/root{}", dir.display()))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(seen, vec![VMM_DIR.to_string()], "the jail shows {seen:?}");
        assert_eq!(
            std::fs::read(format!("/proc/{pid}/root{}", kernel.display())).unwrap(),
            b"kernel"
        );
        let argv = std::fs::read_to_string(vmm.join("argv")).unwrap();
        assert!(
            argv.contains("--api-sock") && argv.contains(&format!("--id {id}")),
            "{argv}"
        );
        assert!(!argv.contains("seccomp"), "{argv}");
        let calls = std::fs::read_to_string(vmm.join("calls")).unwrap();
        assert_eq!(calls, "GET /\nPATCH /vm\n");

        b.destroy(&rec, &paths).unwrap();
        assert!(!alive(pid), "Firecracker outlived destroy");
        assert!(!netns::exists(&ns));
        assert!(
            crate::cgroup::leftovers(b.mode, &crate::cgroup::sandbox_cgroup_path(&id)).is_empty()
        );
        assert!(!dir.join(API_SOCK).exists() && !dir.join(FC_PID).exists());
        assert!(!dir.join(JAIL_ROOT).exists() && !b.ram_vmm_dir(&id).exists());
    }
}
