//! The launch plan of one fp8 linear call, built from the path the planner chose: activation
//! quantization, the GEMM step (our kernels, cuBLASLt or cuBLAS), split-K reduction and bias.
//! Pure: nothing here touches a device.

use fp8nsa_types::{ActQuant, CudaFp8Path};

use crate::context::grid_for;
use crate::step::{self, Buf, Dtype, KArg, Kernel, Plan, Step, Val};

use super::args::{elementwise, i32v, i64v, val};
use super::names;

use super::plan::{tile_smem_bytes, tile_warps};
use super::weight::WeightLayout;

/// Threads per CTA of the small-M kernel.
const GEMV_BLOCK: usize = 256;
/// CTAs the small-M grid aims for: three per SM of a 132-SM H100, the fewest with which every
/// DeepSeek-V3 shape streamed at its best in the H100 sweep (benches/gpu/gemv_sweep.cu).
const GEMV_MIN_CTAS: usize = 396;
/// Most 16-byte chunks of a row one thread walks: past this a narrower group leaves too few
/// loads in flight per row (run3's sweep, the group kernel's first form, 7168 x 16384 at
/// M = 1: 48 us at 8 chunks per thread, 52 us at 16).
const GEMV_MAX_CHUNKS_PER_THREAD: usize = 8;

/// How the small-M kernel runs for `n` rows, `k` columns and `tokens` (its template size).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct GemvLaunch {
    /// Output rows per thread group, as the kernel's template instances have them.
    pub rows: usize,
    /// Threads per group (a multiple of 32, at most [`GEMV_BLOCK`]).
    pub tpg: usize,
    /// Threads per CTA.
    pub block: usize,
    /// CTAs.
    pub ctas: usize,
}

/// The dense small-M kernel. Up to 8 tokens (`fp8_gemv`): the narrowest group (fewest threads
/// per row) that still gives the grid [`GEMV_MIN_CTAS`] CTAs of [`GEMV_BLOCK`] threads and
/// each thread at most [`GEMV_MAX_CHUNKS_PER_THREAD`] chunks of a row, among the widths up to
/// the row's chunk count rounded up to a power of two (at least 32); where none meets both
/// limits, that widest one. 16 tokens: [`gemv_cta_launch`].
pub(super) fn gemv_launch(n: usize, k: usize, tokens: usize) -> GemvLaunch {
    if tokens > 8 {
        return gemv_cta_launch(n, k, tokens);
    }
    let chunks = k.div_ceil(16).max(1);
    let widest = chunks.next_power_of_two().clamp(32, GEMV_BLOCK);
    let rows = 4;
    let groups = n.div_ceil(rows).max(1);
    let ctas = |tpg: usize| groups.div_ceil(GEMV_BLOCK / tpg);
    let tpg = [32, 64, 128, 256]
        .into_iter()
        .filter(|&tpg| tpg <= widest)
        .find(|&tpg| {
            ctas(tpg) >= GEMV_MIN_CTAS && chunks.div_ceil(tpg) <= GEMV_MAX_CHUNKS_PER_THREAD
        })
        .unwrap_or(widest);
    GemvLaunch {
        rows,
        tpg,
        block: GEMV_BLOCK,
        ctas: ctas(tpg),
    }
}

/// The CTA-wide form (`fp8_gemv_cta`: 16 tokens, and every grouped expert launch): the CTA is
/// one group of 8 rows (up to 4 tokens), 4 (8 tokens) or 2 (16), a thread per 16-byte chunk
/// of K, 32 to 256.
pub(super) fn gemv_cta_launch(n: usize, k: usize, tokens: usize) -> GemvLaunch {
    let rows = match tokens {
        1..=4 => 8,
        5..=8 => 4,
        _ => 2,
    };
    let threads = k.div_ceil(16).next_multiple_of(32).clamp(32, GEMV_BLOCK);
    GemvLaunch {
        rows,
        tpg: threads,
        block: threads,
        ctas: n.div_ceil(rows).max(1),
    }
}

/// The fields of `GemvParams` (fp8_gemv.cu), in order: activations `xd` f32 `[m, ld]`, codes
/// argument 1, scales argument 2, output argument 4, the group width.
pub(super) fn gemv_params(
    w: &WeightLayout,
    xd: Buf,
    bias: Val,
    m: usize,
    launch: GemvLaunch,
) -> Vec<Val> {
    vec![
        Val::Ptr(xd, 0),
        Val::Ptr(Buf::Arg(1), 0),
        Val::Ptr(Buf::Arg(2), 0),
        bias,
        Val::Ptr(Buf::Arg(4), 0),
        Val::I64(w.ld as i64),
        Val::I64(w.ld as i64),
        Val::I64(w.scale_ld as i64),
        Val::I32(m as i32),
        Val::I32(w.n as i32),
        Val::I32(w.k as i32),
        Val::I32(w.bn as i32),
        Val::I32(w.bk as i32),
        Val::I32(launch.tpg as i32),
    ]
}

/// The fields of `GemmParams` (fp8_gemm.cu), in order: codes `xq [m, ld]` with scales `sx`
/// (row-block stride = K-blocks, K-block stride 1), weight codes argument 1, scales argument 2,
/// output argument 4; `ws` the split-K workspace.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm_params(
    w: &WeightLayout,
    (xq, sx): (Buf, Buf),
    bias: Val,
    ws: Val,
    m: usize,
    bm_act: usize,
    per: usize,
    splits: usize,
) -> Vec<Val> {
    let kb = w.k.div_ceil(w.bk);
    vec![
        Val::Ptr(xq, 0),
        Val::Ptr(sx, 0),
        Val::Ptr(Buf::Arg(1), 0),
        Val::Ptr(Buf::Arg(2), 0),
        bias,
        Val::Ptr(Buf::Arg(4), 0),
        ws,
        Val::I64(w.ld as i64),
        Val::I64(w.ld as i64),
        Val::I64(kb as i64),
        Val::I64(1),
        Val::I64(w.scale_ld as i64),
        Val::I32(m as i32),
        Val::I32(w.n as i32),
        Val::I32(w.k as i32),
        Val::I32(bm_act as i32),
        Val::I32(w.bn as i32),
        Val::I32(w.bk as i32),
        Val::I32(per as i32),
        Val::I32(splits as i32),
    ]
}

/// Where the activation kernel writes.
pub(super) enum ActOut {
    /// e4m3 codes `[rows, ld]` and scales with (row-block, k-block) strides.
    Codes {
        xq: Val,
        sx: Val,
        rs: usize,
        cs: usize,
    },
    /// Quantize-dequantized (or plain, for `None`) values `[m, ld]` in f32.
    F32(Val),
    /// The same in the input type.
    Same(Val),
}

/// The activation kernel on `x [m, k]` at `src`: one warp per scale tile, 8 per block.
#[allow(clippy::too_many_arguments)]
pub(super) fn act_step(
    x: Dtype,
    src: Val,
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
            KArg::Val(xq),
            null.clone(),
            KArg::Val(sx),
            rs,
            cs,
        ),
        ActOut::F32(b) => (
            names::act(x.suffix(), false),
            null.clone(),
            KArg::Val(b),
            null,
            0,
            0,
        ),
        ActOut::Same(b) => (
            names::act(x.suffix(), true),
            null.clone(),
            KArg::Val(b),
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
            KArg::Val(src),
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

/// The call's input, argument 0.
pub(super) const X: Val = Val::Ptr(Buf::Arg(0), 0);

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
    path: CudaFp8Path,
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
        CudaFp8Path::CublasLt => {
            let mp = m.next_multiple_of(crate::blas::cublaslt::TOKEN_ALIGN);
            let l = k.div_ceil(128);
            // the activation kernel writes rows and scales of the m tokens; padding tokens need
            // zeros (only then is the memset paid)
            let xq = plan.tmp(mp * ld, mp != m);
            let sx = plan.tmp(4 * l * mp, mp != m);
            plan.kernel(act_step(
                x,
                X,
                m,
                k,
                ld,
                128,
                ActQuant::Group,
                ActOut::Codes {
                    xq: Val::Ptr(xq, 0),
                    sx: Val::Ptr(sx, 0),
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
                .push(Step::BlockScaledGemm(step::BlockScaledGemm {
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
        CudaFp8Path::Mma { tile, splits } => {
            let kb = k.div_ceil(bk);
            let bm_act = match act {
                ActQuant::Block2d { bm } => bm,
                _ => 1,
            };
            let xq = plan.tmp(m * ld, false);
            let sx = plan.tmp(4 * m.div_ceil(bm_act) * kb, false);
            plan.kernel(act_step(
                x,
                X,
                m,
                k,
                ld,
                bk,
                act,
                ActOut::Codes {
                    xq: Val::Ptr(xq, 0),
                    sx: Val::Ptr(sx, 0),
                    rs: kb,
                    cs: 1,
                },
            ));
            let per = kb.div_ceil(splits.max(1));
            let splits = kb.div_ceil(per);
            let ws = (splits > 1).then(|| plan.tmp(4 * splits * m * n, false));
            let params = gemm_params(
                w,
                (xq, sx),
                if splits == 1 { field(&bias) } else { Val::Null },
                ws.map_or(Val::Null, |b| Val::Ptr(b, 0)),
                m,
                bm_act,
                per,
                splits,
            );
            plan.kernel(Kernel {
                module: names::GEMM_MODULE,
                name: names::gemm(tile, x.suffix()),
                grid: (
                    n.div_ceil(128) as u32,
                    m.div_ceil(tile.rows()) as u32,
                    splits as u32,
                ),
                block: tile_warps(tile) * 32,
                smem: tile_smem_bytes(tile),
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
        CudaFp8Path::SmallM { tokens } => {
            let xd = plan.tmp(4 * m * ld, false);
            plan.kernel(act_step(
                x,
                X,
                m,
                k,
                ld,
                bk,
                act,
                ActOut::F32(Val::Ptr(xd, 0)),
            ));
            let launch = gemv_launch(n, k, tokens);
            let params = gemv_params(w, xd, field(&bias), m, launch);
            plan.kernel(Kernel {
                module: names::GEMV_MODULE,
                name: names::gemv(tokens, x.suffix()),
                grid: (launch.ctas as u32, 1, 1),
                block: launch.block as u32,
                smem: 0,
                args: vec![KArg::Struct(params)],
            });
        }
        CudaFp8Path::Dequant => {
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
            plan.kernel(act_step(
                x,
                X,
                m,
                k,
                ld,
                bk,
                act,
                ActOut::Same(Val::Ptr(xs, 0)),
            ));
            // column-major: y^T [n, m] = W [k, n]^T . x^T [k, m]
            plan.steps.push(Step::Gemm(step::Gemm {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// On the H100 sweep (benches/gpu/gemv_sweep.cu, one token, kernel only) these widths
    /// streamed fastest for the DeepSeek-V3 shapes; the rule must keep picking them.
    #[test]
    fn gemv_launch_picks_the_measured_widths() {
        for (n, k, tpg) in [
            (2112, 7168, 256),
            (24576, 1536, 32),
            (7168, 16384, 128),
            (4096, 7168, 128),
            (7168, 2048, 64),
        ] {
            let l = gemv_launch(n, k, 1);
            assert_eq!((l.rows, l.tpg, l.block), (4, tpg, 256), "{n} x {k}");
            // every row group has its threads, and no more CTAs than needed
            assert_eq!(l.ctas, n.div_ceil(4).div_ceil(256 / tpg), "{n} x {k}");
        }
    }

    /// Short rows get no group wider than their chunk count rounded up to a power of two (at
    /// least 32); 16 tokens and the grouped experts take the CTA-wide kernel, a thread per
    /// chunk.
    #[test]
    fn gemv_launch_small_and_wide_cases() {
        assert_eq!(gemv_launch(5, 20, 1).tpg, 32);
        assert_eq!(gemv_launch(576, 3884, 4).tpg, 256);
        let l = gemv_launch(576, 3884, 16);
        assert_eq!((l.rows, l.tpg, l.block, l.ctas), (2, 256, 256, 288));
        let l = gemv_launch(7, 100, 16);
        assert_eq!((l.rows, l.tpg, l.block, l.ctas), (2, 32, 32, 4));
        // the MoE bench's experts, [768, 2048], one token: as first measured on the H100
        let l = gemv_cta_launch(768, 2048, 1);
        assert_eq!((l.rows, l.tpg, l.block, l.ctas), (8, 128, 128, 96));
    }
}
