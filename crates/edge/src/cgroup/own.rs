//! Cgroups the edge makes itself, for processes no OCI runtime starts (a VM's QEMU, a
//! Firecracker VMM): the sandbox's CPU, memory and pids limits on the process that runs it.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Command;

use dsec_common::{IoContext, IoFailure};

use super::CgroupMode;

/// Limits for a cgroup the edge makes itself (for a process no OCI runtime starts, such
/// as a Firecracker VMM).
#[derive(Debug, Clone, Copy)]
pub struct LeafLimits {
    pub memory_bytes: u64,
    /// CPU time per 100 ms period, in microseconds (cores × 100 000).
    pub cpu_quota_us: u64,
    /// Most processes and threads.
    pub pids: u64,
}

const CPU_PERIOD_US: u64 = 100_000;

/// Makes the sandbox's cgroup `rel` in every hierarchy the limits need and sets them;
/// returns the `cgroup.procs` files a process is moved into (by writing its pid, or `0`
/// for the writer itself). On error what was made is removed again.
pub fn create_leaf(
    mode: CgroupMode,
    rel: &str,
    limits: LeafLimits,
) -> Result<Vec<std::path::PathBuf>, IoFailure> {
    let root = Path::new("/sys/fs/cgroup");
    let rel = rel.trim_start_matches('/');
    let mut files: Vec<(std::path::PathBuf, Vec<(&str, String)>)> = Vec::new();
    match mode {
        CgroupMode::V2 => {
            // Controllers must be enabled on the way down for the limits to exist.
            let mut at = root.to_path_buf();
            for part in Path::new(rel).parent().into_iter().flat_map(|p| p.iter()) {
                let _ = std::fs::write(at.join("cgroup.subtree_control"), "+memory +cpu +pids");
                at = at.join(part);
                let _ = std::fs::create_dir(&at);
            }
            let _ = std::fs::write(at.join("cgroup.subtree_control"), "+memory +cpu +pids");
            files.push((
                root.join(rel),
                vec![
                    ("memory.max", limits.memory_bytes.to_string()),
                    (
                        "cpu.max",
                        format!("{} {CPU_PERIOD_US}", limits.cpu_quota_us.max(1000)),
                    ),
                    ("pids.max", limits.pids.to_string()),
                ],
            ));
        }
        CgroupMode::V1 | CgroupMode::Hybrid => {
            files.push((
                root.join("memory").join(rel),
                vec![("memory.limit_in_bytes", limits.memory_bytes.to_string())],
            ));
            files.push((
                root.join("cpu").join(rel),
                vec![
                    ("cpu.cfs_period_us", CPU_PERIOD_US.to_string()),
                    (
                        "cpu.cfs_quota_us",
                        limits.cpu_quota_us.max(1000).to_string(),
                    ),
                ],
            ));
            files.push((
                root.join("pids").join(rel),
                vec![("pids.max", limits.pids.to_string())],
            ));
            // CPU time is read from cpuacct where it is a hierarchy of its own.
            if !same_dir(&root.join("cpu"), &root.join("cpuacct")) && root.join("cpuacct").is_dir()
            {
                files.push((root.join("cpuacct").join(rel), Vec::new()));
            }
        }
    }
    let mut procs = Vec::new();
    for (dir, settings) in &files {
        let made = std::fs::create_dir_all(dir)
            .ctx(|| format!("creating cgroup {}", dir.display()))
            .and_then(|()| {
                for (k, v) in settings {
                    std::fs::write(dir.join(k), v)
                        .ctx(|| format!("setting {}/{k} to {v}", dir.display()))?;
                }
                Ok(())
            });
        if let Err(e) = made {
            super::remove(mode, &format!("/{rel}"));
            return Err(e);
        }
        procs.push(dir.join("cgroup.procs"));
    }
    Ok(procs)
}

fn same_dir(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// CPU time per period for `cores`.
pub fn quota_us(cores: f64) -> u64 {
    ((cores.max(0.0) * CPU_PERIOD_US as f64) as u64).max(1000)
}

/// Makes the process `cmd` starts join the cgroups whose `cgroup.procs` files are `procs`
/// before it runs anything, so all of its memory is counted from the start.
pub fn join_before_exec(cmd: &mut Command, procs: &[std::path::PathBuf]) -> Result<(), IoFailure> {
    let files: Vec<File> = procs
        .iter()
        .map(|p| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(p)
                .ctx(|| format!("opening {}", p.display()))
        })
        .collect::<Result<_, _>>()?;
    // SAFETY: between fork and exec only write(2) on fds opened above; writing "0" moves
    // the writer, i.e. the child. The files stay open in the closure until it is dropped.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(cmd, move || {
            for f in &files {
                if libc::write(f.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    Ok(())
}

/// A VMM moved out of its sandbox's memory cgroup into a sibling without a limit
/// (`<rel>.save`) while it writes a snapshot, and back when this is dropped.
///
/// Pages a process writes to a tmpfs file are charged to its memory cgroup and stay
/// charged there until the file goes. A Firecracker saving guest memory into the RAM
/// directory would otherwise carry a second copy of its guest in its own limit: at the
/// limit after every fork, OOM-killed on the next save. Moved aside, the snapshot's
/// pages are charged to the sibling, and to `/dsec` once the sibling is removed (the
/// kernel hands a removed cgroup's charges to its parent); the guest's own pages stay
/// where they were, as cgroups do not move charges with a process.
pub struct ChargedApart {
    pid: i32,
    home: std::path::PathBuf,
    aside: std::path::PathBuf,
}

/// The memory hierarchy's directory of `rel`.
fn memory_dir(mode: CgroupMode, rel: &str) -> std::path::PathBuf {
    let root = Path::new("/sys/fs/cgroup");
    let rel = rel.trim_start_matches('/');
    match mode {
        CgroupMode::V2 => root.join(rel),
        CgroupMode::V1 | CgroupMode::Hybrid => root.join("memory").join(rel),
    }
}

/// Moves `pid` (all its threads) from `rel`'s memory cgroup into `<rel>.save`.
pub fn charge_apart(mode: CgroupMode, rel: &str, pid: i32) -> Result<ChargedApart, IoFailure> {
    let home = memory_dir(mode, rel);
    let aside = memory_dir(mode, &format!("{rel}.save"));
    match std::fs::create_dir(&aside) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(IoFailure::new(
                format!("creating cgroup {}", aside.display()),
                e,
            ));
        }
    }
    if let Err(e) = std::fs::write(aside.join("cgroup.procs"), pid.to_string()) {
        let _ = std::fs::remove_dir(&aside);
        return Err(IoFailure::new(
            format!("moving the VMM into {}", aside.display()),
            e,
        ));
    }
    Ok(ChargedApart { pid, home, aside })
}

impl Drop for ChargedApart {
    fn drop(&mut self) {
        match std::fs::write(self.home.join("cgroup.procs"), self.pid.to_string()) {
            Ok(()) => {}
            // The VMM died meanwhile: nothing to move back.
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
            Err(e) => tracing::warn!(
                "moving the VMM {} back into {}: {e}",
                self.pid,
                self.home.display()
            ),
        }
        for _ in 0..100 {
            if std::fs::remove_dir(&self.aside).is_ok() || !self.aside.exists() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        tracing::warn!("cgroup {} is still in use", self.aside.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh leaf with 256 MiB, half a core and 64 pids: (mode, path, its procs files);
    /// None (the test skips) where cgroups cannot be made.
    fn test_leaf() -> Option<(CgroupMode, String, Vec<std::path::PathBuf>)> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: making cgroups needs root");
            return None;
        }
        let mode = super::super::detect();
        let mut r = [0u8; 4];
        dsec_common::id::fill_random(&mut r);
        let rel = format!("/dsec-test-{}", hex::encode(r));
        let limits = LeafLimits {
            memory_bytes: 256 << 20,
            cpu_quota_us: 50_000,
            pids: 64,
        };
        match create_leaf(mode, &rel, limits) {
            Ok(p) => Some((mode, rel, p)),
            Err(e) if matches!(e.errno(), Some(libc::EROFS | libc::EACCES | libc::EPERM)) => {
                eprintln!("skipped: cgroups are not writable here: {e}");
                None
            }
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn quotas_are_shares_of_the_period_with_a_floor() {
        assert_eq!(quota_us(0.5), 50_000);
        assert_eq!(quota_us(2.0), 200_000);
        assert_eq!(quota_us(0.0001), 1000);
    }

    #[test]
    fn a_leaf_gets_its_limits_and_is_removed() {
        let Some((mode, rel, procs)) = test_leaf() else {
            return;
        };
        assert!(
            !procs.is_empty() && procs.iter().all(|p| p.exists()),
            "{procs:?}"
        );
        let mem = match mode {
            CgroupMode::V2 => Path::new("/sys/fs/cgroup")
                .join(&rel[1..])
                .join("memory.max"),
            _ => Path::new("/sys/fs/cgroup/memory")
                .join(&rel[1..])
                .join("memory.limit_in_bytes"),
        };
        let got = std::fs::read_to_string(&mem).unwrap_or_default();
        super::super::remove(mode, &rel);
        assert_eq!(got.trim(), (256u64 << 20).to_string());
        assert!(super::super::leftovers(mode, &rel).is_empty());
    }

    /// The memory cgroup a process is in (its `/proc/<pid>/cgroup` line for memory, or
    /// the unified one).
    fn memory_cgroup_of(mode: CgroupMode, pid: u32) -> String {
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
        text.lines()
            .find(|l| match mode {
                CgroupMode::V2 => l.starts_with("0::"),
                _ => l
                    .split(':')
                    .nth(1)
                    .is_some_and(|c| c.split(',').any(|c| c == "memory")),
            })
            .and_then(|l| l.splitn(3, ':').nth(2))
            .unwrap_or_default()
            .to_string()
    }

    #[test]
    fn a_process_charged_apart_goes_back_and_the_sibling_is_removed() {
        let Some((mode, rel, procs)) = test_leaf() else {
            return;
        };
        let mut cmd = Command::new("sleep");
        cmd.arg("30");
        join_before_exec(&mut cmd, &procs).unwrap();
        let mut child = cmd.spawn().unwrap();
        let pid = child.id();
        assert_eq!(memory_cgroup_of(mode, pid), rel);
        {
            let _apart = charge_apart(mode, &rel, pid as i32).unwrap();
            assert_eq!(memory_cgroup_of(mode, pid), format!("{rel}.save"));
        }
        assert_eq!(memory_cgroup_of(mode, pid), rel);
        assert!(super::super::leftovers(mode, &format!("{rel}.save")).is_empty());
        let _ = child.kill();
        let _ = child.wait();
        super::super::empty_and_remove(mode, &rel, std::time::Duration::from_secs(5));
        assert!(super::super::leftovers(mode, &rel).is_empty());
    }
}
