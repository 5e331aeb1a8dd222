//! The executor: runs a [`Plan`] on a CUDA stream. Kernel launches go through the driver;
//! library steps through [`crate::blas`]. Below it: `step` (the plan as data), `context`
//! (modules, functions, per-stream handles) and `blas`; above it: the `fp8` and `nsa` builders.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use crate::context::Gpu;
use crate::error::Result;
use crate::step::{
    self, ArgValue, BlockScaledGemm, Bufs, DevBuf, Gemm, Kernel, KernelArgs, Machine, Plan, Tmp,
};

/// Runs `plan` on `stream` over `args` (device addresses of the call's buffers, which the
/// caller keeps alive and whose sizes it checked against the plan's builder contract).
pub(crate) fn execute(
    g: &Gpu,
    stream: &Arc<CudaStream>,
    plan: &Plan,
    args: &[DevBuf],
) -> Result<()> {
    step::run(&GpuMachine { g, stream }, plan, args)
}

/// A plan's steps on one stream of one device.
struct GpuMachine<'a> {
    g: &'a Gpu,
    stream: &'a Arc<CudaStream>,
}

impl Machine for GpuMachine<'_> {
    type Tmp = CudaSlice<u8>;

    fn alloc(&self, t: &Tmp) -> Result<CudaSlice<u8>> {
        Ok(if t.zeroed {
            self.stream.alloc_zeros::<u8>(t.bytes)?
        } else {
            // SAFETY: a plan reads a non-zeroed temporary only where an earlier step wrote it.
            unsafe { self.stream.alloc::<u8>(t.bytes) }?
        })
    }

    fn buf(&self, t: &CudaSlice<u8>) -> DevBuf {
        let (ptr, _guard) = cudarc::driver::DevicePtr::device_ptr(t, self.stream);
        DevBuf {
            ptr,
            bytes: t.len(),
        }
    }

    fn kernel(&self, k: &Kernel, args: &mut KernelArgs) -> Result<()> {
        let f = self.g.func(k.module, &k.name, k.smem)?;
        let mut b = self.stream.launch_builder(&f);
        for v in &args.0 {
            match v {
                ArgValue::U64(v) => b.arg(v),
                ArgValue::I32(v) => b.arg(v),
                ArgValue::I64(v) => b.arg(v),
                ArgValue::F32(v) => b.arg(v),
                ArgValue::Words(w) => b.arg(&w[0]),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: k.grid,
            block_dim: (k.block, 1, 1),
            shared_mem_bytes: k.smem,
        };
        // SAFETY: the plan's builder sized every buffer the kernel touches (see the builders'
        // contracts), the arguments match the kernel's C signature in order and type (the
        // emulator runs the same argument lists through the kernels' own signatures), and the
        // argument storage outlives the launch call.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    fn gemm(&self, c: &Gemm, bufs: &Bufs<'_>) -> Result<()> {
        crate::blas::cublas::gemm(self.g, self.stream, c, &|b| bufs.addr(b))
    }

    fn block_scaled_gemm(&self, c: &BlockScaledGemm, bufs: &Bufs<'_>) -> Result<()> {
        crate::blas::cublaslt::matmul(self.g, self.stream, c, &|b| bufs.addr(b))
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: both buffers hold `bytes` (checked by `step::run`); same stream, in order.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream())
        }?;
        Ok(())
    }
}
