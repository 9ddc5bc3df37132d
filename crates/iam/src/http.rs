//! IAM over the public API: its routes (whoami, projects, quotas, keys), the principal an
//! apiserver hands to an edge, and the checks any apiserver makes of a request against the
//! key's project before the request reaches an edge. Served by the cluster front door and
//! by a node's own REST face alike.

#[cfg(feature = "openapi")]
use dsec_common::error::ErrorReply;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Extension, Path, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use dsec_common::api::{ClusterStatus, CreateSandboxRequest};
use dsec_common::http::{ApiResult, body, json as json_response};
use dsec_common::image_ref::ImageRef;
use dsec_common::{ApiError, ErrorCode};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::{Command, Iam, IamError, Principal, PrincipalKind, Quota, Refusal};

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

/// What these routes serve, for the generated API description.
#[cfg(feature = "openapi")]
#[derive(utoipa::OpenApi)]
#[openapi(paths(
    whoami,
    projects,
    create_project,
    set_quota,
    keys,
    create_key,
    revoke_key
))]
pub struct Doc;

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

/// The principal an apiserver authenticated, passed on to the edge (base64url of its JSON).
/// The same name as the gRPC metadata entry that carries it.
pub const PRINCIPAL_HEADER: &str = dsec_rpc::PRINCIPAL_METADATA;

pub fn encode_principal(p: &Principal) -> String {
    use base64::Engine;
    let json = serde_json::to_vec(p).unwrap_or_default();
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json)
}

pub fn decode_principal(v: &str) -> Option<Principal> {
    use base64::Engine;
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(v.trim())
        .ok()?;
    serde_json::from_slice(&json).ok()
}

/// Which cluster components may act for a principal on an edge's listener: apiservers
/// (they authenticated the caller), and the watcher only to read `/v1/status`. An edge's
/// certificate forwards nothing, so one escaped node cannot act as anyone on the others
/// (edge-to-edge transfers check the peer's certificate themselves).
pub fn may_forward(peer: Option<&dsec_mtls::Identity>, method: &Method, path: &str) -> bool {
    match peer.map(|p| p.role) {
        Some(dsec_mtls::Role::Apiserver) => true,
        Some(dsec_mtls::Role::Watcher) => method == Method::GET && path == "/v1/status",
        _ => false,
    }
}

/// `GET /metrics`'s answer for `p`: the process's Prometheus metrics for a key of the root
/// project, refused to any other (the series name every project's sandboxes).
pub fn metrics_for(p: &Principal) -> ApiResult<Response> {
    if !p.is_admin() {
        return Err(ApiError::new(
            ErrorCode::PermissionDenied,
            format!(
                "/metrics is for keys of the root project (they show every project's sandboxes); this key is of {}",
                p.project
            ),
        )
        .into());
    }
    Ok((
        [(axum::http::header::CONTENT_TYPE, dsec_metrics::CONTENT_TYPE)],
        dsec_metrics::scrape(),
    )
        .into_response())
}

/// The status a key sees: sandbox counts of its own project subtree only (other projects'
/// names and counts are theirs); node-wide totals and capacity stay.
pub fn status_for(p: &Principal, mut s: ClusterStatus) -> ClusterStatus {
    for n in &mut s.nodes {
        n.projects
            .retain(|project, _| crate::within(project, &p.project));
    }
    s
}

/// A create body, parsed, in the caller's project (or one inside it; 404 otherwise), naming
/// an image the caller may read.
/// A project the key may put sandboxes in: its own or one inside it; any other is as
/// unknown as a missing one (404).
pub fn usable_project(p: &Principal, project: &str) -> ApiResult<()> {
    if crate::within(project, &p.project) {
        return Ok(());
    }
    Err(ApiError::not_found(format!(
        "project {project} does not exist (this key can use {} and the projects inside it)",
        p.project
    ))
    .into())
}

pub fn create_request(bytes: &Bytes, p: &Principal) -> ApiResult<CreateSandboxRequest> {
    check_create(body(bytes, "create sandbox")?, p)
}

/// A create, however it arrived, in the caller's project (or one inside it; 404 otherwise),
/// naming an image the caller may read; its `project` filled in.
pub fn check_create(
    mut req: CreateSandboxRequest,
    p: &Principal,
) -> ApiResult<CreateSandboxRequest> {
    let project = req.project.clone().unwrap_or_else(|| p.project.clone());
    usable_project(p, &project)?;
    check_read(p, &req.image)?;
    req.project = Some(project);
    Ok(req)
}

/// The image a create names, as the caller may see it: an image of a project it cannot
/// read does not exist for it (404, the same answer as a missing image, so names of other
/// projects' images don't leak). A reference that does not parse is left to the edge,
/// which says what is wrong with it.
pub fn check_read(p: &Principal, image: &str) -> ApiResult<()> {
    let Ok(r) = ImageRef::parse(image) else {
        return Ok(());
    };
    if p.may_read_images(&r.project()) {
        return Ok(());
    }
    Err(ApiError::not_found(format!(
        "image {r} not found; this key (project {}) can use images of its project, the projects inside it and its parents, e.g. root/base",
        p.project
    ))
    .into())
}

#[cfg_attr(feature = "openapi", utoipa::path(
    get,
    path = "/v1/whoami",
    summary = "The key's principal, kind and project",
    responses(
        (status = 200, description = "The key's principal, kind and project", body = Object),
        (status = 400, response = ErrorReply),
        (status = 403, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
))]
async fn whoami(Extension(p): Extension<Principal>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({"principal": p.name, "kind": p.kind, "key_id": p.key_id, "project": p.project}),
    )
}

#[cfg_attr(feature = "openapi", utoipa::path(
    get,
    path = "/v1/projects",
    summary = "Projects this key can see, with quota and usage",
    responses(
        (status = 200, description = "Projects this key can see, with quota and usage", body = Object),
        (status = 400, response = ErrorReply),
        (status = 403, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
))]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(as = ProjectRequest))]
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

#[cfg_attr(feature = "openapi", utoipa::path(
    post,
    path = "/v1/projects",
    summary = "Create a project: {project, quota}; the quota is delegated from the parent",
    request_body = ProjectBody,
    responses(
        (status = 201, description = "Create a project: {project, quota}; the quota is delegated from the parent", body = Object),
        (status = 400, response = ErrorReply),
        (status = 403, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
))]
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
        now_ms: crate::now_ms(),
    })
    .map_err(api_error)?;
    let mut r = view(iam.as_ref(), &p, &b.project)?;
    *r.status_mut() = StatusCode::CREATED;
    Ok(r)
}

#[cfg_attr(feature = "openapi", utoipa::path(
    post,
    path = "/v1/projects/quota",
    summary = "Set a project's quota: {project, quota} (a key of a parent project only)",
    request_body = ProjectBody,
    responses(
        (status = 200, description = "Set a project's quota: {project, quota} (a key of a parent project only)", body = Object),
        (status = 400, response = ErrorReply),
        (status = 403, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
))]
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

#[cfg_attr(feature = "openapi", utoipa::path(
    get,
    path = "/v1/keys",
    summary = "API keys of the projects this key can see (ids, never keys)",
    responses(
        (status = 200, description = "API keys of the projects this key can see (ids, never keys)", body = Object),
        (status = 400, response = ErrorReply),
        (status = 403, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
))]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(as = KeyRequest))]
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
    format: crate::KeyFormat,
}

fn human() -> PrincipalKind {
    PrincipalKind::Human
}

#[cfg_attr(feature = "openapi", utoipa::path(
    post,
    path = "/v1/keys",
    summary = "Create a key: {principal, project?, kind: human|agent, format?: dsec|e2b (e2b_ and 40 hex digits)}; the key is in the answer only",
    request_body = KeyBody,
    responses(
        (status = 201, description = "Create a key: {principal, project?, kind: human|agent, format?: dsec|e2b (e2b_ and 40 hex digits)}; the key is in the answer only", body = Object),
        (status = 400, response = ErrorReply),
        (status = 403, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
))]
async fn create_key(
    State(iam): State<Arc<dyn Iam>>,
    Extension(p): Extension<Principal>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let b: KeyBody = body(&bytes, "create key")?;
    let project = b.project.unwrap_or_else(|| p.project.clone());
    let (key, key_id) = crate::create_key_as(
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

#[cfg_attr(feature = "openapi", utoipa::path(
    delete,
    path = "/v1/keys/{key_id}",
    summary = "Revoke a key",
    params(
        ("key_id" = String, Path),
    ),
    responses(
        (status = 204, description = "Revoke a key", body = Object),
        (status = 400, response = ErrorReply),
        (status = 403, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
))]
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn key(project: &str) -> Principal {
        Principal {
            name: "k".into(),
            kind: PrincipalKind::Agent,
            key_id: "k".into(),
            project: project.into(),
        }
    }

    /// Fuzz target: any create body is parsed (or refused with a message) without a panic.
    #[test]
    fn fuzz_create_bodies() {
        let key = key("root/t1");
        bolero::check!()
            .with_iterations(2000)
            .for_each(|input: &[u8]| {
                let _ = create_request(&Bytes::copy_from_slice(input), &key);
            });
    }

    #[test]
    fn a_create_stays_in_the_keys_subtree_and_its_readable_images() {
        let k = key("root/t1");
        let ok = create_request(&Bytes::from_static(br#"{"image":"root/base"}"#), &k).unwrap();
        assert_eq!(ok.project.as_deref(), Some("root/t1"));
        for refused in [
            br#"{"image":"root/base","project":"root/t2"}"#.as_slice(),
            br#"{"image":"root/base","project":"root"}"#,
            br#"{"image":"root/t2/secret:v1"}"#,
        ] {
            let e = create_request(&Bytes::copy_from_slice(refused), &k).unwrap_err();
            assert_eq!(
                e.0.code,
                ErrorCode::NotFound,
                "{}",
                String::from_utf8_lossy(refused)
            );
        }
        let e = create_request(&Bytes::from_static(b"{"), &k).unwrap_err();
        assert_eq!(e.0.code, ErrorCode::InvalidArgument);
    }

    #[test]
    fn the_principal_header_round_trips_and_refuses_garbage() {
        let p = key("root/t1");
        let back = decode_principal(&encode_principal(&p)).unwrap();
        assert_eq!(back.project, "root/t1");
        assert!(decode_principal("not base64 !").is_none());
        assert!(decode_principal("e30").is_none(), "{{}} is not a principal");
    }

    #[test]
    fn only_apiservers_act_for_principals_and_the_watcher_only_reads_status() {
        use dsec_mtls::{Identity, Role};
        let id = |role| Identity::new(role, "n1").unwrap();
        let api = id(Role::Apiserver);
        assert!(may_forward(Some(&api), &Method::POST, "/v1/sandboxes"));
        let watcher = id(Role::Watcher);
        assert!(may_forward(Some(&watcher), &Method::GET, "/v1/status"));
        assert!(!may_forward(Some(&watcher), &Method::POST, "/v1/sandboxes"));
        assert!(!may_forward(Some(&watcher), &Method::GET, "/v1/sandboxes"));
        let edge = id(Role::Edge);
        assert!(!may_forward(Some(&edge), &Method::GET, "/v1/status"));
        assert!(!may_forward(
            Some(&edge),
            &Method::DELETE,
            "/v1/sandboxes/e1-x"
        ));
        assert!(!may_forward(None, &Method::GET, "/v1/status"));
    }

    #[test]
    fn status_shows_a_key_only_its_own_projects() {
        let mut node = dsec_common::api::NodeStatus::unreachable("e0");
        node.projects = BTreeMap::from([
            ("root".to_string(), 1),
            ("root/t1".to_string(), 2),
            ("root/t1/a".to_string(), 3),
            ("root/t2".to_string(), 4),
        ]);
        let s = ClusterStatus {
            version: "x".into(),
            nodes: vec![node],
        };
        let seen = status_for(&key("root/t1"), s.clone());
        let names: Vec<&String> = seen.nodes[0].projects.keys().collect();
        assert_eq!(names, ["root/t1", "root/t1/a"]);
        assert_eq!(status_for(&key("root"), s).nodes[0].projects.len(), 4);
    }
}
