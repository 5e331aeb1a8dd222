//! Selection attention over a paged KV cache (issue 19, items 1 and 2): a batch of sequences
//! of different lengths, their keys scattered over a shuffled page pool, against the same
//! sequences called one by one on contiguous keys. Bit for bit on the CPU kernel and on the
//! dense fallback, for page sizes 1, 16, 64 and 24 (which does not divide the 32-key blocks),
//! blocks, ranges and tokens, decode (Tq = 1) and speculative decode (Tq = 3).

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
