//! Many channel connections over one byte stream: how the edge reaches aether in a VM,
//! whose only link to the host is one virtio-serial port (a port opens once and carries
//! one stream; these hosts have no vsock).
//!
//! Each logical connection is a stream with an id, bridged on both ends to a local unix
//! socket: on the host, a connection accepted on the sandbox's `aether.sock` (so the edge
//! talks to a VM exactly as to a container); in the guest, one end of a socketpair whose
//! other end aether serves like any connection. Frames are `[kind u8][stream u32][len
//! u32][payload]`, big-endian. A sender may have at most [`WINDOW`] bytes of a stream
//! unacknowledged; the receiver grants more as its local socket takes them, so a slow
//! reader stalls only its own stream, never the link, and memory stays bounded: a peer
//! that sends past the window it was granted has the stream closed (the guest is not
//! trusted to keep to it).
//!
//! A VM can be stopped with half a frame read (its memory saved, then restored in a fork
//! copy or after a pause to disk) and a new host end then joins mid-stream, in both
//! directions. So each host connection starts with [`FILLER`] bytes of `0xFF` (longer than
//! any frame, never a frame kind) and a RESET carrying a random nonce: whatever half frame
//! the guest was in is completed or rejected, after which it skips `0xFF`s and reads the
//! RESET. The guest answers with the same filler and RESET, and the host ignores
//! everything before that exact RESET (the tail of a frame the guest began for an
//! earlier host).

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex};

/// Bytes a stream may have in flight before the receiver grants more.
pub const WINDOW: u32 = 256 * 1024;
/// Largest payload of one DATA frame.
pub const MAX_DATA: usize = 32 * 1024;

const OPEN: u8 = 1;
const DATA: u8 = 2;
const EOF: u8 = 3;
const WINDOW_UPDATE: u8 = 4;
const CLOSE: u8 = 5;
/// The host side (re)connected: every earlier stream is gone.
const RESET: u8 = 6;

const HEADER: usize = 9;
/// Never a frame kind: filler between frames after a (re)connect.
const SYNC: u8 = 0xFF;
/// Filler sent before a RESET: more than the longest frame.
pub const FILLER: usize = MAX_DATA + HEADER + 1;
const NONCE: usize = 16;

const IN_DONE: u8 = 1;
const OUT_DONE: u8 = 2;

struct Stream {
    /// Which directions have ended ([`IN_DONE`], [`OUT_DONE`]); with both, the stream goes.
    done: Mutex<u8>,
    /// Bytes this side may still send.
    credit: Mutex<u32>,
    credit_cv: Condvar,
    /// Incoming payloads, in order, for the writer thread. Unbounded as a queue, but
    /// `queued` holds it to a window of bytes; the link's reader never waits.
    incoming: Sender<Option<Vec<u8>>>,
    /// Bytes received and not yet written to the local socket (granted back as written).
    queued: Arc<AtomicU32>,
    local: UnixStream,
}

struct Inner {
    link: Mutex<Box<dyn Write + Send>>,
    streams: Mutex<HashMap<u32, Arc<Stream>>>,
    next_id: AtomicU32,
    /// Host side: the RESET the guest must echo before its frames count.
    awaiting: Mutex<Option<Vec<u8>>>,
    /// Guest side: where streams the host opens are handed (the local end to serve).
    on_open: Option<Box<dyn Fn(UnixStream) + Send + Sync>>,
}

/// One end of the multiplexed link. Cheap to clone.
#[derive(Clone)]
pub struct Mux {
    inner: Arc<Inner>,
}

fn frame(kind: u8, id: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(HEADER + payload.len());
    f.push(kind);
    f.extend_from_slice(&id.to_be_bytes());
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    f
}

impl Mux {
    /// The host end: streams are opened with [`Mux::open`]. Tells the guest to forget any
    /// streams of an earlier host connection.
    pub fn host(link: Box<dyn Write + Send>) -> io::Result<Mux> {
        let m = Mux::new(link, None);
        let mut nonce = [0u8; NONCE];
        crate::id::fill_random(&mut nonce);
        // Stream ids start at a random point, so a late frame of a stream that an earlier
        // host had open is not taken for one of ours.
        let mut start = [0u8; 4];
        crate::id::fill_random(&mut start);
        m.inner
            .next_id
            .store(u32::from_be_bytes(start) >> 1 | 1, Ordering::Relaxed);
        *m.inner.awaiting.lock().unwrap_or_else(|p| p.into_inner()) = Some(frame(RESET, 0, &nonce));
        m.send_reset(&nonce)?;
        Ok(m)
    }

    /// Filler, then a RESET with `nonce` (see the module comment).
    fn send_reset(&self, nonce: &[u8]) -> io::Result<()> {
        let mut f = vec![SYNC; FILLER];
        f.extend_from_slice(&frame(RESET, 0, nonce));
        let mut link = self.inner.link.lock().unwrap_or_else(|p| p.into_inner());
        link.write_all(&f)?;
        link.flush()
    }

    /// The guest end: each stream the host opens is handed to `on_open` as a unix socket.
    pub fn guest(
        link: Box<dyn Write + Send>,
        on_open: impl Fn(UnixStream) + Send + Sync + 'static,
    ) -> Mux {
        Mux::new(link, Some(Box::new(on_open)))
    }

    fn new(
        link: Box<dyn Write + Send>,
        on_open: Option<Box<dyn Fn(UnixStream) + Send + Sync>>,
    ) -> Mux {
        Mux {
            inner: Arc::new(Inner {
                link: Mutex::new(link),
                streams: Mutex::new(HashMap::new()),
                next_id: AtomicU32::new(1),
                awaiting: Mutex::new(None),
                on_open,
            }),
        }
    }

    fn send(&self, kind: u8, id: u32, payload: &[u8]) -> io::Result<()> {
        let f = frame(kind, id, payload);
        let mut link = self.inner.link.lock().unwrap_or_else(|p| p.into_inner());
        link.write_all(&f)?;
        link.flush()
    }

    fn streams(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Arc<Stream>>> {
        self.inner.streams.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Host side: carries `local` (an accepted connection) to the guest as a new stream.
    pub fn open(&self, local: UnixStream) -> io::Result<()> {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        self.bridge(id, local, true)
    }

    /// Starts the two pumps of stream `id`: local socket → link (within the credit the
    /// peer grants) and link → local socket (granting credit as it goes).
    /// With `announce`, the OPEN goes out before either pump can send a byte of the
    /// stream (a DATA ahead of its OPEN would be dropped by the peer).
    fn bridge(&self, id: u32, local: UnixStream, announce: bool) -> io::Result<()> {
        let (tx, rx) = channel::<Option<Vec<u8>>>();
        let queued = Arc::new(AtomicU32::new(0));
        let s = Arc::new(Stream {
            done: Mutex::new(0),
            credit: Mutex::new(WINDOW),
            credit_cv: Condvar::new(),
            incoming: tx,
            queued: queued.clone(),
            local: local.try_clone()?,
        });
        self.streams().insert(id, s.clone());
        if announce && let Err(e) = self.send(OPEN, id, &[]) {
            self.drop_stream(id);
            return Err(e);
        }
        let started = (|| {
            let writer_end = local.try_clone()?;
            let m = self.clone();
            std::thread::Builder::new()
                .name(format!("vmux-in-{id}"))
                .spawn(move || m.pump_in(id, writer_end, rx, queued))?;
            let m = self.clone();
            std::thread::Builder::new()
                .name(format!("vmux-out-{id}"))
                .spawn(move || m.pump_out(id, local, s))?;
            Ok(())
        })();
        if started.is_err() {
            let _ = self.send(CLOSE, id, &[]);
            self.drop_stream(id);
        }
        started
    }

    /// Local socket → link.
    fn pump_out(&self, id: u32, mut local: UnixStream, s: Arc<Stream>) {
        let mut buf = vec![0u8; MAX_DATA];
        loop {
            let n = match local.read(&mut buf) {
                // Dropped meanwhile (a RESET): the peer no longer knows this id.
                _ if !self.streams().contains_key(&id) => return,
                Ok(0) => {
                    let _ = self.send(EOF, id, &[]);
                    self.finish(id, OUT_DONE);
                    return;
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    let _ = self.send(CLOSE, id, &[]);
                    self.drop_stream(id);
                    return;
                }
            };
            {
                let mut credit = s.credit.lock().unwrap_or_else(|p| p.into_inner());
                while *credit < n as u32 {
                    credit = s.credit_cv.wait(credit).unwrap_or_else(|p| p.into_inner());
                    if !self.streams().contains_key(&id) {
                        return;
                    }
                }
                *credit -= n as u32;
            }
            if self.send(DATA, id, &buf[..n]).is_err() {
                return;
            }
        }
    }

    /// Link → local socket (a thread per stream, so a slow reader holds up only itself).
    fn pump_in(
        &self,
        id: u32,
        mut local: UnixStream,
        rx: Receiver<Option<Vec<u8>>>,
        queued: Arc<AtomicU32>,
    ) {
        while let Ok(item) = rx.recv() {
            match item {
                Some(data) => {
                    if local.write_all(&data).is_err() {
                        let _ = self.send(CLOSE, id, &[]);
                        self.drop_stream(id);
                        return;
                    }
                    queued.fetch_sub(data.len() as u32, Ordering::SeqCst);
                    let _ = self.send(WINDOW_UPDATE, id, &(data.len() as u32).to_be_bytes());
                }
                None => {
                    let _ = local.shutdown(Shutdown::Write);
                    self.finish(id, IN_DONE);
                    return;
                }
            }
        }
    }

    /// Hands a payload to the stream's writer; a stream whose writer is gone, or whose
    /// peer sent more than the window it was granted, is dropped (and the peer told).
    fn deliver(&self, id: u32, s: &Stream, payload: Vec<u8>) {
        let n = payload.len() as u32;
        let queued = s.queued.fetch_add(n, Ordering::SeqCst).saturating_add(n);
        if queued > WINDOW {
            self.drop_stream(id);
            let _ = self.send(CLOSE, id, &[]);
            return;
        }
        if s.incoming.send(Some(payload)).is_err() {
            self.drop_stream(id);
        }
    }

    /// Marks one direction of a stream ended; a stream ended both ways is forgotten (its
    /// socket closes once the pumps are gone).
    fn finish(&self, id: u32, bit: u8) {
        let mut streams = self.streams();
        let both = streams.get(&id).is_some_and(|s| {
            let mut d = s.done.lock().unwrap_or_else(|p| p.into_inner());
            *d |= bit;
            *d == IN_DONE | OUT_DONE
        });
        if both {
            streams.remove(&id);
        }
    }

    /// Streams currently open (for tests and diagnostics).
    pub fn open_streams(&self) -> usize {
        self.streams().len()
    }

    fn drop_stream(&self, id: u32) {
        if let Some(s) = self.streams().remove(&id) {
            let _ = s.local.shutdown(Shutdown::Both);
            s.credit_cv.notify_all();
        }
    }

    fn drop_all(&self) {
        let ids: Vec<u32> = self.streams().keys().copied().collect();
        for id in ids {
            self.drop_stream(id);
        }
    }

    /// Reads frames from the link until it ends (the caller reconnects or gives up). Every
    /// stream is dropped when it returns.
    pub fn run(&self, link: impl Read) -> io::Result<()> {
        let mut link = io::BufReader::with_capacity(64 * 1024, link);
        let r = self.read_frames(&mut link);
        self.drop_all();
        r
    }

    /// Host side: discards what the guest sends until the echo of our RESET.
    fn await_echo(&self, link: &mut impl Read) -> io::Result<()> {
        let Some(want) = self
            .inner
            .awaiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        else {
            return Ok(());
        };
        let mut window: Vec<u8> = Vec::with_capacity(want.len());
        let mut b = [0u8; 1];
        while window != want {
            link.read_exact(&mut b)?;
            if window.len() == want.len() {
                window.remove(0);
            }
            window.push(b[0]);
        }
        *self
            .inner
            .awaiting
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = None;
        Ok(())
    }

    fn read_frames(&self, link: &mut impl Read) -> io::Result<()> {
        self.await_echo(link)?;
        let mut header = [0u8; HEADER];
        loop {
            // Filler between frames.
            loop {
                link.read_exact(&mut header[..1])?;
                if header[0] != SYNC {
                    break;
                }
            }
            link.read_exact(&mut header[1..])?;
            let kind = header[0];
            let id = u32::from_be_bytes([header[1], header[2], header[3], header[4]]);
            let len = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) as usize;
            if len > MAX_DATA || !(OPEN..=RESET).contains(&kind) {
                if self.inner.on_open.is_none() {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("vmux frame of kind {kind} and {len} bytes (most {MAX_DATA})"),
                    ));
                }
                // The guest joined a new host mid-frame: skip to the filler before its
                // RESET.
                loop {
                    link.read_exact(&mut header[..1])?;
                    if header[0] == SYNC {
                        break;
                    }
                }
                continue;
            }
            let mut payload = vec![0u8; len];
            link.read_exact(&mut payload)?;
            let stream = self.streams().get(&id).cloned();
            match (kind, stream) {
                (RESET, _) => {
                    self.drop_all();
                    if self.inner.on_open.is_some() {
                        self.send_reset(&payload)?;
                    }
                }
                (OPEN, None) => match &self.inner.on_open {
                    Some(on_open) => {
                        let (ours, theirs) = UnixStream::pair()?;
                        if self.bridge(id, ours, false).is_ok() {
                            on_open(theirs);
                        } else {
                            let _ = self.send(CLOSE, id, &[]);
                        }
                    }
                    None => {
                        let _ = self.send(CLOSE, id, &[]);
                    }
                },
                (DATA, Some(s)) => self.deliver(id, &s, payload),
                (EOF, Some(s)) => {
                    let _ = s.incoming.send(None);
                }
                (WINDOW_UPDATE, Some(s)) if len == 4 => {
                    let more = u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
                    let mut c = s.credit.lock().unwrap_or_else(|p| p.into_inner());
                    *c = c.saturating_add(more).min(WINDOW);
                    s.credit_cv.notify_all();
                }
                (CLOSE, Some(_)) => self.drop_stream(id),
                // Frames of a stream already gone (closed on one side while in flight).
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// Fuzz target: a guest's end of the link fed any bytes (as a restored or hostile peer
    /// might send) ends cleanly at the end of input.
    #[test]
    fn fuzz_link_bytes() {
        bolero::check!()
            .with_iterations(crate::FUZZ_CASES)
            .for_each(|input: &[u8]| {
                let m = Mux::guest(Box::new(std::io::sink()), drop);
                let _ = m.run(input);
            });
    }

    /// A writer whose bytes a test can read back.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// Fuzz target: the host's end (vmux) fed any bytes after a correct echo of its RESET
    /// (what a hostile guest kernel can send once the link is up) ends cleanly, with a
    /// stream of its own open, and never holds more than the window for it.
    #[test]
    fn fuzz_host_link_bytes() {
        bolero::check!()
            .with_iterations(crate::FUZZ_CASES)
            .for_each(|input: &[u8]| {
                let out = Captured::default();
                let m = Mux::host(Box::new(out.clone())).unwrap();
                let sent = out.0.lock().unwrap().clone();
                // The RESET is the frame after the filler: echo it, as a guest does.
                let reset = &sent[FILLER..FILLER + HEADER + NONCE];
                let (ours, _theirs) = UnixStream::pair().unwrap();
                m.open(ours).unwrap();
                let mut feed = vec![SYNC; 3];
                feed.extend_from_slice(reset);
                feed.extend_from_slice(input);
                let _ = m.run(&feed[..]);
                assert_eq!(
                    m.open_streams(),
                    0,
                    "every stream is dropped when the link ends"
                );
            });
    }

    /// A guest that answers each stream: reads a request line `N` and writes N bytes back
    /// (a digest-checkable pattern), or echoes everything for `echo`.
    fn guest_service(s: UnixStream) {
        std::thread::spawn(move || {
            let mut r = std::io::BufReader::new(s.try_clone().unwrap());
            let mut line = String::new();
            use std::io::BufRead;
            if r.read_line(&mut line).is_err() {
                return;
            }
            let mut w = s;
            if line.trim() == "echo" {
                let _ = std::io::copy(&mut r, &mut w);
                let _ = w.shutdown(Shutdown::Write);
                return;
            }
            let n: usize = line.trim().parse().unwrap_or(0);
            let chunk: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8).collect();
            let mut left = n;
            while left > 0 {
                let k = left.min(chunk.len());
                if w.write_all(&chunk[..k]).is_err() {
                    return;
                }
                left -= k;
            }
            let _ = w.shutdown(Shutdown::Write);
        });
    }

    /// A host mux and a guest mux joined by a socketpair (standing in for the serial
    /// port); returns the host mux.
    fn link() -> Mux {
        let (h, g) = UnixStream::pair().unwrap();
        let guest = Mux::guest(Box::new(g.try_clone().unwrap()), guest_service);
        std::thread::spawn(move || guest.run(g));
        let host = Mux::host(Box::new(h.try_clone().unwrap())).unwrap();
        let h2 = host.clone();
        std::thread::spawn(move || h2.run(h));
        host
    }

    fn frame_of(kind: u8, id: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = vec![kind];
        f.extend_from_slice(&id.to_be_bytes());
        f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// Reads one frame (after any filler) from a raw end of the link.
    fn read_frame(r: &mut impl Read) -> (u8, u32, Vec<u8>) {
        let mut b = [0u8; 1];
        loop {
            r.read_exact(&mut b).unwrap();
            if b[0] != SYNC {
                break;
            }
        }
        let mut h = [0u8; HEADER - 1];
        r.read_exact(&mut h).unwrap();
        let id = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
        let len = u32::from_be_bytes([h[4], h[5], h[6], h[7]]) as usize;
        let mut p = vec![0u8; len];
        r.read_exact(&mut p).unwrap();
        (b[0], id, p)
    }

    #[test]
    fn a_guest_that_ignores_the_window_loses_its_stream_not_the_hosts_memory() {
        let (h, mut g) = UnixStream::pair().unwrap();
        let host = Mux::host(Box::new(h.try_clone().unwrap())).unwrap();
        let h2 = host.clone();
        std::thread::spawn(move || h2.run(h));
        // The raw guest echoes the host's RESET, as a real one does.
        let (kind, _, nonce) = read_frame(&mut g);
        assert_eq!(kind, RESET);
        g.write_all(&vec![SYNC; FILLER]).unwrap();
        g.write_all(&frame_of(RESET, 0, &nonce)).unwrap();
        // The edge opens a stream and never reads what comes back.
        let (unread, b) = UnixStream::pair().unwrap();
        host.open(b).unwrap();
        let (kind, id, _) = read_frame(&mut g);
        assert_eq!(kind, OPEN);
        // The guest sends four windows without waiting for a grant.
        let chunk = vec![7u8; MAX_DATA];
        let mut g2 = g.try_clone().unwrap();
        let sender = std::thread::spawn(move || {
            for _ in 0..(4 * WINDOW as usize / MAX_DATA) {
                if g2.write_all(&frame_of(DATA, id, &chunk)).is_err() {
                    return;
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        g.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let closed = loop {
            let (kind, fid, _) = read_frame(&mut g);
            if kind == CLOSE && fid == id {
                break true;
            }
            if Instant::now() > deadline {
                break false;
            }
        };
        assert!(closed, "the host kept taking bytes past the window");
        assert_eq!(host.open_streams(), 0);
        sender.join().unwrap();
        drop(unread);
    }

    fn connect(host: &Mux) -> UnixStream {
        let (a, b) = UnixStream::pair().unwrap();
        host.open(b).unwrap();
        a
    }

    #[test]
    fn many_streams_at_once_each_get_their_own_bytes() {
        let host = link();
        let handles: Vec<_> = (0..32)
            .map(|i| {
                let mut c = connect(&host);
                std::thread::spawn(move || {
                    let n = 1000 + i * 7919;
                    c.write_all(format!("{n}\n").as_bytes()).unwrap();
                    let mut got = Vec::new();
                    c.read_to_end(&mut got).unwrap();
                    assert_eq!(got.len(), n);
                    assert!(
                        got.iter()
                            .enumerate()
                            .all(|(j, b)| *b == ((j % 65536) % 251) as u8)
                    );
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        // Streams ended both ways are forgotten (no descriptors kept per connection).
        let t0 = Instant::now();
        while host.open_streams() > 0 && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(host.open_streams(), 0);
    }

    #[test]
    fn a_stalled_reader_holds_up_only_its_own_stream() {
        let host = link();
        // 64 MiB that nobody reads for a while...
        let mut slow = connect(&host);
        slow.write_all(b"67108864\n").unwrap();
        std::thread::sleep(Duration::from_millis(200));
        // ...does not stop another stream.
        let mut fast = connect(&host);
        fast.write_all(b"echo\n").unwrap();
        let t0 = Instant::now();
        fast.write_all(b"ping").unwrap();
        fast.shutdown(Shutdown::Write).unwrap();
        let mut got = Vec::new();
        fast.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"ping");
        assert!(t0.elapsed() < Duration::from_secs(5));
        let mut total = 0usize;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = slow.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            total += n;
        }
        assert_eq!(total, 64 << 20);
    }

    #[test]
    fn a_host_reconnect_drops_old_streams_and_new_ones_work() {
        let (h, g) = UnixStream::pair().unwrap();
        let guest = Mux::guest(Box::new(g.try_clone().unwrap()), guest_service);
        std::thread::spawn(move || guest.run(g));
        let host = Mux::host(Box::new(h.try_clone().unwrap())).unwrap();
        let h2 = host.clone();
        let reader = h.try_clone().unwrap();
        std::thread::spawn(move || h2.run(reader));
        let mut old = connect(&host);
        old.write_all(b"echo\n").unwrap();
        // A second host end on the same link announces itself: the guest forgets `old`.
        let host2 = Mux::host(Box::new(h)).unwrap();
        let mut buf = [0u8; 1];
        old.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(old.read(&mut buf).unwrap_or(0), 0, "the old stream ends");
        let _ = host2;
        let mut c = connect(&host);
        c.write_all(b"5\n").unwrap();
        let mut got = Vec::new();
        c.read_to_end(&mut got).unwrap();
        assert_eq!(got.len(), 5);
    }

    #[test]
    fn a_restored_guest_and_a_new_host_resynchronise_mid_frame() {
        let (h, g) = UnixStream::pair().unwrap();
        // The guest stopped half-way through a DATA frame of an earlier host...
        let mut raw = h.try_clone().unwrap();
        let mut half = frame(DATA, 7, &[1u8; 1000]);
        half.truncate(600);
        raw.write_all(&half).unwrap();
        // ...and had begun a frame of its own towards that host.
        let mut graw = g.try_clone().unwrap();
        graw.write_all(&frame(DATA, 9, &[SYNC; 50])[..20]).unwrap();
        let guest = Mux::guest(Box::new(g.try_clone().unwrap()), guest_service);
        std::thread::spawn(move || guest.run(g));
        let host = Mux::host(Box::new(h.try_clone().unwrap())).unwrap();
        let h2 = host.clone();
        std::thread::spawn(move || h2.run(h));
        for n in [5usize, 70_000] {
            let mut c = connect(&host);
            c.write_all(format!("{n}\n").as_bytes()).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut got = Vec::new();
            c.read_to_end(&mut got).unwrap();
            assert_eq!(got.len(), n);
        }
    }

    #[test]
    fn a_guest_cut_off_inside_a_header_resynchronises() {
        for cut in 1..HEADER {
            let (h, g) = UnixStream::pair().unwrap();
            let mut raw = h.try_clone().unwrap();
            raw.write_all(&frame(DATA, 3, &[0u8; 40])[..cut]).unwrap();
            let guest = Mux::guest(Box::new(g.try_clone().unwrap()), guest_service);
            std::thread::spawn(move || guest.run(g));
            let host = Mux::host(Box::new(h.try_clone().unwrap())).unwrap();
            let h2 = host.clone();
            std::thread::spawn(move || h2.run(h));
            let mut c = connect(&host);
            c.write_all(b"5\n").unwrap();
            c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut got = Vec::new();
            c.read_to_end(&mut got).unwrap();
            assert_eq!(got.len(), 5, "cut after {cut} header bytes");
        }
    }

    #[test]
    fn oversized_frames_end_the_host_link() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let host = Mux::host(Box::new(a.try_clone().unwrap())).unwrap();
        let t = std::thread::spawn(move || host.run(a));
        // Echo the host's RESET as a guest would, then send an oversized frame.
        let mut hello = vec![0u8; FILLER + HEADER + NONCE];
        b.read_exact(&mut hello).unwrap();
        b.write_all(&hello[FILLER..]).unwrap();
        b.write_all(&frame(DATA, 1, &[])[..5]).unwrap();
        b.write_all(&(u32::MAX).to_be_bytes()).unwrap();
        assert!(t.join().unwrap().is_err());
    }
}
