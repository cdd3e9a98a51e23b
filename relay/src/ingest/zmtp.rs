//! The rank's subscription to the engine's PUB socket, read on the rank's own thread: a ZeroMQ
//! SUB peer of the relay's own (ZMTP 3.0, the NULL mechanism) over TCP or a Unix socket.
//!
//! Why not libzmq here: a libzmq socket is read by libzmq's I/O thread, which hands each message
//! to the rank's thread through a queue and a wakeup. A quiet relay paid for three threads a
//! batch (that I/O thread, the rank's thread, the server thread) where it needs two; the I/O
//! thread alone was an eighth of the relay's CPU at 1,000 batches a second (`docs/benchmarks.md`).
//! Here the kernel wakes the rank's thread, which reads the socket, splits the frames in place
//! and decodes them. The replay socket (a DEALER, used on gaps only) and `inproc://` endpoints
//! stay on libzmq ([`Sub::open`] says which endpoints are read here).
//!
//! What the wire is (ZMTP 3.0, rfc.zeromq.org/spec/23; what libzmq 4.x speaks):
//! * Each side sends a 64-byte greeting: `FF`, 8 bytes of padding, `7F`; the version (3, 0); the
//!   mechanism's name padded to 20 bytes (`NULL`); as-server (0); 31 bytes of filler.
//! * The NULL handshake: each side sends a `READY` command with its metadata, of which the
//!   `Socket-Type` matters: this side says `SUB` and takes a peer that says `PUB` or `XPUB`. An
//!   `ERROR` command ends the connection with its reason.
//! * Then frames: a flags byte (bit 0 more frames follow, bit 1 an 8-byte size follows instead
//!   of a 1-byte one, bit 2 a command; the others zero), the size, the body. A message is the
//!   frames up to one without "more".
//! * A subscription is a message of one frame, `01` and the topic (the ZMTP 3.0 form, which
//!   libzmq also takes from newer peers). A peer may send `PING` (its heartbeat): the answer is a
//!   `PONG` with the ping's context.
//!
//! What it does as libzmq did: it connects again after 100 ms, doubling to 2 s while connecting
//! fails (`ZMQ_RECONNECT_IVL` 100 and `ZMQ_RECONNECT_IVL_MAX` 2000, as the SUB socket had), and a
//! frame over `max_message_bytes` drops the connection (`ZMQ_MAXMSGSIZE` does the same). What is
//! not the same: libzmq's I/O thread read ahead into the SUB's queue (its receive high-water mark)
//! while the rank's thread committed; here the queue is the kernel's socket buffer and the
//! engine's PUB queue behind it (its send high-water mark), and the engine's PUB drops at that
//! mark while the rank's thread is busy. Those batches come back through the gap rule.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The first wait before connecting again, doubled after each failed attempt up to
/// [`RECONNECT_MAX`].
pub const RECONNECT_FIRST: Duration = Duration::from_millis(100);
pub const RECONNECT_MAX: Duration = Duration::from_secs(2);
/// How long a TCP connect, and then the greeting and the handshake, may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(1);

const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;
const GREETING: usize = 64;
/// Bytes asked of the kernel by one read, at least.
const READ_CHUNK: usize = 64 * 1024;

/// Where the engine's PUB socket is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    /// `host:port` (a name, an IPv4 address or a bracketed IPv6 one), resolved at each connect.
    Tcp(String),
    Ipc(PathBuf),
}

/// An open connection.
enum Conn {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Conn {
    fn fd(&self) -> RawFd {
        match self {
            Conn::Tcp(s) => s.as_raw_fd(),
            Conn::Unix(s) => s.as_raw_fd(),
        }
    }

    fn set_timeouts(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.set_read_timeout(t).and_then(|()| s.set_write_timeout(t)),
            Conn::Unix(s) => s.set_read_timeout(t).and_then(|()| s.set_write_timeout(t)),
        }
    }

    fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.set_nonblocking(on),
            Conn::Unix(s) => s.set_nonblocking(on),
        }
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.read(buf),
            Conn::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.write(buf),
            Conn::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// What [`Sub::next`] found.
#[derive(Debug, PartialEq)]
pub enum Next<'a> {
    /// A message: its frames.
    Message(Vec<&'a [u8]>),
    /// The connection dropped, for this reason; the next connect is already planned.
    Dropped(String),
    /// Nothing within the wait.
    Idle,
}

/// A frame whose header is whole, found by [`Frames::next_frame`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Frame {
    flags: u8,
    /// Where its body starts and ends in the buffer.
    start: usize,
    end: usize,
}

/// Splitting a byte stream into frames and messages, with nothing of the socket: the part the
/// tests and the fuzz target drive with any bytes.
#[derive(Debug, Default)]
pub struct Frames {
    /// Bytes `pos..end` are read and not consumed; the rest is room (zeroed once, when the
    /// buffer grows).
    buf: Vec<u8>,
    pos: usize,
    end: usize,
    max_frame: u64,
}

/// Why a stream cannot be read on: the connection is dropped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("a frame of {size} bytes, over max_message_bytes ({max})")]
    TooLarge { size: u64, max: u64 },
    #[error("frame flags {0:#04x} have reserved bits set")]
    Flags(u8),
    #[error("a command frame inside a multi-frame message")]
    CommandInMessage,
    #[error("the engine's ZeroMQ sent ERROR: {0}")]
    PeerError(String),
    #[error("a malformed command frame")]
    BadCommand,
}

/// What [`Frames::take`] found at the front of the stream.
#[derive(Debug, PartialEq)]
pub enum Unit<'a> {
    Message(Vec<&'a [u8]>),
    /// A `PING`, whose answer is to be sent: the whole `PONG` frame.
    Ping(Vec<u8>),
    /// Any other command (a `PONG`, or one of a later version): skipped.
    Command,
}

impl Frames {
    pub fn new(max_message_bytes: u64) -> Self {
        Self { buf: Vec::new(), pos: 0, end: 0, max_frame: max_message_bytes }
    }

    /// Appends bytes read from the stream.
    pub fn push(&mut self, bytes: &[u8]) {
        self.room(bytes.len())[..bytes.len()].copy_from_slice(bytes);
        self.end += bytes.len();
    }

    /// Room for at least `want` more bytes after the unconsumed ones (which move to the front
    /// once the consumed ones are half the buffer, or to make room).
    fn room(&mut self, want: usize) -> &mut [u8] {
        if self.pos == self.end {
            self.pos = 0;
            self.end = 0;
        } else if self.pos > 0 && (self.pos >= self.buf.len() / 2 || self.buf.len() - self.end < want) {
            self.buf.copy_within(self.pos..self.end, 0);
            self.end -= self.pos;
            self.pos = 0;
        }
        if self.buf.len() - self.end < want {
            self.buf.resize(self.end + want, 0);
        }
        &mut self.buf[self.end..]
    }

    /// Bytes read and not consumed.
    pub fn pending(&self) -> usize {
        self.end - self.pos
    }

    /// The frame at `at`, if its header is whole (its body may not be yet).
    fn frame_at(&self, at: usize) -> Result<Option<Frame>, ProtocolError> {
        let read = &self.buf[..self.end];
        let Some(&flags) = read.get(at) else { return Ok(None) };
        if flags & !(MORE | LONG | COMMAND) != 0 {
            return Err(ProtocolError::Flags(flags));
        }
        let (size, head) = if flags & LONG != 0 {
            let Some(b) = read.get(at + 1..at + 9) else { return Ok(None) };
            (u64::from_be_bytes(b.try_into().expect("8 bytes")), 9)
        } else {
            let Some(&b) = read.get(at + 1) else { return Ok(None) };
            (u64::from(b), 2)
        };
        if flags & COMMAND == 0 && size > self.max_frame {
            return Err(ProtocolError::TooLarge { size, max: self.max_frame });
        }
        // A command is small (READY's metadata is the largest); more is a broken peer.
        if flags & COMMAND != 0 && size > 1 << 16 {
            return Err(ProtocolError::BadCommand);
        }
        let start = at + head;
        let end = usize::try_from(size)
            .ok()
            .and_then(|n| start.checked_add(n))
            .ok_or(ProtocolError::TooLarge { size, max: self.max_frame })?;
        Ok(Some(Frame { flags, start, end }))
    }

    /// The next whole message or command at the front of the stream, consumed; `None` until
    /// all of it has been pushed. How many more bytes it needs at least is in `need`.
    pub fn take(&mut self, need: &mut usize) -> Result<Option<Unit<'_>>, ProtocolError> {
        *need = 0;
        let mut at = self.pos;
        let mut frames: Vec<Frame> = Vec::new();
        loop {
            let Some(f) = self.frame_at(at)? else {
                *need = 9;
                return Ok(None);
            };
            if f.end > self.end {
                *need = f.end - self.end;
                return Ok(None);
            }
            if f.flags & COMMAND != 0 {
                if !frames.is_empty() {
                    return Err(ProtocolError::CommandInMessage);
                }
                self.pos = f.end;
                return command(&self.buf[f.start..f.end]).map(Some);
            }
            at = f.end;
            frames.push(f);
            if f.flags & MORE == 0 {
                break;
            }
        }
        self.pos = at;
        Ok(Some(Unit::Message(frames.iter().map(|f| &self.buf[f.start..f.end]).collect())))
    }
}

/// Every unit `stream` splits into when pushed in reads of `read` bytes (a message as its
/// frames; a ping as `PONG` and its answer; another command as `COMMAND`), and the error that
/// ended it. For the tests and the fuzz target `zmtp`, which compare the reads' cuts.
pub fn units(stream: &[u8], read: usize, max_message_bytes: u64) -> (Vec<Vec<Vec<u8>>>, Option<ProtocolError>) {
    let mut f = Frames::new(max_message_bytes);
    let mut got = Vec::new();
    for chunk in stream.chunks(read.max(1)) {
        f.push(chunk);
        let mut need = 0;
        loop {
            match f.take(&mut need) {
                Ok(Some(Unit::Message(m))) => got.push(m.iter().map(|x| x.to_vec()).collect()),
                Ok(Some(Unit::Ping(pong))) => got.push(vec![b"PONG".to_vec(), pong]),
                Ok(Some(Unit::Command)) => got.push(vec![b"COMMAND".to_vec()]),
                Ok(None) => break,
                Err(e) => return (got, Some(e)),
            }
        }
        assert!(need > 0, "a stream that is not whole needs more bytes");
    }
    (got, None)
}

/// A command frame's body: `PING` gets its `PONG`, `ERROR` ends the connection, any other is
/// skipped.
fn command(body: &[u8]) -> Result<Unit<'static>, ProtocolError> {
    let (&n, rest) = body.split_first().ok_or(ProtocolError::BadCommand)?;
    let name = rest.get(..usize::from(n)).ok_or(ProtocolError::BadCommand)?;
    let data = &rest[usize::from(n)..];
    match name {
        b"PING" => {
            // TTL (2 bytes), then a context of at most 16 bytes that the PONG echoes.
            let context = data.get(2..).ok_or(ProtocolError::BadCommand)?;
            let context = &context[..context.len().min(16)];
            let mut body = vec![4];
            body.extend_from_slice(b"PONG");
            body.extend_from_slice(context);
            Ok(Unit::Ping(frame(COMMAND, &body)))
        }
        b"ERROR" => {
            let reason = data.split_first().map(|(&k, r)| &r[..usize::from(k).min(r.len())]).unwrap_or_default();
            Err(ProtocolError::PeerError(String::from_utf8_lossy(reason).into_owned()))
        }
        _ => Ok(Unit::Command),
    }
}

/// One frame: `flags` (without [`LONG`], which the size decides) and `body`.
fn frame(flags: u8, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 9);
    if body.len() > 255 {
        out.push(flags | LONG);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
    out
}

/// This side's greeting: ZMTP 3.0, NULL, not the server.
fn greeting() -> [u8; GREETING] {
    let mut g = [0u8; GREETING];
    g[0] = 0xff;
    // The padding's last byte is 1, as libzmq sends it (a ZMTP 1.0 peer reads it as a length).
    g[8] = 0x01;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// Checks the peer's greeting.
fn check_greeting(g: &[u8; GREETING]) -> Result<(), String> {
    if g[0] != 0xff || g[9] & 0x01 == 0 {
        return Err(
            "the peer did not greet as ZeroMQ (ZMTP 3): is the endpoint the engine's KV-event PUB socket?".into()
        );
    }
    if g[10] < 3 {
        return Err(format!("the peer speaks ZMTP {}.{}; 3.0 or later is needed", g[10], g[11]));
    }
    let mechanism = &g[12..32];
    let end = mechanism.iter().position(|&b| b == 0).unwrap_or(mechanism.len());
    if &mechanism[..end] != b"NULL" {
        return Err(format!(
            "the peer asks for the {:?} security mechanism; the relay speaks NULL (no CURVE or PLAIN)",
            String::from_utf8_lossy(&mechanism[..end])
        ));
    }
    Ok(())
}

/// This side's `READY` command frame (`Socket-Type: SUB`).
fn ready() -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&3u32.to_be_bytes());
    body.extend_from_slice(b"SUB");
    frame(COMMAND, &body)
}

/// The peer's `READY` metadata's `Socket-Type`.
fn socket_type(body: &[u8]) -> Result<String, String> {
    let bad = || "a malformed READY command".to_string();
    let (&n, rest) = body.split_first().ok_or_else(bad)?;
    let name = rest.get(..usize::from(n)).ok_or_else(bad)?;
    let mut props = &rest[usize::from(n)..];
    if name == b"ERROR" {
        let reason = props.split_first().map(|(&k, r)| &r[..usize::from(k).min(r.len())]).unwrap_or_default();
        return Err(format!("the peer refused the connection: {}", String::from_utf8_lossy(reason)));
    }
    if name != b"READY" {
        return Err(format!("the peer sent {:?} where READY was due", String::from_utf8_lossy(name)));
    }
    while let Some((&k, rest)) = props.split_first() {
        let key = rest.get(..usize::from(k)).ok_or_else(bad)?;
        let rest = &rest[usize::from(k)..];
        let len = rest.get(..4).ok_or_else(bad)?;
        let len = u32::from_be_bytes(len.try_into().expect("4 bytes")) as usize;
        let value = rest.get(4..4 + len).ok_or_else(bad)?;
        if key.eq_ignore_ascii_case(b"Socket-Type") {
            return Ok(String::from_utf8_lossy(value).into_owned());
        }
        props = &rest[4 + len..];
    }
    Err("the peer's READY has no Socket-Type".into())
}

/// The engine's PUB socket, subscribed to one topic, read on the calling thread.
pub struct Sub {
    target: Target,
    /// The endpoint as configured, for messages.
    endpoint: String,
    topic: Vec<u8>,
    conn: Option<Conn>,
    frames: Frames,
    /// Bytes to send (a `PONG`) not yet written.
    out: Vec<u8>,
    /// The last read emptied the socket (see [`Sub::read`]).
    drained: bool,
    /// While not connected: when to try again, and the wait after that.
    retry_at: Instant,
    backoff: Duration,
    /// Why the last attempt to connect failed, and how many failed in a row.
    pub last_refusal: Option<String>,
    pub refusals: u64,
}

impl Sub {
    /// A subscription to `topic` on `endpoint`, when it is an endpoint this module reads
    /// (`tcp://host:port`, `ipc://path`); `None` for any other (libzmq reads those). It connects
    /// on the first [`Sub::next`].
    pub fn open(endpoint: &str, topic: &[u8], max_message_bytes: u64) -> Option<Sub> {
        let target = if let Some(addr) = endpoint.strip_prefix("tcp://") {
            // `host:port`; libzmq's `tcp://iface;host:port` (a source address) stays with libzmq.
            if addr.contains(';') || addr.starts_with('*') {
                return None;
            }
            Target::Tcp(addr.to_string())
        } else {
            Target::Ipc(PathBuf::from(endpoint.strip_prefix("ipc://")?))
        };
        Some(Sub {
            target,
            endpoint: endpoint.to_string(),
            topic: topic.to_vec(),
            conn: None,
            frames: Frames::new(max_message_bytes),
            out: Vec::new(),
            drained: false,
            retry_at: Instant::now(),
            backoff: RECONNECT_FIRST,
            last_refusal: None,
            refusals: 0,
        })
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Connected and through the handshake.
    pub fn connected(&self) -> bool {
        self.conn.is_some()
    }

    /// The next message, waiting up to `timeout` for it (a zero timeout only looks); or the news
    /// that the connection dropped. While not connected it connects, when the reconnect interval
    /// has passed (a connect and handshake block for up to [`HANDSHAKE_TIMEOUT`] each).
    pub fn next(&mut self, timeout: Duration) -> Next<'_> {
        let deadline = Instant::now() + timeout;
        // Borrowck: the message borrows `self.frames`, so the decision is made first.
        loop {
            if self.conn.is_none() {
                let now = Instant::now();
                if now < self.retry_at {
                    let wait = self.retry_at.min(deadline).saturating_duration_since(now);
                    if wait.is_zero() {
                        return Next::Idle;
                    }
                    std::thread::sleep(wait);
                    if Instant::now() < self.retry_at {
                        return Next::Idle;
                    }
                }
                if let Err(why) = self.connect() {
                    self.refusals += 1;
                    self.last_refusal = Some(why);
                    self.retry_at = Instant::now() + self.backoff;
                    self.backoff = (self.backoff * 2).min(RECONNECT_MAX);
                    if Instant::now() >= deadline {
                        return Next::Idle;
                    }
                    continue;
                }
            }
            match self.step(deadline) {
                Step::Message => break,
                Step::Idle => return Next::Idle,
                Step::Dropped(why) => {
                    self.conn = None;
                    self.out.clear();
                    self.frames = Frames::new(self.frames.max_frame);
                    self.retry_at = Instant::now() + RECONNECT_FIRST;
                    self.backoff = RECONNECT_FIRST;
                    return Next::Dropped(why);
                }
            }
        }
        let mut need = 0;
        match self.frames.take(&mut need) {
            Ok(Some(Unit::Message(frames))) => Next::Message(frames),
            _ => unreachable!("step said a whole message is at the front"),
        }
    }

    /// Handles what is at the front of the buffer (answering pings) until a whole message is
    /// there, reading as needed until `deadline`.
    fn step(&mut self, deadline: Instant) -> Step {
        loop {
            // Look at the front without consuming a message: commands are consumed here.
            let mut need = 0;
            let before = self.frames.pos;
            match self.frames.take(&mut need) {
                Ok(Some(Unit::Message(_))) => {
                    self.frames.pos = before;
                    return Step::Message;
                }
                Ok(Some(Unit::Ping(pong))) => {
                    self.out.extend_from_slice(&pong);
                    continue;
                }
                Ok(Some(Unit::Command)) => continue,
                Ok(None) => {}
                Err(e) => return Step::Dropped(e.to_string()),
            }
            if let Err(e) = self.write_out() {
                return Step::Dropped(format!("writing to the engine's socket: {e}"));
            }
            match self.read(need, deadline) {
                Ok(true) => continue,
                Ok(false) => return Step::Idle,
                Err(e) => return Step::Dropped(e),
            }
        }
    }

    /// Reads what the socket has (with room for at least `need` more bytes), waiting until
    /// `deadline` for it; `Ok(false)` when nothing came.
    ///
    /// A read that did not fill its room emptied the socket (`drained`): the next look waits in
    /// `poll` first, and a look that may not wait returns at once. That is two system calls a
    /// message at light load (the `poll` that sleeps, the `read`) where reading first would
    /// make four; what arrives meanwhile is in the kernel's buffer for the next wait.
    fn read(&mut self, need: usize, deadline: Instant) -> Result<bool, String> {
        let conn = self.conn.as_mut().expect("connected");
        loop {
            if self.drained {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Ok(false);
                }
                // Milliseconds, rounded up; then the read says whether anything came.
                let ms = i64::try_from(left.as_micros().div_ceil(1000)).unwrap_or(i64::MAX);
                let mut items = [zmq::PollItem::from_fd(conn.fd(), zmq::POLLIN)];
                match zmq::poll(&mut items, ms) {
                    Ok(_) | Err(zmq::Error::EINTR) => {}
                    Err(e) => return Err(format!("poll: {e}")),
                }
                self.drained = false;
            }
            let room = self.frames.room(need.max(READ_CHUNK));
            let asked = room.len();
            match conn.read(room) {
                Ok(0) => return Err("the engine closed the connection".into()),
                Ok(n) => {
                    self.frames.end += n;
                    self.drained = n < asked;
                    return Ok(true);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.drained = true,
                Err(e) => return Err(format!("reading the engine's socket: {e}")),
            }
        }
    }

    /// Writes what is owed to the peer, as far as the socket takes it now.
    fn write_out(&mut self) -> io::Result<()> {
        let Some(conn) = self.conn.as_mut() else { return Ok(()) };
        while !self.out.is_empty() {
            match conn.write(&self.out) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.out.drain(..n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Connects, greets, shakes hands and subscribes.
    fn connect(&mut self) -> Result<(), String> {
        let mut conn = match &self.target {
            Target::Tcp(addr) => {
                let addrs: Vec<_> = addr.to_socket_addrs().map_err(|e| format!("resolving {addr}: {e}"))?.collect();
                let mut last = format!("{addr} resolved to no address");
                let mut found = None;
                for a in addrs {
                    match TcpStream::connect_timeout(&a, HANDSHAKE_TIMEOUT) {
                        Ok(s) => {
                            found = Some(s);
                            break;
                        }
                        Err(e) => last = format!("connecting to {a}: {e}"),
                    }
                }
                let s = found.ok_or(last)?;
                s.set_nodelay(true).map_err(|e| e.to_string())?;
                Conn::Tcp(s)
            }
            Target::Ipc(path) => {
                Conn::Unix(UnixStream::connect(path).map_err(|e| format!("connecting to {}: {e}", path.display()))?)
            }
        };
        let io = |e: io::Error| format!("the handshake with {}: {e}", self.endpoint);
        conn.set_timeouts(Some(HANDSHAKE_TIMEOUT)).map_err(io)?;
        conn.write_all(&greeting()).map_err(io)?;
        let mut peer = [0u8; GREETING];
        conn.read_exact(&mut peer).map_err(io)?;
        check_greeting(&peer)?;
        conn.write_all(&ready()).map_err(io)?;
        // The peer's READY: one command frame.
        let mut head = [0u8; 2];
        conn.read_exact(&mut head).map_err(io)?;
        let size = if head[0] & LONG != 0 {
            let mut rest = [0u8; 7];
            conn.read_exact(&mut rest).map_err(io)?;
            let mut b = [0u8; 8];
            b[0] = head[1];
            b[1..].copy_from_slice(&rest);
            u64::from_be_bytes(b)
        } else {
            u64::from(head[1])
        };
        if head[0] & COMMAND == 0 || size > 1 << 16 {
            return Err("the peer's handshake is not a ZeroMQ NULL handshake".into());
        }
        let mut body = vec![0u8; size as usize];
        conn.read_exact(&mut body).map_err(io)?;
        let kind = socket_type(&body)?;
        if kind != "PUB" && kind != "XPUB" {
            return Err(format!("the peer is a ZeroMQ {kind} socket, not the engine's PUB"));
        }
        let mut sub = vec![1];
        sub.extend_from_slice(&self.topic);
        conn.write_all(&frame(0, &sub)).map_err(io)?;
        conn.set_timeouts(None).map_err(io)?;
        conn.set_nonblocking(true).map_err(io)?;
        self.conn = Some(conn);
        self.drained = false;
        self.backoff = RECONNECT_FIRST;
        self.refusals = 0;
        self.last_refusal = None;
        Ok(())
    }
}

enum Step {
    Message,
    Idle,
    Dropped(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(frames: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, f) in frames.iter().enumerate() {
            out.extend(frame(if i + 1 < frames.len() { MORE } else { 0 }, f));
        }
        out
    }

    fn all(f: &mut Frames) -> Result<Vec<Vec<Vec<u8>>>, ProtocolError> {
        let mut got = Vec::new();
        let mut need = 0;
        while let Some(u) = f.take(&mut need)? {
            if let Unit::Message(m) = u {
                got.push(m.iter().map(|x| x.to_vec()).collect());
            }
        }
        Ok(got)
    }

    #[test]
    fn frames_split_messages_whatever_the_reads() {
        let big = vec![7u8; 300];
        let mut stream = message(&[b"kv", &5u64.to_be_bytes(), b"payload"]);
        stream.extend(frame(COMMAND, b"\x04PONG"));
        stream.extend(message(&[b"kv", &6u64.to_be_bytes(), &big]));
        let want: Vec<Vec<Vec<u8>>> = vec![
            vec![b"kv".to_vec(), 5u64.to_be_bytes().to_vec(), b"payload".to_vec()],
            vec![b"kv".to_vec(), 6u64.to_be_bytes().to_vec(), big.clone()],
        ];
        // In one piece, and cut at every byte.
        for cut in 0..=stream.len() {
            let mut f = Frames::new(1 << 20);
            f.push(&stream[..cut]);
            let mut got = all(&mut f).unwrap();
            f.push(&stream[cut..]);
            got.extend(all(&mut f).unwrap());
            assert_eq!(got, want, "cut at {cut}");
            assert_eq!(f.pending(), 0);
        }
    }

    proptest::proptest! {
        /// Frames of any flags (reserved bits now and then), both size forms, bodies up to past
        /// the bound, a byte changed anywhere: the reads' cuts change nothing, and nothing panics.
        #[test]
        fn any_stream_splits_the_same_whatever_the_reads(
            parts in proptest::collection::vec((0u8..9, proptest::collection::vec(proptest::num::u8::ANY, 0..300), proptest::bool::ANY), 0..12),
            flip in proptest::option::of((proptest::num::usize::ANY, proptest::num::u8::ANY)),
            read in 1usize..70,
        ) {
            let mut stream = Vec::new();
            for (flags, body, long) in &parts {
                let flags = if *flags == 8 { 0x10 } else { *flags & (MORE | COMMAND) };
                if *long {
                    stream.push(flags | LONG);
                    stream.extend_from_slice(&(body.len() as u64).to_be_bytes());
                    stream.extend_from_slice(body);
                } else {
                    stream.extend(frame(flags, &body[..body.len().min(255)]));
                }
            }
            if let Some((at, byte)) = flip.filter(|_| !stream.is_empty()) {
                let n = stream.len();
                stream[at % n] = byte;
            }
            proptest::prop_assert_eq!(units(&stream, read, 256), units(&stream, stream.len(), 256));
        }
    }

    #[test]
    fn the_long_form_is_read_and_written() {
        let body = vec![1u8; 256];
        let f = frame(0, &body);
        assert_eq!(&f[..9], &[LONG, 0, 0, 0, 0, 0, 0, 1, 0]);
        let f = frame(MORE, &[9; 255]);
        assert_eq!(&f[..2], &[MORE, 255]);
        // A long frame of a short body is legal.
        let mut s = vec![LONG, 0, 0, 0, 0, 0, 0, 0, 2, b'h', b'i'];
        s.extend(frame(0, b""));
        let mut fr = Frames::new(10);
        fr.push(&s);
        assert_eq!(all(&mut fr).unwrap(), vec![vec![b"hi".to_vec()], vec![vec![]]]);
    }

    #[test]
    fn a_frame_over_the_bound_is_refused_before_its_body() {
        let mut f = Frames::new(100);
        f.push(&[LONG, 0, 0, 0, 0, 0, 0, 0, 101]);
        let mut need = 0;
        assert_eq!(f.take(&mut need), Err(ProtocolError::TooLarge { size: 101, max: 100 }));
        let mut f = Frames::new(100);
        f.push(&[0, 100]);
        assert_eq!(f.take(&mut need), Ok(None));
        assert_eq!(need, 100);
        let mut f = Frames::new(u64::MAX);
        f.push(&[LONG, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        assert!(matches!(f.take(&mut need), Err(ProtocolError::TooLarge { .. })));
    }

    #[test]
    fn pings_are_answered_and_errors_end_the_stream() {
        let mut f = Frames::new(100);
        f.push(&frame(COMMAND, b"\x04PING\x00\x0actx"));
        let mut need = 0;
        assert_eq!(f.take(&mut need), Ok(Some(Unit::Ping(frame(COMMAND, b"\x04PONGctx")))));
        f.push(&frame(COMMAND, b"\x05ERROR\x04gone"));
        assert_eq!(f.take(&mut need), Err(ProtocolError::PeerError("gone".into())));
        let mut f = Frames::new(100);
        f.push(&[0x08, 0]);
        assert_eq!(f.take(&mut need), Err(ProtocolError::Flags(0x08)));
        let mut f = Frames::new(100);
        f.push(&frame(MORE, b"a"));
        f.push(&frame(COMMAND, b"\x04PING\x00\x00"));
        assert_eq!(f.take(&mut need), Err(ProtocolError::CommandInMessage));
        let mut f = Frames::new(100);
        f.push(&frame(COMMAND, b"\x09PI"));
        assert_eq!(f.take(&mut need), Err(ProtocolError::BadCommand));
    }

    #[test]
    fn handshake_parts() {
        let g = greeting();
        assert_eq!(g.len(), 64);
        assert_eq!(check_greeting(&g), Ok(()));
        let mut bad = g;
        bad[10] = 2;
        assert_eq!(check_greeting(&bad), Err("the peer speaks ZMTP 2.0; 3.0 or later is needed".into()));
        let mut curve = g;
        curve[12..17].copy_from_slice(b"CURVE");
        assert!(check_greeting(&curve).unwrap_err().contains("\"CURVE\""));
        let r = ready();
        assert_eq!(r[0], COMMAND);
        assert_eq!(socket_type(&r[2..]), Ok("SUB".into()));
        let mut pubr = vec![5];
        pubr.extend_from_slice(b"READY");
        pubr.push(8);
        pubr.extend_from_slice(b"Identity");
        pubr.extend_from_slice(&0u32.to_be_bytes());
        pubr.push(11);
        pubr.extend_from_slice(b"socket-type");
        pubr.extend_from_slice(&3u32.to_be_bytes());
        pubr.extend_from_slice(b"PUB");
        assert_eq!(socket_type(&pubr), Ok("PUB".into()));
        assert_eq!(socket_type(b"\x05ERROR\x03bad"), Err("the peer refused the connection: bad".into()));
        assert_eq!(socket_type(&pubr[..20]), Err("a malformed READY command".into()));
    }

    #[test]
    fn endpoints_read_here() {
        assert_eq!(Sub::open("tcp://127.0.0.1:5557", b"kv", 1).unwrap().target, Target::Tcp("127.0.0.1:5557".into()));
        assert_eq!(Sub::open("tcp://[::1]:5557", b"", 1).unwrap().target, Target::Tcp("[::1]:5557".into()));
        assert_eq!(Sub::open("ipc:///tmp/kv", b"", 1).unwrap().target, Target::Ipc("/tmp/kv".into()));
        assert!(Sub::open("inproc://kv", b"", 1).is_none());
        assert!(Sub::open("tcp://eth0;10.0.0.1:5557", b"", 1).is_none());
    }

    /// Against libzmq's PUB: the handshake, the subscription's topic, messages of every size
    /// class, and a reconnect after the publisher goes away and comes back on the same port.
    #[test]
    fn follows_a_libzmq_publisher() {
        let ctx = zmq::Context::new();
        let publ = ctx.socket(zmq::PUB).unwrap();
        publ.bind("tcp://127.0.0.1:0").unwrap();
        let ep = publ.get_last_endpoint().unwrap().unwrap();
        let mut sub = Sub::open(&ep, b"kv", 1 << 20).unwrap();
        // The subscription reaches the PUB some time after the connect: publish until one arrives.
        let mut first = None;
        for _ in 0..200 {
            publ.send_multipart([&b"other"[..], b"x"], 0).unwrap();
            publ.send_multipart([&b"kv"[..], b"probe"], 0).unwrap();
            if let Next::Message(m) = sub.next(Duration::from_millis(20)) {
                first = Some(m.iter().map(|f| f.to_vec()).collect::<Vec<_>>());
                break;
            }
        }
        assert_eq!(first, Some(vec![b"kv".to_vec(), b"probe".to_vec()]));
        // Drain the probes still on their way.
        while let Next::Message(_) = sub.next(Duration::from_millis(50)) {}
        let sizes = [0usize, 1, 255, 256, 70_000, 1 << 20];
        for &n in &sizes {
            publ.send_multipart([&b"other"[..], &vec![1; n]], 0).unwrap();
            publ.send_multipart([&b"kv"[..], &n.to_be_bytes(), &vec![(n % 251) as u8; n]], 0).unwrap();
        }
        for &n in &sizes {
            match sub.next(Duration::from_secs(5)) {
                Next::Message(m) => {
                    assert_eq!(m.len(), 3);
                    assert_eq!(m[1], n.to_be_bytes());
                    assert_eq!(m[2], vec![(n % 251) as u8; n].as_slice());
                }
                other => panic!("size {n}: {other:?}"),
            }
        }
        // Over the bound: the connection drops.
        publ.send_multipart([&b"kv"[..], &vec![0; (1 << 20) + 1]], 0).unwrap();
        assert!(
            matches!(sub.next(Duration::from_secs(5)), Next::Dropped(why) if why.contains("over max_message_bytes"))
        );
        assert!(!sub.connected());
        // It connects again by itself, and the publisher's new messages arrive.
        let mut back = None;
        for k in 0..400u32 {
            publ.send_multipart([&b"kv"[..], &k.to_be_bytes()], 0).unwrap();
            if let Next::Message(m) = sub.next(Duration::from_millis(10)) {
                back = Some(m[0].to_vec());
                break;
            }
        }
        assert_eq!(back, Some(b"kv".to_vec()));
        drop(publ);
        assert!(
            matches!(sub.next(Duration::from_secs(5)), Next::Dropped(why) if why == "the engine closed the connection")
        );
    }

    #[test]
    fn a_peer_that_is_not_zeromq_is_refused() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let ep = format!("tcp://{}", l.local_addr().unwrap());
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").unwrap();
            std::thread::sleep(Duration::from_millis(200));
        });
        let mut sub = Sub::open(&ep, b"", 100).unwrap();
        assert_eq!(sub.next(Duration::ZERO), Next::Idle);
        t.join().unwrap();
        assert_eq!(sub.refusals, 1);
        assert!(!sub.connected());
        let why = sub.last_refusal.clone().unwrap();
        assert!(why.contains("did not greet as ZeroMQ") || why.contains("handshake"), "{why}");
    }
}
