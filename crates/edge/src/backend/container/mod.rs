//! The `container` backend: an OCI runtime binary runs each sandbox from a bundle the edge
//! writes, over an overlay of the image's read-only layers and a size-limited upper.
//! Fork copies the writable layer; process memory is not carried over.

mod oci;
mod rootfs;
mod runtime;
mod seccomp;

use base64::Engine as _;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use dsec_common::api::{BackendStatus, Capability, SandboxState};
use dsec_common::{ApiError, ErrorCode, IoContext, IoFailure};
use dsec_image::ImageStore;

pub use oci::{ALLOWED_SYSCALLS, CAPABILITIES};
pub use runtime::OciRuntime;

use super::detached::read_pid;
use super::{Backend, SandboxPaths};
use crate::cgroup::{self, CgroupMode};
use crate::registry::SandboxRecord;

/// What goes wrong running a container sandbox.
#[derive(Debug, thiserror::Error)]
pub enum ContainerError {
    /// No OCI runtime, or not the one configured; the message says what to install.
    #[error("{0}")]
    NoRuntime(String),
    #[error(transparent)]
    NoAether(#[from] super::NoAether),
    /// The backend could not start (the cause found at start, repeated on each use).
    #[error("container backend unavailable: {0}")]
    Unavailable(String),
    /// The OCI runtime refused a call: its last output lines.
    #[error("{runtime} {call} failed ({status}): {output}")]
    Runtime {
        runtime: String,
        call: String,
        status: String,
        output: String,
    },
    #[error("path {} has a NUL byte", .0.display())]
    NulInPath(PathBuf),
    #[error("layer path {0} contains ',' or ':', which overlayfs cannot take")]
    BadLayerPath(String),
    #[error("image has too many layers ({0}) for one overlay mount; build it with fewer steps")]
    TooManyLayers(usize),
    #[error("copying the fork source's files (disk_limit_mb too small?): {0}")]
    CopyFiles(String),
    #[error(transparent)]
    Image(#[from] dsec_image::ImageError),
    #[error(transparent)]
    Net(#[from] crate::net::NetError),
    #[error(transparent)]
    Netlink(#[from] crate::net::NetlinkError),
    #[error(transparent)]
    Volume(#[from] crate::volumes::VolumeError),
    #[error(transparent)]
    MountNs(#[from] crate::mountns::MountNsError),
    #[error(transparent)]
    Io(#[from] IoFailure),
}

impl ContainerError {
    /// Whether the kernel (or the runtime, in its output) said a resource was busy: the
    /// writable layer of a container that just ended is let go of a moment later.
    fn is_busy(&self) -> bool {
        match self {
            ContainerError::Io(e) => e.errno() == Some(libc::EBUSY),
            ContainerError::Runtime { output, .. } => output.contains("busy"),
            _ => false,
        }
    }
}

impl crate::error::Coded for ContainerError {
    fn code(&self) -> ErrorCode {
        match self {
            ContainerError::NoRuntime(_)
            | ContainerError::NoAether(_)
            | ContainerError::Unavailable(_) => ErrorCode::Unavailable,
            ContainerError::TooManyLayers(_) => ErrorCode::FailedPrecondition,
            ContainerError::CopyFiles(_) => ErrorCode::ResourceExhausted,
            ContainerError::Volume(e) => e.code(),
            ContainerError::Net(e) => e.code(),
            ContainerError::Netlink(_) => ErrorCode::Internal,
            ContainerError::MountNs(e) => e.code(),
            ContainerError::Image(_) => ErrorCode::Internal,
            ContainerError::Runtime { .. }
            | ContainerError::NulInPath(_)
            | ContainerError::BadLayerPath(_)
            | ContainerError::Io(_) => ErrorCode::Internal,
        }
    }
}

/// See [`crate::backend::Backend::capabilities`].
pub const BACKEND_CAPABILITIES: &[Capability] = &[Capability::PauseToDisk, Capability::Volumes];

pub struct ContainerBackend {
    runtime: Result<OciRuntime, ContainerError>,
    aether: Result<PathBuf, super::NoAether>,
    images: ImageStore,
    mode: CgroupMode,
    /// Where each sandbox's directory is (`<sandboxes>/<id>`).
    sandboxes: PathBuf,
    /// The seccomp policy compiled once for crun (`seccomp.rs`), base64; None: the runtime
    /// compiles the OCI section itself.
    seccomp_bpf: Option<String>,
    /// Bound over the masked directories of every sandbox (see `oci.rs`).
    empty_dir: Option<PathBuf>,
    /// The sysfs every sandbox's /sys is a bind of ([`sysfs_view`]), made on the first
    /// create; `None` inside: each sandbox mounts a sysfs of its own.
    sysfs_view: std::sync::OnceLock<Option<PathBuf>>,
}

fn cid(rec: &SandboxRecord) -> String {
    format!("dsec-{}", rec.id)
}

/// Where a sandbox's volumes are attached for its runtime, in the sandbox's directory.
const VOLUMES: &str = "volumes";

/// The container's init pid, written by the OCI runtime, in the sandbox's directory.
const INIT_PID: &str = "init.pid";

/// Whether process `pid` is alive and in sandbox `id`'s cgroup (`/proc/<pid>/cgroup`
/// names it in every hierarchy the process is in).
fn init_in_cgroup(pid: i32, id: &str) -> bool {
    let want = cgroup::sandbox_cgroup_path(id);
    let below = format!("{want}/");
    std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|t| {
        t.lines()
            .filter_map(|l| l.rsplit(':').next())
            .any(|path| path == want || path.starts_with(&below))
    })
}

/// Whether an ELF file has no program interpreter, i.e. runs without a dynamic loader.
pub fn is_static_elf(p: &Path) -> bool {
    std::fs::read(p).is_ok_and(|b| dsec_common::elf::has_interpreter(&b) == Ok(false))
}

/// The empty, read-only directory bound over the masked directories of every sandbox
/// (see `oci.rs`), next to the sandboxes' directory; `None` if it cannot be made.
fn empty_dir(sandboxes: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let dir = sandboxes.parent()?.join("masked-empty");
    let made = (|| -> std::io::Result<()> {
        std::fs::create_dir_all(&dir)?;
        if std::fs::read_dir(&dir)?.next().is_some() {
            return Err(std::io::Error::other("not empty"));
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555))
    })();
    match made {
        Ok(()) => Some(dir),
        Err(e) => {
            tracing::warn!(
                "{}: {e}; masked directories get a tmpfs each",
                dir.display()
            );
            None
        }
    }
}

/// The sysfs that every sandbox's /sys is a read-only bind of, next to the sandboxes'
/// directory, mounted once in the sandboxes' mount namespace (where it stays across edge
/// restarts) from a network namespace of its own that holds only `lo`.
///
/// A sysfs mounted in a sandbox's own network namespace is a new superblock, and the
/// kernel finds a sysfs superblock by comparing the new one's namespace with that of every
/// sysfs on the node, so each create cost more than the one before. What a sandbox sees
/// differs in one place: `/sys/class/net` lists `lo` alone, not its own `eth0` (whose
/// state `ip` reads over netlink, as before), and never the node's interfaces.
/// `None` (each sandbox mounts its own) if it cannot be made.
fn sysfs_view(sandboxes: &Path) -> Option<PathBuf> {
    let dir = sandboxes.parent()?.join("sysfs-view");
    let made = crate::mountns::within(|| rootfs::mount_sysfs_view(&dir));
    match made {
        Ok(()) => Some(dir),
        Err(e) => {
            tracing::warn!("{e}; each sandbox mounts a sysfs of its own");
            None
        }
    }
}

/// 65536, or the edge's hard RLIMIT_NOFILE if that is lower (a runtime cannot raise it).
fn nofile_limit() -> u64 {
    // SAFETY: getrlimit fills the struct.
    let mut r: libc::rlimit = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return 1024;
    }
    (r.rlim_max as u64).min(65536)
}

/// Files of the image the bundle bind-mounts over (see `oci.rs`), relative to the root.
const BIND_MOUNT_FILES: [&str; 2] = ["etc/hosts", "etc/resolv.conf"];

/// Copies the contents of `src` into `dest`, keeping owners, modes, links, xattrs and
/// overlay whiteouts (`cp -a`; reflinks where the filesystem has them).
fn copy_tree(src: &Path, dest: &Path) -> Result<(), ContainerError> {
    let out = Command::new("cp")
        .arg("-a")
        .arg("--reflink=auto")
        .arg(format!("{}/.", src.display()))
        .arg(dest)
        .output()
        .ctx(|| "cannot run cp".into())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(ContainerError::CopyFiles(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ))
    }
}

impl ContainerBackend {
    pub fn new(
        runtime_choice: &str,
        runtime_state: &Path,
        aether: Option<&Path>,
        images: ImageStore,
        mode: CgroupMode,
        sandboxes: &Path,
    ) -> ContainerBackend {
        let runtime = OciRuntime::resolve(runtime_choice, runtime_state, mode);
        let seccomp_bpf = match &runtime {
            Ok(rt) if rt.kind == runtime::Kind::Crun => {
                match seccomp::compile(&oci::seccomp_policy()) {
                    Ok(bpf) => Some(base64::engine::general_purpose::STANDARD.encode(bpf)),
                    Err(e) => {
                        tracing::warn!(
                            "cannot compile the seccomp policy ({e}); crun compiles it on each create"
                        );
                        None
                    }
                }
            }
            _ => None,
        };
        if let Ok(rt) = &runtime {
            rt.sweep_unified_leftovers();
        }
        // runc refuses mounts inside /proc other than its own list: it keeps its tmpfs masks.
        let empty_dir = match &runtime {
            Ok(rt) if rt.kind == runtime::Kind::Crun => empty_dir(sandboxes),
            _ => None,
        };
        ContainerBackend {
            runtime,
            aether: super::find_aether(aether),
            images,
            mode,
            sandboxes: sandboxes.to_path_buf(),
            seccomp_bpf,
            empty_dir,
            sysfs_view: std::sync::OnceLock::new(),
        }
    }

    fn runtime_or_why(&self) -> Result<&OciRuntime, ContainerError> {
        self.runtime
            .as_ref()
            .map_err(|e| ContainerError::Unavailable(e.to_string()))
    }

    fn rt(&self) -> Result<&OciRuntime, ApiError> {
        self.runtime
            .as_ref()
            .map_err(|e| ApiError::unavailable(format!("container backend unavailable: {e}")))
    }

    fn create_inner(
        &self,
        rec: &SandboxRecord,
        paths: &SandboxPaths,
        seed: Option<&Path>,
    ) -> Result<(), ContainerError> {
        let rt = self.runtime_or_why()?;
        let aether = self
            .aether
            .as_ref()
            .map_err(|e| ContainerError::Unavailable(e.to_string()))?;
        let dir = &paths.dir;
        let disk = dir.join("disk");
        let rootfs = dir.join("rootfs");
        let disk_mb = rec.limits.disk_mb;
        // The disk is made in the sandboxes' mount namespace, where it stays while the
        // sandbox lives (also while it is paused without its processes).
        crate::mountns::within(|| -> Result<_, ContainerError> {
            rootfs::mount_disk(&disk, disk_mb)?;
            if let Some(seed) = seed {
                copy_tree(seed, &disk.join("upper"))?;
            }
            Ok(())
        })?;
        let view = self.sysfs_view(rt);
        let hosts = dir.join("hosts");
        std::fs::write(
            &hosts,
            "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n127.0.1.1\tsandbox\n",
        )
        .ctx(|| "writing hosts".into())?;
        // The edge made the sandbox's network namespace; /etc/resolv.conf names the DNS
        // proxy's address (DNS to anything else on port 53 is redirected there anyway).
        let netns = rec
            .network
            .as_ref()
            .map(|_| crate::net::link::netns_path(&rec.id))
            .transpose()?;
        let resolv = dir.join("resolv.conf");
        let gateway = rec.network.as_ref().and_then(|n| n.gateway.clone());
        if let Some(gw) = &gateway {
            std::fs::write(
                &resolv,
                format!("nameserver {gw}\noptions timeout:2 attempts:2\n"),
            )
            .ctx(|| "writing resolv.conf".into())?;
        }
        let cgroup_path = cgroup::sandbox_cgroup_path(&rec.id);
        let limit_swap = match self.mode {
            CgroupMode::V2 => true,
            _ => Path::new("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes").exists(),
        };
        let config = oci::config(
            rec,
            &oci::BundleInput {
                rootfs: &rootfs,
                aether,
                hosts: &hosts,
                cgroup_path: &cgroup_path,
                limit_swap,
                nofile: nofile_limit(),
                netns: netns.as_deref(),
                resolv_conf: gateway.as_ref().map(|_| resolv.as_path()),
                seccomp_bpf: self.seccomp_bpf.as_deref(),
                empty_dir: self.empty_dir.as_deref(),
                sysfs: view.map(|_| dir.join("sysfs")).as_deref(),
                volumes: &dir.join(VOLUMES),
            },
        );
        // The bundle carries the sandbox's environment: root's alone.
        dsec_common::private::write(
            &dir.join("config.json"),
            &serde_json::to_vec_pretty(&config).unwrap_or_default(),
        )
        .ctx(|| "writing config.json".into())?;
        self.start_container(rec, paths)
    }

    /// Every process of the container is in the sandbox's cgroup: killed here (thawed
    /// first; the cgroup goes once they have), whatever the runtime knows of them, also
    /// when it lost the container's state. Then the runtime is asked once to forget the
    /// container: a stop of thousands costs one runtime process each.
    fn end_processes(&self, rec: &SandboxRecord) {
        cgroup::empty_and_remove(
            self.mode,
            &cgroup::sandbox_cgroup_path(&rec.id),
            Duration::from_secs(10),
        );
        if let Ok(rt) = self.rt()
            && let Err(e) = rt.delete_force(&cid(rec))
        {
            // Also what a container that was never started answers.
            tracing::debug!(sandbox = %rec.id, "{e}");
        }
    }

    /// The node's sysfs view for a crun container (runc refuses a bind at /sys: it
    /// mounts a sysfs of its own).
    fn sysfs_view(&self, rt: &OciRuntime) -> Option<&Path> {
        match rt.kind {
            runtime::Kind::Crun => self
                .sysfs_view
                .get_or_init(|| sysfs_view(&self.sandboxes))
                .as_deref(),
            _ => None,
        }
    }

    /// Mounts the sandbox's root (its layers under the writable layer on its disk) and
    /// starts its container from the bundle: at create, and when a sandbox paused without
    /// its processes resumes. The overlay is made in the sandboxes' mount namespace and
    /// left detached there, for the runtime's call to attach (see `rootfs.rs`).
    fn start_container(
        &self,
        rec: &SandboxRecord,
        paths: &SandboxPaths,
    ) -> Result<(), ContainerError> {
        let rt = self.runtime_or_why()?;
        let dir = &paths.dir;
        let (disk, rootfs) = (dir.join("disk"), dir.join("rootfs"));
        let lowers: Vec<PathBuf> = rec
            .layers
            .iter()
            .rev()
            .map(|l| self.images.layer_path(l))
            .collect();
        let view = self.sysfs_view(rt);
        let state_dir = self.sandboxes.parent().unwrap_or(&self.sandboxes);
        // Lazy layers: mounted here, then in the sandboxes' namespace too.
        let lazy = self.images.ready_layers(&rec.layers)?;
        let (root_fd, sys_fd, vol_fds) =
            crate::mountns::within(|| -> Result<_, ContainerError> {
                if let Some(m) = self.images.lazy() {
                    for l in &lazy {
                        m.mount_here(l)?;
                    }
                }
                // Copies of the volumes' mounts, attached in the runtime's namespace below.
                let vols: Vec<OwnedFd> = crate::volumes::mount_points(state_dir, &rec.volumes)?
                    .iter()
                    .map(|p| rootfs::clone_mount(p))
                    .collect::<Result<_, _>>()?;
                rootfs::mount_overlay(&lowers, &disk, &rootfs)?;
                let sys: Option<OwnedFd> = view.map(rootfs::clone_mount).transpose()?;
                Ok((rootfs::detach(&rootfs)?, sys, vols))
            })?;
        let _ = std::fs::remove_file(&paths.channel);
        let listener = UnixListener::bind(&paths.channel)
            .ctx(|| format!("creating channel socket {}", paths.channel.display()))?;
        rt.run_detached(
            &cid(rec),
            dir,
            root_fd.as_raw_fd(),
            sys_fd.as_ref().map(|f| f.as_raw_fd()),
            &vol_fds.iter().map(|f| f.as_raw_fd()).collect::<Vec<_>>(),
            listener.as_raw_fd(),
            &dir.join("console.log"),
            &dir.join(INIT_PID),
        )?;
        Ok(())
    }
}

impl Backend for ContainerBackend {
    fn name(&self) -> &'static str {
        "container"
    }

    fn status(&self) -> BackendStatus {
        let (available, detail) = match (&self.runtime, &self.aether) {
            (Ok(rt), Ok(_)) => (
                true,
                format!("{}, cgroup {}", rt.describe(), self.mode.as_str()),
            ),
            (Err(e), _) => (false, e.to_string()),
            (_, Err(e)) => (false, e.to_string()),
        };
        BackendStatus {
            name: "container".into(),
            available,
            detail,
            capabilities: BACKEND_CAPABILITIES.to_vec(),
        }
    }

    fn capabilities(&self) -> &'static [Capability] {
        BACKEND_CAPABILITIES
    }

    fn keeps_agent_connections(&self) -> bool {
        true
    }

    fn create(
        &self,
        rec: &SandboxRecord,
        paths: &SandboxPaths,
        seed: Option<&Path>,
    ) -> Result<(), ApiError> {
        self.rt()?;
        match self.create_inner(rec, paths, seed) {
            Ok(()) => Ok(()),
            Err(e) => {
                if let Err(cleanup) = self.destroy(rec, paths) {
                    tracing::error!(sandbox = %rec.id, "cleanup after failed create: {}", cleanup.message);
                }
                Err(ApiError::internal(format!(
                    "creating container sandbox: {e}"
                )))
            }
        }
    }

    /// From the container's init pid (written by the runtime at create): alive while that
    /// process exists in the sandbox's cgroup, which a reused pid is not. No runtime
    /// process per sandbox, so a restart re-adopts thousands at once. A container made
    /// before pid files were written is asked of the runtime.
    fn is_alive(&self, rec: &SandboxRecord) -> bool {
        let dir = self.sandboxes.join(&rec.id);
        if rec.state == SandboxState::Paused && rec.paused_to_disk {
            // No process: alive while its files are (its disk still mounted).
            let paths = SandboxPaths {
                channel: dir.join("aether.sock"),
                dir,
            };
            return upper(&paths).is_ok();
        }
        if let Some(pid) = read_pid(&dir.join(INIT_PID)) {
            return init_in_cgroup(pid, &rec.id);
        }
        let Ok(rt) = self.rt() else { return false };
        matches!(
            rt.state(&cid(rec)).as_deref(),
            Some("running" | "paused" | "created")
        )
    }

    /// The container's init (aether, its PID 1: the container ends with it).
    fn main_pid(&self, rec: &SandboxRecord) -> Option<i32> {
        let pid = read_pid(&self.sandboxes.join(&rec.id).join(INIT_PID))?;
        init_in_cgroup(pid, &rec.id).then_some(pid)
    }

    fn pause(&self, rec: &SandboxRecord) -> Result<(), ApiError> {
        self.rt()?
            .pause(&cid(rec))
            .map_err(|e| ApiError::internal(format!("pausing: {e}")))
    }

    fn resume(&self, rec: &SandboxRecord) -> Result<(), ApiError> {
        self.rt()?
            .resume(&cid(rec))
            .map_err(|e| ApiError::internal(format!("resuming: {e}")))
    }

    /// Ends the container's processes, freeing their memory; its files stay on its disk
    /// (and its network), so [`Backend::wake`] starts it afresh on them.
    fn suspend(&self, rec: &SandboxRecord, paths: &SandboxPaths) -> Result<(), ApiError> {
        upper(paths)?;
        self.end_processes(rec);
        let _ = std::fs::remove_file(paths.dir.join(INIT_PID));
        Ok(())
    }

    /// Starts a [`Backend::suspend`]ed container again on its files: a fresh start (its
    /// processes ended with the pause).
    fn wake(&self, rec: &SandboxRecord, paths: &SandboxPaths) -> Result<(), ApiError> {
        upper(paths)?;
        // The ended container's overlay is let go of as its last process is reaped; until
        // then its writable layer counts as in use.
        let mut tries = 0;
        loop {
            match self.start_container(rec, paths) {
                Ok(()) => return Ok(()),
                Err(e) if tries < 40 && e.is_busy() => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => {
                    return Err(ApiError::internal(format!(
                        "starting the container again: {e}"
                    )));
                }
            }
        }
    }

    fn snapshot(
        &self,
        _rec: &SandboxRecord,
        paths: &SandboxPaths,
        dest: &Path,
    ) -> Result<(), ApiError> {
        std::fs::create_dir_all(dest)
            .map_err(|e| ApiError::internal(format!("creating {}: {e}", dest.display())))?;
        copy_tree(&upper(paths)?, dest)
            .map_err(|e| ApiError::internal(format!("copying the writable layer: {e}")))
    }

    fn destroy(&self, rec: &SandboxRecord, paths: &SandboxPaths) -> Result<(), ApiError> {
        self.end_processes(rec);
        let dir = &paths.dir;
        let mut problems = Vec::new();
        let (rootfs, disk) = (dir.join("rootfs"), dir.join("disk"));
        let unmount_both = || {
            [&rootfs, &disk]
                .into_iter()
                .filter_map(|m| rootfs::unmount(m).err())
                .collect::<Vec<_>>()
        };
        match crate::mountns::get().and_then(|ns| ns.run(unmount_both)) {
            Ok(p) => problems.extend(p.iter().map(ToString::to_string)),
            Err(e) => problems.push(e.to_string()),
        }
        // A sandbox of an edge that mounted in the host's namespace.
        problems.extend(unmount_both().iter().map(ToString::to_string));
        // Removed in-process (no `rm` per stop) once nothing is mounted inside it here:
        // this namespace's table is the host's, a few entries, so the check is cheap, and
        // the removal never reaches into another file system (`remove_dir_all` follows no
        // symlink either).
        let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        if crate::mountns::has_mount_within(&table, dir) {
            problems.push(format!("{} still has a mount inside", dir.display()));
        }
        if problems.is_empty() {
            if let Err(e) = std::fs::remove_dir_all(dir)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(sandbox = %rec.id, "removing {}: {e}", dir.display());
            }
            Ok(())
        } else {
            Err(ApiError::internal(format!(
                "cleaning up {}: {}",
                rec.id,
                problems.join("; ")
            )))
        }
    }

    fn oom_kills(&self, rec: &SandboxRecord) -> u64 {
        cgroup::oom_kills(self.mode, &cgroup::sandbox_cgroup_path(&rec.id))
    }

    fn copy_changes(
        &self,
        _rec: &SandboxRecord,
        paths: &SandboxPaths,
        dest: &Path,
    ) -> Result<(), ApiError> {
        copy_tree(&upper(paths)?, dest)
            .map_err(|e| ApiError::internal(format!("copying the writable layer: {e}")))?;
        remove_mount_point_files(dest)
    }
}

/// The sandbox's writable layer, as the host reaches it: in the sandboxes' mount namespace,
/// or in the host's for a sandbox an older edge made. Never a directory the disk is not
/// mounted on, whose (empty) contents would pass for the sandbox's.
fn upper(paths: &SandboxPaths) -> Result<PathBuf, ApiError> {
    let disk = paths.dir.join("disk");
    let mut places = Vec::new();
    if let Ok(ns) = crate::mountns::get() {
        places.push(ns.view(&disk));
    }
    places.push(disk);
    places
        .into_iter()
        .find(|d| is_mounted_tmpfs(d))
        .map(|d| d.join("upper"))
        .ok_or_else(|| ApiError::internal("the sandbox's disk is not mounted"))
}

/// Whether a tmpfs is mounted at `p` (not merely a directory on one).
fn is_mounted_tmpfs(p: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let dev = |p: &Path| std::fs::metadata(p).map(|m| m.dev()).ok();
    let parent = p.parent().and_then(dev);
    if dev(p).is_none() || dev(p) == parent {
        return false;
    }
    let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: statfs fills the struct from a NUL-terminated path.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    unsafe { libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type == libc::TMPFS_MAGIC }
}

/// Removes the files the runtime made in the upper as mount points for its bind mounts
/// (where the image has none): never the sandbox's own, which cannot replace a mount point.
/// The tree is the sandbox's: a component of the path may be a symlink (`etc -> /etc`) that
/// would aim the removal at the host, so only a path of real directories counts.
fn remove_mount_point_files(dest: &Path) -> Result<(), ApiError> {
    for f in BIND_MOUNT_FILES {
        let p = dest.join(f);
        if no_symlink_on_the_way(dest, Path::new(f))
            && std::fs::symlink_metadata(&p).is_ok_and(|m| m.is_file())
        {
            std::fs::remove_file(&p)
                .map_err(|e| ApiError::internal(format!("removing {}: {e}", p.display())))?;
        }
    }
    Ok(())
}

/// Whether every directory between `root` and `root/rel` is a real directory (no
/// symlink). `root` is the edge's own; what lies below it may be a sandbox's.
fn no_symlink_on_the_way(root: &Path, rel: &Path) -> bool {
    let mut p = root.to_path_buf();
    let Some(parent) = rel.parent() else {
        return true;
    };
    parent.components().all(|c| {
        p.push(c);
        std::fs::symlink_metadata(&p).is_ok_and(|m| m.file_type().is_dir())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_symlinked_etc_in_a_sandbox_tree_aims_no_removal_at_the_host() {
        let t = tempfile::tempdir().unwrap();
        let victim = t.path().join("host-etc");
        std::fs::create_dir(&victim).unwrap();
        std::fs::write(victim.join("hosts"), "host's").unwrap();
        let tree = t.path().join("upper");
        std::fs::create_dir(&tree).unwrap();
        std::os::unix::fs::symlink(&victim, tree.join("etc")).unwrap();
        remove_mount_point_files(&tree).unwrap();
        assert!(
            victim.join("hosts").exists(),
            "removed through the sandbox's symlink"
        );
        std::fs::remove_file(tree.join("etc")).unwrap();
        std::fs::create_dir(tree.join("etc")).unwrap();
        std::fs::write(tree.join("etc/hosts"), "mount point").unwrap();
        remove_mount_point_files(&tree).unwrap();
        assert!(!tree.join("etc/hosts").exists());
        assert!(victim.join("hosts").exists());
    }

    #[test]
    fn recognises_static_binaries() {
        // /bin/sh on any distro is dynamically linked.
        assert!(!is_static_elf(Path::new("/bin/sh")));
        assert!(!is_static_elf(Path::new("/etc/hostname")));
    }
}
