//! The IAM service other components call (apiservers authenticate keys and manage
//! projects; edges reserve and release quota): JSON over HTTP on the replica's mutual-TLS
//! listener, next to the Raft routes. Any replica answers; writes go through the leader.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

use crate::raft::RaftIam;
use crate::state::{Command, KeyRecord, Refusal};
use crate::{Iam, IamError, Principal, ProjectView};

pub const PATH_AUTHENTICATE: &str = "/iam/authenticate";
pub const PATH_APPLY: &str = "/iam/apply";
pub const PATH_PROJECTS: &str = "/iam/projects";
pub const PATH_KEYS: &str = "/iam/keys";
pub const PATH_LEADER: &str = "/iam/leader";

#[derive(Serialize, Deserialize)]
pub struct AuthenticateRequest {
    pub key: String,
}

#[derive(Serialize, Deserialize)]
pub struct AuthenticateReply {
    pub principal: Option<Principal>,
}

#[derive(Serialize, Deserialize)]
pub struct ActorRequest {
    pub actor: String,
}

/// What a failed apply answers: a refusal (the command was applied and said no) or an
/// outage (`unavailable`, retry).
#[derive(Debug, Serialize, Deserialize)]
pub enum ApplyFailure {
    Refused(Refusal),
    Unavailable(String),
}

#[derive(Serialize, Deserialize)]
pub struct LeaderReply {
    pub id: u64,
    pub leader_id: Option<u64>,
    pub leader: Option<String>,
}

pub fn router(node: RaftIam) -> Router {
    Router::new()
        .route(PATH_AUTHENTICATE, post(authenticate))
        .route(PATH_APPLY, post(apply))
        .route(PATH_PROJECTS, post(projects))
        .route(PATH_KEYS, post(keys))
        .route(PATH_LEADER, get(leader))
        .with_state(node)
}

async fn authenticate(
    State(n): State<RaftIam>,
    Json(r): Json<AuthenticateRequest>,
) -> Json<AuthenticateReply> {
    Json(AuthenticateReply {
        principal: n.authenticate(&r.key),
    })
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

async fn apply(
    State(n): State<RaftIam>,
    peer: Option<axum::Extension<dsec_mtls::Identity>>,
    Json(cmd): Json<Command>,
) -> Response {
    if let Some(axum::Extension(p)) = &peer
        && p.role == dsec_mtls::Role::Edge
        && !edge_may_apply(&p.name, &cmd)
    {
        return (
            StatusCode::FORBIDDEN,
            Json(ApplyFailure::Refused(crate::Refusal::Forbidden(format!(
                "edge {} may only reserve and release its own sandboxes",
                p.name
            )))),
        )
            .into_response();
    }
    match n.write(cmd).await {
        Ok(()) => Json(serde_json::json!({})).into_response(),
        Err(IamError::Refused(r)) => {
            (StatusCode::CONFLICT, Json(ApplyFailure::Refused(r))).into_response()
        }
        Err(IamError::Storage(m)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(ApplyFailure::Unavailable(m)),
        )
            .into_response(),
    }
}

fn listing<T: Serialize>(r: Result<T, IamError>) -> Response {
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(ApplyFailure::Unavailable(e.to_string())),
        )
            .into_response(),
    }
}

async fn projects(State(n): State<RaftIam>, Json(r): Json<ActorRequest>) -> Response {
    listing::<Vec<ProjectView>>(n.projects(&r.actor))
}

async fn keys(State(n): State<RaftIam>, Json(r): Json<ActorRequest>) -> Response {
    listing::<Vec<KeyRecord>>(n.keys(&r.actor))
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
