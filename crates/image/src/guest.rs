//! Guest artefacts for the VM backends, built from Debian packages and cached in the
//! image store:
//!
//! ```text
//! guest/kernel-<release>/vmlinuz                 from linux-image-<release> (the package
//! guest/kernel-<release>/modules/<name>.ko         behind linux-image-cloud-amd64)
//! guest/kernel-<release>/vmlinux                 the ELF kernel inside vmlinuz (Firecracker)
//! guest/kernel-<release>/kernel.json             release, package version, sha256 of vmlinuz
//! guest/kernel-<release>/initramfs-<hash>.cpio.gz busybox + the modules + /init
//! guest/disks/stage-<key>.erofs                  aether and the root's mount points
//! guest/disks/merged-<key>.erofs                 the bottom layers of a deep image, as one
//! erofs/<layer>.img                              a layer as an EROFS disk (a lazily pulled
//!                                                  layer's is its file on lazyfs/ instead)
//! ```
//!
//! A VM's root is a stack of read-only EROFS disks, one per image layer (so VMs of images
//! that share layers share their disks, and a lazily pulled layer is fetched as the guest
//! reads it), under the stage. The initramfs `/init` loads the virtio and EROFS modules
//! (and, with `dsec.channel=vsock` on the command line, the vsock ones), mounts the
//! `dsec.layers=N` disks under an overlayfs whose upper layer is a tmpfs, prints
//! `dsec-guest: root ready` and `switch_root`s into the program named by `dsec.init=` on
//! the kernel command line (default `/.dsec/aether`), passing it the words after `--` on
//! the command line.
//!
//! Everything is built in a temporary path next to its final place and renamed (a root
//! disk: linked) into it, so a crash leaves nothing half-written under a cached name.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use dsec_common::id::random_hex;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::build::run_logged;
use crate::cpio::CpioWriter;
use crate::digest::file_sha256;
use crate::store::remove_tree;
use crate::{ImageError, ImageRef, ImageStore, IoContext};

/// The Debian meta-package whose dependency names the guest kernel.
pub const KERNEL_META_PACKAGE: &str = "linux-image-cloud-amd64";

/// Modules the guest loads, in `insmod` order (dependencies first). virtio-mmio finds the
/// devices QEMU's microvm describes in ACPI; virtio-pci serves q35 and `microvm,pcie=on`.
pub const GUEST_MODULES: &[&str] = &[
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "virtio_pci_legacy_dev",
    "virtio_pci_modern_dev",
    "virtio_pci",
    "virtio_blk",
    "failover",
    "net_failover",
    "virtio_net",
    "virtio_console",
    "virtio-rng",
    "libcrc32c",
    "erofs",
    "overlay",
    // Volumes (virtio-fs devices).
    "fuse",
    "virtiofs",
];

/// Modules for the channel over vsock (Firecracker), loaded after [`GUEST_MODULES`] only
/// when the command line says `dsec.channel=vsock`, so QEMU guests boot as before.
pub const VSOCK_MODULES: &[&str] = &[
    "vsock",
    "vmw_vsock_virtio_transport_common",
    "vmw_vsock_virtio_transport",
];

/// Without these the guest cannot mount its root, so a kernel package lacking them is
/// refused rather than cached.
const REQUIRED_MODULES: &[&str] = &[
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "virtio_blk",
    "erofs",
    "overlay",
];

/// Where the root disk puts the in-sandbox agent, and what `/init` runs by default.
pub const AETHER_GUEST_PATH: &str = "/.dsec/aether";

/// The line `/init` prints on the console once the root filesystem is in place.
pub const ROOT_READY_LINE: &str = "dsec-guest: root ready";

/// The host's static busybox (Debian package busybox-static), copied into the initramfs.
pub const HOST_BUSYBOX: &str = "/bin/busybox";

/// Busybox applets linked in the initramfs's /bin.
const INITRAMFS_APPLETS: &[&str] = &[
    "sh",
    "mount",
    "insmod",
    "switch_root",
    "mkdir",
    "echo",
    "cat",
    "sleep",
    "poweroff",
];

/// Bumped whenever the initramfs or root disk layout changes, so old cache entries are
/// not reused.
const INITRAMFS_FORMAT: &str = "dsec-initramfs-v2";
const ROOT_DISK_FORMAT: &str = "dsec-root-disk-v2";
/// Bumped whenever the set of modules taken from the kernel package changes: a cached
/// kernel of another format is unpacked again.
const KERNEL_FORMAT: &str = "dsec-kernel-v4";

/// A guest kernel unpacked into the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kernel {
    /// Kernel release (`uname -r`), e.g. `6.1.0-57-cloud-amd64`.
    pub version: String,
    /// Debian version of the package it came from, e.g. `6.1.192-3`.
    pub package_version: String,
    /// `<store_root>/guest/kernel-<version>`.
    pub dir: PathBuf,
    pub vmlinuz: PathBuf,
    pub vmlinuz_sha256: String,
    /// Uncompressed modules, in `insmod` order (a subset of [`GUEST_MODULES`]: the ones the
    /// package ships as modules).
    pub modules: Vec<PathBuf>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct KernelJson {
    version: String,
    package: String,
    package_version: String,
    vmlinuz_sha256: String,
    /// Module names, in `insmod` order; each is `modules/<name>.ko`.
    modules: Vec<String>,
    /// [`KERNEL_FORMAT`] when it was unpacked (absent in the first format).
    #[serde(default)]
    format: String,
}

fn guest_dir(store_root: &Path) -> PathBuf {
    store_root.join("guest")
}

fn build_err(msg: impl Into<String>) -> ImageError {
    ImageError::Build(msg.into())
}

/// The message of an error about to be wrapped in another, without a second
/// "image build failed" prefix.
fn detail(e: &ImageError) -> String {
    match e {
        ImageError::Build(m) => m.clone(),
        e => e.to_string(),
    }
}

/// [`file_sha256`] of the aether binary, remembered while the file is the same one
/// (device, inode, size, modification time): it is hashed into every VM's root disk key,
/// and hashing its megabytes on every boot would be the larger part of a boot's host work.
/// An error says what to do about it.
fn aether_digest(p: &Path) -> Result<String, ImageError> {
    use std::os::unix::fs::MetadataExt;
    type Seen = std::sync::Mutex<Option<((u64, u64, u64, i64, i64), String)>>;
    static SEEN: Seen = std::sync::Mutex::new(None);
    let unreadable = |e: &dyn std::fmt::Display| {
        build_err(format!(
            "aether binary {} is not readable ({e}); build it (`cargo build -p dsec-aether`) or pass its path",
            p.display()
        ))
    };
    let m = std::fs::metadata(p).map_err(|e| unreadable(&e))?;
    if !m.is_file() {
        return Err(build_err(format!(
            "aether binary {} is not a regular file",
            p.display()
        )));
    }
    let key = (m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec());
    if let Some((k, d)) = SEEN.lock().unwrap_or_else(|e| e.into_inner()).as_ref()
        && *k == key
    {
        return Ok(d.clone());
    }
    let d = file_sha256(p).map_err(|e| unreadable(&e))?;
    *SEEN.lock().unwrap_or_else(|e| e.into_inner()) = Some((key, d.clone()));
    Ok(d)
}

/// A path removed on drop unless [`TempPath::keep`] was called.
struct TempPath(Option<PathBuf>);

impl TempPath {
    fn new(p: PathBuf) -> TempPath {
        TempPath(Some(p))
    }
    fn path(&self) -> &Path {
        self.0.as_deref().expect("temp path is kept")
    }
    fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            if p.is_dir() {
                let _ = remove_tree(&p);
            } else {
                let _ = std::fs::remove_file(&p);
            }
        }
    }
}

/// Runs a command to completion, logging its output at debug level.
fn run(cmd: &mut Command, what: &str) -> Result<(), ImageError> {
    run_logged(
        cmd,
        what,
        &mut |line| tracing::debug!(target: "dsec_image::guest", "{what}: {line}"),
    )
}

/// Runs a command and returns its stdout; the error carries stderr.
fn output(cmd: &mut Command, what: &str) -> Result<String, ImageError> {
    let out = cmd.output().ctx(|| format!("running {what}"))?;
    if !out.status.success() {
        return Err(build_err(format!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn valid_release(v: &str) -> bool {
    !v.is_empty()
        && v.len() <= 64
        && v.as_bytes()[0].is_ascii_digit()
        && v.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b".+-~_".contains(&b))
}

/// The kernel release named by `apt-cache depends linux-image-cloud-amd64` output, e.g.
/// `Depends: linux-image-6.1.0-57-cloud-amd64` gives `6.1.0-57-cloud-amd64`.
pub fn parse_kernel_depends(depends: &str) -> Option<String> {
    depends.lines().find_map(|l| {
        let dep = l
            .trim()
            .trim_start_matches('|')
            .strip_prefix("Depends:")?
            .trim();
        let dep = dep.trim_start_matches('<').trim_end_matches('>');
        let release = dep.strip_prefix("linux-image-")?;
        (release.ends_with("-cloud-amd64") && valid_release(release)).then(|| release.to_string())
    })
}

/// The `Candidate:` version in `apt-cache policy` output.
fn parse_candidate(policy: &str) -> Option<String> {
    policy.lines().find_map(|l| {
        let v = l.trim().strip_prefix("Candidate:")?.trim();
        (v != "(none)" && !v.is_empty()).then(|| v.to_string())
    })
}

fn apt_fix() -> String {
    format!(
        "run `apt-get update` (a Debian bookworm main source must be configured) so apt knows {KERNEL_META_PACKAGE}"
    )
}

/// The kernel release `linux-image-cloud-amd64` points at now.
fn current_kernel_release() -> Result<String, ImageError> {
    let depends = output(
        Command::new("apt-cache").args(["depends", KERNEL_META_PACKAGE]),
        &format!("apt-cache depends {KERNEL_META_PACKAGE}"),
    )
    .map_err(|e| {
        build_err(format!(
            "cannot find the guest kernel package: {}; {}",
            detail(&e),
            apt_fix()
        ))
    })?;
    parse_kernel_depends(&depends).ok_or_else(|| {
        build_err(format!(
            "{KERNEL_META_PACKAGE} depends on no linux-image-*-cloud-amd64 package (apt-cache said: {}); {}",
            depends.trim(),
            apt_fix()
        ))
    })
}

/// The version of `package` apt would install.
fn candidate_version(package: &str) -> Result<String, ImageError> {
    let policy = output(
        Command::new("apt-cache").args(["policy", package]),
        &format!("apt-cache policy {package}"),
    )?;
    parse_candidate(&policy).ok_or_else(|| {
        build_err(format!(
            "apt has no installable version of {package}; {}",
            apt_fix()
        ))
    })
}

fn kernel_dir(store_root: &Path, release: &str) -> PathBuf {
    guest_dir(store_root).join(format!("kernel-{release}"))
}

/// Loads a cached kernel, or `None` when `dir` holds none.
fn load_kernel(dir: &Path) -> Result<Option<Kernel>, ImageError> {
    let json = dir.join("kernel.json");
    let bytes = match std::fs::read(&json) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).ctx(|| format!("reading {}", json.display())),
    };
    let damaged = |why: String| {
        ImageError::Corrupt(format!(
            "guest kernel cache {} is damaged ({why}); remove that directory and it is rebuilt on next use",
            dir.display()
        ))
    };
    let k: KernelJson =
        serde_json::from_slice(&bytes).map_err(|e| damaged(format!("kernel.json: {e}")))?;
    if k.format != KERNEL_FORMAT {
        return Ok(None);
    }
    let vmlinuz = dir.join("vmlinuz");
    let sha = file_sha256(&vmlinuz).map_err(|e| damaged(e.to_string()))?;
    if sha != k.vmlinuz_sha256 {
        return Err(damaged(format!(
            "vmlinuz has sha256 {sha}, kernel.json says {}",
            k.vmlinuz_sha256
        )));
    }
    let mut modules = Vec::new();
    for m in &k.modules {
        let p = dir.join("modules").join(format!("{m}.ko"));
        if !p.is_file() {
            return Err(damaged(format!("{} is missing", p.display())));
        }
        modules.push(p);
    }
    Ok(Some(Kernel {
        version: k.version,
        package_version: k.package_version,
        dir: dir.to_path_buf(),
        vmlinuz,
        vmlinuz_sha256: k.vmlinuz_sha256,
        modules,
    }))
}

/// Whether the store holds a guest kernel already (so using it downloads nothing).
pub fn has_cached_kernel(store_root: &Path) -> bool {
    newest_cached_kernel(store_root).is_some()
}

/// The newest kernel already in the cache, for hosts where apt cannot say which is current.
fn newest_cached_kernel(store_root: &Path) -> Option<Kernel> {
    let mut found: Vec<Kernel> = std::fs::read_dir(guest_dir(store_root))
        .ok()?
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("kernel-"))
        .filter_map(|e| load_kernel(&e.path()).ok().flatten())
        .collect();
    found.sort_by(|a, b| {
        let key = |v: &str| -> Vec<u64> {
            v.split(|c: char| !c.is_ascii_digit())
                .filter_map(|s| s.parse().ok())
                .collect()
        };
        key(&a.version).cmp(&key(&b.version))
    });
    found.pop()
}

/// Normalised module name: the kernel treats `-` and `_` alike.
fn module_key(name: &str) -> String {
    name.replace('-', "_")
}

/// Module name → path of its `.ko`, `.ko.xz`, `.ko.zst` or `.ko.gz` under `dir`.
fn find_modules(dir: &Path) -> Result<BTreeMap<String, PathBuf>, ImageError> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).ctx(|| format!("listing {}", d.display()))? {
            let e = e.ctx(|| format!("listing {}", d.display()))?;
            let ft = e
                .file_type()
                .ctx(|| format!("reading {}", e.path().display()))?;
            if ft.is_dir() {
                stack.push(e.path());
                continue;
            }
            let name = e.file_name().to_string_lossy().into_owned();
            let stem = [".ko", ".ko.xz", ".ko.zst", ".ko.gz"]
                .iter()
                .find_map(|ext| name.strip_suffix(ext));
            if let Some(stem) = stem {
                out.entry(module_key(stem)).or_insert_with(|| e.path());
            }
        }
    }
    Ok(out)
}

/// Copies module `src` to `dest` as a plain `.ko`, decompressing it if it is compressed
/// (busybox `insmod` wants it uncompressed).
fn install_module(src: &Path, dest: &Path) -> Result<(), ImageError> {
    let name = src.to_string_lossy();
    let tool = if name.ends_with(".ko.xz") {
        Some(("xz", "xz-utils"))
    } else if name.ends_with(".ko.zst") {
        Some(("zstd", "zstd"))
    } else if name.ends_with(".ko.gz") {
        Some(("gzip", "gzip"))
    } else {
        None
    };
    let Some((tool, package)) = tool else {
        std::fs::copy(src, dest).ctx(|| format!("copying {}", src.display()))?;
        return Ok(());
    };
    let out_file = std::fs::File::create(dest).ctx(|| format!("creating {}", dest.display()))?;
    let out = Command::new(tool)
        .arg("-dc")
        .arg(src)
        .stdout(out_file)
        .output()
        .map_err(|e| {
            build_err(format!(
                "cannot run `{tool}` to decompress {} ({e}); install it with `apt-get install {package}`",
                src.display()
            ))
        })?;
    if !out.status.success() {
        return Err(build_err(format!(
            "{tool} -d {} failed: {}",
            src.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Names listed in the package's `modules.builtin` (built into the kernel image).
fn builtin_modules(modroot: &Path) -> Vec<String> {
    std::fs::read_to_string(modroot.join("modules.builtin"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.rsplit('/').next())
        .filter_map(|f| f.strip_suffix(".ko"))
        .map(module_key)
        .collect()
}

/// Makes sure the Debian cloud kernel (the version `linux-image-cloud-amd64` points at now)
/// and its virtio modules are in `<store_root>/guest/kernel-<release>/`; downloads and
/// unpacks the package (no install) on a cache miss. Needs `apt-get`, `dpkg-deb` and, for
/// compressed modules, `xz`.
pub fn ensure_kernel(store_root: &Path) -> Result<Kernel, ImageError> {
    let release = match current_kernel_release() {
        Ok(r) => r,
        Err(e) => {
            if let Some(k) = newest_cached_kernel(store_root) {
                tracing::warn!(
                    "using cached guest kernel {} because the current one is unknown: {e}",
                    k.version
                );
                return Ok(k);
            }
            return Err(e);
        }
    };
    let dir = kernel_dir(store_root, &release);
    if let Some(k) = load_kernel(&dir)? {
        tracing::debug!("guest kernel {release} is cached in {}", dir.display());
        return Ok(k);
    }
    let package = format!("linux-image-{release}");
    let package_version = candidate_version(&package)?;
    tracing::info!("building guest kernel {release} from {package} {package_version}");
    let parent = guest_dir(store_root);
    std::fs::create_dir_all(&parent).ctx(|| format!("creating {}", parent.display()))?;
    let work = TempPath::new(parent.join(format!(".tmp-kernel-{release}-{}", random_hex(8))));
    let dl = work.path().join("download");
    let unpacked = work.path().join("unpacked");
    let out = work.path().join("out");
    for d in [&dl, &unpacked, &out.join("modules")] {
        std::fs::create_dir_all(d).ctx(|| format!("creating {}", d.display()))?;
    }

    tracing::info!("apt-get download {package}={package_version}");
    run(
        Command::new("apt-get")
            .args(["download", "-q", "-o", "APT::Sandbox::User=root"])
            .arg(format!("{package}={package_version}"))
            .current_dir(&dl),
        &format!("apt-get download {package}"),
    )
    .map_err(|e| {
        build_err(format!(
            "downloading the guest kernel failed: {}\nThe host needs network access to a Debian mirror (or an apt proxy); check `apt-get download {package}` by hand",
            detail(&e)
        ))
    })?;
    let deb = std::fs::read_dir(&dl)
        .ctx(|| format!("listing {}", dl.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or_else(|| build_err(format!("apt-get download {package} produced no .deb file")))?;

    tracing::info!("unpacking {}", deb.display());
    run(
        Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&unpacked),
        "dpkg-deb -x",
    )?;

    let vmlinuz_src = unpacked.join("boot").join(format!("vmlinuz-{release}"));
    if !vmlinuz_src.is_file() {
        return Err(build_err(format!(
            "{package} has no boot/vmlinuz-{release}; is it a kernel image package?"
        )));
    }
    let vmlinuz = out.join("vmlinuz");
    std::fs::copy(&vmlinuz_src, &vmlinuz).ctx(|| format!("copying {}", vmlinuz_src.display()))?;

    let modroot = unpacked.join("lib/modules").join(&release);
    let available = find_modules(&modroot.join("kernel"))?;
    let builtin = builtin_modules(&modroot);
    let mut names = Vec::new();
    for m in GUEST_MODULES.iter().chain(VSOCK_MODULES) {
        let key = module_key(m);
        match available.get(&key) {
            Some(src) => {
                install_module(src, &out.join("modules").join(format!("{m}.ko")))?;
                names.push(m.to_string());
            }
            None if builtin.contains(&key) => {
                tracing::debug!("module {m} is built into {release}");
            }
            None if REQUIRED_MODULES.contains(m) => {
                return Err(build_err(format!(
                    "{package} ships no {m} module and does not build it in; the guest could not mount its root. Use a kernel with virtio, EROFS and overlayfs support"
                )));
            }
            None => tracing::warn!("{package} has no {m} module; guests will run without it"),
        }
    }

    let json = KernelJson {
        version: release.clone(),
        package: package.clone(),
        package_version: package_version.clone(),
        vmlinuz_sha256: file_sha256(&vmlinuz)?,
        modules: names,
        format: KERNEL_FORMAT.into(),
    };
    let bytes = serde_json::to_vec_pretty(&json)
        .map_err(|e| build_err(format!("encoding kernel.json: {e}")))?;
    std::fs::write(out.join("kernel.json"), bytes).ctx(|| "writing kernel.json".into())?;

    // A cache entry of an older format is moved aside (VMs still running from its files
    // keep them open) and removed.
    if dir.join("kernel.json").is_file() && load_kernel(&dir).ok().flatten().is_none() {
        let old = parent.join(format!(".old-kernel-{release}-{}", random_hex(8)));
        if std::fs::rename(&dir, &old).is_ok() {
            let _ = remove_tree(&old);
        }
    }
    match std::fs::rename(&out, &dir) {
        Ok(()) => {}
        // Someone else finished the same kernel first: theirs is as good as ours.
        Err(_) if dir.join("kernel.json").is_file() => {}
        Err(e) => return Err(e).ctx(|| format!("moving the kernel into {}", dir.display())),
    }
    drop(work);
    tracing::info!("guest kernel {release} cached in {}", dir.display());
    load_kernel(&dir)?.ok_or_else(|| {
        ImageError::Corrupt(format!(
            "{} vanished right after it was written",
            dir.display()
        ))
    })
}

/// The `/init` script of the initramfs.
fn init_script() -> String {
    let modules = GUEST_MODULES.join(" ");
    let vsock_modules = VSOCK_MODULES.join(" ");
    format!(
        r#"#!/bin/sh
# OpenDsec guest init: load the virtio modules, mount the root read-only under an
# overlayfs with a tmpfs upper layer, and switch_root into the agent.
# Kernel command line: dsec.init=PATH (default {AETHER_GUEST_PATH}); dsec.layers=N: the
# root is N EROFS disks, top first (a disk whose virtio serial is dsec_lI is layer I;
# without serials, the first N in the order the kernel names them); without it, one disk
# dsec.root=DEV (default /dev/vda) of type dsec.rootfstype=TYPE (default ext4). The words
# after `--` become the arguments of dsec.init.
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

fail() {{
    echo "dsec-guest: error: $*"
    /bin/busybox poweroff -f
    exit 1
}}

init={AETHER_GUEST_PATH}
root=/dev/vda
rootfstype=ext4
layers=
channel=virtio-serial
set -f
read -r cmdline < /proc/cmdline
for arg in $cmdline; do
    case "$arg" in
        --) break ;;
        dsec.init=*) init="${{arg#dsec.init=}}" ;;
        dsec.root=*) root="${{arg#dsec.root=}}" ;;
        dsec.rootfstype=*) rootfstype="${{arg#dsec.rootfstype=}}" ;;
        dsec.layers=*) layers="${{arg#dsec.layers=}}" ;;
        dsec.channel=*) channel="${{arg#dsec.channel=}}" ;;
    esac
done
set +f

for m in {modules}; do
    if [ -f /lib/modules/$m.ko ]; then
        insmod /lib/modules/$m.ko || echo "dsec-guest: warning: insmod $m failed"
    fi
done
if [ "$channel" = vsock ]; then
    for m in {vsock_modules}; do
        if [ -f /lib/modules/$m.ko ]; then
            insmod /lib/modules/$m.ko || echo "dsec-guest: warning: insmod $m failed"
        fi
    done
fi

mkdir -p /mnt/lower /mnt/rw /newroot
if [ -n "$layers" ]; then
    case "$layers" in
        *[!0-9]*|'') fail "dsec.layers=$layers is not a number" ;;
    esac
    # A tmpfs holding every disk's mount, so that they move into the root as one.
    mount -t tmpfs -o mode=0755 dsec-lower /mnt/lower || fail "cannot mount the tmpfs for the root disks"
    i=0
    while :; do
        n=0
        for d in /sys/block/vd*; do
            [ -e "$d" ] && n=$((n + 1))
        done
        [ $n -ge "$layers" ] && break
        i=$((i + 1))
        [ $i -gt 200 ] && fail "$n of $layers root disks after 10 s (are the virtio-blk devices attached?)"
        sleep 0.05
    done
    # Disks with a dsec_l<I> serial are layer I; where none has one, the first N in the
    # kernel's order are the layers. Other disks are not the root's.
    byserial=
    for d in /sys/block/vd*; do
        serial=
        [ -r "$d/serial" ] && read -r serial < "$d/serial"
        case "$serial" in dsec_l[0-9]*) byserial=1 ;; esac
    done
    k=0
    for d in /sys/block/vd*; do
        dev=${{d##*/}}
        serial=
        [ -r "$d/serial" ] && read -r serial < "$d/serial"
        idx=
        case "$serial" in
            dsec_l[0-9]*) idx=${{serial#dsec_l}} ;;
            *) [ -z "$byserial" ] && idx=$k && k=$((k + 1)) ;;
        esac
        case "$idx" in
            ''|*[!0-9]*) continue ;;
        esac
        [ "$idx" -lt "$layers" ] || continue
        [ -e /mnt/lower/$idx ] && fail "two disks are root disk $idx"
        mkdir /mnt/lower/$idx
        mount -t erofs -o ro "/dev/$dev" /mnt/lower/$idx || fail "cannot mount root disk $idx (/dev/$dev, EROFS)"
    done
    lowerdir=
    i=0
    while [ $i -lt "$layers" ]; do
        [ -d /mnt/lower/$i ] || fail "no root disk $i"
        lowerdir="$lowerdir${{lowerdir:+:}}/mnt/lower/$i"
        i=$((i + 1))
    done
else
    i=0
    while [ ! -b "$root" ]; do
        i=$((i + 1))
        [ $i -gt 200 ] && fail "no root disk $root after 10 s (is a virtio-blk device attached?)"
        sleep 0.05
    done
    mount -t "$rootfstype" -o ro "$root" /mnt/lower || fail "cannot mount $root ($rootfstype) read-only"
    lowerdir=/mnt/lower
fi
mount -t tmpfs -o mode=0755 dsec-rw /mnt/rw || fail "cannot mount the tmpfs for the writable layer"
mkdir -p /mnt/rw/upper /mnt/rw/work
mount -t overlay -o lowerdir=$lowerdir,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work dsec-root /newroot \
    || fail "cannot mount the overlay root (is the overlay module loaded?)"
for d in proc sys dev; do
    mkdir -p /newroot/$d
    mount --move /$d /newroot/$d || fail "cannot move /$d into the new root"
done
# The root disks and the writable layer stay reachable for the agent (e.g. to commit the
# sandbox's changes) where the root has mount points for them.
[ -d /newroot/.dsec/lower ] && mount --move /mnt/lower /newroot/.dsec/lower
[ -d /newroot/.dsec/rw ] && mount --move /mnt/rw /newroot/.dsec/rw
[ -x "/newroot$init" ] || [ -L "/newroot$init" ] || fail "$init is not an executable in the root disk"

echo "{ROOT_READY_LINE}"
exec switch_root /newroot "$init" "$@"
"#
    )
}

fn read_static_busybox() -> Result<Vec<u8>, ImageError> {
    let fix = "install Debian's busybox-static package (`apt-get install busybox-static`), which provides a statically linked /bin/busybox";
    let bytes = std::fs::read(HOST_BUSYBOX)
        .map_err(|e| build_err(format!("cannot read {HOST_BUSYBOX} ({e}); {fix}")))?;
    match dsec_common::elf::has_interpreter(&bytes) {
        Ok(false) => Ok(bytes),
        Ok(true) => Err(build_err(format!(
            "{HOST_BUSYBOX} is dynamically linked and cannot run in the guest's initramfs; {fix}"
        ))),
        Err(e) => Err(build_err(format!("{HOST_BUSYBOX}: {e}; {fix}"))),
    }
}

/// The initramfs as an uncompressed newc archive.
fn initramfs_archive(busybox: &[u8], modules: &[(String, Vec<u8>)]) -> std::io::Result<Vec<u8>> {
    let mut w = CpioWriter::new(Vec::new());
    for d in [
        "bin",
        "dev",
        "proc",
        "sys",
        "mnt",
        "mnt/lower",
        "mnt/rw",
        "newroot",
        "lib",
        "lib/modules",
    ] {
        w.dir(d, 0o755)?;
    }
    // The kernel opens /dev/console for /init's stdio before anything is mounted.
    w.char_device("dev/console", 0o600, 5, 1)?;
    w.file("bin/busybox", 0o755, busybox)?;
    for a in INITRAMFS_APPLETS {
        w.symlink(&format!("bin/{a}"), "busybox")?;
    }
    for (name, bytes) in modules {
        w.file(&format!("lib/modules/{name}.ko"), 0o644, bytes)?;
    }
    w.file("init", 0o755, init_script().as_bytes())?;
    w.finish()
}

/// Makes sure the initramfs for `kernel` is cached (busybox from the host, the kernel's
/// virtio modules, and the `/init` described in the module docs); returns its path,
/// `<store_root>/guest/kernel-<release>/initramfs-<hash of its inputs>.cpio.gz`.
pub fn ensure_initramfs(store_root: &Path, kernel: &Kernel) -> Result<PathBuf, ImageError> {
    let busybox = read_static_busybox()?;
    let mut modules = Vec::new();
    for p in &kernel.modules {
        let name = p
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let bytes = std::fs::read(p).ctx(|| format!("reading {}", p.display()))?;
        modules.push((name, bytes));
    }
    let mut h = Sha256::new();
    h.update(INITRAMFS_FORMAT.as_bytes());
    h.update(kernel.version.as_bytes());
    h.update(init_script().as_bytes());
    h.update(INITRAMFS_APPLETS.join(" ").as_bytes());
    h.update(Sha256::digest(&busybox));
    for (name, bytes) in &modules {
        h.update(name.as_bytes());
        h.update(Sha256::digest(bytes));
    }
    let hash = hex::encode(h.finalize());
    let dir = kernel_dir(store_root, &kernel.version);
    let dest = dir.join(format!("initramfs-{}.cpio.gz", &hash[..16]));
    if dest.is_file() {
        tracing::debug!("initramfs is cached at {}", dest.display());
        return Ok(dest);
    }
    tracing::info!(
        "building initramfs for {} ({} modules)",
        kernel.version,
        modules.len()
    );
    std::fs::create_dir_all(&dir).ctx(|| format!("creating {}", dir.display()))?;
    let archive =
        initramfs_archive(&busybox, &modules).ctx(|| "writing the initramfs archive".into())?;
    let tmp = TempPath::new(dir.join(format!(".tmp-initramfs-{}", random_hex(8))));
    let file =
        std::fs::File::create(tmp.path()).ctx(|| format!("creating {}", tmp.path().display()))?;
    let mut gz = flate2::write::GzEncoder::new(file, flate2::Compression::best());
    gz.write_all(&archive)
        .and_then(|_| gz.finish())
        .and_then(|f| f.sync_all())
        .ctx(|| format!("writing {}", tmp.path().display()))?;
    std::fs::rename(tmp.path(), &dest).ctx(|| format!("writing {}", dest.display()))?;
    tmp.keep();
    tracing::info!("initramfs cached at {}", dest.display());
    Ok(dest)
}

/// The uncompressed ELF kernel of `kernel` (`<kernel dir>/vmlinux`), extracted from its
/// bzImage on first use: Firecracker boots only ELF kernels.
pub fn ensure_vmlinux(kernel: &Kernel) -> Result<PathBuf, ImageError> {
    let dest = kernel.dir.join("vmlinux");
    if dest.is_file() {
        return Ok(dest);
    }
    let bz =
        std::fs::read(&kernel.vmlinuz).ctx(|| format!("reading {}", kernel.vmlinuz.display()))?;
    let elf = crate::vmlinux::extract(&bz).map_err(|e| {
        build_err(format!(
            "extracting vmlinux from {}: {e}",
            kernel.vmlinuz.display()
        ))
    })?;
    let tmp = TempPath::new(kernel.dir.join(format!(".tmp-vmlinux-{}", random_hex(8))));
    std::fs::write(tmp.path(), &elf).ctx(|| format!("writing {}", tmp.path().display()))?;
    std::fs::rename(tmp.path(), &dest).ctx(|| format!("writing {}", dest.display()))?;
    tmp.keep();
    tracing::info!(
        "vmlinux ({} MiB) extracted to {}",
        elf.len() >> 20,
        dest.display()
    );
    Ok(dest)
}

/// What a root disk is built from.
#[derive(Debug, Clone, Copy)]
pub enum DiskSource<'a> {
    /// An image in the store, resolved to its layers.
    Image(&'a ImageRef),
    /// Layer digests, bottom first (as in a manifest).
    Layers(&'a [String]),
}

impl DiskSource<'_> {
    fn layers(&self, store: &ImageStore) -> Result<Vec<String>, ImageError> {
        let layers = match self {
            DiskSource::Image(r) => store.resolve(r)?.1.layers,
            DiskSource::Layers(l) => l.to_vec(),
        };
        if layers.is_empty() {
            return Err(build_err(
                "the image has no layers; a root disk needs at least one",
            ));
        }
        for l in &layers {
            if !crate::digest::valid_digest(l) || !store.layer_path(l).is_dir() {
                return Err(ImageError::Corrupt(format!(
                    "layer {l} is not in the image store at {}",
                    store.root().display()
                )));
            }
        }
        Ok(layers)
    }
}

/// Whether a tree holds OCI whiteouts (`.wh.NAME`, `.wh..wh..opq`), which overlayfs
/// does not read.
fn has_oci_whiteouts(dir: &Path) -> Result<bool, ImageError> {
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).ctx(|| format!("listing {}", d.display()))? {
            let e = e.ctx(|| format!("listing {}", d.display()))?;
            if e.file_name().as_encoded_bytes().starts_with(b".wh.") {
                return Ok(true);
            }
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(e.path());
            }
        }
    }
    Ok(false)
}

fn cstring(p: &Path) -> Result<CString, ImageError> {
    CString::new(p.as_os_str().as_encoded_bytes())
        .map_err(|_| build_err(format!("path {} contains a NUL byte", p.display())))
}

/// Rewrites OCI whiteouts in `dir` (a private copy of a layer) as overlayfs ones:
/// `.wh.NAME` becomes a 0/0 character device `NAME`, `.wh..wh..opq` becomes the
/// `trusted.overlay.opaque` attribute on its directory.
fn convert_oci_whiteouts(dir: &Path) -> Result<(), ImageError> {
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let mut entries = Vec::new();
        for e in std::fs::read_dir(&d).ctx(|| format!("listing {}", d.display()))? {
            entries.push(e.ctx(|| format!("listing {}", d.display()))?);
        }
        for e in entries {
            let name = e.file_name().to_string_lossy().into_owned();
            let path = e.path();
            if name == ".wh..wh..opq" {
                std::fs::remove_file(&path).ctx(|| format!("removing {}", path.display()))?;
                let c = cstring(&d)?;
                // SAFETY: NUL-terminated strings; a 1-byte value.
                let rc = unsafe {
                    libc::setxattr(
                        c.as_ptr(),
                        c"trusted.overlay.opaque".as_ptr(),
                        b"y".as_ptr().cast(),
                        1,
                        0,
                    )
                };
                if rc != 0 {
                    return Err(std::io::Error::last_os_error())
                        .ctx(|| format!("marking {} opaque (needs root)", d.display()));
                }
            } else if let Some(target) = name.strip_prefix(".wh.") {
                std::fs::remove_file(&path).ctx(|| format!("removing {}", path.display()))?;
                let hidden = d.join(target);
                if hidden.symlink_metadata().is_ok() {
                    remove_tree(&hidden)?;
                }
                let c = cstring(&hidden)?;
                // SAFETY: NUL-terminated path.
                if unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR, libc::makedev(0, 0)) } != 0 {
                    return Err(std::io::Error::last_os_error())
                        .ctx(|| format!("making whiteout {} (needs root)", hidden.display()));
                }
            } else if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(path);
            }
        }
    }
    Ok(())
}

fn mkdir_mode(p: &Path, mode: u32) -> Result<(), ImageError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(p).ctx(|| format!("creating {}", p.display()))?;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
        .ctx(|| format!("chmod {}", p.display()))
}

/// The most disks a VM's root is made of: its stage and up to this many less one image
/// layers. QEMU's `microvm` has 24 virtio-mmio transports and Firecracker 19 interrupt
/// lines (5 to 23), shared with the network, entropy and vsock devices and whatever else
/// a VM is given; the bottom layers of a deeper image are merged into one disk.
pub const MAX_ROOT_DISKS: usize = 12;

/// A layer tree with OCI whiteouts in a form overlayfs reads: the layer itself, or a
/// converted copy under `work` (whiteouts as 0/0 devices, opaque directories marked).
fn overlay_ready(store: &ImageStore, layer: &str, work: &Path) -> Result<PathBuf, ImageError> {
    let path = store.layer_path(layer);
    if !has_oci_whiteouts(&path)? {
        return Ok(path);
    }
    tracing::info!(
        "layer {} has OCI whiteouts; converting a copy",
        &layer[..12]
    );
    let copy = work.join(format!("oci-{layer}"));
    std::fs::create_dir(&copy).ctx(|| format!("creating {}", copy.display()))?;
    run(
        Command::new("cp")
            .args(["-a", "--reflink=auto"])
            .arg(format!("{}/.", path.display()))
            .arg(&copy),
        "cp -a (layer copy)",
    )?;
    convert_oci_whiteouts(&copy)?;
    Ok(copy)
}

/// Writes `build` to `dest` through a temporary file next to it, unless `dest` exists.
/// One build per destination at a time in this process, and the file is published with
/// a link that never replaces one already there: a disk that VMs use (and whose sha256
/// is kept beside it) never changes under them.
fn cached(
    dest: &Path,
    build: impl FnOnce(&Path) -> Result<(), ImageError>,
) -> Result<PathBuf, ImageError> {
    type Locks = std::sync::Mutex<BTreeMap<PathBuf, std::sync::Arc<std::sync::Mutex<()>>>>;
    static BUILDING: Locks = std::sync::Mutex::new(BTreeMap::new());
    if dest.is_file() {
        return Ok(dest.to_path_buf());
    }
    let lock = BUILDING
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(dest.to_path_buf())
        .or_default()
        .clone();
    let one = lock.lock().unwrap_or_else(|e| e.into_inner());
    let r = (|| {
        if dest.is_file() {
            return Ok(dest.to_path_buf());
        }
        let dir = dest
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).ctx(|| format!("creating {}", dir.display()))?;
        let tmp = TempPath::new(dir.join(format!(".tmp-{}", random_hex(8))));
        build(tmp.path())?;
        std::fs::File::open(tmp.path())
            .and_then(|f| f.sync_all())
            .ctx(|| format!("syncing {}", tmp.path().display()))?;
        match std::fs::hard_link(tmp.path(), dest) {
            Ok(()) => {}
            // Another process (a second edge on the store) published it first.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e).ctx(|| format!("writing {}", dest.display())),
        }
        Ok(dest.to_path_buf())
    })();
    drop(one);
    BUILDING
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(dest);
    r
}

/// The EROFS disk of one store layer: the lazy file system's file for a lazily pulled
/// layer (its blocks fetched as the guest reads them), else `erofs/<layer>.img`, built
/// once from the layer's tree and kept while the layer is.
pub fn layer_disk(store: &ImageStore, layer: &str) -> Result<PathBuf, ImageError> {
    if crate::lazy::is_registered(store.root(), layer) {
        let m = store.lazy().ok_or_else(|| {
            build_err(format!(
                "layer {layer} is fetched lazily, and this node cannot serve it ({}); pull the image again with --no-lazy",
                crate::lazy::unsupported().unwrap_or_else(|| "lazy images are off".into())
            ))
        })?;
        m.ensure_daemon()?;
        return Ok(m.fuse_dir().join(layer));
    }
    let dest = store.root().join("erofs").join(format!("{layer}.img"));
    cached(&dest, |tmp| {
        let work = TempPath::new(store.temp_dir("layer-disk")?);
        let tree = overlay_ready(store, layer, work.path())?;
        let s = crate::erofs::build(&tree, tmp)?;
        tracing::info!(
            "layer {} as an EROFS disk: {} inodes, {} KiB",
            &layer[..12],
            s.inodes,
            s.bytes >> 10
        );
        Ok(())
    })
}

/// The disk on top of every VM's root: `aether` at [`AETHER_GUEST_PATH`], and the
/// directories `/init` mounts on (`/proc`, `/sys`, `/dev`, `/mnt`, `/.dsec/lower`,
/// `/.dsec/rw`).
fn stage_disk(store: &ImageStore, aether: &Path, aether_sha: &str) -> Result<PathBuf, ImageError> {
    let mut h = Sha256::new();
    h.update(ROOT_DISK_FORMAT.as_bytes());
    h.update(aether_sha.as_bytes());
    let dest =
        disks_dir(store.root()).join(format!("stage-{}.erofs", &hex::encode(h.finalize())[..32]));
    cached(&dest, |tmp| {
        let work = TempPath::new(store.temp_dir("stage")?);
        let stage = work.path().join("stage");
        mkdir_mode(&stage, 0o755)?;
        for d in [
            "proc",
            "sys",
            "dev",
            "mnt",
            ".dsec",
            ".dsec/lower",
            ".dsec/rw",
        ] {
            mkdir_mode(&stage.join(d), 0o755)?;
        }
        let dest = stage.join(AETHER_GUEST_PATH.trim_start_matches('/'));
        std::fs::copy(aether, &dest).ctx(|| format!("copying {}", aether.display()))?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(0o755))
                .ctx(|| format!("chmod {}", dest.display()))?;
        }
        crate::erofs::build(&stage, tmp).map(|_| ())
    })
}

/// Gives the calling thread a mount namespace of its own, whose mounts propagate nowhere:
/// they go when the thread ends (unshare affects only it, which then has its own file
/// system information too).
fn own_mount_namespace() -> std::io::Result<()> {
    // SAFETY: no pointers.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: NUL-terminated constants.
    let rc = unsafe {
        libc::mount(
            c"none".as_ptr(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Mounts a read-only overlay of `lowerdir` (`:`-separated, top first) on `target`.
fn overlay_ro(lowerdir: &str, target: &Path) -> std::io::Result<()> {
    let bad = |_| std::io::Error::from(std::io::ErrorKind::InvalidInput);
    let t = CString::new(target.as_os_str().as_encoded_bytes()).map_err(bad)?;
    let data = CString::new(format!("ro,lowerdir={lowerdir}")).map_err(bad)?;
    // SAFETY: NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            c"dsec-layers".as_ptr(),
            t.as_ptr(),
            c"overlay".as_ptr(),
            libc::MS_RDONLY,
            data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// One EROFS disk of `layers` (bottom first) stacked: what overlayfs shows of them,
/// read in a mount namespace of a thread of its own, which the overlay goes with.
fn merged_disk(store: &ImageStore, layers: &[String]) -> Result<PathBuf, ImageError> {
    let mut h = Sha256::new();
    h.update(ROOT_DISK_FORMAT.as_bytes());
    for l in layers {
        h.update(l.as_bytes());
        h.update(b"\n");
    }
    let dest =
        disks_dir(store.root()).join(format!("merged-{}.erofs", &hex::encode(h.finalize())[..32]));
    cached(&dest, |tmp| {
        // Lazy ones are read whole, through their mounts.
        store.ready_layers(layers)?;
        let work = TempPath::new(store.temp_dir("merge")?);
        let mut lowers = Vec::new();
        for l in layers.iter().rev() {
            lowers.push(overlay_ready(store, l, work.path())?);
        }
        let merged = work.path().join("merged");
        std::fs::create_dir(&merged).ctx(|| format!("creating {}", merged.display()))?;
        // Relative to layers/ (the thread's own working directory, below), to fit more
        // layers in one mount's options.
        let layers_dir = store.root().join("layers");
        let rel = |p: &Path| match p.strip_prefix(&layers_dir) {
            Ok(r) => r.display().to_string(),
            Err(_) => format!(
                "../tmp/{}",
                p.strip_prefix(store.root().join("tmp"))
                    .unwrap_or(p)
                    .display()
            ),
        };
        let opts = lowers.iter().map(|p| rel(p)).collect::<Vec<_>>().join(":");
        if opts.len() >= 3900 || opts.contains(',') {
            return Err(build_err(format!(
                "the image has too many layers ({}) to merge in one overlay mount; build it with fewer steps",
                layers.len()
            )));
        }
        tracing::info!("merging {} bottom layers into one EROFS disk", layers.len());
        // Absolute: the thread changes its working directory.
        let abs = |p: &Path| std::path::absolute(p).ctx(|| format!("resolving {}", p.display()));
        let (tmp, merged2, layers_dir) = (abs(tmp)?, abs(&merged)?, abs(&layers_dir)?);
        std::thread::spawn(move || -> Result<(), ImageError> {
            own_mount_namespace()
                .ctx(|| "a mount namespace for merging layers (needs root)".into())?;
            // This thread's alone: its file system information was unshared with the
            // namespace.
            std::env::set_current_dir(&layers_dir)
                .ctx(|| format!("entering {}", layers_dir.display()))?;
            overlay_ro(&opts, &merged2).ctx(|| "mounting the layers to merge".into())?;
            crate::erofs::build(&merged2, &tmp).map(|_| ())
        })
        .join()
        .map_err(|_| build_err("merging layers panicked"))?
    })
}

/// Where root disks are cached.
pub fn disks_dir(store_root: &Path) -> PathBuf {
    guest_dir(store_root).join("disks")
}

/// The sha256 of a root disk (they never change once built), kept next to it as
/// `<disk>.sha256` after the first time. A lazy layer's file is named by its digest,
/// which its chunks are checked against as they arrive.
pub fn disk_sha256(disk: &Path) -> Result<String, ImageError> {
    if let Some((_, hex)) = crate::lazy::lazyfs_blob(disk) {
        return Ok(hex.to_string());
    }
    let mut side = disk.as_os_str().to_owned();
    side.push(".sha256");
    let side = PathBuf::from(side);
    if let Ok(s) = std::fs::read_to_string(&side) {
        let s = s.trim();
        if s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Ok(s.to_string());
        }
    }
    let sha = file_sha256(disk)?;
    let _ = std::fs::write(&side, &sha);
    Ok(sha)
}

/// A root disk received from another edge (`received`, claimed to have `sha256`): checked
/// and kept as `disks/imported-<sha256>.img`, which is returned.
pub fn adopt_disk(store_root: &Path, received: &Path, sha256: &str) -> Result<PathBuf, ImageError> {
    if sha256.len() != 64 || !sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(build_err(format!("{sha256:?} is not a sha256")));
    }
    let got = file_sha256(received)?;
    if got != sha256 {
        return Err(build_err(format!(
            "the received root disk has sha256 {got}, not the {sha256} it was sent as"
        )));
    }
    let dir = disks_dir(store_root);
    std::fs::create_dir_all(&dir).ctx(|| format!("creating {}", dir.display()))?;
    let dest = dir.join(format!("imported-{sha256}.img"));
    if dest.is_file() {
        let _ = std::fs::remove_file(received);
    } else if std::fs::rename(received, &dest).is_err() {
        // Another filesystem: copy, then move into place whole.
        let tmp = TempPath::new(dir.join(format!(".imported-{sha256}.{}.tmp", random_hex(6))));
        std::fs::copy(received, tmp.path())
            .ctx(|| format!("copying the disk to {}", tmp.path().display()))?;
        std::fs::rename(tmp.path(), &dest)
            .ctx(|| format!("moving the disk to {}", dest.display()))?;
        tmp.keep();
        let _ = std::fs::remove_file(received);
    }
    let mut side = dest.as_os_str().to_owned();
    side.push(".sha256");
    let _ = std::fs::write(PathBuf::from(side), sha256);
    Ok(dest)
}

/// The disks a VM's root is made of, top first: the stage ([`AETHER_GUEST_PATH`] and
/// mount points), then the image's layers as EROFS disks, shared by every VM (and image)
/// with the layer, the bottom ones merged into one past [`MAX_ROOT_DISKS`]. The guest's
/// `/init` stacks them under an overlay (`dsec.layers=N` on its command line, see
/// [`root_cmdline`]).
pub fn ensure_root_disks(
    store: &ImageStore,
    source: DiskSource<'_>,
    aether: &Path,
) -> Result<Vec<PathBuf>, ImageError> {
    let layers = source.layers(store)?;
    let aether_sha = aether_digest(aether)?;
    let mut disks = vec![stage_disk(store, aether, &aether_sha)?];
    // Layers kept as their own disks: all of them when they fit beside the stage, else
    // the top ones, with one disk left for the merged rest.
    let room = MAX_ROOT_DISKS - 1;
    let (bottom, top) = if layers.len() <= room {
        (&layers[..0], &layers[..])
    } else {
        layers.split_at(layers.len() - (room - 1))
    };
    for l in top.iter().rev() {
        disks.push(layer_disk(store, l)?);
    }
    if !bottom.is_empty() {
        disks.push(merged_disk(store, bottom)?);
    }
    Ok(disks)
}

/// What a guest booted from `n` disks of [`ensure_root_disks`] is told on its command
/// line.
pub fn root_cmdline(n: usize) -> String {
    format!("dsec.layers={n}")
}

/// The virtio-blk serial of root disk `i`, which `/init` places it by when the device
/// order differs from the command line's. QEMU sets it as `serial=`; it is also the
/// Firecracker drive id (alphanumerics and `_`), though Firecracker answers another
/// serial, so a microVM's disks are placed by their order, which is the order they are
/// attached in.
pub fn disk_serial(i: usize) -> String {
    format!("dsec_l{i}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpio::{S_IFCHR, S_IFLNK, read_newc};
    use std::collections::HashSet;

    #[test]
    fn kernel_release_comes_from_the_meta_package_dependency() {
        let out = "linux-image-cloud-amd64\n  Depends: linux-image-6.1.0-57-cloud-amd64\n";
        assert_eq!(
            parse_kernel_depends(out).as_deref(),
            Some("6.1.0-57-cloud-amd64")
        );
        let alt =
            "linux-image-cloud-amd64\n |Depends: <linux-image-6.1.0-9-cloud-amd64>\n  Depends: x\n";
        assert_eq!(
            parse_kernel_depends(alt).as_deref(),
            Some("6.1.0-9-cloud-amd64")
        );
        assert_eq!(
            parse_kernel_depends("x\n  Depends: linux-image-6.1.0-57-amd64\n"),
            None
        );
        assert_eq!(
            parse_kernel_depends("  Depends: linux-image-../../x-cloud-amd64\n"),
            None
        );
        let policy =
            "linux-image-6.1.0-57-cloud-amd64:\n  Installed: (none)\n  Candidate: 6.1.192-3\n";
        assert_eq!(parse_candidate(policy).as_deref(), Some("6.1.192-3"));
        assert_eq!(parse_candidate("x:\n  Candidate: (none)\n"), None);
    }

    #[test]
    fn finds_plain_and_compressed_modules_with_dash_or_underscore() {
        let tmp = tempfile::tempdir().unwrap();
        let k = tmp.path().join("kernel");
        std::fs::create_dir_all(k.join("drivers/char/hw_random")).unwrap();
        std::fs::create_dir_all(k.join("fs/overlayfs")).unwrap();
        std::fs::write(k.join("drivers/char/hw_random/virtio-rng.ko"), b"rng").unwrap();
        std::fs::write(k.join("fs/overlayfs/overlay.ko.xz"), b"xz").unwrap();
        std::fs::write(k.join("fs/overlayfs/README"), b"no").unwrap();
        let m = find_modules(&k).unwrap();
        assert_eq!(m.len(), 2);
        assert!(m[&module_key("virtio-rng")].ends_with("virtio-rng.ko"));
        assert!(m["overlay"].ends_with("overlay.ko.xz"));
    }

    #[test]
    fn compressed_modules_are_decompressed() {
        if Command::new("xz").arg("--version").output().is_err() {
            eprintln!("skipped: xz is not installed");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let plain = tmp.path().join("m.ko");
        std::fs::write(&plain, b"module bytes").unwrap();
        assert!(
            Command::new("xz")
                .arg("-k")
                .arg(&plain)
                .status()
                .unwrap()
                .success()
        );
        let out = tmp.path().join("out.ko");
        install_module(&tmp.path().join("m.ko.xz"), &out).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"module bytes");
    }

    #[test]
    fn elf_check_tells_static_from_dynamic() {
        let sh = std::fs::read("/bin/sh").unwrap();
        assert_eq!(
            dsec_common::elf::has_interpreter(&sh),
            Ok(true),
            "/bin/sh is dynamic"
        );
        if let Ok(bb) = std::fs::read(HOST_BUSYBOX) {
            // Debian's busybox-static; the dynamic `busybox` package also installs here.
            let dynamic = Command::new("file")
                .arg("-L")
                .arg(HOST_BUSYBOX)
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).contains("dynamically"))
                .unwrap_or(false);
            assert_eq!(dsec_common::elf::has_interpreter(&bb), Ok(dynamic));
        }
        assert!(dsec_common::elf::has_interpreter(b"#!/bin/sh\n").is_err());
    }

    #[test]
    fn initramfs_has_busybox_applets_modules_console_and_init() {
        let modules = vec![
            ("virtio_ring".to_string(), b"ring".to_vec()),
            ("virtio-rng".to_string(), b"rng".to_vec()),
        ];
        let a = initramfs_archive(b"\x7fELFbusybox", &modules).unwrap();
        let e = read_newc(&a).unwrap();
        let get = |n: &str| {
            e.iter()
                .find(|e| e.name == n)
                .unwrap_or_else(|| panic!("{n} missing"))
        };
        assert_eq!(get("bin/busybox").mode, 0o100755);
        assert_eq!(get("bin/busybox").data, b"\x7fELFbusybox");
        for a in [
            "sh",
            "mount",
            "insmod",
            "switch_root",
            "mkdir",
            "echo",
            "cat",
            "sleep",
        ] {
            let l = get(&format!("bin/{a}"));
            assert_eq!(l.file_type(), S_IFLNK, "{a}");
            assert_eq!(l.data, b"busybox", "{a}");
        }
        assert_eq!(get("dev/console").file_type(), S_IFCHR);
        assert_eq!(get("dev/console").rdev, (5, 1));
        assert_eq!(get("lib/modules/virtio-rng.ko").data, b"rng");
        let init = get("init");
        assert_eq!(init.mode, 0o100755);
        let script = String::from_utf8(init.data.clone()).unwrap();
        assert!(script.starts_with("#!/bin/sh\n"));
        assert!(script.contains(ROOT_READY_LINE));
        assert!(script.contains("exec switch_root /newroot \"$init\" \"$@\""));
        assert!(script.contains(&format!("init={AETHER_GUEST_PATH}\n")));
        // Modules load in the documented order.
        let for_line = script.lines().find(|l| l.starts_with("for m in ")).unwrap();
        assert_eq!(
            for_line,
            format!("for m in {}; do", GUEST_MODULES.join(" "))
        );
        for d in ["proc", "sys", "mnt/lower", "mnt/rw", "newroot"] {
            assert_eq!(get(d).mode, 0o040755, "{d}");
        }
    }

    #[test]
    fn init_script_parses_with_busybox_sh() {
        let Ok(out) = Command::new(HOST_BUSYBOX)
            .args(["sh", "-n", "-c", &init_script()])
            .output()
        else {
            eprintln!("skipped: {HOST_BUSYBOX} is not installed");
            return;
        };
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Mounts `disks` (EROFS, top first) stacked read-only under an overlay, as the
    /// guest's `/init` does, in a thread with a mount namespace of its own, and gives
    /// `look` the merged tree.
    fn stacked<T: Send + 'static>(
        disks: &[PathBuf],
        look: impl FnOnce(&Path) -> T + Send + 'static,
    ) -> T {
        let disks = disks.to_vec();
        std::thread::spawn(move || {
            let dir = tempfile::tempdir().unwrap();
            own_mount_namespace().unwrap();
            let mut lowers = Vec::new();
            for (i, d) in disks.iter().enumerate() {
                let m = dir.path().join(i.to_string());
                std::fs::create_dir(&m).unwrap();
                crate::erofs::mount(d, &m).unwrap();
                lowers.push(m.display().to_string());
            }
            let merged = dir.path().join("merged");
            std::fs::create_dir(&merged).unwrap();
            overlay_ro(&lowers.join(":"), &merged).unwrap();
            look(&merged)
        })
        .join()
        .unwrap()
    }

    fn names(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// A throw-away store, where root disks can be built and mounted (root, and a kernel
    /// that mounts EROFS from a file); `None`, said, elsewhere.
    fn erofs_store() -> Option<(tempfile::TempDir, ImageStore)> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 || crate::lazy::unsupported().is_some() {
            eprintln!("skipped: needs root and a kernel that mounts EROFS from a file");
            return None;
        }
        let tmp = tempfile::tempdir().unwrap();
        let store = ImageStore::open(tmp.path()).unwrap();
        Some((tmp, store))
    }

    /// An overlayfs whiteout (a 0/0 character device) at `p`.
    fn whiteout(p: &Path) {
        let c = cstring(p).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(
            unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR, libc::makedev(0, 0)) },
            0
        );
    }

    /// Layers with overlayfs and OCI whiteouts become EROFS disks that stack, under the
    /// stage, into the image's tree; disks are cached per layer and shared by images.
    #[test]
    fn root_disks_stack_layers_honour_whiteouts_and_cache() {
        let Some((tmp, store)) = erofs_store() else {
            return;
        };
        let mk = |files: &[(&str, &str)]| {
            let d = store.temp_dir("l").unwrap();
            for (p, c) in files {
                let p = d.join(p);
                std::fs::create_dir_all(p.parent().unwrap()).unwrap();
                std::fs::write(p, c).unwrap();
            }
            d
        };
        let base = mk(&[
            ("etc/keep", "base"),
            ("etc/over", "base"),
            ("etc/gone-overlay", "x"),
            ("etc/gone-oci", "x"),
            ("opq/old", "x"),
            ("opq-oci/old", "x"),
        ]);
        std::os::unix::fs::chown(base.join("etc/keep"), Some(1000), Some(1001)).unwrap();
        let (l1, _) = store.add_layer(&base).unwrap();
        let top = mk(&[("etc/over", "top"), ("opq/new", "y"), ("opq-oci/new", "y")]);
        // overlayfs-style whiteout and opaque dir, as `run` steps produce them.
        whiteout(&top.join("etc/gone-overlay"));
        let opq = cstring(&top.join("opq")).unwrap();
        assert_eq!(
            unsafe {
                libc::setxattr(
                    opq.as_ptr(),
                    c"trusted.overlay.opaque".as_ptr(),
                    b"y".as_ptr().cast(),
                    1,
                    0,
                )
            },
            0
        );
        let (l2, _) = store.add_layer(&top).unwrap();
        // OCI-style whiteouts in a third layer.
        let oci = mk(&[
            ("etc/.wh.gone-oci", ""),
            ("opq-oci/.wh..wh..opq", ""),
            ("opq-oci/fresh", "z"),
        ]);
        let (l3, _) = store.add_layer(&oci).unwrap();
        let aether = tmp.path().join("aether");
        std::fs::write(&aether, b"#!/bin/sh\necho aether\n").unwrap();

        let layers = vec![l1.clone(), l2.clone(), l3.clone()];
        let disks = ensure_root_disks(&store, DiskSource::Layers(&layers), &aether).unwrap();
        assert_eq!(disks.len(), 4, "{disks:?}");
        assert!(disks[0].starts_with(tmp.path().join("guest/disks")));
        // Top first, each layer its own disk.
        for (d, l) in disks[1..].iter().zip([&l3, &l2, &l1]) {
            assert_eq!(*d, tmp.path().join("erofs").join(format!("{l}.img")));
        }
        let (keep, over, aether_text, root, etc, opq_ls, opq_oci, owner, mode) =
            stacked(&disks, |m| {
                use std::os::unix::fs::MetadataExt;
                let keep = std::fs::metadata(m.join("etc/keep")).unwrap();
                (
                    std::fs::read_to_string(m.join("etc/keep")).unwrap(),
                    std::fs::read_to_string(m.join("etc/over")).unwrap(),
                    std::fs::read_to_string(m.join(".dsec/aether")).unwrap(),
                    names(m),
                    names(&m.join("etc")),
                    names(&m.join("opq")),
                    names(&m.join("opq-oci")),
                    (keep.uid(), keep.gid()),
                    std::fs::metadata(m.join(".dsec/aether")).unwrap().mode() & 0o7777,
                )
            });
        assert_eq!(keep, "base");
        assert_eq!(over, "top");
        assert_eq!(aether_text, "#!/bin/sh\necho aether\n");
        for d in ["proc", "sys", "dev", "mnt", "etc", ".dsec"] {
            assert!(root.contains(&d.to_string()), "/{d} missing in {root:?}");
        }
        assert_eq!(etc, ["keep", "over"], "whiteouts ignored");
        assert_eq!(opq_ls, ["new"]);
        // The opaque marker hides everything below its layer, even l2's newer file.
        assert_eq!(opq_oci, ["fresh"]);
        assert_eq!(owner, (1000, 1001));
        assert_eq!(mode, 0o755);

        // Cache hit: same paths, not rewritten; another image with a shared layer
        // shares its disk.
        let mtime = std::fs::metadata(&disks[1]).unwrap().modified().unwrap();
        assert_eq!(
            ensure_root_disks(&store, DiskSource::Layers(&layers), &aether).unwrap(),
            disks
        );
        assert_eq!(
            std::fs::metadata(&disks[1]).unwrap().modified().unwrap(),
            mtime
        );
        let other = ensure_root_disks(&store, DiskSource::Layers(&layers[..1]), &aether).unwrap();
        assert_eq!(other[1], disks[3]);
        // Another aether, another stage; the layers' disks stay.
        std::fs::write(&aether, b"other").unwrap();
        let disks2 = ensure_root_disks(&store, DiskSource::Layers(&layers), &aether).unwrap();
        assert_ne!(disks[0], disks2[0]);
        assert_eq!(disks[1..], disks2[1..]);
        // Nothing left behind in tmp/, and the store's layers are untouched.
        assert_eq!(
            std::fs::read_dir(tmp.path().join("tmp")).unwrap().count(),
            0
        );
        assert!(store.layer_path(&l3).join("etc/.wh.gone-oci").exists());
        // A layer's disk goes with the layer.
        store.gc(&HashSet::new()).unwrap();
        assert!(!disks[1].exists());
    }

    /// An image deeper than [`MAX_ROOT_DISKS`] keeps its top layers as their own disks and
    /// merges the rest into one, whiteouts across the cut included.
    #[test]
    fn deep_images_merge_their_bottom_layers() {
        let Some((tmp, store)) = erofs_store() else {
            return;
        };
        let n = MAX_ROOT_DISKS + 4;
        let mut layers = Vec::new();
        for i in 0..n {
            let d = store.temp_dir("l").unwrap();
            std::fs::create_dir(d.join("f")).unwrap();
            std::fs::write(d.join(format!("f/{i}")), i.to_string()).unwrap();
            // Layer 1 deletes layer 0's file (both merged); the top deletes layer 2's.
            let gone = match i {
                1 => Some(0),
                i if i == n - 1 => Some(2),
                _ => None,
            };
            if let Some(g) = gone {
                whiteout(&d.join(format!("f/{g}")));
            }
            layers.push(store.add_layer(&d).unwrap().0);
        }
        let aether = tmp.path().join("aether");
        std::fs::write(&aether, b"a").unwrap();
        let disks = ensure_root_disks(&store, DiskSource::Layers(&layers), &aether).unwrap();
        assert_eq!(disks.len(), MAX_ROOT_DISKS);
        assert!(
            disks[MAX_ROOT_DISKS - 1]
                .file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("merged-")
        );
        let seen = stacked(&disks, |m| names(&m.join("f")));
        let mut want: Vec<String> = (0..n)
            .filter(|i| *i != 0 && *i != 2)
            .map(|i| i.to_string())
            .collect();
        want.sort();
        assert_eq!(seen, want);
        assert_eq!(
            ensure_root_disks(&store, DiskSource::Layers(&layers), &aether).unwrap(),
            disks
        );
    }
}
