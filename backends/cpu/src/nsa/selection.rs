//! Selection attention: the checked plan (`plan`, `plan_paged`) and its run over the
//! selected spans of contiguous or paged keys.

use super::*;

/// One checked call: valid head dims, sequences that tile the query tokens in order with
/// their keys inside the key total, and the selection's kind. Made once by [`plan`];
/// [`SelectionPlan::run`] executes it without deciding anything again.
///
/// ```
/// use fp8nsa_cpu::nsa::plan;
/// use fp8nsa_types::{AttnDims, Pages, Seq, Spans};
///
/// let dims = AttnDims::new(2, 1, 4, 4)?;
/// let seqs = [Seq { q_start: 0, q_len: 1, k_start: 0, k_len: 3, q_offset: 2 }];
/// let p = plan(dims, &seqs, 3, None)?;
/// let (q, kv) = (vec![1f32; 8], vec![1f32; 12]);
/// let (mut o, mut lse) = (vec![0f32; 8], vec![0f32; 2]);
/// let sel = Spans::Ranges { ranges: &[0, 3][..], per_row: 1 };
/// p.run(&q, &kv, &kv, sel, 0.5, &mut o, &mut lse)?;
/// assert!(o.iter().all(|&x| (x - 1.0).abs() < 1e-6)); // equal scores: the mean of ones
/// assert!((lse[0] - (3f32 * 2f32.exp()).ln()).abs() < 1e-5);
/// let bad = [Seq { k_len: 4, ..seqs[0] }];
/// assert!(plan(dims, &bad, 3, None).is_err()); // keys past the total
/// # Ok::<(), fp8nsa_cpu::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SelectionPlan<'s> {
    dims: AttnDims,
    seqs: &'s [Seq],
    tq: usize,
    /// Tokens `k` and `v` hold: the packed total, or the page pool's.
    tk: usize,
    /// `Some(block_size)` for block ids, `None` for ranges.
    block_size: Option<usize>,
    /// Keys in a page pool rather than packed ([`plan_paged`]).
    pages: Option<Pages<'s>>,
}

/// Checks a call's head dims and token partition: `seqs` tile the query tokens in order and
/// each sequence's keys lie inside `tk` keys; `block_size` (block-id selections) is at least 1.
pub fn plan<'s>(
    dims: AttnDims,
    seqs: &'s [Seq],
    tk: usize,
    block_size: Option<usize>,
) -> Result<SelectionPlan<'s>> {
    if let Some(bs) = block_size {
        check_positive("block_size", bs)?;
    }
    let mut tq = 0usize;
    for (i, s) in seqs.iter().enumerate() {
        let k_end = s.k_start.checked_add(s.k_len);
        if s.q_start != tq || k_end.is_none_or(|e| e > tk) {
            return Err(Error::Invalid {
                arg: "seqs",
                msg: format!(
                    "sequence {i} ({s:?}) does not follow the previous one within {tk} keys"
                ),
            });
        }
        tq = tq.checked_add(s.q_len).ok_or_else(|| Error::Invalid {
            arg: "seqs",
            msg: "query total overflows".into(),
        })?;
    }
    Ok(SelectionPlan {
        dims,
        seqs,
        tq,
        tk,
        block_size,
        pages: None,
    })
}

/// [`plan`] for keys and values in a page pool of `pool_tokens` tokens (`k [pool_tokens, hkv,
/// d]`, `v [pool_tokens, hkv, dv]`): sequence `i` reads its `k_len` keys through row `i` of
/// `pages` (its `k_start` is not used). The table was checked when `pages` was made
/// ([`Pages::new`]); here only that it was made for these sequences and this pool.
///
/// ```
/// use fp8nsa_cpu::nsa::plan_paged;
/// use fp8nsa_types::{AttnDims, Pages, Seq, Spans};
///
/// let dims = AttnDims::new(1, 1, 2, 2)?;
/// let seqs = [Seq { q_start: 0, q_len: 1, k_start: 0, k_len: 3, q_offset: 2 }];
/// // a pool of 3 pages of 2 tokens; the sequence's keys 0, 1 on page 2, key 2 on page 0
/// let pages = Pages::new(&[2, 0], 2, 2, &seqs, 6)?;
/// let p = plan_paged(dims, &seqs, 6, None, pages)?;
/// let kv = [9f32, 9., 9., 9., 0., 0., 0., 0., 1., 1., 1., 1.]; // pages 0, 1, 2
/// let (mut o, mut lse) = ([0f32; 2], [0f32; 1]);
/// let one_key = Spans::Ranges { ranges: &[2, 3][..], per_row: 1 };
/// p.run(&[1f32, 0.], &kv, &kv, one_key, 1.0, &mut o, &mut lse)?;
/// assert_eq!(o, [9.0, 9.0]); // key 2: page 0, token 0
/// assert!(Pages::new(&[2, 3], 2, 2, &seqs, 6).is_err()); // page 3 is past the pool
/// assert!(plan_paged(dims, &seqs, 4, None, pages).is_err()); // not the pool it was checked for
/// let longer = [Seq { k_len: 4, q_offset: 3, ..seqs[0] }];
/// assert!(plan_paged(dims, &longer, 6, None, pages).is_err()); // keys past the checked ones
/// # Ok::<(), fp8nsa_cpu::Error>(())
/// ```
pub fn plan_paged<'s>(
    dims: AttnDims,
    seqs: &'s [Seq],
    pool_tokens: usize,
    block_size: Option<usize>,
    pages: Pages<'s>,
) -> Result<SelectionPlan<'s>> {
    let checked = pages.seqs();
    if checked.len() != seqs.len() || pages.pool_tokens() != pool_tokens {
        return Err(Error::Invalid {
            arg: "pages",
            msg: format!(
                "checked for {} sequences on a pool of {} tokens, used for {} on {pool_tokens}",
                checked.len(),
                pages.pool_tokens(),
                seqs.len()
            ),
        });
    }
    // only the entries of the keys the table was checked for are known to be pages
    if let Some((i, s)) = seqs
        .iter()
        .zip(checked)
        .enumerate()
        .find_map(|(i, (s, c))| (s.k_len > c.k_len).then_some((i, s)))
    {
        return Err(Error::Invalid {
            arg: "seq_lens",
            msg: format!(
                "sequence {i}: {} keys, more than the block table was checked for",
                s.k_len
            ),
        });
    }
    let covered = pages.row_capacity();
    // the same checks as packed keys, each sequence's keys counted from 0 within its row
    let packed: Vec<Seq> = seqs.iter().map(|s| Seq { k_start: 0, ..*s }).collect();
    let tq = plan(dims, &packed, covered, block_size)?.tq;
    Ok(SelectionPlan {
        dims,
        seqs,
        tq,
        tk: pool_tokens,
        block_size,
        pages: Some(pages),
    })
}

impl SelectionPlan<'_> {
    /// Query tokens, the sum of the sequences'.
    pub fn queries(&self) -> usize {
        self.tq
    }

    /// Computes `out [Σtq, hq, dv]` and `lse [Σtq, hq]` (natural log; `-inf` and a zero output
    /// for a query that sees no selected key). `scale` multiplies the scores (usually
    /// `1/sqrt(d)`). Inputs are f32, bf16 or f16; everything is computed in f32. The buffers
    /// and the selection must have the plan's sizes and kind (`Error::Shape` / `Error::Invalid`
    /// naming the argument otherwise).
    #[allow(clippy::too_many_arguments)]
    pub fn run<T>(
        &self,
        q: &[T],
        k: &[T],
        v: &[T],
        spans: Spans<&[i32]>,
        scale: f32,
        out: &mut [f32],
        lse: &mut [f32],
    ) -> Result<()>
    where
        T: KeyElem,
    {
        let (dims, seqs, tq, tk) = (self.dims, self.seqs, self.tq, self.tk);
        check_len("q", q.len(), tq * dims.hq() * dims.d())?;
        check_len("k", k.len(), tk * dims.hkv() * dims.d())?;
        check_len("v", v.len(), tk * dims.hkv() * dims.dv())?;
        check_len("out", out.len(), tq * dims.hq() * dims.dv())?;
        check_len("lse", lse.len(), tq * dims.hq())?;
        let block_size = match spans {
            Spans::Blocks { block_size, .. } => Some(block_size),
            Spans::Ranges { .. } => None,
        };
        if block_size != self.block_size {
            return Err(Error::Invalid {
                arg: "selection",
                msg: format!(
                    "planned for {:?}, got {:?} (block size; None: ranges)",
                    self.block_size, block_size
                ),
            });
        }
        if spans.per_row() > 0 {
            check_len("selection rows", spans.rows(), tq * dims.hkv())?;
        }
        if tq == 0 {
            return Ok(());
        }
        let (hq, dv) = (dims.hq(), dims.dv());
        // Split a token's heads across threads only when there are too few tokens to go around,
        // and then as little as fills every thread evenly: each unit gathers its rows' selected
        // keys again (scattered rows, for a token-level selection mostly cache misses).
        let threads = rayon::current_num_threads();
        let split = if tq >= 2 * threads {
            1
        } else {
            (1..=hq)
                .filter(|s| hq % s == 0)
                .find(|&s| tq * s >= threads && (tq * s) % threads == 0)
                .unwrap_or_else(|| {
                    let mut s = (2 * threads).div_ceil(tq).min(hq);
                    while hq % s != 0 {
                        s -= 1;
                    }
                    s
                })
        };
        let hu = hq / split;
        let mut seq_of = vec![0usize; tq];
        for (si, s) in seqs.iter().enumerate() {
            seq_of[s.q_start..s.q_start + s.q_len].fill(si);
        }
        out.par_chunks_mut(hu * dv)
            .zip(lse.par_chunks_mut(hu))
            .enumerate()
            .for_each_init(Scratch::default, |scratch, (unit, (o, lse))| {
                let token = unit / split;
                let h0 = (unit % split) * hu;
                let s = seqs[seq_of[token]];
                let pos = s.q_offset + (token - s.q_start);
                let limit = s.k_len.min(pos + 1);
                let keys = match self.pages {
                    None => KeyRows::Packed(s.k_start),
                    Some(p) => KeyRows::Paged(p, seq_of[token]),
                };
                let args = RowArgs {
                    q,
                    k,
                    v,
                    dims,
                    token,
                    keys,
                    limit,
                    scale,
                };
                attend_heads(&args, &spans, h0..h0 + hu, o, lse, scratch);
            });
        Ok(())
    }
}

/// [`plan`] then [`SelectionPlan::run`], the key total taken from `k`: selection attention
/// over token-packed `q [Σtq, hq, d]`, `k [Σtk, hkv, d]`, `v [Σtk, hkv, dv]`.
#[allow(clippy::too_many_arguments)]
pub fn selection_attention<T>(
    q: &[T],
    k: &[T],
    v: &[T],
    dims: AttnDims,
    seqs: &[Seq],
    spans: Spans<&[i32]>,
    scale: f32,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()>
where
    T: KeyElem,
{
    let tk = k.len() / (dims.hkv() * dims.d());
    let block_size = match spans {
        Spans::Blocks { block_size, .. } => Some(block_size),
        Spans::Ranges { .. } => None,
    };
    plan(dims, seqs, tk, block_size)?.run(q, k, v, spans, scale, out, lse)
}

#[derive(Default)]
pub(super) struct Scratch {
    spans: Vec<(usize, usize)>,
    q: Vec<f32>,
    kc: Vec<f32>,
    vc: Vec<f32>,
    scores: Vec<f32>,
}

/// Where a sequence's logical key `j` sits in `k` / `v`.
#[derive(Clone, Copy)]
pub(super) enum KeyRows<'a> {
    /// Packed: token `k_start + j`.
    Packed(usize),
    /// In a page pool, through this sequence's row of the block table.
    Paged(Pages<'a>, usize),
}

impl KeyRows<'_> {
    #[inline]
    fn row(self, j: usize) -> usize {
        match self {
            KeyRows::Packed(start) => start + j,
            KeyRows::Paged(p, seq) => p.row(seq, j),
        }
    }
}

pub(super) struct RowArgs<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    dims: AttnDims,
    token: usize,
    keys: KeyRows<'a>,
    limit: usize,
    scale: f32,
}

/// Query heads `heads` of one token; `o [heads, dv]`, `lse [heads]`.
pub(super) fn attend_heads<T: KeyElem>(
    a: &RowArgs<'_, T>,
    spans: &Spans<&[i32]>,
    heads: std::ops::Range<usize>,
    o: &mut [f32],
    lse: &mut [f32],
    sc: &mut Scratch,
) {
    let (hq, hkv, d, dv) = (a.dims.hq(), a.dims.hkv(), a.dims.d(), a.dims.dv());
    let g = hq / hkv;
    let mut h = heads.start;
    while h < heads.end {
        let kvh = h / g;
        let h1 = heads.end.min((kvh + 1) * g);
        let gn = h1 - h;
        spans.row_spans(a.token * hkv + kvh, a.limit, &mut sc.spans);
        sc.q.clear();
        for qh in h..h1 {
            let row = &a.q[(a.token * hq + qh) * d..(a.token * hq + qh + 1) * d];
            sc.q.extend(row.iter().map(|&x| x.into() * a.scale));
        }
        let mut st = Softmax {
            m: vec![f32::NEG_INFINITY; gn],
            l: vec![0.0; gn],
            acc: vec![0.0; gn * dv],
        };
        sc.scores.resize(gn * CHUNK, 0.0);
        // chunks fill across span boundaries: many short spans (token-level selections, small
        // blocks) fold CHUNK keys at a time like one long span, instead of one softmax
        // rescale per span
        let kernel = fold_kernel(d, dv);
        if kernel != FoldKernel::Portable || T::as_f32(a.k).is_some() {
            // the chunk is a list of rows read in place (a token-level selection would
            // otherwise copy every selected key and value row before folding it); the x86
            // folds convert 16-bit rows in its loads
            let (k, v) = (a.k, a.v);
            let mut rows = [0u32; CHUNK];
            let mut n = 0;
            for j in sc.spans.iter().flat_map(|&(s0, s1)| s0..s1) {
                rows[n] = (a.keys.row(j) * hkv + kvh) as u32;
                n += 1;
                if n == CHUNK {
                    fold_rows(
                        kernel,
                        &sc.q,
                        k,
                        v,
                        &rows,
                        d,
                        dv,
                        &mut st,
                        &mut sc.scores,
                        &[],
                    );
                    n = 0;
                }
            }
            if n > 0 {
                fold_rows(
                    kernel,
                    &sc.q,
                    k,
                    v,
                    &rows[..n],
                    d,
                    dv,
                    &mut st,
                    &mut sc.scores,
                    &[],
                );
            }
        } else {
            // the portable fold on 16-bit rows: converted a chunk at a time
            sc.kc.clear();
            sc.vc.clear();
            for j in sc.spans.iter().flat_map(|&(s0, s1)| s0..s1) {
                let key = a.keys.row(j) * hkv + kvh;
                T::extend_f32(&mut sc.kc, &a.k[key * d..(key + 1) * d]);
                T::extend_f32(&mut sc.vc, &a.v[key * dv..(key + 1) * dv]);
                if sc.kc.len() == CHUNK * d {
                    fold_chunk(&sc.q, &sc.kc, &sc.vc, d, dv, &mut st, &mut sc.scores);
                    sc.kc.clear();
                    sc.vc.clear();
                }
            }
            if !sc.kc.is_empty() {
                fold_chunk(&sc.q, &sc.kc, &sc.vc, d, dv, &mut st, &mut sc.scores);
            }
        }
        let base = h - heads.start;
        for gi in 0..gn {
            let out = &mut o[(base + gi) * dv..(base + gi + 1) * dv];
            // l is 0 only when the row saw no key; a NaN l (a NaN query, or a NaN / Inf in a
            // key it attends) must come out as NaN, not as "saw nothing"
            if st.l[gi] != 0.0 {
                let inv = 1.0 / st.l[gi];
                for (x, &y) in out.iter_mut().zip(&st.acc[gi * dv..(gi + 1) * dv]) {
                    *x = y * inv;
                }
                lse[base + gi] = st.m[gi] + st.l[gi].ln();
            } else {
                out.fill(0.0);
                lse[base + gi] = f32::NEG_INFINITY;
            }
        }
        h = h1;
    }
}
