//! Commits: records encoded into one frame, appended to the log with one `write`, then applied
//! to the live set and published. A rank's position after each record is kept with it.

use super::codec::encode_record;
use super::error::{count, StoreError};
use super::log::{self, Writer};
use super::{Committed, RankCursor, Store, View};
use crate::model::{ControlKind, Event, Record, RecordBody, Tier};
use crate::sync::{Locked, ReadWrite};
use std::collections::BTreeMap;
use std::sync::Arc;

impl Store {
    /// Commits one record at the next cursor.
    pub fn commit(&self, body: RecordBody) -> Result<Record, StoreError> {
        let mut v = self.commit_many(vec![body])?;
        Ok(v.pop().expect("one record for one body").record.clone())
    }

    /// Commits records at consecutive cursors, all in one atomic write.
    pub fn commit_many(&self, mut bodies: Vec<RecordBody>) -> Result<Vec<Arc<Committed>>, StoreError> {
        self.commit_group(&mut bodies)
    }

    /// [`Store::commit_many`] of the bodies in `group`, taken from it; when the commit fails
    /// they are all put back, in order, for a retry, so a caller that must not lose them need
    /// not copy them first.
    pub fn commit_group(&self, group: &mut Vec<RecordBody>) -> Result<Vec<Arc<Committed>>, StoreError> {
        if group.is_empty() {
            return Ok(Vec::new());
        }
        let mut committed = Vec::with_capacity(group.len());
        let mut rest = std::mem::take(group).into_iter();
        let out = self.commit_into(&mut rest, &mut committed);
        if out.is_err() {
            // Nothing was published: each record is still only here.
            group.extend(committed.into_iter().map(|c| Arc::into_inner(c).expect("an unpublished record").record.body));
            group.extend(rest);
            return out.map(|()| Vec::new());
        }
        Ok(committed)
    }

    /// Encodes `bodies` into `committed` and writes them; on an error the bodies not taken yet
    /// stay in `bodies`, and those taken are in `committed`, none published.
    fn commit_into(
        &self,
        bodies: &mut impl Iterator<Item = RecordBody>,
        committed: &mut Vec<Arc<Committed>>,
    ) -> Result<(), StoreError> {
        let inner = &*self.inner;
        let sh = &*inner.shared;
        let mut guard = sh.writer.locked();
        let w = &mut *guard;
        w.usable("commit", &sh.dir)?;
        let mut counters = w.counters;
        let mut ranks: BTreeMap<u32, RankCursor> = BTreeMap::new();
        let mut added: Vec<u64> = Vec::new();
        let mut offsets: Vec<(u64, u32)> = Vec::new();
        let mut frame = std::mem::take(&mut w.frame);
        log::begin_frame(&mut frame, counters.newest + 1);
        for body in bodies {
            let record = Record { cursor: counters.newest + 1, incarnation: sh.incarnation, body };
            let bytes = check_tiers(&record.body)
                .and_then(|()| encode_record(&record).map_err(|detail| StoreError::Invalid { what: "record", detail }));
            let size = bytes.as_ref().map_or(0, |b| b.len() as u64);
            let cursor = record.cursor;
            // Taken either way: on an error it goes back with the others.
            committed.push(Arc::new(Committed::new(record, size)));
            let bytes = match bytes {
                Ok(b) => b,
                Err(e) => {
                    w.frame = frame;
                    return Err(count("commit", e));
                }
            };
            let body = &committed.last().expect("just pushed").record.body;
            let rank = rank_of(body);
            let row = ranks.entry(rank).or_insert_with(|| w.ranks.get(&rank).cloned().unwrap_or_default());
            rank_after(row, cursor, body);
            counters.newest = cursor;
            counters.hist_batches += 1;
            counters.hist_bytes += size;
            if counters.oldest == 0 {
                counters.oldest = cursor;
            }
            added.push(size);
            offsets.push(log::push_record(&mut frame, &bytes));
        }
        log::end_frame(&mut frame);
        let written = w.log.append(&frame, w.counters.newest + 1, &offsets, &sh.log);
        w.frame = frame;
        if let Err((e, fatal)) = written {
            let e = StoreError::io("commit", &sh.dir, e);
            return Err(if fatal { w.fail("commit", e) } else { count("commit", e) });
        }
        let trimmed = log::trim(&mut counters, inner.limits, &w.sizes, &added);
        // Written: apply to the live set, then publish.
        {
            let mut live = sh.live.locked();
            for c in committed.iter() {
                live.apply(c.record.cursor, &c.record.body);
            }
        }
        let drop_sizes = trimmed.min(w.sizes.len());
        w.sizes.drain(..drop_sizes);
        let skip_added = trimmed - drop_sizes;
        w.sizes.extend(added.iter().skip(skip_added));
        w.appended += added.iter().sum::<u64>();
        w.counters = counters;
        w.ranks.extend(ranks);
        inner.recent.writing().push(committed.iter().cloned(), counters.oldest);
        *inner.shared.view.writing() = View { counters, ranks: w.ranks.clone() };
        let due = self.checkpoint_due(w);
        let keep = w.keep_from();
        drop(guard);
        if sh.log.reading().removable(keep) {
            sh.prune_log_before(keep);
        }
        inner.newest_tx.send_replace(counters.newest);
        if due {
            if let Some(tx) = &*inner.checkpoint_tx.locked() {
                let _ = tx.try_send(());
            }
        }
        Ok(())
    }

    /// Whether a checkpoint should begin now ([`CheckpointPolicy`]); marks it running if so.
    fn checkpoint_due(&self, w: &Writer) -> bool {
        let inner = &*self.inner;
        let mut c = inner.shared.checkpoints.locked();
        if c.running {
            return false;
        }
        let every_records = inner.policy.every_records;
        let every_bytes = inner.policy.every_bytes.max(c.last.map_or(0, |l| l.bytes));
        let due = w.counters.newest - c.began.0 >= every_records || w.appended - c.began.1 >= every_bytes;
        c.running = due;
        due
    }

    /// Makes every commit so far durable (a background thread otherwise does it every
    /// `log::SYNC_EVERY`). Commits go on meanwhile. A failed sync fails the store: nothing more is
    /// written until it is reopened (see `log.rs`, "A failed write").
    pub fn flush(&self) -> Result<(), StoreError> {
        self.inner.shared.sync_log("flush")
    }
}

/// A tier name the checkpoints' layout cannot hold (over 65,535 bytes) is refused at commit.
fn check_tiers(body: &RecordBody) -> Result<(), StoreError> {
    let RecordBody::Batch { batch, .. } = body else { return Ok(()) };
    for e in &batch.events {
        let tier = match e {
            Event::Stored(s) => Some(&s.tier),
            Event::Removed(r) => Some(&r.tier),
            Event::Cleared(c) => c.tier.as_ref(),
        };
        if let Some(Tier::Other(name)) = tier {
            if name.len() > usize::from(u16::MAX) {
                return Err(StoreError::Invalid { what: "tier", detail: format!("tier name of {} bytes", name.len()) });
            }
        }
    }
    Ok(())
}

/// The rank a record is of.
pub(super) fn rank_of(body: &RecordBody) -> u32 {
    match body {
        RecordBody::Batch { batch, .. } => batch.dp_rank,
        RecordBody::Control(c) => c.dp_rank,
    }
}

/// A rank's position after its record at `cursor`.
pub(super) fn rank_after(row: &mut RankCursor, cursor: u64, body: &RecordBody) {
    row.last_cursor = cursor;
    match body {
        RecordBody::Batch { batch, .. } => (row.last_seq, row.last_ts) = (Some(batch.seq), Some(batch.ts)),
        RecordBody::Control(c) => match &c.kind {
            ControlKind::RankReset { .. } => (row.last_seq, row.last_ts) = (None, None),
            kind => row.health = row.health.after(kind),
        },
    }
}
