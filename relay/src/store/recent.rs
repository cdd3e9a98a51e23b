//! The newest committed records, kept in memory beside the history's log.
//!
//! Every subscriber that is caught up sends each new record. Without this ring each of them would
//! read it from the log, decode it, convert it to protobuf and encode that: with 64 subscribers,
//! 64 times per record, several times the commit's own cost. The ring holds each record once,
//! shared (`Arc`), with its Subscribe message encoded by the first subscriber to send it; the
//! others send the same bytes.
//!
//! The ring is a cache of the history's tail, never more: it holds consecutive cursors ending at
//! the newest commit of this process, never a record the history has trimmed, and a read it
//! cannot answer whole goes to the log. It is bounded by records and by encoded bytes; the newest
//! record is always kept.

use crate::model::Record;
use bytes::Bytes;
use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};

/// How much of the history's tail is kept in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecentLimits {
    pub max_records: usize,
    /// Sum of the records' encoded sizes (as in the history).
    pub max_bytes: u64,
}

impl Default for RecentLimits {
    fn default() -> Self {
        RecentLimits { max_records: 1024, max_bytes: 16 << 20 }
    }
}

/// A committed record, shared by every reader of the ring.
#[derive(Debug)]
pub struct Committed {
    pub record: Record,
    /// Encoded size in the history.
    size: u64,
    /// The Subscribe messages for this record, each encoded once: full, and lean (what an
    /// index needs, `SubscribeRequest.omit_token_ids`).
    subscribe: [OnceLock<Bytes>; 2],
}

impl Committed {
    pub(crate) fn new(record: Record, size: u64) -> Self {
        Committed { record, size, subscribe: [OnceLock::new(), OnceLock::new()] }
    }

    /// The record's encoded size in the history.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The record's Subscribe message, encoded (`lean`: its lean shape): `make` runs for the
    /// first caller of that shape only, and every caller shares its bytes.
    pub fn subscribe_encoded(&self, lean: bool, make: impl FnOnce(&Record) -> Bytes) -> Bytes {
        self.subscribe[usize::from(lean)].get_or_init(|| make(&self.record)).clone()
    }
}

#[derive(Debug, Default)]
pub(crate) struct Recent {
    items: VecDeque<Arc<Committed>>,
    bytes: u64,
    limits: RecentLimits,
}

impl Recent {
    pub(crate) fn new(limits: RecentLimits) -> Self {
        Recent { items: VecDeque::new(), bytes: 0, limits }
    }

    /// Appends records just committed (consecutive, after the newest held), then drops the
    /// oldest past the limits and those older than the history's `oldest` cursor.
    pub(crate) fn push(&mut self, committed: impl IntoIterator<Item = Arc<Committed>>, oldest: u64) {
        for c in committed {
            if self.items.back().is_some_and(|b| b.record.cursor + 1 != c.record.cursor) {
                // Not consecutive (cannot happen while commits are serialized): start over
                // rather than hold a hole.
                self.items.clear();
                self.bytes = 0;
            }
            self.bytes += c.size;
            self.items.push_back(c);
        }
        while self.items.len() > 1
            && (self.items.len() > self.limits.max_records
                || self.bytes > self.limits.max_bytes
                || self.items.front().is_some_and(|f| f.record.cursor < oldest))
        {
            let f = self.items.pop_front().expect("more than one item");
            self.bytes -= f.size;
        }
    }

    /// Up to `limit` records after cursor `after`, when the ring holds every one of them (the
    /// first is `after + 1`, or `after` is the newest); `None` when part of the answer is older
    /// than the ring.
    pub(crate) fn after(&self, after: u64, limit: usize) -> Option<Vec<Arc<Committed>>> {
        let front = self.items.front()?.record.cursor;
        let back = self.items.back()?.record.cursor;
        if after >= back {
            return Some(Vec::new());
        }
        if after + 1 < front {
            return None;
        }
        let skip = (after + 1 - front) as usize;
        Some(self.items.iter().skip(skip).take(limit).cloned().collect())
    }

    #[cfg(test)]
    fn cursors(&self) -> Vec<u64> {
        self.items.iter().map(|c| c.record.cursor).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Control, ControlKind, RecordBody};

    fn rec(cursor: u64, size: u64) -> Arc<Committed> {
        let body = RecordBody::Control(Control { dp_rank: 0, kind: ControlKind::RankRecovered });
        Arc::new(Committed::new(Record { cursor, incarnation: 1, body }, size))
    }

    fn cursors(v: Option<Vec<Arc<Committed>>>) -> Option<Vec<u64>> {
        v.map(|v| v.iter().map(|c| c.record.cursor).collect())
    }

    #[test]
    fn answers_only_what_it_holds_whole() {
        let mut r = Recent::new(RecentLimits { max_records: 3, max_bytes: 1000 });
        assert_eq!(cursors(r.after(0, 10)), None, "an empty ring answers nothing");
        r.push((5..=9).map(|c| rec(c, 10)), 1);
        assert_eq!(r.cursors(), vec![7, 8, 9], "bounded by records");
        assert_eq!(cursors(r.after(6, 10)), Some(vec![7, 8, 9]));
        assert_eq!(cursors(r.after(7, 1)), Some(vec![8]));
        assert_eq!(cursors(r.after(9, 10)), Some(vec![]), "caught up");
        assert_eq!(cursors(r.after(12, 10)), Some(vec![]), "past the newest, as sled answers");
        assert_eq!(cursors(r.after(5, 10)), None, "cursor 6 is older than the ring");
    }

    #[test]
    fn bounded_by_bytes_and_by_the_history_but_keeps_the_newest() {
        let mut r = Recent::new(RecentLimits { max_records: 100, max_bytes: 25 });
        r.push([rec(1, 10), rec(2, 10)], 1);
        assert_eq!(r.cursors(), vec![1, 2]);
        r.push([rec(3, 10)], 1);
        assert_eq!((r.cursors(), r.bytes), (vec![2, 3], 20));
        r.push([rec(4, 40)], 1);
        assert_eq!((r.cursors(), r.bytes), (vec![4], 40), "the newest stays, even over the bound");
        r.push([rec(5, 1), rec(6, 1)], 6);
        assert_eq!((r.cursors(), r.bytes), (vec![6], 1), "nothing the history trimmed");
    }

    #[test]
    fn a_hole_starts_the_ring_over() {
        let mut r = Recent::new(RecentLimits::default());
        r.push([rec(1, 1), rec(2, 1)], 1);
        r.push([rec(4, 1)], 1);
        assert_eq!(r.cursors(), vec![4]);
        assert_eq!(cursors(r.after(2, 10)), None);
    }

    #[test]
    fn the_wire_form_is_made_once() {
        let c = rec(1, 1);
        let mut made = 0;
        for _ in 0..3 {
            for (lean, bytes) in [(false, b"full"), (true, b"lean")] {
                let b = c.subscribe_encoded(lean, |_| {
                    made += 1;
                    Bytes::from_static(bytes)
                });
                assert_eq!(b, Bytes::from_static(bytes));
            }
        }
        assert_eq!(made, 2);
    }
}
