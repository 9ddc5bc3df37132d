//! Images in and out without a registry. [`import`] takes an OCI image layout (a
//! directory, or a tar of one) or a `docker save` tarball; [`export`] writes an OCI image
//! layout that `skopeo`, `crane` or a registry push take as it is.
//!
//! Both sides keep what makes an image the same here: the layers' trees (owners, modes,
//! attributes, whiteouts as `.wh.` files, opaque directories as `.wh..wh..opq`), the
//! environment, working directory and time in the config, and this store's own
//! `source` and start command as annotations, so export then import gives the same
//! image digest. What is imported is untrusted: every blob is checked against its
//! digest (and each layer's tar against the config's `diff_ids`), the limits of a pull
//! hold, and the archive's paths never lead outside its own directory.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::layer::{sniff_media_type, unpack_layer_checked};
use crate::oci::{Descriptor, Document, OCI_CONFIG, OCI_INDEX, OCI_LAYER_GZIP, OCI_MANIFEST};
use crate::pull::{ConfigFile, PullFailure, PullLimits, check_digest, image_manifest};
use crate::store::{Manifest, StartCmd, remove_tree};
use crate::{ImageError, ImageRef, ImageStore, IoContext};

const SOURCE_ANNOTATION: &str = "org.opendsec.source";
const START_ANNOTATION: &str = "org.opendsec.start";
const REF_NAME: &str = "org.opencontainers.image.ref.name";
fn refused(what: &str, m: impl Into<String>) -> ImageError {
    ImageError::Pull {
        reference: what.to_string(),
        kind: PullFailure::Refused,
        message: m.into(),
    }
}

/// An archive's files: a directory, where a `docker save` tar's symlinks (a layer kept
/// once and named twice) are followed by name, never on disk.
struct Files {
    root: PathBuf,
    links: HashMap<PathBuf, PathBuf>,
    what: String,
}

/// `p` as normal components only; None if it leaves its directory.
fn clean(p: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

impl Files {
    /// The file at `rel` inside the archive, through its recorded links.
    fn path(&self, rel: &str) -> Result<PathBuf, ImageError> {
        let mut cur = clean(Path::new(rel))
            .ok_or_else(|| refused(&self.what, format!("{rel:?} leads outside the archive")))?;
        for _ in 0..16 {
            match self.links.get(&cur) {
                Some(target) => {
                    let base = cur.parent().unwrap_or(Path::new("")).join(target);
                    cur = clean(&base).ok_or_else(|| {
                        refused(&self.what, format!("{rel:?} links outside the archive"))
                    })?;
                }
                None => {
                    let p = self.root.join(&cur);
                    // Only regular files: nothing in the archive may be a link on disk.
                    return match std::fs::symlink_metadata(&p) {
                        Ok(m) if m.is_file() => Ok(p),
                        _ => Err(refused(
                            &self.what,
                            format!("{rel} is not a file of the archive"),
                        )),
                    };
                }
            }
        }
        Err(refused(&self.what, format!("{rel}: too many links")))
    }

    fn read(&self, rel: &str, max: u64) -> Result<Vec<u8>, ImageError> {
        let p = self.path(rel)?;
        let len = std::fs::metadata(&p).map(|m| m.len()).unwrap_or(0);
        if len > max {
            return Err(refused(
                &self.what,
                format!("{rel} is {len} bytes, over the limit of {max}"),
            ));
        }
        std::fs::read(&p).ctx(|| format!("reading {}", p.display()))
    }

    fn blob(&self, digest: &str) -> Result<PathBuf, ImageError> {
        let hex = check_digest(&self.what, digest)?;
        self.path(&format!("blobs/sha256/{hex}"))
    }
}

/// Unpacks a tar of an archive into `dir`: directories and regular files only, each
/// under `dir`; symlinks are recorded, not made.
fn untar_archive(tar_path: &Path, dir: &Path, what: &str) -> Result<Files, ImageError> {
    let f = std::fs::File::open(tar_path).ctx(|| format!("opening {}", tar_path.display()))?;
    let mut a = tar::Archive::new(std::io::BufReader::new(f));
    let mut links = HashMap::new();
    let bad = |m: String| refused(what, m);
    for ent in a
        .entries()
        .map_err(|e| bad(format!("not a tar archive: {e}")))?
    {
        let mut ent = ent.map_err(|e| bad(format!("the tar archive is damaged: {e}")))?;
        let raw = ent.path_bytes().into_owned();
        let Some(rel) = clean(Path::new(std::ffi::OsStr::from_bytes(&raw))) else {
            return Err(bad(format!(
                "entry {:?} leads outside the archive",
                String::from_utf8_lossy(&raw)
            )));
        };
        if rel.as_os_str().is_empty() {
            continue;
        }
        let dest = dir.join(&rel);
        match ent.header().entry_type() {
            tar::EntryType::Directory => {
                std::fs::create_dir_all(&dest).ctx(|| format!("creating {}", dest.display()))?
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                if let Some(parent) = dest.parent() {
                    std::fs::create_dir_all(parent)
                        .ctx(|| format!("creating {}", parent.display()))?;
                }
                // Parents are directories this made: nothing on the way is a link.
                let mut out = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&dest)
                    .map_err(|e| bad(format!("{}: {e}", rel.display())))?;
                std::io::copy(&mut ent, &mut out)
                    .map_err(|e| bad(format!("{}: {e}", rel.display())))?;
            }
            tar::EntryType::Symlink => {
                let target = ent
                    .link_name_bytes()
                    .ok_or_else(|| bad(format!("{} has no target", rel.display())))?;
                links.insert(rel, PathBuf::from(std::ffi::OsStr::from_bytes(&target)));
            }
            other => {
                return Err(bad(format!(
                    "{}: {other:?} entries have no place in an image archive",
                    rel.display()
                )));
            }
        }
    }
    Ok(Files {
        root: dir.to_path_buf(),
        links,
        what: what.to_string(),
    })
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct SaveEntry {
    config: String,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

/// A blob of the layout, read whole (a manifest, an index, a config), checked against
/// its digest.
fn doc_blob(files: &Files, d: &Descriptor, limits: &PullLimits) -> Result<Vec<u8>, ImageError> {
    let p = files.blob(&d.digest)?;
    let bytes = files.read(
        &p.strip_prefix(&files.root).unwrap_or(&p).to_string_lossy(),
        limits.max_document_bytes,
    )?;
    let got = hex::encode(Sha256::digest(&bytes));
    if format!("sha256:{got}") != d.digest {
        return Err(refused(
            &files.what,
            format!("blob {} holds sha256:{got}", d.digest),
        ));
    }
    Ok(bytes)
}

fn hash_file(p: &Path) -> Result<(String, u64), ImageError> {
    let mut f = std::fs::File::open(p).ctx(|| format!("opening {}", p.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f
            .read(&mut buf)
            .ctx(|| format!("reading {}", p.display()))?;
        if k == 0 {
            break;
        }
        n += k as u64;
        h.update(&buf[..k]);
    }
    Ok((format!("sha256:{}", hex::encode(h.finalize())), n))
}

/// What to unpack: each layer's file, media type, and the digest the file must have.
struct Plan {
    config: Vec<u8>,
    layers: Vec<(PathBuf, String, Option<String>)>,
    source: Option<String>,
    start: Option<StartCmd>,
}

fn plan_oci(files: &Files, limits: &PullLimits) -> Result<Plan, ImageError> {
    let what = files.what.clone();
    let index: Document =
        serde_json::from_slice(&files.read("index.json", limits.max_document_bytes)?)
            .map_err(|e| refused(&what, format!("index.json: {e}")))?;
    let list = index.manifests.unwrap_or_default();
    let amd64 = |d: &&Descriptor| {
        d.platform
            .as_ref()
            .is_none_or(|p| p.os == "linux" && p.architecture == "amd64")
    };
    let mut pick = match list.len() {
        0 => return Err(refused(&what, "index.json lists no image")),
        1 => &list[0],
        _ => list
            .iter()
            .find(amd64)
            .ok_or_else(|| refused(&what, "the layout holds no linux/amd64 image"))?,
    };
    let mut owned;
    let mut doc: Document;
    loop {
        let bytes = doc_blob(files, pick, limits)?;
        doc = serde_json::from_slice(&bytes)
            .map_err(|e| refused(&what, format!("{}: {e}", pick.digest)))?;
        match &doc.manifests {
            Some(inner) if pick.media_type == OCI_INDEX || doc.layers.is_none() => {
                owned = inner
                    .iter()
                    .filter(amd64)
                    .map(|d| Descriptor {
                        media_type: d.media_type.clone(),
                        digest: d.digest.clone(),
                        size: d.size,
                        platform: None,
                        annotations: d.annotations.clone(),
                        artifact_type: None,
                    })
                    .collect::<Vec<_>>();
                if owned.is_empty() {
                    return Err(refused(&what, "the index has no linux/amd64 image"));
                }
                owned.truncate(1);
                pick = &owned[0];
            }
            _ => break,
        }
    }
    let (Some(config), Some(layers)) = (doc.config, doc.layers) else {
        return Err(refused(&what, "the manifest has no config or no layers"));
    };
    if layers.len() > limits.max_layers {
        return Err(refused(
            &what,
            format!(
                "the image has {} layers, over the limit of {}",
                layers.len(),
                limits.max_layers
            ),
        ));
    }
    let cfg = doc_blob(files, &config, limits)?;
    let mut out = Vec::new();
    for l in &layers {
        out.push((
            files.blob(&l.digest)?,
            l.media_type.clone(),
            Some(l.digest.clone()),
        ));
    }
    Ok(Plan {
        config: cfg,
        layers: out,
        source: doc.annotations.get(SOURCE_ANNOTATION).cloned(),
        start: doc
            .annotations
            .get(START_ANNOTATION)
            .and_then(|s| serde_json::from_str(s).ok()),
    })
}

fn plan_docker_save(files: &Files, limits: &PullLimits) -> Result<Plan, ImageError> {
    let what = files.what.clone();
    let list: Vec<SaveEntry> =
        serde_json::from_slice(&files.read("manifest.json", limits.max_document_bytes)?)
            .map_err(|e| refused(&what, format!("manifest.json: {e}")))?;
    let Some(e) = list.into_iter().next() else {
        return Err(refused(&what, "manifest.json lists no image"));
    };
    let _ = e.repo_tags;
    if e.layers.len() > limits.max_layers {
        return Err(refused(
            &what,
            format!(
                "the image has {} layers, over the limit of {}",
                e.layers.len(),
                limits.max_layers
            ),
        ));
    }
    let config = files.read(&e.config, limits.max_document_bytes)?;
    // A config named by its digest (`<hex>.json`, `blobs/sha256/<hex>`) must hold it.
    let stem = Path::new(&e.config)
        .file_name()
        .map(|n| n.to_string_lossy().trim_end_matches(".json").to_string())
        .unwrap_or_default();
    if stem.len() == 64 && stem.bytes().all(|b| b.is_ascii_hexdigit()) {
        let got = hex::encode(Sha256::digest(&config));
        if got != stem {
            return Err(refused(
                &what,
                format!("config {} holds sha256:{got}", e.config),
            ));
        }
    }
    let mut out = Vec::new();
    for l in &e.layers {
        let p = files.path(l)?;
        out.push((p.clone(), sniff_media_type(&p)?.to_string(), None));
    }
    Ok(Plan {
        config,
        layers: out,
        source: None,
        start: None,
    })
}

/// Imports the image archive at `src` (a directory or a tar file) as `target`; `log`
/// gets a line per step. Returns the store's digest and manifest.
pub fn import(
    store: &ImageStore,
    src: &Path,
    target: &ImageRef,
    limits: &PullLimits,
    log: &mut dyn FnMut(String),
) -> Result<(String, Manifest), ImageError> {
    let what = src.display().to_string();
    let tmp = store.temp_dir("import")?;
    let r = import_in(store, src, target, limits, log, &tmp, &what);
    let _ = remove_tree(&tmp);
    r
}

fn import_in(
    store: &ImageStore,
    src: &Path,
    target: &ImageRef,
    limits: &PullLimits,
    log: &mut dyn FnMut(String),
    tmp: &Path,
    what: &str,
) -> Result<(String, Manifest), ImageError> {
    let md = std::fs::metadata(src).ctx(|| format!("reading {}", src.display()))?;
    let files = if md.is_dir() {
        Files {
            root: src.to_path_buf(),
            links: HashMap::new(),
            what: what.to_string(),
        }
    } else {
        log(format!("unpacking the archive {}", src.display()));
        let dir = tmp.join("archive");
        std::fs::create_dir(&dir).ctx(|| format!("creating {}", dir.display()))?;
        untar_archive(src, &dir, what)?
    };
    let plan = if files.path("index.json").is_ok() {
        plan_oci(&files, limits)?
    } else if files.path("manifest.json").is_ok() {
        plan_docker_save(&files, limits)?
    } else {
        return Err(refused(
            what,
            "neither an OCI image layout (index.json) nor a `docker save` archive (manifest.json)",
        ));
    };
    let cfg: ConfigFile = serde_json::from_slice(&plan.config)
        .map_err(|e| refused(what, format!("the image config: {e}")))?;
    let diff_ids: Vec<String> = cfg
        .rootfs
        .as_ref()
        .map(|r| r.diff_ids.clone())
        .unwrap_or_default();
    if diff_ids.len() != plan.layers.len() {
        return Err(refused(
            what,
            format!(
                "the config lists {} layers and the manifest {}",
                diff_ids.len(),
                plan.layers.len()
            ),
        ));
    }
    let mut layers = Vec::new();
    let mut size_bytes = 0;
    for (i, (blob, media, digest)) in plan.layers.iter().enumerate() {
        if let Some(d) = digest {
            let (got, _) = hash_file(blob)?;
            if &got != d {
                return Err(refused(what, format!("layer {d} holds {got}")));
            }
        }
        let dir = store.temp_dir("layer")?;
        let stats = match unpack_layer_checked(blob, media, &dir, limits.layer, Some(&diff_ids[i]))
        {
            Ok(s) => s,
            Err(e) => {
                let _ = remove_tree(&dir);
                return Err(match e {
                    ImageError::BadTree(m) | ImageError::Uncommittable(m) => {
                        refused(what, format!("layer {}: {m}", i + 1))
                    }
                    other => other,
                });
            }
        };
        let (d, size) = store.add_layer(&dir)?;
        log(format!(
            "layer {}/{}: {} entries ({:.1} MiB)",
            i + 1,
            plan.layers.len(),
            stats.entries,
            stats.bytes as f64 / (1 << 20) as f64
        ));
        size_bytes += size;
        layers.push(d);
    }
    let source = plan.source.unwrap_or_else(|| {
        format!(
            "import {}",
            src.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        )
    });
    let manifest = image_manifest(cfg, layers, size_bytes, source, plan.start);
    let digest = store.put_manifest(&manifest)?;
    store.tag(target, &digest)?;
    log(format!("{target} is {digest}"));
    Ok((digest, manifest))
}

/// A writer that hashes and counts what passes through it.
struct HashWriter<W> {
    inner: W,
    hasher: Sha256,
    n: u64,
}

impl<W: Write> Write for HashWriter<W> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let k = self.inner.write(b)?;
        self.hasher.update(&b[..k]);
        self.n += k as u64;
        Ok(k)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn xattrs_of(p: &Path) -> Result<BTreeMap<String, Vec<u8>>, ImageError> {
    dsec_common::tree::read_xattrs(p).map_err(|e| ImageError::Io {
        context: format!("reading the attributes of {}", p.display()),
        source: std::io::Error::other(e),
    })
}

/// `dir`'s names, sorted by their bytes.
fn sorted_names(dir: &Path) -> Result<Vec<std::ffi::OsString>, ImageError> {
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .ctx(|| format!("listing {}", dir.display()))?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()
        .ctx(|| format!("listing {}", dir.display()))?;
    names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    Ok(names)
}

/// Appends every entry under `root`, depth first and sorted by name, to `b`. A loop with
/// a stack of its own rather than recursion: a layer may be deeper than a thread's stack.
fn add_tree<W: Write>(b: &mut tar::Builder<W>, root: &Path) -> Result<(), ImageError> {
    let mut seen: HashMap<(u64, u64), PathBuf> = HashMap::new();
    let mut stack: Vec<(PathBuf, std::vec::IntoIter<std::ffi::OsString>)> =
        vec![(PathBuf::new(), sorted_names(root)?.into_iter())];
    while let Some((rel, names)) = stack.last_mut() {
        let Some(name) = names.next() else {
            stack.pop();
            continue;
        };
        let rel = rel.clone();
        let r = rel.join(&name);
        let p = root.join(&r);
        let m = std::fs::symlink_metadata(&p).ctx(|| format!("reading {}", p.display()))?;
        let ft = m.file_type();
        let mut h = tar::Header::new_gnu();
        h.set_mode(m.mode() & 0o7777);
        h.set_uid(m.uid() as u64);
        h.set_gid(m.gid() as u64);
        h.set_mtime(m.mtime().max(0) as u64);
        let mut xattrs = xattrs_of(&p)?;
        let opaque = xattrs
            .remove(dsec_common::tree::OPAQUE_XATTR)
            .is_some_and(|v| v == b"y");
        if !xattrs.is_empty() && !ft.is_symlink() {
            let pax: Vec<(String, Vec<u8>)> = xattrs
                .into_iter()
                .map(|(k, v)| (format!("SCHILY.xattr.{k}"), v))
                .collect();
            b.append_pax_extensions(pax.iter().map(|(k, v)| (k.as_str(), v.as_slice())))
                .ctx(|| "writing a layer".to_string())?;
        }
        let io = |e: std::io::Error| ImageError::Io {
            context: format!("adding {} to a layer", r.display()),
            source: e,
        };
        if ft.is_dir() {
            h.set_entry_type(tar::EntryType::Directory);
            h.set_size(0);
            b.append_data(&mut h, &r, std::io::empty()).map_err(io)?;
            if opaque {
                let mut w = tar::Header::new_gnu();
                w.set_mode(0o644);
                w.set_size(0);
                w.set_entry_type(tar::EntryType::Regular);
                b.append_data(&mut w, r.join(".wh..wh..opq"), std::io::empty())
                    .map_err(io)?;
            }
            let children = sorted_names(&p)?;
            stack.push((r, children.into_iter()));
        } else if ft.is_file() {
            if m.nlink() > 1 {
                if let Some(first) = seen.get(&(m.dev(), m.ino())) {
                    h.set_entry_type(tar::EntryType::Link);
                    h.set_size(0);
                    b.append_link(&mut h, &r, first).map_err(io)?;
                    continue;
                }
                seen.insert((m.dev(), m.ino()), r.clone());
            }
            h.set_entry_type(tar::EntryType::Regular);
            h.set_size(m.len());
            let f = std::fs::File::open(&p).map_err(io)?;
            b.append_data(&mut h, &r, f).map_err(io)?;
        } else if ft.is_symlink() {
            let target = std::fs::read_link(&p).map_err(io)?;
            h.set_entry_type(tar::EntryType::Symlink);
            h.set_size(0);
            b.append_link(&mut h, &r, target).map_err(io)?;
        } else if ft.is_char_device() && m.rdev() == 0 {
            // An overlayfs whiteout: OCI's `.wh.<name>`.
            let mut w = tar::Header::new_gnu();
            w.set_mode(0o644);
            w.set_size(0);
            w.set_entry_type(tar::EntryType::Regular);
            let mut wname = std::ffi::OsString::from(".wh.");
            wname.push(&name);
            b.append_data(&mut w, rel.join(wname), std::io::empty())
                .map_err(io)?;
        } else if ft.is_fifo() {
            h.set_entry_type(tar::EntryType::Fifo);
            h.set_size(0);
            b.append_data(&mut h, &r, std::io::empty()).map_err(io)?;
        }
        // Other devices and sockets are never in a layer.
    }
    Ok(())
}

/// Writes layer `digest` of the store as a gzip tar blob under `blobs`; returns its
/// descriptor and the uncompressed tar's digest.
fn export_layer(
    store: &ImageStore,
    digest: &str,
    blobs: &Path,
) -> Result<(serde_json::Value, String), ImageError> {
    let tmp = blobs.join(format!(".layer-{digest}"));
    let file = std::fs::File::create(&tmp).ctx(|| format!("creating {}", tmp.display()))?;
    let outer = HashWriter {
        inner: std::io::BufWriter::new(file),
        hasher: Sha256::new(),
        n: 0,
    };
    let gz = flate2::write::GzEncoder::new(outer, flate2::Compression::default());
    let inner = HashWriter {
        inner: gz,
        hasher: Sha256::new(),
        n: 0,
    };
    let mut b = tar::Builder::new(inner);
    b.mode(tar::HeaderMode::Complete);
    b.follow_symlinks(false);
    add_tree(&mut b, &store.layer_path(digest))?;
    let inner = b.into_inner().ctx(|| "finishing a layer".to_string())?;
    let diff_id = format!("sha256:{}", hex::encode(inner.hasher.finalize()));
    let mut outer = inner
        .inner
        .finish()
        .ctx(|| "finishing a layer".to_string())?;
    outer.flush().ctx(|| "writing a layer".to_string())?;
    let hexd = hex::encode(outer.hasher.finalize());
    let size = outer.n;
    std::fs::rename(&tmp, blobs.join(&hexd)).ctx(|| "naming a layer blob".to_string())?;
    Ok((
        json!({"mediaType": OCI_LAYER_GZIP, "digest": format!("sha256:{hexd}"), "size": size}),
        diff_id,
    ))
}

fn put_blob(blobs: &Path, bytes: &[u8], media_type: &str) -> Result<serde_json::Value, ImageError> {
    let hexd = hex::encode(Sha256::digest(bytes));
    let p = blobs.join(&hexd);
    std::fs::write(&p, bytes).ctx(|| format!("writing {}", p.display()))?;
    Ok(json!({"mediaType": media_type, "digest": format!("sha256:{hexd}"), "size": bytes.len()}))
}

use dsec_common::rfc3339;

/// Writes image `r` as an OCI image layout in `dest` (made; it must not exist or be
/// empty). Returns the manifest's digest.
pub fn export(
    store: &ImageStore,
    r: &ImageRef,
    dest: &Path,
    log: &mut dyn FnMut(String),
) -> Result<String, ImageError> {
    export_as(store, r, dest, log, true)
}

/// [`export`]; without `with_source` the store's `source` (which may name a sandbox of
/// another project, for a commit) is left out of the manifest, as for a push.
pub fn export_as(
    store: &ImageStore,
    r: &ImageRef,
    dest: &Path,
    log: &mut dyn FnMut(String),
    with_source: bool,
) -> Result<String, ImageError> {
    let (_, m) = store.resolve(r)?;
    if dest.exists()
        && std::fs::read_dir(dest)
            .map(|mut d| d.next().is_some())
            .unwrap_or(true)
    {
        return Err(ImageError::AlreadyExists(format!(
            "{} (export writes into a new or empty directory)",
            dest.display()
        )));
    }
    let blobs = dest.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).ctx(|| format!("creating {}", blobs.display()))?;
    let mut layers = Vec::new();
    let mut diff_ids = Vec::new();
    for (i, l) in m.layers.iter().enumerate() {
        let (desc, diff_id) = export_layer(store, l, &blobs)?;
        log(format!(
            "layer {}/{}: {}",
            i + 1,
            m.layers.len(),
            desc["digest"].as_str().unwrap_or("")
        ));
        layers.push(desc);
        diff_ids.push(diff_id);
    }
    let mut config = json!({
        "created": rfc3339(m.created_ms),
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": m.env.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>(),
        },
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    });
    if let Some(w) = &m.workdir {
        config["config"]["WorkingDir"] = w.clone().into();
    }
    let cdesc = put_blob(
        &blobs,
        &serde_json::to_vec(&config).unwrap_or_default(),
        OCI_CONFIG,
    )?;
    let mut annotations = json!({});
    if with_source {
        annotations[SOURCE_ANNOTATION] = m.source.clone().into();
    }
    if let Some(s) = &m.start {
        annotations[START_ANNOTATION] = serde_json::to_string(s).unwrap_or_default().into();
    }
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": cdesc,
        "layers": layers,
        "annotations": annotations,
    });
    let mut mdesc = put_blob(
        &blobs,
        &serde_json::to_vec(&manifest).unwrap_or_default(),
        OCI_MANIFEST,
    )?;
    mdesc["annotations"] = json!({ REF_NAME: r.tag });
    std::fs::write(
        dest.join("index.json"),
        serde_json::to_vec(
            &json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [mdesc]}),
        )
        .unwrap_or_default(),
    )
    .ctx(|| "writing index.json".to_string())?;
    std::fs::write(
        dest.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .ctx(|| "writing oci-layout".to_string())?;
    let digest = mdesc["digest"].as_str().unwrap_or_default().to_string();
    log(format!("{r} written to {} as {digest}", dest.display()));
    Ok(digest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_round_trip_through_rfc3339() {
        for ms in [0, 1_700_000_000_123, 951_782_400_000, 4_102_444_799_999] {
            assert_eq!(crate::pull::rfc3339_ms(&rfc3339(ms)), Some(ms), "{ms}");
        }
        assert_eq!(rfc3339(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
    }

    /// A store image with every kind of entry a layer holds, exported and imported into
    /// another store: the same digest, the same trees.
    #[test]
    fn export_then_import_gives_the_same_image() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        let a = ImageStore::open(t.path().join("a")).unwrap();
        let mk = |files: &dyn Fn(&Path)| {
            let d = a.temp_dir("t").unwrap();
            files(&d);
            a.add_layer(&d).unwrap()
        };
        let (l1, s1) = mk(&|d| {
            std::fs::create_dir_all(d.join("etc/cache")).unwrap();
            std::fs::write(d.join("etc/name"), b"one\n").unwrap();
            std::fs::write(d.join("etc/cache/old"), b"old").unwrap();
            std::fs::write(d.join("etc/gone"), b"x").unwrap();
            std::fs::set_permissions(d.join("etc/name"), std::fs::Permissions::from_mode(0o4755))
                .unwrap();
        });
        let (l2, s2) = mk(&|d| {
            std::fs::create_dir_all(d.join("etc/cache")).unwrap();
            std::fs::write(d.join("etc/cache/new"), b"new").unwrap();
            std::fs::hard_link(d.join("etc/cache/new"), d.join("etc/again")).unwrap();
            std::os::unix::fs::symlink("/etc/name", d.join("etc/link")).unwrap();
            let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
            // SAFETY: NUL-terminated paths and names, values with their lengths.
            unsafe {
                assert_eq!(
                    libc::mknod(c(&d.join("etc/gone")).as_ptr(), libc::S_IFCHR, 0),
                    0
                );
                let (n, v) = (c(Path::new(dsec_common::tree::OPAQUE_XATTR)), b"y");
                assert_eq!(
                    libc::lsetxattr(
                        c(&d.join("etc/cache")).as_ptr(),
                        n.as_ptr(),
                        v.as_ptr().cast(),
                        1,
                        0
                    ),
                    0
                );
                let (n, v) = (c(Path::new("user.note")), b"kept");
                assert_eq!(
                    libc::lsetxattr(
                        c(&d.join("etc/cache/new")).as_ptr(),
                        n.as_ptr(),
                        v.as_ptr().cast(),
                        4,
                        0
                    ),
                    0
                );
            }
        });
        let m = Manifest {
            schema_version: 1,
            layers: vec![l1.clone(), l2.clone()],
            env: BTreeMap::from([("FOO".into(), "bar baz".into())]),
            workdir: Some("/etc".into()),
            start: Some(StartCmd {
                run: "sleep 1".into(),
                ready: Some("true".into()),
                ready_timeout_seconds: None,
            }),
            created_ms: 1_700_000_000_123,
            size_bytes: s1 + s2,
            source: "build images/x.toml".into(),
        };
        let digest = a.put_manifest(&m).unwrap();
        let name = ImageRef::parse("root/x:v1").unwrap();
        a.tag(&name, &digest).unwrap();
        let out = t.path().join("layout");
        let oci = export(&a, &name, &out, &mut |_| {}).unwrap();
        assert!(
            export(&a, &name, &out, &mut |_| {}).is_err(),
            "into a full directory"
        );
        let b = ImageStore::open(t.path().join("b")).unwrap();
        let other = ImageRef::parse("root/y:v2").unwrap();
        let (d2, m2) = import(&b, &out, &other, &PullLimits::default(), &mut |_| {}).unwrap();
        assert_eq!(m2, m);
        assert_eq!(d2, digest);
        // And out again: the same layout digest.
        let out2 = t.path().join("layout2");
        assert_eq!(export(&b, &other, &out2, &mut |_| {}).unwrap(), oci);
        // A tar of the layout imports the same.
        let tarball = t.path().join("layout.tar");
        let st = std::process::Command::new("tar")
            .args(["-cf"])
            .arg(&tarball)
            .arg("-C")
            .arg(&out)
            .arg(".")
            .status()
            .unwrap();
        assert!(st.success());
        let (d3, _) = import(&b, &tarball, &other, &PullLimits::default(), &mut |_| {}).unwrap();
        assert_eq!(d3, digest);
        // A changed byte in a layer blob is refused.
        let idx: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("index.json")).unwrap()).unwrap();
        let mhex = idx["manifests"][0]["digest"]
            .as_str()
            .unwrap()
            .trim_start_matches("sha256:")
            .to_string();
        let man: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("blobs/sha256").join(&mhex)).unwrap())
                .unwrap();
        let lhex = man["layers"][1]["digest"]
            .as_str()
            .unwrap()
            .trim_start_matches("sha256:")
            .to_string();
        let lp = out.join("blobs/sha256").join(lhex);
        let mut bytes = std::fs::read(&lp).unwrap();
        let n = bytes.len();
        bytes[n / 2] ^= 1;
        std::fs::write(&lp, bytes).unwrap();
        let e = import(
            &b,
            &out,
            &ImageRef::parse("root/z:v1").unwrap(),
            &PullLimits::default(),
            &mut |_| {},
        )
        .unwrap_err();
        assert!(e.to_string().contains("holds sha256:"), "{e}");
        assert!(b.resolve(&ImageRef::parse("root/z:v1").unwrap()).is_err());
    }

    /// Arbitrary bytes as an archive file, and as an index.json or manifest.json in a
    /// layout: an error or an image, never a panic, nothing written outside the store.
    #[test]
    fn fuzz_archives() {
        let t = tempfile::tempdir().unwrap();
        let store = ImageStore::open(t.path().join("store")).unwrap();
        let target = ImageRef::parse("root/fuzz:v1").unwrap();
        let mut n = 0;
        bolero::check!()
            .with_iterations(200)
            .for_each(|input: &[u8]| {
                n += 1;
                let dir = t.path().join(format!("in{n}"));
                std::fs::create_dir(&dir).unwrap();
                let file = dir.join("archive.tar");
                std::fs::write(&file, input).unwrap();
                let _ = import(&store, &file, &target, &PullLimits::default(), &mut |_| {});
                for name in ["index.json", "manifest.json"] {
                    let layout = dir.join(format!("layout-{name}"));
                    std::fs::create_dir(&layout).unwrap();
                    std::fs::write(layout.join(name), input).unwrap();
                    let _ = import(
                        &store,
                        &layout,
                        &target,
                        &PullLimits::default(),
                        &mut |_| {},
                    );
                }
                std::fs::remove_dir_all(&dir).unwrap();
                let top: Vec<_> = std::fs::read_dir(t.path())
                    .unwrap()
                    .map(|e| e.unwrap().file_name().into_string().unwrap())
                    .collect();
                assert_eq!(top, ["store"], "{top:?}");
                assert_eq!(
                    std::fs::read_dir(store.root().join("tmp")).unwrap().count(),
                    0
                );
            });
    }

    /// A layer 1,500 directories deep exports on a thread with a small stack: the walk
    /// keeps its own stack.
    #[test]
    fn a_deep_layer_exports_without_recursion() {
        let t = tempfile::tempdir().unwrap();
        let a = ImageStore::open(t.path().join("a")).unwrap();
        let d = a.temp_dir("deep").unwrap();
        let deep = d.join("d/".repeat(1500));
        std::fs::create_dir_all(&deep).unwrap();
        std::fs::write(deep.join("f"), b"bottom").unwrap();
        let (l, size) = a.add_layer(&d).unwrap();
        let m = Manifest {
            schema_version: 1,
            layers: vec![l],
            env: BTreeMap::new(),
            workdir: None,
            start: None,
            created_ms: 0,
            size_bytes: size,
            source: "test".into(),
        };
        let name = ImageRef::parse("root/deep:v1").unwrap();
        a.tag(&name, &a.put_manifest(&m).unwrap()).unwrap();
        let out = t.path().join("layout");
        let (a2, n2, o2) = (a.clone(), name.clone(), out.clone());
        std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(move || export(&a2, &n2, &o2, &mut |_| {}).unwrap())
            .unwrap()
            .join()
            .unwrap();
        assert!(out.join("index.json").is_file());
    }

    #[test]
    fn archive_paths_never_leave_the_archive() {
        let t = tempfile::tempdir().unwrap();
        std::fs::write(t.path().join("real"), b"x").unwrap();
        let files = Files {
            root: t.path().to_path_buf(),
            links: HashMap::from([
                (PathBuf::from("a/up"), PathBuf::from("../../etc/passwd")),
                (PathBuf::from("a/ok"), PathBuf::from("../real")),
                (PathBuf::from("loop"), PathBuf::from("loop")),
            ]),
            what: "t".into(),
        };
        assert_eq!(files.path("a/ok").unwrap(), t.path().join("real"));
        for bad in ["a/up", "../x", "/etc/passwd", "loop", "missing"] {
            assert!(files.path(bad).is_err(), "{bad}");
        }
        assert!(files.blob("sha256:../../x").is_err());
    }
}
