//! Images belong to projects: a reference's namespace (`root/t1` in `root/t1/env:v1`) is
//! the project that owns it. A key reads images of its project subtree and of its
//! ancestors (so `root/…` base images are shared), and writes only inside its subtree
//! (see [`Principal::may_read_images`] and [`Principal::may_write_images`]). The checks
//! sit in the edge's router, which a cluster's apiservers forward to with the caller's
//! principal, so both paths enforce them.

use dsec_common::error::ErrorReply;
use dsec_common::http::ApiResult;
use dsec_common::{ApiError, ErrorCode};
use dsec_iam::Principal;
use dsec_iam::http::check_read;
use dsec_image::build::BuildSpec;
use dsec_image::credentials::Login;
use dsec_image::{ImageRef, store::ImageEntry};

/// A commit's (or any other write's) target: 403 naming where the key may write.
pub(crate) fn check_write(p: &Principal, image: &str) -> ApiResult<ImageRef> {
    let r = ImageRef::parse(image).map_err(|e| ApiError::invalid(e.to_string()))?;
    let project = r.project();
    if p.may_write_images(&project) {
        return Ok(r);
    }
    let name = r.repo.last().map(String::as_str).unwrap_or("name");
    Err(ApiError::new(
        ErrorCode::PermissionDenied,
        format!(
            "image {r} belongs to project {project}; this key (project {}) may create or replace images only in its own project and those inside it, e.g. {}/{name}:{}",
            p.project, p.project, r.tag
        ),
    )
    .into())
}

/// A build sent over the API: its image in the caller's subtree, its base one it may read,
/// and nothing that names a file of the node (`src`, `copy_from`: send `content`).
pub(crate) fn check_build(p: &Principal, spec: &BuildSpec) -> ApiResult<()> {
    spec.validate()
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    check_write(p, &spec.name)?;
    // A registry's image is pulled by the edge, which checks that the project may pull
    // from that registry.
    if let Some(from) = &spec.from
        && !dsec_image::pull::is_registry_reference(from)
    {
        check_read(p, from)?;
    }
    if let Some(i) = spec
        .steps
        .iter()
        .position(|s| s.src.is_some() || s.copy_from.is_some())
    {
        return Err(ApiError::invalid(format!(
            "step {}: `src` and `copy_from` name files of the machine that reads the spec; over the API send the file's `content` (`dsec image build` reads `src` files for you)",
            i + 1
        ))
        .into());
    }
    Ok(())
}

/// The images of a listing the caller may read. Of images it reads but does not own (its
/// parents'), a commit's source is withheld: it names a sandbox of another project.
pub(crate) fn visible(p: &Principal, mut list: Vec<ImageEntry>) -> Vec<ImageEntry> {
    list.retain(|i| ImageRef::parse(&i.reference).is_ok_and(|r| p.may_read_images(&r.project())));
    for i in &mut list {
        let owned = ImageRef::parse(&i.reference).is_ok_and(|r| p.may_write_images(&r.project()));
        if !owned && i.manifest.source.starts_with("commit") {
            i.manifest.source = "commit".into();
        }
    }
    list
}

#[cfg(test)]
mod tests {
    use dsec_iam::PrincipalKind;

    use super::*;

    fn key(project: &str) -> Principal {
        Principal {
            name: "eve".into(),
            kind: PrincipalKind::Agent,
            key_id: "k".into(),
            project: project.into(),
        }
    }

    #[test]
    fn a_tenant_cannot_replace_a_shared_image_and_is_told_where_it_may_write() {
        let e = check_write(&key("root/t1"), "root/py:3.11").unwrap_err().0;
        assert_eq!(e.code, ErrorCode::PermissionDenied);
        assert!(e.message.contains("root/t1/py:3.11"), "{}", e.message);
        assert_eq!(
            check_write(&key("root/t1"), "root/t1/env")
                .unwrap()
                .to_string(),
            "root/t1/env:latest"
        );
        assert_eq!(
            check_write(&key("root/t1"), "../x").unwrap_err().0.code,
            ErrorCode::InvalidArgument
        );
    }

    #[test]
    fn a_build_writes_only_the_callers_images_from_bases_it_reads() {
        let spec = |t: &str| BuildSpec::parse(t).unwrap();
        let eve = key("root/t1");
        let ok = spec("name = \"root/t1/env:1\"\nfrom = \"root/base\"\n[[step]]\nrun = \"true\"\n");
        assert!(check_build(&eve, &ok).is_ok());
        let over = spec("name = \"root/base\"\nfrom = \"root/base\"\n");
        assert_eq!(
            check_build(&eve, &over).unwrap_err().0.code,
            ErrorCode::PermissionDenied
        );
        let theirs = spec("name = \"root/t1/x\"\nfrom = \"root/t2/secret:1\"\n");
        assert_eq!(
            check_build(&eve, &theirs).unwrap_err().0.code,
            ErrorCode::NotFound
        );
        let host = spec(
            "name = \"root/t1/x\"\nfrom = \"root/base\"\n[[step]]\nfile = \"/s\"\ncopy_from = \"/etc\"\n",
        );
        let e = check_build(&eve, &host).unwrap_err().0;
        assert_eq!(e.code, ErrorCode::InvalidArgument);
        assert!(e.message.contains("copy_from"), "{}", e.message);
    }

    #[test]
    fn a_siblings_image_does_not_exist_for_a_tenant() {
        let e = check_read(&key("root/t1"), "root/t2/env:v1").unwrap_err().0;
        assert_eq!(e.code, ErrorCode::NotFound);
        assert!(check_read(&key("root/t1"), "root/py:3.11").is_ok());
        assert!(check_read(&key("root/t1"), "root/t1/x/env:v1").is_ok());
    }
}

/// What these routes serve, for the generated API description.
#[derive(utoipa::OpenApi)]
#[openapi(paths(
    remove_image,
    pull_image,
    push_image,
    list_logins,
    put_login,
    delete_login
))]
pub(crate) struct Doc;

/// `POST /v1/images:pull`'s body.
#[derive(serde::Deserialize, utoipa::ToSchema)]
#[schema(as = PullRequest)]
#[serde(deny_unknown_fields)]
pub(crate) struct PullBody {
    /// `[registry/]repository[:tag][@digest]`.
    reference: String,
    /// The image's name here (default: `<the key's project>/<the repository's last
    /// component>:<tag>`).
    #[serde(default, rename = "as")]
    target: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
    /// A bearer token the registry takes as it is.
    #[serde(default)]
    token: Option<String>,
    /// Plain HTTP (a registry on loopback): keys of `root` only.
    #[serde(default)]
    plain_http: bool,
    /// PEM certificates to trust for this registry: keys of `root` only.
    #[serde(default)]
    ca_pem: Option<String>,
    /// Start the image before it has arrived when the registry has its lazy layers
    /// (default true; false fetches the whole image now).
    #[serde(default)]
    lazy: Option<bool>,
}

/// Where a pulled image goes when the body names no target.
fn default_target(p: &Principal, r: &oci_client::Reference) -> Result<ImageRef, ApiError> {
    let name = r.repository().rsplit('/').next().unwrap_or("image");
    let tag = match (r.tag(), r.digest()) {
        (Some(t), _) => t.to_string(),
        (None, Some(d)) => d.trim_start_matches("sha256:").chars().take(12).collect(),
        (None, None) => "latest".to_string(),
    };
    let want = format!("{}/{name}:{tag}", p.project);
    ImageRef::parse(&want).map_err(|e| {
        ApiError::invalid(format!(
            "{e}; name the image with `as` (e.g. {}/myimage:v1)",
            p.project
        ))
    })
}

/// Whether the key may make the node fetch from `registry`: keys of `root` anywhere,
/// others only from the node's `pull_registries`.
fn check_registry(p: &Principal, registry: &str, edge: &dsec_edge::Edge) -> ApiResult<()> {
    if edge.may_pull_from(&p.project, registry) {
        return Ok(());
    }
    let allowed = edge.pull_registries();
    Err(ApiError::new(
        ErrorCode::PermissionDenied,
        format!(
            "registry {registry} is not one this node lets project {} pull from (it allows: {}); an administrator can add it to [edge] pull_registries",
            p.project,
            if allowed.is_empty() { "none".to_string() } else { allowed.join(", ") }
        ),
    )
    .into())
}

/// What a request gives to reach a registry, checked: the registry is one the key may
/// reach, `plain_http` and `ca_pem` come from a key of `root` only, and the credentials
/// are a username with a password, a token alone, or none.
struct Access {
    username: Option<String>,
    password: Option<String>,
    token: Option<String>,
    plain_http: bool,
    ca_pem: Option<String>,
}

impl Access {
    /// The [`PullRequest`](dsec_image::pull::PullRequest) for `reference` (parsed as `r`)
    /// to or from image `target` here. A request without credentials uses the login kept
    /// for `login_project` at that registry ([`dsec_image::credentials`]; for a pull also
    /// a parent's, `inherit`), and says whose it used.
    fn request(
        self,
        p: &Principal,
        edge: &dsec_edge::Edge,
        reference: String,
        r: &oci_client::Reference,
        target: ImageRef,
        (login_project, inherit): (&str, bool),
    ) -> ApiResult<(dsec_image::pull::PullRequest, Option<String>)> {
        use dsec_image::pull::{Credentials, PullLimits, PullRequest};
        check_registry(p, r.registry(), edge)?;
        if (self.plain_http || self.ca_pem.is_some()) && !p.is_admin() {
            return Err(ApiError::new(
                ErrorCode::PermissionDenied,
                "plain_http and ca_pem are for keys of the root project",
            )
            .into());
        }
        let credentials = match (self.username, self.password, self.token) {
            (Some(username), Some(password), None) => Credentials::Basic { username, password },
            (None, None, Some(t)) => Credentials::Token(t),
            (None, None, None) => Credentials::Anonymous,
            _ => {
                return Err(ApiError::invalid(
                    "give username and password together, or a token alone, or neither",
                )
                .into());
            }
        };
        let (credentials, kept) = match credentials {
            Credentials::Anonymous => match edge
                .registry_logins()
                .find(login_project, r.registry(), inherit)
                .map_err(|e| ApiError::internal(e.to_string()))?
            {
                Some((project, c)) => (c, Some(project)),
                None => (Credentials::Anonymous, None),
            },
            given => (given, None),
        };
        Ok((
            PullRequest {
                reference,
                target,
                credentials,
                plain_http: self.plain_http || edge.insecure_registry(r.registry()),
                ca_pem: self.ca_pem,
                limits: PullLimits::default(),
                login: kept.clone(),
                lazy: None,
            },
            kept,
        ))
    }
}

/// A pull's or push's error, naming the kept login it used when the registry refused it.
fn access_error(e: dsec_image::ImageError, kept: &Option<String>, registry: &str) -> ApiError {
    let mut err = pull_error(e);
    if let (Some(project), ErrorCode::PermissionDenied) = (kept, err.code) {
        err.message.push_str(&format!(
            " (with the login project {project} keeps for {registry}; replace it with `dsec image login {registry}`)"
        ));
    }
    err
}

/// `reference` as an OCI reference, or a 400 with an example.
fn parse_reference(reference: &str, example: &str) -> ApiResult<oci_client::Reference> {
    reference.parse().map_err(|e| {
        ApiError::invalid(format!(
            "{reference:?} is not an image reference ({e}); e.g. {example}"
        ))
        .into()
    })
}

pub(crate) fn pull_error(e: dsec_image::ImageError) -> ApiError {
    match &e {
        dsec_image::ImageError::Pull { kind, .. } => ApiError::new((*kind).into(), e.to_string()),
        _ => ApiError::internal(e.to_string()),
    }
}

/// `POST /v1/images:pull`: pulls an image from a registry into this node's store;
/// answers NDJSON, a `{"log": …}` line per step and a last line with the image or the
/// error.
#[utoipa::path(
    post,
    path = "/v1/images:pull",
    summary = "Pull an image from an OCI distribution registry into the node's store (index resolved to linux/amd64; manifest, config and every layer checked against its digest and declared size; gzip, zstd and plain tar layers; OCI whiteouts applied). Keys outside root pull only from the node's pull_registries; plain_http and ca_pem are for keys of root. The target must be in the key's project subtree.",
    request_body = PullBody,
    responses(
        (status = 200, description = "NDJSON: {\"log\": line} per step, then {\"image\", \"digest\", \"source_digest\", \"layers\", \"fetched_layers\", \"cached_layers\", \"fetched_bytes\", \"size_bytes\", \"lazy\"} or {\"error\": {\"code\", \"message\"}} (not_found: no such tag, digest or repository; permission_denied: the registry refused the credentials; failed_precondition: a digest or size that does not match, a manifest over the limits; unavailable: the registry cannot be reached)"),
        (status = 400, response = ErrorReply),
        (status = 403, response = ErrorReply),
    ),
)]
pub(crate) async fn pull_image(
    axum::extract::State(st): axum::extract::State<crate::AppState>,
    axum::extract::Extension(p): axum::extract::Extension<Principal>,
    bytes: axum::body::Bytes,
) -> ApiResult<axum::response::Response> {
    let b: PullBody = dsec_common::http::body(&bytes, "image pull")?;
    let r = parse_reference(&b.reference, "registry.example.com/team/python:3.11")?;
    let target = match &b.target {
        Some(t) => check_write(&p, t)?,
        None => {
            let t = default_target(&p, &r)?;
            check_write(&p, &t.to_string())?
        }
    };
    let access = Access {
        username: b.username,
        password: b.password,
        token: b.token,
        plain_http: b.plain_http,
        ca_pem: b.ca_pem,
    };
    let project = target.project();
    let (mut req, kept) =
        access.request(&p, &st.edge, b.reference, &r, target, (&project, true))?;
    if b.lazy != Some(false) {
        req.lazy = st.edge.lazy_mounter(&p.project, r.registry());
    }
    let registry = r.registry().to_string();
    let edge = st.edge.clone();
    Ok(crate::ndjson(move |tx| async move {
        let name = req.target.to_string();
        let mut log = move |l: String| {
            tracing::info!(image = %name, "pull: {l}");
            let _ = tx.send(l);
        };
        match edge.pull_image(&req, &mut log).await {
            Ok(done) => serde_json::json!({
                "image": req.target.to_string(),
                "digest": done.digest,
                "source_digest": done.source_digest,
                "layers": done.manifest.layers.len(),
                "fetched_layers": done.fetched,
                "cached_layers": done.cached,
                "fetched_bytes": done.fetched_bytes,
                "size_bytes": done.manifest.size_bytes,
                "lazy": done.lazy,
            }),
            Err(e) => {
                tracing::warn!(image = %req.target, "pull failed: {e}");
                serde_json::json!({ "error": access_error(e, &kept, &registry) })
            }
        }
    }))
}

/// `POST /v1/images:push`'s body.
#[derive(serde::Deserialize, utoipa::ToSchema)]
#[schema(as = PushRequest)]
#[serde(deny_unknown_fields)]
pub(crate) struct PushBody {
    /// The image here (`root/…`).
    image: String,
    /// Where to: `registry/repository:tag`.
    reference: String,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
    #[serde(default)]
    token: Option<String>,
    #[serde(default)]
    plain_http: bool,
    #[serde(default)]
    ca_pem: Option<String>,
    /// Push the layers as EROFS images too, so that nodes can start the image before it
    /// has arrived (default true).
    #[serde(default)]
    lazy: Option<bool>,
}

/// `POST /v1/images:push`: sends an image the key may read to a registry it may reach;
/// NDJSON as a pull answers.
#[utoipa::path(
    post,
    path = "/v1/images:push",
    summary = "Push an image of the node's store (one the key may read) to an OCI distribution registry (one the key may reach, as for pulls): its blobs the registry has not got, then its manifest.",
    request_body = PushBody,
    responses(
        (status = 200, description = "NDJSON: {\"log\": line} per step, then {\"image\", \"reference\", \"digest\", \"pushed_blobs\", \"skipped_blobs\", \"pushed_bytes\", \"lazy_digest\"} or {\"error\": {\"code\", \"message\"}}"),
        (status = 400, response = ErrorReply),
        (status = 403, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
pub(crate) async fn push_image(
    axum::extract::State(st): axum::extract::State<crate::AppState>,
    axum::extract::Extension(p): axum::extract::Extension<Principal>,
    bytes: axum::body::Bytes,
) -> ApiResult<axum::response::Response> {
    let b: PushBody = dsec_common::http::body(&bytes, "image push")?;
    check_read(&p, &b.image)?;
    let image = ImageRef::parse(&b.image).map_err(|e| ApiError::invalid(e.to_string()))?;
    let r = parse_reference(&b.reference, "registry.example.com/team/env:v1")?;
    let access = Access {
        username: b.username,
        password: b.password,
        token: b.token,
        plain_http: b.plain_http,
        ca_pem: b.ca_pem,
    };
    let (how, kept) = access.request(
        &p,
        &st.edge,
        b.reference,
        &r,
        image.clone(),
        (&p.project, false),
    )?;
    let registry = r.registry().to_string();
    let store = st.edge.images().clone();
    Ok(crate::ndjson(move |tx| async move {
        let name = image.to_string();
        let mut log = move |l: String| {
            tracing::info!(image = %name, "push: {l}");
            let _ = tx.send(l);
        };
        let dest = how.reference.clone();
        let lazy = b.lazy != Some(false);
        match dsec_image::push::push(&store, &image, &dest, &how, lazy, &mut log).await {
            Ok(done) => serde_json::json!({
                "image": image.to_string(),
                "reference": dest,
                "digest": done.digest,
                "pushed_blobs": done.pushed_blobs,
                "skipped_blobs": done.skipped_blobs,
                "pushed_bytes": done.pushed_bytes,
                "lazy_digest": done.lazy_digest,
            }),
            Err(dsec_image::ImageError::NotFound(n)) => serde_json::json!({
                "error": ApiError::not_found(format!("image {n} not found"))
            }),
            Err(e) => {
                tracing::warn!(image = %image, "push failed: {e}");
                serde_json::json!({ "error": access_error(e, &kept, &registry) })
            }
        }
    }))
}

/// `PUT /v1/registries/{registry}/login`'s body.
#[derive(serde::Deserialize, utoipa::ToSchema)]
#[schema(as = RegistryLoginRequest)]
#[serde(deny_unknown_fields)]
pub(crate) struct LoginBody {
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
    #[serde(default)]
    token: Option<String>,
    /// Whose login it is (default: the key's project); one the key may write images of.
    #[serde(default)]
    project: Option<String>,
}

#[derive(serde::Deserialize)]
pub(crate) struct LoginQuery {
    #[serde(default)]
    project: Option<String>,
}

/// The project a login call names (default the key's): 403 unless the key may write
/// that project's images.
fn login_project(p: &Principal, project: Option<String>) -> ApiResult<String> {
    let project = project.unwrap_or_else(|| p.project.clone());
    let well_formed = project.len() <= 255
        && project.split('/').all(|seg| {
            !seg.is_empty()
                && seg != "."
                && seg != ".."
                && seg
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        });
    if !well_formed || !p.may_write_images(&project) {
        return Err(ApiError::new(
            ErrorCode::PermissionDenied,
            format!(
                "this key (project {}) keeps registry logins for its own project and those inside it, not {project:?}",
                p.project
            ),
        )
        .into());
    }
    Ok(project)
}

fn login_error(e: dsec_image::ImageError) -> ApiError {
    pull_error(e)
}

/// `PUT /v1/registries/{registry}/login`: keeps a registry login for the project (sealed
/// on the node); answers what is kept, never the secret.
#[utoipa::path(
    put,
    path = "/v1/registries/{registry}/login",
    summary = "Keep a login for a registry for a project (default: the key's; one the key may write images of), sealed on the node (AES-256-GCM under the node's key). Pulls, pushes and builds FROM the registry that give no credentials use it; a project's login also serves the pulls of the projects inside it, a push uses the pushing project's own only.",
    params(
        ("registry" = String, Path, description = "host[:port], e.g. registry.example.com or 127.0.0.1:5000 (Docker Hub's other names are docker.io)"),
    ),
    request_body = LoginBody,
    responses(
        (status = 200, description = "What is kept (never the secret)", body = Login),
        (status = 400, response = ErrorReply),
        (status = 403, response = ErrorReply),
    ),
)]
pub(crate) async fn put_login(
    axum::extract::State(st): axum::extract::State<crate::AppState>,
    axum::extract::Extension(p): axum::extract::Extension<Principal>,
    axum::extract::Path(registry): axum::extract::Path<String>,
    bytes: axum::body::Bytes,
) -> ApiResult<axum::response::Response> {
    use dsec_image::pull::Credentials;
    let b: LoginBody = dsec_common::http::body(&bytes, "registry login")?;
    let project = login_project(&p, b.project)?;
    let login = match (b.username, b.password, b.token) {
        (Some(username), Some(password), None) => Credentials::Basic { username, password },
        (None, None, Some(t)) => Credentials::Token(t),
        _ => {
            return Err(ApiError::invalid(
                "give a username and a password together, or a token alone",
            )
            .into());
        }
    };
    let book = st.edge.registry_logins();
    let kept = tokio::task::spawn_blocking(move || book.set(&project, &registry, &login))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(login_error)?;
    tracing::info!(project = %kept.project, registry = %kept.registry, by = %p.name, "registry login kept");
    Ok(dsec_common::http::json(axum::http::StatusCode::OK, &kept))
}

/// `DELETE /v1/registries/{registry}/login[?project=]`: forgets the project's login.
#[utoipa::path(
    delete,
    path = "/v1/registries/{registry}/login",
    summary = "Forget a project's login for a registry.",
    params(
        ("registry" = String, Path, description = "host[:port], e.g. registry.example.com or 127.0.0.1:5000 (Docker Hub's other names are docker.io)"),
        ("project" = Option<String>, Query, description = "Whose login (default: the key's project)"),
    ),
    responses(
        (status = 200, description = "{\"project\", \"registry\", \"removed\": true}"),
        (status = 403, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
pub(crate) async fn delete_login(
    axum::extract::State(st): axum::extract::State<crate::AppState>,
    axum::extract::Extension(p): axum::extract::Extension<Principal>,
    axum::extract::Path(registry): axum::extract::Path<String>,
    axum::extract::Query(q): axum::extract::Query<LoginQuery>,
) -> ApiResult<axum::response::Response> {
    let project = login_project(&p, q.project)?;
    let book = st.edge.registry_logins();
    let (pj, rg) = (project.clone(), registry.clone());
    let gone = tokio::task::spawn_blocking(move || book.remove(&pj, &rg))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(login_error)?;
    if !gone {
        return Err(ApiError::not_found(format!(
            "project {project} keeps no login for registry {registry}"
        ))
        .into());
    }
    Ok(dsec_common::http::json(
        axum::http::StatusCode::OK,
        &serde_json::json!({"project": project, "registry": registry, "removed": true}),
    ))
}

/// `GET /v1/registries`: the logins kept for the key's project and those inside it.
#[utoipa::path(
    get,
    path = "/v1/registries",
    summary = "The registry logins kept for the key's project and the projects inside it; never their secrets.",
    responses(
        (status = 200, description = "the logins", body = LoginList),
    ),
)]
pub(crate) async fn list_logins(
    axum::extract::State(st): axum::extract::State<crate::AppState>,
    axum::extract::Extension(p): axum::extract::Extension<Principal>,
) -> ApiResult<axum::response::Response> {
    let book = st.edge.registry_logins();
    let logins = tokio::task::spawn_blocking(move || book.list(|pj| p.may_write_images(pj)))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(login_error)?;
    Ok(dsec_common::http::json(
        axum::http::StatusCode::OK,
        &LoginList { logins },
    ))
}

/// `GET /v1/registries`'s answer.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[schema(as = RegistryLoginList)]
pub(crate) struct LoginList {
    logins: Vec<Login>,
}

/// `DELETE /v1/images/{reference}` (the reference percent-encoded, `root%2Fenv:v1`):
/// removes an image of the key's subtree, the layers nothing else uses (no image,
/// sandbox or snapshot), and the disk it held in its project's quota.
#[utoipa::path(
    delete,
    path = "/v1/images/{reference}",
    summary = "Remove an image of the key's subtree and the layers nothing else uses (no other image, sandbox or snapshot); the disk its commit, build or pull held in its project's quota is given back.",
    params(
        ("reference" = String, Path, description = "The image, percent-encoded as one segment: root%2Fteam%2Fenv:v1"),
    ),
    responses(
        (status = 200, description = "{\"image\", \"removed\": true, \"freed_layers\"}"),
        (status = 400, response = ErrorReply),
        (status = 403, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
pub(crate) async fn remove_image(
    axum::extract::State(st): axum::extract::State<crate::AppState>,
    axum::extract::Extension(p): axum::extract::Extension<Principal>,
    axum::extract::Path(reference): axum::extract::Path<String>,
) -> ApiResult<axum::response::Response> {
    check_read(&p, &reference)?;
    let r = check_write(&p, &reference)?;
    if !st.edge.images().exists(&r) {
        return Err(ApiError::not_found(format!("image {r} not found")).into());
    }
    let freed = st.edge.remove_image(&r).await?;
    Ok(dsec_common::http::json(
        axum::http::StatusCode::OK,
        &serde_json::json!({"image": r.to_string(), "removed": true, "freed_layers": freed}),
    ))
}
