//! REST routes of the runtime API (docs/RUNTIME_API.md): processes, files, watches,
//! sessions and trajectories. Streams are NDJSON; file bodies stream in both directions in
//! bounded memory.

use crate::openapi::{Binary, SandboxPath, StepHeaders};
use dsec_common::api::{FileStat, SessionInfo, SessionResult};
use dsec_common::error::ErrorReply;
use std::collections::BTreeMap;
use std::convert::Infallible;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine;
use dsec_common::ApiError;
use dsec_common::api::StringMap;
use dsec_common::api::{ExecRequest, SessionCreateRequest, SessionRunRequest};
use dsec_common::channel::{PtySize, Request};
use dsec_common::http::{ApiResult, Failure, body, json as json_response, query_pairs};
use dsec_edge::runtime::{ProcEvent, ProcessStream};
use dsec_edge::trajectory::{Outcome, StepRef};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::{AppState, route};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/sandboxes/{id}/processes", get(processes))
        .route("/v1/sandboxes/{id}/processes/{pid}/output", get(attach))
        .route(
            "/v1/sandboxes/{id}/processes/{pid}/stdin",
            post(stdin).layer(DefaultBodyLimit::disable()),
        )
        .route("/v1/sandboxes/{id}/processes/{pid}/signal", post(signal))
        .route("/v1/sandboxes/{id}/processes/{pid}/resize", post(resize))
        .route(
            "/v1/sandboxes/{id}/files",
            get(download).put(upload).layer(DefaultBodyLimit::disable()),
        )
        .route("/v1/sandboxes/{id}/files/batch", post(batch))
        .route("/v1/sandboxes/{id}/files/stat", get(stat))
        .route("/v1/sandboxes/{id}/files/list", get(list))
        .route("/v1/sandboxes/{id}/files/exists", get(exists))
        .route("/v1/sandboxes/{id}/files/watch", get(watch))
        .route("/v1/sandboxes/{id}/files/mkdir", post(mkdir))
        .route("/v1/sandboxes/{id}/files/remove", post(remove))
        .route("/v1/sandboxes/{id}/files/rename", post(rename))
        .route("/v1/sandboxes/{id}/files/chmod", post(chmod))
        .route("/v1/sandboxes/{id}/files/chown", post(chown))
        .route(
            "/v1/sandboxes/{id}/sessions",
            post(session_create).get(sessions),
        )
        .route(
            "/v1/sandboxes/{id}/sessions/{sid}",
            axum::routing::delete(session_kill),
        )
        .route("/v1/sandboxes/{id}/sessions/{sid}/run", post(session_run))
        .route(
            "/v1/sandboxes/{id}/sessions/{sid}/commands/{cid}",
            get(session_command),
        )
        .route("/v1/sandboxes/{id}/trajectories", get(trajectories))
        .route("/v1/sandboxes/{id}/trajectories/{name}", get(trajectory))
}

/// What these routes serve, for the generated API description.
#[derive(utoipa::OpenApi)]
#[openapi(paths(
    processes,
    attach,
    stdin,
    signal,
    resize,
    download,
    upload,
    batch,
    stat,
    exists,
    list,
    watch,
    mkdir,
    remove,
    rename,
    chmod,
    chown,
    session_create,
    sessions,
    session_kill,
    session_run,
    session_command,
    trajectories,
    trajectory
))]
pub(crate) struct Doc;

/// The trajectory step a call is, from `X-Dsec-Trajectory` and `X-Dsec-Step`.
pub fn step_ref(h: &HeaderMap) -> Result<Option<StepRef>, Failure> {
    let get = |k: &str| h.get(k).and_then(|v| v.to_str().ok());
    Ok(StepRef::parse(
        get("x-dsec-trajectory"),
        get("x-dsec-step"),
    )?)
}

/// A step's result as a response, marked when it came from the log.
pub fn outcome(status: StatusCode, o: Outcome) -> Response {
    let mut r = json_response(status, &o.value);
    if o.replayed {
        r.headers_mut()
            .insert("x-dsec-replayed", HeaderValue::from_static("true"));
    }
    r
}

pub(crate) fn query(q: Option<&str>) -> BTreeMap<String, String> {
    query_pairs(q.unwrap_or("")).into_iter().collect()
}

pub(crate) fn required(q: &BTreeMap<String, String>, k: &str) -> Result<String, Failure> {
    q.get(k).cloned().ok_or_else(|| {
        ApiError::invalid(format!(
            "the query parameter {k} is required (e.g. ?{k}=/root/file)"
        ))
        .into()
    })
}

pub(crate) fn flag(q: &BTreeMap<String, String>, k: &str) -> Result<bool, Failure> {
    match q.get(k).map(String::as_str) {
        None | Some("false") | Some("0") => Ok(false),
        Some("true") | Some("1") | Some("") => Ok(true),
        Some(v) => Err(ApiError::invalid(format!("{k} must be true or false (got {v:?})")).into()),
    }
}

fn ndjson(body: Body) -> Response {
    (
        [
            (header::CONTENT_TYPE, "application/x-ndjson"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

fn line(v: Value) -> Bytes {
    let mut b = serde_json::to_vec(&v).unwrap_or_default();
    b.push(b'\n');
    Bytes::from(b)
}

fn event_line(ev: ProcEvent) -> Bytes {
    let b64 = |d: &[u8]| base64::engine::general_purpose::STANDARD.encode(d);
    line(match ev {
        ProcEvent::Stdout(d) => json!({"type": "stdout", "data": b64(&d)}),
        ProcEvent::Stderr(d) => json!({"type": "stderr", "data": b64(&d)}),
        ProcEvent::Exit(r) => {
            let mut v = serde_json::to_value(&r).unwrap_or_default();
            if let Some(o) = v.as_object_mut() {
                o.remove("stdout");
                o.remove("stderr");
                o.insert("type".into(), json!("exit"));
            }
            v
        }
        ProcEvent::Error(e) => json!({"type": "error", "code": e.code, "message": e.message}),
    })
}

/// A process's events as an NDJSON body, starting with `start`.
fn process_body(ps: ProcessStream) -> Response {
    let start = line(json!({"type": "start", "pid": ps.pid}));
    let s = futures_util::stream::unfold((ps, Some(start)), |(mut ps, first)| async move {
        if let Some(f) = first {
            return Some((Ok::<Bytes, Infallible>(f), (ps, None)));
        }
        let ev = ps.next().await?;
        Some((Ok(event_line(ev)), (ps, None)))
    });
    ndjson(Body::from_stream(s))
}

/// `POST /exec`: one result, a stream, or a background process.
pub async fn exec(
    st: &AppState,
    id: &str,
    headers: &HeaderMap,
    req: ExecRequest,
) -> ApiResult<Response> {
    let step = step_ref(headers)?;
    if req.stream {
        if step.as_ref().is_some_and(|s| s.seq.is_some()) {
            return Err(ApiError::invalid(
                "a streamed exec cannot be a trajectory step; use a plain exec or background",
            )
            .into());
        }
        return Ok(process_body(st.edge.exec_stream(id, req).await?));
    }
    if req.background {
        let o = st.edge.exec_background(id, req, step).await?;
        return Ok(outcome(StatusCode::CREATED, o));
    }
    Ok(outcome(
        StatusCode::OK,
        st.edge.exec_step(id, req, step).await?,
    ))
}

fn pid_of(s: &str) -> Result<u32, Failure> {
    s.parse()
        .map_err(|_| ApiError::invalid(format!("process id {s:?} is not a number")).into())
}

#[utoipa::path(
    get,
    path = "/v1/sandboxes/{id}/processes",
    summary = "List managed processes",
    params(
        SandboxPath,
    ),
    responses(
        (status = 200, description = "List managed processes", body = Object),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn processes(State(st): State<AppState>, Path(id): Path<String>) -> ApiResult<Response> {
    route(&st, &id)?;
    let p = st.edge.processes(&id).await?;
    Ok(json_response(StatusCode::OK, &json!({ "processes": p })))
}

#[utoipa::path(
    get,
    path = "/v1/sandboxes/{id}/processes/{pid}/output",
    summary = "Attach: kept output, then live output, then exit (NDJSON)",
    params(
        SandboxPath,
        ("pid" = String, Path),
    ),
    responses(
        (status = 200, description = "Attach: kept output, then live output, then exit (NDJSON)", body = String, content_type = "application/x-ndjson"),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn attach(
    State(st): State<AppState>,
    Path((id, pid)): Path<(String, String)>,
) -> ApiResult<Response> {
    route(&st, &id)?;
    Ok(process_body(st.edge.attach(&id, pid_of(&pid)?).await?))
}

#[utoipa::path(
    post,
    path = "/v1/sandboxes/{id}/processes/{pid}/stdin",
    summary = "Write to stdin (close=true closes it)",
    params(
        SandboxPath,
        ("pid" = String, Path),
        ("close" = Option<bool>, Query),
    ),
    request_body(content = inline(Binary), content_type = "application/octet-stream"),
    responses(
        (status = 204, description = "Write to stdin (close=true closes it)"),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn stdin(
    State(st): State<AppState>,
    Path((id, pid)): Path<(String, String)>,
    RawQuery(q): RawQuery,
    b: Body,
) -> ApiResult<Response> {
    route(&st, &id)?;
    let close = flag(&query(q.as_deref()), "close")?;
    st.edge
        .write_stdin(&id, pid_of(&pid)?, close, b.into_data_stream())
        .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Deserialize, utoipa::ToSchema)]
#[schema(as = Signal)]
#[serde(untagged)]
enum SignalSpec {
    Number(i32),
    Name(String),
}

#[derive(Deserialize, utoipa::ToSchema)]
#[schema(as = SignalRequest)]
#[serde(deny_unknown_fields)]
struct SignalBody {
    signal: SignalSpec,
}

fn signal_number(s: &SignalSpec) -> Result<i32, Failure> {
    match s {
        SignalSpec::Number(n) => Ok(*n),
        SignalSpec::Name(n) => {
            let n = n.trim().to_ascii_uppercase();
            let n = n.strip_prefix("SIG").unwrap_or(&n);
            Ok(match n {
                "HUP" => libc::SIGHUP,
                "INT" => libc::SIGINT,
                "QUIT" => libc::SIGQUIT,
                "KILL" => libc::SIGKILL,
                "USR1" => libc::SIGUSR1,
                "USR2" => libc::SIGUSR2,
                "TERM" => libc::SIGTERM,
                "CONT" => libc::SIGCONT,
                "STOP" => libc::SIGSTOP,
                "TSTP" => libc::SIGTSTP,
                "WINCH" => libc::SIGWINCH,
                other => {
                    return Err(ApiError::invalid(format!(
                        "unknown signal {other:?}; use a number or one of HUP, INT, QUIT, KILL, USR1, USR2, TERM, CONT, STOP, TSTP, WINCH"
                    ))
                    .into());
                }
            })
        }
    }
}

#[utoipa::path(
    post,
    path = "/v1/sandboxes/{id}/processes/{pid}/signal",
    summary = "Signal the process group",
    params(
        SandboxPath,
        ("pid" = String, Path),
    ),
    request_body = SignalBody,
    responses(
        (status = 204, description = "Signal the process group"),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn signal(
    State(st): State<AppState>,
    Path((id, pid)): Path<(String, String)>,
    bytes: Bytes,
) -> ApiResult<Response> {
    route(&st, &id)?;
    let b: SignalBody = body(&bytes, "signal")?;
    st.edge
        .signal(&id, pid_of(&pid)?, signal_number(&b.signal)?)
        .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[utoipa::path(
    post,
    path = "/v1/sandboxes/{id}/processes/{pid}/resize",
    summary = "Resize the terminal",
    params(
        SandboxPath,
        ("pid" = String, Path),
    ),
    request_body = PtySize,
    responses(
        (status = 204, description = "Resize the terminal"),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn resize(
    State(st): State<AppState>,
    Path((id, pid)): Path<(String, String)>,
    bytes: Bytes,
) -> ApiResult<Response> {
    route(&st, &id)?;
    let size: PtySize = body(&bytes, "resize")?;
    st.edge.resize(&id, pid_of(&pid)?, size).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[utoipa::path(
    get,
    path = "/v1/sandboxes/{id}/files",
    summary = "Download a file (streamed)",
    params(
        SandboxPath,
        ("path" = String, Query),
    ),
    responses(
        (status = 200, description = "Download a file (streamed)", body = inline(Binary), content_type = "application/octet-stream"),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn download(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    route(&st, &id)?;
    let path = required(&query(q.as_deref()), "path")?;
    let fr = st.edge.read_file(&id, &path).await?;
    let size = fr.size;
    let s = futures_util::stream::unfold(fr, |mut fr| async move {
        let c = fr.chunk().await?;
        Some((c.map_err(|e| std::io::Error::other(e.message)), fr))
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

pub(crate) fn parse_mode(v: Option<&String>) -> Result<Option<u32>, Failure> {
    v.map(|m| {
        u32::from_str_radix(m.trim_start_matches("0o"), 8)
            .ok()
            .filter(|m| *m <= 0o7777)
            .ok_or_else(|| {
                ApiError::invalid(format!(
                    "mode must be octal permission bits like 644 (got {m:?})"
                ))
                .into()
            })
    })
    .transpose()
}

#[utoipa::path(
    put,
    path = "/v1/sandboxes/{id}/files",
    summary = "Upload a file (streamed; parents created)",
    params(
        SandboxPath,
        ("path" = String, Query),
        ("mode" = Option<String>, Query),
        ("append" = Option<bool>, Query),
        ("user" = Option<String>, Query, description = "Write as this user (a name from the sandbox's /etc/passwd or a uid): what the write makes is theirs, and it writes only where they may. Default root."),
        StepHeaders,
    ),
    request_body(content = inline(Binary), content_type = "application/octet-stream"),
    responses(
        (status = 200, description = "Upload a file (streamed; parents created)", body = Object),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn upload(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
    headers: HeaderMap,
    b: Body,
) -> ApiResult<Response> {
    route(&st, &id)?;
    let q = query(q.as_deref());
    let path = required(&q, "path")?;
    let mode = parse_mode(q.get("mode"))?;
    let append = flag(&q, "append")?;
    let step = step_ref(&headers)?;
    let how = dsec_edge::runtime::WriteOptions {
        mode,
        append,
        user: q.get("user").cloned(),
        metadata: metadata_headers(&headers)?,
    };
    let o = st
        .edge
        .write_file(&id, &path, how, b.into_data_stream(), step)
        .await?;
    Ok(outcome(StatusCode::OK, o))
}

/// Header prefix of a file's metadata on an upload: `X-Dsec-Metadata-<key>: <value>`.
const METADATA_HEADER: &str = "x-dsec-metadata-";

/// The metadata an upload gives its file (None: no such header).
fn metadata_headers(h: &HeaderMap) -> Result<Option<StringMap>, Failure> {
    let mut m = BTreeMap::new();
    for (name, value) in h {
        // Header names arrive in lower case.
        if let Some(key) = name.as_str().strip_prefix(METADATA_HEADER) {
            let v = value.to_str().map_err(|_| {
                ApiError::invalid(format!(
                    "the value of metadata key {key:?} must be printable US-ASCII"
                ))
            })?;
            m.insert(key.to_string(), v.to_string());
        }
    }
    Ok((!m.is_empty()).then_some(m))
}

#[derive(Deserialize, utoipa::ToSchema)]
#[schema(as = FileBatchEntry)]
#[serde(deny_unknown_fields)]
struct BatchFile {
    path: String,
    data: String,
    #[serde(default)]
    mode: Option<u32>,
    /// The file's metadata.
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize, utoipa::ToSchema)]
#[schema(as = FileBatch)]
#[serde(deny_unknown_fields)]
struct Batch {
    files: Vec<BatchFile>,
    /// Write every file as this user (default root).
    #[serde(default)]
    user: Option<String>,
}

#[utoipa::path(
    post,
    path = "/v1/sandboxes/{id}/files/batch",
    summary = "Write many files: {files:[{path,data(base64),mode}], user?} (as user when given)",
    params(
        SandboxPath,
    ),
    request_body = Batch,
    responses(
        (status = 200, description = "Write many files: {files:[{path,data(base64),mode}], user?} (as user when given)", body = Object),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn batch(
    State(st): State<AppState>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    route(&st, &id)?;
    let b: Batch = body(&bytes, "batch upload")?;
    if b.files.len() > 10_000 {
        return Err(ApiError::invalid("a batch may hold at most 10000 files").into());
    }
    let mut decoded = Vec::with_capacity(b.files.len());
    for f in b.files {
        let data = base64::engine::general_purpose::STANDARD
            .decode(f.data.as_bytes())
            .map_err(|e| ApiError::invalid(format!("data of {} is not base64: {e}", f.path)))?;
        decoded.push((f.path, f.mode, f.metadata, data));
    }
    let mut written = Vec::new();
    for (path, mode, metadata, data) in decoded {
        let one = futures_util::stream::iter([Ok::<Bytes, Infallible>(Bytes::from(data))]);
        let how = dsec_edge::runtime::WriteOptions {
            mode,
            append: false,
            user: b.user.clone(),
            metadata,
        };
        let o = st.edge.write_file(&id, &path, how, one, None).await?;
        written.push(o.value);
    }
    Ok(json_response(
        StatusCode::OK,
        &json!({ "written": written }),
    ))
}

async fn file_query(st: &AppState, id: &str, req: Request) -> ApiResult<Response> {
    route(st, id)?;
    Ok(json_response(
        StatusCode::OK,
        &st.edge.file_query(id, req).await?,
    ))
}

#[utoipa::path(
    get,
    path = "/v1/sandboxes/{id}/files/stat",
    summary = "Stat a path",
    params(
        SandboxPath,
        ("path" = String, Query),
    ),
    responses(
        (status = 200, description = "Stat a path", body = FileStat),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn stat(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let path = required(&query(q.as_deref()), "path")?;
    file_query(&st, &id, Request::Stat { path }).await
}

#[utoipa::path(
    get,
    path = "/v1/sandboxes/{id}/files/list",
    summary = "List a directory",
    params(
        SandboxPath,
        ("path" = String, Query),
        ("depth" = Option<u64>, Query),
    ),
    responses(
        (status = 200, description = "List a directory", body = Object),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn list(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let q = query(q.as_deref());
    let path = required(&q, "path")?;
    let depth = match q.get("depth") {
        None => 1,
        Some(d) => d
            .parse::<u32>()
            .ok()
            .filter(|d| (1..=64).contains(d))
            .ok_or_else(|| ApiError::invalid(format!("depth must be from 1 to 64 (got {d:?})")))?,
    };
    file_query(&st, &id, Request::List { path, depth }).await
}

#[utoipa::path(
    get,
    path = "/v1/sandboxes/{id}/files/exists",
    summary = "Whether a path exists",
    params(
        SandboxPath,
        ("path" = String, Query),
    ),
    responses(
        (status = 200, description = "Whether a path exists", body = Object),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn exists(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let path = required(&query(q.as_deref()), "path")?;
    file_query(&st, &id, Request::Exists { path }).await
}

#[derive(Deserialize, utoipa::ToSchema)]
#[schema(as = FilePathRequest)]
#[serde(deny_unknown_fields)]
struct PathBody {
    path: String,
    #[serde(default)]
    recursive: bool,
    /// mkdir: make the directories as this user (default root).
    #[serde(default)]
    user: Option<String>,
}

#[derive(Deserialize, utoipa::ToSchema)]
#[schema(as = FileRenameRequest)]
#[serde(deny_unknown_fields)]
struct RenameBody {
    from: String,
    to: String,
}

#[derive(Deserialize, utoipa::ToSchema)]
#[schema(as = FileChmodRequest)]
#[serde(deny_unknown_fields)]
struct ChmodBody {
    path: String,
    mode: u32,
}

#[derive(Deserialize, utoipa::ToSchema)]
#[schema(as = FileChownRequest)]
#[serde(deny_unknown_fields)]
struct ChownBody {
    path: String,
    uid: u32,
    gid: u32,
}

/// The file operations (`files/mkdir`, `remove`, `rename`, `chmod`, `chown`): one handler
/// each, so that the router and the API description name the same paths, all parsing
/// their body and running here.
async fn file_op<B: serde::de::DeserializeOwned>(
    st: &AppState,
    id: &str,
    headers: &HeaderMap,
    bytes: &Bytes,
    what: &str,
    make: impl FnOnce(B) -> Request,
) -> ApiResult<Response> {
    route(st, id)?;
    let req = make(body(bytes, what)?);
    let removed = matches!(req, Request::Remove { .. });
    let o = st.edge.file_op(id, req, step_ref(headers)?).await?;
    if removed && !o.replayed {
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    Ok(outcome(StatusCode::OK, o))
}

#[utoipa::path(
    post,
    path = "/v1/sandboxes/{id}/files/mkdir",
    summary = "mkdir -p: {path, user?} (as user when given: the directories made are theirs)",
    params(
        SandboxPath,
        StepHeaders,
    ),
    request_body = PathBody,
    responses(
        (status = 200, description = "mkdir -p: {path, user?} (as user when given: the directories made are theirs)", body = FileStat),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn mkdir(
    State(st): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    bytes: Bytes,
) -> ApiResult<Response> {
    file_op(&st, &id, &headers, &bytes, "files/mkdir", |b: PathBody| {
        Request::Mkdir {
            path: b.path,
            user: b.user,
        }
    })
    .await
}

#[utoipa::path(
    post,
    path = "/v1/sandboxes/{id}/files/remove",
    summary = "Remove: {path, recursive}",
    params(
        SandboxPath,
        StepHeaders,
    ),
    request_body = PathBody,
    responses(
        (status = 204, description = "removed"),
        (status = 200, description = "a trajectory step replayed: its recorded result", body = Object),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn remove(
    State(st): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    bytes: Bytes,
) -> ApiResult<Response> {
    file_op(&st, &id, &headers, &bytes, "files/remove", |b: PathBody| {
        Request::Remove {
            path: b.path,
            recursive: b.recursive,
        }
    })
    .await
}

#[utoipa::path(
    post,
    path = "/v1/sandboxes/{id}/files/rename",
    summary = "Rename: {from, to}",
    params(
        SandboxPath,
        StepHeaders,
    ),
    request_body = RenameBody,
    responses(
        (status = 200, description = "Rename: {from, to}", body = FileStat),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn rename(
    State(st): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    bytes: Bytes,
) -> ApiResult<Response> {
    file_op(
        &st,
        &id,
        &headers,
        &bytes,
        "files/rename",
        |b: RenameBody| Request::Rename {
            from: b.from,
            to: b.to,
        },
    )
    .await
}

#[utoipa::path(
    post,
    path = "/v1/sandboxes/{id}/files/chmod",
    summary = "chmod: {path, mode}",
    params(
        SandboxPath,
        StepHeaders,
    ),
    request_body = ChmodBody,
    responses(
        (status = 200, description = "chmod: {path, mode}", body = FileStat),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn chmod(
    State(st): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    bytes: Bytes,
) -> ApiResult<Response> {
    file_op(&st, &id, &headers, &bytes, "files/chmod", |b: ChmodBody| {
        Request::Chmod {
            path: b.path,
            mode: b.mode,
        }
    })
    .await
}

#[utoipa::path(
    post,
    path = "/v1/sandboxes/{id}/files/chown",
    summary = "chown: {path, uid, gid}",
    params(
        SandboxPath,
        StepHeaders,
    ),
    request_body = ChownBody,
    responses(
        (status = 200, description = "chown: {path, uid, gid}", body = FileStat),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn chown(
    State(st): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    bytes: Bytes,
) -> ApiResult<Response> {
    file_op(&st, &id, &headers, &bytes, "files/chown", |b: ChownBody| {
        Request::Chown {
            path: b.path,
            uid: b.uid,
            gid: b.gid,
        }
    })
    .await
}

#[utoipa::path(
    get,
    path = "/v1/sandboxes/{id}/files/watch",
    summary = "Watch a directory (NDJSON: ready, then create/write/remove/rename/chmod)",
    params(
        SandboxPath,
        ("path" = String, Query),
        ("recursive" = Option<bool>, Query),
    ),
    responses(
        (status = 200, description = "Watch a directory (NDJSON: ready, then create/write/remove/rename/chmod)", body = String, content_type = "application/x-ndjson"),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn watch(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    route(&st, &id)?;
    let q = query(q.as_deref());
    let path = required(&q, "path")?;
    let recursive = flag(&q, "recursive")?;
    let entry = flag(&q, "entry")?;
    let network = flag(&q, "allow_network_mounts")?;
    let ws = st.edge.watch(&id, &path, recursive, entry, network).await?;
    let ready = line(json!({"type": "ready"}));
    let s = futures_util::stream::unfold((ws, Some(ready)), |(mut ws, first)| async move {
        if let Some(f) = first {
            return Some((Ok::<Bytes, Infallible>(f), (ws, None)));
        }
        let l = match ws.next().await? {
            Ok(ev) => line(serde_json::to_value(&ev).unwrap_or_default()),
            Err(e) => line(json!({"type": "error", "code": e.code, "message": e.message})),
        };
        Some((Ok(l), (ws, None)))
    });
    Ok(ndjson(Body::from_stream(s)))
}

#[utoipa::path(
    post,
    path = "/v1/sandboxes/{id}/sessions",
    summary = "Start a persistent shell session: {cwd?, env?}",
    params(
        SandboxPath,
    ),
    request_body = SessionCreateRequest,
    responses(
        (status = 201, description = "Start a persistent shell session: {cwd?, env?}", body = SessionInfo),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn session_create(
    State(st): State<AppState>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    route(&st, &id)?;
    let req: SessionCreateRequest = if bytes.is_empty() {
        SessionCreateRequest::default()
    } else {
        body(&bytes, "create session")?
    };
    let s = st.edge.session_create(&id, req).await?;
    Ok(json_response(StatusCode::CREATED, &s))
}

#[utoipa::path(
    get,
    path = "/v1/sandboxes/{id}/sessions",
    summary = "List sessions",
    params(
        SandboxPath,
    ),
    responses(
        (status = 200, description = "List sessions", body = Object),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn sessions(State(st): State<AppState>, Path(id): Path<String>) -> ApiResult<Response> {
    route(&st, &id)?;
    let s = st.edge.sessions(&id).await?;
    Ok(json_response(StatusCode::OK, &json!({ "sessions": s })))
}

#[utoipa::path(
    post,
    path = "/v1/sandboxes/{id}/sessions/{sid}/run",
    summary = "Run a command in the session: {cmd, timeout_seconds?, background?}",
    params(
        SandboxPath,
        ("sid" = String, Path),
        StepHeaders,
    ),
    request_body = SessionRunRequest,
    responses(
        (status = 200, description = "Run a command in the session: {cmd, timeout_seconds?, background?}", body = SessionResult),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn session_run(
    State(st): State<AppState>,
    Path((id, sid)): Path<(String, String)>,
    headers: HeaderMap,
    bytes: Bytes,
) -> ApiResult<Response> {
    route(&st, &id)?;
    let req: SessionRunRequest = body(&bytes, "session run")?;
    let o = st
        .edge
        .session_run(&id, &sid, req, step_ref(&headers)?)
        .await?;
    Ok(outcome(StatusCode::OK, o))
}

#[utoipa::path(
    get,
    path = "/v1/sandboxes/{id}/sessions/{sid}/commands/{cid}",
    summary = "A session command's result (running or done)",
    params(
        SandboxPath,
        ("sid" = String, Path),
        ("cid" = String, Path),
    ),
    responses(
        (status = 200, description = "A session command's result (running or done)", body = SessionResult),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn session_command(
    State(st): State<AppState>,
    Path((id, sid, cid)): Path<(String, String, String)>,
) -> ApiResult<Response> {
    route(&st, &id)?;
    let cid: u64 = cid
        .parse()
        .map_err(|_| ApiError::invalid(format!("command id {cid:?} is not a number")))?;
    let c = st.edge.session_command(&id, &sid, cid).await?;
    Ok(json_response(StatusCode::OK, &c))
}

#[utoipa::path(
    delete,
    path = "/v1/sandboxes/{id}/sessions/{sid}",
    summary = "End a session and every process it started",
    params(
        SandboxPath,
        ("sid" = String, Path),
    ),
    responses(
        (status = 204, description = "End a session and every process it started"),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn session_kill(
    State(st): State<AppState>,
    Path((id, sid)): Path<(String, String)>,
) -> ApiResult<Response> {
    route(&st, &id)?;
    st.edge.session_kill(&id, &sid).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[utoipa::path(
    get,
    path = "/v1/sandboxes/{id}/trajectories",
    summary = "Trajectories and their step counts",
    params(
        SandboxPath,
    ),
    responses(
        (status = 200, description = "Trajectories and their step counts", body = Object),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn trajectories(State(st): State<AppState>, Path(id): Path<String>) -> ApiResult<Response> {
    route(&st, &id)?;
    Ok(json_response(
        StatusCode::OK,
        &st.edge.trajectories(&id).await?,
    ))
}

#[utoipa::path(
    get,
    path = "/v1/sandboxes/{id}/trajectories/{name}",
    summary = "A trajectory's steps",
    params(
        SandboxPath,
        ("name" = String, Path),
    ),
    responses(
        (status = 200, description = "A trajectory's steps", body = Object),
        (status = 400, response = ErrorReply),
        (status = 404, response = ErrorReply),
    ),
)]
async fn trajectory(
    State(st): State<AppState>,
    Path((id, name)): Path<(String, String)>,
) -> ApiResult<Response> {
    route(&st, &id)?;
    Ok(json_response(
        StatusCode::OK,
        &st.edge.trajectory(&id, &name).await?,
    ))
}
