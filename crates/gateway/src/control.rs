//! The E2B control plane (`/v2/sandboxes`, `/sandboxes/{id}/…`) on the OpenDsec sandbox
//! API, called with the caller's own key (`X-API-KEY`).

use std::collections::BTreeMap;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use dsec_common::api::{MetricsHistory, SandboxInfo, SandboxMetrics, SandboxState};
use dsec_common::id::SandboxId;
use hyper::Method;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::upstream::{UpErr, enc};
use crate::{
    DEFAULT_TIMEOUT_S, ENVD_VERSION, Gw, LABEL_PREFIX, PUBLIC_LABEL, TEMPLATE_LABEL, Template,
    access_token, header_str,
};

pub(crate) fn routes() -> Router<Gw> {
    Router::new()
        .route("/v2/sandboxes", post(create).get(list))
        .route("/sandboxes", post(create).get(list))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/resume", post(connect))
        .route("/sandboxes/{id}", get(detail).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/metrics", get(metrics))
        .route("/sandboxes/{id}/pause", post(pause))
        .route(
            "/sandboxes/{id}/network",
            axum::routing::put(update_network),
        )
}

type Res = Result<Response, UpErr>;

/// The caller's OpenDsec key: `X-API-KEY` (what the SDK sends) or a bearer token.
pub(crate) fn key(h: &HeaderMap) -> Result<String, UpErr> {
    let k = header_str(h, "x-api-key")
        .or_else(|| header_str(h, "authorization").and_then(|v| v.strip_prefix("Bearer ")))
        .filter(|k| !k.is_empty())
        .ok_or_else(|| {
            UpErr::new(
                401,
                "unauthenticated",
                "missing API key: set E2B_API_KEY to an OpenDsec key (dsk.…)",
            )
        })?;
    Ok(k.trim().to_string())
}

/// An id from a path: a well-formed sandbox id, or not found (never passed on raw).
pub(crate) fn sandbox_id(id: &str) -> Result<String, UpErr> {
    SandboxId::parse(id)
        .map(|p| p.to_string())
        .map_err(|_| not_found(id))
}

fn not_found(id: &str) -> UpErr {
    UpErr::new(404, "not_found", format!("sandbox {id} not found"))
}

/// Whether E2B may see the sandbox, and as what: stopping ones are already gone.
fn e2b_state(s: SandboxState) -> Option<&'static str> {
    match s {
        SandboxState::Creating | SandboxState::Running => Some("running"),
        SandboxState::Paused => Some("paused"),
        SandboxState::Stopping | SandboxState::Stopped => None,
    }
}

fn template_of(info: &SandboxInfo) -> String {
    info.labels
        .get(TEMPLATE_LABEL)
        .cloned()
        .unwrap_or_else(|| info.image.clone())
}

fn metadata_of(info: &SandboxInfo) -> BTreeMap<&str, &str> {
    info.labels
        .iter()
        .filter(|(k, _)| !k.starts_with(LABEL_PREFIX))
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

/// `Sandbox` (create and connect).
pub(crate) fn sandbox_json(gw: &Gw, info: &SandboxInfo) -> Value {
    let mut v = json!({
        "templateID": template_of(info),
        "sandboxID": info.id,
        "clientID": info.edge,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": access_token(&gw.cfg.secret, &info.id),
        "domain": gw.cfg.domain,
    });
    if !crate::ports::public(info) {
        v["trafficAccessToken"] = json!(crate::ports::traffic_token(&gw.cfg.secret, &info.id));
    }
    v
}

/// `SandboxDetail` and `ListedSandbox` (one shape serves both).
fn detail_json(gw: &Gw, info: &SandboxInfo, state: &str) -> Value {
    let mut v = sandbox_json(gw, info);
    let extra = json!({
        "alias": template_of(info),
        "startedAt": rfc3339(info.created_at_ms),
        "endAt": rfc3339(info.expires_at_ms),
        "cpuCount": (info.limits.cpu_cores.ceil() as u64).max(1),
        "memoryMB": info.limits.memory_mb,
        "diskSizeMB": info.limits.disk_mb,
        "state": state,
        "metadata": metadata_of(info),
        "allowInternetAccess": info.network.mode != "none",
        "network": network_json(info),
    });
    if let (Some(o), Value::Object(e)) = (v.as_object_mut(), extra) {
        o.extend(e);
    }
    v
}

/// The sandbox's `network` as E2B's info shows it.
fn network_json(info: &SandboxInfo) -> Value {
    let n = &info.network;
    let pick = |allowed: bool| {
        n.rules
            .iter()
            .filter(|(_, a)| **a == allowed)
            .map(|(k, _)| k.clone())
            .collect::<Vec<_>>()
    };
    let mut v = json!({
        "allowOut": pick(true),
        "denyOut": pick(false),
        "allowPublicTraffic": crate::ports::public(info),
    });
    if !n.egress_headers.is_empty() {
        v["rules"] = n
            .egress_headers
            .iter()
            .map(|(host, hs)| (host.clone(), json!([{ "transform": { "headers": hs } }])))
            .collect::<serde_json::Map<_, _>>()
            .into();
    }
    if let Some(m) = info.labels.get(crate::MASK_HOST_LABEL) {
        v["maskRequestHost"] = json!(m);
    }
    let https = crate::ports::https_ports(info);
    if !https.is_empty() {
        v["httpsPorts"] = json!(https);
    }
    v
}

pub(crate) use dsec_common::rfc3339;

/// An RFC 3339 time (`2026-12-05T10:00:00.5Z`, `…+01:00`; without an offset, UTC) as
/// Unix milliseconds.
pub(crate) fn parse_rfc3339(t: &str) -> Option<u64> {
    let b = t.as_bytes();
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let s = t.get(r)?;
        s.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| s.parse().ok())?
    };
    if b.len() < 19 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if b[13] != b':' || b[16] != b':' || !(1..=12).contains(&mo) || !(1..=31).contains(&d) {
        return None;
    }
    if h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    let mut i = 19;
    let mut ms = 0i64;
    if b.get(i) == Some(&b'.') {
        let start = i + 1;
        i = start;
        while b.get(i).is_some_and(|c| c.is_ascii_digit()) {
            i += 1;
        }
        let frac = t.get(start..i).filter(|f| !f.is_empty())?;
        let f3: String = frac.chars().chain("000".chars()).take(3).collect();
        ms = f3.parse().ok()?;
    }
    let offset_s = match t.get(i..) {
        None | Some("") | Some("Z") | Some("z") => 0,
        Some(o)
            if o.len() == 6
                && matches!(o.as_bytes()[0], b'+' | b'-')
                && o.as_bytes()[3] == b':' =>
        {
            let sign = if o.starts_with('-') { -1 } else { 1 };
            sign * (num(i + 1..i + 3)? * 3600 + num(i + 4..i + 6)? * 60)
        }
        _ => return None,
    };
    // days from civil (Howard Hinnant), the inverse of `rfc3339`'s
    let (yy, mm) = if mo <= 2 {
        (y - 1, mo + 9)
    } else {
        (y, mo - 3)
    };
    let era = yy.div_euclid(400);
    let yoe = yy - era * 400;
    let doy = (153 * mm + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + h * 3600 + mi * 60 + sec - offset_s;
    u64::try_from(secs * 1000 + ms).ok()
}

pub(crate) fn parse<T: for<'de> Deserialize<'de>>(body: &Bytes, what: &str) -> Result<T, UpErr> {
    let b: &[u8] = if body.is_empty() { b"{}" } else { body };
    serde_json::from_slice(b).map_err(|e| {
        UpErr::new(
            400,
            "invalid_argument",
            format!("the {what} body is not valid: {e}"),
        )
    })
}

#[derive(Deserialize)]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    timeout: Option<u64>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default, rename = "envVars")]
    env_vars: Option<BTreeMap<String, String>>,
    allow_internet_access: Option<bool>,
    #[serde(default)]
    network: Option<NetworkOpts>,
    /// `lifecycle={"on_timeout": "pause"}`: paused, not killed, at its timeout.
    #[serde(default, rename = "autoPause")]
    auto_pause: Option<bool>,
    /// `{"on_timeout": {"action": "pause", "mode": "filesystem"}}` sends false: that
    /// pause ends the sandbox's processes (a pause to disk).
    #[serde(default, rename = "autoPauseMemory")]
    auto_pause_memory: Option<bool>,
    /// `lifecycle={…, "auto_resume": True}`: a request to a port resumes it.
    #[serde(default, rename = "autoResume")]
    auto_resume: Option<AutoResume>,
    /// `volume_mounts={"/mnt/data": volume}`: each a volume's name and where it goes.
    #[serde(default, rename = "volumeMounts")]
    volume_mounts: Option<Vec<VolumeMountBody>>,
    /// Workload identity: refused (see `create_inner`).
    #[serde(default)]
    iam: Option<Value>,
}

#[derive(Deserialize)]
struct VolumeMountBody {
    name: String,
    path: String,
}

#[derive(Deserialize)]
struct AutoResume {
    #[serde(default)]
    enabled: bool,
}

/// The create body's `network`: who may reach the sandbox's ports, and egress rules
/// (domains and CIDRs, as OpenDsec's `network_rules`; egress is closed unless allowed).
#[derive(Deserialize)]
struct NetworkOpts {
    #[serde(rename = "allowPublicTraffic")]
    allow_public_traffic: Option<bool>,
    #[serde(default, rename = "allowOut")]
    allow_out: Vec<String>,
    #[serde(default, rename = "denyOut")]
    deny_out: Vec<String>,
    /// The `Host` the sandbox's servers see in requests to its ports (`${PORT}` is the
    /// port); without it they see the host the client asked for.
    #[serde(rename = "maskRequestHost")]
    mask_request_host: Option<String>,
    /// Opened (all traffic) when `allowOut` names a domain; none given: 8.8.8.8, as E2B.
    #[serde(default, rename = "dnsServers")]
    dns_servers: Option<Vec<String>>,
    #[serde(default, rename = "egressProxy")]
    egress_proxy: Option<Value>,
    #[serde(default)]
    rules: Option<Value>,
    /// Ports whose servers speak TLS: requests for them reach them over TLS.
    #[serde(default, rename = "httpsPorts")]
    https_ports: Vec<u32>,
}

/// An egress proxy of the caller's (SOCKS5) is refused with 400 rather than silently
/// left out, as E2B's open-source deployment does.
fn refuse_egress_proxy(egress_proxy: Option<&Value>) -> Result<(), UpErr> {
    if egress_proxy.is_some_and(|v| !v.is_null()) {
        return Err(UpErr::new(
            400,
            "invalid_argument",
            "network egressProxy is not supported by this gateway (a sandbox's egress leaves from the node, by its allowOut/denyOut): leave it out",
        ));
    }
    Ok(())
}

/// The most DNS servers a network may name, as E2B.
const MAX_DNS_SERVERS: usize = 10;

/// What `allowOut` adds for DNS: when it names a domain, the DNS servers (8.8.8.8 unless
/// given), all traffic to them allowed, as E2B. (Every sandbox's DNS goes to the node's
/// proxy whatever server it asks; this opens the addresses as E2B's firewall does.)
fn dns_allowed(allow_out: &[String], dns_servers: Option<&[String]>) -> Result<Vec<String>, UpErr> {
    let servers: Vec<String> = match dns_servers {
        Some(s) => s.to_vec(),
        None => vec!["8.8.8.8".to_string()],
    };
    if servers.len() > MAX_DNS_SERVERS {
        return Err(UpErr::new(
            400,
            "invalid_argument",
            format!(
                "network dnsServers has {} entries; at most {MAX_DNS_SERVERS}",
                servers.len()
            ),
        ));
    }
    if let Some(bad) = servers
        .iter()
        .find(|s| s.parse::<std::net::Ipv4Addr>().is_err())
    {
        return Err(UpErr::new(
            400,
            "invalid_argument",
            format!("network dnsServers: {bad:?} is not an IPv4 address"),
        ));
    }
    let names_domain = allow_out
        .iter()
        .any(|a| a.chars().any(|c| c.is_ascii_alphabetic()) && a.contains('.'));
    Ok(if names_domain { servers } else { Vec::new() })
}

/// E2B's `network.rules` (`{"api.example.com": [{"transform": {"headers": {…}}}]}`) as
/// OpenDsec's `egress_headers`: a host's rules' headers, later ones replacing earlier ones.
/// Workload-identity placeholders are refused: this gateway mints no such tokens.
fn egress_headers(
    rules: Option<&Value>,
) -> Result<BTreeMap<String, BTreeMap<String, String>>, UpErr> {
    let bad = |why: String| UpErr::new(400, "invalid_argument", format!("network rules: {why}"));
    let mut out = BTreeMap::new();
    let Some(rules) = rules.filter(|v| !v.is_null()) else {
        return Ok(out);
    };
    let Some(hosts) = rules.as_object() else {
        return Err(bad("must be an object of host to a list of rules".into()));
    };
    for (host, list) in hosts {
        let Some(list) = list.as_array() else {
            return Err(bad(format!("{host:?} must map to a list of rules")));
        };
        let mut headers = BTreeMap::new();
        for rule in list {
            let Some(hs) = rule.get("transform").and_then(|t| t.get("headers")) else {
                continue;
            };
            let Some(hs) = hs.as_object() else {
                return Err(bad(format!(
                    "{host:?}: transform headers must be an object"
                )));
            };
            for (name, value) in hs {
                let Some(value) = value.as_str() else {
                    return Err(bad(format!("{host:?}: header {name} must be a string")));
                };
                if value.contains("${e2b.identity.") {
                    return Err(bad(format!(
                        "{host:?}: header {name} uses a workload identity token, which this gateway does not mint: give the value itself"
                    )));
                }
                headers.insert(name.clone(), value.to_string());
            }
        }
        if !headers.is_empty() {
            out.insert(host.to_ascii_lowercase(), headers);
        }
    }
    Ok(out)
}

/// A `maskRequestHost` the gateway can put in a `Host` header: a host name or address,
/// with an optional `:port`, where `${PORT}` may stand for the port.
fn check_mask(mask: &str) -> Result<(), UpErr> {
    let host = mask.replace("${PORT}", "1");
    let ok = !host.is_empty()
        && host.len() <= 255
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._:[]".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(UpErr::new(
            400,
            "invalid_argument",
            format!(
                "network.maskRequestHost {mask:?} is not a host: give a name or address (up to 255 characters of letters, digits, '-', '.', '_', ':', '[', ']'), where ${{PORT}} stands for the port, e.g. \"${{PORT}}-myapp.example.com\""
            ),
        ))
    }
}

/// What a template id stands for: the template map, an image reference, or a template
/// built through this gateway (`Template.build()`).
/// The project of `key`, as the API says.
pub(crate) async fn project_of(gw: &Gw, key: &str) -> Result<String, UpErr> {
    let who: Value = gw.up.call(Method::GET, "/v1/whoami", key, None).await?;
    who["project"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| UpErr::new(502, "internal", "whoami named no project"))
}

/// What a template name means for `key`: the gateway's own templates, an image reference,
/// or a template built by the key's project or one of its parents (the nearest first),
/// among the images that key can see.
pub(crate) async fn template_for(gw: &Gw, key: &str, template: &str) -> Result<Template, UpErr> {
    if let Some(t) = gw.cfg.templates.get(template) {
        return Ok(t.clone());
    }
    if template.contains('/') {
        return Ok(Template::Image(template.to_string()));
    }
    let (name, tag) = template.split_once(':').unwrap_or((template, "latest"));
    let project = project_of(gw, key).await?;
    let project = project.as_str();
    let images: Result<Value, UpErr> = gw.up.call(Method::GET, "/v1/images", key, None).await;
    let seen: std::collections::HashSet<String> = images
        .ok()
        .and_then(|v| {
            v["images"].as_array().map(|a| {
                a.iter()
                    .filter_map(|i| i["reference"].as_str().map(str::to_string))
                    .collect()
            })
        })
        .unwrap_or_default();
    let mut p = Some(project);
    while let Some(proj) = p {
        let built = crate::templates::image_of(proj, name, tag);
        if seen.contains(&built) {
            return Ok(Template::Image(built));
        }
        p = proj.rsplit_once('/').map(|(parent, _)| parent);
    }
    Err(UpErr::new(
        404,
        "not_found",
        format!(
            "template {template:?} not found: the gateway maps {} to images, and finds templates built by this key's project ({project}) or its parents; an OpenDsec image reference (owner/name:tag) also works",
            gw.cfg
                .templates
                .keys()
                .map(|k| format!("{k:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    ))
}

async fn create(State(gw): State<Gw>, h: HeaderMap, body: Bytes) -> Response {
    match create_inner(&gw, &h, &body).await {
        Ok(r) => r,
        Err(e) => {
            // A failed create is not retried by the SDK: it may have done work.
            let mut r = e.into_response();
            r.headers_mut().insert(
                "should-retry",
                hyper::header::HeaderValue::from_static("false"),
            );
            r
        }
    }
}

async fn create_inner(gw: &Gw, h: &HeaderMap, body: &Bytes) -> Res {
    let k = key(h)?;
    let req: NewSandbox = parse(body, "create sandbox")?;
    let metadata = req.metadata.clone().unwrap_or_default();
    if let Some(k) = metadata.keys().find(|k| k.starts_with(LABEL_PREFIX)) {
        return Err(UpErr::new(
            400,
            "invalid_argument",
            format!(
                "metadata key {k:?}: keys starting with {LABEL_PREFIX:?} are the gateway's own"
            ),
        ));
    }
    // A snapshot's id or name (`Sandbox.create(snapshot_id)`), unless the gateway maps
    // that name to a template of its own.
    if !gw.cfg.templates.contains_key(&req.template_id)
        && let Some(s) = crate::snapshots::find(gw, &k, &req.template_id).await?
    {
        let info = crate::snapshots::create_from(
            gw,
            &k,
            &s,
            &req.template_id,
            metadata,
            req.timeout.unwrap_or(DEFAULT_TIMEOUT_S),
        )
        .await?;
        return Ok((StatusCode::CREATED, axum::Json(sandbox_json(gw, &info))).into_response());
    }
    if let Some(n) = &req.network {
        refuse_egress_proxy(n.egress_proxy.as_ref())?;
    }
    if req.iam.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(UpErr::new(
            400,
            "invalid_argument",
            "iam (workload identity tokens) is not supported by this gateway: leave it out",
        ));
    }
    let template = template_for(gw, &k, &req.template_id).await?;
    let mut labels = metadata;
    labels.insert(TEMPLATE_LABEL.to_string(), req.template_id.clone());
    let mut rules = BTreeMap::new();
    let public = req
        .network
        .as_ref()
        .and_then(|n| n.allow_public_traffic)
        .unwrap_or(true);
    if public {
        labels.insert(PUBLIC_LABEL.to_string(), "true".to_string());
    }
    if let Some(mask) = req
        .network
        .as_ref()
        .and_then(|n| n.mask_request_host.clone())
    {
        check_mask(&mask)?;
        labels.insert(crate::MASK_HOST_LABEL.to_string(), mask);
    }
    if let Some(n) = &req.network
        && !n.https_ports.is_empty()
    {
        if let Some(p) = n
            .https_ports
            .iter()
            .find(|p| **p == 0 || **p > 65535 || **p == u32::from(crate::ENVD_PORT))
        {
            return Err(UpErr::new(
                400,
                "invalid_argument",
                format!(
                    "network httpsPorts: {p} cannot be listed (a TCP port 1-65535, not envd's {})",
                    crate::ENVD_PORT
                ),
            ));
        }
        let list: Vec<String> = n.https_ports.iter().map(|p| p.to_string()).collect();
        labels.insert(crate::HTTPS_PORTS_LABEL.to_string(), list.join(","));
    }
    let mut headers = BTreeMap::new();
    if let Some(n) = req.network {
        let dns = dns_allowed(&n.allow_out, n.dns_servers.as_deref())?;
        headers = egress_headers(n.rules.as_ref())?;
        rules.extend(n.deny_out.into_iter().map(|d| (d, false)));
        // allowed entries win over denied ones, as in E2B
        rules.extend(n.allow_out.into_iter().map(|d| (d, true)));
        rules.extend(dns.into_iter().map(|d| (d, true)));
    }
    let mut create = json!({
        "image": template.image(),
        "ttl_seconds": req.timeout.unwrap_or(DEFAULT_TIMEOUT_S),
        "labels": labels,
        "env": req.env_vars.unwrap_or_default(),
    });
    if req.allow_internet_access == Some(false) {
        create["network"] = json!("none");
    } else {
        if !rules.is_empty() {
            create["network_rules"] = json!(rules);
        }
        if !headers.is_empty() {
            create["egress_headers"] = json!(headers);
        }
    }
    if let Some(b) = template.backend() {
        create["backend"] = json!(b);
    }
    if req.auto_pause == Some(true) {
        create["on_timeout"] = json!(if req.auto_pause_memory == Some(false) {
            "pause_to_disk"
        } else {
            "pause"
        });
    }
    if let Some(m) = &req.volume_mounts {
        create["volumes"] = json!(
            m.iter()
                .map(|v| json!({ "volume": v.name, "path": v.path }))
                .collect::<Vec<_>>()
        );
    }
    if req.auto_resume.is_some_and(|a| a.enabled) {
        if req.auto_pause_memory == Some(false) {
            return Err(UpErr::new(
                400,
                "invalid_argument",
                "on_timeout mode \"filesystem\" cannot be combined with auto_resume: a sandbox paused without its memory is resumed with connect()",
            ));
        }
        create["auto_resume"] = json!(true);
        create["labels"][crate::AUTO_RESUME_LABEL] = json!("true");
    }
    let info: SandboxInfo = gw
        .up
        .call(Method::POST, "/v1/sandboxes", &k, Some(create))
        .await?;
    Ok((StatusCode::CREATED, axum::Json(sandbox_json(gw, &info))).into_response())
}

async fn get_info(gw: &Gw, k: &str, id: &str) -> Result<(SandboxInfo, &'static str), UpErr> {
    let id = sandbox_id(id)?;
    let info: SandboxInfo = gw
        .up
        .call(Method::GET, &format!("/v1/sandboxes/{id}"), k, None)
        .await?;
    let state = e2b_state(info.state).ok_or_else(|| not_found(&id))?;
    Ok((info, state))
}

async fn detail(State(gw): State<Gw>, h: HeaderMap, Path(id): Path<String>) -> Res {
    let k = key(&h)?;
    let (info, state) = get_info(&gw, &k, &id).await?;
    Ok(axum::Json(detail_json(&gw, &info, state)).into_response())
}

#[derive(Deserialize)]
struct ConnectBody {
    timeout: Option<u64>,
}

pub(crate) use dsec_common::now_ms;

/// Connect (and the old resume): resumes a paused sandbox; `timeout` only extends.
async fn connect(State(gw): State<Gw>, h: HeaderMap, Path(id): Path<String>, body: Bytes) -> Res {
    let k = key(&h)?;
    let req: ConnectBody = parse(&body, "connect")?;
    let (mut info, state) = get_info(&gw, &k, &id).await?;
    let path = format!("/v1/sandboxes/{}", info.id);
    if state == "paused" {
        info = gw
            .up
            .call(Method::POST, &format!("{path}/resume"), &k, Some(json!({})))
            .await?;
    }
    if let Some(t) = req.timeout
        && now_ms().saturating_add(t.saturating_mul(1000)) > info.expires_at_ms
    {
        let _: Value = gw
            .up
            .call(
                Method::POST,
                &format!("{path}/timeout"),
                &k,
                Some(json!({"ttl_seconds": t})),
            )
            .await?;
    }
    Ok(axum::Json(sandbox_json(&gw, &info)).into_response())
}

async fn kill(State(gw): State<Gw>, h: HeaderMap, Path(id): Path<String>) -> Res {
    let k = key(&h)?;
    let id = sandbox_id(&id)?;
    gw.forget_running(&id);
    let gone: Result<Value, UpErr> = gw
        .up
        .call(Method::DELETE, &format!("/v1/sandboxes/{id}"), &k, None)
        .await;
    // Also after: an envd call meanwhile may have seen it running.
    gw.forget_running(&id);
    let _ = gone?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `PUT /sandboxes/{id}/network`'s body: the whole egress configuration, replacing the
/// one before (what it leaves out is cleared).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct NetworkUpdate {
    #[serde(default)]
    allow_out: Vec<String>,
    #[serde(default)]
    deny_out: Vec<String>,
    #[serde(default)]
    dns_servers: Option<Vec<String>>,
    #[serde(default)]
    egress_proxy: Option<Value>,
    #[serde(default)]
    rules: Option<Value>,
    allow_internet_access: Option<bool>,
}

/// `Sandbox.update_network`: the sandbox's egress rules replaced at once (OpenDsec's
/// `PUT /v1/sandboxes/{id}/network`); allowed entries win over denied ones, as at create.
async fn update_network(
    State(gw): State<Gw>,
    h: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Res {
    let k = key(&h)?;
    let id = sandbox_id(&id)?;
    let req: NetworkUpdate = parse(&body, "network update")?;
    refuse_egress_proxy(req.egress_proxy.as_ref())?;
    let mut rules = BTreeMap::new();
    let mut headers = BTreeMap::new();
    if req.allow_internet_access != Some(false) {
        let dns = dns_allowed(&req.allow_out, req.dns_servers.as_deref())?;
        headers = egress_headers(req.rules.as_ref())?;
        rules.extend(req.deny_out.into_iter().map(|d| (d, false)));
        rules.extend(req.allow_out.into_iter().map(|d| (d, true)));
        rules.extend(dns.into_iter().map(|d| (d, true)));
    }
    let _: Value = gw
        .up
        .call(
            Method::PUT,
            &format!("/v1/sandboxes/{id}/network"),
            &k,
            Some(json!({ "network_rules": rules, "egress_headers": headers })),
        )
        .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Deserialize)]
struct TimeoutBody {
    timeout: u64,
}

async fn set_timeout(
    State(gw): State<Gw>,
    h: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Res {
    let k = key(&h)?;
    let id = sandbox_id(&id)?;
    let req: TimeoutBody = parse(&body, "set timeout")?;
    let _: Value = gw
        .up
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/timeout"),
            &k,
            Some(json!({"ttl_seconds": req.timeout})),
        )
        .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// How far apart the two readings are that give a CPU rate.
const CPU_WINDOW: std::time::Duration = std::time::Duration::from_millis(250);

/// `SandboxMetric`s from `start` to `end` (unix seconds; default: since the sandbox
/// started, until now): one per kept reading after the first, CPU use over the time
/// since the one before, memory then, and the sandbox's disk as it is now (disk is not
/// kept). A running sandbox with fewer than two readings yet, and no range asked for,
/// gets one entry measured now over a short window.
/// How far before a range's start the history is read: more than the edge's interval
/// between readings (5 s).
const LOOKBACK_MS: u64 = 15_000;

async fn metrics(
    State(gw): State<Gw>,
    h: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> Res {
    let k = key(&h)?;
    let (mut start_ms, mut end_ms) = (None, None);
    for (name, v) in query_pairs(q.as_deref().unwrap_or("")) {
        let slot = match name.as_str() {
            "start" => &mut start_ms,
            "end" => &mut end_ms,
            _ => continue,
        };
        let secs: u64 = v.parse().map_err(|_| {
            UpErr::new(
                400,
                "invalid_argument",
                format!("{name} must be a unix timestamp in seconds, not {v:?}"),
            )
        })?;
        *slot = Some(secs.saturating_mul(1000));
    }
    let ranged = start_ms.is_some() || end_ms.is_some();
    // A reading's CPU is over the interval before it: the history starts a reading early,
    // so the first one inside the range has its predecessor (and is shown).
    let mut range = Vec::new();
    if let Some(s) = start_ms {
        range.push(format!("start_ms={}", s.saturating_sub(LOOKBACK_MS)));
    }
    if let Some(e) = end_ms {
        range.push(format!("end_ms={e}"));
    }
    let range = if range.is_empty() {
        String::new()
    } else {
        format!("?{}", range.join("&"))
    };
    let (info, state) = get_info(&gw, &k, &id).await?;
    let hist: MetricsHistory = gw
        .up
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{}/metrics/history{range}", info.id),
            &k,
            None,
        )
        .await?;
    let path = format!("/v1/sandboxes/{}/metrics", info.id);
    let now: Option<SandboxMetrics> = if state == "running" {
        Some(gw.up.call(Method::GET, &path, &k, None).await?)
    } else {
        None
    };
    let cpus = hist.cpu_cores.ceil().max(1.0);
    let (disk_used, disk_total) = now
        .as_ref()
        .map_or((0, 0), |m| (m.disk_used_bytes, m.disk_total_bytes));
    let series: Vec<Value> = hist
        .samples
        .windows(2)
        .filter(|w| start_ms.is_none_or(|s| w[1].timestamp_ms >= s))
        .map(|w| {
            let wall_ns =
                (w[1].timestamp_ms.saturating_sub(w[0].timestamp_ms) as f64 * 1e6).max(1.0);
            let used = w[1].cpu_used_ns.saturating_sub(w[0].cpu_used_ns) as f64;
            metric_entry(
                w[1].timestamp_ms,
                cpus,
                used / (wall_ns * cpus) * 100.0,
                w[1].memory_used_bytes,
                hist.memory_limit_bytes,
                w[1].memory_cache_bytes,
                disk_used,
                disk_total,
            )
        })
        .collect();
    if !series.is_empty() || ranged || state != "running" {
        return Ok(axum::Json(Value::Array(series)).into_response());
    }
    let Some(a) = now else {
        return Ok(axum::Json(json!([])).into_response());
    };
    let t0 = std::time::Instant::now();
    tokio::time::sleep(CPU_WINDOW).await;
    let b: SandboxMetrics = gw.up.call(Method::GET, &path, &k, None).await?;
    let wall_ns = t0.elapsed().as_nanos().max(1) as f64;
    let cpus = b.cpu_cores.ceil().max(1.0);
    let used = b.cpu_used_ns.saturating_sub(a.cpu_used_ns) as f64;
    Ok(axum::Json(json!([metric_entry(
        b.timestamp_ms,
        cpus,
        used / (wall_ns * cpus) * 100.0,
        b.memory_used_bytes,
        b.memory_limit_bytes,
        b.memory_cache_bytes,
        b.disk_used_bytes,
        b.disk_total_bytes,
    )]))
    .into_response())
}

/// One E2B `SandboxMetric`.
#[allow(clippy::too_many_arguments)]
fn metric_entry(
    at_ms: u64,
    cpus: f64,
    pct: f64,
    mem_used: u64,
    mem_total: u64,
    mem_cache: u64,
    disk_used: u64,
    disk_total: u64,
) -> Value {
    let pct = pct.clamp(0.0, 100.0);
    json!({
        "timestamp": rfc3339(at_ms),
        "timestampUnix": at_ms / 1000,
        "cpuCount": cpus as u64,
        "cpuUsedPct": (pct * 100.0).round() / 100.0,
        "memUsed": mem_used,
        "memTotal": mem_total,
        "memCache": mem_cache,
        "diskUsed": disk_used,
        "diskTotal": disk_total,
    })
}

/// `POST /sandboxes/{id}/pause`, `{"memory": false}` for a filesystem-only pause: the
/// sandbox's processes end and its memory is freed (OpenDsec's pause to disk; a VM keeps
/// its memory there, since its files live in it); resuming starts a container afresh.
async fn pause(
    State(gw): State<Gw>,
    h: HeaderMap,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Res {
    let k = key(&h)?;
    let memory = if body.iter().all(u8::is_ascii_whitespace) {
        true
    } else {
        let v: Value = serde_json::from_slice(&body)
            .map_err(|e| UpErr::new(400, "invalid_argument", format!("pause body: {e}")))?;
        match &v["memory"] {
            Value::Null => true,
            Value::Bool(b) => *b,
            _ => {
                return Err(UpErr::new(
                    400,
                    "invalid_argument",
                    "pause body: memory must be true or false",
                ));
            }
        }
    };
    let (info, state) = get_info(&gw, &k, &id).await?;
    if state == "paused" {
        return Err(UpErr::new(
            409,
            "already_exists",
            "sandbox is already paused",
        ));
    }
    gw.forget_running(&info.id);
    let paused: Result<Value, UpErr> = gw
        .up
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{}/pause", info.id),
            &k,
            Some(json!({"to_disk": !memory})),
        )
        .await;
    // Also after: an envd call meanwhile may have seen it running.
    gw.forget_running(&info.id);
    let _ = paused?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub(crate) use dsec_common::http::{percent_decode as pct, query_pairs};

/// The `metadata` list filter: one query value holding a form string whose keys and
/// values are percent-encoded once more.
fn metadata_filter(v: &str) -> BTreeMap<String, String> {
    query_pairs(v)
        .into_iter()
        .map(|(k, v)| (pct(&k, false), pct(&v, false)))
        .collect()
}

async fn list(State(gw): State<Gw>, h: HeaderMap, RawQuery(q): RawQuery) -> Res {
    let k = key(&h)?;
    let mut labels = BTreeMap::new();
    let mut states: Option<Vec<String>> = None;
    let mut limit = 100usize;
    let mut offset = 0usize;
    let mut newest_first = false;
    let mut started_after: Option<u64> = None;
    let mut template: Option<String> = None;
    for (name, v) in query_pairs(q.as_deref().unwrap_or("")) {
        match name.as_str() {
            "metadata" => labels.extend(metadata_filter(&v)),
            "order" => {
                newest_first = match v.as_str() {
                    "asc" => false,
                    "desc" => true,
                    _ => {
                        return Err(UpErr::new(
                            400,
                            "invalid_argument",
                            format!("order {v:?}: asc or desc"),
                        ));
                    }
                }
            }
            "startedAfter" => {
                started_after = Some(parse_rfc3339(&v).ok_or_else(|| {
                    UpErr::new(
                        400,
                        "invalid_argument",
                        format!("startedAfter {v:?} is not an RFC 3339 time"),
                    )
                })?)
            }
            "template" if !v.is_empty() => template = Some(v),
            "state" => states = Some(v.split(',').map(|s| s.trim().to_string()).collect()),
            "limit" => {
                limit = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=1000).contains(n))
                    .ok_or_else(|| UpErr::new(400, "invalid_argument", "limit must be 1 to 1000"))?
            }
            "nextToken" => {
                offset = v.parse().map_err(|_| {
                    UpErr::new(
                        400,
                        "invalid_argument",
                        "nextToken is not one this gateway gave",
                    )
                })?
            }
            _ => {}
        }
    }
    let query: Vec<String> = labels
        .iter()
        .map(|(k, v)| format!("label={}", enc(&format!("{k}={v}"))))
        .collect();
    let path = if query.is_empty() {
        "/v1/sandboxes".to_string()
    } else {
        format!("/v1/sandboxes?{}", query.join("&"))
    };
    let resp: dsec_common::api::ListSandboxesResponse =
        gw.up.call(Method::GET, &path, &k, None).await?;
    let mut all: Vec<(SandboxInfo, &str)> = resp
        .sandboxes
        .into_iter()
        .filter_map(|s| e2b_state(s.state).map(|st| (s, st)))
        .filter(|(_, st)| states.as_ref().is_none_or(|w| w.iter().any(|x| x == st)))
        .filter(|(s, _)| started_after.is_none_or(|t| s.created_at_ms > t))
        .filter(|(s, _)| template.as_deref().is_none_or(|t| template_of(s) == t))
        .collect();
    all.sort_by(|a, b| (a.0.created_at_ms, &a.0.id).cmp(&(b.0.created_at_ms, &b.0.id)));
    if newest_first {
        all.reverse();
    }
    let page: Vec<Value> = all
        .iter()
        .skip(offset)
        .take(limit)
        .map(|(s, st)| detail_json(&gw, s, st))
        .collect();
    let mut r = axum::Json(Value::Array(page)).into_response();
    if offset + limit < all.len()
        && let Ok(v) = (offset + limit).to_string().parse()
    {
        r.headers_mut().insert("x-next-token", v);
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2b_rules_become_egress_headers_in_order() {
        let rules = json!({
            "API.example.com": [
                {"transform": {"headers": {"X-A": "1", "X-B": "first"}}},
                {},
                {"transform": {"headers": {"X-B": "second"}}}
            ],
            "*.example.com": [{"transform": {}}]
        });
        let h = egress_headers(Some(&rules)).unwrap();
        assert_eq!(
            h,
            BTreeMap::from([(
                "api.example.com".to_string(),
                BTreeMap::from([
                    ("X-A".to_string(), "1".to_string()),
                    ("X-B".to_string(), "second".to_string())
                ])
            )])
        );
        assert!(egress_headers(None).unwrap().is_empty());
        for bad in [
            json!(["x"]),
            json!({"a.example.com": {"transform": {}}}),
            json!({"a.example.com": [{"transform": {"headers": {"X": 1}}}]}),
            json!({"a.example.com": [{"transform": {"headers": {"X": "${e2b.identity.tokens.aws}"}}}]}),
        ] {
            let e = egress_headers(Some(&bad)).unwrap_err();
            assert_eq!(e.status, 400, "{bad}");
        }
    }

    #[test]
    fn dns_servers_open_only_with_a_domain_allowed() {
        let d = |a: &[&str], s: Option<&[&str]>| {
            let a: Vec<String> = a.iter().map(|x| x.to_string()).collect();
            let s: Option<Vec<String>> = s.map(|v| v.iter().map(|x| x.to_string()).collect());
            dns_allowed(&a, s.as_deref())
        };
        assert_eq!(d(&["api.example.com"], None).unwrap(), ["8.8.8.8"]);
        assert_eq!(
            d(&["api.example.com"], Some(&["1.1.1.1"])).unwrap(),
            ["1.1.1.1"]
        );
        assert!(d(&["api.example.com"], Some(&[])).unwrap().is_empty());
        assert!(
            d(&["203.0.113.7", "198.51.100.0/24"], None)
                .unwrap()
                .is_empty()
        );
        assert!(d(&["api.example.com"], Some(&["dns.example.com"])).is_err());
        assert!(d(&["a.example.com"], Some(&["1.1.1.1"; 11])).is_err());
    }

    #[test]
    fn a_host_mask_is_a_host() {
        for ok in [
            "${PORT}-myapp.example.com",
            "localhost:${PORT}",
            "app.internal",
            "[::1]:8080",
        ] {
            assert!(check_mask(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "a b",
            "x\r\nX-Injected: 1",
            "${HOME}.example.com",
            "a/b",
            &"a".repeat(256),
        ] {
            let e = check_mask(bad).unwrap_err();
            assert_eq!(e.status, 400, "{bad:?}");
        }
    }

    #[test]
    fn times_are_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_735_689_600_123), "2025-01-01T00:00:00.123Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
        for ms in [0, 1_735_689_600_123, 951_782_400_000, 1_796_512_363_999] {
            assert_eq!(parse_rfc3339(&rfc3339(ms)), Some(ms));
        }
        // as Python's isoformat() writes them: microseconds, an offset, or none
        assert_eq!(
            parse_rfc3339("2025-01-01T01:00:00.123456+01:00"),
            Some(1_735_689_600_123)
        );
        assert_eq!(
            parse_rfc3339("2025-01-01T00:00:00"),
            Some(1_735_689_600_000)
        );
        for bad in [
            "",
            "2025-13-01T00:00:00Z",
            "2025-01-01",
            "2025-01-01T00:00:00+1",
            "x".repeat(30).as_str(),
        ] {
            assert_eq!(parse_rfc3339(bad), None, "{bad}");
        }
    }

    #[test]
    fn metadata_filter_decodes_three_levels() {
        // {"a b":"c&d=e","k":"v"} as the SDK sends it.
        let q = "metadata=a%252520b%3Dc%252526d%25253De%26k%3Dv";
        let pairs = query_pairs(q);
        assert_eq!(pairs[0].0, "metadata");
        let m = metadata_filter(&pairs[0].1);
        assert_eq!(m.get("a b").map(String::as_str), Some("c&d=e"));
        assert_eq!(m.get("k").map(String::as_str), Some("v"));
        assert_eq!(pct("%zz%4", false), "%zz%4");
        assert_eq!(pct("%", false), "%");
    }
}
