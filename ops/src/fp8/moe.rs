//! `Fp8Moe`: a mixture-of-experts MLP block (Qwen3-MoE / DeepSeek style routing, SwiGLU
//! experts) on the grouped fp8 GEMM.

use candle_core::{DType, Device, Tensor};

use super::Fp8Experts;
use crate::error::{invalid, shape_err, Result};

/// Router, then for each token its `top_k` experts' `down(silu(gate(x)) * up(x))`, weighted by
/// the router's softmax probabilities (renormalized over the chosen `top_k` when
/// `norm_topk_prob`, as Qwen3-MoE sets it). Each projection of all experts is one grouped call
/// ([`Fp8Experts::forward_contiguous`]), with token rows grouped by expert.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use fp8nsa_ops::{ActQuant, Fp8BlockWeight, Fp8Experts, Fp8Moe};
///
/// let (e, h, i, dev) = (4, 8, 16, Device::Cpu);
/// let stack = |n: usize, k: usize| -> Result<Fp8Experts, fp8nsa_ops::Error> {
///     let ws: Vec<Fp8BlockWeight> = (0..e)
///         .map(|s| Fp8BlockWeight::quantize(&Tensor::randn(0f32, 0.1, (n, k), &dev)?, [128, 128]))
///         .collect::<Result<_, _>>()?;
///     Fp8Experts::new(&ws, ActQuant::Group)
/// };
/// let router = Tensor::randn(0f32, 1.0, (e, h), &dev)?;
/// let moe = Fp8Moe::new(router, stack(i, h)?, stack(i, h)?, stack(h, i)?, 2, true)?;
/// let x = Tensor::randn(0f32, 1.0, (3, h), &dev)?;
/// let (experts, weights) = moe.route(&x)?;
/// assert_eq!((experts.len(), weights.len()), (6, 6)); // 2 per token
/// assert!((weights[0] + weights[1] - 1.0).abs() < 1e-6); // renormalized
/// assert_eq!(moe.forward(&x)?.dims(), &[3, h]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct Fp8Moe {
    router: Tensor,
    gate: Fp8Experts,
    up: Fp8Experts,
    down: Fp8Experts,
    top_k: usize,
    norm_topk_prob: bool,
}

impl Fp8Moe {
    /// `router [E, H]` (any float dtype, kept dense as checkpoints keep it), `gate` and `up`
    /// `[E, I, H]`, `down` `[E, H, I]`, `1 <= top_k <= E`.
    pub fn new(
        router: Tensor,
        gate: Fp8Experts,
        up: Fp8Experts,
        down: Fp8Experts,
        top_k: usize,
        norm_topk_prob: bool,
    ) -> Result<Self> {
        let [e, i, h] = gate.shape();
        if router.dims() != [e, h] {
            return Err(shape_err("router", format!("[{e}, {h}]"), router.dims()));
        }
        if up.shape() != [e, i, h] {
            return Err(shape_err("up", format!("[{e}, {i}, {h}]"), &up.shape()));
        }
        if down.shape() != [e, h, i] {
            return Err(shape_err("down", format!("[{e}, {h}, {i}]"), &down.shape()));
        }
        if top_k == 0 || top_k > e {
            return Err(invalid(
                "top_k",
                format!("must be in 1..={e} (the number of experts), got {top_k}"),
            ));
        }
        let router = router.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
        Ok(Self {
            router,
            gate,
            up,
            down,
            top_k,
            norm_topk_prob,
        })
    }

    pub fn top_k(&self) -> usize {
        self.top_k
    }

    pub fn num_experts(&self) -> usize {
        self.gate.num_experts()
    }

    /// For `x [T, H]`: each token's `top_k` experts (highest probability first; ties to the
    /// lower index) and their weights, flattened `[T * top_k]`.
    pub fn route(&self, x: &Tensor) -> Result<(Vec<usize>, Vec<f32>)> {
        let h = self.router.dims()[1];
        if x.rank() != 2 || x.dims()[1] != h {
            return Err(shape_err("x", format!("[T, {h}]"), x.dims()));
        }
        // routing is decided on the host (the grouped call takes host counts)
        let logits = x
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .matmul(&self.router.t()?)?;
        let probs = candle_nn::ops::softmax_last_dim(&logits)?;
        let probs: Vec<Vec<f32>> = probs.to_vec2()?;
        let (mut experts, mut weights) = (Vec::new(), Vec::new());
        for p in probs {
            if p.iter().any(|v| v.is_nan()) {
                return Err(invalid("x", "the router's probabilities are NaN"));
            }
            let mut order: Vec<usize> = (0..p.len()).collect();
            // stable: equal probabilities keep the lower expert first
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
            let chosen = &order[..self.top_k];
            let sum: f32 = chosen.iter().map(|&e| p[e]).sum();
            for &e in chosen {
                experts.push(e);
                weights.push(if self.norm_topk_prob {
                    p[e] / sum
                } else {
                    p[e]
                });
            }
        }
        Ok((experts, weights))
    }

    /// `y [.., H]` for `x [.., H]` (f32, bf16 or f16; computed in f32, returned in x's dtype).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.router.dims()[1];
        if x.dims().last() != Some(&h) || x.elem_count() == 0 {
            return Err(shape_err("x", format!("[.., {h}], not empty"), x.dims()));
        }
        let t = x.elem_count() / h;
        let x2 = x.reshape((t, h))?.to_dtype(DType::F32)?;
        let (experts, weights) = self.route(&x2)?;
        let e = self.gate.num_experts();
        // the (token, slot) pairs grouped by expert, in token order within each expert
        let mut counts = vec![0usize; e];
        for &ex in &experts {
            counts[ex] += 1;
        }
        let mut order: Vec<usize> = (0..experts.len()).collect();
        order.sort_by_key(|&j| experts[j]);
        let rows: Vec<u32> = order.iter().map(|&j| (j / self.top_k) as u32).collect();
        let dev = x.device();
        let rows = Tensor::new(rows.as_slice(), dev)?;
        let xp = x2.index_select(&rows, 0)?;
        let g = self.gate.forward_contiguous(&xp, &counts)?;
        let u = self.up.forward_contiguous(&xp, &counts)?;
        let a = (g.silu()? * u)?;
        let d = self.down.forward_contiguous(&a, &counts)?;
        // each (token, slot) row weighted, then summed into its token in expert order
        let wsorted: Vec<f32> = order.iter().map(|&j| weights[j]).collect();
        let d = d.broadcast_mul(&Tensor::from_vec(wsorted, (order.len(), 1), dev)?)?;
        let out = Tensor::zeros((t, h), DType::F32, dev)?.index_add(&rows, &d, 0)?;
        Ok(out.reshape(x.dims())?.to_dtype(x.dtype())?)
    }
}
