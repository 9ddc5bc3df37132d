//! Replicated IAM clusters on 127.0.0.1 ephemeral ports, in temp dirs.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dsec_iam::{
    Command, Iam, IamError, PrincipalKind, Quota, ROOT, RaftConfig, RaftIam, Refusal, Reservation,
    Usage, create_key,
};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Every test ends within this, whatever happens.
const TEST_LIMIT: Duration = Duration::from_secs(90);

async fn bounded<F: Future<Output = ()>>(f: F) {
    tokio::time::timeout(TEST_LIMIT, f)
        .await
        .expect("the test ran past its time limit");
}

struct Replica {
    node: RaftIam,
    stop: Option<oneshot::Sender<()>>,
    server: JoinHandle<()>,
    id: u64,
    addr: String,
    dir: PathBuf,
}

fn settings(cfg: &mut RaftConfig) {
    cfg.heartbeat = Duration::from_millis(100);
    cfg.election_timeout = (Duration::from_millis(400), Duration::from_millis(800));
    cfg.secret = Some("cluster-secret".into());
}

async fn start(id: u64, listener: TcpListener, dir: &Path, tweak: fn(&mut RaftConfig)) -> Replica {
    let addr = listener.local_addr().unwrap().to_string();
    let mut cfg = RaftConfig::new(id, addr.clone(), dir);
    settings(&mut cfg);
    tweak(&mut cfg);
    // A replica stopped a moment ago may still hold its files for a little while.
    let deadline = Instant::now() + Duration::from_secs(10);
    let node = loop {
        match RaftIam::open(cfg.clone()).await {
            Ok(n) => break n,
            Err(e) if Instant::now() < deadline => {
                eprintln!("replica {id} not open yet: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("replica {id} does not open: {e}"),
        }
    };
    let (tx, rx) = oneshot::channel::<()>();
    let app = node.router();
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = rx.await;
            })
            .await;
    });
    Replica {
        node,
        stop: Some(tx),
        server,
        id,
        addr,
        dir: dir.to_path_buf(),
    }
}

impl Replica {
    /// Stops Raft and the routes, and releases the files.
    async fn stop(mut self) -> (u64, String, PathBuf) {
        self.node.shutdown().await.unwrap();
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if tokio::time::timeout(Duration::from_secs(5), &mut self.server)
            .await
            .is_err()
        {
            self.server.abort();
        }
        (self.id, self.addr, self.dir)
    }
}

async fn listener() -> TcpListener {
    TcpListener::bind("127.0.0.1:0").await.unwrap()
}

/// `n` replicas with ids 1..=n, initialized through the first; waits for a leader.
async fn cluster(n: usize, root: &Path, tweak: fn(&mut RaftConfig)) -> (Vec<Replica>, Duration) {
    let mut listeners = Vec::new();
    for _ in 0..n {
        listeners.push(listener().await);
    }
    let members: Vec<(u64, String)> = listeners
        .iter()
        .enumerate()
        .map(|(i, l)| (i as u64 + 1, l.local_addr().unwrap().to_string()))
        .collect();
    let mut replicas = Vec::new();
    for (i, l) in listeners.into_iter().enumerate() {
        let id = i as u64 + 1;
        replicas.push(start(id, l, &root.join(format!("r{id}")), tweak).await);
    }
    let t = Instant::now();
    replicas[0].node.initialize(&members).await.unwrap();
    let leader = replicas[0]
        .node
        .wait_for_leader(Duration::from_secs(10))
        .await
        .unwrap();
    for r in &replicas {
        assert_eq!(
            r.node
                .wait_for_leader(Duration::from_secs(10))
                .await
                .unwrap(),
            leader
        );
    }
    (replicas, t.elapsed())
}

fn leader_index(replicas: &[Replica]) -> usize {
    replicas
        .iter()
        .position(|r| r.node.is_leader())
        .expect("a replica leads")
}

/// Polls `cond` until it holds or `limit` passes; returns the time it took.
async fn eventually(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < limit, "not within {limit:?}: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    t.elapsed()
}

fn project(path: &str, sandboxes: Option<u64>) -> Command {
    Command::CreateProject {
        actor: ROOT.into(),
        path: path.into(),
        quota: Quota {
            sandboxes,
            ..Quota::default()
        },
        now_ms: 1,
    }
}

fn has_project(r: &Replica, path: &str) -> bool {
    r.node
        .projects(ROOT)
        .unwrap()
        .iter()
        .any(|p| p.project.path == path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_elect_a_leader_and_accept_writes_on_any_replica() {
    bounded(async {
        let tmp = tempfile::tempdir().unwrap();
        let (replicas, elected) = cluster(3, tmp.path(), |_| {}).await;
        eprintln!("3 replicas: leader elected in {elected:?}");
        let l = leader_index(&replicas);
        let followers: Vec<usize> = (0..3).filter(|i| *i != l).collect();

        // A project created through a follower is on all three.
        let f = &replicas[followers[0]];
        f.node.write(project("root/a", Some(4))).await.unwrap();
        assert!(
            has_project(f, "root/a"),
            "the accepting replica reads its own write"
        );
        let took = eventually(Duration::from_secs(5), "root/a on every replica", || {
            replicas.iter().all(|r| has_project(r, "root/a"))
        })
        .await;
        eprintln!("project visible on all replicas {took:?} after the write returned");

        // A key made through the other follower (the blocking Iam path) authenticates on all.
        let g = replicas[followers[1]].node.clone();
        let (key, key_id) = tokio::task::spawn_blocking(move || {
            create_key(&g, ROOT, "root/a", "bot", PrincipalKind::Agent)
        })
        .await
        .unwrap()
        .unwrap();
        eventually(
            Duration::from_secs(5),
            "the key authenticates everywhere",
            || {
                replicas.iter().all(|r| {
                    r.node
                        .authenticate(&key)
                        .is_some_and(|p| p.project == "root/a" && p.key_id == key_id)
                })
            },
        )
        .await;
        assert!(replicas[l].node.authenticate("dsk.nope").is_none());
        // A refusal comes back as a refusal, from any replica.
        let e = f.node.write(project("root/a", None)).await.unwrap_err();
        assert!(matches!(e, IamError::Refused(Refusal::Exists(_))), "{e}");
        // The replica routes refuse whoever lacks the cluster secret.
        let stranger = dsec_iam::raft::network::HttpClient::new(Some("wrong"), None);
        let forged = stranger
            .post::<_, serde_json::Value>(
                &replicas[l].addr,
                dsec_iam::raft::network::PATH_WRITE,
                &project("root/forged", None),
                Duration::from_secs(2),
            )
            .await
            .unwrap_err();
        assert!(forged.to_string().contains("403"), "{forged}");
        assert!(!has_project(&replicas[l], "root/forged"));
        for r in replicas {
            r.stop().await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn losing_the_leader_elects_another_and_the_old_one_catches_up_after_a_restart() {
    bounded(async {
        let tmp = tempfile::tempdir().unwrap();
        let (mut replicas, _) = cluster(3, tmp.path(), |_| {}).await;
        replicas[0].node.write(project("root/before", None)).await.unwrap();
        let l = leader_index(&replicas);
        let old = replicas.remove(l);
        let old_id = old.id;
        let t = Instant::now();
        let (id, addr, dir) = old.stop().await;
        let took = eventually(Duration::from_secs(5), "a new leader", || {
            replicas.iter().all(|r| {
                r.node.leader().is_some_and(|x| x != old_id) && r.node.leader() == replicas[0].node.leader()
            })
        })
        .await;
        eprintln!(
            "new leader {:?} elected {took:?} after the old one stopped ({:?} since the stop began)",
            replicas[0].node.leader(),
            t.elapsed()
        );
        replicas[1].node.write(project("root/after", None)).await.unwrap();
        replicas[0].node.write(project("root/after2", None)).await.unwrap();

        // The old leader restarts from its files, on its address, and catches up.
        let port = addr.parse::<std::net::SocketAddr>().unwrap();
        let back = start(id, TcpListener::bind(port).await.unwrap(), &dir, |_| {}).await;
        assert!(has_project(&back, "root/before"), "its own files held the old state");
        let t = Instant::now();
        let took = eventually(Duration::from_secs(10), "the restarted replica catches up", || {
            has_project(&back, "root/after") && has_project(&back, "root/after2")
        })
        .await;
        eprintln!("restarted replica caught up in {took:?}");
        assert!(t.elapsed() < Duration::from_secs(10));
        // And it takes writes again (forwarded to the leader if it is not).
        back.node.write(project("root/again", None)).await.unwrap();
        eventually(Duration::from_secs(5), "root/again everywhere", || {
            replicas.iter().all(|r| has_project(r, "root/again"))
        })
        .await;
        replicas.push(back);
        for r in replicas {
            r.stop().await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_reservations_from_every_replica_never_exceed_the_quota() {
    bounded(async {
        let tmp = tempfile::tempdir().unwrap();
        let (replicas, _) = cluster(3, tmp.path(), |_| {}).await;
        const N: u64 = 5;
        replicas[0]
            .node
            .write(project("root/q", Some(N)))
            .await
            .unwrap();
        let mut tasks = Vec::new();
        for i in 0..24 {
            let node = replicas[i % 3].node.clone();
            tasks.push(tokio::spawn(async move {
                node.write(Command::Reserve(Reservation {
                    sandbox_id: format!("s{i}"),
                    project: "root/q".into(),
                    edge: format!("e{}", i % 3),
                    usage: Usage {
                        sandboxes: 1,
                        cpu_cores: 0.5,
                        memory_mb: 256,
                        disk_mb: 0,
                    },
                }))
                .await
            }));
        }
        let (mut ok, mut over) = (0, 0);
        for t in tasks {
            match t.await.unwrap() {
                Ok(()) => ok += 1,
                Err(IamError::Refused(Refusal::Quota(_))) => over += 1,
                Err(e) => panic!("unexpected: {e}"),
            }
        }
        assert_eq!((ok, over), (N, 24 - N));
        eventually(
            Duration::from_secs(5),
            "every replica counts N sandboxes",
            || {
                replicas.iter().all(|r| {
                    r.node
                        .projects("root/q")
                        .unwrap()
                        .first()
                        .is_some_and(|p| p.usage.sandboxes == N)
                })
            },
        )
        .await;
        for r in replicas {
            r.stop().await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn snapshots_purge_the_log_and_a_late_learner_catches_up_from_one() {
    bounded(async {
        let tmp = tempfile::tempdir().unwrap();
        fn small(cfg: &mut RaftConfig) {
            cfg.snapshot_every = 20;
            cfg.logs_kept_after_snapshot = 5;
        }
        let (mut replicas, _) = cluster(3, tmp.path(), small).await;
        const COUNT: usize = 80;
        for chunk in (0..COUNT).collect::<Vec<_>>().chunks(8) {
            let mut tasks = Vec::new();
            for i in chunk {
                let node = replicas[i % 3].node.clone();
                let i = *i;
                tasks.push(tokio::spawn(async move {
                    node.write(project(&format!("root/p{i}"), None)).await
                }));
            }
            for t in tasks {
                t.await.unwrap().unwrap();
            }
        }
        let leader = replicas[leader_index(&replicas)].node.clone();
        let m = leader
            .raft()
            .wait(Some(Duration::from_secs(10)))
            .metrics(
                |m| m.snapshot.is_some_and(|s| s.index >= 40) && m.purged.is_some(),
                "a snapshot and a purge",
            )
            .await
            .unwrap();
        let purged = m.purged.unwrap().index;
        let first = leader.first_log_index().unwrap();
        eprintln!(
            "leader: snapshot at {:?}, purged up to {purged}, log starts at {first:?}, last applied {:?}",
            m.snapshot.map(|s| s.index),
            m.last_applied.map(|l| l.index)
        );
        assert!(first.is_none_or(|f| f > purged), "entries up to {purged} are gone");
        assert!(purged > 1);

        // A new replica joins as a learner: the early entries are gone, so it needs the snapshot.
        let dir = tmp.path().join("r4");
        let l4 = listener().await;
        let learner = start(4, l4, &dir, small).await;
        let t = Instant::now();
        leader.add_learner(4, &learner.addr).await.unwrap();
        let took = eventually(Duration::from_secs(10), "the learner has every project", || {
            (0..COUNT).all(|i| has_project(&learner, &format!("root/p{i}")))
        })
        .await;
        eprintln!("learner caught up in {:?} (add_learner returned after {:?})", t.elapsed(), t.elapsed() - took);
        let lm = learner.node.metrics();
        assert!(
            lm.snapshot.is_some_and(|s| s.index >= purged),
            "the learner installed a snapshot: {:?}",
            lm.snapshot
        );
        assert!(learner.node.first_log_index().unwrap().is_none_or(|f| f > purged));
        // Promote it: four voters now, and writes still go through.
        leader.change_membership(&[1, 2, 3, 4]).await.unwrap();
        learner.node.write(project("root/late", None)).await.unwrap();
        assert!(has_project(&learner, "root/late"));
        assert_eq!(learner.node.raft().voter_ids().count(), 4);
        replicas.push(learner);
        for r in replicas {
            r.stop().await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_replica_cluster_works_and_keeps_its_state_over_a_restart() {
    bounded(async {
        let tmp = tempfile::tempdir().unwrap();
        let l = listener().await;
        let addr = l.local_addr().unwrap().to_string();
        let r = start(1, l, &tmp.path().join("r1"), |_| {}).await;
        let e = r
            .node
            .initialize(&[(1, addr.clone()), (2, "127.0.0.1:9".into())])
            .await
            .unwrap_err();
        assert!(e.to_string().contains("1, 3 or 5"), "{e}");
        let t = Instant::now();
        r.node.initialize(&[(1, addr.clone())]).await.unwrap();
        assert_eq!(
            r.node
                .wait_for_leader(Duration::from_secs(5))
                .await
                .unwrap(),
            1
        );
        eprintln!("single replica leads after {:?}", t.elapsed());
        r.node.write(project("root/solo", Some(1))).await.unwrap();
        let node = r.node.clone();
        let (key, _) = tokio::task::spawn_blocking(move || {
            create_key(&node, ROOT, "root/solo", "me", PrincipalKind::Human)
        })
        .await
        .unwrap()
        .unwrap();
        assert!(r.node.authenticate(&key).is_some());
        let (id, addr, dir) = r.stop().await;
        let port = addr.parse::<std::net::SocketAddr>().unwrap();
        let r = start(id, TcpListener::bind(port).await.unwrap(), &dir, |_| {}).await;
        assert!(
            r.node.authenticate(&key).is_some(),
            "the key survived the restart"
        );
        r.node
            .wait_for_leader(Duration::from_secs(5))
            .await
            .unwrap();
        r.node.write(project("root/solo2", None)).await.unwrap();
        assert!(has_project(&r, "root/solo2"));
        // A burst of writes at once: each gets its own answer, and the quota holds.
        r.node
            .write(project("root/burst", Some(250)))
            .await
            .unwrap();
        let tasks: Vec<_> = (0..600)
            .map(|i| {
                let node = r.node.clone();
                tokio::spawn(async move {
                    node.write(Command::Reserve(Reservation {
                        sandbox_id: format!("b{i}"),
                        project: "root/burst".into(),
                        edge: "e".into(),
                        usage: Usage {
                            sandboxes: 1,
                            ..Usage::default()
                        },
                    }))
                    .await
                })
            })
            .collect();
        let (mut ok, mut over) = (0, 0);
        for t in tasks {
            match t.await.unwrap() {
                Ok(()) => ok += 1,
                Err(IamError::Refused(Refusal::Quota(_))) => over += 1,
                Err(e) => panic!("unexpected: {e}"),
            }
        }
        assert_eq!((ok, over), (250, 350));
        let usage = r.node.projects("root/burst").unwrap()[0].usage.sandboxes;
        assert_eq!(usage, 250);
        r.stop().await;
    })
    .await;
}
