//! Child bookkeeping for PID 1. Commands aether runs are waited for by the thread that
//! started them; every other zombie (orphans re-parented to us) is reaped here. The reaper
//! only peeks (`WNOWAIT`) and decides under the table lock, which spawners hold from fork
//! until the pid is registered, so it never steals a managed child's exit status.
//!
//! The reaper runs only while PID 1 has children: the first spawn starts it, and it ends
//! when none is left (no zombie can appear then, since an orphan needs a living
//! ancestor of ours). An idle sandbox is then one thread lighter, and the kernel walks
//! every thread of the node on each new container's `pivot_root`. A process that entered
//! the sandbox from outside (`crun exec`) and left an orphan is reaped at the next spawn.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

#[derive(Default)]
pub struct Table {
    managed: Mutex<HashSet<u32>>,
    /// Whether a reaper runs; changed only under `managed`'s lock.
    reaping: AtomicBool,
    me: OnceLock<Weak<Table>>,
}

impl Table {
    pub fn new() -> Arc<Table> {
        let t = Arc::new(Table::default());
        let _ = t.me.set(Arc::downgrade(&t));
        t
    }
    /// Held while spawning; register the new pid (with [`Table::register`]) before
    /// dropping it.
    pub fn lock(&self) -> MutexGuard<'_, HashSet<u32>> {
        self.managed.lock().unwrap_or_else(|p| p.into_inner())
    }
    /// Records a child just spawned under `guard`, and starts the reaper unless it runs.
    pub fn register(&self, guard: &mut MutexGuard<'_, HashSet<u32>>, pid: u32) {
        guard.insert(pid);
        if self.reaping.swap(true, Ordering::SeqCst) {
            return;
        }
        let started = self.me.get().and_then(Weak::upgrade).is_some_and(|t| {
            std::thread::Builder::new()
                .name("reaper".into())
                .spawn(move || reap(t))
                .is_ok()
        });
        if !started {
            // No thread to be had (the pids limit): the next spawn tries again.
            self.reaping.store(false, Ordering::SeqCst);
        }
    }
    pub fn release(&self, pid: u32) {
        self.lock().remove(&pid);
    }
}

/// Whether the calling process has no children (waitid says ECHILD), without waiting.
fn childless() -> bool {
    // SAFETY: siginfo_t is plain data; waitid fills it.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: WNOHANG | WNOWAIT: a peek that neither blocks nor reaps.
    let rc = unsafe {
        libc::waitid(
            libc::P_ALL,
            0,
            &mut info,
            libc::WEXITED | libc::WNOWAIT | libc::WNOHANG,
        )
    };
    rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD)
}

fn reap(table: Arc<Table>) {
    loop {
        // SAFETY: siginfo_t is plain data; waitid fills it.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let rc = unsafe { libc::waitid(libc::P_ALL, 0, &mut info, libc::WEXITED | libc::WNOWAIT) };
        if rc != 0 {
            // ECHILD: no children at all. Decided under the lock spawners hold from fork
            // to registration: a spawn after this starts a new reaper.
            let _g = table.lock();
            if childless() {
                table.reaping.store(false, Ordering::SeqCst);
                return;
            }
            continue;
        }
        // SAFETY: waitid succeeded with WEXITED, so si_pid is valid.
        let pid = unsafe { info.si_pid() };
        let managed = table.lock();
        if managed.contains(&(pid as u32)) {
            drop(managed);
            // Its owner will reap it; give it the chance.
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        let mut status = 0;
        // SAFETY: reaping one specific zombie that nobody else waits for.
        unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    }
}
