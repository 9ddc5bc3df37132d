//! A VM's root disks: one read-only EROFS disk per image layer (a lazily pulled layer's
//! is its file on the lazy file system), the bottom layers of a deep image merged into one,
//! and the stage disk on top (aether and the root's mount points); disks received from
//! another edge are checked and kept by their sha256.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::process::Command;

use dsec_common::id::random_hex;
use sha2::{Digest, Sha256};

use super::*;
use crate::digest::file_sha256;
use crate::store::remove_tree;
use crate::{ImageError, ImageRef, ImageStore, IoContext};

pub(super) const ROOT_DISK_FORMAT: &str = "dsec-root-disk-v2";

/// [`file_sha256`] of the aether binary, remembered while the file is the same one
/// (device, inode, size, modification time): it is hashed into every VM's root disk key,
/// and hashing its megabytes on every boot would be the larger part of a boot's host work.
/// An error says what to do about it.
pub(super) fn aether_digest(p: &Path) -> Result<String, ImageError> {
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
pub(super) fn has_oci_whiteouts(dir: &Path) -> Result<bool, ImageError> {
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

pub(super) fn cstring(p: &Path) -> Result<CString, ImageError> {
    CString::new(p.as_os_str().as_encoded_bytes())
        .map_err(|_| build_err(format!("path {} contains a NUL byte", p.display())))
}

/// Rewrites OCI whiteouts in `dir` (a private copy of a layer) as overlayfs ones:
/// `.wh.NAME` becomes a 0/0 character device `NAME`, `.wh..wh..opq` becomes the
/// `trusted.overlay.opaque` attribute on its directory.
pub(super) fn convert_oci_whiteouts(dir: &Path) -> Result<(), ImageError> {
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

pub(super) fn mkdir_mode(p: &Path, mode: u32) -> Result<(), ImageError> {
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
pub(super) fn overlay_ready(
    store: &ImageStore,
    layer: &str,
    work: &Path,
) -> Result<PathBuf, ImageError> {
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
pub(super) fn cached(
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
pub(super) fn stage_disk(
    store: &ImageStore,
    aether: &Path,
    aether_sha: &str,
) -> Result<PathBuf, ImageError> {
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
pub(super) fn own_mount_namespace() -> std::io::Result<()> {
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
pub(super) fn overlay_ro(lowerdir: &str, target: &Path) -> std::io::Result<()> {
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
pub(super) fn merged_disk(store: &ImageStore, layers: &[String]) -> Result<PathBuf, ImageError> {
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
