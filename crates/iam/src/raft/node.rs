//! [`RaftIam`]: one replica of the replicated IAM store. It opens its two redb files (the
//! Raft log and the state), runs openraft, serves the replica-to-replica routes on an axum
//! [`Router`], and implements [`Iam`]: reads come from the replica's applied state, writes
//! go through the leader (a follower forwards them), so any replica accepts writes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{DefaultBodyLimit, State};
use axum::routing::post;
use axum::{Json, Router};
use openraft::async_runtime::WatchReceiver;
use openraft::error::{ClientWriteError, RaftError};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse,
};
use openraft::{BasicNode, Raft, RaftMetrics, ServerState, SnapshotPolicy};
use serde::{Deserialize, Serialize};
use tokio::runtime::{Handle, RuntimeFlavor};

use super::log_store::LogStore;
use super::network::{
    CallError, HttpClient, MAX_BODY, Network, PATH_APPEND, PATH_PRE_VOTE, PATH_SNAPSHOT, PATH_VOTE,
    PATH_WRITE, SECRET_HEADER, SnapshotRequest, same_secret,
};
use super::state_machine::StateMachineStore;
use super::types::{IamRequest, IamResponse, NodeId, Snapshot, TypeConfig};
use crate::state::{Command, KeyRecord, Refusal};
use crate::{Iam, IamError, Principal, ProjectView, authenticate_in, keys_in, projects_in};

/// How a replica runs. [`RaftConfig::new`] gives defaults for a LAN cluster.
#[derive(Debug, Clone)]
pub struct RaftConfig {
    /// This replica's id, unique in the cluster and never reused for another machine.
    pub id: NodeId,
    /// `host:port` where the other replicas reach this replica's [`RaftIam::router`].
    pub addr: String,
    /// Holds `raft-log.redb` and `iam.redb`.
    pub dir: PathBuf,
    pub heartbeat: Duration,
    /// A follower that hears no leader for a random time in this range starts an election.
    pub election_timeout: (Duration, Duration),
    /// A snapshot is built after this many log entries since the last one.
    pub snapshot_every: u64,
    /// Entries kept in the log after a snapshot (for replicas that lag a little).
    pub logs_kept_after_snapshot: u64,
    /// The most a write may take, forwarding and retries included.
    pub write_timeout: Duration,
    /// The most a snapshot transfer to one replica may take.
    pub snapshot_timeout: Duration,
    /// Shared by all replicas; when set, the `/raft/...` routes refuse requests without it.
    /// Without it, anyone who reaches the routes can write to the IAM store (make an admin
    /// key), so either set it or serve the routes only on a private network.
    pub secret: Option<String>,
    /// Reach the other replicas over mutual TLS with this client config (a cluster); without
    /// it, plain HTTP (a single replica, or tests on loopback).
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

impl RaftConfig {
    pub fn new(id: NodeId, addr: impl Into<String>, dir: impl Into<PathBuf>) -> RaftConfig {
        RaftConfig {
            id,
            addr: addr.into(),
            dir: dir.into(),
            heartbeat: Duration::from_millis(100),
            election_timeout: (Duration::from_millis(500), Duration::from_millis(1000)),
            snapshot_every: 1000,
            logs_kept_after_snapshot: 100,
            write_timeout: Duration::from_secs(10),
            snapshot_timeout: Duration::from_secs(60),
            secret: None,
            tls: None,
        }
    }
}

pub type IamRaft = Raft<TypeConfig, StateMachineStore>;

struct Inner {
    cfg: RaftConfig,
    raft: IamRaft,
    sm: StateMachineStore,
    log: LogStore,
    http: HttpClient,
    runtime: Handle,
}

/// One replica. Cheap to clone (a handle).
#[derive(Clone)]
pub struct RaftIam {
    inner: Arc<Inner>,
}

/// What `/raft/write` answers.
#[derive(Debug, Serialize, Deserialize)]
enum WriteReply {
    /// Committed and applied on the leader, at log `index`.
    Applied { response: IamResponse, index: u64 },
    /// This replica is not the leader; `leader` is the one it knows of, if any.
    NotLeader { leader: Option<(NodeId, String)> },
    /// Failed in a way a retry might duplicate (or a fatal error): not retried.
    Failed(String),
}

fn leader_of(
    e: &RaftError<TypeConfig, ClientWriteError<TypeConfig>>,
) -> Option<Option<(NodeId, String)>> {
    // Only ForwardToLeader means "not appended": LogEntryDiscarded may still commit.
    match e.api_error() {
        Some(ClientWriteError::ForwardToLeader(f)) => Some(
            f.leader_id
                .zip(f.leader_node.as_ref().map(|n| n.addr.clone())),
        ),
        _ => None,
    }
}

fn membership_err(e: RaftError<TypeConfig, ClientWriteError<TypeConfig>>) -> IamError {
    match leader_of(&e) {
        Some(leader) => crate::not_leader(leader.map(|l| l.1)),
        None => crate::unavailable(e.to_string()),
    }
}

impl RaftIam {
    /// Opens (or creates) this replica's files and starts its Raft. A new cluster then
    /// needs [`RaftIam::initialize`] on one replica; a restarted replica rejoins by itself.
    /// The replica answers its peers only once [`RaftIam::router`] is served at `cfg.addr`.
    pub async fn open(cfg: RaftConfig) -> Result<RaftIam, IamError> {
        let log = LogStore::open(&cfg.dir.join("raft-log.redb"))?;
        let sm = StateMachineStore::open(&cfg.dir.join("iam.redb"))?;
        let config = openraft::Config {
            cluster_name: "dsec-iam".into(),
            heartbeat_interval: cfg.heartbeat.as_millis() as u64,
            election_timeout_min: cfg.election_timeout.0.as_millis() as u64,
            election_timeout_max: cfg.election_timeout.1.as_millis() as u64,
            snapshot_policy: SnapshotPolicy::LogsSinceLast(cfg.snapshot_every),
            max_in_snapshot_log_to_keep: cfg.logs_kept_after_snapshot,
            install_snapshot_timeout: cfg.snapshot_timeout.as_millis() as u64,
            ..Default::default()
        }
        .validate()
        .map_err(|e| IamError::Storage(format!("the Raft settings do not hold together: {e}")))?;
        let network = Network {
            http: HttpClient::new(cfg.secret.as_deref(), cfg.tls.clone()),
            snapshot_timeout: cfg.snapshot_timeout,
        };
        let raft = Raft::new(
            cfg.id,
            Arc::new(config),
            network.clone(),
            log.clone(),
            sm.clone(),
        )
        .await
        .map_err(|e| IamError::Storage(format!("starting the IAM replica {}: {e}", cfg.id)))?;
        tracing::info!(id = cfg.id, addr = %cfg.addr, dir = %cfg.dir.display(), "IAM replica started");
        let inner = Arc::new(Inner {
            cfg,
            raft,
            sm,
            log,
            http: network.http,
            runtime: Handle::current(),
        });
        // What Prometheus sees of this replica, read from openraft's own metrics.
        let weak = Arc::downgrade(&inner);
        dsec_metrics::on_scrape(move || {
            let Some(inner) = weak.upgrade() else { return };
            let m = inner.raft.metrics().borrow_watched().clone();
            dsec_metrics::iam::set_raft(
                m.current_term,
                m.state == ServerState::Leader,
                m.local_committed.map(|l| l.index).unwrap_or(0),
                m.last_applied.map(|l| l.index).unwrap_or(0),
            );
        });
        Ok(RaftIam { inner })
    }

    pub fn id(&self) -> NodeId {
        self.inner.cfg.id
    }

    pub fn addr(&self) -> &str {
        &self.inner.cfg.addr
    }

    /// The openraft handle, for metrics and waits.
    pub fn raft(&self) -> &IamRaft {
        &self.inner.raft
    }

    pub fn metrics(&self) -> RaftMetrics<TypeConfig> {
        self.inner.raft.metrics().borrow_watched().clone()
    }

    /// The leader this replica knows of.
    pub fn leader(&self) -> Option<NodeId> {
        self.inner.raft.metrics().borrow_watched().current_leader
    }

    pub fn is_leader(&self) -> bool {
        self.metrics().state == ServerState::Leader
    }

    /// The first index still in this replica's log (`None`: empty), to see purging.
    pub fn first_log_index(&self) -> Result<Option<u64>, IamError> {
        self.inner.log.first_index().map_err(crate::store::db_err)
    }

    /// Waits until this replica knows a leader.
    pub async fn wait_for_leader(&self, timeout: Duration) -> Result<NodeId, IamError> {
        let m = self
            .inner
            .raft
            .wait(Some(timeout))
            .metrics(|m| m.current_leader.is_some(), "a leader is known")
            .await
            .map_err(|e| crate::unavailable(format!("no IAM leader elected: {e}")))?;
        m.current_leader
            .ok_or_else(|| crate::unavailable("no IAM leader elected"))
    }

    /// The replica-to-replica routes (`/raft/...`), to serve at [`RaftConfig::addr`] (alone
    /// or merged into another router; they carry their own body limit).
    pub fn router(&self) -> Router {
        Router::new()
            .route(PATH_APPEND, post(append))
            .route(PATH_VOTE, post(vote))
            .route(PATH_PRE_VOTE, post(pre_vote))
            .route(PATH_SNAPSHOT, post(snapshot))
            .route(PATH_WRITE, post(forwarded_write))
            .layer(axum::middleware::from_fn_with_state(
                self.clone(),
                check_secret,
            ))
            .layer(DefaultBodyLimit::max(MAX_BODY))
            .with_state(self.clone())
    }

    /// Makes a new cluster of `members` (`(id, addr)`, this replica among them): 1, 3 or 5
    /// voters. Call it once, on one replica, with every member's routes served.
    pub async fn initialize(&self, members: &[(NodeId, String)]) -> Result<(), IamError> {
        if ![1, 3, 5].contains(&members.len()) {
            return Err(IamError::Refused(Refusal::Invalid(format!(
                "a new IAM cluster has 1, 3 or 5 members, not {}",
                members.len()
            ))));
        }
        let nodes: BTreeMap<NodeId, BasicNode> = members
            .iter()
            .map(|(id, addr)| (*id, BasicNode::new(addr)))
            .collect();
        if nodes.len() != members.len() || !nodes.contains_key(&self.id()) {
            return Err(IamError::Refused(Refusal::Invalid(
                "the members of a new IAM cluster need distinct ids, this replica's among them"
                    .into(),
            )));
        }
        self.inner
            .raft
            .initialize(nodes)
            .await
            .map_err(|e| crate::unavailable(format!("initializing the IAM cluster: {e}")))
    }

    /// Adds a replica that receives the log (or a snapshot) but does not vote; returns once
    /// it has caught up. Call it on the leader.
    pub async fn add_learner(&self, id: NodeId, addr: &str) -> Result<(), IamError> {
        self.inner
            .raft
            .add_learner(id, BasicNode::new(addr), true)
            .await
            .map(|_| ())
            .map_err(membership_err)
    }

    /// Makes `voters` the voting members (learners among them are promoted; voters left out
    /// are removed). Call it on the leader.
    pub async fn change_membership(&self, voters: &[NodeId]) -> Result<(), IamError> {
        let voters: BTreeSet<NodeId> = voters.iter().copied().collect();
        self.inner
            .raft
            .change_membership(voters, false)
            .await
            .map(|_| ())
            .map_err(membership_err)
    }

    /// Stops this replica's Raft (its routes answer errors from then on).
    pub async fn shutdown(&self) -> Result<(), IamError> {
        self.inner
            .raft
            .shutdown()
            .await
            .map_err(|e| crate::unavailable(format!("stopping the IAM replica: {e}")))
    }

    async fn local_write(&self, cmd: Command) -> WriteReply {
        let started = std::time::Instant::now();
        match self.inner.raft.client_write(IamRequest(cmd)).await {
            Ok(r) => WriteReply::Applied {
                response: {
                    dsec_metrics::iam::APPLY_SECONDS.observe(started.elapsed().as_secs_f64());
                    r.data
                },
                index: r.log_id.index,
            },
            Err(e) => match leader_of(&e) {
                Some(leader) => WriteReply::NotLeader { leader },
                None => WriteReply::Failed(e.to_string()),
            },
        }
    }

    /// Applies `cmd` through the leader and waits until this replica has applied it too, so
    /// a read here right after sees it.
    pub async fn write(&self, cmd: Command) -> Result<(), IamError> {
        let start = Instant::now();
        let deadline = start + self.inner.cfg.write_timeout;
        let mut target: Option<(NodeId, String)> = None;
        let mut last_leader = None;
        loop {
            let reply = match &target {
                Some((id, addr)) if *id != self.id() => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match self
                        .inner
                        .http
                        .post::<_, WriteReply>(addr, PATH_WRITE, &cmd, left)
                        .await
                    {
                        Ok(r) => r,
                        // Nothing was sent: ask again who leads.
                        Err(CallError::Connect { .. }) => WriteReply::NotLeader { leader: None },
                        Err(e) => {
                            return Err(crate::unavailable(format!(
                                "forwarding the write to the leader: {e}; it may or may not have been applied"
                            )));
                        }
                    }
                }
                _ => self.local_write(cmd.clone()).await,
            };
            match reply {
                WriteReply::Applied { response, index } => {
                    self.wait_applied(index, deadline).await;
                    tracing::debug!(
                        took_ms = start.elapsed().as_millis() as u64,
                        "IAM write applied"
                    );
                    return match response.refusal {
                        Some(r) => Err(IamError::Refused(r)),
                        None => Ok(()),
                    };
                }
                WriteReply::Failed(msg) => return Err(crate::unavailable(msg)),
                WriteReply::NotLeader { leader } => {
                    if leader.is_some() {
                        last_leader = leader.clone();
                    }
                    if Instant::now() >= deadline {
                        return Err(crate::not_leader(last_leader.map(|l| l.1)));
                    }
                    let same = leader.is_some() && leader == target;
                    if leader.is_none() || same {
                        // No leader yet (an election is on), or the hint did not move: wait.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    target = leader.or_else(|| {
                        let m = self.metrics();
                        let id = m.current_leader?;
                        let node = m.membership_config.membership().get_node(&id)?;
                        Some((id, node.addr.clone()))
                    });
                }
            }
        }
    }

    async fn wait_applied(&self, index: u64, deadline: Instant) {
        let left = deadline.saturating_duration_since(Instant::now());
        if let Err(e) = self
            .inner
            .raft
            .wait(Some(left))
            .applied_index_at_least(Some(index), "the write is applied here")
            .await
        {
            // Committed anyway; only this replica's view lags.
            tracing::warn!(index, error = %e, "an IAM write is committed but not yet applied on this replica");
        }
    }

    fn read<R>(&self, f: impl FnOnce(&crate::state::IamState) -> R) -> R {
        f(&self.inner.sm.read().state)
    }
}

impl Iam for RaftIam {
    fn authenticate(&self, key: &str) -> Option<Principal> {
        self.read(|s| authenticate_in(s, key))
    }

    /// Blocks until the write is applied; from async code prefer [`RaftIam::write`]. Inside
    /// a multi-threaded tokio runtime it blocks the worker with `block_in_place`; a
    /// current-thread runtime cannot block for its own Raft, so it gets an error.
    fn apply(&self, cmd: Command) -> Result<(), IamError> {
        let inside = Handle::try_current().ok().map(|h| h.runtime_flavor());
        if inside == Some(RuntimeFlavor::CurrentThread) {
            return Err(crate::unavailable(
                "RaftIam::apply blocks, and cannot inside a current-thread tokio runtime; use RaftIam::write",
            ));
        }
        let this = self.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        self.inner.runtime.spawn(async move {
            let _ = tx.send(this.write(cmd).await);
        });
        let wait = move || {
            rx.recv().unwrap_or_else(|_| {
                Err(crate::unavailable(
                    "the IAM write task ended without an answer",
                ))
            })
        };
        if inside.is_some() {
            tokio::task::block_in_place(wait)
        } else {
            wait()
        }
    }

    /// Runs [`RaftIam::write`] on the Raft's own runtime and awaits it from any runtime.
    fn apply_async(self: Arc<Self>, cmd: Command) -> crate::Applying {
        let this = (*self).clone();
        let task = self
            .inner
            .runtime
            .spawn(async move { this.write(cmd).await });
        Box::pin(async move {
            task.await.unwrap_or_else(|e| {
                Err(crate::unavailable(format!(
                    "the IAM write task ended without an answer: {e}"
                )))
            })
        })
    }

    fn projects(&self, actor: &str) -> Result<Vec<ProjectView>, IamError> {
        Ok(self.read(|s| projects_in(s, actor)))
    }

    fn keys(&self, actor: &str) -> Result<Vec<KeyRecord>, IamError> {
        Ok(self.read(|s| keys_in(s, actor)))
    }
}

/// Refuses requests without the cluster secret, when one is set.
async fn check_secret(
    State(node): State<RaftIam>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    if let Some(secret) = &node.inner.cfg.secret {
        let given = req
            .headers()
            .get(SECRET_HEADER)
            .map(|v| v.as_bytes())
            .unwrap_or_default();
        if !same_secret(given, secret.as_bytes()) {
            tracing::warn!("a Raft request without the cluster secret was refused");
            return axum::response::IntoResponse::into_response((
                axum::http::StatusCode::FORBIDDEN,
                "this route is for the replicas of the IAM cluster",
            ));
        }
    }
    next.run(req).await
}

type RaftResult<T> = Result<T, RaftError<TypeConfig>>;

async fn append(
    State(node): State<RaftIam>,
    Json(req): Json<AppendEntriesRequest<TypeConfig>>,
) -> Json<RaftResult<AppendEntriesResponse<TypeConfig>>> {
    Json(node.inner.raft.append_entries(req).await)
}

async fn vote(
    State(node): State<RaftIam>,
    Json(req): Json<VoteRequest<TypeConfig>>,
) -> Json<RaftResult<VoteResponse<TypeConfig>>> {
    Json(node.inner.raft.vote(req).await)
}

async fn pre_vote(
    State(node): State<RaftIam>,
    Json(req): Json<VoteRequest<TypeConfig>>,
) -> Json<RaftResult<VoteResponse<TypeConfig>>> {
    Json(node.inner.raft.pre_vote(req).await)
}

async fn snapshot(
    State(node): State<RaftIam>,
    Json(req): Json<SnapshotRequest>,
) -> Json<Result<SnapshotResponse<TypeConfig>, super::network::SnapshotRefused>> {
    let snap = Snapshot {
        meta: req.meta,
        snapshot: req.data.into_bytes(),
    };
    Json(
        node.inner
            .raft
            .install_full_snapshot(req.vote, snap)
            .await
            .map_err(|e| super::network::SnapshotRefused(e.to_string())),
    )
}

/// A write forwarded by another replica; answered from here only (no second hop).
async fn forwarded_write(
    State(node): State<RaftIam>,
    Json(cmd): Json<Command>,
) -> Json<WriteReply> {
    Json(node.local_write(cmd).await)
}
