//! The OCI bundle config the edge writes for a container sandbox. Security defaults
//! (documented in docs/SECURITY.md): mount, pid, net, uts, ipc and cgroup namespaces;
//! capabilities cut to the list below; `noNewPrivileges`; a seccomp deny list; masked and
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

/// Syscalls refused with EPERM: kernel modules, kexec, mounts, namespaces, tracing other
/// processes, keyrings, BPF, perf, clock setting, swap, reboot, io_uring.
pub const DENIED_SYSCALLS: &[&str] = &[
    "acct",
    "add_key",
    "bpf",
    "clock_adjtime",
    "clock_settime",
    "delete_module",
    "finit_module",
    "fsconfig",
    "fsmount",
    "fsopen",
    "fspick",
    "init_module",
    "io_uring_enter",
    "io_uring_register",
    "io_uring_setup",
    "ioperm",
    "iopl",
    "kcmp",
    "kexec_file_load",
    "kexec_load",
    "keyctl",
    "lookup_dcookie",
    "mount",
    "mount_setattr",
    "move_mount",
    "name_to_handle_at",
    "open_by_handle_at",
    "open_tree",
    "perf_event_open",
    "pivot_root",
    "process_vm_readv",
    "process_vm_writev",
    "ptrace",
    "quotactl",
    "reboot",
    "request_key",
    "setns",
    "settimeofday",
    "swapoff",
    "swapon",
    "syslog",
    "umount2",
    "unshare",
    "uselib",
    "userfaultfd",
    "vhangup",
];

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

fn seccomp() -> Value {
    #[cfg(target_arch = "x86_64")]
    let arches = json!(["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]);
    #[cfg(not(target_arch = "x86_64"))]
    let arches = json!(["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"]);
    json!({
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": arches,
        "syscalls": [
            { "names": DENIED_SYSCALLS, "action": "SCMP_ACT_ERRNO", "errnoRet": 1 },
            // New user namespaces would hand the sandbox a full capability set in them.
            { "names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1,
              "args": [{ "index": 0, "value": CLONE_NEWUSER, "valueTwo": CLONE_NEWUSER, "op": "SCMP_CMP_MASKED_EQ" }] },
            // clone3 passes its flags in memory, which seccomp cannot read: make libc fall
            // back to clone.
            { "names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38 }
        ]
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
            { "destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"] },
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
                "cpu": { "quota": quota, "period": period },
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
            "maskedPaths": MASKED_PATHS,
            "readonlyPaths": READONLY_PATHS,
            "seccomp": seccomp()
        }
    });
    if let (Some(r), Some(mounts)) = (inp.resolv_conf, config["mounts"].as_array_mut()) {
        mounts.push(json!({ "destination": "/etc/resolv.conf", "type": "bind", "source": r, "options": ["bind", "ro", "nosuid", "nodev", "noexec"] }));
    }
    config
}
