//! The fp8 e4m3fn block-scaled format and the layer built on it.

mod comm;
mod cuda;
mod experts;
mod experts_cuda;
mod fused;
mod gather;
mod linear;
mod moe;
#[cfg(feature = "nccl")]
mod nccl;
mod op;
mod parallel;
mod pjrt;
mod shard;
pub(crate) mod weight;

pub use comm::{Communicator, HostGroup};
pub use experts::Fp8Experts;
pub use fp8nsa_cpu::linear::{bf16_tile_min_m, GEMV_MAX_M};
pub use fp8nsa_types::{ActQuant, ScaleDType};
pub use fp8nsa_types::{CpuFp8Kernel, CpuFp8Path};
pub use linear::Fp8Linear;
pub use moe::{Fp8Moe, MoeRouter, Routing};
#[cfg(feature = "nccl")]
pub use nccl::NcclGroup;
pub use op::Fp8Path;
pub use parallel::{ColumnParallel, ExpertParallel, RowParallel};
pub use shard::{HeadShard, Shard, Split};
pub use weight::Fp8BlockWeight;
