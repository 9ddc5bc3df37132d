//! aether for VMs. In the guest (`dsec-aether` started as init with no channel socket on
//! fd 3) it finds the virtio-serial port named [`PORT_NAME`], keeps it open for the guest's
//! whole life, and serves every stream the host multiplexes over it (see
//! `dsec_common::vmux`) like a connection on fd 3. On the host, `dsec-aether vmux LISTEN
//! CHARDEV` runs next to QEMU: it accepts the edge's connections on the sandbox's usual
//! `aether.sock` and carries each one over QEMU's chardev socket, so the edge talks to a
//! VM exactly as to a container, and the VM outlives a restart of the edge. A Firecracker
//! guest uses vsock instead (see `vsock.rs`).

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dsec_common::vmux::Mux;

/// The name of the virtio-serial port (`virtserialport,name=…`) that carries the channel.
pub const PORT_NAME: &str = "dsec.channel";

/// The guest's channel port: `/dev/vportNpM` whose sysfs name is [`PORT_NAME`].
fn find_port() -> Option<PathBuf> {
    let dir = std::fs::read_dir("/sys/class/virtio-ports").ok()?;
    for e in dir.flatten() {
        let name = std::fs::read_to_string(e.path().join("name")).unwrap_or_default();
        if name.trim() == PORT_NAME {
            return Some(Path::new("/dev").join(e.file_name()));
        }
    }
    None
}

/// Mounts what a container runtime would have set up for aether (terminals, shared memory).
fn prepare_guest() {
    let mount = |src: &str, dst: &str, fstype: &str, data: &str| {
        let _ = std::fs::create_dir_all(dst);
        let c = |s: &str| std::ffi::CString::new(s).unwrap_or_default();
        let (src, dst, fstype, data) = (c(src), c(dst), c(fstype), c(data));
        // SAFETY: mount(2) with valid C strings.
        unsafe {
            libc::mount(
                src.as_ptr(),
                dst.as_ptr(),
                fstype.as_ptr(),
                libc::MS_NOSUID | libc::MS_NOEXEC,
                data.as_ptr().cast(),
            )
        };
    };
    mount(
        "devpts",
        "/dev/pts",
        "devpts",
        "newinstance,ptmxmode=0666,mode=0620",
    );
    let _ = std::fs::remove_file("/dev/ptmx");
    let _ = std::os::unix::fs::symlink("pts/ptmx", "/dev/ptmx");
    mount("shm", "/dev/shm", "tmpfs", "mode=1777");
    let _ = std::fs::write("/proc/sys/kernel/hostname", "sandbox");
}

/// The kernel command line's `dsec.pids=N`: the most processes (and threads) the guest's
/// user space may have, as a container's `pids.max`.
fn pids_from_cmdline(cmdline: &str) -> Option<u64> {
    cmdline
        .split_whitespace()
        .find_map(|t| t.strip_prefix("dsec.pids="))
        .and_then(|n| n.parse().ok())
        .filter(|&n| n > 0)
}

/// Puts aether, and so everything it starts, in a cgroup of the guest's own whose
/// `pids.max` is the sandbox's limit: in a VM the node's cgroup holds only QEMU's
/// threads, so the guest's processes are counted here, as a container's are by its
/// cgroup. Aether's own threads count too, as in a container.
fn limit_pids(max: u64) -> Result<(), String> {
    let root = Path::new("/sys/fs/cgroup");
    if !root.join("cgroup.controllers").exists() {
        let c = |s: &str| std::ffi::CString::new(s).unwrap_or_default();
        let (src, dst, fstype) = (c("cgroup2"), c("/sys/fs/cgroup"), c("cgroup2"));
        // SAFETY: mount(2) with NUL-terminated strings that outlive the call.
        let rc = unsafe {
            libc::mount(
                src.as_ptr(),
                dst.as_ptr(),
                fstype.as_ptr(),
                libc::MS_NOSUID | libc::MS_NOEXEC | libc::MS_NODEV,
                std::ptr::null(),
            )
        };
        if rc != 0 {
            return Err(format!(
                "mounting cgroup2: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    let leaf = root.join("sandbox");
    let step = |what: &str, r: std::io::Result<()>| r.map_err(|e| format!("{what}: {e}"));
    step(
        "enabling the pids controller",
        std::fs::write(root.join("cgroup.subtree_control"), "+pids"),
    )?;
    match std::fs::create_dir(&leaf) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            return Err(format!("creating {}: {e}", leaf.display()));
        }
        _ => {}
    }
    step(
        "setting pids.max",
        std::fs::write(leaf.join("pids.max"), max.to_string()),
    )?;
    step(
        "moving aether into its cgroup",
        std::fs::write(leaf.join("cgroup.procs"), "0"),
    )
}

/// Mounts a VM's volumes: each virtio-fs device at its path (made if missing), `nosuid`
/// and `nodev`, read-only where asked (the node serves those read-only too). One already
/// mounted there is left as it is, so a repeated request changes nothing.
pub fn mount_shares(mounts: &[dsec_common::channel::GuestMount]) -> Result<(), String> {
    if mounts.is_empty() {
        return Ok(());
    }
    // One at a time: the edge sends the request again when an answer is slow (a first
    // virtio-fs mount under emulation can take seconds), and a second mount of a device
    // still being mounted fails with EBUSY instead of finding the first.
    static MOUNTING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = MOUNTING.lock().unwrap_or_else(|p| p.into_inner());
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    for m in mounts {
        if !m.path.starts_with('/') {
            return Err(format!("volume mount path {} is not absolute", m.path));
        }
        let escaped = dsec_common::mountinfo::escaped(Path::new(&m.path));
        // mountinfo: ... mount-point(5th) ... - fstype source ...
        let mounted = table.lines().any(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let fstype = f.iter().position(|x| *x == "-").and_then(|i| f.get(i + 1));
            f.get(4) == Some(&escaped.as_str()) && fstype == Some(&"virtiofs")
        });
        if mounted {
            continue;
        }
        std::fs::create_dir_all(&m.path)
            .map_err(|e| format!("making volume mount point {}: {e}", m.path))?;
        let c = |s: &str| std::ffi::CString::new(s).map_err(|_| format!("{s:?} has a NUL byte"));
        let (tag, path, fstype) = (c(&m.tag)?, c(&m.path)?, c("virtiofs")?);
        let mut flags = libc::MS_NOSUID | libc::MS_NODEV;
        if m.read_only {
            flags |= libc::MS_RDONLY;
        }
        // SAFETY: mount(2) with NUL-terminated strings that outlive the call.
        let rc = unsafe {
            libc::mount(
                tag.as_ptr(),
                path.as_ptr(),
                fstype.as_ptr(),
                flags,
                std::ptr::null(),
            )
        };
        if rc != 0 {
            return Err(format!(
                "mounting volume {} at {}: {} (is the virtiofs module loaded?)",
                m.tag,
                m.path,
                io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

/// After a restore from a snapshot: the clock stood still while the VM was saved, and
/// every copy of one snapshot has the same RNG state. Steps the clock and reseeds.
pub fn restored(unix_ms: u64, entropy_hex: &str) -> Result<(), String> {
    let ts = libc::timespec {
        tv_sec: (unix_ms / 1000) as libc::time_t,
        tv_nsec: ((unix_ms % 1000) * 1_000_000) as libc::c_long,
    };
    // SAFETY: clock_settime with a valid timespec.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } != 0 {
        return Err(format!("setting the clock: {}", io::Error::last_os_error()));
    }
    let bytes = decode_hex(entropy_hex)?;
    if bytes.is_empty() || bytes.len() > 512 || bytes.len() % 4 != 0 {
        return Err("entropy must be 4..512 bytes, a multiple of 4".into());
    }
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + bytes.len());
    info.extend_from_slice(&((bytes.len() * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(bytes.len() as i32).to_ne_bytes());
    info.extend_from_slice(&bytes);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/urandom")
        .map_err(|e| format!("opening /dev/urandom: {e}"))?;
    use std::os::fd::AsRawFd;
    const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
    const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
    // SAFETY: the ioctls take a rand_pool_info laid out above and no argument.
    unsafe {
        if libc::ioctl(f.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) != 0 {
            return Err(format!("adding entropy: {}", io::Error::last_os_error()));
        }
        if libc::ioctl(f.as_raw_fd(), RNDRESEEDCRNG as _) != 0 {
            return Err(format!("reseeding: {}", io::Error::last_os_error()));
        }
    }
    Ok(())
}

fn decode_hex(s: &str) -> Result<Vec<u8>, String> {
    if !s.len().is_multiple_of(2) || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err("entropy must be hex".into());
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|e| e.to_string()))
        .collect()
}

/// Guest init: serves the channel until the VM ends, over vsock when the kernel command
/// line says `dsec.channel=vsock` (Firecracker), else over the virtio-serial port (QEMU).
pub fn guest_main(serve: impl Fn(UnixStream) + Send + Sync + Clone + 'static) -> ! {
    prepare_guest();
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    if let Some(max) = pids_from_cmdline(&cmdline)
        && let Err(e) = limit_pids(max)
    {
        // The guest runs on; its processes are then bounded by its memory alone.
        eprintln!("dsec-aether: limiting processes to {max}: {e}");
    }
    // The VM keeps running without a network if this fails; its commands see why.
    match crate::guestnet::from_cmdline(&cmdline) {
        Some(Ok(spec)) => {
            if let Err(e) = crate::guestnet::configure(&spec) {
                eprintln!("dsec-aether: configuring the network: {e}");
            }
        }
        Some(Err(e)) => eprintln!("dsec-aether: {e}"),
        None => {}
    }
    if dsec_common::vsock::channel_from_cmdline(&cmdline) == dsec_common::vsock::GuestChannel::Vsock
    {
        crate::vsock::guest_main(serve);
    }
    let t0 = Instant::now();
    let path = loop {
        if let Some(p) = find_port() {
            break p;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            eprintln!(
                "dsec-aether: no virtio-serial port named {PORT_NAME}; is virtio_console loaded?"
            );
            std::process::exit(2);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // One open for the guest's whole life (a port opens once; reopening loses data).
    let port = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) => {
            eprintln!("dsec-aether: opening {}: {e}", path.display());
            std::process::exit(2);
        }
    };
    eprintln!("dsec-aether: serving the channel on {}", path.display());
    loop {
        let writer = match port.try_clone() {
            Ok(w) => w,
            Err(e) => {
                eprintln!("dsec-aether: {e}");
                std::process::exit(2);
            }
        };
        let s = serve.clone();
        let mux = Mux::guest(Box::new(writer), move |stream| {
            let s = s.clone();
            // As on fd 3: a connection that gets no thread is dropped, never the agent.
            let _ = std::thread::Builder::new().spawn(move || s(stream));
        });
        // The link reads EOF while no host is connected: wait and read again.
        let reader: &File = &port;
        let _ = mux.run(reader);
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// When bytes were last written to and read from the link (ms since `start`).
struct LinkClock {
    start: Instant,
    wrote: AtomicU64,
    read: AtomicU64,
}

impl LinkClock {
    fn now(&self) -> u64 {
        self.start.elapsed().as_millis() as u64 + 1
    }
}

struct TimedWriter(UnixStream, Arc<LinkClock>);

impl Write for TimedWriter {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        let n = self.0.write(b)?;
        self.1.wrote.store(self.1.now(), Ordering::Relaxed);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

struct TimedReader(UnixStream, Arc<LinkClock>);

impl Read for TimedReader {
    fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
        let n = self.0.read(b)?;
        self.1.read.store(self.1.now(), Ordering::Relaxed);
        Ok(n)
    }
}

/// QEMU reads a chardev only while the guest can take data, and re-checks that only when
/// its main loop wakes; a guest that opens the port (or is restored) while that loop
/// sleeps leaves the host's bytes unread. When the link has been sent bytes and nothing
/// has come back for a while, a connection to the VM's spare `wake` chardev wakes the loop.
fn wake_when_stalled(wake: String, clock: Arc<LinkClock>) {
    let mut poked_at = 0u64;
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let (wrote, read, now) = (
            clock.wrote.load(Ordering::Relaxed),
            clock.read.load(Ordering::Relaxed),
            clock.now(),
        );
        if wrote > read && now.saturating_sub(wrote) >= 100 && now.saturating_sub(poked_at) >= 250 {
            poked_at = now;
            drop(UnixStream::connect(&wake));
        }
    }
}

/// `dsec-aether vmux LISTEN CHARDEV [WAKE]`: the host end (see the module comment). Ends
/// when the VM's chardev closes (QEMU is gone).
pub fn vmux_main(listen: &str, chardev: &str, wake: Option<&str>) -> io::Result<()> {
    let t0 = Instant::now();
    let link = loop {
        match UnixStream::connect(chardev) {
            Ok(s) => break s,
            Err(e) if t0.elapsed() < Duration::from_secs(30) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(io::Error::new(e.kind(), format!("{chardev}: {e}"))),
        }
    };
    let _ = std::fs::remove_file(listen);
    let listener = UnixListener::bind(listen)?;
    let clock = Arc::new(LinkClock {
        start: Instant::now(),
        wrote: AtomicU64::new(0),
        read: AtomicU64::new(0),
    });
    let mux = Mux::host(Box::new(TimedWriter(link.try_clone()?, clock.clone())))?;
    if let Some(w) = wake {
        let (w, c) = (w.to_string(), clock.clone());
        std::thread::spawn(move || wake_when_stalled(w, c));
    }
    let m2 = mux.clone();
    let reader = TimedReader(link, clock);
    std::thread::spawn(move || {
        let _ = m2.run(reader);
        // QEMU closed the chardev: the VM is gone, and so is this process.
        std::process::exit(0);
    });
    for conn in listener.incoming() {
        match conn {
            Ok(c) => {
                if let Err(e) = mux.open(c) {
                    eprintln!("dsec-aether vmux: {e}");
                }
            }
            Err(e) => {
                eprintln!("dsec-aether vmux: accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pids_limit_comes_from_the_command_line() {
        assert_eq!(
            pids_from_cmdline("console=ttyS0 dsec.pids=64 dsec.rw_mb=1"),
            Some(64)
        );
        assert_eq!(pids_from_cmdline("console=ttyS0 dsec.rw_mb=1"), None);
        assert_eq!(pids_from_cmdline("dsec.pids=0"), None);
        assert_eq!(pids_from_cmdline("dsec.pids=x"), None);
    }
}
