//! The guest kernel: the release `linux-image-cloud-amd64` depends on, its package fetched
//! with apt and unpacked into the store with the modules the guests load, and the ELF
//! `vmlinux` inside it for Firecracker.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use dsec_common::id::random_hex;
use serde::{Deserialize, Serialize};

use super::*;
use crate::digest::file_sha256;
use crate::store::remove_tree;
use crate::{ImageError, IoContext};

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
pub(super) const REQUIRED_MODULES: &[&str] = &[
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "virtio_blk",
    "erofs",
    "overlay",
];

/// Bumped whenever the set of modules taken from the kernel package changes: a cached
/// kernel of another format is unpacked again.
pub(super) const KERNEL_FORMAT: &str = "dsec-kernel-v4";

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
pub(super) struct KernelJson {
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

pub(super) fn valid_release(v: &str) -> bool {
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
pub(super) fn parse_candidate(policy: &str) -> Option<String> {
    policy.lines().find_map(|l| {
        let v = l.trim().strip_prefix("Candidate:")?.trim();
        (v != "(none)" && !v.is_empty()).then(|| v.to_string())
    })
}

pub(super) fn apt_fix() -> String {
    format!(
        "run `apt-get update` (a Debian bookworm main source must be configured) so apt knows {KERNEL_META_PACKAGE}"
    )
}

/// The kernel release `linux-image-cloud-amd64` points at now.
pub(super) fn current_kernel_release() -> Result<String, ImageError> {
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
pub(super) fn candidate_version(package: &str) -> Result<String, ImageError> {
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

pub(super) fn kernel_dir(store_root: &Path, release: &str) -> PathBuf {
    guest_dir(store_root).join(format!("kernel-{release}"))
}

/// Loads a cached kernel, or `None` when `dir` holds none.
pub(super) fn load_kernel(dir: &Path) -> Result<Option<Kernel>, ImageError> {
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
pub(super) fn newest_cached_kernel(store_root: &Path) -> Option<Kernel> {
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
pub(super) fn module_key(name: &str) -> String {
    name.replace('-', "_")
}

/// Module name → path of its `.ko`, `.ko.xz`, `.ko.zst` or `.ko.gz` under `dir`.
pub(super) fn find_modules(dir: &Path) -> Result<BTreeMap<String, PathBuf>, ImageError> {
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
pub(super) fn install_module(src: &Path, dest: &Path) -> Result<(), ImageError> {
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
pub(super) fn builtin_modules(modroot: &Path) -> Vec<String> {
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
