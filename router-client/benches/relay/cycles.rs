//! Pre-encoded cycles: the engine side that offers millions of block operations a second.

use super::*;

/// The batch shapes of the ingest goals' rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    /// A prefill-heavy vLLM step (0.32 wire): one `BlockStored` of 64-128 blocks of 16 token ids
    /// (chained in the event, no parent) and one `BlockRemoved` of as many hashes.
    Prefill,
    /// SGLang with page size 1 (latest wire): 128 one-block `BlockStored` of one token each, each
    /// the child of the one before, and 128 one-block `BlockRemoved`.
    Page1,
}

impl Shape {
    pub(crate) const ALL: [Shape; 2] = [Shape::Prefill, Shape::Page1];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Shape::Prefill => "vLLM prefill (1 store of 64-128 blocks + 1 removal of as many)",
            Shape::Page1 => "SGLang page size 1 (128 one-block stores + 128 one-block removals)",
        }
    }

    /// The name in the table.
    pub(crate) fn short(self) -> &'static str {
        match self {
            Shape::Prefill => "vLLM prefill, 64-128-block store + removal a batch",
            Shape::Page1 => "SGLang page size 1, 128 + 128 one-block events a batch",
        }
    }

    /// Its name for `KV_RELAY_BENCH_SHAPE`.
    pub(crate) fn key(self) -> &'static str {
        match self {
            Shape::Prefill => "prefill",
            Shape::Page1 => "page1",
        }
    }

    pub(crate) fn wire(self) -> WireVersion {
        match self {
            Shape::Prefill => WireVersion::parse(Engine::Vllm, "0.32").expect("wire"),
            Shape::Page1 => WireVersion::latest(Engine::Sglang),
        }
    }

    /// Blocks stored by batch `i` of the cycle.
    pub(crate) fn stores(self, i: usize) -> usize {
        match self {
            Shape::Prefill => 64 + (i * 29) % 65,
            Shape::Page1 => 128,
        }
    }
}

/// Batches in one pass of a cycle per rank (L), and how many batches later a batch's blocks are
/// removed (D): about 6,200 live blocks a rank for the prefill shape, 8,192 for page size 1.
pub(crate) fn cycle_geometry(opts: &Opts) -> (usize, usize) {
    if opts.quick {
        (32, 8)
    } else {
        (256, 64)
    }
}

/// A vLLM store of a fresh prefix (no parent) of `BLOCK_SIZE`-token blocks on the GPU.
pub(crate) fn vllm_prefix(hashes: Vec<BlockHash>, tokens: Vec<u64>) -> EngineEvent {
    EngineEvent::Stored(Stored {
        hashes,
        parent: None,
        token_ids: TokenIds::Single(tokens),
        block_size: BLOCK_SIZE,
        medium: Some("GPU".into()),
        group_idx: Some(0),
        kind: Some("full_attention".into()),
        ..Default::default()
    })
}

pub(crate) fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A state-consistent loop of pre-encoded batches per rank, encoded once with the test kit's wire
/// encoder: batch i of a pass stores `shape.stores(i)` fresh hashes and removes (tail first) the
/// hashes batch i - D stored (mod L), so the live set stays about K*D blocks a rank and every
/// removal hits a live block. The first pass's first D batches are store-only variants (nothing
/// to remove yet); SGLang's first batch carries `AllBlocksCleared` in front, as the engine's does.
/// Each send copies the payload and writes the current time into its `ts` (a float64 at bytes
/// 2..10); the seq frame is the rank publisher's, which also keeps the batch for replay.
pub(crate) struct Cycle {
    pub(crate) ranks: u32,
    pub(crate) shape: Shape,
    pub(crate) lag: usize,
    pub(crate) len: usize,
    /// Per rank: the first pass's first D batches, then the L batches of every pass; (payload,
    /// block operations).
    pub(crate) prelude: Vec<Vec<(Vec<u8>, u64)>>,
    pub(crate) pass: Vec<Vec<(Vec<u8>, u64)>>,
    pub(crate) sent: Vec<usize>,
    pub(crate) turn: u32,
}

impl Cycle {
    pub(crate) fn new(shape: Shape, ranks: u32, (len, lag): (usize, usize)) -> Cycle {
        assert!(lag < len, "a batch's blocks are removed within the pass");
        let wire = shape.wire();
        let hash = |rank: u32, i: usize, j: usize| splitmix64((u64::from(rank) << 48) ^ ((i as u64) << 16) ^ j as u64);
        let block_hash = |h: u64| match shape {
            Shape::Prefill => BlockHash::U64(h),
            Shape::Page1 => BlockHash::I64(h as i64),
        };
        let (mut prelude, mut pass) = (Vec::new(), Vec::new());
        for rank in 0..ranks {
            let (mut pre, mut cyc) = (Vec::new(), Vec::new());
            for i in 0..len {
                let stored: Vec<u64> = (0..shape.stores(i)).map(|j| hash(rank, i, j)).collect();
                let gone = (i + len - lag) % len;
                // Leaves first, as the engines evict: the chain's tail to its head.
                let removed: Vec<u64> = (0..shape.stores(gone)).rev().map(|j| hash(rank, gone, j)).collect();
                let (stores, removals) = match shape {
                    Shape::Prefill => {
                        let tokens = stored
                            .iter()
                            .flat_map(|&h| (0..u64::from(BLOCK_SIZE)).map(move |t| 1 + splitmix64(h ^ t) % 32_000))
                            .collect();
                        let store = vllm_prefix(stored.iter().map(|&h| block_hash(h)).collect(), tokens);
                        let removal = EngineEvent::Removed(Removed {
                            hashes: removed.iter().map(|&h| block_hash(h)).collect(),
                            medium: Some("GPU".into()),
                            group_idx: Some(0),
                            ..Default::default()
                        });
                        (vec![store], vec![removal])
                    }
                    Shape::Page1 => {
                        let stores = stored
                            .iter()
                            .enumerate()
                            .map(|(j, &h)| {
                                EngineEvent::Stored(Stored {
                                    hashes: vec![block_hash(h)],
                                    parent: j.checked_sub(1).map(|p| block_hash(stored[p])),
                                    token_ids: TokenIds::Single(vec![1 + splitmix64(h) % 32_000]),
                                    block_size: 1,
                                    medium: Some("GPU".into()),
                                    ..Default::default()
                                })
                            })
                            .collect();
                        let removals = removed
                            .iter()
                            .map(|&h| {
                                EngineEvent::Removed(Removed {
                                    hashes: vec![block_hash(h)],
                                    medium: Some("GPU".into()),
                                    ..Default::default()
                                })
                            })
                            .collect();
                        (stores, removals)
                    }
                };
                let clear = (i == 0 && wire.clears_on_start()).then_some(EngineEvent::Cleared);
                let encode = |events: Vec<EngineEvent>| {
                    let p = encode_batch(&wire, &Batch { ts: 0.0, events, dp_rank: Some(rank) });
                    assert_eq!(p[1], 0xcb, "a batch starts with its ts as a float64");
                    p
                };
                if i < lag {
                    let events: Vec<EngineEvent> = clear.into_iter().chain(stores.iter().cloned()).collect();
                    pre.push((encode(events), stored.len() as u64));
                }
                let events: Vec<EngineEvent> = removals.into_iter().chain(stores).collect();
                cyc.push((encode(events), (stored.len() + removed.len()) as u64));
            }
            prelude.push(pre);
            pass.push(cyc);
        }
        Cycle { ranks, shape, lag, len, prelude, pass, sent: vec![0; ranks as usize], turn: 0 }
    }

    /// Live blocks on every rank once the prelude is out.
    pub(crate) fn live_blocks(&self) -> u64 {
        let per_rank: usize = (self.len - self.lag..self.len).map(|i| self.shape.stores(i)).sum();
        per_rank as u64 * u64::from(self.ranks)
    }

    pub(crate) fn ops_per_batch(&self) -> f64 {
        let (n, ops) = self.pass.iter().flatten().fold((0u64, 0u64), |(n, o), (_, k)| (n + 1, o + k));
        ops as f64 / n as f64
    }

    pub(crate) fn bytes_per_batch(&self) -> f64 {
        let (n, b) = self.pass.iter().flatten().fold((0usize, 0usize), |(n, b), (p, _)| (n + 1, b + p.len()));
        b as f64 / n as f64
    }

    /// The next batch: (rank, payload stamped with the current time, block operations).
    pub(crate) fn next(&mut self) -> (u32, Vec<u8>, u64) {
        let rank = self.turn % self.ranks;
        self.turn = self.turn.wrapping_add(1);
        let n = self.sent[rank as usize];
        self.sent[rank as usize] += 1;
        let (p, ops) =
            if n < self.lag { &self.prelude[rank as usize][n] } else { &self.pass[rank as usize][n % self.len] };
        let mut out = p.clone();
        out[2..10].copy_from_slice(&wall().to_be_bytes());
        (rank, out, *ops)
    }
}
