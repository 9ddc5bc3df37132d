//! The sandbox root filesystem: a size-limited tmpfs holding the overlay's upper and work
//! directories, and the overlay (read-only image layers + that upper). Both are made in
//! the sandboxes' mount namespace ([`crate::mountns`]); the overlay then leaves it as a
//! detached mount ([`detach`]) that the OCI runtime's call attaches at `rootfs/` in a
//! namespace of its own ([`attach`]), so it is only ever mounted where the container is.

use std::ffi::CString;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use dsec_common::{IoContext, IoFailure};

use super::ContainerError;

// From <linux/mount.h>.
const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 4;

fn cstr(p: &Path) -> Result<CString, ContainerError> {
    CString::new(p.as_os_str().as_encoded_bytes())
        .map_err(|_| ContainerError::NulInPath(p.to_path_buf()))
}

fn mount(src: &str, target: &Path, fstype: &str, data: &str) -> Result<(), ContainerError> {
    let c = |s: &str| CString::new(s).map_err(|_| ContainerError::NulInPath(s.into()));
    let (src_c, fs_c, data_c) = (c(src)?, c(fstype)?, c(data)?);
    let t = cstr(target)?;
    // SAFETY: all pointers are NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            src_c.as_ptr(),
            t.as_ptr(),
            fs_c.as_ptr(),
            libc::MS_NODEV | libc::MS_NOSUID,
            data_c.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(
            IoFailure::last_os(format!("mounting {fstype} on {}", target.display())).into(),
        );
    }
    Ok(())
}

/// tmpfs of `size_mb` at `disk`, with `upper/` and `work/` inside.
pub fn mount_disk(disk: &Path, size_mb: u64) -> Result<(), ContainerError> {
    std::fs::create_dir_all(disk).ctx(|| format!("creating {}", disk.display()))?;
    mount(
        "dsec-disk",
        disk,
        "tmpfs",
        &format!("size={size_mb}m,mode=0755"),
    )?;
    for sub in ["upper", "work"] {
        std::fs::create_dir_all(disk.join(sub)).ctx(|| format!("creating {sub}"))?;
    }
    Ok(())
}

/// Overlay of `lowers` (top first) under `disk/upper` at `target`.
pub fn mount_overlay(
    lowers: &[std::path::PathBuf],
    disk: &Path,
    target: &Path,
) -> Result<(), ContainerError> {
    std::fs::create_dir_all(target).ctx(|| format!("creating {}", target.display()))?;
    let mut parts = Vec::new();
    for l in lowers {
        let s = l.display().to_string();
        if s.contains([',', ':']) {
            return Err(ContainerError::BadLayerPath(s));
        }
        parts.push(s);
    }
    let data = format!(
        "lowerdir={},upperdir={},workdir={}",
        parts.join(":"),
        disk.join("upper").display(),
        disk.join("work").display()
    );
    if data.len() >= 4000 {
        return Err(ContainerError::TooManyLayers(lowers.len()));
    }
    mount("overlay", target, "overlay", &data)
}

/// Mounts, read-only at `target` (made if missing), a sysfs seen from a new network
/// namespace of its own (which the mount keeps: it holds only `lo`); a sysfs already
/// there, from an earlier edge, is kept. Run on a thread that ends after it: the
/// thread is left in that namespace.
pub fn mount_sysfs_view(target: &Path) -> Result<(), ContainerError> {
    const SYSFS_MAGIC: libc::c_long = 0x6265_6572;
    std::fs::create_dir_all(target).ctx(|| format!("creating {}", target.display()))?;
    let t = cstr(target)?;
    // SAFETY: statfs into a zeroed struct with a NUL-terminated path.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(t.as_ptr(), &mut st) } == 0 && st.f_type as libc::c_long == SYSFS_MAGIC
    {
        return Ok(());
    }
    // SAFETY: unshare(2) of this thread's network namespace; mount(2) with static
    // NUL-terminated strings and the path above.
    unsafe {
        if libc::unshare(libc::CLONE_NEWNET) != 0 {
            return Err(IoFailure::last_os("a network namespace for the sandboxes' sysfs").into());
        }
        if libc::mount(
            c"sysfs".as_ptr(),
            t.as_ptr(),
            c"sysfs".as_ptr(),
            libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            std::ptr::null(),
        ) != 0
        {
            return Err(
                IoFailure::last_os(format!("mounting sysfs on {}", target.display())).into(),
            );
        }
    }
    Ok(())
}

/// A copy of the mount at `target` that is attached nowhere, open; the mount at `target`
/// is then taken away. The copy lives as long as the descriptor, or as the tree it is
/// attached to by [`attach`].
pub fn detach(target: &Path) -> Result<OwnedFd, ContainerError> {
    let fd = clone_mount(target)?;
    unmount(target)?;
    Ok(fd)
}

/// A copy of the mount at `target` alone (none of the mounts below it), attached nowhere:
/// what the file system holds under those mounts is reached through it.
pub fn clone_mount(target: &Path) -> Result<OwnedFd, ContainerError> {
    let t = cstr(target)?;
    // SAFETY: open_tree(2) with a NUL-terminated path; it returns a new descriptor.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            t.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(
            IoFailure::last_os(format!("copying the mount at {}", target.display())).into(),
        );
    }
    // SAFETY: a descriptor open_tree just returned, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Attaches the detached mount `fd` at `target` (a NUL-terminated path) in the calling
/// process's mount namespace. Async-signal-safe: it runs between fork and exec.
pub fn attach(fd: RawFd, target: &std::ffi::CStr) -> std::io::Result<()> {
    // SAFETY: move_mount(2) with a valid descriptor and NUL-terminated strings.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            fd,
            c"".as_ptr(),
            libc::AT_FDCWD,
            target.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Unmounts `p` if mounted; lazily if it is busy. Tried directly, not looked up in
/// `/proc/self/mountinfo` first: the mount table grows with every sandbox on the node, and
/// reading it on each stop made stopping N sandboxes cost O(N^2).
pub fn unmount(p: &Path) -> Result<(), ContainerError> {
    let c = cstr(p)?;
    // SAFETY: NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
        return Ok(());
    }
    // Not a mount point, or not there at all: nothing to unmount.
    if let Some(libc::EINVAL | libc::ENOENT) = std::io::Error::last_os_error().raw_os_error() {
        return Ok(());
    }
    // SAFETY: NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
        return Ok(());
    }
    Err(IoFailure::last_os(format!("unmounting {}", p.display())).into())
}
