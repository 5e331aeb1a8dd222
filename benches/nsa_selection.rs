//! CPU NSA selection kernel vs the dense masked-SDPA fallback, same inputs, same run.
//! Hq = 16, Hkv = 1, D = 128, 16 selected blocks of 64 per query (1/32 of a 32k context):
//! 256 queries at the end of a 32k context (chunked prefill), and decode at Tk = 65536. Then
//! token-level selection (DeepSeek-V3.2 DSA: K = 2048 single keys of a 64k context, decode): the
//! `TokenSelection` against dense masked SDPA and against the same keys as 2048 one-token ranges.
//!
//! `cargo bench --bench nsa_selection`

mod util;

use candle_core::{Device, Tensor};
use criterion::BenchmarkId;
use fp8nsa::nsa::{BlockSelection, SelectionAttention, SelectionRanges, TokenSelection};
use rand::seq::SliceRandom;
use rand::SeedableRng;

const HQ: usize = 16;
const HKV: usize = 1;
const D: usize = 128;
const BLOCK: usize = 64;
const SELECTED: usize = 16;
const BASELINE: &str = "dense_masked_sdpa";
const OURS: &str = "selection_kernel";

/// 16 random visible blocks per query; the query's own (local) block always among them.
fn selection(tq: usize, tk: usize, rng: &mut rand::rngs::StdRng) -> BlockSelection {
    let mut v = Vec::with_capacity(tq * HKV * SELECTED);
    for t in 0..tq {
        let last = (tk - tq + t) / BLOCK;
        let mut ids: Vec<i32> = (0..last as i32).collect();
        ids.shuffle(rng);
        ids.truncate(SELECTED - 1);
        ids.push(last as i32);
        v.extend(ids);
    }
    let t = Tensor::from_vec(v, (1, tq, HKV, SELECTED), &Device::Cpu).unwrap();
    BlockSelection::new(t, BLOCK).unwrap()
}

fn main() {
    let mut c = util::criterion(10, 8);
    let group = "nsa_selection_cpu_hq16_hkv1_d128_16x64";
    let dev = Device::Cpu;
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let cases = [("prefill256_32k", 256, 32768), ("decode_64k", 1, 65536)];
    for (name, tq, tk) in cases {
        let q = Tensor::randn(0f32, 1.0, (1, tq, HQ, D), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (1, tk, HKV, D), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (1, tk, HKV, D), &dev).unwrap();
        let sel = selection(tq, tk, &mut rng);
        let kernel = SelectionAttention::new().min_len(0);
        let dense = SelectionAttention::new().min_len(usize::MAX);
        let mut g = c.benchmark_group(group);
        g.bench_function(BenchmarkId::new(BASELINE, name), |b| {
            b.iter(|| dense.forward(&q, &k, &v, &sel).unwrap())
        });
        g.bench_function(BenchmarkId::new(OURS, name), |b| {
            b.iter(|| kernel.forward(&q, &k, &v, &sel).unwrap())
        });
        g.finish();
    }
    // DSA decode: 2048 random distinct keys of 65536, the query's own key among them
    let (tk, k_sel) = (65536usize, 2048usize);
    let q = Tensor::randn(0f32, 1.0, (1, 1, HQ, D), &dev).unwrap();
    let k = Tensor::randn(0f32, 1.0, (1, tk, HKV, D), &dev).unwrap();
    let v = Tensor::randn(0f32, 1.0, (1, tk, HKV, D), &dev).unwrap();
    let mut ids: Vec<i32> = (0..tk as i32 - 1).collect();
    ids.shuffle(&mut rng);
    ids.truncate(k_sel - 1);
    ids.push(tk as i32 - 1);
    let ranges: Vec<i32> = ids.iter().flat_map(|&i| [i, i + 1]).collect();
    let tokens =
        TokenSelection::new(Tensor::from_vec(ids, (1, 1, HKV, k_sel), &dev).unwrap()).unwrap();
    let ranges =
        SelectionRanges::new(Tensor::from_vec(ranges, (1, 1, HKV, k_sel, 2), &dev).unwrap())
            .unwrap();
    let kernel = SelectionAttention::new().min_len(0);
    let dense = SelectionAttention::new().min_len(usize::MAX);
    let mut g = c.benchmark_group("nsa_tokens_cpu_hq16_hkv1_d128_2048of64k");
    g.bench_function(BenchmarkId::new(BASELINE, "decode_64k"), |b| {
        b.iter(|| dense.forward(&q, &k, &v, &tokens).unwrap())
    });
    g.bench_function(BenchmarkId::new("one_token_ranges", "decode_64k"), |b| {
        b.iter(|| kernel.forward(&q, &k, &v, &ranges).unwrap())
    });
    g.bench_function(BenchmarkId::new("token_selection", "decode_64k"), |b| {
        b.iter(|| kernel.forward(&q, &k, &v, &tokens).unwrap())
    });
    g.finish();
    c.final_summary();
    let params: Vec<String> = cases.iter().map(|c| c.0.to_string()).collect();
    util::print_ratios(group, BASELINE, &[OURS], &params);
}
