use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};

use crate::config::{LlamaConfig, RopeStyle};
use crate::error::{invalid, Error, Result};
use crate::shards::Shards;

/// Named tensors in Hugging Face Llama naming (`model.layers.N.self_attn.q_proj.weight`,
/// ...): f32 for dense weights, F8E4M3 bytes plus `weight_scale_inv` for fp8 ones. A
/// checkpoint directory's tensors stay on disk until a layer takes one ([`Self::get`]), so
/// building a model holds each weight once. Loaded on the host; a model built with
/// [`crate::ModelOptions::device`] takes them on its device.
#[derive(Clone, Debug, Default)]
pub struct Weights {
    map: HashMap<String, Tensor>,
    /// Where [`Self::get`] hands tensors out (`None`: where they are, the host).
    device: Option<Device>,
    /// Tensors of safetensors shards, read when taken.
    shards: Option<Arc<Shards>>,
    /// Block size of stored fp8 weights (`quantization_config.weight_block_size`).
    pub fp8_block: Option<[usize; 2]>,
    /// `quantization_config.modules_to_not_convert`.
    pub modules_to_not_convert: Vec<String>,
}

/// What the header of a GGUF file (versions 2 and 3) declares, read before candle's reader
/// sees the file: the tensor and metadata counts (candle keeps both in maps, so a repeated
/// name would silently replace the first), and `general.alignment` when it is stored as an
/// integer.
#[derive(Debug, Default)]
struct GgufHeader {
    tensors: Option<u64>,
    kvs: Option<u64>,
    alignment: Option<u64>,
}

/// [`GgufHeader`]; fields stay `None` where the header cannot be walked (candle's reader then
/// says what is wrong). Leaves the file at its start. Every length is bounded by the file's
/// size, so a corrupt header cannot make this allocate much or loop for long.
fn gguf_header(file: &mut std::fs::File) -> std::io::Result<GgufHeader> {
    use std::io::{BufReader, Read, Seek, SeekFrom};
    fn u32_(r: &mut impl Read) -> std::io::Result<u32> {
        let mut b = [0u8; 4];
        r.read_exact(&mut b)?;
        Ok(u32::from_le_bytes(b))
    }
    fn u64_(r: &mut impl Read) -> std::io::Result<u64> {
        let mut b = [0u8; 8];
        r.read_exact(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }
    fn skip(r: &mut impl Read, n: u64) -> std::io::Result<()> {
        let got = std::io::copy(&mut r.take(n), &mut std::io::sink())?;
        if got < n {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok(())
    }
    // bytes of one value of a fixed-size type; None for strings (8) and arrays (9)
    fn width(t: u32) -> Option<u64> {
        match t {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        }
    }
    fn walk(r: &mut impl Read, size: u64, h: &mut GgufHeader) -> std::io::Result<Option<u64>> {
        let too_long = || std::io::Error::from(std::io::ErrorKind::InvalidData);
        let mut magic = [0u8; 4];
        r.read_exact(&mut magic)?;
        let version = u32_(r)?;
        if &magic != b"GGUF" || !(2..=3).contains(&version) {
            return Ok(None);
        }
        h.tensors = Some(u64_(r)?);
        let kvs = u64_(r)?;
        h.kvs = Some(kvs);
        // every entry takes at least 12 bytes, so kvs is bounded by the size
        for _ in 0..kvs.min(size / 12) {
            let klen = u64_(r)?;
            if klen > size {
                return Err(too_long());
            }
            let mut key = vec![0u8; klen as usize];
            r.read_exact(&mut key)?;
            let t = u32_(r)?;
            if key == b"general.alignment" {
                // the 8- to 32-bit integer types candle's reader takes the alignment from (it
                // uses its default for any other type); only whether it is zero matters here
                return Ok(match (t, width(t)) {
                    (0..=5, Some(w)) => {
                        let mut b = [0u8; 4];
                        r.read_exact(&mut b[..w as usize])?;
                        Some(u32::from_le_bytes(b) as u64)
                    }
                    _ => None,
                });
            }
            let (elem, count) = if t == 9 { (u32_(r)?, u64_(r)?) } else { (t, 1) };
            match (elem, width(elem)) {
                (_, Some(w)) => {
                    let n = count
                        .checked_mul(w)
                        .filter(|n| *n <= size)
                        .ok_or_else(too_long)?;
                    skip(r, n)?
                }
                (8, None) => {
                    for _ in 0..count.min(size) {
                        let n = u64_(r)?;
                        if n > size {
                            return Err(too_long());
                        }
                        skip(r, n)?;
                    }
                }
                _ => return Ok(None),
            }
        }
        Ok(None)
    }
    let size = file.metadata()?.len();
    file.seek(SeekFrom::Start(0))?;
    let mut h = GgufHeader::default();
    h.alignment = walk(&mut BufReader::new(&mut *file), size, &mut h).unwrap_or(None);
    file.seek(SeekFrom::Start(0))?;
    Ok(h)
}

fn file_err(path: &Path, msg: impl ToString) -> Error {
    Error::File {
        path: path.to_path_buf(),
        msg: msg.to_string(),
    }
}

impl Weights {
    pub fn from_tensors(map: HashMap<String, Tensor>) -> Self {
        Self {
            map,
            ..Self::default()
        }
    }

    /// Hands every tensor out on `device` from now on: [`Self::get`] moves each as a layer
    /// takes it, so a checkpoint directory's tensors go from disk to the device one at a time
    /// ([`crate::ModelOptions::device`]).
    pub(crate) fn on_device(mut self, device: &Device) -> Self {
        self.device = Some(device.clone());
        self
    }

    /// Adds (or replaces) a tensor, e.g. to complete generated weights.
    pub fn insert(&mut self, name: impl Into<String>, tensor: Tensor) {
        self.map.insert(name.into(), tensor);
    }

    /// Every tensor name, in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.map
            .keys()
            .chain(self.shards.iter().flat_map(|s| s.names()))
    }

    /// Whether a tensor `name` exists (nothing is read).
    pub fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
            || self
                .shards
                .as_ref()
                .is_some_and(|s| s.entry(name).is_some())
    }

    /// The dims of `name` (nothing is read).
    pub fn dims(&self, name: &str) -> Option<Vec<usize>> {
        match self.map.get(name) {
            Some(t) => Some(t.dims().to_vec()),
            None => Some(self.shards.as_ref()?.entry(name)?.dims.clone()),
        }
    }

    /// `name` as a layer takes it: fp8 codes (F8E4M3 / U8) and f32 as stored, every other
    /// dtype converted to f32. A tensor of a checkpoint directory is read from its shard now.
    pub fn get(&self, name: &str) -> Result<Tensor> {
        self.get_opt(name)?
            .ok_or_else(|| Error::MissingTensor(name.to_string()))
    }

    /// [`Self::get`], `None` when there is no such tensor (a read that fails is an error).
    pub fn get_opt(&self, name: &str) -> Result<Option<Tensor>> {
        self.read(name)?.map(|t| self.place(t)).transpose()
    }

    /// `t` on the device [`Self::get`] hands tensors out on.
    fn place(&self, t: Tensor) -> Result<Tensor> {
        Ok(match &self.device {
            Some(d) if !t.device().same_device(d) => t.to_device(d)?,
            _ => t,
        })
    }

    /// `name` where it is (the host), converted as [`Self::get`] says.
    fn read(&self, name: &str) -> Result<Option<Tensor>> {
        if let Some(t) = self.map.get(name) {
            return Ok(Some(t.clone()));
        }
        let Some(t) = self
            .shards
            .as_ref()
            .map(|s| s.read(name))
            .transpose()?
            .flatten()
        else {
            return Ok(None);
        };
        Ok(Some(match t.dtype() {
            DType::F8E4M3 | DType::U8 | DType::F32 => t,
            _ => t.to_dtype(DType::F32)?,
        }))
    }

    /// `(data, scales, block)` when `{module}.weight` is stored in fp8. Both stay on the host
    /// whatever [`crate::ModelOptions::device`] says: an fp8 layer prepares its weight for the
    /// device it runs on at its first call.
    pub fn fp8(&self, module: &str) -> Result<Option<(Tensor, Tensor, [usize; 2])>> {
        let Some(scales) = self.read(&format!("{module}.weight_scale_inv"))? else {
            return Ok(None);
        };
        let name = format!("{module}.weight");
        let data = self.read(&name)?.ok_or(Error::MissingTensor(name))?;
        let block = self.fp8_block.unwrap_or([128, 128]);
        Ok(Some((data, scales, block)))
    }

    /// `{module}.weight` as f32, dequantized when stored in fp8 (a router, or a projection a
    /// layer folds into others), on the device [`Self::get`] hands tensors out on.
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use fp8nsa_models::Weights;
    ///
    /// let mut w = Weights::default();
    /// // a stored fp8 weight: e4m3 1.0 (0x38) everywhere, one 128x128 block scaled by 0.5
    /// w.insert("gate.weight", Tensor::full(0x38u8, (4, 8), &Device::Cpu)?);
    /// w.insert("gate.weight_scale_inv", Tensor::full(0.5f32, (1, 1), &Device::Cpu)?);
    /// let d = w.dense("gate")?;
    /// assert_eq!(d.dims(), &[4, 8]);
    /// assert!(d.flatten_all()?.to_vec1::<f32>()?.iter().all(|&x| x == 0.5));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn dense(&self, module: &str) -> Result<Tensor> {
        match self.fp8(module)? {
            Some((data, scales, block)) => {
                let t = fp8nsa_ops::Fp8BlockWeight::from_parts(data, scales, block)?
                    .dequantize(DType::F32)?;
                self.place(t)
            }
            None => self.get(&format!("{module}.weight")),
        }
    }

    /// Seeded N(0, 0.02) weights (norms at 1) for `cfg`, in the Qwen3-MoE expert layout for
    /// its MoE layers: a model to run without a download.
    pub fn random(cfg: &LlamaConfig, seed: u64) -> Result<Self> {
        cfg.validate()?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let normal = Normal::new(0f32, 0.02).expect("valid std");
        let mut map = HashMap::new();
        let mut put = |name: String, dims: &[usize], rng: &mut rand::rngs::StdRng| -> Result<()> {
            let n = dims.iter().product();
            let v: Vec<f32> = (0..n).map(|_| normal.sample(rng)).collect();
            map.insert(name, Tensor::from_vec(v, dims, &Device::Cpu)?);
            Ok(())
        };
        let mut ones = Vec::new();
        let (h, i, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim());
        let (q, kv) = (cfg.num_attention_heads * hd, cfg.kv_heads() * hd);
        put(
            "model.embed_tokens.weight".into(),
            &[cfg.vocab_size, h],
            &mut rng,
        )?;
        if cfg.tie_word_embeddings == Some(false) {
            put("lm_head.weight".into(), &[cfg.vocab_size, h], &mut rng)?;
        }
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let mut mats = vec![
                ("self_attn.q_proj".to_string(), [q, h]),
                ("self_attn.k_proj".into(), [kv, h]),
                ("self_attn.v_proj".into(), [kv, h]),
                ("self_attn.o_proj".into(), [h, q]),
            ];
            if cfg.moe.is_moe_layer(l) {
                // Qwen3-MoE's layout: router `mlp.gate`, experts `mlp.experts.{e}.*`
                let mi = cfg.moe.moe_intermediate_size;
                mats.push(("mlp.gate".into(), [cfg.moe.num_experts, h]));
                for e in 0..cfg.moe.num_experts {
                    mats.push((format!("mlp.experts.{e}.gate_proj"), [mi, h]));
                    mats.push((format!("mlp.experts.{e}.up_proj"), [mi, h]));
                    mats.push((format!("mlp.experts.{e}.down_proj"), [h, mi]));
                }
            } else {
                mats.push(("mlp.gate_proj".into(), [i, h]));
                mats.push(("mlp.up_proj".into(), [i, h]));
                mats.push(("mlp.down_proj".into(), [h, i]));
            }
            for (n, dims) in mats {
                put(format!("{p}.{n}.weight"), &dims, &mut rng)?;
            }
            for n in ["input_layernorm", "post_attention_layernorm"] {
                ones.push(format!("{p}.{n}.weight"));
            }
        }
        ones.push("model.norm.weight".into());
        for name in ones {
            map.insert(name, Tensor::ones(h, DType::F32, &Device::Cpu)?);
        }
        Ok(Self::from_tensors(map))
    }

    /// A Hugging Face model directory: `config.json` and `*.safetensors`. fp8 weights
    /// (`weight` F8_E4M3 + `weight_scale_inv`) stay fp8; everything else becomes f32.
    pub fn load_hf_dir(dir: &Path) -> Result<(LlamaConfig, Self)> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| file_err(&cfg_path, e))?;
        let mut cfg: LlamaConfig =
            serde_json::from_str(&text).map_err(|e| file_err(&cfg_path, e))?;
        cfg.rope_style = RopeStyle::Half;
        cfg.validate()?;
        let raw: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| file_err(&cfg_path, e))?;
        Ok((cfg, Self::open_hf_dir(dir, &raw)?))
    }

    /// The tensors of a Hugging Face directory whose `config.json` is `raw` (already parsed
    /// by the caller for its own architecture): the quantization settings and the shards'
    /// headers, checked; no tensor is read yet.
    pub(crate) fn open_hf_dir(dir: &Path, raw: &serde_json::Value) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let mut w = Self::default();
        if let Some(qc) = raw.get("quantization_config") {
            if let Some(b) = qc["weight_block_size"].as_array() {
                let b: Vec<usize> = b
                    .iter()
                    .filter_map(|x| x.as_u64().map(|x| x as usize))
                    .collect();
                if b.len() != 2 || b.contains(&0) {
                    return Err(file_err(
                        &cfg_path,
                        "weight_block_size must be two positive integers",
                    ));
                }
                w.fp8_block = Some([b[0], b[1]]);
            }
            if let Some(m) = qc["modules_to_not_convert"].as_array() {
                w.modules_to_not_convert = m
                    .iter()
                    .filter_map(|x| x.as_str().map(String::from))
                    .collect();
            }
        }
        let shards = Shards::open(&shard_files(dir)?)?;
        let scale_name = |name: &str| format!("{name}_scale_inv");
        for name in shards.names() {
            let e = shards.entry(name).expect("a listed name");
            // block scales are values: a checkpoint storing them as integers is broken, and
            // converting those by value would scale every output wrongly
            if name.ends_with(".weight_scale_inv")
                && !matches!(e.dtype, DType::F32 | DType::BF16 | DType::F16 | DType::F64)
            {
                return Err(file_err(
                    dir,
                    format!(
                        "{name} is {:?}; block scales must be F32, BF16, F16 or F64",
                        e.dtype
                    ),
                ));
            }
            // an fp8 weight is codes and scales: without the scales it is no weight at all
            if name.ends_with(".weight")
                && matches!(e.dtype, DType::F8E4M3 | DType::U8)
                && shards.entry(&scale_name(name)).is_none()
            {
                return Err(file_err(
                    dir,
                    format!("{name} is fp8 codes without its {}", scale_name(name)),
                ));
            }
        }
        w.shards = Some(Arc::new(shards));
        Ok(w)
    }

    /// A GGUF file of the llama architecture, every tensor dequantized to f32 on load and
    /// renamed to Hugging Face names. `on_tensor(done, total)` reports progress.
    pub fn load_gguf(
        path: &Path,
        on_tensor: &mut dyn FnMut(usize, usize),
    ) -> Result<(LlamaConfig, Self, gguf_file::Content)> {
        let mut file = std::fs::File::open(path).map_err(|e| file_err(path, e))?;
        // candle's reader divides by the alignment: a file saying 0 would panic inside it
        let header = gguf_header(&mut file).map_err(|e| file_err(path, e))?;
        if header.alignment == Some(0) {
            return Err(file_err(
                path,
                "general.alignment is 0; a GGUF file needs a positive alignment",
            ));
        }
        let content = gguf_file::Content::read(&mut file).map_err(|e| file_err(path, e))?;
        for (what, declared, read) in [
            ("tensor", header.tensors, content.tensor_infos.len()),
            ("metadata key", header.kvs, content.metadata.len()),
        ] {
            if declared.is_some_and(|d| d != read as u64) {
                return Err(file_err(
                    path,
                    format!(
                        "the header declares {} {what}s but {read} distinct names were read: \
                         a {what} name appears more than once",
                        declared.unwrap_or(0)
                    ),
                ));
            }
        }
        // every tensor's size from its dims, with checked arithmetic, within the file: candle
        // would allocate it before reading
        let size = file.metadata().map_err(|e| file_err(path, e))?.len();
        for (name, info) in &content.tensor_infos {
            let elems = info
                .shape
                .dims()
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d as u64));
            let bytes = elems.and_then(|e| {
                let bs = info.ggml_dtype.block_size() as u64;
                (e / bs).checked_mul(info.ggml_dtype.type_size() as u64)
            });
            // no tensor of a model is empty, and candle reads an empty one through a pointer
            // that is not aligned for its element type (an abort under debug assertions)
            if elems == Some(0) {
                return Err(file_err(
                    path,
                    format!(
                        "tensor {name} has no elements (dims {:?})",
                        info.shape.dims()
                    ),
                ));
            }
            let end = bytes
                .and_then(|b| b.checked_add(info.offset))
                .and_then(|b| b.checked_add(content.tensor_data_offset));
            if end.is_none_or(|e| e > size) {
                return Err(file_err(
                    path,
                    format!(
                        "tensor {name} with dims {:?} does not fit in the file ({size} bytes)",
                        info.shape.dims()
                    ),
                ));
            }
        }
        let cfg = config_from_gguf(&content).map_err(|e| file_err(path, e))?;
        let mut names: Vec<String> = content.tensor_infos.keys().cloned().collect();
        names.sort();
        let mut map = HashMap::new();
        for (i, name) in names.iter().enumerate() {
            let q = content
                .tensor(&mut file, name, &Device::Cpu)
                .map_err(|e| file_err(path, e))?;
            let t = q.dequantize(&Device::Cpu)?;
            if let Some(hf) = hf_name(name) {
                map.insert(hf, t);
            }
            on_tensor(i + 1, names.len());
        }
        Ok((cfg, Self::from_tensors(map), content))
    }
}

/// The shards of a checkpoint directory: those `model.safetensors.index.json` names (its
/// `weight_map`) when there is an index, so a stale extra shard beside them is not loaded;
/// every `*.safetensors` otherwise. A shard named in the index must be a file of the
/// directory itself (no separators, no `..`). A tensor the index lists but its shard does not
/// hold is not an error here (published repositories ship such indexes, and other loaders
/// take them): it is `MissingTensor` if and when a layer asks for it.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    let mut files: Vec<PathBuf> = if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| file_err(&index, e))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| file_err(&index, e))?;
        let map = json["weight_map"]
            .as_object()
            .ok_or_else(|| file_err(&index, "no weight_map object"))?;
        let mut names: Vec<&str> = Vec::with_capacity(map.len());
        for (tensor, shard) in map {
            let shard = shard
                .as_str()
                .ok_or_else(|| file_err(&index, format!("{tensor}: the shard is not a string")))?;
            let plain = Path::new(shard)
                .file_name()
                .is_some_and(|f| f == std::ffi::OsStr::new(shard));
            if !plain || shard == ".." || shard == "." {
                return Err(file_err(
                    &index,
                    format!("{tensor}: shard {shard:?} is not a file of this directory"),
                ));
            }
            names.push(shard);
        }
        names.sort_unstable();
        names.dedup();
        names.into_iter().map(|n| dir.join(n)).collect()
    } else {
        std::fs::read_dir(dir)
            .map_err(|e| file_err(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect()
    };
    files.sort();
    if files.is_empty() {
        return Err(file_err(dir, "no .safetensors file"));
    }
    Ok(files)
}

/// GGUF (llama.cpp) tensor names to Hugging Face ones.
fn hf_name(gguf: &str) -> Option<String> {
    let fixed = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, tail) = rest.split_once('.')?;
    let hf = match tail {
        "attn_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

fn config_from_gguf(c: &gguf_file::Content) -> Result<LlamaConfig> {
    let md = &c.metadata;
    let arch = md
        .get("general.architecture")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .unwrap_or_default();
    if arch != "llama" {
        return Err(invalid(
            "general.architecture",
            format!("expected llama, got {arch:?}"),
        ));
    }
    let u = |k: &str| -> Result<usize> {
        md.get(k)
            .ok_or_else(|| invalid("gguf metadata", format!("missing {k}")))?
            .to_u32()
            .map(|v| v as usize)
            .map_err(|e| invalid("gguf metadata", format!("{k}: {e}")))
    };
    let f = |k: &str, default: f64| {
        md.get(k)
            .and_then(|v| v.to_f32().ok())
            .map_or(default, |v| v as f64)
    };
    let heads = u("llama.attention.head_count")?;
    let hidden = u("llama.embedding_length")?;
    if heads == 0 {
        return Err(invalid("llama.attention.head_count", "must be at least 1"));
    }
    let vocab = match md
        .get("tokenizer.ggml.tokens")
        .and_then(|v| v.to_vec().ok())
    {
        Some(t) => t.len(),
        None => u("llama.vocab_size")?,
    };
    let cfg = LlamaConfig {
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: u("llama.feed_forward_length")?,
        num_hidden_layers: u("llama.block_count")?,
        num_attention_heads: heads,
        num_key_value_heads: Some(u("llama.attention.head_count_kv").unwrap_or(heads)),
        head_dim: Some(u("llama.rope.dimension_count").unwrap_or(hidden / heads)),
        rms_norm_eps: f("llama.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta: f("llama.rope.freq_base", 10_000.0),
        max_position_embeddings: u("llama.context_length").unwrap_or(4096),
        tie_word_embeddings: Some(!c.tensor_infos.contains_key("output.weight")),
        bos_token_id: md
            .get("tokenizer.ggml.bos_token_id")
            .and_then(|v| v.to_u32().ok()),
        eos_token_id: md
            .get("tokenizer.ggml.eos_token_id")
            .and_then(|v| v.to_u32().ok())
            .into_iter()
            .collect(),
        hidden_act: "silu".into(),
        rope_scaling: None,
        moe: Default::default(),
        rope_style: RopeStyle::Interleaved,
    };
    cfg.validate()?;
    Ok(cfg)
}
