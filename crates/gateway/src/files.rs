//! envd's files: `GET`/`POST /files` and the `filesystem.Filesystem` RPCs, on OpenDsec's
//! files API.

use std::io::Read;

use axum::body::{Body, Bytes};
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use dsec_common::api::FileStat;
use http_body_util::BodyExt;
use hyper::Method;
use serde_json::{Value, json};

use crate::control::{query_pairs, rfc3339};
use crate::envd::{RpcErr, RpcResult, Target, target};
use crate::upstream::{UpErr, enc, full};
use crate::{Gw, e2b_error, header_str};

/// The largest upload body (one request; files are kept in memory while written).
const MAX_UPLOAD: usize = 64 << 20;
/// The longest path the gateway passes on.
const MAX_PATH: usize = 4096;

/// A path as the sandbox sees it: `~` is the user's home, a relative path stays relative
/// (the sandbox's working directory resolves it). Empty paths and NUL bytes are refused.
pub(crate) fn sandbox_path(t: &Target, p: &str) -> Result<String, UpErr> {
    if p.is_empty() || p.len() > MAX_PATH || p.contains('\0') {
        return Err(UpErr::new(
            400,
            "invalid_argument",
            "path must be 1 to 4096 bytes without NUL",
        ));
    }
    Ok(if p == "~" {
        t.home()
    } else if let Some(rest) = p.strip_prefix("~/") {
        format!("{}/{rest}", t.home())
    } else {
        p.to_string()
    })
}

fn query(q: &Option<String>, name: &str) -> Option<String> {
    query_pairs(q.as_deref().unwrap_or(""))
        .into_iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v)
}

/// `GET /files?path=&username=`: the file's bytes, streamed.
pub(crate) async fn read(State(gw): State<Gw>, h: HeaderMap, RawQuery(q): RawQuery) -> Response {
    let t = match target(&gw, &h, query(&q, "username")).await {
        Ok(t) => t,
        Err(r) => return r,
    };
    let r = async {
        let path = sandbox_path(&t, &query(&q, "path").unwrap_or_default())?;
        gw.up
            .open(
                Method::GET,
                &t.path(&format!("/files?path={}", enc(&path))),
                &gw.cfg.service_key,
                None,
                full(Bytes::new()),
            )
            .await
    }
    .await;
    match r {
        Ok(resp) => {
            let mut out = Response::builder()
                .status(StatusCode::OK)
                .header(header::CONTENT_TYPE, "application/octet-stream");
            if let Some(l) = resp.headers().get(header::CONTENT_LENGTH) {
                out = out.header(header::CONTENT_LENGTH, l.clone());
            }
            out.body(Body::new(resp.into_body()))
                .unwrap_or_else(|_| e2b_error(500, "building the response"))
        }
        Err(e) => e.into_response(),
    }
}

/// One file of an upload: its path as sent, and its bytes.
type Upload = (String, Bytes);

/// `POST /files`: multipart (one part per file, the filename the full path) or a raw
/// body (`path` required; `Content-Encoding: gzip` unpacked).
pub(crate) async fn write(
    State(gw): State<Gw>,
    h: HeaderMap,
    RawQuery(q): RawQuery,
    body: Body,
) -> Response {
    let t = match target(&gw, &h, query(&q, "username")).await {
        Ok(t) => t,
        Err(r) => return r,
    };
    let ct = header_str(&h, "content-type").unwrap_or("");
    let plain = matches!(header_str(&h, "content-encoding"), None | Some("identity"));
    if !ct.starts_with("multipart/form-data") && plain {
        // A raw upload (file objects, iterables) streams through, whatever its size.
        return match write_stream(&gw, &t, &q, body).await {
            Ok(v) => axum::Json(v).into_response(),
            Err(e) => e.into_response(),
        };
    }
    let Ok(body) = axum::body::to_bytes(body, MAX_UPLOAD).await else {
        return e2b_error(
            413,
            &format!("an upload is at most {} MiB", MAX_UPLOAD >> 20),
        );
    };
    match write_inner(&gw, &t, &h, &q, body).await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn write_stream(gw: &Gw, t: &Target, q: &Option<String>, body: Body) -> Result<Value, UpErr> {
    let p = query(q, "path")
        .ok_or_else(|| UpErr::new(400, "invalid_argument", "path is required for a raw upload"))?;
    let path = sandbox_path(t, &p)?;
    let body = body.map_err(std::io::Error::other).boxed_unsync();
    let r = gw
        .up
        .open(
            Method::PUT,
            &t.path(&format!("/files?path={}", enc(&path))),
            &gw.cfg.service_key,
            Some("application/octet-stream"),
            body,
        )
        .await?;
    Ok(Value::Array(vec![written(r, &path).await]))
}

/// The `WriteInfo` of a file the API wrote (its answer names the absolute path).
async fn written(r: hyper::Response<hyper::body::Incoming>, path: &str) -> Value {
    let b = r
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let v: Value = serde_json::from_slice(&b).unwrap_or_default();
    let abs = v["path"].as_str().unwrap_or(path).to_string();
    let name = abs.rsplit('/').next().unwrap_or("").to_string();
    json!({"name": name, "type": "file", "path": abs})
}

async fn write_inner(
    gw: &Gw,
    t: &Target,
    h: &HeaderMap,
    q: &Option<String>,
    body: Bytes,
) -> Result<Value, UpErr> {
    let ct = header_str(h, "content-type").unwrap_or("");
    let body = match header_str(h, "content-encoding") {
        None | Some("identity") => body,
        Some("gzip") => gunzip(&body)?,
        Some(other) => {
            return Err(UpErr::new(
                400,
                "invalid_argument",
                format!("content encoding {other:?} is not supported"),
            ));
        }
    };
    let path_param = query(q, "path");
    let uploads: Vec<Upload> = if ct.starts_with("multipart/form-data") {
        let parts = multipart(ct, &body)?;
        if parts.len() == 1
            && let Some(p) = &path_param
        {
            vec![(
                p.clone(),
                parts.into_iter().next().map(|x| x.1).unwrap_or_default(),
            )]
        } else {
            parts
        }
    } else {
        let p = path_param.ok_or_else(|| {
            UpErr::new(400, "invalid_argument", "path is required for a raw upload")
        })?;
        vec![(p, body)]
    };
    if uploads.is_empty() {
        return Err(UpErr::new(400, "invalid_argument", "no file in the upload"));
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for (p, data) in uploads {
        let path = sandbox_path(t, &p)?;
        if !seen.insert(path.clone()) {
            return Err(UpErr::new(
                400,
                "invalid_argument",
                format!("{path} is written twice in one upload"),
            ));
        }
        let r = gw
            .up
            .open(
                Method::PUT,
                &t.path(&format!("/files?path={}", enc(&path))),
                &gw.cfg.service_key,
                Some("application/octet-stream"),
                full(data),
            )
            .await?;
        out.push(written(r, &path).await);
    }
    Ok(Value::Array(out))
}

fn gunzip(b: &[u8]) -> Result<Bytes, UpErr> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(b)
        .take(MAX_UPLOAD as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| UpErr::new(400, "invalid_argument", format!("gzip body: {e}")))?;
    if out.len() > MAX_UPLOAD {
        return Err(UpErr::new(
            413,
            "resource_exhausted",
            "the unpacked upload is over 64 MiB",
        ));
    }
    Ok(out.into())
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The `file` parts of a multipart body: (filename, bytes). The filename is the full path
/// (taken as written, never reduced to its last component).
pub(crate) fn multipart(ct: &str, body: &Bytes) -> Result<Vec<Upload>, UpErr> {
    let bad = |m: &str| UpErr::new(400, "invalid_argument", format!("multipart body: {m}"));
    let boundary = ct
        .split(';')
        .filter_map(|p| p.trim().strip_prefix("boundary="))
        .next()
        .map(|b| b.trim_matches('"'))
        .filter(|b| !b.is_empty() && b.len() <= 200)
        .ok_or_else(|| bad("no boundary"))?;
    let delim = format!("--{boundary}");
    let mut rest: &[u8] = body;
    let start = find(rest, delim.as_bytes()).ok_or_else(|| bad("no first boundary"))?;
    rest = &rest[start + delim.len()..];
    let sep = format!("\r\n--{boundary}");
    let mut out = Vec::new();
    loop {
        if rest.starts_with(b"--") {
            return Ok(out);
        }
        rest = rest
            .strip_prefix(b"\r\n")
            .ok_or_else(|| bad("boundary not followed by CRLF"))?;
        let hend = find(rest, b"\r\n\r\n").ok_or_else(|| bad("part headers not terminated"))?;
        let headers =
            std::str::from_utf8(&rest[..hend]).map_err(|_| bad("part headers not UTF-8"))?;
        let content = &rest[hend + 4..];
        let end = find(content, sep.as_bytes()).ok_or_else(|| bad("part not terminated"))?;
        let data = body.slice_ref(&content[..end]);
        rest = &content[end + sep.len()..];
        let mut name = None;
        let mut filename = None;
        for line in headers.split("\r\n") {
            let Some((k, v)) = line.split_once(':') else {
                continue;
            };
            if !k.trim().eq_ignore_ascii_case("content-disposition") {
                continue;
            }
            name = disposition_param(v, "name");
            filename = disposition_param(v, "filename");
        }
        if name.as_deref() != Some("file") {
            continue;
        }
        out.push((
            filename.ok_or_else(|| bad("a file part has no filename"))?,
            data,
        ));
        if out.len() > 10_000 {
            return Err(bad("more than 10000 files"));
        }
    }
}

/// A parameter of a `Content-Disposition` value (quoted, with `\"` escapes, or bare).
fn disposition_param(v: &str, key: &str) -> Option<String> {
    let mut s = v;
    while let Some(i) = s.find(';') {
        s = s[i + 1..].trim_start();
        let Some(after) = s
            .strip_prefix(key)
            .and_then(|a| a.trim_start().strip_prefix('='))
        else {
            continue;
        };
        let after = after.trim_start();
        if let Some(q) = after.strip_prefix('"') {
            let mut out = String::new();
            let mut chars = q.chars();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => out.push(chars.next()?),
                    '"' => return Some(pct_quotes(&out)),
                    c => out.push(c),
                }
            }
            return None;
        }
        return Some(after.split(';').next().unwrap_or("").trim().to_string());
    }
    None
}

/// Browsers' and the SDK's escapes for quotes and line breaks in a filename.
fn pct_quotes(s: &str) -> String {
    s.replace("%22", "\"")
        .replace("%0D", "\r")
        .replace("%0A", "\n")
}

/// `EntryInfo` for a stat.
fn entry(s: &FileStat) -> Value {
    let (ty, tchar) = match s.kind.as_str() {
        "file" => ("FILE_TYPE_FILE", '-'),
        "dir" => ("FILE_TYPE_DIRECTORY", 'd'),
        "symlink" => ("FILE_TYPE_SYMLINK", 'l'),
        _ => ("FILE_TYPE_UNSPECIFIED", '?'),
    };
    let mut perms = String::from(tchar);
    for shift in [6u32, 3, 0] {
        let b = (s.mode >> shift) & 7;
        perms.push(if b & 4 != 0 { 'r' } else { '-' });
        perms.push(if b & 2 != 0 { 'w' } else { '-' });
        perms.push(if b & 1 != 0 { 'x' } else { '-' });
    }
    let who = |id: u32| {
        if id == 0 {
            "root".to_string()
        } else {
            id.to_string()
        }
    };
    let mut e = json!({
        "name": s.name,
        "type": ty,
        "path": s.path,
        "size": s.size.to_string(),
        "mode": s.mode & 0o7777,
        "permissions": perms,
        "owner": who(s.uid),
        "group": who(s.gid),
        "modifiedTime": rfc3339(s.mtime_ms.max(0) as u64),
        "isSymlink": s.kind == "symlink",
    });
    if let Some(target) = &s.target {
        e["symlinkTarget"] = json!(target);
    }
    e
}

fn str_field<'a>(msg: &'a Value, name: &str) -> Result<&'a str, RpcErr> {
    msg[name]
        .as_str()
        .ok_or_else(|| RpcErr::new("invalid_argument", format!("{name} is required")))
}

fn path_field(t: &Target, msg: &Value, name: &str) -> Result<String, RpcErr> {
    sandbox_path(t, str_field(msg, name)?).map_err(RpcErr::from)
}

async fn stat(gw: &Gw, t: &Target, path: &str) -> Result<FileStat, UpErr> {
    gw.up
        .call(
            Method::GET,
            &t.path(&format!("/files/stat?path={}", enc(path))),
            &gw.cfg.service_key,
            None,
        )
        .await
}

/// The `filesystem.Filesystem` methods (the watchers are not supported yet).
pub(crate) async fn rpc(gw: &Gw, t: &Target, method: &str, msg: Value) -> RpcResult {
    let key = &gw.cfg.service_key;
    match method {
        "Stat" => {
            let p = path_field(t, &msg, "path")?;
            Ok(json!({"entry": entry(&stat(gw, t, &p).await?)}))
        }
        "ListDir" => {
            let p = path_field(t, &msg, "path")?;
            let depth = msg["depth"].as_u64().unwrap_or(1).clamp(1, 64);
            let s = stat(gw, t, &p).await?;
            if s.kind != "dir" {
                return Err(RpcErr::new(
                    "invalid_argument",
                    format!("{p} is not a directory"),
                ));
            }
            let v: Value = gw
                .up
                .call(
                    Method::GET,
                    &t.path(&format!("/files/list?path={}&depth={depth}", enc(&p))),
                    key,
                    None,
                )
                .await?;
            let entries: Vec<Value> = v["entries"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|e| serde_json::from_value::<FileStat>(e.clone()).ok())
                .filter(|e| e.path != s.path)
                .map(|e| entry(&e))
                .collect();
            Ok(json!({"entries": entries}))
        }
        "MakeDir" => {
            let p = path_field(t, &msg, "path")?;
            match stat(gw, t, &p).await {
                Ok(s) if s.kind == "dir" => {
                    return Err(RpcErr::new("already_exists", format!("{p} already exists")));
                }
                Ok(_) => {
                    return Err(RpcErr::new(
                        "invalid_argument",
                        format!("{p} exists and is not a directory"),
                    ));
                }
                Err(e) if e.status == 404 => {}
                Err(e) => return Err(e.into()),
            }
            let s: FileStat = gw
                .up
                .call(
                    Method::POST,
                    &t.path("/files/mkdir"),
                    key,
                    Some(json!({"path": p})),
                )
                .await?;
            Ok(json!({"entry": entry(&s)}))
        }
        "Move" => {
            let from = path_field(t, &msg, "source")?;
            let to = path_field(t, &msg, "destination")?;
            let s: FileStat = gw
                .up
                .call(
                    Method::POST,
                    &t.path("/files/rename"),
                    key,
                    Some(json!({"from": from, "to": to})),
                )
                .await?;
            Ok(json!({"entry": entry(&s)}))
        }
        "Remove" => {
            let p = path_field(t, &msg, "path")?;
            let r: Result<Value, UpErr> = gw
                .up
                .call(
                    Method::POST,
                    &t.path("/files/remove"),
                    key,
                    Some(json!({"path": p, "recursive": true})),
                )
                .await;
            match r {
                Ok(_) => Ok(json!({})),
                Err(e) if e.status == 404 => Ok(json!({})),
                Err(e) => Err(e.into()),
            }
        }
        _ => Err(RpcErr::new(
            "unimplemented",
            format!("filesystem.Filesystem/{method} is not supported by this gateway yet"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multipart_keeps_full_paths() {
        let body = Bytes::from_static(
            b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/home/user/d/a.txt\"\r\nContent-Type: text/plain\r\n\r\nhello\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"rel/b\\\"q.bin\"\r\n\r\n\x00\x01\r\n--XyZ--\r\n",
        );
        let parts = multipart("multipart/form-data; boundary=XyZ", &body).unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].0, "/home/user/d/a.txt");
        assert_eq!(&parts[0].1[..], b"hello");
        assert_eq!(parts[1].0, "rel/b\"q.bin");
        assert_eq!(&parts[1].1[..], b"\x00\x01");
    }

    #[test]
    fn malformed_multipart_is_an_error() {
        let ct = "multipart/form-data; boundary=B";
        for b in [
            &b""[..],
            b"--B\r\nContent-Disposition: form-data; name=\"file\"",
            b"--B\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nx\r\n--B--",
            b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n\r\nunterminated",
            b"--Bgarbage",
        ] {
            assert!(multipart(ct, &Bytes::copy_from_slice(b)).is_err(), "{b:?}");
        }
        assert!(multipart("multipart/form-data", &Bytes::new()).is_err());
    }

    #[test]
    fn paths_are_checked_and_tilde_expanded() {
        let t = Target {
            id: "local-x".into(),
            user: None,
        };
        assert_eq!(sandbox_path(&t, "~/a").unwrap(), "/root/a");
        assert_eq!(sandbox_path(&t, "~").unwrap(), "/root");
        assert_eq!(sandbox_path(&t, "rel").unwrap(), "rel");
        assert!(sandbox_path(&t, "").is_err());
        assert!(sandbox_path(&t, "a\0b").is_err());
        assert!(sandbox_path(&t, &"a".repeat(5000)).is_err());
        let u = Target {
            id: "local-x".into(),
            user: Some("bob".into()),
        };
        assert_eq!(sandbox_path(&u, "~/a").unwrap(), "/home/bob/a");
    }
}
