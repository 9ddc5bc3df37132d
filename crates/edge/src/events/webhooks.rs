//! Webhooks: a project's events POSTed to a URL, signed, in order, retried with backoff,
//! with a log of each try. Registrations are kept in `<state_dir>/webhooks.json` (with
//! their secrets, mode 0600); each has one task that sends its queue's head until it is
//! delivered or given up, so a receiver sees the events in the order they happened.
//!
//! The URL is a tenant's input and the node sends the requests: every address a delivery
//! connects to must be public (or in `webhook_allow`), checked for the addresses the name
//! resolves to at the time of sending (not at registration, which a DNS change would get
//! round), and redirects are not followed.
//!
//! Signature: `X-Dsec-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret,
//! "<t>.<body>")>`; a receiver recomputes it and refuses stale `t`. A webhook made with
//! `format: "e2b"` (the E2B gateway's `/events/webhooks`) gets E2B's event bodies and
//! headers instead, signed as E2B signs (`e2b-signature`: SHA-256 of secret and body).

use std::collections::{BTreeMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_lc_rs::hmac;
use dsec_common::ApiError;
use dsec_common::api::{
    Delivery, Event, WebhookFormat, WebhookInfo, WebhookRequest, WebhookUpdate,
};
use dsec_common::now_ms;
use tokio::sync::Notify;

use crate::config::EventsConfig;
use crate::net::rules::Cidr;

/// Tries kept per webhook in its delivery log.
const LOG_KEPT: usize = 200;
/// Webhooks the keys of one project may have in its whole subtree, so that no tenant
/// takes the node's all.
pub const PER_PROJECT: usize = 32;
/// The longest URL a webhook may have.
const MAX_URL: usize = 2048;
/// The longest name, and the shortest and longest secret a caller may choose.
const MAX_NAME: usize = 128;
const SECRET_BYTES: std::ops::RangeInclusive<usize> = 16..=256;
/// Name lookups of webhook hosts at once (each holds a thread of the blocking pool that
/// the edge's own work shares), and how long one may take.
const LOOKUPS_AT_ONCE: usize = 16;
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);
/// The event types there are.
pub use dsec_common::api::EVENT_TYPES as TYPES;

pub struct Webhooks {
    path: PathBuf,
    attempts: u32,
    max: usize,
    queue_max: usize,
    allow: Arc<Vec<Cidr>>,
    client: reqwest::Client,
    hooks: Mutex<BTreeMap<String, Arc<Hook>>>,
    /// Held across a change and its save, so saves never interleave and limits hold.
    changes: Mutex<()>,
}

struct Hook {
    id: String,
    /// What `PATCH` may change (url, types, name, enabled); the rest stays as made.
    info: Mutex<WebhookInfo>,
    queue: Mutex<VecDeque<Arc<Event>>>,
    wake: Notify,
    log: Mutex<VecDeque<Delivery>>,
    gone: AtomicBool,
}

impl Webhooks {
    pub(super) fn start(cfg: &EventsConfig, state_dir: &Path) -> Result<Arc<Webhooks>, ApiError> {
        let mut allow = Vec::new();
        for c in &cfg.webhook_allow {
            allow.push(Cidr::parse(c).ok_or_else(|| {
                ApiError::invalid(format!(
                    "[edge.events] webhook_allow: {c:?} is not an IPv4 CIDR"
                ))
            })?);
        }
        let allow = Arc::new(allow);
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .timeout(Duration::from_secs(cfg.webhook_timeout_seconds.max(1)))
            .dns_resolver(Arc::new(CheckedResolver {
                allow: allow.clone(),
            }))
            .user_agent("dsec-webhooks")
            .build()
            .map_err(|e| ApiError::internal(format!("webhook client: {e}")))?;
        let path = state_dir.join("webhooks.json");
        let saved: Vec<WebhookInfo> = match std::fs::read(&path) {
            Ok(b) => match serde_json::from_slice(&b) {
                Ok(v) => v,
                Err(e) => {
                    // Set aside, not fatal: the node starts, without these webhooks.
                    let aside = path.with_extension("json.unreadable");
                    tracing::warn!(
                        "{} is not readable ({e}); moved to {} and starting without webhooks",
                        path.display(),
                        aside.display()
                    );
                    let _ = std::fs::rename(&path, &aside);
                    Vec::new()
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(ApiError::internal(format!("{}: {e}", path.display()))),
        };
        let w = Arc::new(Webhooks {
            path,
            attempts: cfg.webhook_attempts.max(1),
            max: cfg.max_webhooks,
            queue_max: cfg.webhook_queue.max(1),
            allow,
            client,
            hooks: Mutex::new(BTreeMap::new()),
            changes: Mutex::new(()),
        });
        for info in saved {
            w.spawn(info);
        }
        Ok(w)
    }

    fn spawn(self: &Arc<Self>, info: WebhookInfo) {
        let hook = Arc::new(Hook {
            id: info.id.clone(),
            info: Mutex::new(info),
            queue: Mutex::new(VecDeque::new()),
            wake: Notify::new(),
            log: Mutex::new(VecDeque::new()),
            gone: AtomicBool::new(false),
        });
        self.hooks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(hook.id.clone(), hook.clone());
        tokio::spawn(deliver_loop(self.clone(), hook));
    }

    /// Queues `ev` for every webhook of its project (or a parent) that wants its type.
    pub(super) fn dispatch(&self, ev: &Arc<Event>) {
        let hooks = self.hooks.lock().unwrap_or_else(|p| p.into_inner());
        for h in hooks.values() {
            let wanted = {
                let i = h.info.lock().unwrap_or_else(|p| p.into_inner());
                i.enabled
                    && dsec_common::project::within(&ev.project, &i.project)
                    && (i.types.is_empty() || i.types.iter().any(|t| *t == ev.kind))
                    // E2B has no word for some types; such a webhook is not sent them.
                    && (i.format.is_dsec() || dsec_common::e2b::e2b_type(&ev.kind).is_some())
            };
            if !wanted {
                continue;
            }
            let dropped = {
                let mut q = h.queue.lock().unwrap_or_else(|p| p.into_inner());
                q.push_back(ev.clone());
                (q.len() > self.queue_max).then(|| q.pop_front()).flatten()
            };
            if let Some(d) = dropped {
                h.record(Delivery {
                    event: d.id.clone(),
                    kind: d.kind.clone(),
                    attempt: 0,
                    at_ms: now_ms(),
                    took_ms: 0,
                    status: None,
                    ok: false,
                    error: Some("dropped: the webhook's queue was full".into()),
                });
            }
            h.wake.notify_one();
        }
    }

    pub(super) fn add(
        self: &Arc<Self>,
        mut req: WebhookRequest,
        project: String,
        owner: &str,
    ) -> Result<WebhookInfo, ApiError> {
        if req.url.len() > MAX_URL {
            return Err(ApiError::invalid(format!(
                "webhook url is {} bytes; at most {MAX_URL}",
                req.url.len()
            )));
        }
        check_url(&req.url, &self.allow)?;
        check_types(&mut req.types)?;
        if let Some(n) = &req.name {
            check_name(n)?;
        }
        if let Some(s) = &req.secret
            && (!SECRET_BYTES.contains(&s.len()) || s.chars().any(char::is_control))
        {
            return Err(ApiError::invalid(format!(
                "webhook secret: {} to {} bytes without control characters; it is {} bytes",
                SECRET_BYTES.start(),
                SECRET_BYTES.end(),
                s.len()
            )));
        }
        let _change = self.changes.lock().unwrap_or_else(|p| p.into_inner());
        let info = WebhookInfo {
            id: format!("wh-{}", dsec_common::id::random_hex(8)),
            url: req.url,
            project,
            types: req.types,
            created_at_ms: now_ms(),
            secret: Some(
                req.secret
                    .unwrap_or_else(|| format!("whsec_{}", dsec_common::id::random_hex(24))),
            ),
            name: req.name,
            enabled: req.enabled.unwrap_or(true),
            format: req.format.unwrap_or_default(),
        };
        {
            let hooks = self.hooks.lock().unwrap_or_else(|p| p.into_inner());
            if hooks.len() >= self.max {
                return Err(ApiError::exhausted(format!(
                    "this node keeps at most {} webhooks ([edge.events] max_webhooks)",
                    self.max
                )));
            }
            let mine = hooks
                .values()
                .filter(|h| {
                    let i = h.info.lock().unwrap_or_else(|p| p.into_inner());
                    dsec_common::project::within(&i.project, owner)
                })
                .count();
            if mine >= PER_PROJECT {
                return Err(ApiError::exhausted(format!(
                    "project {owner} and the projects inside it have {PER_PROJECT} webhooks, the most they may have; remove one first"
                )));
            }
        }
        self.spawn(info.clone());
        if let Err(e) = self.save() {
            self.forget(&info.id);
            return Err(e);
        }
        Ok(info)
    }

    pub(super) fn list(&self, visible: impl Fn(&str) -> bool) -> Vec<WebhookInfo> {
        self.hooks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|h| h.shown())
            .filter(|i| visible(&i.project))
            .collect()
    }

    /// Changes a webhook's url, types, name or whether it is sent events; events already
    /// queued go to the new url.
    pub(super) fn update(&self, id: &str, u: WebhookUpdate) -> Result<WebhookInfo, ApiError> {
        let WebhookUpdate {
            url,
            mut types,
            name,
            enabled,
        } = u;
        if let Some(url) = &url {
            if url.len() > MAX_URL {
                return Err(ApiError::invalid(format!(
                    "webhook url is {} bytes; at most {MAX_URL}",
                    url.len()
                )));
            }
            check_url(url, &self.allow)?;
        }
        if let Some(t) = &mut types {
            check_types(t)?;
        }
        if let Some(n) = &name {
            check_name(n)?;
        }
        let _change = self.changes.lock().unwrap_or_else(|p| p.into_inner());
        let hook = self
            .hooks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
            .ok_or_else(|| ApiError::not_found(format!("webhook {id} does not exist")))?;
        let before = hook.info();
        {
            let mut i = hook.info.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(url) = url {
                i.url = url;
            }
            if let Some(t) = types {
                i.types = t;
            }
            if let Some(n) = name {
                i.name = Some(n);
            }
            if let Some(e) = enabled {
                i.enabled = e;
            }
        }
        if let Err(e) = self.save() {
            *hook.info.lock().unwrap_or_else(|p| p.into_inner()) = before;
            return Err(e);
        }
        hook.wake.notify_one();
        Ok(hook.shown())
    }

    pub(super) fn get(&self, id: &str) -> Option<WebhookInfo> {
        let hooks = self.hooks.lock().unwrap_or_else(|p| p.into_inner());
        hooks.get(id).map(|h| h.shown())
    }

    pub(super) fn remove(&self, id: &str) -> Result<(), ApiError> {
        let _change = self.changes.lock().unwrap_or_else(|p| p.into_inner());
        if !self.forget(id) {
            return Err(ApiError::not_found(format!("webhook {id} does not exist")));
        }
        self.save()
    }

    /// Drops a webhook and ends its task; false if there was none.
    fn forget(&self, id: &str) -> bool {
        let h = self
            .hooks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        match h {
            Some(h) => {
                h.gone.store(true, Ordering::SeqCst);
                h.wake.notify_one();
                true
            }
            None => false,
        }
    }

    pub(super) fn deliveries(&self, id: &str) -> Option<Vec<Delivery>> {
        let hooks = self.hooks.lock().unwrap_or_else(|p| p.into_inner());
        let h = hooks.get(id)?;
        let log = h.log.lock().unwrap_or_else(|p| p.into_inner());
        Some(log.iter().cloned().collect())
    }

    /// Writes the registrations (secrets included) to a new file renamed over the old.
    fn save(&self) -> Result<(), ApiError> {
        let all: Vec<WebhookInfo> = self
            .hooks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|h| h.info())
            .collect();
        let body =
            serde_json::to_vec_pretty(&all).map_err(|e| ApiError::internal(e.to_string()))?;
        let tmp = self.path.with_extension("json.tmp");
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(&body)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &self.path)
        };
        write().map_err(|e| ApiError::internal(format!("{}: {e}", self.path.display())))
    }
}

impl Hook {
    fn info(&self) -> WebhookInfo {
        self.info.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The webhook as the API shows it: without its secret.
    fn shown(&self) -> WebhookInfo {
        WebhookInfo {
            secret: None,
            ..self.info()
        }
    }

    fn record(&self, d: Delivery) {
        let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        log.push_back(d);
        while log.len() > LOG_KEPT {
            log.pop_front();
        }
    }
}

/// Sends the hook's queue in order: the head until delivered or given up, then the next.
async fn deliver_loop(hooks: Arc<Webhooks>, hook: Arc<Hook>) {
    let (secret, format) = {
        let i = hook.info();
        (i.secret.unwrap_or_default(), i.format)
    };
    let signer = Signer {
        key: hmac::Key::new(hmac::HMAC_SHA256, secret.as_bytes()),
        secret,
        format,
    };
    loop {
        if hook.gone.load(Ordering::SeqCst) {
            return;
        }
        let head = hook
            .queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .front()
            .cloned();
        let Some(ev) = head else {
            // A notify_one sent while nothing waited is kept, so none is missed.
            hook.wake.notified().await;
            continue;
        };
        let body = match format {
            WebhookFormat::Dsec => serde_json::to_vec(ev.as_ref()).unwrap_or_default(),
            WebhookFormat::E2b => dsec_common::e2b::event(&ev)
                .map(|v| v.to_string().into_bytes())
                .unwrap_or_default(),
        };
        let mut wait = Duration::from_secs(1);
        for attempt in 1..=hooks.attempts {
            if hook.gone.load(Ordering::SeqCst) {
                return;
            }
            let started = Instant::now();
            let url = hook.info().url;
            let r = send(&hooks, &hook.id, &url, &signer, &ev, &body, attempt).await;
            let ok = matches!(r, Ok(s) if (200..300).contains(&s));
            let last = attempt == hooks.attempts;
            let error = match &r {
                Ok(s) if !ok => Some(format!("answered {s}")),
                Err(e) => Some(e.clone()),
                _ => None,
            }
            .map(|e| if last { format!("{e}; given up") } else { e });
            hook.record(Delivery {
                event: ev.id.clone(),
                kind: ev.kind.clone(),
                attempt,
                at_ms: now_ms(),
                took_ms: started.elapsed().as_millis() as u64,
                status: r.ok(),
                ok,
                error,
            });
            if ok {
                break;
            }
            if !last {
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(60));
            } else {
                tracing::warn!(webhook = %hook.id, event = %ev.id, "webhook delivery given up");
            }
        }
        let mut q = hook.queue.lock().unwrap_or_else(|p| p.into_inner());
        if q.front().is_some_and(|e| Arc::ptr_eq(e, &ev)) {
            q.pop_front();
        }
    }
}

/// How a webhook's deliveries are signed.
struct Signer {
    key: hmac::Key,
    secret: String,
    format: WebhookFormat,
}

impl Signer {
    /// The headers that name and sign one try.
    fn headers(
        &self,
        hook: &str,
        ev: &Event,
        body: &[u8],
        attempt: u32,
    ) -> Vec<(&'static str, String)> {
        match self.format {
            WebhookFormat::Dsec => {
                let t = now_ms() / 1000;
                let mut signed = format!("{t}.").into_bytes();
                signed.extend_from_slice(body);
                let sig = hex::encode(hmac::sign(&self.key, &signed).as_ref());
                vec![
                    ("x-dsec-event", ev.kind.clone()),
                    ("x-dsec-delivery", ev.id.clone()),
                    ("x-dsec-signature", format!("t={t},v1={sig}")),
                ]
            }
            WebhookFormat::E2b => vec![
                ("e2b-webhook-id", hook.to_string()),
                ("e2b-delivery-id", format!("{}-{attempt}", ev.id)),
                ("e2b-signature-version", "v1".to_string()),
                ("e2b-signature", e2b_signature(&self.secret, body)),
            ],
        }
    }
}

/// E2B's webhook signature: SHA-256 of the secret followed by the body, in unpadded
/// URL-safe base64. (Not an HMAC; it is what E2B's receivers check.)
fn e2b_signature(secret: &str, body: &[u8]) -> String {
    use base64::Engine;
    let mut d = aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256);
    d.update(secret.as_bytes());
    d.update(body);
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(d.finish().as_ref())
}

/// One try: the receiver's status, or why there was none.
async fn send(
    hooks: &Webhooks,
    hook: &str,
    url: &str,
    signer: &Signer,
    ev: &Event,
    body: &[u8],
    attempt: u32,
) -> Result<u16, String> {
    // A literal address does not go through the resolver: checked here.
    check_url(url, &hooks.allow).map_err(|e| e.message)?;
    let mut req = hooks
        .client
        .post(url)
        .header("content-type", "application/json");
    for (k, v) in signer.headers(hook, ev, body, attempt) {
        req = req.header(k, v);
    }
    let r = req.body(body.to_vec()).send().await.map_err(|e| {
        // Told in general terms: the log is the tenant's, and details (which address
        // refused, how) would let it probe the node's network.
        if is_refused_name(&e) {
            "refused: the host is not a public address".to_string()
        } else if e.is_timeout() {
            "no answer in time".to_string()
        } else if e.is_connect() {
            "could not connect".to_string()
        } else {
            "the request failed".to_string()
        }
    })?;
    Ok(r.status().as_u16())
}

fn check_types(types: &mut Vec<String>) -> Result<(), ApiError> {
    for t in types.iter() {
        if !TYPES.contains(&t.as_str()) {
            return Err(ApiError::invalid(format!(
                "unknown event type {t:?}; the types are {}",
                TYPES.join(", ")
            )));
        }
    }
    types.sort();
    types.dedup();
    Ok(())
}

fn check_name(n: &str) -> Result<(), ApiError> {
    if n.len() > MAX_NAME || n.chars().any(char::is_control) {
        return Err(ApiError::invalid(format!(
            "webhook name: at most {MAX_NAME} bytes without control characters"
        )));
    }
    Ok(())
}

/// Whether a failed request was the resolver's refusal of the host's addresses.
fn is_refused_name(e: &reqwest::Error) -> bool {
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        if s.to_string().starts_with(REFUSED) {
            return true;
        }
        src = s.source();
    }
    false
}

const REFUSED: &str = "webhooks are not sent to";

/// A webhook URL must be http(s), have a host, and (when the host is an address) be an
/// address deliveries may go to.
fn check_url(url: &str, allow: &[Cidr]) -> Result<(), ApiError> {
    let u = reqwest::Url::parse(url)
        .map_err(|e| ApiError::invalid(format!("webhook url {url:?} is not a URL: {e}")))?;
    if u.scheme() != "http" && u.scheme() != "https" {
        return Err(ApiError::invalid(format!(
            "webhook url {url:?}: only http:// and https:// are sent to"
        )));
    }
    if !u.username().is_empty() || u.password().is_some() {
        return Err(ApiError::invalid(
            "webhook url: credentials in the URL are refused; check the signature instead",
        ));
    }
    let host = u
        .host_str()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| ApiError::invalid(format!("webhook url {url:?} has no host")))?;
    // The URL parser has already made `http://2130706433/` and the like dotted quads.
    match host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
    {
        Ok(ip) => allowed(ip, allow),
        Err(_) => Ok(()),
    }
}

fn allowed(ip: IpAddr, allow: &[Cidr]) -> Result<(), ApiError> {
    let v4 = match ip {
        IpAddr::V4(a) => Some(a),
        IpAddr::V6(a) => a.to_ipv4_mapped(),
    };
    if let Some(a) = v4
        && allow.iter().any(|c| c.contains(a))
    {
        return Ok(());
    }
    if public(ip) {
        return Ok(());
    }
    Err(ApiError::invalid(format!(
        "webhooks are not sent to {ip}: a loopback, private or otherwise special address \
         (the node's [edge.events] webhook_allow lets such networks through)"
    )))
}

/// Whether `ip` is a public unicast address.
fn public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(a) => public_v4(a),
        IpAddr::V6(a) => {
            if let Some(v4) = a.to_ipv4_mapped() {
                return public_v4(v4);
            }
            let s = a.segments();
            !(a.is_loopback()
                || a.is_unspecified()
                || a.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00 // unique local
                || (s[0] & 0xffc0) == 0xfe80 // link-local
                || (s[0] & 0xffc0) == 0xfec0 // site-local
                || (s[0] == 0x2001 && s[1] == 0x0db8) // documentation
                || (s[0] == 0x0064 && s[1] == 0xff9b) // NAT64, may reach IPv4 private
                || (s[0] == 0x2002) // 6to4, may embed anything
                || a == Ipv6Addr::from([0, 0, 0, 0, 0, 0, s[6], s[7]])) // IPv4-compatible
        }
    }
}

fn public_v4(a: Ipv4Addr) -> bool {
    let o = a.octets();
    !(a.is_loopback()
        || a.is_private()
        || a.is_link_local()
        || a.is_broadcast()
        || a.is_multicast()
        || a.is_unspecified()
        || a.is_documentation()
        || o[0] == 0
        || (o[0] == 100 && (o[1] & 0xc0) == 64) // shared (CGNAT)
        || (o[0] == 192 && o[1] == 0 && o[2] == 0) // IETF protocol assignments
        || (o[0] == 198 && (o[1] & 0xfe) == 18) // benchmarking
        || o[0] >= 240)
}

static LOOKUPS: std::sync::LazyLock<Arc<tokio::sync::Semaphore>> =
    std::sync::LazyLock::new(|| Arc::new(tokio::sync::Semaphore::new(LOOKUPS_AT_ONCE)));

/// Resolves a webhook's host and keeps only the addresses deliveries may go to.
struct CheckedResolver {
    allow: Arc<Vec<Cidr>>,
}

impl reqwest::dns::Resolve for CheckedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let allow = self.allow.clone();
        Box::pin(async move {
            let host = name.as_str().to_string();
            // The lookup runs on a thread of the blocking pool: a bounded number at once,
            // each holding its turn until its thread is done, so a slow name server cannot
            // take the pool the edge's own work needs.
            let turn = LOOKUPS
                .clone()
                .acquire_owned()
                .await
                .map_err(|e| format!("lookup: {e}"))?;
            let h2 = host.clone();
            let lookup = tokio::spawn(async move {
                let r = tokio::net::lookup_host((h2.as_str(), 0))
                    .await
                    .map(|a| a.collect::<Vec<SocketAddr>>());
                drop(turn);
                r
            });
            let addrs: Vec<SocketAddr> = match tokio::time::timeout(LOOKUP_TIMEOUT, lookup).await {
                Ok(Ok(Ok(a))) => a,
                Ok(Ok(Err(e))) => return Err(e.into()),
                Ok(Err(e)) => return Err(format!("lookup: {e}").into()),
                Err(_) => return Err(format!("looking up {host} took too long").into()),
            };
            let ok: Vec<SocketAddr> = addrs
                .iter()
                .copied()
                .filter(|a| allowed(a.ip(), &allow).is_ok())
                .collect();
            if ok.is_empty() {
                return Err(format!("{REFUSED} {host}: not a public address").into());
            }
            Ok(Box::new(ok.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_to_the_node_and_private_networks_are_refused() {
        let none: Vec<Cidr> = Vec::new();
        for bad in [
            "http://127.0.0.1:7600/v1/keys",
            "http://[::1]/",
            "http://[::ffff:127.0.0.1]/",
            "http://169.254.169.254/latest/meta-data",
            "http://10.200.0.2/",
            "http://192.168.1.1/",
            "http://100.64.0.1/",
            "http://0.0.0.0/",
            "http://[fd00::1]/",
            "http://[64:ff9b::a00:1]/",
            "file:///etc/passwd",
            "gopher://example.com/",
            "http://user:pw@example.com/",
            "not a url",
        ] {
            assert!(check_url(bad, &none).is_err(), "{bad} was accepted");
        }
        for good in [
            "https://example.com/hook",
            "http://203.0.114.9:8080/x",
            "http://[2a00::1]/",
        ] {
            assert!(check_url(good, &none).is_ok(), "{good} was refused");
        }
        let lo = vec![Cidr::parse("127.0.0.0/8").unwrap()];
        assert!(check_url("http://127.0.0.1:9/", &lo).is_ok());
        assert!(check_url("http://10.0.0.1:9/", &lo).is_err());
    }

    #[tokio::test]
    async fn a_tenant_has_a_bounded_number_of_webhooks_over_its_subtree() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = EventsConfig::default();
        let hooks = Webhooks::start(&cfg, dir.path()).unwrap();
        let req = |url: &str| WebhookRequest {
            url: url.into(),
            types: vec!["created".into(), "created".into()],
            ..Default::default()
        };
        // Spread over sub-projects (which need not exist), they still count as the owner's.
        for i in 0..PER_PROJECT {
            let w = hooks
                .add(
                    req("https://example.com/h"),
                    format!("root/a/p{i}"),
                    "root/a",
                )
                .unwrap();
            assert_eq!(w.types, vec!["created".to_string()], "types kept twice");
        }
        let e = hooks
            .add(req("https://example.com/h"), "root/a/more".into(), "root/a")
            .unwrap_err();
        assert!(
            e.message.contains("the most they may have"),
            "{}",
            e.message
        );
        // Another tenant is not affected.
        hooks
            .add(req("https://example.com/h"), "root/b".into(), "root/b")
            .unwrap();
        let long = format!("https://example.com/{}", "x".repeat(MAX_URL));
        assert!(hooks.add(req(&long), "root/b".into(), "root/b").is_err());
        // What was saved loads back whole, secrets included.
        let again = Webhooks::start(&cfg, dir.path()).unwrap();
        assert_eq!(again.list(|_| true).len(), PER_PROJECT + 1);
        // A file that cannot be read is set aside; the node still starts.
        std::fs::write(dir.path().join("webhooks.json"), b"{not json").unwrap();
        let fresh = Webhooks::start(&cfg, dir.path()).unwrap();
        assert!(fresh.list(|_| true).is_empty());
        assert!(dir.path().join("webhooks.json.unreadable").exists());
    }

    #[test]
    fn the_e2b_signature_is_what_e2b_receivers_compute() {
        // base64url(sha256("secret" + "{}")) without padding, as E2B's verification
        // examples compute it (Python: hashlib.sha256(b"secret{}")).
        assert_eq!(
            e2b_signature("secret", b"{}"),
            "e9B8ejqc2_sG6v6Lh2cAHsXgRKkAkGentpGLCOuoSYs"
        );
    }

    #[tokio::test]
    async fn an_update_changes_what_it_says_and_keeps_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let hooks = Webhooks::start(&EventsConfig::default(), dir.path()).unwrap();
        let w = hooks
            .add(
                WebhookRequest {
                    url: "https://example.com/a".into(),
                    secret: Some("0123456789abcdef".into()),
                    format: Some(WebhookFormat::E2b),
                    ..Default::default()
                },
                "root/a".into(),
                "root/a",
            )
            .unwrap();
        assert_eq!(w.secret.as_deref(), Some("0123456789abcdef"));
        let u = hooks
            .update(
                &w.id,
                WebhookUpdate {
                    enabled: Some(false),
                    types: Some(vec!["stopped".into()]),
                    ..Default::default()
                },
            )
            .unwrap();
        assert!(!u.enabled && u.types == ["stopped"] && u.url == "https://example.com/a");
        assert!(u.secret.is_none() && u.format == WebhookFormat::E2b);
        // Bad changes are refused and change nothing.
        for bad in [
            WebhookUpdate {
                url: Some("http://127.0.0.1/".into()),
                ..Default::default()
            },
            WebhookUpdate {
                types: Some(vec!["nope".into()]),
                ..Default::default()
            },
        ] {
            assert!(hooks.update(&w.id, bad).is_err());
        }
        assert!(hooks.update("wh-none", WebhookUpdate::default()).is_err());
        // Kept across a restart, the secret too.
        let again = Webhooks::start(&EventsConfig::default(), dir.path()).unwrap();
        let i = again.hooks.lock().unwrap().get(&w.id).unwrap().info();
        assert!(!i.enabled && i.secret.as_deref() == Some("0123456789abcdef"));
        // A short secret is refused.
        let short = WebhookRequest {
            url: "https://example.com/a".into(),
            secret: Some("short".into()),
            ..Default::default()
        };
        assert!(hooks.add(short, "root/a".into(), "root/a").is_err());
    }

    #[test]
    fn the_signature_is_hmac_sha256_of_time_and_body() {
        // RFC 4231 test case 2.
        let key = hmac::Key::new(hmac::HMAC_SHA256, b"Jefe");
        assert_eq!(
            hex::encode(hmac::sign(&key, b"what do ya want for nothing?").as_ref()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}
