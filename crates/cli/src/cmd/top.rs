//! `dsec top`: the key's sandboxes by what they use (CPU over the node's last reading
//! interval, memory), refreshed as the node takes new readings. One `GET /v1/usage` per
//! refresh, whatever the number of sandboxes: the node answers from readings it keeps.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use anyhow::Result;
use dsec_common::api::{SandboxUsage, UsageResponse};
use hyper::Method;

use super::api;
use super::sandbox::parse_label;
use crate::ApiArgs;
use crate::output;

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SortBy {
    Cpu,
    Memory,
    Id,
}

#[derive(clap::Args)]
pub struct TopArgs {
    /// Print one screen and return (for scripts)
    #[arg(long)]
    pub once: bool,
    /// Seconds between refreshes (default: the node's reading interval)
    #[arg(long)]
    pub interval: Option<f64>,
    /// Order of the rows
    #[arg(long, value_enum, default_value = "cpu")]
    pub sort: SortBy,
    /// The most rows to show (default: what fits the terminal; all when not one)
    #[arg(long, short = 'n')]
    pub limit: Option<usize>,
    /// Only sandboxes with this label (KEY=VALUE; repeat to require several)
    #[arg(long = "label", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    #[command(flatten)]
    pub api: ApiArgs,
}

/// Bytes in a short form: `512B`, `12.5M`, `3.0G`.
fn short_bytes(b: u64) -> String {
    const UNITS: [&str; 4] = ["K", "M", "G", "T"];
    if b < 1024 {
        return format!("{b}B");
    }
    let mut v = b as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if v >= 100.0 {
        format!("{v:.0}{}", UNITS[unit])
    } else {
        format!("{v:.1}{}", UNITS[unit])
    }
}

fn sort(rows: &mut [SandboxUsage], by: SortBy) {
    let cpu = |u: &SandboxUsage| u.cpu_percent.unwrap_or(-1.0);
    match by {
        SortBy::Cpu => rows.sort_by(|a, b| cpu(b).total_cmp(&cpu(a)).then(a.id.cmp(&b.id))),
        SortBy::Memory => rows.sort_by(|a, b| {
            b.memory_used_bytes
                .cmp(&a.memory_used_bytes)
                .then(a.id.cmp(&b.id))
        }),
        SortBy::Id => rows.sort_by(|a, b| a.id.cmp(&b.id)),
    }
}

/// One screen: a summary line and a table of at most `limit` rows (memory in use, and
/// in percent of the sandbox's limit).
fn screen(u: &UsageResponse, limit: Option<usize>) -> String {
    let running = u
        .sandboxes
        .iter()
        .filter(|s| s.state == dsec_common::api::SandboxState::Running)
        .count();
    let cpu: f64 = u.sandboxes.iter().filter_map(|s| s.cpu_percent).sum();
    let mem: u64 = u.sandboxes.iter().map(|s| s.memory_used_bytes).sum();
    let mut out = format!(
        "{} sandboxes, {running} running; CPU {cpu:.1}% of a core, memory {}\n",
        u.sandboxes.len(),
        short_bytes(mem)
    );
    let shown = limit.unwrap_or(usize::MAX).min(u.sandboxes.len());
    let rows = u.sandboxes[..shown]
        .iter()
        .map(|s| {
            let pct = if s.memory_limit_bytes > 0 {
                format!(
                    " {:.0}%",
                    s.memory_used_bytes as f64 * 100.0 / s.memory_limit_bytes as f64
                )
            } else {
                String::new()
            };
            vec![
                s.id.clone(),
                s.project.clone(),
                format!("{:?}", s.state).to_lowercase(),
                s.cpu_percent
                    .map_or("-".to_string(), |c| format!("{c:.1}%")),
                format!("{}{pct}", short_bytes(s.memory_used_bytes)),
                s.backend.clone(),
            ]
        })
        .collect();
    out.push_str(&output::table(
        &["id", "project", "state", "cpu", "memory", "backend"],
        rows,
    ));
    if shown < u.sandboxes.len() {
        out.push_str(&format!(
            "\n… and {} more (--limit, --sort)",
            u.sandboxes.len() - shown
        ));
    }
    out
}

pub async fn run(a: TopArgs) -> Result<i32> {
    let api = api(&a.api)?;
    let q: Vec<String> = a
        .labels
        .iter()
        .map(|(k, v)| {
            format!(
                "label={}%3D{}",
                super::image::url_escape(k),
                super::image::url_escape(v)
            )
        })
        .collect();
    let path = if q.is_empty() {
        "/v1/usage".to_string()
    } else {
        format!("/v1/usage?{}", q.join("&"))
    };
    let live = std::io::stdout().is_terminal() && !a.once;
    loop {
        let mut u: UsageResponse = api.call(Method::GET, &path, None::<&()>).await?;
        sort(&mut u.sandboxes, a.sort);
        if a.api.json {
            output::print_json(&u);
        } else {
            // Rows that fit under the summary, the table's borders and header.
            let fit = live.then(|| (output::term_size().1 as usize).saturating_sub(6).max(1));
            let text = screen(&u, a.limit.or(fit));
            if live {
                // Home and clear, then the new screen.
                println!("\x1b[H\x1b[2J{text}");
            } else {
                println!("{text}");
            }
            std::io::stdout().flush()?;
        }
        if a.once {
            return Ok(0);
        }
        let every = a
            .interval
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .unwrap_or(Duration::from_millis(u.interval_ms.max(1000)));
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = tokio::signal::ctrl_c() => return Ok(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_common::api::SandboxState;

    fn u(id: &str, cpu: Option<f64>, mem: u64) -> SandboxUsage {
        SandboxUsage {
            id: id.into(),
            project: "root/team-with-a-long-name".into(),
            state: SandboxState::Running,
            backend: "container".into(),
            image: "root/base".into(),
            cpu_cores: 1.0,
            cpu_percent: cpu,
            memory_used_bytes: mem,
            memory_limit_bytes: 64 << 20,
            sampled_at_ms: 1,
        }
    }

    #[test]
    fn a_screen_sorts_fits_80_columns_and_says_what_it_left_out() {
        let mut rows = vec![
            u("local-000000000001", Some(3.0), 1 << 20),
            u("local-000000000002", Some(97.5), 2 << 20),
            u("local-000000000003", None, 40 << 20),
        ];
        sort(&mut rows, SortBy::Cpu);
        assert_eq!(rows[0].id, "local-000000000002");
        assert_eq!(
            rows[2].id, "local-000000000003",
            "no reading yet sorts last"
        );
        let resp = UsageResponse {
            sandboxes: rows.clone(),
            interval_ms: 5000,
        };
        let s = screen(&resp, Some(2));
        assert!(
            s.starts_with("3 sandboxes, 3 running; CPU 100.5% of a core"),
            "{s}"
        );
        assert!(s.contains("97.5%") && s.contains("2.0M 3%"), "{s}");
        assert!(
            !s.contains("local-000000000003") && s.contains("… and 1 more"),
            "{s}"
        );
        assert!(s.lines().all(|l| l.chars().count() <= 80), "{s}");
        sort(&mut rows, SortBy::Memory);
        assert_eq!(rows[0].id, "local-000000000003");
        assert_eq!(short_bytes(512), "512B");
        assert_eq!(short_bytes(3 << 30), "3.0G");
        assert_eq!(short_bytes(200 << 20), "200M");
    }
}
