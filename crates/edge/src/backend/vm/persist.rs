//! A VM's saved state: what `vm.json` records ([`SavedVm`], [`VmInfo`]), how a running
//! or stopped VM is saved (a stream with or without its memory, a live capture into a
//! template, a `mapped-ram` file), and how fork copies start from a save.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dsec_common::{ApiError, IoContext};

use super::qemu::{Incoming, Mem, qmp_of_child};
use super::{VmBackend, VmError, mapped, net};
use crate::backend::SandboxPaths;
use crate::backend::detached::{copy_sparse, kill, read_json, read_pid, write_json};
use crate::backend::saved::{SavedGuest, SavedState};
use crate::registry::SandboxRecord;

/// The format of `vm.json` this edge writes; it reads this one and the ones before.
/// Any change to [`SavedVm`] that an older edge would misread takes the next number.
pub(super) const SAVED_FORMAT: u32 = 1;

fn first_format() -> u32 {
    1
}

/// What a save holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum SavedKind {
    /// `dev` holds the device state and `ram` the memory file.
    Shared,
    /// `full` holds both (the VM's memory was private, e.g. a fork copy).
    Full,
    /// `ram` is a `mapped-ram` save of both, which copies map.
    Mapped,
}

/// A saved VM's description (`vm.json`), checked: a format newer than this edge's is
/// refused rather than misread.
pub(super) fn read_saved(path: &Path) -> Result<SavedVm, crate::backend::StateError> {
    crate::backend::saved::read(path)
}

impl SavedState for SavedVm {
    const WHAT: &'static str = "a saved QEMU VM";
    const FORMAT: u32 = SAVED_FORMAT;
    fn format(&self) -> u32 {
        self.format
    }
    fn guest(&self) -> &SavedGuest {
        &self.guest
    }
}

/// What a saved VM is, written next to its state as `vm.json`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct SavedVm {
    /// The guest's root disks, memory and vCPUs.
    #[serde(flatten)]
    pub(super) guest: SavedGuest,
    /// [`SAVED_FORMAT`] when written (files from before it was recorded are format 1).
    #[serde(default = "first_format")]
    pub(super) format: u32,
    pub(super) kind: SavedKind,
    /// The memory file of a `shared` or `mapped` save, when it lives outside the saved
    /// directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) ram: Option<PathBuf>,
    /// The guest kernel's release: a restore needs the same kernel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) kernel: Option<String>,
    #[serde(default = "default_machine")]
    pub(super) machine: String,
    #[serde(default)]
    pub(super) net: bool,
    /// A `mapped` save planned and not yet made ([`Backend::plan_snapshot`]): copies may
    /// start on `ram`, and wait until this is gone before they load it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(super) pending: bool,
}

impl SavedVm {
    /// A save of the VM `info` describes just made: `shared` with its memory file `ram`,
    /// else `full`.
    pub(super) fn of(info: VmInfo, ram: Option<&Path>, kernel: Option<String>) -> SavedVm {
        SavedVm {
            guest: info.guest,
            format: SAVED_FORMAT,
            kind: if ram.is_some() {
                SavedKind::Shared
            } else {
                SavedKind::Full
            },
            ram: ram.map(Path::to_path_buf),
            kernel,
            machine: info.machine,
            net: info.net,
            pending: false,
        }
    }

    /// The VM this save restores into; `shared_ram` says how its memory will be held.
    pub(super) fn info(&self, shared_ram: bool) -> VmInfo {
        VmInfo {
            guest: self.guest.clone(),
            shared_ram,
            machine: self.machine.clone(),
            net: self.net,
            shares: 0,
        }
    }
}

/// The files a saved VM is made of, as another edge receives them (and its disks,
/// [`moved_disk::is_name`]).
pub(super) const SAVED_FILES: &[&str] = &["vm.json", "dev", "full", "ram"];

/// The VM's own description (`<sandbox dir>/vm.json`): what a save and a restart need.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct VmInfo {
    /// Its root disks (the stage of [`guest::ensure_root_disks`] on top, or, in a VM saved
    /// before roots were layered, its one ext4 disk), memory and vCPUs.
    #[serde(flatten)]
    pub(super) guest: SavedGuest,
    /// Whether its memory is its own shared file (else a private mapping of a template).
    pub(super) shared_ram: bool,
    /// QEMU's machine type (a restore needs the same one).
    #[serde(default = "default_machine")]
    pub(super) machine: String,
    /// Whether it has a network device (in the sandbox's namespace).
    #[serde(default)]
    pub(super) net: bool,
    /// How many volumes it mounts (virtio-fs devices `dsec_v<i>`, each served by a
    /// virtiofsd of its own). Such a VM is never saved (see [`refuse_saving`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub(super) shares: usize,
}

pub(super) fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// A VM that mounts volumes cannot be saved: a virtio-fs device's state is its daemon's
/// (open files, locks), which QEMU's migration cannot carry, so QEMU refuses it.
pub(super) fn refuse_saving(rec: &SandboxRecord, what: &str) -> Result<(), ApiError> {
    if rec.volumes.is_empty() {
        return Ok(());
    }
    Err(ApiError::precondition(format!(
        "sandbox {} mounts volumes, and a vm sandbox that mounts volumes cannot be {what} (its shared-filesystem devices cannot be saved with it); use a container sandbox, or a vm without volumes",
        rec.id
    )))
}

pub(super) fn default_machine() -> String {
    "microvm".into()
}

/// How long saving or loading a VM's state may take (the memory goes through it when the
/// VM's pages are private).
pub(super) const SAVE_TIMEOUT: Duration = Duration::from_secs(120);

/// The command line of a template that takes a live migration of the VM whose command
/// line is `own` (see [`VmBackend::live_save`]): the same machine and devices, its files
/// moved from `dir` into `tdir`, its memory `ram` (shared, so it ends in the file), its NIC
/// on the tap it is given as descriptor 3 (the VM's own tap stays the VM's), and waiting
/// stopped for an incoming migration.
pub(super) fn template_args(
    own: &[String],
    dir: &Path,
    tdir: &Path,
    ram: &Path,
) -> Result<Vec<String>, VmError> {
    let (from, to) = (dir.to_string_lossy(), tdir.to_string_lossy());
    let mut out = Vec::with_capacity(own.len() + 4);
    let mut it = own.iter();
    let mut mem = false;
    while let Some(a) = it.next() {
        match a.as_str() {
            "-S" => continue,
            "-incoming" => {
                it.next();
                continue;
            }
            _ => {}
        }
        let a = if a.starts_with("memory-backend-file,") {
            mem = true;
            a.split(',')
                .map(|o| {
                    if o.starts_with("mem-path=") {
                        format!("mem-path={}", ram.display())
                    } else if o.starts_with("share=") {
                        "share=on".to_string()
                    } else {
                        o.to_string()
                    }
                })
                .collect::<Vec<_>>()
                .join(",")
        } else if a.starts_with("tap,") {
            let id = a
                .split(',')
                .find_map(|o| o.strip_prefix("id="))
                .unwrap_or("net0");
            format!("tap,id={id},fd=3")
        } else {
            a.replace(from.as_ref(), to.as_ref())
        };
        out.push(a);
    }
    if !mem {
        return Err(VmError::Refused("the VM's memory is not a file".into()));
    }
    out.extend(["-incoming".into(), "defer".into(), "-S".into()]);
    Ok(out)
}

/// A new file for a `mapped-ram` save of a guest memory of `mem_bytes`, open for writing
/// only (how QEMU takes it), the edge's alone (QEMU opens what maps it before it drops to
/// its user, and is handed descriptors for the rest), and as long as a copy maps: a copy
/// that starts before the save is written would otherwise extend it itself, racing the
/// save's own writes.
pub(super) fn new_mapped_file(path: &Path, mem_bytes: u64) -> Result<std::fs::File, VmError> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .ctx(|| format!("creating {}", path.display()))?;
    let len = mapped::planned_pages_offset(mem_bytes) + mem_bytes;
    if f.metadata().map(|m| m.len()).unwrap_or(0) < len {
        f.set_len(len)
            .ctx(|| format!("sizing {}", path.display()))?;
    }
    Ok(f)
}

impl VmBackend {
    /// A fork copy from a saved VM (see [`VmBackend::save`], [`VmBackend::mapped_save`]).
    pub(super) fn restore_copy(
        &self,
        rec: &SandboxRecord,
        paths: &SandboxPaths,
        seed: &Path,
    ) -> Result<(), VmError> {
        let mut saved = read_saved(&seed.join("vm.json"))?;
        if saved.pending {
            match self.restore_early(rec, paths, seed, &saved) {
                Err(VmError::Replanned) => {
                    // The snapshot came out otherwise: this copy starts over from it.
                    self.stop_processes(&paths.dir);
                    saved = read_saved(&seed.join("vm.json"))?;
                }
                done => return done,
            }
        }
        let ram = saved.ram.clone().unwrap_or_else(|| seed.join("ram"));
        let mut info = saved.info(false);
        match saved.kind {
            SavedKind::Shared => self.start(
                rec,
                paths,
                &info,
                Mem::Template(&ram),
                Some(Incoming::Stream {
                    file: &seed.join("dev"),
                    ignore_shared: true,
                }),
                None,
            ),
            SavedKind::Mapped => {
                let block = mapped::read_mem_of(&ram, info.guest.mem_mb << 20)?;
                self.start(
                    rec,
                    paths,
                    &info,
                    Mem::Mapped {
                        file: &ram,
                        offset: block.pages_offset,
                    },
                    Some(Incoming::Mapped(&ram)),
                    None,
                )
            }
            SavedKind::Full => {
                info.shared_ram = !self.anon_ram();
                self.start(
                    rec,
                    paths,
                    &info,
                    Mem::Own { fill: None },
                    Some(Incoming::Stream {
                        file: &seed.join("full"),
                        ignore_shared: false,
                    }),
                    None,
                )
            }
        }
    }

    /// A fork copy started while its snapshot is taken (`saved`, the plan): QEMU starts on
    /// the planned file at the offset its pages will have, then waits for the snapshot
    /// before it loads it. [`VmError::Replanned`] when the snapshot came out otherwise.
    pub(super) fn restore_early(
        &self,
        rec: &SandboxRecord,
        paths: &SandboxPaths,
        seed: &Path,
        saved: &SavedVm,
    ) -> Result<(), VmError> {
        let ram = saved
            .ram
            .clone()
            .ok_or_else(|| VmError::Refused("the planned snapshot names no file".into()))?;
        let offset = mapped::planned_pages_offset(saved.guest.mem_mb << 20);
        let info = saved.info(false);
        let wait = || {
            let t0 = Instant::now();
            loop {
                if !seed.is_dir() {
                    return Err(VmError::SnapshotFailed);
                }
                // Absent or still the plan while it is taken (or retaken after a pause).
                if let Ok(now) = read_saved(&seed.join("vm.json"))
                    && !now.pending
                {
                    if now.kind != SavedKind::Mapped || now.ram.as_deref() != Some(ram.as_path()) {
                        return Err(VmError::Replanned);
                    }
                    return match mapped::read_mem_of(&ram, saved.guest.mem_mb << 20) {
                        Ok(b) if b.pages_offset == offset => Ok(()),
                        Ok(_) => Err(VmError::Replanned),
                        Err(e) => Err(e.into()),
                    };
                }
                if t0.elapsed() > SAVE_TIMEOUT {
                    return Err(VmError::Timeout {
                        what: "the fork's snapshot".into(),
                        secs: SAVE_TIMEOUT.as_secs(),
                    });
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        };
        self.start(
            rec,
            paths,
            &info,
            Mem::Mapped { file: &ram, offset },
            Some(Incoming::Mapped(&ram)),
            Some(&wait),
        )
    }

    /// Saves a stopped VM into `dest`: its device state and a copy of its memory file
    /// (`ram_to`, sparse) when its memory is its own shared file, or one stream with
    /// the memory in it when its pages are private. The VM stays stopped, and may go on
    /// (`cont`) afterwards: its own file is never mapped by anything restored from this.
    pub(super) fn save(
        &self,
        rec: &SandboxRecord,
        dest: &Path,
        ram_to: &Path,
    ) -> Result<(), VmError> {
        let dir = self.sandboxes.join(&rec.id);
        let info: VmInfo = read_json(&dir.join("vm.json"))?;
        std::fs::create_dir_all(dest).ctx(|| format!("creating {}", dest.display()))?;
        let kernel = Some(self.boot_files()?.0.version);
        let mut q = self.qmp_of(&rec.id)?;
        if self.qemu_version >= (9, 0) {
            // Left on by a mapped-ram capture an edge died in; a stream save refuses them.
            let _ = q.set_caps(&[("mapped-ram", false), ("multifd", false)]);
        }
        q.set_ignore_shared(info.shared_ram)?;
        let saved = if info.shared_ram {
            q.save(&dest.join("dev"), SAVE_TIMEOUT)?;
            copy_sparse(&self.ram_file(&rec.id), ram_to)?;
            SavedVm::of(info, Some(ram_to), kernel)
        } else {
            q.save(&dest.join("full"), SAVE_TIMEOUT)?;
            SavedVm::of(info, None, kernel)
        };
        Ok(write_json(&dest.join("vm.json"), &saved)?)
    }

    /// [`VmBackend::save`] of a running VM (`info`, its `vm.json`) without stopping it
    /// for the memory copy: a template QEMU with the VM's own command line (see
    /// [`template_args`]) takes a live migration of the VM over a socket pair; the VM is stopped only for the last dirty pages and its device state, then
    /// continues. The template, now holding the memory, saves its device state
    /// (`x-ignore-shared`) into `dest` and quits. Returns the ms the VM stood still.
    pub(super) fn live_save(
        &self,
        rec: &SandboxRecord,
        info: VmInfo,
        dest: &Path,
        ram_to: &Path,
    ) -> Result<u64, VmError> {
        let dir = self.sandboxes.join(&rec.id);
        let pid = read_pid(&dir.join("qemu.pid"))
            .ok_or_else(|| VmError::Refused("the VM has no pid file".into()))?;
        let own = std::fs::read(format!("/proc/{pid}/cmdline"))
            .ctx(|| "reading the VM's command line".into())?;
        let own: Vec<String> = own
            .split(|&b| b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let tdir = dir.join("fork-template");
        // One left by an edge that died mid-capture, still waiting for its migration.
        kill(&tdir.join("qemu.pid"));
        let _ = std::fs::remove_dir_all(&tdir);
        std::fs::create_dir_all(&tdir).ctx(|| format!("creating {}", tdir.display()))?;
        let args = template_args(&own, &dir, &tdir, ram_to)?;
        let (qemu, rest) = args
            .split_first()
            .ok_or_else(|| VmError::Refused("the VM's command line is empty".into()))?;
        let log = std::fs::File::create(tdir.join("qemu.log"))
            .ctx(|| "creating the template's log".into())?;
        let log2 = log.try_clone().ctx(|| "the template's log".into())?;
        let mut cmd = Command::new(qemu);
        cmd.args(rest).stdin(Stdio::null()).stdout(log).stderr(log2);
        // Its NIC's backend: a tap like the VM's (the migrated device wants one with
        // headers), in a namespace of nobody's, on descriptor 3.
        let tap = if info.net {
            Some(net::detached_tap()?)
        } else {
            None
        };
        if let Some(t) = &tap {
            let fd = std::os::fd::AsRawFd::as_raw_fd(t);
            // SAFETY: dup2 between fork and exec onto descriptor 3, which the command line
            // names; the source stays open until the spawn is done.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                    if libc::dup2(fd, 3) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let mut child = cmd.spawn().ctx(|| "starting the template QEMU".into())?;
        drop(tap);
        let said = || {
            let log = std::fs::read_to_string(tdir.join("qemu.log")).unwrap_or_default();
            log.trim().to_string()
        };
        let r = (|| {
            let t0 = Instant::now();
            let mut t = qmp_of_child(&mut child, &tdir.join("vm.qmp"), &tdir.join("qemu.log"))?;
            let (a, b) = std::os::unix::net::UnixStream::pair()
                .ctx(|| "a socket pair for the migration".into())?;
            t.give_fd("dsec-live", &b)?;
            t.execute(
                "migrate-incoming",
                serde_json::json!({ "uri": "fd:dsec-live" }),
            )?;
            let spawned = t0.elapsed();
            let mut q = self.qmp_of(&rec.id)?;
            q.set_ignore_shared(false)?;
            let stalled = q.migrate_live(&a, crate::config::LIVE_FORK_WITHIN)?;
            drop((a, b));
            let migrated = t0.elapsed();
            let state = t.wait_loaded(SAVE_TIMEOUT).map_err(|e| VmError::Template {
                why: e.to_string(),
                said: said(),
            })?;
            if state == "running" {
                return Err(VmError::Template {
                    why: "it ran the migrated VM instead of holding it".into(),
                    said: said(),
                });
            }
            t.set_ignore_shared(true)?;
            t.save(&dest.join("dev"), SAVE_TIMEOUT)?;
            let _ = t.execute("quit", serde_json::Value::Null);
            tracing::info!(
                sandbox = %rec.id,
                template_up_ms = spawned.as_millis() as u64,
                migrated_ms = (migrated - spawned).as_millis() as u64,
                saved_ms = (t0.elapsed() - migrated).as_millis() as u64,
                stalled_ms = stalled,
                "captured live"
            );
            Ok::<u64, VmError>(stalled)
        })();
        let _ = child.kill();
        let _ = child.wait();
        let _ = std::fs::remove_dir_all(&tdir);
        let stalled = r?;
        let kernel = Some(self.boot_files()?.0.version);
        write_json(
            &dest.join("vm.json"),
            &SavedVm::of(info, Some(ram_to), kernel),
        )?;
        Ok(stalled)
    }

    /// [`VmBackend::save`] of a running VM into one `mapped-ram` file, `file` (in the RAM
    /// directory), while the VM runs: it stands still only for its last dirty pages and
    /// its device state (a few ms), then goes on; the file is then sealed
    /// ([`mapped::seal`]) for copies to map. Returns the ms the VM stood still.
    pub(super) fn mapped_save(
        &self,
        rec: &SandboxRecord,
        dest: &Path,
        file: &Path,
    ) -> Result<u64, VmError> {
        let info: VmInfo = read_json(&self.sandboxes.join(&rec.id).join("vm.json"))?;
        let kernel = Some(self.boot_files()?.0.version);
        let out = new_mapped_file(file, info.guest.mem_mb << 20)?;
        let mut q = self.qmp_of(&rec.id)?;
        let t0 = Instant::now();
        let stalled = q.migrate_mapped(&out, crate::config::LIVE_FORK_WITHIN)?;
        let saved_at = t0.elapsed();
        drop(out);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(file)
            .ctx(|| format!("opening {}", file.display()))?;
        mapped::seal(&f, info.guest.mem_mb << 20)?;
        tracing::info!(
            sandbox = %rec.id,
            saved_ms = saved_at.as_millis() as u64,
            sealed_ms = (t0.elapsed() - saved_at).as_millis() as u64,
            stalled_ms = stalled,
            "captured with mapped-ram"
        );
        let mut saved = SavedVm::of(info, Some(file), kernel);
        saved.kind = SavedKind::Mapped;
        write_json(&dest.join("vm.json"), &saved)?;
        Ok(stalled)
    }

    /// See [`Backend::plan_snapshot`]: with `mapped` capture, the snapshot's file is made
    /// now (copies starting early open it) and `dest/vm.json` says it is pending.
    pub(super) fn plan(&self, rec: &SandboxRecord, dest: &Path) -> Result<(), VmError> {
        let info: VmInfo = read_json(&self.sandboxes.join(&rec.id).join("vm.json"))?;
        let kernel = Some(self.boot_files()?.0.version);
        std::fs::create_dir_all(dest).ctx(|| format!("creating {}", dest.display()))?;
        let ram = self
            .ram_dir
            .join(format!("seed-{}-{}.mr", rec.id, crate::random_hex(8)));
        new_mapped_file(&ram, info.guest.mem_mb << 20)?;
        let mut saved = SavedVm::of(info, Some(&ram), kernel);
        saved.kind = SavedKind::Mapped;
        saved.pending = true;
        Ok(write_json(&dest.join("vm.json"), &saved).inspect_err(|_| {
            let _ = std::fs::remove_file(&ram);
        })?)
    }

    pub(super) fn suspended_dir(&self, id: &str) -> PathBuf {
        self.sandboxes.join(id).join(crate::backend::SUSPENDED_DIR)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_vms_read_by_format_and_kind() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("vm.json");
        // As edges wrote it before the format was recorded.
        std::fs::write(
            &p,
            r#"{"disk":"/d","mem_mb":256,"cpus":1,"kind":"shared","ram":"/r"}"#,
        )
        .unwrap();
        let s = read_saved(&p).unwrap();
        assert_eq!((s.format, s.kind), (1, SavedKind::Shared));
        assert_eq!(s.machine, "microvm");
        // What this edge writes reads back the same.
        write_json(&p, &s).unwrap();
        let back = read_saved(&p).unwrap();
        assert_eq!((back.format, back.kind), (SAVED_FORMAT, SavedKind::Shared));
        // A newer format, or a kind this edge does not know, is refused, not misread.
        std::fs::write(
            &p,
            r#"{"format":2,"disk":"/d","mem_mb":256,"cpus":1,"kind":"full"}"#,
        )
        .unwrap();
        let e = read_saved(&p).unwrap_err().to_string();
        assert!(e.contains("format 2") && e.contains("newer edge"), "{e}");
        std::fs::write(
            &p,
            r#"{"disk":"/d","mem_mb":256,"cpus":1,"kind":"sideways"}"#,
        )
        .unwrap();
        assert!(read_saved(&p).is_err());
    }

    #[test]
    fn a_template_has_the_vms_command_line_with_its_own_files() {
        let own: Vec<String> = [
            "/usr/bin/qemu-system-x86_64",
            "-object",
            "memory-backend-file,id=mem,size=256M,mem-path=/dev/shm/dsec-vm/a.ram,share=on",
            "-pidfile",
            "/d/sandboxes/a/qemu.pid",
            "-qmp",
            "unix:/d/sandboxes/a/vm.qmp,server=on,wait=off",
            "-netdev",
            "tap,id=net0,ifname=tap0,script=no,downscript=no",
            "-incoming",
            "defer",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let t = template_args(
            &own,
            Path::new("/d/sandboxes/a"),
            Path::new("/d/sandboxes/a/fork-template"),
            Path::new("/dev/shm/dsec-vm/seed.ram"),
        )
        .unwrap();
        let line = t.join(" ");
        assert!(
            line.contains("mem-path=/dev/shm/dsec-vm/seed.ram,share=on"),
            "{line}"
        );
        assert!(
            line.contains("-pidfile /d/sandboxes/a/fork-template/qemu.pid"),
            "{line}"
        );
        assert!(
            line.contains("unix:/d/sandboxes/a/fork-template/vm.qmp"),
            "{line}"
        );
        assert!(line.contains("-netdev tap,id=net0,fd=3 "), "{line}");
        assert!(!line.contains("ifname=tap0"), "{line}");
        assert!(line.ends_with("-incoming defer -S"), "{line}");
        assert_eq!(line.matches("-incoming").count(), 1, "{line}");
        let no_file: Vec<String> = vec!["qemu".into(), "-m".into(), "256M".into()];
        assert!(
            template_args(&no_file, Path::new("/d"), Path::new("/t"), Path::new("/r")).is_err()
        );
    }
}
