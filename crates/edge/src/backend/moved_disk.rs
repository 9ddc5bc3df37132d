//! A VM's read-only root disks as part of a state moved to another edge (both VM
//! backends boot from the image store's guest disks: the stage and the image's layers as
//! EROFS). Each travels with its sha256, so the receiving edge uses a disk it already
//! holds with the same content (the same layer's disk built there, a lazily pulled layer
//! of that digest, or one received before) instead of fetching it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use dsec_common::IoContext;
use dsec_image::{ImageStore, guest};

use super::{SavedFile, StateError};

/// The top disk's name in a transfer manifest; the disks below it are `disk.1`, `disk.2`…
pub const NAME: &str = "disk";

/// The name of root disk `i` (top first).
fn name_of(i: usize) -> String {
    if i == 0 {
        NAME.to_string()
    } else {
        format!("{NAME}.{i}")
    }
}

/// The place of a disk named `name` among the root's disks, if it names one.
fn index_of(name: &str) -> Option<usize> {
    if name == NAME {
        return Some(0);
    }
    let i: usize = name.strip_prefix(NAME)?.strip_prefix('.')?.parse().ok()?;
    (i > 0 && i < guest::MAX_ROOT_DISKS && name == name_of(i)).then_some(i)
}

/// Whether `name` is one of a saved state's disks.
pub fn is_name(name: &str) -> bool {
    index_of(name).is_some()
}

/// A root's disks (`top`, then `lowers`, as saved states record them) as files of a
/// saved state.
pub fn saved_files(top: &Path, lowers: &[PathBuf]) -> Result<Vec<SavedFile>, StateError> {
    if 1 + lowers.len() > guest::MAX_ROOT_DISKS {
        return Err(StateError::Invalid(format!(
            "{} root disks is too many",
            1 + lowers.len()
        )));
    }
    std::iter::once(top)
        .chain(lowers.iter().map(PathBuf::as_path))
        .enumerate()
        .map(|(i, disk)| {
            let size = std::fs::metadata(disk)
                .ctx(|| format!("{}", disk.display()))?
                .len();
            let sha = guest::disk_sha256(disk)?;
            // A lazy layer's file: its name, and what its chunk table says it holds.
            let hint = match lazy_table(disk) {
                Some(t) => Some(format!("{sha}@{t}")),
                None => disk.file_name().map(|n| n.to_string_lossy().into_owned()),
            };
            Ok(SavedFile {
                name: name_of(i),
                size,
                sha256: Some(sha),
                hint,
                path: disk.to_path_buf(),
            })
        })
        .collect()
}

/// The [`dsec_image::lazy::table_digest`] of a disk that is a lazy layer's file on
/// `<store>/lazyfs/`.
fn lazy_table(disk: &Path) -> Option<String> {
    let (store, hex) = dsec_image::lazy::lazyfs_blob(disk)?;
    let src = dsec_image::lazy::source(store, hex).ok()?;
    Some(dsec_image::lazy::table_digest(&src.table))
}

/// A disk in `store` with the content of `f`: a lazily pulled layer of that digest and
/// chunk table, a layer's disk or a guest disk under the sender's name, or one received
/// before. The name is only a hint; the content is checked.
pub fn local_copy(store: &ImageStore, f: &SavedFile) -> Option<PathBuf> {
    let sha = f
        .sha256
        .as_deref()
        .filter(|s| is_name(&f.name) && dsec_image::digest::valid_digest(s))?;
    // A lazy layer of that digest whose chunk table is the sender's: the same bytes.
    if let Some(table) = f
        .hint
        .as_deref()
        .and_then(|h| h.strip_prefix(sha)?.strip_prefix('@'))
        && let Some(m) = store.lazy()
        && lazy_table(&m.fuse_dir().join(sha)).as_deref() == Some(table)
        && m.ensure_daemon().is_ok()
    {
        return Some(m.fuse_dir().join(sha));
    }
    let dir = guest::disks_dir(store.root());
    let mut candidates = vec![
        dir.join(format!("imported-{sha}.img")),
        dir.join(format!("imported-{sha}.ext4")),
    ];
    if let Some(h) = f
        .hint
        .as_deref()
        .filter(|h| !h.contains('/') && !h.starts_with('.'))
    {
        if h.ends_with(".ext4") || h.ends_with(".erofs") {
            candidates.push(dir.join(h));
        }
        if h.strip_suffix(".img")
            .is_some_and(dsec_image::digest::valid_digest)
        {
            candidates.push(store.root().join("erofs").join(h));
        }
    }
    candidates
        .into_iter()
        .find(|c| c.is_file() && guest::disk_sha256(c).is_ok_and(|s| s == sha))
}

/// Where the received state's disks are on this edge (the top one, and those below it):
/// the local copies found before the transfer, or the fetched ones (in `staged`), checked
/// against their sha256 and kept in the store.
pub fn place(
    store_root: &Path,
    staged: &Path,
    files: &[SavedFile],
    have: &BTreeMap<String, PathBuf>,
) -> Result<(PathBuf, Vec<PathBuf>), StateError> {
    let mut disks: BTreeMap<usize, &SavedFile> = BTreeMap::new();
    for f in files {
        if let Some(i) = index_of(&f.name) {
            disks.insert(i, f);
        }
    }
    if disks.keys().copied().ne(0..disks.len()) {
        return Err(StateError::Invalid(
            "its disks are not numbered from 0 without gaps".into(),
        ));
    }
    let mut placed = disks.values().map(|f| {
        if let Some(p) = have.get(&f.name) {
            return Ok(p.clone());
        }
        let sha = f
            .sha256
            .as_deref()
            .ok_or_else(|| StateError::Invalid(format!("{} has no sha256", f.name)))?;
        Ok(guest::adopt_disk(store_root, &staged.join(&f.name), sha)?)
    });
    let top = placed
        .next()
        .ok_or_else(|| StateError::Invalid("it has no disk".into()))??;
    Ok((top, placed.collect::<Result<_, StateError>>()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_names_are_numbered_and_nothing_else_is_one() {
        assert_eq!(index_of("disk"), Some(0));
        assert_eq!(index_of("disk.1"), Some(1));
        let last = guest::MAX_ROOT_DISKS - 1;
        assert_eq!(index_of(&format!("disk.{last}")), Some(last));
        let past = format!("disk.{}", last + 1);
        for n in [
            "disk.0", "disk.01", &past, "disk.", "disk.-1", "disks", "ram",
        ] {
            assert_eq!(index_of(n), None, "{n}");
        }
    }

    #[test]
    fn placing_needs_every_disk_and_checks_what_was_fetched() {
        let tmp = tempfile::tempdir().unwrap();
        let staged = tmp.path().join("staged");
        std::fs::create_dir(&staged).unwrap();
        let file = |name: &str, sha: &str| SavedFile {
            name: name.into(),
            size: 1,
            sha256: Some(sha.into()),
            hint: None,
            path: PathBuf::new(),
        };
        let sha_x = "2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881";
        std::fs::write(staged.join("disk.1"), b"x").unwrap();
        let mut have = BTreeMap::new();
        have.insert("disk".to_string(), PathBuf::from("/here/stage"));
        // A gap: disk.2 without disk.1.
        let gap = [file("disk", sha_x), file("disk.2", sha_x)];
        assert!(place(tmp.path(), &staged, &gap, &have).is_err());
        // A fetched disk whose bytes are not what it was sent as.
        let wrong = [file("disk", sha_x), file("disk.1", &"0".repeat(64))];
        assert!(place(tmp.path(), &staged, &wrong, &have).is_err());
        let ok = [file("disk", sha_x), file("disk.1", sha_x)];
        let (top, lowers) = place(tmp.path(), &staged, &ok, &have).unwrap();
        assert_eq!(top, PathBuf::from("/here/stage"));
        assert_eq!(
            lowers[0],
            guest::disks_dir(tmp.path()).join(format!("imported-{sha_x}.img"))
        );
        assert_eq!(std::fs::read(&lowers[0]).unwrap(), b"x");
    }
}
