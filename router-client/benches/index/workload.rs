//! The workload: the Mooncake trace turned into KV events of per-worker LRU caches.

use super::*;

/// One KV event of one worker.
#[derive(Clone, Debug)]
pub(crate) enum Op {
    Store {
        worker: u32,
        /// The block before the first stored one (Dynamo's trees link to it, and so do the
        /// index's runs).
        parent: Option<u64>,
        hashes: Vec<u64>,
    },
    Remove {
        worker: u32,
        hashes: Vec<u64>,
    },
}

impl Op {
    pub(crate) fn worker(&self) -> u32 {
        match self {
            Op::Store { worker, .. } | Op::Remove { worker, .. } => *worker,
        }
    }
}

/// The events of one simulated fleet, and what is indexed at the end.
pub(crate) struct Workload {
    pub(crate) workers: u32,
    pub(crate) requests: usize,
    pub(crate) ops: Vec<Op>,
    /// Block operations before each event (`ops[i]` is due at `due[i] / rate` when paced).
    pub(crate) due: Vec<u64>,
    pub(crate) block_ops: usize,
    pub(crate) stores: usize,
    pub(crate) hits: usize,
    pub(crate) lookups: Vec<Vec<u64>>,
    /// Live hashes held by at least one worker at the end.
    pub(crate) distinct: usize,
    /// Live (worker, hash) pairs at the end.
    pub(crate) pairs: usize,
    /// Each worker's blocks at the end, sorted by hash (as a store keyed by hash lists them).
    pub(crate) held: Vec<Vec<u64>>,
    /// The block each stored block was stored after.
    pub(crate) parents: HashMap<u64, u64>,
}

pub(crate) fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Reads the trace's `hash_ids`, or makes a synthetic trace of the same shape (every request
/// starts with a shared block; conversations grow turn by turn) when the file is absent.
pub(crate) fn read_trace(path: Option<&PathBuf>, max_blocks: usize) -> (String, Vec<Vec<u64>>) {
    if let Some(text) = path.and_then(|p| std::fs::read_to_string(p).ok()) {
        let mut out = Vec::new();
        let mut n = 0;
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let v: serde_json::Value = serde_json::from_str(line).expect("a Mooncake trace line is JSON");
            let ids: Vec<u64> =
                v["hash_ids"].as_array().map(|a| a.iter().filter_map(|x| x.as_u64()).collect()).unwrap_or_default();
            n += ids.len();
            out.push(ids);
            if max_blocks > 0 && n >= max_blocks {
                break;
            }
        }
        return (path.expect("read").display().to_string(), out);
    }
    let mut out: Vec<Vec<u64>> = Vec::new();
    let mut next_id = 1u64;
    let mut s = 7u64;
    let mut n = 0;
    while n < max_blocks.max(1) && out.len() < 12_000 {
        s = splitmix(s);
        let ids = if out.len() > 10 && s.is_multiple_of(3) {
            // A later turn of an earlier conversation: its prompt plus a few new blocks.
            let mut ids = out[out.len() - 1 - (s >> 8) as usize % 10.min(out.len())].clone();
            ids.extend((0..1 + (s >> 20) % 4).map(|_| {
                next_id += 1;
                next_id
            }));
            ids
        } else {
            std::iter::once(0)
                .chain((0..3 + (s >> 8) % 40).map(|_| {
                    next_id += 1;
                    next_id
                }))
                .collect()
        };
        n += ids.len();
        out.push(ids);
    }
    ("synthetic (trace file not found)".into(), out)
}

/// One worker's LRU cache of blocks.
#[derive(Default)]
pub(crate) struct Lru {
    /// hash -> (last use, depth)
    pub(crate) at: HashMap<u64, (u64, u32)>,
    /// (last use, deepest first, hash)
    pub(crate) order: BTreeSet<(u64, std::cmp::Reverse<u32>, u64)>,
}

impl Lru {
    pub(crate) fn touch(&mut self, hash: u64, now: u64, depth: u32) -> bool {
        let hit = match self.at.insert(hash, (now, depth)) {
            Some((t, d)) => {
                self.order.remove(&(t, std::cmp::Reverse(d), hash));
                true
            }
            None => false,
        };
        self.order.insert((now, std::cmp::Reverse(depth), hash));
        hit
    }
    pub(crate) fn evict(&mut self) -> u64 {
        let (_, _, h) = self.order.pop_first().expect("evict from a non-empty cache");
        self.at.remove(&h);
        h
    }
}

/// How requests are placed on workers (`--placement`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Placement {
    /// The lowest cost: blocks to prefill plus running load (Dynamo's default).
    Cost,
    /// A hash of the request's blocks: no affinity.
    Uniform,
}

impl Placement {
    pub(crate) fn parse(name: &str) -> Placement {
        match name.trim() {
            "cost" => Placement::Cost,
            "uniform" => Placement::Uniform,
            other => panic!("--placement takes cost or uniform, not {other:?}"),
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Placement::Cost => "cost",
            Placement::Uniform => "uniform",
        }
    }
}

pub(crate) fn simulate(
    trace: &[Vec<u64>],
    placement: Placement,
    workers: u32,
    copies: u32,
    capacity: usize,
    max_blocks: usize,
    lookups: usize,
) -> Workload {
    assert!((1..=128).contains(&workers), "the simulation tracks holders in a u128");
    let hash = |copy: u32, id: u64| splitmix(id ^ ((copy as u64) << 44) ^ 0x5eed);
    let mut caches: Vec<Lru> = (0..workers).map(|_| Lru::default()).collect();
    let mut holders: HashMap<u64, u128> = HashMap::new();
    let mut recent: VecDeque<(u32, usize)> = VecDeque::new();
    let mut active = vec![0usize; workers as usize];
    let mut w = Workload {
        workers,
        requests: 0,
        ops: Vec::new(),
        due: Vec::new(),
        block_ops: 0,
        stores: 0,
        hits: 0,
        lookups: Vec::new(),
        distinct: 0,
        pairs: 0,
        held: Vec::new(),
        parents: HashMap::new(),
    };
    let mut matched = vec![0usize; workers as usize];
    let all: u128 = if workers == 128 { u128::MAX } else { (1u128 << workers) - 1 };
    'outer: for ids in trace {
        for copy in 0..copies {
            let blocks: Vec<u64> = ids.iter().take(capacity).map(|&id| hash(copy, id)).collect();
            let now = w.requests as u64;
            // Route: each worker's cached prefix, from the holder bitmaps (for the cost).
            matched.iter_mut().for_each(|m| *m = 0);
            let mut mask = if placement == Placement::Cost { all } else { 0 };
            for h in &blocks {
                mask &= holders.get(h).copied().unwrap_or(0);
                if mask == 0 {
                    break;
                }
                let mut m = mask;
                while m != 0 {
                    matched[m.trailing_zeros() as usize] += 1;
                    m &= m - 1;
                }
            }
            let chosen = match placement {
                Placement::Cost => {
                    let start = (now % workers as u64) as usize;
                    let cost = |k: usize| blocks.len() - matched[k] + active[k];
                    let chosen = (0..workers as usize).map(|j| (start + j) % workers as usize).min_by_key(|&k| cost(k));
                    chosen.expect("at least one worker")
                }
                Placement::Uniform => {
                    (blocks.iter().fold(0x0c0f_fee5, |a, &h| splitmix(a ^ h)) % workers as u64) as usize
                }
            };
            recent.push_back((chosen as u32, blocks.len()));
            active[chosen] += blocks.len();
            if recent.len() > 2 * workers as usize {
                let (k, n) = recent.pop_front().expect("non-empty");
                active[k as usize] -= n;
            }
            // Serve: touch every block; the missing suffix is stored.
            let cache = &mut caches[chosen];
            let bit = 1u128 << chosen;
            let mut first_missing = blocks.len();
            for (d, &h) in blocks.iter().enumerate() {
                if cache.touch(h, now, d as u32) {
                    w.hits += 1;
                    debug_assert!(first_missing == blocks.len(), "caches stay prefix-closed");
                } else {
                    first_missing = first_missing.min(d);
                    *holders.entry(h).or_insert(0) |= bit;
                }
            }
            if first_missing < blocks.len() {
                let stored = blocks[first_missing..].to_vec();
                let parent = first_missing.checked_sub(1).map(|i| blocks[i]);
                for d in first_missing.max(1)..blocks.len() {
                    w.parents.insert(blocks[d], blocks[d - 1]);
                }
                w.due.push(w.block_ops as u64);
                w.stores += stored.len();
                w.block_ops += stored.len();
                w.ops.push(Op::Store { worker: chosen as u32, parent, hashes: stored });
            }
            let mut evicted = Vec::new();
            while cache.at.len() > capacity {
                let h = cache.evict();
                let e = holders.get_mut(&h).expect("a cached block has holders");
                *e &= !bit;
                if *e == 0 {
                    holders.remove(&h);
                }
                evicted.push(h);
            }
            if !evicted.is_empty() {
                w.due.push(w.block_ops as u64);
                w.block_ops += evicted.len();
                w.ops.push(Op::Remove { worker: chosen as u32, hashes: evicted });
            }
            w.requests += 1;
            if max_blocks > 0 && w.stores >= max_blocks {
                break 'outer;
            }
        }
    }
    w.distinct = holders.len();
    w.pairs = caches.iter().map(|c| c.at.len()).sum();
    w.held = caches
        .iter()
        .map(|c| {
            let mut v: Vec<u64> = c.at.keys().copied().collect();
            v.sort_unstable();
            v
        })
        .collect();
    // Lookups: trace requests (any copy), spread over the trace.
    let served = (w.requests / copies as usize).max(1);
    w.lookups = (0..lookups as u64)
        .map(|i| {
            let r = splitmix(i ^ 0x100c) as usize % served.min(trace.len());
            let copy = (splitmix(i ^ 0xc0b1) % copies as u64) as u32;
            trace[r].iter().take(capacity).map(|&id| hash(copy, id)).collect()
        })
        .collect();
    w
}
