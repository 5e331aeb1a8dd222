use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Module, Shape, Tensor};
use fp8nsa_cpu::linear::fp8_linear;
use fp8nsa_types::{LinearShape, Settings};

use super::{ActQuant, Fp8BlockWeight};
use crate::backend::{use_cuda, Backend, CudaFp8Kernel, TpuKernel};
use crate::error::{invalid, shape_err, Error, Result};
use crate::storage::{f32_slice, fp8_bytes, from_f32};

/// A linear layer `y = x · Wᵀ + b` with an fp8 block-scaled weight and dynamic activation
/// quantization, accumulated in f32 with the scales applied per K-block. A drop-in for
/// `candle_nn::Linear`: `x [.., K]` of f32/bf16/f16 gives `y [.., N]` of the same dtype.
///
/// ```
/// use candle_core::{Device, Module, Tensor};
/// use fp8nsa_ops::{ActQuant, Fp8BlockWeight, Fp8Linear};
///
/// let w = Tensor::randn(0f32, 1.0, (256, 512), &Device::Cpu)?;
/// let b = Tensor::zeros(256, candle_core::DType::F32, &Device::Cpu)?;
/// let lin = Fp8Linear::new(Fp8BlockWeight::quantize(&w, [128, 128])?, Some(b), ActQuant::Group)?;
/// let y = lin.forward(&Tensor::ones((3, 512), candle_core::DType::BF16, &Device::Cpu)?)?;
/// assert_eq!((y.dims(), y.dtype()), (&[3, 256][..], candle_core::DType::BF16));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct Fp8Linear {
    weight: Fp8BlockWeight,
    bias: Option<Tensor>,
    op: Fp8LinearOp,
    backend: Backend,
    kernel: Option<TpuKernel>,
    cuda_kernel: Option<CudaFp8Kernel>,
    /// The weight as uploaded to a PJRT device, shared by clones.
    #[cfg_attr(not(feature = "pjrt"), allow(dead_code))]
    device_weight: super::pjrt::WeightCache,
    /// The weight as prepared for a CUDA device, shared by clones.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    cuda_weight: super::cuda::CudaWeightCache,
}

impl Fp8Linear {
    /// `bias`, when given, is `[N]` of any float dtype.
    pub fn new(weight: Fp8BlockWeight, bias: Option<Tensor>, act: ActQuant) -> Result<Self> {
        act.validate()?;
        let [n, k] = weight.shape();
        let bias_host = match &bias {
            None => None,
            Some(b) => {
                if b.dims() != [n] {
                    return Err(shape_err("bias", format!("[{n}]"), b.dims()));
                }
                if !b.dtype().is_float() {
                    return Err(Error::DType {
                        arg: "bias",
                        expected: "a float dtype",
                        got: b.dtype(),
                    });
                }
                let v = b
                    .to_device(&candle_core::Device::Cpu)?
                    .to_dtype(DType::F32)?
                    .to_vec1::<f32>()?;
                Some(Arc::<[f32]>::from(v))
            }
        };
        let op = Fp8LinearOp {
            n,
            k,
            block: weight.block(),
            act,
            bias: bias_host,
        };
        Ok(Self {
            weight,
            bias,
            op,
            backend: Backend::Auto,
            kernel: None,
            cuda_kernel: None,
            device_weight: Default::default(),
            cuda_weight: Default::default(),
        })
    }

    /// Runs on `backend` (default `Backend::Auto`: the tensor's device, or `FP8NSA_BACKEND`).
    pub fn with_backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// The PJRT fp8 kernel variant (default: `FP8NSA_TPU_KERNEL`, else v1, the XLA-native
    /// program).
    pub fn with_tpu_kernel(mut self, kernel: TpuKernel) -> Self {
        self.kernel = Some(kernel);
        self
    }

    /// The CUDA fp8 GEMM path (default: `FP8NSA_CUDA_FP8_KERNEL`, else `Auto`, chosen per call).
    pub fn with_cuda_kernel(mut self, kernel: CudaFp8Kernel) -> Self {
        self.cuda_kernel = Some(kernel);
        self
    }

    pub fn weight(&self) -> &Fp8BlockWeight {
        &self.weight
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    pub fn act(&self) -> ActQuant {
        self.op.act
    }

    #[cfg_attr(not(any(feature = "pjrt", feature = "cuda")), allow(dead_code))]
    pub(crate) fn bias_host(&self) -> Option<&[f32]> {
        self.op.bias.as_deref()
    }

    #[cfg_attr(not(feature = "pjrt"), allow(dead_code))]
    pub(crate) fn tpu_kernel(&self) -> Result<TpuKernel> {
        self.kernel
            .map_or_else(|| Ok(Settings::global().tpu_kernel.clone()?), Ok)
    }

    #[cfg_attr(not(feature = "pjrt"), allow(dead_code))]
    pub(crate) fn device_weight(&self) -> &super::pjrt::WeightCache {
        &self.device_weight
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn cuda_kernel(&self) -> Result<CudaFp8Kernel> {
        self.cuda_kernel
            .map_or_else(|| Ok(Settings::global().cuda_fp8_kernel.clone()?), Ok)
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn cuda_weight(&self) -> &super::cuda::CudaWeightCache {
        &self.cuda_weight
    }

    /// Like [`Module::forward`], with this crate's error type.
    pub fn forward_t(&self, x: &Tensor) -> Result<Tensor> {
        let [n, k] = self.weight.shape();
        let dims = x.dims();
        if dims.last() != Some(&k) {
            return Err(shape_err("x", format!("[.., {k}] (K of the weight)"), dims));
        }
        if x.elem_count() == 0 {
            return Err(shape_err(
                "x",
                format!("[.., {k}] with at least one row"),
                dims,
            ));
        }
        if !matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::DType {
                arg: "x",
                expected: "f32, bf16 or f16",
                got: x.dtype(),
            });
        }
        let m = x.elem_count() / k;
        let mut out_dims = dims.to_vec();
        *out_dims.last_mut().expect("x has a last dim") = n;
        let backend = self.backend.resolve()?;
        if let Backend::Pjrt(rt) = &backend {
            let y = super::pjrt::fp8_linear(self, rt, x, m)?;
            return Ok(y.reshape(out_dims)?);
        }
        let _span = tracing::debug_span!("fp8nsa::fp8_linear", m, n, k).entered();
        let x2 = x.reshape((m, k))?.contiguous()?;
        if use_cuda(&backend, x.device(), "Fp8Linear")? {
            let y = super::cuda::fp8_linear(self, &x2, m)?;
            return Ok(y.reshape(out_dims)?);
        }
        if !x.device().is_cpu() || !self.weight.device().is_cpu() {
            return Err(Error::Unsupported {
                op: "Fp8Linear",
                device: format!("{:?}", x.device()),
                hint: "the CPU kernels need x and the weight on the CPU (CUDA tensors run on CUDA with the `cuda` feature)",
            });
        }
        let y = x2.apply_op3_no_bwd(self.weight.data(), self.weight.scales(), &self.op)?;
        Ok(y.reshape(out_dims)?)
    }
}

impl Module for Fp8Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.forward_t(x)?)
    }
}

/// The Candle custom op: `(x [M, K], data U8 [N, K], scales F32) -> y [M, N]` in x's dtype.
#[derive(Clone, Debug)]
struct Fp8LinearOp {
    n: usize,
    k: usize,
    block: [usize; 2],
    act: ActQuant,
    bias: Option<Arc<[f32]>>,
}

impl CustomOp3 for Fp8LinearOp {
    fn name(&self) -> &'static str {
        "fp8nsa-fp8-linear"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        ss: &CpuStorage,
        sl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, k) = xl.shape().dims2()?;
        if k != self.k {
            return Err(shape_err("x", format!("[M, {}]", self.k), xl.dims()).into());
        }
        let x = f32_slice("x", xs, xl)?;
        let w = fp8_bytes("weight", ws, wl)?;
        let scales = match ss {
            CpuStorage::F32(v) => {
                let (a, b) = sl
                    .contiguous_offsets()
                    .ok_or_else(|| invalid("scales", "must be contiguous"))?;
                &v[a..b]
            }
            other => {
                return Err(Error::DType {
                    arg: "scales",
                    expected: "f32",
                    got: other.dtype(),
                }
                .into())
            }
        };
        let shape = LinearShape {
            m,
            n: self.n,
            k,
            bn: self.block[0],
            bk: self.block[1],
        };
        let mut out = vec![0f32; m * self.n];
        let kernel = fp8_linear(
            &x,
            &w,
            scales,
            self.bias.as_deref(),
            shape,
            self.act,
            &mut out,
        )
        .map_err(Error::from)?;
        tracing::debug!(
            op = "fp8_linear",
            backend = "cpu",
            kernel = kernel.name(),
            m,
            n = self.n,
            k,
            block = ?self.block,
            act = ?self.act,
            dtype = ?xs.dtype(),
        );
        Ok((from_f32(out, xs.dtype()), Shape::from((m, self.n))))
    }
}
