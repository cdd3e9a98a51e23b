//! Crowd records: for a key with many holders, its holders as one cache line of bitsets, so
//! that a lookup reads a popular block once instead of one slot per (worker, tier) pair.
//!
//! A key whose live slots are at least [`CROWD`], all of workers below [`WIDE`] and all in one
//! tier (the common shape of a popular prefix: every worker holds the system prompt in its
//! device tier) has a *record*: its hash, its tier, and one bitset of workers per generation
//! tag. A lookup that finds one uses it in place of the key's slots ([`Table::holders`]);
//! keys without one (few holders, wide worker ids, several tiers, or their record's place
//! taken by another key) are read from their slots as before. So a record only saves reads:
//! it never decides an answer the slots would not.
//!
//! **Exact.** Records are written only by the shard's writers, under its mutex, inside the
//! key's crowded change ([`Table::change`]): every change of the slots of a key with at least
//! eight of them is crowded (one of them is outside the home group of seven), so a key's
//! record is brought up to date (or dropped) by every change of its slots, before the change's
//! second version raise and before the writer's call returns. Each record is a seqlock: its
//! sequence is odd while it is written, and a reader keeps what it read only if the sequence
//! was even and the same before and after. A reader therefore sees the key's holders as they
//! were before or after each change, never a torn mix: what reading the slots gives. The
//! records of a shard outlive its tables (a rebuild moves slots, not holders), so a rebuilt
//! table takes its predecessor's.
//!
//! **Place.** A shard has [`RECORDS`] records (allocated at its first crowded key: 8 KiB),
//! two-way set associative by hash. A crowded key whose two places are taken by other keys
//! has none until one is dropped (its key falls below [`CROWD`] slots, or stops fitting). One
//! word per shard says which pairs of places hold a record, so that a probe of a key without
//! one (most keys of a full table are homed in an overflowed group) reads no record's line.

use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::OnceLock;

use super::packed;
use super::table::Probe;

/// Live slots from which a key has a record (a key with this many spills out of its home
/// group, so every change of it is crowded).
pub(super) const CROWD: usize = 8;
/// Workers a record's bitsets cover: ids below this.
pub(super) const WIDE: u32 = 128;
/// Records per shard (a power of two; two per bit of [`Crowds::present`]).
const RECORDS: usize = 128;
/// In [`Record::meta`]: the record holds a key (its tier in the low byte).
const OWNED: u64 = 1 << 8;

/// One key's holders: per tag, the workers holding it (in `tier`, the only tier any of its
/// slots is in).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Crowd {
    pub tier: u8,
    pub workers: [u128; 2],
}

impl Crowd {
    /// The key's live slots: one per (worker, tag), all in one tier.
    pub fn slots(&self) -> usize {
        (self.workers[0].count_ones() + self.workers[1].count_ones()) as usize
    }

    /// The key's holders as packed slot values (worker, tag and tier; no entry, one copy),
    /// in worker order.
    pub fn for_each(&self, mut f: impl FnMut(u64)) {
        let mut all = self.workers[0] | self.workers[1];
        while all != 0 {
            let w = all.trailing_zeros();
            all &= all - 1;
            for tag in 0..2 {
                if self.workers[tag] >> w & 1 != 0 {
                    f(packed::holder(w, tag as u64, self.tier) | packed::NO_ENTRY_BITS | 1);
                }
            }
        }
    }

    /// The record a key with these live slots (packed values) has: `None` when it has none
    /// (fewer than [`CROWD`], a worker at or past [`WIDE`], or more than one tier).
    #[cfg(test)]
    pub fn of(values: impl IntoIterator<Item = u64>) -> Option<Crowd> {
        let mut t = Tally::default();
        values.into_iter().for_each(|v| t.add(v));
        t.crowd()
    }
}

/// Counts a key's live slots into the record it has ([`Tally::crowd`]).
#[derive(Default)]
pub(super) struct Tally {
    workers: [u128; 2],
    tiers: u64,
    slots: usize,
    wide: bool,
}

impl Tally {
    pub fn add(&mut self, v: u64) {
        let w = packed::worker_of(v);
        self.wide |= w >= WIDE;
        self.workers[packed::tag_of(v) as usize] |= 1u128.checked_shl(w).unwrap_or(0);
        self.tiers |= 1 << packed::tier_of(v);
        self.slots += 1;
    }

    /// False when the key has too few slots to have a record now or to have had one before a
    /// change of one slot: then there is nothing to write or drop.
    pub fn may_have_had_a_record(&self) -> bool {
        self.slots + 1 >= CROWD
    }

    /// The record of a key with the slots added: `None` when it has none (fewer than
    /// [`CROWD`], a worker at or past [`WIDE`], or more than one tier).
    pub fn crowd(&self) -> Option<Crowd> {
        let c = Crowd { tier: self.tiers.trailing_zeros() as u8, workers: self.workers };
        (self.slots >= CROWD && !self.wide && self.tiers.count_ones() == 1 && c.slots() == self.slots).then_some(c)
    }
}

#[repr(align(64))]
#[derive(Default)]
struct Record {
    /// Odd while the record is written.
    seq: AtomicU64,
    hash: AtomicU64,
    /// `OWNED | tier`, or 0 when free.
    meta: AtomicU64,
    workers: [AtomicU64; 4],
}

/// A shard's records (see the module docs).
#[derive(Default)]
pub(super) struct Crowds {
    /// Bit `i`: a record of places `2i` and `2i + 1` holds a key. A lookup reads this word
    /// (kept in cache by every probe) before a record's line, so that the probes of keys
    /// without one cost no miss: a stale bit only sends it to the line, or to the slots.
    present: AtomicU64,
    records: OnceLock<Box<[Record]>>,
}

/// The two places of `p`'s key.
fn places(p: &Probe) -> [usize; 2] {
    let i = (p.mixed() >> 20) as usize & (RECORDS - 1) & !1;
    [i, i + 1]
}

impl Crowds {
    /// The holders of `p`'s key by its record, if it has one and it was not being written.
    /// Lock-free.
    #[inline]
    pub fn get(&self, p: &Probe) -> Option<Crowd> {
        let places = places(p);
        if self.present.load(Ordering::Relaxed) >> (places[0] / 2) & 1 == 0 {
            return None;
        }
        let records = self.records.get()?;
        for i in places {
            let r = &records[i];
            let seq = r.seq.load(Ordering::Acquire);
            if r.hash.load(Ordering::Relaxed) != p.hash {
                continue;
            }
            let meta = r.meta.load(Ordering::Relaxed);
            let w: [u64; 4] = std::array::from_fn(|k| r.workers[k].load(Ordering::Relaxed));
            // A seqlock's second read: the record's fields are written after its odd sequence,
            // behind a `Release` fence.
            fence(Ordering::Acquire);
            if seq & 1 != 0 || r.seq.load(Ordering::Relaxed) != seq || meta & OWNED == 0 {
                return None;
            }
            let tag = |k: usize| (w[2 * k] as u128) | ((w[2 * k + 1] as u128) << 64);
            return Some(Crowd { tier: meta as u8, workers: [tag(0), tag(1)] });
        }
        None
    }

    /// Sets the record of `p`'s key to `crowd` (its holders now), or drops it (`None`).
    /// Caller holds the shard's mutex: records have one writer at a time.
    pub fn set(&self, p: &Probe, crowd: Option<Crowd>) {
        let records = match crowd {
            Some(_) => self.records.get_or_init(|| (0..RECORDS).map(|_| Record::default()).collect()),
            None => match self.records.get() {
                Some(r) => r,
                None => return,
            },
        };
        let owned = |r: &Record| r.meta.load(Ordering::Relaxed) & OWNED != 0;
        let [a, b] = places(p).map(|i| &records[i]);
        let mine = [a, b].into_iter().find(|r| owned(r) && r.hash.load(Ordering::Relaxed) == p.hash);
        let Some(r) = mine.or_else(|| crowd.and([a, b].into_iter().find(|r| !owned(r)))) else {
            return;
        };
        let seq = r.seq.load(Ordering::Relaxed);
        r.seq.store(seq + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        match crowd {
            Some(c) => {
                r.hash.store(p.hash, Ordering::Relaxed);
                r.meta.store(OWNED | c.tier as u64, Ordering::Relaxed);
                for (k, w) in c.workers.iter().enumerate() {
                    r.workers[2 * k].store(*w as u64, Ordering::Relaxed);
                    r.workers[2 * k + 1].store((*w >> 64) as u64, Ordering::Relaxed);
                }
            }
            None => r.meta.store(0, Ordering::Relaxed),
        }
        r.seq.store(seq + 2, Ordering::Release);
        let bit = 1 << (places(p)[0] / 2);
        let present = self.present.load(Ordering::Relaxed);
        let present = if owned(a) || owned(b) { present | bit } else { present & !bit };
        self.present.store(present, Ordering::Release);
    }

    /// Heap bytes.
    pub fn bytes(&self) -> usize {
        self.records.get().map_or(0, |r| r.len() * std::mem::size_of::<Record>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(worker: u32, tag: u64, tier: u8) -> u64 {
        packed::holder(worker, tag, tier) | 1
    }

    #[test]
    fn a_record_is_kept_for_eight_slots_of_narrow_workers_in_one_tier() {
        let eight: Vec<u64> = (0..8).map(|w| slot(w * 16 + 1, w as u64 % 2, 3)).collect();
        let c = Crowd::of(eight.iter().copied()).expect("eight slots in one tier");
        assert_eq!(c.tier, 3);
        assert_eq!(c.workers, [1 << 1 | 1 << 33 | 1 << 65 | 1 << 97, 1 << 17 | 1 << 49 | 1 << 81 | 1 << 113]);
        assert_eq!(c.slots(), 8);
        let mut back = Vec::new();
        c.for_each(|v| back.push(v & packed::HOLDER));
        assert_eq!(back, eight.iter().map(|v| v & packed::HOLDER).collect::<Vec<_>>());
        // Seven slots, a second tier, or a wide worker: no record.
        assert_eq!(Crowd::of(eight[..7].iter().copied()), None);
        assert_eq!(Crowd::of(eight.iter().copied().chain([slot(2, 0, 4)])), None);
        assert_eq!(Crowd::of(eight.iter().copied().chain([slot(WIDE, 0, 3)])), None);
        // One worker in both tags: two slots.
        let both: Vec<u64> = (0..4).flat_map(|w| [slot(w, 0, 0), slot(w, 1, 0)]).collect();
        assert_eq!(Crowd::of(both).map(|c| (c.workers, c.slots())), Some(([0xf, 0xf], 8)));
    }

    #[test]
    fn records_are_set_found_and_dropped_by_hash_two_per_place() {
        let crowds = Crowds::default();
        let c = |w: u128| Some(Crowd { tier: 1, workers: [w, 0] });
        // Three keys of the same places: the third finds none free until one is dropped.
        let mut same = Vec::new();
        let mut h = 0u64;
        while same.len() < 3 {
            let p = Probe::new(h);
            if same.is_empty() || places(&same[0]) == places(&p) {
                same.push(p);
            }
            h += 1;
        }
        assert_eq!(crowds.get(&same[0]), None);
        crowds.set(&same[0], None);
        assert_eq!(crowds.bytes(), 0, "nothing allocated until a key has a record");
        crowds.set(&same[0], c(0xff));
        crowds.set(&same[1], c(0xff00));
        crowds.set(&same[2], c(0xff_0000));
        assert_eq!(crowds.get(&same[0]), c(0xff));
        assert_eq!(crowds.get(&same[1]), c(0xff00));
        assert_eq!(crowds.get(&same[2]), None);
        crowds.set(&same[0], c(0x1ff));
        assert_eq!(crowds.get(&same[0]), c(0x1ff));
        crowds.set(&same[0], None);
        assert_eq!(crowds.get(&same[0]), None);
        crowds.set(&same[2], c(0xff_0000));
        assert_eq!(crowds.get(&same[2]), c(0xff_0000));
        assert_eq!(crowds.get(&same[1]), c(0xff00));
        assert_eq!(crowds.bytes(), RECORDS * 64);
        // The pair's presence bit goes with its last record.
        let bit = 1u64 << (places(&same[0])[0] / 2);
        assert_eq!(crowds.present.load(Ordering::Relaxed), bit);
        crowds.set(&same[1], None);
        assert_eq!(crowds.present.load(Ordering::Relaxed), bit);
        crowds.set(&same[2], None);
        assert_eq!(crowds.present.load(Ordering::Relaxed), 0);
        assert_eq!(crowds.get(&same[2]), None);
    }
}
