//! What keeps the node's view true: the sandboxes a restarted edge finds and re-adopts,
//! the reaper (TTL, deaths the kernel tells, agents that stopped answering), and the
//! metrics sampler.

use super::*;

impl Edge {
    pub(crate) fn adopt(&self) {
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

    /// Stops sandboxes whose TTL or idle timeout ran out and, with `check_alive`, ones
    /// whose agent has gone.
    pub async fn reap_once(self: &Arc<Self>, check_alive: bool) {
        let now = now_ms();
        // Read in place under the lock (no record is copied): this runs twice a second
        // over every sandbox on the node. Only a running sandbox's time runs (a preempted
        // job resumes later); one in the middle of an operation (a pause, a fork) is not
        // judged dead: its agent may be stopped on purpose. A sandbox the kernel watches
        // for its death (`deaths.rs`) is not polled.
        let mut due: Vec<(String, StopReason)> = Vec::new();
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
                    due.push((id.clone(), StopReason::Expired));
                } else if r
                    .idle_timeout_seconds
                    .is_some_and(|s| now >= r.last_activity_ms + s * 1000)
                {
                    due.push((id.clone(), StopReason::Idle));
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
                    due.push((id, StopReason::Died));
                }
            }
        }
        for id in to_pause {
            let edge = self.clone();
            tokio::spawn(async move { edge.pause_on_timeout(&id).await });
        }
        for (id, reason) in due {
            tracing::info!(sandbox = %id, reason = reason.as_str(), "stopping");
            let edge = self.clone();
            tokio::spawn(async move {
                if let Err(e) = edge.stop_for(&id, reason).await {
                    tracing::warn!(sandbox = %id, "stopping: {}", e.message);
                }
            });
        }
    }

    /// A watched sandbox's first process exited: it is stopped once no operation holds it
    /// (a pause or a fork may be under way), if it is still running by then.
    pub(crate) async fn on_death(self: &Arc<Self>, id: String) {
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
            if let Err(e) = self.stop_for(&id, StopReason::Died).await {
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
    pub(crate) async fn sample_forever(self: Arc<Self>) {
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

    /// What each listed sandboxes that `visible` lets through uses, from the readings
    /// already kept: a look at memory per sandbox, no cgroup read.
    pub fn usage(
        &self,
        labels: &BTreeMap<String, String>,
        visible: impl Fn(&str) -> bool,
    ) -> dsec_common::api::UsageResponse {
        let entries: Vec<Arc<Entry>> = self
            .sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        let mut sandboxes = Vec::new();
        for e in entries {
            let mut u = {
                let r = e.rec.lock().unwrap_or_else(|p| p.into_inner());
                if r.pool_waiting.is_some()
                    || !visible(&r.project)
                    || !labels.iter().all(|(k, v)| r.labels.get(k) == Some(v))
                {
                    continue;
                }
                dsec_common::api::SandboxUsage {
                    id: r.id.clone(),
                    project: r.project.clone(),
                    state: r.state,
                    backend: r.backend.clone(),
                    image: r.image.clone(),
                    cpu_cores: r.limits.cpu_cores,
                    cpu_percent: None,
                    memory_used_bytes: 0,
                    memory_limit_bytes: r.limits.memory_mb << 20,
                    sampled_at_ms: 0,
                }
            };
            let (before, last) = e.samples.last_two();
            if let Some(l) = last {
                u.memory_used_bytes = l.memory_used_bytes;
                u.sampled_at_ms = l.timestamp_ms;
                if let Some(b) = before
                    && l.timestamp_ms > b.timestamp_ms
                    && u.state == SandboxState::Running
                {
                    let ns = l.cpu_used_ns.saturating_sub(b.cpu_used_ns) as f64;
                    let wall_ns = (l.timestamp_ms - b.timestamp_ms) as f64 * 1e6;
                    u.cpu_percent = Some((ns / wall_ns * 1000.0).round() / 10.0);
                }
            }
            sandboxes.push(u);
        }
        sandboxes.sort_by(|a, b| a.id.cmp(&b.id));
        dsec_common::api::UsageResponse {
            sandboxes,
            interval_ms: self.cfg.metrics_interval_ms,
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
}
