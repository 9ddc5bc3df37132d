//! The volume file API's file operations, done by the node on a file system that
//! sandboxes write: every path is resolved by the kernel inside the volume
//! (`openat2(2)` with `RESOLVE_IN_ROOT`: `..` and absolute links stop at the volume's root,
//! as they would in a sandbox that mounts it; no magic links, no other mount), and every
//! change is made through a descriptor of what was resolved or relative to its directory
//! without following the last component, so a link a sandbox swaps in at any moment never
//! sends the node's root-owned operation out of the volume.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use dsec_common::ApiError;
use dsec_common::api::VolumeEntry;

/// Most entries one listing returns.
pub const MAX_LIST: usize = 100_000;

/// A path in a volume, as the API takes it (`/a/b`, `a/b`; `..` cannot climb out):
/// relative to the volume's root, `""` for the root itself.
pub fn clean(path: &str) -> Result<String, ApiError> {
    if path.len() > 4096 || path.contains('\0') {
        return Err(ApiError::invalid(
            "path must be at most 4096 bytes with no NUL byte",
        ));
    }
    Ok(path
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect::<Vec<_>>()
        .join("/"))
}

fn cstr(s: &[u8]) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// The volume's root (`O_PATH`), which every operation resolves from.
pub fn open_root(root: &Path) -> io::Result<OwnedFd> {
    let c = cstr(root.as_os_str().as_bytes())?;
    // SAFETY: open(2) with a NUL-terminated path.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor from the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `rel` resolved inside the volume rooted at `root` (links followed, also the last).
fn resolve(root: &OwnedFd, rel: &str, flags: i32, mode: u32) -> io::Result<OwnedFd> {
    let c = cstr(if rel.is_empty() { b"." } else { rel.as_bytes() })?;
    let mode = if flags & libc::O_CREAT != 0 { mode } else { 0 };
    dsec_common::beneath::openat2(
        root.as_raw_fd(),
        &c,
        flags,
        mode,
        libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS | libc::RESOLVE_NO_XDEV,
    )
}

/// `rel`'s directory (resolved inside the volume) and its last name; the root has none.
fn parent<'a>(root: &OwnedFd, rel: &'a str) -> Result<(OwnedFd, &'a str), ApiError> {
    let (dir, name) = match rel.rsplit_once('/') {
        Some((d, n)) => (d, n),
        None => ("", rel),
    };
    if name.is_empty() || name == ".." {
        return Err(ApiError::invalid(
            "the path names the volume's root (or climbs above it): name a file or directory in it",
        ));
    }
    let d = resolve(root, dir, libc::O_PATH | libc::O_DIRECTORY, 0)
        .map_err(|e| error(e, &format!("/{dir}")))?;
    Ok((d, name))
}

/// An I/O error as the API says it, about `what` (a volume path).
pub fn error(e: io::Error, what: &str) -> ApiError {
    match e.raw_os_error() {
        // What this module refuses itself (too deep, too large), in words.
        None => ApiError::invalid(format!("{what}: {e}")),
        Some(libc::ENOENT) => ApiError::not_found(format!("{what} does not exist in the volume")),
        Some(libc::EEXIST) => ApiError::new(
            dsec_common::ErrorCode::AlreadyExists,
            format!("{what} exists already"),
        ),
        Some(libc::ENOTDIR) => ApiError::invalid(format!("a part of {what} is not a directory")),
        Some(libc::EISDIR) => ApiError::invalid(format!("{what} is a directory, not a file")),
        Some(libc::ENOTEMPTY) => ApiError::precondition(format!("{what} is not empty")),
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => ApiError::exhausted(format!(
            "the volume is full writing {what}: make room or use a larger volume (size_mb)"
        )),
        Some(libc::ELOOP) => ApiError::invalid(format!("{what}: too many levels of links")),
        Some(libc::EXDEV) => ApiError::invalid(format!("{what} leaves the volume")),
        Some(libc::ENAMETOOLONG) => ApiError::invalid(format!("{what}: a name is too long")),
        Some(libc::ENXIO) => ApiError::invalid(format!("{what} is not a regular file")),
        Some(libc::EROFS) => ApiError::unavailable(format!(
            "the volume's file system went read-only writing {what} (it found an error)"
        )),
        _ => ApiError::internal(format!("{what}: {e}")),
    }
}

fn fstatat(dir: RawFd, name: &[u8], flags: i32) -> io::Result<libc::stat> {
    let c = cstr(name)?;
    // SAFETY: fstatat with a valid fd, a NUL-terminated path and a zeroed out-struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstatat(dir, c.as_ptr(), &mut st, flags) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

fn readlinkat(dir: RawFd, name: &[u8]) -> Option<String> {
    let c = cstr(name).ok()?;
    let mut buf = vec![0u8; 4096];
    // SAFETY: readlinkat into a buffer of the length passed.
    let n = unsafe { libc::readlinkat(dir, c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return None;
    }
    buf.truncate(n as usize);
    Some(String::from_utf8_lossy(&buf).into_owned())
}

fn entry(dir: RawFd, name: &[u8], path: String) -> io::Result<VolumeEntry> {
    let st = fstatat(dir, name, libc::AT_SYMLINK_NOFOLLOW | libc::AT_EMPTY_PATH)?;
    let kind = match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => "file",
        libc::S_IFDIR => "directory",
        libc::S_IFLNK => "symlink",
        _ => "other",
    };
    let ms = |s: i64, ns: i64| s * 1000 + ns / 1_000_000;
    Ok(VolumeEntry {
        name: path.rsplit('/').next().unwrap_or("").to_string(),
        target: if kind == "symlink" {
            readlinkat(dir, name)
        } else {
            None
        },
        path,
        kind: kind.into(),
        size: st.st_size.max(0) as u64,
        mode: st.st_mode,
        uid: st.st_uid,
        gid: st.st_gid,
        atime_ms: ms(st.st_atime, st.st_atime_nsec),
        mtime_ms: ms(st.st_mtime, st.st_mtime_nsec),
        ctime_ms: ms(st.st_ctime, st.st_ctime_nsec),
    })
}

fn show(rel: &str) -> String {
    format!("/{rel}")
}

/// What is at `rel` (a link itself, not what it points to).
pub fn stat(root: &OwnedFd, rel: &str) -> Result<VolumeEntry, ApiError> {
    if rel.is_empty() {
        return entry(root.as_raw_fd(), b"", "/".into()).map_err(|e| error(e, "/"));
    }
    let (d, name) = parent(root, rel)?;
    entry(d.as_raw_fd(), name.as_bytes(), show(rel)).map_err(|e| error(e, &show(rel)))
}

/// Most bytes of paths one listing holds (its entries' names and paths).
pub const MAX_LIST_BYTES: usize = 32 << 20;

/// The entries of directory `rel`, `depth` levels down (1: its own).
pub fn list(root: &OwnedFd, rel: &str, depth: u32) -> Result<Vec<VolumeEntry>, ApiError> {
    let dir = resolve(root, rel, libc::O_RDONLY | libc::O_DIRECTORY, 0)
        .map_err(|e| error(e, &show(rel)))?;
    let mut out = Vec::new();
    let mut budget = MAX_LIST_BYTES;
    walk(dir, &show(rel), depth.max(1), &mut out, &mut budget).map_err(|e| error(e, &show(rel)))?;
    Ok(out)
}

fn walk(
    dir: OwnedFd,
    at: &str,
    depth: u32,
    out: &mut Vec<VolumeEntry>,
    budget: &mut usize,
) -> io::Result<()> {
    let base = at.trim_end_matches('/');
    // The directory's own descriptor, by its exact inode: nothing is resolved again.
    let mut names = names_in(&dir)?;
    names.sort();
    for name in names {
        if out.len() >= MAX_LIST {
            return Ok(());
        }
        let path = format!("{base}/{}", String::from_utf8_lossy(&name));
        let cost = 2 * path.len() + 128;
        if cost > *budget {
            return Err(io::Error::other(format!(
                "the listing is larger than {} MiB: list a directory further down, or fewer levels",
                MAX_LIST_BYTES >> 20
            )));
        }
        *budget -= cost;
        let Ok(e) = entry(dir.as_raw_fd(), &name, path.clone()) else {
            continue; // gone meanwhile
        };
        let is_dir = e.kind == "directory";
        out.push(e);
        if is_dir
            && depth > 1
            && let Ok(sub) = open_dir_at(dir.as_raw_fd(), &name)
        {
            walk(sub, &path, depth - 1, out, budget)?;
        }
    }
    Ok(())
}

/// `fd` as a regular file, blocking again: it was opened `O_NONBLOCK`, so that a FIFO a
/// sandbox put there never holds the node's thread waiting for a peer, and anything but a
/// regular file is refused.
fn regular(fd: OwnedFd, rel: &str) -> Result<(File, u64), ApiError> {
    let f = File::from(fd);
    let m = f.metadata().map_err(|e| error(e, &show(rel)))?;
    if m.is_dir() {
        return Err(ApiError::invalid(format!(
            "{} is a directory: list it instead",
            show(rel)
        )));
    }
    if !m.is_file() {
        return Err(ApiError::invalid(format!(
            "{} is not a regular file",
            show(rel)
        )));
    }
    // SAFETY: fcntl on a descriptor this function owns.
    let flags = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFL) };
    if flags < 0
        || unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0
    {
        return Err(error(io::Error::last_os_error(), &show(rel)));
    }
    Ok((f, m.len()))
}

/// File `rel` opened to read, and its size.
pub fn open_read(root: &OwnedFd, rel: &str) -> Result<(File, u64), ApiError> {
    let fd = resolve(root, rel, libc::O_RDONLY | libc::O_NONBLOCK, 0)
        .map_err(|e| error(e, &show(rel)))?;
    regular(fd, rel)
}

/// Owner and permission bits for what an operation makes or changes. Set-user and
/// set-group bits are dropped (the volume is mounted `nosuid` anyway).
#[derive(Debug, Clone, Copy, Default)]
pub struct Owner {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mode: Option<u32>,
}

fn apply(fd: &OwnedFd, o: Owner, what: &str) -> Result<(), ApiError> {
    if o.uid.is_some() || o.gid.is_some() {
        let (u, g) = (
            o.uid.map(|u| u as libc::uid_t).unwrap_or(u32::MAX),
            o.gid.map(|g| g as libc::gid_t).unwrap_or(u32::MAX),
        );
        // SAFETY: fchownat on a descriptor with an empty path.
        if unsafe { libc::fchownat(fd.as_raw_fd(), c"".as_ptr(), u, g, libc::AT_EMPTY_PATH) } != 0 {
            return Err(error(io::Error::last_os_error(), what));
        }
    }
    if let Some(m) = o.mode {
        // chmod through the descriptor's own magic link: the exact inode resolved above.
        let p = format!("/proc/self/fd/{}", fd.as_raw_fd());
        let c = cstr(p.as_bytes()).map_err(|e| error(e, what))?;
        // SAFETY: chmod with a NUL-terminated path.
        if unsafe { libc::chmod(c.as_ptr(), m & 0o1777) } != 0 {
            return Err(error(io::Error::last_os_error(), what));
        }
    }
    Ok(())
}

/// Makes the directories of `rel` that are missing (each resolved inside the volume).
fn make_parents(root: &OwnedFd, rel: &str, o: Owner) -> Result<(), ApiError> {
    let mut at = String::new();
    for c in rel.split('/').filter(|c| !c.is_empty()) {
        if !at.is_empty() {
            at.push('/');
        }
        at.push_str(c);
        match mkdir_one(root, &at, o) {
            Ok(()) => {}
            Err(e) if e.code == dsec_common::ErrorCode::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn mkdir_one(root: &OwnedFd, rel: &str, o: Owner) -> Result<(), ApiError> {
    let (d, name) = parent(root, rel)?;
    let c = cstr(name.as_bytes()).map_err(|e| error(e, &show(rel)))?;
    let mode = o.mode.unwrap_or(0o755) & 0o1777;
    // SAFETY: mkdirat relative to a directory fd (the last name is not followed).
    if unsafe { libc::mkdirat(d.as_raw_fd(), c.as_ptr(), mode) } != 0 {
        return Err(error(io::Error::last_os_error(), &show(rel)));
    }
    let made = resolve(root, rel, libc::O_PATH | libc::O_DIRECTORY, 0)
        .map_err(|e| error(e, &show(rel)))?;
    apply(&made, o, &show(rel))
}

/// Makes directory `rel` (and with `parents`, those above it that are missing).
pub fn mkdir(root: &OwnedFd, rel: &str, parents: bool, o: Owner) -> Result<VolumeEntry, ApiError> {
    if parents && let Some((up, _)) = rel.rsplit_once('/') {
        make_parents(root, up, o)?;
    }
    mkdir_one(root, rel, o)?;
    stat(root, rel)
}

/// A file being written in place of another: the bytes go to a new file beside it, which
/// replaces it in one rename once whole ([`Upload::commit`]), so a reader never sees it cut
/// short and a failed upload leaves what was there. Dropped before the commit, the new
/// file is removed.
#[derive(Debug)]
pub struct Upload {
    file: Option<File>,
    dir: OwnedFd,
    tmp: CString,
    name: CString,
    shown: String,
}

impl Upload {
    /// The new file, to write to.
    pub fn file(&mut self) -> io::Result<File> {
        self.file
            .as_ref()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?
            .try_clone()
    }

    /// Puts the written file in place (after its data is on disk).
    pub fn commit(mut self) -> Result<(), ApiError> {
        let f = self.file.take().ok_or_else(|| {
            ApiError::internal(format!("{}: the upload was already ended", self.shown))
        })?;
        f.sync_all().map_err(|e| error(e, &self.shown))?;
        let d = self.dir.as_raw_fd();
        // SAFETY: renameat between names in one directory fd, both NUL-terminated.
        if unsafe { libc::renameat(d, self.tmp.as_ptr(), d, self.name.as_ptr()) } != 0 {
            let e = io::Error::last_os_error();
            let _ = unlink_at(d, self.tmp.as_bytes(), 0);
            return Err(error(e, &self.shown));
        }
        Ok(())
    }
}

impl Drop for Upload {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = unlink_at(self.dir.as_raw_fd(), self.tmp.as_bytes(), 0);
        }
    }
}

/// `rel` with the links in it resolved (inside the volume), when it names something:
/// a write through a link replaces what the link points to, as writing to it would.
fn real_rel(root: &OwnedFd, rel: &str) -> Option<String> {
    let fd = resolve(root, rel, libc::O_PATH, 0).ok()?;
    let at = |fd: RawFd| std::fs::read_link(format!("/proc/self/fd/{fd}")).ok();
    let (here, top) = (at(fd.as_raw_fd())?, at(root.as_raw_fd())?);
    let inside = here.strip_prefix(&top).ok()?;
    clean(inside.to_str()?).ok()
}

/// An upload of file `rel` ([`Upload`]; missing directories above it are made). What is
/// there now must be a regular file, whose owner and mode the new one keeps unless `o`
/// says otherwise.
pub fn open_write(root: &OwnedFd, rel: &str, o: Owner) -> Result<Upload, ApiError> {
    if let Some((up, _)) = rel.rsplit_once('/') {
        make_parents(root, up, Owner { mode: None, ..o })?;
    }
    let real = real_rel(root, rel).unwrap_or_else(|| rel.to_string());
    let (d, name) = parent(root, &real)?;
    let mut o = o;
    match fstatat(d.as_raw_fd(), name.as_bytes(), libc::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => match st.st_mode & libc::S_IFMT {
            libc::S_IFREG => {
                o.uid.get_or_insert(st.st_uid);
                o.gid.get_or_insert(st.st_gid);
                o.mode.get_or_insert(st.st_mode & 0o1777);
            }
            libc::S_IFDIR => {
                return Err(ApiError::invalid(format!(
                    "{} is a directory: name a file",
                    show(rel)
                )));
            }
            // A link that points nowhere (or out of reach) is replaced by the file.
            libc::S_IFLNK => {}
            _ => {
                return Err(ApiError::invalid(format!(
                    "{} is not a regular file",
                    show(rel)
                )));
            }
        },
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
        Err(e) => return Err(error(e, &show(rel))),
    }
    let tmp = format!(".dsec-upload-{}", dsec_common::id::random_hex(12));
    let (tmp, cname) = (
        cstr(tmp.as_bytes()).map_err(|e| error(e, &show(rel)))?,
        cstr(name.as_bytes()).map_err(|e| error(e, &show(rel)))?,
    );
    let mode = o.mode.unwrap_or(0o644) & 0o1777;
    // SAFETY: openat relative to a directory fd, a new name only (O_EXCL, no link followed).
    let fd = unsafe {
        libc::openat(
            d.as_raw_fd(),
            tmp.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            mode as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(error(io::Error::last_os_error(), &show(rel)));
    }
    // SAFETY: a fresh descriptor from the kernel.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // From here a failure removes the new file (the Upload's drop).
    let mut up = Upload {
        file: None,
        dir: d,
        tmp,
        name: cname,
        shown: show(rel),
    };
    let applied = apply(&fd, o, &show(rel));
    up.file = Some(File::from(fd));
    applied?;
    Ok(up)
}

/// Changes the owner or permission bits of `rel` (what a link there points to, inside
/// the volume).
pub fn update(root: &OwnedFd, rel: &str, o: Owner) -> Result<VolumeEntry, ApiError> {
    let fd = resolve(root, rel, libc::O_PATH, 0).map_err(|e| error(e, &show(rel)))?;
    apply(&fd, o, &show(rel))?;
    entry(fd.as_raw_fd(), b"", show(rel)).map_err(|e| error(e, &show(rel)))
}

/// Removes `rel`: a file or link, or a directory with everything in it.
pub fn remove(root: &OwnedFd, rel: &str) -> Result<(), ApiError> {
    let (d, name) = parent(root, rel)?;
    remove_at(d.as_raw_fd(), OsStr::new(name).as_bytes()).map_err(|e| error(e, &show(rel)))
}

/// Deepest directory tree a remove goes through (each level is an open descriptor).
pub const MAX_DEPTH: usize = 4096;

fn open_dir_at(dir: RawFd, name: &[u8]) -> io::Result<OwnedFd> {
    let c = cstr(name)?;
    // SAFETY: openat relative to a directory fd, not following a link.
    let fd = unsafe {
        libc::openat(
            dir,
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor from the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn names_in(dir: &OwnedFd) -> io::Result<Vec<Vec<u8>>> {
    Ok(
        std::fs::read_dir(format!("/proc/self/fd/{}", dir.as_raw_fd()))?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().as_bytes().to_vec())
            .collect(),
    )
}

fn unlink_at(dir: RawFd, name: &[u8], flags: i32) -> io::Result<()> {
    let c = cstr(name)?;
    // SAFETY: unlinkat relative to a directory fd (a link itself is removed).
    match unsafe { libc::unlinkat(dir, c.as_ptr(), flags) } {
        0 => Ok(()),
        _ => match io::Error::last_os_error() {
            e if e.raw_os_error() == Some(libc::ENOENT) => Ok(()), // gone meanwhile
            e => Err(e),
        },
    }
}

/// Removes `name` in `dir`: a file or link, or a directory with everything in it, walked
/// with a stack of its own (no recursion: a sandbox can nest directories as deep as it
/// likes), never following a link, at most [`MAX_DEPTH`] levels down.
fn remove_at(dir: RawFd, name: &[u8]) -> io::Result<()> {
    let st = fstatat(dir, name, libc::AT_SYMLINK_NOFOLLOW)?;
    if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
        return unlink_at(dir, name, 0);
    }
    // Each level: the directory, its name in the level above, the names left in it.
    let top = open_dir_at(dir, name)?;
    let left = names_in(&top)?;
    let mut stack: Vec<(OwnedFd, Vec<u8>, Vec<Vec<u8>>)> = vec![(top, name.to_vec(), left)];
    while let Some(next) = stack
        .last_mut()
        .map(|(d, _, left)| (d.as_raw_fd(), left.pop()))
    {
        let (here, n) = match next {
            (here, Some(n)) => (here, n),
            (_, None) => {
                if let Some((done, its_name, _)) = stack.pop() {
                    drop(done);
                    let up = stack.last().map(|(p, _, _)| p.as_raw_fd()).unwrap_or(dir);
                    unlink_at(up, &its_name, libc::AT_REMOVEDIR)?;
                }
                continue;
            }
        };
        match fstatat(here, &n, libc::AT_SYMLINK_NOFOLLOW) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e),
            Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFDIR => {
                if stack.len() >= MAX_DEPTH {
                    return Err(io::Error::other(format!(
                        "directories nested deeper than {MAX_DEPTH} levels: remove the deepest from a sandbox first"
                    )));
                }
                let sub = open_dir_at(here, &n)?;
                let names = names_in(&sub)?;
                stack.push((sub, n, names));
            }
            Ok(_) => unlink_at(here, &n, 0)?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::fs::symlink;

    /// A volume a hostile sandbox filled with links out of it, next to a host secret.
    fn hostile() -> (tempfile::TempDir, std::path::PathBuf) {
        let t = tempfile::tempdir().unwrap();
        std::fs::write(t.path().join("secret"), b"host").unwrap();
        let vol = t.path().join("vol");
        std::fs::create_dir_all(vol.join("d")).unwrap();
        std::fs::write(vol.join("d/inside"), b"inside").unwrap();
        symlink(t.path().join("secret"), vol.join("abs")).unwrap();
        symlink("../secret", vol.join("up")).unwrap();
        symlink(t.path(), vol.join("hostdir")).unwrap();
        symlink("/d/inside", vol.join("rooted")).unwrap();
        (t, vol)
    }

    #[test]
    fn links_resolve_inside_the_volume_never_on_the_host() {
        let (t, vol) = hostile();
        let root = open_root(&vol).unwrap();
        // An absolute link to the host's file resolves inside the volume: nothing there.
        assert_eq!(
            open_read(&root, "abs").unwrap_err().code,
            dsec_common::ErrorCode::NotFound
        );
        // `..` stops at the volume's root.
        assert_eq!(
            open_read(&root, "up").unwrap_err().code,
            dsec_common::ErrorCode::NotFound
        );
        assert!(open_read(&root, &clean("../../secret").unwrap()).is_err());
        // A link to `/d/inside` means the volume's own file, as in a sandbox.
        let (mut f, n) = open_read(&root, "rooted").unwrap();
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        assert_eq!((s.as_str(), n), ("inside", 6));
        // Writing through links lands in the volume, never over the host's file.
        for name in ["abs", "hostdir/secret"] {
            if let Ok(mut up) = open_write(&root, name, Owner::default()) {
                up.file().unwrap().write_all(b"pwned").unwrap();
                let _ = up.commit();
            }
        }
        assert_eq!(std::fs::read(t.path().join("secret")).unwrap(), b"host");
        // chmod and remove through links do not touch the host either.
        let _ = update(
            &root,
            "abs",
            Owner {
                mode: Some(0o777),
                ..Default::default()
            },
        );
        use std::os::unix::fs::PermissionsExt;
        let m = std::fs::metadata(t.path().join("secret"))
            .unwrap()
            .permissions()
            .mode();
        assert_ne!(m & 0o777, 0o777);
        remove(&root, "hostdir").unwrap();
        assert!(
            t.path().join("secret").exists(),
            "the link went, not its target"
        );
        let names: Vec<String> = list(&root, "", 1)
            .unwrap()
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert!(!names.contains(&"hostdir".to_string()));
    }

    #[test]
    fn a_fifo_is_refused_at_once_never_waited_on() {
        let t = tempfile::tempdir().unwrap();
        let c = CString::new(t.path().join("p").as_os_str().as_bytes()).unwrap();
        // SAFETY: mkfifo with a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0);
        let root = open_root(t.path()).unwrap();
        // Without O_NONBLOCK either open would wait for a peer that never comes.
        let start = std::time::Instant::now();
        assert_eq!(
            open_read(&root, "p").unwrap_err().code,
            dsec_common::ErrorCode::InvalidArgument
        );
        assert_eq!(
            open_write(&root, "p", Owner::default()).unwrap_err().code,
            dsec_common::ErrorCode::InvalidArgument
        );
        assert!(start.elapsed() < std::time::Duration::from_secs(5));
    }

    #[test]
    fn an_upload_that_fails_leaves_the_old_file_whole() {
        let t = tempfile::tempdir().unwrap();
        let root = open_root(t.path()).unwrap();
        std::fs::write(t.path().join("f"), b"old content").unwrap();
        std::os::unix::fs::symlink("f", t.path().join("link")).unwrap();
        {
            let mut up = open_write(&root, "f", Owner::default()).unwrap();
            up.file().unwrap().write_all(b"half").unwrap();
            // Readers still see the whole old file while the upload runs.
            assert_eq!(std::fs::read(t.path().join("f")).unwrap(), b"old content");
            // The upload fails here (dropped without a commit).
        }
        assert_eq!(std::fs::read(t.path().join("f")).unwrap(), b"old content");
        let left: Vec<_> = std::fs::read_dir(t.path()).unwrap().collect();
        assert_eq!(left.len(), 2, "no half-written file left: {left:?}");
        // Through the link: the file it points to is replaced, the link stays a link.
        let mut up = open_write(&root, "link", Owner::default()).unwrap();
        up.file().unwrap().write_all(b"new").unwrap();
        up.commit().unwrap();
        assert_eq!(std::fs::read(t.path().join("f")).unwrap(), b"new");
        assert!(
            std::fs::symlink_metadata(t.path().join("link"))
                .unwrap()
                .file_type()
                .is_symlink()
        );
        // A directory is not replaced.
        std::fs::create_dir(t.path().join("d")).unwrap();
        assert_eq!(
            open_write(&root, "d", Owner::default()).unwrap_err().code,
            dsec_common::ErrorCode::InvalidArgument
        );
    }

    /// Makes `levels` directories, each inside the last, under `dir`.
    fn nest(dir: &std::path::Path, levels: usize) {
        let mut fd = open_root(dir).unwrap();
        for _ in 0..levels {
            // SAFETY: mkdirat relative to a directory fd.
            assert_eq!(
                unsafe { libc::mkdirat(fd.as_raw_fd(), c"d".as_ptr(), 0o755) },
                0
            );
            fd = open_dir_at(fd.as_raw_fd(), b"d").unwrap();
        }
    }

    #[test]
    fn a_tree_nested_thousands_deep_is_removed_without_recursion() {
        let t = tempfile::tempdir().unwrap();
        nest(t.path(), 3000);
        let root = open_root(t.path()).unwrap();
        // On a thread with a small stack: a recursive walk would overflow it.
        let r = std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(move || remove(&root, "d"))
            .unwrap()
            .join()
            .unwrap();
        r.unwrap();
        assert!(!t.path().join("d").exists());
        nest(t.path(), MAX_DEPTH + 1);
        let root = open_root(t.path()).unwrap();
        let e = remove(&root, "d").unwrap_err();
        assert_eq!(e.code, dsec_common::ErrorCode::InvalidArgument);
        assert!(e.message.contains("deeper than"), "{}", e.message);
    }

    #[test]
    fn files_and_directories_round_trip() {
        let t = tempfile::tempdir().unwrap();
        let root = open_root(t.path()).unwrap();
        let o = Owner {
            uid: Some(1000),
            gid: Some(1000),
            mode: Some(0o4755),
        };
        let mut up = open_write(&root, "/a/b/c.txt", o).unwrap();
        up.file().unwrap().write_all(b"hi").unwrap();
        up.commit().unwrap();
        let e = stat(&root, "a/b/c.txt").unwrap();
        assert_eq!(
            (e.kind.as_str(), e.size, e.uid, e.gid),
            ("file", 2, 1000, 1000)
        );
        assert_eq!(e.mode & 0o7777, 0o755, "set-user bit dropped");
        assert_eq!(e.path, "/a/b/c.txt");
        mkdir(&root, "x/y", true, Owner::default()).unwrap();
        assert_eq!(
            mkdir(&root, "x/y", true, Owner::default())
                .unwrap_err()
                .code,
            dsec_common::ErrorCode::AlreadyExists
        );
        let all = list(&root, "", 3).unwrap();
        let paths: Vec<&str> = all.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["/a", "/a/b", "/a/b/c.txt", "/x", "/x/y"]);
        // Written again: the same owner and mode, the new bytes.
        let mut up = open_write(&root, "a/b/c.txt", Owner::default()).unwrap();
        up.file().unwrap().write_all(b"again").unwrap();
        up.commit().unwrap();
        let e = stat(&root, "a/b/c.txt").unwrap();
        assert_eq!(
            (e.size, e.uid, e.gid, e.mode & 0o777),
            (5, 1000, 1000, 0o755)
        );
        assert_eq!(list(&root, "a", 1).unwrap().len(), 1);
        remove(&root, "a").unwrap();
        assert_eq!(
            stat(&root, "a").unwrap_err().code,
            dsec_common::ErrorCode::NotFound
        );
        assert_eq!(
            remove(&root, "").unwrap_err().code,
            dsec_common::ErrorCode::InvalidArgument
        );
    }
}
