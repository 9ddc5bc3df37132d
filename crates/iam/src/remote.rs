//! [`RemoteIam`]: the [`Iam`] of a component that is not an IAM replica (apiserver, edge).
//! It calls the replicas' service over mutual TLS, moving to the next replica when one does
//! not answer, and caches key lookups briefly so that a request costs no IAM round trip.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Limited};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::service::{
    ActorRequest, ApplyFailure, AuthenticateReply, AuthenticateRequest, PATH_APPLY,
    PATH_AUTHENTICATE, PATH_KEYS, PATH_PROJECTS,
};
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
const MAX_ANSWER: usize = 64 << 20;

struct Inner {
    replicas: Vec<String>,
    client: dsec_mtls::Client,
    /// The replica that answered last; calls start there.
    preferred: AtomicUsize,
    cache: Mutex<HashMap<String, (Option<Principal>, Instant)>>,
}

/// A client of the IAM replicas. Cheap to clone.
#[derive(Clone)]
pub struct RemoteIam {
    inner: Arc<Inner>,
}

enum CallError {
    /// The replica did not answer (connect failure, timeout, 5xx): try another.
    Down(String),
    /// The replica answered with a refusal.
    Refused(crate::state::Refusal),
}

impl RemoteIam {
    /// `replicas` are the replicas' `host:port`; `tls` this component's client config.
    pub fn new(replicas: Vec<String>, tls: Option<Arc<rustls::ClientConfig>>) -> RemoteIam {
        RemoteIam {
            inner: Arc::new(Inner {
                replicas,
                client: dsec_mtls::Client::new(tls),
                preferred: AtomicUsize::new(0),
                cache: Mutex::new(HashMap::new()),
            }),
        }
    }

    async fn post_one<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        addr: &str,
        path: &str,
        req: &Req,
        timeout: Duration,
    ) -> Result<Resp, CallError> {
        let body = serde_json::to_vec(req).map_err(|e| CallError::Down(e.to_string()))?;
        let url = format!("{}{path}", self.inner.client.base(addr));
        let request =
            dsec_mtls::client::post_json(&url, body).map_err(|e| CallError::Down(e.to_string()))?;
        let call = async {
            let resp = self
                .inner
                .client
                .request(request)
                .await
                .map_err(|e| CallError::Down(format!("{addr}: {e}")))?;
            let status = resp.status();
            let bytes = Limited::new(resp.into_body(), MAX_ANSWER)
                .collect()
                .await
                .map_err(|e| CallError::Down(format!("{addr}: reading the answer: {e}")))?
                .to_bytes();
            if status.is_success() {
                return serde_json::from_slice(&bytes)
                    .map_err(|e| CallError::Down(format!("{addr}: bad answer: {e}")));
            }
            match serde_json::from_slice::<ApplyFailure>(&bytes) {
                Ok(ApplyFailure::Refused(r)) => Err(CallError::Refused(r)),
                Ok(ApplyFailure::Unavailable(m)) => Err(CallError::Down(format!("{addr}: {m}"))),
                Err(_) => Err(CallError::Down(format!(
                    "{addr} answered {status}: {}",
                    String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
                ))),
            }
        };
        tokio::time::timeout(timeout, call)
            .await
            .map_err(|_| CallError::Down(format!("{addr} did not answer within {timeout:?}")))?
    }

    /// Calls the replicas in turn, starting with the one that answered last, until one
    /// answers or `timeout` has passed.
    async fn post<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        path: &str,
        req: &Req,
        timeout: Duration,
    ) -> Result<Resp, IamError> {
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
            match self.post_one(addr, path, req, left).await {
                Ok(r) => {
                    self.inner.preferred.store(i % n, Ordering::Relaxed);
                    return Ok(r);
                }
                Err(CallError::Refused(r)) => return Err(IamError::Refused(r)),
                Err(CallError::Down(m)) => {
                    tracing::debug!(replica = %addr, error = %m, "IAM replica did not answer");
                    errors.push(m);
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
        let reply: AuthenticateReply = match self
            .post(
                PATH_AUTHENTICATE,
                &AuthenticateRequest {
                    key: key.to_string(),
                },
                READ_TIMEOUT,
            )
            .await
        {
            Ok(r) => r,
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
        cache.insert(h, (reply.principal.clone(), Instant::now()));
        reply.principal
    }

    pub async fn write(&self, cmd: Command) -> Result<(), IamError> {
        let revokes = matches!(cmd, Command::RevokeKey { .. });
        self.post::<_, serde_json::Value>(PATH_APPLY, &cmd, WRITE_TIMEOUT)
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
        let req = ActorRequest {
            actor: actor.to_string(),
        };
        self.block(self.post(PATH_PROJECTS, &req, READ_TIMEOUT))
    }

    fn keys(&self, actor: &str) -> Result<Vec<KeyRecord>, IamError> {
        let req = ActorRequest {
            actor: actor.to_string(),
        };
        self.block(self.post(PATH_KEYS, &req, READ_TIMEOUT))
    }
}
