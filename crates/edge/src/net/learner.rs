//! Applies the DNS proxy's learned addresses to nftables in batches. Every allowed DNS
//! answer must open its addresses before it goes out; one `nft` run per answer would put a
//! process on the hot path of every lookup on the node. One worker thread takes whatever
//! answers are waiting and applies them as one transaction, so the number of `nft` runs
//! follows the time a run takes, not the number of answers, and no lock is held meanwhile.

use std::net::Ipv4Addr;
use std::sync::mpsc;

use super::nft;

/// Most answers applied in one transaction.
const MAX_BATCH: usize = 512;

struct Job {
    key: String,
    add: Vec<(Ipv4Addr, u32)>,
    present: Vec<Ipv4Addr>,
    done: tokio::sync::oneshot::Sender<Result<(), String>>,
}

pub struct Learner {
    tx: mpsc::Sender<Job>,
}

type Apply = dyn Fn(&str) -> Result<(), String> + Send + 'static;

impl Learner {
    /// A learner that applies scripts with `nft -f`.
    pub fn start() -> Learner {
        Learner::start_with(Box::new(nft::apply))
    }

    /// A learner that applies scripts with `apply`.
    pub fn start_with(apply: Box<Apply>) -> Learner {
        let (tx, rx) = mpsc::channel::<Job>();
        let spawned = std::thread::Builder::new()
            .name("dsec-dns-learner".into())
            .spawn(move || {
                while let Ok(first) = rx.recv() {
                    let mut jobs = vec![first];
                    while jobs.len() < MAX_BATCH {
                        match rx.try_recv() {
                            Ok(j) => jobs.push(j),
                            Err(_) => break,
                        }
                    }
                    run(&*apply, jobs);
                }
            });
        if let Err(e) = spawned {
            tracing::error!("starting the DNS learner thread: {e}");
        }
        Learner { tx }
    }

    /// Opens `add` (address, TTL) in the set of sandbox `key`, first deleting `present` (so
    /// that their timeouts start again); returns once the rule is in.
    pub async fn learn(
        &self,
        key: String,
        add: Vec<(Ipv4Addr, u32)>,
        present: Vec<Ipv4Addr>,
    ) -> Result<(), String> {
        let (done, wait) = tokio::sync::oneshot::channel();
        self.tx
            .send(Job {
                key,
                add,
                present,
                done,
            })
            .map_err(|_| "the DNS learner has stopped".to_string())?;
        wait.await
            .map_err(|_| "the DNS learner has stopped".to_string())?
    }
}

/// One transaction for the whole batch; if it fails (an element to delete had just
/// expired, a sandbox just went away), each answer on its own, then without its deletes.
fn run(apply: &Apply, jobs: Vec<Job>) {
    let script: String = jobs
        .iter()
        .map(|j| nft::learn(&j.key, &j.add, &j.present))
        .collect();
    if apply(&script).is_ok() {
        for j in jobs {
            let _ = j.done.send(Ok(()));
        }
        return;
    }
    for j in jobs {
        let mut r = apply(&nft::learn(&j.key, &j.add, &j.present));
        if r.is_err() && !j.present.is_empty() {
            r = apply(&nft::learn(&j.key, &j.add, &[]));
        }
        let _ = j.done.send(r);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn answers_waiting_together_go_in_one_transaction() {
        let runs = Arc::new(Mutex::new(Vec::<String>::new()));
        let r2 = runs.clone();
        let l = Arc::new(Learner::start_with(Box::new(move |s: &str| {
            // as slow as a real `nft` run, so answers pile up behind it
            std::thread::sleep(std::time::Duration::from_millis(20));
            r2.lock().unwrap().push(s.to_string());
            Ok(())
        })));
        let answers = 400;
        let all: Vec<_> = (0..answers)
            .map(|i| {
                let l = l.clone();
                tokio::spawn(async move {
                    l.learn(
                        format!("k{}", i % 7),
                        vec![(Ipv4Addr::new(203, 0, 113, (i % 250) as u8), 30)],
                        vec![],
                    )
                    .await
                })
            })
            .collect();
        for h in all {
            h.await.unwrap().unwrap();
        }
        let runs = runs.lock().unwrap();
        let elements: usize = runs.iter().map(|s| s.matches("add element").count()).sum();
        assert_eq!(elements, answers, "every answer applied once");
        assert!(
            runs.len() < answers / 4,
            "{} nft runs for {answers} answers",
            runs.len()
        );
    }

    #[tokio::test]
    async fn a_failed_batch_falls_back_to_each_answer_without_its_deletes() {
        let l = Learner::start_with(Box::new(|s: &str| {
            if s.contains("delete element") {
                Err("No such file or directory".into())
            } else {
                Ok(())
            }
        }));
        let ip = Ipv4Addr::new(198, 51, 100, 1);
        l.learn("k".into(), vec![(ip, 5)], vec![ip]).await.unwrap();
    }
}
