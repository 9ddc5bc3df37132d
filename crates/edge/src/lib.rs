//! The edge: one per compute node. It owns the node's sandboxes (create, exec, fork, stop,
//! TTL), drives the backends, keeps its registry on disk and re-adopts live sandboxes
//! after a restart. It has the final say on admission.
//!
//! [`Edge`] is defined here with its start; its methods are kept by concern:
//! `lifecycle.rs` (create, exec, network rules, stop), `fork.rs`, `pause.rs` (pause,
//! resume, groups), `adopt.rs` (re-adoption, the reaper, the sampler), `transfer.rs`
//! (state between edges), `snapshots.rs`, `commit.rs`, `runtime.rs` (processes, files,
//! sessions).

mod adopt;
pub mod backend;
mod build;
pub mod cgroup;
pub mod channel;
mod commit;
pub use commit::layers_in_use;
pub mod config;
mod deaths;
pub mod error;
pub mod events;
mod fork;
pub mod functions;
pub mod host;
mod lifecycle;
mod metrics;
pub(crate) use lifecycle::StopReason;
pub mod mountns;
pub mod net;
mod pause;
mod pools;
pub mod registry;
pub mod runtime;
mod samples;
mod snapshots;
pub mod spawn;
pub mod trajectory;
pub mod transfer;
mod validate;
pub mod volumes;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dsec_common::ApiError;
use dsec_common::api::{
    Capability, CreateSandboxRequest, ExecRequest, ExecResult, ForkRequest, ForkResponse,
    NodeStatus, SandboxInfo, SandboxState,
};
use dsec_common::channel::{ExecSpec, Request, Response, StartSpec};
use dsec_common::id::SandboxId;
use dsec_image::{ImageRef, ImageStore};

use backend::container::ContainerBackend;
use backend::{Backend, SandboxPaths};
pub use config::EdgeConfig;
use registry::{Registry, SandboxRecord, now_ms};

/// A quota call under way.
pub type Pending<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

/// The quota gate: every sandbox holds a reservation in its project from before it starts
/// until it is gone (stopped, expired, dead). IAM implements it.
pub trait Quotas: Send + Sync {
    /// Awaited without holding a thread: many creates at once are one batch of writes
    /// (see `Iam::apply_async`), not one at a time on a bounded set of threads.
    fn reserve(&self, rec: &SandboxRecord) -> Pending<Result<(), ApiError>>;
    /// Holds `bytes` of disk in `project` for something this edge keeps under `id` (a
    /// snapshot, a committed image), replacing what `id` held before.
    fn hold_disk(&self, id: &str, project: &str, edge: &str, bytes: u64) -> Result<(), ApiError>;
    /// Releases a sandbox's reservation, or what a kept thing held (awaited as
    /// [`Quotas::reserve`] is).
    fn release(&self, sandbox_id: &str) -> Pending<()>;
    /// After a restart: drop the reservations of this edge's sandboxes (and kept things)
    /// not in `live`.
    fn reconcile(&self, edge: &str, live: Vec<String>);
}

/// Longest path a unix socket can have, less room for the file name.
const MAX_STATE_DIR_LEN: usize = 70;

pub(crate) struct Entry {
    rec: Mutex<SandboxRecord>,
    /// Serialises stop and fork. Exec takes no lock: a stop must never wait for a
    /// long-running command (it kills it).
    op: tokio::sync::Mutex<()>,
    /// Agent connections kept open between execs.
    agent: channel::Kept,
    /// Its resource use over time.
    samples: samples::Ring,
}

impl Entry {
    fn snapshot(&self) -> SandboxRecord {
        self.rec.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
    fn update<R>(&self, f: impl FnOnce(&mut SandboxRecord) -> R) -> R {
        f(&mut self.rec.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

pub struct Edge {
    cfg: EdgeConfig,
    images: ImageStore,
    /// Mounts lazy image layers; none when the node cannot or is told not to.
    lazy: Option<dsec_image::lazy::LazyMounter>,
    registry: Registry,
    backends: BTreeMap<&'static str, Arc<dyn Backend>>,
    sandboxes: Mutex<HashMap<String, Arc<Entry>>>,
    mode: cgroup::CgroupMode,
    creating: AtomicU64,
    fork_tmp: PathBuf,
    trajectories: trajectory::Logs,
    /// Turns to start a sandbox (`create_parallelism`), given in arrival order.
    create_turns: tokio::sync::Semaphore,
    functions: functions::Functions,
    /// Quota calls under way at once (see [`Edge::quota`]).
    quota_turns: tokio::sync::Semaphore,
    quotas: Option<Arc<dyn Quotas>>,
    /// Sandbox networking; `None` when `[edge.network] enabled = false`.
    net: Option<Arc<net::Network>>,
    dns: Vec<tokio::task::JoinHandle<()>>,
    /// The egress header proxy (`net/headers.rs`), with networking.
    headers: Option<Arc<net::headers::HeaderProxy>>,
    /// Saved states offered to other edges (a resume or fork placed there).
    offers: transfer::Offers,
    /// The other edges of the cluster; unset on a single machine.
    peers: std::sync::OnceLock<Arc<dyn transfer::Peers>>,
    snapshot_locks: snapshots::Locks,
    /// Sandboxes whose first process the kernel watches (the others' agents are polled),
    /// and where their deaths arrive until the reaper takes them.
    deaths: Option<Arc<deaths::Deaths>>,
    died: Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<String>>>,
    /// Warm pools (`[[edge.pools]]`).
    pools: pools::Pools,
    volumes: volumes::Volumes,
    /// Lifecycle events and webhooks.
    events: Arc<events::Events>,
}

/// Runs an operation that changes a sandbox as a task of its own, so it ends in a
/// consistent state even when the request that started it is dropped (the client left).
async fn finish<T: Send + 'static>(
    op: impl std::future::Future<Output = Result<T, ApiError>> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::spawn(op)
        .await
        .map_err(|e| ApiError::internal(format!("worker failed: {e}")))?
}

/// After a VM's memory was restored (fork copy, resume): its clock, RNG and id (see
/// [`Request::Restored`]). Also the wait for the agent to answer (safe to repeat).
async fn tell_restored(
    channel: &Path,
    id: &str,
    within: Duration,
    alive: impl Fn() -> bool,
) -> Result<(), ApiError> {
    let req = Request::Restored {
        sandbox_id: id.to_string(),
        unix_ms: now_ms(),
        entropy: random_hex(64),
    };
    channel::wait_ready_ok(channel, &req, within, alive).await
}

/// After a fresh start: the environment and working directory commands start from (a
/// VM's init has neither; a container's agent is told the same it was started with).
/// Also the wait for the agent to answer (setting them twice changes nothing).
async fn tell_environment(
    channel: &Path,
    rec: &SandboxRecord,
    within: Duration,
    alive: impl Fn() -> bool,
) -> Result<(), ApiError> {
    channel::wait_ready_ok(channel, &environment_request(rec), within, alive).await
}

/// What the agent is told of the sandbox's environment and working directory.
fn environment_request(rec: &SandboxRecord) -> Request {
    let mut env = rec.env.clone();
    env.insert("DSEC_SANDBOX_ID".into(), rec.id.clone());
    // A VM mounts its volumes itself, from the virtio-fs devices its backend attached; a
    // container's are in place before its agent starts.
    let mounts = if rec.backend == "vm" {
        volumes::guest_mounts(&rec.volumes)
    } else {
        Vec::new()
    };
    Request::Environment {
        env,
        workdir: rec.workdir.clone(),
        mounts,
    }
}

/// How long an image's start command may take to become ready, unless it says.
const START_READY_TIMEOUT_S: u64 = 60;

/// Starts the image's start command in the background (tagged `start`) and waits until
/// its `ready` command succeeds.
async fn start_command(channel: &Path, s: &dsec_image::store::StartCmd) -> Result<(), ApiError> {
    let sh = |cmd: &str, timeout_ms: Option<u64>| ExecSpec {
        argv: vec!["/bin/sh".into(), "-c".into(), cmd.into()],
        timeout_ms,
        max_output_bytes: 4096,
        ..Default::default()
    };
    let req = Request::Start(StartSpec {
        exec: sh(&s.run, None),
        tag: Some("start".into()),
        ..Default::default()
    });
    match channel::call(channel, &req, Duration::from_secs(10)).await? {
        Response::Started { .. } => {}
        other => return Err(channel::unexpected(&other)),
    }
    let Some(ready) = &s.ready else {
        return Ok(());
    };
    let within = Duration::from_secs(s.ready_timeout_seconds.unwrap_or(START_READY_TIMEOUT_S));
    let t0 = std::time::Instant::now();
    loop {
        let last = match channel::call(
            channel,
            &Request::Exec(sh(ready, Some(5000))),
            Duration::from_secs(10),
        )
        .await?
        {
            Response::Exec(r) if r.exit_code == 0 && !r.timed_out => return Ok(()),
            Response::Exec(r) => format!("{}{}", r.stdout, r.stderr),
            other => return Err(channel::unexpected(&other)),
        };
        if t0.elapsed() > within {
            return Err(ApiError::precondition(format!(
                "the image's start command ({}) was not ready within {} s: `{ready}` last said: {:?}",
                s.run,
                within.as_secs(),
                last.trim()
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("worker failed: {e}")))
}

/// Quota calls (IAM writes, each waiting for its commit) run at once on blocking threads.
const QUOTA_CALLS_AT_ONCE: usize = 16;

/// Runs `f`, which blocks waiting for work done on the async workers, on a blocking
/// thread once `turns` gives it a turn: never on a worker, and never on more blocking
/// threads than `turns` has, so the work it waits for always has threads to run on.
async fn off_workers<R: Send + 'static>(
    turns: &tokio::sync::Semaphore,
    f: impl FnOnce() -> R + Send + 'static,
) -> Result<R, ApiError> {
    let _turn = turns
        .acquire()
        .await
        .map_err(|_| ApiError::unavailable("the edge is shutting down"))?;
    blocking(f).await
}

/// Creates that may start sandboxes at once: `configured`, else twice the CPUs.
fn create_parallelism(configured: u32) -> usize {
    match configured {
        0 => 2 * std::thread::available_parallelism().map_or(2, |n| n.get()),
        n => n as usize,
    }
}

/// Raises this process's soft limit on open files to its hard limit: each sandbox holds
/// a few descriptors open here (its init's pidfd, its trajectory log, agent connections),
/// and a soft limit of 1024 would stop a node at a few hundred sandboxes.
fn raise_nofile() {
    // SAFETY: getrlimit/setrlimit with a struct we own.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &r) != 0 {
                tracing::warn!(
                    "cannot raise the open-file limit: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    }
}

impl Edge {
    /// Runs a quota call (`None` without quotas). Each is an IAM write that blocks until
    /// it is committed, which on an async worker would take the worker (`block_in_place`),
    /// and a burst of them (a thousand creates or stops at once) took every thread the
    /// runtime has, the IAM writes included: the node stopped. So they run on blocking
    /// threads, a few at a time, and the workers stay free for the writes themselves.
    pub(crate) async fn quota<R: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn Quotas) -> R + Send + 'static,
    ) -> Result<Option<R>, ApiError> {
        let Some(q) = self.quotas.clone() else {
            return Ok(None);
        };
        off_workers(&self.quota_turns, move || f(q.as_ref()))
            .await
            .map(Some)
    }

    /// Reserves `rec`'s resources in its project; nothing to do without a quota gate.
    pub(crate) async fn reserve_quota(&self, rec: &SandboxRecord) -> Result<(), ApiError> {
        match &self.quotas {
            Some(q) => q.reserve(rec).await,
            None => Ok(()),
        }
    }

    /// Releases what `id` holds.
    pub(crate) async fn release_quota(&self, id: &str) {
        if let Some(q) = &self.quotas {
            q.release(id).await;
        }
    }

    /// Opens the edge's state, probes backends and re-adopts sandboxes left running by a
    /// previous edge process (cleaning up any that died or were half-created).
    pub async fn start(cfg: EdgeConfig) -> Result<Arc<Edge>, ApiError> {
        Edge::start_with(cfg, None).await
    }

    /// [`Edge::start`] with a quota gate that every sandbox must pass.
    pub async fn start_with(
        cfg: EdgeConfig,
        quotas: Option<Arc<dyn Quotas>>,
    ) -> Result<Arc<Edge>, ApiError> {
        if !dsec_common::id::valid_edge_name(&cfg.name) {
            return Err(ApiError::invalid(format!(
                "edge name {:?} is not valid: use 1-32 lower-case letters and digits, starting with a letter",
                cfg.name
            )));
        }
        let state = cfg.state_dir.display().to_string();
        if state.len() > MAX_STATE_DIR_LEN || state.contains([',', ':']) {
            return Err(ApiError::invalid(format!(
                "edge state directory {state} must be at most {MAX_STATE_DIR_LEN} characters (unix socket paths are short) and contain no ',' or ':'"
            )));
        }
        raise_nofile();
        let images = ImageStore::open(&cfg.image_store)
            .map_err(|e| ApiError::internal(format!("opening image store: {e}")))?;
        let registry = Registry::open(&cfg.state_dir.join("sandboxes"))?;
        let fork_tmp = cfg.state_dir.join("fork-tmp");
        let _ = std::fs::remove_dir_all(&fork_tmp);
        std::fs::create_dir_all(&fork_tmp)
            .map_err(|e| ApiError::internal(format!("creating {}: {e}", fork_tmp.display())))?;
        let mode = cgroup::detect();
        cgroup::prepare_parents(mode);
        if cfg.cgroup_favor_dynmods {
            match cgroup::favor_dynmods(mode, true) {
                Ok(true) => tracing::info!(
                    "cgroup2 favordynmods turned on: a process moved into a cgroup no longer waits for an RCU grace period (cgroup_favor_dynmods = false leaves it off)"
                ),
                Ok(false) => {}
                Err(e) => tracing::warn!(
                    "cannot turn on cgroup2 favordynmods ({e}); each create waits for an RCU grace period"
                ),
            }
        }
        // Lazy layers in the store are mounted wherever the kernel can, even with lazy
        // pulls turned off; `lazy` (pulls) only where they are on.
        let mounter = lazy_mounter(&cfg, &images);
        let images = images.with_lazy(mounter.clone());
        let lazy = mounter.filter(|_| cfg.lazy_images);
        let container: Arc<dyn Backend> = Arc::new(ContainerBackend::new(
            &cfg.oci_runtime,
            &cfg.state_dir.join("runtime"),
            cfg.aether_binary.as_deref(),
            images.clone(),
            mode,
            &cfg.state_dir.join("sandboxes"),
        ));
        let vm: Arc<dyn Backend> = Arc::new(backend::vm::VmBackend::new(
            backend::find_aether(cfg.aether_binary.as_deref()),
            images.clone(),
            &cfg.state_dir.join("sandboxes"),
            &cfg.vm_ram_dir,
            mode,
            cfg.vm.clone(),
        ));
        let microvm: Arc<dyn Backend> = Arc::new(backend::microvm::MicrovmBackend::new(
            &backend::microvm::MicrovmConfig {
                binary: cfg.firecracker_binary.clone(),
                diff_snapshots: cfg.firecracker_diff_snapshots,
                run_as: cfg.firecracker_run_as.clone(),
            },
            backend::find_aether(cfg.aether_binary.as_deref()),
            images.clone(),
            &cfg.state_dir.join("sandboxes"),
            &cfg.vm_ram_dir,
            mode,
        ));
        let mut backends: BTreeMap<&'static str, Arc<dyn Backend>> = BTreeMap::new();
        backends.insert(container.name(), container);
        backends.insert(vm.name(), vm);
        backends.insert(microvm.name(), microvm);
        let (net_cfg, state_dir) = (cfg.network.clone(), cfg.state_dir.clone());
        let network = blocking(move || net::Network::start(&net_cfg, &state_dir)).await??;
        let network = Arc::new(network);
        let (net, mut dns, headers) = if network.enabled() {
            let dns = net::dns::spawn(network.clone()).await?;
            let proxy = net::headers::HeaderProxy::new(
                &cfg.state_dir.join("egress-ca"),
                &cfg.name,
                &cfg.network.header_roots,
            )
            .map_err(|e| ApiError::internal(e.to_string()))?;
            (Some(network), dns, Some(Arc::new(proxy)))
        } else {
            (None, Vec::new(), None)
        };
        if let (Some(n), Some(h)) = (&net, &headers) {
            let task = net::headers::spawn(n.clone(), h.clone(), n.gateway())
                .await
                .map_err(|e| ApiError::internal(e.to_string()))?;
            dns.push(task);
        }
        // Late in the start, so that a start that fails (the network's ports taken) leaves
        // no holder behind.
        let pools = pools::Pools::new(&cfg)?;
        let turns = create_parallelism(cfg.create_parallelism);
        let functions = functions::Functions::new(&cfg)?;
        let ns = mountns::init(&cfg.state_dir)?;
        if let Err(e) = ns.own_mount(&images.root().join("layers")) {
            tracing::warn!("{e}; creates will slow down as sandboxes accumulate");
        }
        let (died_tx, died_rx) = tokio::sync::mpsc::unbounded_channel();
        let deaths = deaths::Deaths::start(died_tx)
            .inspect_err(|e| {
                tracing::warn!("cannot watch sandbox processes ({e}); their agents are polled")
            })
            .ok();
        if let Some(m) = images.lazy().cloned() {
            // After a reboot the layers are there but not mounted.
            match blocking(move || m.mount_all()).await? {
                Ok(0) => {}
                Ok(n) => tracing::info!("{n} lazy image layers mounted"),
                Err(e) => tracing::warn!("mounting lazy image layers: {e}"),
            }
        }
        let events = events::Events::start(&cfg.events, &cfg.name, &cfg.state_dir).await?;
        let edge = Arc::new(Edge {
            cfg,
            images,
            lazy,
            registry,
            backends,
            sandboxes: Mutex::new(HashMap::new()),
            mode,
            creating: AtomicU64::new(0),
            fork_tmp,
            trajectories: trajectory::Logs::default(),
            create_turns: tokio::sync::Semaphore::new(turns),
            functions,
            quota_turns: tokio::sync::Semaphore::new(QUOTA_CALLS_AT_ONCE),
            quotas,
            net,
            dns,
            headers,
            offers: transfer::Offers::default(),
            peers: std::sync::OnceLock::new(),
            snapshot_locks: snapshots::Locks::default(),
            deaths,
            died: Mutex::new(Some(died_rx)),
            pools,
            volumes: volumes::Volumes::default(),
            events,
        });
        let e2 = edge.clone();
        blocking(move || {
            e2.load_volumes();
            e2.adopt()
        })
        .await?;
        if let Some(n) = edge.net.clone() {
            let (name, ids) = (edge.cfg.name.clone(), edge.ids());
            blocking(move || n.sweep(&name, &ids)).await?;
        }
        // Pool members back in their pools; those of a pool no longer configured go.
        let waiting: Vec<SandboxRecord> = edge
            .sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|e| e.snapshot())
            .filter(|r| r.pool_waiting.is_some())
            .collect();
        for r in waiting {
            let pool = r.pool_waiting.clone().unwrap_or_default();
            if !edge.pools.adopt(&pool, &r.id, &r) {
                tracing::info!(sandbox = %r.id, pool = %pool, "a member of a pool no longer configured; stopping");
                let _ = edge.stop(&r.id).await;
            }
        }
        if edge.quotas.is_some() {
            // A waiting pool member holds no reservation; it takes one when handed out.
            let mut live = edge.listed_ids();
            live.extend(edge.snapshot_ids());
            live.extend(edge.volume_ids());
            let e2 = edge.clone();
            live.extend(blocking(move || e2.image_hold_ids()).await?);
            let name = edge.cfg.name.clone();
            edge.quota(move |q| q.reconcile(&name, live)).await?;
        }
        metrics::watch(&edge);
        Ok(edge)
    }

    pub fn name(&self) -> &str {
        &self.cfg.name
    }

    /// Lifecycle events and webhooks.
    pub fn events(&self) -> &events::Events {
        &self.events
    }

    /// Records a lifecycle event about `rec` (see `events/`).
    pub(crate) fn event(
        &self,
        kind: &str,
        rec: &SandboxRecord,
        reason: Option<&str>,
        detail: &[(&str, serde_json::Value)],
    ) {
        let detail = detail
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        self.events.emit(kind, rec, reason, detail);
    }

    pub fn images(&self) -> &ImageStore {
        &self.images
    }

    /// The registry logins projects keep, in the image store (shared by a cluster's edges).
    pub fn registry_logins(&self) -> dsec_image::credentials::CredentialBook {
        self.images.registry_logins()
    }

    /// Registries keys outside `root` may pull from (`[edge] pull_registries`).
    pub fn pull_registries(&self) -> &[String] {
        &self.cfg.pull_registries
    }

    /// Whether a project may make this node fetch from `registry` (as the reference
    /// names it: `docker.io`, not the `index.docker.io` it resolves to): `root` from any,
    /// others from `[edge] pull_registries` only.
    pub fn may_pull_from(&self, project: &str, registry: &str) -> bool {
        project == dsec_common::project::ROOT
            || self
                .cfg
                .pull_registries
                .iter()
                .any(|a| a.eq_ignore_ascii_case(registry))
    }

    /// What mounts lazy image layers for a pull by `project` from `registry`, if this
    /// node starts images lazily and trusts that pull's layers to its kernel: a lazy
    /// layer is an EROFS image the registry made, parsed by the kernel when mounted, so
    /// only pulls by `root` and from `[edge] lazy_registries` are lazy.
    pub fn lazy_mounter(
        &self,
        project: &str,
        registry: &str,
    ) -> Option<dsec_image::lazy::LazyMounter> {
        let trusted = project == dsec_common::project::ROOT
            || self
                .cfg
                .lazy_registries
                .iter()
                .any(|a| a.eq_ignore_ascii_case(registry));
        self.lazy.clone().filter(|_| trusted)
    }

    /// Whether the node talks plain HTTP to `registry` (`[edge] insecure_registries`).
    pub fn insecure_registry(&self, registry: &str) -> bool {
        self.cfg
            .insecure_registries
            .iter()
            .any(|a| a.eq_ignore_ascii_case(registry))
    }

    fn paths(&self, id: &str) -> SandboxPaths {
        let dir = self.registry.dir(id);
        SandboxPaths {
            channel: dir.join("aether.sock"),
            dir,
        }
    }

    /// Sandboxes that belong to a project (not pool members still waiting).
    fn listed_ids(&self) -> Vec<String> {
        self.sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, e)| e.snapshot().pool_waiting.is_none())
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Ids of the sandboxes this edge runs.
    fn ids(&self) -> Vec<String> {
        self.sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect()
    }

    fn insert(&self, rec: SandboxRecord) -> Arc<Entry> {
        if let Some(d) = &self.deaths
            && let Some(pid) = self
                .backends
                .get(rec.backend.as_str())
                .and_then(|b| b.main_pid(&rec))
            && let Err(e) = d.watch(&rec.id, pid)
        {
            tracing::warn!(sandbox = %rec.id, "cannot watch its process ({e}); its agent is polled");
        }
        let e = Arc::new(Entry {
            rec: Mutex::new(rec.clone()),
            op: tokio::sync::Mutex::new(()),
            agent: channel::Kept::default(),
            samples: samples::Ring::default(),
        });
        self.sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(rec.id, e.clone());
        e
    }

    /// A sandbox of the API's: a pool member still waiting is nobody's, so not found.
    fn entry(&self, id: &str) -> Result<Arc<Entry>, ApiError> {
        let e = self.entry_any(id)?;
        if e.snapshot().pool_waiting.is_some() {
            return Err(ApiError::not_found(format!(
                "sandbox {id} does not exist (it may have been stopped or its TTL ran out)"
            )));
        }
        Ok(e)
    }

    /// Any sandbox of the node, pool members included.
    fn entry_any(&self, id: &str) -> Result<Arc<Entry>, ApiError> {
        SandboxId::parse(id).map_err(|e| ApiError::invalid(e.to_string()))?;
        self.sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
            .ok_or_else(|| {
                ApiError::not_found(format!(
                    "sandbox {id} does not exist (it may have been stopped or its TTL ran out)"
                ))
            })
    }

    fn backend(&self, name: &str) -> Result<Arc<dyn Backend>, ApiError> {
        let b = self.backends.get(name).cloned().ok_or_else(|| {
            ApiError::invalid(format!(
                "unknown backend {name:?}; this node offers: {}",
                self.backends.keys().cloned().collect::<Vec<_>>().join(", ")
            ))
        })?;
        let st = b.status();
        if !st.available {
            return Err(ApiError::unavailable(format!(
                "backend {name} is unavailable on node {}: {}",
                self.cfg.name, st.detail
            )));
        }
        Ok(b)
    }

    fn touch(&self, e: &Entry) {
        e.update(|r| r.last_activity_ms = now_ms());
    }

    pub fn status(&self) -> NodeStatus {
        let (total, avail) = host::memory_mb();
        let map = self.sandboxes.lock().unwrap_or_else(|p| p.into_inner());
        let mut projects = BTreeMap::new();
        let (cpu, mem) = map.values().fold((0.0, 0), |(c, m), e| {
            let r = e.snapshot();
            if r.pool_waiting.is_none() {
                *projects.entry(r.project.clone()).or_insert(0) += 1;
            }
            (c + r.limits.cpu_cores, m + r.limits.memory_mb)
        });
        NodeStatus {
            name: self.cfg.name.clone(),
            healthy: true,
            backends: self.backends.values().map(|b| b.status()).collect(),
            cgroup_mode: self.mode.as_str().into(),
            cpus: host::cpus(),
            memory_total_mb: total,
            memory_available_mb: avail,
            disk_free_mb: host::disk_free_mb(&self.cfg.state_dir),
            sandboxes: map.len() as u64,
            committed_cpu_cores: cpu,
            committed_memory_mb: mem,
            max_sandboxes: self.cfg.max_sandboxes,
            projects,
            pools: self.pools.status(),
        }
    }
}

/// The lazy layers' mounter of an edge whose kernel can mount them.
fn lazy_mounter(cfg: &EdgeConfig, images: &ImageStore) -> Option<dsec_image::lazy::LazyMounter> {
    if let Some(why) = dsec_image::lazy::unsupported() {
        tracing::info!("images are pulled whole: {why}");
        return None;
    }
    let exe = std::env::current_exe()
        .inspect_err(|e| tracing::warn!("images are pulled whole: this program's path: {e}"))
        .ok()?;
    Some(dsec_image::lazy::LazyMounter {
        exe,
        store: images.root().to_path_buf(),
        cache_mb: cfg.lazy_cache_mb,
        prefetch: cfg.lazy_prefetch,
    })
}

/// The time of a create's steps, in order: `admit:0.05,reserve:0.31,...` (milliseconds).
pub(crate) struct Phases {
    last: std::time::Instant,
    done: Vec<(&'static str, Duration)>,
}

impl Phases {
    pub(crate) fn start() -> Phases {
        Phases {
            last: std::time::Instant::now(),
            done: Vec::new(),
        }
    }

    /// Ends the step called `name` (a name given twice adds up).
    pub(crate) fn mark(&mut self, name: &'static str) {
        let now = std::time::Instant::now();
        let took = now - self.last;
        self.last = now;
        match self.done.iter_mut().find(|(n, _)| *n == name) {
            Some((_, d)) => *d += took,
            None => self.done.push((name, took)),
        }
    }
}

impl std::fmt::Display for Phases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (n, d)) in self.done.iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            write!(f, "{sep}{n}:{:.2}", d.as_secs_f64() * 1000.0)?;
        }
        Ok(())
    }
}

fn fork_response(
    backend: &Arc<dyn Backend>,
    made: Vec<SandboxInfo>,
    paused_ms: u64,
) -> ForkResponse {
    ForkResponse {
        sandboxes: made,
        memory_preserved: backend.fork_preserves_memory(),
        note: if backend.fork_preserves_memory() {
            "copies carry the source's memory and filesystem".into()
        } else {
            format!(
                "{} backend: copies carry the source's filesystem (its writable layer) but not its process memory; processes start fresh",
                backend.name()
            )
        },
        source_paused_ms: paused_ms,
    }
}

pub(crate) use dsec_common::id::random_hex;

fn port_token() -> String {
    random_hex(24)
}

/// The agent holds its listening socket for as long as it lives: a refused connect means
/// the sandbox is gone.
fn agent_alive(sock: &Path) -> bool {
    match std::os::unix::net::UnixStream::connect(sock) {
        Ok(_) => true,
        Err(e) => {
            e.kind() != std::io::ErrorKind::ConnectionRefused
                && e.kind() != std::io::ErrorKind::NotFound
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What an IAM write through `Iam::apply` does: spawn the write on the runtime and
    /// block (in `block_in_place`) until it answers.
    fn blocking_write() -> u32 {
        let (tx, rx) = std::sync::mpsc::channel();
        tokio::runtime::Handle::current().spawn(async move {
            tokio::time::sleep(Duration::from_millis(1)).await;
            let _ = tx.send(7);
        });
        tokio::task::block_in_place(|| rx.recv().unwrap_or(0))
    }

    /// Far more quota calls at once than the runtime has threads: every one completes.
    /// Called on the workers themselves (as before), a burst like this took every thread,
    /// the writes they waited for included, and never finished.
    #[test]
    fn a_burst_of_blocking_quota_calls_cannot_take_every_thread() {
        // On its own thread, watched from this one: a runtime out of threads cannot even
        // run its own timers, so only a wait from outside can say it is stuck.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .max_blocking_threads(4)
                .enable_all()
                .build()
                .unwrap();
            let done = rt.block_on(async {
                let turns = Arc::new(tokio::sync::Semaphore::new(2));
                let calls = (0..64).map(|_| {
                    let turns = turns.clone();
                    tokio::spawn(async move { off_workers(&turns, blocking_write).await })
                });
                futures_util::future::join_all(calls).await
            });
            let _ = tx.send(done.into_iter().filter(|r| matches!(r, Ok(Ok(7)))).count());
        });
        let done = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the quota calls did not finish: the runtime ran out of threads");
        assert_eq!(done, 64);
    }
}
