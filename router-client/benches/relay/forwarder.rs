//! The transport alone: a process that does what the relay does to a batch on its way from the
//! engine to a subscriber, minus the store. It is the peer of the `floor` part's rows: what any
//! relay built on these libraries pays for a batch before it keeps anything.
//!
//! Per rank a thread with a libzmq SUB socket (as the relay's rank threads) decodes and normalizes
//! each batch with the relay's own code, gives it the next cursor, encodes its Subscribe message
//! once as the relay's in-memory tail does (`server::encode`), and hands it to the server
//! through a broadcast channel. The server is the relay's gRPC stack on one server thread (tonic,
//! the `Subscribe` response encoded once and shared, as `--server-threads 1`). No log, no live
//! set, no checkpoint, no history: a subscriber gets an empty snapshot at the current cursor,
//! then the records after it (its index is therefore not the engine's; only timing counts here).
//!
//! It runs as its own process (the bench binary again, with `KV_RELAY_BENCH_FORWARD` set), so
//! that its CPU is its own, as the relay's is, and on the relay's allocator ([`BenchAllocator`]:
//! glibc's malloc cost the relay a third of its CPU at these rates); the bench itself keeps the
//! system's.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kv_relay::model::{Record, RecordBody};
use kv_relay::normalize::Normalizer;
use kv_relay::server::encode::{subscribe_bytes, Shape};
use kv_relay::wire;
use kv_relay_proto::encoded::server::relay_server::{Relay, RelayServer};
use kv_relay_proto::encoded::SubscribeOut;
use kv_relay_proto::pb;
use pb::subscribe_response::Message as M;
use tokio::sync::broadcast;
use tonic::{Request, Response, Status};

/// The environment variable that makes the bench binary a forwarder: `rank=endpoint` pairs,
/// comma-separated.
pub const ENV: &str = "KV_RELAY_BENCH_FORWARD";

/// The bench's allocator: the relay's (`kv_relay_alloc`, mimalloc with the relay's options) in a
/// forwarder process, the system's in the bench. Which one is decided at the first allocation,
/// from the environment the process started with, so every block is freed by the allocator that
/// gave it.
pub struct BenchAllocator;

/// 0: not decided yet; 1: the system's; 2: the relay's.
static WHICH: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

#[allow(unsafe_code)]
fn relays_allocator() -> bool {
    match WHICH.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            extern "C" {
                fn getenv(name: *const std::os::raw::c_char) -> *mut std::os::raw::c_char;
            }
            // SAFETY: a NUL-terminated name; `getenv` allocates nothing, and nothing sets this
            // variable in the process (only the parent, before exec).
            let on = unsafe { !getenv(c"KV_RELAY_BENCH_FORWARD".as_ptr()).is_null() };
            WHICH.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
    }
}

// SAFETY: each call goes to one allocator, the same for the whole life of the process.
#[allow(unsafe_code)]
unsafe impl std::alloc::GlobalAlloc for BenchAllocator {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        if relays_allocator() {
            kv_relay_alloc::Allocator.alloc(l)
        } else {
            std::alloc::System.alloc(l)
        }
    }

    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        if relays_allocator() {
            kv_relay_alloc::Allocator.dealloc(p, l)
        } else {
            std::alloc::System.dealloc(p, l)
        }
    }

    unsafe fn alloc_zeroed(&self, l: std::alloc::Layout) -> *mut u8 {
        if relays_allocator() {
            kv_relay_alloc::Allocator.alloc_zeroed(l)
        } else {
            std::alloc::System.alloc_zeroed(l)
        }
    }

    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, n: usize) -> *mut u8 {
        if relays_allocator() {
            kv_relay_alloc::Allocator.realloc(p, l, n)
        } else {
            std::alloc::System.realloc(p, l, n)
        }
    }
}

/// The forwarder's epoch (any fixed value: it never restarts under a subscriber).
const EPOCH: u64 = 7;

struct Shared {
    /// The newest cursor given; records are sent under this lock, so in cursor order.
    cursor: Mutex<u64>,
    tx: broadcast::Sender<(u64, Bytes)>,
    ranks: Vec<u32>,
}

/// Runs the forwarder until stdin closes; prints `listening on http://ADDR` first.
pub fn main(spec: &str) {
    assert!(
        relays_allocator() && kv_relay_alloc::tuned(),
        "the forwarder runs on the relay's allocator, set as the relay sets it"
    );
    let endpoints: Vec<(u32, String)> = spec
        .split(',')
        .map(|p| {
            let (rank, ep) = p.split_once('=').expect("rank=endpoint");
            (rank.parse().expect("rank"), ep.to_string())
        })
        .collect();
    let (tx, _) = broadcast::channel(4096);
    let shared = Arc::new(Shared { cursor: Mutex::new(0), tx, ranks: endpoints.iter().map(|(r, _)| *r).collect() });
    let stop = Arc::new(AtomicBool::new(false));
    let ctx = zmq::Context::new();
    let mut threads = Vec::new();
    for (rank, ep) in endpoints {
        let sock = ctx.socket(zmq::SUB).expect("SUB");
        sock.set_linger(0).expect("linger");
        sock.set_rcvhwm(100_000).expect("hwm");
        sock.set_subscribe(b"").expect("subscribe");
        sock.connect(&ep).expect("connect");
        let (shared, stop) = (shared.clone(), stop.clone());
        threads.push(
            std::thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn(move || {
                    let mut norm = Normalizer::new();
                    while !stop.load(Ordering::Relaxed) {
                        match sock.poll(zmq::POLLIN, 50) {
                            Ok(n) if n > 0 => {}
                            _ => continue,
                        }
                        let Ok(frames) = sock.recv_multipart(0) else { continue };
                        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
                        let Ok(f) = wire::split_pub(&refs) else { continue };
                        let seq = f.seq;
                        let Ok(raw) = wire::decode_batch(f.payload) else { continue };
                        let n = norm.normalize(raw.dp_rank.unwrap_or(rank), seq, raw);
                        let mut cursor = shared.cursor.lock().expect("cursor");
                        *cursor += 1;
                        let body = RecordBody::Batch { batch: n.batch, load: None, liveness: None };
                        let r = Record { cursor: *cursor, incarnation: 1, body };
                        // No receiver yet is not an error: nobody subscribes.
                        let _ = shared.tx.send((*cursor, subscribe_bytes(&r, Shape::Full)));
                    }
                })
                .expect("thread"),
        );
    }

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        println!("listening on http://{}", listener.local_addr().expect("addr"));
        // As the relay's server: each record is written as it comes (no Nagle delay).
        let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        let server = tonic::transport::Server::builder()
            .add_service(RelayServer::new(Forwarder { shared }))
            .serve_with_incoming_shutdown(incoming, async {
                // Ends when the bench closes our stdin (or goes away).
                let _ = tokio::task::spawn_blocking(|| {
                    let mut sink = Vec::new();
                    let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
                })
                .await;
            });
        server.await.expect("serve");
    });
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
}

struct Forwarder {
    shared: Arc<Shared>,
}

type BoxStream<T> = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl Relay for Forwarder {
    type SubscribeStream = BoxStream<SubscribeOut>;
    type HistoryStream = BoxStream<pb::HistoryResponse>;
    type SnapshotStream = BoxStream<pb::SnapshotResponse>;

    async fn subscribe(&self, _: Request<pb::SubscribeRequest>) -> Result<Response<Self::SubscribeStream>, Status> {
        // Receive first, then read the cursor: every record after it comes through `rx`.
        let mut rx = self.shared.tx.subscribe();
        let at = *self.shared.cursor.lock().expect("cursor");
        let begin = pb::SnapshotBegin { cursor: at, epoch: EPOCH, incarnation: 1, ..Default::default() };
        let end = pb::SnapshotEnd { cursor: at, incarnation: 1, block_count: 0 };
        let head = [M::SnapshotBegin(begin), M::SnapshotEnd(end)]
            .map(|m| Ok(SubscribeOut::Message(pb::SubscribeResponse { message: Some(m) })));
        let records = async_stream(move |tx| async move {
            loop {
                match rx.recv().await {
                    Ok((c, _)) if c <= at => {}
                    Ok((_, bytes)) => {
                        if tx.send(Ok(SubscribeOut::Encoded(bytes))).await.is_err() {
                            return;
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        let _ = tx.send(Err(Status::data_loss(format!("fell {n} records behind")))).await;
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::StreamExt::chain(tokio_stream::iter(head), records))))
    }

    async fn status(&self, _: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        let newest = *self.shared.cursor.lock().expect("cursor");
        Ok(Response::new(pb::StatusResponse {
            epoch: EPOCH,
            incarnation: 1,
            newest_cursor: newest,
            ranks: self
                .shared
                .ranks
                .iter()
                .map(|&r| pb::RankStatus { dp_rank: r, state: pb::RankState::Ok as i32, ..Default::default() })
                .collect(),
            ..Default::default()
        }))
    }

    async fn history(&self, _: Request<pb::HistoryRequest>) -> Result<Response<Self::HistoryStream>, Status> {
        Err(Status::unimplemented("the forwarder keeps no history"))
    }

    async fn snapshot(&self, _: Request<pb::SnapshotRequest>) -> Result<Response<Self::SnapshotStream>, Status> {
        Err(Status::unimplemented("the forwarder keeps no live set"))
    }
}

/// A stream fed by a task through a channel of one (the tonic pattern).
fn async_stream<T: Send + 'static, F>(f: impl FnOnce(tokio::sync::mpsc::Sender<T>) -> F) -> BoxStreamOf<T>
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(f(tx));
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

type BoxStreamOf<T> = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = T> + Send>>;

/// The forwarder as the bench runs it: its own process, stopped by closing its stdin.
pub struct ForwarderProc {
    child: std::process::Child,
    url: String,
}

impl ForwarderProc {
    pub fn start(endpoints: &[(u32, String)]) -> ForwarderProc {
        use std::io::BufRead;
        let spec: Vec<String> = endpoints.iter().map(|(r, e)| format!("{r}={e}")).collect();
        let mut child = std::process::Command::new(std::env::current_exe().expect("bench binary"))
            .env(ENV, spec.join(","))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("start the forwarder");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("forwarder's address");
        let url = line.trim().strip_prefix("listening on ").expect("listening on ...").to_string();
        ForwarderProc { child, url }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for ForwarderProc {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
