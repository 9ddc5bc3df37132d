//! The sandboxes' mount namespace. What each sandbox mounts (its disk, and the pin that
//! keeps its network namespace) is mounted here, never in the host's mount namespace:
//! every new mount namespace (each OCI runtime call, each container) starts as a copy of
//! its creator's, so a host mount table that grew with every sandbox made each create
//! cost more than the one before (and a plain `crun run` on the same node too).
//!
//! A holder process (`sleep infinity`, named `dsec-mountns`) lives in the namespace and
//! keeps it across edge restarts, as sandboxes outlive the edge. The edge works in it
//! from short-lived threads that join it ([`MountNs::run`]), and reaches its files through
//! `/proc/<holder>/root` ([`MountNs::view`]). If the holder dies while the edge runs, a new
//! one joins the same namespace.

use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};

use dsec_common::{ErrorCode, IoContext, IoFailure};

use crate::error::Coded;

/// The holder's `argv[0]`, which tells it apart from other processes at adoption.
pub const HOLDER_NAME: &str = "dsec-mountns";
const PID_FILE: &str = "mountns.pid";

pub struct MountNs {
    /// The namespace, open: joined by [`MountNs::run`], and by a replacement holder.
    ns: File,
    pid_file: PathBuf,
    holder: Mutex<Holder>,
}

/// What goes wrong with the sandboxes' mount namespace.
#[derive(Debug, thiserror::Error)]
pub enum MountNsError {
    #[error("the sandboxes' mount namespace was not started")]
    NotStarted,
    #[error("a thread in the sandboxes' mount namespace panicked")]
    Panicked,
    #[error("{0} has a NUL byte")]
    NulInPath(PathBuf),
    #[error(transparent)]
    Io(#[from] IoFailure),
}

impl Coded for MountNsError {
    fn code(&self) -> ErrorCode {
        match self {
            MountNsError::NulInPath(_) => ErrorCode::InvalidArgument,
            _ => ErrorCode::Internal,
        }
    }
}

struct Holder {
    pid: i32,
    /// Set when this edge started it (and so reaps it).
    child: Option<Child>,
}

static NS: OnceLock<MountNs> = OnceLock::new();

/// Starts the namespace, or adopts the one a previous edge on `state_dir` left with its
/// sandboxes. Once per process; later calls return the first.
pub fn init(state_dir: &Path) -> Result<&'static MountNs, MountNsError> {
    if let Some(ns) = NS.get() {
        return Ok(ns);
    }
    let ns = MountNs::start_or_adopt(&state_dir.join(PID_FILE))?;
    Ok(NS.get_or_init(|| ns))
}

/// The namespace [`init`] made.
pub fn get() -> Result<&'static MountNs, MountNsError> {
    NS.get().ok_or(MountNsError::NotStarted)
}

/// Runs `f` on a thread in the namespace [`init`] made; a failure to get there is one of
/// `f`'s errors.
pub fn within<T: Send, E: From<MountNsError> + Send>(
    f: impl FnOnce() -> Result<T, E> + Send,
) -> Result<T, E> {
    get()?.run(f)?
}

pub(crate) use dsec_common::mountinfo::escaped as mountinfo_path;

/// Whether the mount table `mountinfo` has a mount at `dir` or anywhere inside it.
pub(crate) fn has_mount_within(mountinfo: &str, dir: &Path) -> bool {
    let d = mountinfo_path(dir);
    let inside = format!("{}/", d.trim_end_matches('/'));
    mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|m| m == d || m.starts_with(&inside))
}

/// Whether `pid` is a live holder (not this process's own namespace).
fn is_holder(pid: i32) -> bool {
    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    if !cmd.starts_with(format!("{HOLDER_NAME}\0").as_bytes()) {
        return false;
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the command name in parentheses; a zombie holds no namespace.
    let state = stat.rsplit(") ").next().and_then(|s| s.chars().next());
    state.is_some_and(|s| s != 'Z' && s != 'X')
}

/// Moves the calling process into a new mount namespace, a copy of its own with every
/// mount made private (nothing mounted there reaches the old one, nor the reverse).
/// Async-signal-safe: it runs between fork and exec.
pub fn unshare_private() -> std::io::Result<()> {
    // SAFETY: unshare(2) and mount(2) with a static NUL-terminated path and no data.
    unsafe {
        if libc::unshare(libc::CLONE_NEWNS) != 0
            || libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Starts a holder: in a new mount namespace copied from this one with every mount made
/// private (nothing mounted there reaches the host, nor the reverse), or, with `join`, in
/// that namespace.
fn spawn_holder(join: Option<RawFd>) -> Result<Child, IoFailure> {
    let mut cmd = Command::new("sleep");
    cmd.arg0(HOLDER_NAME)
        .arg("infinity")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: only async-signal-safe system calls run between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::setsid();
            if let Some(fd) = join {
                if libc::setns(fd, libc::CLONE_NEWNS) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                return Ok(());
            }
            unshare_private()
        });
    }
    cmd.spawn()
        .ctx(|| "starting the sandboxes' mount namespace (sleep)".into())
}

impl MountNs {
    fn start_or_adopt(pid_file: &Path) -> Result<MountNs, MountNsError> {
        let old = std::fs::read_to_string(pid_file)
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
            .filter(|&p| is_holder(p));
        let (pid, child) = match old {
            Some(pid) => {
                tracing::info!(pid, "adopted the sandboxes' mount namespace");
                (pid, None)
            }
            None => {
                let c = spawn_holder(None)?;
                (c.id() as i32, Some(c))
            }
        };
        let ns_path = format!("/proc/{pid}/ns/mnt");
        let ns = File::open(&ns_path).ctx(|| format!("opening {ns_path}"))?;
        std::fs::write(pid_file, format!("{pid}\n"))
            .ctx(|| format!("writing {}", pid_file.display()))?;
        Ok(MountNs {
            ns,
            pid_file: pid_file.to_path_buf(),
            holder: Mutex::new(Holder { pid, child }),
        })
    }

    fn holder(&self) -> std::sync::MutexGuard<'_, Holder> {
        self.holder.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The holder's pid; a new holder joins the namespace if the last one is gone.
    pub fn pid(&self) -> i32 {
        let mut h = self.holder();
        let exited = match h.child.as_mut() {
            Some(c) => !matches!(c.try_wait(), Ok(None)),
            None => !is_holder(h.pid),
        };
        if exited {
            match spawn_holder(Some(self.ns.as_raw_fd())) {
                Ok(c) => {
                    tracing::warn!(
                        old = h.pid,
                        new = c.id(),
                        "the mount namespace's holder was gone; a new one holds it"
                    );
                    h.pid = c.id() as i32;
                    h.child = Some(c);
                    let _ = std::fs::write(&self.pid_file, format!("{}\n", h.pid));
                }
                Err(e) => tracing::error!("{e}"),
            }
        }
        h.pid
    }

    /// Where the absolute path `p` of the namespace is seen from the host.
    pub fn view(&self, p: &Path) -> PathBuf {
        let rel = p.strip_prefix("/").unwrap_or(p);
        PathBuf::from(format!("/proc/{}/root", self.pid())).join(rel)
    }

    /// Runs `f` on a thread in the namespace (it ends with `f`); processes `f` starts are
    /// in the namespace too.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T, MountNsError> {
        let fd = self.ns.as_raw_fd();
        std::thread::scope(|s| {
            std::thread::Builder::new()
                .name("dsec-mountns".into())
                .spawn_scoped(s, move || {
                    // SAFETY: unshare and setns on this thread only, which ends after `f`;
                    // `fd` stays open for the scope.
                    unsafe {
                        if libc::unshare(libc::CLONE_FS) != 0
                            || libc::setns(fd, libc::CLONE_NEWNS) != 0
                        {
                            return Err(IoFailure::last_os(
                                "joining the sandboxes' mount namespace",
                            )
                            .into());
                        }
                    }
                    Ok(f())
                })
                .ctx(|| "starting a thread in the sandboxes' mount namespace".into())?
                .join()
                .map_err(|_| MountNsError::Panicked)?
        })
    }

    /// Gives directory `dir` a mount of its own in the namespace (a bind of itself),
    /// unless it has one. For the image layers: the kernel checks each lower directory of
    /// a new overlay against every mount attached below the mount the directory is on,
    /// and the namespace's root mount has one for each sandbox's disk and network pin, so
    /// on a mount of their own (with nothing below it) a create costs no more at the
    /// 3,000th sandbox than at the first. Files added to `dir` later are seen there too.
    pub fn own_mount(&self, dir: &Path) -> Result<(), MountNsError> {
        std::fs::create_dir_all(dir).ctx(|| format!("creating {}", dir.display()))?;
        let dir = dir
            .canonicalize()
            .ctx(|| format!("resolving {}", dir.display()))?;
        let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
            .map_err(|_| MountNsError::NulInPath(dir.clone()))?;
        self.run(|| {
            let table = std::fs::read_to_string("/proc/thread-self/mountinfo").unwrap_or_default();
            let target = mountinfo_path(&dir);
            if table
                .lines()
                .any(|l| l.split(' ').nth(4) == Some(target.as_str()))
            {
                return Ok(());
            }
            // SAFETY: mount(2) with NUL-terminated paths that outlive the call.
            let rc = unsafe {
                libc::mount(
                    c.as_ptr(),
                    c.as_ptr(),
                    std::ptr::null(),
                    libc::MS_BIND,
                    std::ptr::null(),
                )
            };
            if rc != 0 {
                return Err(IoFailure::last_os(format!(
                    "bind-mounting {} on itself",
                    dir.display()
                ))
                .into());
            }
            Ok(())
        })?
    }

    /// Ends the holder, and with it the namespace and whatever is still mounted there
    /// (for `dsec down` once no sandbox is left).
    pub fn stop(&self) {
        let mut h = self.holder();
        // SAFETY: kill(2) of the holder's pid, checked to be the holder just before.
        if h.child.is_some() || is_holder(h.pid) {
            unsafe { libc::kill(h.pid, libc::SIGKILL) };
        }
        if let Some(c) = h.child.as_mut() {
            let _ = c.wait();
        }
        let _ = std::fs::remove_file(&self.pid_file);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;

    fn cstr(s: &str) -> CString {
        CString::new(s).unwrap()
    }

    fn root() -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    fn mounted_in(pid: &str, target: &Path) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
            .unwrap_or_default()
            .lines()
            .any(|l| l.split(' ').nth(4) == Some(&*target.to_string_lossy()))
    }

    /// A tmpfs mounted in the namespace is there (and seen through `view`), not in the
    /// host's table; it survives the holder being killed (a new one joins), and goes when
    /// the namespace is stopped.
    #[test]
    fn finds_a_mount_inside_a_directory() {
        let table = "36 25 8:1 / / rw - ext4 /dev/vda rw
40 36 0:50 / /var/lib/dsec/sb/a\\040b/disk rw - tmpfs dsec-disk rw
41 36 0:51 / /var/lib/dsec/sb/c rw - tmpfs x rw
";
        assert!(has_mount_within(table, Path::new("/var/lib/dsec/sb/a b")));
        assert!(has_mount_within(table, Path::new("/var/lib/dsec/sb/c")));
        assert!(has_mount_within(table, Path::new("/var/lib/dsec/sb")));
        // A sibling whose name starts the same is not inside.
        assert!(!has_mount_within(table, Path::new("/var/lib/dsec/sb/a")));
        assert!(!has_mount_within(table, Path::new("/var/lib/dsec/sb/cc")));
    }

    #[test]
    fn mounts_stay_out_of_the_host_and_outlive_a_holder() {
        if !root() {
            eprintln!("skipped: mount namespaces need root");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let ns = MountNs::start_or_adopt(&t.path().join(PID_FILE)).unwrap();
        let target = t.path().join("disk");
        std::fs::create_dir(&target).unwrap();
        let tgt = target.clone();
        ns.run(move || {
            let (src, dst, fs) = (cstr("t"), cstr(&tgt.to_string_lossy()), cstr("tmpfs"));
            // SAFETY: NUL-terminated strings that outlive the call.
            let rc = unsafe {
                libc::mount(src.as_ptr(), dst.as_ptr(), fs.as_ptr(), 0, std::ptr::null())
            };
            assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
            std::fs::write(tgt.join("f"), "in the namespace").unwrap();
        })
        .unwrap();
        assert!(!mounted_in("self", &target), "the host sees the mount");
        assert!(!target.join("f").exists());
        let pid = ns.pid();
        assert!(mounted_in(&pid.to_string(), &target));
        assert_eq!(
            std::fs::read_to_string(ns.view(&target).join("f")).unwrap(),
            "in the namespace"
        );
        // SAFETY: kill of the holder this test started.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        std::thread::sleep(std::time::Duration::from_millis(100));
        let again = ns.pid();
        assert_ne!(again, pid);
        assert_eq!(
            std::fs::read_to_string(ns.view(&target).join("f")).unwrap(),
            "in the namespace",
            "the new holder is not in the same namespace"
        );
        // A second start on the same state adopts the holder instead of making another.
        let adopted = MountNs::start_or_adopt(&t.path().join(PID_FILE)).unwrap();
        assert_eq!(adopted.pid(), again);
        ns.stop();
        assert!(!is_holder(again));
        assert!(!t.path().join(PID_FILE).exists());
    }
}
