//! The node's DNS proxy, the only resolver a sandbox has (its DNS to any server on port 53
//! is redirected here). It knows the sandbox by the source address, answers REFUSED for a
//! name its rules do not allow, asks the upstream resolvers for one that is allowed,
//! refuses an answer whose CNAME chain leaves the allowed names, and before answering opens
//! the answer's IPv4 addresses to that sandbox for their TTL. AAAA questions get an empty
//! answer (sandboxes have no IPv6).

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dsec_common::IoFailure;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

use super::rules::Policy;
use super::{NetError, Network};

const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3);
/// Queries one sandbox may send per second, and at once: past them its queries are dropped
/// (UDP) or refused (TCP) before any work, so a sandbox flooding the proxy does not slow
/// the DNS, creates or stops of others.
const RATE_PER_S: f64 = 100.0;
const BURST: f64 = 200.0;
const TCP_IDLE: Duration = Duration::from_secs(10);
const MAX_MESSAGE: usize = 65535;

const TYPE_A: u16 = 1;
const TYPE_CNAME: u16 = 5;
const TYPE_AAAA: u16 = 28;
const RCODE_FORMERR: u8 = 1;
const RCODE_SERVFAIL: u8 = 2;
const RCODE_REFUSED: u8 = 5;

/// A name starting at `off`, following compression pointers (bounded), and the offset
/// after it in the original position.
fn read_name(msg: &[u8], mut off: usize) -> Option<(String, usize)> {
    let mut labels: Vec<String> = Vec::new();
    let mut end = None;
    let mut jumps = 0;
    loop {
        let len = *msg.get(off)? as usize;
        if len & 0xc0 == 0xc0 {
            let ptr = ((len & 0x3f) << 8) | *msg.get(off + 1)? as usize;
            end.get_or_insert(off + 2);
            jumps += 1;
            if jumps > 16 || ptr >= msg.len() {
                return None;
            }
            off = ptr;
        } else if len == 0 {
            let name = labels.join(".").to_ascii_lowercase();
            return (name.len() <= 253).then(|| (name, end.unwrap_or(off + 1)));
        } else if len > 63 {
            return None;
        } else {
            let label = msg.get(off + 1..off + 1 + len)?;
            labels.push(String::from_utf8_lossy(label).into_owned());
            off += 1 + len;
        }
    }
}

fn u16_at(msg: &[u8], off: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*msg.get(off)?, *msg.get(off + 1)?]))
}

fn u32_at(msg: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_be_bytes(msg.get(off..off + 4)?.try_into().ok()?))
}

/// The first question: (name, type), and where the question section ends.
pub fn question(msg: &[u8]) -> Option<(String, u16, usize)> {
    if msg.len() < 12 || u16_at(msg, 4)? == 0 {
        return None;
    }
    let (name, off) = read_name(msg, 12)?;
    let qtype = u16_at(msg, off)?;
    u16_at(msg, off + 2)?;
    Some((name, qtype, off + 4))
}

/// An answer with the query's id and question and `rcode`, no records.
pub fn reply(query: &[u8], rcode: u8) -> Vec<u8> {
    let qend = question(query).map(|q| q.2).unwrap_or(12).min(query.len());
    let mut r = query[..qend].to_vec();
    if r.len() < 12 {
        r.resize(12, 0);
    }
    // QR, opcode from the query, RD copied; RA set.
    r[2] = 0x80 | (query.get(2).copied().unwrap_or(0) & 0x79);
    r[3] = 0x80 | (rcode & 0x0f);
    let qd: u16 = if qend > 12 { 1 } else { 0 };
    r[4..6].copy_from_slice(&qd.to_be_bytes());
    for b in &mut r[6..12] {
        *b = 0;
    }
    r
}

/// What an upstream answer means for the sandbox: the addresses it opens, or why it is
/// refused.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Open(Vec<Opened>),
    Refuse(String),
}

/// An A record of an answer: its address, its TTL and where the TTL sits in the message
/// (the proxy rewrites it to how long the node really keeps the address open).
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub struct Opened {
    pub ip: Ipv4Addr,
    pub ttl: u32,
    pub ttl_at: usize,
}

/// Sets the TTL of each record in `opened` to the matching entry of `ttls`.
pub fn rewrite_ttls(answer: &mut [u8], opened: &[Opened], ttls: &[u32]) {
    for (o, ttl) in opened.iter().zip(ttls) {
        if let Some(field) = answer.get_mut(o.ttl_at..o.ttl_at + 4) {
            field.copy_from_slice(&ttl.to_be_bytes());
        }
    }
}

/// Checks an upstream answer against the policy: every name in its answer section (owner
/// names and CNAME targets) must be allowed.
pub fn judge(answer: &[u8], policy: &Policy) -> Option<Verdict> {
    let (_, _, mut off) = question(answer)?;
    let ancount = u16_at(answer, 6)?;
    let mut addrs = Vec::new();
    for _ in 0..ancount {
        let (owner, next) = read_name(answer, off)?;
        let rtype = u16_at(answer, next)?;
        let ttl = u32_at(answer, next + 4)?;
        let rdlen = u16_at(answer, next + 8)? as usize;
        let rdata = next + 10;
        answer.get(rdata..rdata + rdlen)?;
        if !policy.allows_name(&owner) {
            return Some(Verdict::Refuse(format!("the answer names {owner}")));
        }
        match rtype {
            TYPE_CNAME => {
                let (target, _) = read_name(answer, rdata)?;
                if !policy.allows_name(&target) {
                    return Some(Verdict::Refuse(format!("{owner} is an alias of {target}")));
                }
            }
            TYPE_A if rdlen == 4 => {
                let b = &answer[rdata..rdata + 4];
                addrs.push(Opened {
                    ip: Ipv4Addr::new(b[0], b[1], b[2], b[3]),
                    ttl,
                    ttl_at: next + 4,
                });
            }
            _ => {}
        }
        off = rdata + rdlen;
    }
    Some(Verdict::Open(addrs))
}

/// Why an upstream resolver gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("{upstream}: {source}")]
    Io {
        upstream: SocketAddr,
        source: std::io::Error,
    },
    #[error("{0} did not answer")]
    Silent(SocketAddr),
    #[error("the query is malformed: {0}")]
    BadQuery(&'static str),
    #[error("no randomness for a DNS query id")]
    NoRandomness,
    #[error("no upstream resolver configured")]
    NoUpstream,
}

async fn ask_udp(upstream: SocketAddr, query: &[u8]) -> Result<Vec<u8>, UpstreamError> {
    let io = |source| UpstreamError::Io { upstream, source };
    let sock = UdpSocket::bind("0.0.0.0:0").await.map_err(io)?;
    sock.connect(upstream).await.map_err(io)?;
    // An id of the node's own, not the sandbox's: an answer forged from off the path must
    // guess it as well as the port (and the question must be the one asked).
    let mut sent = query.to_vec();
    let id: [u8; 2] = {
        let mut b = [0u8; 2];
        // SAFETY: a 2-byte buffer for the kernel to fill.
        let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), 2, 0) };
        if n != 2 {
            return Err(UpstreamError::NoRandomness);
        }
        b
    };
    if sent.len() < 12 {
        return Err(UpstreamError::BadQuery("shorter than a header"));
    }
    sent[..2].copy_from_slice(&id);
    let qend = question(query)
        .map(|q| q.2)
        .ok_or(UpstreamError::BadQuery("no question"))?;
    sock.send(&sent).await.map_err(io)?;
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let n = tokio::time::timeout(UPSTREAM_TIMEOUT, sock.recv(&mut buf))
            .await
            .map_err(|_| UpstreamError::Silent(upstream))?
            .map_err(io)?;
        if matches_query(&buf[..n], &sent, qend) {
            buf.truncate(n);
            buf[..2].copy_from_slice(&query[..2]);
            return Ok(buf);
        }
    }
}

/// Whether `answer` answers `sent`: the same id and the same question (names compared
/// without case, as resolvers may change it).
fn matches_query(answer: &[u8], sent: &[u8], qend: usize) -> bool {
    answer.len() >= qend
        && answer[..2] == sent[..2]
        && answer[4..6] == sent[4..6]
        && answer[12..qend].eq_ignore_ascii_case(&sent[12..qend])
}

async fn ask_tcp(upstream: SocketAddr, query: &[u8]) -> Result<Vec<u8>, UpstreamError> {
    let io = |source| UpstreamError::Io { upstream, source };
    let call = async {
        let mut s = TcpStream::connect(upstream).await.map_err(io)?;
        let len = u16::try_from(query.len()).map_err(|_| UpstreamError::BadQuery("too long"))?;
        s.write_all(&len.to_be_bytes()).await.map_err(io)?;
        s.write_all(query).await.map_err(io)?;
        let n = s.read_u16().await.map_err(io)? as usize;
        let mut buf = vec![0u8; n];
        s.read_exact(&mut buf).await.map_err(io)?;
        Ok(buf)
    };
    tokio::time::timeout(UPSTREAM_TIMEOUT, call)
        .await
        .map_err(|_| UpstreamError::Silent(upstream))?
}

/// The answer to `query` from the sandbox at `src` (none to a message too short to
/// answer), counted by outcome.
async fn answer(net: &Arc<Network>, src: Ipv4Addr, query: &[u8], tcp: bool) -> Option<Vec<u8>> {
    let (r, outcome) = judged(net, src, query, tcp).await?;
    dsec_metrics::net::dns_answered(outcome);
    Some(r)
}

/// [`answer`]'s work: the answer and its outcome's name.
async fn judged(
    net: &Arc<Network>,
    src: Ipv4Addr,
    query: &[u8],
    tcp: bool,
) -> Option<(Vec<u8>, &'static str)> {
    if query.len() < 12 {
        return None;
    }
    let Some((name, qtype, _)) = question(query) else {
        return Some((reply(query, RCODE_FORMERR), "malformed"));
    };
    let Some((id, policy)) = net.sandbox_at(src) else {
        return Some((reply(query, RCODE_REFUSED), "unknown_source"));
    };
    if !policy.allows_name(&name) {
        tracing::debug!(sandbox = %id, %name, "DNS refused: not allowed");
        return Some((reply(query, RCODE_REFUSED), "refused"));
    }
    if qtype == TYPE_AAAA {
        return Some((reply(query, 0), "answered"));
    }
    let mut last = UpstreamError::NoUpstream;
    for up in &net.upstream {
        let got = if tcp {
            ask_tcp(*up, query).await
        } else {
            ask_udp(*up, query).await
        };
        let resp = match got {
            Ok(r) => r,
            Err(e) => {
                last = e;
                continue;
            }
        };
        return Some(match judge(&resp, &policy) {
            None => (reply(query, RCODE_SERVFAIL), "servfail"),
            Some(Verdict::Refuse(why)) => {
                tracing::info!(sandbox = %id, %name, "DNS refused: {why}");
                (reply(query, RCODE_REFUSED), "refused")
            }
            Some(Verdict::Open(opened)) => {
                let named: Vec<(Ipv4Addr, u32, String)> =
                    opened.iter().map(|o| (o.ip, o.ttl, name.clone())).collect();
                let started = Instant::now();
                let learned = net.learn(src, &named).await;
                dsec_metrics::net::netfilter_took("learn", started.elapsed().as_secs_f64());
                match learned {
                    Ok(ttls) => {
                        let mut resp = resp;
                        rewrite_ttls(&mut resp, &opened, &ttls);
                        (resp, "answered")
                    }
                    Err(e) => {
                        tracing::warn!(sandbox = %id, "opening the answer's addresses: {e}");
                        (reply(query, RCODE_SERVFAIL), "servfail")
                    }
                }
            }
        });
    }
    tracing::warn!(%name, "no DNS upstream answered: {last}");
    Some((reply(query, RCODE_SERVFAIL), "servfail"))
}

fn v4(a: SocketAddr) -> Option<Ipv4Addr> {
    match a {
        SocketAddr::V4(a) => Some(*a.ip()),
        SocketAddr::V6(a) => a.ip().to_ipv4_mapped(),
    }
}

/// A token bucket per source address.
#[derive(Default)]
struct Limiter {
    buckets: std::sync::Mutex<std::collections::HashMap<Ipv4Addr, (f64, Instant)>>,
}

impl Limiter {
    fn allow(&self, ip: Ipv4Addr, now: Instant) -> bool {
        let mut m = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if m.len() > 65536 {
            m.retain(|_, (_, t)| now.duration_since(*t) < Duration::from_secs(60));
        }
        let (tokens, last) = m.entry(ip).or_insert((BURST, now));
        *tokens = (*tokens + now.duration_since(*last).as_secs_f64() * RATE_PER_S).min(BURST);
        *last = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Serves DNS on UDP and TCP `0.0.0.0:<dns_port>` until the tasks are dropped.
pub async fn spawn(net: Arc<Network>) -> Result<Vec<tokio::task::JoinHandle<()>>, NetError> {
    let addr = SocketAddr::from(([0, 0, 0, 0], net.cfg.dns_port));
    let hint = "(is another dsec edge running in this network namespace? one node per namespace, or give this one [edge.network] enabled = false)";
    let udp = Arc::new(
        UdpSocket::bind(addr)
            .await
            .map_err(|e| IoFailure::new(format!("DNS proxy on udp {addr} {hint}"), e))?,
    );
    let tcp = TcpListener::bind(addr)
        .await
        .map_err(|e| IoFailure::new(format!("DNS proxy on tcp {addr} {hint}"), e))?;
    let n1 = net.clone();
    let limiter = Arc::new(Limiter::default());
    let l1 = limiter.clone();
    let udp_task = tokio::spawn(async move {
        let mut buf = vec![0u8; MAX_MESSAGE];
        loop {
            let Ok((n, from)) = udp.recv_from(&mut buf).await else {
                continue;
            };
            let Some(src) = v4(from) else { continue };
            if !l1.allow(src, Instant::now()) {
                dsec_metrics::net::dns_answered("rate_limited");
                continue;
            }
            let query = buf[..n].to_vec();
            let (net, udp) = (n1.clone(), udp.clone());
            tokio::spawn(async move {
                if let Some(r) = answer(&net, src, &query, false).await {
                    let _ = udp.send_to(&r, from).await;
                }
            });
        }
    });
    let tcp_task = tokio::spawn(async move {
        loop {
            let Ok((mut s, from)) = tcp.accept().await else {
                continue;
            };
            let Some(src) = v4(from) else { continue };
            let (net, limiter) = (net.clone(), limiter.clone());
            tokio::spawn(async move {
                loop {
                    let Ok(Ok(n)) = tokio::time::timeout(TCP_IDLE, s.read_u16()).await else {
                        return;
                    };
                    let mut q = vec![0u8; n as usize];
                    if s.read_exact(&mut q).await.is_err() {
                        return;
                    }
                    let r = if limiter.allow(src, Instant::now()) {
                        answer(&net, src, &q, true).await
                    } else {
                        dsec_metrics::net::dns_answered("rate_limited");
                        (q.len() >= 12).then(|| reply(&q, RCODE_REFUSED))
                    };
                    let Some(r) = r else {
                        return;
                    };
                    let Ok(len) = u16::try_from(r.len()) else {
                        return;
                    };
                    if s.write_all(&len.to_be_bytes()).await.is_err()
                        || s.write_all(&r).await.is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    Ok(vec![udp_task, tcp_task])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_answer_to_the_question_asked_counts() {
        let q = query("pypi.test", TYPE_A);
        let qend = question(&q).unwrap().2;
        let mut same = q.clone();
        same[2] |= 0x80;
        assert!(matches_query(&same, &q, qend));
        // a resolver that changed the name's case answers the same question
        let upper = query("PYPI.test", TYPE_A);
        assert!(matches_query(&upper, &q, qend));
        // another name, another type, another id: not this query's answer
        assert!(!matches_query(&query("evil.test", TYPE_A), &q, qend));
        assert!(!matches_query(&query("pypi.test", 28), &q, qend));
        let mut other_id = q.clone();
        other_id[0] ^= 1;
        assert!(!matches_query(&other_id, &q, qend));
        assert!(!matches_query(&q[..qend - 1], &q, qend));
    }

    /// Fuzz target: any query from a sandbox, and any answer from upstream, is read (or
    /// refused) without a panic; a judged answer opens only addresses it carries.
    #[test]
    fn fuzz_messages() {
        let p = policy(&["*.example.com", "example.com"]);
        bolero::check!()
            .with_iterations(2000)
            .for_each(|input: &[u8]| {
                let _ = question(input);
                let _ = read_name(input, 12);
                if let Some(Verdict::Open(opened)) = judge(input, &p) {
                    for o in &opened {
                        let b = o.ip.octets();
                        assert!(
                            input.windows(4).any(|w| w == b),
                            "{} is not in the answer",
                            o.ip
                        );
                        assert_eq!(u32_at(input, o.ttl_at), Some(o.ttl));
                    }
                    let mut copy = input.to_vec();
                    let ttls: Vec<u32> = opened.iter().map(|_| 7).collect();
                    rewrite_ttls(&mut copy, &opened, &ttls);
                    assert_eq!(
                        judge(&copy, &p).map(|v| match v {
                            Verdict::Open(o) => o.iter().all(|o| o.ttl == 7),
                            Verdict::Refuse(_) => false,
                        }),
                        Some(true)
                    );
                }
                if input.len() >= 12 {
                    let r = reply(input, RCODE_REFUSED);
                    assert_eq!(r[..2], input[..2]);
                }
            });
    }
    use crate::net::rules::DomainPattern;

    fn name(n: &str) -> Vec<u8> {
        let mut v = Vec::new();
        for l in n.split('.') {
            v.push(l.len() as u8);
            v.extend_from_slice(l.as_bytes());
        }
        v.push(0);
        v
    }

    fn query(n: &str, qtype: u16) -> Vec<u8> {
        let mut m = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        m.extend(name(n));
        m.extend(qtype.to_be_bytes());
        m.extend(1u16.to_be_bytes());
        m
    }

    /// An answer to `q` with records (owner as a pointer to the question, or a full name).
    fn answer_with(q: &[u8], records: &[(Option<&str>, u16, u32, Vec<u8>)]) -> Vec<u8> {
        let mut m = q.to_vec();
        m[2] = 0x81;
        m[3] = 0x80;
        m[6..8].copy_from_slice(&(records.len() as u16).to_be_bytes());
        for (owner, t, ttl, rdata) in records {
            match owner {
                None => m.extend([0xc0, 12]),
                Some(o) => m.extend(name(o)),
            }
            m.extend(t.to_be_bytes());
            m.extend(1u16.to_be_bytes());
            m.extend(ttl.to_be_bytes());
            m.extend((rdata.len() as u16).to_be_bytes());
            m.extend(rdata);
        }
        m
    }

    #[test]
    fn a_flooding_sandbox_is_held_to_its_rate_and_others_are_not() {
        let l = Limiter::default();
        let t0 = Instant::now();
        let (flood, quiet) = (Ipv4Addr::new(10, 200, 0, 2), Ipv4Addr::new(10, 200, 0, 6));
        let allowed = (0..10_000).filter(|_| l.allow(flood, t0)).count();
        assert_eq!(
            allowed, BURST as usize,
            "a burst, then nothing at the same instant"
        );
        assert!(l.allow(quiet, t0), "another sandbox is not held back");
        let later = t0 + Duration::from_millis(500);
        let refilled = (0..10_000).filter(|_| l.allow(flood, later)).count();
        assert_eq!(refilled, (RATE_PER_S / 2.0) as usize);
    }

    fn policy(domains: &[&str]) -> Policy {
        Policy {
            domains: domains
                .iter()
                .filter_map(|d| DomainPattern::parse(d))
                .collect(),
            ..Policy::default()
        }
    }

    #[test]
    fn questions_parse_and_refusals_keep_the_question() {
        let q = query("PyPI.test", TYPE_A);
        assert_eq!(
            question(&q).map(|x| (x.0, x.1)),
            Some(("pypi.test".into(), TYPE_A))
        );
        let r = reply(&q, RCODE_REFUSED);
        assert_eq!(&r[..2], &[0x12, 0x34]);
        assert_eq!(r[3] & 0x0f, RCODE_REFUSED);
        assert_eq!(r.len(), q.len());
        assert!(question(&[0u8; 5]).is_none());
        // A pointer loop does not hang the parser.
        let mut bad = vec![0u8; 12];
        bad[5] = 1;
        bad.extend([0xc0, 12]);
        assert!(question(&bad).is_none());
    }

    #[test]
    fn answers_open_their_addresses_only_if_every_name_is_allowed() {
        let p = policy(&["pypi.test", "*.cdn.test"]);
        let q = query("pypi.test", TYPE_A);
        let ok = answer_with(&q, &[(None, TYPE_A, 30, vec![203, 0, 113, 10])]);
        let Some(Verdict::Open(opened)) = judge(&ok, &p) else {
            panic!("not opened");
        };
        assert_eq!(
            opened.iter().map(|o| (o.ip, o.ttl)).collect::<Vec<_>>(),
            vec![("203.0.113.10".parse().unwrap(), 30)]
        );
        let cname_in = answer_with(
            &q,
            &[
                (None, TYPE_CNAME, 30, name("a.cdn.test")),
                (Some("a.cdn.test"), TYPE_A, 5, vec![203, 0, 113, 11]),
            ],
        );
        assert!(matches!(judge(&cname_in, &p), Some(Verdict::Open(v)) if v.len() == 1));
        let cname_out = answer_with(
            &q,
            &[
                (None, TYPE_CNAME, 30, name("other.test")),
                (Some("other.test"), TYPE_A, 5, vec![203, 0, 113, 20]),
            ],
        );
        assert!(
            matches!(judge(&cname_out, &p), Some(Verdict::Refuse(w)) if w.contains("other.test"))
        );
        // Truncated records are rejected, not read past the end.
        assert_eq!(judge(&ok[..ok.len() - 2], &p), None);
    }
}
