//! Times the dense f32 GEMV alone (`linear::gemv_f32`, the decode step of f32 projections and of
//! an f32 LM head): its rate in bytes of weights per second, to compare against the machine's
//! memory bandwidth when the weight is larger than the last-level cache (SmolLM2's head is
//! 49152 x 576, 113 MB).
//!
//! ```text
//! cargo run --release -p fp8nsa-cpu --example gemv_f32_time -- N K [WEIGHTS]
//! ```
//!
//! `WEIGHTS` (default 1) distinct weights are cycled through, across rounds. Prints the best of
//! five rounds of 20 calls, each round run on a rayon worker (as a model's step runs).

use std::time::Instant;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> Res<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;
    let (n, k, nw) = match args[..] {
        [n, k] => (n, k, 1),
        [n, k, w] => (n, k, w),
        _ => return Err("usage: gemv_f32_time N K [WEIGHTS]".into()),
    };
    if nw == 0 {
        return Err("WEIGHTS must be at least 1".into());
    }
    let ws: Vec<Vec<f32>> = (0..nw)
        .map(|s| {
            (0..n * k)
                .map(|i| ((i + s) % 97) as f32 * 0.01 - 0.48)
                .collect()
        })
        .collect();
    let x: Vec<f32> = (0..k).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect();
    let mut y = vec![0f32; n];
    let calls = 20;
    let mut best = f64::MAX;
    for round in 0..5 {
        let t = Instant::now();
        rayon::scope(|_| -> Result<(), fp8nsa_cpu::Error> {
            for c in 0..calls {
                // every round goes on through the weights, so that more of them than one
                // round's calls keep them out of cache
                let w = &ws[(round * calls + c) % nw];
                fp8nsa_cpu::linear::gemv_f32(&x, w, n, k, None, &mut y)?;
            }
            Ok(())
        })?;
        best = best.min(t.elapsed().as_secs_f64() / calls as f64);
    }
    println!(
        "N {n} K {k}, {nw} weights: {:.3} ms, {:.1} GB/s of weights",
        best * 1e3,
        (n * k * 4) as f64 / best / 1e9
    );
    Ok(())
}
