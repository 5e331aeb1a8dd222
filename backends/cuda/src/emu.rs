//! Runs launch plans on the CPU emulator (`emu` feature): the kernels of `kernels/*.cu`
//! compiled as C++ (emu/emu.cpp), every CUDA thread a fiber, warp collectives and cp.async
//! emulated from the PTX ISA. cuBLAS steps run as a plain host GEMM and cuBLASLt's
//! block-scaled GEMM as the documented formula over its scale layouts. For tests: what this
//! checks is our kernels and launch plans, not the hardware or NVIDIA's libraries.
//!
//! ```
//! use fp8nsa_cuda::emu::{execute, HostBuf};
//! use fp8nsa_cuda::fp8::plan_pad_rows;
//!
//! // [3, 20] codes into rows of 32 bytes, zeros past column 20
//! let mut codes = HostBuf::from_slice(&[0x38u8; 60]);
//! let mut out = HostBuf::new(3 * 32);
//! execute(&plan_pad_rows::<u8>(3, 20, 32), &mut [&mut codes, &mut out])?;
//! let v = out.to_vec::<u8>();
//! assert_eq!((v[19], v[20], v[32]), (0x38, 0, 0x38));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::ffi::{c_char, c_void, CString};

use crate::error::Result;
use crate::step::{
    self, BlockScaledGemm, Bufs, DevBuf, Dtype, Gemm, Kernel, KernelArgs, Machine, Plan, Tmp,
};

extern "C" {
    fn fp8nsa_emu_launch(
        name: *const c_char,
        gx: u32,
        gy: u32,
        gz: u32,
        block: u32,
        smem: u32,
        args: *mut *mut c_void,
        workers: u32,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
    fn fp8nsa_emu_has_kernel(name: *const c_char) -> i32;
    fn fp8nsa_emu_alloc(bytes: usize) -> *mut c_void;
    fn fp8nsa_emu_free(p: *mut c_void);
}

/// Host memory standing in for a device buffer. Its bytes end at an inaccessible page, so a
/// kernel reading or writing past the end faults instead of passing unnoticed. New buffers are
/// filled with 0xFF bytes (NaN as floats): whatever a kernel fails to write shows up.
pub struct HostBuf {
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: the buffer is plain memory owned by this value.
unsafe impl Send for HostBuf {}

impl HostBuf {
    /// `bytes` of 0xFF.
    pub fn new(bytes: usize) -> Self {
        // SAFETY: the emulator returns `bytes` (at least 1) writable bytes, freed in Drop.
        let ptr = unsafe { fp8nsa_emu_alloc(bytes) } as *mut u8;
        Self { ptr, bytes }
    }

    pub fn zeroed(bytes: usize) -> Self {
        let b = Self::new(bytes);
        // SAFETY: `bytes` writable bytes.
        unsafe { std::ptr::write_bytes(b.ptr, 0, bytes) };
        b
    }

    pub fn from_slice<T: Copy>(v: &[T]) -> Self {
        let bytes = std::mem::size_of_val(v);
        let b = Self::new(bytes);
        // SAFETY: `bytes` writable bytes; T is Copy plain data.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr() as *const u8, b.ptr, bytes) };
        b
    }

    /// The contents as `T`s (the byte length must be a multiple of `size_of::<T>()`).
    pub fn to_vec<T: Copy>(&self) -> Vec<T> {
        let n = self.bytes / std::mem::size_of::<T>();
        let mut v = Vec::with_capacity(n);
        // SAFETY: n * size_of::<T>() <= bytes readable bytes, copied into fresh capacity; the
        // emulator's allocations are 16-byte aligned.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr,
                v.as_mut_ptr() as *mut u8,
                n * std::mem::size_of::<T>(),
            );
            v.set_len(n);
        }
        v
    }

    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    fn dev(&self) -> DevBuf {
        DevBuf {
            ptr: self.ptr as u64,
            bytes: self.bytes,
        }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by fp8nsa_emu_alloc, freed once.
        unsafe { fp8nsa_emu_free(self.ptr as *mut c_void) };
    }
}

/// Runs `plan` over `args` (the plan builder's argument order) on the emulator.
pub fn execute(plan: &Plan, args: &mut [&mut HostBuf]) -> Result<()> {
    let bufs: Vec<DevBuf> = args.iter().map(|b| b.dev()).collect();
    step::run(&Emulator, plan, &bufs)
}

/// The CPU emulator as a [`Machine`]: kernels on fibers, library steps as host formulas.
struct Emulator;

impl Machine for Emulator {
    type Tmp = HostBuf;

    fn alloc(&self, t: &Tmp) -> Result<HostBuf> {
        Ok(if t.zeroed {
            HostBuf::zeroed(t.bytes)
        } else {
            HostBuf::new(t.bytes)
        })
    }

    fn buf(&self, t: &HostBuf) -> DevBuf {
        t.dev()
    }

    fn kernel(&self, k: &Kernel, args: &mut KernelArgs) -> Result<()> {
        launch(k, args)
    }

    fn gemm(&self, g: &Gemm, bufs: &Bufs<'_>) -> Result<()> {
        host_gemm(g, bufs)
    }

    fn block_scaled_gemm(&self, g: &BlockScaledGemm, bufs: &Bufs<'_>) -> Result<()> {
        host_block_scaled(g, bufs)
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: both hold `bytes` (checked by `step::run`); emulator memory of one plan.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }
}

/// Whether the emulator holds kernel `name`.
pub fn has_kernel(name: &str) -> bool {
    let c = CString::new(name).expect("kernel names have no NUL");
    // SAFETY: a NUL-terminated name.
    unsafe { fp8nsa_emu_has_kernel(c.as_ptr()) == 1 }
}

fn launch(k: &Kernel, args: &mut KernelArgs) -> Result<()> {
    let mut ptrs = args.pointers();
    let name = CString::new(k.name.as_str()).expect("kernel names have no NUL");
    let mut err = vec![0u8; 1024];
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(8) as u32;
    // SAFETY: one pointer per kernel parameter, each to storage of the parameter's C type that
    // outlives the call (the kernels' signatures unpack them); buffers are emulator memory.
    let rc = unsafe {
        fp8nsa_emu_launch(
            name.as_ptr(),
            k.grid.0,
            k.grid.1,
            k.grid.2,
            k.block,
            k.smem,
            ptrs.as_mut_ptr(),
            workers,
            err.as_mut_ptr() as *mut c_char,
            err.len(),
        )
    };
    if rc != 0 {
        let msg =
            String::from_utf8_lossy(&err[..err.iter().position(|&c| c == 0).unwrap_or(err.len())])
                .into_owned();
        return Err(crate::error::Error::Unsupported {
            op: "emulator",
            reason: msg,
        });
    }
    Ok(())
}

/// Element `i` of `b` (bounds-checked: a plan whose library step overruns its buffer panics
/// here instead of reading past it).
fn read(b: DevBuf, dtype: Dtype, i: usize) -> f64 {
    assert!(
        (i + 1) * dtype.size() <= b.bytes,
        "library step reads past its buffer"
    );
    let p = b.ptr as *const u8;
    // SAFETY: element i lies within the buffer's `bytes` (asserted above), emulator memory
    // alive for the whole plan.
    unsafe {
        match dtype {
            Dtype::F32 => (p as *const f32).add(i).read_unaligned() as f64,
            Dtype::Bf16 => {
                half::bf16::from_bits((p as *const u16).add(i).read_unaligned()).to_f64()
            }
            Dtype::F16 => half::f16::from_bits((p as *const u16).add(i).read_unaligned()).to_f64(),
        }
    }
}

/// Writes element `i` of `b` (bounds-checked as [`read`]).
fn write(b: DevBuf, dtype: Dtype, i: usize, v: f64) {
    assert!(
        (i + 1) * dtype.size() <= b.bytes,
        "library step writes past its buffer"
    );
    let p = b.ptr as *mut u8;
    // SAFETY: as in `read`.
    unsafe {
        match dtype {
            Dtype::F32 => (p as *mut f32).add(i).write_unaligned(v as f32),
            Dtype::Bf16 => (p as *mut u16)
                .add(i)
                .write_unaligned(half::bf16::from_f64(v).to_bits()),
            Dtype::F16 => (p as *mut u16)
                .add(i)
                .write_unaligned(half::f16::from_f64(v).to_bits()),
        }
    }
}

/// cuBLAS's column-major GEMM, C = op(A) op(B), alpha 1, beta 0.
fn host_gemm(g: &Gemm, bufs: &Bufs<'_>) -> Result<()> {
    let (a, b, c) = (bufs.get(g.a), bufs.get(g.b), bufs.get(g.c));
    for j in 0..g.n {
        for i in 0..g.m {
            let mut acc = 0f64;
            for l in 0..g.k {
                let av = read(
                    a,
                    g.dtype,
                    if g.trans_a {
                        l + i * g.lda
                    } else {
                        i + l * g.lda
                    },
                );
                let bv = read(
                    b,
                    g.dtype,
                    if g.trans_b {
                        j + l * g.ldb
                    } else {
                        l + j * g.ldb
                    },
                );
                acc += av * bv;
            }
            write(c, g.dtype, i + j * g.ldc, acc);
        }
    }
    Ok(())
}

/// The buffer's contents as `T`s.
fn vec_of<T: Copy>(b: DevBuf) -> Vec<T> {
    let n = b.bytes / std::mem::size_of::<T>();
    let mut v = Vec::with_capacity(n);
    // SAFETY: the buffer holds `bytes` readable bytes (an argument's or a temporary's
    // emulator memory), copied into fresh capacity of n * size_of::<T>() <= bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(
            b.ptr as *const u8,
            v.as_mut_ptr() as *mut u8,
            n * std::mem::size_of::<T>(),
        );
        v.set_len(n);
    }
    v
}

/// e4m3fn to f64.
fn e4m3(b: u8) -> f64 {
    let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0xf) as i32;
    let m = (b & 7) as f64;
    if b & 0x7f == 0x7f {
        return f64::NAN;
    }
    s * if e == 0 {
        m * 2f64.powi(-9)
    } else {
        (1.0 + m / 8.0) * 2f64.powi(e - 7)
    }
}

/// cuBLASLt's block-scaled GEMM as its documentation defines it: weight scales `BLK128x128_32F`
/// (K-block index contiguous, rows of L4 = round_up(ceil(K/128), 4)), activation scales
/// `VEC128_32F` (token index contiguous), D column-major N x Mp.
fn host_block_scaled(g: &BlockScaledGemm, bufs: &Bufs<'_>) -> Result<()> {
    let (w, ws, x, xs, d) = (
        bufs.get(g.w),
        bufs.get(g.w_scales),
        bufs.get(g.x),
        bufs.get(g.x_scales),
        bufs.get(g.d),
    );
    let l = g.k.div_ceil(128);
    let l4 = l.next_multiple_of(4);
    let (wv, xv) = (vec_of::<u8>(w), vec_of::<u8>(x));
    let (wsv, xsv) = (vec_of::<f32>(ws), vec_of::<f32>(xs));
    for col in 0..g.mp {
        for row in 0..g.n {
            let mut acc = 0f64;
            for kb in 0..l {
                let mut part = 0f64;
                for k in kb * 128..((kb + 1) * 128).min(g.k) {
                    part += e4m3(wv[row * g.k + k]) * e4m3(xv[col * g.k + k]);
                }
                acc += part * wsv[(row / 128) * l4 + kb] as f64 * xsv[kb * g.mp + col] as f64;
            }
            write(d, g.out, col * g.n + row, acc);
        }
    }
    Ok(())
}
