//! One shard's open-addressing multimap `block hash -> packed holder`, readable without locks.
//!
//! Layout: `slots[i] = (key: AtomicU64, val: AtomicU64)` (16 bytes) in groups of seven, and one
//! `AtomicU64` control word per group: bytes 0..7 are the slots' control bytes, `EMPTY` (0x80,
//! never used), `DELETED` (0xfe, dead) or a 7-bit fingerprint of the key (live), and byte 7 is
//! the group's overflow count: how many live slots were placed past it, their inserts having
//! found it full and gone on to a later group (raised by an insert, lowered when such a slot
//! dies; saturating at 255, where it stays until a rebuild).
//! A hash held by several (worker, tier) pairs occupies several slots, all with the same key
//! (a multimap): a lookup walks the groups from the key's home group and stops after the first
//! group whose overflow count is 0, usually the home group itself even when it is full.
//!
//! `val` packs one holder and its slot's state: `worker:23 | tag:1 | tier:6 | entry:28 |
//! copies:6` (high to low bits). `entry` names the slot's entry in its holder's pages
//! (`runs.rs`; `NO_ENTRY` if none); `copies` is the copy count, or `MANY` when the count is
//! 63 or more and kept in the [`Overflow`] map instead. A dead slot's value is a *tomb*
//! (worker field all ones) carrying the grace ticket taken when it died.
//!
//! Invariants that make lock-free reads sound (all writers hold the shard's mutex, and every
//! reader is inside a grace read section, `grace.rs`):
//! - A slot is born by writing its key and value, then its fingerprint control byte with
//!   `Release`; so a reader that sees the byte sees the key and value.
//! - A slot dies by its value becoming a tomb, then its control byte `DELETED`, then the tomb
//!   taking a grace ticket (a read-modify-write after those writes). A dead slot is reborn for
//!   any key, but only once more grace periods than its ticket have ended: every reader that
//!   could have read its live value (entered before the period after the ticket) has left.
//!   So a reader that loads a slot's `val` and then its `key` pairs them right: a slot changes
//!   key at most once while a reader is inside (dead, then reborn), the value it can read
//!   then is a tomb or the new value, and the new value was written after the new key.
//! - A group's overflow count is raised before the slot that overflowed is published, so a
//!   reader that sees the slot's control byte walked through to it.
//! - A new slot takes the first group from its key's home with an `EMPTY` slot or a reusable
//!   dead one (a dead one first), so a group with an `EMPTY` slot is passed by no live slot
//!   and its overflow count is 0; the table never gets fuller than 7/8 (live and dead slots),
//!   so such groups exist: every probe ends. A slot that dies lowers the counts of the groups
//!   it was placed past after its control byte says `DELETED`, so a lookup that stops early
//!   because of it misses only that slot, which is gone.
//! - A dead slot whose ticket has passed, in a group whose overflow count is 0, may become
//!   `EMPTY` again in place ([`Table::sweep`]): it is reusable anyway, lookups skip `EMPTY`
//!   and `DELETED` bytes alike and stop by overflow counts alone, and the group keeps "a
//!   group with an `EMPTY` slot has count 0". Counts that fall when slots die are what let
//!   groups return to 0.
//!
//! Dead slots are reused in place rather than left for the shard's next rebuild, which makes
//! rebuilds fewer, and lookups skip them by their control byte. A full table first sweeps (its
//! dead slots freed in place, a walk of its control words) and is rebuilt only when that frees
//! too few. A table whose live slots are past 3/4 when it is full grows by half
//! ([`Table::grown`]), so that a growing index rebuilds each table a few times, not once per
//! few percent of growth.
//!
//! **Versions of crowded keys.** Each key has a version: one of the table's version counters
//! (one per 32 groups, 64 to 4,096), by hash. A change of a key's set of live slots (a slot
//! born or dead; copy counts and entry moves do not count) is *crowded* when the
//! key has, before or after it, a live slot outside its home group; a crowded change raises
//! the key's version once before it and once after it (so a version is odd while one is under
//! way: changes of a table never overlap, as its writers hold the shard's mutex). A lookup may
//! keep what it read of a key's slots for as long as the table and the version stay what they
//! were when it started reading, if it saw at least eight live slots and the same even version
//! after reading them (see `PrefixIndex::lookup_into`). Why that is exact: of the eight slots,
//! one, `y`, is outside the home group (a group has seven) and was live when read. Any change
//! of the key after the first version read is crowded or comes after a crowded one: if `y` was
//! born after that read, its birth is crowded; if not, every change while `y` is live is
//! crowded, and its death is one. So if none came between the two reads, the slots read are the
//! key's state then, and the first change after it raises the version before it writes
//! anything. A rebuilt table is a new table with a new [`Table::id`]. A key all in its home
//! group (most keys, even in a full group) raises nothing.
//!
//! Each counter also keeps its last crowded change (the key, the slot's holder, born or dead),
//! written between the two raises: a seqlock's record, read by [`Table::last_change`] between
//! two reads of the count. A lookup whose kept slots are exactly one change old (the version
//! is 2 more than when it kept them) applies that change to them, if it is of their key, or
//! keeps them as they are, if it is of another key; the result is the key's state at the new
//! version, and if it still has eight live slots, the argument above holds from there on.

use std::sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use super::crowd::{Crowd, Crowds, Tally};
use super::grace::Grace;
use super::packed::{entry_of, is_tomb, ripe, tomb, Overflow, COPIES, ENTRY, ENTRY_SHIFT, HOLDER, MANY, NEVER};
use super::prefetch::{prefetch, prefetch_write};
use super::Padded;

mod probe;
pub(super) use probe::Probe;
use probe::{dead_bytes, match_byte, next_group, overflowed, DELETED, EMPTY_WORD, GROUP, HI, OVERFLOW_SHIFT};

const MIN_GROUPS: usize = 2;
/// Groups per version counter (see the module docs), and the bounds of their number. A change
/// of another key of the counter costs kept candidates nothing when it is the only change since
/// they were kept (they take it as it is, [`Table::last_change`]), so counters can be few (a
/// counter is 24 bytes with its last change); more of them do not make lookups faster. A
/// small table keeps few, so that they stay in cache.
const GROUPS_PER_VERSION: usize = 32;
const VERSIONS: std::ops::RangeInclusive<usize> = 64..=4096;

/// Ids of tables, never reused.
static TABLE_IDS: AtomicU64 = AtomicU64::new(0);

struct Slot {
    key: AtomicU64,
    val: AtomicU64,
}

/// Outcome of [`Table::sub`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Subbed {
    /// One copy taken; the holder still has some.
    Taken,
    /// The last copy taken: the slot is gone, and with it its entry.
    Died { entry: u32 },
    /// The holder had no copy.
    Missing,
}

/// Outcome of [`Table::add`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Added {
    /// The copies were added (`saturated` if the counter hit `u32::MAX`); `entry` is the
    /// slot's run entry (`NO_ENTRY` if none).
    Done { saturated: bool, entry: u32 },
    /// A new slot was needed and the table is at its load limit: rebuild, then retry.
    Full,
}

pub(super) struct Table {
    /// Unique among all tables ever made.
    id: u64,
    /// Versions of crowded keys, by [`Probe::stripe`].
    versions: Box<[Version]>,
    ctrl: Box<[AtomicU64]>,
    slots: Box<[Slot]>,
    counts: Padded<Counts>,
    /// The shard's crowd records (`crowd.rs`): shared by its successive tables, as a rebuild
    /// changes no key's holders.
    crowds: Arc<Crowds>,
}

/// A version counter of crowded keys, and the last crowded change it counted (module docs,
/// Versions of crowded keys): a lookup that kept a key's slots at the version before it can
/// bring them up to date without reading the slots again.
#[derive(Default)]
struct Version {
    /// Odd exactly while a crowded change of one of its keys is under way.
    count: AtomicU64,
    /// The last change's key.
    hash: AtomicU64,
    /// The last change's slot: its holder bits ([`HOLDER`]), and [`BORN`] if the slot was born
    /// (else it died).
    change: AtomicU64,
}

/// In [`Version::change`]: the slot was born. The holder bits leave the copies field free.
const BORN: u64 = 1;

/// A crowded change of one key's live slots: the slot of `holder` (packed, [`HOLDER`] bits)
/// under `hash` was born, or died.
#[derive(Clone, Copy)]
pub(super) struct Change {
    pub hash: u64,
    pub holder: u64,
    pub born: bool,
}

/// A table's counts, written at every slot born or dead, on cache lines of their own: beside
/// the table's pointers, which every probe reads, each write took the line from lookups.
#[derive(Default)]
struct Counts {
    /// Live holders. Written only under the shard's mutex; atomic so stats can read it.
    live: AtomicUsize,
    /// Dead slots (reusable once their grace ticket has passed).
    tombs: AtomicUsize,
}

impl Counts {
    /// Adds `live` and `tombs` to the counts. Caller holds the shard's mutex (or owns the
    /// table), so a load and a store suffice: a read-modify-write would also wait for every
    /// store and load before it (as would the page `valid` words', `runs.rs`).
    fn add(&self, live: isize, tombs: isize) {
        self.live.store(self.live.load(Ordering::Relaxed).wrapping_add_signed(live), Ordering::Relaxed);
        if tombs != 0 {
            self.tombs.store(self.tombs.load(Ordering::Relaxed).wrapping_add_signed(tombs), Ordering::Relaxed);
        }
    }
}

impl Table {
    /// A table sized so that `live` entries fill it to about 72%.
    pub fn for_entries(live: usize) -> Self {
        Self::sized(live, Arc::default())
    }

    /// [`Table::for_entries`] with the crowd records `crowds`.
    fn sized(live: usize, crowds: Arc<Crowds>) -> Self {
        let slots = live.saturating_mul(25) / 18;
        Self::with_groups((slots / GROUP + 1).max(MIN_GROUPS), crowds)
    }

    fn with_groups(groups: usize, crowds: Arc<Crowds>) -> Self {
        Self {
            id: TABLE_IDS.fetch_add(1, Ordering::Relaxed),
            versions: (0..(groups / GROUPS_PER_VERSION).next_power_of_two().clamp(*VERSIONS.start(), *VERSIONS.end()))
                .map(|_| Version::default())
                .collect(),
            ctrl: (0..groups).map(|_| AtomicU64::new(EMPTY_WORD)).collect(),
            slots: (0..groups * GROUP).map(|_| Slot { key: AtomicU64::new(0), val: AtomicU64::new(0) }).collect(),
            counts: Padded::default(),
            crowds,
        }
    }

    pub fn live(&self) -> usize {
        self.counts.live.load(Ordering::Relaxed)
    }

    pub fn tombs(&self) -> usize {
        self.counts.tombs.load(Ordering::Relaxed)
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// This table's id: no other table, before or after, has it.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The version of `p`'s key (see the module docs, Versions of crowded keys): read before
    /// and after reading the key's slots.
    pub fn version(&self, p: &Probe) -> u64 {
        self.versions[p.stripe(self.versions.len())].count.load(Ordering::SeqCst)
    }

    /// The crowded change that raised the version of `p`'s key to `version` (even, just read
    /// by [`Table::version`]), if the version is still `version` after reading it. The change
    /// may be of another key of the same counter (its `hash` says).
    pub fn last_change(&self, p: &Probe, version: u64) -> Option<Change> {
        let v = &self.versions[p.stripe(self.versions.len())];
        let hash = v.hash.load(Ordering::Relaxed);
        let change = v.change.load(Ordering::Relaxed);
        // A seqlock's second read: a change's record is written after its first raise, behind
        // a `Release` fence, so a record read from a later change shows here as a new count.
        fence(Ordering::Acquire);
        (v.count.load(Ordering::Relaxed) == version).then_some(Change {
            hash,
            holder: change & HOLDER,
            born: change & BORN != 0,
        })
    }

    /// Makes a change of `p`'s key (`write`: `holder`'s slot is born, or dies), raising the
    /// key's version before and after it when `crowded`: the key has, before or after the
    /// change, a live slot outside its home group (see the module docs); a crowded change also
    /// leaves its record with the version ([`Table::last_change`]). Caller holds the shard's
    /// mutex, so a table's changes never overlap and a version is odd exactly while a change of
    /// one of its keys is under way.
    fn change(&self, p: &Probe, crowded: bool, holder: u64, born: bool, write: impl FnOnce()) {
        if !crowded {
            write();
            return;
        }
        let v = &self.versions[p.stripe(self.versions.len())];
        v.count.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::Release);
        write();
        // The key's record follows every change of a key with a record (such a change is
        // crowded: `crowd.rs`), and a key reaching a record's shape takes one here.
        let mut live = Tally::default();
        self.for_each(p, |v| live.add(v));
        if live.may_have_had_a_record() {
            self.crowds.set(p, live.crowd());
        }
        v.hash.store(p.hash, Ordering::Relaxed);
        v.change.store(holder & HOLDER | if born { BORN } else { 0 }, Ordering::Relaxed);
        v.count.fetch_add(1, Ordering::SeqCst);
    }

    /// True if `p`'s key has a live slot outside its home group. Caller holds the shard's
    /// mutex.
    fn spills(&self, p: &Probe) -> bool {
        let groups = self.ctrl.len();
        let fp = p.fingerprint();
        let mut g = p.home(groups);
        let mut word = self.ctrl[g].load(Ordering::Relaxed);
        while overflowed(word) {
            g = next_group(g, groups);
            word = self.ctrl[g].load(Ordering::Relaxed);
            let mut m = match_byte(word, fp);
            while m != 0 {
                let slot = &self.slots[g * GROUP + (m.trailing_zeros() / 8) as usize];
                m &= m - 1;
                if !is_tomb(slot.val.load(Ordering::Relaxed)) && slot.key.load(Ordering::Relaxed) == p.hash {
                    return true;
                }
            }
        }
        false
    }

    /// Heap bytes of this table (control words, slots, versions) plus its header.
    pub fn bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.versions.len() * std::mem::size_of::<Version>()
            + self.ctrl.len() * std::mem::size_of::<AtomicU64>()
            + self.slots.len() * std::mem::size_of::<Slot>()
    }

    /// Bytes of this table's slots by state, each slot with its share of its group's control
    /// word: `(live, dead, empty)`; [`Table::bytes`] less these is the version counters and
    /// the header.
    pub fn slot_bytes(&self) -> (usize, usize, usize) {
        let per = |n: usize| n * (std::mem::size_of::<Slot>() * GROUP + 8) / GROUP;
        let (live, dead) = (self.live(), self.tombs());
        (per(live), per(dead), self.bytes() - self.versions_bytes() - per(live) - per(dead))
    }

    /// Bytes of the version counters and the header.
    pub fn versions_bytes(&self) -> usize {
        std::mem::size_of::<Self>() + self.versions.len() * std::mem::size_of::<Version>()
    }

    fn max_used(&self) -> usize {
        self.capacity() - self.capacity() / 8
    }

    /// True if `extra` new slots fit before the table is full (live and dead slots past 7/8),
    /// none of them taking a dead slot's place.
    pub fn has_room(&self, extra: usize) -> bool {
        self.live() + self.tombs() + extra <= self.max_used()
    }

    /// Asks for the cache lines a probe for `p` will read first: its home group's control
    /// word and its slots (112 bytes, over two or three lines: slots 0, 4 and 6 are on each
    /// of them), so that callers can ask for several probes' lines before using any: their
    /// cache misses then overlap (`prefetch.rs`).
    #[inline]
    pub fn prefetch(&self, p: &Probe) {
        self.ask(p, prefetch);
    }

    /// [`Table::prefetch`] for a writer: asks for the same lines owned, as it writes the
    /// control word and one of the slots (`prefetch.rs`).
    #[inline]
    pub fn prefetch_write(&self, p: &Probe) {
        self.ask(p, prefetch_write);
    }

    #[inline(always)]
    fn ask(&self, p: &Probe, hint: impl Fn(&AtomicU64)) {
        let g = p.home(self.ctrl.len());
        hint(&self.ctrl[g]);
        for k in [0, 4, GROUP - 1] {
            hint(&self.slots[g * GROUP + k].val);
        }
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
                if !is_tomb(v) && slot.key.load(Ordering::Relaxed) == p.hash {
                    f(v);
                }
            }
            if !overflowed(word) {
                return;
            }
            g = next_group(g, groups);
        }
    }

    /// The crowd record of `p.hash` if it has one (one cache line instead of its slots), else
    /// `f` called with every holder of `p.hash` as [`Table::for_each`] does. Only keys homed
    /// in an overflowed group can have one. Lock-free.
    #[inline]
    pub fn holders(&self, p: &Probe, f: impl FnMut(u64)) -> Option<Crowd> {
        if overflowed(self.ctrl[p.home(self.ctrl.len())].load(Ordering::Relaxed)) {
            if let Some(c) = self.crowds.get(p) {
                return Some(c);
            }
        }
        self.for_each(p, f);
        None
    }

    /// The crowd record of `p.hash`, if it has one (`crowd.rs`). Lock-free.
    #[cfg(test)]
    pub fn crowd(&self, p: &Probe) -> Option<Crowd> {
        self.crowds.get(p)
    }

    /// Heap bytes of the shard's crowd records.
    pub fn crowd_bytes(&self) -> usize {
        self.crowds.bytes()
    }

    /// Calls `f(hash, value)` with every live slot. Lock-free, like [`Table::for_each`]: a slot
    /// written concurrently is seen before or after the write, never torn.
    pub fn for_each_entry(&self, mut f: impl FnMut(u64, u64)) {
        for i in self.published_slots() {
            let slot = &self.slots[i];
            let v = slot.val.load(Ordering::Acquire);
            if !is_tomb(v) {
                f(slot.key.load(Ordering::Relaxed), v);
            }
        }
    }

    /// The indexes of every slot whose control byte is a fingerprint (live, or dying under a
    /// writer), group by group.
    fn published_slots(&self) -> impl Iterator<Item = usize> + '_ {
        self.ctrl.iter().enumerate().flat_map(move |(g, ctrl)| {
            let mut full = !ctrl.load(Ordering::Acquire) & HI;
            std::iter::from_fn(move || {
                if full == 0 {
                    return None;
                }
                let i = g * GROUP + (full.trailing_zeros() / 8) as usize;
                full &= full - 1;
                Some(i)
            })
        })
    }

    /// Adds `copies` (> 0) to `holder` under `p.hash`. A new slot gets `entry()` as its entry
    /// (called at most once, only when a slot is created), and takes the first slot from the
    /// key's home group that is `EMPTY` or dead with a ticket below `ended` (the grace periods
    /// ended; [`Table::kill`]). Caller holds the shard's mutex.
    pub fn add(
        &self,
        p: &Probe,
        holder: u64,
        copies: u32,
        entry: &mut dyn FnMut() -> u32,
        overflow: &Overflow,
        ended: u64,
    ) -> Added {
        debug_assert!(copies > 0 && holder & !HOLDER == 0);
        let groups = self.ctrl.len();
        let fp = p.fingerprint();
        let home = p.home(groups);
        let mut g = home;
        // A live slot of the key outside its home group (the walk sees every slot of the key).
        let mut outside = false;
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
                if is_tomb(v) {
                    continue;
                } else if v & HOLDER != holder {
                    outside |= g != home;
                } else {
                    let old = overflow.copies(p.hash, v, None) as u64;
                    let sum = old + copies as u64;
                    let saturated = sum > u32::MAX as u64;
                    Self::set_copies(slot, p.hash, v, sum.min(u32::MAX as u64) as u32, overflow);
                    return Added::Done { saturated, entry: entry_of(v) };
                }
            }
            if !overflowed(word) {
                break;
            }
            g = next_group(g, groups);
        }
        let (i, reused) = self.spot(p, ended);
        if !reused && self.live() + self.tombs() + 1 > self.max_used() {
            return Added::Full;
        }
        let entry = entry();
        let v = holder | ((entry as u64) << ENTRY_SHIFT);
        let v = Self::fresh_copies(p.hash, v, copies, overflow);
        // The walk saw every live slot of the key; the new one goes to group `i / GROUP`.
        self.change(p, outside || i / GROUP != home, holder, true, || self.put(p, v, i, reused, Ordering::Release));
        Added::Done { saturated: false, entry }
    }

    /// `v` (copies field 0) with `copies` (> 0), recording a large count in the overflow map.
    fn fresh_copies(hash: u64, v: u64, copies: u32, overflow: &Overflow) -> u64 {
        if (copies as u64) < MANY {
            return v | copies as u64;
        }
        overflow.lock().insert((hash, v & HOLDER), copies);
        v | MANY
    }

    /// Sets the live slot `slot` (value `v`) to `copies` (> 0).
    fn set_copies(slot: &Slot, hash: u64, v: u64, copies: u32, overflow: &Overflow) {
        let base = v & !COPIES;
        if v & COPIES != MANY && (copies as u64) < MANY {
            slot.val.store(base | copies as u64, Ordering::Release);
            return;
        }
        let mut many = overflow.lock();
        if (copies as u64) < MANY {
            slot.val.store(base | copies as u64, Ordering::Release);
            many.remove(&(hash, v & HOLDER));
        } else {
            many.insert((hash, v & HOLDER), copies);
            slot.val.store(base | MANY, Ordering::Release);
        }
    }

    /// Where a new slot for `p.hash` goes, and whether it is a dead one: in the first group
    /// from its home with an `EMPTY` slot or a dead one whose ticket is below `ended`, a dead
    /// one if there is one (so that dead slots are used up, and rebuilds stay rare), else the
    /// `EMPTY` one. There is always an `EMPTY` slot: the table never gets fuller than 7/8,
    /// dead slots included.
    fn spot(&self, p: &Probe, ended: u64) -> (usize, bool) {
        let groups = self.ctrl.len();
        let mut g = p.home(groups);
        loop {
            let word = self.ctrl[g].load(Ordering::Relaxed);
            let mut dead = dead_bytes(word);
            while dead != 0 {
                let i = g * GROUP + (dead.trailing_zeros() / 8) as usize;
                dead &= dead - 1;
                if ripe(self.slots[i].val.load(Ordering::Relaxed), ended) {
                    return (i, true);
                }
            }
            let empty = word & HI & !(word << 1);
            if empty != 0 {
                return (g * GROUP + (empty.trailing_zeros() / 8) as usize, false);
            }
            g = next_group(g, groups);
        }
    }

    /// Writes a new slot for `p.hash` with value `v` at slot `i` (from [`Table::spot`]):
    /// raises the overflow count of every group passed on the way from its home, writes the
    /// key and value, then publishes the control byte (`publish`). Caller holds the shard's
    /// mutex (or owns the table) and checked the load limit.
    fn put(&self, p: &Probe, v: u64, i: usize, reused: bool, publish: Ordering) {
        let at = i / GROUP;
        self.passed(p.home(self.ctrl.len()), at, true, publish);
        let slot = &self.slots[i];
        slot.key.store(p.hash, Ordering::Relaxed);
        slot.val.store(v, Ordering::Relaxed);
        let byte = 8 * (i % GROUP);
        let word = self.ctrl[at].load(Ordering::Relaxed);
        self.ctrl[at].store((word & !(0xff << byte)) | ((p.fingerprint() as u64) << byte), publish);
        self.counts.add(1, if reused { -1 } else { 0 });
    }

    /// Puts a new slot for `p.hash` into a table no lookup reads yet (a rebuild's).
    fn place(&self, p: &Probe, v: u64) {
        let (i, reused) = self.spot(p, 0);
        self.put(p, v, i, reused, Ordering::Relaxed);
    }

    /// Kills the live slot `i` of a key homed at group `home`: its value becomes a tomb, its
    /// control byte `DELETED`, the groups it was placed past count one slot fewer, and the
    /// tomb then takes a grace ticket, so that the slot is reused for another key only once
    /// every lookup that could have read its live value has ended (module docs). Caller holds
    /// the shard's mutex.
    fn kill(&self, i: usize, home: usize, grace: &Grace) {
        let slot = &self.slots[i];
        slot.val.store(tomb(NEVER), Ordering::Release);
        let (g, byte) = (i / GROUP, 8 * (i % GROUP));
        let word = self.ctrl[g].load(Ordering::Relaxed);
        self.ctrl[g].store((word & !(0xff << byte)) | ((DELETED as u64) << byte), Ordering::Release);
        self.passed(home, g, false, Ordering::Release);
        slot.val.store(tomb(grace.ticket()), Ordering::Relaxed);
        self.counts.add(-1, 1);
    }

    /// Raises (`up`) or lowers the overflow count of every group from `home` up to (not
    /// including) `at`: a slot homed at `home` is placed in group `at` ([`Table::put`]), or
    /// that slot died ([`Table::kill`]). A saturated count stays (it no longer knows how many
    /// slots went past). Caller holds the shard's mutex (or owns the table).
    fn passed(&self, home: usize, at: usize, up: bool, order: Ordering) {
        let groups = self.ctrl.len();
        let mut g = home;
        while g != at {
            let word = self.ctrl[g].load(Ordering::Relaxed);
            let count = word >> OVERFLOW_SHIFT;
            debug_assert!(up || count > 0, "a group a live slot went past has a count");
            if count != 0xff {
                let one = 1 << OVERFLOW_SHIFT;
                self.ctrl[g].store(if up { word + one } else { word - one }, order);
            }
            g = next_group(g, groups);
        }
    }

    /// The index of `holder`'s live slot of `p.hash`, its value, and whether it is outside
    /// the key's home group, if any.
    fn live_slot(&self, p: &Probe, holder: u64) -> Option<(usize, u64, bool)> {
        let groups = self.ctrl.len();
        let fp = p.fingerprint();
        let mut g = p.home(groups);
        loop {
            let word = self.ctrl[g].load(Ordering::Relaxed);
            let mut m = match_byte(word, fp);
            while m != 0 {
                let i = g * GROUP + (m.trailing_zeros() / 8) as usize;
                let slot = &self.slots[i];
                m &= m - 1;
                let v = slot.val.load(Ordering::Relaxed);
                if !is_tomb(v) && v & HOLDER == holder && slot.key.load(Ordering::Relaxed) == p.hash {
                    return Some((i, v, g != p.home(groups)));
                }
            }
            if !overflowed(word) {
                return None;
            }
            g = next_group(g, groups);
        }
    }

    /// The entry of `holder`'s live slot of `p.hash` (`None` if it has none). Lock-free: sound
    /// for a caller holding the holder's lock, as only the holder's writers change its slots.
    pub fn entry(&self, p: &Probe, holder: u64) -> Option<u32> {
        self.live_slot(p, holder).map(|(_, v, _)| entry_of(v))
    }

    /// Takes one copy from `holder` under `p.hash`. Caller holds the shard's mutex.
    pub fn sub(&self, p: &Probe, holder: u64, overflow: &Overflow, grace: &Grace) -> Subbed {
        let Some((i, v, outside)) = self.live_slot(p, holder) else {
            return Subbed::Missing;
        };
        let copies = overflow.copies(p.hash, v, None);
        if copies > 1 {
            Self::set_copies(&self.slots[i], p.hash, v, copies - 1, overflow);
            return Subbed::Taken;
        }
        self.change(p, outside || self.spills(p), holder, false, || self.kill(i, p.home(self.ctrl.len()), grace));
        Subbed::Died { entry: entry_of(v) }
    }

    /// Points `holder`'s live slot of `p.hash` at `entry` instead of `old`; false if it has no
    /// such slot. Caller holds the shard's mutex.
    pub fn move_entry(&self, p: &Probe, holder: u64, old: u32, entry: u32) -> bool {
        match self.live_slot(p, holder) {
            Some((i, v, _)) if entry_of(v) == old => {
                // Not a change of the key's holders: kept candidates hold no entries.
                self.slots[i].val.store((v & !ENTRY) | ((entry as u64) << ENTRY_SHIFT), Ordering::Release);
                true
            }
            _ => false,
        }
    }

    /// Kills every live slot whose value `drop` is true of; returns how many. Caller holds
    /// the shard's mutex.
    pub fn remove_where(&self, mut drop: impl FnMut(u64) -> bool, overflow: &Overflow, grace: &Grace) -> usize {
        let mut removed = 0;
        for i in self.published_slots() {
            let slot = &self.slots[i];
            let v = slot.val.load(Ordering::Relaxed);
            if !is_tomb(v) && drop(v) {
                let key = slot.key.load(Ordering::Relaxed);
                if Overflow::is_many(v) {
                    overflow.lock().remove(&(key, v & HOLDER));
                }
                // Where the slot is is not known here: any key homed in an overflowed group
                // counts as crowded (a superset: as sound, and this scan is rare).
                let p = Probe::new(key);
                let home = p.home(self.ctrl.len());
                self.change(&p, overflowed(self.ctrl[home].load(Ordering::Relaxed)), v, false, || {
                    self.kill(i, home, grace)
                });
                removed += 1;
            }
        }
        removed
    }

    /// Turns dead slots back into `EMPTY` ones in place, where that is sound: those whose
    /// ticket is below `ended` (every lookup that could have read their live value has left,
    /// so they are reusable now anyway), in groups whose overflow count is 0 (no live slot was
    /// placed past them, so an `EMPTY` slot there keeps "a group with an `EMPTY` slot is passed
    /// by no live slot"). Lookups skip `EMPTY` and `DELETED` bytes alike and stop at a group by its
    /// overflow count alone, and no key's live slots change, so nothing a lookup reads or
    /// keeps changes meaning. Returns how many slots it freed: each lowers the load a new slot
    /// is checked against, so a table full of dead slots needs no rebuild while enough of them
    /// can be freed this way. Caller holds the shard's mutex.
    pub fn sweep(&self, ended: u64) -> usize {
        let mut freed = 0;
        for (g, ctrl) in self.ctrl.iter().enumerate() {
            let word = ctrl.load(Ordering::Relaxed);
            let mut dead = dead_bytes(word);
            if dead == 0 || overflowed(word) {
                continue;
            }
            let mut ripe_bytes = 0u64;
            while dead != 0 {
                let byte = dead.trailing_zeros() / 8;
                dead &= dead - 1;
                if ripe(self.slots[g * GROUP + byte as usize].val.load(Ordering::Relaxed), ended) {
                    ripe_bytes |= 0xff << (8 * byte);
                }
            }
            if ripe_bytes != 0 {
                ctrl.store((word & !ripe_bytes) | (EMPTY_WORD & ripe_bytes), Ordering::Release);
                freed += ripe_bytes.count_ones() as usize / 8;
            }
        }
        self.counts.add(0, -(freed as isize));
        freed
    }

    /// Whether a full table should be swept ([`Table::sweep`]) rather than rebuilt: its live
    /// slots are still at the load a rebuild would give it (about 72%; under 3/4), so a
    /// rebuild would not grow it, only drop its dead slots.
    pub fn sweep_first(&self) -> bool {
        self.live() * 4 < self.capacity() * 3
    }

    /// The fewest slots a sweep must free for the table to be kept: a sixty-fourth of it, so
    /// that a table whose dead slots mostly sit in overflowed groups is rebuilt, not swept
    /// again at every insert.
    pub fn sweep_enough(&self) -> usize {
        (self.capacity() / 64).max(1)
    }

    /// True when the table should be rebuilt after removals: mostly tombstones, or mostly empty.
    pub fn wants_compaction(&self) -> bool {
        let (live, tombs, cap) = (self.live(), self.tombs(), self.capacity());
        cap > MIN_GROUPS * GROUP && ((tombs > cap / 4 && tombs > live) || live < cap / 8)
    }

    /// A fresh table holding this table's live values, with room for half as many again:
    /// sized for 1.5 times its live entries, so about 48% full. For a full table whose live
    /// slots are past 3/4 ([`Table::sweep_first`] false). Growing by half copies each live slot
    /// under three times over the index's growth, where a table rebuilt for `live + 1` would
    /// grow by a few percent a rebuild, and each rebuild drops every lookup's kept candidates
    /// of its keys.
    pub fn grown(&self) -> Table {
        self.rebuilt((self.live() / 2).max(1))
    }

    /// A fresh table holding this table's live values, sized for `live + extra` entries.
    /// Caller holds the shard's mutex (so nothing changes while copying).
    pub fn rebuilt(&self, extra: usize) -> Table {
        let live = self.live();
        let next = Table::sized(live + extra, self.crowds.clone());
        self.for_each_entry(|key, v| next.place(&Probe::new(key), v));
        debug_assert_eq!(next.live(), live);
        next
    }
}

#[cfg(test)]
mod tests;
