//! Fork: the source saved once (paused around it, or captured live), the copies started
//! from that save in parallel, each through the create path, and the save let go.

use super::*;

impl Edge {
    pub async fn fork(
        self: &Arc<Self>,
        id: &str,
        req: ForkRequest,
    ) -> Result<ForkResponse, ApiError> {
        let (edge, id) = (self.clone(), id.to_string());
        finish(async move {
            let r = edge.fork_now(&id, req).await?;
            if let Ok(e) = edge.entry_any(&id) {
                let copies: Vec<serde_json::Value> =
                    r.sandboxes.iter().map(|s| s.id.clone().into()).collect();
                edge.event("forked", &e.snapshot(), None, &[("copies", copies.into())]);
            }
            Ok(r)
        })
        .await
    }

    pub(crate) async fn fork_now(
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
    pub(crate) async fn copies(
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
}
