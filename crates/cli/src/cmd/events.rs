//! `dsec events`: the lifecycle events of the key's sandboxes, once or followed.

use anyhow::Result;
use dsec_common::api::{Event, ListEventsResponse};
use hyper::Method;

use super::api;
use crate::ApiArgs;

#[derive(clap::Args)]
pub struct EventsArgs {
    /// Only events after this sequence number (the last one printed)
    #[arg(long, default_value_t = 0)]
    pub after: u64,
    /// Only this sandbox's events
    #[arg(long)]
    pub sandbox: Option<String>,
    /// Only events of this type (created, paused, resumed, updated, forked, snapshotted,
    /// stopped, expired, oom_killed)
    #[arg(long = "type")]
    pub kind: Option<String>,
    /// Keep printing events as they happen (until interrupted)
    #[arg(long, short)]
    pub follow: bool,
    #[command(flatten)]
    pub api: ApiArgs,
}

fn line(e: &Event) -> String {
    let secs = e.at_ms / 1000;
    let (h, m, s) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
    let mut l = format!(
        "{:>6} {h:02}:{m:02}:{s:02} {:<11} {}",
        e.seq, e.kind, e.sandbox
    );
    if let Some(r) = &e.reason {
        l.push_str(&format!(" ({r})"));
    }
    l.push_str(&format!(" {}", e.project));
    l
}

pub async fn run(a: EventsArgs) -> Result<i32> {
    let api = api(&a.api)?;
    let mut after = a.after;
    loop {
        let mut path = format!("/v1/events?limit=1000&after={after}");
        if let Some(s) = &a.sandbox {
            path.push_str(&format!("&sandbox={}", super::image::url_escape(s)));
        }
        if let Some(k) = &a.kind {
            path.push_str(&format!("&type={}", super::image::url_escape(k)));
        }
        if a.follow {
            path.push_str("&wait_seconds=30");
        }
        let r: ListEventsResponse = api.call(Method::GET, &path, None::<&()>).await?;
        for e in &r.events {
            if a.api.json {
                // One object per line, so a follower's output can be read as it comes.
                println!("{}", serde_json::to_string(e)?);
            } else {
                println!("{}", line(e));
            }
        }
        after = r.next;
        let more = r.events.len() >= 1000;
        if !a.follow && !more {
            return Ok(0);
        }
    }
}
