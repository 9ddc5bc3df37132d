//! Child bookkeeping for PID 1. Commands aether runs are waited for by the thread that
//! started them; every other zombie (orphans re-parented to us) is reaped here. The reaper
//! only peeks (`WNOWAIT`) and decides under the table lock, which spawners hold from fork
//! until the pid is registered, so it never steals a managed child's exit status.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

#[derive(Default)]
pub struct Table {
    managed: Mutex<HashSet<u32>>,
}

impl Table {
    /// Held while spawning; register the new pid before dropping it.
    pub fn lock(&self) -> MutexGuard<'_, HashSet<u32>> {
        self.managed.lock().unwrap_or_else(|p| p.into_inner())
    }
    pub fn release(&self, pid: u32) {
        self.lock().remove(&pid);
    }
}

pub fn start_reaper(table: Arc<Table>) {
    std::thread::spawn(move || {
        loop {
            // SAFETY: siginfo_t is plain data; waitid fills it.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            let rc =
                unsafe { libc::waitid(libc::P_ALL, 0, &mut info, libc::WEXITED | libc::WNOWAIT) };
            if rc != 0 {
                // ECHILD: no children at all right now.
                std::thread::sleep(Duration::from_millis(20));
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
