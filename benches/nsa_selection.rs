//! CPU NSA selection kernel vs the dense masked-SDPA fallback, same inputs, same run.
//! Hq = 16, Hkv = 1, D = 128, 16 selected blocks of 64 per query (1/32 of a 32k context):
//! 256 queries at the end of a 32k context (chunked prefill), and decode at Tk = 65536.
//!
//! `cargo bench --bench nsa_selection`

mod util;

use candle_core::{Device, Tensor};
use criterion::BenchmarkId;
use fp8nsa::nsa::{BlockSelection, SelectionAttention};
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
    c.final_summary();
    let params: Vec<String> = cases.iter().map(|c| c.0.to_string()).collect();
    util::print_ratios(group, BASELINE, &[OURS], &params);
}
