//! Selection attention over a paged KV cache (issue 19, items 1 and 2): a batch of sequences
//! of different lengths, their keys scattered over a shuffled page pool, against the same
//! sequences called one by one on contiguous keys. Bit for bit on the CPU kernel and on the
//! dense fallback, for page sizes 1, 16, 64 and 24 (which does not divide the 32-key blocks),
//! blocks, ranges and tokens, decode (Tq = 1) and speculative decode (Tq = 3). And the full
//! NSA layer with its decode state on server-owned pages (item 3): the same outputs as the
//! layer's own `NsaCache`, step for step, through forks (prefix sharing, copy on write) and
//! rollbacks, with every page back in the pool at the end; an exhausted pool is an error that
//! leaves the state as it was.

use candle_core::{DType, Device, Tensor};
use fp8nsa::nsa::{
    BlockSelection, NsaPath, PagedKv, Selection, SelectionAttention, SelectionRanges,
    TokenSelection,
};
use fp8nsa::Error;
use fp8nsa_test_support::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;

const HQ: usize = 8;
const HKV: usize = 2;
const D: usize = 32;

/// Sequences' contiguous keys and values `[1, L, Hkv, D]`, and the same in a page pool.
struct Batch {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    k_pages: Tensor,
    v_pages: Tensor,
    table: Tensor,
    lens: Vec<usize>,
}

fn batch(rng: &mut StdRng, lens: &[usize], page_size: usize, dtype: DType) -> Batch {
    let need: Vec<usize> = lens.iter().map(|l| l.div_ceil(page_size)).collect();
    let max_pages = need.iter().copied().max().unwrap() + 1; // a spare entry past each row's end
    let total: usize = need.iter().sum::<usize>() + 3; // pages nobody uses
    let mut ids: Vec<usize> = (0..total).collect();
    ids.shuffle(rng);
    let row = page_size * HKV * D;
    let mut pool_k = gaussian(rng, total * row);
    let mut pool_v = gaussian(rng, total * row);
    let (mut k, mut v, mut table) = (vec![], vec![], vec![]);
    let mut next = 0;
    for &l in lens {
        let pages = &ids[next..next + l.div_ceil(page_size)];
        next += pages.len();
        let (kv, vv) = (gaussian(rng, l * HKV * D), gaussian(rng, l * HKV * D));
        for j in 0..l {
            let at = (pages[j / page_size] * page_size + j % page_size) * HKV * D;
            pool_k[at..at + HKV * D].copy_from_slice(&kv[j * HKV * D..][..HKV * D]);
            pool_v[at..at + HKV * D].copy_from_slice(&vv[j * HKV * D..][..HKV * D]);
        }
        let t = |x: Vec<f32>| tensor(x, &[1, l, HKV, D]).to_dtype(dtype).unwrap();
        k.push(t(kv));
        v.push(t(vv));
        let mut r: Vec<i32> = pages.iter().map(|&p| p as i32).collect();
        r.resize(max_pages, -1);
        table.extend(r);
    }
    let pool = |x: Vec<f32>| {
        tensor(x, &[total, page_size, HKV, D])
            .to_dtype(dtype)
            .unwrap()
    };
    Batch {
        k,
        v,
        k_pages: pool(pool_k),
        v_pages: pool(pool_v),
        table: Tensor::from_vec(table, (lens.len(), max_pages), &Device::Cpu).unwrap(),
        lens: lens.to_vec(),
    }
}

/// One selection row per (sequence, query, kv head), as the three kinds.
fn selections(rng: &mut StdRng, lens: &[usize], tq: usize) -> [Vec<Vec<i32>>; 3] {
    let (mut blocks, mut ranges, mut tokens) = (vec![], vec![], vec![]);
    for &l in lens {
        for _ in 0..tq * HKV {
            let nb = l.div_ceil(32) as i32;
            let mut b: Vec<i32> = (0..nb).collect();
            b.shuffle(rng);
            b.truncate(3);
            b.resize(3, -1);
            blocks.push(b);
            let head = (l as i32).min(5);
            let a = rng.random_range(head..=l as i32);
            let e = rng.random_range(a..=l as i32);
            ranges.push(vec![a, e, 0, head, 0, 0]);
            let mut t: Vec<i32> = (0..l as i32).collect();
            t.shuffle(rng);
            t.truncate(40);
            t.resize(40, -1);
            tokens.push(t);
        }
    }
    [blocks, ranges, tokens]
}

/// One of the three selection kinds, owned.
enum Owned {
    Blocks(BlockSelection),
    Ranges(SelectionRanges),
    Tokens(TokenSelection),
}

impl Owned {
    fn new(kind: usize, rows: &[Vec<i32>], b: usize, tq: usize) -> Self {
        let n = rows[0].len();
        let t = |dims: &[usize]| Tensor::from_vec(rows.concat(), dims, &Device::Cpu).unwrap();
        match kind {
            0 => Owned::Blocks(BlockSelection::new(t(&[b, tq, HKV, n]), 32).unwrap()),
            1 => Owned::Ranges(SelectionRanges::new(t(&[b, tq, HKV, n / 2, 2])).unwrap()),
            _ => Owned::Tokens(TokenSelection::new(t(&[b, tq, HKV, n])).unwrap()),
        }
    }

    fn sel(&self) -> Selection<'_> {
        match self {
            Owned::Blocks(s) => s.into(),
            Owned::Ranges(s) => s.into(),
            Owned::Tokens(s) => s.into(),
        }
    }
}

#[test]
fn paged_batches_equal_each_sequence_on_contiguous_keys() {
    let mut rng = rng("paged");
    let lens = [200, 33, 3, 97, 64, 150];
    for (page_size, tq, dtype) in [
        (16, 1, DType::F32),
        (1, 1, DType::BF16),
        (64, 3, DType::F32),
        (24, 3, DType::F16),
    ] {
        let bt = batch(&mut rng, &lens, page_size, dtype);
        let kv = PagedKv {
            k_pages: &bt.k_pages,
            v_pages: &bt.v_pages,
            block_table: &bt.table,
            seq_lens: &bt.lens,
        };
        let b = lens.len();
        let q = tensor(gaussian(&mut rng, b * tq * HQ * D), &[b, tq, HQ, D])
            .to_dtype(dtype)
            .unwrap();
        let sels = selections(&mut rng, &lens, tq);
        for (kind, rows) in sels.iter().enumerate() {
            let owned = Owned::new(kind, rows, b, tq);
            let sel = owned.sel();
            for (min_len, want_path) in [
                (0, NsaPath::CpuKernel),
                (
                    usize::MAX,
                    NsaPath::Sdpa(fp8nsa::nsa::SdpaReason::BelowMinLen {
                        tk: 200,
                        min_len: usize::MAX,
                    }),
                ),
            ] {
                let attn = SelectionAttention::new().min_len(min_len).with_lse(true);
                let (o, lse, path) = attn.forward_paged_with_path(&q, &kv, sel).unwrap();
                assert_eq!(path, want_path);
                let what =
                    format!("page {page_size} tq {tq} {dtype:?} kind {kind} min_len {min_len}");
                for (i, &l) in lens.iter().enumerate() {
                    let rows_i = &rows[i * tq * HKV..(i + 1) * tq * HKV];
                    let owned_i = Owned::new(kind, rows_i, 1, tq);
                    let sel_i = owned_i.sel();
                    let qi = q.narrow(0, i, 1).unwrap();
                    let one = SelectionAttention::new()
                        .min_len(min_len)
                        .with_lse(true)
                        .q_offset(l - tq);
                    let (want, want_lse) = one.forward(&qi, &bt.k[i], &bt.v[i], sel_i).unwrap();
                    let got = o.narrow(0, i, 1).unwrap();
                    let f = |t: &Tensor| {
                        t.to_dtype(DType::F32)
                            .unwrap()
                            .flatten_all()
                            .unwrap()
                            .to_vec1::<f32>()
                            .unwrap()
                    };
                    assert_eq!(f(&got), f(&want), "{what}: sequence {i} o");
                    let gl = lse.as_ref().unwrap().narrow(0, i, 1).unwrap();
                    assert_eq!(
                        f(&gl),
                        f(want_lse.as_ref().unwrap()),
                        "{what}: sequence {i} lse"
                    );
                }
            }
        }
    }
}

#[test]
fn bad_tables_and_lengths_are_errors_naming_the_sequence() {
    let mut rng = rng("paged_errors");
    let lens = [40, 70];
    let bt = batch(&mut rng, &lens, 16, DType::F32);
    let q = tensor(gaussian(&mut rng, 2 * HQ * D), &[2, 1, HQ, D]);
    let sel = TokenSelection::new(
        Tensor::from_vec([0i32, 5, 39, -1].repeat(4), (2, 1, HKV, 4), &Device::Cpu).unwrap(),
    )
    .unwrap();
    let attn = SelectionAttention::new().min_len(0);
    let run = |table: &Tensor, seq_lens: &[usize]| {
        let kv = PagedKv {
            k_pages: &bt.k_pages,
            v_pages: &bt.v_pages,
            block_table: table,
            seq_lens,
        };
        attn.forward_paged(&q, &kv, &sel).map(|_| ()).unwrap_err()
    };
    let rows: Vec<Vec<i32>> = bt.table.to_vec2().unwrap();
    let num_pages = bt.k_pages.dims()[0] as i32;
    let with = |s: usize, e: usize, p: i32| {
        let mut r = rows.clone();
        r[s][e] = p;
        Tensor::new(r, &Device::Cpu).unwrap()
    };
    // a page id past the pool, and -1, in entries sequence 1 uses
    for p in [num_pages, -1] {
        let e = run(&with(1, 4, p), &lens);
        assert!(
            matches!(&e, Error::Invalid { arg: "block_table", msg } if msg.contains("sequence 1, entry 4")),
            "{e}"
        );
    }
    // an unused entry may hold anything
    run_ok(&attn, &q, &bt, &with(0, 3, 12345), &lens, &sel);
    // seq_len past what the row covers (6 entries of 16)
    let e = run(&bt.table, &[40, 97]);
    assert!(
        matches!(&e, Error::Invalid { arg: "seq_lens", msg } if msg.contains("sequence 1")),
        "{e}"
    );
    // a table of the wrong shape / dtype, seq_lens of the wrong length
    let e = run(&bt.table.narrow(0, 0, 1).unwrap(), &lens);
    assert!(
        matches!(
            &e,
            Error::Shape {
                arg: "block_table",
                ..
            }
        ),
        "{e}"
    );
    let e = run(&bt.table.to_dtype(DType::I64).unwrap(), &lens);
    assert!(
        matches!(
            &e,
            Error::DType {
                arg: "block_table",
                ..
            }
        ),
        "{e}"
    );
    let e = run(&bt.table, &[40]);
    assert!(
        matches!(
            &e,
            Error::Invalid {
                arg: "seq_lens",
                ..
            }
        ),
        "{e}"
    );
    // a selection past seq_len (token 39 of a sequence of 30)
    let e = run(&bt.table, &[30, 70]);
    assert!(matches!(&e, Error::Selection { batch: 0, .. }), "{e}");
}

fn run_ok(
    attn: &SelectionAttention,
    q: &Tensor,
    bt: &Batch,
    table: &Tensor,
    lens: &[usize],
    sel: &TokenSelection,
) {
    let kv = PagedKv {
        k_pages: &bt.k_pages,
        v_pages: &bt.v_pages,
        block_table: table,
        seq_lens: lens,
    };
    attn.forward_paged(q, &kv, sel).unwrap();
}

mod layer_on_pages {
    use super::*;
    use fp8nsa::nsa::{
        Compressor, Gates, NativeSparseAttention, NsaCache, NsaConfig, NsaDims, NsaPages, NsaPool,
        NsaSeqState, PagePool, SharedAllocator,
    };

    /// The layer's heads in these tests.
    fn dims() -> NsaDims {
        NsaDims::new(4, 2, 32, 32).unwrap()
    }

    fn layer() -> NativeSparseAttention {
        let cfg = NsaConfig {
            compress_block: 16,
            compress_stride: 8,
            select_block: 32,
            num_selected: 4,
            num_initial: 1,
            num_local: 2,
            window: 48,
            ..NsaConfig::default()
        };
        NativeSparseAttention::new(
            cfg,
            dims(),
            Compressor::MeanPool,
            Gates::Fixed([0.5, 0.3, 0.2]),
        )
        .unwrap()
    }

    /// A sequence's tokens: gate input, q, k, v `[1, T, ..]`.
    struct Tokens {
        x: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
    }

    fn tokens(rng: &mut StdRng, t: usize) -> Tokens {
        let mk = |rng: &mut StdRng, h: usize| tensor(gaussian(rng, t * h * D), &[1, t, h, D]);
        Tokens {
            x: Tensor::zeros((1, t, 4), DType::F32, &Device::Cpu).unwrap(),
            q: mk(rng, dims().hq()),
            k: mk(rng, dims().hkv()),
            v: mk(rng, dims().hkv()),
        }
    }

    fn flat(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// Feeds `tok[from..to]` in chunks of `chunk` tokens to both the paged state and the cache,
    /// asserting equal outputs at every step.
    #[allow(clippy::too_many_arguments)]
    fn feed(
        nsa: &NativeSparseAttention,
        tok: &Tokens,
        (from, to, chunk): (usize, usize, usize),
        pages: &NsaPages,
        state: &mut NsaSeqState,
        cache: &mut NsaCache,
        what: &str,
    ) {
        let mut pos = from;
        while pos < to {
            let n = chunk.min(to - pos);
            let c = |t: &Tensor| t.narrow(1, pos, n).unwrap();
            let got = nsa
                .forward_step_paged(&c(&tok.x), &c(&tok.q), &c(&tok.k), &c(&tok.v), pages, state)
                .unwrap();
            let want = nsa
                .forward_step(&c(&tok.x), &c(&tok.q), &c(&tok.k), &c(&tok.v), cache)
                .unwrap();
            assert_eq!(flat(&got), flat(&want), "{what}: tokens {pos}..{}", pos + n);
            assert_eq!(
                (state.len(), state.compressed_len()),
                (cache.len(), cache.compressed_len())
            );
            pos += n;
        }
    }

    #[test]
    fn the_layer_on_server_pages_equals_its_cache() {
        let mut rng = rng("nsa_layer_pages");
        let nsa = layer();
        let t = 200;
        let tok = tokens(&mut rng, t);
        // 50 does not divide the 32-key selection blocks
        for page in [1, 16, 50] {
            let raw = t.div_ceil(page) + 2;
            let cmp = nsa.config().compressed_len(t).div_ceil(page) + 2;
            let pages = NsaPages::new(dims(), page, raw, cmp, DType::F32, &Device::Cpu).unwrap();
            let alloc = SharedAllocator::new(PagePool::new(raw, cmp).unwrap());
            let mut state = NsaSeqState::new(&alloc);
            let mut cache = NsaCache::new();
            let what = format!("page {page}");
            // a 37-token prefill chunk, single steps, then speculative chunks of 5
            feed(
                &nsa,
                &tok,
                (0, 37, 37),
                &pages,
                &mut state,
                &mut cache,
                &what,
            );
            feed(
                &nsa,
                &tok,
                (37, 120, 1),
                &pages,
                &mut state,
                &mut cache,
                &what,
            );
            feed(
                &nsa,
                &tok,
                (120, t, 5),
                &pages,
                &mut state,
                &mut cache,
                &what,
            );
            assert_eq!(state.pages(NsaPool::Raw).len(), t.div_ceil(page));
            state.truncate(0, nsa.config(), &pages).unwrap();
            assert_eq!(alloc.lock().free_pages(NsaPool::Raw), raw, "{what}");
            assert_eq!(alloc.lock().free_pages(NsaPool::Compressed), cmp, "{what}");
        }
    }

    #[test]
    fn forks_and_rollbacks_keep_each_sequence_its_own() {
        let mut rng = rng("nsa_layer_pages_fork");
        let nsa = layer();
        let cfg = nsa.config().clone();
        let (prefix, more) = (
            tokens(&mut rng, 90),
            [tokens(&mut rng, 40), tokens(&mut rng, 40)],
        );
        let (page, raw, cmp) = (16, 24, 6);
        let pages = NsaPages::new(dims(), page, raw, cmp, DType::F32, &Device::Cpu).unwrap();
        let alloc = SharedAllocator::new(PagePool::new(raw, cmp).unwrap());
        let (mut a, mut cache_a) = (NsaSeqState::new(&alloc), NsaCache::new());
        feed(
            &nsa,
            &prefix,
            (0, 90, 7),
            &pages,
            &mut a,
            &mut cache_a,
            "prefix",
        );
        // B shares A's 6 raw pages, the last one (90 = 5 x 16 + 10) half full
        let mut b = a.fork().unwrap();
        let mut cache_b = cache_a.try_clone().unwrap();
        assert_eq!(b.pages(NsaPool::Raw), a.pages(NsaPool::Raw));
        assert_eq!(
            alloc.lock().holders(NsaPool::Raw, a.pages(NsaPool::Raw)[5]),
            2
        );
        // both write into the shared half page: each gets its own copy
        feed(
            &nsa,
            &more[0],
            (0, 40, 3),
            &pages,
            &mut a,
            &mut cache_a,
            "A after fork",
        );
        feed(
            &nsa,
            &more[1],
            (0, 40, 1),
            &pages,
            &mut b,
            &mut cache_b,
            "B after fork",
        );
        assert_eq!(a.pages(NsaPool::Raw)[..5], b.pages(NsaPool::Raw)[..5]);
        assert_ne!(a.pages(NsaPool::Raw)[5], b.pages(NsaPool::Raw)[5]);
        // roll A back into the shared prefix, then continue it differently
        a.truncate(70, &cfg, &pages).unwrap();
        cache_a.truncate(70, &cfg).unwrap();
        let other = tokens(&mut rng, 30);
        feed(
            &nsa,
            &other,
            (0, 30, 4),
            &pages,
            &mut a,
            &mut cache_a,
            "A rolled back",
        );
        // B still reads its own history
        let last = tokens(&mut rng, 3);
        feed(
            &nsa,
            &last,
            (0, 3, 1),
            &pages,
            &mut b,
            &mut cache_b,
            "B at the end",
        );
        a.truncate(0, &cfg, &pages).unwrap();
        drop(b); // a dropped state returns its pages
        assert_eq!(alloc.lock().free_pages(NsaPool::Raw), raw);
        assert_eq!(alloc.lock().free_pages(NsaPool::Compressed), cmp);
    }

    #[test]
    fn an_exhausted_pool_is_an_error_that_changes_nothing() {
        let mut rng = rng("nsa_layer_pages_full");
        let nsa = layer();
        let tok = tokens(&mut rng, 64);
        let (page, raw, cmp) = (16, 3, 4);
        let pages = NsaPages::new(dims(), page, raw, cmp, DType::F32, &Device::Cpu).unwrap();
        let alloc = SharedAllocator::new(PagePool::new(raw, cmp).unwrap());
        let (mut s, mut cache) = (NsaSeqState::new(&alloc), NsaCache::new());
        feed(&nsa, &tok, (0, 40, 40), &pages, &mut s, &mut cache, "fill");
        let c = |t: &Tensor| t.narrow(1, 40, 20).unwrap();
        // 60 tokens need a fourth page of 16
        let e = nsa
            .forward_step_paged(
                &c(&tok.x),
                &c(&tok.q),
                &c(&tok.k),
                &c(&tok.v),
                &pages,
                &mut s,
            )
            .unwrap_err();
        assert!(
            matches!(
                &e,
                Error::OutOfPages {
                    pool: NsaPool::Raw,
                    pages: 3
                }
            ),
            "{e}"
        );
        assert_eq!((s.len(), s.pages(NsaPool::Raw).len()), (40, 3));
        assert_eq!(alloc.lock().free_pages(NsaPool::Raw), 0);
        // what still fits goes on as if the failed step had not happened
        feed(
            &nsa,
            &tok,
            (40, 48, 8),
            &pages,
            &mut s,
            &mut cache,
            "after the error",
        );
        // one sequence per state, and the pages' dtype
        let two = Tensor::zeros((2, 1, dims().hkv(), D), DType::F32, &Device::Cpu).unwrap();
        let e = nsa.append_kv_paged(&two, &two, &pages, &mut s).unwrap_err();
        assert!(matches!(&e, Error::Shape { arg: "k_new", .. }), "{e}");
        let half = Tensor::zeros((1, 1, dims().hkv(), D), DType::F16, &Device::Cpu).unwrap();
        let e = nsa
            .append_kv_paged(&half, &half, &pages, &mut s)
            .unwrap_err();
        assert!(matches!(&e, Error::DType { arg: "k_new", .. }), "{e}");
        assert_eq!(s.len(), 48);
    }

    /// `[1, n, Hkv, D]` keys (and values) whose every element names the token: `base + i`.
    fn numbered(base: usize, n: usize) -> Tensor {
        let v: Vec<f32> = (0..n)
            .flat_map(|i| std::iter::repeat_n((base + i) as f32, dims().hkv() * D))
            .collect();
        tensor(v, &[1, n, dims().hkv(), D])
    }

    /// The keys a state holds, read from the pool through its page list (one number per
    /// token, see [`numbered`]).
    fn held(pages: &NsaPages, s: &NsaSeqState) -> Vec<f32> {
        let ps = pages.page_size();
        let k = pages
            .keys()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let row = dims().hkv() * D;
        (0..s.len())
            .map(|p| {
                let at = (s.pages(NsaPool::Raw)[p / ps] * ps + p % ps) * row;
                assert!(k[at..at + row].iter().all(|&x| x == k[at]));
                k[at]
            })
            .collect()
    }

    #[test]
    fn a_dropped_state_returns_its_pages() {
        // 20 tokens take 2 of the 4 pages: without the drop, the third sequence has none left
        let nsa = layer();
        let pages = NsaPages::new(dims(), 16, 4, 4, DType::F32, &Device::Cpu).unwrap();
        let alloc = SharedAllocator::new(PagePool::new(4, 4).unwrap());
        for _ in 0..5 {
            let mut s = NsaSeqState::new(&alloc);
            let kv = numbered(0, 20);
            nsa.append_kv_paged(&kv, &kv, &pages, &mut s).unwrap();
            assert_eq!(alloc.lock().free_pages(NsaPool::Raw), 2);
        }
        assert_eq!(alloc.lock().free_pages(NsaPool::Raw), 4);
        assert_eq!(alloc.lock().free_pages(NsaPool::Compressed), 4);
    }

    #[test]
    fn the_sole_holder_of_a_page_writes_it_in_place() {
        // A fills a 3-page pool (40 tokens: the last page has 8 rows free); a fork truncated
        // to nothing (or dropped) leaves A the only holder, so A's next tokens need no copy
        let nsa = layer();
        for drop_it in [false, true] {
            let pages = NsaPages::new(dims(), 16, 3, 4, DType::F32, &Device::Cpu).unwrap();
            let alloc = SharedAllocator::new(PagePool::new(3, 4).unwrap());
            let mut a = NsaSeqState::new(&alloc);
            nsa.append_kv_paged(&numbered(0, 40), &numbered(0, 40), &pages, &mut a)
                .unwrap();
            let mut b = a.fork().unwrap();
            if drop_it {
                drop(b);
            } else {
                b.truncate(0, nsa.config(), &pages).unwrap();
            }
            let kv = numbered(40, 8);
            nsa.append_kv_paged(&kv, &kv, &pages, &mut a).unwrap();
            let want: Vec<f32> = (0..48).map(|i| i as f32).collect();
            assert_eq!(held(&pages, &a), want);
        }
    }

    #[test]
    fn a_page_nobody_holds_cannot_be_shared_or_released() {
        use fp8nsa::nsa::PageAllocator;
        let mut pool = PagePool::new(4, 1).unwrap();
        let e = pool.share(NsaPool::Raw, 2).unwrap_err();
        assert!(
            matches!(
                e,
                Error::PageNotHeld {
                    pool: NsaPool::Raw,
                    page: 2,
                    op: "share"
                }
            ),
            "{e}"
        );
        // so it is not handed out twice
        let (p, q) = (pool.alloc(NsaPool::Raw), pool.alloc(NsaPool::Raw));
        assert_eq!((p, q), (Some(0), Some(1)));
        pool.release(NsaPool::Raw, 0).unwrap();
        let e = pool.release(NsaPool::Raw, 0).unwrap_err();
        assert!(
            matches!(
                e,
                Error::PageNotHeld {
                    page: 0,
                    op: "release",
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(pool.free_pages(NsaPool::Raw), 3);
        assert!(matches!(
            pool.release(NsaPool::Compressed, 9),
            Err(Error::PageNotHeld { page: 9, .. })
        ));
    }

    #[test]
    fn pool_sizes_that_overflow_are_refused() {
        for (raw, cmp, arg) in [
            (1usize << 59, 4, "raw_pages"),
            (4, usize::MAX, "compressed_pages"),
            (usize::MAX / 16 + 2, 4, "raw_pages"),
        ] {
            let e = NsaPages::new(dims(), 16, raw, cmp, DType::F32, &Device::Cpu).unwrap_err();
            assert!(
                matches!(&e, Error::Invalid { arg: a, .. } if *a == arg),
                "{e}"
            );
        }
        // sizes that fit the address space but no machine's memory: refused by the allocator,
        // a typed error instead of an abort
        for (raw, cmp, arg) in [
            (1usize << 40, 4, "raw_pages"),
            (4, 1usize << 40, "compressed_pages"),
        ] {
            let e = NsaPages::new(dims(), 16, raw, cmp, DType::F32, &Device::Cpu).unwrap_err();
            assert!(
                matches!(&e, Error::Invalid { arg: a, .. } if *a == arg),
                "{e}"
            );
        }
        for (raw, cmp) in [(1usize << 59, 4), (4, usize::MAX)] {
            let e = PagePool::new(raw, cmp).unwrap_err();
            assert!(matches!(&e, Error::Invalid { .. }), "{e}");
        }
    }

    /// Random create / step / fork / truncate / drop against a model of which pages each
    /// state holds and which tokens it reads: every state reads exactly its own tokens, the
    /// pool's holder counts are the model's, and after dropping everything the pool is full.
    #[test]
    fn random_state_operations_keep_the_pool_consistent() {
        let mut rng = rng("nsa_paged_state_ops");
        let nsa = layer();
        let cfg = nsa.config().clone();
        let (ps, raw, cmp) = (8, 14, 6);
        let pages = NsaPages::new(dims(), ps, raw, cmp, DType::F32, &Device::Cpu).unwrap();
        let alloc = SharedAllocator::new(PagePool::new(raw, cmp).unwrap());
        // each live state and the tokens it should read
        let mut live: Vec<(NsaSeqState, Vec<f32>)> = Vec::new();
        let mut next = 0usize; // token numbers are unique across states
        let (mut counts, mut refused) = ([0usize; 5], 0);
        for round in 0..400 {
            // appends four times as often as the rest and rollbacks by half at most, so the pool runs out now and then
            let op = [0, 1, 1, 1, 1, 2, 3, 4][rng.random_range(0..8)];
            match op {
                0 if live.len() < 6 => live.push((NsaSeqState::new(&alloc), Vec::new())),
                1 if !live.is_empty() => {
                    let i = rng.random_range(0..live.len());
                    let n = rng.random_range(1..12);
                    let kv = numbered(next, n);
                    let (s, want) = &mut live[i];
                    let before = held(&pages, s);
                    match nsa.append_kv_paged(&kv, &kv, &pages, s) {
                        Ok(()) => {
                            want.extend((next..next + n).map(|t| t as f32));
                            next += n;
                        }
                        // only running out of pages may refuse, and it changes nothing
                        Err(Error::OutOfPages { .. }) => {
                            assert_eq!(held(&pages, s), before);
                            refused += 1;
                        }
                        Err(e) => panic!("round {round}: {e}"),
                    }
                }
                2 if !live.is_empty() && live.len() < 6 => {
                    let i = rng.random_range(0..live.len());
                    let f = live[i].0.fork().unwrap();
                    let want = live[i].1.clone();
                    live.push((f, want));
                }
                3 if !live.is_empty() => {
                    let i = rng.random_range(0..live.len());
                    let (s, want) = &mut live[i];
                    let len = rng.random_range(s.len() / 2..=s.len());
                    s.truncate(len, &cfg, &pages).unwrap();
                    want.truncate(len);
                }
                4 if !live.is_empty() => {
                    let i = rng.random_range(0..live.len());
                    live.swap_remove(i);
                }
                _ => continue,
            }
            counts[op] += 1;
            // the model: holders per page are the states listing it; free = the rest
            let a = alloc.lock();
            for pool in [NsaPool::Raw, NsaPool::Compressed] {
                let total = if pool == NsaPool::Raw { raw } else { cmp };
                let mut holders = vec![0u32; total];
                for (s, _) in &live {
                    for &p in s.pages(pool) {
                        holders[p] += 1;
                    }
                }
                for (p, &h) in holders.iter().enumerate() {
                    assert_eq!(a.holders(pool, p), h, "round {round}, {pool:?} page {p}");
                }
                let free = holders.iter().filter(|&&h| h == 0).count();
                assert_eq!(a.free_pages(pool), free, "round {round}, {pool:?}");
            }
            drop(a);
            for (s, want) in &live {
                assert_eq!(&held(&pages, s), want, "round {round}");
                assert_eq!(s.compressed_len(), cfg.compressed_len(s.len()));
            }
        }
        // every kind of operation ran, appends often enough to fill the pool at times
        assert!(counts.iter().all(|&c| c >= 10), "{counts:?}");
        assert!(refused > 0, "the pool never ran out: {counts:?}");
        drop(live);
        assert_eq!(alloc.lock().free_pages(NsaPool::Raw), raw);
        assert_eq!(alloc.lock().free_pages(NsaPool::Compressed), cmp);
    }
}
