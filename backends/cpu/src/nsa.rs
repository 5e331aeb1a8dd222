//! NSA selection attention: each query attends only to its selected key spans.
//!
//! Layout is token-packed BTHD: `q [Σtq, hq, d]`, `k [Σtk, hkv, d]`, `v [Σtk, hkv, dv]`, with
//! the sequences described by [`Seq`] (a dense batch is the special case of equal lengths).
//! For each (query token, kv head) the kernel takes the row's spans, clamps them to the keys the
//! query may see (`j <= q_offset + i`, `j < tk`), sorts and merges them (so every key counts once
//! whatever the selection says), then walks them in order with an online softmax in f32, all G
//! query heads of the kv head together. Cost is proportional to the selected keys, not to `tk`.

use rayon::prelude::*;

use crate::error::{check_len, check_positive, Error, Result};
use crate::simd::{dot, simd_dispatch, Arith};
use fp8nsa_types::{AttnDims, Seq, Spans};

/// Keys per softmax step: scores for this many keys and all G heads are computed before the
/// running max and sums are updated.
const CHUNK: usize = 64;

/// Online-softmax state of `g` query heads.
struct Softmax {
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
}

/// Folds keys `kc [c, d]` / values `vc [c, dv]` into the state of the prescaled queries
/// `q [g, d]`. `scores` is scratch of at least `g * c`.
#[inline(always)]
fn fold_chunk_impl<A: Arith>(
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    d: usize,
    dv: usize,
    st: &mut Softmax,
    scores: &mut [f32],
) {
    let Softmax { m, l, acc } = st;
    let c = kc.len() / d;
    for (gi, qg) in q.chunks_exact(d).enumerate() {
        let s = &mut scores[gi * c..(gi + 1) * c];
        for (sj, kj) in s.iter_mut().zip(kc.chunks_exact(d)) {
            *sj = dot::<A>(qg, kj);
        }
        let mx = s.iter().fold(m[gi], |a, &b| a.max(b));
        let alpha = (m[gi] - mx).exp();
        let mut sum = 0f32;
        for sj in s.iter_mut() {
            *sj = (*sj - mx).exp();
            sum += *sj;
        }
        m[gi] = mx;
        l[gi] = l[gi] * alpha + sum;
        let a = &mut acc[gi * dv..(gi + 1) * dv];
        if alpha != 1.0 {
            a.iter_mut().for_each(|x| *x *= alpha);
        }
        for (&p, vj) in s.iter().zip(vc.chunks_exact(dv)) {
            for (x, &y) in a.iter_mut().zip(vj) {
                *x = A::mul_add(p, y, *x);
            }
        }
    }
}

simd_dispatch!(fn fold_chunk => fold_chunk_impl(
    q: &[f32], kc: &[f32], vc: &[f32], d: usize, dv: usize, st: &mut Softmax, scores: &mut [f32]
));

/// Checks the arguments of [`selection_attention`].
#[allow(clippy::too_many_arguments)]
fn check<T>(
    q: &[T],
    k: &[T],
    v: &[T],
    dims: AttnDims,
    seqs: &[Seq],
    spans: &Spans<&[i32]>,
    out: &[f32],
    lse: &[f32],
) -> Result<(usize, usize)> {
    dims.validate()?;
    let tq = q.len() / (dims.hq * dims.d);
    let tk = k.len() / (dims.hkv * dims.d);
    check_len("q", q.len(), tq * dims.hq * dims.d)?;
    check_len("k", k.len(), tk * dims.hkv * dims.d)?;
    check_len("v", v.len(), tk * dims.hkv * dims.dv)?;
    check_len("out", out.len(), tq * dims.hq * dims.dv)?;
    check_len("lse", lse.len(), tq * dims.hq)?;
    if spans.per_row() > 0 {
        check_len("selection rows", spans.rows(), tq * dims.hkv)?;
    }
    if let Spans::Blocks { block_size: 0, .. } = spans {
        check_positive("block_size", 0)?;
    }
    let mut covered = 0;
    for (i, s) in seqs.iter().enumerate() {
        if s.q_start != covered || s.k_start + s.k_len > tk {
            return Err(Error::Invalid {
                arg: "seqs",
                msg: format!("sequence {i} ({s:?}) does not tile {tq} queries / {tk} keys"),
            });
        }
        covered += s.q_len;
    }
    if covered != tq {
        return Err(Error::Invalid {
            arg: "seqs",
            msg: format!("sequences cover {covered} queries, q has {tq}"),
        });
    }
    Ok((tq, tk))
}

/// Computes `out [Σtq, hq, dv]` and `lse [Σtq, hq]` (natural log; `-inf` and a zero output for a
/// query that sees no selected key). `scale` multiplies the scores (usually `1/sqrt(d)`).
/// Inputs are f32, bf16 or f16; everything is computed in f32.
#[allow(clippy::too_many_arguments)]
pub fn selection_attention<T>(
    q: &[T],
    k: &[T],
    v: &[T],
    dims: AttnDims,
    seqs: &[Seq],
    spans: Spans<&[i32]>,
    scale: f32,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()>
where
    T: Copy + Into<f32> + Send + Sync,
{
    let (tq, _) = check(q, k, v, dims, seqs, &spans, out, lse)?;
    if tq == 0 {
        return Ok(());
    }
    let AttnDims { hq, dv, .. } = dims;
    // Split a token's heads across threads only when there are too few tokens to go around.
    let threads = rayon::current_num_threads();
    let mut split = if tq >= 2 * threads {
        1
    } else {
        (2 * threads).div_ceil(tq).min(hq)
    };
    while hq % split != 0 {
        split -= 1;
    }
    let hu = hq / split;
    let mut seq_of = vec![0usize; tq];
    for (si, s) in seqs.iter().enumerate() {
        seq_of[s.q_start..s.q_start + s.q_len].fill(si);
    }
    out.par_chunks_mut(hu * dv)
        .zip(lse.par_chunks_mut(hu))
        .enumerate()
        .for_each_init(Scratch::default, |scratch, (unit, (o, lse))| {
            let token = unit / split;
            let h0 = (unit % split) * hu;
            let s = seqs[seq_of[token]];
            let pos = s.q_offset + (token - s.q_start);
            let limit = s.k_len.min(pos + 1);
            let args = RowArgs {
                q,
                k,
                v,
                dims,
                token,
                k_start: s.k_start,
                limit,
                scale,
            };
            attend_heads(&args, &spans, h0..h0 + hu, o, lse, scratch);
        });
    Ok(())
}

#[derive(Default)]
struct Scratch {
    spans: Vec<(usize, usize)>,
    q: Vec<f32>,
    kc: Vec<f32>,
    vc: Vec<f32>,
    scores: Vec<f32>,
}

struct RowArgs<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    dims: AttnDims,
    token: usize,
    k_start: usize,
    limit: usize,
    scale: f32,
}

/// Query heads `heads` of one token; `o [heads, dv]`, `lse [heads]`.
fn attend_heads<T: Copy + Into<f32>>(
    a: &RowArgs<'_, T>,
    spans: &Spans<&[i32]>,
    heads: std::ops::Range<usize>,
    o: &mut [f32],
    lse: &mut [f32],
    sc: &mut Scratch,
) {
    let AttnDims { hq, hkv, d, dv } = a.dims;
    let g = hq / hkv;
    let mut h = heads.start;
    while h < heads.end {
        let kvh = h / g;
        let h1 = heads.end.min((kvh + 1) * g);
        let gn = h1 - h;
        spans.row_spans(a.token * hkv + kvh, a.limit, &mut sc.spans);
        sc.q.clear();
        for qh in h..h1 {
            let row = &a.q[(a.token * hq + qh) * d..(a.token * hq + qh + 1) * d];
            sc.q.extend(row.iter().map(|&x| x.into() * a.scale));
        }
        let mut st = Softmax {
            m: vec![f32::NEG_INFINITY; gn],
            l: vec![0.0; gn],
            acc: vec![0.0; gn * dv],
        };
        sc.scores.resize(gn * CHUNK, 0.0);
        for &(s0, s1) in &sc.spans {
            let mut c0 = s0;
            while c0 < s1 {
                let c1 = (c0 + CHUNK).min(s1);
                sc.kc.clear();
                sc.vc.clear();
                for j in c0..c1 {
                    let key = (a.k_start + j) * hkv + kvh;
                    sc.kc
                        .extend(a.k[key * d..(key + 1) * d].iter().map(|&x| x.into()));
                    sc.vc
                        .extend(a.v[key * dv..(key + 1) * dv].iter().map(|&x| x.into()));
                }
                fold_chunk(&sc.q, &sc.kc, &sc.vc, d, dv, &mut st, &mut sc.scores);
                c0 = c1;
            }
        }
        let base = h - heads.start;
        for gi in 0..gn {
            let out = &mut o[(base + gi) * dv..(base + gi + 1) * dv];
            if st.l[gi] > 0.0 {
                let inv = 1.0 / st.l[gi];
                for (x, &y) in out.iter_mut().zip(&st.acc[gi * dv..(gi + 1) * dv]) {
                    *x = y * inv;
                }
                lse[base + gi] = st.m[gi] + st.l[gi].ln();
            } else {
                out.fill(0.0);
                lse[base + gi] = f32::NEG_INFINITY;
            }
        }
        h = h1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_key_gives_its_value_and_empty_rows_give_zero() {
        let dims = AttnDims {
            hq: 2,
            hkv: 1,
            d: 2,
            dv: 3,
        };
        let q = [1.0f32, 0.0, 0.0, 1.0];
        let k = [0.5f32, 0.5, 9.0, 9.0];
        let v = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let seqs = [Seq {
            q_start: 0,
            q_len: 1,
            k_start: 0,
            k_len: 2,
            q_offset: 1,
        }];
        let (mut o, mut lse) = (vec![9f32; 6], vec![9f32; 2]);
        let r = [0, 1];
        selection_attention(
            &q,
            &k,
            &v,
            dims,
            &seqs,
            Spans::Ranges {
                ranges: &r[..],
                per_row: 1,
            },
            1.0,
            &mut o,
            &mut lse,
        )
        .unwrap();
        assert_eq!(o, vec![1.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
        assert_eq!(lse, vec![0.5, 0.5]);
        let r = [5, 9];
        selection_attention(
            &q,
            &k,
            &v,
            dims,
            &seqs,
            Spans::Ranges {
                ranges: &r[..],
                per_row: 1,
            },
            1.0,
            &mut o,
            &mut lse,
        )
        .unwrap();
        assert_eq!(o, vec![0.0; 6]);
        assert!(lse.iter().all(|&x| x == f32::NEG_INFINITY));
    }
}
