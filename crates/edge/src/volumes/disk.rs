//! A volume's disk: an ext4 file system in a sparse file of the volume's size, so what a
//! volume holds is bounded by the kernel (a full volume answers `ENOSPC`, the node's disk
//! is untouched), and it survives the sandboxes and the edge. It is mounted through a loop
//! device in the sandboxes' mount namespace (never the host's), `nosuid,nodev`; the loop
//! device clears itself when the last mount goes.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use dsec_common::{IoContext, IoFailure};

use super::VolumeError;

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LO_FLAGS_AUTOCLEAR: u32 = 4;

/// `struct loop_info64` (linux/loop.h).
#[repr(C)]
struct LoopInfo64 {
    device: u64,
    inode: u64,
    rdevice: u64,
    offset: u64,
    sizelimit: u64,
    number: u32,
    encrypt_type: u32,
    encrypt_key_size: u32,
    flags: u32,
    file_name: [u8; 64],
    crypt_name: [u8; 64],
    encrypt_key: [u8; 32],
    init: [u64; 2],
}

/// `struct loop_config` (linux/loop.h, `LOOP_CONFIGURE` since Linux 5.8).
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

pub const IMAGE: &str = "disk.ext4";
pub const MOUNT: &str = "mnt";

/// Makes the volume's file system in `dir` (a new, empty directory): a sparse file of
/// `size_mb` and `mkfs.ext4` on it (not on a hot path: once per volume).
pub fn make(dir: &Path, size_mb: u64) -> Result<(), VolumeError> {
    let image = dir.join(IMAGE);
    let f = File::create(&image).ctx(|| format!("creating {}", image.display()))?;
    f.set_len(size_mb * 1024 * 1024)
        .ctx(|| format!("sizing {}", image.display()))?;
    drop(f);
    std::fs::create_dir(dir.join(MOUNT)).ctx(|| "creating the mount point".into())?;
    let out = std::process::Command::new("mkfs.ext4")
        .args([
            "-q",
            "-F",
            "-m",
            "0",
            "-E",
            "root_owner=0:0,lazy_itable_init=1,lazy_journal_init=1",
        ])
        .arg(&image)
        .stdin(std::process::Stdio::null())
        .output()
        .ctx(|| "running mkfs.ext4 (is e2fsprogs installed?)".into())?;
    if !out.status.success() {
        return Err(VolumeError::Mkfs {
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

/// The calling thread's mount table (`mountinfo`).
pub fn mount_table() -> String {
    std::fs::read_to_string("/proc/thread-self/mountinfo").unwrap_or_default()
}

/// Whether `target` is a mount point in the calling thread's mount namespace.
pub fn mounted(target: &Path) -> bool {
    crate::mountns::has_mount_within(&mount_table(), target)
}

/// A free loop device, backed by `image` (it clears itself once unmounted).
fn attach_loop(image: &Path) -> Result<(File, String), VolumeError> {
    let ctl = File::open("/dev/loop-control").ctx(|| "opening /dev/loop-control".into())?;
    let backing = OpenOptions::new()
        .read(true)
        .write(true)
        .open(image)
        .ctx(|| format!("opening {}", image.display()))?;
    // Another process may take the device between the two calls: try again.
    for _ in 0..16 {
        // SAFETY: an ioctl without an argument on an open descriptor.
        let n = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE) };
        if n < 0 {
            return Err(IoFailure::last_os("finding a free loop device").into());
        }
        let dev = format!("/dev/loop{n}");
        let lo = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&dev)
            .ctx(|| format!("opening {dev}"))?;
        // SAFETY: zeroed is a valid loop_config; the fields set are plain integers.
        let mut cfg: LoopConfig = unsafe { std::mem::zeroed() };
        cfg.fd = backing.as_raw_fd() as u32;
        cfg.info.flags = LO_FLAGS_AUTOCLEAR;
        // SAFETY: LOOP_CONFIGURE reads a loop_config of the size the kernel expects.
        let rc = unsafe { libc::ioctl(lo.as_raw_fd(), LOOP_CONFIGURE, &cfg as *const LoopConfig) };
        if rc == 0 {
            return Ok((lo, dev));
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EBUSY) {
            return Err(
                IoFailure::new(format!("setting up {dev} for {}", image.display()), e).into(),
            );
        }
    }
    Err(VolumeError::NoFreeLoop)
}

/// Mounts the volume in `dir` at `dir/mnt` unless it is mounted already; `fresh`: its
/// file system was just made (the root is opened to every user of the sandboxes, and
/// mkfs's `lost+found` goes). Runs in the sandboxes' mount namespace.
pub fn mount(dir: &Path, fresh: bool) -> Result<(), VolumeError> {
    // One mount at a time: two first uses at once must not mount one file system twice.
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let target = dir.join(MOUNT);
    if mounted(&target) {
        return Ok(());
    }
    let (lo, dev) = attach_loop(&dir.join(IMAGE))?;
    let src =
        CString::new(dev.as_bytes()).map_err(|_| VolumeError::NulInPath(dev.clone().into()))?;
    let tgt = CString::new(target.as_os_str().as_bytes())
        .map_err(|_| VolumeError::NulInPath(target.clone()))?;
    // SAFETY: mount(2) with NUL-terminated strings.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            tgt.as_ptr(),
            c"ext4".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            c"errors=remount-ro".as_ptr().cast(),
        )
    };
    // The mount holds the device now; with autoclear it goes with the last mount.
    drop(lo);
    if rc != 0 {
        return Err(IoFailure::last_os(format!("mounting {dev} at {}", target.display())).into());
    }
    if fresh {
        let _ = std::fs::remove_dir(target.join("lost+found"));
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o777))
            .ctx(|| "opening the volume's root".into())?;
    }
    Ok(())
}

/// Unmounts the volume in `dir` (in the sandboxes' mount namespace), if mounted.
pub fn unmount(dir: &Path) -> Result<(), VolumeError> {
    let target = dir.join(MOUNT);
    if !mounted(&target) {
        return Ok(());
    }
    let tgt = CString::new(target.as_os_str().as_bytes())
        .map_err(|_| VolumeError::NulInPath(target.clone()))?;
    // SAFETY: umount2(2) with a NUL-terminated path.
    if unsafe { libc::umount2(tgt.as_ptr(), libc::MNT_DETACH) } != 0 {
        return Err(IoFailure::last_os(format!("unmounting {}", target.display())).into());
    }
    Ok(())
}

/// Bytes the volume's files take (its file system's used blocks), read at `root`.
pub fn used_bytes(root: &Path) -> u64 {
    let Ok(c) = CString::new(root.as_os_str().as_bytes()) else {
        return 0;
    };
    // SAFETY: statvfs with a NUL-terminated path and a zeroed out-struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return 0;
    }
    (st.f_blocks.saturating_sub(st.f_bfree)) * st.f_frsize
}
