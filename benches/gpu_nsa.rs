//! NSA selection attention on CUDA, the paper's configuration: B = 1, Hq = 64, Hkv = 4,
//! D = Dv = 128, bf16, 16 selected blocks of 64 keys per (token, kv head) — the initial block,
//! the query's own block and 14 random visible ones — prefill at T in {4k, 8k, 16k, 32k, 64k},
//! and decode with B = 16 at Tk = 64k. The peers (PyTorch's flash SDPA, dense, and fla's
//! Triton `parallel_nsa`) run from benches/peers/nsa.py in the same device command
//! (benches/peers/run_gpu.sh); benches/peers/report.py computes the ratios.
//!
//! `cargo bench --features cuda --bench gpu_nsa -- [--json out.jsonl] [--quick]`

mod gpu;

use candle_core::{DType, Device, Tensor};
use fp8nsa::nsa::{BlockSelection, SelectionAttention};
use rand::{Rng, SeedableRng};
use serde_json::json;

const HQ: usize = 64;
const HKV: usize = 4;
const D: usize = 128;
const BLOCK: usize = 64;
const SELECTED: usize = 16;

/// `[b, tq, HKV, SELECTED]` block ids for queries at positions `tk - tq ..`: block 0, the
/// query's own block, and random distinct visible blocks; -1 where fewer are visible.
fn selection(
    b: usize,
    tq: usize,
    tk: usize,
    dev: &candle_core::Device,
    rng: &mut rand::rngs::StdRng,
) -> BlockSelection {
    let mut v = Vec::with_capacity(b * tq * HKV * SELECTED);
    for _ in 0..b {
        for t in 0..tq {
            let own = (tk - tq + t) / BLOCK;
            for _ in 0..HKV {
                let mut row = vec![0i32];
                if own > 0 {
                    row.push(own as i32);
                }
                let want = SELECTED.min(own + 1);
                while row.len() < want {
                    let c = rng.random_range(1..own.max(2)) as i32;
                    if !row.contains(&c) {
                        row.push(c);
                    }
                }
                row.resize(SELECTED, -1);
                v.extend(row);
            }
        }
    }
    let t = Tensor::from_vec(v, (b, tq, HKV, SELECTED), &Device::Cpu)
        .unwrap()
        .to_device(dev)
        .unwrap();
    BlockSelection::new(t, BLOCK).unwrap()
}

fn main() {
    let args = gpu::args();
    let (dev, stream, gpu_name) = gpu::gpu();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let att = SelectionAttention::new().min_len(0);
    println!("{gpu_name}: NSA selection, Hq = {HQ}, Hkv = {HKV}, D = {D}, {SELECTED} blocks of {BLOCK}, bf16");
    let ts: &[usize] = if args.quick {
        &[4096]
    } else {
        &[4096, 8192, 16384, 32768, 65536]
    };
    for &t in ts {
        let bf = |dims: &[usize]| {
            Tensor::randn(0f32, 1.0, dims, &dev)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap()
        };
        let (q, k, v) = (bf(&[1, t, HQ, D]), bf(&[1, t, HKV, D]), bf(&[1, t, HKV, D]));
        let sel = selection(1, t, t, &dev, &mut rng);
        let ms = gpu::time_ms(&stream, || drop(att.forward(&q, &k, &v, &sel).unwrap()));
        println!("prefill T = {t:>6}: {ms:>9.3} ms");
        gpu::emit(
            &args.json,
            json!({"op": "nsa_prefill", "impl": "fp8nsa", "t": t, "ms": ms, "gpu": gpu_name}),
        );
    }
    let (b, tk) = (16, if args.quick { 8192 } else { 65536 });
    let bf = |dims: &[usize]| {
        Tensor::randn(0f32, 1.0, dims, &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
    };
    let (q, k, v) = (
        bf(&[b, 1, HQ, D]),
        bf(&[b, tk, HKV, D]),
        bf(&[b, tk, HKV, D]),
    );
    let sel = selection(b, 1, tk, &dev, &mut rng);
    let ms = gpu::time_ms(&stream, || drop(att.forward(&q, &k, &v, &sel).unwrap()));
    println!("decode B = {b}, Tk = {tk}: {ms:.4} ms");
    gpu::emit(
        &args.json,
        json!({"op": "nsa_decode", "impl": "fp8nsa", "b": b, "tk": tk, "ms": ms, "gpu": gpu_name}),
    );
}
