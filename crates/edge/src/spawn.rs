//! Starting a program without copying the edge. `std::process::Command` with a `pre_exec`
//! step forks: the kernel copies the page tables of the whole edge (its heap grows with
//! every sandbox it holds) and every page it then writes faults once more, on each OCI
//! runtime call of each create and stop. Here the child shares the edge's memory
//! (`clone(CLONE_VM | CLONE_VFORK)`, as `posix_spawn` does) on a stack of its own, runs
//! the step, and execs; the calling thread waits only until the exec.
//!
//! The step runs in a process that shares this one's memory: like a `pre_exec` closure it
//! may only make async-signal-safe system calls (no allocation, no locks).
//!
//! The child's descriptor table holds only the descriptors below the parked ones
//! ([`park`]): the edge keeps a descriptor per sandbox it watches, parked high, and a
//! child that copied the whole table (and closed each at exec) cost more with every
//! sandbox on the node. The child shares the table at first (`CLONE_FILES`) and replaces
//! it with a copy of the low part before anything else (`close_range(CLOSE_RANGE_UNSHARE)`).
//!
//! A program may be run from a sealed memory copy ([`Program::sealed`]). An OCI runtime
//! run from a file on disk first copies or bind-mounts its own binary and executes itself
//! again (so a container cannot overwrite it through `/proc/self/exe`); run from a sealed
//! copy it sees that there is nothing to protect and skips that, once per call.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicI32, Ordering};

/// The child's stack: the step and the exec only.
const STACK: usize = 128 * 1024;

// From <linux/close_range.h>.
const CLOSE_RANGE_UNSHARE: libc::c_uint = 1 << 1;

/// Where parked descriptors start: 1024, on a node whose descriptor limit leaves room
/// above it; `None` (nothing parked) otherwise.
fn park_base() -> Option<RawFd> {
    static BASE: std::sync::OnceLock<Option<RawFd>> = std::sync::OnceLock::new();
    *BASE.get_or_init(|| {
        // SAFETY: getrlimit fills the struct.
        let mut r: libc::rlimit = unsafe { std::mem::zeroed() };
        let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0;
        (ok && r.rlim_max >= 4096).then_some(1024)
    })
}

/// Moves a descriptor kept for long (one per sandbox) to the parked range, which no
/// started program inherits or pays for. Where that range is full or missing, `fd` stays
/// where it is (correct, only slower to spawn past).
pub fn park(fd: OwnedFd) -> OwnedFd {
    let Some(base) = park_base() else {
        return fd;
    };
    if fd.as_raw_fd() >= base {
        return fd;
    }
    // SAFETY: F_DUPFD_CLOEXEC on a descriptor we own; the copy is owned below.
    let high = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, base) };
    if high < 0 {
        return fd;
    }
    // SAFETY: a descriptor fcntl just returned, owned by nobody else; `fd` closes on drop.
    unsafe { OwnedFd::from_raw_fd(high) }
}

/// What to run: a path, or a sealed copy of the program held open.
#[derive(Debug)]
pub struct Program {
    pub path: std::path::PathBuf,
    sealed: Option<std::os::fd::OwnedFd>,
}

impl Program {
    pub fn path(path: &std::path::Path) -> Program {
        Program {
            path: path.to_path_buf(),
            sealed: None,
        }
    }

    /// A copy of the file at `path` in memory, sealed against every change
    /// (`F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE`), run from there.
    pub fn sealed(path: &std::path::Path) -> std::io::Result<Program> {
        let mut f = memfd(c"dsec-program", libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)?;
        std::io::copy(&mut File::open(path)?, &mut f)?;
        let seals =
            libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
        // SAFETY: fcntl on a descriptor we own.
        if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Program {
            path: path.to_path_buf(),
            sealed: Some(f.into()),
        })
    }

    pub fn is_sealed(&self) -> bool {
        self.sealed.is_some()
    }
}

struct Child<'a> {
    path: *const libc::c_char,
    /// The sealed copy to execute, or -1 for `path`.
    exe: RawFd,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    stdio: [RawFd; 3],
    /// With `CLONE_FILES`: the first descriptor the child's own table leaves out (every
    /// descriptor the child uses is below it); 0: the child has a full copy already.
    files_from: RawFd,
    step: &'a mut dyn FnMut() -> std::io::Result<()>,
    /// The parent's signal mask, restored in the child just before `execv`.
    mask: libc::sigset_t,
    /// errno of what failed in the child; 0 if it reached the program.
    err: AtomicI32,
}

extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `Child` that `spawn` keeps alive until this process has exec'd
    // or exited (CLONE_VFORK suspends the parent until then).
    let c = unsafe { &mut *(arg as *mut Child) };
    let fail = |c: &Child, e: i32| -> ! {
        c.err
            .store(if e == 0 { libc::EINVAL } else { e }, Ordering::SeqCst);
        // SAFETY: ends this process without running anything of the parent's.
        unsafe { libc::_exit(127) }
    };
    // First: until the child has a table of its own, a descriptor it opened, closed or
    // moved would be the parent's. Without close_range (kernels before 5.9), a full copy.
    if c.files_from > 0 {
        // SAFETY: close_range(2) and unshare(2) on this process's own descriptor table.
        unsafe {
            if libc::syscall(
                libc::SYS_close_range,
                c.files_from as libc::c_uint,
                libc::c_uint::MAX,
                CLOSE_RANGE_UNSHARE,
            ) != 0
                && libc::unshare(libc::CLONE_FILES) != 0
            {
                fail(c, *libc::__errno_location());
            }
        }
    }
    // SAFETY: async-signal-safe calls on this process's own signal table (not shared:
    // no CLONE_SIGHAND) and descriptors; the pointers are valid for the calls.
    unsafe {
        // Handlers are the parent's code; none may run here. Signals stay blocked (the
        // parent blocked them all) until the table holds no handler.
        for sig in 1..=libc::SIGRTMAX() {
            let mut sa: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, std::ptr::null(), &mut sa) == 0
                && sa.sa_sigaction != libc::SIG_DFL
                && sa.sa_sigaction != libc::SIG_IGN
            {
                sa.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(sig, &sa, std::ptr::null_mut());
            }
        }
        for (target, &fd) in c.stdio.iter().enumerate() {
            let target = target as RawFd;
            if fd == target {
                let flags = libc::fcntl(fd, libc::F_GETFD);
                libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC);
            } else if libc::dup2(fd, target) < 0 {
                fail(c, *libc::__errno_location());
            }
        }
    }
    if let Err(e) = (c.step)() {
        fail(c, e.raw_os_error().unwrap_or(libc::EINVAL));
    }
    // SAFETY: as above; `path` and `argv` point into CStrings the parent keeps alive.
    unsafe {
        libc::sigprocmask(libc::SIG_SETMASK, &c.mask, std::ptr::null_mut());
        if c.exe >= 0 {
            libc::syscall(
                libc::SYS_execveat,
                c.exe,
                c"".as_ptr(),
                c.argv,
                c.envp,
                libc::AT_EMPTY_PATH,
            );
        } else {
            libc::execve(c.path, c.argv, c.envp);
        }
        fail(c, *libc::__errno_location())
    }
}

fn cstring(s: &OsStr) -> std::io::Result<CString> {
    CString::new(s.as_bytes()).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("argument {s:?} has a NUL byte"),
        )
    })
}

/// Starts `program` with `args` (not including argv\[0\], which is its path), this
/// process's environment, `stdio` as its fds 0, 1 and 2, after `step` has run in the new
/// process. `uses`: every other descriptor the step uses (the child's table keeps them).
/// Returns its pid once it has exec'd; an error if the step or the exec failed (the
/// process is then reaped).
pub fn spawn(
    program: &Program,
    args: &[&OsStr],
    stdio: [RawFd; 3],
    uses: &[RawFd],
    step: &mut dyn FnMut() -> std::io::Result<()>,
) -> std::io::Result<libc::pid_t> {
    let path_c = cstring(program.path.as_os_str())?;
    let mut owned = vec![path_c.clone()];
    for a in args {
        owned.push(cstring(a)?);
    }
    let mut argv: Vec<*const libc::c_char> = owned.iter().map(|s| s.as_ptr()).collect();
    argv.push(std::ptr::null());
    let env: Vec<CString> = std::env::vars_os()
        .filter_map(|(k, v)| {
            let mut kv = k.into_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            CString::new(kv).ok()
        })
        .collect();
    let mut envp: Vec<*const libc::c_char> = env.iter().map(|s| s.as_ptr()).collect();
    envp.push(std::ptr::null());
    let mut stack = vec![0u8; STACK];
    // SAFETY: one past the end of `stack`, rounded down to the 16 bytes the ABI wants.
    let top = unsafe { stack.as_mut_ptr().add(STACK) } as usize & !15;
    // SAFETY: sigset_t is plain data; sigfillset initialises it.
    let exe = program.sealed.as_ref().map_or(-1, |f| f.as_raw_fd());
    let files_from = park_base().map_or(0, |base| {
        let highest = stdio.iter().chain(uses).fold(exe, |m, &fd| m.max(fd));
        base.max(highest + 1)
    });
    let mut child = Child {
        path: path_c.as_ptr(),
        exe,
        argv: argv.as_ptr(),
        envp: envp.as_ptr(),
        stdio,
        files_from,
        step,
        mask: unsafe { std::mem::zeroed() },
        err: AtomicI32::new(0),
    };
    // SAFETY: signal masks of this thread only, restored right after; clone(2) with a
    // stack and an argument that outlive the child's use of them (CLONE_VFORK returns
    // once it has exec'd or exited).
    let pid = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut child.mask);
        let pid = libc::clone(
            child_main,
            top as *mut libc::c_void,
            libc::CLONE_VM
                | libc::CLONE_VFORK
                | if files_from > 0 { libc::CLONE_FILES } else { 0 }
                | libc::SIGCHLD,
            (&mut child as *mut Child).cast(),
        );
        let err = std::io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &child.mask, std::ptr::null_mut());
        if pid < 0 {
            return Err(err);
        }
        pid
    };
    drop(stack);
    let e = child.err.load(Ordering::SeqCst);
    if e != 0 {
        let _ = wait(pid);
        return Err(std::io::Error::from_raw_os_error(e));
    }
    Ok(pid)
}

/// Waits for `pid` (a child of this process) to end.
pub fn wait(pid: libc::pid_t) -> std::io::Result<ExitStatus> {
    let mut status = 0;
    loop {
        // SAFETY: waitpid on our own child with a valid status pointer.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r == pid {
            return Ok(ExitStatus::from_raw(status));
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// What a finished program wrote.
pub struct Output {
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// A new memory file (`memfd_create`).
pub(crate) fn memfd(name: &std::ffi::CStr, flags: libc::c_uint) -> std::io::Result<File> {
    // SAFETY: memfd_create with a NUL-terminated name; the descriptor is owned below.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor owned by nobody else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// All that was written to memory file `f`, read from its start.
pub(crate) fn written(f: &mut File) -> std::io::Result<Vec<u8>> {
    let mut v = Vec::new();
    f.seek(SeekFrom::Start(0))?;
    f.read_to_end(&mut v)?;
    Ok(v)
}

/// Runs `path` to the end with stdin from /dev/null; its stdout and stderr go to memory
/// files (no pipes to drain while it runs) and are returned.
pub fn output(
    program: &Program,
    args: &[&OsStr],
    uses: &[RawFd],
    step: &mut dyn FnMut() -> std::io::Result<()>,
) -> std::io::Result<Output> {
    let null = File::open("/dev/null")?;
    let (mut out, mut err) = (
        memfd(c"stdout", libc::MFD_CLOEXEC)?,
        memfd(c"stderr", libc::MFD_CLOEXEC)?,
    );
    let pid = spawn(
        program,
        args,
        [null.as_raw_fd(), out.as_raw_fd(), err.as_raw_fd()],
        uses,
        step,
    )?;
    let status = wait(pid)?;
    Ok(Output {
        status,
        stdout: written(&mut out)?,
        stderr: written(&mut err)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prog(p: &str) -> Program {
        Program::path(std::path::Path::new(p))
    }

    #[test]
    fn a_sealed_copy_runs_and_cannot_be_changed() {
        let p = Program::sealed(std::path::Path::new("/bin/sh")).unwrap();
        assert!(p.is_sealed());
        let fd = p.sealed.as_ref().unwrap().as_raw_fd();
        // SAFETY: fcntl and write on a descriptor `p` owns.
        unsafe {
            let seals = libc::fcntl(fd, libc::F_GET_SEALS);
            assert_ne!(seals & libc::F_SEAL_WRITE, 0);
            assert!(libc::write(fd, b"x".as_ptr().cast(), 1) < 0);
        }
        // It runs from memory, with argv[0] the path, and sees its environment.
        let o = output(
            &p,
            &[
                OsStr::new("-c"),
                OsStr::new("echo \"$0\"; readlink /proc/$$/exe; echo ${PATH:+has-path}"),
            ],
            &[],
            &mut || Ok(()),
        )
        .unwrap();
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "/bin/sh", "{text}");
        assert!(lines[1].starts_with("/memfd:dsec-program"), "{text}");
        assert_eq!(lines[2], "has-path", "{text}");
    }

    #[test]
    fn runs_the_step_then_the_program() {
        let dir = tempfile::tempdir().unwrap();
        let cwd = CString::new(dir.path().as_os_str().as_bytes()).unwrap();
        // The step changes the child's directory (its own fs state: no CLONE_FS); the
        // program then prints it. The parent's stays where it was.
        let here = std::env::current_dir().unwrap();
        let mut step = || {
            // SAFETY: chdir with a NUL-terminated path.
            if unsafe { libc::chdir(cwd.as_ptr()) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        };
        let o = output(&prog("/bin/pwd"), &[], &[], &mut step).unwrap();
        assert!(o.status.success());
        assert_eq!(
            String::from_utf8_lossy(&o.stdout).trim(),
            dir.path().canonicalize().unwrap().display().to_string()
        );
        assert_eq!(std::env::current_dir().unwrap(), here);
    }

    #[test]
    fn captures_both_streams_and_the_status() {
        let o = output(
            &prog("/bin/sh"),
            &[
                OsStr::new("-c"),
                OsStr::new("echo out; echo err >&2; exit 3"),
            ],
            &[],
            &mut || Ok(()),
        )
        .unwrap();
        assert_eq!(o.status.code(), Some(3));
        assert_eq!(o.stdout, b"out\n");
        assert_eq!(o.stderr, b"err\n");
    }

    #[test]
    fn a_failed_step_or_exec_is_an_error() {
        let e = output(&prog("/bin/true"), &[], &[], &mut || {
            Err(std::io::Error::from_raw_os_error(libc::EPERM))
        })
        .err()
        .unwrap();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM));
        let e = output(&prog("/nonexistent/program"), &[], &[], &mut || Ok(()))
            .err()
            .unwrap();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
    }

    #[test]
    fn the_program_gets_no_handler_and_the_parents_mask() {
        // A handler in the parent becomes the default in the child (SigCgt has no bit
        // for it), and a signal the parent blocks stays blocked there (SigBlk).
        extern "C" fn on_usr1(_: libc::c_int) {}
        // SAFETY: installing a handler that does nothing; blocking SIGUSR2 on this thread.
        let old = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_usr1 as *const () as usize;
            let mut old: libc::sigaction = std::mem::zeroed();
            libc::sigaction(libc::SIGUSR1, &sa, &mut old);
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGUSR2);
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            old
        };
        let o = output(
            &prog("/bin/grep"),
            &[
                OsStr::new("-E"),
                OsStr::new("^Sig(Cgt|Blk)"),
                OsStr::new("/proc/self/status"),
            ],
            &[],
            &mut || Ok(()),
        )
        .unwrap();
        // SAFETY: restoring what was there before.
        unsafe {
            libc::sigaction(libc::SIGUSR1, &old, std::ptr::null_mut());
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGUSR2);
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        }
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        let field = |name: &str| -> u64 {
            let line = text.lines().find(|l| l.starts_with(name)).unwrap();
            u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap()
        };
        assert_eq!(field("SigCgt:") & (1 << (libc::SIGUSR1 - 1)), 0, "{text}");
        assert_ne!(field("SigBlk:") & (1 << (libc::SIGUSR2 - 1)), 0, "{text}");
    }

    /// The child's table holds what it uses and nothing parked; what its step does to its
    /// descriptors (close, open, move) stays in the child.
    #[test]
    fn the_child_gets_a_table_of_its_own_without_the_parked_descriptors() {
        use std::sync::atomic::AtomicBool;
        let Some(base) = park_base() else {
            eprintln!("RLIMIT_NOFILE too low to park descriptors: nothing to check");
            return;
        };
        let open = || File::open("/dev/null").unwrap();
        let low = open();
        // Parked after the used one, so above it: what the child keeps ends at `used`.
        let used = park(OwnedFd::from(open()));
        let parked = park(OwnedFd::from(open()));
        assert!(parked.as_raw_fd() > used.as_raw_fd() && used.as_raw_fd() >= base);
        let (l, p, u) = (low.as_raw_fd(), parked.as_raw_fd(), used.as_raw_fd());
        let (saw_low, saw_parked, saw_used) = (
            AtomicBool::new(false),
            AtomicBool::new(true),
            AtomicBool::new(false),
        );
        let moved = base - 1;
        // SAFETY (in the step): fcntl, dup2 and close on the child's descriptors.
        let mut step = || unsafe {
            let valid = |fd| libc::fcntl(fd, libc::F_GETFD) >= 0;
            saw_low.store(valid(l), Ordering::SeqCst);
            saw_parked.store(valid(p), Ordering::SeqCst);
            saw_used.store(valid(u), Ordering::SeqCst);
            libc::dup2(l, moved);
            libc::close(l);
            libc::close(u);
            Ok(())
        };
        let o = output(&prog("/bin/true"), &[], &[u], &mut step).unwrap();
        assert!(o.status.success());
        assert!(saw_low.load(Ordering::SeqCst), "a low descriptor is copied");
        assert!(saw_used.load(Ordering::SeqCst), "a used one is kept");
        assert!(!saw_parked.load(Ordering::SeqCst), "a parked one is not");
        // The parent still has both it closed, and not the one it made.
        // SAFETY: fcntl on descriptors of this process.
        unsafe {
            assert!(libc::fcntl(l, libc::F_GETFD) >= 0);
            assert!(libc::fcntl(u, libc::F_GETFD) >= 0);
            assert!(libc::fcntl(moved, libc::F_GETFD) < 0);
        }
    }
}
