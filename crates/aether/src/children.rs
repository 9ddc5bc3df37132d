//! Child bookkeeping for PID 1. Commands aether runs are waited for by the thread that
//! started them; every other zombie (orphans re-parented to us) is reaped here. The reaper
//! only peeks (`WNOWAIT`) and decides under the table lock, which spawners hold from fork
//! until the pid is registered, so it never steals a managed child's exit status.

use std::collections::HashSet;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

#[derive(Default)]
pub struct Table {
    managed: Mutex<HashSet<u32>>,
    /// Signalled when a spawner registers a child: the reaper waits on it while PID 1 has
    /// no children at all.
    spawned: Condvar,
}

impl Table {
    /// Held while spawning; register the new pid (with [`Table::register`]) before
    /// dropping it.
    pub fn lock(&self) -> MutexGuard<'_, HashSet<u32>> {
        self.managed.lock().unwrap_or_else(|p| p.into_inner())
    }
    /// Records a child just spawned under `guard` and wakes the reaper.
    pub fn register(&self, guard: &mut MutexGuard<'_, HashSet<u32>>, pid: u32) {
        guard.insert(pid);
        self.spawned.notify_all();
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

pub fn start_reaper(table: Arc<Table>) {
    std::thread::spawn(move || {
        loop {
            // SAFETY: siginfo_t is plain data; waitid fills it.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            let rc =
                unsafe { libc::waitid(libc::P_ALL, 0, &mut info, libc::WEXITED | libc::WNOWAIT) };
            if rc != 0 {
                // ECHILD: no children at all, so no zombie can appear (an orphan needs a
                // living descendant) until one is spawned. Wait for that, not in a sleep
                // loop: a thousand idle sandboxes would otherwise wake the node 50 000
                // times a second. Checked again under the lock spawners hold from fork to
                // registration, so no spawn is missed. Only a process that entered the
                // sandbox from outside (`crun exec`) can leave us an orphan without a
                // spawn of ours; its zombie is reaped at the next spawn or within a minute
                // (a shorter bound woke every idle sandbox on the node once a second).
                let g = table.lock();
                if childless() {
                    let _ = table.spawned.wait_timeout(g, Duration::from_secs(60));
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
    });
}
