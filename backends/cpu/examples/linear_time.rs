//! Times one W8A8 `Fp8Linear` product alone (`linear::plan` + `LinearPlan::run`, 128 x 128
//! blocks, activations quantized per 1 x 128 group), to see a kernel's cost without a model
//! around it: which path runs, and its rate in codes and in flops.
//!
//! ```text
//! cargo run --release -p fp8nsa-cpu --example linear_time -- M N K [WEIGHTS]
//! ```
//!
//! `WEIGHTS` (default 1) distinct weights are cycled through: 1 keeps the weight in cache and
//! times the arithmetic; enough of them to exceed the last-level cache (e.g. 100 of
//! 1536 x 576) read each call's codes from memory, as a model's step does. Prints the best of
//! five rounds of 40 calls (`CALLS=n` for n, e.g. many more under `perf`). `TIER=avx2` (or
//! `avx512`, `portable`) caps the SIMD tier, to time a lower tier's kernels on this CPU.

use std::time::Instant;

use fp8nsa_cpu::linear::plan;
use fp8nsa_types::{ActQuant, LinearShape, Tier};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> Res<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;
    let (m, n, k, nw) = match args[..] {
        [m, n, k] => (m, n, k, 1),
        [m, n, k, w] => (m, n, k, w),
        _ => return Err("usage: linear_time M N K [WEIGHTS]".into()),
    };
    if nw == 0 {
        return Err("WEIGHTS must be at least 1".into());
    }
    if let Ok(t) = std::env::var("TIER") {
        let tier = match t.as_str() {
            "portable" => Tier::Portable,
            "avx2" => Tier::Avx2,
            "avx512" => Tier::Avx512,
            _ => return Err(format!("TIER={t}: portable, avx2 or avx512").into()),
        };
        Tier::cap(tier);
    }
    let p = plan(LinearShape::new(m, n, k, 128, 128)?, ActQuant::Group)?;
    let mut x = 0x9e37_79b9u32;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x
    };
    // random finite codes (0x7f / 0xff are NaN)
    let ws: Vec<Vec<u8>> = (0..nw)
        .map(|_| {
            (0..n * k)
                .map(|_| match (rnd() & 0xff) as u8 {
                    c if c & 0x7f == 0x7f => 0,
                    c => c,
                })
                .collect()
        })
        .collect();
    let sw = vec![0.01f32; n.div_ceil(128) * k.div_ceil(128)];
    let xs: Vec<f32> = (0..m * k)
        .map(|_| (rnd() % 1000) as f32 * 0.001 - 0.5)
        .collect();
    let mut y = vec![0f32; m * n];
    let calls: usize = std::env::var("CALLS").map_or(Ok(40), |v| v.parse())?;
    let mut best = f64::MAX;
    for round in 0..5 {
        let t = Instant::now();
        // on a pool thread, as a model's step runs its products: a call from outside the pool
        // would time the hand-off to a sleeping pool instead
        rayon::scope(|_| -> Result<(), fp8nsa_cpu::Error> {
            for c in 0..calls {
                // every round goes on through the weights, so that more of them than one
                // round's calls keep them out of cache
                p.run(&xs, &ws[(round * calls + c) % nw], &sw, None, &mut y)?;
            }
            Ok(())
        })?;
        best = best.min(t.elapsed().as_secs_f64() / calls as f64);
    }
    println!(
        "M {m} N {n} K {k}, {nw} weights, {:?}: {:.4} ms, {:.1} GB/s of codes, {:.0} GFLOP/s",
        p.path(),
        best * 1e3,
        (n * k) as f64 / best / 1e9,
        2.0 * (m * n * k) as f64 / best / 1e9
    );
    Ok(())
}
