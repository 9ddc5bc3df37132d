//! The binary protobuf codec of envd's Connect RPCs (`application/proto`,
//! `application/connect+proto`): messages are transcoded to and from the proto3 JSON the
//! gateway works in, by the `process` and `filesystem` schemas below. The SDKs send JSON;
//! a client made from the `.proto` files with Connect's default codec sends this.

use base64::Engine;
use serde_json::{Map, Value, json};

/// A field's type. `Map` is `map<string, string>`; `Ts` is `google.protobuf.Timestamp`
/// (an RFC 3339 string in JSON).
#[derive(Clone, Copy)]
enum T {
    Str,
    Bytes,
    Bool,
    U32,
    I64,
    S32,
    Enum(&'static [(i64, &'static str)]),
    Msg(&'static str),
    Map,
    Ts,
}

/// A field: number, JSON name, type, repeated, explicit presence (`optional` or a oneof
/// member: sent even when it holds the default).
struct F(u32, &'static str, T, bool, bool);

const SIGNAL: &[(i64, &str)] = &[
    (0, "SIGNAL_UNSPECIFIED"),
    (15, "SIGNAL_SIGTERM"),
    (9, "SIGNAL_SIGKILL"),
];
const FILE_TYPE: &[(i64, &str)] = &[
    (0, "FILE_TYPE_UNSPECIFIED"),
    (1, "FILE_TYPE_FILE"),
    (2, "FILE_TYPE_DIRECTORY"),
    (3, "FILE_TYPE_SYMLINK"),
];
const EVENT_TYPE: &[(i64, &str)] = &[
    (0, "EVENT_TYPE_UNSPECIFIED"),
    (1, "EVENT_TYPE_CREATE"),
    (2, "EVENT_TYPE_WRITE"),
    (3, "EVENT_TYPE_REMOVE"),
    (4, "EVENT_TYPE_RENAME"),
    (5, "EVENT_TYPE_CHMOD"),
];

use T::*;

/// The fields of a message (by its full name), as in `process/process.proto` and
/// `filesystem/filesystem.proto`.
fn fields(msg: &str) -> Option<&'static [F]> {
    Some(match msg {
        "process.PTY" => &[F(1, "size", Msg("process.PTY.Size"), false, false)],
        "process.PTY.Size" => &[
            F(1, "cols", U32, false, false),
            F(2, "rows", U32, false, false),
        ],
        "process.ProcessConfig" => &[
            F(1, "cmd", Str, false, false),
            F(2, "args", Str, true, false),
            F(3, "envs", Map, false, false),
            F(4, "cwd", Str, false, true),
        ],
        "process.ProcessSelector" => {
            &[F(1, "pid", U32, false, true), F(2, "tag", Str, false, true)]
        }
        "process.ProcessInfo" => &[
            F(1, "config", Msg("process.ProcessConfig"), false, false),
            F(2, "pid", U32, false, false),
            F(3, "tag", Str, false, true),
        ],
        "process.ListResponse" => &[F(1, "processes", Msg("process.ProcessInfo"), true, false)],
        "process.StartRequest" => &[
            F(1, "process", Msg("process.ProcessConfig"), false, false),
            F(2, "pty", Msg("process.PTY"), false, true),
            F(3, "tag", Str, false, true),
            F(4, "stdin", Bool, false, true),
        ],
        "process.UpdateRequest" => &[
            F(1, "process", Msg("process.ProcessSelector"), false, false),
            F(2, "pty", Msg("process.PTY"), false, true),
        ],
        "process.ProcessEvent" => &[
            F(
                1,
                "start",
                Msg("process.ProcessEvent.StartEvent"),
                false,
                true,
            ),
            F(
                2,
                "data",
                Msg("process.ProcessEvent.DataEvent"),
                false,
                true,
            ),
            F(3, "end", Msg("process.ProcessEvent.EndEvent"), false, true),
            F(4, "keepalive", Msg("Empty"), false, true),
        ],
        "process.ProcessEvent.StartEvent" => &[F(1, "pid", U32, false, false)],
        "process.ProcessEvent.DataEvent" => &[
            F(1, "stdout", Bytes, false, true),
            F(2, "stderr", Bytes, false, true),
            F(3, "pty", Bytes, false, true),
        ],
        "process.ProcessEvent.EndEvent" => &[
            F(1, "exitCode", S32, false, false),
            F(2, "exited", Bool, false, false),
            F(3, "status", Str, false, false),
            F(4, "error", Str, false, true),
        ],
        "process.StartResponse" | "process.ConnectResponse" => {
            &[F(1, "event", Msg("process.ProcessEvent"), false, false)]
        }
        "process.ConnectRequest" | "process.CloseStdinRequest" => &[F(
            1,
            "process",
            Msg("process.ProcessSelector"),
            false,
            false,
        )],
        "process.ProcessInput" => &[
            F(1, "stdin", Bytes, false, true),
            F(2, "pty", Bytes, false, true),
        ],
        "process.SendInputRequest" => &[
            F(1, "process", Msg("process.ProcessSelector"), false, false),
            F(2, "input", Msg("process.ProcessInput"), false, false),
        ],
        "process.StreamInputRequest" => &[
            F(
                1,
                "start",
                Msg("process.StreamInputRequest.StartEvent"),
                false,
                true,
            ),
            F(
                2,
                "data",
                Msg("process.StreamInputRequest.DataEvent"),
                false,
                true,
            ),
            F(3, "keepalive", Msg("Empty"), false, true),
        ],
        "process.StreamInputRequest.StartEvent" => &[F(
            1,
            "process",
            Msg("process.ProcessSelector"),
            false,
            false,
        )],
        "process.StreamInputRequest.DataEvent" => {
            &[F(2, "input", Msg("process.ProcessInput"), false, false)]
        }
        "process.SendSignalRequest" => &[
            F(1, "process", Msg("process.ProcessSelector"), false, false),
            F(2, "signal", Enum(SIGNAL), false, false),
        ],
        "filesystem.EntryInfo" => &[
            F(1, "name", Str, false, false),
            F(2, "type", Enum(FILE_TYPE), false, false),
            F(3, "path", Str, false, false),
            F(4, "size", I64, false, false),
            F(5, "mode", U32, false, false),
            F(6, "permissions", Str, false, false),
            F(7, "owner", Str, false, false),
            F(8, "group", Str, false, false),
            F(9, "modifiedTime", Ts, false, true),
            F(10, "symlinkTarget", Str, false, true),
            F(11, "metadata", Map, false, false),
            F(12, "isSymlink", Bool, false, false),
        ],
        "filesystem.StatRequest" | "filesystem.MakeDirRequest" | "filesystem.RemoveRequest" => {
            &[F(1, "path", Str, false, false)]
        }
        "filesystem.StatResponse" | "filesystem.MakeDirResponse" | "filesystem.MoveResponse" => {
            &[F(1, "entry", Msg("filesystem.EntryInfo"), false, false)]
        }
        "filesystem.MoveRequest" => &[
            F(1, "source", Str, false, false),
            F(2, "destination", Str, false, false),
        ],
        "filesystem.ListDirRequest" => &[
            F(1, "path", Str, false, false),
            F(2, "depth", U32, false, false),
        ],
        "filesystem.ListDirResponse" => {
            &[F(1, "entries", Msg("filesystem.EntryInfo"), true, false)]
        }
        "filesystem.WatchDirRequest" | "filesystem.CreateWatcherRequest" => &[
            F(1, "path", Str, false, false),
            F(2, "recursive", Bool, false, false),
            F(3, "includeEntry", Bool, false, false),
            F(4, "allowNetworkMounts", Bool, false, false),
        ],
        "filesystem.FilesystemEvent" => &[
            F(1, "name", Str, false, false),
            F(2, "type", Enum(EVENT_TYPE), false, false),
            F(3, "entry", Msg("filesystem.EntryInfo"), false, true),
        ],
        "filesystem.WatchDirResponse" => &[
            F(1, "start", Msg("Empty"), false, true),
            F(
                2,
                "filesystem",
                Msg("filesystem.FilesystemEvent"),
                false,
                true,
            ),
            F(3, "keepalive", Msg("Empty"), false, true),
        ],
        "filesystem.CreateWatcherResponse"
        | "filesystem.GetWatcherEventsRequest"
        | "filesystem.RemoveWatcherRequest" => &[F(1, "watcherId", Str, false, false)],
        "filesystem.GetWatcherEventsResponse" => &[F(
            1,
            "events",
            Msg("filesystem.FilesystemEvent"),
            true,
            false,
        )],
        // every empty request and response
        "Empty" => &[],
        _ => return None,
    })
}

/// The request and response messages of an RPC (`process.Process`, `Start`).
pub fn rpc_types(service: &str, method: &str) -> Option<(&'static str, &'static str)> {
    Some(match (service, method) {
        ("process.Process", "List") => ("Empty", "process.ListResponse"),
        ("process.Process", "Start") => ("process.StartRequest", "process.StartResponse"),
        ("process.Process", "Connect") => ("process.ConnectRequest", "process.ConnectResponse"),
        ("process.Process", "Update") => ("process.UpdateRequest", "Empty"),
        ("process.Process", "StreamInput") => ("process.StreamInputRequest", "Empty"),
        ("process.Process", "SendInput") => ("process.SendInputRequest", "Empty"),
        ("process.Process", "SendSignal") => ("process.SendSignalRequest", "Empty"),
        ("process.Process", "CloseStdin") => ("process.CloseStdinRequest", "Empty"),
        ("filesystem.Filesystem", "Stat") => ("filesystem.StatRequest", "filesystem.StatResponse"),
        ("filesystem.Filesystem", "MakeDir") => {
            ("filesystem.MakeDirRequest", "filesystem.MakeDirResponse")
        }
        ("filesystem.Filesystem", "Move") => ("filesystem.MoveRequest", "filesystem.MoveResponse"),
        ("filesystem.Filesystem", "ListDir") => {
            ("filesystem.ListDirRequest", "filesystem.ListDirResponse")
        }
        ("filesystem.Filesystem", "Remove") => ("filesystem.RemoveRequest", "Empty"),
        ("filesystem.Filesystem", "WatchDir") => {
            ("filesystem.WatchDirRequest", "filesystem.WatchDirResponse")
        }
        ("filesystem.Filesystem", "CreateWatcher") => (
            "filesystem.CreateWatcherRequest",
            "filesystem.CreateWatcherResponse",
        ),
        ("filesystem.Filesystem", "GetWatcherEvents") => (
            "filesystem.GetWatcherEventsRequest",
            "filesystem.GetWatcherEventsResponse",
        ),
        ("filesystem.Filesystem", "RemoveWatcher") => ("filesystem.RemoveWatcherRequest", "Empty"),
        _ => return None,
    })
}

/// Why a message could not be transcoded (the client is told, as `invalid_argument`).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProtoError {
    /// The binary message is malformed: how.
    #[error("{0}")]
    Malformed(&'static str),
    #[error("wire type {0} is not supported")]
    WireType(u64),
    #[error("unknown message {0}")]
    UnknownMessage(String),
    /// A field holds what its type does not allow: the field, and what was wrong.
    #[error("{field}: {why}")]
    Field { field: String, why: String },
    #[error("message too large")]
    TooLarge,
    #[error("gzip message: {0}")]
    Gzip(String),
    #[error("not JSON: {0}")]
    Json(String),
}

fn field_err(field: impl Into<String>, why: impl Into<String>) -> ProtoError {
    ProtoError::Field {
        field: field.into(),
        why: why.into(),
    }
}

/// Nesting deeper than any of these messages goes: a hostile message cannot recurse.
const MAX_DEPTH: usize = 16;

fn varint(b: &mut &[u8]) -> Result<u64, ProtoError> {
    let mut v = 0u64;
    for i in 0..10 {
        let (&x, rest) = b
            .split_first()
            .ok_or(ProtoError::Malformed("truncated varint"))?;
        *b = rest;
        v |= u64::from(x & 0x7f) << (7 * i);
        if x & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(ProtoError::Malformed("varint longer than 10 bytes"))
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn take<'a>(b: &mut &'a [u8], n: u64) -> Result<&'a [u8], ProtoError> {
    let n = usize::try_from(n).map_err(|_| ProtoError::Malformed("length too large"))?;
    if b.len() < n {
        return Err(ProtoError::Malformed("truncated field"));
    }
    let (x, rest) = b.split_at(n);
    *b = rest;
    Ok(x)
}

/// A binary message as proto3 JSON.
pub fn decode(bytes: &[u8], msg: &str) -> Result<Value, ProtoError> {
    decode_at(bytes, msg, 0)
}

fn decode_at(mut b: &[u8], msg: &str, depth: usize) -> Result<Value, ProtoError> {
    if depth > MAX_DEPTH {
        return Err(ProtoError::Malformed("message nested too deeply"));
    }
    let fs = fields(msg).ok_or_else(|| ProtoError::UnknownMessage(msg.to_string()))?;
    let mut out = Map::new();
    while !b.is_empty() {
        let key = varint(&mut b)?;
        let (num, wire) = ((key >> 3) as u32, key & 7);
        let raw: Result<(Option<u64>, Option<&[u8]>), ProtoError> = match wire {
            0 => Ok((Some(varint(&mut b)?), None)),
            1 => take(&mut b, 8).map(|x| {
                (
                    Some(u64::from_le_bytes(x.try_into().unwrap_or([0; 8]))),
                    None,
                )
            }),
            2 => {
                let n = varint(&mut b)?;
                Ok((None, Some(take(&mut b, n)?)))
            }
            5 => take(&mut b, 4).map(|x| {
                (
                    Some(u64::from(u32::from_le_bytes(
                        x.try_into().unwrap_or([0; 4]),
                    ))),
                    None,
                )
            }),
            w => Err(ProtoError::WireType(w)),
        };
        let (num_v, bytes_v) = raw?;
        let Some(f) = fs.iter().find(|f| f.0 == num) else {
            continue; // unknown fields are skipped
        };
        let v = match (f.2, num_v, bytes_v) {
            (Str, _, Some(x)) => Value::String(
                String::from_utf8(x.to_vec()).map_err(|_| field_err(f.1, "not UTF-8"))?,
            ),
            (Bytes, _, Some(x)) => json!(base64::engine::general_purpose::STANDARD.encode(x)),
            (Bool, Some(v), _) => json!(v != 0),
            (U32, Some(v), _) => json!(v as u32),
            (I64, Some(v), _) => json!((v as i64).to_string()),
            (S32, Some(v), _) => json!(((v >> 1) as i64) ^ -((v & 1) as i64)),
            (Enum(names), Some(v), _) => match names.iter().find(|(n, _)| *n == v as i32 as i64) {
                Some((_, name)) => json!(name),
                None => json!(v as i32),
            },
            (Msg(m), _, Some(x)) => decode_at(x, m, depth + 1)?,
            (Ts, _, Some(x)) => {
                let t = decode_ts(x)?;
                json!(t)
            }
            (Map, _, Some(x)) => {
                let e = map_entry(x)?;
                let obj = out.entry(f.1).or_insert_with(|| json!({}));
                if let (Some(o), Some(k)) = (obj.as_object_mut(), e["key"].as_str()) {
                    o.insert(k.to_string(), e["value"].clone());
                }
                continue;
            }
            _ => return Err(field_err(f.1, format!("wrong wire type {wire}"))),
        };
        if f.3 {
            match out.entry(f.1).or_insert_with(|| json!([])) {
                Value::Array(a) => a.push(v),
                _ => return Err(field_err(f.1, "repeated field")),
            }
        } else {
            out.insert(f.1.to_string(), v);
        }
    }
    Ok(Value::Object(out))
}

/// A `map<string, string>` entry: key = 1, value = 2.
fn map_entry(mut b: &[u8]) -> Result<Value, ProtoError> {
    let (mut k, mut v) = (String::new(), String::new());
    while !b.is_empty() {
        let key = varint(&mut b)?;
        if key & 7 != 2 {
            return Err(field_err("map entry", "wrong wire type"));
        }
        let n = varint(&mut b)?;
        let s = String::from_utf8(take(&mut b, n)?.to_vec())
            .map_err(|_| field_err("map entry", "not UTF-8"))?;
        match key >> 3 {
            1 => k = s,
            2 => v = s,
            _ => {}
        }
    }
    Ok(json!({"key": k, "value": v}))
}

fn decode_ts(mut b: &[u8]) -> Result<String, ProtoError> {
    let (mut secs, mut nanos) = (0i64, 0i64);
    while !b.is_empty() {
        let key = varint(&mut b)?;
        let v = varint(&mut b)?;
        match key >> 3 {
            1 => secs = v as i64,
            2 => nanos = v as i32 as i64,
            _ => {}
        }
    }
    let ms = secs.max(0) as u64 * 1000 + (nanos.max(0) as u64) / 1_000_000;
    Ok(crate::control::rfc3339(ms))
}

/// Proto3 JSON as a binary message.
pub fn encode(v: &Value, msg: &str) -> Result<Vec<u8>, ProtoError> {
    let mut out = Vec::new();
    encode_into(&mut out, v, msg, 0)?;
    Ok(out)
}

fn encode_into(out: &mut Vec<u8>, v: &Value, msg: &str, depth: usize) -> Result<(), ProtoError> {
    if depth > MAX_DEPTH {
        return Err(ProtoError::Malformed("message nested too deeply"));
    }
    let fs = fields(msg).ok_or_else(|| ProtoError::UnknownMessage(msg.to_string()))?;
    let Some(obj) = v.as_object() else {
        return Err(field_err(msg, "expected an object"));
    };
    for f in fs {
        let Some(x) = obj.get(f.1).filter(|x| !x.is_null()) else {
            continue;
        };
        let items: Vec<&Value> = match (f.3, x) {
            (true, Value::Array(a)) => a.iter().collect(),
            (true, _) => return Err(field_err(f.1, "expected a list")),
            (false, x) => vec![x],
        };
        for x in items {
            field(out, f, x, depth)?;
        }
    }
    Ok(())
}

fn key(out: &mut Vec<u8>, num: u32, wire: u64) {
    put_varint(out, (u64::from(num) << 3) | wire);
}

fn len_field(out: &mut Vec<u8>, num: u32, b: &[u8]) {
    key(out, num, 2);
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

fn int_of(x: &Value, name: &str) -> Result<i64, ProtoError> {
    x.as_i64()
        .or_else(|| x.as_u64().map(|u| u as i64))
        .or_else(|| x.as_str().and_then(|s| s.parse().ok()))
        .ok_or_else(|| field_err(name, "expected an integer"))
}

fn field(out: &mut Vec<u8>, f: &F, x: &Value, depth: usize) -> Result<(), ProtoError> {
    let (num, name, opt) = (f.0, f.1, f.4);
    match f.2 {
        Str => {
            let s = x
                .as_str()
                .ok_or_else(|| field_err(name, "expected a string"))?;
            if opt || !s.is_empty() {
                len_field(out, num, s.as_bytes());
            }
        }
        Bytes => {
            let s = x
                .as_str()
                .ok_or_else(|| field_err(name, "expected base64"))?;
            let b = base64::engine::general_purpose::STANDARD
                .decode(s)
                .map_err(|e| field_err(name, e.to_string()))?;
            if opt || !b.is_empty() {
                len_field(out, num, &b);
            }
        }
        Bool => {
            let b = x
                .as_bool()
                .ok_or_else(|| field_err(name, "expected a bool"))?;
            if opt || b {
                key(out, num, 0);
                put_varint(out, u64::from(b));
            }
        }
        U32 | I64 | Enum(_) => {
            let n = match (f.2, x.as_str()) {
                (Enum(names), Some(s)) => names
                    .iter()
                    .find(|(_, n)| *n == s)
                    .map(|(n, _)| *n)
                    .ok_or_else(|| field_err(name, format!("unknown value {s:?}")))?,
                _ => int_of(x, name)?,
            };
            if opt || n != 0 {
                key(out, num, 0);
                put_varint(out, n as u64);
            }
        }
        S32 => {
            let n = int_of(x, name)?;
            if opt || n != 0 {
                key(out, num, 0);
                put_varint(out, ((n << 1) ^ (n >> 63)) as u64);
            }
        }
        Msg(m) => {
            let mut inner = Vec::new();
            encode_into(&mut inner, x, m, depth + 1)?;
            len_field(out, num, &inner);
        }
        Ts => {
            let s = x
                .as_str()
                .ok_or_else(|| field_err(name, "expected a time"))?;
            let ms = parse_rfc3339(s)
                .ok_or_else(|| field_err(name, format!("{s:?} is not RFC 3339")))?;
            let mut inner = Vec::new();
            key(&mut inner, 1, 0);
            put_varint(&mut inner, (ms / 1000) as u64);
            if ms % 1000 != 0 {
                key(&mut inner, 2, 0);
                put_varint(&mut inner, ((ms % 1000) * 1_000_000) as u64);
            }
            len_field(out, num, &inner);
        }
        Map => {
            let o = x
                .as_object()
                .ok_or_else(|| field_err(name, "expected an object"))?;
            for (k, v) in o {
                let v = v
                    .as_str()
                    .ok_or_else(|| field_err(format!("{name}.{k}"), "expected a string"))?;
                let mut e = Vec::new();
                len_field(&mut e, 1, k.as_bytes());
                len_field(&mut e, 2, v.as_bytes());
                len_field(out, num, &e);
            }
        }
    }
    Ok(())
}

/// `YYYY-MM-DDTHH:MM:SS[.fff…]Z` as unix milliseconds.
fn parse_rfc3339(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || b[10] != b'T' || !s.ends_with('Z') {
        return None;
    }
    let n = |r: std::ops::Range<usize>| s.get(r)?.parse::<i64>().ok();
    let (y, mo, d) = (n(0..4)?, n(5..7)?, n(8..10)?);
    let (h, mi, sec) = (n(11..13)?, n(14..16)?, n(17..19)?);
    let frac = s.get(19..s.len() - 1).unwrap_or("");
    let ms = match frac.strip_prefix('.') {
        Some(f) if !f.is_empty() => {
            let digits: String = f.chars().chain("000".chars()).take(3).collect();
            digits.parse::<i64>().ok()?
        }
        _ => 0,
    };
    // days from civil (Howard Hinnant)
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if mo > 2 { mo - 3 } else { mo + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 86400 + h * 3600 + mi * 60 + sec) * 1000) + ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fuzz target: any bytes decode (or are refused) as each message the gateway reads,
    /// and what decodes encodes again.
    #[test]
    fn fuzz_transcoding() {
        let messages: Vec<&str> = [
            ("process.Process", "Start"),
            ("process.Process", "Connect"),
            ("process.Process", "Update"),
            ("process.Process", "StreamInput"),
            ("process.Process", "SendInput"),
            ("process.Process", "SendSignal"),
            ("process.Process", "CloseStdin"),
            ("filesystem.Filesystem", "Stat"),
            ("filesystem.Filesystem", "MakeDir"),
            ("filesystem.Filesystem", "Move"),
            ("filesystem.Filesystem", "ListDir"),
            ("filesystem.Filesystem", "Remove"),
            ("filesystem.Filesystem", "WatchDir"),
        ]
        .iter()
        .filter_map(|(s, m)| rpc_types(s, m).map(|t| t.0))
        .collect();
        bolero::check!()
            .with_iterations(crate::FUZZ_CASES)
            .for_each(|input: &[u8]| {
                for m in &messages {
                    if let Ok(v) = decode(input, m) {
                        encode(&v, m).expect("a decoded message encodes again");
                    }
                }
            });
    }

    #[test]
    fn messages_round_trip() {
        let start = json!({
            "process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi"], "envs": {"A": "b"}},
            "stdin": false,
        });
        let b = encode(&start, "process.StartRequest").unwrap();
        // an explicit `stdin: false` is kept (presence), defaults are not sent
        assert_eq!(decode(&b, "process.StartRequest").unwrap(), start);
        let ev =
            json!({"event": {"end": {"exitCode": -1, "exited": true, "status": "signal: killed"}}});
        let b = encode(&ev, "process.StartResponse").unwrap();
        assert_eq!(decode(&b, "process.StartResponse").unwrap(), ev);
        let ka = json!({"event": {"keepalive": {}}});
        assert_eq!(
            decode(
                &encode(&ka, "process.ConnectResponse").unwrap(),
                "process.ConnectResponse"
            )
            .unwrap(),
            ka
        );
        let entry = json!({"entries": [{
            "name": "a", "type": "FILE_TYPE_FILE", "path": "/a", "size": "12345678901",
            "mode": 420, "permissions": "-rw-r--r--", "owner": "root", "group": "root",
            "modifiedTime": "2025-01-01T00:00:00.123Z",
        }]});
        let b = encode(&entry, "filesystem.ListDirResponse").unwrap();
        assert_eq!(decode(&b, "filesystem.ListDirResponse").unwrap(), entry);
        assert_eq!(parse_rfc3339("1970-01-01T00:00:01Z"), Some(1000));
        assert_eq!(
            parse_rfc3339("2000-02-29T00:00:00.5Z"),
            Some(951_782_400_500)
        );
    }

    #[test]
    fn bytes_from_protoc_decode() {
        // StartRequest{process{cmd:"ls"}, stdin:false} as protoc writes it
        let b = [0x0a, 0x04, 0x0a, 0x02, b'l', b's', 0x20, 0x00];
        assert_eq!(
            decode(&b, "process.StartRequest").unwrap(),
            json!({"process": {"cmd": "ls"}, "stdin": false})
        );
        // garbage is an error, never a panic
        for bad in [
            &[0x0a, 0x05, 0x01][..],
            &[0xff; 12],
            &[0x0b],
            &[0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f],
        ] {
            assert!(decode(bad, "process.StartRequest").is_err(), "{bad:?}");
        }
    }
}

/// Which way a stream of Connect frames is transcoded.
#[derive(Clone, Copy)]
pub enum Dir {
    /// Binary messages in (a request), JSON out (for the handlers).
    ToJson,
    /// JSON messages in (a handler's response), binary out.
    ToProto,
}

/// A compressed message, unpacked (at most [`MAX_MESSAGE`](crate::connect::MAX_MESSAGE)).
fn gunzip_message(payload: &[u8]) -> Result<Vec<u8>, ProtoError> {
    crate::gunzip(payload, crate::connect::MAX_MESSAGE).map_err(|e| match e {
        crate::GunzipError::TooLarge => ProtoError::TooLarge,
        crate::GunzipError::Bad(e) => ProtoError::Gzip(e.to_string()),
    })
}

/// One message frame transcoded; end-of-stream frames (flag 2) are JSON in either codec
/// and pass as they are. Compressed request frames (flag 1, gzip) are unpacked.
fn reframe_one(flags: u8, payload: &[u8], msg: &str, dir: Dir) -> Result<Vec<u8>, ProtoError> {
    if flags & 2 != 0 {
        return Ok(crate::connect::encode(flags, payload));
    }
    let unpacked;
    let payload = if flags & 1 != 0 {
        unpacked = gunzip_message(payload)?;
        &unpacked[..]
    } else {
        payload
    };
    if payload.len() > crate::connect::MAX_MESSAGE {
        return Err(ProtoError::TooLarge);
    }
    let v = match dir {
        Dir::ToJson => decode(payload, msg)?,
        Dir::ToProto => {
            let v: Value =
                serde_json::from_slice(payload).map_err(|e| ProtoError::Json(e.to_string()))?;
            return Ok(crate::connect::encode(0, &encode(&v, msg)?));
        }
    };
    Ok(crate::connect::message(&v))
}

/// A body of Connect frames, transcoded frame by frame as it streams.
pub fn reframe<S, E>(
    body: S,
    msg: &'static str,
    dir: Dir,
) -> impl futures_util::Stream<Item = Result<bytes::Bytes, std::io::Error>> + Send + 'static
where
    S: futures_util::Stream<Item = Result<bytes::Bytes, E>> + Send + Unpin + 'static,
    E: std::fmt::Display,
{
    use futures_util::StreamExt;
    let state = (body, bytes::BytesMut::new(), false);
    futures_util::stream::unfold(state, move |(mut body, mut buf, done)| async move {
        if done {
            return None;
        }
        loop {
            if buf.len() >= 5 {
                let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
                if len > 2 * crate::connect::MAX_MESSAGE {
                    let e = std::io::Error::other("message too large");
                    return Some((Err(e), (body, buf, true)));
                }
                if buf.len() >= 5 + len {
                    let f = buf.split_to(5 + len);
                    return Some(match reframe_one(f[0], &f[5..], msg, dir) {
                        Ok(out) => (Ok(bytes::Bytes::from(out)), (body, buf, false)),
                        Err(e) => (Err(std::io::Error::other(e)), (body, buf, true)),
                    });
                }
            }
            match body.next().await {
                Some(Ok(b)) => buf.extend_from_slice(&b),
                Some(Err(e)) => {
                    return Some((Err(std::io::Error::other(e.to_string())), (body, buf, true)));
                }
                None if buf.is_empty() => return None,
                None => {
                    let e = std::io::Error::other("truncated frame at the end of the stream");
                    return Some((Err(e), (body, buf, true)));
                }
            }
        }
    })
}

/// Serves an RPC whose codec is binary protobuf through its JSON handler: the request is
/// transcoded to JSON, the answer back (errors and end-of-stream frames stay JSON, as the
/// Connect protocol has them).
pub async fn serve<F, Fut>(
    service: &str,
    method: &str,
    req: axum::extract::Request,
    handler: F,
) -> axum::response::Response
where
    F: FnOnce(axum::extract::Request) -> Fut,
    Fut: std::future::Future<Output = axum::response::Response>,
{
    use axum::body::Body;
    use axum::http::{HeaderValue, header};
    use axum::response::IntoResponse;

    let Some((req_t, resp_t)) = rpc_types(service, method) else {
        return crate::envd::unary_error(
            "unimplemented",
            &format!("{service}/{method} is not supported by this gateway"),
        );
    };
    let streaming = crate::header_str(req.headers(), "content-type")
        .is_some_and(|c| c.starts_with("application/connect+"));
    let (mut parts, body) = req.into_parts();
    let body = if streaming {
        Body::from_stream(reframe(body.into_data_stream(), req_t, Dir::ToJson))
    } else {
        let gz = crate::header_str(&parts.headers, "content-encoding") == Some("gzip");
        let bytes = match axum::body::to_bytes(body, 2 * crate::connect::MAX_MESSAGE).await {
            Ok(b) => b,
            Err(_) => {
                return crate::envd::unary_error("resource_exhausted", "request message too large");
            }
        };
        let unpacked = if gz {
            match gunzip_message(&bytes) {
                Ok(b) => bytes::Bytes::from(b),
                Err(e) => return crate::envd::unary_error("invalid_argument", &e.to_string()),
            }
        } else {
            bytes
        };
        let bytes = match decode(&unpacked, req_t) {
            Ok(v) => bytes::Bytes::from(v.to_string()),
            Err(e) => {
                return crate::envd::unary_error(
                    "invalid_argument",
                    &format!("request message: {e}"),
                );
            }
        };
        parts.headers.remove("content-encoding");
        Body::from(bytes)
    };
    let json_ct = if streaming {
        "application/connect+json"
    } else {
        "application/json"
    };
    parts
        .headers
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(json_ct));
    let resp = handler(axum::extract::Request::from_parts(parts, body)).await;
    let (mut rparts, rbody) = resp.into_parts();
    if streaming {
        rparts.headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/connect+proto"),
        );
        let out = reframe(rbody.into_data_stream(), resp_t, Dir::ToProto);
        return axum::response::Response::from_parts(rparts, Body::from_stream(out));
    }
    if rparts.status != axum::http::StatusCode::OK {
        return axum::response::Response::from_parts(rparts, rbody); // a JSON error
    }
    let encoded = match axum::body::to_bytes(rbody, 64 << 20).await {
        Ok(b) => serde_json::from_slice::<Value>(&b)
            .map_err(|e| ProtoError::Json(e.to_string()))
            .and_then(|v| encode(&v, resp_t)),
        Err(e) => Err(ProtoError::Json(e.to_string())),
    };
    match encoded {
        Ok(b) => (
            axum::http::StatusCode::OK,
            [(header::CONTENT_TYPE, "application/proto")],
            b,
        )
            .into_response(),
        Err(e) => crate::envd::unary_error("internal", &format!("encoding the answer: {e}")),
    }
}
