//! The `vm` backend: a QEMU `microvm` per sandbox, with KVM where the host has hardware
//! virtualisation and TCG (emulation) otherwise. The guest boots the kernel and initramfs
//! the image store builds from Debian packages; its root is the image's layers as a
//! read-only ext4 disk (shared by every VM of the image) under an overlay whose writable
//! layer is a tmpfs in the guest; aether is its init and serves the channel over a
//! virtio-serial port, which `dsec-aether vmux` carries to the sandbox's `aether.sock`.
//! QEMU and vmux run detached from the edge (their pids in the sandbox directory), so a
//! restarted edge re-adopts running VMs.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use dsec_common::ApiError;
use dsec_common::api::BackendStatus;
use dsec_image::ImageStore;
use dsec_image::guest;

use super::{Backend, SandboxPaths};
use crate::registry::SandboxRecord;

/// How a VM's CPU is run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }

    /// KVM when `/dev/kvm` is there and the CPU has hardware virtualisation behind it
    /// (`vmx`/`svm` and the kvm_intel/kvm_amd module); anything else (e.g. a paravirtual
    /// KVM module that cannot run an unmodified guest) gets TCG.
    pub fn detect() -> Accel {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let flags = cpuinfo
            .lines()
            .find(|l| l.starts_with("flags"))
            .unwrap_or_default();
        let hw = flags.split_whitespace().any(|f| f == "vmx" || f == "svm");
        let module = Path::new("/sys/module/kvm_intel").exists()
            || Path::new("/sys/module/kvm_amd").exists();
        if Path::new("/dev/kvm").exists() && hw && module {
            Accel::Kvm
        } else {
            Accel::Tcg
        }
    }
}

pub struct VmBackend {
    qemu: Result<PathBuf, String>,
    aether: Result<PathBuf, String>,
    accel: Accel,
    images: ImageStore,
    /// The edge's sandbox directories (`<dir>/<id>/qemu.pid`, …).
    sandboxes: PathBuf,
    /// The guest kernel and initramfs, found (or built) on the first create.
    boot: std::sync::Mutex<Option<(guest::Kernel, PathBuf)>>,
}

fn find_qemu() -> Result<PathBuf, String> {
    for dir in ["/usr/bin", "/usr/local/bin", "/usr/libexec"] {
        let p = Path::new(dir).join("qemu-system-x86_64");
        if p.exists() {
            return Ok(p);
        }
    }
    Err("qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)".into())
}

/// The host's TSC rate in kHz: the guest is told it, so its boot does not stall trying to
/// calibrate against an emulated PIT on a busy host.
fn tsc_khz() -> u64 {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("cpu MHz"))
        .and_then(|l| l.split(':').nth(1))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|mhz| (mhz * 1000.0) as u64)
        .unwrap_or(2_000_000)
}

fn read_pid(p: &Path) -> Option<i32> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

fn kill(pid_file: &Path) {
    if let Some(pid) = read_pid(pid_file) {
        // SAFETY: SIGKILL to the process whose pid we recorded.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        for _ in 0..100 {
            if !alive(pid) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl VmBackend {
    pub fn new(aether: Result<PathBuf, String>, images: ImageStore, sandboxes: &Path) -> VmBackend {
        VmBackend {
            qemu: find_qemu(),
            aether,
            accel: Accel::detect(),
            images,
            sandboxes: sandboxes.to_path_buf(),
            boot: std::sync::Mutex::new(None),
        }
    }

    /// The kernel and initramfs; building them the first time downloads the kernel
    /// package (tens of MiB) and can take a minute.
    fn boot_files(&self) -> Result<(guest::Kernel, PathBuf), String> {
        let mut b = self.boot.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = b.as_ref() {
            return Ok(k.clone());
        }
        let root = self.images.root();
        let kernel = guest::ensure_kernel(root).map_err(|e| e.to_string())?;
        let initrd = guest::ensure_initramfs(root, &kernel).map_err(|e| e.to_string())?;
        *b = Some((kernel.clone(), initrd.clone()));
        Ok((kernel, initrd))
    }

    pub fn accel(&self) -> Accel {
        self.accel
    }

    fn create_inner(&self, rec: &SandboxRecord, paths: &SandboxPaths) -> Result<(), String> {
        let qemu = self.qemu.as_ref().map_err(Clone::clone)?;
        let aether = self.aether.as_ref().map_err(Clone::clone)?;
        let (kernel, initrd) = self.boot_files()?;
        let disk =
            guest::ensure_root_disk(&self.images, guest::DiskSource::Layers(&rec.layers), aether)
                .map_err(|e| e.to_string())?;
        let dir = &paths.dir;
        let chardev = dir.join("vm.chardev");
        let qmp = dir.join("vm.qmp");
        let qemu_pid = dir.join("qemu.pid");
        let cpus = rec.limits.cpu_cores.ceil().max(1.0) as u64;
        // The guest's writable layer is a tmpfs inside it, so its disk limit is guest memory.
        let mem = rec.limits.memory_mb.max(128) + rec.limits.disk_mb / 4;
        let append = format!(
            "console=ttyS0 quiet panic=-1 tsc_early_khz={} tsc=reliable random.trust_cpu=on dsec.rw_mb={}",
            tsc_khz(),
            rec.limits.disk_mb
        );
        let mut cmd = Command::new(qemu);
        cmd.args([
            "-M",
            "microvm",
            "-accel",
            self.accel.as_str(),
            "-cpu",
            "max",
        ])
        .args(["-m", &format!("{mem}M"), "-smp", &cpus.to_string()])
        .args([
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
        ])
        .arg("-daemonize")
        .arg("-pidfile")
        .arg(&qemu_pid)
        .arg("-serial")
        .arg(format!("file:{}", dir.join("console.log").display()))
        .arg("-kernel")
        .arg(&kernel.vmlinuz)
        .arg("-initrd")
        .arg(&initrd)
        .args(["-append", &append])
        .arg("-drive")
        .arg(format!(
            "id=root,file={},format=raw,if=none,readonly=on",
            disk.display()
        ))
        .args(["-device", "virtio-blk-device,drive=root"])
        // Entropy from the host: without it the guest's CRNG can take minutes to initialise
        // under TCG, and getrandom() (Python's start-up) blocks until then.
        .args(["-object", "rng-random,id=rng,filename=/dev/urandom"])
        .args(["-device", "virtio-rng-device,rng=rng"])
        .args(["-device", "virtio-serial-device"])
        .arg("-chardev")
        .arg(format!(
            "socket,id=ch,path={},server=on,wait=off",
            chardev.display()
        ))
        .args([
            "-device",
            &format!("virtserialport,chardev=ch,name={}", "dsec.channel"),
        ])
        .arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", qmp.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
        let out = cmd
            .output()
            .map_err(|e| format!("starting {}: {e}", qemu.display()))?;
        if !out.status.success() {
            return Err(format!(
                "QEMU did not start: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        // The channel's host end, detached like QEMU (it exits when the VM does).
        let vmux_log = std::fs::File::create(dir.join("vmux.log"))
            .map_err(|e| format!("creating vmux.log: {e}"))?;
        let mut vmux = Command::new(aether);
        vmux.arg("vmux")
            .arg(&paths.channel)
            .arg(&chardev)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(vmux_log);
        // SAFETY: setsid between fork and exec, so the edge's exit does not take it along.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut vmux, || {
                libc::setsid();
                Ok(())
            });
        }
        let child = vmux
            .spawn()
            .map_err(|e| format!("starting dsec-aether vmux: {e}"))?;
        std::fs::write(dir.join("vmux.pid"), child.id().to_string())
            .map_err(|e| format!("writing vmux.pid: {e}"))?;
        Ok(())
    }

    fn qmp(&self, rec: &SandboxRecord, command: &str) -> Result<(), ApiError> {
        use std::io::{BufRead, BufReader, Write};
        let sock =
            std::os::unix::net::UnixStream::connect(self.sandboxes.join(&rec.id).join("vm.qmp"))
                .map_err(|e| ApiError::unavailable(format!("the VM's QMP socket: {e}")))?;
        let _ = sock.set_read_timeout(Some(Duration::from_secs(10)));
        let mut r = BufReader::new(
            sock.try_clone()
                .map_err(|e| ApiError::internal(e.to_string()))?,
        );
        let mut w = sock;
        let mut line = String::new();
        let _ = r.read_line(&mut line); // greeting
        for cmd in ["qmp_capabilities", command] {
            writeln!(w, "{{\"execute\":\"{cmd}\"}}")
                .map_err(|e| ApiError::unavailable(format!("QMP: {e}")))?;
            loop {
                line.clear();
                if r.read_line(&mut line).unwrap_or(0) == 0 {
                    return Err(ApiError::unavailable("QMP closed the connection"));
                }
                if line.contains("\"return\"") {
                    break;
                }
                if line.contains("\"error\"") {
                    return Err(ApiError::internal(format!("QMP {cmd}: {}", line.trim())));
                }
            }
        }
        Ok(())
    }
}

impl Backend for VmBackend {
    fn name(&self) -> &'static str {
        "vm"
    }

    fn status(&self) -> BackendStatus {
        let (available, detail) = match (&self.qemu, &self.aether) {
            (Ok(q), Ok(_)) => (
                true,
                format!(
                    "QEMU microvm ({}; {}), kernel and root disks built from Debian packages on first use",
                    q.display(),
                    match self.accel {
                        Accel::Kvm => "KVM",
                        Accel::Tcg => "TCG emulation: no hardware virtualisation on this host",
                    }
                ),
            ),
            (Err(e), _) | (_, Err(e)) => (false, e.clone()),
        };
        BackendStatus {
            name: "vm".into(),
            available,
            detail,
        }
    }

    fn fork_preserves_memory(&self) -> bool {
        false
    }

    fn create(
        &self,
        rec: &SandboxRecord,
        paths: &SandboxPaths,
        seed: Option<&Path>,
    ) -> Result<(), ApiError> {
        if seed.is_some() {
            return Err(ApiError::unimplemented(
                "forking a vm sandbox is not built yet (containers fork today)",
            ));
        }
        self.create_inner(rec, paths).map_err(|e| {
            let _ = self.destroy(rec, paths);
            ApiError::internal(format!("starting the VM: {e}"))
        })
    }

    fn is_alive(&self, rec: &SandboxRecord) -> bool {
        let dir = self.sandboxes.join(&rec.id);
        [dir.join("qemu.pid"), dir.join("vmux.pid")]
            .iter()
            .all(|p| read_pid(p).is_some_and(alive))
    }

    /// Stops the VM's CPUs in place (its memory stays where it is).
    fn pause(&self, rec: &SandboxRecord) -> Result<(), ApiError> {
        self.qmp(rec, "stop")
    }

    fn resume(&self, rec: &SandboxRecord) -> Result<(), ApiError> {
        self.qmp(rec, "cont")
    }

    fn snapshot_fs(
        &self,
        _rec: &SandboxRecord,
        _paths: &SandboxPaths,
        _dest: &Path,
    ) -> Result<(), ApiError> {
        Err(ApiError::unimplemented(
            "forking a vm sandbox is not built yet (containers fork today)",
        ))
    }

    fn destroy(&self, _rec: &SandboxRecord, paths: &SandboxPaths) -> Result<(), ApiError> {
        kill(&paths.dir.join("qemu.pid"));
        kill(&paths.dir.join("vmux.pid"));
        for f in ["qemu.pid", "vmux.pid", "vm.chardev", "vm.qmp"] {
            let _ = std::fs::remove_file(paths.dir.join(f));
        }
        let _ = std::fs::remove_file(&paths.channel);
        Ok(())
    }

    fn oom_kills(&self, _rec: &SandboxRecord) -> u64 {
        0
    }

    fn start_log(&self, paths: &SandboxPaths) -> Option<String> {
        let text = std::fs::read_to_string(paths.dir.join("console.log")).ok()?;
        let lines: Vec<&str> = text.lines().rev().take(8).collect();
        Some(lines.into_iter().rev().collect::<Vec<_>>().join(" | "))
    }

    /// A guest boots before aether answers: about 2 s under TCG on an idle host, far more
    /// when many boot at once on few cores.
    fn start_timeout(&self) -> Duration {
        match self.accel {
            Accel::Kvm => Duration::from_secs(30),
            Accel::Tcg => Duration::from_secs(120),
        }
    }
}
