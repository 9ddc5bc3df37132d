//! Polling: the watcher asks every edge for its status (`GET /v1/status` of the edge's API,
//! which answers with the cluster status of that one node) and keeps the latest answers.
//! An edge that does not answer within the timeout is kept in the view as unhealthy, so
//! placement skips it until it answers again. The view has no durable state: a restarted
//! watcher has it back after one round.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use dsec_common::api::{ClusterStatus, NodeStatus};
use http_body_util::BodyExt;

use crate::ClusterView;

/// Why a call to another component got no usable answer.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The connection failed: the client's error and its cause.
    #[error("{}", chain(.0.as_ref()))]
    Transport(Box<dyn std::error::Error + Send + Sync>),
    #[error("reading the answer: {}", chain(.0.as_ref()))]
    Body(Box<dyn std::error::Error + Send + Sync>),
    #[error("HTTP {0}")]
    Status(u16),
    #[error("a malformed answer: {0}")]
    Malformed(#[from] serde_json::Error),
    #[error("the edge at {url} is not named {name}")]
    Misnamed { url: String, name: String },
    #[error("the request: {0}")]
    Request(#[from] hyper::http::Error),
    /// The component is not one this caller knows.
    #[error("{0}")]
    Unknown(String),
}

/// An error and the first cause under it, as one line.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    match e.source() {
        Some(s) => format!("{e}: {s}"),
        None => e.to_string(),
    }
}

/// One edge to poll.
#[derive(Debug, Clone, PartialEq)]
pub struct EdgeEndpoint {
    pub name: String,
    /// Base URL of the edge's API, e.g. `https://10.0.0.7:7700`.
    pub url: String,
    /// A header that authenticates the watcher (an API key, or in a cluster, where the
    /// certificate authenticates, the forwarded principal).
    pub auth: Option<(String, String)>,
}

/// The view, shared with whoever serves or reads it.
pub type SharedView = Arc<RwLock<ClusterView>>;

pub struct Poller {
    edges: Vec<EdgeEndpoint>,
    timeout: Duration,
    http: dsec_mtls::Client,
    view: SharedView,
}

impl Poller {
    /// `http` is plain for `http://` edges, or carries the watcher's certificate.
    pub fn new(edges: Vec<EdgeEndpoint>, timeout: Duration, http: dsec_mtls::Client) -> Poller {
        Poller {
            edges,
            timeout,
            http,
            view: SharedView::default(),
        }
    }

    pub fn view(&self) -> SharedView {
        self.view.clone()
    }

    async fn fetch(&self, e: &EdgeEndpoint) -> Result<NodeStatus, CallError> {
        let mut req = hyper::Request::get(format!("{}/v1/status", e.url.trim_end_matches('/')));
        if let Some((k, v)) = &e.auth {
            req = req.header(k.as_str(), v.as_str());
        }
        let req = req.body(dsec_mtls::client::Body::empty())?;
        let resp = tokio::time::timeout(self.timeout, self.http.request(req))
            .await
            .map_err(|_| CallError::Timeout(self.timeout))?
            .map_err(|err| CallError::Transport(err.into()))?;
        if !resp.status().is_success() {
            return Err(CallError::Status(resp.status().as_u16()));
        }
        let body = tokio::time::timeout(self.timeout, resp.into_body().collect())
            .await
            .map_err(|_| CallError::Timeout(self.timeout))?
            .map_err(|err| CallError::Body(err.into()))?
            .to_bytes();
        let s: ClusterStatus = serde_json::from_slice(&body)?;
        s.nodes
            .into_iter()
            .find(|n| n.name == e.name)
            .ok_or_else(|| CallError::Misnamed {
                url: e.url.clone(),
                name: e.name.clone(),
            })
    }

    /// Asks every edge once, concurrently, and updates the view.
    pub async fn poll_once(&self) {
        let answers =
            futures_util::future::join_all(self.edges.iter().map(|e| self.fetch(e))).await;
        let mut view = self.view.write().unwrap_or_else(|p| p.into_inner());
        for (e, a) in self.edges.iter().zip(answers) {
            match a {
                Ok(n) => view.update(n),
                Err(why) => {
                    tracing::warn!(edge = %e.name, "unreachable: {why}");
                    view.update(NodeStatus::unreachable(&e.name));
                }
            }
        }
    }

    /// Polls every `every` until the task is dropped.
    pub async fn run(self, every: Duration) {
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            self.poll_once().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::Router;
    use axum::routing::get;

    async fn fake_edge(
        name: &'static str,
        sandboxes: u64,
    ) -> (String, tokio::task::JoinHandle<()>) {
        let app = Router::new().route(
            "/v1/status",
            get(move |h: axum::http::HeaderMap| async move {
                if h.get("authorization").and_then(|v| v.to_str().ok()) != Some("Bearer dsk.k") {
                    return Err(axum::http::StatusCode::UNAUTHORIZED);
                }
                let mut n = NodeStatus::unreachable(name);
                n.healthy = true;
                n.sandboxes = sandboxes;
                Ok(axum::Json(ClusterStatus {
                    version: "t".into(),
                    nodes: vec![n],
                }))
            }),
        );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        (
            url,
            tokio::spawn(async move {
                let _ = axum::serve(l, app).await;
            }),
        )
    }

    #[tokio::test]
    async fn polls_every_edge_and_marks_a_silent_one_unhealthy() {
        let (u1, h1) = fake_edge("e1", 3).await;
        let (u2, h2) = fake_edge("e2", 5).await;
        let ep = |name: &str, url: &str, key: &str| EdgeEndpoint {
            name: name.into(),
            url: url.into(),
            auth: Some(("authorization".into(), format!("Bearer {key}"))),
        };
        let p = Poller::new(
            vec![
                ep("e1", &u1, "dsk.k"),
                ep("e2", &u2, "dsk.k"),
                ep("e3", &u1, "dsk.k"),
            ],
            Duration::from_millis(500),
            dsec_mtls::Client::new(None),
        );
        p.poll_once().await;
        let v = p.view().read().unwrap().clone();
        let health: Vec<(String, bool, u64)> = v
            .nodes()
            .iter()
            .map(|n| (n.name.clone(), n.healthy, n.sandboxes))
            .collect();
        // e3 points at an edge named e1: not trusted as e3.
        assert_eq!(
            health,
            [
                ("e1".into(), true, 3),
                ("e2".into(), true, 5),
                ("e3".into(), false, 0)
            ]
        );
        h2.abort();
        let _ = h2.await;
        p.poll_once().await;
        assert!(
            !p.view().read().unwrap().nodes()[1].healthy,
            "a stopped edge stays unhealthy"
        );
        let wrong_key = Poller::new(
            vec![ep("e1", &u1, "dsk.bad")],
            Duration::from_millis(500),
            dsec_mtls::Client::new(None),
        );
        wrong_key.poll_once().await;
        assert!(!wrong_key.view().read().unwrap().nodes()[0].healthy);
        h1.abort();
    }
}
