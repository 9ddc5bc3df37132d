//! The OCI bundle config the edge writes for a container sandbox. Security defaults
//! (documented in docs/SECURITY.md): mount, pid, net, uts, ipc and cgroup namespaces;
//! capabilities cut to the list below; `noNewPrivileges`; a seccomp allow list; masked and
//! read-only /proc and /sys paths; a device allow list.

use std::path::Path;

use serde_json::{Value, json};

use crate::registry::SandboxRecord;

/// Capabilities sandbox processes keep (Docker's default set without NET_RAW and MKNOD).
pub const CAPABILITIES: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_AUDIT_WRITE",
    "CAP_SETFCAP",
];

/// The system calls a sandbox may make (an allow list after Docker's and containerd's
/// default profiles, x86-64 names): everything else is refused with EPERM, new system
/// calls included. Left out on purpose: mounts and the mount API, namespaces (`unshare`,
/// `setns`; `clone` is allowed below without `CLONE_NEWUSER`), `ptrace` and
/// `process_vm_*`, `kcmp`, kernel modules, kexec, keyrings, `bpf`, `perf_event_open`,
/// `userfaultfd`, `io_uring_*`, clock and time setting, swap, `reboot`, `acct`,
/// `quotactl`, `syslog`, `*_by_handle_at`, `iopl`/`ioperm`, `modify_ldt`, `uselib`,
/// `vhangup`, `lookup_dcookie`, `pivot_root`, host and domain names, and `socket` outside
/// the families below.
pub const ALLOWED_SYSCALLS: &[&str] = &[
    "accept",
    "accept4",
    "access",
    "adjtimex",
    "alarm",
    "arch_prctl",
    "bind",
    "brk",
    "capget",
    "capset",
    "chdir",
    "chmod",
    "chown",
    "chroot",
    "clock_getres",
    "clock_gettime",
    "clock_nanosleep",
    "close",
    "close_range",
    "connect",
    "copy_file_range",
    "creat",
    "dup",
    "dup2",
    "dup3",
    "epoll_create",
    "epoll_create1",
    "epoll_ctl",
    "epoll_pwait",
    "epoll_pwait2",
    "epoll_wait",
    "eventfd",
    "eventfd2",
    "execve",
    "execveat",
    "exit",
    "exit_group",
    "faccessat",
    "faccessat2",
    "fadvise64",
    "fallocate",
    "fchdir",
    "fchmod",
    "fchmodat",
    "fchown",
    "fchownat",
    "fcntl",
    "fdatasync",
    "fgetxattr",
    "flistxattr",
    "flock",
    "fork",
    "fremovexattr",
    "fsetxattr",
    "fstat",
    "fstatfs",
    "fsync",
    "ftruncate",
    "futex",
    "futex_waitv",
    "futimesat",
    "get_robust_list",
    "getcpu",
    "getcwd",
    "getdents",
    "getdents64",
    "getegid",
    "geteuid",
    "getgid",
    "getgroups",
    "getitimer",
    "getpeername",
    "getpgid",
    "getpgrp",
    "getpid",
    "getppid",
    "getpriority",
    "getrandom",
    "getresgid",
    "getresuid",
    "getrlimit",
    "getrusage",
    "getsid",
    "getsockname",
    "getsockopt",
    "gettid",
    "gettimeofday",
    "getuid",
    "getxattr",
    "inotify_add_watch",
    "inotify_init",
    "inotify_init1",
    "inotify_rm_watch",
    "io_cancel",
    "io_destroy",
    "io_getevents",
    "io_pgetevents",
    "io_setup",
    "io_submit",
    "ioctl",
    "ioprio_get",
    "ioprio_set",
    "kill",
    "landlock_add_rule",
    "landlock_create_ruleset",
    "landlock_restrict_self",
    "lchown",
    "lgetxattr",
    "link",
    "linkat",
    "listen",
    "listxattr",
    "llistxattr",
    "lremovexattr",
    "lseek",
    "lsetxattr",
    "lstat",
    "madvise",
    "membarrier",
    "memfd_create",
    "mincore",
    "mkdir",
    "mkdirat",
    "mknod",
    "mknodat",
    "mlock",
    "mlock2",
    "mlockall",
    "mmap",
    "mprotect",
    "mq_getsetattr",
    "mq_notify",
    "mq_open",
    "mq_timedreceive",
    "mq_timedsend",
    "mq_unlink",
    "mremap",
    "msgctl",
    "msgget",
    "msgrcv",
    "msgsnd",
    "msync",
    "munlock",
    "munlockall",
    "munmap",
    "nanosleep",
    "newfstatat",
    "open",
    "openat",
    "openat2",
    "pause",
    "pidfd_getfd",
    "pidfd_open",
    "pidfd_send_signal",
    "pipe",
    "pipe2",
    "pkey_alloc",
    "pkey_free",
    "pkey_mprotect",
    "poll",
    "ppoll",
    "prctl",
    "pread64",
    "preadv",
    "preadv2",
    "prlimit64",
    "process_mrelease",
    "pselect6",
    "pwrite64",
    "pwritev",
    "pwritev2",
    "read",
    "readahead",
    "readlink",
    "readlinkat",
    "readv",
    "recvfrom",
    "recvmmsg",
    "recvmsg",
    "remap_file_pages",
    "removexattr",
    "rename",
    "renameat",
    "renameat2",
    "restart_syscall",
    "rmdir",
    "rseq",
    "rt_sigaction",
    "rt_sigpending",
    "rt_sigprocmask",
    "rt_sigqueueinfo",
    "rt_sigreturn",
    "rt_sigsuspend",
    "rt_sigtimedwait",
    "rt_tgsigqueueinfo",
    "sched_get_priority_max",
    "sched_get_priority_min",
    "sched_getaffinity",
    "sched_getattr",
    "sched_getparam",
    "sched_getscheduler",
    "sched_rr_get_interval",
    "sched_setaffinity",
    "sched_setattr",
    "sched_setparam",
    "sched_setscheduler",
    "sched_yield",
    "seccomp",
    "select",
    "semctl",
    "semget",
    "semop",
    "semtimedop",
    "sendfile",
    "sendmmsg",
    "sendmsg",
    "sendto",
    "set_robust_list",
    "set_tid_address",
    "setfsgid",
    "setfsuid",
    "setgid",
    "setgroups",
    "setitimer",
    "setpgid",
    "setpriority",
    "setregid",
    "setresgid",
    "setresuid",
    "setreuid",
    "setrlimit",
    "setsid",
    "setsockopt",
    "setuid",
    "setxattr",
    "shmat",
    "shmctl",
    "shmdt",
    "shmget",
    "shutdown",
    "sigaltstack",
    "signalfd",
    "signalfd4",
    "socketpair",
    "splice",
    "stat",
    "statfs",
    "statx",
    "symlink",
    "symlinkat",
    "sync",
    "sync_file_range",
    "syncfs",
    "sysinfo",
    "tee",
    "tgkill",
    "time",
    "timer_create",
    "timer_delete",
    "timer_getoverrun",
    "timer_gettime",
    "timer_settime",
    "timerfd_create",
    "timerfd_gettime",
    "timerfd_settime",
    "times",
    "tkill",
    "truncate",
    "umask",
    "uname",
    "unlink",
    "unlinkat",
    "utime",
    "utimensat",
    "utimes",
    "vfork",
    "vmsplice",
    "wait4",
    "waitid",
    "write",
    "writev",
];

/// Socket families a sandbox may open: unix, IPv4, IPv6, netlink (reading routes and
/// addresses; changing them needs NET_ADMIN, which it lacks). Packet sockets need NET_RAW,
/// which it lacks too; AF_ALG, AF_VSOCK and the rest are refused.
const SOCKET_FAMILIES: &[u64] = &[1, 2, 10, 16];

/// `personality` values programs use (Linux, and with ADDR_NO_RANDOMIZE, and the query);
/// others change how the kernel treats the process.
const PERSONALITIES: &[u64] = &[0x0, 0x8, 0x20000, 0x20008, 0xffff_ffff];

const CLONE_NEWUSER: u64 = 0x1000_0000;

const MASKED_PATHS: &[&str] = &[
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];

const READONLY_PATHS: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

/// The sandboxes' seccomp policy, as the OCI section (see `seccomp.rs` for its compiled
/// form).
pub(crate) fn seccomp_policy() -> Value {
    #[cfg(target_arch = "x86_64")]
    let arches = json!(["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]);
    #[cfg(not(target_arch = "x86_64"))]
    let arches = json!(["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"]);
    let mut rules = vec![
        json!({ "names": ALLOWED_SYSCALLS, "action": "SCMP_ACT_ALLOW" }),
        // New user namespaces would hand the sandbox a full capability set in them.
        json!({ "names": ["clone"], "action": "SCMP_ACT_ALLOW",
          "args": [{ "index": 0, "value": CLONE_NEWUSER, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ" }] }),
        // clone3 passes its flags in memory, which seccomp cannot read: make libc fall
        // back to clone.
        json!({ "names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38 }),
    ];
    for f in SOCKET_FAMILIES {
        rules.push(json!({ "names": ["socket"], "action": "SCMP_ACT_ALLOW",
            "args": [{ "index": 0, "value": f, "op": "SCMP_CMP_EQ" }] }));
    }
    for p in PERSONALITIES {
        rules.push(
            json!({ "names": ["personality"], "action": "SCMP_ACT_ALLOW",
            "args": [{ "index": 0, "value": p, "op": "SCMP_CMP_EQ" }] }),
        );
    }
    json!({
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": 1,
        "architectures": arches,
        "syscalls": rules
    })
}

pub struct BundleInput<'a> {
    pub rootfs: &'a Path,
    pub aether: &'a Path,
    pub hosts: &'a Path,
    pub cgroup_path: &'a str,
    /// Whether the memory controller accounts swap (set memory+swap to the same limit).
    pub limit_swap: bool,
    /// RLIMIT_NOFILE for sandbox processes (never above the edge's own hard limit).
    pub nofile: u64,
    /// The network namespace to join (made by the edge); `None`: a new, empty one.
    pub netns: Option<&'a Path>,
    /// A resolv.conf naming the node's DNS proxy, bound over /etc/resolv.conf.
    pub resolv_conf: Option<&'a Path>,
    /// The seccomp policy compiled (base64 BPF), for crun's `run.oci.seccomp_bpf_data`.
    pub seccomp_bpf: Option<&'a str>,
    /// An empty directory no sandbox can write, bound over the masked directories;
    /// `None`: the runtime masks them with a tmpfs each.
    pub empty_dir: Option<&'a Path>,
    /// A sysfs to bind at /sys (read-only), shared by every sandbox; `None`: a sysfs
    /// mounted in the sandbox's own network namespace.
    pub sysfs: Option<&'a Path>,
    /// Where the runtime finds the sandbox's volumes: `<volumes>/<i>` is the mount of
    /// `rec.volumes[i]` (see `ContainerBackend::start_container`).
    pub volumes: &'a Path,
}

pub fn config(rec: &SandboxRecord, inp: &BundleInput<'_>) -> Value {
    let mut env: Vec<String> = Vec::new();
    let mut vars = rec.env.clone();
    vars.entry("PATH".into())
        .or_insert_with(|| "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    vars.entry("HOME".into()).or_insert_with(|| "/root".into());
    vars.insert("DSEC_SANDBOX_ID".into(), rec.id.clone());
    for (k, v) in &vars {
        env.push(format!("{k}={v}"));
    }
    let mem = rec.limits.memory_mb as i64 * 1024 * 1024;
    // The kernel's default period, which a new cgroup already has: left out of the spec,
    // since each write of a period or a quota walks every CPU cgroup of the node.
    let period: u64 = 100_000;
    let quota = (rec.limits.cpu_cores * period as f64).round().max(1000.0) as i64;
    let mut memory = json!({ "limit": mem });
    if inp.limit_swap {
        memory["swap"] = json!(mem);
    }
    let shm_kb = (rec.limits.memory_mb / 4).clamp(4, 65536) * 1024;
    let network = match inp.netns {
        Some(p) => json!({ "type": "network", "path": p }),
        None => json!({ "type": "network" }),
    };
    // A runtime masks a directory with a tmpfs of its own, one more superblock per
    // sandbox; the kernel's cost of a new memory cgroup and of a new superblock grows with
    // the number of superblocks on the node (the memcg shrinker maps), so the directories
    // the node has are bound, read-only, to one shared empty directory instead.
    let (masked, mask_binds): (Vec<&str>, Vec<Value>) = match inp.empty_dir {
        Some(empty) => {
            let dirs = masked_dirs();
            (
                MASKED_PATHS
                    .iter()
                    .copied()
                    .filter(|p| !dirs.contains(p))
                    .collect(),
                dirs.iter()
                    .map(|d| {
                        json!({ "destination": d, "type": "bind", "source": empty,
                        "options": ["bind", "ro", "nosuid", "nodev", "noexec"] })
                    })
                    .collect(),
            )
        }
        None => (MASKED_PATHS.to_vec(), Vec::new()),
    };
    let sys = match inp.sysfs {
        Some(view) => json!({ "destination": "/sys", "type": "bind", "source": view,
            "options": ["bind", "ro", "nosuid", "noexec", "nodev"] }),
        None => json!({ "destination": "/sys", "type": "sysfs", "source": "sysfs",
            "options": ["nosuid", "noexec", "nodev", "ro"] }),
    };
    let mut config = json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": { "uid": 0, "gid": 0 },
            "args": ["/.dsec/aether"],
            "env": env,
            "cwd": rec.workdir.clone().unwrap_or_else(|| "/".into()),
            "capabilities": {
                "bounding": CAPABILITIES,
                "effective": CAPABILITIES,
                "permitted": CAPABILITIES,
            },
            "rlimits": [{ "type": "RLIMIT_NOFILE", "hard": inp.nofile, "soft": inp.nofile }],
            "noNewPrivileges": true
        },
        "root": { "path": inp.rootfs, "readonly": false },
        "hostname": "sandbox",
        "mounts": [
            { "destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"] },
            { "destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"] },
            { "destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"] },
            { "destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", format!("size={shm_kb}k")] },
            { "destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"] },
            sys,
            { "destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup", "options": ["nosuid", "noexec", "nodev", "relatime", "ro"] },
            { "destination": "/.dsec/aether", "type": "bind", "source": inp.aether, "options": ["bind", "ro", "nosuid", "nodev"] },
            { "destination": "/etc/hosts", "type": "bind", "source": inp.hosts, "options": ["bind", "ro", "nosuid", "nodev", "noexec"] }
        ],
        "linux": {
            "namespaces": [
                { "type": "pid" }, network, { "type": "ipc" },
                { "type": "uts" }, { "type": "mount" }, { "type": "cgroup" }
            ],
            "cgroupsPath": inp.cgroup_path,
            "resources": {
                "memory": memory,
                "cpu": { "quota": quota },
                "pids": { "limit": rec.limits.pids },
                "devices": [
                    { "allow": false, "access": "rwm" },
                    { "allow": true, "type": "c", "major": 1, "minor": 3, "access": "rwm" },
                    { "allow": true, "type": "c", "major": 1, "minor": 5, "access": "rwm" },
                    { "allow": true, "type": "c", "major": 1, "minor": 7, "access": "rwm" },
                    { "allow": true, "type": "c", "major": 1, "minor": 8, "access": "rwm" },
                    { "allow": true, "type": "c", "major": 1, "minor": 9, "access": "rwm" },
                    { "allow": true, "type": "c", "major": 5, "minor": 0, "access": "rwm" },
                    { "allow": true, "type": "c", "major": 5, "minor": 2, "access": "rwm" },
                    { "allow": true, "type": "c", "major": 136, "access": "rwm" }
                ]
            },
            "maskedPaths": masked,
            "readonlyPaths": READONLY_PATHS,
            "seccomp": seccomp_policy()
        }
    });
    if let Some(bpf) = inp.seccomp_bpf {
        // crun loads this program instead of compiling the section above, which stays as
        // the policy's statement (and what any other runtime would use).
        config["annotations"] = json!({ "run.oci.seccomp_bpf_data": bpf });
    }
    if let Some(mounts) = config["mounts"].as_array_mut() {
        if let Some(r) = inp.resolv_conf {
            mounts.push(json!({ "destination": "/etc/resolv.conf", "type": "bind", "source": r, "options": ["bind", "ro", "nosuid", "nodev", "noexec"] }));
        }
        mounts.extend(mask_binds);
        // Volumes first: a path the image made a link (`/data -> /.dsec`) may take a volume
        // where the system's own mounts go, and those are then made over it.
        let volumes = rec.volumes.iter().enumerate().map(|(i, v)| {
            let access = if v.read_only { "ro" } else { "rw" };
            json!({ "destination": v.path, "type": "bind",
                "source": inp.volumes.join(i.to_string()),
                "options": ["bind", access, "nosuid", "nodev"] })
        });
        mounts.splice(0..0, volumes);
    }
    config
}

/// The masked paths that are directories on this node (`/proc` and `/sys` show a sandbox
/// the same ones): found once.
fn masked_dirs() -> &'static [&'static str] {
    static DIRS: std::sync::OnceLock<Vec<&'static str>> = std::sync::OnceLock::new();
    DIRS.get_or_init(|| {
        MASKED_PATHS
            .iter()
            .copied()
            .filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir()))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sandbox's record with `cpu_cores`, as the tests' bundles are built from.
    fn record(cpu_cores: f64) -> SandboxRecord {
        serde_json::from_value(json!({
            "id": "local-abc", "edge": "local", "backend": "container", "image": "root/base:latest",
            "image_digest": "", "layers": [], "env": {}, "workdir": null,
            "limits": {"cpu_cores": cpu_cores, "memory_mb": 64, "disk_mb": 64, "pids": 64},
            "labels": {}, "state": "running", "created_at_ms": 0, "expires_at_ms": 0,
            "idle_timeout_seconds": null, "last_activity_ms": 0, "forked_from": null, "oom_kills": 0
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// A bundle's input with placeholder paths and the given program and empty directory.
    fn input<'a>(seccomp_bpf: Option<&'a str>, empty_dir: Option<&'a Path>) -> BundleInput<'a> {
        let p = Path::new("/x");
        BundleInput {
            rootfs: p,
            aether: p,
            hosts: p,
            cgroup_path: "/dsec/local-abc",
            limit_swap: false,
            nofile: 1024,
            netns: None,
            resolv_conf: None,
            empty_dir,
            seccomp_bpf,
            sysfs: None,
            volumes: p,
        }
    }

    #[test]
    fn a_compiled_policy_goes_to_crun_as_an_annotation() {
        let rec = record(1.0);
        let with = config(&rec, &input(Some("AAAA"), None));
        assert_eq!(with["annotations"]["run.oci.seccomp_bpf_data"], "AAAA");
        // The OCI section stays: the policy's statement, and any other runtime's input.
        assert_eq!(with["linux"]["seccomp"], seccomp_policy());
        assert!(
            config(&rec, &input(None, None))
                .get("annotations")
                .is_none()
        );
    }

    /// With a shared empty directory, every masked path still masked: the directories this
    /// node has by a read-only bind of it (no tmpfs each), the rest by the runtime.
    #[test]
    fn masked_directories_are_binds_of_one_empty_directory() {
        let rec = record(0.5);
        let empty = Path::new("/srv/empty");
        let inp = |empty_dir| input(None, empty_dir);
        let plain = config(&rec, &inp(None));
        assert_eq!(plain["linux"]["maskedPaths"], json!(MASKED_PATHS));
        let c = config(&rec, &inp(Some(empty)));
        let masked: Vec<&str> = c["linux"]["maskedPaths"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        let binds: Vec<&Value> = c["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["source"] == "/srv/empty")
            .collect();
        for path in MASKED_PATHS {
            let bound = binds.iter().find(|m| m["destination"] == *path);
            assert!(
                masked.contains(path) != bound.is_some(),
                "{path}: masked once, either way"
            );
            if let Some(m) = bound {
                assert!(std::fs::metadata(path).unwrap().is_dir(), "{path}");
                assert!(m["options"].as_array().unwrap().contains(&json!("ro")));
            }
        }
        if Path::new("/sys/firmware").is_dir() {
            assert!(!masked.contains(&"/sys/firmware"));
        }
        // The quota alone: a new cgroup has the kernel's default period already.
        assert_eq!(c["linux"]["resources"]["cpu"], json!({ "quota": 50000 }));
    }

    #[test]
    fn seccomp_allows_a_userland_and_refuses_the_rest_by_default() {
        let s = seccomp_policy();
        assert_eq!(s["defaultAction"], "SCMP_ACT_ERRNO");
        assert_eq!(s["defaultErrnoRet"], 1);
        let allowed: Vec<&str> = s["syscalls"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["action"] == "SCMP_ACT_ALLOW" && r.get("args").is_none())
            .flat_map(|r| r["names"].as_array().unwrap().iter())
            .filter_map(|n| n.as_str())
            .collect();
        for needed in [
            "read", "execve", "openat", "mmap", "futex", "wait4", "prctl", "setsid",
        ] {
            assert!(allowed.contains(&needed), "{needed} is not allowed");
        }
        for refused in [
            "mount",
            "unshare",
            "setns",
            "ptrace",
            "bpf",
            "io_uring_setup",
            "kexec_load",
            "init_module",
            "keyctl",
            "add_key",
            "request_key",
            "perf_event_open",
            "userfaultfd",
            "modify_ldt",
            "open_by_handle_at",
            "pivot_root",
            "clock_settime",
            "sethostname",
            "socket",
            "clone",
            "personality",
        ] {
            assert!(!allowed.contains(&refused), "{refused} is allowed outright");
        }
        // clone only without CLONE_NEWUSER; socket only for unix, inet, inet6, netlink.
        let rules = s["syscalls"].as_array().unwrap();
        let clone = rules
            .iter()
            .find(|r| r["names"] == json!(["clone"]))
            .unwrap();
        assert_eq!(clone["args"][0]["value"], CLONE_NEWUSER);
        assert_eq!(clone["args"][0]["valueTwo"], 0);
        let families: Vec<u64> = rules
            .iter()
            .filter(|r| r["names"] == json!(["socket"]))
            .map(|r| r["args"][0]["value"].as_u64().unwrap())
            .collect();
        assert_eq!(families, [1, 2, 10, 16]);
    }
}
