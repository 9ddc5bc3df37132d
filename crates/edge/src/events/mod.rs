//! Lifecycle events: what happened to each sandbox (created, paused, resumed, updated,
//! forked, snapshotted, stopped, expired, oom_killed), kept in memory for `GET /v1/events` and in
//! hourly files under `<state_dir>/events/` so a restart keeps them, for
//! `[edge.events] keep_seconds`. Each event is also handed to the webhooks that want it
//! (`webhooks.rs`).
//!
//! Recording one is a push onto a ring under a short lock and a send to a writer task:
//! no file, no network and no wait on the path of the operation that caused it.

mod webhooks;

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsec_common::ApiError;
use dsec_common::api::{Delivery, Event, WebhookInfo, WebhookRequest, WebhookUpdate};
use dsec_common::now_ms;
use tokio::sync::{Notify, mpsc};

use crate::config::EventsConfig;
use crate::registry::SandboxRecord;

pub use webhooks::TYPES;
pub(crate) use webhooks::Webhooks;

const HOUR_MS: u64 = 3_600_000;
/// Where the next sequence number is kept.
const SEQ_FILE: &str = "next-seq";
/// How far numbering jumps at each start (more than a writer ever holds unwritten).
const SEQ_GAP: u64 = 1_000_000;
/// Labels an event carries at most, and bytes of them together (the rest are left out;
/// the sandbox's info has them all).
const EVENT_LABELS: usize = 16;
const EVENT_LABEL_BYTES: usize = 2048;
/// Queries waiting for an event at once; more get an answer at once instead of waiting.
const MAX_WAITERS: usize = 512;
/// Events one query passes over at most (the rest are the next page's).
const SCAN_AT_MOST: usize = 100_000;
/// The longest a query waits for a new event (`wait_seconds`, which the API caps the
/// same).
pub const MAX_WAIT: Duration = Duration::from_secs(60);

pub struct Events {
    edge: String,
    keep_ms: u64,
    max: usize,
    log: Mutex<Log>,
    /// Wakes queries waiting for a new event.
    changed: Notify,
    waiters: tokio::sync::Semaphore,
    to_writer: mpsc::UnboundedSender<Arc<Event>>,
    hooks: Arc<Webhooks>,
}

struct Log {
    ring: VecDeque<Arc<Event>>,
    /// The least number the next event may have. Numbers are the microseconds of the
    /// node's clock when each was recorded (one more than the last when the clock has
    /// not moved on), so one node's numbers can be compared with another's: a cluster's
    /// apiserver merges every edge's events by them.
    next_seq: u64,
}

impl Log {
    /// The number the next event gets.
    fn upcoming(&self) -> u64 {
        self.next_seq.max(now_us())
    }
}

fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// What a query asks for (its `wait` is `list`'s own argument).
pub use dsec_common::api::EventQuery as Query;

impl Events {
    /// Loads the kept events and webhooks and starts the writer and the deliveries.
    pub(crate) async fn start(
        cfg: &EventsConfig,
        edge: &str,
        state_dir: &Path,
    ) -> Result<Arc<Events>, ApiError> {
        let dir = state_dir.join("events");
        std::fs::create_dir_all(&dir)
            .map_err(|e| ApiError::internal(format!("creating {}: {e}", dir.display())))?;
        let keep_ms = cfg.keep_seconds.saturating_mul(1000);
        let (dir2, max) = (dir.clone(), cfg.max_events.max(1));
        let ring = tokio::task::spawn_blocking(move || load(&dir2, keep_ms, max))
            .await
            .map_err(|e| ApiError::internal(format!("loading events: {e}")))?;
        // The next number also survives a time without events long enough for every file
        // to go, so a client's `after` never points past new events.
        let saved = std::fs::read_to_string(dir.join(SEQ_FILE))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(1);
        // Events handed out but not yet written when the node died are not in the files:
        // numbering goes on past any of them, so `after` never hides new events.
        let next_seq = ring.back().map_or(1, |e| e.seq + 1).max(saved) + SEQ_GAP;
        let hooks = Webhooks::start(cfg, state_dir)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let events = Arc::new(Events {
            edge: edge.to_string(),
            keep_ms,
            max,
            log: Mutex::new(Log { ring, next_seq }),
            changed: Notify::new(),
            waiters: tokio::sync::Semaphore::new(MAX_WAITERS),
            to_writer: tx,
            hooks: hooks.clone(),
        });
        tokio::spawn(writer(rx, dir, keep_ms, hooks));
        Ok(events)
    }

    /// Records an event about `rec`.
    pub(crate) fn emit(
        &self,
        kind: &str,
        rec: &SandboxRecord,
        reason: Option<&str>,
        detail: BTreeMap<String, serde_json::Value>,
    ) {
        let mut labels = BTreeMap::new();
        let mut bytes = 0;
        for (k, v) in rec.labels.iter().take(EVENT_LABELS) {
            bytes += k.len() + v.len();
            if bytes > EVENT_LABEL_BYTES {
                break;
            }
            labels.insert(k.clone(), v.clone());
        }
        let mut ev = Event {
            id: String::new(),
            seq: 0,
            kind: kind.to_string(),
            at_ms: 0,
            sandbox: rec.id.clone(),
            project: rec.project.clone(),
            edge: self.edge.clone(),
            backend: rec.backend.clone(),
            reason: reason.map(str::to_string),
            labels,
            detail,
        };
        let ev = {
            let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
            // Taken under the lock, so times ascend with numbers.
            ev.at_ms = now_ms();
            ev.seq = log.upcoming();
            log.next_seq = ev.seq + 1;
            ev.id = format!("{}-{}", self.edge, ev.seq);
            let ev = Arc::new(ev);
            log.ring.push_back(ev.clone());
            let cutoff = ev.at_ms.saturating_sub(self.keep_ms);
            while log.ring.len() > self.max || log.ring.front().is_some_and(|e| e.at_ms < cutoff) {
                log.ring.pop_front();
            }
            ev
        };
        self.changed.notify_waiters();
        // The writer lives as long as the edge's runtime.
        let _ = self.to_writer.send(ev);
    }

    /// Events after `q.after` that `visible` lets through, oldest first, and where the
    /// next page starts: after the last event looked at when the page is full, else
    /// the node's position now (every event recorded later is numbered above it). With
    /// `wait`, waits that long for one when there is none yet.
    pub async fn list(
        &self,
        q: &Query,
        visible: impl Fn(&Event) -> bool,
        wait: Duration,
    ) -> (Vec<Event>, u64) {
        let deadline = tokio::time::Instant::now() + wait.min(MAX_WAIT);
        let mut q = q.clone();
        // Too many waiting already: answer now (the client asks again).
        let _slot = match self.waiters.try_acquire() {
            Ok(p) => Some(p),
            Err(_) => return self.scan(&q, &visible),
        };
        loop {
            // Registered before looking, so an event that lands in between still wakes it.
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let (found, next) = self.scan(&q, &visible);
            if !found.is_empty() || tokio::time::Instant::now() >= deadline {
                return (found, next);
            }
            // What was passed over is not looked at again.
            q.after = next;
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.scan(&q, &visible);
            }
        }
    }

    fn scan(&self, q: &Query, visible: &impl Fn(&Event) -> bool) -> (Vec<Event>, u64) {
        // Under the lock only the matches' pointers are taken (a page of them at most);
        // the events are copied after.
        let mut page: Vec<Arc<Event>> = Vec::new();
        let mut skip = q.offset;
        let wanted = |e: &Event| {
            q.sandbox.as_deref().is_none_or(|s| e.sandbox == s)
                && (q.types.is_empty() || q.types.contains(&e.kind))
                && visible(e)
        };
        let mut take = |e: &Arc<Event>| {
            if !wanted(e) {
                return false;
            }
            if skip > 0 {
                skip -= 1;
                return false;
            }
            page.push(e.clone());
            page.len() >= q.limit.max(1)
        };
        let next = {
            let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
            // Every event recorded from here on is numbered above this.
            let now = (log.upcoming() - 1).max(q.after);
            let start = log.ring.partition_point(|e| e.seq <= q.after);
            let range = log.ring.range(start..);
            let mut next = now;
            if q.newest_first {
                // The next page of newer events starts after the newest there is.
                for e in range.rev().take(SCAN_AT_MOST) {
                    if take(e) {
                        break;
                    }
                }
            } else {
                let more = range.len() > SCAN_AT_MOST;
                let mut last = q.after;
                let mut full = false;
                for e in range.take(SCAN_AT_MOST) {
                    last = e.seq;
                    if take(e) {
                        full = true;
                        break;
                    }
                }
                if full || more {
                    next = last;
                }
            }
            next
        };
        (page.iter().map(|e| e.as_ref().clone()).collect(), next)
    }

    /// Adds a webhook for `project`, made with a key of `owner` (its limit is counted
    /// over `owner`'s whole subtree).
    pub fn add_webhook(
        &self,
        req: WebhookRequest,
        project: String,
        owner: &str,
    ) -> Result<WebhookInfo, ApiError> {
        self.hooks.add(req, project, owner)
    }

    pub fn webhooks(&self, visible: impl Fn(&str) -> bool) -> Vec<WebhookInfo> {
        self.hooks.list(visible)
    }

    pub fn webhook(&self, id: &str) -> Option<WebhookInfo> {
        self.hooks.get(id)
    }

    pub fn update_webhook(&self, id: &str, u: WebhookUpdate) -> Result<WebhookInfo, ApiError> {
        self.hooks.update(id, u)
    }

    pub fn remove_webhook(&self, id: &str) -> Result<(), ApiError> {
        self.hooks.remove(id)
    }

    pub fn deliveries(&self, id: &str) -> Option<Vec<Delivery>> {
        self.hooks.deliveries(id)
    }
}

/// The file of the hour `at_ms` falls in.
fn hour_file(dir: &Path, at_ms: u64) -> PathBuf {
    dir.join(format!("{}.ndjson", at_ms / HOUR_MS * HOUR_MS))
}

/// The hour a file holds, from its name.
fn file_hour(p: &Path) -> Option<u64> {
    p.file_name()?
        .to_str()?
        .strip_suffix(".ndjson")?
        .parse()
        .ok()
}

/// The events of the kept files, oldest first (at most `max`); files past `keep_ms` go.
fn load(dir: &Path, keep_ms: u64, max: usize) -> VecDeque<Arc<Event>> {
    let cutoff = now_ms().saturating_sub(keep_ms);
    let mut files: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|d| file_hour(&d.path()).map(|h| (h, d.path())))
        .collect();
    files.sort();
    let mut ring = VecDeque::new();
    for (hour, path) in files {
        if hour + HOUR_MS < cutoff {
            let _ = std::fs::remove_file(&path);
            continue;
        }
        let Ok(f) = std::fs::File::open(&path) else {
            continue;
        };
        // A line cut short by a crash is skipped.
        for line in std::io::BufReader::new(f).lines().map_while(Result::ok) {
            if let Ok(e) = serde_json::from_str::<Event>(&line)
                && e.at_ms >= cutoff
                && ring.back().is_none_or(|b: &Arc<Event>| b.seq < e.seq)
            {
                ring.push_back(Arc::new(e));
                if ring.len() > max {
                    ring.pop_front();
                }
            }
        }
    }
    ring
}

/// Appends events to their hour's file, in batches, and hands them to the webhooks;
/// drops the files past the keep time once an hour.
async fn writer(
    mut rx: mpsc::UnboundedReceiver<Arc<Event>>,
    dir: PathBuf,
    keep_ms: u64,
    hooks: Arc<Webhooks>,
) {
    let mut batch = Vec::with_capacity(1024);
    let mut pruned_at = 0u64;
    while rx.recv_many(&mut batch, 1024).await > 0 {
        for e in &batch {
            hooks.dispatch(e);
        }
        let (dir2, events) = (dir.clone(), std::mem::take(&mut batch));
        let prune = now_ms() >= pruned_at + HOUR_MS;
        if prune {
            pruned_at = now_ms();
        }
        let r = tokio::task::spawn_blocking(move || {
            append(&dir2, &events)?;
            if prune {
                prune_files(&dir2, keep_ms);
            }
            Ok::<(), std::io::Error>(())
        })
        .await;
        if let Ok(Err(e)) = r {
            tracing::warn!("writing events under {}: {e}", dir.display());
        }
    }
}

fn append(dir: &Path, events: &[Arc<Event>]) -> std::io::Result<()> {
    if let Some(last) = events.last() {
        // A new file renamed over the old: a crash leaves one or the other whole.
        let tmp = dir.join(format!("{SEQ_FILE}.tmp"));
        std::fs::write(&tmp, format!("{}\n", last.seq + 1))?;
        std::fs::rename(&tmp, dir.join(SEQ_FILE))?;
    }
    let mut i = 0;
    while i < events.len() {
        let path = hour_file(dir, events[i].at_ms);
        let mut buf = Vec::new();
        while i < events.len() && hour_file(dir, events[i].at_ms) == path {
            serde_json::to_writer(&mut buf, events[i].as_ref()).map_err(std::io::Error::other)?;
            buf.push(b'\n');
            i += 1;
        }
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?
            .write_all(&buf)?;
    }
    Ok(())
}

fn prune_files(dir: &Path, keep_ms: u64) {
    let cutoff = now_ms().saturating_sub(keep_ms);
    for d in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if file_hour(&d.path()).is_some_and(|h| h + HOUR_MS < cutoff) {
            let _ = std::fs::remove_file(d.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(seq: u64, at_ms: u64) -> Arc<Event> {
        Arc::new(Event {
            id: format!("e-{seq}"),
            seq,
            kind: "created".into(),
            at_ms,
            sandbox: "s".into(),
            project: "root".into(),
            edge: "e".into(),
            backend: "container".into(),
            reason: None,
            labels: BTreeMap::new(),
            detail: BTreeMap::new(),
        })
    }

    #[tokio::test]
    async fn a_query_pages_newest_first_by_offset_and_types() {
        let dir = tempfile::tempdir().unwrap();
        let ev_log = Events::start(&EventsConfig::default(), "e", dir.path())
            .await
            .unwrap();
        {
            let mut log = ev_log.log.lock().unwrap();
            for (seq, kind) in [
                (1, "created"),
                (2, "paused"),
                (3, "resumed"),
                (4, "stopped"),
            ] {
                let mut e = ev(seq, seq);
                Arc::make_mut(&mut e).kind = kind.into();
                log.ring.push_back(e);
            }
        }
        let seqs = |q: Query| {
            let (evs, next) = ev_log.scan(&q, &|_| true);
            (evs.iter().map(|e| e.seq).collect::<Vec<_>>(), next)
        };
        let q = Query {
            limit: 100,
            ..Query::default()
        };
        // A page that is not full says where the node is: past every event it has,
        // and below any it records later.
        let (all, now) = seqs(q.clone());
        assert_eq!(all, [1, 2, 3, 4]);
        assert!(now >= 4 && now < now_us());
        // A full page says where it stopped.
        assert_eq!(
            seqs(Query {
                limit: 2,
                ..q.clone()
            }),
            (vec![1, 2], 2)
        );
        let desc = Query {
            newest_first: true,
            ..q.clone()
        };
        assert_eq!(seqs(desc.clone()).0, [4, 3, 2, 1]);
        assert_eq!(
            seqs(Query {
                offset: 1,
                limit: 2,
                ..desc.clone()
            })
            .0,
            [3, 2]
        );
        assert_eq!(
            seqs(Query {
                types: vec!["paused".into(), "stopped".into()],
                ..desc
            })
            .0,
            [4, 2]
        );
        assert_eq!(
            seqs(Query {
                offset: 3,
                after: 1,
                ..q
            })
            .0,
            Vec::<u64>::new()
        );
        // What is recorded next is numbered above what was said.
        let upcoming = ev_log.log.lock().unwrap().upcoming();
        assert!(upcoming > now, "{upcoming} <= {now}");
    }

    #[test]
    fn kept_files_load_back_in_order_and_old_ones_go() {
        let dir = tempfile::tempdir().unwrap();
        let now = now_ms();
        let old = now - 10 * HOUR_MS;
        append(dir.path(), &[ev(1, old), ev(2, now - 1000), ev(3, now)]).unwrap();
        // A line cut short by a crash.
        std::fs::OpenOptions::new()
            .append(true)
            .open(hour_file(dir.path(), now))
            .unwrap()
            .write_all(b"{\"id\":\"e-4\",\"se")
            .unwrap();
        let ring = load(dir.path(), 2 * HOUR_MS, 100);
        assert_eq!(ring.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![2, 3]);
        assert_eq!(
            std::fs::read_to_string(dir.path().join(SEQ_FILE)).unwrap(),
            "4\n"
        );
        assert!(
            !hour_file(dir.path(), old).exists(),
            "an expired file stayed"
        );
        let ring = load(dir.path(), 2 * HOUR_MS, 1);
        assert_eq!(ring.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![3]);
    }
}
