//! `y = x · Wᵀ` with fp8 block-scaled weights, two kernels:
//! - [`CpuKernel::Gemv`] for `m <= GEMV_MAX_M` (decode): streams each weight byte once, decodes
//!   in registers, applies `sx · sw` per K-block to the f32 partial dot product;
//! - [`CpuKernel::PanelGemm`] otherwise: dequantizes a cache-sized panel of weight rows (codes
//!   times their block scale) and multiplies it with the dequantized activations using the `gemm`
//!   crate. Scaling each factor by its own block scale before the product is the contract's
//!   per-K-block scaling, distributed over the sum.

use rayon::prelude::*;

pub use crate::quant::ActMode;
use crate::error::{check_len, check_positive, Result};
use crate::fp8::{decode_scaled, e4m3_to_f32};
use crate::quant::{quantize_act, QuantizedAct};
use crate::simd::{dot, simd_dispatch, Arith};

/// Largest `m` served by the GEMV kernel.
pub const GEMV_MAX_M: usize = 16;

/// Problem size: `x [m, k]`, `W [n, k]` in `bn x bk` blocks, `y [m, n]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fp8LinearShape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub bn: usize,
    pub bk: usize,
}

impl Fp8LinearShape {
    pub fn n_blocks(&self) -> usize {
        self.n.div_ceil(self.bn)
    }
    pub fn k_blocks(&self) -> usize {
        self.k.div_ceil(self.bk)
    }
    fn validate(&self) -> Result<()> {
        for (arg, v) in [
            ("m", self.m),
            ("n", self.n),
            ("k", self.k),
            ("bn", self.bn),
            ("bk", self.bk),
        ] {
            check_positive(arg, v)?;
        }
        Ok(())
    }
}

/// The kernel a call runs; reported for logging.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CpuKernel {
    Gemv,
    PanelGemm,
}

impl CpuKernel {
    pub fn for_shape(shape: &Fp8LinearShape) -> Self {
        if shape.m <= GEMV_MAX_M {
            CpuKernel::Gemv
        } else {
            CpuKernel::PanelGemm
        }
    }
    pub fn name(&self) -> &'static str {
        match self {
            CpuKernel::Gemv => "cpu-gemv",
            CpuKernel::PanelGemm => "cpu-panel-gemm",
        }
    }
}

/// Computes `out [m, n] = x [m, k] · dequant(W)ᵀ + bias` per the numerics contract.
///
/// `w` holds e4m3fn codes `[n, k]`, `sw` the scales `[ceil(n/bn), ceil(k/bk)]`, `bias` has `n`
/// entries. Activations are quantized dynamically according to `act`.
pub fn fp8_linear(
    x: &[f32],
    w: &[u8],
    sw: &[f32],
    bias: Option<&[f32]>,
    shape: Fp8LinearShape,
    act: ActMode,
    out: &mut [f32],
) -> Result<CpuKernel> {
    shape.validate()?;
    let s = shape;
    check_len("x", x.len(), s.m * s.k)?;
    check_len("weight", w.len(), s.n * s.k)?;
    check_len("weight scales", sw.len(), s.n_blocks() * s.k_blocks())?;
    check_len("out", out.len(), s.m * s.n)?;
    if let Some(b) = bias {
        check_len("bias", b.len(), s.n)?;
    }
    if let ActMode::Block2d { bm } = act {
        check_positive("bm", bm)?;
    }
    let kernel = CpuKernel::for_shape(&s);
    // yt is the transposed output [n, m]: each task then owns a contiguous run of it.
    let mut yt = vec![0f32; s.n * s.m];
    match kernel {
        CpuKernel::Gemv => {
            let xq = quantize_act(x, s.m, s.k, s.bk, act, false)?;
            let rows = 8;
            yt.par_chunks_mut(rows * s.m)
                .enumerate()
                .for_each(|(c, yt)| gemv_rows(&xq, w, sw, s, c * rows, yt));
        }
        CpuKernel::PanelGemm => {
            let xd = quantize_act(x, s.m, s.k, s.bk, act, true)?;
            panel_gemm(&xd.values, w, sw, s, &mut yt);
        }
    }
    for (r, row) in out.chunks_exact_mut(s.n).enumerate() {
        for (j, y) in row.iter_mut().enumerate() {
            *y = yt[j * s.m + r] + bias.map_or(0.0, |b| b[j]);
        }
    }
    Ok(kernel)
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

/// Fills `yt [rows, m]` for weight rows `n0..`: one pass over those weight rows.
#[inline(always)]
fn gemv_rows_impl<A: Arith>(
    xq: &QuantizedAct<'_>,
    w: &[u8],
    sw: &[f32],
    s: Fp8LinearShape,
    n0: usize,
    yt: &mut [f32],
) {
    const CHUNK: usize = 256;
    let (m, k, kbs) = (s.m, s.k, s.k_blocks());
    let x = &xq.values[..];
    let mut buf = [0f32; CHUNK];
    let mut part = [0f32; GEMV_MAX_M];
    for (r, acc) in yt.chunks_exact_mut(m).enumerate() {
        let n = n0 + r;
        let wrow = &w[n * k..(n + 1) * k];
        let sw_row = &sw[(n / s.bn) * kbs..(n / s.bn + 1) * kbs];
        for (kb, &swv) in sw_row.iter().enumerate() {
            let (k0, k1) = (kb * s.bk, (kb * s.bk + s.bk).min(k));
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
                for (d, &c) in b.iter_mut().zip(&wrow[c0..c1]) {
                    *d = e4m3_to_f32(c);
                }
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
    xq: &QuantizedAct<'_>, w: &[u8], sw: &[f32], s: Fp8LinearShape, n0: usize, yt: &mut [f32]
));

/// Weight rows per panel: about 512 KiB of dequantized f32, a multiple of 8 rows.
fn panel_rows(s: &Fp8LinearShape) -> usize {
    ((128 * 1024 / s.k).max(8) / 8 * 8).min(s.n.next_multiple_of(8))
}

fn panel_gemm(x: &[f32], w: &[u8], sw: &[f32], s: Fp8LinearShape, yt: &mut [f32]) {
    let p = panel_rows(&s);
    let panels = s.n.div_ceil(p);
    let threads = rayon::current_num_threads();
    let dequant = |n0: usize, buf: &mut [f32]| {
        let kbs = s.k_blocks();
        for (r, row) in buf.chunks_exact_mut(s.k).enumerate() {
            let n = n0 + r;
            for kb in 0..kbs {
                let (k0, k1) = (kb * s.bk, (kb * s.bk + s.bk).min(s.k));
                let scale = sw[(n / s.bn) * kbs + kb];
                decode_scaled(&w[n * s.k + k0..n * s.k + k1], scale, &mut row[k0..k1]);
            }
        }
    };
    if panels >= 2 * threads {
        // Many panels: one panel per task, each product single-threaded.
        yt.par_chunks_mut(p * s.m).enumerate().for_each_init(
            || vec![0f32; p * s.k],
            |buf, (i, dst)| {
                let rows = dst.len() / s.m;
                let buf = &mut buf[..rows * s.k];
                dequant(i * p, buf);
                gemm_nt(s.m, rows, s.k, x, buf, dst, gemm::Parallelism::None);
            },
        );
    } else {
        // Few panels (small n, large m): let the product itself use every thread.
        let mut buf = vec![0f32; p * s.k];
        for (i, dst) in yt.chunks_mut(p * s.m).enumerate() {
            let rows = dst.len() / s.m;
            let buf = &mut buf[..rows * s.k];
            dequant(i * p, buf);
            gemm_nt(s.m, rows, s.k, x, buf, dst, gemm::Parallelism::Rayon(threads));
        }
    }
}

/// `dst[j * m + i] = Σ_k lhs[i * k + kk] · rhs[j * k + kk]`: lhs `[m, k]` and rhs `[p, k]`
/// row-major, dst column-major `[m, p]` (that is, row-major `[p, m]`).
fn gemm_nt(
    m: usize,
    p: usize,
    k: usize,
    lhs: &[f32],
    rhs: &[f32],
    dst: &mut [f32],
    par: gemm::Parallelism,
) {
    assert!(lhs.len() >= m * k && rhs.len() >= p * k && dst.len() >= m * p);
    // SAFETY: the three pointers come from slices at least as long as the extents checked just
    // above, every (row, col) the strides address lies inside them, and `dst` is exclusively
    // borrowed, so gemm reads and writes only memory we own.
    unsafe {
        gemm::gemm(
            m,
            p,
            k,
            dst.as_mut_ptr(),
            m as isize,
            1,
            false,
            lhs.as_ptr(),
            1,
            k as isize,
            rhs.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}
