//! Directory watches: `WatchDir` (a server stream) and the polling watchers
//! (`CreateWatcher`, `GetWatcherEvents`, `RemoveWatcher`), both on OpenDsec's
//! `/files/watch` NDJSON stream.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::HeaderMap;
use axum::response::Response;
use bytes::BytesMut;
use http_body_util::BodyExt;
use hyper::Method;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use dsec_common::api::FileStat;

use crate::connect;
use crate::envd::{RpcErr, RpcResult, Target, stream_error, stream_response};
use crate::files::sandbox_path;
use crate::upstream::{enc, full};
use crate::{Gw, header_str};

/// Watchers kept at once, over all sandboxes.
const MAX_WATCHERS: usize = 1024;
/// Events a watcher keeps between two polls; older ones are dropped.
const MAX_PENDING: usize = 10_000;

#[derive(Default)]
pub(crate) struct Watchers {
    next: u64,
    map: HashMap<String, Watcher>,
}

struct Watcher {
    sandbox: String,
    events: Arc<Mutex<Vec<Value>>>,
    task: tokio::task::JoinHandle<()>,
}

/// A watch's upstream stream, opened on a directory, and that directory's absolute path.
async fn open(
    gw: &Gw,
    t: &Target,
    msg: &Value,
) -> Result<(crate::upstream::UpBody, String), RpcErr> {
    let p = msg["path"]
        .as_str()
        .ok_or_else(|| RpcErr::new("invalid_argument", "path is required"))?;
    let p = sandbox_path(t, p)?;
    let st: dsec_common::api::FileStat = gw
        .up
        .call(
            Method::GET,
            &t.path(&format!("/files/stat?path={}", enc(&p))),
            &gw.cfg.service_key,
            None,
        )
        .await?;
    if st.kind != "dir" {
        return Err(RpcErr::new(
            "invalid_argument",
            format!("{p} is not a directory"),
        ));
    }
    let mut opts = String::new();
    for (field, param) in [
        ("recursive", "recursive"),
        ("includeEntry", "entry"),
        ("allowNetworkMounts", "allow_network_mounts"),
    ] {
        if msg[field] == json!(true) {
            opts.push_str(&format!("&{param}=true"));
        }
    }
    let r = gw
        .up
        .open(
            Method::GET,
            &t.path(&format!("/files/watch?path={}{opts}", enc(&st.path))),
            &gw.cfg.service_key,
            None,
            full(bytes::Bytes::new()),
        )
        .await?;
    Ok((r.into_body(), st.path))
}

/// An OpenDsec watch event as a `FilesystemEvent` (name relative to the watched directory).
fn fs_event(ev: &Value, dir: &str) -> Option<Value> {
    let ty = match ev["type"].as_str()? {
        "create" => "EVENT_TYPE_CREATE",
        "write" => "EVENT_TYPE_WRITE",
        "remove" => "EVENT_TYPE_REMOVE",
        "rename" => "EVENT_TYPE_RENAME",
        "chmod" => "EVENT_TYPE_CHMOD",
        _ => return None,
    };
    let path = ev["path"].as_str()?;
    let prefix = format!("{}/", dir.trim_end_matches('/'));
    let name = path.strip_prefix(&prefix).unwrap_or(path);
    let mut e = json!({"name": name, "type": ty});
    // Present when the watch asked for entries and the entry is still there.
    if let Ok(s) = serde_json::from_value::<FileStat>(ev["entry"].clone()) {
        e["entry"] = crate::files::entry(&s);
    }
    Some(e)
}

/// The next NDJSON event of a watch stream (an `error` line as the error it carries);
/// None when the stream ends.
async fn each_line(
    body: &mut crate::upstream::UpBody,
    buf: &mut BytesMut,
) -> Option<Result<Value, (String, String)>> {
    loop {
        if let Some(nl) = buf.iter().position(|b| *b == b'\n') {
            let line = buf.split_to(nl + 1);
            let Ok(v) = serde_json::from_slice::<Value>(&line[..nl]) else {
                continue;
            };
            if v["type"] == "error" {
                return Some(Err((
                    v["code"].as_str().unwrap_or("unknown").to_string(),
                    v["message"].as_str().unwrap_or("watch failed").to_string(),
                )));
            }
            return Some(Ok(v));
        }
        match body.frame().await? {
            Ok(f) => {
                if let Ok(d) = f.into_data() {
                    buf.extend_from_slice(&d);
                }
            }
            Err(e) => return Some(Err(("unavailable".into(), e.to_string()))),
        }
    }
}

/// `WatchDir`: `{"start":{}}` once the watch is set, then events as they come, keepalives
/// when idle; the stream ends at `Connect-Timeout-Ms` or when the client goes.
pub(crate) async fn watch_dir(gw: &Gw, t: &Target, h: &HeaderMap, msg: Value) -> Response {
    let (mut body, dir) = match open(gw, t, &msg).await {
        Ok(x) => x,
        Err(RpcErr(c, m)) => return stream_error(&c, &m),
    };
    let keepalive = header_str(h, "keepalive-ping-interval")
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map_or(Duration::from_secs(3600), Duration::from_secs);
    let deadline = header_str(h, "connect-timeout-ms")
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        .map(|ms| tokio::time::Instant::now() + Duration::from_millis(ms));
    let (tx, rx) = mpsc::channel::<Vec<u8>>(64);
    tokio::spawn(async move {
        let mut buf = BytesMut::new();
        let mut started = false;
        loop {
            let until = deadline.unwrap_or_else(|| tokio::time::Instant::now() + keepalive * 2);
            let next = tokio::select! {
                r = tokio::time::timeout(keepalive, each_line(&mut body, &mut buf)) => r,
                _ = tokio::time::sleep_until(until), if deadline.is_some() => {
                    let _ = tx.send(connect::end(Some(("deadline_exceeded", "the watch reached its timeout")))).await;
                    return;
                }
            };
            let frame = match next {
                Err(_) if started => connect::message(&json!({"keepalive": {}})),
                Err(_) => continue,
                Ok(None) => {
                    let _ = tx
                        .send(connect::end(Some(("unavailable", "the watch ended"))))
                        .await;
                    return;
                }
                Ok(Some(Err((c, m)))) => {
                    let _ = tx.send(connect::end(Some((&c, &m)))).await;
                    return;
                }
                Ok(Some(Ok(v))) if v["type"] == "ready" => {
                    started = true;
                    connect::message(&json!({"start": {}}))
                }
                Ok(Some(Ok(v))) => match fs_event(&v, &dir) {
                    Some(e) if started => connect::message(&json!({"filesystem": e})),
                    _ => continue,
                },
            };
            if tx.send(frame).await.is_err() {
                return;
            }
        }
    });
    stream_response(rx)
}

/// The polling watchers.
pub(crate) async fn rpc(gw: &Gw, t: &Target, method: &str, msg: Value) -> RpcResult {
    match method {
        "CreateWatcher" => {
            let full_now = gw
                .watchers
                .lock()
                .map(|mut w| {
                    // Watches whose sandbox went away have ended: forget them.
                    w.map.retain(|_, x| !x.task.is_finished());
                    w.map.len() >= MAX_WATCHERS
                })
                .unwrap_or(true);
            if full_now {
                return Err(RpcErr::new(
                    "resource_exhausted",
                    "too many watchers: remove some first",
                ));
            }
            let (mut body, dir) = open(gw, t, &msg).await?;
            let mut buf = BytesMut::new();
            // The watch is in place once it says ready.
            match each_line(&mut body, &mut buf).await {
                Some(Ok(v)) if v["type"] == "ready" => {}
                Some(Err((c, m))) => return Err(RpcErr(c, m)),
                _ => return Err(RpcErr::new("unavailable", "the watch did not start")),
            }
            let events = Arc::new(Mutex::new(Vec::new()));
            let ev2 = events.clone();
            let task = tokio::spawn(async move {
                while let Some(Ok(v)) = each_line(&mut body, &mut buf).await {
                    if let Some(e) = fs_event(&v, &dir)
                        && let Ok(mut q) = ev2.lock()
                    {
                        if q.len() >= MAX_PENDING {
                            q.remove(0);
                        }
                        q.push(e);
                    }
                }
            });
            let mut w = gw
                .watchers
                .lock()
                .map_err(|_| RpcErr::new("internal", "watcher table poisoned"))?;
            w.next += 1;
            let id = format!(
                "w{}-{}",
                w.next,
                &crate::access_token(&gw.cfg.secret, &format!("watch{}", w.next))[..12]
            );
            w.map.insert(
                id.clone(),
                Watcher {
                    sandbox: t.id.clone(),
                    events,
                    task,
                },
            );
            Ok(json!({"watcherId": id}))
        }
        "GetWatcherEvents" | "RemoveWatcher" => {
            let id = msg["watcherId"].as_str().unwrap_or("");
            let mut w = gw
                .watchers
                .lock()
                .map_err(|_| RpcErr::new("internal", "watcher table poisoned"))?;
            let not_found = || RpcErr::new("not_found", format!("watcher {id:?} not found"));
            match w.map.get(id) {
                Some(x) if x.sandbox == t.id => {}
                _ => return Err(not_found()),
            }
            if method == "RemoveWatcher" {
                if let Some(x) = w.map.remove(id) {
                    x.task.abort();
                }
                return Ok(json!({}));
            }
            let x = w.map.get(id).ok_or_else(not_found)?;
            let events: Vec<Value> = x
                .events
                .lock()
                .map(|mut q| std::mem::take(&mut *q))
                .unwrap_or_default();
            Ok(json!({"events": events}))
        }
        _ => Err(RpcErr::new(
            "unimplemented",
            format!("filesystem.Filesystem/{method} is not supported"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_named_relative_to_the_watch() {
        let e = fs_event(
            &json!({"type": "create", "path": "/w/sub/a.txt", "is_dir": false}),
            "/w",
        )
        .unwrap();
        assert_eq!(e, json!({"name": "sub/a.txt", "type": "EVENT_TYPE_CREATE"}));
        let e = fs_event(&json!({"type": "remove", "path": "/w/b"}), "/w/").unwrap();
        assert_eq!(e["name"], "b");
        assert!(fs_event(&json!({"type": "ready"}), "/w").is_none());
        assert!(fs_event(&json!({"type": "write"}), "/w").is_none());
    }
}
