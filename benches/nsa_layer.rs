//! The whole NSA layer on CPU (compression + top-n selection + sliding window, paper defaults)
//! vs dense causal attention over the same queries and keys, in the same run. Queries come
//! through the decode cache as a server would run them: the cache holds the context, the
//! layer takes the last 256 queries (chunked prefill) or 1 (decode), then the cache is rolled
//! back for the next iteration. Hq = 16, Hkv = 1, D = 128, f32.
//!
//! `cargo bench --bench nsa_layer`

mod util;

use candle_core::{DType, Device, Tensor};
use criterion::BenchmarkId;
use fp8nsa::nsa::{
    Compressor, Gates, NativeSparseAttention, NsaCache, NsaConfig, NsaDims, SelectionAttention,
    SelectionRanges,
};

const BASELINE: &str = "dense_causal_sdpa";
const OURS: &str = "nsa_layer";

fn main() {
    let mut c = util::criterion(10, 6);
    let group = "nsa_layer_cpu_hq16_hkv1_d128";
    let dev = Device::Cpu;
    let dims = NsaDims::new(16, 1, 128, 128).unwrap();
    let cfg = NsaConfig::default();
    let nsa = NativeSparseAttention::new(
        cfg.clone(),
        dims,
        Compressor::MeanPool,
        Gates::Fixed([1.0; 3]),
    )
    .unwrap()
    .with_attention(SelectionAttention::new().min_len(0));
    let dense = SelectionAttention::new().min_len(usize::MAX);
    let mut params = Vec::new();
    for t in [8192usize, 32768] {
        let q = Tensor::randn(0f32, 1.0, (1, t, dims.hq(), dims.d()), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (1, t, dims.hkv(), dims.d()), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (1, t, dims.hkv(), dims.dv()), &dev).unwrap();
        for (name, tq) in [("prefill256", 256usize), ("decode", 1)] {
            let param = format!("{name}_{}k", t / 1024);
            let ctx = t - tq;
            let mut cache = NsaCache::new();
            nsa.append_kv(
                &k.narrow(1, 0, ctx).unwrap(),
                &v.narrow(1, 0, ctx).unwrap(),
                &mut cache,
            )
            .unwrap();
            let tail = |x: &Tensor| x.narrow(1, ctx, tq).unwrap();
            let (qt, kt, vt) = (tail(&q), tail(&k), tail(&v));
            let x = Tensor::zeros((1, tq, 8), DType::F32, &dev).unwrap();
            let all: Vec<i32> = (0..tq).flat_map(|_| [0, t as i32]).collect();
            let causal =
                SelectionRanges::new(Tensor::from_vec(all, (1, tq, 1, 1, 2), &dev).unwrap())
                    .unwrap();
            let mut g = c.benchmark_group(group);
            g.bench_function(BenchmarkId::new(BASELINE, &param), |b| {
                b.iter(|| dense.forward(&qt, &k, &v, &causal).unwrap())
            });
            g.bench_function(BenchmarkId::new(OURS, &param), |b| {
                b.iter(|| {
                    let o = nsa.forward_step(&x, &qt, &kt, &vt, &mut cache).unwrap();
                    cache.truncate(ctx, &cfg).unwrap();
                    o
                })
            });
            g.finish();
            params.push(param);
        }
    }
    c.final_summary();
    util::print_ratios(group, BASELINE, &[OURS], &params);
}
