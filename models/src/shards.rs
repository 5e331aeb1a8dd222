//! The tensors of a checkpoint's safetensors shards, read from disk one at a time when a layer
//! takes them.
//!
//! Only each shard's header is read up front. A tensor's bytes are read with positioned reads
//! into memory the tensor then owns, so a checkpoint being built into a model is never resident
//! twice: reading every shard whole (or mapping it, whose touched pages count in the process's
//! resident set as long as the map lives, and candle's CPU tensors cannot borrow them) held a
//! 2.9 GiB fp8 checkpoint at 5.9 GiB peak.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use safetensors::tensor::Metadata;
use safetensors::Dtype;

use crate::error::{Error, Result};

/// One stored tensor: where its bytes are and what they hold.
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    shard: usize,
    pub(crate) dtype: DType,
    pub(crate) dims: Vec<usize>,
    /// Byte range in the shard file.
    start: u64,
    len: usize,
}

#[derive(Debug)]
struct Shard {
    path: PathBuf,
    file: File,
}

/// The shards of one checkpoint: every tensor name once, with its shard and byte range.
#[derive(Debug)]
pub(crate) struct Shards {
    files: Vec<Shard>,
    index: HashMap<String, Entry>,
}

fn file_err(path: &Path, msg: impl ToString) -> Error {
    Error::File {
        path: path.to_path_buf(),
        msg: msg.to_string(),
    }
}

/// candle's dtype of a stored one, `None` for dtypes candle has no tensor for.
fn candle_dtype(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::F8_E4M3 => DType::F8E4M3,
        Dtype::U8 => DType::U8,
        Dtype::U32 => DType::U32,
        Dtype::I64 => DType::I64,
        Dtype::BF16 => DType::BF16,
        Dtype::F16 => DType::F16,
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        _ => return None,
    })
}

impl Shards {
    /// Reads the headers of `files`. A header that does not describe its file exactly (offsets
    /// past the end, sizes that disagree with the shapes), a dtype candle has no tensor for, or
    /// a name in two shards is an [`Error::File`] naming the shard.
    pub(crate) fn open(files: &[PathBuf]) -> Result<Self> {
        let mut shards = Vec::with_capacity(files.len());
        let mut index: HashMap<String, Entry> = HashMap::new();
        for (i, path) in files.iter().enumerate() {
            let file = File::open(path).map_err(|e| file_err(path, e))?;
            let size = file.metadata().map_err(|e| file_err(path, e))?.len();
            let mut n = [0u8; 8];
            file.read_exact_at(&mut n, 0)
                .map_err(|e| file_err(path, format!("no safetensors header: {e}")))?;
            let n = u64::from_le_bytes(n);
            // the header must fit in the file (and safetensors' own 100 MB header limit)
            if n > size.saturating_sub(8) || n > 100 << 20 {
                return Err(file_err(
                    path,
                    format!("header length {n} does not fit in the file ({size} bytes)"),
                ));
            }
            let mut header = vec![0u8; n as usize];
            file.read_exact_at(&mut header, 8)
                .map_err(|e| file_err(path, e))?;
            let text = std::str::from_utf8(&header)
                .map_err(|e| file_err(path, format!("header is not UTF-8: {e}")))?;
            // the safetensors crate checks that the offsets tile the data section and that
            // each size agrees with its shape and dtype
            let meta: Metadata = serde_json::from_str(text)
                .map_err(|e| file_err(path, format!("bad safetensors header: {e}")))?;
            let data_start = 8 + n;
            let tensors = meta.tensors();
            let end = tensors
                .values()
                .map(|t| t.data_offsets.1)
                .max()
                .unwrap_or(0);
            if data_start.checked_add(end as u64) != Some(size) {
                return Err(file_err(
                    path,
                    format!(
                        "the header describes {end} bytes of data, the file holds {}",
                        size - data_start
                    ),
                ));
            }
            for (name, info) in tensors {
                let dtype = candle_dtype(info.dtype).ok_or_else(|| {
                    file_err(
                        path,
                        format!("{name} is stored as unsupported {:?}", info.dtype),
                    )
                })?;
                let entry = Entry {
                    shard: i,
                    dtype,
                    dims: info.shape.clone(),
                    start: data_start + info.data_offsets.0 as u64,
                    len: info.data_offsets.1 - info.data_offsets.0,
                };
                if let Some(first) = index.insert(name.clone(), entry) {
                    return Err(file_err(
                        path,
                        format!("tensor {name} is also in {}", files[first.shard].display()),
                    ));
                }
            }
            shards.push(Shard {
                path: path.clone(),
                file,
            });
        }
        Ok(Self {
            files: shards,
            index,
        })
    }

    pub(crate) fn names(&self) -> impl Iterator<Item = &String> {
        self.index.keys()
    }

    pub(crate) fn entry(&self, name: &str) -> Option<&Entry> {
        self.index.get(name)
    }

    /// `name` as stored (its own dtype), read from its shard now; `None` if no shard has it.
    pub(crate) fn read(&self, name: &str) -> Result<Option<Tensor>> {
        let Some(e) = self.index.get(name) else {
            return Ok(None);
        };
        let shard = &self.files[e.shard];
        let mut bytes = vec![0u8; e.len];
        shard
            .file
            .read_exact_at(&mut bytes, e.start)
            .map_err(|err| file_err(&shard.path, format!("reading {name}: {err}")))?;
        Ok(Some(Tensor::from_raw_buffer(
            &bytes,
            e.dtype,
            &e.dims,
            &Device::Cpu,
        )?))
    }
}
