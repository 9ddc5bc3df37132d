//! A sandbox's network namespace and veth pair, made in-process over rtnetlink
//! ([`super::rtnl`]): the namespace `dsec-<id>` (pinned at `/run/dsec/netns/dsec-<id>` in
//! the sandboxes' mount namespace; the OCI runtime joins it at [`netns_path`]), `eth0`
//! inside with the sandbox's address and a default route, `dsv<k>` on the node, and the
//! namespace's own DNS guard ([`super::guard`]).
//!
//! Each sandbox has an address of its own (the second of a /30 of the pool); the node's
//! side has none. Every sandbox's gateway is the pool's first address, held once by the
//! node's loopback ([`install_gateway`]), and every `dsv<k>` has the same hardware
//! address, which each sandbox knows for its gateway from the start (a permanent
//! neighbour entry: no ARP, whatever the node's `arp_ignore`); the node reaches a sandbox
//! by a /32 route out of its `dsv<k>`. An address
//! per sandbox on the node's side would make every address added on the node walk all
//! the others (the kernel's lifetime check), and cost four routes instead of one.

use std::net::Ipv4Addr;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::netlink::NetlinkError;
use super::nft::IFACE_PREFIX;
use super::rtnl::{self, Rtnl};
use super::rules::Cidr;

/// A sandbox's addresses: its gateway (the node's, the same for every sandbox) and its
/// own (`ip`).
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
            gateway: gateway(pool),
            ip: Ipv4Addr::from(base + index * 4 + 2),
        })
    }

    /// How many sandboxes a pool holds.
    pub fn capacity(pool: &Cidr) -> u32 {
        ((1u64 << (32 - pool.prefix as u64)) / 4).min(u32::MAX as u64) as u32
    }
}

/// The hardware address of the node's side of every sandbox's veth (locally
/// administered, unicast).
pub const GATEWAY_MAC: [u8; 6] = [0x02, 0xd5, 0xec, 0x00, 0x00, 0x01];

/// The sandboxes' gateway: the pool's first address (never a sandbox's, whose addresses
/// are the second of each /30).
pub fn gateway(pool: &Cidr) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(pool.addr) + 1)
}

/// Puts the sandboxes' gateway on the node's loopback (it may be there already).
pub fn install_gateway(pool: &Cidr) -> Result<(), NetlinkError> {
    let gw = gateway(pool);
    let mut r = Rtnl::open()?;
    let lo = rtnl::index("lo")?;
    match r.add_address(lo, gw, 32) {
        Err(e) if e.errno() != Some(libc::EEXIST) => Err(e),
        _ => Ok(()),
    }
}

/// Takes the sandboxes' gateway off the node's loopback (the last sandbox is gone).
pub fn remove_gateway(pool: &Cidr) {
    let gw = gateway(pool);
    let gone = Rtnl::open().and_then(|mut r| r.delete_address(rtnl::index("lo")?, gw, 32));
    if let Err(e) = gone {
        tracing::warn!("taking the sandboxes' gateway {gw} off lo: {e}");
    }
}

pub fn netns_name(id: &str) -> String {
    format!("dsec-{id}")
}

/// Where the host opens sandbox `id`'s network namespace.
pub fn netns_path(id: &str) -> Result<PathBuf, NetlinkError> {
    rtnl::netns_path(&netns_name(id))
}

pub fn host_iface(k: &str) -> String {
    format!("{IFACE_PREFIX}{k}")
}

/// Makes the namespace and the veth pair; on failure removes what it made.
pub fn create(id: &str, k: &str, slot: &Slot) -> Result<(), super::NetError> {
    let made = (|| -> Result<(), NetlinkError> {
        let ns = rtnl::create_netns(&netns_name(id))?;
        let host = host_iface(k);
        let mut r = Rtnl::open()?;
        r.add_veth(&host, GATEWAY_MAC, "eth0", ns.as_fd())?;
        let i = rtnl::index(&host)?;
        // IPv6 off on the node's side before it comes up. Sandboxes are reached over IPv4
        // only; with IPv6 on, each pair would add its link-local and multicast routes to
        // the node's one IPv6 table, all under the same prefixes, so route lookups and
        // every link coming up (which walks the table) would cost more with each sandbox,
        // and each sandbox's own solicitations and reports would be routed there too.
        rtnl::disable_ipv6(&host)?;
        r.set_up(i)?;
        r.add_host_route(i, slot.ip, slot.gateway)?;
        let (ip, gw) = (slot.ip, slot.gateway);
        rtnl::in_netns(&ns, move || {
            let mut r = Rtnl::open()?;
            r.set_up(rtnl::index("lo")?)?;
            // eth0 came with IPv6 off (the namespace's default, see `create_netns`):
            // it has nowhere to reach over IPv6, and with it on, each new sandbox would send
            // solicitations and listener reports, and run address timers, for seconds. Its
            // loopback keeps `::1`, which `localhost` may resolve to.
            let eth0 = rtnl::index("eth0")?;
            r.add_address(eth0, ip, 32)?;
            r.set_up(eth0)?;
            r.add_neighbour(eth0, gw, GATEWAY_MAC)?;
            r.add_default_route(eth0, gw)?;
            super::guard::install_here()
        })
    })();
    if let Err(e) = made {
        remove(id, k);
        return Err(super::NetError::Setup(e));
    }
    Ok(())
}

/// Removes the namespace and the veth pair; either may already be gone. Deleting the
/// namespace takes the pair with it (the kernel tears it down once nothing uses it), which
/// spares the slow synchronous link delete on the node side.
pub fn remove(id: &str, k: &str) {
    if Path::new(rtnl::NETNS_DIR).join(netns_name(id)).exists() {
        if let Err(e) = rtnl::delete_netns(&netns_name(id)) {
            tracing::warn!(sandbox = %id, "removing its network namespace: {e}");
        }
    } else if let Ok(mut r) = Rtnl::open() {
        let _ = r.delete_link(&host_iface(k));
    }
}

/// Namespaces `dsec-<id>` present on the node (from [`rtnl::NETNS_DIR`]).
pub fn namespaces() -> Vec<String> {
    std::fs::read_dir(rtnl::NETNS_DIR)
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
    fn slots_are_disjoint_slash_30s_inside_the_pool_behind_one_gateway() {
        let pool = Cidr::parse("10.200.0.0/16").unwrap();
        let s0 = Slot::in_pool(&pool, 0).unwrap();
        assert_eq!(
            (s0.gateway.to_string(), s0.ip.to_string()),
            ("10.200.0.1".into(), "10.200.0.2".into())
        );
        let s5 = Slot::in_pool(&pool, 5).unwrap();
        assert_eq!(s5.ip.to_string(), "10.200.0.22");
        assert_eq!(s5.gateway, s0.gateway);
        assert_eq!(Slot::capacity(&pool), 16384);
        assert!(Slot::in_pool(&pool, 16383).is_some());
        assert!(Slot::in_pool(&pool, 16384).is_none());
    }
}
