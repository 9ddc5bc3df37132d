//! Polling: the watcher asks every edge for its status (`GET /v1/status` of the edge's API,
//! which answers with the cluster status of that one node) and keeps the latest answers.
//! An edge that does not answer within the timeout is kept in the view as unhealthy, so
//! placement skips it until it answers again. The view has no durable state: a restarted
//! watcher has it back after one round.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use dsec_common::api::NodeStatus;
use dsec_rpc::pb::edge_client::EdgeClient;
use dsec_rpc::{Channels, pb, status::within};

use crate::ClusterView;

pub use dsec_rpc::CallError;

/// One edge to poll.
#[derive(Debug, Clone, PartialEq)]
pub struct EdgeEndpoint {
    pub name: String,
    /// `host:port` of the edge's cluster listener.
    pub addr: String,
}

/// The view, shared with whoever serves or reads it.
pub type SharedView = Arc<RwLock<ClusterView>>;

/// Why an edge's answer is not taken.
#[derive(Debug, thiserror::Error)]
pub enum PollError {
    #[error(transparent)]
    Call(#[from] CallError),
    #[error("the edge at {addr} is not named {name}")]
    Misnamed { addr: String, name: String },
}

pub struct Poller {
    edges: Vec<EdgeEndpoint>,
    timeout: Duration,
    channels: Channels,
    /// The encoded principal the poller asks as (the edges cut per-project counts to it).
    principal: String,
    view: SharedView,
}

impl Poller {
    /// Asks each edge's `dsec.v1.Edge/Status` over `channels` as `principal`.
    pub fn new(
        edges: Vec<EdgeEndpoint>,
        timeout: Duration,
        channels: Channels,
        principal: String,
    ) -> Poller {
        Poller {
            edges,
            timeout,
            channels,
            principal,
            view: SharedView::default(),
        }
    }

    pub fn view(&self) -> SharedView {
        self.view.clone()
    }

    async fn fetch(&self, e: &EdgeEndpoint) -> Result<NodeStatus, PollError> {
        let mut client = self.channels.client(&e.addr, EdgeClient::with_origin)?;
        let req = dsec_rpc::with_principal(pb::StatusRequest {}, &self.principal)?;
        let node = within(self.timeout, client.status(req)).await?;
        let node = NodeStatus::try_from(node).map_err(CallError::from)?;
        if node.name != e.name {
            return Err(PollError::Misnamed {
                addr: e.addr.clone(),
                name: e.name.clone(),
            });
        }
        Ok(node)
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
    use dsec_mtls::{Role, Tls, TlsFiles, pki};
    use dsec_rpc::pb::edge_server::{Edge, EdgeServer};
    use tonic::{Request, Response, Status};

    /// An edge that answers its status with `sandboxes`, named `name`, to callers that
    /// name a principal.
    struct FakeEdge {
        name: &'static str,
        sandboxes: u64,
    }

    #[tonic::async_trait]
    impl Edge for FakeEdge {
        async fn status(
            &self,
            req: Request<pb::StatusRequest>,
        ) -> Result<Response<pb::NodeStatus>, Status> {
            if req.metadata().get(dsec_rpc::PRINCIPAL_METADATA).is_none() {
                return Err(Status::unauthenticated("no principal"));
            }
            let mut n = NodeStatus::unreachable(self.name);
            n.healthy = true;
            n.sandboxes = self.sandboxes;
            Ok(Response::new(n.into()))
        }
    }

    fn tls(dir: &std::path::Path, role: Role, name: &str) -> Tls {
        pki::issue(dir, role, name, &["127.0.0.1".to_string()]).unwrap();
        Tls::load(&TlsFiles::in_dir(dir, name)).unwrap()
    }

    /// An edge on a runtime of its own, so that stopping it (dropping the runtime) ends
    /// its open connections too, as a stopped process does.
    async fn fake_edge(
        dir: &std::path::Path,
        name: &'static str,
        sandboxes: u64,
    ) -> (String, tokio::runtime::Runtime) {
        let tls = tls(dir, Role::Edge, name);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let app = dsec_rpc::routes(EdgeServer::new(FakeEdge { name, sandboxes }));
        rt.spawn(async move {
            let l = tokio::net::TcpListener::from_std(l).unwrap();
            let _ = dsec_mtls::serve(l, &tls, &[Role::Watcher], app, std::future::pending()).await;
        });
        (addr, rt)
    }

    #[tokio::test]
    async fn polls_every_edge_over_grpc_and_marks_a_silent_one_unhealthy() {
        let dir = tempfile::tempdir().unwrap();
        pki::init_ca(dir.path()).unwrap();
        let (a1, h1) = fake_edge(dir.path(), "e1", 3).await;
        let (a2, h2) = fake_edge(dir.path(), "e2", 5).await;
        let watcher = tls(dir.path(), Role::Watcher, "w");
        let ep = |name: &str, addr: &str| EdgeEndpoint {
            name: name.into(),
            addr: addr.into(),
        };
        let p = Poller::new(
            vec![ep("e1", &a1), ep("e2", &a2), ep("e3", &a1)],
            Duration::from_secs(5),
            Channels::new(Some(watcher.client.clone())),
            "p".into(),
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
        h2.shutdown_background();
        p.poll_once().await;
        assert!(
            !p.view().read().unwrap().nodes()[1].healthy,
            "a stopped edge stays unhealthy"
        );
        // A poller whose certificate the edge's listener does not admit (an edge's own)
        // gets no status.
        let other = tls(dir.path(), Role::Edge, "e9");
        let refused = Poller::new(
            vec![ep("e1", &a1)],
            Duration::from_secs(5),
            Channels::new(Some(other.client.clone())),
            "p".into(),
        );
        refused.poll_once().await;
        assert!(!refused.view().read().unwrap().nodes()[0].healthy);
        h1.shutdown_background();
    }
}
