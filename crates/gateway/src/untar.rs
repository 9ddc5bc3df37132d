//! Unpacks a tenant's archive (a template build's `COPY` context) into a directory and
//! nowhere else. Every entry is checked before anything is written:
//!
//! - its path is relative, of plain components (no `..`, no root);
//! - no directory on the way to it is a symlink (an earlier entry's `l -> /etc` cannot
//!   carry a later `l/shadow` out);
//! - a symlink's target is relative and stays inside the directory, by its text when it
//!   is unpacked and, once everything is, by the kernel's resolution through every other
//!   link (`openat2` with `RESOLVE_BENEATH`: `a -> .` then `b -> a/..` climbs out though
//!   each looks inside); a hard link names a regular file already unpacked (it becomes a
//!   copy);
//! - devices, FIFOs and other special entries are refused;
//! - set-uid, set-gid and sticky bits are dropped, and owners are not kept (files belong
//!   to the unpacker);
//! - the entries and their bytes are bounded, so a small compressed upload cannot fill
//!   the disk.

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use dsec_common::{IoContext, IoFailure};

/// Most entries and bytes one archive may unpack to.
pub const MAX_ENTRIES: usize = 200_000;
pub const MAX_BYTES: u64 = 4 << 30;

/// `p` as a path of plain components, or None.
fn plain(p: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            _ => return None,
        }
    }
    (!out.as_os_str().is_empty()).then_some(out)
}

/// Whether `target`, read from the directory `parent` (relative to the root), stays inside.
fn link_stays_inside(parent: &Path, target: &Path) -> bool {
    if target.is_absolute() {
        return false;
    }
    let mut depth = parent.components().count() as i64;
    for c in target.components() {
        match c {
            Component::Normal(_) => depth += 1,
            Component::CurDir => {}
            Component::ParentDir => {
                depth -= 1;
                if depth < 0 {
                    return false;
                }
            }
            _ => return false,
        }
    }
    true
}

/// Why an archive was not unpacked.
#[derive(Debug, thiserror::Error)]
pub enum UntarError {
    /// The archive breaks a rule of the module (an entry leaving the directory, too
    /// many entries or bytes, a kind of entry not taken): which.
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Io(#[from] IoFailure),
}

/// Makes the directories of `rel` under `root`, refusing to pass through a symlink or a
/// non-directory.
fn real_dirs(root: &Path, rel: &Path) -> Result<(), UntarError> {
    let mut p = root.to_path_buf();
    for c in rel.components() {
        p.push(c);
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_dir() => {}
            Ok(_) => {
                return Err(UntarError::Refused(format!(
                    "{} goes through {}, which is not a directory (a symlink?)",
                    rel.display(),
                    p.strip_prefix(root).unwrap_or(&p).display()
                )));
            }
            Err(_) => std::fs::create_dir(&p).ctx(|| format!("creating {}", p.display()))?,
        }
    }
    Ok(())
}

/// Unpacks the tar stream `r` into `dir` (made if missing), as the module says.
pub fn unpack(r: impl Read, dir: &Path) -> Result<(), UntarError> {
    std::fs::create_dir_all(dir).ctx(|| format!("creating {}", dir.display()))?;
    let mut a = tar::Archive::new(r);
    let mut links: Vec<PathBuf> = Vec::new();
    let mut entries = 0usize;
    let mut bytes = 0u64;
    for e in a.entries().ctx(|| "reading the archive".into())? {
        let mut e = e.ctx(|| "reading the archive".into())?;
        entries += 1;
        if entries > MAX_ENTRIES {
            return Err(UntarError::Refused(format!(
                "the archive has more than {MAX_ENTRIES} entries"
            )));
        }
        let raw = e.path().ctx(|| "an entry's path".into())?.into_owned();
        let Some(rel) = plain(&raw) else {
            if raw.components().all(|c| matches!(c, Component::CurDir)) {
                continue; // "./" itself
            }
            return Err(UntarError::Refused(format!(
                "entry {} leaves the archive's directory (absolute or '..')",
                raw.display()
            )));
        };
        let parent = rel.parent().unwrap_or(Path::new(""));
        real_dirs(dir, parent)?;
        let dest = dir.join(&rel);
        let mode = e.header().mode().unwrap_or(0o644) & 0o777;
        let kind = e.header().entry_type();
        // What is there already is replaced, never followed.
        if let Ok(m) = std::fs::symlink_metadata(&dest)
            && !(kind.is_dir() && m.file_type().is_dir())
        {
            if m.file_type().is_dir() {
                std::fs::remove_dir_all(&dest)
            } else {
                std::fs::remove_file(&dest)
            }
            .ctx(|| format!("replacing {}", rel.display()))?;
        }
        if kind.is_dir() {
            real_dirs(dir, &rel)?;
            std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(mode | 0o700))
                .ctx(|| format!("chmod {}", rel.display()))?;
        } else if kind.is_file() {
            bytes += e.size();
            if bytes > MAX_BYTES {
                return Err(UntarError::Refused(format!(
                    "the archive unpacks to more than {MAX_BYTES} bytes"
                )));
            }
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&dest)
                .ctx(|| format!("writing {}", rel.display()))?;
            std::io::copy(&mut (&mut e).take(MAX_BYTES), &mut f)
                .ctx(|| format!("writing {}", rel.display()))?;
            f.set_permissions(std::fs::Permissions::from_mode(mode))
                .ctx(|| format!("chmod {}", rel.display()))?;
        } else if kind.is_symlink() {
            let target = e
                .link_name()
                .ctx(|| format!("{}", rel.display()))?
                .ok_or_else(|| {
                    UntarError::Refused(format!("symlink {} has no target", rel.display()))
                })?
                .into_owned();
            if !link_stays_inside(parent, &target) {
                return Err(UntarError::Refused(format!(
                    "symlink {} -> {} points outside the archive's directory",
                    rel.display(),
                    target.display()
                )));
            }
            std::os::unix::fs::symlink(&target, &dest)
                .ctx(|| format!("linking {}", rel.display()))?;
            links.push(rel.clone());
        } else if kind.is_hard_link() {
            let target = e
                .link_name()
                .ctx(|| format!("{}", rel.display()))?
                .and_then(|t| plain(&t))
                .ok_or_else(|| {
                    UntarError::Refused(format!(
                        "hard link {} leaves the archive's directory",
                        rel.display()
                    ))
                })?;
            let t = dir.join(&target);
            let ok = target.parent().is_none_or(|p| real_dirs(dir, p).is_ok())
                && std::fs::symlink_metadata(&t).is_ok_and(|m| m.file_type().is_file());
            if !ok {
                return Err(UntarError::Refused(format!(
                    "hard link {} -> {} names no file unpacked before it",
                    rel.display(),
                    target.display()
                )));
            }
            std::fs::copy(&t, &dest).ctx(|| format!("copying {}", rel.display()))?;
        } else if matches!(
            kind,
            tar::EntryType::XGlobalHeader | tar::EntryType::XHeader | tar::EntryType::GNULongName
        ) {
            continue;
        } else {
            return Err(UntarError::Refused(format!(
                "entry {} is a {kind:?}; an archive holds files, directories and links only",
                rel.display()
            )));
        }
    }
    // Every link now resolves against everything unpacked: none may lead out.
    for l in &links {
        match dsec_common::beneath::stays_beneath(dir, l) {
            Ok(true) => {}
            Ok(false) => {
                return Err(UntarError::Refused(format!(
                    "symlink {} leads outside the archive's directory (through other links)",
                    l.display()
                )));
            }
            Err(e) => {
                return Err(IoFailure::new(format!("checking symlink {}", l.display()), e).into());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fuzz target: any archive unpacks inside its directory or is refused; nothing
    /// lands beside it.
    #[test]
    fn fuzz_archives() {
        let t = tempfile::tempdir().unwrap();
        let outside = t.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        let mut n = 0;
        bolero::check!()
            .with_iterations(crate::FUZZ_CASES / 4)
            .for_each(|input: &[u8]| {
                n += 1;
                let dir = t.path().join(format!("ctx{n}"));
                if unpack(input, &dir).is_ok() {
                    // Whatever was kept resolves inside, links through links included.
                    let mut stack = vec![dir.clone()];
                    while let Some(d) = stack.pop() {
                        for e in std::fs::read_dir(&d).unwrap().flatten() {
                            let ft = e.file_type().unwrap();
                            let rel = e.path().strip_prefix(&dir).unwrap().to_path_buf();
                            if ft.is_dir() {
                                stack.push(e.path());
                            } else if ft.is_symlink() {
                                assert!(
                                    dsec_common::beneath::stays_beneath(&dir, &rel).unwrap(),
                                    "{} leads out",
                                    rel.display()
                                );
                            }
                        }
                    }
                }
                let _ = std::fs::remove_dir_all(&dir);
                assert!(std::fs::read_dir(&outside).unwrap().next().is_none());
            });
    }

    enum E<'a> {
        File(&'a str, &'a [u8], u32),
        Dir(&'a str),
        Link(&'a str, &'a str),
        Hard(&'a str, &'a str),
        Dev(&'a str),
    }

    fn archive(entries: &[E]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for e in entries {
            let mut h = tar::Header::new_gnu();
            // Set the raw name bytes: the builder's own setters refuse '..'.
            let set = |h: &mut tar::Header, name: &str| {
                let n = &mut h.as_old_mut().name;
                n.fill(0);
                n[..name.len()].copy_from_slice(name.as_bytes());
            };
            match e {
                E::File(n, data, mode) => {
                    set(&mut h, n);
                    h.set_size(data.len() as u64);
                    h.set_mode(*mode);
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_cksum();
                    b.append(&h, *data).unwrap();
                }
                E::Dir(n) => {
                    set(&mut h, n);
                    h.set_size(0);
                    h.set_mode(0o755);
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_cksum();
                    b.append(&h, &[][..]).unwrap();
                }
                E::Link(n, t) | E::Hard(n, t) => {
                    set(&mut h, n);
                    h.set_size(0);
                    h.set_mode(0o777);
                    h.set_entry_type(if matches!(e, E::Link(..)) {
                        tar::EntryType::Symlink
                    } else {
                        tar::EntryType::Link
                    });
                    h.as_old_mut().linkname[..t.len()].copy_from_slice(t.as_bytes());
                    h.set_cksum();
                    b.append(&h, &[][..]).unwrap();
                }
                E::Dev(n) => {
                    set(&mut h, n);
                    h.set_size(0);
                    h.set_mode(0o666);
                    h.set_entry_type(tar::EntryType::Char);
                    h.set_cksum();
                    b.append(&h, &[][..]).unwrap();
                }
            }
        }
        b.into_inner().unwrap()
    }

    fn try_unpack(entries: &[E]) -> (tempfile::TempDir, Result<(), UntarError>) {
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir(t.path().join("outside")).unwrap();
        let r = unpack(&archive(entries)[..], &t.path().join("ctx"));
        (t, r)
    }

    #[test]
    fn plain_contexts_unpack_with_safe_modes() {
        let (t, r) = try_unpack(&[
            E::Dir("./src/"),
            E::File("src/a.py", b"print(1)", 0o4755),
            E::Link("src/b.py", "a.py"),
            E::Link("top", "src/../src/a.py"),
            E::Hard("src/c.py", "src/a.py"),
        ]);
        r.unwrap();
        let ctx = t.path().join("ctx");
        assert_eq!(std::fs::read(ctx.join("src/b.py")).unwrap(), b"print(1)");
        assert_eq!(std::fs::read(ctx.join("src/c.py")).unwrap(), b"print(1)");
        let mode = std::fs::metadata(ctx.join("src/a.py"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o755, "set-uid dropped");
        // Links through links that stay inside, and dangling ones, are kept.
        let (_t, r) = try_unpack(&[
            E::Dir("a/b"),
            E::Link("a/up", ".."),
            E::Link("a/b/up2", "../up"),
            E::Link("gone", "missing"),
        ]);
        r.unwrap();
    }

    #[test]
    fn escapes_are_refused_and_nothing_outside_changes() {
        for (what, entries) in [
            ("dot-dot", vec![E::File("../outside/x", b"pwn", 0o644)]),
            (
                "deep dot-dot",
                vec![E::File("a/../../outside/x", b"pwn", 0o644)],
            ),
            ("absolute", vec![E::File("/tmp/outside-x", b"pwn", 0o644)]),
            (
                "through an absolute link",
                vec![E::Link("l", "/"), E::File("l/tmp/x", b"pwn", 0o644)],
            ),
            (
                "through an escaping link",
                vec![E::Link("l", "../outside"), E::File("l/x", b"pwn", 0o644)],
            ),
            (
                "through an inside link",
                vec![
                    E::Dir("d"),
                    E::Link("l", "d"),
                    E::File("l/x", b"pwn", 0o644),
                ],
            ),
            ("hard link out", vec![E::Hard("h", "../outside/x")]),
            ("device", vec![E::Dev("null")]),
            (
                // Each link's text stays inside; resolved through each other they climb
                // out (a COPY of `l3/outside/...` would then read the host's files).
                "a chain of links",
                vec![
                    E::Link("l1", "."),
                    E::Link("l2", "l1/.."),
                    E::Link("l3", "l2/.."),
                ],
            ),
            ("a link to itself", vec![E::Link("loop", "loop")]),
        ] {
            let (t, r) = try_unpack(&entries);
            let e = r.expect_err(what);
            assert!(!e.to_string().is_empty(), "{what}");
            assert!(
                std::fs::read_dir(t.path().join("outside"))
                    .unwrap()
                    .next()
                    .is_none(),
                "{what}: something was written outside"
            );
            assert!(!Path::new("/tmp/outside-x").exists(), "{what}");
        }
    }
}
