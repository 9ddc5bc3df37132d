//! A streaming `multipart/form-data` reader: parts come one after another, each part's
//! data in chunks as the body arrives, so an upload of any size passes through in
//! bounded memory.

use bytes::{Buf, Bytes, BytesMut};
use futures_util::{Stream, StreamExt};

use crate::upstream::UpErr;

/// The most a part's headers may take.
const MAX_HEADERS: usize = 16 << 10;
/// The most bytes before the first boundary (a preamble).
const MAX_PREAMBLE: usize = 64 << 10;

fn bad(m: &str) -> UpErr {
    UpErr::new(400, "invalid_argument", format!("multipart body: {m}"))
}

/// A part's `Content-Disposition`: its field name and file name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PartHead {
    pub name: Option<String>,
    pub filename: Option<String>,
}

enum State {
    /// Before the first boundary.
    Start,
    /// Right after a boundary line's `--boundary`.
    Boundary,
    /// In a part's data.
    Data,
    /// After the closing boundary.
    End,
}

pub(crate) struct Multipart<S> {
    body: S,
    buf: BytesMut,
    /// `--boundary` (the first delimiter).
    first: Vec<u8>,
    /// `\r\n--boundary` (every later one).
    sep: Vec<u8>,
    state: State,
    eof: bool,
}

/// The boundary of a `multipart/form-data` content type.
pub(crate) fn boundary(ct: &str) -> Result<String, UpErr> {
    ct.split(';')
        .filter_map(|p| p.trim().strip_prefix("boundary="))
        .next()
        .map(|b| b.trim_matches('"'))
        .filter(|b| !b.is_empty() && b.len() <= 200)
        .map(str::to_string)
        .ok_or_else(|| bad("no boundary"))
}

/// Where `needle` starts in `hay`, searching from `from`.
fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    hay.get(from..)?
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|i| i + from)
}

/// Where the next search may start after one that failed: a match could still begin in
/// the last `needle - 1` bytes (so bodies sent in tiny pieces cost linear time).
fn resume(hay: &[u8], needle: &[u8]) -> usize {
    hay.len().saturating_sub(needle.len() - 1)
}

impl<S, E> Multipart<S>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    pub fn new(content_type: &str, body: S) -> Result<Self, UpErr> {
        let b = boundary(content_type)?;
        Ok(Multipart {
            body,
            buf: BytesMut::new(),
            first: format!("--{b}").into_bytes(),
            sep: format!("\r\n--{b}").into_bytes(),
            state: State::Start,
            eof: false,
        })
    }

    /// Reads more of the body; false at its end.
    async fn fill(&mut self) -> Result<bool, UpErr> {
        if self.eof {
            return Ok(false);
        }
        match self.body.next().await {
            Some(Ok(b)) => {
                self.buf.extend_from_slice(&b);
                Ok(true)
            }
            Some(Err(e)) => Err(UpErr::new(
                400,
                "invalid_argument",
                format!("reading the upload: {e}"),
            )),
            None => {
                self.eof = true;
                Ok(false)
            }
        }
    }

    /// Until `buf` holds `n` bytes; false if the body ends first.
    async fn want(&mut self, n: usize) -> Result<bool, UpErr> {
        while self.buf.len() < n {
            if !self.fill().await? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The next part's head, skipping what is left of the current part; None after the
    /// closing boundary.
    pub async fn next_part(&mut self) -> Result<Option<PartHead>, UpErr> {
        loop {
            match self.state {
                State::End => return Ok(None),
                State::Data => while self.chunk().await?.is_some() {},
                State::Start => {
                    let mut from = 0;
                    let at = loop {
                        if let Some(i) = find(&self.buf, &self.first, from) {
                            break i;
                        }
                        from = resume(&self.buf, &self.first);
                        if self.buf.len() > MAX_PREAMBLE || !self.fill().await? {
                            return Err(bad("no first boundary"));
                        }
                    };
                    self.buf.advance(at + self.first.len());
                    self.state = State::Boundary;
                }
                State::Boundary => {
                    if !self.want(2).await? {
                        return Err(bad("ends after a boundary"));
                    }
                    if self.buf.starts_with(b"--") {
                        self.state = State::End;
                        return Ok(None);
                    }
                    if !self.buf.starts_with(b"\r\n") {
                        return Err(bad("boundary not followed by CRLF"));
                    }
                    let mut from = 0;
                    let end = loop {
                        if let Some(i) = find(&self.buf, b"\r\n\r\n", from) {
                            break i;
                        }
                        from = resume(&self.buf, b"\r\n\r\n");
                        if self.buf.len() > MAX_HEADERS || !self.fill().await? {
                            return Err(bad("part headers not terminated"));
                        }
                    };
                    // (a part without headers has its empty line right after the CRLF)
                    let head = std::str::from_utf8(self.buf.get(2..end).unwrap_or_default())
                        .map_err(|_| bad("part headers not UTF-8"))?
                        .to_string();
                    self.buf.advance(end + 4);
                    self.state = State::Data;
                    return Ok(Some(parse_head(&head)));
                }
            }
        }
    }

    /// The current part's next chunk of data; None at its end.
    pub async fn chunk(&mut self) -> Result<Option<Bytes>, UpErr> {
        if !matches!(self.state, State::Data) {
            return Ok(None);
        }
        let mut from = 0;
        loop {
            if let Some(i) = find(&self.buf, &self.sep, from) {
                let data = self.buf.split_to(i).freeze();
                self.buf.advance(self.sep.len());
                self.state = State::Boundary;
                return Ok((!data.is_empty()).then_some(data));
            }
            // All but what could be the start of a boundary is data.
            let keep = self.sep.len() - 1;
            if self.buf.len() > keep + (64 << 10) {
                let n = self.buf.len() - keep;
                return Ok(Some(self.buf.split_to(n).freeze()));
            }
            from = resume(&self.buf, &self.sep);
            if !self.fill().await? {
                return Err(bad("part not terminated"));
            }
        }
    }
}

fn parse_head(head: &str) -> PartHead {
    let mut h = PartHead {
        name: None,
        filename: None,
    };
    for line in head.split("\r\n") {
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        if k.trim().eq_ignore_ascii_case("content-disposition") {
            h.name = disposition_param(v, "name");
            h.filename = disposition_param(v, "filename");
        }
    }
    h
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Fuzz target: any upload body, in any split, reads as parts or is refused.
    #[test]
    fn fuzz_bodies() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        bolero::check!()
            .with_iterations(crate::FUZZ_CASES)
            .for_each(|input: &[u8]| {
                let step = input.first().map(|b| *b as usize % 64 + 1).unwrap_or(1);
                let _ = rt.block_on(parts("multipart/form-data; boundary=xYz", input, step));
            });
    }

    /// All parts of `body`, fed in pieces of `step` bytes: (head, data).
    async fn parts(ct: &str, body: &[u8], step: usize) -> Result<Vec<(PartHead, Vec<u8>)>, UpErr> {
        let pieces: Vec<Result<Bytes, std::io::Error>> = body
            .chunks(step.max(1))
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let mut m = Multipart::new(ct, futures_util::stream::iter(pieces))?;
        let mut out = vec![];
        while let Some(h) = m.next_part().await? {
            let mut data = vec![];
            while let Some(c) = m.chunk().await? {
                data.extend_from_slice(&c);
            }
            out.push((h, data));
        }
        Ok(out)
    }

    #[tokio::test]
    async fn parts_keep_full_paths_whatever_the_chunking() {
        let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let mut body = b"preamble\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/home/user/d/a.txt\"\r\nContent-Type: text/plain\r\n\r\nhello\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"rel/b\\\"q.bin\"\r\n\r\n".to_vec();
        body.extend_from_slice(&big);
        body.extend_from_slice(b"\r\n--XyZ\r\nContent-Disposition: form-data; name=\"empty\"\r\n\r\n\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"c\"\r\n\r\n\r\n--X\r\n--XyZ--\r\n");
        for step in [1, 3, 7, 64, 4096, body.len()] {
            let p = parts("multipart/form-data; boundary=XyZ", &body, step)
                .await
                .unwrap();
            assert_eq!(p.len(), 4, "step {step}");
            assert_eq!(p[0].0.filename.as_deref(), Some("/home/user/d/a.txt"));
            assert_eq!(p[0].1, b"hello");
            assert_eq!(p[1].0.filename.as_deref(), Some("rel/b\"q.bin"));
            assert_eq!(p[1].1, big);
            assert_eq!(p[2].0.name.as_deref(), Some("empty"));
            assert!(p[2].1.is_empty());
            // data that looks like the start of a boundary is data
            assert_eq!(p[3].1, b"\r\n--X");
        }
    }

    #[tokio::test]
    async fn malformed_bodies_are_errors() {
        let ct = "multipart/form-data; boundary=B";
        for b in [
            &b""[..],
            b"--B\r\nContent-Disposition: form-data; name=\"file\"",
            b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n\r\nunterminated",
            b"--Bgarbage",
            b"--B",
            b"--B\r\n\r\nno headers, no end",
        ] {
            assert!(parts(ct, b, 2).await.is_err(), "{b:?}");
        }
        assert!(parts("multipart/form-data", b"", 1).await.is_err());
        // a part without headers is not a file
        let p = parts(ct, b"--B\r\n\r\nx\r\n--B--", 1).await.unwrap();
        assert_eq!(p[0].0.name, None);
        assert_eq!(p[0].1, b"x");
    }
}
