use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, CudaViewMut, DeviceRepr, ValidAsZeroBits};

/// The float types the kernels take and return: f32, bf16 and f16 (kernel names end in
/// `SUFFIX`).
pub trait Element: DeviceRepr + ValidAsZeroBits + Copy + Send + Sync + 'static {
    const SUFFIX: &'static str;
    /// cuBLASLt's name of the type.
    const LT_TYPE: cudarc::cublaslt::sys::cudaDataType;

    fn from_f32(v: f32) -> Self;

    /// cuBLAS GEMM in this type with f32 accumulation.
    ///
    /// # Safety
    /// The config's shapes and leading dimensions must lie within `a`, `b` and `c`.
    unsafe fn gemm(
        blas: &CudaBlas,
        cfg: GemmConfig<Self>,
        a: &CudaSlice<Self>,
        b: &CudaSlice<Self>,
        c: &mut CudaViewMut<'_, Self>,
    ) -> Result<(), cudarc::cublas::result::CublasError>;
}

macro_rules! element {
    ($t:ty, $suffix:literal, $lt:ident, $from:expr) => {
        impl Element for $t {
            const SUFFIX: &'static str = $suffix;
            const LT_TYPE: cudarc::cublaslt::sys::cudaDataType =
                cudarc::cublaslt::sys::cudaDataType::$lt;

            fn from_f32(v: f32) -> Self {
                $from(v)
            }

            unsafe fn gemm(
                blas: &CudaBlas,
                cfg: GemmConfig<Self>,
                a: &CudaSlice<Self>,
                b: &CudaSlice<Self>,
                c: &mut CudaViewMut<'_, Self>,
            ) -> Result<(), cudarc::cublas::result::CublasError> {
                // SAFETY: forwarded from the caller.
                unsafe { <CudaBlas as Gemm<$t>>::gemm(blas, cfg, a, b, c) }
            }
        }
    };
}

element!(f32, "f32", CUDA_R_32F, |v| v);
element!(half::bf16, "bf16", CUDA_R_16BF, half::bf16::from_f32);
element!(half::f16, "f16", CUDA_R_16F, half::f16::from_f32);
