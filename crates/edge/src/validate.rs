//! Request validation with messages that name the field, the allowed range and what was
//! sent.

use dsec_common::ApiError;
use dsec_common::api::{CreateSandboxRequest, ExecRequest, ForkRequest, Limits};
use dsec_common::channel::ExecSpec;

use crate::config::EdgeConfig;
use crate::host;

pub struct CreateParams {
    pub limits: Limits,
    pub ttl_seconds: u64,
    pub idle_timeout_seconds: Option<u64>,
    /// `on_timeout = "pause"`.
    pub pause_on_timeout: bool,
    /// `on_timeout = "pause_to_disk"`: that pause is to disk.
    pub pause_to_disk_on_timeout: bool,
}

const MAX_FORK_COUNT: u64 = 256;
const MAX_LABELS: usize = 64;

fn whole(field: &str, v: f64, min: u64, max: u64, unit: &str) -> Result<u64, ApiError> {
    if !v.is_finite() || v.fract() != 0.0 || v < min as f64 || v > max as f64 {
        return Err(ApiError::invalid(format!(
            "{field} must be a whole number from {min} to {max}{unit} (got {v})"
        )));
    }
    Ok(v as u64)
}

pub fn ttl(cfg: &EdgeConfig, field: &str, v: f64) -> Result<u64, ApiError> {
    whole(field, v, 1, cfg.max.ttl_seconds, " seconds")
}

pub fn create(cfg: &EdgeConfig, req: &CreateSandboxRequest) -> Result<CreateParams, ApiError> {
    if req.image.trim().is_empty() {
        return Err(ApiError::invalid(
            "image is required, e.g. \"root/py:3.11\" (see `dsec image ls`)",
        ));
    }
    let (total_mb, _) = host::memory_mb();
    let max_cpu = if cfg.max.cpu_cores > 0.0 {
        cfg.max.cpu_cores
    } else {
        host::cpus() as f64
    };
    let max_mem = if cfg.max.memory_mb > 0 {
        cfg.max.memory_mb
    } else {
        total_mb.max(16)
    };
    let cpu = req
        .cpu_cores_limit
        .unwrap_or(cfg.defaults.cpu_cores.min(max_cpu));
    if !cpu.is_finite() || cpu < 0.01 || cpu > max_cpu {
        return Err(ApiError::invalid(format!(
            "cpu_cores_limit must be from 0.01 to {max_cpu} (this node's limit) (got {cpu})"
        )));
    }
    let memory = whole(
        "memory_limit_mb",
        req.memory_limit_mb.unwrap_or(cfg.defaults.memory_mb as f64),
        16,
        max_mem,
        " MiB",
    )?;
    let disk = whole(
        "disk_limit_mb",
        req.disk_limit_mb.unwrap_or(cfg.defaults.disk_mb as f64),
        16,
        cfg.max.disk_mb,
        " MiB",
    )?;
    let pids = whole(
        "pids_limit",
        req.pids_limit.unwrap_or(cfg.defaults.pids as f64),
        16,
        cfg.max.pids,
        "",
    )?;
    let ttl_seconds = ttl(
        cfg,
        "ttl_seconds",
        req.ttl_seconds.unwrap_or(cfg.defaults.ttl_seconds as f64),
    )?;
    let idle_timeout_seconds = req
        .idle_timeout_seconds
        .map(|v| {
            whole(
                "idle_timeout_seconds",
                v,
                1,
                cfg.max.ttl_seconds,
                " seconds",
            )
        })
        .transpose()?;
    labels(&req.labels)?;
    for (k, v) in &req.env {
        if k.is_empty() || k.contains(['=', '\0']) || v.contains('\0') {
            return Err(ApiError::invalid(format!(
                "env variable {k:?} is not valid: names must be non-empty without '=' or NUL"
            )));
        }
    }
    let (pause_on_timeout, pause_to_disk_on_timeout) = match req.on_timeout.as_deref() {
        None | Some("stop") => (false, false),
        Some("pause") => (true, false),
        Some("pause_to_disk") => (true, true),
        Some(other) => {
            return Err(ApiError::invalid(format!(
                "on_timeout {other:?}: \"stop\" (the default), \"pause\" or \"pause_to_disk\""
            )));
        }
    };
    Ok(CreateParams {
        limits: Limits {
            cpu_cores: cpu,
            memory_mb: memory,
            disk_mb: disk,
            pids,
        },
        ttl_seconds,
        idle_timeout_seconds,
        pause_on_timeout,
        pause_to_disk_on_timeout,
    })
}

pub fn labels(l: &std::collections::BTreeMap<String, String>) -> Result<(), ApiError> {
    if l.len() > MAX_LABELS {
        return Err(ApiError::invalid(format!(
            "at most {MAX_LABELS} labels (got {})",
            l.len()
        )));
    }
    for (k, v) in l {
        if k.is_empty() || k.len() > 128 || v.len() > 1024 || k.contains(['=', ',']) {
            return Err(ApiError::invalid(format!(
                "label {k:?} is not valid: keys are 1-128 characters without '=' or ',', values up to 1024"
            )));
        }
    }
    Ok(())
}

pub fn exec(cfg: &EdgeConfig, req: &ExecRequest) -> Result<ExecSpec, ApiError> {
    let argv = match (&req.cmd, &req.argv) {
        (Some(c), None) => vec!["/bin/sh".to_string(), "-c".to_string(), c.clone()],
        (None, Some(a)) if !a.is_empty() => a.clone(),
        (None, Some(_)) => return Err(ApiError::invalid("argv must not be empty")),
        _ => {
            return Err(ApiError::invalid(
                "give exactly one of cmd (a shell command line) or argv (a program and its arguments)",
            ));
        }
    };
    if argv.iter().any(|a| a.contains('\0')) {
        return Err(ApiError::invalid(
            "command arguments must not contain NUL bytes",
        ));
    }
    if let Some(cwd) = &req.cwd
        && !cwd.starts_with('/')
    {
        return Err(ApiError::invalid(format!(
            "cwd must be an absolute path (got {cwd:?})"
        )));
    }
    for k in req.env.keys() {
        if k.is_empty() || k.contains(['=', '\0']) {
            return Err(ApiError::invalid(format!(
                "env variable {k:?} is not valid"
            )));
        }
    }
    let timeout = req
        .timeout_seconds
        .unwrap_or(cfg.default_exec_timeout_seconds);
    if !timeout.is_finite() || timeout <= 0.0 || timeout > cfg.max.ttl_seconds as f64 {
        return Err(ApiError::invalid(format!(
            "timeout_seconds must be more than 0 and at most {} (got {timeout})",
            cfg.max.ttl_seconds
        )));
    }
    if let Some(u) = &req.user
        && (u.is_empty() || u.len() > 64 || u.contains(['\0', ':', '\n']))
    {
        return Err(ApiError::invalid(format!(
            "user {u:?} is not a user name or uid"
        )));
    }
    if let Some(p) = &req.pty {
        if !(1..=1000).contains(&p.cols) || !(1..=1000).contains(&p.rows) {
            return Err(ApiError::invalid(format!(
                "pty cols and rows must be from 1 to 1000 (got {}x{})",
                p.cols, p.rows
            )));
        }
        if !req.stream && !req.background {
            return Err(ApiError::invalid(
                "a pty needs stream or background: a terminal is interactive",
            ));
        }
    }
    if req.stream && req.background {
        return Err(ApiError::invalid(
            "give at most one of stream and background",
        ));
    }
    if req.tag.as_ref().is_some_and(|t| t.len() > 256) {
        return Err(ApiError::invalid("tag must be at most 256 bytes"));
    }
    Ok(ExecSpec {
        argv,
        env: req.env.clone(),
        cwd: req.cwd.clone(),
        user: req.user.clone(),
        // Streamed and background processes run until they end unless given a timeout.
        timeout_ms: if (req.stream || req.background) && req.timeout_seconds.is_none() {
            None
        } else {
            Some((timeout * 1000.0) as u64)
        },
        stdin: req.stdin.clone(),
        max_output_bytes: cfg
            .max_output_bytes
            .min(dsec_common::channel::MAX_STREAM_OUTPUT),
    })
}

pub fn fork_count(req: &ForkRequest) -> Result<u64, ApiError> {
    labels(&req.labels)?;
    whole("count", req.count, 1, MAX_FORK_COUNT, "")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> CreateSandboxRequest {
        CreateSandboxRequest {
            backend: "container".into(),
            image: "root/py:3.11".into(),
            ..Default::default()
        }
    }

    #[test]
    fn defaults_apply_and_bad_limits_name_the_field() {
        let cfg = EdgeConfig::default();
        let ok = create(&cfg, &req()).unwrap();
        assert_eq!(ok.limits.memory_mb, 512);
        let err = |f: fn(&mut CreateSandboxRequest)| {
            let mut r = req();
            f(&mut r);
            create(&cfg, &r)
                .err()
                .map(|e| e.message)
                .unwrap_or_default()
        };
        assert!(err(|r| r.memory_limit_mb = Some(0.0)).starts_with("memory_limit_mb must be"));
        assert!(err(|r| r.memory_limit_mb = Some(-5.0)).contains("got -5"));
        assert!(err(|r| r.memory_limit_mb = Some(1e12)).contains("memory_limit_mb"));
        assert!(err(|r| r.cpu_cores_limit = Some(0.0)).starts_with("cpu_cores_limit"));
        assert!(err(|r| r.cpu_cores_limit = Some(1000.0)).starts_with("cpu_cores_limit"));
        assert!(err(|r| r.pids_limit = Some(1.5)).starts_with("pids_limit"));
        assert!(err(|r| r.disk_limit_mb = Some(10_000_000.0)).starts_with("disk_limit_mb"));
        assert!(err(|r| r.ttl_seconds = Some(0.0)).starts_with("ttl_seconds"));
        assert!(err(|r| r.image = String::new()).starts_with("image is required"));
    }

    #[test]
    fn exec_needs_exactly_one_command_form() {
        let cfg = EdgeConfig::default();
        assert!(exec(&cfg, &ExecRequest::default()).is_err());
        let both = ExecRequest {
            cmd: Some("ls".into()),
            argv: Some(vec!["ls".into()]),
            ..Default::default()
        };
        assert!(exec(&cfg, &both).is_err());
        let spec = exec(
            &cfg,
            &ExecRequest {
                cmd: Some("echo hi".into()),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(spec.argv, ["/bin/sh", "-c", "echo hi"]);
        let rel = ExecRequest {
            cmd: Some("ls".into()),
            cwd: Some("tmp".into()),
            ..Default::default()
        };
        assert!(exec(&cfg, &rel).unwrap_err().message.contains("absolute"));
    }
}
