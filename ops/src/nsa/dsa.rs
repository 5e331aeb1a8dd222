//! DeepSeek-V3.2's sparse attention (DSA): the lightning indexer's scores, from which each
//! query keeps its `index_topk` keys (a [`super::TokenSelection`]).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

use crate::error::{shape_err, Error, Result};
use crate::storage::{contiguous, ParkedError};

/// The indexer's scores `[T, Tk]`, `s[i][j] = Σ_h w[i][h] · relu(q[i][h] · k[j])`, for queries
/// `q [T, H, D]`, per-head weights `w [T, H]` and keys `k [Tk, D]` (one head shared by all).
/// DeepSeek's scales (`H^-0.5`, `D^-0.5`) are folded into `w` by the caller; causality is the
/// caller's too. f32 on the CPU runs one pass over the keys
/// ([`fp8nsa_cpu::dsa::index_scores`]); elsewhere the same sum from Candle ops.
///
/// ```
/// use candle_core::{Device, Tensor};
///
/// let dev = Device::Cpu;
/// let q = Tensor::new(&[[[1f32, 0.0], [0.0, 1.0]]], &dev)?; // one query, two heads
/// let w = Tensor::new(&[[1f32, 2.0]], &dev)?;
/// let k = Tensor::new(&[[3f32, -1.0], [-2.0, 5.0]], &dev)?;
/// let s = fp8nsa_ops::nsa::index_scores(&q, &w, &k)?;
/// assert_eq!(s.to_vec2::<f32>()?, [[3.0, 10.0]]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn index_scores(q: &Tensor, w: &Tensor, keys: &Tensor) -> Result<Tensor> {
    let (t, h, d) = q
        .dims3()
        .map_err(|_| shape_err("q", "[T, H, D]", q.dims()))?;
    if w.dims() != [t, h] {
        return Err(shape_err("w", format!("[{t}, {h}]"), w.dims()));
    }
    let tk = match keys.dims() {
        &[tk, kd] if kd == d => tk,
        _ => return Err(shape_err("keys", format!("[Tk, {d}]"), keys.dims())),
    };
    let host = [q, w, keys]
        .iter()
        .all(|x| x.device().is_cpu() && x.dtype() == DType::F32);
    if !host {
        let s = q
            .reshape((t * h, d))?
            .matmul(&keys.t()?)?
            .relu()?
            .reshape((t, h, tk))?;
        return Ok(w.unsqueeze(1)?.matmul(&s)?.squeeze(1)?);
    }
    let op = IndexOp {
        err: ParkedError::new(),
    };
    q.contiguous()?
        .apply_op3_no_bwd(&w.contiguous()?, &keys.contiguous()?, &op)
        .map_err(|e| op.err.or(e))
}

struct IndexOp {
    err: ParkedError,
}

impl CustomOp3 for IndexOp {
    fn name(&self) -> &'static str {
        "fp8nsa-dsa-index-scores"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.err.park((|| {
            let (CpuStorage::F32(q), CpuStorage::F32(w), CpuStorage::F32(k)) = (qs, ws, ks) else {
                return Err(Error::DType {
                    arg: "q",
                    expected: "f32 queries, weights and keys",
                    got: qs.dtype(),
                });
            };
            let (t, h, d) = ql.shape().dims3()?;
            let tk = kl.shape().dims()[0];
            let (q, w, k) = (
                contiguous("q", q, ql)?,
                contiguous("w", w, wl)?,
                contiguous("keys", k, kl)?,
            );
            let mut out = vec![0f32; t * tk];
            fp8nsa_cpu::dsa::index_scores(q, w, k, t, h, d, tk, &mut out)?;
            Ok((CpuStorage::F32(out), Shape::from((t, tk))))
        })())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The host kernel and the Candle-ops path agree (the latter is what other devices run),
    /// on a strided view of keys as a cache holds them; bad shapes are typed errors.
    #[test]
    fn host_kernel_equals_candle_ops_and_bad_shapes_are_errors() {
        let dev = Device::Cpu;
        let (t, h, d, tk) = (3, 4, 40, 300);
        let q = Tensor::randn(0f32, 1.0, (t, h, d), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (t, h), &dev).unwrap();
        let buf = Tensor::randn(0f32, 1.0, (400, d), &dev).unwrap();
        let keys = buf.narrow(0, 0, tk).unwrap();
        let got = index_scores(&q, &w, &keys).unwrap();
        let f64s = |x: &Tensor| x.to_dtype(DType::F64).unwrap();
        let want = index_scores(&f64s(&q), &f64s(&w), &f64s(&keys)).unwrap();
        let diff = (got.to_dtype(DType::F64).unwrap() - &want)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        assert!(diff < 1e-3, "{diff}");
        for (q2, w2, k2, arg) in [
            (q.narrow(0, 0, 2).unwrap(), w.clone(), keys.clone(), "w"),
            (q.clone(), w.clone(), keys.narrow(1, 0, 8).unwrap(), "keys"),
        ] {
            match index_scores(&q2, &w2, &k2) {
                Err(Error::Shape { arg: a, .. }) => assert_eq!(a, arg),
                other => panic!("{other:?}"),
            }
        }
    }
}
