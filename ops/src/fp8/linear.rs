use std::sync::{Arc, Mutex};

use candle_core::{DType, Module, Tensor};
use fp8nsa_types::{LinearShape, Settings};

use super::op::{CallPlan, Fp8LinearOp, Fp8Path};
use super::{cuda, pjrt, ActQuant, Fp8BlockWeight};
use crate::backend::{use_cuda, Backend, CudaFp8Kernel, TpuKernel};
use crate::error::{shape_err, Error, Result};

/// A linear layer `y = x · Wᵀ + b` with an fp8 block-scaled weight and dynamic activation
/// quantization, accumulated in f32 with the scales applied per K-block. A drop-in for
/// `candle_nn::Linear`: `x [.., K]` of f32/bf16/f16 gives `y [.., N]` of the same dtype.
///
/// On an accelerator the weight is prepared once (laid out for a CUDA device, or uploaded to a
/// PJRT runtime) and kept with the layer, shared by its clones. The layer keeps one prepared
/// copy: moving it to another device prepares the weight again there.
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
    /// The bias as f32 on the host, what every backend starts from.
    bias_host: Option<Arc<[f32]>>,
    act: ActQuant,
    backend: Backend,
    tpu_kernel: Option<TpuKernel>,
    cuda_kernel: Option<CudaFp8Kernel>,
    /// The weight as the accelerator it last ran on holds it, shared by clones. The CPU
    /// kernels read `weight` itself.
    prepared: Arc<Mutex<Option<Prepared>>>,
}

/// The weight prepared for one accelerator: one variant per device kind (each a stand-in that
/// cannot be built when its feature is off, so the layer has the same fields in every build).
#[derive(Clone, Debug)]
pub(crate) enum Prepared {
    /// Codes and scales laid out for the CUDA kernels on one device.
    Cuda(Arc<cuda::CudaWeight>),
    /// Uploaded to one PJRT runtime's device.
    Pjrt(Arc<pjrt::PjrtWeight>),
}

impl Fp8Linear {
    /// `bias`, when given, is `[N]` of any float dtype.
    pub fn new(weight: Fp8BlockWeight, bias: Option<Tensor>, act: ActQuant) -> Result<Self> {
        act.validate()?;
        let [n, _] = weight.shape();
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
        Ok(Self {
            weight,
            bias,
            bias_host,
            act,
            backend: Backend::Auto,
            tpu_kernel: None,
            cuda_kernel: None,
            prepared: Arc::default(),
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
        self.tpu_kernel = Some(kernel);
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
        self.act
    }

    /// The backend this layer's calls run on (`FP8NSA_BACKEND` applied to `Auto`).
    pub(crate) fn backend_resolved(&self) -> Result<Backend> {
        self.backend.resolve()
    }

    pub(crate) fn bias_host(&self) -> Option<&[f32]> {
        self.bias_host.as_deref()
    }

    pub(crate) fn tpu_kernel(&self) -> Result<TpuKernel> {
        self.tpu_kernel
            .map_or_else(|| Ok(Settings::global().tpu_kernel.clone()?), Ok)
    }

    pub(crate) fn cuda_kernel(&self) -> Result<CudaFp8Kernel> {
        self.cuda_kernel
            .map_or_else(|| Ok(Settings::global().cuda_fp8_kernel.clone()?), Ok)
    }

    /// The prepared weight if `keep` accepts it, else the one `make` builds (kept for the next
    /// call, replacing what another device had).
    pub(crate) fn prepared<T>(
        &self,
        keep: impl Fn(&Prepared) -> Option<T>,
        make: impl FnOnce() -> Result<(Prepared, T)>,
    ) -> Result<T> {
        let mut slot = self.prepared.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = slot.as_ref().and_then(&keep) {
            return Ok(t);
        }
        let (p, t) = make()?;
        *slot = Some(p);
        Ok(t)
    }

    /// Like [`Module::forward`], with this crate's error type.
    pub fn forward_t(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.forward_with_path(x)?.0)
    }

    /// [`Self::forward_t`], also returning the path that ran.
    ///
    /// The call is checked and planned once, before anything runs: a shape, dtype or device
    /// the layer does not take, or a forced kernel that does not apply, is a typed error here
    /// (never text from inside a Candle op).
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use fp8nsa_ops::fp8::CpuFp8Kernel;
    /// use fp8nsa_ops::{ActQuant, Fp8BlockWeight, Fp8Linear, Fp8Path};
    ///
    /// let w = Tensor::randn(0f32, 1.0, (64, 256), &Device::Cpu)?;
    /// let lin = Fp8Linear::new(Fp8BlockWeight::quantize(&w, [128, 128])?, None, ActQuant::Group)?;
    /// let (_, path) = lin.forward_with_path(&Tensor::ones((1, 256), DType::F32, &Device::Cpu)?)?;
    /// assert!(matches!(path, Fp8Path::Cpu(p) if p.kernel == CpuFp8Kernel::Gemv));
    /// let (_, path) = lin.forward_with_path(&Tensor::ones((40, 256), DType::F32, &Device::Cpu)?)?;
    /// assert!(matches!(path, Fp8Path::Cpu(p) if p.kernel == CpuFp8Kernel::PanelGemm));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn forward_with_path(&self, x: &Tensor) -> Result<(Tensor, Fp8Path)> {
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
            let (y, kernel) = self.run_pjrt(rt, x, m)?;
            return Ok((y.reshape(out_dims)?, Fp8Path::Pjrt(kernel)));
        }
        let _span = tracing::debug_span!("fp8nsa::fp8_linear", m, n, k).entered();
        let plan = if use_cuda(&backend, x.device(), "Fp8Linear")? {
            CallPlan::Cuda(self.plan_cuda(x.device(), m, x.dtype())?)
        } else if x.device().is_cpu() && self.weight.device().is_cpu() {
            let [bn, bk] = self.weight.block();
            let shape = LinearShape::new(m, n, k, bn, bk)?;
            CallPlan::Cpu(fp8nsa_cpu::linear::plan(shape, self.act)?)
        } else {
            return Err(Error::Unsupported {
                op: "Fp8Linear",
                device: format!("{:?}", x.device()),
                hint: "the CPU kernels need x and the weight on the CPU (CUDA tensors run on CUDA with the `cuda` feature)",
            });
        };
        let op = Fp8LinearOp::new(&self.weight, self.bias_host(), plan, out_dims.into());
        let y = if op.on_cpu() {
            op.apply(&x.contiguous()?)?
        } else {
            let out = op.out_shape().clone();
            op.apply(&x.reshape((m, k))?.contiguous()?)?.reshape(out)?
        };
        let path = op.path();
        // the kernel's name is formatted only for a subscriber that wants it: a decode step
        // makes over a hundred of these calls
        if tracing::enabled!(tracing::Level::DEBUG) {
            let (backend, kernel) = match path {
                Fp8Path::Cpu(p) => ("cpu", p.to_string()),
                Fp8Path::Cuda(p) => ("cuda", p.to_string()),
                Fp8Path::Pjrt(k) => ("pjrt", format!("{k:?}")),
            };
            tracing::debug!(op = "fp8_linear", backend, kernel, m, n, k, block = ?self.weight.block(), act = ?self.act, dtype = ?x.dtype());
        }
        Ok((y, path))
    }
}

impl Module for Fp8Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.forward_t(x)?)
    }
}

/// The accelerator paths, which keep the prepared weight in the layer's one slot.
impl Fp8Linear {
    /// Plans `m` rows of `dtype` on `dev`, then prepares the weight for it (once per device,
    /// kept with the layer): every refusal (a forced kernel that does not apply, sizes past
    /// the kernels' indexing, no `cuda` feature) is a typed error here, before the op runs.
    fn plan_cuda(
        &self,
        dev: &candle_core::Device,
        m: usize,
        dtype: DType,
    ) -> Result<cuda::CudaCall> {
        let kernel = self.cuda_kernel()?;
        let loc = dev.location();
        cuda::plan((&self.weight, self.act), dev, m, dtype, kernel, || {
            self.prepared(
                |p| match p {
                    Prepared::Cuda(w) if cuda::is_on(w, &loc) => Some(w.clone()),
                    _ => None,
                },
                || {
                    let w = cuda::prepare(&self.weight, self.bias_host(), dev)?;
                    Ok((Prepared::Cuda(w.clone()), w))
                },
            )
        })
    }

    /// `x` with `m` rows of K -> `y [m, N]` and the kernel variant that ran; the weight is
    /// uploaded on the first call for `rt` and kept with the layer.
    fn run_pjrt(
        &self,
        rt: &Arc<crate::backend::PjrtRuntime>,
        x: &Tensor,
        m: usize,
    ) -> Result<(Tensor, TpuKernel)> {
        let variant = self.tpu_kernel()?;
        pjrt::check(rt, variant)?;
        let w = self.prepared(
            |p| match p {
                Prepared::Pjrt(w) if Arc::ptr_eq(pjrt::runtime(w), rt) => Some(w.clone()),
                _ => None,
            },
            || {
                let w = pjrt::upload(&self.weight, self.bias_host(), rt)?;
                Ok((Prepared::Pjrt(w.clone()), w))
            },
        )?;
        let y = pjrt::run((&w, self.weight.shape(), self.act), x, m, variant)?;
        Ok((y, variant))
    }
}
