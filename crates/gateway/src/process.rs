//! The `process.Process` service on OpenDsec's exec API: a `Start` is a streamed exec
//! whose NDJSON events become Connect `ProcessEvent`s; the rest map call for call.

use std::time::Duration;

use axum::body::Body;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use bytes::{Buf, BytesMut};
use http_body_util::BodyExt;
use hyper::Method;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::connect::{self, FLAG_COMPRESSED, MAX_MESSAGE};
use crate::envd::{RpcErr, RpcResult, Target, stream_error, stream_response};
use crate::upstream::{UpErr, full};
use crate::{Gw, header_str};

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// The pid a `ProcessSelector` names: its pid, or the running process with its tag.
async fn pid_of(gw: &Gw, t: &Target, sel: &Value) -> Result<u32, RpcErr> {
    if sel.get("tag").is_none_or(Value::is_null) {
        return pid_in(sel);
    }
    pid_among(sel, &processes(gw, t).await?)
}

/// The sandbox's managed processes, as the API lists them.
async fn processes(gw: &Gw, t: &Target) -> Result<Vec<Value>, RpcErr> {
    let mut v: Value = gw
        .up
        .call(
            Method::GET,
            &t.path("/processes"),
            &gw.cfg.service_key,
            None,
        )
        .await?;
    Ok(match v["processes"].take() {
        Value::Array(a) => a,
        _ => Vec::new(),
    })
}

/// The pid a selector names among `procs`: its pid, or the running process with its tag.
fn pid_among(sel: &Value, procs: &[Value]) -> Result<u32, RpcErr> {
    let Some(tag) = sel.get("tag").filter(|v| !v.is_null()) else {
        return pid_in(sel);
    };
    let tag = tag
        .as_str()
        .ok_or_else(|| RpcErr::new("invalid_argument", "process.tag must be a string"))?;
    procs
        .iter()
        .find(|p| p["running"] == json!(true) && p["tag"].as_str() == Some(tag))
        .and_then(|p| p["pid"].as_u64())
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| RpcErr::new("not_found", format!("no running process is tagged {tag:?}")))
}

/// The pid of a selector that names one.
fn pid_in(sel: &Value) -> Result<u32, RpcErr> {
    let p = &sel["pid"];
    p.as_u64()
        .or_else(|| p.as_str().and_then(|s| s.parse().ok()))
        .and_then(|n| u32::try_from(n).ok())
        .filter(|n| *n > 0)
        .ok_or_else(|| RpcErr::new("invalid_argument", "process.pid is missing or not a number"))
}

fn string_map(v: &Value, what: &str) -> Result<serde_json::Map<String, Value>, RpcErr> {
    match v {
        Value::Null => Ok(Default::default()),
        Value::Object(m) if m.values().all(Value::is_string) => Ok(m.clone()),
        _ => Err(RpcErr::new(
            "invalid_argument",
            format!("{what} must map strings to strings"),
        )),
    }
}

/// The exec request a `Start` stands for.
fn exec_request(t: &Target, h: &HeaderMap, msg: &Value) -> Result<(Value, bool), RpcErr> {
    let p = &msg["process"];
    let cmd = p["cmd"]
        .as_str()
        .filter(|c| !c.is_empty())
        .ok_or_else(|| RpcErr::new("invalid_argument", "process.cmd is required"))?;
    let mut argv = vec![Value::from(cmd)];
    match &p["args"] {
        Value::Null => {}
        Value::Array(a) if a.iter().all(Value::is_string) => argv.extend(a.iter().cloned()),
        _ => {
            return Err(RpcErr::new(
                "invalid_argument",
                "process.args must be strings",
            ));
        }
    }
    let mut req =
        json!({"argv": argv, "stream": true, "env": string_map(&p["envs"], "process.envs")?});
    if let Some(cwd) = p["cwd"].as_str().filter(|c| !c.is_empty()) {
        // `~` and relative working directories are the user's home and under it.
        req["cwd"] = json!(crate::files::sandbox_path(t, cwd).map_err(RpcErr::from)?);
    }
    if let Some(u) = &t.user {
        req["user"] = json!(u);
    }
    if let Some(tag) = msg["tag"].as_str() {
        req["tag"] = json!(tag);
    }
    // Connect-Timeout-Ms is the process's lifetime; without it a streamed process runs
    // until it ends (`timeout=0` in the SDK).
    if let Some(ms) = header_str(h, "connect-timeout-ms").and_then(|v| v.parse::<u64>().ok())
        && ms > 0
    {
        req["timeout_seconds"] = json!((ms as f64 / 1000.0).max(0.001));
    }
    let pty = !msg["pty"].is_null();
    if pty {
        let s = &msg["pty"]["size"];
        let dim = |v: &Value| v.as_u64().filter(|n| (1..=u16::MAX as u64).contains(n));
        req["pty"] = json!({
            "cols": dim(&s["cols"]).unwrap_or(80),
            "rows": dim(&s["rows"]).unwrap_or(24),
        });
    } else if msg["stdin"] == json!(false) {
        // stdin closed at once: a command reading it sees EOF.
        req["stdin"] = json!("");
    }
    Ok((req, pty))
}

/// `Start` and `Connect`: the process's events as a Connect server stream.
pub(crate) async fn stream(
    gw: &Gw,
    t: &Target,
    h: &HeaderMap,
    method: &str,
    msg: Value,
) -> Response {
    let opened = async {
        if method == "Start" {
            let (req, pty) = exec_request(t, h, &msg)?;
            let r = gw
                .up
                .open(
                    Method::POST,
                    &t.path("/exec"),
                    &gw.cfg.service_key,
                    Some("application/json"),
                    full(req.to_string()),
                )
                .await?;
            Ok::<_, RpcErr>((r, pty))
        } else {
            let procs = processes(gw, t).await?;
            let pid = pid_among(&msg["process"], &procs)?;
            // A terminal's output goes out as `pty` data (what `pty.connect` reads).
            let pty = procs
                .iter()
                .any(|p| p["pid"].as_u64() == Some(pid as u64) && p["pty"] == json!(true));
            let r = gw
                .up
                .open(
                    Method::GET,
                    &t.path(&format!("/processes/{pid}/output")),
                    &gw.cfg.service_key,
                    None,
                    full(bytes::Bytes::new()),
                )
                .await?;
            Ok((r, pty))
        }
    }
    .await;
    let (resp, pty) = match opened {
        Ok(x) => x,
        Err(RpcErr(c, m)) => {
            // The sandbox may have gone since it was last seen running (the check is
            // skipped for a moment after one): then E2B's "not found" as before.
            gw.forget_running(&t.id);
            if let Err(gone) = crate::envd::running(gw, &t.id).await {
                return gone;
            }
            return stream_error(&c, &m);
        }
    };
    let keepalive = header_str(h, "keepalive-ping-interval")
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs);
    let (tx, rx) = mpsc::channel::<Vec<u8>>(64);
    tokio::spawn(relay(resp.into_body(), tx, pty, keepalive));
    stream_response(rx)
}

/// NDJSON exec events in, Connect frames out, until the end frame. A client that goes
/// away ends the relay, not the process.
async fn relay(
    mut body: crate::upstream::UpBody,
    tx: mpsc::Sender<Vec<u8>>,
    pty: bool,
    keepalive: Option<Duration>,
) {
    let mut buf = BytesMut::new();
    let mut started = false;
    loop {
        // Every event already here goes out as one chunk (the end message and the end of
        // the stream, say): one write and one wake-up of the client, not one per frame.
        let mut out = Vec::new();
        let mut done = false;
        while let Some(nl) = buf.iter().position(|b| *b == b'\n') {
            let line = buf.split_to(nl + 1);
            let Ok(ev) = serde_json::from_slice::<Value>(&line[..nl]) else {
                continue;
            };
            let (frames, end) = convert(&ev, pty, &mut started);
            out.extend(frames.into_iter().flatten());
            if end {
                done = true;
                break;
            }
        }
        if !out.is_empty() && tx.send(out).await.is_err() {
            return;
        }
        if done {
            // The API's response ends right after: read its end, so that its connection
            // goes back to the pool instead of being closed.
            let _ = tokio::time::timeout(Duration::from_secs(1), async {
                while let Some(Ok(_)) = body.frame().await {}
            })
            .await;
            return;
        }
        let next = match keepalive.filter(|_| started) {
            Some(d) => match tokio::time::timeout(d, body.frame()).await {
                Ok(f) => f,
                Err(_) => {
                    let ka = connect::message(&json!({"event": {"keepalive": {}}}));
                    if tx.send(ka).await.is_err() {
                        return;
                    }
                    continue;
                }
            },
            None => body.frame().await,
        };
        match next {
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    buf.extend_from_slice(&d);
                }
            }
            Some(Err(e)) => {
                let _ = tx
                    .send(connect::end(Some(("unavailable", &e.to_string()))))
                    .await;
                return;
            }
            None => {
                let _ = tx
                    .send(connect::end(Some((
                        "unavailable",
                        "the process stream ended early",
                    ))))
                    .await;
                return;
            }
        }
    }
}

/// One exec event as Connect frames; true once the stream is over.
fn convert(ev: &Value, pty: bool, started: &mut bool) -> (Vec<Vec<u8>>, bool) {
    let msg = |v: Value| connect::message(&json!({"event": v}));
    match ev["type"].as_str().unwrap_or("") {
        "start" => {
            *started = true;
            (vec![msg(json!({"start": {"pid": ev["pid"]}}))], false)
        }
        k @ ("stdout" | "stderr") => {
            let key = if pty { "pty" } else { k };
            let data = ev["data"].as_str().unwrap_or("");
            (vec![msg(json!({"data": {key: data}}))], false)
        }
        "exit" => {
            if ev["timed_out"] == json!(true) {
                return (
                    vec![connect::end(Some((
                        "deadline_exceeded",
                        "the command timed out",
                    )))],
                    true,
                );
            }
            let end = match ev["signal"].as_i64() {
                Some(sig) => {
                    let st = format!("signal: {}", signal_name(sig));
                    json!({"exitCode": -1, "exited": false, "status": st, "error": st})
                }
                None => {
                    let code = ev["exit_code"].as_i64().unwrap_or(-1);
                    let st = format!("exit status {code}");
                    let mut e = json!({"exitCode": code, "exited": true, "status": st});
                    if code != 0 {
                        e["error"] = json!(st);
                    }
                    e
                }
            };
            (vec![msg(json!({"end": end})), connect::end(None)], true)
        }
        "error" => {
            let code = ev["code"].as_str().unwrap_or("unknown");
            let m = ev["message"].as_str().unwrap_or("exec failed");
            (vec![connect::end(Some((code, m)))], true)
        }
        _ => (vec![], false),
    }
}

fn signal_name(sig: i64) -> String {
    match sig {
        9 => "killed".into(),
        15 => "terminated".into(),
        2 => "interrupt".into(),
        n => format!("signal {n}"),
    }
}

/// The unary `process.Process` methods.
pub(crate) async fn unary(gw: &Gw, t: &Target, method: &str, msg: Value) -> RpcResult {
    let key = &gw.cfg.service_key;
    match method {
        "List" => {
            let v: Value = gw
                .up
                .call(Method::GET, &t.path("/processes"), key, None)
                .await?;
            let procs: Vec<Value> = v["processes"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["running"] == json!(true))
                .map(|p| {
                    let argv: Vec<Value> = p["argv"].as_array().cloned().unwrap_or_default();
                    let mut cfg = json!({
                        "cmd": argv.first().cloned().unwrap_or(json!("")),
                        "args": argv.get(1..).unwrap_or(&[]),
                        "envs": {},
                    });
                    if let Some(c) = p["cwd"].as_str() {
                        cfg["cwd"] = json!(c);
                    }
                    let mut out = json!({"pid": p["pid"], "config": cfg});
                    if let Some(tag) = p["tag"].as_str() {
                        out["tag"] = json!(tag);
                    }
                    out
                })
                .collect();
            Ok(json!({"processes": procs}))
        }
        "SendInput" => {
            let pid = pid_of(gw, t, &msg["process"]).await?;
            let inp = &msg["input"];
            let data = inp["stdin"].as_str().or(inp["pty"].as_str()).unwrap_or("");
            let bytes = B64
                .decode(data)
                .map_err(|_| RpcErr::new("invalid_argument", "input is not base64"))?;
            send_stdin(gw, t, pid, bytes, false).await?;
            Ok(json!({}))
        }
        "CloseStdin" => {
            let pid = pid_of(gw, t, &msg["process"]).await?;
            send_stdin(gw, t, pid, vec![], true).await?;
            Ok(json!({}))
        }
        "SendSignal" => {
            let pid = pid_of(gw, t, &msg["process"]).await?;
            let sig = match &msg["signal"] {
                Value::String(s) if s == "SIGNAL_SIGKILL" => 9,
                Value::String(s) if s == "SIGNAL_SIGTERM" => 15,
                Value::Number(n) if n.as_u64() == Some(9) || n.as_u64() == Some(15) => {
                    n.as_u64().unwrap_or(9)
                }
                _ => {
                    return Err(RpcErr::new(
                        "invalid_argument",
                        "signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM",
                    ));
                }
            };
            let sent: Result<Value, _> = gw
                .up
                .call(
                    Method::POST,
                    &t.path(&format!("/processes/{pid}/signal")),
                    key,
                    Some(json!({"signal": sig})),
                )
                .await;
            match sent {
                Ok(_) => Ok(json!({})),
                // As envd: a process that has ended is not found (the SDK's `kill` then
                // answers False instead of raising).
                Err(e) if e.code == "failed_precondition" => Err(RpcErr::new(
                    "not_found",
                    format!("process {pid} is not running: {}", e.message),
                )),
                Err(e) => Err(e.into()),
            }
        }
        "Update" => {
            let pid = pid_of(gw, t, &msg["process"]).await?;
            let s = &msg["pty"]["size"];
            if s.is_null() {
                return Ok(json!({}));
            }
            let _: Value = gw
                .up
                .call(
                    Method::POST,
                    &t.path(&format!("/processes/{pid}/resize")),
                    key,
                    Some(json!({"cols": s["cols"], "rows": s["rows"]})),
                )
                .await?;
            Ok(json!({}))
        }
        _ => Err(RpcErr::new(
            "unimplemented",
            format!("process.Process/{method} is not supported"),
        )),
    }
}

async fn send_stdin(
    gw: &Gw,
    t: &Target,
    pid: u32,
    data: Vec<u8>,
    close: bool,
) -> Result<(), UpErr> {
    let q = if close { "?close=true" } else { "" };
    let r = gw
        .up
        .open(
            Method::POST,
            &t.path(&format!("/processes/{pid}/stdin{q}")),
            &gw.cfg.service_key,
            Some("application/octet-stream"),
            full(data),
        )
        .await?;
    let _ = r.into_body().collect().await;
    Ok(())
}

/// `StreamInput` (client stream): each frame applied as it arrives; one `{}` and the end
/// frame when the request ends.
pub(crate) async fn stream_input(gw: &Gw, t: &Target, mut body: Body) -> Response {
    let mut buf = BytesMut::new();
    let mut pid: Option<u32> = None;
    loop {
        // Whole frames first.
        while buf.len() >= 5 {
            let flags = buf[0];
            let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
            if flags & FLAG_COMPRESSED != 0 || flags != 0 {
                return stream_error("invalid_argument", "bad Connect envelope flags");
            }
            if len > MAX_MESSAGE {
                return stream_error("resource_exhausted", "request message too large");
            }
            if buf.len() < 5 + len {
                break;
            }
            buf.advance(5);
            let m = buf.split_to(len);
            let Ok(v) = serde_json::from_slice::<Value>(&m) else {
                return stream_error("invalid_argument", "request message is not JSON");
            };
            if let Some(s) = v.get("start") {
                match pid_of(gw, t, &s["process"]).await {
                    Ok(p) => pid = Some(p),
                    Err(RpcErr(c, m)) => return stream_error(&c, &m),
                }
            } else if let Some(d) = v.get("data") {
                let Some(p) = pid else {
                    return stream_error("invalid_argument", "data before start");
                };
                let inp = &d["input"];
                let data = inp["stdin"].as_str().or(inp["pty"].as_str()).unwrap_or("");
                let Ok(bytes) = B64.decode(data) else {
                    return stream_error("invalid_argument", "input is not base64");
                };
                if let Err(e) = send_stdin(gw, t, p, bytes, false).await {
                    return stream_error(&e.code, &e.message);
                }
            }
        }
        match body.frame().await {
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    buf.extend_from_slice(&d);
                }
            }
            Some(Err(e)) => return stream_error("canceled", &e.to_string()),
            None => break,
        }
    }
    if !buf.is_empty() {
        return stream_error("invalid_argument", "truncated Connect envelope");
    }
    let mut out = connect::message(&json!({}));
    out.extend(connect::end(None));
    (
        axum::http::StatusCode::OK,
        [(axum::http::header::CONTENT_TYPE, connect::STREAM_CT)],
        out,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_events_become_process_events() {
        let mut started = false;
        let (f, done) = convert(&json!({"type": "start", "pid": 7}), false, &mut started);
        assert!(started && !done);
        assert_eq!(&f[0][5..], br#"{"event":{"start":{"pid":7}}}"#);
        let (f, _) = convert(
            &json!({"type": "stdout", "data": "aGk="}),
            true,
            &mut started,
        );
        assert_eq!(&f[0][5..], br#"{"event":{"data":{"pty":"aGk="}}}"#);
        let (f, done) = convert(
            &json!({"type": "exit", "exit_code": 3}),
            false,
            &mut started,
        );
        assert!(done);
        let v: Value = serde_json::from_slice(&f[0][5..]).unwrap();
        assert_eq!(v["event"]["end"]["exitCode"], 3);
        assert_eq!(v["event"]["end"]["error"], "exit status 3");
        assert_eq!(f[1][0], connect::FLAG_END);
        let (f, _) = convert(
            &json!({"type": "exit", "exit_code": 137, "signal": 9}),
            false,
            &mut started,
        );
        let v: Value = serde_json::from_slice(&f[0][5..]).unwrap();
        assert_eq!(v["event"]["end"]["exitCode"], -1);
        let (f, done) = convert(
            &json!({"type": "exit", "timed_out": true}),
            false,
            &mut started,
        );
        assert!(done && f.len() == 1 && f[0][0] == connect::FLAG_END);
        let (f, done) = convert(
            &json!({"type": "exit", "exit_code": 0}),
            false,
            &mut started,
        );
        let v: Value = serde_json::from_slice(&f[0][5..]).unwrap();
        assert!(done && v["event"]["end"].get("error").is_none());
    }

    #[test]
    fn selectors_are_checked() {
        assert_eq!(pid_in(&json!({"pid": 5})).ok(), Some(5));
        assert_eq!(pid_in(&json!({"pid": "5"})).ok(), Some(5));
        assert!(pid_in(&json!({"pid": 0})).is_err());
        assert!(pid_in(&json!({"pid": -1})).is_err());
        assert!(pid_in(&json!(null)).is_err());
    }
}
