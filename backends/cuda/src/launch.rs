//! Launch plans: what one call runs, as data. A plan lists the temporaries it needs and its
//! steps (kernel launches with grid, block, shared memory and arguments; cuBLAS / cuBLASLt
//! calls; copies) over the call's buffers. Building a plan is pure; `execute` runs it on a
//! CUDA stream. The `emu` feature runs the very same plans on the CPU, over the same kernel
//! sources, so kernels and launch logic are tested without a GPU.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use crate::context::Gpu;
use crate::error::{invalid, Result};

/// Element types of the float buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

impl Dtype {
    /// Kernel-name suffix.
    pub fn suffix(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }

    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }

    pub(crate) fn of<T: crate::Element>() -> Dtype {
        match T::SUFFIX {
            "bf16" => Dtype::Bf16,
            "f16" => Dtype::F16,
            _ => Dtype::F32,
        }
    }
}

/// A buffer of the call: one of its arguments (in the order the plan's builder documents) or
/// one of the plan's temporaries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Buf {
    Arg(usize),
    Tmp(usize),
}

/// A kernel argument, or a field of a parameter struct.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Val {
    /// The address of a buffer, plus a byte offset.
    Ptr(Buf, usize),
    /// A null pointer.
    Null,
    I32(i32),
    I64(i64),
    F32(f32),
}

/// A kernel argument: a scalar / pointer, or a parameter struct passed by value (C layout).
#[derive(Clone, Debug, PartialEq)]
pub enum KArg {
    Val(Val),
    Struct(Vec<Val>),
}

/// A temporary: `bytes` long, zero-filled first when `zeroed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tmp {
    pub bytes: usize,
    pub zeroed: bool,
}

/// One kernel launch.
#[derive(Clone, Debug, PartialEq)]
pub struct Kernel {
    /// Kernel file (PTX module).
    pub module: &'static str,
    pub name: String,
    pub grid: (u32, u32, u32),
    pub block: u32,
    /// Dynamic shared memory, bytes.
    pub smem: u32,
    pub args: Vec<KArg>,
}

/// `C = op(A) op(B)` in column-major cuBLAS terms, all in `dtype`, f32 accumulation,
/// alpha = 1, beta = 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gemm {
    pub dtype: Dtype,
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: Buf,
    pub lda: usize,
    pub b: Buf,
    pub ldb: usize,
    pub c: Buf,
    pub ldc: usize,
}

/// cuBLASLt's block-scaled fp8 GEMM `d[mp, n] = x[mp, ld] . w[n, ld]^T`: weight scales
/// `BLK128x128_32F` `[ceil(n/128)][scale_ld]`, activation scales `VEC128_32F` `[ceil(k/128)][mp]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockScaledGemm {
    pub out: Dtype,
    pub n: usize,
    pub mp: usize,
    /// The K cuBLASLt sees: the padded row length of both operands.
    pub k: usize,
    pub w: Buf,
    pub w_scales: Buf,
    pub x: Buf,
    pub x_scales: Buf,
    pub d: Buf,
}

/// One step of a plan.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    Kernel(Kernel),
    Gemm(Gemm),
    BlockScaledGemm(BlockScaledGemm),
    Copy { src: Buf, dst: Buf, bytes: usize },
}

/// Temporaries and steps, run in order on one stream.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    pub tmps: Vec<Tmp>,
    pub steps: Vec<Step>,
}

impl Plan {
    pub(crate) fn tmp(&mut self, bytes: usize, zeroed: bool) -> Buf {
        self.tmps.push(Tmp {
            bytes: bytes.max(1),
            zeroed,
        });
        Buf::Tmp(self.tmps.len() - 1)
    }

    pub(crate) fn kernel(&mut self, k: Kernel) {
        self.steps.push(Step::Kernel(k));
    }
}

/// A parameter struct in the C layout nvcc gives it on every 64-bit target: pointers and
/// 64-bit integers 8-aligned, 32-bit values 4-aligned, the size a multiple of 8. Returned as
/// 64-bit words so the bytes are 8-aligned wherever they live.
pub fn struct_words(fields: &[Val], resolve: &dyn Fn(Buf) -> u64) -> Vec<u64> {
    let mut bytes: Vec<u8> = Vec::new();
    for f in fields {
        let (data, align): ([u8; 8], usize) = match *f {
            Val::Ptr(b, off) => ((resolve(b) + off as u64).to_le_bytes(), 8),
            Val::Null => (0u64.to_le_bytes(), 8),
            Val::I64(v) => (v.to_le_bytes(), 8),
            Val::I32(v) => (pad4(v.to_le_bytes()), 4),
            Val::F32(v) => (pad4(v.to_le_bytes()), 4),
        };
        bytes.resize(bytes.len().next_multiple_of(align), 0);
        bytes.extend_from_slice(&data[..align]);
    }
    bytes.resize(bytes.len().next_multiple_of(8), 0);
    bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect()
}

fn pad4(b: [u8; 4]) -> [u8; 8] {
    [b[0], b[1], b[2], b[3], 0, 0, 0, 0]
}

/// A call's buffer on the device: its address and length in bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DevBuf {
    pub(crate) ptr: u64,
    pub(crate) bytes: usize,
}

/// Runs `plan` on `stream` over `args` (device addresses of the call's buffers, which the
/// caller keeps alive and whose sizes it checked against the plan's builder contract).
pub(crate) fn execute(
    g: &Gpu,
    stream: &Arc<CudaStream>,
    plan: &Plan,
    args: &[DevBuf],
) -> Result<()> {
    let mut tmps: Vec<CudaSlice<u8>> = Vec::with_capacity(plan.tmps.len());
    for t in &plan.tmps {
        tmps.push(if t.zeroed {
            stream.alloc_zeros::<u8>(t.bytes)?
        } else {
            // SAFETY: a plan reads a non-zeroed temporary only where an earlier step wrote it.
            unsafe { stream.alloc::<u8>(t.bytes) }?
        });
    }
    let tmp_ptrs: Vec<DevBuf> = tmps
        .iter()
        .map(|t| {
            let (p, _guard) = cudarc::driver::DevicePtr::device_ptr(t, stream);
            DevBuf {
                ptr: p,
                bytes: t.len(),
            }
        })
        .collect();
    let resolve = |b: Buf| -> u64 {
        match b {
            Buf::Arg(i) => args[i].ptr,
            Buf::Tmp(i) => tmp_ptrs[i].ptr,
        }
    };
    for step in &plan.steps {
        match step {
            Step::Kernel(k) => launch(g, stream, k, &resolve)?,
            Step::Gemm(c) => crate::fp8::gemm(g, stream, c, &resolve)?,
            Step::BlockScaledGemm(c) => crate::fp8::cublaslt::matmul(g, stream, c, &resolve)?,
            Step::Copy { src, dst, bytes } => {
                let len = |b: &Buf| match b {
                    Buf::Arg(i) => args[*i].bytes,
                    Buf::Tmp(i) => tmp_ptrs[*i].bytes,
                };
                if len(src) < *bytes || len(dst) < *bytes {
                    return Err(invalid(
                        "plan",
                        format!("copy of {bytes} bytes overruns its buffers"),
                    ));
                }
                // SAFETY: both buffers hold `bytes` (checked above); same stream, in order.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        resolve(*dst),
                        resolve(*src),
                        *bytes,
                        stream.cu_stream(),
                    )
                }?;
            }
        }
    }
    // temporaries are freed in stream order, after the steps that use them
    drop(tmps);
    Ok(())
}

/// Storage for one kernel argument while the launch is built.
enum ArgStore {
    U64(u64),
    I32(i32),
    I64(i64),
    F32(f32),
    Words(Vec<u64>),
}

fn launch(
    g: &Gpu,
    stream: &Arc<CudaStream>,
    k: &Kernel,
    resolve: &dyn Fn(Buf) -> u64,
) -> Result<()> {
    let f = g.func(k.module, &k.name, k.smem)?;
    let store: Vec<ArgStore> = k
        .args
        .iter()
        .map(|a| match a {
            KArg::Val(Val::Ptr(b, off)) => ArgStore::U64(resolve(*b) + *off as u64),
            KArg::Val(Val::Null) => ArgStore::U64(0),
            KArg::Val(Val::I32(v)) => ArgStore::I32(*v),
            KArg::Val(Val::I64(v)) => ArgStore::I64(*v),
            KArg::Val(Val::F32(v)) => ArgStore::F32(*v),
            KArg::Struct(fields) => ArgStore::Words(struct_words(fields, resolve)),
        })
        .collect();
    let mut b = stream.launch_builder(&f);
    for s in &store {
        match s {
            ArgStore::U64(v) => b.arg(v),
            ArgStore::I32(v) => b.arg(v),
            ArgStore::I64(v) => b.arg(v),
            ArgStore::F32(v) => b.arg(v),
            ArgStore::Words(w) => b.arg(&w[0]),
        };
    }
    if k.grid.0 == 0 || k.grid.1 == 0 || k.grid.2 == 0 || k.grid.1 > 65535 || k.grid.2 > 65535 {
        return Err(invalid(
            "launch",
            format!("{}: grid {:?} out of range", k.name, k.grid),
        ));
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

/// `resolve`-d address as a C pointer.
pub(crate) fn cptr(resolve: &dyn Fn(Buf) -> u64, b: Buf) -> *mut c_void {
    resolve(b) as *mut c_void
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_layout_matches_c() {
        // { void*; int; int; long; float; } -> 8 + 4 + 4 + 8 + 4 (+4 pad) = 32 bytes
        let w = struct_words(
            &[
                Val::Ptr(Buf::Arg(0), 16),
                Val::I32(-2),
                Val::I32(3),
                Val::I64(1 << 40),
                Val::F32(1.5),
            ],
            &|_| 0x1000,
        );
        assert_eq!(w.len(), 4);
        assert_eq!(w[0], 0x1010);
        assert_eq!(w[1], (3u64 << 32) | (-2i32 as u32 as u64));
        assert_eq!(w[2], 1 << 40);
        assert_eq!(w[3], 1.5f32.to_bits() as u64);
        // an int followed by a pointer is padded to 8
        let w = struct_words(&[Val::I32(7), Val::Null], &|_| 0);
        assert_eq!(w, vec![7, 0]);
    }
}
