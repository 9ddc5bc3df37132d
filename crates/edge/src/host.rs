//! What the node really has: cores, memory, free disk, load.

use std::path::Path;

pub fn cpus() -> u32 {
    std::thread::available_parallelism()
        .map(|n| n.get() as u32)
        .unwrap_or(1)
}

/// (total, available) memory in MiB from /proc/meminfo.
pub fn memory_mb() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            / 1024
    };
    (field("MemTotal:"), field("MemAvailable:"))
}

pub fn disk_free_mb(path: &Path) -> u64 {
    dsec_common::disk::usage(path).map_or(0, |u| u.available >> 20)
}

/// The 1-minute load average from /proc/loadavg.
pub fn load1() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|t| t.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0.0)
}

/// The node's state at admission time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Snapshot {
    pub sandboxes: u64,
    pub memory_available_mb: u64,
    pub disk_free_mb: u64,
    pub load1: f64,
    pub cpus: u32,
}

/// The node's own limits on taking more work.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reserve {
    pub max_sandboxes: u64,
    pub memory_mb: u64,
    pub disk_mb: u64,
    /// 0 disables the load check.
    pub max_load_per_core: f64,
}

/// Why a node takes no more sandboxes, by the resource it lacks.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Refusal {
    #[error(
        "node {node} is full: it runs {running} sandboxes (max_sandboxes = {max}); stop some or add nodes"
    )]
    Sandboxes {
        node: String,
        running: u64,
        max: u64,
    },
    #[error(
        "node {node} has only {available_mb} MiB of memory available (reserve {reserve_mb} MiB); stop some sandboxes"
    )]
    Memory {
        node: String,
        available_mb: u64,
        reserve_mb: u64,
    },
    #[error(
        "node {node} has only {free_mb} MiB of disk free for sandbox state (reserve {reserve_mb} MiB); free some disk"
    )]
    Disk {
        node: String,
        free_mb: u64,
        reserve_mb: u64,
    },
    #[error(
        "node {node} is overloaded: load {load:.1} on {cpus} cores (limit {limit} per core); try again or another node"
    )]
    Load {
        node: String,
        load: f64,
        cpus: u32,
        limit: f64,
    },
}

impl Refusal {
    /// The resource the node lacks: `sandboxes`, `memory`, `disk` or `load`.
    pub fn resource(&self) -> &'static str {
        match self {
            Refusal::Sandboxes { .. } => "sandboxes",
            Refusal::Memory { .. } => "memory",
            Refusal::Disk { .. } => "disk",
            Refusal::Load { .. } => "load",
        }
    }
}

/// Whether a node in state `s` takes one more sandbox; `Err` says why not.
pub fn admit(node: &str, s: &Snapshot, r: &Reserve) -> Result<(), Refusal> {
    let node = node.to_string();
    if s.sandboxes >= r.max_sandboxes {
        return Err(Refusal::Sandboxes {
            node,
            running: s.sandboxes,
            max: r.max_sandboxes,
        });
    }
    if s.memory_available_mb < r.memory_mb + 32 {
        return Err(Refusal::Memory {
            node,
            available_mb: s.memory_available_mb,
            reserve_mb: r.memory_mb,
        });
    }
    if s.disk_free_mb < r.disk_mb {
        return Err(Refusal::Disk {
            node,
            free_mb: s.disk_free_mb,
            reserve_mb: r.disk_mb,
        });
    }
    let per_core = s.load1 / s.cpus.max(1) as f64;
    if r.max_load_per_core > 0.0 && per_core > r.max_load_per_core {
        return Err(Refusal::Load {
            node,
            load: s.load1,
            cpus: s.cpus,
            limit: r.max_load_per_core,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_refuses_on_each_real_resource_and_says_which() {
        let ok = Snapshot {
            sandboxes: 10,
            memory_available_mb: 8000,
            disk_free_mb: 50_000,
            load1: 3.0,
            cpus: 4,
        };
        let r = Reserve {
            max_sandboxes: 100,
            memory_mb: 256,
            disk_mb: 1024,
            max_load_per_core: 4.0,
        };
        assert!(admit("n", &ok, &r).is_ok());
        let cases = [
            (
                Snapshot {
                    sandboxes: 100,
                    ..ok
                },
                "is full",
            ),
            (
                Snapshot {
                    memory_available_mb: 200,
                    ..ok
                },
                "memory",
            ),
            (
                Snapshot {
                    disk_free_mb: 100,
                    ..ok
                },
                "disk",
            ),
            (Snapshot { load1: 17.0, ..ok }, "overloaded"),
        ];
        for (s, why) in cases {
            let e = admit("n", &s, &r).unwrap_err();
            assert!(e.to_string().contains(why), "{e}");
        }
        let off = Reserve {
            max_load_per_core: 0.0,
            ..r
        };
        assert!(admit("n", &Snapshot { load1: 99.0, ..ok }, &off).is_ok());
        // The real host reads as something sane.
        assert!(cpus() >= 1 && memory_mb().0 > 0 && load1() >= 0.0);
    }
}
