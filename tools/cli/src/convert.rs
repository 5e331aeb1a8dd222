//! Quantizing a safetensors checkpoint to fp8 e4m3fn with 2-D block scales, in the layout of
//! DeepSeek-V3 / Qwen3-FP8 checkpoints: each converted `X.weight` becomes F8_E4M3 bytes plus an
//! f32 or bf16 `X.weight_scale_inv` (the dequantization multiplier), and `config.json` gains a
//! `quantization_config`. This is the library side of `fp8nsa quantize`.
//!
//! ```no_run
//! use fp8nsa_cli::convert::{quantize_checkpoint, QuantizeOptions};
//! let report = quantize_checkpoint(
//!     "model/".as_ref(),
//!     "model-fp8/".as_ref(),
//!     &QuantizeOptions::default(), // 128x128 blocks, embeddings / norms / lm_head kept
//!     &mut |_name, _bytes| {},
//! )?;
//! println!("{} tensors converted", report.converted.len());
//! # Ok::<(), fp8nsa_cli::Error>(())
//! ```

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use regex_lite::Regex;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use fp8nsa::{Fp8BlockWeight, ScaleDType};

use crate::{Error, Result};

/// The Hugging Face index of a sharded checkpoint.
const INDEX_FILE: &str = "model.safetensors.index.json";

/// What to convert and how.
#[derive(Clone, Debug)]
pub struct QuantizeOptions {
    /// `[bn, bk]`; `[128, 128]` by default (what DeepSeek-V3 and Qwen3-FP8 ship).
    pub block: [usize; 2],
    /// Tensors whose name matches are candidates (they must also be 2-D floats).
    pub include: String,
    /// Candidates whose name matches are left as they are and listed in
    /// `modules_to_not_convert`.
    pub exclude: String,
    /// The dtype of the written `weight_scale_inv`: f32 (DeepSeek-V3's, the default) or bf16
    /// (Qwen3-FP8's; each scale rounded up to bf16 before the codes are computed).
    pub scale_dtype: ScaleDType,
}

impl Default for QuantizeOptions {
    fn default() -> Self {
        Self {
            block: [128, 128],
            include: r"\.weight$".into(),
            exclude: r"(embed|lm_head|norm|mlp\.gate\.weight$)".into(),
            scale_dtype: ScaleDType::F32,
        }
    }
}

/// What a conversion did.
#[derive(Clone, Debug, Default)]
pub struct QuantizeReport {
    /// Weights converted to fp8 (tensor names).
    pub converted: Vec<String>,
    /// 2-D float weights that matched `include` but also `exclude` (module names).
    pub not_converted: Vec<String>,
    /// Files written.
    pub written: Vec<PathBuf>,
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// The `quantization_config` object written into the config.
    pub quantization_config: serde_json::Value,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn invalid(arg: &'static str, msg: impl Into<String>) -> Error {
    Error::Invalid {
        arg,
        msg: msg.into(),
    }
}

fn candle_dtype(d: Dtype) -> Option<DType> {
    match d {
        Dtype::F32 => Some(DType::F32),
        Dtype::BF16 => Some(DType::BF16),
        Dtype::F16 => Some(DType::F16),
        _ => None,
    }
}

/// Total bytes of the tensors a run would convert, for progress reporting.
pub fn bytes_to_convert(input: &Path, opts: &QuantizeOptions) -> Result<u64> {
    let (include, exclude) = regexes(opts)?;
    let mut total = 0u64;
    for file in input_files(input)? {
        let bytes = std::fs::read(&file).map_err(io_err(&file))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|source| Error::Safetensors {
            path: file.clone(),
            source,
        })?;
        for (name, view) in st.tensors() {
            if is_candidate(&name, &view, &include) && !exclude.is_match(&name) {
                total += view.data().len() as u64;
            }
        }
    }
    Ok(total)
}

fn regexes(opts: &QuantizeOptions) -> Result<(Regex, Regex)> {
    let re =
        |arg, s: &str| Regex::new(s).map_err(|e| invalid(arg, format!("bad regex {s:?}: {e}")));
    Ok((re("include", &opts.include)?, re("exclude", &opts.exclude)?))
}

fn is_candidate(name: &str, view: &TensorView<'_>, include: &Regex) -> bool {
    include.is_match(name) && view.shape().len() == 2 && candle_dtype(view.dtype()).is_some()
}

/// The `.safetensors` files of `input` (a file, or a directory of shards), sorted.
fn input_files(input: &Path) -> Result<Vec<PathBuf>> {
    let meta = std::fs::metadata(input).map_err(io_err(input))?;
    if meta.is_file() {
        return Ok(vec![input.to_path_buf()]);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(input)
        .map_err(io_err(input))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(invalid(
            "input",
            format!("{} holds no .safetensors file", input.display()),
        ));
    }
    Ok(files)
}

/// Converts `input` (a `.safetensors` file or a directory of shards with its `config.json`)
/// into `output` (a file, or a directory for a directory input). `on_tensor(name, bytes)` is
/// called after each converted weight, for progress.
///
/// The config is taken from `input/config.json` for a directory, or `config.json` beside a
/// file input; the output gets it back with `quantization_config` set (beside an output file:
/// `config.json` when there was a config, else `quantization_config.json`).
pub fn quantize_checkpoint(
    input: &Path,
    output: &Path,
    opts: &QuantizeOptions,
    on_tensor: &mut dyn FnMut(&str, u64),
) -> Result<QuantizeReport> {
    if opts.block.contains(&0) {
        return Err(invalid(
            "block",
            format!("both sides must be at least 1, got {:?}", opts.block),
        ));
    }
    let (include, exclude) = regexes(opts)?;
    let files = input_files(input)?;
    let dir_mode = input.is_dir();
    let out_dir = if dir_mode {
        output.to_path_buf()
    } else {
        output.parent().map(Path::to_path_buf).unwrap_or_default()
    };
    if !out_dir.as_os_str().is_empty() {
        std::fs::create_dir_all(&out_dir).map_err(io_err(&out_dir))?;
    }
    let mut report = QuantizeReport::default();
    let mut weight_map = serde_json::Map::new();
    for file in &files {
        let dest = if dir_mode {
            output.join(file.file_name().expect("a listed file has a name"))
        } else {
            output.to_path_buf()
        };
        if same_file(file, &dest) {
            return Err(invalid(
                "output",
                format!("{} would overwrite the input", dest.display()),
            ));
        }
        let names = convert_file(
            file,
            &dest,
            opts,
            &include,
            &exclude,
            &mut report,
            on_tensor,
        )?;
        let shard = dest
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        for n in names {
            weight_map.insert(n, serde_json::Value::String(shard.clone()));
        }
    }
    if dir_mode && (files.len() > 1 || input.join(INDEX_FILE).is_file()) {
        // loaders find the tensors of a sharded checkpoint (scales included) through this map
        let index = serde_json::json!({
            "metadata": { "total_size": report.bytes_out },
            "weight_map": weight_map,
        });
        let path = output.join(INDEX_FILE);
        let text = serde_json::to_string_pretty(&index).expect("a JSON value serializes");
        std::fs::write(&path, text + "\n").map_err(io_err(&path))?;
        report.written.push(path);
    }
    report.not_converted.sort();
    report.not_converted.dedup();
    report.quantization_config = serde_json::json!({
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": opts.block,
        "modules_to_not_convert": report.not_converted,
    });
    write_config(input, output, dir_mode, &mut report)?;
    Ok(report)
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// A tensor to write: name, dtype, shape, bytes (borrowed from the input when unchanged).
type OutTensor<'a> = (String, Dtype, Vec<usize>, Cow<'a, [u8]>);

fn convert_file(
    file: &Path,
    dest: &Path,
    opts: &QuantizeOptions,
    include: &Regex,
    exclude: &Regex,
    report: &mut QuantizeReport,
    on_tensor: &mut dyn FnMut(&str, u64),
) -> Result<Vec<String>> {
    let bytes = std::fs::read(file).map_err(io_err(file))?;
    report.bytes_in += bytes.len() as u64;
    let st_err = |source| Error::Safetensors {
        path: file.to_path_buf(),
        source,
    };
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(st_err)?;
    let st = SafeTensors::deserialize(&bytes).map_err(st_err)?;
    let mut tensors = st.tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));

    let mut out: Vec<OutTensor<'_>> = Vec::new();
    for (name, view) in tensors {
        if !is_candidate(&name, &view, include) {
            out.push((
                name,
                view.dtype(),
                view.shape().to_vec(),
                Cow::Borrowed(view.data()),
            ));
            continue;
        }
        if exclude.is_match(&name) {
            let module = name.strip_suffix(".weight").unwrap_or(&name).to_string();
            report.not_converted.push(module);
            out.push((
                name,
                view.dtype(),
                view.shape().to_vec(),
                Cow::Borrowed(view.data()),
            ));
            continue;
        }
        let dtype = candle_dtype(view.dtype()).expect("candidates are float");
        let w = Tensor::from_raw_buffer(view.data(), dtype, view.shape(), &Device::Cpu)?;
        let q = Fp8BlockWeight::quantize_as(&w, opts.block, opts.scale_dtype)?;
        let codes = q.data().flatten_all()?.to_vec1::<u8>()?;
        let scale_values = q.scales().flatten_all()?.to_vec1::<f32>()?;
        let (scale_dtype, scales): (Dtype, Vec<u8>) = match opts.scale_dtype {
            ScaleDType::F32 => (
                Dtype::F32,
                scale_values.iter().flat_map(|s| s.to_le_bytes()).collect(),
            ),
            // quantize_as made every scale a bf16 value: its top 16 bits are the bf16 exactly
            ScaleDType::Bf16 => (
                Dtype::BF16,
                scale_values
                    .iter()
                    .flat_map(|s| ((s.to_bits() >> 16) as u16).to_le_bytes())
                    .collect(),
            ),
        };
        let scale_name = format!("{}_scale_inv", name);
        out.push((
            name.clone(),
            Dtype::F8_E4M3,
            view.shape().to_vec(),
            Cow::Owned(codes),
        ));
        out.push((
            scale_name,
            scale_dtype,
            q.scales().dims().to_vec(),
            Cow::Owned(scales),
        ));
        on_tensor(&name, view.data().len() as u64);
        tracing::info!(tensor = %name, shape = ?view.shape(), "quantized");
        report.converted.push(name);
    }
    let views = out
        .iter()
        .map(|(n, d, s, b)| {
            Ok((
                n.clone(),
                TensorView::new(*d, s.clone(), b).map_err(st_err)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata: Option<HashMap<String, String>> = header.metadata().clone();
    safetensors::serialize_to_file(views, metadata, dest).map_err(|source| Error::Safetensors {
        path: dest.to_path_buf(),
        source,
    })?;
    report.bytes_out += std::fs::metadata(dest).map_err(io_err(dest))?.len();
    report.written.push(dest.to_path_buf());
    Ok(out.into_iter().map(|t| t.0).collect())
}

fn write_config(
    input: &Path,
    output: &Path,
    dir_mode: bool,
    report: &mut QuantizeReport,
) -> Result<()> {
    let (src, out_dir) = if dir_mode {
        (input.join("config.json"), output.to_path_buf())
    } else {
        (
            input.with_file_name("config.json"),
            output.parent().map(Path::to_path_buf).unwrap_or_default(),
        )
    };
    let qc = report.quantization_config.clone();
    // beside an input config in the same folder, never overwrite it: write the new section alone
    let (dest, json) = if src.is_file() && !same_file(&src, &out_dir.join("config.json")) {
        let text = std::fs::read_to_string(&src).map_err(io_err(&src))?;
        let mut cfg: serde_json::Value =
            serde_json::from_str(&text).map_err(|source| Error::Json {
                path: src.clone(),
                source,
            })?;
        let obj = cfg
            .as_object_mut()
            .ok_or_else(|| invalid("config", format!("{} is not a JSON object", src.display())))?;
        obj.insert("quantization_config".into(), qc);
        (out_dir.join("config.json"), cfg)
    } else {
        (out_dir.join("quantization_config.json"), qc)
    };
    let text = serde_json::to_string_pretty(&json).expect("a JSON value serializes");
    std::fs::write(&dest, text + "\n").map_err(io_err(&dest))?;
    report.written.push(dest);
    Ok(())
}
