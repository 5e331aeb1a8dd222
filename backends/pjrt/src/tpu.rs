//! Exported TPU kernels (Pallas v1/v2/v3, written by `fp8nsa export-tpu`): the manifest, and
//! which program serves a call. Programs are exported per token-count bucket; a call pads its
//! rows up to the smallest bucket that holds them.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{invalid, Error, Result};
use fp8nsa_types::{ActQuant, TpuKernel};

/// One exported program.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct TpuEntry {
    pub variant: String,
    pub m_bucket: usize,
    pub n: usize,
    pub k: usize,
    pub block: usize,
    pub act: String,
    pub bm: Option<usize>,
    pub dtype: String,
    /// The StableHLO module (the Mosaic kernel inside as a `tpu_custom_call`), relative to the
    /// manifest's folder.
    pub stablehlo: String,
    /// The kernel's Mosaic MLIR as text, for `fp8nsa inspect`.
    pub mlir: String,
}

/// `manifest.json` of an export folder.
#[derive(Clone, Debug, Deserialize)]
pub struct TpuManifest {
    pub entries: Vec<TpuEntry>,
    #[serde(skip)]
    pub dir: PathBuf,
}

impl TpuManifest {
    /// Reads `dir/manifest.json`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("manifest.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| invalid("manifest", format!("{}: {e}", path.display())))?;
        let mut m: TpuManifest = serde_json::from_str(&text)
            .map_err(|e| invalid("manifest", format!("{}: {e}", path.display())))?;
        m.dir = dir.to_path_buf();
        Ok(m)
    }

    /// The f32-activation program of `variant` for a `[m, k] x [n, k]` call in `block`-square
    /// blocks with `act`, from the smallest bucket that holds `m` rows.
    pub fn select(
        &self,
        variant: TpuKernel,
        m: usize,
        n: usize,
        k: usize,
        block: [usize; 2],
        act: ActQuant,
    ) -> Result<&TpuEntry> {
        let (act_name, bm) = match act {
            ActQuant::Group => ("group", None),
            ActQuant::Block2d { bm } => ("block2d", Some(bm)),
            ActQuant::None => {
                return Err(invalid(
                    "act",
                    "the TPU kernels quantize activations (Group or Block2d)",
                ))
            }
        };
        let name = variant.name();
        self.entries
            .iter()
            .filter(|e| {
                e.variant == name
                    && (e.n, e.k) == (n, k)
                    && [e.block, e.block] == block
                    && e.act == act_name
                    && e.bm == bm
                    && e.dtype == "f32"
                    && e.m_bucket >= m
            })
            .min_by_key(|e| e.m_bucket)
            .ok_or_else(|| Error::Invalid {
                arg: "tpu program",
                msg: format!(
                    "no exported {name} program for m <= bucket, n = {n}, k = {k}, block {block:?}, {act:?}, f32 in {} (run fp8nsa export-tpu for this shape)",
                    self.dir.display()
                ),
            })
    }

    pub fn stablehlo_path(&self, e: &TpuEntry) -> PathBuf {
        self.dir.join(&e.stablehlo)
    }
}

/// `x [m, k]` zero-padded to `[bucket, k]` (zero rows quantize to zeros and are sliced off).
pub fn pad_rows(x: &[f32], m: usize, k: usize, bucket: usize) -> Vec<f32> {
    let mut out = vec![0f32; bucket * k];
    out[..m * k].copy_from_slice(&x[..m * k]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest() -> TpuManifest {
        let json = r#"{"entries": [
            {"variant": "v2", "m_bucket": 16, "n": 576, "k": 3884, "block": 128, "act": "group", "bm": null, "dtype": "f32", "file": "a.bin", "mlir": "a.mlir", "stablehlo": "a.stablehlo"},
            {"variant": "v2", "m_bucket": 128, "n": 576, "k": 3884, "block": 128, "act": "group", "bm": null, "dtype": "f32", "file": "b.bin", "mlir": "b.mlir", "stablehlo": "b.stablehlo"},
            {"variant": "v3", "m_bucket": 128, "n": 576, "k": 3884, "block": 128, "act": "block2d", "bm": 16, "dtype": "f32", "file": "c.bin", "mlir": "c.mlir", "stablehlo": "c.stablehlo"},
            {"variant": "v2", "m_bucket": 1, "n": 576, "k": 3884, "block": 128, "act": "group", "bm": null, "dtype": "bf16", "file": "d.bin", "mlir": "d.mlir", "stablehlo": "d.stablehlo"}
        ]}"#;
        let mut m: TpuManifest = serde_json::from_str(json).unwrap();
        m.dir = PathBuf::from("/exports");
        m
    }

    #[test]
    fn picks_the_smallest_bucket_that_holds_the_rows() {
        let m = manifest();
        let pick = |rows| {
            m.select(TpuKernel::V2, rows, 576, 3884, [128, 128], ActQuant::Group)
                .map(|e| e.m_bucket)
        };
        assert_eq!(pick(1).unwrap(), 16); // the bf16 bucket of 1 does not serve f32 calls
        assert_eq!(pick(16).unwrap(), 16);
        assert_eq!(pick(17).unwrap(), 128);
        let e = pick(129).unwrap_err().to_string();
        assert!(e.contains("export-tpu") && e.contains("576"), "{e}");
        let b2 = ActQuant::Block2d { bm: 16 };
        assert_eq!(
            m.select(TpuKernel::V3, 100, 576, 3884, [128, 128], b2)
                .unwrap()
                .stablehlo,
            "c.stablehlo"
        );
        assert!(m
            .select(
                TpuKernel::V3,
                100,
                576,
                3884,
                [128, 128],
                ActQuant::Block2d { bm: 8 }
            )
            .is_err());
        assert!(m
            .select(TpuKernel::V1, 1, 576, 3884, [128, 128], ActQuant::Group)
            .is_err());
        assert!(m
            .select(TpuKernel::V2, 1, 576, 3884, [128, 128], ActQuant::None)
            .is_err());
        assert_eq!(
            m.stablehlo_path(
                m.select(TpuKernel::V2, 2, 576, 3884, [128, 128], ActQuant::Group)
                    .unwrap()
            ),
            PathBuf::from("/exports/a.stablehlo")
        );
    }

    #[test]
    fn padding_keeps_the_rows_and_adds_zeros() {
        assert_eq!(
            pad_rows(&[1.0, 2.0, 3.0, 4.0], 2, 2, 3),
            vec![1.0, 2.0, 3.0, 4.0, 0.0, 0.0]
        );
    }

    #[test]
    fn a_bad_manifest_is_an_error() {
        let dir = std::env::temp_dir().join(format!("fp8nsa-manifest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(TpuManifest::load(&dir).is_err());
        std::fs::write(dir.join("manifest.json"), "{not json").unwrap();
        assert!(TpuManifest::load(&dir)
            .unwrap_err()
            .to_string()
            .contains("manifest.json"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
