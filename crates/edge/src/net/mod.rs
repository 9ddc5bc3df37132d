//! Sandbox networking: a network namespace per sandbox with a veth to the node and an
//! address from the node's pool ([`link`]), egress denied unless the sandbox's rules
//! ([`rules`]) allow it, enforced with nftables ([`nft`], elements of a fixed ruleset
//! written over netlink, [`nfnl`]), and a DNS proxy ([`dns`]) that
//! is every sandbox's only resolver: it answers allowed names only and opens the answers'
//! addresses to the asking sandbox for their TTL.

pub mod dns;
pub mod guard;
pub mod headers;
pub mod learner;
pub mod link;
pub mod netlink;
pub mod nfnl;
pub mod nft;
pub mod rtnl;
pub mod rules;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use dsec_common::{ApiError, ErrorCode, IoContext, IoFailure};

use crate::config::NetworkConfig;
use link::Slot;
pub use netlink::NetlinkError;
use rules::{Cidr, Policy};

/// What goes wrong with the sandboxes' network.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The node's `[edge.network]` settings: the message names the setting.
    #[error("{0}")]
    Config(String),
    /// `nft -f` refused the node's base ruleset: its output.
    #[error("nft refused the ruleset: {0}")]
    Ruleset(String),
    #[error("the sandbox is gone")]
    SandboxGone,
    #[error("sandbox {id} holds {held} addresses open from DNS answers, the most a sandbox may")]
    TooManyLearned { id: String, held: usize },
    #[error(transparent)]
    Learn(#[from] learner::LearnError),
    #[error("setting up the sandbox's network: {0}")]
    Setup(#[source] NetlinkError),
    #[error("the VM's network in namespace {ns}: {source}")]
    VmNetwork { ns: String, source: NetlinkError },
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error(transparent)]
    Io(#[from] IoFailure),
}

impl crate::error::Coded for NetlinkError {
    fn code(&self) -> ErrorCode {
        ErrorCode::Internal
    }
}

impl crate::error::Coded for NetError {
    fn code(&self) -> ErrorCode {
        match self {
            NetError::Config(_) => ErrorCode::FailedPrecondition,
            NetError::TooManyLearned { .. } => ErrorCode::ResourceExhausted,
            NetError::SandboxGone => ErrorCode::NotFound,
            _ => ErrorCode::Internal,
        }
    }
}

/// Shortest time a DNS answer opens an address for (answers with TTL 0 or 1 still need
/// the connection that follows them to get through).
pub const MIN_TTL: u32 = 2;
/// Longest: a long TTL does not open an address for days.
pub const MAX_TTL: u32 = 3600;
/// Most addresses DNS answers may hold open for one sandbox at a time (a sandbox asking
/// for ever new names under an allowed wildcard does not grow the node's table without
/// bound).
pub const MAX_LEARNED: usize = 4096;

/// The random part of a sandbox id, which names its interface, chain and sets.
pub fn key_of(id: &str) -> &str {
    id.rsplit_once('-').map(|(_, k)| k).unwrap_or(id)
}

#[derive(Debug, Clone)]
struct Attached {
    id: String,
    policy: Policy,
    /// Addresses its DNS answers opened.
    learned: HashMap<Ipv4Addr, Learned>,
}

/// An address a DNS answer opened for a sandbox.
#[derive(Debug, Clone)]
struct Learned {
    /// When the set's element ends.
    until: Instant,
    /// The name asked for.
    name: String,
    /// Whether the element is in the set yet (an answer that finds it still on its way
    /// asks for it again rather than going out before it).
    applied: bool,
}

#[derive(Default)]
struct State {
    used: BTreeSet<u32>,
    /// Where the next free slot is looked for: slots are handed out round the pool, so a
    /// slot just freed (whose veth the kernel may still be tearing down) is not reused at
    /// once.
    cursor: u32,
    /// Sandbox address → its attachment.
    by_ip: HashMap<Ipv4Addr, Attached>,
    /// Sandbox key → its address.
    by_key: HashMap<String, Ipv4Addr>,
}

pub struct Network {
    pub cfg: NetworkConfig,
    catalog: rules::Catalog,
    learner: learner::Learner,
    pool: Cidr,
    pub upstream: Vec<SocketAddr>,
    state: Mutex<State>,
    /// Holds the node's `ip_forward` from before the edge turned it on, to put back at
    /// shutdown (a file, so that it outlives a crashed edge).
    forwarding_file: std::path::PathBuf,
}

const IP_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";

fn resolv_conf_servers() -> Vec<SocketAddr> {
    std::fs::read_to_string("/etc/resolv.conf")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|a| a.trim().parse::<Ipv4Addr>().ok())
        .map(|ip| SocketAddr::from((ip, 53)))
        .collect()
}

impl Network {
    /// Checks the configuration and, when networking is enabled, installs the node's
    /// table and turns on IPv4 forwarding.
    pub fn start(cfg: &NetworkConfig, state_dir: &std::path::Path) -> Result<Network, NetError> {
        let pool = Cidr::parse(&cfg.pool)
            .filter(|p| p.prefix <= 30)
            .ok_or_else(|| {
                NetError::Config(format!(
                    "[edge.network] pool {:?} is not an IPv4 network of /30 or larger",
                    cfg.pool
                ))
            })?;
        let catalog = rules::Catalog::new(&cfg.services, &cfg.private_services, &pool)?;
        let mut upstream = Vec::new();
        for u in &cfg.dns_upstream {
            let a = u
                .parse::<SocketAddr>()
                .or_else(|_| u.parse::<Ipv4Addr>().map(|ip| SocketAddr::from((ip, 53))))
                .map_err(|_| {
                    NetError::Config(format!(
                        "[edge.network] dns_upstream {u:?} is not ip or ip:port"
                    ))
                })?;
            upstream.push(a);
        }
        if upstream.is_empty() {
            upstream = resolv_conf_servers();
        }
        let net = Network {
            cfg: cfg.clone(),
            catalog,
            learner: learner::Learner::start(),
            pool,
            upstream,
            state: Mutex::new(State::default()),
            forwarding_file: state_dir.join("ip_forward.before"),
        };
        if cfg.enabled {
            link::install_gateway(&pool)?;
            nft::apply_script(&nft::base(&pool, cfg.dns_port, cfg.header_port)).map_err(|e| {
                NetError::Ruleset(format!(
                    "{e} (sandbox networking needs nftables; or set [edge.network] enabled = false)"
                ))
            })?;
            if !nft::probe_destroy() {
                tracing::info!(
                    "this kernel has no idempotent nftables element delete (Linux 6.3): a stop deletes elements one by one when some have expired"
                );
            }
            let was = std::fs::read_to_string(IP_FORWARD).unwrap_or_default();
            if was.trim() != "1" {
                if !net.forwarding_file.exists() {
                    std::fs::write(&net.forwarding_file, was.trim())
                        .ctx(|| format!("{}", net.forwarding_file.display()))?;
                }
                std::fs::write(IP_FORWARD, "1")
                    .ctx(|| "turning on IPv4 forwarding for sandbox egress".into())?;
                tracing::info!("turned on IPv4 forwarding (sandbox egress goes through the node)");
            }
        }
        Ok(net)
    }

    pub fn enabled(&self) -> bool {
        self.cfg.enabled
    }

    /// A sandbox's rules and egress headers, checked and compiled.
    pub fn policy(
        &self,
        rules: &BTreeMap<String, bool>,
        headers: &dsec_common::api::EgressHeaders,
    ) -> Result<Policy, ApiError> {
        let mut p = rules::compile(rules, &self.catalog)?;
        p.headers = rules::compile_headers(headers)?;
        Ok(p)
    }

    /// The sandboxes' gateway: the node's address in every sandbox's network.
    pub fn gateway(&self) -> Ipv4Addr {
        link::gateway(&self.pool)
    }

    /// The id of the sandbox whose address `ip` is.
    pub fn sandbox_id_at(&self, ip: Ipv4Addr) -> Option<String> {
        self.lock().by_ip.get(&ip).map(|a| a.id.clone())
    }

    /// Whether `ip` is in the sandboxes' pool.
    pub fn in_pool(&self, ip: Ipv4Addr) -> bool {
        self.pool.contains(ip)
    }

    /// The headers the sandbox at `src` has for a request to `host` that goes to `daddr`.
    /// Without `verified` (plain HTTP, where nothing proves who answers) the address must
    /// be one the sandbox's DNS answer for that very name opened (or the rule's own
    /// address), so a request that names one host but goes to another gets nothing; a
    /// server that proved over TLS that it is `host` may be at any address the sandbox
    /// may reach.
    pub fn headers_for(
        &self,
        src: Ipv4Addr,
        daddr: Ipv4Addr,
        host: &str,
        verified: bool,
    ) -> Option<Vec<(String, String)>> {
        let st = self.lock();
        let a = st.by_ip.get(&src)?;
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        let now = Instant::now();
        let answered = verified
            || a.learned.get(&daddr).is_some_and(|l| {
                l.until > now && l.name.trim_end_matches('.').eq_ignore_ascii_case(&host)
            });
        a.policy
            .headers
            .iter()
            .find(|r| match &r.host {
                rules::HeaderHost::Name(p) => answered && p.matches(&host),
                rules::HeaderHost::Addr(x) => *x == daddr,
            })
            .map(|r| r.headers.clone())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self_lock(&self.state)
    }

    /// Takes a free /30 of the pool.
    pub fn allocate(&self) -> Result<u32, ApiError> {
        let mut st = self.lock();
        let cap = Slot::capacity(&self.pool);
        let start = st.cursor % cap.max(1);
        let free = (start..cap)
            .chain(0..start)
            .find(|i| !st.used.contains(i))
            .ok_or_else(|| {
                ApiError::node_full(format!(
                    "the node's sandbox address pool {} is used up ({cap} sandboxes)",
                    self.pool
                ))
            })?;
        st.used.insert(free);
        st.cursor = free + 1;
        Ok(free)
    }

    fn slot(&self, index: u32) -> Result<Slot, ApiError> {
        Slot::in_pool(&self.pool, index).ok_or_else(|| {
            ApiError::internal(format!(
                "address slot {index} is outside the pool {}",
                self.pool
            ))
        })
    }

    fn register(&self, id: &str, slot: Slot, policy: Policy) {
        let mut st = self.lock();
        st.used.insert(slot.index);
        st.by_key.insert(key_of(id).to_string(), slot.ip);
        st.by_ip.insert(
            slot.ip,
            Attached {
                id: id.to_string(),
                policy,
                learned: HashMap::new(),
            },
        );
    }

    /// Makes the sandbox's namespace, veth and rules (blocking). On error nothing is left.
    pub fn attach(&self, id: &str, index: u32, policy: Policy) -> Result<Slot, ApiError> {
        let slot = self.slot(index)?;
        let k = key_of(id);
        link::create(id, k, &slot)?;
        if let Err(e) = nft::apply(&nft::add_rules(k, &policy)) {
            link::remove(id, k);
            return Err(ApiError::internal(format!(
                "installing the sandbox's egress rules: {e}"
            )));
        }
        self.register(id, slot, policy);
        Ok(slot)
    }

    /// Takes back a running sandbox after a restart: its slot and rules. [`Network::sweep`]
    /// then puts the rules of all of them back in one transaction.
    pub fn adopt(&self, id: &str, index: u32, policy: Policy) -> Result<(), ApiError> {
        let slot = self.slot(index)?;
        self.register(id, slot, policy);
        Ok(())
    }

    /// Removes the sandbox's rules, veth and namespace and frees its slot (blocking;
    /// idempotent, also for a half-made sandbox).
    pub fn detach(&self, id: &str, index: Option<u32>) {
        let k = key_of(id);
        let gone = {
            let mut st = self.lock();
            if let Some(i) = index {
                st.used.remove(&i);
            }
            st.by_key.remove(k).and_then(|ip| st.by_ip.remove(&ip))
        };
        if let Some(a) = gone {
            let learned: Vec<Ipv4Addr> = a.learned.keys().copied().collect();
            let mut msgs = nft::remove_rules(k, &a.policy);
            msgs.extend(nft::forget(k, &learned));
            if let Err(e) = nft::apply_removing(&msgs) {
                tracing::warn!(sandbox = %id, "removing the sandbox's egress rules: {e}");
            }
        }
        self.learner.reset(k, Vec::new());
        link::remove(id, k);
    }

    /// Replaces the rules of a running sandbox. Addresses its DNS answers opened stay open
    /// while their name is still allowed; the others close at once. The node's lock is not
    /// held while the kernel is written to.
    pub fn set_policy(&self, id: &str, policy: Policy) -> Result<(), ApiError> {
        let k = key_of(id).to_string();
        let (old, closing, keep) = {
            let mut st = self.lock();
            let ip = *st.by_key.get(&k).ok_or_else(|| {
                ApiError::precondition(format!(
                    "sandbox {id} has no network (created with network \"none\")"
                ))
            })?;
            let a = st
                .by_ip
                .get_mut(&ip)
                .ok_or_else(|| ApiError::internal("network state lost"))?;
            let now = Instant::now();
            let closing: Vec<Ipv4Addr> = a
                .learned
                .iter()
                .filter(|(_, l)| l.until > now && !policy.allows_name(&l.name))
                .map(|(ip, _)| *ip)
                .collect();
            a.learned
                .retain(|_, l| l.until > now && policy.allows_name(&l.name));
            let keep: Vec<(Ipv4Addr, u32)> = a
                .learned
                .iter()
                .map(|(ip, l)| (*ip, l.until.duration_since(now).as_secs().max(1) as u32))
                .collect();
            (a.policy.clone(), closing, keep)
        };
        // Only what changes: an element in both the old and the new rules stays in.
        let before: std::collections::HashSet<_> = nft::rule_elems(&k, &old).into_iter().collect();
        let after: std::collections::HashSet<_> =
            nft::rule_elems(&k, &policy).into_iter().collect();
        let mut msgs = nft::by_set(
            nft::delete_op(),
            before.difference(&after).cloned().collect(),
        );
        msgs.extend(nft::forget(&k, &closing));
        msgs.extend(nft::by_set(
            nfnl::ElemOp::Add,
            after.difference(&before).cloned().collect(),
        ));
        nft::apply_removing(&msgs).map_err(NetError::from)?;
        self.learner.reset(&k, keep);
        let mut st = self.lock();
        if let Some(ip) = st.by_key.get(&k).copied()
            && let Some(a) = st.by_ip.get_mut(&ip)
        {
            a.policy = policy;
        }
        Ok(())
    }

    /// The sandbox at `ip`, as (id, policy).
    pub fn sandbox_at(&self, ip: Ipv4Addr) -> Option<(String, Policy)> {
        self.lock()
            .by_ip
            .get(&ip)
            .map(|a| (a.id.clone(), a.policy.clone()))
    }

    /// Opens `addrs` (address, TTL, the name asked) to the sandbox at `ip`; returns once
    /// the rule is in (the DNS answer goes out only then), with the TTL to tell the
    /// sandbox for each address: how long the node keeps it open from now. The node's lock
    /// is held only for the bookkeeping; the table is written by the learner, in batches.
    ///
    /// An address already open for at least half its new TTL is left as it is and its
    /// remaining time told instead, so an address answered again and again (a CDN behind
    /// many names, a flood of random names under an allowed wildcard) costs one set update
    /// per half TTL, not one per answer, and the sandbox is never told an address is good
    /// for longer than it is open.
    pub async fn learn(
        &self,
        ip: Ipv4Addr,
        addrs: &[(Ipv4Addr, u32, String)],
    ) -> Result<Vec<u32>, NetError> {
        if addrs.is_empty() {
            return Ok(Vec::new()); // nothing to open (NXDOMAIN, a TXT answer): no work at all
        }
        let (k, add, ttls) = {
            let mut st = self.lock();
            let Some(a) = st.by_ip.get_mut(&ip) else {
                return Err(NetError::SandboxGone);
            };
            let now = Instant::now();
            // What has expired in the set has expired here too.
            a.learned.retain(|_, l| l.until > now);
            if a.learned.len() + addrs.len() > MAX_LEARNED {
                return Err(NetError::TooManyLearned {
                    id: a.id.clone(),
                    held: a.learned.len(),
                });
            }
            let mut add: Vec<(Ipv4Addr, u32)> = Vec::new();
            let mut ttls = Vec::with_capacity(addrs.len());
            for (addr, ttl, _) in addrs {
                let ttl = (*ttl).clamp(MIN_TTL, MAX_TTL);
                let left = a
                    .learned
                    .get(addr)
                    .filter(|l| l.applied)
                    .map(|l| l.until.saturating_duration_since(now).as_secs() as u32)
                    .unwrap_or(0);
                if left >= (ttl / 2).max(MIN_TTL) {
                    ttls.push(left.min(ttl));
                    continue;
                }
                if let Some(same) = add.iter_mut().find(|(x, _)| x == addr) {
                    same.1 = same.1.max(ttl);
                } else {
                    add.push((*addr, ttl));
                }
                ttls.push(ttl);
            }
            for (addr, ttl) in &add {
                let name = addrs
                    .iter()
                    .find(|(x, _, _)| x == addr)
                    .map(|(_, _, n)| n.clone())
                    .unwrap_or_default();
                a.learned.insert(
                    *addr,
                    Learned {
                        until: now + Duration::from_secs(*ttl as u64),
                        name,
                        applied: false,
                    },
                );
            }
            (key_of(&a.id).to_string(), add, ttls)
        };
        if add.is_empty() {
            return Ok(ttls); // every address is open long enough already
        }
        let opened: Vec<Ipv4Addr> = add.iter().map(|(a, _)| *a).collect();
        self.learner.learn(k, add).await?;
        if let Some(a) = self.lock().by_ip.get_mut(&ip) {
            for addr in opened {
                if let Some(l) = a.learned.get_mut(&addr) {
                    l.applied = true;
                }
            }
        }
        Ok(ttls)
    }

    /// Removes namespaces, interfaces and rule chains that belong to no sandbox in `ids`
    /// (left by a crash in the middle of a create or a stop). Namespaces of other edges
    /// (`/run/netns` is shared by every edge on a machine) are not touched.
    pub fn sweep(&self, edge: &str, ids: &[String]) {
        let keys: BTreeSet<&str> = ids.iter().map(|i| key_of(i)).collect();
        let full: BTreeSet<&str> = ids.iter().map(String::as_str).collect();
        let mine = format!("{edge}-");
        for ns in link::namespaces() {
            if ns.starts_with(&mine) && !full.contains(ns.as_str()) {
                tracing::info!(netns = %ns, "removing a sandbox network namespace nothing owns");
                link::remove(&ns, key_of(&ns));
            }
        }
        for k in link::interfaces() {
            if !keys.contains(k.as_str()) {
                let _ = std::process::Command::new("ip")
                    .args(["link", "del", &link::host_iface(&k)])
                    .status();
            }
        }
        for k in nft::legacy_chains() {
            for line in nft::remove_legacy(&k) {
                let _ = nft::apply_script(&line);
            }
        }
        // The rules of every sandbox adopted, back in case the table was lost (what is there
        // already is no error; see `nft::rebuild_rules` for what a gone sandbox left).
        let msgs = {
            let st = self.lock();
            nft::rebuild_rules(st.by_ip.values().map(|a| (key_of(&a.id), &a.policy)))
        };
        if let Err(e) = nft::apply(&msgs) {
            tracing::error!("putting the sandboxes' egress rules back: {e}");
        }
    }

    /// At shutdown with no sandboxes left: removes the table and restores forwarding.
    pub fn shutdown(&self) {
        if !self.cfg.enabled || !self.lock().by_ip.is_empty() {
            return;
        }
        let _ = nft::apply_script(&nft::drop_table());
        link::remove_gateway(&self.pool);
        if let Ok(was) = std::fs::read_to_string(&self.forwarding_file) {
            let _ = std::fs::write(IP_FORWARD, was.trim());
            let _ = std::fs::remove_file(&self.forwarding_file);
        }
    }
}

/// Runs `cmd` with `input` on its stdin; its stderr is the error when it fails.
pub(crate) fn run_with_input(
    mut cmd: std::process::Command,
    input: &str,
    what: &str,
) -> Result<(), NetError> {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .ctx(|| format!("running {what}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(input.as_bytes())
            .ctx(|| format!("writing to {what}"))?;
    }
    let out = child
        .wait_with_output()
        .ctx(|| format!("waiting for {what}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(NetError::Ruleset(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ))
    }
}

fn self_lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
