//! The IAM service and its client over real mutual TLS: a replica on loopback, a client
//! that has to skip a dead replica first.

use std::time::Duration;

use dsec_iam::{
    Command, Iam, IamError, PrincipalKind, Quota, ROOT, RaftConfig, RaftIam, Refusal, RemoteIam,
    create_key,
};
use dsec_mtls::{Role, Tls, TlsFiles, pki};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_clients_apply_authenticate_and_see_refusals_over_mtls() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    pki::init_ca(&certs).unwrap();
    pki::issue(&certs, Role::Iam, "iam1", &[]).unwrap();
    pki::issue(&certs, Role::Apiserver, "api1", &[]).unwrap();
    pki::issue(&certs, Role::Watcher, "w1", &[]).unwrap();
    let iam_tls = Tls::load(&TlsFiles::in_dir(&certs, "iam1")).unwrap();

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let mut cfg = RaftConfig::new(1, addr.clone(), dir.path().join("raft"));
    cfg.tls = Some(iam_tls.client.clone());
    let node = RaftIam::open(cfg).await.unwrap();
    let app = node.router().merge(dsec_iam::service::router(node.clone()));
    dsec_mtls::server::spawn(listener, &iam_tls, &[Role::Iam, Role::Apiserver], app);
    node.initialize(&[(1, addr.clone())]).await.unwrap();
    node.wait_for_leader(Duration::from_secs(20)).await.unwrap();

    // A port nobody listens on comes first: the client moves on to the live replica.
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead_addr = dead.local_addr().unwrap().to_string();
    drop(dead);
    let api_tls = Tls::load(&TlsFiles::in_dir(&certs, "api1")).unwrap();
    let remote = RemoteIam::new(vec![dead_addr, addr.clone()], Some(api_tls.client.clone()));

    let mk = |path: &str| Command::CreateProject {
        actor: ROOT.into(),
        path: path.into(),
        quota: Quota::default(),
        now_ms: 0,
    };
    let r = remote.clone();
    tokio::task::spawn_blocking(move || r.apply(mk("root/a")))
        .await
        .unwrap()
        .unwrap();
    // Applied on the replica, and a refusal comes back as a refusal, not an outage.
    assert!(
        node.projects(ROOT)
            .unwrap()
            .iter()
            .any(|p| p.project.path == "root/a")
    );
    match remote.write(mk("root/a")).await {
        Err(IamError::Refused(Refusal::Exists(_))) => {}
        other => panic!("expected Exists, got {other:?}"),
    }

    let (key, key_id) = create_key(&node, ROOT, "root/a", "agent", PrincipalKind::Agent).unwrap();
    let p = remote
        .authenticate_async(&key)
        .await
        .expect("the key authenticates");
    assert_eq!(p.project, "root/a");
    assert!(remote.authenticate_async("dsk.not-a-key").await.is_none());
    // Revoking through this client stops it honouring the key at once (no cache).
    remote
        .write(Command::RevokeKey {
            actor: ROOT.into(),
            key_id,
        })
        .await
        .unwrap();
    assert!(remote.authenticate_async(&key).await.is_none());

    // A cluster certificate of a role the IAM does not admit gets no answer: a good key
    // does not authenticate through it.
    let (key2, _) = create_key(&node, ROOT, "root/a", "agent2", PrincipalKind::Agent).unwrap();
    assert!(remote.authenticate_async(&key2).await.is_some());
    let w = Tls::load(&TlsFiles::in_dir(&certs, "w1")).unwrap();
    let stranger = RemoteIam::new(vec![addr], Some(w.client.clone()));
    assert!(stranger.authenticate_async(&key2).await.is_none());
    node.shutdown().await.unwrap();
}
