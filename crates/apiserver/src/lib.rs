//! The apiserver of a cluster. It keeps no per-sandbox state: it authenticates the API key
//! through IAM, places creates on the watcher's view (filter, then power-of-k with its own
//! recent placements overlaid; a node that refuses is skipped and the next one tried), and
//! sends every request for a sandbox to the edge its id names, over mutual TLS, with the
//! caller's principal. The control calls (create, list, stop, fork, pause, resume, groups,
//! snapshot listings) are gRPC calls (`dsec.v1.Edge`); lifecycle events and usage are
//! gathered from every edge's REST face and merged; the rest (reads of one sandbox,
//! exec, files, processes, ports, upgrades, images) is forwarded as HTTP, byte for byte,
//! with the principal in [`PRINCIPAL_HEADER`]. The edge decides visibility (404 for other
//! projects' sandboxes), admission and quota.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use dsec_common::ApiError;
use dsec_common::api::{
    ClusterStatus, ForkRequest, ForkResponse, GroupFailure, GroupRequest, GroupResponse,
    ListSandboxesResponse, ListSnapshotsResponse, NodeStatus, PauseRequest, ResumeRequest,
    SandboxInfo, UsageResponse,
};
use dsec_common::http::{
    ApiResult, Failure, api_key, body, json, label_filter, missing_key, no_such_endpoint,
    public_routes, unknown_key,
};
use dsec_common::id::SandboxId;
use dsec_iam::http::{PRINCIPAL_HEADER, create_request, encode_principal, status_for};
use dsec_iam::{Iam, Principal, PrincipalKind, ROOT, RemoteIam};
use dsec_rpc::pb::edge_client::EdgeClient;
use dsec_rpc::pb::watcher_client::WatcherClient;
use dsec_rpc::status::within;
use dsec_rpc::{CallError, Channels, Transport, pb};
use dsec_watcher::{ClusterView, Demand, EdgeEndpoint, Placer, Poller, SharedView};

/// The most a create may take on an edge (image unpacking included).
const CREATE_TIMEOUT: Duration = Duration::from_secs(120);
/// The most a listing or status call to one edge may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// A group pause to disk writes every member's memory out.
const GROUP_TIMEOUT: Duration = Duration::from_secs(600);
/// A fork, pause or resume (a VM's memory written out or read back, many copies made).
const LONG_TIMEOUT: Duration = Duration::from_secs(600);
/// Memory a create is placed by when it names none (the edges' usual default).
const DEFAULT_MEMORY_MB: u64 = 512;

pub struct ClusterConfig {
    /// Edge name → `host:port` of its cluster listener.
    pub edges: BTreeMap<String, String>,
    /// The watcher's `host:port`; without one the apiserver polls the edges itself.
    pub watcher: Option<String>,
    /// How often the view is refreshed.
    pub refresh: Duration,
}

pub struct Cluster {
    iam: RemoteIam,
    edges: BTreeMap<String, String>,
    watcher: Option<String>,
    refresh: Duration,
    /// HTTP for what is forwarded as it is.
    client: dsec_mtls::Client,
    /// gRPC channels to the edges and the watcher.
    rpc: Channels,
    placer: Placer,
    view: SharedView,
    /// Polls the edges directly while the watcher does not answer.
    fallback: Poller,
}

/// How the apiserver itself appears to edges when it polls them.
fn component_principal(name: &str) -> Principal {
    Principal {
        name: name.to_string(),
        kind: PrincipalKind::Agent,
        key_id: String::new(),
        project: ROOT.to_string(),
    }
}

/// The encoded principal with which a cluster component reads an edge's status.
pub fn component_auth(name: &str) -> String {
    encode_principal(&component_principal(name))
}

impl Cluster {
    pub fn new(
        cfg: ClusterConfig,
        iam: RemoteIam,
        client: dsec_mtls::Client,
        rpc: Channels,
    ) -> Arc<Cluster> {
        let endpoints = cfg
            .edges
            .iter()
            .map(|(name, addr)| EdgeEndpoint {
                name: name.clone(),
                addr: addr.clone(),
            })
            .collect();
        Arc::new(Cluster {
            iam,
            edges: cfg.edges,
            watcher: cfg.watcher,
            refresh: cfg.refresh,
            fallback: Poller::new(
                endpoints,
                Duration::from_secs(2),
                rpc.clone(),
                component_auth("apiserver"),
            ),
            client,
            rpc,
            // Own placements count for two refreshes: until the view has them.
            placer: Placer::new(2, cfg.refresh * 2 + Duration::from_millis(500)),
            view: SharedView::default(),
        })
    }

    fn view(&self) -> ClusterView {
        self.view.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Fetches the watcher's view; if it does not answer, polls the edges directly.
    pub async fn refresh_once(&self) {
        if let Some(w) = &self.watcher {
            match self.fetch_watcher(w).await {
                Ok(nodes) => {
                    let mut v = ClusterView::default();
                    for n in nodes {
                        v.update(n);
                    }
                    *self.view.write().unwrap_or_else(|p| p.into_inner()) = v;
                    return;
                }
                Err(e) => {
                    tracing::warn!(watcher = %w, "the watcher does not answer ({e}); polling the edges directly")
                }
            }
        }
        self.fallback.poll_once().await;
        let v = self
            .fallback
            .view()
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        *self.view.write().unwrap_or_else(|p| p.into_inner()) = v;
    }

    async fn fetch_watcher(&self, addr: &str) -> Result<Vec<NodeStatus>, CallError> {
        let mut w = self.rpc.client(addr, WatcherClient::with_origin)?;
        let s = within(CALL_TIMEOUT, w.view(pb::StatusRequest {})).await?;
        Ok(ClusterStatus::try_from(s)?.nodes)
    }

    /// Refreshes the view every `refresh` until the task is dropped.
    pub fn spawn_refresh(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let c = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(c.refresh);
            loop {
                tick.tick().await;
                c.refresh_once().await;
            }
        })
    }

    fn edge_addr(&self, edge: &str) -> ApiResult<&str> {
        self.edges.get(edge).map(String::as_str).ok_or_else(|| {
            Failure(ApiError::not_found(format!(
                "edge {edge} is not part of this cluster (the sandbox id names an edge this apiserver does not know)"
            )))
        })
    }

    /// The gRPC client of `edge`.
    fn edge(&self, edge: &str) -> Result<EdgeClient<Transport>, CallError> {
        let addr = self.edge_addr(edge).map_err(|f| CallError::Api(f.0))?;
        self.rpc.client(addr, EdgeClient::with_origin)
    }

    async fn principal(&self, headers: &HeaderMap) -> Result<Principal, Failure> {
        let k = api_key(headers).ok_or_else(missing_key)?;
        self.iam.authenticate_async(k).await.ok_or_else(unknown_key)
    }

    /// Forwards `req` as it is to `edge`, streaming both ways; an `Upgrade` is spliced.
    async fn forward(
        &self,
        edge: &str,
        mut req: Request,
        principal: Option<&Principal>,
    ) -> ApiResult<Response> {
        let addr = self.edge_addr(edge)?;
        let pq = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or("/")
            .to_string();
        *req.uri_mut() = Uri::try_from(format!("{}{pq}", self.client.base(addr)))
            .map_err(|e| ApiError::invalid(format!("bad request path: {e}")))?;
        let h = req.headers_mut();
        h.remove(PRINCIPAL_HEADER);
        if let Some(p) = principal {
            h.remove(header::AUTHORIZATION);
            h.remove("x-api-key");
            let v = HeaderValue::from_str(&encode_principal(p))
                .map_err(|e| ApiError::internal(e.to_string()))?;
            h.insert(PRINCIPAL_HEADER, v);
        }
        let client_upgrade = req
            .headers()
            .contains_key(header::UPGRADE)
            .then(|| hyper::upgrade::on(&mut req));
        let mut resp = self.client.request(req).await.map_err(|e| {
            Failure(ApiError::unavailable(format!(
                "edge {edge} ({addr}) does not answer ({e}); its sandboxes are reachable again once it is back"
            )))
        })?;
        dsec_common::http::splice_upgrade(client_upgrade, &mut resp);
        Ok(resp.map(Body::new).into_response())
    }
}

impl Cluster {
    /// A GET of `path_and_query` on `edge`'s REST face as `p`, its JSON answer read.
    async fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        edge: &str,
        path_and_query: &str,
        p: &Principal,
        timeout: Duration,
    ) -> Result<T, ApiError> {
        let addr = self.edge_addr(edge).map_err(|f| f.0)?;
        let req = hyper::Request::get(format!("{}{path_and_query}", self.client.base(addr)))
            .header(PRINCIPAL_HEADER, encode_principal(p))
            .body(Body::empty())
            .map_err(|e| ApiError::internal(e.to_string()))?;
        let call = async {
            let resp = self.client.request(req).await.map_err(|e| {
                ApiError::unavailable(format!("edge {edge} ({addr}) does not answer ({e})"))
            })?;
            let status = resp.status();
            // Thousands of sandboxes' entries fit well inside this.
            let bytes = axum::body::to_bytes(Body::new(resp.into_body()), 64 << 20)
                .await
                .map_err(|e| ApiError::unavailable(format!("edge {edge}: {e}")))?;
            if !status.is_success() {
                let m = String::from_utf8_lossy(&bytes);
                return Err(ApiError::unavailable(format!(
                    "edge {edge} answered {status}: {m}"
                )));
            }
            serde_json::from_slice(&bytes).map_err(|e| {
                ApiError::internal(format!(
                    "edge {edge} gave an answer this apiserver cannot read: {e}"
                ))
            })
        };
        tokio::time::timeout(timeout, call)
            .await
            .map_err(|_| ApiError::unavailable(format!("edge {edge} did not answer in time")))?
    }
}

pub fn router(c: Arc<Cluster>) -> Router {
    let iam: Arc<dyn Iam> = Arc::new(c.iam.clone());
    let iam_routes = dsec_iam::http::routes()
        .with_state(iam)
        .route_layer(middleware::from_fn_with_state(c.clone(), auth));
    public_routes()
        .route("/v1/status", get(status))
        .route("/v1/sandboxes", post(create).get(list))
        .route("/v1/usage", get(usage))
        .route("/v1/images", get(images))
        .route("/v1/images/builds", post(images))
        .route("/v1/images:pull", post(images))
        .route("/v1/images:push", post(images))
        .route("/v1/registries", get(images))
        .route(
            "/v1/registries/{registry}/login",
            axum::routing::put(images).delete(images),
        )
        .route("/v1/groups/{verb}", post(group))
        .route("/v1/snapshots", get(list_snapshots))
        .route("/v1/snapshots/{sid}", any(snapshot))
        .route("/v1/snapshots/{sid}/{*rest}", any(snapshot_rest))
        .route("/v1/sandboxes/{id}", any(sandbox))
        .route("/v1/sandboxes/{id}/{*rest}", any(sandbox_rest))
        .route("/v1/events", get(events))
        .route("/v1/webhooks", any(events_per_node))
        .route("/v1/webhooks/{*rest}", any(events_per_node))
        .route("/metrics", get(metrics_text))
        .merge(dsec_console::routes())
        .merge(iam_routes)
        .fallback(|| async { no_such_endpoint() })
        .layer(middleware::from_fn(|r, n| {
            dsec_metrics::http::count("apiserver", r, n)
        }))
        .with_state(c)
}

/// `GET /metrics`: this apiserver's Prometheus metrics, for a key of the root project
/// only.
async fn metrics_text(State(c): State<Arc<Cluster>>, headers: HeaderMap) -> ApiResult<Response> {
    dsec_iam::http::metrics_for(&c.principal(&headers).await?)
}

async fn auth(State(c): State<Arc<Cluster>>, mut req: Request, next: Next) -> Response {
    match c.principal(req.headers()).await {
        Ok(p) => {
            req.extensions_mut().insert(p);
            next.run(req).await
        }
        Err(e) => e.into_response(),
    }
}

fn owning_edge(id: &str) -> ApiResult<String> {
    Ok(SandboxId::parse(id)
        .map_err(|e| ApiError::invalid(e.to_string()))?
        .edge()
        .to_string())
}

/// What a gRPC call of `edge` answered, as the REST answer: `status` and the JSON of the
/// message, or the edge's own error.
fn answer<M, T>(status: StatusCode, edge: &str, r: Result<M, CallError>) -> ApiResult<Response>
where
    T: TryFrom<M, Error = dsec_rpc::Malformed> + serde::Serialize,
{
    let m = r.map_err(|e| Failure(e.into_api(&format!("edge {edge}"))))?;
    let v = T::try_from(m).map_err(|e| {
        Failure(ApiError::internal(format!(
            "edge {edge} gave an answer this apiserver cannot read: {e}"
        )))
    })?;
    Ok(json(status, &v))
}

/// A call's request with the caller's principal.
fn ask<T>(msg: T, p: &Principal) -> Result<tonic::Request<T>, CallError> {
    dsec_rpc::with_principal(msg, &encode_principal(p))
}

/// The JSON body of a sandbox call, or `{}` when it has none.
fn optional_body<T: serde::de::DeserializeOwned>(bytes: &Bytes, what: &str) -> ApiResult<T> {
    if bytes.is_empty() {
        body(&Bytes::from_static(b"{}"), what)
    } else {
        body(bytes, what)
    }
}

async fn sandbox(
    State(c): State<Arc<Cluster>>,
    Path(id): Path<String>,
    req: Request,
) -> ApiResult<Response> {
    let p = c.principal(req.headers()).await?;
    let edge = owning_edge(&id)?;
    match *req.method() {
        // A read, often polled: forwarded as it is, which costs the hop least (measured
        // with `make bench-cluster`: about 0.3 ms less than a gRPC call on this hardware).
        Method::DELETE => {
            let r = pb::SandboxRef { id };
            let call = async { within(CREATE_TIMEOUT, c.edge(&edge)?.stop(ask(r, &p)?)).await };
            call.await
                .map_err(|e| Failure(e.into_api(&format!("edge {edge}"))))?;
            Ok(StatusCode::NO_CONTENT.into_response())
        }
        _ => c.forward(&edge, req, Some(&p)).await,
    }
}

async fn sandbox_rest(
    State(c): State<Arc<Cluster>>,
    Path((id, rest)): Path<(String, String)>,
    req: Request,
) -> ApiResult<Response> {
    let edge = owning_edge(&id)?;
    // Port forwarding may be opened by the sandbox's port token instead of a key; the
    // edge checks the token.
    let p = if rest.starts_with("ports/") && api_key(req.headers()).is_none() {
        None
    } else {
        Some(c.principal(req.headers()).await?)
    };
    let control = matches!(rest.as_str(), "fork" | "pause" | "resume");
    let (Some(p), true, &Method::POST) = (&p, control, req.method()) else {
        return c.forward(&edge, req, p.as_ref()).await;
    };
    let bytes = axum::body::to_bytes(req.into_body(), 1 << 20)
        .await
        .map_err(|e| ApiError::invalid(format!("reading the request body: {e}")))?;
    match rest.as_str() {
        "fork" => {
            let f: ForkRequest = optional_body(&bytes, "fork")?;
            let call = async {
                let msg = pb::ForkCall {
                    id,
                    request: Some(f.into()),
                };
                within(LONG_TIMEOUT, c.edge(&edge)?.fork(ask(msg, p)?)).await
            };
            answer::<_, ForkResponse>(StatusCode::CREATED, &edge, call.await)
        }
        "pause" => {
            let r: PauseRequest = optional_body(&bytes, "pause")?;
            let call = async {
                let msg = pb::PauseCall {
                    id,
                    request: Some(r.into()),
                };
                within(LONG_TIMEOUT, c.edge(&edge)?.pause(ask(msg, p)?)).await
            };
            answer::<_, SandboxInfo>(StatusCode::OK, &edge, call.await)
        }
        _ => {
            let r: ResumeRequest = optional_body(&bytes, "resume")?;
            let call = async {
                let msg = pb::ResumeCall {
                    id,
                    request: Some(r.into()),
                };
                within(LONG_TIMEOUT, c.edge(&edge)?.resume(ask(msg, p)?)).await
            };
            answer::<_, SandboxInfo>(StatusCode::OK, &edge, call.await)
        }
    }
}

async fn snapshot(
    State(c): State<Arc<Cluster>>,
    Path(sid): Path<String>,
    req: Request,
) -> ApiResult<Response> {
    let p = c.principal(req.headers()).await?;
    let edge = owning_edge(&sid)?;
    c.forward(&edge, req, Some(&p)).await
}

async fn snapshot_rest(
    State(c): State<Arc<Cluster>>,
    Path((sid, _rest)): Path<(String, String)>,
    req: Request,
) -> ApiResult<Response> {
    let p = c.principal(req.headers()).await?;
    let edge = owning_edge(&sid)?;
    c.forward(&edge, req, Some(&p)).await
}

/// An answer gathered from the edges, naming in `x-dsec-unreachable-edges` those that did
/// not answer.
fn naming_unreachable(mut resp: Response, missing: &[String]) -> Response {
    if !missing.is_empty()
        && let Ok(v) = HeaderValue::from_str(&missing.join(","))
    {
        resp.headers_mut().insert("x-dsec-unreachable-edges", v);
    }
    resp
}

/// Every edge's snapshots the caller may see.
async fn list_snapshots(State(c): State<Arc<Cluster>>, headers: HeaderMap) -> ApiResult<Response> {
    let p = c.principal(&headers).await?;
    let calls = c.edges.keys().map(|edge| {
        let (c, p) = (c.clone(), p.clone());
        async move {
            let call = async {
                let msg = ask(pb::ListSnapshotsRequest {}, &p)?;
                within(CALL_TIMEOUT, c.edge(edge)?.list_snapshots(msg)).await
            };
            (edge.clone(), call.await)
        }
    });
    let mut out = ListSnapshotsResponse {
        snapshots: Vec::new(),
    };
    let mut missing = Vec::new();
    for (edge, r) in futures_util::future::join_all(calls).await {
        match r {
            Ok(l) => out
                .snapshots
                .extend(ListSnapshotsResponse::from(l).snapshots),
            Err(e) => {
                tracing::warn!(edge = %edge, "listing snapshots: {e}");
                missing.push(edge)
            }
        }
    }
    out.snapshots.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(naming_unreachable(json(StatusCode::OK, &out), &missing))
}

/// Every edge's usage of the caller's sandboxes, together (an edge that does not answer
/// is named in `x-dsec-unreachable-edges`).
async fn usage(
    State(c): State<Arc<Cluster>>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let p = c.principal(&headers).await?;
    // Checked here, so a bad filter is one clear error, not one per edge.
    label_filter(q.as_deref())?;
    let pq = match &q {
        Some(q) => format!("/v1/usage?{q}"),
        None => "/v1/usage".to_string(),
    };
    let calls = c.edges.keys().map(|edge| {
        let (c, p, pq) = (c.clone(), p.clone(), pq.clone());
        async move {
            let r = c
                .get_json::<UsageResponse>(edge, &pq, &p, CALL_TIMEOUT)
                .await;
            (edge.clone(), r)
        }
    });
    let mut out = UsageResponse {
        sandboxes: Vec::new(),
        interval_ms: 0,
    };
    let mut missing = Vec::new();
    for (edge, r) in futures_util::future::join_all(calls).await {
        match r {
            Ok(u) => {
                out.sandboxes.extend(u.sandboxes);
                out.interval_ms = out.interval_ms.max(u.interval_ms);
            }
            Err(e) => {
                tracing::warn!(edge = %edge, "usage: {}", e.message);
                missing.push(edge)
            }
        }
    }
    out.sandboxes.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(naming_unreachable(json(StatusCode::OK, &out), &missing))
}

/// Webhooks are kept by each node (`dsec up`); a cluster's apiserver does not keep them
/// for its edges yet, and says so instead of a bare 404.
async fn events_per_node() -> ApiResult<Response> {
    Err(ApiError::unimplemented(
        "webhooks are kept by a single node (dsec up); a cluster's apiserver does not keep them for its edges yet (GET /v1/events is served)",
    )
    .into())
}

/// `GET /v1/events` over every edge. Each edge numbers its events by its clock's
/// microseconds and answers with where its next page starts (the last event of a full
/// page, else its position then); the answer holds the events up to the least of those,
/// merged by number, so an event an edge records later is never numbered below a `next`
/// already given: nothing is passed over, nothing repeated. Every edge must answer (an
/// edge that does not is an error, not a gap). One sandbox's events are its edge's alone.
async fn events(
    State(c): State<Arc<Cluster>>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    use dsec_common::api::{Event, ListEventsResponse};
    use dsec_common::event_query::{EventQuery, MAX_LIMIT};
    let p = c.principal(&headers).await?;
    let q = EventQuery::parse(q.as_deref().unwrap_or(""))?;
    // One edge's answer to `query`, waiting up to its `wait`.
    let ask = |edge: String, query: &EventQuery| {
        let (c, p) = (c.clone(), p.clone());
        let pq = format!(
            "/v1/events?{}&wait_seconds={}",
            query.to_query(),
            query.wait.as_secs_f64()
        );
        let timeout = CALL_TIMEOUT + query.wait;
        Box::pin(async move {
            c.get_json::<ListEventsResponse>(&edge, &pq, &p, timeout)
                .await
        })
    };
    if let Some(s) = &q.sandbox {
        let r = ask(owning_edge(s)?, &q).await.map_err(Failure)?;
        return Ok(json(StatusCode::OK, &r));
    }
    if q.newest_first && q.offset + q.limit > MAX_LIMIT {
        return Err(ApiError::invalid(format!(
            "a cluster's newest-first pages reach {MAX_LIMIT} events deep at most: offset + limit is {}",
            q.offset + q.limit
        ))
        .into());
    }
    // Each edge is asked for enough to fill the page alone; newest first, the offset is
    // taken over the merged list.
    let per_edge = EventQuery {
        limit: if q.newest_first {
            q.offset + q.limit
        } else {
            q.limit
        },
        offset: 0,
        wait: std::time::Duration::ZERO,
        ..q.clone()
    };
    let every_edge = |query: &EventQuery| -> Vec<_> {
        c.edges
            .keys()
            .map(|edge| ask(edge.clone(), query))
            .collect()
    };
    let mut answers = futures_util::future::try_join_all(every_edge(&per_edge))
        .await
        .map_err(|e| {
            Failure(ApiError::unavailable(format!(
                "{}; events are read from every edge, so that none is passed over: ask again once it is back, or for one sandbox's with sandbox=",
                e.message
            )))
        })?;
    if answers.iter().all(|r| r.events.is_empty()) && !q.wait.is_zero() {
        // Wait on every edge at once for the first new event, then read them all again.
        let horizon = answers.iter().map(|r| r.next).min().unwrap_or(q.after);
        let waiting = EventQuery {
            after: horizon.max(q.after),
            limit: 1,
            wait: q.wait,
            ..per_edge.clone()
        };
        let mut pending = every_edge(&waiting);
        while !pending.is_empty() {
            let (r, _, rest) = futures_util::future::select_all(pending).await;
            if r.is_ok_and(|l| !l.events.is_empty()) {
                break;
            }
            pending = rest;
        }
        answers = futures_util::future::try_join_all(every_edge(&per_edge))
            .await
            .map_err(Failure)?;
    }
    // Past this, an edge has not said what it holds.
    let horizon = answers.iter().map(|r| r.next).min().unwrap_or(q.after);
    let mut merged: Vec<Event> = answers
        .into_iter()
        .flat_map(|r| r.events)
        .filter(|e| q.newest_first || e.seq <= horizon)
        .collect();
    let next;
    if q.newest_first {
        merged.sort_by(|a, b| b.seq.cmp(&a.seq).then(a.id.cmp(&b.id)));
        merged = merged.into_iter().skip(q.offset).take(q.limit).collect();
        next = horizon.max(q.after);
    } else {
        merged.sort_by(|a, b| a.seq.cmp(&b.seq).then(a.id.cmp(&b.id)));
        next = if merged.len() > q.limit {
            // Two edges may number events alike: a page never ends between two such.
            let mut cut = q.limit;
            let at = merged[cut].seq;
            while cut > 0 && merged[cut - 1].seq == at {
                cut -= 1;
            }
            if cut == 0 {
                cut = merged.iter().take_while(|e| e.seq == at).count();
            }
            merged.truncate(cut);
            merged.last().map_or(horizon, |e| e.seq)
        } else if merged.len() == q.limit {
            merged.last().map_or(horizon, |e| e.seq)
        } else {
            horizon
        }
        .max(q.after);
    }
    Ok(json(
        StatusCode::OK,
        &ListEventsResponse {
            events: merged,
            next,
        },
    ))
}

async fn status(State(c): State<Arc<Cluster>>, headers: HeaderMap) -> ApiResult<Response> {
    let p = c.principal(&headers).await?;
    let mut view = c.view();
    if view.nodes().is_empty() {
        c.refresh_once().await;
        view = c.view();
    }
    Ok(json(StatusCode::OK, &status_for(&p, view.status())))
}

async fn create(
    State(c): State<Arc<Cluster>>,
    headers: HeaderMap,
    bytes: Bytes,
) -> ApiResult<Response> {
    let p = c.principal(&headers).await?;
    let req = create_request(&bytes, &p)?;
    if !req.volumes.is_empty() {
        return Err(ApiError::unimplemented(
            "volumes are kept by one edge: create a sandbox with volumes through that edge's API (the cluster apiserver does not place them yet)",
        )
        .into());
    }
    let demand = Demand {
        backend: req.backend.clone(),
        memory_mb: req
            .memory_limit_mb
            .filter(|m| m.is_finite() && *m > 0.0)
            .map(|m| m as u64)
            .unwrap_or(DEFAULT_MEMORY_MB),
    };
    let msg = pb::CreateCall {
        request: Some(req.into()),
    };
    let mut view = c.view();
    if view.nodes().is_empty() {
        c.refresh_once().await;
        view = c.view();
    }
    let mut exclude: Vec<String> = Vec::new();
    let mut refusals: Vec<String> = Vec::new();
    loop {
        let node = match c.placer.choose(&view, &demand, &exclude) {
            Ok(n) => n,
            Err(e) => {
                let any_healthy = view.nodes().iter().any(|n| n.healthy);
                let mut msg = e.to_string();
                if !refusals.is_empty() {
                    msg = format!("{msg} ({})", refusals.join("; "));
                }
                return Err(Failure(if any_healthy {
                    ApiError::node_full(msg)
                } else {
                    ApiError::unavailable(msg)
                }));
            }
        };
        let call = async {
            let req = ask(msg.clone(), &p)?;
            within(CREATE_TIMEOUT, c.edge(&node)?.create(req)).await
        };
        match call.await {
            Err(CallError::Api(e))
                if e.node_refused && e.code == dsec_common::ErrorCode::ResourceExhausted =>
            {
                tracing::info!(edge = %node, "edge refused the create; placing it elsewhere");
                refusals.push(format!("{node} is full"));
            }
            Err(e @ CallError::Api(_)) => return Err(Failure(e.into_api(&node))),
            Err(e) => {
                tracing::warn!(edge = %node, "create not delivered: {e}");
                refusals.push(format!("{node} does not answer"));
            }
            Ok(info) => return answer::<_, SandboxInfo>(StatusCode::CREATED, &node, Ok(info)),
        }
        exclude.push(node);
    }
}

async fn list(
    State(c): State<Arc<Cluster>>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let p = c.principal(&headers).await?;
    // Checked here, so a bad filter is one clear error, not one per edge.
    let labels = label_filter(q.as_deref())?;
    let calls = c.edges.keys().map(|edge| {
        let (c, p, labels) = (c.clone(), p.clone(), labels.clone());
        async move {
            let call = async {
                let msg = ask(pb::ListSandboxesRequest { labels }, &p)?;
                let l = within(CALL_TIMEOUT, c.edge(edge)?.list(msg)).await?;
                Ok::<_, CallError>(ListSandboxesResponse::try_from(l)?)
            };
            (edge.clone(), call.await)
        }
    });
    let mut out = ListSandboxesResponse {
        sandboxes: Vec::new(),
    };
    let mut missing = Vec::new();
    for (edge, r) in futures_util::future::join_all(calls).await {
        match r {
            Ok(l) => out.sandboxes.extend(l.sandboxes),
            // The same answer from every edge: pass it on.
            Err(CallError::Api(e)) => return Err(Failure(e)),
            Err(e) => {
                tracing::warn!(edge = %edge, "listing sandboxes: {e}");
                missing.push(edge)
            }
        }
    }
    out.sandboxes.sort_by(|a, b| a.id.cmp(&b.id));
    // The listing lacks these edges' sandboxes (they did not answer).
    Ok(naming_unreachable(json(StatusCode::OK, &out), &missing))
}

/// A group pause or resume: every edge acts on its own sandboxes with the labels, at
/// once; the answers are merged. An edge that does not answer is one failure, named.
async fn group(
    State(c): State<Arc<Cluster>>,
    Path(verb): Path<String>,
    headers: HeaderMap,
    bytes: Bytes,
) -> ApiResult<Response> {
    if verb != "pause" && verb != "resume" {
        return Err(Failure(ApiError::not_found(
            "no such endpoint: groups can be paused (/v1/groups/pause) or resumed (/v1/groups/resume)",
        )));
    }
    let p = c.principal(&headers).await?;
    // Checked here too, so a bad body is one clear error, not one per edge.
    let req: GroupRequest = body(&bytes, "group")?;
    if req.labels.is_empty() {
        return Err(Failure(ApiError::invalid(
            "labels must name at least one key: value; a group is the sandboxes that carry them all",
        )));
    }
    let started = std::time::Instant::now();
    let msg = pb::GroupCall {
        resume: verb == "resume",
        request: Some(req.into()),
    };
    let calls = c.edges.keys().map(|edge| {
        let (c, p, msg) = (c.clone(), p.clone(), msg.clone());
        async move {
            let call = async {
                let g = within(GROUP_TIMEOUT, c.edge(edge)?.group(ask(msg, &p)?)).await?;
                Ok::<_, CallError>(GroupResponse::try_from(g)?)
            };
            (edge.clone(), call.await)
        }
    });
    let mut out = GroupResponse::default();
    for (edge, r) in futures_util::future::join_all(calls).await {
        let answer = match r {
            Ok(g) => Ok(g),
            Err(CallError::Api(e)) => Err(format!("edge {edge}: {}", e.message)),
            Err(e) => Err(format!("edge {edge} does not answer: {e}")),
        };
        match answer {
            Ok(g) => {
                out.done.extend(g.done);
                out.failed.extend(g.failed);
            }
            Err(message) => out.failed.push(GroupFailure {
                id: format!("edge:{edge}"),
                code: dsec_common::ErrorCode::Unavailable,
                message,
            }),
        }
    }
    out.done.sort();
    out.took_ms = started.elapsed().as_millis() as u64;
    Ok(json(StatusCode::OK, &out))
}

/// Images and registry logins (`/v1/images`, builds, pulls, pushes, `/v1/registries`):
/// any healthy edge (the image store, and the logins kept in it, are shared).
async fn images(State(c): State<Arc<Cluster>>, req: Request) -> ApiResult<Response> {
    let p = c.principal(req.headers()).await?;
    let view = c.view();
    let edge = view
        .nodes()
        .iter()
        .find(|n| n.healthy)
        .map(|n| n.name.clone())
        .or_else(|| c.edges.keys().next().cloned())
        .ok_or_else(|| ApiError::unavailable("the cluster has no edges"))?;
    c.forward(&edge, req, Some(&p)).await
}
