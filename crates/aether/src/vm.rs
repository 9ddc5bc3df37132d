//! aether for VMs. In the guest (`dsec-aether` started as init with no channel socket on
//! fd 3) it finds the virtio-serial port named [`PORT_NAME`], keeps it open for the guest's
//! whole life, and serves every stream the host multiplexes over it (see
//! `dsec_common::vmux`) like a connection on fd 3. On the host, `dsec-aether vmux LISTEN
//! CHARDEV` runs next to QEMU: it accepts the edge's connections on the sandbox's usual
//! `aether.sock` and carries each one over QEMU's chardev socket, so the edge talks to a
//! VM exactly as to a container, and the VM outlives a restart of the edge.

use std::fs::File;
use std::io;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
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

/// Guest init: serves the channel over the virtio-serial port until the VM ends.
pub fn guest_main(serve: impl Fn(UnixStream) + Send + Sync + Clone + 'static) -> ! {
    prepare_guest();
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

/// `dsec-aether vmux LISTEN CHARDEV`: the host end (see the module comment). Ends when the
/// VM's chardev closes (QEMU is gone).
pub fn vmux_main(listen: &str, chardev: &str) -> io::Result<()> {
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
    let mux = Mux::host(Box::new(link.try_clone()?))?;
    let m2 = mux.clone();
    std::thread::spawn(move || {
        let _ = m2.run(link);
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
