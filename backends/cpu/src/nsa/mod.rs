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
use crate::scratch::with_f32;
use crate::simd::{dot, exp_nonpos, hsum16, simd_dispatch, Arith};
use fp8nsa_types::{AttnDims, Pages, Seq, Spans};

mod causal;
mod paged;
mod selection;
#[cfg(test)]
mod tests;

use causal::*;

pub use causal::{causal_attention, decode_attention, HeadMajor};
pub use paged::{causal_attention_paged, decode_attention_paged, PagedChunk, PagedSeq};
pub use selection::{plan, plan_paged, selection_attention, SelectionPlan};

/// Keys per softmax step: scores for this many keys and all G heads are computed before the
/// running max and sums are updated.
const CHUNK: usize = 64;

/// Online-softmax state of `g` query heads.
#[derive(Default)]
struct Softmax {
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
}

impl Softmax {
    /// Back to the state before any key, for `g` heads of `dv` values, in the vectors' own
    /// memory (a reused state allocates nothing once it has held that many heads).
    fn reset(&mut self, g: usize, dv: usize) {
        self.m.clear();
        self.m.resize(g, f32::NEG_INFINITY);
        self.l.clear();
        self.l.resize(g, 0.0);
        self.acc.clear();
        self.acc.resize(g * dv, 0.0);
    }

    /// Floats [`Self::store`] writes for `g` heads of `dv` values.
    fn stored_len(g: usize, dv: usize) -> usize {
        g * (dv + 2)
    }

    /// The state into `slot` (`[m | l | acc]`, [`Self::stored_len`] floats), where
    /// [`Self::finish_merged`] reads it.
    fn store(&self, slot: &mut [f32]) {
        let g = self.m.len();
        let (m, rest) = slot.split_at_mut(g);
        let (l, acc) = rest.split_at_mut(g);
        m.copy_from_slice(&self.m);
        l.copy_from_slice(&self.l);
        acc.copy_from_slice(&self.acc);
    }

    /// `o [g, dv]`: the weighted sums over the folded keys. A head without keys gives zeros
    /// (as the selection kernel does); a NaN `l` stays NaN.
    fn finish(&self, o: &mut [f32]) {
        let dv = self.acc.len() / self.l.len().max(1);
        for ((o, a), &l) in o
            .chunks_exact_mut(dv)
            .zip(self.acc.chunks_exact(dv))
            .zip(&self.l)
        {
            let inv = if l != 0.0 { 1.0 / l } else { 0.0 };
            for (o, a) in o.iter_mut().zip(a) {
                *o = a * inv;
            }
        }
    }

    /// [`Self::finish`] of the states of disjoint key parts of the same queries, each rescaled
    /// to the largest running max: one fold over all the parts gives the same to rounding. A
    /// part without keys (`l = 0`) adds nothing; a NaN in any part's max or sum makes its head
    /// NaN, as in one fold.
    ///
    /// The parts are the [`Self::store`]d states in `parts` (each [`Self::stored_len`] floats
    /// for `g` heads), `o` is `[g, dv]`.
    fn finish_merged(parts: &[f32], g: usize, o: &mut [f32]) {
        let dv = o.len() / g.max(1);
        let stride = Self::stored_len(g, dv);
        if parts.len() < stride {
            return o.fill(0.0);
        }
        // part p's max, sum and weighted sums of head h
        let mh = |p: &[f32], h: usize| p[h];
        let lh = |p: &[f32], h: usize| p[g + h];
        fn acch(p: &[f32], g: usize, dv: usize, h: usize) -> &[f32] {
            &p[2 * g + h * dv..2 * g + (h + 1) * dv]
        }
        for (h, oh) in o.chunks_exact_mut(dv).enumerate().take(g) {
            let top = parts
                .chunks_exact(stride)
                .filter(|p| lh(p, h) != 0.0)
                .map(|p| mh(p, h))
                .fold(f32::NEG_INFINITY, |a, x| if x > a { x } else { a });
            let mut l = 0f32;
            oh.fill(0.0);
            for p in parts.chunks_exact(stride).filter(|p| lh(p, h) != 0.0) {
                // a NaN max gives a NaN factor
                let w = (mh(p, h) - top).exp();
                l += lh(p, h) * w;
                for (o, a) in oh.iter_mut().zip(acch(p, g, dv, h)) {
                    *o += a * w;
                }
            }
            let inv = if l != 0.0 { 1.0 / l } else { 0.0 };
            for o in oh.iter_mut() {
                *o *= inv;
            }
        }
    }
}

/// Fewest keys per part when a decode step's keys are split between threads
/// ([`key_parts`]): below this the split's merge and extra tasks cost more than the idle
/// thread it saves.
const PART_MIN: usize = 2 * CHUNK;

/// Into how many parts each query unit's `keys` are split (1: not split) when `units` tasks of
/// equal work would leave threads idle: fewer than four per thread and not a multiple of the
/// thread count. SmolLM2's three kv heads on two threads keep one thread idle for a third of
/// the attention; split in two, the six parts go three to each.
fn key_parts(units: usize, threads: usize, keys: usize) -> usize {
    if units == 0 || threads <= 1 || units.is_multiple_of(threads) || units >= 4 * threads {
        return 1;
    }
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    (threads / gcd(units, threads)).min(keys / PART_MIN).max(1)
}

/// Rows `lo..hi` of `parts` near-equal parts of `n` rows, part `p`: boundaries on multiples of
/// [`CHUNK`] where the parts are long enough, so each part folds whole chunks but its last.
fn part_rows(n: usize, parts: usize, p: usize) -> (usize, usize) {
    let at = |i: usize| {
        if i >= parts {
            n
        } else {
            (n * i / parts) / CHUNK * CHUNK
        }
    };
    (at(p), at(p + 1))
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
            let x = dot::<A>(qg, kj);
            // finite inputs cannot give -inf (short of overflow): it comes from an Inf in the
            // key, and as exp(-inf) = 0 it would vanish instead of making the query NaN
            *sj = if x == f32::NEG_INFINITY { f32::NAN } else { x };
        }
        let mx = s.iter().fold(m[gi], |a, &b| a.max(b));
        let alpha = (m[gi] - mx).exp();
        // every `sj - mx` is <= 0 (or NaN, which stays NaN), the domain of `exp_nonpos`; the
        // sum in 16 lanes, as the dot products
        let mut lanes = [0f32; 16];
        for c in s.chunks_mut(16) {
            for (l, sj) in lanes.iter_mut().zip(c.iter_mut()) {
                *sj = exp_nonpos(*sj - mx);
                *l += *sj;
            }
        }
        let sum = hsum16(lanes);
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

simd_dispatch!(fn fold_chunk_portable => fold_chunk_impl(
    q: &[f32], kc: &[f32], vc: &[f32], d: usize, dv: usize, st: &mut Softmax, scores: &mut [f32]
));

/// Row numbers `0..CHUNK`, the rows of a contiguous chunk.
const CHUNK_ROWS: [u32; CHUNK] = {
    let mut r = [0u32; CHUNK];
    let mut i = 0;
    while i < CHUNK {
        r[i] = i as u32;
        i += 1;
    }
    r
};

/// Which fold [`fold_rows`] runs, decided once per call by [`fold_kernel`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FoldKernel {
    /// Run by run of consecutive rows through [`fold_chunk_portable`].
    Portable,
    /// `x86::fold_chunk8`: head sizes multiples of 8, one head per pass.
    Avx2,
    /// `avx512::fold_chunk16`: head sizes multiples of 16, up to three heads per pass.
    Avx512,
}

/// The fold for these head sizes at the tier in force.
fn fold_kernel(d: usize, dv: usize) -> FoldKernel {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::simd::Tier;
        let tier = Tier::current();
        if d.is_multiple_of(16) && dv.is_multiple_of(16) && tier >= Tier::Avx512 {
            return FoldKernel::Avx512;
        }
        if d.is_multiple_of(8) && dv.is_multiple_of(8) && tier >= Tier::Avx2 {
            return FoldKernel::Avx2;
        }
    }
    let _ = (d, dv);
    FoldKernel::Portable
}

/// [`fold_chunk_impl`] over the key rows `rows` (at most CHUNK, any rows of `k [.., d]` /
/// `v [.., dv]`) by `kernel` (from [`fold_kernel`]); the portable one goes run by run of
/// consecutive rows (the same sums in another order: the kernels agree to rounding).
/// `scores` must hold `g · CHUNK` values. The x86 kernels prefetch the rows `ahead` (the next
/// chunk's, or none) as they go.
#[allow(clippy::too_many_arguments)]
fn fold_rows<T: KeyElem>(
    kernel: FoldKernel,
    q: &[f32],
    k: &[T],
    v: &[T],
    rows: &[u32],
    d: usize,
    dv: usize,
    st: &mut Softmax,
    scores: &mut [f32],
    ahead: &[u32],
) {
    #[cfg(target_arch = "x86_64")]
    match kernel {
        FoldKernel::Avx2 => {
            let Softmax { m, l, acc } = st;
            // SAFETY: `Avx2` comes from `fold_kernel`: the AVX2 tier (only detected with AVX2,
            // FMA and F16C present) and head sizes that are multiples of 8; the kernel checks
            // the rest.
            unsafe { crate::x86::fold_chunk8(q, k, v, rows, d, dv, m, l, acc, scores, ahead) };
            return;
        }
        FoldKernel::Avx512 => {
            // the heads three at a time (the kernel's register budget), the rows prefetched
            // by the first pass only
            let g = q.len() / d;
            for h0 in (0..g).step_by(3) {
                let n = 3.min(g - h0);
                let q = &q[h0 * d..(h0 + n) * d];
                let (m, l) = (&mut st.m[h0..], &mut st.l[h0..]);
                let acc = &mut st.acc[h0 * dv..];
                let ahead = if h0 == 0 { ahead } else { &[] };
                use crate::avx512::fold_chunk16 as f;
                // SAFETY: `Avx512` comes from `fold_kernel`: the AVX-512 tier (only detected
                // with AVX-512 F, AVX2, FMA and F16C present) and head sizes that are
                // multiples of 16; the kernel checks the rest.
                unsafe {
                    match n {
                        1 => f::<T, 1>(q, k, v, rows, d, dv, m, l, acc, scores, ahead),
                        2 => f::<T, 2>(q, k, v, rows, d, dv, m, l, acc, scores, ahead),
                        _ => f::<T, 3>(q, k, v, rows, d, dv, m, l, acc, scores, ahead),
                    }
                }
            }
            return;
        }
        FoldKernel::Portable => {}
    }
    let _ = (kernel, ahead);
    let mut i = 0;
    while i < rows.len() {
        let mut j = i + 1;
        while j < rows.len() && rows[j] == rows[j - 1] + 1 {
            j += 1;
        }
        let (a, b) = (rows[i] as usize, rows[j - 1] as usize + 1);
        let (kr, vr) = (&k[a * d..b * d], &v[a * dv..b * dv]);
        match T::as_f32(kr).zip(T::as_f32(vr)) {
            Some((kr, vr)) => fold_chunk_portable(q, kr, vr, d, dv, st, scores),
            // a 16-bit run widened into this thread's kept buffers
            None => with_f32(kr.len(), |kc| {
                with_f32(vr.len(), |vc| {
                    T::copy_f32(kr, kc);
                    T::copy_f32(vr, vc);
                    fold_chunk_portable(q, kc, vc, d, dv, st, scores);
                })
            }),
        }
        i = j;
    }
}

/// [`fold_rows`] over a contiguous chunk `kc [c, d]` / `vc [c, dv]` (`c <= CHUNK`).
fn fold_chunk(
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    d: usize,
    dv: usize,
    st: &mut Softmax,
    scores: &mut [f32],
) {
    let c = kc.len() / d;
    fold_rows(
        fold_kernel(d, dv),
        q,
        kc,
        vc,
        &CHUNK_ROWS[..c],
        d,
        dv,
        st,
        scores,
        &[],
    )
}

/// The fold's loads of eight elements (x86: `x86::Lanes`, converting 16-bit rows in the load);
/// elsewhere no requirement.
#[cfg(target_arch = "x86_64")]
use crate::x86::Lanes;
#[cfg(not(target_arch = "x86_64"))]
pub trait Lanes {}
#[cfg(not(target_arch = "x86_64"))]
impl Lanes for f32 {}
#[cfg(not(target_arch = "x86_64"))]
impl Lanes for half::f16 {}
#[cfg(not(target_arch = "x86_64"))]
impl Lanes for half::bf16 {}

/// An element type the attention kernels read: f32, bf16 or f16. Rows are read in place; the
/// AVX2 fold converts 16-bit ones in its loads, the blocked kernel in its 64-key tile copies,
/// the portable fold into a chunk buffer first.
pub trait KeyElem: Copy + Into<f32> + Send + Sync + Lanes {
    /// The slice itself when the elements are f32.
    fn as_f32(s: &[Self]) -> Option<&[f32]>;

    /// `src` converted to f32 into `dst` (of the same length).
    fn copy_f32(src: &[Self], dst: &mut [f32]) {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = x.into();
        }
    }

    /// Appends `src` converted to f32 to `dst`.
    fn extend_f32(dst: &mut Vec<f32>, src: &[Self]) {
        let n = dst.len();
        dst.resize(n + src.len(), 0.0);
        Self::copy_f32(src, &mut dst[n..]);
    }

    /// `src` rounded to this type (to nearest, ties to even: as Candle's `to_dtype`) into `dst`
    /// (of the same length).
    fn copy_from_f32(src: &[f32], dst: &mut [Self]);
}

impl KeyElem for f32 {
    fn as_f32(s: &[f32]) -> Option<&[f32]> {
        Some(s)
    }

    fn copy_f32(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    fn copy_from_f32(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl KeyElem for half::bf16 {
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }

    fn copy_from_f32(src: &[f32], dst: &mut [Self]) {
        use half::slice::HalfFloatSliceExt;
        dst.convert_from_f32_slice(src);
    }
}

impl KeyElem for half::f16 {
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }

    fn copy_f32(src: &[Self], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        // the slice form converts 8 at a time with F16C where the CPU has it
        src.convert_to_f32_slice(dst);
    }

    fn copy_from_f32(src: &[f32], dst: &mut [Self]) {
        use half::slice::HalfFloatSliceExt;
        dst.convert_from_f32_slice(src);
    }
}

/// Writes new tokens' keys (or values) into a head-major cache or page pool, in place, each
/// rounded once to the pool's type: `src [t, h, w]` (token-major f32, as a projection gives
/// them, `t = rows.len()`) goes to row `rows[i]` of every head of `dst` (head `hh` from
/// `hh · head_stride`, row `r` at `r · w` within it), the layout [`HeadMajor`] reads. One
/// pass, no transposed copy. A row past a head's `head_stride`, or a `dst` too short for the
/// last head's rows, is [`Error::Invalid`] and nothing is written.
///
/// ```
/// use fp8nsa_cpu::nsa::write_rows;
///
/// // a pool of 2 heads x 3 rows of width 2; one new token (2 heads) to row 1
/// let mut pool = [0f32; 12];
/// write_rows(&[1.0, 2.0, 3.0, 4.0], 2, 2, &[1], &mut pool, 6)?;
/// assert_eq!(pool, [0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 3.0, 4.0, 0.0, 0.0]);
/// assert!(write_rows(&[1.0; 4], 2, 2, &[3], &mut pool, 6).is_err()); // row 3 of 3
/// # Ok::<(), fp8nsa_cpu::Error>(())
/// ```
pub fn write_rows<T: KeyElem>(
    src: &[f32],
    h: usize,
    w: usize,
    rows: &[usize],
    dst: &mut [T],
    head_stride: usize,
) -> Result<()> {
    check_positive("h", h)?;
    check_positive("w", w)?;
    check_len("src", src.len(), product("src", &[rows.len(), h, w])?)?;
    let Some(&top) = rows.iter().max() else {
        return Ok(());
    };
    let end = product("rows", &[top + 1, w])?;
    let need = product("dst", &[h - 1, head_stride])?.checked_add(end);
    if end > head_stride || need.is_none_or(|n| dst.len() < n) {
        return Err(Error::Invalid {
            arg: "rows",
            msg: format!(
                "row {top} of width {w} in {h} heads {head_stride} apart: {need:?} values, \
                 the pool holds {}",
                dst.len()
            ),
        });
    }
    for (&r, tok) in rows.iter().zip(src.chunks_exact(h * w)) {
        for (hh, x) in tok.chunks_exact(w).enumerate() {
            let at = hh * head_stride + r * w;
            T::copy_from_f32(x, &mut dst[at..at + w]);
        }
    }
    Ok(())
}
