//! The edge ↔ aether channel protocol: one JSON request line, one JSON response line, per
//! connection. The listening socket is created by the edge on the host and handed to aether
//! as an inherited file descriptor, so it has no path inside the sandbox.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::api::ExecResult;

/// The file descriptor number on which aether finds its listening socket.
pub const LISTEN_FD: i32 = 3;

/// Protocol version reported by `Pong`; bumped on incompatible changes.
pub const PROTOCOL_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Ping,
    Exec(ExecSpec),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecSpec {
    pub argv: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    #[serde(default)]
    pub stdin: Option<String>,
    /// Output beyond this many bytes per stream is dropped and reported as truncated.
    pub max_output_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Response {
    Pong { version: u32, pid: u32 },
    Exec(ExecResult),
    Error { message: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_as_one_json_line() {
        let r = Request::Exec(ExecSpec {
            argv: vec!["sh".into(), "-c".into(), "echo hi\nthere".into()],
            env: BTreeMap::from([("A".into(), "1".into())]),
            cwd: Some("/tmp".into()),
            timeout_ms: Some(5),
            stdin: None,
            max_output_bytes: 10,
        });
        let line = serde_json::to_string(&r).unwrap();
        assert!(!line.contains('\n'));
        assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), r);
        let p: Request = serde_json::from_str(r#"{"op":"ping"}"#).unwrap();
        assert_eq!(p, Request::Ping);
    }
}
