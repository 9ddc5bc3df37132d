//! Resource samples kept per sandbox, for its metrics over a time range: CPU time and
//! memory read from the sandbox's cgroup every `metrics_interval_ms` while it runs, the
//! last [`MAX_SAMPLES`] kept in a ring (30 minutes at the default 5 s; 40 bytes each, so
//! about 14 KiB per sandbox when full).

use std::collections::VecDeque;
use std::sync::Mutex;

use dsec_common::api::MetricsSample;

/// The most samples kept per sandbox; older ones go.
pub const MAX_SAMPLES: usize = 360;

#[derive(Default)]
pub struct Ring(Mutex<VecDeque<MetricsSample>>);

impl Ring {
    pub fn push(&self, s: MetricsSample) {
        let mut q = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() >= MAX_SAMPLES {
            q.pop_front();
        }
        q.push_back(s);
    }

    /// The last two samples, newest second.
    pub fn last_two(&self) -> (Option<MetricsSample>, Option<MetricsSample>) {
        let q = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let n = q.len();
        let at = |i: Option<usize>| i.and_then(|i| q.get(i)).copied();
        (at(n.checked_sub(2)), at(n.checked_sub(1)))
    }

    /// The samples taken from `start_ms` to `end_ms` (both included; none: unbounded), in
    /// order.
    pub fn between(&self, start_ms: Option<u64>, end_ms: Option<u64>) -> Vec<MetricsSample> {
        let q = self.0.lock().unwrap_or_else(|p| p.into_inner());
        q.iter()
            .filter(|s| start_ms.is_none_or(|a| s.timestamp_ms >= a))
            .filter(|s| end_ms.is_none_or(|b| s.timestamp_ms <= b))
            .copied()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(t: u64) -> MetricsSample {
        MetricsSample {
            timestamp_ms: t,
            cpu_used_ns: t * 10,
            memory_used_bytes: t,
            memory_cache_bytes: 0,
        }
    }

    #[test]
    fn the_ring_keeps_the_newest_and_answers_a_range() {
        let r = Ring::default();
        for t in 0..(MAX_SAMPLES as u64 + 10) {
            r.push(at(t));
        }
        let all = r.between(None, None);
        assert_eq!(all.len(), MAX_SAMPLES);
        assert_eq!(all[0].timestamp_ms, 10, "the oldest went first");
        let some: Vec<u64> = r
            .between(Some(100), Some(102))
            .iter()
            .map(|s| s.timestamp_ms)
            .collect();
        assert_eq!(some, [100, 101, 102]);
        assert!(r.between(Some(1000), None).is_empty());
    }
}
