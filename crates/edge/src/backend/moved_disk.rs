//! A VM's read-only root disk as part of a state moved to another edge (both VM
//! backends boot from the image store's guest disks). It travels with its sha256, so
//! the receiving edge uses a disk it already holds with the same content (the same
//! image's disk built there, or one received before) instead of fetching it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use dsec_image::guest;

use super::SavedFile;

/// Its name in a transfer manifest.
pub const NAME: &str = "disk";

/// `disk` as a file of a saved state.
pub fn saved_file(disk: &Path) -> Result<SavedFile, String> {
    let size = std::fs::metadata(disk)
        .map_err(|e| format!("{}: {e}", disk.display()))?
        .len();
    let sha = guest::disk_sha256(disk).map_err(|e| e.to_string())?;
    Ok(SavedFile {
        name: NAME.into(),
        size,
        sha256: Some(sha),
        hint: disk.file_name().map(|n| n.to_string_lossy().into_owned()),
        path: disk.to_path_buf(),
    })
}

/// A disk in the store at `store_root` with the content of `f`: under the sender's name
/// or as one received before. The name is only a hint; the content is checked.
pub fn local_copy(store_root: &Path, f: &SavedFile) -> Option<PathBuf> {
    let sha = f.sha256.as_deref().filter(|_| f.name == NAME)?;
    let dir = guest::disks_dir(store_root);
    let mut candidates = vec![dir.join(format!("imported-{sha}.ext4"))];
    if let Some(h) = f
        .hint
        .as_deref()
        .filter(|h| h.ends_with(".ext4") && !h.contains('/') && !h.starts_with('.'))
    {
        candidates.push(dir.join(h));
    }
    candidates
        .into_iter()
        .find(|c| c.is_file() && guest::disk_sha256(c).is_ok_and(|s| s == sha))
}

/// Where the received state's disk is on this edge: the local copy found before the
/// transfer, or the fetched one (in `staged`), checked against its sha256 and kept in
/// the store.
pub fn place(
    store_root: &Path,
    staged: &Path,
    files: &[SavedFile],
    have: &BTreeMap<String, PathBuf>,
) -> Result<PathBuf, String> {
    if let Some(p) = have.get(NAME) {
        return Ok(p.clone());
    }
    let sha = files
        .iter()
        .find(|f| f.name == NAME)
        .and_then(|f| f.sha256.clone())
        .ok_or_else(|| "the disk has no sha256".to_string())?;
    guest::adopt_disk(store_root, &staged.join(NAME), &sha).map_err(|e| e.to_string())
}
