//! Several `Fp8Linear`s over the same input in one call: q, k and v of an attention layer, gate
//! and up of a SwiGLU MLP (vLLM's `QKVParallelLinear` / `MergedColumnParallelLinear` without
//! concatenating the weights: each keeps its own blocks and scales, as loaded from the
//! checkpoint's separate tensors, so each output is exactly what the layer gives alone), and
//! gate and up with SwiGLU's `silu(gate) · up` in the same op.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use fp8nsa_cpu::linear::{FusedPart, LinearPlan};
use fp8nsa_types::LinearShape;

use super::op::host_weight;
use super::Fp8Linear;
use crate::backend::Backend;
use crate::error::{shape_err, Result};
use crate::storage::{f32_slice, from_f32, ParkedError};

impl Fp8Linear {
    /// `layers[i].forward(x)` for every layer, as one call where that pays: on the CPU, when
    /// every layer has the same K blocking and activation scheme, `x` is quantized once
    /// (`fp8nsa_cpu::linear::run_fused`), and in the decode GEMV (at most `GEMV_MAX_M` rows)
    /// all weights' rows are one parallel region. Everywhere else (CUDA, PJRT, mixed schemes)
    /// each layer runs alone. The outputs are the layers' own, bit for bit.
    ///
    /// ```
    /// use candle_core::{Device, Module, Tensor};
    /// use fp8nsa_ops::{ActQuant, Fp8BlockWeight, Fp8Linear};
    ///
    /// let dev = Device::Cpu;
    /// let layer = |n| -> Result<Fp8Linear, Box<dyn std::error::Error>> {
    ///     let w = Tensor::randn(0f32, 1.0, (n, 256), &dev)?;
    ///     Ok(Fp8Linear::new(Fp8BlockWeight::quantize(&w, [128, 128])?, None, ActQuant::Group)?)
    /// };
    /// let (q, k) = (layer(576)?, layer(192)?);
    /// let x = Tensor::randn(0f32, 1.0, (1, 1, 256), &dev)?;
    /// let out = Fp8Linear::forward_fused(&[&q, &k], &x)?;
    /// assert_eq!(out[1].dims(), &[1, 1, 192]);
    /// let alone = k.forward(&x)?;
    /// assert_eq!((&out[1] - alone)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn forward_fused(layers: &[&Fp8Linear], x: &Tensor) -> Result<Vec<Tensor>> {
        match fused_plans(layers, x)? {
            Some(plans) => {
                let m = plans[0].shape().m();
                let last = x.rank() - 1;
                // the layers' outputs one after another: for one row (a decode step) that is
                // x's shape with the widths summed last, and each output one narrow of it;
                // for more rows, runs of m · n to view in x's shape
                let total = plans.iter().map(|p| p.shape().n()).sum();
                let shape = if m == 1 {
                    out_dims(x, total).into()
                } else {
                    Shape::from(m * total)
                };
                let out = run_op(layers, &plans, false, shape, x)?;
                let mut off = 0;
                plans
                    .iter()
                    .map(|p| {
                        let n = p.shape().n();
                        let y = if m == 1 {
                            out.narrow(last, off, n)?
                        } else {
                            out.narrow(0, off * m, m * n)?.reshape(out_dims(x, n))?
                        };
                        off += n;
                        Ok(y)
                    })
                    .collect()
            }
            None => layers.iter().map(|l| l.forward_t(x)).collect(),
        }
    }

    /// `silu(gate(x)) · up(x)`, the first half of a SwiGLU MLP, for `gate` and `up` of one
    /// output width. On the CPU with f32 `x` and layers that fuse as in [`Self::forward_fused`],
    /// one op (`fp8nsa_cpu::linear::run_swiglu`: gate and up as [`Self::forward_fused`] runs
    /// them, into a reused buffer, then the product, so no tensor is made for either);
    /// everywhere else [`crate::silu_mul`] of [`Self::forward_fused`]'s two outputs. The same
    /// bits either way.
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use fp8nsa_ops::{ActQuant, Fp8BlockWeight, Fp8Linear};
    ///
    /// let dev = Device::Cpu;
    /// let layer = |n| -> Result<Fp8Linear, Box<dyn std::error::Error>> {
    ///     let w = Tensor::randn(0f32, 1.0, (n, 256), &dev)?;
    ///     Ok(Fp8Linear::new(Fp8BlockWeight::quantize(&w, [128, 128])?, None, ActQuant::Group)?)
    /// };
    /// let (gate, up) = (layer(1536)?, layer(1536)?);
    /// let x = Tensor::randn(0f32, 1.0, (1, 1, 256), &dev)?;
    /// let y = Fp8Linear::forward_swiglu(&gate, &up, &x)?;
    /// let want = fp8nsa_ops::silu_mul(&gate.forward_t(&x)?, &up.forward_t(&x)?)?;
    /// assert_eq!((y - want)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
    /// assert!(Fp8Linear::forward_swiglu(&gate, &layer(576)?, &x).is_err()); // widths differ
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn forward_swiglu(gate: &Fp8Linear, up: &Fp8Linear, x: &Tensor) -> Result<Tensor> {
        let n = gate.weight().shape()[0];
        if up.weight().shape()[0] != n {
            return Err(shape_err(
                "up",
                format!("gate's {n} output features"),
                &up.weight().shape(),
            ));
        }
        let layers = [gate, up];
        match fused_plans(&layers, x)? {
            Some(plans) if x.dtype() == DType::F32 => {
                run_op(&layers, &plans, true, out_dims(x, n).into(), x)
            }
            _ => match &Self::forward_fused(&layers, x)?[..] {
                [g, u] => crate::silu_mul(g, u),
                _ => unreachable!("forward_fused gives one output per layer"),
            },
        }
    }
}

/// `x`'s dimensions with `n` last.
fn out_dims(x: &Tensor, n: usize) -> Vec<usize> {
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("x was checked to have a last dim") = n;
    dims
}

/// The fused CPU op over `x`'s rows of K (read in place, whatever x's rank; `plans` from
/// [`fused_plans`]): every layer's output one after another, or with `swiglu` the product of
/// the two, given the caller's `shape`.
fn run_op(
    layers: &[&Fp8Linear],
    plans: &[LinearPlan],
    swiglu: bool,
    shape: Shape,
    x: &Tensor,
) -> Result<Tensor> {
    let op = FusedOp {
        layers,
        plans,
        swiglu,
        shape,
        err: ParkedError::new(),
    };
    x.contiguous()?
        .apply_op1_no_bwd(&op)
        .map_err(|e| op.err.or(e))
}

/// The CPU plans of a fused call, or `None` where the layers run one by one.
fn fused_plans(layers: &[&Fp8Linear], x: &Tensor) -> Result<Option<Vec<LinearPlan>>> {
    let Some(first) = layers.first() else {
        return Ok(None);
    };
    let k = first.weight().shape()[1];
    if x.dims().last() != Some(&k) || x.elem_count() == 0 {
        return Err(shape_err(
            "x",
            format!("[.., {k}] with at least one row"),
            x.dims(),
        ));
    }
    let on_cpu = x.device().is_cpu()
        && matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && layers.iter().all(|l| l.weight().device().is_cpu());
    if layers.len() < 2 || !on_cpu {
        return Ok(None);
    }
    for l in layers {
        if !matches!(l.backend_resolved()?, Backend::Auto | Backend::Cpu) {
            return Ok(None);
        }
    }
    let m = x.elem_count() / k;
    let mut plans = Vec::with_capacity(layers.len());
    for l in layers {
        let [n, kl] = l.weight().shape();
        let [bn, bk] = l.weight().block();
        if kl != k || bk != first.weight().block()[1] || l.act() != first.act() {
            return Ok(None);
        }
        // `run_fused` checks that the plans share a kernel (and runs them alone where not)
        plans.push(fp8nsa_cpu::linear::plan(
            LinearShape::new(m, n, k, bn, bk)?,
            l.act(),
        )?);
    }
    Ok(Some(plans))
}

struct FusedOp<'a> {
    layers: &'a [&'a Fp8Linear],
    plans: &'a [LinearPlan],
    /// Two layers, gate and up: the op's output is `silu(gate) · up` (`run_swiglu`) instead
    /// of every layer's output one after another.
    swiglu: bool,
    /// The output's shape, as the caller views it.
    shape: Shape,
    err: ParkedError,
}

impl CustomOp1 for FusedOp<'_> {
    fn name(&self) -> &'static str {
        "fp8nsa-fp8-linear-fused"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.err.park((|| {
            let x = f32_slice("x", xs, xl)?;
            let guards: Vec<_> = self
                .layers
                .iter()
                .map(|l| {
                    (
                        l.weight().data().storage_and_layout(),
                        l.weight().scales().storage_and_layout(),
                    )
                })
                .collect();
            let mut host = Vec::with_capacity(guards.len());
            for ((data, dl), (scales, sl)) in &guards {
                host.push(host_weight(data, dl, scales, sl)?);
            }
            let parts: Vec<FusedPart> = self
                .layers
                .iter()
                .zip(self.plans)
                .zip(&host)
                .map(|((l, p), (codes, scales))| FusedPart {
                    plan: p.assume_nan_free(l.weight().nan_free(codes)),
                    w: codes,
                    sw: scales,
                    bias: l.bias_host(),
                })
                .collect();
            if let (true, [gate, up]) = (self.swiglu, &parts[..]) {
                let mut out = vec![0f32; gate.plan.shape().m() * gate.plan.shape().n()];
                fp8nsa_cpu::linear::run_swiglu(&x, *gate, *up, &mut out)?;
                return Ok((from_f32(out, xs.dtype()), self.shape.clone()));
            }
            let sizes: Vec<usize> = self
                .plans
                .iter()
                .map(|p| p.shape().m() * p.shape().n())
                .collect();
            let total = sizes.iter().sum();
            let mut out = vec![0f32; total];
            let mut outs: Vec<&mut [f32]> = Vec::with_capacity(sizes.len());
            let mut rest = &mut out[..];
            for &s in &sizes {
                let (a, b) = rest.split_at_mut(s);
                outs.push(a);
                rest = b;
            }
            fp8nsa_cpu::linear::run_fused(&x, &parts, &mut outs)?;
            Ok((from_f32(out, xs.dtype()), self.shape.clone()))
        })())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ActQuant, Fp8BlockWeight};
    use candle_core::Device;

    /// Each fused output equals its layer alone, bit for bit and in x's shape with the layer's
    /// width last: one row (outputs narrowed from one row of the summed widths) in two ranks,
    /// several rows (runs of the flat output) with leading dimensions of 1 and above, widths
    /// that are not multiples of the row blocking.
    #[test]
    fn fused_outputs_are_each_layer_alone() {
        let dev = Device::Cpu;
        let k = 300;
        let layers: Vec<Fp8Linear> = [576usize, 192, 37]
            .iter()
            .map(|&n| {
                let w = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap();
                let w = Fp8BlockWeight::quantize(&w, [128, 128]).unwrap();
                Fp8Linear::new(w, None, ActQuant::Group).unwrap()
            })
            .collect();
        let refs: Vec<&Fp8Linear> = layers.iter().collect();
        let shapes: [&[usize]; 5] = [&[1, 1, k], &[k], &[1, 5, k], &[2, 3, k], &[17, k]];
        for &shape in &shapes {
            let x = Tensor::randn(0f32, 1.0, shape, &dev).unwrap();
            let fused = Fp8Linear::forward_fused(&refs, &x).unwrap();
            for (l, y) in layers.iter().zip(&fused) {
                let alone = l.forward_t(&x).unwrap();
                assert_eq!(y.dims(), alone.dims(), "{shape:?}");
                let bits = |t: &Tensor| {
                    let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                };
                assert_eq!(bits(y), bits(&alone), "{shape:?}");
            }
        }
    }
}
