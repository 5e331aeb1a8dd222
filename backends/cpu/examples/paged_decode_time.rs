//! Times the serving step's attention alone: one batched decode over paged KV
//! (`decode_attention_paged`) in SmolLM2-135M's shape (9 query heads, 3 kv heads, head size
//! 64, pages of 16 tokens handed out interleaved across the sequences, as a pool does).
//!
//! ```text
//! cargo run --release -p fp8nsa-cpu --example paged_decode_time -- [seqs] [len] [f32|f16|bf16]
//! ```
//!
//! Defaults: 16 sequences of 560 tokens, f16 pages. `LAYERS=n` (default 30, the model's) sets
//! how many layers' pools the calls rotate through: 30 of them do not fit the last-level cache
//! together, so each call reads its keys and values from memory, as a model's step does;
//! `LAYERS=1` keeps one pool in cache and times the arithmetic. Prints the best of five rounds
//! of 60 calls.

use std::time::Instant;

use fp8nsa_cpu::nsa::{decode_attention_paged, HeadMajor, KeyElem, PagedSeq};
use fp8nsa_types::AttnDims;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn run<T: KeyElem + Copy + Send + Sync>(conv: fn(f32) -> T, b: usize, len: usize) -> Res<()> {
    let (hq, hkv, d, ps) = (9, 3, 64, 16);
    let layers: usize = std::env::var("LAYERS").map_or(Ok(30), |v| v.parse())?;
    if b == 0 || len == 0 || layers == 0 {
        return Err("seqs, len and LAYERS must be at least 1".into());
    }
    let pages_per = len.div_ceil(ps);
    let rows = b * pages_per * ps;
    let mut x = 1u32;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        (x as f32 / u32::MAX as f32) - 0.5
    };
    let mut pool = |n: usize| -> Vec<Vec<T>> {
        (0..layers)
            .map(|_| (0..n).map(|_| conv(rnd())).collect())
            .collect()
    };
    let (k, v) = (pool(hkv * rows * d), pool(hkv * rows * d));
    let q: Vec<f32> = (0..b * hq * d)
        .map(|i| (i % 7) as f32 * 0.1 - 0.3)
        .collect();
    // page p of sequence s is pool page p · b + s (pages handed out as the sequences grow
    // together), or s · pages + p with `PAGES=contiguous` (each sequence's pages in a run)
    let contiguous = std::env::var("PAGES").is_ok_and(|v| v == "contiguous");
    let tables: Vec<Vec<usize>> = (0..b)
        .map(|s| {
            (0..pages_per)
                .map(|p| {
                    if contiguous {
                        s * pages_per + p
                    } else {
                        p * b + s
                    }
                })
                .collect()
        })
        .collect();
    let seqs: Vec<PagedSeq> = tables.iter().map(|t| PagedSeq { pages: t, len }).collect();
    let dims = AttnDims::new(hq, hkv, d, d)?;
    let mut out = vec![0f32; b * hq * d];
    let hm = |data| HeadMajor {
        data,
        head_stride: rows * d,
    };
    let calls = 60;
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        // on a pool thread, as a model's step calls it: from outside the pool each call would
        // also time the hand-off to it
        rayon::scope(|_| -> Result<(), fp8nsa_cpu::Error> {
            for c in 0..calls {
                let l = c % layers;
                decode_attention_paged(&q, hm(&k[l]), hm(&v[l]), dims, ps, &seqs, 0.125, &mut out)?;
            }
            Ok(())
        })?;
        best = best.min(t.elapsed().as_secs_f64() / calls as f64);
    }
    let bytes = (2 * b * len * hkv * d * std::mem::size_of::<T>()) as f64;
    println!(
        "{b} sequences x {len} tokens, {layers} pools: {:.3} ms per call ({:.1} GB/s of keys and \
         values), {:.1} ms for 30 layers",
        best * 1e3,
        bytes / best / 1e9,
        best * 30e3
    );
    Ok(())
}

fn main() -> Res<()> {
    let mut a = std::env::args().skip(1);
    let b: usize = a.next().map_or(Ok(16), |s| s.parse())?;
    let len: usize = a.next().map_or(Ok(560), |s| s.parse())?;
    match a.next().as_deref().unwrap_or("f16") {
        "f32" => run::<f32>(|x| x, b, len),
        "f16" => run::<half::f16>(half::f16::from_f32, b, len),
        "bf16" => run::<half::bf16>(half::bf16::from_f32, b, len),
        other => Err(format!("unknown element type {other}: f32, f16 or bf16").into()),
    }
}
