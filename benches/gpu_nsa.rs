//! NSA selection attention on CUDA, the paper's configuration: B = 1, Hq = 64, Hkv = 4,
//! D = Dv = 128, bf16, 16 selected blocks of 64 keys per (token, kv head) — the initial block,
//! the query's own block and 14 random visible ones — prefill at T in {4k, 8k, 16k, 32k, 64k},
//! and decode with B = 16 at Tk = 64k. The baseline in this binary is dense causal attention
//! written with candle ops (cuBLAS bf16 GEMMs, candle's softmax), where its T x T scores fit
//! (prefill T <= 8k, and decode). The peers (PyTorch's flash SDPA, dense, and fla's Triton
//! `parallel_nsa`) run from benches/peers/nsa.py in the same device command
//! (benches/peers/run_gpu.sh); benches/peers/report.py computes the ratios.
//!
//! Then the server's shapes (issue 19): a continuous-batching decode step of 16 sequences of
//! mixed lengths whose keys lie in a shuffled page pool (pages of 16), against the same step on
//! packed keys (`forward_varlen`) and as 16 single calls; and DSA's token-level selection
//! (2048 tokens of a 64k context per query, Hq = 16, Hkv = 1) against dense decode and the
//! same keys as 2048 one-token ranges.
//!
//! `cargo bench --features cuda --bench gpu_nsa -- [--json out.jsonl] [--quick]`

mod gpu;

use candle_core::{DType, Device, Tensor};
use fp8nsa::nsa::{BlockSelection, PagedKv, SelectionAttention, SelectionRanges, TokenSelection};
use rand::seq::SliceRandom;
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

/// Dense attention of `q [b, tq, Hq, D]` over `k, v [b, tk, Hkv, D]` with candle ops; `mask`
/// `[tq, tk]` (0 / -inf) for causal prefill. The G query heads of a kv head are stacked so
/// that each GEMM reads k and v once per kv head, as a GQA kernel would.
fn candle_dense(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Tensor {
    let (b, tq, hq, _) = q.dims4().unwrap();
    let (tk, hkv) = (k.dims()[1], k.dims()[2]);
    let g = hq / hkv;
    let q = q
        .reshape((b, tq, hkv, g, D))
        .unwrap()
        .permute((0, 2, 3, 1, 4))
        .unwrap()
        .reshape((b, hkv, g * tq, D))
        .unwrap()
        .contiguous()
        .unwrap();
    let k = k.transpose(1, 2).unwrap().contiguous().unwrap();
    let v = v.transpose(1, 2).unwrap().contiguous().unwrap();
    let s = (q.matmul(&k.t().unwrap()).unwrap() * (1.0 / (D as f64).sqrt())).unwrap();
    let s = match mask {
        Some(m) => s
            .reshape((b, hkv, g, tq, tk))
            .unwrap()
            .broadcast_add(m)
            .unwrap()
            .reshape((b, hkv, g * tq, tk))
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
        // the dense baseline's scores take 2 * 64 * T^2 bytes (8 GiB at 8k) several times over;
        // at 8k candle's matmul fails to launch on an H100 (CUDA_ERROR_INVALID_VALUE, first GPU
        // run 2026-11-26), so the dense peer past 4k is torch's flash SDPA (benches/peers/nsa.py)
        if t <= 4096 {
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
    server_shapes(&args, &dev, &stream, &gpu_name, &mut rng);
}

/// Issue 19's shapes: paged batched decode and token-level selection.
fn server_shapes(
    args: &gpu::Args,
    dev: &Device,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    gpu_name: &str,
    rng: &mut rand::rngs::StdRng,
) {
    let att = SelectionAttention::new().min_len(0);
    let bf = |dims: &[usize]| {
        Tensor::randn(0f32, 1.0, dims, dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
    };
    let host = Device::Cpu;
    // 16 sequences of 4k .. 64k keys (a quarter of that with --quick), pages of 16
    let scale = if args.quick { 1024 } else { 4096 };
    let lens: Vec<usize> = (0..16).map(|i| scale * (1 + (i * 7) % 16)).collect();
    let ps = 16;
    let b = lens.len();
    let need: Vec<usize> = lens.iter().map(|l| l.div_ceil(ps)).collect();
    let max_pages = *need.iter().max().unwrap();
    let pages: usize = need.iter().sum();
    let mut ids: Vec<i32> = (0..pages as i32).collect();
    ids.shuffle(rng);
    let (mut table, mut rows, mut next) = (Vec::new(), Vec::new(), 0);
    for (&n, &l) in need.iter().zip(&lens) {
        let mine = &ids[next..next + n];
        next += n;
        rows.extend((0..l).map(|j| (mine[j / ps] as usize * ps + j % ps) as u32));
        let mut r = mine.to_vec();
        r.resize(max_pages, -1);
        table.extend(r);
    }
    let (kp, vp) = (bf(&[pages, ps, HKV, D]), bf(&[pages, ps, HKV, D]));
    let table = Tensor::from_vec(table, (b, max_pages), dev).unwrap();
    let q = bf(&[b, 1, HQ, D]);
    let mut sel = Vec::new();
    for &l in &lens {
        sel.push(
            selection(1, 1, l, &host, rng)
                .indices()
                .flatten_all()
                .unwrap(),
        );
    }
    let sel = BlockSelection::new(
        Tensor::cat(&sel, 0)
            .unwrap()
            .reshape((b, 1, HKV, SELECTED))
            .unwrap()
            .to_device(dev)
            .unwrap(),
        BLOCK,
    )
    .unwrap();
    let kv = PagedKv {
        k_pages: &kp,
        v_pages: &vp,
        block_table: &table,
        seq_lens: &lens,
    };
    let paged = gpu::time_ms(stream, || drop(att.forward_paged(&q, &kv, &sel).unwrap()));
    // the same keys packed: gathered once, outside the timing
    let rows = Tensor::from_vec(rows, lens.iter().sum::<usize>(), dev).unwrap();
    let flat = |p: &Tensor| {
        p.reshape((pages * ps, HKV, D))
            .unwrap()
            .index_select(&rows, 0)
            .unwrap()
    };
    let (k, v) = (flat(&kp), flat(&vp));
    let mut cu = vec![0u32];
    for &l in &lens {
        cu.push(cu.last().unwrap() + l as u32);
    }
    let cu_k = Tensor::new(cu.as_slice(), dev).unwrap();
    let cu_q = Tensor::new((0..=b as u32).collect::<Vec<_>>().as_slice(), dev).unwrap();
    let qp = q.reshape((b, HQ, D)).unwrap();
    let sel_packed =
        BlockSelection::new(sel.indices().reshape((1, b, HKV, SELECTED)).unwrap(), BLOCK).unwrap();
    let packed = gpu::time_ms(stream, || {
        drop(
            att.forward_varlen(&qp, &k, &v, &cu_q, &cu_k, &sel_packed)
                .unwrap(),
        )
    });
    let singles: Vec<_> = (0..b)
        .map(|i| {
            let (a, l) = (cu[i] as usize, lens[i]);
            (
                q.narrow(0, i, 1).unwrap(),
                k.narrow(0, a, l).unwrap().unsqueeze(0).unwrap(),
                v.narrow(0, a, l).unwrap().unsqueeze(0).unwrap(),
                BlockSelection::new(sel.indices().narrow(0, i, 1).unwrap(), BLOCK).unwrap(),
            )
        })
        .collect();
    let one_by_one = gpu::time_ms(stream, || {
        for (q, k, v, s) in &singles {
            drop(att.forward(q, k, v, s).unwrap());
        }
    });
    println!(
        "paged decode, 16 seqs of {}..{} keys, pages of {ps}: {paged:.4} ms   packed {packed:.4} ms (x{:.2})   16 single calls {one_by_one:.4} ms (x{:.2})",
        lens.iter().min().unwrap(),
        lens.iter().max().unwrap(),
        packed / paged,
        one_by_one / paged
    );
    for (imp, ms) in [
        ("fp8nsa_paged", paged),
        ("fp8nsa_packed", packed),
        ("fp8nsa_16_calls", one_by_one),
    ] {
        gpu::emit(
            &args.json,
            json!({"op": "nsa_paged_decode", "impl": imp, "b": b, "page": ps, "ms": ms, "gpu": gpu_name}),
        );
    }

    // DSA: 2048 tokens of a 64k context per query, 16 query heads on one kv head
    let (tk, n, hq) = (if args.quick { 16384 } else { 65536 }, 2048, 16);
    let q = bf(&[1, 1, hq, D]);
    let (k, v) = (bf(&[1, tk, 1, D]), bf(&[1, tk, 1, D]));
    let mut toks: Vec<i32> = (0..tk as i32).collect();
    toks.shuffle(rng);
    toks.truncate(n);
    let ranges: Vec<i32> = toks.iter().flat_map(|&t| [t, t + 1]).collect();
    let tsel = TokenSelection::new(
        Tensor::from_vec(toks, (1, 1, 1, n), &host)
            .unwrap()
            .to_device(dev)
            .unwrap(),
    )
    .unwrap();
    let rsel = SelectionRanges::new(
        Tensor::from_vec(ranges, (1, 1, 1, n, 2), &host)
            .unwrap()
            .to_device(dev)
            .unwrap(),
    )
    .unwrap();
    let tokens = gpu::time_ms(stream, || drop(att.forward(&q, &k, &v, &tsel).unwrap()));
    let as_ranges = gpu::time_ms(stream, || drop(att.forward(&q, &k, &v, &rsel).unwrap()));
    let dense = gpu::time_ms(stream, || drop(candle_dense(&q, &k, &v, None)));
    println!(
        "tokens, {n} of {tk}: {tokens:.4} ms   as {n} ranges {as_ranges:.4} ms (x{:.2})   candle dense {dense:.4} ms (x{:.2})",
        as_ranges / tokens,
        dense / tokens
    );
    for (imp, ms) in [
        ("fp8nsa_tokens", tokens),
        ("fp8nsa_ranges", as_ranges),
        ("candle_dense", dense),
    ] {
        gpu::emit(
            &args.json,
            json!({"op": "nsa_tokens_decode", "impl": imp, "tk": tk, "k": n, "ms": ms, "gpu": gpu_name}),
        );
    }
}
