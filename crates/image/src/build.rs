//! `dsec image build`: a base from Debian packages (mmdebstrap) or an existing image,
//! then steps (`run`, `file`, `env`). Each `run` or `file` step becomes one layer.
//!
//! A `run` step executes the image's own programs, which anyone who could write a parent
//! image may have planted: it never runs on the host. A [`StepRunner`] runs it in a
//! sandbox (the edge's runs a container-backend sandbox with the node's limits, seccomp
//! and egress rules) and hands back the changes; without one, a spec with `run` steps is
//! refused.
//!
//! ```toml
//! name = "root/py:3.11"
//! [debian]
//! suite = "bookworm"
//! packages = ["python3"]
//! [[step]]
//! run = "python3 -m compileall -q /usr/lib/python3.11"
//! [[step]]
//! file = "/etc/motd"
//! content = "hello\n"
//! ```

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};

use crate::store::{Manifest, StartCmd, now_ms, remove_tree};
use crate::{ImageError, ImageRef, ImageStore, IoContext};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BuildSpec {
    pub name: String,
    /// Start from an image already in the store.
    #[serde(default)]
    pub from: Option<String>,
    /// Start from a Debian root filesystem made by mmdebstrap.
    #[serde(default)]
    pub debian: Option<DebianBase>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub workdir: Option<String>,
    /// `[start] run = "…", ready = "…"`: started in every new sandbox (inherited from
    /// `from` unless set).
    #[serde(default)]
    pub start: Option<StartCmd>,
    #[serde(default, rename = "step")]
    pub steps: Vec<Step>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DebianBase {
    #[serde(default = "default_suite")]
    pub suite: String,
    #[serde(default = "default_variant")]
    pub variant: String,
    #[serde(default)]
    pub packages: Vec<String>,
    #[serde(default)]
    pub mirror: Option<String>,
}

fn default_suite() -> String {
    "bookworm".into()
}
fn default_variant() -> String {
    "minbase".into()
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// The file's content from a file next to the spec (a relative path below the spec's
    /// directory); [`BuildSpec::load`] reads it into `content`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub src: Option<String>,
    /// With `file`: a file or directory tree on the building machine (an absolute path),
    /// copied to `file` as it is (modes and symlinks kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy_from: Option<String>,
    /// Octal, e.g. "0755".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<BTreeMap<String, String>>,
}

fn valid_package(p: &str) -> bool {
    !p.is_empty()
        && p.len() <= 128
        && p.as_bytes()[0].is_ascii_alphanumeric()
        && p.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+-.:=~".contains(&b))
}

/// A path inside the image: absolute, normal components only.
fn image_path(p: &str) -> Result<std::path::PathBuf, ImageError> {
    let path = Path::new(p);
    if !path.is_absolute()
        || path
            .components()
            .skip(1)
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return Err(ImageError::Build(format!(
            "file path {p:?} must be absolute and must not contain '..' or '.'"
        )));
    }
    Ok(path.components().skip(1).collect())
}

impl BuildSpec {
    /// Reads a spec file; `src` of file steps is read relative to its directory.
    pub fn load(path: &Path) -> Result<BuildSpec, ImageError> {
        let text = std::fs::read_to_string(path).ctx(|| format!("reading {}", path.display()))?;
        let mut spec = BuildSpec::parse(&text)?;
        let dir = path.parent().unwrap_or(Path::new("."));
        for (i, s) in spec.steps.iter_mut().enumerate() {
            let Some(src) = s.src.take() else { continue };
            let rel = Path::new(&src);
            if rel.is_absolute()
                || rel
                    .components()
                    .any(|c| !matches!(c, std::path::Component::Normal(_)))
            {
                return Err(ImageError::Build(format!(
                    "step {}: src {src:?} must be a relative path below the spec's directory",
                    i + 1
                )));
            }
            let file = dir.join(rel);
            s.content =
                Some(std::fs::read_to_string(&file).ctx(|| format!("reading {}", file.display()))?);
        }
        Ok(spec)
    }

    pub fn parse(text: &str) -> Result<BuildSpec, ImageError> {
        let spec: BuildSpec = toml::from_str(text)
            .map_err(|e| ImageError::Build(format!("image spec is not valid: {e}")))?;
        spec.validate()?;
        Ok(spec)
    }

    pub fn validate(&self) -> Result<(), ImageError> {
        ImageRef::parse(&self.name)?;
        match (&self.from, &self.debian) {
            // A registry's image is pulled (as `<project>/from-…:base`) by the node that
            // builds, before the build starts.
            (Some(f), None) if crate::pull::is_registry_reference(f) => {
                f.parse::<oci_client::Reference>().map_err(|e| {
                    ImageError::BadReference(format!(
                        "from = {f:?}: not an image of this store (root/…) nor of a registry ({e})"
                    ))
                })?;
            }
            (Some(f), None) => {
                ImageRef::parse(f)?;
            }
            (None, Some(d)) => {
                if let Some(p) = d.packages.iter().find(|p| !valid_package(p)) {
                    return Err(ImageError::Build(format!(
                        "{p:?} is not a Debian package name"
                    )));
                }
                if !d.suite.bytes().all(|b| b.is_ascii_lowercase() || b == b'-') {
                    return Err(ImageError::Build(format!(
                        "{:?} is not a Debian suite",
                        d.suite
                    )));
                }
                if ![
                    "extract",
                    "custom",
                    "essential",
                    "apt",
                    "required",
                    "minbase",
                    "buildd",
                    "important",
                    "debootstrap",
                    "standard",
                ]
                .contains(&d.variant.as_str())
                {
                    return Err(ImageError::Build(format!(
                        "{:?} is not an mmdebstrap variant",
                        d.variant
                    )));
                }
            }
            _ => {
                return Err(ImageError::Build(
                    "an image spec needs exactly one base: `from = \"ns/name:tag\"` or a [debian] table".into(),
                ));
            }
        }
        if let Some(s) = &self.start
            && (s.run.trim().is_empty() || s.ready.as_ref().is_some_and(|r| r.trim().is_empty()))
        {
            return Err(ImageError::Build(
                "[start] needs a non-empty `run` (and `ready`, if given)".into(),
            ));
        }
        for (i, s) in self.steps.iter().enumerate() {
            let kinds = [s.run.is_some(), s.file.is_some(), s.env.is_some()]
                .iter()
                .filter(|x| **x)
                .count();
            if kinds != 1 {
                return Err(ImageError::Build(format!(
                    "step {} must have exactly one of `run`, `file` or `env`",
                    i + 1
                )));
            }
            if let Some(c) = &s.copy_from
                && (s.file.is_none()
                    || s.content.is_some()
                    || s.src.is_some()
                    || !c.starts_with('/'))
            {
                return Err(ImageError::Build(format!(
                    "step {}: `copy_from` (an absolute path on this machine) goes with `file`, instead of `content` or `src`",
                    i + 1
                )));
            }
            if s.src.is_some() && (s.file.is_none() || s.content.is_some()) {
                return Err(ImageError::Build(format!(
                    "step {}: `src` goes with `file`, instead of `content`",
                    i + 1
                )));
            }
            if let Some(f) = &s.file {
                image_path(f)?;
                if let Some(m) = &s.mode {
                    u32::from_str_radix(m, 8).map_err(|_| {
                        ImageError::Build(format!("step {}: mode {m:?} is not octal", i + 1))
                    })?;
                }
            }
        }
        Ok(())
    }
}

/// A `run` step: `sh -c cmd` (with `env`, in `workdir`) on the image made of `layers`
/// (bottom first).
pub struct RunStep<'a> {
    pub layers: &'a [String],
    pub env: &'a BTreeMap<String, String>,
    pub workdir: Option<&'a str>,
    pub cmd: &'a str,
}

/// Runs a build's `run` steps somewhere other than the host.
pub trait StepRunner {
    /// Runs `step` and leaves its changes to the filesystem in overlayfs form (whiteouts
    /// and opaque directories) in `upper`, an empty directory.
    fn run(
        &self,
        step: &RunStep<'_>,
        upper: &Path,
        progress: &mut dyn FnMut(&str),
    ) -> Result<(), ImageError>;

    /// Called once the image's layers are in the store, before its name points at it:
    /// `added` bytes of layers over its base. An error stops the build (the name keeps
    /// what it had).
    fn before_tag(&self, _added: u64) -> Result<(), ImageError> {
        Ok(())
    }
}

impl BuildSpec {
    /// Whether building needs a [`StepRunner`].
    pub fn has_run_steps(&self) -> bool {
        self.steps.iter().any(|s| s.run.is_some())
    }
}

/// Builds `spec` into `store`, calling `progress` with one line at a time; `run` steps go
/// to `runner`.
pub fn build(
    store: &ImageStore,
    spec: &BuildSpec,
    runner: Option<&dyn StepRunner>,
    progress: &mut dyn FnMut(&str),
) -> Result<String, ImageError> {
    spec.validate()?;
    if spec.has_run_steps() && runner.is_none() {
        return Err(ImageError::Build(
            "`run` steps execute in a sandbox of a running node, never on the host: start `dsec up` and build there (`dsec image build` sends a spec with `run` steps to the node of its --data-dir)".into(),
        ));
    }
    let name = ImageRef::parse(&spec.name)?;
    let (mut layers, mut env, mut workdir, mut start, mut size, mut source) = match &spec.from {
        Some(f) => {
            let r = ImageRef::parse(f)?;
            let (_, m) = store.resolve(&r)?;
            (
                m.layers,
                m.env,
                m.workdir,
                m.start,
                m.size_bytes,
                format!("from {r}"),
            )
        }
        None => (Vec::new(), BTreeMap::new(), None, None, 0, String::new()),
    };
    let base_size = size;
    if spec.start.is_some() {
        start = spec.start.clone();
    }
    if let Some(d) = &spec.debian {
        progress(&format!(
            "mmdebstrap {} ({}) with {}",
            d.suite,
            d.variant,
            if d.packages.is_empty() {
                "no extra packages".to_string()
            } else {
                d.packages.join(", ")
            }
        ));
        let (digest, sz) = debian_layer(store, d, progress)?;
        progress(&format!("layer {} ({} MiB)", &digest[..12], sz >> 20));
        layers.push(digest);
        size += sz;
        source = format!(
            "debian {} {} +[{}]",
            d.suite,
            d.variant,
            d.packages.join(",")
        );
    }
    env.extend(spec.env.clone());
    if spec.workdir.is_some() {
        workdir = spec.workdir.clone();
    }
    for (i, step) in spec.steps.iter().enumerate() {
        let n = i + 1;
        if let Some(e) = &step.env {
            progress(&format!(
                "step {n}: env {}",
                e.keys().cloned().collect::<Vec<_>>().join(" ")
            ));
            env.extend(e.clone());
            continue;
        }
        let dir = store.temp_dir("layer")?;
        if let Some(cmd) = &step.run {
            progress(&format!("step {n}: run {cmd}"));
            let upper = dir.join("upper");
            std::fs::create_dir_all(&upper).ctx(|| format!("creating {}", upper.display()))?;
            if let Some(r) = runner {
                let step = RunStep {
                    layers: &layers,
                    env: &env,
                    workdir: workdir.as_deref(),
                    cmd,
                };
                r.run(&step, &upper, progress)?;
            }
        } else if let Some(f) = &step.file {
            progress(&format!("step {n}: file {f}"));
            let rel = image_path(f)?;
            let dest = dir.join("upper").join(rel);
            if let Some(parent) = dest.parent() {
                std::fs::create_dir_all(parent).ctx(|| format!("creating {}", parent.display()))?;
            }
            match &step.copy_from {
                Some(from) => copy_in(Path::new(from), &dest)?,
                None => {
                    std::fs::write(&dest, step.content.as_deref().unwrap_or(""))
                        .ctx(|| format!("writing {}", dest.display()))?;
                    let mode = step
                        .mode
                        .as_deref()
                        .and_then(|m| u32::from_str_radix(m, 8).ok())
                        .unwrap_or(0o644);
                    use std::os::unix::fs::PermissionsExt;
                    std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(mode))
                        .ctx(|| format!("chmod {}", dest.display()))?;
                }
            }
        }
        let upper = dir.join("upper");
        let (digest, sz) = store.add_layer(&upper)?;
        remove_tree(&dir)?;
        progress(&format!("layer {} ({} KiB)", &digest[..12], sz >> 10));
        layers.push(digest);
        size += sz;
    }
    if !spec.steps.is_empty() {
        source.push_str(&format!("; {} steps", spec.steps.len()));
    }
    let manifest = Manifest {
        schema_version: 1,
        layers,
        env,
        workdir,
        start,
        created_ms: now_ms(),
        size_bytes: size,
        source,
    };
    if let Some(r) = runner {
        r.before_tag(manifest.size_bytes.saturating_sub(base_size))?;
    }
    let digest = store.put_manifest(&manifest)?;
    store.tag(&name, &digest)?;
    progress(&format!("tagged {name} -> {}", &digest[..12]));
    Ok(digest)
}

/// Copies a file or a directory's contents to `dest` as they are (`cp -a`: modes,
/// symlinks, times).
fn copy_in(from: &Path, dest: &Path) -> Result<(), ImageError> {
    let meta = std::fs::symlink_metadata(from).ctx(|| format!("reading {}", from.display()))?;
    let mut cmd = Command::new("cp");
    cmd.arg("-a");
    if meta.is_dir() {
        std::fs::create_dir_all(dest).ctx(|| format!("creating {}", dest.display()))?;
        cmd.arg(format!("{}/.", from.display())).arg(dest);
    } else {
        cmd.arg(from).arg(dest);
    }
    let out = cmd.output().ctx(|| "running cp".to_string())?;
    if !out.status.success() {
        return Err(ImageError::Build(format!(
            "copying {} in: {}",
            from.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Runs a child and forwards each line of its combined output to `progress`.
pub(crate) fn run_logged(
    cmd: &mut Command,
    what: &str,
    progress: &mut dyn FnMut(&str),
) -> Result<(), ImageError> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().ctx(|| format!("starting {what}"))?;
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let forward = |r: Option<Box<dyn std::io::Read + Send>>,
                   tx: std::sync::mpsc::Sender<String>| {
        std::thread::spawn(move || {
            if let Some(r) = r {
                for line in BufReader::new(r).lines().map_while(Result::ok) {
                    let _ = tx.send(line);
                }
            }
        })
    };
    let t_out = forward(child.stdout.take().map(|o| Box::new(o) as _), tx.clone());
    let t_err = forward(child.stderr.take().map(|e| Box::new(e) as _), tx);
    let mut tail: Vec<String> = Vec::new();
    for line in rx {
        progress(&line);
        tail.push(line);
        if tail.len() > 20 {
            tail.remove(0);
        }
    }
    let _ = t_out.join();
    let _ = t_err.join();
    let status = child.wait().ctx(|| format!("waiting for {what}"))?;
    if !status.success() {
        return Err(ImageError::Build(format!(
            "{what} failed ({status}); last output:\n{}",
            tail.join("\n")
        )));
    }
    Ok(())
}

fn debian_layer(
    store: &ImageStore,
    d: &DebianBase,
    progress: &mut dyn FnMut(&str),
) -> Result<(String, u64), ImageError> {
    let dir = store.temp_dir("debian")?;
    let rootfs = dir.join("rootfs");
    let mut cmd = Command::new("mmdebstrap");
    cmd.arg(format!("--variant={}", d.variant))
        .arg("--aptopt=APT::Install-Recommends \"false\"")
        .arg("--dpkgopt=path-exclude=/usr/share/man/*")
        .arg("--dpkgopt=path-exclude=/usr/share/doc/*")
        .arg("--dpkgopt=path-include=/usr/share/doc/*/copyright")
        .arg("--dpkgopt=path-exclude=/usr/share/locale/*")
        .arg("--dpkgopt=path-exclude=/usr/share/info/*");
    if !d.packages.is_empty() {
        cmd.arg(format!("--include={}", d.packages.join(",")));
    }
    cmd.arg(&d.suite).arg(&rootfs);
    if let Some(m) = &d.mirror {
        cmd.arg(m);
    }
    let r = run_logged(&mut cmd, "mmdebstrap", progress);
    if let Err(e) = r {
        let _ = remove_tree(&dir);
        return Err(e);
    }
    // Sandboxes get their resolver from the edge; don't bake the build host's into images.
    let _ = std::fs::remove_file(rootfs.join("etc/resolv.conf"));
    let _ = std::fs::write(rootfs.join("etc/hostname"), "sandbox\n");
    let out = store.add_layer(&rootfs);
    let _ = remove_tree(&dir);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_commands_and_file_sources() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("srv")).unwrap();
        std::fs::write(d.path().join("srv/s.py"), "print(1)\n").unwrap();
        let spec = d.path().join("i.toml");
        std::fs::write(
            &spec,
            "name = \"root/x:1\"\nfrom = \"root/b:1\"\n[start]\nrun = \"python3 /s.py\"\nready = \"true\"\n[[step]]\nfile = \"/s.py\"\nsrc = \"srv/s.py\"\n",
        )
        .unwrap();
        let s = BuildSpec::load(&spec).unwrap();
        assert_eq!(s.steps[0].content.as_deref(), Some("print(1)\n"));
        assert_eq!(s.start.unwrap().ready.as_deref(), Some("true"));
        for bad in ["../s.py", "/etc/passwd", "srv/../../x"] {
            std::fs::write(
                &spec,
                format!("name = \"root/x:1\"\nfrom = \"root/b:1\"\n[[step]]\nfile = \"/s\"\nsrc = \"{bad}\"\n"),
            )
            .unwrap();
            let e = BuildSpec::load(&spec).unwrap_err().to_string();
            assert!(e.contains("below the spec's directory"), "{bad}: {e}");
        }
        let err = |t: &str| BuildSpec::parse(t).unwrap_err().to_string();
        assert!(
            err("name = \"root/x\"\nfrom = \"root/b\"\n[start]\nrun = \" \"\n").contains("[start]")
        );
        assert!(
            err("name = \"root/x\"\nfrom = \"root/b\"\n[[step]]\nrun = \"a\"\nsrc = \"b\"\n")
                .contains("`src` goes with `file`")
        );
    }

    #[test]
    fn spec_validation_says_what_is_wrong() {
        let ok = BuildSpec::parse(
            "name = \"root/py:3.11\"\n[debian]\npackages = [\"python3\"]\n[[step]]\nfile = \"/etc/motd\"\ncontent = \"hi\"\n",
        )
        .unwrap();
        assert_eq!(ok.debian.unwrap().suite, "bookworm");
        let err = |t: &str| BuildSpec::parse(t).unwrap_err().to_string();
        assert!(err("name = \"root/x\"\n").contains("exactly one base"));
        assert!(err("name = \"root/x\"\n[debian]\npackages = [\"a;rm\"]\n").contains("package"));
        assert!(
            err("name = \"root/x\"\nfrom = \"root/b\"\n[[step]]\nfile = \"/a/../../b\"\n")
                .contains("..")
        );
        assert!(
            err("name = \"root/x\"\nfrom = \"root/b\"\n[[step]]\nrun = \"a\"\nfile = \"/b\"\n")
                .contains("exactly one")
        );
        assert!(err("name = \"Bad\"\nfrom = \"root/b\"\n").contains("not a valid image reference"));
        assert!(err("name = \"root/x\"\nfrom = \"root/b\"\nbogus = 1\n").contains("unknown field"));
    }

    #[test]
    fn file_and_env_steps_make_layers_on_a_base() {
        let tmp = tempfile::tempdir().unwrap();
        let (store, l) = store_with_base(tmp.path());
        let spec = BuildSpec::parse(
            "name = \"root/c:1\"\nfrom = \"root/b\"\n[[step]]\nenv = { A = \"1\" }\n[[step]]\nfile = \"/etc/motd\"\ncontent = \"hi\"\nmode = \"0600\"\n",
        )
        .unwrap();
        let mut lines = Vec::new();
        build(&store, &spec, None, &mut |s| lines.push(s.to_string())).unwrap();
        let (_, m) = store
            .resolve(&ImageRef::parse("root/c:1").unwrap())
            .unwrap();
        assert_eq!(m.layers.len(), 2);
        assert_eq!(m.layers[0], l);
        assert_eq!(m.env["A"], "1");
        let motd = store.layer_path(&m.layers[1]).join("etc/motd");
        assert_eq!(std::fs::read_to_string(&motd).unwrap(), "hi");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&motd).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert!(lines.iter().any(|l| l.contains("tagged root/c:1")));
    }

    /// A store at `dir` with `root/b`, one layer holding an empty `/etc`; its layer.
    fn store_with_base(dir: &Path) -> (ImageStore, String) {
        let store = ImageStore::open(dir).unwrap();
        let base = store.temp_dir("b").unwrap();
        std::fs::create_dir_all(base.join("etc")).unwrap();
        let (l, _) = store.add_layer(&base).unwrap();
        let m = Manifest {
            schema_version: 1,
            layers: vec![l.clone()],
            env: BTreeMap::new(),
            workdir: None,
            start: None,
            created_ms: 0,
            size_bytes: 0,
            source: String::new(),
        };
        let digest = store.put_manifest(&m).unwrap();
        store
            .tag(&ImageRef::parse("root/b").unwrap(), &digest)
            .unwrap();
        (store, l)
    }

    /// Writes what it was asked to run where the step's changes go.
    struct Recorder;

    impl StepRunner for Recorder {
        fn run(
            &self,
            s: &RunStep<'_>,
            upper: &Path,
            _progress: &mut dyn FnMut(&str),
        ) -> Result<(), ImageError> {
            std::fs::write(
                upper.join("ran"),
                format!(
                    "{} {} {:?} {:?}",
                    s.layers.len(),
                    s.cmd,
                    s.env.get("A"),
                    s.workdir
                ),
            )
            .map_err(|e| ImageError::Build(e.to_string()))
        }
    }

    #[test]
    fn run_steps_go_to_the_runner_and_never_to_the_host() {
        let d = tempfile::tempdir().unwrap();
        let (store, _) = store_with_base(&d.path().join("s"));
        let spec = BuildSpec::parse(
            "name = \"root/r:1\"\nfrom = \"root/b\"\nworkdir = \"/w\"\n[[step]]\nenv = { A = \"1\" }\n[[step]]\nrun = \"touch /x\"\n",
        )
        .unwrap();
        assert!(spec.has_run_steps());
        let e = build(&store, &spec, None, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("never on the host"), "{e}");
        assert!(!store.exists(&ImageRef::parse("root/r:1").unwrap()));
        build(&store, &spec, Some(&Recorder), &mut |_| {}).unwrap();
        let (_, m) = store
            .resolve(&ImageRef::parse("root/r:1").unwrap())
            .unwrap();
        let ran = std::fs::read_to_string(store.layer_path(&m.layers[1]).join("ran")).unwrap();
        assert_eq!(ran, "1 touch /x Some(\"1\") Some(\"/w\")");
    }
}
