//! One token through a Qwen3-30B-A3B-shaped MoE layer (128 experts, top 8, hidden 2048, 768 per
//! expert): `Fp8Moe` (each projection of all routed experts as one grouped call) against a loop
//! of per-expert `Fp8Linear` calls and against dense f32 experts (`candle_nn::Linear`), all
//! with the same routing, measured in the same run. Also T = 32 (a small prefill).
//!
//! `cargo bench --bench moe` (add `-- --quick` for a short run). Builds 128 x 3 fp8 experts
//! (~600 MB); the dense f32 weights are built for the experts the fixed inputs route to only
//! (the others are never read by any variant).

mod util;

use candle_core::{DType, Device, Module, Tensor};
use criterion::BenchmarkId;
use fp8nsa::{ActQuant, Fp8BlockWeight, Fp8Experts, Fp8Linear, Fp8Moe};

const E: usize = 128;
const TOP_K: usize = 8;
const H: usize = 2048;
const I: usize = 768;
const TS: [usize; 2] = [1, 32];

fn main() {
    let mut c = util::criterion(20, 4);
    let group = format!("moe_e{E}_top{TOP_K}_h{H}_i{I}");
    let dev = Device::Cpu;
    eprintln!("quantizing {E} x 3 experts");
    let make = |n: usize, k: usize| -> Vec<Fp8BlockWeight> {
        (0..E)
            .map(|_| {
                let w = Tensor::randn(0f32, 0.02, (n, k), &dev).unwrap();
                Fp8BlockWeight::quantize(&w, [128, 128]).unwrap()
            })
            .collect()
    };
    let (gate, up, down) = (make(I, H), make(I, H), make(H, I));
    let stack = |ws: &[Fp8BlockWeight]| Fp8Experts::new(ws, ActQuant::Group).unwrap();
    let router = Tensor::randn(0f32, 1.0, (E, H), &dev).unwrap();
    let moe = Fp8Moe::new(router, stack(&gate), stack(&up), stack(&down), TOP_K, true).unwrap();
    let linear = |w: &Fp8BlockWeight| Fp8Linear::new(w.clone(), None, ActQuant::Group).unwrap();
    let per_expert: Vec<[Fp8Linear; 3]> = (0..E)
        .map(|e| [linear(&gate[e]), linear(&up[e]), linear(&down[e])])
        .collect();
    for t in TS {
        let x = Tensor::randn(0f32, 1.0, (t, H), &dev).unwrap();
        let (chosen, _) = moe.route(&x).unwrap();
        let mut used: Vec<usize> = chosen.clone();
        used.sort_unstable();
        used.dedup();
        let dense: std::collections::HashMap<usize, [candle_nn::Linear; 3]> = used
            .iter()
            .map(|&e| {
                let d = |w: &Fp8BlockWeight| {
                    candle_nn::Linear::new(w.dequantize(DType::F32).unwrap(), None)
                };
                (e, [d(&gate[e]), d(&up[e]), d(&down[e])])
            })
            .collect();
        let mut g = c.benchmark_group(&group);
        g.bench_with_input(BenchmarkId::new("fp8_moe_grouped", t), &x, |b, x| {
            b.iter(|| moe.forward(x).unwrap())
        });
        // the same routing, then per routed expert one call per projection on its tokens
        let looped = |x: &Tensor, layer: &dyn Fn(usize, usize, &Tensor) -> Tensor| {
            let (chosen, weights) = moe.route(x).unwrap();
            let mut out = Tensor::zeros((t, H), DType::F32, &Device::Cpu).unwrap();
            for e in 0..E {
                let slots: Vec<usize> = (0..chosen.len()).filter(|&j| chosen[j] == e).collect();
                if slots.is_empty() {
                    continue;
                }
                let toks: Vec<u32> = slots.iter().map(|&j| (j / TOP_K) as u32).collect();
                let idx = Tensor::new(toks.as_slice(), &Device::Cpu).unwrap();
                let xe = x.index_select(&idx, 0).unwrap();
                let a = (layer(e, 0, &xe).silu().unwrap() * layer(e, 1, &xe)).unwrap();
                let w: Vec<f32> = slots.iter().map(|&j| weights[j]).collect();
                let w = Tensor::from_vec(w, (slots.len(), 1), &Device::Cpu).unwrap();
                let d = layer(e, 2, &a).broadcast_mul(&w).unwrap();
                out = out.index_add(&idx, &d, 0).unwrap();
            }
            out
        };
        g.bench_with_input(BenchmarkId::new("fp8_linear_loop", t), &x, |b, x| {
            b.iter(|| looped(x, &|e, p, v| per_expert[e][p].forward(v).unwrap()))
        });
        g.bench_with_input(BenchmarkId::new("dense_f32_loop", t), &x, |b, x| {
            b.iter(|| looped(x, &|e, p, v| dense[&e][p].forward(v).unwrap()))
        });
        g.finish();
    }
    c.final_summary();
    let params: Vec<String> = TS.iter().map(|t| t.to_string()).collect();
    util::print_ratios(&group, "fp8_linear_loop", &["fp8_moe_grouped"], &params);
    util::print_ratios(&group, "dense_f32_loop", &["fp8_moe_grouped"], &params);
    util::print_machine();
}
