//! Sandbox changes as a layer: the host side of a commit.
//!
//! [`TreeImport`] rebuilds a tree sent over the channel (`dsec_common::tree`, from a VM's
//! agent) in a fresh directory, trusting nothing: every path is relative with no `..`,
//! every entry is made inside a directory this import made itself (so nothing is ever
//! written through a symlink), headers and totals are bounded, and only overlayfs
//! whiteouts (0/0 character devices), never real device nodes, are made.
//!
//! [`normalize_layer`] applies the same rules to a writable layer copied on the host (a
//! container's overlay upper): overlayfs bookkeeping attributes and sockets go, device
//! nodes and redirects are refused.
//!
//! Both leave overlayfs-style whiteouts, which the container backend (layers as overlay
//! lowerdirs) and the VM root disk builder (an overlay of the layers) both honour.

use std::collections::HashSet;
use std::ffi::CString;
use std::fs::File;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use dsec_common::channel::{FRAME_DATA, FRAME_JSON, Response};
use dsec_common::tree::{
    EntryKind, MAX_HEADER, MAX_PATH, MAX_XATTR_VALUE, MAX_XATTRS, OPAQUE_XATTR, TreeEntry,
    XattrRule, checked_path, unescape, xattr_rule,
};

use crate::ImageError;

/// Bounds on what one import accepts.
#[derive(Debug, Clone, Copy)]
pub struct TreeLimits {
    pub max_entries: u64,
    /// File content in bytes, all files together.
    pub max_bytes: u64,
}

impl Default for TreeLimits {
    fn default() -> Self {
        TreeLimits {
            max_entries: 1_000_000,
            max_bytes: 64 << 30,
        }
    }
}

/// What an import made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImportStats {
    pub entries: u64,
    pub bytes: u64,
}

fn bad(m: impl Into<String>) -> ImageError {
    ImageError::BadTree(m.into())
}

fn io(what: &str, p: &Path, e: std::io::Error) -> ImageError {
    ImageError::Io {
        context: format!("{what} {}", p.display()),
        source: e,
    }
}

fn cpath(p: &Path) -> Result<CString, ImageError> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| bad(format!("path {} has a NUL byte", p.display())))
}

fn last_err(what: &str, p: &Path) -> ImageError {
    io(what, p, std::io::Error::last_os_error())
}

enum State {
    /// Expecting a header or the end.
    Entry,
    /// Receiving a regular file's content.
    Content {
        file: File,
        path: PathBuf,
        rel: PathBuf,
        entry: Box<TreeEntry>,
        xattrs: Vec<(CString, Vec<u8>)>,
    },
    /// The end was received.
    Done,
}

/// Rebuilds a tree from the frames of an export, in `root` (an empty directory).
pub struct TreeImport {
    root: PathBuf,
    limits: TreeLimits,
    /// Directories this import made, relative to `root` (`""` is the root).
    dirs: HashSet<PathBuf>,
    /// Directories' modes and times, applied at the end (children change a directory's
    /// time, and a read-only mode would stop them being made).
    dir_meta: Vec<(PathBuf, u32, i64, u32)>,
    state: State,
    stats: ImportStats,
}

impl TreeImport {
    pub fn new(root: &Path, limits: TreeLimits) -> Result<TreeImport, ImageError> {
        let md = std::fs::symlink_metadata(root).map_err(|e| io("reading", root, e))?;
        let empty = std::fs::read_dir(root)
            .map_err(|e| io("listing", root, e))?
            .next()
            .is_none();
        if !md.is_dir() || !empty {
            return Err(bad(format!(
                "{} must be an empty directory to import into",
                root.display()
            )));
        }
        Ok(TreeImport {
            root: root.to_path_buf(),
            limits,
            dirs: HashSet::from([PathBuf::new()]),
            dir_meta: Vec::new(),
            state: State::Entry,
            stats: ImportStats::default(),
        })
    }

    /// Takes the next frame; `Ok(true)` once the end arrived (then call [`Self::finish`]).
    pub fn frame(&mut self, kind: u8, payload: &[u8]) -> Result<bool, ImageError> {
        match (&mut self.state, kind) {
            (State::Done, _) => Err(bad("data after the end of the tree")),
            (State::Entry, FRAME_DATA) if payload.is_empty() => {
                Err(bad("an empty frame where an entry was due"))
            }
            (State::Entry, FRAME_DATA) => {
                self.entry(payload)?;
                Ok(false)
            }
            (State::Entry, FRAME_JSON) => {
                let r: Response = serde_json::from_slice(payload)
                    .map_err(|e| bad(format!("malformed end of the tree: {e}")))?;
                match r {
                    Response::Exported { entries, bytes }
                        if entries == self.stats.entries && bytes == self.stats.bytes =>
                    {
                        self.state = State::Done;
                        Ok(true)
                    }
                    Response::Exported { entries, bytes } => Err(bad(format!(
                        "the sender counted {entries} entries and {bytes} bytes, {} and {} arrived",
                        self.stats.entries, self.stats.bytes
                    ))),
                    Response::Error { message, .. } => Err(ImageError::Export(message)),
                    other => Err(bad(format!("unexpected reply {other:?} in the tree"))),
                }
            }
            (State::Content { file, path, .. }, FRAME_DATA) if !payload.is_empty() => {
                self.stats.bytes += payload.len() as u64;
                if self.stats.bytes > self.limits.max_bytes {
                    return Err(bad(format!(
                        "the files add up to more than {} bytes",
                        self.limits.max_bytes
                    )));
                }
                file.write_all(payload)
                    .map_err(|e| io("writing", path, e))?;
                Ok(false)
            }
            (State::Content { .. }, FRAME_DATA) => {
                let State::Content {
                    file,
                    path,
                    entry,
                    xattrs,
                    ..
                } = std::mem::replace(&mut self.state, State::Entry)
                else {
                    return Err(bad("import state lost"));
                };
                finish_file(file, &path, &entry, &xattrs)?;
                Ok(false)
            }
            (State::Content { rel, .. }, FRAME_JSON) => {
                let why = match serde_json::from_slice::<Response>(payload) {
                    Ok(Response::Error { message, .. }) => return Err(ImageError::Export(message)),
                    _ => "a reply",
                };
                Err(bad(format!(
                    "{why} arrived in the middle of {}",
                    rel.display()
                )))
            }
            (_, k) => Err(bad(format!("unexpected frame kind {:?}", k as char))),
        }
    }

    fn entry(&mut self, header: &[u8]) -> Result<(), ImageError> {
        if header.len() > MAX_HEADER {
            return Err(bad(format!(
                "an entry header of {} bytes is over the {MAX_HEADER}-byte limit",
                header.len()
            )));
        }
        let e: TreeEntry = serde_json::from_slice(header)
            .map_err(|err| bad(format!("malformed entry header: {err}")))?;
        self.stats.entries += 1;
        if self.stats.entries > self.limits.max_entries {
            return Err(bad(format!(
                "more than {} entries",
                self.limits.max_entries
            )));
        }
        let rel = checked_path(&e.path).map_err(|m| bad(m.to_string()))?;
        let parent = rel.parent().unwrap_or(Path::new("")).to_path_buf();
        if !self.dirs.contains(&parent) {
            return Err(bad(format!(
                "{} comes before its directory (or its parent is not a directory)",
                rel.display()
            )));
        }
        if e.mode > 0o7777 {
            return Err(bad(format!(
                "{}: mode {:o} is not a permission mode",
                rel.display(),
                e.mode
            )));
        }
        if e.mtime_ns > 999_999_999 {
            return Err(bad(format!("{}: bad mtime_ns", rel.display())));
        }
        let xattrs = self.xattrs(&rel, &e)?;
        let abs = self.root.join(&rel);
        let c = cpath(&abs)?;
        let exists = |err: std::io::Error| {
            if err.kind() == std::io::ErrorKind::AlreadyExists {
                bad(format!("{} is sent twice", rel.display()))
            } else {
                io("creating", &abs, err)
            }
        };
        if e.kind != EntryKind::Symlink && e.kind != EntryKind::Hardlink && e.target.is_some() {
            return Err(bad(format!("{}: only links have a target", rel.display())));
        }
        if !matches!(e.kind, EntryKind::Char | EntryKind::Block) && e.rdev.is_some() {
            return Err(bad(format!("{}: only devices have rdev", rel.display())));
        }
        match e.kind {
            EntryKind::Dir => {
                std::fs::DirBuilder::new()
                    .mode(0o700)
                    .create(&abs)
                    .map_err(exists)?;
                set_owner(&c, &abs, &e)?;
                set_xattrs(&c, &abs, &xattrs)?;
                self.dirs.insert(rel.clone());
                self.dir_meta.push((rel, e.mode, e.mtime, e.mtime_ns));
            }
            EntryKind::File => {
                let file = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                    .open(&abs)
                    .map_err(exists)?;
                self.state = State::Content {
                    file,
                    path: abs,
                    rel,
                    entry: Box::new(e),
                    xattrs,
                };
            }
            EntryKind::Hardlink => {
                let target = checked_path(e.target.as_deref().unwrap_or(""))
                    .map_err(|m| bad(format!("hard link {}: bad target: {m}", rel.display())))?;
                let tparent = target.parent().unwrap_or(Path::new("")).to_path_buf();
                let tabs = self.root.join(&target);
                // Its directory was made here, so lstat sees what this import made.
                let is_file = self.dirs.contains(&tparent)
                    && std::fs::symlink_metadata(&tabs).is_ok_and(|m| m.file_type().is_file());
                if !is_file || !xattrs.is_empty() {
                    return Err(bad(format!(
                        "hard link {} must name a regular file sent before it, and carry no attributes",
                        rel.display()
                    )));
                }
                std::fs::hard_link(&tabs, &abs).map_err(exists)?;
            }
            EntryKind::Symlink => {
                let target = unescape(e.target.as_deref().unwrap_or(""))
                    .map_err(|m| bad(format!("symlink {}: {m}", rel.display())))?;
                if target.is_empty() || target.len() > MAX_PATH || target.contains(&0) {
                    return Err(bad(format!(
                        "symlink {} has an empty, over-long or NUL-holding target",
                        rel.display()
                    )));
                }
                // The target is stored as it is; nothing here ever follows it.
                std::os::unix::fs::symlink(std::ffi::OsStr::from_bytes(&target), &abs)
                    .map_err(exists)?;
                set_owner(&c, &abs, &e)?;
                set_xattrs(&c, &abs, &xattrs)?;
                set_times(&c, &abs, e.mtime, e.mtime_ns)?;
            }
            EntryKind::Char | EntryKind::Fifo => {
                let (fmt, dev) = if e.kind == EntryKind::Char {
                    if e.rdev != Some((0, 0)) {
                        let (major, minor) = e.rdev.unwrap_or_default();
                        return Err(ImageError::Uncommittable(format!(
                            "{} is a device node ({major}:{minor}); only overlayfs whiteouts (0/0) can be committed",
                            rel.display()
                        )));
                    }
                    (libc::S_IFCHR, libc::makedev(0, 0))
                } else {
                    (libc::S_IFIFO, 0)
                };
                // SAFETY: a NUL-terminated path whose parent this import made.
                if unsafe { libc::mknod(c.as_ptr(), fmt | (e.mode & 0o777), dev) } != 0 {
                    return Err(exists(std::io::Error::last_os_error()));
                }
                set_owner(&c, &abs, &e)?;
                set_mode(&abs, e.mode)?;
                set_xattrs(&c, &abs, &xattrs)?;
                set_times(&c, &abs, e.mtime, e.mtime_ns)?;
            }
            EntryKind::Block => {
                return Err(ImageError::Uncommittable(format!(
                    "{} is a block device; device nodes cannot be committed",
                    rel.display()
                )));
            }
        }
        Ok(())
    }

    /// The entry's attributes, decoded and checked against the layer rules.
    fn xattrs(&self, rel: &Path, e: &TreeEntry) -> Result<Vec<(CString, Vec<u8>)>, ImageError> {
        if e.xattrs.len() > MAX_XATTRS {
            return Err(bad(format!(
                "{} has more than {MAX_XATTRS} attributes",
                rel.display()
            )));
        }
        let mut out = Vec::new();
        for (name, value) in &e.xattrs {
            let v = unescape(value).map_err(|m| bad(format!("{}: {m}", rel.display())))?;
            if v.len() > MAX_XATTR_VALUE {
                return Err(bad(format!(
                    "{}: attribute {name} is too large",
                    rel.display()
                )));
            }
            match xattr_rule(name) {
                XattrRule::Keep => {}
                XattrRule::Refuse(why) => {
                    return Err(ImageError::Uncommittable(format!(
                        "{} has attribute {name}: {why}",
                        rel.display()
                    )));
                }
                XattrRule::Drop => {
                    return Err(bad(format!(
                        "{}: attribute {name:?} does not belong in a layer",
                        rel.display()
                    )));
                }
            }
            if name == OPAQUE_XATTR && (e.kind != EntryKind::Dir || v != b"y") {
                return Err(bad(format!(
                    "{}: {OPAQUE_XATTR} is only for directories, with the value y",
                    rel.display()
                )));
            }
            let cname = CString::new(name.as_bytes())
                .map_err(|_| bad(format!("{}: attribute name with a NUL", rel.display())))?;
            out.push((cname, v));
        }
        Ok(out)
    }

    /// After the end arrived: directories get their modes and times (deepest first).
    pub fn finish(self) -> Result<ImportStats, ImageError> {
        if !matches!(self.state, State::Done) {
            return Err(bad("the tree ended before its end marker"));
        }
        for (rel, mode, mtime, ns) in self.dir_meta.iter().rev() {
            let abs = self.root.join(rel);
            set_mode(&abs, *mode)?;
            set_times(&cpath(&abs)?, &abs, *mtime, *ns)?;
        }
        set_mode(&self.root, 0o755)?;
        Ok(self.stats)
    }
}

fn set_owner(c: &CString, p: &Path, e: &TreeEntry) -> Result<(), ImageError> {
    // SAFETY: a NUL-terminated path; lchown does not follow a symlink.
    if unsafe { libc::lchown(c.as_ptr(), e.uid, e.gid) } != 0 {
        return Err(last_err("setting the owner of", p));
    }
    Ok(())
}

fn set_mode(p: &Path, mode: u32) -> Result<(), ImageError> {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
        .map_err(|e| io("setting the mode of", p, e))
}

fn set_times(c: &CString, p: &Path, sec: i64, ns: u32) -> Result<(), ImageError> {
    let t = libc::timespec {
        tv_sec: sec as libc::time_t,
        tv_nsec: ns as _,
    };
    let times = [t, t];
    // SAFETY: a NUL-terminated path and two timespecs.
    let rc = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            times.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if rc != 0 {
        return Err(last_err("setting the times of", p));
    }
    Ok(())
}

fn set_xattrs(c: &CString, p: &Path, xattrs: &[(CString, Vec<u8>)]) -> Result<(), ImageError> {
    for (name, value) in xattrs {
        // SAFETY: NUL-terminated path and name, a value of the length passed.
        let rc = unsafe {
            libc::lsetxattr(
                c.as_ptr(),
                name.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        if rc != 0 {
            return Err(last_err(
                &format!("setting attribute {} on", name.to_string_lossy()),
                p,
            ));
        }
    }
    Ok(())
}

fn finish_file(
    file: File,
    path: &Path,
    e: &TreeEntry,
    xattrs: &[(CString, Vec<u8>)],
) -> Result<(), ImageError> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // Owner before mode: a chown clears set-id bits.
    // SAFETY: fd is the open file.
    if unsafe { libc::fchown(fd, e.uid, e.gid) } != 0 {
        return Err(last_err("setting the owner of", path));
    }
    file.set_permissions(std::fs::Permissions::from_mode(e.mode))
        .map_err(|err| io("setting the mode of", path, err))?;
    for (name, value) in xattrs {
        // SAFETY: fd is the open file; NUL-terminated name, a value of the length passed.
        let rc =
            unsafe { libc::fsetxattr(fd, name.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
        if rc != 0 {
            return Err(last_err(
                &format!("setting attribute {} on", name.to_string_lossy()),
                path,
            ));
        }
    }
    let t = libc::timespec {
        tv_sec: e.mtime as libc::time_t,
        tv_nsec: e.mtime_ns as _,
    };
    // SAFETY: fd is the open file; two timespecs.
    if unsafe { libc::futimens(fd, [t, t].as_ptr()) } != 0 {
        return Err(last_err("setting the times of", path));
    }
    Ok(())
}

/// Makes a writable layer copied on the host fit to be an image layer, by the rules
/// imports follow: the top-level `.dsec` (the sandbox's mount points) and sockets go,
/// attributes overlayfs keeps for one mount go (the opaque marker stays), and device
/// nodes other than whiteouts or renamed-directory redirects make it fail.
pub fn normalize_layer(root: &Path) -> Result<(), ImageError> {
    let dsec = root.join(".dsec");
    if std::fs::symlink_metadata(&dsec).is_ok() {
        crate::store::remove_tree(&dsec)?;
    }
    let mut stack = vec![root.to_path_buf()];
    let mut first = true;
    // Hard links share attributes: visit each inode once.
    let mut seen: HashSet<(u64, u64)> = HashSet::new();
    while let Some(p) = stack.pop() {
        let md = std::fs::symlink_metadata(&p).map_err(|e| io("reading", &p, e))?;
        let ft = md.file_type();
        let rel = p.strip_prefix(root).unwrap_or(&p).display().to_string();
        if ft.is_socket() {
            std::fs::remove_file(&p).map_err(|e| io("removing socket", &p, e))?;
            continue;
        }
        if ft.is_block_device() || (ft.is_char_device() && md.rdev() != libc::makedev(0, 0)) {
            return Err(ImageError::Uncommittable(format!(
                "/{rel} is a device node; only overlayfs whiteouts (0/0) can be committed"
            )));
        }
        if md.nlink() > 1 && !ft.is_dir() && !seen.insert((md.dev(), md.ino())) {
            continue;
        }
        clean_xattrs(&p, &rel)?;
        if ft.is_dir() {
            for ent in std::fs::read_dir(&p).map_err(|e| io("listing", &p, e))? {
                let ent = ent.map_err(|e| io("listing", &p, e))?;
                stack.push(ent.path());
            }
        }
        if first {
            first = false;
            set_mode(root, 0o755)?;
        }
    }
    Ok(())
}

/// Removes the attributes a layer must not carry; refuses ones that cannot be dropped.
fn clean_xattrs(p: &Path, rel: &str) -> Result<(), ImageError> {
    let c = cpath(p)?;
    // SAFETY: a NUL-terminated path; a null buffer asks for the size.
    let n = unsafe { libc::llistxattr(c.as_ptr(), std::ptr::null_mut(), 0) };
    if n <= 0 {
        return Ok(());
    }
    let mut buf = vec![0u8; n as usize + 256];
    // SAFETY: the buffer has the length passed.
    let m = unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if m < 0 {
        return Err(last_err("listing attributes of", p));
    }
    buf.truncate(m as usize);
    for raw in buf.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let name = String::from_utf8_lossy(raw);
        match xattr_rule(&name) {
            XattrRule::Keep => {}
            XattrRule::Refuse(why) => {
                return Err(ImageError::Uncommittable(format!(
                    "/{rel} has attribute {name}: {why}"
                )));
            }
            XattrRule::Drop => {
                let cname = CString::new(raw).map_err(|e| bad(e.to_string()))?;
                // SAFETY: NUL-terminated path and name.
                if unsafe { libc::lremovexattr(c.as_ptr(), cname.as_ptr()) } != 0 {
                    return Err(last_err(&format!("removing attribute {name} from"), p));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_common::channel::{read_frame, write_json};
    use dsec_common::tree::escape;

    fn is_root() -> bool {
        // SAFETY: no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    fn entry(path: &str, kind: EntryKind) -> TreeEntry {
        // SAFETY: no preconditions.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        TreeEntry {
            path: path.into(),
            kind,
            mode: 0o755,
            uid,
            gid,
            mtime: 1_700_000_000,
            mtime_ns: 5,
            target: None,
            rdev: None,
            xattrs: Default::default(),
        }
    }

    fn header(e: &TreeEntry) -> Vec<u8> {
        serde_json::to_vec(e).unwrap()
    }

    /// Fuzz target: a guest's export stream as any frames (`[kind][len u16][payload]`
    /// from the input) is rebuilt inside its directory or refused; nothing lands beside
    /// it. Entry headers that parse are mixed in, so the fuzzer reaches past them.
    #[test]
    fn fuzz_tree_streams() {
        let t = tempfile::tempdir().unwrap();
        let outside = t.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        let kinds = [FRAME_JSON, FRAME_DATA, b'H', b'X'];
        let mut n = 0;
        bolero::check!()
            .with_iterations(500)
            .for_each(|input: &[u8]| {
                n += 1;
                let dest = t.path().join(format!("t{n}"));
                std::fs::create_dir(&dest).unwrap();
                let mut imp = TreeImport::new(&dest, TreeLimits::default()).unwrap();
                let mut rest = input;
                while rest.len() >= 3 {
                    let kind = kinds[rest[0] as usize % kinds.len()];
                    let len = (u16::from_be_bytes([rest[1], rest[2]]) as usize).min(rest.len() - 3);
                    let payload = &rest[3..3 + len];
                    rest = &rest[3 + len..];
                    let framed = if kind == b'H' {
                        // a header that parses, with the fuzzer's path
                        let mut e = entry(&String::from_utf8_lossy(payload), EntryKind::File);
                        e.mode = 0o644;
                        (FRAME_JSON, header(&e))
                    } else {
                        (kind, payload.to_vec())
                    };
                    match imp.frame(framed.0, &framed.1) {
                        Ok(false) => {}
                        _ => break,
                    }
                }
                let _ = crate::store::remove_tree(&dest);
                assert!(std::fs::read_dir(&outside).unwrap().next().is_none());
            });
    }

    /// Feeds frames to a fresh import; the result of the first failure, or of finish.
    fn run(frames: &[(u8, Vec<u8>)]) -> (tempfile::TempDir, Result<ImportStats, ImageError>) {
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("t");
        std::fs::create_dir(&dest).unwrap();
        let mut imp = TreeImport::new(&dest, TreeLimits::default()).unwrap();
        for (k, p) in frames {
            match imp.frame(*k, p) {
                Ok(true) => return (d, imp.finish()),
                Ok(false) => {}
                Err(e) => return (d, Err(e)),
            }
        }
        (d, imp.finish())
    }

    fn end(entries: u64, bytes: u64) -> (u8, Vec<u8>) {
        (
            FRAME_JSON,
            serde_json::to_vec(&Response::Exported { entries, bytes }).unwrap(),
        )
    }

    fn d(b: &[u8]) -> (u8, Vec<u8>) {
        (FRAME_DATA, b.to_vec())
    }

    fn must_fail(frames: &[(u8, Vec<u8>)], what: &str) -> String {
        let (dir, r) = run(frames);
        let e = r.expect_err(what).to_string();
        // Nothing was made outside the import's directory.
        let outside: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(outside, vec![std::ffi::OsString::from("t")], "{what}");
        e
    }

    #[test]
    fn rejects_traversal_symlink_escape_and_malformed_input() {
        let dir = |p: &str| d(&header(&entry(p, EntryKind::Dir)));
        let file = |p: &str| d(&header(&entry(p, EntryKind::File)));
        let mut link = entry("l", EntryKind::Symlink);
        link.target = Some("..".into());
        let link = d(&header(&link));
        for (frames, what) in [
            (vec![file("../x"), d(b"")], "parent traversal"),
            (vec![file("/etc/x"), d(b"")], "absolute path"),
            (vec![file("%2Fetc%2Fx"), d(b"")], "escaped absolute path"),
            (vec![dir("a"), file("a/../../x"), d(b"")], "inner traversal"),
            (vec![file("a/x"), d(b"")], "child before its directory"),
            // A symlink to the outside, then writing "through" it as a directory.
            (
                vec![link.clone(), file("l/x"), d(b"")],
                "write through a symlink",
            ),
            (vec![link.clone(), dir("l/sub")], "mkdir through a symlink"),
            (vec![dir("a"), dir("a")], "duplicate entry"),
            (vec![link.clone(), file("l"), d(b"")], "file over a symlink"),
            (vec![d(b"{not json")], "malformed header"),
            (
                vec![d(
                    br#"{"path":"a","kind":"dir","mode":493,"uid":0,"gid":0,"evil":1}"#,
                )],
                "unknown field",
            ),
            (vec![d(b"")], "empty frame where an entry is due"),
            (vec![(b'X', b"x".to_vec())], "unknown frame kind"),
            (vec![d(&vec![b' '; MAX_HEADER + 1])], "oversized header"),
            (
                vec![file("f"), d(b"abc"), end(1, 3)],
                "end in the middle of a file",
            ),
            (
                vec![file("f"), d(b"abc"), d(b""), end(1, 4)],
                "counts that do not match",
            ),
            (vec![file("f"), d(b"")], "no end marker"),
        ] {
            must_fail(&frames, what);
        }
        let mut hl = entry("h", EntryKind::Hardlink);
        hl.target = Some("l".into());
        must_fail(&[link.clone(), d(&header(&hl))], "hard link to a symlink");
        hl.target = Some("../../etc/passwd".into());
        must_fail(&[d(&header(&hl))], "hard link outside");
        let mut dev = entry("sda", EntryKind::Char);
        dev.rdev = Some((8, 0));
        let e = must_fail(&[d(&header(&dev)), end(1, 0)], "device node");
        assert!(e.contains("device node"), "{e}");
        let mut x = entry("a", EntryKind::Dir);
        x.xattrs
            .insert("trusted.overlay.redirect".into(), "/b".into());
        must_fail(&[d(&header(&x))], "redirect attribute");
        x.xattrs.clear();
        x.xattrs.insert("security.selinux".into(), "x".into());
        must_fail(&[d(&header(&x))], "attribute a layer does not carry");
        let mut m = entry("a", EntryKind::Dir);
        m.mode = 0o170000;
        must_fail(&[d(&header(&m))], "file type bits in mode");
        let err = must_fail(
            &[(
                FRAME_JSON,
                serde_json::to_vec(&Response::error(
                    dsec_common::ErrorCode::FailedPrecondition,
                    "cannot read /x",
                ))
                .unwrap(),
            )],
            "the sender's error",
        );
        assert!(err.contains("cannot read /x"), "{err}");
        // Bounds: entries and bytes.
        let dest = tempfile::tempdir().unwrap();
        let mut imp = TreeImport::new(
            dest.path(),
            TreeLimits {
                max_entries: 10,
                max_bytes: 4,
            },
        )
        .unwrap();
        imp.frame(FRAME_DATA, &header(&entry("f", EntryKind::File)))
            .unwrap();
        assert!(imp.frame(FRAME_DATA, b"12345").is_err());
    }

    /// A tree with a whiteout, an opaque directory, a symlink, a hard link, odd names
    /// and modes goes out through the agent's encoder and comes back the same.
    #[test]
    fn round_trips_whiteouts_opaque_dirs_symlinks_and_modes() {
        if !is_root() {
            eprintln!("skipped: whiteouts and trusted.* attributes need root");
            return;
        }
        let src = tempfile::tempdir().unwrap();
        let s = src.path();
        std::fs::set_permissions(s, PermissionsExt::from_mode(0o755)).unwrap();
        std::fs::create_dir_all(s.join("etc/opq")).unwrap();
        std::fs::write(s.join("etc/opq/kept"), b"kept").unwrap();
        let opq = CString::new(s.join("etc/opq").as_os_str().as_bytes()).unwrap();
        let name = CString::new(OPAQUE_XATTR).unwrap();
        // SAFETY: NUL-terminated strings, a one-byte value.
        assert_eq!(
            unsafe { libc::lsetxattr(opq.as_ptr(), name.as_ptr(), c"y".as_ptr().cast(), 1, 0) },
            0
        );
        let wh = CString::new(s.join("etc/gone").as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(
            unsafe { libc::mknod(wh.as_ptr(), libc::S_IFCHR, libc::makedev(0, 0)) },
            0
        );
        std::fs::write(s.join("etc/secret"), b"x".repeat(300_000)).unwrap();
        std::os::unix::fs::lchown(s.join("etc/secret"), Some(1234), Some(5678)).unwrap();
        std::fs::set_permissions(s.join("etc/secret"), PermissionsExt::from_mode(0o4711)).unwrap();
        std::os::unix::fs::symlink("../../outside", s.join("etc/link")).unwrap();
        std::fs::hard_link(s.join("etc/opq/kept"), s.join("hard")).unwrap();
        std::fs::write(s.join("odd name\n%"), b"").unwrap();
        std::fs::create_dir(s.join("ro")).unwrap();
        std::fs::write(s.join("ro/f"), b"f").unwrap();
        std::fs::set_permissions(s.join("ro"), PermissionsExt::from_mode(0o555)).unwrap();

        let mut wire = Vec::new();
        let stats = dsec_common::tree::export(s, &[], &mut wire).unwrap();
        write_json(
            &mut wire,
            &Response::Exported {
                entries: stats.entries,
                bytes: stats.bytes,
            },
        )
        .unwrap();
        let out = tempfile::tempdir().unwrap();
        let dest = out.path().join("layer");
        std::fs::create_dir(&dest).unwrap();
        let mut imp = TreeImport::new(&dest, TreeLimits::default()).unwrap();
        let mut r = &wire[..];
        let mut done = false;
        while let Some((k, p)) = read_frame(&mut r).unwrap() {
            assert!(!done, "frames after the end");
            done = imp.frame(k, &p).unwrap();
        }
        assert!(done);
        let got = imp.finish().unwrap();
        assert_eq!((got.entries, got.bytes), (stats.entries, stats.bytes));

        // Same tree, by the layer digest (tar with owners, modes, xattrs, devices).
        let (a, _) = crate::digest::tree_digest(s).unwrap();
        let (b, _) = crate::digest::tree_digest(&dest).unwrap();
        assert_eq!(a, b, "the rebuilt tree differs");
        let md = std::fs::symlink_metadata(dest.join("etc/gone")).unwrap();
        assert!(md.file_type().is_char_device() && md.rdev() == 0);
        let md = std::fs::symlink_metadata(dest.join("etc/secret")).unwrap();
        assert_eq!(
            (md.mode() & 0o7777, md.uid(), md.gid()),
            (0o4711, 1234, 5678)
        );
        assert_eq!(
            md.mtime(),
            std::fs::metadata(s.join("etc/secret")).unwrap().mtime()
        );
        assert_eq!(
            std::fs::read_link(dest.join("etc/link")).unwrap(),
            PathBuf::from("../../outside")
        );
        let a = std::fs::metadata(dest.join("hard")).unwrap();
        let b = std::fs::metadata(dest.join("etc/opq/kept")).unwrap();
        assert_eq!(a.ino(), b.ino(), "hard link not kept");
        let x = dsec_common::tree::read_xattrs(&dest.join("etc/opq")).unwrap();
        assert_eq!(x.get(OPAQUE_XATTR).map(Vec::as_slice), Some(&b"y"[..]));
        assert_eq!(
            std::fs::metadata(dest.join("ro")).unwrap().mode() & 0o7777,
            0o555
        );
        assert!(dest.join("odd name\n%").is_file());
        assert_eq!(escape(b"odd name\n%"), "odd name%0A%25");
    }

    #[test]
    fn normalize_drops_overlay_bookkeeping_and_refuses_devices() {
        if !is_root() {
            eprintln!("skipped: trusted.* attributes and device nodes need root");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        std::fs::create_dir_all(r.join(".dsec")).unwrap();
        std::fs::write(r.join(".dsec/aether"), b"").unwrap();
        std::fs::create_dir(r.join("d")).unwrap();
        let _sock = std::os::unix::net::UnixListener::bind(r.join("d/sock")).unwrap();
        let set = |p: &Path, n: &str, v: &[u8]| {
            let c = CString::new(p.as_os_str().as_bytes()).unwrap();
            let n = CString::new(n).unwrap();
            // SAFETY: NUL-terminated strings, a value of the length passed.
            let rc =
                unsafe { libc::lsetxattr(c.as_ptr(), n.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
            assert_eq!(rc, 0);
        };
        set(&r.join("d"), "trusted.overlay.impure", b"y");
        set(&r.join("d"), OPAQUE_XATTR, b"y");
        normalize_layer(r).unwrap();
        assert!(!r.join(".dsec").exists() && !r.join("d/sock").exists());
        let x = dsec_common::tree::read_xattrs(&r.join("d")).unwrap();
        assert_eq!(x.keys().collect::<Vec<_>>(), vec![OPAQUE_XATTR]);
        // SAFETY: clears nothing; reads back the raw list to see impure is gone.
        let c = CString::new(r.join("d").as_os_str().as_bytes()).unwrap();
        let mut buf = vec![0u8; 1024];
        let n = unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        assert!(!String::from_utf8_lossy(&buf[..n as usize]).contains("impure"));
        set(&r.join("d"), "trusted.overlay.redirect", b"/x");
        assert!(matches!(
            normalize_layer(r),
            Err(ImageError::Uncommittable(_))
        ));
        std::fs::remove_dir_all(r.join("d")).unwrap();
        let dev = CString::new(r.join("null").as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(
            unsafe { libc::mknod(dev.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) },
            0
        );
        assert!(matches!(
            normalize_layer(r),
            Err(ImageError::Uncommittable(_))
        ));
    }
}
