//! Grouped fp8 GEMM for mixture-of-experts layers: `E` expert weights `[E, N, K]` (e4m3 codes)
//! with block scales `[E, ceil(N/bn), ceil(K/bk)]`, and token rows grouped by expert (the
//! "contiguous" layout: expert `e` takes the next `counts[e]` rows of `x`).
//!
//! Decode sends a few rows to each of a few experts: every such expert's GEMV runs as tasks of
//! **one** parallel region, one pass over each routed expert's weight rows. An expert with more
//! than [`GEMV_MAX_M`] rows (prefill) runs the panel GEMM of [`crate::linear`] on its own.

use rayon::prelude::*;

use crate::error::{check_len, check_positive, Result};
use crate::linear::{
    gemv_bf16_act, gemv_task, gemv_task_rows, gemv_wants_scaled_act, plan, untranspose, GemvAct,
    GEMV_MAX_M,
};
use crate::quant::{quantize_act_in, QuantizedAct};
use crate::scratch::with_f32;
use crate::simd::Tier;
pub use fp8nsa_types::ExpertsShape;
use fp8nsa_types::{ActQuant, LinearShape};

/// The experts' weights: codes `[e, n, k]`, scales `[e, ceil(n/bn), ceil(k/bk)]`, and whether no
/// code is NaN (as [`crate::linear::LinearPlan::assume_nan_free`], for all experts).
#[derive(Clone, Copy, Debug)]
pub struct ExpertWeights<'a> {
    pub codes: &'a [u8],
    pub scales: &'a [f32],
    pub nan_free: bool,
}

/// `out [T, n]`: row `t` of `x [T, k]` times expert `e`'s dequantized weight, where `e` is the
/// group row `t` falls in (`counts [e]`, summing to `T`; empty groups allowed). Activations are
/// quantized per `act` within each expert's group, as `e` separate
/// [`crate::linear::fp8_linear`] calls would.
///
/// ```
/// use fp8nsa_cpu::experts::{grouped, ExpertWeights, ExpertsShape};
/// use fp8nsa_types::ActQuant;
///
/// // two experts of [1, 2]: expert 0 doubles the sum, expert 1 negates it (codes 1.0 / -1.0)
/// let s = ExpertsShape::new(2, 1, 2, 128, 128)?;
/// let w = [0x38, 0x38, 0xb8, 0xb8];
/// let sw = [2.0, 1.0];
/// let mut out = [0f32; 3];
/// let weights = ExpertWeights { codes: &w, scales: &sw, nan_free: true };
/// grouped(&[1.0, 2.0, 3.0, 4.0, 0.5, 0.5], &[1, 2], weights, s, ActQuant::None, &mut out)?;
/// assert_eq!(out, [6.0, -7.0, -1.0]);
/// # Ok::<(), fp8nsa_cpu::Error>(())
/// ```
pub fn grouped(
    x: &[f32],
    counts: &[usize],
    weights: ExpertWeights<'_>,
    s: ExpertsShape,
    act: ActQuant,
    out: &mut [f32],
) -> Result<()> {
    let ExpertWeights {
        codes: w,
        scales: sw,
        nan_free,
    } = weights;
    if let ActQuant::Block2d { bm } = act {
        check_positive("bm", bm)?;
    }
    let t = s.routed_rows(counts)?;
    check_len("x", x.len(), t * s.k())?;
    check_len("weight", w.len(), s.e() * s.n() * s.k())?;
    check_len("weight scales", sw.len(), s.e() * s.scales_per_expert())?;
    check_len("out", out.len(), t * s.n())?;
    let (nk, spe) = (s.n() * s.k(), s.scales_per_expert());
    let starts: Vec<usize> = counts
        .iter()
        .scan(0, |acc, &c| {
            let r = *acc;
            *acc += c;
            Some(r)
        })
        .collect();
    // prefill-sized groups: the panel GEMM, one expert at a time, each parallel inside
    for (e, (&m, &r0)) in counts.iter().zip(&starts).enumerate() {
        if m > GEMV_MAX_M {
            plan(s.linear(m)?, act)?.assume_nan_free(nan_free).run(
                &x[r0 * s.k()..(r0 + m) * s.k()],
                &w[e * nk..(e + 1) * nk],
                &sw[e * spe..(e + 1) * spe],
                None,
                &mut out[r0 * s.n()..(r0 + m) * s.n()],
            )?;
        }
    }
    let small: Vec<(usize, usize, usize, LinearShape)> = counts
        .iter()
        .zip(&starts)
        .enumerate()
        .filter(|(_, (&m, _))| m > 0 && m <= GEMV_MAX_M)
        .map(|(e, (&m, &r0))| Ok((e, m, r0, s.linear(m)?.fitted())))
        .collect::<Result<_>>()?;
    if small.is_empty() {
        return Ok(());
    }
    // read once: a concurrent `Tier::cap` must not change the path mid-call
    let tier = Tier::current();
    let rows_small: usize = small.iter().map(|&(_, m, _, _)| m).sum();
    with_f32(rows_small * s.k(), |abuf| -> Result<()> {
        with_f32(rows_small * s.n(), |ybuf| -> Result<()> {
            // each small expert's quantized rows and transposed output yt [n, m], carved from
            // the two buffers
            let mut acts: Vec<QuantizedAct<'_>> = Vec::with_capacity(small.len());
            let mut yts: Vec<&mut [f32]> = Vec::with_capacity(small.len());
            let (mut arest, mut yrest) = (&mut abuf[..], &mut ybuf[..]);
            for &(_, m, r0, _) in &small {
                let (a, ar) = std::mem::take(&mut arest).split_at_mut(m * s.k());
                let (y, yr) = std::mem::take(&mut yrest).split_at_mut(m * s.n());
                (arest, yrest) = (ar, yr);
                let deq = gemv_wants_scaled_act(tier, m, act);
                let xe = &x[r0 * s.k()..(r0 + m) * s.k()];
                acts.push(quantize_act_in(xe, m, s.k(), s.bk(), act, deq, a)?);
                yts.push(y);
            }
            let xbs: Vec<Option<Vec<u16>>> = small
                .iter()
                .zip(&acts)
                .map(|(&(_, _, _, shape), xq)| gemv_bf16_act(tier, xq, act, shape))
                .collect();
            // every task of every small expert in one parallel region
            let mut tasks = Vec::new();
            for ((i, &(e, m, _, _)), yt) in small.iter().enumerate().zip(yts) {
                let rows = gemv_task_rows(tier, m);
                for (c, chunk) in yt.chunks_mut(rows * m).enumerate() {
                    tasks.push((i, e, c * rows, chunk));
                }
            }
            tasks.into_par_iter().for_each(|(i, e, n0, yt)| {
                let shape = small[i].3;
                gemv_task(
                    tier,
                    GemvAct {
                        q: &acts[i],
                        bf16: xbs[i].as_deref(),
                    },
                    &w[e * nk..(e + 1) * nk],
                    &sw[e * spe..(e + 1) * spe],
                    shape,
                    n0,
                    yt,
                    nan_free,
                )
            });
            let mut off = 0;
            for &(_, m, r0, _) in &small {
                let yt = &ybuf[off..off + m * s.n()];
                untranspose(yt, m, &mut out[r0 * s.n()..(r0 + m) * s.n()]);
                off += m * s.n();
            }
            Ok(())
        })?;
        Ok(())
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::linear::fp8_linear;
    use crate::quant::quantize_weight;

    /// One grouped call equals one `fp8_linear` per expert on its rows, bit for bit: the same
    /// kernels on the same quantized rows, only scheduled together.
    #[test]
    fn grouped_equals_one_linear_per_expert() {
        let s = ExpertsShape::new(5, 43, 300, 16, 128).unwrap();
        let (mut w, mut sw) = (Vec::new(), Vec::new());
        for e in 0..s.e() {
            let we: Vec<f32> = (0..s.n() * s.k())
                .map(|i| ((i * 31 + e * 7) % 97) as f32 - 48.0)
                .map(|v| v * 10f32.powi((e % 3) as i32 - 1))
                .collect();
            let (q, sc) = quantize_weight(&we, s.n(), s.k(), s.bn(), s.bk()).unwrap();
            w.extend(q);
            sw.extend(sc);
        }
        let counts = [0, 1, 3, GEMV_MAX_M + 4, 2];
        let t: usize = counts.iter().sum();
        let x: Vec<f32> = (0..t * s.k())
            .map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.1)
            .collect();
        for act in [ActQuant::Group, ActQuant::None, ActQuant::Block2d { bm: 2 }] {
            let mut got = vec![f32::NAN; t * s.n()];
            let weights = ExpertWeights {
                codes: &w,
                scales: &sw,
                nan_free: true,
            };
            grouped(&x, &counts, weights, s, act, &mut got).unwrap();
            let mut r0 = 0;
            for (e, &m) in counts.iter().enumerate() {
                if m == 0 {
                    continue;
                }
                let shape = s.linear(m).unwrap();
                let (nk, spe) = (s.n() * s.k(), s.scales_per_expert());
                let mut want = vec![0f32; m * s.n()];
                fp8_linear(
                    &x[r0 * s.k()..(r0 + m) * s.k()],
                    &w[e * nk..(e + 1) * nk],
                    &sw[e * spe..(e + 1) * spe],
                    None,
                    shape,
                    act,
                    &mut want,
                )
                .unwrap();
                assert_eq!(
                    &got[r0 * s.n()..(r0 + m) * s.n()],
                    &want[..],
                    "{act:?} expert {e}"
                );
                r0 += m;
            }
        }
    }

    #[test]
    fn bad_calls_are_errors() {
        let s = ExpertsShape::new(2, 1, 2, 1, 1).unwrap();
        let (w, sw) = ([0x38u8; 4], [1.0f32; 4]);
        let mut out = [0f32; 2];
        let g = |x: &[f32], counts: &[usize], out: &mut [f32]| {
            let weights = ExpertWeights {
                codes: &w,
                scales: &sw,
                nan_free: false,
            };
            grouped(x, counts, weights, s, ActQuant::Group, out)
        };
        // a count per expert: the routing check every backend shares (ExpertsShape)
        assert!(matches!(
            g(&[1.0; 4], &[1], &mut out),
            Err(Error::Invalid { arg: "counts", .. })
        ));
        assert!(matches!(
            g(&[], &[0, 0], &mut []),
            Err(Error::Invalid { arg: "counts", .. })
        ));
        assert!(matches!(
            g(&[1.0; 2], &[1, 1], &mut out),
            Err(Error::Shape { arg: "x", .. })
        ));
        assert!(matches!(
            g(&[1.0; 4], &[1, 1], &mut out[..1]),
            Err(Error::Shape { arg: "out", .. })
        ));
        g(&[1.0; 4], &[2, 0], &mut out).unwrap();
        assert_eq!(out, [2.0, 2.0]);
    }
}
