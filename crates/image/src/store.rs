//! The image store on disk. Writes go to `tmp/` and are renamed into place, so a crash
//! never leaves a half-written layer or reference visible.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::digest::{sha256_hex, tree_digest, valid_digest};
use crate::{ImageError, ImageRef, IoContext};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub schema_version: u32,
    /// Layer digests, bottom first.
    pub layers: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// What every new sandbox of the image starts (E2B's start command).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<StartCmd>,
    pub created_ms: u64,
    /// Sum of the layers' tar sizes.
    pub size_bytes: u64,
    /// How the image was made, for `dsec image inspect`.
    pub source: String,
}

/// A command every new sandbox of an image runs in the background once it is up (a
/// server, say), and a command that succeeds once it is ready; create waits for that.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartCmd {
    pub run: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<String>,
    /// How long `ready` may take to succeed (default 60 s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_timeout_seconds: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ImageEntry {
    pub reference: String,
    pub digest: String,
    pub manifest: Manifest,
}

#[derive(Debug, Clone)]
pub struct ImageStore {
    root: PathBuf,
    /// Mounts the store's lazy layers ([`crate::lazy`]); none where the node cannot.
    lazy: Option<crate::lazy::LazyMounter>,
}

pub use dsec_common::now_ms;

impl ImageStore {
    pub fn open(root: impl Into<PathBuf>) -> Result<ImageStore, ImageError> {
        let root = root.into();
        for sub in ["layers", "manifests", "refs", "tmp"] {
            let p = root.join(sub);
            std::fs::create_dir_all(&p).ctx(|| format!("creating {}", p.display()))?;
        }
        // Layers hold what sandboxes committed, set-id programs included, on a filesystem
        // that honours set-id bits: only root may reach them (sandboxes see them through
        // overlay mounts made by root). Best effort: a non-root `dsec image ls` cannot.
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            use std::os::unix::fs::PermissionsExt;
            for sub in ["layers", "tmp"] {
                let p = root.join(sub);
                if std::fs::metadata(&p).is_ok_and(|m| m.permissions().mode() & 0o077 != 0) {
                    let _ = std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o700));
                }
            }
        }
        Ok(ImageStore { root, lazy: None })
    }

    /// The store, mounting its lazy layers with `m` when they are used.
    pub fn with_lazy(mut self, m: Option<crate::lazy::LazyMounter>) -> ImageStore {
        self.lazy = m;
        self
    }

    pub fn lazy(&self) -> Option<&crate::lazy::LazyMounter> {
        self.lazy.as_ref()
    }

    /// Makes `layers` ready to read in this process's mount namespace: each lazy one
    /// mounted (the daemon started if need be). Returns the lazy ones. A lazy layer on a
    /// node that cannot mount it is an error, never an empty directory.
    pub fn ready_layers(&self, layers: &[String]) -> Result<Vec<String>, ImageError> {
        let mut lazy = Vec::new();
        for l in layers {
            if !crate::lazy::is_registered(&self.root, l) {
                continue;
            }
            match &self.lazy {
                Some(m) => m.mount(l)?,
                None => {
                    return Err(ImageError::Build(format!(
                        "layer {l} is fetched lazily, and this node cannot mount it ({}); pull the image again with --no-lazy",
                        crate::lazy::unsupported().unwrap_or_else(|| "lazy images are off".into())
                    )));
                }
            }
            lazy.push(l.clone());
        }
        Ok(lazy)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The registry logins projects keep in this store ([`crate::credentials`]).
    pub fn registry_logins(&self) -> crate::credentials::CredentialBook {
        crate::credentials::CredentialBook::new(&self.root)
    }

    pub fn layer_path(&self, digest: &str) -> PathBuf {
        self.root.join("layers").join(digest)
    }

    /// A fresh, empty directory under `tmp/` for work in progress.
    pub fn temp_dir(&self, what: &str) -> Result<PathBuf, ImageError> {
        let p = self
            .root
            .join("tmp")
            .join(format!("{what}-{}", dsec_common::id::random_hex(8)));
        std::fs::create_dir_all(&p).ctx(|| format!("creating {}", p.display()))?;
        Ok(p)
    }

    /// Moves a finished directory tree into the store as a layer; returns (digest, size).
    pub fn add_layer(&self, dir: &Path) -> Result<(String, u64), ImageError> {
        let (digest, size) = tree_digest(dir)?;
        let dest = self.layer_path(&digest);
        if dest.exists() {
            remove_tree(dir)?;
        } else {
            std::fs::rename(dir, &dest).ctx(|| format!("moving layer into {}", dest.display()))?;
        }
        Ok((digest, size))
    }

    pub fn put_manifest(&self, m: &Manifest) -> Result<String, ImageError> {
        let bytes = serde_json::to_vec_pretty(m)
            .map_err(|e| ImageError::Corrupt(format!("encoding manifest: {e}")))?;
        let digest = sha256_hex(&bytes);
        let dest = self.root.join("manifests").join(format!("{digest}.json"));
        write_atomic(&self.root.join("tmp"), &dest, &bytes)?;
        Ok(digest)
    }

    pub fn manifest(&self, digest: &str) -> Result<Manifest, ImageError> {
        if !valid_digest(digest) {
            return Err(ImageError::Corrupt(format!(
                "bad manifest digest {digest:?}"
            )));
        }
        let p = self.root.join("manifests").join(format!("{digest}.json"));
        let bytes = std::fs::read(&p).ctx(|| format!("reading {}", p.display()))?;
        let m: Manifest = serde_json::from_slice(&bytes)
            .map_err(|e| ImageError::Corrupt(format!("{}: {e}", p.display())))?;
        for l in &m.layers {
            if !valid_digest(l) {
                return Err(ImageError::Corrupt(format!(
                    "{}: bad layer {l:?}",
                    p.display()
                )));
            }
        }
        Ok(m)
    }

    pub fn tag(&self, r: &ImageRef, digest: &str) -> Result<(), ImageError> {
        let dest = self.root.join("refs").join(r.rel_path());
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).ctx(|| format!("creating {}", parent.display()))?;
        }
        write_atomic(&self.root.join("tmp"), &dest, digest.as_bytes())
    }

    /// Points `r` at `digest` only if `r` does not exist yet (atomically, so two commits
    /// to one new name cannot both win).
    pub fn tag_new(&self, r: &ImageRef, digest: &str) -> Result<(), ImageError> {
        let dest = self.root.join("refs").join(r.rel_path());
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).ctx(|| format!("creating {}", parent.display()))?;
        }
        let mut rnd = [0u8; 8];
        dsec_common::id::fill_random(&mut rnd);
        let tmp = self
            .root
            .join("tmp")
            .join(format!("w-{}", hex::encode(rnd)));
        std::fs::write(&tmp, digest.as_bytes()).ctx(|| format!("writing {}", tmp.display()))?;
        let linked = std::fs::hard_link(&tmp, &dest);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                Err(ImageError::AlreadyExists(r.to_string()))
            }
            Err(e) => Err(e).ctx(|| format!("writing {}", dest.display())),
        }
    }

    /// Whether a reference exists (whatever state its image is in).
    pub fn exists(&self, r: &ImageRef) -> bool {
        std::fs::symlink_metadata(self.root.join("refs").join(r.rel_path())).is_ok()
    }

    /// Makes image `target` from `base` plus one more layer, the finished tree in
    /// `layer_dir` (under `tmp/`; moved into the store): env and workdir are the base's.
    /// Without `overwrite` an existing `target` is refused. Returns the manifest's digest
    /// and the manifest.
    pub fn commit(
        &self,
        base: &Manifest,
        layer_dir: &Path,
        target: &ImageRef,
        overwrite: bool,
        source: String,
    ) -> Result<(String, Manifest), ImageError> {
        if !overwrite && self.exists(target) {
            remove_tree(layer_dir)?;
            return Err(ImageError::AlreadyExists(target.to_string()));
        }
        let (layer, size) = self.add_layer(layer_dir)?;
        let mut layers = base.layers.clone();
        layers.push(layer);
        let m = Manifest {
            schema_version: 1,
            layers,
            env: base.env.clone(),
            workdir: base.workdir.clone(),
            start: base.start.clone(),
            created_ms: now_ms(),
            size_bytes: base.size_bytes + size,
            source,
        };
        let digest = self.put_manifest(&m)?;
        if overwrite {
            self.tag(target, &digest)?;
        } else {
            // Lost a race to another commit: its image stands; this layer and manifest
            // are collected by the next `gc`.
            self.tag_new(target, &digest)?;
        }
        Ok((digest, m))
    }

    /// The manifest digest and manifest a reference points at.
    pub fn resolve(&self, r: &ImageRef) -> Result<(String, Manifest), ImageError> {
        let p = self.root.join("refs").join(r.rel_path());
        let digest = match std::fs::read_to_string(&p) {
            Ok(s) => s.trim().to_string(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ImageError::NotFound(r.to_string()));
            }
            Err(e) => return Err(e).ctx(|| format!("reading {}", p.display())),
        };
        let m = self.manifest(&digest)?;
        for l in &m.layers {
            if !self.layer_path(l).is_dir() {
                return Err(ImageError::Corrupt(format!(
                    "image {r}: layer {l} is missing"
                )));
            }
        }
        Ok((digest, m))
    }

    pub fn list(&self) -> Result<Vec<ImageEntry>, ImageError> {
        let mut out = Vec::new();
        let refs = self.root.join("refs");
        let mut stack = vec![refs.clone()];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).ctx(|| format!("listing {}", dir.display()))? {
                let e = e.ctx(|| format!("listing {}", dir.display()))?;
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                    continue;
                }
                let Ok(rel) = p.strip_prefix(&refs) else {
                    continue;
                };
                let parts: Vec<String> = rel
                    .iter()
                    .map(|c| c.to_string_lossy().into_owned())
                    .collect();
                let Some((tag, repo)) = parts.split_last() else {
                    continue;
                };
                let Ok(r) = ImageRef::parse(&format!("{}:{tag}", repo.join("/"))) else {
                    continue;
                };
                if let Ok((digest, manifest)) = self.resolve(&r) {
                    out.push(ImageEntry {
                        reference: r.to_string(),
                        digest,
                        manifest,
                    });
                }
            }
        }
        out.sort_by(|a, b| a.reference.cmp(&b.reference));
        Ok(out)
    }

    /// Removes a reference, then every layer and manifest no reference (and nothing in
    /// `layers_in_use`) needs any more. Returns the number of layers removed.
    pub fn remove(
        &self,
        r: &ImageRef,
        layers_in_use: &HashSet<String>,
    ) -> Result<usize, ImageError> {
        let p = self.root.join("refs").join(r.rel_path());
        match std::fs::remove_file(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ImageError::NotFound(r.to_string()));
            }
            Err(e) => return Err(e).ctx(|| format!("removing {}", p.display())),
        }
        self.gc(layers_in_use)
    }

    pub fn gc(&self, layers_in_use: &HashSet<String>) -> Result<usize, ImageError> {
        let live = self.list()?;
        let mut keep_layers = layers_in_use.clone();
        let mut keep_manifests = HashSet::new();
        for e in &live {
            keep_manifests.insert(e.digest.clone());
            keep_layers.extend(e.manifest.layers.iter().cloned());
        }
        let mut removed = 0;
        let layers = self.root.join("layers");
        for e in std::fs::read_dir(&layers).ctx(|| "listing layers".into())? {
            let e = e.ctx(|| "listing layers".into())?;
            let name = e.file_name().to_string_lossy().into_owned();
            if valid_digest(&name) && !keep_layers.contains(&name) {
                // A lazy layer: its mount first, then its chunks.
                crate::lazy::LazyMounter::remove(&self.root, &name)?;
                remove_tree(&e.path())?;
                // What a push learnt of its EROFS conversion, and its VM disk.
                let erofs = self.root.join("erofs");
                for f in [".json", ".img", ".img.sha256"] {
                    let _ = std::fs::remove_file(erofs.join(format!("{name}{f}")));
                }
                removed += 1;
            }
        }
        let manifests = self.root.join("manifests");
        for e in std::fs::read_dir(&manifests).ctx(|| "listing manifests".into())? {
            let e = e.ctx(|| "listing manifests".into())?;
            let name = e.file_name().to_string_lossy().into_owned();
            let stem = name.trim_end_matches(".json");
            if valid_digest(stem) && !keep_manifests.contains(stem) {
                let _ = std::fs::remove_file(e.path());
            }
        }
        Ok(removed)
    }
}

pub(crate) fn write_atomic(tmp_dir: &Path, dest: &Path, bytes: &[u8]) -> Result<(), ImageError> {
    let mut r = [0u8; 8];
    dsec_common::id::fill_random(&mut r);
    let tmp = tmp_dir.join(format!("w-{}", hex::encode(r)));
    std::fs::write(&tmp, bytes).ctx(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, dest).ctx(|| format!("writing {}", dest.display()))
}

/// Removes a tree that may hold read-only directories.
pub fn remove_tree(p: &Path) -> Result<(), ImageError> {
    match std::fs::remove_dir_all(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(_) => {
            let status = std::process::Command::new("rm")
                .arg("-rf")
                .arg("--one-file-system")
                .arg(p)
                .status()
                .ctx(|| format!("removing {}", p.display()))?;
            if status.success() {
                Ok(())
            } else {
                Err(ImageError::Io {
                    context: format!("removing {}", p.display()),
                    source: std::io::Error::other("rm -rf failed"),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(store: &ImageStore, file: &str, content: &str) -> String {
        let d = store.temp_dir("t").unwrap();
        std::fs::write(d.join(file), content).unwrap();
        store.add_layer(&d).unwrap().0
    }

    #[test]
    fn layers_are_content_addressed_and_refs_resolve() {
        let tmp = tempfile::tempdir().unwrap();
        let store = ImageStore::open(tmp.path()).unwrap();
        let a = layer(&store, "x", "1");
        let a2 = layer(&store, "x", "1");
        let b = layer(&store, "x", "2");
        assert_eq!(a, a2, "same tree, same digest");
        assert_ne!(a, b);
        let m = Manifest {
            schema_version: 1,
            layers: vec![a.clone(), b.clone()],
            env: BTreeMap::new(),
            workdir: None,
            start: None,
            created_ms: 1,
            size_bytes: 2,
            source: "test".into(),
        };
        let d = store.put_manifest(&m).unwrap();
        let r = ImageRef::parse("root/t:1").unwrap();
        store.tag(&r, &d).unwrap();
        let (d2, m2) = store.resolve(&r).unwrap();
        assert_eq!((d2, m2), (d, m));
        assert_eq!(store.list().unwrap().len(), 1);
        assert!(matches!(
            store.resolve(&ImageRef::parse("root/none").unwrap()),
            Err(ImageError::NotFound(_))
        ));
    }

    #[test]
    fn commit_adds_a_layer_keeps_env_and_refuses_existing_tags() {
        let tmp = tempfile::tempdir().unwrap();
        let store = ImageStore::open(tmp.path()).unwrap();
        let base_layer = layer(&store, "a", "1");
        let base = Manifest {
            schema_version: 1,
            layers: vec![base_layer.clone()],
            env: BTreeMap::from([("K".to_string(), "v".to_string())]),
            workdir: Some("/w".into()),
            start: None,
            created_ms: 1,
            size_bytes: 10,
            source: "base".into(),
        };
        let mk = |content: &str| {
            let d = store.temp_dir("c").unwrap();
            std::fs::write(d.join("new"), content).unwrap();
            d
        };
        let r = ImageRef::parse("root/committed:v1").unwrap();
        let (digest, m) = store
            .commit(&base, &mk("x"), &r, false, "commit of sandbox s".into())
            .unwrap();
        assert_eq!(m.layers.len(), 2);
        assert_eq!(m.layers[0], base_layer);
        assert_eq!(
            (m.env.clone(), m.workdir.clone()),
            (base.env.clone(), base.workdir.clone())
        );
        assert!(m.size_bytes > base.size_bytes);
        assert_eq!(store.resolve(&r).unwrap(), (digest.clone(), m));
        assert!(
            store
                .layer_path(&store.resolve(&r).unwrap().1.layers[1])
                .join("new")
                .is_file()
        );
        // An existing tag: refused without overwrite (and the tree is cleaned up), replaced with.
        let again = mk("y");
        assert!(matches!(
            store.commit(&base, &again, &r, false, String::new()),
            Err(ImageError::AlreadyExists(_))
        ));
        assert!(!again.exists());
        assert_eq!(store.resolve(&r).unwrap().0, digest);
        let (d2, _) = store
            .commit(&base, &mk("y"), &r, true, String::new())
            .unwrap();
        assert_ne!(d2, digest);
        assert_eq!(store.resolve(&r).unwrap().0, d2);
        assert!(matches!(
            store.tag_new(&r, &digest),
            Err(ImageError::AlreadyExists(_))
        ));
    }

    #[test]
    fn remove_collects_unreferenced_layers_only() {
        let tmp = tempfile::tempdir().unwrap();
        let store = ImageStore::open(tmp.path()).unwrap();
        let shared = layer(&store, "s", "shared");
        let own = layer(&store, "o", "own");
        let mk = |layers: Vec<String>| Manifest {
            schema_version: 1,
            layers,
            env: BTreeMap::new(),
            workdir: None,
            start: None,
            created_ms: 0,
            size_bytes: 0,
            source: String::new(),
        };
        let r1 = ImageRef::parse("root/a").unwrap();
        let r2 = ImageRef::parse("root/b").unwrap();
        store
            .tag(
                &r1,
                &store
                    .put_manifest(&mk(vec![shared.clone(), own.clone()]))
                    .unwrap(),
            )
            .unwrap();
        store
            .tag(&r2, &store.put_manifest(&mk(vec![shared.clone()])).unwrap())
            .unwrap();
        assert_eq!(store.remove(&r1, &HashSet::new()).unwrap(), 1);
        assert!(store.layer_path(&shared).is_dir());
        assert!(!store.layer_path(&own).exists());
        assert!(matches!(
            store.remove(&r1, &HashSet::new()),
            Err(ImageError::NotFound(_))
        ));
    }
}
