//! `dsec serve --config FILE`: one role of a multi-node cluster (iam, apiserver, watcher
//! or edge), configured by one TOML file per role (examples in `deploy/cluster/`).
//! Components talk HTTP over mutual TLS with certificates from `dsec certs`; each listener
//! admits only the roles that call it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use axum::extract::{Extension, Request};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use dsec_edge::EdgeConfig;
use dsec_iam::{Iam, PrincipalKind, ROOT, RaftConfig, RaftIam, RemoteIam};
use dsec_mtls::{Identity, Role, Tls, TlsFiles};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoleConfig {
    pub role: Role,
    /// Component name; an edge's is the node name inside its sandbox ids.
    pub name: String,
    pub data_dir: PathBuf,
    /// The cluster listener (mutual TLS).
    pub listen: SocketAddr,
    /// Apiserver only: the public REST API (plain HTTP; put TLS in front of it).
    #[serde(default)]
    pub public_listen: Option<SocketAddr>,
    pub tls: TlsFiles,
    #[serde(default)]
    pub cluster: ClusterSection,
    #[serde(default)]
    pub iam: Option<IamSection>,
    #[serde(default)]
    pub edge: Option<EdgeConfig>,
    #[serde(default)]
    pub watcher: Option<WatcherSection>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSection {
    /// Every IAM replica's cluster listener, `host:port`.
    #[serde(default)]
    pub iam: Vec<String>,
    #[serde(default)]
    pub watcher: Option<String>,
    /// Edge name → its cluster listener.
    #[serde(default)]
    pub edges: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IamSection {
    /// This replica's Raft id (unique, never reused).
    pub id: u64,
    /// The initial members, id → cluster listener; the lowest id creates the cluster.
    pub members: BTreeMap<String, String>,
    /// Where the replica that creates the cluster writes the first admin key.
    #[serde(default)]
    pub bootstrap_key_file: Option<PathBuf>,
    /// How often the leader tells the others it is there (ms; default 100).
    #[serde(default)]
    pub heartbeat_ms: Option<u64>,
    /// A follower that hears no leader for a random time in [min, max] ms starts an
    /// election (default [500, 1000]). Raise both, with the heartbeat, where replicas
    /// share loaded or slow machines, so that a late heartbeat does not start elections.
    #[serde(default)]
    pub election_timeout_ms: Option<[u64; 2]>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WatcherSection {
    #[serde(default = "default_poll_ms")]
    pub poll_ms: u64,
}

fn default_poll_ms() -> u64 {
    500
}

impl RoleConfig {
    pub fn load(path: &Path) -> Result<RoleConfig> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let cfg: RoleConfig =
            toml::from_str(&text).with_context(|| format!("{} is not valid", path.display()))?;
        Identity::new(cfg.role, &cfg.name)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        match cfg.role {
            Role::Monitor => bail!(
                "{}: monitor is the role of a metrics scraper's certificate (Prometheus), not a component to serve",
                path.display()
            ),
            Role::Iam if cfg.iam.is_none() => {
                bail!("{}: role iam needs an [iam] table", path.display())
            }
            Role::Apiserver if cfg.public_listen.is_none() => {
                bail!("{}: role apiserver needs public_listen", path.display())
            }
            Role::Apiserver | Role::Edge if cfg.cluster.iam.is_empty() => {
                bail!(
                    "{}: [cluster] iam must list the IAM replicas",
                    path.display()
                )
            }
            Role::Apiserver | Role::Watcher if cfg.cluster.edges.is_empty() => {
                bail!("{}: [cluster.edges] must name the edges", path.display())
            }
            Role::Edge if !dsec_common::id::valid_edge_name(&cfg.name) => bail!(
                "{}: an edge's name is 1-32 of [a-z0-9], starting with a letter (it is part of sandbox ids)",
                path.display()
            ),
            _ => {}
        }
        Ok(cfg)
    }
}

/// Resolves on SIGTERM/SIGINT (`Some(true)`: stop sandboxes) or SIGUSR2 (`Some(false)`).
async fn stop_signal() -> bool {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int), Ok(mut keep)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::user_defined2()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => true,
        _ = int.recv() => true,
        _ = keep.recv() => false,
    }
}

async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener> {
    super::listen(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))
}

pub async fn run(path: &Path) -> Result<i32> {
    super::up::init_tracing();
    dsec_mtls::install_provider();
    let cfg = RoleConfig::load(path)?;
    std::fs::create_dir_all(&cfg.data_dir)
        .with_context(|| format!("creating {}", cfg.data_dir.display()))?;
    let tls = Tls::load(&cfg.tls).map_err(|e| anyhow::anyhow!("loading [tls]: {e}"))?;
    if tls.identity.role != cfg.role {
        bail!(
            "{} is a certificate for {}, but this component is role {}",
            cfg.tls.cert.display(),
            tls.identity,
            cfg.role
        );
    }
    tracing::info!(role = %cfg.role, name = %cfg.name, listen = %cfg.listen, "starting");
    match cfg.role {
        Role::Iam => run_iam(cfg, tls).await,
        Role::Apiserver => run_apiserver(cfg, tls).await,
        Role::Watcher => run_watcher(cfg, tls).await,
        Role::Edge => run_edge(cfg, tls).await,
        Role::Monitor => bail!("monitor is not a role to serve"),
    }
}

/// Only replicas may use the Raft routes; apiservers and edges use the IAM service.
async fn replicas_only(Extension(peer): Extension<Identity>, req: Request, next: Next) -> Response {
    if req.uri().path().starts_with("/raft/") && peer.role != Role::Iam {
        tracing::warn!(peer = %peer, "refused a Raft call from a component that is not a replica");
        return (
            axum::http::StatusCode::FORBIDDEN,
            "only IAM replicas may call /raft",
        )
            .into_response();
    }
    next.run(req).await
}

async fn run_iam(cfg: RoleConfig, tls: Tls) -> Result<i32> {
    let Some(section) = &cfg.iam else {
        bail!("role iam needs an [iam] table");
    };
    let mut members = Vec::new();
    for (id, addr) in &section.members {
        let id: u64 = id
            .parse()
            .with_context(|| format!("[iam] members: {id:?} is not a numeric id"))?;
        members.push((id, addr.clone()));
    }
    members.sort();
    let own = members
        .iter()
        .find(|(id, _)| *id == section.id)
        .map(|(_, a)| a.clone())
        .unwrap_or_else(|| cfg.listen.to_string());
    let raft_dir = cfg.data_dir.join("raft");
    let fresh = !raft_dir.join("raft-log.redb").exists();
    let mut rc = RaftConfig::new(section.id, own, &raft_dir);
    rc.tls = Some(tls.client.clone());
    if let Some(ms) = section.heartbeat_ms {
        rc.heartbeat = Duration::from_millis(ms.max(10));
    }
    if let Some([lo, hi]) = section.election_timeout_ms {
        if lo <= rc.heartbeat.as_millis() as u64 || hi <= lo {
            bail!(
                "[iam] election_timeout_ms = [{lo}, {hi}]: both must exceed heartbeat_ms ({} ms) and max must exceed min",
                rc.heartbeat.as_millis()
            );
        }
        rc.election_timeout = (Duration::from_millis(lo), Duration::from_millis(hi));
    }
    let node = RaftIam::open(rc).await?;
    let app = node
        .router()
        .merge(dsec_iam::service::router(node.clone()))
        .merge(dsec_common::http::health())
        .layer(middleware::from_fn(replicas_only));
    let listener = bind(cfg.listen).await?;
    let server_tls = tls.clone();
    let server = tokio::spawn(async move {
        dsec_mtls::serve(
            listener,
            &server_tls,
            &[Role::Iam, Role::Apiserver, Role::Edge],
            app,
            async {
                stop_signal().await;
            },
        )
        .await
    });
    let first = members.first().map(|(id, _)| *id) == Some(section.id);
    if fresh && first {
        tracing::info!(members = members.len(), "creating the IAM cluster");
        node.initialize(&members).await?;
    }
    node.wait_for_leader(Duration::from_secs(120))
        .await
        .context("no IAM leader was elected")?;
    if let Some(file) = &section.bootstrap_key_file {
        write_bootstrap_key(&node, file).await?;
    }
    tracing::info!(id = section.id, "IAM replica serving");
    server.await??;
    let _ = node.shutdown().await;
    Ok(0)
}

/// Writes the first admin key to `file`, once: when the file is missing and the cluster has
/// no keys. Elections can go on for a while after the first leader (replicas on a loaded
/// host miss each other's heartbeats): a write refused for want of a leader is tried
/// again, for up to two minutes, rather than ending the replica.
async fn write_bootstrap_key(node: &RaftIam, file: &Path) -> Result<()> {
    const WITHIN: Duration = Duration::from_secs(120);
    let t0 = std::time::Instant::now();
    // After a failed try the key may still have been made (the answer was lost): make
    // another rather than leave the cluster with none anyone holds.
    let mut tried = false;
    loop {
        if file.exists() {
            return Ok(());
        }
        let made = match node.keys(ROOT) {
            Ok(k) if !k.is_empty() && !tried => return Ok(()),
            Ok(_) => dsec_iam::create_key(node, ROOT, ROOT, "admin", PrincipalKind::Human),
            Err(e) => Err(e),
        };
        match made {
            Ok((key, _)) => {
                super::up::write_private(file, &format!("{key}\n"))?;
                tracing::info!(file = %file.display(), "wrote the first admin key");
                return Ok(());
            }
            Err(dsec_iam::IamError::Storage(m)) if t0.elapsed() < WITHIN => {
                tracing::warn!("writing the first admin key: {m}; trying again");
                tried = true;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e).context("writing the first admin key"),
        }
    }
}

async fn run_apiserver(cfg: RoleConfig, tls: Tls) -> Result<i32> {
    let client = dsec_mtls::Client::new(Some(tls.client.clone()));
    let iam = RemoteIam::new(cfg.cluster.iam.clone(), Some(tls.client.clone()));
    let cluster = dsec_apiserver::Cluster::new(
        dsec_apiserver::ClusterConfig {
            edges: cfg.cluster.edges.clone(),
            watcher: cfg.cluster.watcher.clone(),
            refresh: Duration::from_millis(500),
        },
        iam,
        client,
        dsec_rpc::Channels::new(Some(tls.client.clone())),
    );
    let refresh = cluster.spawn_refresh();
    let internal = bind(cfg.listen).await?;
    dsec_mtls::server::spawn(internal, &tls, &Role::ALL, dsec_common::http::health());
    let public_addr = cfg.public_listen.context("public_listen is required")?;
    let public = bind(public_addr).await?;
    tracing::info!("public API on http://{public_addr}");
    axum::serve(public, dsec_apiserver::router(cluster))
        .with_graceful_shutdown(async {
            stop_signal().await;
        })
        .await?;
    refresh.abort();
    Ok(0)
}

async fn run_watcher(cfg: RoleConfig, tls: Tls) -> Result<i32> {
    let every = Duration::from_millis(cfg.watcher.as_ref().map_or(500, |w| w.poll_ms.max(50)));
    let endpoints = cfg
        .cluster
        .edges
        .iter()
        .map(|(name, addr)| dsec_watcher::EdgeEndpoint {
            name: name.clone(),
            addr: addr.clone(),
        })
        .collect();
    let poller = dsec_watcher::Poller::new(
        endpoints,
        Duration::from_secs(2),
        dsec_rpc::Channels::new(Some(tls.client.clone())),
        dsec_apiserver::component_auth(&cfg.name),
    );
    let view = poller.view();
    let polling = tokio::spawn(poller.run(every));
    let app = dsec_watcher::router(view).merge(dsec_common::http::health());
    let listener = bind(cfg.listen).await?;
    dsec_mtls::serve(listener, &tls, &[Role::Apiserver], app, async {
        stop_signal().await;
    })
    .await?;
    polling.abort();
    Ok(0)
}

async fn run_edge(cfg: RoleConfig, tls: Tls) -> Result<i32> {
    let mut edge_cfg = super::up::edge_config(cfg.edge.clone(), &cfg.data_dir);
    edge_cfg.name = cfg.name.clone();
    let iam: Arc<dyn Iam> = Arc::new(RemoteIam::new(
        cfg.cluster.iam.clone(),
        Some(tls.client.clone()),
    ));
    let (edge, reaper) = super::up::start_edge(edge_cfg, iam.clone()).await?;
    let others: std::collections::BTreeMap<String, String> = cfg
        .cluster
        .edges
        .iter()
        .filter(|(name, _)| **name != cfg.name)
        .map(|(n, a)| (n.clone(), a.clone()))
        .collect();
    // The store's lazy file system asks the other edges for chunks before the registry.
    if let Err(e) =
        dsec_edge_api::transfer::write_lazy_peers(edge.images().root(), &cfg.tls, &others)
    {
        tracing::warn!("lazy images will not fetch chunks from other edges: {e}");
    }
    // A resume or fork placed on another edge pulls the state from here, or from there.
    edge.set_peers(Arc::new(dsec_edge_api::transfer::MtlsPeers::new(
        dsec_mtls::Client::new(Some(tls.client.clone())),
        others,
    )));
    let state = dsec_edge_api::AppState {
        edge: edge.clone(),
        iam,
        forwarded: true,
    };
    // REST (and the byte streams the apiservers forward) and the gRPC control calls, on
    // one mutual-TLS listener.
    let app = dsec_edge_api::router(state.clone())
        .merge(dsec_rpc::routes(dsec_edge_api::grpc::service(state)));
    let listener = bind(cfg.listen).await?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let server = dsec_mtls::serve(
        listener,
        &tls,
        &[Role::Apiserver, Role::Watcher, Role::Edge],
        app,
        async move {
            let _ = tx.send(stop_signal().await);
        },
    );
    tracing::info!("edge serving the cluster on {}", cfg.listen);
    server.await?;
    reaper.abort();
    if rx.await.unwrap_or(true) {
        tracing::info!("stopping all sandboxes");
        edge.stop_all(|left, total| {
            if left % 100 == 0 || left == 0 {
                tracing::info!("{} of {total} sandboxes stopped", total - left);
            }
        })
        .await;
    } else {
        tracing::info!("leaving sandboxes running for the next start");
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_example_configs_in_deploy_load() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/cluster");
        for (file, role) in [
            ("iam.toml", Role::Iam),
            ("apiserver.toml", Role::Apiserver),
            ("watcher.toml", Role::Watcher),
            ("edge.toml", Role::Edge),
        ] {
            let cfg = RoleConfig::load(&dir.join(file)).unwrap_or_else(|e| panic!("{file}: {e:#}"));
            assert_eq!(cfg.role, role, "{file}");
        }
    }

    #[test]
    fn a_config_missing_what_its_role_needs_is_refused_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.toml");
        let base = "name = \"e-1\"\ndata_dir = \"/tmp/x\"\nlisten = \"127.0.0.1:1\"\n[tls]\nca = \"a\"\ncert = \"b\"\nkey = \"c\"\n";
        let cases = [
            ("role = \"apiserver\"\n", "public_listen"),
            ("role = \"iam\"\n", "[iam]"),
            ("role = \"edge\"\n", "[cluster] iam"),
            ("role = \"king\"\n", "king"),
        ];
        for (role, needle) in cases {
            std::fs::write(&p, format!("{role}{base}")).unwrap();
            let e = format!("{:#}", RoleConfig::load(&p).unwrap_err());
            assert!(e.contains(needle), "{role}: {e}");
        }
        std::fs::write(
            &p,
            format!("role = \"edge\"\n{base}[cluster]\niam = [\"127.0.0.1:2\"]\n"),
        )
        .unwrap();
        let e = format!("{:#}", RoleConfig::load(&p).unwrap_err());
        assert!(e.contains("part of sandbox ids"), "{e}");
    }
}
