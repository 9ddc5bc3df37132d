//! Cgroup mode detection and per-sandbox cgroup reads. The OCI runtime creates and limits
//! a container's cgroups; the edge reads counters from them and removes what a runtime
//! leaves. A VM's cgroups the edge makes itself (`own.rs`).
//! v1 (all controllers on v1), v2 (unified only) and hybrid (v1 controllers plus a
//! cgroup2 mount at `unified/`) are siblings behind one interface.

pub mod own;
mod v1;
mod v2;

pub use own::{LeafLimits, create_leaf};

use std::path::Path;

use dsec_common::{IoContext, IoFailure};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupMode {
    V1,
    V2,
    Hybrid,
}

impl CgroupMode {
    pub fn as_str(self) -> &'static str {
        match self {
            CgroupMode::V1 => "v1",
            CgroupMode::V2 => "v2",
            CgroupMode::Hybrid => "hybrid",
        }
    }
}

/// Reads the mount table and the cgroup root to tell the modes apart.
pub fn detect() -> CgroupMode {
    detect_from(
        &std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default(),
        Path::new("/sys/fs/cgroup"),
    )
}

fn detect_from(mountinfo: &str, root: &Path) -> CgroupMode {
    let mut v2_at_root = false;
    let mut v2_unified = false;
    let mut any_v1 = false;
    for line in mountinfo.lines() {
        let Some((pre, post)) = line.split_once(" - ") else {
            continue;
        };
        let Some(mount_point) = pre.split_whitespace().nth(4) else {
            continue;
        };
        let fstype = post.split_whitespace().next().unwrap_or("");
        let root_s = root.to_string_lossy();
        match fstype {
            "cgroup2" if mount_point == root_s => v2_at_root = true,
            "cgroup2" if mount_point.starts_with(&*root_s) => v2_unified = true,
            "cgroup" if mount_point.starts_with(&*root_s) => any_v1 = true,
            _ => {}
        }
    }
    match (v2_at_root, any_v1, v2_unified) {
        (true, _, _) => CgroupMode::V2,
        (false, true, true) => CgroupMode::Hybrid,
        _ => CgroupMode::V1,
    }
}

/// The cgroup path (relative to each hierarchy's root) the runtime is told to use:
/// `/dsec/<bucket>/<id>`, the bucket being the id's last character. A new v1 cpuset
/// cgroup with `clone_children` (see [`prepare_parents`]) is checked against each of its
/// siblings; in one `/dsec` of 3,000 sandboxes that was 0.7 ms of every create, in a
/// bucket of 36 it is a fortieth of it.
///
/// A sandbox made by an earlier version, re-adopted after an upgrade, keeps the
/// `/dsec/<id>` it was made with.
pub fn sandbox_cgroup_path(sandbox_id: &str) -> String {
    let legacy = format!("/dsec/{sandbox_id}");
    let root = Path::new("/sys/fs/cgroup");
    let rel = legacy.trim_start_matches('/');
    if !sandbox_id.is_empty()
        && !sandbox_id.contains('/')
        && (root.join("memory").join(rel).is_dir() || root.join(rel).is_dir())
    {
        return legacy;
    }
    format!("/dsec/{}/{sandbox_id}", bucket(sandbox_id))
}

fn bucket(sandbox_id: &str) -> char {
    match sandbox_id.chars().last() {
        Some(c) if c.is_ascii_alphanumeric() => c.to_ascii_lowercase(),
        _ => '_',
    }
}

/// OOM kills recorded in the sandbox's memory cgroup.
pub fn oom_kills(mode: CgroupMode, rel: &str) -> u64 {
    match mode {
        CgroupMode::V2 => v2::oom_kills(rel),
        _ => v1::oom_kills(rel),
    }
}

/// CPU time used by the sandbox, in nanoseconds.
pub fn cpu_usage_ns(mode: CgroupMode, rel: &str) -> u64 {
    match mode {
        CgroupMode::V2 => v2::cpu_usage_ns(rel),
        _ => v1::cpu_usage_ns(rel),
    }
}

/// (used, page cache) bytes of the sandbox's memory cgroup.
pub fn memory(mode: CgroupMode, rel: &str) -> (u64, u64) {
    match mode {
        CgroupMode::V2 => v2::memory(rel),
        _ => v1::memory(rel),
    }
}

/// Directories of this sandbox's cgroups that still exist (nothing should, after stop).
pub fn leftovers(mode: CgroupMode, rel: &str) -> Vec<std::path::PathBuf> {
    let mut out = match mode {
        CgroupMode::V2 => v2::dirs(rel),
        _ => v1::dirs(rel),
    };
    if mode == CgroupMode::Hybrid {
        out.extend(v2::dirs_under(Path::new("/sys/fs/cgroup/unified"), rel));
    }
    out.retain(|p| p.exists());
    out
}

/// Removes what the runtime left behind (empty leaf directories only; rmdir fails on a
/// cgroup that still has processes, which is what we want).
pub fn remove(mode: CgroupMode, rel: &str) {
    for d in leftovers(mode, rel) {
        let _ = std::fs::remove_dir(&d);
    }
}

/// Removes a cgroup the edge made for a VMM: kills whatever is still in it (a VMM that
/// survived its SIGKILL's wait, a helper it left) and removes the directories once the
/// kernel has let the processes go, which for a VMM with gigabytes mapped can take
/// seconds. Gives up after `within`, leaving what could not be removed.
pub fn empty_and_remove(mode: CgroupMode, rel: &str, within: std::time::Duration) {
    let t0 = std::time::Instant::now();
    loop {
        let dirs = leftovers(mode, rel);
        if dirs.is_empty() {
            return;
        }
        for d in &dirs {
            // A frozen task takes its SIGKILL only once thawed (a paused sandbox).
            let _ = std::fs::write(d.join("cgroup.freeze"), "0");
            let _ = std::fs::write(d.join("freezer.state"), "THAWED");
            // cgroup.kill (v2, Linux 5.14) also takes processes forking at the moment.
            if std::fs::write(d.join("cgroup.kill"), "1").is_err() {
                for pid in std::fs::read_to_string(d.join("cgroup.procs"))
                    .unwrap_or_default()
                    .split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok())
                {
                    // SAFETY: SIGKILL to a process in the sandbox's own cgroup.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
            let _ = std::fs::remove_dir(d);
        }
        if t0.elapsed() >= within {
            let left = leftovers(mode, rel);
            if !left.is_empty() {
                tracing::warn!(
                    cgroup = rel,
                    "processes outlived the sandbox's cgroup removal: {left:?}"
                );
            }
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Prepares the shared parent cgroups before the first sandbox. On v1 a new cpuset cgroup
/// starts with no CPUs and no memory nodes, and the OCI runtime fills them in by writing
/// the parent's values into each new one; the kernel checks every such write against all
/// of the new cgroup's siblings and rebuilds the scheduler domains, so on a node of
/// thousands of sandboxes each create cost more than the one before. With
/// `cgroup.clone_children` set on `/dsec`, a new child starts with its parent's values
/// and the runtime's write changes nothing, which the kernel returns from at once.
pub fn prepare_parents(mode: CgroupMode) {
    if mode == CgroupMode::V2 {
        return;
    }
    let root = Path::new("/sys/fs/cgroup/cpuset");
    if !root.join("cpuset.cpus").exists() {
        return;
    }
    let dir = root.join("dsec");
    let done = (|| -> std::io::Result<()> {
        std::fs::create_dir_all(&dir)?;
        for f in ["cpuset.cpus", "cpuset.mems"] {
            if std::fs::read_to_string(dir.join(f))?.trim().is_empty() {
                std::fs::write(dir.join(f), std::fs::read_to_string(root.join(f))?)?;
            }
        }
        std::fs::write(dir.join("cgroup.clone_children"), "1")
    })();
    if let Err(e) = done {
        tracing::warn!("preparing {}: {e}", dir.display());
    }
}

/// Where this layout's cgroup2 hierarchy is mounted, if it has one.
fn cgroup2_mount(mode: CgroupMode) -> Option<&'static str> {
    match mode {
        CgroupMode::V2 => Some("/sys/fs/cgroup"),
        CgroupMode::Hybrid => Some("/sys/fs/cgroup/unified"),
        CgroupMode::V1 => None,
    }
}

/// The superblock options of the cgroup2 mount at `target` in `mountinfo` (`rw`/`ro` left
/// out: they are the mount's, not the file system's).
fn cgroup2_options(mountinfo: &str, target: &str) -> Option<Vec<String>> {
    mountinfo.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        let mut r = right.split(' ');
        if left.split(' ').nth(4) != Some(target) || r.next() != Some("cgroup2") {
            return None;
        }
        let opts = r.nth(1).unwrap_or("");
        Some(
            opts.split(',')
                .filter(|o| !o.is_empty() && *o != "rw" && *o != "ro")
                .map(String::from)
                .collect(),
        )
    })
}

// From <linux/mount.h>.
const FSPICK_CLOEXEC: libc::c_uint = 1;
const FSCONFIG_SET_FLAG: libc::c_uint = 0;
const FSCONFIG_SET_STRING: libc::c_uint = 1;
const FSCONFIG_CMD_RECONFIGURE: libc::c_uint = 7;

/// Turns cgroup2's `favordynmods` on or off; Ok(true) if that changed it. The kernel
/// guards cgroup membership with one lock that forks take as readers; in its default mode
/// a writer (a process moved into a cgroup: each create's runtime moves the container's
/// first process) first waits for an RCU grace period, milliseconds, with nothing else to
/// do. With the flag the readers take the slower path and the writer waits for nothing.
/// The flag is the kernel's, for the whole host (any hierarchy sets it); it is set here on
/// the superblock with `fspick`/`fsconfig`, keeping its other options and leaving the
/// mount's own flags as they are.
pub fn favor_dynmods(mode: CgroupMode, on: bool) -> Result<bool, IoFailure> {
    let Some(target) = cgroup2_mount(mode) else {
        return Ok(false);
    };
    let table =
        std::fs::read_to_string("/proc/self/mountinfo").ctx(|| "reading the mount table".into())?;
    let Some(mut opts) = cgroup2_options(&table, target) else {
        return Ok(false);
    };
    let has = opts.iter().any(|o| o == "favordynmods");
    if has == on {
        return Ok(false);
    }
    opts.retain(|o| o != "favordynmods");
    if on {
        opts.push("favordynmods".into());
    }
    let c = |s: &str| {
        std::ffi::CString::new(s).map_err(|_| {
            IoFailure::new(
                format!("option {s:?}"),
                std::io::Error::from(std::io::ErrorKind::InvalidInput),
            )
        })
    };
    let path = c(target)?;
    // SAFETY: fspick(2) with a NUL-terminated path; the descriptor is owned below.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_fspick,
            libc::AT_FDCWD,
            path.as_ptr(),
            FSPICK_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(IoFailure::last_os(format!(
            "opening {target} to reconfigure"
        )));
    }
    // SAFETY: a descriptor fspick just returned, owned by nobody else.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
    let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
    for o in &opts {
        let (key, value) = match o.split_once('=') {
            Some((k, v)) => (c(k)?, Some(c(v)?)),
            None => (c(o)?, None),
        };
        // SAFETY: fsconfig(2) with NUL-terminated strings that outlive the call.
        let rc = unsafe {
            match &value {
                Some(v) => libc::syscall(
                    libc::SYS_fsconfig,
                    raw,
                    FSCONFIG_SET_STRING,
                    key.as_ptr(),
                    v.as_ptr(),
                    0,
                ),
                None => libc::syscall(
                    libc::SYS_fsconfig,
                    raw,
                    FSCONFIG_SET_FLAG,
                    key.as_ptr(),
                    std::ptr::null::<libc::c_char>(),
                    0,
                ),
            }
        };
        if rc < 0 {
            return Err(IoFailure::last_os(format!("setting {o} on {target}")));
        }
    }
    // SAFETY: fsconfig(2) on the descriptor above, with no key or value.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            raw,
            FSCONFIG_CMD_RECONFIGURE,
            std::ptr::null::<libc::c_char>(),
            std::ptr::null::<libc::c_char>(),
            0,
        )
    };
    if rc < 0 {
        return Err(IoFailure::last_os(format!("reconfiguring {target}")));
    }
    Ok(true)
}

/// Removes the shared parent cgroups once no sandbox uses them (at shutdown; during
/// operation a concurrent create may be about to use them): the buckets, then `/dsec`.
pub fn remove_parents(mode: CgroupMode) {
    let buckets = ('0'..='9').chain('a'..='z').chain(['_']);
    for b in buckets {
        remove(mode, &format!("/dsec/{b}"));
    }
    remove(mode, "/dsec");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandboxes_are_spread_over_buckets_by_their_last_character() {
        assert_eq!(
            sandbox_cgroup_path("local-b1s8zjrynj8k"),
            "/dsec/k/local-b1s8zjrynj8k"
        );
        assert_eq!(
            sandbox_cgroup_path("e1-00000000000Z"),
            "/dsec/z/e1-00000000000Z"
        );
        assert_eq!(sandbox_cgroup_path("odd-"), "/dsec/_/odd-");
        let ids = (0..3600)
            .map(|i| format!("local-{:012}", i * 7919))
            .collect::<Vec<_>>();
        let used: std::collections::HashSet<_> = ids.iter().map(|i| bucket(i)).collect();
        assert_eq!(used.len(), 10, "digits only in these ids");
    }

    /// A sandbox of an earlier version (`/dsec/<id>`, no bucket) keeps its path, so an
    /// upgrade re-adopts it instead of taking it for dead.
    #[test]
    fn a_sandbox_made_before_buckets_keeps_its_cgroup() {
        let id = format!("cgtest-{}", std::process::id());
        // Inside a real hierarchy only: on v1 /sys/fs/cgroup itself is a tmpfs.
        let root = match detect() {
            CgroupMode::V2 => Path::new("/sys/fs/cgroup"),
            _ => Path::new("/sys/fs/cgroup/memory"),
        };
        let dir = root.join("dsec").join(&id);
        if !root.join("cgroup.procs").exists() || std::fs::create_dir_all(&dir).is_err() {
            eprintln!(
                "skipped: cannot make {} (needs root and cgroups)",
                dir.display()
            );
            return;
        }
        let got = sandbox_cgroup_path(&id);
        let _ = std::fs::remove_dir(&dir);
        // And /dsec, unless sandboxes use it.
        let _ = std::fs::remove_dir(root.join("dsec"));
        assert_eq!(got, format!("/dsec/{id}"));
        assert_eq!(
            sandbox_cgroup_path(&id),
            format!("/dsec/{}/{id}", bucket(&id))
        );
    }

    const HYBRID: &str = "30 25 0:26 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw
32 30 0:28 / /sys/fs/cgroup/memory rw,nosuid shared:11 - cgroup cgroup rw,memory
";
    const V2: &str =
        "30 25 0:26 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate
";
    const V1: &str = "30 25 0:26 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
32 30 0:28 / /sys/fs/cgroup/memory rw,nosuid shared:11 - cgroup cgroup rw,memory
";

    #[test]
    fn reads_the_cgroup2_superblock_options() {
        let table = format!(
            "{HYBRID}41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate,favordynmods\n"
        );
        // The first line for the target that is cgroup2 (HYBRID's own has no options).
        assert_eq!(
            cgroup2_options(&table, "/sys/fs/cgroup/unified"),
            Some(vec![])
        );
        let v2 = "30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n";
        assert_eq!(
            cgroup2_options(v2, "/sys/fs/cgroup"),
            Some(vec!["nsdelegate".into(), "memory_recursiveprot".into()])
        );
        assert_eq!(cgroup2_options(V1, "/sys/fs/cgroup"), None);
        assert_eq!(cgroup2_options(v2, "/sys/fs/cgroup/unified"), None);
    }

    /// Root only: turns the flag on (the setting `dsec up` makes) and checks it took, on
    /// the host's own cgroup2 mount; leaves it as it found it.
    #[test]
    fn favordynmods_goes_on_and_keeps_the_other_options() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return;
        }
        let mode = detect();
        let Some(target) = cgroup2_mount(mode) else {
            return;
        };
        let read = || {
            cgroup2_options(
                &std::fs::read_to_string("/proc/self/mountinfo").unwrap(),
                target,
            )
            .unwrap()
        };
        let before = read();
        let was_on = before.iter().any(|o| o == "favordynmods");
        favor_dynmods(mode, true).unwrap();
        let on = read();
        assert!(on.iter().any(|o| o == "favordynmods"), "{on:?}");
        let others = |v: &[String]| -> Vec<String> {
            v.iter().filter(|o| *o != "favordynmods").cloned().collect()
        };
        assert_eq!(others(&on), others(&before));
        assert!(
            !favor_dynmods(mode, true).unwrap(),
            "a second call changes nothing"
        );
        if !was_on {
            assert!(favor_dynmods(mode, false).unwrap());
            assert_eq!(read(), before);
        }
    }

    #[test]
    fn detects_each_layout() {
        let root = Path::new("/sys/fs/cgroup");
        assert_eq!(detect_from(HYBRID, root), CgroupMode::Hybrid);
        assert_eq!(detect_from(V2, root), CgroupMode::V2);
        assert_eq!(detect_from(V1, root), CgroupMode::V1);
    }

    #[test]
    fn parses_counters() {
        assert_eq!(
            v1::parse_oom_control("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"),
            3
        );
        assert_eq!(
            v2::parse_key("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n", "oom_kill"),
            2
        );
        assert_eq!(
            v2::parse_key("usage_usec 1500\nuser_usec 1\n", "usage_usec"),
            1500
        );
    }
}
