//! The node's network: the DNS proxy's answers by outcome, and how long its netfilter and
//! netlink work takes (a sandbox's network set up and torn down, a DNS answer's addresses
//! opened).

use std::sync::LazyLock;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Op {
    pub op: &'static str,
}

pub static DNS_ANSWERS: LazyLock<Family<Outcome, Counter>> = LazyLock::new(Family::default);
pub static NETFILTER_SECONDS: LazyLock<crate::Histograms<Op>> =
    LazyLock::new(|| Family::new_with_constructor(crate::latency as fn() -> Histogram));

pub(crate) fn register(r: &mut Registry) {
    r.register(
        "dns_answers",
        "The DNS proxy's answers to sandboxes, by outcome: answered, refused (a name the rules do not allow, or an answer leading outside them), rate_limited, unknown_source, servfail, malformed",
        DNS_ANSWERS.clone(),
    );
    r.register(
        "netfilter_seconds",
        "Time of the node's netfilter and netlink work, by operation: attach (a sandbox's namespace, addresses and rules), detach, learn (a DNS answer's addresses opened)",
        NETFILTER_SECONDS.clone(),
    );
}

pub fn dns_answered(outcome: &'static str) {
    DNS_ANSWERS.get_or_create(&Outcome { outcome }).inc();
}

pub fn netfilter_took(op: &'static str, secs: f64) {
    NETFILTER_SECONDS.get_or_create(&Op { op }).observe(secs);
}
