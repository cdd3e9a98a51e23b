//! A worker's complete state, staged outside the index before an atomic replace.

use super::ids::TierId;
use super::prefetch::prefetch;

/// A worker's complete new state: `(tier, hash, copies)` triples, collected (for example from
/// a relay's snapshot chunks) without touching the index, then swapped in whole by
/// [`PrefixIndex::replace_worker`](super::PrefixIndex::replace_worker).
///
/// Triples with the same `(tier, hash)` add up; triples with 0 copies are ignored.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StagedSnapshot {
    pub(super) entries: Vec<(TierId, u64, u32)>,
    /// Per entry, the hash it was stored after (`NO_PARENT` if none), or empty when no entry
    /// came with one.
    pub(super) parents: Vec<u64>,
}

/// No parent (see [`StagedSnapshot::push_after`]). A parent equal to it is taken as none.
pub(super) const NO_PARENT: u64 = u64::MAX;

impl StagedSnapshot {
    /// An empty state (replacing with it drops all of the worker's blocks).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `copies` copies of `hash` in `tier`.
    pub fn push(&mut self, tier: TierId, hash: u64, copies: u32) {
        self.push_after(tier, hash, copies, None);
    }

    /// [`push`](Self::push) of a block the engine stored after `parent` (a relay's snapshot
    /// says so per block). The parents only guide how the replace lays the worker's blocks
    /// out, as with [`PrefixIndex::store_after`](super::PrefixIndex::store_after): a block
    /// follows its parent, so that lookups of the resynced worker follow runs instead of
    /// probing every block. Absent, wrong, or not staged, the worker's state is the same.
    pub fn push_after(&mut self, tier: TierId, hash: u64, copies: u32, parent: Option<u64>) {
        let parent = parent.unwrap_or(NO_PARENT);
        if parent != NO_PARENT && self.parents.len() < self.entries.len() {
            self.parents.resize(self.entries.len(), NO_PARENT);
        }
        if parent != NO_PARENT || !self.parents.is_empty() {
            self.parents.push(parent);
        }
        self.entries.push((tier, hash, copies));
    }

    /// Adds one copy of each hash in `tier`.
    pub fn extend_blocks(&mut self, tier: TierId, hashes: &[u64]) {
        for &h in hashes {
            self.push(tier, h, 1);
        }
    }

    /// Number of staged triples.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is staged.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The staged triples, in insertion order.
    pub fn entries(&self) -> &[(TierId, u64, u32)] {
        &self.entries
    }

    /// [`order`](Self::order) by entry indexes: each entry's index, and its parent's.
    #[cfg(test)]
    pub(super) fn layout(&self) -> Vec<(usize, Option<usize>)> {
        if self.parents.is_empty() {
            return (0..self.entries.len()).map(|i| (i, None)).collect();
        }
        let order = self.order();
        order
            .iter()
            .map(|&(i, parent)| (i as usize, (parent != NONE).then(|| order[parent as usize].0 as usize)))
            .collect()
    }

    /// The entries in [`order`](Self::order), gathered, so that the replace that writes them
    /// reads them in order (with an engine's hashes, a relay's snapshot comes in no order of
    /// its chains, and reading each entry where it was staged was a cache miss that the
    /// replace's work kept from overlapping the next ones). Without parents (or with more
    /// entries than positions in `u32`), the staging order, no entry with a parent.
    pub(super) fn laid(&self) -> Layout {
        let n = self.entries.len();
        let mut out = Layout { hashes: Vec::with_capacity(n), blocks: Vec::with_capacity(n) };
        if self.parents.is_empty() || n >= NONE as usize {
            for &(tier, hash, copies) in &self.entries {
                out.hashes.push(hash);
                out.blocks.push((tier, copies, NONE));
            }
            return out;
        }
        let order = self.order();
        for (k, &(i, parent)) in order.iter().enumerate() {
            if let Some(&(ahead, _)) = order.get(k + GATHER_AHEAD) {
                prefetch(&self.entries[ahead as usize].1);
            }
            let (tier, hash, copies) = self.entries[i as usize];
            out.hashes.push(hash);
            out.blocks.push((tier, copies, parent));
        }
        out
    }

    /// The order to write the entries in, so that each follows its parent's entry where it
    /// can (same tier): every staged chain in order, from its first block (one without a
    /// staged parent), each block right after its parent where it can be (its parent's first
    /// child), then any entries left (parents that form a cycle), in order. Each entry's
    /// index, and the position in this order of its parent's entry (`NONE` if none: it is
    /// always before the entry). For staged parents and fewer than `NONE` entries.
    fn order(&self) -> Vec<(u32, u32)> {
        let n = self.entries.len();
        debug_assert!(!self.parents.is_empty() && n < NONE as usize);
        let first = FirstOf::new(&self.entries);
        // Children of each entry, as linked lists from the last staged to the first.
        let (mut head, mut next) = (vec![NONE; n], vec![NONE; n]);
        let mut has_parent = Bits::new(n);
        for (i, (&(tier, h, _), &parent)) in self.entries.iter().zip(&self.parents).enumerate() {
            if let (Some(&(tier, _, _)), Some(&parent)) = (self.entries.get(i + AHEAD), self.parents.get(i + AHEAD)) {
                first.ask(tier, parent);
            }
            if parent == NO_PARENT || parent == h {
                continue;
            }
            if let Some(p) = first.get(tier, parent) {
                next[i] = head[p];
                head[p] = i as u32;
                has_parent.set(i);
            }
        }
        let mut order: Vec<(u32, u32)> = Vec::with_capacity(n);
        let mut done = Bits::new(n);
        // (entry, its parent's position).
        let mut stack: Vec<(u32, u32)> = Vec::new();
        let roots = (0..n).filter(|&i| !has_parent.get(i));
        for start in roots.chain(0..n) {
            if done.get(start) {
                continue;
            }
            stack.push((start as u32, NONE));
            while let Some((i, parent)) = stack.pop() {
                if done.get(i as usize) {
                    continue;
                }
                done.set(i as usize);
                let at = order.len() as u32;
                order.push((i, parent));
                // Children pushed last-staged first, so that the first is written next.
                let mut c = head[i as usize];
                while c != NONE {
                    stack.push((c, at));
                    c = next[c as usize];
                }
            }
        }
        order
    }
}

/// The staged entries in the order a replace writes them ([`StagedSnapshot::laid`]).
pub(super) struct Layout {
    /// The hash of each entry.
    pub hashes: Vec<u64>,
    /// The tier and copies of each entry, and the position of its parent's entry in this
    /// order (`NONE` if none).
    pub blocks: Vec<(TierId, u32, u32)>,
}

/// How many entries ahead of the one it works on [`StagedSnapshot::order`] asks for the line of
/// a parent's slot in [`FirstOf`].
const AHEAD: usize = 8;
/// How many entries ahead [`StagedSnapshot::laid`] asks for the line of an entry it gathers.
const GATHER_AHEAD: usize = 16;

/// A set of entry indexes, a bit each (a million entries' bits stay in cache).
struct Bits(Vec<u64>);

impl Bits {
    fn new(n: usize) -> Self {
        Bits(vec![0; n.div_ceil(64)])
    }

    fn get(&self, i: usize) -> bool {
        self.0[i / 64] & 1 << (i % 64) != 0
    }

    fn set(&mut self, i: usize) {
        self.0[i / 64] |= 1 << (i % 64);
    }
}

/// No entry or position (in [`StagedSnapshot::order`]'s lists and a [`Layout`]'s parents,
/// which are `u32`: a worker's run entries stop at 2^26, and a snapshot of `NONE` entries or
/// more is laid out in staging order, without parents).
pub(super) const NONE: u32 = u32::MAX;

/// The first entry of each staged `(tier, hash)`, for [`StagedSnapshot::order`]: open
/// addressing over slots of 16 bytes (hash, entry and tier), at most half full, so that
/// finding a parent is one cache miss. A `HashMap` of `(TierId, u64) -> usize` took 24 bytes
/// an entry and the tuple's hashing, and was most of the layout of a million blocks.
struct FirstOf {
    slots: Vec<FirstSlot>,
    shift: u32,
}

#[derive(Clone, Copy)]
struct FirstSlot {
    hash: u64,
    /// The entry's index, `NONE` for an empty slot.
    at: u32,
    tier: u8,
}

impl FirstOf {
    fn new(entries: &[(TierId, u64, u32)]) -> Self {
        let bits = (2 * entries.len()).next_power_of_two().max(2).trailing_zeros();
        let mut first =
            FirstOf { slots: vec![FirstSlot { hash: 0, at: NONE, tier: 0 }; 1 << bits], shift: u64::BITS - bits };
        for (i, &(tier, hash, _)) in entries.iter().enumerate() {
            if let Some(&(tier, hash, _)) = entries.get(i + AHEAD) {
                first.ask(tier, hash);
            }
            let k = first.find(tier.get(), hash);
            if first.slots[k].at == NONE {
                first.slots[k] = FirstSlot { hash, at: i as u32, tier: tier.get() };
            }
        }
        first
    }

    /// The first slot `(tier, hash)` may be in.
    fn home(&self, tier: u8, hash: u64) -> usize {
        ((hash ^ (tier as u64) << 58).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.shift) as usize
    }

    /// Asks for the cache line of the first slot `(tier, hash)` may be in.
    fn ask(&self, tier: TierId, hash: u64) {
        prefetch(&self.slots[self.home(tier.get(), hash)].hash);
    }

    /// The slot of `(tier, hash)`, or the empty slot where it would go.
    fn find(&self, tier: u8, hash: u64) -> usize {
        let mask = self.slots.len() - 1;
        let mut k = self.home(tier, hash);
        loop {
            let s = &self.slots[k];
            if s.at == NONE || (s.hash == hash && s.tier == tier) {
                return k;
            }
            k = (k + 1) & mask;
        }
    }

    /// The first entry of `(tier, hash)`, if staged.
    fn get(&self, tier: TierId, hash: u64) -> Option<usize> {
        let s = &self.slots[self.find(tier.get(), hash)];
        (s.at != NONE).then_some(s.at as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chains staged out of order, with a fork, a cycle, a parent not staged, one staged in
    /// another tier only, and a block staged twice.
    fn staged() -> StagedSnapshot {
        let d = TierId::DEVICE;
        let mut s = StagedSnapshot::new();
        s.push_after(d, 3, 1, Some(2)); // 0: child of 2
        s.push(d, 1, 1); // 1: a first block
        s.push_after(d, 2, 1, Some(1)); // 2: child of 1
        s.push_after(d, 4, 1, Some(1)); // 3: second child of 1
        s.push_after(d, 9, 1, Some(8)); // 4: parent not staged: a first block
        s.push_after(d, 6, 1, Some(7)); // 5: a cycle, 6 <-> 7
        s.push_after(d, 7, 1, Some(6)); // 6
        s.push_after(TierId::HOST, 5, 1, Some(1)); // 7: parent staged only in another tier
        s.push_after(d, 2, 2, Some(1)); // 8: the same block again: a child of 1 too
        s
    }

    #[test]
    fn chains_are_laid_out_parent_first_then_what_is_left_in_order() {
        let d = TierId::DEVICE;
        let s = staged();
        let order: Vec<(usize, Option<usize>)> = s.layout();
        assert_eq!(
            order,
            vec![
                (1, None),
                (2, Some(1)),
                (0, Some(2)),
                (3, Some(1)),
                (8, Some(1)),
                (4, None),
                (7, None),
                (5, None),
                (6, Some(5)),
            ]
        );
        // Without parents, the staging order.
        let mut plain = StagedSnapshot::new();
        plain.extend_blocks(d, &[5, 4, 3]);
        assert_eq!(plain.layout(), vec![(0, None), (1, None), (2, None)]);
        // Parents given for some entries only: the others have none.
        let mut some = StagedSnapshot::new();
        some.push(d, 1, 1);
        some.push_after(d, 2, 1, Some(1));
        assert_eq!(some.parents, vec![NO_PARENT, 1]);
        assert_eq!(some.layout(), vec![(0, None), (1, Some(0))]);
    }

    #[test]
    fn laid_gathers_the_entries_in_order_with_parents_as_positions() {
        let d = TierId::DEVICE;
        let h = TierId::HOST;
        let mut s = staged();
        s.push_after(d, 11, 0, Some(9)); // 9: no copies, a child of 9
        s.push_after(d, 12, 3, Some(11)); // 10: child of the entry without copies
        s.push_after(d, 13, 1, Some(13)); // 11: its own parent: a first block
        let laid = s.laid();
        // Positions: 1 2 3 4 2 | 9 11 12 | 5 | 13 | 6 7.
        assert_eq!(laid.hashes, vec![1, 2, 3, 4, 2, 9, 11, 12, 5, 13, 6, 7]);
        assert_eq!(
            laid.blocks,
            vec![
                (d, 1, NONE),
                (d, 1, 0),
                (d, 1, 1),
                (d, 1, 0),
                (d, 2, 0),
                (d, 1, NONE),
                (d, 0, 5),
                (d, 3, 6),
                (h, 1, NONE),
                (d, 1, NONE),
                (d, 1, NONE),
                (d, 1, 10),
            ]
        );
        // A chain staged backwards is laid out forwards.
        let mut back = StagedSnapshot::new();
        for hash in (1..=5u64).rev() {
            back.push_after(d, hash, 1, (hash > 1).then(|| hash - 1));
        }
        let laid = back.laid();
        assert_eq!(laid.hashes, vec![1, 2, 3, 4, 5]);
        assert_eq!(laid.blocks, vec![(d, 1, NONE), (d, 1, 0), (d, 1, 1), (d, 1, 2), (d, 1, 3)]);
        // Without parents: the staging order, none with a parent.
        let mut plain = StagedSnapshot::new();
        plain.push(h, 5, 2);
        plain.push(d, 4, 0);
        plain.push(d, 5, 1);
        let laid = plain.laid();
        assert_eq!(laid.hashes, vec![5, 4, 5]);
        assert_eq!(laid.blocks, vec![(h, 2, NONE), (d, 0, NONE), (d, 1, NONE)]);
        let empty = StagedSnapshot::new().laid();
        assert!(empty.hashes.is_empty() && empty.blocks.is_empty());
    }

    #[test]
    fn first_of_finds_the_first_entry_of_each_tier_and_hash() {
        let d = TierId::DEVICE;
        let h = TierId::HOST;
        // Hashes that differ only in the bits the tier is mixed into, and the same hash in
        // several tiers and entries.
        let entries = vec![(d, 7, 1), (h, 7, 1), (d, 7 ^ (1 << 58), 1), (d, 7, 2), (h, 8, 0), (h, 7, 3)];
        let first = FirstOf::new(&entries);
        assert_eq!(first.get(d, 7), Some(0));
        assert_eq!(first.get(h, 7), Some(1));
        assert_eq!(first.get(d, 7 ^ (1 << 58)), Some(2));
        assert_eq!(first.get(h, 8), Some(4));
        assert_eq!(first.get(d, 8), None);
        assert_eq!(first.get(TierId::DISK, 7), None);
        // Many entries: a table of a power of two slots, at most half full, finds every one.
        let many: Vec<(TierId, u64, u32)> = (0..1000u64).map(|i| (d, i << 54, 1)).collect();
        let first = FirstOf::new(&many);
        assert_eq!(first.slots.len(), 2048);
        for i in 0..1000 {
            assert_eq!(first.get(d, i << 54), Some(i as usize));
        }
        assert_eq!(first.get(d, 1000 << 54), None);
    }
}
