//! Launch plan of the selection kernel (pure: tested without a GPU).

use crate::context::DeviceInfo;
use crate::error::{unsupported, Result};

/// Keys per K/V tile (`KT` in nsa_selection.cu).
pub const KEYS_PER_TILE: usize = 32;
/// Selection entries per (token, kv head) row the kernel normalizes (`MAX_PER_ROW`).
pub const MAX_PER_ROW: usize = 2048;
/// Query heads per kv head the kernel takes (16 per warp, up to 4 warps).
pub const MAX_GROUP: usize = 64;
/// An upper bound of the kernel's static shared memory (its per-tile key rows, the merge's
/// lane sums, two counters: 648 bytes), which counts against the same per-block budget as the
/// dynamic part.
pub const STATIC_SMEM: usize = 1024;
/// Most splits of a row's tiles (decode).
pub const MAX_SPLITS: usize = 32;
/// Head dims with a kernel: D and Dv.
pub const HEAD_DIMS: [usize; 3] = [64, 128, 192];
pub const VALUE_DIMS: [usize; 2] = [64, 128];

/// How one call launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NsaPlan {
    /// Warps per block: ceil(G / 16) rounded up to 1, 2 or 4.
    pub warps: usize,
    /// Blocks per (token, kv head): 1, or more for decode (merged by log-sum-exp).
    pub splits: usize,
    /// Dynamic shared memory per block.
    pub smem: u32,
}

/// The kernel's dynamic shared memory: the row's spans and their packed key counts (entries
/// per row rounded up to a power of two, at least 32: `span_cap`), then two K/V tile stages.
pub fn smem_bytes(d: usize, dv: usize, per_row: usize) -> u32 {
    let cap = per_row.clamp(32, MAX_PER_ROW).next_power_of_two();
    (2 * KEYS_PER_TILE * (d + dv) * 2 + cap * (8 + 4)) as u32
}

/// Why the kernel does not take these dims, if it does not.
pub fn supports(
    d: usize,
    dv: usize,
    group: usize,
    per_row: usize,
) -> std::result::Result<(), String> {
    if !HEAD_DIMS.contains(&d) {
        return Err(format!("head dim D = {d} (kernels: {HEAD_DIMS:?})"));
    }
    if !VALUE_DIMS.contains(&dv) {
        return Err(format!("value dim Dv = {dv} (kernels: {VALUE_DIMS:?})"));
    }
    if group == 0 || group > MAX_GROUP {
        return Err(format!(
            "{group} query heads per kv head (kernels: 1..={MAX_GROUP})"
        ));
    }
    if per_row > MAX_PER_ROW {
        return Err(format!(
            "{per_row} selection entries per row (kernel: up to {MAX_PER_ROW})"
        ));
    }
    Ok(())
}

/// Plan for `rows = tokens x kv heads` work items of at most `max_tiles` key tiles each.
/// Splits only when the rows alone leave the GPU short of blocks (decode, small batches).
pub fn plan(
    info: &DeviceInfo,
    d: usize,
    dv: usize,
    group: usize,
    per_row: usize,
    rows: usize,
    max_tiles: usize,
) -> Result<NsaPlan> {
    supports(d, dv, group, per_row).map_err(|why| unsupported("nsa selection", why))?;
    let smem = smem_bytes(d, dv, per_row);
    if smem as usize + STATIC_SMEM > info.smem_optin as usize {
        return Err(unsupported(
            "nsa selection",
            format!(
                "{smem} bytes of shared memory for {per_row} entries per row; the device allows {}",
                info.smem_optin
            ),
        ));
    }
    let want_blocks = 8 * info.sms as usize;
    let splits = if rows >= want_blocks / 2 {
        1
    } else {
        want_blocks
            .div_ceil(rows.max(1))
            .min(MAX_SPLITS)
            .min(max_tiles.max(1))
    };
    Ok(NsaPlan {
        // kernels exist for 1, 2 and 4 warps; rows past G are computed and not written
        warps: match group.div_ceil(16) {
            1 => 1,
            2 => 2,
            _ => 4,
        },
        splits,
        smem,
    })
}

/// Upper bound of key tiles in one row: the selection clamped to `max_tk` keys, packed end to
/// end into tiles.
pub fn max_tiles(per_row: usize, block_size: Option<usize>, max_tk: usize) -> usize {
    let keys = match block_size {
        Some(bs) => per_row.saturating_mul(bs).min(max_tk),
        None => max_tk,
    };
    keys.div_ceil(KEYS_PER_TILE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ptx::Family;

    fn h100() -> DeviceInfo {
        DeviceInfo {
            cc: (9, 0),
            sms: 132,
            smem_optin: 227 * 1024,
            family: Family::Sm89,
        }
    }

    #[test]
    fn paper_config() {
        // Hq = 64, Hkv = 4 -> G = 16: one warp; prefill at 64k: no split
        let p = plan(
            &h100(),
            128,
            128,
            16,
            16,
            65536 * 4,
            max_tiles(16, Some(64), 65536),
        )
        .unwrap();
        assert_eq!((p.warps, p.splits), (1, 1));
        // decode, B = 16: 64 rows, split to fill the GPU but not past the row's tiles
        let p = plan(
            &h100(),
            128,
            128,
            16,
            16,
            64,
            max_tiles(16, Some(64), 65536),
        )
        .unwrap();
        assert!(p.splits > 1 && p.splits <= MAX_SPLITS, "{p:?}");
        let p = plan(&h100(), 128, 128, 16, 1, 1, max_tiles(1, Some(32), 32)).unwrap();
        assert_eq!(p.splits, 1, "{p:?}");
        // DSA decode: 2048 single tokens of 64k pack into 64 tiles, the splits' ceiling
        assert_eq!(max_tiles(2048, Some(1), 65536), 64);
        // a device that cannot opt in to the spans' memory is refused, not launched
        let small = DeviceInfo {
            smem_optin: 48 * 1024,
            ..h100()
        };
        let e = plan(&small, 192, 128, 16, 2048, 1, 64).unwrap_err();
        assert!(e.to_string().contains("shared memory"), "{e}");
        // exactly 48 KB of dynamic memory plus the static part is past the default: refused
        // on a device that cannot opt in, taken (the launcher opts in) on one that can
        assert_eq!(smem_bytes(64, 128, 2048), 48 * 1024);
        assert!(plan(&small, 64, 128, 16, 2048, 1, 64).is_err());
        assert!(plan(&h100(), 64, 128, 16, 2048, 1, 64).is_ok());
    }

    #[test]
    fn shared_memory_fits_every_family() {
        for d in HEAD_DIMS {
            for dv in VALUE_DIMS {
                // within the smallest opt-in of the sm_80+ families (99 KB: sm_86, sm_89,
                // sm_120); the NSA paper's 16 blocks stay under the 48 KB default
                let b = smem_bytes(d, dv, MAX_PER_ROW);
                assert!(b <= 99 * 1024, "d={d} dv={dv}: {b}");
                assert!(smem_bytes(d, dv, 16) <= 48 * 1024, "d={d} dv={dv}");
            }
        }
    }

    #[test]
    fn span_memory_follows_the_selection() {
        // 16 entries per row: 32 slots; the paper's config fits 7 blocks in an H100's 228 KB
        assert_eq!(smem_bytes(128, 128, 16), 32768 + 32 * 12);
        assert_eq!(smem_bytes(128, 128, 33), 32768 + 64 * 12);
        assert_eq!(
            smem_bytes(128, 128, 5000),
            smem_bytes(128, 128, MAX_PER_ROW)
        );
    }

    #[test]
    fn refusals_name_the_reason() {
        let d = h100();
        for (dd, dv, g, per_row, want) in [
            (96, 128, 16, 16, "D = 96"),
            (128, 192, 16, 16, "Dv = 192"),
            (128, 128, 80, 16, "80 query heads"),
            (128, 128, 16, 3000, "3000 selection entries"),
        ] {
            let err = plan(&d, dd, dv, g, per_row, 100, 10)
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "{err}");
        }
        assert_eq!(plan(&d, 64, 64, 33, 4, 10, 10).unwrap().warps, 4);
        assert_eq!(plan(&d, 64, 64, 17, 4, 10, 10).unwrap().warps, 2);
    }
}
