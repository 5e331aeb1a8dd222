//! Native Sparse Attention (DeepSeek, arXiv 2502.11089): selection attention over chosen key
//! blocks or arbitrary ranges, with a dense masked-SDPA fallback ([`SelectionAttention`]), and
//! the full three-branch layer ([`NativeSparseAttention`]) with its decode cache.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use fp8nsa_ops::nsa::{SelectionAttention, SelectionRanges};
//!
//! let dev = Device::Cpu;
//! let (b, t, hq, hkv, d) = (1, 96, 4, 1, 64);
//! let q = Tensor::randn(0f32, 1.0, (b, t, hq, d), &dev)?;
//! let k = Tensor::randn(0f32, 1.0, (b, t, hkv, d), &dev)?;
//! let v = Tensor::randn(0f32, 1.0, (b, t, hkv, d), &dev)?;
//! // every query sees keys [0, 16), [32, 48) and [64, 80) (causally)
//! let r = Tensor::new(&[[0i32, 16], [32, 48], [64, 80]], &dev)?;
//! let ranges = SelectionRanges::new(r.reshape((1, 1, 1, 3, 2))?.repeat((b, t, hkv, 1, 1))?)?;
//! let (o, lse) = SelectionAttention::new().with_lse(true).forward(&q, &k, &v, &ranges)?;
//! assert_eq!(o.dims(), &[b, t, hq, d]);
//! assert_eq!(lse.unwrap().dims(), &[b, t, hq]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod attention;
mod compress;
mod config;
mod cuda;
mod decode;
mod dsa;
mod layer;
mod op;
mod paged;
mod paged_kv;
mod pjrt;
mod sdpa;
mod selection;

pub use attention::{
    NsaPath, PathOutput, SdpaReason, SelectionAttention, DEFAULT_MIN_LEN, MIN_LEN_ENV,
};
pub use compress::{Compressor, MlpCompressor};
pub use config::{CompressorKind, NsaConfig};
pub use decode::{
    causal_attention, causal_attention_paged, decode_attention, decode_attention_paged, write_rows,
};
pub use dsa::index_scores;
pub use layer::{AttnDims, Gates, NativeSparseAttention, NsaDims, NsaOutput};
pub use paged::{
    NsaCache, NsaPages, NsaPool, NsaSeqState, PageAllocator, PagePool, SharedAllocator,
};
pub use paged_kv::PagedKv;
pub use selection::{BlockSelection, Selection, SelectionRanges, TokenSelection};
