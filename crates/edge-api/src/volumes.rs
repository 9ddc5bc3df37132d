//! Volume routes on an edge's router: create, list, show, delete, and the volume file
//! API (read, write, stat, list, mkdir, remove, owner and mode). A volume belongs to a
//! project; a key sees the volumes of its project and those inside it, and others' are
//! 404, as if they did not exist.

use crate::openapi::Binary;
use dsec_common::api::VolumeEntry;
use dsec_common::error::ErrorReply;
use std::collections::BTreeMap;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Extension, Path, RawQuery, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use dsec_common::ApiError;
use dsec_common::api::StringMap;
use dsec_common::api::{CreateVolumeRequest, ListVolumesResponse, VolumeEntryUpdate, VolumeInfo};
use dsec_common::http::{ApiResult, Failure, body, json};
use dsec_edge::volumes::fs::Owner;
use dsec_iam::Principal;
use dsec_iam::http::usable_project;

use crate::AppState;
use crate::runtime::{flag, parse_mode, query, required};

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/volumes", post(create).get(list))
        .route("/v1/volumes/{vid}", get(show).delete(delete))
        .route(
            "/v1/volumes/{vid}/files",
            get(read).put(write).delete(remove),
        )
        .route("/v1/volumes/{vid}/stat", get(stat).patch(update))
        .route("/v1/volumes/{vid}/list", get(listing))
        .route("/v1/volumes/{vid}/mkdir", post(mkdir))
}

/// What these routes serve, for the generated API description.
#[derive(utoipa::OpenApi)]
#[openapi(paths(
    create, list, show, delete, read, write, remove, stat, update, listing, mkdir
))]
pub(crate) struct Doc;

fn gone(vid: &str) -> Failure {
    ApiError::not_found(format!(
        "volume {vid} does not exist (it may have been deleted)"
    ))
    .into()
}

/// The volume, if the caller's project may see it (404 otherwise, so ids don't leak).
fn visible(st: &AppState, p: &Principal, vid: &str) -> ApiResult<VolumeInfo> {
    let info = st
        .edge
        .resolve_volume(vid, &p.project)
        .map_err(|_| gone(vid))?;
    if info.id != vid || !dsec_iam::within(&info.project, &p.project) {
        return Err(gone(vid));
    }
    Ok(info)
}

/// The volumes a create names, each one the key may see (by id, or by name in the
/// sandbox's project and its parents), each replaced by its id: the edge mounts exactly
/// what was checked here. Any other is 404, alike whether it exists or not.
pub(crate) fn check_mounts(
    st: &AppState,
    p: &Principal,
    project: &str,
    backend: &str,
    mounts: &mut [dsec_common::api::VolumeMount],
) -> ApiResult<()> {
    if !mounts.is_empty() {
        dsec_edge::volumes::volumes_allowed(backend)?;
    }
    for m in mounts {
        let v = st
            .edge
            .resolve_volume(&m.volume, project)
            .ok()
            .filter(|v| dsec_iam::within(&v.project, &p.project))
            .ok_or_else(|| dsec_edge::volumes::missing(&m.volume, project))?;
        m.volume = v.id;
    }
    Ok(())
}

#[utoipa::path(
    post,
    path = "/v1/volumes",
    summary = "Create a volume",
    request_body = CreateVolumeRequest,
    responses(
        (status = 201, description = "the volume", body = VolumeInfo),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
        (status = 409, response = ErrorReply),
        (status = 429, response = ErrorReply),
    ),
)]
async fn create(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let mut req: CreateVolumeRequest = body(&bytes, "create volume")?;
    let project = req.project.clone().unwrap_or_else(|| p.project.clone());
    usable_project(&p, &project)?;
    req.project = Some(project);
    Ok(json(
        StatusCode::CREATED,
        &st.edge.create_volume(req).await?,
    ))
}

#[utoipa::path(
    get,
    path = "/v1/volumes",
    summary = "The volumes of the key's project and those inside it",
    responses(
        (status = 200, description = "volumes", body = ListVolumesResponse),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn list(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
) -> ApiResult<Response> {
    let mut volumes = st.edge.list_volumes().await;
    volumes.retain(|v| dsec_iam::within(&v.project, &p.project));
    Ok(json(StatusCode::OK, &ListVolumesResponse { volumes }))
}

#[utoipa::path(
    get,
    path = "/v1/volumes/{vid}",
    summary = "One volume",
    params(
        ("vid" = String, Path),
    ),
    responses(
        (status = 200, description = "the volume", body = VolumeInfo),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn show(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(vid): Path<String>,
) -> ApiResult<Response> {
    visible(&st, &p, &vid)?;
    Ok(json(StatusCode::OK, &st.edge.get_volume(&vid).await?))
}

#[utoipa::path(
    delete,
    path = "/v1/volumes/{vid}",
    summary = "Delete a volume and its files (refused while a sandbox mounts it)",
    params(
        ("vid" = String, Path),
    ),
    responses(
        (status = 204, description = "deleted"),
        (status = 404, response = ErrorReply),
        (status = 409, response = ErrorReply),
    ),
)]
async fn delete(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(vid): Path<String>,
) -> ApiResult<Response> {
    visible(&st, &p, &vid)?;
    st.edge.delete_volume(&vid).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

fn number<T: std::str::FromStr>(q: &BTreeMap<String, String>, k: &str) -> ApiResult<Option<T>> {
    q.get(k)
        .map(|v| {
            v.parse::<T>().map_err(|_| {
                ApiError::invalid(format!("{k} must be a whole number (got {v:?})")).into()
            })
        })
        .transpose()
}

/// `uid`, `gid` and `mode` (octal, like `644`) of a query.
fn owner(q: &BTreeMap<String, String>) -> ApiResult<Owner> {
    Ok(Owner {
        uid: number(q, "uid")?,
        gid: number(q, "gid")?,
        mode: parse_mode(q.get("mode"))?,
    })
}

/// A file call's query and the path it names, once the caller may see the volume.
fn target(
    st: &AppState,
    p: &Principal,
    vid: &str,
    q: Option<&str>,
) -> ApiResult<(StringMap, String)> {
    visible(st, p, vid)?;
    let q = query(q);
    let path = required(&q, "path")?;
    Ok((q, path))
}

#[utoipa::path(
    get,
    path = "/v1/volumes/{vid}/files",
    summary = "Read a file of a volume",
    params(
        ("vid" = String, Path),
        ("path" = String, Query, description = "a path in the volume, e.g. /data/a.txt (resolved inside it)"),
    ),
    responses(
        (status = 200, description = "its bytes", body = inline(Binary), content_type = "application/octet-stream"),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn read(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(vid): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let (_, path) = target(&st, &p, &vid, q.as_deref())?;
    let r = st.edge.volume_read(&vid, &path).await?;
    let size = r.size;
    let s = futures_util::stream::unfold(r, |mut r| async move {
        let c = r.chunk().await?;
        Some((c.map_err(|e| std::io::Error::other(e.message)), r))
    });
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_LENGTH, size.to_string()),
        ],
        Body::from_stream(s),
    )
        .into_response())
}

#[utoipa::path(
    put,
    path = "/v1/volumes/{vid}/files",
    summary = "Write a file of a volume (made with missing directories above it, or replaced)",
    params(
        ("vid" = String, Path),
        ("path" = String, Query, description = "a path in the volume, e.g. /data/a.txt (resolved inside it)"),
        ("uid" = Option<u64>, Query),
        ("gid" = Option<u64>, Query),
        ("mode" = Option<String>, Query),
    ),
    request_body(content = inline(Binary), content_type = "application/octet-stream"),
    responses(
        (status = 201, description = "the file", body = VolumeEntry),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
        (status = 429, response = ErrorReply),
    ),
)]
async fn write(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(vid): Path<String>,
    RawQuery(q): RawQuery,
    b: Body,
) -> ApiResult<Response> {
    let (q, path) = target(&st, &p, &vid, q.as_deref())?;
    let o = owner(&q)?;
    let e = st
        .edge
        .volume_write(&vid, &path, o, b.into_data_stream())
        .await?;
    Ok(json(StatusCode::CREATED, &e))
}

#[utoipa::path(
    delete,
    path = "/v1/volumes/{vid}/files",
    summary = "Remove a file, link or directory (with what it holds) of a volume",
    params(
        ("vid" = String, Path),
        ("path" = String, Query, description = "a path in the volume, e.g. /data/a.txt (resolved inside it)"),
    ),
    responses(
        (status = 204, description = "removed"),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn remove(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(vid): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let (_, path) = target(&st, &p, &vid, q.as_deref())?;
    st.edge.volume_remove(&vid, &path).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[utoipa::path(
    get,
    path = "/v1/volumes/{vid}/stat",
    summary = "What is at a path of a volume (a link itself)",
    params(
        ("vid" = String, Path),
        ("path" = String, Query, description = "a path in the volume, e.g. /data/a.txt (resolved inside it)"),
    ),
    responses(
        (status = 200, description = "the entry", body = VolumeEntry),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn stat(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(vid): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let (_, path) = target(&st, &p, &vid, q.as_deref())?;
    Ok(json(
        StatusCode::OK,
        &st.edge.volume_stat(&vid, &path).await?,
    ))
}

#[utoipa::path(
    patch,
    path = "/v1/volumes/{vid}/stat",
    summary = "Change the owner or permission bits at a path",
    params(
        ("vid" = String, Path),
        ("path" = String, Query, description = "a path in the volume, e.g. /data/a.txt (resolved inside it)"),
    ),
    request_body = Option<VolumeEntryUpdate>,
    responses(
        (status = 200, description = "the entry", body = VolumeEntry),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn update(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(vid): Path<String>,
    RawQuery(q): RawQuery,
    bytes: Bytes,
) -> ApiResult<Response> {
    let (_, path) = target(&st, &p, &vid, q.as_deref())?;
    let u: VolumeEntryUpdate = body(&bytes, "update")?;
    if u.mode.is_some_and(|m| m > 0o7777) {
        return Err(ApiError::invalid("mode must be permission bits, at most 0o7777").into());
    }
    let o = Owner {
        uid: u.uid,
        gid: u.gid,
        mode: u.mode,
    };
    Ok(json(
        StatusCode::OK,
        &st.edge.volume_update(&vid, &path, o).await?,
    ))
}

#[derive(serde::Serialize, utoipa::ToSchema)]
#[schema(as = VolumeListing)]
struct Listing {
    entries: Vec<dsec_common::api::VolumeEntry>,
}

#[utoipa::path(
    get,
    path = "/v1/volumes/{vid}/list",
    summary = "A directory's entries, depth levels down",
    params(
        ("vid" = String, Path),
        ("path" = Option<String>, Query, description = "a path in the volume, e.g. /data/a.txt (resolved inside it)"),
        ("depth" = Option<u64>, Query, description = "1 to 64, default 1"),
    ),
    responses(
        (status = 200, description = "entries", body = Listing),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn listing(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(vid): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    visible(&st, &p, &vid)?;
    let q = query(q.as_deref());
    let path = q.get("path").cloned().unwrap_or_else(|| "/".into());
    let depth = number::<u32>(&q, "depth")?.unwrap_or(1);
    if !(1..=64).contains(&depth) {
        return Err(ApiError::invalid(format!("depth must be from 1 to 64 (got {depth})")).into());
    }
    let entries = st.edge.volume_list(&vid, &path, depth).await?;
    Ok(json(StatusCode::OK, &Listing { entries }))
}

#[utoipa::path(
    post,
    path = "/v1/volumes/{vid}/mkdir",
    summary = "Make a directory in a volume",
    params(
        ("vid" = String, Path),
        ("path" = String, Query, description = "a path in the volume, e.g. /data/a.txt (resolved inside it)"),
        ("parents" = Option<bool>, Query),
        ("uid" = Option<u64>, Query),
        ("gid" = Option<u64>, Query),
        ("mode" = Option<String>, Query),
    ),
    responses(
        (status = 201, description = "the directory", body = VolumeEntry),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
        (status = 409, response = ErrorReply),
    ),
)]
async fn mkdir(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(vid): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let (q, path) = target(&st, &p, &vid, q.as_deref())?;
    let parents = flag(&q, "parents")?;
    let o = owner(&q)?;
    Ok(json(
        StatusCode::CREATED,
        &st.edge.volume_mkdir(&vid, &path, parents, o).await?,
    ))
}
