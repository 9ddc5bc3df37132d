//! What the backend asks Firecracker's API, in order: the boot sequence (machine, boot
//! source, drives, the NIC, vsock, start), a snapshot load, pause, resume and snapshot
//! calls, each sending only the fields the probed version knows.

use std::path::{Path, PathBuf};

use super::api::{self, Client};
use super::probe::Capabilities;
use super::*;

/// What a boot sends Firecracker, in order (see [`boot_calls`]).
#[derive(Debug, Clone)]
pub struct BootPlan {
    pub vcpus: u64,
    pub mem_mb: u64,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub boot_args: String,
    /// The root disks, top first.
    pub disks: Vec<PathBuf>,
    pub vsock_uds: PathBuf,
    pub track_dirty_pages: bool,
}

/// Configures a fresh Firecracker process and starts the guest.
pub fn boot_calls(c: &Client, caps: &Capabilities, p: &BootPlan) -> Result<(), api::ApiCallError> {
    c.put(
        "/machine-config",
        &api::MachineConfig {
            vcpu_count: p.vcpus,
            mem_size_mib: p.mem_mb,
            smt: false,
            track_dirty_pages: p.track_dirty_pages,
        },
    )?;
    c.put(
        "/boot-source",
        &api::BootSource {
            kernel_image_path: p.kernel.clone(),
            boot_args: p.boot_args.clone(),
            initrd_path: Some(p.initrd.clone()),
        },
    )?;
    // Not root devices: the initramfs mounts them (read-only, under the overlay), in
    // this order, which is the guest's.
    for (i, disk) in p.disks.iter().enumerate() {
        let id = guest::disk_serial(i);
        c.put(
            &format!("/drives/{id}"),
            &api::Drive {
                drive_id: id.clone(),
                path_on_host: disk.clone(),
                is_root_device: false,
                is_read_only: true,
            },
        )?;
    }
    c.put(
        &format!("/network-interfaces/{}", netns::IFACE_ID),
        &api::NetworkInterface {
            iface_id: netns::IFACE_ID.into(),
            host_dev_name: netns::TAP.into(),
            guest_mac: netns::GUEST_MAC.into(),
            mtu: caps.net_mtu.then_some(1500),
        },
    )?;
    c.put(
        "/vsock",
        &api::Vsock {
            guest_cid: GUEST_CID,
            uds_path: p.vsock_uds.clone(),
        },
    )?;
    // Entropy from the host, so getrandom() in a fresh guest does not block.
    if caps.entropy {
        c.put("/entropy", &api::Entropy {})?;
    }
    c.put(
        "/actions",
        &api::Action {
            action_type: api::ActionType::InstanceStart,
        },
    )?;
    Ok(())
}

/// Loads a snapshot into a fresh Firecracker process and runs it: the memory file mapped
/// private (copy-on-write), this VM's own vsock socket.
pub fn load_calls(
    c: &Client,
    caps: &Capabilities,
    vmstate: &Path,
    mem: &Path,
    vsock_uds: &Path,
    track_dirty_pages: bool,
) -> Result<(), api::ApiCallError> {
    c.put(
        "/snapshot/load",
        &api::SnapshotLoad {
            snapshot_path: vmstate.to_path_buf(),
            mem_backend: api::MemBackend {
                backend_type: api::MemBackendType::File,
                backend_path: mem.to_path_buf(),
            },
            track_dirty_pages: (caps.load_track_dirty_pages && track_dirty_pages).then_some(true),
            resume_vm: true,
            // Same tap name in every copy's namespace: nothing to rewrite.
            network_overrides: None,
            vsock_override: caps.vsock_override.then(|| api::VsockOverride {
                uds_path: vsock_uds.to_path_buf(),
            }),
        },
    )
    .map(drop)
}

pub fn pause_call(c: &Client) -> Result<(), api::ApiCallError> {
    c.patch(
        "/vm",
        &api::Vm {
            state: api::RunState::Paused,
        },
    )
    .map(drop)
}

pub fn resume_call(c: &Client) -> Result<(), api::ApiCallError> {
    c.patch(
        "/vm",
        &api::Vm {
            state: api::RunState::Resumed,
        },
    )
    .map(drop)
}

/// Whether the VM is paused by the API (`GET /`: `"state": "Paused"`).
pub fn api_paused(c: &Client) -> Result<bool, api::ApiCallError> {
    Ok(c.get("/")?.get("state").and_then(|v| v.as_str()) == Some("Paused"))
}

/// Writes a snapshot of a paused VM.
pub fn snapshot_call(
    c: &Client,
    kind: api::SnapshotType,
    vmstate: &Path,
    mem: &Path,
) -> Result<(), api::ApiCallError> {
    c.put(
        "/snapshot/create",
        &api::SnapshotCreate {
            snapshot_type: kind,
            snapshot_path: vmstate.to_path_buf(),
            mem_file_path: mem.to_path_buf(),
        },
    )
    .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::microvm::api::fake::{Seen, Server};
    use crate::backend::microvm::probe::Version;
    use serde_json::json;

    fn call(method: &str, path: &str, body: serde_json::Value) -> Seen {
        Seen {
            method: method.into(),
            path: path.into(),
            body,
        }
    }

    fn plan() -> BootPlan {
        BootPlan {
            vcpus: 2,
            mem_mb: 640,
            kernel: "/store/guest/kernel-6.1/vmlinux".into(),
            initrd: "/store/guest/kernel-6.1/initramfs-ab.cpio.gz".into(),
            boot_args: "console=ttyS0 dsec.channel=vsock".into(),
            disks: vec![
                "/store/guest/disks/stage-k.erofs".into(),
                "/store/erofs/l.img".into(),
            ],
            vsock_uds: "/state/sandboxes/local-a/fc.vsock".into(),
            track_dirty_pages: false,
        }
    }

    #[test]
    fn boot_sends_each_call_with_its_exact_body() {
        let srv = Server::start(&[]);
        let caps = Capabilities::of(Version::new(1, 16, 1));
        boot_calls(&srv.client(), &caps, &plan()).unwrap();
        assert_eq!(
            srv.calls(),
            vec![
                call(
                    "PUT",
                    "/machine-config",
                    json!({"vcpu_count": 2, "mem_size_mib": 640, "smt": false, "track_dirty_pages": false})
                ),
                call(
                    "PUT",
                    "/boot-source",
                    json!({
                        "kernel_image_path": "/store/guest/kernel-6.1/vmlinux",
                        "boot_args": "console=ttyS0 dsec.channel=vsock",
                        "initrd_path": "/store/guest/kernel-6.1/initramfs-ab.cpio.gz"
                    })
                ),
                call(
                    "PUT",
                    "/drives/dsec_l0",
                    json!({
                        "drive_id": "dsec_l0",
                        "path_on_host": "/store/guest/disks/stage-k.erofs",
                        "is_root_device": false,
                        "is_read_only": true
                    })
                ),
                call(
                    "PUT",
                    "/drives/dsec_l1",
                    json!({
                        "drive_id": "dsec_l1",
                        "path_on_host": "/store/erofs/l.img",
                        "is_root_device": false,
                        "is_read_only": true
                    })
                ),
                call(
                    "PUT",
                    "/network-interfaces/eth0",
                    json!({
                        "iface_id": "eth0",
                        "host_dev_name": "fctap0",
                        "guest_mac": "06:00:ac:10:00:02",
                        "mtu": 1500
                    })
                ),
                call(
                    "PUT",
                    "/vsock",
                    json!({"guest_cid": 3, "uds_path": "/state/sandboxes/local-a/fc.vsock"})
                ),
                call("PUT", "/entropy", json!({})),
                call("PUT", "/actions", json!({"action_type": "InstanceStart"})),
            ]
        );
    }

    #[test]
    fn fields_a_version_does_not_know_are_left_out() {
        let srv = Server::start(&[]);
        // 1.15 has no `mtu`, and no `vsock_override` on load.
        let caps = Capabilities::of(Version::new(1, 15, 0));
        boot_calls(&srv.client(), &caps, &plan()).unwrap();
        load_calls(
            &srv.client(),
            &caps,
            Path::new("/seed/vmstate"),
            Path::new("/ram/seed.mem"),
            Path::new("/copy/fc.vsock"),
            true,
        )
        .unwrap();
        let calls = srv.calls();
        let net = calls
            .iter()
            .find(|c| c.path == "/network-interfaces/eth0")
            .unwrap();
        assert!(net.body.get("mtu").is_none(), "{}", net.body);
        let load = calls.last().unwrap();
        assert_eq!(
            load.body,
            json!({
                "snapshot_path": "/seed/vmstate",
                "mem_backend": {"backend_type": "File", "backend_path": "/ram/seed.mem"},
                "track_dirty_pages": true,
                "resume_vm": true
            })
        );
    }

    #[test]
    fn pause_snapshot_resume_and_load_send_what_firecracker_expects() {
        let srv = Server::start(&[]);
        let c = srv.client();
        let caps = Capabilities::of(Version::new(1, 16, 1));
        pause_call(&c).unwrap();
        snapshot_call(
            &c,
            api::SnapshotType::Full,
            Path::new("/seed/vmstate"),
            Path::new("/ram/seed.mem"),
        )
        .unwrap();
        snapshot_call(
            &c,
            api::SnapshotType::Diff,
            Path::new("/seed/vmstate"),
            Path::new("/ram/seed.diff"),
        )
        .unwrap();
        resume_call(&c).unwrap();
        load_calls(
            &c,
            &caps,
            Path::new("/seed/vmstate"),
            Path::new("/ram/seed.mem"),
            Path::new("/copy/fc.vsock"),
            false,
        )
        .unwrap();
        assert_eq!(
            srv.calls(),
            vec![
                call("PATCH", "/vm", json!({"state": "Paused"})),
                call(
                    "PUT",
                    "/snapshot/create",
                    json!({"snapshot_type": "Full", "snapshot_path": "/seed/vmstate", "mem_file_path": "/ram/seed.mem"})
                ),
                call(
                    "PUT",
                    "/snapshot/create",
                    json!({"snapshot_type": "Diff", "snapshot_path": "/seed/vmstate", "mem_file_path": "/ram/seed.diff"})
                ),
                call("PATCH", "/vm", json!({"state": "Resumed"})),
                call(
                    "PUT",
                    "/snapshot/load",
                    json!({
                        "snapshot_path": "/seed/vmstate",
                        "mem_backend": {"backend_type": "File", "backend_path": "/ram/seed.mem"},
                        "resume_vm": true,
                        "vsock_override": {"uds_path": "/copy/fc.vsock"}
                    })
                ),
            ]
        );
    }

    #[test]
    fn a_refused_call_stops_the_boot_with_firecrackers_reason() {
        let srv = Server::start(&[(
            "PUT /boot-source",
            "Invalid kernel path: No such file or directory (os error 2)",
        )]);
        let caps = Capabilities::of(Version::new(1, 16, 1));
        let e = boot_calls(&srv.client(), &caps, &plan()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "Firecracker refused PUT /boot-source (400): Invalid kernel path: No such file or directory (os error 2)"
        );
        // Nothing after the refused call was sent.
        assert_eq!(srv.calls().len(), 2);
    }
}
