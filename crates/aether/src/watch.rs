//! Directory watches through inotify: events in kernel order, new subdirectories added to a
//! recursive watch as they appear. The watch ends when the edge closes the connection.

use std::collections::HashMap;
use std::ffi::CString;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use dsec_common::ErrorCode;
use dsec_common::channel::{FsEvent, Response, write_json};

use crate::files::{FsError, io_err};

const MASK: u32 = libc::IN_CREATE
    | libc::IN_CLOSE_WRITE
    | libc::IN_MODIFY
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_ATTRIB
    | libc::IN_DELETE_SELF;
/// More watched directories than this is refused (each costs kernel memory).
const MAX_DIRS: usize = 8192;

struct Watcher {
    fd: OwnedFd,
    dirs: HashMap<i32, PathBuf>,
    recursive: bool,
}

impl Watcher {
    /// Watches `dir` (and, when recursive, the directories in it). `found`, for a directory
    /// that has just appeared: what is already in it gets a `create` there, since it may
    /// have been made before the watch was in place (`mkdir -p a/b && touch a/b/c` is over
    /// before the event for `a` is read); a change made meanwhile may then be told twice,
    /// never missed.
    fn add(
        &mut self,
        dir: &Path,
        mut found: Option<&mut Vec<(u32, FsEvent)>>,
    ) -> Result<(), FsError> {
        if self.dirs.len() >= MAX_DIRS {
            return Err((
                ErrorCode::ResourceExhausted,
                format!("more than {MAX_DIRS} directories to watch; watch a smaller tree"),
            ));
        }
        let c = CString::new(dir.as_os_str().as_bytes())
            .map_err(|_| (ErrorCode::InvalidArgument, "path contains NUL".to_string()))?;
        // SAFETY: a valid inotify fd and a NUL-terminated path.
        let wd = unsafe { libc::inotify_add_watch(self.fd.as_raw_fd(), c.as_ptr(), MASK) };
        if wd < 0 {
            return Err(io_err("cannot watch", dir, std::io::Error::last_os_error()));
        }
        self.dirs.insert(wd, dir.to_path_buf());
        if self.recursive
            && let Ok(rd) = std::fs::read_dir(dir)
        {
            for e in rd.flatten() {
                let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
                if let Some(f) = found.as_deref_mut() {
                    f.push((
                        0,
                        FsEvent {
                            kind: "create".into(),
                            path: e.path().display().to_string(),
                            is_dir,
                            from: None,
                            entry: None,
                        },
                    ));
                }
                if is_dir {
                    self.add(&e.path(), found.as_deref_mut())?;
                }
            }
        }
        Ok(())
    }
}

/// What a watch watches and reports.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub recursive: bool,
    /// Events carry the entry's stat.
    pub entry: bool,
    pub allow_network_mounts: bool,
}

/// `statfs` magic numbers of filesystems whose files change elsewhere too (inotify sees
/// only this machine's changes): NFS, SMB/CIFS, 9p, FUSE (sshfs and the like), Ceph, AFS,
/// virtio-fs (FUSE's number) and Coda.
const NETWORK_FS: [i64; 10] = [
    0x6969,
    0x517b,
    0xff53_4d42,
    0xfe53_4d42,
    0x0102_1997,
    0x6573_5546,
    0x00c3_6400,
    0x5346_414f,
    0x6b41_4653,
    0x7375_7245,
];

fn on_network_fs(p: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: statfs fills the zeroed struct for a NUL-terminated path.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    unsafe { libc::statfs(c.as_ptr(), &mut s) == 0 && NETWORK_FS.contains(&(s.f_type as i64)) }
}

/// Watches `path` and writes `Ready`, then one `Event` per change, to `out`.
pub fn run(path: &Path, how: Options, out: &mut UnixStream) -> Result<(), FsError> {
    let recursive = how.recursive;
    let root = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .unwrap_or_else(|_| "/".into())
            .join(path)
    };
    let m = std::fs::metadata(&root).map_err(|e| io_err("cannot watch", &root, e))?;
    if !m.is_dir() {
        return Err((
            ErrorCode::InvalidArgument,
            format!("{} is not a directory; watch a directory", root.display()),
        ));
    }
    if !how.allow_network_mounts && on_network_fs(&root) {
        return Err((
            ErrorCode::FailedPrecondition,
            format!(
                "{} is on a network filesystem, where changes made elsewhere are not seen; allow network mounts to watch it anyway",
                root.display()
            ),
        ));
    }
    // SAFETY: plain syscall; the fd is owned below.
    let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
    if fd < 0 {
        return Err(io_err(
            "cannot watch",
            &root,
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: inotify_init1 returned a fresh fd.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut w = Watcher {
        fd,
        dirs: HashMap::new(),
        recursive,
    };
    w.add(&root, None)?;
    if write_json(out, &Response::Ready).is_err() {
        return Ok(());
    }
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let mut fds = [
            libc::pollfd {
                fd: w.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: out.as_raw_fd(),
                events: libc::POLLRDHUP,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, 1000) };
        if n < 0 {
            continue;
        }
        if fds[1].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
            return Ok(()); // the edge closed the watch
        }
        if fds[0].revents & libc::POLLIN == 0 {
            continue;
        }
        // SAFETY: reading into our buffer from the inotify fd.
        let len = unsafe { libc::read(w.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if len <= 0 {
            continue;
        }
        let mut events = Vec::new();
        let mut off = 0usize;
        let hdr = std::mem::size_of::<libc::inotify_event>();
        while off + hdr <= len as usize {
            // SAFETY: the kernel wrote whole inotify_event records; read_unaligned copes
            // with the byte buffer's alignment.
            let ev: libc::inotify_event =
                unsafe { std::ptr::read_unaligned(buf[off..].as_ptr().cast()) };
            let name_bytes = &buf[off + hdr..off + hdr + ev.len as usize];
            let name_end = name_bytes
                .iter()
                .position(|&b| b == 0)
                .unwrap_or(name_bytes.len());
            let name = std::ffi::OsStr::from_bytes(&name_bytes[..name_end]);
            off += hdr + ev.len as usize;
            let Some(dir) = w.dirs.get(&ev.wd).cloned() else {
                continue;
            };
            if ev.mask & libc::IN_DELETE_SELF != 0 {
                w.dirs.remove(&ev.wd);
                continue;
            }
            let path = dir.join(name);
            let is_dir = ev.mask & libc::IN_ISDIR != 0;
            let kind = if ev.mask & libc::IN_CREATE != 0 {
                "create"
            } else if ev.mask & (libc::IN_MODIFY | libc::IN_CLOSE_WRITE) != 0 {
                "write"
            } else if ev.mask & libc::IN_DELETE != 0 {
                "remove"
            } else if ev.mask & libc::IN_MOVED_FROM != 0 {
                "moved_from"
            } else if ev.mask & libc::IN_MOVED_TO != 0 {
                "moved_to"
            } else if ev.mask & libc::IN_ATTRIB != 0 {
                "chmod"
            } else {
                continue;
            };
            events.push((
                ev.cookie,
                FsEvent {
                    kind: kind.into(),
                    path: path.display().to_string(),
                    is_dir,
                    from: None,
                    entry: None,
                },
            ));
            if is_dir && recursive && (kind == "create" || kind == "moved_to") {
                let _ = w.add(&path, Some(&mut events));
            }
        }
        for mut ev in pair_renames(events) {
            if how.entry && ev.kind != "remove" {
                ev.entry = crate::files::stat(Path::new(&ev.path)).ok();
            }
            if write_json(out, &Response::Event(ev)).is_err() {
                return Ok(());
            }
        }
        let _ = out.flush();
    }
}

/// Joins a `moved_from` and the `moved_to` with the same cookie into one `rename`; a move
/// out of the watched tree is a `remove`, one into it a `create`.
fn pair_renames(events: Vec<(u32, FsEvent)>) -> Vec<FsEvent> {
    let mut out: Vec<FsEvent> = Vec::new();
    let mut pending: Vec<(u32, usize)> = Vec::new();
    for (cookie, mut ev) in events {
        match ev.kind.as_str() {
            "moved_from" => {
                ev.kind = "remove".into();
                pending.push((cookie, out.len()));
                out.push(ev);
            }
            "moved_to" => {
                if let Some(i) = pending.iter().position(|(c, _)| *c == cookie) {
                    let (_, at) = pending.remove(i);
                    let from = out[at].path.clone();
                    out[at] = FsEvent {
                        kind: "rename".into(),
                        from: Some(from),
                        ..ev
                    };
                } else {
                    ev.kind = "create".into();
                    out.push(ev);
                }
            }
            // Several writes in a row to one file are one event.
            _ if out.last() == Some(&ev) => {}
            _ => out.push(ev),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(kind: &str, path: &str) -> FsEvent {
        FsEvent {
            kind: kind.into(),
            path: path.into(),
            is_dir: false,
            from: None,
            entry: None,
        }
    }

    #[test]
    fn a_new_directory_tells_what_was_made_in_it_before_its_watch() {
        let root = std::env::temp_dir().join(format!("aether-watch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        // SAFETY: plain syscall; the fd is owned below.
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
        assert!(fd >= 0);
        let mut w = Watcher {
            // SAFETY: inotify_init1 returned a fresh fd.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            dirs: HashMap::new(),
            recursive: true,
        };
        w.add(&root, None).unwrap();
        // All made before the event for `d` is handled, as `mkdir -p d/e && touch d/e/y`.
        std::fs::create_dir_all(root.join("d/e")).unwrap();
        std::fs::write(root.join("d/e/y"), "1").unwrap();
        let mut found = Vec::new();
        w.add(&root.join("d"), Some(&mut found)).unwrap();
        let mut told: Vec<(String, bool)> = found
            .iter()
            .map(|(_, e)| (e.path.clone(), e.is_dir))
            .collect();
        told.sort();
        let p = |s: &str| root.join(s).display().to_string();
        assert_eq!(told, [(p("d/e"), true), (p("d/e/y"), false)]);
        assert!(found.iter().all(|(_, e)| e.kind == "create"));
        // And both directories are watched from now on.
        assert_eq!(w.dirs.len(), 3);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn moves_pair_into_renames() {
        let out = pair_renames(vec![
            (0, ev("create", "/a")),
            (7, ev("moved_from", "/a")),
            (7, ev("moved_to", "/b")),
            (9, ev("moved_from", "/c")),
            (11, ev("moved_to", "/d")),
        ]);
        let kinds: Vec<(&str, &str)> = out
            .iter()
            .map(|e| (e.kind.as_str(), e.path.as_str()))
            .collect();
        assert_eq!(
            kinds,
            [
                ("create", "/a"),
                ("rename", "/b"),
                ("remove", "/c"),
                ("create", "/d")
            ]
        );
        assert_eq!(out[1].from.as_deref(), Some("/a"));
    }
}
