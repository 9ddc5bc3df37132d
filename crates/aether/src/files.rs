//! File operations inside the sandbox. Aether's root is the sandbox's root, so no path can
//! leave it; relative paths resolve against aether's working directory (the image's).

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use dsec_common::ErrorCode;
use dsec_common::api::{FileStat, METADATA_MAX_BYTES, METADATA_XATTR_PREFIX};
use dsec_common::channel::{CHUNK, FRAME_DATA, read_frame, write_frame};

pub type FsError = (ErrorCode, String);

pub fn check_path(p: &str) -> Result<PathBuf, FsError> {
    if p.is_empty() || p.contains('\0') {
        return Err((
            ErrorCode::InvalidArgument,
            format!("path {p:?} is empty or contains a NUL byte"),
        ));
    }
    Ok(PathBuf::from(p))
}

/// Runs `f` with the filesystem credentials of `user` (by name or uid, from the
/// sandbox's /etc/passwd; none: aether's own, root's): on a thread of its own whose
/// fsuid and fsgid are the user's, so what `f` makes is the user's and the kernel checks
/// its permissions as the user's (a non-zero fsuid leaves the thread no capability to
/// override them). The thread, and the credentials, end with `f`.
pub fn as_user<T: Send>(user: Option<&str>, f: impl FnOnce() -> T + Send) -> Result<T, FsError> {
    let Some(name) = user else {
        return Ok(f());
    };
    let u = crate::user::lookup(name).map_err(|e| (ErrorCode::InvalidArgument, e))?;
    if u.uid == 0 {
        return Ok(f());
    }
    std::thread::scope(|s| {
        s.spawn(move || {
            // SAFETY: setfsgid/setfsuid change only the calling thread's filesystem
            // credentials (the raw calls: no library broadcast to other threads). Each
            // returns the previous value; a call with -1 reads the current one back.
            let ok = unsafe {
                libc::syscall(libc::SYS_setfsgid, u.gid);
                libc::syscall(libc::SYS_setfsuid, u.uid);
                libc::syscall(libc::SYS_setfsuid, u32::MAX) == u.uid as libc::c_long
                    && libc::syscall(libc::SYS_setfsgid, u32::MAX) == u.gid as libc::c_long
            };
            if !ok {
                return Err((
                    ErrorCode::Internal,
                    format!("could not act as user {name} (uid {})", u.uid),
                ));
            }
            Ok(f())
        })
        .join()
        .unwrap_or_else(|_| Err((ErrorCode::Internal, "the file operation failed".into())))
    })
}

/// Maps an I/O error on `path` to an API error code and a sentence.
pub fn io_err(what: &str, path: &Path, e: std::io::Error) -> FsError {
    use std::io::ErrorKind as K;
    let code = match e.kind() {
        K::NotFound => ErrorCode::NotFound,
        K::PermissionDenied => ErrorCode::PermissionDenied,
        K::AlreadyExists => ErrorCode::AlreadyExists,
        K::StorageFull | K::QuotaExceeded => ErrorCode::ResourceExhausted,
        _ => match e.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => ErrorCode::ResourceExhausted,
            Some(libc::EPERM) | Some(libc::EACCES) | Some(libc::EROFS) => {
                ErrorCode::PermissionDenied
            }
            Some(libc::EEXIST) => ErrorCode::AlreadyExists,
            _ => ErrorCode::InvalidArgument,
        },
    };
    (code, format!("{what} {}: {e}", path.display()))
}

pub fn stat(path: &Path) -> Result<FileStat, FsError> {
    let m = fs::symlink_metadata(path).map_err(|e| io_err("cannot stat", path, e))?;
    let ft = m.file_type();
    let kind = if ft.is_symlink() {
        "symlink"
    } else if ft.is_dir() {
        "dir"
    } else if ft.is_file() {
        "file"
    } else {
        "other"
    };
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .unwrap_or_else(|_| "/".into())
            .join(path)
    };
    Ok(FileStat {
        path: abs.display().to_string(),
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "/".into()),
        kind: kind.into(),
        size: m.len(),
        mode: m.mode() & 0o7777,
        uid: m.uid(),
        gid: m.gid(),
        mtime_ms: m.mtime() * 1000 + m.mtime_nsec() / 1_000_000,
        target: ft
            .is_symlink()
            .then(|| fs::read_link(path).ok())
            .flatten()
            .map(|t| t.display().to_string()),
        // Symlinks cannot carry user attributes.
        metadata: if ft.is_symlink() {
            BTreeMap::new()
        } else {
            read_metadata(path)
        },
    })
}

/// Where metadata goes when the filesystem keeps no `user.*` attributes: a VM's writable
/// layer is a tmpfs of the guest's kernel, which keeps them only from Linux 6.6 on, but
/// keeps `trusted.*` ones (aether is root there). Read with the user ones.
const METADATA_TRUSTED_PREFIX: &str = "trusted.e2b.";

/// The names of `path`'s extended attributes (not following a symlink), or of the open
/// file `fd`; none where the filesystem keeps none.
fn xattr_names(path: Option<&std::ffi::CStr>, fd: i32) -> Vec<Vec<u8>> {
    let mut names = vec![0u8; 64 * 1024];
    // SAFETY: the buffer is writable for its length; the path is NUL-terminated, or fd open.
    let n = unsafe {
        match path {
            Some(c) => libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()),
            None => libc::flistxattr(fd, names.as_mut_ptr().cast(), names.len()),
        }
    };
    if n <= 0 {
        return Vec::new();
    }
    names[..n as usize]
        .split(|b| *b == 0)
        .filter(|n| !n.is_empty())
        .map(<[u8]>::to_vec)
        .collect()
}

/// The metadata key an attribute name holds, if it is one.
fn metadata_key(name: &[u8]) -> Option<&str> {
    let key = name
        .strip_prefix(METADATA_XATTR_PREFIX.as_bytes())
        .or_else(|| name.strip_prefix(METADATA_TRUSTED_PREFIX.as_bytes()))?;
    std::str::from_utf8(key).ok()
}

/// A file's metadata: its `user.e2b.*` extended attributes (and `trusted.e2b.*` ones,
/// where those stand in for them); none where the filesystem keeps none, or the file has
/// none. Not following a symlink.
pub fn read_metadata(path: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return out;
    };
    let mut names = xattr_names(Some(&c), -1);
    // `user.` sorts after `trusted.`: read last, it wins.
    names.sort();
    for name in names {
        let Some(key) = metadata_key(&name) else {
            continue;
        };
        let Ok(cname) = std::ffi::CString::new(name.clone()) else {
            continue;
        };
        let mut value = vec![0u8; METADATA_MAX_BYTES];
        // SAFETY: the value buffer is writable for its length; both strings NUL-terminated.
        let v = unsafe {
            libc::lgetxattr(
                c.as_ptr(),
                cname.as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        if v >= 0 {
            value.truncate(v as usize);
            out.insert(
                key.to_string(),
                String::from_utf8_lossy(&value).into_owned(),
            );
        }
    }
    out
}

/// Makes the metadata of the open file `f` exactly `m`: what it had goes first.
fn set_metadata(f: &File, path: &Path, m: &BTreeMap<String, String>) -> Result<(), FsError> {
    use std::os::fd::AsRawFd;
    let fd = f.as_raw_fd();
    let failed = |what: &str, e: std::io::Error| match e.raw_os_error() {
        Some(libc::ENOTSUP) => (
            ErrorCode::FailedPrecondition,
            format!(
                "the filesystem of {} keeps no extended attributes, so no metadata",
                path.display()
            ),
        ),
        Some(libc::ENOSPC) | Some(libc::E2BIG) | Some(libc::ERANGE) => (
            ErrorCode::InvalidArgument,
            format!("the metadata does not fit on {}: {e}", path.display()),
        ),
        _ => io_err(what, path, e),
    };
    for name in xattr_names(None, fd) {
        if metadata_key(&name).is_none() {
            continue;
        }
        let Ok(cname) = std::ffi::CString::new(name) else {
            continue;
        };
        // SAFETY: a NUL-terminated attribute name of the open fd.
        if unsafe { libc::fremovexattr(fd, cname.as_ptr()) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENODATA) {
                return Err(failed("cannot clear the metadata of", e));
            }
        }
    }
    let set = |prefix: &str, k: &str, v: &str| -> std::io::Result<()> {
        let name = std::ffi::CString::new(format!("{prefix}{k}"))
            .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: the value is readable for its length; the name is NUL-terminated.
        let r = unsafe { libc::fsetxattr(fd, name.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    let mut prefix = METADATA_XATTR_PREFIX;
    for (i, (k, v)) in m.iter().enumerate() {
        match set(prefix, k, v) {
            Ok(()) => {}
            Err(e) if i == 0 && e.raw_os_error() == Some(libc::ENOTSUP) => {
                prefix = METADATA_TRUSTED_PREFIX;
                set(prefix, k, v).map_err(|e| failed("cannot set the metadata of", e))?;
            }
            Err(e) => return Err(failed("cannot set the metadata of", e)),
        }
    }
    Ok(())
}

pub fn list(path: &Path, depth: u32) -> Result<Vec<FileStat>, FsError> {
    let depth = depth.clamp(1, 64);
    let root = stat(path)?;
    if root.kind != "dir" {
        return Err((
            ErrorCode::InvalidArgument,
            format!("{} is not a directory", path.display()),
        ));
    }
    let mut out = Vec::new();
    // The reply is one JSON frame: it must stay under the channel's frame limit.
    let budget = dsec_common::channel::MAX_FRAME as usize - (1 << 20);
    let mut bytes = 0usize;
    let mut todo = vec![(PathBuf::from(&root.path), 1)];
    while let Some((dir, d)) = todo.pop() {
        let rd = fs::read_dir(&dir).map_err(|e| io_err("cannot list", &dir, e))?;
        for ent in rd.flatten() {
            let p = ent.path();
            if let Ok(s) = stat(&p) {
                if s.kind == "dir" && d < depth {
                    todo.push((p, d + 1));
                }
                bytes += serde_json::to_vec(&s).map(|v| v.len() + 1).unwrap_or(0);
                out.push(s);
            }
        }
        if bytes > budget {
            return Err((
                ErrorCode::ResourceExhausted,
                format!(
                    "the listing of {} at depth {depth} is over {} MiB; list a smaller tree",
                    path.display(),
                    budget >> 20
                ),
            ));
        }
        if out.len() > 100_000 {
            return Err((
                ErrorCode::ResourceExhausted,
                format!(
                    "{} has more than 100000 entries at depth {depth}; list a smaller tree",
                    path.display()
                ),
            ));
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

pub fn mkdir(path: &Path) -> Result<FileStat, FsError> {
    fs::create_dir_all(path).map_err(|e| io_err("cannot create directory", path, e))?;
    stat(path)
}

pub fn remove(path: &Path, recursive: bool) -> Result<(), FsError> {
    let m = fs::symlink_metadata(path).map_err(|e| io_err("cannot remove", path, e))?;
    let r = if m.is_dir() {
        if recursive {
            fs::remove_dir_all(path)
        } else {
            fs::remove_dir(path).map_err(|e| {
                if e.raw_os_error() == Some(libc::ENOTEMPTY) {
                    std::io::Error::other("the directory is not empty; pass recursive=true")
                } else {
                    e
                }
            })
        }
    } else {
        fs::remove_file(path)
    };
    r.map_err(|e| io_err("cannot remove", path, e))
}

pub fn rename(from: &Path, to: &Path) -> Result<FileStat, FsError> {
    if let Some(parent) = to.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).map_err(|e| io_err("cannot create directory", parent, e))?;
    }
    fs::rename(from, to).map_err(|e| io_err("cannot rename", from, e))?;
    stat(to)
}

pub fn chmod(path: &Path, mode: u32) -> Result<FileStat, FsError> {
    if mode > 0o7777 {
        return Err((
            ErrorCode::InvalidArgument,
            format!("mode {mode:o} is not a permission mode (at most 0o7777)"),
        ));
    }
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .map_err(|e| io_err("cannot chmod", path, e))?;
    stat(path)
}

pub fn chown(path: &Path, uid: u32, gid: u32) -> Result<FileStat, FsError> {
    std::os::unix::fs::lchown(path, Some(uid), Some(gid))
        .map_err(|e| io_err("cannot chown", path, e))?;
    stat(path)
}

/// Opens a regular file for reading; a directory is an error that says so.
pub fn open_read(path: &Path) -> Result<(File, u64), FsError> {
    let f = File::open(path).map_err(|e| io_err("cannot read", path, e))?;
    let m = f.metadata().map_err(|e| io_err("cannot stat", path, e))?;
    if m.is_dir() {
        return Err((
            ErrorCode::InvalidArgument,
            format!("{} is a directory; list it, or read a file", path.display()),
        ));
    }
    Ok((f, m.len()))
}

/// Sends a file as `D` frames ended by an empty one.
pub fn send_file(mut f: File, out: &mut impl Write) -> std::io::Result<()> {
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        write_frame(out, FRAME_DATA, &buf[..n])?;
    }
    write_frame(out, FRAME_DATA, &[])
}

/// Receives `D` frames into a file (parents created). On error the rest of the data is
/// still read, so the connection stays in step, and the error returned.
/// Writes the framed data from `input` to `path`. Its metadata becomes `metadata` when
/// given; otherwise a write (not an append) clears it, as the file's content is new.
pub fn receive_file(
    path: &Path,
    mode: Option<u32>,
    append: bool,
    metadata: Option<&BTreeMap<String, String>>,
    input: &mut impl Read,
) -> Result<u64, FsError> {
    let mut target: Result<File, FsError> = (|| {
        // Refused before the file is touched (the data is still read to its end).
        if let Some(m) = metadata {
            dsec_common::api::check_metadata(m)
                .map_err(|e| (ErrorCode::InvalidArgument, e.message))?;
        }
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            fs::create_dir_all(parent).map_err(|e| io_err("cannot create directory", parent, e))?;
        }
        let mut o = OpenOptions::new();
        o.write(true).create(true);
        if append {
            o.append(true);
        } else {
            o.truncate(true);
        }
        o.mode(mode.unwrap_or(0o644));
        let f = o.open(path).map_err(|e| io_err("cannot write", path, e))?;
        if let Some(m) = mode {
            let _ = f.set_permissions(fs::Permissions::from_mode(m & 0o7777));
        }
        Ok(f)
    })();
    let mut size = 0u64;
    loop {
        let frame = read_frame(input)
            .map_err(|e| (ErrorCode::InvalidArgument, format!("receiving data: {e}")))?;
        match frame {
            Some((FRAME_DATA, d)) if d.is_empty() => break,
            Some((FRAME_DATA, d)) => {
                if let Ok(f) = &mut target
                    && let Err(e) = f.write_all(&d)
                {
                    target = Err(io_err("cannot write", path, e));
                }
                size += d.len() as u64;
            }
            Some((k, _)) => {
                return Err((
                    ErrorCode::InvalidArgument,
                    format!("unexpected frame {:?} in file data", k as char),
                ));
            }
            None => {
                return Err((
                    ErrorCode::InvalidArgument,
                    "the data ended before its end marker".into(),
                ));
            }
        }
    }
    let f = target?;
    match metadata {
        Some(m) => set_metadata(&f, path, m)?,
        // Nothing to clear is the common case: one listing, no error if unsupported.
        None if !append && !read_metadata(path).is_empty() => {
            set_metadata(&f, path, &BTreeMap::new())?;
        }
        None => {}
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framed(body: &[u8]) -> Vec<u8> {
        let mut data = Vec::new();
        write_frame(&mut data, FRAME_DATA, body).unwrap();
        write_frame(&mut data, FRAME_DATA, b"").unwrap();
        data
    }

    #[test]
    fn metadata_is_set_kept_through_rename_and_appends_and_cleared_by_a_write() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.txt");
        let meta: BTreeMap<String, String> = [("owner".to_string(), "team a".to_string())].into();
        match receive_file(&p, None, false, Some(&meta), &mut &framed(b"one")[..]) {
            Err((ErrorCode::FailedPrecondition, m)) => {
                eprintln!("skipped: {m}");
                return;
            }
            r => assert_eq!(r.unwrap(), 3),
        }
        assert_eq!(stat(&p).unwrap().metadata, meta);
        // Set by hand, as an image's file would be: read back too.
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        let (name, other) = (c"user.e2b.source", c"user.other");
        unsafe {
            assert_eq!(
                libc::lsetxattr(c.as_ptr(), name.as_ptr(), b"img".as_ptr().cast(), 3, 0),
                0
            );
            assert_eq!(
                libc::lsetxattr(c.as_ptr(), other.as_ptr(), b"x".as_ptr().cast(), 1, 0),
                0
            );
        }
        assert_eq!(
            stat(&p).unwrap().metadata.get("source").map(String::as_str),
            Some("img")
        );
        assert!(!stat(&p).unwrap().metadata.contains_key("other"));
        receive_file(&p, None, true, None, &mut &framed(b"two")[..]).unwrap();
        assert_eq!(stat(&p).unwrap().metadata.len(), 2, "an append keeps it");
        let q = dir.path().join("moved.txt");
        let moved = rename(&p, &q).unwrap();
        assert_eq!(moved.metadata.len(), 2, "a rename keeps it");
        // A bad key is refused before the file is touched.
        let bad: BTreeMap<String, String> = [("Bad Key".to_string(), String::new())].into();
        let e = receive_file(&q, None, false, Some(&bad), &mut &framed(b"x")[..]).unwrap_err();
        assert_eq!(e.0, ErrorCode::InvalidArgument);
        assert_eq!(fs::read(&q).unwrap(), b"onetwo");
        // A write without metadata: the content is new, and so is the metadata (none);
        // attributes that are not metadata stay.
        receive_file(&q, None, false, None, &mut &framed(b"new")[..]).unwrap();
        assert!(stat(&q).unwrap().metadata.is_empty());
        let c = std::ffi::CString::new(q.as_os_str().as_encoded_bytes()).unwrap();
        let mut buf = [0u8; 8];
        let n = unsafe { libc::lgetxattr(c.as_ptr(), other.as_ptr(), buf.as_mut_ptr().cast(), 8) };
        assert_eq!(n, 1);
    }

    #[test]
    fn file_round_trip_listing_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a/b/c.txt");
        let mut data = Vec::new();
        write_frame(&mut data, FRAME_DATA, b"hello ").unwrap();
        write_frame(&mut data, FRAME_DATA, b"world").unwrap();
        write_frame(&mut data, FRAME_DATA, b"").unwrap();
        assert_eq!(
            receive_file(&p, Some(0o600), false, None, &mut &data[..]).unwrap(),
            11
        );
        let s = stat(&p).unwrap();
        assert_eq!((s.kind.as_str(), s.size, s.mode), ("file", 11, 0o600));
        let (f, size) = open_read(&p).unwrap();
        let mut out = Vec::new();
        send_file(f, &mut out).unwrap();
        assert_eq!(size, 11);
        let mut r = &out[..];
        assert_eq!(read_frame(&mut r).unwrap().unwrap().1, b"hello world");
        assert_eq!(read_frame(&mut r).unwrap().unwrap().1, b"");
        let names: Vec<String> = list(dir.path(), 3)
            .unwrap()
            .into_iter()
            .map(|s| s.name)
            .collect();
        assert_eq!(names, ["a", "b", "c.txt"]);
        assert_eq!(list(dir.path(), 1).unwrap().len(), 1);
        assert_eq!(
            open_read(&dir.path().join("a")).unwrap_err().0,
            ErrorCode::InvalidArgument
        );
        assert_eq!(
            open_read(&dir.path().join("nope")).unwrap_err().0,
            ErrorCode::NotFound
        );
        assert_eq!(
            remove(&dir.path().join("a"), false).unwrap_err().0,
            ErrorCode::InvalidArgument
        );
        remove(&dir.path().join("a"), true).unwrap();
        assert!(check_path("").is_err() && check_path("a\0b").is_err());
    }
}
