//! The edge ↔ aether channel protocol. Per connection: one JSON request line from the
//! edge, then frames in both directions: `[kind: u8][len: u32 big-endian][payload]`.
//! `J` frames carry one JSON [`Response`]; `O`/`E` carry stdout/stderr bytes; `D` carries
//! file or stdin bytes, a zero-length `D` ending the data. A unary reply that carries
//! output (an exec's or a session command's result) sends that output first as `O`/`E`
//! frames of at most [`CHUNK`] bytes and then the `J` reply with both strings empty (see
//! [`split_output`]), so no frame need be larger than [`MAX_FRAME`]. The listening socket
//! is created by the edge on the host and handed to aether as an inherited file
//! descriptor, so it has no path inside the sandbox.

use std::collections::BTreeMap;
use std::io::{Read, Write};

use serde::{Deserialize, Serialize};

use crate::ErrorCode;
use crate::api::{ExecResult, FileStat, ProcessInfo, SessionInfo, SessionResult};

/// The file descriptor number on which aether finds its listening socket.
pub const LISTEN_FD: i32 = 3;

/// Protocol version reported by `Pong`; bumped on incompatible changes. 3: unary replies
/// send their output as `O`/`E` frames ahead of the `J` (an edge reads version 2 replies,
/// output inside the `J`, as well).
pub const PROTOCOL_VERSION: u32 = 3;

pub const FRAME_JSON: u8 = b'J';
pub const FRAME_STDOUT: u8 = b'O';
pub const FRAME_STDERR: u8 = b'E';
pub const FRAME_DATA: u8 = b'D';

/// Largest frame either side accepts: output and data travel in [`CHUNK`]s, so only JSON
/// replies come near it (a directory listing is held below it by aether).
pub const MAX_FRAME: u32 = 16 << 20;
/// Most output per stream a unary reply may carry (the cap an edge may set on command
/// output; `O`/`E` bytes are text after lossy decoding, up to three times the bytes read).
pub const MAX_STREAM_OUTPUT: u64 = 64 << 20;
/// Size of the data chunks both sides send.
pub const CHUNK: usize = 256 << 10;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Ping,
    /// Runs a command to the end and answers with its result.
    Exec(ExecSpec),
    /// Starts a managed process; answers `Started`, then with `attach` streams like
    /// [`Request::Attach`].
    Start(StartSpec),
    /// Streams a process's kept output, then its live output, then `Exit`.
    Attach {
        pid: u32,
    },
    /// `D` frames follow with bytes for the process's stdin, ended by an empty one.
    Stdin {
        pid: u32,
        close: bool,
    },
    Signal {
        pid: u32,
        signal: i32,
    },
    Resize {
        pid: u32,
        cols: u16,
        rows: u16,
    },
    Processes,
    /// Answers `File`, then `D` frames, then an empty `D`.
    ReadFile {
        path: String,
    },
    /// `D` frames follow, ended by an empty one; answers `Written`.
    WriteFile {
        path: String,
        mode: Option<u32>,
        append: bool,
        /// Write as this user (name or uid from the sandbox's /etc/passwd): what it makes
        /// is theirs, and only what they may write is written. Default root.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<String>,
        /// The file's metadata after the write (replacing what it had); none: a write
        /// that truncates clears it, an append keeps it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        metadata: Option<std::collections::BTreeMap<String, String>>,
    },
    Stat {
        path: String,
    },
    List {
        path: String,
        depth: u32,
    },
    Exists {
        path: String,
    },
    /// Answers `Ok`, then the tree under `path` as described in [`crate::tree`] (entries
    /// in `D` frames; a top-level `.dsec`, the sandbox's own mount points, left out), then
    /// `Exported` or an error. For a commit of a VM's writable layer.
    ExportTree {
        path: String,
    },
    Mkdir {
        path: String,
        /// As [`Request::WriteFile`]'s `user`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<String>,
    },
    Remove {
        path: String,
        recursive: bool,
    },
    Rename {
        from: String,
        to: String,
    },
    Chmod {
        path: String,
        mode: u32,
    },
    Chown {
        path: String,
        uid: u32,
        gid: u32,
    },
    /// Answers `Ready`, then one `Event` per change until the edge closes the connection.
    Watch {
        path: String,
        recursive: bool,
        /// Each event carries the entry's stat as it is after the change (none for a
        /// removal).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        entry: bool,
        /// Watch a directory on a network filesystem (NFS, SMB, 9p, FUSE, …), where
        /// changes made elsewhere are not seen; refused otherwise.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        allow_network_mounts: bool,
    },
    SessionCreate {
        cwd: Option<String>,
        #[serde(default)]
        env: BTreeMap<String, String>,
        max_output_bytes: u64,
    },
    SessionList,
    SessionRun {
        session: String,
        cmd: String,
        timeout_ms: u64,
        background: bool,
    },
    SessionCommand {
        session: String,
        command: u64,
    },
    SessionKill {
        session: String,
    },
    /// Connects to a TCP port inside the sandbox; after `Ok` the connection carries the
    /// raw bytes of that TCP connection in both directions (no frames).
    Connect {
        port: u16,
    },
    /// The sandbox's memory was restored from a snapshot (a fork copy, or a resume): step
    /// the clock to `unix_ms`, mix `entropy` (hex) into the kernel's RNG and reseed it, so
    /// copies do not share random numbers, and take `sandbox_id` as the sandbox's id.
    Restored {
        sandbox_id: String,
        unix_ms: u64,
        entropy: String,
    },
    /// Sent once after a fresh start: the environment (image's, then the sandbox's) and
    /// working directory every command starts from. A container's agent was started with
    /// them already; a VM's init was not.
    Environment {
        env: BTreeMap<String, String>,
        #[serde(default)]
        workdir: Option<String>,
        /// A VM's volumes: virtio-fs devices to mount (before the working directory is
        /// made, which may be inside one). Mounting one already mounted changes nothing.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        mounts: Vec<GuestMount>,
    },
    /// The writable filesystem's use (`statvfs("/")`: for an overlay root, its upper
    /// layer's filesystem).
    DiskUsage,
}

/// A virtio-fs device (its tag) the guest mounts at `path`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestMount {
    pub tag: String,
    pub path: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ExecSpec {
    pub argv: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub cwd: Option<String>,
    /// A user name from the sandbox's /etc/passwd or a numeric uid.
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    #[serde(default)]
    pub stdin: Option<String>,
    /// Output beyond this many bytes per stream is dropped and reported as truncated.
    pub max_output_bytes: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StartSpec {
    #[serde(flatten)]
    pub exec: ExecSpec,
    #[serde(default)]
    pub pty: Option<PtySize>,
    #[serde(default)]
    pub tag: Option<String>,
    /// Stream the output on this connection after `Started`.
    #[serde(default)]
    pub attach: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PtySize {
    pub cols: u16,
    pub rows: u16,
}

/// Tagged by `reply` (payloads such as file stats and events have their own `type`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Response {
    Pong {
        version: u32,
        pid: u32,
    },
    DiskUsage {
        used_bytes: u64,
        total_bytes: u64,
    },
    Exec(ExecResult),
    Ok,
    Error {
        code: ErrorCode,
        message: String,
    },
    Started {
        pid: u32,
        /// The connection carries more requests once this process's stream has ended
        /// with its exit (or at once, for a process started without one); agents before
        /// it closed it.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        kept: bool,
    },
    Exit(ExecResult),
    Processes {
        processes: Vec<ProcessInfo>,
    },
    File {
        size: u64,
    },
    Written {
        path: String,
        size: u64,
    },
    Exported {
        entries: u64,
        bytes: u64,
    },
    Stat(FileStat),
    Entries {
        entries: Vec<FileStat>,
    },
    Exists {
        exists: bool,
    },
    Ready,
    Event(FsEvent),
    Session(SessionInfo),
    Sessions {
        sessions: Vec<SessionInfo>,
    },
    Command(SessionResult),
}

impl Response {
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Response {
        Response::Error {
            code,
            message: message.into(),
        }
    }
}

/// One change seen by a directory watch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FsEvent {
    /// `create`, `write`, `remove`, `rename` or `chmod`.
    #[serde(rename = "type")]
    pub kind: String,
    pub path: String,
    pub is_dir: bool,
    /// For `rename`: the old path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// The entry after the change, when the watch asked for it (and it is still there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entry: Option<crate::api::FileStat>,
}

/// The output strings of a reply that carries output (an exec's or a session command's
/// result): (stdout, stderr).
fn output_of(r: &mut Response) -> Option<(&mut String, &mut String)> {
    match r {
        Response::Exec(x) => Some((&mut x.stdout, &mut x.stderr)),
        Response::Command(x) => Some((&mut x.stdout, &mut x.stderr)),
        _ => None,
    }
}

/// Takes the output out of a reply that carries it, leaving both strings empty: (the
/// reply, stdout, stderr). The sender writes the output as `O`/`E` frames before the
/// reply; [`merge_output`] puts it back.
pub fn split_output(mut r: Response) -> (Response, String, String) {
    let (out, err) = output_of(&mut r)
        .map(|(o, e)| (std::mem::take(o), std::mem::take(e)))
        .unwrap_or_default();
    (r, out, err)
}

/// Puts output received as `O`/`E` frames ahead of a reply back into it. A reply that
/// carries its output itself (an agent of protocol 2) keeps it.
pub fn merge_output(mut r: Response, out: &[u8], err: &[u8]) -> Response {
    if let Some((o, e)) = output_of(&mut r) {
        for (s, b) in [(o, out), (e, err)] {
            if s.is_empty() && !b.is_empty() {
                *s = String::from_utf8_lossy(b).into_owned();
            }
        }
    }
    r
}

/// Writes a unary reply: its output (if it carries any) as `O`/`E` frames of at most
/// [`CHUNK`] bytes, then the reply itself.
pub fn write_reply(w: &mut impl Write, r: Response) -> std::io::Result<()> {
    let (r, out, err) = split_output(r);
    for (kind, text) in [(FRAME_STDOUT, &out), (FRAME_STDERR, &err)] {
        for piece in text.as_bytes().chunks(CHUNK) {
            write_frame(w, kind, piece)?;
        }
    }
    write_json(w, &r)
}

/// Writes one frame.
pub fn write_frame(w: &mut impl Write, kind: u8, payload: &[u8]) -> std::io::Result<()> {
    let mut head = [0u8; 5];
    head[0] = kind;
    head[1..].copy_from_slice(&(payload.len() as u32).to_be_bytes());
    w.write_all(&head)?;
    w.write_all(payload)
}

pub fn write_json(w: &mut impl Write, r: &Response) -> std::io::Result<()> {
    let body = serde_json::to_vec(r).map_err(std::io::Error::other)?;
    write_frame(w, FRAME_JSON, &body)
}

/// Reads one frame; `None` at a clean end of stream.
pub fn read_frame(r: &mut impl Read) -> std::io::Result<Option<(u8, Vec<u8>)>> {
    let mut head = [0u8; 5];
    match r.read_exact(&mut head) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]);
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {len} bytes is over the {MAX_FRAME}-byte limit"),
        ));
    }
    // Grown as bytes arrive, never sized by the header alone.
    let mut body = Vec::with_capacity((len as usize).min(1 << 20));
    let got = r.take(len as u64).read_to_end(&mut body)?;
    if got != len as usize {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(Some((head[0], body)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fuzz target (`cargo bolero test channel::tests::fuzz_frames`); under `cargo test`
    /// a bounded property test: any bytes from a sandbox's agent read as frames and
    /// replies without a panic or an allocation the bytes did not pay for.
    #[test]
    fn fuzz_frames() {
        bolero::check!()
            .with_iterations(crate::FUZZ_CASES)
            .for_each(|input: &[u8]| {
                let mut r = input;
                while let Ok(Some((_, body))) = read_frame(&mut r) {
                    let _ = serde_json::from_slice::<Response>(&body);
                    let _ = serde_json::from_slice::<Request>(&body);
                }
            });
    }

    #[test]
    fn requests_round_trip_as_one_json_line() {
        let r = Request::Exec(ExecSpec {
            argv: vec!["sh".into(), "-c".into(), "echo hi\nthere".into()],
            env: BTreeMap::from([("A".into(), "1".into())]),
            cwd: Some("/tmp".into()),
            timeout_ms: Some(5),
            max_output_bytes: 10,
            ..Default::default()
        });
        let line = serde_json::to_string(&r).unwrap();
        assert!(!line.contains('\n'));
        assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), r);
        let p: Request = serde_json::from_str(r#"{"op":"ping"}"#).unwrap();
        assert_eq!(p, Request::Ping);
        let s = Request::Start(StartSpec {
            exec: ExecSpec {
                argv: vec!["bash".into()],
                max_output_bytes: 1,
                ..Default::default()
            },
            pty: Some(PtySize { cols: 80, rows: 24 }),
            tag: None,
            attach: true,
        });
        let line = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), s);
    }

    #[test]
    fn frames_round_trip_and_oversized_frames_are_refused() {
        let mut buf = Vec::new();
        write_frame(&mut buf, FRAME_STDOUT, b"abc").unwrap();
        write_json(&mut buf, &Response::Ok).unwrap();
        let mut r = &buf[..];
        assert_eq!(
            read_frame(&mut r).unwrap(),
            Some((FRAME_STDOUT, b"abc".to_vec()))
        );
        let (k, body) = read_frame(&mut r).unwrap().unwrap();
        assert_eq!(k, FRAME_JSON);
        assert_eq!(
            serde_json::from_slice::<Response>(&body).unwrap(),
            Response::Ok
        );
        assert_eq!(read_frame(&mut r).unwrap(), None);
        let mut big = vec![FRAME_DATA];
        big.extend_from_slice(&(MAX_FRAME + 1).to_be_bytes());
        assert!(read_frame(&mut &big[..]).is_err());
    }

    /// An exec result with 40 MiB of output travels in frames of at most a chunk, and
    /// comes back whole.
    #[test]
    fn a_big_result_goes_in_chunks_and_comes_back_whole() {
        let r = Response::Exec(ExecResult {
            stdout: "o\u{1}".repeat(20 << 20),
            stderr: "e".repeat(300 << 10),
            exit_code: 3,
            ..Default::default()
        });
        let mut buf = Vec::new();
        write_reply(&mut buf, r.clone()).unwrap();
        let (mut rd, mut out, mut err) = (&buf[..], Vec::new(), Vec::new());
        let back = loop {
            let (k, body) = read_frame(&mut rd).unwrap().unwrap();
            assert!(body.len() <= CHUNK, "a {}-byte frame", body.len());
            match k {
                FRAME_STDOUT => out.extend_from_slice(&body),
                FRAME_STDERR => err.extend_from_slice(&body),
                FRAME_JSON => break serde_json::from_slice::<Response>(&body).unwrap(),
                other => panic!("frame {other}"),
            }
        };
        assert!(matches!(&back, Response::Exec(x) if x.stdout.is_empty()));
        assert_eq!(merge_output(back, &out, &err), r);
        // A reply of protocol 2, output inside, keeps it.
        let old = Response::Exec(ExecResult {
            stdout: "in".into(),
            ..Default::default()
        });
        assert_eq!(merge_output(old.clone(), b"", b""), old);
    }
}
