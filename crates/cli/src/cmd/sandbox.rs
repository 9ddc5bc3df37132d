//! Sandbox commands: run, exec, ls, rm, fork, set-timeout.

use std::collections::BTreeMap;

use anyhow::Result;
use dsec_common::api::{
    CreateSandboxRequest, ExecRequest, ExecResult, ForkRequest, ForkResponse,
    ListSandboxesResponse, SandboxInfo, SetTimeoutRequest,
};
use hyper::Method;

use super::api;
use crate::{ApiArgs, output};

pub(crate) fn parse_label(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

#[derive(clap::Args)]
pub struct RunArgs {
    /// Image reference, e.g. root/py:3.11
    pub image: String,
    /// Command to run after the sandbox starts (after `--`)
    #[arg(last = true)]
    pub command: Vec<String>,
    #[arg(long, default_value = "container")]
    pub backend: String,
    /// CPU cores (fractions allowed)
    #[arg(long)]
    pub cpus: Option<f64>,
    /// Memory limit in MiB
    #[arg(long)]
    pub memory: Option<f64>,
    /// Writable disk limit in MiB
    #[arg(long)]
    pub disk: Option<f64>,
    /// Process limit
    #[arg(long)]
    pub pids: Option<f64>,
    /// Lifetime in seconds
    #[arg(long)]
    pub ttl: Option<f64>,
    /// When the lifetime runs out: stop (the default), pause (resume it later; it then
    /// has as long again) or pause_to_disk (its processes end, freeing its memory)
    #[arg(long, value_parser = ["stop", "pause", "pause_to_disk"])]
    pub on_timeout: Option<String>,
    /// When paused, resume on the next request to one of its ports
    #[arg(long)]
    pub auto_resume: bool,
    #[arg(long = "label", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    #[arg(long = "env", short = 'e', value_parser = parse_label)]
    pub env: Vec<(String, String)>,
    /// Stop the sandbox after the command
    #[arg(long)]
    pub rm: bool,
    /// Project whose quota it counts against (default: the API key's project)
    #[arg(long)]
    pub project: Option<String>,
    /// Let the sandbox reach this (repeatable): a service (pypi, npm, github, …), a domain
    /// (*.example.com) or an IPv4 CIDR with an optional port (203.0.113.0/24:443).
    /// Without any, egress is closed.
    #[arg(long = "allow", value_name = "RULE")]
    pub allow: Vec<String>,
    /// Set a header on its requests to a host (repeatable), e.g.
    /// `api.example.com:Authorization=Bearer sk-…`: the node adds it on the way out over
    /// HTTP and HTTPS, so the sandbox never holds the value. The host must be allowed.
    #[arg(long = "header", value_name = "HOST:NAME=VALUE", value_parser = parse_header)]
    pub headers: Vec<(String, String, String)>,
    /// `none`: no network at all, loopback only
    #[arg(long)]
    pub network: Option<String>,
    /// Mount a volume (repeatable): VOLUME:/PATH, or VOLUME:/PATH:ro read-only; VOLUME is
    /// its id or name (see `dsec volume ls`)
    #[arg(long = "volume", short = 'v', value_name = "VOLUME:/PATH[:ro]", value_parser = parse_volume)]
    pub volumes: Vec<dsec_common::api::VolumeMount>,
    #[command(flatten)]
    pub api: ApiArgs,
}

/// `VOLUME:/PATH[:ro]`.
fn parse_volume(s: &str) -> Result<dsec_common::api::VolumeMount, String> {
    let (volume, rest) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?} is not VOLUME:/PATH[:ro] (e.g. data:/mnt/data)"))?;
    let (path, read_only) = match rest.strip_suffix(":ro") {
        Some(p) => (p, true),
        None => (rest.strip_suffix(":rw").unwrap_or(rest), false),
    };
    if volume.is_empty() || !path.starts_with('/') {
        return Err(format!(
            "{s:?} is not VOLUME:/PATH[:ro] (e.g. data:/mnt/data)"
        ));
    }
    Ok(dsec_common::api::VolumeMount {
        volume: volume.to_string(),
        path: path.to_string(),
        read_only,
    })
}

/// `dsec network`: replace a running sandbox's egress rules.
#[derive(clap::Args)]
pub struct NetworkArgs {
    pub id: String,
    /// What it may reach from now on (repeatable); none at all closes egress
    #[arg(long = "allow", value_name = "RULE")]
    pub allow: Vec<String>,
    /// Headers set on its requests to a host from now on (repeatable, as `dsec run`)
    #[arg(long = "header", value_name = "HOST:NAME=VALUE", value_parser = parse_header)]
    pub headers: Vec<(String, String, String)>,
    #[command(flatten)]
    pub api: ApiArgs,
}

fn rules(allow: &[String]) -> BTreeMap<String, bool> {
    allow.iter().map(|r| (r.clone(), true)).collect()
}

fn parse_header(s: &str) -> std::result::Result<(String, String, String), String> {
    let (host, rest) = s
        .split_once(':')
        .ok_or("expected HOST:NAME=VALUE, e.g. api.example.com:Authorization=Bearer x")?;
    let (name, value) = rest
        .split_once('=')
        .ok_or("expected HOST:NAME=VALUE, e.g. api.example.com:Authorization=Bearer x")?;
    Ok((host.to_string(), name.to_string(), value.to_string()))
}

fn egress_headers(h: &[(String, String, String)]) -> dsec_common::api::EgressHeaders {
    let mut out = dsec_common::api::EgressHeaders::new();
    for (host, name, value) in h {
        out.entry(host.clone())
            .or_default()
            .insert(name.clone(), value.clone());
    }
    out
}

pub async fn network(a: NetworkArgs) -> Result<i32> {
    let api = api(&a.api)?;
    let body = dsec_common::api::SetNetworkRequest {
        network_rules: rules(&a.allow),
        egress_headers: egress_headers(&a.headers),
    };
    let sb: SandboxInfo = api
        .call(
            Method::PUT,
            &format!("/v1/sandboxes/{}/network", a.id),
            Some(&body),
        )
        .await?;
    if a.api.json {
        output::print_json(&sb.network);
    } else if sb.network.rules.is_empty() {
        println!("{}: egress closed", sb.id);
    } else {
        let r: Vec<&str> = sb.network.rules.keys().map(String::as_str).collect();
        println!("{}: may reach {}", sb.id, r.join(", "));
    }
    Ok(0)
}

#[derive(clap::Args)]
pub struct ExecArgs {
    pub id: String,
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
    #[arg(long)]
    pub timeout: Option<f64>,
    #[arg(long)]
    pub cwd: Option<String>,
    #[arg(long = "env", short = 'e', value_parser = parse_label)]
    pub env: Vec<(String, String)>,
    #[command(flatten)]
    pub api: ApiArgs,
}

#[derive(clap::Args)]
pub struct LsArgs {
    #[arg(long = "label", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    #[command(flatten)]
    pub api: ApiArgs,
}

#[derive(clap::Args)]
pub struct RmArgs {
    #[arg(required = true)]
    pub ids: Vec<String>,
    #[command(flatten)]
    pub api: ApiArgs,
}

#[derive(clap::Args)]
pub struct ForkArgs {
    pub id: String,
    /// How many copies
    #[arg(long, default_value_t = 1)]
    pub count: u32,
    /// KEY=VALUE for every copy (repeatable)
    #[arg(long = "label", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// Make the copies on this edge of the cluster (vm backends; default: the source's)
    #[arg(long)]
    pub edge: Option<String>,
    #[command(flatten)]
    pub api: ApiArgs,
}

#[derive(clap::Args)]
pub struct TimeoutArgs {
    pub id: String,
    /// Seconds from now
    pub ttl_seconds: u64,
    #[command(flatten)]
    pub api: ApiArgs,
}

/// Prints a command's output and returns its exit code as ours.
fn show_exec(r: &ExecResult, json: bool) -> i32 {
    if json {
        output::print_json(r);
        return r.exit_code;
    }
    print!("{}", r.stdout);
    eprint!("{}", r.stderr);
    exit_notes(
        r.timed_out,
        r.oom_killed,
        r.stdout_truncated || r.stderr_truncated,
    );
    r.exit_code
}

/// Notes on stderr for how a command ended.
pub fn exit_notes(timed_out: bool, oom_killed: bool, truncated: bool) {
    if timed_out {
        eprintln!("dsec: the command timed out and was killed");
    }
    if oom_killed {
        eprintln!(
            "dsec: the sandbox ran out of memory (memory_limit_mb) and the kernel killed a process"
        );
    }
    if truncated {
        eprintln!("dsec: output was truncated (more than the edge keeps per stream)");
    }
}

fn exec_request(
    cmd: &[String],
    env: &[(String, String)],
    timeout: Option<f64>,
    cwd: Option<String>,
) -> ExecRequest {
    ExecRequest {
        argv: Some(cmd.to_vec()),
        env: env.iter().cloned().collect(),
        timeout_seconds: timeout,
        cwd,
        ..Default::default()
    }
}

pub async fn run(a: RunArgs) -> Result<i32> {
    let api = api(&a.api)?;
    let req = CreateSandboxRequest {
        backend: a.backend.clone(),
        image: a.image.clone(),
        cpu_cores_limit: a.cpus,
        memory_limit_mb: a.memory,
        disk_limit_mb: a.disk,
        pids_limit: a.pids,
        ttl_seconds: a.ttl,
        idle_timeout_seconds: None,
        on_timeout: a.on_timeout.clone(),
        auto_resume: a.auto_resume.then_some(true),
        labels: a.labels.iter().cloned().collect::<BTreeMap<_, _>>(),
        env: BTreeMap::new(),
        project: a.project.clone(),
        network: a.network.clone(),
        network_rules: rules(&a.allow),
        egress_headers: egress_headers(&a.headers),
        volumes: a.volumes.clone(),
    };
    let sb: SandboxInfo = api.call(Method::POST, "/v1/sandboxes", Some(&req)).await?;
    if a.command.is_empty() {
        if a.api.json {
            output::print_json(&sb);
        } else {
            println!("{}", sb.id);
        }
        return Ok(0);
    }
    if !a.api.json {
        eprintln!("sandbox {}", sb.id);
    }
    let r: Result<ExecResult> = api
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{}/exec", sb.id),
            Some(&exec_request(&a.command, &a.env, None, None)),
        )
        .await;
    if a.rm {
        api.call::<serde_json::Value>(
            Method::DELETE,
            &format!("/v1/sandboxes/{}", sb.id),
            None::<&()>,
        )
        .await?;
    }
    Ok(show_exec(&r?, a.api.json))
}

pub async fn exec(a: ExecArgs) -> Result<i32> {
    let api = api(&a.api)?;
    let r: ExecResult = api
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{}/exec", a.id),
            Some(&exec_request(&a.command, &a.env, a.timeout, a.cwd.clone())),
        )
        .await?;
    Ok(show_exec(&r, a.api.json))
}

pub async fn ls(a: LsArgs) -> Result<i32> {
    let api = api(&a.api)?;
    let q: Vec<String> = a
        .labels
        .iter()
        .map(|(k, v)| format!("label={k}%3D{v}"))
        .collect();
    let path = if q.is_empty() {
        "/v1/sandboxes".to_string()
    } else {
        format!("/v1/sandboxes?{}", q.join("&"))
    };
    let l: ListSandboxesResponse = api.call(Method::GET, &path, None::<&()>).await?;
    if a.api.json {
        output::print_json(&l);
        return Ok(0);
    }
    let rows = l
        .sandboxes
        .iter()
        .map(|s| {
            vec![
                s.id.clone(),
                s.backend.clone(),
                s.image.clone(),
                format!("{:?}", s.state).to_lowercase(),
                format!("{} cpu / {} MiB", s.limits.cpu_cores, s.limits.memory_mb),
                output::ago_ms(s.created_at_ms),
                output::in_ms(s.expires_at_ms),
            ]
        })
        .collect();
    println!(
        "{}",
        output::table(
            &[
                "id", "backend", "image", "state", "limits", "created", "expires"
            ],
            rows
        )
    );
    Ok(0)
}

pub async fn rm(a: RmArgs) -> Result<i32> {
    let api = api(&a.api)?;
    let mut failed = 0;
    for id in &a.ids {
        match api
            .call::<serde_json::Value>(Method::DELETE, &format!("/v1/sandboxes/{id}"), None::<&()>)
            .await
        {
            Ok(_) => println!("{id}"),
            Err(e) => {
                eprintln!("{id}: {e:#}");
                failed += 1;
            }
        }
    }
    Ok(if failed > 0 { 1 } else { 0 })
}

pub async fn fork(a: ForkArgs) -> Result<i32> {
    let api = api(&a.api)?;
    let req = ForkRequest {
        count: a.count as f64,
        labels: a.labels.into_iter().collect(),
        edge: a.edge,
    };
    let r: ForkResponse = api
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{}/fork", a.id),
            Some(&req),
        )
        .await?;
    if a.api.json {
        output::print_json(&r);
        return Ok(0);
    }
    for s in &r.sandboxes {
        println!("{}", s.id);
    }
    eprintln!("source paused {} ms; {}", r.source_paused_ms, r.note);
    Ok(0)
}

pub async fn set_timeout(a: TimeoutArgs) -> Result<i32> {
    let api = api(&a.api)?;
    let s: SandboxInfo = api
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{}/timeout", a.id),
            Some(&SetTimeoutRequest {
                ttl_seconds: a.ttl_seconds as f64,
            }),
        )
        .await?;
    if a.api.json {
        output::print_json(&s);
    } else {
        println!("{} expires {}", s.id, output::in_ms(s.expires_at_ms));
    }
    Ok(0)
}
