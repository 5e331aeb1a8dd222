use std::ops::Range;

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use super::shard::{check_on_blocks, Shard, Split};
use crate::error::{invalid, shape_err, Error, Result};
use fp8nsa_types::ScaleDType;

/// A weight `W [N, K]` (out x in, the Hugging Face layout) stored as fp8 e4m3fn bytes with one
/// f32 dequantization scale per `bn x bk` block: `W_real[n, k] ≈ W[n, k] · scales[n/bn, k/bk]`.
/// Edge blocks are partial; storage is never padded.
///
/// The bytes are kept as a `U8` tensor: they are opaque on every device, which avoids Candle's
/// fp8 conversions (numeric, not bit-level, and unavailable on CUDA).
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use fp8nsa_ops::Fp8BlockWeight;
///
/// let w = Tensor::randn(0f32, 0.02, (576, 3884), &Device::Cpu)?;
/// let q = Fp8BlockWeight::quantize(&w, [128, 128])?;
/// assert_eq!(q.scales().dims(), &[5, 31]); // ceil(576/128) x ceil(3884/128)
/// let back = q.dequantize(DType::F32)?;
/// let err = (back - &w)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(err < 0.02 * 6.0 / 16.0); // half an fp8 ulp of the largest entries
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct Fp8BlockWeight {
    data: Tensor,
    scales: Tensor,
    block: [usize; 2],
    /// Whether no code is NaN (`0x7f` / `0xff`), found by one scan of the codes the first time a
    /// CPU kernel asks: the weights never change, and a NaN-free weight lets the decode GEMV
    /// skip its per-code NaN check.
    nan_free: std::sync::OnceLock<bool>,
}

fn check_block(block: [usize; 2]) -> Result<()> {
    if block[0] == 0 || block[1] == 0 {
        return Err(invalid(
            "block",
            format!("both sides must be at least 1, got {block:?}"),
        ));
    }
    Ok(())
}

/// The raw bytes of a U8 or F8E4M3 tensor, on the host.
pub(crate) fn host_bytes(arg: &'static str, t: &Tensor) -> Result<Vec<u8>> {
    let t = t.to_device(&Device::Cpu)?.flatten_all()?;
    match t.dtype() {
        DType::U8 => Ok(t.to_vec1::<u8>()?),
        DType::F8E4M3 => Ok(t
            .to_vec1::<float8::F8E4M3>()?
            .into_iter()
            .map(|x| x.to_bits())
            .collect()),
        got => Err(Error::DType {
            arg,
            expected: "u8 or f8e4m3",
            got,
        }),
    }
}

impl Fp8BlockWeight {
    /// Quantizes a real `[N, K]` weight (f32, bf16, f16 or f64) in `[bn, bk]` blocks:
    /// `scale = max(amax(block), 1e-12) / 448`, codes `sat(rne(w / scale))`.
    pub fn quantize(w: &Tensor, block: [usize; 2]) -> Result<Self> {
        Self::quantize_as(w, block, ScaleDType::F32)
    }

    /// [`Self::quantize`] with scales a checkpoint can store in `scale_dtype` exactly: each
    /// block's scale is rounded up to that dtype before its codes are computed (Qwen3-FP8
    /// checkpoints keep bf16 scales). The scales tensor stays f32.
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use fp8nsa_ops::{Fp8BlockWeight, ScaleDType};
    ///
    /// let w = Tensor::new(&[[0.3f32, -1.7], [2.9, 0.01]], &Device::Cpu)?;
    /// let q = Fp8BlockWeight::quantize_as(&w, [1, 2], ScaleDType::Bf16)?;
    /// for s in q.scales().flatten_all()?.to_vec1::<f32>()? {
    ///     assert_eq!(s.to_bits() & 0xffff, 0); // a bf16 value
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn quantize_as(w: &Tensor, block: [usize; 2], scale_dtype: ScaleDType) -> Result<Self> {
        check_block(block)?;
        let (n, k) = match *w.dims() {
            [n, k] if n > 0 && k > 0 => (n, k),
            _ => return Err(shape_err("w", "[N, K] with N, K >= 1", w.dims())),
        };
        if !w.dtype().is_float() || w.dtype() == DType::F8E4M3 {
            return Err(Error::DType {
                arg: "w",
                expected: "f32, bf16, f16 or f64",
                got: w.dtype(),
            });
        }
        let host = w
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        // a non-finite weight has no fp8 code (an Inf block would dequantize to NaN): the
        // checkpoint is corrupt, and saying where beats writing a scale of Inf
        if let Some(i) = host.iter().position(|v| !v.is_finite()) {
            let (r, c) = (i / k, i % k);
            return Err(invalid(
                "w",
                format!(
                    "element [{r}, {c}] is {}: fp8 weights must be finite (block [{}, {}] of {block:?})",
                    host[i],
                    r / block[0],
                    c / block[1]
                ),
            ));
        }
        let (codes, scales) =
            fp8nsa_cpu::quant::quantize_weight_as(&host, n, k, block[0], block[1], scale_dtype)?;
        let dev = w.device();
        let data = Tensor::from_vec(codes, (n, k), dev)?;
        crate::storage::advise_huge_pages(&data);
        Ok(Self {
            nan_free: std::sync::OnceLock::new(),
            data,
            scales: Tensor::from_vec(scales, (n.div_ceil(block[0]), k.div_ceil(block[1])), dev)?,
            block,
        })
    }

    /// Builds a weight from its parts: `data` F8E4M3 or U8 `[N, K]`, `scales` F32
    /// `[ceil(N/bn), ceil(K/bk)]`, on the same device.
    pub fn from_parts(data: Tensor, scales: Tensor, block: [usize; 2]) -> Result<Self> {
        check_block(block)?;
        let (n, k) = match *data.dims() {
            [n, k] if n > 0 && k > 0 => (n, k),
            _ => return Err(shape_err("data", "[N, K] with N, K >= 1", data.dims())),
        };
        let expected = [n.div_ceil(block[0]), k.div_ceil(block[1])];
        if scales.dims() != expected {
            return Err(shape_err(
                "scales",
                format!(
                    "{expected:?} (ceil({n}/{}), ceil({k}/{}))",
                    block[0], block[1]
                ),
                scales.dims(),
            ));
        }
        if scales.dtype() != DType::F32 {
            return Err(Error::DType {
                arg: "scales",
                expected: "f32",
                got: scales.dtype(),
            });
        }
        if !data.device().same_device(scales.device()) {
            return Err(invalid(
                "scales",
                format!(
                    "must be on the device of data ({:?}), got {:?}",
                    data.device(),
                    scales.device()
                ),
            ));
        }
        // a NaN, negative or infinite scale dequantizes a whole block to garbage; the scales are
        // small (one per block), so they are checked on the host wherever they live
        let host_scales = scales
            .to_device(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        if let Some(i) = host_scales
            .iter()
            .position(|s| !(s.is_finite() && *s >= 0.0))
        {
            let kb = expected[1];
            return Err(invalid(
                "scales",
                format!(
                    "block [{}, {}] is {}: scales must be finite and >= 0",
                    i / kb,
                    i % kb,
                    host_scales[i]
                ),
            ));
        }
        let data = match data.dtype() {
            DType::U8 => data.contiguous()?,
            DType::F8E4M3 => Tensor::from_vec(host_bytes("data", &data)?, (n, k), data.device())?,
            got => {
                return Err(Error::DType {
                    arg: "data",
                    expected: "u8 or f8e4m3",
                    got,
                })
            }
        };
        // every decode step streams the codes once: on huge pages where the kernel allows
        crate::storage::advise_huge_pages(&data);
        Ok(Self {
            nan_free: std::sync::OnceLock::new(),
            data,
            scales: scales.contiguous()?,
            block,
        })
    }

    /// Loads `weight` (F8_E4M3) and `weight_scale_inv` (the dequantization multiplier, f32 or
    /// bf16) from a `VarBuilder` prefix, as in DeepSeek-V3 / Qwen3-FP8 checkpoints.
    ///
    /// A `VarBuilder` converts whatever dtype the file stores into the one asked for, by value,
    /// and does not say what it found. So that a weight stored as anything but F8_E4M3 (U8
    /// codes, f32, integers) is not silently read as numbers, the values are also read as f32
    /// and must all be e4m3 values; otherwise this is an `Error::Invalid` for `weight`. Codes
    /// stored as U8 load with [`Self::load_safetensors`], which reads the stored dtype.
    /// (Limit: a non-F8_E4M3 tensor whose every value happens to be an e4m3 value loads as
    /// those values.) The scales' stored dtype is hidden the same way and cannot be told from
    /// their values (power-of-two scales are often integers), so scales stored as integers
    /// (U8, I64) load here by value; [`Self::load_safetensors`] and `Model::load_hf` read the
    /// stored dtype and refuse them.
    ///
    /// ```no_run
    /// # use candle_core::{DType, Device};
    /// # use candle_nn::VarBuilder;
    /// # let bytes: Vec<u8> = vec![];
    /// let vb = VarBuilder::from_buffered_safetensors(bytes, DType::BF16, &Device::Cpu)?;
    /// let w = fp8nsa_ops::Fp8BlockWeight::load(vb.pp("model.layers.0.mlp.up_proj"), [128, 128])?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn load(vb: candle_nn::VarBuilder, block: [usize; 2]) -> Result<Self> {
        let data = vb.get_unchecked_dtype("weight", DType::F8E4M3)?;
        let values = vb.get_unchecked_dtype("weight", DType::F32)?;
        if let [n, _] = *data.dims() {
            // a band of rows at a time keeps the host copies small for large weights
            const BAND: usize = 256;
            for r0 in (0..n).step_by(BAND) {
                let rows = BAND.min(n - r0);
                let band = |t: &Tensor| -> Result<Vec<f32>> {
                    Ok(t.narrow(0, r0, rows)?
                        .to_device(&Device::Cpu)?
                        .to_dtype(DType::F32)?
                        .flatten_all()?
                        .to_vec1::<f32>()?)
                };
                let (got, as_e4m3) = (band(&values)?, band(&data)?);
                let k = got.len() / rows;
                let same = |(a, b): (&f32, &f32)| a == b || (a.is_nan() && b.is_nan());
                if let Some(i) = got.iter().zip(&as_e4m3).position(|p| !same(p)) {
                    return Err(invalid(
                        "weight",
                        format!(
                            "{}.weight is not stored as F8_E4M3: element [{}, {}] is {}, not an \
                             e4m3 value; codes stored as U8 load with \
                             Fp8BlockWeight::load_safetensors",
                            vb.prefix(),
                            r0 + i / k,
                            i % k,
                            got[i]
                        ),
                    ));
                }
            }
        }
        let scales = vb
            .get_unchecked_dtype("weight_scale_inv", DType::F32)?
            .to_dtype(DType::F32)?;
        Self::from_parts(data, scales, block)
    }

    /// Loads `{prefix}.weight` and `{prefix}.weight_scale_inv` from safetensors files by their
    /// stored dtypes: the weight's codes as stored when F8_E4M3 or U8 (never converted by
    /// value), anything else refused; the scales from f32, bf16, f16 or f64. Moved to `device`.
    ///
    /// ```no_run
    /// use candle_core::{safetensors::MmapedSafetensors, Device};
    /// // SAFETY: the file is not modified while mapped.
    /// let st = unsafe { MmapedSafetensors::new("model.safetensors")? };
    /// let w = fp8nsa_ops::Fp8BlockWeight::load_safetensors(
    ///     &st, "model.layers.0.mlp.up_proj", [128, 128], &Device::Cpu)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn load_safetensors(
        st: &candle_core::safetensors::MmapedSafetensors,
        prefix: &str,
        block: [usize; 2],
        device: &Device,
    ) -> Result<Self> {
        // the whole weight is the one shard of a group of one
        let whole = Shard {
            rank: 0,
            world_size: 1,
        };
        Self::load_shard(st, prefix, block, Split::Column, whole, device)
    }

    /// The real weight `[N, K]` in `dtype`, on the weight's device.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        let [n, k] = self.shape();
        let [bn, bk] = self.block;
        let bytes = host_bytes("data", &self.data)?;
        let scales = self
            .scales
            .to_device(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let kbs = k.div_ceil(bk);
        let mut out = vec![0f32; n * k];
        out.par_chunks_mut(k)
            .zip(bytes.par_chunks(k))
            .enumerate()
            .for_each(|(r, (row, codes))| {
                for kb in 0..kbs {
                    let (k0, k1) = (kb * bk, (kb * bk + bk).min(k));
                    let s = scales[(r / bn) * kbs + kb];
                    fp8nsa_cpu::fp8::decode_scaled(&codes[k0..k1], s, &mut row[k0..k1]);
                }
            });
        Ok(Tensor::from_vec(out, (n, k), self.data.device())?.to_dtype(dtype)?)
    }

    /// Whether `codes` (this weight's codes, on the host) hold no NaN code; scanned once.
    pub(crate) fn nan_free(&self, codes: &[u8]) -> bool {
        *self
            .nan_free
            .get_or_init(|| !codes.iter().any(|&c| c & 0x7f == 0x7f))
    }

    /// The e4m3fn bytes as a U8 `[N, K]` tensor.
    pub fn data(&self) -> &Tensor {
        &self.data
    }

    /// The f32 dequantization scales `[ceil(N/bn), ceil(K/bk)]`.
    pub fn scales(&self) -> &Tensor {
        &self.scales
    }

    /// `[bn, bk]`.
    pub fn block(&self) -> [usize; 2] {
        self.block
    }

    /// `[N, K]`.
    pub fn shape(&self) -> [usize; 2] {
        let d = self.data.dims();
        [d[0], d[1]]
    }

    pub fn device(&self) -> &Device {
        self.data.device()
    }
}

/// Loading one rank's slice of a checkpoint's weight.
impl Fp8BlockWeight {
    /// This rank's slice of `{prefix}.weight` (F8_E4M3 or U8 codes) and the matching rows or
    /// columns of `{prefix}.weight_scale_inv`, read from safetensors without touching the
    /// other ranks' bytes (the file is memory-mapped; only this slice is copied). The result is
    /// an ordinary weight `[N_r, K]` (column split) or `[N, K_r]` (row split) on `device`.
    pub fn load_shard(
        st: &MmapedSafetensors,
        prefix: &str,
        block: [usize; 2],
        split: Split,
        shard: Shard,
        device: &Device,
    ) -> Result<Self> {
        Self::load_slice(st, prefix, block, split, Slice::Shard(shard), device)
    }

    /// Rows (`Split::Column`) or columns (`Split::Row`) `range` of `{prefix}.weight` and the
    /// matching scales, as [`Self::load_shard`] reads them: for splits that are not an even
    /// deal of blocks, such as a rank's attention heads ([`Shard::heads`]). The range must
    /// fall on blocks.
    pub fn load_range(
        st: &MmapedSafetensors,
        prefix: &str,
        block: [usize; 2],
        split: Split,
        range: Range<usize>,
        device: &Device,
    ) -> Result<Self> {
        Self::load_slice(st, prefix, block, split, Slice::Range(range), device)
    }

    fn load_slice(
        st: &MmapedSafetensors,
        prefix: &str,
        block: [usize; 2],
        split: Split,
        slice: Slice,
        device: &Device,
    ) -> Result<Self> {
        use safetensors::Dtype;
        let name = format!("{prefix}.weight");
        let view = st.get(&name)?;
        if !matches!(view.dtype(), Dtype::F8_E4M3 | Dtype::U8) {
            return Err(invalid(
                "weight",
                format!(
                    "{name} is stored as {:?}; fp8 weights are F8_E4M3 (or U8 codes)",
                    view.dtype()
                ),
            ));
        }
        let (n, k) = match *view.shape() {
            [n, k] => (n, k),
            _ => {
                return Err(invalid(
                    "weight",
                    format!("{name} is not 2-D: {:?}", view.shape()),
                ))
            }
        };
        let bytes = view.data();
        if block[0] == 0 || block[1] == 0 {
            return Err(invalid("block", format!("{block:?} has a zero side")));
        }
        let (rows, cols) = match split {
            Split::Column => (slice.resolve(n, block[0])?, 0..k),
            Split::Row => (0..n, slice.resolve(k, block[1])?),
        };
        let mut codes = Vec::with_capacity(rows.len() * cols.len());
        for r in rows.clone() {
            codes.extend_from_slice(&bytes[r * k + cols.start..r * k + cols.end]);
        }
        let scale_name = format!("{prefix}.weight_scale_inv");
        let scales = st.load(&scale_name, &Device::Cpu)?;
        if !scales.dtype().is_float() || scales.dtype() == DType::F8E4M3 {
            return Err(invalid(
                "scales",
                format!("{scale_name} is stored as {:?}", scales.dtype()),
            ));
        }
        let scales = scales.to_dtype(DType::F32)?;
        let expected = [n.div_ceil(block[0]), k.div_ceil(block[1])];
        if scales.dims() != expected {
            return Err(crate::error::shape_err(
                "scales",
                format!("{expected:?} for {name} {:?} in blocks {block:?}", [n, k]),
                scales.dims(),
            ));
        }
        let scales = match split {
            Split::Column => {
                scales.narrow(0, rows.start / block[0], rows.len().div_ceil(block[0]))?
            }
            Split::Row => scales.narrow(1, cols.start / block[1], cols.len().div_ceil(block[1]))?,
        };
        let data = Tensor::from_vec(codes, (rows.len(), cols.len()), device)?;
        Self::from_parts(data, scales.contiguous()?.to_device(device)?, block)
    }

    /// This rank's slice of a weight already in memory (the same blocks as
    /// [`Self::load_shard`] would read).
    pub fn shard(&self, split: Split, shard: Shard) -> Result<Self> {
        let [n, k] = self.shape();
        let block = self.block();
        let range = match split {
            Split::Column => shard.range(n, block[0])?,
            Split::Row => shard.range(k, block[1])?,
        };
        self.slice(split, range)
    }

    /// Rows (`Split::Column`) or columns (`Split::Row`) `range` of a weight in memory, with
    /// the matching scales; the range must fall on blocks.
    pub fn slice(&self, split: Split, range: Range<usize>) -> Result<Self> {
        let [n, k] = self.shape();
        let block = self.block();
        let (dim, len, b) = match split {
            Split::Column => (0, n, block[0]),
            Split::Row => (1, k, block[1]),
        };
        check_on_blocks("range", &range, len, b)?;
        let data = self.data().narrow(dim, range.start, range.len())?;
        let scales = self
            .scales()
            .narrow(dim, range.start / b, range.len().div_ceil(b))?;
        Self::from_parts(data.contiguous()?, scales.contiguous()?, block)
    }
}

/// What part of the split dimension a load takes.
enum Slice {
    Shard(Shard),
    Range(Range<usize>),
}

impl Slice {
    fn resolve(self, len: usize, block: usize) -> Result<Range<usize>> {
        match self {
            Slice::Shard(s) => s.range(len, block),
            Slice::Range(r) => {
                check_on_blocks("range", &r, len, block)?;
                Ok(r)
            }
        }
    }
}
