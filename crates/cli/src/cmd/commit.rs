//! `dsec commit`: a sandbox's filesystem changes become a new image.

use anyhow::Result;
use dsec_common::api::{CommitRequest, CommitResponse};
use hyper::Method;

use super::api;
use crate::ApiArgs;
use crate::output;

#[derive(clap::Args)]
pub struct CommitArgs {
    /// The running sandbox whose changes to commit
    #[arg(value_name = "SANDBOX_ID")]
    pub id: String,
    /// The new image's reference, ns/name[:tag] (tag defaults to latest)
    #[arg(value_name = "IMAGE_REF")]
    pub image: String,
    /// Replace IMAGE_REF if it already exists
    #[arg(long)]
    pub overwrite: bool,
    #[command(flatten)]
    pub api: ApiArgs,
}

pub async fn commit(a: CommitArgs) -> Result<i32> {
    let api = api(&a.api)?;
    let req = CommitRequest {
        image: a.image.clone(),
        overwrite: a.overwrite,
    };
    let r: CommitResponse = api
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{}/commit", a.id),
            Some(&req),
        )
        .await?;
    if a.api.json {
        output::print_json(&r);
        return Ok(0);
    }
    println!("{}", r.image);
    eprintln!(
        "digest {}, {} layers, {}; sandbox paused {} ms",
        &r.digest[..r.digest.len().min(12)],
        r.layers.len(),
        human_bytes(r.size_bytes),
        r.paused_ms
    );
    Ok(0)
}

fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if b < 1024 {
        return format!("{b} B");
    }
    let mut v = b as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes_read_well() {
        assert_eq!(super::human_bytes(512), "512 B");
        assert_eq!(super::human_bytes(1536), "1.5 KiB");
        assert_eq!(super::human_bytes(180 << 20), "180.0 MiB");
    }
}
