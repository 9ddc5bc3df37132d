//! Files only root may read: the node's state holds port tokens, sandboxes' environments
//! (secrets), commands and their output. Directories are made 0700 and files written 0600,
//! whatever the umask, so another user on the host reads none of it.

use std::fs::{DirBuilder, OpenOptions, Permissions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Makes `dir` (and missing parents) and sets it to 0700, also when it existed.
pub fn dir(dir: &Path) -> std::io::Result<()> {
    DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    std::fs::set_permissions(dir, Permissions::from_mode(0o700))
}

/// Opens `path` for writing (created 0600, or truncated), to append to with `append`.
pub fn open(path: &Path, append: bool) -> std::io::Result<std::fs::File> {
    let f = OpenOptions::new()
        .create(true)
        .write(true)
        .append(append)
        .truncate(!append)
        .mode(0o600)
        .open(path)?;
    // An older file may have been made with wider bits.
    f.set_permissions(Permissions::from_mode(0o600))?;
    Ok(f)
}

/// Writes `bytes` to `path` as a 0600 file, whole or not at all (through `<path>.tmp`,
/// renamed into place).
pub fn write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = Path::new(&tmp);
    open(tmp, false)?.write_all(bytes)?;
    std::fs::rename(tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_files_and_dirs_whatever_the_umask() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("a/b");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, Permissions::from_mode(0o755)).unwrap();
        dir(&d).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&d), 0o700);
        let f = d.join("state.json");
        std::fs::write(&f, "old").unwrap();
        std::fs::set_permissions(&f, Permissions::from_mode(0o644)).unwrap();
        write(&f, b"{}").unwrap();
        assert_eq!(mode(&f), 0o600);
        assert_eq!(std::fs::read(&f).unwrap(), b"{}");
        assert!(!d.join("state.json.tmp").exists());
    }
}
