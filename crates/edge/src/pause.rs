//! Pause and resume: in place or to disk, by id or by label for a group, a sandbox woken
//! by a request for it, and a TTL that pauses instead of stopping.

use super::*;

impl Edge {
    /// Pauses a running sandbox: frozen in place, or (`to_disk`, VM backends) saved to
    /// disk with its processes ended. Its TTL and idle time stop running until resumed.
    pub async fn pause(self: &Arc<Self>, id: &str, to_disk: bool) -> Result<SandboxInfo, ApiError> {
        let (edge, id) = (self.clone(), id.to_string());
        finish(async move { edge.pause_now(&id, to_disk).await }).await
    }

    pub(crate) async fn pause_now(
        self: &Arc<Self>,
        id: &str,
        to_disk: bool,
    ) -> Result<SandboxInfo, ApiError> {
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
        self.event("paused", &rec, None, &[("to_disk", to_disk.into())]);
        Ok(rec.info())
    }

    /// Resumes a paused sandbox where it stopped (from disk if it was paused to disk).
    pub async fn resume(self: &Arc<Self>, id: &str) -> Result<SandboxInfo, ApiError> {
        let (edge, id) = (self.clone(), id.to_string());
        finish(async move { edge.resume_now(&id).await }).await
    }

    pub(crate) async fn resume_now(self: &Arc<Self>, id: &str) -> Result<SandboxInfo, ApiError> {
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
        self.event("resumed", &rec, None, &[]);
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
    pub(crate) async fn pause_on_timeout(self: &Arc<Self>, id: &str) {
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
            if let Err(e) = self.stop_for(id, StopReason::Expired).await {
                tracing::warn!(sandbox = %id, "stopping: {}", e.message);
            }
        }
    }
}
