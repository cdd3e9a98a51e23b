use super::lookup::SCRATCH;
use super::*;

#[test]
fn an_index_that_only_grows_keeps_few_of_the_table_sets_it_swapped_out() {
    let index = PrefixIndex::new(IndexConfig { shards: 1, initial_capacity: 0 });
    let w = index.worker("http://relay-a:50051", 0).unwrap();
    index.store(w, TierId::DEVICE, &(0..20_000).collect::<Vec<u64>>());
    assert!(index.stats().rebuilds >= 10, "{:?}", index.stats());
    assert!(lock(&index.retired_sets).len() <= 2, "{} sets kept", lock(&index.retired_sets).len());
}

#[test]
fn the_memory_breakdown_adds_up_to_memory_bytes_and_counts_live_and_dead_slots_and_entries() {
    let index = PrefixIndex::default();
    let w = index.worker("http://relay-a:50051", 0).unwrap();
    index.store(w, TierId::DEVICE, &(0..1000).collect::<Vec<u64>>());
    index.remove(w, TierId::DEVICE, &(0..100).collect::<Vec<u64>>());
    let m = index.memory_breakdown();
    assert_eq!(m.total(), index.memory_bytes());
    // A slot is 16 bytes and a seventh of its group's control word; rounded per shard.
    let slot = |n: usize| n * (16 * 7 + 8) / 7;
    assert!(m.live_slots.abs_diff(slot(900)) < 16, "{m:?}");
    assert!(m.dead_slots.abs_diff(slot(100)) < 16, "{m:?}");
    assert_eq!(m.run_entries, 900 * 8);
    assert!(m.empty_slots > 0 && m.versions > 0 && m.run_headers > 0, "{m:?}");
}

/// Lookups answer the same with any parent or none, so only the layout shows whether a
/// store used its parent: the parent's entry links to the first stored block's.
#[test]
fn a_store_after_its_parent_links_the_parents_entry_to_its_first_block() {
    let index = PrefixIndex::default();
    let w = index.worker("http://relay:50051", 0).expect("worker");
    let holder = packed::holder(w.get(), index.gens.load(w) & 1, TierId::DEVICE.get());
    let entry = |hash: u64| {
        let p = Probe::new(hash);
        index.tables.load()[p.shard(index.shard_mask)].entry(&p, holder).expect("held")
    };
    index.store(w, TierId::DEVICE, &[1, 2, 3]);
    // Another event's blocks come between the parent and the continuation.
    index.store(w, TierId::DEVICE, &[10, 11]);
    index.store_after(w, TierId::DEVICE, Some(3), &[4, 5]);
    assert_eq!((entry(3), entry(10), entry(4)), (2, 3, 5));
    assert_eq!(index.runs.link_of(entry(3)), Some(entry(4)));
    // Without a parent nothing links to the new blocks.
    index.store(w, TierId::DEVICE, &[20]);
    index.store(w, TierId::DEVICE, &[30]);
    index.store(w, TierId::DEVICE, &[6]);
    assert_eq!(index.runs.link_of(entry(20)), None);
    assert_eq!(index.runs.link_of(entry(5)), None);
    // A parent this worker does not hold links nothing either.
    index.store_after(w, TierId::DEVICE, Some(99), &[7]);
    assert_eq!(index.runs.link_of(entry(6)), None);
    assert_eq!(index.lookup(&[1, 2, 3, 4, 5]).get(w).map(|m| m.blocks), Some(5));
}

/// A replace writes the staged chains in order whatever the staging order: each block
/// right after its parent, a fork's other children after the first's chain (linked from
/// their parent's entry), duplicates into the first's slot, nothing for blocks without
/// copies, and a cycle's entries last.
#[test]
fn a_replace_writes_each_staged_chain_in_order_and_links_forks() {
    let index = PrefixIndex::default();
    let w = index.worker("http://relay:50051", 0).expect("worker");
    // Old state, under the other tag: the replace writes the new one from entry 0 of pages
    // of its own.
    index.store(w, TierId::DEVICE, &[1, 2, 3, 50]);
    let d = TierId::DEVICE;
    let mut s = StagedSnapshot::new();
    s.push_after(d, 3, 1, Some(2)); // after 2
    s.push(d, 1, 1); // a first block
    s.push_after(d, 2, 1, Some(1)); // after 1
    s.push_after(d, 4, 1, Some(1)); // after 1 too: a fork
    s.push_after(d, 9, 1, Some(8)); // parent not staged: a first block
    s.push_after(d, 6, 1, Some(7)); // a cycle, 6 <-> 7
    s.push_after(d, 7, 1, Some(6));
    s.push_after(d, 2, 2, Some(1)); // 2 again
    s.push_after(d, 11, 0, Some(9)); // no copies: not written
    s.push_after(d, 12, 1, Some(11)); // after the block not written
    index.replace_worker(w, &s);
    let holder = packed::holder(w.get(), index.gens.load(w) & 1, d.get());
    let entry = |hash: u64| {
        let p = Probe::new(hash);
        index.tables.load()[p.shard(index.shard_mask)].entry(&p, holder)
    };
    let base = entry(1).expect("held");
    assert_eq!(base % PAGE, 0, "a page of the new state's own");
    let entries: Vec<Option<u32>> =
        [1, 2, 3, 4, 9, 12, 6, 7, 11, 50].into_iter().map(|h| entry(h).map(|e| e - base)).collect();
    assert_eq!(entries, vec![Some(0), Some(1), Some(2), Some(3), Some(4), Some(5), Some(6), Some(7), None, None]);
    // The fork's second child is linked from the parent; the rest follow in their page.
    let links: Vec<Option<u32>> = (base..base + 8).map(|e| index.runs.link_of(e)).collect();
    assert_eq!(links, vec![Some(base + 3), None, None, None, None, None, None, None]);
    let blocks = |hashes: &[u64]| index.lookup(hashes).get(w).map(|m| m.blocks);
    assert_eq!(
        [blocks(&[1, 2, 3]), blocks(&[1, 4]), blocks(&[9, 11, 12]), blocks(&[6, 7]), blocks(&[50])],
        [Some(3), Some(2), Some(1), Some(2), None]
    );
}

/// An index and its reference, written together; `look` checks a lookup against the
/// reference and returns how many times this thread's kept candidates were brought up to
/// date by a change (`Scratch::caught_up`) during it.
struct Both {
    index: PrefixIndex,
    reference: reference::ReferenceIndex,
}

impl Both {
    fn store(&mut self, worker: u32, tier: TierId, hashes: &[u64]) {
        let worker = WorkerId::new(worker).expect("small id");
        self.index.store(worker, tier, hashes);
        self.reference.store(worker, tier, hashes);
    }

    fn remove(&mut self, worker: u32, tier: TierId, hashes: &[u64]) {
        let worker = WorkerId::new(worker).expect("small id");
        assert_eq!(self.index.remove(worker, tier, hashes), self.reference.remove(worker, tier, hashes));
    }

    fn look(&self, hashes: &[u64]) -> u64 {
        let before = SCRATCH.with(|s| s.borrow().caught_up);
        assert_eq!(self.index.lookup(hashes), self.reference.lookup(hashes), "lookup of {hashes:?}");
        SCRATCH.with(|s| s.borrow().caught_up) - before
    }
}

/// The crowd record of `hash`'s key, as a lookup would read it.
fn crowd_of(index: &PrefixIndex, hash: u64) -> Option<crowd::Crowd> {
    let p = Probe::new(hash);
    index.tables.load()[p.shard(index.shard_mask)].crowd(&p)
}

/// A popular block's record follows every change of its holders: taken at eight slots of
/// workers below 128 in one tier, dropped below eight, with a second tier or a wide
/// worker, kept through rebuilds, and both tags' holders while a replace is under way.
/// Every lookup, from the record or from the slots, equals the reference's.
#[test]
fn a_popular_blocks_record_follows_every_change_of_its_holders() {
    let mut b = Both {
        index: PrefixIndex::new(IndexConfig { shards: 1, initial_capacity: 0 }),
        reference: reference::ReferenceIndex::new(),
    };
    let s = [0x61u64, 0x62, 0x63, 0x64];
    let record = |b: &Both| crowd_of(&b.index, s[0]).map(|c| (c.tier, c.workers));
    for k in 0..7 {
        b.store(k, TierId::DEVICE, &s[..1 + k as usize % 4]);
    }
    assert_eq!(record(&b), None, "seven holders");
    b.store(9, TierId::DEVICE, &s);
    assert_eq!(record(&b), Some((0, [0x27f, 0])));
    b.look(&s);
    let found = b.index.lookup(&s);
    let blocks: Vec<(u32, u32)> = found.iter().map(|m| (m.worker.get(), m.blocks)).collect();
    assert_eq!(blocks, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 1), (5, 2), (6, 3), (9, 4)]);
    // A second tier: no record; back to one: the record again.
    b.store(4, TierId::HOST, &s[..2]);
    assert_eq!(record(&b), None);
    b.look(&s);
    b.remove(4, TierId::HOST, &s[..2]);
    assert_eq!(record(&b), Some((0, [0x27f, 0])));
    // A worker past the bitsets' 128: no record while it holds the block.
    b.store(128, TierId::DEVICE, &s[..3]);
    assert_eq!(record(&b), None);
    b.look(&s);
    b.remove(128, TierId::DEVICE, &s[..3]);
    b.store(127, TierId::DEVICE, &s[..3]);
    assert_eq!(record(&b), Some((0, [0x27f | 1 << 127, 0])));
    b.look(&s);
    // Copies are not holders.
    b.store(127, TierId::DEVICE, &s[..1]);
    b.remove(127, TierId::DEVICE, &s[..1]);
    assert_eq!(record(&b), Some((0, [0x27f | 1 << 127, 0])));
    // Many other blocks: the table is rebuilt several times, the record stays.
    let rebuilds = b.index.stats().rebuilds;
    for k in 0..2_000u64 {
        b.store(k as u32 % 16, TierId::DEVICE, &[0x1000 + k]);
    }
    assert!(b.index.stats().rebuilds > rebuilds);
    assert_eq!(record(&b), Some((0, [0x27f | 1 << 127, 0])));
    b.look(&s);
    // A replace of worker 2: the new state under the other tag, then the old one gone.
    let mut snap = StagedSnapshot::new();
    snap.extend_blocks(TierId::DEVICE, &s[..2]);
    b.index.replace_worker(WorkerId::new(2).expect("small id"), &snap);
    b.reference.replace_worker(WorkerId::new(2).expect("small id"), &snap);
    let tag2 = b.index.gens.load(WorkerId::new(2).expect("small id")) & 1;
    let mut want = [0x27b | 1 << 127, 0];
    want[tag2 as usize] |= 1 << 2;
    assert_eq!(record(&b), Some((0, want)));
    assert_eq!(b.index.lookup(&s).blocks(WorkerId::new(2).expect("small id")), 2);
    b.look(&s);
    // Below eight holders: dropped.
    b.remove(0, TierId::DEVICE, &s[..1]);
    want[0] &= !1;
    assert_eq!(record(&b), Some((0, want)));
    b.look(&s);
    b.remove(1, TierId::DEVICE, &s[..1]);
    assert_eq!(record(&b), None);
    b.look(&s);
}

/// Kept candidates of a crowded first block follow a single change of its holders (a slot
/// born or dead, in any tier, under either tag) by applying it, not by reading the block's
/// holders again; two changes, or a change leaving fewer than eight holders, make the
/// lookup read them. Every answer equals the reference's.
#[test]
fn kept_candidates_take_a_single_change_of_their_block_without_reading_it_again() {
    let mut b = Both {
        index: PrefixIndex::new(IndexConfig { shards: 1, initial_capacity: 1 << 12 }),
        reference: reference::ReferenceIndex::new(),
    };
    let s = [0x51u64, 0x52, 0x53];
    for k in 0..12 {
        b.store(k, TierId::DEVICE, &s[..1 + k as usize % 3]);
    }
    // The first lookup keeps the candidates, the second uses them as they are.
    assert_eq!((b.look(&s), b.look(&s)), (0, 0));
    // A new holder, with an id between the others' and past them.
    b.store(40, TierId::DEVICE, &s);
    assert_eq!(b.look(&s), 1);
    b.store(7, TierId::HOST, &s[..2]);
    assert_eq!(b.look(&s), 1);
    // A holder's last copy of block 0 goes; then a tier of a holder with two.
    b.remove(4, TierId::DEVICE, &s[..1]);
    assert_eq!(b.look(&s), 1);
    b.remove(7, TierId::DEVICE, &s[..1]);
    assert_eq!(b.look(&s), 1);
    // Copies are not changes of the holders: nothing to bring up.
    b.store(5, TierId::DEVICE, &s[..1]);
    assert_eq!(b.look(&s), 0);
    b.remove(5, TierId::DEVICE, &s[..1]);
    assert_eq!(b.look(&s), 0);
    // The other tag (a replace under way writes under it) is not counted by lookups.
    let w3 = WorkerId::new(3).expect("small id");
    let other = packed::holder(3, (b.index.gens.load(w3) & 1) ^ 1, TierId::DISK.get());
    let p = Probe::new(s[0]);
    {
        let table = b.index.shard_locks[p.shard(b.index.shard_mask)].lock();
        let added = table.add(&p, other, 1, &mut || packed::NO_ENTRY, &b.index.overflow, 0);
        assert!(matches!(added, Added::Done { .. }));
    }
    assert_eq!(b.look(&s), 1);
    // Two changes since the last lookup: read again.
    b.store(41, TierId::DEVICE, &s[..1]);
    b.store(42, TierId::DEVICE, &s[..1]);
    assert_eq!(b.look(&s), 0);
    assert_eq!(b.look(&s), 0);
    // Down to eight slots (six workers' in the device tier, worker 7's in the host tier,
    // worker 3's under the other tag), one change at a time; then to seven, which cannot
    // be kept.
    for k in [0, 1, 2, 5, 6, 8, 9] {
        b.remove(k, TierId::DEVICE, &s[..1]);
        assert_eq!(b.look(&s), 1, "after worker {k} left");
    }
    b.remove(10, TierId::DEVICE, &s[..1]);
    assert_eq!(b.look(&s), 0);
    assert_eq!(b.look(&s), 0);
}
