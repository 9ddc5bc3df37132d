//! `dsec volume create|ls|rm|put|get|files`: volumes, file systems kept apart from
//! sandboxes that sandboxes mount (`dsec run -v NAME:/mnt/data`).

use anyhow::{Context, Result};
use dsec_common::api::{CreateVolumeRequest, ListVolumesResponse, VolumeEntry, VolumeInfo};
use http_body_util::BodyExt;
use hyper::Method;

use super::api;
use crate::{ApiArgs, output};

#[derive(clap::Subcommand)]
pub enum VolumeCommand {
    /// Create a volume (its size counts against the project's disk quota)
    #[command(
        after_help = "Example:\n  dsec volume create data --size 2048\n  dsec run -v data:/mnt/data root/base -- ls /mnt/data"
    )]
    Create(CreateArgs),
    /// List the volumes your key's project can see
    #[command(after_help = "Example:\n  dsec volume ls --json")]
    Ls(ListArgs),
    /// Delete a volume and its files (refused while a sandbox mounts it)
    #[command(after_help = "Example:\n  dsec volume rm local-0123456789ab")]
    Rm(IdArgs),
    /// Write a local file into a volume
    #[command(
        after_help = "Example:\n  dsec volume put local-0123456789ab ./train.csv /data/train.csv"
    )]
    Put(PutArgs),
    /// Print a file of a volume (or write it to --out)
    #[command(
        after_help = "Example:\n  dsec volume get local-0123456789ab /data/train.csv --out train.csv"
    )]
    Get(GetArgs),
    /// List a directory of a volume
    #[command(after_help = "Example:\n  dsec volume files local-0123456789ab / --depth 2")]
    Files(FilesArgs),
}

#[derive(clap::Args)]
pub struct CreateArgs {
    /// [a-z0-9._-], unique in its project
    pub name: String,
    /// What it may hold, in MiB (default 1024)
    #[arg(long)]
    pub size: Option<f64>,
    /// Its project (default: the API key's)
    #[arg(long)]
    pub project: Option<String>,
    #[command(flatten)]
    pub api: ApiArgs,
}

#[derive(clap::Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub api: ApiArgs,
}

#[derive(clap::Args)]
pub struct IdArgs {
    /// The volume's id
    pub id: String,
    #[command(flatten)]
    pub api: ApiArgs,
}

#[derive(clap::Args)]
pub struct PutArgs {
    pub id: String,
    /// Local file to send
    pub local: std::path::PathBuf,
    /// Where it goes in the volume
    pub path: String,
    #[command(flatten)]
    pub api: ApiArgs,
}

#[derive(clap::Args)]
pub struct GetArgs {
    pub id: String,
    pub path: String,
    /// Write it here instead of standard output
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub api: ApiArgs,
}

#[derive(clap::Args)]
pub struct FilesArgs {
    pub id: String,
    #[arg(default_value = "/")]
    pub path: String,
    #[arg(long, default_value_t = 1)]
    pub depth: u32,
    #[command(flatten)]
    pub api: ApiArgs,
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1 << 20) as f64)
}

fn rows(list: &[VolumeInfo]) -> String {
    output::table(
        &["id", "name", "project", "size", "used", "created"],
        list.iter()
            .map(|v| {
                vec![
                    v.id.clone(),
                    v.name.clone(),
                    v.project.clone(),
                    format!("{} MiB", v.size_mb),
                    mib(v.used_bytes),
                    output::ago_ms(v.created_at_ms),
                ]
            })
            .collect(),
    )
}

/// `path` as a query value.
fn query(path: &str) -> String {
    super::runtime::encode(path, true)
}

pub async fn run(c: VolumeCommand) -> Result<i32> {
    match c {
        VolumeCommand::Create(a) => {
            let req = CreateVolumeRequest {
                name: a.name.clone(),
                project: a.project.clone(),
                size_mb: a.size,
            };
            let v: VolumeInfo = api(&a.api)?
                .call(Method::POST, "/v1/volumes", Some(&req))
                .await?;
            if a.api.json {
                output::print_json(&v);
            } else {
                println!("{}", v.id);
                eprintln!(
                    "volume {} ({} MiB) in {}: mount it with `dsec run -v {}:/mnt/data ...`",
                    v.name, v.size_mb, v.project, v.name
                );
            }
        }
        VolumeCommand::Ls(a) => {
            let r: ListVolumesResponse = api(&a.api)?
                .call(Method::GET, "/v1/volumes", None::<&()>)
                .await?;
            if a.api.json {
                output::print_json(&r.volumes);
            } else {
                print!("{}", rows(&r.volumes));
            }
        }
        VolumeCommand::Rm(a) => {
            api(&a.api)?
                .call::<serde_json::Value>(
                    Method::DELETE,
                    &format!("/v1/volumes/{}", a.id),
                    None::<&()>,
                )
                .await?;
            println!("{}", a.id);
        }
        VolumeCommand::Put(a) => {
            // Streamed from the file (or stdin, `-`), with progress on a terminal.
            let src = a.local.to_string_lossy().into_owned();
            let (reader, size, _) = super::runtime::open_local(&src).await?;
            let bar = super::runtime::progress(size, a.api.json);
            let t0 = std::time::Instant::now();
            let resp = api(&a.api)?
                .open(
                    Method::PUT,
                    &format!("/v1/volumes/{}/files?path={}", a.id, query(&a.path)),
                    "application/octet-stream",
                    super::runtime::body_of(reader, bar.clone()),
                )
                .await
                .with_context(|| format!("uploading {src} to volume {}:{}", a.id, a.path));
            bar.finish_and_clear();
            let body = resp?.into_body().collect().await?.to_bytes();
            let e: VolumeEntry =
                serde_json::from_slice(&body).context("unexpected reply to the upload")?;
            if a.api.json {
                output::print_json(&e);
            } else {
                println!(
                    "{} ({} bytes in {:.2} s)",
                    e.path,
                    e.size,
                    t0.elapsed().as_secs_f64()
                );
            }
        }
        VolumeCommand::Get(a) => {
            let resp = api(&a.api)?
                .open(
                    Method::GET,
                    &format!("/v1/volumes/{}/files?path={}", a.id, query(&a.path)),
                    "application/json",
                    crate::client::full(Vec::new()),
                )
                .await?;
            let len = resp
                .headers()
                .get(hyper::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
            let dst = a
                .out
                .as_ref()
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_else(|| "-".into());
            // Only now that the file is there: a failed request leaves the local file alone.
            let mut out = super::runtime::create_local(&dst, &a.path).await?;
            let bar = super::runtime::progress(len, a.api.json);
            let r = super::runtime::copy_body(resp.into_body(), &mut out, &bar).await;
            bar.finish_and_clear();
            r.with_context(|| format!("downloading volume {}:{} to {dst}", a.id, a.path))?;
        }
        VolumeCommand::Files(a) => {
            let r: serde_json::Value = api(&a.api)?
                .call(
                    Method::GET,
                    &format!(
                        "/v1/volumes/{}/list?path={}&depth={}",
                        a.id,
                        query(&a.path),
                        a.depth
                    ),
                    None::<&()>,
                )
                .await?;
            let entries: Vec<VolumeEntry> =
                serde_json::from_value(r["entries"].clone()).unwrap_or_default();
            if a.api.json {
                output::print_json(&entries);
            } else {
                print!(
                    "{}",
                    output::table(
                        &["path", "type", "size", "mode", "owner"],
                        entries
                            .iter()
                            .map(|e| vec![
                                e.path.clone(),
                                e.kind.clone(),
                                e.size.to_string(),
                                format!("{:o}", e.mode & 0o7777),
                                format!("{}:{}", e.uid, e.gid),
                            ])
                            .collect(),
                    )
                );
            }
        }
    }
    Ok(0)
}
