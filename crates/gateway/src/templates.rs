//! E2B template builds (`Template.build()`, `Template.from_dockerfile()`) as OpenDsec image
//! builds: the SDK's steps become an image spec (`RUN` → a run step, `ENV` → env,
//! `WORKDIR` → workdir, the start and ready commands → `[start]`) built on the node's
//! image store, named `root/e2b-<name>:<tag>`; `Sandbox.create("<name>")` then finds it.
//!
//! The base is a template (`from_template`, through the template map) or an OpenDsec
//! image (`from_image("root/py:3.11")`); there is no registry to pull other images from.
//! `COPY` (files uploaded from the client) is not supported yet and says so.

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
use hyper::Method;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::control::{key, now_ms, parse, query_pairs, rfc3339};
use crate::upstream::UpErr;
use crate::{Gw, Template};

/// Builds an image spec into the node's image store, reporting progress one line at a
/// time; the image's digest, or why it failed.
pub trait Builder: Send + Sync {
    fn build(&self, spec: &BuildSpec, progress: &mut dyn FnMut(&str)) -> Result<String, String>;
}

/// The image a built template is kept as.
pub(crate) fn image_of(name: &str, tag: &str) -> String {
    format!("root/e2b-{name}:{tag}")
}

pub(crate) fn routes() -> Router<Gw> {
    Router::new()
        .route("/v3/templates", post(request_build))
        .route("/v2/templates/{tid}/builds/{bid}", post(start_build))
        .route("/templates/{tid}/builds/{bid}/status", get(status))
        .route("/templates/{tid}/files/{hash}", get(files))
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

/// Whether the caller may build: images are shared by the whole deployment, so builds
/// take a key of the root project (its administrators).
async fn caller(gw: &Gw, h: &HeaderMap) -> Result<(), UpErr> {
    let k = key(h)?;
    let who: Value = gw.up.call(Method::GET, "/v1/whoami", &k, None).await?;
    if who["project"] != "root" {
        return Err(UpErr::new(
            403,
            "permission_denied",
            "template builds write the deployment's shared image store: use a key of the root project",
        ));
    }
    Ok(())
}

#[derive(Deserialize)]
struct BuildRequest {
    name: Option<String>,
    alias: Option<String>,
    #[serde(default)]
    tags: Vec<String>,
}

async fn request_build(State(gw): State<Gw>, h: HeaderMap, body: Bytes) -> Res {
    caller(&gw, &h).await?;
    if gw.cfg.builder.is_none() {
        return Err(UpErr::new(
            501,
            "unimplemented",
            "this gateway cannot build templates (no image store on this node); use `dsec image build`",
        ));
    }
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
    let bid = crate::random_id();
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
}

/// The OpenDsec image a build starts from.
async fn base_image(gw: &Gw, req: &StartBuild) -> Result<String, UpErr> {
    if req
        .from_image_registry
        .as_ref()
        .is_some_and(|v| !v.is_null())
    {
        return Err(bad(
            "fromImageRegistry: this gateway builds from OpenDsec images and templates only (no registry)",
        ));
    }
    match (&req.from_template, &req.from_image) {
        (Some(t), _) => match crate::control::template_for(gw, t).await? {
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
        (None, Some(i)) => match gw.cfg.templates.get(i.as_str()) {
            Some(t) => Ok(t.image().to_string()),
            None => Err(bad(format!(
                "base image {i:?}: images cannot be pulled from a registry here; start from a template (from_template(\"base\")) or an OpenDsec image (from_image(\"root/py:3.11\"), or `FROM root/py:3.11` in a Dockerfile)"
            ))),
        },
        (None, None) => Err(bad("the build names no base (fromTemplate or fromImage)")),
    }
}

/// The SDK's steps as image build steps (and the working directory and user they leave).
fn spec_steps(req: &StartBuild) -> Result<(Vec<Step>, Option<String>), UpErr> {
    let mut steps = Vec::new();
    let mut workdir: Option<String> = None;
    let step = |run: Option<String>, env: Option<BTreeMap<String, String>>| Step {
        run,
        file: None,
        content: None,
        src: None,
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
            // E2B's default user `user` is root here, as everywhere in the gateway
            "USER" => {
                if !matches!(s.args.first().map(String::as_str), Some("root" | "user")) {
                    return Err(bad(format!(
                        "step {n}: USER {:?}: sandboxes run as root here",
                        s.args.first().map(String::as_str).unwrap_or("")
                    )));
                }
            }
            "COPY" => {
                return Err(bad(format!(
                    "step {n}: COPY is not supported by this gateway yet; write the files in a RUN step or an image spec's file steps (`dsec image build`)"
                )));
            }
            other => {
                return Err(bad(format!(
                    "step {n}: {other:?} is not a step this gateway knows"
                )));
            }
        }
    }
    Ok((steps, workdir.filter(|w| w != "/")))
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
    caller(&gw, &h).await?;
    let b = find(&gw, &tid, &bid)?;
    let req: StartBuild = parse(&body, "template build")?;
    let from = base_image(&gw, &req).await?;
    let (steps, workdir) = spec_steps(&req)?;
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
    let spec = BuildSpec {
        name: image_of(&name, &tag),
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
    let Some(builder) = gw.cfg.builder.clone() else {
        return Err(UpErr::new(
            501,
            "unimplemented",
            "this gateway cannot build templates",
        ));
    };
    let b2 = b.clone();
    tokio::task::spawn_blocking(move || {
        let log = |b: &Arc<Mutex<Build>>, line: &str| {
            b.lock()
                .unwrap_or_else(|p| p.into_inner())
                .logs
                .push((now_ms(), line.to_string()));
        };
        log(&b2, &format!("building {}", spec.name));
        let r = builder.build(&spec, &mut |line| log(&b2, line));
        let mut bl = b2.lock().unwrap_or_else(|p| p.into_inner());
        match r {
            Ok(digest) => {
                bl.logs
                    .push((now_ms(), format!("built {} ({digest})", spec.name)));
                bl.state = State_::Ready;
            }
            Err(e) => {
                bl.logs.push((now_ms(), format!("build failed: {e}")));
                bl.reason = Some(e);
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

/// Uploads for `COPY`: not supported yet, said before anything is uploaded.
async fn files(State(gw): State<Gw>, h: HeaderMap) -> Res {
    caller(&gw, &h).await?;
    Err(bad(
        "COPY is not supported by this gateway yet; write the files in a RUN step or an image spec's file steps (`dsec image build`)",
    ))
}

/// Whether a template name is taken (`Template.exists()`).
async fn alias(State(gw): State<Gw>, h: HeaderMap, Path(alias): Path<String>) -> Res {
    caller(&gw, &h).await?;
    match crate::control::template_for(&gw, &alias).await {
        Ok(_) => Ok(axum::Json(json!({"templateID": alias, "public": false})).into_response()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let (steps, wd) = spec_steps(&req).unwrap();
        assert_eq!(wd.as_deref(), Some("/app dir"));
        assert_eq!(steps[0].run.as_deref(), Some("cd '/' && echo hi > /x"));
        assert_eq!(steps[1].env.as_ref().unwrap()["C"], "d");
        assert_eq!(steps[2].run.as_deref(), Some("mkdir -p '/app dir'"));
        assert_eq!(steps[3].run.as_deref(), Some("cd '/app dir' && touch f"));
        for step in [
            json!({"type": "COPY", "args": ["a", "/b"]}),
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
