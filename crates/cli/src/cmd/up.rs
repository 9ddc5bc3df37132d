//! `dsec up`, `serve`, `down`, `status`: the embedded single-machine deployment. `up`
//! starts `dsec serve` detached (its log is `<data-dir>/dsec.log`) and waits until it
//! answers; `serve` runs every role in one process.

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use axum::serve::ListenerExt;
use dsec_common::api::ClusterStatus;
use dsec_common::client_config::{self, ClientConfig};
use dsec_edge::{Edge, EdgeConfig};
use dsec_iam::{Iam, PrincipalKind, ROOT, RaftConfig, RaftIam};
use hyper::Method;
use serde::Deserialize;

use crate::client::{self, Api};
use crate::output;

#[derive(clap::Args, Clone)]
pub struct UpArgs {
    #[command(flatten)]
    pub data: crate::DataDirArg,
    /// Address the API listens on
    #[arg(long, default_value = "127.0.0.1:7600")]
    pub listen: SocketAddr,
    /// OCI runtime for containers: auto, crun, runc or a path
    #[arg(long)]
    pub oci_runtime: Option<String>,
    /// Node name (part of every sandbox id)
    #[arg(long, env = "DSEC_NODE_NAME")]
    pub node_name: Option<String>,
    /// Image store directory (default: <data-dir>/images; a shared filesystem in a cluster)
    #[arg(long, env = "DSEC_IMAGE_STORE")]
    pub image_store: Option<PathBuf>,
    /// Stay in the foreground (what the systemd unit does)
    #[arg(long)]
    pub foreground: bool,
    /// Address of the E2B-compatible gateway (default: the API's address, port + 10000)
    #[arg(long)]
    pub e2b_listen: Option<SocketAddr>,
}

#[derive(clap::Args)]
pub struct DownArgs {
    #[command(flatten)]
    pub data: crate::DataDirArg,
    /// Leave sandboxes running; the next `dsec up` re-adopts them
    #[arg(long)]
    pub keep_sandboxes: bool,
}

#[derive(clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub data: crate::DataDirArg,
    #[command(flatten)]
    pub api: crate::ApiArgs,
}

/// `<data-dir>/config.toml`: optional; flags override it.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct ServerConfig {
    listen: Option<SocketAddr>,
    edge: Option<EdgeConfig>,
    gateway: Option<GatewayToml>,
}

/// The `[gateway]` table: the E2B-compatible gateway.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GatewayToml {
    #[serde(default = "yes")]
    enabled: bool,
    listen: Option<SocketAddr>,
    /// The sandbox domain: `get_host(port)` is `{port}-{id}.{domain}`, which must resolve
    /// to the gateway (default `localhost:<gateway port>`, which browsers resolve).
    domain: Option<String>,
    /// E2B template id → image (`"owner/name:tag"`) or `{ image = "…", backend = "vm" }`,
    /// added to (or replacing) the defaults (`base`, `base-vm`, `base-microvm`, …).
    #[serde(default)]
    templates: std::collections::BTreeMap<String, dsec_gateway::Template>,
}

fn yes() -> bool {
    true
}

fn pid_file(d: &Path) -> PathBuf {
    d.join("dsec.pid")
}

fn read_pid(d: &Path) -> Option<i32> {
    let pid: i32 = std::fs::read_to_string(pid_file(d))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    // SAFETY: signal 0 only checks that the process exists.
    (unsafe { libc::kill(pid, 0) } == 0).then_some(pid)
}

async fn healthy(url: &str) -> bool {
    let Ok(api) = Api::new(&ClientConfig {
        api_url: url.to_string(),
        api_key: String::new(),
    }) else {
        return false;
    };
    api.call::<serde_json::Value>(Method::GET, "/healthz", None::<&()>)
        .await
        .is_ok()
}

pub async fn up(a: UpArgs) -> Result<i32> {
    if a.foreground {
        return serve(a).await;
    }
    let dir = &a.data.data_dir;
    // Keys, tokens and sandboxes' state live here: root's alone.
    dsec_common::private::dir(dir).with_context(|| format!("creating {}", dir.display()))?;
    let url = format!("http://{}", a.listen);
    if read_pid(dir).is_some() && healthy(&url).await {
        println!("OpenDsec is already running ({url}).");
        return print_client(dir, false);
    }
    let log = dir.join("dsec.log");
    let logf = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)?;
    let exe = std::env::current_exe()?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("serve")
        .arg("--data-dir")
        .arg(dir)
        .arg("--listen")
        .arg(a.listen.to_string());
    if let Some(r) = &a.oci_runtime {
        cmd.arg("--oci-runtime").arg(r);
    }
    if let Some(n) = &a.node_name {
        cmd.arg("--node-name").arg(n);
    }
    if let Some(s) = &a.image_store {
        cmd.arg("--image-store").arg(s);
    }
    if let Some(g) = &a.e2b_listen {
        cmd.arg("--e2b-listen").arg(g.to_string());
    }
    cmd.stdin(std::process::Stdio::null())
        .stdout(logf.try_clone()?)
        .stderr(logf);
    // SAFETY: setsid between fork and exec: the server outlives this shell session.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("starting dsec serve")?;
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            bail!(
                "the server exited ({status}) while starting; last lines of {}:\n{}",
                log.display(),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        if dir.join("client.toml").exists() && healthy(&url).await {
            break;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            bail!(
                "the server did not answer on {url} within 60 s; see {}",
                log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "OpenDsec is up in {:.1} s (pid {}, log {}).",
        t0.elapsed().as_secs_f64(),
        child.id(),
        log.display()
    );
    print_client(dir, true)
}

fn print_client(dir: &Path, copy: bool) -> Result<i32> {
    let path = dir.join("client.toml");
    let c = ClientConfig::load(&path)?;
    println!("API URL:  {}", c.api_url);
    println!("API key:  {}", c.api_key);
    println!("Console:  {}/console (log in with the key)", c.api_url);
    println!("Client config: {}", path.display());
    let e2b = dir.join(E2B_ENV);
    if let Ok(text) = std::fs::read_to_string(&e2b) {
        println!("E2B SDK ({}):", e2b.display());
        for line in text.lines() {
            println!("  export {line}");
        }
    }
    if copy && let Some(def) = client_config::default_path() {
        if let Some(parent) = def.parent() {
            std::fs::create_dir_all(parent)?;
        }
        write_private(&def, &c.to_toml())?;
        println!("               (copied to {})", def.display());
    }
    println!("Try: dsec run root/py:3.11 -- python3 -c 'print(6*7)'");
    Ok(0)
}

pub(crate) fn write_private(p: &Path, text: &str) -> Result<()> {
    dsec_common::private::write(p, text.as_bytes())
        .with_context(|| format!("writing {}", p.display()))
}

/// IAM for `dsec up`: a Raft replica, the only member of its cluster, in
/// `<data-dir>/iam/raft`; its cluster secret in `<data-dir>/iam/cluster-secret`.
async fn start_iam(dir: &std::path::Path, addr: &str) -> Result<RaftIam> {
    let raft_dir = dir.join("iam/raft");
    let fresh = !raft_dir.join("raft-log.redb").exists();
    let secret_path = dir.join("iam/cluster-secret");
    let secret = match std::fs::read_to_string(&secret_path) {
        Ok(s) if !s.trim().is_empty() => s.trim().to_string(),
        _ => {
            let s = dsec_iam::generate_key();
            std::fs::create_dir_all(dir.join("iam"))?;
            write_private(&secret_path, &s)?;
            s
        }
    };
    let mut cfg = RaftConfig::new(1, addr, &raft_dir);
    cfg.secret = Some(secret);
    let node = RaftIam::open(cfg).await?;
    if fresh {
        node.initialize(&[(1, addr.to_string())]).await?;
    }
    node.wait_for_leader(std::time::Duration::from_secs(20))
        .await
        .context("the IAM replica did not become leader")?;
    Ok(node)
}

/// The `[edge]` table, with state and images under `dir` unless it names other places.
pub(crate) fn edge_config(table: Option<EdgeConfig>, dir: &Path) -> EdgeConfig {
    let defaults = EdgeConfig::default();
    let mut cfg = table.unwrap_or_default();
    if cfg.state_dir == defaults.state_dir {
        cfg.state_dir = dir.join("edge");
    }
    if cfg.image_store == defaults.image_store {
        cfg.image_store = dir.join("images");
    }
    cfg
}

/// Starts the edge with IAM as its quota gate, and its TTL reaper.
pub(crate) async fn start_edge(
    cfg: EdgeConfig,
    iam: Arc<dyn Iam>,
) -> Result<(Arc<Edge>, tokio::task::JoinHandle<()>)> {
    let quotas = Arc::new(dsec_edge_api::quotas::IamQuotas(iam));
    let edge = Edge::start_with(cfg, Some(quotas))
        .await
        .map_err(|e| anyhow::anyhow!("starting the edge: {}", e.message))?;
    for b in edge.status().backends {
        tracing::info!(backend = %b.name, available = b.available, "{}", b.detail);
    }
    let reaper = edge.spawn_reaper();
    Ok((edge, reaper))
}

pub(crate) fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// `dsec serve`: every role in one process, or with `--config` one cluster role.
#[derive(clap::Args)]
pub struct ServeArgs {
    /// A cluster role's config file (role = "iam" | "apiserver" | "watcher" | "edge");
    /// without it, every role runs here as `dsec up` does
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub up: UpArgs,
}

pub async fn serve_command(a: ServeArgs) -> Result<i32> {
    match a.config {
        Some(path) => super::role::run(&path).await,
        None => serve(a.up).await,
    }
}

pub async fn serve(a: UpArgs) -> Result<i32> {
    init_tracing();
    let dir = a.data.data_dir.clone();
    dsec_common::private::dir(&dir)?;
    let dir = dir.canonicalize()?;
    let cfg_path = dir.join("config.toml");
    let server_cfg: ServerConfig = match std::fs::read_to_string(&cfg_path) {
        Ok(t) => {
            toml::from_str(&t).with_context(|| format!("{} is not valid", cfg_path.display()))?
        }
        Err(_) => ServerConfig::default(),
    };
    let mut edge_cfg = edge_config(server_cfg.edge, &dir);
    if let Some(r) = a.oci_runtime {
        edge_cfg.oci_runtime = r;
    }
    if let Some(n) = a.node_name {
        edge_cfg.name = n;
    }
    if let Some(s) = a.image_store {
        edge_cfg.image_store = s;
    }
    let listen = if a.listen.to_string() == "127.0.0.1:7600" {
        server_cfg.listen.unwrap_or(a.listen)
    } else {
        a.listen
    };
    // The cluster CA, for certificates of the components of more machines (`dsec certs`).
    if let Err(e) = dsec_mtls::pki::init_ca(&dir.join("certs")) {
        tracing::warn!(
            "creating the cluster CA in {}: {e}",
            dir.join("certs").display()
        );
    }
    let raft = start_iam(&dir, &listen.to_string()).await?;
    let iam: Arc<dyn Iam> = Arc::new(raft.clone());
    dsec_iam::import_key_file(iam.as_ref(), &dir.join("iam/keys.json"))?;
    let client_path = dir.join("client.toml");
    let url = format!("http://{listen}");
    let existing = ClientConfig::load(&client_path).ok();
    let key = match existing {
        Some(c) if iam.authenticate(&c.api_key).is_some_and(|p| p.is_admin()) => c.api_key,
        _ => dsec_iam::create_key(iam.as_ref(), ROOT, ROOT, "admin", PrincipalKind::Human)?.0,
    };
    let e2b_key = e2b_key(iam.as_ref(), &dir)?;
    let listener = super::listen(listen).await.with_context(|| {
        format!("cannot listen on {listen} (is another dsec running? use --listen)")
    })?;
    let node = Arc::new(std::sync::OnceLock::new());
    let builder: Arc<dyn dsec_gateway::Builder> = Arc::new(NodeBuilder {
        edge: node.clone(),
        store: edge_cfg.image_store.clone(),
    });
    // The gateway calls the API's router in this process (set once it is built below).
    let api_router: dsec_gateway::upstream::InProcess = Default::default();
    let gateway = bind_gateway(
        &dir,
        server_cfg.gateway,
        a.e2b_listen,
        listen,
        &url,
        &key,
        &e2b_key,
        Some(builder),
        Some(api_router.clone()),
    )
    .await?;
    let (edge, reaper) = start_edge(edge_cfg, iam.clone()).await?;
    // One node: no peer edges for the lazy file system to ask (a store that served a
    // cluster's edge before may name some).
    let _ = std::fs::remove_file(dsec_edge_api::transfer::lazy_peers_file(
        edge.images().root(),
    ));
    let _ = node.set(edge.clone());
    // The replica routes (guarded by the cluster secret) let more IAM replicas join.
    let app = dsec_edge_api::router(dsec_edge_api::AppState {
        edge: edge.clone(),
        iam: iam.clone(),
        forwarded: false,
    })
    .merge(raft.router());
    let _ = api_router.set(app.clone());
    std::fs::write(pid_file(&dir), std::process::id().to_string())?;
    write_private(
        &client_path,
        &ClientConfig {
            api_url: url.clone(),
            api_key: key,
        }
        .to_toml(),
    )?;
    tracing::info!("API listening on {url}");
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(None::<bool>);
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut int), Ok(mut keep)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
            signal(SignalKind::user_defined2()),
        ) else {
            return;
        };
        let stop_sandboxes = tokio::select! {
            _ = term.recv() => true,
            _ = int.recv() => true,
            _ = keep.recv() => false,
        };
        let _ = stop_tx.send(Some(stop_sandboxes));
    });
    let mut gateway_task = None;
    if let Some((gl, gapp)) = gateway {
        let mut rx3 = stop_rx.clone();
        gateway_task = Some(tokio::spawn(async move {
            let r = axum::serve(gl.tap_io(no_delay), gapp)
                .with_graceful_shutdown(async move {
                    let _ = rx3.wait_for(|v| v.is_some()).await;
                })
                .await;
            if let Err(e) = r {
                tracing::error!("E2B gateway: {e}");
            }
        }));
    }
    let mut rx2 = stop_rx.clone();
    axum::serve(listener.tap_io(no_delay), app)
        .with_graceful_shutdown(async move {
            let _ = rx2.wait_for(|v| v.is_some()).await;
        })
        .await?;
    // The gateway calls the API's router in this process: its calls end before the node
    // stops (one still open after 10 s is not waited for).
    if let Some(t) = gateway_task {
        let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
    }
    reaper.abort();
    let stop_sandboxes = stop_rx.borrow_and_update().unwrap_or(true);
    if stop_sandboxes {
        tracing::info!("stopping all sandboxes");
        // `dsec down` follows this file; IAM stays up until the last sandbox has released
        // its reservation.
        let progress = dir.join(STOPPING);
        edge.stop_all(|left, total| {
            let _ = dsec_common::private::write(
                &progress,
                format!("{{\"left\": {left}, \"total\": {total}}}\n").as_bytes(),
            );
        })
        .await;
        let _ = std::fs::remove_file(&progress);
    } else {
        tracing::info!("leaving sandboxes running for the next start");
    }
    let _ = raft.shutdown().await;
    let _ = std::fs::remove_file(pid_file(&dir));
    let _ = std::fs::remove_file(dir.join(E2B_ENV));
    Ok(0)
}

/// What `dsec up` writes for programs that use the E2B SDK.
const E2B_ENV: &str = "e2b.env";
/// The gateway's default port: the API's plus this.
const GATEWAY_PORT_OFFSET: u16 = 10000;

/// Binds the E2B gateway (unless `[gateway] enabled = false`) and writes `e2b.env` with the
/// three variables the E2B SDK needs. Its access-token secret is kept in
/// Template builds from the gateway, on this node (as `POST /v1/images/builds`: `run`
/// steps in sandboxes), for the caller's project.
struct NodeBuilder {
    edge: Arc<std::sync::OnceLock<Arc<dsec_edge::Edge>>>,
    store: PathBuf,
}

impl dsec_gateway::Builder for NodeBuilder {
    fn build(
        &self,
        spec: &dsec_image::build::BuildSpec,
        project: &str,
        progress: &mut dyn FnMut(&str),
    ) -> Result<String, dsec_common::ApiError> {
        let edge = self.edge.get().cloned().ok_or_else(|| {
            dsec_common::ApiError::unavailable("the node is still starting; try again")
        })?;
        let rt = tokio::runtime::Handle::current();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let spec = spec.clone();
        let project = project.to_string();
        let task = rt.spawn(async move { edge.build_image(spec, project, tx).await });
        while let Some(line) = rx.blocking_recv() {
            progress(&line);
        }
        rt.block_on(task)
            .map_err(|e| dsec_common::ApiError::internal(format!("build worker failed: {e}")))?
    }

    fn scratch(&self) -> PathBuf {
        self.store.join("tmp").join("e2b-uploads")
    }
}

/// The project whose key `dsec up` hands to E2B programs (in `e2b.env`): an ordinary
/// tenant, not an administrator.
pub(crate) const E2B_PROJECT: &str = "root/e2b";

/// The key of [`E2B_PROJECT`] kept in `<data-dir>/e2b.key`, made (with the project) when
/// missing or no longer valid.
fn e2b_key(iam: &dyn Iam, dir: &Path) -> Result<String> {
    let path = dir.join("e2b.key");
    // In E2B's format (`e2b_` and 40 hex digits): wrappers of the E2B SDK check the shape.
    if let Ok(k) = std::fs::read_to_string(&path)
        && k.trim().starts_with(dsec_iam::E2B_KEY_PREFIX)
        && iam
            .authenticate(k.trim())
            .is_some_and(|p| p.project == E2B_PROJECT)
    {
        return Ok(k.trim().to_string());
    }
    if !iam
        .projects(ROOT)?
        .iter()
        .any(|p| p.project.path == E2B_PROJECT)
    {
        iam.apply(dsec_iam::Command::CreateProject {
            actor: ROOT.to_string(),
            path: E2B_PROJECT.to_string(),
            quota: Default::default(),
            now_ms: dsec_iam::now_ms(),
        })?;
    }
    let (k, _) = dsec_iam::create_key_as(
        iam,
        ROOT,
        E2B_PROJECT,
        "e2b",
        PrincipalKind::Human,
        dsec_iam::KeyFormat::E2b,
    )?;
    write_private(&path, &k)?;
    Ok(k)
}

/// The secret sandbox access tokens are signed with, from `path` (made there if it is
/// missing), so tokens survive restarts; gateways of one deployment share it.
pub(crate) fn gateway_secret(path: &Path) -> Result<String> {
    match std::fs::read_to_string(path) {
        Ok(s) if !s.trim().is_empty() => Ok(s.trim().to_string()),
        _ => {
            let s = dsec_iam::generate_key();
            write_private(path, &s)?;
            Ok(s)
        }
    }
}

/// The gateway `dsec up` runs; its secret is `<data-dir>/gateway-secret`. `key` is its
/// own (it looks sandboxes up); `user_key` goes to `e2b.env`.
#[allow(clippy::too_many_arguments)]
async fn bind_gateway(
    dir: &Path,
    table: Option<GatewayToml>,
    flag: Option<SocketAddr>,
    api: SocketAddr,
    api_url: &str,
    key: &str,
    user_key: &str,
    builder: Option<Arc<dyn dsec_gateway::Builder>>,
    in_process: Option<dsec_gateway::upstream::InProcess>,
) -> Result<Option<(tokio::net::TcpListener, axum::Router)>> {
    let env_path = dir.join(E2B_ENV);
    let _ = std::fs::remove_file(&env_path);
    let table = table.unwrap_or(GatewayToml {
        enabled: true,
        listen: None,
        domain: None,
        templates: Default::default(),
    });
    if !table.enabled {
        return Ok(None);
    }
    // An address that was asked for must be had; the default is given up with a warning
    // (test and benchmark servers use neighbouring ports, hence the distant default).
    let (addr, explicit) = match flag.or(table.listen) {
        Some(a) => (a, true),
        None => match api.port().checked_add(GATEWAY_PORT_OFFSET) {
            Some(p) => (SocketAddr::new(api.ip(), p), false),
            None => {
                tracing::warn!(
                    "no E2B gateway: API port {} + {GATEWAY_PORT_OFFSET} is not a port; use --e2b-listen",
                    api.port()
                );
                return Ok(None);
            }
        },
    };
    let listener = match super::listen(addr).await {
        Ok(l) => l,
        Err(e) if !explicit => {
            tracing::warn!("no E2B gateway: cannot listen on {addr} ({e}); use --e2b-listen");
            return Ok(None);
        }
        Err(e) => {
            return Err(e).with_context(|| {
                format!("cannot listen on {addr} for the E2B gateway (use another --e2b-listen, or [gateway] enabled = false in config.toml)")
            });
        }
    };
    let secret = gateway_secret(&dir.join("gateway-secret"))?;
    let mut templates = dsec_gateway::default_templates();
    templates.extend(table.templates);
    let bound = listener.local_addr().unwrap_or(addr);
    let app = dsec_gateway::router(dsec_gateway::Config {
        api_url: api_url.to_string(),
        service_key: key.to_string(),
        secret: secret.into_bytes(),
        templates,
        domain: Some(
            table
                .domain
                .unwrap_or_else(|| format!("localhost:{}", bound.port())),
        ),
        builder,
        in_process,
    });
    let url = format!("http://{bound}");
    write_private(
        &env_path,
        &format!(
            "E2B_API_URL={url}\nE2B_SANDBOX_URL={url}\nE2B_VOLUME_API_URL={url}\nE2B_API_KEY={user_key}\n"
        ),
    )?;
    tracing::info!("E2B gateway listening on {url}");
    Ok(Some((listener, app)))
}

/// Written by a stopping server as its sandboxes stop: `{"left": n, "total": m}`.
const STOPPING: &str = "stopping.json";
/// How long `dsec down` waits without a sandbox stopping before it calls it a hang.
const STOP_STALL: Duration = Duration::from_secs(60);

fn read_stopping(dir: &Path) -> Option<(usize, usize)> {
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(STOPPING)).ok()?).ok()?;
    Some((v["left"].as_u64()? as usize, v["total"].as_u64()? as usize))
}

/// `dsec down`'s progress: a bar on a terminal, a line every few seconds otherwise.
struct Stopping {
    bar: Option<indicatif::ProgressBar>,
    last_line: Option<Instant>,
    printed: Option<(usize, usize)>,
}

impl Stopping {
    fn new() -> Stopping {
        use std::io::IsTerminal;
        Stopping {
            bar: std::io::stderr()
                .is_terminal()
                .then(indicatif::ProgressBar::hidden),
            last_line: None,
            printed: None,
        }
    }

    fn show(&mut self, left: usize, total: usize) {
        if total == 0 || self.printed == Some((left, total)) {
            return;
        }
        match &self.bar {
            Some(b) => {
                if b.is_hidden() {
                    b.set_draw_target(indicatif::ProgressDrawTarget::stderr());
                    b.set_style(
                        indicatif::ProgressStyle::with_template(
                            "stopping sandboxes [{bar:30}] {pos}/{len} {elapsed}",
                        )
                        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
                    );
                }
                b.set_length(total as u64);
                b.set_position((total - left) as u64);
            }
            None => {
                if left == 0
                    || self
                        .last_line
                        .is_none_or(|t| t.elapsed() > Duration::from_secs(2))
                {
                    eprintln!("stopped {} of {total} sandboxes", total - left);
                    self.last_line = Some(Instant::now());
                    self.printed = Some((left, total));
                }
            }
        }
    }

    fn done(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

pub async fn down(a: DownArgs) -> Result<i32> {
    let dir = &a.data.data_dir;
    let Some(pid) = read_pid(dir) else {
        println!(
            "OpenDsec is not running (no live pid in {}).",
            pid_file(dir).display()
        );
        return Ok(0);
    };
    let sig = if a.keep_sandboxes {
        libc::SIGUSR2
    } else {
        libc::SIGTERM
    };
    // A stale progress file of an earlier run must not be read as this one's.
    let _ = std::fs::remove_file(dir.join(STOPPING));
    // SAFETY: signalling the server whose pid file we read.
    unsafe { libc::kill(pid, sig) };
    let t0 = Instant::now();
    let mut shown = Stopping::new();
    let mut last_change = Instant::now();
    let mut last: Option<(usize, usize)> = None;
    // SAFETY (the loop's kill): signal 0 only asks whether the process is there.
    while unsafe { libc::kill(pid, 0) } == 0 {
        let now = read_stopping(dir);
        if now.is_some() && now != last {
            last = now;
            last_change = Instant::now();
            if let Some((left, total)) = now {
                shown.show(left, total);
            }
        }
        // As long as sandboxes keep stopping, it waits; a minute without any is a hang.
        if last_change.elapsed() > STOP_STALL {
            shown.done();
            bail!(
                "server pid {pid} made no progress for {} s{}; it is still running (see {})",
                STOP_STALL.as_secs(),
                last.map(|(l, t)| format!(" with {l} of {t} sandboxes left"))
                    .unwrap_or_default(),
                dir.join("dsec.log").display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The server removes its progress file once every sandbox has stopped: gone with it,
    // all of them are; still there, it ended with some left.
    match (read_stopping(dir), last) {
        (Some((left, total)), _) => shown.show(left, total),
        (None, Some((_, total))) => shown.show(0, total),
        (None, None) => {}
    }
    shown.done();
    println!(
        "OpenDsec stopped in {:.1} s{}.",
        t0.elapsed().as_secs_f64(),
        if a.keep_sandboxes {
            "; sandboxes left running"
        } else {
            ""
        }
    );
    Ok(0)
}

pub async fn status(a: StatusArgs) -> Result<i32> {
    let cfg = client::resolve(
        a.api.api_url.as_deref(),
        a.api.api_key.as_deref(),
        Some(&a.data.data_dir),
    )?;
    let api = Api::new(&cfg)?;
    let s: ClusterStatus = api.call(Method::GET, "/v1/status", None::<&()>).await?;
    if a.api.json {
        output::print_json(&s);
        return Ok(0);
    }
    println!("OpenDsec {} at {}", s.version, cfg.api_url);
    let rows = s
        .nodes
        .iter()
        .map(|n| {
            vec![
                n.name.clone(),
                if n.healthy {
                    "healthy".into()
                } else {
                    "unhealthy".into()
                },
                n.sandboxes.to_string(),
                format!("{} cores ({:.1} committed)", n.cpus, n.committed_cpu_cores),
                format!(
                    "{}/{} MiB free ({} committed)",
                    n.memory_available_mb, n.memory_total_mb, n.committed_memory_mb
                ),
                format!("{} MiB", n.disk_free_mb),
                n.cgroup_mode.clone(),
            ]
        })
        .collect();
    println!(
        "{}",
        output::table(
            &[
                "node",
                "health",
                "sandboxes",
                "cpu",
                "memory",
                "disk free",
                "cgroups"
            ],
            rows
        )
    );
    let rows = s
        .nodes
        .iter()
        .flat_map(|n| {
            n.backends.iter().map(move |b| {
                vec![
                    n.name.clone(),
                    b.name.clone(),
                    if b.available {
                        "yes".into()
                    } else {
                        "no".into()
                    },
                    b.detail.clone(),
                ]
            })
        })
        .collect();
    println!(
        "{}",
        output::table(&["node", "backend", "available", "detail"], rows)
    );
    let rows: Vec<Vec<String>> = s
        .nodes
        .iter()
        .flat_map(|n| {
            n.pools.iter().map(move |p| {
                vec![
                    n.name.clone(),
                    p.name.clone(),
                    p.image.clone(),
                    p.backend.clone(),
                    format!("{}/{}", p.ready, p.size),
                ]
            })
        })
        .collect();
    if !rows.is_empty() {
        println!(
            "{}",
            output::table(&["node", "pool", "image", "backend", "ready"], rows)
        );
    }
    Ok(0)
}

/// Streamed answers (exec output, the gateway's Connect streams) are many small writes:
/// without TCP_NODELAY each can wait for the peer's delayed ACK (40 ms).
pub(crate) fn no_delay(tcp: &mut tokio::net::TcpStream) {
    let _ = tcp.set_nodelay(true);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gateway_table_parses_and_rejects_unknown_keys() {
        let c: ServerConfig = toml::from_str(
            "[gateway]\nlisten = \"127.0.0.1:9\"\ndomain = \"sb.example.com\"\n[gateway.templates]\nmine = \"root/x:1\"\nvm = { image = \"root/y:2\", backend = \"vm\" }\n",
        )
        .unwrap();
        let g = c.gateway.unwrap();
        assert!(g.enabled);
        assert_eq!(g.listen, Some("127.0.0.1:9".parse().unwrap()));
        assert_eq!(g.domain.as_deref(), Some("sb.example.com"));
        assert_eq!(g.templates["mine"].image(), "root/x:1");
        assert_eq!(g.templates["mine"].backend(), None);
        assert_eq!(g.templates["vm"].image(), "root/y:2");
        assert_eq!(g.templates["vm"].backend(), Some("vm"));
        assert!(toml::from_str::<ServerConfig>("[gateway]\nport = 1\n").is_err());
    }

    #[tokio::test]
    async fn the_gateway_writes_e2b_env_unless_disabled() {
        let d = tempfile::tempdir().unwrap();
        let api: SocketAddr = "127.0.0.1:7600".parse().unwrap();
        let g = bind_gateway(
            d.path(),
            None,
            Some("127.0.0.1:0".parse().unwrap()),
            api,
            "http://127.0.0.1:7600",
            "dsk.k",
            "dsk.user",
            None,
            None,
        )
        .await
        .unwrap();
        let port = g.unwrap().0.local_addr().unwrap().port();
        let env = std::fs::read_to_string(d.path().join(E2B_ENV)).unwrap();
        assert!(env.contains(&format!("E2B_API_URL=http://127.0.0.1:{port}\n")));
        assert!(env.contains(&format!("E2B_SANDBOX_URL=http://127.0.0.1:{port}\n")));
        assert!(
            env.contains("E2B_API_KEY=dsk.user\n"),
            "the tenant key, not the admin's"
        );
        let secret = std::fs::read_to_string(d.path().join("gateway-secret")).unwrap();
        assert!(!secret.trim().is_empty());
        let off = GatewayToml {
            enabled: false,
            listen: None,
            domain: None,
            templates: Default::default(),
        };
        let g = bind_gateway(
            d.path(),
            Some(off),
            None,
            api,
            "http://x",
            "dsk.k",
            "dsk.user",
            None,
            None,
        )
        .await
        .unwrap();
        assert!(g.is_none());
        assert!(!d.path().join(E2B_ENV).exists());
    }
}
