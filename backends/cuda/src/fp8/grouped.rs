//! The grouped fp8 GEMM of a mixture-of-experts layer: `E` experts' weights stacked
//! (`[E, n, ld]` codes, `[E, ceil(n/bn), scale_ld]` scales, each expert in the
//! [`WeightLayout`] of one weight), token rows grouped by expert (`counts[e]` rows for expert
//! `e`, in order). One kernel launch covers every expert: the small-M kernel's grouped form for
//! decode (a CTA of an expert without rows returns at once, so only routed experts' weights are
//! read), the tensor-core kernel's grouped form when groups are larger.
//!
//! Activations are quantized as `E` separate [`super::fp8_linear`] calls would: `Group` and
//! `None` per row (one launch over all rows), `Block2d` row blocks within each expert's group
//! (one activation launch per routed expert).

use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use fp8nsa_types::{ActQuant, CudaFp8Kernel, CudaFp8Path, ExpertsShape, LinearShape};

use crate::context::{gpu, DeviceInfo};
use crate::element::Element;
use crate::error::{invalid, unsupported, Result};
use crate::launch;
use crate::step::{Buf, DevBuf, Dtype, KArg, Kernel, Plan, Val};

use super::build::{act_step, gemm_params, gemv_cta_launch, gemv_params, ActOut, X};
use super::names;
use super::plan::{
    applicability, mma_tile, tile_smem_bytes, tile_warps, SMALL_M_MAX, SMALL_M_PREFERRED,
};
use super::weight::{WeightLayout, WeightRef};

/// Checks a grouped call's routing and returns the rows it covers: one count per expert (at
/// least one expert), at least one row in all, within the kernels' indexing.
pub fn check_grouped(w: &WeightLayout, counts: &[usize], act: ActQuant) -> Result<usize> {
    if counts.is_empty() {
        return Err(invalid("counts", "needs one count per expert, got none"));
    }
    // grid.y of the grouped small-M kernel is the expert
    if counts.len() > 65535 {
        return Err(invalid(
            "counts",
            format!(
                "{} experts, more than one launch takes (65535)",
                counts.len()
            ),
        ));
    }
    // one count per expert, at least one row in all: the routing check of every backend
    let t = ExpertsShape::new(counts.len(), w.n, w.k, w.bn, w.bk)?.routed_rows(counts)?;
    // the row tiles of all groups share grid.y, like the rows of one call
    let tiles: usize = counts
        .iter()
        .map(|c| c.div_ceil(super::MmaTile::M16.rows()))
        .sum();
    if tiles > 65535 {
        return Err(invalid(
            "counts",
            format!("{t} rows need more than 65535 row tiles"),
        ));
    }
    super::check_call(w, t, act)?;
    Ok(t)
}

/// The path of one grouped call, from the device, one expert's layout, the routing and the
/// activation scheme alone (pure). `CudaFp8Kernel::Auto` picks the small-M kernel while every
/// group is small and the tensor-core kernel where it applies beyond that; `SmallM` and `Mma`
/// force one (an error saying why when it does not apply). cuBLASLt and the dequantize path
/// have no grouped form here: forcing them is `Error::Unsupported`.
pub fn plan_grouped(
    info: &DeviceInfo,
    w: &WeightLayout,
    counts: &[usize],
    act: ActQuant,
    kernel: CudaFp8Kernel,
) -> Result<CudaFp8Path> {
    check_grouped(w, counts, act)?;
    let most = counts.iter().copied().max().unwrap_or(0);
    // (a call without rows plans as one row: the planner needs a valid problem)
    let shape = LinearShape::new(most.clamp(1, SMALL_M_MAX), w.n, w.k, w.bn, w.bk)?;
    // the grouped small-M kernel takes groups of any size (in chunks of 16 tokens)
    let a = applicability(info, &shape, act);
    let small = || CudaFp8Path::SmallM {
        tokens: most.clamp(1, SMALL_M_MAX).next_power_of_two(),
    };
    let mma = || CudaFp8Path::Mma {
        tile: mma_tile(most),
        splits: 1,
    };
    let refuse = |what: &str, why: &String| {
        Err(unsupported(
            "grouped fp8 GEMM",
            format!("{what} does not apply: {why}"),
        ))
    };
    match kernel {
        CudaFp8Kernel::Auto => {
            if a.small_m.is_ok() && (most <= SMALL_M_PREFERRED || a.mma.is_err()) {
                Ok(small())
            } else if a.mma.is_ok() {
                Ok(mma())
            } else {
                refuse(
                    "no grouped kernel",
                    &format!(
                        "{}; {}",
                        a.small_m.err().unwrap_or_default(),
                        a.mma.err().unwrap_or_default()
                    ),
                )
            }
        }
        CudaFp8Kernel::SmallM => match &a.small_m {
            Ok(()) => Ok(small()),
            Err(why) => refuse("the small-M kernel", why),
        },
        CudaFp8Kernel::Mma => match &a.mma {
            Ok(()) => Ok(mma()),
            Err(why) => refuse("the fp8 tensor-core kernel", why),
        },
        CudaFp8Kernel::CublasLt | CudaFp8Kernel::Dequant => Err(unsupported(
            "grouped fp8 GEMM",
            format!("{kernel:?} has no grouped form; use Auto, SmallM or Mma"),
        )),
    }
}

/// The plan of one grouped call on `path` (`SmallM` or `Mma`; any other path is
/// `Error::Unsupported`). Arguments: 0 `x [T, k]` in `x`'s dtype, 1 codes `[E, n, ld]`,
/// 2 scales `[E, ceil(n/bn), scale_ld]`, 3 row offsets `[E + 1]` i32 (the prefix sums of
/// `counts`), 4 out `[T, n]` in `x`'s dtype.
pub fn plan_fp8_grouped(
    w: &WeightLayout,
    counts: &[usize],
    act: ActQuant,
    path: CudaFp8Path,
    x: Dtype,
) -> Result<Plan> {
    let t = check_grouped(w, counts, act)?;
    let WeightLayout {
        n,
        k,
        bn,
        bk,
        ld,
        scale_ld,
    } = *w;
    let e = counts.len();
    let kb = k.div_ceil(bk);
    let bm = match act {
        ActQuant::Block2d { bm } => bm,
        _ => 1,
    };
    // (first row, first activation-scale row, rows) of each routed expert
    let groups: Vec<(usize, usize, usize)> = counts
        .iter()
        .scan((0, 0), |(r, sr), &c| {
            let g = (*r, *sr, c);
            *r += c;
            *sr += c.div_ceil(bm);
            Some(g)
        })
        .filter(|g| g.2 > 0)
        .collect();
    let scale_rows: usize = counts.iter().map(|c| c.div_ceil(bm)).sum();
    let at = |b: Buf, bytes: usize| Val::Ptr(b, bytes);
    // one activation launch over all rows, or one per group where row blocks must not span two
    let act_launches = |plan: &mut Plan, out: &dyn Fn(usize, usize) -> ActOut| {
        if matches!(act, ActQuant::Block2d { .. }) {
            for &(r0, sr0, c) in &groups {
                plan.kernel(act_step(
                    x,
                    at(Buf::Arg(0), r0 * k * x.size()),
                    c,
                    k,
                    ld,
                    bk,
                    act,
                    out(r0, sr0),
                ));
            }
        } else {
            plan.kernel(act_step(x, X, t, k, ld, bk, act, out(0, 0)));
        }
    };
    let strides = [
        Val::Ptr(Buf::Arg(3), 0),
        Val::I64((n * ld) as i64),
        Val::I64((n.div_ceil(bn) * scale_ld) as i64),
    ];
    let mut plan = Plan::default();
    match path {
        CudaFp8Path::SmallM { tokens } if [1, 2, 4, 8, 16].contains(&tokens) => {
            let xd = plan.tmp(4 * t * ld, false);
            act_launches(&mut plan, &|r0, _| ActOut::F32(at(xd, 4 * r0 * ld)));
            // M is per chunk, set by the kernel
            let launch = gemv_cta_launch(n, k, tokens);
            let mut params = gemv_params(w, xd, Val::Null, 0, launch);
            params.extend(strides);
            plan.kernel(Kernel {
                module: names::GEMV_MODULE,
                name: names::grouped_gemv(tokens, x.suffix()),
                grid: (launch.ctas as u32, e as u32, 1),
                block: launch.block as u32,
                smem: 0,
                args: vec![KArg::Struct(params)],
            });
        }
        CudaFp8Path::Mma { tile, splits: 1 } if act != ActQuant::None && bk % 128 == 0 => {
            let xq = plan.tmp(t * ld, false);
            let sx = plan.tmp(4 * scale_rows * kb, false);
            act_launches(&mut plan, &|r0, sr0| ActOut::Codes {
                xq: at(xq, r0 * ld),
                sx: at(sx, 4 * sr0 * kb),
                rs: kb,
                cs: 1,
            });
            let tiles: usize = counts.iter().map(|c| c.div_ceil(tile.rows())).sum();
            // M is per group, set by the kernel; no K split
            let mut params = gemm_params(w, (xq, sx), Val::Null, Val::Null, 0, bm, kb, 1);
            params.extend(strides);
            params.push(Val::I32(e as i32));
            plan.kernel(Kernel {
                module: names::GEMM_MODULE,
                name: names::grouped_gemm(tile, x.suffix()),
                grid: (n.div_ceil(128) as u32, tiles as u32, 1),
                block: tile_warps(tile) * 32,
                smem: tile_smem_bytes(tile),
                args: vec![KArg::Struct(params)],
            });
        }
        other => {
            return Err(unsupported(
                "grouped fp8 GEMM",
                format!("no grouped form of {other} with {act:?}"),
            ))
        }
    }
    Ok(plan)
}

/// Row offsets `[E + 1]` of the groups, as the grouped kernels read them.
pub fn row_offsets(counts: &[usize]) -> Vec<i32> {
    std::iter::once(0)
        .chain(counts.iter().scan(0usize, |r, &c| {
            *r += c;
            Some(*r as i32)
        }))
        .collect()
}

/// `out [T, n]`: row `t` of `x [T, k]` times the weight of the expert whose group it falls in
/// (`counts`, one per expert, summing to `T`), per the numerics contract, on `stream`. `w` holds
/// all experts stacked: its `layout` is one expert's, its codes and scales `counts.len()` times
/// that. The row offsets go to the device with each call (a small copy). Returns the path
/// that ran.
#[allow(clippy::too_many_arguments)]
pub fn fp8_grouped<T: Element>(
    stream: &Arc<CudaStream>,
    x: &CudaView<'_, T>,
    w: &WeightRef<'_>,
    counts: &[usize],
    act: ActQuant,
    kernel: CudaFp8Kernel,
    out: &mut CudaViewMut<'_, T>,
) -> Result<CudaFp8Path> {
    let lay = w.layout;
    let t = check_grouped(&lay, counts, act)?;
    let e = counts.len();
    let (n, k) = (lay.n, lay.k);
    if x.len() != t * k {
        return Err(invalid(
            "x",
            format!("expected [{t}, {k}] = {} elements, got {}", t * k, x.len()),
        ));
    }
    if out.len() != t * n {
        return Err(invalid(
            "out",
            format!(
                "expected [{t}, {n}] = {} elements, got {}",
                t * n,
                out.len()
            ),
        ));
    }
    let [nb, _] = lay.scale_dims();
    if w.data.len() != e * n * lay.ld || w.scales.len() != e * nb * lay.scale_ld {
        return Err(invalid(
            "weight",
            format!(
                "expected {e} experts of [{n}, {}] codes and [{nb}, {}] scales, got {} bytes \
                 and {} scales",
                lay.ld,
                lay.scale_ld,
                w.data.len(),
                w.scales.len()
            ),
        ));
    }
    let g = gpu(stream)?;
    let dtype = Dtype::of::<T>();
    let path = plan_grouped(&g.info, &lay, counts, act, kernel)?;
    let plan = plan_fp8_grouped(&lay, counts, act, path, dtype)?;
    let offsets = stream.clone_htod(&row_offsets(counts))?;
    let size = dtype.size();
    let (xp, _g1) = x.device_ptr(stream);
    let (wp, _g2) = w.data.device_ptr(stream);
    let (sp, _g3) = w.scales.device_ptr(stream);
    if wp % 16 != 0 || sp % 16 != 0 {
        return Err(invalid(
            "weight",
            "codes and scales must start on a 16-byte boundary",
        ));
    }
    let (ofp, _g4) = offsets.device_ptr(stream);
    let (op, _g5) = out.device_ptr_mut(stream);
    let args = [
        DevBuf {
            ptr: xp,
            bytes: t * k * size,
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
            ptr: ofp,
            bytes: 4 * (e + 1),
        },
        DevBuf {
            ptr: op,
            bytes: t * n * size,
        },
    ];
    launch::execute(&g, stream, &plan, &args)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ptx::Family;
    use fp8nsa_types::MmaTile;

    fn h100() -> DeviceInfo {
        DeviceInfo {
            cc: (9, 0),
            sms: 132,
            smem_optin: 227 * 1024,
            family: Family::for_capability((9, 0)).unwrap(),
        }
    }

    #[test]
    fn decode_takes_the_small_m_kernel_and_prefill_tensor_cores() {
        let w = WeightLayout::new([768, 2048], [128, 128]).unwrap();
        let mut counts = vec![0; 128];
        for e in [3, 17, 40, 41, 77, 90, 101, 127] {
            counts[e] = 1;
        }
        let p = |c: &[usize], act, k| plan_grouped(&h100(), &w, c, act, k);
        assert_eq!(
            p(&counts, ActQuant::Group, CudaFp8Kernel::Auto).unwrap(),
            CudaFp8Path::SmallM { tokens: 1 }
        );
        counts[3] = 300;
        assert_eq!(
            p(&counts, ActQuant::Group, CudaFp8Kernel::Auto).unwrap(),
            CudaFp8Path::Mma {
                tile: MmaTile::M128,
                splits: 1
            }
        );
        // W8A16 has no tensor-core form: the small-M kernel in chunks of 16 tokens
        assert_eq!(
            p(&counts, ActQuant::None, CudaFp8Kernel::Auto).unwrap(),
            CudaFp8Path::SmallM { tokens: 16 }
        );
        for k in [CudaFp8Kernel::CublasLt, CudaFp8Kernel::Dequant] {
            let e = p(&counts, ActQuant::Group, k).unwrap_err();
            assert!(e.to_string().contains("no grouped form"), "{e}");
        }
        let e = p(&counts, ActQuant::None, CudaFp8Kernel::Mma).unwrap_err();
        assert!(e.to_string().contains("None"), "{e}");
    }

    #[test]
    fn bad_routing_is_an_error() {
        let w = WeightLayout::new([64, 128], [128, 128]).unwrap();
        for (counts, want) in [
            (vec![], "none"),
            (vec![0, 0], "at least one row"),
            (vec![usize::MAX, 1], "overflow"),
            (vec![70_000 * 16, 0], "row tiles"),
            (vec![1; 70_000], "65535"),
        ] {
            let e = plan_grouped(&h100(), &w, &counts, ActQuant::Group, CudaFp8Kernel::Auto)
                .unwrap_err();
            assert!(e.to_string().contains(want), "{counts:?}: {e}");
        }
        assert_eq!(row_offsets(&[2, 0, 3]), vec![0, 2, 2, 5]);
    }
}
