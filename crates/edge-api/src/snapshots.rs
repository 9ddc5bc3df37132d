//! Snapshot routes on an edge's router: take one of a sandbox, list, show, delete, and
//! restore (here, or on another edge with `edge`). A snapshot belongs to the project of
//! the sandbox it was taken of; other projects do not see it.

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use dsec_common::ApiError;
use dsec_common::api::{ForkRequest, ListSnapshotsResponse, SnapshotInfo};
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
#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct SnapshotBody {
    #[serde(default)]
    labels: std::collections::BTreeMap<String, String>,
}

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

async fn list(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
) -> ApiResult<Response> {
    let mut snapshots = st.edge.list_snapshots();
    snapshots.retain(|s| dsec_iam::within(&s.project, &p.project));
    Ok(json(StatusCode::OK, &ListSnapshotsResponse { snapshots }))
}

async fn show(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(sid): Path<String>,
) -> ApiResult<Response> {
    Ok(json(StatusCode::OK, &visible(&st, &p, &sid)?))
}

async fn delete(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(sid): Path<String>,
) -> ApiResult<Response> {
    visible(&st, &p, &sid)?;
    st.edge.delete_snapshot(&sid).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

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
