//! DeepSeek-V3.2's lightning indexer scores on the host: for each query token, every key's
//! `Σ_h w[h] · relu(q[h] · k)`, one pass over the keys.
//!
//! As a matrix product this is `[T·H, D] x [D, Tk]`, a ReLU, then `[T, 1, H] x [T, H, Tk]`:
//! at decode (T = 1, a handful of heads) the product is a skinny one that a GEMM library runs
//! well below the memory rate, and the `[H, Tk]` intermediate makes two more passes. Here each
//! key row is read once, dotted with every head's query while it is in cache, and its score
//! written; tasks take runs of keys.

use rayon::prelude::*;

use crate::error::{check_len, check_positive, Result};
use crate::simd::{dot, simd_dispatch, Arith};

/// Keys per parallel task.
const TASK_KEYS: usize = 256;

/// `out [t, tk]`: `out[i][s] = Σ_h w[i][h] · max(0, q[i][h] · k[s])` for `q [t, h, d]`,
/// `w [t, h]`, `k [tk, d]` (f32, row-major). Every key is scored for every query; causality
/// is the caller's.
///
/// ```
/// use fp8nsa_cpu::dsa::index_scores;
///
/// // one query with two heads, weights 1 and 2; two keys of dimension 2
/// let (q, w, k) = ([1f32, 0.0, 0.0, 1.0], [1f32, 2.0], [3f32, -1.0, -2.0, 5.0]);
/// let mut out = [0f32; 2];
/// index_scores(&q, &w, &k, 1, 2, 2, 2, &mut out)?;
/// // key 0: relu(3) + 2 relu(-1) = 3; key 1: relu(-2) + 2 relu(5) = 10
/// assert_eq!(out, [3.0, 10.0]);
/// # Ok::<(), fp8nsa_cpu::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn index_scores(
    q: &[f32],
    w: &[f32],
    k: &[f32],
    t: usize,
    h: usize,
    d: usize,
    tk: usize,
    out: &mut [f32],
) -> Result<()> {
    check_positive("t", t)?;
    check_positive("heads", h)?;
    check_positive("d", d)?;
    check_len("q", q.len(), t * h * d)?;
    check_len("w", w.len(), t * h)?;
    check_len("keys", k.len(), tk * d)?;
    check_len("out", out.len(), t * tk)?;
    if tk == 0 {
        return Ok(());
    }
    for i in 0..t {
        let (qi, wi) = (&q[i * h * d..(i + 1) * h * d], &w[i * h..(i + 1) * h]);
        out[i * tk..(i + 1) * tk]
            .par_chunks_mut(TASK_KEYS)
            .enumerate()
            .for_each(|(c, o)| {
                let k0 = c * TASK_KEYS;
                score_keys(qi, wi, &k[k0 * d..(k0 + o.len()) * d], d, o)
            });
    }
    Ok(())
}

#[inline(always)]
fn score_keys_impl<A: Arith>(q: &[f32], w: &[f32], k: &[f32], d: usize, out: &mut [f32]) {
    for (o, key) in out.iter_mut().zip(k.chunks_exact(d)) {
        let mut s = 0f32;
        for (qh, &wh) in q.chunks_exact(d).zip(w) {
            s += wh * dot::<A>(qh, key).max(0.0);
        }
        *o = s;
    }
}

simd_dispatch!(fn score_keys => score_keys_impl(
    q: &[f32], w: &[f32], k: &[f32], d: usize, out: &mut [f32]
));

#[cfg(test)]
mod tests {
    use super::*;
    use fp8nsa_test_support::{gaussian, rng};

    /// Against f64 on shapes with tails (d not a multiple of 16, key counts across task
    /// boundaries), several queries, one key; bad lengths are errors.
    #[test]
    fn index_scores_match_f64() {
        let mut r = rng("index_scores_match_f64");
        for (t, h, d, tk) in [
            (1usize, 1usize, 1usize, 1usize),
            (1, 8, 128, 1000),
            (3, 5, 37, 257),
        ] {
            let (q, w, k) = (
                gaussian(&mut r, t * h * d),
                gaussian(&mut r, t * h),
                gaussian(&mut r, tk * d),
            );
            let mut out = vec![0f32; t * tk];
            index_scores(&q, &w, &k, t, h, d, tk, &mut out).unwrap();
            for i in 0..t {
                for s in 0..tk {
                    let want: f64 = (0..h)
                        .map(|hh| {
                            let dot: f64 = (0..d)
                                .map(|j| q[(i * h + hh) * d + j] as f64 * k[s * d + j] as f64)
                                .sum();
                            w[i * h + hh] as f64 * dot.max(0.0)
                        })
                        .sum();
                    let scale: f64 = (0..h).map(|hh| w[i * h + hh].abs() as f64).sum::<f64>()
                        * (d as f64).sqrt();
                    let got = out[i * tk + s] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * scale,
                        "{t} {h} {d} {tk}: {got} vs {want}"
                    );
                }
            }
        }
        let mut out = [0f32; 2];
        assert!(index_scores(&[0.0; 3], &[1.0], &[0.0; 4], 1, 1, 2, 2, &mut out).is_err());
    }
}
