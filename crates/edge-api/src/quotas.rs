//! The quota gate the edge asks before a sandbox starts, backed by IAM.

use std::sync::Arc;

use dsec_common::ApiError;
use dsec_edge::registry::SandboxRecord;
use dsec_edge::{Pending, Quotas};
use dsec_iam::http::api_error;
use dsec_iam::{Command, Iam, Reservation, Usage};

/// The edge's quota gate, backed by IAM.
pub struct IamQuotas(pub Arc<dyn Iam>);

impl Quotas for IamQuotas {
    fn reserve(&self, rec: &SandboxRecord) -> Pending<Result<(), ApiError>> {
        let applying = self.0.clone().apply_async(Command::Reserve(Reservation {
            sandbox_id: rec.id.clone(),
            project: rec.project.clone(),
            edge: rec.edge.clone(),
            usage: Usage {
                sandboxes: 1,
                cpu_cores: rec.limits.cpu_cores,
                memory_mb: rec.limits.memory_mb,
                disk_mb: rec.limits.disk_mb,
            },
        }));
        Box::pin(async move { applying.await.map_err(api_error) })
    }

    fn hold_disk(&self, id: &str, project: &str, edge: &str, bytes: u64) -> Result<(), ApiError> {
        self.0
            .apply(Command::Hold(Reservation {
                sandbox_id: id.to_string(),
                project: project.to_string(),
                edge: edge.to_string(),
                usage: Usage {
                    disk_mb: bytes.div_ceil(1 << 20),
                    ..Usage::default()
                },
            }))
            .map_err(api_error)
    }

    fn release(&self, sandbox_id: &str) -> Pending<()> {
        let id = sandbox_id.to_string();
        let applying = self.0.clone().apply_async(Command::Release {
            sandbox_id: id.clone(),
        });
        Box::pin(async move {
            if let Err(e) = applying.await {
                tracing::warn!(sandbox = %id, "releasing its quota: {e}");
            }
        })
    }

    fn reconcile(&self, edge: &str, live: Vec<String>) {
        if let Err(e) = self.0.apply(Command::Reconcile {
            edge: edge.to_string(),
            live,
        }) {
            tracing::warn!("reconciling quota usage: {e}");
        }
    }
}
