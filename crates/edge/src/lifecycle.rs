//! A sandbox's life on the edge: create (validation, admission, quota, network, the
//! backend, the agent's answer), exec, network rules, TTL, stop, and the node's shutdown.

use super::*;

impl Edge {
    pub async fn create(
        self: &Arc<Self>,
        req: CreateSandboxRequest,
    ) -> Result<SandboxInfo, ApiError> {
        // Counted here, from its arrival, whatever ends it (a bad request, a missing image,
        // admission, the backend); fork copies and pool members are counted by `launch`.
        let backend = self.backend(&req.backend).map_or("unknown", |b| b.name());
        let mut counted = CreateCount::start(backend);
        let r = self.create_request(req).await;
        counted.end(r.as_ref().map(|_| ()).map_err(|e| e.code.as_str()));
        r
    }

    async fn create_request(
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
        let started = Instant::now();
        let s = blocking(move || n2.attach(&id2, slot, policy)).await??;
        dsec_metrics::net::netfilter_took("attach", started.elapsed().as_secs_f64());
        if let Some(nr) = &mut rec.network {
            nr.ip = Some(s.ip.to_string());
            nr.gateway = Some(s.gateway.to_string());
        }
        self.registry.save(rec)
    }

    /// The network a create asks for, its rules checked (400 names what is wrong).
    pub(crate) fn network_for(
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
    pub(crate) async fn install_trust(&self, sock: &std::path::Path) -> Result<(), ApiError> {
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
        self.event("updated", &rec, Some("network"), &[]);
        Ok(rec.info())
    }

    /// The node's final say: its real free memory, disk and load, and its sandbox count.
    pub(crate) fn admit(&self) -> Result<(), ApiError> {
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
        host::admit(&self.cfg.name, &snapshot, &reserve).map_err(|r| {
            dsec_metrics::sandbox::refused(r.resource());
            ApiError::node_full(r.to_string())
        })
    }

    /// Starts `rec` on `backend`: the shared path of create and fork.
    pub(crate) async fn launch(
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
        // A create is counted by `create`; a fork's copy, a restore and a pool member here.
        let mut counted = (seed.is_some() || rec.pool_waiting.is_some())
            .then(|| CreateCount::start(backend.name()));
        let mut phases = Phases::start();
        let from_seed = seed.is_some();
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
        if let Some(c) = &mut counted {
            c.end(result.as_ref().map(|_| ()).map_err(|e| e.code.as_str()));
        }
        match result {
            Ok(info) => {
                if rec.pool_waiting.is_none() {
                    let (reason, detail) = match (&rec.forked_from, from_seed) {
                        (Some(src), _) => ("fork", vec![("forked_from", src.clone().into())]),
                        (None, true) => ("restore", Vec::new()),
                        (None, false) => ("create", Vec::new()),
                    };
                    self.event("created", &rec, Some(reason), &detail);
                }
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
        let started = Instant::now();
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
                    let now = e.update(|r| {
                        r.oom_kills = after;
                        r.clone()
                    });
                    let _ = self.registry.save(&now);
                    if after > rec.oom_kills {
                        self.event("oom_killed", &now, None, &[("oom_kills", after.into())]);
                    }
                }
                dsec_metrics::sandbox::exec_took(&rec.backend, started.elapsed().as_secs_f64());
                Ok(r)
            }
            other => Err(channel::unexpected(&other)),
        }
    }

    /// Stops a sandbox because it was asked to (by the API or the node's own work).
    pub async fn stop(self: &Arc<Self>, id: &str) -> Result<(), ApiError> {
        self.stop_for(id, StopReason::Requested).await
    }

    pub(crate) async fn stop_for(
        self: &Arc<Self>,
        id: &str,
        why: StopReason,
    ) -> Result<(), ApiError> {
        let e = self.entry_any(id)?;
        let _g = e.op.lock().await;
        // A stop that waited for another one (a DELETE racing the TTL) has nothing left to
        // do: its quota is not given back twice, nor is it counted twice.
        let current = self
            .sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .is_some_and(|now| Arc::ptr_eq(now, &e));
        if !current {
            return Ok(());
        }
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
            let started = Instant::now();
            blocking(move || n.detach(&id2, nr.slot)).await?;
            dsec_metrics::net::netfilter_took("detach", started.elapsed().as_secs_f64());
        }
        let _ = std::fs::remove_dir_all(self.registry.dir(id));
        self.trajectories.forget(&self.registry.dir(id));
        self.release_quota(id).await;
        self.sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        dsec_metrics::sandbox::stopped(&rec.backend, why.as_str());
        // A pool member that was never handed out was nobody's: no event.
        if rec.pool_waiting.is_none() {
            match why {
                StopReason::Expired => self.event("expired", &rec, None, &[]),
                _ => self.event("stopped", &rec, Some(why.as_str()), &[]),
            }
        }
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
        self.event(
            "updated",
            &rec,
            Some("timeout"),
            &[("expires_at_ms", rec.expires_at_ms.into())],
        );
        Ok(rec.info())
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
                    if let Err(e) = edge.stop_for(&id, StopReason::Shutdown).await {
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

/// Why a sandbox is stopped, as the metrics name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StopReason {
    /// The API or the node's own work (a function call done, a pool gone) asked.
    Requested,
    /// Its time ran out.
    Expired,
    /// It was idle for its idle timeout.
    Idle,
    /// Its agent or its VM died.
    Died,
    /// The node is shutting down (`dsec down`).
    Shutdown,
}

impl StopReason {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            StopReason::Requested => "requested",
            StopReason::Expired => "expired",
            StopReason::Idle => "idle",
            StopReason::Died => "died",
            StopReason::Shutdown => "shutdown",
        }
    }
}

/// A create's count: its outcome when it ends, `cancelled` when its caller went away
/// first (the sandbox is still made, by a task of its own, and counted as it stops).
struct CreateCount {
    backend: &'static str,
    started: Instant,
    done: bool,
}

impl CreateCount {
    fn start(backend: &'static str) -> CreateCount {
        CreateCount {
            backend,
            started: Instant::now(),
            done: false,
        }
    }

    fn end(&mut self, outcome: Result<(), &str>) {
        self.done = true;
        let secs = self.started.elapsed().as_secs_f64();
        dsec_metrics::sandbox::created(self.backend, outcome.map(|()| secs));
    }
}

impl Drop for CreateCount {
    fn drop(&mut self) {
        if !self.done {
            dsec_metrics::sandbox::created(self.backend, Err("cancelled"));
        }
    }
}
