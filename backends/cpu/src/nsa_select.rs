//! Host-side helpers of the full NSA layer on plain slices: which compressed blocks a query
//! sees, selection-block importance (from the queries and compressed keys, or remapped from
//! given compressed-branch probabilities), the top-n block selection and the sliding-window
//! ranges (docs/nsa.md, "Full NSA layer").
//!
//! Each function validates its sizes and writes into a caller-provided output slice, so a
//! device version with the same shape of signature (params, rows, inputs, output) can replace
//! it. Layouts are row-major; a "row" is one (batch, query, kv head).

use rayon::prelude::*;

use crate::error::{check_len, check_positive, Error, Result};
use crate::simd::{dot, simd_dispatch, Arith};

/// Largest `compress_block` / `select_block` a config may ask for (keys per block).
pub const MAX_BLOCK: usize = 1 << 16;

/// The block geometry and budget of the NSA layer (docs/nsa.md, "Defaults"): the same fields,
/// under the same names, as the layer's `NsaConfig`, without Candle or serde.
///
/// ```
/// use fp8nsa_cpu::nsa_select::NsaParams;
/// let p = NsaParams { compress_block: 32, compress_stride: 16, select_block: 64,
///                     num_selected: 16, num_initial: 1, num_local: 2, window: 512 };
/// p.validate().unwrap();
/// assert_eq!((p.compressed_len(31), p.compressed_len(32), p.compressed_len(100)), (0, 1, 5));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NsaParams {
    /// Keys per compressed block, `l`.
    pub compress_block: usize,
    /// Stride between compressed blocks, `d`.
    pub compress_stride: usize,
    /// Keys per selection block, `l'`.
    pub select_block: usize,
    /// Selected blocks per query, forced ones included, `n`.
    pub num_selected: usize,
    /// Leading blocks always selected.
    pub num_initial: usize,
    /// Blocks ending at the query always selected.
    pub num_local: usize,
    /// Sliding-window length, `w`.
    pub window: usize,
}

impl NsaParams {
    /// The relations every helper relies on (docs/nsa.md, "Defaults"): positive sizes, the
    /// stride dividing both block lengths (so eq. 9 lines blocks up), and the forced blocks
    /// fitting in the budget (so a row never holds more than `num_selected` entries).
    ///
    /// ```
    /// use fp8nsa_cpu::nsa_select::NsaParams;
    /// let p = NsaParams { compress_block: 16, compress_stride: 8, select_block: 32,
    ///                     num_selected: 4, num_initial: 1, num_local: 2, window: 48 };
    /// assert!(p.validate().is_ok());
    /// assert!(NsaParams { compress_stride: 5, ..p }.validate().is_err());
    /// assert!(NsaParams { num_local: 4, ..p }.validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<()> {
        check_positive("compress_block", self.compress_block)?;
        check_positive("compress_stride", self.compress_stride)?;
        check_positive("select_block", self.select_block)?;
        check_positive("num_selected", self.num_selected)?;
        check_positive("window", self.window)?;
        // the selection work per query grows with select_block / compress_stride (the importance
        // remap) and with the block sizes; a config past these bounds is a typo or an attack,
        // not a model (the paper uses 32 / 64, DSA single tokens)
        for (arg, v) in [
            ("compress_block", self.compress_block),
            ("select_block", self.select_block),
        ] {
            if v > MAX_BLOCK {
                return Err(invalid(
                    arg,
                    format!("must be at most {MAX_BLOCK}, got {v}"),
                ));
            }
        }
        if self.select_block / self.compress_stride > MAX_BLOCK / 16 {
            return Err(invalid(
                "compress_stride",
                format!(
                    "select_block / compress_stride must be at most {}, got {} / {}",
                    MAX_BLOCK / 16,
                    self.select_block,
                    self.compress_stride
                ),
            ));
        }
        for (arg, v) in [
            ("compress_block", self.compress_block),
            ("select_block", self.select_block),
        ] {
            if v % self.compress_stride != 0 {
                return Err(invalid(
                    arg,
                    format!(
                        "must be a multiple of compress_stride = {}, got {v}",
                        self.compress_stride
                    ),
                ));
            }
        }
        // each query's top-n row is num_selected entries long (DSA's 2048 tokens fit easily)
        if self.num_selected > MAX_BLOCK {
            return Err(invalid(
                "num_selected",
                format!("must be at most {MAX_BLOCK}, got {}", self.num_selected),
            ));
        }
        let forced = self.num_initial.checked_add(self.num_local);
        if forced.is_none_or(|f| f > self.num_selected) {
            return Err(invalid(
                "num_selected",
                format!(
                    "must hold the {} initial + {} local forced blocks, got {}",
                    self.num_initial, self.num_local, self.num_selected
                ),
            ));
        }
        Ok(())
    }

    /// Compressed blocks that exist once `t` keys are known (docs/nsa.md, "Compression"):
    /// block `i` covers keys `[i·d, i·d + l)`, so `0` if `t < l`, else `(t − l)/d + 1`. A query
    /// at position `p` sees `compressed_len(p + 1)` blocks.
    ///
    /// ```
    /// use fp8nsa_cpu::nsa_select::NsaParams;
    /// let p = NsaParams { compress_block: 16, compress_stride: 8, select_block: 32,
    ///                     num_selected: 4, num_initial: 1, num_local: 2, window: 48 };
    /// assert_eq!((p.compressed_len(15), p.compressed_len(16), p.compressed_len(24)), (0, 1, 2));
    /// ```
    pub fn compressed_len(&self, t: usize) -> usize {
        if t < self.compress_block {
            0
        } else {
            (t - self.compress_block) / self.compress_stride + 1
        }
    }
}

/// Which rows a selection is built for: `b` batches of `tq` queries at positions
/// `q_offset .. q_offset + tq`, each with `hkv` kv heads. Rows are laid out `[b, tq, hkv]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueryRows {
    pub b: usize,
    pub tq: usize,
    pub hkv: usize,
    /// Position of the first query (`Tk − Tq` for the layer's queries).
    pub q_offset: usize,
}

impl QueryRows {
    /// `b · tq · hkv`, or an error if it overflows.
    fn count(&self) -> Result<usize> {
        product("rows", &[self.b, self.tq, self.hkv])
    }

    /// Positions (and `p + 1`, and so block indices) must fit the i32 outputs.
    fn check_positions(&self) -> Result<()> {
        match self.q_offset.checked_add(self.tq) {
            Some(end) if end <= i32::MAX as usize => Ok(()),
            _ => Err(invalid(
                "q_offset",
                format!(
                    "positions up to q_offset + tq = {} + {} must fit in i32",
                    self.q_offset, self.tq
                ),
            )),
        }
    }
}

fn invalid(arg: &'static str, msg: impl Into<String>) -> Error {
    Error::Invalid {
        arg,
        msg: msg.into(),
    }
}

fn product(arg: &'static str, dims: &[usize]) -> Result<usize> {
    dims.iter().try_fold(1usize, |acc, &d| {
        acc.checked_mul(d)
            .ok_or_else(|| invalid(arg, format!("size {dims:?} overflows usize")))
    })
}

/// The compressed branch's visibility mask (docs/nsa.md, "Compression"): for the `tq` queries at
/// positions `q_offset ..`, `out [tq, n_c]` gets `0.0` for the compressed blocks a query sees
/// (the first `min(compressed_len(p + 1), n_c)`, those whose last key is at or before `p`) and
/// `-inf` for the others, ready to add to the `[.., tq, n_c]` scores.
///
/// ```
/// use fp8nsa_cpu::nsa_select::{compressed_mask, NsaParams};
/// let p = NsaParams { compress_block: 4, compress_stride: 2, select_block: 4,
///                     num_selected: 2, num_initial: 1, num_local: 1, window: 8 };
/// // blocks end at keys 3, 5, 7: queries at positions 3, 4, 5 see 1, 1 and 2 of the 3
/// let mut mask = [1f32; 9];
/// compressed_mask(p, 3, 3, 3, &mut mask).unwrap();
/// let inf = f32::NEG_INFINITY;
/// assert_eq!(mask, [0.0, inf, inf, 0.0, inf, inf, 0.0, 0.0, inf]);
/// ```
pub fn compressed_mask(
    params: NsaParams,
    q_offset: usize,
    tq: usize,
    n_c: usize,
    out: &mut [f32],
) -> Result<()> {
    params.validate()?;
    check_len("mask", out.len(), product("mask", &[tq, n_c])?)?;
    if q_offset.checked_add(tq).is_none() {
        return Err(invalid("q_offset", "q_offset + tq overflows usize"));
    }
    if n_c == 0 {
        return Ok(());
    }
    for (t, row) in out.chunks_exact_mut(n_c).enumerate() {
        let vis = params.compressed_len(q_offset + t + 1).min(n_c);
        row[..vis].fill(0.0);
        row[vis..].fill(f32::NEG_INFINITY);
    }
    Ok(())
}

/// Paper eq. 9 for 0-based blocks (docs/nsa.md, "Block importance"): each of `rows` rows of
/// compressed-block probabilities `p [rows, n_c]` becomes selection-block importance
/// `out [rows, nb]`, with `r = l'/d`, `c = l/d`:
///
/// `out[j] = Σ_{m < r} Σ_{k < c} p[r·j + m − k]` (out-of-range terms dropped),
///
/// which weighs compressed block `i` by the keys it shares with selection block `j` (over the
/// stride). Summed in f32 in that order (`m` outer, `k` inner), from 0.
///
/// ```
/// use fp8nsa_cpu::nsa_select::{remap, NsaParams};
/// let p = NsaParams { compress_block: 4, compress_stride: 2, select_block: 4,
///                     num_selected: 2, num_initial: 1, num_local: 1, window: 8 };
/// // compressed blocks cover keys [0,4), [2,6), [4,8); selection blocks [0,4), [4,8)
/// let mut imp = [0f32; 2];
/// remap(p, 1, 3, 2, &[1.0, 10.0, 100.0], &mut imp).unwrap();
/// // block 0 shares 4 keys (2 strides) with selection block 0, block 1 shares 2 (1 stride)
/// assert_eq!(imp, [2.0 * 1.0 + 10.0, 10.0 + 2.0 * 100.0]);
/// ```
pub fn remap(
    params: NsaParams,
    rows: usize,
    n_c: usize,
    nb: usize,
    p: &[f32],
    out: &mut [f32],
) -> Result<()> {
    params.validate()?;
    check_len("p", p.len(), product("p", &[rows, n_c])?)?;
    check_len("importance", out.len(), product("importance", &[rows, nb])?)?;
    if rows == 0 || nb == 0 {
        return Ok(());
    }
    if n_c == 0 {
        // no probabilities: every term is out of range
        out.fill(0.0);
    } else {
        p.par_chunks(n_c)
            .zip(out.par_chunks_mut(nb))
            .for_each(|(row, out)| remap_row(params, row, out));
    }
    Ok(())
}

/// [`remap`] of one row: `p [n_c]` (any length) to `out [nb]`.
fn remap_row(params: NsaParams, p: &[f32], out: &mut [f32]) {
    let s = params.compress_stride;
    let (ratio, span) = (params.select_block / s, params.compress_block / s);
    for (j, o) in out.iter_mut().enumerate() {
        let mut acc = 0f32;
        for m in 0..ratio {
            // i = ratio·j + m − n for n in 0..span, kept when 0 <= i < n_c
            let top = ratio * j + m;
            for n in 0..span {
                if let Some(&x) = top.checked_sub(n).and_then(|i| p.get(i)) {
                    acc += x;
                }
            }
        }
        *o = acc;
    }
}

/// The compressed branch's shapes as [`importance`] reads them: `g` query heads per kv head,
/// head size `d`, `n_c` compressed blocks, and the softmax scale.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CompressedDims {
    pub g: usize,
    pub d: usize,
    pub n_c: usize,
    pub scale: f32,
}

/// Selection-block importance from the queries and the compressed keys (docs/nsa.md, "Block
/// importance"): for each row `(b, t, h)` of `rows`, the softmax of `scale · q · ck` over the
/// compressed blocks the query sees ([`compressed_mask`]), summed over the `g` query heads of
/// kv head `h`, then [`remap`]ped into `out [rows, nb]`. `q [b, tq, hkv · g, d]` (head `h · g +
/// i` is the `i`-th of kv head `h`'s group), `ck [b, n_c, hkv, d]`.
///
/// Each row is computed on its own in one fixed order (the dot products by `simd::dot`, then
/// the softmax and the group sum sequentially), whatever the batch, the number of queries
/// or of compressed blocks. So a query's importance is bit-identical in a prefill and in a
/// one-token decode step, and both pick the same blocks even where two nearly tie (a matrix
/// product's rounding depends on its shape, which made the two disagree now and then).
///
/// ```
/// use fp8nsa_cpu::nsa_select::{importance, CompressedDims, NsaParams, QueryRows};
/// let p = NsaParams { compress_block: 2, compress_stride: 2, select_block: 2,
///                     num_selected: 2, num_initial: 1, num_local: 1, window: 8 };
/// let rows = QueryRows { b: 1, tq: 1, hkv: 1, q_offset: 3 }; // sees blocks 0 and 1
/// let dims = CompressedDims { g: 1, d: 1, n_c: 2, scale: 1.0 };
/// let mut imp = [0f32; 2];
/// importance(p, rows, dims, 2, &[1.0], &[0.0, 2f32.ln()], &mut imp).unwrap();
/// // scores 0 and ln 2: probabilities 1/3 and 2/3
/// assert!((imp[0] - 1.0 / 3.0).abs() < 1e-6 && (imp[1] - 2.0 / 3.0).abs() < 1e-6);
/// ```
pub fn importance(
    params: NsaParams,
    rows: QueryRows,
    dims: CompressedDims,
    nb: usize,
    q: &[f32],
    ck: &[f32],
    out: &mut [f32],
) -> Result<()> {
    params.validate()?;
    rows.check_positions()?;
    let CompressedDims { g, d, n_c, scale } = dims;
    check_positive("g", g)?;
    check_positive("d", d)?;
    let n_rows = rows.count()?;
    check_len("q", q.len(), product("q", &[n_rows, g, d])?)?;
    check_len("ck", ck.len(), product("ck", &[rows.b, n_c, rows.hkv, d])?)?;
    check_len(
        "importance",
        out.len(),
        product("importance", &[n_rows, nb])?,
    )?;
    if n_rows == 0 || nb == 0 {
        return Ok(());
    }
    let (tq, hkv) = (rows.tq, rows.hkv);
    out.par_chunks_mut(nb).enumerate().for_each_init(
        || (vec![0f32; n_c], vec![0f32; n_c]),
        |(s, p), (r, out)| {
            let (h, t, bi) = (r % hkv, r / hkv % tq, r / (hkv * tq));
            let vis = params.compressed_len(rows.q_offset + t + 1).min(n_c);
            p.fill(0.0);
            for i in 0..g {
                if vis > 0 {
                    let qh = &q[(r * g + i) * d..][..d];
                    // compressed block j of kv head h at `(bi · n_c + j) · hkv + h` rows of d
                    let keys = &ck[(bi * n_c * hkv + h) * d..];
                    scores_row(qh, keys, hkv * d, scale, &mut s[..vis]);
                }
                let m = s[..vis].iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let mut l = 0f32;
                for s in &mut s[..vis] {
                    *s = (*s - m).exp();
                    l += *s;
                }
                for (p, &e) in p.iter_mut().zip(&s[..vis]) {
                    *p += e / l;
                }
            }
            remap_row(params, p, out);
        },
    );
    Ok(())
}

simd_dispatch!(fn scores_row => scores_row_impl(
    q: &[f32], keys: &[f32], stride: usize, scale: f32, s: &mut [f32]
));

/// `s[j] = scale · q · keys[j · stride ..][..q.len()]`: the products by the project's one dot
/// product, whose order is fixed by its code (and its tier, which a prefill and the decode
/// steps after it share), not by how many rows a call holds.
#[inline(always)]
fn scores_row_impl<A: Arith>(q: &[f32], keys: &[f32], stride: usize, scale: f32, s: &mut [f32]) {
    for (j, s) in s.iter_mut().enumerate() {
        *s = dot::<A>(q, &keys[j * stride..][..q.len()]) * scale;
    }
}

/// Top-n selection (docs/nsa.md, "Top-n selection"): for each row of `importance [rows, nb]`
/// (rows `[b, tq, hkv]` as in `rows`), writes `out [rows, num_selected]`, the block indices
/// chosen for the query at position `p`:
///
/// - candidates are blocks `0 ..= cur`, `cur = p / l'` (never one after the query's);
/// - forced: the first `num_initial` and the `num_local` blocks ending with `cur`
///   (`j + num_local > cur`);
/// - the remaining budget goes to the most important other candidates, ties to the lower
///   block index (importance ordered by `f32::total_cmp`);
/// - the row is sorted ascending and padded with `-1`.
///
/// Needs `cur < nb` for every query (`nb = ceil(Tk / l')` covers queries at positions below
/// `Tk`).
///
/// ```
/// use fp8nsa_cpu::nsa_select::{top_n, NsaParams, QueryRows};
/// let p = NsaParams { compress_block: 4, compress_stride: 4, select_block: 4,
///                     num_selected: 3, num_initial: 1, num_local: 1, window: 8 };
/// // one query at position 17 (block 4): blocks 0 and 4 forced, one more by importance
/// let rows = QueryRows { b: 1, tq: 1, hkv: 1, q_offset: 17 };
/// let mut sel = [0i32; 3];
/// top_n(p, rows, 5, &[0.0, 0.2, 0.5, 0.5, 9.0], &mut sel).unwrap();
/// assert_eq!(sel, [0, 2, 4]); // 2 and 3 tie: the lower index wins
/// // a query at position 2 (block 0) has a single candidate
/// let rows = QueryRows { q_offset: 2, ..rows };
/// top_n(p, rows, 5, &[0.0, 0.2, 0.5, 0.5, 9.0], &mut sel).unwrap();
/// assert_eq!(sel, [0, -1, -1]);
/// ```
pub fn top_n(
    params: NsaParams,
    rows: QueryRows,
    nb: usize,
    importance: &[f32],
    out: &mut [i32],
) -> Result<()> {
    params.validate()?;
    rows.check_positions()?;
    let n_rows = rows.count()?;
    let n = params.num_selected;
    check_len(
        "importance",
        importance.len(),
        product("importance", &[n_rows, nb])?,
    )?;
    check_len("selection", out.len(), product("selection", &[n_rows, n])?)?;
    if n_rows == 0 {
        return Ok(());
    }
    let last = (rows.q_offset + rows.tq - 1) / params.select_block;
    if last >= nb {
        return Err(invalid(
            "nb",
            format!(
                "the query at position {} is in block {last}, but importance has only {nb} blocks",
                rows.q_offset + rows.tq - 1
            ),
        ));
    }
    let (tq, hkv) = (rows.tq, rows.hkv);
    importance
        .par_chunks(nb)
        .zip(out.par_chunks_mut(n))
        .enumerate()
        .for_each_init(
            || Vec::with_capacity(nb),
            |cand: &mut Vec<usize>, (r, (imp, row))| {
                let t = r / hkv % tq;
                let cur = (rows.q_offset + t) / params.select_block;
                let forced = |j: usize| j < params.num_initial || j + params.num_local > cur;
                // forced blocks first: at most num_initial + num_local <= n (validated)
                let mut len = 0;
                for j in (0..=cur).filter(|&j| forced(j)) {
                    row[len] = j as i32;
                    len += 1;
                }
                cand.clear();
                cand.extend((0..=cur).filter(|&j| !forced(j)));
                let budget = n.saturating_sub(len).min(cand.len());
                if budget > 0 && budget < cand.len() {
                    cand.select_nth_unstable_by(budget - 1, |&a, &c| {
                        imp[c].total_cmp(&imp[a]).then(a.cmp(&c))
                    });
                }
                for &j in &cand[..budget] {
                    row[len] = j as i32;
                    len += 1;
                }
                row[..len].sort_unstable();
                row[len..].fill(-1);
            },
        );
    Ok(())
}

/// Sliding-window ranges (docs/nsa.md, "Sliding window"): for each row `[b, tq, hkv]`,
/// `out [rows, 2]` gets the half-open range `[max(0, p + 1 − w), p + 1)`, the last `w` keys up
/// to and including the query's own position (one range per row, the layout of a
/// `[B, Tq, Hkv, 1, 2]` range selection).
///
/// ```
/// use fp8nsa_cpu::nsa_select::{window_ranges, NsaParams, QueryRows};
/// let p = NsaParams { compress_block: 4, compress_stride: 4, select_block: 4,
///                     num_selected: 2, num_initial: 1, num_local: 1, window: 3 };
/// let rows = QueryRows { b: 1, tq: 2, hkv: 1, q_offset: 1 };
/// let mut r = [0i32; 4];
/// window_ranges(p, rows, &mut r).unwrap();
/// assert_eq!(r, [0, 2, 0, 3]); // positions 1 and 2: fewer than w keys so far
/// let mut r = [0i32; 2];
/// window_ranges(p, QueryRows { tq: 1, q_offset: 9, ..rows }, &mut r).unwrap();
/// assert_eq!(r, [7, 10]);
/// ```
pub fn window_ranges(params: NsaParams, rows: QueryRows, out: &mut [i32]) -> Result<()> {
    params.validate()?;
    rows.check_positions()?;
    check_len("ranges", out.len(), product("ranges", &[rows.count()?, 2])?)?;
    if rows.hkv == 0 {
        return Ok(());
    }
    let per_token = 2 * rows.hkv;
    for (r, tok) in out.chunks_exact_mut(per_token).enumerate() {
        let p = rows.q_offset + r % rows.tq;
        let start = (p + 1).saturating_sub(params.window);
        for pair in tok.chunks_exact_mut(2) {
            pair.copy_from_slice(&[start as i32, (p + 1) as i32]);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    /// A seeded rng; FP8NSA_TEST_SEED replays a failure.
    fn rng() -> rand::rngs::StdRng {
        fp8nsa_test_support::rng("nsa_select")
    }

    fn params(l: usize, d: usize, ls: usize, n: usize, init: usize, local: usize) -> NsaParams {
        NsaParams {
            compress_block: l,
            compress_stride: d,
            select_block: ls,
            num_selected: n,
            num_initial: init,
            num_local: local,
            window: 8,
        }
    }

    fn one_row(p: NsaParams, pos: usize, imp: &[f32]) -> Vec<i32> {
        let rows = QueryRows {
            b: 1,
            tq: 1,
            hkv: 1,
            q_offset: pos,
        };
        let mut out = vec![7i32; p.num_selected];
        top_n(p, rows, imp.len(), imp, &mut out).unwrap();
        out
    }

    /// `importance` against an f64 softmax and eq. 9 by overlap counting, and each row alone
    /// (one query, only the blocks it sees) bit-identical to the same row inside a batch.
    #[test]
    fn importance_matches_f64_and_each_row_alone() {
        let mut rng = rng();
        // l = 8, d = 4 (overlapping blocks), l' = 16; 61 keys: 14 compressed, 4 selection blocks
        let p = params(8, 4, 16, 3, 1, 1);
        let (b, tq, hkv, g, d, tk) = (2, 13, 2, 3, 11, 61);
        let (n_c, nb, q_offset) = (p.compressed_len(tk), tk.div_ceil(16), tk - tq);
        let mut gen =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect() };
        let (q, ck) = (gen(b * tq * hkv * g * d), gen(b * n_c * hkv * d));
        let rows = QueryRows {
            b,
            tq,
            hkv,
            q_offset,
        };
        let dims = CompressedDims {
            g,
            d,
            n_c,
            scale: 0.7,
        };
        let mut imp = vec![0f32; b * tq * hkv * nb];
        importance(p, rows, dims, nb, &q, &ck, &mut imp).unwrap();
        for (r, row) in imp.chunks_exact(nb).enumerate() {
            let (h, t, bi) = (r % hkv, r / hkv % tq, r / (hkv * tq));
            let pos = q_offset + t;
            let vis = p.compressed_len(pos + 1);
            // f64 reference: probabilities summed over the group, then each compressed block's
            // keys [4i, 4i + 8) shared with selection block j's [16j, 16j + 16), over 4
            let mut pr = vec![0f64; vis];
            for i in 0..g {
                let qh = &q[(r * g + i) * d..][..d];
                let s: Vec<f64> = (0..vis)
                    .map(|j| {
                        let kj = &ck[((bi * n_c + j) * hkv + h) * d..][..d];
                        0.7 * qh
                            .iter()
                            .zip(kj)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let l: f64 = s.iter().map(|s| (s - m).exp()).sum();
                for (p, s) in pr.iter_mut().zip(&s) {
                    *p += (s - m).exp() / l;
                }
            }
            for (j, &got) in row.iter().enumerate() {
                let want: f64 = (0..vis)
                    .map(|i| {
                        let (a, c) = ((4 * i).max(16 * j), (4 * i + 8).min(16 * j + 16));
                        pr[i] * c.saturating_sub(a) as f64 / 4.0
                    })
                    .sum();
                assert!(
                    (got as f64 - want).abs() < 1e-5,
                    "row {r} block {j}: {got} vs {want}"
                );
            }
            // the row alone, with only the compressed blocks it sees and its own blocks
            let one = QueryRows {
                b: 1,
                tq: 1,
                hkv: 1,
                q_offset: pos,
            };
            let qr = &q[r * g * d..][..g * d];
            let ckr: Vec<f32> = (0..vis)
                .flat_map(|j| ck[((bi * n_c + j) * hkv + h) * d..][..d].to_vec())
                .collect();
            let nb1 = (pos + 1).div_ceil(16);
            let mut alone = vec![0f32; nb1];
            let dims1 = CompressedDims { n_c: vis, ..dims };
            importance(p, one, dims1, nb1, qr, &ckr, &mut alone).unwrap();
            assert_eq!(alone[..], row[..nb1], "row {r}");
        }
        let bad = importance(p, rows, dims, nb, &q[1..], &ck, &mut imp);
        assert!(matches!(bad, Err(Error::Shape { arg: "q", .. })), "{bad:?}");
    }

    #[test]
    fn top_n_forces_initial_and_local_blocks_over_importance() {
        // 10 blocks of 4 keys, query at position 38 (block 9); the forced blocks are the least
        // important ones
        let p = params(4, 4, 4, 5, 2, 2);
        let imp = [0.0, 0.0, 5.0, 6.0, 7.0, 8.0, 9.0, 4.0, 0.0, 0.0];
        assert_eq!(one_row(p, 38, &imp), [0, 1, 6, 8, 9]);
    }

    #[test]
    fn top_n_breaks_ties_toward_the_lower_index() {
        let p = params(4, 4, 4, 3, 1, 0);
        // blocks 1..=5 tie, block 6 is best: 6 and the lowest tied block 1
        let imp = [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0];
        assert_eq!(one_row(p, 27, &imp), [0, 1, 6]);
        // with block 6 worse, the budget goes to the two lowest of the tie
        let imp = [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5];
        assert_eq!(one_row(p, 27, &imp), [0, 1, 2]);
    }

    #[test]
    fn top_n_budget_smaller_than_candidates_keeps_the_most_important() {
        let p = params(4, 4, 4, 4, 1, 1);
        // candidates 1..=7 (0 and 8 forced), budget 2: blocks 3 and 6
        let imp = [0.0, 0.1, 0.2, 0.9, 0.3, 0.4, 0.8, 0.5, 0.0, 100.0];
        // block 9 is after the query (position 35, block 8): never selected
        assert_eq!(one_row(p, 35, &imp), [0, 3, 6, 8]);
    }

    #[test]
    fn top_n_pads_rows_with_fewer_candidates() {
        let p = params(4, 4, 8, 5, 1, 1);
        let imp = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(one_row(p, 0, &imp), [0, -1, -1, -1, -1]);
        assert_eq!(one_row(p, 8, &imp), [0, 1, -1, -1, -1]);
        assert_eq!(one_row(p, 23, &imp), [0, 1, 2, -1, -1]);
    }

    #[test]
    fn top_n_layout_follows_batch_token_head_rows() {
        let p = params(4, 4, 4, 2, 0, 0);
        let rows = QueryRows {
            b: 2,
            tq: 2,
            hkv: 2,
            q_offset: 3,
        };
        // query positions 3 (block 0) and 4 (block 1); each kv head prefers a different block
        let nb = 2;
        let mut imp = vec![0f32; 8 * nb];
        for r in 0..8 {
            imp[r * nb + r % 2] = 1.0 + r as f32;
        }
        let mut out = vec![0i32; 8 * 2];
        top_n(p, rows, nb, &imp, &mut out).unwrap();
        let per_batch = [0, -1, 0, -1, 0, 1, 0, 1];
        assert_eq!(out, per_batch.repeat(2));
        let p = params(4, 4, 4, 1, 0, 0);
        let mut out = vec![0i32; 8];
        top_n(p, rows, nb, &imp, &mut out).unwrap();
        assert_eq!(out, [0, 0, 0, 1, 0, 0, 0, 1]);
    }

    /// Brute force: forced blocks, then the others fully sorted by (importance desc, index asc).
    fn top_n_brute(p: NsaParams, pos: usize, imp: &[f32]) -> Vec<i32> {
        let cur = pos / p.select_block;
        let forced = |j: usize| j < p.num_initial || j + p.num_local > cur;
        let mut row: Vec<usize> = (0..=cur).filter(|&j| forced(j)).collect();
        let mut rest: Vec<usize> = (0..=cur).filter(|&j| !forced(j)).collect();
        rest.sort_by(|&a, &b| imp[b].total_cmp(&imp[a]).then(a.cmp(&b)));
        let budget = p.num_selected - row.len();
        row.extend(rest.into_iter().take(budget));
        row.sort();
        let mut row: Vec<i32> = row.into_iter().map(|j| j as i32).collect();
        row.resize(p.num_selected, -1);
        row
    }

    #[test]
    fn top_n_matches_brute_force_on_random_rows() {
        let mut rng = rng();
        for _ in 0..300 {
            let ls = 1 << rng.random_range(0..4);
            let n = rng.random_range(1..8);
            let init = rng.random_range(0..=n);
            let local = rng.random_range(0..=n - init);
            let p = params(ls, ls, ls, n, init, local);
            let tk: usize = rng.random_range(1..200);
            let nb = tk.div_ceil(ls);
            let tq = rng.random_range(1..=tk);
            let rows = QueryRows {
                b: rng.random_range(1..3),
                tq,
                hkv: rng.random_range(1..3),
                q_offset: tk - tq,
            };
            let n_rows = rows.b * rows.tq * rows.hkv;
            // few distinct values: many ties
            let imp: Vec<f32> = (0..n_rows * nb)
                .map(|_| rng.random_range(0..4) as f32)
                .collect();
            let mut out = vec![0i32; n_rows * n];
            top_n(p, rows, nb, &imp, &mut out).unwrap();
            for r in 0..n_rows {
                let pos = rows.q_offset + r / rows.hkv % rows.tq;
                let want = top_n_brute(p, pos, &imp[r * nb..(r + 1) * nb]);
                assert_eq!(out[r * n..(r + 1) * n], want[..], "{p:?} {rows:?} row {r}");
            }
        }
    }

    #[test]
    fn remap_matches_shared_key_counts() {
        let mut rng = rng();
        for _ in 0..50 {
            let d = rng.random_range(1..5);
            let l = d * rng.random_range(1..5);
            let ls = d * rng.random_range(1..5);
            let p = params(l, d, ls, 1, 0, 0);
            let tk: usize = rng.random_range(0..120);
            let n_c = p.compressed_len(tk);
            let nb = tk.div_ceil(ls);
            let rows = rng.random_range(1..4);
            // multiples of 1/64 below 1: every sum below is exact in f32
            let probs: Vec<f32> = (0..rows * n_c)
                .map(|_| rng.random_range(0..64) as f32 / 64.0)
                .collect();
            let mut out = vec![f32::NAN; rows * nb];
            remap(p, rows, n_c, nb, &probs, &mut out).unwrap();
            for r in 0..rows {
                for j in 0..nb {
                    // Σ_i p[i] · |keys of compressed block i ∩ keys of selection block j| / d
                    let mut want = 0f64;
                    for i in 0..n_c {
                        let shared = (j * ls..(j + 1) * ls)
                            .filter(|k| (i * d..i * d + l).contains(k))
                            .count();
                        want += probs[r * n_c + i] as f64 * (shared / d) as f64;
                        assert_eq!(shared % d, 0);
                    }
                    assert_eq!(
                        out[r * nb + j] as f64,
                        want,
                        "{p:?} tk {tk} row {r} block {j}"
                    );
                }
            }
        }
    }

    #[test]
    fn remap_without_compressed_blocks_is_zero() {
        let p = params(4, 2, 4, 1, 0, 0);
        let mut out = [1f32; 6];
        remap(p, 2, 0, 3, &[], &mut out).unwrap();
        assert_eq!(out, [0.0; 6]);
    }

    #[test]
    fn window_ranges_below_and_above_the_window() {
        let p = NsaParams {
            window: 4,
            ..params(4, 4, 4, 1, 0, 0)
        };
        let rows = QueryRows {
            b: 2,
            tq: 6,
            hkv: 2,
            q_offset: 1,
        };
        let mut out = vec![0i32; 2 * 6 * 2 * 2];
        window_ranges(p, rows, &mut out).unwrap();
        let per_batch: Vec<i32> = [[0, 2], [0, 3], [0, 4], [1, 5], [2, 6], [3, 7]]
            .iter()
            .flat_map(|r| r.repeat(2)) // both kv heads
            .collect();
        assert_eq!(out, per_batch.repeat(2));
        // window 1: the query's own key only
        let p = NsaParams { window: 1, ..p };
        window_ranges(p, rows, &mut out).unwrap();
        assert!(out.chunks(2).all(|r| r[1] - r[0] == 1));
    }

    #[test]
    fn compressed_mask_visible_counts() {
        let mut rng = rng();
        for _ in 0..50 {
            let d = rng.random_range(1..5);
            let l = d * rng.random_range(1..5);
            let p = params(l, d, d, 1, 0, 0);
            let tk: usize = rng.random_range(1..100);
            let tq = rng.random_range(1..=tk);
            let q_offset = tk - tq;
            // sometimes fewer blocks than the last query sees (a chunk's cap)
            let n_c = (p.compressed_len(tk) + rng.random_range(0..2))
                .saturating_sub(usize::from(tk.is_multiple_of(3)));
            let mut mask = vec![f32::NAN; tq * n_c];
            compressed_mask(p, q_offset, tq, n_c, &mut mask).unwrap();
            for t in 0..tq {
                let pos = q_offset + t;
                let row = &mask[t * n_c..(t + 1) * n_c];
                for (i, &m) in row.iter().enumerate() {
                    // docs: block i is visible once its last key i·d + l − 1 is at or before p
                    let visible = i * d + l - 1 <= pos;
                    assert_eq!(m, if visible { 0.0 } else { f32::NEG_INFINITY });
                }
                let vis = row.iter().filter(|&&m| m == 0.0).count();
                assert_eq!(vis, p.compressed_len(pos + 1).min(n_c));
            }
        }
    }

    #[test]
    fn bad_sizes_are_errors() {
        let p = params(4, 2, 4, 2, 1, 1);
        let rows = QueryRows {
            b: 1,
            tq: 2,
            hkv: 1,
            q_offset: 6,
        };
        assert!(matches!(
            window_ranges(p, rows, &mut [0; 3]),
            Err(Error::Shape { arg: "ranges", .. })
        ));
        assert!(matches!(
            compressed_mask(p, 0, 2, 3, &mut [0.0; 5]),
            Err(Error::Shape { arg: "mask", .. })
        ));
        assert!(matches!(
            remap(p, 2, 3, 2, &[0.0; 5], &mut [0.0; 4]),
            Err(Error::Shape { arg: "p", .. })
        ));
        assert!(matches!(
            remap(p, 2, 3, 2, &[0.0; 6], &mut [0.0; 3]),
            Err(Error::Shape {
                arg: "importance",
                ..
            })
        ));
        assert!(matches!(
            top_n(p, rows, 2, &[0.0; 4], &mut [0; 3]),
            Err(Error::Shape {
                arg: "selection",
                ..
            })
        ));
        // the query at position 7 is in block 1: one block of importance is not enough
        assert!(matches!(
            top_n(p, rows, 1, &[0.0; 2], &mut [0; 4]),
            Err(Error::Invalid { arg: "nb", .. })
        ));
        let huge = QueryRows {
            q_offset: i32::MAX as usize,
            ..rows
        };
        assert!(matches!(
            window_ranges(p, huge, &mut [0; 4]),
            Err(Error::Invalid {
                arg: "q_offset",
                ..
            })
        ));
        let zero_stride = NsaParams {
            compress_stride: 0,
            ..p
        };
        assert!(matches!(
            remap(zero_stride, 0, 0, 0, &[], &mut []),
            Err(Error::Invalid {
                arg: "compress_stride",
                ..
            })
        ));
    }
}
