//! The node's nftables table `inet dsec`, written as `nft -f` scripts (each applied as one
//! atomic transaction). Base chains steer only traffic of sandbox interfaces (`dsv*`):
//!
//! - forward: packets from one sandbox to another (by interface or by pool address) are
//!   dropped first, whatever the rules; then a sandbox's packets go through its own chain
//!   `sb_<k>` (the operator's private services its rules named, then the never-ranges
//!   dropped, then addresses its DNS answers gave (`a_<k>`, with their TTL), then its CIDR
//!   rules), else they are dropped; IPv6 is dropped; nothing may open a connection into a
//!   sandbox; replies pass.
//! - input: from a sandbox only DNS to the proxy reaches the node.
//! - nat: DNS on port 53 to any address is redirected to the proxy; the pool is
//!   masqueraded behind the node's uplink. Before it (raw priority), each sandbox's DNS
//!   packets past a rate are dropped by the kernel.
//!
//! `<k>` is the random part of the sandbox id (12 characters of `[0-9a-z]`).

use std::process::{Command, Stdio};

use super::rules::{Cidr, Policy, never};

pub const TABLE: &str = "dsec";
/// DNS packets a sandbox may send per second (and in a burst) before the kernel drops them,
/// so a flood costs the node no wakeup of the proxy (which holds each sandbox to fewer
/// queries still, see `dns.rs`).
pub const DNS_PACKETS_PER_S: u32 = 200;
pub const DNS_PACKETS_BURST: u32 = 400;
pub const IFACE_PREFIX: &str = "dsv";

/// Runs an `nft -f -` script as one transaction.
pub fn apply(script: &str) -> Result<(), String> {
    let mut cmd = Command::new("nft");
    cmd.args(["-f", "-"]);
    super::run_with_input(cmd, script, "nft (install the nftables package)")
        .map_err(|e| format!("nft refused the ruleset: {e}"))
}

/// Names of the current per-sandbox chains (`sb_<k>`), to clean up what no sandbox owns.
pub fn sandbox_chains() -> Vec<String> {
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

/// Creates the table and its base chains, replacing base chains and keeping the sandbox
/// chains and sets of a table left by an earlier run.
pub fn base(pool: &Cidr, dns_port: u16) -> String {
    let never_elems = never()
        .iter()
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let p = IFACE_PREFIX;
    format!(
        "add table inet {TABLE}
add set inet {TABLE} never4 {{ type ipv4_addr; flags interval; }}
flush set inet {TABLE} never4
add element inet {TABLE} never4 {{ {never_elems} }}
add map inet {TABLE} egress {{ type ifname : verdict; }}
add chain inet {TABLE} forward {{ type filter hook forward priority filter; policy accept; }}
flush chain inet {TABLE} forward
add rule inet {TABLE} forward iifname \"{p}*\" ct state established,related accept
add rule inet {TABLE} forward iifname \"{p}*\" meta nfproto ipv6 drop
add rule inet {TABLE} forward iifname \"{p}*\" oifname \"{p}*\" drop
add rule inet {TABLE} forward iifname \"{p}*\" ip daddr {pool} drop
add rule inet {TABLE} forward iifname \"{p}*\" iifname vmap @egress
add rule inet {TABLE} forward iifname \"{p}*\" drop
add rule inet {TABLE} forward oifname \"{p}*\" ct state established,related accept
add rule inet {TABLE} forward oifname \"{p}*\" drop
add chain inet {TABLE} input {{ type filter hook input priority filter; policy accept; }}
flush chain inet {TABLE} input
add rule inet {TABLE} input iifname \"{p}*\" ct state established,related accept
add rule inet {TABLE} input iifname \"{p}*\" meta nfproto ipv4 meta l4proto {{ tcp, udp }} th dport {dns_port} accept
add rule inet {TABLE} input iifname \"{p}*\" drop
add set inet {TABLE} dnsrate {{ type ipv4_addr; flags dynamic,timeout; timeout 1m; size 65536; }}
add chain inet {TABLE} dnslimit {{ type filter hook prerouting priority raw; policy accept; }}
flush chain inet {TABLE} dnslimit
add rule inet {TABLE} dnslimit iifname \"{p}*\" meta l4proto {{ tcp, udp }} th dport 53 update @dnsrate {{ ip saddr limit rate over {DNS_PACKETS_PER_S}/second burst {DNS_PACKETS_BURST} packets }} drop
add chain inet {TABLE} prerouting {{ type nat hook prerouting priority dstnat; policy accept; }}
flush chain inet {TABLE} prerouting
add rule inet {TABLE} prerouting iifname \"{p}*\" meta nfproto ipv4 meta l4proto {{ tcp, udp }} th dport 53 redirect to :{dns_port}
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

/// The sets and chain of sandbox `k` with `policy`, and its entry in the egress map.
pub fn sandbox(k: &str, policy: &Policy) -> String {
    let mut s = format!(
        "add set inet {TABLE} a_{k} {{ type ipv4_addr; flags timeout; }}
add set inet {TABLE} x_{k} {{ type ipv4_addr; flags interval; }}
add set inet {TABLE} xp_{k} {{ type ipv4_addr . inet_service; flags interval; }}
add set inet {TABLE} c_{k} {{ type ipv4_addr; flags interval; }}
add set inet {TABLE} p_{k} {{ type ipv4_addr . inet_service; flags interval; }}
add chain inet {TABLE} sb_{k}
flush chain inet {TABLE} sb_{k}
add rule inet {TABLE} sb_{k} ip daddr @x_{k} accept
add rule inet {TABLE} sb_{k} ip daddr . th dport @xp_{k} accept
add rule inet {TABLE} sb_{k} ip daddr @never4 drop
add rule inet {TABLE} sb_{k} ip daddr @a_{k} accept
add rule inet {TABLE} sb_{k} ip daddr @c_{k} accept
add rule inet {TABLE} sb_{k} ip daddr . th dport @p_{k} accept
add rule inet {TABLE} sb_{k} drop
"
    );
    s.push_str(&cidr_sets(k, policy));
    s.push_str(&format!(
        "add element inet {TABLE} egress {{ \"{IFACE_PREFIX}{k}\" : jump sb_{k} }}\n"
    ));
    s
}

/// Replaces the CIDR sets of sandbox `k` (rules changed while it runs): the operator's
/// private services in `x`/`xp` (looked at before the never-ranges are dropped), the
/// tenant's CIDRs in `c`/`p` (after).
pub fn cidr_sets(k: &str, policy: &Policy) -> String {
    let mut s = String::new();
    for set in ["x", "xp", "c", "p"] {
        s.push_str(&format!("flush set inet {TABLE} {set}_{k}\n"));
    }
    let private = policy.private.iter().map(|c| (true, c));
    let public = policy.cidrs.iter().map(|c| (false, c));
    for (explicit_private, (cidr, port)) in private.chain(public) {
        let set = match (explicit_private, port) {
            (true, None) => "x",
            (true, Some(_)) => "xp",
            (false, None) => "c",
            (false, Some(_)) => "p",
        };
        let elem = match port {
            Some(p) => format!("{cidr} . {p}"),
            None => cidr.to_string(),
        };
        s.push_str(&format!(
            "add element inet {TABLE} {set}_{k} {{ {elem} }}\n"
        ));
    }
    s
}

/// Empties the DNS-learned set of sandbox `k`.
pub fn flush_learned(k: &str) -> String {
    format!("flush set inet {TABLE} a_{k}\n")
}

/// Adds DNS-learned addresses to sandbox `k`'s set, each for its TTL. An element that is
/// already there is deleted first so that its timeout starts again (`present`).
pub fn learn(
    k: &str,
    addrs: &[(std::net::Ipv4Addr, u32)],
    present: &[std::net::Ipv4Addr],
) -> String {
    let mut s = String::new();
    for ip in present {
        s.push_str(&format!("delete element inet {TABLE} a_{k} {{ {ip} }}\n"));
    }
    for (ip, ttl) in addrs {
        s.push_str(&format!(
            "add element inet {TABLE} a_{k} {{ {ip} timeout {ttl}s }}\n"
        ));
    }
    s
}

/// Removes everything of sandbox `k`. Each piece may already be gone (a half-made
/// sandbox), so the caller applies this line by line.
pub fn remove_sandbox(k: &str) -> Vec<String> {
    let mut v = vec![format!(
        "delete element inet {TABLE} egress {{ \"{IFACE_PREFIX}{k}\" }}\n"
    )];
    v.push(format!("delete chain inet {TABLE} sb_{k}\n"));
    for set in ["a", "x", "xp", "c", "p"] {
        v.push(format!("delete set inet {TABLE} {set}_{k}\n"));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::rules::{Catalog, compile};
    use std::collections::BTreeMap;

    #[test]
    fn cidr_rules_go_to_the_right_set() {
        let rules: BTreeMap<String, bool> = [
            ("203.0.113.0/24", true),
            ("198.51.100.7:443", true),
            ("db", true),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), *v))
        .collect();
        let private = BTreeMap::from([(
            "db".to_string(),
            vec!["10.9.0.0/16".to_string(), "169.254.169.254:80".to_string()],
        )]);
        let pool = Cidr::parse("10.200.0.0/16").unwrap();
        let catalog = Catalog::new(&BTreeMap::new(), &private, &pool).unwrap();
        let p = compile(&rules, &catalog).unwrap();
        let s = cidr_sets("abc", &p);
        assert!(
            s.contains("add element inet dsec c_abc { 203.0.113.0/24 }"),
            "{s}"
        );
        assert!(
            s.contains("add element inet dsec p_abc { 198.51.100.7/32 . 443 }"),
            "{s}"
        );
        assert!(
            s.contains("add element inet dsec x_abc { 10.9.0.0/16 }"),
            "{s}"
        );
        assert!(
            s.contains("add element inet dsec xp_abc { 169.254.169.254/32 . 80 }"),
            "{s}"
        );
    }

    #[test]
    fn sandboxes_never_reach_each_other_before_any_rule_is_looked_at() {
        let pool = Cidr::parse("10.200.0.0/16").unwrap();
        let b = base(&pool, 10053);
        let pos = |needle: &str| {
            b.find(needle)
                .unwrap_or_else(|| panic!("{needle} missing from:\n{b}"))
        };
        let vmap = pos("iifname vmap @egress");
        assert!(pos("iifname \"dsv*\" oifname \"dsv*\" drop") < vmap);
        assert!(pos("ip daddr 10.200.0.0/16 drop") < vmap);
    }
}
