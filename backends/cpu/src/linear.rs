//! `y = x · Wᵀ` with fp8 block-scaled weights, two kernels:
//! - [`CpuFp8Kernel::Gemv`] for `m <= GEMV_MAX_M` (decode): streams each weight byte once. At
//!   M = 1 it decodes in registers and applies `sx · sw` per K-block to the f32 partial dot
//!   product (four weight rows per pass on the AVX2 tier). For M > 1 on the AVX2 tier it
//!   decodes three weight rows at a time with their block scales into a small buffer and
//!   multiplies them with activations already multiplied by theirs (the panel GEMM's
//!   distribution of the scaling, below), four activation rows at a time in registers; the
//!   portable tier applies `sx · sw` per K-block as at M = 1;
//! - [`CpuFp8Kernel::PanelGemm`] otherwise: dequantizes a cache-sized panel of weight rows (codes
//!   times their block scale) and multiplies it with the dequantized activations using the `gemm`
//!   crate. Scaling each factor by its own block scale before the product is the contract's
//!   per-K-block scaling, distributed over the sum.
//!
//! On CPUs with AVX512-BF16 and VBMI (`Tier::Avx512Bf16`), W8A8 calls of both kernels multiply
//! bf16 pairs instead (`avx512bf16`): the e4m3 weights and activations are exact in bf16, the
//! products exact in f32, and each (row, row, K-block) partial is scaled by `sx · sw`. There calls
//! of 10..=16 rows are planned as the panel GEMM (its micro-kernel on a single tile of rows).
//! [`plan`] decides kernel and tier once; the path it reports is the one [`LinearPlan::run`]
//! runs.

use rayon::prelude::*;

use crate::error::{check_len, check_positive, Result};
use crate::fp8::{decode_scaled, e4m3_to_f32};
use crate::quant::{quantize_act_in, QuantizedAct};
use crate::scratch::with_f32;
use crate::simd::{dot, simd_dispatch, Arith, Tier};
use fp8nsa_types::{ActQuant, CpuFp8Kernel, CpuFp8Path, LinearShape};

/// Largest `m` served by the GEMV kernel.
pub const GEMV_MAX_M: usize = 16;

/// One checked call: a valid shape and activation scheme, and the kernel and SIMD tier chosen
/// for them. Made once by [`plan`]; [`LinearPlan::run`] executes it without deciding anything
/// again, so [`LinearPlan::path`] is the path that runs.
///
/// ```
/// use fp8nsa_cpu::linear::plan;
/// use fp8nsa_types::{ActQuant, CpuFp8Kernel, LinearShape, Tier};
///
/// let shape = LinearShape::new(1, 2, 3, 128, 128)?;
/// let p = plan(shape, ActQuant::Group)?;
/// assert_eq!(p.path().kernel, CpuFp8Kernel::Gemv);
/// assert_eq!(p.path().tier, Tier::current());
/// let w = [0x38u8; 6]; // e4m3 1.0
/// let mut y = [0f32; 2];
/// p.run(&[2.0, 2.0, 2.0], &w, &[0.5], None, &mut y)?;
/// assert!(y.iter().all(|y| (y - 3.0).abs() < 1e-5), "{y:?}"); // 0.5 * (2 + 2 + 2)
/// assert!(plan(shape, ActQuant::Block2d { bm: 0 }).is_err());
/// # Ok::<(), fp8nsa_cpu::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearPlan {
    shape: LinearShape,
    act: ActQuant,
    kernel: CpuFp8Kernel,
    tier: Tier,
    nan_free: bool,
}

/// Checks a call's shape and activation scheme and picks its kernel at the tier in force
/// ([`Tier::current`], read once here): the GEMV up to [`GEMV_MAX_M`] rows, except from
/// `BF16_TILE_MIN_M` rows on the AVX512-BF16 tier, where the panel GEMM's micro-kernel runs
/// them as one tile; the panel GEMM past that.
pub fn plan(shape: LinearShape, act: ActQuant) -> Result<LinearPlan> {
    if let ActQuant::Block2d { bm } = act {
        check_positive("bm", bm)?;
    }
    let tier = Tier::current();
    let m = shape.m();
    let kernel = if m > GEMV_MAX_M || (m >= BF16_TILE_MIN_M && uses_bf16(tier, act)) {
        CpuFp8Kernel::PanelGemm
    } else {
        CpuFp8Kernel::Gemv
    };
    Ok(LinearPlan {
        shape,
        act,
        kernel,
        tier,
        nan_free: false,
    })
}

impl LinearPlan {
    /// The kernel and tier [`Self::run`] runs.
    pub fn path(&self) -> CpuFp8Path {
        CpuFp8Path {
            kernel: self.kernel,
            tier: self.tier,
        }
    }

    pub fn shape(&self) -> LinearShape {
        self.shape
    }

    /// Declares that the weight this plan runs on holds no NaN code (`0x7f` / `0xff`), which
    /// lets the M = 1 AVX2 kernel skip its per-code NaN scan (~15% of its time). Weights are
    /// immutable, so a caller checks once per weight (`Fp8BlockWeight` does). A false claim
    /// gives finite garbage instead of NaN in the affected outputs, nothing worse.
    pub fn assume_nan_free(mut self, nan_free: bool) -> Self {
        self.nan_free = nan_free;
        self
    }

    /// Computes `out [m, n] = x [m, k] · dequant(W)ᵀ + bias` per the numerics contract.
    ///
    /// `w` holds e4m3fn codes `[n, k]`, `sw` the scales `[ceil(n/bn), ceil(k/bk)]`, `bias` has
    /// `n` entries. Activations are quantized dynamically according to the plan's scheme. The
    /// buffers must have the plan's sizes (`Error::Shape` naming the buffer otherwise).
    pub fn run(
        &self,
        x: &[f32],
        w: &[u8],
        sw: &[f32],
        bias: Option<&[f32]>,
        out: &mut [f32],
    ) -> Result<()> {
        let (s, act, kernel) = (self.shape, self.act, self.kernel);
        check_len("x", x.len(), s.m() * s.k())?;
        check_len("weight", w.len(), s.n() * s.k())?;
        check_len("weight scales", sw.len(), s.n_blocks() * s.k_blocks())?;
        check_len("out", out.len(), s.m() * s.n())?;
        if let Some(b) = bias {
            check_len("bias", b.len(), s.n())?;
        }
        let (m, k, bk) = (s.m(), s.k(), s.bk());
        // the activations' quantized copy (none for W8A16) lives in a reused buffer
        let act_len = if act == ActQuant::None { 0 } else { m * k };
        // the plan's tier: detected on this CPU (so its SIMD code may run), and fixed for the
        // call even if a test caps the tier meanwhile
        let tier = self.tier;
        with_f32(act_len, |abuf| -> Result<()> {
            match kernel {
                CpuFp8Kernel::Gemv => {
                    let rows = gemv_task_rows(tier, m);
                    // each task fills a contiguous run of the transposed output yt [n, m]; at
                    // M = 1 that is `out` itself
                    let mut gemv = |yt: &mut [f32]| -> Result<()> {
                        let deq = gemv_wants_scaled_act(tier, m, act);
                        let xq = quantize_act_in(x, m, k, bk, act, deq, abuf)?;
                        let xb = gemv_bf16_act(tier, &xq, act, s);
                        let nan_free = self.nan_free;
                        yt.par_chunks_mut(rows * m).enumerate().for_each(|(c, yt)| {
                            let xq = GemvAct {
                                q: &xq,
                                bf16: xb.as_deref(),
                            };
                            gemv_task(tier, xq, w, sw, s, c * rows, yt, nan_free)
                        });
                        Ok(())
                    };
                    if m == 1 {
                        gemv(out)?;
                    } else {
                        with_f32(s.n() * m, |yt| -> Result<()> {
                            gemv(yt)?;
                            untranspose(yt, m, out);
                            Ok(())
                        })?;
                    }
                }
                CpuFp8Kernel::PanelGemm => {
                    if uses_bf16(tier, act) {
                        // from BF16_TILE_MIN_M rows: each weight tile decoded once, all rows
                        // of a short call in one tile
                        let xq = quantize_act_in(x, m, k, bk, act, false, abuf)?;
                        panel_gemm_bf16(tier, &xq, w, sw, s, out);
                    } else {
                        let xd = quantize_act_in(x, m, k, bk, act, true, abuf)?;
                        panel_gemm(&xd.values, w, sw, s, out);
                    }
                }
            }
            Ok(())
        })?;
        if let Some(b) = bias {
            out.par_chunks_mut(s.n()).for_each(|row| {
                for (y, b) in row.iter_mut().zip(b) {
                    *y += b;
                }
            });
        }
        Ok(())
    }
}

/// `out [m, n]` from the GEMV's transposed output `yt [n, m]`.
pub(crate) fn untranspose(yt: &[f32], m: usize, out: &mut [f32]) {
    let n = out.len() / m;
    for (r, row) in out.chunks_exact_mut(n).enumerate() {
        for (j, y) in row.iter_mut().enumerate() {
            *y = yt[j * m + r];
        }
    }
}

/// Weight rows per GEMV task: enough work to amortize the hand-off at M = 1.
pub(crate) fn gemv_task_rows(tier: Tier, m: usize) -> usize {
    if tier >= Tier::Avx2 && m == 1 {
        32
    } else {
        8
    }
}

/// Whether [`gemv_task`] takes the activations already multiplied by their scales
/// (`quantize_act(.., dequantize = true)`) for this tier, `m` and scheme.
pub(crate) fn gemv_wants_scaled_act(tier: Tier, m: usize, act: ActQuant) -> bool {
    tier >= Tier::Avx2 && m > 1 && !uses_bf16(tier, act)
}

/// The activations of a GEMV call: quantized as [`gemv_wants_scaled_act`] says, and in the
/// AVX512-BF16 kernel's layout when [`gemv_bf16_act`] made one.
#[derive(Clone, Copy)]
pub(crate) struct GemvAct<'a> {
    pub q: &'a QuantizedAct<'a>,
    pub bf16: Option<&'a [u16]>,
}

/// Whether a call runs the AVX512-BF16 kernels (GEMV and panel GEMM): on that tier with
/// quantized activations (e4m3 values, exact in bf16; W8A16's f32 activations are not, and keep
/// the f32 kernels).
pub(crate) fn uses_bf16(tier: Tier, act: ActQuant) -> bool {
    tier >= Tier::Avx512Bf16 && act != ActQuant::None
}

/// The activations in the AVX512-BF16 kernels' layout, row after row, when
/// [`uses_bf16`]; `xq` must hold the e4m3 values themselves (not dequantized).
pub(crate) fn gemv_bf16_act(
    tier: Tier,
    xq: &QuantizedAct<'_>,
    act: ActQuant,
    s: LinearShape,
) -> Option<Vec<u16>> {
    #[cfg(target_arch = "x86_64")]
    if uses_bf16(tier, act) {
        let x = &xq.values[..s.m() * s.k()];
        return Some(crate::avx512bf16::act_layout(x, s.k(), s.bk()));
    }
    let _ = (tier, xq, act, s);
    None
}

/// One GEMV task: `yt [rows, m]` (transposed output) for weight rows `n0..` of `w`. `tier` must
/// be at most `Tier::detected()`; `nan_free` as [`LinearPlan::assume_nan_free`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemv_task(
    tier: Tier,
    xa: GemvAct<'_>,
    w: &[u8],
    sw: &[f32],
    s: LinearShape,
    n0: usize,
    yt: &mut [f32],
    nan_free: bool,
) {
    let xq = xa.q;
    if let Some(xb) = xa.bf16 {
        gemv_rows_bf16(tier, xq, xb, w, sw, s, n0, yt)
    } else if tier >= Tier::Avx2 && s.m() > 1 {
        // scaled activations (`gemv_wants_scaled_act`; W8A16's are their own values)
        with_f32(3 * s.k(), |buf| {
            gemv_small_rows(tier, &xq.values, w, sw, s, n0, yt, buf)
        })
    } else if tier >= Tier::Avx2 {
        gemv1_rows(tier, xq, w, sw, s, n0, yt, nan_free)
    } else {
        gemv_rows(xq, w, sw, s, n0, yt)
    }
}

/// [`plan`] then [`LinearPlan::run`]: `out [m, n] = x [m, k] · dequant(W)ᵀ + bias`, returning
/// the path that ran.
pub fn fp8_linear(
    x: &[f32],
    w: &[u8],
    sw: &[f32],
    bias: Option<&[f32]>,
    shape: LinearShape,
    act: ActQuant,
    out: &mut [f32],
) -> Result<CpuFp8Path> {
    let p = plan(shape, act)?;
    p.run(x, w, sw, bias, out)?;
    Ok(p.path())
}

/// Dot product of f32 activations with fp8 codes, decoding in registers.
#[inline(always)]
fn dot_fp8<A: Arith>(x: &[f32], w: &[u8]) -> f32 {
    const L: usize = 16;
    let n = x.len().min(w.len());
    let (x, w) = (&x[..n], &w[..n]);
    let mut acc = [0f32; L];
    let (cx, cw) = (x.chunks_exact(L), w.chunks_exact(L));
    let (rx, rw) = (cx.remainder(), cw.remainder());
    for (a, b) in cx.zip(cw) {
        for i in 0..L {
            acc[i] = A::mul_add(a[i], e4m3_to_f32(b[i]), acc[i]);
        }
    }
    let mut tail = 0f32;
    for (a, b) in rx.iter().zip(rw) {
        tail = A::mul_add(*a, e4m3_to_f32(*b), tail);
    }
    acc.iter().sum::<f32>() + tail
}

/// Fills `yt [rows, m]` for weight rows `n0..` (overwriting it): one pass over those weight
/// rows.
#[inline(always)]
fn gemv_rows_impl<A: Arith>(
    xq: &QuantizedAct<'_>,
    w: &[u8],
    sw: &[f32],
    s: LinearShape,
    n0: usize,
    yt: &mut [f32],
) {
    const CHUNK: usize = 256;
    let (m, k, kbs) = (s.m(), s.k(), s.k_blocks());
    let x = &xq.values[..];
    let mut buf = [0f32; CHUNK];
    let mut part = [0f32; GEMV_MAX_M];
    for (r, acc) in yt.chunks_exact_mut(m).enumerate() {
        // `yt` is a reused buffer (or the caller's output): start each sum from zero
        acc.fill(0.0);
        let n = n0 + r;
        let wrow = &w[n * k..(n + 1) * k];
        let sw_row = &sw[(n / s.bn()) * kbs..(n / s.bn() + 1) * kbs];
        for (kb, &swv) in sw_row.iter().enumerate() {
            let (k0, k1) = (kb * s.bk(), (kb * s.bk() + s.bk()).min(k));
            if m == 1 {
                let d = dot_fp8::<A>(&x[k0..k1], &wrow[k0..k1]);
                acc[0] += d * (xq.scale(0, kb) * swv);
                continue;
            }
            part[..m].fill(0.0);
            let mut c0 = k0;
            while c0 < k1 {
                let c1 = (c0 + CHUNK).min(k1);
                let b = &mut buf[..c1 - c0];
                decode_scaled(&wrow[c0..c1], 1.0, b);
                for (mi, p) in part[..m].iter_mut().enumerate() {
                    *p += dot::<A>(&x[mi * k + c0..mi * k + c1], b);
                }
                c0 = c1;
            }
            for (mi, a) in acc.iter_mut().enumerate() {
                *a += part[mi] * (xq.scale(mi, kb) * swv);
            }
        }
    }
}

simd_dispatch!(fn gemv_rows => gemv_rows_impl(
    xq: &QuantizedAct<'_>, w: &[u8], sw: &[f32], s: LinearShape, n0: usize, yt: &mut [f32]
));

/// [`gemv_rows`] at M = 1 (`yt` is `[rows]`), on the AVX2 tier and up: four weight rows per
/// pass share each activation load, each decoded through F16C in registers (16 codes per step
/// on AVX2, 32 on AVX-512).
#[allow(clippy::too_many_arguments)]
fn gemv1_rows(
    tier: Tier,
    xq: &QuantizedAct<'_>,
    w: &[u8],
    sw: &[f32],
    s: LinearShape,
    n0: usize,
    yt: &mut [f32],
    nan_free: bool,
) {
    #[cfg(target_arch = "x86_64")]
    {
        /// The kernel's body, compiled into each tier's copy below; `WIDE` picks the AVX-512
        /// row kernel.
        #[inline(always)]
        unsafe fn body<const WIDE: bool>(
            xq: &QuantizedAct<'_>,
            w: &[u8],
            sw: &[f32],
            s: LinearShape,
            n0: usize,
            yt: &mut [f32],
            nan_free: bool,
        ) {
            let (k, kbs) = (s.k(), s.k_blocks());
            let x = &xq.values[..];
            let rows = yt.len();
            let (prod, nb0) = scale_products(xq, sw, s, n0, rows);
            for r0 in (0..rows).step_by(4) {
                // a short last group repeats its last row rather than branching per row
                let n = [0, 1, 2, 3].map(|i| n0 + (r0 + i).min(rows - 1));
                let wr = n.map(|n| &w[n * k..(n + 1) * k]);
                let sc = n.map(|n| &prod[(n / s.bn() - nb0) * kbs..(n / s.bn() - nb0 + 1) * kbs]);
                // SAFETY: the callers below are compiled for the features of the kernel they
                // pick (AVX-512 F/BW/VL with WIDE, AVX2 + FMA + F16C in both), which they
                // checked the CPU has.
                let acc = unsafe {
                    match (WIDE, nan_free) {
                        (true, true) => crate::avx512::dot4_blocks::<false>(x, wr, s.bk(), sc),
                        (true, false) => crate::avx512::dot4_blocks::<true>(x, wr, s.bk(), sc),
                        (false, true) => crate::x86::dot4_blocks::<false>(x, wr, s.bk(), sc),
                        (false, false) => crate::x86::dot4_blocks::<true>(x, wr, s.bk(), sc),
                    }
                };
                let take = (rows - r0).min(4);
                yt[r0..r0 + take].copy_from_slice(&acc[..take]);
            }
        }
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
        unsafe fn run512(
            xq: &QuantizedAct<'_>,
            w: &[u8],
            sw: &[f32],
            s: LinearShape,
            n0: usize,
            yt: &mut [f32],
            nan_free: bool,
        ) {
            body::<true>(xq, w, sw, s, n0, yt, nan_free)
        }
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn run(
            xq: &QuantizedAct<'_>,
            w: &[u8],
            sw: &[f32],
            s: LinearShape,
            n0: usize,
            yt: &mut [f32],
            nan_free: bool,
        ) {
            body::<false>(xq, w, sw, s, n0, yt, nan_free)
        }
        if tier >= Tier::Avx512 {
            // SAFETY: `tier` came from `Tier::current()`, which is never above the detected
            // tier, and the AVX-512 tier is only detected with AVX-512 F/BW/VL, AVX2, FMA and
            // F16C present.
            return unsafe { run512(xq, w, sw, s, n0, yt, nan_free) };
        }
        if tier >= Tier::Avx2 {
            // SAFETY: as above; the AVX2 tier is only detected with AVX2, FMA and F16C present.
            return unsafe { run(xq, w, sw, s, n0, yt, nan_free) };
        }
    }
    gemv_rows(xq, w, sw, s, n0, yt)
}

/// For the weight-row blocks of rows `n0..n0 + rows` (from block `nb0`, returned): the M = 1
/// activation scale times the weight scale of each K-block, `[blocks, k_blocks]`.
fn scale_products(
    xq: &QuantizedAct<'_>,
    sw: &[f32],
    s: LinearShape,
    n0: usize,
    rows: usize,
) -> (Vec<f32>, usize) {
    let kbs = s.k_blocks();
    let nb0 = n0 / s.bn();
    let mut prod = vec![0f32; ((n0 + rows - 1) / s.bn() + 1 - nb0) * kbs];
    for (i, p) in prod.chunks_exact_mut(kbs).enumerate() {
        for (kb, v) in p.iter_mut().enumerate() {
            *v = xq.scale(0, kb) * sw[(nb0 + i) * kbs + kb];
        }
    }
    (prod, nb0)
}

/// [`gemv_rows`] on the AVX512-BF16 tier, with the activations in that tier's layout (`xb`,
/// from [`gemv_bf16_act`]; `yt` is `[rows, m]`). At M = 1 four weight rows per pass are decoded
/// by table lookup in registers; for M > 1 two weight rows at a time are decoded into a buffer
/// once, then multiplied with four activation rows at a time, and each (row, row, K-block)
/// partial is scaled by `sx · sw` as at M = 1.
#[allow(clippy::too_many_arguments)]
fn gemv_rows_bf16(
    tier: Tier,
    xq: &QuantizedAct<'_>,
    xb: &[u16],
    w: &[u8],
    sw: &[f32],
    s: LinearShape,
    n0: usize,
    yt: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if tier >= Tier::Avx512Bf16 && s.m() > 1 {
        use crate::avx512bf16::{block_words, decode_row, dot_4x2_blocks};
        let (m, k, kbs) = (s.m(), s.k(), s.k_blocks());
        let rw = kbs * block_words(s.bk());
        let rows = yt.len() / m;
        let mut wd = vec![0u16; 2 * rw];
        let sx_row = |i: usize| {
            let r = i / xq.rows_per_scale;
            &xq.scales[r * kbs..(r + 1) * kbs]
        };
        for g0 in (0..rows).step_by(2) {
            // a short last pair repeats its last row rather than branching per row
            let n = [0, 1].map(|j| n0 + (g0 + j).min(rows - 1));
            for (j, dst) in wd.chunks_exact_mut(rw).enumerate() {
                // SAFETY: as below; the row holds k codes and `dst` its blocks.
                unsafe { decode_row(&w[n[j] * k..(n[j] + 1) * k], k, s.bk(), dst) };
            }
            let wr = [&wd[..rw], &wd[rw..]];
            let swr = n.map(|n| &sw[(n / s.bn()) * kbs..(n / s.bn() + 1) * kbs]);
            for i0 in (0..m).step_by(4) {
                let xi = [0, 1, 2, 3].map(|i| (i0 + i).min(m - 1));
                let xr = xi.map(|i| &xb[i * rw..(i + 1) * rw]);
                // SAFETY: `tier` came from `Tier::current()`, never above the detected tier,
                // and that tier is only detected with AVX-512 F/BW/VL/VBMI/BF16; every row
                // holds kbs blocks of block_words(bk) words, every scale row kbs entries.
                let d = unsafe {
                    dot_4x2_blocks(xr, wr, kbs, block_words(s.bk()), xi.map(sx_row), swr)
                };
                for j in 0..(rows - g0).min(2) {
                    for (i, row) in d.iter().enumerate().take(m - i0) {
                        yt[(g0 + j) * m + i0 + i] = row[j];
                    }
                }
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if tier >= Tier::Avx512Bf16 {
        let (k, kbs) = (s.k(), s.k_blocks());
        let rows = yt.len();
        let (prod, nb0) = scale_products(xq, sw, s, n0, rows);
        for r0 in (0..rows).step_by(4) {
            // a short last group repeats its last row rather than branching per row
            let n = [0, 1, 2, 3].map(|i| n0 + (r0 + i).min(rows - 1));
            let wr = n.map(|n| &w[n * k..(n + 1) * k]);
            let sc = n.map(|n| &prod[(n / s.bn() - nb0) * kbs..(n / s.bn() - nb0 + 1) * kbs]);
            // SAFETY: `tier` came from `Tier::current()`, never above the detected tier, and
            // that tier is only detected with AVX-512 F/BW/VL/VBMI/BF16; `xb` was laid out for
            // this shape by `gemv_bf16_act` and every row holds `k` codes.
            let acc = unsafe { crate::avx512bf16::dot4_blocks(xb, wr, k, s.bk(), sc) };
            let take = (rows - r0).min(4);
            yt[r0..r0 + take].copy_from_slice(&acc[..take]);
        }
        return;
    }
    // `gemv_bf16_act` lays the activations out only on that tier
    let _ = (tier, xq, xb, w, sw, s, n0, yt);
    unreachable!("the bf16 layout exists only on the AVX512-BF16 tier")
}

/// [`gemv_rows`] for `m > 1` on the AVX2 tier and up (`yt` is `[rows, m]`, `xd` the activations
/// already multiplied by their scales): three weight rows at a time are decoded with their
/// block scales into `buf`, then multiplied with four activation rows at a time in registers.
/// Scaling each factor by its own block scale before the product is the contract's per-K-block
/// scaling, distributed over the sum, as in the panel GEMM. The AVX-512 tier runs the same
/// 256-bit code, decode included: on an Ice Lake-class Xeon a 16-lane `dot_4x3` measured
/// 10-25% slower, and the 16-lane row decode alone ~10% slower at M = 16 (not profiled
/// further; a lower clock under 512-bit instructions would explain it).
#[allow(clippy::too_many_arguments)]
fn gemv_small_rows(
    tier: Tier,
    xd: &[f32],
    w: &[u8],
    sw: &[f32],
    s: LinearShape,
    n0: usize,
    yt: &mut [f32],
    buf: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma,f16c")]
        fn run(
            xd: &[f32],
            w: &[u8],
            sw: &[f32],
            s: LinearShape,
            n0: usize,
            yt: &mut [f32],
            buf: &mut [f32],
        ) {
            let (m, k) = (s.m(), s.k());
            let rows = yt.len() / m;
            for g0 in (0..rows).step_by(3) {
                // a short last group repeats its last row rather than branching per row
                let r = [0, 1, 2].map(|j| (g0 + j).min(rows - 1));
                for (j, dst) in buf[..3 * k].chunks_exact_mut(k).enumerate() {
                    dequant_row(w, sw, s, n0 + r[j], dst);
                }
                let wr = [&buf[..k], &buf[k..2 * k], &buf[2 * k..3 * k]];
                for i0 in (0..m).step_by(4) {
                    let xi = [0, 1, 2, 3].map(|i| (i0 + i).min(m - 1));
                    let xr = xi.map(|i| &xd[i * k..(i + 1) * k]);
                    // SAFETY: this function is compiled for AVX2 + FMA + F16C, which the caller
                    // checked the CPU has.
                    let d = unsafe { crate::x86::dot_4x3(xr, wr) };
                    for (j, _) in r.iter().enumerate().take(rows - g0) {
                        for (i, row) in d.iter().enumerate().take(m - i0) {
                            yt[(g0 + j) * m + i0 + i] = row[j];
                        }
                    }
                }
            }
        }
        if tier >= Tier::Avx2 {
            // SAFETY: `tier` came from `Tier::current()`, which is never above the detected
            // tier, and the AVX2 tier is only detected with AVX2, FMA and F16C present.
            return unsafe { run(xd, w, sw, s, n0, yt, buf) };
        }
    }
    // callers take this path only with an AVX2 `tier`, the value passed here
    let _ = (tier, xd, w, sw, s, n0, yt, buf);
    unreachable!("gemv_small_rows runs on the AVX2 tier only")
}

/// Weight row `n` decoded and multiplied by its block scales into `dst [k]`, by the AVX2
/// decoder on every tier that has it (the caller's tier).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn dequant_row(w: &[u8], sw: &[f32], s: LinearShape, n: usize, dst: &mut [f32]) {
    let kbs = s.k_blocks();
    for kb in 0..kbs {
        let (k0, k1) = (kb * s.bk(), (kb * s.bk() + s.bk()).min(s.k()));
        // SAFETY: this function is compiled for AVX2 + FMA + F16C, which its caller (compiled
        // for them itself) checked the CPU has.
        unsafe {
            crate::x86::decode_scaled(
                &w[n * s.k() + k0..n * s.k() + k1],
                sw[(n / s.bn()) * kbs + kb],
                &mut dst[k0..k1],
            )
        };
    }
}

/// Weight rows per panel (at most) and K columns per tile: a 128 x 512 f32 tile (256 KiB) stays
/// in a 512 KiB L2 while `gemm` packs it, with room for the activations it streams (a 256 x 1024
/// tile, 1 MiB, measured 5-15% slower on such a core), and each `gemm` call is still large
/// enough that packing costs little next to the multiply.
const PANEL_ROWS: usize = 128;
const TILE_K: usize = 512;

/// Writes `codes * block scale` of weight rows `n0..n0 + rows`, columns `c0..c1`, into
/// `buf [rows, c1 - c0]`.
fn dequant_tile(
    w: &[u8],
    sw: &[f32],
    s: LinearShape,
    n0: usize,
    c0: usize,
    c1: usize,
    buf: &mut [f32],
) {
    let kbs = s.k_blocks();
    for (r, row) in buf.chunks_exact_mut(c1 - c0).enumerate() {
        let n = n0 + r;
        let mut c = c0;
        while c < c1 {
            let kb = c / s.bk();
            let end = ((kb + 1) * s.bk()).min(c1);
            let scale = sw[(n / s.bn()) * kbs + kb];
            let (src, dst) = (
                &w[n * s.k() + c..n * s.k() + end],
                &mut row[c - c0..end - c0],
            );
            decode_scaled(src, scale, dst);
            c = end;
        }
    }
}

fn panel_gemm(x: &[f32], w: &[u8], sw: &[f32], s: LinearShape, out: &mut [f32]) {
    let threads = rayon::current_num_threads();
    // a multiple of `threads` panels of at most PANEL_ROWS rows, so every thread gets the same
    // number of equal panels (the last may be a little shorter)
    let panels = s.n().div_ceil(threads * PANEL_ROWS) * threads;
    let p = s.n().div_ceil(panels);
    // K in equal tiles of about TILE_K (576 is one tile, not 512 + a thin 64 whose product
    // would re-read and re-write the whole output block for little work)
    let kc = s
        .k()
        .div_ceil((s.k() as f64 / TILE_K as f64).round().max(1.0) as usize);
    let per_panel = s.n().div_ceil(p) >= threads;
    let inner = if per_panel {
        gemm::Parallelism::None
    } else {
        gemm::Parallelism::Rayon(threads)
    };
    // panel i computes its own row-major [m, rows] block
    let panel = |i: usize, dst: &mut [f32], buf: &mut [f32]| {
        let rows = dst.len() / s.m();
        for c0 in (0..s.k()).step_by(kc) {
            let c1 = (c0 + kc).min(s.k());
            let tile = &mut buf[..rows * (c1 - c0)];
            dequant_tile(w, sw, s, i * p, c0, c1, tile);
            let lhs = Operand {
                data: &x[c0..],
                ld: s.k(),
            };
            let rhs = Operand {
                data: tile,
                ld: c1 - c0,
            };
            gemm_nt(s.m(), rows, c1 - c0, lhs, rhs, dst, c0 > 0, inner);
        }
    };
    with_f32(s.m() * s.n(), |blocks| {
        if per_panel {
            blocks
                .par_chunks_mut(p * s.m())
                .enumerate()
                .for_each(|(i, dst)| with_f32(p * kc, |buf| panel(i, dst, buf)));
        } else {
            with_f32(p * kc, |buf| {
                for (i, dst) in blocks.chunks_mut(p * s.m()).enumerate() {
                    panel(i, dst, buf);
                }
            });
        }
        out.par_chunks_mut(s.n()).enumerate().for_each(|(r, row)| {
            for (i, block) in blocks.chunks(p * s.m()).enumerate() {
                let rows = block.len() / s.m();
                row[i * p..i * p + rows].copy_from_slice(&block[r * rows..(r + 1) * rows]);
            }
        });
    });
}

/// From this many rows on, a GEMV call on the AVX512-BF16 tier runs [`panel_gemm_bf16`] (one
/// tile of at most 16 rows): decoding each weight tile once into L2 and multiplying it with
/// broadcast weight pairs beats [`gemv_rows_bf16`]'s four-by-two register blocks there (Zen 4,
/// N = K = 4096: 2.16 vs 2.69 ms at M = 12, 2.19 vs 3.42 ms at M = 16; 2.20 vs 1.87 ms at M = 8).
pub const BF16_TILE_MIN_M: usize = 10;

/// Weight rows per micro-kernel call of [`panel_gemm_bf16`]: with two vectors of 16 activation
/// rows that is 24 accumulators of the 32 vector registers, two activation loads and 12
/// broadcast weight pairs per 24 `vdpbf16ps`.
const BF16_NR: usize = 12;

/// [`gemm_tile`](crate::avx512bf16::gemm_tile) for one row-tile height, `BF16_NR` weight rows.
#[cfg(target_arch = "x86_64")]
type TileFn = unsafe fn(
    &[u32],
    usize,
    &[u16],
    usize,
    &[f32],
    usize,
    [&[f32]; BF16_NR],
    (usize, usize),
    &mut [f32],
    usize,
);

/// The panel GEMM on the AVX512-BF16 tier, for W8A8 (`xq` holds the e4m3 values, not
/// dequantized): the same panels of weight rows per thread as [`panel_gemm`], but each K tile
/// of whole blocks is decoded to bf16 without its scale (exact) and multiplied by
/// [`gemm_tile`](crate::avx512bf16::gemm_tile) with the activations in bf16 pairs, and each
/// (row, row, K-block) partial is scaled by `sx · sw` as in the GEMV. `vdpbf16ps` does twice
/// the multiplies of an f32 FMA, and the per-block scaling costs one FMA per 64 of them at
/// 128-wide blocks.
fn panel_gemm_bf16(
    tier: Tier,
    xq: &QuantizedAct<'_>,
    w: &[u8],
    sw: &[f32],
    s: LinearShape,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if tier >= Tier::Avx512Bf16 {
        use crate::avx512bf16::{act_layout, block_words, decode_row, gemm_tile, pair_columns};
        let (m, n, k, bk, kbs) = (s.m(), s.n(), s.k(), s.bk(), s.k_blocks());
        let (bw, m_pad) = (block_words(bk), m.next_multiple_of(16));
        let ppb = bw / 2;
        let a = pair_columns(&act_layout(&xq.values[..m * k], k, bk), m, m_pad);
        // the activation scales as columns too, zeros for the padding rows
        let mut sxt = vec![0f32; kbs * m_pad];
        for (kb, col) in sxt.chunks_exact_mut(m_pad).enumerate() {
            for (i, v) in col[..m].iter_mut().enumerate() {
                *v = xq.scale(i, kb);
            }
        }
        // K tiles of whole blocks, about TILE_K codes each, all of about the same size
        let per_tile = (TILE_K as f64 / bw as f64).round().max(1.0) as usize;
        let per_tile = kbs.div_ceil(kbs.div_ceil(per_tile));
        let threads = rayon::current_num_threads();
        let panels = n.div_ceil(threads * PANEL_ROWS) * threads;
        let p = n.div_ceil(panels).next_multiple_of(BF16_NR);
        // yt [n rounded up to panels, m_pad]: panel i owns rows i·p..; the padding rows of the
        // last panel multiply zero weights and are dropped
        with_f32(n.next_multiple_of(p) * m_pad, |yt| {
            yt.par_chunks_mut(p * m_pad)
                .enumerate()
                .for_each(|(i, yt)| {
                    yt.fill(0.0);
                    let (n0, rows) = (i * p, p.min(n - i * p));
                    let mut wt = vec![0u16; p * per_tile * bw];
                    for kb0 in (0..kbs).step_by(per_tile) {
                        let nb = per_tile.min(kbs - kb0);
                        let (c0, c1, tw) = (kb0 * bk, ((kb0 + nb) * bk).min(k), nb * bw);
                        for (r, dst) in wt.chunks_exact_mut(tw).take(rows).enumerate() {
                            let row = &w[(n0 + r) * k..(n0 + r + 1) * k];
                            // SAFETY: `tier` came from `Tier::current()`, never above the
                            // detected tier, which needs AVX-512 F/BW/VL/VBMI/BF16; `dst`
                            // holds the nb blocks of c1 - c0 codes.
                            unsafe { decode_row(&row[c0..c1], c1 - c0, bk, dst) };
                        }
                        // rows past the weight's end must be zeros; a shorter last tile
                        // (`tw`) moves where they start, so they are cleared every tile
                        wt[rows * tw..p * tw].fill(0);
                        for g in (0..p).step_by(BF16_NR) {
                            let swr: [&[f32]; BF16_NR] = std::array::from_fn(|r| {
                                let o = ((n0 + g + r).min(n - 1) / s.bn()) * kbs + kb0;
                                &sw[o..o + nb]
                            });
                            let wg = &wt[g * tw..p * tw];
                            let ytg = &mut yt[g * m_pad..];
                            let mut m0 = 0;
                            while m0 < m_pad {
                                // tiles of 32 rows, and one of 16 where m_pad leaves it
                                let (tile_m, tile) = if m_pad - m0 >= 32 {
                                    (32, gemm_tile::<2, BF16_NR> as TileFn)
                                } else {
                                    (16, gemm_tile::<1, BF16_NR> as TileFn)
                                };
                                let (ao, so) = (kb0 * ppb * m_pad + m0, kb0 * m_pad + m0);
                                let (a, sx) = (&a[ao..], &sxt[so..]);
                                let yg = &mut ytg[m0..];
                                // SAFETY: as above for the tier; every slice holds what the
                                // strides address from its offset (checked by the kernel).
                                unsafe {
                                    tile(a, m_pad, wg, tw, sx, m_pad, swr, (ppb, nb), yg, m_pad)
                                };
                                m0 += tile_m;
                            }
                        }
                    }
                });
            // 16 output rows per task: each 64-byte run of yt is read once
            out.par_chunks_mut(16 * n)
                .enumerate()
                .for_each(|(c, rows)| {
                    for j in 0..n {
                        let src = &yt[j * m_pad + 16 * c..];
                        for (r, y) in rows.iter_mut().skip(j).step_by(n).enumerate() {
                            *y = src[r];
                        }
                    }
                });
        });
        return;
    }
    // `uses_bf16` picks this path only on that tier
    let _ = (tier, xq, w, sw, s, out);
    unreachable!("the bf16 panel GEMM runs on the AVX512-BF16 tier only")
}

/// A row-major matrix operand: row `r` starts at `data[r * ld]`.
#[derive(Clone, Copy)]
struct Operand<'a> {
    data: &'a [f32],
    ld: usize,
}

/// `dst[i * p + j] (+)= Σ_kk lhs[i, kk] · rhs[j, kk]` for `i < m, j < p, kk < k`: lhs `[m, k]`
/// and rhs `[p, k]` row-major, dst row-major `[m, p]`.
#[allow(clippy::too_many_arguments)]
fn gemm_nt(
    m: usize,
    p: usize,
    k: usize,
    lhs: Operand<'_>,
    rhs: Operand<'_>,
    dst: &mut [f32],
    accumulate: bool,
    par: gemm::Parallelism,
) {
    assert!(m > 0 && p > 0 && k > 0 && lhs.ld >= k && rhs.ld >= k);
    assert!(lhs.data.len() >= (m - 1) * lhs.ld + k);
    assert!(rhs.data.len() >= (p - 1) * rhs.ld + k);
    assert!(dst.len() >= m * p);
    // SAFETY: the asserts above bound every element the strides address inside the three
    // slices, and `dst` is exclusively borrowed, so gemm touches only memory we own.
    unsafe {
        gemm::gemm(
            m,
            p,
            k,
            dst.as_mut_ptr(),
            1,
            p as isize,
            accumulate,
            lhs.data.as_ptr(),
            1,
            lhs.ld as isize,
            rhs.data.as_ptr(),
            rhs.ld as isize,
            1,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{quantize_act, quantize_weight};

    /// The kernels write through reused scratch buffers and into the caller's `out`: whatever
    /// those held before (NaN here) must not leak into the result.
    #[test]
    fn stale_output_and_scratch_contents_do_not_leak() {
        let (n, k) = (37, 300);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01)
            .collect();
        let (wq, sw) = quantize_weight(&w, n, k, 16, 128).unwrap();
        for m in [1, 3, GEMV_MAX_M + 4] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.1)
                .collect();
            let shape = LinearShape::new(m, n, k, 16, 128).unwrap();
            let p = plan(shape, ActQuant::Group).unwrap();
            let mut clean = vec![0f32; m * n];
            p.run(&x, &wq, &sw, None, &mut clean).unwrap();
            // dirty the scratch buffers every thread keeps: a call on other inputs leaves its
            // own values in them (a kernel reading before writing would see those), and this
            // thread's largest one is NaN
            let other: Vec<f32> = x.iter().map(|v| v * -3.0 + 1.0).collect();
            p.run(&other, &wq, &sw, None, &mut vec![0f32; m * n])
                .unwrap();
            crate::scratch::with_f32(1 << 16, |b| b.fill(f32::NAN));
            let mut dirty = vec![f32::NAN; m * n];
            p.run(&x, &wq, &sw, None, &mut dirty).unwrap();
            assert_eq!(clean, dirty, "m = {m}");
            assert!(clean.iter().all(|v| v.is_finite()));
            // the portable GEMV, whichever tier this CPU runs
            let mm = m.min(GEMV_MAX_M);
            let xq = quantize_act(&x[..mm * k], mm, k, 128, ActQuant::Group, false).unwrap();
            let s = shape.with_m(mm).unwrap();
            let (mut a, mut b) = (vec![0f32; 8 * mm], vec![f32::NAN; 8 * mm]);
            gemv_rows(&xq, &wq, &sw, s, 8, &mut a);
            gemv_rows(&xq, &wq, &sw, s, 8, &mut b);
            assert_eq!(a, b, "portable gemv, m = {mm}");
        }
    }
}
