//! The producers behind the server streams, each reading the store and sending through a bounded
//! channel. A History or Snapshot producer is a task of its own (the tonic pattern: stop when
//! `send` fails, the client went away). A Subscribe producer is run by its response stream
//! ([`Driven`]), on the connection's task: a commit then wakes one task, not two, and the
//! producer goes when the stream goes.
//!
//! # Reads
//! A subscriber reads the history from the store, a page at a time, at its own pace. The newest
//! records come from the store's in-memory tail ([`Store::recent`]): shared by every subscriber,
//! each record encoded as its Subscribe message once (every stream sends the same bytes), and
//! read without the blocking pool. Only a subscriber behind that tail reads the log.
//!
//! # Memory per subscriber
//! A subscriber holds at most one page of records ([`ServerConfig::history_page`] records) and
//! its channel ([`ServerConfig::stream_buffer`] entries: records shared with the store's tail, or
//! messages of its own), plus a broadcast receiver (a cursor into the one shared notice ring). A
//! lagging subscriber therefore costs at most
//! `(history_page + stream_buffer) × the largest record`, however far behind it is; while it
//! sends a snapshot it holds one chunk (`snapshot_chunk_blocks` blocks) instead of a page.

use super::convert::{load_to_pb, record_rank, record_to_pb, snapshot_block_to_pb};
use super::encode::{subscribe_bytes, Shape};
use super::ServerConfig;
use crate::shutdown::Shutdown;
use crate::status::{Notice, RelayStatusHandle};
use crate::store::{Committed, SnapshotFilter, Store, StoreError};
use kv_relay_proto::encoded::SubscribeOut;
use kv_relay_proto::pb;
use pb::subscribe_response::Message as M;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{broadcast, mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tonic::Status;

/// The client went away, or the stream ended with a status already sent.
pub(crate) struct Stop;

pub(crate) type Tx<T> = mpsc::Sender<Result<T, Status>>;

async fn send<T>(tx: &Tx<T>, item: Result<T, Status>) -> Result<(), Stop> {
    tx.send(item).await.map_err(|_| Stop)
}

pub(crate) fn store_status(e: StoreError) -> Status {
    Status::internal(format!("store: {e}"))
}

/// Runs a blocking store read off the async workers.
pub(crate) async fn blocking<R: Send + 'static>(
    f: impl FnOnce() -> Result<R, StoreError> + Send + 'static,
) -> Result<R, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("store read task failed: {e}")))?
        .map_err(store_status)
}

/// The incarnation that committed `cursor` (the last incarnation that began at or before it);
/// the store's current one for cursor 0.
pub(crate) fn incarnation_of(store: &Store, cursor: u64) -> u32 {
    if cursor == 0 {
        return store.incarnation();
    }
    store
        .incarnations()
        .iter()
        .rev()
        .find(|(_, &first)| first <= cursor)
        .map(|(&i, _)| i)
        .unwrap_or_else(|| store.incarnation())
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// The pieces of a snapshot stream, wrapped into the RPC's own message type by `wrap`.
pub(crate) enum SnapPart {
    Begin(pb::SnapshotBegin),
    Chunk(pb::SnapshotChunk),
    End(pb::SnapshotEnd),
}

/// Streams a snapshot (begin, chunks, end) and returns its cursor. Holds one chunk at a time;
/// chunks are copied from the live set on the blocking pool, one per trip.
pub(crate) async fn send_snapshot<T>(
    store: &Store,
    filter: SnapshotFilter,
    chunk_blocks: usize,
    reason: pb::SnapshotReason,
    tx: &Tx<T>,
    wrap: impl Fn(SnapPart) -> T,
) -> Result<u64, Stop> {
    let ranks = filter.ranks.clone().unwrap_or_default();
    let s = store.clone();
    metrics::counter!("kv_relay_snapshots_served_total").increment(1);
    let mut snap = match blocking(move || s.snapshot(filter)).await {
        Ok(s) => s,
        Err(st) => {
            let _ = send(tx, Err(st)).await;
            return Err(Stop);
        }
    };
    snap.chunk_blocks = chunk_blocks.max(1);
    let cursor = snap.cursor;
    let incarnation = incarnation_of(store, cursor);
    let begin = pb::SnapshotBegin {
        cursor,
        epoch: snap.epoch,
        incarnation,
        block_count: Some(snap.blocks),
        reason: reason as i32,
        ranks,
    };
    send(tx, Ok(wrap(SnapPart::Begin(begin)))).await?;
    let mut sent = 0u64;
    loop {
        let (back, chunk) = match tokio::task::spawn_blocking(move || {
            let c = snap.next();
            (snap, c)
        })
        .await
        {
            Ok(r) => r,
            Err(e) => {
                let _ = send(tx, Err(Status::internal(format!("snapshot read task failed: {e}")))).await;
                return Err(Stop);
            }
        };
        snap = back;
        match chunk {
            None => break,
            Some(Ok(blocks)) => {
                sent += blocks.len() as u64;
                let chunk = pb::SnapshotChunk { blocks: blocks.into_iter().map(snapshot_block_to_pb).collect() };
                send(tx, Ok(wrap(SnapPart::Chunk(chunk)))).await?;
            }
            Some(Err(e)) => {
                let _ = send(tx, Err(store_status(e))).await;
                return Err(Stop);
            }
        }
    }
    send(tx, Ok(wrap(SnapPart::End(pb::SnapshotEnd { cursor, incarnation, block_count: sent })))).await?;
    Ok(cursor)
}

/// What a Subscribe producer queues for its connection.
pub(crate) enum Outgoing {
    /// A record, shared with the store's tail and every other subscriber, and the shape this
    /// subscriber asked for.
    Record(Arc<Committed>, Shape),
    Message(pb::SubscribeResponse),
}

impl Outgoing {
    /// The message to send: a record's is encoded once, and every subscriber sends its bytes.
    pub(crate) fn into_message(self) -> SubscribeOut {
        match self {
            Outgoing::Record(c, shape) => {
                SubscribeOut::Encoded(c.subscribe_encoded(shape == Shape::Lean, |r| subscribe_bytes(r, shape)))
            }
            Outgoing::Message(m) => SubscribeOut::Message(m),
        }
    }
}

/// A Subscribe response stream that runs its own producer: the producer is polled by the task
/// that polls the stream (the connection's), so a commit wakes that one task, which reads the
/// record and sends it, rather than a producer task that then wakes the sender. Every item the
/// producer queues is queued while this stream polls it, so the queue is read without a waker
/// of its own. When the stream is dropped (the client went away), so is its producer.
pub(crate) struct Driven<F> {
    producer: Option<std::pin::Pin<Box<F>>>,
    rx: mpsc::Receiver<Result<Outgoing, Status>>,
}

impl<F: std::future::Future<Output = ()>> Driven<F> {
    /// `producer` sends into the channel whose receiver is `rx`.
    pub(crate) fn new(producer: F, rx: mpsc::Receiver<Result<Outgoing, Status>>) -> Self {
        Driven { producer: Some(Box::pin(producer)), rx }
    }
}

impl<F: std::future::Future<Output = ()>> tokio_stream::Stream for Driven<F> {
    type Item = Result<Outgoing, Status>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        let this = self.get_mut();
        loop {
            if let Ok(item) = this.rx.try_recv() {
                return Poll::Ready(Some(item));
            }
            let Some(producer) = this.producer.as_mut() else { return Poll::Ready(None) };
            if producer.as_mut().poll(cx).is_ready() {
                // Done: what it queued is still to be read.
                this.producer = None;
                continue;
            }
            return match this.rx.try_recv() {
                Ok(item) => Poll::Ready(Some(item)),
                Err(_) => Poll::Pending,
            };
        }
    }
}

/// Where a subscription starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Start {
    /// Every record after this cursor.
    After(u64),
    /// A snapshot first, then every record after its cursor.
    Snapshot(pb::SnapshotReason),
}

/// One Subscribe stream's producer.
pub(crate) struct Subscriber {
    pub store: Store,
    pub status: RelayStatusHandle,
    pub cfg: Arc<ServerConfig>,
    /// Live notices (heartbeats). Lossy: skipped while catching up.
    pub notices: broadcast::Receiver<Notice>,
    pub newest: watch::Receiver<u64>,
    pub shutdown: Shutdown,
    /// Only these ranks (`None`: all).
    pub ranks: Option<Vec<u32>>,
    pub snapshot_token_ids: bool,
    /// The records' shape: lean when the client asked to omit token ids.
    pub shape: Shape,
    pub start: Start,
    /// Snapshot slots, shared with the Snapshot RPC: a snapshot start waits for one.
    pub snapshot_slots: Arc<Semaphore>,
    /// The subscriber slot; released when the producer ends.
    pub _permit: OwnedSemaphorePermit,
}

/// What woke a live, quiet subscriber.
enum Wake {
    /// A commit (`false`: the store is gone).
    Commit(bool),
    Notice(Result<Notice, broadcast::error::RecvError>),
    Tick,
}

/// Decrements the subscriber count however the producer ends.
struct SubscriberCount(RelayStatusHandle);

impl Drop for SubscriberCount {
    fn drop(&mut self) {
        self.0.subscriber_closed();
    }
}

impl Subscriber {
    fn wants(&self, dp_rank: u32) -> bool {
        self.ranks.as_ref().is_none_or(|r| r.contains(&dp_rank))
    }

    pub(crate) async fn run(mut self, tx: Tx<Outgoing>) {
        self.status.subscriber_opened();
        let _counted = SubscriberCount(self.status.clone());
        let _ = self.produce(&tx).await;
    }

    async fn produce(&mut self, tx: &Tx<Outgoing>) -> Result<(), Stop> {
        let mut pos = match self.start {
            Start::After(c) => c,
            Start::Snapshot(reason) => {
                let _slot = tokio::select! {
                    slot = self.snapshot_slots.clone().acquire_owned() => slot.map_err(|_| Stop)?,
                    _ = tx.closed() => return Err(Stop),
                };
                let filter = SnapshotFilter {
                    ranks: self.ranks.clone(),
                    tiers: None,
                    include_token_ids: self.snapshot_token_ids,
                };
                let wrap = |p| {
                    Outgoing::Message(pb::SubscribeResponse {
                        message: Some(match p {
                            SnapPart::Begin(b) => M::SnapshotBegin(b),
                            SnapPart::Chunk(c) => M::SnapshotChunk(c),
                            SnapPart::End(e) => M::SnapshotEnd(e),
                        }),
                    })
                };
                send_snapshot(&self.store, filter, self.cfg.snapshot_chunk_blocks, reason, tx, wrap).await?
            }
        };
        let interval = self.cfg.heartbeat_interval;
        let mut last_sent = Instant::now();
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut notices_open = true;
        let mut newest_open = true;
        loop {
            // Mark the newest cursor seen before reading: a commit after this wakes the wait.
            self.newest.borrow_and_update();
            let page = self.cfg.history_page.max(1);
            // The newest records come from memory, shared with every subscriber and encoded
            // once; older ones are read from the log on the blocking pool.
            let records = match self.store.recent(pos, page) {
                Some(r) => r,
                None => {
                    let store = self.store.clone();
                    match blocking(move || store.history_shared(pos, page)).await {
                        Ok(r) => r,
                        Err(st) => return send(tx, Err(st)).await,
                    }
                }
            };
            if !records.is_empty() {
                let (n, hole) = continuing(pos, records.iter().map(|c| c.record.cursor));
                for c in &records[..n] {
                    pos = c.record.cursor;
                    if self.wants(record_rank(&c.record)) {
                        send(tx, Ok(Outgoing::Record(c.clone(), self.shape))).await?;
                        last_sent = Instant::now();
                    }
                }
                if let Some(next) = hole {
                    return self.resync(tx, pos, next).await;
                }
                continue;
            }
            // Nothing after `pos`: caught up, unless the records after it were trimmed away.
            if self.store.newest_cursor() > pos {
                match self.store.oldest_cursor() {
                    Some(o) if o <= pos + 1 => continue, // committed between the two reads
                    o => return self.resync(tx, pos, o.unwrap_or(self.store.newest_cursor() + 1)).await,
                }
            }
            // Live and quiet: wait for a commit, a notice, a heartbeat tick, or the end.
            let wake = tokio::select! {
                biased;
                _ = self.shutdown.recv() => return Err(Stop),
                _ = tx.closed() => return Err(Stop),
                r = self.newest.changed(), if newest_open => Wake::Commit(r.is_ok()),
                n = self.notices.recv(), if notices_open => Wake::Notice(n),
                _ = tick.tick() => Wake::Tick,
            };
            match wake {
                // The store was dropped: nothing more will be committed.
                Wake::Commit(open) => newest_open = open,
                Wake::Notice(Ok(Notice::Heartbeat { dp_rank, load })) => {
                    // The ingest sends these only while the rank is quiet: forward each.
                    if self.wants(dp_rank) {
                        send(tx, Ok(Outgoing::Message(self.heartbeat(dp_rank, load.as_ref().map(load_to_pb))))).await?;
                        last_sent = Instant::now();
                    }
                }
                Wake::Notice(Err(broadcast::error::RecvError::Lagged(_))) => {}
                Wake::Notice(Err(broadcast::error::RecvError::Closed)) => notices_open = false,
                Wake::Tick => {
                    if last_sent.elapsed() >= interval {
                        for (dp_rank, load) in self.own_heartbeats() {
                            send(tx, Ok(Outgoing::Message(self.heartbeat(dp_rank, load)))).await?;
                        }
                        last_sent = Instant::now();
                    }
                }
            }
        }
    }

    /// A heartbeat for `dp_rank` with `load` and the rank's engine liveness now.
    fn heartbeat(&self, dp_rank: u32, load: Option<pb::Load>) -> pb::SubscribeResponse {
        let liveness = self.status.rank(dp_rank).and_then(|r| r.liveness).as_ref().map(super::convert::liveness_to_pb);
        pb::SubscribeResponse {
            message: Some(M::Heartbeat(pb::Heartbeat {
                dp_rank,
                load,
                newest_cursor: self.store.newest_cursor(),
                sent_at_ms: unix_ms(),
                liveness,
            })),
        }
    }

    /// The server's own heartbeats when the ingest sent none: one per rank the status knows (and
    /// the filter passes), with its latest load; rank 0 when no rank is known yet.
    fn own_heartbeats(&self) -> Vec<(u32, Option<pb::Load>)> {
        let st = self.status.get();
        let mut out: Vec<_> = st
            .ranks
            .iter()
            .filter(|(r, _)| self.wants(**r))
            .map(|(r, s)| (*r, s.load.as_ref().map(load_to_pb)))
            .collect();
        if out.is_empty() {
            let r = self.ranks.as_ref().and_then(|r| r.first().copied()).unwrap_or(0);
            out.push((r, None));
        }
        out
    }

    /// The subscriber fell behind the history: say so, then end with `OUT_OF_RANGE`.
    async fn resync(&self, tx: &Tx<Outgoing>, pos: u64, oldest: u64) -> Result<(), Stop> {
        let reason =
            format!("subscriber fell behind the history: it is at cursor {pos}, the oldest record held is {oldest}");
        tracing::info!(pos, oldest, "subscriber told to resync");
        self.status.add("subscribers_resynced", 1);
        metrics::counter!("kv_relay_subscriber_resyncs_total").increment(1);
        let msg = pb::SubscribeResponse {
            message: Some(M::Resync(pb::Resync { reason: reason.clone(), after_cursor: pos, oldest_cursor: oldest })),
        };
        send(tx, Ok(Outgoing::Message(msg))).await?;
        send(tx, Err(Status::out_of_range(reason))).await?;
        Err(Stop)
    }
}

/// How many of `records` (a page read after cursor `pos`) continue `pos` without a hole, and
/// the cursor after the first hole. A page is read while commits trim the history: a trim that
/// overtakes the reader within a page leaves a hole, which a subscriber must never be sent across
/// (it resyncs instead).
fn continuing(pos: u64, cursors: impl ExactSizeIterator<Item = u64>) -> (usize, Option<u64>) {
    let n = cursors.len();
    match cursors.zip(pos + 1..).enumerate().find(|(_, (c, want))| c != want) {
        Some((i, (c, _))) => (i, Some(c)),
        None => (n, None),
    }
}

/// Streams the History RPC's records.
pub(crate) async fn send_history(
    store: Store,
    from: u64,
    to: u64,
    limit: u64,
    ranks: Option<Vec<u32>>,
    page: usize,
    tx: Tx<pb::HistoryResponse>,
) {
    let mut after = from.saturating_sub(1);
    let mut sent = 0u64;
    while sent < limit && after < to {
        let s = store.clone();
        let records = match blocking(move || s.history(after, page)).await {
            Ok(r) => r,
            Err(st) => {
                let _ = tx.send(Err(st)).await;
                return;
            }
        };
        if records.is_empty() {
            return;
        }
        for r in &records {
            if r.cursor > to || sent >= limit {
                return;
            }
            after = r.cursor;
            if ranks.as_ref().is_none_or(|rs| rs.contains(&record_rank(r))) {
                if tx.send(Ok(record_to_pb(r).into_history())).await.is_err() {
                    return;
                }
                sent += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::continuing;

    fn page(cursors: &[u64]) -> std::iter::Copied<std::slice::Iter<'_, u64>> {
        cursors.iter().copied()
    }

    #[test]
    fn a_page_is_sent_only_up_to_its_first_hole() {
        assert_eq!(continuing(4, page(&[5, 6, 7])), (3, None));
        // The history was trimmed past the reader mid-page: 7 and 8 are gone.
        assert_eq!(continuing(4, page(&[5, 6, 9, 10])), (2, Some(9)));
        // ... or before its first record.
        assert_eq!(continuing(4, page(&[6, 7])), (0, Some(6)));
        assert_eq!(continuing(4, page(&[])), (0, None));
    }
}
