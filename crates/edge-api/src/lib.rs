//! A node's own REST face: the public REST/JSON API (described by `openapi.json`, served
//! at `/openapi.json`) over one in-process [`Edge`], with API-key authentication through
//! IAM and project visibility. `dsec up` serves it to clients; every edge of a cluster
//! serves it on its mutual-TLS listener, where the apiserver forwards requests with the
//! caller's principal, and where edges hand each other saved VMs and image chunks.

use crate::openapi::{SandboxPath, StepHeaders};
use dsec_common::api::{
    CommitRequest, CommitResponse, ExecResult, ForkResponse, FunctionCallRequest,
    FunctionCallResult, GroupResponse, MetricsHistory, SandboxMetrics, UsageResponse,
};
use dsec_common::error::ErrorReply;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Extension, Path, RawQuery, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use dsec_common::ApiError;
use dsec_common::api::{
    ClusterStatus, CreateSandboxRequest, ExecRequest, ForkRequest, GroupRequest,
    ListSandboxesResponse, PauseRequest, ResumeRequest, SandboxInfo, SetNetworkRequest,
    SetTimeoutRequest, StringMap,
};
use dsec_common::http::{
    ApiResult, Failure, api_key, body, json, label_filter, method_not_allowed, missing_key,
    no_such_endpoint, public_routes, unknown_key,
};
use dsec_common::id::SandboxId;
use dsec_edge::Edge;
use dsec_iam::http::{
    PRINCIPAL_HEADER, create_request, decode_principal, may_forward, status_for, usable_project,
};
use dsec_iam::{Iam, Principal};

mod events;
pub mod grpc;
mod images;
pub mod openapi;
mod ports;
pub mod quotas;
mod runtime;
mod snapshots;
pub mod transfer;
mod volumes;

#[derive(Clone)]
pub struct AppState {
    pub edge: Arc<Edge>,
    pub iam: Arc<dyn Iam>,
    /// Take the caller's principal from [`PRINCIPAL_HEADER`] (set by an apiserver) instead
    /// of an API key: only for an edge's listener that admits cluster components alone
    /// (mutual TLS), never for a public one.
    pub forwarded: bool,
}

/// The forwarded principal of a request, when the state trusts forwarding and the peer's
/// certificate may forward one for it (see [`may_forward`]).
pub(crate) fn forwarded_principal(st: &AppState, req: &Request) -> Option<Principal> {
    if !st.forwarded {
        return None;
    }
    let peer = req.extensions().get::<dsec_mtls::Identity>();
    if !may_forward(peer, req.method(), req.uri().path()) {
        return None;
    }
    req.headers()
        .get(PRINCIPAL_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(decode_principal)
}

pub fn router(state: AppState) -> Router {
    let api = Router::new()
        .route("/v1/status", get(status))
        .route("/v1/sandboxes", post(create).get(list))
        .route("/v1/sandboxes/{id}", get(get_one).delete(stop))
        .route("/v1/usage", get(usage))
        .route("/v1/sandboxes/{id}/metrics", get(metrics))
        .route("/v1/sandboxes/{id}/metrics/history", get(metrics_history))
        .route("/v1/sandboxes/{id}/exec", post(exec))
        .route("/v1/sandboxes/{id}/commit", post(commit))
        .route("/v1/sandboxes/{id}/fork", post(fork))
        .route("/v1/sandboxes/{id}/pause", post(pause))
        .route("/v1/sandboxes/{id}/resume", post(resume))
        .route("/v1/groups/pause", post(pause_group))
        .route("/v1/groups/resume", post(resume_group))
        .route("/v1/sandboxes/{id}/timeout", post(set_timeout))
        .route(
            "/v1/sandboxes/{id}/network",
            axum::routing::put(set_network),
        )
        .route("/v1/images", get(images))
        .route("/v1/images/builds", post(build_image))
        .route(
            "/v1/images/{reference}",
            axum::routing::delete(images::remove_image),
        )
        .route("/v1/images:pull", post(images::pull_image))
        .route("/v1/images:push", post(images::push_image))
        .route("/v1/registries", get(images::list_logins))
        .route(
            "/v1/registries/{registry}/login",
            axum::routing::put(images::put_login).delete(images::delete_login),
        )
        .route("/v1/functions", get(functions))
        .route("/v1/functions/{call}", post(call_function))
        .route("/metrics", get(metrics_text))
        .merge(runtime::routes())
        .merge(snapshots::routes())
        .merge(events::routes())
        .merge(volumes::routes())
        .merge(dsec_iam::http::routes().with_state(state.iam.clone()))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    public_routes()
        .merge(api)
        // The web console's pages; it calls the API above with the key the user types.
        .merge(dsec_console::routes())
        // Edge to edge over mutual TLS: each handler checks the peer's certificate.
        .merge(transfer::routes())
        // Checks the API key or the sandbox's port token itself.
        .merge(ports::routes())
        .fallback(|| async { no_such_endpoint() })
        .method_not_allowed_fallback(|| async { method_not_allowed() })
        .layer(middleware::from_fn(|r, n| {
            dsec_metrics::http::count("edge", r, n)
        }))
        .layer(DefaultBodyLimit::max(64 << 20))
        .with_state(state)
}

/// `GET /metrics`: the process's Prometheus metrics, for a key of the root project only
/// (they name every project's sandboxes).
#[utoipa::path(
    get,
    path = "/metrics",
    summary = "Prometheus metrics of the node (OpenMetrics text): sandboxes made, stopped and running by project, create and exec latency, admission refusals, pools, requests, DNS answers, network set-up, IAM's Raft; for keys of the root project",
    responses(
        (status = 200, description = "the metrics", body = String, content_type = "application/openmetrics-text; version=1.0.0; charset=utf-8"),
        (status = 401, response = ErrorReply),
        (status = 403, response = ErrorReply),
    ),
)]
async fn metrics_text(Extension(p): Extension<Principal>) -> ApiResult<Response> {
    dsec_iam::http::metrics_for(&p)
}

/// The caller: the forwarded principal (on an edge's cluster listener) or the API key's.
pub(crate) fn caller(st: &AppState, req: &Request) -> Result<Principal, Failure> {
    if let Some(p) = forwarded_principal(st, req) {
        return Ok(p);
    }
    let k = api_key(req.headers()).ok_or_else(missing_key)?;
    st.iam.authenticate(k).ok_or_else(unknown_key)
}

async fn auth(State(st): State<AppState>, mut req: Request, next: Next) -> Response {
    let principal = match caller(&st, &req) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    // A sandbox of a project the key cannot see does not exist for it (404, not 403, so
    // ids don't leak).
    if let Some(id) = req.uri().path().strip_prefix("/v1/sandboxes/")
        && let Some(id) = id.split('/').next()
        && let Err(e) = visible(&st, &principal, id)
    {
        return e.into_response();
    }
    req.extensions_mut().insert(principal);
    next.run(req).await
}

/// Whether the principal may see sandbox `id` (a sandbox of its project or inside it).
pub(crate) fn visible(st: &AppState, p: &Principal, id: &str) -> ApiResult<()> {
    if id.is_empty() {
        return Ok(());
    }
    route(st, id)?;
    match st.edge.get(id) {
        Ok(info) if dsec_iam::within(&info.project, &p.project) => Ok(()),
        Ok(_) => Err(ApiError::not_found(format!(
            "sandbox {id} does not exist (it may have been stopped or its TTL ran out)"
        ))
        .into()),
        Err(e) => Err(e.into()),
    }
}

/// Checks that the id is well formed and names an edge this apiserver reaches.
pub(crate) fn route(st: &AppState, id: &str) -> ApiResult<()> {
    let parsed = SandboxId::parse(id).map_err(|e| ApiError::invalid(e.to_string()))?;
    if parsed.edge() != st.edge.name() {
        return Err(ApiError::not_found(format!(
            "sandbox {id} belongs to edge {}, which this apiserver does not know",
            parsed.edge()
        ))
        .into());
    }
    Ok(())
}

/// The node's status as `p` sees it (per-project counts of its subtree only).
pub(crate) fn status_seen_by(st: &AppState, p: &Principal) -> ClusterStatus {
    let mut view = dsec_watcher::ClusterView::default();
    view.update(st.edge.status());
    status_for(p, view.status())
}

#[utoipa::path(
    get,
    path = "/v1/status",
    summary = "Nodes, backends, capacity, sandboxes",
    responses(
        (status = 200, description = "cluster status"),
        (status = 401, response = ErrorReply),
    ),
)]
async fn status(State(st): State<AppState>, Extension(p): Extension<Principal>) -> Response {
    json(StatusCode::OK, &status_seen_by(&st, &p))
}

/// A create whose project and image are checked against `p` (`check_create`): its volumes
/// checked and looked up, then made. REST and gRPC alike.
pub(crate) async fn create_checked(
    st: &AppState,
    p: &Principal,
    mut req: CreateSandboxRequest,
) -> ApiResult<SandboxInfo> {
    let project = req.project.clone().unwrap_or_else(|| p.project.clone());
    let backend = req.backend.clone();
    volumes::check_mounts(st, p, &project, &backend, &mut req.volumes)?;
    Ok(st.edge.create(req).await?)
}

#[utoipa::path(
    post,
    path = "/v1/sandboxes",
    summary = "Create a sandbox",
    request_body = CreateSandboxRequest,
    responses(
        (status = 201, description = "running", body = SandboxInfo),
        (status = 400, response = ErrorReply),
        (status = 401, response = ErrorReply),
        (status = 404, response = ErrorReply),
        (status = 429, response = ErrorReply),
        (status = 503, response = ErrorReply),
    ),
)]
async fn create(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let req = create_request(&bytes, &p)?;
    Ok(json(
        StatusCode::CREATED,
        &create_checked(&st, &p, req).await?,
    ))
}

/// The sandboxes with every one of `labels` that `p` may see (its project and inside).
pub(crate) fn sandboxes_seen_by(
    st: &AppState,
    p: &Principal,
    labels: &StringMap,
) -> Vec<SandboxInfo> {
    let mut sandboxes = st.edge.list(labels);
    sandboxes.retain(|s| dsec_iam::within(&s.project, &p.project));
    sandboxes
}

#[utoipa::path(
    get,
    path = "/v1/sandboxes",
    summary = "List sandboxes",
    params(
        ("label" = Option<String>, Query, description = "KEY=VALUE; repeat to require several"),
    ),
    responses(
        (status = 200, description = "sandboxes"),
    ),
)]
async fn list(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let labels = label_filter(q.as_deref())?;
    let sandboxes = sandboxes_seen_by(&st, &p, &labels);
    Ok(json(StatusCode::OK, &ListSandboxesResponse { sandboxes }))
}

#[utoipa::path(
    get,
    path = "/v1/usage",
    summary = "What each of the caller's sandboxes uses (CPU over the last interval, memory), from the node's kept readings: one call for all of them (dsec top)",
    params(
        ("label" = Option<String>, Query, description = "KEY=VALUE; repeat to require several"),
    ),
    responses(
        (status = 200, description = "usage", body = UsageResponse),
        (status = 400, response = ErrorReply),
    ),
)]
async fn usage(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let labels = label_filter(q.as_deref())?;
    let u = st
        .edge
        .usage(&labels, |project| dsec_iam::within(project, &p.project));
    Ok(json(StatusCode::OK, &u))
}

#[utoipa::path(
    get,
    path = "/v1/sandboxes/{id}",
    summary = "Get a sandbox",
    params(
        SandboxPath,
    ),
    responses(
        (status = 200, description = "sandbox"),
        (status = 404, response = ErrorReply),
    ),
)]
async fn get_one(State(st): State<AppState>, Path(id): Path<String>) -> ApiResult<Response> {
    route(&st, &id)?;
    Ok(json(StatusCode::OK, &st.edge.get(&id)?))
}

#[utoipa::path(
    get,
    path = "/v1/sandboxes/{id}/metrics",
    summary = "What a running sandbox uses now: CPU time so far (a running total), memory and its writable disk",
    params(
        SandboxPath,
    ),
    responses(
        (status = 200, description = "the readings", body = SandboxMetrics),
        (status = 404, response = ErrorReply),
        (status = 409, description = "the sandbox is not running"),
    ),
)]
async fn metrics(State(st): State<AppState>, Path(id): Path<String>) -> ApiResult<Response> {
    route(&st, &id)?;
    Ok(json(StatusCode::OK, &st.edge.metrics(&id).await?))
}

/// `?start_ms=&end_ms=` (milliseconds since the epoch, both optional).
#[utoipa::path(
    get,
    path = "/v1/sandboxes/{id}/metrics/history",
    summary = "The sandbox's kept readings of CPU time and memory (one every metrics_interval_ms while it ran; the last 360), oldest first",
    params(
        SandboxPath,
        ("start_ms" = Option<u64>, Query, description = "the first reading's earliest time, milliseconds since the epoch"),
        ("end_ms" = Option<u64>, Query, description = "the last reading's latest time, milliseconds since the epoch"),
    ),
    responses(
        (status = 200, description = "the readings", body = MetricsHistory),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn metrics_history(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    route(&st, &id)?;
    let mut range = [None, None];
    for pair in q
        .as_deref()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
    {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let at = match k {
            "start_ms" => 0,
            "end_ms" => 1,
            other => {
                return Err(ApiError::invalid(format!(
                    "unknown query parameter {other:?}: start_ms and end_ms (milliseconds since the epoch) are taken"
                ))
                .into());
            }
        };
        range[at] = Some(v.parse::<u64>().map_err(|_| {
            ApiError::invalid(format!(
                "{k} must be milliseconds since the epoch, not {v:?}"
            ))
        })?);
    }
    Ok(json(
        StatusCode::OK,
        &st.edge.metrics_history(&id, range[0], range[1])?,
    ))
}

#[utoipa::path(
    delete,
    path = "/v1/sandboxes/{id}",
    summary = "Stop a sandbox: kills its processes, removes its mounts, cgroups and files",
    params(
        SandboxPath,
    ),
    responses(
        (status = 204, description = "stopped"),
        (status = 404, response = ErrorReply),
    ),
)]
async fn stop(State(st): State<AppState>, Path(id): Path<String>) -> ApiResult<Response> {
    route(&st, &id)?;
    st.edge.stop(&id).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[utoipa::path(
    post,
    path = "/v1/sandboxes/{id}/exec",
    summary = "Run a command: wait for it, stream it (stream), or start it (background); see docs/RUNTIME_API.md",
    params(
        SandboxPath,
        StepHeaders,
    ),
    request_body = ExecRequest,
    responses(
        (status = 200, description = "result", body = ExecResult),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
        (status = 201, description = "background process started", body = Object),
    ),
)]
async fn exec(
    State(st): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    bytes: Bytes,
) -> ApiResult<Response> {
    route(&st, &id)?;
    let req: ExecRequest = body(&bytes, "exec")?;
    runtime::exec(&st, &id, &headers, req).await
}

#[utoipa::path(
    post,
    path = "/v1/sandboxes/{id}/fork",
    summary = "Fork a running sandbox into count copies",
    params(
        SandboxPath,
    ),
    request_body = Option<ForkRequest>,
    responses(
        (status = 201, description = "copies", body = ForkResponse),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn fork(
    State(st): State<AppState>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    route(&st, &id)?;
    let req: ForkRequest = if bytes.is_empty() {
        body(&Bytes::from_static(b"{}"), "fork")?
    } else {
        body(&bytes, "fork")?
    };
    Ok(json(StatusCode::CREATED, &st.edge.fork(&id, req).await?))
}

#[utoipa::path(
    post,
    path = "/v1/sandboxes/{id}/pause",
    summary = "Pause a running sandbox: frozen in place, or (to_disk, vm backends) saved to disk with its memory and its processes ended",
    params(
        SandboxPath,
    ),
    request_body = Option<PauseRequest>,
    responses(
        (status = 200, description = "the sandbox, state paused", body = SandboxInfo),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
        (status = 409, response = ErrorReply),
        (status = 501, response = ErrorReply),
    ),
)]
async fn pause(
    State(st): State<AppState>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    route(&st, &id)?;
    let req: PauseRequest = if bytes.is_empty() {
        PauseRequest::default()
    } else {
        body(&bytes, "pause")?
    };
    Ok(json(
        StatusCode::OK,
        &st.edge.pause(&id, req.to_disk).await?,
    ))
}

#[utoipa::path(
    post,
    path = "/v1/sandboxes/{id}/resume",
    summary = "Resume a paused sandbox where it stopped (from disk too)",
    params(
        SandboxPath,
    ),
    request_body = Option<ResumeRequest>,
    responses(
        (status = 200, description = "the sandbox, state running", body = SandboxInfo),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
        (status = 409, response = ErrorReply),
        (status = 501, response = ErrorReply),
    ),
)]
async fn resume(
    State(st): State<AppState>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    route(&st, &id)?;
    let req: ResumeRequest = if bytes.is_empty() {
        ResumeRequest::default()
    } else {
        body(&bytes, "resume")?
    };
    Ok(json(StatusCode::OK, &resume_to(&st, &id, req).await?))
}

/// Resumes `id` here, or on the edge the request names.
pub(crate) async fn resume_to(
    st: &AppState,
    id: &str,
    req: ResumeRequest,
) -> Result<SandboxInfo, ApiError> {
    match req.edge.filter(|e| e != st.edge.name()) {
        Some(target) => st.edge.resume_on(id, &target).await,
        None => st.edge.resume(id).await,
    }
}

/// The caller's sandboxes (its project and those inside it) that carry every label.
pub(crate) fn group_ids(
    st: &AppState,
    p: &Principal,
    req: &GroupRequest,
) -> ApiResult<Vec<String>> {
    if req.labels.is_empty() {
        return Err(ApiError::invalid(
            "labels must name at least one key: value; a group is the sandboxes that carry them all",
        )
        .into());
    }
    Ok(sandboxes_seen_by(st, p, &req.labels)
        .into_iter()
        .map(|s| s.id)
        .collect())
}

#[utoipa::path(
    post,
    path = "/v1/groups/pause",
    summary = "Pause every sandbox of the caller's project that has all the given labels",
    request_body = Option<GroupRequest>,
    responses(
        (status = 200, description = "what was done, sandbox by sandbox", body = GroupResponse),
        (status = 400, response = ErrorReply),
    ),
)]
async fn pause_group(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let req: GroupRequest = body(&bytes, "group pause")?;
    let ids = group_ids(&st, &p, &req)?;
    Ok(json(
        StatusCode::OK,
        &st.edge.group(ids, req.to_disk, false).await,
    ))
}

#[utoipa::path(
    post,
    path = "/v1/groups/resume",
    summary = "Resume every paused sandbox of the caller's project that has all the given labels",
    request_body = Option<GroupRequest>,
    responses(
        (status = 200, description = "what was done, sandbox by sandbox", body = GroupResponse),
        (status = 400, response = ErrorReply),
    ),
)]
async fn resume_group(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let req: GroupRequest = body(&bytes, "group resume")?;
    let ids = group_ids(&st, &p, &req)?;
    Ok(json(StatusCode::OK, &st.edge.group(ids, false, true).await))
}

#[utoipa::path(
    post,
    path = "/v1/sandboxes/{id}/timeout",
    summary = "Set the remaining lifetime (keep-alive)",
    params(
        SandboxPath,
    ),
    request_body = SetTimeoutRequest,
    responses(
        (status = 200, description = "sandbox"),
        (status = 404, response = ErrorReply),
    ),
)]
async fn set_timeout(
    State(st): State<AppState>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    route(&st, &id)?;
    let req: SetTimeoutRequest = body(&bytes, "set timeout")?;
    Ok(json(
        StatusCode::OK,
        &st.edge.set_timeout(&id, req.ttl_seconds).await?,
    ))
}

#[utoipa::path(
    put,
    path = "/v1/sandboxes/{id}/network",
    summary = "Replace the sandbox's egress rules (new connections follow them at once; addresses opened by DNS answers for names no longer allowed close)",
    params(
        SandboxPath,
    ),
    request_body = SetNetworkRequest,
    responses(
        (status = 200, description = "sandbox", body = SandboxInfo),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
        (status = 409, response = ErrorReply),
    ),
)]
async fn set_network(
    State(st): State<AppState>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    route(&st, &id)?;
    let req: SetNetworkRequest = body(&bytes, "set network rules")?;
    Ok(json(
        StatusCode::OK,
        &st.edge
            .set_network_rules(&id, req.network_rules, req.egress_headers)
            .await?,
    ))
}

/// A commit names an image of the caller's project subtree (see [`images`]); an existing
/// one is replaced only with `overwrite`.
#[utoipa::path(
    post,
    path = "/v1/sandboxes/{id}/commit",
    summary = "Commit the sandbox's filesystem changes as a new image (one layer on top of its image; env and workdir kept), usable by any backend",
    params(
        SandboxPath,
    ),
    request_body = CommitRequest,
    responses(
        (status = 201, description = "the new image", body = CommitResponse),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
        (status = 409, response = ErrorReply),
    ),
)]
async fn commit(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    route(&st, &id)?;
    let req: dsec_common::api::CommitRequest = body(&bytes, "commit")?;
    images::check_write(&p, &req.image)?;
    Ok(json(StatusCode::CREATED, &st.edge.commit(&id, req).await?))
}

/// `POST /v1/images/builds`: builds the spec (JSON) on this node, `run` steps in
/// sandboxes; answers NDJSON as it goes: `{"log": line}`…, then `{"image", "digest"}` or
/// `{"error": {"code", "message"}}`. The build goes on if the caller leaves.
#[utoipa::path(
    post,
    path = "/v1/images/builds",
    summary = "Build an image on the node (a spec as JSON: name, from or debian, env, workdir, start, step[] with run, file + content, env); run steps execute in sandboxes with egress to package services only. The image must be in the key's project subtree.",
    request_body = Object,
    responses(
        (status = 200, description = "NDJSON: {\"log\": line} as the build goes, then {\"image\", \"digest\"} or {\"error\": {\"code\", \"message\"}}"),
        (status = 400, response = ErrorReply),
        (status = 403, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn build_image(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let spec: dsec_image::build::BuildSpec = body(&bytes, "image build")?;
    images::check_build(&p, &spec)?;
    let name = dsec_image::ImageRef::parse(&spec.name)
        .map_err(|e| ApiError::invalid(e.to_string()))?
        .to_string();
    let edge = st.edge.clone();
    Ok(ndjson(move |log| async move {
        match edge.build_image(spec, p.project, log).await {
            Ok(digest) => serde_json::json!({"image": name, "digest": digest}),
            Err(e) => serde_json::json!({ "error": e }),
        }
    }))
}

/// An NDJSON answer: a `{"log": line}` line for each line `work` sends, then the value
/// it ends with. `work` runs to its end even when the caller leaves, so that nothing is
/// left half-made and it never waits on a reader.
pub(crate) fn ndjson<F, W>(work: W) -> Response
where
    W: FnOnce(tokio::sync::mpsc::UnboundedSender<String>) -> F,
    F: std::future::Future<Output = serde_json::Value> + Send + 'static,
{
    let line = |v: serde_json::Value| {
        let mut b = serde_json::to_vec(&v).unwrap_or_default();
        b.push(b'\n');
        Bytes::from(b)
    };
    let (log_tx, mut log_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let (out_tx, out_rx) = tokio::sync::mpsc::unbounded_channel::<Bytes>();
    let done = tokio::spawn(work(log_tx));
    tokio::spawn(async move {
        while let Some(l) = log_rx.recv().await {
            let _ = out_tx.send(line(serde_json::json!({ "log": l })));
        }
        let last = done.await.unwrap_or_else(
            |e| serde_json::json!({"error": ApiError::internal(format!("the worker failed: {e}"))}),
        );
        let _ = out_tx.send(line(last));
    });
    let stream = futures_util::stream::unfold(out_rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
    });
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        axum::body::Body::from_stream(stream),
    )
        .into_response()
}

#[utoipa::path(
    get,
    path = "/v1/images",
    summary = "Images in the store",
    responses(
        (status = 200, description = "images"),
    ),
)]
async fn images(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
) -> ApiResult<Response> {
    let store = st.edge.images().clone();
    let list = tokio::task::spawn_blocking(move || store.list())
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let list = images::visible(&p, list);
    Ok(json(StatusCode::OK, &serde_json::json!({ "images": list })))
}

/// `GET /v1/functions`: the functions this key may call.
#[utoipa::path(
    get,
    path = "/v1/functions",
    summary = "Functions this key may call ([[edge.functions]] of the node)",
    responses(
        (status = 200, description = "functions", body = FunctionList),
    ),
)]
async fn functions(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
) -> ApiResult<Response> {
    let functions = st.edge.functions(&p.project);
    Ok(json(StatusCode::OK, &FunctionList { functions }))
}

/// `GET /v1/functions`'s answer.
#[derive(serde::Serialize, utoipa::ToSchema)]
struct FunctionList {
    functions: Vec<dsec_common::api::FunctionInfo>,
}

/// `POST /v1/functions/{name}:call`.
#[utoipa::path(
    post,
    path = "/v1/functions/{name}:call",
    summary = "Call a function: its entry point runs in a sandbox of its own (a warm pool member when the function has a pool), with the input as JSON on stdin; the output is its stdout. A function that exits non-zero answers 200 with its exit_code and stderr.",
    params(
        ("name" = String, Path),
    ),
    request_body = FunctionCallRequest,
    responses(
        (status = 200, description = "the function ran", body = FunctionCallResult),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
        (status = 429, response = ErrorReply),
        (status = 504, response = ErrorReply),
    ),
)]
async fn call_function(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(call): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let Some(name) = call.strip_suffix(":call") else {
        return Err(ApiError::not_found(format!(
            "no such endpoint: POST /v1/functions/{call}; to call a function, POST /v1/functions/NAME:call"
        ))
        .into());
    };
    let req: dsec_common::api::FunctionCallRequest = body(&bytes, "function call")?;
    if let Some(project) = &req.project {
        usable_project(&p, project)?;
    }
    let r = st.edge.call_function(name, &p.project, req).await?;
    Ok(json(StatusCode::OK, &r))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fuzz target: any request body is parsed (or refused with a message) without a
    /// panic, whatever the route.
    #[test]
    fn fuzz_bodies() {
        let key = Principal {
            name: "k".into(),
            kind: dsec_iam::PrincipalKind::Agent,
            key_id: "k".into(),
            project: "root/t1".into(),
        };
        bolero::check!()
            .with_iterations(2000)
            .for_each(|input: &[u8]| {
                let b = Bytes::copy_from_slice(input);
                let _ = body::<ExecRequest>(&b, "exec");
                let _ = body::<ForkRequest>(&b, "fork");
                let _ = body::<dsec_common::api::CommitRequest>(&b, "commit");
                let _ = body::<SetNetworkRequest>(&b, "network");
                if let Ok(spec) = body::<dsec_image::build::BuildSpec>(&b, "build") {
                    let _ = images::check_build(&key, &spec);
                }
            });
    }

    #[test]
    fn openapi_document_is_valid_json_with_every_route() {
        let v: serde_json::Value = serde_json::from_str(dsec_common::http::OPENAPI).unwrap();
        for p in [
            "/v1/sandboxes",
            "/v1/sandboxes/{id}",
            "/v1/sandboxes/{id}/exec",
            "/v1/sandboxes/{id}/fork",
            "/v1/sandboxes/{id}/pause",
            "/v1/sandboxes/{id}/resume",
            "/v1/groups/pause",
            "/v1/groups/resume",
            "/v1/sandboxes/{id}/snapshot",
            "/v1/snapshots",
            "/v1/snapshots/{sid}",
            "/v1/snapshots/{sid}/restore",
            "/v1/sandboxes/{id}/commit",
            "/v1/sandboxes/{id}/metrics",
            "/v1/sandboxes/{id}/metrics/history",
            "/v1/sandboxes/{id}/timeout",
            "/v1/sandboxes/{id}/network",
            "/v1/status",
            "/v1/images",
            "/v1/images/builds",
            "/v1/images/{reference}",
            "/v1/images:pull",
            "/v1/images:push",
            "/v1/registries",
            "/v1/registries/{registry}/login",
            "/v1/sandboxes/{id}/processes/{pid}/output",
            "/v1/sandboxes/{id}/files",
            "/v1/sandboxes/{id}/files/watch",
            "/v1/sandboxes/{id}/sessions/{sid}/run",
            "/v1/sandboxes/{id}/trajectories/{name}",
            "/v1/functions",
            "/v1/functions/{name}:call",
            "/v1/volumes",
            "/v1/volumes/{vid}",
            "/v1/volumes/{vid}/files",
            "/v1/volumes/{vid}/stat",
            "/v1/volumes/{vid}/list",
            "/v1/volumes/{vid}/mkdir",
        ] {
            assert!(v["paths"].get(p).is_some(), "{p} missing from openapi.json");
        }
    }
}
