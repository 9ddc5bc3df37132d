//! Connect protocol framing (JSON codec): the 5-byte envelope of streaming messages
//! (flags, big-endian length, payload), end-of-stream frames and error bodies.

use serde_json::{Value, json};

/// Flag of a message compressed with the negotiated encoding (the gateway accepts none).
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Flag of the end-of-stream frame (server to client).
pub const FLAG_END: u8 = 0x02;
/// The largest message the gateway accepts in an envelope.
pub const MAX_MESSAGE: usize = 4 << 20;

/// Content type of streaming requests and responses (exactly this: clients compare it).
pub const STREAM_CT: &str = "application/connect+json";

#[derive(Debug, PartialEq, Eq)]
pub enum FrameError {
    /// Fewer bytes than the header or the length it states.
    Truncated,
    TooLarge(usize),
    Compressed,
    /// A flag no client sends.
    BadFlags(u8),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Truncated => write!(f, "truncated Connect envelope"),
            FrameError::TooLarge(n) => {
                write!(f, "Connect message of {n} bytes is over {MAX_MESSAGE}")
            }
            FrameError::Compressed => write!(f, "compressed Connect messages are not supported"),
            FrameError::BadFlags(b) => write!(f, "unknown Connect envelope flags {b:#04x}"),
        }
    }
}

/// One enveloped message.
pub fn encode(flags: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + payload.len());
    out.push(flags);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// A message frame carrying `v`.
pub fn message(v: &Value) -> Vec<u8> {
    encode(0, v.to_string().as_bytes())
}

/// The end-of-stream frame: `{}`, or `{"error":{code,message}}`.
pub fn end(error: Option<(&str, &str)>) -> Vec<u8> {
    let v = match error {
        None => json!({}),
        Some((code, msg)) => json!({"error": {"code": connect_code(code), "message": msg}}),
    };
    encode(FLAG_END, v.to_string().as_bytes())
}

/// Splits a request body into its messages. Every frame must be a whole, uncompressed
/// message frame of at most [`MAX_MESSAGE`] bytes.
pub fn decode_all(mut buf: &[u8]) -> Result<Vec<&[u8]>, FrameError> {
    let mut out = Vec::new();
    while !buf.is_empty() {
        if buf.len() < 5 {
            return Err(FrameError::Truncated);
        }
        let flags = buf[0];
        let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
        if flags & FLAG_COMPRESSED != 0 {
            return Err(FrameError::Compressed);
        }
        if flags != 0 {
            return Err(FrameError::BadFlags(flags));
        }
        if len > MAX_MESSAGE {
            return Err(FrameError::TooLarge(len));
        }
        if buf.len() - 5 < len {
            return Err(FrameError::Truncated);
        }
        out.push(&buf[5..5 + len]);
        buf = &buf[5 + len..];
    }
    Ok(out)
}

/// The one message of a server-streaming request body.
pub fn single(buf: &[u8]) -> Result<Value, (String, String)> {
    let frames = decode_all(buf).map_err(|e| {
        let code = match e {
            FrameError::TooLarge(_) => "resource_exhausted",
            _ => "invalid_argument",
        };
        (code.to_string(), e.to_string())
    })?;
    let [m] = frames.as_slice() else {
        return Err((
            "invalid_argument".into(),
            format!("expected one request message, got {}", frames.len()),
        ));
    };
    serde_json::from_slice(m).map_err(|e| {
        (
            "invalid_argument".into(),
            format!("request is not JSON: {e}"),
        )
    })
}

/// The OpenDsec error code as a Connect code (the same names, but for the few Connect
/// lacks).
pub fn connect_code(code: &str) -> &str {
    match code {
        "invalid_argument"
        | "unauthenticated"
        | "permission_denied"
        | "not_found"
        | "already_exists"
        | "failed_precondition"
        | "resource_exhausted"
        | "unimplemented"
        | "unavailable"
        | "deadline_exceeded"
        | "internal"
        | "canceled"
        | "aborted"
        | "out_of_range"
        | "data_loss" => code,
        _ => "unknown",
    }
}

/// The HTTP status of a unary Connect error.
pub fn http_status(code: &str) -> u16 {
    match connect_code(code) {
        "canceled" => 499,
        "invalid_argument" | "failed_precondition" | "out_of_range" => 400,
        "deadline_exceeded" => 504,
        "not_found" => 404,
        "already_exists" | "aborted" => 409,
        "permission_denied" => 403,
        "resource_exhausted" => 429,
        "unimplemented" => 501,
        "unavailable" => 503,
        "unauthenticated" => 401,
        _ => 500,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fuzz target: any request body reads as Connect envelopes, or is refused.
    #[test]
    fn fuzz_envelopes() {
        bolero::check!()
            .with_iterations(crate::FUZZ_CASES)
            .for_each(|input: &[u8]| {
                let _ = decode_all(input);
                let _ = single(input);
            });
    }

    #[test]
    fn frames_round_trip() {
        let mut body = message(&json!({"a": 1}));
        body.extend(message(&json!({"b": "x"})));
        let frames = decode_all(&body).unwrap();
        assert_eq!(frames, vec![&br#"{"a":1}"#[..], &br#"{"b":"x"}"#[..]]);
        assert_eq!(decode_all(&[]).unwrap().len(), 0);
        let e = end(None);
        assert_eq!(e[0], FLAG_END);
        assert_eq!(&e[5..], b"{}");
        let e = end(Some(("not_found", "gone")));
        let v: Value = serde_json::from_slice(&e[5..]).unwrap();
        assert_eq!(v["error"]["code"], "not_found");
        let e = end(Some(("weird", "x")));
        let v: Value = serde_json::from_slice(&e[5..]).unwrap();
        assert_eq!(v["error"]["code"], "unknown");
    }

    #[test]
    fn malformed_frames_are_errors() {
        assert_eq!(decode_all(&[0, 0, 0]), Err(FrameError::Truncated));
        assert_eq!(
            decode_all(&[0, 0, 0, 0, 9, b'{']),
            Err(FrameError::Truncated)
        );
        assert_eq!(decode_all(&[1, 0, 0, 0, 0]), Err(FrameError::Compressed));
        assert_eq!(decode_all(&[2, 0, 0, 0, 0]), Err(FrameError::BadFlags(2)));
        assert_eq!(
            decode_all(&[0, 0xff, 0xff, 0xff, 0xff]),
            Err(FrameError::TooLarge(u32::MAX as usize))
        );
        // a good frame followed by garbage
        let mut b = message(&json!({}));
        b.push(0);
        assert_eq!(decode_all(&b), Err(FrameError::Truncated));
        assert!(single(&[]).is_err());
        let mut two = message(&json!({}));
        two.extend(message(&json!({})));
        assert!(single(&two).is_err());
        assert!(single(&encode(0, b"not json")).is_err());
        assert_eq!(single(&message(&json!({"x": 1}))).unwrap()["x"], 1);
    }

    #[test]
    fn codes_map_to_statuses() {
        assert_eq!(http_status("not_found"), 404);
        assert_eq!(http_status("failed_precondition"), 400);
        assert_eq!(http_status("resource_exhausted"), 429);
        assert_eq!(http_status("nonsense"), 500);
    }
}
