//! The web console (`/console`): a single page of plain JavaScript and xterm.js, built into
//! the binary with `include_str!` (no build step, nothing fetched at run time). It holds
//! no server state: the page keeps the API key the user typed in memory only (not in
//! storage, which pages of a sandbox's port, served on the same origin, could read) and
//! calls the REST API with it, so the console sees exactly what the key may see.
//!
//! The pages are served without a key; every answer carries a Content-Security-Policy
//! that allows scripts and connections to this origin only and no framing.

use axum::Router;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

const INDEX: &str = include_str!("../assets/index.html");
const APP_JS: &str = include_str!("../assets/app.js");
const APP_CSS: &str = include_str!("../assets/app.css");
const XTERM_JS: &str = include_str!("../assets/vendor/xterm/xterm.js");
const XTERM_CSS: &str = include_str!("../assets/vendor/xterm/xterm.css");

const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
                   connect-src 'self'; img-src 'self' blob: data:; font-src 'self'; \
                   frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

fn asset(body: &'static str, content_type: &'static str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// The console's pages: path, body and content type.
const PAGES: [(&str, &str, &str); 6] = [
    ("/console", INDEX, "text/html; charset=utf-8"),
    ("/console/", INDEX, "text/html; charset=utf-8"),
    ("/console/app.js", APP_JS, "text/javascript; charset=utf-8"),
    ("/console/app.css", APP_CSS, "text/css; charset=utf-8"),
    (
        "/console/xterm.js",
        XTERM_JS,
        "text/javascript; charset=utf-8",
    ),
    ("/console/xterm.css", XTERM_CSS, "text/css; charset=utf-8"),
];

/// The console's routes, for any router (`dsec up`'s API and a cluster's apiserver).
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    PAGES
        .into_iter()
        .fold(Router::new(), |r, (path, body, content_type)| {
            r.route(path, get(move || async move { asset(body, content_type) }))
        })
}
