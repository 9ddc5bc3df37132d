//! Replica-to-replica RPC: JSON over HTTP/1.1 (over mutual TLS in a cluster; axum routes
//! in [`super::node`]). One client per target replica, each call bounded by a timeout.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Limited};
use openraft::error::{NetworkError, RPCError, ReplicationClosed, StreamingError, Unreachable};
use openraft::network::{RPCOption, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse,
};
use openraft::{BasicNode, RaftNetworkV2};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::types::{NodeId, Snapshot, SnapshotMeta, TypeConfig, Vote};

/// A replica's refusal of a snapshot, as it said it (its openraft error's text: the
/// error itself does not cross the wire). On the wire the string alone, as before.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, thiserror::Error)]
#[serde(transparent)]
#[error("{0}")]
pub struct SnapshotRefused(pub String);

pub const PATH_APPEND: &str = "/raft/append";
pub const PATH_VOTE: &str = "/raft/vote";
pub const PATH_PRE_VOTE: &str = "/raft/pre-vote";
pub const PATH_SNAPSHOT: &str = "/raft/snapshot";
pub const PATH_WRITE: &str = "/raft/write";

/// The largest answer read from a replica (snapshots included).
pub(crate) const MAX_BODY: usize = 512 << 20;

/// The body of a full snapshot transfer. The data is the state's JSON, carried as a string
/// (a byte array would be written as a list of numbers).
#[derive(Serialize, Deserialize)]
pub struct SnapshotRequest {
    pub vote: Vote,
    pub meta: SnapshotMeta,
    pub data: String,
}

/// Why one HTTP call to a replica failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// Nothing was sent (no connection): the call may be retried elsewhere.
    #[error("cannot connect to {addr}: {msg}")]
    Connect { addr: String, msg: String },
    #[error("no answer from {addr} within {timeout:?}")]
    Timeout { addr: String, timeout: Duration },
    #[error("{addr}: {msg}")]
    Other { addr: String, msg: String },
}

/// The header that carries the cluster secret between replicas.
pub const SECRET_HEADER: &str = "x-dsec-raft-secret";

/// A JSON-over-HTTP client shared by all targets (pooled connections per host).
#[derive(Clone)]
pub struct HttpClient {
    client: dsec_mtls::Client,
    secret: Option<Arc<str>>,
}

impl HttpClient {
    /// With `tls`, peers are reached over mutual TLS (`https`); without, plain HTTP.
    pub fn new(secret: Option<&str>, tls: Option<Arc<rustls::ClientConfig>>) -> HttpClient {
        HttpClient {
            client: dsec_mtls::Client::new(tls),
            secret: secret.map(Arc::from),
        }
    }
}

pub(crate) use dsec_common::id::same_secret;

impl HttpClient {
    /// POSTs `req` as JSON to `{http|https}://{addr}{path}` and parses the JSON answer.
    pub async fn post<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        addr: &str,
        path: &str,
        req: &Req,
        timeout: Duration,
    ) -> Result<Resp, CallError> {
        let other = |msg: String| CallError::Other {
            addr: addr.to_string(),
            msg,
        };
        let body = serde_json::to_vec(req).map_err(|e| other(e.to_string()))?;
        let url = format!("{}{path}", self.client.base(addr));
        let mut request =
            dsec_mtls::client::post_json(&url, body).map_err(|e| other(e.to_string()))?;
        if let Some(secret) = &self.secret
            && let Ok(v) = hyper::header::HeaderValue::from_str(secret)
        {
            request.headers_mut().insert(SECRET_HEADER, v);
        }
        let call = async {
            let resp = self.client.request(request).await.map_err(|e| {
                if e.is_connect() {
                    CallError::Connect {
                        addr: addr.to_string(),
                        msg: e.to_string(),
                    }
                } else {
                    other(e.to_string())
                }
            })?;
            let status = resp.status();
            let bytes = Limited::new(resp.into_body(), MAX_BODY)
                .collect()
                .await
                .map_err(|e| other(format!("reading the answer: {e}")))?
                .to_bytes();
            if !status.is_success() {
                return Err(other(format!(
                    "answered {status}: {}",
                    String::from_utf8_lossy(&bytes[..bytes.len().min(300)])
                )));
            }
            serde_json::from_slice(&bytes)
                .map_err(|e| other(format!("the answer does not parse: {e}")))
        };
        tokio::time::timeout(timeout, call)
            .await
            .map_err(|_| CallError::Timeout {
                addr: addr.to_string(),
                timeout,
            })?
    }
}

/// Makes a [`Connection`] per target replica.
#[derive(Clone)]
pub struct Network {
    pub(crate) http: HttpClient,
    /// The time a snapshot transfer may take.
    pub(crate) snapshot_timeout: Duration,
}

pub struct Connection {
    http: HttpClient,
    target: NodeId,
    addr: String,
    snapshot_timeout: Duration,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Connection;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> Connection {
        Connection {
            http: self.http.clone(),
            target,
            addr: node.addr.clone(),
            snapshot_timeout: self.snapshot_timeout,
        }
    }
}

fn rpc_err(target: NodeId, e: CallError) -> RPCError<TypeConfig> {
    match e {
        CallError::Connect { .. } => RPCError::Unreachable(Unreachable::from_string(e)),
        e => RPCError::Network(NetworkError::from_string(format!("replica {target}: {e}"))),
    }
}

impl Connection {
    async fn call<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        path: &str,
        req: &Req,
        option: &RPCOption,
    ) -> Result<Resp, RPCError<TypeConfig>> {
        let answer: Result<Resp, openraft::error::RaftError<TypeConfig>> = self
            .http
            .post(&self.addr, path, req, option.soft_ttl())
            .await
            .map_err(|e| rpc_err(self.target, e))?;
        // A remote fatal error (the replica's Raft stopped) looks like a network failure to
        // the caller: it retries and eventually gives up on that replica.
        answer.map_err(|e| {
            RPCError::Network(NetworkError::from_string(format!(
                "replica {}: {e}",
                self.target
            )))
        })
    }
}

impl RaftNetworkV2<TypeConfig> for Connection {
    type SnapshotData = super::types::SnapshotData;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call(PATH_APPEND, &rpc, &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call(PATH_VOTE, &rpc, &option).await
    }

    async fn pre_vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call(PATH_PRE_VOTE, &rpc, &option).await
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: Snapshot,
        cancel: impl Future<Output = ReplicationClosed> + openraft::OptionalSend + 'static,
        _option: RPCOption,
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError<TypeConfig>> {
        let data = String::from_utf8(snapshot.snapshot).map_err(|e| {
            StreamingError::Network(NetworkError::from_string(format!(
                "the IAM snapshot is not JSON text: {e}"
            )))
        })?;
        let req = SnapshotRequest {
            vote,
            meta: snapshot.meta,
            data,
        };
        let send = self
            .http
            .post::<_, Result<SnapshotResponse<TypeConfig>, SnapshotRefused>>(
                &self.addr,
                PATH_SNAPSHOT,
                &req,
                self.snapshot_timeout,
            );
        tokio::select! {
            closed = cancel => Err(StreamingError::Closed(closed)),
            res = send => match res {
                Ok(Ok(resp)) => Ok(resp),
                Ok(Err(remote)) => Err(StreamingError::Network(NetworkError::from_string(format!(
                    "replica {} could not install the snapshot: {remote}",
                    self.target
                )))),
                Err(e @ CallError::Connect { .. }) => {
                    Err(StreamingError::Unreachable(Unreachable::from_string(e)))
                }
                Err(e) => Err(StreamingError::Network(NetworkError::from_string(format!(
                    "replica {}: {e}",
                    self.target
                )))),
            },
        }
    }
}
