//! One shard's open-addressing multimap `block hash -> packed holder`, readable without locks.
//!
//! Layout: `slots[i] = (key: AtomicU64, val: AtomicU64)` (16 bytes) plus one control byte per
//! slot, eight of them packed into an `AtomicU64` per group of eight slots. A control byte is
//! `EMPTY` (0x80) or a 7-bit fingerprint of the key. A hash held by several (worker, tier)
//! pairs occupies several slots, all with the same key (a multimap): a lookup walks the groups
//! from the key's home group and stops after the first group that still has an `EMPTY` byte.
//!
//! `val` packs one holder: `worker:23 | tag:1 | tier:8 | copies:32` (high to low bits); the
//! all-ones value `TOMB` marks a removed holder.
//!
//! Invariants that make lock-free reads sound (all writers hold the shard's mutex):
//! - A control byte only ever goes `EMPTY -> fingerprint`, published with `Release` after the
//!   slot's key and value were written; so a reader that sees the byte sees the key.
//! - A slot's key never changes once published. A tombstoned slot is only reused for a holder
//!   of the *same* key; slots are recycled for other keys only by a rebuild into a new table.
//!   So a reader that loads `val` and then `key` of a published slot never pairs a value with
//!   another key's hash.
//! - A table never gets fuller than 7/8 (live + tombstones), so every probe ends.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// The value of a removed holder. Never a live value: worker ids stop below 2^23 - 1.
pub(super) const TOMB: u64 = u64::MAX;
/// Mask of the `copies` bits of a packed value.
pub(super) const COPIES: u64 = 0xffff_ffff;
/// Mask of the holder bits (worker, tag, tier) of a packed value.
pub(super) const HOLDER: u64 = !COPIES;

const GROUP: usize = 8;
const EMPTY_WORD: u64 = 0x8080_8080_8080_8080;
const HI: u64 = 0x8080_8080_8080_8080;
const LO: u64 = 0x0101_0101_0101_0101;
const MIN_GROUPS: usize = 2;

/// Packs a holder (without copies).
pub(super) const fn holder(worker: u32, tag: u64, tier: u8) -> u64 {
    ((worker as u64) << 41) | (tag << 40) | ((tier as u64) << 32)
}

/// Worker id of a packed value.
pub(super) const fn worker_of(v: u64) -> u32 {
    (v >> 41) as u32
}

/// Generation tag (0 or 1) of a packed value.
pub(super) const fn tag_of(v: u64) -> u64 {
    (v >> 40) & 1
}

/// Tier id of a packed value.
pub(super) const fn tier_of(v: u64) -> u8 {
    (v >> 32) as u8
}

/// Where a block hash lives: computed once per hash from a strong mix of it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Probe {
    pub hash: u64,
    mixed: u64,
}

impl Probe {
    pub fn new(hash: u64) -> Self {
        // A 64-bit finalizer: engine hashes are already uniform, but tests and synthetic
        // workloads use small integers, and the shard, home group and fingerprint must not
        // correlate.
        let mut x = hash;
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 33;
        x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        x ^= x >> 33;
        Self { hash, mixed: x }
    }

    /// Bits 32.. choose the shard.
    pub fn shard(&self, mask: usize) -> usize {
        (self.mixed >> 32) as usize & mask
    }

    /// Bits 57..64: the control-byte fingerprint (0..=0x7f).
    fn fingerprint(&self) -> u8 {
        (self.mixed >> 57) as u8
    }

    /// Bits 0..32 pick the home group by multiply-shift (group counts need not be powers of 2).
    fn home(&self, groups: usize) -> usize {
        (((self.mixed & 0xffff_ffff) * groups as u64) >> 32) as usize
    }
}

/// Bytes of `word` equal to `fp` (bit 7 of each matching byte set). May flag a full byte next
/// to a true match (borrow), never an `EMPTY` byte; callers compare keys anyway.
fn match_byte(word: u64, fp: u8) -> u64 {
    let x = word ^ (LO * fp as u64);
    x.wrapping_sub(LO) & !x & HI
}

struct Slot {
    key: AtomicU64,
    val: AtomicU64,
}

/// Outcome of [`Table::add`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Added {
    /// The copies were added (`saturated` if the counter hit `u32::MAX`).
    Done { saturated: bool },
    /// A new slot was needed and the table is at its load limit: rebuild, then retry.
    Full,
}

pub(super) struct Table {
    ctrl: Box<[AtomicU64]>,
    slots: Box<[Slot]>,
    /// Live holders. Written only under the shard's mutex; atomic so stats can read it.
    live: AtomicUsize,
    /// Tombstoned slots (still bound to their key).
    tombs: AtomicUsize,
}

impl Table {
    /// A table sized so that `live` entries fill it to about 60%.
    pub fn for_entries(live: usize) -> Self {
        let slots = live.saturating_mul(5) / 3;
        Self::with_groups((slots / GROUP + 1).max(MIN_GROUPS))
    }

    fn with_groups(groups: usize) -> Self {
        Self {
            ctrl: (0..groups).map(|_| AtomicU64::new(EMPTY_WORD)).collect(),
            slots: (0..groups * GROUP).map(|_| Slot { key: AtomicU64::new(0), val: AtomicU64::new(0) }).collect(),
            live: AtomicUsize::new(0),
            tombs: AtomicUsize::new(0),
        }
    }

    pub fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    pub fn tombs(&self) -> usize {
        self.tombs.load(Ordering::Relaxed)
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Heap bytes of this table (control words and slots) plus its header.
    pub fn bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.ctrl.len() * std::mem::size_of::<AtomicU64>()
            + self.slots.len() * std::mem::size_of::<Slot>()
    }

    fn max_used(&self) -> usize {
        self.capacity() - self.capacity() / 8
    }

    /// Loads the cache lines a probe for `p` will read first (its home group's control word
    /// and slots), so that callers can issue the loads of several probes before using any:
    /// their cache misses then overlap. Returns a value to feed to `black_box`.
    #[inline]
    pub fn touch(&self, p: &Probe) -> u64 {
        let g = p.home(self.ctrl.len());
        self.ctrl[g].load(Ordering::Relaxed)
            ^ self.slots[g * GROUP].val.load(Ordering::Relaxed)
            ^ self.slots[g * GROUP + GROUP / 2].val.load(Ordering::Relaxed)
    }

    /// Calls `f` with every live packed value stored under `p.hash`. Lock-free; may be called
    /// while a writer modifies the table (it then sees each slot either before or after).
    #[inline]
    pub fn for_each(&self, p: &Probe, mut f: impl FnMut(u64)) {
        let groups = self.ctrl.len();
        let fp = p.fingerprint();
        let mut g = p.home(groups);
        loop {
            let word = self.ctrl[g].load(Ordering::Acquire);
            let mut m = match_byte(word, fp);
            while m != 0 {
                let slot = &self.slots[g * GROUP + (m.trailing_zeros() / 8) as usize];
                m &= m - 1;
                let v = slot.val.load(Ordering::Acquire);
                if v != TOMB && slot.key.load(Ordering::Relaxed) == p.hash {
                    f(v);
                }
            }
            if word & HI != 0 {
                return;
            }
            g += 1;
            if g == groups {
                g = 0;
            }
        }
    }

    /// Adds `copies` (> 0) to `holder` under `p.hash`. Caller holds the shard's mutex.
    pub fn add(&self, p: &Probe, holder: u64, copies: u32) -> Added {
        debug_assert!(copies > 0 && holder & COPIES == 0);
        let groups = self.ctrl.len();
        let fp = p.fingerprint();
        let mut g = p.home(groups);
        let mut reuse: Option<usize> = None;
        loop {
            let word = self.ctrl[g].load(Ordering::Relaxed);
            let mut m = match_byte(word, fp);
            while m != 0 {
                let i = g * GROUP + (m.trailing_zeros() / 8) as usize;
                m &= m - 1;
                let slot = &self.slots[i];
                if slot.key.load(Ordering::Relaxed) != p.hash {
                    continue;
                }
                let v = slot.val.load(Ordering::Relaxed);
                if v == TOMB {
                    reuse.get_or_insert(i);
                } else if v & HOLDER == holder {
                    let sum = (v & COPIES) + copies as u64;
                    let saturated = sum > COPIES;
                    slot.val.store(holder | sum.min(COPIES), Ordering::Release);
                    return Added::Done { saturated };
                }
            }
            let empties = word & HI;
            if empties != 0 {
                if let Some(i) = reuse {
                    self.slots[i].val.store(holder | copies as u64, Ordering::Release);
                    self.tombs.fetch_sub(1, Ordering::Relaxed);
                    self.live.fetch_add(1, Ordering::Relaxed);
                    return Added::Done { saturated: false };
                }
                if self.live() + self.tombs() + 1 > self.max_used() {
                    return Added::Full;
                }
                let byte = (empties.trailing_zeros() / 8) as usize;
                let slot = &self.slots[g * GROUP + byte];
                slot.key.store(p.hash, Ordering::Relaxed);
                slot.val.store(holder | copies as u64, Ordering::Relaxed);
                let cleared = word & !(0xff << (8 * byte));
                self.ctrl[g].store(cleared | ((fp as u64) << (8 * byte)), Ordering::Release);
                self.live.fetch_add(1, Ordering::Relaxed);
                return Added::Done { saturated: false };
            }
            g += 1;
            if g == groups {
                g = 0;
            }
        }
    }

    /// Takes one copy from `holder` under `p.hash`; false if it held none. Caller holds the
    /// shard's mutex.
    pub fn sub(&self, p: &Probe, holder: u64) -> bool {
        let groups = self.ctrl.len();
        let fp = p.fingerprint();
        let mut g = p.home(groups);
        loop {
            let word = self.ctrl[g].load(Ordering::Relaxed);
            let mut m = match_byte(word, fp);
            while m != 0 {
                let slot = &self.slots[g * GROUP + (m.trailing_zeros() / 8) as usize];
                m &= m - 1;
                let v = slot.val.load(Ordering::Relaxed);
                if v != TOMB && v & HOLDER == holder && slot.key.load(Ordering::Relaxed) == p.hash {
                    if v & COPIES > 1 {
                        slot.val.store(v - 1, Ordering::Release);
                    } else {
                        slot.val.store(TOMB, Ordering::Release);
                        self.live.fetch_sub(1, Ordering::Relaxed);
                        self.tombs.fetch_add(1, Ordering::Relaxed);
                    }
                    return true;
                }
            }
            if word & HI != 0 {
                return false;
            }
            g += 1;
            if g == groups {
                g = 0;
            }
        }
    }

    /// Tombstones every live value for which `drop` is true; returns how many. Caller holds
    /// the shard's mutex.
    pub fn remove_where(&self, mut drop: impl FnMut(u64) -> bool) -> usize {
        let mut removed = 0;
        for (g, ctrl) in self.ctrl.iter().enumerate() {
            let mut full = !ctrl.load(Ordering::Relaxed) & HI;
            while full != 0 {
                let slot = &self.slots[g * GROUP + (full.trailing_zeros() / 8) as usize];
                full &= full - 1;
                let v = slot.val.load(Ordering::Relaxed);
                if v != TOMB && drop(v) {
                    slot.val.store(TOMB, Ordering::Release);
                    removed += 1;
                }
            }
        }
        self.live.fetch_sub(removed, Ordering::Relaxed);
        self.tombs.fetch_add(removed, Ordering::Relaxed);
        removed
    }

    /// True when the table should be rebuilt after removals: mostly tombstones, or mostly empty.
    pub fn wants_compaction(&self) -> bool {
        let (live, tombs, cap) = (self.live(), self.tombs(), self.capacity());
        cap > MIN_GROUPS * GROUP && ((tombs > cap / 4 && tombs > live) || live < cap / 8)
    }

    /// A fresh table holding this table's live values, sized for `live + extra` entries.
    /// Caller holds the shard's mutex (so nothing changes while copying).
    pub fn rebuilt(&self, extra: usize) -> Table {
        let live = self.live();
        let next = Table::for_entries(live + extra);
        for (g, ctrl) in self.ctrl.iter().enumerate() {
            let mut full = !ctrl.load(Ordering::Relaxed) & HI;
            while full != 0 {
                let slot = &self.slots[g * GROUP + (full.trailing_zeros() / 8) as usize];
                full &= full - 1;
                let v = slot.val.load(Ordering::Relaxed);
                if v != TOMB {
                    next.push_fresh(&Probe::new(slot.key.load(Ordering::Relaxed)), v);
                }
            }
        }
        debug_assert_eq!(next.live(), live);
        next
    }

    /// Inserts a value known not to be present, into a table nobody reads yet.
    fn push_fresh(&self, p: &Probe, v: u64) {
        let groups = self.ctrl.len();
        let mut g = p.home(groups);
        loop {
            let word = self.ctrl[g].load(Ordering::Relaxed);
            let empties = word & HI;
            if empties != 0 {
                let byte = (empties.trailing_zeros() / 8) as usize;
                let slot = &self.slots[g * GROUP + byte];
                slot.key.store(p.hash, Ordering::Relaxed);
                slot.val.store(v, Ordering::Relaxed);
                let cleared = word & !(0xff << (8 * byte));
                self.ctrl[g].store(cleared | ((p.fingerprint() as u64) << (8 * byte)), Ordering::Relaxed);
                self.live.fetch_add(1, Ordering::Relaxed);
                return;
            }
            g += 1;
            if g == groups {
                g = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn match_byte_flags_equal_bytes_and_never_empty_ones() {
        let word = u64::from_le_bytes([0x80, 0x12, 0x13, 0x80, 0x12, 0x7f, 0x00, 0x80]);
        let m = match_byte(word, 0x12);
        assert_ne!(m & (0x80 << 8), 0);
        assert_ne!(m & (0x80 << 32), 0);
        for empty_byte in [0, 3, 7] {
            assert_eq!(m & (0x80 << (8 * empty_byte)), 0);
        }
    }

    #[test]
    fn table_grows_only_through_full_and_keeps_values_on_rebuild() {
        let t = Table::for_entries(0);
        let h = holder(1, 0, 2);
        let mut n = 0u64;
        while let Added::Done { .. } = t.add(&Probe::new(n), h, 1) {
            n += 1;
        }
        assert_eq!(t.live() as u64, n);
        assert!(t.live() <= t.capacity() - t.capacity() / 8);
        let r = t.rebuilt(1);
        assert_eq!(r.live() as u64, n);
        for k in 0..n {
            let mut seen = vec![];
            r.for_each(&Probe::new(k), |v| seen.push(v));
            assert_eq!(seen, vec![h | 1]);
        }
    }
}
