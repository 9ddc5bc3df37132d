//! A VM's network: QEMU runs inside the sandbox's network namespace (`dsec-<id>`, made by
//! the edge's network module like a container's, with the sandbox's address on `eth0`) and
//! gives the guest a tap device there. The guest has the same address in every VM and
//! every fork copy ([`GUEST_CIDR`], told on the kernel command line); the namespace
//! translates it to the sandbox's address on the way out, and sends DNS to the node's
//! proxy, so the node's egress rules and DNS policy hold for a VM as for a container.

use std::net::Ipv4Addr;

use dsec_common::{IoContext, IoFailure};

use crate::net::{NetError, NetlinkError};

/// The guest's side and the namespace's side of the tap.
pub const GUEST_CIDR: &str = "172.16.0.2/30";
pub const TAP_ADDR: &str = "172.16.0.1";
pub const TAP: &str = "tap0";
/// One MAC for every guest and one for every tap (each VM is alone on its tap): a fork
/// copy's guest still has the tap's MAC in its ARP cache from the source's.
pub const GUEST_MAC: &str = "52:54:00:d5:ec:02";
pub const TAP_MAC: &str = "52:54:00:d5:ec:01";

/// [`TAP_ADDR`] as an address.
fn tap_ip() -> Ipv4Addr {
    TAP_ADDR.parse().unwrap_or(Ipv4Addr::UNSPECIFIED)
}

/// The kernel command line's `dsec.net=` value.
pub fn cmdline() -> String {
    format!("dsec.net={GUEST_CIDR},{TAP_ADDR}")
}

/// `aa:bb:…` as bytes.
fn mac_bytes(mac: &str) -> [u8; 6] {
    let mut out = [0u8; 6];
    for (o, part) in out.iter_mut().zip(mac.split(':')) {
        *o = u8::from_str_radix(part, 16).unwrap_or(0);
    }
    out
}

// From <linux/if_tun.h>.
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETPERSIST: libc::c_ulong = 0x4004_54cb;
const TUNSETOWNER: libc::c_ulong = 0x4004_54cc;
const TUNSETGROUP: libc::c_ulong = 0x4004_54ce;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;

/// A persistent tap `name` in the calling thread's namespace (as `ip tuntap add`), which
/// `owner` may attach to.
fn add_tap(name: &str, owner: Option<(u32, u32)>) -> Result<(), IoFailure> {
    use std::os::fd::AsRawFd;
    let tun = open_tap(name, IFF_TAP | IFF_NO_PI)?;
    let fd = tun.as_raw_fd();
    let check = |r: libc::c_int, what: &str| {
        if r < 0 {
            Err(IoFailure::last_os(format!("tap {name}: {what}")))
        } else {
            Ok(())
        }
    };
    // SAFETY: TUN ioctls on a descriptor we own, with an ifreq or an integer argument.
    unsafe {
        if let Some((uid, gid)) = owner {
            check(libc::ioctl(fd, TUNSETOWNER, uid as libc::c_ulong), "owner")?;
            check(libc::ioctl(fd, TUNSETGROUP, gid as libc::c_ulong), "group")?;
        }
        check(
            libc::ioctl(fd, TUNSETPERSIST, 1 as libc::c_ulong),
            "keeping it",
        )?;
    }
    Ok(())
}

/// A tap with virtio-net headers that no namespace of the node holds: made on a thread
/// that first moved into a network namespace of its own, which goes when the returned
/// descriptor closes (the tap is not persistent). For a template QEMU taking a live
/// migration, whose NIC needs a backend like the VM's (a tap with headers) but must not
/// touch the VM's own tap.
pub fn detached_tap() -> Result<std::fs::File, IoFailure> {
    const IFF_VNET_HDR: libc::c_short = 0x4000;
    std::thread::Builder::new()
        .name("dsec-scratch-tap".into())
        .spawn(|| {
            // SAFETY: unshare on this thread only, which ends right after.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                return Err(IoFailure::last_os("a network namespace for a scratch tap"));
            }
            open_tap(TAP, IFF_TAP | IFF_NO_PI | IFF_VNET_HDR)
        })
        .ctx(|| "a thread for a scratch tap".into())?
        .join()
        .map_err(|_| {
            IoFailure::new(
                "a scratch tap",
                std::io::Error::other("its thread panicked"),
            )
        })?
}

/// Opens (creating it if needed) tap `name` with `flags` in the calling thread's
/// namespace.
fn open_tap(name: &str, flags: libc::c_short) -> Result<std::fs::File, IoFailure> {
    use std::os::fd::AsRawFd;
    let tun = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .ctx(|| "opening /dev/net/tun".into())?;
    // SAFETY: an all-zero ifreq is valid; the name is copied in below, NUL-terminated.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    if name.len() >= ifr.ifr_name.len() {
        return Err(IoFailure::new(
            format!("tap name {name:?}"),
            std::io::Error::from(std::io::ErrorKind::InvalidFilename),
        ));
    }
    for (d, s) in ifr.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    ifr.ifr_ifru.ifru_flags = flags;
    // SAFETY: TUNSETIFF on a descriptor we own, with an ifreq.
    if unsafe { libc::ioctl(tun.as_raw_fd(), TUNSETIFF, &mut ifr) } < 0 {
        return Err(IoFailure::last_os(format!("tap {name}: creating")));
    }
    Ok(tun)
}

/// Makes the tap and the translation in namespace `ns`, in-process (a thread that joins
/// it: netlink for the link, one nf_tables batch for the table), since a fork of many
/// copies does this for each. Idempotent: a VM resumed from disk finds the tap there, and
/// the table is replaced as one transaction. `node_side` is the gateway address of the
/// sandbox's veth.
pub fn setup(ns: &str, node_side: &str) -> Result<(), NetError> {
    setup_tap(ns, node_side, TAP, None)
}

/// [`setup`] with the tap's name and, for a VMM that runs unprivileged (Firecracker in
/// its jail), the user and group that may attach to it.
pub fn setup_tap(
    ns: &str,
    node_side: &str,
    tap: &str,
    owner: Option<(u32, u32)>,
) -> Result<(), NetError> {
    use crate::net::rtnl;
    let path = rtnl::netns_path(ns)?;
    let f = std::fs::File::open(&path).ctx(|| format!("opening network namespace {ns}"))?;
    setup_in(&f, node_side, tap, owner).map_err(|source| NetError::VmNetwork {
        ns: ns.into(),
        source,
    })
}

/// [`setup_tap`] in the namespace `ns` (an open namespace file).
fn setup_in(
    ns: &std::fs::File,
    node_side: &str,
    tap: &str,
    owner: Option<(u32, u32)>,
) -> Result<(), NetlinkError> {
    use crate::net::rtnl;
    let node_side: Ipv4Addr = node_side.parse().map_err(|_| {
        NetlinkError::Other(format!(
            "the sandbox's gateway {node_side:?} is not an IPv4 address"
        ))
    })?;
    let tap = tap.to_string();
    rtnl::in_netns(ns, move || {
        if rtnl::index(&tap).is_err() {
            add_tap(&tap, owner)?;
            let index = rtnl::index(&tap)?;
            let mut rt = rtnl::Rtnl::open()?;
            rt.set_mac(index, mac_bytes(TAP_MAC))?;
            rt.add_address(index, tap_ip(), 30)?;
            rt.set_up(index)?;
        }
        rtnl::write_sysctl("net/ipv4/ip_forward", "1").ctx(|| "turning on forwarding".into())?;
        let (batch, n) = nat_batch(node_side, &tap);
        crate::net::nfnl::transact(&batch, 1, n, |i| {
            format!("message {} of the VM's NAT table", i + 1)
        })
    })
}

/// The namespace's NAT, as one nf_tables transaction that first drops any earlier copy
/// of the table (so setting up twice leaves one): the guest's traffic leaves as the
/// sandbox's address, its DNS goes to the node side of the sandbox's veth (where the node
/// redirects it to the proxy). In `nft` terms:
///
/// ```text
/// table ip dsecvm {
///   chain pre { type nat hook prerouting priority dstnat;
///     iifname "tap0" ip daddr 172.16.0.1 meta l4proto tcp th dport 53 dnat to NODE_SIDE
///     iifname "tap0" ip daddr 172.16.0.1 meta l4proto udp th dport 53 dnat to NODE_SIDE }
///   chain post { type nat hook postrouting priority srcnat;
///     oifname "eth0" masquerade }
/// }
/// ```
fn nat_batch(node_side: Ipv4Addr, tap: &str) -> (Vec<u8>, u32) {
    use crate::net::nfnl::{
        self, Msg, NF_ACCEPT, NF_INET_PRE_ROUTING, NFT_MSG_NEWCHAIN, NFT_MSG_NEWRULE,
        NFT_MSG_NEWTABLE, NFT_PAYLOAD_NETWORK_HEADER, NFT_PAYLOAD_TRANSPORT_HEADER, NFT_REG_1,
        NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_REQUEST, cmp_eq, payload,
    };
    // From <linux/netfilter/nf_tables.h>, <linux/netfilter.h>.
    const NFPROTO_IPV4: u8 = 2;
    const NFT_MSG_DELTABLE: u16 = 2;
    const NF_INET_POST_ROUTING: u32 = 4;
    const NF_IP_PRI_NAT_DST: i32 = -100;
    const NF_IP_PRI_NAT_SRC: i32 = 100;
    const NFT_META_IIFNAME: u32 = 6;
    const NFT_META_OIFNAME: u32 = 7;
    const NFT_META_L4PROTO: u32 = 16;
    const NFT_NAT_DNAT: u32 = 1;
    const IFNAMSIZ: usize = 16;

    fn meta(m: &mut Msg, key: u32) {
        m.expr("meta", |m| {
            m.u32(2, key).u32(1, NFT_REG_1); // NFTA_META_KEY, NFTA_META_DREG
        });
    }
    fn ifname(name: &str) -> Vec<u8> {
        let mut v = name.as_bytes().to_vec();
        v.resize(IFNAMSIZ, 0);
        v
    }

    const TABLE: &str = "dsecvm";
    nfnl::batch(1, |out| {
        let mut seq = 1;
        let mut next = || {
            seq += 1;
            seq
        };
        let create = NLM_F_REQUEST | NLM_F_CREATE | NLM_F_ACK;
        // Make sure it is there, then delete it (as `nft -f` does with `table x {}` and
        // `delete table x`: kernels before 6.3 have no "destroy if there").
        for kind in [NFT_MSG_NEWTABLE, NFT_MSG_DELTABLE] {
            let mut m = Msg::new(kind, create, next(), NFPROTO_IPV4);
            m.str(1, TABLE);
            m.finish(out);
        }
        let mut table = Msg::new(NFT_MSG_NEWTABLE, create, next(), NFPROTO_IPV4);
        table.str(1, TABLE);
        table.finish(out);
        for (chain, hook, prio) in [
            ("pre", NF_INET_PRE_ROUTING, NF_IP_PRI_NAT_DST),
            ("post", NF_INET_POST_ROUTING, NF_IP_PRI_NAT_SRC),
        ] {
            let mut c = Msg::new(NFT_MSG_NEWCHAIN, create, next(), NFPROTO_IPV4);
            c.str(1, TABLE).str(3, chain);
            c.open(4).u32(1, hook).u32(2, prio as u32).close(); // NFTA_CHAIN_HOOK
            c.u32(5, NF_ACCEPT).str(7, "nat"); // NFTA_CHAIN_POLICY, NFTA_CHAIN_TYPE
            c.finish(out);
        }
        for proto in [libc::IPPROTO_TCP as u8, libc::IPPROTO_UDP as u8] {
            let mut r = Msg::new(NFT_MSG_NEWRULE, create | NLM_F_APPEND, next(), NFPROTO_IPV4);
            r.str(1, TABLE).str(2, "pre");
            r.open(4); // NFTA_RULE_EXPRESSIONS
            meta(&mut r, NFT_META_IIFNAME);
            cmp_eq(&mut r, &ifname(tap));
            payload(&mut r, NFT_PAYLOAD_NETWORK_HEADER, 16, 4); // ip daddr
            cmp_eq(&mut r, &tap_ip().octets());
            meta(&mut r, NFT_META_L4PROTO);
            cmp_eq(&mut r, &[proto]);
            payload(&mut r, NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2); // th dport
            cmp_eq(&mut r, &53u16.to_be_bytes());
            r.expr("immediate", |m| {
                m.u32(1, NFT_REG_1); // NFTA_IMMEDIATE_DREG
                m.open(2).attr(1, &node_side.octets()).close(); // { NFTA_DATA_VALUE }
            });
            r.expr("nat", |m| {
                m.u32(1, NFT_NAT_DNAT) // NFTA_NAT_TYPE
                    .u32(2, NFPROTO_IPV4 as u32) // NFTA_NAT_FAMILY
                    .u32(3, NFT_REG_1); // NFTA_NAT_REG_ADDR_MIN
            });
            r.close();
            r.finish(out);
        }
        let mut r = Msg::new(NFT_MSG_NEWRULE, create | NLM_F_APPEND, next(), NFPROTO_IPV4);
        r.str(1, TABLE).str(2, "post");
        r.open(4);
        meta(&mut r, NFT_META_OIFNAME);
        cmp_eq(&mut r, &ifname("eth0"));
        r.expr("masq", |_| {});
        r.close();
        r.finish(out);
        seq - 1
    })
}

/// QEMU's arguments for the guest's network device (`bus`: `device` or `pci`).
pub fn qemu_args(bus: &str) -> [String; 4] {
    [
        "-netdev".into(),
        format!("tap,id=net0,ifname={TAP},script=no,downscript=no"),
        "-device".into(),
        format!("virtio-net-{bus},netdev=net0,mac={GUEST_MAC}"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nat_names_the_tap_and_the_node_side() {
        let (b, n) = nat_batch("10.200.0.5".parse().unwrap(), TAP);
        assert_eq!(n, 8, "table, delete, table, two chains, three rules");
        let has = |needle: &[u8]| b.windows(needle.len()).any(|w| w == needle);
        assert!(has(b"tap0\0\0\0\0\0\0\0\0\0\0\0\0"));
        assert!(has(&[10, 200, 0, 5]));
        assert!(has(&[172, 16, 0, 1]));
        assert!(has(b"masq\0"));
        assert_eq!(mac_bytes(TAP_MAC), [0x52, 0x54, 0, 0xd5, 0xec, 1]);
        assert_eq!(cmdline(), "dsec.net=172.16.0.2/30,172.16.0.1");
        assert_eq!(
            qemu_args("pci")[3],
            "virtio-net-pci,netdev=net0,mac=52:54:00:d5:ec:02"
        );
    }

    /// The tap and the NAT really made in a namespace of the test's own, twice (a VM
    /// resumed from disk sets up again), read back with `ip` and `nft`.
    #[test]
    fn setup_makes_the_tap_and_the_nat_in_the_namespace() {
        use std::process::Command;
        let ns = format!("dsec-vmnet-test-{}", std::process::id());
        if !Command::new("ip")
            .args(["netns", "add", &ns])
            .status()
            .is_ok_and(|s| s.success())
        {
            eprintln!("skipped: cannot make a network namespace here");
            return;
        }
        struct Gone(String);
        impl Drop for Gone {
            fn drop(&mut self) {
                let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
            }
        }
        let _gone = Gone(ns.clone());
        let f = std::fs::File::open(format!("/run/netns/{ns}")).unwrap();
        setup_in(&f, "10.200.0.5", TAP, None).unwrap();
        setup_in(&f, "10.200.0.9", TAP, None).unwrap();
        let out = |args: &[&str]| {
            let o = Command::new("ip")
                .arg("netns")
                .arg("exec")
                .arg(&ns)
                .args(args)
                .output()
                .unwrap();
            assert!(
                o.status.success(),
                "{args:?}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            String::from_utf8_lossy(&o.stdout).into_owned()
        };
        let link = out(&["ip", "-o", "addr", "show", "dev", TAP]);
        assert!(link.contains("inet 172.16.0.1/30"), "{link}");
        let mac = out(&["ip", "-o", "link", "show", "dev", TAP]);
        assert!(mac.contains(TAP_MAC) && mac.contains("UP"), "{mac}");
        assert_eq!(out(&["cat", "/proc/sys/net/ipv4/ip_forward"]).trim(), "1");
        let table = out(&["nft", "list", "table", "ip", "dsecvm"]);
        for want in [
            "type nat hook prerouting priority dstnat; policy accept;",
            "iifname \"tap0\" ip daddr 172.16.0.1 tcp dport 53 dnat to 10.200.0.9",
            "iifname \"tap0\" ip daddr 172.16.0.1 udp dport 53 dnat to 10.200.0.9",
            "type nat hook postrouting priority srcnat; policy accept;",
            "oifname \"eth0\" masquerade",
        ] {
            assert!(table.contains(want), "missing {want:?} in:\n{table}");
        }
        assert!(
            !table.contains("10.200.0.5"),
            "the second setup replaced the first:\n{table}"
        );
    }

    /// The template's tap: one with virtio-net headers, in no namespace of the node's.
    #[test]
    fn a_detached_tap_has_headers_and_is_not_on_the_node() {
        use std::os::fd::AsRawFd;
        let here = std::path::Path::new("/sys/class/net").join(TAP).exists();
        let Ok(t) = detached_tap() else {
            eprintln!("skipped: cannot make a network namespace or a tap here");
            return;
        };
        // SAFETY: TUNGETIFF fills an ifreq on a tap descriptor we own.
        let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
        const TUNGETIFF: libc::c_ulong = 0x8004_54d2;
        assert_eq!(
            unsafe { libc::ioctl(t.as_raw_fd(), TUNGETIFF, &mut ifr) },
            0
        );
        // SAFETY: the kernel filled the flags.
        let flags = unsafe { ifr.ifr_ifru.ifru_flags };
        assert_ne!(flags & 0x4000, 0, "IFF_VNET_HDR");
        assert_ne!(flags & IFF_TAP, 0);
        // Made in a namespace of its own: the test's has no new tap.
        assert_eq!(
            std::path::Path::new("/sys/class/net").join(TAP).exists(),
            here
        );
    }
}
