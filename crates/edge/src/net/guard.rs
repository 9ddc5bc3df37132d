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
//! send it), from a short-lived thread that joins the namespace: no `nft` process per
//! sandbox.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

/// The rate (and burst) of packets to port 53 past which a sandbox's own namespace drops
/// them: the node's `dnslimit` chain's, held one step earlier. Above the node proxy's own
/// per-sandbox answer rate, so a well-behaved resolver never meets it.
use super::nft::{DNS_PACKETS_BURST, DNS_PACKETS_PER_S};

/// The table's name inside each sandbox namespace.
pub const TABLE: &str = "dsecguard";

// From <linux/netfilter/nfnetlink.h>, <linux/netfilter/nf_tables.h>, <linux/netlink.h>.
const NETLINK_NETFILTER: i32 = 12;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_NEWRULE: u16 = 6;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_CREATE: u16 = 0x400;
const NLM_F_APPEND: u16 = 0x800;
const NLMSG_ERROR: u16 = 0x2;
const NLA_F_NESTED: u16 = 0x8000;
const NFPROTO_INET: u8 = 1;
const NF_INET_PRE_ROUTING: u32 = 0;
const NF_INET_LOCAL_OUT: u32 = 3;
const NF_IP_PRI_RAW: i32 = -300;
const NF_ACCEPT: u32 = 1;
const NF_DROP: u32 = 0;
const NFT_REG_VERDICT: u32 = 0;
const NFT_REG_1: u32 = 1;
const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
const NFT_CMP_EQ: u32 = 0;
const NFT_LIMIT_PKTS: u32 = 0;
const NFT_LIMIT_F_INV: u32 = 1;

/// Netlink attributes, appended to a message under construction.
struct Msg {
    buf: Vec<u8>,
    nests: Vec<usize>,
}

impl Msg {
    /// A message of `kind` with the nfgenmsg header for `family`.
    fn new(kind: u16, flags: u16, seq: u32, family: u8) -> Msg {
        let mut buf = Vec::with_capacity(256);
        buf.extend_from_slice(&0u32.to_ne_bytes()); // length, set by `finish`
        buf.extend_from_slice(&kind.to_ne_bytes());
        buf.extend_from_slice(&flags.to_ne_bytes());
        buf.extend_from_slice(&seq.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel's
        buf.push(family);
        buf.push(0); // version
        buf.extend_from_slice(&NFNL_SUBSYS_NFTABLES.to_be_bytes()); // res_id
        Msg {
            buf,
            nests: Vec::new(),
        }
    }

    fn attr(&mut self, kind: u16, data: &[u8]) -> &mut Msg {
        let len = 4 + data.len();
        self.buf.extend_from_slice(&(len as u16).to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.pad();
        self
    }

    fn str(&mut self, kind: u16, s: &str) -> &mut Msg {
        let mut v = s.as_bytes().to_vec();
        v.push(0);
        self.attr(kind, &v)
    }

    fn u32(&mut self, kind: u16, v: u32) -> &mut Msg {
        self.attr(kind, &v.to_be_bytes())
    }

    fn u64(&mut self, kind: u16, v: u64) -> &mut Msg {
        self.attr(kind, &v.to_be_bytes())
    }

    fn open(&mut self, kind: u16) -> &mut Msg {
        self.nests.push(self.buf.len());
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf
            .extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
        self
    }

    fn close(&mut self) -> &mut Msg {
        if let Some(at) = self.nests.pop() {
            let len = (self.buf.len() - at) as u16;
            self.buf[at..at + 2].copy_from_slice(&len.to_ne_bytes());
        }
        self
    }

    /// An expression: its name and its attributes, written by `data`.
    fn expr(&mut self, name: &str, data: impl FnOnce(&mut Msg)) -> &mut Msg {
        self.open(1); // NFTA_LIST_ELEM
        self.str(1, name); // NFTA_EXPR_NAME
        self.open(2); // NFTA_EXPR_DATA
        data(self);
        self.close().close()
    }

    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    fn finish(mut self, out: &mut Vec<u8>) {
        let len = self.buf.len() as u32;
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        out.extend_from_slice(&self.buf);
    }
}

fn nft(kind: u16) -> u16 {
    (NFNL_SUBSYS_NFTABLES << 8) | kind
}

/// `cmp eq <value>` on register 1.
fn cmp_eq(m: &mut Msg, value: &[u8]) {
    m.expr("cmp", |m| {
        m.u32(1, NFT_REG_1).u32(2, NFT_CMP_EQ);
        m.open(3).attr(1, value).close(); // NFTA_CMP_DATA { NFTA_DATA_VALUE }
    });
}

/// The batch: table `inet dsecguard`, chains on output (a container's own packets) and on
/// prerouting (a VM's, arriving from its tap), each with
/// `th dport 53 limit rate over N/second burst B packets drop`.
fn batch() -> Vec<u8> {
    let mut out = Vec::with_capacity(1024);
    let mut seq = 1;
    let mut next = || {
        seq += 1;
        seq
    };
    // Batch messages carry the subsystem in res_id and an unspecified family.
    let begin = Msg::new(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, 1, 0);
    begin.finish(&mut out);
    let create = NLM_F_REQUEST | NLM_F_CREATE | NLM_F_ACK;
    let mut table = Msg::new(nft(NFT_MSG_NEWTABLE), create, next(), NFPROTO_INET);
    table.str(1, TABLE); // NFTA_TABLE_NAME
    table.finish(&mut out);
    for (chain, hook) in [("out", NF_INET_LOCAL_OUT), ("in", NF_INET_PRE_ROUTING)] {
        let mut c = Msg::new(nft(NFT_MSG_NEWCHAIN), create, next(), NFPROTO_INET);
        c.str(1, TABLE).str(3, chain); // NFTA_CHAIN_TABLE, NFTA_CHAIN_NAME
        c.open(4) // NFTA_CHAIN_HOOK
            .u32(1, hook) // NFTA_HOOK_HOOKNUM
            .u32(2, NF_IP_PRI_RAW as u32) // NFTA_HOOK_PRIORITY
            .close();
        c.u32(5, NF_ACCEPT).str(7, "filter"); // NFTA_CHAIN_POLICY, NFTA_CHAIN_TYPE
        c.finish(&mut out);

        let mut r = Msg::new(
            nft(NFT_MSG_NEWRULE),
            create | NLM_F_APPEND,
            next(),
            NFPROTO_INET,
        );
        r.str(1, TABLE).str(2, chain); // NFTA_RULE_TABLE, NFTA_RULE_CHAIN
        r.open(4); // NFTA_RULE_EXPRESSIONS
        // The destination port sits at bytes 2..4 of both the UDP and the TCP header.
        r.expr("payload", |m| {
            m.u32(1, NFT_REG_1) // NFTA_PAYLOAD_DREG
                .u32(2, NFT_PAYLOAD_TRANSPORT_HEADER) // NFTA_PAYLOAD_BASE
                .u32(3, 2) // NFTA_PAYLOAD_OFFSET
                .u32(4, 2); // NFTA_PAYLOAD_LEN
        });
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
        r.finish(&mut out);
    }
    let end = Msg::new(NFNL_MSG_BATCH_END, NLM_F_REQUEST, next(), 0);
    end.finish(&mut out);
    out
}

/// Sends the batch on a netfilter netlink socket of the calling thread's namespace and
/// reads one acknowledgement per message that asked for one; the first error wins.
fn send(batch: &[u8]) -> io::Result<()> {
    // SAFETY: plain socket(2); the descriptor is owned at once.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            NETLINK_NETFILTER,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // The kernel answers a batch at once; a bound on the wait keeps a create from hanging
    // on a reply that never comes.
    let timeout = libc::timeval {
        tv_sec: 2,
        tv_usec: 0,
    };
    // SAFETY: setsockopt with a timeval of the size given.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&timeout as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as u32,
        )
    };
    // SAFETY: sockaddr_nl zeroed is the kernel's address (pid 0, no groups).
    let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    addr.nl_family = libc::AF_NETLINK as u16;
    // SAFETY: the buffer and address outlive the call.
    let sent = unsafe {
        libc::sendto(
            sock.as_raw_fd(),
            batch.as_ptr().cast(),
            batch.len(),
            0,
            (&addr as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    // Table, two chains, two rules: five acknowledgements.
    let mut acks = 0;
    let mut buf = vec![0u8; 8192];
    while acks < 5 {
        // SAFETY: reads into a buffer we own, of its length.
        let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut at = 0usize;
        let n = n as usize;
        while at + 16 <= n {
            let len = u32::from_ne_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]) as usize;
            let kind = u16::from_ne_bytes([buf[at + 4], buf[at + 5]]);
            if len < 16 || at + len > n {
                return Err(io::Error::other("a malformed netlink reply"));
            }
            if kind == NLMSG_ERROR && len >= 20 {
                let code =
                    i32::from_ne_bytes([buf[at + 16], buf[at + 17], buf[at + 18], buf[at + 19]]);
                if code != 0 {
                    return Err(io::Error::from_raw_os_error(-code));
                }
                acks += 1;
            }
            at += (len + 3) & !3;
        }
    }
    Ok(())
}

/// Writes the guard table into the namespace at `netns` (a `/run/netns/<name>` file).
/// Runs on a thread of its own, which joins the namespace and ends with it.
pub fn install(netns: &Path) -> Result<(), String> {
    let ns = File::open(netns).map_err(|e| format!("opening {}: {e}", netns.display()))?;
    let batch = batch();
    std::thread::Builder::new()
        .name("dsec-netguard".into())
        .spawn(move || {
            // SAFETY: setns on this thread only; the thread ends after the batch.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(format!(
                    "joining the namespace: {}",
                    io::Error::last_os_error()
                ));
            }
            send(&batch).map_err(|e| format!("nftables over netlink: {e}"))
        })
        .map_err(|e| format!("starting a thread: {e}"))?
        .join()
        .map_err(|_| "the namespace guard's thread panicked".to_string())?
        .map_err(|e| format!("guarding the sandbox's namespace: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::UdpSocket;
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
        install(&path).unwrap();
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
        let b = batch();
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
