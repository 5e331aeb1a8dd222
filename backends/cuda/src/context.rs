//! Per-CUDA-context state: the device's capabilities, the PTX modules loaded into the context
//! (lazily, the family picked by compute capability) and per-stream library handles.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::ThreadId;

use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::CudaSlice;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;

use crate::error::{unsupported, Error, Result};
use crate::ptx::{self, Family};

/// What the kernels need to know about a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Compute capability `(major, minor)`.
    pub cc: (i32, i32),
    /// Streaming multiprocessors.
    pub sms: u32,
    /// Dynamic shared memory a block may opt in to, in bytes.
    pub smem_optin: u32,
    /// The PTX family loaded for the device.
    pub family: Family,
}

/// Library handles bound to one stream and used from one thread (candle's default stream is
/// the per-thread stream: the same handle value names a different stream on every thread).
#[derive(Default)]
pub(crate) struct StreamState {
    pub(crate) blas: Option<Arc<cudarc::cublas::CudaBlas>>,
    pub(crate) lt: Option<Arc<LtState>>,
}

pub(crate) struct Gpu {
    ctx: Arc<CudaContext>,
    pub(crate) info: DeviceInfo,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// name -> (function, dynamic shared memory it is cleared for, its static shared memory)
    funcs: Mutex<HashMap<String, (CudaFunction, u32, u32)>>,
    streams: Mutex<StreamStates>,
    /// cuBLASLt problems it refused: not tried again.
    lt_refused: Mutex<std::collections::HashSet<LtProblem>>,
}

/// A cuBLASLt problem: (n, m padded to the token alignment, k stride, output type).
pub(crate) type LtProblem = (usize, usize, usize, crate::step::Dtype);

/// Keyed by (stream handle, thread).
type StreamStates = HashMap<(usize, ThreadId), Arc<Mutex<StreamState>>>;

/// The state of `stream`'s context, created on first use.
pub(crate) fn gpu(stream: &Arc<CudaStream>) -> Result<Arc<Gpu>> {
    static REGISTRY: OnceLock<Mutex<HashMap<usize, Arc<Gpu>>>> = OnceLock::new();
    let ctx = stream.context();
    let key = ctx.cu_ctx() as usize;
    let mut reg = REGISTRY
        .get_or_init(Default::default)
        .lock()
        .expect("gpu registry");
    if let Some(g) = reg.get(&key) {
        return Ok(g.clone());
    }
    let cc = ctx.compute_capability()?;
    let family = Family::for_capability(cc).ok_or_else(|| {
        unsupported(
            "fp8nsa-cuda",
            format!("compute capability {}.{} is below 8.0", cc.0, cc.1),
        )
    })?;
    let attr = |a| -> Result<u32> { Ok(ctx.attribute(a)?.max(0) as u32) };
    let info = DeviceInfo {
        cc,
        sms: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        smem_optin: attr(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )?,
        family,
    };
    let g = Arc::new(Gpu {
        ctx: ctx.clone(),
        info,
        modules: Mutex::default(),
        funcs: Mutex::default(),
        streams: Mutex::default(),
        lt_refused: Mutex::default(),
    });
    reg.insert(key, g.clone());
    Ok(g)
}

/// The device facts fp8nsa-cuda works with, for `stream`'s device.
pub fn device_info(stream: &Arc<CudaStream>) -> Result<DeviceInfo> {
    Ok(gpu(stream)?.info)
}

impl Gpu {
    /// Kernel `name` of kernel file `module`, cleared for `smem` bytes of dynamic shared memory.
    /// The kernel's static shared memory counts against the same per-block budget: without
    /// the opt-in a block gets 48 KB in all, so dynamic memory past `48 KB - static` opts in.
    pub(crate) fn func(&self, module: &'static str, name: &str, smem: u32) -> Result<CudaFunction> {
        if smem > self.info.smem_optin {
            return Err(unsupported(
                "fp8nsa-cuda",
                format!(
                    "{name} needs {smem} bytes of shared memory, the device allows {}",
                    self.info.smem_optin
                ),
            ));
        }
        let mut funcs = self.funcs.lock().expect("function cache");
        if !funcs.contains_key(name) {
            let module_handle = self.module(module)?;
            let f = module_handle.load_function(name).map_err(|e| {
                unsupported(
                    "fp8nsa-cuda",
                    format!("kernel {name} not in module {module} ({e})"),
                )
            })?;
            let fixed = f.shared_size_bytes()?.max(0) as u32;
            funcs.insert(
                name.to_string(),
                (f, (48 * 1024u32).saturating_sub(fixed), fixed),
            );
        }
        let (f, cleared, fixed) = funcs.get_mut(name).expect("inserted above");
        if smem.saturating_add(*fixed) > self.info.smem_optin {
            return Err(unsupported(
                "fp8nsa-cuda",
                format!(
                    "{name} needs {smem} bytes of dynamic and {fixed} of static shared memory, \
                     the device allows {} in all",
                    self.info.smem_optin
                ),
            ));
        }
        if smem > *cleared {
            Self::clear_smem(f, smem)?;
            *cleared = smem;
        }
        Ok(f.clone())
    }

    fn clear_smem(f: &CudaFunction, smem: u32) -> Result<()> {
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )?;
        Ok(())
    }

    fn module(&self, module: &'static str) -> Result<Arc<CudaModule>> {
        let mut mods = self.modules.lock().expect("module cache");
        if let Some(m) = mods.get(module) {
            return Ok(m.clone());
        }
        let text = ptx::find(module, self.info.family).ok_or_else(|| {
            unsupported(
                "fp8nsa-cuda",
                format!(
                    "kernel file {module} is not built for family {} (compute capability {}.{})",
                    self.info.family.name(),
                    self.info.cc.0,
                    self.info.cc.1
                ),
            )
        })?;
        let m = self
            .ctx
            .load_module(Ptx::from_src(text))
            .map_err(Error::from)?;
        mods.insert(module, m.clone());
        Ok(m)
    }

    /// The handles of `stream` on this thread.
    pub(crate) fn stream_state(&self, stream: &Arc<CudaStream>) -> Arc<Mutex<StreamState>> {
        let key = (stream.cu_stream() as usize, std::thread::current().id());
        self.streams
            .lock()
            .expect("stream states")
            .entry(key)
            .or_default()
            .clone()
    }

    pub(crate) fn lt_refused(&self, key: LtProblem) -> bool {
        self.lt_refused.lock().expect("refusals").contains(&key)
    }

    pub(crate) fn refuse_lt(&self, key: LtProblem) {
        self.lt_refused.lock().expect("refusals").insert(key);
    }

    /// cuBLAS bound to `stream`.
    pub(crate) fn blas(&self, stream: &Arc<CudaStream>) -> Result<Arc<cudarc::cublas::CudaBlas>> {
        let state = self.stream_state(stream);
        let mut s = state.lock().expect("stream state");
        if let Some(b) = &s.blas {
            return Ok(b.clone());
        }
        let b = Arc::new(cudarc::cublas::CudaBlas::new(stream.clone())?);
        s.blas = Some(b.clone());
        Ok(b)
    }
}

/// Launch geometry helper: `n` items in blocks of `threads`, capped grid (grid-stride loops).
pub(crate) fn grid_for(n: usize, threads: u32) -> u32 {
    (n.div_ceil(threads as usize)).clamp(1, 65535 * 16) as u32
}

/// Workspace per stream, the size NVIDIA's samples use on Hopper.
pub(crate) const WORKSPACE_BYTES: usize = 32 << 20;
/// (n, mp, k, output type, alignments of A, B, D): what the heuristic's choice depends on.
type AlgoKey = (usize, usize, usize, sys::cudaDataType, [u32; 3]);

/// A cuBLASLt handle with its reused workspace and the algorithms found per problem.
pub(crate) struct LtState {
    pub(crate) handle: sys::cublasLtHandle_t,
    pub(crate) workspace: CudaSlice<u8>,
    pub(crate) algos: Mutex<HashMap<AlgoKey, sys::cublasLtMatmulAlgo_t>>,
}

// SAFETY: the handle is a plain pointer owned by this struct. One state exists per (stream,
// thread) key (`Gpu::stream_state`), and only that thread uses it, on that stream, so the
// handle and workspace are never used concurrently even though the lock is released before use.
unsafe impl Send for LtState {}
// SAFETY: as above.
unsafe impl Sync for LtState {}

impl Drop for LtState {
    fn drop(&mut self) {
        // SAFETY: the handle was created by create_handle and is destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

impl Gpu {
    /// `stream`'s cuBLASLt handle, workspace and algorithm cache, created on first use.
    pub(crate) fn lt(&self, stream: &Arc<CudaStream>) -> Result<Arc<LtState>> {
        let st = self.stream_state(stream);
        let mut s = st.lock().expect("stream state");
        if let Some(l) = &s.lt {
            return Ok(l.clone());
        }
        let l = Arc::new(LtState {
            handle: lt::create_handle()?,
            workspace: stream.alloc_zeros::<u8>(WORKSPACE_BYTES)?,
            algos: Mutex::default(),
        });
        s.lt = Some(l.clone());
        Ok(l)
    }
}
