//! An OCI image layer (a tar, plain, gzip or zstd) unpacked into a store layer: the
//! untrusted bytes go through [`TreeImport`], the same checked writer a commit uses (no
//! path outside the layer, nothing written through a symlink, no device nodes, bounded
//! entries and bytes), after the OCI conventions are turned into overlayfs ones:
//!
//! - `.wh.<name>` (a whiteout) becomes a 0/0 character device `<name>`;
//! - `.wh..wh..opq` makes its directory opaque (`trusted.overlay.opaque=y`);
//! - a directory a tar leaves implicit is made (0755, root), and takes the entry's
//!   owner, mode and time if the entry comes later;
//! - device nodes are left out (a sandbox's /dev is its own) and counted.
//!
//! Extended attributes (PAX `SCHILY.xattr.*`) are kept where a layer may carry them
//! (`security.capability`, ACLs, `user.*`) and dropped otherwise.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::CString;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use dsec_common::channel::{FRAME_DATA, FRAME_JSON, Response};
use dsec_common::tree::{EntryKind, OPAQUE_XATTR, TreeEntry, XattrRule, escape, xattr_rule};

use crate::import::{TreeImport, TreeLimits};
use crate::{ImageError, IoContext};

/// Bounds on one unpacked layer.
#[derive(Debug, Clone, Copy)]
pub struct LayerLimits {
    pub max_entries: u64,
    /// Files' bytes, all together (a small blob that unpacks to far more is refused).
    pub max_bytes: u64,
}

impl Default for LayerLimits {
    fn default() -> Self {
        LayerLimits {
            max_entries: 1_000_000,
            max_bytes: 64 << 30,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerStats {
    pub entries: u64,
    pub bytes: u64,
    pub skipped_devices: u64,
}

fn bad(m: impl Into<String>) -> ImageError {
    ImageError::BadTree(m.into())
}

/// The entry's path as a relative path of normal components (`./` and a leading `/`
/// dropped); `None` for the root itself; an error for `..` or anything odd.
fn relative(raw: &[u8]) -> Result<Option<PathBuf>, ImageError> {
    let p = Path::new(std::ffi::OsStr::from_bytes(raw));
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir | Component::RootDir => {}
            Component::ParentDir | Component::Prefix(_) => {
                return Err(bad(format!(
                    "entry {:?} leaves the layer",
                    String::from_utf8_lossy(raw)
                )));
            }
        }
    }
    Ok((!out.as_os_str().is_empty()).then_some(out))
}

fn esc(p: &Path) -> String {
    escape(p.as_os_str().as_bytes())
}

/// The media type a layer file's first bytes say it is (`docker save` names none).
pub fn sniff_media_type(blob: &Path) -> Result<&'static str, ImageError> {
    let mut head = [0u8; 4];
    let n = std::fs::File::open(blob)
        .and_then(|mut f| f.read(&mut head))
        .ctx(|| format!("reading {}", blob.display()))?;
    Ok(match &head[..n] {
        [0x1f, 0x8b, ..] => "application/vnd.oci.image.layer.v1.tar+gzip",
        [0x28, 0xb5, 0x2f, 0xfd] => "application/vnd.oci.image.layer.v1.tar+zstd",
        _ => "application/vnd.oci.image.layer.v1.tar",
    })
}

/// The most a tar extension entry (PAX `x`/`g`, GNU long name or link `L`/`K`) may hold:
/// the tar crate reads those whole into memory, so a layer of a few MiB could otherwise
/// declare one of a hundred GiB.
const MAX_EXTENSION: u64 = 1 << 20;

/// The deepest path a pulled layer may hold (a real image's are a few dozen levels).
const MAX_DEPTH: usize = 256;

/// Watches a tar stream as it passes, block by block: refuses an extension entry over
/// [`MAX_EXTENSION`] before the tar crate reads it, and a stream longer than `budget`
/// decompressed bytes (what the unpacker does not keep is counted too).
struct TarGuard<R> {
    inner: R,
    header: [u8; 512],
    filled: usize,
    /// Bytes of the current entry's data (rounded up to blocks) still to pass.
    data_left: u64,
    total: u64,
    budget: u64,
}

fn tar_size(field: &[u8]) -> Option<u64> {
    if field[0] & 0x80 != 0 {
        // base-256, big-endian, in the bytes after the marker
        let mut v: u64 = 0;
        for (i, b) in field.iter().enumerate() {
            let b = if i == 0 { b & 0x7f } else { *b };
            v = v.checked_mul(256)?.checked_add(u64::from(b))?;
        }
        return Some(v);
    }
    let text: Vec<u8> = field
        .iter()
        .copied()
        .skip_while(|b| *b == b' ')
        .take_while(|b| (b'0'..=b'7').contains(b))
        .collect();
    if text.is_empty() {
        return Some(0);
    }
    u64::from_str_radix(std::str::from_utf8(&text).ok()?, 8).ok()
}

impl<R: Read> TarGuard<R> {
    fn new(inner: R, budget: u64) -> Self {
        TarGuard {
            inner,
            header: [0; 512],
            filled: 0,
            data_left: 0,
            total: 0,
            budget,
        }
    }

    fn see(&mut self, mut b: &[u8]) -> std::io::Result<()> {
        while !b.is_empty() {
            if self.data_left > 0 {
                let k = (self.data_left.min(b.len() as u64)) as usize;
                self.data_left -= k as u64;
                b = &b[k..];
                continue;
            }
            let k = (512 - self.filled).min(b.len());
            self.header[self.filled..self.filled + k].copy_from_slice(&b[..k]);
            self.filled += k;
            b = &b[k..];
            if self.filled < 512 {
                break;
            }
            self.filled = 0;
            if self.header.iter().all(|x| *x == 0) {
                continue; // an end-of-archive block
            }
            let size = tar_size(&self.header[124..136])
                .ok_or_else(|| std::io::Error::other("a tar header with a bad size"))?;
            if matches!(self.header[156], b'x' | b'g' | b'L' | b'K') && size > MAX_EXTENSION {
                return Err(std::io::Error::other(format!(
                    "a tar extension entry of {size} bytes, over the limit of {MAX_EXTENSION}"
                )));
            }
            self.data_left = size.div_ceil(512) * 512;
        }
        Ok(())
    }
}

impl<R: Read> Read for TarGuard<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.total += n as u64;
        if self.total > self.budget {
            return Err(std::io::Error::other(format!(
                "the layer unpacks to more than {} bytes",
                self.budget
            )));
        }
        self.see(&buf[..n])?;
        Ok(n)
    }
}

/// A reader that hashes what passes through it.
struct Hashing<R> {
    inner: R,
    hasher: sha2::Sha256,
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        sha2::Digest::update(&mut self.hasher, &buf[..n]);
        Ok(n)
    }
}

/// The decompressed tar stream of `blob`, by `media_type`.
fn open_tar(blob: &Path, media_type: &str) -> Result<Box<dyn Read>, ImageError> {
    let f = std::fs::File::open(blob).ctx(|| format!("opening {}", blob.display()))?;
    let f = std::io::BufReader::with_capacity(1 << 16, f);
    if media_type.ends_with("+gzip") || media_type.ends_with(".tar.gzip") {
        Ok(Box::new(flate2::read::MultiGzDecoder::new(f)))
    } else if media_type.ends_with("+zstd") {
        let d = ruzstd::decoding::StreamingDecoder::new(f)
            .map_err(|e| bad(format!("not a zstd stream: {e}")))?;
        Ok(Box::new(d))
    } else {
        Ok(Box::new(f))
    }
}

struct Unpacker {
    import: TreeImport,
    root: PathBuf,
    /// Directories made so far (relative), and those made because a tar left them
    /// implicit (their entry may still come).
    dirs: HashSet<PathBuf>,
    implicit: HashSet<PathBuf>,
    /// An implicit directory's entry that came later: applied after the import.
    later: HashMap<PathBuf, TreeEntry>,
    opaque: Vec<PathBuf>,
    stats: LayerStats,
}

impl Unpacker {
    fn header(&mut self, e: &TreeEntry) -> Result<(), ImageError> {
        let json = serde_json::to_vec(e).map_err(|x| bad(x.to_string()))?;
        self.import.frame(FRAME_DATA, &json)?;
        self.stats.entries += 1;
        Ok(())
    }

    /// Makes every missing ancestor of `rel`.
    fn parents(&mut self, rel: &Path) -> Result<(), ImageError> {
        let mut missing = Vec::new();
        let mut cur = rel.parent();
        while let Some(p) = cur {
            if p.as_os_str().is_empty() || self.dirs.contains(p) {
                break;
            }
            missing.push(p.to_path_buf());
            cur = p.parent();
        }
        for d in missing.into_iter().rev() {
            self.header(&TreeEntry {
                path: esc(&d),
                kind: EntryKind::Dir,
                mode: 0o755,
                uid: 0,
                gid: 0,
                mtime: 0,
                mtime_ns: 0,
                target: None,
                rdev: None,
                xattrs: BTreeMap::new(),
            })?;
            self.dirs.insert(d.clone());
            self.implicit.insert(d);
        }
        Ok(())
    }

    fn entry<R: Read>(&mut self, mut ent: tar::Entry<'_, R>) -> Result<(), ImageError> {
        let raw = ent.path_bytes().into_owned();
        let Some(rel) = relative(&raw)? else {
            return Ok(()); // the layer's root: the store sets its mode
        };
        if rel.components().count() > MAX_DEPTH {
            return Err(bad(format!(
                "{}: more than {MAX_DEPTH} directories deep",
                rel.display()
            )));
        }
        let name = rel
            .file_name()
            .map(|n| n.as_bytes().to_vec())
            .unwrap_or_default();
        let h = ent.header();
        let mode = h
            .mode()
            .map_err(|e| bad(format!("{}: {e}", rel.display())))?
            & 0o7777;
        let uid = u32::try_from(h.uid().unwrap_or(0)).map_err(|_| bad("uid out of range"))?;
        let gid = u32::try_from(h.gid().unwrap_or(0)).map_err(|_| bad("gid out of range"))?;
        let mtime = i64::try_from(h.mtime().unwrap_or(0)).unwrap_or(0);
        let kind = h.entry_type();
        let dev = (
            h.device_major().ok().flatten(),
            h.device_minor().ok().flatten(),
        );
        // Whiteouts.
        if name == b".wh..wh..opq" {
            self.parents(&rel)?;
            if let Some(dir) = rel.parent()
                && !dir.as_os_str().is_empty()
            {
                self.opaque.push(dir.to_path_buf());
            }
            return Ok(());
        }
        if let Some(hidden) = name.strip_prefix(b".wh.") {
            if hidden.is_empty() {
                return Err(bad(format!("{}: a whiteout of nothing", rel.display())));
            }
            self.parents(&rel)?;
            let target = rel.with_file_name(std::ffi::OsStr::from_bytes(hidden));
            return self.header(&TreeEntry {
                path: esc(&target),
                kind: EntryKind::Char,
                mode: 0,
                uid: 0,
                gid: 0,
                mtime,
                mtime_ns: 0,
                target: None,
                rdev: Some((0, 0)),
                xattrs: BTreeMap::new(),
            });
        }
        let mut xattrs = BTreeMap::new();
        if let Ok(Some(pax)) = ent.pax_extensions() {
            for ext in pax.flatten() {
                let Ok(key) = ext.key() else { continue };
                let Some(attr) = key.strip_prefix("SCHILY.xattr.") else {
                    continue;
                };
                if attr != OPAQUE_XATTR && matches!(xattr_rule(attr), XattrRule::Keep) {
                    xattrs.insert(attr.to_string(), escape(ext.value_bytes()));
                }
            }
        }
        let base = |kind: EntryKind| TreeEntry {
            path: esc(&rel),
            kind,
            mode,
            uid,
            gid,
            mtime,
            mtime_ns: 0,
            target: None,
            rdev: None,
            xattrs: xattrs.clone(),
        };
        use tar::EntryType as T;
        match kind {
            T::Directory => {
                if self.implicit.remove(&rel) {
                    let e = base(EntryKind::Dir);
                    self.later.insert(rel.clone(), e);
                    return Ok(());
                }
                if self.dirs.contains(&rel) {
                    return Err(bad(format!("{} is listed twice", rel.display())));
                }
                self.parents(&rel)?;
                self.header(&base(EntryKind::Dir))?;
                self.dirs.insert(rel.clone());
            }
            T::Regular | T::Continuous => {
                self.parents(&rel)?;
                self.header(&base(EntryKind::File))?;
                let mut buf = vec![0u8; 1 << 16];
                loop {
                    let n = ent
                        .read(&mut buf)
                        .map_err(|e| bad(format!("{}: {e}", rel.display())))?;
                    if n == 0 {
                        break;
                    }
                    self.stats.bytes += n as u64;
                    self.import.frame(FRAME_DATA, &buf[..n])?;
                }
                self.import.frame(FRAME_DATA, &[])?;
            }
            T::Symlink => {
                let target = ent
                    .link_name_bytes()
                    .ok_or_else(|| bad(format!("symlink {} has no target", rel.display())))?;
                self.parents(&rel)?;
                let mut e = base(EntryKind::Symlink);
                e.target = Some(escape(&target));
                self.header(&e)?;
            }
            T::Link => {
                let target = ent
                    .link_name_bytes()
                    .ok_or_else(|| bad(format!("hard link {} has no target", rel.display())))?;
                let Some(t) = relative(&target)? else {
                    return Err(bad(format!("hard link {} to the root", rel.display())));
                };
                self.parents(&rel)?;
                let mut e = base(EntryKind::Hardlink);
                e.target = Some(esc(&t));
                e.xattrs.clear();
                self.header(&e)?;
            }
            T::Fifo => {
                self.parents(&rel)?;
                self.header(&base(EntryKind::Fifo))?;
            }
            T::Char if dev == (Some(0), Some(0)) => {
                // An overlayfs-style whiteout written by a tool that exports uppers as-is.
                self.parents(&rel)?;
                let mut e = base(EntryKind::Char);
                e.rdev = Some((0, 0));
                self.header(&e)?;
            }
            T::Char | T::Block => self.stats.skipped_devices += 1,
            other => {
                return Err(bad(format!(
                    "{}: tar entry type {other:?} is not supported in a layer",
                    rel.display()
                )));
            }
        }
        Ok(())
    }
}

/// Unpacks the layer blob at `blob` (of `media_type`) into `dest`, an empty directory.
pub fn unpack_layer(
    blob: &Path,
    media_type: &str,
    dest: &Path,
    limits: LayerLimits,
) -> Result<LayerStats, ImageError> {
    unpack_layer_checked(blob, media_type, dest, limits, None)
}

/// [`unpack_layer`], checking the uncompressed tar against `diff_id` (`sha256:…`, as an
/// image config's `rootfs.diff_ids` names it) when one is given.
pub fn unpack_layer_checked(
    blob: &Path,
    media_type: &str,
    dest: &Path,
    limits: LayerLimits,
    diff_id: Option<&str>,
) -> Result<LayerStats, ImageError> {
    let import = TreeImport::new(
        dest,
        TreeLimits {
            max_entries: limits.max_entries,
            max_bytes: limits.max_bytes,
        },
    )?;
    let mut u = Unpacker {
        import,
        root: dest.to_path_buf(),
        dirs: HashSet::new(),
        implicit: HashSet::new(),
        later: HashMap::new(),
        opaque: Vec::new(),
        stats: LayerStats::default(),
    };
    // Files' bytes, and room for headers and padding besides.
    let budget = limits
        .max_bytes
        .saturating_add(limits.max_bytes / 8)
        .saturating_add(limits.max_entries.saturating_mul(2048));
    let mut archive = tar::Archive::new(Hashing {
        inner: TarGuard::new(open_tar(blob, media_type)?, budget),
        hasher: <sha2::Sha256 as sha2::Digest>::new(),
    });
    for ent in archive
        .entries()
        .map_err(|e| bad(format!("not a tar archive: {e}")))?
    {
        let ent = ent.map_err(|e| bad(format!("the tar archive is damaged: {e}")))?;
        u.entry(ent)?;
    }
    if let Some(want) = diff_id {
        let mut rest = archive.into_inner();
        std::io::copy(&mut rest, &mut std::io::sink())
            .map_err(|e| bad(format!("the tar archive is damaged: {e}")))?;
        let got = format!(
            "sha256:{}",
            hex::encode(sha2::Digest::finalize(rest.hasher))
        );
        if !got.eq_ignore_ascii_case(want) {
            return Err(bad(format!(
                "the layer's tar is {got}, not the {want} its image config names"
            )));
        }
    }
    let end = serde_json::to_vec(&Response::Exported {
        entries: u.stats.entries,
        bytes: u.stats.bytes,
    })
    .map_err(|e| bad(e.to_string()))?;
    u.import.frame(FRAME_JSON, &end)?;
    let Unpacker {
        import,
        root,
        later,
        opaque,
        stats,
        ..
    } = u;
    import.finish()?;
    // Every path below was made by the import as a directory, so nothing here can lead
    // through a symlink.
    for (rel, e) in later {
        let p = root.join(&rel);
        let c = cstr(&p)?;
        // SAFETY: NUL-terminated paths of directories this unpacking made.
        unsafe {
            if libc::lchown(c.as_ptr(), e.uid, e.gid) != 0 || libc::chmod(c.as_ptr(), e.mode) != 0 {
                return Err(last_err(&p));
            }
        }
    }
    for rel in opaque {
        let p = root.join(&rel);
        if !std::fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir()) {
            return Err(bad(format!(
                "{}: an opaque marker in something that is not a directory",
                rel.display()
            )));
        }
        let c = cstr(&p)?;
        let name = CString::new(OPAQUE_XATTR).map_err(|e| bad(e.to_string()))?;
        // SAFETY: NUL-terminated name and path, a 1-byte value.
        if unsafe { libc::lsetxattr(c.as_ptr(), name.as_ptr(), b"y".as_ptr().cast(), 1, 0) } != 0 {
            return Err(last_err(&p));
        }
    }
    Ok(stats)
}

fn cstr(p: &Path) -> Result<CString, ImageError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| bad(format!("{} has a NUL", p.display())))
}

fn last_err(p: &Path) -> ImageError {
    ImageError::Io {
        context: format!("setting the attributes of {}", p.display()),
        source: std::io::Error::last_os_error(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A tar of (path, kind, data) entries: `f` file, `d` directory, `l` symlink (data is
    /// the target), `h` hard link (data is the earlier path), `c` a char device 1:3.
    fn tar(entries: &[(&str, char, &[u8])]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind, data) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_mode(if *kind == 'd' { 0o755 } else { 0o644 });
            h.set_mtime(1_700_000_000);
            let t = match kind {
                'd' => tar::EntryType::Directory,
                'l' => tar::EntryType::Symlink,
                'h' => tar::EntryType::Link,
                'c' => tar::EntryType::Char,
                _ => tar::EntryType::Regular,
            };
            h.set_entry_type(t);
            if *kind == 'c' {
                h.set_device_major(1).unwrap();
                h.set_device_minor(3).unwrap();
            }
            if matches!(kind, 'l' | 'h') {
                h.set_size(0);
                b.append_link(&mut h, path, std::str::from_utf8(data).unwrap())
                    .unwrap();
            } else {
                let body: &[u8] = if *kind == 'f' { data } else { &[] };
                h.set_size(body.len() as u64);
                // Written raw so that paths with `..` reach the unpacker as they are.
                let name = path.as_bytes();
                h.as_old_mut().name[..name.len()].copy_from_slice(name);
                h.set_cksum();
                b.append(&h, body).unwrap();
            }
        }
        b.into_inner().unwrap()
    }

    fn unpack(bytes: &[u8], media: &str) -> (tempfile::TempDir, Result<LayerStats, ImageError>) {
        let t = tempfile::tempdir().unwrap();
        let blob = t.path().join("blob");
        std::fs::File::create(&blob)
            .unwrap()
            .write_all(bytes)
            .unwrap();
        let dest = t.path().join("layer");
        std::fs::create_dir(&dest).unwrap();
        let r = unpack_layer(&blob, media, &dest, LayerLimits::default());
        (t, r)
    }

    #[test]
    fn whiteouts_become_overlay_whiteouts_and_parents_are_made() {
        let raw = tar(&[
            ("a/b/file", 'f', b"hi"),
            ("a/.wh.gone", 'f', b""),
            ("a/b/.wh..wh..opq", 'f', b""),
            ("a/b", 'd', b""),
            ("a/link", 'l', b"/etc/passwd"),
            ("a/hard", 'h', b"a/b/file"),
            ("dev/null", 'c', b""),
        ]);
        let gz = {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            e.write_all(&raw).unwrap();
            e.finish().unwrap()
        };
        let (t, r) = unpack(&gz, "application/vnd.oci.image.layer.v1.tar+gzip");
        let stats = r.unwrap();
        assert_eq!(stats.skipped_devices, 1);
        let root = t.path().join("layer");
        assert_eq!(std::fs::read(root.join("a/b/file")).unwrap(), b"hi");
        let gone = std::fs::symlink_metadata(root.join("a/gone")).unwrap();
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        assert!(gone.file_type().is_char_device() && gone.rdev() == 0);
        let mut v = [0u8; 4];
        let c = cstr(&root.join("a/b")).unwrap();
        let name = CString::new(OPAQUE_XATTR).unwrap();
        // SAFETY: NUL-terminated strings and a buffer of the given length.
        let n = unsafe { libc::lgetxattr(c.as_ptr(), name.as_ptr(), v.as_mut_ptr().cast(), 4) };
        assert_eq!((n, &v[..1]), (1, &b"y"[..]));
        assert_eq!(
            std::fs::read_link(root.join("a/link")).unwrap(),
            Path::new("/etc/passwd")
        );
        assert_eq!(std::fs::metadata(root.join("a/hard")).unwrap().nlink(), 2);
        assert!(!root.join("dev/null").exists());
    }

    #[test]
    fn nothing_lands_outside_the_layer() {
        let t = tempfile::tempdir().unwrap();
        let outside = t.path().join("outside");
        for entries in [
            vec![("../escape", 'f', &b"x"[..])],
            vec![("a/../../escape", 'f', &b"x"[..])],
            // A symlink to outside, then a file through it.
            vec![
                ("l", 'l', outside.to_str().unwrap().as_bytes()),
                ("l/x", 'f', b"x"),
            ],
            // A hard link to a file outside.
            vec![("h", 'h', &b"../../etc/passwd"[..])],
        ] {
            std::fs::create_dir_all(&outside).unwrap();
            let (_t, r) = unpack(&tar(&entries), "application/vnd.oci.image.layer.v1.tar");
            assert!(r.is_err(), "{entries:?}");
            assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
        }
    }

    #[test]
    fn a_small_blob_that_unpacks_to_too_much_is_refused() {
        let big = vec![0u8; 3 << 20];
        let raw = tar(&[("zeros", 'f', &big)]);
        let t = tempfile::tempdir().unwrap();
        let blob = t.path().join("blob");
        std::fs::write(&blob, zstd_frame(&raw)).unwrap();
        let dest = t.path().join("layer");
        std::fs::create_dir(&dest).unwrap();
        let limits = LayerLimits {
            max_entries: 10,
            max_bytes: 1 << 20,
        };
        let e = unpack_layer(
            &blob,
            "application/vnd.oci.image.layer.v1.tar+zstd",
            &dest,
            limits,
        )
        .unwrap_err();
        assert!(e.to_string().contains("more than"), "{e}");
    }

    /// A PAX extension header that declares 100 GiB is refused at its header, before the
    /// tar crate would read it into memory; a path deeper than the limit is refused.
    #[test]
    fn extension_bombs_and_deep_paths_are_refused() {
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(tar::EntryType::XHeader);
        h.set_size(100 << 30);
        h.set_path("PaxHeaders/x").unwrap();
        h.set_cksum();
        let mut raw = h.as_bytes().to_vec();
        raw.extend_from_slice(&[b'0'; 4096]);
        let (_t, r) = unpack(&raw, "application/vnd.oci.image.layer.v1.tar");
        let e = r.unwrap_err().to_string();
        assert!(e.contains("extension entry of 107374182400 bytes"), "{e}");
        let deep = "d/".repeat(MAX_DEPTH) + "f";
        let mut b = tar::Builder::new(Vec::new());
        let mut fh = tar::Header::new_gnu();
        fh.set_size(1);
        fh.set_mode(0o644);
        b.append_data(&mut fh, &deep, &b"x"[..]).unwrap();
        let (_t, r) = unpack(
            &b.into_inner().unwrap(),
            "application/vnd.oci.image.layer.v1.tar",
        );
        assert!(r.unwrap_err().to_string().contains("directories deep"));
    }

    #[test]
    fn tar_sizes_parse_as_the_format_has_them() {
        assert_eq!(tar_size(b"00000000012\0"), Some(10));
        assert_eq!(tar_size(b"     12     "), Some(10));
        assert_eq!(tar_size(b"\0\0\0\0\0\0\0\0\0\0\0\0"), Some(0));
        let mut big = [0u8; 12];
        big[0] = 0x80;
        big[11] = 5;
        assert_eq!(tar_size(&big), Some(5));
    }

    /// `raw` as a zstd stream, from the `zstd` tool (the crate here only decodes).
    fn zstd_frame(raw: &[u8]) -> Vec<u8> {
        let mut c = std::process::Command::new("zstd")
            .args(["-q", "-c"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("the zstd tool (deploy/deps.sh installs it)");
        let mut stdin = c.stdin.take().unwrap();
        let data = raw.to_vec();
        let w = std::thread::spawn(move || stdin.write_all(&data));
        let out = c.wait_with_output().unwrap();
        w.join().unwrap().unwrap();
        out.stdout
    }

    /// Arbitrary bytes as a layer, plain and gzip: an error or a layer, never a panic, and
    /// never a file outside the destination.
    #[test]
    fn fuzz_layer_blobs() {
        let t = tempfile::tempdir().unwrap();
        let mut n = 0;
        bolero::check!()
            .with_iterations(300)
            .for_each(|input: &[u8]| {
                n += 1;
                for media in [
                    "application/vnd.oci.image.layer.v1.tar",
                    "application/vnd.oci.image.layer.v1.tar+gzip",
                    "application/vnd.oci.image.layer.v1.tar+zstd",
                ] {
                    let dir = t.path().join(format!("c{n}-{}", media.len()));
                    std::fs::create_dir(&dir).unwrap();
                    let blob = dir.join("blob");
                    std::fs::write(&blob, input).unwrap();
                    let dest = dir.join("layer");
                    std::fs::create_dir(&dest).unwrap();
                    let _ = unpack_layer(&blob, media, &dest, LayerLimits::default());
                    let names: Vec<_> = std::fs::read_dir(&dir)
                        .unwrap()
                        .map(|e| e.unwrap().file_name())
                        .collect();
                    assert_eq!(names.len(), 2, "{names:?}");
                    std::fs::remove_dir_all(&dir).unwrap();
                }
            });
    }
}
