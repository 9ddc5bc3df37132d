//! What the edge shows Prometheus (`dsec_metrics::sandbox`) of what exists: at each scrape,
//! its sandboxes by state and project and its pools' ready members, counted under the
//! sandbox map's lock (a pass over records in memory, no record copied).

use super::*;

pub(crate) fn watch(edge: &Arc<Edge>) {
    let weak = Arc::downgrade(edge);
    dsec_metrics::on_scrape(move || {
        let Some(edge) = weak.upgrade() else { return };
        let mut sandboxes: HashMap<(String, String), i64> = HashMap::new();
        let mut pools: HashMap<String, i64> = HashMap::new();
        for e in edge
            .sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
        {
            let r = e.rec.lock().unwrap_or_else(|p| p.into_inner());
            match &r.pool_waiting {
                // A pool member is nobody's until handed out.
                Some(pool) => *pools.entry(pool.clone()).or_default() += 1,
                None => {
                    *sandboxes
                        .entry((r.state.as_str().to_string(), r.project.clone()))
                        .or_default() += 1
                }
            }
        }
        dsec_metrics::sandbox::set_sandboxes(sandboxes);
        dsec_metrics::sandbox::set_pools(pools);
    });
}
