//! IAM's Raft replica: its term, whether it leads, its commit and applied indexes, and how
//! long a command takes to be applied (proposed, replicated, committed, applied).

use std::sync::LazyLock;

use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

pub static RAFT_TERM: LazyLock<Gauge> = LazyLock::new(Gauge::default);
pub static RAFT_LEADER: LazyLock<Gauge> = LazyLock::new(Gauge::default);
pub static RAFT_COMMITTED: LazyLock<Gauge> = LazyLock::new(Gauge::default);
pub static RAFT_APPLIED: LazyLock<Gauge> = LazyLock::new(Gauge::default);
pub static APPLY_SECONDS: LazyLock<Histogram> = LazyLock::new(crate::latency);

pub(crate) fn register(r: &mut Registry) {
    r.register(
        "iam_raft_term",
        "This IAM replica's Raft term",
        RAFT_TERM.clone(),
    );
    r.register(
        "iam_raft_leader",
        "1 when this IAM replica is the Raft leader, else 0",
        RAFT_LEADER.clone(),
    );
    r.register(
        "iam_raft_commit_index",
        "The highest log index this replica knows committed",
        RAFT_COMMITTED.clone(),
    );
    r.register(
        "iam_raft_applied_index",
        "The highest log index this replica has applied",
        RAFT_APPLIED.clone(),
    );
    r.register(
        "iam_apply_seconds",
        "Time from a command's proposal to its application (quota reservations, keys, projects)",
        APPLY_SECONDS.clone(),
    );
}

/// Sets the replica's Raft gauges (a scrape hook's work).
pub fn set_raft(term: u64, leader: bool, committed: u64, applied: u64) {
    RAFT_TERM.set(term as i64);
    RAFT_LEADER.set(leader as i64);
    RAFT_COMMITTED.set(committed as i64);
    RAFT_APPLIED.set(applied as i64);
}
