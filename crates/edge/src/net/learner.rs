//! Applies the DNS proxy's learned addresses to nftables in batches. Every allowed DNS
//! answer must open its addresses before it goes out. One worker thread takes whatever
//! answers are waiting and applies them as one netlink transaction, so the number of
//! transactions follows the time one takes, not the number of answers, and no lock is
//! held meanwhile.

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::netlink::NetlinkError;
use super::nfnl::SetMsg;
use super::nft;

/// Most jobs taken into one transaction.
const MAX_BATCH: usize = 512;
/// An element this close to its end is treated as gone (it may expire before the
/// transaction runs, and deleting it would then fail).
const MARGIN: Duration = Duration::from_millis(200);

/// Why addresses were not opened. Clone: one transaction answers every sandbox in it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LearnError {
    #[error("the DNS learner has stopped")]
    Stopped,
    #[error("not applied")]
    NotApplied,
    /// The kernel refused the sandbox's set update (the netlink error, as text: it is
    /// shared by every waiter of the batch).
    #[error("opening the answer's addresses: {0}")]
    Refused(String),
}

enum Job {
    Learn {
        key: String,
        add: Vec<(Ipv4Addr, u32)>,
        done: tokio::sync::oneshot::Sender<Result<(), LearnError>>,
    },
    /// The sandbox's set was rewritten (its rules changed; these elements are in it now,
    /// with these TTLs) or removed (none).
    Reset {
        key: String,
        present: Vec<(Ipv4Addr, u32)>,
    },
}

pub struct Learner {
    tx: mpsc::Sender<Job>,
}

type Apply = dyn Fn(&[SetMsg]) -> Result<(), NetlinkError> + Send + 'static;

/// What the learner has put in each sandbox's set, and until when: only it writes the
/// sets between rule changes, so only it knows which elements to delete (to restart
/// their timeouts) and which merely to add.
#[derive(Default)]
struct Sets(HashMap<String, HashMap<Ipv4Addr, Instant>>);

impl Learner {
    /// A learner that writes the kernel's sets over netlink.
    pub fn start() -> Learner {
        Learner::start_with(Box::new(nft::apply))
    }

    /// A learner that applies its transactions with `apply`.
    pub fn start_with(apply: Box<Apply>) -> Learner {
        let (tx, rx) = mpsc::channel::<Job>();
        let spawned = std::thread::Builder::new()
            .name("dsec-dns-learner".into())
            .spawn(move || {
                let mut sets = Sets::default();
                while let Ok(first) = rx.recv() {
                    let mut jobs = vec![first];
                    while jobs.len() < MAX_BATCH {
                        match rx.try_recv() {
                            Ok(j) => jobs.push(j),
                            Err(_) => break,
                        }
                    }
                    run(&*apply, &mut sets, jobs);
                }
            });
        if let Err(e) = spawned {
            tracing::error!("starting the DNS learner thread: {e}");
        }
        Learner { tx }
    }

    /// Opens `add` (address, TTL) in the set of sandbox `key` (an address already there
    /// gets its timeout started again); returns once the rule is in.
    pub async fn learn(&self, key: String, add: Vec<(Ipv4Addr, u32)>) -> Result<(), LearnError> {
        let (done, wait) = tokio::sync::oneshot::channel();
        self.tx
            .send(Job::Learn { key, add, done })
            .map_err(|_| LearnError::Stopped)?;
        wait.await.map_err(|_| LearnError::Stopped)?
    }

    /// Tells the learner what sandbox `key`'s set holds after it was rewritten (or, with
    /// nothing, removed). Ordered with the learns sent before and after it.
    pub fn reset(&self, key: &str, present: Vec<(Ipv4Addr, u32)>) {
        let _ = self.tx.send(Job::Reset {
            key: key.to_string(),
            present,
        });
    }
}

/// One transaction for the whole batch, every address once per set (the longest TTL
/// asked for); if it fails (a set just removed, an element that expired meanwhile), each
/// set on its own, then without its deletes.
fn run(apply: &Apply, sets: &mut Sets, jobs: Vec<Job>) {
    let now = Instant::now();
    let mut wanted: BTreeMap<String, BTreeMap<Ipv4Addr, u32>> = BTreeMap::new();
    let mut waiting: Vec<(String, tokio::sync::oneshot::Sender<Result<(), LearnError>>)> =
        Vec::new();
    for j in jobs {
        match j {
            Job::Learn { key, add, done } => {
                let w = wanted.entry(key.clone()).or_default();
                for (ip, ttl) in add {
                    let t = w.entry(ip).or_insert(ttl);
                    *t = (*t).max(ttl);
                }
                waiting.push((key, done));
            }
            Job::Reset { key, present } => {
                // Learns of the batch queued before it were for the old set: apply them
                // first, so the order holds.
                flush(
                    apply,
                    sets,
                    std::mem::take(&mut wanted),
                    std::mem::take(&mut waiting),
                    now,
                );
                if present.is_empty() {
                    sets.0.remove(&key);
                } else {
                    sets.0.insert(
                        key,
                        present
                            .into_iter()
                            .map(|(ip, ttl)| (ip, now + Duration::from_secs(ttl as u64)))
                            .collect(),
                    );
                }
            }
        }
    }
    flush(apply, sets, wanted, waiting, now);
}

/// What to add to one set, and what to delete from it first.
type Plan = (Vec<(Ipv4Addr, u32)>, Vec<Ipv4Addr>);

fn flush(
    apply: &Apply,
    sets: &mut Sets,
    wanted: BTreeMap<String, BTreeMap<Ipv4Addr, u32>>,
    waiting: Vec<(String, tokio::sync::oneshot::Sender<Result<(), LearnError>>)>,
    now: Instant,
) {
    if wanted.is_empty() {
        return;
    }
    // Per set: (what to add, what is there to delete first).
    let mut plans: BTreeMap<&String, Plan> = BTreeMap::new();
    for (key, addrs) in &wanted {
        let have = sets.0.entry(key.clone()).or_default();
        have.retain(|_, until| *until > now);
        let add: Vec<(Ipv4Addr, u32)> = addrs.iter().map(|(ip, t)| (*ip, *t)).collect();
        let present: Vec<Ipv4Addr> = addrs
            .keys()
            .filter(|ip| have.get(ip).is_some_and(|until| *until > now + MARGIN))
            .copied()
            .collect();
        plans.insert(key, (add, present));
    }
    let batch: Vec<SetMsg> = plans
        .iter()
        .flat_map(|(k, (add, present))| nft::learn(k, add, present))
        .collect();
    let mut results: HashMap<String, Result<(), LearnError>> = HashMap::new();
    if apply(&batch).is_ok() {
        for k in plans.keys() {
            results.insert((*k).clone(), Ok(()));
        }
    } else {
        for (k, (add, present)) in &plans {
            let mut r = apply(&nft::learn(k, add, present));
            if r.is_err() && !present.is_empty() {
                r = apply(&nft::learn(k, add, &[]));
            }
            results.insert(
                (*k).clone(),
                r.map_err(|e| LearnError::Refused(e.to_string())),
            );
        }
    }
    for (k, (add, _)) in plans {
        if results.get(k).is_some_and(Result::is_ok) {
            let have = sets.0.entry(k.clone()).or_default();
            for (ip, ttl) in add {
                have.insert(ip, now + Duration::from_secs(ttl as u64));
            }
        }
    }
    for (k, done) in waiting {
        let r = results
            .get(&k)
            .cloned()
            .unwrap_or(Err(LearnError::NotApplied));
        let _ = done.send(r);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::net::nfnl::ElemOp;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn answers_waiting_together_go_in_one_transaction() {
        let runs = Arc::new(Mutex::new(Vec::<Vec<SetMsg>>::new()));
        let r2 = runs.clone();
        let l = Arc::new(Learner::start_with(Box::new(move |m: &[SetMsg]| {
            // slow, so that answers pile up behind it
            std::thread::sleep(std::time::Duration::from_millis(20));
            r2.lock().unwrap().push(m.to_vec());
            Ok(())
        })));
        let answers = 400;
        let all: Vec<_> = (0..answers)
            .map(|i| {
                let l = l.clone();
                tokio::spawn(async move {
                    l.learn(
                        format!("k{}", i % 7),
                        vec![(Ipv4Addr::new(203, 0, 113, (i % 50) as u8), 30)],
                    )
                    .await
                })
            })
            .collect();
        for h in all {
            h.await.unwrap().unwrap();
        }
        let runs = runs.lock().unwrap();
        // Each (set, address) pair once per transaction, never deleted twice in one.
        for r in runs.iter() {
            for adding in [true, false] {
                let keys: Vec<&Vec<u8>> = r
                    .iter()
                    .filter(|m| (m.op == ElemOp::Add) == adding)
                    .flat_map(|m| m.elems.iter().map(|e| &e.key))
                    .collect();
                let mut unique = keys.clone();
                unique.sort();
                unique.dedup();
                assert_eq!(keys.len(), unique.len(), "{r:?}");
            }
        }
        assert!(
            runs.len() < answers / 4,
            "{} transactions for {answers} answers",
            runs.len()
        );
    }

    #[tokio::test]
    async fn an_address_seen_again_is_deleted_and_added_so_its_timeout_restarts() {
        let runs = Arc::new(Mutex::new(Vec::<Vec<SetMsg>>::new()));
        let r2 = runs.clone();
        let l = Learner::start_with(Box::new(move |m: &[SetMsg]| {
            r2.lock().unwrap().push(m.to_vec());
            Ok(())
        }));
        let ip = Ipv4Addr::new(198, 51, 100, 1);
        l.learn("k".into(), vec![(ip, 30)]).await.unwrap();
        l.learn("k".into(), vec![(ip, 30)]).await.unwrap();
        // After a rule change that dropped it, it is new again.
        l.reset("k", vec![]);
        l.learn("k".into(), vec![(ip, 30)]).await.unwrap();
        let runs = runs.lock().unwrap();
        assert_eq!(runs.len(), 3);
        let deletes = |r: &Vec<SetMsg>| r.iter().any(|m| m.op != ElemOp::Add);
        assert!(!deletes(&runs[0]), "{:?}", runs[0]);
        assert!(deletes(&runs[1]), "{:?}", runs[1]);
        assert!(!deletes(&runs[2]), "{:?}", runs[2]);
    }

    #[tokio::test]
    async fn a_failed_batch_falls_back_to_each_set_without_its_deletes() {
        let l = Learner::start_with(Box::new(|m: &[SetMsg]| {
            if m.iter().any(|m| m.op != ElemOp::Add) {
                Err(NetlinkError::Refused {
                    what: "a delete".into(),
                    source: std::io::Error::from_raw_os_error(libc::ENOENT),
                })
            } else {
                Ok(())
            }
        }));
        let ip = Ipv4Addr::new(198, 51, 100, 1);
        l.learn("k".into(), vec![(ip, 5)]).await.unwrap();
        l.learn("k".into(), vec![(ip, 5)]).await.unwrap();
    }
}
