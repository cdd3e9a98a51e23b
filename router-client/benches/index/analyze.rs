//! `--analyze` and the resync part: the index alone, profiled, and a worker's replace timed.

use super::*;

/// A reading of this machine's cores, taken before each peer's part of a run: how long a fixed
/// ALU loop takes alone (`alone`, seconds, best of 3), and how much a second thread running it
/// beside slows it (`beside`, a ratio). This machine's two cores are virtual: the host may run
/// them on the two hardware threads of one physical core, or another tenant's work on the other
/// hardware thread of ours, for some runs and not others. A writer whose work is in cache then
/// slows by up to a third (the same binary, 7M against 11M block ops/s here), and the peers do
/// not all slow alike, so the runs where both parts read an undisturbed core are also compared
/// on their own.
#[derive(Clone, Copy)]
pub(crate) struct Cores {
    pub(crate) alone: f64,
    pub(crate) beside: f64,
}

impl Cores {
    pub(crate) fn read() -> Cores {
        // Eight independent chains: enough work in flight to keep a core's ALU ports busy, so
        // that a hardware thread beside it has to share them (one dependent chain would not
        // notice).
        fn spin(iters: u64) -> u64 {
            let mut x: [u64; 8] = std::array::from_fn(|i| 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i as u64 + 1));
            for _ in 0..iters {
                for v in &mut x {
                    *v ^= *v << 13;
                    *v ^= *v >> 7;
                    *v ^= *v << 17;
                }
            }
            black_box(x.iter().fold(0, |a, b| a ^ b))
        }
        let time = || {
            (0..3)
                .map(|_| {
                    let t0 = Instant::now();
                    spin(400_000);
                    t0.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min)
        };
        let alone = time();
        let stop = AtomicBool::new(false);
        let beside = std::thread::scope(|s| {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    spin(2_000);
                }
            });
            let t = time();
            stop.store(true, Ordering::Relaxed);
            t
        });
        Cores { alone, beside: beside / alone }
    }

    /// Undisturbed: within a tenth of the fastest reading of the run (`best`, seconds alone),
    /// and not sharing a physical core with the other thread.
    pub(crate) fn undisturbed(&self, best: f64) -> bool {
        best / self.alone >= 0.9 && self.beside < 1.25
    }
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// `--analyze`: the index alone, on one thread. The whole stream is applied `reps` times (each
/// into a new index, timed: the apply rate with no lookups), then the lookups run
/// `lookup_reps` times over the last index, with no writer beside them: latency percentiles
/// (each with the lookup's length, deepest match, workers matched and (worker, block) pairs
/// matched), mean latency by depth of the deepest match, and by how many workers matched past
/// block 0 (how many runs the lookup followed) with the share of them at or over the p99. For
/// profiling.
pub(crate) fn analyze(w: &Workload, reps: usize, lookup_reps: usize) {
    // The stream applied `reps` times, each into a new index (the last one is looked up).
    let mut rates = Vec::new();
    let mut index = PrefixIndex::new(IndexConfig::default());
    for rep in 0..reps {
        if rep > 0 {
            index = PrefixIndex::new(IndexConfig::default());
        }
        let t0 = Instant::now();
        for op in &w.ops {
            index.apply(op);
        }
        let secs = t0.elapsed().as_secs_f64();
        rates.push(w.block_ops as f64 / secs);
        println!(
            "  applied {} block ops in {secs:.3} s on one thread, no lookups: {:.0} ops/s",
            w.block_ops,
            w.block_ops as f64 / secs
        );
    }
    println!("  apply median of {reps}: {:.0} ops/s", median(rates));
    // (ns, request length, deepest match, workers, matched (worker, block) pairs, workers
    // matching more than block 0)
    let mut rows: Vec<(u64, usize, u32, usize, u64, usize)> = Vec::new();
    let mut r = LookupResult::default();
    for _ in 0..lookup_reps {
        for q in &w.lookups {
            let t0 = Instant::now();
            index.lookup_into(q, &mut r);
            let ns = t0.elapsed().as_nanos() as u64;
            let pairs: u64 = r.iter().map(|m| m.blocks as u64).sum();
            let depth = r.iter().map(|m| m.blocks).max().unwrap_or(0);
            let past_first = r.iter().filter(|m| m.blocks > 1).count();
            rows.push((ns, q.len(), depth, r.len(), pairs, past_first));
        }
    }
    rows.sort_unstable();
    let n = rows.len();
    let total: u64 = rows.iter().map(|r| r.0).sum();
    match n {
        0 => println!("  no lookups (--lookup-runs 0)"),
        _ => println!("  {n} lookups, mean {} ns", total / n as u64),
    }
    // The row at percentile `p` (rows are sorted by time).
    let at = |p: f64| rows[((n - 1) as f64 * p) as usize];
    for p in [0.5, 0.9, 0.99, 0.999].into_iter().filter(|_| n > 0) {
        let (ns, len, depth, workers, pairs, _) = at(p);
        println!("  p{p}: {ns} ns (length {len}, depth {depth}, {workers} workers, {pairs} matched pairs)");
    }
    let mut by_depth = std::collections::BTreeMap::new();
    for &(ns, _, depth, _, _, _) in &rows {
        let e = by_depth.entry(depth / 25 * 25).or_insert((0usize, 0u64));
        e.0 += 1;
        e.1 += ns;
    }
    for (d, (c, ns)) in by_depth {
        println!("  depth {d:>4}..{:<4} {c:>8} lookups, mean {} ns", d + 24, ns / c as u64);
    }
    // By how many workers' runs the lookup followed past block 0: how many lookups, their
    // mean, and how many of them are at or over the p99.
    if n > 0 {
        let p99 = at(0.99).0;
        let mut by_followed = std::collections::BTreeMap::new();
        for &(ns, _, _, _, _, past_first) in &rows {
            let e = by_followed.entry(past_first.min(3)).or_insert((0usize, 0u64, 0usize));
            e.0 += 1;
            e.1 += ns;
            e.2 += (ns >= p99) as usize;
        }
        for (k, (c, ns, slow)) in by_followed {
            let label = if k == 3 { "3 or more".to_string() } else { k.to_string() };
            println!(
                "  workers matching past block 0: {label:>9}: {c:>8} lookups, mean {} ns, {slow} at or over the p99 ({:.1}% of them)",
                ns / c as u64,
                100.0 * slow as f64 / c as f64
            );
        }
    }
    println!("  {:?}, {} B: {:?}", index.stats(), index.memory_bytes(), index.memory_breakdown().parts());
    if std::env::args().any(|a| a == "--hot") {
        hot(&index, w);
    }
    if std::env::args().any(|a| a == "--resync") {
        resync(w, lookup_reps);
    }
}

/// `--analyze --hot`: the CPU a lookup costs with everything in cache (one request looked up
/// 200,000 times in a row), for the first three lookup requests of each kind: every worker
/// matching only the first block (kept first-block candidates with no holder of block 1, the
/// path of most of the 8-worker bench's lookups), 3 to 24 blocks deep, and 25 or more. Three
/// rounds, to see the machine's spread.
pub(crate) fn hot(index: &PrefixIndex, w: &Workload) {
    pub(crate) const REPS: u32 = 200_000;
    let mut r = LookupResult::default();
    let mut picked: Vec<(&str, &[u64])> = Vec::new();
    for q in &w.lookups {
        index.lookup_into(q, &mut r);
        let depth = r.iter().map(|m| m.blocks).max().unwrap_or(0);
        let kind = match depth {
            1 if r.len() == w.workers as usize => "first block only",
            3..=24 => "3-24 blocks",
            25.. => "25+ blocks",
            _ => continue,
        };
        if picked.iter().filter(|(k, _)| *k == kind).count() < 3 {
            picked.push((kind, q));
        }
    }
    picked.sort_by_key(|(kind, _)| *kind);
    for round in 0..3 {
        let mut line = format!("  in cache, round {round}:");
        for (kind, q) in &picked {
            let t0 = Instant::now();
            for _ in 0..REPS {
                index.lookup_into(q, &mut r);
                black_box(&r);
            }
            let ns = t0.elapsed().as_nanos() as f64 / REPS as f64;
            line += &format!(" [{kind}, length {}] {ns:.0} ns", q.len());
        }
        println!("{line}");
    }
}

/// `--analyze --resync`: every worker's final state swapped into a new index by
/// `replace_worker`, as a router resynced from relays' snapshots would hold it (blocks in hash
/// order), once without the blocks' parents and once with them; then the same lookups over
/// both, alternating passes, in this process.
pub(crate) fn resync(w: &Workload, reps: usize) {
    let snapshots = |with_parents: bool| -> Vec<StagedSnapshot> {
        w.held
            .iter()
            .map(|held| {
                let mut snap = StagedSnapshot::new();
                for &h in held {
                    let parent = if with_parents { w.parents.get(&h).copied() } else { None };
                    snap.push_after(TierId::DEVICE, h, 1, parent);
                }
                snap
            })
            .collect()
    };
    let (without, with) = (snapshots(false), snapshots(true));
    let build = |with_parents: bool| {
        let index = PrefixIndex::new(IndexConfig::default());
        let t0 = Instant::now();
        for (k, snap) in if with_parents { &with } else { &without }.iter().enumerate() {
            index.replace_worker(wid(k as u32), snap);
        }
        (index, t0.elapsed())
    };
    let (_, t0) = build(false);
    let (_, t1) = build(true);
    println!("  resync warm-up: {t0:.2?} without parents, {t1:.2?} with");
    let (plain, t_plain) = build(false);
    let (laid, t_laid) = build(true);
    println!(
        "  resync: {} workers' snapshots replaced in {t_plain:.2?} without parents, {t_laid:.2?} with",
        w.held.len()
    );
    let mut lat: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
    let mut r = LookupResult::default();
    for _ in 0..reps {
        for (k, index) in [&plain, &laid].into_iter().enumerate() {
            for q in &w.lookups {
                let t0 = Instant::now();
                index.lookup_into(q, &mut r);
                lat[k].push(t0.elapsed().as_nanos() as u64);
            }
        }
    }
    for (k, name) in ["without parents", "with parents"].into_iter().enumerate() {
        let v = &mut lat[k];
        v.sort_unstable();
        let mean = v.iter().sum::<u64>() / v.len().max(1) as u64;
        println!(
            "  resynced index, {name}: {} lookups, mean {mean} ns, p50 {:?}, p99 {:?}",
            v.len(),
            pct(v, 0.5),
            pct(v, 0.99)
        );
    }
}
