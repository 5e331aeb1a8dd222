//! fp8nsa-types: the one vocabulary of fp8nsa, below every other crate.
//!
//! Each concept the layers, the backends and the tools talk about has exactly one type here,
//! and each environment setting exactly one parser ([`Settings`]). Nothing here knows Candle,
//! CUDA or PJRT, so every backend takes these types directly.
//!
//! ```
//! use fp8nsa_types::{ActQuant, LinearShape, Spans};
//!
//! let shape = LinearShape::new(7, 576, 3884, 128, 128).unwrap();
//! assert_eq!((shape.n_blocks(), shape.k_blocks()), (5, 31));
//! assert!(ActQuant::Block2d { bm: 0 }.validate().is_err());
//!
//! // Two overlapping ranges and one past the visible keys, normalized for a query at key 9.
//! let sel = Spans::Ranges { ranges: &[0, 4, 2, 6, 8, 20][..], per_row: 3 };
//! let mut spans = Vec::new();
//! sel.row_spans(0, 10, &mut spans);
//! assert_eq!(spans, [(0, 6), (8, 10)]);
//! ```

mod act;
mod error;
mod kernel;
mod python;
mod rope;
mod scale;
mod selection;
mod settings;
mod shape;
mod tier;

pub use act::ActQuant;
pub use error::{Error, Result};
pub use kernel::{
    BackendKind, CpuFp8Kernel, CpuFp8Path, CudaFp8Kernel, CudaFp8Path, MmaTile, TpuKernel,
};
pub use python::{find_python_package_file, python_site_dirs, XLA_CPU_PLUGIN};
pub use rope::RopeStyle;
pub use scale::ScaleDType;
pub use selection::{EntryIssue, Spans};
pub use settings::{
    Settings, BACKEND_ENV, CUDA_FP8_KERNEL_ENV, DEFAULT_MIN_LEN, NSA_MIN_LEN_ENV, PJRT_PLUGIN_ENV,
    TPU_KERNEL_ENV,
};
pub use shape::{AttnDims, ExpertsShape, LinearShape, NsaPool, Pages, Seq};
pub use tier::Tier;
