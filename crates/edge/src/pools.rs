//! Warm pools (`[[edge.pools]]`): sandboxes made ahead from a configured spec, waiting
//! unlisted and owned by no project, each handed out once, to a create that asks for what
//! they are (the same image digest, backend and limits, and a network if they have one).
//! That create then costs a few messages (the tenant's rules as set elements, its quota
//! reservation, its environment to the agent) instead of a sandbox start.
//!
//! A member is as fresh as a new sandbox: made for nobody, never given back, its own id
//! and token. What a create adds is applied at hand-out: project, labels, TTL, idle
//! timeout, network rules (a member waits with none: egress denied), environment. The
//! image's `[start]` command ran when the member was made, with the image's environment.
//!
//! One task per pool refills it, one member at a time, only once no create has asked for
//! 200 ms and none is under way, and at most `refill_per_second`: creates, pooled or not,
//! are never starved by a refill.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsec_common::ApiError;
use dsec_common::api::{
    CreateSandboxRequest, ExecRequest, Limits, PoolStatus, SandboxInfo, SandboxState,
};
use dsec_common::channel::Response;
use dsec_image::ImageRef;

use crate::config::{EdgeConfig, PoolConfig};
use crate::registry::now_ms;
use crate::{Edge, blocking, channel, environment_request, port_token, validate};

/// A member ready to hand out.
struct Ready {
    id: String,
    digest: String,
    net: bool,
}

struct Pool {
    cfg: PoolConfig,
    limits: Limits,
    ready: VecDeque<Ready>,
    /// Members being made now.
    filling: u32,
    /// VM pools: the saved state of a booted member, restored to make the next ones.
    seed: Option<Seed>,
}

/// A snapshot of a booted member (`save_running`, as a fork's), of one image digest.
#[derive(Clone)]
struct Seed {
    dir: PathBuf,
    digest: String,
}

pub(crate) struct Pools {
    pools: Mutex<HashMap<String, Pool>>,
    /// Wakes the refill tasks (a member was taken, or the node is closing).
    changed: tokio::sync::Notify,
    /// Pool members being made on the node (the rest of `Edge::creating` is ordinary
    /// creates, which go first).
    pub(crate) filling: AtomicU64,
    closing: AtomicBool,
    /// When a create last asked (a hand-out or a new sandbox): a refill waits until the
    /// node has been quiet for [`QUIET`], so a burst has the machine to itself.
    last_ask: Mutex<std::time::Instant>,
}

const QUIET: Duration = Duration::from_millis(200);

/// The create a pool's members are made by.
pub(crate) fn request(cfg: &PoolConfig, edge: &EdgeConfig) -> CreateSandboxRequest {
    CreateSandboxRequest {
        backend: cfg.backend.clone(),
        image: cfg.image.clone(),
        cpu_cores_limit: cfg.cpu_cores,
        memory_limit_mb: cfg.memory_mb.map(|m| m as f64),
        disk_limit_mb: cfg.disk_mb.map(|m| m as f64),
        pids_limit: cfg.pids.map(|m| m as f64),
        // A member waits at most the longest TTL; the reaper then replaces it.
        ttl_seconds: Some(edge.max.ttl_seconds as f64),
        ..CreateSandboxRequest::default()
    }
}

/// A pool's or a function's name: 1-32 of `[a-z0-9-]`.
pub(crate) fn valid_name(n: &str) -> bool {
    (1..=32).contains(&n.len())
        && n.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

impl Pools {
    /// The configured pools, each checked as a create would be (an error names the pool).
    pub(crate) fn new(cfg: &EdgeConfig) -> Result<Pools, ApiError> {
        let mut pools = HashMap::new();
        for p in &cfg.pools {
            if !valid_name(&p.name) {
                return Err(ApiError::invalid(format!(
                    "[[edge.pools]] name {:?}: use 1-32 of a-z, 0-9 and -",
                    p.name
                )));
            }
            if !(p.refill_per_second.is_finite() && p.refill_per_second > 0.0) {
                return Err(ApiError::invalid(format!(
                    "[[edge.pools]] {}: refill_per_second must be above 0",
                    p.name
                )));
            }
            let v = validate::create(cfg, &request(p, cfg)).map_err(|e| {
                ApiError::invalid(format!("[[edge.pools]] {}: {}", p.name, e.message))
            })?;
            let pool = Pool {
                cfg: p.clone(),
                limits: v.limits,
                ready: VecDeque::new(),
                filling: 0,
                seed: None,
            };
            if pools.insert(p.name.clone(), pool).is_some() {
                return Err(ApiError::invalid(format!(
                    "[[edge.pools]] {} is named twice",
                    p.name
                )));
            }
        }
        Ok(Pools {
            pools: Mutex::new(pools),
            changed: tokio::sync::Notify::new(),
            filling: AtomicU64::new(0),
            closing: AtomicBool::new(false),
            last_ask: Mutex::new(std::time::Instant::now()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Pool>> {
        self.pools.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn status(&self) -> Vec<PoolStatus> {
        let mut v: Vec<PoolStatus> = self
            .lock()
            .values()
            .map(|p| PoolStatus {
                name: p.cfg.name.clone(),
                image: p.cfg.image.clone(),
                backend: p.cfg.backend.clone(),
                size: p.cfg.size,
                ready: p.ready.len() as u32,
            })
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// Takes a ready member that matches; `(pool, id)`.
    fn pop(
        &self,
        backend: &str,
        limits: &Limits,
        digest: &str,
        net: bool,
    ) -> Option<(String, String)> {
        let mut pools = self.lock();
        for (name, p) in pools.iter_mut() {
            if p.cfg.backend != backend || &p.limits != limits {
                continue;
            }
            if let Some(i) = p
                .ready
                .iter()
                .position(|r| r.digest == digest && r.net == net)
                && let Some(r) = p.ready.remove(i)
            {
                return Some((name.clone(), r.id));
            }
        }
        None
    }

    fn push(&self, pool: &str, r: Ready) {
        if let Some(p) = self.lock().get_mut(pool) {
            p.ready.push_back(r);
        }
    }

    /// A member adopted after a restart: waits in its pool again if the pool is still
    /// configured with the limits it has; false: it should go.
    pub(crate) fn adopt(&self, pool: &str, id: &str, rec: &crate::registry::SandboxRecord) -> bool {
        let mut pools = self.lock();
        match pools.get_mut(pool) {
            Some(p) if p.cfg.backend == rec.backend && p.limits == rec.limits => {
                p.ready.push_back(Ready {
                    id: id.to_string(),
                    digest: rec.image_digest.clone(),
                    net: rec.network.is_some(),
                });
                true
            }
            _ => false,
        }
    }

    /// A waiting member is gone (it died, or was stopped): out of its pool's queue, which
    /// its refill then tops up.
    pub(crate) fn forget(&self, pool: &str, id: &str) {
        if let Some(p) = self.lock().get_mut(pool) {
            p.ready.retain(|r| r.id != id);
        }
        self.changed.notify_waiters();
    }

    /// A create asked for a sandbox (pooled or not).
    pub(crate) fn asked(&self) {
        *self.last_ask.lock().unwrap_or_else(|p| p.into_inner()) = std::time::Instant::now();
    }

    fn quiet(&self) -> bool {
        self.last_ask
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed()
            >= QUIET
    }

    /// For `dsec down`: refilling ends.
    pub(crate) fn close(&self) {
        self.closing.store(true, Ordering::SeqCst);
        self.changed.notify_waiters();
    }
}

impl Edge {
    /// Hands out a ready member of a pool that matches the create, with the create's
    /// project, labels, limits of time, rules and environment applied; None: no pool has
    /// one (the create makes a sandbox as usual).
    pub(crate) async fn take_pooled(
        self: &Arc<Self>,
        req: &CreateSandboxRequest,
        v: &validate::CreateParams,
        digest: &str,
        backend: &str,
        net: bool,
    ) -> Result<Option<SandboxInfo>, ApiError> {
        self.pools.asked();
        loop {
            let mut phases = crate::Phases::start();
            let Some((pool, id)) = self.pools.pop(backend, &v.limits, digest, net) else {
                return Ok(None);
            };
            let Ok(e) = self.entry_any(&id) else {
                continue; // it died while waiting
            };
            let g = e.op.lock().await;
            let waiting = e.snapshot();
            if waiting.state != SandboxState::Running || waiting.pool_waiting.is_none() {
                continue;
            }
            phases.mark("take");
            let now = now_ms();
            let mut rec = waiting.clone();
            rec.project = req
                .project
                .clone()
                .unwrap_or_else(dsec_common::api::root_project);
            rec.labels = req.labels.clone();
            rec.env.extend(req.env.clone());
            rec.created_at_ms = now;
            rec.expires_at_ms = now + v.ttl_seconds * 1000;
            rec.idle_timeout_seconds = v.idle_timeout_seconds;
            rec.pause_on_timeout = v.pause_on_timeout;
            rec.pause_to_disk_on_timeout = v.pause_to_disk_on_timeout;
            rec.ttl_ms = v.ttl_seconds * 1000;
            rec.resume_on_request = req.auto_resume == Some(true);
            rec.last_activity_ms = now;
            rec.port_token = port_token();
            rec.pool_waiting = None;
            rec.from_pool = Some(pool.clone());
            if let Some(nr) = &mut rec.network {
                nr.rules = req.network_rules.clone();
            }
            if let Err(err) = self.reserve_quota(&rec).await {
                // Still the pool's: back where it was.
                self.pools.push(
                    &pool,
                    Ready {
                        id,
                        digest: digest.to_string(),
                        net,
                    },
                );
                return Err(err);
            }
            phases.mark("reserve");
            let applied = async {
                if let (Some(n), Some(nr)) = (&self.net, &rec.network)
                    && !nr.rules.is_empty()
                {
                    let policy = n.policy(&nr.rules, &nr.egress_headers)?;
                    let (n2, id2) = (n.clone(), id.clone());
                    blocking(move || n2.set_policy(&id2, policy)).await??;
                }
                phases.mark("rules");
                self.registry.save(&rec)?;
                e.update(|r| *r = rec.clone());
                phases.mark("record");
                // The member's agent is up: one request, on a connection kept for the
                // sandbox's first exec where the backend keeps them.
                let backend = self.backend(&rec.backend)?;
                let (sock, req) = (self.paths(&id).channel, environment_request(&rec));
                let answer = if backend.keeps_agent_connections() {
                    channel::call_kept(&e.agent, &sock, &req, backend.start_timeout()).await?
                } else {
                    channel::call(&sock, &req, backend.start_timeout()).await?
                };
                match answer {
                    Response::Ok => Ok(()),
                    other => Err(channel::unexpected(&other)),
                }
            }
            .await;
            drop(g);
            if let Err(err) = applied {
                tracing::warn!(sandbox = %id, pool = %pool, "handing out a pool member: {}", err.message);
                let _ = self.stop(&id).await;
                return Err(err);
            }
            phases.mark("agent");
            self.pools.changed.notify_waiters(); // its refill
            tracing::info!(sandbox = %id, pool = %pool, phases = %phases, "sandbox handed out from a warm pool");
            self.event(
                "created",
                &rec,
                Some("pool"),
                &[("pool", pool.clone().into())],
            );
            return Ok(Some(rec.info()));
        }
    }

    /// Saves member `id` of a VM pool as the pool's seed; without one (it failed) the
    /// pool boots its members.
    async fn make_seed(
        self: &Arc<Self>,
        pool: &str,
        backend: &Arc<dyn crate::backend::Backend>,
        id: &str,
        digest: &str,
    ) {
        let Ok(e) = self.entry_any(id) else { return };
        let dir = self
            .fork_tmp
            .join(format!("pool-{pool}-{}", dsec_common::id::random_hex(8)));
        match self
            .save_running(&e, backend, &dir, "saved for its pool")
            .await
        {
            Ok(paused_ms) => {
                tracing::info!(pool, sandbox = %id, paused_ms, "pool seed saved: the next members are restored from it");
                let kept = match self.pools.lock().get_mut(pool) {
                    Some(p) if p.seed.is_none() => {
                        p.seed = Some(Seed {
                            dir: dir.clone(),
                            digest: digest.to_string(),
                        });
                        true
                    }
                    _ => false,
                };
                if !kept {
                    self.discard_seed(backend, &dir).await;
                }
            }
            Err(err) => {
                tracing::warn!(
                    pool,
                    "saving a seed for the pool ({}); its members are booted",
                    err.message
                );
            }
        }
    }

    /// Removes every pool's seed (for `dsec down`).
    pub(crate) async fn discard_pool_seeds(self: &Arc<Self>) {
        let seeds: Vec<(String, Seed)> = self
            .pools
            .lock()
            .values_mut()
            .filter_map(|p| p.seed.take().map(|s| (p.cfg.backend.clone(), s)))
            .collect();
        for (backend, s) in seeds {
            if let Ok(b) = self.backend(&backend) {
                self.discard_seed(&b, &s.dir).await;
            }
        }
    }

    /// Starts the refill task of every pool.
    pub(crate) fn spawn_pools(self: &Arc<Self>) {
        let names: Vec<String> = self.pools.lock().keys().cloned().collect();
        for name in names {
            let edge = self.clone();
            tokio::spawn(async move { edge.refill(name).await });
        }
    }

    async fn refill(self: Arc<Self>, name: String) {
        loop {
            if self.pools.closing.load(Ordering::SeqCst) {
                return;
            }
            let (need, cfg) = {
                let pools = self.pools.lock();
                let Some(p) = pools.get(&name) else { return };
                let have = p.ready.len() as u32 + p.filling;
                (p.cfg.size.saturating_sub(have), p.cfg.clone())
            };
            if need == 0 {
                let _ = tokio::time::timeout(Duration::from_secs(5), self.pools.changed.notified())
                    .await;
                continue;
            }
            // Creates first: a pool never holds up a caller, nor a burst of hand-outs.
            let filling = self.pools.filling.load(Ordering::SeqCst);
            if self.creating.load(Ordering::SeqCst) > filling || !self.pools.quiet() {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            // Counted as being made before closing is looked at: `dsec down` closes, then
            // waits until none is being made, so it either waits for this member (and
            // stops it with the rest) or this fill sees it closing. Counted any later,
            // a member could start after `dsec down` had listed what to stop, and outlive it.
            self.pools.filling.fetch_add(1, Ordering::SeqCst);
            let made = if self.pools.closing.load(Ordering::SeqCst) {
                Ok(())
            } else {
                self.fill_one(&cfg).await
            };
            self.pools.filling.fetch_sub(1, Ordering::SeqCst);
            if let Err(e) = made {
                tracing::warn!(pool = %name, "making a pool member: {}", e.message);
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
            tokio::time::sleep(Duration::from_secs_f64(1.0 / cfg.refill_per_second)).await;
        }
    }

    /// Makes one member of pool `cfg`; members of an image the pool's reference no longer
    /// names are stopped (no create would match them).
    async fn fill_one(self: &Arc<Self>, cfg: &PoolConfig) -> Result<(), ApiError> {
        let req = request(cfg, &self.cfg);
        let v = validate::create(&self.cfg, &req)?;
        let network = self.network_for(&req)?;
        let image = ImageRef::parse(&cfg.image).map_err(|e| ApiError::invalid(e.to_string()))?;
        let (images, image2) = (self.images.clone(), image.clone());
        let (digest, manifest) = blocking(move || images.resolve(&image2))
            .await?
            .map_err(|e| ApiError::not_found(e.to_string()))?;
        // Before the member is counted as being made: nothing to undo if it fails.
        let backend = self.backend(&cfg.backend)?;
        let (stale, old_seed, seed) = {
            let mut pools = self.pools.lock();
            let Some(p) = pools.get_mut(&cfg.name) else {
                return Ok(());
            };
            let (keep, stale): (VecDeque<Ready>, VecDeque<Ready>) =
                p.ready.drain(..).partition(|r| r.digest == digest);
            p.ready = keep;
            p.filling += 1;
            let old_seed = p.seed.take_if(|s| s.digest != digest);
            let stale: Vec<String> = stale.into_iter().map(|r| r.id).collect();
            (stale, old_seed, p.seed.clone())
        };
        for id in stale {
            tracing::info!(sandbox = %id, pool = %cfg.name, "its image was replaced; stopping the pool member");
            let _ = self.stop(&id).await;
        }
        if let Some(s) = old_seed {
            self.discard_seed(&backend, &s.dir).await;
        }
        // A VM pool boots one member, saves it as the seed, and restores the rest from
        // it: boot once per image, restore many (a restore answers in a fraction of a
        // boot; each copy gets its own id, clock and random seed, as a fork's copies do).
        let restored = seed.is_some();
        let made = self
            .create_new(
                req,
                v,
                image,
                digest.clone(),
                manifest,
                network,
                Some(cfg.name.clone()),
                seed.map(|s| s.dir),
            )
            .await;
        // A VM's emulator starts with none of the guest's code translated (TCG) and the
        // guest with none of its exec path paged in: one `true` now, so that the first
        // exec of whoever takes the member costs what any later one does.
        if let Ok(info) = &made
            && backend.fork_preserves_memory()
        {
            // Straight to its agent: a member is no sandbox of anyone's yet.
            let warm = ExecRequest {
                argv: Some(vec!["true".into()]),
                timeout_seconds: Some(30.0),
                ..ExecRequest::default()
            };
            let ran = match validate::exec(&self.cfg, &warm) {
                Ok(spec) => crate::channel::call(
                    &self.paths(&info.id).channel,
                    &dsec_common::channel::Request::Exec(spec),
                    Duration::from_secs(60),
                )
                .await
                .map(drop),
                Err(e) => Err(e),
            };
            if let Err(e) = ran {
                tracing::warn!(sandbox = %info.id, pool = %cfg.name, "warming a pool member: {}", e.message);
            }
        }
        if let Ok(info) = &made
            && !restored
            && backend.fork_preserves_memory()
            && !self.pools.closing.load(Ordering::SeqCst)
        {
            self.make_seed(&cfg.name, &backend, &info.id, &digest).await;
        }
        let info = {
            let mut pools = self.pools.lock();
            if let Some(p) = pools.get_mut(&cfg.name) {
                p.filling -= 1;
            }
            made?
        };
        if self.pools.closing.load(Ordering::SeqCst) {
            return Ok(()); // `dsec down` stops it with the rest
        }
        self.pools.push(
            &cfg.name,
            Ready {
                id: info.id,
                digest,
                net: info.network.mode != "none",
            },
        );
        Ok(())
    }
}
