//! The jail each Firecracker process runs in: what Firecracker's own `jailer` does, done
//! by the edge between fork and exec. The VMM gets a mount namespace of its own whose root
//! is an empty tmpfs holding only what it needs, each at the same absolute path as on the
//! host (so API calls name the host's paths unchanged): its binary, the kernel, initrd and
//! disk it boots (read-only), the snapshot files it loads (read-only), its own working
//! directory and memory directory (read-write), the shared libraries of the host
//! (read-only, for a dynamically linked build), and its own `/dev/kvm` and
//! `/dev/net/tun` nodes owned by its user. It then drops to an unprivileged user
//! (`[edge] firecracker_run_as`, default `nobody`) with no capabilities and
//! `no_new_privs`, in the sandbox's cgroup and network namespace (set by the backend). An
//! escape from the VMM lands as that user in a root that holds nothing of other sandboxes
//! or of the node.
//!
//! Everything a jail needs is computed before the fork ([`Jail::new`]); between fork and
//! exec only system calls on prepared C strings run.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use dsec_common::IoContext;

use super::MicrovmError;

/// Host directories of shared libraries, bound read-only when present.
const LIB_DIRS: &[&str] = &["/lib", "/lib64", "/usr/lib", "/usr/lib64"];

/// Device nodes made in every jail: (path, major, minor).
const DEVICES: &[(&str, u32, u32)] = &[("/dev/kvm", 10, 232), ("/dev/net/tun", 10, 200)];

/// Who the VMM runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunAs {
    pub uid: u32,
    pub gid: u32,
}

impl RunAs {
    /// The user named `name` (its uid and primary group); `None` when empty (stay root).
    pub fn lookup(name: &str) -> Result<Option<RunAs>, MicrovmError> {
        if name.is_empty() {
            return Ok(None);
        }
        let c = CString::new(name).map_err(|_| MicrovmError::NulInPath(name.into()))?;
        // SAFETY: a NUL-terminated name; the entry is copied out at once (this runs while
        // the backend is made, before any other thread looks users up).
        let pw = unsafe { libc::getpwnam(c.as_ptr()) };
        if pw.is_null() {
            return Err(MicrovmError::Unavailable(format!(
                "[edge] firecracker_run_as = {name:?} is not a user of this host (Firecracker drops to it; create it, or give \"nobody\")"
            )));
        }
        // SAFETY: non-null result of getpwnam.
        let (uid, gid) = unsafe { ((*pw).pw_uid, (*pw).pw_gid) };
        Ok(Some(RunAs { uid, gid }))
    }
}

/// What to put in a jail.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// An empty directory the jail's root is mounted on (in the VMM's namespace only).
    pub root: PathBuf,
    /// Files and directories visible read-only.
    pub read_only: Vec<PathBuf>,
    /// Directories visible read-write (the VMM's own).
    pub read_write: Vec<PathBuf>,
    pub run_as: Option<RunAs>,
}

enum Step {
    MkDir(CString),
    /// A file to bind over.
    Touch(CString),
    Bind {
        src: CString,
        dst: CString,
        read_only: bool,
    },
    Device {
        path: CString,
        dev: libc::dev_t,
    },
    /// A symbolic link as on the host (`/lib64 -> usr/lib64` on a merged-/usr system,
    /// where a dynamic binary's loader is named through it).
    Symlink {
        target: CString,
        path: CString,
    },
}

/// A jail ready to enter in a forked child ([`Jail::enter`]).
pub struct Jail {
    root: CString,
    steps: Vec<Step>,
    run_as: Option<RunAs>,
    tmpfs: CString,
    tmpfs_opts: CString,
    slash: CString,
    dot: CString,
}

fn cstr(p: &Path) -> Result<CString, MicrovmError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| MicrovmError::NulInPath(p.to_path_buf()))
}

/// `p` inside the jail's root.
fn inside(root: &Path, p: &Path) -> Result<PathBuf, MicrovmError> {
    if !p.is_absolute() || p.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(MicrovmError::Refused(format!(
            "{} is not an absolute, plain path",
            p.display()
        )));
    }
    Ok(root.join(p.strip_prefix("/").unwrap_or(p)))
}

impl Jail {
    /// Prepares the steps (every path resolved and encoded now, before the fork).
    pub fn new(plan: &Plan) -> Result<Jail, MicrovmError> {
        let mut steps = Vec::new();
        let mut made: Vec<PathBuf> = Vec::new();
        let mut mkdirs = |steps: &mut Vec<Step>, dir: &Path| -> Result<(), MicrovmError> {
            let mut cur = PathBuf::from("/");
            for c in dir.components().skip(1) {
                cur.push(c);
                if !made.contains(&cur) {
                    made.push(cur.clone());
                    steps.push(Step::MkDir(cstr(&inside(&plan.root, &cur)?)?));
                }
            }
            Ok(())
        };
        let binds = plan
            .read_only
            .iter()
            .map(|p| (p.clone(), true))
            .chain(
                LIB_DIRS
                    .iter()
                    .map(PathBuf::from)
                    .filter(|p| p.is_dir() && !p.is_symlink())
                    .map(|p| (p, true)),
            )
            .chain(plan.read_write.iter().map(|p| (p.clone(), false)));
        for (src, read_only) in binds {
            let meta = std::fs::metadata(&src).ctx(|| format!("{}", src.display()))?;
            let dst = inside(&plan.root, &src)?;
            if meta.is_dir() {
                mkdirs(&mut steps, &src)?;
            } else {
                if let Some(parent) = src.parent() {
                    mkdirs(&mut steps, parent)?;
                }
                steps.push(Step::Touch(cstr(&dst)?));
            }
            steps.push(Step::Bind {
                src: cstr(&src)?,
                dst: cstr(&dst)?,
                read_only,
            });
        }
        for l in LIB_DIRS.iter().map(Path::new).filter(|p| p.is_symlink()) {
            let target = std::fs::read_link(l).ctx(|| format!("{}", l.display()))?;
            steps.push(Step::Symlink {
                target: cstr(&target)?,
                path: cstr(&inside(&plan.root, l)?)?,
            });
        }
        for (path, major, minor) in DEVICES {
            let p = Path::new(path);
            if let Some(parent) = p.parent() {
                mkdirs(&mut steps, parent)?;
            }
            steps.push(Step::Device {
                path: cstr(&inside(&plan.root, p)?)?,
                dev: libc::makedev(*major, *minor),
            });
        }
        Ok(Jail {
            root: cstr(&plan.root)?,
            steps,
            run_as: plan.run_as,
            tmpfs: c"tmpfs".to_owned(),
            tmpfs_opts: c"mode=0755,size=64k".to_owned(),
            slash: c"/".to_owned(),
            dot: c".".to_owned(),
        })
    }

    /// Enters the jail: in a forked child, just before exec (async-signal-safe: only
    /// system calls on the prepared strings).
    ///
    /// # Safety
    /// Call only between fork and exec.
    pub unsafe fn enter(&self) -> io::Result<()> {
        let err = || Err(io::Error::last_os_error());
        // SAFETY (whole block): plain system calls on NUL-terminated strings prepared
        // before the fork; the child is single-threaded.
        unsafe {
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                return err();
            }
            // Nothing mounted from here on reaches the host's namespace.
            if libc::mount(
                std::ptr::null(),
                self.slash.as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) != 0
            {
                return err();
            }
            if libc::mount(
                self.tmpfs.as_ptr(),
                self.root.as_ptr(),
                self.tmpfs.as_ptr(),
                libc::MS_NOSUID,
                self.tmpfs_opts.as_ptr().cast(),
            ) != 0
            {
                return err();
            }
            for s in &self.steps {
                let ok = match s {
                    Step::MkDir(p) => {
                        libc::mkdir(p.as_ptr(), 0o755) == 0
                            || *libc::__errno_location() == libc::EEXIST
                    }
                    Step::Touch(p) => {
                        let fd = libc::open(
                            p.as_ptr(),
                            libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                            0o600,
                        );
                        fd >= 0 && libc::close(fd) == 0
                    }
                    Step::Bind {
                        src,
                        dst,
                        read_only,
                    } => {
                        let flags = libc::MS_BIND | libc::MS_REC;
                        libc::mount(
                            src.as_ptr(),
                            dst.as_ptr(),
                            std::ptr::null(),
                            flags,
                            std::ptr::null(),
                        ) == 0
                            && (!read_only
                                || libc::mount(
                                    std::ptr::null(),
                                    dst.as_ptr(),
                                    std::ptr::null(),
                                    flags
                                        | libc::MS_REMOUNT
                                        | libc::MS_RDONLY
                                        | libc::MS_NOSUID
                                        | libc::MS_NODEV,
                                    std::ptr::null(),
                                ) == 0)
                    }
                    Step::Symlink { target, path } => {
                        libc::symlink(target.as_ptr(), path.as_ptr()) == 0
                    }
                    Step::Device { path, dev } => {
                        let made = libc::mknod(path.as_ptr(), libc::S_IFCHR | 0o600, *dev) == 0;
                        made && match self.run_as {
                            Some(r) => libc::chown(path.as_ptr(), r.uid, r.gid) == 0,
                            None => true,
                        }
                    }
                };
                if !ok {
                    return err();
                }
            }
            if libc::chdir(self.root.as_ptr()) != 0
                || libc::chroot(self.dot.as_ptr()) != 0
                || libc::chdir(self.slash.as_ptr()) != 0
            {
                return err();
            }
            if let Some(r) = self.run_as {
                // Groups first, while still allowed; setuid to a non-zero uid clears
                // every capability.
                if libc::setgroups(0, std::ptr::null()) != 0
                    || libc::setgid(r.gid) != 0
                    || libc::setuid(r.uid) != 0
                {
                    return err();
                }
            }
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return err();
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_land_inside_the_root_and_odd_ones_are_refused() {
        let root = Path::new("/run/j");
        assert_eq!(
            inside(root, Path::new("/var/lib/x")).unwrap(),
            PathBuf::from("/run/j/var/lib/x")
        );
        assert!(inside(root, Path::new("rel")).is_err());
        assert!(inside(root, Path::new("/a/../etc")).is_err());
        assert!(RunAs::lookup("").unwrap().is_none());
        assert!(RunAs::lookup("no-such-user-dsec").is_err());
        assert_eq!(
            RunAs::lookup("root").unwrap(),
            Some(RunAs { uid: 0, gid: 0 })
        );
    }
}
