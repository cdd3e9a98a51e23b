//! Generated traffic: a prefix cache per rank fed by requests, emitting the events an engine
//! would (stores of new blocks, LRU evictions of unreferenced leaf-most blocks, clears).
//!
//! - [`CacheSim`]: one rank's prefix cache (block size, capacity in blocks, LRU over leaves).
//! - [`RandomSource`] / [`MooncakeSource`]: where requests come from (seeded random prompts
//!   over shared "system prompts", or the Mooncake traces' `hash_ids`).
//! - [`Rng`]: a small seeded PRNG (splitmix64), so runs are reproducible.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use crate::hashing::{
    sglang_event_hash, sglang_page_hash, vllm_event_hash, vllm_none_hash, vllm_sha256_cbor, Digest32,
};
use crate::wire::{BlockHash, Engine, EngineEvent, Removed, Stored, TokenIds};

/// splitmix64: small, seeded, good enough for traffic.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A request: the token ids of its prompt, one `Vec` per full block.
pub type RequestBlocks = Vec<Vec<u64>>;

#[derive(Debug, Clone)]
struct Node {
    parent: Option<u64>,
    children: u32,
    last_used: u64,
    /// The hash as published (int or digest), repeated in removals.
    wire: BlockHash,
}

/// One rank's prefix cache. Blocks are keyed by their event hash (normalised u64); a block is
/// evictable when it is a leaf (no cached child) and not part of the request being served.
#[derive(Debug, Clone)]
pub struct CacheSim {
    engine: Engine,
    pub block_size: u32,
    pub capacity: usize,
    nodes: HashMap<u64, Node>,
    /// Evictable candidates: leaves ordered by last use (LRU first).
    leaves: BTreeSet<(u64, u64)>,
    tick: u64,
    /// vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`: hashes published as raw digests.
    bytes_hashes: bool,
    /// Optional host tier that GPU evictions are offloaded to.
    host: Option<HostTier>,
    /// SGLang with EAGLE: radix keys are bigrams, pages hold `block_size` pairs.
    eagle: bool,
}

/// A host (CPU) tier: blocks evicted from the GPU are written here (vLLM's offloading
/// connector, medium `CPU`; SGLang HiCache, `CPU_PINNED`), LRU-evicted at its capacity.
#[derive(Debug, Clone)]
struct HostTier {
    capacity: usize,
    /// hash → (last use, wire hash)
    members: HashMap<u64, (u64, BlockHash)>,
    lru: BTreeSet<(u64, u64)>,
}

impl CacheSim {
    pub fn new(engine: Engine, block_size: u32, capacity: usize) -> Self {
        CacheSim {
            engine,
            block_size,
            capacity: capacity.max(1),
            nodes: HashMap::new(),
            leaves: BTreeSet::new(),
            tick: 0,
            bytes_hashes: false,
            host: None,
            eagle: false,
        }
    }

    /// SGLang EAGLE bigram pages (`token_ids` as `[a, b]` pairs, hashes over both elements).
    pub fn with_eagle(mut self, on: bool) -> Self {
        self.eagle = on && self.engine == Engine::Sglang;
        self
    }

    /// EAGLE: a request's tokens as full pages of bigrams, each page flattened
    /// `[a0, b0, a1, b1, ...]` (adjacent pages share the boundary token; a partial last page
    /// is not cached).
    fn bigram_pages(&self, blocks: &[Vec<u64>]) -> Vec<Vec<u64>> {
        let tokens: Vec<u64> = blocks.iter().flatten().copied().collect();
        let pairs: Vec<[u64; 2]> = tokens.windows(2).map(|w| [w[0], w[1]]).collect();
        pairs.chunks_exact(self.block_size as usize).map(|page| page.iter().flatten().copied().collect()).collect()
    }

    /// Publish raw digests instead of ints (vLLM only; SGLang always publishes ints).
    pub fn with_bytes_hashes(mut self, on: bool) -> Self {
        self.bytes_hashes = on && self.engine == Engine::Vllm;
        self
    }

    /// Offload GPU evictions to a host tier of `capacity` blocks (0: none).
    pub fn with_host_tier(mut self, capacity: usize) -> Self {
        self.host = (capacity > 0).then(|| HostTier { capacity, members: HashMap::new(), lru: BTreeSet::new() });
        self
    }

    /// The medium of the host tier on this engine's wire.
    pub fn host_medium(&self) -> &'static str {
        match self.engine {
            Engine::Vllm => "CPU",
            Engine::Sglang => "CPU_PINNED",
        }
    }

    /// Every block hash held by the host tier (normalised).
    pub fn host_hashes(&self) -> BTreeSet<u64> {
        self.host.as_ref().map(|h| h.members.keys().copied().collect()).unwrap_or_default()
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Fraction of the capacity in use.
    pub fn usage(&self) -> f64 {
        self.nodes.len() as f64 / self.capacity as f64
    }

    /// Every cached block hash (normalised).
    pub fn hashes(&self) -> BTreeSet<u64> {
        self.nodes.keys().copied().collect()
    }

    /// Drop everything (reset_prefix_cache, engine restart).
    pub fn clear(&mut self) {
        self.nodes.clear();
        self.leaves.clear();
        if let Some(h) = &mut self.host {
            h.members.clear();
            h.lru.clear();
        }
    }

    /// The chain of (wire hash, normalised hash) for a request's blocks.
    fn chain(&self, blocks: &[Vec<u64>]) -> Vec<(BlockHash, u64)> {
        let mut out = Vec::with_capacity(blocks.len());
        match self.engine {
            Engine::Vllm => {
                let mut prev: Digest32 = vllm_none_hash();
                for b in blocks {
                    prev = vllm_sha256_cbor(&prev, b);
                    let h = vllm_event_hash(&prev);
                    let wire = if self.bytes_hashes { BlockHash::Bytes(prev.to_vec()) } else { BlockHash::U64(h) };
                    out.push((wire, h));
                }
            }
            Engine::Sglang => {
                let mut prev: Option<Digest32> = None;
                for b in blocks {
                    let d = sglang_page_hash(prev.as_ref(), b);
                    let h = sglang_event_hash(&d);
                    out.push((BlockHash::I64(h), h as u64));
                    prev = Some(d);
                }
            }
        }
        out
    }

    fn touch(&mut self, h: u64) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(n) = self.nodes.get_mut(&h) {
            if n.children == 0 {
                self.leaves.remove(&(n.last_used, h));
                self.leaves.insert((tick, h));
            }
            n.last_used = tick;
        }
    }

    fn evict_one(&mut self, protected: &BTreeSet<u64>) -> Option<(u64, BlockHash)> {
        let victim = self.leaves.iter().find(|(_, h)| !protected.contains(h)).copied()?;
        self.leaves.remove(&victim);
        let (_, h) = victim;
        let node = self.nodes.remove(&h)?;
        if let Some(p) = node.parent {
            if let Some(pn) = self.nodes.get_mut(&p) {
                pn.children -= 1;
                if pn.children == 0 {
                    self.leaves.insert((pn.last_used, p));
                }
            }
        }
        Some((h, node.wire))
    }

    /// Write evicted GPU blocks to the host tier; returns (stored there, evicted from it).
    fn offload(&mut self, evicted: &[(u64, BlockHash)]) -> (Vec<BlockHash>, Vec<BlockHash>) {
        let Some(host) = &mut self.host else {
            return (vec![], vec![]);
        };
        let (mut stored, mut dropped) = (Vec::new(), Vec::new());
        for (h, wire) in evicted {
            self.tick += 1;
            if let Some((t, _)) = host.members.get(h).cloned() {
                host.lru.remove(&(t, *h));
                host.lru.insert((self.tick, *h));
                host.members.insert(*h, (self.tick, wire.clone()));
                continue;
            }
            while host.members.len() >= host.capacity {
                let Some(&(t, old)) = host.lru.iter().next() else { break };
                host.lru.remove(&(t, old));
                if let Some((_, w)) = host.members.remove(&old) {
                    dropped.push(w);
                }
            }
            host.members.insert(*h, (self.tick, wire.clone()));
            host.lru.insert((self.tick, *h));
            stored.push(wire.clone());
        }
        (stored, dropped)
    }

    /// How many of a request's leading blocks the cache holds.
    pub fn cached_prefix(&self, blocks: &[Vec<u64>]) -> usize {
        self.chain(blocks).iter().take_while(|(_, h)| self.nodes.contains_key(h)).count()
    }

    /// Serve one request: reuse its cached prefix, evict what is needed, store the rest.
    /// Returns the events of that scheduler step, in the engine's order (removals first).
    pub fn serve(&mut self, blocks: &[Vec<u64>]) -> Vec<EngineEvent> {
        let paged;
        let blocks = if self.eagle {
            paged = self.bigram_pages(blocks);
            &paged[..]
        } else {
            blocks
        };
        let chain = self.chain(blocks);
        let matched = chain.iter().take_while(|(_, h)| self.nodes.contains_key(h)).count();
        for (_, h) in &chain[..matched] {
            self.touch(*h);
        }
        let protected: BTreeSet<u64> = chain[..matched].iter().map(|(_, h)| *h).collect();
        let n_new = (chain.len() - matched).min(self.capacity.saturating_sub(matched));
        let mut evicted = Vec::new();
        while self.nodes.len() + n_new > self.capacity {
            match self.evict_one(&protected) {
                Some(h) => evicted.push(h),
                None => break,
            }
        }
        let n_new = n_new.min(self.capacity - self.nodes.len());
        let new = &chain[matched..matched + n_new];
        let mut parent = if matched > 0 { Some(chain[matched - 1].1) } else { None };
        for (w, h) in new {
            self.tick += 1;
            if let Some(p) = parent {
                if let Some(pn) = self.nodes.get_mut(&p) {
                    if pn.children == 0 {
                        self.leaves.remove(&(pn.last_used, p));
                    }
                    pn.children += 1;
                }
            }
            self.nodes.insert(*h, Node { parent, children: 0, last_used: self.tick, wire: w.clone() });
            self.leaves.insert((self.tick, *h));
            parent = Some(*h);
        }

        let (offloaded, host_dropped) = self.offload(&evicted);
        let mut events = Vec::new();
        let (medium, group, kind) = match self.engine {
            Engine::Vllm => (Some("GPU".to_string()), Some(0), Some("full_attention".to_string())),
            Engine::Sglang => (Some("GPU".to_string()), None, None),
        };
        let evicted: Vec<BlockHash> = evicted.into_iter().map(|(_, w)| w).collect();
        let host_medium = Some(self.host_medium().to_string());
        match self.engine {
            // vLLM: one BlockRemoved per evicted block.
            Engine::Vllm => {
                events.extend(evicted.iter().map(|w| {
                    EngineEvent::Removed(Removed {
                        hashes: vec![w.clone()],
                        medium: medium.clone(),
                        group_idx: group,
                        ..Default::default()
                    })
                }));
                events.extend(host_dropped.iter().map(|w| {
                    EngineEvent::Removed(Removed {
                        hashes: vec![w.clone()],
                        medium: host_medium.clone(),
                        ..Default::default()
                    })
                }));
            }
            // SGLang: consecutive removals merged into one event per tier.
            Engine::Sglang => {
                for (hashes, m) in [(evicted, &medium), (host_dropped, &host_medium)] {
                    if !hashes.is_empty() {
                        events.push(EngineEvent::Removed(Removed { hashes, medium: m.clone(), ..Default::default() }));
                    }
                }
            }
        }
        if !offloaded.is_empty() {
            // The offloading connector's placeholder store: no tokens, no parent.
            events.push(EngineEvent::Stored(Stored {
                hashes: offloaded,
                token_ids: TokenIds::Single(vec![]),
                block_size: self.block_size,
                medium: host_medium,
                ..Default::default()
            }));
        }
        if !new.is_empty() {
            let tokens: Vec<u64> = blocks[matched..matched + n_new].iter().flatten().copied().collect();
            events.push(EngineEvent::Stored(Stored {
                hashes: new.iter().map(|(w, _)| w.clone()).collect(),
                parent: if matched > 0 { Some(chain[matched - 1].0.clone()) } else { None },
                token_ids: if self.eagle {
                    TokenIds::Pairs(tokens.chunks_exact(2).map(|p| [p[0], p[1]]).collect())
                } else {
                    TokenIds::Single(tokens)
                },
                block_size: self.block_size,
                medium,
                group_idx: group,
                kind,
                extra_keys: match self.engine {
                    Engine::Vllm => Some(vec![rmpv::Value::Nil; n_new]),
                    Engine::Sglang => None,
                },
                ..Default::default()
            }));
        }
        events
    }
}

/// Where requests come from.
pub trait RequestSource: Send {
    /// The next request's blocks, or `None` when the source is exhausted.
    fn next_request(&mut self) -> Option<RequestBlocks>;
}

/// Seeded random prompts: a few shared "system prompts" (1–8 blocks) so prefixes are reused,
/// each request taking a prefix of one and adding 1–3 blocks of its own. Every request thus
/// stores at least one new block, so (while the cache has room beyond the prefix) every
/// request publishes exactly one batch.
pub struct RandomSource {
    rng: Rng,
    block_size: u32,
    prompts: Vec<RequestBlocks>,
}

impl RandomSource {
    pub fn new(seed: u64, block_size: u32, num_prompts: usize) -> Self {
        let mut rng = Rng::new(seed);
        let prompts = (0..num_prompts.max(1))
            .map(|_| {
                let n = 1 + rng.below(8) as usize;
                (0..n).map(|_| random_block(&mut rng, block_size)).collect()
            })
            .collect();
        RandomSource { rng, block_size, prompts }
    }
}

fn random_block(rng: &mut Rng, block_size: u32) -> Vec<u64> {
    (0..block_size).map(|_| 1 + rng.below(32_000)).collect()
}

impl RequestSource for RandomSource {
    fn next_request(&mut self) -> Option<RequestBlocks> {
        let p = &self.prompts[self.rng.below(self.prompts.len() as u64) as usize];
        let take = 1 + self.rng.below(p.len() as u64) as usize;
        let mut blocks: RequestBlocks = p[..take].to_vec();
        let own = 1 + self.rng.below(3);
        for _ in 0..own {
            blocks.push(random_block(&mut self.rng, self.block_size));
        }
        Some(blocks)
    }
}

/// The Mooncake traces: each `hash_ids` entry is one block of a chained prefix; its tokens
/// are derived from the id (deterministic), so equal ids give equal engine hashes.
pub struct MooncakeSource {
    requests: Vec<Vec<u64>>,
    next: usize,
    block_size: u32,
}

impl MooncakeSource {
    pub fn open(path: &Path, block_size: u32) -> std::io::Result<Self> {
        let text = std::fs::read_to_string(path)?;
        let mut requests = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(line).map_err(|e| {
                std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{}:{}: {e}", path.display(), i + 1))
            })?;
            let ids = v["hash_ids"]
                .as_array()
                .map(|a| a.iter().filter_map(serde_json::Value::as_u64).collect())
                .unwrap_or_default();
            requests.push(ids);
        }
        Ok(MooncakeSource { requests, next: 0, block_size })
    }

    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }
}

/// The tokens of Mooncake block `id`.
pub fn mooncake_block_tokens(id: u64, block_size: u32) -> Vec<u64> {
    (0..u64::from(block_size)).map(|i| 1 + mix(id.wrapping_mul(0x1000_0000_01B3) ^ i) % 32_000).collect()
}

impl RequestSource for MooncakeSource {
    fn next_request(&mut self) -> Option<RequestBlocks> {
        let ids = self.requests.get(self.next)?;
        self.next += 1;
        Some(ids.iter().map(|&id| mooncake_block_tokens(id, self.block_size)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hashes_of(ev: &EngineEvent) -> Vec<u64> {
        match ev {
            EngineEvent::Stored(s) => s.hashes.iter().map(BlockHash::as_u64).collect(),
            EngineEvent::Removed(r) => r.hashes.iter().map(BlockHash::as_u64).collect(),
            EngineEvent::Cleared => vec![],
        }
    }

    #[test]
    fn a_shared_prefix_is_stored_once_and_extended_with_its_parent() {
        let mut c = CacheSim::new(Engine::Vllm, 2, 10);
        let a = vec![vec![1, 2], vec![3, 4]];
        let ev = c.serve(&a);
        assert_eq!(ev.len(), 1);
        let mut b = a.clone();
        b.push(vec![5, 6]);
        let ev = c.serve(&b);
        let EngineEvent::Stored(s) = &ev[0] else { panic!("store expected") };
        assert_eq!(s.hashes.len(), 1);
        assert_eq!(s.parent.as_ref().map(BlockHash::as_u64), Some(c.chain(&a)[1].1));
        assert_eq!(c.len(), 3);
    }

    #[test]
    fn eagle_pages_are_bigrams_hashed_over_both_elements() {
        // Spec vector: bigram page (1,2)...(16,17) -> -7316793502406646264.
        let mut c = CacheSim::new(Engine::Sglang, 16, 10).with_eagle(true);
        let ev = c.serve(&[(1..=17).collect()]);
        let EngineEvent::Stored(s) = &ev[0] else { panic!("store expected") };
        assert_eq!(s.hashes, vec![BlockHash::I64(-7316793502406646264)]);
        let TokenIds::Pairs(p) = &s.token_ids else { panic!("pairs expected") };
        assert_eq!((p.len(), p[0], p[15]), (16, [1, 2], [16, 17]));
    }

    #[test]
    fn eviction_takes_the_least_recently_used_leaf() {
        let mut c = CacheSim::new(Engine::Sglang, 1, 3);
        c.serve(&[vec![1], vec![2]]); // root 1, leaf 2
        c.serve(&[vec![7]]); // leaf 7
        c.serve(&[vec![1], vec![2]]); // touch 1, 2
        let ev = c.serve(&[vec![9]]); // full: evicts LRU leaf = 7
        let removed: Vec<u64> =
            ev.iter().filter(|e| matches!(e, EngineEvent::Removed(_))).flat_map(hashes_of).collect();
        assert_eq!(removed, vec![c.chain(&[vec![7]])[0].1]);
        assert_eq!(c.len(), 3);
    }
}
