//! `Fp8Experts`: the weights of one projection of every expert of a mixture-of-experts layer,
//! called once per layer with the tokens routed to them (grouped fp8 GEMM).

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};
use fp8nsa_cpu::experts::{grouped, ExpertWeights};
use fp8nsa_types::ExpertsShape;
use fp8nsa_types::{CudaFp8Kernel, Settings};

use super::experts_cuda::{self as cuda, CudaExperts};

use super::weight::host_bytes;
use super::{ActQuant, Fp8BlockWeight};
use crate::error::{invalid, shape_err, Error, Result};

/// `E` experts' `[N, K]` fp8 weights with the same block size, stored together (`[E, N, K]`
/// codes, `[E, ceil(N/bn), ceil(K/bk)]` scales), and the activation scheme of their calls.
///
/// Two call shapes, as DeepGEMM has them: [`Fp8Experts::forward_contiguous`] (token rows
/// grouped by expert, prefill) and [`Fp8Experts::forward_masked`] (a fixed-size slot of rows per
/// expert with a count of valid ones, decode). Both run as one grouped call: at decode every
/// routed expert's GEMV is a task of one parallel region, one pass over its weight rows. On
/// CUDA (`cuda` feature) each call is one launch of fp8nsa-cuda's grouped kernel for all
/// experts (the experts are uploaded once per device, on first use). PJRT tensors get
/// `Error::Unsupported`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use fp8nsa_ops::{ActQuant, Fp8BlockWeight, Fp8Experts};
///
/// let dev = Device::Cpu;
/// let experts: Vec<Fp8BlockWeight> = (0..4)
///     .map(|e| Fp8BlockWeight::quantize(&Tensor::full(e as f32 + 1.0, (3, 8), &dev)?, [128, 128]))
///     .collect::<Result<_, _>>()?;
/// let layer = Fp8Experts::new(&experts, ActQuant::Group)?;
/// let x = Tensor::ones((3, 8), candle_core::DType::F32, &dev)?;
/// // rows 0 and 1 to expert 1, row 2 to expert 3
/// let y = layer.forward_contiguous(&x, &[0, 2, 0, 1])?.to_vec2::<f32>()?;
/// let close = |row: &[f32], v: f32| row.iter().all(|y| (y - v).abs() < 1e-4 * v);
/// assert!(close(&y[0], 16.0) && close(&y[1], 16.0)); // 8 ones times 2
/// assert!(close(&y[2], 32.0)); // 8 ones times 4
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct Fp8Experts {
    codes: Arc<[u8]>,
    scales: Arc<[f32]>,
    shape: ExpertsShape,
    act: ActQuant,
    /// No code of any expert is NaN: the decode GEMV may skip its check.
    nan_free: bool,
    cuda_kernel: Option<CudaFp8Kernel>,
    /// The experts laid out for one CUDA device, made on the first call there.
    cuda: Arc<Mutex<Option<Arc<CudaExperts>>>>,
}

impl Fp8Experts {
    /// Stacks `experts` (at least one, all of the same shape and block size).
    pub fn new(experts: &[Fp8BlockWeight], act: ActQuant) -> Result<Self> {
        act.validate()?;
        let first = experts
            .first()
            .ok_or_else(|| invalid("experts", "needs at least one expert"))?;
        let ([n, k], [bn, bk]) = (first.shape(), first.block());
        let shape = ExpertsShape::new(experts.len(), n, k, bn, bk)?;
        let mut codes = Vec::with_capacity(shape.e() * n * k);
        let mut scales = Vec::with_capacity(shape.e() * shape.scales_per_expert());
        let mut nan_free = true;
        for (i, w) in experts.iter().enumerate() {
            if w.shape() != [n, k] || w.block() != [bn, bk] {
                return Err(invalid(
                    "experts",
                    format!(
                        "expert {i} is {:?} in {:?} blocks, expert 0 is [{n}, {k}] in [{bn}, {bk}]",
                        w.shape(),
                        w.block()
                    ),
                ));
            }
            let bytes = host_bytes("experts", w.data())?;
            // each weight's own (cached) answer
            nan_free &= w.nan_free(&bytes);
            codes.extend(bytes);
            scales.extend(
                w.scales()
                    .to_device(&Device::Cpu)?
                    .flatten_all()?
                    .to_vec1::<f32>()?,
            );
        }
        Ok(Self {
            nan_free,
            codes: codes.into(),
            scales: scales.into(),
            shape,
            act,
            cuda_kernel: None,
            cuda: Arc::default(),
        })
    }

    /// The CUDA kernel of the grouped call (default: `FP8NSA_CUDA_FP8_KERNEL`, else `Auto`):
    /// `SmallM` or `Mma` force one; cuBLASLt and dequantize have no grouped form.
    pub fn with_cuda_kernel(mut self, kernel: CudaFp8Kernel) -> Self {
        self.cuda_kernel = Some(kernel);
        self
    }

    fn weights(&self) -> ExpertWeights<'_> {
        ExpertWeights {
            codes: &self.codes,
            scales: &self.scales,
            nan_free: self.nan_free,
        }
    }

    pub fn num_experts(&self) -> usize {
        self.shape.e()
    }

    /// `[E, N, K]`.
    pub fn shape(&self) -> [usize; 3] {
        [self.shape.e(), self.shape.n(), self.shape.k()]
    }

    pub fn act(&self) -> ActQuant {
        self.act
    }

    fn check_x(&self, x: &Tensor, rank: usize) -> Result<()> {
        if !matches!(x.device(), Device::Cpu | Device::Cuda(_)) {
            return Err(Error::Unsupported {
                op: "fp8-experts",
                device: format!("{:?}", x.device()),
                hint: "the grouped expert GEMM runs on the CPU and CUDA",
            });
        }
        if !matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::DType {
                arg: "x",
                expected: "f32, bf16 or f16",
                got: x.dtype(),
            });
        }
        if x.rank() != rank || x.dims().last() != Some(&self.shape.k()) {
            let want = if rank == 2 { "[T, K]" } else { "[E, M, K]" };
            return Err(shape_err(
                "x",
                format!("{want} with K = {}", self.shape.k()),
                x.dims(),
            ));
        }
        Ok(())
    }

    fn check_counts(&self, counts: &[usize]) -> Result<()> {
        if counts.len() != self.shape.e() {
            return Err(invalid(
                "counts",
                format!(
                    "needs one count per expert ({}), got {}",
                    self.shape.e(),
                    counts.len()
                ),
            ));
        }
        Ok(())
    }

    /// `y [T, N]` for `x [T, K]` whose rows are grouped by expert: expert `e` takes the next
    /// `counts[e]` rows (counts sum to `T`; zeros allowed; `T = 0` gives an empty `y`).
    pub fn forward_contiguous(&self, x: &Tensor, counts: &[usize]) -> Result<Tensor> {
        self.check_x(x, 2)?;
        self.check_counts(counts)?;
        let t = x.dims()[0];
        let sum = counts.iter().try_fold(0usize, |a, &c| a.checked_add(c));
        if sum != Some(t) {
            return Err(invalid(
                "counts",
                format!("must sum to the {t} rows of x, got {counts:?}"),
            ));
        }
        if t == 0 {
            return Ok(Tensor::zeros((0, self.shape.n()), x.dtype(), x.device())?);
        }
        if x.device().is_cuda() {
            return self.cuda_contiguous(x, counts);
        }
        let xs = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let mut out = vec![0f32; t * self.shape.n()];
        grouped(&xs, counts, self.weights(), self.shape, self.act, &mut out)?;
        Ok(Tensor::from_vec(out, (t, self.shape.n()), &Device::Cpu)?.to_dtype(x.dtype())?)
    }

    /// `y [E, M, N]` for `x [E, M, K]`: expert `e` takes rows `0..counts[e]` of its slot;
    /// the other rows of `y` are zero.
    pub fn forward_masked(&self, x: &Tensor, counts: &[usize]) -> Result<Tensor> {
        self.check_x(x, 3)?;
        self.check_counts(counts)?;
        let (e, m, k, n) = (self.shape.e(), x.dims()[1], self.shape.k(), self.shape.n());
        if x.dims()[0] != e {
            return Err(shape_err("x", format!("[{e}, M, {k}]"), x.dims()));
        }
        if let Some((i, &c)) = counts.iter().enumerate().find(|(_, &c)| c > m) {
            return Err(invalid(
                "counts",
                format!("expert {i} has {c} rows, more than the slot of {m}"),
            ));
        }
        if x.device().is_cuda() {
            // the valid rows packed by expert, through the contiguous call, back to their slots
            let rows: Vec<u32> = counts
                .iter()
                .enumerate()
                .flat_map(|(i, &c)| (0..c).map(move |r| (i * m + r) as u32))
                .collect();
            let flat = x.reshape((e * m, k))?;
            let zeros = Tensor::zeros((e * m, n), x.dtype(), x.device())?;
            if rows.is_empty() {
                return Ok(zeros.reshape((e, m, n))?);
            }
            let idx = Tensor::new(rows.as_slice(), x.device())?;
            let y = self.cuda_contiguous(&flat.index_select(&idx, 0)?, counts)?;
            return Ok(zeros.index_add(&idx, &y, 0)?.reshape((e, m, n))?);
        }
        let xs = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let t: usize = counts.iter().sum();
        let mut out = vec![0f32; e * m * n];
        if t > 0 {
            let packed: Vec<f32> = counts
                .iter()
                .enumerate()
                .flat_map(|(i, &c)| &xs[i * m * k..(i * m + c) * k])
                .copied()
                .collect();
            let mut y = vec![0f32; t * n];
            grouped(
                &packed,
                counts,
                self.weights(),
                self.shape,
                self.act,
                &mut y,
            )?;
            let mut r = 0;
            for (i, &c) in counts.iter().enumerate() {
                out[i * m * n..(i * m + c) * n].copy_from_slice(&y[r * n..(r + c) * n]);
                r += c;
            }
        }
        Ok(Tensor::from_vec(out, (e, m, n), &Device::Cpu)?.to_dtype(x.dtype())?)
    }

    fn cuda_contiguous(&self, x: &Tensor, counts: &[usize]) -> Result<Tensor> {
        let kernel = match self.cuda_kernel {
            Some(k) => k,
            // the process-wide choice is made for Fp8Linear: one with no grouped form leaves
            // the grouped call its own choice instead of failing every MoE layer
            None => match Settings::global().cuda_fp8_kernel.clone()? {
                CudaFp8Kernel::CublasLt | CudaFp8Kernel::Dequant => CudaFp8Kernel::Auto,
                k => k,
            },
        };
        let w = cuda::prepared(
            &self.cuda,
            &self.codes,
            &self.scales,
            self.shape,
            x.device(),
        )?;
        Ok(cuda::forward(&w, x, counts, self.act, kernel)?.0)
    }
}
