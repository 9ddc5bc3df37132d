//! The `vm` backend: a QEMU `microvm` per sandbox, with KVM where the host has hardware
//! virtualisation and TCG (emulation) otherwise. The guest boots the kernel and initramfs
//! the image store builds from Debian packages; its root is the image's layers as
//! read-only EROFS disks (one per layer, shared by every VM whose image has it; a lazily
//! pulled layer's read from the lazy file system as the guest asks) under the stage disk
//! (aether) and an overlay whose writable layer is a tmpfs in the guest; aether is its
//! init and serves the channel over a virtio-serial port, which `dsec-aether vmux`
//! carries to the sandbox's `aether.sock`.
//! QEMU and vmux run detached from the edge (their pids in the sandbox directory), so a
//! restarted edge re-adopts running VMs.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use dsec_common::api::{BackendStatus, Capability};
use dsec_common::{ApiError, ErrorCode, IoContext, IoFailure};
use dsec_image::ImageStore;
use dsec_image::guest;

mod mapped;
pub(crate) mod net;
mod persist;
mod probe;
mod qemu;
mod qmp;

pub use qmp::QmpError;
mod shares;

pub use probe::Accel;

use persist::{SAVED_FILES, SavedKind, VmInfo, read_saved, refuse_saving};
use probe::{check_options, find_qemu, machine, qemu_version};
use qemu::{BootFiles, Incoming, Mem};

use super::detached::{alive, copy_sparse, read_json, read_pid, write_json};
use super::{Backend, SandboxPaths, SavedFile, moved_disk};
use crate::cgroup::{self, CgroupMode};
use crate::config::ForkCapture;
use crate::registry::SandboxRecord;

/// See [`crate::backend::Backend::capabilities`].
pub const BACKEND_CAPABILITIES: &[Capability] = &[
    Capability::ForkMemory,
    Capability::PauseToDisk,
    Capability::Move,
    Capability::Volumes,
];

pub struct VmBackend {
    qemu: Result<PathBuf, VmError>,
    /// QEMU's `(major, minor)` version: what its command line and captures can use.
    qemu_version: (u32, u32),
    aether: Result<PathBuf, crate::backend::NoAether>,
    accel: Accel,
    images: ImageStore,
    /// The edge's sandbox directories (`<dir>/<id>/qemu.pid`, …).
    sandboxes: PathBuf,
    /// Where VM memory files live (a tmpfs: `/dev/shm/dsec-vm`).
    ram_dir: PathBuf,
    /// The guest kernel and initramfs, found (or built) on the first create.
    boot: Arc<BootFiles>,
    /// QEMU runs in the sandbox's cgroup (CPU quota, memory, pids).
    cgroups: CgroupMode,
    /// The machine type and extra devices (`[edge.vm]`); `machine` checked in `new`.
    options: Result<crate::config::VmOptions, VmError>,
}

/// What goes wrong running a QEMU VM.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// The backend cannot run VMs here (QEMU, the agent or a setting is missing): the
    /// cause found at start, which says what to install or set.
    #[error("{0}")]
    Unavailable(String),
    /// `[edge.vm]` holds a value the backend cannot use.
    #[error("{0}")]
    Config(String),
    /// What the VM or its saved state is cannot be done (a VM with volumes restored, a
    /// machine type not known, a network device without a network).
    #[error("{0}")]
    Refused(String),
    #[error("QEMU did not start ({status}): {said}")]
    NotStarted { status: String, said: String },
    #[error("{what} took over {secs} s")]
    Timeout { what: String, secs: u64 },
    /// A fork copy started early ([`VmBackend::restore_early`]) found its snapshot made
    /// another way than planned; it starts over from the snapshot as made.
    #[error("the snapshot was made otherwise than planned")]
    Replanned,
    #[error("the fork's snapshot failed")]
    SnapshotFailed,
    /// The template QEMU of a live capture failed: what it printed.
    #[error("the template QEMU: {why} ({said})")]
    Template { why: String, said: String },
    #[error("virtiofsd for volume {volume} did not start: {said}")]
    Virtiofsd { volume: String, said: String },
    #[error(transparent)]
    Qmp(#[from] qmp::QmpError),
    #[error(transparent)]
    State(#[from] crate::backend::StateError),
    #[error(transparent)]
    Net(#[from] crate::net::NetError),
    #[error(transparent)]
    Netlink(#[from] crate::net::NetlinkError),
    #[error(transparent)]
    MountNs(#[from] crate::mountns::MountNsError),
    #[error(transparent)]
    Volume(#[from] crate::volumes::VolumeError),
    #[error(transparent)]
    Image(#[from] dsec_image::ImageError),
    #[error(transparent)]
    Io(#[from] IoFailure),
}

impl crate::error::Coded for VmError {
    fn code(&self) -> ErrorCode {
        match self {
            VmError::Unavailable(_) => ErrorCode::Unavailable,
            VmError::Config(_) => ErrorCode::FailedPrecondition,
            VmError::Refused(_) => ErrorCode::FailedPrecondition,
            VmError::Timeout { .. } => ErrorCode::Unavailable,
            VmError::State(e) => e.code(),
            VmError::Net(e) => e.code(),
            VmError::MountNs(e) => e.code(),
            VmError::Volume(e) => e.code(),
            _ => ErrorCode::Internal,
        }
    }
}

impl VmBackend {
    pub fn new(
        aether: Result<PathBuf, crate::backend::NoAether>,
        images: ImageStore,
        sandboxes: &Path,
        ram_dir: &Path,
        cgroups: CgroupMode,
        options: crate::config::VmOptions,
    ) -> VmBackend {
        let boot = Arc::new(BootFiles::default());
        // A kernel already in the store: its initramfs is found (or made) now, in the
        // background, instead of by the first VM's create. A store without one is left
        // alone (making one downloads a package).
        if guest::has_cached_kernel(images.root()) {
            let (b, store) = (boot.clone(), images.clone());
            let _ = std::thread::Builder::new()
                .name("vm-boot-files".into())
                .spawn(move || match b.get(&store) {
                    Ok((k, _)) => tracing::info!("VM kernel {} and its initramfs ready", k.version),
                    Err(e) => tracing::warn!("preparing the VMs' kernel and initramfs: {e}"),
                });
        }
        let qemu = find_qemu();
        let version = qemu.as_ref().map(|q| qemu_version(q)).unwrap_or((0, 0));
        VmBackend {
            qemu,
            qemu_version: version,
            aether,
            accel: Accel::detect(),
            images,
            sandboxes: sandboxes.to_path_buf(),
            ram_dir: ram_dir.to_path_buf(),
            boot,
            cgroups,
            options: check_options(options),
        }
    }

    /// The kernel and initramfs; building them the first time downloads the kernel
    /// package (tens of MiB) and can take a minute.
    fn boot_files(&self) -> Result<(guest::Kernel, PathBuf), VmError> {
        self.boot.get(&self.images)
    }

    pub fn accel(&self) -> Accel {
        self.accel
    }

    /// How forks and snapshots of a running VM are captured: `auto` is `mapped` with
    /// QEMU 10 or newer, else `pause`.
    fn capture(&self) -> ForkCapture {
        match self.options.as_ref().map(|o| o.fork_capture) {
            Ok(ForkCapture::Auto) | Err(_) if self.qemu_version >= (10, 0) => ForkCapture::Mapped,
            Ok(ForkCapture::Auto) | Err(_) => ForkCapture::Pause,
            Ok(c) => c,
        }
    }

    /// Whether a VM's own memory is anonymous (see [`Mem::Own`]).
    fn anon_ram(&self) -> bool {
        self.capture() == ForkCapture::Mapped
    }

    /// The VM's own memory file.
    fn ram_file(&self, id: &str) -> PathBuf {
        self.ram_dir.join(format!("{id}.ram"))
    }

    fn qemu(&self) -> Result<&Path, VmError> {
        self.qemu
            .as_deref()
            .map_err(|e| VmError::Unavailable(e.to_string()))
    }

    fn aether(&self) -> Result<&Path, VmError> {
        self.aether
            .as_deref()
            .map_err(|e| VmError::Unavailable(e.to_string()))
    }

    fn options(&self) -> Result<&crate::config::VmOptions, VmError> {
        self.options
            .as_ref()
            .map_err(|e| VmError::Unavailable(e.to_string()))
    }
}

impl Backend for VmBackend {
    fn name(&self) -> &'static str {
        "vm"
    }

    fn status(&self) -> BackendStatus {
        let (available, detail) = match (&self.qemu, &self.aether, &self.options) {
            (Ok(q), Ok(_), Ok(o)) => (
                true,
                format!(
                    "QEMU {} ({}; {}), kernel and root disks built from Debian packages on first use",
                    o.machine,
                    q.display(),
                    match self.accel {
                        Accel::Kvm => "KVM",
                        Accel::Tcg => "TCG emulation: no hardware virtualisation on this host",
                    }
                ),
            ),
            (Err(e), _, _) | (_, _, Err(e)) => (false, e.to_string()),
            (_, Err(e), _) => (false, e.to_string()),
        };
        BackendStatus {
            name: "vm".into(),
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
        let started = match seed {
            Some(seed) => self.restore_copy(rec, paths, seed),
            None => self.boot(rec, paths),
        };
        started.map_err(|e| {
            let _ = self.destroy(rec, paths);
            crate::error::during("starting the VM", &e)
        })
    }

    fn is_alive(&self, rec: &SandboxRecord) -> bool {
        let dir = self.sandboxes.join(&rec.id);
        if self.suspended_dir(&rec.id).join("vm.json").exists() {
            return true;
        }
        // Its volumes' daemons too: without one, the guest's mount of it only fails.
        let daemons = (0..rec.volumes.len()).map(|i| shares::pid_file(&dir, i));
        [dir.join("qemu.pid"), dir.join("vmux.pid")]
            .into_iter()
            .chain(daemons)
            .all(|p| read_pid(&p).is_some_and(alive))
    }

    /// Stops the VM's CPUs in place (its memory stays where it is).
    fn pause(&self, rec: &SandboxRecord) -> Result<(), ApiError> {
        self.qmp(rec, "stop")
    }

    fn resume(&self, rec: &SandboxRecord) -> Result<(), ApiError> {
        self.qmp(rec, "cont")
    }

    /// With `mapped` capture: [`VmBackend::mapped_save`]. With `live` and the VM's
    /// memory its own file: [`VmBackend::live_save`]. The seed goes to the RAM directory
    /// like [`Backend::snapshot`]'s. A failed capture leaves the VM running and falls back
    /// to a paused one (`None`).
    fn snapshot_live(&self, rec: &SandboxRecord, dest: &Path) -> Option<Result<u64, ApiError>> {
        if let Err(e) = refuse_saving(rec, "forked or snapshotted") {
            return Some(Err(e));
        }
        let capture = self.capture();
        let info: VmInfo = read_json(&self.sandboxes.join(&rec.id).join("vm.json")).ok()?;
        let live = match capture {
            ForkCapture::Mapped => true,
            // A VM whose pages are private (a fork copy) is saved whole, stopped, as before.
            ForkCapture::Live => info.shared_ram,
            _ => false,
        };
        if !live {
            return None;
        }
        std::fs::create_dir_all(dest).ok()?;
        let name = format!("seed-{}-{}", rec.id, crate::random_hex(8));
        let (ram, r) = if capture == ForkCapture::Mapped {
            // Where the plan put it, if copies were started on it.
            let ram = read_saved(&dest.join("vm.json"))
                .ok()
                .filter(|s| s.pending)
                .and_then(|s| s.ram)
                .unwrap_or_else(|| self.ram_dir.join(format!("{name}.mr")));
            let r = self.mapped_save(rec, dest, &ram);
            (ram, r)
        } else {
            let ram = self.ram_dir.join(format!("{name}.ram"));
            let r = self.live_save(rec, info, dest, &ram);
            if r.is_ok() {
                // The template wrote every page of the seed, zeros too: those go back,
                // behind the copies (which map it privately and would read zeros there
                // either way).
                let (seed, id) = (ram.clone(), rec.id.clone());
                let _ = std::thread::Builder::new()
                    .name("dsec-seed-punch".into())
                    .spawn(move || match super::detached::punch_zero_pages(&seed) {
                        Ok(n) => tracing::debug!(sandbox = %id, "seed gave back {} MiB of zero pages", n >> 20),
                        Err(e) => tracing::debug!(sandbox = %id, "seed's zero pages: {e}"),
                    });
            }
            (ram, r)
        };
        match r {
            Ok(ms) => Some(Ok(ms)),
            Err(e) => {
                // The VM runs on whatever happened (a cancelled migration leaves it
                // running); the caller captures it paused instead.
                let _ = std::fs::remove_file(&ram);
                let _ = std::fs::remove_file(dest.join("vm.json"));
                tracing::warn!(sandbox = %rec.id, "live capture failed, pausing instead: {e}");
                let mut q = self.qmp_of(&rec.id).ok()?;
                if q.status().ok()?.as_str() != "running" {
                    q.execute("cont", serde_json::Value::Null).ok()?;
                }
                None
            }
        }
    }

    fn plan_snapshot(&self, rec: &SandboxRecord, dest: &Path) -> bool {
        if self.capture() != ForkCapture::Mapped || !rec.volumes.is_empty() {
            return false;
        }
        match self.plan(rec, dest) {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(sandbox = %rec.id, "copies start after the snapshot: {e}");
                false
            }
        }
    }

    /// The VM's device state and memory (see [`VmBackend::save`]); the copy of its memory
    /// file goes to the RAM directory, next to the memory it copies.
    fn snapshot(
        &self,
        rec: &SandboxRecord,
        _paths: &SandboxPaths,
        dest: &Path,
    ) -> Result<(), ApiError> {
        refuse_saving(rec, "forked or snapshotted")?;
        let ram = self
            .ram_dir
            .join(format!("seed-{}-{}.ram", rec.id, crate::random_hex(8)));
        self.save(rec, dest, &ram).map_err(|e| {
            let _ = std::fs::remove_file(&ram);
            ApiError::internal(format!("snapshotting the VM: {e}"))
        })
    }

    /// The memory file comes into the snapshot's directory (on disk, out of the RAM
    /// directory's tmpfs); copies map it from there.
    fn keep_snapshot(&self, dest: &Path) -> Result<(), ApiError> {
        let fail = |e: String| ApiError::internal(format!("keeping the VM snapshot: {e}"));
        let mut saved = read_saved(&dest.join("vm.json")).map_err(|e| fail(e.to_string()))?;
        if let Some(ram) = saved.ram.clone()
            && !ram.starts_with(dest)
        {
            copy_sparse(&ram, &dest.join("ram")).map_err(|e| fail(e.to_string()))?;
            // `ram` next to the state, wherever the directory is moved to.
            saved.ram = None;
            write_json(&dest.join("vm.json"), &saved).map_err(|e| fail(e.to_string()))?;
            let _ = std::fs::remove_file(&ram);
        }
        Ok(())
    }

    fn discard_snapshot(&self, dest: &Path) {
        if let Ok(saved) = read_saved(&dest.join("vm.json"))
            && let Some(ram) = saved.ram
        {
            // Copies map it; their pages stay until the last one ends.
            let _ = std::fs::remove_file(ram);
        }
    }

    fn saved_files(&self, saved: &Path) -> Result<Vec<SavedFile>, ApiError> {
        let bad = |e: String| ApiError::internal(format!("reading the saved VM: {e}"));
        let vm = read_saved(&saved.join("vm.json")).map_err(|e| bad(e.to_string()))?;
        let mut out =
            vec![SavedFile::at("vm.json", saved.join("vm.json")).map_err(|e| bad(e.to_string()))?];
        // A mapped-ram save is one file, `ram`.
        let state = match vm.kind {
            SavedKind::Shared => Some("dev"),
            SavedKind::Mapped => None,
            SavedKind::Full => Some("full"),
        };
        if let Some(state) = state {
            out.push(SavedFile::at(state, saved.join(state)).map_err(|e| bad(e.to_string()))?);
        }
        let ram = vm
            .ram
            .clone()
            .or_else(|| (vm.kind != SavedKind::Full).then(|| saved.join("ram")));
        if let Some(ram) = ram {
            out.push(SavedFile::at("ram", ram).map_err(|e| bad(e.to_string()))?);
        }
        out.extend(
            moved_disk::saved_files(&vm.guest.disk, &vm.guest.lowers)
                .map_err(|e| bad(e.to_string()))?,
        );
        Ok(out)
    }

    fn local_copy(&self, f: &SavedFile) -> Option<PathBuf> {
        moved_disk::local_copy(&self.images, f)
    }

    fn adopt_saved(
        &self,
        staged: &Path,
        home: &Path,
        files: &[SavedFile],
        have: &std::collections::BTreeMap<String, PathBuf>,
    ) -> Result<(), ApiError> {
        let bad =
            |e: String| ApiError::invalid(format!("the VM state sent by the other edge: {e}"));
        if let Some(f) = files
            .iter()
            .find(|f| !SAVED_FILES.contains(&f.name.as_str()) && !moved_disk::is_name(&f.name))
        {
            return Err(bad(format!("unknown file {:?}", f.name)));
        }
        let mut vm = read_saved(&staged.join("vm.json")).map_err(|e| bad(e.to_string()))?;
        let state = match vm.kind {
            SavedKind::Shared => "dev",
            SavedKind::Full => "full",
            SavedKind::Mapped => "ram",
        };
        if !staged.join(state).is_file() {
            return Err(bad(format!("{state} is missing")));
        }
        if machine(&vm.machine).is_none() {
            return Err(bad(format!("unknown machine type {:?}", vm.machine)));
        }
        if vm.guest.mem_mb == 0
            || vm.guest.mem_mb > 1 << 20
            || vm.guest.cpus == 0
            || vm.guest.cpus > 256
        {
            return Err(bad(format!(
                "{} MiB and {} cpus is not a VM",
                vm.guest.mem_mb, vm.guest.cpus
            )));
        }
        let here = self
            .boot_files()
            .map_err(|e| ApiError::unavailable(format!("the guest kernel: {e}")))?
            .0
            .version;
        if let Some(k) = &vm.kernel
            && *k != here
        {
            return Err(ApiError::precondition(format!(
                "the VM runs guest kernel {k} and this edge has {here}; restore it on an edge with the same kernel"
            )));
        }
        vm.ram = match vm.kind {
            SavedKind::Mapped => {
                // Copies map its pages at the offset its header gives: a header that does
                // not fit the memory size, or a file short of the pages, goes no further.
                mapped::read_mem_of(&staged.join("ram"), vm.guest.mem_mb << 20)
                    .map_err(|e| bad(e.to_string()))?;
                Some(home.join("ram"))
            }
            SavedKind::Shared if staged.join("ram").is_file() => Some(home.join("ram")),
            SavedKind::Shared => return Err(bad("ram is missing".into())),
            SavedKind::Full => None,
        };
        (vm.guest.disk, vm.guest.lowers) =
            moved_disk::place(self.images.root(), staged, files, have)
                .map_err(|e| bad(e.to_string()))?;
        Ok(write_json(&staged.join("vm.json"), &vm)?)
    }

    fn suspend(&self, rec: &SandboxRecord, paths: &SandboxPaths) -> Result<(), ApiError> {
        refuse_saving(rec, "paused to disk or moved")?;
        let dest = self.suspended_dir(&rec.id);
        let part = paths.dir.join("suspended.part");
        let _ = std::fs::remove_dir_all(&part);
        let r = self.save(rec, &part, &part.join("ram")).and_then(|()| {
            // The saved memory now names its place inside `suspended/`.
            let mut saved = read_saved(&part.join("vm.json"))?;
            if saved.ram.is_some() {
                saved.ram = Some(dest.join("ram"));
            }
            write_json(&part.join("vm.json"), &saved)?;
            Ok(std::fs::rename(&part, &dest).ctx(|| "moving the saved VM".into())?)
        });
        if let Err(e) = r {
            let _ = std::fs::remove_dir_all(&part);
            return Err(crate::error::during("saving the VM to disk", &e));
        }
        self.stop_processes(&paths.dir);
        let _ = std::fs::remove_file(self.ram_file(&rec.id));
        Ok(())
    }

    fn wake(&self, rec: &SandboxRecord, paths: &SandboxPaths) -> Result<(), ApiError> {
        let dir = self.suspended_dir(&rec.id);
        let r = (|| {
            let saved = read_saved(&dir.join("vm.json"))?;
            let info = saved.info(saved.ram.is_some() || !self.anon_ram());
            match saved.ram.as_deref() {
                Some(ram) => self.start(
                    rec,
                    paths,
                    &info,
                    Mem::Own { fill: Some(ram) },
                    Some(Incoming::Stream {
                        file: &dir.join("dev"),
                        ignore_shared: true,
                    }),
                    None,
                ),
                None => self.start(
                    rec,
                    paths,
                    &info,
                    Mem::Own { fill: None },
                    Some(Incoming::Stream {
                        file: &dir.join("full"),
                        ignore_shared: false,
                    }),
                    None,
                ),
            }
        })();
        match r {
            Ok(()) => {
                let _ = std::fs::remove_dir_all(&dir);
                Ok(())
            }
            Err(e) => {
                // Still suspended: the saved state stays for another try.
                self.stop_processes(&paths.dir);
                let _ = std::fs::remove_file(self.ram_file(&rec.id));
                Err(crate::error::during("resuming the VM from disk", &e))
            }
        }
    }

    fn destroy(&self, rec: &SandboxRecord, paths: &SandboxPaths) -> Result<(), ApiError> {
        self.stop_processes(&paths.dir);
        let _ = std::fs::remove_file(self.ram_file(&rec.id));
        let _ = std::fs::remove_dir_all(self.suspended_dir(&rec.id));
        let _ = std::fs::remove_file(&paths.channel);
        Ok(())
    }

    /// QEMU killed for going over the memory limit (the guest's own OOM killer acts
    /// inside it first, on its memory).
    fn oom_kills(&self, rec: &SandboxRecord) -> u64 {
        cgroup::oom_kills(self.cgroups, &cgroup::sandbox_cgroup_path(&rec.id))
    }

    fn housekeeping(&self, paths: &SandboxPaths) {
        cap_console(&paths.dir.join("console.log"), CONSOLE_MAX);
        shares::cap_logs(&paths.dir, CONSOLE_MAX);
    }

    fn start_log(&self, paths: &SandboxPaths) -> Option<String> {
        let text = std::fs::read_to_string(paths.dir.join("console.log")).ok()?;
        let lines: Vec<&str> = text.lines().rev().take(8).collect();
        Some(lines.into_iter().rev().collect::<Vec<_>>().join(" | "))
    }

    /// A guest boots before aether answers: about 2 s under TCG on an idle host, far more
    /// when many boot at once on few cores.
    fn start_timeout(&self) -> Duration {
        match self.accel {
            Accel::Kvm => Duration::from_secs(30),
            Accel::Tcg => Duration::from_secs(120),
        }
    }
}

/// Most bytes of a VM's console kept on the host: a guest that writes to its serial port
/// without end does not fill the node's disk.
pub const CONSOLE_MAX: u64 = 4 << 20;

/// Cuts `path` (a console log QEMU appends to) to nothing once it is over `max` bytes,
/// leaving a line that says so.
pub fn cap_console(path: &Path, max: u64) {
    if std::fs::metadata(path).is_ok_and(|m| m.len() > max)
        && let Ok(f) = std::fs::OpenOptions::new().write(true).open(path)
    {
        let _ = f.set_len(0);
        let _ = std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .and_then(|mut f| {
                use std::io::Write;
                writeln!(f, "[dsec: console output over {max} bytes was cut here]")
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_console_log_over_its_cap_is_cut() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("console.log");
        std::fs::write(&p, vec![b'x'; 2000]).unwrap();
        cap_console(&p, 4000);
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 2000);
        std::fs::write(&p, vec![b'x'; 5000]).unwrap();
        cap_console(&p, 4000);
        let left = std::fs::read_to_string(&p).unwrap();
        assert!(
            left.starts_with("[dsec: console output over 4000 bytes"),
            "{left}"
        );
    }
}
