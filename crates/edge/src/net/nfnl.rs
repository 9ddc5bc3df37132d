//! nf_tables set elements over netlink, in the edge's own process: what changes per
//! sandbox in the node's fixed ruleset (see [`super::nft`]) is only set elements, and
//! writing them costs one `sendmsg` and the kernel's acknowledgements, whatever the number
//! of sandboxes, with no `nft` process and no ruleset to read back.
//!
//! A call sends one batch (`NFNL_MSG_BATCH_BEGIN` … `NFNL_MSG_BATCH_END`), which the
//! kernel applies as one transaction: all of it or none. Every message in it asks for an
//! acknowledgement, so the answer is one acknowledgement per message, the first error
//! among them being the batch's.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use super::netlink::NetlinkError;

// From <linux/netfilter/nfnetlink.h>, <linux/netfilter/nf_tables.h>, <linux/netlink.h>.
const NETLINK_NETFILTER: libc::c_int = 12;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
pub const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
pub const NFNL_MSG_BATCH_END: u16 = 0x11;
pub const NFT_MSG_NEWTABLE: u16 = 0;
pub const NFT_MSG_NEWCHAIN: u16 = 3;
pub const NFT_MSG_NEWRULE: u16 = 6;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_DELSETELEM: u16 = 14;
/// Like DELSETELEM, but an element that is not there is no error (Linux 6.3).
const NFT_MSG_DESTROYSETELEM: u16 = 30;
pub const NFPROTO_INET: u8 = 1;

pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_ACK: u16 = 0x4;
pub const NLM_F_CREATE: u16 = 0x400;
pub const NLM_F_APPEND: u16 = 0x800;
const NLMSG_ERROR: u16 = 2;
const NLA_F_NESTED: u16 = 0x8000;

const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_TIMEOUT: u16 = 4;
const NFTA_SET_ELEM_KEY_END: u16 = 10;
const NFTA_DATA_VALUE: u16 = 1;

/// How long the kernel may take to answer a batch.
const ANSWER_WITHIN: Duration = Duration::from_secs(10);
/// Socket buffers big enough for a batch that rewrites every sandbox's elements at once
/// (a restart with thousands running) and for its acknowledgements.
const BUFFER_BYTES: libc::c_int = 32 << 20;

/// What a message does to its set's elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElemOp {
    Add,
    Delete,
    /// Delete, and no error for an element already gone.
    Destroy,
}

/// One set element: its key (the concatenated fields, each padded to 4 bytes), for an
/// interval set the key its range ends at, and a timeout.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Elem {
    pub key: Vec<u8>,
    pub key_end: Option<Vec<u8>>,
    pub timeout_ms: Option<u64>,
}

/// One message: `op` on `elems` of `set` in table `inet <table>`. No elements with
/// `Delete` empties the set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetMsg {
    pub op: ElemOp,
    pub table: String,
    pub set: String,
    pub elems: Vec<Elem>,
}

/// An nf_tables message under construction: the netlink and nfgenmsg headers, then
/// attributes, nested ones opened and closed in order.
pub struct Msg {
    buf: Vec<u8>,
    nests: Vec<usize>,
}

impl Msg {
    /// A message of `kind` (an `NFT_MSG_*`, or a batch delimiter) for `family`.
    pub fn new(kind: u16, flags: u16, seq: u32, family: u8) -> Msg {
        let kind = if kind == NFNL_MSG_BATCH_BEGIN || kind == NFNL_MSG_BATCH_END {
            kind
        } else {
            (NFNL_SUBSYS_NFTABLES << 8) | kind
        };
        let mut buf = Vec::with_capacity(256);
        buf.extend_from_slice(&0u32.to_ne_bytes()); // length, set by `finish`
        buf.extend_from_slice(&kind.to_ne_bytes());
        buf.extend_from_slice(&flags.to_ne_bytes());
        buf.extend_from_slice(&seq.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel's
        buf.push(family);
        buf.push(0); // NFNETLINK_V0
        // res_id: the subsystem for the batch delimiters (ignored by the others).
        buf.extend_from_slice(&NFNL_SUBSYS_NFTABLES.to_be_bytes());
        Msg {
            buf,
            nests: Vec::new(),
        }
    }

    pub fn attr(&mut self, kind: u16, data: &[u8]) -> &mut Msg {
        let len = 4 + data.len();
        self.buf.extend_from_slice(&(len as u16).to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.buf.resize(self.buf.len().next_multiple_of(4), 0);
        self
    }

    pub fn str(&mut self, kind: u16, s: &str) -> &mut Msg {
        let mut v = s.as_bytes().to_vec();
        v.push(0);
        self.attr(kind, &v)
    }

    pub fn u32(&mut self, kind: u16, v: u32) -> &mut Msg {
        self.attr(kind, &v.to_be_bytes())
    }

    pub fn u64(&mut self, kind: u16, v: u64) -> &mut Msg {
        self.attr(kind, &v.to_be_bytes())
    }

    pub fn open(&mut self, kind: u16) -> &mut Msg {
        self.nests.push(self.buf.len());
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf
            .extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
        self
    }

    pub fn close(&mut self) -> &mut Msg {
        if let Some(at) = self.nests.pop() {
            // An attribute's length is 16 bits: callers keep nests smaller (see
            // `nft::by_set`); saturating makes an oversized one a refusal, not a wrap.
            let len = u16::try_from(self.buf.len() - at).unwrap_or(u16::MAX);
            self.buf[at..at + 2].copy_from_slice(&len.to_ne_bytes());
        }
        self
    }

    /// A rule expression: its name and its attributes, written by `data`.
    pub fn expr(&mut self, name: &str, data: impl FnOnce(&mut Msg)) -> &mut Msg {
        self.open(1); // NFTA_LIST_ELEM
        self.str(1, name); // NFTA_EXPR_NAME
        self.open(2); // NFTA_EXPR_DATA
        data(self);
        self.close().close()
    }

    pub fn finish(mut self, out: &mut Vec<u8>) {
        let len = self.buf.len() as u32;
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        out.extend_from_slice(&self.buf);
    }
}

// Rule building blocks shared by the tables written in-process (the namespace guard,
// a VM's NAT). From <linux/netfilter/nf_tables.h>, <linux/netfilter.h>.
pub const NF_INET_PRE_ROUTING: u32 = 0;
pub const NF_ACCEPT: u32 = 1;
pub const NFT_REG_1: u32 = 1;
pub const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
pub const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
const NFT_CMP_EQ: u32 = 0;

/// `payload load <len> bytes at <base> + <offset>` into register 1.
pub fn payload(m: &mut Msg, base: u32, offset: u32, len: u32) {
    m.expr("payload", |m| {
        m.u32(1, NFT_REG_1) // NFTA_PAYLOAD_DREG
            .u32(2, base) // NFTA_PAYLOAD_BASE
            .u32(3, offset) // NFTA_PAYLOAD_OFFSET
            .u32(4, len); // NFTA_PAYLOAD_LEN
    });
}

/// `cmp eq <value>` on register 1.
pub fn cmp_eq(m: &mut Msg, value: &[u8]) {
    m.expr("cmp", |m| {
        m.u32(1, NFT_REG_1).u32(2, NFT_CMP_EQ);
        m.open(3).attr(1, value).close(); // NFTA_CMP_DATA { NFTA_DATA_VALUE }
    });
}

/// A batch: `body` appends its messages (numbered from `seq + 1`, each asking for an
/// acknowledgement) between the delimiters and returns how many it wrote.
pub fn batch(seq: u32, body: impl FnOnce(&mut Vec<u8>) -> u32) -> (Vec<u8>, u32) {
    let mut out = Vec::with_capacity(1024);
    Msg::new(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, seq, 0).finish(&mut out);
    let n = body(&mut out);
    Msg::new(NFNL_MSG_BATCH_END, NLM_F_REQUEST, seq + 1 + n, 0).finish(&mut out);
    (out, n)
}

/// The batch for `msgs`, their sequence numbers following `seq`.
pub fn encode(msgs: &[SetMsg], seq: u32) -> Vec<u8> {
    batch(seq, |out| {
        for (i, m) in msgs.iter().enumerate() {
            let (ty, flags) = match m.op {
                ElemOp::Add => (NFT_MSG_NEWSETELEM, NLM_F_CREATE),
                ElemOp::Delete => (NFT_MSG_DELSETELEM, 0),
                ElemOp::Destroy => (NFT_MSG_DESTROYSETELEM, 0),
            };
            let mut msg = Msg::new(
                ty,
                NLM_F_REQUEST | NLM_F_ACK | flags,
                seq + 1 + i as u32,
                NFPROTO_INET,
            );
            msg.str(NFTA_SET_ELEM_LIST_TABLE, &m.table);
            msg.str(NFTA_SET_ELEM_LIST_SET, &m.set);
            if !m.elems.is_empty() {
                msg.open(NFTA_SET_ELEM_LIST_ELEMENTS);
                for e in &m.elems {
                    msg.open(NFTA_LIST_ELEM);
                    msg.open(NFTA_SET_ELEM_KEY)
                        .attr(NFTA_DATA_VALUE, &e.key)
                        .close();
                    if let Some(end) = &e.key_end {
                        msg.open(NFTA_SET_ELEM_KEY_END)
                            .attr(NFTA_DATA_VALUE, end)
                            .close();
                    }
                    if let Some(t) = e.timeout_ms {
                        msg.u64(NFTA_SET_ELEM_TIMEOUT, t);
                    }
                    msg.close();
                }
                msg.close();
            }
            msg.finish(out);
        }
        msgs.len() as u32
    })
    .0
}

fn check(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the descriptor is owned from here on.
    let fd = check(unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            NETLINK_NETFILTER,
        )
    })?;
    // SAFETY: `fd` was just returned by socket(2) and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let set = |opt: libc::c_int, val: *const libc::c_void, len: usize| {
        // SAFETY: `val` points to `len` readable bytes for the call's duration.
        check(unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                val,
                len as libc::socklen_t,
            )
        })
    };
    for opt in [libc::SO_SNDBUFFORCE, libc::SO_RCVBUFFORCE] {
        // Without CAP_NET_ADMIN the forced sizes are refused; the defaults then hold
        // batches of a few thousand elements.
        let _ = set(
            opt,
            &BUFFER_BYTES as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>(),
        );
    }
    // Acknowledgements without a copy of the request: an error about a batch of thousands
    // of elements would otherwise be too big for any receive buffer, and be lost.
    let one: libc::c_int = 1;
    // SAFETY: `one` is a readable c_int for the call's duration.
    check(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_NETLINK,
            libc::NETLINK_CAP_ACK,
            &one as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    })?;
    let tv = libc::timeval {
        tv_sec: ANSWER_WITHIN.as_secs() as libc::time_t,
        tv_usec: 0,
    };
    set(
        libc::SO_RCVTIMEO,
        &tv as *const libc::timeval as *const libc::c_void,
        std::mem::size_of::<libc::timeval>(),
    )?;
    // SAFETY: a zeroed sockaddr_nl is valid (pid 0: the kernel assigns one).
    let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: `addr` is a valid sockaddr_nl of the given size.
    check(unsafe {
        libc::bind(
            fd.as_raw_fd(),
            &addr as *const libc::sockaddr_nl as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    })?;
    Ok(fd)
}

fn describe(m: &SetMsg) -> String {
    let op = match m.op {
        ElemOp::Add => "adding",
        ElemOp::Delete if m.elems.is_empty() => "emptying",
        ElemOp::Delete | ElemOp::Destroy => "deleting",
    };
    format!(
        "{op} {} element(s) of set inet {} {}",
        m.elems.len(),
        m.table,
        m.set
    )
}

/// Sends `batch` on a netfilter socket of the calling thread's network namespace and
/// reads the acknowledgements of messages `seq + 1 ..= seq + n`; the first refusal is
/// the error, named by `what` (given the message's index).
pub fn transact(
    batch: &[u8],
    seq: u32,
    n: u32,
    what: impl Fn(usize) -> String,
) -> Result<(), NetlinkError> {
    let fd = socket()?;
    // SAFETY: `batch` is readable for its length; a netlink socket sends to the kernel.
    let sent = unsafe {
        libc::send(
            fd.as_raw_fd(),
            batch.as_ptr() as *const libc::c_void,
            batch.len(),
            0,
        )
    };
    if sent < 0 {
        return Err(NetlinkError::Io(io::Error::last_os_error()));
    }
    if sent as usize != batch.len() {
        return Err(NetlinkError::Io(io::Error::other(
            "the batch was cut short",
        )));
    }
    let (first, last) = (seq + 1, seq + n);
    let mut acked = 0u32;
    let mut refused: Option<NetlinkError> = None;
    let mut buf = vec![0u8; 1 << 16];
    while acked < n {
        // SAFETY: `buf` is writable for its length.
        let got = unsafe {
            libc::recv(
                fd.as_raw_fd(),
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
                0,
            )
        };
        if got < 0 {
            let e = io::Error::last_os_error();
            return Err(match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => NetlinkError::Timeout {
                    what: format!("a batch of {n} message(s) within {ANSWER_WITHIN:?}"),
                },
                _ => NetlinkError::Io(e),
            });
        }
        for (s, errno) in acks(&buf[..got as usize]) {
            if !(first..=last).contains(&s) {
                // An answer about the batch itself (its framing, or no memory for it).
                if errno != 0 {
                    return Err(NetlinkError::Refused {
                        what: "the batch".into(),
                        source: io::Error::from_raw_os_error(errno),
                    });
                }
                continue;
            }
            acked += 1;
            if errno != 0 && refused.is_none() {
                refused = Some(NetlinkError::Refused {
                    what: what((s - first) as usize),
                    source: io::Error::from_raw_os_error(errno),
                });
            }
        }
    }
    match refused {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Applies `msgs` as one transaction. Nothing to do is no call at all.
pub fn apply(msgs: &[SetMsg]) -> Result<(), NetlinkError> {
    if msgs.is_empty() {
        return Ok(());
    }
    let seq = 1;
    transact(&encode(msgs, seq), seq, msgs.len() as u32, |i| {
        describe(&msgs[i])
    })
}

/// The (sequence number, errno) of each acknowledgement in a datagram (0: done).
fn acks(mut data: &[u8]) -> Vec<(u32, i32)> {
    let mut out = Vec::new();
    while data.len() >= 16 {
        let len = u32::from_ne_bytes([data[0], data[1], data[2], data[3]]) as usize;
        let ty = u16::from_ne_bytes([data[4], data[5]]);
        if len < 16 || len > data.len() {
            break;
        }
        // NLMSG_ERROR: an errno (negative, 0 for an acknowledgement), then the header
        // of the message it answers.
        if ty == NLMSG_ERROR && len >= 16 + 4 + 16 {
            let err = i32::from_ne_bytes([data[16], data[17], data[18], data[19]]);
            let seq = u32::from_ne_bytes([data[28], data[29], data[30], data[31]]);
            out.push((seq, -err));
        }
        data = &data[len.next_multiple_of(4).min(data.len())..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u16_at(b: &[u8], i: usize) -> u16 {
        u16::from_ne_bytes([b[i], b[i + 1]])
    }

    fn u32_at(b: &[u8], i: usize) -> u32 {
        u32::from_ne_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
    }

    #[test]
    fn a_batch_is_framed_and_its_elements_nested_as_the_kernel_reads_them() {
        let msgs = [SetMsg {
            op: ElemOp::Add,
            table: "dsec".into(),
            set: "a".into(),
            elems: vec![Elem {
                key: vec![1; 20],
                key_end: None,
                timeout_ms: Some(30_000),
            }],
        }];
        let b = encode(&msgs, 7);
        // Begin: 20 bytes, type 16, the subsystem big-endian in res_id.
        assert_eq!(u32_at(&b, 0), 20);
        assert_eq!(u16_at(&b, 4), NFNL_MSG_BATCH_BEGIN);
        assert_eq!(u32_at(&b, 8), 7);
        assert_eq!(&b[18..20], &10u16.to_be_bytes());
        // The element message.
        let m = &b[20..];
        let len = u32_at(m, 0) as usize;
        assert_eq!(u16_at(m, 4), (10 << 8) | 12);
        assert_eq!(u16_at(m, 6), NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE);
        assert_eq!(u32_at(m, 8), 8);
        assert_eq!(m[16], NFPROTO_INET);
        // table "dsec\0" (9 bytes, padded to 12), set "a\0" (6, padded to 8)
        assert_eq!(
            (u16_at(m, 20), u16_at(m, 22)),
            (9, NFTA_SET_ELEM_LIST_TABLE)
        );
        assert_eq!(&m[24..29], b"dsec\0");
        assert_eq!((u16_at(m, 32), u16_at(m, 34)), (6, NFTA_SET_ELEM_LIST_SET));
        let list = 40;
        assert_eq!(
            u16_at(m, list + 2),
            NFTA_SET_ELEM_LIST_ELEMENTS | NLA_F_NESTED
        );
        assert_eq!(u16_at(m, list + 6), NFTA_LIST_ELEM | NLA_F_NESTED);
        let key = list + 8;
        assert_eq!(u16_at(m, key + 2), NFTA_SET_ELEM_KEY | NLA_F_NESTED);
        assert_eq!(
            (u16_at(m, key + 4), u16_at(m, key + 6)),
            (24, NFTA_DATA_VALUE)
        );
        assert_eq!(&m[key + 8..key + 28], &[1; 20]);
        let timeout = key + 28;
        assert_eq!(
            (u16_at(m, timeout), u16_at(m, timeout + 2)),
            (12, NFTA_SET_ELEM_TIMEOUT)
        );
        assert_eq!(&m[timeout + 4..timeout + 12], &30_000u64.to_be_bytes());
        assert_eq!(len, timeout + 12);
        // End: the next sequence number.
        let e = &m[len..];
        assert_eq!(u16_at(e, 4), NFNL_MSG_BATCH_END);
        assert_eq!(u32_at(e, 8), 9);
        assert_eq!(e.len(), 20);
    }

    #[test]
    fn acknowledgements_give_each_messages_errno() {
        let mut d = Vec::new();
        for (seq, err) in [(2u32, 0i32), (3, -libc::ENOENT)] {
            d.extend_from_slice(&36u32.to_ne_bytes());
            d.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
            d.extend_from_slice(&[0; 10]);
            d.extend_from_slice(&err.to_ne_bytes());
            d.extend_from_slice(&[0; 8]);
            d.extend_from_slice(&seq.to_ne_bytes());
            d.extend_from_slice(&[0; 4]);
        }
        assert_eq!(acks(&d), vec![(2, 0), (3, libc::ENOENT)]);
        // Truncated or nonsense input ends the walk, never panics.
        assert_eq!(acks(&d[..20]), vec![]);
        assert_eq!(acks(&[0xff; 40]), vec![]);
    }
}
