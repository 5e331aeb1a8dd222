//! The cuBLAS step of a plan: `C = op(A) op(B)` in the input dtype (the last-resort fp8 path,
//! after the weight is dequantized).

use std::sync::Arc;

use cudarc::driver::CudaStream;

use crate::context::Gpu;
use crate::error::Result;
use crate::step::{cptr, Buf, Dtype, Gemm};

/// cuBLAS GEMM step (the last-resort path).
pub(crate) fn gemm(
    g: &Gpu,
    stream: &Arc<CudaStream>,
    c: &Gemm,
    resolve: &dyn Fn(Buf) -> u64,
) -> Result<()> {
    use cudarc::cublas::sys::{
        cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t as Op, cudaDataType,
    };
    let t = match c.dtype {
        Dtype::F32 => cudaDataType::CUDA_R_32F,
        Dtype::Bf16 => cudaDataType::CUDA_R_16BF,
        Dtype::F16 => cudaDataType::CUDA_R_16F,
    };
    let op = |tr: bool| if tr { Op::CUBLAS_OP_T } else { Op::CUBLAS_OP_N };
    let blas = g.blas(stream)?;
    let (alpha, beta) = (1f32, 0f32);
    // SAFETY: the plan sized A (lda x (trans_a ? m : k)), B and C for these dimensions; the
    // handle is bound to `stream`; alpha / beta are f32 as CUBLAS_COMPUTE_32F expects.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            op(c.trans_a),
            op(c.trans_b),
            c.m as i32,
            c.n as i32,
            c.k as i32,
            &alpha as *const f32 as *const _,
            cptr(resolve, c.a),
            t,
            c.lda as i32,
            cptr(resolve, c.b),
            t,
            c.ldb as i32,
            &beta as *const f32 as *const _,
            cptr(resolve, c.c),
            t,
            c.ldc as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }?;
    Ok(())
}
