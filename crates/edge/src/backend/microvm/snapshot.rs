//! Snapshot files of a microVM and what is recorded about them.
//!
//! ```text
//! <seed dir>/vmstate, fc.json        a fork's snapshot (the edge's fork-tmp/<src>-<rand>)
//! <ram dir>/seed-<seed name>.mem     its guest memory, on the RAM directory's tmpfs
//! <ram dir>/seed-<seed name>.mem.diff  a Diff's pages, until laid over a copy of the base
//! <sandbox dir>/suspended/vmstate, mem, fc.json   a VM paused to disk
//! <snapshot dir>/vmstate, mem, fc.json  a snapshot kept for later (its memory moved
//!                                    out of the RAM directory)
//! <ram dir>/<id>.base.mem            a hard link to the memory a VM last saved or was
//!                                    loaded from: what a Diff snapshot is laid onto
//! ```
//!
//! Copies map a memory file MAP_PRIVATE for their whole life, so a memory file is never
//! written once anything may have loaded it: removing it (discard) only unlinks it, and a
//! Diff goes onto a fresh copy of the base, never the base itself.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use dsec_common::IoContext;

use super::probe::{Firecracker, Version};
use crate::backend::StateError;
use crate::backend::saved::{SavedGuest, SavedState};

/// Bumped when the layout or `fc.json` changes (`FORMAT_NUMBER` with it).
pub const FORMAT: &str = "dsec-fc-snapshot-v1";
const FORMAT_PREFIX: &str = "dsec-fc-snapshot-v";
const FORMAT_NUMBER: u32 = 1;
pub const META: &str = "fc.json";
pub const VMSTATE: &str = "vmstate";
pub const MEM: &str = "mem";
pub const SUSPENDED: &str = "suspended";

/// What a saved microVM is, next to its `vmstate` as `fc.json`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SavedVm {
    pub format: String,
    /// The Firecracker that wrote it: the snapshot format changes with almost every
    /// minor release, so only the same version loads it.
    pub firecracker: Version,
    pub snapshot_version: String,
    #[serde(flatten)]
    pub guest: SavedGuest,
    /// Whether the VM tracked dirty pages (Diff snapshots of its copies are possible).
    pub track_dirty_pages: bool,
    /// The guest memory file: absolute, or relative to the directory of `fc.json` (a kept
    /// snapshot's, which is moved into place after it is written). [`read_meta`] gives it
    /// absolute.
    pub mem: PathBuf,
}

/// Where a fork's memory file goes: on the RAM directory, named after the seed.
impl SavedState for SavedVm {
    const WHAT: &'static str = "a saved Firecracker microVM";
    const FORMAT: u32 = FORMAT_NUMBER;
    fn format(&self) -> u32 {
        self.format
            .strip_prefix(FORMAT_PREFIX)
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }
    fn guest(&self) -> &SavedGuest {
        &self.guest
    }
}

pub fn seed_mem(ram_dir: &Path, seed: &Path) -> PathBuf {
    let name = seed
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "seed".into());
    ram_dir.join(format!("seed-{name}.mem"))
}

/// Where a Diff snapshot's pages wait, next to the memory file `mem` they become part of,
/// until they are laid over a copy of the base (after the source is resumed).
pub fn pending_diff(mem: &Path) -> PathBuf {
    let mut p = mem.as_os_str().to_owned();
    p.push(".diff");
    PathBuf::from(p)
}

/// The hard link a VM keeps to the memory it last saved or loaded (see the module doc).
pub fn base_mem(ram_dir: &Path, id: &str) -> PathBuf {
    ram_dir.join(format!("{id}.base.mem"))
}

pub fn suspended_dir(sandbox_dir: &Path) -> PathBuf {
    sandbox_dir.join(SUSPENDED)
}

pub fn write_meta(dir: &Path, saved: &SavedVm) -> Result<(), StateError> {
    let b = serde_json::to_vec_pretty(saved).map_err(|source| StateError::Json {
        path: dir.join(META),
        source,
    })?;
    Ok(
        std::fs::write(dir.join(META), b)
            .ctx(|| format!("writing {}", dir.join(META).display()))?,
    )
}

pub fn read_meta(dir: &Path) -> Result<SavedVm, StateError> {
    let mut saved: SavedVm = crate::backend::saved::read(&dir.join(META))?;
    saved.mem = dir.join(&saved.mem);
    Ok(saved)
}

/// Checks that `dir` holds a snapshot `fc` can load: the same format and Firecracker, its
/// files present, the memory file the size of the guest's memory.
pub fn validate(dir: &Path, fc: &Firecracker) -> Result<SavedVm, StateError> {
    let saved = read_meta(dir)?;
    if saved.firecracker != fc.version || saved.snapshot_version != fc.snapshot_version {
        return Err(StateError::Invalid(format!(
            "the snapshot in {} was written by Firecracker {} (snapshot format {}), and this node runs {} (format {}); snapshots load only into the same version",
            dir.display(),
            saved.firecracker,
            saved.snapshot_version,
            fc.version,
            fc.snapshot_version
        )));
    }
    for f in std::iter::once(dir.join(VMSTATE)).chain(saved.guest.disks().map(Path::to_path_buf)) {
        if !f.is_file() {
            return Err(StateError::Invalid(format!("{} is missing", f.display())));
        }
    }
    let len = std::fs::metadata(&saved.mem)
        .ctx(|| format!("the snapshot's memory {}", saved.mem.display()))?
        .len();
    if len != saved.guest.mem_mb << 20 {
        return Err(StateError::Invalid(format!(
            "the snapshot's memory {} has {len} bytes, not the guest's {} MiB",
            saved.mem.display(),
            saved.guest.mem_mb
        )));
    }
    Ok(saved)
}

/// Removes what a fork's snapshot keeps outside its directory (its memory file). Copies
/// that mapped it keep their pages until they end.
pub fn discard(seed: &Path) {
    if let Ok(saved) = read_meta(seed)
        && !saved.mem.starts_with(seed)
    {
        let _ = std::fs::remove_file(&saved.mem);
        let _ = std::fs::remove_file(pending_diff(&saved.mem));
    }
}

/// Writes every data region of the sparse file `diff` (a Diff snapshot's memory: only
/// the pages dirtied since the base) over the same offsets of `into` (a copy of the base).
pub fn merge_diff(diff: &Path, into: &Path) -> Result<u64, StateError> {
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut src = std::fs::File::open(diff).ctx(|| format!("opening {}", diff.display()))?;
    let mut dst = std::fs::OpenOptions::new()
        .write(true)
        .open(into)
        .ctx(|| format!("opening {}", into.display()))?;
    let len = src.metadata().ctx(|| format!("{}", diff.display()))?.len() as i64;
    let mut at: i64 = 0;
    let mut copied = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    while at < len {
        // SAFETY: lseek on an fd we own.
        let data = unsafe { libc::lseek(src.as_raw_fd(), at, libc::SEEK_DATA) };
        if data < 0 {
            break; // ENXIO: only a hole is left
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(src.as_raw_fd(), data, libc::SEEK_HOLE) };
        let end = if hole < 0 { len } else { hole };
        src.seek(SeekFrom::Start(data as u64))
            .and_then(|_| dst.seek(SeekFrom::Start(data as u64)))
            .ctx(|| format!("merging {}", diff.display()))?;
        let mut left = (end - data) as usize;
        while left > 0 {
            let n = left.min(buf.len());
            src.read_exact(&mut buf[..n])
                .and_then(|()| dst.write_all(&buf[..n]))
                .ctx(|| format!("merging {} into {}", diff.display(), into.display()))?;
            left -= n;
            copied += n as u64;
        }
        at = end;
    }
    dst.sync_all().ctx(|| format!("{}", into.display()))?;
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::microvm::probe::Capabilities;

    fn fc(v: Version) -> Firecracker {
        Firecracker {
            path: "/usr/local/bin/firecracker".into(),
            version: v,
            snapshot_version: "v10.0.0".into(),
            caps: Capabilities::of(v),
        }
    }

    /// A seed as a fork leaves it: vmstate + fc.json in `seed`, memory on `ram`.
    fn make_seed(seed: &Path, ram: &Path, disk: &Path) -> SavedVm {
        std::fs::create_dir_all(seed).unwrap();
        std::fs::write(seed.join(VMSTATE), b"state").unwrap();
        let mem = seed_mem(ram, seed);
        let f = std::fs::File::create(&mem).unwrap();
        f.set_len(2 << 20).unwrap();
        let saved = SavedVm {
            format: FORMAT.into(),
            firecracker: Version::new(1, 16, 1),
            snapshot_version: "v10.0.0".into(),
            guest: SavedGuest {
                disk: disk.to_path_buf(),
                lowers: vec![],
                mem_mb: 2,
                cpus: 1,
            },
            track_dirty_pages: false,
            mem,
        };
        write_meta(seed, &saved).unwrap();
        saved
    }

    /// A seed named `name` in `dir`, its memory in `dir/ram`, its disk `dir/root.ext4`:
    /// (seed, ram, disk, what `fc.json` says).
    fn fixture(dir: &Path, name: &str) -> (PathBuf, PathBuf, PathBuf, SavedVm) {
        let (seed, ram, disk) = (dir.join(name), dir.join("ram"), dir.join("root.ext4"));
        std::fs::create_dir_all(&ram).unwrap();
        std::fs::write(&disk, b"disk").unwrap();
        let saved = make_seed(&seed, &ram, &disk);
        (seed, ram, disk, saved)
    }

    #[test]
    fn names_and_places() {
        let ram = Path::new("/dev/shm/dsec-vm");
        assert_eq!(
            seed_mem(ram, Path::new("/x/fork-tmp/local-ab-0011")),
            Path::new("/dev/shm/dsec-vm/seed-local-ab-0011.mem")
        );
        assert_eq!(
            base_mem(ram, "local-ab"),
            Path::new("/dev/shm/dsec-vm/local-ab.base.mem")
        );
        assert_eq!(
            suspended_dir(Path::new("/s/local-ab")),
            Path::new("/s/local-ab/suspended")
        );
    }

    #[test]
    fn a_saved_vm_validates_only_against_its_own_firecracker() {
        let d = tempfile::tempdir().unwrap();
        let (seed, _, _, saved) = fixture(d.path(), "seed");
        assert_eq!(validate(&seed, &fc(Version::new(1, 16, 1))).unwrap(), saved);
        // The guest's fields sit at the top of fc.json, as edges wrote them before the
        // description was shared with the vm backend.
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(seed.join(META)).unwrap()).unwrap();
        assert_eq!(
            (json["mem_mb"].as_u64(), json["cpus"].as_u64()),
            (Some(2), Some(1))
        );
        // A newer format is refused, not misread.
        let newer = SavedVm {
            format: "dsec-fc-snapshot-v2".into(),
            ..saved.clone()
        };
        write_meta(&seed, &newer).unwrap();
        let e = validate(&seed, &fc(Version::new(1, 16, 1)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("format 2, newer"), "{e}");
        write_meta(&seed, &saved).unwrap();

        let e = validate(&seed, &fc(Version::new(1, 17, 0)))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("written by Firecracker v1.16.1") && e.contains("runs v1.17.0"),
            "{e}"
        );

        // Memory of the wrong size (a truncated copy).
        std::fs::File::options()
            .write(true)
            .open(&saved.mem)
            .unwrap()
            .set_len(4096)
            .unwrap();
        let e = validate(&seed, &fc(Version::new(1, 16, 1)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("has 4096 bytes, not the guest's 2 MiB"), "{e}");

        std::fs::remove_file(seed.join(VMSTATE)).unwrap();
        let e = validate(&seed, &fc(Version::new(1, 16, 1)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("vmstate is missing"), "{e}");

        let mut other = saved.clone();
        other.format = "dsec-fc-snapshot-v0".into();
        write_meta(&seed, &other).unwrap();
        let e = validate(&seed, &fc(Version::new(1, 16, 1)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("this edge reads"), "{e}");

        std::fs::write(seed.join(META), b"{").unwrap();
        assert!(validate(&seed, &fc(Version::new(1, 16, 1))).is_err());
    }

    #[test]
    fn discard_removes_the_memory_outside_the_seed_only() {
        let d = tempfile::tempdir().unwrap();
        let (seed, ram, disk, saved) = fixture(d.path(), "seed");
        // A copy's base link to the same memory survives the discard.
        let base = base_mem(&ram, "local-copy");
        std::fs::hard_link(&saved.mem, &base).unwrap();
        discard(&seed);
        assert!(!saved.mem.exists());
        assert!(base.exists() && seed.join(VMSTATE).exists() && disk.exists());

        // A suspended VM's memory lives inside its directory: left for the caller.
        let susp = suspended_dir(&d.path().join("sb"));
        std::fs::create_dir_all(&susp).unwrap();
        std::fs::write(susp.join(MEM), b"m").unwrap();
        write_meta(
            &susp,
            &SavedVm {
                mem: susp.join(MEM),
                ..saved
            },
        )
        .unwrap();
        discard(&susp);
        assert!(susp.join(MEM).exists());
        discard(&d.path().join("no-such-seed"));
    }

    #[test]
    fn memory_named_relative_to_its_directory_moves_with_it() {
        let d = tempfile::tempdir().unwrap();
        let (part, _, _, saved) = fixture(d.path(), ".snap.part");
        // Kept: the memory comes into the directory under a relative name, and the
        // directory is then renamed into place.
        std::fs::rename(&saved.mem, part.join(MEM)).unwrap();
        write_meta(
            &part,
            &SavedVm {
                mem: PathBuf::from(MEM),
                ..saved.clone()
            },
        )
        .unwrap();
        let kept = d.path().join("snap");
        std::fs::rename(&part, &kept).unwrap();
        let read = validate(&kept, &fc(Version::new(1, 16, 1))).unwrap();
        assert_eq!(read.mem, kept.join(MEM));
        // Not outside its directory: a discard leaves it to whoever removes the directory.
        discard(&kept);
        assert!(kept.join(MEM).exists());
    }

    #[test]
    fn a_diff_is_laid_over_a_copy_of_its_base() {
        use std::io::{Seek, SeekFrom, Write};
        let d = tempfile::tempdir().unwrap();
        let (base, diff) = (d.path().join("base"), d.path().join("diff"));
        std::fs::write(&base, vec![b'b'; 3 << 20]).unwrap();
        let mut f = std::fs::File::create(&diff).unwrap();
        f.set_len(3 << 20).unwrap();
        f.seek(SeekFrom::Start(1 << 20)).unwrap();
        f.write_all(&[b'd'; 4096]).unwrap();
        f.seek(SeekFrom::Start((3 << 20) - 4096)).unwrap();
        f.write_all(&[b'e'; 4096]).unwrap();
        drop(f);
        let copied = merge_diff(&diff, &base).unwrap();
        // A filesystem without SEEK_DATA support reports the whole file as data.
        assert!(copied == 8192 || copied == 3 << 20, "{copied}");
        let m = std::fs::read(&base).unwrap();
        assert_eq!(m.len(), 3 << 20);
        assert_eq!(m[0], b'b');
        assert_eq!(&m[1 << 20..(1 << 20) + 4096], &[b'd'; 4096][..]);
        assert_eq!(m[(1 << 20) + 4096], if copied == 8192 { b'b' } else { 0 });
        assert_eq!(m[(3 << 20) - 1], b'e');
    }
}
