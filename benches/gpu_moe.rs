//! The grouped fp8 expert GEMM on CUDA (one launch for all experts) vs a loop of per-expert
//! `Fp8Linear` calls and a loop of per-expert bf16 matmuls (cuBLAS), on the same weights in
//! the same binary. Shapes: Qwen3-30B-A3B's gate/up projection (128 experts of [768, 2048],
//! top 8), T tokens routed at random (T = 1 is one decode step: 8 experts' weights read).
//! For T = 1 also the routed weights' bytes over the time, against the copy bandwidth.
//!
//! `cargo bench --features cuda --bench gpu_moe -- [--json out.jsonl] [--quick]`

mod gpu;

use candle_core::{DType, Module, Tensor};
use fp8nsa::{ActQuant, Fp8BlockWeight, Fp8Experts, Fp8Linear};
use rand::seq::index::sample;
use rand::SeedableRng;
use serde_json::json;

const E: usize = 128;
const TOP_K: usize = 8;
const N: usize = 768;
const K: usize = 2048;

fn main() {
    let args = gpu::args();
    let (dev, stream, gpu_name) = gpu::gpu();
    println!("{gpu_name}: {E} experts of [{N}, {K}], top {TOP_K}");
    let ws: Vec<Fp8BlockWeight> = (0..E)
        .map(|_| {
            let w = Tensor::randn(0f32, 0.02, (N, K), &dev).unwrap();
            Fp8BlockWeight::quantize(&w, [128, 128]).unwrap()
        })
        .collect();
    let grouped = Fp8Experts::new(&ws, ActQuant::Group).unwrap();
    let linears: Vec<Fp8Linear> = ws
        .iter()
        .map(|w| Fp8Linear::new(w.clone(), None, ActQuant::Group).unwrap())
        .collect();
    let dense: Vec<Tensor> = ws
        .iter()
        .map(|w| w.dequantize(DType::BF16).unwrap().t().unwrap())
        .collect();
    println!(
        "{:>5}  {:<14} {:>10} {:>12} {:>10} {:>9} {:>9}",
        "T", "path", "grouped ms", "loop fp8 ms", "bf16 ms", "x loop", "x bf16"
    );
    let tokens: &[usize] = if args.quick {
        &[1, 128]
    } else {
        &[1, 4, 16, 128, 512, 4096]
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for &t in tokens {
        let mut counts = vec![0usize; E];
        for _ in 0..t {
            for e in sample(&mut rng, E, TOP_K) {
                counts[e] += 1;
            }
        }
        let rows: usize = counts.iter().sum();
        let x = Tensor::randn(0f32, 1.0, (rows, K), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let t_grouped = gpu::time_ms(&stream, || {
            drop(grouped.forward_contiguous(&x, &counts).unwrap())
        });
        let groups: Vec<(usize, usize, usize)> = counts
            .iter()
            .enumerate()
            .scan(0, |r, (e, &c)| {
                let g = (e, *r, c);
                *r += c;
                Some(g)
            })
            .filter(|g| g.2 > 0)
            .collect();
        let t_loop = gpu::time_ms(&stream, || {
            for &(e, r0, c) in &groups {
                drop(linears[e].forward(&x.narrow(0, r0, c).unwrap()).unwrap());
            }
        });
        let t_bf16 = gpu::time_ms(&stream, || {
            for &(e, r0, c) in &groups {
                drop(x.narrow(0, r0, c).unwrap().matmul(&dense[e]).unwrap());
            }
        });
        let path = fp8nsa::cuda::fp8::plan_grouped(
            &fp8nsa::cuda::device_info(&stream).unwrap(),
            &fp8nsa::cuda::fp8::WeightLayout::new([N, K], [128, 128]).unwrap(),
            &counts,
            ActQuant::Group,
            fp8nsa::CudaFp8Kernel::Auto,
        )
        .map(|p| p.to_string())
        .unwrap_or_else(|e| e.to_string());
        println!(
            "{t:>5}  {path:<14} {t_grouped:>10.4} {t_loop:>12.4} {t_bf16:>10.4} {:>9.2} {:>9.2}",
            t_loop / t_grouped,
            t_bf16 / t_grouped
        );
        if t == 1 {
            let gbs = (TOP_K * N * K) as f64 / t_grouped / 1e6;
            println!("       routed weights read at {gbs:.0} GB/s");
        }
        gpu::emit(
            &args.json,
            json!({"op": "fp8_experts", "gpu": gpu_name, "t": t, "e": E, "top_k": TOP_K, "n": N, "k": K, "path": path,
                   "grouped_ms": t_grouped, "loop_fp8_ms": t_loop, "loop_bf16_ms": t_bf16}),
        );
    }
}
