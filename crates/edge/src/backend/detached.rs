//! Helpers for the processes a VM backend runs detached from the edge (QEMU, Firecracker,
//! their channel proxies), known by pid files, and for the small JSON files and sparse
//! memory files next to them.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

pub fn read_pid(p: &Path) -> Option<i32> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// Whether `pid` runs (a zombie does not: a VM process can be the edge's child, or a
/// subreaper's, until reaped).
pub fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    if unsafe { libc::kill(pid, 0) } != 0 {
        return false;
    }
    proc_state(Path::new(&format!("/proc/{pid}/stat"))).is_some_and(|s| s != 'Z')
}

/// The state letter (`R`, `S`, `T`, `Z`, …) in a `/proc/<pid>/stat` or
/// `/proc/<pid>/task/<tid>/stat` file: the first field after the command's `)`.
pub fn proc_state(stat: &Path) -> Option<char> {
    let s = std::fs::read_to_string(stat).ok()?;
    s.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Kills the process named by `pid_file` and waits (up to 1 s) until it is gone.
pub fn kill(pid_file: &Path) {
    if let Some(pid) = read_pid(pid_file) {
        // SAFETY: SIGKILL to the process whose pid we recorded; waitpid reaps it if it
        // is our child (and fails harmlessly if not).
        unsafe { libc::kill(pid, libc::SIGKILL) };
        for _ in 0..200 {
            unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) };
            if !alive(pid) {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

pub fn read_json<T: serde::de::DeserializeOwned>(p: &Path) -> Result<T, String> {
    let b = std::fs::read(p).map_err(|e| format!("reading {}: {e}", p.display()))?;
    serde_json::from_slice(&b).map_err(|e| format!("{}: {e}", p.display()))
}

pub fn write_json<T: serde::Serialize>(p: &Path, v: &T) -> Result<(), String> {
    let b = serde_json::to_vec_pretty(v).map_err(|e| e.to_string())?;
    std::fs::write(p, b).map_err(|e| format!("writing {}: {e}", p.display()))
}

/// `cp --sparse=always`: memory files are mostly holes.
pub fn copy_sparse(from: &Path, to: &Path) -> Result<(), String> {
    let out = Command::new("cp")
        .arg("--sparse=always")
        .arg(from)
        .arg(to)
        .output()
        .map_err(|e| format!("running cp: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "copying {} to {}: {}",
            from.display(),
            to.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}
