//! Prometheus metrics of every role, in one registry per process (`dsec up` runs every role
//! in one process; a cluster role's process has its own), encoded in the OpenMetrics text
//! format that a Prometheus server scrapes from `/metrics`.
//!
//! The families are defined here, one module per concern, so that every name the project
//! exports is in one place; the code that observes something calls into these modules.
//! What is a count of what exists now (sandboxes by state, pool members) is set at scrape
//! time by the hooks the roles register with [`on_scrape`], not kept up to date on every
//! change.

use std::sync::{LazyLock, Mutex};

use prometheus_client::encoding::text::encode;
use prometheus_client::registry::Registry;

pub mod http;
pub mod iam;
pub mod net;
pub mod sandbox;

/// What `/metrics` answers with.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

static REGISTRY: LazyLock<Registry> = LazyLock::new(|| {
    let mut r = Registry::with_prefix("dsec");
    sandbox::register(&mut r);
    http::register(&mut r);
    iam::register(&mut r);
    net::register(&mut r);
    r
});

type Hook = Box<dyn Fn() + Send + Sync>;

static HOOKS: Mutex<Vec<Hook>> = Mutex::new(Vec::new());

/// Runs `f` before each scrape, to set gauges of what exists at that moment. A hook that
/// holds a part of a role keeps it weakly and does nothing once it is gone.
pub fn on_scrape(f: impl Fn() + Send + Sync + 'static) {
    HOOKS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(Box::new(f));
}

/// Every family, as a scrape reads it.
pub fn scrape() -> String {
    // One scrape at a time: another's hooks would clear the gauges this one encodes.
    let hooks = HOOKS.lock().unwrap_or_else(|p| p.into_inner());
    for h in hooks.iter() {
        h();
    }
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = encode(&mut out, &REGISTRY);
    out
}

/// A family of latency histograms, one per label set.
pub(crate) type Histograms<L> = prometheus_client::metrics::family::Family<
    L,
    prometheus_client::metrics::histogram::Histogram,
    fn() -> prometheus_client::metrics::histogram::Histogram,
>;

/// A latency histogram: buckets from a millisecond to about half a minute.
pub(crate) fn latency() -> prometheus_client::metrics::histogram::Histogram {
    prometheus_client::metrics::histogram::Histogram::new(
        prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 16),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scrape_runs_the_hooks_and_shows_every_family() {
        sandbox::created("t-scrape", Ok(0.25));
        sandbox::created("t-scrape", Ok(0.5));
        sandbox::created("t-scrape", Err("not_found"));
        sandbox::refused("memory");
        // What the hook sees: here, 3 running sandboxes of a project, then none.
        static LIVE: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(3);
        on_scrape(|| {
            let n = LIVE.load(std::sync::atomic::Ordering::SeqCst);
            let live = (n > 0).then(|| (("running".to_string(), "root/t-scrape".to_string()), n));
            sandbox::set_sandboxes(live)
        });
        let text = scrape();
        for want in [
            r#"dsec_sandbox_creates_total{backend="t-scrape",outcome="ok"} 2"#,
            r#"dsec_sandbox_creates_total{backend="t-scrape",outcome="not_found"} 1"#,
            r#"dsec_sandbox_create_seconds_count{backend="t-scrape"} 2"#,
            r#"dsec_sandbox_create_seconds_sum{backend="t-scrape"} 0.75"#,
            r#"dsec_sandboxes{state="running",project="root/t-scrape"} 3"#,
            r#"dsec_admission_refusals_total{resource="memory"}"#,
            "# TYPE dsec_iam_raft_leader gauge",
        ] {
            assert!(text.contains(want), "{want} not in:\n{text}");
        }
        assert!(text.ends_with("# EOF\n"));
        // A gauge of what exists forgets what is gone.
        LIVE.store(0, std::sync::atomic::Ordering::SeqCst);
        assert!(!scrape().contains(r#"project="root/t-scrape""#));
    }

    #[tokio::test]
    async fn requests_are_counted_by_route_pattern_and_known_methods_only() {
        use axum::Router;
        use axum::body::Body;
        use axum::http::Request;
        use axum::routing::get;
        use tower::ServiceExt;

        let odd = || async { (axum::http::StatusCode::from_u16(299).unwrap(), "odd") };
        let app = Router::new()
            .route("/t-http/{id}", get(|| async { "ok" }))
            .route("/t-http-odd", get(odd))
            .layer(axum::middleware::from_fn(|r, n| {
                http::count("t-http", r, n)
            }));
        for (method, path) in [
            ("GET", "/t-http/a1"),
            ("GET", "/t-http/b2"),
            ("BREW", "/t-http/c3"),
            ("GET", "/t-http-nowhere/d4"),
            ("GET", "/t-http-odd"),
        ] {
            let req = Request::builder()
                .method(method)
                .uri(path)
                .body(Body::empty())
                .unwrap();
            let _ = app.clone().oneshot(req).await.unwrap();
        }
        let text = scrape();
        let ours: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("dsec_http_requests_total{role=\"t-http\""))
            .collect();
        assert!(
            ours.contains(&r#"dsec_http_requests_total{role="t-http",method="GET",route="/t-http/{id}",status="200"} 2"#),
            "{ours:?}"
        );
        // A status only a proxied server would pick is counted by its class.
        assert!(
            ours.iter()
                .any(|l| l.contains(r#"route="/t-http-odd",status="2xx""#)),
            "{ours:?}"
        );
        // A made-up method and an unrouted path make no series of their own.
        assert!(
            ours.iter().any(|l| l.contains(r#"method="other""#)),
            "{ours:?}"
        );
        assert!(
            ours.iter().any(|l| l.contains(r#"route="unmatched""#)),
            "{ours:?}"
        );
        assert!(!text.contains("a1") && !text.contains("BREW") && !text.contains("d4"));
    }
}
