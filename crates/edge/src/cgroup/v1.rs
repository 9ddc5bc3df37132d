//! cgroup v1: one hierarchy per controller under /sys/fs/cgroup/<controller>.

use std::path::PathBuf;

const ROOT: &str = "/sys/fs/cgroup";
const CONTROLLERS: &[&str] = &[
    "memory",
    "cpu",
    "cpuacct",
    "cpuset",
    "pids",
    "devices",
    "freezer",
    "blkio",
    "net_cls",
    "net_prio",
    "perf_event",
    "hugetlb",
    "rdma",
    "misc",
    "systemd",
];

fn dir(controller: &str, rel: &str) -> PathBuf {
    PathBuf::from(ROOT)
        .join(controller)
        .join(rel.trim_start_matches('/'))
}

pub fn parse_oom_control(text: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

pub fn oom_kills(rel: &str) -> u64 {
    std::fs::read_to_string(dir("memory", rel).join("memory.oom_control"))
        .map(|t| parse_oom_control(&t))
        .unwrap_or(0)
}

pub fn cpu_usage_ns(rel: &str) -> u64 {
    std::fs::read_to_string(dir("cpuacct", rel).join("cpuacct.usage"))
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0)
}

/// (used, page cache) bytes: use without the inactive file cache that can be dropped.
pub fn memory(rel: &str) -> (u64, u64) {
    let d = dir("memory", rel);
    let usage: u64 = std::fs::read_to_string(d.join("memory.usage_in_bytes"))
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0);
    let stat = std::fs::read_to_string(d.join("memory.stat")).unwrap_or_default();
    let inactive = super::v2::parse_key(&stat, "total_inactive_file");
    (
        usage.saturating_sub(inactive),
        super::v2::parse_key(&stat, "total_cache"),
    )
}

pub fn dirs(rel: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = CONTROLLERS.iter().map(|c| dir(c, rel)).collect();
    // Co-mounted controllers (e.g. cpu,cpuacct) live under a combined name.
    if let Ok(rd) = std::fs::read_dir(ROOT) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.contains(',') {
                out.push(dir(&name, rel));
            }
        }
    }
    out
}
