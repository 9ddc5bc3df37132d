//! envd's files: `GET`/`POST /files` and the `filesystem.Filesystem` RPCs, on OpenDsec's
//! files API.

use std::collections::BTreeMap;

use axum::body::{Body, Bytes};
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use dsec_common::api::{FileStat, StringMap};
use http_body_util::BodyExt;
use hyper::Method;
use serde_json::{Value, json};

use crate::control::{query_pairs, rfc3339};
use crate::envd::{RpcErr, RpcResult, Signed, Target, target_signed};
use crate::multipart::Multipart;
use crate::upstream::{UpErr, enc, full};
use crate::{GunzipError, Gw, e2b_error, header_str};

/// The largest gzip upload, packed and unpacked (it is unpacked in memory; plain uploads
/// stream through whatever their size).
const MAX_UPLOAD: usize = 64 << 20;
/// The most files one multipart upload may write.
const MAX_FILES: usize = 10_000;
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
    // As envd: `~` and relative paths are the user's home and under it.
    Ok(if p == "~" {
        t.home()
    } else if let Some(rest) = p.strip_prefix("~/") {
        format!("{}/{rest}", t.home())
    } else if !p.starts_with('/') {
        format!("{}/{p}", t.home())
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

/// The signature of a signed file URL, if the query has one.
fn signed(q: &Option<String>, op: &'static str) -> Option<Signed> {
    Some(Signed {
        path: query(q, "path").unwrap_or_default(),
        op,
        signature: query(q, "signature")?,
        expiration: query(q, "signature_expiration").and_then(|e| e.parse().ok()),
    })
}

/// `GET /files?path=&username=[&signature=&signature_expiration=]`: the file's bytes,
/// streamed.
pub(crate) async fn read(State(gw): State<Gw>, h: HeaderMap, RawQuery(q): RawQuery) -> Response {
    let t = match target_signed(&gw, &h, query(&q, "username"), signed(&q, "read")).await {
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

/// `POST /files`: multipart (one part per file, the filename the full path; a `path`
/// query names the first file's) or a raw body (`path` required), streamed through in
/// bounded memory whatever the size; `Content-Encoding: gzip` bodies are unpacked (up to
/// 64 MiB).
pub(crate) async fn write(
    State(gw): State<Gw>,
    h: HeaderMap,
    RawQuery(q): RawQuery,
    body: Body,
) -> Response {
    let sig = signed(&q, "write");
    // A signed URL (no header token) writes the one path it signs, whatever the parts say.
    let bound = sig.is_some() && header_str(&h, "x-access-token").is_none();
    let t = match target_signed(&gw, &h, query(&q, "username"), sig).await {
        Ok(t) => t,
        Err(r) => return r,
    };
    let meta = match metadata(&h) {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    let (gw, t) = (&gw, &Put { t: &t, meta: &meta });
    let ct = header_str(&h, "content-type").unwrap_or("");
    let multi = ct.starts_with("multipart/form-data");
    let r = match header_str(&h, "content-encoding") {
        None | Some("identity") if multi => {
            write_multipart(gw, t, ct, &q, bound, body.into_data_stream()).await
        }
        None | Some("identity") => write_stream(gw, t, &q, body).await,
        Some("gzip") => match axum::body::to_bytes(body, MAX_UPLOAD).await {
            Err(_) => Err(UpErr::new(
                413,
                "resource_exhausted",
                format!("a gzip upload is at most {} MiB", MAX_UPLOAD >> 20),
            )),
            Ok(b) => match gunzip(&b) {
                Err(e) => Err(e),
                Ok(data) if multi => {
                    let one = futures_util::stream::iter([Ok::<_, std::convert::Infallible>(data)]);
                    write_multipart(gw, t, ct, &q, bound, one).await
                }
                Ok(data) => write_stream(gw, t, &q, Body::from(data)).await,
            },
        },
        Some(other) => Err(UpErr::new(
            400,
            "invalid_argument",
            format!("content encoding {other:?} is not supported"),
        )),
    };
    match r {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Header prefix of a file's metadata on an envd upload: `X-Metadata-<key>: <value>`.
const METADATA_HEADER: &str = "x-metadata-";

/// The metadata an upload gives each of its files (checked as the API checks it, so a
/// bad key is refused before the body is read).
fn metadata(h: &HeaderMap) -> Result<StringMap, UpErr> {
    let mut m = BTreeMap::new();
    for (name, value) in h {
        if let Some(key) = name.as_str().strip_prefix(METADATA_HEADER) {
            let v = value.to_str().map_err(|_| {
                UpErr::new(
                    400,
                    "invalid_argument",
                    format!("the value of metadata key {key:?} must be printable US-ASCII"),
                )
            })?;
            m.insert(key.to_string(), v.to_string());
        }
    }
    dsec_common::api::check_metadata(&m)
        .map_err(|e| UpErr::new(400, "invalid_argument", e.message))?;
    Ok(m)
}

/// Where an upload's files go: the sandbox, and the metadata each file gets.
struct Put<'a> {
    t: &'a Target,
    meta: &'a BTreeMap<String, String>,
}

async fn write_stream(
    gw: &Gw,
    t: &Put<'_>,
    q: &Option<String>,
    body: Body,
) -> Result<Value, UpErr> {
    let p = query(q, "path")
        .ok_or_else(|| UpErr::new(400, "invalid_argument", "path is required for a raw upload"))?;
    let path = sandbox_path(t.t, &p)?;
    let body = body.map_err(std::io::Error::other).boxed_unsync();
    Ok(Value::Array(vec![put(gw, t.t, t.meta, path, body).await?]))
}

/// Writes one file from a streamed body; its `WriteInfo`.
async fn put(
    gw: &Gw,
    t: &Target,
    meta: &BTreeMap<String, String>,
    path: String,
    body: crate::upstream::Body,
) -> Result<Value, UpErr> {
    let headers: Vec<(String, String)> = meta
        .iter()
        .map(|(k, v)| (format!("x-dsec-metadata-{k}"), v.clone()))
        .collect();
    let r = gw
        .up
        .open_with(
            Method::PUT,
            &t.path(&format!("/files?path={}{}", enc(&path), t.user_query())),
            &gw.cfg.service_key,
            Some("application/octet-stream"),
            &headers,
            body,
        )
        .await?;
    Ok(written(r, &path, meta).await)
}

/// The `WriteInfo` of a file the API wrote (its answer names the absolute path).
async fn written(
    r: hyper::Response<crate::upstream::UpBody>,
    path: &str,
    meta: &BTreeMap<String, String>,
) -> Value {
    let b = r
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let v: Value = serde_json::from_slice(&b).unwrap_or_default();
    let abs = v["path"].as_str().unwrap_or(path).to_string();
    let name = abs.rsplit('/').next().unwrap_or("").to_string();
    let mut info = json!({"name": name, "type": "file", "path": abs});
    if !meta.is_empty() {
        info["metadata"] = json!(meta);
    }
    info
}

/// Each `file` part of a multipart body is written as it arrives, one after another.
/// `bound` (a signed URL): one part only, written to the signed `path`.
async fn write_multipart<S, E>(
    gw: &Gw,
    put_to: &Put<'_>,
    ct: &str,
    q: &Option<String>,
    bound: bool,
    body: S,
) -> Result<Value, UpErr>
where
    S: futures_util::Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let t = put_to.t;
    let mut m = Multipart::new(ct, body)?;
    let mut path_param = query(q, "path");
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    while let Some(head) = m.next_part().await? {
        if head.name.as_deref() != Some("file") {
            continue;
        }
        if bound && !out.is_empty() {
            return Err(UpErr::new(
                400,
                "invalid_argument",
                "a signed upload URL writes one file, the path it was signed for; this body has more file parts",
            ));
        }
        let filename = if bound { None } else { head.filename };
        let p = match path_param.take().or(filename) {
            Some(p) => p,
            None => {
                return Err(UpErr::new(
                    400,
                    "invalid_argument",
                    "multipart body: a file part has no filename",
                ));
            }
        };
        let path = sandbox_path(t, &p)?;
        if !seen.insert(path.clone()) {
            return Err(UpErr::new(
                400,
                "invalid_argument",
                format!("{path} is written twice in one upload"),
            ));
        }
        if out.len() >= MAX_FILES {
            return Err(UpErr::new(
                400,
                "invalid_argument",
                format!("more than {MAX_FILES} files in one upload"),
            ));
        }
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
        let data = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv()
                .await
                .map(|c| (c.map(hyper::body::Frame::data), rx))
        });
        let body = http_body_util::StreamBody::new(data).boxed_unsync();
        let (gw2, t2, meta) = (gw.clone(), t.clone(), put_to.meta.clone());
        let writing = tokio::spawn(async move { put(&gw2, &t2, &meta, path, body).await });
        let fed = async {
            while let Some(c) = m.chunk().await? {
                if tx.send(Ok(c)).await.is_err() {
                    break; // the write failed; its error is below
                }
            }
            Ok::<(), UpErr>(())
        }
        .await;
        if let Err(e) = &fed {
            let _ = tx.send(Err(std::io::Error::other(e.message.clone()))).await;
        }
        drop(tx);
        let w = writing
            .await
            .map_err(|e| UpErr::new(500, "internal", format!("writing the file: {e}")));
        fed?;
        out.push(w??);
    }
    if out.is_empty() {
        return Err(UpErr::new(400, "invalid_argument", "no file in the upload"));
    }
    Ok(Value::Array(out))
}

fn gunzip(b: &[u8]) -> Result<Bytes, UpErr> {
    match crate::gunzip(b, MAX_UPLOAD) {
        Ok(out) => Ok(out.into()),
        Err(GunzipError::Bad(e)) => Err(UpErr::new(
            400,
            "invalid_argument",
            format!("gzip body: {e}"),
        )),
        Err(GunzipError::TooLarge) => Err(UpErr::new(
            413,
            "resource_exhausted",
            "the unpacked upload is over 64 MiB",
        )),
    }
}

/// `EntryInfo` for a stat.
pub(crate) fn entry(s: &FileStat) -> Value {
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
    if !s.metadata.is_empty() {
        e["metadata"] = json!(s.metadata);
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
                    Some(match &t.user {
                        Some(u) => json!({"path": p, "user": u}),
                        None => json!({"path": p}),
                    }),
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
    fn paths_are_checked_and_tilde_expanded() {
        let t = Target {
            id: "local-x".into(),
            user: None,
        };
        assert_eq!(sandbox_path(&t, "~/a").unwrap(), "/root/a");
        assert_eq!(sandbox_path(&t, "~").unwrap(), "/root");
        assert_eq!(sandbox_path(&t, "rel").unwrap(), "/root/rel");
        assert!(sandbox_path(&t, "").is_err());
        assert!(sandbox_path(&t, "a\0b").is_err());
        assert!(sandbox_path(&t, &"a".repeat(5000)).is_err());
        let u = Target {
            id: "local-x".into(),
            user: Some("bob".into()),
        };
        assert_eq!(sandbox_path(&u, "~/a").unwrap(), "/home/bob/a");
        assert_eq!(sandbox_path(&u, "a.txt").unwrap(), "/home/bob/a.txt");
        assert_eq!(sandbox_path(&u, "/etc/x").unwrap(), "/etc/x");
    }
}
