//! `dsec gateway`: the E2B-compatible gateway on its own, in front of any OpenDsec API (a
//! cluster's apiserver, say); `dsec up` runs one by itself.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use axum::serve::ListenerExt;
use hyper::Method;

use crate::client::{self, Api};

#[derive(clap::Args)]
pub struct GatewayArgs {
    #[command(flatten)]
    pub api: crate::ApiArgs,
    /// Address to listen on (E2B_API_URL and E2B_SANDBOX_URL of its users)
    #[arg(long, default_value = "127.0.0.1:17600")]
    pub listen: SocketAddr,
    /// Sandbox domain: `get_host(port)` is `{port}-{id}.{domain}`, a name that must lead
    /// here (default: localhost:<port>, which browsers resolve)
    #[arg(long)]
    pub domain: Option<String>,
    /// Signs the sandboxes' access tokens; made if missing. Gateways of one deployment
    /// share it
    #[arg(long, default_value = "/var/lib/dsec/gateway-secret")]
    pub secret_file: PathBuf,
    /// More templates, NAME=IMAGE or NAME=IMAGE@BACKEND (repeatable; `base`,
    /// `code-interpreter-v1` and their `-vm` forms are there already)
    #[arg(long = "template", value_name = "NAME=IMAGE[@BACKEND]")]
    pub templates: Vec<String>,
}

/// `NAME=IMAGE[@BACKEND]`.
fn parse_template(s: &str) -> Result<(String, dsec_gateway::Template)> {
    let (name, rest) = s
        .split_once('=')
        .filter(|(n, r)| !n.is_empty() && !r.is_empty())
        .with_context(|| format!("--template {s:?}: expected NAME=IMAGE or NAME=IMAGE@BACKEND"))?;
    let t = match rest.split_once('@') {
        Some((image, backend)) => dsec_gateway::Template::Spec {
            image: image.to_string(),
            backend: Some(backend.to_string()),
        },
        None => dsec_gateway::Template::Image(rest.to_string()),
    };
    Ok((name.to_string(), t))
}

pub async fn run(a: GatewayArgs) -> Result<i32> {
    super::up::init_tracing();
    let cfg = client::resolve(a.api.api_url.as_deref(), a.api.api_key.as_deref(), None)?;
    let mut templates = dsec_gateway::default_templates();
    for t in &a.templates {
        let (name, t) = parse_template(t)?;
        templates.insert(name, t);
    }
    // In-sandbox calls are made with this key: it must see every sandbox.
    let who: serde_json::Value = Api::new(&cfg)?
        .call(Method::GET, "/v1/whoami", None::<&()>)
        .await
        .with_context(|| format!("checking the API key against {}", cfg.api_url))?;
    if who["project"] != "root" {
        bail!(
            "the gateway needs a key of the root project (it acts on every sandbox its users' tokens open); this one is of {}",
            who["project"]
        );
    }
    let secret = super::up::gateway_secret(&a.secret_file)?;
    let listener = super::listen(a.listen)
        .await
        .with_context(|| format!("cannot listen on {}", a.listen))?;
    let bound = listener.local_addr()?;
    let app = dsec_gateway::router(dsec_gateway::Config {
        api_url: cfg.api_url.clone(),
        service_key: cfg.api_key.clone(),
        secret: secret.into_bytes(),
        templates,
        domain: Some(
            a.domain
                .unwrap_or_else(|| format!("localhost:{}", bound.port())),
        ),
        // Images are built where the image store is (`dsec up`, `dsec image build`).
        builder: None,
        in_process: None,
    });
    println!("E2B gateway on http://{bound} for {}", cfg.api_url);
    println!(
        "  E2B_API_URL=http://{bound} E2B_SANDBOX_URL=http://{bound} E2B_API_KEY=<an OpenDsec key>"
    );
    axum::serve(listener.tap_io(super::up::no_delay), app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_parse() {
        let (n, t) = parse_template("mine=root/x:1@vm").unwrap();
        assert_eq!(
            (n.as_str(), t.image(), t.backend()),
            ("mine", "root/x:1", Some("vm"))
        );
        let (_, t) = parse_template("a=root/y:2").unwrap();
        assert_eq!(t.backend(), None);
        assert!(parse_template("noequals").is_err());
        assert!(parse_template("=x").is_err());
    }
}
