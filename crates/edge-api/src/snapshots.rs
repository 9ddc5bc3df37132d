//! Snapshot routes on an edge's router: take one of a sandbox, list, show, delete, and
//! restore (here, or on another edge with `edge`). A snapshot belongs to the project of
//! the sandbox it was taken of; other projects do not see it.

use crate::openapi::SandboxPath;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use dsec_common::ApiError;
use dsec_common::api::ForkResponse;
use dsec_common::api::{ForkRequest, ListSnapshotsResponse, SnapshotInfo};
use dsec_common::error::ErrorReply;
use dsec_common::http::{ApiResult, body, json};
use dsec_iam::Principal;

use crate::{AppState, route};

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/sandboxes/{id}/snapshot", post(create))
        .route("/v1/snapshots", get(list))
        .route("/v1/snapshots/{sid}", get(show).delete(delete))
        .route("/v1/snapshots/{sid}/restore", post(restore))
}

/// What these routes serve, for the generated API description.
#[derive(utoipa::OpenApi)]
#[openapi(paths(create, list, show, delete, restore))]
pub(crate) struct Doc;

/// The snapshot, if the caller's project may see it (404 otherwise, so ids don't leak).
fn visible(st: &AppState, p: &Principal, sid: &str) -> ApiResult<SnapshotInfo> {
    let info = st.edge.get_snapshot(sid)?;
    if !dsec_iam::within(&info.project, &p.project) {
        return Err(ApiError::not_found(format!(
            "snapshot {sid} does not exist (it may have been deleted)"
        ))
        .into());
    }
    Ok(info)
}

/// `POST /v1/sandboxes/{id}/snapshot`'s body (optional): labels the snapshot has over
/// those of its sandbox.
#[derive(serde::Deserialize, Default, utoipa::ToSchema)]
#[schema(as = SnapshotRequest)]
#[serde(deny_unknown_fields)]
struct SnapshotBody {
    #[serde(default)]
    labels: std::collections::BTreeMap<String, String>,
}

#[utoipa::path(
    post,
    path = "/v1/sandboxes/{id}/snapshot",
    summary = "Keep a running sandbox's state under a new snapshot id (VM: memory and devices; container: its files); the sandbox pauses briefly",
    params(
        SandboxPath,
    ),
    request_body = Option<SnapshotBody>,
    responses(
        (status = 201, description = "the snapshot", body = SnapshotInfo),
        (status = 404, response = ErrorReply),
        (status = 409, response = ErrorReply),
        (status = 400, response = ErrorReply),
    ),
)]
async fn create(
    State(st): State<AppState>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    route(&st, &id)?;
    let b: SnapshotBody = if bytes.is_empty() {
        SnapshotBody::default()
    } else {
        body(&bytes, "snapshot")?
    };
    Ok(json(
        StatusCode::CREATED,
        &st.edge.create_snapshot(&id, b.labels).await?,
    ))
}

#[utoipa::path(
    get,
    path = "/v1/snapshots",
    summary = "Snapshots the caller's project can see",
    responses(
        (status = 200, description = "snapshots", body = ListSnapshotsResponse),
    ),
)]
async fn list(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
) -> ApiResult<Response> {
    let mut snapshots = st.edge.list_snapshots();
    snapshots.retain(|s| dsec_iam::within(&s.project, &p.project));
    Ok(json(StatusCode::OK, &ListSnapshotsResponse { snapshots }))
}

#[utoipa::path(
    get,
    path = "/v1/snapshots/{sid}",
    summary = "One snapshot",
    params(
        ("sid" = String, Path),
    ),
    responses(
        (status = 200, description = "the snapshot", body = SnapshotInfo),
        (status = 404, response = ErrorReply),
    ),
)]
async fn show(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(sid): Path<String>,
) -> ApiResult<Response> {
    Ok(json(StatusCode::OK, &visible(&st, &p, &sid)?))
}

#[utoipa::path(
    delete,
    path = "/v1/snapshots/{sid}",
    summary = "Delete a snapshot (sandboxes restored from it keep running)",
    params(
        ("sid" = String, Path),
    ),
    responses(
        (status = 204, description = "deleted"),
        (status = 404, response = ErrorReply),
    ),
)]
async fn delete(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(sid): Path<String>,
) -> ApiResult<Response> {
    visible(&st, &p, &sid)?;
    st.edge.delete_snapshot(&sid).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[utoipa::path(
    post,
    path = "/v1/snapshots/{sid}/restore",
    summary = "Start count sandboxes from a snapshot, on its edge or (edge) on another that pulls it",
    params(
        ("sid" = String, Path),
    ),
    request_body = Option<ForkRequest>,
    responses(
        (status = 201, description = "the new sandboxes", body = ForkResponse),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn restore(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(sid): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    visible(&st, &p, &sid)?;
    let req: ForkRequest = if bytes.is_empty() {
        body(&Bytes::from_static(b"{}"), "restore")?
    } else {
        body(&bytes, "restore")?
    };
    Ok(json(
        StatusCode::CREATED,
        &st.edge.restore_snapshot(&sid, req).await?,
    ))
}
