//! chronus: one per shell session, started by aether as `dsec-aether chronus SHELL`. It is
//! a child subreaper, so every process the session starts stays in its tree even after
//! detaching (`setsid`, double fork); that makes "kill the session" kill all of them.
//! It talks to aether only through signals and the shell's inherited stdio:
//! SIGUSR1 kills everything but the shell (a timed-out command), SIGTERM ends the session.
//! It exits with the shell's status, after killing whatever the shell left behind. (No
//! parent-death signal: that fires when the spawning *thread* of aether ends; if aether
//! itself ends, the whole pid namespace goes with it.)

use std::collections::HashMap;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::Duration;

/// Parent pid of every process, from /proc.
fn parents() -> HashMap<i32, i32> {
    let mut out = HashMap::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // The command name is in parentheses and may contain anything: parse after it.
        if let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..])
            && let Some(ppid) = rest.split_whitespace().nth(1).and_then(|s| s.parse().ok())
        {
            out.insert(pid, ppid);
        }
    }
    out
}

/// Every process below `root`.
pub fn descendants(root: i32) -> Vec<i32> {
    let parents = parents();
    let mut out = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for (&c, &pp) in &parents {
            if pp == p && !out.contains(&c) {
                out.push(c);
                frontier.push(c);
            }
        }
    }
    out
}

/// Reaps exited children; returns the shell's wait status if it was among them.
fn reap(shell: i32) -> Option<i32> {
    let mut shell_status = None;
    loop {
        let mut status = 0;
        // SAFETY: plain waitpid on our own children.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid <= 0 {
            return shell_status;
        }
        if pid == shell {
            shell_status = Some(status);
        }
    }
}

/// SIGKILLs every descendant except `keep` (not its children), until none is left.
fn kill_tree(me: i32, keep: Option<i32>, shell: i32, shell_status: &mut Option<i32>) {
    for _ in 0..200 {
        let victims: Vec<i32> = descendants(me)
            .into_iter()
            .filter(|&p| Some(p) != keep)
            .collect();
        let mut alive = 0;
        for p in victims {
            // A zombie child still shows up until reaped; only living ones count.
            let zombie = std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|s| {
                    s.rfind(')')
                        .map(|i| s[i + 1..].trim_start().starts_with('Z'))
                })
                .unwrap_or(true);
            if !zombie {
                alive += 1;
                // SAFETY: kill(2) on a process in our own tree.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
        }
        if let Some(s) = reap(shell) {
            *shell_status = Some(s);
        }
        if alive == 0 {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn exit_code(status: i32) -> i32 {
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    }
}

pub fn main(shell: &str) -> ! {
    // SAFETY: prctl and sigprocmask on our own process; sigset_t is filled by sigemptyset.
    let set = unsafe {
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGCHLD, libc::SIGTERM, libc::SIGUSR1, libc::SIGINT] {
            libc::sigaddset(&mut set, s);
        }
        libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    let mut cmd = Command::new(shell);
    if shell.ends_with("bash") {
        cmd.args(["--noprofile", "--norc"]);
    }
    // The shell reads commands on stdin, which aether writes; commands themselves get
    // /dev/null as stdin (see session.rs).
    let child = match cmd.process_group(0).spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("chronus: cannot start {shell}: {e}");
            std::process::exit(127);
        }
    };
    let shell_pid = child.id() as i32;
    let me = std::process::id() as i32;
    let mut shell_status: Option<i32> = None;
    loop {
        if let Some(s) = shell_status {
            kill_tree(me, None, shell_pid, &mut shell_status);
            std::process::exit(exit_code(s));
        }
        // SAFETY: waiting for one of the blocked signals.
        let sig = unsafe { libc::sigwaitinfo(&set, std::ptr::null_mut()) };
        match sig {
            libc::SIGCHLD => {
                if let Some(s) = reap(shell_pid) {
                    shell_status = Some(s);
                }
            }
            libc::SIGUSR1 => kill_tree(me, Some(shell_pid), shell_pid, &mut shell_status),
            libc::SIGTERM | libc::SIGINT => {
                kill_tree(me, None, shell_pid, &mut shell_status);
                std::process::exit(exit_code(shell_status.unwrap_or(libc::SIGKILL)));
            }
            _ => {}
        }
    }
}
