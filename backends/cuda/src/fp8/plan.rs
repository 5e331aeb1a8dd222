//! Which fp8 GEMM path runs, decided from the device, the shape and the activation scheme
//! alone (pure: tested without a GPU).

use fp8nsa_types::{ActQuant, CudaFp8Kernel, CudaFp8Path, LinearShape, MmaTile};

use crate::context::DeviceInfo;
use crate::error::{unsupported, Result};

/// Warps per block of the tensor-core kernel for `tile`.
pub(crate) fn tile_warps(tile: MmaTile) -> u32 {
    match tile {
        MmaTile::M128 => 8,
        MmaTile::M64 | MmaTile::M16 => 4,
    }
}

/// Pipeline stages x (A + B tile) bytes.
pub(crate) fn tile_smem_bytes(tile: MmaTile) -> u32 {
    let stages = match tile {
        MmaTile::M128 => 3,
        MmaTile::M64 | MmaTile::M16 => 4,
    };
    stages * (tile.rows() as u32 + 128) * 128
}

/// Largest M the small-M kernel takes.
pub const SMALL_M_MAX: usize = 16;
/// Up to this M the small-M kernel is preferred even where the tensor-core kernel runs.
pub const SMALL_M_PREFERRED: usize = 4;
/// From this M on, cuBLASLt is preferred where it applies.
pub const CUBLASLT_MIN_M: usize = 64;
/// Most K splits of the tensor-core kernel.
pub const MAX_SPLITS: usize = 16;

/// Why each path does or does not apply.
pub(crate) struct Applicability {
    pub(crate) small_m: std::result::Result<(), String>,
    pub(crate) mma: std::result::Result<(), String>,
    pub(crate) cublaslt: std::result::Result<(), String>,
}

pub(crate) fn applicability(info: &DeviceInfo, s: &LinearShape, act: ActQuant) -> Applicability {
    let small_m = if s.m() > SMALL_M_MAX {
        Err(format!("M = {} > {SMALL_M_MAX}", s.m()))
    } else if !s.bk().is_multiple_of(16) {
        Err(format!("block K = {} is not a multiple of 16", s.bk()))
    } else {
        Ok(())
    };
    let mma = if info.cc < (8, 9) {
        Err(format!(
            "compute capability {}.{} has no fp8 tensor cores (needs 8.9+)",
            info.cc.0, info.cc.1
        ))
    } else if act == ActQuant::None {
        Err("activations are not quantized (ActQuant::None)".to_string())
    } else if !s.bk().is_multiple_of(128) {
        Err(format!("block K = {} is not a multiple of 128", s.bk()))
    } else {
        Ok(())
    };
    let cublaslt = if info.cc != (9, 0) {
        Err(format!(
            "block-scaled fp8 in cuBLASLt is sm_90 only, device is {}.{}",
            info.cc.0, info.cc.1
        ))
    } else if (s.bn(), s.bk()) != (128, 128) {
        Err(format!(
            "weight blocks {}x{} (cuBLASLt takes 128x128)",
            s.bn(),
            s.bk()
        ))
    } else if act != ActQuant::Group {
        Err(format!(
            "activation scheme {act:?} (cuBLASLt takes 1x128 groups)"
        ))
    } else if !s.n().is_multiple_of(16) {
        Err(format!("N = {} is not a multiple of 16", s.n()))
    } else {
        Ok(())
    };
    Applicability {
        small_m,
        mma,
        cublaslt,
    }
}

/// The K split of the tensor-core kernel: enough blocks for two waves, whole K-blocks per split.
pub(crate) fn mma_splits(info: &DeviceInfo, s: &LinearShape, tile: MmaTile) -> (usize, usize) {
    let kb = s.k().div_ceil(s.bk());
    let tiles = s.n().div_ceil(128) * s.m().div_ceil(tile.rows());
    let target = 2 * info.sms as usize;
    let want = if tiles >= target {
        1
    } else {
        target.div_ceil(tiles).min(MAX_SPLITS).min(kb)
    };
    let per = kb.div_ceil(want.max(1));
    (kb.div_ceil(per), per)
}

pub(crate) fn mma_tile(m: usize) -> MmaTile {
    if m <= 16 {
        MmaTile::M16
    } else if m <= 64 {
        MmaTile::M64
    } else {
        MmaTile::M128
    }
}

/// The path for one call. `CudaFp8Kernel::Auto` picks the best that applies; a named kernel that
/// does not apply is an error saying why.
pub fn plan(
    info: &DeviceInfo,
    s: &LinearShape,
    act: ActQuant,
    kernel: CudaFp8Kernel,
) -> Result<CudaFp8Path> {
    let a = applicability(info, s, act);
    let mma = || {
        let tile = mma_tile(s.m());
        CudaFp8Path::Mma {
            tile,
            splits: mma_splits(info, s, tile).0,
        }
    };
    let small = || CudaFp8Path::SmallM {
        tokens: s.m().next_power_of_two(),
    };
    let refuse = |what: &'static str, why: &String| -> Result<CudaFp8Path> {
        Err(unsupported(
            "fp8 linear",
            format!("{what} does not apply: {why}"),
        ))
    };
    match kernel {
        CudaFp8Kernel::Auto => Ok(
            if a.small_m.is_ok() && (s.m() <= SMALL_M_PREFERRED || a.mma.is_err()) {
                small()
            } else if a.cublaslt.is_ok() && s.m() >= CUBLASLT_MIN_M {
                CudaFp8Path::CublasLt
            } else if a.mma.is_ok() {
                mma()
            } else {
                CudaFp8Path::Dequant
            },
        ),
        CudaFp8Kernel::CublasLt => match &a.cublaslt {
            Ok(()) => Ok(CudaFp8Path::CublasLt),
            Err(why) => refuse("the cuBLASLt block-scaled GEMM", why),
        },
        CudaFp8Kernel::Mma => match &a.mma {
            Ok(()) => Ok(mma()),
            Err(why) => refuse("the fp8 tensor-core kernel", why),
        },
        CudaFp8Kernel::SmallM => match &a.small_m {
            Ok(()) => Ok(small()),
            Err(why) => refuse("the small-M kernel", why),
        },
        CudaFp8Kernel::Dequant => Ok(CudaFp8Path::Dequant),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ptx::Family;

    fn dev(cc: (i32, i32)) -> DeviceInfo {
        DeviceInfo {
            cc,
            sms: 132,
            smem_optin: 227 * 1024,
            family: Family::for_capability(cc).unwrap(),
        }
    }

    fn shape(m: usize, n: usize, k: usize, b: [usize; 2]) -> LinearShape {
        LinearShape::new(m, n, k, b[0], b[1]).unwrap()
    }

    const H100: (i32, i32) = (9, 0);

    #[test]
    fn auto_on_h100() {
        let d = dev(H100);
        let b128 = [128, 128];
        // decode: the small-M kernel
        assert_eq!(
            plan(
                &d,
                &shape(1, 7168, 2048, b128),
                ActQuant::Group,
                CudaFp8Kernel::Auto
            )
            .unwrap(),
            CudaFp8Path::SmallM { tokens: 1 }
        );
        // a decode batch: tensor cores, split over K to fill the GPU
        let p = plan(
            &d,
            &shape(16, 2112, 7168, b128),
            ActQuant::Group,
            CudaFp8Kernel::Auto,
        )
        .unwrap();
        match p {
            CudaFp8Path::Mma {
                tile: MmaTile::M16,
                splits,
            } => assert!(splits > 1, "{p}"),
            other => panic!("{other}"),
        }
        // prefill: cuBLASLt for 128x128 blocks and 1x128 groups
        assert_eq!(
            plan(
                &d,
                &shape(4096, 2112, 7168, b128),
                ActQuant::Group,
                CudaFp8Kernel::Auto
            )
            .unwrap(),
            CudaFp8Path::CublasLt
        );
        // other block shapes and Block2d: our kernel
        for (b, act) in [
            ([256, 256], ActQuant::Group),
            ([64, 128], ActQuant::Group),
            ([128, 128], ActQuant::Block2d { bm: 128 }),
        ] {
            assert_eq!(
                plan(&d, &shape(4096, 7168, 2048, b), act, CudaFp8Kernel::Auto).unwrap(),
                CudaFp8Path::Mma {
                    tile: MmaTile::M128,
                    splits: 1
                }
            );
        }
        // W8A16 beyond the small-M range: dequantize
        assert_eq!(
            plan(
                &d,
                &shape(512, 576, 3884, b128),
                ActQuant::None,
                CudaFp8Kernel::Auto
            )
            .unwrap(),
            CudaFp8Path::Dequant
        );
        assert_eq!(
            plan(
                &d,
                &shape(7, 576, 3884, b128),
                ActQuant::None,
                CudaFp8Kernel::Auto
            )
            .unwrap(),
            CudaFp8Path::SmallM { tokens: 8 }
        );
    }

    #[test]
    fn ampere_and_ada() {
        let a100 = dev((8, 0));
        let s = shape(512, 576, 3884, [128, 128]);
        assert_eq!(
            plan(&a100, &s, ActQuant::Group, CudaFp8Kernel::Auto).unwrap(),
            CudaFp8Path::Dequant
        );
        assert_eq!(
            plan(
                &a100,
                &shape(16, 576, 3884, [128, 128]),
                ActQuant::Group,
                CudaFp8Kernel::Auto
            )
            .unwrap(),
            CudaFp8Path::SmallM { tokens: 16 }
        );
        let err = plan(&a100, &s, ActQuant::Group, CudaFp8Kernel::Mma).unwrap_err();
        assert!(err.to_string().contains("8.0"), "{err}");
        let l40 = dev((8, 9));
        assert!(matches!(
            plan(&l40, &s, ActQuant::Group, CudaFp8Kernel::Auto).unwrap(),
            CudaFp8Path::Mma { .. }
        ));
        let err = plan(&l40, &s, ActQuant::Group, CudaFp8Kernel::CublasLt).unwrap_err();
        assert!(err.to_string().contains("sm_90"), "{err}");
    }

    #[test]
    fn forced_kernels_say_why_they_do_not_apply() {
        let d = dev(H100);
        let cases = [
            (
                shape(64, 576, 3884, [256, 256]),
                ActQuant::Group,
                CudaFp8Kernel::CublasLt,
                "256x256",
            ),
            (
                shape(64, 576, 3884, [128, 128]),
                ActQuant::Block2d { bm: 64 },
                CudaFp8Kernel::CublasLt,
                "Block2d",
            ),
            (
                shape(64, 584, 3884, [128, 128]),
                ActQuant::Group,
                CudaFp8Kernel::CublasLt,
                "multiple of 16",
            ),
            (
                shape(64, 576, 3884, [128, 96]),
                ActQuant::Group,
                CudaFp8Kernel::Mma,
                "multiple of 128",
            ),
            (
                shape(64, 576, 3884, [128, 128]),
                ActQuant::None,
                CudaFp8Kernel::Mma,
                "None",
            ),
            (
                shape(17, 576, 3884, [128, 128]),
                ActQuant::Group,
                CudaFp8Kernel::SmallM,
                "M = 17",
            ),
            (
                shape(8, 576, 3884, [128, 100]),
                ActQuant::Group,
                CudaFp8Kernel::SmallM,
                "multiple of 16",
            ),
        ];
        for (s, act, k, want) in cases {
            let err = plan(&d, &s, act, k).unwrap_err().to_string();
            assert!(err.contains(want), "{s:?} {act:?} {k:?}: {err}");
        }
        // the last resort always applies
        assert_eq!(
            plan(
                &d,
                &shape(3, 5, 7, [1, 1]),
                ActQuant::Group,
                CudaFp8Kernel::Dequant
            )
            .unwrap(),
            CudaFp8Path::Dequant
        );
    }

    #[test]
    fn splits_cover_k_in_whole_blocks() {
        let d = dev(H100);
        for (m, n, k, bk) in [
            (16, 2112, 7168, 128),
            (16, 24576, 1536, 128),
            (64, 576, 3884, 512),
            (1, 128, 128, 128),
            (4096, 7168, 16384, 128),
        ] {
            let s = shape(m, n, k, [128, bk]);
            for tile in [MmaTile::M16, MmaTile::M64, MmaTile::M128] {
                let (splits, per) = mma_splits(&d, &s, tile);
                let kb = k.div_ceil(bk);
                assert!((1..=MAX_SPLITS).contains(&splits), "{s:?}");
                assert!(
                    splits * per >= kb && (splits - 1) * per < kb,
                    "{s:?}: {splits} x {per} vs {kb}"
                );
            }
        }
        // large problems are not split
        assert_eq!(
            mma_splits(&d, &shape(4096, 7168, 16384, [128, 128]), MmaTile::M128).0,
            1
        );
    }

    #[test]
    fn tiles_fit_shared_memory() {
        // sm_89 allows 99 KB per block
        for t in [MmaTile::M128, MmaTile::M64, MmaTile::M16] {
            assert!(
                tile_smem_bytes(t) <= 99 * 1024,
                "{t:?}: {}",
                tile_smem_bytes(t)
            );
        }
    }
}
