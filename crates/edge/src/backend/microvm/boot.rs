//! Starting a microVM: its VMM spawned jailed in its namespaces and cgroup with the files
//! it may see, the channel's host end, a boot or a snapshot load, and a save.

use super::*;
use crate::backend::saved::SavedGuest;

impl MicrovmBackend {
    /// Gives files the jailed VMM must open (a snapshot's state and memory, which may have
    /// been written by the edge or copied in from another edge) to its user.
    pub(super) fn give_to_vmm(&self, files: &[&Path]) -> Result<(), MicrovmError> {
        if let Ok(Some(r)) = &self.run_as {
            for f in files {
                std::os::unix::fs::chown(f, Some(r.uid), Some(r.gid))
                    .ctx(|| format!("giving {} to the VMM's user", f.display()))?;
            }
        }
        Ok(())
    }

    /// Makes a directory the jailed VMM owns (mode 0700).
    pub(super) fn vmm_owned_dir(&self, p: &Path) -> Result<(), MicrovmError> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(p).ctx(|| format!("creating {}", p.display()))?;
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o700))
            .ctx(|| format!("{}", p.display()))?;
        self.give_to_vmm(&[p])
    }

    /// Starts a Firecracker process for the sandbox inside its network namespace, cgroup
    /// and jail, with its API socket ready; no guest yet. `read_only`: the files the VM
    /// will open (kernel, initrd and disk, or a snapshot's files), all it sees of the host
    /// besides its binary, shared libraries and its own directories.
    pub(super) fn spawn_vmm(
        &self,
        fc: &Firecracker,
        rec: &SandboxRecord,
        paths: &SandboxPaths,
        mem_mb: u64,
        read_only: &[PathBuf],
    ) -> Result<Client, MicrovmError> {
        let dir = &paths.dir;
        let api_sock = dir.join(API_SOCK);
        let run_as = *self
            .run_as
            .as_ref()
            .map_err(|e| MicrovmError::Unavailable(e.to_string()))?;
        self.vmm_owned_dir(&dir.join(VMM_DIR))?;
        self.vmm_owned_dir(&self.ram_vmm_dir(&rec.id))?;
        // A stale vsock socket makes a snapshot load fail with EADDRINUSE.
        for f in [API_SOCK, VSOCK_UDS] {
            let _ = std::fs::remove_file(dir.join(f));
        }
        let root = dir.join(JAIL_ROOT);
        std::fs::create_dir_all(&root).ctx(|| format!("creating {}", root.display()))?;
        let mut visible = vec![fc.path.clone()];
        visible.extend(read_only.iter().cloned());
        let jail = jail::Jail::new(&jail::Plan {
            root,
            read_only: visible,
            read_write: vec![dir.join(VMM_DIR), self.ram_vmm_dir(&rec.id)],
            run_as,
        })?;
        // With a network, the VMM runs in the sandbox's namespace (made by the edge's
        // network module, as for a container), its tap NAT'd to the sandbox's address and
        // its DNS sent to the node's proxy: the sandbox's egress rules hold for the guest.
        // Without one, a namespace of its own holds a tap that leads nowhere.
        let ns_file = match rec.network.as_ref().and_then(|n| n.gateway.clone()) {
            Some(node_side) => {
                let ns = crate::net::link::netns_name(&rec.id);
                crate::backend::vm::net::setup_tap(
                    &ns,
                    &node_side,
                    netns::TAP,
                    run_as.map(|o| (o.uid, o.gid)),
                )?;
                std::fs::File::open(crate::net::link::netns_path(&rec.id)?)
                    .ctx(|| format!("opening the sandbox's network namespace {ns}"))?
            }
            None => {
                let ns = netns::name(&rec.id);
                netns::create(&ns, run_as)?;
                netns::open(&ns)?
            }
        };
        let limits = cgroup::LeafLimits {
            memory_bytes: (mem_mb + VMM_OVERHEAD_MB) << 20,
            cpu_quota_us: cgroup::own::quota_us(rec.limits.cpu_cores),
            pids: 1024,
        };
        let procs = cgroup::create_leaf(self.mode, &cgroup::sandbox_cgroup_path(&rec.id), limits)?;
        let console = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(CONSOLE))
            .ctx(|| format!("creating {CONSOLE}"))?;
        let console2 = console.try_clone().ctx(|| CONSOLE.to_string())?;
        let mut cmd = Command::new(&fc.path);
        cmd.arg("--api-sock")
            .arg(&api_sock)
            .arg("--id")
            .arg(&rec.id)
            .stdin(Stdio::null())
            // The guest's serial console, and Firecracker's own log lines.
            .stdout(console)
            .stderr(console2);
        let ns_fd = ns_file.as_raw_fd();
        // SAFETY: between fork and exec only async-signal-safe calls on an fd opened
        // above: a new session (the edge's exit must not take the VM along) and the VM's
        // network namespace.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                libc::setsid();
                if libc::setns(ns_fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cgroup::own::join_before_exec(&mut cmd, &procs)?;
        // Last: once jailed, the host's cgroup files and namespaces are out of sight.
        // SAFETY: `enter` runs only system calls on strings prepared by `Jail::new`.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || jail.enter());
        }
        let child = cmd
            .spawn()
            .ctx(|| format!("starting {} in its jail", fc.path.display()))?;
        std::fs::write(dir.join(FC_PID), child.id().to_string())
            .ctx(|| format!("writing {FC_PID}"))?;
        drop(ns_file);
        let c = Client::new(&api_sock, SNAPSHOT_TIMEOUT);
        c.wait_ready(API_READY)?;
        Ok(c)
    }

    /// The channel's host end, detached like Firecracker (it exits when Firecracker does).
    pub(super) fn spawn_proxy(&self, paths: &SandboxPaths) -> Result<(), MicrovmError> {
        let aether = self.aether()?;
        let dir = &paths.dir;
        let fc_pid = read_pid(&dir.join(FC_PID))
            .ok_or_else(|| MicrovmError::Refused("Firecracker's pid is not recorded".into()))?;
        let log = std::fs::File::create(dir.join("vsockproxy.log"))
            .ctx(|| "creating vsockproxy.log".into())?;
        let mut cmd = Command::new(aether);
        cmd.arg("vsockproxy")
            .arg(&paths.channel)
            .arg(dir.join(VSOCK_UDS))
            .arg(dsec_common::vsock::CHANNEL_PORT.to_string())
            .arg(fc_pid.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        spawn_detached(&mut cmd, "dsec-aether vsockproxy", &dir.join(PROXY_PID))?;
        Ok(())
    }

    pub(super) fn boot(
        &self,
        fc: &Firecracker,
        rec: &SandboxRecord,
        paths: &SandboxPaths,
    ) -> Result<(), MicrovmError> {
        let aether = self.aether()?;
        let disks =
            guest::ensure_root_disks(&self.images, guest::DiskSource::Layers(&rec.layers), aether)?;
        let (kernel, initrd) = self.boot_files()?;
        let info = VmInfo {
            guest: SavedGuest {
                disk: disks
                    .first()
                    .cloned()
                    .ok_or_else(|| MicrovmError::Refused("the VM has no root disk".into()))?,
                lowers: disks[1..].to_vec(),
                // The guest's writable layer is a tmpfs inside it: its disk limit is memory.
                mem_mb: rec.limits.memory_mb.max(128) + rec.limits.disk_mb / 4,
                cpus: vcpus(rec.limits.cpu_cores),
            },
            track_dirty_pages: self.diff_snapshots,
        };
        write_json(&paths.dir.join(INFO), &info)?;
        let plan = BootPlan {
            vcpus: info.guest.cpus,
            mem_mb: info.guest.mem_mb,
            kernel,
            initrd,
            boot_args: format!(
                "console=ttyS0 reboot=k panic=1 quiet i8042.noaux i8042.nomux i8042.dumbkbd random.trust_cpu=on {}=vsock dsec.rw_mb={} dsec.pids={} {}{}",
                dsec_common::vsock::CMDLINE_KEY,
                rec.limits.disk_mb,
                rec.limits.pids,
                guest::root_cmdline(disks.len()),
                // The guest's address and gateway on the tap (the same in every copy).
                match rec.network.as_ref().and_then(|n| n.gateway.as_ref()) {
                    Some(_) => format!(" {}", crate::backend::vm::net::cmdline()),
                    None => String::new(),
                }
            ),
            disks,
            vsock_uds: paths.dir.join(VSOCK_UDS),
            track_dirty_pages: info.track_dirty_pages,
        };
        let visible: Vec<PathBuf> = [plan.kernel.clone(), plan.initrd.clone()]
            .into_iter()
            .chain(plan.disks.iter().cloned())
            .collect();
        let c = self.spawn_vmm(fc, rec, paths, info.guest.mem_mb, &visible)?;
        boot_calls(&c, &fc.caps, &plan)?;
        self.spawn_proxy(paths)
    }

    /// Starts a VM from a saved one (a fork copy, or itself after a pause to disk).
    pub(super) fn load(
        &self,
        fc: &Firecracker,
        rec: &SandboxRecord,
        paths: &SandboxPaths,
        saved_dir: &Path,
    ) -> Result<SavedVm, MicrovmError> {
        let saved = snapshot::validate(saved_dir, fc)?;
        let info = VmInfo {
            guest: saved.guest.clone(),
            track_dirty_pages: saved.track_dirty_pages,
        };
        write_json(&paths.dir.join(INFO), &info)?;
        let visible: Vec<PathBuf> = [saved_dir.join(snapshot::VMSTATE), saved.mem.clone()]
            .into_iter()
            .chain(saved.guest.disks().map(Path::to_path_buf))
            .collect();
        self.give_to_vmm(&[&visible[0], &visible[1]])?;
        let c = self.spawn_vmm(fc, rec, paths, info.guest.mem_mb, &visible)?;
        load_calls(
            &c,
            &fc.caps,
            &saved_dir.join(snapshot::VMSTATE),
            &saved.mem,
            &paths.dir.join(VSOCK_UDS),
            info.track_dirty_pages,
        )?;
        self.spawn_proxy(paths)?;
        Ok(saved)
    }

    /// Keeps a link to the memory the VM now stands on, for its next Diff snapshot.
    pub(super) fn set_base(&self, id: &str, mem: &Path) {
        let base = snapshot::base_mem(&self.ram_dir, id);
        let _ = std::fs::remove_file(&base);
        // Fails across filesystems (a wake from disk): the next snapshot is then Full.
        let _ = std::fs::hard_link(mem, &base);
    }

    /// Writes a snapshot of the paused VM `rec`: `vmstate` into `dest`, memory to `mem`.
    /// A Diff (when dirty pages are tracked and a base exists) goes onto a copy of the
    /// base; otherwise a Full snapshot writes all of it.
    pub(super) fn save(
        &self,
        fc: &Firecracker,
        rec: &SandboxRecord,
        dest: &Path,
        mem: &Path,
    ) -> Result<SavedVm, MicrovmError> {
        let info: VmInfo = read_json(&self.dir(&rec.id).join(INFO))?;
        std::fs::create_dir_all(dest).ctx(|| format!("creating {}", dest.display()))?;
        let c = self.client(&rec.id);
        let fc_pid = read_pid(&self.dir(&rec.id).join(FC_PID));
        // Paused by `pause` (stopped threads): Firecracker saves only a VM its API paused.
        if let Some(pid) = fc_pid {
            signal_threads(pid, libc::SIGCONT, STOP_WITHIN)?;
        }
        if !api_paused(&c)? {
            pause_call(&c)?;
        }
        let base = snapshot::base_mem(&self.ram_dir, &rec.id);
        let vmstate = dest.join(snapshot::VMSTATE);
        // The jailed VMM writes only into its own directories: it saves there, and the
        // files are then moved where they belong (memory stays on the filesystem it was
        // asked for: the RAM directory's VMM directory for memory bound for RAM).
        let vmm = self.dir(&rec.id).join(VMM_DIR);
        let out_state = vmm.join("out.vmstate");
        let mem_out_dir = if mem.starts_with(&self.ram_dir) {
            self.ram_vmm_dir(&rec.id)
        } else {
            vmm.clone()
        };
        // What the VMM writes now is not the guest's memory use: charged apart from its limit.
        let _apart = match fc_pid {
            Some(pid) => Some(cgroup::own::charge_apart(
                self.mode,
                &cgroup::sandbox_cgroup_path(&rec.id),
                pid,
            )?),
            None => None,
        };
        // A Diff holds only the pages written since the base: the source stays paused for
        // those alone. It becomes the snapshot's memory in `finish_snapshot`, laid over a
        // copy of the base once the source runs again.
        let diff = info.track_dirty_pages && base.is_file() && mem.parent() == base.parent();
        let saved = if diff {
            let out = mem_out_dir.join("out.diff");
            snapshot_call(&c, api::SnapshotType::Diff, &out_state, &out)
                .map_err(MicrovmError::from)
                .and_then(|()| move_file(&out, &snapshot::pending_diff(mem)))
        } else {
            let out_mem = mem_out_dir.join("out.mem");
            snapshot_call(&c, api::SnapshotType::Full, &out_state, &out_mem)
                .map_err(MicrovmError::from)
                .and_then(|()| move_file(&out_mem, mem))
        }
        .and_then(|()| move_file(&out_state, &vmstate));
        if let Err(e) = saved {
            for f in ["out.vmstate", "out.mem", "out.diff"] {
                let _ = std::fs::remove_file(vmm.join(f));
                let _ = std::fs::remove_file(mem_out_dir.join(f));
            }
            let _ = std::fs::remove_file(snapshot::pending_diff(mem));
            return Err(e);
        }
        if info.track_dirty_pages && !diff {
            self.set_base(&rec.id, mem);
        }
        let saved = SavedVm {
            format: snapshot::FORMAT.into(),
            firecracker: fc.version,
            snapshot_version: fc.snapshot_version.clone(),
            guest: info.guest,
            track_dirty_pages: info.track_dirty_pages,
            mem: mem.to_path_buf(),
        };
        snapshot::write_meta(dest, &saved)?;
        Ok(saved)
    }
}
