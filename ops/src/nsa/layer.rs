use candle_core::{DType, Device, Tensor};
use candle_nn::{Linear, Module, VarBuilder};

use super::compress::{Compressor, MlpCompressor};
use super::config::{CompressorKind, NsaConfig};
use super::sdpa::masked_attention;
use super::{BlockSelection, SelectionAttention, SelectionRanges};
use crate::error::{invalid, shape_err, Error, Result};
use fp8nsa_cpu::nsa_select::{self, QueryRows};
pub use fp8nsa_types::AttnDims;

/// The layer's head layout: `Hq = G · Hkv` query heads of dim `d`, values of dim `dv` (the
/// shared [`AttnDims`], under the name the layer's API has always used).
pub type NsaDims = AttnDims;

/// Branch gates, per query head: `sigmoid(Linear(x))` (the paper), or fixed weights (e.g. to
/// run a dense checkpoint through NSA without trained gates).
#[derive(Clone, Debug)]
pub enum Gates {
    /// `hidden -> 3 * Hq`, laid out `[compressed | selected | window]`, each `Hq` wide.
    Learned(Linear),
    /// `[compressed, selected, window]` for every head and token.
    Fixed([f32; 3]),
}

/// Every branch of one call, for inspection and tests.
#[derive(Clone, Debug)]
pub struct NsaOutput {
    /// The gated sum `[B, Tq, Hq, Dv]`, in the input dtype.
    pub o: Tensor,
    /// Branch outputs `[B, Tq, Hq, Dv]`, f32.
    pub compressed: Tensor,
    pub selected: Tensor,
    pub window: Tensor,
    /// Gates `[B, Tq, Hq, 3]` f32.
    pub gates: Tensor,
    /// The top-n blocks per (batch, query, kv head).
    pub selection: BlockSelection,
    /// Selection-block importance `[B, Tq, Hkv, ceil(Tk / select_block)]` f32 (paper eq. 9,
    /// summed over the G heads of the group).
    pub importance: Tensor,
}

/// Where the selection and window branches read keys and values.
pub(crate) enum Kv<'a> {
    Dense { k: &'a Tensor, v: &'a Tensor },
    Paged(super::PagedKv<'a>),
}

/// Queries per chunk of the compressed branch (bounds its `[G, chunk, n_c]` score matrices).
const CMP_CHUNK: usize = 256;

/// The three-branch Native Sparse Attention layer (DeepSeek, arXiv 2502.11089) over projected
/// q / k / v:
///
/// `o = g_cmp · Attn(q, K̃, Ṽ) + g_slc · Attn(q, K[top-n blocks]) + g_win · Attn(q, K[last w])`
///
/// - compression: keys / values of overlapping blocks (`compress_block`, `compress_stride`)
///   become one compressed key / value each; a query sees a compressed block once all its keys
///   are at or before the query;
/// - selection: the compressed branch's attention probabilities, remapped to selection blocks
///   (eq. 9) and summed over the G heads of a kv group, rank the blocks; the top `num_selected`,
///   with the first `num_initial` and the `num_local` blocks ending at the query forced, feed
///   [`SelectionAttention`] (so every backend's selection kernel is reused);
/// - sliding window: the last `window` keys;
/// - gates: per head per branch, see [`Gates`].
///
/// ```
/// use candle_core::{Device, Tensor};
/// use fp8nsa_ops::nsa::{Compressor, Gates, NativeSparseAttention, NsaCache, NsaConfig, NsaDims};
///
/// let dev = Device::Cpu;
/// let dims = NsaDims::new(4, 1, 32, 32)?;
/// let nsa = NativeSparseAttention::new(NsaConfig::default(), dims, Compressor::MeanPool,
///                                      Gates::Fixed([1.0, 1.0, 1.0]))?;
/// let (q, k, v) = (Tensor::randn(0f32, 1.0, (1, 100, 4, 32), &dev)?,
///                  Tensor::randn(0f32, 1.0, (1, 100, 1, 32), &dev)?,
///                  Tensor::randn(0f32, 1.0, (1, 100, 1, 32), &dev)?);
/// let x = Tensor::zeros((1, 100, 8), candle_core::DType::F32, &dev)?; // gate input (unused here)
/// let o = nsa.forward(&x, &q, &k, &v)?; // prefill: [1, 100, 4, 32]
/// let mut cache = NsaCache::new();
/// let o2 = nsa.forward_step(&x, &q, &k, &v, &mut cache)?; // same, and fills the cache
/// assert_eq!((o.dims(), cache.len(), cache.compressed_len()), (o2.dims(), 100, 5));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct NativeSparseAttention {
    cfg: NsaConfig,
    dims: NsaDims,
    compressor: Compressor,
    gates: Gates,
    attention: SelectionAttention,
    scale: f32,
}

impl NativeSparseAttention {
    pub fn new(
        cfg: NsaConfig,
        dims: NsaDims,
        compressor: Compressor,
        gates: Gates,
    ) -> Result<Self> {
        // `dims` is valid by construction (`NsaDims::new`)
        cfg.validate()?;
        if compressor.kind() != cfg.compressor {
            return Err(invalid(
                "compressor",
                format!(
                    "config asks for {:?}, got {:?}",
                    cfg.compressor,
                    compressor.kind()
                ),
            ));
        }
        if cfg.compressor == CompressorKind::Mlp && dims.d() != dims.dv() {
            return Err(invalid("dims", "the MLP compressor needs Dv == D"));
        }
        Ok(Self {
            scale: 1.0 / (dims.d() as f32).sqrt(),
            cfg,
            dims,
            compressor,
            gates,
            attention: SelectionAttention::new(),
        })
    }

    /// Loads the gate projection `gate` (`hidden -> 3 * Hq`, with bias) and, for the MLP
    /// compressor, `k_compress.*` / `v_compress.*` (see [`MlpCompressor::load`]).
    pub fn load(cfg: NsaConfig, dims: NsaDims, hidden: usize, vb: VarBuilder) -> Result<Self> {
        let gates = Gates::Learned(candle_nn::linear(hidden, 3 * dims.hq(), vb.pp("gate"))?);
        let compressor = match cfg.compressor {
            CompressorKind::MeanPool => Compressor::MeanPool,
            CompressorKind::Mlp => {
                let l = cfg.compress_block;
                let h = if cfg.mlp_hidden == 0 {
                    l * dims.d() / 4
                } else {
                    cfg.mlp_hidden
                };
                Compressor::Mlp {
                    k: MlpCompressor::load(vb.pp("k_compress"), l, dims.d(), h)?,
                    v: MlpCompressor::load(vb.pp("v_compress"), l, dims.dv(), h)?,
                }
            }
        };
        Self::new(cfg, dims, compressor, gates)
    }

    /// The selection / window branches use [`SelectionAttention`] with this `min_len`.
    pub fn with_attention(mut self, attention: SelectionAttention) -> Self {
        self.attention = attention;
        self
    }

    pub(crate) fn compressor(&self) -> &Compressor {
        &self.compressor
    }

    pub fn config(&self) -> &NsaConfig {
        &self.cfg
    }

    pub fn dims(&self) -> NsaDims {
        self.dims
    }

    /// Stateless call over a whole context: `gate_input [B, Tq, hidden]` (the layer's input
    /// hidden states, read only by learned gates), projected `q [B, Tq, Hq, D]`,
    /// `k [B, Tk, Hkv, D]`, `v [B, Tk, Hkv, Dv]`, the queries being the last `Tq` positions
    /// (`q_offset = Tk - Tq`). Returns `[B, Tq, Hq, Dv]` in q's dtype.
    pub fn forward(
        &self,
        gate_input: &Tensor,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor> {
        Ok(self.forward_detailed(gate_input, q, k, v)?.o)
    }

    /// [`Self::forward`] with every branch, the gates, the selection and the importance.
    pub fn forward_detailed(
        &self,
        gate_input: &Tensor,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<NsaOutput> {
        let tk = self.check_kv(k, v)?;
        let n_c = self.cfg.compressed_len(tk);
        let ck = self.compressor.compress(&self.cfg, k, 0, n_c, true)?;
        let cv = self.compressor.compress(&self.cfg, v, 0, n_c, false)?;
        self.core(gate_input, q, k, v, &ck, &cv)
    }

    pub(crate) fn check_kv(&self, k: &Tensor, v: &Tensor) -> Result<usize> {
        let (hkv, d, dv) = (self.dims.hkv(), self.dims.d(), self.dims.dv());
        let (b, tk, h, dk) = k
            .dims4()
            .map_err(|_| shape_err("k", "[B, Tk, Hkv, D]", k.dims()))?;
        if (h, dk) != (hkv, d) {
            return Err(shape_err("k", format!("[B, Tk, {hkv}, {d}]"), k.dims()));
        }
        if v.dims() != [b, tk, hkv, dv] {
            return Err(shape_err(
                "v",
                format!("[{b}, {tk}, {hkv}, {dv}]"),
                v.dims(),
            ));
        }
        Ok(tk)
    }

    fn gate_values(&self, gate_input: &Tensor, b: usize, tq: usize) -> Result<Tensor> {
        let hq = self.dims.hq();
        match &self.gates {
            Gates::Fixed(w) => {
                let t = Tensor::new(&w[..], gate_input.device())?;
                Ok(t.reshape((1, 1, 1, 3))?
                    .broadcast_as((b, tq, hq, 3))?
                    .contiguous()?)
            }
            Gates::Learned(lin) => {
                let dims = gate_input.dims();
                let hidden = lin.weight().dims()[1];
                if dims != [b, tq, hidden] {
                    return Err(shape_err(
                        "gate_input",
                        format!("[{b}, {tq}, {hidden}] (hidden = the gate's input width)"),
                        dims,
                    ));
                }
                let g = candle_nn::ops::sigmoid(&lin.forward(gate_input)?.to_dtype(DType::F32)?)?;
                Ok(g.reshape((b, tq, 3, hq))?.transpose(2, 3)?.contiguous()?)
            }
        }
    }

    /// The three branches for queries at the last `Tq` of `Tk` positions.
    fn core(
        &self,
        gate_input: &Tensor,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        ck: &Tensor,
        cv: &Tensor,
    ) -> Result<NsaOutput> {
        let (bk, tk, _, _) = k.dims4()?;
        self.core_on(gate_input, q, Kv::Dense { k, v }, (bk, tk), ck, cv)
    }

    /// [`Self::core`] over keys and values held contiguously or in pages (`bk` sequences of
    /// `tk` keys).
    pub(crate) fn core_on(
        &self,
        gate_input: &Tensor,
        q: &Tensor,
        kv: Kv<'_>,
        (bk, tk): (usize, usize),
        ck: &Tensor,
        cv: &Tensor,
    ) -> Result<NsaOutput> {
        let (hq, hkv, d) = (self.dims.hq(), self.dims.hkv(), self.dims.d());
        let (b, tq, hq2, d2) = q
            .dims4()
            .map_err(|_| shape_err("q", "[B, Tq, Hq, D]", q.dims()))?;
        if (hq2, d2, b) != (hq, d, bk) {
            return Err(shape_err("q", format!("[{bk}, Tq, {hq}, {d}]"), q.dims()));
        }
        if tq > tk {
            return Err(invalid(
                "q",
                format!("Tq = {tq} queries but only Tk = {tk} keys"),
            ));
        }
        if !matches!(q.dtype(), DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::DType {
                arg: "q",
                expected: "f32, bf16 or f16",
                got: q.dtype(),
            });
        }
        let q_offset = tk - tq;
        let _span = tracing::debug_span!("fp8nsa::nsa_layer", b, tq, tk, hq, hkv).entered();
        let gates = self.gate_values(gate_input, b, tq)?;

        // compressed branch and block importance
        let (o_cmp, importance, selection) = self.compressed_branch(q, ck, cv, q_offset, tk)?;
        let attn = self.attention.clone().q_offset(q_offset).with_lse(false);
        let window = self.window_ranges(b, tq, q_offset, q.device())?;
        let (o_slc, o_win) = match &kv {
            Kv::Dense { k, v } => (
                attn.forward(q, k, v, &selection)?.0,
                attn.forward(q, k, v, &window)?.0,
            ),
            // one read, check and route of the block table for both branches
            Kv::Paged(paged) => {
                let mut outs = attn
                    .forward_paged_each(q, paged, &[(&selection).into(), (&window).into()])?
                    .into_iter()
                    .map(|(o, _, _)| o);
                let o_slc = outs.next().expect("two outputs");
                (o_slc, outs.next().expect("two outputs"))
            }
        };
        let o_slc = o_slc.to_dtype(DType::F32)?;
        let o_win = o_win.to_dtype(DType::F32)?;
        let g = |i: usize| gates.narrow(3, i, 1);
        let o = ((o_cmp.broadcast_mul(&g(0)?)? + o_slc.broadcast_mul(&g(1)?)?)?
            + o_win.broadcast_mul(&g(2)?)?)?;
        tracing::debug!(
            op = "nsa_layer",
            b,
            tq,
            tk,
            compressed = ck.dims()[1],
            selected = self.cfg.num_selected,
            window = self.cfg.window
        );
        Ok(NsaOutput {
            o: o.to_dtype(q.dtype())?,
            compressed: o_cmp,
            selected: o_slc,
            window: o_win,
            gates,
            selection,
            importance,
        })
    }

    /// The sliding window as one range per (batch, query, kv head), docs/nsa.md "Sliding
    /// window" (computed by `nsa_select::window_ranges`).
    fn window_ranges(
        &self,
        b: usize,
        tq: usize,
        q_offset: usize,
        dev: &Device,
    ) -> Result<SelectionRanges> {
        let hkv = self.dims.hkv();
        let rows = QueryRows {
            b,
            tq,
            hkv,
            q_offset,
        };
        let mut r = vec![0i32; b * tq * hkv * 2];
        nsa_select::window_ranges(self.cfg.params(), rows, &mut r)?;
        SelectionRanges::new(Tensor::from_vec(r, (b, tq, hkv, 1, 2), dev)?)
    }

    /// Compressed attention (dense over the visible compressed keys), its probabilities
    /// remapped to selection-block importance, and the top-n selection.
    fn compressed_branch(
        &self,
        q: &Tensor,
        ck: &Tensor,
        cv: &Tensor,
        q_offset: usize,
        tk: usize,
    ) -> Result<(Tensor, Tensor, BlockSelection)> {
        let (hq, hkv, d, dv) = (
            self.dims.hq(),
            self.dims.hkv(),
            self.dims.d(),
            self.dims.dv(),
        );
        let g = hq / hkv;
        let (b, tq, _, _) = q.dims4()?;
        let n_c = ck.dims()[1];
        let nb = tk.div_ceil(self.cfg.select_block);
        let params = self.cfg.params();
        let mut outs = Vec::with_capacity(b);
        for bi in 0..b {
            let mut chunks = Vec::new();
            for t0 in (0..tq).step_by(CMP_CHUNK) {
                let tc = CMP_CHUNK.min(tq - t0);
                if n_c == 0 {
                    chunks.push(Tensor::zeros((tc, hq, dv), DType::F32, q.device())?);
                    continue;
                }
                let qs = q
                    .narrow(0, bi, 1)?
                    .narrow(1, t0, tc)?
                    .to_dtype(DType::F32)?
                    .reshape((tc, hkv, g, d))?
                    .permute((1, 2, 0, 3))?
                    .reshape((hkv, g * tc, d))?
                    .contiguous()?;
                let kb = ck
                    .narrow(0, bi, 1)?
                    .squeeze(0)?
                    .transpose(0, 1)?
                    .contiguous()?;
                let vb = cv
                    .narrow(0, bi, 1)?
                    .squeeze(0)?
                    .transpose(0, 1)?
                    .contiguous()?;
                // a query at position p sees compressed block i iff the block ends at or before p
                let mut mask = vec![0f32; tc * n_c];
                nsa_select::compressed_mask(params, q_offset + t0, tc, n_c, &mut mask)?;
                let attend = Tensor::from_vec(mask, (1, 1, tc, n_c), q.device())?.eq(0f32)?;
                let (o, _, _) = masked_attention(&qs, &kb, &vb, &attend, self.scale)?;
                chunks.push(o.permute((2, 0, 1, 3))?.reshape((tc, hq, dv))?);
            }
            outs.push(Tensor::cat(&chunks, 0)?);
        }
        let o_cmp = Tensor::stack(&outs, 0)?;
        // the importance is not taken from the branch's probabilities: their rounding depends
        // on the product's shape (queries per call, blocks so far), so a prefill and a decode
        // step could pick different blocks at a near tie; `importance` computes each row alone
        let host = |t: &Tensor| -> Result<Vec<f32>> {
            Ok(t.to_dtype(DType::F32)?
                .flatten_all()?
                .to_device(&Device::Cpu)?
                .to_vec1()?)
        };
        let mut importance = vec![0f32; b * tq * hkv * nb];
        let rows = QueryRows {
            b,
            tq,
            hkv,
            q_offset,
        };
        let cd = nsa_select::CompressedDims {
            g,
            d,
            n_c,
            scale: self.scale,
        };
        nsa_select::importance(params, rows, cd, nb, &host(q)?, &host(ck)?, &mut importance)?;
        let selection = self.top_n(&importance, b, tq, nb, q_offset, q.device())?;
        let importance = Tensor::from_vec(importance, (b, tq, hkv, nb), q.device())?;
        Ok((o_cmp, importance, selection))
    }

    /// The top-n blocks per (batch, query, kv head), docs/nsa.md "Top-n selection" (computed
    /// by `nsa_select::top_n`: forced initial and local blocks, ties to the lower index, sorted,
    /// `-1` pads).
    fn top_n(
        &self,
        importance: &[f32],
        b: usize,
        tq: usize,
        nb: usize,
        q_offset: usize,
        dev: &Device,
    ) -> Result<BlockSelection> {
        let (hkv, n) = (self.dims.hkv(), self.cfg.num_selected);
        let rows = QueryRows {
            b,
            tq,
            hkv,
            q_offset,
        };
        let mut idx = vec![0i32; b * tq * hkv * n];
        nsa_select::top_n(self.cfg.params(), rows, nb, importance, &mut idx)?;
        BlockSelection::new(
            Tensor::from_vec(idx, (b, tq, hkv, n), dev)?,
            self.cfg.select_block,
        )
    }
}

/// A decode step's queries are its new positions: at most as many as the keys it appends.
pub(crate) fn check_step_queries(q: &Tensor, k_new: &Tensor) -> Result<()> {
    if let (Some(&tq), Some(&tn)) = (q.dims().get(1), k_new.dims().get(1)) {
        if tq > tn {
            return Err(invalid(
                "q",
                format!(
                    "{tq} query tokens for {tn} new key tokens: a step's queries are its new \
                     positions (at most as many as k_new)"
                ),
            ));
        }
    }
    Ok(())
}
