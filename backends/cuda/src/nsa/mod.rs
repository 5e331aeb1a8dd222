//! NSA selection attention on CUDA: each (query token, kv head) attends to its selected keys,
//! all G query heads of the kv head together on tensor cores (bf16 / f16 in, f32 softmax).
//!
//! The selection is read as it is on the device, never validated on the host: the kernel
//! clamps every block or range to the keys the query may see, sorts and merges them, so no
//! index can make it read out of bounds or count a key twice.
//!
//! ```no_run
//! use cudarc::driver::CudaContext;
//! use fp8nsa_cuda::nsa::{selection_attention, Selection};
//! use fp8nsa_types::{AttnDims, Seq};
//!
//! let stream = CudaContext::new(0)?.default_stream();
//! let dims = AttnDims::new(16, 1, 128, 128)?;
//! let (tq, tk) = (1, 4096);
//! let q = stream.alloc_zeros::<half::bf16>(tq * 16 * 128)?;
//! let k = stream.alloc_zeros::<half::bf16>(tk * 128)?;
//! let v = stream.alloc_zeros::<half::bf16>(tk * 128)?;
//! let blocks = stream.clone_htod(&[0i32, 7, 63, -1])?; // one row: 4 entries, -1 pads
//! let sel = Selection::Blocks { indices: blocks.as_view(), per_row: 4, block_size: 64 };
//! let seqs = [Seq { q_start: 0, q_len: tq, k_start: 0, k_len: tk, q_offset: tk - 1 }];
//! let mut o = stream.alloc_zeros::<half::bf16>(tq * 16 * 128)?;
//! let mut lse = stream.alloc_zeros::<f32>(tq * 16)?;
//! selection_attention(&stream, &q.as_view(), &k.as_view(), &v.as_view(), &sel, &seqs, dims,
//!     1.0 / (128f32).sqrt(), &mut o.as_view_mut(), &mut lse.as_view_mut())?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod plan;

use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};

pub use plan::{
    max_tiles, plan, smem_bytes, supports, NsaPlan, HEAD_DIMS, KEYS_PER_TILE, MAX_GROUP,
    MAX_PER_ROW, MAX_SPLITS, VALUE_DIMS,
};

use fp8nsa_types::{AttnDims, Seq, Spans};

use crate::context::gpu;
use crate::element::Element;
use crate::error::{invalid, unsupported, Result};
use crate::launch;
use crate::step::{Buf, DevBuf, Dtype, KArg, Kernel, Plan, Val};

/// Kernel names (the launcher and the PTX test share them).
pub(crate) mod names {
    pub(crate) const MODULE: &str = "nsa_selection";
    #[cfg(test)]
    pub(crate) const SUFFIXES: [&str; 2] = ["bf16", "f16"];
    #[cfg(test)]
    pub(crate) const WARPS: [usize; 3] = [1, 2, 4];

    pub(crate) fn selection(suffix: &str, d: usize, dv: usize, warps: usize) -> String {
        format!("fp8nsa_nsa_selection_{suffix}_d{d}_dv{dv}_w{warps}")
    }

    pub(crate) fn merge(suffix: &str) -> String {
        format!("fp8nsa_nsa_merge_{suffix}")
    }
}

/// The selection as it lies on the device, rows `token * hkv + kv_head`: the shared
/// [`Spans`] with its i32 entries in device memory.
pub type Selection<'a> = Spans<CudaView<'a, i32>>;

/// The token partition as the kernel reads it: `cu_q`, `cu_k` (B + 1 offsets) and each
/// sequence's `q_offset`, checked; plus the totals.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqArrays {
    pub cu_q: Vec<i32>,
    pub cu_k: Vec<i32>,
    pub q_off: Vec<i32>,
    pub total_q: usize,
    pub total_k: usize,
    pub max_k: usize,
}

impl SeqArrays {
    /// Sequences whose queries and keys are token-packed one after another.
    pub fn new(seqs: &[Seq]) -> Result<Self> {
        Self::build(seqs, true)
    }

    /// Sequences whose keys live in pages ([`PageLayout`]): `k_start` is not read, and `cu_k`
    /// only tells the kernel each sequence's length.
    pub fn paged(seqs: &[Seq]) -> Result<Self> {
        Self::build(seqs, false)
    }

    fn build(seqs: &[Seq], packed_keys: bool) -> Result<Self> {
        let (mut tq, mut tk) = (0usize, 0usize);
        let (mut cu_q, mut cu_k, mut q_off) = (vec![0i32], vec![0i32], Vec::new());
        for (i, s) in seqs.iter().enumerate() {
            if s.q_start != tq || (packed_keys && s.k_start != tk) {
                return Err(invalid(
                    "seqs",
                    format!("sequence {i} does not follow the previous one"),
                ));
            }
            tq += s.q_len;
            tk += s.k_len;
            let last = s.q_offset.saturating_add(s.q_len);
            if !packed_keys && tk > i32::MAX as usize {
                // the kernel takes each sequence's length as a difference of i32 offsets
                return Err(unsupported(
                    "nsa selection",
                    "paged sequences whose lengths sum past i32::MAX",
                ));
            }
            if tq > i32::MAX as usize || tk > i32::MAX as usize || last > i32::MAX as usize {
                return Err(invalid(
                    "seqs",
                    "token counts and positions must fit in i32",
                ));
            }
            cu_q.push(tq as i32);
            cu_k.push(tk as i32);
            q_off.push(s.q_offset as i32);
        }
        if seqs.is_empty() || tq == 0 {
            return Err(invalid("seqs", "no query tokens"));
        }
        Ok(Self {
            cu_q,
            cu_k,
            q_off,
            total_q: tq,
            total_k: tk,
            max_k: seqs.iter().map(|s| s.k_len).max().unwrap_or(0),
        })
    }
}

/// A page pool as the kernel reads it: keys `[num_pages * page_size, hkv, d]` (values alike)
/// and a block table `[B, max_pages]` i32 whose row `b` lists sequence `b`'s pages in order
/// (the NHD layout of vLLM v1 / FlashInfer). This crate does not read the table: the caller
/// checks it (fp8nsa-ops' `forward_paged` does, on the host, naming the sequence), and the
/// kernel clamps a page id outside the pool into it, so no table makes it read past the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageLayout {
    pub num_pages: usize,
    pub page_size: usize,
    pub max_pages: usize,
}

impl PageLayout {
    fn check(&self, seqs: &SeqArrays) -> Result<()> {
        let PageLayout {
            num_pages,
            page_size,
            max_pages,
        } = *self;
        let fits = |x: usize| (1..=i32::MAX as usize).contains(&x);
        if !fits(num_pages) || !fits(page_size) || !fits(max_pages) {
            return Err(invalid(
                "pages",
                format!("{self:?}: every size must be in 1..={}", i32::MAX),
            ));
        }
        if max_pages
            .checked_mul(page_size)
            .is_none_or(|c| c < seqs.max_k)
        {
            return Err(invalid(
                "pages",
                format!(
                    "{max_pages} pages of {page_size} per sequence do not cover its {} keys",
                    seqs.max_k
                ),
            ));
        }
        if num_pages.checked_mul(page_size).is_none() {
            return Err(invalid("pages", "the pool's token count overflows"));
        }
        Ok(())
    }
}

/// What the selection names: block ids of `block_size` keys, or ranges.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SelKind {
    Blocks { per_row: usize, block_size: usize },
    Ranges { per_row: usize },
}

impl SelKind {
    pub fn per_row(self) -> usize {
        match self {
            SelKind::Blocks { per_row, .. } | SelKind::Ranges { per_row } => per_row,
        }
    }

    /// i32 values per row.
    pub fn width(self) -> usize {
        match self {
            SelKind::Blocks { per_row, .. } => per_row,
            SelKind::Ranges { per_row } => 2 * per_row,
        }
    }
}

/// The plan of one call. Arguments: 0 `q [total_q, hq, d]`, 1 `k [total_k, hkv, d]`,
/// 2 `v [total_k, hkv, dv]` (all in `dtype`), 3 the selection (i32, `total_q * hkv` rows of
/// `kind.width()`), 4 `cu_q`, 5 `cu_k`, 6 `q_off` (i32, as in [`SeqArrays`]), 7 `o` in
/// `dtype`, 8 `lse` f32; with `pages`, 1 and 2 are the page pools
/// `[num_pages * page_size, hkv, *]` and 9 the block table (i32 `[B, max_pages]`).
/// Errors for what the kernel does not take (`Error::Unsupported`).
pub fn plan_selection(
    info: &crate::DeviceInfo,
    dims: AttnDims,
    seqs: &SeqArrays,
    kind: SelKind,
    dtype: Dtype,
    scale: f32,
    pages: Option<PageLayout>,
) -> Result<(NsaPlan, Plan)> {
    if dtype == Dtype::F32 {
        return Err(unsupported(
            "nsa selection",
            "f32 inputs (the kernel takes bf16 and f16)",
        ));
    }
    // `AttnDims` guarantees hkv >= 1 and hq a multiple of it
    let (hq, hkv, d, dv) = (dims.hq(), dims.hkv(), dims.d(), dims.dv());
    if let SelKind::Blocks { block_size, .. } = kind {
        if block_size == 0 || block_size > i32::MAX as usize {
            return Err(invalid(
                "block_size",
                format!("must be in 1..={}", i32::MAX),
            ));
        }
    }
    if let Some(pl) = &pages {
        pl.check(seqs)?;
    }
    let rows = seqs.total_q * hkv;
    if rows > i32::MAX as usize {
        return Err(invalid("q", "token count x kv heads must fit in i32"));
    }
    let block_size = match kind {
        SelKind::Blocks { block_size, .. } => Some(block_size),
        SelKind::Ranges { .. } => None,
    };
    let per_row = kind.per_row();
    let p = plan(
        info,
        d,
        dv,
        hq / hkv,
        per_row,
        rows,
        max_tiles(per_row, block_size, seqs.max_k),
    )?;
    let tq = seqs.total_q;
    let mut out = Plan::default();
    let ws = (p.splits > 1).then(|| {
        (
            out.tmp(4 * p.splits * tq * hq * dv, false),
            out.tmp(4 * p.splits * tq * hq, false),
        )
    });
    let ptr = |i: usize| Val::Ptr(Buf::Arg(i), 0);
    let params = vec![
        ptr(0),
        ptr(1),
        ptr(2),
        ptr(3),
        ptr(4),
        ptr(5),
        ptr(6),
        ptr(7),
        ptr(8),
        ws.map_or(Val::Null, |w| Val::Ptr(w.0, 0)),
        ws.map_or(Val::Null, |w| Val::Ptr(w.1, 0)),
        Val::F32(scale * std::f32::consts::LOG2_E),
        Val::I32(tq as i32),
        Val::I32(seqs.q_off.len() as i32),
        Val::I32(hq as i32),
        Val::I32(hkv as i32),
        Val::I32(per_row as i32),
        Val::I32(block_size.unwrap_or(0) as i32),
        Val::I32(p.splits as i32),
        pages.map_or(Val::Null, |_| ptr(9)),
        Val::I32(pages.map_or(0, |l| l.max_pages) as i32),
        Val::I32(pages.map_or(0, |l| l.page_size) as i32),
        Val::I32(pages.map_or(0, |l| l.num_pages) as i32),
    ];
    out.kernel(Kernel {
        module: names::MODULE,
        name: names::selection(dtype.suffix(), d, dv, p.warps),
        grid: (rows as u32, p.splits as u32, 1),
        block: (32 * p.warps) as u32,
        smem: p.smem,
        args: vec![KArg::Struct(params)],
    });
    if let Some((wo, wl)) = ws {
        let rows_h = tq * hq;
        out.kernel(Kernel {
            module: names::MODULE,
            name: names::merge(dtype.suffix()),
            grid: (rows_h as u32, 1, 1),
            block: dv.min(128) as u32,
            smem: 0,
            args: vec![
                KArg::Val(Val::Ptr(wo, 0)),
                KArg::Val(Val::Ptr(wl, 0)),
                KArg::Val(ptr(7)),
                KArg::Val(ptr(8)),
                KArg::Val(Val::I32(rows_h as i32)),
                KArg::Val(Val::I32(dv as i32)),
                KArg::Val(Val::I32(p.splits as i32)),
            ],
        });
    }
    Ok((p, out))
}

/// One selection-attention call, checked and planned once; [`execute`] runs it as it is.
/// Made by [`plan_call`] before anything launches, so what the kernel does not take is
/// known (and typed) before a caller commits to it.
pub struct NsaCall {
    /// The CUDA context it was planned for (its launch depends on the device).
    context: usize,
    arrays: SeqArrays,
    kind: SelKind,
    dims: AttnDims,
    dtype: Dtype,
    pages: Option<PageLayout>,
    launch: NsaPlan,
    steps: Plan,
}

impl NsaCall {
    /// How the call launches (warps, splits, shared memory).
    pub fn launch(&self) -> NsaPlan {
        self.launch
    }
}

/// Checks and plans selection attention for `T` on `stream`'s device: the token partition,
/// the selection's kind and width, and the kernel for these head dims and group size.
/// `Error::Unsupported` for what the kernel does not take (callers fall back);
/// `Error::Invalid` for arguments no path could take.
pub fn plan_call<T: Element>(
    stream: &Arc<CudaStream>,
    dims: AttnDims,
    seqs: &[Seq],
    kind: SelKind,
    scale: f32,
) -> Result<NsaCall> {
    plan_any::<T>(stream, dims, SeqArrays::new(seqs)?, kind, scale, None)
}

/// [`plan_call`] for keys and values in a page pool ([`PageLayout`]); run it with
/// [`execute_paged`]. `seqs` give each sequence's queries and key count (`k_start` unused).
pub fn plan_call_paged<T: Element>(
    stream: &Arc<CudaStream>,
    dims: AttnDims,
    seqs: &[Seq],
    kind: SelKind,
    scale: f32,
    pages: PageLayout,
) -> Result<NsaCall> {
    plan_any::<T>(
        stream,
        dims,
        SeqArrays::paged(seqs)?,
        kind,
        scale,
        Some(pages),
    )
}

fn plan_any<T: Element>(
    stream: &Arc<CudaStream>,
    dims: AttnDims,
    arrays: SeqArrays,
    kind: SelKind,
    scale: f32,
    pages: Option<PageLayout>,
) -> Result<NsaCall> {
    let dtype = Dtype::of::<T>();
    let g = gpu(stream)?;
    let (launch, steps) = plan_selection(&g.info, dims, &arrays, kind, dtype, scale, pages)?;
    Ok(NsaCall {
        context: stream.context().cu_ctx() as usize,
        arrays,
        kind,
        dims,
        dtype,
        pages,
        launch,
        steps,
    })
}

/// Token-packed `q [Σtq, hq, d]`, `k [Σtk, hkv, d]`, `v [Σtk, hkv, dv]` (bf16 or f16) ->
/// `o [Σtq, hq, dv]` in the input type and `lse [Σtq, hq]` (natural log; `-inf` and `o = 0`
/// where a query sees no selected key), as planned by [`plan_call`]. `sel` holds the
/// selection's i32 entries (`Σtq · hkv` rows of the planned kind's width). The buffers must be
/// the ones the plan describes (`Error::Invalid` naming the buffer otherwise).
#[allow(clippy::too_many_arguments)]
pub fn execute<T: Element>(
    stream: &Arc<CudaStream>,
    call: &NsaCall,
    q: &CudaView<'_, T>,
    k: &CudaView<'_, T>,
    v: &CudaView<'_, T>,
    sel: &CudaView<'_, i32>,
    o: &mut CudaViewMut<'_, T>,
    lse: &mut CudaViewMut<'_, f32>,
) -> Result<NsaPlan> {
    if call.pages.is_some() {
        return Err(invalid(
            "call",
            "was planned for pages: run it with execute_paged",
        ));
    }
    run_call(stream, call, q, k, v, None, sel, o, lse)
}

/// [`execute`] for a call planned by [`plan_call_paged`]: `k_pages [num_pages * page_size,
/// hkv, d]`, `v_pages [num_pages * page_size, hkv, dv]` and `block_table [B * max_pages]`.
#[allow(clippy::too_many_arguments)]
pub fn execute_paged<T: Element>(
    stream: &Arc<CudaStream>,
    call: &NsaCall,
    q: &CudaView<'_, T>,
    k_pages: &CudaView<'_, T>,
    v_pages: &CudaView<'_, T>,
    block_table: &CudaView<'_, i32>,
    sel: &CudaView<'_, i32>,
    o: &mut CudaViewMut<'_, T>,
    lse: &mut CudaViewMut<'_, f32>,
) -> Result<NsaPlan> {
    if call.pages.is_none() {
        return Err(invalid(
            "call",
            "was planned for packed keys: run it with execute",
        ));
    }
    run_call(
        stream,
        call,
        q,
        k_pages,
        v_pages,
        Some(block_table),
        sel,
        o,
        lse,
    )
}

#[allow(clippy::too_many_arguments)]
fn run_call<T: Element>(
    stream: &Arc<CudaStream>,
    call: &NsaCall,
    q: &CudaView<'_, T>,
    k: &CudaView<'_, T>,
    v: &CudaView<'_, T>,
    table: Option<&CudaView<'_, i32>>,
    sel: &CudaView<'_, i32>,
    o: &mut CudaViewMut<'_, T>,
    lse: &mut CudaViewMut<'_, f32>,
) -> Result<NsaPlan> {
    if call.dtype != Dtype::of::<T>() {
        return Err(invalid("q", "element type differs from the planned call's"));
    }
    if call.context != stream.context().cu_ctx() as usize {
        return Err(invalid(
            "stream",
            "belongs to another device than the planned call's",
        ));
    }
    let arrays = &call.arrays;
    let (hq, hkv, d, dv) = (
        call.dims.hq(),
        call.dims.hkv(),
        call.dims.d(),
        call.dims.dv(),
    );
    let tq = arrays.total_q;
    let (tk, table_len) = match call.pages {
        Some(l) => (l.num_pages * l.page_size, arrays.q_off.len() * l.max_pages),
        None => (arrays.total_k, 0),
    };
    for (arg, got, want) in [
        ("q", q.len(), tq * hq * d),
        ("k", k.len(), tk * hkv * d),
        ("v", v.len(), tk * hkv * dv),
        ("block_table", table.map_or(0, |t| t.len()), table_len),
        ("selection", sel.len(), tq * hkv * call.kind.width()),
        ("o", o.len(), tq * hq * dv),
        ("lse", lse.len(), tq * hq),
    ] {
        if got != want {
            return Err(invalid(arg, format!("expected {want} elements, got {got}")));
        }
    }
    let g = gpu(stream)?;
    let cu_q = stream.clone_htod(&arrays.cu_q)?;
    let cu_k = stream.clone_htod(&arrays.cu_k)?;
    let q_off = stream.clone_htod(&arrays.q_off)?;
    let size = std::mem::size_of::<T>();
    let (o_len, lse_len) = (o.len(), lse.len());
    let (qp, _g0) = q.device_ptr(stream);
    let (kp, _g1) = k.device_ptr(stream);
    let (vp, _g2) = v.device_ptr(stream);
    let (sp, _g3) = sel.device_ptr(stream);
    let (cq, _g4) = cu_q.device_ptr(stream);
    let (ck, _g5) = cu_k.device_ptr(stream);
    let (qo, _g6) = q_off.device_ptr(stream);
    let (op, _g7) = o.device_ptr_mut(stream);
    let (lp, _g8) = lse.device_ptr_mut(stream);
    let table = table.map(|t| t.device_ptr(stream));
    // cp.async moves 16-byte rows of K / V; q is read in 4-byte pairs
    if kp % 16 != 0 || vp % 16 != 0 || qp % 4 != 0 {
        return Err(unsupported(
            "nsa selection",
            "q, k or v is not aligned for vector loads",
        ));
    }
    let mut args = vec![
        DevBuf {
            ptr: qp,
            bytes: q.len() * size,
        },
        DevBuf {
            ptr: kp,
            bytes: k.len() * size,
        },
        DevBuf {
            ptr: vp,
            bytes: v.len() * size,
        },
        DevBuf {
            ptr: sp,
            bytes: 4 * sel.len(),
        },
        DevBuf {
            ptr: cq,
            bytes: 4 * arrays.cu_q.len(),
        },
        DevBuf {
            ptr: ck,
            bytes: 4 * arrays.cu_k.len(),
        },
        DevBuf {
            ptr: qo,
            bytes: 4 * arrays.q_off.len(),
        },
        DevBuf {
            ptr: op,
            bytes: o_len * size,
        },
        DevBuf {
            ptr: lp,
            bytes: 4 * lse_len,
        },
    ];
    if let Some((tp, _)) = &table {
        args.push(DevBuf {
            ptr: *tp,
            bytes: 4 * table_len,
        });
    }
    launch::execute(&g, stream, &call.steps, &args)?;
    Ok(call.launch)
}

/// [`plan_call`] then [`execute`], the selection's kind taken from `sel`. Returns how it
/// launched. Shapes the kernel does not take are `Error::Unsupported` (callers fall back).
#[allow(clippy::too_many_arguments)]
pub fn selection_attention<T: Element>(
    stream: &Arc<CudaStream>,
    q: &CudaView<'_, T>,
    k: &CudaView<'_, T>,
    v: &CudaView<'_, T>,
    sel: &Selection<'_>,
    seqs: &[Seq],
    dims: AttnDims,
    scale: f32,
    o: &mut CudaViewMut<'_, T>,
    lse: &mut CudaViewMut<'_, f32>,
) -> Result<NsaPlan> {
    let (kind, entries) = match sel {
        Selection::Blocks {
            indices,
            per_row,
            block_size,
        } => (
            SelKind::Blocks {
                per_row: *per_row,
                block_size: *block_size,
            },
            indices,
        ),
        Selection::Ranges { ranges, per_row } => (SelKind::Ranges { per_row: *per_row }, ranges),
    };
    let call = plan_call::<T>(stream, dims, seqs, kind, scale)?;
    execute(stream, &call, q, k, v, entries, o, lse)
}
