//! The continuous-batching engine (issue: serving, items 2 and 3): requests of mixed lengths
//! joining at different steps all get what `generate` gives them alone, under a KV pool tight
//! enough to force preemption; cancelled and finished requests free their pages; bad requests
//! are refused by field.

use std::collections::HashMap;

use fp8nsa_models::*;
use rand::Rng;

fn model() -> Llama {
    model_with(ModelOptions::default())
}

fn model_with(opts: ModelOptions) -> Llama {
    let cfg = LlamaConfig::tiny();
    Llama::new(&cfg, &Weights::random(&cfg, 5).unwrap(), &opts).unwrap()
}

fn alone(model: &Llama, req: &Request) -> Vec<u32> {
    let mut cache = model.new_cache();
    generate(
        model,
        &mut cache,
        &req.prompt,
        req.max_tokens,
        req.sampling,
        &req.stop_tokens,
        &mut |_| {},
    )
    .unwrap()
}

/// Runs the engine to the end, adding `late` requests after `join_after` steps; returns each
/// request's tokens and finish reason.
fn drive(
    engine: &mut Engine,
    late: Vec<(u64, Request)>,
    join_after: usize,
) -> HashMap<u64, (Vec<u32>, Option<FinishReason>)> {
    let mut out: HashMap<u64, (Vec<u32>, Option<FinishReason>)> = HashMap::new();
    let mut late = Some(late);
    let mut steps = 0;
    while engine.has_work() || late.is_some() {
        if steps == join_after {
            for (id, r) in late.take().unwrap_or_default() {
                engine.add(id, r).unwrap();
            }
        }
        for e in engine.step() {
            match e {
                Event::Token { id, token } => out.entry(id).or_default().0.push(token),
                Event::Finished {
                    id,
                    reason,
                    completion_tokens,
                    ..
                } => {
                    let o = out.entry(id).or_default();
                    assert_eq!(o.0.len(), completion_tokens);
                    o.1 = Some(reason);
                }
                Event::Failed { id, error } => panic!("request {id} failed: {error}"),
            }
        }
        steps += 1;
        assert!(steps < 10_000, "the engine finishes");
    }
    out
}

fn requests(n: usize, seed: &str) -> Vec<(u64, Request)> {
    let mut rng = fp8nsa_test_support::rng(seed);
    (0..n as u64)
        .map(|id| {
            // the first two: 47-token prompts admitted together into 6 of 8 pages, which
            // outgrow them while decoding (a preemption is certain in the 8-page pool)
            let len = if id < 2 { 47 } else { rng.random_range(1..60) };
            let sampling = if id % 3 == 2 {
                Sampling::TopP {
                    p: 0.9,
                    temperature: 0.8,
                    seed: id,
                }
            } else {
                Sampling::Greedy
            };
            let req = Request {
                prompt: (0..len).map(|_| rng.random_range(0..512u32)).collect(),
                max_tokens: if id < 2 { 30 } else { rng.random_range(1..40) },
                sampling,
                // a stop token some requests will meet
                stop_tokens: if id % 4 == 3 { vec![7, 300] } else { vec![] },
            };
            (id, req)
        })
        .collect()
}

#[test]
fn every_request_gets_what_it_gets_alone() {
    check_alone(model(), &[(256, 512), (8, 64), (64, 7)]);
}

/// The NSA variant: each layer's paged NSA state per sequence, dropped on preemption.
#[test]
fn nsa_requests_get_what_they_get_alone() {
    let nsa = fp8nsa_ops::nsa::NsaConfig {
        compress_block: 16,
        compress_stride: 8,
        select_block: 16,
        num_selected: 4,
        window: 16,
        ..Default::default()
    };
    check_alone(
        model_with(ModelOptions {
            attention: AttentionKind::Nsa(nsa),
            ..ModelOptions::default()
        }),
        &[(8, 64)],
    );
}

fn check_alone(model: Llama, configs: &[(usize, usize)]) {
    let reqs = requests(12, "engine_alone");
    // a roomy pool, then one so tight that sequences are preempted and recomputed, then a
    // step budget of a few tokens (long prompts prefill over many steps)
    for &(pages, budget) in configs {
        let mut engine = Engine::new(
            model.clone(),
            EngineConfig {
                kv_pages: pages,
                page_size: 16,
                max_batch_tokens: budget,
                max_running: 8,
                max_waiting: 64,
                ..EngineConfig::default()
            },
        )
        .unwrap();
        let (first, late) = reqs.split_at(7);
        for (id, r) in first {
            engine.add(*id, r.clone()).unwrap();
        }
        let out = drive(&mut engine, late.to_vec(), 3);
        for (id, r) in &reqs {
            let want = alone(&model, r);
            let (got, reason) = &out[id];
            assert_eq!(got, &want, "pages {pages}, budget {budget}: request {id}");
            let stopped = want.last().is_some_and(|t| r.stop_tokens.contains(t));
            let want_reason = if stopped {
                FinishReason::Stop
            } else {
                FinishReason::Length
            };
            assert_eq!(*reason, Some(want_reason), "request {id}");
        }
        let stats = engine.stats();
        assert_eq!((stats.running, stats.waiting, stats.pages_used), (0, 0, 0));
        if pages == 8 {
            assert!(stats.preemptions > 0, "the tight pool preempted");
        }
    }
}

#[test]
fn cancelled_requests_free_their_pages_and_bad_ones_are_refused() {
    let mut engine = Engine::new(
        model(),
        EngineConfig {
            kv_pages: 8,
            page_size: 16,
            max_waiting: 2,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let req = |len: usize, max_tokens| Request {
        prompt: vec![5; len],
        max_tokens,
        sampling: Sampling::Greedy,
        stop_tokens: vec![],
    };
    engine.add(1, req(40, 100)).unwrap();
    engine.step();
    assert!(engine.stats().pages_used >= 3);
    assert!(engine.cancel(1));
    assert!(!engine.cancel(1));
    assert_eq!(engine.stats().pages_used, 0);
    assert!(!engine.has_work());

    let field = |r: Result<()>| match r {
        Err(Error::Invalid { arg, .. }) => arg,
        other => panic!("{other:?}"),
    };
    assert_eq!(field(engine.add(2, req(0, 1))), "prompt");
    assert_eq!(field(engine.add(2, req(3, 0))), "max_tokens");
    // 8 pages of 16: 127 prompt tokens at most
    assert_eq!(engine.max_prompt_tokens(), 127);
    assert_eq!(field(engine.add(2, req(128, 1))), "prompt");
    let mut bad = req(3, 1);
    bad.prompt[1] = 512;
    assert_eq!(field(engine.add(2, bad)), "prompt");
    let mut bad = req(3, 1);
    bad.sampling = Sampling::TopP {
        p: 1.5,
        temperature: 1.0,
        seed: 0,
    };
    assert_eq!(field(engine.add(2, bad)), "sampling");
    engine.add(2, req(3, 1)).unwrap();
    assert_eq!(field(engine.add(2, req(3, 1))), "id");
    engine.add(3, req(3, 1)).unwrap();
    assert_eq!(field(engine.add(4, req(3, 1))), "queue");
    // a lone sequence that fills the KV capacity ends with Length, not an error
    while engine.has_work() {
        engine.step();
    }
    engine.add(5, req(120, 100)).unwrap();
    let mut events = Vec::new();
    while engine.has_work() {
        events.extend(engine.step());
    }
    assert!(
        matches!(
            events.last(),
            Some(Event::Finished {
                reason: FinishReason::Length,
                completion_tokens: 8,
                ..
            })
        ),
        "{events:?}"
    );
    assert_eq!(engine.stats().pages_used, 0);
}
