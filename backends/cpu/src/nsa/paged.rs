//! Dense attention over a paged pool read in place: decode steps and chunks of many
//! sequences, each reading its own pages (`decode_attention_paged`,
//! `causal_attention_paged`).

use super::*;

/// One sequence of [`decode_attention_paged`]: its pages in order and how many rows they hold.
#[derive(Clone, Copy, Debug)]
pub struct PagedSeq<'a> {
    pub pages: &'a [usize],
    pub len: usize,
}

/// [`decode_attention`] for a batch of sequences, one new token each, whose keys and values
/// sit in pages of a shared pool read in place: the pool is head-major (`k.data` holds head
/// `h`'s rows at `h · head_stride`, row `r` of the pool at `r · d` within it), and row `j` of
/// sequence `s` is pool row `pages[j / page_size] · page_size + j % page_size`. `q` is
/// `[B, hq, d]`, `out` `[B, hq, dv]`; one task per sequence and kv head. Pages past a
/// head's rows, or too few pages for a length, are [`Error::Invalid`].
///
/// ```
/// use fp8nsa_cpu::nsa::{decode_attention_paged, HeadMajor, PagedSeq};
/// use fp8nsa_types::AttnDims;
///
/// let dims = AttnDims::new(1, 1, 1, 1)?;
/// // a pool of 3 pages of 2 rows; the sequence holds pages 2 then 0, 3 rows
/// let k = [0f32, 0.0, 9.0, 9.0, 0.0, 0.0];
/// let v = [5f32, 0.0, 9.0, 9.0, 1.0, 3.0];
/// let pool = |data| HeadMajor { data, head_stride: 6 };
/// let mut out = [0f32; 1];
/// let seq = PagedSeq { pages: &[2, 0], len: 3 };
/// decode_attention_paged(&[1.0], pool(&k), pool(&v), dims, 2, &[seq], 1.0, &mut out)?;
/// assert!((out[0] - 3.0).abs() < 1e-6); // equal scores over rows 4, 5 and 0: mean of 1, 3, 5
/// # Ok::<(), fp8nsa_cpu::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn decode_attention_paged<T: KeyElem>(
    q: &[f32],
    k: HeadMajor<'_, T>,
    v: HeadMajor<'_, T>,
    dims: AttnDims,
    page_size: usize,
    seqs: &[PagedSeq<'_>],
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    attention_paged(q, k, v, dims, page_size, seqs, scale, out, true)
}

/// A sequence of a paged attention call, seen as a [`PagedChunk`] (a decode step's
/// [`PagedSeq`] has one new token), so that the decode entry point passes its sequences
/// through as they are.
pub(super) trait AsChunk: Sync {
    fn chunk(&self) -> PagedChunk<'_>;
}

impl AsChunk for PagedSeq<'_> {
    fn chunk(&self) -> PagedChunk<'_> {
        PagedChunk {
            pages: self.pages,
            len: self.len,
            new: 1,
        }
    }
}

impl AsChunk for PagedChunk<'_> {
    fn chunk(&self) -> PagedChunk<'_> {
        *self
    }
}

/// One sequence of [`causal_attention_paged`]: its pages in order, how many rows they hold
/// (`len`, its new tokens' rows included) and how many of those are new (`new`, the last ones).
#[derive(Clone, Copy, Debug)]
pub struct PagedChunk<'a> {
    pub pages: &'a [usize],
    pub len: usize,
    pub new: usize,
}

/// [`causal_attention`] for a batch of sequences in pages of a shared pool, read in place (the
/// pool as [`decode_attention_paged`] reads it): sequence `s` brings `new` query tokens, at
/// positions `len - new .. len`, each seeing the rows up to its own. `q` is `[Σ new, hq, d]`
/// (the sequences' tokens in turn), `out` `[Σ new, hq, dv]`. A serving step's prefill chunks
/// and decode tokens in one parallel region; [`decode_attention_paged`] is the case of one new
/// token each. A sequence with `new = 0` contributes no rows; `new > len` is
/// [`Error::Invalid`].
///
/// ```
/// use fp8nsa_cpu::nsa::{causal_attention, causal_attention_paged, HeadMajor, PagedChunk};
/// use fp8nsa_types::AttnDims;
///
/// let dims = AttnDims::new(1, 1, 1, 1)?;
/// // a pool of 3 pages of 2 rows; the sequence holds pages 2 then 0: rows 4, 5, 0
/// let k = [0f32, 0.0, 9.0, 9.0, 0.0, 0.0];
/// let v = [5f32, 0.0, 9.0, 9.0, 1.0, 3.0];
/// let pool = |data| HeadMajor { data, head_stride: 6 };
/// let seq = PagedChunk { pages: &[2, 0], len: 3, new: 2 };
/// let mut out = [0f32; 2];
/// causal_attention_paged(&[1.0, 1.0], pool(&k), pool(&v), dims, 2, &[seq], 1.0, &mut out)?;
/// assert!((out[0] - 2.0).abs() < 1e-6); // equal scores over rows 4 and 5: mean of 1 and 3
/// assert!((out[1] - 3.0).abs() < 1e-6); // and row 0: mean of 1, 3 and 5
/// # Ok::<(), fp8nsa_cpu::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn causal_attention_paged<T: KeyElem>(
    q: &[f32],
    k: HeadMajor<'_, T>,
    v: HeadMajor<'_, T>,
    dims: AttnDims,
    page_size: usize,
    seqs: &[PagedChunk<'_>],
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    attention_paged(q, k, v, dims, page_size, seqs, scale, out, false)
}

/// The pool rows of a sequence's rows `lo..hi` (`lo <= hi`, within its pages), page by page:
/// `(first pool row, rows)`.
pub(super) fn page_runs(
    pages: &[usize],
    page_size: usize,
    lo: usize,
    hi: usize,
) -> impl Iterator<Item = (usize, usize)> + '_ {
    let first = lo / page_size;
    let end = if hi > lo {
        hi.div_ceil(page_size)
    } else {
        first
    };
    pages[first..end].iter().enumerate().map(move |(i, &page)| {
        let pi = first + i;
        let (a, b) = (lo.max(pi * page_size), hi.min((pi + 1) * page_size));
        (page * page_size + a - pi * page_size, b - a)
    })
}

/// [`causal_attention_paged`]; `decode` ([`decode_attention_paged`]: one token each) also
/// takes sequences of no rows, which give zeros.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_paged<T: KeyElem, S: AsChunk>(
    q: &[f32],
    k: HeadMajor<'_, T>,
    v: HeadMajor<'_, T>,
    dims: AttnDims,
    page_size: usize,
    seqs: &[S],
    scale: f32,
    out: &mut [f32],
    decode: bool,
) -> Result<()> {
    // `AttnDims` guarantees hq a multiple of hkv
    let (hq, hkv, d, dv) = (dims.hq(), dims.hkv(), dims.d(), dims.dv());
    check_positive("page_size", page_size)?;
    // a decode step may have an empty cache (zeros); a chunk's rows must be among its rows
    if let Some((i, s)) = seqs
        .iter()
        .map(S::chunk)
        .enumerate()
        .find(|(_, s)| s.new > s.len && !decode)
    {
        return Err(Error::Invalid {
            arg: "seqs",
            msg: format!("sequence {i}: {} new rows of {}", s.new, s.len),
        });
    }
    let total = seqs
        .iter()
        .map(S::chunk)
        .try_fold(0usize, |a, s| a.checked_add(s.new))
        .ok_or_else(|| Error::Invalid {
            arg: "seqs",
            msg: "the new tokens' count overflows".into(),
        })?;
    check_len("q", q.len(), product("q", &[total, hq, d])?)?;
    check_len("out", out.len(), product("out", &[total, hq, dv])?)?;
    for (arg, kv, w) in [("k", k, d), ("v", v, dv)] {
        let rows = kv.head_stride / w;
        if kv.data.len() < (hkv - 1) * kv.head_stride + rows * w {
            return Err(Error::Invalid {
                arg,
                msg: format!(
                    "{hkv} heads {} apart need more than the {} values given",
                    kv.head_stride,
                    kv.data.len()
                ),
            });
        }
        for (i, s) in seqs.iter().map(S::chunk).enumerate() {
            if s.pages
                .len()
                .checked_mul(page_size)
                .is_none_or(|r| r < s.len)
            {
                return Err(Error::Invalid {
                    arg: "seqs",
                    msg: format!(
                        "sequence {i}: {} pages cannot hold {} rows",
                        s.pages.len(),
                        s.len
                    ),
                });
            }
            let used = &s.pages[..s.len.div_ceil(page_size)];
            if let Some(&p) = used.iter().find(|&&p| {
                p.checked_add(1)
                    .and_then(|e| e.checked_mul(page_size))
                    .is_none_or(|e| e > rows)
            }) {
                return Err(Error::Invalid {
                    arg,
                    msg: format!("sequence {i}: page {p} is past the pool's {rows} rows"),
                });
            }
        }
    }
    let g = hq / hkv;
    if decode || seqs.iter().all(|s| s.chunk().new == 1) {
        // one token each: one unit per sequence and kv head, its G query heads together (as
        // `decode_attention`, split between threads alike), written in place
        attend_units(
            seqs.len() * hkv,
            |i| HeadRows {
                q: &q[i * g * d..(i + 1) * g * d],
                k: k.head(i % hkv),
                v: v.head(i % hkv),
                d,
                dv,
            },
            |i| seqs[i / hkv].chunk().len,
            |i, lo, hi| page_runs(seqs[i / hkv].chunk().pages, page_size, lo, hi),
            scale,
            out,
        );
        return Ok(());
    }
    // tasks of a few tokens of one sequence and one kv head: blocked where it runs, else the
    // fold token by token; each returns its rows, moved into `out` after
    let blocked = blocked_fast(g, dv);
    let bt = if blocked { block_tokens(g) } else { 1 };
    let mut tasks = Vec::new(); // (sequence, its first query row in q, i0, i1, kv head)
    let mut r0 = 0;
    for (si, s) in seqs.iter().map(S::chunk).enumerate() {
        for i0 in (0..s.new).step_by(bt) {
            for h in 0..hkv {
                tasks.push((si, r0, i0, (i0 + bt).min(s.new), h));
            }
        }
        r0 += s.new;
    }
    let outs: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(si, r0, i0, i1, h)| {
            let s = seqs[si].chunk();
            let lim0 = s.len - s.new + 1;
            let qs = &q[r0 * hq * d..];
            let mut o = vec![0f32; (i1 - i0) * g * dv];
            #[cfg(target_arch = "x86_64")]
            if blocked && i1 - i0 > 1 {
                let (rows, lim) = block_rows(qs, (i0, i1), lim0, (h, g, hq, d), scale);
                let row = |j: usize| s.pages[j / page_size] * page_size + j % page_size;
                // SAFETY: `blocked_fast` held: the AVX2 tier, only detected with AVX2, FMA and
                // F16C.
                unsafe { attend_blocked(&rows, &lim, k.head(h), v.head(h), row, d, dv, &mut o) };
                return o;
            }
            for (i, oi) in (i0..i1).zip(o.chunks_exact_mut(g * dv)) {
                let head = HeadRows {
                    q: &qs[(i * hq + h * g) * d..(i * hq + (h + 1) * g) * d],
                    k: k.head(h),
                    v: v.head(h),
                    d,
                    dv,
                };
                head.attend(page_runs(s.pages, page_size, 0, lim0 + i), scale, oi);
            }
            o
        })
        .collect();
    for (&(_, r0, i0, _, h), o) in tasks.iter().zip(&outs) {
        scatter_rows(o, i0, (h, g, hq, dv), &mut out[r0 * hq * dv..]);
    }
    Ok(())
}
