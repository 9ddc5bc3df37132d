//! Whether a path, resolved by the kernel through every symlink on the way, stays inside a
//! directory: `openat2(2)` with `RESOLVE_BENEATH`. A check on a path's text cannot see
//! that `b -> a/..` after `a -> .` climbs out; the kernel's resolution can. [`openat2`] is
//! the call itself, for the other resolution modes (a volume's `RESOLVE_IN_ROOT`).

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Opens `rel` under `dir` as an `O_PATH` descriptor, following symlinks (the final one
/// too unless `follow_last` is false), failing with `EXDEV` if resolution would leave
/// `dir` (absolute links, `..` above it, through any chain of links) and `ELOOP` on a
/// loop. `ENOENT` means it resolves to nothing (a dangling link).
pub fn open_beneath(dir: &Path, rel: &Path, follow_last: bool) -> io::Result<OwnedFd> {
    let d = std::fs::File::open(dir)?;
    let c = CString::new(rel.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))?;
    let mut flags = libc::O_PATH;
    if !follow_last {
        flags |= libc::O_NOFOLLOW;
    }
    openat2(
        d.as_raw_fd(),
        &c,
        flags,
        0,
        libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS,
    )
}

/// `openat2(2)`: `rel` opened from directory `dir` with `flags` (`O_CLOEXEC` added),
/// `mode` for a file it makes, and the `RESOLVE_*` bits `resolve`.
pub fn openat2(dir: RawFd, rel: &CStr, flags: i32, mode: u32, resolve: u64) -> io::Result<OwnedFd> {
    // SAFETY: zeroed open_how is valid; the fields set are plain integers.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    how.mode = mode as u64;
    how.resolve = resolve;
    // SAFETY: openat2 with a directory fd, a NUL-terminated path and an open_how of the
    // size passed.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir,
            rel.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor from the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Whether `rel` under `dir` resolves inside `dir` (or to nothing at all): false only
/// when the kernel says resolution leaves it or loops.
pub fn stays_beneath(dir: &Path, rel: &Path) -> io::Result<bool> {
    match open_beneath(dir, rel, true) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(true),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EXDEV) | Some(libc::ELOOP)) => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// The chain a textual check lets through: each link alone looks inside.
    #[test]
    fn a_chain_of_links_that_climbs_out_is_caught() {
        let t = tempfile::tempdir().unwrap();
        let ctx = t.path().join("a/b/ctx");
        std::fs::create_dir_all(&ctx).unwrap();
        std::fs::write(t.path().join("secret"), b"host").unwrap();
        symlink(".", ctx.join("l1")).unwrap();
        symlink("l1/..", ctx.join("l2")).unwrap();
        symlink("l2/..", ctx.join("l3")).unwrap();
        symlink("inside", ctx.join("ok")).unwrap();
        std::fs::write(ctx.join("inside"), b"x").unwrap();
        symlink("/etc", ctx.join("abs")).unwrap();
        symlink("nowhere", ctx.join("dangling")).unwrap();
        symlink("loop", ctx.join("loop")).unwrap();
        assert!(stays_beneath(&ctx, Path::new("l1")).unwrap());
        assert!(
            !stays_beneath(&ctx, Path::new("l2")).unwrap(),
            "l2 is ctx's parent"
        );
        assert!(!stays_beneath(&ctx, Path::new("l3/secret")).unwrap());
        assert!(!stays_beneath(&ctx, Path::new("abs")).unwrap());
        assert!(!stays_beneath(&ctx, Path::new("loop")).unwrap());
        assert!(stays_beneath(&ctx, Path::new("ok")).unwrap());
        assert!(stays_beneath(&ctx, Path::new("dangling")).unwrap());
        // Not following the last link: the link itself is inside.
        assert!(open_beneath(&ctx, Path::new("l2"), false).is_ok());
    }
}
