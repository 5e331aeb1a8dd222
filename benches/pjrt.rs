//! PJRT (the XLA CPU plugin) vs fp8nsa's own CPU backend, same inputs, same run, for both
//! layers. Needs `--features pjrt` and `pip install xla-cpu-pjrt` (or `FP8NSA_PJRT_PLUGIN`).
//!
//! `cargo bench --features pjrt --bench pjrt`

mod util;

use std::sync::Arc;

use candle_core::{Device, Module, Tensor};
use criterion::BenchmarkId;
use fp8nsa::nsa::{BlockSelection, SelectionAttention};
use fp8nsa::{ActQuant, Backend, Fp8BlockWeight, Fp8Linear, PjrtRuntime};

const BASELINE: &str = "cpu_backend";
const OURS: &str = "pjrt_xla_cpu";

fn main() {
    let rt = match PjrtRuntime::from_env() {
        Ok(rt) => Arc::new(rt),
        Err(e) => {
            eprintln!("no PJRT plugin, nothing to measure: {e}");
            return;
        }
    };
    let mut c = util::criterion(10, 4);
    let dev = Device::Cpu;
    let lin_group = "pjrt_fp8_linear_n4096_k4096";
    let w = Tensor::randn(0f32, 0.02, (4096, 4096), &dev).unwrap();
    let wq = Fp8BlockWeight::quantize(&w, [128, 128]).unwrap();
    let cpu = Fp8Linear::new(wq, None, ActQuant::Group)
        .unwrap()
        .with_backend(Backend::Cpu);
    let pjrt = cpu.clone().with_backend(Backend::Pjrt(rt.clone()));
    for m in [1usize, 128] {
        let x = Tensor::randn(0f32, 1.0, (m, 4096), &dev).unwrap();
        pjrt.forward(&x).unwrap(); // compile and upload outside the timing
        let mut g = c.benchmark_group(lin_group);
        g.bench_with_input(BenchmarkId::new(BASELINE, m), &x, |b, x| {
            b.iter(|| cpu.forward(x).unwrap())
        });
        g.bench_with_input(BenchmarkId::new(OURS, m), &x, |b, x| {
            b.iter(|| pjrt.forward(x).unwrap())
        });
        g.finish();
    }
    let nsa_group = "pjrt_nsa_selection_hq16_hkv1_d128_tk8192";
    let tk = 8192;
    let k = Tensor::randn(0f32, 1.0, (1, tk, 1, 128), &dev).unwrap();
    let v = Tensor::randn(0f32, 1.0, (1, tk, 1, 128), &dev).unwrap();
    let mut params = Vec::new();
    for tq in [256usize, 1] {
        let q = Tensor::randn(0f32, 1.0, (1, tq, 16, 128), &dev).unwrap();
        let idx: Vec<i32> = (0..tq)
            .flat_map(|t| {
                let last = ((tk - tq + t) / 64) as i32;
                (0..16).map(move |i| (last - i * 7).max(-1))
            })
            .collect();
        let mut idx = idx;
        for row in idx.chunks_mut(16) {
            let mut seen = std::collections::HashSet::new();
            for x in row.iter_mut() {
                if *x >= 0 && !seen.insert(*x) {
                    *x = -1;
                }
            }
        }
        let sel =
            BlockSelection::new(Tensor::from_vec(idx, (1, tq, 1, 16), &dev).unwrap(), 64).unwrap();
        let on = |b| SelectionAttention::new().min_len(0).backend(b);
        let (cpu_att, pjrt_att) = (on(Backend::Cpu), on(Backend::Pjrt(rt.clone())));
        pjrt_att.forward(&q, &k, &v, &sel).unwrap();
        let name = format!("tq{tq}");
        let mut g = c.benchmark_group(nsa_group);
        g.bench_function(BenchmarkId::new(BASELINE, &name), |b| {
            b.iter(|| cpu_att.forward(&q, &k, &v, &sel).unwrap())
        });
        g.bench_function(BenchmarkId::new(OURS, &name), |b| {
            b.iter(|| pjrt_att.forward(&q, &k, &v, &sel).unwrap())
        });
        g.finish();
        params.push(name);
    }
    c.final_summary();
    println!("PJRT plugin platform: {}", rt.platform());
    util::print_ratios(lin_group, BASELINE, &[OURS], &["1".into(), "128".into()]);
    util::print_ratios(nsa_group, BASELINE, &[OURS], &params);
}
