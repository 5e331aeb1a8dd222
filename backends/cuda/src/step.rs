//! Launch plans as data: what one call runs. A plan lists the temporaries it needs and its
//! steps (kernel launches with grid, block, shared memory and arguments; cuBLAS / cuBLASLt
//! calls) over the call's buffers. Building a plan is pure; `launch::execute` runs it on a
//! CUDA stream, and the `emu` feature runs the very same plans on the CPU over the same kernel
//! sources. Nothing here touches a device, so every other module may depend on it.

use std::ffi::c_void;

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

/// `resolve`-d address as a C pointer.
pub(crate) fn cptr(resolve: &dyn Fn(Buf) -> u64, b: Buf) -> *mut c_void {
    resolve(b) as *mut c_void
}

/// What runs a plan: the GPU executor (`launch`) and the CPU emulator (`emu`). [`run`] walks a
/// plan once for both: temporaries, buffer addresses, kernel argument values, grid and copy
/// bounds. A machine only says how to allocate, launch, multiply and copy.
pub(crate) trait Machine {
    /// A temporary of the plan, kept alive until the plan has run.
    type Tmp;
    fn alloc(&self, t: &Tmp) -> Result<Self::Tmp>;
    fn buf(&self, t: &Self::Tmp) -> DevBuf;
    fn kernel(&self, k: &Kernel, args: &mut KernelArgs) -> Result<()>;
    fn gemm(&self, g: &Gemm, bufs: &Bufs<'_>) -> Result<()>;
    fn block_scaled_gemm(&self, g: &BlockScaledGemm, bufs: &Bufs<'_>) -> Result<()>;
    /// `bytes` from `src` to `dst`, both checked to hold them.
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()>;
}

/// The buffers of one run: the call's arguments, then the plan's temporaries.
pub(crate) struct Bufs<'a> {
    args: &'a [DevBuf],
    tmps: Vec<DevBuf>,
}

impl Bufs<'_> {
    pub(crate) fn get(&self, b: Buf) -> DevBuf {
        match b {
            Buf::Arg(i) => self.args[i],
            Buf::Tmp(i) => self.tmps[i],
        }
    }

    pub(crate) fn addr(&self, b: Buf) -> u64 {
        self.get(b).ptr
    }
}

/// One kernel argument's value, in the C type of the kernel's parameter.
pub(crate) enum ArgValue {
    U64(u64),
    I32(i32),
    I64(i64),
    F32(f32),
    /// A parameter struct, as [`struct_words`] lays it out.
    Words(Vec<u64>),
}

/// A launch's argument values, stored until the launch has been issued.
pub(crate) struct KernelArgs(pub(crate) Vec<ArgValue>);

impl KernelArgs {
    fn new(k: &Kernel, bufs: &Bufs<'_>) -> Self {
        let resolve = |b: Buf| bufs.addr(b);
        KernelArgs(
            k.args
                .iter()
                .map(|a| match a {
                    KArg::Val(Val::Ptr(b, off)) => ArgValue::U64(resolve(*b) + *off as u64),
                    KArg::Val(Val::Null) => ArgValue::U64(0),
                    KArg::Val(Val::I32(v)) => ArgValue::I32(*v),
                    KArg::Val(Val::I64(v)) => ArgValue::I64(*v),
                    KArg::Val(Val::F32(v)) => ArgValue::F32(*v),
                    KArg::Struct(fields) => ArgValue::Words(struct_words(fields, &resolve)),
                })
                .collect(),
        )
    }

    /// One pointer per parameter, to its value (the `void**` of a driver launch).
    pub(crate) fn pointers(&mut self) -> Vec<*mut c_void> {
        self.0
            .iter_mut()
            .map(|s| match s {
                ArgValue::U64(v) => v as *mut u64 as *mut c_void,
                ArgValue::I32(v) => v as *mut i32 as *mut c_void,
                ArgValue::I64(v) => v as *mut i64 as *mut c_void,
                ArgValue::F32(v) => v as *mut f32 as *mut c_void,
                ArgValue::Words(w) => w.as_mut_ptr() as *mut c_void,
            })
            .collect()
    }
}

/// Runs `plan` on `machine` over `args` (the call's buffers, in the order the plan's builder
/// documents, which the caller keeps alive and sized as the builder's contract says).
pub(crate) fn run<M: Machine>(machine: &M, plan: &Plan, args: &[DevBuf]) -> Result<()> {
    let tmps = plan
        .tmps
        .iter()
        .map(|t| machine.alloc(t))
        .collect::<Result<Vec<_>>>()?;
    let bufs = Bufs {
        args,
        tmps: tmps.iter().map(|t| machine.buf(t)).collect(),
    };
    for step in &plan.steps {
        match step {
            Step::Kernel(k) => {
                if k.grid.0 == 0
                    || k.grid.1 == 0
                    || k.grid.2 == 0
                    || k.grid.1 > 65535
                    || k.grid.2 > 65535
                {
                    return Err(invalid(
                        "launch",
                        format!("{}: grid {:?} out of range", k.name, k.grid),
                    ));
                }
                machine.kernel(k, &mut KernelArgs::new(k, &bufs))?
            }
            Step::Gemm(g) => machine.gemm(g, &bufs)?,
            Step::BlockScaledGemm(g) => machine.block_scaled_gemm(g, &bufs)?,
            Step::Copy { src, dst, bytes } => {
                let (s, d) = (bufs.get(*src), bufs.get(*dst));
                if s.bytes < *bytes || d.bytes < *bytes {
                    return Err(invalid(
                        "plan",
                        format!("copy of {bytes} bytes overruns its buffers"),
                    ));
                }
                machine.copy(d.ptr, s.ptr, *bytes)?
            }
        }
    }
    // temporaries outlive every step that uses them (on a GPU they are freed in stream order)
    drop(bufs);
    drop(tmps);
    Ok(())
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
