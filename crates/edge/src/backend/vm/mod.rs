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
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dsec_common::api::{BackendStatus, Capability};
use dsec_common::{ApiError, ErrorCode, IoContext, IoFailure};
use dsec_image::ImageStore;
use dsec_image::guest;

mod mapped;
pub(crate) mod net;
mod qmp;

pub use qmp::QmpError;
mod shares;

use qmp::Qmp;
use shares::stop_shares;

use super::detached::{
    alive, copy_sparse, kill, new_session, read_json, read_pid, spawn_detached, write_json,
};
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

/// How a VM's CPU is run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }

    /// KVM when `/dev/kvm` is there and the CPU has hardware virtualisation behind it
    /// (`vmx`/`svm` and the kvm_intel/kvm_amd module); anything else (e.g. a paravirtual
    /// KVM module that cannot run an unmodified guest) gets TCG.
    pub fn detect() -> Accel {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let flags = cpuinfo
            .lines()
            .find(|l| l.starts_with("flags"))
            .unwrap_or_default();
        let hw = flags.split_whitespace().any(|f| f == "vmx" || f == "svm");
        let module = Path::new("/sys/module/kvm_intel").exists()
            || Path::new("/sys/module/kvm_amd").exists();
        if Path::new("/dev/kvm").exists() && hw && module {
            Accel::Kvm
        } else {
            Accel::Tcg
        }
    }
}

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

/// Machine types the backend knows how to wire: the `-M` value and the virtio transport
/// suffix of its devices.
fn machine(name: &str) -> Option<(&'static str, &'static str)> {
    match name {
        "microvm" => Some(("microvm", "device")),
        "q35" => Some(("q35", "pci")),
        _ => None,
    }
}

fn check_options(o: crate::config::VmOptions) -> Result<crate::config::VmOptions, VmError> {
    if machine(&o.machine).is_none() {
        return Err(VmError::Config(format!(
            "[edge.vm] machine = {:?} is not supported: use \"microvm\" or \"q35\"",
            o.machine
        )));
    }
    if let Some(d) = o
        .devices
        .iter()
        .find(|d| d.is_empty() || d.chars().any(|c| c.is_whitespace() || c.is_control()))
    {
        return Err(VmError::Config(format!(
            "[edge.vm] devices entry {d:?} is not a QEMU -device argument"
        )));
    }
    if !o.run_as.is_empty() && !user_exists(&o.run_as) {
        return Err(VmError::Config(format!(
            "[edge.vm] run_as = {:?} is not a user of this host (QEMU drops to it after start-up; create it, or give \"nobody\")",
            o.run_as
        )));
    }
    Ok(o)
}

/// Whether `name` is in the host's user database.
fn user_exists(name: &str) -> bool {
    let Ok(c) = std::ffi::CString::new(name) else {
        return false;
    };
    // SAFETY: a NUL-terminated name; the result is only checked for NULL.
    !unsafe { libc::getpwnam(c.as_ptr()) }.is_null()
}

/// What QEMU itself needs beyond the guest's memory (device emulation, and under TCG the
/// translated-code cache, capped with `tb-size`).
const QEMU_OVERHEAD_MB: u64 = 256;
const TCG_CACHE_MB: u64 = 128;

/// The `(major, minor)` version `qemu --version` prints; (0, 0) if it prints none.
fn qemu_version(qemu: &Path) -> (u32, u32) {
    let out = Command::new(qemu)
        .arg("--version")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    parse_version(&out).unwrap_or((0, 0))
}

fn parse_version(said: &str) -> Option<(u32, u32)> {
    let v = said
        .lines()
        .next()?
        .strip_prefix("QEMU emulator version ")?;
    let mut parts = v.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

fn find_qemu() -> Result<PathBuf, VmError> {
    for dir in ["/usr/bin", "/usr/local/bin", "/usr/libexec"] {
        let p = Path::new(dir).join("qemu-system-x86_64");
        if p.exists() {
            return Ok(p);
        }
    }
    Err(VmError::Unavailable(
        "qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)".into(),
    ))
}

/// The host's TSC rate in kHz: the guest is told it, so its boot does not stall trying to
/// calibrate against an emulated PIT on a busy host.
fn tsc_khz() -> u64 {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("cpu MHz"))
        .and_then(|l| l.split(':').nth(1))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|mhz| (mhz * 1000.0) as u64)
        .unwrap_or(2_000_000)
}

/// Where a VM's memory comes from when QEMU starts.
enum Mem<'a> {
    /// Its own: anonymous memory where forks are captured with `mapped-ram`, else a file
    /// in the RAM directory mapped shared (what a snapshot can leave out and copies can
    /// map); `fill` is such a file's saved content, copied into it first (a resume from
    /// disk of a VM saved that way).
    Own { fill: Option<&'a Path> },
    /// A fork copy: the template's file mapped private, so pages stay shared with the
    /// other copies until written.
    Template(&'a Path),
    /// A fork copy from a `mapped-ram` save: its pages mapped private from `offset`.
    Mapped { file: &'a Path, offset: u64 },
}

/// What a VM started to receive a saved state loads.
enum Incoming<'a> {
    /// A migration stream; with `ignore_shared`, one that left out memory in a shared file.
    Stream { file: &'a Path, ignore_shared: bool },
    /// A `mapped-ram` file whose memory the VM maps ([`Mem::Mapped`]).
    Mapped(&'a Path),
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

/// What a saved VM is, written next to its state as `vm.json`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct SavedVm {
    /// The root disk the guest had (its page cache is in the saved memory, so a restore
    /// must get the same disk even if the image's disk has been rebuilt since).
    disk: PathBuf,
    /// The root's other disks (its layers, below `disk`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    lowers: Vec<PathBuf>,
    mem_mb: u64,
    cpus: u64,
    /// `shared`: `dev` holds the device state and `ram` the memory file;
    /// `full`: `full` holds both (the VM's memory was private, e.g. a fork copy);
    /// `mapped`: `ram` is a `mapped-ram` save of both, which copies map.
    kind: String,
    /// The memory file of a `shared` or `mapped` save, when it lives outside the saved
    /// directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ram: Option<PathBuf>,
    /// The guest kernel's release: a restore needs the same kernel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    kernel: Option<String>,
    #[serde(default = "default_machine")]
    machine: String,
    #[serde(default)]
    net: bool,
    /// A `mapped` save planned and not yet made ([`Backend::plan_snapshot`]): copies may
    /// start on `ram`, and wait until this is gone before they load it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pending: bool,
}

impl SavedVm {
    /// A save of the VM `info` describes just made: `shared` with its memory file `ram`,
    /// else `full`.
    fn of(info: VmInfo, ram: Option<&Path>, kernel: Option<String>) -> SavedVm {
        SavedVm {
            disk: info.disk,
            lowers: info.lowers,
            mem_mb: info.mem_mb,
            cpus: info.cpus,
            kind: if ram.is_some() { "shared" } else { "full" }.into(),
            ram: ram.map(Path::to_path_buf),
            kernel,
            machine: info.machine,
            net: info.net,
            pending: false,
        }
    }

    /// The VM this save restores into; `shared_ram` says how its memory will be held.
    fn info(&self, shared_ram: bool) -> VmInfo {
        VmInfo {
            disk: self.disk.clone(),
            lowers: self.lowers.clone(),
            mem_mb: self.mem_mb,
            cpus: self.cpus,
            shared_ram,
            machine: self.machine.clone(),
            net: self.net,
            shares: 0,
        }
    }
}

/// The files a saved VM is made of, as another edge receives them (and its disks,
/// [`moved_disk::is_name`]).
const SAVED_FILES: &[&str] = &["vm.json", "dev", "full", "ram"];

/// The VM's own description (`<sandbox dir>/vm.json`): what a save and a restart need.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct VmInfo {
    /// The root's top disk: the stage of [`guest::ensure_root_disks`] (or, in a VM saved
    /// before roots were layered, its one ext4 disk).
    disk: PathBuf,
    /// The root's other disks, top first: the image's layers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    lowers: Vec<PathBuf>,
    mem_mb: u64,
    cpus: u64,
    /// Whether its memory is its own shared file (else a private mapping of a template).
    shared_ram: bool,
    /// QEMU's machine type (a restore needs the same one).
    #[serde(default = "default_machine")]
    machine: String,
    /// Whether it has a network device (in the sandbox's namespace).
    #[serde(default)]
    net: bool,
    /// How many volumes it mounts (virtio-fs devices `dsec_v<i>`, each served by a
    /// virtiofsd of its own). Such a VM is never saved (see [`refuse_saving`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    shares: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// A VM that mounts volumes cannot be saved: a virtio-fs device's state is its daemon's
/// (open files, locks), which QEMU's migration cannot carry, so QEMU refuses it.
fn refuse_saving(rec: &SandboxRecord, what: &str) -> Result<(), ApiError> {
    if rec.volumes.is_empty() {
        return Ok(());
    }
    Err(ApiError::precondition(format!(
        "sandbox {} mounts volumes, and a vm sandbox that mounts volumes cannot be {what} (its shared-filesystem devices cannot be saved with it); use a container sandbox, or a vm without volumes",
        rec.id
    )))
}

fn default_machine() -> String {
    "microvm".into()
}

/// How long saving or loading a VM's state may take (the memory goes through it when the
/// VM's pages are private).
const SAVE_TIMEOUT: Duration = Duration::from_secs(120);

/// QEMU's drives and block devices for the VM's root disks: read-only, the top one
/// `root` (as VMs saved with a single disk had it), each layered one with the serial
/// that tells the guest's `/init` its place ([`guest::disk_serial`]).
fn drive_args(info: &VmInfo, bus: &str) -> Vec<String> {
    let layered = !info.lowers.is_empty();
    let mut out = Vec::new();
    for (i, d) in std::iter::once(&info.disk).chain(&info.lowers).enumerate() {
        let id = if i == 0 {
            "root".to_string()
        } else {
            format!("root{i}")
        };
        out.push("-drive".into());
        out.push(format!(
            "id={id},file={},format=raw,if=none,readonly=on",
            d.display()
        ));
        out.push("-device".into());
        out.push(if layered {
            format!(
                "virtio-blk-{bus},drive={id},serial={}",
                guest::disk_serial(i)
            )
        } else {
            format!("virtio-blk-{bus},drive={id}")
        });
    }
    out
}

/// The command line of a template that takes a live migration of the VM whose command
/// line is `own` (see [`VmBackend::live_save`]): the same machine and devices, its files
/// moved from `dir` into `tdir`, its memory `ram` (shared, so it ends in the file), its NIC
/// on the tap it is given as descriptor 3 (the VM's own tap stays the VM's), and waiting
/// stopped for an incoming migration.
fn template_args(
    own: &[String],
    dir: &Path,
    tdir: &Path,
    ram: &Path,
) -> Result<Vec<String>, VmError> {
    let (from, to) = (dir.to_string_lossy(), tdir.to_string_lossy());
    let mut out = Vec::with_capacity(own.len() + 4);
    let mut it = own.iter();
    let mut mem = false;
    while let Some(a) = it.next() {
        match a.as_str() {
            "-S" => continue,
            "-incoming" => {
                it.next();
                continue;
            }
            _ => {}
        }
        let a = if a.starts_with("memory-backend-file,") {
            mem = true;
            a.split(',')
                .map(|o| {
                    if o.starts_with("mem-path=") {
                        format!("mem-path={}", ram.display())
                    } else if o.starts_with("share=") {
                        "share=on".to_string()
                    } else {
                        o.to_string()
                    }
                })
                .collect::<Vec<_>>()
                .join(",")
        } else if a.starts_with("tap,") {
            let id = a
                .split(',')
                .find_map(|o| o.strip_prefix("id="))
                .unwrap_or("net0");
            format!("tap,id={id},fd=3")
        } else {
            a.replace(from.as_ref(), to.as_ref())
        };
        out.push(a);
    }
    if !mem {
        return Err(VmError::Refused("the VM's memory is not a file".into()));
    }
    out.extend(["-incoming".into(), "defer".into(), "-S".into()]);
    Ok(out)
}

/// The QMP connection of the QEMU just started as `child`: once its socket `qmp` is there
/// (QEMU makes it during start-up), or its log `log` as the error if it exited first.
fn qmp_of_child(child: &mut std::process::Child, qmp: &Path, log: &Path) -> Result<Qmp, VmError> {
    let t0 = Instant::now();
    while !qmp.exists() {
        if let Ok(Some(status)) = child.try_wait() {
            let said = std::fs::read_to_string(log).unwrap_or_default();
            return Err(VmError::NotStarted {
                status: status.to_string(),
                said: said.trim().to_string(),
            });
        }
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(VmError::Timeout {
                what: "QEMU's QMP socket".into(),
                secs: 30,
            });
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(Qmp::connect(qmp, Duration::from_secs(10))?)
}

/// The kernel and initramfs every VM boots, found (or built) once per edge.
#[derive(Default)]
struct BootFiles(std::sync::Mutex<Option<(guest::Kernel, PathBuf)>>);

impl BootFiles {
    fn get(&self, images: &ImageStore) -> Result<(guest::Kernel, PathBuf), VmError> {
        let mut b = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = b.as_ref() {
            return Ok(k.clone());
        }
        let root = images.root();
        let kernel = guest::ensure_kernel(root)?;
        let initrd = guest::ensure_initramfs(root, &kernel)?;
        *b = Some((kernel.clone(), initrd.clone()));
        Ok((kernel, initrd))
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

    fn qmp_of(&self, id: &str) -> Result<Qmp, VmError> {
        Ok(Qmp::connect(
            &self.sandboxes.join(id).join("vm.qmp"),
            Duration::from_secs(5),
        )?)
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

    /// Starts QEMU (and the channel's host end) for a sandbox: booting, or, with
    /// `incoming`, loading a saved state (`(file, ignore_shared)`) and continuing it.
    fn start(
        &self,
        rec: &SandboxRecord,
        paths: &SandboxPaths,
        info: &VmInfo,
        mem: Mem<'_>,
        incoming: Option<Incoming<'_>>,
        ready: Option<&dyn Fn() -> Result<(), VmError>>,
    ) -> Result<(), VmError> {
        let qemu = self.qemu()?;
        let aether = self.aether()?;
        let (kernel, initrd) = self.boot_files()?;
        let dir = &paths.dir;
        let chardev = dir.join("vm.chardev");
        let wake = dir.join("vm.wake");
        let qmp = dir.join("vm.qmp");
        let qemu_pid = dir.join("qemu.pid");
        std::fs::create_dir_all(&self.ram_dir)
            .ctx(|| format!("creating {}", self.ram_dir.display()))?;
        // The guest's memory: a file, so that a snapshot can leave it out (the file is the
        // memory) and fork copies map it copy-on-write; or anonymous, where copies map a
        // `mapped-ram` save instead. No prealloc or mlock, which would touch every page
        // and end the sharing.
        let size = info.mem_mb;
        if info.shares > 0 && (incoming.is_some() || !matches!(mem, Mem::Own { fill: None })) {
            return Err(VmError::Refused(
                "a VM that mounts volumes is never restored from a save".into(),
            ));
        }
        let memory = match mem {
            // A virtio-fs daemon maps the guest's memory: it must be shareable.
            Mem::Own { fill: None } if self.anon_ram() && info.shares > 0 => {
                format!("memory-backend-memfd,id=mem,size={size}M,share=on")
            }
            Mem::Own { fill: None } if self.anon_ram() => {
                format!("memory-backend-ram,id=mem,size={size}M")
            }
            Mem::Own { fill } => {
                let own = self.ram_file(&rec.id);
                if let Some(src) = fill {
                    copy_sparse(src, &own)?;
                }
                format!(
                    "memory-backend-file,id=mem,size={size}M,mem-path={},share=on",
                    own.display()
                )
            }
            Mem::Template(t) => format!(
                "memory-backend-file,id=mem,size={size}M,mem-path={},share=off",
                t.display()
            ),
            Mem::Mapped { file, offset } => format!(
                "memory-backend-file,id=mem,size={size}M,mem-path={},offset={offset},share=off",
                file.display()
            ),
        };
        write_json(&dir.join("vm.json"), info)?;
        let mut append = format!(
            "console=ttyS0 quiet panic=-1 tsc_early_khz={} tsc=reliable random.trust_cpu=on dsec.rw_mb={} dsec.pids={}",
            tsc_khz(),
            rec.limits.disk_mb,
            rec.limits.pids
        );
        if !info.lowers.is_empty() {
            append.push(' ');
            append.push_str(&guest::root_cmdline(1 + info.lowers.len()));
        }
        if info.net {
            append.push(' ');
            append.push_str(&net::cmdline());
        }
        let opts = self.options()?;
        let (machine_type, bus) = machine(&info.machine).ok_or_else(|| {
            VmError::Refused(format!("machine type {:?} is not supported", info.machine))
        })?;
        let mut cmd = Command::new(qemu);
        let accel = match self.accel {
            Accel::Kvm => "kvm".to_string(),
            Accel::Tcg => format!("tcg,tb-size={TCG_CACHE_MB}"),
        };
        cmd.args([
            "-M",
            &format!("{machine_type},memory-backend=mem"),
            "-accel",
            &accel,
            "-cpu",
            "max",
        ])
        .args([
            "-m",
            &format!("{}M", info.mem_mb),
            "-smp",
            &info.cpus.to_string(),
        ])
        .args(["-object", &memory])
        .args([
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
        ])
        // QEMU's own seccomp filter: no obsolete system calls, no fork or exec (migrations
        // go to descriptors handed over QMP), no scheduler or affinity changes, and no
        // set*id once it runs as `run_as` (it drops to it itself, after the filter is in,
        // so set*id stays allowed for that one step; without `run_as`, never). It runs
        // detached by the edge rather than `-daemonize` (which forks).
        .args([
            "-sandbox",
            if opts.run_as.is_empty() {
                "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
            } else {
                "on,obsolete=deny,spawn=deny,resourcecontrol=deny"
            },
        ])
        .args(match (opts.run_as.as_str(), self.qemu_version >= (9, 1)) {
            ("", _) => vec![],
            (user, true) => vec!["-run-with".to_string(), format!("user={user}")],
            (user, false) => vec!["-runas".to_string(), user.to_string()],
        })
        .arg("-pidfile")
        .arg(&qemu_pid)
        // Appending, so the edge can cut the file short ([`cap_console`]) and QEMU goes on
        // writing from its new end.
        .arg("-chardev")
        .arg(format!(
            "file,id=console0,append=on,path={}",
            dir.join("console.log").display()
        ))
        .args(["-serial", "chardev:console0"])
        .arg("-kernel")
        .arg(&kernel.vmlinuz)
        .arg("-initrd")
        .arg(&initrd)
        .args(["-append", &append])
        .args(drive_args(info, bus))
        // Entropy from the host: without it the guest's CRNG can take minutes to initialise
        // under TCG, and getrandom() (Python's start-up) blocks until then.
        .args(["-object", "rng-random,id=rng,filename=/dev/urandom"])
        .args(["-device", &format!("virtio-rng-{bus},rng=rng")])
        .args(["-device", &format!("virtio-serial-{bus}")])
        .arg("-chardev")
        .arg(format!(
            "socket,id=ch,path={},server=on,wait=off",
            chardev.display()
        ))
        .args([
            "-device",
            &format!("virtserialport,chardev=ch,name={}", "dsec.channel"),
        ])
        // A chardev with no device: connecting to it only wakes QEMU's main loop (see
        // dsec-aether vmux).
        .arg("-chardev")
        .arg(format!(
            "socket,id=wake,path={},server=on,wait=off",
            wake.display()
        ))
        .arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", qmp.display()))
        .args(opts.devices.iter().flat_map(|d| ["-device", d.as_str()]))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
        // The sandbox's limits hold for QEMU as a whole, from its first allocation.
        let overhead = QEMU_OVERHEAD_MB
            + match self.accel {
                Accel::Kvm => 0,
                Accel::Tcg => TCG_CACHE_MB,
            };
        let procs = cgroup::create_leaf(
            self.cgroups,
            &cgroup::sandbox_cgroup_path(&rec.id),
            cgroup::LeafLimits {
                cpu_quota_us: cgroup::own::quota_us(rec.limits.cpu_cores),
                memory_bytes: (info.mem_mb + overhead) << 20,
                pids: 1024,
            },
        )?;
        cgroup::own::join_before_exec(&mut cmd, &procs)?;
        if info.shares > 0 {
            // virtiofsd (libvhost-user) serves modern virtio only, and microvm's
            // virtio-mmio devices are legacy unless told otherwise.
            if bus == "device" {
                cmd.args(["-global", "virtio-mmio.force-legacy=false"]);
            }
            for (i, sock) in self.start_shares(rec, dir, &procs)?.iter().enumerate() {
                cmd.arg("-chardev")
                    .arg(format!("socket,id=vfs{i},path={}", sock.display()))
                    .args([
                        "-device",
                        &format!(
                            "vhost-user-fs-{bus},chardev=vfs{i},tag={}",
                            crate::volumes::share_tag(i)
                        ),
                    ]);
            }
        }
        // With a network, QEMU runs in the sandbox's namespace, next to its tap.
        let _netns = if info.net {
            let node_side = rec
                .network
                .as_ref()
                .and_then(|n| n.gateway.clone())
                .ok_or_else(|| VmError::Refused("the VM has a network device, so it needs a network (it was saved with one; not network \"none\")".into()))?;
            net::setup(&crate::net::link::netns_name(&rec.id), &node_side)?;
            let f = std::fs::File::open(crate::net::link::netns_path(&rec.id)?)
                .ctx(|| "opening the sandbox's network namespace".into())?;
            let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
            // SAFETY: setns(2) between fork and exec on a descriptor that stays open
            // until the command has run.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                    if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            cmd.args(net::qemu_args(bus));
            Some(f)
        } else {
            None
        };
        // Never run the guest before the channel's host end is connected: output the
        // guest writes to an unconnected port stalls the port for good (QEMU throttles
        // it and has no socket to wait on), so QEMU starts stopped.
        match incoming {
            Some(_) => cmd.args(["-incoming", "defer"]),
            None => cmd.arg("-S"),
        };
        let _ = std::fs::remove_file(&qmp); // a socket a killed QEMU left
        let qemu_log = dir.join("qemu.log");
        let log =
            std::fs::File::create(&qemu_log).ctx(|| format!("creating {}", qemu_log.display()))?;
        let log2 = log.try_clone().ctx(|| "the QEMU log".into())?;
        cmd.stdin(Stdio::null()).stdout(log).stderr(log2);
        new_session(&mut cmd);
        let mut child = cmd.spawn().ctx(|| format!("starting {}", qemu.display()))?;
        let mut q = qmp_of_child(&mut child, &qmp, &qemu_log)?;
        // The channel's host end, detached like QEMU (it exits when the VM does).
        let vmux_log =
            std::fs::File::create(dir.join("vmux.log")).ctx(|| "creating vmux.log".into())?;
        let mut vmux = Command::new(aether);
        vmux.arg("vmux")
            .arg(&paths.channel)
            .arg(&chardev)
            .arg(&wake)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(vmux_log);
        spawn_detached(&mut vmux, "dsec-aether vmux", &dir.join("vmux.pid"))?;
        // What it loads may still be being written (a fork's copy started early).
        if let Some(ready) = ready {
            ready()?;
        }
        match incoming {
            Some(Incoming::Stream {
                file,
                ignore_shared,
            }) => {
                q.set_ignore_shared(ignore_shared)?;
                q.load(file, SAVE_TIMEOUT)?;
            }
            Some(Incoming::Mapped(file)) => q.load_mapped(file, SAVE_TIMEOUT)?,
            None => {}
        }
        q.wait_connected("ch", Duration::from_secs(10))?;
        q.execute("cont", serde_json::Value::Null)?;
        Ok(())
    }

    fn boot(&self, rec: &SandboxRecord, paths: &SandboxPaths) -> Result<(), VmError> {
        let aether = self.aether()?;
        let mut disks =
            guest::ensure_root_disks(&self.images, guest::DiskSource::Layers(&rec.layers), aether)?
                .into_iter();
        let info = VmInfo {
            disk: disks
                .next()
                .ok_or_else(|| VmError::Refused("the VM has no root disk".into()))?,
            lowers: disks.collect(),
            // The guest's writable layer is a tmpfs inside it, so its disk limit is
            // guest memory.
            mem_mb: rec.limits.memory_mb.max(128) + rec.limits.disk_mb / 4,
            cpus: rec.limits.cpu_cores.ceil().max(1.0) as u64,
            shared_ram: !self.anon_ram(),
            machine: self.options()?.machine.clone(),
            net: rec.network.as_ref().is_some_and(|n| n.gateway.is_some()),
            shares: rec.volumes.len(),
        };
        self.start(rec, paths, &info, Mem::Own { fill: None }, None, None)
    }

    /// A fork copy from a saved VM (see [`VmBackend::save`], [`VmBackend::mapped_save`]).
    fn restore_copy(
        &self,
        rec: &SandboxRecord,
        paths: &SandboxPaths,
        seed: &Path,
    ) -> Result<(), VmError> {
        let mut saved: SavedVm = read_json(&seed.join("vm.json"))?;
        if saved.pending {
            match self.restore_early(rec, paths, seed, &saved) {
                Err(VmError::Replanned) => {
                    // The snapshot came out otherwise: this copy starts over from it.
                    self.stop_processes(&paths.dir);
                    saved = read_json(&seed.join("vm.json"))?;
                }
                done => return done,
            }
        }
        let ram = saved.ram.clone().unwrap_or_else(|| seed.join("ram"));
        let mut info = saved.info(false);
        match saved.kind.as_str() {
            "shared" => self.start(
                rec,
                paths,
                &info,
                Mem::Template(&ram),
                Some(Incoming::Stream {
                    file: &seed.join("dev"),
                    ignore_shared: true,
                }),
                None,
            ),
            "mapped" => {
                let block = mapped::read_mem_of(&ram, info.mem_mb << 20)?;
                self.start(
                    rec,
                    paths,
                    &info,
                    Mem::Mapped {
                        file: &ram,
                        offset: block.pages_offset,
                    },
                    Some(Incoming::Mapped(&ram)),
                    None,
                )
            }
            _ => {
                info.shared_ram = !self.anon_ram();
                self.start(
                    rec,
                    paths,
                    &info,
                    Mem::Own { fill: None },
                    Some(Incoming::Stream {
                        file: &seed.join("full"),
                        ignore_shared: false,
                    }),
                    None,
                )
            }
        }
    }

    /// A fork copy started while its snapshot is taken (`saved`, the plan): QEMU starts on
    /// the planned file at the offset its pages will have, then waits for the snapshot
    /// before it loads it. [`VmError::Replanned`] when the snapshot came out otherwise.
    fn restore_early(
        &self,
        rec: &SandboxRecord,
        paths: &SandboxPaths,
        seed: &Path,
        saved: &SavedVm,
    ) -> Result<(), VmError> {
        let ram = saved
            .ram
            .clone()
            .ok_or_else(|| VmError::Refused("the planned snapshot names no file".into()))?;
        let offset = mapped::planned_pages_offset(saved.mem_mb << 20);
        let info = saved.info(false);
        let wait = || {
            let t0 = Instant::now();
            loop {
                if !seed.is_dir() {
                    return Err(VmError::SnapshotFailed);
                }
                // Absent or still the plan while it is taken (or retaken after a pause).
                if let Ok(now) = read_json::<SavedVm>(&seed.join("vm.json"))
                    && !now.pending
                {
                    if now.kind != "mapped" || now.ram.as_deref() != Some(ram.as_path()) {
                        return Err(VmError::Replanned);
                    }
                    return match mapped::read_mem_of(&ram, saved.mem_mb << 20) {
                        Ok(b) if b.pages_offset == offset => Ok(()),
                        Ok(_) => Err(VmError::Replanned),
                        Err(e) => Err(e.into()),
                    };
                }
                if t0.elapsed() > SAVE_TIMEOUT {
                    return Err(VmError::Timeout {
                        what: "the fork's snapshot".into(),
                        secs: SAVE_TIMEOUT.as_secs(),
                    });
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        };
        self.start(
            rec,
            paths,
            &info,
            Mem::Mapped { file: &ram, offset },
            Some(Incoming::Mapped(&ram)),
            Some(&wait),
        )
    }

    /// Saves a stopped VM into `dest`: its device state and a copy of its memory file
    /// (`ram_to`, sparse) when its memory is its own shared file, or one stream with
    /// the memory in it when its pages are private. The VM stays stopped, and may go on
    /// (`cont`) afterwards: its own file is never mapped by anything restored from this.
    fn save(&self, rec: &SandboxRecord, dest: &Path, ram_to: &Path) -> Result<(), VmError> {
        let dir = self.sandboxes.join(&rec.id);
        let info: VmInfo = read_json(&dir.join("vm.json"))?;
        std::fs::create_dir_all(dest).ctx(|| format!("creating {}", dest.display()))?;
        let kernel = Some(self.boot_files()?.0.version);
        let mut q = self.qmp_of(&rec.id)?;
        if self.qemu_version >= (9, 0) {
            // Left on by a mapped-ram capture an edge died in; a stream save refuses them.
            let _ = q.set_caps(&[("mapped-ram", false), ("multifd", false)]);
        }
        q.set_ignore_shared(info.shared_ram)?;
        let saved = if info.shared_ram {
            q.save(&dest.join("dev"), SAVE_TIMEOUT)?;
            copy_sparse(&self.ram_file(&rec.id), ram_to)?;
            SavedVm::of(info, Some(ram_to), kernel)
        } else {
            q.save(&dest.join("full"), SAVE_TIMEOUT)?;
            SavedVm::of(info, None, kernel)
        };
        Ok(write_json(&dest.join("vm.json"), &saved)?)
    }

    /// [`VmBackend::save`] of a running VM (`info`, its `vm.json`) without stopping it
    /// for the memory copy: a template QEMU with the VM's own command line (see
    /// [`template_args`]) takes a live migration of the VM over a socket pair; the VM is stopped only for the last dirty pages and its device state, then
    /// continues. The template, now holding the memory, saves its device state
    /// (`x-ignore-shared`) into `dest` and quits. Returns the ms the VM stood still.
    fn live_save(
        &self,
        rec: &SandboxRecord,
        info: VmInfo,
        dest: &Path,
        ram_to: &Path,
    ) -> Result<u64, VmError> {
        let dir = self.sandboxes.join(&rec.id);
        let pid = read_pid(&dir.join("qemu.pid"))
            .ok_or_else(|| VmError::Refused("the VM has no pid file".into()))?;
        let own = std::fs::read(format!("/proc/{pid}/cmdline"))
            .ctx(|| "reading the VM's command line".into())?;
        let own: Vec<String> = own
            .split(|&b| b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let tdir = dir.join("fork-template");
        // One left by an edge that died mid-capture, still waiting for its migration.
        kill(&tdir.join("qemu.pid"));
        let _ = std::fs::remove_dir_all(&tdir);
        std::fs::create_dir_all(&tdir).ctx(|| format!("creating {}", tdir.display()))?;
        let args = template_args(&own, &dir, &tdir, ram_to)?;
        let (qemu, rest) = args
            .split_first()
            .ok_or_else(|| VmError::Refused("the VM's command line is empty".into()))?;
        let log = std::fs::File::create(tdir.join("qemu.log"))
            .ctx(|| "creating the template's log".into())?;
        let log2 = log.try_clone().ctx(|| "the template's log".into())?;
        let mut cmd = Command::new(qemu);
        cmd.args(rest).stdin(Stdio::null()).stdout(log).stderr(log2);
        // Its NIC's backend: a tap like the VM's (the migrated device wants one with
        // headers), in a namespace of nobody's, on descriptor 3.
        let tap = if info.net {
            Some(net::detached_tap()?)
        } else {
            None
        };
        if let Some(t) = &tap {
            let fd = std::os::fd::AsRawFd::as_raw_fd(t);
            // SAFETY: dup2 between fork and exec onto descriptor 3, which the command line
            // names; the source stays open until the spawn is done.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                    if libc::dup2(fd, 3) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let mut child = cmd.spawn().ctx(|| "starting the template QEMU".into())?;
        drop(tap);
        let said = || {
            let log = std::fs::read_to_string(tdir.join("qemu.log")).unwrap_or_default();
            log.trim().to_string()
        };
        let r = (|| {
            let t0 = Instant::now();
            let mut t = qmp_of_child(&mut child, &tdir.join("vm.qmp"), &tdir.join("qemu.log"))?;
            let (a, b) = std::os::unix::net::UnixStream::pair()
                .ctx(|| "a socket pair for the migration".into())?;
            t.give_fd("dsec-live", &b)?;
            t.execute(
                "migrate-incoming",
                serde_json::json!({ "uri": "fd:dsec-live" }),
            )?;
            let spawned = t0.elapsed();
            let mut q = self.qmp_of(&rec.id)?;
            q.set_ignore_shared(false)?;
            let stalled = q.migrate_live(&a, crate::config::LIVE_FORK_WITHIN)?;
            drop((a, b));
            let migrated = t0.elapsed();
            let state = t.wait_loaded(SAVE_TIMEOUT).map_err(|e| VmError::Template {
                why: e.to_string(),
                said: said(),
            })?;
            if state == "running" {
                return Err(VmError::Template {
                    why: "it ran the migrated VM instead of holding it".into(),
                    said: said(),
                });
            }
            t.set_ignore_shared(true)?;
            t.save(&dest.join("dev"), SAVE_TIMEOUT)?;
            let _ = t.execute("quit", serde_json::Value::Null);
            tracing::info!(
                sandbox = %rec.id,
                template_up_ms = spawned.as_millis() as u64,
                migrated_ms = (migrated - spawned).as_millis() as u64,
                saved_ms = (t0.elapsed() - migrated).as_millis() as u64,
                stalled_ms = stalled,
                "captured live"
            );
            Ok::<u64, VmError>(stalled)
        })();
        let _ = child.kill();
        let _ = child.wait();
        let _ = std::fs::remove_dir_all(&tdir);
        let stalled = r?;
        let kernel = Some(self.boot_files()?.0.version);
        write_json(
            &dest.join("vm.json"),
            &SavedVm::of(info, Some(ram_to), kernel),
        )?;
        Ok(stalled)
    }

    /// [`VmBackend::save`] of a running VM into one `mapped-ram` file, `file` (in the RAM
    /// directory), while the VM runs: it stands still only for its last dirty pages and
    /// its device state (a few ms), then goes on; the file is then sealed
    /// ([`mapped::seal`]) for copies to map. Returns the ms the VM stood still.
    fn mapped_save(&self, rec: &SandboxRecord, dest: &Path, file: &Path) -> Result<u64, VmError> {
        let info: VmInfo = read_json(&self.sandboxes.join(&rec.id).join("vm.json"))?;
        let kernel = Some(self.boot_files()?.0.version);
        let out = new_mapped_file(file, info.mem_mb << 20)?;
        let mut q = self.qmp_of(&rec.id)?;
        let t0 = Instant::now();
        let stalled = q.migrate_mapped(&out, crate::config::LIVE_FORK_WITHIN)?;
        let saved_at = t0.elapsed();
        drop(out);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(file)
            .ctx(|| format!("opening {}", file.display()))?;
        mapped::seal(&f, info.mem_mb << 20)?;
        tracing::info!(
            sandbox = %rec.id,
            saved_ms = saved_at.as_millis() as u64,
            sealed_ms = (t0.elapsed() - saved_at).as_millis() as u64,
            stalled_ms = stalled,
            "captured with mapped-ram"
        );
        let mut saved = SavedVm::of(info, Some(file), kernel);
        saved.kind = "mapped".into();
        write_json(&dest.join("vm.json"), &saved)?;
        Ok(stalled)
    }

    /// See [`Backend::plan_snapshot`]: with `mapped` capture, the snapshot's file is made
    /// now (copies starting early open it) and `dest/vm.json` says it is pending.
    fn plan(&self, rec: &SandboxRecord, dest: &Path) -> Result<(), VmError> {
        let info: VmInfo = read_json(&self.sandboxes.join(&rec.id).join("vm.json"))?;
        let kernel = Some(self.boot_files()?.0.version);
        std::fs::create_dir_all(dest).ctx(|| format!("creating {}", dest.display()))?;
        let ram = self
            .ram_dir
            .join(format!("seed-{}-{}.mr", rec.id, crate::random_hex(8)));
        new_mapped_file(&ram, info.mem_mb << 20)?;
        let mut saved = SavedVm::of(info, Some(&ram), kernel);
        saved.kind = "mapped".into();
        saved.pending = true;
        Ok(write_json(&dest.join("vm.json"), &saved).inspect_err(|_| {
            let _ = std::fs::remove_file(&ram);
        })?)
    }

    fn suspended_dir(&self, id: &str) -> PathBuf {
        self.sandboxes.join(id).join(super::SUSPENDED_DIR)
    }

    fn stop_processes(&self, dir: &Path) {
        kill(&dir.join("qemu.pid"));
        // A live capture's template, if an edge died during one.
        kill(&dir.join("fork-template").join("qemu.pid"));
        kill(&dir.join("vmux.pid"));
        for f in ["qemu.pid", "vmux.pid", "vm.chardev", "vm.wake", "vm.qmp"] {
            let _ = std::fs::remove_file(dir.join(f));
        }
        stop_shares(dir);
        if let Some(id) = dir.file_name() {
            let rel = cgroup::sandbox_cgroup_path(&id.to_string_lossy());
            // A killed QEMU can take a moment (seconds, nested) to leave its cgroup.
            cgroup::empty_and_remove(self.cgroups, &rel, Duration::from_secs(30));
        }
    }

    fn qmp(&self, rec: &SandboxRecord, command: &str) -> Result<(), ApiError> {
        let mut q = self
            .qmp_of(&rec.id)
            .map_err(|e| ApiError::unavailable(format!("the VM's control socket: {e}")))?;
        q.execute(command, serde_json::Value::Null)?;
        Ok(())
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
            let ram = read_json::<SavedVm>(&dest.join("vm.json"))
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
        let mut saved: SavedVm =
            read_json(&dest.join("vm.json")).map_err(|e| fail(e.to_string()))?;
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
        if let Ok(saved) = read_json::<SavedVm>(&dest.join("vm.json"))
            && let Some(ram) = saved.ram
        {
            // Copies map it; their pages stay until the last one ends.
            let _ = std::fs::remove_file(ram);
        }
    }

    fn saved_files(&self, saved: &Path) -> Result<Vec<SavedFile>, ApiError> {
        let bad = |e: String| ApiError::internal(format!("reading the saved VM: {e}"));
        let vm: SavedVm = read_json(&saved.join("vm.json")).map_err(|e| bad(e.to_string()))?;
        let mut out =
            vec![SavedFile::at("vm.json", saved.join("vm.json")).map_err(|e| bad(e.to_string()))?];
        // A mapped-ram save is one file, `ram`.
        let state = match vm.kind.as_str() {
            "shared" => Some("dev"),
            "mapped" => None,
            _ => Some("full"),
        };
        if let Some(state) = state {
            out.push(SavedFile::at(state, saved.join(state)).map_err(|e| bad(e.to_string()))?);
        }
        let ram = vm
            .ram
            .clone()
            .or_else(|| (vm.kind != "full").then(|| saved.join("ram")));
        if let Some(ram) = ram {
            out.push(SavedFile::at("ram", ram).map_err(|e| bad(e.to_string()))?);
        }
        out.extend(moved_disk::saved_files(&vm.disk, &vm.lowers).map_err(|e| bad(e.to_string()))?);
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
        let mut vm: SavedVm = read_json(&staged.join("vm.json")).map_err(|e| bad(e.to_string()))?;
        let state = match vm.kind.as_str() {
            "shared" => "dev",
            "full" => "full",
            "mapped" => "ram",
            k => return Err(bad(format!("unknown kind {k:?}"))),
        };
        if !staged.join(state).is_file() {
            return Err(bad(format!("{state} is missing")));
        }
        if machine(&vm.machine).is_none() {
            return Err(bad(format!("unknown machine type {:?}", vm.machine)));
        }
        if vm.mem_mb == 0 || vm.mem_mb > 1 << 20 || vm.cpus == 0 || vm.cpus > 256 {
            return Err(bad(format!(
                "{} MiB and {} cpus is not a VM",
                vm.mem_mb, vm.cpus
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
        vm.ram = match vm.kind.as_str() {
            "mapped" => {
                // Copies map its pages at the offset its header gives: a header that does
                // not fit the memory size, or a file short of the pages, goes no further.
                mapped::read_mem_of(&staged.join("ram"), vm.mem_mb << 20)
                    .map_err(|e| bad(e.to_string()))?;
                Some(home.join("ram"))
            }
            "shared" if staged.join("ram").is_file() => Some(home.join("ram")),
            "shared" => return Err(bad("ram is missing".into())),
            _ => None,
        };
        (vm.disk, vm.lowers) = moved_disk::place(self.images.root(), staged, files, have)
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
            let mut saved: SavedVm = read_json(&part.join("vm.json"))?;
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
            let saved: SavedVm = read_json(&dir.join("vm.json"))?;
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

/// A new file for a `mapped-ram` save of a guest memory of `mem_bytes`, open for writing
/// only (how QEMU takes it), the edge's alone (QEMU opens what maps it before it drops to
/// its user, and is handed descriptors for the rest), and as long as a copy maps: a copy
/// that starts before the save is written would otherwise extend it itself, racing the
/// save's own writes.
fn new_mapped_file(path: &Path, mem_bytes: u64) -> Result<std::fs::File, VmError> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .ctx(|| format!("creating {}", path.display()))?;
    let len = mapped::planned_pages_offset(mem_bytes) + mem_bytes;
    if f.metadata().map(|m| m.len()).unwrap_or(0) < len {
        f.set_len(len)
            .ctx(|| format!("sizing {}", path.display()))?;
    }
    Ok(f)
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
    use crate::config::VmOptions;

    #[test]
    fn qemu_versions_are_read() {
        let v = "QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)\nCopyright";
        assert_eq!(parse_version(v), Some((10, 0)));
        assert_eq!(
            parse_version("QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7)"),
            Some((7, 2))
        );
        assert_eq!(parse_version("qemu-system-x86_64: not found"), None);
        assert_eq!(parse_version(""), None);
    }

    #[test]
    fn a_template_has_the_vms_command_line_with_its_own_files() {
        let own: Vec<String> = [
            "/usr/bin/qemu-system-x86_64",
            "-object",
            "memory-backend-file,id=mem,size=256M,mem-path=/dev/shm/dsec-vm/a.ram,share=on",
            "-pidfile",
            "/d/sandboxes/a/qemu.pid",
            "-qmp",
            "unix:/d/sandboxes/a/vm.qmp,server=on,wait=off",
            "-netdev",
            "tap,id=net0,ifname=tap0,script=no,downscript=no",
            "-incoming",
            "defer",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let t = template_args(
            &own,
            Path::new("/d/sandboxes/a"),
            Path::new("/d/sandboxes/a/fork-template"),
            Path::new("/dev/shm/dsec-vm/seed.ram"),
        )
        .unwrap();
        let line = t.join(" ");
        assert!(
            line.contains("mem-path=/dev/shm/dsec-vm/seed.ram,share=on"),
            "{line}"
        );
        assert!(
            line.contains("-pidfile /d/sandboxes/a/fork-template/qemu.pid"),
            "{line}"
        );
        assert!(
            line.contains("unix:/d/sandboxes/a/fork-template/vm.qmp"),
            "{line}"
        );
        assert!(line.contains("-netdev tap,id=net0,fd=3 "), "{line}");
        assert!(!line.contains("ifname=tap0"), "{line}");
        assert!(line.ends_with("-incoming defer -S"), "{line}");
        assert_eq!(line.matches("-incoming").count(), 1, "{line}");
        let no_file: Vec<String> = vec!["qemu".into(), "-m".into(), "256M".into()];
        assert!(
            template_args(&no_file, Path::new("/d"), Path::new("/t"), Path::new("/r")).is_err()
        );
    }

    #[test]
    fn vm_options_are_checked() {
        let ok = |m: &str, d: &[&str]| {
            check_options(VmOptions {
                machine: m.into(),
                devices: d.iter().map(|s| s.to_string()).collect(),
                run_as: "nobody".into(),
                ..VmOptions::default()
            })
        };
        assert!(ok("microvm", &[]).is_ok());
        assert!(ok("q35", &["vfio-pci,host=0000:65:00.0"]).is_ok());
        let e = ok("pc-i440fx", &[]).unwrap_err();
        assert!(matches!(e, VmError::Config(_)), "{e:?}");
        let e = e.to_string();
        assert!(e.contains("microvm") && e.contains("q35"), "{e}");
        assert!(ok("q35", &["vfio-pci,host=1 -monitor stdio"]).is_err());
        assert!(ok("q35", &[""]).is_err());
        assert_eq!(machine("q35"), Some(("q35", "pci")));
        assert_eq!(machine("microvm"), Some(("microvm", "device")));
        let no_such = check_options(VmOptions {
            run_as: "dsec-no-such-user".into(),
            ..VmOptions::default()
        });
        assert!(no_such.unwrap_err().to_string().contains("run_as"));
    }
}
