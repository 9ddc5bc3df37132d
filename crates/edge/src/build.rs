//! Image builds on the node ([`dsec_image::build`]): every `run` step executes in a
//! sandbox of the container backend, like any tenant's (its namespaces, seccomp
//! profile, capabilities and cgroup limits, counted against the building project's
//! quota), never on the host. The step's sandbox starts from the layers built so far, may
//! reach only the package services a build needs (by the node's named-service rules), and
//! its filesystem changes become the step's layer, copied out as a commit copies them.

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::sync::Arc;

use dsec_common::ApiError;
use dsec_common::api::{CreateSandboxRequest, ExecRequest};
use dsec_image::build::{BuildSpec, RunStep, StepRunner};
use dsec_image::{ImageError, ImageRef, Manifest};

use crate::commit::image_error;
use crate::runtime::ProcEvent;
use crate::{Edge, blocking};

/// The services a build step may reach (named-service rules of the node's catalog).
pub const BUILD_SERVICES: &[&str] = &["debian", "pypi", "npm", "github"];
/// A step's sandbox: big enough for package installs, bounded like any sandbox.
const STEP_MEMORY_MB: u64 = 2048;
const STEP_DISK_MB: u64 = 4096;
const STEP_PIDS: u64 = 4096;
const STEP_SECONDS: u64 = 3600;
/// Output lines kept for the error of a failed step.
const TAIL_LINES: usize = 20;

impl Edge {
    /// Builds `spec` on this node for `project`, whose quota the steps' sandboxes count
    /// against; each line of progress goes to `progress`. The caller has checked that the
    /// project may write `spec.name` and read `spec.from`.
    pub async fn build_image(
        self: &Arc<Self>,
        spec: BuildSpec,
        project: String,
        progress: tokio::sync::mpsc::UnboundedSender<String>,
    ) -> Result<String, ApiError> {
        let target = ImageRef::parse(&spec.name).map_err(|e| ApiError::invalid(e.to_string()))?;
        // The API and the gateway check this with the caller's key; checked again here,
        // where the project is all there is.
        if !dsec_common::project::may_write_images(&project, &target.project()) {
            return Err(ApiError::new(
                dsec_common::ErrorCode::PermissionDenied,
                format!("project {project} may not write image {target}"),
            ));
        }
        let mut spec = spec;
        if let Some(from) = spec.from.clone() {
            if dsec_image::pull::is_registry_reference(&from) {
                // A registry's image: pulled into the building project first.
                let base = self.pull_base(&from, &project, &progress).await?;
                spec.from = Some(base.to_string());
            } else {
                let base = ImageRef::parse(&from).map_err(|e| ApiError::invalid(e.to_string()))?;
                if !dsec_common::project::may_read_images(&project, &base.project()) {
                    return Err(ApiError::not_found(format!("image {base} not found")));
                }
            }
        }
        let refused = Arc::new(std::sync::Mutex::new(None));
        let steps = SandboxSteps {
            edge: self.clone(),
            rt: tokio::runtime::Handle::current(),
            project,
            image: target,
            refused: refused.clone(),
        };
        let images = self.images.clone();
        let built = blocking(move || {
            // Lines are sent from inside the steps' async code too, so the channel never
            // blocks (what it holds is bounded by the build's own output); a reader that
            // left does not stop the build.
            let mut p = |line: &str| {
                let _ = progress.send(line.to_string());
            };
            dsec_image::build::build(&images, &spec, Some(&steps), &mut p)
        })
        .await?;
        if let Some(e) = refused.lock().unwrap_or_else(|p| p.into_inner()).take() {
            return Err(e);
        }
        built.map_err(|e| match e {
            ImageError::Build(m) => ApiError::precondition(m),
            other => image_error(other),
        })
    }
}

impl Edge {
    /// Pulls an image into the store; before it is named, its size is held in its
    /// project's disk quota (as a commit's is, under the same hold id), so a project
    /// cannot fill the node's disk with pulls.
    pub async fn pull_image(
        self: &Arc<Self>,
        req: &dsec_image::pull::PullRequest,
        log: &mut (dyn FnMut(String) + Send),
    ) -> Result<dsec_image::pull::Pulled, ImageError> {
        let edge = self.clone();
        let target = req.target.clone();
        let hold: dsec_image::pull::BeforeTag = Box::new(move |bytes| {
            Box::pin(async move {
                let id = crate::commit::image_hold_id(&edge.cfg.name, &target);
                let (project, name) = (target.project(), edge.cfg.name.clone());
                let held = edge
                    .quota(move |q| q.hold_disk(&id, &project, &name, bytes))
                    .await
                    .and_then(|r| r.transpose());
                held.map(|_| ()).map_err(|e| ImageError::Pull {
                    reference: target.to_string(),
                    kind: if e.code == dsec_common::ErrorCode::ResourceExhausted {
                        dsec_image::pull::PullFailure::Quota
                    } else {
                        dsec_image::pull::PullFailure::Unreachable
                    },
                    message: e.message,
                })
            })
        });
        dsec_image::pull::pull_held(&self.images, req, log, Some(hold)).await
    }

    /// Pulls `reference`, a build's `FROM`, as the building project's base image
    /// (`dsec_image::pull::base_name`), with the registry login the project (or a parent)
    /// keeps, else anonymously; the pull's lines go to `progress`.
    async fn pull_base(
        self: &Arc<Self>,
        reference: &str,
        project: &str,
        progress: &tokio::sync::mpsc::UnboundedSender<String>,
    ) -> Result<ImageRef, ApiError> {
        let r: oci_client::Reference = reference.parse().map_err(|e| {
            ApiError::invalid(format!(
                "FROM {reference:?}: not an image of this store (root/…) nor of a registry ({e})"
            ))
        })?;
        let registry = r.registry().to_string();
        if !self.may_pull_from(project, &registry) {
            return Err(ApiError::new(
                dsec_common::ErrorCode::PermissionDenied,
                format!(
                    "FROM {reference}: registry {registry} is not one this node lets project {project} pull from; an administrator can add it to [edge] pull_registries"
                ),
            ));
        }
        let target = dsec_image::pull::base_name(project, reference)
            .map_err(|e| ApiError::invalid(e.to_string()))?;
        let kept = self
            .registry_logins()
            .find(project, &registry, true)
            .map_err(image_error)?;
        let req = dsec_image::pull::PullRequest {
            reference: reference.to_string(),
            target: target.clone(),
            credentials: kept.as_ref().map(|(_, c)| c.clone()).unwrap_or_default(),
            plain_http: self.insecure_registry(&registry),
            ca_pem: None,
            limits: dsec_image::pull::PullLimits::default(),
            login: kept.map(|(p, _)| p),
            lazy: self.lazy_mounter(project, &registry),
        };
        let tx = progress.clone();
        let mut log = move |l: String| {
            let _ = tx.send(l);
        };
        self.pull_image(&req, &mut log)
            .await
            .map_err(|e| match &e {
                ImageError::Pull { kind, .. } => {
                    ApiError::new((*kind).into(), format!("FROM: {e}"))
                }
                _ => image_error(e),
            })?;
        Ok(target)
    }
}

/// Runs build steps in sandboxes of `edge` (from a blocking thread of its runtime).
struct SandboxSteps {
    edge: Arc<Edge>,
    rt: tokio::runtime::Handle,
    project: String,
    image: ImageRef,
    /// A quota refusal before the tag, returned as it is (429) rather than as a build
    /// failure.
    refused: Arc<std::sync::Mutex<Option<ApiError>>>,
}

impl StepRunner for SandboxSteps {
    /// The layers the build added hold disk in the image's project, as a commit's do.
    fn before_tag(&self, added: u64) -> Result<(), ImageError> {
        let Some(q) = &self.edge.quotas else {
            return Ok(());
        };
        let hold = crate::commit::image_hold_id(&self.edge.cfg.name, &self.image);
        q.hold_disk(&hold, &self.image.project(), &self.edge.cfg.name, added)
            .map_err(|e| {
                let m = e.message.clone();
                *self.refused.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                ImageError::Build(m)
            })
    }

    fn run(
        &self,
        step: &RunStep<'_>,
        upper: &Path,
        progress: &mut dyn FnMut(&str),
    ) -> Result<(), ImageError> {
        self.rt
            .block_on(self.step(step, upper, progress))
            .map_err(|e| ImageError::Build(e.message))
    }
}

impl SandboxSteps {
    async fn step(
        &self,
        step: &RunStep<'_>,
        upper: &Path,
        progress: &mut dyn FnMut(&str),
    ) -> Result<(), ApiError> {
        let manifest = Manifest {
            schema_version: 1,
            layers: step.layers.to_vec(),
            env: step.env.clone(),
            workdir: step.workdir.map(str::to_string),
            start: None,
            created_ms: dsec_image::store::now_ms(),
            size_bytes: 0,
            source: format!("a build step of {}", self.image),
        };
        let (images, m2) = (self.edge.images.clone(), manifest.clone());
        let digest = blocking(move || images.put_manifest(&m2))
            .await?
            .map_err(image_error)?;
        let cfg = &self.edge.cfg;
        let rules = if self.edge.net.is_some() {
            BUILD_SERVICES
                .iter()
                .map(|s| (s.to_string(), true))
                .collect()
        } else {
            BTreeMap::new()
        };
        let req = CreateSandboxRequest {
            backend: "container".into(),
            image: self.image.to_string(),
            memory_limit_mb: Some(STEP_MEMORY_MB as f64),
            disk_limit_mb: Some(STEP_DISK_MB.min(cfg.max.disk_mb) as f64),
            pids_limit: Some(STEP_PIDS.min(cfg.max.pids) as f64),
            ttl_seconds: Some(STEP_SECONDS.min(cfg.max.ttl_seconds) as f64),
            network_rules: rules,
            project: Some(self.project.clone()),
            ..Default::default()
        };
        let v = crate::validate::create(cfg, &req)?;
        let info = self
            .edge
            .create_from(req, v, self.image.clone(), digest, manifest)
            .await?;
        progress(&format!("  (in sandbox {})", info.id));
        let ran = self.run_in(&info.id, step.cmd, upper, progress).await;
        let stopped = self.edge.stop(&info.id).await;
        ran.and(stopped)
    }

    /// Runs the step's command in sandbox `id`, then copies its changes to `upper`.
    async fn run_in(
        &self,
        id: &str,
        cmd: &str,
        upper: &Path,
        progress: &mut dyn FnMut(&str),
    ) -> Result<(), ApiError> {
        let mut p = self
            .edge
            .exec_stream(
                id,
                ExecRequest {
                    argv: Some(vec!["/bin/sh".into(), "-c".into(), cmd.into()]),
                    timeout_seconds: Some(STEP_SECONDS.min(self.edge.cfg.max.ttl_seconds) as f64),
                    stream: true,
                    ..Default::default()
                },
            )
            .await?;
        let mut lines = Lines::default();
        let mut exit = None;
        while let Some(ev) = p.next().await {
            match ev {
                ProcEvent::Stdout(d) => lines.push(0, &d, progress),
                ProcEvent::Stderr(d) => lines.push(1, &d, progress),
                ProcEvent::Exit(r) => exit = Some(r),
                ProcEvent::Error(e) => return Err(e),
            }
        }
        lines.flush(progress);
        match exit {
            Some(r) if r.exit_code == 0 => {}
            Some(r) => {
                let why = if r.timed_out {
                    "ran out of time".to_string()
                } else if r.oom_killed {
                    format!("was killed at its {STEP_MEMORY_MB} MiB memory limit")
                } else {
                    format!("exited with {}", r.exit_code)
                };
                return Err(ApiError::precondition(format!(
                    "step `{cmd}` {why}; its last output:\n{}",
                    lines.tail()
                )));
            }
            None => {
                return Err(ApiError::internal(format!(
                    "step `{cmd}`: the sandbox agent ended the stream without an exit status"
                )));
            }
        }
        let rec = self.edge.entry(id)?.snapshot();
        let backend = self.edge.backend(&rec.backend)?;
        self.edge.copy_container_changes(&rec, backend, upper).await
    }
}

/// A command's output cut into lines per stream, the last few kept.
#[derive(Default)]
struct Lines {
    partial: [Vec<u8>; 2],
    tail: VecDeque<String>,
}

impl Lines {
    fn push(&mut self, stream: usize, d: &[u8], progress: &mut dyn FnMut(&str)) {
        let buf = &mut self.partial[stream];
        buf.extend_from_slice(d);
        while let Some(i) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=i).collect();
            let text = String::from_utf8_lossy(&line[..line.len() - 1]).into_owned();
            Self::emit(&mut self.tail, text, progress);
        }
        // A line with no end in sight is shown in pieces rather than held.
        if buf.len() > 4096 {
            let text = String::from_utf8_lossy(buf).into_owned();
            buf.clear();
            Self::emit(&mut self.tail, text, progress);
        }
    }

    fn flush(&mut self, progress: &mut dyn FnMut(&str)) {
        for i in 0..2 {
            if !self.partial[i].is_empty() {
                let text = String::from_utf8_lossy(&self.partial[i]).into_owned();
                self.partial[i].clear();
                Self::emit(&mut self.tail, text, progress);
            }
        }
    }

    fn emit(tail: &mut VecDeque<String>, text: String, progress: &mut dyn FnMut(&str)) {
        progress(&text);
        tail.push_back(text);
        if tail.len() > TAIL_LINES {
            tail.pop_front();
        }
    }

    fn tail(&self) -> String {
        self.tail.iter().cloned().collect::<Vec<_>>().join("\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_is_cut_into_lines_and_the_tail_kept() {
        let mut seen = Vec::new();
        let mut l = Lines::default();
        let mut p = |s: &str| seen.push(s.to_string());
        l.push(0, b"a\nb", &mut p);
        l.push(1, b"err\n", &mut p);
        l.push(0, b"c\n", &mut p);
        for i in 0..30 {
            l.push(0, format!("{i}\n").as_bytes(), &mut p);
        }
        l.push(0, b"no end", &mut p);
        l.flush(&mut p);
        assert_eq!(&seen[..3], ["a", "err", "bc"]);
        assert_eq!(seen.last().map(String::as_str), Some("no end"));
        assert_eq!(l.tail().lines().count(), TAIL_LINES);
        assert!(l.tail().ends_with("29\nno end"));
    }
}
