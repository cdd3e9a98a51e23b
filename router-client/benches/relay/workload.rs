//! The workload: the Mooncake trace (looped with fresh ids each pass) through per-rank caches.

use super::*;

pub(crate) struct Workload {
    pub(crate) trace: Vec<Vec<u64>>,
    pub(crate) random: Option<RandomSource>,
    pub(crate) next: usize,
    pub(crate) pass: u64,
    pub(crate) sims: Vec<CacheSim>,
    pub(crate) turn: u32,
}

impl Workload {
    pub(crate) fn new(opts: &Opts) -> Workload {
        let trace = std::fs::read_to_string(&opts.trace)
            .ok()
            .map(|text| {
                text.lines()
                    .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                    .map(|v| {
                        v["hash_ids"]
                            .as_array()
                            .map(|a| a.iter().filter_map(|x| x.as_u64()).collect())
                            .unwrap_or_default()
                    })
                    .filter(|ids: &Vec<u64>| !ids.is_empty())
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        let random = trace.is_empty().then(|| RandomSource::new(7, BLOCK_SIZE, 64));
        let sims = (0..DP).map(|_| CacheSim::new(Engine::Vllm, BLOCK_SIZE, opts.cache_blocks)).collect();
        Workload { trace, random, next: 0, pass: 0, sims, turn: 0 }
    }

    pub(crate) fn source(&self) -> &'static str {
        if self.random.is_some() {
            "random prompts (no Mooncake trace found)"
        } else {
            "Mooncake conversation trace"
        }
    }

    pub(crate) fn request(&mut self) -> Vec<Vec<u64>> {
        if let Some(r) = &mut self.random {
            return r.next_request().unwrap_or_default();
        }
        if self.next == self.trace.len() {
            self.next = 0;
            self.pass += 1;
        }
        let ids = &self.trace[self.next];
        self.next += 1;
        let off = self.pass << 40;
        ids.iter().map(|&id| mooncake_block_tokens(id + off, BLOCK_SIZE)).collect()
    }

    /// The next batch: (rank, events, block operations).
    pub(crate) fn batch(&mut self) -> (u32, Vec<EngineEvent>, u64) {
        loop {
            let rank = self.turn % DP;
            self.turn += 1;
            let blocks = self.request();
            let events = self.sims[rank as usize].serve(&blocks);
            if !events.is_empty() {
                let ops = events.iter().map(block_ops).sum();
                return (rank, events, ops);
            }
        }
    }
}

pub(crate) fn block_ops(e: &EngineEvent) -> u64 {
    match e {
        EngineEvent::Stored(s) => s.hashes.len() as u64,
        EngineEvent::Removed(r) => r.hashes.len() as u64,
        EngineEvent::Cleared => 0,
    }
}

/// A publisher thread at an adjustable rate, fed by a generator thread (the Mooncake workload)
/// or by a [`Cycle`] of pre-encoded payloads.
pub(crate) struct Publisher {
    /// Offered batches per second (0: paused; infinite: as fast as it can).
    pub(crate) rate: Arc<Mutex<f64>>,
    pub(crate) published: Arc<AtomicU64>,
    pub(crate) ops: Arc<AtomicU64>,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) threads: Vec<std::thread::JoinHandle<()>>,
}

pub(crate) type Item = (u32, Vec<EngineEvent>, u64);

/// Where the publisher's batches come from.
pub(crate) enum Feed {
    /// Events from the generator thread, encoded (and applied to the engine's truth) per batch.
    Events(std::sync::mpsc::Receiver<Item>),
    /// Pre-encoded payloads, published without the truth.
    Cycle(Cycle),
}

impl Publisher {
    pub(crate) fn start(engine: Arc<MockEngine>, mut work: Workload) -> Publisher {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::sync_channel::<Item>(4096);
        let gen = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if tx.send(work.batch()).is_err() {
                        return;
                    }
                }
            })
        };
        let mut p = Publisher::pace(engine, Feed::Events(rx), stop);
        p.threads.push(gen);
        p
    }

    pub(crate) fn cycle(engine: Arc<MockEngine>, cycle: Cycle) -> Publisher {
        Publisher::pace(engine, Feed::Cycle(cycle), Arc::new(AtomicBool::new(false)))
    }

    pub(crate) fn pace(engine: Arc<MockEngine>, mut feed: Feed, stop: Arc<AtomicBool>) -> Publisher {
        let rate = Arc::new(Mutex::new(0.0f64));
        let published = Arc::new(AtomicU64::new(0));
        let ops = Arc::new(AtomicU64::new(0));
        let publ = {
            let (rate, published, ops, stop) = (rate.clone(), published.clone(), ops.clone(), stop.clone());
            std::thread::spawn(move || {
                let (mut cur, mut since, mut n) = (0.0f64, Instant::now(), 0u64);
                while !stop.load(Ordering::Relaxed) {
                    let r = *rate.lock().expect("rate");
                    if r != cur {
                        (cur, since, n) = (r, Instant::now(), 0);
                    }
                    if cur <= 0.0 {
                        std::thread::sleep(Duration::from_millis(2));
                        continue;
                    }
                    let due = since + Duration::from_secs_f64(n as f64 / cur);
                    let now = Instant::now();
                    if due > now {
                        std::thread::sleep((due - now).min(Duration::from_millis(5)));
                        continue;
                    }
                    let k = match &mut feed {
                        Feed::Events(rx) => {
                            let Ok((rank, events, k)) = rx.recv() else { return };
                            engine.publish(rank, events).expect("publish");
                            k
                        }
                        Feed::Cycle(c) => {
                            let (rank, payload, k) = c.next();
                            engine.publish_untracked(rank, payload).expect("publish");
                            k
                        }
                    };
                    n += 1;
                    published.fetch_add(1, Ordering::Relaxed);
                    ops.fetch_add(k, Ordering::Relaxed);
                }
            })
        };
        Publisher { rate, published, ops, stop, threads: vec![publ] }
    }

    pub(crate) fn set_rate(&self, r: f64) {
        *self.rate.lock().expect("rate") = r;
    }

    pub(crate) fn published(&self) -> u64 {
        self.published.load(Ordering::Relaxed)
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // The pacer first: the generator may be blocked on a full channel until the pacer's exit
        // drops the receiver.
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
