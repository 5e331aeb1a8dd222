//! cuBLASLt block-scaled fp8 GEMM (CUDA >= 12.9, sm_90): activations with `VEC128_32F` scales
//! (one f32 per 128 K-elements per token), weights with `BLK128x128_32F` scales, TN layout.
//!
//! Column-major view of `y[M, N] = x[M, K] . W[N, K]^T`: cuBLASLt's A is the weight (K x N,
//! transposed), B the activations (K x Mp), D is N x Mp with ld N, i.e. row-major `y`.
//! Scale layouts (cuBLAS docs, "scaling factors layouts"): weight scales `[ceil(N/128)][L4]`
//! with the K-block index contiguous and rows padded to L4 = round_up(ceil(K/128), 4) (the
//! prepared weight has this layout); activation scales `[L][Mp]`, token index contiguous;
//! the token count Mp is padded to a multiple of 16.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaStream, DevicePtr};

use crate::context::{Gpu, WORKSPACE_BYTES};
use crate::error::{Error, Result};
use crate::step::{BlockScaledGemm, Buf, Dtype};

/// Token counts are padded to this for cuBLASLt (docs: multiple of 4; 8 seen in practice).
pub(crate) const TOKEN_ALIGN: usize = 16;

/// The alignment cuBLASLt may assume of a buffer: its address's largest power of two, <= 256.
fn alignment(ptr: u64) -> u32 {
    if ptr == 0 {
        256
    } else {
        (1u64 << ptr.trailing_zeros().min(8)) as u32
    }
}

/// Destroys the cuBLASLt objects of one call on every exit path.
struct Objects {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: Vec<sys::cublasLtMatrixLayout_t>,
    pref: Option<sys::cublasLtMatmulPreference_t>,
}

impl Drop for Objects {
    fn drop(&mut self) {
        // SAFETY: each object was created once by this call and is destroyed once.
        unsafe {
            for l in &self.layouts {
                let _ = lt::destroy_matrix_layout(*l);
            }
            if let Some(p) = self.pref {
                let _ = lt::destroy_matmul_pref(p);
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

fn set_desc<V>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    v: &V,
) -> Result<()> {
    // SAFETY: `v` is a live value of the size passed, as the attribute expects.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            attr,
            v as *const V as *const c_void,
            std::mem::size_of::<V>(),
        )
    }
    .map_err(Error::from)
}

/// Runs a [`BlockScaledGemm`] step: `d[mp, n] = x[mp, k] . w[n, k]^T` with the block scales.
pub(crate) fn matmul(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    c: &BlockScaledGemm,
    resolve: &dyn Fn(Buf) -> u64,
) -> Result<()> {
    use sys::cublasLtMatmulDescAttributes_t as A;
    let st = gpu.lt(stream)?;
    let (n, mp, k) = (c.n, c.mp, c.k);
    let out_type = match c.out {
        Dtype::F32 => sys::cudaDataType::CUDA_R_32F,
        Dtype::Bf16 => sys::cudaDataType::CUDA_R_16BF,
        Dtype::F16 => sys::cudaDataType::CUDA_R_16F,
    };
    let d_ptr = resolve(c.d);
    if !d_ptr.is_multiple_of(16) {
        return Err(crate::error::unsupported(
            "cuBLASLt",
            "the output is not 16-byte aligned",
        ));
    }
    let desc = lt::create_matmul_desc(
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        sys::cudaDataType::CUDA_R_32F,
    )?;
    let mut obj = Objects {
        desc,
        layouts: Vec::new(),
        pref: None,
    };
    let (work_ptr, _g) = st.workspace.device_ptr(stream);
    let (ws_ptr, sx_ptr) = (resolve(c.w_scales), resolve(c.x_scales));

    set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &1i32)?; // CUBLAS_OP_T
    set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &0i32)?; // CUBLAS_OP_N
    set_desc(
        desc,
        A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
        &(ws_ptr as *const c_void),
    )?;
    set_desc(
        desc,
        A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
        &(sx_ptr as *const c_void),
    )?;
    let blk = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F as u32;
    let vec = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F as u32;
    set_desc(desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &blk)?;
    set_desc(desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &vec)?;
    set_desc(desc, A::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &0i8)?;

    let e4m3 = sys::cudaDataType::CUDA_R_8F_E4M3;
    let a_l = lt::create_matrix_layout(e4m3, k as u64, n as u64, k as i64)?;
    obj.layouts.push(a_l);
    let b_l = lt::create_matrix_layout(e4m3, k as u64, mp as u64, k as i64)?;
    obj.layouts.push(b_l);
    let d_l = lt::create_matrix_layout(out_type, n as u64, mp as u64, n as i64)?;
    obj.layouts.push(d_l);

    let (w_ptr, x_ptr) = (resolve(c.w), resolve(c.x));
    let align = [alignment(w_ptr), alignment(x_ptr), alignment(d_ptr)];
    let key = (n, mp, k, out_type, align);
    let cached = st.algos.lock().expect("algo cache").get(&key).copied();
    let algo = match cached {
        Some(a) => a,
        None => {
            let pref = lt::create_matmul_pref()?;
            obj.pref = Some(pref);
            use sys::cublasLtMatmulPreferenceAttributes_t as P;
            // SAFETY: a live usize for an attribute of type size_t.
            unsafe {
                lt::set_matmul_pref_attribute(
                    pref,
                    P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &WORKSPACE_BYTES as *const usize as *const c_void,
                    std::mem::size_of::<usize>(),
                )?;
            }
            // the heuristic assumes 256-byte buffers unless told otherwise
            for (attr, a) in [
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align[0]),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align[1]),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align[2]),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align[2]),
            ] {
                // SAFETY: a live u32 for an attribute of type uint32_t.
                unsafe {
                    lt::set_matmul_pref_attribute(
                        pref,
                        attr,
                        &a as *const u32 as *const c_void,
                        std::mem::size_of::<u32>(),
                    )?;
                }
            }
            // SAFETY: every descriptor and layout is live; C has D's layout (beta = 0).
            let h = unsafe {
                lt::get_matmul_algo_heuristic(st.handle, desc, a_l, b_l, d_l, d_l, pref)
            }?;
            st.algos.lock().expect("algo cache").insert(key, h.algo);
            h.algo
        }
    };
    let (alpha, beta) = (1f32, 0f32);
    // SAFETY: the plan sized every buffer for these layouts (w n x k, x mp x k, scales as the
    // module docs say, d mp x n) and keeps them alive until the call is enqueued; the
    // workspace is WORKSPACE_BYTES long and used by this (stream, thread) only; C aliases D
    // with beta = 0.
    unsafe {
        lt::matmul(
            st.handle,
            desc,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            w_ptr as *const c_void,
            a_l,
            x_ptr as *const c_void,
            b_l,
            d_ptr as *const c_void,
            d_l,
            d_ptr as *mut c_void,
            d_l,
            &algo,
            work_ptr as *mut c_void,
            WORKSPACE_BYTES,
            stream.cu_stream() as sys::cudaStream_t,
        )
    }?;
    Ok(())
}
