use candle_core::{DType, Tensor};
use fp8nsa_types::{AttnDims, Pages, Seq, Settings, Spans};

use super::op::{SelPlan, SelectionOp};
use super::paged_kv::{PagedKv, PoolRef};
use super::sdpa::masked_sdpa;
use super::selection::{host_selection, validate_host, Selection};
use crate::backend::{use_cuda, Backend, PjrtRuntime};
use crate::error::{invalid, shape_err, Error, Result};

pub use fp8nsa_types::{DEFAULT_MIN_LEN, NSA_MIN_LEN_ENV as MIN_LEN_ENV};

/// Which implementation a selection-attention call ran, decided once per call and returned by
/// [`SelectionAttention::forward_with_path`] (the `tracing` events say the same for logs).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use fp8nsa_ops::nsa::{NsaPath, SdpaReason, SelectionAttention, SelectionRanges};
///
/// let q = Tensor::randn(0f32, 1.0, (1, 4, 2, 8), &Device::Cpu)?;
/// let k = Tensor::randn(0f32, 1.0, (1, 4, 1, 8), &Device::Cpu)?;
/// let r = SelectionRanges::new(Tensor::new(&[0i32, 4], &Device::Cpu)?.reshape((1, 1, 1, 1, 2))?.repeat((1, 4, 1, 1, 1))?)?;
/// let att = SelectionAttention::new().min_len(0);
/// assert_eq!(att.forward_with_path(&q, &k, &k, &r)?.2, NsaPath::CpuKernel);
/// let dense = SelectionAttention::new().min_len(100);
/// let path = dense.forward_with_path(&q, &k, &k, &r)?.2;
/// assert_eq!(path, NsaPath::Sdpa(SdpaReason::BelowMinLen { tk: 4, min_len: 100 }));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NsaPath {
    /// fp8nsa-cpu's selection kernel.
    CpuKernel,
    /// fp8nsa-cuda's selection kernel.
    CudaKernel,
    /// The PJRT masked program (whatever `min_len` says).
    Pjrt,
    /// The dense masked SDPA in Candle ops, on the tensors' device.
    Sdpa(SdpaReason),
    /// No selected entries: zeros and `lse = -inf`, nothing launched.
    Empty,
}

/// Why the dense masked SDPA ran instead of a selection kernel (docs/nsa.md, "SDPA fallback").
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SdpaReason {
    /// The longest sequence has fewer keys than `min_len`.
    BelowMinLen { tk: usize, min_len: usize },
    /// No selection kernel takes this call (device, dtype, head dims or group size); says why.
    NoKernel(String),
}

impl std::fmt::Display for SdpaReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SdpaReason::BelowMinLen { tk, min_len } => write!(f, "tk = {tk} < min_len = {min_len}"),
            SdpaReason::NoKernel(why) => f.write_str(why),
        }
    }
}

/// `(o, lse, the path that ran)`.
pub type PathOutput = (Tensor, Option<Tensor>, NsaPath);

/// Where one selection call runs, decided once per call (the backend resolved, CUDA or not,
/// `min_len` read) and handed to the path that runs it.
enum Route {
    /// A PJRT runtime: a masked program per sequence (no `min_len`: it has one program).
    Pjrt(std::sync::Arc<PjrtRuntime>),
    /// CUDA tensors: our kernel from `min_len` keys (where it takes the call), else the
    /// masked SDPA on the GPU.
    Cuda { min_len: usize },
    /// Host-side paths: the CPU kernel from `min_len` keys for CPU tensors (`cpu`), else
    /// Candle's masked SDPA.
    Host { min_len: usize, cpu: bool },
}

impl Route {
    /// Whether a kernel that reads a page pool in place gets a call whose longest sequence
    /// has `max_tk` keys: the CPU kernel or the CUDA one, from `min_len` keys. (The CUDA
    /// kernel may still refuse the call; it then gathers and falls back.)
    fn reads_pages(&self, max_tk: usize) -> bool {
        match *self {
            Route::Cuda { min_len } | Route::Host { min_len, cpu: true } => max_tk >= min_len,
            Route::Host { cpu: false, .. } | Route::Pjrt(_) => false,
        }
    }
}

/// Each sequence's keys and values gathered out of the pools `[num_pages * page_size, Hkv, *]`,
/// packed one after another, with `seqs` pointed at them: for the paths that do not read pages.
fn gather_pages(
    pool_k: &Tensor,
    pool_v: &Tensor,
    seqs: &[Seq],
    pages: &Pages<'_>,
) -> Result<(Tensor, Tensor, Vec<Seq>)> {
    let mut rows = Vec::new();
    let mut packed = seqs.to_vec();
    for (i, s) in packed.iter_mut().enumerate() {
        s.k_start = rows.len();
        rows.extend((0..s.k_len).map(|j| pages.row(i, j) as u32));
    }
    let n = rows.len();
    let rows = Tensor::from_vec(rows, n, pool_k.device())?;
    Ok((
        pool_k.index_select(&rows, 0)?,
        pool_v.index_select(&rows, 0)?,
        packed,
    ))
}

/// NSA selection attention: each query attends to the keys its selection names (shared by the G
/// query heads of a kv head), causally, with an f32 softmax.
///
/// Layout BTHD: `q [B, Tq, Hq, D]`, `k [B, Tk, Hkv, D]`, `v [B, Tk, Hkv, Dv]`, `Hq = G · Hkv`,
/// f32/bf16/f16. Query `i` sits at position `q_offset + i` (default `Tk - Tq`: prefill, decode
/// and chunked prefill alike) and sees key `j` iff `j <= q_offset + i`. Output
/// `o [B, Tq, Hq, Dv]` in the input dtype and, `with_lse`, `lse [B, Tq, Hq]` f32 (natural log).
/// A query that sees no selected key gets `o = 0`, `lse = -inf`.
///
/// On the CPU the selection is validated first (duplicates, overlaps and out-of-range entries
/// are errors). Below `min_len` keys, or where no kernel exists for the device, a dense masked
/// SDPA built from Candle ops runs instead, and a `tracing` event says why.
#[derive(Clone, Debug)]
pub struct SelectionAttention {
    scale: Option<f32>,
    q_offset: Option<usize>,
    /// `None`: `FP8NSA_NSA_MIN_LEN` or [`DEFAULT_MIN_LEN`], read when the layer runs.
    min_len: Option<usize>,
    with_lse: bool,
    backend: Backend,
}

impl Default for SelectionAttention {
    fn default() -> Self {
        Self::new()
    }
}

impl SelectionAttention {
    /// Scale `1/sqrt(D)`, default `q_offset`, `min_len` from `FP8NSA_NSA_MIN_LEN` or 2048, no
    /// lse.
    pub fn new() -> Self {
        Self {
            scale: None,
            q_offset: None,
            min_len: None,
            with_lse: false,
            backend: Backend::Auto,
        }
    }

    /// Runs on `backend` (default `Backend::Auto`: the tensor's device, or `FP8NSA_BACKEND`).
    /// On PJRT the masked program runs whatever `min_len` says.
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// Score scale (default `1/sqrt(D)`).
    pub fn scale(mut self, scale: f32) -> Self {
        self.scale = Some(scale);
        self
    }

    /// Absolute position of the first query (default `Tk - Tq`, per sequence for varlen).
    pub fn q_offset(mut self, q_offset: usize) -> Self {
        self.q_offset = Some(q_offset);
        self
    }

    /// Key count below which the dense fallback runs.
    pub fn min_len(mut self, min_len: usize) -> Self {
        self.min_len = Some(min_len);
        self
    }

    /// Decides where a call on `q`'s device runs: the backend resolved once, and the
    /// `min_len` in force (the one set, else the settings'; an unparsable
    /// `FP8NSA_NSA_MIN_LEN` is an error here, not a silent default, on every path but PJRT).
    fn route(&self, q: &Tensor) -> Result<Route> {
        let backend = self.backend.resolve()?;
        if let Backend::Pjrt(rt) = backend {
            return Ok(Route::Pjrt(rt));
        }
        let cuda = use_cuda(&backend, q.device(), "SelectionAttention")?;
        let min_len = match self.min_len {
            Some(n) => n,
            None => Settings::global().nsa_min_len.clone()?,
        };
        Ok(if cuda {
            Route::Cuda { min_len }
        } else {
            Route::Host {
                min_len,
                cpu: q.device().is_cpu(),
            }
        })
    }

    /// Also return the log-sum-exp of the scores.
    pub fn with_lse(mut self, with_lse: bool) -> Self {
        self.with_lse = with_lse;
        self
    }

    /// Dense batch: see the type's docs for shapes. `selection` is a `&BlockSelection` or
    /// `&SelectionRanges` of `[B, Tq, Hkv, ..]`.
    pub fn forward<'s>(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        selection: impl Into<Selection<'s>>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (o, lse, _) = self.forward_with_path(q, k, v, selection)?;
        Ok((o, lse))
    }

    /// [`Self::forward`], also returning which implementation ran.
    pub fn forward_with_path<'s>(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        selection: impl Into<Selection<'s>>,
    ) -> Result<PathOutput> {
        let sel = selection.into();
        let (b, tq, hq, d) = dims4("q", q, "[B, Tq, Hq, D]")?;
        let (bk, tk, hkv, dk) = dims4("k", k, "[B, Tk, Hkv, D]")?;
        let (bv, tv, hv, dv) = dims4("v", v, "[B, Tk, Hkv, Dv]")?;
        if bk != b || dk != d {
            return Err(shape_err("k", format!("[{b}, Tk, Hkv, {d}]"), k.dims()));
        }
        if (bv, tv, hv) != (b, tk, hkv) {
            return Err(shape_err("v", format!("[{b}, {tk}, {hkv}, Dv]"), v.dims()));
        }
        let q_offset = match self.q_offset {
            Some(o) => o,
            None => tk.checked_sub(tq).ok_or_else(|| {
                invalid(
                    "q_offset",
                    format!("Tq = {tq} > Tk = {tk} needs an explicit q_offset"),
                )
            })?,
        };
        let seqs: Vec<Seq> = (0..b)
            .map(|i| Seq {
                q_start: i * tq,
                q_len: tq,
                k_start: i * tk,
                k_len: tk,
                q_offset,
            })
            .collect();
        let (o, lse, path) = self.run(
            &q.reshape((b * tq, hq, d))?,
            &k.reshape((b * tk, hkv, d))?,
            &v.reshape((b * tk, hkv, dv))?,
            &seqs,
            sel,
            [b, tq, hkv],
            None,
            &self.route(q)?,
        )?;
        let lse = match lse {
            Some(l) => Some(l.reshape((b, tq, hq))?),
            None => None,
        };
        Ok((o.reshape((b, tq, hq, dv))?, lse, path))
    }

    /// Packed sequences: `q [ΣTq, Hq, D]`, `k [ΣTk, Hkv, D]`, `v [ΣTk, Hkv, Dv]`,
    /// `cu_seqlens_q` / `cu_seqlens_k` (u32, i32 or i64, length B + 1, from 0 to the totals).
    /// The selection is packed like q, `[1, ΣTq, Hkv, ..]`, with key positions relative to
    /// each sequence's own keys. Output `o [ΣTq, Hq, Dv]`, `lse [ΣTq, Hq]`.
    pub fn forward_varlen<'s>(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cu_seqlens_q: &Tensor,
        cu_seqlens_k: &Tensor,
        selection: impl Into<Selection<'s>>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (o, lse, _) =
            self.forward_varlen_with_path(q, k, v, cu_seqlens_q, cu_seqlens_k, selection)?;
        Ok((o, lse))
    }

    /// [`Self::forward_varlen`], also returning which implementation ran.
    pub fn forward_varlen_with_path<'s>(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cu_seqlens_q: &Tensor,
        cu_seqlens_k: &Tensor,
        selection: impl Into<Selection<'s>>,
    ) -> Result<PathOutput> {
        let sel = selection.into();
        let (tq, _, d) = dims3("q", q, "[ΣTq, Hq, D]")?;
        let (tk, hkv, dk) = dims3("k", k, "[ΣTk, Hkv, D]")?;
        let (tv, hv, _) = dims3("v", v, "[ΣTk, Hkv, Dv]")?;
        if dk != d {
            return Err(shape_err("k", format!("[ΣTk, Hkv, {d}]"), k.dims()));
        }
        if (tv, hv) != (tk, hkv) {
            return Err(shape_err("v", format!("[{tk}, {hkv}, Dv]"), v.dims()));
        }
        let cq = cu_seqlens("cu_seqlens_q", cu_seqlens_q, tq)?;
        let ck = cu_seqlens("cu_seqlens_k", cu_seqlens_k, tk)?;
        if cq.len() != ck.len() {
            return Err(shape_err(
                "cu_seqlens_k",
                format!("[{}] like cu_seqlens_q", cq.len()),
                cu_seqlens_k.dims(),
            ));
        }
        let mut seqs = Vec::with_capacity(cq.len() - 1);
        for i in 0..cq.len() - 1 {
            let (q_len, k_len) = (cq[i + 1] - cq[i], ck[i + 1] - ck[i]);
            let q_offset = match self.q_offset {
                Some(o) => o,
                None => k_len.checked_sub(q_len).ok_or_else(|| {
                    invalid(
                        "q_offset",
                        format!(
                            "sequence {i}: Tq = {q_len} > Tk = {k_len} needs an explicit q_offset"
                        ),
                    )
                })?,
            };
            seqs.push(Seq {
                q_start: cq[i],
                q_len,
                k_start: ck[i],
                k_len,
                q_offset,
            });
        }
        self.run(q, k, v, &seqs, sel, [1, tq, hkv], None, &self.route(q)?)
    }

    /// Selection attention over a paged KV cache (see [`PagedKv`]), the shape of a
    /// continuous-batching step: `q [B, Tq, Hq, D]` holds the last `Tq` positions of each of
    /// the `B` sequences (one query each in decode, a few for speculative decoding), so query
    /// `i` of sequence `b` sits at `seq_lens[b] − Tq + i` (or `q_offset + i` when set). The
    /// selection `[B, Tq, Hkv, ..]` names logical key positions, as for [`Self::forward`].
    /// Output `o [B, Tq, Hq, Dv]`, `lse [B, Tq, Hq]`.
    ///
    /// The CPU and CUDA kernels read the pages in place (any page size; the kernels' outputs
    /// equal their contiguous calls'); the other paths (the dense fallback, PJRT) gather each
    /// sequence's keys first. On the CPU the result is bit for bit that of
    /// [`Self::forward_varlen`] on the gathered keys. A wrong table shape, a page id outside
    /// the pool in a used entry, a `seq_len` past what the table row covers, or a selection
    /// past `seq_len` is an error naming the argument and the sequence.
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use fp8nsa_ops::nsa::{PagedKv, SelectionAttention, TokenSelection};
    ///
    /// let dev = Device::Cpu;
    /// // a pool of 8 pages of 16 tokens; two sequences of 20 and 37 keys, one query each
    /// let k_pages = Tensor::randn(0f32, 1.0, (8, 16, 2, 64), &dev)?;
    /// let v_pages = Tensor::randn(0f32, 1.0, (8, 16, 2, 64), &dev)?;
    /// let block_table = Tensor::new(&[[5i32, 2, -1], [0, 7, 3]], &dev)?;
    /// let kv = PagedKv { k_pages: &k_pages, v_pages: &v_pages, block_table: &block_table,
    ///                    seq_lens: &[20, 37] };
    /// let q = Tensor::randn(0f32, 1.0, (2, 1, 8, 64), &dev)?;
    /// // each query attends 4 chosen tokens (per kv head), -1 pads
    /// let idx = Tensor::new(&[[[[0i32, 3, 19, -1], [1, 2, 4, 8]]], [[[0, 20, 36, 5], [-1, -1, 30, 31]]]], &dev)?;
    /// let sel = TokenSelection::new(idx)?;
    /// let (o, _) = SelectionAttention::new().min_len(0).forward_paged(&q, &kv, &sel)?;
    /// assert_eq!(o.dims(), &[2, 1, 8, 64]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn forward_paged<'s>(
        &self,
        q: &Tensor,
        kv: &PagedKv<'_>,
        selection: impl Into<Selection<'s>>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (o, lse, _) = self.forward_paged_with_path(q, kv, selection)?;
        Ok((o, lse))
    }

    /// [`Self::forward_paged`], also returning which implementation ran.
    pub fn forward_paged_with_path<'s>(
        &self,
        q: &Tensor,
        kv: &PagedKv<'_>,
        selection: impl Into<Selection<'s>>,
    ) -> Result<PathOutput> {
        let mut out = self.forward_paged_each(q, kv, &[selection.into()])?;
        Ok(out.pop().expect("one output per selection"))
    }

    /// [`Self::forward_paged_with_path`] for several selections over the same queries and
    /// pages (the NSA layer's selected blocks and its window): the block table is read, checked
    /// and routed once, then each selection runs on that decision.
    pub(crate) fn forward_paged_each(
        &self,
        q: &Tensor,
        kv: &PagedKv<'_>,
        sels: &[Selection<'_>],
    ) -> Result<Vec<PathOutput>> {
        let (b, tq, hq, d) = dims4("q", q, "[B, Tq, Hq, D]")?;
        let (np, ps, hkv, dk) = dims4("k_pages", kv.k_pages, "[num_pages, page_size, Hkv, D]")?;
        let (npv, psv, hv, dv) = dims4("v_pages", kv.v_pages, "[num_pages, page_size, Hkv, Dv]")?;
        if dk != d {
            return Err(shape_err(
                "k_pages",
                format!("[{np}, {ps}, {hkv}, {d}]"),
                kv.k_pages.dims(),
            ));
        }
        if (npv, psv, hv) != (np, ps, hkv) {
            return Err(shape_err(
                "v_pages",
                format!("[{np}, {ps}, {hkv}, Dv]"),
                kv.v_pages.dims(),
            ));
        }
        let max_pages = match *kv.block_table.dims() {
            [bt, m] if bt == b => m,
            _ => {
                return Err(shape_err(
                    "block_table",
                    format!("[{b}, max_pages]"),
                    kv.block_table.dims(),
                ))
            }
        };
        if kv.block_table.dtype() != DType::I32 {
            return Err(Error::DType {
                arg: "block_table",
                expected: "i32",
                got: kv.block_table.dtype(),
            });
        }
        if kv.seq_lens.len() != b {
            return Err(invalid(
                "seq_lens",
                format!("has {} entries for {b} sequences", kv.seq_lens.len()),
            ));
        }
        let table: Vec<i32> = kv
            .block_table
            .to_device(&candle_core::Device::Cpu)?
            .flatten_all()?
            .to_vec1()?;
        let mut seqs = Vec::with_capacity(b);
        for (i, &k_len) in kv.seq_lens.iter().enumerate() {
            let q_offset = match self.q_offset {
                Some(o) => o,
                None => k_len.checked_sub(tq).ok_or_else(|| {
                    invalid(
                        "seq_lens",
                        format!("sequence {i}: {k_len} keys for {tq} queries (Tq > seq_len)"),
                    )
                })?,
            };
            seqs.push(Seq {
                q_start: i * tq,
                q_len: tq,
                k_start: 0,
                k_len,
                q_offset,
            });
        }
        // the table against the pool and seq_lens, once, for every path
        let pages = Pages::new(&table, max_pages, ps, &seqs, np * ps)?;
        let q_packed = q.reshape((b * tq, hq, d))?;
        let pool_k = kv.k_pages.reshape((np * ps, hkv, d))?;
        let pool_v = kv.v_pages.reshape((np * ps, hkv, dv))?;
        let max_tk = kv.seq_lens.iter().copied().max().unwrap_or(0);
        let pool = PoolRef {
            host: pages,
            table: kv.block_table,
            num_pages: np,
        };
        let route = self.route(q)?;
        // in place, or over the keys gathered once for every selection
        let gathered = if route.reads_pages(max_tk) {
            None
        } else {
            Some(gather_pages(&pool_k, &pool_v, &seqs, &pages)?)
        };
        let mut outs = Vec::with_capacity(sels.len());
        for &sel in sels {
            let (o, lse, path) = match &gathered {
                None => self.run(
                    &q_packed,
                    &pool_k,
                    &pool_v,
                    &seqs,
                    sel,
                    [b, tq, hkv],
                    Some(pool),
                    &route,
                )?,
                Some((k, v, seqs)) => {
                    self.run(&q_packed, k, v, seqs, sel, [b, tq, hkv], None, &route)?
                }
            };
            let lse = match lse {
                Some(l) => Some(l.reshape((b, tq, hq))?),
                None => None,
            };
            outs.push((o.reshape((b, tq, hq, dv))?, lse, path));
        }
        Ok(outs)
    }

    /// Token-packed core shared by the entry points, on the `route` the entry point decided;
    /// `pages` (only where that route reads them) means `k` / `v` are a page pool read through
    /// the block table.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqs: &[Seq],
        sel: Selection<'_>,
        sel_dims: [usize; 3],
        pages: Option<PoolRef<'_>>,
        route: &Route,
    ) -> Result<PathOutput> {
        let (tq, hq, d) = q.dims3()?;
        let (_, hkv, _) = k.dims3()?;
        let dv = v.dims()[2];
        if hkv == 0 || hq % hkv != 0 {
            return Err(shape_err(
                "q",
                format!("Hq a multiple of Hkv = {hkv}"),
                q.dims(),
            ));
        }
        if tq == 0 {
            return Err(invalid(
                "q",
                "has no query tokens (Tq = 0): nothing to attend",
            ));
        }
        // every path computes query positions q_offset + i: refuse what would wrap
        if let Some((i, s)) = seqs
            .iter()
            .enumerate()
            .find(|(_, s)| s.q_offset.checked_add(s.q_len).is_none())
        {
            return Err(invalid(
                "q_offset",
                format!(
                    "sequence {i}: q_offset {} + {} queries overflows a position",
                    s.q_offset, s.q_len
                ),
            ));
        }
        if d == 0 {
            return Err(shape_err("q", "head dim D >= 1", q.dims()));
        }
        if dv == 0 {
            return Err(shape_err("v", "value head dim Dv >= 1", v.dims()));
        }
        for (arg, t) in [("q", q), ("k", k), ("v", v)] {
            if !matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16) {
                return Err(Error::DType {
                    arg,
                    expected: "f32, bf16 or f16",
                    got: t.dtype(),
                });
            }
            if t.dtype() != q.dtype() || !t.device().same_device(q.device()) {
                return Err(invalid(arg, "q, k and v must share dtype and device"));
            }
        }
        let sd = sel.dims();
        if sd[..3] != sel_dims {
            return Err(shape_err(
                "selection",
                format!("[{}, {}, {}, ..]", sel_dims[0], sel_dims[1], sel_dims[2]),
                &sd,
            ));
        }
        let scale = self.scale.unwrap_or(1.0 / (d as f32).sqrt());
        let max_tk = seqs.iter().map(|s| s.k_len).max().unwrap_or(0);
        debug_assert!(pages.is_none() || route.reads_pages(max_tk));
        let min_len = match *route {
            Route::Cuda { min_len } => {
                return self.run_cuda(q, k, v, seqs, sel, scale, max_tk, min_len, pages);
            }
            Route::Host { min_len, .. } => Some(min_len),
            Route::Pjrt(_) => None,
        };
        let host = host_selection(sel)?;
        let mut seq_of = vec![0usize; tq];
        for (i, s) in seqs.iter().enumerate() {
            seq_of[s.q_start..s.q_start + s.q_len].fill(i);
        }
        // errors name (batch, token): the sequence and the token within it
        validate_host(
            &host,
            &|t| {
                let s = seqs[seq_of[t]];
                (seq_of[t], t - s.q_start, s.k_len)
            },
            hkv,
        )?;
        if let Route::Pjrt(rt) = route {
            let (o, lse) = super::pjrt::selection(rt, q, k, v, seqs, &host, scale)?;
            return Ok((
                o.to_dtype(q.dtype())?,
                self.with_lse.then_some(lse),
                NsaPath::Pjrt,
            ));
        }
        let min_len = min_len.unwrap_or(0); // Route::Pjrt returned above
        let reason = if max_tk < min_len {
            Some(SdpaReason::BelowMinLen {
                tk: max_tk,
                min_len,
            })
        } else if !q.device().is_cpu() {
            Some(SdpaReason::NoKernel(format!(
                "no selection kernel for {:?}",
                q.device()
            )))
        } else {
            None
        };
        let _span = tracing::debug_span!("fp8nsa::nsa_selection", tq, hq, hkv, d, dv).entered();
        if let Some(reason) = reason {
            tracing::debug!(op = "nsa_selection", backend = "sdpa-fallback", %reason, tq, hq, hkv, d, dv);
            let (o, lse) = masked_sdpa(q, k, v, seqs, &host, scale)?;
            return Ok((
                o.to_dtype(q.dtype())?,
                self.with_lse.then_some(lse),
                NsaPath::Sdpa(reason),
            ));
        }
        let dims = AttnDims::new(hq, hkv, d, dv)?;
        let block_size = match &host {
            Spans::Blocks { block_size, .. } => Some(*block_size),
            Spans::Ranges { .. } => None,
        };
        let plan = match pages {
            None => fp8nsa_cpu::nsa::plan(dims, seqs, k.dims()[0], block_size)?,
            Some(p) => fp8nsa_cpu::nsa::plan_paged(dims, seqs, k.dims()[0], block_size, p.host)?,
        };
        let op = SelectionOp::new(dims, scale, SelPlan::Cpu(plan, &host));
        let (o, lse) = op.apply(q, k, v)?;
        let lse = self.with_lse.then_some(lse);
        Ok((o, lse, NsaPath::CpuKernel))
    }
}

impl SelectionAttention {
    /// CUDA tensors: the selection kernel, or the dense masked SDPA on the GPU below `min_len`
    /// and for what the kernel does not take (logged with the reason). The selection is not
    /// validated here: kernel and fallback both clamp, sort and merge each row, as the
    /// reference does, so an invalid selection computes the attention of its valid part.
    /// With `pages`, `k` and `v` are page pools: the kernel reads them in place, and the
    /// fallback gathers each sequence's keys first.
    #[allow(clippy::too_many_arguments)]
    fn run_cuda(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqs: &[Seq],
        sel: Selection<'_>,
        scale: f32,
        max_tk: usize,
        min_len: usize,
        pages: Option<PoolRef<'_>>,
    ) -> Result<PathOutput> {
        let (tq, hq, d) = q.dims3()?;
        let (_, hkv, _) = k.dims3()?;
        let dv = v.dims()[2];
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        let _span = tracing::debug_span!("fp8nsa::nsa_selection", tq, hq, hkv, d, dv).entered();
        if sel.dims()[3] == 0 {
            // nothing selected: every row is empty, and no launch sees a zero-sized buffer
            tracing::debug!(
                op = "nsa_selection",
                backend = "cuda-empty-selection",
                tq,
                hq,
                hkv
            );
            let o = Tensor::zeros((tq, hq, dv), q.dtype(), q.device())?;
            let lse = self
                .with_lse
                .then(|| Tensor::full(f32::NEG_INFINITY, (tq, hq), q.device()))
                .transpose()?;
            return Ok((o, lse, NsaPath::Empty));
        }
        let planned = if max_tk < min_len {
            Err(SdpaReason::BelowMinLen {
                tk: max_tk,
                min_len,
            })
        } else {
            super::cuda::plan(&q, &k, &v, seqs, sel, scale, pages.as_ref())?
                .map_err(SdpaReason::NoKernel)
        };
        let call = match planned {
            Ok(call) => call,
            Err(reason) => {
                tracing::debug!(op = "nsa_selection", backend = "cuda-sdpa-fallback", %reason, tq, hq, hkv, d, dv);
                let host = host_selection(sel)?;
                let (o, lse) = match pages {
                    None => masked_sdpa(&q, &k, &v, seqs, &host, scale)?,
                    Some(p) => {
                        let (k, v, seqs) = gather_pages(&k, &v, seqs, &p.host)?;
                        masked_sdpa(&q, &k, &v, &seqs, &host, scale)?
                    }
                };
                return Ok((
                    o.to_dtype(q.dtype())?,
                    self.with_lse.then_some(lse),
                    NsaPath::Sdpa(reason),
                ));
            }
        };
        let op = SelectionOp::new(
            AttnDims::new(hq, hkv, d, dv)?,
            scale,
            SelPlan::Cuda(Box::new(call)),
        );
        let (o, lse) = op.apply(&q, &k, &v)?;
        Ok((o, self.with_lse.then_some(lse), NsaPath::CudaKernel))
    }
}

fn dims4(arg: &'static str, t: &Tensor, want: &str) -> Result<(usize, usize, usize, usize)> {
    match *t.dims() {
        [a, b, c, d] => Ok((a, b, c, d)),
        _ => Err(shape_err(arg, want, t.dims())),
    }
}

fn dims3(arg: &'static str, t: &Tensor, want: &str) -> Result<(usize, usize, usize)> {
    match *t.dims() {
        [a, b, c] => Ok((a, b, c)),
        _ => Err(shape_err(arg, want, t.dims())),
    }
}

fn cu_seqlens(arg: &'static str, t: &Tensor, total: usize) -> Result<Vec<usize>> {
    if t.rank() != 1 || t.dims()[0] < 2 {
        return Err(shape_err(arg, "[B + 1] with B >= 1", t.dims()));
    }
    let v: Vec<i64> = match t.dtype() {
        DType::U32 | DType::I32 | DType::I64 => t.to_dtype(DType::I64)?.to_vec1()?,
        got => {
            return Err(Error::DType {
                arg,
                expected: "u32, i32 or i64",
                got,
            })
        }
    };
    let ok = v[0] == 0
        && *v.last().expect("len >= 2") == total as i64
        && v.windows(2).all(|w| w[1] >= w[0]);
    if !ok {
        return Err(invalid(
            arg,
            format!("must rise from 0 to {total} without decreasing, got {v:?}"),
        ));
    }
    Ok(v.into_iter().map(|x| x as usize).collect())
}
