//! A sandbox's network namespace and veth pair, made with iproute2 batches: the namespace
//! `dsec-<id>` (at `/run/netns/dsec-<id>`, which the OCI runtime joins), `eth0` inside with
//! the sandbox's address and a default route, `dsv<k>` on the node with the gateway
//! address, and the namespace's own DNS guard ([`super::guard`]). Each sandbox has a /30
//! of the pool.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use super::nft::IFACE_PREFIX;
use super::rules::Cidr;

/// A sandbox's addresses: the node side (`gateway`) and its own (`ip`), a /30.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub index: u32,
    pub gateway: Ipv4Addr,
    pub ip: Ipv4Addr,
}

impl Slot {
    pub fn in_pool(pool: &Cidr, index: u32) -> Option<Slot> {
        let base = u32::from(pool.addr);
        let size = 1u64 << (32 - pool.prefix as u64);
        if (index as u64 + 1) * 4 > size {
            return None;
        }
        Some(Slot {
            index,
            gateway: Ipv4Addr::from(base + index * 4 + 1),
            ip: Ipv4Addr::from(base + index * 4 + 2),
        })
    }

    /// How many sandboxes a pool holds.
    pub fn capacity(pool: &Cidr) -> u32 {
        ((1u64 << (32 - pool.prefix as u64)) / 4).min(u32::MAX as u64) as u32
    }
}

pub fn netns_name(id: &str) -> String {
    format!("dsec-{id}")
}

pub fn netns_path(id: &str) -> PathBuf {
    PathBuf::from("/run/netns").join(netns_name(id))
}

pub fn host_iface(k: &str) -> String {
    format!("{IFACE_PREFIX}{k}")
}

fn ip_batch(netns: Option<&str>, lines: &str) -> Result<(), String> {
    let mut cmd = Command::new("ip");
    if let Some(ns) = netns {
        cmd.args(["-n", ns]);
    }
    cmd.args(["-batch", "-"]);
    super::run_with_input(cmd, lines, "ip (install iproute2)").map_err(|e| format!("ip: {e}"))
}

/// Makes the namespace and the veth pair; on failure removes what it made.
pub fn create(id: &str, k: &str, slot: &Slot) -> Result<(), String> {
    let ns = netns_name(id);
    let host = host_iface(k);
    let made = ip_batch(
        None,
        &format!(
            "netns add {ns}\n\
             link add name {host} type veth peer name eth0 netns {ns}\n\
             addr add {gw}/30 dev {host}\n\
             link set {host} up\n",
            gw = slot.gateway
        ),
    )
    .and_then(|()| {
        ip_batch(
            Some(&ns),
            &format!(
                "link set lo up\n\
                 addr add {ip}/30 dev eth0\n\
                 link set eth0 up\n\
                 route add default via {gw}\n",
                ip = slot.ip,
                gw = slot.gateway
            ),
        )
    })
    .and_then(|()| super::guard::install(&netns_path(id)));
    if let Err(e) = made {
        remove(id, k);
        return Err(format!("setting up the sandbox's network: {e}"));
    }
    Ok(())
}

/// Removes the namespace and the veth pair; either may already be gone. Deleting the
/// namespace takes the pair with it (the kernel tears it down once nothing uses it), which
/// spares the slow synchronous link delete on the node side.
pub fn remove(id: &str, k: &str) {
    if netns_path(id).exists() {
        let _ = Command::new("ip")
            .args(["netns", "del", &netns_name(id)])
            .stderr(Stdio::null())
            .status();
    } else {
        let _ = Command::new("ip")
            .args(["link", "del", &host_iface(k)])
            .stderr(Stdio::null())
            .status();
    }
}

/// Namespaces `dsec-<id>` present on the node (from `/run/netns`).
pub fn namespaces() -> Vec<String> {
    std::fs::read_dir("/run/netns")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| {
                    e.file_name()
                        .to_str()?
                        .strip_prefix("dsec-")
                        .map(String::from)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Sandbox interfaces (`dsv<k>`) in this network namespace, as their `<k>` (asked over
/// netlink: `/sys/class/net` may show another namespace's).
pub fn interfaces() -> Vec<String> {
    let Ok(out) = Command::new("ip").args(["-o", "link", "show"]).output() else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let name = l.split(": ").nth(1)?;
            let name = name.split('@').next()?;
            name.strip_prefix(IFACE_PREFIX).map(String::from)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_disjoint_slash_30s_inside_the_pool() {
        let pool = Cidr::parse("10.200.0.0/16").unwrap();
        let s0 = Slot::in_pool(&pool, 0).unwrap();
        assert_eq!(
            (s0.gateway.to_string(), s0.ip.to_string()),
            ("10.200.0.1".into(), "10.200.0.2".into())
        );
        let s5 = Slot::in_pool(&pool, 5).unwrap();
        assert_eq!(s5.ip.to_string(), "10.200.0.22");
        assert_eq!(Slot::capacity(&pool), 16384);
        assert!(Slot::in_pool(&pool, 16383).is_some());
        assert!(Slot::in_pool(&pool, 16384).is_none());
    }
}
