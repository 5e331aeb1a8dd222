//! A paged KV cache as the selection kernels read it: the caller's view ([`PagedKv`]) and the
//! checked pool a kernel reads in place ([`PoolRef`]).

use candle_core::Tensor;
use fp8nsa_types::Pages;

/// A paged KV cache as a server holds it (the NHD layout of vLLM v1 / FlashInfer): keys and
/// values in a pool of pages the server allocates, a block table naming each sequence's pages
/// in order, and each sequence's length. See [`SelectionAttention::forward_paged`].
#[derive(Clone, Copy, Debug)]
pub struct PagedKv<'a> {
    /// `[num_pages, page_size, Hkv, D]`, any positive page size.
    pub k_pages: &'a Tensor,
    /// `[num_pages, page_size, Hkv, Dv]`.
    pub v_pages: &'a Tensor,
    /// `[B, max_pages]` i32: row `b` lists sequence `b`'s pages; entries past its last page
    /// are not read (`-1` is customary). It is checked on the host, so with CUDA pools a
    /// table the server keeps on the host saves a device-to-host copy (the kernel gets it
    /// uploaded).
    pub block_table: &'a Tensor,
    /// Keys held by each of the `B` sequences.
    pub seq_lens: &'a [usize],
}

/// A page pool a kernel reads in place: the table checked on the host, and the table tensor
/// as the caller gave it (the CUDA kernel reads it on the device).
#[derive(Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct PoolRef<'a> {
    pub(crate) host: Pages<'a>,
    pub(crate) table: &'a Tensor,
    pub(crate) num_pages: usize,
}
