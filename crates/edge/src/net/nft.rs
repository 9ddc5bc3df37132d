//! The node's nftables table `inet dsec`: a fixed ruleset, written once at start with
//! `nft -f`, in which every sandbox is only set elements keyed by its interface
//! (`dsv<k>`, `<k>` the random part of its id), written in-process over netlink
//! ([`super::nfnl`]). Adding the thousandth sandbox costs what adding the first did: no
//! chain or set per sandbox, no `nft` process, no ruleset read back.
//!
//! - forward: packets from one sandbox to another (by interface or by pool address) are
//!   dropped first, whatever the rules; then a sandbox's packets go through `egress`,
//!   which accepts (in this order) the operator's private services its rules named
//!   (`x`, `xp`), drops the never-ranges, then accepts addresses its DNS answers gave
//!   (`a`, each with its TTL) and its CIDR rules (`c`, `p`); the rest is dropped. IPv6
//!   is dropped; nothing may open a connection into a sandbox; replies pass.
//! - input: from a sandbox only DNS to the proxy reaches the node.
//! - nat: DNS on port 53 to any address goes to the proxy at the sandboxes' gateway; the
//!   pool is masqueraded behind the node's uplink. Before it (raw priority), a packet
//!   whose source address is not the one routed to its interface (a sandbox posing as
//!   another) is dropped, and each sandbox's DNS packets past a rate are dropped by the
//!   kernel.
//!
//! Set keys are `iifname . ip daddr [. th dport]`: the interface a packet came in on,
//! which a sandbox cannot forge (an address it can).

use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};

use super::netlink::NetlinkError;
use super::nfnl::{self, Elem, ElemOp, SetMsg};
use super::rules::{Cidr, Policy, never};

pub const TABLE: &str = "dsec";
/// DNS packets a sandbox may send per second (and in a burst) before the kernel drops them,
/// so a flood costs the node no wakeup of the proxy (which holds each sandbox to fewer
/// queries still, see `dns.rs`).
pub const DNS_PACKETS_PER_S: u32 = 200;
pub const DNS_PACKETS_BURST: u32 = 400;
pub const IFACE_PREFIX: &str = "dsv";

/// The operator's private services a sandbox's rules named: `iifname . ip daddr` ranges,
/// and with a port.
pub const PRIVATE: &str = "x";
pub const PRIVATE_PORT: &str = "xp";
/// Addresses DNS answers opened, each until its TTL ends.
pub const LEARNED: &str = "a";
/// The sandbox's CIDR rules, and with a port.
pub const CIDRS: &str = "c";
pub const CIDRS_PORT: &str = "p";
/// Each of the four above for single addresses: hash sets, whose inserts cost the same
/// however many elements they hold. An interval set (the kernel's pipapo, for
/// concatenations) rebuilds its lookup tables on every insert, which made putting 3,000
/// sandboxes' rules back after a restart take over 10 s; most rules are one address.
pub const PRIVATE_ONE: &str = "x1";
pub const PRIVATE_PORT_ONE: &str = "xp1";
pub const CIDRS_ONE: &str = "c1";
pub const CIDRS_PORT_ONE: &str = "p1";
/// Interfaces of sandboxes with egress headers: their HTTP and HTTPS connections to what
/// their rules open go to the node's header proxy (`headers.rs`).
pub const HEADERS: &str = "h";
/// The sets that hold rules (not what DNS answers opened).
pub const RULE_SETS: [&str; 8] = [
    PRIVATE,
    PRIVATE_PORT,
    CIDRS,
    CIDRS_PORT,
    PRIVATE_ONE,
    PRIVATE_PORT_ONE,
    CIDRS_ONE,
    CIDRS_PORT_ONE,
];

/// The hash set that holds single addresses of interval set `set`.
fn one_of(set: &'static str) -> &'static str {
    match set {
        PRIVATE => PRIVATE_ONE,
        PRIVATE_PORT => PRIVATE_PORT_ONE,
        CIDRS => CIDRS_ONE,
        _ => CIDRS_PORT_ONE,
    }
}

/// Whether the kernel deletes elements idempotently (`NFT_MSG_DESTROYSETELEM`, Linux
/// 6.3): found out by [`probe_destroy`] at start.
static DESTROY: AtomicBool = AtomicBool::new(false);

/// Runs an `nft -f -` script as one transaction (the base ruleset, at start).
pub fn apply_script(script: &str) -> Result<(), super::NetError> {
    let mut cmd = Command::new("nft");
    cmd.args(["-f", "-"]);
    super::run_with_input(cmd, script, "nft (install the nftables package)")
}

/// Applies element changes as one transaction, in-process.
pub fn apply(msgs: &[SetMsg]) -> Result<(), NetlinkError> {
    nfnl::apply(msgs)
}

/// Applies `msgs`, where an element to delete that is already gone (expired, or the
/// sandbox was half made) is no error: with the kernel's idempotent delete in one
/// transaction, else one deletion at a time. What is to be added must go in.
pub fn apply_removing(msgs: &[SetMsg]) -> Result<(), NetlinkError> {
    let first = match nfnl::apply(msgs) {
        Ok(()) => return Ok(()),
        Err(e) => e,
    };
    if first.errno() != Some(libc::ENOENT) {
        return Err(first);
    }
    for m in msgs {
        if m.op == ElemOp::Add || m.elems.is_empty() {
            nfnl::apply(std::slice::from_ref(m))?;
            continue;
        }
        for e in &m.elems {
            let one = SetMsg {
                elems: vec![e.clone()],
                ..m.clone()
            };
            match nfnl::apply(&[one]) {
                Ok(()) => {}
                Err(err) if err.errno() == Some(libc::ENOENT) => {}
                Err(err) => return Err(err),
            }
        }
    }
    Ok(())
}

/// Delete, idempotent where the kernel can.
pub fn delete_op() -> ElemOp {
    if DESTROY.load(Ordering::Relaxed) {
        ElemOp::Destroy
    } else {
        ElemOp::Delete
    }
}

/// Finds out whether the kernel has idempotent deletes: destroys an element no sandbox
/// has (the table must exist).
pub fn probe_destroy() -> bool {
    let probe = SetMsg {
        op: ElemOp::Destroy,
        table: TABLE.into(),
        set: LEARNED.into(),
        elems: vec![Elem {
            key: key("probe", Ipv4Addr::UNSPECIFIED, None),
            key_end: None,
            timeout_ms: None,
        }],
    };
    let ok = match nfnl::apply(&[probe]) {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!("no idempotent set-element delete in this kernel: {e}");
            false
        }
    };
    DESTROY.store(ok, Ordering::Relaxed);
    ok
}

/// The interface of sandbox `k` as a key field: IFNAMSIZ bytes, NUL-padded.
fn ifname(k: &str) -> [u8; 16] {
    let mut b = [0u8; 16];
    let name = format!("{IFACE_PREFIX}{k}");
    let n = name.len().min(15);
    b[..n].copy_from_slice(&name.as_bytes()[..n]);
    b
}

/// `iifname . ip daddr [. th dport]` as the kernel's registers hold it: each field
/// padded to 4 bytes, the address and port in network order.
pub fn key(k: &str, ip: Ipv4Addr, port: Option<u16>) -> Vec<u8> {
    let mut v = Vec::with_capacity(24);
    v.extend_from_slice(&ifname(k));
    v.extend_from_slice(&ip.octets());
    if let Some(p) = port {
        v.extend_from_slice(&p.to_be_bytes());
        v.extend_from_slice(&[0, 0]);
    }
    v
}

/// The rule sets' elements of sandbox `k`: (set, element), each network as a range,
/// overlapping and adjacent ones merged (an interval set refuses overlaps); a range of one
/// address goes to the matching hash set instead.
pub fn rule_elems(k: &str, policy: &Policy) -> Vec<(&'static str, Elem)> {
    use std::collections::BTreeMap;
    // (set, port) → address ranges, first to last address
    type Groups = BTreeMap<(&'static str, Option<u16>), Vec<(u32, u32)>>;
    let mut groups = Groups::new();
    let private = policy.private.iter().map(|c| (true, c));
    let public = policy.cidrs.iter().map(|c| (false, c));
    for (explicit_private, (cidr, port)) in private.chain(public) {
        let set = match (explicit_private, port) {
            (true, None) => PRIVATE,
            (true, Some(_)) => PRIVATE_PORT,
            (false, None) => CIDRS,
            (false, Some(_)) => CIDRS_PORT,
        };
        groups.entry((set, *port)).or_default().push(range(cidr));
    }
    let mut out = Vec::new();
    if !policy.headers.is_empty() {
        out.push((
            HEADERS,
            Elem {
                key: ifname(k).to_vec(),
                key_end: None,
                timeout_ms: None,
            },
        ));
    }
    for ((set, port), mut ranges) in groups {
        ranges.sort();
        let mut merged: Vec<(u32, u32)> = Vec::new();
        for (a, b) in ranges {
            match merged.last_mut() {
                Some(last) if a <= last.1.saturating_add(1) => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        for (a, b) in merged {
            let (set, key_end) = if a == b {
                (one_of(set), None)
            } else {
                (set, Some(key(k, Ipv4Addr::from(b), port)))
            };
            out.push((
                set,
                Elem {
                    key: key(k, Ipv4Addr::from(a), port),
                    key_end,
                    timeout_ms: None,
                },
            ));
        }
    }
    out
}

fn range(c: &Cidr) -> (u32, u32) {
    let start = u32::from(c.addr);
    let size = if c.prefix == 0 {
        u32::MAX
    } else {
        (1u32 << (32 - c.prefix as u32)) - 1
    };
    (start, start | size)
}

/// Most elements in one message: their list is one netlink attribute, whose length is
/// 16 bits (a bigger one wraps and the kernel reads garbage).
const ELEMS_PER_MESSAGE: usize = 256;

/// Messages doing `op` on `elems`: per set, at most [`ELEMS_PER_MESSAGE`] elements each.
pub fn by_set(op: ElemOp, elems: Vec<(&'static str, Elem)>) -> Vec<SetMsg> {
    let mut out: Vec<SetMsg> = Vec::new();
    for (set, e) in elems {
        match out
            .iter_mut()
            .rev()
            .find(|m| m.set == set && m.elems.len() < ELEMS_PER_MESSAGE)
        {
            Some(m) => m.elems.push(e),
            None => out.push(SetMsg {
                op,
                table: TABLE.into(),
                set: set.into(),
                elems: vec![e],
            }),
        }
    }
    out
}

/// Puts sandbox `k`'s rules in.
pub fn add_rules(k: &str, policy: &Policy) -> Vec<SetMsg> {
    by_set(ElemOp::Add, rule_elems(k, policy))
}

/// Takes sandbox `k`'s rules out (for [`apply_removing`]).
pub fn remove_rules(k: &str, policy: &Policy) -> Vec<SetMsg> {
    by_set(delete_op(), rule_elems(k, policy))
}

fn learned_elem(k: &str, ip: Ipv4Addr, ttl_s: Option<u32>) -> (&'static str, Elem) {
    (
        LEARNED,
        Elem {
            key: key(k, ip, None),
            key_end: None,
            timeout_ms: ttl_s.map(|t| t as u64 * 1000),
        },
    )
}

/// Takes addresses DNS answers opened for sandbox `k` out (for [`apply_removing`]).
pub fn forget(k: &str, addrs: &[Ipv4Addr]) -> Vec<SetMsg> {
    by_set(
        delete_op(),
        addrs.iter().map(|ip| learned_elem(k, *ip, None)).collect(),
    )
}

/// Opens DNS-learned addresses to sandbox `k`, each for its TTL. An element that is
/// already there is deleted first so that its timeout starts again (`present`).
pub fn learn(k: &str, addrs: &[(Ipv4Addr, u32)], present: &[Ipv4Addr]) -> Vec<SetMsg> {
    let mut out = forget(k, present);
    out.extend(by_set(
        ElemOp::Add,
        addrs
            .iter()
            .map(|(ip, ttl)| learned_elem(k, *ip, Some(*ttl)))
            .collect(),
    ));
    out
}

/// Puts back the rules of `sandboxes` (key, policy) after a restart, in one transaction.
/// Elements still there are left as they are (adding an element that is there is no
/// error). Elements of sandboxes that are gone stay too: keyed by an interface that no
/// longer exists they match no packet, and every new sandbox has a new key; the table goes
/// when the last sandbox does. (Emptying the sets first in the same transaction also
/// works, but costs 30 times as much: 440 ms against 15 ms for 3,000 sandboxes, measured,
/// on the way to the API answering after a restart.)
pub fn rebuild_rules<'a>(sandboxes: impl Iterator<Item = (&'a str, &'a Policy)>) -> Vec<SetMsg> {
    let mut all = Vec::new();
    for (k, p) in sandboxes {
        all.extend(rule_elems(k, p));
    }
    by_set(ElemOp::Add, all)
}

/// Names of per-sandbox chains (`sb_<k>`) an earlier version of the edge made, which
/// the fixed ruleset replaced: removed at start.
pub fn legacy_chains() -> Vec<String> {
    let Ok(out) = Command::new("nft")
        .args(["list", "chains", "inet"])
        .stderr(Stdio::null())
        .output()
    else {
        return Vec::new();
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let mut in_table = false;
    let mut chains = Vec::new();
    for line in text.lines() {
        let l = line.trim();
        if let Some(rest) = l.strip_prefix("table inet ") {
            in_table = rest.trim_end_matches(" {").trim() == TABLE;
        } else if in_table && let Some(rest) = l.strip_prefix("chain sb_") {
            chains.push(rest.trim_end_matches(" {").trim().to_string());
        }
    }
    chains
}

/// Removes a legacy sandbox chain and its sets; each may already be gone, so the caller
/// applies this line by line.
pub fn remove_legacy(k: &str) -> Vec<String> {
    let mut v = vec![format!("delete chain inet {TABLE} sb_{k}\n")];
    for set in ["a", "x", "xp", "c", "p"] {
        v.push(format!("delete set inet {TABLE} {set}_{k}\n"));
    }
    v
}

/// Creates the table, its sets and chains, replacing the chains' rules and keeping the
/// sets' elements of a table left by an earlier run (sandboxes still running). The
/// per-sandbox verdict map of an earlier version goes (created first so that the delete
/// never fails).
pub fn base(pool: &Cidr, dns_port: u16, header_port: u16) -> String {
    let never_elems = never()
        .iter()
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let p = IFACE_PREFIX;
    let gateway = super::link::gateway(pool);
    format!(
        "add table inet {TABLE}
add set inet {TABLE} never4 {{ type ipv4_addr; flags interval; }}
flush set inet {TABLE} never4
add element inet {TABLE} never4 {{ {never_elems} }}
add set inet {TABLE} {PRIVATE} {{ type ifname . ipv4_addr; flags interval; }}
add set inet {TABLE} {PRIVATE_PORT} {{ type ifname . ipv4_addr . inet_service; flags interval; }}
add set inet {TABLE} {LEARNED} {{ type ifname . ipv4_addr; flags timeout; }}
add set inet {TABLE} {CIDRS} {{ type ifname . ipv4_addr; flags interval; }}
add set inet {TABLE} {CIDRS_PORT} {{ type ifname . ipv4_addr . inet_service; flags interval; }}
add set inet {TABLE} {PRIVATE_ONE} {{ type ifname . ipv4_addr; }}
add set inet {TABLE} {PRIVATE_PORT_ONE} {{ type ifname . ipv4_addr . inet_service; }}
add set inet {TABLE} {CIDRS_ONE} {{ type ifname . ipv4_addr; }}
add set inet {TABLE} {CIDRS_PORT_ONE} {{ type ifname . ipv4_addr . inet_service; }}
add set inet {TABLE} {HEADERS} {{ type ifname; }}
add chain inet {TABLE} egress
flush chain inet {TABLE} egress
add rule inet {TABLE} egress iifname . ip daddr @{PRIVATE} accept
add rule inet {TABLE} egress iifname . ip daddr @{PRIVATE_ONE} accept
add rule inet {TABLE} egress iifname . ip daddr . th dport @{PRIVATE_PORT} accept
add rule inet {TABLE} egress iifname . ip daddr . th dport @{PRIVATE_PORT_ONE} accept
add rule inet {TABLE} egress ip daddr @never4 drop
add rule inet {TABLE} egress iifname . ip daddr @{LEARNED} accept
add rule inet {TABLE} egress iifname . ip daddr @{CIDRS} accept
add rule inet {TABLE} egress iifname . ip daddr @{CIDRS_ONE} accept
add rule inet {TABLE} egress iifname . ip daddr . th dport @{CIDRS_PORT} accept
add rule inet {TABLE} egress iifname . ip daddr . th dport @{CIDRS_PORT_ONE} accept
add chain inet {TABLE} forward {{ type filter hook forward priority filter; policy accept; }}
flush chain inet {TABLE} forward
add rule inet {TABLE} forward iifname \"{p}*\" ct state established,related accept
add rule inet {TABLE} forward iifname \"{p}*\" meta nfproto ipv6 drop
add rule inet {TABLE} forward iifname \"{p}*\" oifname \"{p}*\" drop
add rule inet {TABLE} forward iifname \"{p}*\" ip daddr {pool} drop
add rule inet {TABLE} forward iifname \"{p}*\" jump egress
add rule inet {TABLE} forward iifname \"{p}*\" drop
add rule inet {TABLE} forward oifname \"{p}*\" ct state established,related accept
add rule inet {TABLE} forward oifname \"{p}*\" drop
add map inet {TABLE} egress {{ type ifname : verdict; }}
delete map inet {TABLE} egress
add chain inet {TABLE} input {{ type filter hook input priority filter; policy accept; }}
flush chain inet {TABLE} input
add rule inet {TABLE} input iifname \"{p}*\" ct state established,related accept
add rule inet {TABLE} input iifname \"{p}*\" meta nfproto ipv4 meta l4proto {{ tcp, udp }} th dport {dns_port} accept
add rule inet {TABLE} input iifname \"{p}*\" meta nfproto ipv4 tcp dport {header_port} ct status dnat accept
add rule inet {TABLE} input iifname \"{p}*\" drop
add set inet {TABLE} dnsrate {{ type ipv4_addr; flags dynamic,timeout; timeout 1m; size 65536; }}
add chain inet {TABLE} dnslimit {{ type filter hook prerouting priority raw; policy accept; }}
flush chain inet {TABLE} dnslimit
add rule inet {TABLE} dnslimit iifname \"{p}*\" fib saddr . iif oif missing drop
add rule inet {TABLE} dnslimit iifname \"{p}*\" meta l4proto {{ tcp, udp }} th dport 53 update @dnsrate {{ ip saddr limit rate over {DNS_PACKETS_PER_S}/second burst {DNS_PACKETS_BURST} packets }} drop
add chain inet {TABLE} prerouting {{ type nat hook prerouting priority dstnat; policy accept; }}
flush chain inet {TABLE} prerouting
add rule inet {TABLE} prerouting iifname \"{p}*\" meta nfproto ipv4 meta l4proto {{ tcp, udp }} th dport 53 dnat ip to {gateway}:{dns_port}
add rule inet {TABLE} prerouting iifname @{HEADERS} meta nfproto ipv4 tcp dport {{ 80, 443 }} ip daddr != @never4 ip daddr != {pool} fib daddr type != local iifname . ip daddr @{LEARNED} dnat ip to {gateway}:{header_port}
add rule inet {TABLE} prerouting iifname @{HEADERS} meta nfproto ipv4 tcp dport {{ 80, 443 }} ip daddr != @never4 ip daddr != {pool} fib daddr type != local iifname . ip daddr @{CIDRS_ONE} dnat ip to {gateway}:{header_port}
add rule inet {TABLE} prerouting iifname @{HEADERS} meta nfproto ipv4 tcp dport {{ 80, 443 }} ip daddr != @never4 ip daddr != {pool} fib daddr type != local iifname . ip daddr @{CIDRS} dnat ip to {gateway}:{header_port}
add chain inet {TABLE} postrouting {{ type nat hook postrouting priority srcnat; policy accept; }}
flush chain inet {TABLE} postrouting
add rule inet {TABLE} postrouting ip saddr {pool} oifname != \"{p}*\" masquerade
"
    )
}

/// Deletes the whole table (the last sandbox is gone and the edge stops).
pub fn drop_table() -> String {
    format!("delete table inet {TABLE}\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::rules::{Catalog, compile};
    use std::collections::BTreeMap;

    fn policy(rules: &[&str], private: &[(&str, &[&str])]) -> Policy {
        let rules: BTreeMap<String, bool> = rules.iter().map(|k| (k.to_string(), true)).collect();
        let private = private
            .iter()
            .map(|(n, v)| (n.to_string(), v.iter().map(|s| s.to_string()).collect()))
            .collect();
        let pool = Cidr::parse("10.200.0.0/16").unwrap();
        let catalog = Catalog::new(&BTreeMap::new(), &private, &pool).unwrap();
        compile(&rules, &catalog).unwrap()
    }

    fn ip(key: &[u8]) -> Ipv4Addr {
        Ipv4Addr::new(key[16], key[17], key[18], key[19])
    }

    #[test]
    fn keys_are_the_interface_then_the_address_then_the_port_each_padded() {
        let k = key("0123456789ab", Ipv4Addr::new(198, 51, 100, 7), Some(443));
        assert_eq!(k.len(), 24);
        assert_eq!(&k[..15], b"dsv0123456789ab");
        assert_eq!(k[15], 0);
        assert_eq!(&k[16..20], &[198, 51, 100, 7]);
        assert_eq!(&k[20..], &[0x01, 0xbb, 0, 0]);
        assert_eq!(key("ab", Ipv4Addr::LOCALHOST, None).len(), 20);
    }

    #[test]
    fn cidr_rules_go_to_the_right_set_as_ranges() {
        let p = policy(
            &["203.0.113.0/24", "198.51.100.7:443", "db"],
            &[("db", &["10.9.0.0/16", "169.254.169.254:80"])],
        );
        let e = rule_elems("abc", &p);
        let find = |set: &str| -> Vec<(Ipv4Addr, Ipv4Addr, Vec<u8>)> {
            e.iter()
                .filter(|(s, _)| *s == set)
                .map(|(_, el)| {
                    // A single address has no end key (a hash set's element).
                    let end = el.key_end.clone().unwrap_or_else(|| el.key.clone());
                    (ip(&el.key), ip(&end), el.key[20..].to_vec())
                })
                .collect()
        };
        assert_eq!(
            find(CIDRS),
            vec![(
                Ipv4Addr::new(203, 0, 113, 0),
                Ipv4Addr::new(203, 0, 113, 255),
                vec![]
            )]
        );
        assert_eq!(find(CIDRS_PORT), vec![]);
        assert_eq!(
            find(CIDRS_PORT_ONE),
            vec![(
                Ipv4Addr::new(198, 51, 100, 7),
                Ipv4Addr::new(198, 51, 100, 7),
                vec![1, 187, 0, 0]
            )]
        );
        assert_eq!(
            find(PRIVATE),
            vec![(
                Ipv4Addr::new(10, 9, 0, 0),
                Ipv4Addr::new(10, 9, 255, 255),
                vec![]
            )]
        );
        assert_eq!(
            find(PRIVATE_PORT_ONE),
            vec![(
                Ipv4Addr::new(169, 254, 169, 254),
                Ipv4Addr::new(169, 254, 169, 254),
                vec![0, 80, 0, 0]
            )]
        );
        // Every key names the sandbox's interface.
        assert!(e.iter().all(|(_, el)| el.key.starts_with(b"dsvabc\0")));
    }

    #[test]
    fn overlapping_and_adjacent_networks_become_one_range_per_port() {
        let p = policy(
            &[
                "203.0.113.0/25",
                "203.0.113.128/25",
                "203.0.113.7",
                "198.51.100.0/24",
                "198.51.100.9:443",
                "198.51.100.9:80",
                "0.0.0.0/0",
            ],
            &[],
        );
        let c: Vec<(Ipv4Addr, Ipv4Addr)> = rule_elems("k", &p)
            .into_iter()
            .filter(|(s, _)| *s == CIDRS)
            .map(|(_, e)| (ip(&e.key), ip(e.key_end.as_ref().unwrap())))
            .collect();
        // 0.0.0.0/0 swallows the rest (the never-ranges are dropped before `c` is read).
        assert_eq!(c, vec![(Ipv4Addr::UNSPECIFIED, Ipv4Addr::BROADCAST)]);
        let ports = rule_elems("k", &p)
            .into_iter()
            .filter(|(s, _)| *s == CIDRS_PORT_ONE)
            .count();
        assert_eq!(ports, 2, "one element per port");
    }

    #[test]
    fn a_rebuild_adds_every_sandboxs_rules_in_one_message_per_set() {
        let p = policy(&["203.0.113.0/24"], &[]);
        let msgs = rebuild_rules([("k1", &p), ("k2", &p)].into_iter());
        assert!(msgs.iter().all(|m| m.op == ElemOp::Add));
        assert_eq!(msgs.len(), 1);
        assert_eq!(msgs[0].elems.len(), 2);
    }

    #[test]
    fn sandboxes_never_reach_each_other_before_any_rule_is_looked_at() {
        let pool = Cidr::parse("10.200.0.0/16").unwrap();
        let b = base(&pool, 10053, 10080);
        let pos = |needle: &str| {
            b.find(needle)
                .unwrap_or_else(|| panic!("{needle} missing from:\n{b}"))
        };
        let jump = pos("forward iifname \"dsv*\" jump egress");
        assert!(pos("iifname \"dsv*\" oifname \"dsv*\" drop") < jump);
        assert!(pos("ip daddr 10.200.0.0/16 drop") < jump);
        // In `egress`, only the operator's private services come before the never-ranges.
        let never = pos("egress ip daddr @never4 drop");
        assert!(pos("@x accept") < never && pos("@xp accept") < never);
        assert!(pos("@x1 accept") < never && pos("@xp1 accept") < never);
        for tenant in [
            "@a accept",
            "@c accept",
            "@p accept",
            "@c1 accept",
            "@p1 accept",
        ] {
            assert!(pos(tenant) > never, "{tenant}");
        }
    }

    /// Runs `f` on a thread in a network namespace of its own (gone with the thread), with
    /// the node's base ruleset in it; skipped without root or `nft`.
    fn in_own_netns(f: impl FnOnce() + Send + 'static) {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 || Command::new("nft").arg("-v").output().is_err() {
            eprintln!("skipped: needs root and nft");
            return;
        }
        std::thread::spawn(|| {
            // SAFETY: unshare on this thread only; its namespace ends with the thread.
            assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0);
            let pool = Cidr::parse("10.200.0.0/16").unwrap();
            apply_script(&base(&pool, 10053, 10080)).unwrap();
            f()
        })
        .join()
        .unwrap();
    }

    /// In a network namespace of its own: the base ruleset, then sandboxes' elements put
    /// in, read back with `nft`, taken out (twice: the second finds them gone, which is
    /// no error), and a rebuild, twice (what is there already is no error).
    #[test]
    fn sandbox_elements_go_in_and_out_of_the_kernels_sets() {
        in_own_netns(|| {
            let list = |set: &str| {
                let o = Command::new("nft")
                    .args(["list", "set", "inet", TABLE, set])
                    .output()
                    .unwrap();
                String::from_utf8_lossy(&o.stdout).into_owned()
            };
            let destroy = probe_destroy();
            eprintln!("idempotent delete: {destroy}");
            let p = policy(&["203.0.113.0/24", "198.51.100.7:443"], &[]);
            apply(&add_rules("k1", &p)).unwrap();
            apply(&add_rules("k2", &p)).unwrap();
            let c = list(CIDRS);
            assert!(c.contains("\"dsvk1\" . 203.0.113.0/24"), "{c}");
            assert!(c.contains("\"dsvk2\" . 203.0.113.0/24"), "{c}");
            let cp = list(CIDRS_PORT_ONE);
            assert!(cp.contains("\"dsvk1\" . 198.51.100.7 . 443"), "{cp}");
            // A range of ports' worth of addresses stays in the interval set.
            let wide = policy(&["198.51.100.0/24:443"], &[]);
            apply(&add_rules("k1", &wide)).unwrap();
            let cpr = list(CIDRS_PORT);
            assert!(cpr.contains("\"dsvk1\" . 198.51.100.0/24 . 443"), "{cpr}");
            apply_removing(&remove_rules("k1", &wide)).unwrap();
            let ip = Ipv4Addr::new(192, 0, 2, 1);
            apply(&learn("k1", &[(ip, 30)], &[])).unwrap();
            let a = list(LEARNED);
            assert!(a.contains("\"dsvk1\" . 192.0.2.1 timeout 30s"), "{a}");
            // Again, deleting it first: its timeout starts again.
            apply(&learn("k1", &[(ip, 60)], &[ip])).unwrap();
            assert!(list(LEARNED).contains("timeout 1m"), "{}", list(LEARNED));

            let mut out = remove_rules("k1", &p);
            out.extend(forget("k1", &[ip]));
            apply_removing(&out).unwrap();
            let c = list(CIDRS);
            assert!(!c.contains("dsvk1") && c.contains("dsvk2"), "{c}");
            assert!(!list(LEARNED).contains("dsvk1"));
            apply_removing(&out).unwrap();
            // As on a kernel without idempotent deletes: one at a time, the gone ones skipped.
            DESTROY.store(false, Ordering::Relaxed);
            let mut out = remove_rules("k1", &p);
            out.extend(remove_rules("k2", &p));
            assert!(out.iter().all(|m| m.op == ElemOp::Delete));
            apply_removing(&out).unwrap();
            assert!(!list(CIDRS).contains("dsvk2"), "{}", list(CIDRS));
            DESTROY.store(destroy, Ordering::Relaxed);

            apply(&rebuild_rules([("k3", &p)].into_iter())).unwrap();
            let c = list(CIDRS);
            assert!(c.contains("dsvk3"), "{c}");
            // Again: what is there already is no error.
            apply(&rebuild_rules([("k3", &p)].into_iter())).unwrap();
            // The kernel says what it refused.
            let e = apply(&[SetMsg {
                op: ElemOp::Add,
                table: TABLE.into(),
                set: "no-such-set".into(),
                elems: vec![],
            }])
            .unwrap_err()
            .to_string();
            assert!(e.contains("no-such-set"), "{e}");
        });
    }

    /// A restart puts back the rules of thousands of sandboxes in one transaction; the
    /// kernel's answer (an error echoes the whole request unless acknowledgements are
    /// capped) must come back whole.
    #[test]
    fn a_rebuild_of_thousands_goes_in_as_one_transaction() {
        in_own_netns(|| {
            let keys: Vec<String> = (0..3000).map(|i| format!("{i:012}")).collect();
            let policies: Vec<Policy> = (0..3000)
                .map(|i| {
                    policy(
                        &[
                            &format!("203.0.{}.{}:443", i / 256 % 256, i % 256),
                            "198.51.100.0/24",
                        ],
                        &[],
                    )
                })
                .collect();
            for (k, p) in keys.iter().zip(&policies).take(1000) {
                apply(&add_rules(k, p)).unwrap();
            }
            let t0 = std::time::Instant::now();
            apply(&rebuild_rules(
                keys.iter().map(String::as_str).zip(policies.iter()),
            ))
            .unwrap();
            eprintln!("rebuild of 3000 sandboxes' rules: {:?}", t0.elapsed());
            let o = Command::new("nft")
                .args(["list", "set", "inet", TABLE, CIDRS_PORT_ONE])
                .output()
                .unwrap();
            assert_eq!(
                String::from_utf8_lossy(&o.stdout).matches("\"dsv").count(),
                3000
            );
            // A refusal inside a big batch is reported, not waited for.
            let mut bad = rebuild_rules(keys.iter().map(String::as_str).zip(policies.iter()));
            bad.push(SetMsg {
                op: ElemOp::Add,
                table: TABLE.into(),
                set: "no-such-set".into(),
                elems: vec![],
            });
            let e = apply(&bad).unwrap_err().to_string();
            assert!(e.contains("no-such-set"), "{e}");
        });
    }
}
