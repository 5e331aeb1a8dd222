//! Our own fuzzing of what a server is handed (issue: reliability): GGUF files, safetensors
//! files, `config.json`, selections and `NsaConfig`, mutated at random from valid ones. Every
//! case must come back as `Ok` or an error: never a panic, an abort or a long hang. Seeded
//! (the seed is printed; `FP8NSA_TEST_SEED=<seed>` replays it) and bounded to a few seconds
//! each, so CI runs it on every commit. `FP8NSA_FUZZ_CASES` raises the case count for a
//! longer local run.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use fp8nsa::models::{LlamaConfig, Weights};
use fp8nsa::nsa::{
    BlockSelection, Compressor, Gates, NativeSparseAttention, NsaConfig, NsaDims, PagedKv,
    SelectionAttention, SelectionRanges, TokenSelection,
};
use fp8nsa::Fp8BlockWeight;
use fp8nsa_test_support::*;
use rand::rngs::StdRng;
use rand::Rng;

/// Cases per target: enough to reach every header field many times, small enough for CI.
fn cases(default: usize) -> usize {
    std::env::var("FP8NSA_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Runs `f`; a panic fails the test with the case's description, and so does a case that
/// takes longer than `limit` (a near-hang).
fn no_panic<T>(what: &str, limit: Duration, f: impl FnOnce() -> T) -> T {
    let t0 = Instant::now();
    let out = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(out) => out,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!("{what}: panicked: {msg}");
        }
    };
    let took = t0.elapsed();
    assert!(took < limit, "{what}: took {took:?}");
    out
}

// The least share of cases (percent) each suite's stages must accept. Seeds are fresh each
// run; measured over runs (2026-11-25) the suites accept about: GGUF 12%, safetensors 47%,
// config.json 21% parsed / 11% valid, selections 5% blocks / 24% ranges / 30% tokens,
// NsaConfig 11-19%, paged calls 40%. The floors sit at a third of that or less, so a run
// misses one only when the checks begin refusing valid inputs.
const ACCEPT_GGUF: usize = 4;
const ACCEPT_SAFETENSORS: usize = 20;
const ACCEPT_CONFIG: usize = 4;
/// DeepSeek configs that validate and build on the tiny weights: 3-7% measured (2026-11-27).
const ACCEPT_DEEPSEEK_BUILT: usize = 1;
const ACCEPT_SELECTIONS: usize = 8;
const ACCEPT_BLOCKS: usize = 1;
const ACCEPT_NSA_CONFIG: usize = 4;
const ACCEPT_PAGED: usize = 15;

/// How many of `total` cases each stage accepted, for a suite to assert that its mutations
/// leave enough valid inputs to reach the code behind the checks (a suite whose validation
/// refused everything would pass without testing anything).
#[derive(Debug, Default)]
struct Accepted {
    total: usize,
    counts: std::collections::BTreeMap<&'static str, usize>,
}

impl Accepted {
    fn add(&mut self, stage: &'static str, ok: bool) {
        *self.counts.entry(stage).or_default() += usize::from(ok);
    }

    /// Every stage named accepted at least `percent`% of the cases.
    fn assert_at_least(&self, percent: usize, stages: &[&'static str]) {
        eprintln!("accepted of {}: {:?}", self.total, self.counts);
        for stage in stages {
            let n = self.counts.get(stage).copied().unwrap_or(0);
            assert!(
                n * 100 >= percent * self.total,
                "{stage}: {n} of {} cases accepted, expected at least {percent}%: {self:?}",
                self.total
            );
        }
    }
}

/// A value that often sits on a boundary: 0, 1, powers of two near the type's range, max.
fn edgy(rng: &mut StdRng) -> u64 {
    match rng.random_range(0..6) {
        0 => 0,
        1 => 1,
        2 => u64::MAX,
        3 => 1 << rng.random_range(0..64),
        4 => u32::MAX as u64 + rng.random_range(0..3),
        _ => rng.random_range(0..1 << 20),
    }
}

/// Mutates `bytes` in place: flips, overwritten 4- and 8-byte fields, or a truncation.
fn mutate(rng: &mut StdRng, bytes: &mut Vec<u8>, header_len: usize) {
    let n = rng.random_range(1..4);
    for _ in 0..n {
        let span = header_len.min(bytes.len()).max(1);
        let at = rng.random_range(0..span);
        match rng.random_range(0..4) {
            0 => bytes[at] ^= 1 << rng.random_range(0..8),
            1 if at + 8 <= bytes.len() => {
                bytes[at..at + 8].copy_from_slice(&edgy(rng).to_le_bytes())
            }
            2 if at + 4 <= bytes.len() => {
                bytes[at..at + 4].copy_from_slice(&(edgy(rng) as u32).to_le_bytes())
            }
            _ => bytes.truncate(at.max(1)),
        }
    }
}

/// A small, valid Hugging Face Llama config (that of `LlamaConfig::tiny`).
fn tiny_config_json() -> serde_json::Value {
    serde_json::json!({
        "vocab_size": 512, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 4, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": true,
        "bos_token_id": 1, "eos_token_id": 2, "rope_scaling": null,
        "hidden_act": "silu", "num_experts": 0, "num_experts_per_tok": 0,
        "moe_intermediate_size": 0, "norm_topk_prob": false, "decoder_sparse_step": null,
        "mlp_only_layers": []
    })
}

/// Values the config suites put in place of a key's: out of range, wrong types, and the
/// published forms a loader must take (id lists, other activations, flags).
fn config_values() -> Vec<serde_json::Value> {
    use serde_json::json;
    vec![
        json!(0),
        json!(-1),
        json!(1e300),
        json!(u64::MAX),
        json!(4294967295u64),
        json!(1u64 << 40),
        json!("NaN"),
        json!(null),
        json!([]),
        json!({"type": "yarn", "factor": -2.0}),
        json!({"rope_type": "llama3", "factor": 1e30}),
        json!(0.5),
        json!(false),
        json!(true),
        json!("gelu"),
        json!("silu"),
        json!([128001, 128008, 128009]),
        json!([2, -1]),
        json!(4),
        json!(2),
    ]
}

#[test]
fn gguf_files() {
    let mut rng = rng("fuzz_gguf");
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.gguf");
    let header_len = fp8nsa_test_support::gguf::tiny_llama(&good, 7, 64, 16);
    let bytes = std::fs::read(&good).unwrap();
    let bad = dir.path().join("bad.gguf");
    // the unmutated file loads: the cases are mutations of a valid input
    Weights::load_gguf(&good, &mut |_, _| {}).unwrap();
    let mut acc = Accepted::default();
    for i in 0..cases(400) {
        let mut b = bytes.clone();
        mutate(&mut rng, &mut b, header_len);
        std::fs::write(&bad, &b).unwrap();
        let ok = no_panic(&format!("gguf case {i}"), Duration::from_secs(5), || {
            Weights::load_gguf(&bad, &mut |_, _| {}).is_ok()
        });
        acc.total += 1;
        acc.add("load_gguf", ok);
    }
    acc.assert_at_least(ACCEPT_GGUF, &["load_gguf"]);
}

#[test]
fn safetensors_files() {
    use safetensors::tensor::{Dtype, TensorView};
    let mut rng = rng("fuzz_safetensors");
    let dir = tempfile::tempdir().unwrap();
    let codes: Vec<u8> = (0..64 * 48).map(|i| (i % 251) as u8).collect();
    let scales: Vec<u8> = [0.5f32, 1.0].iter().flat_map(|s| s.to_le_bytes()).collect();
    let dense: Vec<u8> = (0..48 * 4).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let tensors = vec![
        (
            "m.weight".to_string(),
            TensorView::new(Dtype::F8_E4M3, vec![64, 48], &codes).unwrap(),
        ),
        (
            "m.weight_scale_inv".to_string(),
            TensorView::new(Dtype::F32, vec![2, 1], &scales).unwrap(),
        ),
        (
            "d.weight".to_string(),
            TensorView::new(Dtype::F32, vec![48, 4], &dense).unwrap(),
        ),
    ];
    let good = safetensors::serialize(tensors, None).unwrap();
    let header_len = 8 + u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    std::fs::write(model.join("config.json"), tiny_config_json().to_string()).unwrap();
    let path = model.join("model.safetensors");
    // the unmutated checkpoint loads, as a directory and as the fp8 weight
    std::fs::write(&path, &good).unwrap();
    Weights::load_hf_dir(&model).unwrap();
    {
        // SAFETY: this test's own file, not modified while mapped.
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(&path) }.unwrap();
        Fp8BlockWeight::load_safetensors(&st, "m", [32, 48], &Device::Cpu).unwrap();
    }
    let mut acc = Accepted::default();
    for i in 0..cases(400) {
        let mut b = good.clone();
        if rng.random_bool(0.5) {
            mutate(&mut rng, &mut b, header_len);
        } else {
            // the header intact, the values changed: codes, scales (zero, NaN, huge) and data
            for _ in 0..rng.random_range(1..4) {
                let at = rng.random_range(header_len..b.len() - 3);
                b[at..at + 4].copy_from_slice(&(edgy(&mut rng) as u32).to_le_bytes());
            }
        }
        // a dtype name swapped inside the JSON header, now and then
        if rng.random_bool(0.2) {
            let text = String::from_utf8_lossy(&b).into_owned();
            let swapped = text.replacen("F8_E4M3", ["U8", "I64", "F64", "BOOL"][i % 4], 1);
            if swapped.len() == b.len() {
                b = swapped.into_bytes();
            }
        }
        std::fs::write(&path, &b).unwrap();
        let (dir_ok, fp8_ok) = no_panic(
            &format!("safetensors case {i}"),
            Duration::from_secs(5),
            || {
                let dir_ok = Weights::load_hf_dir(&model).is_ok();
                // SAFETY: this test's own file, not modified while mapped.
                let fp8_ok = match unsafe {
                    candle_core::safetensors::MmapedSafetensors::new(&path)
                } {
                    Ok(st) => {
                        Fp8BlockWeight::load_safetensors(&st, "m", [32, 48], &Device::Cpu).is_ok()
                    }
                    Err(_) => false,
                };
                (dir_ok, fp8_ok)
            },
        );
        acc.total += 1;
        acc.add("load_hf_dir", dir_ok);
        acc.add("fp8 weight", fp8_ok);
    }
    acc.assert_at_least(ACCEPT_SAFETENSORS, &["load_hf_dir", "fp8 weight"]);
}

#[test]
fn config_json() {
    let mut rng = rng("fuzz_config");
    let base = tiny_config_json();
    assert!(serde_json::from_value::<LlamaConfig>(base.clone()).is_ok());
    let keys: Vec<String> = base.as_object().unwrap().keys().cloned().collect();
    let values = config_values();
    let mut acc = Accepted::default();
    for i in 0..cases(600) {
        let mut cfg = base.clone();
        for _ in 0..rng.random_range(1..4) {
            let k = &keys[rng.random_range(0..keys.len())];
            cfg[k] = values[rng.random_range(0..values.len())].clone();
        }
        let (parsed, valid) = no_panic(
            &format!("config case {i}: {cfg}"),
            Duration::from_secs(5),
            || {
                let Ok(c) = serde_json::from_value::<LlamaConfig>(cfg.clone()) else {
                    return (false, false);
                };
                let valid = c.validate().is_ok();
                if valid {
                    // what a loader then builds from it, against weights it does not fit
                    let w = Weights::random(&LlamaConfig::tiny(), 1).unwrap();
                    let _ = fp8nsa::models::Llama::new(&c, &w, &Default::default());
                }
                (true, valid)
            },
        );
        acc.total += 1;
        acc.add("parsed", parsed);
        acc.add("valid", valid);
    }
    acc.assert_at_least(ACCEPT_CONFIG, &["parsed", "valid"]);
}

/// DeepSeek-V3 / V3.2 configs (MLA sizes, group-limited routing, the indexer, YaRN) mutated
/// key by key: parsing, validation and building never panic or hang, and a config that
/// validates either builds on the tiny model's weights or is refused by a typed error.
#[test]
fn deepseek_config_json() {
    use fp8nsa::models::{DeepSeekConfig, Llama};
    let mut rng = rng("fuzz_deepseek_config");
    let tiny = DeepSeekConfig::tiny();
    let base = serde_json::to_value(&tiny).unwrap();
    assert!(serde_json::from_value::<DeepSeekConfig>(base.clone())
        .unwrap()
        .validate(true)
        .is_ok());
    let weights = tiny.random_weights(1).unwrap();
    let keys: Vec<String> = base.as_object().unwrap().keys().cloned().collect();
    let values = config_values();
    let mut acc = Accepted::default();
    for i in 0..cases(300) {
        let mut cfg = base.clone();
        for _ in 0..rng.random_range(1..3) {
            let k = &keys[rng.random_range(0..keys.len())];
            cfg[k] = values[rng.random_range(0..values.len())].clone();
        }
        let v32 = rng.random_bool(0.5);
        let (parsed, valid, built) = no_panic(
            &format!("deepseek config case {i} (v32 {v32}): {cfg}"),
            Duration::from_secs(10),
            || {
                let Ok(c) = serde_json::from_value::<DeepSeekConfig>(cfg.clone()) else {
                    return (false, false, false);
                };
                if c.validate(v32).is_err() {
                    return (true, false, false);
                }
                let built = Llama::deepseek(&c, &weights, &Default::default()).is_ok();
                (true, true, built)
            },
        );
        acc.total += 1;
        acc.add("parsed", parsed);
        acc.add("valid", valid);
        acc.add("built", built);
    }
    acc.assert_at_least(ACCEPT_CONFIG, &["parsed", "valid"]);
    acc.assert_at_least(ACCEPT_DEEPSEEK_BUILT, &["built"]);
}

fn edge_i32(rng: &mut StdRng, tk: i32) -> i32 {
    match rng.random_range(0..7) {
        0 => -1,
        1 => i32::MIN,
        2 => i32::MAX,
        3 => tk,
        4 => rng.random_range(-5..tk + 5),
        _ => rng.random_range(0..tk.max(1)),
    }
}

#[test]
fn selections() {
    let mut rng = rng("fuzz_selections");
    let (hq, hkv, d) = (4, 2, 16);
    let mut acc = Accepted::default();
    for i in 0..cases(300) {
        let (tq, tk) = (rng.random_range(1..6), rng.random_range(1..40));
        let n = rng.random_range(1..5);
        let mk =
            |rng: &mut StdRng, dims: &[usize]| tensor(gaussian(rng, dims.iter().product()), dims);
        let (q, k, v) = (
            mk(&mut rng, &[1, tq, hq, d]),
            mk(&mut rng, &[1, tk, hkv, d]),
            mk(&mut rng, &[1, tk, hkv, d]),
        );
        // ids in range (-1 pads), then up to two moved onto an edge
        let mut ids: Vec<i32> = (0..tq * hkv * n * 2)
            .map(|_| rng.random_range(-1..tk as i32 + 1))
            .collect();
        for _ in 0..rng.random_range(0..3) {
            let at = rng.random_range(0..ids.len());
            ids[at] = edge_i32(&mut rng, tk as i32);
        }
        let block = [0, 1, 7, 64, usize::MAX][rng.random_range(0..5)];
        let min_len = [0, usize::MAX][rng.random_range(0..2)];
        let what = format!("selection case {i}: tq {tq} tk {tk} n {n} block {block}");
        let ran = no_panic(&what, Duration::from_secs(5), || {
            let attn = SelectionAttention::new().min_len(min_len).with_lse(true);
            let t = |v: &[i32], dims: &[usize]| {
                Tensor::from_vec(v.to_vec(), dims, &Device::Cpu).unwrap()
            };
            // an accepted call returns finite outputs (rows that see nothing are zeros)
            let finite = |r: fp8nsa::Result<(Tensor, Option<Tensor>)>| match r {
                Ok((o, _)) => {
                    let o: Vec<f32> = o.flatten_all().unwrap().to_vec1().unwrap();
                    assert!(o.iter().all(|x| x.is_finite()), "{what}: non-finite output");
                    true
                }
                Err(_) => false,
            };
            let half = &ids[..tq * hkv * n];
            let blocks = BlockSelection::new(t(half, &[1, tq, hkv, n]), block)
                .is_ok_and(|s| finite(attn.forward(&q, &k, &v, &s)));
            let tokens = TokenSelection::new(t(half, &[1, tq, hkv, n]))
                .is_ok_and(|s| finite(attn.forward(&q, &k, &v, &s)));
            let ranges = SelectionRanges::new(t(&ids, &[1, tq, hkv, n, 2]))
                .is_ok_and(|s| finite(attn.forward(&q, &k, &v, &s)));
            [blocks, tokens, ranges]
        });
        acc.total += 1;
        for (stage, ok) in ["blocks", "tokens", "ranges"].into_iter().zip(ran) {
            acc.add(stage, ok);
        }
    }
    acc.assert_at_least(ACCEPT_BLOCKS, &["blocks"]);
    acc.assert_at_least(ACCEPT_SELECTIONS, &["tokens", "ranges"]);
}

#[test]
fn nsa_configs() {
    let mut rng = rng("fuzz_nsa_config");
    let dims = NsaDims::new(4, 2, 16, 16).unwrap();
    let pick = |rng: &mut StdRng| -> usize {
        match rng.random_range(0..6) {
            0 => 0,
            1 => usize::MAX,
            2 => 1 << rng.random_range(0..40),
            3 => usize::MAX / rng.random_range(1..4),
            _ => rng.random_range(1..40),
        }
    };
    let t = 48;
    let mk = |rng: &mut StdRng, dims: &[usize]| tensor(gaussian(rng, dims.iter().product()), dims);
    let (q, k, v) = (
        mk(&mut rng, &[1, t, 4, 16]),
        mk(&mut rng, &[1, t, 2, 16]),
        mk(&mut rng, &[1, t, 2, 16]),
    );
    let x = Tensor::zeros((1, t, 8), DType::F32, &Device::Cpu).unwrap();
    let mut acc = Accepted::default();
    for i in 0..cases(400) {
        let mut cfg = NsaConfig::default();
        for _ in 0..rng.random_range(1..4) {
            let v = pick(&mut rng);
            match rng.random_range(0..7) {
                0 => cfg.compress_block = v,
                1 => cfg.compress_stride = v,
                2 => cfg.select_block = v,
                3 => cfg.num_selected = v,
                4 => cfg.num_initial = v,
                5 => cfg.num_local = v,
                _ => cfg.window = v,
            }
        }
        let (valid, ran) = no_panic(
            &format!("nsa config case {i}: {cfg:?}"),
            Duration::from_secs(5),
            || {
                if cfg.validate().is_err() {
                    return (false, false);
                }
                let ran = NativeSparseAttention::new(
                    cfg.clone(),
                    dims,
                    Compressor::MeanPool,
                    Gates::Fixed([0.3, 0.3, 0.4]),
                )
                .is_ok_and(|nsa| nsa.forward(&x, &q, &k, &v).is_ok());
                (true, ran)
            },
        );
        acc.total += 1;
        acc.add("valid", valid);
        acc.add("forward", ran);
    }
    acc.assert_at_least(ACCEPT_NSA_CONFIG, &["valid", "forward"]);
}

#[test]
fn paged_kv() {
    let mut rng = rng("fuzz_paged");
    let (hq, hkv, d) = (4, 2, 16);
    let mut acc = Accepted::default();
    for i in 0..cases(300) {
        let (np, ps) = (rng.random_range(1..6), rng.random_range(1..20));
        let b = rng.random_range(1..4);
        let tq = rng.random_range(1..3);
        let max_pages = rng.random_range(1..5);
        // a valid call, then up to two mutations of its table, lengths or selection
        let mut table: Vec<i32> = (0..b * max_pages)
            .map(|_| rng.random_range(0..np as i32))
            .collect();
        let mut lens: Vec<usize> = (0..b)
            .map(|_| rng.random_range(tq.min(max_pages * ps)..=max_pages * ps))
            .collect();
        let n = rng.random_range(1..4);
        // tokens 0..n of each sequence (distinct, visible to its last query), -1 past its length
        let mut ids: Vec<i32> = (0..b * tq * hkv * n)
            .map(|x| {
                let (bi, e) = (x / (tq * hkv * n), (x % n) as i32);
                if (e as usize) < lens[bi] + 1 - tq {
                    e
                } else {
                    -1
                }
            })
            .collect();
        for _ in 0..rng.random_range(0..3) {
            match rng.random_range(0..3) {
                0 => {
                    let at = rng.random_range(0..table.len());
                    table[at] = edge_i32(&mut rng, np as i32);
                }
                1 => {
                    let at = rng.random_range(0..b);
                    lens[at] = [0, usize::MAX, max_pages * ps + 1][rng.random_range(0..3)];
                }
                _ => {
                    let at = rng.random_range(0..ids.len());
                    ids[at] = edge_i32(&mut rng, 40);
                }
            }
        }
        let mk =
            |rng: &mut StdRng, dims: &[usize]| tensor(gaussian(rng, dims.iter().product()), dims);
        let k_pages = mk(&mut rng, &[np, ps, hkv, d]);
        let v_pages = mk(&mut rng, &[np, ps, hkv, d]);
        let q = mk(&mut rng, &[b, tq, hq, d]);
        let min_len = [0, usize::MAX][rng.random_range(0..2)];
        let what = format!("paged case {i}: pool {np}x{ps}, table {table:?}, lens {lens:?}");
        let ok = no_panic(&what, Duration::from_secs(5), || {
            let table = Tensor::from_vec(table.clone(), (b, max_pages), &Device::Cpu).unwrap();
            let kv = PagedKv {
                k_pages: &k_pages,
                v_pages: &v_pages,
                block_table: &table,
                seq_lens: &lens,
            };
            let attn = SelectionAttention::new().min_len(min_len);
            let idx = Tensor::from_vec(ids.clone(), (b, tq, hkv, n), &Device::Cpu).unwrap();
            TokenSelection::new(idx).is_ok_and(|s| attn.forward_paged(&q, &kv, &s).is_ok())
        });
        acc.total += 1;
        acc.add("forward_paged", ok);
    }
    // the mutations leave enough valid calls to reach the kernels
    acc.assert_at_least(ACCEPT_PAGED, &["forward_paged"]);
}
