//! Lifecycle events and webhooks on an edge's router: `GET /v1/events` (long-polls with
//! `wait_seconds`) and per-project webhooks. A key sees and hooks the events of its project
//! and the projects inside it only; anything else is 404, so ids do not leak.

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Extension, Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use dsec_common::ApiError;
use dsec_common::api::{Delivery, ListEventsResponse, WebhookInfo, WebhookRequest, WebhookUpdate};
use dsec_common::error::ErrorReply;
use dsec_common::event_query::EventQuery;
use dsec_common::http::{ApiResult, body, json};
use dsec_iam::Principal;

use crate::AppState;

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/events", get(list))
        .route("/v1/webhooks", get(webhooks).post(add_webhook))
        .route(
            "/v1/webhooks/{wid}",
            get(show_webhook)
                .patch(update_webhook)
                .delete(remove_webhook),
        )
        .route("/v1/webhooks/{wid}/deliveries", get(deliveries))
}

/// What these routes serve, for the generated API description.
#[derive(utoipa::OpenApi)]
#[openapi(paths(
    list,
    webhooks,
    add_webhook,
    show_webhook,
    update_webhook,
    remove_webhook,
    deliveries
))]
pub(crate) struct Doc;

#[utoipa::path(
    get,
    path = "/v1/events",
    summary = "Lifecycle events of the caller's sandboxes (its project and inside), oldest first, after a sequence number; next is where the following page starts (once the answer is not a full page, the node's position then: every later event is numbered above it)",
    params(
        ("after" = Option<u64>, Query, description = "only events with a larger seq (the previous answer's next)"),
        ("limit" = Option<u64>, Query, description = "at most this many (default 100, at most 1000)"),
        ("sandbox" = Option<String>, Query, description = "only this sandbox's"),
        ("type" = Option<String>, Query, description = "only this type (repeat it for any of several)"),
        ("order" = Option<String>, Query, description = "asc (oldest first, the default) or desc (newest first)"),
        ("offset" = Option<u64>, Query, description = "pass over this many matching events first"),
        ("wait_seconds" = Option<f64>, Query, description = "wait up to this long (at most 60) for an event when there is none yet"),
    ),
    responses(
        (status = 200, description = "events", body = ListEventsResponse),
        (status = 400, response = ErrorReply),
    ),
)]
async fn list(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let query = EventQuery::parse(q.as_deref().unwrap_or(""))?;
    let project = p.project.clone();
    let (events, next) = st
        .edge
        .events()
        .list(
            &query,
            |e| dsec_iam::within(&e.project, &project),
            query.wait,
        )
        .await;
    Ok(json(StatusCode::OK, &ListEventsResponse { events, next }))
}

/// The webhook, if the caller's project may see it.
fn visible(st: &AppState, p: &Principal, wid: &str) -> ApiResult<WebhookInfo> {
    match st.edge.events().webhook(wid) {
        Some(w) if dsec_iam::within(&w.project, &p.project) => Ok(w),
        _ => Err(ApiError::not_found(format!("webhook {wid} does not exist")).into()),
    }
}

#[utoipa::path(
    get,
    path = "/v1/webhooks",
    summary = "Webhooks of the caller's project and the projects inside it (without their secrets)",
    responses(
        (status = 200, description = "webhooks: {\"webhooks\": [...]}", body = Object),
    ),
)]
async fn webhooks(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
) -> ApiResult<Response> {
    let list = st
        .edge
        .events()
        .webhooks(|project| dsec_iam::within(project, &p.project));
    Ok(json(
        StatusCode::OK,
        &serde_json::json!({ "webhooks": list }),
    ))
}

#[utoipa::path(
    post,
    path = "/v1/webhooks",
    summary = "Send a project's events to a URL: POSTed one at a time in order, signed with X-Dsec-Signature (t=<unix>,v1=<hex HMAC-SHA256(secret, \"<t>.<body>\")>) or, with format e2b, as E2B signs; retried with backoff; the secret is in this answer only",
    request_body = WebhookRequest,
    responses(
        (status = 201, description = "the webhook, with its secret", body = WebhookInfo),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
        (status = 429, response = ErrorReply),
    ),
)]
async fn add_webhook(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let mut req: WebhookRequest = body(&bytes, "webhook")?;
    let project = req.project.take().unwrap_or_else(|| p.project.clone());
    if !dsec_iam::within(&project, &p.project) {
        return Err(ApiError::not_found(format!(
            "project {project} does not exist or is not the key's to hook"
        ))
        .into());
    }
    Ok(json(
        StatusCode::CREATED,
        &st.edge.events().add_webhook(req, project, &p.project)?,
    ))
}

#[utoipa::path(
    get,
    path = "/v1/webhooks/{wid}",
    summary = "One webhook (without its secret)",
    params(("wid" = String, Path)),
    responses(
        (status = 200, description = "the webhook", body = WebhookInfo),
        (status = 404, response = ErrorReply),
    ),
)]
async fn show_webhook(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(wid): Path<String>,
) -> ApiResult<Response> {
    Ok(json(StatusCode::OK, &visible(&st, &p, &wid)?))
}

#[utoipa::path(
    patch,
    path = "/v1/webhooks/{wid}",
    summary = "Change a webhook's url, types, name or whether it is sent events (a field left out stays)",
    params(("wid" = String, Path)),
    request_body = WebhookUpdate,
    responses(
        (status = 200, description = "the webhook", body = WebhookInfo),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn update_webhook(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(wid): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    visible(&st, &p, &wid)?;
    let u: WebhookUpdate = body(&bytes, "webhook update")?;
    Ok(json(
        StatusCode::OK,
        &st.edge.events().update_webhook(&wid, u)?,
    ))
}

#[utoipa::path(
    delete,
    path = "/v1/webhooks/{wid}",
    summary = "Remove a webhook; events not yet delivered are not sent",
    params(("wid" = String, Path)),
    responses(
        (status = 204, description = "removed"),
        (status = 404, response = ErrorReply),
    ),
)]
async fn remove_webhook(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(wid): Path<String>,
) -> ApiResult<Response> {
    visible(&st, &p, &wid)?;
    st.edge.events().remove_webhook(&wid)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[utoipa::path(
    get,
    path = "/v1/webhooks/{wid}/deliveries",
    summary = "The webhook's last tries (up to 200), oldest first: event, attempt, status, error",
    params(("wid" = String, Path)),
    responses(
        (status = 200, description = "{\"deliveries\": [...]}", body = Vec<Delivery>),
        (status = 404, response = ErrorReply),
    ),
)]
async fn deliveries(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(wid): Path<String>,
) -> ApiResult<Response> {
    visible(&st, &p, &wid)?;
    let d = st.edge.events().deliveries(&wid).unwrap_or_default();
    Ok(json(
        StatusCode::OK,
        &serde_json::json!({ "deliveries": d }),
    ))
}
