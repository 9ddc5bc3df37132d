//! The guard inside each sandbox's network namespace: a table that drops DNS packets over
//! a per-sandbox rate before they leave the namespace.
//!
//! The node's own `dnslimit` chain drops the same flood, but only after the packet has
//! crossed the veth, in softirq work no CPU limit charges to the sandbox: a sandbox sending
//! DNS queries as fast as it can then takes node CPU from everyone else. Dropped here, in
//! the sender's own output path (a container) or in QEMU's write to the tap (a VM), the
//! cost is the sandbox's, inside its CPU limit. A sandbox has no `CAP_NET_ADMIN` in its
//! namespace (a VM's guest cannot reach it at all), so it cannot remove the table.
//!
//! The table is written over `NETLINK_NETFILTER` in-process (one batch, as `nft -f` would
//! send it), by the thread that sets up the sandbox's namespace from inside it
//! (`link::create`): no `nft` process per sandbox.

/// The rate (and burst) of packets to port 53 past which a sandbox's own namespace drops
/// them: the node's `dnslimit` chain's, held one step earlier. Above the node proxy's own
/// per-sandbox answer rate, so a well-behaved resolver never meets it.
use super::nfnl::{
    self, Msg, NF_ACCEPT, NF_INET_PRE_ROUTING, NFPROTO_INET, NFT_MSG_NEWCHAIN, NFT_MSG_NEWRULE,
    NFT_MSG_NEWTABLE, NFT_PAYLOAD_TRANSPORT_HEADER, NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE,
    NLM_F_REQUEST, cmp_eq, payload,
};
use super::nft::{DNS_PACKETS_BURST, DNS_PACKETS_PER_S};

/// The table's name inside each sandbox namespace.
pub const TABLE: &str = "dsecguard";

// From <linux/netfilter/nf_tables.h>, <linux/netfilter.h>.
const NF_INET_LOCAL_OUT: u32 = 3;
const NF_IP_PRI_RAW: i32 = -300;
const NF_DROP: u32 = 0;
const NFT_REG_VERDICT: u32 = 0;
const NFT_LIMIT_PKTS: u32 = 0;
const NFT_LIMIT_F_INV: u32 = 1;

/// The batch: table `inet dsecguard`, chains on output (a container's own packets) and on
/// prerouting (a VM's, arriving from its tap), each with
/// `th dport 53 limit rate over N/second burst B packets drop`.
fn batch() -> (Vec<u8>, u32) {
    nfnl::batch(1, |out| {
        let mut seq = 1;
        let mut next = || {
            seq += 1;
            seq
        };
        let create = NLM_F_REQUEST | NLM_F_CREATE | NLM_F_ACK;
        let mut table = Msg::new(NFT_MSG_NEWTABLE, create, next(), NFPROTO_INET);
        table.str(1, TABLE); // NFTA_TABLE_NAME
        table.finish(out);
        for (chain, hook) in [("out", NF_INET_LOCAL_OUT), ("in", NF_INET_PRE_ROUTING)] {
            let mut c = Msg::new(NFT_MSG_NEWCHAIN, create, next(), NFPROTO_INET);
            c.str(1, TABLE).str(3, chain); // NFTA_CHAIN_TABLE, NFTA_CHAIN_NAME
            c.open(4) // NFTA_CHAIN_HOOK
                .u32(1, hook) // NFTA_HOOK_HOOKNUM
                .u32(2, NF_IP_PRI_RAW as u32) // NFTA_HOOK_PRIORITY
                .close();
            c.u32(5, NF_ACCEPT).str(7, "filter"); // NFTA_CHAIN_POLICY, NFTA_CHAIN_TYPE
            c.finish(out);

            let mut r = Msg::new(NFT_MSG_NEWRULE, create | NLM_F_APPEND, next(), NFPROTO_INET);
            r.str(1, TABLE).str(2, chain); // NFTA_RULE_TABLE, NFTA_RULE_CHAIN
            r.open(4); // NFTA_RULE_EXPRESSIONS
            // The destination port sits at bytes 2..4 of both the UDP and the TCP header.
            payload(&mut r, NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2);
            cmp_eq(&mut r, &53u16.to_be_bytes());
            r.expr("limit", |m| {
                m.u64(1, DNS_PACKETS_PER_S.into()) // NFTA_LIMIT_RATE
                    .u64(2, 1) // NFTA_LIMIT_UNIT: per second
                    .u32(3, DNS_PACKETS_BURST) // NFTA_LIMIT_BURST
                    .u32(4, NFT_LIMIT_PKTS) // NFTA_LIMIT_TYPE
                    .u32(5, NFT_LIMIT_F_INV); // NFTA_LIMIT_FLAGS: "over"
            });
            r.expr("immediate", |m| {
                m.u32(1, NFT_REG_VERDICT); // NFTA_IMMEDIATE_DREG
                m.open(2) // NFTA_IMMEDIATE_DATA
                    .open(2) // NFTA_DATA_VERDICT
                    .u32(1, NF_DROP) // NFTA_VERDICT_CODE
                    .close()
                    .close();
            });
            r.close();
            r.finish(out);
        }
        seq - 1
    })
}

/// Writes the guard table into the calling thread's network namespace.
pub fn install_here() -> Result<(), super::NetlinkError> {
    let (batch, n) = batch();
    nfnl::transact(&batch, 1, n, |i| {
        format!("message {} of the guard table", i + 1)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::net::UdpSocket;
    use std::os::fd::AsRawFd;
    use std::path::Path;
    use std::process::Command;
    use std::time::Duration;

    struct Netns(String);

    impl Drop for Netns {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }

    /// Sends `n` datagrams to 127.0.0.1:`port` from a thread inside `ns` and counts
    /// those that arrive.
    fn delivered(ns: &Path, port: u16, n: usize) -> usize {
        let ns = File::open(ns).unwrap();
        std::thread::spawn(move || {
            // SAFETY: setns on this thread only, which ends after the count.
            assert_eq!(
                unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) },
                0
            );
            let rx = UdpSocket::bind(("127.0.0.1", port)).unwrap();
            rx.set_read_timeout(Some(Duration::from_millis(200)))
                .unwrap();
            let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
            let mut got = 0;
            let mut buf = [0u8; 64];
            for i in 0..n {
                // A packet dropped on output fails the send with EPERM.
                let _ = tx.send_to(&(i as u32).to_be_bytes(), ("127.0.0.1", port));
                // Drain as we go so the receive buffer never drops anything itself.
                if i % 50 == 49 {
                    rx.set_nonblocking(true).unwrap();
                    while rx.recv(&mut buf).is_ok() {
                        got += 1;
                    }
                    rx.set_nonblocking(false).unwrap();
                }
            }
            while rx.recv(&mut buf).is_ok() {
                got += 1;
            }
            got
        })
        .join()
        .unwrap()
    }

    /// A flood to port 53 from inside the namespace is cut to the burst (plus what the
    /// rate refills while it runs); the same flood to another port all arrives.
    #[test]
    fn a_namespace_drops_its_own_dns_flood() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: making network namespaces needs root");
            return;
        }
        let mut r = [0u8; 4];
        dsec_common::id::fill_random(&mut r);
        let ns = Netns(format!("tguard-{}", hex::encode(r)));
        assert!(
            Command::new("ip")
                .args(["netns", "add", &ns.0])
                .status()
                .unwrap()
                .success()
        );
        assert!(
            Command::new("ip")
                .args(["-n", &ns.0, "link", "set", "lo", "up"])
                .status()
                .unwrap()
                .success()
        );
        let path = Path::new("/run/netns").join(&ns.0);
        assert_eq!(delivered(&path, 53, 3000), 3000, "before the guard");
        let ns = File::open(&path).unwrap();
        crate::net::rtnl::in_netns(&ns, install_here).unwrap();
        let dns = delivered(&path, 53, 3000);
        assert!(
            dns >= DNS_PACKETS_BURST as usize && dns < 1500,
            "{dns} of 3000 DNS packets passed the guard"
        );
        assert_eq!(
            delivered(&path, 5353, 3000),
            3000,
            "other ports are not limited"
        );
    }

    /// Every message of the batch is whole: lengths add up to the batch, and each is
    /// 4-aligned, as the kernel's batch parser needs.
    #[test]
    fn batch_messages_are_well_formed() {
        use crate::net::nfnl::{NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END};
        let nft = |kind: u16| (10 << 8) | kind;
        let (b, n) = batch();
        assert_eq!(n, 5);
        let mut at = 0;
        let mut kinds = Vec::new();
        while at < b.len() {
            let len = u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as usize;
            assert!(
                len >= 20 && len.is_multiple_of(4),
                "message at {at} has length {len}"
            );
            kinds.push(u16::from_ne_bytes([b[at + 4], b[at + 5]]));
            at += len;
        }
        assert_eq!(at, b.len());
        assert_eq!(
            kinds,
            vec![
                NFNL_MSG_BATCH_BEGIN,
                nft(NFT_MSG_NEWTABLE),
                nft(NFT_MSG_NEWCHAIN),
                nft(NFT_MSG_NEWRULE),
                nft(NFT_MSG_NEWCHAIN),
                nft(NFT_MSG_NEWRULE),
                NFNL_MSG_BATCH_END
            ]
        );
    }
}
