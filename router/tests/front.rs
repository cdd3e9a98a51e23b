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
    fleet_with(n, relay_args, FrontConfig::default()).await
}

/// The fleet with the front in `front`'s settings (its `hash`: the engines').
async fn fleet_with(n: usize, relay_args: &[&str], front: FrontConfig) -> Fleet {
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
    let front = FrontConfig { hash: Some(hash), ..front };
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

/// Waits until a worker holds `n` leading blocks of `hashes` and its load, as the router last
/// heard it, is idle: a scrape taken while an earlier request ran says 1 running, which
/// `cache_aware` rightly weighs above a few blocks' prefill.
async fn until_held_and_idle(router: &Router, hashes: &[u64], n: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let idle = |w: &kv_router_client::MatchRef<'_>| w.load.is_some_and(|l| l.running == 0.0 && l.waiting == 0.0);
    while !router.follower().matches(hashes, Default::default()).iter().any(|w| w.matched_blocks == n && idle(&w)) {
        assert!(Instant::now() < deadline, "no idle worker held the {n} blocks");
        tokio::time::sleep(Duration::from_millis(20)).await;
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
    until_held_and_idle(&f.router, &hashes, 8).await;
    // Again, streamed: the same engine, all 8 blocks cached, as the router predicted.
    let routed = f.router.route(&hashes).unwrap();
    assert_eq!((f.engine_of(routed.engine_url.as_deref().unwrap()), routed.matched_blocks), (holder, 8));
    f.router.report(routed.request_id, kv_router::Outcome::Done, Default::default()).unwrap();
    until_held_and_idle(&f.router, &hashes, 8).await;
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

/// A model directory whose tokenizer is the mock engine's: one token per byte of the text, its
/// value (a character-level WordLevel over ASCII), and a chat template that joins the messages'
/// contents, as the mock engine reads a chat request.
fn mock_model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut vocab = serde_json::Map::new();
    for b in 32u8..127 {
        vocab.insert((b as char).to_string(), b.into());
    }
    vocab.insert("<unk>".into(), 0.into());
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated", "invert": false},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    std::fs::write(dir.path().join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let config = serde_json::json!({"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"});
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}

/// `POST path` on the front; the answer's status, the worker the router chose and the blocks
/// it predicted cached (its headers), and the body.
async fn post_seen(addr: std::net::SocketAddr, path: &'static str, body: String) -> (u16, String, u64, String) {
    use std::io::{Read, Write};
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        write!(
            s,
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
        let header = |name: &str| {
            head.lines()
                .find_map(|l| l.split_once(": ").filter(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.to_string()))
                .unwrap_or_default()
        };
        let body = if header("transfer-encoding") == "chunked" {
            kv_relay_testkit::metrics::dechunk(body)
        } else {
            body.to_string()
        };
        (status, header("x-kv-router-worker"), header("x-kv-router-matched-blocks").parse().unwrap_or(u64::MAX), body)
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_prompts_and_chat_messages_are_tokenized_as_the_engine_does_and_routed_by_their_prefix() {
    let model = mock_model_dir();
    let tokenizer = Arc::new(kv_router::tokenize::Tokenizer::from_dir(model.path()).unwrap());
    text_and_chat_routed_by_prefix(FrontConfig { tokenizer: Some(tokenizer), ..FrontConfig::default() }, [3, 0]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_tokenizer_an_engines_tokenize_gives_the_tokens() {
    text_and_chat_routed_by_prefix(FrontConfig { tokenize_via_engine: true, ..FrontConfig::default() }, [0, 3]).await;
}

/// A text prompt, then the same text, then a chat starting with it: the second and third go
/// to the first's worker with its 8 blocks predicted and cached. `by`: how many prompts the
/// router and the engines tokenized.
async fn text_and_chat_routed_by_prefix(front: FrontConfig, by: [u64; 2]) {
    let f = fleet_with(2, &[], front).await;
    // 34 characters: 34 tokens for the engine, 8 full blocks of 4.
    let text = "Route me where my prefix is cached";
    assert_eq!(text.len(), 34);
    let completion = serde_json::json!({"model": "m", "prompt": text, "max_tokens": 2}).to_string();
    let chat = serde_json::json!({"model": "m", "messages": [
        {"role": "system", "content": "Route me where my "},
        {"role": "user", "content": "prefix is cached, then more"},
    ]})
    .to_string();
    let (status, first, matched, body) = post_seen(f.addr, "/v1/completions", completion.clone()).await;
    assert_eq!((status, matched), (200, 0), "{body}");
    assert_eq!(usage(&body)["prompt_tokens_details"]["cached_tokens"], 0);
    reported(&f.router, 1).await;
    // The router sees the engine hold the 8 blocks the text's tokens make.
    let hashes = kv_relay_proto::hash::block_event_hashes(
        &EngineHashConfig::vllm("0.32".parse().unwrap(), VllmHashAlgo::Sha256Cbor, None, BLOCK as usize).unwrap(),
        &kv_relay_proto::hash::RequestKeys {
            token_ids: &text.bytes().map(u64::from).collect::<Vec<_>>(),
            ..Default::default()
        },
    )
    .unwrap();
    until_held_and_idle(&f.router, &hashes, 8).await;
    // The same text: the same worker, 8 blocks predicted, 32 tokens cached by the engine.
    let (status, again, matched, body) = post_seen(f.addr, "/v1/completions", completion).await;
    assert_eq!((status, &again, matched), (200, &first, 8), "{body}");
    assert_eq!(usage(&body)["prompt_tokens_details"]["cached_tokens"], 32);
    until_held_and_idle(&f.router, &hashes, 8).await;
    // A chat whose messages' contents start with the same 34 characters (45 in all): the same
    // worker again, the same 8 blocks predicted and cached.
    let (status, chatted, matched, body) = post_seen(f.addr, "/v1/chat/completions", chat).await;
    assert_eq!((status, &chatted, matched), (200, &first, 8), "{body}");
    assert_eq!(usage(&body)["prompt_tokens_details"]["cached_tokens"], 32);
    reported(&f.router, 3).await;
    let (_, metrics) = tokio::task::spawn_blocking({
        let a = f.addr;
        move || http_get(a, "/metrics").unwrap()
    })
    .await
    .unwrap();
    for line in [
        format!("kv_router_front_tokenized_total{{by=\"router\"}} {}", by[0]),
        format!("kv_router_front_tokenized_total{{by=\"engine\"}} {}", by[1]),
        "kv_router_front_tokenize_errors_total 0".to_string(),
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} not in {metrics}");
    }
    // The router's own /tokenize answers what the engine's does.
    if by[0] > 0 {
        for (body, want) in [
            (serde_json::json!({"prompt": "ab c"}), vec![97u64, 98, 32, 99]),
            (
                serde_json::json!({"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "yz"}]}),
                vec![120, 121, 122],
            ),
        ] {
            let (status, text) = post(f.addr, "/tokenize", body.to_string()).await;
            assert_eq!(status, 200, "{text}");
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!((v["count"].as_u64(), ids_of(&v["tokens"])), (Some(want.len() as u64), want));
        }
        let (status, text) = post(f.addr, "/tokenize", "{}".into()).await;
        assert_eq!((status, text.contains("no prompt or messages")), (400, true), "{text}");
    } else {
        let (status, text) = post(f.addr, "/tokenize", r#"{"prompt": "x"}"#.into()).await;
        assert_eq!((status, text.contains("--model-dir")), (404, true), "{text}");
    }
    f.stop().await;
}

fn ids_of(v: &serde_json::Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|i| i.as_u64().unwrap()).collect()
}
