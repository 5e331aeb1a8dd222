//! Dense attention over a head-major cache read in place: one decode token
//! (`decode_attention`) or a chunk of new tokens, each over the rows up to its own
//! (`causal_attention`), with the blocked kernel for prefill chunks and the split of a
//! kv head's keys into parts folded as separate tasks.

use super::*;

/// Keys or values of one sequence laid out head-major, as a decode cache keeps them: head `h`'s
/// row `j` is `data[h · head_stride + j · width ..][..width]` (rows contiguous, heads
/// `head_stride` apart, so a view of the first rows of a larger buffer needs no copy).
///
/// The elements are f32, bf16 or f16 ([`KeyElem`]): a 16-bit cache halves the bytes every
/// step reads; its values are converted to f32 as the kernels load them, and the arithmetic
/// is the f32 kernels'.
#[derive(Debug)]
pub struct HeadMajor<'a, T = f32> {
    pub data: &'a [T],
    pub head_stride: usize,
}

impl<T> Clone for HeadMajor<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for HeadMajor<'_, T> {}

/// Dense attention of one query token over `len` keys, every key visible (a decode step,
/// whose own key is already in the cache): `out [hq, dv] = softmax(scale · q kᵀ) v` per query
/// head, query head `h` reading kv head `h / (hq / hkv)`. `q` is `[hq, d]`. The same online
/// softmax as the selection kernel (NaN from a NaN or infinite key, zeros for `len = 0`), one
/// task per query head.
///
/// ```
/// use fp8nsa_cpu::nsa::{decode_attention, HeadMajor};
/// use fp8nsa_types::AttnDims;
///
/// let dims = AttnDims::new(2, 1, 2, 1)?;
/// // two keys in a buffer with room for four rows
/// let k = [1f32, 0.0, 0.0, 1.0, 9.0, 9.0, 9.0, 9.0];
/// let v = [1f32, 3.0, 9.0, 9.0];
/// let (kv, vv) = (HeadMajor { data: &k, head_stride: 8 }, HeadMajor { data: &v, head_stride: 4 });
/// let mut out = [0f32; 2];
/// decode_attention(&[0.0, 0.0, 5.0, 5.0], kv, vv, dims, 2, 1.0, &mut out)?;
/// assert!((out[0] - 2.0).abs() < 1e-6); // equal scores: the mean
/// assert!((out[1] - 2.0).abs() < 1e-6);
/// assert!(decode_attention(&[0.0; 4], kv, vv, dims, 5, 1.0, &mut out).is_err()); // past the buffer
/// # Ok::<(), fp8nsa_cpu::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn decode_attention<T: KeyElem>(
    q: &[f32],
    k: HeadMajor<'_, T>,
    v: HeadMajor<'_, T>,
    dims: AttnDims,
    len: usize,
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    attend_causal(q, k, v, dims, 1, len, scale, out, true)
}

/// Causal dense attention of `t` new tokens of one sequence over its first `len` rows (the
/// new tokens' own keys included, last): token `i` sits at position `len - t + i` and sees
/// rows `0..=len - t + i`. `q [t, hq, d]`, `out [t, hq, dv]`; otherwise as
/// [`decode_attention`], which is the case `t = 1`. A prefill chunk runs as `t` decode steps
/// would, on the same online softmax (on AVX2 blocked: several tokens' query rows per key
/// load, equal to the decode steps to rounding): no score matrix, no mask, and the keys past
/// each token's position are never read.
///
/// ```
/// use fp8nsa_cpu::nsa::{causal_attention, decode_attention, HeadMajor};
/// use fp8nsa_types::AttnDims;
///
/// let dims = AttnDims::new(1, 1, 2, 1)?;
/// let k = [1f32, 0.0, 0.0, 1.0, 1.0, 1.0];
/// let v = [1f32, 3.0, 8.0];
/// let (kv, vv) = (HeadMajor { data: &k, head_stride: 6 }, HeadMajor { data: &v, head_stride: 3 });
/// let q = [0f32, 0.0, 0.0, 0.0]; // two new tokens at positions 1 and 2, equal scores
/// let mut out = [0f32; 2];
/// causal_attention(&q, kv, vv, dims, 2, 3, 1.0, &mut out)?;
/// assert!((out[0] - 2.0).abs() < 1e-6); // rows 0 and 1
/// assert!((out[1] - 4.0).abs() < 1e-6); // rows 0, 1 and 2
/// // the last token is a decode step over all three rows
/// let mut one = [0f32; 1];
/// decode_attention(&q[2..], kv, vv, dims, 3, 1.0, &mut one)?;
/// assert_eq!(one[0], out[1]);
/// assert!(causal_attention(&q, kv, vv, dims, 2, 1, 1.0, &mut out).is_err()); // t > len
/// # Ok::<(), fp8nsa_cpu::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn causal_attention<T: KeyElem>(
    q: &[f32],
    k: HeadMajor<'_, T>,
    v: HeadMajor<'_, T>,
    dims: AttnDims,
    t: usize,
    len: usize,
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    attend_causal(q, k, v, dims, t, len, scale, out, false)
}

/// `size` elements as a product that may not overflow (an overflow is as wrong a size as any).
pub(super) fn product(arg: &'static str, factors: &[usize]) -> Result<usize> {
    factors
        .iter()
        .try_fold(1usize, |a, &f| a.checked_mul(f))
        .ok_or_else(|| Error::Invalid {
            arg,
            msg: format!("the size {factors:?} overflows"),
        })
}

/// [`causal_attention`]; `decode` (one token, [`decode_attention`]) also takes `len = 0`, an
/// empty cache, which gives zeros.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend_causal<T: KeyElem>(
    q: &[f32],
    k: HeadMajor<'_, T>,
    v: HeadMajor<'_, T>,
    dims: AttnDims,
    t: usize,
    len: usize,
    scale: f32,
    out: &mut [f32],
    decode: bool,
) -> Result<()> {
    // `AttnDims` guarantees hq a multiple of hkv
    let (hq, hkv, d, dv) = (dims.hq(), dims.hkv(), dims.d(), dims.dv());
    if t > len && !(decode && len == 0) {
        return Err(Error::Invalid {
            arg: "t",
            msg: format!("{t} new tokens cannot sit in the first {len} rows"),
        });
    }
    check_len("q", q.len(), product("q", &[t, hq, d])?)?;
    check_len("out", out.len(), product("out", &[t, hq, dv])?)?;
    for (arg, kv, w) in [("k", k, d), ("v", v, dv)] {
        let rows = product(arg, &[len, w])?;
        let need = product(arg, &[hkv - 1, kv.head_stride])?.checked_add(rows);
        if kv.head_stride < rows || need.is_none_or(|n| kv.data.len() < n) {
            return Err(Error::Invalid {
                arg,
                msg: format!(
                    "{len} rows of {w} per head, heads {} apart, need {need:?} values: has {}",
                    kv.head_stride,
                    kv.data.len()
                ),
            });
        }
    }
    if t == 0 {
        return Ok(());
    }
    if len == 0 {
        // a decode step over an empty cache: zeros, as the fold gives a query without keys
        out.fill(0.0);
        return Ok(());
    }
    let g = hq / hkv;
    #[cfg(target_arch = "x86_64")]
    if t > 1 && blocked_fast(g, dv) {
        // a prefill chunk: tasks of a few tokens' rows per kv head, blocked
        let bt = block_tokens(g);
        let tasks: Vec<(usize, usize)> = (0..t)
            .step_by(bt)
            .flat_map(|i0| (0..hkv).map(move |h| (i0, h)))
            .collect();
        let outs: Vec<Vec<f32>> = tasks
            .par_iter()
            .map(|&(i0, h)| {
                let i1 = (i0 + bt).min(t);
                let (rows, lim) = block_rows(q, (i0, i1), len - t + 1, (h, g, hq, d), scale);
                let mut o = vec![0f32; lim.len() * dv];
                // SAFETY: `blocked_fast` held: the AVX2 tier, only detected with AVX2, FMA and
                // F16C.
                unsafe { attend_blocked(&rows, &lim, k.head(h), v.head(h), |j| j, d, dv, &mut o) };
                o
            })
            .collect();
        for (&(i0, h), o) in tasks.iter().zip(&outs) {
            scatter_rows(o, i0, (h, g, hq, dv), out);
        }
        return Ok(());
    }
    // one task per token and kv head, its G query heads together: the head's keys and values
    // are read once per token, not once per query head. With fewer tasks than threads (a
    // decode step of MLA's one latent head) a head's query heads are split into as few groups
    // as keep every thread busy; each group reads the keys again
    let threads = rayon::current_num_threads();
    let split = (1..=g)
        .filter(|s| g % s == 0)
        .find(|&s| t * hkv * s >= threads)
        .unwrap_or(g);
    let hu = g / split;
    // unit u covers query heads u·hu.. of the flattened [t, hq]
    let units = t * hkv * split;
    attend_units(
        units,
        |u| HeadRows {
            q: &q[u * hu * d..(u + 1) * hu * d],
            k: k.head(u % (hkv * split) / split),
            v: v.head(u % (hkv * split) / split),
            d,
            dv,
        },
        |u| len - t + u / (hkv * split) + 1,
        |_, lo, hi| std::iter::once((lo, hi - lo)),
        scale,
        out,
    );
    Ok(())
}

/// Query rows per task of the blocked kernel (a whole number of tokens, each with its G heads).
/// Each task converts and transposes the keys and values it reads into its own tiles, so fewer,
/// larger tasks copy less: 96 rows (32 tokens at G = 3) against 48 made a 1024-token prefill
/// 582 -> 623 tok/s and four 512-token ones 807 -> 842 (medians of three alternating runs,
/// Zen 4); on the AVX2 EPYC 96 and 192 measured no different from 48.
pub(super) const BLOCK_ROWS: usize = 96;

/// Whether [`attend_blocked`] runs for G query heads per kv head and value rows of `dv`: the
/// AVX2 tier, `dv` a multiple of the micro-kernel's 16 columns, G at most [`BLOCK_ROWS`].
pub(super) fn blocked_fast(g: usize, dv: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if dv.is_multiple_of(16)
        && g <= BLOCK_ROWS
        && crate::simd::Tier::current() >= crate::simd::Tier::Avx2
    {
        return true;
    }
    let _ = (g, dv);
    false
}

/// Tokens per task of the blocked kernel for G query heads per kv head.
pub(super) fn block_tokens(g: usize) -> usize {
    (BLOCK_ROWS / g).max(1)
}

/// Softmax attention of the query rows `q [nr, d]` (prescaled), row `r` seeing keys
/// `0..lim[r]`, over one kv head whose key `j` is row `row(j)` of `k [.., d]` / `v [.., dv]`:
/// `o [nr, dv]`. The same online softmax as the fold, blocked for a chunk of prefill tokens
/// whose rows share their keys: 64 keys at a time (their keys transposed once), six rows per
/// micro-kernel call for the scores and again for the weighted sum, so each key and value
/// load feeds six rows instead of one. The special values follow the fold: a `-inf` score (an
/// infinite key) is NaN, NaN scores are left out of the max, a row without keys is zeros; a
/// non-finite value reaches only the rows that attend its key.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (as [`blocked_fast`] checks); the sizes are checked,
/// panicking.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn attend_blocked<T: KeyElem>(
    q: &[f32],
    lim: &[usize],
    k: &[T],
    v: &[T],
    row: impl Fn(usize) -> usize,
    d: usize,
    dv: usize,
    o: &mut [f32],
) {
    use crate::x86::{mk_6x16, MK_MR as MR, MK_NR as NR};
    // keys per softmax step: four of the micro-kernel's column groups, so each row's max,
    // rescale and exponentials serve 64 keys
    const KC: usize = 4 * NR;
    let nr = lim.len();
    assert!(q.len() == nr * d && o.len() == nr * dv && d > 0 && dv.is_multiple_of(NR));
    let nb = nr.div_ceil(MR);
    // the rows as [block][d][6], zeros past nr
    let mut qp = vec![0f32; nb * d * MR];
    for (r, qr) in q.chunks_exact(d).take(nr).enumerate() {
        let blk = &mut qp[(r / MR) * d * MR..];
        for (c, &x) in qr.iter().enumerate() {
            blk[c * MR + r % MR] = x;
        }
    }
    let mut kt = vec![0f32; d * KC];
    let mut krow = vec![0f32; d];
    let mut vc = vec![0f32; KC * dv];
    let mut sb = vec![0f32; MR * KC];
    let mut pp = vec![0f32; KC * MR];
    let mut acc = vec![0f32; nb * MR * dv];
    let (mut m, mut l) = (vec![f32::NEG_INFINITY; nr], vec![0f32; nr]);
    let end = lim.iter().copied().max().unwrap_or(0);
    for j0 in (0..end).step_by(KC) {
        let kc = KC.min(end - j0);
        // column groups of 16 keys that hold any key
        let groups = kc.div_ceil(NR);
        let mut finite_v = true;
        for jj in 0..groups * NR {
            if jj < kc {
                let rj = row(j0 + jj);
                // the tile's copies are where a 16-bit cache becomes f32: the key row converted
                // as a whole (vector conversions; per element it is a call each), then
                // transposed into its column
                let key: &[f32] = match T::as_f32(&k[rj * d..(rj + 1) * d]) {
                    Some(row) => row,
                    None => {
                        // SAFETY: this function's contract (AVX2, FMA, F16C).
                        unsafe { widen_row(&k[rj * d..(rj + 1) * d], &mut krow) };
                        &krow
                    }
                };
                for (c, &x) in key.iter().enumerate() {
                    kt[c * KC + jj] = x;
                }
                let vr = &mut vc[jj * dv..(jj + 1) * dv];
                // SAFETY: as above.
                unsafe { widen_row(&v[rj * dv..(rj + 1) * dv], vr) };
                // an all-ones exponent is Inf or NaN; OR-ed without a branch, so it vectorizes
                let special = vr.iter().fold(0u32, |a, &x| {
                    a | u32::from(x.to_bits() & 0x7f80_0000 == 0x7f80_0000)
                });
                finite_v &= special == 0;
            } else {
                for c in 0..d {
                    kt[c * KC + jj] = 0.0;
                }
                vc[jj * dv..(jj + 1) * dv].fill(0.0);
            }
        }
        for b in 0..nb {
            // how many of the chunk's keys each row of the block sees
            let see: [usize; MR] = std::array::from_fn(|rr| {
                let r = b * MR + rr;
                if r < nr {
                    lim[r].saturating_sub(j0).min(kc)
                } else {
                    0
                }
            });
            let most = see.iter().copied().max().unwrap_or(0);
            if most == 0 {
                continue;
            }
            let used = most.div_ceil(NR); // column groups any row of the block sees
            for jc in 0..used {
                // SAFETY: this function runs only with AVX2 and FMA (its contract); the
                // kernel checks the sizes.
                unsafe {
                    mk_6x16(
                        d,
                        &qp[b * d * MR..],
                        &kt[jc * NR..],
                        KC,
                        &mut sb[jc * NR..],
                        KC,
                        None,
                    )
                };
            }
            let width = used * NR;
            let mut alpha = [1f32; MR];
            for (rr, &n) in see.iter().enumerate() {
                let r = b * MR + rr;
                let sr = &mut sb[rr * KC..rr * KC + width];
                if n == 0 {
                    for jj in 0..width {
                        pp[jj * MR + rr] = 0.0;
                    }
                    continue;
                }
                // a -inf score (an infinite key) becomes NaN below, in the exponentials' pass;
                // the maximum is the same with it as without (NaN is left out of it)
                let mx = max_skip_nan(m[r], &sr[..n]);
                let al = (m[r] - mx).exp();
                // the exponentials in place, the keys past the row's limit zeroed, summed by
                // sixteen lanes (every lane written: a pass that rewrote only the -inf lanes
                // compiled to a masked store, which AMD cores run microcoded)
                let mut lanes = [0f32; NR];
                for (g16, chunk) in sr.chunks_exact_mut(NR).enumerate() {
                    for (jj, x) in chunk.iter_mut().enumerate() {
                        let p = if *x == f32::NEG_INFINITY {
                            f32::NAN
                        } else {
                            exp_nonpos(*x - mx)
                        };
                        *x = if g16 * NR + jj < n { p } else { 0.0 };
                    }
                    for (a, &x) in lanes.iter_mut().zip(chunk.iter()) {
                        *a += x;
                    }
                }
                for (jj, &p) in sr.iter().enumerate() {
                    pp[jj * MR + rr] = p;
                }
                m[r] = mx;
                l[r] = l[r] * al + crate::simd::hsum16(lanes);
                alpha[rr] = al;
            }
            let ab = &mut acc[b * MR * dv..(b + 1) * MR * dv];
            if finite_v {
                for c0 in (0..dv).step_by(NR) {
                    // SAFETY: as above.
                    unsafe { mk_6x16(width, &pp, &vc[c0..], dv, &mut ab[c0..], dv, Some(&alpha)) };
                }
            } else {
                // 0 · inf is NaN: each row adds only the values of the keys it sees
                for (rr, &n) in see.iter().enumerate() {
                    let orow = &mut ab[rr * dv..(rr + 1) * dv];
                    for x in orow.iter_mut() {
                        *x *= alpha[rr];
                    }
                    for jj in 0..n {
                        let p = pp[jj * MR + rr];
                        for (x, &y) in orow.iter_mut().zip(&vc[jj * dv..(jj + 1) * dv]) {
                            *x += p * y;
                        }
                    }
                }
            }
        }
    }
    for ((orow, arow), &l) in o.chunks_exact_mut(dv).zip(acc.chunks_exact(dv)).zip(&l) {
        // l is 0 only without keys (zeros, as in the fold); a NaN l stays NaN
        let inv = if l != 0.0 { 1.0 / l } else { 0.0 };
        for (x, &a) in orow.iter_mut().zip(arow) {
            *x = a * inv;
        }
    }
}

/// `src` as f32 into `dst` (the common length), eight elements per load (`Lanes::load8`:
/// F16C for f16, a shift for bf16, a plain load for f32), inlined into the caller's loop where
/// a slice conversion would be a call per short row.
///
/// # Safety
/// The CPU must have AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(super) unsafe fn widen_row<T: KeyElem>(src: &[T], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n, both slices hold n elements; the caller's CPU has AVX2 and F16C.
        unsafe {
            std::arch::x86_64::_mm256_storeu_ps(
                dst.as_mut_ptr().add(i),
                T::load8(src.as_ptr().add(i)),
            )
        };
        i += 8;
    }
    for j in i..n {
        dst[j] = src[j].into();
    }
}

/// `f32::max` folded over `xs` from `init` (NaN entries left out, as `f32::max` leaves a NaN
/// operand out), eight independent lanes so that it vectorizes instead of a chain of dependent
/// compares. The same value as the sequential fold: the maximum of a set does not depend on the
/// order (a zero's sign may differ, which no use of the maximum here can see).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn max_skip_nan(init: f32, xs: &[f32]) -> f32 {
    let mut lanes = [init; 8];
    let mut chunks = xs.chunks_exact(8);
    for c in &mut chunks {
        for (a, &x) in lanes.iter_mut().zip(c) {
            // false for a NaN x: the lane keeps its value
            *a = if x > *a { x } else { *a };
        }
    }
    let tail = chunks.remainder().iter().fold(init, |a, &b| a.max(b));
    lanes.iter().fold(tail, |a, &b| a.max(b))
}

/// The rows of a blocked task: tokens `i0..i1` of a chunk whose token `i` sits at query row
/// `i` of `q [.., hq, d]` and sees `lim0 + i` keys, kv head `h`'s G query heads each.
/// Returns the prescaled query rows and their key limits, row `(i - i0) · g + gi`.
#[cfg(target_arch = "x86_64")]
pub(super) fn block_rows(
    q: &[f32],
    (i0, i1): (usize, usize),
    lim0: usize,
    (h, g, hq, d): (usize, usize, usize, usize),
    scale: f32,
) -> (Vec<f32>, Vec<usize>) {
    let mut rows = Vec::with_capacity((i1 - i0) * g * d);
    let mut lim = Vec::with_capacity((i1 - i0) * g);
    for i in i0..i1 {
        let qi = &q[(i * hq + h * g) * d..(i * hq + (h + 1) * g) * d];
        rows.extend(qi.iter().map(|x| x * scale));
        lim.extend(std::iter::repeat_n(lim0 + i, g));
    }
    (rows, lim)
}

/// Writes a task's output rows (token by token, each token's G heads) into `out [.., hq, dv]`.
pub(super) fn scatter_rows(
    o: &[f32],
    i0: usize,
    (h, g, hq, dv): (usize, usize, usize, usize),
    out: &mut [f32],
) {
    for (r, orow) in o.chunks_exact(g * dv).enumerate() {
        let i = i0 + r;
        out[(i * hq + h * g) * dv..(i * hq + (h + 1) * g) * dv].copy_from_slice(orow);
    }
}

impl<'a, T> HeadMajor<'a, T> {
    /// Kv head `h`'s rows onward.
    pub(super) fn head(&self, h: usize) -> &'a [T] {
        &self.data[h * self.head_stride..]
    }
}

/// The query heads of one kv head at a decode step (`q [g, d]`) and that kv head's rows (`k` /
/// `v` from row 0 of the head).
pub(super) struct HeadRows<'a, T> {
    pub(super) q: &'a [f32],
    pub(super) k: &'a [T],
    pub(super) v: &'a [T],
    pub(super) d: usize,
    pub(super) dv: usize,
}

impl<T: KeyElem> HeadRows<'_, T> {
    /// `o [g, dv] = softmax(scale · q kᵀ) v` over the rows of `runs` (`(first row, rows)`, in
    /// order), folded CHUNK rows at a time by the online softmax of the selection kernel, all
    /// g query heads per chunk; a chunk takes its rows from as many runs (pages) as it needs.
    pub(super) fn attend(
        &self,
        runs: impl IntoIterator<Item = (usize, usize)>,
        scale: f32,
        o: &mut [f32],
    ) {
        self.fold(runs, scale, |st| st.finish(o))
    }

    /// [`Self::attend`]'s online-softmax state before the final division (for merging the
    /// states of key parts folded apart).
    ///
    /// The state lives in this thread's [`FOLD`] scratch, handed to `then`: a decode step
    /// folds a few hundred times and allocates nothing for it.
    fn fold<R>(
        &self,
        runs: impl IntoIterator<Item = (usize, usize)>,
        scale: f32,
        then: impl FnOnce(&Softmax) -> R,
    ) -> R {
        FOLD.with(|f| {
            // a fold never runs another on its thread (no pool work inside), so the borrow is
            // free; a panic mid-fold poisons nothing: the next fold resets every buffer
            let mut f = f.borrow_mut();
            let FoldScratch { st, qh, scores } = &mut *f;
            self.fold_in(runs, scale, st, qh, scores);
            then(st)
        })
    }

    fn fold_in(
        &self,
        runs: impl IntoIterator<Item = (usize, usize)>,
        scale: f32,
        st: &mut Softmax,
        qh: &mut Vec<f32>,
        scores: &mut Vec<f32>,
    ) {
        let (d, dv) = (self.d, self.dv);
        let g = self.q.len() / d;
        qh.clear();
        qh.extend(self.q.iter().map(|x| x * scale));
        st.reset(g, dv);
        scores.clear();
        scores.resize(g * CHUNK, 0.0);
        let (qh, scores) = (&qh[..], &mut scores[..]);
        let kernel = fold_kernel(d, dv);
        // rows read in place, a 16-bit cache's converted in the fold's loads
        let fold = |rows: &[u32], ahead: &[u32], st: &mut Softmax, scores: &mut [f32]| {
            fold_rows(kernel, qh, self.k, self.v, rows, d, dv, st, scores, ahead)
        };
        // two chunks of rows: a chunk folds once the next one is known, which the fold
        // prefetches as it goes (a decode step reads every sequence's cache from memory, and
        // the hardware prefetcher does not run ahead of short runs of rows)
        let mut rows = [[0u32; CHUNK]; 2];
        let (mut cur, mut n, mut full) = (0, 0, false);
        for (r0, len) in runs {
            for r in r0..r0 + len {
                rows[cur][n] = r as u32;
                n += 1;
                if n == CHUNK {
                    if full {
                        fold(&rows[1 - cur], &rows[cur], st, scores);
                    }
                    full = true;
                    cur = 1 - cur;
                    n = 0;
                }
            }
        }
        if full {
            fold(&rows[1 - cur], &rows[cur][..n], st, scores);
        }
        fold(&rows[cur][..n], &[], st, scores);
    }
}

/// A thread's reused state and buffers for [`HeadRows::fold`].
#[derive(Default)]
pub(super) struct FoldScratch {
    st: Softmax,
    qh: Vec<f32>,
    scores: Vec<f32>,
}

thread_local! {
    static FOLD: std::cell::RefCell<FoldScratch> = std::cell::RefCell::new(FoldScratch::default());
}

/// `units` decode queries (one token's G query heads of one kv head each) into `out [units,
/// g·dv]`: `head(u)` is unit `u`'s queries and kv head, `keys(u)` how many rows it sees, and
/// `runs(u, lo, hi)` where its rows `lo..hi` lie. One task per unit, or, where that would
/// leave threads idle ([`key_parts`]), per part of a unit's keys, the parts' states merged.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend_units<'a, T, I>(
    units: usize,
    head: impl Fn(usize) -> HeadRows<'a, T> + Sync,
    keys: impl Fn(usize) -> usize + Sync,
    runs: impl Fn(usize, usize, usize) -> I + Sync,
    scale: f32,
    out: &mut [f32],
) where
    T: KeyElem + 'a,
    I: Iterator<Item = (usize, usize)>,
{
    if units == 0 {
        return;
    }
    let w = out.len() / units;
    let most = (0..units).map(&keys).max().unwrap_or(0);
    let parts = key_parts(units, rayon::current_num_threads(), most);
    if parts == 1 {
        out.par_chunks_mut(w).enumerate().for_each(|(u, o)| {
            head(u).attend(runs(u, 0, keys(u)), scale, o);
        });
        return;
    }
    // each part's state stored in one reused buffer, then merged per unit
    let (g, dv) = {
        let h = head(0);
        (h.q.len() / h.d, h.dv)
    };
    let stride = Softmax::stored_len(g, dv);
    with_f32(units * parts * stride, |states| {
        states
            .par_chunks_mut(stride)
            .enumerate()
            .for_each(|(i, slot)| {
                let (u, p) = (i / parts, i % parts);
                let (lo, hi) = part_rows(keys(u), parts, p);
                head(u).fold(runs(u, lo, hi), scale, |st| st.store(slot));
            });
        for (u, o) in out.chunks_exact_mut(w).enumerate() {
            Softmax::finish_merged(&states[u * parts * stride..(u + 1) * parts * stride], g, o);
        }
    });
}
