//! Sandboxes whose first process has exited, told by the kernel: a pidfd per watched
//! process in one epoll set, waited on by one thread. Noticing that one of thousands of
//! idle sandboxes died costs nothing until it does (polling each one's agent woke every
//! sandbox on the node every few seconds).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Mutex;

use tokio::sync::mpsc::UnboundedSender;

pub struct Deaths {
    epoll: OwnedFd,
    /// Token → (sandbox, its pidfd); the id's token in `tokens`.
    watched: Mutex<Watched>,
}

#[derive(Default)]
struct Watched {
    by_token: HashMap<u64, (String, OwnedFd)>,
    tokens: HashMap<String, u64>,
    next: u64,
}

fn pidfd_open(pid: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open(2); it returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just returned, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

impl Deaths {
    /// Starts the waiting thread; the id of each watched sandbox whose process exits is
    /// sent on `died` (once; it is no longer watched then).
    pub fn start(died: UnboundedSender<String>) -> std::io::Result<std::sync::Arc<Deaths>> {
        // SAFETY: epoll_create1 returns a new descriptor or -1.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let d = std::sync::Arc::new(Deaths {
            // SAFETY: the descriptor epoll_create1 just returned.
            epoll: unsafe { OwnedFd::from_raw_fd(fd) },
            watched: Mutex::new(Watched::default()),
        });
        let d2 = d.clone();
        std::thread::Builder::new()
            .name("dsec-deaths".into())
            .spawn(move || d2.wait_loop(died))?;
        Ok(d)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Watched> {
        self.watched.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Watches process `pid` of sandbox `id` (replacing what was watched for it). A
    /// process already gone is reported at once.
    pub fn watch(&self, id: &str, pid: i32) -> std::io::Result<()> {
        // Parked: one per sandbox, kept for its life (see `spawn::park`).
        let pidfd = crate::spawn::park(pidfd_open(pid)?);
        let mut w = self.lock();
        if let Some(old) = w.tokens.remove(id) {
            w.by_token.remove(&old);
        }
        w.next += 1;
        let token = w.next;
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: token,
        };
        // SAFETY: epoll_ctl on our epoll descriptor with a live pidfd and an event struct.
        let rc = unsafe {
            libc::epoll_ctl(
                self.epoll.as_raw_fd(),
                libc::EPOLL_CTL_ADD,
                pidfd.as_raw_fd(),
                &mut ev,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        w.tokens.insert(id.to_string(), token);
        w.by_token.insert(token, (id.to_string(), pidfd));
        Ok(())
    }

    /// Stops watching sandbox `id` (closing its pidfd takes it out of the epoll set).
    pub fn unwatch(&self, id: &str) {
        let mut w = self.lock();
        if let Some(t) = w.tokens.remove(id) {
            w.by_token.remove(&t);
        }
    }

    pub fn watching(&self, id: &str) -> bool {
        self.lock().tokens.contains_key(id)
    }

    fn wait_loop(&self, died: UnboundedSender<String>) {
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 64];
        loop {
            // SAFETY: epoll_wait fills at most `events.len()` entries of our array.
            let n = unsafe {
                libc::epoll_wait(
                    self.epoll.as_raw_fd(),
                    events.as_mut_ptr(),
                    events.len() as i32,
                    -1,
                )
            };
            if n < 0 {
                if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                tracing::error!(
                    "waiting for sandbox processes: {}",
                    std::io::Error::last_os_error()
                );
                return;
            }
            let mut w = self.lock();
            for ev in &events[..n as usize] {
                let token = ev.u64;
                if let Some((id, _fd)) = w.by_token.remove(&token) {
                    w.tokens.remove(&id);
                    if died.send(id).is_err() {
                        return;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_the_exit_of_a_watched_process_once_and_not_an_unwatched_one() {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let d = Deaths::start(tx).unwrap();
        let mut a = std::process::Command::new("sleep")
            .arg("0.2")
            .spawn()
            .unwrap();
        let mut b = std::process::Command::new("sleep")
            .arg("0.2")
            .spawn()
            .unwrap();
        d.watch("a", a.id() as i32).unwrap();
        d.watch("b", b.id() as i32).unwrap();
        d.unwatch("b");
        assert!(d.watching("a") && !d.watching("b"));
        assert!(rx.try_recv().is_err(), "reported before it exited");
        let _ = a.wait();
        let _ = b.wait();
        let got = rx.blocking_recv().unwrap();
        assert_eq!(got, "a");
        assert!(!d.watching("a"));
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(rx.try_recv().is_err(), "an unwatched exit was reported");
    }
}
