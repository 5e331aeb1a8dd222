//! A plugin, a client on its first device, and a cache of compiled programs: what the layers
//! need to run through PJRT.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crate::error::{invalid, Error, Result};
use crate::programs::{self, AttnShape};
use crate::safe::{Api, Buffer, Client, Device, ElementType, Executable};
use fp8nsa_types::{ActQuant, LinearShape, Settings, TpuKernel, PJRT_PLUGIN_ENV};

/// The XLA CPU plugin of the `xla-cpu-pjrt` wheel, if pip installed it where
/// [`fp8nsa_types::python_site_dirs`] looks.
pub fn locate_cpu_plugin() -> Option<PathBuf> {
    fp8nsa_types::find_python_package_file(fp8nsa_types::XLA_CPU_PLUGIN)
}

/// An fp8 weight resident on the device: uploaded once, used by every call.
pub struct DeviceWeight {
    wq: Buffer,
    sw: Buffer,
    bias: Option<Buffer>,
    n: usize,
    k: usize,
    block: [usize; 2],
}

impl std::fmt::Debug for DeviceWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceWeight([{}, {}] in {:?} blocks)",
            self.n, self.k, self.block
        )
    }
}

/// A loaded PJRT plugin with a client, its first device and compiled programs.
pub struct PjrtRuntime {
    api: &'static Api,
    client: Client,
    device: Device,
    platform: String,
    path: String,
    cache: Mutex<HashMap<String, Arc<Executable>>>,
    fp8_max: std::sync::OnceLock<Buffer>,
    tpu_programs: Option<crate::tpu::TpuManifest>,
}

impl std::fmt::Debug for PjrtRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PjrtRuntime({}, platform {})", self.path, self.platform)
    }
}

impl PjrtRuntime {
    /// Loads the plugin at `path` and opens a client on it.
    pub fn load(path: &str) -> Result<Self> {
        let api = Api::load(path)?;
        let client = api.client()?;
        let device = client.device()?;
        let platform = client.platform_name()?;
        tracing::info!(plugin = path, %platform, version = ?api.version(), "PJRT plugin loaded");
        Ok(Self {
            api,
            client,
            device,
            platform,
            path: path.to_string(),
            cache: Mutex::new(HashMap::new()),
            fp8_max: std::sync::OnceLock::new(),
            tpu_programs: None,
        })
    }

    /// The plugin named by `FP8NSA_PJRT_PLUGIN`, else the installed XLA CPU plugin.
    pub fn from_env() -> Result<Self> {
        let path = match &Settings::global().pjrt_plugin {
            Some(p) => p.clone(),
            None => locate_cpu_plugin().ok_or_else(|| Error::Load {
                path: "(none)".into(),
                message: format!(
                    "set {PJRT_PLUGIN_ENV} to a PJRT plugin, or `pip install xla-cpu-pjrt` for the CPU one"
                ),
            })?,
        };
        Self::load(&path.to_string_lossy())
    }

    /// Uses the Pallas kernels exported to `dir` (by `fp8nsa export-tpu`) for `TpuKernel::V2`
    /// and `V3` calls on a TPU.
    pub fn with_tpu_programs(mut self, dir: &std::path::Path) -> Result<Self> {
        self.tpu_programs = Some(crate::tpu::TpuManifest::load(dir)?);
        Ok(self)
    }

    /// The platform the plugin reports (`cpu`, `cuda`, `tpu`, ...).
    pub fn platform(&self) -> &str {
        &self.platform
    }

    pub fn api_version(&self) -> (i32, i32) {
        self.api.version()
    }

    /// Programs compiled so far.
    pub fn cached_programs(&self) -> usize {
        self.cache.lock().map_or(0, |c| c.len())
    }

    /// Errors unless `kernel` can run on this plugin's platform.
    pub fn check_kernel(&self, kernel: TpuKernel) -> Result<()> {
        match kernel {
            TpuKernel::V1 => Ok(()),
            _ if self.platform == "tpu" && self.tpu_programs.is_some() => Ok(()),
            _ if self.platform == "tpu" => Err(invalid(
                "kernel",
                format!("{kernel:?} needs exported programs: run fp8nsa export-tpu and pass the folder to with_tpu_programs"),
            )),
            _ => Err(Error::NotOnPlatform {
                what: format!("TpuKernel::{kernel:?}"),
                platform: self.platform.clone(),
            }),
        }
    }

    /// Compiles `text` once per `key` and caches the executable.
    pub fn executable(&self, key: &str, text: impl FnOnce() -> String) -> Result<Arc<Executable>> {
        if let Some(e) = self.cache.lock().expect("program cache").get(key) {
            return Ok(e.clone());
        }
        let text = text();
        let t = std::time::Instant::now();
        let exe = Arc::new(self.client.compile(
            &text,
            "mlir",
            &crate::proto::compile_options(0, 1, 1),
        )?);
        tracing::debug!(
            key,
            ms = t.elapsed().as_secs_f64() * 1e3,
            "PJRT program compiled"
        );
        self.cache
            .lock()
            .expect("program cache")
            .insert(key.to_string(), exe.clone());
        Ok(exe)
    }

    fn upload_f32(&self, v: &[f32], dims: &[usize]) -> Result<Buffer> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let dims: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        self.client
            .upload(&bytes, ElementType::F32, &dims, &self.device)
    }

    /// Uploads an fp8 weight (`codes [n, k]`, `scales [ceil(n/bn), ceil(k/bk)]`, `bias [n]`).
    pub fn upload_weight(
        &self,
        codes: &[u8],
        scales: &[f32],
        bias: Option<&[f32]>,
        n: usize,
        k: usize,
        block: [usize; 2],
    ) -> Result<DeviceWeight> {
        if n == 0 || k == 0 || block.contains(&0) {
            return Err(invalid(
                "weight",
                format!("needs n, k and block sides >= 1, got n = {n}, k = {k}, block = {block:?}"),
            ));
        }
        let (nb, kb) = (n.div_ceil(block[0]), k.div_ceil(block[1]));
        if scales.len() != nb * kb {
            return Err(invalid(
                "scales",
                format!("{} values for [{nb}, {kb}]", scales.len()),
            ));
        }
        Ok(DeviceWeight {
            wq: self
                .client
                .upload(codes, ElementType::U8, &[n as i64, k as i64], &self.device)?,
            sw: self.upload_f32(scales, &[nb, kb])?,
            bias: bias.map(|b| self.upload_f32(b, &[n])).transpose()?,
            n,
            k,
            block,
        })
    }

    /// `y [m, n] = x [m, k] · Wᵀ (+ bias)` with the fp8 contract, through the v1 program.
    pub fn fp8_linear(
        &self,
        x: &[f32],
        m: usize,
        w: &DeviceWeight,
        act: ActQuant,
        kernel: TpuKernel,
    ) -> Result<Vec<f32>> {
        self.check_kernel(kernel)?;
        if x.len() != m * w.k || m == 0 {
            return Err(invalid(
                "x",
                format!("{} values for [{m}, {}]", x.len(), w.k),
            ));
        }
        let shape = LinearShape::new(m, w.n, w.k, w.block[0], w.block[1])?;
        if act == (ActQuant::Block2d { bm: 0 }) {
            return Err(invalid("act", "Block2d needs bm >= 1"));
        }
        if kernel != TpuKernel::V1 {
            return self.fp8_linear_exported(x, m, w, act, kernel);
        }
        let key = format!("fp8_linear {shape:?} {act:?} bias={}", w.bias.is_some());
        let exe = self.executable(&key, || programs::fp8_linear(shape, act, w.bias.is_some()))?;
        let xb = self.upload_f32(x, &[m, w.k])?;
        let mut args = vec![&xb, &w.wq, &w.sw];
        if let Some(b) = &w.bias {
            args.push(b);
        }
        if act != ActQuant::None {
            if self.fp8_max.get().is_none() {
                let _ = self.fp8_max.set(self.upload_f32(&[448.0], &[])?);
            }
            args.push(self.fp8_max.get().expect("set above"));
        }
        let out = exe.execute(&args)?;
        out[0].to_f32()
    }

    /// A Pallas kernel from the export folder: rows padded to the program's bucket, the bias
    /// added on the host (the kernels take none).
    fn fp8_linear_exported(
        &self,
        x: &[f32],
        m: usize,
        w: &DeviceWeight,
        act: ActQuant,
        kernel: TpuKernel,
    ) -> Result<Vec<f32>> {
        let manifest = self
            .tpu_programs
            .as_ref()
            .ok_or_else(|| invalid("kernel", "no TPU programs loaded"))?;
        let entry = manifest.select(kernel, m, w.n, w.k, w.block, act)?;
        let path = manifest.stablehlo_path(entry);
        let key = path.to_string_lossy().into_owned();
        let text = match self.cache.lock().expect("program cache").contains_key(&key) {
            true => String::new(),
            false => std::fs::read_to_string(&path)
                .map_err(|e| invalid("tpu program", format!("{}: {e}", path.display())))?,
        };
        let exe = self.executable(&key, || text)?;
        let xb = self.upload_f32(
            &crate::tpu::pad_rows(x, m, w.k, entry.m_bucket),
            &[entry.m_bucket, w.k],
        )?;
        let mut y = exe.execute(&[&xb, &w.wq, &w.sw])?[0].to_f32()?;
        y.truncate(m * w.n);
        if let Some(b) = &w.bias {
            let b = b.to_f32()?;
            for row in y.chunks_mut(w.n) {
                row.iter_mut().zip(&b).for_each(|(v, b)| *v += b);
            }
        }
        Ok(y)
    }

    /// Masked selection attention of one sequence (see [`programs::nsa_selection`]).
    pub fn nsa_selection(
        &self,
        s: AttnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        mask: &[f32],
        scale: f32,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        if s.hkv == 0 || !s.hq.is_multiple_of(s.hkv) || [s.tq, s.tk, s.d, s.dv].contains(&0) {
            return Err(invalid(
                "shape",
                format!("{s:?}: needs Hq a multiple of Hkv and no empty dim"),
            ));
        }
        let key = format!("nsa_selection {s:?} scale={scale}");
        let exe = self.executable(&key, || programs::nsa_selection(s, scale))?;
        let bufs = [
            self.upload_f32(q, &[s.tq, s.hq, s.d])?,
            self.upload_f32(k, &[s.tk, s.hkv, s.d])?,
            self.upload_f32(v, &[s.tk, s.hkv, s.dv])?,
            self.upload_f32(mask, &[s.hkv, s.tq, s.tk])?,
        ];
        let out = exe.execute(&bufs.iter().collect::<Vec<_>>())?;
        Ok((out[0].to_f32()?, out[1].to_f32()?))
    }

    /// The optimized program of a cached executable, rendered as HLO-like text.
    pub fn optimized_hlo(&self, key: &str) -> Result<String> {
        let exe = self
            .cache
            .lock()
            .expect("program cache")
            .get(key)
            .cloned()
            .ok_or_else(|| invalid("key", format!("no program compiled under {key:?}")))?;
        let (format, bytes) = exe.optimized_program()?;
        Ok(crate::proto::render_hlo(&bytes, &format).join("\n"))
    }
}
