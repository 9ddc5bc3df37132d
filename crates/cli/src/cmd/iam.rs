//! `dsec iam`: projects, quotas and API keys, through the API. A key acts on its own
//! project and the projects inside it.

use anyhow::Result;
use hyper::Method;
use serde_json::{Value, json};

use super::api;
use crate::{ApiArgs, output};

#[derive(clap::Subcommand)]
pub enum IamCommand {
    /// Show who the API key belongs to
    #[command(after_help = "Example:\n  dsec iam whoami")]
    Whoami(ApiOnly),
    /// Create a project inside one the key can use, with a quota
    #[command(
        name = "project-create",
        after_help = "Example:\n  dsec iam project-create root/team-a --sandboxes 100 --cpus 64 --memory 131072 --disk 500000"
    )]
    ProjectCreate(ProjectArgs),
    /// List the projects the key can see, with quotas and usage
    #[command(
        name = "project-ls",
        after_help = "Example:\n  dsec iam project-ls --json"
    )]
    ProjectLs(ApiOnly),
    /// Set a project's quota (only a key of a parent project can)
    #[command(
        name = "quota-set",
        after_help = "Example:\n  dsec iam quota-set root/team-a --sandboxes 50"
    )]
    QuotaSet(ProjectArgs),
    /// Create an API key for a person or an agent in a project
    #[command(
        name = "key-create",
        after_help = "Examples:\n  dsec iam key-create --project root/team-a --name rl-trainer --agent\n  dsec iam key-create --project root/team-a --name e2b-jobs --e2b-format"
    )]
    KeyCreate(KeyArgs),
    /// List API keys (ids only; keys are shown once, when made)
    #[command(name = "key-ls", after_help = "Example:\n  dsec iam key-ls")]
    KeyLs(ApiOnly),
    /// Revoke an API key by its id
    #[command(
        name = "key-revoke",
        after_help = "Example:\n  dsec iam key-revoke 3fa0c2d9e1b4"
    )]
    KeyRevoke(RevokeArgs),
}

#[derive(clap::Args)]
pub struct ApiOnly {
    #[command(flatten)]
    pub api: ApiArgs,
}

#[derive(clap::Args)]
pub struct ProjectArgs {
    /// Project path, e.g. root/team-a/exp-1
    pub project: String,
    /// Most sandboxes at once (the whole subtree counts)
    #[arg(long)]
    pub sandboxes: Option<u64>,
    /// Most CPU cores of sandbox limits
    #[arg(long)]
    pub cpus: Option<f64>,
    /// Most MiB of sandbox memory limits
    #[arg(long)]
    pub memory: Option<u64>,
    /// Most MiB of disk: sandboxes' disk limits, snapshots and committed images
    #[arg(long)]
    pub disk: Option<u64>,
    #[command(flatten)]
    pub api: ApiArgs,
}

#[derive(clap::Args)]
pub struct KeyArgs {
    /// Project of the key (default: the calling key's project)
    #[arg(long)]
    pub project: Option<String>,
    /// Who the key is for
    #[arg(long)]
    pub name: String,
    /// The key is for an agent (a program), not a person
    #[arg(long)]
    pub agent: bool,
    /// Make the key in E2B's format (`e2b_` and 40 hex digits), for programs written for
    /// E2B that check a key's shape
    #[arg(long)]
    pub e2b_format: bool,
    #[command(flatten)]
    pub api: ApiArgs,
}

#[derive(clap::Args)]
pub struct RevokeArgs {
    pub key_id: String,
    #[command(flatten)]
    pub api: ApiArgs,
}

fn quota(a: &ProjectArgs) -> Value {
    let mut q = serde_json::Map::new();
    if let Some(v) = a.sandboxes {
        q.insert("sandboxes".into(), json!(v));
    }
    if let Some(v) = a.cpus {
        q.insert("cpu_cores".into(), json!(v));
    }
    if let Some(v) = a.memory {
        q.insert("memory_mb".into(), json!(v));
    }
    if let Some(v) = a.disk {
        q.insert("disk_mb".into(), json!(v));
    }
    Value::Object(q)
}

fn limit(q: &Value, k: &str) -> String {
    q.get(k)
        .map(|v| v.to_string())
        .unwrap_or_else(|| "-".into())
}

fn show_project(v: &Value) -> Vec<String> {
    let (q, u) = (&v["quota"], &v["usage"]);
    vec![
        v["path"].as_str().unwrap_or("").to_string(),
        format!("{} / {}", u["sandboxes"], limit(q, "sandboxes")),
        format!("{} / {}", u["cpu_cores"], limit(q, "cpu_cores")),
        format!("{} / {}", u["memory_mb"], limit(q, "memory_mb")),
        format!("{} / {}", u["disk_mb"], limit(q, "disk_mb")),
    ]
}

pub async fn run(c: IamCommand) -> Result<i32> {
    match c {
        IamCommand::Whoami(a) => {
            let v: Value = api(&a.api)?
                .call(Method::GET, "/v1/whoami", None::<&()>)
                .await?;
            if a.api.json {
                output::print_json(&v);
            } else {
                println!(
                    "{} ({}) in project {}, key {}",
                    v["principal"].as_str().unwrap_or(""),
                    v["kind"].as_str().unwrap_or(""),
                    v["project"].as_str().unwrap_or(""),
                    v["key_id"].as_str().unwrap_or("")
                );
            }
        }
        IamCommand::ProjectCreate(a) => {
            let body = json!({"project": a.project, "quota": quota(&a)});
            let v: Value = api(&a.api)?
                .call(Method::POST, "/v1/projects", Some(&body))
                .await?;
            print_projects(&[v], a.api.json);
        }
        IamCommand::QuotaSet(a) => {
            let body = json!({"project": a.project, "quota": quota(&a)});
            let v: Value = api(&a.api)?
                .call(Method::POST, "/v1/projects/quota", Some(&body))
                .await?;
            print_projects(&[v], a.api.json);
        }
        IamCommand::ProjectLs(a) => {
            let v: Value = api(&a.api)?
                .call(Method::GET, "/v1/projects", None::<&()>)
                .await?;
            let list = v["projects"].as_array().cloned().unwrap_or_default();
            print_projects(&list, a.api.json);
        }
        IamCommand::KeyCreate(a) => {
            let body = json!({
                "project": a.project,
                "principal": a.name,
                "kind": if a.agent { "agent" } else { "human" },
                "format": if a.e2b_format { "e2b" } else { "dsec" },
            });
            let v: Value = api(&a.api)?
                .call(Method::POST, "/v1/keys", Some(&body))
                .await?;
            if a.api.json {
                output::print_json(&v);
            } else {
                println!("{}", v["key"].as_str().unwrap_or(""));
                eprintln!(
                    "key {} for {} in {}: this is the only time the key is shown",
                    v["key_id"].as_str().unwrap_or(""),
                    v["principal"].as_str().unwrap_or(""),
                    v["project"].as_str().unwrap_or("")
                );
            }
        }
        IamCommand::KeyLs(a) => {
            let v: Value = api(&a.api)?
                .call(Method::GET, "/v1/keys", None::<&()>)
                .await?;
            if a.api.json {
                output::print_json(&v);
            } else {
                let rows = v["keys"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                    .iter()
                    .map(|k| {
                        vec![
                            k["key_id"].as_str().unwrap_or("").to_string(),
                            k["principal"].as_str().unwrap_or("").to_string(),
                            k["kind"].as_str().unwrap_or("").to_string(),
                            k["project"].as_str().unwrap_or("").to_string(),
                            if k["revoked"].as_bool() == Some(true) {
                                "revoked".into()
                            } else {
                                "active".into()
                            },
                        ]
                    })
                    .collect();
                println!(
                    "{}",
                    output::table(&["key id", "principal", "kind", "project", "state"], rows)
                );
            }
        }
        IamCommand::KeyRevoke(a) => {
            api(&a.api)?
                .call::<Value>(
                    Method::DELETE,
                    &format!("/v1/keys/{}", a.key_id),
                    None::<&()>,
                )
                .await?;
            if !a.api.json {
                println!("revoked {}", a.key_id);
            }
        }
    }
    Ok(0)
}

fn print_projects(list: &[Value], json: bool) {
    if json {
        output::print_json(&list);
        return;
    }
    let rows = list.iter().map(show_project).collect();
    println!(
        "{}",
        output::table(
            &[
                "project",
                "sandboxes (used / quota)",
                "cpus",
                "memory MiB",
                "disk MiB"
            ],
            rows
        )
    );
}
