//! Dense attention of new tokens over a head-major cache, on the CPU, read in place: the
//! cache's first `Tk` rows are a strided view of a larger buffer, which Candle's matmul path
//! (scores, mask, softmax, weighted sum: four ops and their temporaries per layer) handled at
//! several times the cost at decode, and at twice the work in a prefill (every masked score
//! computed, then discarded).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Device, InplaceOp2, Layout, Shape, Tensor};
use fp8nsa_cpu::nsa::HeadMajor;
use fp8nsa_types::AttnDims;

use crate::error::{invalid, shape_err, Error, Result};
use crate::storage::{contiguous, contiguous_mut, f32s, ParkedError};

/// `o [B, Hq, Dv] = softmax(scale · q kᵀ) v` for one query token per sequence, every key
/// visible: `q [B, Hq, D]`, `k [B, Hkv, Tk, D]` and `v [B, Hkv, Tk, Dv]` CPU tensors (`q`
/// and `o` f32; the cache f32, or f16 / bf16, `k` and `v` alike: a 16-bit cache is read as
/// it is and computed on in f32), query head `h` reading kv head `h / (Hq / Hkv)`. `k` and `v` need contiguous rows (the last
/// dimension dense, rows `D` / `Dv` apart) and may be any batch and head strides, such as the
/// first `Tk` rows of a cache buffer (`narrow` on dim 2), read without a copy. The same online
/// softmax as selection attention: a NaN or infinite key makes its heads NaN.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use fp8nsa_ops::nsa::decode_attention;
///
/// let dev = Device::Cpu;
/// let cache = Tensor::randn(0f32, 1.0, (1, 2, 64, 16), &dev)?; // room for 64 rows
/// let k = cache.narrow(2, 0, 10)?; // 10 valid rows, in place
/// let q = Tensor::randn(0f32, 1.0, (1, 4, 16), &dev)?;
/// let o = decode_attention(&q, &k, &k, 0.25)?;
/// assert_eq!(o.dims(), &[1, 4, 16]);
/// // query head 0 reads kv head 0: the same as softmax attention from Candle ops
/// let (q0, k0) = (q.narrow(1, 0, 1)?.squeeze(0)?, k.get(0)?.get(0)?.contiguous()?);
/// let s = candle_nn::ops::softmax_last_dim(&(q0.matmul(&k0.t()?)? * 0.25)?)?;
/// let want = s.matmul(&k0)?;
/// let diff = (o.get(0)?.narrow(0, 0, 1)? - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-5);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn decode_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<Tensor> {
    let (b, hq, d) = q
        .dims3()
        .map_err(|_| shape_err("q", "[B, Hq, D] (one token per sequence)", q.dims()))?;
    let o = attend(&q.reshape((b, 1, hq, d))?, k, v, scale, true)?;
    Ok(o.squeeze(1)?)
}

/// Causal dense attention of `T` new tokens per sequence over a head-major cache that already
/// holds them: `q [B, T, Hq, D]`, `k [B, Hkv, Tk, D]`, `v [B, Hkv, Tk, Dv]` as in
/// [`decode_attention`] (which is `T = 1`), token `i` at position `Tk - T + i` seeing rows
/// `0..=Tk - T + i`; `o [B, T, Hq, Dv]`. A prefill chunk on the decode step's online softmax
/// (blocked on AVX2): no score matrix, no mask, and no work on the keys a token cannot see.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use fp8nsa_ops::nsa::{causal_attention, decode_attention};
///
/// let dev = Device::Cpu;
/// let cache = Tensor::randn(0f32, 1.0, (1, 2, 64, 16), &dev)?; // room for 64 rows
/// let k = cache.narrow(2, 0, 10)?; // 10 valid rows, the last 3 the new tokens'
/// let q = Tensor::randn(0f32, 1.0, (1, 3, 4, 16), &dev)?;
/// let o = causal_attention(&q, &k, &k, 0.25)?;
/// assert_eq!(o.dims(), &[1, 3, 4, 16]);
/// // the first new token sees rows 0..8, as a decode step over 8 rows would
/// let first = decode_attention(&q.get(0)?.narrow(0, 0, 1)?, &k.narrow(2, 0, 8)?, &k.narrow(2, 0, 8)?, 0.25)?;
/// let diff = (o.get(0)?.narrow(0, 0, 1)? - first)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-5); // the same softmax; on AVX2 a chunk runs blocked, equal to rounding
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<Tensor> {
    attend(q, k, v, scale, false)
}

/// `q [B, T, Hq, D]` over `k` / `v [B, Hkv, Tk, D]`, causal; `one` says the caller is the
/// one-token form, whose zero-row cache gives zeros instead of an error.
fn attend(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, one: bool) -> Result<Tensor> {
    let (b, t, hq, d) = q
        .dims4()
        .map_err(|_| shape_err("q", "[B, T, Hq, D]", q.dims()))?;
    let dims4 = |arg: &'static str, t: &Tensor| -> Result<[usize; 4]> {
        match *t.dims() {
            [b, h, n, w] => Ok([b, h, n, w]),
            _ => Err(Error::Shape {
                arg,
                expected: "[B, Hkv, Tk, D]".into(),
                got: t.dims().to_vec(),
            }),
        }
    };
    let [bk, hkv, tk, dk] = dims4("k", k)?;
    let [bv, hv, tv, dv] = dims4("v", v)?;
    if (bk, dk) != (b, d) {
        return Err(Error::Shape {
            arg: "k",
            expected: format!("[{b}, Hkv, Tk, {d}]"),
            got: k.dims().to_vec(),
        });
    }
    if (bv, hv, tv) != (b, hkv, tk) {
        return Err(Error::Shape {
            arg: "v",
            expected: format!("[{b}, {hkv}, {tk}, Dv]"),
            got: v.dims().to_vec(),
        });
    }
    for (arg, t) in [("q", q), ("k", k), ("v", v)] {
        if !matches!(t.device(), Device::Cpu) {
            return Err(invalid(
                arg,
                "attention over a head-major cache runs on CPU tensors",
            ));
        }
    }
    let op = DecodeOp {
        dims: AttnDims::new(hq, hkv, d, dv)?,
        t,
        tk,
        scale,
        one,
        err: ParkedError::new(),
    };
    let o = q
        .contiguous()?
        .apply_op3_no_bwd(k, v, &op)
        .map_err(|e| op.err.or(e))?;
    Ok(o)
}

struct DecodeOp {
    dims: AttnDims,
    /// New tokens per sequence.
    t: usize,
    tk: usize,
    scale: f32,
    /// `decode_attention`: one token, and no rows is zeros rather than an error.
    one: bool,
    err: ParkedError,
}

/// Runs `$body` with `$k` / `$v` bound to the key and value storages' element slices: f32,
/// f16 or bf16 (a 16-bit cache), the same for both; anything else is [`Error::DType`].
macro_rules! with_kv {
    ($ks:expr, $vs:expr, |$k:ident, $v:ident| $body:expr) => {
        match ($ks, $vs) {
            (CpuStorage::F32($k), CpuStorage::F32($v)) => $body,
            (CpuStorage::F16($k), CpuStorage::F16($v)) => $body,
            (CpuStorage::BF16($k), CpuStorage::BF16($v)) => $body,
            (k @ (CpuStorage::F32(_) | CpuStorage::F16(_) | CpuStorage::BF16(_)), v) => {
                Err(Error::DType {
                    arg: "v",
                    expected: match k.dtype() {
                        candle_core::DType::F32 => "f32, as k",
                        candle_core::DType::F16 => "f16, as k",
                        _ => "bf16, as k",
                    },
                    got: v.dtype(),
                })
            }
            (k, _) => Err(Error::DType {
                arg: "k",
                expected: "f32, f16 or bf16",
                got: k.dtype(),
            }),
        }
    };
}

/// Writes new tokens' keys or values into a head-major cache or page pool in place, each
/// rounded once to the pool's type: `src [T, Hkv, W]` (or `[1, T, Hkv, W]`; f32, token-major,
/// as a projection gives them) goes to row `rows[i]` of every head of `dst [Hkv, R, W]` (or
/// `[1, Hkv, R, W]`; f32, f16 or bf16, contiguous), the layout [`causal_attention`] and
/// [`decode_attention_paged`] read. On the CPU one pass over the new rows
/// (`fp8nsa_cpu::nsa::write_rows`) instead of a transposed, converted copy and a copy per run
/// of rows; elsewhere those Candle copies. A row past `R` is [`Error::Invalid`] and nothing is
/// written.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use fp8nsa_ops::nsa::write_rows;
///
/// let dev = Device::Cpu;
/// let pool = Tensor::zeros((2, 8, 4), DType::F16, &dev)?; // 2 kv heads, 8 rows of 4
/// let k = Tensor::randn(0f32, 1.0, (3, 2, 4), &dev)?; // 3 new tokens
/// write_rows(&pool, &k, &[5, 6, 1])?;
/// // token 2, head 1 is row 1 of head 1, rounded to f16
/// let got = pool.get(1)?.get(1)?.to_dtype(DType::F32)?;
/// let want = k.get(2)?.get(1)?.to_dtype(DType::F16)?.to_dtype(DType::F32)?;
/// assert_eq!(got.to_vec1::<f32>()?, want.to_vec1::<f32>()?);
/// assert!(write_rows(&pool, &k, &[5, 6, 8]).is_err()); // row 8 of 8
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn write_rows(dst: &Tensor, src: &Tensor, rows: &[usize]) -> Result<()> {
    let (h, r, w) = match *dst.dims() {
        [h, r, w] | [1, h, r, w] => (h, r, w),
        _ => {
            return Err(shape_err(
                "dst",
                "[Hkv, R, W] or [1, Hkv, R, W]",
                dst.dims(),
            ))
        }
    };
    let t = match *src.dims() {
        [t, sh, sw] | [1, t, sh, sw] if (t, sh, sw) == (rows.len(), h, w) => t,
        _ => {
            let want = format!(
                "[{}, {h}, {w}] (one row per token, dst's heads and width)",
                rows.len()
            );
            return Err(shape_err("src", want, src.dims()));
        }
    };
    if src.dtype() != DType::F32 {
        return Err(Error::DType {
            arg: "src",
            expected: "f32",
            got: src.dtype(),
        });
    }
    if !matches!(dst.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return Err(Error::DType {
            arg: "dst",
            expected: "f32, f16 or bf16",
            got: dst.dtype(),
        });
    }
    if let Some(&bad) = rows.iter().find(|&&x| x >= r) {
        return Err(invalid("rows", format!("row {bad} of a pool of {r} rows")));
    }
    if t == 0 {
        return Ok(());
    }
    if dst.device().is_cpu() && src.device().is_cpu() {
        let op = WriteRowsOp {
            h,
            w,
            rows,
            err: ParkedError::new(),
        };
        return dst
            .inplace_op2(&src.contiguous()?, &op)
            .map_err(|e| op.err.or(e));
    }
    // [Hkv, T, W] in the pool's type, then one copy per run of consecutive rows
    let pool = dst.reshape((h, r, w))?;
    let st = src
        .reshape((t, h, w))?
        .transpose(0, 1)?
        .to_dtype(dst.dtype())?
        .contiguous()?;
    let mut i = 0;
    while i < t {
        let mut j = i + 1;
        while j < t && rows[j] == rows[j - 1] + 1 {
            j += 1;
        }
        pool.slice_set(&st.narrow(1, i, j - i)?.contiguous()?, 1, rows[i])?;
        i = j;
    }
    Ok(())
}

struct WriteRowsOp<'a> {
    h: usize,
    w: usize,
    rows: &'a [usize],
    err: ParkedError,
}

impl InplaceOp2 for WriteRowsOp<'_> {
    fn name(&self) -> &'static str {
        "fp8nsa-write-rows"
    }

    fn cpu_fwd(
        &self,
        ds: &mut CpuStorage,
        dl: &Layout,
        ss: &CpuStorage,
        sl: &Layout,
    ) -> candle_core::Result<()> {
        self.err.park((|| {
            let src = contiguous("src", f32s("src", ss)?, sl)?;
            // the pool's rows per head: its last two dims
            let stride = dl.dims()[dl.dims().len() - 2] * self.w;
            let (h, w, rows) = (self.h, self.w, self.rows);
            match ds {
                CpuStorage::F32(d) => {
                    let d = contiguous_mut("dst", d, dl)?;
                    fp8nsa_cpu::nsa::write_rows(src, h, w, rows, d, stride)?
                }
                CpuStorage::F16(d) => {
                    let d = contiguous_mut("dst", d, dl)?;
                    fp8nsa_cpu::nsa::write_rows(src, h, w, rows, d, stride)?
                }
                CpuStorage::BF16(d) => {
                    let d = contiguous_mut("dst", d, dl)?;
                    fp8nsa_cpu::nsa::write_rows(src, h, w, rows, d, stride)?
                }
                other => {
                    return Err(Error::DType {
                        arg: "dst",
                        expected: "f32, f16 or bf16",
                        got: other.dtype(),
                    })
                }
            }
            Ok(())
        })())
    }
}

/// The rows of `t`'s batch entries as [`HeadMajor`] views, checked to be dense per row.
fn head_major<'a, T>(
    arg: &'static str,
    data: &'a [T],
    l: &Layout,
    width: usize,
) -> Result<Vec<HeadMajor<'a, T>>> {
    let st = l.stride();
    if st[3] != 1 || (l.dims()[2] > 1 && st[2] != width) {
        return Err(invalid(
            arg,
            "needs dense rows (stride 1 within a row, rows adjacent)",
        ));
    }
    Ok((0..l.dims()[0])
        .map(|bi| HeadMajor {
            data: &data[l.start_offset() + bi * st[0]..],
            head_stride: st[1],
        })
        .collect())
}

impl CustomOp3 for DecodeOp {
    fn name(&self) -> &'static str {
        "fp8nsa-decode-attention"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.err.park((|| {
            let (hq, d, dv) = (self.dims.hq(), self.dims.d(), self.dims.dv());
            let CpuStorage::F32(qd) = qs else {
                return Err(Error::DType {
                    arg: "q",
                    expected: "f32",
                    got: qs.dtype(),
                });
            };
            let q = contiguous("q", qd, ql)?;
            let (b, t) = (ql.dims()[0], self.t);
            let mut o = vec![0f32; b * t * hq * dv];
            with_kv!(ks, vs, |k, v| {
                let (kh, vh) = (head_major("k", k, kl, d)?, head_major("v", v, vl, dv)?);
                for (bi, ob) in o.chunks_exact_mut((t * hq * dv).max(1)).enumerate() {
                    let qb = &q[bi * t * hq * d..(bi + 1) * t * hq * d];
                    if self.one {
                        fp8nsa_cpu::nsa::decode_attention(
                            qb, kh[bi], vh[bi], self.dims, self.tk, self.scale, ob,
                        )?;
                    } else {
                        fp8nsa_cpu::nsa::causal_attention(
                            qb, kh[bi], vh[bi], self.dims, t, self.tk, self.scale, ob,
                        )?;
                    }
                }
                Ok(())
            })?;
            Ok((CpuStorage::F32(o), Shape::from((b, t, hq, dv))))
        })())
    }
}

/// [`decode_attention`] for `B` sequences whose keys and values sit in pages of shared pools,
/// read in place (no gather): `q [B, Hq, D]`; pools `k [Hkv, rows, D]` and `v [Hkv, rows, Dv]`
/// (CPU, contiguous; f32, f16 or bf16 as in [`decode_attention`]), sequence `i`'s row `j` at pool row
/// `pages[i][j / page_size] · page_size + j % page_size`, `lens[i]` rows each. One parallel
/// region for the whole batch.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use fp8nsa_ops::nsa::{decode_attention, decode_attention_paged};
///
/// let dev = Device::Cpu;
/// let pool = Tensor::randn(0f32, 1.0, (2, 8 * 4, 16), &dev)?; // 8 pages of 4 rows, 2 kv heads
/// let q = Tensor::randn(0f32, 1.0, (1, 4, 16), &dev)?;
/// // a sequence on pages 5 then 2, 6 rows
/// let o = decode_attention_paged(&q, &pool, &pool, &[&[5, 2]], &[6], 4, 0.25)?;
/// // the same rows gathered
/// let rows = Tensor::new(&[20u32, 21, 22, 23, 8, 9], &dev)?;
/// let k = pool.index_select(&rows, 1)?.unsqueeze(0)?;
/// let want = decode_attention(&q, &k, &k, 0.25)?;
/// let diff = (o - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-5);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn decode_attention_paged(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pages: &[&[usize]],
    lens: &[usize],
    page_size: usize,
    scale: f32,
) -> Result<Tensor> {
    paged(q, k, v, pages, lens, None, page_size, scale)
}

/// [`causal_attention`] over pages, for a batch of sequences each with its new tokens (a
/// serving step's prefill chunks and decode tokens together): `q [M, Hq, D]` holds sequence
/// `i`'s `news[i]` tokens in turn (`M = Σ news`), the last `news[i]` of its `lens[i]` rows
/// (which the pools already hold, as [`decode_attention_paged`] reads them); each token sees
/// the rows up to its own. `o [M, Hq, Dv]`. [`decode_attention_paged`] is the case of one new
/// token each.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use fp8nsa_ops::nsa::{causal_attention, causal_attention_paged};
///
/// let dev = Device::Cpu;
/// let pool = Tensor::randn(0f32, 1.0, (2, 8 * 4, 16), &dev)?; // 8 pages of 4 rows, 2 kv heads
/// let q = Tensor::randn(0f32, 1.0, (3, 4, 16), &dev)?;
/// // a sequence on pages 5 then 2, 6 rows, the last 3 new
/// let o = causal_attention_paged(&q, &pool, &pool, &[&[5, 2]], &[6], &[3], 4, 0.25)?;
/// // the same rows gathered
/// let rows = Tensor::new(&[20u32, 21, 22, 23, 8, 9], &dev)?;
/// let k = pool.index_select(&rows, 1)?.unsqueeze(0)?;
/// let want = causal_attention(&q.unsqueeze(0)?, &k, &k, 0.25)?.squeeze(0)?;
/// let diff = (o - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-5);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn causal_attention_paged(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pages: &[&[usize]],
    lens: &[usize],
    news: &[usize],
    page_size: usize,
    scale: f32,
) -> Result<Tensor> {
    paged(q, k, v, pages, lens, Some(news), page_size, scale)
}

/// `news` `None`: one new token per sequence (`decode_attention_paged`).
#[allow(clippy::too_many_arguments)]
fn paged(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pages: &[&[usize]],
    lens: &[usize],
    news: Option<&[usize]>,
    page_size: usize,
    scale: f32,
) -> Result<Tensor> {
    let (m, hq, d) = q.dims3().map_err(|_| {
        shape_err(
            "q",
            "[M, Hq, D] (the new tokens of every sequence)",
            q.dims(),
        )
    })?;
    let decode = news.is_none();
    let news = news.map_or_else(|| vec![1; m], <[usize]>::to_vec);
    let b = lens.len();
    let (hkv, rows, dk) = k
        .dims3()
        .map_err(|_| shape_err("k", "[Hkv, rows, D] (a pool)", k.dims()))?;
    let (hv, rv, dv) = v
        .dims3()
        .map_err(|_| shape_err("v", "[Hkv, rows, Dv] (a pool)", v.dims()))?;
    if dk != d {
        return Err(shape_err("k", format!("[Hkv, rows, {d}]"), k.dims()));
    }
    if (hv, rv) != (hkv, rows) {
        return Err(shape_err("v", format!("[{hkv}, {rows}, Dv]"), v.dims()));
    }
    if pages.len() != b || news.len() != b {
        return Err(invalid(
            "pages",
            if decode {
                format!("{} page lists and {m} queries for {b} lengths", pages.len())
            } else {
                format!(
                    "{} page lists and {} counts of new tokens for {b} lengths",
                    pages.len(),
                    news.len()
                )
            },
        ));
    }
    let total = news
        .iter()
        .try_fold(0usize, |a, &n| a.checked_add(n))
        .ok_or_else(|| invalid("news", "the new tokens' count overflows"))?;
    if total != m {
        return Err(shape_err(
            "q",
            format!("[{total}, Hq, D] (the new tokens of every sequence)"),
            q.dims(),
        ));
    }
    for (arg, t) in [("q", q), ("k", k), ("v", v)] {
        if !matches!(t.device(), Device::Cpu) {
            return Err(invalid(arg, "paged attention runs on CPU tensors"));
        }
        if arg != "q" && !t.is_contiguous() {
            return Err(invalid(arg, "the pool must be contiguous"));
        }
    }
    let op = PagedDecodeOp {
        dims: AttnDims::new(hq, hkv, d, dv)?,
        pages: pages.iter().map(|p| p.to_vec()).collect(),
        lens: lens.to_vec(),
        news,
        decode,
        page_size,
        scale,
        err: ParkedError::new(),
    };
    let o = q
        .contiguous()?
        .apply_op3_no_bwd(k, v, &op)
        .map_err(|e| op.err.or(e))?;
    Ok(o)
}

/// A contiguous head-major pool `[Hkv, rows, w]`.
fn pool<'a, T>(arg: &'static str, data: &'a [T], l: &Layout, w: usize) -> Result<HeadMajor<'a, T>> {
    Ok(HeadMajor {
        data: contiguous(arg, data, l)?,
        head_stride: l.dims()[1] * w,
    })
}

struct PagedDecodeOp {
    dims: AttnDims,
    pages: Vec<Vec<usize>>,
    lens: Vec<usize>,
    news: Vec<usize>,
    /// `decode_attention_paged`: one token each, a sequence of no rows giving zeros.
    decode: bool,
    page_size: usize,
    scale: f32,
    err: ParkedError,
}

impl CustomOp3 for PagedDecodeOp {
    fn name(&self) -> &'static str {
        "fp8nsa-decode-attention-paged"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.err.park((|| {
            let (hq, d, dv) = (self.dims.hq(), self.dims.d(), self.dims.dv());
            let q = contiguous("q", f32s("q", qs)?, ql)?;
            let b: usize = self.news.iter().sum();
            let mut o = vec![0f32; b * hq * dv];
            with_kv!(ks, vs, |k, v| self.run(
                q,
                pool("k", k, kl, d)?,
                pool("v", v, vl, dv)?,
                &mut o
            ))?;
            Ok((CpuStorage::F32(o), Shape::from((b, hq, dv))))
        })())
    }
}

impl PagedDecodeOp {
    fn run<T: fp8nsa_cpu::nsa::KeyElem>(
        &self,
        q: &[f32],
        k: HeadMajor<'_, T>,
        v: HeadMajor<'_, T>,
        o: &mut [f32],
    ) -> Result<()> {
        if self.decode {
            // one token each, an empty sequence giving zeros
            let seqs: Vec<fp8nsa_cpu::nsa::PagedSeq<'_>> = self
                .pages
                .iter()
                .zip(&self.lens)
                .map(|(p, &len)| fp8nsa_cpu::nsa::PagedSeq { pages: p, len })
                .collect();
            fp8nsa_cpu::nsa::decode_attention_paged(
                q,
                k,
                v,
                self.dims,
                self.page_size,
                &seqs,
                self.scale,
                o,
            )?;
        } else {
            let seqs: Vec<fp8nsa_cpu::nsa::PagedChunk<'_>> = self
                .pages
                .iter()
                .zip(&self.lens)
                .zip(&self.news)
                .map(|((p, &len), &new)| fp8nsa_cpu::nsa::PagedChunk { pages: p, len, new })
                .collect();
            fp8nsa_cpu::nsa::causal_attention_paged(
                q,
                k,
                v,
                self.dims,
                self.page_size,
                &seqs,
                self.scale,
                o,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// New rows written in place equal Candle's transposed, converted copy of them (f32, f16,
    /// bf16 pools; the `[1, ..]` forms; rows in any order across pages); the rest of the pool
    /// is untouched; bad shapes, types and rows are typed errors that write nothing.
    #[test]
    fn write_rows_equals_candle_copies() {
        let dev = Device::Cpu;
        let (h, r, w, t) = (3usize, 40usize, 16usize, 5usize);
        let rows = [17usize, 3, 4, 39, 0];
        let src = Tensor::randn(0f32, 10.0, (t, h, w), &dev).unwrap();
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let base = Tensor::randn(0f32, 1.0, (h, r, w), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let pool = base.copy().unwrap();
            write_rows(&pool, &src, &rows).unwrap();
            // the same through Candle: each token's [H, 1, W] converted, set at its row
            let want = base.copy().unwrap();
            for (i, &row) in rows.iter().enumerate() {
                let x = src.narrow(0, i, 1).unwrap().transpose(0, 1).unwrap();
                want.slice_set(&x.to_dtype(dtype).unwrap().contiguous().unwrap(), 1, row)
                    .unwrap();
            }
            let flat = |x: &Tensor| {
                x.to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            };
            assert_eq!(flat(&pool), flat(&want), "{dtype:?}");
            // a [1, Hkv, R, W] pool and [1, T, Hkv, W] rows alike
            let pool4 = base.unsqueeze(0).unwrap().copy().unwrap();
            write_rows(&pool4, &src.unsqueeze(0).unwrap(), &rows).unwrap();
            assert_eq!(flat(&pool4), flat(&want), "{dtype:?}, 4-d");
            // errors, and nothing written
            let before = flat(&pool);
            // (the call, the variant and argument its error must name); a strided view of a
            // pool is not written through
            let bad = [
                (
                    write_rows(&pool, &src, &[1, 2, 3, 4, 40]),
                    "Invalid",
                    "rows",
                ),
                (write_rows(&pool, &src, &rows[..4]), "Shape", "src"),
                (
                    write_rows(&pool, &src.narrow(2, 0, 8).unwrap(), &rows),
                    "Shape",
                    "src",
                ),
                (
                    write_rows(&pool.narrow(1, 0, 10).unwrap(), &src, &[1, 2, 3, 4, 5]),
                    "Invalid",
                    "dst",
                ),
                (
                    write_rows(&pool, &src.to_dtype(DType::F16).unwrap(), &rows),
                    "DType",
                    "src",
                ),
                (
                    write_rows(
                        &Tensor::zeros((h, r, w), DType::U32, &dev).unwrap(),
                        &src,
                        &rows,
                    ),
                    "DType",
                    "dst",
                ),
            ];
            for (got, variant, arg) in &bad {
                let named = match got {
                    Err(Error::Invalid { arg, .. }) => ("Invalid", *arg),
                    Err(Error::Shape { arg, .. }) => ("Shape", *arg),
                    Err(Error::DType { arg, .. }) => ("DType", *arg),
                    _ => ("", ""),
                };
                assert_eq!(named, (*variant, *arg), "{dtype:?}: {got:?}");
            }
            assert_eq!(
                flat(&pool),
                before,
                "{dtype:?}: a failed write changed the pool"
            );
        }
    }

    /// f16 and bf16 caches and pools give what f32 ones holding the same values give, bit for
    /// bit; k and v of different types, or an integer cache, are typed errors.
    #[test]
    fn half_caches_are_read_as_their_values() {
        use candle_core::DType;
        let dev = Device::Cpu;
        let q = Tensor::randn(0f32, 1.0, (3, 4, 32), &dev).unwrap();
        let pool = Tensor::randn(0f32, 1.0, (2, 8 * 4, 32), &dev).unwrap();
        let cache = Tensor::randn(0f32, 1.0, (3, 2, 20, 32), &dev).unwrap();
        let same = |a: &Tensor, b: &Tensor| {
            let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
            d.to_scalar::<f32>().unwrap() == 0.0
        };
        for dt in [DType::F16, DType::BF16] {
            let ph = pool.to_dtype(dt).unwrap();
            let pf = ph.to_dtype(DType::F32).unwrap();
            let pages: [&[usize]; 3] = [&[5, 2], &[0], &[7, 1, 3]];
            let (lens, news) = ([6, 1, 9], [1, 1, 1]);
            let a = causal_attention_paged(&q, &ph, &ph, &pages, &lens, &news, 4, 0.2).unwrap();
            let b = causal_attention_paged(&q, &pf, &pf, &pages, &lens, &news, 4, 0.2).unwrap();
            assert!(same(&a, &b), "{dt:?} pool");
            let ch = cache.to_dtype(dt).unwrap();
            let cf = ch.to_dtype(DType::F32).unwrap();
            let qc = q.unsqueeze(1).unwrap();
            let a = causal_attention(
                &qc,
                &ch.narrow(2, 0, 7).unwrap(),
                &ch.narrow(2, 0, 7).unwrap(),
                0.2,
            );
            let b = causal_attention(
                &qc,
                &cf.narrow(2, 0, 7).unwrap(),
                &cf.narrow(2, 0, 7).unwrap(),
                0.2,
            );
            assert!(same(&a.unwrap(), &b.unwrap()), "{dt:?} cache");
            let err = decode_attention(&q, &ch, &cf, 0.2).unwrap_err();
            assert!(matches!(err, Error::DType { arg: "v", .. }), "{err}");
        }
        let ints = cache.to_dtype(DType::U32).unwrap();
        let err = decode_attention(&q, &ints, &ints, 0.2).unwrap_err();
        assert!(matches!(err, Error::DType { arg: "k", .. }), "{err}");
    }
    use candle_core::{DType, D};

    /// Softmax attention per batch entry and query head from Candle ops on contiguous copies.
    fn candle_ref(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Tensor {
        let (b, hq, _) = q.dims3().unwrap();
        let g = hq / k.dims()[1];
        let mut rows = Vec::new();
        for bi in 0..b {
            for h in 0..hq {
                let qh = q.get(bi).unwrap().narrow(0, h, 1).unwrap();
                let kh = k.get(bi).unwrap().get(h / g).unwrap().contiguous().unwrap();
                let vh = v.get(bi).unwrap().get(h / g).unwrap().contiguous().unwrap();
                let s = (qh.matmul(&kh.t().unwrap()).unwrap() * scale).unwrap();
                let p = candle_nn::ops::softmax(&s, D::Minus1).unwrap();
                rows.push(p.matmul(&vh).unwrap());
            }
        }
        Tensor::cat(&rows, 0)
            .unwrap()
            .reshape((b, hq, v.dims()[3]))
            .unwrap()
    }

    #[test]
    fn strided_batches_match_candle_ops_and_bad_inputs_are_typed_errors() {
        let dev = Device::Cpu;
        let (b, hq, hkv, cap, tk, d, dv) = (2, 6, 2, 80, 67, 32, 24);
        let kbuf = Tensor::randn(0f32, 1.0, (b, hkv, cap, d), &dev).unwrap();
        let vbuf = Tensor::randn(0f32, 1.0, (b, hkv, cap, dv), &dev).unwrap();
        let q = (Tensor::randn(0f32, 1.0, (b, hq, d), &dev).unwrap() * 3.0).unwrap();
        let (k, v) = (
            kbuf.narrow(2, 0, tk).unwrap(),
            vbuf.narrow(2, 0, tk).unwrap(),
        );
        let got = decode_attention(&q, &k, &v, 0.2).unwrap();
        let want = candle_ref(&q, &k, &v, 0.2);
        let diff = fp8nsa_test_support::max_abs_diff(&got, &want);
        assert!(diff < 1e-5, "max diff {diff}");

        let r = decode_attention(&q, &k.narrow(3, 0, 16).unwrap(), &v, 0.2);
        assert!(matches!(r, Err(Error::Shape { arg: "k", .. })), "{r:?}");
        let r = decode_attention(&q, &k, &v.narrow(2, 0, 5).unwrap(), 0.2);
        assert!(matches!(r, Err(Error::Shape { arg: "v", .. })), "{r:?}");
        // a bf16 cache is read, but k and v must agree
        let r = decode_attention(&q, &k.to_dtype(DType::BF16).unwrap(), &v, 0.2);
        assert!(matches!(r, Err(Error::DType { arg: "v", .. })), "{r:?}");
        // rows not dense: the keys of a [B, Tk, Hkv, D] layout seen as [B, Hkv, Tk, D]
        let token_major = Tensor::randn(0f32, 1.0, (b, tk, hkv, d), &dev).unwrap();
        let r = decode_attention(&q, &token_major.transpose(1, 2).unwrap(), &v, 0.2);
        assert!(matches!(r, Err(Error::Invalid { arg: "k", .. })), "{r:?}");
        let r = decode_attention(&q.narrow(1, 0, 5).unwrap(), &k, &v, 0.2);
        assert!(matches!(r, Err(Error::Invalid { arg: "hq", .. })), "{r:?}");
        // a 2-D q names q (it was candle's "unexpected rank")
        let r = decode_attention(&q.get(0).unwrap(), &k, &v, 0.2);
        assert!(matches!(r, Err(Error::Shape { arg: "q", .. })), "{r:?}");
    }

    /// A prefill chunk of T tokens per sequence (the blocked kernel on AVX2: dv = 32), on
    /// strided cache views of two sequences,
    /// against Candle's score matrix with the causal mask, softmax and weighted sum.
    #[test]
    fn causal_chunks_match_masked_candle_softmax() {
        let dev = Device::Cpu;
        let (b, hq, hkv, cap, d, dv) = (2, 6, 2, 96, 32, 32);
        for (past, t) in [(0usize, 7usize), (60, 5), (1, 70)] {
            let tk = past + t;
            let kbuf = Tensor::randn(0f32, 1.0, (b, hkv, cap, d), &dev).unwrap();
            let vbuf = Tensor::randn(0f32, 1.0, (b, hkv, cap, dv), &dev).unwrap();
            let q = (Tensor::randn(0f32, 1.0, (b, t, hq, d), &dev).unwrap() * 3.0).unwrap();
            let (k, v) = (
                kbuf.narrow(2, 0, tk).unwrap(),
                vbuf.narrow(2, 0, tk).unwrap(),
            );
            let got = causal_attention(&q, &k, &v, 0.2).unwrap();
            assert_eq!(got.dims(), &[b, t, hq, dv]);
            let g = hq / hkv;
            let mask: Vec<f32> = (0..t)
                .flat_map(|i| {
                    (0..tk).map(move |j| if j > past + i { f32::NEG_INFINITY } else { 0.0 })
                })
                .collect();
            let mask = Tensor::from_vec(mask, (t, tk), &dev).unwrap();
            for bi in 0..b {
                for h in 0..hq {
                    let qh = q
                        .get(bi)
                        .unwrap()
                        .narrow(1, h, 1)
                        .unwrap()
                        .squeeze(1)
                        .unwrap();
                    let kh = k.get(bi).unwrap().get(h / g).unwrap().contiguous().unwrap();
                    let vh = v.get(bi).unwrap().get(h / g).unwrap().contiguous().unwrap();
                    let s = (qh.matmul(&kh.t().unwrap()).unwrap() * 0.2).unwrap();
                    let p = candle_nn::ops::softmax(&(s + &mask).unwrap(), D::Minus1).unwrap();
                    let want = p.matmul(&vh).unwrap();
                    let mine = got
                        .get(bi)
                        .unwrap()
                        .narrow(1, h, 1)
                        .unwrap()
                        .squeeze(1)
                        .unwrap();
                    let diff = fp8nsa_test_support::max_abs_diff(&mine, &want);
                    assert!(diff < 1e-5, "past {past} t {t} seq {bi} head {h}: {diff}");
                }
            }
        }
        // more new tokens than the cache holds: named
        let k = Tensor::zeros((1, 1, 3, 8), DType::F32, &dev).unwrap();
        let q = Tensor::zeros((1, 4, 1, 8), DType::F32, &dev).unwrap();
        let r = causal_attention(&q, &k, &k, 1.0);
        assert!(matches!(r, Err(Error::Invalid { arg: "t", .. })), "{r:?}");
    }
}
