//! `dsec image build|pull|push|login|logout|logins|import|export|ls|inspect|rm`: builds,
//! pulls and pushes go through the running node; the rest work directly on the image
//! store directory.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Result;
use dsec_image::build::BuildSpec;
use dsec_image::{ImageRef, ImageStore};

use crate::{DataDirArg, output};

#[derive(clap::Subcommand)]
pub enum ImageCommand {
    /// Build an image from a spec file (Debian packages + steps)
    #[command(
        after_help = "Example:\n  dsec image build images/py-3.11.toml\n\nSpec format:\n  name = \"root/py:3.11\"\n  [debian]\n  packages = [\"python3\"]\n  [[step]]\n  run = \"echo hi > /etc/motd\""
    )]
    Build(BuildArgs),
    /// Pull an image from an OCI registry into the node's store
    #[command(
        after_help = "Examples:\n  dsec image pull docker.io/library/python:3.11-slim --as root/python:3.11\n  dsec image pull 127.0.0.1:5000/team/env:v1 --plain-http --no-lazy\n  dsec image pull 127.0.0.1:5000/team/env@sha256:… --plain-http\n  echo \"$PASSWORD\" | dsec image pull registry.example.com/team/env:v1 --username me --password-stdin\n\nWithout --username, credentials for the registry are read from Docker's config.json\n($DOCKER_CONFIG/config.json or ~/.docker/config.json) when it has them."
    )]
    Pull(PullArgs),
    /// Push an image of the node to an OCI registry
    #[command(
        after_help = "Examples:\n  dsec image push root/env:v1 registry.example.com/team/env:v1 --username me --password-stdin\n  dsec image push root/env:v1 127.0.0.1:5000/team/env:v1 --plain-http\n\nWithout --username, credentials are read from Docker's config.json when it has them."
    )]
    Push(PushArgs),
    /// Keep a registry login for a project on the node (sealed), used by its pulls,
    /// pushes and builds that give none
    #[command(
        after_help = "Examples:\n  echo \"$PASSWORD\" | dsec image login registry.example.com --username me --password-stdin\n  echo \"$TOKEN\" | dsec image login ghcr.io --token-stdin --project root/team-a\n\nA project's login also serves the pulls of the projects inside it; a push uses the\npushing project's own login only."
    )]
    Login(LoginArgs),
    /// Forget a project's registry login
    #[command(
        after_help = "Example:\n  dsec image logout registry.example.com --project root/team-a"
    )]
    Logout(LogoutArgs),
    /// List the registry logins kept on the node (never their secrets)
    #[command(after_help = "Example:\n  dsec image logins --json")]
    Logins(StoreArgs),
    /// Import an image from an OCI image layout (a directory or a tar of one) or a
    /// `docker save` tarball
    #[command(
        after_help = "Examples:\n  docker save python:3.11 -o py.tar && dsec image import py.tar --as root/python:3.11\n  skopeo copy docker://alpine:3 oci:alpine-layout:3 && dsec image import alpine-layout --as root/alpine:3"
    )]
    Import(ImportArgs),
    /// Export an image as an OCI image layout (for skopeo, crane or a registry)
    #[command(
        after_help = "Example:\n  dsec image export root/py:3.11 ./py-layout\n  skopeo copy oci:./py-layout:3.11 docker://registry.example.com/team/py:3.11"
    )]
    Export(ExportArgs),
    /// List images
    #[command(after_help = "Example:\n  dsec image ls --json")]
    Ls(StoreArgs),
    /// Show an image's manifest
    #[command(after_help = "Example:\n  dsec image inspect root/py:3.11")]
    Inspect(RefArgs),
    /// Remove an image reference and the layers nothing else uses
    #[command(after_help = "Example:\n  dsec image rm root/py:3.11")]
    Rm(RefArgs),
    /// Fetch and build what `vm` sandboxes boot: the guest kernel (from Debian's
    /// linux-image-cloud-amd64) and the initramfs (done on the first vm create otherwise)
    #[command(
        name = "vm-kernel",
        after_help = "Example:\n  dsec image vm-kernel --data-dir /var/lib/dsec\n\nNeeds a Debian mirror (apt-get download); edges without one can share a store where it ran."
    )]
    VmKernel(StoreArgs),
}

#[derive(clap::Args)]
pub struct StoreArgs {
    #[command(flatten)]
    pub data: DataDirArg,
    /// Image store directory (default: <data-dir>/images)
    #[arg(long, env = "DSEC_IMAGE_STORE")]
    pub store: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args)]
pub struct BuildArgs {
    /// Spec file (TOML)
    pub spec: PathBuf,
    /// Build only if the reference does not exist yet
    #[arg(long)]
    pub if_missing: bool,
    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(clap::Args)]
pub struct PullArgs {
    /// `[registry/]repository[:tag][@digest]`
    pub reference: String,
    /// The image's name on the node (default: <your project>/<repository's last part>:<tag>)
    #[arg(long = "as", value_name = "NAME")]
    pub target: Option<String>,
    /// Fetch the whole image now, even when the registry has its lazy layers
    #[arg(long)]
    pub no_lazy: bool,
    #[command(flatten)]
    pub registry: RegistryArgs,
    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(clap::Args)]
pub struct PushArgs {
    /// The image on the node, e.g. root/env:v1
    pub image: String,
    /// Where to: `registry/repository:tag`
    pub reference: String,
    /// Push the image only, without its lazy layers (EROFS images that let a node
    /// start it before it has arrived)
    #[arg(long)]
    pub no_lazy: bool,
    #[command(flatten)]
    pub registry: RegistryArgs,
    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(clap::Args)]
pub struct LoginArgs {
    /// The registry: host[:port], e.g. registry.example.com or docker.io
    pub registry: String,
    /// Registry user name (the password is read from stdin with --password-stdin)
    #[arg(long, requires = "password_stdin")]
    pub username: Option<String>,
    #[arg(long, requires = "username")]
    pub password_stdin: bool,
    /// Read a bearer token for the registry from stdin
    #[arg(
        long,
        conflicts_with = "username",
        required_unless_present = "username"
    )]
    pub token_stdin: bool,
    /// Whose login it is
    #[arg(long, default_value = dsec_common::project::ROOT)]
    pub project: String,
    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(clap::Args)]
pub struct LogoutArgs {
    /// The registry: host[:port]
    pub registry: String,
    /// Whose login to forget
    #[arg(long, default_value = dsec_common::project::ROOT)]
    pub project: String,
    #[command(flatten)]
    pub store: StoreArgs,
}

/// How to reach a registry.
#[derive(clap::Args)]
pub struct RegistryArgs {
    /// Registry user name (the password is read from stdin with --password-stdin)
    #[arg(long)]
    pub username: Option<String>,
    #[arg(long, requires = "username")]
    pub password_stdin: bool,
    /// Read a bearer token for the registry from stdin
    #[arg(long, conflicts_with = "username")]
    pub token_stdin: bool,
    /// Talk plain HTTP to the registry (e.g. one on loopback)
    #[arg(long)]
    pub plain_http: bool,
    /// PEM file of a CA to trust for this registry
    #[arg(long, value_name = "FILE")]
    pub ca_cert: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct ImportArgs {
    /// An OCI image layout directory, a tar of one, or a `docker save` tarball
    pub source: PathBuf,
    /// The image's name in the store
    #[arg(long = "as", value_name = "NAME")]
    pub target: String,
    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(clap::Args)]
pub struct ExportArgs {
    pub reference: String,
    /// A new (or empty) directory for the OCI image layout
    pub dest: PathBuf,
    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(clap::Args)]
pub struct RefArgs {
    pub reference: String,
    #[command(flatten)]
    pub store: StoreArgs,
}

fn open(a: &StoreArgs) -> Result<ImageStore> {
    let root = a
        .store
        .clone()
        .unwrap_or_else(|| a.data.data_dir.join("images"));
    Ok(ImageStore::open(root)?)
}

/// The node's registry logins, kept in its image store.
fn book(a: &StoreArgs) -> Result<dsec_image::credentials::CredentialBook> {
    Ok(open(a)?.registry_logins())
}

/// Layers that sandboxes and snapshots of this machine's edge still use.
fn layers_in_use(a: &StoreArgs) -> std::collections::HashSet<String> {
    dsec_edge::layers_in_use(&a.data.data_dir.join("edge"))
}

/// Removes `r` through the node of this data directory; `None` when none is running.
async fn rm_on_node(a: &StoreArgs, r: &ImageRef) -> Result<Option<usize>> {
    let Ok(cfg) = crate::client::resolve(None, None, Some(&a.data.data_dir)) else {
        return Ok(None);
    };
    let api = crate::client::Api::new(&cfg)?;
    let path = format!("/v1/images/{}", url_escape(&r.to_string()));
    match api
        .call::<serde_json::Value>(hyper::Method::DELETE, &path, None::<&()>)
        .await
    {
        Ok(v) => Ok(Some(v["freed_layers"].as_u64().unwrap_or(0) as usize)),
        Err(e)
            if e.chain().any(|c| {
                c.downcast_ref::<hyper_util::client::legacy::Error>()
                    .is_some_and(|h| h.is_connect())
            }) =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// `s` with every byte but unreserved ones percent-encoded (an image reference as one
/// path segment).
pub(crate) fn url_escape(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' | b':' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A build's progress: a spinner with step lines on a terminal, the lines on stderr
/// otherwise, nothing with `--json`.
struct Progress {
    bar: indicatif::ProgressBar,
    tty: bool,
    json: bool,
    t0: Instant,
}

impl Progress {
    fn new(json: bool, t0: Instant) -> Progress {
        let tty = std::io::stderr().is_terminal() && !json;
        let bar = indicatif::ProgressBar::new_spinner();
        if tty {
            bar.enable_steady_tick(Duration::from_millis(120));
        } else {
            bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
        }
        Progress { bar, tty, json, t0 }
    }

    fn line(&mut self, line: &str) {
        let is_step = line.starts_with("step ")
            || line.starts_with("mmdebstrap ")
            || line.starts_with("layer ")
            || line.starts_with("manifest ")
            || line.starts_with("tagged ");
        if self.tty {
            if is_step {
                self.bar.println(format!("==> {line}"));
            }
            self.bar.set_message(format!(
                "[{:>4.0}s] {}",
                self.t0.elapsed().as_secs_f64(),
                line.chars().take(100).collect::<String>()
            ));
        } else if !self.json {
            eprintln!("{line}");
        }
    }

    fn done(&self) {
        self.bar.finish_and_clear();
    }
}

/// Sends the build to the node whose data directory this is (`POST /v1/images/builds`)
/// and follows its NDJSON answer; the image's digest.
async fn build_on_node(
    data_dir: &std::path::Path,
    spec: &BuildSpec,
    progress: &mut dyn FnMut(&str),
) -> Result<String> {
    let v = on_node(
        data_dir,
        "/v1/images/builds",
        serde_json::to_vec(spec)?,
        "`run` steps execute in sandboxes of a running node",
        progress,
    )
    .await?;
    if let Some(d) = v["digest"].as_str() {
        return Ok(d.to_string());
    }
    anyhow::bail!(
        "the build failed ({}): {}",
        v["error"]["code"].as_str().unwrap_or("error"),
        v["error"]["message"].as_str().unwrap_or("no message")
    )
}

/// Posts `body` to `path` of the node whose data directory this is and follows its
/// NDJSON answer (`{"log": …}` lines to `progress`); the last line.
async fn on_node(
    data_dir: &std::path::Path,
    path: &str,
    body: Vec<u8>,
    why_running: &str,
    progress: &mut dyn FnMut(&str),
) -> Result<serde_json::Value> {
    use http_body_util::BodyExt;

    let cfg = crate::client::resolve(None, None, Some(data_dir)).map_err(|e| {
        anyhow::anyhow!(
            "{e}\n{why_running}: start `dsec up --data-dir {}` first",
            data_dir.display()
        )
    })?;
    let api = crate::client::Api::new(&cfg)?;
    let resp = api
        .open(
            hyper::Method::POST,
            path,
            "application/json",
            crate::client::full(body),
        )
        .await?;
    let mut body = resp.into_body();
    let mut buf: Vec<u8> = Vec::new();
    let mut last = None;
    while let Some(frame) = body.frame().await {
        if let Some(d) = frame?.data_ref() {
            buf.extend_from_slice(d);
        }
        while let Some(i) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=i).collect();
            let v: serde_json::Value = serde_json::from_slice(&line)?;
            match v.get("log").and_then(|l| l.as_str()) {
                Some(l) => progress(l),
                None => last = Some(v),
            }
        }
    }
    last.ok_or_else(|| anyhow::anyhow!("the node ended its answer without a result"))
}

/// The registry's user and password from Docker's config.json (`auths.<registry>`:
/// `auth`, base64 of `user:password`, or `username` and `password`), if it has them.
fn docker_config_credentials(registry: &str) -> Option<(String, String)> {
    use base64::Engine;
    let dir = std::env::var_os("DOCKER_CONFIG")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".docker")))?;
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).ok()?).ok()?;
    let auths = v.get("auths")?.as_object()?;
    let keys = [
        registry.to_string(),
        format!("https://{registry}"),
        format!("http://{registry}"),
        if registry == "docker.io" || registry == "registry-1.docker.io" {
            "https://index.docker.io/v1/".to_string()
        } else {
            String::new()
        },
    ];
    let entry = keys.iter().find_map(|k| auths.get(k))?;
    if let (Some(u), Some(p)) = (
        entry.get("username").and_then(|x| x.as_str()),
        entry.get("password").and_then(|x| x.as_str()),
    ) {
        return Some((u.to_string(), p.to_string()));
    }
    let raw = base64::engine::general_purpose::STANDARD
        .decode(entry.get("auth")?.as_str()?)
        .ok()?;
    let text = String::from_utf8(raw).ok()?;
    let (u, p) = text.split_once(':')?;
    Some((u.to_string(), p.to_string()))
}

fn read_stdin_secret(what: &str) -> Result<String> {
    let mut s = String::new();
    std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
        .map_err(|e| anyhow::anyhow!("reading the {what} from stdin: {e}"))?;
    let s = s.trim_end_matches(['\n', '\r']).to_string();
    if s.is_empty() {
        anyhow::bail!("no {what} on stdin");
    }
    Ok(s)
}

/// The body of a pull or push to `reference`: how to reach its registry.
fn registry_body(reference: &str, a: &RegistryArgs) -> Result<serde_json::Value> {
    let registry = reference
        .parse::<oci_client::Reference>()
        .map(|r| r.registry().to_string())
        .map_err(|e| anyhow::anyhow!("{reference:?} is not an image reference: {e}"))?;
    let mut body = serde_json::json!({ "reference": reference, "plain_http": a.plain_http });
    if let Some(u) = &a.username {
        body["username"] = u.clone().into();
        body["password"] = if a.password_stdin {
            read_stdin_secret("password")?
        } else {
            anyhow::bail!("--username needs --password-stdin (a password is never an argument)")
        }
        .into();
    } else if a.token_stdin {
        body["token"] = read_stdin_secret("token")?.into();
    } else if let Some((u, p)) = docker_config_credentials(&registry) {
        body["username"] = u.into();
        body["password"] = p.into();
    }
    if let Some(ca) = &a.ca_cert {
        body["ca_pem"] = std::fs::read_to_string(ca)
            .map_err(|e| anyhow::anyhow!("reading {}: {e}", ca.display()))?
            .into();
    }
    Ok(body)
}

/// Sends `body` to the running node's `path` (a pull or a push), showing its progress,
/// and prints its result: JSON, or the sentence `say` makes of it.
fn registry_call(
    store: &StoreArgs,
    path: &str,
    body: serde_json::Value,
    what: &str,
    say: impl FnOnce(&serde_json::Value, &str, f64) -> String,
) -> Result<i32> {
    let t0 = Instant::now();
    let mut show = Progress::new(store.json, t0);
    let v = tokio::runtime::Handle::current().block_on(on_node(
        &store.data.data_dir,
        path,
        serde_json::to_vec(&body)?,
        what,
        &mut |l| show.line(l),
    ));
    show.done();
    let v = v?;
    let Some(digest) = v["digest"].as_str() else {
        eprintln!(
            "error ({}): {}",
            v["error"]["code"].as_str().unwrap_or("error"),
            v["error"]["message"].as_str().unwrap_or("no message")
        );
        return Ok(1);
    };
    let seconds = t0.elapsed().as_secs_f64();
    if store.json {
        let mut out = v.clone();
        out["seconds"] = seconds.into();
        output::print_json(&out);
    } else {
        println!("{}", say(&v, digest, seconds));
    }
    Ok(0)
}

fn mib(v: &serde_json::Value) -> f64 {
    v.as_f64().unwrap_or(0.0) / 1048576.0
}

fn push(a: PushArgs) -> Result<i32> {
    let mut body = registry_body(&a.reference, &a.registry)?;
    body["image"] = a.image.clone().into();
    body["lazy"] = (!a.no_lazy).into();
    let what = "a push sends an image of a running node's store";
    registry_call(&a.store, "/v1/images:push", body, what, |v, digest, s| {
        format!(
            "pushed {} to {} ({digest}): {} blobs sent ({:.1} MiB), {} there already, in {s:.1} s",
            a.image,
            a.reference,
            v["pushed_blobs"],
            mib(&v["pushed_bytes"]),
            v["skipped_blobs"],
        )
    })
}

fn pull(a: PullArgs) -> Result<i32> {
    let mut body = registry_body(&a.reference, &a.registry)?;
    if let Some(t) = &a.target {
        body["as"] = t.clone().into();
    }
    body["lazy"] = (!a.no_lazy).into();
    let what = "a pull goes into the store of a running node";
    registry_call(&a.store, "/v1/images:pull", body, what, |v, digest, s| {
        format!(
            "pulled {} as {} ({}): {} layers ({} fetched, {} in the store already), {:.1} MiB in {s:.1} s",
            a.reference,
            v["image"].as_str().unwrap_or("?"),
            &digest[..12.min(digest.len())],
            v["layers"],
            v["fetched_layers"],
            v["cached_layers"],
            mib(&v["fetched_bytes"]),
        ) + if v["lazy"].as_bool() == Some(true) {
            "\nits layers are lazy: fetched as sandboxes read them"
        } else {
            ""
        }
    })
}

pub async fn run(c: ImageCommand) -> Result<i32> {
    tokio::task::spawn_blocking(move || run_blocking(c)).await?
}

fn run_blocking(c: ImageCommand) -> Result<i32> {
    match c {
        ImageCommand::Pull(a) => pull(a),
        ImageCommand::Push(a) => push(a),
        ImageCommand::Import(a) => {
            let store = open(&a.store)?;
            let target = ImageRef::parse(&a.target)?;
            let t0 = Instant::now();
            let mut show = Progress::new(a.store.json, t0);
            let r = dsec_image::archive::import(
                &store,
                &a.source,
                &target,
                &dsec_image::pull::PullLimits::default(),
                &mut |l| show.line(&l),
            );
            show.done();
            let (digest, m) = r?;
            if a.store.json {
                output::print_json(&serde_json::json!({
                    "image": target.to_string(), "digest": digest, "layers": m.layers.len(),
                    "size_bytes": m.size_bytes, "seconds": t0.elapsed().as_secs_f64(),
                }));
            } else {
                println!(
                    "imported {} as {target} ({}): {} layers, {:.1} MiB in {:.1} s",
                    a.source.display(),
                    &digest[..12],
                    m.layers.len(),
                    m.size_bytes as f64 / 1048576.0,
                    t0.elapsed().as_secs_f64()
                );
            }
            Ok(0)
        }
        ImageCommand::Export(a) => {
            let store = open(&a.store)?;
            let r = ImageRef::parse(&a.reference)?;
            let t0 = Instant::now();
            let mut show = Progress::new(a.store.json, t0);
            let d = dsec_image::archive::export(&store, &r, &a.dest, &mut |l| show.line(&l));
            show.done();
            let digest = d?;
            if a.store.json {
                output::print_json(&serde_json::json!({
                    "image": r.to_string(), "layout": a.dest, "manifest_digest": digest, "tag": r.tag,
                }));
            } else {
                println!(
                    "exported {r} to {} (manifest {digest}, tag {}) in {:.1} s",
                    a.dest.display(),
                    r.tag,
                    t0.elapsed().as_secs_f64()
                );
            }
            Ok(0)
        }
        ImageCommand::VmKernel(a) => {
            let store = open(&a)?;
            let t0 = Instant::now();
            if !a.json {
                eprintln!(
                    "fetching and unpacking the guest kernel (first time: a download of tens of MiB)…"
                );
            }
            let kernel = dsec_image::guest::ensure_kernel(store.root())?;
            let initrd = dsec_image::guest::ensure_initramfs(store.root(), &kernel)?;
            if a.json {
                output::print_json(&serde_json::json!({
                    "kernel": kernel.version,
                    "vmlinuz": kernel.vmlinuz,
                    "initramfs": initrd,
                }));
            } else {
                println!(
                    "guest kernel {} ({}) and initramfs ready in {:.1} s:\n  {}\n  {}",
                    kernel.version,
                    kernel.package_version,
                    t0.elapsed().as_secs_f64(),
                    kernel.vmlinuz.display(),
                    initrd.display()
                );
            }
            Ok(0)
        }
        ImageCommand::Build(a) => {
            let spec = BuildSpec::load(&a.spec)?;
            let store = open(&a.store)?;
            let name = ImageRef::parse(&spec.name)?;
            if a.if_missing && store.resolve(&name).is_ok() {
                println!("{name} exists; not rebuilding");
                return Ok(0);
            }
            let t0 = Instant::now();
            let mut show = Progress::new(a.store.json, t0);
            let from_registry = spec
                .from
                .as_deref()
                .is_some_and(dsec_image::pull::is_registry_reference);
            let digest = if spec.has_run_steps() || from_registry {
                // `run` steps execute in sandboxes, and a registry's base is pulled into
                // the node's store: the node builds it.
                tokio::runtime::Handle::current().block_on(build_on_node(
                    &a.store.data.data_dir,
                    &spec,
                    &mut |l| show.line(l),
                ))
            } else {
                dsec_image::build::build(&store, &spec, None, &mut |l| show.line(l))
                    .map_err(anyhow::Error::from)
            };
            show.done();
            let digest = digest?;
            if a.store.json {
                output::print_json(
                    &serde_json::json!({"reference": name.to_string(), "digest": digest, "seconds": t0.elapsed().as_secs_f64()}),
                );
            } else {
                println!(
                    "built {name} ({}) in {:.1} s",
                    &digest[..12],
                    t0.elapsed().as_secs_f64()
                );
            }
            Ok(0)
        }
        ImageCommand::Login(a) => {
            let login = match &a.username {
                Some(u) => dsec_image::pull::Credentials::Basic {
                    username: u.clone(),
                    password: read_stdin_secret("password")?,
                },
                None => dsec_image::pull::Credentials::Token(read_stdin_secret("token")?),
            };
            let kept = book(&a.store)?.set(&a.project, &a.registry, &login)?;
            if a.store.json {
                output::print_json(&kept);
            } else {
                println!(
                    "kept a {} login{} for {} for project {}",
                    kept.kind,
                    kept.username
                        .as_deref()
                        .map(|u| format!(" (user {u})"))
                        .unwrap_or_default(),
                    kept.registry,
                    kept.project
                );
            }
            Ok(0)
        }
        ImageCommand::Logout(a) => {
            let gone = book(&a.store)?.remove(&a.project, &a.registry)?;
            if a.store.json {
                output::print_json(&serde_json::json!({
                    "project": a.project, "registry": a.registry, "removed": gone,
                }));
            } else if gone {
                println!("forgot project {}'s login for {}", a.project, a.registry);
            } else {
                eprintln!("project {} keeps no login for {}", a.project, a.registry);
            }
            Ok(if gone { 0 } else { 1 })
        }
        ImageCommand::Logins(a) => {
            let list = book(&a)?.list(|_| true)?;
            if a.json {
                output::print_json(&list);
                return Ok(0);
            }
            let rows = list
                .iter()
                .map(|l| {
                    vec![
                        l.project.clone(),
                        l.registry.clone(),
                        l.kind.clone(),
                        l.username.clone().unwrap_or_default(),
                        output::ago_ms(l.updated_ms),
                    ]
                })
                .collect();
            println!(
                "{}",
                output::table(&["project", "registry", "kind", "user", "kept"], rows)
            );
            Ok(0)
        }
        ImageCommand::Ls(a) => {
            let list = open(&a)?.list()?;
            if a.json {
                output::print_json(&list);
                return Ok(0);
            }
            let rows = list
                .iter()
                .map(|e| {
                    vec![
                        e.reference.clone(),
                        e.digest[..12].to_string(),
                        e.manifest.layers.len().to_string(),
                        format!("{:.1} MiB", e.manifest.size_bytes as f64 / 1048576.0),
                        output::ago_ms(e.manifest.created_ms),
                    ]
                })
                .collect();
            println!(
                "{}",
                output::table(&["reference", "digest", "layers", "size", "created"], rows)
            );
            Ok(0)
        }
        ImageCommand::Inspect(a) => {
            let r = ImageRef::parse(&a.reference)?;
            let (digest, m) = open(&a.store)?.resolve(&r)?;
            output::print_json(
                &serde_json::json!({"reference": r.to_string(), "digest": digest, "manifest": m}),
            );
            Ok(0)
        }
        ImageCommand::Rm(a) => {
            let r = ImageRef::parse(&a.reference)?;
            // Through the running node, which gives back the disk the image held in its
            // project's quota; with none running, on the store (the node gives it back
            // when it next starts and finds the image gone).
            let n = match tokio::runtime::Handle::current().block_on(rm_on_node(&a.store, &r))? {
                Some(n) => n,
                None => open(&a.store)?.remove(&r, &layers_in_use(&a.store))?,
            };
            if a.store.json {
                output::print_json(&serde_json::json!({
                    "image": r.to_string(), "removed": true, "freed_layers": n,
                }));
            } else {
                println!("removed {r} ({n} layers freed)");
            }
            Ok(0)
        }
    }
}
