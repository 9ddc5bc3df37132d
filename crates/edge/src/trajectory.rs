//! The trajectory log: every command and file mutation sent through the API is a step with
//! a sequence number, appended with its result to a JSON-lines file in the sandbox's state
//! directory. A client that re-sends a step already in the log gets the recorded result and
//! nothing runs again; a step that differs from the log is a divergence error. Steps run
//! in their own task, so a client that disappears mid-step does not cut the step short.
//!
//! File format, one JSON object per line: a step's start
//! `{"seq","kind","request","started_at_ms"}`, then its end `{"seq","result",
//! "finished_at_ms"}` or `{"seq","aborted":{"code","message"}}` (a step that failed with an
//! error is not kept: sending it again runs it again).

use std::collections::HashMap;
use std::future::Future;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use dsec_common::ApiError;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::registry::now_ms;

/// The trajectory that calls without `X-Dsec-Trajectory` go to; its steps are numbered by
/// the edge and never replayed.
pub const DEFAULT: &str = "default";

/// Which step of which trajectory a call is.
#[derive(Debug, Clone, PartialEq)]
pub struct StepRef {
    pub name: String,
    /// The client's step number (from 1); `None` numbers it next (no replay).
    pub seq: Option<u64>,
}

impl StepRef {
    pub fn parse(name: Option<&str>, seq: Option<&str>) -> Result<Option<StepRef>, ApiError> {
        let Some(name) = name else {
            if seq.is_some() {
                return Err(ApiError::invalid(
                    "X-Dsec-Step needs X-Dsec-Trajectory naming the trajectory",
                ));
            }
            return Ok(None);
        };
        valid_name(name)?;
        let seq = match seq {
            None => None,
            Some(s) => match s.trim().parse::<u64>() {
                Ok(n) if n >= 1 => Some(n),
                _ => {
                    return Err(ApiError::invalid(format!(
                        "X-Dsec-Step must be a whole number from 1 (got {s:?})"
                    )));
                }
            },
        };
        Ok(Some(StepRef {
            name: name.to_string(),
            seq,
        }))
    }
}

pub fn valid_name(name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(format!(
            "trajectory name {name:?} must be 1-64 letters, digits, '.', '_' or '-', not starting with '.'"
        )))
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Step {
    pub seq: u64,
    pub kind: String,
    pub request: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    pub started_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at_ms: Option<u64>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Line {
    seq: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    request: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    started_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    result: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    finished_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    aborted: Option<ApiError>,
}

/// What a replayable trajectory keeps of a step in memory: enough to check a re-sent step
/// and to find it in the file. Requests and results stay on disk, so a long trajectory
/// with large results costs the edge little memory.
struct Indexed {
    seq: u64,
    kind: String,
    request_sha256: [u8; 32],
    /// Offsets in the file of the step's start line and (once finished) its end line.
    start: u64,
    end: Option<u64>,
}

fn digest(v: &Value) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    Sha256::digest(serde_json::to_vec(v).unwrap_or_default()).into()
}

struct Log {
    path: PathBuf,
    /// Steps of a replayable trajectory: finished ones, then at most one unfinished
    /// (started before an edge restart). Empty for edge-numbered logs, which are only
    /// appended to (and read back from the file).
    index: Vec<Indexed>,
    /// The next step number.
    next: u64,
    durable: bool,
    /// Open for appending after the first line written: a step is two appends, and
    /// opening (with its directory checks) each time cost more than the write.
    file: Option<std::fs::File>,
}

/// The lines of a log file with their offsets (a torn last line, from a crash mid-write,
/// is skipped).
fn lines_of(path: &Path) -> Vec<(u64, Line)> {
    let Ok(bytes) = std::fs::read(path) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut off = 0u64;
    for raw in bytes.split_inclusive(|b| *b == b'\n') {
        let at = off;
        off += raw.len() as u64;
        if let Ok(l) = serde_json::from_slice::<Line>(raw) {
            out.push((at, l));
        }
    }
    out
}

/// The steps a log file holds, whole (for listing a trajectory).
fn read_steps(path: &Path) -> Vec<Step> {
    let mut steps: Vec<Step> = Vec::new();
    for (_, l) in lines_of(path) {
        if let (Some(kind), Some(request)) = (l.kind, l.request) {
            steps.retain(|s| s.seq != l.seq);
            steps.push(Step {
                seq: l.seq,
                kind,
                request,
                result: None,
                started_at_ms: l.started_at_ms.unwrap_or(0),
                finished_at_ms: None,
            });
        } else if l.aborted.is_some() {
            steps.retain(|s| s.seq != l.seq);
        } else if let Some(s) = steps.iter_mut().find(|s| s.seq == l.seq) {
            s.result = l.result;
            s.finished_at_ms = l.finished_at_ms;
        }
    }
    steps
}

/// The line at `offset` of a log file.
fn line_at(path: &Path, offset: u64) -> Result<Line, ApiError> {
    use std::io::{BufRead, Seek};
    let fail = |e: String| {
        ApiError::internal(format!(
            "reading the trajectory log {}: {e}",
            path.display()
        ))
    };
    let mut f =
        std::io::BufReader::new(std::fs::File::open(path).map_err(|e| fail(e.to_string()))?);
    f.seek(std::io::SeekFrom::Start(offset))
        .map_err(|e| fail(e.to_string()))?;
    let mut raw = Vec::new();
    f.read_until(b'\n', &mut raw)
        .map_err(|e| fail(e.to_string()))?;
    serde_json::from_slice(&raw).map_err(|e| fail(e.to_string()))
}

impl Log {
    fn load(path: PathBuf, durable: bool) -> Log {
        let mut index: Vec<Indexed> = Vec::new();
        for (at, l) in lines_of(&path) {
            if let (Some(kind), Some(request)) = (l.kind, l.request) {
                index.retain(|s| s.seq != l.seq);
                index.push(Indexed {
                    seq: l.seq,
                    kind,
                    request_sha256: digest(&request),
                    start: at,
                    end: None,
                });
            } else if l.aborted.is_some() {
                index.retain(|s| s.seq != l.seq);
            } else if let Some(s) = index.iter_mut().find(|s| s.seq == l.seq) {
                s.end = Some(at);
            }
        }
        let next = index.iter().map(|s| s.seq).max().unwrap_or(0) + 1;
        Log {
            path,
            index,
            next,
            durable,
            file: None,
        }
    }

    /// Where the next line will start.
    fn end_offset(&self) -> u64 {
        std::fs::metadata(&self.path).map(|m| m.len()).unwrap_or(0)
    }

    fn append(&mut self, line: &Line) -> Result<(), ApiError> {
        let path = &self.path;
        let fail = |e: std::io::Error| {
            ApiError::internal(format!(
                "writing the trajectory log {}: {e}",
                path.display()
            ))
        };
        let f = match &mut self.file {
            Some(f) => f,
            None => {
                if let Some(dir) = path.parent() {
                    dsec_common::private::dir(dir).map_err(fail)?;
                }
                // Commands and their output: root's alone.
                self.file
                    .insert(dsec_common::private::open(path, true).map_err(fail)?)
            }
        };
        let mut buf = serde_json::to_vec(line).map_err(|e| ApiError::internal(e.to_string()))?;
        buf.push(b'\n');
        f.write_all(&buf).map_err(fail)?;
        if self.durable {
            f.sync_data().map_err(fail)?;
        }
        Ok(())
    }
}

/// The open trajectory logs of this edge's sandboxes.
#[derive(Default)]
pub struct Logs {
    open: Mutex<HashMap<PathBuf, Arc<tokio::sync::Mutex<Log>>>>,
}

/// What a step returned, and whether it came from the log.
pub struct Outcome {
    pub value: Value,
    pub replayed: bool,
}

fn dir_of(sandbox_dir: &Path) -> PathBuf {
    sandbox_dir.join("trajectories")
}

impl Logs {
    fn log(&self, sandbox_dir: &Path, name: &str) -> Arc<tokio::sync::Mutex<Log>> {
        let path = dir_of(sandbox_dir).join(format!("{name}.jsonl"));
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        open.entry(path.clone())
            .or_insert_with(|| Arc::new(tokio::sync::Mutex::new(Log::load(path, name != DEFAULT))))
            .clone()
    }

    /// Forgets the open logs of a stopped sandbox (its directory goes with it).
    pub fn forget(&self, sandbox_dir: &Path) {
        let dir = dir_of(sandbox_dir);
        self.open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|p, _| !p.starts_with(&dir));
    }

    /// Runs `run` as step `step` (or the next step of the default trajectory), or
    /// answers from the log.
    pub async fn step<F, Fut>(
        &self,
        sandbox_dir: &Path,
        step: Option<StepRef>,
        kind: &str,
        request: Value,
        run: F,
    ) -> Result<Outcome, ApiError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Value, ApiError>> + Send + 'static,
    {
        let step = step.unwrap_or(StepRef {
            name: DEFAULT.into(),
            seq: None,
        });
        let log = self.log(sandbox_dir, &step.name);
        let kind = kind.to_string();
        let name = step.name.clone();
        // The whole step runs in its own task holding the log's lock, so it completes
        // and is logged even if the caller goes away, and a re-sent step waits for it.
        let Some(seq) = step.seq else {
            return append_unnumbered(log, kind, request, run).await;
        };
        let mut guard = log.clone().lock_owned().await;
        let next = guard.next;
        if let Some(logged) = guard.index.iter().find(|s| s.seq == seq) {
            if logged.kind != kind || logged.request_sha256 != digest(&request) {
                let was = line_at(&guard.path, logged.start)?;
                return Err(ApiError::precondition(format!(
                    "trajectory {name:?} diverged at step {seq}: the log has {} {} but this call is {kind} {}",
                    logged.kind,
                    was.request.unwrap_or(Value::Null),
                    request
                )));
            }
            return match logged.end {
                Some(at) => Ok(Outcome {
                    value: line_at(&guard.path, at)?.result.unwrap_or(Value::Null),
                    replayed: true,
                }),
                None => Err(ApiError::precondition(format!(
                    "step {seq} of trajectory {name:?} was running when the edge stopped; whether it took effect is unknown, so it is not run again (check the sandbox, then continue with step {})",
                    seq + 1
                ))),
            };
        }
        if seq != next {
            return Err(ApiError::invalid(format!(
                "trajectory {name:?} has {} steps; the next one is step {next}, not {seq}",
                next - 1
            )));
        }
        let started = now_ms();
        let start = guard.end_offset();
        let request_sha256 = digest(&request);
        guard.append(&Line {
            seq,
            kind: Some(kind.clone()),
            request: Some(request),
            started_at_ms: Some(started),
            result: None,
            finished_at_ms: None,
            aborted: None,
        })?;
        let fut = run();
        let task = tokio::spawn(async move {
            let r = fut.await;
            let end = end_line(seq, &r);
            let end_at = guard.end_offset();
            guard.append(&end)?;
            if r.is_ok() {
                guard.next = seq + 1;
                guard.index.push(Indexed {
                    seq,
                    kind,
                    request_sha256,
                    start,
                    end: Some(end_at),
                });
            }
            r
        });
        let value = task
            .await
            .map_err(|e| ApiError::internal(format!("trajectory step failed: {e}")))??;
        Ok(Outcome {
            value,
            replayed: false,
        })
    }

    /// The trajectories of a sandbox: names and step counts.
    pub async fn list(&self, sandbox_dir: &Path) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        if let Ok(rd) = std::fs::read_dir(dir_of(sandbox_dir)) {
            for e in rd.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if let Some(name) = n.strip_suffix(".jsonl") {
                    let steps = self.steps(sandbox_dir, name).await.len() as u64;
                    out.push((name.to_string(), steps));
                }
            }
        }
        out.sort();
        out
    }

    /// A trajectory's steps, read from its file (which every step reaches first).
    pub async fn steps(&self, sandbox_dir: &Path, name: &str) -> Vec<Step> {
        let path = dir_of(sandbox_dir).join(format!("{name}.jsonl"));
        tokio::task::spawn_blocking(move || read_steps(&path))
            .await
            .unwrap_or_default()
    }
}

/// Output kept per stream in an edge-numbered step's record: these steps are never
/// replayed, so the log keeps a provenance record, not every byte.
const UNNUMBERED_OUTPUT: usize = 64 << 10;

/// A result with `stdout`/`stderr` cut to [`UNNUMBERED_OUTPUT`] bytes, marked when cut.
fn trim_output(v: &Value) -> Value {
    let mut v = v.clone();
    if let Some(o) = v.as_object_mut() {
        for k in ["stdout", "stderr"] {
            if let Some(Value::String(text)) = o.get_mut(k)
                && text.len() > UNNUMBERED_OUTPUT
            {
                let mut cut = UNNUMBERED_OUTPUT;
                while !text.is_char_boundary(cut) {
                    cut -= 1;
                }
                text.truncate(cut);
                o.insert("log_truncated".into(), Value::Bool(true));
            }
        }
    }
    v
}

fn end_line(seq: u64, r: &Result<Value, ApiError>) -> Line {
    let (result, finished_at_ms, aborted) = match r {
        Ok(v) => (Some(v.clone()), Some(now_ms()), None),
        Err(e) => (None, None, Some(e.clone())),
    };
    Line {
        seq,
        kind: None,
        request: None,
        started_at_ms: None,
        result,
        finished_at_ms,
        aborted,
    }
}

/// A step the edge numbers (no `X-Dsec-Step`): never replayed, so such steps run
/// concurrently; the log's lock is held only to append.
async fn append_unnumbered<F, Fut>(
    log: Arc<tokio::sync::Mutex<Log>>,
    kind: String,
    request: Value,
    run: F,
) -> Result<Outcome, ApiError>
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<Value, ApiError>> + Send + 'static,
{
    let seq = {
        let mut g = log.lock().await;
        let seq = g.next;
        g.append(&Line {
            seq,
            kind: Some(kind),
            request: Some(request),
            started_at_ms: Some(now_ms()),
            result: None,
            finished_at_ms: None,
            aborted: None,
        })?;
        g.next += 1;
        seq
    };
    let fut = run();
    // In its own task, so the step is logged even if the caller goes away.
    let task = tokio::spawn(async move {
        let r = fut.await;
        let kept = r.as_ref().map(trim_output).map_err(Clone::clone);
        log.lock().await.append(&end_line(seq, &kept))?;
        r
    });
    let value = task
        .await
        .map_err(|e| ApiError::internal(format!("trajectory step failed: {e}")))??;
    Ok(Outcome {
        value,
        replayed: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(seq: u64) -> Option<StepRef> {
        Some(StepRef {
            name: "t1".into(),
            seq: Some(seq),
        })
    }

    #[tokio::test]
    async fn steps_replay_diverge_and_survive_a_reload() {
        let dir = tempfile::tempdir().unwrap();
        let logs = Logs::default();
        let runs = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let go = |v: i64| {
            let runs = runs.clone();
            move || async move {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok(serde_json::json!({ "out": v }))
            }
        };
        let req = serde_json::json!({"cmd": "echo x"});
        let o = logs
            .step(dir.path(), named(1), "exec", req.clone(), go(1))
            .await
            .unwrap();
        assert!(!o.replayed);
        let o = logs
            .step(dir.path(), named(2), "exec", req.clone(), go(2))
            .await
            .unwrap();
        assert_eq!(o.value["out"], 2);
        // A gap is refused; a replay returns the logged result without running.
        assert!(
            logs.step(dir.path(), named(4), "exec", req.clone(), go(4))
                .await
                .is_err()
        );
        let o = logs
            .step(dir.path(), named(1), "exec", req.clone(), go(9))
            .await
            .unwrap();
        assert!(o.replayed && o.value["out"] == 1);
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
        let e = logs
            .step(
                dir.path(),
                named(2),
                "exec",
                serde_json::json!({"cmd": "echo y"}),
                go(9),
            )
            .await
            .err()
            .unwrap();
        assert!(
            e.message.contains("step 2")
                && e.message.contains("echo y")
                && e.message.contains("echo x"),
            "{}",
            e.message
        );
        // An error is not kept: the step can be sent again.
        let fail = || async { Err(ApiError::not_found("no such file")) };
        assert!(
            logs.step(dir.path(), named(3), "remove", req.clone(), fail)
                .await
                .is_err()
        );
        logs.step(dir.path(), named(3), "exec", req.clone(), go(3))
            .await
            .unwrap();
        // A fresh edge reads the same log.
        let again = Logs::default();
        let steps = again.steps(dir.path(), "t1").await;
        assert_eq!(steps.iter().map(|s| s.seq).collect::<Vec<_>>(), [1, 2, 3]);
        let o = again
            .step(dir.path(), named(3), "exec", req.clone(), go(9))
            .await
            .unwrap();
        assert!(o.replayed && o.value["out"] == 3);
        // Calls without a step number go to the default trajectory, numbered in order.
        logs.step(dir.path(), None, "exec", req.clone(), go(5))
            .await
            .unwrap();
        logs.step(dir.path(), None, "exec", req, go(6))
            .await
            .unwrap();
        // Edge-numbered steps do not wait for each other.
        let slow = || async {
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            Ok(serde_json::json!({"slow": true}))
        };
        let t0 = std::time::Instant::now();
        let (a, b) = tokio::join!(
            logs.step(dir.path(), None, "exec", serde_json::json!({"n": 1}), slow),
            logs.step(dir.path(), None, "exec", serde_json::json!({"n": 2}), slow)
        );
        assert!(a.is_ok() && b.is_ok() && t0.elapsed() < std::time::Duration::from_millis(900));
        // Their records keep at most 64 KiB of output per stream.
        let big =
            || async { Ok(serde_json::json!({"stdout": "é".repeat(40_000), "exit_code": 0})) };
        let o = logs
            .step(dir.path(), None, "exec", serde_json::json!({"n": 3}), big)
            .await
            .unwrap();
        assert_eq!(
            o.value["stdout"].as_str().unwrap().len(),
            80_000,
            "the caller gets all of it"
        );
        let logged = logs.steps(dir.path(), DEFAULT).await;
        let last = logged.last().unwrap().result.as_ref().unwrap();
        assert!(
            last["stdout"].as_str().unwrap().len() <= 64 << 10 && last["log_truncated"] == true
        );
        let names = logs.list(dir.path()).await;
        assert_eq!(names, [("default".to_string(), 5), ("t1".to_string(), 3)]);
        assert!(StepRef::parse(Some("../x"), Some("1")).is_err());
        assert!(StepRef::parse(Some("ok"), Some("0")).is_err());
        assert!(StepRef::parse(None, Some("1")).is_err());
    }
}
