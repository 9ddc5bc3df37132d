//! IAM routes (projects, quotas, keys) and the quota gate the edge asks before a sandbox
//! starts. A key acts on its own project and the projects inside it.

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use dsec_common::{ApiError, ErrorCode};
use dsec_edge::registry::SandboxRecord;
use dsec_edge::{Pending, Quotas};
use dsec_iam::{
    Command, Iam, IamError, Principal, PrincipalKind, Quota, Refusal, Reservation, Usage,
};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::{ApiResult, body, json as json_response};

/// The routes, with their own state (the IAM); `with_state` makes them mergeable into any
/// router whose auth layer inserts the [`Principal`].
pub fn routes() -> Router<Arc<dyn Iam>> {
    Router::new()
        .route("/v1/whoami", get(whoami))
        .route("/v1/projects", get(projects).post(create_project))
        .route("/v1/projects/quota", post(set_quota))
        .route("/v1/keys", get(keys).post(create_key))
        .route("/v1/keys/{key_id}", delete(revoke_key))
}

pub fn api_error(e: IamError) -> ApiError {
    match e {
        IamError::Refused(r) => {
            let code = match r {
                Refusal::Invalid(_) => ErrorCode::InvalidArgument,
                Refusal::NotFound(_) => ErrorCode::NotFound,
                Refusal::Forbidden(_) => ErrorCode::PermissionDenied,
                Refusal::Exists(_) => ErrorCode::AlreadyExists,
                Refusal::Quota(_) => ErrorCode::ResourceExhausted,
            };
            ApiError::new(code, r.to_string())
        }
        IamError::Storage(m) => ApiError::unavailable(format!("IAM is unavailable: {m}")),
    }
}

/// The edge's quota gate, backed by IAM.
pub struct IamQuotas(pub Arc<dyn Iam>);

impl Quotas for IamQuotas {
    fn reserve(&self, rec: &SandboxRecord) -> Pending<Result<(), ApiError>> {
        let applying = self.0.clone().apply_async(Command::Reserve(Reservation {
            sandbox_id: rec.id.clone(),
            project: rec.project.clone(),
            edge: rec.edge.clone(),
            usage: Usage {
                sandboxes: 1,
                cpu_cores: rec.limits.cpu_cores,
                memory_mb: rec.limits.memory_mb,
                disk_mb: rec.limits.disk_mb,
            },
        }));
        Box::pin(async move { applying.await.map_err(api_error) })
    }

    fn hold_disk(&self, id: &str, project: &str, edge: &str, bytes: u64) -> Result<(), ApiError> {
        self.0
            .apply(Command::Hold(Reservation {
                sandbox_id: id.to_string(),
                project: project.to_string(),
                edge: edge.to_string(),
                usage: Usage {
                    disk_mb: bytes.div_ceil(1 << 20),
                    ..Usage::default()
                },
            }))
            .map_err(api_error)
    }

    fn release(&self, sandbox_id: &str) -> Pending<()> {
        let id = sandbox_id.to_string();
        let applying = self.0.clone().apply_async(Command::Release {
            sandbox_id: id.clone(),
        });
        Box::pin(async move {
            if let Err(e) = applying.await {
                tracing::warn!(sandbox = %id, "releasing its quota: {e}");
            }
        })
    }

    fn reconcile(&self, edge: &str, live: Vec<String>) {
        if let Err(e) = self.0.apply(Command::Reconcile {
            edge: edge.to_string(),
            live,
        }) {
            tracing::warn!("reconciling quota usage: {e}");
        }
    }
}

async fn whoami(Extension(p): Extension<Principal>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({"principal": p.name, "kind": p.kind, "key_id": p.key_id, "project": p.project}),
    )
}

async fn projects(
    State(iam): State<Arc<dyn Iam>>,
    Extension(p): Extension<Principal>,
) -> ApiResult<Response> {
    let projects = iam.projects(&p.project).map_err(api_error)?;
    Ok(json_response(
        StatusCode::OK,
        &json!({ "projects": projects }),
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProjectBody {
    project: String,
    #[serde(default)]
    quota: Quota,
}

fn view(iam: &dyn Iam, p: &Principal, path: &str) -> ApiResult<Response> {
    let v = iam
        .projects(&p.project)
        .map_err(api_error)?
        .into_iter()
        .find(|v| v.project.path == path)
        .ok_or_else(|| ApiError::internal("the project vanished"))?;
    Ok(json_response(StatusCode::OK, &v))
}

async fn create_project(
    State(iam): State<Arc<dyn Iam>>,
    Extension(p): Extension<Principal>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let b: ProjectBody = body(&bytes, "create project")?;
    iam.apply(Command::CreateProject {
        actor: p.project.clone(),
        path: b.project.clone(),
        quota: b.quota,
        now_ms: dsec_iam::now_ms(),
    })
    .map_err(api_error)?;
    let mut r = view(iam.as_ref(), &p, &b.project)?;
    *r.status_mut() = StatusCode::CREATED;
    Ok(r)
}

async fn set_quota(
    State(iam): State<Arc<dyn Iam>>,
    Extension(p): Extension<Principal>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let b: ProjectBody = body(&bytes, "set quota")?;
    iam.apply(Command::SetQuota {
        actor: p.project.clone(),
        path: b.project.clone(),
        quota: b.quota,
    })
    .map_err(api_error)?;
    view(iam.as_ref(), &p, &b.project)
}

#[derive(Serialize)]
struct KeyView {
    key_id: String,
    principal: String,
    kind: PrincipalKind,
    project: String,
    created_ms: u64,
    revoked: bool,
}

async fn keys(
    State(iam): State<Arc<dyn Iam>>,
    Extension(p): Extension<Principal>,
) -> ApiResult<Response> {
    let keys: Vec<KeyView> = iam
        .keys(&p.project)
        .map_err(api_error)?
        .into_iter()
        .map(|k| KeyView {
            key_id: k.key_id,
            principal: k.principal,
            kind: k.kind,
            project: k.project,
            created_ms: k.created_ms,
            revoked: k.revoked,
        })
        .collect();
    Ok(json_response(StatusCode::OK, &json!({ "keys": keys })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyBody {
    #[serde(default)]
    project: Option<String>,
    principal: String,
    #[serde(default = "human")]
    kind: PrincipalKind,
    /// `dsec` (`dsk.…`, the default) or `e2b` (`e2b_` and 40 hex digits, for programs
    /// written for E2B that check a key's shape).
    #[serde(default)]
    format: dsec_iam::KeyFormat,
}

fn human() -> PrincipalKind {
    PrincipalKind::Human
}

async fn create_key(
    State(iam): State<Arc<dyn Iam>>,
    Extension(p): Extension<Principal>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let b: KeyBody = body(&bytes, "create key")?;
    let project = b.project.unwrap_or_else(|| p.project.clone());
    let (key, key_id) = dsec_iam::create_key_as(
        iam.as_ref(),
        &p.project,
        &project,
        &b.principal,
        b.kind,
        b.format,
    )
    .map_err(api_error)?;
    Ok(json_response(
        StatusCode::CREATED,
        &json!({"key": key, "key_id": key_id, "project": project, "principal": b.principal, "kind": b.kind}),
    ))
}

async fn revoke_key(
    State(iam): State<Arc<dyn Iam>>,
    Extension(p): Extension<Principal>,
    Path(key_id): Path<String>,
) -> ApiResult<Response> {
    iam.apply(Command::RevokeKey {
        actor: p.project.clone(),
        key_id,
    })
    .map_err(api_error)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
