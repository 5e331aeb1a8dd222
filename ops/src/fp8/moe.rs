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
    router: MoeRouter,
    gate: Fp8Experts,
    up: Fp8Experts,
    down: Fp8Experts,
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
        Ok(Self {
            router: MoeRouter::new(router, top_k, norm_topk_prob)?,
            gate,
            up,
            down,
        })
    }

    /// [`Self::new`] with a router built apart (e.g. [`MoeRouter::sigmoid_grouped`] for
    /// DeepSeek-V3), whose expert count and hidden size must match the experts'.
    pub fn with_router(
        router: MoeRouter,
        gate: Fp8Experts,
        up: Fp8Experts,
        down: Fp8Experts,
    ) -> Result<Self> {
        let (top_k, norm) = (router.top_k, router.norm_topk_prob);
        let mut moe = Self::new(router.weight.clone(), gate, up, down, top_k, norm)?;
        moe.router = router;
        Ok(moe)
    }

    pub fn top_k(&self) -> usize {
        self.router.top_k
    }

    pub fn num_experts(&self) -> usize {
        self.gate.num_experts()
    }

    pub fn router(&self) -> &MoeRouter {
        &self.router
    }

    /// For `x [T, H]`: each token's `top_k` experts (highest probability first; ties to the
    /// lower index) and their weights, flattened `[T * top_k]`.
    pub fn route(&self, x: &Tensor) -> Result<(Vec<usize>, Vec<f32>)> {
        self.router.route(x)
    }

    /// `y [.., H]` for `x [.., H]` (f32, bf16 or f16; computed in f32, returned in x's dtype).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (x2, r) = self.router.group(x)?;
        let xp = x2.index_select(&r.rows, 0)?;
        let g = self.gate.forward_contiguous(&xp, &r.counts)?;
        let u = self.up.forward_contiguous(&xp, &r.counts)?;
        let a = crate::silu_mul(&g, &u)?;
        let d = self.down.forward_contiguous(&a, &r.counts)?;
        Ok(r.combine(&d)?.reshape(x.dims())?.to_dtype(x.dtype())?)
    }
}

/// Token-choice top-k routing: by default (Qwen3-MoE) softmax over `router [E, H] . x`, each
/// token's `top_k` most probable experts, their probabilities as weights (renormalized over the
/// chosen `top_k` when `norm_topk_prob`); DeepSeek-V3's sigmoid, group-limited choice is
/// [`MoeRouter::sigmoid_grouped`]. Shared by [`Fp8Moe`] and any other expert
/// implementation (a dense baseline), so both route identically.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use fp8nsa_ops::MoeRouter;
///
/// // expert 1 scores highest for the token, then expert 2
/// let router = Tensor::new(&[[0f32, 0.0], [2.0, 0.0], [1.0, 0.0]], &Device::Cpu)?;
/// let r = MoeRouter::new(router, 2, true)?;
/// let (experts, weights) = r.route(&Tensor::new(&[[1f32, 5.0]], &Device::Cpu)?)?;
/// assert_eq!(experts, [1, 2]);
/// assert!((weights[0] + weights[1] - 1.0).abs() < 1e-6 && weights[0] > weights[1]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct MoeRouter {
    /// `[E, H]` f32 on the host: routing is decided there.
    weight: Tensor,
    top_k: usize,
    norm_topk_prob: bool,
    scoring: Scoring,
}

/// How a router turns its logits into a choice and weights.
#[derive(Clone, Debug, PartialEq)]
enum Scoring {
    /// Softmax over all experts; the `top_k` most probable.
    Softmax,
    /// DeepSeek-V3's `noaux_tc`: see [`MoeRouter::sigmoid_grouped`].
    SigmoidGrouped {
        bias: Vec<f32>,
        n_group: usize,
        topk_group: usize,
        scaling: f32,
    },
}

/// A batch's rows grouped by expert: what one grouped call per projection takes.
#[derive(Clone, Debug)]
pub struct Routing {
    /// Rows per expert, `[E]`.
    pub counts: Vec<usize>,
    /// The token of each grouped row, `[T * top_k]` u32 on the input's device.
    pub rows: Tensor,
    /// The routing weight of each grouped row.
    pub weights: Vec<f32>,
    /// Tokens in the batch.
    pub tokens: usize,
}

impl Routing {
    /// `[T, H]` f32: each grouped row of `y [T * top_k, H]` times its weight, summed into its
    /// token (in expert order).
    pub fn combine(&self, y: &Tensor) -> Result<Tensor> {
        let dev = y.device();
        let n = self.weights.len();
        if y.rank() != 2 || y.dims()[0] != n {
            return Err(shape_err("y", format!("[{n}, H]"), y.dims()));
        }
        let w = Tensor::from_vec(self.weights.clone(), (n, 1), dev)?;
        let y = y.to_dtype(DType::F32)?.broadcast_mul(&w)?;
        let h = y.dims()[1];
        Ok(Tensor::zeros((self.tokens, h), DType::F32, dev)?.index_add(&self.rows, &y, 0)?)
    }
}

/// The `k` entries of `among` with the largest `v`, largest first, ties to the lower index.
fn best(v: &[f32], mut among: Vec<usize>, k: usize) -> Vec<usize> {
    among.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    among.truncate(k);
    among
}

impl MoeRouter {
    /// `weight [E, H]` (any float dtype, any device), `1 <= top_k <= E`.
    pub fn new(weight: Tensor, top_k: usize, norm_topk_prob: bool) -> Result<Self> {
        if weight.rank() != 2 {
            return Err(shape_err("router", "[E, H]", weight.dims()));
        }
        let e = weight.dims()[0];
        if top_k == 0 || top_k > e {
            return Err(invalid(
                "top_k",
                format!("must be in 1..={e} (the number of experts), got {top_k}"),
            ));
        }
        Ok(Self {
            weight: weight.to_device(&Device::Cpu)?.to_dtype(DType::F32)?,
            top_k,
            norm_topk_prob,
            scoring: Scoring::Softmax,
        })
    }

    /// DeepSeek-V3's router (`scoring_func: sigmoid`, `topk_method: noaux_tc`): scores
    /// `sigmoid(router . x)`; the choice adds `bias` (`e_score_correction_bias`, `[E]`) to them,
    /// splits the experts into `n_group` equal groups, ranks each group by the sum of its two
    /// best biased scores, keeps the `topk_group` best groups and picks the `top_k` best biased
    /// scores among their experts (ties to the lower index throughout). The weights are the
    /// picks' unbiased scores, divided by their sum when `norm_topk_prob`, times
    /// `routed_scaling_factor`.
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use fp8nsa_ops::MoeRouter;
    ///
    /// let dev = Device::Cpu;
    /// // four experts in two groups; the token's logits are the router's rows
    /// let router = Tensor::new(&[[1f32], [0.5], [-1.0], [2.0]], &dev)?;
    /// let bias = Tensor::new(&[0f32, 0.0, 3.0, 0.0], &dev)?;
    /// let r = MoeRouter::sigmoid_grouped(router, 2, true, bias, 2, 1, 2.5)?;
    /// let (experts, weights) = r.route(&Tensor::new(&[[1f32]], &dev)?)?;
    /// // the bias makes group {2, 3} win and expert 2 the first pick; its weight is unbiased
    /// assert_eq!(experts, [2, 3]);
    /// let s = |x: f32| 1.0 / (1.0 + (-x).exp());
    /// assert!((weights[0] - 2.5 * s(-1.0) / (s(-1.0) + s(2.0))).abs() < 1e-6);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn sigmoid_grouped(
        weight: Tensor,
        top_k: usize,
        norm_topk_prob: bool,
        bias: Tensor,
        n_group: usize,
        topk_group: usize,
        routed_scaling_factor: f32,
    ) -> Result<Self> {
        let mut r = Self::new(weight, top_k, norm_topk_prob)?;
        let e = r.num_experts();
        if bias.dims() != [e] {
            return Err(shape_err(
                "e_score_correction_bias",
                format!("[{e}]"),
                bias.dims(),
            ));
        }
        let bias: Vec<f32> = bias.to_dtype(DType::F32)?.to_vec1()?;
        if bias.iter().any(|b| !b.is_finite()) {
            return Err(invalid("e_score_correction_bias", "must be finite"));
        }
        if n_group == 0 || !e.is_multiple_of(n_group) {
            return Err(invalid(
                "n_group",
                format!("must divide the {e} experts, got {n_group}"),
            ));
        }
        if topk_group == 0 || topk_group > n_group {
            return Err(invalid(
                "topk_group",
                format!("must be in 1..={n_group} (n_group), got {topk_group}"),
            ));
        }
        if top_k > topk_group * (e / n_group) {
            return Err(invalid(
                "top_k",
                format!(
                    "{top_k} experts cannot come from {topk_group} groups of {}",
                    e / n_group
                ),
            ));
        }
        if !(routed_scaling_factor.is_finite() && routed_scaling_factor > 0.0) {
            return Err(invalid(
                "routed_scaling_factor",
                format!("must be finite and > 0, got {routed_scaling_factor}"),
            ));
        }
        r.scoring = Scoring::SigmoidGrouped {
            bias,
            n_group,
            topk_group,
            scaling: routed_scaling_factor,
        };
        Ok(r)
    }

    pub fn num_experts(&self) -> usize {
        self.weight.dims()[0]
    }

    /// The hidden size `H` the router scores.
    pub fn hidden(&self) -> usize {
        self.weight.dims()[1]
    }

    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// For `x [T, H]`: each token's `top_k` experts (highest probability first; ties to the
    /// lower index) and their weights, flattened `[T * top_k]`.
    pub fn route(&self, x: &Tensor) -> Result<(Vec<usize>, Vec<f32>)> {
        let h = self.weight.dims()[1];
        if x.rank() != 2 || x.dims()[1] != h {
            return Err(shape_err("x", format!("[T, {h}]"), x.dims()));
        }
        // routing is decided on the host (the grouped calls take host counts)
        let logits = x
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .matmul(&self.weight.t()?)?;
        let (mut experts, mut weights) = (Vec::new(), Vec::new());
        match &self.scoring {
            Scoring::Softmax => {
                let probs = candle_nn::ops::softmax_last_dim(&logits)?;
                for p in probs.to_vec2::<f32>()? {
                    if p.iter().any(|v| v.is_nan()) {
                        return Err(invalid("x", "the router's probabilities are NaN"));
                    }
                    let chosen = best(&p, (0..p.len()).collect(), self.top_k);
                    let sum: f32 = chosen.iter().map(|&e| p[e]).sum();
                    for e in chosen {
                        experts.push(e);
                        weights.push(if self.norm_topk_prob {
                            p[e] / sum
                        } else {
                            p[e]
                        });
                    }
                }
            }
            Scoring::SigmoidGrouped {
                bias,
                n_group,
                topk_group,
                scaling,
            } => {
                for l in logits.to_vec2::<f32>()? {
                    if l.iter().any(|v| v.is_nan()) {
                        return Err(invalid("x", "the router's scores are NaN"));
                    }
                    let score: Vec<f32> = l.iter().map(|&v| 1.0 / (1.0 + (-v).exp())).collect();
                    let choice: Vec<f32> = score.iter().zip(bias).map(|(s, b)| s + b).collect();
                    let size = choice.len() / n_group;
                    let group_score: Vec<f32> = choice
                        .chunks(size)
                        .map(|g| {
                            let top = best(g, (0..g.len()).collect(), 2.min(g.len()));
                            top.iter().map(|&i| g[i]).sum()
                        })
                        .collect();
                    let groups = best(&group_score, (0..*n_group).collect(), *topk_group);
                    let candidates: Vec<usize> = groups
                        .iter()
                        .flat_map(|&g| g * size..(g + 1) * size)
                        .collect();
                    let chosen = best(&choice, candidates, self.top_k);
                    let sum: f32 = chosen.iter().map(|&e| score[e]).sum();
                    for e in chosen {
                        experts.push(e);
                        let w = if self.norm_topk_prob {
                            score[e] / (sum + 1e-20)
                        } else {
                            score[e]
                        };
                        weights.push(w * scaling);
                    }
                }
            }
        }
        Ok((experts, weights))
    }

    /// `x [.., H]` as `[T, H]` f32 on its device, and its rows grouped by expert (in token
    /// order within each expert).
    pub fn group(&self, x: &Tensor) -> Result<(Tensor, Routing)> {
        let h = self.weight.dims()[1];
        if x.dims().last() != Some(&h) || x.elem_count() == 0 {
            return Err(shape_err("x", format!("[.., {h}], not empty"), x.dims()));
        }
        let t = x.elem_count() / h;
        let x2 = x.reshape((t, h))?.to_dtype(DType::F32)?;
        let (experts, weights) = self.route(&x2)?;
        let mut counts = vec![0usize; self.num_experts()];
        for &ex in &experts {
            counts[ex] += 1;
        }
        let mut order: Vec<usize> = (0..experts.len()).collect();
        order.sort_by_key(|&j| experts[j]);
        let rows: Vec<u32> = order.iter().map(|&j| (j / self.top_k) as u32).collect();
        let routing = Routing {
            counts,
            rows: Tensor::new(rows.as_slice(), x.device())?,
            weights: order.iter().map(|&j| weights[j]).collect(),
            tokens: t,
        };
        Ok((x2, routing))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    /// DeepSeek-V3's routing recomputed in f64 from the same inputs, written from the rule
    /// (not from the code above): `(experts, weights, margin)`, where `margin` is the smallest
    /// gap between two values a decision compared, so that near-ties (where f32 and f64 may
    /// rightly disagree) can be left out.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        w: &[f32],
        x: &[f32],
        h: usize,
        bias: &[f32],
        n_group: usize,
        topk_group: usize,
        top_k: usize,
        norm: bool,
        scaling: f64,
    ) -> (Vec<usize>, Vec<f64>, f64) {
        let e = bias.len();
        let score: Vec<f64> = (0..e)
            .map(|i| {
                let l: f64 = (0..h).map(|j| w[i * h + j] as f64 * x[j] as f64).sum();
                1.0 / (1.0 + (-l).exp())
            })
            .collect();
        let choice: Vec<f64> = (0..e).map(|i| score[i] + bias[i] as f64).collect();
        let mut margin = f64::INFINITY;
        // the k best of `among` by `v`, and the gap at the cut and between the kept
        let mut pick = |v: &[f64], mut among: Vec<usize>, k: usize| -> Vec<usize> {
            among.sort_by(|&a, &b| v[b].total_cmp(&v[a]));
            for p in among.windows(2).take(k) {
                margin = margin.min(v[p[0]] - v[p[1]]);
            }
            among.truncate(k);
            among
        };
        let size = e / n_group;
        let group_score: Vec<f64> = (0..n_group)
            .map(|g| {
                let top = pick(&choice, (g * size..(g + 1) * size).collect(), 2);
                top.iter().map(|&i| choice[i]).sum()
            })
            .collect();
        let groups = pick(&group_score, (0..n_group).collect(), topk_group);
        let candidates: Vec<usize> = groups
            .iter()
            .flat_map(|&g| g * size..(g + 1) * size)
            .collect();
        let chosen = pick(&choice, candidates, top_k);
        let sum: f64 = chosen.iter().map(|&i| score[i]).sum();
        let weights = chosen
            .iter()
            .map(|&i| scaling * if norm { score[i] / sum } else { score[i] })
            .collect();
        (chosen, weights, margin)
    }

    /// The grouped sigmoid router against the f64 rule over many random tokens, with biases
    /// large enough to change choices and a group limit that binds: the same experts in the
    /// same order and the same weights, wherever the rule has no near-tie.
    #[test]
    fn sigmoid_grouped_routing_matches_the_f64_rule() {
        let mut rng = fp8nsa_test_support::rng("moe_sigmoid_grouped");
        let (e, h, n_group, topk_group, top_k, scaling) = (16, 24, 4, 2, 4, 2.5f32);
        let w: Vec<f32> = (0..e * h).map(|_| rng.random_range(-0.5..0.5)).collect();
        let bias: Vec<f32> = (0..e).map(|_| rng.random_range(-0.3..0.3)).collect();
        let dev = Device::Cpu;
        let wt = Tensor::from_vec(w.clone(), (e, h), &dev).unwrap();
        let bt = Tensor::from_vec(bias.clone(), e, &dev).unwrap();
        let (mut checked, mut bias_changed, mut limit_bound) = (0, 0, 0);
        for norm in [true, false] {
            let r = MoeRouter::sigmoid_grouped(
                wt.clone(),
                top_k,
                norm,
                bt.clone(),
                n_group,
                topk_group,
                scaling,
            )
            .unwrap();
            for _ in 0..300 {
                let x: Vec<f32> = (0..h).map(|_| rng.random_range(-1.0..1.0)).collect();
                let (want, want_w, margin) = reference(
                    &w,
                    &x,
                    h,
                    &bias,
                    n_group,
                    topk_group,
                    top_k,
                    norm,
                    scaling as f64,
                );
                if margin < 1e-4 {
                    continue;
                }
                checked += 1;
                let (got, got_w) = r
                    .route(&Tensor::from_vec(x.clone(), (1, h), &dev).unwrap())
                    .unwrap();
                assert_eq!(got, want, "norm {norm}, x {x:?}");
                for (g, w) in got_w.iter().zip(&want_w) {
                    assert!(
                        (*g as f64 - w).abs() < 1e-5 * w.abs().max(1.0),
                        "{got_w:?} vs {want_w:?}"
                    );
                }
                // what the test covers: the bias moved a pick, and the group limit kept out an
                // expert the ungrouped choice would take
                let (no_bias, _, _) = reference(
                    &w,
                    &x,
                    h,
                    &vec![0.0; e],
                    n_group,
                    topk_group,
                    top_k,
                    norm,
                    1.0,
                );
                bias_changed += usize::from(no_bias != want);
                let (no_limit, _, _) =
                    reference(&w, &x, h, &bias, n_group, n_group, top_k, norm, 1.0);
                limit_bound += usize::from(no_limit != want);
            }
        }
        assert!(
            checked >= 500,
            "only {checked} of 600 tokens without a near-tie"
        );
        assert!(
            bias_changed >= 50 && limit_bound >= 50,
            "bias {bias_changed}, limit {limit_bound}"
        );
    }
}
