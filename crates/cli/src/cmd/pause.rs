//! Pause and resume: one sandbox, or every sandbox with given labels (a preempted job).

use std::collections::BTreeMap;

use anyhow::{Result, bail};
use dsec_common::api::{GroupRequest, GroupResponse, PauseRequest, ResumeRequest, SandboxInfo};
use hyper::Method;

use super::api;
use super::sandbox::parse_label;
use crate::{ApiArgs, output};

#[derive(clap::Args)]
pub struct PauseArgs {
    pub id: String,
    /// End the sandbox's processes, freeing the host's memory until `dsec resume` (a vm's
    /// memory is saved to disk; a container keeps its files and starts afresh)
    #[arg(long)]
    pub to_disk: bool,
    #[command(flatten)]
    pub api: ApiArgs,
}

#[derive(clap::Args)]
pub struct ResumeArgs {
    pub id: String,
    /// Resume on this edge of the cluster instead (vm backends): it pulls the saved state
    /// and the sandbox goes on there under a new id, which is printed
    #[arg(long)]
    pub edge: Option<String>,
    #[command(flatten)]
    pub api: ApiArgs,
}

#[derive(clap::Args)]
pub struct GroupArgs {
    /// KEY=VALUE a sandbox must have (repeatable; all must match; at least one)
    #[arg(long = "label", value_parser = parse_label, required = true)]
    pub labels: Vec<(String, String)>,
    /// Pause to disk instead of in place (pause-group only)
    #[arg(long)]
    pub to_disk: bool,
    #[command(flatten)]
    pub api: ApiArgs,
}

fn show(s: &SandboxInfo, json: bool) {
    if json {
        output::print_json(s);
    } else {
        let state = match (s.state, s.paused_to_disk) {
            (dsec_common::api::SandboxState::Paused, true) => "paused (on disk)".to_string(),
            (st, _) => format!("{st:?}").to_lowercase(),
        };
        match &s.moved_from {
            Some(old) => println!("{}: {state} (moved from {old} on another edge)", s.id),
            None => println!("{}: {state}", s.id),
        }
    }
}

pub async fn pause(a: PauseArgs) -> Result<i32> {
    let api = api(&a.api)?;
    let s: SandboxInfo = api
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{}/pause", a.id),
            Some(&PauseRequest { to_disk: a.to_disk }),
        )
        .await?;
    show(&s, a.api.json);
    Ok(0)
}

pub async fn resume(a: ResumeArgs) -> Result<i32> {
    let api = api(&a.api)?;
    let s: SandboxInfo = api
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{}/resume", a.id),
            Some(&ResumeRequest { edge: a.edge }),
        )
        .await?;
    show(&s, a.api.json);
    Ok(0)
}

/// `dsec pause-group` (`resume` false) and `dsec resume-group` (`resume` true).
pub async fn group(a: GroupArgs, resume: bool) -> Result<i32> {
    if resume && a.to_disk {
        bail!(
            "--to-disk applies to pause-group only; resume-group resumes wherever a sandbox was paused"
        );
    }
    let api = api(&a.api)?;
    let req = GroupRequest {
        labels: a.labels.into_iter().collect::<BTreeMap<_, _>>(),
        to_disk: a.to_disk,
    };
    let path = if resume {
        "/v1/groups/resume"
    } else {
        "/v1/groups/pause"
    };
    let r: GroupResponse = api.call(Method::POST, path, Some(&req)).await?;
    if a.api.json {
        output::print_json(&r);
    } else {
        for id in &r.done {
            println!("{id}");
        }
        for f in &r.failed {
            eprintln!("{}: {}", f.id, f.message);
        }
        eprintln!(
            "{} {} in {} ms, {} failed",
            r.done.len(),
            if resume { "resumed" } else { "paused" },
            r.took_ms,
            r.failed.len()
        );
    }
    Ok(if r.failed.is_empty() { 0 } else { 1 })
}
