//! Cgroup mode detection and per-sandbox cgroup reads. The OCI runtime creates and limits
//! a container's cgroups; the edge reads counters from them and removes what a runtime
//! leaves. A VM's cgroups the edge makes itself (`own.rs`).
//! v1 (all controllers on v1), v2 (unified only) and hybrid (v1 controllers plus a
//! cgroup2 mount at `unified/`) are siblings behind one interface.

pub mod own;
mod v1;
mod v2;

pub use own::{LeafLimits, create_leaf};

use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupMode {
    V1,
    V2,
    Hybrid,
}

impl CgroupMode {
    pub fn as_str(self) -> &'static str {
        match self {
            CgroupMode::V1 => "v1",
            CgroupMode::V2 => "v2",
            CgroupMode::Hybrid => "hybrid",
        }
    }
}

/// Reads the mount table and the cgroup root to tell the modes apart.
pub fn detect() -> CgroupMode {
    detect_from(
        &std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default(),
        Path::new("/sys/fs/cgroup"),
    )
}

fn detect_from(mountinfo: &str, root: &Path) -> CgroupMode {
    let mut v2_at_root = false;
    let mut v2_unified = false;
    let mut any_v1 = false;
    for line in mountinfo.lines() {
        let Some((pre, post)) = line.split_once(" - ") else {
            continue;
        };
        let Some(mount_point) = pre.split_whitespace().nth(4) else {
            continue;
        };
        let fstype = post.split_whitespace().next().unwrap_or("");
        let root_s = root.to_string_lossy();
        match fstype {
            "cgroup2" if mount_point == root_s => v2_at_root = true,
            "cgroup2" if mount_point.starts_with(&*root_s) => v2_unified = true,
            "cgroup" if mount_point.starts_with(&*root_s) => any_v1 = true,
            _ => {}
        }
    }
    match (v2_at_root, any_v1, v2_unified) {
        (true, _, _) => CgroupMode::V2,
        (false, true, true) => CgroupMode::Hybrid,
        _ => CgroupMode::V1,
    }
}

/// The cgroup path (relative to each hierarchy's root) the runtime is told to use.
pub fn sandbox_cgroup_path(sandbox_id: &str) -> String {
    format!("/dsec/{sandbox_id}")
}

/// OOM kills recorded in the sandbox's memory cgroup.
pub fn oom_kills(mode: CgroupMode, rel: &str) -> u64 {
    match mode {
        CgroupMode::V2 => v2::oom_kills(rel),
        _ => v1::oom_kills(rel),
    }
}

/// CPU time used by the sandbox, in nanoseconds.
pub fn cpu_usage_ns(mode: CgroupMode, rel: &str) -> u64 {
    match mode {
        CgroupMode::V2 => v2::cpu_usage_ns(rel),
        _ => v1::cpu_usage_ns(rel),
    }
}

/// (used, page cache) bytes of the sandbox's memory cgroup.
pub fn memory(mode: CgroupMode, rel: &str) -> (u64, u64) {
    match mode {
        CgroupMode::V2 => v2::memory(rel),
        _ => v1::memory(rel),
    }
}

/// Directories of this sandbox's cgroups that still exist (nothing should, after stop).
pub fn leftovers(mode: CgroupMode, rel: &str) -> Vec<std::path::PathBuf> {
    let mut out = match mode {
        CgroupMode::V2 => v2::dirs(rel),
        _ => v1::dirs(rel),
    };
    if mode == CgroupMode::Hybrid {
        out.extend(v2::dirs_under(Path::new("/sys/fs/cgroup/unified"), rel));
    }
    out.retain(|p| p.exists());
    out
}

/// Removes what the runtime left behind (empty leaf directories only; rmdir fails on a
/// cgroup that still has processes, which is what we want).
pub fn remove(mode: CgroupMode, rel: &str) {
    for d in leftovers(mode, rel) {
        let _ = std::fs::remove_dir(&d);
    }
}

/// Removes a cgroup the edge made for a VMM: kills whatever is still in it (a VMM that
/// survived its SIGKILL's wait, a helper it left) and removes the directories once the
/// kernel has let the processes go, which for a VMM with gigabytes mapped can take
/// seconds. Gives up after `within`, leaving what could not be removed.
pub fn empty_and_remove(mode: CgroupMode, rel: &str, within: std::time::Duration) {
    let t0 = std::time::Instant::now();
    loop {
        let dirs = leftovers(mode, rel);
        if dirs.is_empty() {
            return;
        }
        for d in &dirs {
            // A frozen task takes its SIGKILL only once thawed (a paused sandbox).
            let _ = std::fs::write(d.join("cgroup.freeze"), "0");
            let _ = std::fs::write(d.join("freezer.state"), "THAWED");
            // cgroup.kill (v2, Linux 5.14) also takes processes forking at the moment.
            if std::fs::write(d.join("cgroup.kill"), "1").is_err() {
                for pid in std::fs::read_to_string(d.join("cgroup.procs"))
                    .unwrap_or_default()
                    .split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok())
                {
                    // SAFETY: SIGKILL to a process in the sandbox's own cgroup.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
            let _ = std::fs::remove_dir(d);
        }
        if t0.elapsed() >= within {
            let left = leftovers(mode, rel);
            if !left.is_empty() {
                tracing::warn!(
                    cgroup = rel,
                    "processes outlived the sandbox's cgroup removal: {left:?}"
                );
            }
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Removes the shared parent cgroups once no sandbox uses them (at shutdown; during
/// operation a concurrent create may be about to use them).
pub fn remove_parents(mode: CgroupMode) {
    remove(mode, "/dsec");
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "30 25 0:26 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw
32 30 0:28 / /sys/fs/cgroup/memory rw,nosuid shared:11 - cgroup cgroup rw,memory
";
    const V2: &str =
        "30 25 0:26 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate
";
    const V1: &str = "30 25 0:26 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
32 30 0:28 / /sys/fs/cgroup/memory rw,nosuid shared:11 - cgroup cgroup rw,memory
";

    #[test]
    fn detects_each_layout() {
        let root = Path::new("/sys/fs/cgroup");
        assert_eq!(detect_from(HYBRID, root), CgroupMode::Hybrid);
        assert_eq!(detect_from(V2, root), CgroupMode::V2);
        assert_eq!(detect_from(V1, root), CgroupMode::V1);
    }

    #[test]
    fn parses_counters() {
        assert_eq!(
            v1::parse_oom_control("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"),
            3
        );
        assert_eq!(
            v2::parse_key("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n", "oom_kill"),
            2
        );
        assert_eq!(
            v2::parse_key("usage_usec 1500\nuser_usec 1\n", "usage_usec"),
            1500
        );
    }
}
