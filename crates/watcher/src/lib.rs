//! The watcher: polls every edge and aggregates node state (capacity, load, backends,
//! sandboxes per project) for the apiservers' placement ([`placement`]). In the
//! single-node `dsec up` there is one edge and the apiserver reads it directly; this crate
//! holds the view the cluster watcher serves and the placer the apiservers run on it.

pub mod placement;
pub mod poll;

use std::collections::BTreeMap;

use dsec_common::api::{ClusterStatus, NodeStatus};

pub use placement::{Demand, PlacementError, Placer};
pub use poll::{CallError, EdgeEndpoint, PollError, Poller, SharedView};

/// The watcher's view as the `dsec.v1.Watcher` gRPC service, read by the apiservers (its
/// listener admits apiserver certificates only).
pub fn router(view: SharedView) -> axum::Router {
    dsec_rpc::routes(dsec_rpc::pb::watcher_server::WatcherServer::new(
        ViewService { view },
    ))
}

pub struct ViewService {
    view: SharedView,
}

#[tonic::async_trait]
impl dsec_rpc::pb::watcher_server::Watcher for ViewService {
    async fn view(
        &self,
        _: tonic::Request<dsec_rpc::pb::StatusRequest>,
    ) -> Result<tonic::Response<dsec_rpc::pb::ClusterStatus>, tonic::Status> {
        let s = self.view.read().unwrap_or_else(|p| p.into_inner()).status();
        Ok(tonic::Response::new(s.into()))
    }
}

/// The aggregated view of every node.
#[derive(Debug, Default, Clone)]
pub struct ClusterView {
    nodes: Vec<NodeStatus>,
}

impl ClusterView {
    pub fn update(&mut self, node: NodeStatus) {
        match self.nodes.iter_mut().find(|n| n.name == node.name) {
            Some(n) => *n = node,
            None => self.nodes.push(node),
        }
        self.nodes.sort_by(|a, b| a.name.cmp(&b.name));
    }

    pub fn nodes(&self) -> &[NodeStatus] {
        &self.nodes
    }

    /// Sandboxes per project across the cluster.
    pub fn projects(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for n in &self.nodes {
            for (p, c) in &n.projects {
                *out.entry(p.clone()).or_insert(0) += c;
            }
        }
        out
    }

    pub fn status(&self) -> ClusterStatus {
        ClusterStatus {
            version: env!("CARGO_PKG_VERSION").to_string(),
            nodes: self.nodes.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, sandboxes: u64) -> NodeStatus {
        NodeStatus {
            healthy: true,
            sandboxes,
            projects: BTreeMap::from([("root/a".to_string(), sandboxes)]),
            ..NodeStatus::unreachable(name)
        }
    }

    #[test]
    fn update_replaces_a_node_and_keeps_order() {
        let mut v = ClusterView::default();
        v.update(node("b", 1));
        v.update(node("a", 1));
        v.update(node("b", 5));
        let s = v.status();
        assert_eq!(s.nodes.len(), 2);
        assert_eq!(s.nodes[0].name, "a");
        assert_eq!(s.nodes[1].sandboxes, 5);
        assert_eq!(v.projects()["root/a"], 6);
    }
}
