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
    /// Replace an output that already exists (a file, or a directory that is not empty).
    /// Without it such an output is an error, before anything is converted.
    pub force: bool,
}

impl Default for QuantizeOptions {
    fn default() -> Self {
        Self {
            block: [128, 128],
            include: r"\.weight$".into(),
            exclude: r"(embed|lm_head|norm|mlp\.gate\.weight$)".into(),
            scale_dtype: ScaleDType::F32,
            force: false,
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
    if !dir_mode && output.extension().is_none_or(|e| e != "safetensors") {
        return Err(invalid(
            "output",
            format!(
                "{} must end in .safetensors (for a file input, the output is a file)",
                output.display()
            ),
        ));
    }
    for file in &files {
        let dest = if dir_mode {
            output.join(file.file_name().expect("a listed file has a name"))
        } else {
            output.to_path_buf()
        };
        if same_file(file, &dest) || same_file(input, output) {
            return Err(invalid(
                "output",
                format!("{} would overwrite the input", dest.display()),
            ));
        }
    }
    // an output inside the input folder, or one holding the input, would be replaced (with
    // --force) together with what it overlaps
    if dir_mode {
        let in_c = input.canonicalize().map_err(io_err(input))?;
        let out_c = match output.canonicalize() {
            Ok(c) => c,
            Err(_) => match (output.parent(), output.file_name()) {
                (Some(p), Some(f)) if !p.as_os_str().is_empty() => p
                    .canonicalize()
                    .map(|p| p.join(f))
                    .unwrap_or_else(|_| output.to_path_buf()),
                _ => std::env::current_dir()
                    .map(|d| d.join(output))
                    .unwrap_or_else(|_| output.to_path_buf()),
            },
        };
        if out_c.starts_with(&in_c) || in_c.starts_with(&out_c) {
            return Err(invalid(
                "output",
                format!(
                    "{} overlaps the input {}: write the output elsewhere",
                    output.display(),
                    input.display()
                ),
            ));
        }
    }
    let exists = match std::fs::read_dir(output) {
        Ok(mut d) => d.next().is_some(),
        Err(_) => output.exists(),
    };
    // in file mode the config goes beside the output: replacing one there needs --force too
    let config_there = !dir_mode && {
        let dir = match output.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let src = input.with_file_name("config.json");
        let name = if src.is_file() && !same_file(&src, &dir.join("config.json")) {
            "config.json"
        } else {
            "quantization_config.json"
        };
        dir.join(name).exists()
    };
    if config_there && !opts.force {
        return Err(invalid(
            "output",
            format!(
                "the config written beside {} would replace one already there; pass --force",
                output.display()
            ),
        ));
    }
    if exists && !opts.force {
        return Err(invalid(
            "output",
            format!(
                "{} already exists{}; pass --force (QuantizeOptions::force) to replace it",
                output.display(),
                if dir_mode { " and is not empty" } else { "" }
            ),
        ));
    }
    // Everything is written into a staging folder beside the output and moved into place
    // only once complete: a failed or killed run never leaves new shards beside old ones,
    // and what it leaves behind is named as unfinished.
    let parent = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(io_err(&parent))?;
    let out_name = output
        .file_name()
        .ok_or_else(|| invalid("output", format!("{} names no file", output.display())))?
        .to_string_lossy()
        .into_owned();
    let stage = parent.join(format!(".{out_name}.fp8nsa-partial-{}", std::process::id()));
    if stage.exists() {
        std::fs::remove_dir_all(&stage).map_err(io_err(&stage))?;
    }
    std::fs::create_dir(&stage).map_err(io_err(&stage))?;
    let staged = (|| {
        let staged_out = if dir_mode {
            stage.clone()
        } else {
            stage.join(&out_name)
        };
        let final_dir = if dir_mode { output } else { parent.as_path() };
        let mut report = convert_into(
            input,
            &files,
            dir_mode,
            &staged_out,
            final_dir,
            opts,
            &include,
            &exclude,
            on_tensor,
        )?;
        put_in_place(&stage, output, &parent, dir_mode, &mut report)?;
        Ok(report)
    })();
    if staged.is_err() {
        let _ = std::fs::remove_dir_all(&stage);
    }
    staged
}

/// Writes the converted shards, the index and the config into `staged_out` (the staging
/// folder for a directory input, a file in it otherwise); `final_dir` is the folder they
/// will be moved to.
#[allow(clippy::too_many_arguments)]
fn convert_into(
    input: &Path,
    files: &[PathBuf],
    dir_mode: bool,
    staged_out: &Path,
    final_dir: &Path,
    opts: &QuantizeOptions,
    include: &Regex,
    exclude: &Regex,
    on_tensor: &mut dyn FnMut(&str, u64),
) -> Result<QuantizeReport> {
    let mut report = QuantizeReport::default();
    let mut weight_map = serde_json::Map::new();
    for file in files {
        let dest = if dir_mode {
            staged_out.join(file.file_name().expect("a listed file has a name"))
        } else {
            staged_out.to_path_buf()
        };
        let names = convert_file(file, &dest, opts, include, exclude, &mut report, on_tensor)?;
        let shard = dest
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        for n in names {
            if weight_map.contains_key(&n) {
                return Err(invalid(
                    "input",
                    format!(
                        "{n} is in more than one shard (the second: {})",
                        file.display()
                    ),
                ));
            }
            weight_map.insert(n, serde_json::Value::String(shard.clone()));
        }
    }
    if dir_mode && (files.len() > 1 || input.join(INDEX_FILE).is_file()) {
        // loaders find the tensors of a sharded checkpoint (scales included) through this map
        let index = serde_json::json!({
            "metadata": { "total_size": report.bytes_out },
            "weight_map": weight_map,
        });
        let path = staged_out.join(INDEX_FILE);
        let text = serde_json::to_string_pretty(&index).expect("a JSON value serializes");
        write_synced(&path, (text + "\n").as_bytes())?;
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
    write_config(input, staged_out, final_dir, dir_mode, &mut report)?;
    Ok(report)
}

/// Moves a complete staging folder's contents to the output: for a directory the folder
/// itself (replacing an empty or `--force`d one), for a file its entries one by one (each a
/// rename within one folder). `report.written` is rewritten to the final paths.
fn put_in_place(
    stage: &Path,
    output: &Path,
    parent: &Path,
    dir_mode: bool,
    report: &mut QuantizeReport,
) -> Result<()> {
    let final_path = |p: &PathBuf| -> PathBuf {
        let rel = p.strip_prefix(stage).expect("written into the stage");
        if dir_mode {
            output.join(rel)
        } else {
            parent.join(rel)
        }
    };
    let empty_dir = std::fs::read_dir(output).is_ok_and(|mut d| d.next().is_none());
    if dir_mode && !empty_dir {
        let old = parent.join(format!(
            ".{}.fp8nsa-replaced-{}",
            output.file_name().unwrap_or_default().to_string_lossy(),
            std::process::id()
        ));
        let had = output.exists();
        if had {
            std::fs::rename(output, &old).map_err(io_err(output))?;
        }
        if let Err(e) = std::fs::rename(stage, output) {
            if had {
                // put the old output back where it was
                let _ = std::fs::rename(&old, output);
            }
            return Err(io_err(output)(e));
        }
        if had {
            // what --force replaced may have been a file; the new output is in place either
            // way, so a failed clean-up is a warning, not a failed run
            let removed = if old.is_dir() {
                std::fs::remove_dir_all(&old)
            } else {
                std::fs::remove_file(&old)
            };
            if let Err(e) = removed {
                tracing::warn!(path = %old.display(), error = %e, "could not remove the replaced output");
            }
        }
    } else if dir_mode {
        // an existing empty folder (a mount point, a folder made for the output) stays: the
        // files move into it
        for p in &report.written {
            let to = final_path(p);
            std::fs::rename(p, &to).map_err(io_err(&to))?;
        }
        std::fs::remove_dir(stage).map_err(io_err(stage))?;
    } else {
        // the config first: if its move fails, the old output file is still untouched
        for p in report.written.iter().rev() {
            let to = final_path(p);
            std::fs::rename(p, &to).map_err(io_err(&to))?;
        }
        std::fs::remove_dir(stage).map_err(io_err(stage))?;
    }
    // the renames themselves are durable once the folder holding them is synced
    if let Ok(d) = std::fs::File::open(parent) {
        let _ = d.sync_all();
    }
    report.written = report.written.iter().map(final_path).collect();
    Ok(())
}

/// Writes `bytes` to a new file (ordinary permissions) and syncs it to disk.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(io_err(path))?;
    f.write_all(bytes).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))
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
        let q =
            Fp8BlockWeight::quantize_as(&w, opts.block, opts.scale_dtype).map_err(|source| {
                Error::Tensor {
                    path: file.to_path_buf(),
                    name: name.clone(),
                    source: Box::new(source),
                }
            })?;
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
    let mut seen = std::collections::HashSet::new();
    for (n, ..) in &out {
        if !seen.insert(n.as_str()) {
            let dense = n.strip_suffix("_scale_inv").unwrap_or(n);
            return Err(invalid(
                "input",
                format!(
                    "{}: {n} would be written twice: the input already holds it beside \
                     {dense}, which is dense and matches --include (a partly converted \
                     checkpoint?); leave {dense} out with --exclude or remove the stale {n}",
                    file.display()
                ),
            ));
        }
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
    // a failed write (a full disk) is not a bad input file: say which it is
    safetensors::serialize_to_file(views, metadata, dest).map_err(|source| match source {
        safetensors::SafeTensorError::IoError(source) => Error::Io {
            path: dest.to_path_buf(),
            source,
        },
        source => Error::Write {
            path: dest.to_path_buf(),
            source,
        },
    })?;
    // the safetensors writer goes through a private temporary file (mode 0600): give the
    // result an ordinary file's permissions (rw-r--r--), and sync it before it is moved in place
    let f = std::fs::File::open(dest).map_err(io_err(dest))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dest, std::fs::Permissions::from_mode(0o644))
            .map_err(io_err(dest))?;
    }
    f.sync_all().map_err(io_err(dest))?;
    report.bytes_out += std::fs::metadata(dest).map_err(io_err(dest))?.len();
    report.written.push(dest.to_path_buf());
    Ok(out.into_iter().map(|t| t.0).collect())
}

/// The config into the folder of `staged_out`; `final_dir` is where it will end up.
fn write_config(
    input: &Path,
    staged_out: &Path,
    final_dir: &Path,
    dir_mode: bool,
    report: &mut QuantizeReport,
) -> Result<()> {
    let (src, out_dir) = if dir_mode {
        (input.join("config.json"), staged_out.to_path_buf())
    } else {
        (
            input.with_file_name("config.json"),
            staged_out
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_default(),
        )
    };
    let qc = report.quantization_config.clone();
    // beside an input config in the same folder, never overwrite it: write the new section alone
    let beside_input = same_file(&src, &final_dir.join("config.json"));
    let (dest, json) = if src.is_file() && !beside_input {
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
    write_synced(&dest, (text + "\n").as_bytes())?;
    report.written.push(dest);
    Ok(())
}
