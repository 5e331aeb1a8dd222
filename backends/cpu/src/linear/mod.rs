//! `y = x · Wᵀ` with fp8 block-scaled weights, two kernels:
//! - [`CpuFp8Kernel::Gemv`] for `m <= GEMV_MAX_M` (decode): streams each weight byte once. At
//!   M = 1 it decodes in registers and applies `sx · sw` per K-block to the f32 partial dot
//!   product (four weight rows per pass on the AVX2 tier). For 2..=4 rows on the AVX2 tier it
//!   decodes each weight row in registers the same way once for all of them; from 5 rows it
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
//! from 7 to 13 rows up to 16 (by the row length: [`bf16_tile_min_m`]) are planned as the panel
//! GEMM (its micro-kernel on a single tile of rows).
//! [`plan`] decides kernel and tier once; the path it reports is the one [`LinearPlan::run`]
//! runs.

use rayon::prelude::*;

use crate::error::{check_len, check_positive, Error, Result};
use crate::fp8::{decode_scaled, e4m3_to_f32};
use crate::quant::{act_scales_len, quantize_act_into, QuantizedAct};
use crate::scratch::{with_buf, with_f32};
use crate::simd::{dot, lanes, simd_dispatch, Arith, Tier};
use fp8nsa_types::{ActQuant, CpuFp8Kernel, CpuFp8Path, LinearShape};

mod dense;
mod gemv;
mod panel;

pub use dense::gemv_f32;

use gemv::{gemv1_rows, gemv_rows, gemv_rows_bf16, gemv_rows_regs, gemv_small_rows};
use panel::{panel_gemm, panel_gemm_bf16};

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
/// [`bf16_tile_min_m`] rows on the AVX512-BF16 tier, where the panel GEMM's micro-kernel runs
/// them as one tile; the panel GEMM past that.
pub fn plan(shape: LinearShape, act: ActQuant) -> Result<LinearPlan> {
    // the kernels work on fitted blocks (a block past the matrix is one partial block)
    let shape = shape.fitted();
    if let ActQuant::Block2d { bm } = act {
        check_positive("bm", bm)?;
    }
    let tier = Tier::current();
    let m = shape.m();
    let kernel = if m > GEMV_MAX_M || (m >= bf16_tile_min_m(shape.k()) && uses_bf16(tier, act)) {
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
        let part = FusedPart {
            plan: *self,
            w,
            sw,
            bias,
        };
        part.check(x, out)?;
        if self.kernel == CpuFp8Kernel::Gemv {
            gemv_parts(x, &[part], &mut [out])
        } else {
            panel_parts(x, &[part], &mut [out])
        }
    }
}

/// The panel GEMM of `parts` (checked as for [`gemv_parts`]) over one quantization of `x`: each
/// part's panels run as [`LinearPlan::run`] runs them alone, on the same quantized activations.
fn panel_parts(x: &[f32], parts: &[FusedPart<'_>], outs: &mut [&mut [f32]]) -> Result<()> {
    let first = parts[0].plan;
    let (s0, act) = (first.shape, first.act);
    let (m, k, bk) = (s0.m(), s0.k(), s0.bk());
    // the activations' quantized copy (none for W8A16) and their scales live in a reused
    // buffer
    let act_len = if act == ActQuant::None { 0 } else { m * k };
    let scales_len = act_scales_len(m, k, bk, act)?;
    // the plan's tier: detected on this CPU (so its SIMD code may run), and fixed for the
    // call even if a test caps the tier meanwhile
    let tier = first.tier;
    with_f32(act_len + scales_len, |abuf| -> Result<()> {
        // the bf16 kernels take the e4m3 values themselves, the f32 ones the dequantized
        let bf16 = uses_bf16(tier, act);
        let (abuf, sbuf) = abuf.split_at_mut(act_len);
        let xq = quantize_act_into(x, m, k, bk, act, !bf16, abuf, sbuf)?;
        for (p, out) in parts.iter().zip(outs.iter_mut()) {
            let s = p.plan.shape;
            if bf16 {
                // from bf16_tile_min_m rows: each weight tile decoded once, all rows of a
                // short call in one tile
                panel_gemm_bf16(tier, &xq, p.w, p.sw, s, out);
            } else {
                panel_gemm(&xq.values, p.w, p.sw, s, out, tier, p.plan.nan_free);
            }
            if let Some(b) = p.bias {
                out.par_chunks_mut(s.n()).for_each(|row| {
                    for (y, b) in row.iter_mut().zip(b) {
                        *y += b;
                    }
                });
            }
        }
        Ok(())
    })
}

/// One weight of [`run_fused`]: its plan (made by [`plan`], with
/// [`LinearPlan::assume_nan_free`] as for [`LinearPlan::run`]), codes, scales and bias.
#[derive(Clone, Copy, Debug)]
pub struct FusedPart<'a> {
    pub plan: LinearPlan,
    pub w: &'a [u8],
    pub sw: &'a [f32],
    pub bias: Option<&'a [f32]>,
}

impl FusedPart<'_> {
    /// Every buffer of a call at its plan's size (`Error::Shape` naming the buffer otherwise).
    fn check(&self, x: &[f32], out: &[f32]) -> Result<()> {
        let s = self.plan.shape;
        check_len("x", x.len(), s.m() * s.k())?;
        check_len("weight", self.w.len(), s.n() * s.k())?;
        check_len("weight scales", self.sw.len(), s.n_blocks() * s.k_blocks())?;
        check_len("out", out.len(), s.m() * s.n())?;
        if let Some(b) = self.bias {
            check_len("bias", b.len(), s.n())?;
        }
        Ok(())
    }
}

/// Several linears over the same activations `x [m, k]` (q, k and v; gate and up), each part's
/// output `out_p [m, n_p]` the bits [`LinearPlan::run`] gives it: where all parts run the same
/// kernel with one activation scheme and K blocking, `x` is quantized once; the GEMV then runs
/// the weight rows of all parts as one parallel region (a decode step's hand-offs between
/// threads, per layer, go from five to two), the panel GEMM each part's panels in turn.
/// Otherwise each part runs alone.
///
/// ```
/// use fp8nsa_cpu::linear::{plan, run_fused, FusedPart};
/// use fp8nsa_types::{ActQuant, LinearShape};
///
/// let (wa, wb) = ([0x38u8; 6], [0x40u8; 3]); // e4m3 1.0 as [2, 3], 2.0 as [1, 3]
/// // W8A16 (f32 activations): exact sums here
/// let pa = plan(LinearShape::new(1, 2, 3, 128, 128)?, ActQuant::None)?;
/// let pb = plan(LinearShape::new(1, 1, 3, 128, 128)?, ActQuant::None)?;
/// let parts = [
///     FusedPart { plan: pa, w: &wa, sw: &[1.0], bias: None },
///     FusedPart { plan: pb, w: &wb, sw: &[0.5], bias: Some(&[1.0]) },
/// ];
/// let (mut ya, mut yb) = ([0f32; 2], [0f32; 1]);
/// run_fused(&[1.0, 2.0, 3.0], &parts, &mut [&mut ya[..], &mut yb[..]])?;
/// assert_eq!((ya, yb), ([6.0, 6.0], [7.0]));
/// # Ok::<(), fp8nsa_cpu::Error>(())
/// ```
pub fn run_fused(x: &[f32], parts: &[FusedPart<'_>], outs: &mut [&mut [f32]]) -> Result<()> {
    check_len("outs", outs.len(), parts.len())?;
    let Some(first) = parts.first() else {
        return Ok(());
    };
    if !fusable(parts) {
        for (p, out) in parts.iter().zip(outs.iter_mut()) {
            p.plan.run(x, p.w, p.sw, p.bias, out)?;
        }
        return Ok(());
    }
    for (p, out) in parts.iter().zip(outs.iter()) {
        p.check(x, out)?;
    }
    if first.plan.kernel == CpuFp8Kernel::Gemv {
        gemv_parts(x, parts, outs)
    } else {
        panel_parts(x, parts, outs)
    }
}

/// Whether `parts` (at least one) share a kernel, activation scheme, tier, M and K blocking, so
/// that one quantization of the input serves them all.
fn fusable(parts: &[FusedPart<'_>]) -> bool {
    let first = parts[0].plan;
    let s0 = first.shape;
    parts.iter().all(|p| {
        let s = p.plan.shape;
        p.plan.kernel == first.kernel
            && p.plan.act == first.act
            && p.plan.tier == first.tier
            && (s.m(), s.k(), s.bk()) == (s0.m(), s0.k(), s0.bk())
    })
}

/// A SwiGLU MLP's first half: `out [m, n] = silu(gate(x)) · up(x)` for `gate` and `up` of one
/// shape (M, N and K; each its own blocks, scales and bias), the bits of [`LinearPlan::run`]
/// on each followed by [`crate::act::silu_mul`]: both run as [`run_fused`] runs them (one
/// quantization of `x`, at decode one parallel region) into a reused scratch buffer, and one
/// pass writes the product. (Computing the product in each GEMV task, from the same rows of
/// gate and up, measured slower at M = 1 on Zen 4: each thread then reads two weight streams
/// in turn instead of one, 0.70-0.97x of this with the codes from memory.)
///
/// ```
/// use fp8nsa_cpu::linear::{plan, run_swiglu, FusedPart};
/// use fp8nsa_types::{ActQuant, LinearShape};
///
/// let p = plan(LinearShape::new(1, 1, 2, 128, 128)?, ActQuant::None)?;
/// let gate = FusedPart { plan: p, w: &[0x38, 0x38], sw: &[1.0], bias: None }; // e4m3 1.0
/// let up = FusedPart { plan: p, w: &[0x40, 0x40], sw: &[1.0], bias: None }; // e4m3 2.0
/// let mut out = [0f32];
/// run_swiglu(&[1.0, 2.0], gate, up, &mut out)?;
/// let (g, u) = (3.0f32, 6.0f32); // gate · x, up · x
/// assert!((out[0] - g / (1.0 + (-g).exp()) * u).abs() < 1e-5);
/// assert!(run_swiglu(&[1.0, 2.0], gate, up, &mut [0.0; 2]).is_err()); // out is [1, 1]
/// # Ok::<(), fp8nsa_cpu::Error>(())
/// ```
pub fn run_swiglu(
    x: &[f32],
    gate: FusedPart<'_>,
    up: FusedPart<'_>,
    out: &mut [f32],
) -> Result<()> {
    let (sg, su) = (gate.plan.shape, up.plan.shape);
    if (su.m(), su.n(), su.k()) != (sg.m(), sg.n(), sg.k()) {
        return Err(Error::Shape {
            arg: "up",
            expected: format!("gate's [m, n, k] = [{}, {}, {}]", sg.m(), sg.n(), sg.k()),
            got: format!("[{}, {}, {}]", su.m(), su.n(), su.k()),
        });
    }
    check_len("out", out.len(), sg.m() * sg.n())?;
    let len = out.len();
    with_f32(2 * len, |buf| {
        let (g, u) = buf.split_at_mut(len);
        run_fused(x, &[gate, up], &mut [g, u])?;
        crate::act::silu_mul(g, u, out)
    })
}

/// The GEMV of `parts` (checked: the same M, K blocking, activation scheme and tier, every
/// buffer its plan's size) over one quantization of `x` and one parallel region over all
/// parts' weight rows; [`LinearPlan::run`] is the one-part case.
fn gemv_parts(x: &[f32], parts: &[FusedPart<'_>], outs: &mut [&mut [f32]]) -> Result<()> {
    let first = parts[0].plan;
    let (s0, act, tier) = (first.shape, first.act, first.tier);
    let (m, k, bk) = (s0.m(), s0.k(), s0.bk());
    let rows = gemv_task_rows(tier, m);
    // the activations' quantized copy (none for W8A16) and their scales live in a reused
    // buffer: a decode step makes a hundred of these calls
    let act_len = if act == ActQuant::None { 0 } else { m * k };
    let scales_len = act_scales_len(m, k, bk, act)?;
    // each task fills a contiguous run of its part's transposed output yt [n, m]: at M = 1 the
    // part's output itself, above it a slice of one reused buffer, untransposed afterwards
    let yt_len = if m == 1 {
        0
    } else {
        parts.iter().map(|p| p.plan.shape.n() * m).sum()
    };
    let xb_len = gemv_bf16_act_len(tier, act, s0);
    with_f32(act_len + scales_len, |abuf| {
        with_f32(yt_len, |ytbuf| -> Result<()> {
            with_buf::<u16, _>(xb_len, |xbbuf| -> Result<()> {
                let deq = gemv_wants_scaled_act(tier, m, act);
                let (abuf, sbuf) = abuf.split_at_mut(act_len);
                let xq = quantize_act_into(x, m, k, bk, act, deq, abuf, sbuf)?;
                let xb = gemv_bf16_act_in(tier, &xq, act, s0, xbbuf);
                {
                    // above M = 1 each part's run of the transposed buffer, listed on the stack for
                    // the usual few parts (q/k/v, gate/up: a decode step allocates nothing here)
                    let (mut small, mut many): ([&mut [f32]; 4], Vec<&mut [f32]>) =
                        (Default::default(), Vec::new());
                    let mut rest = &mut ytbuf[..];
                    let mut runs = parts.iter().zip(outs.iter_mut()).map(|(p, out)| {
                        if m == 1 {
                            &mut **out
                        } else {
                            let (a, b) =
                                std::mem::take(&mut rest).split_at_mut(p.plan.shape.n() * m);
                            rest = b;
                            a
                        }
                    });
                    let targets: &mut [&mut [f32]] = if parts.len() <= small.len() {
                        for (t, run) in small.iter_mut().zip(&mut runs) {
                            *t = run;
                        }
                        &mut small[..parts.len()]
                    } else {
                        many.extend(runs);
                        &mut many
                    };
                    targets
                        .par_iter_mut()
                        .enumerate()
                        .flat_map(|(pi, yt)| {
                            yt.par_chunks_mut(rows * m)
                                .enumerate()
                                .map(move |(c, yt)| (pi, c, yt))
                        })
                        .for_each(|(pi, c, yt)| {
                            let p = &parts[pi];
                            let xa = GemvAct { q: &xq, bf16: xb };
                            gemv_task(
                                tier,
                                xa,
                                p.w,
                                p.sw,
                                p.plan.shape,
                                c * rows,
                                yt,
                                p.plan.nan_free,
                            );
                        });
                }
                if m > 1 {
                    let mut rest = &ytbuf[..];
                    for (p, out) in parts.iter().zip(outs.iter_mut()) {
                        let (a, b) = rest.split_at(p.plan.shape.n() * m);
                        untranspose(a, m, out);
                        rest = b;
                    }
                }
                Ok(())
            })
        })
    })?;
    for (p, out) in parts.iter().zip(outs.iter_mut()) {
        if let Some(b) = p.bias {
            for row in out.chunks_mut(p.plan.shape.n()) {
                for (y, b) in row.iter_mut().zip(b) {
                    *y += b;
                }
            }
        }
    }
    Ok(())
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

/// Weight rows per GEMV task: enough work to amortize the hand-off at M = 1; above it a
/// multiple of both the small-M kernels' row groups (three rows in `gemv_small_rows`, two in
/// `gemv_rows_bf16`), which repeat a group's last row in a short group: tasks of 8 made every
/// task compute a ninth row.
pub(crate) fn gemv_task_rows(tier: Tier, m: usize) -> usize {
    if tier >= Tier::Avx2 && m == 1 {
        32
    } else if tier >= Tier::Avx2 {
        12
    } else {
        8
    }
}

/// Up to how many rows the f32 GEMV of the AVX2 and AVX-512 tiers decodes each weight row in
/// registers per four activation rows ([`gemv::gemv_rows_regs`]); past it, once into a buffer
/// ([`gemv::gemv_small_rows`]). `linear_time M 1536 576 100` on the AVX2 tier (capped on Zen
/// 4, medians of 7 / 5 runs), buffer against registers, ms: M = 2 0.103 against 0.061, 3 0.108
/// against 0.088, 4 0.136 against 0.096; 5 0.18 against 0.21 (two groups of activation rows,
/// each weight row decoded twice), 8 0.23 against 0.24.
pub(crate) const GEMV_REG_MAX_M: usize = 4;

/// Whether [`gemv_task`] takes the activations already multiplied by their scales
/// (`quantize_act(.., dequantize = true)`) for this tier, `m` and scheme: the f32 GEMV that
/// decodes weight rows into a buffer does.
pub(crate) fn gemv_wants_scaled_act(tier: Tier, m: usize, act: ActQuant) -> bool {
    tier >= Tier::Avx2 && m > GEMV_REG_MAX_M && !uses_bf16(tier, act)
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
    let mut buf = vec![0u16; gemv_bf16_act_len(tier, act, s)];
    gemv_bf16_act_in(tier, xq, act, s, &mut buf)?;
    Some(buf)
}

/// The words [`gemv_bf16_act_in`] needs: 0 where [`uses_bf16`] is false.
pub(crate) fn gemv_bf16_act_len(tier: Tier, act: ActQuant, s: LinearShape) -> usize {
    #[cfg(target_arch = "x86_64")]
    if uses_bf16(tier, act) {
        return crate::avx512bf16::act_layout_len(s.m(), s.k(), s.bk());
    }
    let _ = (tier, act, s);
    0
}

/// [`gemv_bf16_act`] into `buf` ([`gemv_bf16_act_len`] words), a reused buffer.
pub(crate) fn gemv_bf16_act_in<'b>(
    tier: Tier,
    xq: &QuantizedAct<'_>,
    act: ActQuant,
    s: LinearShape,
    buf: &'b mut [u16],
) -> Option<&'b [u16]> {
    #[cfg(target_arch = "x86_64")]
    if uses_bf16(tier, act) {
        let x = &xq.values[..s.m() * s.k()];
        crate::avx512bf16::act_layout_into(x, s.k(), s.bk(), buf);
        return Some(buf);
    }
    let _ = (tier, xq, act, s, buf);
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
    } else if tier >= Tier::Avx2 && s.m() > GEMV_REG_MAX_M {
        // scaled activations (`gemv_wants_scaled_act`; W8A16's are their own values)
        with_f32(3 * s.k(), |buf| {
            gemv_small_rows(tier, &xq.values, w, sw, s, n0, yt, buf, nan_free)
        })
    } else if tier >= Tier::Avx2 && s.m() > 1 {
        gemv_rows_regs(tier, xq, w, sw, s, n0, yt, nan_free)
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

/// From how many rows on a W8A8 call of at most [`GEMV_MAX_M`] rows, with rows of `k` codes,
/// runs [`panel_gemm_bf16`] on the AVX512-BF16 tier (one tile of 16 rows, the missing ones
/// zeros) instead of [`gemv_rows_bf16`] (each weight row decoded in registers once per four
/// activation rows): from 7 rows for `k` up to 1024, 9 up to 1536, 13 up to 2048, 11 past that,
/// where the GEMV's decoding of each weight row once per four activation rows, and its
/// products, outweigh the panel's padding to 16 rows. Zen 4, `linear_time` (weights from
/// memory, three runs), GEMV against panel, ms: 1536 x 576 0.14 against 0.20 at M = 6, a tie at
/// 7, 0.12-0.17 against 0.13-0.15 at 8; 576 x 1536 0.15 against 0.16 at 8, a tie at 9 and 10;
/// 5632 x 2048 1.66-1.87 against 1.92-2.00 at 12, a tie at 13; 2048 x 5632 1.47-1.52 against
/// 1.57-1.58 at 10, 1.69-1.74 against 1.59-1.68 at 12; N = K = 4096 1.96 against 2.37 at 10, a
/// tie at 12.
///
/// ```
/// use fp8nsa_cpu::linear::bf16_tile_min_m;
///
/// assert_eq!(bf16_tile_min_m(576), 7); // SmolLM2's projections
/// assert_eq!(bf16_tile_min_m(2048), 13);
/// assert_eq!(bf16_tile_min_m(4096), 11);
/// ```
pub fn bf16_tile_min_m(k: usize) -> usize {
    match k {
        0..=1024 => 7,
        1025..=1536 => 9,
        1537..=2048 => 13,
        _ => 11,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{quantize_act, quantize_weight};

    /// The fused call gives each part the bits of its own call: q/k/v-like parts of different
    /// N (not multiples of the row blocking), with a bias on one, at M = 1, odd M, the GEMV's
    /// largest M and past it (the panel GEMM, also over one quantization), heterogeneous block
    /// scales.
    #[test]
    fn fused_parts_equal_separate_calls() {
        use fp8nsa_test_support::{gaussian, rng};
        let mut r = rng("fused_parts_equal_separate_calls");
        let k = 300;
        let ns = [576usize, 192, 37];
        let weights: Vec<(Vec<u8>, Vec<f32>)> = ns
            .iter()
            .map(|&n| {
                let w: Vec<f32> = gaussian(&mut r, n * k)
                    .iter()
                    .enumerate()
                    .map(|(i, v)| v * 10f32.powi(((i / k / 16 + i % k / 128) % 7) as i32 - 3))
                    .collect();
                quantize_weight(&w, n, k, 16, 128).unwrap()
            })
            .collect();
        let bias = gaussian(&mut r, ns[1]);
        for m in [1usize, 3, GEMV_MAX_M, GEMV_MAX_M + 3, 67] {
            let x = gaussian(&mut r, m * k);
            for act in [ActQuant::Group, ActQuant::None] {
                let parts: Vec<FusedPart> = ns
                    .iter()
                    .zip(&weights)
                    .enumerate()
                    .map(|(i, (&n, (w, sw)))| FusedPart {
                        plan: plan(LinearShape::new(m, n, k, 16, 128).unwrap(), act)
                            .unwrap()
                            .assume_nan_free(true),
                        w,
                        sw,
                        bias: (i == 1).then_some(&bias[..]),
                    })
                    .collect();
                let mut fused: Vec<Vec<f32>> = ns.iter().map(|&n| vec![f32::NAN; m * n]).collect();
                let mut outs: Vec<&mut [f32]> = fused.iter_mut().map(|v| &mut v[..]).collect();
                run_fused(&x, &parts, &mut outs).unwrap();
                for (p, got) in parts.iter().zip(&fused) {
                    let mut want = vec![0f32; got.len()];
                    p.plan.run(&x, p.w, p.sw, p.bias, &mut want).unwrap();
                    assert_eq!(
                        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "m {m} act {act:?} n {}",
                        p.plan.shape().n()
                    );
                }
            }
        }
        // a wrong output count is an error, not a panic
        let p = plan(
            LinearShape::new(1, 37, k, 16, 128).unwrap(),
            ActQuant::Group,
        )
        .unwrap();
        let part = FusedPart {
            plan: p,
            w: &weights[2].0,
            sw: &weights[2].1,
            bias: None,
        };
        assert!(run_fused(&vec![1.0; k], &[part], &mut []).is_err());
    }

    /// `run_swiglu` gives the bits of the two calls and `act::silu_mul`: gate and up with
    /// different blockings (the bias on one), N not a multiple of a task's rows, M = 1, odd M,
    /// the GEMV's largest M and past it, both activation schemes, heterogeneous block scales;
    /// plans that do not fuse (different schemes) take the unfused path with the same bits;
    /// mismatched shapes and buffers are `Error::Shape` naming the argument.
    #[test]
    fn swiglu_equals_silu_of_separate_calls() {
        use fp8nsa_test_support::{gaussian, rng};
        let mut r = rng("swiglu_equals_silu_of_separate_calls");
        let (n, k) = (300, 388);
        let mut weight = |bn: usize| {
            let w: Vec<f32> = gaussian(&mut r, n * k)
                .iter()
                .enumerate()
                .map(|(i, v)| v * 10f32.powi(((i / k / bn + i % k / 128) % 7) as i32 - 3))
                .collect();
            quantize_weight(&w, n, k, bn, 128).unwrap()
        };
        let ((wg, sg), (wu, su)) = (weight(16), weight(128));
        let bias = gaussian(&mut r, n);
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for m in [1usize, 3, GEMV_MAX_M, GEMV_MAX_M + 3, 67] {
            let x = gaussian(&mut r, m * k);
            for (ag, au) in [
                (ActQuant::Group, ActQuant::Group),
                (ActQuant::None, ActQuant::None),
                (ActQuant::Group, ActQuant::None),
            ] {
                let part = |w, sw, bn, act, bias| FusedPart {
                    plan: plan(LinearShape::new(m, n, k, bn, 128).unwrap(), act)
                        .unwrap()
                        .assume_nan_free(true),
                    w,
                    sw,
                    bias,
                };
                let gate = part(&wg[..], &sg[..], 16, ag, None);
                let up = part(&wu[..], &su[..], 128, au, Some(&bias[..]));
                let (mut g, mut u, mut want) =
                    (vec![0f32; m * n], vec![0f32; m * n], vec![0f32; m * n]);
                gate.plan
                    .run(&x, gate.w, gate.sw, gate.bias, &mut g)
                    .unwrap();
                up.plan.run(&x, up.w, up.sw, up.bias, &mut u).unwrap();
                crate::act::silu_mul(&g, &u, &mut want).unwrap();
                let mut got = vec![f32::NAN; m * n];
                run_swiglu(&x, gate, up, &mut got).unwrap();
                assert_eq!(bits(&got), bits(&want), "m {m} acts {ag:?} {au:?}");
            }
        }
        let p = |n| {
            plan(
                LinearShape::new(2, n, k, 128, 128).unwrap(),
                ActQuant::Group,
            )
            .unwrap()
        };
        let x = vec![1f32; 2 * k];
        let gate = FusedPart {
            plan: p(n),
            w: &wu,
            sw: &su,
            bias: None,
        };
        let narrow = FusedPart {
            plan: p(n - 1),
            w: &wu[..(n - 1) * k],
            sw: &su,
            bias: None,
        };
        for (g, u, out_len, arg) in [
            (gate, narrow, 2 * n, "up"),
            (narrow, gate, 2 * (n - 1), "up"),
            (gate, gate, 2 * n - 1, "out"),
        ] {
            let err = run_swiglu(&x, g, u, &mut vec![0f32; out_len]).unwrap_err();
            assert!(
                matches!(err, Error::Shape { arg: a, .. } if a == arg),
                "{arg}: {err:?}"
            );
        }
    }

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
