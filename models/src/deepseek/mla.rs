//! Multi-head latent attention: the projections, the latent cache, and attention on the
//! latent with `kv_b_proj` absorbed into the query and the output.

use candle_core::{DType, Module, Tensor};
use candle_nn::{LayerNorm, RmsNorm};
use fp8nsa_ops::nsa::{SelectionAttention, TokenSelection};

use super::indexer::Indexer;
use super::{expect_shape, DeepSeekConfig};
use crate::attention::Rope;
use crate::config::{ModelOptions, RopeStyle};
use crate::error::{invalid, Result};
use crate::linear::{Linear, LinearKind};
use crate::paged::{KvPool, LayerKv, SeqKv};
use crate::rope::RopeScaling;
use crate::weights::Weights;

#[derive(Clone, Debug)]
pub(super) enum QProj {
    /// `q_b(norm(q_a(x)))`; the normalized latent also feeds the V3.2 indexer.
    Lora {
        a: Linear,
        norm: RmsNorm,
        b: Linear,
    },
    Direct(Linear),
}

/// Per-layer cache of MLA: `[c | k_pe]` rows and, with the indexer, its key rows. Buffers grow
/// by doubling; the first `len` rows are valid, the step's rows count after `commit`.
#[derive(Debug, Default)]
pub(crate) struct MlaCache {
    latent: Option<Tensor>,
    index: Option<Tensor>,
    len: usize,
}

impl MlaCache {
    pub(crate) fn try_clone(&self) -> Result<Self> {
        let copy = |t: &Option<Tensor>| -> Result<Option<Tensor>> {
            Ok(match t {
                Some(t) => Some(t.copy()?),
                None => None,
            })
        };
        Ok(Self {
            latent: copy(&self.latent)?,
            index: copy(&self.index)?,
            len: self.len,
        })
    }

    pub(crate) fn commit(&mut self, t: usize) {
        self.len += t;
    }

    /// Floats kept per token (latent, plus the indexer's key).
    pub(crate) fn row_floats(&self) -> usize {
        [&self.latent, &self.index]
            .iter()
            .filter_map(|b| b.as_ref().map(|t| t.dims()[1]))
            .sum()
    }
}

/// Writes `rows [T, W]` after the first `len` rows of `buf` (growing it) and returns rows
/// `0..len + T`.
fn append(buf: &mut Option<Tensor>, len: usize, rows: &Tensor) -> Result<Tensor> {
    let (t, w) = rows.dims2()?;
    let need = len + t;
    let cap = buf.as_ref().map_or(0, |b| b.dims()[0]);
    if need > cap {
        let grown = Tensor::zeros((need.max(2 * cap).max(64), w), rows.dtype(), rows.device())?;
        if let Some(old) = buf.as_ref() {
            if len > 0 {
                grown.slice_set(&old.narrow(0, 0, len)?, 0, 0)?;
            }
        }
        *buf = Some(grown);
    }
    let b = buf.as_ref().expect("allocated above");
    b.slice_set(&rows.contiguous()?, 0, len)?;
    Ok(b.narrow(0, 0, need)?)
}

/// Multi-head latent attention of one layer (and V3.2's indexer).
#[derive(Clone, Debug)]
pub(crate) struct Mla {
    q: QProj,
    kv_a: Linear,
    kv_norm: RmsNorm,
    /// `[H, nope, r]`: folds each head's key projection into its query.
    w_uk: Tensor,
    /// `[H, r, v]`: each head's value projection, applied to its attended latent.
    w_uv: Tensor,
    o: Linear,
    heads: usize,
    nope: usize,
    rope_dim: usize,
    rank: usize,
    v: usize,
    scale: f32,
    /// Interleaved pairs.
    rope: Rope,
    indexer: Option<Indexer>,
}

impl Mla {
    pub(super) fn new(
        cfg: &DeepSeekConfig,
        w: &Weights,
        prefix: &str,
        opts: &ModelOptions,
        keep_dense: &dyn Fn(&str) -> bool,
        scaling: &RopeScaling,
    ) -> Result<Self> {
        let lin = |n: &str, want: [usize; 2]| -> Result<Linear> {
            let name = format!("{prefix}.{n}");
            let l = Linear::build(w, &name, opts.linear, keep_dense(&name))?;
            expect_shape(&name, &l, want)?;
            Ok(l)
        };
        let norm = |n: &str, dim: usize| -> Result<RmsNorm> {
            let name = format!("{prefix}.{n}.weight");
            let t = w.get(&name)?;
            if t.dims() != [dim] {
                return Err(invalid(
                    "weights",
                    format!("{name} is {:?}, expected [{dim}]", t.dims()),
                ));
            }
            Ok(RmsNorm::new(t, cfg.rms_norm_eps))
        };
        let (h, hidden) = (cfg.num_attention_heads, cfg.hidden_size);
        let (nope, rd, v, r) = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
            cfg.kv_lora_rank,
        );
        let q = match cfg.q_lora_rank {
            Some(ql) => QProj::Lora {
                a: lin("q_a_proj", [ql, hidden])?,
                norm: norm("q_a_layernorm", ql)?,
                b: lin("q_b_proj", [h * (nope + rd), ql])?,
            },
            None => QProj::Direct(lin("q_proj", [h * (nope + rd), hidden])?),
        };
        let kv_b_name = format!("{prefix}.kv_b_proj");
        let kv_b = w.dense(&kv_b_name)?;
        if kv_b.dims() != [h * (nope + v), r] {
            return Err(invalid(
                "weights",
                format!(
                    "{kv_b_name}.weight is {:?}, the config says [{}, {r}]",
                    kv_b.dims(),
                    h * (nope + v)
                ),
            ));
        }
        let kv_b = kv_b.reshape((h, nope + v, r))?;
        let max = cfg.max_position_embeddings;
        let indexer = match cfg.indexer() {
            Some(ix) => {
                let ql = cfg.q_lora_rank.unwrap_or(hidden);
                let p = format!("{prefix}.indexer");
                let get = |n: &str| w.get(&format!("{p}.{n}"));
                let (kw, kb) = (get("k_norm.weight")?, get("k_norm.bias")?);
                for (n, t) in [("k_norm.weight", &kw), ("k_norm.bias", &kb)] {
                    if t.dims() != [ix.head_dim] {
                        return Err(invalid(
                            "weights",
                            format!("{p}.{n} is {:?}, expected [{}]", t.dims(), ix.head_dim),
                        ));
                    }
                }
                // weights_proj stays as stored (bf16 in the checkpoints): it decides which keys
                // are kept, so it is never quantized
                let wp_name = format!("{p}.weights_proj");
                let weights_proj = Linear::build(w, &wp_name, LinearKind::Dense, true)?;
                expect_shape(&wp_name, &weights_proj, [ix.heads, hidden])?;
                Some(Indexer {
                    wq_b: lin("indexer.wq_b", [ix.heads * ix.head_dim, ql])?,
                    wk: lin("indexer.wk", [ix.head_dim, hidden])?,
                    k_norm: LayerNorm::new(kw, kb, 1e-6),
                    weights_proj,
                    dims: ix,
                    rope_dim: rd,
                    rope: Rope::with_dim(scaling, cfg.rope_theta, rd, max, RopeStyle::Half)?,
                })
            }
            None => None,
        };
        Ok(Self {
            q,
            kv_a: lin("kv_a_proj_with_mqa", [r + rd, hidden])?,
            kv_norm: norm("kv_a_layernorm", r)?,
            w_uk: kv_b.narrow(1, 0, nope)?.contiguous()?,
            w_uv: kv_b.narrow(1, nope, v)?.transpose(1, 2)?.contiguous()?,
            o: lin("o_proj", [hidden, h * v])?,
            heads: h,
            nope,
            rope_dim: rd,
            rank: r,
            v,
            scale: cfg.softmax_scale() as f32,
            rope: Rope::with_dim(scaling, cfg.rope_theta, rd, max, RopeStyle::Interleaved)?,
            indexer,
        })
    }

    /// The projections that run (fp8 or dense); `kv_b_proj` runs absorbed, in f32.
    pub(crate) fn projections(&self) -> Vec<&Linear> {
        let mut v = match &self.q {
            QProj::Lora { a, b, .. } => vec![a, b],
            QProj::Direct(q) => vec![q],
        };
        v.extend([&self.kv_a, &self.o]);
        if let Some(ix) = &self.indexer {
            v.extend([&ix.wq_b, &ix.wk, &ix.weights_proj]);
        }
        v
    }

    /// What this layer keeps per token in a [`KvPool`].
    pub(crate) fn kv_layout(&self) -> LayerKv {
        LayerKv::Latent {
            width: self.rank + self.rope_dim,
            index: self.indexer.as_ref().map_or(0, |ix| ix.dims.head_dim),
        }
    }

    /// `x [1, T, hidden]` at positions `pos..pos + T`.
    pub(crate) fn forward(&self, x: &Tensor, pos: usize, cache: &mut MlaCache) -> Result<Tensor> {
        let (_, t, _) = x.dims3()?;
        let segs = [(pos, t)];
        let p = self.project(x, &segs)?;
        let latent = append(&mut cache.latent, cache.len, &p.rows)?; // [pos + T, W]
        let selection = match (&self.indexer, &p.cq) {
            (Some(ix), Some(cq)) => {
                let keys = append(&mut cache.index, cache.len, &ix.keys(x, &segs)?)?;
                ix.select(x, cq, &keys, pos)?
            }
            _ => None,
        };
        self.output(&self.attend(&p.qa, &latent, pos, selection)?)
    }

    /// A ragged batch (`Llama::forward_batch`): `x [1, M, hidden]` holds each sequence's new
    /// tokens in turn, `segs[i] = (pos, len)`; the projections run once over all M tokens,
    /// attention per sequence over the rows of its pages in `pool` (layer `layer`).
    pub(crate) fn forward_batch(
        &self,
        x: &Tensor,
        segs: &[(usize, usize)],
        layer: usize,
        pool: &KvPool,
        seqs: &[&mut SeqKv],
    ) -> Result<Tensor> {
        let p = self.project(x, segs)?;
        let ikeys = match &self.indexer {
            Some(ix) => Some(ix.keys(x, segs)?),
            None => None,
        };
        let mut outs = Vec::with_capacity(segs.len());
        let mut off = 0;
        for (&(pos, t), seq) in segs.iter().zip(seqs) {
            let rows = p.rows.narrow(0, off, t)?;
            let ik = match &ikeys {
                Some(k) => Some(k.narrow(0, off, t)?),
                None => None,
            };
            let (latent, keys) = pool.write_read_latent(layer, seq, pos, &rows, ik.as_ref())?;
            let selection = match (&self.indexer, &p.cq, &keys) {
                (Some(ix), Some(cq), Some(keys)) => {
                    ix.select(&x.narrow(1, off, t)?, &cq.narrow(1, off, t)?, keys, pos)?
                }
                _ => None,
            };
            outs.push(self.attend(&p.qa.narrow(1, off, t)?, &latent, pos, selection)?);
            off += t;
        }
        let o = match outs.len() {
            1 => outs.pop().expect("one output"),
            _ => Tensor::cat(&outs, 1)?,
        };
        self.output(&o)
    }

    /// The step's queries in latent space and cache rows, for `x [1, M, hidden]` whose rows
    /// are runs of positions `segs`.
    fn project(&self, x: &Tensor, segs: &[(usize, usize)]) -> Result<Projected> {
        let (_, m, _) = x.dims3()?;
        let (h, nope, rd, r) = (self.heads, self.nope, self.rope_dim, self.rank);
        let (q, cq) = match &self.q {
            QProj::Lora { a, norm, b } => {
                let cq = norm.forward(&a.forward(x)?)?;
                (b.forward(&cq)?, Some(cq))
            }
            QProj::Direct(p) => (p.forward(x)?, None),
        };
        let q = q.reshape((1, m, h, nope + rd))?;
        let q_pe = self
            .rope
            .apply_segments(&q.narrow(3, nope, rd)?.contiguous()?, segs)?;
        let kv = self.kv_a.forward(x)?;
        let c = self.kv_norm.forward(&kv.narrow(2, 0, r)?.contiguous()?)?;
        let k_pe = kv.narrow(2, r, rd)?.contiguous()?.reshape((1, m, 1, rd))?;
        let k_pe = self.rope.apply_segments(&k_pe, segs)?.reshape((m, rd))?;
        let rows = Tensor::cat(&[&c.reshape((m, r))?, &k_pe], 1)?;
        // [H, M, nope] . [H, nope, r]: the query in latent space, then its rotated part
        let qn = q
            .narrow(3, 0, nope)?
            .squeeze(0)?
            .transpose(0, 1)?
            .contiguous()?;
        let q_lat = qn.matmul(&self.w_uk)?;
        let qp = q_pe.squeeze(0)?.transpose(0, 1)?.contiguous()?;
        Ok(Projected {
            qa: Tensor::cat(&[&q_lat, &qp], 2)?,
            rows,
            cq,
        })
    }

    /// `qa [H, T, W]` at positions `pos..` against `latent [Tk, W]`, every causal key or the
    /// indexer's `selection`: the attended latents `[H, T, r]`.
    fn attend(
        &self,
        qa: &Tensor,
        latent: &Tensor,
        pos: usize,
        selection: Option<TokenSelection>,
    ) -> Result<Tensor> {
        let r = self.rank;
        match selection {
            None => self.attend_all(qa, latent, pos),
            Some(sel) => {
                // the cache row serves as key and as value: the first r outputs are the
                // weighted latents, the rotated tail is dropped
                let q4 = qa.transpose(0, 1)?.unsqueeze(0)?.contiguous()?; // [1, T, H, W]
                let kv4 = latent.unsqueeze(0)?.unsqueeze(2)?; // [1, Tk, 1, W]
                let (o, _) = SelectionAttention::new()
                    .scale(self.scale)
                    .q_offset(pos)
                    .min_len(0)
                    .forward(&q4, &kv4, &kv4, &sel)?;
                Ok(o.narrow(3, 0, r)?
                    .squeeze(0)?
                    .transpose(0, 1)?
                    .contiguous()?)
            }
        }
    }

    /// Each head's value projection of its attended latents `[H, M, r]`, then `o_proj`.
    fn output(&self, o_lat: &Tensor) -> Result<Tensor> {
        let (h, m, _) = o_lat.dims3()?;
        let o = o_lat.matmul(&self.w_uv)?; // [H, M, v]
        let o = o
            .transpose(0, 1)?
            .contiguous()?
            .reshape((1, m, h * self.v))?;
        Ok(self.o.forward(&o)?)
    }

    /// Every causal key: `qa [H, T, W]` against `latent [Tk, W]`; `[H, T, r]`.
    fn attend_all(&self, qa: &Tensor, latent: &Tensor, pos: usize) -> Result<Tensor> {
        let (h, t, w) = qa.dims3()?;
        let r = self.rank;
        let tk = latent.dims()[0];
        if latent.device().is_cpu() && latent.dtype() == DType::F32 {
            // the cache read in place, key and value alike, each query over the rows up to
            // its own (no score matrix, no mask); the rotated tail of the output is dropped
            let kv = latent.reshape((1, 1, tk, w))?;
            let q = qa.transpose(0, 1)?.unsqueeze(0)?; // [1, T, H, W]
            let o = fp8nsa_ops::nsa::causal_attention(&q, &kv, &kv, self.scale)?;
            return Ok(o
                .squeeze(0)?
                .narrow(2, 0, r)?
                .transpose(0, 1)?
                .contiguous()?);
        }
        let s = (qa.reshape((h * t, w))?.matmul(&latent.t()?)? * self.scale as f64)?;
        let mask: Vec<f32> = (0..h * t)
            .flat_map(|row| {
                let i = row % t;
                (0..tk).map(move |j| if j > pos + i { f32::NEG_INFINITY } else { 0.0 })
            })
            .collect();
        let s = (s + Tensor::from_vec(mask, (h * t, tk), latent.device())?)?;
        let p = candle_nn::ops::softmax_last_dim(&s)?;
        let c = latent.narrow(1, 0, r)?.contiguous()?;
        Ok(p.matmul(&c)?.reshape((h, t, r))?)
    }
}

/// One step's MLA projections.
struct Projected {
    /// `[H, M, W]`: each head's query as `[q_nope . W_uk | rotated q_pe]`.
    qa: Tensor,
    /// `[M, W]`: the cache rows `[norm(c) | rotated k_pe]`.
    rows: Tensor,
    /// `[1, M, q_lora_rank]`: the normalized query latent (the indexer's input).
    cq: Option<Tensor>,
}
