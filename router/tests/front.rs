//! The OpenAI-compatible front against mock engines behind in-process relays: a request is
//! passed to the chosen engine and its answer back byte for byte, the DP rank rides in the
//! header vLLM reads, the prefix decides where a repeated prompt goes (and the engine's cached
//! tokens equal what the router predicted), each end is reported, and a worker that refuses
//! the connection leaves routing while the request goes to the next choice.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_relay_proto::hash::{EngineHashConfig, VllmHashAlgo};
use kv_relay_testkit::client::start_engine_on_free_ports;
use kv_relay_testkit::daemon::{start_relay, Daemon};
use kv_relay_testkit::engine::{EngineConfig, MockEngine};
use kv_relay_testkit::face::{Fault, COMPLETION_TOKENS};
use kv_relay_testkit::metrics::{http_get, http_post};
use kv_relay_testkit::wire::{Engine, WireVersion};
use kv_router::front::FrontConfig;
use kv_router::{http, Router, RouterConfig};
use kv_router_client::{FollowConfig, Follower, WorkerState};

const BLOCK: u32 = 4;

fn engine() -> Arc<MockEngine> {
    let mut cfg = EngineConfig::new(WireVersion::parse(Engine::Vllm, "0.32").unwrap());
    cfg.topic = "kv".into();
    cfg.block_size = BLOCK;
    cfg.cache_blocks = 256;
    cfg.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let e = Arc::new(start_engine_on_free_ports(cfg, true));
    e.serve_completions();
    e
}

struct Fleet {
    engines: Vec<Arc<MockEngine>>,
    relays: Vec<Daemon>,
    router: Arc<Router>,
    addr: std::net::SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
}

async fn fleet(n: usize, relay_args: &[&str]) -> Fleet {
    let engines: Vec<_> = (0..n).map(|_| engine()).collect();
    let mut relays = Vec::new();
    for e in &engines {
        relays.push(start_relay(e, relay_args).await);
    }
    let follower = Follower::new(FollowConfig { start_jitter: Duration::ZERO, ..FollowConfig::default() });
    for r in &relays {
        follower.add_relay(&r.url).unwrap();
    }
    let router = Arc::new(Router::new(follower, RouterConfig::default()));
    let hash = EngineHashConfig::vllm("0.32".parse().unwrap(), VllmHashAlgo::Sha256Cbor, None, BLOCK as usize).unwrap();
    let front = FrontConfig { hash: Some(hash), ..FrontConfig::default() };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(http::serve_with(listener, router.clone(), front, async {
        let _ = stopped.await;
    }));
    // Every worker routable, with its engine's URL.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let w = router.workers();
        let ready = |w: &kv_router::RoutedWorker| {
            w.routing.routing == "routable" && w.worker.state == WorkerState::Fresh && w.worker.engine_url.is_some()
        };
        if w.len() == n && w.iter().all(ready) {
            break;
        }
        assert!(Instant::now() < deadline, "workers never routable: {w:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Fleet { engines, relays, router, addr, stop }
}

impl Fleet {
    async fn stop(self) {
        let _ = self.stop.send(());
        for r in self.relays {
            r.stop().await;
        }
    }

    /// The engine whose URL a worker reports.
    fn engine_of(&self, url: &str) -> usize {
        self.engines.iter().position(|e| e.url().as_deref() == Some(url)).expect("a known engine")
    }
}

/// `POST path` on the front, off the runtime's threads.
async fn post(addr: std::net::SocketAddr, path: &'static str, body: String) -> (u16, String) {
    tokio::task::spawn_blocking(move || http_post(addr, path, &[], &body).unwrap()).await.unwrap()
}

fn usage(body: &str) -> serde_json::Value {
    serde_json::from_str::<serde_json::Value>(body).unwrap_or_else(|e| panic!("{e}: {body}"))["usage"].clone()
}

/// Waits until every routed request's end has been reported.
async fn reported(router: &Router, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    let ended = |c: kv_router::RouterCounters| c.tracker.done + c.tracker.failures + c.tracker.connect_failures;
    while ended(router.counters()) < n {
        assert!(Instant::now() < deadline, "{:?}", router.counters());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_goes_where_its_prefix_is_and_the_engine_caches_what_was_predicted() {
    let f = fleet(2, &[]).await;
    let prompt: Vec<u64> = (1..=34).collect();
    let body = serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 4}).to_string();
    let (status, first) = post(f.addr, "/v1/completions", body.clone()).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(usage(&first)["prompt_tokens_details"]["cached_tokens"], 0);
    reported(&f.router, 1).await;
    // The engine that served it holds the prompt's 8 full blocks; wait until the router does.
    let holder = (0..2).find(|&i| f.engines[i].face().unwrap().counters()[0].prompt_tokens == 34).unwrap();
    let hashes = kv_relay_proto::hash::block_event_hashes(
        &EngineHashConfig::vllm("0.32".parse().unwrap(), VllmHashAlgo::Sha256Cbor, None, BLOCK as usize).unwrap(),
        &kv_relay_proto::hash::RequestKeys { token_ids: &prompt, ..Default::default() },
    )
    .unwrap();
    assert_eq!(hashes.len(), 8);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = f.router.follower().matches(&hashes, Default::default());
        if m.iter().any(|w| w.matched_blocks == 8) {
            break;
        }
        assert!(Instant::now() < deadline, "the router never saw the blocks");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Again, streamed: the same engine, all 8 blocks cached, as the router predicted.
    let routed = f.router.route(&hashes).unwrap();
    assert_eq!((f.engine_of(routed.engine_url.as_deref().unwrap()), routed.matched_blocks), (holder, 8));
    f.router.report(routed.request_id, kv_router::Outcome::Done, Default::default()).unwrap();
    let stream = serde_json::json!({"model": "m", "prompt": prompt, "stream": true}).to_string();
    let (status, sse) = post(f.addr, "/v1/completions", stream).await;
    assert_eq!(status, 200);
    let data: Vec<&str> = sse.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{sse}");
    let last: serde_json::Value = serde_json::from_str(data[data.len() - 2]).unwrap();
    assert_eq!(last["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
    assert_eq!(f.engines[holder].face().unwrap().counters()[0].prompt_tokens, 68);
    reported(&f.router, 3).await;
    let c = f.router.counters();
    assert_eq!((c.tracker.done, c.tracker.failures, c.tracker.connect_failures), (3, 0, 0));
    // The tokens of the front's two requests (the direct route reported none).
    assert_eq!((c.prompt_tokens, c.completion_tokens), (68, 2 * COMPLETION_TOKENS));
    assert_eq!(f.router.in_flight(), 0);

    // The engine's errors pass through as they are.
    let (status, body) = post(f.addr, "/v1/completions", "{\"model\": \"m\"}".into()).await;
    assert_eq!((status, body.contains("no prompt or messages")), (400, true), "{body}");
    // /v1/models is an engine's.
    let (status, models) = tokio::task::spawn_blocking({
        let a = f.addr;
        move || http_get(a, "/v1/models").unwrap()
    })
    .await
    .unwrap();
    assert_eq!(status, 200);
    assert_eq!(serde_json::from_str::<serde_json::Value>(&models).unwrap()["data"][0]["id"], "mock-model");
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_goes_to_the_next_choice_and_takes_the_worker_out() {
    // The relays do not probe the engines' health: the refused connection alone takes the
    // worker out (a relay would see the engine stopped within a second, racing the request).
    let f = fleet(2, &["--engine-health-url", "off"]).await;
    // Engine 0 holds the prompt's 2 blocks, so the router chooses it first.
    let prompt: Vec<u64> = (500..508).collect();
    f.engines[0].complete(0, &prompt).unwrap();
    let hashes = kv_relay_proto::hash::block_event_hashes(
        &EngineHashConfig::vllm("0.32".parse().unwrap(), VllmHashAlgo::Sha256Cbor, None, BLOCK as usize).unwrap(),
        &kv_relay_proto::hash::RequestKeys { token_ids: &prompt, ..Default::default() },
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = f.router.follower().matches(&hashes, Default::default());
        let holder = m.iter().find(|w| w.matched_blocks == 2);
        if let Some(w) = holder {
            assert_eq!(f.engine_of(w.engine_url.map(|u| &**u).unwrap()), 0);
            break;
        }
        assert!(Instant::now() < deadline, "the router never saw engine 0's blocks");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Engine 0 stops listening: the request is refused there and served by engine 1.
    f.engines[0].face().unwrap().set_fault(Fault::ListenerGone).unwrap();
    let (status, text) = post(f.addr, "/v1/completions", serde_json::json!({"prompt": prompt}).to_string()).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(usage(&text)["prompt_tokens_details"]["cached_tokens"], 0);
    // One connection refused, before the request was retried on engine 1; engine 0 is out.
    reported(&f.router, 2).await;
    let c = f.router.counters().tracker;
    assert_eq!((c.done, c.connect_failures, c.failures), (1, 1, 0), "{c:?}");
    let w0 =
        f.router.workers().into_iter().find(|w| f.engine_of(w.worker.engine_url.as_deref().unwrap()) == 0).unwrap();
    assert_ne!(w0.routing.routing, "routable", "{w0:?}");
    // While it is out (a probe that finds it still refusing is retried too), engine 1 serves.
    for i in 1..6u64 {
        let body = serde_json::json!({"prompt": [i, i + 1, i + 2, i + 3, i + 4]}).to_string();
        let (status, text) = post(f.addr, "/v1/completions", body).await;
        assert_eq!(status, 200, "{text}");
    }
    let served: Vec<u64> = f.engines.iter().map(|e| e.face().unwrap().counters()[0].prompt_tokens).collect();
    assert_eq!(served, [0, 8 + 5 * 5]);
    assert_eq!(f.router.counters().tracker.done, 6);
    // Listening again: back in routing (one probe re-admits it).
    f.engines[0].face().unwrap().set_fault(Fault::None).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut i = 100u64;
    while f.engines[0].face().unwrap().counters()[0].prompt_tokens == 0 {
        assert!(Instant::now() < deadline, "engine 0 never served again: {:?}", f.router.workers());
        let body = serde_json::json!({"prompt": [i]}).to_string();
        let (status, _) = post(f.addr, "/v1/completions", body).await;
        assert_eq!(status, 200);
        i += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_ends_the_engines_request_and_it_is_reported_failed() {
    use kv_relay_testkit::face::CostModel;
    use std::io::{Read, Write};
    let f = fleet(1, &[]).await;
    let face = f.engines[0].face().unwrap();
    // 100 output tokens, 100 ms each: the stream would last 10 s.
    let slow = CostModel {
        max_batch: 8,
        prefill_per_token: Duration::ZERO,
        decode_per_token: Duration::from_millis(100),
        kv_tokens: 0,
    };
    face.set_cost(Some(slow));
    let addr = f.addr;
    let first = tokio::task::spawn_blocking(move || {
        let body = serde_json::json!({"prompt": [1, 2, 3, 4, 5], "max_tokens": 100, "stream": true}).to_string();
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while !seen.windows(5).any(|w| w == b"data:") {
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0, "the stream ended early");
            seen.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&seen).into_owned()
        // The connection closes here, with the stream's first chunk read.
    })
    .await
    .unwrap();
    assert!(first.to_ascii_lowercase().contains("x-kv-router-matched-blocks: 0"), "{first}");
    assert_eq!(face.counters()[0].in_flight, 1);
    // The engine's request ends long before its 10 s (its next write fails), and the router
    // hears of it as failed.
    let deadline = Instant::now() + Duration::from_secs(5);
    while face.counters()[0].in_flight > 0 || f.router.in_flight() > 0 {
        assert!(Instant::now() < deadline, "{:?} {:?}", face.counters(), f.router.counters());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let c = f.router.counters().tracker;
    assert_eq!((c.done, c.failures, c.connect_failures), (0, 1, 0));
    assert!(face.counters()[0].generation_tokens < 100, "{:?}", face.counters());
    f.stop().await;
}
