//! Sandboxes: how many were made and stopped (by backend, outcome and reason), how long a
//! create and an exec take, how many exist now (by state and project), the node's
//! admission refusals (by resource) and warm pools' members.

use std::sync::LazyLock;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    pub backend: String,
    /// `ok`, or the error code the create ended with.
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Backend {
    pub backend: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Stop {
    pub backend: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateProject {
    pub state: String,
    pub project: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Resource {
    pub resource: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Pool {
    pub pool: String,
}

pub static CREATES: LazyLock<Family<Outcome, Counter>> = LazyLock::new(Family::default);
pub static CREATE_SECONDS: LazyLock<crate::Histograms<Backend>> =
    LazyLock::new(|| Family::new_with_constructor(crate::latency as fn() -> Histogram));
pub static EXEC_SECONDS: LazyLock<crate::Histograms<Backend>> =
    LazyLock::new(|| Family::new_with_constructor(crate::latency as fn() -> Histogram));
pub static STOPS: LazyLock<Family<Stop, Counter>> = LazyLock::new(Family::default);
pub static SANDBOXES: LazyLock<Family<StateProject, Gauge>> = LazyLock::new(Family::default);
pub static ADMISSION_REFUSALS: LazyLock<Family<Resource, Counter>> = LazyLock::new(Family::default);
pub static POOL_MEMBERS: LazyLock<Family<Pool, Gauge>> = LazyLock::new(Family::default);

pub(crate) fn register(r: &mut Registry) {
    r.register(
        "sandbox_creates",
        "Creates answered, and sandboxes made as fork copies, restores and pool members, by backend and outcome: ok or the error code",
        CREATES.clone(),
    );
    r.register(
        "sandbox_create_seconds",
        "Time from a create's arrival on the edge to its sandbox running, by backend",
        CREATE_SECONDS.clone(),
    );
    r.register(
        "exec_seconds",
        "Time of a unary exec (the command's own run included), by backend",
        EXEC_SECONDS.clone(),
    );
    r.register(
        "sandbox_stops",
        "Sandboxes stopped, by backend and reason",
        STOPS.clone(),
    );
    r.register(
        "sandboxes",
        "Sandboxes on this node now, by state and project",
        SANDBOXES.clone(),
    );
    r.register(
        "admission_refusals",
        "Creates the node refused for lack of a resource (sandboxes, memory, disk, load)",
        ADMISSION_REFUSALS.clone(),
    );
    r.register(
        "pool_members",
        "Warm pool members ready to be handed out, by pool",
        POOL_MEMBERS.clone(),
    );
}

/// A create (or a fork's copy, or a restore) ended: `Ok(seconds)` it took, or the error
/// code it ended with.
pub fn created(backend: &str, outcome: Result<f64, &str>) {
    let label = match outcome {
        Ok(secs) => {
            CREATE_SECONDS
                .get_or_create(&Backend {
                    backend: backend.to_string(),
                })
                .observe(secs);
            "ok"
        }
        Err(code) => code,
    };
    CREATES
        .get_or_create(&Outcome {
            backend: backend.to_string(),
            outcome: label.to_string(),
        })
        .inc();
}

pub fn stopped(backend: &str, reason: &str) {
    STOPS
        .get_or_create(&Stop {
            backend: backend.to_string(),
            reason: reason.to_string(),
        })
        .inc();
}

pub fn exec_took(backend: &str, secs: f64) {
    EXEC_SECONDS
        .get_or_create(&Backend {
            backend: backend.to_string(),
        })
        .observe(secs);
}

pub fn refused(resource: &str) {
    ADMISSION_REFUSALS
        .get_or_create(&Resource {
            resource: resource.to_string(),
        })
        .inc();
}

/// Sets the sandbox counts to `counts` ((state, project) → n), forgetting pairs no longer
/// seen (a scrape hook's work).
pub fn set_sandboxes(counts: impl IntoIterator<Item = ((String, String), i64)>) {
    SANDBOXES.clear();
    for ((state, project), n) in counts {
        SANDBOXES
            .get_or_create(&StateProject { state, project })
            .set(n);
    }
}

/// Sets each pool's ready members.
pub fn set_pools(members: impl IntoIterator<Item = (String, i64)>) {
    POOL_MEMBERS.clear();
    for (pool, n) in members {
        POOL_MEMBERS.get_or_create(&Pool { pool }).set(n);
    }
}
