//! [`RemoteIam`]: the [`Iam`] of a component that is not an IAM replica (apiserver, edge).
//! It calls the replicas' gRPC service (`dsec.v1.Iam`) over mutual TLS, moving to the next replica when one does
//! not answer, and caches key lookups briefly so that a request costs no IAM round trip.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dsec_rpc::pb::iam_client::IamClient;
use dsec_rpc::status::within;
use dsec_rpc::{CallError, Channels, Transport, pb};

use crate::rpc::refusal_from_api;
use crate::state::{Command, KeyRecord};
use crate::{Iam, IamError, Principal, ProjectView, hash_key};

/// How long a key's principal is trusted without asking again; a revoked key keeps working
/// on an apiserver for at most this long.
pub const AUTH_CACHE_TTL: Duration = Duration::from_secs(5);
/// Unknown keys are remembered for less, so a key made a moment ago soon works.
const NEGATIVE_TTL: Duration = Duration::from_millis(500);
const READ_TIMEOUT: Duration = Duration::from_secs(3);
/// A write may wait for an election (the replica retries for up to 10 s itself).
const WRITE_TIMEOUT: Duration = Duration::from_secs(15);

struct Inner {
    replicas: Vec<String>,
    channels: Channels,
    /// The replica that answered last; calls start there.
    preferred: AtomicUsize,
    cache: Mutex<HashMap<String, (Option<Principal>, Instant)>>,
}

/// A client of the IAM replicas (`dsec.v1.Iam` over gRPC). Cheap to clone.
#[derive(Clone)]
pub struct RemoteIam {
    inner: Arc<Inner>,
}

impl RemoteIam {
    /// `replicas` are the replicas' `host:port`; `tls` this component's client config.
    pub fn new(replicas: Vec<String>, tls: Option<Arc<rustls::ClientConfig>>) -> RemoteIam {
        RemoteIam {
            inner: Arc::new(Inner {
                replicas,
                channels: Channels::new(tls),
                preferred: AtomicUsize::new(0),
                cache: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Calls the replicas in turn, starting with the one that answered last, until one
    /// answers or `timeout` has passed. A refusal is an answer; anything else (no
    /// connection, no leader, a timeout) moves on to the next replica.
    async fn call<T, F, Fut>(&self, timeout: Duration, call: F) -> Result<T, IamError>
    where
        F: Fn(IamClient<Transport>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let n = self.inner.replicas.len();
        if n == 0 {
            return Err(crate::unavailable("no IAM replicas are configured"));
        }
        let deadline = Instant::now() + timeout;
        let mut errors = Vec::new();
        let mut i = self.inner.preferred.load(Ordering::Relaxed);
        loop {
            let addr = &self.inner.replicas[i % n];
            let left = deadline.saturating_duration_since(Instant::now());
            let answer = match self.inner.channels.client(addr, IamClient::with_origin) {
                Ok(c) => within(left, call(c)).await,
                Err(e) => Err(e),
            };
            match answer {
                Ok(r) => {
                    self.inner.preferred.store(i % n, Ordering::Relaxed);
                    return Ok(r);
                }
                Err(CallError::Api(e)) if let Some(r) = refusal_from_api(&e) => {
                    return Err(IamError::Refused(r));
                }
                Err(e) => {
                    tracing::debug!(replica = %addr, error = %e, "IAM replica did not answer");
                    errors.push(format!("{addr}: {e}"));
                }
            }
            i += 1;
            if Instant::now() >= deadline {
                let last: Vec<_> = errors.iter().rev().take(n).cloned().collect();
                return Err(crate::unavailable(last.join("; ")));
            }
            if i % n == self.inner.preferred.load(Ordering::Relaxed) % n {
                // Every replica failed once: an election may be on; wait a little.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    pub async fn authenticate_async(&self, key: &str) -> Option<Principal> {
        let h = hash_key(key);
        if let Some((p, at)) = self.lock_cache().get(&h).cloned() {
            let ttl = if p.is_some() {
                AUTH_CACHE_TTL
            } else {
                NEGATIVE_TTL
            };
            if at.elapsed() < ttl {
                return p;
            }
        }
        let asked = self
            .call(READ_TIMEOUT, |mut c| {
                let key = key.to_string();
                async move { c.authenticate(pb::AuthenticateRequest { key }).await }
            })
            .await;
        let principal = match asked.map(|r| r.principal.map(Principal::try_from).transpose()) {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "IAM answered a key lookup with a malformed principal");
                None
            }
            Err(e) => {
                // IAM unreachable: keep honouring a key seen recently rather than fail every
                // request during an election.
                tracing::warn!(error = %e, "IAM did not answer a key lookup");
                return self
                    .lock_cache()
                    .get(&h)
                    .filter(|(_, at)| at.elapsed() < AUTH_CACHE_TTL * 12)
                    .and_then(|(p, _)| p.clone());
            }
        };
        let mut cache = self.lock_cache();
        if cache.len() > 100_000 {
            cache.retain(|_, (_, at)| at.elapsed() < AUTH_CACHE_TTL);
        }
        cache.insert(h, (principal.clone(), Instant::now()));
        principal
    }

    pub async fn write(&self, cmd: Command) -> Result<(), IamError> {
        let revokes = matches!(cmd, Command::RevokeKey { .. });
        let msg = pb::Command::from(cmd);
        self.call(WRITE_TIMEOUT, |mut c| {
            let msg = msg.clone();
            async move { c.apply(msg).await }
        })
        .await?;
        if revokes {
            // This apiserver stops honouring the key at once; others within the cache TTL.
            self.lock_cache().clear();
        }
        Ok(())
    }

    fn lock_cache(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, (Option<Principal>, Instant)>> {
        self.inner.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn block<T>(&self, f: impl std::future::Future<Output = T>) -> T {
        // The trait is synchronous; inside the (multi-threaded) runtime, block this worker.
        match tokio::runtime::Handle::try_current() {
            Ok(h) => tokio::task::block_in_place(|| h.block_on(f)),
            Err(_) => tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map(|rt| rt.block_on(f))
                .expect("building a runtime for a blocking IAM call"),
        }
    }
}

impl Iam for RemoteIam {
    fn authenticate(&self, key: &str) -> Option<Principal> {
        self.block(self.authenticate_async(key))
    }

    fn apply(&self, cmd: Command) -> Result<(), IamError> {
        self.block(self.write(cmd))
    }

    fn projects(&self, actor: &str) -> Result<Vec<ProjectView>, IamError> {
        let actor = actor.to_string();
        let r = self.block(self.call(READ_TIMEOUT, |mut c| {
            let actor = actor.clone();
            async move { c.projects(pb::ActorRequest { actor }).await }
        }))?;
        Ok(r.projects.into_iter().map(Into::into).collect())
    }

    fn keys(&self, actor: &str) -> Result<Vec<KeyRecord>, IamError> {
        let actor = actor.to_string();
        let r = self.block(self.call(READ_TIMEOUT, |mut c| {
            let actor = actor.clone();
            async move { c.keys(pb::ActorRequest { actor }).await }
        }))?;
        r.keys
            .into_iter()
            .map(KeyRecord::try_from)
            .collect::<Result<_, _>>()
            .map_err(|e| IamError::Storage(format!("IAM answered a malformed key record: {e}")))
    }
}
