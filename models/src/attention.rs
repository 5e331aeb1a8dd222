use candle_core::{DType, Device, Module, Tensor};
use candle_nn::RmsNorm;
use fp8nsa_ops::nsa::{
    Compressor, Gates, NativeSparseAttention, NsaCache, NsaConfig, NsaDims, SelectionAttention,
};

use crate::config::{LlamaConfig, ModelOptions, RopeStyle};
use crate::error::{invalid, Result};
use crate::linear::{forward_all, Linear};
use crate::paged::{KvPool, LayerKv, SeqInner, SeqKv, Store};
use crate::weights::Weights;

/// The attention of every layer.
#[derive(Clone, Debug, Default)]
pub enum AttentionKind {
    /// Dense causal softmax attention.
    #[default]
    Dense,
    /// Native Sparse Attention. Gates come from `{layer}.self_attn.nsa.gate` when the weights
    /// have them; a dense checkpoint has none, and then the gates are fixed to the selection
    /// branch (`[0, 1, 0]`): training-free NSA, where the compressed branch only ranks blocks.
    /// The selection and window branches run the selection kernel at every length
    /// (`min_len(0)`; `FP8NSA_NSA_MIN_LEN` does not apply here), where the layer's own default
    /// falls back to masked SDPA below 2048 keys.
    Nsa(NsaConfig),
}

/// Rotary position embedding tables, built for the positions in use: they grow (doubling)
/// as later positions are asked for, up to `max_position_embeddings`, so a config that
/// declares an enormous context allocates nothing up front.
#[derive(Debug)]
pub(crate) struct Rope {
    /// `[1, head_dim / 2]` inverse frequencies.
    inv: Tensor,
    attn_factor: f64,
    max: usize,
    style: RopeStyle,
    /// `(cos, sin)` `[len, head_dim / 2]` for positions `0..len`.
    tables: std::sync::RwLock<(Tensor, Tensor)>,
}

/// Positions a fresh table covers before it first grows.
const ROPE_INITIAL: usize = 4096;

impl Clone for Rope {
    fn clone(&self) -> Self {
        let tables = self
            .tables
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        Self {
            inv: self.inv.clone(),
            attn_factor: self.attn_factor,
            max: self.max,
            style: self.style,
            tables: std::sync::RwLock::new(tables),
        }
    }
}

impl Rope {
    pub(crate) fn new(cfg: &LlamaConfig) -> Result<Self> {
        Self::with_dim(
            &cfg.rope_scaling()?,
            cfg.rope_theta,
            cfg.head_dim(),
            cfg.max_position_embeddings,
            cfg.rope_style,
        )
    }

    /// Tables for rotating `dim` dimensions (even) with base `theta`, `scaling`, up to `max`
    /// positions, pairing dimensions as `style` says.
    pub(crate) fn with_dim(
        scaling: &crate::rope::RopeScaling,
        theta: f64,
        dim: usize,
        max: usize,
        style: RopeStyle,
    ) -> Result<Self> {
        let (inv, attn_factor) = scaling.frequencies(theta, dim);
        let inv: Vec<f32> = inv.iter().map(|&f| f as f32).collect();
        let inv = Tensor::from_vec(inv, (1, dim / 2), &Device::Cpu)?;
        let max = max.max(1);
        let tables = Self::build(&inv, attn_factor, ROPE_INITIAL.min(max))?;
        Ok(Self {
            inv,
            attn_factor,
            max,
            style,
            tables: std::sync::RwLock::new(tables),
        })
    }

    fn build(inv: &Tensor, attn_factor: f64, len: usize) -> Result<(Tensor, Tensor)> {
        let n = u32::try_from(len)
            .map_err(|_| invalid("position", format!("{len} positions do not fit in u32")))?;
        let t = Tensor::arange(0u32, n, &Device::Cpu)?
            .to_dtype(DType::F32)?
            .reshape((len, 1))?;
        let f = t.broadcast_mul(inv)?;
        // YaRN's attention temperature scales q·k through both rotated factors
        Ok(((f.cos()? * attn_factor)?, (f.sin()? * attn_factor)?))
    }

    /// The `(cos, sin)` tables, grown if needed to cover positions `0..end`.
    fn tables(&self, end: usize) -> Result<(Tensor, Tensor)> {
        if end > self.max {
            return Err(invalid(
                "position",
                format!(
                    "position {end} exceeds max_position_embeddings = {}",
                    self.max
                ),
            ));
        }
        {
            let (cos, sin) = &*self.tables.read().unwrap_or_else(|e| e.into_inner());
            if cos.dims()[0] >= end {
                return Ok((cos.clone(), sin.clone()));
            }
        }
        let mut tables = self.tables.write().unwrap_or_else(|e| e.into_inner());
        if tables.0.dims()[0] < end {
            let len = end.max(2 * tables.0.dims()[0]).min(self.max);
            *tables = Self::build(&self.inv, self.attn_factor, len)?;
        }
        Ok(tables.clone())
    }

    /// Rotates `x [B, T, H, D]` for positions `pos..pos + T`.
    pub(crate) fn apply(&self, x: &Tensor, pos: usize) -> Result<Tensor> {
        let (b, t) = (x.dims()[0], x.dims()[1]);
        let end = pos
            .checked_add(t)
            .ok_or_else(|| invalid("position", format!("{pos} + {t} overflows")))?;
        let positions: Vec<usize> = (0..b).flat_map(|_| pos..end).collect();
        self.rotate(x, &positions, end)
    }

    /// Rotates `x [1, M, H, D]` whose rows are runs of positions `segs` (`(pos, len)` per
    /// sequence of a ragged batch).
    pub(crate) fn apply_segments(&self, x: &Tensor, segs: &[(usize, usize)]) -> Result<Tensor> {
        let mut end = 0;
        for &(pos, t) in segs {
            let e = pos
                .checked_add(t)
                .ok_or_else(|| invalid("position", format!("{pos} + {t} overflows")))?;
            end = end.max(e);
        }
        let positions: Vec<usize> = segs.iter().flat_map(|&(p, t)| p..p + t).collect();
        self.rotate(x, &positions, end)
    }

    /// `x`'s tokens rotated at `positions` (all below `end`), in one op with no transposes on
    /// the CPU (`fp8nsa_ops::rope`; the tables live on the host, and a model on another device
    /// gets the rows it needs moved there).
    fn rotate(&self, x: &Tensor, positions: &[usize], end: usize) -> Result<Tensor> {
        let (cos, sin) = self.tables(end)?;
        Ok(fp8nsa_ops::rope(x, &cos, &sin, positions, self.style)?)
    }
}

#[derive(Clone, Debug)]
enum Impl {
    Dense,
    Nsa(Box<NativeSparseAttention>),
}

/// Per-layer decode state.
#[derive(Debug)]
pub(crate) enum AttnCache {
    Dense(KvBuf),
    Nsa(NsaCache),
    /// DeepSeek's latent cache.
    Mla(crate::deepseek::MlaCache),
}

impl AttnCache {
    pub(crate) fn try_clone(&self) -> Result<Self> {
        Ok(match self {
            AttnCache::Dense(kv) => AttnCache::Dense(kv.try_clone()?),
            AttnCache::Nsa(c) => AttnCache::Nsa(c.try_clone()?),
            AttnCache::Mla(c) => AttnCache::Mla(c.try_clone()?),
        })
    }

    /// Floats kept per token (see [`crate::Cache::floats_per_token`]); 0 before the first
    /// token.
    pub(crate) fn floats_per_token(&self) -> Option<usize> {
        match self {
            AttnCache::Dense(kv) => Some(kv.kv.as_ref().map_or(0, |(k, v)| {
                let per = |t: &Tensor| t.dims()[1] * t.dims()[3];
                per(k) + per(v)
            })),
            AttnCache::Mla(c) => Some(c.row_floats()),
            AttnCache::Nsa(_) => None,
        }
    }

    /// Makes the positions the last step wrote count. The model calls this once the whole step
    /// succeeded, so a failed step leaves every dense layer's cache as it was (the NSA cache
    /// keeps its own state).
    pub(crate) fn commit(&mut self, t: usize) {
        match self {
            AttnCache::Dense(kv) => kv.len += t,
            AttnCache::Mla(c) => c.commit(t),
            AttnCache::Nsa(_) => {}
        }
    }
}

/// Past keys and values `[B, Hkv, capacity, D]` (the layout attention reads them in), the first
/// `len` positions valid. The buffers grow by doubling, so a decode step writes only its own
/// token, and attention reads the valid prefix as a strided view: nothing is copied per step
/// in proportion to the context. The buffers are written in place, so a clone copies them.
#[derive(Debug)]
pub(crate) struct KvBuf {
    kv: Option<(Tensor, Tensor)>,
    len: usize,
    /// What the rows are kept in (f32, or f16 / bf16: rounded once when written).
    dtype: DType,
}

impl KvBuf {
    fn new(dtype: DType) -> Self {
        Self {
            kv: None,
            len: 0,
            dtype,
        }
    }

    /// A copy with its own buffers: sharing them would let one copy overwrite the other's
    /// positions.
    fn try_clone(&self) -> Result<Self> {
        let kv = match &self.kv {
            Some((k, v)) => Some((k.copy()?, v.copy()?)),
            None => None,
        };
        Ok(Self {
            kv,
            len: self.len,
            dtype: self.dtype,
        })
    }

    /// Writes `k`, `v [B, T, Hkv, D]` after the valid positions and returns all keys and values
    /// up to them as `[B, Hkv, len + T, D]` views. The new positions count only after
    /// [`AttnCache::commit`].
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, t, hkv, d) = k.dims4()?;
        let dv = v.dims4()?.3;
        let need = self.len + t;
        let cap = self.kv.as_ref().map_or(0, |(k, _)| k.dims()[2]);
        if need > cap {
            // twice what is needed: a prompt's first decode step does not grow it again
            let rows = need.saturating_mul(2).max(64);
            let grow = |old: Option<&Tensor>, w: usize| -> Result<Tensor> {
                let buf = fp8nsa_ops::zeros_committed(
                    (b, hkv, rows, w),
                    self.dtype,
                    k.device(),
                    "cache",
                )?;
                if let Some(old) = old {
                    buf.slice_set(&old.narrow(2, 0, self.len)?.contiguous()?, 2, 0)?;
                }
                Ok(buf)
            };
            let old = self.kv.as_ref();
            self.kv = Some((grow(old.map(|p| &p.0), d)?, grow(old.map(|p| &p.1), dv)?));
        }
        let (kb, vb) = self.kv.as_ref().expect("allocated above");
        if b == 1 && k.dtype() == DType::F32 && v.dtype() == DType::F32 {
            // the new rows written in place, rounded once for a 16-bit cache
            let rows: Vec<usize> = (self.len..need).collect();
            fp8nsa_ops::nsa::write_rows(kb, k, &rows)?;
            fp8nsa_ops::nsa::write_rows(vb, v, &rows)?;
        } else {
            let (kt, vt) = (
                k.transpose(1, 2)?.contiguous()?.to_dtype(self.dtype)?,
                v.transpose(1, 2)?.contiguous()?.to_dtype(self.dtype)?,
            );
            kb.slice_set(&kt, 2, self.len)?;
            vb.slice_set(&vt, 2, self.len)?;
        }
        Ok((kb.narrow(2, 0, need)?, vb.narrow(2, 0, need)?))
    }
}

#[derive(Clone, Debug)]
pub(crate) struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    /// Qwen3's per-head RMSNorm of q and k before RoPE (`q_norm` / `k_norm`, weight
    /// `[head_dim]`); Llama has none.
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    hq: usize,
    hkv: usize,
    hd: usize,
    imp: Impl,
}

impl Attention {
    pub(crate) fn new(
        cfg: &LlamaConfig,
        w: &Weights,
        prefix: &str,
        opts: &ModelOptions,
        keep_dense: &dyn Fn(&str) -> bool,
    ) -> Result<Self> {
        let lin = |n: &str| {
            let name = format!("{prefix}.{n}");
            Linear::build(w, &name, opts.linear, keep_dense(&name))
        };
        let (hq, hkv, hd) = (cfg.num_attention_heads, cfg.kv_heads(), cfg.head_dim());
        let imp = match &opts.attention {
            AttentionKind::Dense => Impl::Dense,
            AttentionKind::Nsa(nsa_cfg) => {
                let dims = NsaDims::new(hq, hkv, hd, hd).map_err(fp8nsa_ops::Error::from)?;
                let gate = format!("{prefix}.nsa.gate");
                let gates = match (
                    w.get_opt(&format!("{gate}.weight"))?,
                    w.get_opt(&format!("{gate}.bias"))?,
                ) {
                    (Some(wt), b) => Gates::Learned(candle_nn::Linear::new(wt, b)),
                    (None, _) => Gates::Fixed([0.0, 1.0, 0.0]),
                };
                // the selection kernel from the first key, not only from FP8NSA_NSA_MIN_LEN
                // (2048) on: below it the layer's masked-SDPA fallback gathers the cache's pages
                // and scores every key each step. SmolLM2's NSA variant on a Zen 4 CPU, 512
                // tokens: decode 28 -> 43 tok/s with the kernel, prefill no slower
                let nsa =
                    NativeSparseAttention::new(nsa_cfg.clone(), dims, Compressor::MeanPool, gates)?
                        .with_attention(SelectionAttention::new().min_len(0));
                Impl::Nsa(Box::new(nsa))
            }
        };
        let norm = |n: &str| w.get_opt(&format!("{prefix}.{n}.weight"));
        let qk_norm = match (norm("q_norm")?, norm("k_norm")?) {
            (Some(q), Some(k)) => {
                for (name, t) in [("q_norm", &q), ("k_norm", &k)] {
                    if t.dims() != [hd] {
                        return Err(invalid(
                            "weights",
                            format!("{prefix}.{name}.weight is {:?}, expected [{hd}]", t.dims()),
                        ));
                    }
                }
                let eps = cfg.rms_norm_eps;
                Some((RmsNorm::new(q, eps), RmsNorm::new(k, eps)))
            }
            (None, None) => None,
            _ => {
                return Err(invalid(
                    "weights",
                    format!("{prefix} has only one of q_norm and k_norm"),
                ))
            }
        };
        Ok(Self {
            q: lin("q_proj")?,
            k: lin("k_proj")?,
            v: lin("v_proj")?,
            o: lin("o_proj")?,
            qk_norm,
            hq,
            hkv,
            hd,
            imp,
        })
    }

    pub(crate) fn projections(&self) -> [&Linear; 4] {
        [&self.q, &self.k, &self.v, &self.o]
    }

    /// `kv_dtype` is the dense keys' and values' type (checked by the caller:
    /// `paged::check_kv_dtype`).
    pub(crate) fn new_cache(&self, kv_dtype: DType) -> AttnCache {
        match self.imp {
            Impl::Dense => AttnCache::Dense(KvBuf::new(kv_dtype)),
            Impl::Nsa(_) => AttnCache::Nsa(NsaCache::new()),
        }
    }

    /// `x [1, T, hidden]` at positions `pos..pos + T`.
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        pos: usize,
        rope: &Rope,
        cache: &mut AttnCache,
    ) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let [q, k, v] = forward_all([&self.q, &self.k, &self.v], x)?;
        let q = q.reshape((b, t, self.hq, self.hd))?;
        let k = k.reshape((b, t, self.hkv, self.hd))?;
        let v = v.reshape((b, t, self.hkv, self.hd))?;
        let (q, k) = match &self.qk_norm {
            Some((qn, kn)) => (qn.forward(&q)?, kn.forward(&k)?),
            None => (q, k),
        };
        let (q, k) = (rope.apply(&q, pos)?, rope.apply(&k, pos)?);
        let o = match (&self.imp, cache) {
            (Impl::Dense, AttnCache::Dense(kv)) => {
                // the new positions count only once attention succeeded
                // the new positions count once the whole step succeeded (`AttnCache::commit`)
                let (kh, vh) = kv.append(&k, &v)?;
                self.dense(&q, &kh, &vh, pos)?
            }
            (Impl::Nsa(nsa), AttnCache::Nsa(c)) => nsa.forward_step(x, &q, &k, &v, c)?,
            _ => return Err(invalid("cache", "built for another attention kind")),
        };
        Ok(self.o.forward(&o.reshape((b, t, self.hq * self.hd))?)?)
    }

    /// What this layer keeps per token in a [`KvPool`].
    pub(crate) fn kv_layout(&self) -> Result<LayerKv> {
        Ok(match &self.imp {
            Impl::Dense => LayerKv::Dense {
                hkv: self.hkv,
                d: self.hd,
            },
            Impl::Nsa(nsa) => LayerKv::Nsa(nsa.dims()),
        })
    }

    /// The NSA configuration, for rolling back a sequence's states.
    pub(crate) fn nsa_config(&self) -> Option<&NsaConfig> {
        match &self.imp {
            Impl::Dense => None,
            Impl::Nsa(nsa) => Some(nsa.config()),
        }
    }

    /// A ragged batch: `x [1, M, hidden]` holds the new tokens of each sequence in turn,
    /// `segs[i] = (pos, len)` sequence i's run, `seqs[i]` its KV in `pool` (layer `layer`).
    /// The projections run once over all M tokens; attention runs per sequence over its pages.
    pub(crate) fn forward_batch(
        &self,
        x: &Tensor,
        segs: &[(usize, usize)],
        rope: &Rope,
        layer: usize,
        pool: &KvPool,
        seqs: &mut [&mut SeqKv],
    ) -> Result<Tensor> {
        let (_, m, _) = x.dims3()?;
        let [q, k, v] = forward_all([&self.q, &self.k, &self.v], x)?;
        let q = q.reshape((1, m, self.hq, self.hd))?;
        let k = k.reshape((1, m, self.hkv, self.hd))?;
        let v = v.reshape((1, m, self.hkv, self.hd))?;
        let (q, k) = match &self.qk_norm {
            Some((qn, kn)) => (qn.forward(&q)?, kn.forward(&k)?),
            None => (q, k),
        };
        let (q, k) = (
            rope.apply_segments(&q, segs)?,
            rope.apply_segments(&k, segs)?,
        );
        let o = if matches!(self.imp, Impl::Dense) && q.device().is_cpu() && q.dtype() == DType::F32
        {
            // every new token (a decode step's one, a prefill chunk's many) attends through one
            // paged kernel reading the pages in place, each over the rows up to its own
            pool.write_all(layer, seqs.iter().map(|s| &**s), segs, &k, &v)?;
            let mut lists: Vec<&[usize]> = Vec::with_capacity(segs.len());
            let mut kv = None;
            for seq in seqs.iter() {
                let (pools, pages) = pool.dense(layer, seq)?;
                kv = Some(pools);
                lists.push(pages);
            }
            let lens: Vec<usize> = segs.iter().map(|&(pos, t)| pos + t).collect();
            let news: Vec<usize> = segs.iter().map(|&(_, t)| t).collect();
            let (kp, vp) = kv.ok_or_else(|| invalid("seqs", "an empty batch"))?;
            let scale = 1.0 / (self.hd as f32).sqrt();
            fp8nsa_ops::nsa::causal_attention_paged(
                &q.squeeze(0)?,
                kp,
                vp,
                &lists,
                &lens,
                &news,
                pool.page_size(),
                scale,
            )?
            .reshape((1, m, self.hq * self.hd))?
        } else {
            let mut outs = Vec::with_capacity(segs.len());
            let mut off = 0;
            for (&(pos, t), seq) in segs.iter().zip(seqs.iter_mut()) {
                let (qs, ks, vs) = (
                    q.narrow(1, off, t)?,
                    k.narrow(1, off, t)?,
                    v.narrow(1, off, t)?,
                );
                let o = match &self.imp {
                    Impl::Dense => {
                        pool.write(layer, seq, pos, &ks, &vs)?;
                        // a 16-bit pool's rows: `dense` reads or converts them
                        let (kh, vh) = pool.read(layer, seq, pos + t)?;
                        self.dense(&qs, &kh, &vh, pos)?
                    }
                    Impl::Nsa(nsa) => match (&mut seq.inner, &pool.store) {
                        (SeqInner::Nsa(states), Store::Nsa { layers }) => nsa.forward_step_paged(
                            &x.narrow(1, off, t)?,
                            &qs,
                            &ks.contiguous()?,
                            &vs.contiguous()?,
                            &layers[layer].0,
                            &mut states[layer],
                        )?,
                        _ => return Err(invalid("kv", "the pool was made for dense attention")),
                    },
                };
                outs.push(o.reshape((1, t, self.hq * self.hd))?);
                off += t;
            }
            match outs.len() {
                1 => outs.pop().expect("one output"),
                _ => Tensor::cat(&outs, 1)?,
            }
        };
        Ok(self.o.forward(&o)?)
    }

    /// Causal softmax attention, `q [B, T, Hq, D]` at `pos..`, `kh`/`vh [B, Hkv, Tk, D]`
    /// (views of the cache).
    ///
    /// The G query heads of a kv head attend as G·T rows against that kv head's keys, so k and
    /// v are never expanded to Hq heads (at decode that copy was most of the layer's traffic).
    fn dense(&self, q: &Tensor, kh: &Tensor, vh: &Tensor, pos: usize) -> Result<Tensor> {
        let (b, t, _, _) = q.dims4()?;
        if q.device().is_cpu() && q.dtype() == DType::F32 && kh.dtype() == vh.dtype() {
            // on the CPU the cache is read in place by one kernel, each new token over its own
            // prefix, instead of Candle's scores, mask, softmax and weighted sum with their
            // temporaries (SmolLM2 decode at 512 tokens: +25%; prefill 512: about +20%, the
            // masked half of the scores never computed); 16-bit rows are widened in its loads
            let scale = 1.0 / (self.hd as f32).sqrt();
            return Ok(fp8nsa_ops::nsa::causal_attention(q, kh, vh, scale)?);
        }
        // a 16-bit cache's or pool's rows in the queries' type
        let (kh, vh) = (&kh.to_dtype(q.dtype())?, &vh.to_dtype(q.dtype())?);
        let tk = kh.dims()[2];
        let g = self.hq / self.hkv;
        // [B, Hq, T, D] -> [B, Hkv, G·T, D]: head h = kv · G + gi, row gi · T + i
        let qh = q
            .transpose(1, 2)?
            .contiguous()?
            .reshape((b, self.hkv, g * t, self.hd))?;
        let mut s = (qh.matmul(&kh.t()?)? / (self.hd as f64).sqrt())?;
        if t > 1 {
            let mask: Vec<f32> = (0..g * t)
                .flat_map(|row| {
                    let i = row % t;
                    (0..tk).map(move |j| if j > pos + i { f32::NEG_INFINITY } else { 0.0 })
                })
                .collect();
            s = s.broadcast_add(&Tensor::from_vec(mask, (g * t, tk), q.device())?)?;
        }
        let p = candle_nn::ops::softmax_last_dim(&s)?;
        Ok(p.matmul(vh)? // [B, Hkv, G·T, D]
            .reshape((b, self.hq, t, self.hd))?
            .transpose(1, 2)?
            .contiguous()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rope(scaling: serde_json::Value) -> Rope {
        let cfg = LlamaConfig {
            rope_scaling: Some(scaling),
            ..LlamaConfig::tiny()
        };
        Rope::new(&cfg).unwrap()
    }

    fn x() -> Tensor {
        // [B = 1, T = 1, H = 2, D = 64]
        let v: Vec<f32> = (0..128)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
            .collect();
        Tensor::from_vec(v, (1, 1, 2, 64), &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar()
            .unwrap()
    }

    /// Linear scaling by 2 is position interpolation: position 2p rotates as plain RoPE's p.
    #[test]
    fn linear_scaling_interpolates_positions() {
        let plain = rope(serde_json::Value::Null);
        let lin = rope(serde_json::json!({"type": "linear", "factor": 2.0}));
        for p in [1, 7, 300] {
            let d = max_diff(
                &lin.apply(&x(), 2 * p).unwrap(),
                &plain.apply(&x(), p).unwrap(),
            );
            assert!(d < 1e-4, "p = {p}: {d}");
            assert!(max_diff(&lin.apply(&x(), p).unwrap(), &plain.apply(&x(), p).unwrap()) > 1e-2);
        }
    }

    /// A rotation keeps each pair's length; YaRN's tables also carry its attention factor.
    #[test]
    fn yarn_scales_by_its_attention_factor() {
        let yarn = rope(serde_json::json!({"rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 1024}));
        let norm = |t: &Tensor| {
            t.sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        let want = (0.1 * 4f32.ln() + 1.0).powi(2);
        for p in [0, 5, 2000] {
            let r = norm(&yarn.apply(&x(), p).unwrap()) / norm(&x());
            assert!((r - want).abs() < 1e-4 * want, "p = {p}: {r} vs {want}");
        }
    }
}
