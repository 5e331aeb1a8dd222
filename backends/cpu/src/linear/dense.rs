//! `y = W · x` for one f32 activation row and a dense f32 weight `[n, k]`: the decode step of a
//! model whose projections (or LM head) stay f32. A general GEMM library runs this as a skinny
//! matrix product; here four weight rows at a time share each activation load, and the rows
//! [`PREFETCH_ROWS`] ahead are prefetched as one linear stream, which is what keeps a 2-core
//! machine's loads from stalling on short rows (the same reason as the fp8 GEMV's prefetch).

use rayon::prelude::*;

use crate::error::{check_len, check_positive, Result};
use crate::simd::{dot, simd_dispatch, Arith, Tier};

/// Rows ahead of the four in flight that are prefetched.
const PREFETCH_ROWS: usize = 8;

/// Weight rows per parallel task: at least ~64 KiB of weights, so the hand-off is amortized.
fn task_rows(k: usize) -> usize {
    (16384 / k.max(1)).clamp(4, 256).next_multiple_of(4)
}

/// `out [n] = w [n, k] · x [k] (+ bias)`, f32, summed in f32 with FMA where the CPU has it
/// (the order differs from a GEMM library's, so results agree to rounding, not bit for bit).
/// Returns the tier that ran.
///
/// ```
/// use fp8nsa_cpu::linear::gemv_f32;
///
/// let w = [1f32, 2.0, 3.0, 4.0, 5.0, 6.0]; // [2, 3]
/// let mut y = [0f32; 2];
/// gemv_f32(&[1.0, 0.0, -1.0], &w, 2, 3, Some(&[0.5, 0.5]), &mut y)?;
/// assert_eq!(y, [-1.5, -1.5]);
/// assert!(gemv_f32(&[1.0; 2], &w, 2, 3, None, &mut y).is_err()); // x is not [k]
/// # Ok::<(), fp8nsa_cpu::Error>(())
/// ```
pub fn gemv_f32(
    x: &[f32],
    w: &[f32],
    n: usize,
    k: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<Tier> {
    check_positive("n", n)?;
    check_positive("k", k)?;
    check_len("x", x.len(), k)?;
    let nk = n.checked_mul(k).ok_or(crate::Error::Invalid {
        arg: "n",
        msg: format!("{n} x {k} overflows"),
    })?;
    check_len("weight", w.len(), nk)?;
    check_len("out", out.len(), n)?;
    if let Some(b) = bias {
        check_len("bias", b.len(), n)?;
    }
    let tier = Tier::current();
    let rows = task_rows(k);
    out.par_chunks_mut(rows).enumerate().for_each(|(c, yt)| {
        rows_f32(tier, x, w, k, c * rows, yt);
        if let Some(b) = bias {
            for (y, b) in yt.iter_mut().zip(&b[c * rows..]) {
                *y += b;
            }
        }
    });
    Ok(tier)
}

/// `yt [rows]` for weight rows `n0..`.
fn rows_f32(tier: Tier, x: &[f32], w: &[f32], k: usize, n0: usize, yt: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma")]
        fn run(x: &[f32], w: &[f32], k: usize, n0: usize, yt: &mut [f32]) {
            let rows = yt.len();
            for r0 in (0..rows).step_by(4) {
                // a short last group repeats its last row rather than branching per row
                let n: [usize; 4] = crate::simd::lanes(|i| n0 + (r0 + i).min(rows - 1));
                let wr = crate::simd::lanes(|i| &w[n[i] * k..(n[i] + 1) * k]);
                let ahead = w
                    .as_ptr()
                    .wrapping_add((n0 + r0 + PREFETCH_ROWS) * k)
                    .cast();
                // SAFETY: this function is compiled for AVX2 + FMA, which the caller checked
                // the CPU has.
                let acc = unsafe { crate::x86::dot4_f32(x, wr, ahead) };
                let take = (rows - r0).min(4);
                yt[r0..r0 + take].copy_from_slice(&acc[..take]);
            }
        }
        if tier >= Tier::Avx2 {
            // SAFETY: `tier` came from `Tier::current()`, never above the detected tier, and
            // the AVX2 tier is only detected with AVX2, FMA and F16C present.
            return unsafe { run(x, w, k, n0, yt) };
        }
    }
    let _ = tier;
    rows_portable(x, w, k, n0, yt)
}

#[inline(always)]
fn rows_portable_impl<A: Arith>(x: &[f32], w: &[f32], k: usize, n0: usize, yt: &mut [f32]) {
    for (r, y) in yt.iter_mut().enumerate() {
        let n = n0 + r;
        *y = dot::<A>(x, &w[n * k..(n + 1) * k]);
    }
}

simd_dispatch!(fn rows_portable => rows_portable_impl(
    x: &[f32], w: &[f32], k: usize, n0: usize, yt: &mut [f32]
));

#[cfg(test)]
mod tests {
    use super::*;
    use fp8nsa_test_support::{gaussian, rng};

    /// Against f64 on shapes with tails in both dimensions (rows not a multiple of 4, k not of
    /// 16), one row, and the non-aligned N = 576, K = 3884; each tier's path, portable included.
    #[test]
    fn gemv_f32_matches_f64() {
        let mut r = rng("gemv_f32_matches_f64");
        for (n, k) in [
            (1usize, 1usize),
            (3, 17),
            (37, 300),
            (576, 3884),
            (1000, 64),
        ] {
            let (x, w, b) = (
                gaussian(&mut r, k),
                gaussian(&mut r, n * k),
                gaussian(&mut r, n),
            );
            // magnitudes over 1e-3..1e3, row by row
            let w: Vec<f32> = w
                .iter()
                .enumerate()
                .map(|(i, v)| v * 10f32.powi(((i / k) % 7) as i32 - 3))
                .collect();
            let want: Vec<f64> = (0..n)
                .map(|i| {
                    b[i] as f64
                        + (0..k)
                            .map(|j| x[j] as f64 * w[i * k + j] as f64)
                            .sum::<f64>()
                })
                .collect();
            let check = |got: &[f32], what: &str| {
                for i in 0..n {
                    let mag: f64 = (0..k)
                        .map(|j| (x[j] as f64 * w[i * k + j] as f64).abs())
                        .sum::<f64>()
                        + (b[i] as f64).abs();
                    let err = (got[i] as f64 - want[i]).abs();
                    assert!(
                        err <= 1e-5 * mag + 1e-30,
                        "{what} n {n} k {k} row {i}: {err} of {mag}"
                    );
                }
            };
            let mut y = vec![f32::NAN; n];
            gemv_f32(&x, &w, n, k, Some(&b), &mut y).unwrap();
            check(&y, "dispatched");
            let mut y = vec![f32::NAN; n];
            rows_portable(&x, &w, k, 0, &mut y);
            for (y, b) in y.iter_mut().zip(&b) {
                *y += b;
            }
            check(&y, "portable");
        }
    }

    #[test]
    fn bad_sizes_are_errors() {
        let mut y = [0f32; 2];
        for (x, w, n, k, arg) in [
            (&[1f32; 3][..], &[1f32; 6][..], 0, 3, "n"),
            (&[1f32; 3], &[1f32; 6], 2, 0, "k"),
            (&[1f32; 2], &[1f32; 6], 2, 3, "x"),
            (&[1f32; 3], &[1f32; 5], 2, 3, "weight"),
            (&[1f32; 3], &[1f32; 9], 3, 3, "out"),
        ] {
            let e = gemv_f32(x, w, n, k, None, &mut y).unwrap_err();
            assert!(
                matches!(e, crate::Error::Invalid { arg: a, .. } | crate::Error::Shape { arg: a, .. } if a == arg),
                "{arg}: {e:?}"
            );
        }
    }
}
