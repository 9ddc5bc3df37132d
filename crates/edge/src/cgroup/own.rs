//! Cgroups the edge makes itself, for processes no OCI runtime starts (a VM's QEMU): the
//! sandbox's CPU, memory and pids limits on the process that runs it.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::CgroupMode;

const ROOT: &str = "/sys/fs/cgroup";
/// The CFS period the CPU quota is a share of.
const PERIOD_US: u64 = 100_000;

#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    pub cpu_cores: f64,
    pub memory_bytes: u64,
    pub pids: u64,
}

fn quota_us(cores: f64) -> u64 {
    ((cores * PERIOD_US as f64) as u64).max(1000)
}

fn write(dir: &Path, file: &str, value: &str) -> Result<(), String> {
    std::fs::write(dir.join(file), value)
        .map_err(|e| format!("setting {}/{file} to {value}: {e}", dir.display()))
}

fn mkdir(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating cgroup {}: {e}", dir.display()))
}

/// Creates cgroup `rel` (e.g. `/dsec/<id>`) in every hierarchy that has a limit to set,
/// sets the limits, and returns the `cgroup.procs` files a process joins.
pub fn create(mode: CgroupMode, rel: &str, l: &Limits) -> Result<Vec<PathBuf>, String> {
    let rel = rel.trim_start_matches('/');
    match mode {
        CgroupMode::V2 => {
            let root = PathBuf::from(ROOT);
            let dir = root.join(rel);
            // Each level down to the sandbox hands the controllers on.
            let mut at = root.clone();
            for part in Path::new(rel)
                .parent()
                .into_iter()
                .flat_map(|p| p.components())
            {
                write(&at, "cgroup.subtree_control", "+cpu +memory +pids")?;
                at = at.join(part);
                mkdir(&at)?;
            }
            write(&at, "cgroup.subtree_control", "+cpu +memory +pids")?;
            mkdir(&dir)?;
            write(
                &dir,
                "cpu.max",
                &format!("{} {PERIOD_US}", quota_us(l.cpu_cores)),
            )?;
            write(&dir, "memory.max", &l.memory_bytes.to_string())?;
            write(&dir, "pids.max", &l.pids.to_string())?;
            Ok(vec![dir.join("cgroup.procs")])
        }
        CgroupMode::V1 | CgroupMode::Hybrid => {
            let mut procs = Vec::new();
            let quota = quota_us(l.cpu_cores).to_string();
            let mem = l.memory_bytes.to_string();
            let pids = l.pids.to_string();
            let period = PERIOD_US.to_string();
            let settings: [(&str, Vec<(&str, &str)>); 4] = [
                (
                    "cpu",
                    vec![("cpu.cfs_period_us", &period), ("cpu.cfs_quota_us", &quota)],
                ),
                ("cpuacct", vec![]),
                ("memory", vec![("memory.limit_in_bytes", &mem)]),
                ("pids", vec![("pids.max", &pids)]),
            ];
            for (controller, files) in settings {
                let dir = PathBuf::from(ROOT).join(controller).join(rel);
                if !PathBuf::from(ROOT).join(controller).is_dir() {
                    if files.is_empty() {
                        continue;
                    }
                    return Err(format!("the {controller} cgroup controller is not mounted"));
                }
                mkdir(&dir)?;
                for (f, v) in files {
                    write(&dir, f, v)?;
                }
                let p = dir.join("cgroup.procs");
                // cpu and cpuacct may be one hierarchy under two names.
                if !procs.iter().any(|q: &PathBuf| same_file(q, &p)) {
                    procs.push(p);
                }
            }
            Ok(procs)
        }
    }
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// Makes the process `cmd` starts join `procs` before it runs anything, so all of its
/// memory is counted from the start.
pub fn join_before_exec(cmd: &mut Command, procs: &[PathBuf]) -> Result<(), String> {
    let paths: Vec<CString> = procs
        .iter()
        .map(|p| CString::new(p.as_os_str().as_bytes()).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    // SAFETY: between fork and exec only async-signal-safe calls (getpid, open, write,
    // close) on memory prepared before the fork.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(cmd, move || {
            let mut buf = [0u8; 20];
            let mut n = libc::getpid() as u64;
            let mut i = buf.len();
            loop {
                i -= 1;
                buf[i] = b'0' + (n % 10) as u8;
                n /= 10;
                if n == 0 {
                    break;
                }
            }
            for p in &paths {
                let fd = libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let w = libc::write(fd, buf[i..].as_ptr().cast(), buf.len() - i);
                libc::close(fd);
                if w < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotas_are_shares_of_the_period_with_a_floor() {
        assert_eq!(quota_us(0.5), 50_000);
        assert_eq!(quota_us(2.0), 200_000);
        assert_eq!(quota_us(0.0001), 1000);
    }
}
