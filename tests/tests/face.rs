//! The mock engine's HTTP face: health, progress counters, completions served by the rank's
//! prefix cache with the exact cached tokens, SSE, and the faults.

use std::sync::Arc;
use std::time::Duration;

use kv_relay_testkit::engine::{EngineConfig, MockEngine};
use kv_relay_testkit::face::{Fault, COMPLETION_TOKENS};
use kv_relay_testkit::metrics::{http_get, http_post};
use kv_relay_testkit::wire::{Engine, WireVersion};

fn engine(dp: u32) -> Arc<MockEngine> {
    let mut c = EngineConfig::new(WireVersion::new(Engine::Vllm, 0, 32, 0));
    c.dp_size = dp;
    c.endpoint = "tcp://127.0.0.1:0".into();
    c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    c.block_size = 4;
    let e = Arc::new(MockEngine::start(c).unwrap());
    e.serve_completions();
    e
}

fn usage(body: &str) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    v["usage"].clone()
}

#[test]
fn completions_go_through_the_ranks_cache_and_report_the_cached_prefix() {
    let e = engine(2);
    let addr = e.metrics_addr().unwrap();
    assert_eq!(http_get(addr, "/health").unwrap(), (200, String::new()));
    let prompt = r#"{"model": "m", "prompt": [1,2,3,4,5,6,7,8,9,10], "max_tokens": 4}"#;
    let (status, body) = http_post(addr, "/v1/completions", &[("X-data-parallel-rank", "1")], prompt).unwrap();
    assert_eq!(status, 200, "{body}");
    let u = usage(&body);
    assert_eq!(
        (u["prompt_tokens"].as_u64(), u["prompt_tokens_details"]["cached_tokens"].as_u64()),
        (Some(10), Some(0))
    );
    assert_eq!(u["completion_tokens"].as_u64(), Some(COMPLETION_TOKENS));
    // The same prompt again on rank 1: its two full blocks are cached; on rank 0 nothing is.
    let (_, body) = http_post(addr, "/v1/completions", &[("X-data-parallel-rank", "1")], prompt).unwrap();
    assert_eq!(usage(&body)["prompt_tokens_details"]["cached_tokens"].as_u64(), Some(8));
    let (_, body) = http_post(addr, "/v1/completions", &[], prompt).unwrap();
    assert_eq!(usage(&body)["prompt_tokens_details"]["cached_tokens"].as_u64(), Some(0));
    e.flush().unwrap();
    assert_eq!(e.cache_hashes(1).unwrap().len(), 2);
    assert_eq!(e.cache_hashes(0).unwrap().len(), 2);
    // The counters moved per rank.
    let c = e.face().unwrap().counters();
    assert_eq!((c[0].prompt_tokens, c[0].generation_tokens), (10, COMPLETION_TOKENS));
    assert_eq!((c[1].prompt_tokens, c[1].generation_tokens), (20, 2 * COMPLETION_TOKENS));
    let (_, metrics) = http_get(addr, "/metrics").unwrap();
    assert!(
        metrics.lines().any(|l| l == "vllm:prompt_tokens_total{engine=\"1\",model_name=\"mock-model\"} 20.0"),
        "{metrics}"
    );
    assert!(
        metrics.lines().any(|l| l == "vllm:generation_tokens_total{engine=\"0\",model_name=\"mock-model\"} 4.0"),
        "{metrics}"
    );

    // Chat, streamed: SSE chunks, then the usage, then [DONE]. "abcdefgh" is two blocks of bytes.
    let chat = r#"{"model": "m", "messages": [{"role": "user", "content": "abcdefgh"}], "stream": true}"#;
    let (status, body) = http_post(addr, "/v1/chat/completions", &[], chat).unwrap();
    assert_eq!(status, 200);
    let data: Vec<&str> = body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.len(), COMPLETION_TOKENS as usize + 2, "{body}");
    assert_eq!(data.last(), Some(&"[DONE]"));
    let last: serde_json::Value = serde_json::from_str(data[data.len() - 2]).unwrap();
    assert_eq!(last["usage"]["prompt_tokens"].as_u64(), Some(8));
    let (_, body) = http_post(addr, "/v1/chat/completions", &[], &chat.replace(", \"stream\": true", "")).unwrap();
    assert_eq!(usage(&body)["prompt_tokens_details"]["cached_tokens"].as_u64(), Some(8));

    assert_eq!(http_post(addr, "/v1/completions", &[("X-data-parallel-rank", "2")], prompt).unwrap().0, 400);
    assert_eq!(http_post(addr, "/v1/completions", &[], "not json").unwrap().0, 400);
    let (status, models) = http_get(addr, "/v1/models").unwrap();
    assert_eq!(status, 200);
    assert_eq!(serde_json::from_str::<serde_json::Value>(&models).unwrap()["data"][0]["id"], "mock-model");
}

#[test]
fn faults_hold_refuse_and_fail_as_set() {
    let e = engine(1);
    let addr = e.metrics_addr().unwrap();
    let face = e.face().unwrap();

    face.set_fault(Fault::Unhealthy).unwrap();
    assert_eq!(http_get(addr, "/health").unwrap().0, 503);

    // Wedged: health answers, a completion hangs (and counts as running) until cleared.
    face.set_fault(Fault::Wedged).unwrap();
    assert_eq!(http_get(addr, "/health").unwrap().0, 200);
    let t = std::thread::spawn(move || http_post(addr, "/v1/completions", &[], r#"{"prompt": [1,2,3,4]}"#).unwrap());
    let running = || {
        let (_, m) = http_get(addr, "/metrics").unwrap();
        m.lines().any(|l| l == "vllm:num_requests_running{engine=\"0\",model_name=\"mock-model\"} 1.0")
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !running() {
        assert!(std::time::Instant::now() < deadline, "the wedged completion never counted as running");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(face.counters()[0].generation_tokens, 0);
    face.set_fault(Fault::None).unwrap();
    let (status, body) = t.join().unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(face.counters()[0].generation_tokens, COMPLETION_TOKENS);

    // Listener gone: refused; cleared: the same port answers again.
    face.set_fault(Fault::ListenerGone).unwrap();
    let err = http_get(addr, "/health").unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
    face.set_fault(Fault::None).unwrap();
    assert_eq!(http_get(addr, "/health").unwrap().0, 200);

    // Frozen: a request waits, unanswered, until the fault is cleared.
    face.set_fault(Fault::Frozen).unwrap();
    let t = std::thread::spawn(move || http_get(addr, "/health").unwrap().0);
    std::thread::sleep(Duration::from_millis(300));
    assert!(!t.is_finished());
    face.set_fault(Fault::None).unwrap();
    assert_eq!(t.join().unwrap(), 200);
}

#[test]
fn with_a_cost_model_requests_queue_for_the_batch_and_generate_max_tokens() {
    use kv_relay_testkit::face::CostModel;
    let e = engine(1);
    let addr = e.metrics_addr().unwrap();
    let face = e.face().unwrap();
    // One request at a time; each uncached token takes 50 ms to prefill (12 tokens: 0.6 s). The
    // rank holds 48 tokens of KV: the running request's 12 are a quarter of it.
    let cost = CostModel {
        max_batch: 1,
        prefill_per_token: Duration::from_millis(50),
        decode_per_token: Duration::from_millis(1),
        kv_tokens: 48,
    };
    face.set_cost(Some(cost));
    let post =
        |prompt: &'static str| std::thread::spawn(move || http_post(addr, "/v1/completions", &[], prompt).unwrap());
    let a = post(r#"{"prompt": [1,2,3,4,5,6,7,8,9,10,11,12], "max_tokens": 3}"#);
    // While the first is prefilled, the second waits for a place in the batch, and /metrics says so.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while face.counters()[0].in_flight == 0 {
        assert!(std::time::Instant::now() < until);
        std::thread::sleep(Duration::from_millis(5));
    }
    let b = post(r#"{"prompt": [1,2,3,4,5,6,7,8,20,21,22,23], "stream": true, "max_tokens": 5}"#);
    while face.counters()[0].waiting == 0 {
        assert!(std::time::Instant::now() < until);
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!((face.counters()[0].in_flight, face.counters()[0].waiting), (1, 1));
    let (_, metrics) = http_get(addr, "/metrics").unwrap();
    let line = |name: &str| metrics.lines().find(|l| l.starts_with(name)).map(str::to_string);
    assert_eq!(
        line("vllm:num_requests_running").as_deref(),
        Some("vllm:num_requests_running{engine=\"0\",model_name=\"mock-model\"} 1.0"),
        "{metrics}"
    );
    assert_eq!(
        line("vllm:num_requests_waiting").as_deref(),
        Some("vllm:num_requests_waiting{engine=\"0\",model_name=\"mock-model\"} 1.0"),
        "{metrics}"
    );
    assert_eq!(
        line("vllm:kv_cache_usage_perc").as_deref(),
        Some("vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"mock-model\"} 0.25"),
        "{metrics}"
    );
    assert_eq!(face.counters()[0].running_tokens, 12);
    let (status, body) = a.join().unwrap();
    assert_eq!(status, 200);
    let u = usage(&body);
    assert_eq!(
        (u["completion_tokens"].as_u64(), u["prompt_tokens_details"]["cached_tokens"].as_u64()),
        (Some(3), Some(0))
    );
    // The second shares two blocks with the first: five chunks, then the usage, 8 tokens cached.
    let (status, sse) = b.join().unwrap();
    assert_eq!(status, 200);
    let data: Vec<&str> = sse.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.len(), 5 + 2, "{sse}");
    let last: serde_json::Value = serde_json::from_str(data[5]).unwrap();
    assert_eq!(
        (last["usage"]["completion_tokens"].as_u64(), last["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64()),
        (Some(5), Some(8))
    );
    let c = face.counters()[0];
    assert_eq!((c.prompt_tokens, c.generation_tokens, c.in_flight, c.waiting), (24, 8, 0, 0));
}
