//! `dsec snapshot create|ls|restore|rm`: a sandbox's state kept under an id.

use anyhow::Result;
use dsec_common::api::{ForkRequest, ForkResponse, ListSnapshotsResponse, SnapshotInfo};
use hyper::Method;

use super::api;
use super::sandbox::parse_label;
use crate::{ApiArgs, output};

#[derive(clap::Subcommand)]
pub enum SnapshotCommand {
    /// Keep a running sandbox's state under a new id (vm: memory and devices; container:
    /// its files); the sandbox pauses briefly
    #[command(after_help = "Example:\n  dsec snapshot create local-0123456789ab")]
    Create(IdArgs),
    /// List the snapshots your key's project can see
    #[command(after_help = "Example:\n  dsec snapshot ls --json")]
    Ls(ListArgs),
    /// Start sandboxes from a snapshot (vm: each goes on from where the source was)
    #[command(
        after_help = "Example:\n  dsec snapshot restore local-0123456789ab --count 8 --label job=7\n  dsec snapshot restore edge1-0123456789ab --edge edge2   # that edge pulls it"
    )]
    Restore(RestoreArgs),
    /// Delete a snapshot (sandboxes restored from it keep running)
    #[command(after_help = "Example:\n  dsec snapshot rm local-0123456789ab")]
    Rm(IdArgs),
}

#[derive(clap::Args)]
pub struct IdArgs {
    pub id: String,
    #[command(flatten)]
    pub api: ApiArgs,
}

#[derive(clap::Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub api: ApiArgs,
}

#[derive(clap::Args)]
pub struct RestoreArgs {
    /// The snapshot's id
    pub id: String,
    #[arg(long, default_value_t = 1)]
    pub count: u32,
    /// KEY=VALUE for every new sandbox (repeatable)
    #[arg(long = "label", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// Start them on this edge of the cluster (default: the snapshot's)
    #[arg(long)]
    pub edge: Option<String>,
    #[command(flatten)]
    pub api: ApiArgs,
}

fn rows(list: &[SnapshotInfo]) -> String {
    output::table(
        &[
            "id", "source", "backend", "image", "memory", "size", "created",
        ],
        list.iter()
            .map(|s| {
                vec![
                    s.id.clone(),
                    s.source.clone(),
                    s.backend.clone(),
                    s.image.clone(),
                    if s.memory_preserved { "yes" } else { "no" }.into(),
                    format!("{:.1} MiB", s.size_bytes as f64 / (1 << 20) as f64),
                    output::ago_ms(s.created_at_ms),
                ]
            })
            .collect(),
    )
}

pub async fn run(c: SnapshotCommand) -> Result<i32> {
    match c {
        SnapshotCommand::Create(a) => {
            let s: SnapshotInfo = api(&a.api)?
                .call(
                    Method::POST,
                    &format!("/v1/sandboxes/{}/snapshot", a.id),
                    None::<&()>,
                )
                .await?;
            if a.api.json {
                output::print_json(&s);
            } else {
                println!("{}", s.id);
                eprintln!(
                    "{} kept ({:.1} MiB{}), source paused {} ms",
                    s.id,
                    s.size_bytes as f64 / (1 << 20) as f64,
                    if s.memory_preserved {
                        ", with its memory"
                    } else {
                        ", files only"
                    },
                    s.source_paused_ms
                );
            }
        }
        SnapshotCommand::Ls(a) => {
            let r: ListSnapshotsResponse = api(&a.api)?
                .call(Method::GET, "/v1/snapshots", None::<&()>)
                .await?;
            if a.api.json {
                output::print_json(&r.snapshots);
            } else {
                print!("{}", rows(&r.snapshots));
            }
        }
        SnapshotCommand::Restore(a) => {
            let req = ForkRequest {
                count: a.count as f64,
                labels: a.labels.into_iter().collect(),
                edge: a.edge,
            };
            let r: ForkResponse = api(&a.api)?
                .call(
                    Method::POST,
                    &format!("/v1/snapshots/{}/restore", a.id),
                    Some(&req),
                )
                .await?;
            if a.api.json {
                output::print_json(&r);
            } else {
                for s in &r.sandboxes {
                    println!("{}", s.id);
                }
                eprintln!("{}", r.note);
            }
        }
        SnapshotCommand::Rm(a) => {
            api(&a.api)?
                .call::<serde_json::Value>(
                    Method::DELETE,
                    &format!("/v1/snapshots/{}", a.id),
                    None::<&()>,
                )
                .await?;
            println!("{}", a.id);
        }
    }
    Ok(0)
}
