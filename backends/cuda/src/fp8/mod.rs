//! The fp8 block-scaled linear layer on CUDA: activation quantization, cuBLASLt block scaling,
//! our tensor-core and small-M kernels, and dequantize + cuBLAS as the last resort.
//!
//! ```no_run
//! use cudarc::driver::CudaContext;
//! use fp8nsa_cuda::fp8::{fp8_linear, PreparedWeight};
//! use fp8nsa_types::{ActQuant, CudaFp8Kernel};
//!
//! let stream = CudaContext::new(0)?.default_stream();
//! let (m, n, k) = (7, 576, 3884);
//! let codes = stream.clone_htod(&vec![0x38u8; n * k])?; // e4m3 1.0
//! let scales = stream.clone_htod(&vec![0.5f32; n.div_ceil(128) * k.div_ceil(128)])?;
//! let w = PreparedWeight::new(&stream, &codes.as_view(), &scales.as_view(), [n, k], [128, 128])?;
//! let (wd, ws) = (w.data_view(), w.scales_view());
//! let x = stream.clone_htod(&vec![1f32; m * k])?;
//! let mut y = stream.alloc_zeros::<f32>(m * n)?;
//! let path = fp8_linear(&stream, &x.as_view(), &w.as_ref(&wd, &ws), None, m, ActQuant::Group,
//!     CudaFp8Kernel::Auto, &mut y.as_view_mut())?;
//! println!("ran {path}");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub(crate) mod cublaslt;
mod plan;

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};

pub use plan::{
    plan, Fp8Path, MmaTile, CUBLASLT_MIN_M, MAX_SPLITS, SMALL_M_MAX, SMALL_M_PREFERRED,
};

use fp8nsa_types::{ActQuant, CudaFp8Kernel, LinearShape};

use crate::context::{gpu, grid_for, DeviceInfo, Gpu};
use crate::element::Element;
use crate::error::{invalid, Result};
use crate::launch::{self, Buf, DevBuf, Dtype, KArg, Kernel, Plan, Step, Val};

/// Kernel names, one function per kernel template (the plans and the PTX test share them).
pub(crate) mod names {
    use super::MmaTile;

    pub(crate) const QUANT_MODULE: &str = "fp8_quant";
    pub(crate) const GEMM_MODULE: &str = "fp8_gemm";
    pub(crate) const GEMV_MODULE: &str = "fp8_gemv";

    /// Activation kernel reading `suffix`, writing f32 (`same = false`) or the input type.
    pub(crate) fn act(suffix: &str, same: bool) -> String {
        if same && suffix != "f32" {
            format!("fp8nsa_act_quant_{suffix}_to_{suffix}")
        } else {
            format!("fp8nsa_act_quant_{suffix}")
        }
    }

    pub(crate) fn gemm(tile: MmaTile, suffix: &str) -> String {
        format!("fp8nsa_fp8_gemm_{}_{suffix}", tile.name())
    }

    pub(crate) fn gemv(tokens: usize, suffix: &str) -> String {
        format!("fp8nsa_fp8_gemv_m{tokens}_{suffix}")
    }

    pub(crate) fn elementwise(what: &str, suffix: &str) -> String {
        format!("fp8nsa_{what}_{suffix}")
    }

    #[cfg(test)]
    pub(crate) const SUFFIXES: [&str; 3] = ["f32", "bf16", "f16"];
    #[cfg(test)]
    pub(crate) const GEMV_TOKENS: [usize; 5] = [1, 2, 4, 8, 16];
    #[cfg(test)]
    pub(crate) const TILES: [MmaTile; 3] = [MmaTile::M128, MmaTile::M64, MmaTile::M16];
    #[cfg(test)]
    pub(crate) const ELEMENTWISE: [&str; 3] = ["dequant", "splitk_reduce", "add_bias"];
    pub(crate) const PAD: [&str; 2] = ["fp8nsa_pad2d_u8", "fp8nsa_pad2d_f32"];
}

/// How a prepared weight lies in memory: e4m3 codes `[n, ld]` with `ld = round_up(k, 16)`
/// (zeros past k), f32 scales `[ceil(n/bn), scale_ld]` with
/// `scale_ld = round_up(ceil(k/bk), 4)` (zeros past the last K-block).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WeightLayout {
    pub n: usize,
    pub k: usize,
    pub bn: usize,
    pub bk: usize,
    pub ld: usize,
    pub scale_ld: usize,
}

impl WeightLayout {
    /// The layout of an `[n, k]` weight in `[bn, bk]` blocks; errors for empty shapes and
    /// sizes past the kernels' i32 indexing.
    pub fn new([n, k]: [usize; 2], [bn, bk]: [usize; 2]) -> Result<Self> {
        if n == 0 || k == 0 || bn == 0 || bk == 0 {
            return Err(invalid(
                "weight",
                format!("shape [{n}, {k}] and block [{bn}, {bk}] must be non-zero"),
            ));
        }
        if n > i32::MAX as usize || k > i32::MAX as usize - 16 {
            return Err(invalid(
                "weight",
                format!("[{n}, {k}] exceeds the kernels' i32 indexing"),
            ));
        }
        Ok(Self {
            n,
            k,
            bn,
            bk,
            ld: k.next_multiple_of(16),
            scale_ld: k.div_ceil(bk).next_multiple_of(4),
        })
    }

    /// Scale rows and K-blocks of the checkpoint layout.
    pub fn scale_dims(&self) -> [usize; 2] {
        [self.n.div_ceil(self.bn), self.k.div_ceil(self.bk)]
    }
}

/// A weight in the layout every path reads ([`WeightLayout`]), borrowed: the codes `[n, ld]`
/// (16-byte aligned) and the scales `[ceil(n/bn), scale_ld]`. Checkpoints with K a multiple
/// of 16 need no copy of their codes (see [`WeightLayout::codes_need_padding`]).
#[derive(Clone, Copy)]
pub struct WeightRef<'a> {
    pub data: &'a CudaView<'a, u8>,
    pub scales: &'a CudaView<'a, f32>,
    pub layout: WeightLayout,
}

impl WeightLayout {
    /// Whether the checkpoint's `[n, k]` codes need a padded copy (k not a multiple of 16).
    pub fn codes_need_padding(&self) -> bool {
        self.ld != self.k
    }

    /// Whether the checkpoint's scales need a padded copy (K-blocks not a multiple of 4).
    pub fn scales_need_padding(&self) -> bool {
        self.scale_ld != self.scale_dims()[1]
    }
}

/// A weight fully copied into [`WeightLayout`] (codes and scales), for tests and callers that
/// hold no device copy of their own. Layers keep their codes in place where they can, padding
/// only what needs it ([`pad_rows`]).
pub struct PreparedWeight {
    pub(crate) data: CudaSlice<u8>,
    pub(crate) scales: CudaSlice<f32>,
    pub(crate) layout: WeightLayout,
}

impl std::fmt::Debug for PreparedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PreparedWeight {{ {:?} }}", self.layout)
    }
}

fn val(b: Buf) -> KArg {
    KArg::Val(Val::Ptr(b, 0))
}

fn i32v(v: usize) -> KArg {
    KArg::Val(Val::I32(v as i32))
}

fn i64v(v: usize) -> KArg {
    KArg::Val(Val::I64(v as i64))
}

/// A grid-stride elementwise launch over `n` items.
fn elementwise(module: &'static str, name: String, n: usize, args: Vec<KArg>) -> Kernel {
    Kernel {
        module,
        name,
        grid: (grid_for(n, 256), 1, 1),
        block: 256,
        smem: 0,
        args,
    }
}

/// Element types [`pad_rows`] copies.
pub trait PadElement: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits {
    const KERNEL: &'static str;
}

impl PadElement for u8 {
    const KERNEL: &'static str = names::PAD[0];
}

impl PadElement for f32 {
    const KERNEL: &'static str = names::PAD[1];
}

/// The plan copying `[rows, cols]` (argument 0) into `[rows, ld]` with zeros past `cols`
/// (argument 1).
pub fn plan_pad_rows<T: PadElement>(rows: usize, cols: usize, ld: usize) -> Plan {
    let mut plan = Plan::default();
    plan.kernel(elementwise(
        names::QUANT_MODULE,
        T::KERNEL.to_string(),
        rows * ld,
        vec![
            val(Buf::Arg(0)),
            val(Buf::Arg(1)),
            i32v(rows),
            i32v(cols),
            i64v(ld),
        ],
    ));
    plan
}

/// `src [rows, cols]` copied into a new `[rows, ld]` buffer, zeros past `cols`.
pub fn pad_rows<T: PadElement>(
    stream: &Arc<CudaStream>,
    src: &CudaView<'_, T>,
    rows: usize,
    cols: usize,
    ld: usize,
) -> Result<CudaSlice<T>> {
    if src.len() != rows * cols || ld < cols {
        return Err(invalid(
            "src",
            format!(
                "expected [{rows}, {cols}] (<= ld {ld}), got {} values",
                src.len()
            ),
        ));
    }
    if rows > i32::MAX as usize || cols > i32::MAX as usize {
        return Err(invalid("src", "rows and columns must fit in i32"));
    }
    let g = gpu(stream)?;
    let mut out = stream.alloc_zeros::<T>(rows * ld)?;
    {
        let size = std::mem::size_of::<T>();
        let (s, _g1) = src.device_ptr(stream);
        let (o, _g2) = out.device_ptr_mut(stream);
        let args = [
            DevBuf {
                ptr: s,
                bytes: rows * cols * size,
            },
            DevBuf {
                ptr: o,
                bytes: rows * ld * size,
            },
        ];
        launch::execute(&g, stream, &plan_pad_rows::<T>(rows, cols, ld), &args)?;
    }
    Ok(out)
}

impl PreparedWeight {
    /// From the checkpoint layout: `data` e4m3 `[N, K]`, `scales` `[ceil(N/bn), ceil(K/bk)]`.
    pub fn new(
        stream: &Arc<CudaStream>,
        data: &CudaView<'_, u8>,
        scales: &CudaView<'_, f32>,
        shape: [usize; 2],
        block: [usize; 2],
    ) -> Result<Self> {
        let layout = WeightLayout::new(shape, block)?;
        let [n, k] = shape;
        let [nb, kb] = layout.scale_dims();
        Ok(Self {
            data: pad_rows(stream, data, n, k, layout.ld)?,
            scales: pad_rows(stream, scales, nb, kb, layout.scale_ld)?,
            layout,
        })
    }

    /// `[N, K]`.
    pub fn shape(&self) -> [usize; 2] {
        [self.layout.n, self.layout.k]
    }

    /// `[bn, bk]`.
    pub fn block(&self) -> [usize; 2] {
        [self.layout.bn, self.layout.bk]
    }

    pub fn layout(&self) -> WeightLayout {
        self.layout
    }

    /// Device bytes held.
    pub fn device_bytes(&self) -> usize {
        self.data.len() + 4 * self.scales.len()
    }

    /// Views for [`fp8_linear`], good while the two views live (`let (d, s) = (w.data_view(),
    /// w.scales_view()); fp8_linear(.., &w.as_ref(&d, &s), ..)`).
    pub fn as_ref<'a>(
        &self,
        data: &'a CudaView<'a, u8>,
        scales: &'a CudaView<'a, f32>,
    ) -> WeightRef<'a> {
        WeightRef {
            data,
            scales,
            layout: self.layout,
        }
    }

    pub fn data_view(&self) -> CudaView<'_, u8> {
        self.data.as_view()
    }

    pub fn scales_view(&self) -> CudaView<'_, f32> {
        self.scales.as_view()
    }
}

/// Where the activation kernel writes.
enum ActOut {
    /// e4m3 codes `[rows, ld]` and scales with (row-block, k-block) strides.
    Codes {
        xq: Buf,
        sx: Buf,
        rs: usize,
        cs: usize,
    },
    /// Quantize-dequantized (or plain, for `None`) values `[m, ld]` in f32.
    F32(Buf),
    /// The same in the input type.
    Same(Buf),
}

/// The activation kernel on `x [m, k]` (argument 0): one warp per scale tile, 8 per block.
fn act_step(
    x: Dtype,
    m: usize,
    k: usize,
    ld: usize,
    bk: usize,
    act: ActQuant,
    out: ActOut,
) -> Kernel {
    let bm = match act {
        ActQuant::Block2d { bm } => bm,
        _ => 1,
    };
    let tiles = m.div_ceil(bm) * k.div_ceil(bk);
    let null = KArg::Val(Val::Null);
    let (name, xq, xd, sx, rs, cs) = match out {
        ActOut::Codes { xq, sx, rs, cs } => (
            names::act(x.suffix(), false),
            val(xq),
            null.clone(),
            val(sx),
            rs,
            cs,
        ),
        ActOut::F32(b) => (
            names::act(x.suffix(), false),
            null.clone(),
            val(b),
            null,
            0,
            0,
        ),
        ActOut::Same(b) => (
            names::act(x.suffix(), true),
            null.clone(),
            val(b),
            null,
            0,
            0,
        ),
    };
    Kernel {
        module: names::QUANT_MODULE,
        name,
        grid: (grid_for(tiles, 8), 1, 1),
        block: 256,
        smem: 0,
        args: vec![
            val(Buf::Arg(0)),
            xq,
            xd,
            sx,
            i32v(m),
            i32v(k),
            i32v(ld),
            i32v(bm),
            i32v(bk),
            i64v(rs),
            i64v(cs),
            KArg::Val(Val::I32(i32::from(act == ActQuant::None))),
        ],
    }
}

/// `y[m, n] += bias[n]` on argument 4 (after cuBLAS / cuBLASLt).
fn bias_step(x: Dtype, m: usize, n: usize) -> Kernel {
    elementwise(
        names::QUANT_MODULE,
        names::elementwise("add_bias", x.suffix()),
        m * n,
        vec![val(Buf::Arg(4)), val(Buf::Arg(3)), i32v(m), i32v(n)],
    )
}

/// The plan of one `fp8_linear` call on `path`. Arguments: 0 `x [m, k]` in `x`'s dtype,
/// 1 codes `[n, ld]`, 2 scales `[ceil(n/bn), scale_ld]`, 3 bias `[n]` f32 (read only when
/// `has_bias`), 4 out `[m, n]` in `x`'s dtype. `out_aligned`: argument 4 starts on 16 bytes
/// (cuBLASLt writes straight into it then).
pub fn plan_fp8_linear(
    w: &WeightLayout,
    m: usize,
    act: ActQuant,
    path: Fp8Path,
    x: Dtype,
    has_bias: bool,
    out_aligned: bool,
) -> Plan {
    let WeightLayout {
        n,
        k,
        bn,
        bk,
        ld,
        scale_ld,
    } = *w;
    let bias = if has_bias {
        val(Buf::Arg(3))
    } else {
        KArg::Val(Val::Null)
    };
    let field = |a: &KArg| match a {
        KArg::Val(v) => *v,
        KArg::Struct(_) => unreachable!("scalar"),
    };
    let mut plan = Plan::default();
    match path {
        Fp8Path::CublasLt => {
            let mp = m.next_multiple_of(cublaslt::TOKEN_ALIGN);
            let l = k.div_ceil(128);
            // the activation kernel writes rows and scales of the m tokens; padding tokens need
            // zeros (only then is the memset paid)
            let xq = plan.tmp(mp * ld, mp != m);
            let sx = plan.tmp(4 * l * mp, mp != m);
            plan.kernel(act_step(
                x,
                m,
                k,
                ld,
                128,
                ActQuant::Group,
                ActOut::Codes {
                    xq,
                    sx,
                    rs: 1,
                    cs: mp,
                },
            ));
            let direct = mp == m && out_aligned;
            let d = if direct {
                Buf::Arg(4)
            } else {
                plan.tmp(mp * n * x.size(), false)
            };
            plan.steps
                .push(Step::BlockScaledGemm(launch::BlockScaledGemm {
                    out: x,
                    n,
                    mp,
                    k: ld,
                    w: Buf::Arg(1),
                    w_scales: Buf::Arg(2),
                    x: xq,
                    x_scales: sx,
                    d,
                }));
            if !direct {
                plan.steps.push(Step::Copy {
                    src: d,
                    dst: Buf::Arg(4),
                    bytes: m * n * x.size(),
                });
            }
            if has_bias {
                plan.kernel(bias_step(x, m, n));
            }
        }
        Fp8Path::Mma { tile, splits } => {
            let kb = k.div_ceil(bk);
            let bm_act = match act {
                ActQuant::Block2d { bm } => bm,
                _ => 1,
            };
            let xq = plan.tmp(m * ld, false);
            let sx = plan.tmp(4 * m.div_ceil(bm_act) * kb, false);
            plan.kernel(act_step(
                x,
                m,
                k,
                ld,
                bk,
                act,
                ActOut::Codes {
                    xq,
                    sx,
                    rs: kb,
                    cs: 1,
                },
            ));
            let per = kb.div_ceil(splits.max(1));
            let splits = kb.div_ceil(per);
            let ws = (splits > 1).then(|| plan.tmp(4 * splits * m * n, false));
            let params = vec![
                Val::Ptr(xq, 0),
                Val::Ptr(sx, 0),
                Val::Ptr(Buf::Arg(1), 0),
                Val::Ptr(Buf::Arg(2), 0),
                if splits == 1 { field(&bias) } else { Val::Null },
                Val::Ptr(Buf::Arg(4), 0),
                ws.map_or(Val::Null, |b| Val::Ptr(b, 0)),
                Val::I64(ld as i64),
                Val::I64(ld as i64),
                Val::I64(kb as i64),
                Val::I64(1),
                Val::I64(scale_ld as i64),
                Val::I32(m as i32),
                Val::I32(n as i32),
                Val::I32(k as i32),
                Val::I32(bm_act as i32),
                Val::I32(bn as i32),
                Val::I32(bk as i32),
                Val::I32(per as i32),
                Val::I32(splits as i32),
            ];
            plan.kernel(Kernel {
                module: names::GEMM_MODULE,
                name: names::gemm(tile, x.suffix()),
                grid: (
                    n.div_ceil(128) as u32,
                    m.div_ceil(tile.rows()) as u32,
                    splits as u32,
                ),
                block: tile.warps() * 32,
                smem: tile.smem_bytes(),
                args: vec![KArg::Struct(params)],
            });
            if let Some(ws) = ws {
                plan.kernel(elementwise(
                    names::QUANT_MODULE,
                    names::elementwise("splitk_reduce", x.suffix()),
                    m * n,
                    vec![
                        val(ws),
                        bias,
                        val(Buf::Arg(4)),
                        i32v(m),
                        i32v(n),
                        i32v(splits),
                    ],
                ));
            }
        }
        Fp8Path::SmallM { tokens } => {
            let xd = plan.tmp(4 * m * ld, false);
            plan.kernel(act_step(x, m, k, ld, bk, act, ActOut::F32(xd)));
            let rows = match tokens {
                1..=4 => 8,
                8 => 4,
                _ => 2,
            };
            let threads = k.div_ceil(16).next_multiple_of(32).clamp(32, 256) as u32;
            let params = vec![
                Val::Ptr(xd, 0),
                Val::Ptr(Buf::Arg(1), 0),
                Val::Ptr(Buf::Arg(2), 0),
                field(&bias),
                Val::Ptr(Buf::Arg(4), 0),
                Val::I64(ld as i64),
                Val::I64(ld as i64),
                Val::I64(scale_ld as i64),
                Val::I32(m as i32),
                Val::I32(n as i32),
                Val::I32(k as i32),
                Val::I32(bn as i32),
                Val::I32(bk as i32),
            ];
            plan.kernel(Kernel {
                module: names::GEMV_MODULE,
                name: names::gemv(tokens, x.suffix()),
                grid: (n.div_ceil(rows) as u32, 1, 1),
                block: threads,
                smem: 0,
                args: vec![KArg::Struct(params)],
            });
        }
        Fp8Path::Dequant => {
            let wd = plan.tmp(n * k * x.size(), false);
            plan.kernel(elementwise(
                names::QUANT_MODULE,
                names::elementwise("dequant", x.suffix()),
                n * k,
                vec![
                    val(Buf::Arg(1)),
                    val(Buf::Arg(2)),
                    val(wd),
                    i32v(n),
                    i32v(k),
                    i32v(ld),
                    i32v(bn),
                    i32v(bk),
                    i64v(scale_ld),
                ],
            ));
            // the activations as the contract sees them: quantize-dequantized, or x itself
            let xs = plan.tmp(m * ld * x.size(), false);
            plan.kernel(act_step(x, m, k, ld, bk, act, ActOut::Same(xs)));
            // column-major: y^T [n, m] = W [k, n]^T . x^T [k, m]
            plan.steps.push(Step::Gemm(launch::Gemm {
                dtype: x,
                trans_a: true,
                trans_b: false,
                m: n,
                n: m,
                k,
                a: wd,
                lda: k,
                b: xs,
                ldb: ld,
                c: Buf::Arg(4),
                ldc: n,
            }));
            if has_bias {
                plan.kernel(bias_step(x, m, n));
            }
        }
    }
    plan
}

/// `out[m, n] = x[m, k] . W^T (+ bias)` per the numerics contract, in x's dtype, on `stream`.
/// `bias`, when given, is `[n]` f32. Returns the path that ran. Every element of `out` is
/// written. A forced `kernel` that does not apply is an error saying why; with
/// `CudaFp8Kernel::Auto` a cuBLASLt refusal at run time falls back to our tensor-core kernel.
#[allow(clippy::too_many_arguments)]
pub fn fp8_linear<T: Element>(
    stream: &Arc<CudaStream>,
    x: &CudaView<'_, T>,
    w: &WeightRef<'_>,
    bias: Option<&CudaView<'_, f32>>,
    m: usize,
    act: ActQuant,
    kernel: CudaFp8Kernel,
    out: &mut CudaViewMut<'_, T>,
) -> Result<Fp8Path> {
    let lay = w.layout;
    let (n, k) = (lay.n, lay.k);
    check_linear_args(&lay, m, act, x.len(), out.len(), bias.map(|b| b.len()))?;
    let [nb, _] = lay.scale_dims();
    if w.data.len() != n * lay.ld {
        return Err(invalid(
            "weight",
            format!(
                "codes: expected [{n}, {}] (rows padded to 16 bytes), got {} bytes",
                lay.ld,
                w.data.len()
            ),
        ));
    }
    if w.scales.len() != nb * lay.scale_ld {
        return Err(invalid(
            "weight",
            format!(
                "scales: expected [{nb}, {}], got {} values",
                lay.scale_ld,
                w.scales.len()
            ),
        ));
    }
    let g = gpu(stream)?;
    let shape = LinearShape {
        m,
        n,
        k,
        bn: lay.bn,
        bk: lay.bk,
    };
    let dtype = Dtype::of::<T>();
    let lt_key = (n, m.next_multiple_of(cublaslt::TOKEN_ALIGN), lay.ld, dtype);
    // Auto's cuBLASLt pick falls back to our kernel when cuBLASLt refuses the problem
    let may_fall_back = |path: Fp8Path| path == Fp8Path::CublasLt && kernel == CudaFp8Kernel::Auto;
    let fallback = || plan(&g.info, &shape, act, CudaFp8Kernel::Mma);
    let mut path = plan(&g.info, &shape, act, kernel)?;
    if may_fall_back(path) && g.lt_refused(lt_key) {
        path = fallback()?;
    }
    let size = dtype.size();
    let (xp, _g1) = x.device_ptr(stream);
    let (wp, _g2) = w.data.device_ptr(stream);
    let (sp, _g3) = w.scales.device_ptr(stream);
    // the kernels read the codes in 16-byte vectors; cuBLASLt wants 16-byte scale pointers
    if wp % 16 != 0 || sp % 16 != 0 {
        return Err(invalid(
            "weight",
            "codes and scales must start on a 16-byte boundary",
        ));
    }
    let (bp, _g4) = match bias {
        Some(b) => {
            let (p, g) = b.device_ptr(stream);
            (p, Some(g))
        }
        None => (0, None),
    };
    let (op, _g5) = out.device_ptr_mut(stream);
    let args = [
        DevBuf {
            ptr: xp,
            bytes: m * k * size,
        },
        DevBuf {
            ptr: wp,
            bytes: w.data.len(),
        },
        DevBuf {
            ptr: sp,
            bytes: 4 * w.scales.len(),
        },
        DevBuf {
            ptr: bp,
            bytes: 4 * n,
        },
        DevBuf {
            ptr: op,
            bytes: m * n * size,
        },
    ];
    let run = |path: Fp8Path| {
        let p = plan_fp8_linear(&lay, m, act, path, dtype, bias.is_some(), op % 16 == 0);
        launch::execute(&g, stream, &p, &args)
    };
    match run(path) {
        Ok(()) => Ok(path),
        Err(e) if may_fall_back(path) => {
            let fallback = fallback()?;
            g.refuse_lt(lt_key);
            tracing::warn!(op = "fp8_linear", backend = "cuda", error = %e, fallback = %fallback, "cuBLASLt refused this problem; not asking again");
            run(fallback)?;
            Ok(fallback)
        }
        Err(e) => Err(e),
    }
}

/// The argument checks of [`fp8_linear`], shared with the emulator.
pub fn check_linear_args(
    w: &WeightLayout,
    m: usize,
    act: ActQuant,
    x_len: usize,
    out_len: usize,
    bias_len: Option<usize>,
) -> Result<()> {
    let (n, k) = (w.n, w.k);
    if m == 0 {
        return Err(invalid("x", "needs at least one row"));
    }
    if m > i32::MAX as usize / 2 || m.saturating_mul(w.ld) > i32::MAX as usize * 16 {
        return Err(invalid(
            "x",
            format!("{m} rows exceed the kernels' indexing"),
        ));
    }
    if x_len != m * k {
        return Err(invalid(
            "x",
            format!("expected [{m}, {k}] = {} elements, got {x_len}", m * k),
        ));
    }
    if out_len != m * n {
        return Err(invalid(
            "out",
            format!("expected [{m}, {n}] = {} elements, got {out_len}", m * n),
        ));
    }
    if let Some(b) = bias_len {
        if b != n {
            return Err(invalid("bias", format!("expected [{n}], got {b} values")));
        }
    }
    if let ActQuant::Block2d { bm: 0 } = act {
        return Err(invalid("act", "Block2d row block must be at least 1"));
    }
    if m.div_ceil(MmaTile::M16.rows()) > 65535 {
        return Err(invalid(
            "x",
            format!("{m} rows need more than 65535 row tiles"),
        ));
    }
    Ok(())
}

/// cuBLAS GEMM step (the last-resort path).
pub(crate) fn gemm(
    g: &Gpu,
    stream: &Arc<CudaStream>,
    c: &launch::Gemm,
    resolve: &dyn Fn(Buf) -> u64,
) -> Result<()> {
    use cudarc::cublas::sys::{
        cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t as Op, cudaDataType,
    };
    let t = match c.dtype {
        Dtype::F32 => cudaDataType::CUDA_R_32F,
        Dtype::Bf16 => cudaDataType::CUDA_R_16BF,
        Dtype::F16 => cudaDataType::CUDA_R_16F,
    };
    let op = |tr: bool| if tr { Op::CUBLAS_OP_T } else { Op::CUBLAS_OP_N };
    let blas = g.blas(stream)?;
    let (alpha, beta) = (1f32, 0f32);
    // SAFETY: the plan sized A (lda x (trans_a ? m : k)), B and C for these dimensions; the
    // handle is bound to `stream`; alpha / beta are f32 as CUBLAS_COMPUTE_32F expects.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            op(c.trans_a),
            op(c.trans_b),
            c.m as i32,
            c.n as i32,
            c.k as i32,
            &alpha as *const f32 as *const _,
            launch::cptr(resolve, c.a),
            t,
            c.lda as i32,
            launch::cptr(resolve, c.b),
            t,
            c.ldb as i32,
            &beta as *const f32 as *const _,
            launch::cptr(resolve, c.c),
            t,
            c.ldc as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }?;
    Ok(())
}

/// The device facts the planner uses, for tests and tools that plan without a stream.
pub fn device_info_for(cc: (i32, i32), sms: u32, smem_optin: u32) -> Option<DeviceInfo> {
    Some(DeviceInfo {
        cc,
        sms,
        smem_optin,
        family: crate::ptx::Family::for_capability(cc)?,
    })
}
