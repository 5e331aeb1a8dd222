//! Rotary position embeddings on token-major rows, each token at its own position.

use fp8nsa_types::RopeStyle;
use rayon::prelude::*;

use crate::act::TASK;
use crate::error::{check_len, check_positive, Error, Result};

/// `out [t, h, d]` = `x [t, h, d]` (token-major, as a projection gives it) with each head of
/// token `i` rotated by the angles of position `pos[i]`: `cos` / `sin` are `[positions, d/2]`
/// tables, row `p` the cosines and sines of position `p`. Dimension `j` pairs with `j + d/2`
/// ([`RopeStyle::Half`]) or with its neighbour ([`RopeStyle::Interleaved`]); each pair `(a, b)`
/// becomes `(a·cos - b·sin, a·sin + b·cos)`, Candle's `rope` / `rope_i` arithmetic (the same
/// bits), with no transposed copy on either side and any position per token (a ragged batch's
/// sequences in one call). A position past the tables, an odd `d` or a table whose length is
/// not a whole number of rows is [`Error::Invalid`].
///
/// ```
/// use fp8nsa_cpu::rope::rope;
/// use fp8nsa_types::RopeStyle;
///
/// // one head of 2 dimensions; position 1 turns by 90 degrees
/// let (cos, sin) = ([1f32, 0.0], [0f32, 1.0]);
/// let mut out = [0f32; 4];
/// rope(&[1.0, 2.0, 1.0, 2.0], 1, 2, &[0, 1], &cos, &sin, RopeStyle::Half, &mut out)?;
/// assert_eq!(out, [1.0, 2.0, -2.0, 1.0]);
/// assert!(rope(&[1.0, 2.0], 1, 2, &[2], &cos, &sin, RopeStyle::Half, &mut out[..2]).is_err());
/// # Ok::<(), fp8nsa_cpu::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn rope(
    x: &[f32],
    h: usize,
    d: usize,
    pos: &[usize],
    cos: &[f32],
    sin: &[f32],
    style: RopeStyle,
    out: &mut [f32],
) -> Result<()> {
    check_positive("h", h)?;
    check_positive("d", d)?;
    if !d.is_multiple_of(2) {
        return Err(Error::Invalid {
            arg: "d",
            msg: format!("{d} dimensions do not pair"),
        });
    }
    let half = d / 2;
    let row = h * d;
    check_len("x", x.len(), pos.len() * row)?;
    check_len("out", out.len(), x.len())?;
    check_len("sin", sin.len(), cos.len())?;
    if !cos.len().is_multiple_of(half) {
        return Err(Error::Invalid {
            arg: "cos",
            msg: format!("{} values are not rows of {half}", cos.len()),
        });
    }
    let rows = cos.len() / half;
    if let Some(&p) = pos.iter().find(|&&p| p >= rows) {
        return Err(Error::Invalid {
            arg: "pos",
            msg: format!("position {p} is past the tables' {rows} positions"),
        });
    }
    // whole tokens per task: a decode step's rows stay on the calling thread
    let tokens = (TASK / row).max(1);
    let per = tokens * row;
    x.par_chunks(per)
        .zip(out.par_chunks_mut(per))
        .enumerate()
        .for_each(|(t, (x, o))| {
            for (i, (x, o)) in x.chunks_exact(row).zip(o.chunks_exact_mut(row)).enumerate() {
                let p = pos[t * tokens + i];
                let (c, s) = (
                    &cos[p * half..(p + 1) * half],
                    &sin[p * half..(p + 1) * half],
                );
                for (x, o) in x.chunks_exact(d).zip(o.chunks_exact_mut(d)) {
                    rotate_head(x, c, s, style, o);
                }
            }
        });
    Ok(())
}

/// One head's `o = x` rotated by the angles whose cosines and sines are `c` / `s` (`d / 2`
/// each), pairs as `style` says. Zipped iterators, no indexing: the loops vectorize.
fn rotate_head(x: &[f32], c: &[f32], s: &[f32], style: RopeStyle, o: &mut [f32]) {
    match style {
        RopeStyle::Half => {
            let (x1, x2) = x.split_at(c.len());
            let (o1, o2) = o.split_at_mut(c.len());
            let pairs = o1.iter_mut().zip(o2.iter_mut()).zip(x1.iter().zip(x2));
            for (((o1, o2), (&a, &b)), (&c, &s)) in pairs.zip(c.iter().zip(s)) {
                *o1 = a * c - b * s;
                *o2 = a * s + b * c;
            }
        }
        RopeStyle::Interleaved => {
            let pairs = o.chunks_exact_mut(2).zip(x.chunks_exact(2));
            for ((o, x), (&c, &s)) in pairs.zip(c.iter().zip(s)) {
                let (a, b) = (x[0], x[1]);
                o[0] = a * c - b * s;
                o[1] = a * s + b * c;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fp8nsa_test_support::{gaussian, rng};

    /// Against f64 rotations of fresh random rows at scattered positions (both pairings, a
    /// decode-sized call and a prefill-sized one that runs in parallel); bad arguments are
    /// typed errors naming the argument.
    #[test]
    fn rope_matches_f64_at_any_positions() {
        let mut r = rng("rope_matches_f64_at_any_positions");
        let (h, d, len) = (3usize, 64usize, 700usize);
        let half = d / 2;
        let ang: Vec<f64> = (0..len * half)
            .map(|i| (i / half) as f64 * 10000f64.powf(-((i % half) as f64) / half as f64))
            .collect();
        let cos: Vec<f32> = ang.iter().map(|a| a.cos() as f32).collect();
        let sin: Vec<f32> = ang.iter().map(|a| a.sin() as f32).collect();
        for t in [1usize, 5, 300] {
            let pos: Vec<usize> = (0..t).map(|i| (i * 37 + 11) % len).collect();
            let x = gaussian(&mut r, t * h * d);
            for style in [RopeStyle::Half, RopeStyle::Interleaved] {
                let mut out = vec![f32::NAN; x.len()];
                rope(&x, h, d, &pos, &cos, &sin, style, &mut out).unwrap();
                for (i, &p) in pos.iter().enumerate() {
                    for hh in 0..h {
                        let at = (i * h + hh) * d;
                        for j in 0..half {
                            let (a, b) = match style {
                                RopeStyle::Half => (at + j, at + j + half),
                                RopeStyle::Interleaved => (at + 2 * j, at + 2 * j + 1),
                            };
                            let (c, s) = (cos[p * half + j] as f64, sin[p * half + j] as f64);
                            let (xa, xb) = (x[a] as f64, x[b] as f64);
                            for (got, want) in
                                [(out[a], xa * c - xb * s), (out[b], xa * s + xb * c)]
                            {
                                assert!(
                                    (got as f64 - want).abs() < 1e-5 * (1.0 + want.abs()),
                                    "t {t} {style:?} token {i} head {hh} pair {j}: {got} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
        let mut out = [0f32; 6];
        let ok = |x: &[f32], h, d, pos: &[usize], out: &mut [f32]| {
            rope(x, h, d, pos, &cos, &sin, RopeStyle::Half, out)
        };
        for (e, arg) in [
            (ok(&[0.0; 6], 1, 3, &[0, 1], &mut out), "d"),
            (ok(&[0.0; 6], 0, 2, &[0, 1, 2], &mut out), "h"),
            (ok(&[0.0; 6], 1, 2, &[0, 1], &mut out), "x"),
            (ok(&[0.0; 6], 1, 2, &[0, 1, cos.len()], &mut out), "pos"),
            (ok(&[0.0; 4], 1, 2, &[0, 1], &mut out), "out"),
            (
                rope(
                    &[0.0; 2],
                    1,
                    2,
                    &[0],
                    &cos,
                    &sin[1..],
                    RopeStyle::Half,
                    &mut out[..2],
                ),
                "sin",
            ),
            (
                rope(
                    &[0.0; 4],
                    1,
                    4,
                    &[0],
                    &cos[1..],
                    &sin[1..],
                    RopeStyle::Half,
                    &mut out[..4],
                ),
                "cos",
            ),
        ] {
            let e = e.unwrap_err();
            assert!(
                matches!(&e, Error::Invalid { arg: a, .. } | Error::Shape { arg: a, .. } if *a == arg),
                "{arg}: {e:?}"
            );
        }
    }
}
