//! Subscribers: the router client's admission and prefix index, fed by a Subscribe stream.

use super::*;

#[derive(Default)]
pub(crate) struct SubShared {
    pub(crate) cursor: AtomicU64,
    pub(crate) batches: AtomicU64,
    pub(crate) snapshots: AtomicU64,
    /// Subscribe streams opened.
    pub(crate) sessions: AtomicU64,
    pub(crate) record: AtomicBool,
    /// Engine publish → applied, ms.
    pub(crate) latencies: Mutex<Vec<f32>>,
    pub(crate) errors: Mutex<Vec<String>>,
}

pub(crate) struct SubState {
    pub(crate) admission: RelayAdmission,
    pub(crate) index: PrefixIndex,
}

pub(crate) struct Sub {
    pub(crate) shared: Arc<SubShared>,
    pub(crate) stop: tokio::sync::watch::Sender<bool>,
    pub(crate) task: tokio::task::JoinHandle<SubState>,
}

impl Sub {
    pub(crate) fn start(rt: &tokio::runtime::Handle, url: &str, state: Option<SubState>) -> Sub {
        let shared = Arc::new(SubShared::default());
        let state = state.unwrap_or_else(|| SubState {
            admission: RelayAdmission::new(url.to_string()),
            index: PrefixIndex::new(IndexConfig::default()),
        });
        shared.cursor.store(state.admission.position().cursor, Ordering::Relaxed);
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let task = rt.spawn(follow(url.to_string(), state, shared.clone(), stopped));
        Sub { shared, stop, task }
    }

    /// A subscriber that only reads its stream and counts batches: the relay does the same work
    /// for it as for an indexing one, this process much less (the extra subscribers of the shape
    /// rows, where eight indexes would bound the bench, not the relay). It decodes each message
    /// as [`ThinResponse`]: the batch's cursor, every other field skipped unread.
    pub(crate) fn start_counting(rt: &tokio::runtime::Handle, url: &str) -> Sub {
        let shared = Arc::new(SubShared::default());
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let task = rt.spawn(count(url.to_string(), shared.clone(), stopped));
        Sub { shared, stop, task }
    }

    pub(crate) fn cursor(&self) -> u64 {
        self.shared.cursor.load(Ordering::Relaxed)
    }

    pub(crate) fn finish(self, rt: &tokio::runtime::Runtime) -> SubState {
        let _ = self.stop.send(true);
        rt.block_on(self.task).expect("subscriber task")
    }
}

async fn follow(
    url: String,
    mut st: SubState,
    sh: Arc<SubShared>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> SubState {
    loop {
        if *stop.borrow() {
            return st;
        }
        if let Err(e) = session(&url, &mut st, &sh, &mut stop).await {
            sh.errors.lock().expect("errors").push(e);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The largest message a subscriber of this bench decodes.
pub(crate) const MAX_MESSAGE: usize = 64 << 20;

async fn channel(url: &str) -> Result<tonic::transport::Channel, String> {
    tonic::transport::Endpoint::from_shared(url.to_string())
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| e.to_string())
}

async fn connect(url: &str) -> Result<RelayClient<tonic::transport::Channel>, String> {
    Ok(RelayClient::new(channel(url).await?).max_decoding_message_size(MAX_MESSAGE))
}

async fn session(
    url: &str,
    st: &mut SubState,
    sh: &SubShared,
    stop: &mut tokio::sync::watch::Receiver<bool>,
) -> Result<(), String> {
    let mut client = connect(url).await?;
    let s = client.status(pb::StatusRequest {}).await.map_err(|e| e.to_string())?;
    st.admission.apply_status(s.get_ref(), &st.index);
    let req = st.admission.subscribe_request(true, false);
    let mut stream = client.subscribe(req).await.map_err(|e| e.to_string())?.into_inner();
    sh.sessions.fetch_add(1, Ordering::Relaxed);
    let mut events: Vec<ClientEvent> = Vec::new();
    loop {
        let msg = tokio::select! {
            biased;
            _ = stop.changed() => return Ok(()),
            m = stream.message() => m.map_err(|e| e.to_string())?.ok_or("stream ended")?,
        };
        let ts = match &msg.message {
            Some(pb::subscribe_response::Message::Batch(b)) => Some(b.engine_ts),
            _ => None,
        };
        let before = st.admission.position().cursor;
        let verdict = st.admission.apply(msg, &st.index, tokio::time::Instant::now(), &mut events);
        if let Some(ts) = ts {
            if sh.record.load(Ordering::Relaxed) {
                let ms = ((wall() - ts) * 1000.0) as f32;
                sh.latencies.lock().expect("latencies").push(ms);
            }
            sh.batches.fetch_add(1, Ordering::Relaxed);
        }
        for e in events.drain(..) {
            if let ClientEvent::SnapshotApplied { cursor, .. } = e {
                sh.snapshots.fetch_add(1, Ordering::Relaxed);
                // The records the snapshot stands for count as applied: the relay's records here
                // are batches (a control record, if any, would count as one too), so a subscriber
                // that was told to resync can drain again and the next steps are measured.
                sh.batches.fetch_add(cursor.saturating_sub(before), Ordering::Relaxed);
            }
        }
        sh.cursor.store(st.admission.position().cursor, Ordering::Relaxed);
        if let kv_router_client::Verdict::Resume(why) = verdict {
            return Err(why);
        }
    }
}

async fn count(url: String, sh: Arc<SubShared>, mut stop: tokio::sync::watch::Receiver<bool>) -> SubState {
    let mut after = 0u64;
    while !*stop.borrow() {
        if let Err(e) = count_session(&url, &sh, &mut stop, &mut after).await {
            sh.errors.lock().expect("errors").push(e);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    SubState { admission: RelayAdmission::new(url), index: PrefixIndex::new(IndexConfig::default()) }
}

/// A `SubscribeResponse` as a counting subscriber reads it: a batch's cursor (the contract's
/// tags: `batch = 1` in the response, `cursor = 1` in the batch) and a snapshot end's; prost
/// skips the rest.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ThinResponse {
    #[prost(message, optional, tag = "1")]
    pub(crate) batch: Option<ThinBatch>,
    /// A snapshot's end (`snapshot_end = 6`, its `cursor = 1`), after a resync.
    #[prost(message, optional, tag = "6")]
    pub(crate) snapshot_end: Option<ThinBatch>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ThinBatch {
    #[prost(uint64, tag = "1")]
    pub(crate) cursor: u64,
}

async fn count_session(
    url: &str,
    sh: &SubShared,
    stop: &mut tokio::sync::watch::Receiver<bool>,
    after: &mut u64,
) -> Result<(), String> {
    let mut grpc = tonic::client::Grpc::new(channel(url).await?).max_decoding_message_size(MAX_MESSAGE);
    grpc.ready().await.map_err(|e| e.to_string())?;
    let req = pb::SubscribeRequest { after_cursor: *after, allow_snapshot: true, ..Default::default() };
    let codec = tonic_prost::ProstCodec::<pb::SubscribeRequest, ThinResponse>::default();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/kv_relay.v1.Relay/Subscribe");
    let mut stream =
        grpc.server_streaming(tonic::Request::new(req), path, codec).await.map_err(|e| e.to_string())?.into_inner();
    sh.sessions.fetch_add(1, Ordering::Relaxed);
    loop {
        let msg = tokio::select! {
            biased;
            _ = stop.changed() => return Ok(()),
            m = stream.message() => m.map_err(|e| e.to_string())?.ok_or("stream ended")?,
        };
        if let Some(b) = &msg.batch {
            *after = b.cursor;
            sh.cursor.store(b.cursor, Ordering::Relaxed);
            sh.batches.fetch_add(1, Ordering::Relaxed);
        } else if let Some(e) = &msg.snapshot_end {
            // After a resync: the records the snapshot stands for count as received, as for an
            // indexing subscriber.
            sh.batches.fetch_add(e.cursor.saturating_sub(*after), Ordering::Relaxed);
            *after = e.cursor;
            sh.cursor.store(e.cursor, Ordering::Relaxed);
        }
    }
}

/// The peer: a ZeroMQ SUB on every rank that decodes and normalizes each batch.
pub(crate) struct Direct {
    pub(crate) record: Arc<AtomicBool>,
    pub(crate) latencies: Arc<Mutex<Vec<f32>>>,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) threads: Vec<std::thread::JoinHandle<()>>,
}

impl Direct {
    pub(crate) fn start(engine: &MockEngine) -> Direct {
        let record = Arc::new(AtomicBool::new(false));
        let latencies = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for ep in engine.endpoints() {
            let sock = ZmqSub::connect(engine.context(), &ep.publisher).expect("SUB");
            let (record, latencies, stop) = (record.clone(), latencies.clone(), stop.clone());
            threads.push(std::thread::spawn(move || {
                let mut norm = Normalizer::new();
                while !stop.load(Ordering::Relaxed) {
                    let Some(m) = sock.recv_raw(Duration::from_millis(50)) else { continue };
                    let refs: Vec<&[u8]> = m.frames.iter().map(Vec::as_slice).collect();
                    let Ok(f) = wire::split_pub(&refs) else { continue };
                    let seq = f.seq;
                    let Ok(raw) = wire::decode_batch(f.payload) else { continue };
                    let ts = raw.ts;
                    let n = norm.normalize(raw.dp_rank.unwrap_or(ep.rank), seq, raw);
                    std::hint::black_box(&n);
                    if record.load(Ordering::Relaxed) {
                        latencies.lock().expect("latencies").push(((wall() - ts) * 1000.0) as f32);
                    }
                }
            }));
        }
        Direct { record, latencies, stop, threads }
    }
}

impl Drop for Direct {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
