//! The edge: one per compute node. It owns the node's sandboxes (create, exec, fork, stop,
//! TTL), drives the backends, keeps its registry on disk and re-adopts live sandboxes
//! after a restart. It has the final say on admission.

pub mod backend;
mod build;
pub mod cgroup;
pub mod channel;
mod commit;
pub use commit::layers_in_use;
pub mod config;
mod deaths;
pub mod error;
pub mod functions;
pub mod host;
pub mod mountns;
pub mod net;
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
        Ok(edge)
    }

    pub fn name(&self) -> &str {
        &self.cfg.name
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

    fn adopt(&self) {
        self.sweep_snapshots();
        for r in self.registry.load_all() {
            match r {
                Ok(rec) => {
                    let backend = self.backends.get(rec.backend.as_str()).cloned();
                    let alive = rec.state != SandboxState::Creating
                        && rec.state != SandboxState::Stopping
                        && backend.as_ref().is_some_and(|b| b.is_alive(&rec));
                    if alive {
                        tracing::info!(sandbox = %rec.id, "re-adopted running sandbox");
                        if let (Some(n), Some(nr)) = (&self.net, &rec.network)
                            && let Some(slot) = nr.slot
                        {
                            let adopted = n
                                .policy(&nr.rules, &nr.egress_headers)
                                .and_then(|p| n.adopt(&rec.id, slot, p));
                            if let Err(e) = adopted {
                                tracing::warn!(sandbox = %rec.id, "its network: {}", e.message);
                            }
                        }
                        self.insert(rec);
                    } else {
                        tracing::info!(sandbox = %rec.id, state = ?rec.state, "cleaning up sandbox that is not running");
                        if let Some(b) = backend {
                            let _ = b.destroy(&rec, &self.paths(&rec.id));
                        }
                        if let (Some(n), Some(nr)) = (&self.net, &rec.network) {
                            n.detach(&rec.id, nr.slot);
                        }
                        let _ = std::fs::remove_dir_all(self.registry.dir(&rec.id));
                    }
                }
                Err(dir) => {
                    tracing::warn!(dir = %dir.display(), "sandbox directory without a readable state; removing");
                    let _ = std::process::Command::new("rm")
                        .arg("-rf")
                        .arg("--one-file-system")
                        .arg(&dir)
                        .status();
                }
            }
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

    pub async fn create(
        self: &Arc<Self>,
        req: CreateSandboxRequest,
    ) -> Result<SandboxInfo, ApiError> {
        let v = validate::create(&self.cfg, &req)?;
        let image = ImageRef::parse(&req.image).map_err(|e| ApiError::invalid(e.to_string()))?;
        let images = self.images.clone();
        let image2 = image.clone();
        let (digest, manifest) = blocking(move || images.resolve(&image2))
            .await?
            .map_err(|e| match e {
                dsec_image::ImageError::NotFound(_) => ApiError::not_found(e.to_string()),
                other => ApiError::internal(other.to_string()),
            })?;
        self.create_from(req, v, image, digest, manifest).await
    }

    /// Creates a sandbox of a resolved image: `manifest` (stored as `digest`), shown as
    /// `image` (an image build's steps run on manifests no reference names); `v` is what
    /// [`validate::create`] made of `req`.
    pub(crate) async fn create_from(
        self: &Arc<Self>,
        req: CreateSandboxRequest,
        v: validate::CreateParams,
        image: ImageRef,
        digest: String,
        manifest: dsec_image::Manifest,
    ) -> Result<SandboxInfo, ApiError> {
        let backend = self.backend(&req.backend)?;
        let network = self.network_for(&req)?;
        // A pool's members mount no volumes and trust no egress CA.
        if req.volumes.is_empty()
            && req.egress_headers.is_empty()
            && let Some(info) = self
                .take_pooled(&req, &v, &digest, backend.name(), network.is_some())
                .await?
        {
            return Ok(info);
        }
        self.create_new(req, v, image, digest, manifest, network, None, None)
            .await
    }

    /// Makes a sandbox for `req`, with `network` (what [`Edge::network_for`] made of
    /// it); with `pool`, a member of that warm pool (`pools.rs`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn create_new(
        self: &Arc<Self>,
        req: CreateSandboxRequest,
        v: validate::CreateParams,
        image: ImageRef,
        digest: String,
        manifest: dsec_image::Manifest,
        network: Option<registry::NetRecord>,
        pool: Option<String>,
        seed: Option<PathBuf>,
    ) -> Result<SandboxInfo, ApiError> {
        let backend = self.backend(&req.backend)?;
        let project = req
            .project
            .clone()
            .unwrap_or_else(dsec_common::api::root_project);
        let volumes = self.sandbox_volumes(backend.as_ref(), &project, &req.volumes)?;
        // Such a VM is never saved (its shared-filesystem devices cannot be): a pause to
        // disk at its timeout would end it instead, files and all.
        if backend.name() == "vm" && !volumes.is_empty() && v.pause_to_disk_on_timeout {
            return Err(ApiError::invalid(
                "a vm sandbox that mounts volumes cannot be paused to disk at its timeout (it is never saved): use on_timeout \"pause\" (in place) or \"stop\", or a container sandbox",
            ));
        }
        let now = now_ms();
        let mut env = manifest.env.clone();
        if !req.egress_headers.is_empty() {
            for (k, v) in net::headers::TRUST_ENV {
                env.insert(k.to_string(), v.to_string());
            }
        }
        env.extend(req.env.clone());
        let rec = SandboxRecord {
            id: SandboxId::generate(&self.cfg.name).to_string(),
            edge: self.cfg.name.clone(),
            backend: backend.name().to_string(),
            image: image.to_string(),
            image_digest: digest,
            layers: manifest.layers.clone(),
            env,
            workdir: manifest.workdir.clone(),
            start: manifest.start.clone(),
            limits: v.limits,
            labels: req.labels.clone(),
            project,
            state: SandboxState::Creating,
            created_at_ms: now,
            expires_at_ms: now + v.ttl_seconds * 1000,
            idle_timeout_seconds: v.idle_timeout_seconds,
            last_activity_ms: now,
            forked_from: None,
            oom_kills: 0,
            port_token: port_token(),
            network,
            paused_at_ms: None,
            paused_to_disk: false,
            moved_from: None,
            pool_waiting: pool,
            from_pool: None,
            pause_on_timeout: v.pause_on_timeout,
            pause_to_disk_on_timeout: v.pause_to_disk_on_timeout,
            ttl_ms: v.ttl_seconds * 1000,
            resume_on_request: req.auto_resume == Some(true),
            volumes,
        };
        // To the end even if the caller goes away: a half-made sandbox is never left.
        let edge = self.clone();
        finish(async move { edge.launch(backend, rec, seed).await }).await
    }

    /// Gives a sandbox whose record asks for a network its slot, namespace and rules,
    /// saving the record as it goes (so a crash leaves nothing unaccounted for).
    pub(crate) async fn attach_network(&self, rec: &mut SandboxRecord) -> Result<(), ApiError> {
        let (Some(n), Some(nr)) = (&self.net, rec.network.as_ref()) else {
            return Ok(());
        };
        let policy = n.policy(&nr.rules, &nr.egress_headers)?;
        let slot = n.allocate()?;
        if let Some(nr) = &mut rec.network {
            nr.slot = Some(slot);
        }
        self.registry.save(rec)?;
        let (n2, id2) = (n.clone(), rec.id.clone());
        let s = blocking(move || n2.attach(&id2, slot, policy)).await??;
        if let Some(nr) = &mut rec.network {
            nr.ip = Some(s.ip.to_string());
            nr.gateway = Some(s.gateway.to_string());
        }
        self.registry.save(rec)
    }

    /// The network a create asks for, its rules checked (400 names what is wrong).
    fn network_for(
        &self,
        req: &CreateSandboxRequest,
    ) -> Result<Option<registry::NetRecord>, ApiError> {
        match req.network.as_deref() {
            None | Some("rules") => {}
            Some("none")
                if req.network_rules.values().any(|v| *v) || !req.egress_headers.is_empty() =>
            {
                return Err(ApiError::invalid(
                    "network \"none\" has no network to apply network_rules to; drop one of them",
                ));
            }
            Some("none") => return Ok(None),
            Some(other) => {
                return Err(ApiError::invalid(format!(
                    "network {other:?} is not known: leave it out (egress per network_rules) or use \"none\""
                )));
            }
        }
        let Some(n) = &self.net else {
            if req.network_rules.values().any(|v| *v) || !req.egress_headers.is_empty() {
                return Err(ApiError::precondition(format!(
                    "node {} has sandbox networking turned off ([edge.network] enabled = false), so network_rules cannot be met",
                    self.cfg.name
                )));
            }
            return Ok(None);
        };
        n.policy(&req.network_rules, &req.egress_headers)?;
        Ok(Some(registry::NetRecord {
            slot: None,
            ip: None,
            gateway: None,
            rules: req.network_rules.clone(),
            egress_headers: req.egress_headers.clone(),
        }))
    }

    /// Makes the sandbox behind `sock` trust the egress header proxy's CA.
    async fn install_trust(&self, sock: &std::path::Path) -> Result<(), ApiError> {
        let Some(h) = &self.headers else {
            return Ok(());
        };
        net::headers::install_trust(sock, h.ca_pem())
            .await
            .map_err(|mut e| {
                e.message = format!(
                    "installing the egress proxy's CA in the sandbox: {}",
                    e.message
                );
                e
            })
    }

    /// Replaces a running sandbox's network rules and egress headers; they hold for new
    /// connections at once.
    pub async fn set_network_rules(
        &self,
        id: &str,
        rules: BTreeMap<String, bool>,
        egress_headers: dsec_common::api::EgressHeaders,
    ) -> Result<SandboxInfo, ApiError> {
        let e = self.entry(id)?;
        let _g = e.op.lock().await;
        let (Some(n), Some(_)) = (&self.net, &e.snapshot().network) else {
            return Err(ApiError::precondition(format!(
                "sandbox {id} has no network (created with network \"none\" or on a node without networking); its rules cannot change"
            )));
        };
        let policy = n.policy(&rules, &egress_headers)?;
        if !egress_headers.is_empty() {
            self.install_trust(&self.paths(id).channel).await?;
        }
        let (n2, id2) = (n.clone(), id.to_string());
        blocking(move || n2.set_policy(&id2, policy)).await??;
        let rec = e.update(|r| {
            if let Some(nr) = &mut r.network {
                nr.rules = rules;
                nr.egress_headers = egress_headers;
            }
            r.last_activity_ms = now_ms();
            r.clone()
        });
        self.registry.save(&rec)?;
        Ok(rec.info())
    }

    /// The node's final say: its real free memory, disk and load, and its sandbox count.
    fn admit(&self) -> Result<(), ApiError> {
        let running = self
            .sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len() as u64;
        // This create is already counted in `creating`.
        let creating = self.creating.load(Ordering::SeqCst).saturating_sub(1);
        let snapshot = host::Snapshot {
            sandboxes: running + creating,
            memory_available_mb: host::memory_mb().1,
            disk_free_mb: host::disk_free_mb(&self.cfg.state_dir),
            load1: host::load1(),
            cpus: host::cpus(),
        };
        let reserve = host::Reserve {
            max_sandboxes: self.cfg.max_sandboxes,
            memory_mb: self.cfg.reserved_memory_mb,
            disk_mb: self.cfg.reserved_disk_mb,
            max_load_per_core: self.cfg.max_load_per_core,
        };
        host::admit(&self.cfg.name, &snapshot, &reserve)
            .map_err(|r| ApiError::node_full(r.to_string()))
    }

    /// Starts `rec` on `backend`: the shared path of create and fork.
    async fn launch(
        self: &Arc<Self>,
        backend: Arc<dyn Backend>,
        mut rec: SandboxRecord,
        seed: Option<PathBuf>,
    ) -> Result<SandboxInfo, ApiError> {
        // Its volumes cannot be deleted while it is made (then it mounts them).
        let ids: Vec<String> = rec.volumes.iter().map(|v| v.volume.clone()).collect();
        let _volumes = (!ids.is_empty())
            .then(|| self.use_volumes(&ids))
            .transpose()?;
        self.creating.fetch_add(1, Ordering::SeqCst);
        let mut phases = Phases::start();
        let result = async {
            // Creates take turns; a fork's copies start together (the source waits for
            // them). The semaphore is never closed, so acquiring only waits.
            let _turn = match seed {
                None => Some(
                    self.create_turns
                        .acquire()
                        .await
                        .map_err(|_| ApiError::unavailable("the edge is shutting down"))?,
                ),
                Some(_) => None,
            };
            phases.mark("queued");
            self.admit()?;
            phases.mark("admit");
            // A pool member is nobody's until handed out, when it takes its reservation.
            if rec.pool_waiting.is_none() {
                self.reserve_quota(&rec).await?;
            }
            phases.mark("reserve");
            self.registry.save(&rec)?;
            phases.mark("record");
            self.attach_network(&mut rec).await?;
            phases.mark("network");
            let paths = self.paths(&rec.id);
            let channel = paths.channel.clone();
            let (b2, r2) = (backend.clone(), rec.clone());
            let restored = seed.is_some() && backend.fork_preserves_memory();
            blocking(move || b2.create(&r2, &paths, seed.as_deref())).await??;
            phases.mark("backend");
            let ready = async {
                let alive = || !backend.exited(&rec);
                if restored {
                    tell_restored(&channel, &rec.id, backend.start_timeout(), alive).await?;
                } else {
                    tell_environment(&channel, &rec, backend.start_timeout(), alive).await?;
                    if rec
                        .network
                        .as_ref()
                        .is_some_and(|n| !n.egress_headers.is_empty())
                    {
                        self.install_trust(&channel).await?;
                    }
                    if let Some(s) = &rec.start {
                        start_command(&channel, s).await?;
                    }
                }
                Ok::<(), ApiError>(())
            };
            if let Err(mut e) = ready.await {
                if let Some(log) = backend.start_log(&self.paths(&rec.id)) {
                    e.message = format!("{} (its console ended with: {log})", e.message);
                }
                let (b2, r2, p2) = (backend.clone(), rec.clone(), self.paths(&rec.id));
                let _ = blocking(move || b2.destroy(&r2, &p2)).await;
                return Err(e);
            }
            phases.mark("agent");
            rec.state = SandboxState::Running;
            self.registry.save(&rec)?;
            phases.mark("record");
            Ok(rec.info())
        }
        .await;
        self.creating.fetch_sub(1, Ordering::SeqCst);
        match result {
            Ok(info) => {
                self.insert(rec);
                // Where the create's time went (`bench/create_latency.py` sums these).
                tracing::info!(sandbox = %info.id, image = %info.image, phases = %phases, "sandbox running");
                Ok(info)
            }
            Err(e) => {
                if let (Some(n), Some(nr)) = (self.net.clone(), rec.network.clone()) {
                    let id = rec.id.clone();
                    let _ = blocking(move || n.detach(&id, nr.slot)).await;
                }
                let _ = std::fs::remove_dir_all(self.registry.dir(&rec.id));
                // Idempotent: also right when the reservation itself was refused.
                self.release_quota(&rec.id).await;
                Err(e)
            }
        }
    }

    pub fn get(&self, id: &str) -> Result<SandboxInfo, ApiError> {
        Ok(self.entry(id)?.snapshot().info())
    }

    /// Sandboxes whose labels include every `key=value` in `labels`.
    pub fn list(&self, labels: &BTreeMap<String, String>) -> Vec<SandboxInfo> {
        let map = self.sandboxes.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<SandboxInfo> = map
            .values()
            .map(|e| e.snapshot())
            .filter(|r| r.pool_waiting.is_none())
            .filter(|r| labels.iter().all(|(k, v)| r.labels.get(k) == Some(v)))
            .map(|r| r.info())
            .collect();
        out.sort_by(|a, b| a.created_at_ms.cmp(&b.created_at_ms).then(a.id.cmp(&b.id)));
        out
    }

    pub async fn exec(
        self: &Arc<Self>,
        id: &str,
        req: ExecRequest,
    ) -> Result<ExecResult, ApiError> {
        let (e, sock) = self.running(id)?;
        let spec = validate::exec(&self.cfg, &req)?;
        let rec = e.snapshot();
        let backend = self.backend(&rec.backend)?;
        // A cgroup file read: microseconds, cheaper than a hop to a blocking thread.
        let before = backend.oom_kills(&rec);
        let wait = Duration::from_millis(spec.timeout_ms.unwrap_or(0)) + Duration::from_secs(30);
        let req = Request::Exec(spec);
        let resp = if backend.keeps_agent_connections() {
            channel::call_kept(&e.agent, &sock, &req, wait).await
        } else {
            channel::call(&sock, &req, wait).await
        };
        let resp = match resp {
            Ok(r) => r,
            Err(_) if e.snapshot().state != SandboxState::Running => {
                return Err(ApiError::precondition(format!(
                    "sandbox {id} was stopped while the command ran"
                )));
            }
            Err(err) => return Err(err),
        };
        let after = backend.oom_kills(&rec);
        self.touch(&e);
        match resp {
            Response::Exec(mut r) => {
                r.oom_killed = after > before;
                if after != rec.oom_kills {
                    e.update(|r| r.oom_kills = after);
                    let _ = self.registry.save(&e.snapshot());
                }
                Ok(r)
            }
            other => Err(channel::unexpected(&other)),
        }
    }

    pub async fn fork(
        self: &Arc<Self>,
        id: &str,
        req: ForkRequest,
    ) -> Result<ForkResponse, ApiError> {
        let (edge, id) = (self.clone(), id.to_string());
        finish(async move { edge.fork_now(&id, req).await }).await
    }

    async fn fork_now(
        self: &Arc<Self>,
        id: &str,
        req: ForkRequest,
    ) -> Result<ForkResponse, ApiError> {
        let count = validate::fork_count(&req)?;
        let remote = req.edge.clone().filter(|e| *e != self.cfg.name);
        let e = self.entry(id)?;
        let src = e.snapshot();
        let backend = self.backend(&src.backend)?;
        if remote.is_some() {
            backend::require(backend.as_ref(), Capability::Move, "leave out edge")?;
        }
        let peers = match &remote {
            Some(_) => Some(self.peers()?),
            None => None,
        };
        let seed = self.fork_tmp.join(format!("{}-{}", src.id, random_hex(8)));
        // Copies on this edge start while the snapshot is taken where the backend can
        // say now where it will be (they wait for it before they load it).
        if remote.is_none() && src.state == SandboxState::Running {
            let (b2, s2, d2) = (backend.clone(), src.clone(), seed.clone());
            if blocking(move || b2.plan_snapshot(&s2, &d2)).await? {
                let (edge, b2, s2, d2, labels) = (
                    self.clone(),
                    backend.clone(),
                    src.clone(),
                    seed.clone(),
                    req.labels.clone(),
                );
                let copies =
                    tokio::spawn(
                        async move { edge.copies(&b2, &s2, &d2, count, &labels, false).await },
                    );
                let saved = self.save_running(&e, &backend, &seed, "forked").await;
                let made = copies
                    .await
                    .map_err(|j| ApiError::internal(format!("fork worker failed: {j}")))
                    .and_then(|m| m);
                // Copies that failed early may have removed it before a fallback save
                // made it again.
                self.discard_seed(&backend, &seed).await;
                return match (saved, made) {
                    (Ok(paused_ms), Ok(made)) => Ok(fork_response(&backend, made, paused_ms)),
                    (Err(err), Ok(made)) => {
                        for info in &made {
                            let _ = self.stop(&info.id).await;
                        }
                        Err(err)
                    }
                    (Err(err), Err(_)) | (Ok(_), Err(err)) => Err(err),
                };
            }
        }
        let paused_ms = self.save_running(&e, &backend, &seed, "forked").await?;
        let made = match (remote, peers) {
            (Some(target), Some(peers)) => {
                // The copies are made there, from this snapshot, which goes when they run.
                let answer = self
                    .hand_over(
                        &peers,
                        &backend,
                        &seed,
                        &target,
                        transfer::ImportKind::Fork {
                            count,
                            labels: req.labels.clone(),
                        },
                        &src,
                    )
                    .await;
                self.discard_seed(&backend, &seed).await;
                let mut r: ForkResponse = serde_json::from_slice(&answer?).map_err(|e| {
                    ApiError::internal(format!("edge {target} answered the fork with: {e}"))
                })?;
                r.source_paused_ms = paused_ms;
                return Ok(r);
            }
            _ => {
                self.copies(&backend, &src, &seed, count, &req.labels, false)
                    .await?
            }
        };
        Ok(fork_response(&backend, made, paused_ms))
    }

    /// Saves a running sandbox's state into `dest` (paused meanwhile; returns for how
    /// long, in ms). `what` says what only a running sandbox can be.
    pub(crate) async fn save_running(
        &self,
        e: &Arc<Entry>,
        backend: &Arc<dyn Backend>,
        dest: &Path,
        what: &str,
    ) -> Result<u64, ApiError> {
        let _g = e.op.lock().await;
        let src = e.snapshot();
        if src.state != SandboxState::Running {
            return Err(ApiError::precondition(format!(
                "sandbox {} is {:?}; only a running sandbox can be {what}",
                src.id, src.state
            )));
        }
        self.touch(e);
        let (b2, p2, s2) = (backend.clone(), self.paths(&src.id), dest.to_path_buf());
        let copied = blocking(move || {
            if let Some(r) = b2.snapshot_live(&src, &s2) {
                return r.and_then(|ms| b2.finish_snapshot(&src, &s2).map(|()| ms));
            }
            let t0 = Instant::now();
            b2.pause(&src)?;
            let r = b2.snapshot(&src, &p2, &s2);
            let resumed = b2.resume(&src);
            let paused_ms = t0.elapsed().as_millis() as u64;
            r.and(resumed)?;
            b2.finish_snapshot(&src, &s2).map(|()| paused_ms)
        })
        .await?;
        let paused_ms = match copied {
            Ok(ms) => ms,
            Err(err) => {
                self.discard_seed(backend, dest).await;
                return Err(err);
            }
        };
        Ok(paused_ms)
    }

    /// Removes a fork's snapshot.
    pub(crate) async fn discard_seed(&self, backend: &Arc<dyn Backend>, seed: &Path) {
        let (b2, s2) = (backend.clone(), seed.to_path_buf());
        let _ = blocking(move || {
            b2.discard_snapshot(&s2);
            std::fs::remove_dir_all(&s2)
        })
        .await;
    }

    /// `count` copies of `src` started from the snapshot `seed` (which is removed
    /// afterwards unless `keep_seed`); all or none.
    async fn copies(
        self: &Arc<Self>,
        backend: &Arc<dyn Backend>,
        src: &SandboxRecord,
        seed: &Path,
        count: u64,
        extra_labels: &BTreeMap<String, String>,
        keep_seed: bool,
    ) -> Result<Vec<SandboxInfo>, ApiError> {
        let now = now_ms();
        let mut tasks = Vec::new();
        for _ in 0..count {
            let mut labels = src.labels.clone();
            labels.extend(extra_labels.clone());
            let rec = SandboxRecord {
                id: SandboxId::generate(&self.cfg.name).to_string(),
                edge: self.cfg.name.clone(),
                state: SandboxState::Creating,
                created_at_ms: now,
                expires_at_ms: now
                    + src
                        .expires_at_ms
                        .saturating_sub(src.created_at_ms)
                        .max(1000),
                last_activity_ms: now,
                forked_from: Some(src.id.clone()),
                oom_kills: 0,
                port_token: port_token(),
                labels,
                network: src.network.as_ref().map(|n| registry::NetRecord {
                    slot: None,
                    ip: None,
                    gateway: None,
                    rules: n.rules.clone(),
                    egress_headers: n.egress_headers.clone(),
                }),
                paused_at_ms: None,
                paused_to_disk: false,
                moved_from: None,
                pool_waiting: None,
                from_pool: None,
                ..src.clone()
            };
            let (edge, b, s) = (self.clone(), backend.clone(), seed.to_path_buf());
            tasks.push(tokio::spawn(
                async move { edge.launch(b, rec, Some(s)).await },
            ));
        }
        let mut made = Vec::new();
        let mut first_err = None;
        for t in tasks {
            match t.await {
                Ok(Ok(info)) => made.push(info),
                Ok(Err(err)) => {
                    first_err.get_or_insert(err);
                }
                Err(join) => {
                    first_err
                        .get_or_insert(ApiError::internal(format!("fork worker failed: {join}")));
                }
            }
        }
        if !keep_seed {
            self.discard_seed(backend, seed).await;
        }
        if let Some(err) = first_err {
            for info in &made {
                let _ = self.stop(&info.id).await;
            }
            return Err(ApiError::new(
                err.code,
                format!("fork failed, no copies kept: {}", err.message),
            ));
        }
        Ok(made)
    }

    /// Pauses a running sandbox: frozen in place, or (`to_disk`, VM backends) saved to
    /// disk with its processes ended. Its TTL and idle time stop running until resumed.
    pub async fn pause(self: &Arc<Self>, id: &str, to_disk: bool) -> Result<SandboxInfo, ApiError> {
        let (edge, id) = (self.clone(), id.to_string());
        finish(async move { edge.pause_now(&id, to_disk).await }).await
    }

    async fn pause_now(self: &Arc<Self>, id: &str, to_disk: bool) -> Result<SandboxInfo, ApiError> {
        let e = self.entry(id)?;
        let _g = e.op.lock().await;
        let rec = e.snapshot();
        if rec.state == SandboxState::Paused && (rec.paused_to_disk || !to_disk) {
            return Ok(rec.info());
        }
        if rec.state != SandboxState::Running && rec.state != SandboxState::Paused {
            return Err(ApiError::precondition(format!(
                "sandbox {id} is {:?}; only a running sandbox can be paused",
                rec.state
            )));
        }
        let backend = self.backend(&rec.backend)?;
        if to_disk {
            backend::require(
                backend.as_ref(),
                Capability::PauseToDisk,
                "pause in place (to_disk: false)",
            )?;
        }
        let (b2, r2, p2, was_running) = (
            backend.clone(),
            rec.clone(),
            self.paths(id),
            rec.state == SandboxState::Running,
        );
        blocking(move || {
            if was_running {
                b2.pause(&r2)?;
            }
            if to_disk && let Err(err) = b2.suspend(&r2, &p2) {
                if was_running {
                    let _ = b2.resume(&r2);
                }
                return Err(err);
            }
            Ok(())
        })
        .await??;
        if to_disk {
            e.agent.clear(); // connections to an agent that has ended
        }
        let rec = e.update(|r| {
            r.state = SandboxState::Paused;
            r.paused_at_ms.get_or_insert(now_ms());
            r.paused_to_disk = to_disk;
            r.clone()
        });
        self.registry.save(&rec)?;
        tracing::info!(sandbox = %id, to_disk, "sandbox paused");
        Ok(rec.info())
    }

    /// Resumes a paused sandbox where it stopped (from disk if it was paused to disk).
    pub async fn resume(self: &Arc<Self>, id: &str) -> Result<SandboxInfo, ApiError> {
        let (edge, id) = (self.clone(), id.to_string());
        finish(async move { edge.resume_now(&id).await }).await
    }

    async fn resume_now(self: &Arc<Self>, id: &str) -> Result<SandboxInfo, ApiError> {
        let e = self.entry(id)?;
        let _g = e.op.lock().await;
        let rec = e.snapshot();
        match rec.state {
            SandboxState::Running => return Ok(rec.info()),
            SandboxState::Paused => {}
            s => {
                return Err(ApiError::precondition(format!(
                    "sandbox {id} is {s:?}; only a paused sandbox can be resumed"
                )));
            }
        }
        let backend = self.backend(&rec.backend)?;
        let (b2, r2, p2) = (backend.clone(), rec.clone(), self.paths(id));
        if rec.paused_to_disk {
            blocking(move || b2.wake(&r2, &p2)).await??;
        } else {
            blocking(move || b2.resume(&r2)).await??;
        }
        let channel = self.paths(id).channel;
        let alive = || !backend.exited(&rec);
        if backend.fork_preserves_memory() {
            // The guest's clock stood still while it was paused.
            tell_restored(&channel, id, backend.start_timeout(), alive).await?;
        } else if rec.paused_to_disk {
            // Its processes ended with the pause: a fresh start, as at create.
            tell_environment(&channel, &rec, backend.start_timeout(), alive).await?;
            if let Some(s) = &rec.start {
                start_command(&channel, s).await?;
            }
        }
        let now = now_ms();
        let rec = e.update(|r| {
            let paused_for = r.paused_at_ms.map_or(0, |t| now.saturating_sub(t));
            r.expires_at_ms = r.expires_at_ms.saturating_add(paused_for);
            r.last_activity_ms = now;
            r.state = SandboxState::Running;
            r.paused_at_ms = None;
            r.paused_to_disk = false;
            r.clone()
        });
        self.registry.save(&rec)?;
        tracing::info!(sandbox = %id, "sandbox resumed");
        Ok(rec.info())
    }

    /// Pauses (or, with `resume`, resumes) the sandboxes `ids` (a group: those with
    /// given labels), in parallel.
    pub async fn group(
        self: &Arc<Self>,
        ids: Vec<String>,
        to_disk: bool,
        resume: bool,
    ) -> dsec_common::api::GroupResponse {
        let t0 = Instant::now();
        let mut tasks = Vec::new();
        for id in ids {
            let edge = self.clone();
            tasks.push(tokio::spawn(async move {
                let r = if resume {
                    edge.resume(&id).await
                } else {
                    edge.pause(&id, to_disk).await
                };
                (id, r)
            }));
        }
        let mut out = dsec_common::api::GroupResponse::default();
        for t in tasks {
            match t.await {
                Ok((id, Ok(_))) => out.done.push(id),
                Ok((id, Err(e))) => out.failed.push(dsec_common::api::GroupFailure {
                    id,
                    code: e.code,
                    message: e.message,
                }),
                Err(e) => tracing::warn!("group worker failed: {e}"),
            }
        }
        out.done.sort();
        out.took_ms = t0.elapsed().as_millis() as u64;
        out
    }

    pub async fn stop(self: &Arc<Self>, id: &str) -> Result<(), ApiError> {
        let e = self.entry_any(id)?;
        let _g = e.op.lock().await;
        if let Some(d) = &self.deaths {
            d.unwatch(id);
        }
        let rec = e.update(|r| {
            r.state = SandboxState::Stopping;
            r.clone()
        });
        if let Some(pool) = &rec.pool_waiting {
            self.pools.forget(pool, id);
        }
        let _ = self.registry.save(&rec);
        let backend = self.backends.get(rec.backend.as_str()).cloned();
        if let Some(b) = backend {
            let paths = self.paths(id);
            let r2 = rec.clone();
            blocking(move || b.destroy(&r2, &paths)).await??;
        }
        if let (Some(n), Some(nr)) = (self.net.clone(), rec.network.clone()) {
            let id2 = id.to_string();
            blocking(move || n.detach(&id2, nr.slot)).await?;
        }
        let _ = std::fs::remove_dir_all(self.registry.dir(id));
        self.trajectories.forget(&self.registry.dir(id));
        self.release_quota(id).await;
        self.sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        tracing::info!(sandbox = %id, "sandbox stopped");
        Ok(())
    }

    pub async fn set_timeout(&self, id: &str, ttl_seconds: f64) -> Result<SandboxInfo, ApiError> {
        let secs = validate::ttl(&self.cfg, "ttl_seconds", ttl_seconds)?;
        let e = self.entry(id)?;
        let rec = e.update(|r| {
            r.expires_at_ms = now_ms() + secs * 1000;
            r.last_activity_ms = now_ms();
            r.clone()
        });
        self.registry.save(&rec)?;
        Ok(rec.info())
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

    /// Stops sandboxes whose TTL or idle timeout ran out and, with `check_alive`, ones
    /// whose agent has gone.
    pub async fn reap_once(self: &Arc<Self>, check_alive: bool) {
        let now = now_ms();
        // Read in place under the lock (no record is copied): this runs twice a second
        // over every sandbox on the node. Only a running sandbox's time runs (a preempted
        // job resumes later); one in the middle of an operation (a pause, a fork) is not
        // judged dead: its agent may be stopped on purpose. A sandbox the kernel watches
        // for its death (`deaths.rs`) is not polled.
        let mut due: Vec<(String, &'static str)> = Vec::new();
        let mut to_pause: Vec<String> = Vec::new();
        // (id, backend, the record when its backend must be asked too: a VM with volumes,
        // whose daemons can die without its agent)
        let mut polled: Vec<(String, String, Option<SandboxRecord>)> = Vec::new();
        {
            let map = self.sandboxes.lock().unwrap_or_else(|p| p.into_inner());
            for (id, e) in map.iter() {
                let r = e.rec.lock().unwrap_or_else(|p| p.into_inner());
                if r.state != SandboxState::Running {
                    continue;
                }
                if now >= r.expires_at_ms && r.pause_on_timeout {
                    to_pause.push(id.clone());
                } else if now >= r.expires_at_ms {
                    due.push((id.clone(), "ttl expired"));
                } else if r
                    .idle_timeout_seconds
                    .is_some_and(|s| now >= r.last_activity_ms + s * 1000)
                {
                    due.push((id.clone(), "idle timeout"));
                } else if check_alive
                    && e.op.try_lock().is_ok()
                    && !self.deaths.as_ref().is_some_and(|d| d.watching(id))
                {
                    let ask = (r.backend == "vm" && !r.volumes.is_empty()).then(|| r.clone());
                    polled.push((id.clone(), r.backend.clone(), ask));
                }
            }
        }
        if check_alive {
            let work: Vec<(Arc<dyn Backend>, SandboxPaths)> = polled
                .iter()
                .filter(|(_, b, _)| b != "container")
                .filter_map(|(id, b, _)| Some((self.backend(b).ok()?, self.paths(id))))
                .collect();
            if !work.is_empty() {
                let _ = blocking(move || {
                    for (b, p) in work {
                        b.housekeeping(&p);
                    }
                })
                .await;
            }
            for (id, b, ask) in polled {
                let gone = !agent_alive(&self.paths(&id).channel)
                    || ask.is_some_and(|rec| self.backend(&b).is_ok_and(|be| be.exited(&rec)));
                if gone {
                    due.push((id, "sandbox died"));
                }
            }
        }
        for id in to_pause {
            let edge = self.clone();
            tokio::spawn(async move { edge.pause_on_timeout(&id).await });
        }
        for (id, why) in due {
            tracing::info!(sandbox = %id, "{why}; stopping");
            let edge = self.clone();
            tokio::spawn(async move {
                if let Err(e) = edge.stop(&id).await {
                    tracing::warn!(sandbox = %id, "stopping: {}", e.message);
                }
            });
        }
    }

    /// Before a request to one of its ports: a paused sandbox made with `auto_resume` is
    /// resumed (others are left as they are; the request then finds what it finds). Not
    /// one paused without its memory (a container paused to disk): it would start
    /// afresh, with nothing of what the request was for running, so it is resumed
    /// explicitly.
    pub async fn wake_for_request(self: &Arc<Self>, id: &str) -> Result<(), ApiError> {
        let rec = self.entry(id)?.snapshot();
        let memory_kept =
            !rec.paused_to_disk || self.backend(&rec.backend)?.fork_preserves_memory();
        if rec.state == SandboxState::Paused && rec.resume_on_request && memory_kept {
            tracing::info!(sandbox = %id, "a request to its port resumes it (auto_resume)");
            self.resume(id).await?;
        }
        Ok(())
    }

    /// A sandbox whose TTL ran out with `on_timeout = "pause"`: its TTL is set to run
    /// again in full (from when it is resumed) and it is paused; if it cannot be, stopped.
    async fn pause_on_timeout(self: &Arc<Self>, id: &str) {
        let Ok(e) = self.entry(id) else { return };
        let now = now_ms();
        let rec = e.update(|r| {
            r.expires_at_ms = now + r.ttl_ms.max(1000);
            r.clone()
        });
        let _ = self.registry.save(&rec);
        let to_disk = rec.pause_to_disk_on_timeout;
        tracing::info!(sandbox = %id, to_disk, "ttl expired; pausing (on_timeout = pause)");
        if let Err(err) = self.pause(id, to_disk).await {
            tracing::warn!(sandbox = %id, "pausing at its timeout: {}; stopping", err.message);
            if let Err(e) = self.stop(id).await {
                tracing::warn!(sandbox = %id, "stopping: {}", e.message);
            }
        }
    }

    /// A watched sandbox's first process exited: it is stopped once no operation holds it
    /// (a pause or a fork may be under way), if it is still running by then.
    async fn on_death(self: &Arc<Self>, id: String) {
        loop {
            // Pool members included: a dead one must not be handed out.
            let Ok(e) = self.entry_any(&id) else { return };
            if e.op.try_lock().is_err() {
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
            if e.snapshot().state != SandboxState::Running {
                return;
            }
            tracing::info!(sandbox = %id, "sandbox died; stopping");
            if let Err(e) = self.stop(&id).await {
                tracing::warn!(sandbox = %id, "stopping: {}", e.message);
            }
            return;
        }
    }

    /// Runs the TTL reaper, and stops sandboxes as they die, until the process ends.
    pub fn spawn_reaper(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let edge = self.clone();
        self.spawn_pools();
        let died = self.died.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(mut died) = died {
            let edge = self.clone();
            tokio::spawn(async move {
                while let Some(id) = died.recv().await {
                    let edge = edge.clone();
                    tokio::spawn(async move { edge.on_death(id).await });
                }
            });
        }
        if self.cfg.metrics_interval_ms > 0 {
            let edge = self.clone();
            tokio::spawn(async move { edge.sample_forever().await });
        }
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            for n in 0u64.. {
                tick.tick().await;
                edge.reap_once(n % 10 == 0).await;
            }
        })
    }

    /// Every `metrics_interval_ms`: each running sandbox's CPU time and memory, read from
    /// its cgroup (two file reads each, on one blocking thread for all) and kept.
    async fn sample_forever(self: Arc<Self>) {
        let mut tick =
            tokio::time::interval(Duration::from_millis(self.cfg.metrics_interval_ms.max(100)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let running: Vec<(String, Arc<Entry>)> = self
                .sandboxes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .filter(|(_, e)| e.update(|r| r.state == SandboxState::Running))
                .map(|(id, e)| (id.clone(), e.clone()))
                .collect();
            let mode = self.mode;
            let _ = blocking(move || {
                let (t0, n) = (Instant::now(), running.len());
                for (id, e) in running {
                    let rel = cgroup::sandbox_cgroup_path(&id);
                    let (memory_used_bytes, memory_cache_bytes) = cgroup::memory(mode, &rel);
                    e.samples.push(dsec_common::api::MetricsSample {
                        timestamp_ms: now_ms(),
                        cpu_used_ns: cgroup::cpu_usage_ns(mode, &rel),
                        memory_used_bytes,
                        memory_cache_bytes,
                    });
                }
                // Reading thousands of cgroups is not free: said when it is slow.
                let took_ms = t0.elapsed().as_millis() as u64;
                if took_ms >= 100 {
                    tracing::info!(sandboxes = n, took_ms, "metrics sampled (slowly)");
                } else {
                    tracing::debug!(sandboxes = n, took_ms, "metrics sampled");
                }
            })
            .await;
        }
    }

    /// The kept readings of sandbox `id` (running or paused) from `start_ms` to `end_ms`.
    pub fn metrics_history(
        &self,
        id: &str,
        start_ms: Option<u64>,
        end_ms: Option<u64>,
    ) -> Result<dsec_common::api::MetricsHistory, ApiError> {
        let e = self.entry(id)?;
        let limits = e.snapshot().limits;
        Ok(dsec_common::api::MetricsHistory {
            interval_ms: self.cfg.metrics_interval_ms,
            cpu_cores: limits.cpu_cores,
            memory_limit_bytes: limits.memory_mb << 20,
            samples: e.samples.between(start_ms, end_ms),
        })
    }

    /// Stops every sandbox (for `dsec down`), a bounded number at a time (thousands at once would only
    /// queue on the same cores and locks), calling `progress(left, total)` as each ends.
    pub async fn stop_all(self: &Arc<Self>, progress: impl Fn(usize, usize)) {
        use futures_util::StreamExt;
        // No pool refills from here on; a member being made is waited for (a minute at
        // most), so that it is stopped with the rest.
        self.pools.close();
        for _ in 0..600 {
            if self.pools.filling.load(Ordering::SeqCst) == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.discard_pool_seeds().await;
        let ids = self.ids();
        let total = ids.len();
        let left = std::sync::atomic::AtomicUsize::new(total);
        progress(total, total);
        let at_once = std::thread::available_parallelism().map_or(2, |n| n.get()) * 4;
        futures_util::stream::iter(ids)
            .for_each_concurrent(at_once, |id| {
                let (edge, left, progress) = (self.clone(), &left, &progress);
                async move {
                    if let Err(e) = edge.stop(&id).await {
                        tracing::warn!(sandbox = %id, "stopping at shutdown: {}", e.message);
                    }
                    let n = left.fetch_sub(1, std::sync::atomic::Ordering::SeqCst) - 1;
                    progress(n, total);
                }
            })
            .await;
        if self
            .sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty()
        {
            cgroup::remove_parents(self.mode);
            if let Some(n) = self.net.clone() {
                let _ = blocking(move || n.shutdown()).await;
            }
            if let Ok(ns) = mountns::get() {
                ns.stop();
            }
            if let Some(m) = self.images.lazy().cloned() {
                // What the sandboxes' namespace held goes with this process.
                let _ = blocking(move || m.unmount_all()).await;
            }
            for t in &self.dns {
                t.abort();
            }
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
