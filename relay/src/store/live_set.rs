//! The live set: every live block of every (rank, tier, group), in memory, with its copy count
//! and what a snapshot carries (parent, block size, namespace, token ids, layout).
//!
//! It is the state the history's records build, applied in cursor order: a store adds a copy of
//! each block (the latest store's attributes win), a removal takes one (a removal of a block with
//! no copy is counted, never an error), a clear drops the rank's tables (of one tier when it
//! names one) and a rank reset drops the rank's. It is never written per operation: it reaches
//! disk as checkpoints (`checkpoint.rs`), and a reopened store rebuilds it from the newest whole
//! checkpoint and the log after it.
//!
//! # Layout, in bytes per block
//! A table per (rank, tier, group), split into [`SHARDS`] hash maps by the hash's top bits (so a
//! shard is a range of hashes: a snapshot copies one shard at a time and sorts it, and its
//! output is in hash order). A map holds only where each block's record is (the 64-bit hash and
//! an 8-byte [`Loc`]: a 16-byte bucket), because a map's buckets are at most 7/8 full and, when
//! every shard has grown past a power of two at once, just under half. The records are dense:
//! in slabs of fixed-length slots, one slab per token count (a table's blocks nearly all have
//! one length), a 24-byte header (parent, copies, block size, namespace, flags) then the token
//! ids, so a block of 16 tokens has an 88-byte record and no allocation of its own. Namespaces
//! are interned per table (an id in the header, freed when its last block goes). About 120
//! bytes per block of 16 tokens at a million blocks, map load included (150 with the attributes
//! in the buckets).
//!
//! # Snapshots beside commits
//! A snapshot ([`Journal`]) is the state at one cursor, copied shard by shard under this set's
//! lock in short steps while commits go on. Each commit, before it changes a block in a shard the
//! snapshot has not copied yet, gives the snapshot the block as it was (its *pre-image*, once per
//! block); a table cleared before it was copied is handed over whole (a move, not a copy). The
//! copy of a shard is then its current blocks with the pre-images put back: exactly the state at
//! the snapshot's cursor. Commits wait only while a snapshot is registered (a list of the
//! tables it selects), not while it is copied.

use super::snapshot::{SnapshotBlock, SnapshotFilter};
use super::types::LiveGroupSummary;
use crate::model::{Event, Namespace, RecordBody, Tier, TokenLayout};
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// Shards per table (a power of two): a shard is the hashes with the same top bits.
pub(crate) const SHARD_BITS: u32 = 8;
pub(crate) const SHARDS: usize = 1 << SHARD_BITS;

pub(crate) fn shard_of(hash: u64) -> usize {
    (hash >> (64 - SHARD_BITS)) as usize
}

/// Where a table of live blocks is: ordered as snapshots list them.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct TableKey {
    pub dp_rank: u32,
    pub tier: Tier,
    pub group: u32,
}

/// The block hashes are already uniform 64-bit values, except where tests (or an engine) use
/// small integers: one multiply spreads those over the map's buckets and control bytes.
#[derive(Default, Clone, Copy)]
pub(crate) struct MixHasher(u64);

impl Hasher for MixHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = x;
    }
    fn finish(&self) -> u64 {
        let x = self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        x ^ (x >> 29)
    }
}

type Map = HashMap<u64, Loc, BuildHasherDefault<MixHasher>>;

const F_PARENT: u32 = 1;
const F_BIGRAM: u32 = 2;

/// Where a block's record is: its slab (an index in [`Table::slabs`], stable for the table's
/// life) in the high 32 bits, its slot in the low 32. Eight bytes, so a map bucket is 16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Loc(u64);

impl Loc {
    fn new(slab: usize, slot: u32) -> Loc {
        Loc(((slab as u64) << 32) | u64::from(slot))
    }

    fn slab(self) -> usize {
        (self.0 >> 32) as usize
    }

    fn slot(self) -> u32 {
        self.0 as u32
    }
}

/// A record's header, in u32 words: the parent (low, high), copies, block size, namespace id,
/// flags; its token ids follow.
const HEAD: usize = 6;
const COPIES: usize = 2;
const NS: usize = 4;

/// One live block's attributes, as its record's header holds them (its hash is the map's key,
/// its token ids follow the header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    parent: u64,
    copies: u32,
    block_size: u32,
    /// Interned namespace ([`Namespaces`]).
    ns: u32,
    flags: u32,
}

impl Entry {
    fn read(r: &[u32]) -> Entry {
        Entry {
            parent: u64::from(r[0]) | (u64::from(r[1]) << 32),
            copies: r[COPIES],
            block_size: r[3],
            ns: r[NS],
            flags: r[5],
        }
    }

    fn write(&self, r: &mut [u32]) {
        r[..HEAD].copy_from_slice(&[
            self.parent as u32,
            (self.parent >> 32) as u32,
            self.copies,
            self.block_size,
            self.ns,
            self.flags,
        ]);
    }
}

/// Records of blocks with `len` token ids each (a header of [`HEAD`] words, then the ids), in
/// fixed slots on pages of about 64K words.
#[derive(Debug, Clone)]
struct Slab {
    len: usize,
    pages: Vec<Box<[u32]>>,
    free: Vec<u32>,
    used: u32,
}

impl Slab {
    fn new(len: usize) -> Self {
        Slab { len, pages: Vec::new(), free: Vec::new(), used: 0 }
    }

    fn stride(&self) -> usize {
        HEAD + self.len
    }

    fn per_page(&self) -> usize {
        (65_536 / self.stride()).max(1)
    }

    fn record(&self, slot: u32) -> &[u32] {
        let (p, i, n) = (slot as usize / self.per_page(), slot as usize % self.per_page(), self.stride());
        &self.pages[p][i * n..(i + 1) * n]
    }

    fn record_mut(&mut self, slot: u32) -> &mut [u32] {
        let (p, i, n) = (slot as usize / self.per_page(), slot as usize % self.per_page(), self.stride());
        &mut self.pages[p][i * n..(i + 1) * n]
    }

    /// A free slot (its record is written by the caller).
    fn alloc(&mut self) -> u32 {
        if let Some(s) = self.free.pop() {
            return s;
        }
        let s = self.used;
        self.used += 1;
        if s as usize / self.per_page() == self.pages.len() {
            self.pages.push(vec![0u32; self.per_page() * self.stride()].into_boxed_slice());
        }
        s
    }
}

/// A table's namespaces, interned: id → (namespace, live blocks under it).
#[derive(Debug, Clone, Default)]
struct Namespaces {
    list: Vec<(Namespace, u64)>,
    ids: HashMap<Namespace, u32>,
    free: Vec<u32>,
    /// Namespaces with at least one live block.
    live: u64,
}

impl Namespaces {
    /// The id of `ns`, interned with no blocks if new (released by [`Namespaces::gc`]).
    fn intern(&mut self, ns: &Namespace) -> u32 {
        if let Some(&id) = self.ids.get(ns) {
            return id;
        }
        let id = match self.free.pop() {
            Some(id) => {
                self.list[id as usize] = (ns.clone(), 0);
                id
            }
            None => {
                self.list.push((ns.clone(), 0));
                (self.list.len() - 1) as u32
            }
        };
        self.ids.insert(ns.clone(), id);
        id
    }

    fn add(&mut self, id: u32, blocks: i64) {
        let n = &mut self.list[id as usize].1;
        let was = *n;
        *n = n.saturating_add_signed(blocks);
        match (was, *n) {
            (0, 1..) => self.live += 1,
            (1.., 0) => self.live -= 1,
            _ => {}
        }
    }

    /// Frees `id` when no live block is under it.
    fn gc(&mut self, id: u32) {
        let (ns, n) = &self.list[id as usize];
        if *n == 0 && self.ids.remove(ns).is_some() {
            self.list[id as usize].0 = Namespace::default();
            self.free.push(id);
        }
    }

    fn get(&self, id: u32) -> &Namespace {
        &self.list[id as usize].0
    }
}

/// The live blocks of one (rank, tier, group).
#[derive(Debug, Clone)]
pub(crate) struct Table {
    shards: Box<[Map]>,
    slabs: Vec<Slab>,
    ns: Namespaces,
    pub blocks: u64,
    pub copies: u64,
}

impl Default for Table {
    fn default() -> Self {
        Table {
            shards: (0..SHARDS).map(|_| Map::default()).collect(),
            slabs: Vec::new(),
            ns: Namespaces::default(),
            blocks: 0,
            copies: 0,
        }
    }
}

impl Table {
    /// The index of the slab of `len`-token records, made if new.
    fn slab(&mut self, len: usize) -> usize {
        match self.slabs.iter().position(|s| s.len == len) {
            Some(i) => i,
            None => {
                self.slabs.push(Slab::new(len));
                self.slabs.len() - 1
            }
        }
    }

    fn record(&self, loc: Loc) -> &[u32] {
        self.slabs[loc.slab()].record(loc.slot())
    }

    /// The block `hash` as a snapshot lists it.
    fn block(&self, key: &TableKey, hash: u64, loc: Loc, tokens: bool) -> SnapshotBlock {
        let r = self.record(loc);
        let e = Entry::read(r);
        SnapshotBlock {
            dp_rank: key.dp_rank,
            tier: key.tier.clone(),
            group: key.group,
            hash,
            parent: (e.flags & F_PARENT != 0).then_some(e.parent),
            block_size: e.block_size,
            namespace: self.ns.get(e.ns).clone(),
            copies: e.copies,
            token_ids: if tokens { r[HEAD..].to_vec() } else { Vec::new() },
            token_layout: if e.flags & F_BIGRAM != 0 { TokenLayout::Bigram } else { TokenLayout::Single },
        }
    }

    /// Adds `copies` copies of `hash` with these attributes (a held block takes them as its
    /// latest store's); returns whether it was held already.
    #[allow(clippy::too_many_arguments)]
    fn store(
        &mut self,
        hash: u64,
        parent: Option<u64>,
        block_size: u32,
        layout: TokenLayout,
        ns: u32,
        ids: &[u32],
        copies: u32,
    ) -> bool {
        let flags = u32::from(parent.is_some()) * F_PARENT + u32::from(layout == TokenLayout::Bigram) * F_BIGRAM;
        let mut e = Entry { parent: parent.unwrap_or(0), copies, block_size, ns, flags };
        let shard = shard_of(hash);
        let old = self.shards[shard].get(&hash).copied();
        let loc = match old {
            Some(loc) => {
                let was = Entry::read(self.record(loc));
                e.copies = was.copies.saturating_add(copies);
                if was.ns != ns {
                    self.ns.add(was.ns, -1);
                    self.ns.gc(was.ns);
                    self.ns.add(ns, 1);
                }
                if self.slabs[loc.slab()].len == ids.len() {
                    loc
                } else {
                    // Another length: its record moves to that length's slab.
                    self.slabs[loc.slab()].free.push(loc.slot());
                    let i = self.slab(ids.len());
                    let moved = Loc::new(i, self.slabs[i].alloc());
                    self.shards[shard].insert(hash, moved);
                    moved
                }
            }
            None => {
                self.ns.add(ns, 1);
                self.blocks += 1;
                let i = self.slab(ids.len());
                let loc = Loc::new(i, self.slabs[i].alloc());
                self.shards[shard].insert(hash, loc);
                loc
            }
        };
        let r = self.slabs[loc.slab()].record_mut(loc.slot());
        e.write(r);
        r[HEAD..].copy_from_slice(ids);
        self.copies += u64::from(copies);
        old.is_some()
    }

    /// Takes one copy of `hash`; false when it had none.
    fn remove(&mut self, hash: u64) -> bool {
        let shard = shard_of(hash);
        let Some(&loc) = self.shards[shard].get(&hash) else { return false };
        self.copies -= 1;
        let slab = &mut self.slabs[loc.slab()];
        let r = slab.record_mut(loc.slot());
        if r[COPIES] > 1 {
            r[COPIES] -= 1;
            return true;
        }
        let ns = r[NS];
        slab.free.push(loc.slot());
        self.shards[shard].remove(&hash);
        self.blocks -= 1;
        self.ns.add(ns, -1);
        self.ns.gc(ns);
        true
    }

    /// Approximate heap bytes: the maps' buckets, the slabs' pages, the namespaces.
    fn heap_bytes(&self) -> u64 {
        // hashbrown holds 7 items per 8 buckets, plus a control byte per bucket.
        let bucket = std::mem::size_of::<(u64, Loc)>() + 1;
        let maps: usize = self.shards.iter().map(|m| m.capacity().div_ceil(7) * 8 * bucket).sum();
        let slabs: usize = self.slabs.iter().map(|s| s.pages.len() * s.per_page() * s.stride() * 4).sum();
        (maps + slabs + self.ns.list.len() * std::mem::size_of::<(Namespace, u64)>()) as u64
    }
}

/// A snapshot being copied (see the module docs).
#[derive(Debug)]
pub(crate) struct Journal {
    id: u64,
    /// The tables it selects, as they were at its cursor, in order.
    tables: Vec<TableKey>,
    tokens: bool,
    /// The next (table, shard) to copy.
    next: (usize, usize),
    /// Blocks of uncopied shards as they were at the cursor (`None`: not there), by (table,
    /// shard, hash). Boxed: most are `None` (blocks stored after the cursor), 32 bytes each.
    pre: BTreeMap<(usize, usize, u64), Option<Box<SnapshotBlock>>>,
    /// Tables cleared before they were copied whole, as they were when cleared.
    stash: HashMap<usize, Table>,
}

impl Journal {
    fn watches(&self, key: &TableKey) -> Option<usize> {
        let i = self.tables.binary_search(key).ok()?;
        (i >= self.next.0 && !self.stash.contains_key(&i)).then_some(i)
    }

    /// Keeps `hash`'s block as it is now, before its first change, if its shard is not copied.
    fn note(&mut self, i: usize, key: &TableKey, table: Option<&Table>, hash: u64) {
        let s = shard_of(hash);
        if (i, s) < self.next {
            return;
        }
        if let std::collections::btree_map::Entry::Vacant(v) = self.pre.entry((i, s, hash)) {
            v.insert(table.and_then(|t| t.shards[s].get(&hash).map(|&l| Box::new(t.block(key, hash, l, self.tokens)))));
        }
    }

    pub(crate) fn done(&self) -> bool {
        self.next.0 >= self.tables.len()
    }

    /// Copies the next shard into `out`, sorted by hash; returns the blocks it read.
    fn copy_next(&mut self, set: &BTreeMap<TableKey, Table>, out: &mut Vec<SnapshotBlock>) -> usize {
        let (i, s) = self.next;
        let key = &self.tables[i];
        let rest = self.pre.split_off(&(i, s + 1, 0));
        // This shard's pre-images, in hash order (the map's order).
        let mine = std::mem::replace(&mut self.pre, rest);
        let mut read = mine.len();
        let mut pre = mine.into_iter().map(|((_, _, h), b)| (h, b)).peekable();
        if let Some(t) = self.stash.get(&i).or_else(|| set.get(key)) {
            read += t.shards[s].len();
            // Sorted as (hash, entry) pairs, then built in order: cheaper than sorting blocks.
            let mut now: Vec<(u64, Loc)> = t.shards[s].iter().map(|(h, l)| (*h, *l)).collect();
            now.sort_unstable_by_key(|(h, _)| *h);
            out.reserve(now.len());
            for (h, e) in now {
                while let Some((_, b)) = pre.next_if(|(ph, _)| *ph < h) {
                    out.extend(b.map(|b| *b));
                }
                match pre.next_if(|(ph, _)| *ph == h) {
                    // Changed since the cursor: as it was then.
                    Some((_, b)) => out.extend(b.map(|b| *b)),
                    None => out.push(t.block(key, h, e, self.tokens)),
                }
            }
        }
        out.extend(pre.filter_map(|(_, b)| b.map(|b| *b)));
        self.next = if s + 1 == SHARDS {
            self.stash.remove(&i);
            (i + 1, 0)
        } else {
            (i, s + 1)
        };
        read
    }
}

/// The live set and the snapshots being copied from it: one lock guards both.
#[derive(Debug, Default)]
pub(crate) struct LiveSet {
    pub tables: BTreeMap<TableKey, Table>,
    /// The cursor of the last record applied.
    pub cursor: u64,
    /// Removals of a block with no copy, since the store was created.
    pub removed_not_live: u64,
    /// Stores of a block already held, since the store was created.
    pub stored_already_live: u64,
    journals: Vec<Journal>,
    next_journal: u64,
}

impl LiveSet {
    /// Applies the record at `cursor` (the next one).
    pub(crate) fn apply(&mut self, cursor: u64, body: &RecordBody) {
        match body {
            RecordBody::Batch { batch, .. } => {
                for e in &batch.events {
                    self.apply_event(batch.dp_rank, e);
                }
            }
            RecordBody::Control(c) => {
                if matches!(c.kind, crate::model::ControlKind::RankReset { .. }) {
                    self.clear(c.dp_rank, None);
                }
            }
        }
        self.cursor = cursor;
    }

    fn apply_event(&mut self, dp_rank: u32, e: &Event) {
        match e {
            Event::Stored(s) => {
                let key = TableKey { dp_rank, tier: s.tier.clone(), group: s.group.idx };
                let table = self.tables.entry(key.clone()).or_default();
                let watching: Vec<(usize, usize)> =
                    self.journals.iter().enumerate().filter_map(|(j, jr)| Some((j, jr.watches(&key)?))).collect();
                let ns = table.ns.intern(&s.namespace);
                let mut parent = s.parent;
                for b in &s.blocks {
                    for &(j, i) in &watching {
                        self.journals[j].note(i, &key, Some(table), b.hash);
                    }
                    if table.store(b.hash, parent, s.block_size, s.token_layout, ns, &b.token_ids, 1) {
                        self.stored_already_live += 1;
                    }
                    parent = Some(b.hash);
                }
                table.ns.gc(ns);
            }
            Event::Removed(r) => {
                let key = TableKey { dp_rank, tier: r.tier.clone(), group: r.group };
                let Some(table) = self.tables.get_mut(&key) else {
                    self.removed_not_live += r.block_hashes.len() as u64;
                    return;
                };
                let watching: Vec<(usize, usize)> =
                    self.journals.iter().enumerate().filter_map(|(j, jr)| Some((j, jr.watches(&key)?))).collect();
                for &h in &r.block_hashes {
                    for &(j, i) in &watching {
                        self.journals[j].note(i, &key, Some(table), h);
                    }
                    if !table.remove(h) {
                        self.removed_not_live += 1;
                    }
                }
            }
            Event::Cleared(c) => self.clear(dp_rank, c.tier.as_ref()),
        }
    }

    /// Drops the rank's tables (of one tier when given), handing each to the snapshots that
    /// have not copied it yet.
    fn clear(&mut self, dp_rank: u32, tier: Option<&Tier>) {
        let keys: Vec<TableKey> = self
            .tables
            .range(TableKey { dp_rank, tier: Tier::Device, group: 0 }..)
            .take_while(|(k, _)| k.dp_rank == dp_rank)
            .filter(|(k, _)| tier.is_none_or(|t| &k.tier == t))
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            let table = self.tables.remove(&key).expect("listed");
            let mut table = Some(table);
            let watching: Vec<(usize, usize)> =
                self.journals.iter().enumerate().filter_map(|(j, jr)| Some((j, jr.watches(&key)?))).collect();
            for (n, &(j, i)) in watching.iter().enumerate() {
                let t = if n + 1 == watching.len() {
                    table.take().expect("moved last")
                } else {
                    table.as_ref().expect("kept").clone()
                };
                self.journals[j].stash.insert(i, t);
            }
        }
    }

    /// Puts a block back as a checkpoint (or an older store) held it.
    pub(crate) fn insert(&mut self, b: &SnapshotBlock) {
        let key = TableKey { dp_rank: b.dp_rank, tier: b.tier.clone(), group: b.group };
        let table = self.tables.entry(key).or_default();
        let ns = table.ns.intern(&b.namespace);
        table.store(b.hash, b.parent, b.block_size, b.token_layout, ns, &b.token_ids, b.copies.max(1));
        table.ns.gc(ns);
    }

    /// Registers a snapshot of what `filter` selects, at [`LiveSet::cursor`]; returns its id and
    /// the blocks it will hold.
    pub(crate) fn open_journal(&mut self, filter: &SnapshotFilter) -> (u64, u64) {
        let tables: Vec<TableKey> = self
            .tables
            .iter()
            .filter(|(k, t)| t.blocks > 0 && filter.wants_rank(k.dp_rank) && filter.wants_tier(&k.tier))
            .map(|(k, _)| k.clone())
            .collect();
        let blocks = tables.iter().map(|k| self.tables[k].blocks).sum();
        let id = self.next_journal;
        self.next_journal += 1;
        self.journals.push(Journal {
            id,
            tables,
            tokens: filter.include_token_ids,
            next: (0, 0),
            pre: BTreeMap::new(),
            stash: HashMap::new(),
        });
        (id, blocks)
    }

    /// Copies shards of journal `id` into `out` until at least `want` blocks were read or it is
    /// done; returns whether it is done. An unknown id is done.
    pub(crate) fn copy(&mut self, id: u64, want: usize, out: &mut Vec<SnapshotBlock>) -> bool {
        let Some(j) = self.journals.iter_mut().find(|j| j.id == id) else { return true };
        let mut read = 0;
        while !j.done() && read < want {
            read += j.copy_next(&self.tables, out);
        }
        j.done()
    }

    pub(crate) fn close_journal(&mut self, id: u64) {
        self.journals.retain(|j| j.id != id);
    }

    /// Open snapshots.
    #[cfg(test)]
    pub(crate) fn journals(&self) -> usize {
        self.journals.len()
    }

    /// Totals of the tables holding blocks, in (rank, tier, group) order.
    pub(crate) fn summary(&self) -> Vec<LiveGroupSummary> {
        self.tables
            .iter()
            .filter(|(_, t)| t.blocks > 0)
            .map(|(k, t)| LiveGroupSummary {
                dp_rank: k.dp_rank,
                tier: k.tier.clone(),
                group: k.group,
                blocks: t.blocks,
                copies: t.copies,
                namespaces: t.ns.live,
            })
            .collect()
    }

    pub(crate) fn heap_bytes(&self) -> u64 {
        self.tables.values().map(Table::heap_bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Batch, Block, Cleared, Removed, Stored};

    fn stored(hashes: &[u64], ns: Option<&str>, tokens: usize) -> Event {
        let blocks = hashes
            .iter()
            .map(|&hash| Block::new(hash, (0..tokens as u32).map(|t| t + hash as u32).collect()))
            .collect();
        Event::Stored(Stored {
            namespace: Namespace { cache_salt: ns.map(str::to_string), ..Default::default() },
            ..Stored::plain(Tier::Device, 0, 4, blocks)
        })
    }

    fn apply(live: &mut LiveSet, events: Vec<Event>) {
        let c = live.cursor + 1;
        live.apply(
            c,
            &RecordBody::Batch { batch: Batch { dp_rank: 0, seq: c, ts: 0.0, events }, load: None, liveness: None },
        );
    }

    fn all(live: &mut LiveSet, tokens: bool) -> Vec<SnapshotBlock> {
        let (id, blocks) = live.open_journal(&SnapshotFilter { include_token_ids: tokens, ..SnapshotFilter::all() });
        let mut out = Vec::new();
        assert!(live.copy(id, usize::MAX, &mut out));
        live.close_journal(id);
        assert_eq!(out.len() as u64, blocks);
        out
    }

    #[test]
    fn slots_and_namespaces_are_reused_and_freed() {
        let mut live = LiveSet::default();
        apply(&mut live, vec![stored(&[1, 2, 3], Some("a"), 4)]);
        apply(&mut live, vec![stored(&[2], Some("b"), 2)]);
        let t = &live.tables[&TableKey { dp_rank: 0, tier: Tier::Device, group: 0 }];
        assert_eq!((t.blocks, t.copies, t.ns.live), (3, 4, 2));
        assert_eq!(
            t.slabs.iter().map(|s| (s.len, s.used, s.free.len())).collect::<Vec<_>>(),
            vec![(4, 3, 1), (2, 1, 0)]
        );
        apply(
            &mut live,
            vec![Event::Removed(Removed {
                tier: Tier::Device,
                group: 0,
                block_hashes: vec![2, 2, 2, 9],
                ownership: None,
            })],
        );
        assert_eq!((live.removed_not_live, live.stored_already_live), (2, 1));
        let t = &live.tables[&TableKey { dp_rank: 0, tier: Tier::Device, group: 0 }];
        assert_eq!((t.blocks, t.copies, t.ns.live, t.ns.free.len()), (2, 2, 1, 1));
        // The freed 4-token slot and namespace id are taken again.
        apply(&mut live, vec![stored(&[7], Some("c"), 4)]);
        let t = &live.tables[&TableKey { dp_rank: 0, tier: Tier::Device, group: 0 }];
        assert_eq!((t.slabs[0].used, t.slabs[0].free.len(), t.ns.free.len(), t.ns.list.len()), (3, 0, 0, 2));
        let got: Vec<(u64, Vec<u32>, Option<String>)> =
            all(&mut live, true).into_iter().map(|b| (b.hash, b.token_ids, b.namespace.cache_salt)).collect();
        assert_eq!(
            got,
            vec![
                (1, vec![1, 2, 3, 4], Some("a".into())),
                (3, vec![3, 4, 5, 6], Some("a".into())),
                (7, vec![7, 8, 9, 10], Some("c".into()))
            ]
        );
    }

    #[test]
    fn a_snapshot_copied_in_steps_is_the_state_at_its_cursor() {
        let mut live = LiveSet::default();
        // Hashes spread over every shard.
        let hashes: Vec<u64> = (0..2000u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
        apply(&mut live, vec![stored(&hashes, None, 3)]);
        let before = all(&mut live, true);
        let (id, blocks) = live.open_journal(&SnapshotFilter::all());
        assert_eq!(blocks, 2000);
        let mut out = Vec::new();
        let mut step = 0u64;
        while !live.copy(id, 1, &mut out) {
            step += 1;
            // Between steps: remove, store again with other tokens, add new, and once clear all.
            let h = hashes[(step * 7 % 2000) as usize];
            apply(
                &mut live,
                vec![
                    Event::Removed(Removed { tier: Tier::Device, group: 0, block_hashes: vec![h], ownership: None }),
                    stored(&[hashes[(step * 13 % 2000) as usize], step << 40], Some("x"), 5),
                ],
            );
            if step == 200 {
                apply(&mut live, vec![Event::Cleared(Cleared { tier: None }), stored(&[5], None, 1)]);
            }
        }
        live.close_journal(id);
        assert!(step > 200);
        let mut sorted = before.clone();
        sorted.sort_by_key(|b| b.hash);
        assert_eq!(out, sorted);
        assert_eq!(live.journals(), 0);
    }
}
