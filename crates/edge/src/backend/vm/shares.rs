//! A VM's volumes: each one a virtio-fs device (`vhost-user-fs`, tag `dsec_v<i>`) served
//! by a virtiofsd of its own. The daemon runs in the sandboxes' mount namespace, where the
//! volumes are mounted, on a bind of the volume made for this VM (read-only where the
//! sandbox mounts it so, which the guest cannot undo); inside its own sandbox (mount, pid
//! and network namespaces, `pivot_root` into that directory) it resolves every path the
//! guest sends below it. Only `user.*` extended attributes (file metadata) and file
//! capabilities pass; the guest cannot set `trusted.*` or other `security.*` ones on the
//! node's files ([`XATTR_MAP`]). The daemon runs
//! detached in the sandbox's cgroup, like QEMU, so it outlives a restart of the edge, and
//! exits when QEMU does.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dsec_common::IoContext;

use super::{VmBackend, VmError};
use crate::backend::detached::{alive, spawn_detached};
use crate::cgroup;
use crate::registry::SandboxRecord;

/// Where the VM's volumes are bound in the sandboxes' mount namespace.
const SHARES_DIR: &str = "shares";

/// Only `user.*` attributes and file capabilities pass, unchanged; any other name
/// (`trusted.*`, the rest of `security.*`, `system.*`) is refused. virtiofsd insists on a
/// rule for `security.capability`, and one that renames it breaks `chown` (the daemon
/// then drops it through a descriptor that cannot): it passes as it is, and means
/// nothing on the node, where every mount of a volume is `nosuid`.
const XATTR_MAP: &str = ":ok:all:user.:::ok:all:security.capability:::bad:all:::";

/// The virtiofsd binary: Debian's `virtiofsd` package (Debian 13), QEMU's own before 8.0
/// (Debian 12's `qemu-system-common`, or the copy `deploy/deps.sh` installs from it).
pub fn find_virtiofsd() -> Result<PathBuf, VmError> {
    let candidates = [
        "/usr/libexec/virtiofsd",
        "/usr/lib/qemu/virtiofsd",
        "/usr/local/libexec/virtiofsd",
    ];
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .or_else(|| {
            std::env::var_os("PATH").and_then(|path| {
                std::env::split_paths(&path)
                    .map(|d| d.join("virtiofsd"))
                    .find(|p| p.is_file())
            })
        })
        .ok_or_else(|| {
            VmError::Unavailable("vm sandboxes mount volumes through virtiofsd, which this node lacks: install Debian's virtiofsd package (Debian 13), or run deploy/deps.sh (Debian 12)".into())
        })
}

fn socket(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("vfs{i}.sock"))
}

pub(crate) fn pid_file(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("virtiofsd.{i}.pid"))
}

/// Where daemon `i` logs (warnings and errors only; capped by the backend's housekeeping).
fn log_file(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("virtiofsd.{i}.log"))
}

/// A daemon's command line: serving `src` on socket `sock`.
fn daemon_args(sock: &Path, src: &Path) -> Vec<String> {
    vec![
        format!("--socket-path={}", sock.display()),
        "-o".into(),
        format!("source={}", src.display()),
        "-o".into(),
        "cache=auto".into(),
        "-o".into(),
        "sandbox=namespace".into(),
        "-o".into(),
        format!("xattrmap={XATTR_MAP}"),
        // What the guest sends must not fill the node's disk with lines.
        "-o".into(),
        "log_level=warn".into(),
        // The edge's own limit on open files stands (raising it needs a capability the
        // node may not grant).
        "--rlimit-nofile=0".into(),
    ]
}

impl VmBackend {
    /// Binds the sandbox's volumes and starts a virtiofsd for each, in the cgroup whose
    /// `cgroup.procs` files are `procs`; returns their sockets once each listens.
    pub(super) fn start_shares(
        &self,
        rec: &SandboxRecord,
        dir: &Path,
        procs: &[PathBuf],
    ) -> Result<Vec<PathBuf>, VmError> {
        let bin = find_virtiofsd()?;
        let state_dir = self.sandboxes.parent().unwrap_or(&self.sandboxes);
        let shares = dir.join(SHARES_DIR);
        let started = crate::mountns::within(|| -> Result<Vec<u32>, VmError> {
            let sources = crate::volumes::bind_shares(state_dir, &rec.volumes, &shares)?;
            let mut pids = Vec::with_capacity(sources.len());
            for (i, src) in sources.iter().enumerate() {
                let sock = socket(dir, i);
                let _ = std::fs::remove_file(&sock);
                // Appending, so that the log can be cut short under the daemon.
                let _ = std::fs::remove_file(log_file(dir, i));
                let log = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(log_file(dir, i))
                    .ctx(|| format!("creating virtiofsd.{i}.log"))?;
                let mut cmd = Command::new(&bin);
                cmd.args(daemon_args(&sock, src))
                    .stdin(Stdio::null())
                    .stdout(log.try_clone().ctx(|| "the virtiofsd log".into())?)
                    .stderr(log);
                cgroup::own::join_before_exec(&mut cmd, procs)?;
                let what = bin.display().to_string();
                pids.push(spawn_detached(&mut cmd, &what, &pid_file(dir, i))?.id());
            }
            Ok(pids)
        })?;
        // Each daemon makes its socket once it is ready for QEMU.
        let t0 = Instant::now();
        let mut out = Vec::with_capacity(started.len());
        for (i, pid) in started.iter().enumerate() {
            let sock = socket(dir, i);
            while !sock.exists() {
                if !alive(*pid as i32) || t0.elapsed() > Duration::from_secs(10) {
                    let said = std::fs::read_to_string(log_file(dir, i)).unwrap_or_default();
                    return Err(VmError::Virtiofsd {
                        volume: rec.volumes[i].volume.clone(),
                        said: said.trim().to_string(),
                    });
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            out.push(sock);
        }
        Ok(out)
    }
}

/// Cuts the daemons' logs of the VM in `dir` short, as its console's.
pub(super) fn cap_logs(dir: &Path, max: u64) {
    if dir.join(SHARES_DIR).exists() {
        for i in 0..crate::volumes::MAX_MOUNTS {
            super::cap_console(&log_file(dir, i), max);
        }
    }
}

/// Forgets a VM's virtiofsd daemons and removes the binds of its volumes. The daemons
/// end with QEMU, and whatever is left of them goes with the sandbox's cgroup (their pids
/// are not killed by number: once a daemon has exited, its pid may be another process's).
pub(super) fn stop_shares(dir: &Path) {
    let shares = dir.join(SHARES_DIR);
    if !shares.exists() {
        return;
    }
    for i in 0..crate::volumes::MAX_MOUNTS {
        let _ = std::fs::remove_file(pid_file(dir, i));
        let _ = std::fs::remove_file(socket(dir, i));
    }
    if let Ok(ns) = crate::mountns::get() {
        let _ = ns.run(|| crate::volumes::unbind_shares(&shares));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The node's virtiofsd takes the options a VM's daemon is started with (the xattr
    /// map above all, which it checks at start) and listens on its socket.
    #[test]
    fn virtiofsd_takes_the_options_and_listens() {
        // SAFETY: geteuid has no preconditions.
        let (Ok(bin), 0) = (find_virtiofsd(), unsafe { libc::geteuid() }) else {
            eprintln!("skipped: needs virtiofsd and root");
            return;
        };
        let dir = std::env::temp_dir().join(format!("dsec-vfs-test-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("src")).unwrap();
        let sock = socket(&dir, 0);
        let mut child = Command::new(bin)
            .args(daemon_args(&sock, &dir.join("src")))
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let t0 = Instant::now();
        while !sock.exists() && t0.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(st)) = child.try_wait() {
                let mut said = String::new();
                use std::io::Read;
                let _ = child.stderr.take().unwrap().read_to_string(&mut said);
                panic!("virtiofsd exited ({st}): {said}");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let listening = sock.exists();
        let _ = child.kill();
        let _ = child.wait();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(listening, "virtiofsd made no socket within 10 s");
    }
}
