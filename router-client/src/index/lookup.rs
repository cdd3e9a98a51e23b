//! The lookup engine: a request's leading blocks, per worker and tier, read without locks.

use super::*;

#[derive(Clone, Copy)]
struct Candidate {
    worker: u32,
    /// The tag this lookup counts for the worker.
    tag: u64,
    /// Tiers whose leading run is still going; once `done`, the tiers whose run ended at
    /// `blocks` (so that ending a candidate writes nothing else).
    alive: u64,
    /// Tiers holding block `seen_at` (stale, so 0, when `seen_at` is another block).
    seen: u64,
    seen_at: u32,
    /// Leading blocks in any tier, once the run ended.
    blocks: u32,
    done: bool,
    /// Runs of tiers that ended before the candidate did: the head of a list in
    /// `Scratch::runs` (`NO_RUN` if none).
    ended: u32,
}

impl Candidate {
    /// A worker holding block 0 in `tiers` under `tag`, before any later block.
    fn new(worker: u32, tag: u64, tiers: u64) -> Self {
        Candidate { worker, tag, alive: tiers, seen: 0, seen_at: 0, blocks: 0, done: false, ended: NO_RUN }
    }
}

/// Not a candidate (see `Memo::by_worker`).
const NO_CANDIDATE: u32 = u32::MAX;

/// The end of a candidate's list of ended runs.
const NO_RUN: u32 = u32::MAX;

#[derive(Default)]
pub(super) struct Scratch {
    /// Holders of the blocks of the current window; block `k`'s end at `ends[k]`.
    holders: Vec<u64>,
    ends: [usize; WINDOW],
    /// Block `k` of the current window by its crowd record, when it has one and its holders
    /// were not listed (`PrefixIndex::gather`).
    crowds: [Option<Crowd>; WINDOW],
    candidates: Vec<Candidate>,
    /// Indexes of the candidates whose run goes on (a block costs O(its holders + these),
    /// not O(all candidates): after a popular first block most candidates drop out at once).
    alive: Vec<u32>,
    /// For every alive (candidate, tier): the entry of its slot of the last block matched.
    pairs: Vec<u32>,
    /// Alive candidates with no alive tier (their run goes on in tiers that did not hold
    /// block 0): only a probe tells whether they hold the next block.
    orphans: usize,
    /// The last block probed ended no run: the pairs left are likely to go on together.
    settled: bool,
    /// `(tier, run, next)`: per candidate, a list of the tier runs that ended before it did.
    runs: Vec<(u8, u32, u32)>,
    /// Scratch for sorting block 0's holders by worker.
    sorted: Vec<u64>,
    buckets: Vec<u32>,
    /// One candidate's tier runs, while `emit` sorts them.
    tier_runs: Vec<TierRun>,
    /// Block 0's candidates of crowded keys, as this thread last computed them.
    memo: HashMap<u64, Memo, BuildHasherDefault<WordHasher>>,
    /// The lookup started from kept candidates: the result already lists every candidate as
    /// ending at block 1, and `candidates` are only those that may go on.
    patch: bool,
    /// Kept candidates brought up to date by a key's last change instead of read again
    /// (`PrefixIndex::catch_up`), in this thread.
    pub(super) caught_up: u64,
}

/// Block 0's candidates as a lookup computed them (before any later block), valid while the
/// key's table, the key's version and the swap sequence are the same: a crowded key's version
/// rises before and after any change of its holders, a rebuilt table has a new id, and the
/// tags a lookup counts depend only on the swap sequence it read. Not the pairs' entries:
/// those move (a page's compaction), and a lookup with kept candidates takes them from block
/// 1's probe.
#[derive(Default)]
struct Memo {
    at: (u64, u64, u64),
    /// Live slots of the key (every worker, tag and tier): at least [`MEMO_HOLDERS`].
    slots: usize,
    candidates: Vec<Candidate>,
    /// By worker id: the worker's index in `candidates` (`NO_CANDIDATE` if none); empty when
    /// the ids are sparse (then a binary search of `candidates` finds them). A lookup finds
    /// each holder of block 1 among block 0's candidates: with hundreds of candidates, binary
    /// searches were a fifth of a deep lookup's instructions.
    by_worker: Vec<u32>,
    /// The result if every candidate's match ends at block 1: a lookup copies it, then writes
    /// over the few candidates that go on (each tier that holds block 0 has a run of at least
    /// 1, so their entries keep their size).
    result: LookupResult,
}

impl Memo {
    fn is(&self, table: u64, version: u64, seq: u64) -> bool {
        self.at == (table, version, seq)
    }

    /// Builds `by_worker` and `result` from `candidates`.
    fn index(&mut self) {
        self.by_worker.clear();
        // Only when the workers' ids are dense enough to cost at most 16 bytes per candidate
        // (ids are interned in order, so the holders of a popular block usually are).
        let top = self.candidates.last().map_or(0, |c| c.worker as usize + 1);
        if top <= 4 * self.candidates.len() {
            self.by_worker.resize(top, NO_CANDIDATE);
            for (k, c) in self.candidates.iter().enumerate() {
                self.by_worker[c.worker as usize] = k as u32;
            }
        }
        self.result.clear();
        for c in &self.candidates {
            let worker = WorkerId::new(c.worker).expect("packed worker ids are valid");
            self.result.push(worker, 1, tier_runs(c.alive, 1));
        }
    }

    /// Applies one change of the key's slots (`holder`'s slot born or dead) to the candidates,
    /// `visible` giving the tag the lookups of this memo count for a worker. False if the
    /// candidates cannot be kept: fewer than [`MEMO_HOLDERS`] slots would be left, or the
    /// change does not fit them (never, while the versions are right).
    fn apply(&mut self, holder: u64, born: bool, visible: impl FnOnce(u32) -> u64) -> bool {
        self.slots = if born { self.slots + 1 } else { self.slots.saturating_sub(1) };
        if self.slots < MEMO_HOLDERS {
            return false;
        }
        let (worker, tag, bit) = (packed::worker_of(holder), packed::tag_of(holder), 1u64 << packed::tier_of(holder));
        match self.candidates.binary_search_by_key(&worker, |c| c.worker) {
            Ok(k) => {
                let c = &mut self.candidates[k];
                if c.tag != tag {
                    return true;
                }
                if (c.alive & bit != 0) == born {
                    return false;
                }
                c.alive ^= bit;
                if c.alive == 0 {
                    self.candidates.remove(k);
                }
            }
            Err(k) => {
                if visible(worker) != tag {
                    return true;
                }
                if !born {
                    return false;
                }
                self.candidates.insert(k, Candidate::new(worker, tag, bit));
            }
        }
        self.index();
        true
    }
}

impl Scratch {
    /// Keeps block 0's candidates (just computed, from holders read between two reads of
    /// `at`'s version that gave the same even value) for `hash`.
    fn remember(&mut self, hash: u64, at: (u64, u64, u64)) {
        if self.memo.len() >= MEMO_KEYS && !self.memo.contains_key(&hash) {
            self.memo.clear();
        }
        let m = self.memo.entry(hash).or_default();
        m.at = at;
        m.slots = self.ends[0];
        m.candidates.clear();
        m.candidates.extend_from_slice(&self.candidates);
        m.index();
    }
}

/// Holders of block 0 from which a lookup keeps its candidates for the next lookups of the
/// same first block. At least eight: a key with more holders than its home group's seven
/// slots has one outside it, so every change of it raises its version.
const MEMO_HOLDERS: usize = 8;

/// First blocks whose candidates a thread keeps (all dropped when a new one would exceed it).
const MEMO_KEYS: usize = 64;

/// Blocks whose first cache lines a lookup asks for before using any (see `Table::prefetch`).
const WINDOW: usize = 8;

/// Most alive (candidate, tier) pairs a lookup follows through their runs; with more, it
/// probes (one probe serves every holder of a block).
const FOLLOW: usize = 8;

thread_local! {
    pub(super) static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Sorts packed values by worker id, keeping the order of equal ones. Block 0 of a popular
/// prefix has a holder per worker (hundreds), and a comparison sort of them cost a third of
/// such a lookup; an LSD radix sort over the bits the largest worker id needs is one pass of
/// at most 1,024 buckets for up to 1,024 workers.
fn sort_by_worker(v: &mut [u64], tmp: &mut Vec<u64>, buckets: &mut Vec<u32>) {
    const DIGIT: u32 = 10;
    if v.len() <= 32 {
        v.sort_by_key(|&x| packed::worker_of(x));
        return;
    }
    let max = v.iter().map(|&x| packed::worker_of(x)).max().unwrap_or(0);
    let bits = u32::BITS - max.leading_zeros();
    tmp.clear();
    tmp.resize(v.len(), 0);
    let mut shift = 0;
    let mut in_tmp = false;
    while shift < bits {
        let width = (bits - shift).min(DIGIT);
        let digit = |x: u64| ((packed::worker_of(x) >> shift) & ((1 << width) - 1)) as usize;
        let (src, dst): (&[u64], &mut [u64]) = if in_tmp { (tmp, v) } else { (v, tmp) };
        buckets.clear();
        buckets.resize(1 << width, 0);
        for &x in src.iter() {
            buckets[digit(x)] += 1;
        }
        let mut at = 0;
        for b in buckets.iter_mut() {
            let n = *b;
            *b = at;
            at += n;
        }
        for &x in src.iter() {
            let b = &mut buckets[digit(x)];
            dst[*b as usize] = x;
            *b += 1;
        }
        in_tmp = !in_tmp;
        shift += width;
    }
    if in_tmp {
        v.copy_from_slice(tmp);
    }
}

/// One run of `blocks` for each tier whose bit `tiers` sets, in tier order.
fn tier_runs(mut tiers: u64, blocks: u32) -> impl Iterator<Item = TierRun> {
    std::iter::from_fn(move || {
        let t = (tiers != 0).then(|| tiers.trailing_zeros() as u8)?;
        tiers &= tiers - 1;
        Some(TierRun { tier: TierId::new(t).expect("packed tier ids are valid"), blocks })
    })
}

impl PrefixIndex {
    /// Asks for the first lines of several probes, so that their cache misses overlap.
    fn prefetch(tables: &Tables, mask: usize, probes: &[Probe]) {
        for p in probes {
            tables[p.shard(mask)].prefetch(p);
        }
    }

    /// Probes for up to [`WINDOW`] hashes (the rest of the array is not meant to be used).
    fn probes(hashes: &[u64]) -> [Probe; WINDOW] {
        let mut probes = [Probe::default(); WINDOW];
        for (p, &h) in probes.iter_mut().zip(hashes) {
            *p = Probe::new(h);
        }
        probes
    }

    /// For every worker holding `hashes[0]`: leading blocks held in any tier, and per tier.
    /// Never blocks on writers.
    pub fn lookup(&self, hashes: &[u64]) -> LookupResult {
        let mut out = LookupResult::default();
        self.lookup_into(hashes, &mut out);
        out
    }

    /// [`lookup`](Self::lookup) into a reused result.
    pub fn lookup_into(&self, hashes: &[u64], out: &mut LookupResult) {
        out.clear();
        if hashes.is_empty() {
            return;
        }
        let reading = self.grace.read();
        // Read before any slot: decides which side of each concurrent replace this lookup is on.
        let seq0 = self.swap_seq.load(Ordering::SeqCst);
        let tables = self.section_tables(&reading);
        SCRATCH.with(|s| {
            let s = &mut *s.borrow_mut();
            s.candidates.clear();
            s.runs.clear();
            s.alive.clear();
            s.pairs.clear();
            s.orphans = 0;
            s.settled = false;
            // Block 0 decides the candidates: from this thread's memo when its holders are many
            // and unchanged, else from the table. Block 1 is probed with it (their misses
            // overlap): unless one pair holds block 0, block 1 is where most candidates drop out.
            let n = hashes.len();
            // The first lines asked for: block 1's home group (every lookup of more than one
            // block probes it), then the request's lines, so that the probe's misses do not
            // queue behind those of a long request.
            if n > 1 {
                Self::prefetch(tables, self.shard_mask, &[Probe::new(hashes[1])]);
            }
            Self::prefetch_request(hashes);
            let first = Probe::new(hashes[0]);
            let table = &tables[first.shard(self.shard_mask)];
            // Read before block 0's holders, and again after (see `table`'s docs, Versions of
            // crowded keys).
            let version = table.version(&first);
            let Scratch { memo, patch, caught_up, .. } = &mut *s;
            let kept = match memo.get_mut(&hashes[0]) {
                Some(m) if m.is(table.id(), version, seq0) => true,
                Some(m) => {
                    let up = self.catch_up(m, table, &first, version, seq0);
                    *caught_up += up as u64;
                    up
                }
                None => false,
            };
            *patch = kept;
            let block1 = if kept {
                // Every candidate ends at block 1 but those holding block 1 (probed now: it
                // also gives the pairs' entries); only those are walked. `holders` is block 1's
                // holders (none for a request of one block).
                self.gather(tables, &hashes[1..n.min(2)], true, s);
                let Scratch { memo, holders, candidates, .. } = &mut *s;
                let m = &memo[&hashes[0]];
                out.clone_from(&m.result);
                for &v in holders.iter() {
                    let worker = packed::worker_of(v);
                    let k = if m.by_worker.is_empty() {
                        m.candidates.binary_search_by_key(&worker, |c| c.worker).ok()
                    } else {
                        m.by_worker.get(worker as usize).filter(|&&k| k != NO_CANDIDATE).map(|&k| k as usize)
                    };
                    if let Some(k) = k {
                        candidates.push(m.candidates[k]);
                    }
                }
                candidates.sort_unstable_by_key(|c| c.worker);
                candidates.dedup_by_key(|c| c.worker);
                0..holders.len()
            } else {
                self.gather(tables, &hashes[..n.min(2)], true, s);
                self.first_block(seq0, s);
                // Kept only if no change of the key was under way or came while its holders
                // were read: the version was even and is still the same.
                if s.ends[0] >= MEMO_HOLDERS && version.is_multiple_of(2) && table.version(&first) == version {
                    s.remember(hashes[0], (table.id(), version, seq0));
                }
                s.ends[0]..s.ends[1]
            };
            if s.candidates.is_empty() {
                return;
            }
            s.alive.extend(0..s.candidates.len() as u32);
            let mut i = 1;
            if n > 1 && (s.patch || s.pairs.len() > 1) {
                if !Self::step(1, block1, s) {
                    Self::emit(n as u32, s, out);
                    return;
                }
                i = 2;
            }
            while i < n {
                let pairs = s.pairs.len();
                if s.orphans == 0 && (pairs == 1 || (s.settled && pairs <= FOLLOW)) {
                    // Few holders left, and going on together: follow their runs while every
                    // one goes on, then probe the block where one stops (or its page ends).
                    i += self.follow(&hashes[i..], &mut s.pairs);
                    if i == n {
                        break;
                    }
                    self.gather(tables, &hashes[i..=i], false, s);
                    if !Self::step_at(i, 0, 0..s.ends[0], s) {
                        Self::emit(n as u32, s, out);
                        return;
                    }
                    i += 1;
                    continue;
                }
                // Many holders: probe windows of WINDOW blocks whose cache misses overlap; one
                // block while they are dropping out (block 1 after a popular block 0), as
                // the next block may end them all.
                let window = &hashes[i..n.min(i + if s.settled { WINDOW } else { 1 })];
                self.gather(tables, window, false, s);
                let mut from = 0;
                for k in 0..window.len() {
                    let to = s.ends[k];
                    if !Self::step_at(i + k, k, from..to, s) {
                        Self::emit(n as u32, s, out);
                        return;
                    }
                    from = to;
                }
                i += window.len();
            }
            Self::emit(n as u32, s, out);
        });
    }

    /// Brings kept candidates `m` of `p`'s key up to `version` (even, just read) when one
    /// crowded change of the key's counter came since they were kept: that change, read from
    /// the counter, is applied to them instead of reading the key's slots again (a crowded
    /// first block changes holders often, and reading a hundred holders cost ten times a
    /// lookup that kept them). Exact for the same reason kept candidates are (`table.rs`,
    /// Versions of crowded keys): with at least [`MEMO_HOLDERS`] slots after the change, one is
    /// outside the home group, so the next change raises the version too. False if they cannot
    /// be brought up (then the lookup reads the slots).
    fn catch_up(&self, m: &mut Memo, table: &Table, p: &Probe, version: u64, seq0: u64) -> bool {
        if version < 2 || !version.is_multiple_of(2) || m.at != (table.id(), version - 2, seq0) {
            return false;
        }
        let Some(change) = table.last_change(p, version) else {
            return false;
        };
        if change.hash == p.hash && !m.apply(change.holder, change.born, |worker| self.visible_tag(worker, seq0)) {
            // Not kept: the next lookup reads the slots, and keeps them anew if it can.
            m.at = (table.id(), u64::MAX, seq0);
            return false;
        }
        m.at.1 = version;
        true
    }

    /// Asks for the cache lines of a request's hashes (past the first, which the lookup reads
    /// at once), so that when they are not in cache their misses overlap, instead of coming
    /// one after another as the lookup reaches them: a router may look up hashes it computed a
    /// while before.
    fn prefetch_request(hashes: &[u64]) {
        let mut i = 8;
        while i < hashes.len() {
            prefetch(&hashes[i]);
            i += 8;
        }
        prefetch(&hashes[hashes.len() - 1]);
    }

    /// Follows every alive (candidate, tier) through its holder's runs: the number of blocks
    /// of `hashes` that every one of them holds by its runs alone (each pair's entry moves to
    /// its last one). 0 when one of them cannot go on that way. A pair goes on in its page
    /// while the next entries are valid and equal the next hashes, and where they are not, at
    /// its entry's link if the link's target checks out (module docs, Links).
    fn follow(&self, hashes: &[u64], pairs: &mut [u32]) -> usize {
        if pairs.len() > 1 {
            // Ask for every page's first line before comparing any: their misses overlap.
            for &entry in pairs.iter() {
                if let Some(p) = self.runs.page(entry) {
                    p.prefetch(entry % PAGE + 1);
                }
            }
        }
        debug_assert!(pairs.len() <= FOLLOW);
        // Per pair: 0 while its page is one a live slot named (the grace period keeps it the
        // holder's during this lookup), else the stamp its page had when the pair linked to it.
        let mut stamps = [0u64; FOLLOW];
        let mut bases = [0u32; FOLLOW];
        let mut done = 0;
        while done < hashes.len() {
            let mut m = hashes.len() - done;
            for (k, &entry) in pairs.iter().enumerate() {
                let (base, n) = self.next_of(entry, &mut stamps[k], &hashes[done..done + m]);
                if n == 0 {
                    return done;
                }
                (bases[k], m) = (base, n);
            }
            for (entry, base) in pairs.iter_mut().zip(bases) {
                *entry = base.wrapping_add(m as u32);
            }
            done += m;
        }
        done
    }

    /// How many of `hashes` a pair whose last matched block is at `entry` holds next by its
    /// runs, and the entry just before the first of them (`entry`, or a link's target minus
    /// one). `stamp` is the pair's page stamp (see [`follow`](Self::follow)), updated on a link.
    #[inline]
    fn next_of(&self, entry: u32, stamp: &mut u64, hashes: &[u64]) -> (u32, usize) {
        let Some(page) = self.runs.page(entry) else {
            return (entry, 0);
        };
        let checked = *stamp != 0;
        if checked && page.stamp() != *stamp {
            return (entry, 0);
        }
        let n = page.matching(entry % PAGE + 1, hashes);
        if checked && !page.still(*stamp) {
            return (entry, 0);
        }
        if n > 0 {
            return (entry, n);
        }
        let Some(to) = page.link(entry % PAGE) else {
            return (entry, 0);
        };
        // The pair's holder: its page's owner (a page a live slot named is the holder's or,
        // once all its entries died, free).
        let owner = if checked { *stamp } else { page.stamp() };
        let (Some(holder), Some(target)) = (runs::owner(owner), self.runs.page(to)) else {
            return (entry, 0);
        };
        let at = target.stamp();
        if !runs::owned_by(at, holder) {
            return (entry, 0);
        }
        let n = target.matching(to % PAGE, hashes);
        if n == 0 || !target.still(at) {
            return (entry, 0);
        }
        *stamp = at;
        (to.wrapping_sub(1), n)
    }

    /// The tag a lookup that started at `seq0` counts for `worker`.
    pub(super) fn visible_tag(&self, worker: u32, seq0: u64) -> u64 {
        let Some(w) = WorkerId::new(worker) else {
            return 0;
        };
        let word = self.gens.load(w);
        // A flip stamped after the lookup started has not happened for it; the old state
        // stays intact until the lookup ends (grace period).
        if word >> 1 > seq0 {
            (word & 1) ^ 1
        } else {
            word & 1
        }
    }

    /// Collects the holders of each block of `window` (at most [`WINDOW`]) into `holders`,
    /// block `k`'s ending at `ends[k]`. A block with a crowd record is read from it (one line
    /// instead of its slots): its holders are listed when `list` (the first two blocks, whose
    /// holders make the candidates), else it is left in `crowds[k]` for [`Self::step_at`].
    fn gather(&self, tables: &Tables, window: &[u64], list: bool, s: &mut Scratch) {
        let Scratch { holders, ends, crowds, .. } = s;
        let probes = Self::probes(window);
        let probes = &probes[..window.len()];
        // Even for one probe: its control word and slots are separate lines, loaded together.
        Self::prefetch(tables, self.shard_mask, probes);
        holders.clear();
        for (k, p) in probes.iter().enumerate() {
            crowds[k] = tables[p.shard(self.shard_mask)].holders(p, |v| holders.push(v));
            if list {
                if let Some(c) = crowds[k].take() {
                    c.for_each(|v| holders.push(v));
                }
            }
            ends[k] = holders.len();
        }
    }

    /// Candidates: workers holding block 0 (`s.holders[..s.ends[0]]`) under their visible tag,
    /// by worker, and the entries of their (worker, tier) pairs.
    fn first_block(&self, seq0: u64, s: &mut Scratch) {
        let first = &mut s.holders[..s.ends[0]];
        sort_by_worker(first, &mut s.sorted, &mut s.buckets);
        let mut i = 0;
        while i < first.len() {
            let worker = packed::worker_of(first[i]);
            let tag = self.visible_tag(worker, seq0);
            let mut tiers = 0u64;
            while i < first.len() && packed::worker_of(first[i]) == worker {
                if packed::tag_of(first[i]) == tag {
                    tiers |= 1 << packed::tier_of(first[i]);
                    s.pairs.push(packed::entry_of(first[i]));
                }
                i += 1;
            }
            if tiers != 0 {
                s.candidates.push(Candidate::new(worker, tag, tiers));
            }
        }
    }

    /// Applies block `i`, the `k`-th of the window [`gather`](Self::gather) read, to the
    /// candidates still alive: by its crowd record if it left one, else by its holders
    /// `s.holders[holders]`. False once no candidate goes on.
    fn step_at(i: usize, k: usize, holders: std::ops::Range<usize>, s: &mut Scratch) -> bool {
        match s.crowds[k] {
            Some(c) => Self::step_crowd(i, &c, s),
            None => Self::step(i, holders, s),
        }
    }

    /// [`step`](Self::step) for a block read from its crowd record: each alive candidate's bit
    /// is tested (the cost of the candidates left, whatever the block's holders). The pairs
    /// that go on have no entry (a record has none), so the next block is probed.
    fn step_crowd(i: usize, c: &Crowd, s: &mut Scratch) -> bool {
        let Scratch { candidates, alive, pairs, .. } = &mut *s;
        let at = i as u32;
        pairs.clear();
        let bit = 1 << c.tier;
        for &k in alive.iter() {
            let cand = &mut candidates[k as usize];
            if cand.worker < crowd::WIDE && c.workers[cand.tag as usize] >> cand.worker & 1 != 0 {
                cand.seen_at = at;
                cand.seen = bit;
                if cand.alive & bit != 0 {
                    pairs.push(packed::NO_ENTRY);
                }
            }
        }
        Self::settle(at, s)
    }

    /// Applies block `i`'s holders (`s.holders[holders]`) to the candidates still alive (dropping those whose run
    /// ended) and notes the entries of the (candidate, tier) pairs that go on; false once no
    /// candidate goes on.
    fn step(i: usize, holders: std::ops::Range<usize>, s: &mut Scratch) -> bool {
        let Scratch { holders: all, candidates, pairs, .. } = &mut *s;
        let holders = &all[holders];
        let at = i as u32;
        pairs.clear();
        for &v in holders {
            let worker = packed::worker_of(v);
            let found = if candidates.len() <= 8 {
                candidates.iter().position(|c| c.worker == worker)
            } else {
                candidates.binary_search_by_key(&worker, |c| c.worker).ok()
            };
            if let Some(c) = found.map(|k| &mut candidates[k]) {
                if !c.done && packed::tag_of(v) == c.tag {
                    let bit = 1 << packed::tier_of(v);
                    if c.seen_at != at {
                        c.seen_at = at;
                        c.seen = 0;
                    }
                    c.seen |= bit;
                    if c.alive & bit != 0 {
                        pairs.push(packed::entry_of(v));
                    }
                }
            }
        }
        Self::settle(i as u32, s)
    }

    /// Ends the alive candidates that did not hold block `at` (their `seen` says which tiers
    /// did), and the tier runs of those that hold it in fewer tiers; false once none is left.
    fn settle(at: u32, s: &mut Scratch) -> bool {
        let Scratch { candidates, alive, runs, orphans, settled, .. } = s;
        *orphans = 0;
        let ended = runs.len();
        let before = alive.len();
        alive.retain(|&k| {
            let c = &mut candidates[k as usize];
            let seen = if c.seen_at == at { c.seen } else { 0 };
            if seen == 0 {
                // Every tier still going ends here: `alive` keeps them, `blocks` says where.
                c.done = true;
                c.blocks = at;
                return false;
            }
            let mut gone = c.alive & !seen;
            while gone != 0 {
                runs.push((gone.trailing_zeros() as u8, at, c.ended));
                c.ended = runs.len() as u32 - 1;
                gone &= gone - 1;
            }
            c.alive &= seen;
            *orphans += (c.alive == 0) as usize;
            true
        });
        *settled = runs.len() == ended && alive.len() == before;
        !alive.is_empty()
    }

    /// Writes the candidates' matches into `out`: appended, or, when `out` already lists every
    /// candidate of kept first-block candidates (`s.patch`), over their entries there.
    fn emit(len: u32, s: &mut Scratch, out: &mut LookupResult) {
        let Scratch { candidates, runs, tier_runs: mine, patch, .. } = s;
        #[inline]
        fn put(
            out: &mut LookupResult,
            patch: bool,
            worker: WorkerId,
            blocks: u32,
            runs: impl Iterator<Item = TierRun>,
        ) {
            if patch {
                out.patch(worker, blocks, runs);
            } else {
                out.push(worker, blocks, runs);
            }
        }
        for c in candidates.iter() {
            let blocks = if c.done { c.blocks } else { len };
            let worker = WorkerId::new(c.worker).expect("packed worker ids are valid");
            if c.ended == NO_RUN {
                // The common case: no tier ended before the candidate did.
                put(out, *patch, worker, blocks, tier_runs(c.alive, blocks));
                continue;
            }
            mine.clear();
            mine.extend(tier_runs(c.alive, blocks));
            let mut r = c.ended;
            while r != NO_RUN {
                let (t, run, next) = runs[r as usize];
                mine.push(TierRun { tier: TierId::new(t).expect("packed tier ids are valid"), blocks: run });
                r = next;
            }
            mine.sort_unstable_by_key(|run| run.tier);
            put(out, *patch, worker, blocks, mine.iter().copied());
        }
    }
}
