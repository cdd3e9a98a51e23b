//! The writers: stores, removals, clears and a worker's atomic replace.

use super::*;

/// How many blocks ahead of the block it works on a writer asks for a block's lines (see
/// [`Ahead`]). 4, 8, 12 and 16 gave the same rate in the 128-worker bench.
const AHEAD: usize = 8;

/// Blocks a replace writes under one taking of their holder's lock (a stripe: other holders'
/// writers wait for it meanwhile).
const HELD: usize = 1024;

thread_local! {
    /// This thread's removals that took a copy, to pace [`Grace::advance`] (any index).
    static REMOVALS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// The probes of a writer's blocks, in order, each block's first lines asked for [`AHEAD`]
/// blocks before it is yielded: the misses of the next blocks overlap the work on this one.
/// Plain loads could not do that: the shard lock a writer takes per block waits for every
/// load before it, so they overlapped only within a window, and each window paid a whole miss
/// (`prefetch.rs`).
struct Ahead<'a> {
    /// The tables the hints are for. A table rebuilt meanwhile only makes a hint useless.
    tables: arc_swap::Guard<Arc<Tables>>,
    mask: usize,
    hashes: &'a [u64],
    /// Block `i`'s probe is at `i % AHEAD` from the time its lines are asked for.
    ring: [Probe; AHEAD],
    next: usize,
}

impl<'a> Ahead<'a> {
    fn new(index: &PrefixIndex, hashes: &'a [u64]) -> Self {
        let mut ahead = Self {
            tables: index.tables.load(),
            mask: index.shard_mask,
            hashes,
            ring: [Probe::default(); AHEAD],
            next: 0,
        };
        for i in 0..hashes.len().min(AHEAD) {
            ahead.ask(i);
        }
        ahead
    }

    /// The table of `p`'s shard, of the set the hints are for.
    fn table(&self, p: &Probe) -> &Table {
        &self.tables[p.shard(self.mask)]
    }

    fn ask(&mut self, i: usize) {
        let p = Probe::new(self.hashes[i]);
        self.table(&p).prefetch_write(&p);
        self.ring[i % AHEAD] = p;
    }
}

impl Iterator for Ahead<'_> {
    type Item = Probe;

    fn next(&mut self) -> Option<Probe> {
        let i = self.next;
        if i == self.hashes.len() {
            return None;
        }
        let p = self.ring[i % AHEAD];
        if i + AHEAD < self.hashes.len() {
            self.ask(i + AHEAD);
        }
        self.next = i + 1;
        Some(p)
    }
}

impl PrefixIndex {
    /// Adds copies under the shard's lock, rebuilding the shard's table when it is full. A
    /// new slot gets the holder's next run entry. `cursor` is the holder's (caller holds its
    /// lock). Returns the slot's entry (`NO_ENTRY` if none).
    fn add(&self, p: &Probe, holder: u64, copies: u32, cursor: &mut Cursor) -> u32 {
        let s = p.shard(self.shard_mask);
        let mut table = self.shard_locks[s].0.lock();
        let mut entry = || self.runs.append(cursor, holder, p.hash, &self.grace);
        let ended = self.grace.periods_ended();
        let mut added = table.add(p, holder, copies, &mut entry, &self.overflow, ended);
        // A table full of dead slots frees those whose grace has passed in place, if that
        // gives it enough room. The grace periods are moved on first (a period is a start, a
        // flip and an end; none of it waits): a rebuild costs far more, and with little room
        // for dead slots (a small table, many removals) their tickets would not pass in time.
        if added == Added::Full && table.sweep_first() {
            self.move_periods_on(3);
            let ended = self.grace.periods_ended();
            if table.sweep(ended) >= table.sweep_enough() {
                self.sweeps.fetch_add(1, Ordering::Relaxed);
                added = table.add(p, holder, copies, &mut entry, &self.overflow, ended);
            }
        }
        let (saturated, entry) = match added {
            Added::Done { saturated, entry } => (saturated, entry),
            Added::Full => {
                // Live slots past 3/4: the table grows by half; else a sweep freed too few
                // of its dead slots, and it is rebuilt without them for its live slots.
                let bigger = if table.sweep_first() { table.rebuilt(1) } else { table.grown() };
                let Added::Done { saturated, entry } = bigger.add(p, holder, copies, &mut entry, &self.overflow, ended)
                else {
                    unreachable!("a table rebuilt with room for one more entry is not full");
                };
                self.publish(s, &mut table, bigger);
                (saturated, entry)
            }
        };
        if saturated {
            self.saturated_stores.fetch_add(1, Ordering::Relaxed);
        }
        entry
    }

    /// Makes room for new slots of `hashes` (a replace's staged blocks) in every shard before
    /// they are written: a shard's table that they would fill is rebuilt once, for its live
    /// slots and them (at least half as many again as it holds, as a table grows), instead of
    /// growing by half again and again while they are written (a resync of a million blocks
    /// into a new index rebuilt each of its 16 tables about 20 times).
    fn reserve(&self, hashes: impl Iterator<Item = u64>) {
        let mut extra = vec![0usize; self.shard_locks.len()];
        for h in hashes {
            extra[Probe::new(h).shard(self.shard_mask)] += 1;
        }
        for (s, &n) in extra.iter().enumerate() {
            let mut table = self.shard_locks[s].0.lock();
            if n > 0 && !table.has_room(n) {
                let bigger = table.rebuilt(n.max(table.live() / 2));
                self.publish(s, &mut table, bigger);
            }
        }
    }

    /// Kills the entries matching `drop` in every shard, compacting shards left sparse.
    fn remove_where(&self, drop: impl Fn(u64) -> bool) {
        for (s, shard_lock) in self.shard_locks.iter().enumerate() {
            let mut table = shard_lock.0.lock();
            if table.remove_where(&drop, &self.overflow, &self.grace) > 0 && table.wants_compaction() {
                let smaller = table.rebuilt(0);
                self.publish(s, &mut table, smaller);
            }
        }
        self.move_periods_on(1);
    }

    /// Adds one copy of each hash to `(worker, tier)`.
    pub fn store(&self, worker: WorkerId, tier: TierId, hashes: &[u64]) {
        self.store_after(worker, tier, None, hashes);
    }

    /// [`store`](Self::store) of a stored event whose blocks continue `parent` (the hash the
    /// engine stored them after): lookups then follow the worker's blocks from the parent's
    /// into these without a probe (module docs, Links). The parent only guides that layout:
    /// absent, wrong, not held, or held by other workers, the index holds and answers exactly
    /// what [`store`](Self::store) would.
    pub fn store_after(&self, worker: WorkerId, tier: TierId, parent: Option<u64>, hashes: &[u64]) {
        let _w = self.worker_lock(worker).read().unwrap_or_else(PoisonError::into_inner);
        let tag = self.gens.load(worker) & 1;
        let holder = packed::holder(worker.get(), tag, tier.get());
        let mut cursors = self.runs.lock(holder);
        let cursor = cursors.entry(holder).or_insert(Cursor::NEW);
        let blocks = Ahead::new(self, hashes);
        // The entry before the next block's: the parent's, then each block's. The parent's is
        // read without the shard's lock (its miss overlaps the blocks' hints): only this
        // holder's writers change its slots, and we hold its lock.
        let mut prev = parent
            .filter(|_| !hashes.is_empty())
            .map(Probe::new)
            .and_then(|pp| blocks.table(&pp).entry(&pp, holder))
            .unwrap_or(packed::NO_ENTRY);
        for p in blocks {
            let entry = self.add(&p, holder, 1, cursor);
            self.runs.join(prev, entry);
            prev = entry;
        }
    }

    /// Takes one copy of each hash from `(worker, tier)`. A hash with no copy is a no-op,
    /// counted in the outcome and in [`IndexStats::missing_removes`].
    pub fn remove(&self, worker: WorkerId, tier: TierId, hashes: &[u64]) -> RemoveOutcome {
        let _w = self.worker_lock(worker).read().unwrap_or_else(PoisonError::into_inner);
        let tag = self.gens.load(worker) & 1;
        let holder = packed::holder(worker.get(), tag, tier.get());
        let mut out = RemoveOutcome::default();
        let mut cursors = self.runs.lock(holder);
        // A holder without a cursor has no entries (none stored, or all dropped with it): a
        // fresh one stands in, so that a removal adds nothing to the map.
        let mut fresh = Cursor::NEW;
        let cursor = cursors.get_mut(&holder).unwrap_or(&mut fresh);
        for p in Ahead::new(self, hashes) {
            let subbed =
                self.shard_locks[p.shard(self.shard_mask)].0.lock().sub(&p, holder, &self.overflow, &self.grace);
            match subbed {
                Subbed::Taken => out.removed += 1,
                Subbed::Died { entry } => {
                    out.removed += 1;
                    if let Some((sparse, left)) = self.runs.invalidate(cursor, entry, &self.grace) {
                        if runs::compact_now(left, || self.pages_half_empty()) {
                            self.compact(cursor, holder, sparse);
                        }
                    }
                }
                Subbed::Missing => out.missing += 1,
            }
        }
        if out.missing > 0 {
            self.missing_removes.fetch_add(out.missing as u64, Ordering::Relaxed);
        }
        // Dead slots are reused once a grace period passes: move the periods on, every 16th
        // removal of this thread (each step reads every reader's slot line).
        if out.removed > 0 && REMOVALS.with(|n| n.replace(n.get().wrapping_add(1)) % 16 == 0) {
            self.move_periods_on(1);
        }
        out
    }

    /// True when the pages in use hold fewer live entries than half their room (live slots
    /// stand for their entries): then sparse pages are worth compacting.
    fn pages_half_empty(&self) -> bool {
        let live: usize = self.tables.load().iter().map(|t| t.live()).sum();
        live * 2 < self.runs.pages().0 * PAGE as usize
    }

    /// Moves the valid entries of `holder`'s sparse `page` to its current page (in order, so
    /// runs stay runs), so that the page is freed instead of holding a few live entries.
    /// `cursor` is the holder's (caller holds its lock). The moved entries keep their links,
    /// and entries that were adjacent stay joined (by a link where the current page ends
    /// between them); links of other pages into the moved entries go stale (lookups then
    /// probe).
    fn compact(&self, cursor: &mut Cursor, holder: u64, page: u32) {
        let entries = self.runs.valid_entries(page);
        let links: Vec<Option<u32>> = entries.iter().map(|&(old, _)| self.runs.link_of(old)).collect();
        let mut moved: Vec<(u32, u32)> = Vec::with_capacity(entries.len());
        for (old, hash) in entries {
            let p = Probe::new(hash);
            let table = self.shard_locks[p.shard(self.shard_mask)].0.lock();
            let entry = self.runs.append(cursor, holder, hash, &self.grace);
            // Both entries are valid while the slot moves: either proves the block is held.
            let ok = table.move_entry(&p, holder, old, entry);
            drop(table);
            let stale = if ok { old } else { entry };
            debug_assert!(ok, "a valid entry is its slot's entry");
            self.runs.invalidate(cursor, stale, &self.grace);
            // Entries adjacent in the old page stay joined.
            if let Some(&(_, prev)) = moved.last().filter(|&&(before, _)| old == before + 1) {
                self.runs.join(prev, entry);
            }
            moved.push((old, entry));
        }
        // Links out of the moved entries, to targets that moved too or not.
        for (&(_, entry), link) in moved.iter().zip(links) {
            if let Some(to) = link {
                let to = match moved.binary_search_by_key(&to, |&(old, _)| old) {
                    Ok(k) => moved[k].1,
                    Err(_) if to / PAGE == page => continue,
                    Err(_) => to,
                };
                self.runs.link(entry, to);
            }
        }
    }

    /// Drops all of a worker's blocks (`tier: None`, atomically, like an empty
    /// [`replace_worker`](Self::replace_worker)) or those of one tier (block by block: a
    /// concurrent lookup may see the tier partly cleared).
    pub fn clear(&self, worker: WorkerId, tier: Option<TierId>) {
        let Some(tier) = tier else {
            self.replace_worker(worker, &StagedSnapshot::new());
            return;
        };
        let _w = self.worker_lock(worker).read().unwrap_or_else(PoisonError::into_inner);
        let tag = self.gens.load(worker) & 1;
        let holder = packed::holder(worker.get(), tag, tier.get());
        let mut cursors = self.runs.lock(holder);
        self.remove_where(|v| v & packed::HOLDER == holder);
        self.runs.drop_pages(|h| h == holder, &self.grace);
        cursors.remove(&holder);
    }

    /// Drops every block of a worker, atomically. Its id stays interned.
    pub fn remove_worker(&self, worker: WorkerId) {
        self.replace_worker(worker, &StagedSnapshot::new());
    }

    /// Replaces a worker's whole state with `snapshot`, atomically: a concurrent lookup sees
    /// the worker's whole old state or its whole new state, never a mix.
    ///
    /// Cost: O(snapshot) to stage, one grace period (waits for in-flight lookups), and a scan
    /// of every shard to delete the old state.
    pub fn replace_worker(&self, worker: WorkerId, snapshot: &StagedSnapshot) {
        let _swap = lock(&self.swap);
        let _w = self.worker_lock(worker).write().unwrap_or_else(PoisonError::into_inner);
        let old_tag = self.gens.load(worker) & 1;
        let new_tag = old_tag ^ 1;
        // 1. Stage under the new tag: lookups ignore it until the flip. Each staged chain in
        // order, a block after its parent, so that the worker's blocks form runs as its
        // events would have (joined by links where they do not follow in a page).
        let entries = snapshot.entries();
        self.reserve(entries.iter().filter(|&&(_, _, copies)| copies > 0).map(|&(_, h, _)| h));
        let laid = snapshot.laid();
        // Each entry's run entry, by its position in `laid`.
        let mut written = vec![packed::NO_ENTRY; entries.len()];
        // The lock of the holder being written, kept while its blocks follow one another, up
        // to `HELD` blocks (it is a stripe, shared with other holders' writers).
        let mut held: Option<(u64, MutexGuard<'_, runs::Cursors>)> = None;
        let mut under_lock = 0;
        for (k, (&(tier, copies, parent), p)) in laid.blocks.iter().zip(Ahead::new(self, &laid.hashes)).enumerate() {
            if copies == 0 {
                continue;
            }
            let holder = packed::holder(worker.get(), new_tag, tier.get());
            if held.as_ref().is_none_or(|&(h, _)| h != holder) || under_lock == HELD {
                drop(held.take());
                held = Some((holder, self.runs.lock(holder)));
                under_lock = 0;
            }
            under_lock += 1;
            let (_, cursors) = held.as_mut().expect("the holder's lock was just taken");
            let entry = self.add(&p, holder, copies, cursors.entry(holder).or_insert(Cursor::NEW));
            if parent != snapshot::NONE {
                self.runs.join(written[parent as usize], entry);
            }
            written[k] = entry;
        }
        drop(held);
        // 2. Flip. Lookups that read `swap_seq` before this store keep the old tag.
        let seq = self.swap_seq.load(Ordering::SeqCst) + 1;
        self.gens.store(worker, (seq << 1) | new_tag);
        self.swap_seq.store(seq, Ordering::SeqCst);
        // 3. Wait for lookups that may still count the old tag.
        self.grace.synchronize();
        // 4. Delete the old state, and its runs (no lookup reads them any more).
        let old = ((worker.get() as u64) << 1) | old_tag;
        self.remove_where(|v| v >> 40 == old);
        self.runs.drop_pages(|h| h >> 40 == old, &self.grace);
        for tier in 0..64 {
            let holder = packed::holder(worker.get(), old_tag, tier);
            self.runs.lock(holder).remove(&holder);
        }
        self.replaces.fetch_add(1, Ordering::Relaxed);
    }
}
