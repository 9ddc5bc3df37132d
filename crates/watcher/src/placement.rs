//! Placement on the watcher's view: filter the nodes that can take a sandbox (healthy, the
//! backend available, room for its memory and a free slot), then power-of-k choices: sample
//! k of them at random and take the least loaded. Each apiserver overlays its own recent
//! placements on the view, which is a poll behind, so a burst from one apiserver does not
//! pile onto the node that looked emptiest; the randomness keeps several apiservers from
//! herding onto the same one. The edge still has the final say (its admission).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use dsec_common::api::NodeStatus;

use crate::ClusterView;

/// What a sandbox needs from a node.
#[derive(Debug, Clone, PartialEq)]
pub struct Demand {
    pub backend: String,
    pub memory_mb: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("no node can take this sandbox: {0}")]
    NoCapacity(String),
}

struct Placed {
    at: Instant,
    node: String,
    memory_mb: u64,
}

pub struct Placer {
    k: usize,
    /// How long an own placement counts on top of the view (about two poll periods).
    overlay_for: Duration,
    recent: Mutex<VecDeque<Placed>>,
    rng: Mutex<u64>,
}

impl Placer {
    pub fn new(k: usize, overlay_for: Duration) -> Placer {
        let mut seed = [0u8; 8];
        dsec_common::id::fill_random(&mut seed);
        Placer {
            k: k.max(1),
            overlay_for,
            recent: Mutex::new(VecDeque::new()),
            rng: Mutex::new(u64::from_le_bytes(seed) | 1),
        }
    }

    fn next_random(&self) -> u64 {
        // xorshift64*: plenty for spreading load, no crate needed.
        let mut s = self.rng.lock().unwrap_or_else(|p| p.into_inner());
        *s ^= *s >> 12;
        *s ^= *s << 25;
        *s ^= *s >> 27;
        s.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Own placements per node still within the overlay window: (count, memory).
    fn overlay(&self, node: &str) -> (u64, u64) {
        let mut r = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        while r
            .front()
            .is_some_and(|p| now.duration_since(p.at) > self.overlay_for)
        {
            r.pop_front();
        }
        r.iter()
            .filter(|p| p.node == node)
            .fold((0, 0), |(n, m), p| (n + 1, m + p.memory_mb))
    }

    /// Why `n` cannot take `d`, if it cannot.
    fn unfit(&self, n: &NodeStatus, d: &Demand) -> Option<String> {
        if !n.healthy {
            return Some(format!("{} is unhealthy", n.name));
        }
        if !n
            .backends
            .iter()
            .any(|b| b.name == d.backend && b.available)
        {
            return Some(format!("{} has no {} backend", n.name, d.backend));
        }
        let (count, mem) = self.overlay(&n.name);
        if n.max_sandboxes > 0 && n.sandboxes + count >= n.max_sandboxes {
            return Some(format!(
                "{} is full ({} sandboxes)",
                n.name,
                n.sandboxes + count
            ));
        }
        if n.memory_available_mb.saturating_sub(mem) < d.memory_mb.min(n.memory_total_mb) / 4 {
            // Sandboxes rarely use their whole limit; a quarter of it free is the floor.
            return Some(format!(
                "{} has {} MiB free",
                n.name,
                n.memory_available_mb.saturating_sub(mem)
            ));
        }
        None
    }

    /// Load of a node as this apiserver sees it: sandboxes per core.
    fn load(&self, n: &NodeStatus) -> f64 {
        let (count, _) = self.overlay(&n.name);
        (n.sandboxes + count) as f64 / n.cpus.max(1) as f64
    }

    /// Picks a node for `d`, skipping `exclude` (nodes that just refused it).
    pub fn choose(
        &self,
        view: &ClusterView,
        d: &Demand,
        exclude: &[String],
    ) -> Result<String, PlacementError> {
        let mut why = Vec::new();
        let mut fit: Vec<&NodeStatus> = Vec::new();
        for n in view.nodes() {
            if exclude.contains(&n.name) {
                why.push(format!("{} refused it", n.name));
            } else if let Some(reason) = self.unfit(n, d) {
                why.push(reason);
            } else {
                fit.push(n);
            }
        }
        if fit.is_empty() {
            if why.is_empty() {
                why.push("the cluster has no nodes".into());
            }
            return Err(PlacementError::NoCapacity(why.join("; ")));
        }
        // k distinct candidates at random (partial Fisher-Yates).
        let k = self.k.min(fit.len());
        for i in 0..k {
            let j = i + (self.next_random() as usize) % (fit.len() - i);
            fit.swap(i, j);
        }
        let best = fit[..k]
            .iter()
            .min_by(|a, b| {
                self.load(a)
                    .total_cmp(&self.load(b))
                    .then(b.memory_available_mb.cmp(&a.memory_available_mb))
            })
            .map(|n| n.name.clone())
            .ok_or_else(|| PlacementError::NoCapacity("no candidates".into()))?;
        self.recent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(Placed {
                at: Instant::now(),
                node: best.clone(),
                memory_mb: d.memory_mb,
            });
        Ok(best)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_common::api::BackendStatus;

    fn node(name: &str, sandboxes: u64) -> NodeStatus {
        NodeStatus {
            healthy: true,
            backends: vec![BackendStatus {
                name: "container".into(),
                available: true,
                detail: String::new(),
                capabilities: Vec::new(),
            }],
            cpus: 16,
            memory_total_mb: 65536,
            memory_available_mb: 60000,
            sandboxes,
            max_sandboxes: 4096,
            ..NodeStatus::unreachable(name)
        }
    }

    fn demand() -> Demand {
        Demand {
            backend: "container".into(),
            memory_mb: 512,
        }
    }

    fn view(nodes: Vec<NodeStatus>) -> ClusterView {
        let mut v = ClusterView::default();
        for n in nodes {
            v.update(n);
        }
        v
    }

    #[test]
    fn filters_say_why_nothing_fits() {
        let mut sick = node("a", 0);
        sick.healthy = false;
        let mut vmless = node("b", 0);
        vmless.backends[0].name = "vm".into();
        let mut full = node("c", 4096);
        full.max_sandboxes = 4096;
        let p = Placer::new(2, Duration::from_secs(2));
        let e = p
            .choose(&view(vec![sick, vmless, full]), &demand(), &[])
            .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("a is unhealthy")
                && msg.contains("b has no container")
                && msg.contains("c is full"),
            "{msg}"
        );
        let ok = p.choose(&view(vec![node("d", 0)]), &demand(), &["d".into()]);
        assert!(ok.unwrap_err().to_string().contains("d refused it"));
    }

    #[test]
    fn a_stale_view_still_spreads_evenly_across_nodes_and_apiservers() {
        // The view never changes (as between two polls); two apiservers place 300.
        let v = view(vec![node("e1", 10), node("e2", 10), node("e3", 10)]);
        let placers = [
            Placer::new(2, Duration::from_secs(60)),
            Placer::new(2, Duration::from_secs(60)),
        ];
        let mut counts = std::collections::BTreeMap::new();
        for i in 0..300 {
            let n = placers[i % 2].choose(&v, &demand(), &[]).unwrap();
            *counts.entry(n).or_insert(0) += 1;
        }
        assert_eq!(counts.len(), 3);
        for (n, c) in &counts {
            assert!((80..=120).contains(c), "{n} got {c} of 300: {counts:?}");
        }
        // A node that already runs many gets fewer new ones.
        let skewed = view(vec![node("e1", 200), node("e2", 0), node("e3", 0)]);
        let p = Placer::new(2, Duration::from_secs(60));
        let to_e1 = (0..60)
            .filter(|_| p.choose(&skewed, &demand(), &[]).unwrap() == "e1")
            .count();
        assert_eq!(to_e1, 0);
    }
}
