//! A network namespace per microVM (`dsfc-<sandbox id>`), holding the tap device its
//! virtio-net is backed by. Every VM, and every fork copy of one, has the same tap name,
//! host address and guest MAC/IP inside its own namespace: a snapshot records the tap's
//! name and the guest keeps its addresses, so copies need no re-addressing. Firecracker
//! joins the namespace before it starts (see `setns` in the backend), so the tap it opens
//! is this one.
//!
//! The namespace has no uplink yet: a microVM has the same network as a `vm` sandbox
//! (none beyond itself). The namespace-per-copy layout is what an uplink (veth + NAT per
//! namespace, as the container network does) plugs into.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use dsec_common::{IoContext, IoFailure};

use super::jail::RunAs;
use crate::net::NetError;

/// The tap inside every microVM's namespace.
pub const TAP: &str = "fctap0";
/// The guest's interface id in Firecracker's API.
pub const IFACE_ID: &str = "eth0";
/// The guest's MAC address: the same in every VM and copy (each is alone in its namespace).
pub const GUEST_MAC: &str = "06:00:ac:10:00:02";
/// The tap's (host side) address and the guest's, a /30.
pub const HOST_CIDR: &str = "172.16.0.1/30";
pub const GUEST_IP: &str = "172.16.0.2";

/// The namespace of sandbox `id`. Not `dsec-<id>`: that prefix belongs to the container
/// network, whose sweep removes namespaces it does not know.
pub fn name(id: &str) -> String {
    format!("dsfc-{id}")
}

pub fn path(ns: &str) -> PathBuf {
    PathBuf::from("/run/netns").join(ns)
}

pub fn exists(ns: &str) -> bool {
    path(ns).exists()
}

fn ip_batch(ns: Option<&str>, lines: &str) -> Result<(), NetError> {
    let mut cmd = Command::new("ip");
    if let Some(ns) = ns {
        cmd.args(["-n", ns]);
    }
    cmd.args(["-batch", "-"]);
    crate::net::run_with_input(cmd, lines, "ip (install iproute2)")
}

/// Makes the namespace with loopback up and the tap at [`HOST_CIDR`]; on failure removes
/// what it made. An existing namespace of that name is reused (a wake after a pause to
/// disk, whose Firecracker process ended but whose namespace stayed).
pub fn create(ns: &str, owner: Option<RunAs>) -> Result<(), NetError> {
    if exists(ns) && has_tap(ns) {
        return Ok(());
    }
    // A jailed Firecracker has no capabilities: it may attach to the tap only as its owner.
    let owner = owner
        .map(|o| format!(" user {} group {}", o.uid, o.gid))
        .unwrap_or_default();
    let made = ip_batch(None, &format!("netns add {ns}\n")).and_then(|()| {
        ip_batch(
            Some(ns),
            &format!(
                "link set lo up\n\
                 tuntap add dev {TAP} mode tap{owner}\n\
                 addr add {HOST_CIDR} dev {TAP}\n\
                 link set {TAP} up\n"
            ),
        )
    });
    if let Err(e) = made {
        remove(ns);
        return Err(NetError::Config(format!(
            "setting up the microVM's network namespace {ns}: {e}"
        )));
    }
    Ok(())
}

/// Whether the namespace holds the tap.
pub fn has_tap(ns: &str) -> bool {
    Command::new("ip")
        .args(["-n", ns, "link", "show", TAP])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Removes the namespace and the tap in it (idempotent).
pub fn remove(ns: &str) {
    if exists(ns) {
        let _ = Command::new("ip")
            .args(["netns", "del", ns])
            .stderr(Stdio::null())
            .status();
    }
}

/// The namespace's file, for `setns(2)` in the Firecracker process before it execs.
pub fn open(ns: &str) -> Result<File, IoFailure> {
    File::open(path(ns)).ctx(|| format!("opening network namespace {ns}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Removes its namespaces however the test ends.
    struct Guard(Vec<String>);

    impl Drop for Guard {
        fn drop(&mut self) {
            for ns in &self.0 {
                remove(ns);
            }
        }
    }

    fn unique(tag: &str) -> String {
        let mut r = [0u8; 4];
        dsec_common::id::fill_random(&mut r);
        format!("t{tag}-{}", hex::encode(r))
    }

    fn addresses(ns: &str) -> String {
        let out = Command::new("ip")
            .args(["-n", ns, "-o", "addr", "show", "dev", TAP])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    #[test]
    fn each_copy_gets_a_namespace_with_the_same_tap_and_address() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: making network namespaces needs root");
            return;
        }
        let (a, b) = (name(&unique("a")), name(&unique("b")));
        let guard = Guard(vec![a.clone(), b.clone()]);
        create(&a, None).unwrap();
        create(&b, None).unwrap();
        for ns in [&a, &b] {
            assert!(exists(ns), "{ns} missing");
            assert!(has_tap(ns), "{ns} has no {TAP}");
            let addrs = addresses(ns);
            assert!(addrs.contains(HOST_CIDR), "{ns}: {addrs}");
            open(ns).unwrap();
        }
        // Idempotent for a namespace that is already complete.
        create(&a, None).unwrap();
        remove(&a);
        assert!(!exists(&a) && exists(&b));
        remove(&b);
        assert!(!exists(&b));
        remove(&b);
        drop(guard);
    }
}
