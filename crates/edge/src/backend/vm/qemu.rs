//! Starting QEMU for a sandbox: its command line (machine, memory backend, disks, the
//! channel, the NIC in the sandbox's namespace, virtio-fs devices), the detached
//! process and its QMP connection, the boot files, and stopping it again.

use crate::backend::saved::SavedGuest;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dsec_common::{ApiError, IoContext};
use dsec_image::{ImageStore, guest};

use super::persist::{SAVE_TIMEOUT, VmInfo};
use super::probe::{Accel, machine, tsc_khz};
use super::qmp::Qmp;
use super::shares::stop_shares;
use super::{VmBackend, VmError, net};
use crate::backend::SandboxPaths;
use crate::backend::detached::{copy_sparse, kill, new_session, spawn_detached, write_json};
use crate::cgroup;
use crate::registry::SandboxRecord;

/// What QEMU itself needs beyond the guest's memory (device emulation, and under TCG the
/// translated-code cache, capped with `tb-size`).
pub(super) const QEMU_OVERHEAD_MB: u64 = 256;

pub(super) const TCG_CACHE_MB: u64 = 128;

/// Where a VM's memory comes from when QEMU starts.
pub(super) enum Mem<'a> {
    /// Its own: anonymous memory where forks are captured with `mapped-ram`, else a file
    /// in the RAM directory mapped shared (what a snapshot can leave out and copies can
    /// map); `fill` is such a file's saved content, copied into it first (a resume from
    /// disk of a VM saved that way).
    Own { fill: Option<&'a Path> },
    /// A fork copy: the template's file mapped private, so pages stay shared with the
    /// other copies until written.
    Template(&'a Path),
    /// A fork copy from a `mapped-ram` save: its pages mapped private from `offset`.
    Mapped { file: &'a Path, offset: u64 },
}

/// What a VM started to receive a saved state loads.
pub(super) enum Incoming<'a> {
    /// A migration stream; with `ignore_shared`, one that left out memory in a shared file.
    Stream { file: &'a Path, ignore_shared: bool },
    /// A `mapped-ram` file whose memory the VM maps ([`Mem::Mapped`]).
    Mapped(&'a Path),
}

/// QEMU's drives and block devices for the VM's root disks: read-only, the top one
/// `root` (as VMs saved with a single disk had it), each layered one with the serial
/// that tells the guest's `/init` its place ([`guest::disk_serial`]).
pub(super) fn drive_args(info: &VmInfo, bus: &str) -> Vec<String> {
    let layered = !info.guest.lowers.is_empty();
    let mut out = Vec::new();
    for (i, d) in info.guest.disks().enumerate() {
        let id = if i == 0 {
            "root".to_string()
        } else {
            format!("root{i}")
        };
        out.push("-drive".into());
        out.push(format!(
            "id={id},file={},format=raw,if=none,readonly=on",
            d.display()
        ));
        out.push("-device".into());
        out.push(if layered {
            format!(
                "virtio-blk-{bus},drive={id},serial={}",
                guest::disk_serial(i)
            )
        } else {
            format!("virtio-blk-{bus},drive={id}")
        });
    }
    out
}

/// The QMP connection of the QEMU just started as `child`: once its socket `qmp` is there
/// (QEMU makes it during start-up), or its log `log` as the error if it exited first.
pub(super) fn qmp_of_child(
    child: &mut std::process::Child,
    qmp: &Path,
    log: &Path,
) -> Result<Qmp, VmError> {
    let t0 = Instant::now();
    while !qmp.exists() {
        if let Ok(Some(status)) = child.try_wait() {
            let said = std::fs::read_to_string(log).unwrap_or_default();
            return Err(VmError::NotStarted {
                status: status.to_string(),
                said: said.trim().to_string(),
            });
        }
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(VmError::Timeout {
                what: "QEMU's QMP socket".into(),
                secs: 30,
            });
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(Qmp::connect(qmp, Duration::from_secs(10))?)
}

/// The kernel and initramfs every VM boots, found (or built) once per edge.
#[derive(Default)]
pub(super) struct BootFiles(std::sync::Mutex<Option<(guest::Kernel, PathBuf)>>);

impl BootFiles {
    pub(super) fn get(&self, images: &ImageStore) -> Result<(guest::Kernel, PathBuf), VmError> {
        let mut b = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = b.as_ref() {
            return Ok(k.clone());
        }
        let root = images.root();
        let kernel = guest::ensure_kernel(root)?;
        let initrd = guest::ensure_initramfs(root, &kernel)?;
        *b = Some((kernel.clone(), initrd.clone()));
        Ok((kernel, initrd))
    }
}

impl VmBackend {
    pub(super) fn qmp_of(&self, id: &str) -> Result<Qmp, VmError> {
        Ok(Qmp::connect(
            &self.sandboxes.join(id).join("vm.qmp"),
            Duration::from_secs(5),
        )?)
    }

    /// Starts QEMU (and the channel's host end) for a sandbox: booting, or, with
    /// `incoming`, loading a saved state (`(file, ignore_shared)`) and continuing it.
    pub(super) fn start(
        &self,
        rec: &SandboxRecord,
        paths: &SandboxPaths,
        info: &VmInfo,
        mem: Mem<'_>,
        incoming: Option<Incoming<'_>>,
        ready: Option<&dyn Fn() -> Result<(), VmError>>,
    ) -> Result<(), VmError> {
        let qemu = self.qemu()?;
        let aether = self.aether()?;
        let (kernel, initrd) = self.boot_files()?;
        let dir = &paths.dir;
        let chardev = dir.join("vm.chardev");
        let wake = dir.join("vm.wake");
        let qmp = dir.join("vm.qmp");
        let qemu_pid = dir.join("qemu.pid");
        std::fs::create_dir_all(&self.ram_dir)
            .ctx(|| format!("creating {}", self.ram_dir.display()))?;
        // The guest's memory: a file, so that a snapshot can leave it out (the file is the
        // memory) and fork copies map it copy-on-write; or anonymous, where copies map a
        // `mapped-ram` save instead. No prealloc or mlock, which would touch every page
        // and end the sharing.
        let size = info.guest.mem_mb;
        if info.shares > 0 && (incoming.is_some() || !matches!(mem, Mem::Own { fill: None })) {
            return Err(VmError::Refused(
                "a VM that mounts volumes is never restored from a save".into(),
            ));
        }
        let memory = match mem {
            // A virtio-fs daemon maps the guest's memory: it must be shareable.
            Mem::Own { fill: None } if self.anon_ram() && info.shares > 0 => {
                format!("memory-backend-memfd,id=mem,size={size}M,share=on")
            }
            Mem::Own { fill: None } if self.anon_ram() => {
                format!("memory-backend-ram,id=mem,size={size}M")
            }
            Mem::Own { fill } => {
                let own = self.ram_file(&rec.id);
                if let Some(src) = fill {
                    copy_sparse(src, &own)?;
                }
                format!(
                    "memory-backend-file,id=mem,size={size}M,mem-path={},share=on",
                    own.display()
                )
            }
            Mem::Template(t) => format!(
                "memory-backend-file,id=mem,size={size}M,mem-path={},share=off",
                t.display()
            ),
            Mem::Mapped { file, offset } => format!(
                "memory-backend-file,id=mem,size={size}M,mem-path={},offset={offset},share=off",
                file.display()
            ),
        };
        write_json(&dir.join("vm.json"), info)?;
        let mut append = format!(
            "console=ttyS0 quiet panic=-1 tsc_early_khz={} tsc=reliable random.trust_cpu=on dsec.rw_mb={} dsec.pids={}",
            tsc_khz(),
            rec.limits.disk_mb,
            rec.limits.pids
        );
        if !info.guest.lowers.is_empty() {
            append.push(' ');
            append.push_str(&guest::root_cmdline(1 + info.guest.lowers.len()));
        }
        if info.net {
            append.push(' ');
            append.push_str(&net::cmdline());
        }
        let opts = self.options()?;
        let (machine_type, bus) = machine(&info.machine).ok_or_else(|| {
            VmError::Refused(format!("machine type {:?} is not supported", info.machine))
        })?;
        let mut cmd = Command::new(qemu);
        let accel = match self.accel {
            Accel::Kvm => "kvm".to_string(),
            Accel::Tcg => format!("tcg,tb-size={TCG_CACHE_MB}"),
        };
        cmd.args([
            "-M",
            &format!("{machine_type},memory-backend=mem"),
            "-accel",
            &accel,
            "-cpu",
            "max",
        ])
        .args([
            "-m",
            &format!("{}M", info.guest.mem_mb),
            "-smp",
            &info.guest.cpus.to_string(),
        ])
        .args(["-object", &memory])
        .args([
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
        ])
        // QEMU's own seccomp filter: no obsolete system calls, no fork or exec (migrations
        // go to descriptors handed over QMP), no scheduler or affinity changes, and no
        // set*id once it runs as `run_as` (it drops to it itself, after the filter is in,
        // so set*id stays allowed for that one step; without `run_as`, never). It runs
        // detached by the edge rather than `-daemonize` (which forks).
        .args([
            "-sandbox",
            if opts.run_as.is_empty() {
                "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
            } else {
                "on,obsolete=deny,spawn=deny,resourcecontrol=deny"
            },
        ])
        .args(match (opts.run_as.as_str(), self.qemu_version >= (9, 1)) {
            ("", _) => vec![],
            (user, true) => vec!["-run-with".to_string(), format!("user={user}")],
            (user, false) => vec!["-runas".to_string(), user.to_string()],
        })
        .arg("-pidfile")
        .arg(&qemu_pid)
        // Appending, so the edge can cut the file short ([`cap_console`]) and QEMU goes on
        // writing from its new end.
        .arg("-chardev")
        .arg(format!(
            "file,id=console0,append=on,path={}",
            dir.join("console.log").display()
        ))
        .args(["-serial", "chardev:console0"])
        .arg("-kernel")
        .arg(&kernel.vmlinuz)
        .arg("-initrd")
        .arg(&initrd)
        .args(["-append", &append])
        .args(drive_args(info, bus))
        // Entropy from the host: without it the guest's CRNG can take minutes to initialise
        // under TCG, and getrandom() (Python's start-up) blocks until then.
        .args(["-object", "rng-random,id=rng,filename=/dev/urandom"])
        .args(["-device", &format!("virtio-rng-{bus},rng=rng")])
        .args(["-device", &format!("virtio-serial-{bus}")])
        .arg("-chardev")
        .arg(format!(
            "socket,id=ch,path={},server=on,wait=off",
            chardev.display()
        ))
        .args([
            "-device",
            &format!("virtserialport,chardev=ch,name={}", "dsec.channel"),
        ])
        // A chardev with no device: connecting to it only wakes QEMU's main loop (see
        // dsec-aether vmux).
        .arg("-chardev")
        .arg(format!(
            "socket,id=wake,path={},server=on,wait=off",
            wake.display()
        ))
        .arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", qmp.display()))
        .args(opts.devices.iter().flat_map(|d| ["-device", d.as_str()]))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
        // The sandbox's limits hold for QEMU as a whole, from its first allocation.
        let overhead = QEMU_OVERHEAD_MB
            + match self.accel {
                Accel::Kvm => 0,
                Accel::Tcg => TCG_CACHE_MB,
            };
        let procs = cgroup::create_leaf(
            self.cgroups,
            &cgroup::sandbox_cgroup_path(&rec.id),
            cgroup::LeafLimits {
                cpu_quota_us: cgroup::own::quota_us(rec.limits.cpu_cores),
                memory_bytes: (info.guest.mem_mb + overhead) << 20,
                pids: 1024,
            },
        )?;
        cgroup::own::join_before_exec(&mut cmd, &procs)?;
        if info.shares > 0 {
            // virtiofsd (libvhost-user) serves modern virtio only, and microvm's
            // virtio-mmio devices are legacy unless told otherwise.
            if bus == "device" {
                cmd.args(["-global", "virtio-mmio.force-legacy=false"]);
            }
            for (i, sock) in self.start_shares(rec, dir, &procs)?.iter().enumerate() {
                cmd.arg("-chardev")
                    .arg(format!("socket,id=vfs{i},path={}", sock.display()))
                    .args([
                        "-device",
                        &format!(
                            "vhost-user-fs-{bus},chardev=vfs{i},tag={}",
                            crate::volumes::share_tag(i)
                        ),
                    ]);
            }
        }
        // With a network, QEMU runs in the sandbox's namespace, next to its tap.
        let _netns = if info.net {
            let node_side = rec
                .network
                .as_ref()
                .and_then(|n| n.gateway.clone())
                .ok_or_else(|| VmError::Refused("the VM has a network device, so it needs a network (it was saved with one; not network \"none\")".into()))?;
            net::setup(&crate::net::link::netns_name(&rec.id), &node_side)?;
            let f = std::fs::File::open(crate::net::link::netns_path(&rec.id)?)
                .ctx(|| "opening the sandbox's network namespace".into())?;
            let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
            // SAFETY: setns(2) between fork and exec on a descriptor that stays open
            // until the command has run.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                    if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            cmd.args(net::qemu_args(bus));
            Some(f)
        } else {
            None
        };
        // Never run the guest before the channel's host end is connected: output the
        // guest writes to an unconnected port stalls the port for good (QEMU throttles
        // it and has no socket to wait on), so QEMU starts stopped.
        match incoming {
            Some(_) => cmd.args(["-incoming", "defer"]),
            None => cmd.arg("-S"),
        };
        let _ = std::fs::remove_file(&qmp); // a socket a killed QEMU left
        let qemu_log = dir.join("qemu.log");
        let log =
            std::fs::File::create(&qemu_log).ctx(|| format!("creating {}", qemu_log.display()))?;
        let log2 = log.try_clone().ctx(|| "the QEMU log".into())?;
        cmd.stdin(Stdio::null()).stdout(log).stderr(log2);
        new_session(&mut cmd);
        let mut child = cmd.spawn().ctx(|| format!("starting {}", qemu.display()))?;
        let mut q = qmp_of_child(&mut child, &qmp, &qemu_log)?;
        // The channel's host end, detached like QEMU (it exits when the VM does).
        let vmux_log =
            std::fs::File::create(dir.join("vmux.log")).ctx(|| "creating vmux.log".into())?;
        let mut vmux = Command::new(aether);
        vmux.arg("vmux")
            .arg(&paths.channel)
            .arg(&chardev)
            .arg(&wake)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(vmux_log);
        spawn_detached(&mut vmux, "dsec-aether vmux", &dir.join("vmux.pid"))?;
        // What it loads may still be being written (a fork's copy started early).
        if let Some(ready) = ready {
            ready()?;
        }
        match incoming {
            Some(Incoming::Stream {
                file,
                ignore_shared,
            }) => {
                q.set_ignore_shared(ignore_shared)?;
                q.load(file, SAVE_TIMEOUT)?;
            }
            Some(Incoming::Mapped(file)) => q.load_mapped(file, SAVE_TIMEOUT)?,
            None => {}
        }
        q.wait_connected("ch", Duration::from_secs(10))?;
        q.execute("cont", serde_json::Value::Null)?;
        Ok(())
    }

    pub(super) fn boot(&self, rec: &SandboxRecord, paths: &SandboxPaths) -> Result<(), VmError> {
        let aether = self.aether()?;
        let mut disks =
            guest::ensure_root_disks(&self.images, guest::DiskSource::Layers(&rec.layers), aether)?
                .into_iter();
        let info = VmInfo {
            guest: SavedGuest {
                disk: disks
                    .next()
                    .ok_or_else(|| VmError::Refused("the VM has no root disk".into()))?,
                lowers: disks.collect(),
                // The guest's writable layer is a tmpfs inside it, so its disk limit is
                // guest memory.
                mem_mb: rec.limits.memory_mb.max(128) + rec.limits.disk_mb / 4,
                cpus: rec.limits.cpu_cores.ceil().max(1.0) as u64,
            },
            shared_ram: !self.anon_ram(),
            machine: self.options()?.machine.clone(),
            net: rec.network.as_ref().is_some_and(|n| n.gateway.is_some()),
            shares: rec.volumes.len(),
        };
        self.start(rec, paths, &info, Mem::Own { fill: None }, None, None)
    }

    pub(super) fn stop_processes(&self, dir: &Path) {
        kill(&dir.join("qemu.pid"));
        // A live capture's template, if an edge died during one.
        kill(&dir.join("fork-template").join("qemu.pid"));
        kill(&dir.join("vmux.pid"));
        for f in ["qemu.pid", "vmux.pid", "vm.chardev", "vm.wake", "vm.qmp"] {
            let _ = std::fs::remove_file(dir.join(f));
        }
        stop_shares(dir);
        if let Some(id) = dir.file_name() {
            let rel = cgroup::sandbox_cgroup_path(&id.to_string_lossy());
            // A killed QEMU can take a moment (seconds, nested) to leave its cgroup.
            cgroup::empty_and_remove(self.cgroups, &rel, Duration::from_secs(30));
        }
    }

    pub(super) fn qmp(&self, rec: &SandboxRecord, command: &str) -> Result<(), ApiError> {
        let mut q = self
            .qmp_of(&rec.id)
            .map_err(|e| ApiError::unavailable(format!("the VM's control socket: {e}")))?;
        q.execute(command, serde_json::Value::Null)?;
        Ok(())
    }
}
