//! Real TLS over loopback: who gets in, and what the handler sees.

use std::sync::Arc;

use axum::Router;
use axum::routing::get;
use dsec_mtls::{Client, Identity, Role, Tls, TlsFiles, pki};
use http_body_util::BodyExt;

async fn server(dir: &std::path::Path, allowed: &[Role]) -> String {
    pki::issue(dir, Role::Edge, "edge1", &[]).unwrap();
    let tls = Tls::load(&TlsFiles::in_dir(dir, "edge1")).unwrap();
    let app = Router::new().route(
        "/who",
        get(|axum::Extension(id): axum::Extension<Identity>| async move { id.to_string() }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    dsec_mtls::server::spawn(l, &tls, allowed, app);
    addr
}

async fn get_who(client: &Client, addr: &str) -> Result<String, String> {
    let req = hyper::Request::get(format!("{}/who", client.base(addr)))
        .body(dsec_mtls::client::Body::empty())
        .unwrap();
    let resp = client.request(req).await.map_err(|e| format!("{e:?}"))?;
    let b = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?;
    Ok(String::from_utf8_lossy(&b.to_bytes()).into_owned())
}

#[tokio::test]
async fn only_admitted_roles_with_cluster_certificates_get_in() {
    let dir = tempfile::tempdir().unwrap();
    assert!(pki::init_ca(dir.path()).unwrap());
    assert!(!pki::init_ca(dir.path()).unwrap(), "an existing CA is kept");
    let addr = server(dir.path(), &[Role::Apiserver]).await;

    pki::issue(dir.path(), Role::Apiserver, "api1", &["10.0.0.1".into()]).unwrap();
    let api = Tls::load(&TlsFiles::in_dir(dir.path(), "api1")).unwrap();
    assert_eq!(api.identity.to_string(), "apiserver/api1");
    let ok = Client::new(Some(api.client.clone()));
    assert_eq!(get_who(&ok, &addr).await.unwrap(), "apiserver/api1");

    // A certificate of the cluster, but of a role this server does not admit.
    pki::issue(dir.path(), Role::Watcher, "w1", &[]).unwrap();
    let w = Tls::load(&TlsFiles::in_dir(dir.path(), "w1")).unwrap();
    assert!(
        get_who(&Client::new(Some(w.client.clone())), &addr)
            .await
            .is_err()
    );

    // A certificate from another CA.
    let other = tempfile::tempdir().unwrap();
    pki::init_ca(other.path()).unwrap();
    pki::issue(other.path(), Role::Apiserver, "api1", &[]).unwrap();
    let foreign = Tls::load(&TlsFiles::in_dir(other.path(), "api1")).unwrap();
    assert!(
        get_who(&Client::new(Some(foreign.client.clone())), &addr)
            .await
            .is_err()
    );

    // No certificate at all: the server's CA trusted, but nothing presented.
    let mut roots = rustls::RootCertStore::empty();
    use rustls_pki_types::pem::PemObject;
    for c in rustls_pki_types::CertificateDer::pem_file_iter(dir.path().join("ca.pem")).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let bare = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    assert!(
        get_who(&Client::new(Some(Arc::new(bare))), &addr)
            .await
            .is_err()
    );

    // Plain HTTP to a TLS port gets no answer either.
    assert!(get_who(&Client::new(None), &addr).await.is_err());
}

async fn fetch(client: &Client, addr: &str, path: &str) -> (u16, String) {
    let req = hyper::Request::get(format!("{}{path}", client.base(addr)))
        .body(dsec_mtls::client::Body::empty())
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let b = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&b).into_owned())
}

#[tokio::test]
async fn a_monitor_certificate_reads_metrics_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    pki::init_ca(dir.path()).unwrap();
    // A listener that admits apiservers only still lets a scraper read its metrics.
    let addr = server(dir.path(), &[Role::Apiserver]).await;
    pki::issue(dir.path(), Role::Monitor, "prom", &[]).unwrap();
    let m = Tls::load(&TlsFiles::in_dir(dir.path(), "prom")).unwrap();
    assert_eq!(m.identity.to_string(), "monitor/prom");
    let prom = Client::new(Some(m.client.clone()));
    let (status, text) = fetch(&prom, &addr, "/metrics").await;
    assert_eq!(status, 200, "{text}");
    assert!(text.ends_with("# EOF\n"), "not OpenMetrics text: {text}");
    // The listener's own routes are not its: the handler never runs for it.
    let (status, text) = fetch(&prom, &addr, "/who").await;
    assert_eq!(status, 403, "{text}");
    assert!(text.contains("GET /metrics only"), "{text}");
    // And a component that is not admitted gets no /metrics either.
    pki::issue(dir.path(), Role::Watcher, "w1", &[]).unwrap();
    let w = Tls::load(&TlsFiles::in_dir(dir.path(), "w1")).unwrap();
    let wc = Client::new(Some(w.client.clone()));
    let req = hyper::Request::get(format!("{}/metrics", wc.base(&addr)))
        .body(dsec_mtls::client::Body::empty())
        .unwrap();
    assert!(wc.request(req).await.is_err());
    assert_eq!("monitor".parse::<Role>().unwrap(), Role::Monitor);
    // A scraper's certificate names no host: it cannot be made to serve.
    assert!(pki::issue(dir.path(), Role::Monitor, "prom2", &["10.0.0.9".into()]).is_err());
}

#[test]
fn bad_names_and_roles_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    pki::init_ca(dir.path()).unwrap();
    assert!(pki::issue(dir.path(), Role::Edge, "../x", &[]).is_err());
    assert!(pki::issue(dir.path(), Role::Edge, "ok", &["not a host!".into()]).is_err());
    assert!("king".parse::<Role>().is_err());
    let none = tempfile::tempdir().unwrap();
    let e = pki::issue(none.path(), Role::Edge, "e1", &[]).unwrap_err();
    assert!(e.to_string().contains("dsec certs init"), "{e}");
}
