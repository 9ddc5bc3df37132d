//! Driving an OCI runtime binary (crun, runc, or any compatible one). On hybrid cgroup
//! hosts crun refuses to run while `/sys/fs/cgroup/unified` has controllers, so every crun
//! call there runs in a private mount namespace with that mount detached: crun then sees
//! a plain v1 host. Nothing outside the call is affected. A `run` always has a namespace of
//! its own: the container's root filesystem is attached there (see `rootfs.rs`).
//!
//! crun on such a host still enters the cgroup it finds for the unified line of
//! `/proc/self/cgroup`: with the mount detached, it makes `<path>/cgroup.procs` in the
//! directory under it, which belongs to the node's `/sys/fs/cgroup` tmpfs. Two inodes
//! per create that nothing removed: 12,660 sandboxes' worth were found on a bench node,
//! and creates slowed down run after run. A `run` there gets a directory of the sandbox's
//! own bound over `/sys/fs/cgroup/unified` instead, removed with the sandbox.

use std::ffi::{CString, OsStr};
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::Command;

use dsec_common::{IoContext, IoFailure};

use super::ContainerError;
use crate::cgroup::CgroupMode;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Crun,
    Runc,
    Other,
}

#[derive(Debug, Clone)]
pub struct OciRuntime {
    pub kind: Kind,
    pub version: String,
    /// The runtime's `--root` (its container state), private to this edge.
    root: PathBuf,
    /// What each call runs: for crun and runc a sealed copy in memory (see
    /// [`crate::spawn::Program::sealed`]), which spares each call the runtime's re-exec of
    /// itself. An upgrade of the binary on disk takes effect at the edge's next start.
    program: std::sync::Arc<crate::spawn::Program>,
    hide_unified: bool,
}

fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

impl OciRuntime {
    /// `choice`: `auto`, `crun`, `runc` or a path.
    pub fn resolve(
        choice: &str,
        state_root: &Path,
        mode: CgroupMode,
    ) -> Result<OciRuntime, ContainerError> {
        let path = match choice {
            "auto" => which("crun").or_else(|| which("runc")).ok_or_else(|| {
                ContainerError::NoRuntime(
                    "no OCI runtime found: install crun or runc (apt-get install crun runc), or set oci_runtime in the edge config".into(),
                )
            })?,
            "crun" | "runc" | "youki" | "runsc" => which(choice)
                .ok_or_else(|| {
                    ContainerError::NoRuntime(format!(
                        "OCI runtime {choice} is not installed or not on PATH"
                    ))
                })?,
            p => {
                let p = PathBuf::from(p);
                if !p.is_file() {
                    return Err(ContainerError::NoRuntime(format!(
                        "OCI runtime {} does not exist",
                        p.display()
                    )));
                }
                p
            }
        };
        let out = Command::new(&path)
            .arg("--version")
            .output()
            .ctx(|| format!("cannot run {} --version", path.display()))?;
        let first = String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap_or("")
            .to_string();
        let kind = if first.starts_with("crun") {
            Kind::Crun
        } else if first.starts_with("runc") {
            Kind::Runc
        } else {
            Kind::Other
        };
        let version = first.replace(" version", "");
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let root = state_root.join(name);
        std::fs::create_dir_all(&root).ctx(|| format!("creating {}", root.display()))?;
        let program = match kind {
            Kind::Crun | Kind::Runc => crate::spawn::Program::sealed(&path).unwrap_or_else(|e| {
                tracing::warn!(
                    "cannot copy {} into memory ({e}); running it from disk",
                    path.display()
                );
                crate::spawn::Program::path(&path)
            }),
            Kind::Other => crate::spawn::Program::path(&path),
        };
        Ok(OciRuntime {
            program: std::sync::Arc::new(program),
            kind,
            version,
            root,
            hide_unified: kind == Kind::Crun && mode == CgroupMode::Hybrid,
        })
    }

    /// Removes what crun calls of earlier versions left in the node's `/sys/fs/cgroup`
    /// tmpfs under the detached unified mount (see the module's comment): the entries
    /// of `unified/dsec/` whose sandbox has no memory cgroup, on a thread of its own.
    pub fn sweep_unified_leftovers(&self) {
        if !self.hide_unified {
            return;
        }
        let swept = std::thread::Builder::new()
            .name("dsec-cg-sweep".into())
            .spawn(|| {
                let fd = match super::rootfs::clone_mount(Path::new("/sys/fs/cgroup")) {
                    Ok(fd) => fd,
                    Err(e) => return tracing::warn!("{e}"),
                };
                let dir = PathBuf::from(format!("/proc/self/fd/{}/unified/dsec", fd.as_raw_fd()));
                let Ok(entries) = std::fs::read_dir(&dir) else {
                    return;
                };
                let mut n = 0;
                for e in entries.flatten() {
                    let live = Path::new("/sys/fs/cgroup/memory/dsec").join(e.file_name());
                    if !live.exists() && std::fs::remove_dir_all(e.path()).is_ok() {
                        n += 1;
                    }
                }
                if n > 0 {
                    tracing::info!(
                        "removed {n} directories crun had left in the node's /sys/fs/cgroup tmpfs"
                    );
                }
            });
        if let Err(e) = swept {
            tracing::warn!("starting the cgroup tmpfs sweep: {e}");
        }
    }

    pub fn describe(&self) -> String {
        if self.hide_unified {
            format!("{} (hybrid cgroups: v1 controllers)", self.version)
        } else {
            self.version.clone()
        }
    }

    /// What one runtime call does in its own process before the runtime starts (see
    /// [`crate::spawn`]): detach from our session, so signals to the edge's process group
    /// never reach sandboxes; `pass_fd` becomes fd 3; `rootfs` is a detached mount
    /// attached at its path in the call's own mount namespace.
    fn step(
        &self,
        pass_fd: Option<RawFd>,
        attach: Vec<(RawFd, CString)>,
        unified_scratch: Option<CString>,
    ) -> impl FnMut() -> std::io::Result<()> {
        let hide = self.hide_unified;
        let own_ns = hide || !attach.is_empty();
        let unified = CString::new("/sys/fs/cgroup/unified").unwrap_or_default();
        // Only async-signal-safe system calls: this runs in a process sharing our memory.
        move || {
            // SAFETY: setsid, unshare, umount2, fcntl and dup2 on this process only, with
            // NUL-terminated paths that outlive the calls.
            unsafe {
                libc::setsid();
                if own_ns {
                    crate::mountns::unshare_private()?;
                    if hide {
                        libc::umount2(unified.as_ptr(), libc::MNT_DETACH);
                        if let Some(dir) = &unified_scratch
                            && libc::mount(
                                dir.as_ptr(),
                                unified.as_ptr(),
                                std::ptr::null(),
                                libc::MS_BIND,
                                std::ptr::null(),
                            ) != 0
                        {
                            return Err(std::io::Error::last_os_error());
                        }
                    }
                    for (fd, target) in &attach {
                        super::rootfs::attach(*fd, target)?;
                    }
                }
                // After the attach: the root's descriptor may be the 3 this overwrites.
                if let Some(fd) = pass_fd {
                    if fd == 3 {
                        let flags = libc::fcntl(3, libc::F_GETFD);
                        libc::fcntl(3, libc::F_SETFD, flags & !libc::FD_CLOEXEC);
                    } else if libc::dup2(fd, 3) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
            }
            Ok(())
        }
    }

    /// `--root <root> <args>`.
    fn argv<'a>(&'a self, args: &[&'a OsStr]) -> Vec<&'a OsStr> {
        let mut v = vec![OsStr::new("--root"), self.root.as_os_str()];
        v.extend_from_slice(args);
        v
    }

    fn run_quiet(&self, args: &[&str]) -> Result<String, ContainerError> {
        let args: Vec<&OsStr> = args.iter().map(OsStr::new).collect();
        let out = crate::spawn::output(
            &self.program,
            &self.argv(&args),
            &[],
            &mut self.step(None, Vec::new(), None),
        )
        .ctx(|| format!("cannot run {}", self.program.path.display()))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(ContainerError::Runtime {
                runtime: self.version.clone(),
                call: args
                    .iter()
                    .map(|a| a.to_string_lossy())
                    .collect::<Vec<_>>()
                    .join(" "),
                status: out.status.to_string(),
                output: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            })
        }
    }

    /// `run --detach`: the container's stdio goes to `log`; `listen_fd` is handed to its
    /// first process as fd 3; its pid is written to `pid_file`; `rootfs`, a detached
    /// mount, is its root filesystem (attached at `bundle/rootfs`); `sysfs`, a detached
    /// mount attached at `bundle/sysfs`, for the bundle to bind at /sys.
    #[allow(clippy::too_many_arguments)]
    pub fn run_detached(
        &self,
        cid: &str,
        bundle: &Path,
        rootfs: RawFd,
        sysfs: Option<RawFd>,
        volumes: &[RawFd],
        listen_fd: RawFd,
        log: &Path,
        pid_file: &Path,
    ) -> Result<(), ContainerError> {
        let logf = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .ctx(|| format!("opening {}", log.display()))?;
        let in_bundle = |name: &str| {
            CString::new(bundle.join(name).as_os_str().as_encoded_bytes())
                .map_err(|_| ContainerError::NulInPath(bundle.to_path_buf()))
        };
        let mut attach = vec![(rootfs, in_bundle("rootfs")?)];
        if let Some(fd) = sysfs {
            let dir = bundle.join("sysfs");
            match std::fs::create_dir(&dir) {
                Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                    return Err(IoFailure::new(format!("creating {}", dir.display()), e).into());
                }
                _ => {}
            }
            attach.push((fd, in_bundle("sysfs")?));
        }
        for (i, fd) in volumes.iter().enumerate() {
            let rel = format!("volumes/{i}");
            let dir = bundle.join(&rel);
            match std::fs::create_dir_all(&dir) {
                Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                    return Err(IoFailure::new(format!("creating {}", dir.display()), e).into());
                }
                _ => {}
            }
            attach.push((*fd, in_bundle(&rel)?));
        }
        let uses: Vec<RawFd> = attach.iter().map(|a| a.0).chain([listen_fd]).collect();
        let null = std::fs::File::open("/dev/null").ctx(|| "opening /dev/null".into())?;
        let scratch = if self.hide_unified {
            let dir = bundle.join("cgroup-unified");
            match std::fs::create_dir(&dir) {
                Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                    return Err(IoFailure::new(format!("creating {}", dir.display()), e).into());
                }
                _ => {}
            }
            Some(
                CString::new(dir.as_os_str().as_encoded_bytes())
                    .map_err(|_| ContainerError::NulInPath(bundle.to_path_buf()))?,
            )
        } else {
            None
        };
        let mut args: Vec<&OsStr> = ["run", "--detach", "--preserve-fds", "1"]
            .into_iter()
            .chain(self.no_keyring().iter().copied())
            .chain(["--pid-file"])
            .map(OsStr::new)
            .collect();
        args.extend([
            pid_file.as_os_str(),
            OsStr::new("--bundle"),
            bundle.as_os_str(),
            OsStr::new(cid),
        ]);
        let status = crate::spawn::spawn(
            &self.program,
            &self.argv(&args),
            [null.as_raw_fd(), logf.as_raw_fd(), logf.as_raw_fd()],
            &uses,
            &mut self.step(Some(listen_fd), attach, scratch),
        )
        .and_then(crate::spawn::wait)
        .ctx(|| format!("cannot run {}", self.program.path.display()))?;
        if status.success() {
            return Ok(());
        }
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(5).collect();
        Err(ContainerError::Runtime {
            runtime: self.version.clone(),
            call: "run".into(),
            status: status.to_string(),
            output: tail.into_iter().rev().collect::<Vec<_>>().join(" | "),
        })
    }

    /// No session keyring of the container's own: the kernel finds a named keyring by
    /// walking every keyring of the user namespace, so on a node of thousands of sandboxes
    /// each new one cost more. The sandbox cannot reach a keyring anyway: its seccomp
    /// policy refuses `keyctl`, `add_key` and `request_key` (see `oci.rs`).
    fn no_keyring(&self) -> &'static [&'static str] {
        match self.kind {
            Kind::Crun | Kind::Runc => &["--no-new-keyring"],
            Kind::Other => &[],
        }
    }

    /// The runtime's status string (`running`, `paused`, `stopped`, …), None if unknown.
    pub fn state(&self, cid: &str) -> Option<String> {
        let out = self.run_quiet(&["state", cid]).ok()?;
        let v: serde_json::Value = serde_json::from_str(&out).ok()?;
        v.get("status").and_then(|s| s.as_str()).map(str::to_string)
    }

    pub fn delete_force(&self, cid: &str) -> Result<(), ContainerError> {
        self.run_quiet(&["delete", "--force", cid]).map(|_| ())
    }

    pub fn pause(&self, cid: &str) -> Result<(), ContainerError> {
        self.run_quiet(&["pause", cid]).map(|_| ())
    }

    pub fn resume(&self, cid: &str) -> Result<(), ContainerError> {
        self.run_quiet(&["resume", cid]).map(|_| ())
    }
}
