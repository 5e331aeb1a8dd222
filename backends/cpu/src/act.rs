//! Element-wise activations of the decoder's MLP, in one pass over memory each.

use rayon::prelude::*;

use crate::error::{check_len, Result};
use crate::simd::{exp_nonpos, simd_dispatch, Arith};

/// Elements per parallel task: a decode step's row (1536 for SmolLM2) stays on the calling
/// thread, a prefill's rows split over all of them.
const TASK: usize = 16 * 1024;

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
