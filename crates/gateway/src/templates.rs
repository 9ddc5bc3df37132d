//! E2B template builds (`Template.build()`, `Template.from_dockerfile()`) as OpenDsec image
//! builds: the SDK's steps become an image spec (`RUN` → a run step, `ENV` → env,
//! `WORKDIR` → workdir, `COPY` → a file step copying the files the SDK uploaded, the
//! start and ready commands → `[start]`) built on the node's image store, named
//! `root/e2b-<name>:<tag>`; `Sandbox.create("<name>")` then finds it.
//!
//! The base is a template (`from_template`, through the template map), an OpenDsec image
//! (`from_image("root/py:3.11")`) or a registry's image (`from_image("python:3.11")`,
//! `FROM ghcr.io/org/img:tag`), which the node pulls into the building project first
//! (from the registries it lets that project pull from).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use dsec_image::build::{BuildSpec, Step};
use dsec_image::store::StartCmd;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::control::{key, now_ms, parse, query_pairs, rfc3339};
use crate::upstream::UpErr;
use crate::{Gw, Template};

/// Builds an image spec on the node for `project` (the caller's: its images, its quota),
/// reporting progress one line at a time; the image's digest, or why it failed.
pub trait Builder: Send + Sync {
    fn build(
        &self,
        spec: &BuildSpec,
        project: &str,
        progress: &mut dyn FnMut(&str),
    ) -> Result<String, dsec_common::ApiError>;
    /// A directory on the same machine for uploaded files (`COPY`) while they wait for
    /// their build.
    fn scratch(&self) -> std::path::PathBuf;
}

/// The image a template built by a key of `project` is kept as: in that project's
/// namespace, so it is the project's (and its sub-projects') alone.
pub(crate) fn image_of(project: &str, name: &str, tag: &str) -> String {
    format!("{project}/e2b-{name}:{tag}")
}

pub(crate) fn routes() -> Router<Gw> {
    Router::new()
        .route("/v3/templates", post(request_build))
        .route("/v2/templates/{tid}/builds/{bid}", post(start_build))
        .route("/templates/{tid}/builds/{bid}/status", get(status))
        .route("/templates/{tid}/files/{hash}", get(files))
        .route(
            "/templates/{tid}/files/{hash}/upload",
            axum::routing::put(upload),
        )
        .route("/templates/aliases/{alias}", get(alias))
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State_ {
    Waiting,
    Building,
    Ready,
    Error,
}

struct Build {
    template: String,
    tag: String,
    state: State_,
    logs: Vec<(u64, String)>,
    reason: Option<String>,
}

/// The builds this gateway has been asked for (kept while it runs).
#[derive(Default)]
pub(crate) struct Builds(BTreeMap<String, Arc<Mutex<Build>>>);

type Res = Result<Response, UpErr>;

fn bad(m: impl Into<String>) -> UpErr {
    UpErr::new(400, "invalid_argument", m)
}

/// Template names: `name` or `name:tag`, lower-case letters, digits, `-` and `_`.
fn split_name(n: &str) -> Result<(String, String), UpErr> {
    let (name, tag) = n.split_once(':').unwrap_or((n, "latest"));
    let ok = |s: &str, max: usize| {
        !s.is_empty()
            && s.len() <= max
            && s.as_bytes()[0].is_ascii_alphanumeric()
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
    };
    if !ok(name, 64) || !ok(tag, 64) {
        return Err(bad(format!(
            "template name {n:?}: use `name` or `name:tag` of lower-case letters, digits, '-' and '_'"
        )));
    }
    Ok((name.to_string(), tag.to_string()))
}

/// The caller's key and project: what it builds lands in that project's namespace.
async fn caller(gw: &Gw, h: &HeaderMap) -> Result<(String, String), UpErr> {
    let k = key(h)?;
    let project = crate::control::project_of(gw, &k).await?;
    Ok((k, project))
}

#[derive(Deserialize)]
struct BuildRequest {
    name: Option<String>,
    alias: Option<String>,
    #[serde(default)]
    tags: Vec<String>,
}

/// The node's image builder, or why this gateway has none.
fn builder(gw: &Gw) -> Result<Arc<dyn Builder>, UpErr> {
    gw.cfg.builder.clone().ok_or_else(|| {
        UpErr::new(
            501,
            "unimplemented",
            "this gateway cannot build templates (no image store on this node); use `dsec image build`",
        )
    })
}

async fn request_build(State(gw): State<Gw>, h: HeaderMap, body: Bytes) -> Res {
    caller(&gw, &h).await?;
    builder(&gw)?;
    let req: BuildRequest = parse(&body, "template build request")?;
    let full = req
        .name
        .or(req.alias)
        .ok_or_else(|| bad("the template needs a name"))?;
    let (name, tag) = split_name(&full)?;
    if let Some(t) = req
        .tags
        .iter()
        .find(|t| split_name(&format!("x:{t}")).is_err())
    {
        return Err(bad(format!("tag {t:?} is not valid")));
    }
    let tag = req.tags.first().cloned().unwrap_or(tag);
    let bid = dsec_common::id::random_hex(16);
    let build = Build {
        template: name.clone(),
        tag: tag.clone(),
        state: State_::Waiting,
        logs: vec![],
        reason: None,
    };
    gw.builds
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .0
        .insert(bid.clone(), Arc::new(Mutex::new(build)));
    Ok((
        StatusCode::ACCEPTED,
        axum::Json(json!({
            "templateID": name,
            "buildID": bid,
            "public": false,
            "names": [format!("{name}:{tag}")],
            "aliases": [name],
            "tags": [tag],
        })),
    )
        .into_response())
}

fn find(gw: &Gw, tid: &str, bid: &str) -> Result<Arc<Mutex<Build>>, UpErr> {
    let builds = gw.builds.lock().unwrap_or_else(|p| p.into_inner());
    builds
        .0
        .get(bid)
        .filter(|b| b.lock().map(|b| b.template == tid).unwrap_or(false))
        .cloned()
        .ok_or_else(|| {
            UpErr::new(
                404,
                "not_found",
                format!("build {bid} of template {tid} not found"),
            )
        })
}

#[derive(Deserialize)]
struct StartBuild {
    #[serde(rename = "fromImage")]
    from_image: Option<String>,
    #[serde(rename = "fromTemplate")]
    from_template: Option<String>,
    #[serde(rename = "fromImageRegistry")]
    from_image_registry: Option<Value>,
    #[serde(default)]
    steps: Vec<StepReq>,
    #[serde(rename = "startCmd")]
    start_cmd: Option<String>,
    #[serde(rename = "readyCmd")]
    ready_cmd: Option<String>,
}

#[derive(Deserialize)]
struct StepReq {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default, rename = "filesHash")]
    files_hash: Option<String>,
}

/// A `COPY` waiting for its files: the step (by index) gets `copy_from` once the upload
/// `hash` is unpacked; `src` is the path (or glob) in the client's context.
struct Copy {
    index: usize,
    hash: String,
    src: String,
    /// Where it goes; `into_dir` (`dest/`, or a glob): the files go inside.
    dest: String,
    into_dir: bool,
}

/// The OpenDsec image a build starts from.
async fn base_image(gw: &Gw, key: &str, req: &StartBuild) -> Result<String, UpErr> {
    if req
        .from_image_registry
        .as_ref()
        .is_some_and(|v| !v.is_null())
    {
        return Err(bad(
            "fromImageRegistry: this gateway pulls base images anonymously; use a public image, or pull it with `dsec image pull --username …` and build from that OpenDsec image",
        ));
    }
    match (&req.from_template, &req.from_image) {
        (Some(t), _) => match crate::control::template_for(gw, key, t).await? {
            Template::Image(i) | Template::Spec { image: i, .. } => Ok(i),
        },
        // E2B's own base image (`from_base_image()`) is the `base` template here
        (None, Some(i)) if i == "e2bdev/base" || i.starts_with("e2bdev/base:") => {
            match gw.cfg.templates.get("base") {
                Some(t) => Ok(t.image().to_string()),
                None => Err(bad(
                    "fromImage e2bdev/base: this gateway has no `base` template",
                )),
            }
        }
        (None, Some(i)) if i.contains('/') => Ok(i.clone()),
        // A template of that name, else Docker Hub's official image (`python:3.11`).
        (None, Some(i)) => match gw.cfg.templates.get(i.as_str()) {
            Some(t) => Ok(t.image().to_string()),
            None => Ok(format!("docker.io/library/{i}")),
        },
        (None, None) => Err(bad("the build names no base (fromTemplate or fromImage)")),
    }
}

/// The SDK's steps as image build steps, the working directory they leave, and the
/// copies that wait for uploaded files.
type Translated = (Vec<Step>, Option<String>, Vec<Copy>);

fn spec_steps(req: &StartBuild) -> Result<Translated, UpErr> {
    let mut steps = Vec::new();
    let mut copies = Vec::new();
    let mut workdir: Option<String> = None;
    let step = |run: Option<String>, env: Option<BTreeMap<String, String>>| Step {
        run,
        file: None,
        content: None,
        src: None,
        copy_from: None,
        mode: None,
        env,
    };
    for (i, s) in req.steps.iter().enumerate() {
        let n = i + 1;
        match s.kind.as_str() {
            "RUN" => {
                let cmd = s
                    .args
                    .first()
                    .filter(|c| !c.trim().is_empty())
                    .ok_or_else(|| bad(format!("step {n}: RUN needs a command")))?;
                if let Some(u) = s
                    .args
                    .get(1)
                    .filter(|u| !matches!(u.as_str(), "" | "root" | "user"))
                {
                    return Err(bad(format!(
                        "step {n}: RUN as user {u:?}: build steps run as root here"
                    )));
                }
                // a WORKDIR before applies to what runs after it
                let cmd = match &workdir {
                    Some(w) => format!("cd {} && {cmd}", sh_quote(w)),
                    None => cmd.clone(),
                };
                steps.push(step(Some(cmd), None));
            }
            "ENV" => {
                if s.args.is_empty() || s.args.len() % 2 != 0 {
                    return Err(bad(format!("step {n}: ENV needs name/value pairs")));
                }
                let env: BTreeMap<String, String> = s
                    .args
                    .chunks(2)
                    .map(|p| (p[0].clone(), p[1].clone()))
                    .collect();
                steps.push(step(None, Some(env)));
            }
            "WORKDIR" => {
                let w = s
                    .args
                    .first()
                    .filter(|w| w.starts_with('/'))
                    .ok_or_else(|| bad(format!("step {n}: WORKDIR needs an absolute path")))?;
                if w != "/" {
                    steps.push(step(Some(format!("mkdir -p {}", sh_quote(w))), None));
                }
                workdir = Some(w.clone());
            }
            // Build steps run as root; `user` is E2B's default user, which the image has.
            "USER" => {
                if !matches!(s.args.first().map(String::as_str), Some("root" | "user")) {
                    return Err(bad(format!(
                        "step {n}: USER {:?}: sandboxes run as root here",
                        s.args.first().map(String::as_str).unwrap_or("")
                    )));
                }
            }
            "COPY" => {
                let (Some(src), Some(dest)) = (s.args.first(), s.args.get(1)) else {
                    return Err(bad(format!(
                        "step {n}: COPY needs a source and a destination"
                    )));
                };
                let hash = s
                    .files_hash
                    .clone()
                    .filter(|h| valid_hash(h))
                    .ok_or_else(|| bad(format!("step {n}: COPY without a files hash")))?;
                if let Some(u) = s
                    .args
                    .get(2)
                    .filter(|u| !matches!(u.as_str(), "" | "root" | "user"))
                {
                    return Err(bad(format!(
                        "step {n}: COPY owned by {u:?}: files are root's here"
                    )));
                }
                let abs = if dest.starts_with('/') {
                    dest.clone()
                } else {
                    format!(
                        "{}/{dest}",
                        workdir.as_deref().unwrap_or("").trim_end_matches('/')
                    )
                };
                let glob = src.contains(['*', '?', '[']);
                let target = abs.trim_end_matches('/');
                let target = if target.is_empty() { "/" } else { target };
                copies.push(Copy {
                    index: steps.len(),
                    hash,
                    src: src.clone(),
                    dest: target.to_string(),
                    into_dir: dest.ends_with('/') || glob,
                });
                steps.push(Step {
                    file: Some(target.to_string()),
                    ..step(None, None)
                });
            }
            other => {
                return Err(bad(format!(
                    "step {n}: {other:?} is not a step this gateway knows"
                )));
            }
        }
    }
    // E2B's templates all have its default user: made by the first RUN step, or by one
    // more at the end when there is none (indices of copies stay as they are).
    match steps.iter_mut().find(|s| s.run.is_some()) {
        Some(s) => s.run = s.run.take().map(|r| format!("{ENSURE_USER}\n{r}")),
        None => steps.push(step(Some(ENSURE_USER.to_string()), None)),
    }
    Ok((steps, workdir.filter(|w| w != "/"), copies))
}

/// Makes E2B's default user `user` (uid 1000 where free, home /home/user) unless the
/// image has it: with Debian's `useradd`, BusyBox's `adduser`, or by hand.
const ENSURE_USER: &str = "id -u user >/dev/null 2>&1 || useradd -m -u 1000 -s /bin/bash user 2>/dev/null || useradd -m -s /bin/bash user 2>/dev/null || adduser -D -s /bin/sh user 2>/dev/null || { echo 'user:x:1000:1000::/home/user:/bin/sh' >> /etc/passwd && echo 'user:x:1000:' >> /etc/group && mkdir -p /home/user && chown 1000:1000 /home/user; }";

/// An upload's name: the SDK's sha256 of the files (hex).
fn valid_hash(h: &str) -> bool {
    (16..=128).contains(&h.len()) && h.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A relative path inside an upload: no `..`, not absolute.
fn inside(p: &str) -> Option<std::path::PathBuf> {
    let path = std::path::Path::new(p.trim_start_matches("./"));
    if path.is_absolute()
        || path.components().any(|c| {
            !matches!(
                c,
                std::path::Component::Normal(_) | std::path::Component::CurDir
            )
        })
    {
        return None;
    }
    Some(path.to_path_buf())
}

/// Why a template build failed.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("unpacking the upload: {0}")]
    Upload(#[from] crate::untar::UntarError),
    /// A `COPY` step names something the upload cannot give: why.
    #[error("{0}")]
    Copy(String),
    #[error("{}", .0.message)]
    Build(dsec_common::ApiError),
    #[error(transparent)]
    Io(#[from] dsec_common::IoFailure),
}

/// Unpacks an upload (tar, gzip'd or not) into `dir` and nowhere else ([`crate::untar`]).
fn unpack(archive: &std::path::Path, dir: &std::path::Path) -> Result<(), BuildError> {
    use dsec_common::IoContext;
    use std::io::Read;
    let open = || std::fs::File::open(archive).ctx(|| "opening the upload".into());
    let mut magic = [0u8; 2];
    let gz = open()?.read_exact(&mut magic).is_ok() && magic == [0x1f, 0x8b];
    let reader: Box<dyn Read> = if gz {
        Box::new(flate2::read::GzDecoder::new(open()?))
    } else {
        Box::new(open()?)
    };
    Ok(crate::untar::unpack(reader, dir)?)
}

/// Gives each `COPY` its files: unpacks the uploads under `staging` and points the steps
/// at what they copy (for a glob, every file of the upload, by name, into the destination).
fn stage_copies(
    scratch: &std::path::Path,
    staging: &std::path::Path,
    steps: &mut [Step],
    copies: &[Copy],
) -> Result<(), BuildError> {
    let io =
        |e: std::io::Error| BuildError::from(dsec_common::IoFailure::new("staging the upload", e));
    for (k, c) in copies.iter().enumerate() {
        let dir = staging.join(k.to_string());
        unpack(&scratch.join(format!("{}.tar", c.hash)), &dir.join("ctx"))?;
        let from = if c.src.contains(['*', '?', '[']) {
            let flat = dir.join("flat");
            std::fs::create_dir_all(&flat).map_err(io)?;
            let mut stack = vec![dir.join("ctx")];
            while let Some(d) = stack.pop() {
                for e in std::fs::read_dir(&d).map_err(io)? {
                    let e = e.map_err(io)?;
                    if e.file_type().map_err(io)?.is_dir() {
                        stack.push(e.path());
                    } else {
                        std::fs::rename(e.path(), flat.join(e.file_name())).map_err(io)?;
                    }
                }
            }
            flat
        } else {
            let rel = inside(&c.src).ok_or_else(|| {
                BuildError::Copy(format!("COPY source {:?} leaves the context", c.src))
            })?;
            // The path as the copy will resolve it (every link but the last followed)
            // must stay in the context.
            if let Err(e) = dsec_common::beneath::open_beneath(&dir.join("ctx"), &rel, false)
                && e.raw_os_error() != Some(libc::ENOENT)
            {
                return Err(BuildError::Copy(format!(
                    "COPY source {:?} leads outside the context ({e})",
                    c.src
                )));
            }
            dir.join("ctx").join(rel)
        };
        let meta = std::fs::symlink_metadata(&from).map_err(|_| {
            BuildError::Copy(format!("COPY source {:?} is not in the upload", c.src))
        })?;
        let step = steps
            .get_mut(c.index)
            .ok_or_else(|| BuildError::Copy("COPY step out of range".into()))?;
        if !meta.is_dir() && c.into_dir {
            let name = from
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            step.file = Some(format!("{}/{name}", c.dest.trim_end_matches('/')));
        }
        step.copy_from = Some(from.display().to_string());
    }
    Ok(())
}

fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

async fn start_build(
    State(gw): State<Gw>,
    h: HeaderMap,
    Path((tid, bid)): Path<(String, String)>,
    body: Bytes,
) -> Res {
    let (key, project) = caller(&gw, &h).await?;
    let builder = builder(&gw)?;
    let b = find(&gw, &tid, &bid)?;
    let req: StartBuild = parse(&body, "template build")?;
    let from = base_image(&gw, &key, &req).await?;
    let (steps, workdir, copies) = spec_steps(&req)?;
    let (name, tag) = {
        let mut bl = b.lock().unwrap_or_else(|p| p.into_inner());
        if bl.state != State_::Waiting {
            return Err(UpErr::new(
                409,
                "already_exists",
                "this build has started already",
            ));
        }
        bl.state = State_::Building;
        (bl.template.clone(), bl.tag.clone())
    };
    let mut spec = BuildSpec {
        name: image_of(&project, &name, &tag),
        from: Some(from),
        debian: None,
        env: BTreeMap::new(),
        workdir,
        start: req
            .start_cmd
            .filter(|c| !c.trim().is_empty())
            .map(|run| StartCmd {
                run,
                ready: req.ready_cmd.filter(|c| !c.trim().is_empty()),
                ready_timeout_seconds: None,
            }),
        steps,
    };
    if let Err(e) = spec.validate() {
        b.lock().unwrap_or_else(|p| p.into_inner()).state = State_::Waiting;
        return Err(bad(e.to_string()));
    }
    let b2 = b.clone();
    tokio::task::spawn_blocking(move || {
        let log = |b: &Arc<Mutex<Build>>, line: &str| {
            b.lock()
                .unwrap_or_else(|p| p.into_inner())
                .logs
                .push((now_ms(), line.to_string()));
        };
        log(&b2, &format!("building {}", spec.name));
        let scratch = builder.scratch().join(uploads_of(&project));
        let staging = builder.scratch().join(format!("build-{bid}"));
        let r = stage_copies(&scratch, &staging, &mut spec.steps, &copies).and_then(|()| {
            builder
                .build(&spec, &project, &mut |line| log(&b2, line))
                .map_err(BuildError::Build)
        });
        let _ = std::fs::remove_dir_all(&staging);
        for c in &copies {
            let _ = std::fs::remove_file(scratch.join(format!("{}.tar", c.hash)));
        }
        let mut bl = b2.lock().unwrap_or_else(|p| p.into_inner());
        match r {
            Ok(digest) => {
                bl.logs
                    .push((now_ms(), format!("built {} ({digest})", spec.name)));
                bl.state = State_::Ready;
            }
            Err(e) => {
                bl.logs.push((now_ms(), format!("build failed: {e}")));
                bl.reason = Some(e.to_string());
                bl.state = State_::Error;
            }
        }
    });
    Ok(StatusCode::ACCEPTED.into_response())
}

async fn status(
    State(gw): State<Gw>,
    h: HeaderMap,
    Path((tid, bid)): Path<(String, String)>,
    RawQuery(q): RawQuery,
) -> Res {
    caller(&gw, &h).await?;
    let b = find(&gw, &tid, &bid)?;
    let offset: usize = query_pairs(q.as_deref().unwrap_or(""))
        .into_iter()
        .find(|(k, _)| k == "logsOffset")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let bl = b.lock().unwrap_or_else(|p| p.into_inner());
    let entries: Vec<Value> = bl
        .logs
        .iter()
        .skip(offset)
        .take(100)
        .map(|(t, m)| json!({"timestamp": rfc3339(*t), "level": "info", "message": m}))
        .collect();
    let mut v = json!({
        "templateID": tid,
        "buildID": bid,
        "status": match bl.state {
            State_::Waiting => "waiting",
            State_::Building => "building",
            State_::Ready => "ready",
            State_::Error => "error",
        },
        "logs": bl.logs.iter().skip(offset).take(100).map(|(_, m)| m.clone()).collect::<Vec<_>>(),
        "logEntries": entries,
    });
    if let Some(r) = &bl.reason {
        v["reason"] = json!({"message": r});
    }
    Ok(axum::Json(v).into_response())
}

/// The most one upload may hold.
const MAX_UPLOAD: u64 = 4 << 30;

/// The scratch subdirectory of a project's uploads. Uploads are named by the hash the SDK
/// computes of a `COPY`'s files, which the gateway cannot check: kept per project, one
/// tenant cannot plant files under the hash another tenant's build will ask for.
fn uploads_of(project: &str) -> String {
    use sha2::{Digest, Sha256};
    crate::hex(&Sha256::digest(project.as_bytes())[..16])
}

fn valid_uploads_dir(d: &str) -> bool {
    d.len() == 32
        && d.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// Where a `COPY`'s files go (`{"present", "url"}`): a URL of this gateway, signed for
/// that upload, for the SDK's plain `PUT`.
async fn files(
    State(gw): State<Gw>,
    h: HeaderMap,
    Path((tid, hash)): Path<(String, String)>,
) -> Res {
    let (_, project) = caller(&gw, &h).await?;
    let builder = builder(&gw)?;
    if !valid_hash(&hash) {
        return Err(bad(format!("{hash:?} is not a files hash")));
    }
    let p = uploads_of(&project);
    if builder
        .scratch()
        .join(&p)
        .join(format!("{hash}.tar"))
        .exists()
    {
        return Ok((StatusCode::CREATED, axum::Json(json!({"present": true}))).into_response());
    }
    let host = crate::header_str(&h, "host").ok_or_else(|| bad("the request has no Host"))?;
    let token = crate::access_token(&gw.cfg.secret, &format!("upload:{p}:{hash}"));
    let url = format!("http://{host}/templates/{tid}/files/{hash}/upload?p={p}&token={token}");
    Ok((
        StatusCode::CREATED,
        axum::Json(json!({"present": false, "url": url})),
    )
        .into_response())
}

/// The SDK's upload of a `COPY`'s files (a tar), streamed to the scratch directory.
async fn upload(
    State(gw): State<Gw>,
    Path((_tid, hash)): Path<(String, String)>,
    RawQuery(q): RawQuery,
    body: axum::body::Body,
) -> Res {
    use futures_util::StreamExt;
    use tokio::io::AsyncWriteExt;

    let pairs = query_pairs(q.as_deref().unwrap_or(""));
    let get = |name: &str| {
        pairs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let p = get("p")
        .filter(|p| valid_uploads_dir(p))
        .unwrap_or_default();
    let want = crate::access_token(&gw.cfg.secret, &format!("upload:{p}:{hash}"));
    let given = get("token");
    if p.is_empty() || !valid_hash(&hash) || !given.is_some_and(|t| crate::same(&t, &want)) {
        return Err(UpErr::new(
            401,
            "unauthenticated",
            "this upload URL is not valid",
        ));
    }
    let builder = builder(&gw)?;
    let dir = builder.scratch().join(&p);
    let internal =
        |e: std::io::Error| UpErr::new(500, "internal", format!("storing the upload: {e}"));
    tokio::fs::create_dir_all(&dir).await.map_err(internal)?;
    let part = dir.join(format!(
        "{hash}.tar.part-{}",
        dsec_common::id::random_hex(16)
    ));
    let mut f = tokio::fs::File::create(&part).await.map_err(internal)?;
    let mut stream = body.into_data_stream();
    let mut n = 0u64;
    let r = async {
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| bad(format!("reading the upload: {e}")))?;
            n += chunk.len() as u64;
            if n > MAX_UPLOAD {
                return Err(UpErr::new(
                    413,
                    "resource_exhausted",
                    "an upload is at most 4 GiB",
                ));
            }
            f.write_all(&chunk).await.map_err(internal)?;
        }
        f.flush().await.map_err(internal)?;
        tokio::fs::rename(&part, dir.join(format!("{hash}.tar")))
            .await
            .map_err(internal)
    }
    .await;
    if r.is_err() {
        let _ = tokio::fs::remove_file(&part).await;
    }
    r?;
    Ok(StatusCode::OK.into_response())
}

/// Whether a template name is taken (`Template.exists()`).
async fn alias(State(gw): State<Gw>, h: HeaderMap, Path(alias): Path<String>) -> Res {
    let (key, _) = caller(&gw, &h).await?;
    match crate::control::template_for(&gw, &key, &alias).await {
        Ok(_) => Ok(axum::Json(json!({"templateID": alias, "public": false})).into_response()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tar with `entries` (name, data, mode); names are written raw, `..` included.
    fn tar_of(entries: &[(&str, &[u8], u32)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (name, data, mode) in entries {
            let mut h = tar::Header::new_old();
            h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
            h.set_size(data.len() as u64);
            h.set_mode(*mode);
            h.set_cksum();
            b.append(&h, *data).unwrap();
        }
        b.into_inner().unwrap()
    }

    #[test]
    fn uploads_are_kept_per_project() {
        let (a, b) = (uploads_of("root/t1"), uploads_of("root/t2"));
        assert_ne!(a, b);
        assert!(valid_uploads_dir(&a) && valid_uploads_dir(&b));
        assert!(!valid_uploads_dir("../x") && !valid_uploads_dir(""));
    }

    #[test]
    fn copies_are_staged_inside_their_directory() {
        let d = tempfile::tempdir().unwrap();
        let scratch = d.path().join("scratch");
        std::fs::create_dir_all(&scratch).unwrap();
        let tar = tar_of(&[("a.txt", b"A", 0o644), ("d/b.sh", b"B", 0o755)]);
        std::fs::write(scratch.join("0123456789abcdef.tar"), tar).unwrap();
        let req: StartBuild = serde_json::from_value(json!({
            "fromTemplate": "base",
            "steps": [
                {"type": "COPY", "args": ["a.txt", "/x/"], "filesHash": "0123456789abcdef"},
                {"type": "WORKDIR", "args": ["/w"]},
                {"type": "COPY", "args": ["d", "sub"], "filesHash": "0123456789abcdef"},
                {"type": "COPY", "args": ["*.sh", "/g"], "filesHash": "0123456789abcdef"},
            ],
        }))
        .unwrap();
        let (mut steps, _, copies) = spec_steps(&req).unwrap();
        let staging = d.path().join("staging");
        stage_copies(&scratch, &staging, &mut steps, &copies).unwrap();
        assert_eq!(steps[0].file.as_deref(), Some("/x/a.txt"));
        assert!(steps[0].copy_from.as_ref().unwrap().ends_with("ctx/a.txt"));
        assert_eq!(steps[2].file.as_deref(), Some("/w/sub"));
        assert!(steps[2].copy_from.as_ref().unwrap().ends_with("ctx/d"));
        assert_eq!(steps[3].file.as_deref(), Some("/g"));
        let flat = std::path::PathBuf::from(steps[3].copy_from.clone().unwrap());
        assert!(flat.join("b.sh").exists());
        // an upload with an entry that leaves its directory is refused, and nothing lands
        // outside the staging directory
        let evil = tar_of(&[("a.txt", b"A", 0o644), ("../evil", b"X", 0o644)]);
        std::fs::write(scratch.join("fedcba9876543210.tar"), evil).unwrap();
        let req: StartBuild = serde_json::from_value(json!({"fromTemplate": "base", "steps": [
            {"type": "COPY", "args": ["a.txt", "/x/"], "filesHash": "fedcba9876543210"}]}))
        .unwrap();
        let (mut s1, _, c1) = spec_steps(&req).unwrap();
        let e = stage_copies(&scratch, &d.path().join("s1"), &mut s1, &c1).unwrap_err();
        assert!(
            matches!(e, BuildError::Upload(crate::untar::UntarError::Refused(_))),
            "{e:?}"
        );
        assert!(e.to_string().contains("leaves the archive"), "{e}");
        for p in [
            d.path().join("evil"),
            d.path().join("s1/evil"),
            d.path().join("s1/0/evil"),
        ] {
            assert!(!p.exists(), "{}", p.display());
        }
        // a source that leaves the context, or is not in the upload
        let bad: StartBuild = serde_json::from_value(json!({"fromTemplate": "base", "steps": [
            {"type": "COPY", "args": ["../etc/passwd", "/p"], "filesHash": "0123456789abcdef"}]}))
        .unwrap();
        let (mut s2, _, c2) = spec_steps(&bad).unwrap();
        let e = stage_copies(&scratch, &d.path().join("s2"), &mut s2, &c2).unwrap_err();
        assert!(matches!(e, BuildError::Copy(_)), "{e:?}");
        assert!(e.to_string().contains("leaves the context"), "{e}");
        assert!(inside("/etc").is_none() && inside("a/../../b").is_none());
        assert_eq!(inside("./a/b").unwrap(), std::path::PathBuf::from("a/b"));
    }

    #[test]
    fn names_and_steps_translate() {
        assert_eq!(
            split_name("my-t").unwrap(),
            ("my-t".into(), "latest".into())
        );
        assert_eq!(split_name("t_1:v2").unwrap(), ("t_1".into(), "v2".into()));
        for bad in ["", "A", "../x", "a/b", "a:", "-a"] {
            assert!(split_name(bad).is_err(), "{bad}");
        }
        let req: StartBuild = serde_json::from_value(json!({
            "fromTemplate": "base",
            "steps": [
                {"type": "USER", "args": ["root"]},
                {"type": "WORKDIR", "args": ["/"]},
                {"type": "RUN", "args": ["echo hi > /x"]},
                {"type": "ENV", "args": ["A", "b", "C", "d"]},
                {"type": "WORKDIR", "args": ["/app dir"]},
                {"type": "RUN", "args": ["touch f", "root"]},
            ],
        }))
        .unwrap();
        let (steps, wd, _) = spec_steps(&req).unwrap();
        assert_eq!(wd.as_deref(), Some("/app dir"));
        assert_eq!(
            steps[0].run.as_deref(),
            Some(format!("{ENSURE_USER}\ncd '/' && echo hi > /x").as_str())
        );
        assert_eq!(steps[1].env.as_ref().unwrap()["C"], "d");
        assert_eq!(steps[2].run.as_deref(), Some("mkdir -p '/app dir'"));
        assert_eq!(steps[3].run.as_deref(), Some("cd '/app dir' && touch f"));
        for step in [
            json!({"type": "COPY", "args": ["a", "/b"]}),
            json!({"type": "COPY", "args": ["a", "/b", "bob"], "filesHash": "0123456789abcdef"}),
            json!({"type": "USER", "args": ["bob"]}),
            json!({"type": "ENV", "args": ["A"]}),
            json!({"type": "WORKDIR", "args": ["rel"]}),
            json!({"type": "RUN", "args": ["x", "bob"]}),
            json!({"type": "HEALTHCHECK", "args": []}),
        ] {
            let r: StartBuild =
                serde_json::from_value(json!({"fromTemplate": "base", "steps": [step]})).unwrap();
            assert!(spec_steps(&r).is_err());
        }
    }
}
