//! The tree stream: how aether sends a directory tree (a VM's writable layer) to the edge,
//! which rebuilds it as an image layer (`dsec_image::import`).
//!
//! It travels inside the channel's `D` frames, after aether's `J` `Ok` to a
//! [`crate::channel::Request::ExportTree`]:
//!
//! ```text
//! D {header JSON}                       one entry (a TreeEntry); never empty
//! D bytes … D bytes, D (empty)          a regular file's content, after its header only
//! …
//! J {"reply":"exported",…} | J error    the end: counts to check, or why it stopped
//! ```
//!
//! Parents come before their children. Byte strings (paths, link targets, attribute
//! values) are percent-escaped ([`escape`]) so that any file name fits in JSON. Whiteouts
//! are overlayfs ones: a 0/0 character device, and `trusted.overlay.opaque=y` on an
//! opaque directory. The receiver trusts nothing in it.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::channel::{CHUNK, FRAME_DATA, write_frame};
use crate::{IoContext, IoFailure};

/// Longest header the receiver reads.
pub const MAX_HEADER: usize = 256 << 10;
/// Longest path (or link target), in bytes after unescaping.
pub const MAX_PATH: usize = 4096;
/// Most extended attributes one entry may carry.
pub const MAX_XATTRS: usize = 32;
/// Largest extended attribute value, in bytes.
pub const MAX_XATTR_VALUE: usize = 64 << 10;
/// The attribute overlayfs marks an opaque directory with (value `y`).
pub const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    Dir,
    /// A regular file; its content follows the header.
    File,
    Symlink,
    /// A second name for a regular file sent earlier (`target` is that file's path).
    Hardlink,
    /// A character device; only 0/0 (an overlayfs whiteout) is accepted in a layer.
    Char,
    Block,
    Fifo,
}

/// One entry's header.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TreeEntry {
    /// Relative to the tree's root, `/`-separated, escaped.
    pub path: String,
    pub kind: EntryKind,
    /// Permission bits (at most 0o7777).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    #[serde(default)]
    pub mtime: i64,
    #[serde(default)]
    pub mtime_ns: u32,
    /// A symlink's target, or a hard link's earlier path; escaped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// A device's (major, minor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdev: Option<(u32, u32)>,
    /// Extended attributes: name → escaped value.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub xattrs: BTreeMap<String, String>,
}

/// Escapes bytes for JSON: printable ASCII except `%` stays, anything else is `%XX`.
pub fn escape(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len());
    for &c in b {
        if (0x20..0x7f).contains(&c) && c != b'%' {
            s.push(c as char);
        } else {
            s.push_str(&format!("%{c:02X}"));
        }
    }
    s
}

/// What is wrong with a tree's entry, or with a file it is read from.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    #[error("bad escape at byte {at} of {text:?}")]
    BadEscape { at: usize, text: String },
    #[error("unescaped byte {byte:#04x} in {text:?}")]
    Unescaped { byte: u8, text: String },
    /// A path a header names that no tree may hold: why.
    #[error("path {path:?} {why}")]
    BadPath { path: String, why: &'static str },
    /// An extended attribute a layer cannot carry ([`XattrRule::Refuse`]).
    #[error("{} has attribute {name}: {why}; it cannot be committed", path.display())]
    Uncommittable {
        path: PathBuf,
        name: String,
        why: &'static str,
    },
    #[error("{} has more than {MAX_XATTRS} extended attributes", .0.display())]
    TooManyXattrs(PathBuf),
    #[error("{} has a NUL byte", .0.display())]
    NulInPath(PathBuf),
    #[error(transparent)]
    Io(#[from] IoFailure),
}

/// The inverse of [`escape`]; strict: anything `escape` cannot produce is an error.
pub fn unescape(s: &str) -> Result<Vec<u8>, TreeError> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'%' {
            let hex = b
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .filter(|h| h.bytes().all(|x| x.is_ascii_hexdigit()))
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| TreeError::BadEscape {
                    at: i,
                    text: s.to_string(),
                })?;
            out.push(hex);
            i += 3;
        } else if (0x20..0x7f).contains(&c) {
            out.push(c);
            i += 1;
        } else {
            return Err(TreeError::Unescaped {
                byte: c,
                text: s.to_string(),
            });
        }
    }
    Ok(out)
}

/// What a committed layer does with an extended attribute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XattrRule {
    Keep,
    /// Meaningless outside the sandbox (overlayfs bookkeeping, security labels): left out.
    Drop,
    /// Cannot be carried over faithfully: the commit fails and says why.
    Refuse(&'static str),
}

pub fn xattr_rule(name: &str) -> XattrRule {
    match name {
        OPAQUE_XATTR => XattrRule::Keep,
        "trusted.overlay.redirect" => XattrRule::Refuse(
            "a directory renamed under overlayfs redirect_dir, which a layer cannot carry",
        ),
        "trusted.overlay.metacopy" => XattrRule::Refuse(
            "a metadata-only copy-up (overlayfs metacopy), whose data is in a lower layer",
        ),
        "security.capability" | "system.posix_acl_access" | "system.posix_acl_default" => {
            XattrRule::Keep
        }
        n if n.starts_with("user.") => XattrRule::Keep,
        _ => XattrRule::Drop,
    }
}

/// What [`export`] sent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExportStats {
    pub entries: u64,
    pub bytes: u64,
}

fn cpath(p: &Path) -> Result<CString, TreeError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| TreeError::NulInPath(p.to_path_buf()))
}

/// The extended attributes of `p` (not following a symlink), by [`xattr_rule`]: kept
/// ones returned, dropped ones left out, refused ones an error.
pub fn read_xattrs(p: &Path) -> Result<BTreeMap<String, Vec<u8>>, TreeError> {
    let c = cpath(p)?;
    let mut out = BTreeMap::new();
    let names = loop {
        // SAFETY: a NUL-terminated path; a null buffer asks for the size.
        let n = unsafe { libc::llistxattr(c.as_ptr(), std::ptr::null_mut(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENOTSUP) {
                return Ok(out);
            }
            return Err(IoFailure::new(format!("listing attributes of {}", p.display()), e).into());
        }
        if n == 0 {
            return Ok(out);
        }
        let mut buf = vec![0u8; n as usize];
        // SAFETY: the buffer has the length passed.
        let m = unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if m >= 0 {
            buf.truncate(m as usize);
            break buf;
        }
        // ERANGE: the list grew between the calls; ask again.
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::ERANGE) {
            return Err(
                IoFailure::last_os(format!("listing attributes of {}", p.display())).into(),
            );
        }
    };
    for raw in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let name = String::from_utf8_lossy(raw).into_owned();
        match xattr_rule(&name) {
            XattrRule::Drop => continue,
            XattrRule::Refuse(why) => {
                return Err(TreeError::Uncommittable {
                    path: p.to_path_buf(),
                    name,
                    why,
                });
            }
            XattrRule::Keep => {}
        }
        let cname = CString::new(raw).map_err(|_| TreeError::NulInPath(name.clone().into()))?;
        let mut buf = vec![0u8; MAX_XATTR_VALUE];
        // SAFETY: NUL-terminated path and name, a buffer of the length passed.
        let n = unsafe {
            libc::lgetxattr(
                c.as_ptr(),
                cname.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENODATA) {
                continue;
            }
            return Err(
                IoFailure::new(format!("reading attribute {name} of {}", p.display()), e).into(),
            );
        }
        buf.truncate(n as usize);
        out.insert(name, buf);
    }
    if out.len() > MAX_XATTRS {
        return Err(TreeError::TooManyXattrs(p.to_path_buf()));
    }
    Ok(out)
}

/// Why an export stopped.
#[derive(Debug)]
pub enum ExportError {
    /// Writing to the receiver failed (it went away): nothing more can be sent.
    Write(std::io::Error),
    /// The tree could not be read; the receiver should be told this.
    Tree(String),
}

/// Sends the tree under `root` (its contents, not `root` itself) as [`TreeEntry`] frames
/// to `out`, leaving out the paths in `skip` (relative to `root`, e.g. `.dsec` or
/// `etc/resolv.conf`) and sockets (which cannot be copied). Entries that vanish while it runs are left out; a tree that changes while it
/// is read gives a mix of before and after, as a copy of a live directory does.
pub fn export(
    root: &Path,
    skip: &[&str],
    out: &mut impl Write,
) -> Result<ExportStats, ExportError> {
    let tree = ExportError::Tree;
    let md = std::fs::symlink_metadata(root)
        .map_err(|e| tree(format!("cannot read {}: {e}", root.display())))?;
    if !md.is_dir() {
        return Err(tree(format!("{} is not a directory", root.display())));
    }
    let mut stats = ExportStats::default();
    let mut links: HashMap<(u64, u64), PathBuf> = HashMap::new();
    let mut names = sorted_names(root).map_err(|e| tree(e.to_string()))?;
    names.retain(|n| !skip.iter().any(|s| OsStr::new(s) == n.as_os_str()));
    // Depth-first, parents before children; each level's names reversed, to pop in order.
    names.reverse();
    let mut stack: Vec<(PathBuf, Vec<OsString>)> = vec![(PathBuf::new(), names)];
    while let Some((dir, pending)) = stack.last_mut() {
        let Some(name) = pending.pop() else {
            stack.pop();
            continue;
        };
        let rel = dir.join(&name);
        if skip.iter().any(|s| Path::new(s) == rel) {
            continue;
        }
        let abs = root.join(&rel);
        let md = match std::fs::symlink_metadata(&abs) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(tree(format!("cannot read {}: {e}", abs.display()))),
        };
        let rel_bytes = rel.as_os_str().as_bytes();
        if rel_bytes.len() > MAX_PATH {
            return Err(tree(format!(
                "path {} is longer than {MAX_PATH} bytes",
                abs.display()
            )));
        }
        let ft = md.file_type();
        if ft.is_socket() {
            continue;
        }
        let mut e = TreeEntry {
            path: escape(rel_bytes),
            kind: EntryKind::File,
            mode: md.mode() & 0o7777,
            uid: md.uid(),
            gid: md.gid(),
            mtime: md.mtime(),
            mtime_ns: md.mtime_nsec().clamp(0, 999_999_999) as u32,
            target: None,
            rdev: None,
            xattrs: BTreeMap::new(),
        };
        let mut content = None;
        if ft.is_dir() {
            e.kind = EntryKind::Dir;
        } else if ft.is_symlink() {
            e.kind = EntryKind::Symlink;
            let t = match std::fs::read_link(&abs) {
                Ok(t) => t,
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => continue,
                Err(err) => {
                    return Err(tree(format!("cannot read link {}: {err}", abs.display())));
                }
            };
            e.target = Some(escape(t.as_os_str().as_bytes()));
        } else if ft.is_file() {
            let key = (md.dev(), md.ino());
            if md.nlink() > 1
                && let Some(first) = links.get(&key)
            {
                e.kind = EntryKind::Hardlink;
                e.target = Some(escape(first.as_os_str().as_bytes()));
            } else {
                let f = match std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&abs)
                {
                    Ok(f) => f,
                    Err(err) if err.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(err) => {
                        return Err(tree(format!("cannot read {}: {err}", abs.display())));
                    }
                };
                if md.nlink() > 1 {
                    links.insert(key, rel.clone());
                }
                content = Some(f);
            }
        } else if ft.is_char_device() || ft.is_block_device() {
            e.kind = if ft.is_char_device() {
                EntryKind::Char
            } else {
                EntryKind::Block
            };
            e.rdev = Some((libc::major(md.rdev()), libc::minor(md.rdev())));
        } else if ft.is_fifo() {
            e.kind = EntryKind::Fifo;
        } else {
            continue;
        }
        if e.kind != EntryKind::Hardlink {
            match read_xattrs(&abs) {
                Ok(x) => {
                    e.xattrs = x.into_iter().map(|(k, v)| (k, escape(&v))).collect();
                }
                Err(_) if std::fs::symlink_metadata(&abs).is_err() => continue,
                Err(m) => return Err(tree(m.to_string())),
            }
        }
        let header = serde_json::to_vec(&e).map_err(|err| tree(err.to_string()))?;
        if header.len() > MAX_HEADER {
            return Err(tree(format!(
                "the description of {} is over {MAX_HEADER} bytes (its attributes are too large)",
                abs.display()
            )));
        }
        write_frame(out, FRAME_DATA, &header).map_err(ExportError::Write)?;
        stats.entries += 1;
        if let Some(f) = content {
            stats.bytes += send_content(f, &abs, out)?;
        }
        if e.kind == EntryKind::Dir {
            let mut names = match sorted_names(&abs) {
                Ok(n) => n,
                Err(_) if std::fs::symlink_metadata(&abs).is_err() => Vec::new(),
                Err(m) => return Err(tree(m.to_string())),
            };
            names.reverse();
            stack.push((rel, names));
        }
    }
    Ok(stats)
}

/// A file's bytes as `D` frames, then the empty `D` that ends them (also when reading
/// fails half-way, so the receiver stays in step before it is told why).
fn send_content(mut f: File, abs: &Path, out: &mut impl Write) -> Result<u64, ExportError> {
    let mut buf = vec![0u8; CHUNK];
    let mut sent = 0u64;
    let failure = loop {
        let n = match f.read(&mut buf) {
            Ok(0) => break None,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => break Some(format!("cannot read {}: {e}", abs.display())),
        };
        write_frame(out, FRAME_DATA, &buf[..n]).map_err(ExportError::Write)?;
        sent += n as u64;
    };
    write_frame(out, FRAME_DATA, &[]).map_err(ExportError::Write)?;
    match failure {
        Some(m) => Err(ExportError::Tree(m)),
        None => Ok(sent),
    }
}

fn sorted_names(dir: &Path) -> Result<Vec<OsString>, IoFailure> {
    let rd = std::fs::read_dir(dir).ctx(|| format!("cannot list {}", dir.display()))?;
    let mut names = Vec::new();
    for ent in rd {
        let ent = ent.ctx(|| format!("cannot list {}", dir.display()))?;
        names.push(ent.file_name());
    }
    names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    Ok(names)
}

/// A header's path as a relative path, checked: not empty, no empty, `.` or `..`
/// component, nothing absolute, no NUL, at most [`MAX_PATH`] bytes.
pub fn checked_path(escaped: &str) -> Result<PathBuf, TreeError> {
    let raw = unescape(escaped)?;
    let bad = |why| TreeError::BadPath {
        path: escaped.to_string(),
        why,
    };
    if raw.is_empty() || raw.len() > MAX_PATH {
        return Err(bad("is empty or too long"));
    }
    if raw.contains(&0) {
        return Err(bad("contains a NUL byte"));
    }
    if raw[0] == b'/' {
        return Err(bad("is absolute"));
    }
    for comp in raw.split(|b| *b == b'/') {
        if comp.is_empty() || comp == b"." || comp == b".." {
            return Err(bad("has an empty, '.' or '..' component"));
        }
    }
    Ok(PathBuf::from(OsString::from_vec(raw)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::read_frame;

    #[test]
    fn escaping_round_trips_any_bytes_and_is_strict() {
        let all: Vec<u8> = (0..=255).collect();
        let e = escape(&all);
        assert!(e.is_ascii());
        assert_eq!(unescape(&e).unwrap(), all);
        assert_eq!(escape(b"a b%c/\n"), "a b%25c/%0A");
        for bad in ["%", "%4", "%zz", "é", "a\nb"] {
            assert!(unescape(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn checked_paths_stay_relative_and_inside() {
        assert_eq!(checked_path("a/b%20c").unwrap(), PathBuf::from("a/b c"));
        for bad in [
            "", "/etc", "a//b", "a/", "./a", "a/./b", "..", "a/../b", "a/..", "%2Fetc", "a%00b",
        ] {
            assert!(checked_path(bad).is_err(), "{bad:?} accepted");
        }
        assert!(checked_path(&"a/".repeat(2100)).is_err());
    }

    #[test]
    fn xattr_rules_keep_opaque_and_refuse_redirects() {
        assert_eq!(xattr_rule(OPAQUE_XATTR), XattrRule::Keep);
        assert_eq!(xattr_rule("user.x"), XattrRule::Keep);
        assert_eq!(xattr_rule("trusted.overlay.origin"), XattrRule::Drop);
        assert_eq!(xattr_rule("security.selinux"), XattrRule::Drop);
        assert!(matches!(
            xattr_rule("trusted.overlay.redirect"),
            XattrRule::Refuse(_)
        ));
    }

    #[test]
    fn export_sends_parents_first_content_links_and_skips() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        std::fs::create_dir_all(r.join("a/b")).unwrap();
        std::fs::write(r.join("a/b/f"), b"hello").unwrap();
        std::fs::hard_link(r.join("a/b/f"), r.join("a/g")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", r.join("l")).unwrap();
        std::fs::create_dir(r.join(".dsec")).unwrap();
        std::fs::write(r.join("a/b/skipped"), b"runtime-made").unwrap();
        let _sock = std::os::unix::net::UnixListener::bind(r.join("sock")).unwrap();
        let mut out = Vec::new();
        let stats = export(r, &[".dsec", "a/b/skipped"], &mut out).unwrap();
        assert_eq!(
            stats,
            ExportStats {
                entries: 5,
                bytes: 5
            }
        );
        let mut rd = &out[..];
        let mut seen = Vec::new();
        while let Some((k, body)) = read_frame(&mut rd).unwrap() {
            assert_eq!(k, FRAME_DATA);
            let e: TreeEntry = serde_json::from_slice(&body).unwrap();
            if e.kind == EntryKind::File {
                assert_eq!(read_frame(&mut rd).unwrap().unwrap().1, b"hello");
                assert_eq!(read_frame(&mut rd).unwrap().unwrap().1, b"");
            }
            seen.push((e.path, e.kind, e.target));
        }
        let p = |s: &str| s.to_string();
        assert_eq!(
            seen,
            vec![
                (p("a"), EntryKind::Dir, None),
                (p("a/b"), EntryKind::Dir, None),
                (p("a/b/f"), EntryKind::File, None),
                (p("a/g"), EntryKind::Hardlink, Some(p("a/b/f"))),
                (p("l"), EntryKind::Symlink, Some(p("/etc/passwd"))),
            ]
        );
    }
}
