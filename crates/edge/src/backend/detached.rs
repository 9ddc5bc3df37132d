//! Helpers for the processes a VM backend runs detached from the edge (QEMU, Firecracker,
//! their channel proxies), known by pid files, and for the small JSON files and sparse
//! memory files next to them.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use dsec_common::{IoContext, IoFailure};

use super::StateError;

/// Makes `cmd` start a session of its own, so that the edge's exit does not take it along.
pub fn new_session(cmd: &mut Command) {
    // SAFETY: setsid(2) between fork and exec, an async-signal-safe call.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
}

/// Starts `cmd` detached ([`new_session`]) and records its pid in `pid_file`; `what`
/// names it in errors.
pub fn spawn_detached(cmd: &mut Command, what: &str, pid_file: &Path) -> Result<Child, IoFailure> {
    new_session(cmd);
    let child = cmd.spawn().ctx(|| format!("starting {what}"))?;
    std::fs::write(pid_file, child.id().to_string())
        .ctx(|| format!("writing {}", pid_file.display()))?;
    Ok(child)
}

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

pub fn read_json<T: serde::de::DeserializeOwned>(p: &Path) -> Result<T, StateError> {
    let b = std::fs::read(p).ctx(|| format!("reading {}", p.display()))?;
    serde_json::from_slice(&b).map_err(|source| StateError::Json {
        path: p.to_path_buf(),
        source,
    })
}

/// Writes `v` as JSON to `p` whole or not at all (a reader never sees half of it).
pub fn write_json<T: serde::Serialize>(p: &Path, v: &T) -> Result<(), StateError> {
    let b = serde_json::to_vec_pretty(v).map_err(|source| StateError::Json {
        path: p.to_path_buf(),
        source,
    })?;
    let mut tmp = p.as_os_str().to_owned();
    tmp.push(format!(".{}.tmp", crate::random_hex(6)));
    let tmp = std::path::PathBuf::from(tmp);
    std::fs::write(&tmp, b)
        .and_then(|()| std::fs::rename(&tmp, p))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            IoFailure::new(format!("writing {}", p.display()), e).into()
        })
}

/// Copies `from` to `to` keeping its holes (memory files are mostly holes): each data
/// extent (`SEEK_DATA`/`SEEK_HOLE`) goes by `copy_file_range`, inside the kernel. A VM
/// stays paused while its memory is copied, so this is its stall.
pub fn copy_sparse(from: &Path, to: &Path) -> Result<(), IoFailure> {
    let ctx = |what: &str, e: std::io::Error| {
        IoFailure::new(
            format!("copying {} to {}: {what}", from.display(), to.display()),
            e,
        )
    };
    let src = std::fs::File::open(from).map_err(|e| ctx("opening", e))?;
    let len = src.metadata().map_err(|e| ctx("stat", e))?.len();
    let dst = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(to)
        .map_err(|e| ctx("creating", e))?;
    dst.set_len(len).map_err(|e| ctx("sizing", e))?;
    let extents = data_extents(&src, len).map_err(|e| ctx("finding data", e))?;
    // One thread: two threads writing one tmpfs file were no faster (measured).
    extents
        .iter()
        .try_for_each(|&(o, n)| copy_range(&src, &dst, o, n))
        .map_err(|e| ctx("copying", e))
}

/// The `(offset, length)` of each data extent of `f` below `len`.
fn data_extents(f: &std::fs::File, len: u64) -> std::io::Result<Vec<(u64, u64)>> {
    use std::os::fd::AsRawFd;
    let fd = f.as_raw_fd();
    let mut out = Vec::new();
    let mut off = 0u64;
    while off < len {
        // SAFETY: lseek on a descriptor we own; no memory is passed.
        let data = unsafe { libc::lseek(fd, off as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // only a hole is left
            }
            if e.raw_os_error() == Some(libc::EINVAL) {
                // No SEEK_DATA here: all of it is data.
                return Ok(vec![(0, len)]);
            }
            return Err(e);
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let (data, hole) = (data as u64, (hole as u64).min(len));
        if hole > data {
            out.push((data, hole - data));
        }
        off = hole.max(data + 1);
    }
    Ok(out)
}

/// Copies `len` bytes at `off` from `src` to the same offset of `dst`, in the kernel
/// (`copy_file_range`), or by `pread`/`pwrite` where the file systems cannot.
fn copy_range(src: &std::fs::File, dst: &std::fs::File, off: u64, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    let (mut i, mut o) = (off as libc::loff_t, off as libc::loff_t);
    let end = off + len;
    while (i as u64) < end {
        let want = (end - i as u64).min(1 << 30) as usize;
        // SAFETY: both descriptors are open; the offsets are ours and updated by the call.
        let n = unsafe {
            libc::copy_file_range(src.as_raw_fd(), &mut i, dst.as_raw_fd(), &mut o, want, 0)
        };
        if n > 0 {
            continue;
        }
        if n == 0 {
            return Ok(()); // the source ended early (it shrank)
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EXDEV | libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP) => break,
            _ => return Err(e),
        }
    }
    let mut buf = vec![0u8; 1 << 20];
    let mut at = i as u64;
    while at < end {
        let n = src.read_at(&mut buf[..((end - at) as usize).min(1 << 20)], at)?;
        if n == 0 {
            return Ok(());
        }
        dst.write_all_at(&buf[..n], at)?;
        at += n as u64;
    }
    Ok(())
}

/// Gives back the all-zero 4 KiB pages of `path` to the file system (`FALLOCATE`
/// `PUNCH_HOLE`): a memory file written page by page (a live migration's target, which
/// writes every page, zeros included) shrinks to the pages that hold something. Only for
/// a file nobody writes any more: a page written between the check and the punch would
/// be lost. Returns the bytes given back.
pub fn punch_zero_pages(path: &Path) -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    const PAGE: usize = 4096;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    let len = f.metadata()?.len();
    let mut freed = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    for (start, n) in data_extents(&f, len)? {
        let mut at = start;
        while at < start + n {
            let want = ((start + n - at) as usize).min(buf.len());
            let got = f.read_at(&mut buf[..want], at)?;
            if got == 0 {
                break;
            }
            // Runs of zero pages, punched one run at a time.
            let mut run: Option<u64> = None;
            let whole = got - got % PAGE;
            for (i, page) in buf[..whole].chunks(PAGE).enumerate() {
                let off = at + (i * PAGE) as u64;
                let zero = page.iter().all(|&b| b == 0);
                match (zero, run) {
                    (true, None) => run = Some(off),
                    (false, Some(from)) => {
                        freed += punch(f.as_raw_fd(), from, off - from)?;
                        run = None;
                    }
                    _ => {}
                }
            }
            if let Some(from) = run {
                freed += punch(f.as_raw_fd(), from, at + whole as u64 - from)?;
            }
            at += got.max(PAGE) as u64;
        }
    }
    Ok(freed)
}

fn punch(fd: std::os::fd::RawFd, off: u64, len: u64) -> std::io::Result<u64> {
    // SAFETY: fallocate on a descriptor we own; no memory is passed.
    let r = unsafe {
        libc::fallocate(
            fd,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off as libc::off_t,
            len as libc::off_t,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileExt, MetadataExt};

    #[test]
    fn a_sparse_copy_has_the_same_bytes_and_keeps_the_holes() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        let f = std::fs::File::create(&a).unwrap();
        f.set_len(64 << 20).unwrap();
        // Three extents, one of them at the very end.
        for (at, byte) in [(0u64, 1u8), (20 << 20, 2), ((64 << 20) - 8192, 3)] {
            f.write_all_at(&vec![byte; 8192], at).unwrap();
        }
        drop(f);
        std::fs::write(&b, b"old contents, longer than nothing").unwrap();
        copy_sparse(&a, &b).unwrap();
        assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
        let (ma, mb) = (
            std::fs::metadata(&a).unwrap(),
            std::fs::metadata(&b).unwrap(),
        );
        assert_eq!(mb.len(), 64 << 20);
        // Holes stay holes (allowing for file systems that allocate a little around data).
        assert!(mb.blocks() * 512 < 4 << 20, "{} blocks", mb.blocks());
        assert!(ma.blocks() * 512 < 4 << 20);
        assert!(copy_sparse(&dir.path().join("missing"), &b).is_err());
    }

    #[test]
    fn zero_pages_are_given_back_and_the_rest_kept() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ram");
        let f = std::fs::File::create(&p).unwrap();
        // 8 MiB written in full: zeros, one page of data at 1 MiB + 4 KiB, zeros, a last
        // page of data.
        f.write_all_at(&vec![0u8; 8 << 20], 0).unwrap();
        f.write_all_at(&[7u8; 4096], (1 << 20) + 4096).unwrap();
        f.write_all_at(&[9u8; 4096], (8 << 20) - 4096).unwrap();
        f.sync_all().unwrap();
        let before = std::fs::read(&p).unwrap();
        let freed = punch_zero_pages(&p).unwrap();
        assert_eq!(freed, (8 << 20) - 2 * 4096);
        assert_eq!(std::fs::read(&p).unwrap(), before, "the contents stay");
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!(m.len(), 8 << 20);
        assert!(m.blocks() * 512 <= 64 << 10, "{} blocks left", m.blocks());
    }
}
