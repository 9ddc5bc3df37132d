//! Requests each role's listeners answered, by role, route (the router's pattern, never a
//! raw path: ids would make a series each), method and status, and how long they took.

use std::sync::LazyLock;
use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Answered {
    pub role: &'static str,
    pub method: String,
    pub route: String,
    pub status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Route {
    pub role: &'static str,
    pub route: String,
}

pub static REQUESTS: LazyLock<Family<Answered, Counter>> = LazyLock::new(Family::default);
pub static REQUEST_SECONDS: LazyLock<crate::Histograms<Route>> =
    LazyLock::new(|| Family::new_with_constructor(crate::latency as fn() -> Histogram));

pub(crate) fn register(r: &mut Registry) {
    r.register(
        "http_requests",
        "Requests answered, by role, route, method and status",
        REQUESTS.clone(),
    );
    r.register(
        "http_request_seconds",
        "Time to a request's answer (its head: a stream's body may go on), by role and route",
        REQUEST_SECONDS.clone(),
    );
}

/// A status as a label: the codes the API answers with by name, any other (a sandbox's
/// server answering through the port proxy picks its own) by class.
fn status_label(code: u16) -> &'static str {
    const NAMED: [&str; 19] = [
        "101", "200", "201", "204", "206", "304", "400", "401", "403", "404", "405", "409", "413",
        "429", "500", "501", "502", "503", "504",
    ];
    const CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];
    let digits = code.to_string();
    NAMED
        .iter()
        .find(|n| **n == digits)
        .copied()
        .unwrap_or(CLASSES[usize::from(code / 100).clamp(1, 5) - 1])
}

/// Middleware counting `role`'s requests: `axum::middleware::from_fn(move |r, n| count(role, r, n))`
/// on a router (its routes, so that the route they matched is known).
pub async fn count(role: &'static str, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_string())
        .unwrap_or_else(|| "unmatched".to_string());
    // A client names any method it likes; only the router's own make a series each.
    let method = match req.method().as_str() {
        m @ ("GET" | "POST" | "PUT" | "PATCH" | "DELETE" | "HEAD" | "OPTIONS") => m,
        _ => "other",
    }
    .to_string();
    let t = Instant::now();
    let res = next.run(req).await;
    REQUEST_SECONDS
        .get_or_create(&Route {
            role,
            route: route.clone(),
        })
        .observe(t.elapsed().as_secs_f64());
    REQUESTS
        .get_or_create(&Answered {
            role,
            method,
            route,
            status: status_label(res.status().as_u16()),
        })
        .inc();
    res
}
