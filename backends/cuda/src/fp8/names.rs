//! Kernel names, one function per kernel template (the plans and the PTX test share them).

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

pub(crate) fn grouped_gemm(tile: MmaTile, suffix: &str) -> String {
    format!("fp8nsa_fp8_grouped_gemm_{}_{suffix}", tile.name())
}

pub(crate) fn grouped_gemv(tokens: usize, suffix: &str) -> String {
    format!("fp8nsa_fp8_grouped_gemv_m{tokens}_{suffix}")
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
