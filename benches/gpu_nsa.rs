//! NSA selection attention on CUDA, the paper's configuration: B = 1, Hq = 64, Hkv = 4,
//! D = Dv = 128, bf16, 16 selected blocks of 64 keys per (token, kv head) — the initial block,
//! the query's own block and 14 random visible ones — prefill at T in {4k, 8k, 16k, 32k, 64k},
//! and decode with B = 16 at Tk = 64k. The baseline in this binary is dense causal attention
//! written with candle ops (cuBLAS bf16 GEMMs, candle's softmax), where its T x T scores fit
//! (prefill T <= 8k, and decode). The peers (PyTorch's flash SDPA, dense, and fla's Triton
//! `parallel_nsa`) run from benches/peers/nsa.py in the same device command
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

/// Dense attention of `q [b, tq, HQ, D]` over `k, v [b, tk, HKV, D]` with candle ops; `mask`
/// `[tq, tk]` (0 / -inf) for causal prefill. The G query heads of a kv head are stacked so
/// that each GEMM reads k and v once per kv head, as a GQA kernel would.
fn candle_dense(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Tensor {
    let (b, tq, _, _) = q.dims4().unwrap();
    let tk = k.dims()[1];
    let g = HQ / HKV;
    let q = q
        .reshape((b, tq, HKV, g, D))
        .unwrap()
        .permute((0, 2, 3, 1, 4))
        .unwrap()
        .reshape((b, HKV, g * tq, D))
        .unwrap()
        .contiguous()
        .unwrap();
    let k = k.transpose(1, 2).unwrap().contiguous().unwrap();
    let v = v.transpose(1, 2).unwrap().contiguous().unwrap();
    let s = (q.matmul(&k.t().unwrap()).unwrap() * (1.0 / (D as f64).sqrt())).unwrap();
    let s = match mask {
        Some(m) => s
            .reshape((b, HKV, g, tq, tk))
            .unwrap()
            .broadcast_add(m)
            .unwrap()
            .reshape((b, HKV, g * tq, tk))
            .unwrap(),
        None => s,
    };
    candle_nn::ops::softmax_last_dim(&s)
        .unwrap()
        .matmul(&v)
        .unwrap()
}

/// `[t, t]` bf16: 0 where the key is visible to the query, -inf after it.
fn causal_mask(t: usize, dev: &Device) -> Tensor {
    let m: Vec<f32> = (0..t * t)
        .map(|i| {
            if i % t <= i / t {
                0.0
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect();
    Tensor::from_vec(m, (t, t), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap()
        .to_device(dev)
        .unwrap()
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
    let bf = |dims: &[usize]| {
        Tensor::randn(0f32, 1.0, dims, &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
    };
    for &t in ts {
        let (q, k, v) = (bf(&[1, t, HQ, D]), bf(&[1, t, HKV, D]), bf(&[1, t, HKV, D]));
        let sel = selection(1, t, t, &dev, &mut rng);
        let ms = gpu::time_ms(&stream, || drop(att.forward(&q, &k, &v, &sel).unwrap()));
        gpu::emit(
            &args.json,
            json!({"op": "nsa_prefill", "impl": "fp8nsa", "t": t, "ms": ms, "gpu": gpu_name}),
        );
        // the dense baseline's scores take 2 * 64 * T^2 bytes (8 GiB at 8k) several times over
        if t <= 8192 {
            let mask = causal_mask(t, &dev);
            let dense = gpu::time_ms(&stream, || drop(candle_dense(&q, &k, &v, Some(&mask))));
            println!(
                "prefill T = {t:>6}: {ms:>9.3} ms   candle dense {dense:>9.3} ms   x{:.2}",
                dense / ms
            );
            gpu::emit(
                &args.json,
                json!({"op": "nsa_prefill", "impl": "candle_dense", "t": t, "ms": dense, "gpu": gpu_name}),
            );
        } else {
            println!("prefill T = {t:>6}: {ms:>9.3} ms   (candle dense: too large, see the peers)");
        }
    }
    let (b, tk) = (16, if args.quick { 8192 } else { 65536 });
    let (q, k, v) = (
        bf(&[b, 1, HQ, D]),
        bf(&[b, tk, HKV, D]),
        bf(&[b, tk, HKV, D]),
    );
    let sel = selection(b, 1, tk, &dev, &mut rng);
    let ms = gpu::time_ms(&stream, || drop(att.forward(&q, &k, &v, &sel).unwrap()));
    let dense = gpu::time_ms(&stream, || drop(candle_dense(&q, &k, &v, None)));
    println!(
        "decode B = {b}, Tk = {tk}: {ms:.4} ms   candle dense {dense:.4} ms   x{:.2}",
        dense / ms
    );
    gpu::emit(
        &args.json,
        json!({"op": "nsa_decode", "impl": "fp8nsa", "b": b, "tk": tk, "ms": ms, "gpu": gpu_name}),
    );
    gpu::emit(
        &args.json,
        json!({"op": "nsa_decode", "impl": "candle_dense", "b": b, "tk": tk, "ms": dense, "gpu": gpu_name}),
    );
}
