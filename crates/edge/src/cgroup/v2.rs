//! cgroup v2: one unified hierarchy.

use std::path::{Path, PathBuf};

const ROOT: &str = "/sys/fs/cgroup";

pub fn parse_key(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == key).then(|| v.trim().parse().ok()).flatten()
        })
        .unwrap_or(0)
}

fn dir(rel: &str) -> PathBuf {
    PathBuf::from(ROOT).join(rel.trim_start_matches('/'))
}

pub fn oom_kills(rel: &str) -> u64 {
    std::fs::read_to_string(dir(rel).join("memory.events"))
        .map(|t| parse_key(&t, "oom_kill"))
        .unwrap_or(0)
}

pub fn cpu_usage_ns(rel: &str) -> u64 {
    std::fs::read_to_string(dir(rel).join("cpu.stat"))
        .map(|t| parse_key(&t, "usage_usec") * 1000)
        .unwrap_or(0)
}

/// (used, page cache) bytes: use without the inactive file cache that can be dropped.
pub fn memory(rel: &str) -> (u64, u64) {
    let usage: u64 = std::fs::read_to_string(dir(rel).join("memory.current"))
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0);
    let stat = std::fs::read_to_string(dir(rel).join("memory.stat")).unwrap_or_default();
    (
        usage.saturating_sub(parse_key(&stat, "inactive_file")),
        parse_key(&stat, "file"),
    )
}

pub fn dirs(rel: &str) -> Vec<PathBuf> {
    vec![dir(rel)]
}

pub fn dirs_under(root: &Path, rel: &str) -> Vec<PathBuf> {
    vec![root.join(rel.trim_start_matches('/'))]
}
