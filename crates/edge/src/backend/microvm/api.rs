//! A client for Firecracker's API: HTTP/1.1 on the VM's unix socket (`--api-sock`), one
//! request per connection, JSON bodies from the typed structs below. Success is 204 (or
//! 200 with JSON); an error is 400 with `{"fault_message": "..."}`, which becomes
//! [`ApiCallError::Fault`] naming the call. Every body leaves out optional fields that
//! are `None`, so only fields the probed version knows are sent (see
//! [`super::probe::Capabilities`]).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

/// Longest response header block accepted.
const MAX_HEADER: usize = 16 * 1024;
/// Longest response body accepted (GET /vm/config is a few KiB).
const MAX_BODY: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ApiCallError {
    #[error("Firecracker's API socket {path}: {source}")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error("{method} {path} to Firecracker: {source}")]
    Io {
        method: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("Firecracker refused {method} {path} ({status}): {message}")]
    Fault {
        method: &'static str,
        path: String,
        status: u16,
        message: String,
    },
    #[error("{method} {path}: Firecracker sent a malformed response: {why}")]
    Malformed {
        method: &'static str,
        path: String,
        why: String,
    },
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct MachineConfig {
    pub vcpu_count: u64,
    pub mem_size_mib: u64,
    pub smt: bool,
    pub track_dirty_pages: bool,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BootSource {
    pub kernel_image_path: PathBuf,
    pub boot_args: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub initrd_path: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Drive {
    pub drive_id: String,
    pub path_on_host: PathBuf,
    pub is_root_device: bool,
    pub is_read_only: bool,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct NetworkInterface {
    pub iface_id: String,
    pub host_dev_name: String,
    pub guest_mac: String,
    /// 1.16.0 and later.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Vsock {
    pub guest_cid: u32,
    pub uds_path: PathBuf,
}

/// `PUT /entropy` with no rate limiter.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Entropy {}

#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub enum ActionType {
    InstanceStart,
    FlushMetrics,
    SendCtrlAltDel,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Action {
    pub action_type: ActionType,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub enum RunState {
    Paused,
    Resumed,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Vm {
    pub state: RunState,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub enum SnapshotType {
    Full,
    Diff,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SnapshotCreate {
    pub snapshot_type: SnapshotType,
    pub snapshot_path: PathBuf,
    pub mem_file_path: PathBuf,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub enum MemBackendType {
    /// The memory file is mapped MAP_PRIVATE: copies share its pages until they write.
    File,
    Uffd,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct MemBackend {
    pub backend_type: MemBackendType,
    pub backend_path: PathBuf,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct NetworkOverride {
    pub iface_id: String,
    pub host_dev_name: String,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct VsockOverride {
    pub uds_path: PathBuf,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SnapshotLoad {
    pub snapshot_path: PathBuf,
    pub mem_backend: MemBackend,
    /// 1.13.0 and later (re-enables dirty page tracking after the load).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub track_dirty_pages: Option<bool>,
    pub resume_vm: bool,
    /// 1.12.0 and later.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network_overrides: Option<Vec<NetworkOverride>>,
    /// 1.16.0 and later: the vsock socket this process binds instead of the saved one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vsock_override: Option<VsockOverride>,
}

/// A Firecracker process's API.
#[derive(Debug, Clone)]
pub struct Client {
    sock: PathBuf,
    /// Longest any one call may take (a snapshot writes all guest memory).
    timeout: Duration,
}

impl Client {
    pub fn new(sock: &Path, timeout: Duration) -> Client {
        Client {
            sock: sock.to_path_buf(),
            timeout,
        }
    }

    /// Waits until Firecracker answers `GET /` (its socket appears right after it starts).
    pub fn wait_ready(&self, within: Duration) -> Result<Value, ApiCallError> {
        let t0 = Instant::now();
        loop {
            match self.get("/") {
                Ok(v) => return Ok(v),
                Err(ApiCallError::Connect { .. }) if t0.elapsed() < within => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(e),
            }
        }
    }

    pub fn get(&self, path: &str) -> Result<Value, ApiCallError> {
        self.call("GET", path, None)
    }

    pub fn put<T: Serialize>(&self, path: &str, body: &T) -> Result<Value, ApiCallError> {
        self.call("PUT", path, Some(self.encode("PUT", path, body)?))
    }

    pub fn patch<T: Serialize>(&self, path: &str, body: &T) -> Result<Value, ApiCallError> {
        self.call("PATCH", path, Some(self.encode("PATCH", path, body)?))
    }

    fn encode<T: Serialize>(
        &self,
        method: &'static str,
        path: &str,
        body: &T,
    ) -> Result<Vec<u8>, ApiCallError> {
        serde_json::to_vec(body).map_err(|e| ApiCallError::Malformed {
            method,
            path: path.into(),
            why: format!("encoding the request: {e}"),
        })
    }

    fn call(
        &self,
        method: &'static str,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Value, ApiCallError> {
        let mut s = UnixStream::connect(&self.sock).map_err(|source| ApiCallError::Connect {
            path: self.sock.display().to_string(),
            source,
        })?;
        let io = |source| ApiCallError::Io {
            method,
            path: path.into(),
            source,
        };
        s.set_read_timeout(Some(self.timeout)).map_err(io)?;
        s.set_write_timeout(Some(self.timeout)).map_err(io)?;
        let body = body.unwrap_or_default();
        let mut req =
            format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n");
        if method != "GET" {
            req.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                body.len()
            ));
        }
        req.push_str("\r\n");
        let mut msg = req.into_bytes();
        msg.extend_from_slice(&body);
        s.write_all(&msg).map_err(io)?;
        let (status, body) = read_response(&mut BufReader::new(s)).map_err(|e| match e {
            ReadError::Io(source) => ApiCallError::Io {
                method,
                path: path.into(),
                source,
            },
            ReadError::Bad(why) => ApiCallError::Malformed {
                method,
                path: path.into(),
                why,
            },
        })?;
        let value: Value = if body.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&body)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()))
        };
        if (200..300).contains(&status) {
            return Ok(value);
        }
        let message = value
            .get("fault_message")
            .and_then(Value::as_str)
            .map(String::from)
            .unwrap_or_else(|| match &value {
                Value::Null => "no reason given".into(),
                v => v.to_string(),
            });
        Err(ApiCallError::Fault {
            method,
            path: path.into(),
            status,
            message,
        })
    }
}

enum ReadError {
    Io(std::io::Error),
    Bad(String),
}

/// Reads one HTTP/1.1 response: its status and its body (by Content-Length).
fn read_response(r: &mut impl BufRead) -> Result<(u16, Vec<u8>), ReadError> {
    let mut line = String::new();
    let mut header_bytes = 0;
    r.read_line(&mut line).map_err(ReadError::Io)?;
    let status = line
        .strip_prefix("HTTP/1.")
        .and_then(|rest| rest.split_whitespace().nth(1))
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| ReadError::Bad(format!("status line {:?}", line.trim_end())))?;
    let mut length = 0usize;
    loop {
        line.clear();
        let n = r.read_line(&mut line).map_err(ReadError::Io)?;
        header_bytes += n;
        if n == 0 {
            return Err(ReadError::Bad(
                "the response ended inside its headers".into(),
            ));
        }
        if header_bytes > MAX_HEADER {
            return Err(ReadError::Bad("response headers too long".into()));
        }
        let h = line.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':')
            && k.trim().eq_ignore_ascii_case("content-length")
        {
            length = v
                .trim()
                .parse()
                .map_err(|_| ReadError::Bad(format!("Content-Length {:?}", v.trim())))?;
        }
    }
    if length > MAX_BODY {
        return Err(ReadError::Bad(format!("a body of {length} bytes")));
    }
    let mut body = vec![0u8; length];
    r.read_exact(&mut body).map_err(ReadError::Io)?;
    Ok((status, body))
}

/// An in-process stand-in for Firecracker's API socket, for tests: records every request
/// and answers from a script.
#[cfg(test)]
pub(crate) mod fake {
    use super::*;
    use std::io::Read;
    use std::os::unix::net::UnixListener;
    use std::sync::{Arc, Mutex};

    #[derive(Debug, Clone, PartialEq)]
    pub struct Seen {
        pub method: String,
        pub path: String,
        pub body: Value,
    }

    pub struct Server {
        pub sock: PathBuf,
        pub seen: Arc<Mutex<Vec<Seen>>>,
        _dir: tempfile::TempDir,
    }

    impl Server {
        /// Answers 204 to everything, except requests whose `METHOD path` is in `faults`,
        /// which get 400 with that fault message; `GET /` gets a state.
        pub fn start(faults: &[(&str, &str)]) -> Server {
            let dir = tempfile::tempdir().unwrap();
            let sock = dir.path().join("api.sock");
            let l = UnixListener::bind(&sock).unwrap();
            let seen = Arc::new(Mutex::new(Vec::new()));
            let faults: Vec<(String, String)> = faults
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect();
            let s2 = seen.clone();
            std::thread::spawn(move || {
                for c in l.incoming() {
                    let Ok(c) = c else { return };
                    serve_one(c, &s2, &faults);
                }
            });
            Server {
                sock,
                seen,
                _dir: dir,
            }
        }

        pub fn calls(&self) -> Vec<Seen> {
            self.seen.lock().unwrap().clone()
        }

        pub fn client(&self) -> Client {
            Client::new(&self.sock, Duration::from_secs(5))
        }
    }

    fn serve_one(c: UnixStream, seen: &Mutex<Vec<Seen>>, faults: &[(String, String)]) {
        let mut r = BufReader::new(c.try_clone().unwrap());
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        let mut words = line.split_whitespace();
        let (method, path) = (
            words.next().unwrap().to_string(),
            words.next().unwrap().to_string(),
        );
        let mut length = 0;
        loop {
            let mut h = String::new();
            r.read_line(&mut h).unwrap();
            if h.trim().is_empty() {
                break;
            }
            if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                length = v.trim().parse().unwrap();
            }
        }
        let mut body = vec![0u8; length];
        r.read_exact(&mut body).unwrap();
        let body = if body.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&body).unwrap()
        };
        let key = format!("{method} {path}");
        seen.lock().unwrap().push(Seen { method, path, body });
        let mut w = c;
        if let Some((_, msg)) = faults.iter().find(|(k, _)| *k == key) {
            let b = serde_json::json!({ "fault_message": msg }).to_string();
            let _ = write!(
                w,
                "HTTP/1.1 400 \r\nServer: Firecracker API\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
                b.len()
            );
        } else if key == "GET /" {
            let b = r#"{"id":"anonymous-instance","state":"Running","vmm_version":"1.16.1","app_name":"Firecracker"}"#;
            let _ = write!(
                w,
                "HTTP/1.1 200 \r\nServer: Firecracker API\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
                b.len()
            );
        } else {
            let _ = write!(w, "HTTP/1.1 204 \r\nServer: Firecracker API\r\n\r\n");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn requests_carry_method_path_and_json_body() {
        let srv = fake::Server::start(&[]);
        let c = srv.client();
        let v = c.wait_ready(Duration::from_secs(1)).unwrap();
        assert_eq!(v["state"], "Running");
        c.patch(
            "/vm",
            &Vm {
                state: RunState::Paused,
            },
        )
        .unwrap();
        let calls = srv.calls();
        assert_eq!(calls.len(), 2);
        assert_eq!(
            (calls[0].method.as_str(), calls[0].path.as_str()),
            ("GET", "/")
        );
        assert_eq!(calls[1].method, "PATCH");
        assert_eq!(calls[1].body, json!({"state": "Paused"}));
    }

    #[test]
    fn a_fault_message_becomes_a_clear_error() {
        let srv = fake::Server::start(&[(
            "PUT /snapshot/load",
            "Load snapshot error: Cannot bind vsock: Address already in use (os error 98)",
        )]);
        let e = srv
            .client()
            .put(
                "/snapshot/load",
                &SnapshotLoad {
                    snapshot_path: "vmstate".into(),
                    mem_backend: MemBackend {
                        backend_type: MemBackendType::File,
                        backend_path: "mem".into(),
                    },
                    track_dirty_pages: None,
                    resume_vm: true,
                    network_overrides: None,
                    vsock_override: None,
                },
            )
            .unwrap_err();
        assert!(
            matches!(e, ApiCallError::Fault { status: 400, .. }),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "Firecracker refused PUT /snapshot/load (400): Load snapshot error: Cannot bind vsock: Address already in use (os error 98)"
        );
    }

    #[test]
    fn no_socket_is_a_connect_error() {
        let d = tempfile::tempdir().unwrap();
        let c = Client::new(&d.path().join("none"), Duration::from_secs(1));
        let e = c.wait_ready(Duration::from_millis(50)).unwrap_err();
        assert!(e.to_string().contains("API socket"), "{e}");
    }

    #[test]
    fn responses_are_parsed_by_content_length() {
        let raw = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}trailing";
        let (status, body) = read_response(&mut &raw[..]).ok().unwrap();
        assert_eq!((status, body.as_slice()), (200, &b"{}"[..]));
        assert!(read_response(&mut &b"SSH-2.0\r\n\r\n"[..]).is_err());
        assert!(read_response(&mut &b"HTTP/1.1 204 \r\n"[..]).is_err());
    }
}
