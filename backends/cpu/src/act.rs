//! Element-wise activations of the decoder's MLP, in one pass over memory each.

use rayon::prelude::*;

use crate::error::{check_len, Result};
use crate::simd::{exp_nonpos, simd_dispatch, Arith};

/// Elements per parallel task: a decode step's row (1536 for SmolLM2) stays on the calling
/// thread, a prefill's rows split over all of them.
pub(crate) const TASK: usize = 16 * 1024;

/// `out = silu(gate) · up` element-wise: SwiGLU's product, `silu(x) = x / (1 + e^-x)`, in one
/// pass with a vectorized exponential (Candle's `silu` then `*` makes two passes, a temporary
/// and a libm `expf` per element). Within a few ulp of the f64 value, except that below
/// `gate = -87.3` (where `e^gate` leaves f32's normal range) the sigmoid is 0: `silu(gate)`
/// is then 0 instead of a value under 1e-34 in magnitude (and `0 · ±inf` NaN where Candle
/// gives ±inf); NaN in, NaN out, and `silu(-inf) · u` is NaN as `-inf / (1 + e^inf)` is.
///
/// ```
/// use fp8nsa_cpu::act::silu_mul;
///
/// let mut out = [0f32; 3];
/// silu_mul(&[0.0, 2.0, -2.0], &[5.0, 1.0, 3.0], &mut out)?;
/// let silu = |x: f32| x / (1.0 + (-x).exp());
/// assert_eq!(out[0], 0.0);
/// assert!((out[1] - silu(2.0)).abs() < 1e-6);
/// assert!((out[2] - 3.0 * silu(-2.0)).abs() < 1e-6);
/// assert!(silu_mul(&[1.0], &[1.0, 2.0], &mut out[..1]).is_err()); // lengths differ
/// # Ok::<(), fp8nsa_cpu::Error>(())
/// ```
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()> {
    check_len("up", up.len(), gate.len())?;
    check_len("out", out.len(), gate.len())?;
    out.par_chunks_mut(TASK)
        .zip(gate.par_chunks(TASK).zip(up.par_chunks(TASK)))
        .for_each(|(o, (g, u))| silu_mul_chunk(g, u, o));
    Ok(())
}

/// `out = a + b`, element-wise, in parallel chunks on rayon's pool (the residual adds of a
/// decoder layer: Candle's own add of a large tensor runs on its separate barrier pool, whose
/// thread then spins for a while and took a core from the next kernel on a 2-core machine).
/// Exactly IEEE f32 addition, so the same bits as any other add.
///
/// ```
/// use fp8nsa_cpu::act::add;
///
/// let mut out = [0f32; 3];
/// add(&[1.0, 2.0, f32::INFINITY], &[0.5, -2.0, 1.0], &mut out)?;
/// assert_eq!(out, [1.5, 0.0, f32::INFINITY]);
/// assert!(add(&[1.0], &[1.0, 2.0], &mut out[..1]).is_err()); // lengths differ
/// # Ok::<(), fp8nsa_cpu::Error>(())
/// ```
pub fn add(a: &[f32], b: &[f32], out: &mut [f32]) -> Result<()> {
    check_len("b", b.len(), a.len())?;
    check_len("out", out.len(), a.len())?;
    out.par_chunks_mut(TASK)
        .zip(a.par_chunks(TASK).zip(b.par_chunks(TASK)))
        .for_each(|(o, (a, b))| {
            for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
                *o = a + b;
            }
        });
    Ok(())
}

/// A decoder layer's residual add and the RMSNorm that reads its result, in one pass per row:
/// `sum = x + h` (exactly IEEE f32 addition, as [`add`]) and `normed = sum / sqrt(mean(sum²) +
/// eps) · alpha` row by row (rows of `alpha.len()`), with Candle's `rms_norm` arithmetic (the
/// squares summed in order, then `s / m · alpha`): the same bits as [`add`] followed by Candle's
/// `rms_norm`, in one call instead of two ops and their hand-offs.
///
/// ```
/// use fp8nsa_cpu::act::add_rms_norm;
///
/// let (mut sum, mut normed) = ([0f32; 2], [0f32; 2]);
/// add_rms_norm(&[1.0, 2.0], &[2.0, 2.0], &[1.0, 0.5], 0.0, &mut sum, &mut normed)?;
/// assert_eq!(sum, [3.0, 4.0]);
/// let m = (12.5f32).sqrt(); // mean of 9 and 16
/// assert_eq!(normed, [3.0 / m * 1.0, 4.0 / m * 0.5]);
/// assert!(add_rms_norm(&[1.0; 3], &[1.0; 3], &[1.0; 2], 0.0, &mut [0.0; 3], &mut [0.0; 3]).is_err());
/// # Ok::<(), fp8nsa_cpu::Error>(())
/// ```
pub fn add_rms_norm(
    x: &[f32],
    h: &[f32],
    alpha: &[f32],
    eps: f32,
    sum: &mut [f32],
    normed: &mut [f32],
) -> Result<()> {
    let n = alpha.len();
    check_len("h", h.len(), x.len())?;
    check_len("sum", sum.len(), x.len())?;
    check_len("normed", normed.len(), x.len())?;
    if n == 0 || !x.len().is_multiple_of(n) {
        return Err(crate::Error::Invalid {
            arg: "alpha",
            msg: format!("rows of {n} do not tile {} values", x.len()),
        });
    }
    // whole rows per task: a decode step's row stays on the calling thread
    let per = n * (TASK / n).max(1);
    x.par_chunks(per)
        .zip(h.par_chunks(per))
        .zip(sum.par_chunks_mut(per).zip(normed.par_chunks_mut(per)))
        .for_each(|((x, h), (sum, normed))| {
            let rows = x.chunks_exact(n).zip(h.chunks_exact(n));
            let outs = sum.chunks_exact_mut(n).zip(normed.chunks_exact_mut(n));
            for ((x, h), (s, o)) in rows.zip(outs) {
                for ((s, &x), &h) in s.iter_mut().zip(x).zip(h) {
                    *s = x + h;
                }
                let sum2 = s.iter().map(|&v| v * v).sum::<f32>();
                let m = (sum2 / n as f32 + eps).sqrt();
                for ((o, &v), &a) in o.iter_mut().zip(s.iter()).zip(alpha) {
                    *o = v / m * a;
                }
            }
        });
    Ok(())
}

simd_dispatch!(fn silu_mul_chunk => silu_mul_impl(g: &[f32], u: &[f32], o: &mut [f32]));

#[inline(always)]
fn silu_mul_impl<A: Arith>(g: &[f32], u: &[f32], o: &mut [f32]) {
    for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
        // the sigmoid from e^-|g| <= 1, so the exponential never overflows: 1 / (1 + z) for
        // g >= 0, z / (1 + z) below (NaN takes the second arm and stays NaN)
        let z = exp_nonpos(-g.abs());
        let s = if g >= 0.0 {
            1.0 / (1.0 + z)
        } else {
            z / (1.0 + z)
        };
        *o = g * s * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against f64 row by row (one row, a few, and enough for the parallel split; magnitudes
    /// over 1e-3..1e3 per row), the sum exact; a NaN in a row makes that row's norm NaN only;
    /// rows that do not tile, or buffers of the wrong length, are typed errors.
    #[test]
    fn add_rms_norm_matches_f64() {
        use fp8nsa_test_support::{gaussian, rng};
        let mut r = rng("add_rms_norm_matches_f64");
        let n = 576;
        for rows in [1usize, 3, TASK / n + 5] {
            let scale = |v: Vec<f32>| -> Vec<f32> {
                v.iter()
                    .enumerate()
                    .map(|(i, x)| x * 10f32.powi(((i / n) % 7) as i32 - 3))
                    .collect()
            };
            let (mut x, h) = (
                scale(gaussian(&mut r, rows * n)),
                scale(gaussian(&mut r, rows * n)),
            );
            let alpha = gaussian(&mut r, n);
            x[n / 2] = f32::NAN; // row 0 only
            let (mut sum, mut normed) = (vec![0f32; rows * n], vec![0f32; rows * n]);
            add_rms_norm(&x, &h, &alpha, 1e-5, &mut sum, &mut normed).unwrap();
            for row in 0..rows {
                let s: Vec<f64> = (0..n)
                    .map(|j| x[row * n + j] as f64 + h[row * n + j] as f64)
                    .collect();
                let m = (s.iter().map(|v| v * v).sum::<f64>() / n as f64 + 1e-5).sqrt();
                for j in 0..n {
                    let i = row * n + j;
                    assert_eq!(sum[i].to_bits(), (x[i] + h[i]).to_bits());
                    if row == 0 {
                        assert!(normed[i].is_nan(), "row 0 holds a NaN");
                        continue;
                    }
                    let want = s[j] / m * alpha[j] as f64;
                    assert!(
                        (normed[i] as f64 - want).abs()
                            <= 1e-5 * (want.abs() + alpha[j].abs() as f64),
                        "rows {rows} row {row} col {j}: {} vs {want}",
                        normed[i]
                    );
                }
            }
        }
        let mut o = [0f32; 4];
        let e = add_rms_norm(&[1.0; 4], &[1.0; 4], &[1.0; 3], 0.0, &mut [0.0; 4], &mut o);
        assert!(
            matches!(e, Err(crate::Error::Invalid { arg: "alpha", .. })),
            "{e:?}"
        );
        let e = add_rms_norm(&[1.0; 4], &[1.0; 3], &[1.0; 2], 0.0, &mut [0.0; 4], &mut o);
        assert!(
            matches!(e, Err(crate::Error::Shape { arg: "h", .. })),
            "{e:?}"
        );
        let e = add_rms_norm(
            &[1.0; 4],
            &[1.0; 4],
            &[1.0; 2],
            0.0,
            &mut [0.0; 4],
            &mut o[..2],
        );
        assert!(
            matches!(e, Err(crate::Error::Shape { arg: "normed", .. })),
            "{e:?}"
        );
    }

    /// Against f64 over gates to about ±160 (through the exponential's underflow), around 0,
    /// and the special values; lengths across the parallel split and the SIMD tail.
    #[test]
    fn silu_mul_matches_f64() {
        use fp8nsa_test_support::{gaussian, rng};
        let mut r = rng("silu_mul_matches_f64");
        for n in [1usize, 7, 8, 1000, TASK + 13] {
            let g: Vec<f32> = gaussian(&mut r, n)
                .iter()
                .enumerate()
                .map(|(i, x)| x * [0.01f32, 1.0, 8.0, 40.0][i % 4])
                .collect();
            let u = gaussian(&mut r, n);
            let mut out = vec![f32::NAN; n];
            silu_mul(&g, &u, &mut out).unwrap();
            for ((&o, &g), &u) in out.iter().zip(&g).zip(&u) {
                let (g64, u64) = (g as f64, u as f64);
                let want = g64 / (1.0 + (-g64).exp()) * u64;
                assert!(
                    (o as f64 - want).abs() <= 4.0 * f32::EPSILON as f64 * want.abs() + 1e-34,
                    "silu({g}) * {u}: {o} vs {want}"
                );
            }
        }
        let g = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -100.0,
            100.0,
            -0.0,
        ];
        let mut out = [0f32; 6];
        silu_mul(&g, &[2.0; 6], &mut out).unwrap();
        assert!(out[0].is_nan() && out[2].is_nan(), "{out:?}");
        assert_eq!(out[1], f32::INFINITY);
        assert_eq!(out[4], 200.0);
        assert!(out[3] <= 0.0 && out[3] > -1e-40, "{out:?}");
        assert_eq!(out[5], 0.0);
        let r = silu_mul(&[1.0; 4], &[1.0; 4], &mut [0.0; 3]);
        assert!(
            matches!(r, Err(crate::Error::Shape { arg: "out", .. })),
            "{r:?}"
        );
    }
}
