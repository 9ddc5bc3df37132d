//! What both VM backends write about a saved guest, next to its state (`vm.json` for a
//! QEMU VM, `fc.json` for a Firecracker microVM): the [`SavedGuest`] both record (its
//! disks, memory and vCPUs), the backend's own part around it, and one versioned reading
//! ([`read`]): each backend numbers its formats, writes its newest and reads that one and
//! those before; a newer or unknown one is refused, not misread.

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::StateError;
use super::detached::read_json;

/// The guest a save restores, whichever VMM saved it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SavedGuest {
    /// The root's top disk. Its page cache is in the saved memory, so a restore must get
    /// this disk even if the image's disk has been rebuilt since.
    pub disk: PathBuf,
    /// The root's other disks (the image's layers), top first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lowers: Vec<PathBuf>,
    pub mem_mb: u64,
    pub cpus: u64,
}

impl SavedGuest {
    /// Every root disk, top first.
    pub fn disks(&self) -> impl Iterator<Item = &Path> {
        std::iter::once(self.disk.as_path()).chain(self.lowers.iter().map(PathBuf::as_path))
    }
}

/// A backend's saved-state description.
pub trait SavedState: Serialize + DeserializeOwned {
    /// What it describes, for messages (e.g. "a saved QEMU VM").
    const WHAT: &'static str;
    /// The format this edge writes; it reads formats 1 to this one.
    const FORMAT: u32;
    /// The format this description was written in (0: not one this edge can name).
    fn format(&self) -> u32;
    fn guest(&self) -> &SavedGuest;
}

/// Reads a saved state's description, refusing a format this edge does not read.
pub fn read<T: SavedState>(path: &Path) -> Result<T, StateError> {
    let saved: T = read_json(path)?;
    check::<T>(path, saved.format())?;
    Ok(saved)
}

fn check<T: SavedState>(path: &Path, format: u32) -> Result<(), StateError> {
    let what = match format {
        n if (1..=T::FORMAT).contains(&n) => return Ok(()),
        0 => "a format this edge does not know".to_string(),
        n => format!("format {n}, newer than this edge's; restore it on a newer edge"),
    };
    Err(StateError::Invalid(format!(
        "{} is {} of {what} (this edge reads formats 1 to {})",
        path.display(),
        T::WHAT,
        T::FORMAT,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize, serde::Deserialize)]
    struct Toy {
        format: u32,
        #[serde(flatten)]
        guest: SavedGuest,
    }

    impl SavedState for Toy {
        const WHAT: &'static str = "a toy";
        const FORMAT: u32 = 2;
        fn format(&self) -> u32 {
            self.format
        }
        fn guest(&self) -> &SavedGuest {
            &self.guest
        }
    }

    #[test]
    fn formats_up_to_the_edges_are_read_and_newer_or_unknown_ones_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("toy.json");
        let write = |format: u32| {
            std::fs::write(
                &p,
                format!(
                    r#"{{"format": {format}, "disk": "/d", "lowers": ["/l"], "mem_mb": 256, "cpus": 2}}"#
                ),
            )
            .unwrap()
        };
        for ok in [1, 2] {
            write(ok);
            let t: Toy = read(&p).unwrap();
            assert_eq!(
                t.guest().disks().collect::<Vec<_>>(),
                [Path::new("/d"), Path::new("/l")]
            );
            assert_eq!((t.guest().mem_mb, t.guest().cpus), (256, 2));
        }
        write(3);
        let e = read::<Toy>(&p).err().unwrap().to_string();
        assert!(e.contains("format 3, newer") && e.contains("1 to 2"), "{e}");
        write(0);
        let e = read::<Toy>(&p).err().unwrap().to_string();
        assert!(e.contains("does not know"), "{e}");
    }
}
