//! DeepSeek-V3.2's lightning indexer: which earlier tokens each query attends.

use candle_core::{Module, Tensor};
use candle_nn::LayerNorm;
use fp8nsa_ops::nsa::TokenSelection;

use super::IndexerDims;
use crate::attention::Rope;
use crate::error::Result;
use crate::linear::Linear;

/// V3.2's lightning indexer: one key per token (`LayerNorm(wk(x))`), `heads` queries per
/// token from the query latent, ReLU'd dot products weighted per head by `weights_proj(x)`.
#[derive(Clone, Debug)]
pub(super) struct Indexer {
    pub(super) wq_b: Linear,
    pub(super) wk: Linear,
    pub(super) k_norm: LayerNorm,
    pub(super) weights_proj: Linear,
    pub(super) dims: IndexerDims,
    pub(super) rope_dim: usize,
    /// Half-split pairs (DeepSeek's reference code since Nov 2025), rotated part first.
    pub(super) rope: Rope,
}

impl Indexer {
    /// `[d]` with its first `rope_dim` dimensions rotated, for rows `[1, M, n, d]` at `segs`.
    fn rotate(&self, v: &Tensor, segs: &[(usize, usize)]) -> Result<Tensor> {
        let (_, m, n, d) = v.dims4()?;
        let rd = self.rope_dim;
        let pe = self
            .rope
            .apply_segments(&v.narrow(3, 0, rd)?.contiguous()?, segs)?;
        Ok(Tensor::cat(&[&pe, &v.narrow(3, rd, d - rd)?], 3)?.reshape((m * n, d))?)
    }

    /// The index keys `[M, d]` of `x [1, M, hidden]` at `segs`.
    pub(super) fn keys(&self, x: &Tensor, segs: &[(usize, usize)]) -> Result<Tensor> {
        let (_, m, _) = x.dims3()?;
        let d = self.dims.head_dim;
        let k = self
            .k_norm
            .forward(&self.wk.forward(x)?)?
            .reshape((1, m, 1, d))?;
        self.rotate(&k, segs)
    }

    /// The keys each query of `x [1, T, hidden]` (positions `pos..`, query latent `cq`) keeps
    /// among `keys [pos + T, d]`, or `None` when every query keeps all its causal keys
    /// (`pos + T <= topk`).
    pub(super) fn select(
        &self,
        x: &Tensor,
        cq: &Tensor,
        keys: &Tensor,
        pos: usize,
    ) -> Result<Option<TokenSelection>> {
        let (_, t, _) = x.dims3()?;
        let IndexerDims {
            heads,
            head_dim: d,
            topk,
        } = self.dims;
        if pos + t <= topk {
            return Ok(None);
        }
        let _span = tracing::debug_span!("fp8nsa::dsa_indexer", t, keys = pos + t).entered();
        let q = self.wq_b.forward(cq)?.reshape((1, t, heads, d))?;
        let q = self.rotate(&q, &[(pos, t)])?; // [T · heads, d]
        let wts =
            (self.weights_proj.forward(x)? * ((heads as f64).powf(-0.5) * (d as f64).powf(-0.5)))?;
        let score = fp8nsa_ops::nsa::index_scores(
            &q.reshape((t, heads, d))?,
            &wts.reshape((t, heads))?,
            keys,
        )?;
        let score: Vec<Vec<f32>> = score.to_vec2()?;
        let lists: Vec<Vec<i32>> = score
            .iter()
            .enumerate()
            .map(|(i, sc)| {
                let vis = pos + i + 1;
                let mut keys: Vec<i32> = (0..vis as i32).collect();
                if vis > topk {
                    let by = |a: &i32, b: &i32| {
                        sc[*b as usize].total_cmp(&sc[*a as usize]).then(a.cmp(b))
                    };
                    keys.select_nth_unstable_by(topk - 1, by);
                    keys.truncate(topk);
                }
                keys
            })
            .collect();
        let width = lists.iter().map(Vec::len).max().unwrap_or(1);
        let mut idx = vec![-1i32; t * width];
        for (i, l) in lists.iter().enumerate() {
            idx[i * width..i * width + l.len()].copy_from_slice(l);
        }
        let idx = Tensor::from_vec(idx, (1, t, 1, width), x.device())?;
        Ok(Some(TokenSelection::new(idx)?))
    }
}
