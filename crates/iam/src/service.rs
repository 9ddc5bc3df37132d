//! The IAM service other components call (apiservers authenticate keys and manage
//! projects; edges reserve and release quota): `dsec.v1.Iam` over gRPC
//! (`proto/dsec/v1/iam.proto`) on the replica's mutual-TLS listener, next to the Raft
//! routes. Any replica answers; writes go through the leader. `/iam/leader` (HTTP) says
//! which replica leads, for operators and tests.

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use dsec_rpc::pb;
use dsec_rpc::pb::iam_server::{Iam as IamRpc, IamServer};
use serde::{Deserialize, Serialize};
use tonic::{Request, Response, Status};

use crate::raft::RaftIam;
use crate::rpc::refusal_to_api;
use crate::state::{Command, Refusal};
use crate::{Iam, IamError};

pub const PATH_LEADER: &str = "/iam/leader";

#[derive(Serialize, Deserialize)]
pub struct LeaderReply {
    pub id: u64,
    pub leader_id: Option<u64>,
    pub leader: Option<String>,
}

/// The `dsec.v1.Iam` service and `/iam/leader`.
pub fn router(node: RaftIam) -> Router {
    Router::new()
        .route(PATH_LEADER, get(leader))
        .with_state(node.clone())
        .merge(dsec_rpc::routes(IamServer::new(Service { node })))
}

pub struct Service {
    node: RaftIam,
}

fn outage(e: IamError) -> Status {
    match e {
        IamError::Refused(r) => dsec_rpc::to_status(&refusal_to_api(&r)),
        IamError::Storage(m) => Status::unavailable(m),
    }
}

fn malformed(e: dsec_rpc::Malformed) -> Status {
    Status::invalid_argument(e.to_string())
}

#[tonic::async_trait]
impl IamRpc for Service {
    async fn authenticate(
        &self,
        req: Request<pb::AuthenticateRequest>,
    ) -> Result<Response<pb::AuthenticateReply>, Status> {
        let p = self.node.authenticate(&req.into_inner().key);
        Ok(Response::new(pb::AuthenticateReply {
            principal: p.map(Into::into),
        }))
    }

    async fn apply(&self, req: Request<pb::Command>) -> Result<Response<pb::Applied>, Status> {
        let peer = req.extensions().get::<dsec_mtls::Identity>().cloned();
        let cmd = Command::try_from(req.into_inner()).map_err(malformed)?;
        if let Some(p) = &peer
            && p.role == dsec_mtls::Role::Edge
            && !edge_may_apply(&p.name, &cmd)
        {
            return Err(outage(IamError::Refused(Refusal::Forbidden(format!(
                "edge {} may only reserve and release its own sandboxes",
                p.name
            )))));
        }
        self.node.write(cmd).await.map_err(outage)?;
        Ok(Response::new(pb::Applied {}))
    }

    async fn projects(
        &self,
        req: Request<pb::ActorRequest>,
    ) -> Result<Response<pb::ProjectList>, Status> {
        listing_allowed(&req)?;
        let v = self
            .node
            .projects(&req.into_inner().actor)
            .map_err(|e| Status::unavailable(e.to_string()))?;
        Ok(Response::new(pb::ProjectList {
            projects: v.into_iter().map(Into::into).collect(),
        }))
    }

    async fn keys(&self, req: Request<pb::ActorRequest>) -> Result<Response<pb::KeyList>, Status> {
        listing_allowed(&req)?;
        let v = self
            .node
            .keys(&req.into_inner().actor)
            .map_err(|e| Status::unavailable(e.to_string()))?;
        Ok(Response::new(pb::KeyList {
            keys: v.into_iter().map(Into::into).collect(),
        }))
    }
}

/// Projects and keys (with their principals and key hashes) are listed for apiservers and
/// replicas only: an edge serves no such listing, so an escaped node learns nothing from
/// asking.
fn listing_allowed<T>(req: &Request<T>) -> Result<(), Status> {
    match req.extensions().get::<dsec_mtls::Identity>() {
        Some(p) if matches!(p.role, dsec_mtls::Role::Apiserver | dsec_mtls::Role::Iam) => Ok(()),
        Some(p) => Err(Status::permission_denied(format!(
            "a {} certificate may not list projects or keys",
            p.role
        ))),
        None => Err(Status::unauthenticated(
            "no cluster certificate on this connection",
        )),
    }
}

/// What an edge's certificate may write: its own sandboxes' (and snapshots' and commits')
/// reservations, nothing else
/// (projects, quotas and keys are the apiservers' to change), so one escaped node cannot
/// make itself an administrator.
pub fn edge_may_apply(edge: &str, cmd: &Command) -> bool {
    let own = |sandbox_id: &str| {
        sandbox_id
            .strip_prefix(edge)
            .is_some_and(|rest| rest.starts_with('-'))
    };
    match cmd {
        Command::Reserve(r) | Command::Hold(r) => r.edge == edge && own(&r.sandbox_id),
        Command::Release { sandbox_id } => own(sandbox_id),
        Command::Reconcile { edge: e, .. } => e == edge,
        _ => false,
    }
}

async fn leader(State(n): State<RaftIam>) -> Json<LeaderReply> {
    let m = n.metrics();
    let leader_id = m.current_leader;
    let leader = leader_id.and_then(|id| {
        m.membership_config
            .membership()
            .get_node(&id)
            .map(|node| node.addr.clone())
    });
    Json(LeaderReply {
        id: n.id(),
        leader_id,
        leader,
    })
}

#[cfg(test)]
mod edge_rights {
    use super::*;
    use crate::{Reservation, Usage};

    #[test]
    fn an_edge_writes_only_its_own_reservations() {
        let r = |edge: &str, id: &str| {
            Command::Reserve(Reservation {
                sandbox_id: id.into(),
                project: "root/t1".into(),
                edge: edge.into(),
                usage: Usage::default(),
            })
        };
        assert!(edge_may_apply("e1", &r("e1", "e1-abc")));
        assert!(!edge_may_apply("e1", &r("e2", "e2-abc")));
        assert!(
            !edge_may_apply("e1", &r("e1", "e10-abc")),
            "a prefix is not its name"
        );
        let release = |id: &str| Command::Release {
            sandbox_id: id.into(),
        };
        assert!(edge_may_apply("e1", &release("e1-abc")));
        assert!(!edge_may_apply("e1", &release("e2-abc")));
        let reconcile = |e: &str| Command::Reconcile {
            edge: e.into(),
            live: vec![],
        };
        assert!(edge_may_apply("e1", &reconcile("e1")));
        assert!(!edge_may_apply("e1", &reconcile("e2")));
        for cmd in [
            Command::CreateProject {
                actor: "root".into(),
                path: "root/x".into(),
                quota: Default::default(),
                now_ms: 0,
            },
            Command::SetQuota {
                actor: "root".into(),
                path: "root/t1".into(),
                quota: Default::default(),
            },
            Command::RevokeKey {
                actor: "root".into(),
                key_id: "k".into(),
            },
        ] {
            assert!(!edge_may_apply("e1", &cmd), "{cmd:?}");
        }
    }
}
