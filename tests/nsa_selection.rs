//! NSA selection attention: the CPU kernel and the dense fallback against the f64 reference.

use candle_core::{DType, Device, Tensor};
use fp8nsa::nsa::{
    BlockSelection, NsaPath, SdpaReason, Selection, SelectionAttention, SelectionRanges,
    TokenSelection,
};
use fp8nsa::{reference, Error};
use fp8nsa_test_support::nsa::{check_lse, random_ranges, ranges_rows, rms_ratio};
use fp8nsa_test_support::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

struct Qkv {
    q: Tensor,
    k: Tensor,
    v: Tensor,
}

#[allow(clippy::too_many_arguments)]
fn qkv(
    rng: &mut StdRng,
    b: usize,
    tq: usize,
    tk: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    dv: usize,
    dtype: DType,
) -> Qkv {
    let mk = |rng: &mut StdRng, dims: &[usize]| {
        let n = dims.iter().product();
        tensor(gaussian(rng, n), dims).to_dtype(dtype).unwrap()
    };
    Qkv {
        q: mk(rng, &[b, tq, hq, d]),
        k: mk(rng, &[b, tk, hkv, d]),
        v: mk(rng, &[b, tk, hkv, dv]),
    }
}

/// Runs the kernel (min_len 0) and the fallback (min_len = max) against the reference.
fn check<'s>(x: &Qkv, sel: impl Into<Selection<'s>> + Copy, q_offset: Option<usize>, what: &str) {
    let tol = if x.q.dtype() == DType::F32 {
        1e-4
    } else {
        5e-3
    };
    let (want, want_lse) = reference::nsa_selection(&x.q, &x.k, &x.v, sel, None, q_offset).unwrap();
    for (path, min_len) in [("kernel", 0), ("fallback", usize::MAX)] {
        let mut att = SelectionAttention::new().min_len(min_len).with_lse(true);
        if let Some(o) = q_offset {
            att = att.q_offset(o);
        }
        let (o, lse) = att.forward(&x.q, &x.k, &x.v, sel).unwrap();
        assert_eq!(
            (o.dims(), o.dtype()),
            (want.dims(), x.q.dtype()),
            "{what} {path}"
        );
        let err = rms_ratio(&o, &want);
        assert!(err < tol, "{what} {path}: rms ratio {err:e}");
        check_lse(&lse.unwrap(), &want_lse, 1e-3, &format!("{what} {path}"));
    }
}

fn random_blocks(rng: &mut StdRng, nblocks: usize, s: usize) -> Vec<i32> {
    let mut ids: Vec<i32> = (0..nblocks as i32).collect();
    ids.shuffle(rng);
    let mut row: Vec<i32> = ids[..s.min(nblocks)].to_vec();
    row.resize(s, -1);
    row.shuffle(rng);
    row
}

fn block_selection(
    rng: &mut StdRng,
    b: usize,
    tq: usize,
    hkv: usize,
    tk: usize,
    bs: usize,
    s: usize,
) -> BlockSelection {
    let nb = tk.div_ceil(bs);
    let v: Vec<i32> = (0..b * tq * hkv)
        .flat_map(|_| random_blocks(rng, nb, s))
        .collect();
    BlockSelection::new(
        Tensor::from_vec(v, (b, tq, hkv, s), &Device::Cpu).unwrap(),
        bs,
    )
    .unwrap()
}

#[test]
fn single_range_per_query() {
    let mut rng = rng("single_range");
    let (b, t, hq, hkv, d) = (2, 150, 8, 2, 64);
    let x = qkv(&mut rng, b, t, t, hq, hkv, d, d, DType::F32);
    let rows = (0..b * t * hkv)
        .map(|_| random_ranges(&mut rng, t, 1))
        .collect();
    check(&x, &ranges(rows, b, t, hkv), None, "single range");
}

#[test]
fn many_ranges_per_query() {
    let mut rng = rng("many_ranges");
    let (b, t, hq, hkv, d) = (1, 160, 4, 1, 128);
    let x = qkv(&mut rng, b, t, t, hq, hkv, d, d, DType::F32);
    // the case the original Triton kernel could not compile
    let fixed = vec![vec![[0, 16], [32, 48], [64, 80]]; b * t * hkv];
    check(
        &x,
        &ranges(fixed, b, t, hkv),
        None,
        "[[0,16],[32,48],[64,80]]",
    );
    let rows = (0..b * t * hkv)
        .map(|_| random_ranges(&mut rng, t, 6))
        .collect();
    check(&x, &ranges(rows, b, t, hkv), None, "six random ranges");
}

#[test]
fn mixed_alignment_and_padding() {
    let mut rng = rng("mixed");
    let (b, t, hq, hkv, d) = (2, 130, 8, 2, 64);
    let x = qkv(&mut rng, b, t, t, hq, hkv, d, d, DType::F32);
    let rows = (0..b * t * hkv)
        .map(|i| match i % 3 {
            0 => vec![[0, 64], [64, 128]], // adjacent block-aligned
            1 => random_ranges(&mut rng, t, 3),
            _ => vec![[5, 5], [17, 29], [1000, 999]], // padding both ways
        })
        .collect();
    check(&x, &ranges(rows, b, t, hkv), None, "mixed");
}

#[test]
fn random_block_selections_for_each_group_size_and_head_dim() {
    let mut rng = rng("random_blocks");
    for g in [1, 4, 16] {
        for (d, dv) in [(64, 64), (128, 128), (128, 64), (64, 128)] {
            let (b, t, hkv) = (1, 140, 2);
            let x = qkv(&mut rng, b, t, t, g * hkv, hkv, d, dv, DType::F32);
            let sel = block_selection(&mut rng, b, t, hkv, t, 16, 4);
            check(&x, &sel, None, &format!("G={g} D={d} Dv={dv}"));
        }
    }
}

#[test]
fn block_aligned_ranges_equal_the_blocks() {
    let mut rng = rng("blocks_vs_ranges");
    let (b, t, hq, hkv, d) = (2, 200, 8, 2, 64);
    let x = qkv(&mut rng, b, t, t, hq, hkv, d, d, DType::F32);
    let blocks = block_selection(&mut rng, b, t, hkv, t, 32, 3);
    let ranges = blocks.to_ranges().unwrap();
    check(&x, &ranges, None, "to_ranges");
    for min_len in [0, usize::MAX] {
        let att = SelectionAttention::new().min_len(min_len).with_lse(true);
        let (ob, lb) = att.forward(&x.q, &x.k, &x.v, &blocks).unwrap();
        let (or, lr) = att.forward(&x.q, &x.k, &x.v, &ranges).unwrap();
        assert_eq!(rms_ratio(&ob, &or), 0.0);
        check_lse(&lb.unwrap(), &lr.unwrap(), 1e-3, "blocks vs ranges");
    }
}

/// Token-level (DSA) selections: hundreds of single keys per row, in random order with pads,
/// against the reference on the kernel (whose chunks then span many selected keys) and the
/// fallback; identical to the same keys as one-token ranges.
#[test]
fn token_selections_match_the_reference_and_one_token_ranges() {
    let mut rng = rng("token_selection");
    let (b, hq, hkv, d) = (2, 8, 2, 64);
    for (tq, tk, k, q_offset) in [(1, 3000, 300, None), (5, 700, 130, Some(600))] {
        let x = qkv(&mut rng, b, tq, tk, hq, hkv, d, d, DType::F32);
        let mut v = Vec::new();
        for _ in 0..b * tq * hkv {
            let mut ids: Vec<i32> = (0..tk as i32).collect();
            ids.shuffle(&mut rng);
            ids.truncate(k - 3);
            ids.extend([-1, -1, -1]);
            ids.shuffle(&mut rng);
            v.extend(ids);
        }
        let sel = TokenSelection::new(tensor_i32(v.clone(), &[b, tq, hkv, k])).unwrap();
        assert_eq!(sel.dims(), [b, tq, hkv, k]);
        let what = format!("tokens tq={tq} tk={tk} k={k}");
        check(&x, &sel, q_offset, &what);
        let ranges: Vec<i32> = v
            .iter()
            .flat_map(|&i| if i < 0 { [0, 0] } else { [i, i + 1] })
            .collect();
        let ranges = SelectionRanges::new(tensor_i32(ranges, &[b, tq, hkv, k, 2])).unwrap();
        let mut att = SelectionAttention::new().min_len(0).with_lse(true);
        if let Some(o) = q_offset {
            att = att.q_offset(o);
        }
        let (ot, lt) = att.forward(&x.q, &x.k, &x.v, &sel).unwrap();
        let (or, lr) = att.forward(&x.q, &x.k, &x.v, &ranges).unwrap();
        assert_eq!(rms_ratio(&ot, &or), 0.0, "{what}");
        check_lse(&lt.unwrap(), &lr.unwrap(), 1e-3, &what);
    }
    // a duplicate key is an error naming the entry, as for blocks
    let dup = TokenSelection::new(tensor_i32(vec![4, 9, 4], &[1, 1, 1, 3])).unwrap();
    assert!(matches!(
        dup.validate(10),
        Err(Error::Selection { entry: 2, .. })
    ));
}

#[test]
fn decode_and_chunked_prefill_with_q_offset() {
    let mut rng = rng("decode_chunked");
    let (hq, hkv, d) = (16, 1, 128);
    for (tq, tk, q_offset) in [
        (1, 500, None),
        (7, 300, None),
        (5, 300, Some(100)),
        (3, 2, Some(0)),
    ] {
        let x = qkv(&mut rng, 2, tq, tk, hq, hkv, d, d, DType::F32);
        let sel = block_selection(&mut rng, 2, tq, hkv, tk, 64, 3);
        check(
            &x,
            &sel,
            q_offset,
            &format!("tq={tq} tk={tk} q_offset={q_offset:?}"),
        );
        let rows = (0..2 * tq * hkv)
            .map(|_| random_ranges(&mut rng, tk, 2))
            .collect();
        check(
            &x,
            &ranges(rows, 2, tq, hkv),
            q_offset,
            &format!("ranges tq={tq} tk={tk}"),
        );
    }
}

#[test]
fn bf16_and_f16_inputs() {
    let mut rng = rng("half_inputs");
    for dtype in [DType::BF16, DType::F16] {
        let (b, t, hq, hkv, d) = (1, 150, 8, 2, 128);
        let x = qkv(&mut rng, b, t, t, hq, hkv, d, 64, dtype);
        let sel = block_selection(&mut rng, b, t, hkv, t, 16, 5);
        check(&x, &sel, None, &format!("{dtype:?}"));
    }
}

/// The non-finite rule on the kernel (issue: reliability, item 6): a NaN query makes its own
/// head's `o` and `lse` NaN and nothing else; a NaN key makes NaN exactly the queries that
/// attend it, never the ones that do not select it or cannot see it yet.
#[test]
fn non_finite_inputs_reach_only_the_queries_that_attend_them() {
    // docs/nsa.md "Non-finite values", on the kernel and on the dense fallback
    let mut rng = rng("nan_rule");
    let (b, t, hq, hkv, d) = (1, 40, 4, 1, 32);
    let x = qkv(&mut rng, b, t, t, hq, hkv, d, d, DType::F32);
    let poke = |t_: &Tensor, at: &[(usize, usize, f32)]| {
        let dims = t_.dims().to_vec();
        let mut v: Vec<f32> = t_.flatten_all().unwrap().to_vec1().unwrap();
        for &(tok, head, val) in at {
            v[(tok * dims[2] + head) * dims[3] + 3] = val;
        }
        Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
    };
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    // query token 3 head 1 NaN; keys: 5 NaN and 30 +Inf (attended), 9 NaN (never attended);
    // values: 2 NaN (attended), 10 -Inf (never attended)
    let q = poke(&x.q, &[(3, 1, nan)]);
    let k = poke(&x.k, &[(5, 0, nan), (30, 0, inf), (9, 0, nan)]);
    let v = poke(&x.v, &[(2, 0, nan), (10, 0, -inf)]);
    // the same inputs with every poked entry finite: what the unaffected queries must give
    let q0 = poke(&x.q, &[(3, 1, 0.5)]);
    let k0 = poke(&x.k, &[(5, 0, 0.5), (30, 0, 0.5), (9, 0, 0.5)]);
    let v0 = poke(&x.v, &[(2, 0, 0.5), (10, 0, 0.5)]);
    // tokens before 20 select keys [0, 8) (causal: key 5 from token 5 on), later ones [12, i]
    let rows = (0..t as i32)
        .map(|i| {
            if i < 20 {
                vec![[0, 8]]
            } else {
                vec![[12, i + 1]]
            }
        })
        .collect();
    let sel = ranges(rows, b, t, hkv);
    for (min_len, path) in [(0, "kernel"), (usize::MAX, "fallback")] {
        let run = |q: &Tensor, k: &Tensor, v: &Tensor| {
            let (o, lse) = SelectionAttention::new()
                .min_len(min_len)
                .with_lse(true)
                .forward(q, k, v, &sel)
                .unwrap();
            let o: Vec<Vec<Vec<f32>>> = o.squeeze(0).unwrap().to_vec3().unwrap();
            let lse: Vec<Vec<f32>> = lse.unwrap().squeeze(0).unwrap().to_vec2().unwrap();
            (o, lse)
        };
        let (o, lse) = run(&q, &k, &v);
        let (o0, lse0) = run(&q0, &k0, &v0);
        for i in 0..t {
            for h in 0..hq {
                let bad_key = (5..20).contains(&i) || i >= 30 || (i, h) == (3, 1);
                let bad_value = (2..20).contains(&i);
                let what = format!("{path}: token {i} head {h}");
                if bad_key {
                    assert!(o[i][h].iter().all(|x| x.is_nan()), "o, {what}");
                    assert!(lse[i][h].is_nan(), "lse, {what}");
                } else if bad_value {
                    assert!(o[i][h].iter().any(|x| !x.is_finite()), "o, {what}");
                    assert_eq!(lse[i][h], lse0[i][h], "lse, {what}");
                } else {
                    // bit-for-bit what the finite inputs give
                    assert_eq!(o[i][h], o0[i][h], "o, {what}");
                    assert_eq!(lse[i][h], lse0[i][h], "lse, {what}");
                }
            }
        }
    }
}

/// A NaN query that attends nothing reads nothing: `o = 0`, `lse = -inf` on every path.
#[test]
fn a_nan_query_that_attends_nothing_gives_zero_and_minus_infinity() {
    let mut rng = rng("nan_empty");
    let (b, t, hq, hkv, d) = (1, 8, 2, 1, 16);
    let x = qkv(&mut rng, b, t, t, hq, hkv, d, d, DType::F32);
    let q = Tensor::full(f32::NAN, (b, t, hq, d), &Device::Cpu).unwrap();
    // token 0 selects nothing; the others select key 0
    let rows = (0..t)
        .map(|i| if i == 0 { vec![[3, 3]] } else { vec![[0, 1]] })
        .collect();
    let sel = ranges(rows, b, t, hkv);
    for min_len in [0, usize::MAX] {
        let (o, lse) = SelectionAttention::new()
            .min_len(min_len)
            .with_lse(true)
            .forward(&q, &x.k, &x.v, &sel)
            .unwrap();
        let o: Vec<Vec<Vec<f32>>> = o.squeeze(0).unwrap().to_vec3().unwrap();
        let lse: Vec<Vec<f32>> = lse.unwrap().squeeze(0).unwrap().to_vec2().unwrap();
        assert!(
            o[0].iter().flatten().all(|&v| v == 0.0),
            "min_len {min_len}"
        );
        assert!(
            lse[0].iter().all(|&v| v == f32::NEG_INFINITY),
            "min_len {min_len}"
        );
        assert!(
            o[1].iter().flatten().all(|v| v.is_nan()),
            "min_len {min_len}"
        );
        assert!(lse[1].iter().all(|v| v.is_nan()), "min_len {min_len}");
    }
}

#[test]
fn empty_rows_give_zero_and_minus_infinity() {
    let mut rng = rng("empty_rows");
    let (b, t, hq, hkv, d) = (1, 40, 4, 1, 64);
    let x = qkv(&mut rng, b, t, t, hq, hkv, d, d, DType::F32);
    // only future keys (invisible to every query before 30), or nothing at all
    let rows = (0..t)
        .map(|i| {
            if i % 2 == 0 {
                vec![[30, 40]]
            } else {
                vec![[3, 3]]
            }
        })
        .collect();
    let sel = ranges(rows, b, t, hkv);
    check(&x, &sel, None, "empty rows");
    let (o, lse) = SelectionAttention::new()
        .min_len(0)
        .with_lse(true)
        .forward(&x.q, &x.k, &x.v, &sel)
        .unwrap();
    let o: Vec<Vec<Vec<f32>>> = o.squeeze(0).unwrap().to_vec3().unwrap();
    let lse: Vec<Vec<f32>> = lse.unwrap().squeeze(0).unwrap().to_vec2().unwrap();
    assert!(o[1].iter().flatten().all(|&x| x == 0.0));
    assert!(lse[1].iter().all(|&x| x == f32::NEG_INFINITY));
    assert!(o[34].iter().flatten().any(|&x| x != 0.0));
    let all_pad = BlockSelection::new(
        Tensor::full(-1i32, (b, t, hkv, 3), &Device::Cpu).unwrap(),
        16,
    )
    .unwrap();
    check(&x, &all_pad, None, "all -1");
}

#[test]
fn varlen_three_sequences_match_each_sequence_alone() {
    let mut rng = rng("varlen");
    let (hq, hkv, d, dv) = (8, 2, 64, 64);
    let lens = [(40, 40), (1, 250), (17, 120)]; // prefill, decode, chunked prefill
    let seqs: Vec<(Qkv, BlockSelection)> = lens
        .iter()
        .map(|&(tq, tk)| {
            let x = qkv(&mut rng, 1, tq, tk, hq, hkv, d, dv, DType::F32);
            let sel = block_selection(&mut rng, 1, tq, hkv, tk, 16, 4);
            (x, sel)
        })
        .collect();
    let cat = |f: &dyn Fn(&Qkv) -> Tensor| {
        Tensor::cat(
            &seqs
                .iter()
                .map(|(x, _)| f(x).squeeze(0).unwrap())
                .collect::<Vec<_>>(),
            0,
        )
        .unwrap()
    };
    let (q, k, v) = (
        cat(&|x| x.q.clone()),
        cat(&|x| x.k.clone()),
        cat(&|x| x.v.clone()),
    );
    let idx = Tensor::cat(
        &seqs
            .iter()
            .map(|(_, s)| s.indices().clone())
            .collect::<Vec<_>>(),
        1,
    )
    .unwrap();
    let sel = BlockSelection::new(idx, 16).unwrap();
    let mut cq = vec![0u32];
    let mut ck = vec![0u32];
    for &(tq, tk) in &lens {
        cq.push(cq.last().unwrap() + tq as u32);
        ck.push(ck.last().unwrap() + tk as u32);
    }
    let cq = Tensor::new(cq, &Device::Cpu).unwrap();
    let ck = Tensor::new(ck, &Device::Cpu).unwrap();
    for min_len in [0, usize::MAX] {
        let att = SelectionAttention::new().min_len(min_len).with_lse(true);
        let (o, lse) = att.forward_varlen(&q, &k, &v, &cq, &ck, &sel).unwrap();
        let lse = lse.unwrap();
        let mut start = 0;
        for ((x, s), &(tq, _)) in seqs.iter().zip(&lens) {
            let (want, want_lse) =
                reference::nsa_selection(&x.q, &x.k, &x.v, s, None, None).unwrap();
            let got = o.narrow(0, start, tq).unwrap().unsqueeze(0).unwrap();
            let err = rms_ratio(&got, &want);
            assert!(
                err < 1e-4,
                "varlen min_len={min_len} seq at {start}: {err:e}"
            );
            check_lse(
                &lse.narrow(0, start, tq).unwrap().unsqueeze(0).unwrap(),
                &want_lse,
                1e-3,
                "varlen",
            );
            start += tq;
        }
    }
}

/// The f64 reference on the documented-valid extremes: ranges up to `i32::MAX` and block ids
/// far past the keys cost what the keys cost, not gigabytes (issue: reliability, item 4).
#[test]
fn reference_takes_huge_ranges_and_block_ids() {
    let mut rng = rng("reference_huge");
    let (b, t, hq, hkv, d) = (1, 30, 2, 1, 16);
    let x = qkv(&mut rng, b, t, t, hq, hkv, d, d, DType::F32);
    let rows = (0..t).map(|_| vec![[0, i32::MAX]]).collect();
    let huge = ranges(rows, b, t, hkv);
    let rows = (0..t).map(|_| vec![[0, t as i32]]).collect();
    let all = ranges(rows, b, t, hkv);
    let (o, _) = reference::nsa_selection(&x.q, &x.k, &x.v, &huge, None, None).unwrap();
    let (want, _) = reference::nsa_selection(&x.q, &x.k, &x.v, &all, None, None).unwrap();
    assert_eq!(rel_frobenius(&o, &want), 0.0);
    let ids = Tensor::from_vec(
        [0i32, i32::MAX / 2, i32::MAX].repeat(t),
        (b, t, hkv, 3),
        &Device::Cpu,
    )
    .unwrap();
    let blocks = BlockSelection::new(ids, 64).unwrap();
    let (o, _) = reference::nsa_selection(&x.q, &x.k, &x.v, &blocks, None, None).unwrap();
    assert_eq!(rel_frobenius(&o, &want), 0.0);
}

#[test]
fn validation_errors_name_the_entry() {
    let dev = Device::Cpu;
    let blocks = |v: Vec<i32>, s: usize| {
        BlockSelection::new(Tensor::from_vec(v, (1, 2, 1, s), &dev).unwrap(), 16).unwrap()
    };
    // duplicate block in batch 0, token 1, entry 2
    let e = err_of(blocks(vec![0, 1, -1, 3, 1, 3], 3).validate(64));
    assert!(
        matches!(&e, Error::Selection { batch: 0, token: 1, head: 0, entry: 2, msg }
            if msg.starts_with("duplicates")),
        "{e}"
    );
    // block past tk
    let e = err_of(blocks(vec![0, 4, 1, 2], 2).validate(64));
    assert!(
        matches!(&e, Error::Selection { batch: 0, token: 0, head: 0, entry: 1, msg }
            if msg.contains("past tk")),
        "{e}"
    );
    // partial last block is in range
    blocks(vec![0, 4, 1, 2], 2).validate(65).unwrap();
    // negative other than -1
    let e = err_of(blocks(vec![-2, 0, 1, 2], 2).validate(64));
    assert!(
        matches!(&e, Error::Selection { batch: 0, token: 0, head: 0, entry: 0, msg }
            if msg.contains("only -1 pads")),
        "{e}"
    );
    let ranges = |v: Vec<i32>, r: usize| {
        SelectionRanges::new(Tensor::from_vec(v, (1, 1, 2, r, 2), &dev).unwrap()).unwrap()
    };
    // overlap in kv head 1
    let e = err_of(ranges(vec![0, 10, 20, 30, 0, 10, 5, 12], 2).validate(64));
    assert!(
        matches!(&e, Error::Selection { batch: 0, token: 0, head: 1, entry: 1, msg }
            if msg.starts_with("overlaps")),
        "{e}"
    );
    // out of range: a range must start on a key (its end is clamped to tk, like a partial
    // last block)
    let e = err_of(ranges(vec![64, 70, 0, 0, 0, 1, 2, 3], 2).validate(64));
    assert!(
        matches!(&e, Error::Selection { batch: 0, token: 0, head: 0, entry: 0, msg }
            if msg.contains("outside")),
        "{e}"
    );
    ranges(vec![60, 70, 0, 0, 0, 1, 2, 3], 2)
        .validate(64)
        .unwrap();
    let e = err_of(ranges(vec![-3, 5, 0, 0, 0, 1, 2, 3], 2).validate(64));
    assert!(
        matches!(&e, Error::Selection { batch: 0, token: 0, head: 0, entry: 0, msg }
            if msg.contains("outside")),
        "{e}"
    );
    // padding in any form is fine
    ranges(vec![9, 2, 70, 70, -5, -9, 0, 64], 2)
        .validate(64)
        .unwrap();
    // forward validates on the CPU, in both paths
    let x = qkv(&mut rng("validation"), 1, 2, 64, 2, 1, 8, 8, DType::F32);
    for min_len in [0, usize::MAX] {
        let att = SelectionAttention::new().min_len(min_len);
        let e = err_of(att.forward(&x.q, &x.k, &x.v, &blocks(vec![0, 0, 1, 2], 2)));
        assert!(
            matches!(&e, Error::Selection { batch: 0, token: 0, head: 0, entry: 1, msg }
                if msg.starts_with("duplicates")),
            "min_len {min_len}: {e}"
        );
    }
    // constructors
    let e = err_of(BlockSelection::new(
        Tensor::zeros((1, 2, 1, 3), DType::I64, &dev).unwrap(),
        16,
    ));
    assert!(
        matches!(
            e,
            Error::DType {
                arg: "indices",
                expected: "i32",
                got: DType::I64
            }
        ),
        "{e}"
    );
    let e = err_of(BlockSelection::new(
        Tensor::zeros((2, 1, 3), DType::I32, &dev).unwrap(),
        16,
    ));
    assert!(
        matches!(&e, Error::Shape { arg: "indices", expected, got }
            if expected == "[B, Tq, Hkv, S]" && got == &[2, 1, 3]),
        "{e}"
    );
    let e = err_of(BlockSelection::new(
        Tensor::zeros((1, 2, 1, 3), DType::I32, &dev).unwrap(),
        0,
    ));
    assert!(
        matches!(
            e,
            Error::Invalid {
                arg: "block_size",
                ..
            }
        ),
        "{e}"
    );
    let e = err_of(SelectionRanges::new(
        Tensor::zeros((1, 2, 1, 3, 3), DType::I32, &dev).unwrap(),
    ));
    assert!(
        matches!(&e, Error::Shape { arg: "ranges", got, .. } if got == &[1, 2, 1, 3, 3]),
        "{e}"
    );
}

#[test]
fn shape_and_argument_errors() {
    let dev = Device::Cpu;
    let mut rng = rng("shape_errors");
    let x = qkv(&mut rng, 1, 4, 16, 4, 2, 8, 8, DType::F32);
    let sel = block_selection(&mut rng, 1, 4, 2, 16, 4, 2);
    let att = SelectionAttention::new();
    // selection rows do not match q
    let wrong = block_selection(&mut rng, 1, 3, 2, 16, 4, 2);
    let e = err_of(att.forward(&x.q, &x.k, &x.v, &wrong));
    assert!(
        matches!(&e, Error::Shape { arg: "selection", got, .. } if got[..3] == [1, 3, 2]),
        "{e}"
    );
    // Hq not a multiple of Hkv
    let q3 = Tensor::zeros((1, 4, 3, 8), DType::F32, &dev).unwrap();
    let e = err_of(att.forward(&q3, &x.k, &x.v, &sel));
    assert!(
        matches!(&e, Error::Shape { arg: "q", expected, .. } if expected.contains("Hkv")),
        "{e}"
    );
    // head dim mismatch, mixed dtypes, integer dtype
    let k7 = Tensor::zeros((1, 16, 2, 7), DType::F32, &dev).unwrap();
    let e = err_of(att.forward(&x.q, &k7, &x.v, &sel));
    assert!(
        matches!(&e, Error::Shape { arg: "k", got, .. } if got == &[1, 16, 2, 7]),
        "{e}"
    );
    let kb = x.k.to_dtype(DType::BF16).unwrap();
    let e = err_of(att.forward(&x.q, &kb, &x.v, &sel));
    assert!(
        matches!(&e, Error::Invalid { arg: "k", msg } if msg.contains("dtype")),
        "{e}"
    );
    let qi = Tensor::zeros((1, 4, 4, 8), DType::U32, &dev).unwrap();
    let e = err_of(att.forward(&qi, &x.k, &x.v, &sel));
    assert!(
        matches!(
            e,
            Error::DType {
                arg: "q",
                got: DType::U32,
                ..
            }
        ),
        "{e}"
    );
    // Tq > Tk without an explicit offset
    let long = qkv(&mut rng, 1, 20, 16, 4, 2, 8, 8, DType::F32);
    let sel20 = block_selection(&mut rng, 1, 20, 2, 16, 4, 2);
    let e = err_of(att.forward(&long.q, &long.k, &long.v, &sel20));
    assert!(
        matches!(
            e,
            Error::Invalid {
                arg: "q_offset",
                ..
            }
        ),
        "{e}"
    );
    assert!(att
        .clone()
        .q_offset(0)
        .forward(&long.q, &long.k, &long.v, &sel20)
        .is_ok());
    // varlen: bad cu_seqlens
    let (q, k, v) = (
        x.q.squeeze(0).unwrap(),
        x.k.squeeze(0).unwrap(),
        x.v.squeeze(0).unwrap(),
    );
    let cu = |v: Vec<u32>| Tensor::new(v, &dev).unwrap();
    let e = err_of(att.forward_varlen(&q, &k, &v, &cu(vec![0, 3]), &cu(vec![0, 16]), &sel));
    assert!(
        matches!(
            e,
            Error::Invalid {
                arg: "cu_seqlens_q",
                ..
            }
        ),
        "{e}"
    );
    let e = err_of(att.forward_varlen(&q, &k, &v, &cu(vec![0, 4]), &cu(vec![0, 9, 16]), &sel));
    assert!(
        matches!(&e, Error::Shape { arg: "cu_seqlens_k", got, .. } if got == &[3]),
        "{e}"
    );
    let e = err_of(att.forward_varlen(&q, &k, &v, &cu(vec![1, 4]), &cu(vec![0, 16]), &sel));
    assert!(
        matches!(
            e,
            Error::Invalid {
                arg: "cu_seqlens_q",
                ..
            }
        ),
        "{e}"
    );
    assert!(att
        .forward_varlen(&q, &k, &v, &cu(vec![0, 4]), &cu(vec![0, 16]), &sel)
        .is_ok());
}

#[test]
fn no_keys_or_no_selected_entries_give_empty_rows_on_every_path() {
    let dev = Device::Cpu;
    let mut rng = rng("degenerate");
    // a varlen batch whose second sequence has no keys at all
    let (hq, hkv, d) = (4, 2, 16);
    let q = tensor(gaussian(&mut rng, 3 * hq * d), &[3, hq, d]);
    let k = tensor(gaussian(&mut rng, 5 * hkv * d), &[5, hkv, d]);
    let v = tensor(gaussian(&mut rng, 5 * hkv * d), &[5, hkv, d]);
    let cu = |v: Vec<u32>| Tensor::new(v, &dev).unwrap();
    // block 0 for the tokens of the first sequence; padding for the keyless one
    let idx = Tensor::from_vec(vec![0i32, 0, 0, 0, -1, -1], (1, 3, hkv, 1), &dev).unwrap();
    let sel = BlockSelection::new(idx, 4).unwrap();
    for min_len in [0, usize::MAX] {
        let att = SelectionAttention::new()
            .min_len(min_len)
            .with_lse(true)
            .q_offset(0);
        let (o, lse) = att
            .forward_varlen(&q, &k, &v, &cu(vec![0, 2, 3]), &cu(vec![0, 5, 5]), &sel)
            .unwrap();
        let o: Vec<Vec<Vec<f32>>> = o.to_vec3().unwrap();
        let lse: Vec<Vec<f32>> = lse.unwrap().to_vec2().unwrap();
        assert!(
            o[2].iter().flatten().all(|&x| x == 0.0),
            "min_len {min_len}"
        );
        assert!(lse[2].iter().all(|&x| x == f32::NEG_INFINITY));
        assert!(lse[0].iter().all(|x| x.is_finite()));
    }
    // a selection with zero entries per row
    let x = qkv(&mut rng, 1, 4, 8, 4, 2, 16, 16, DType::F32);
    let none =
        BlockSelection::new(Tensor::zeros((1, 4, 2, 0), DType::I32, &dev).unwrap(), 4).unwrap();
    for min_len in [0, usize::MAX] {
        let (o, _) = SelectionAttention::new()
            .min_len(min_len)
            .forward(&x.q, &x.k, &x.v, &none)
            .unwrap();
        assert_eq!(
            o.abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
            0.0
        );
    }
    let e = err_of(BlockSelection::new(
        Tensor::zeros((1, 1, 1, 1), DType::I32, &dev).unwrap(),
        1 << 40,
    ));
    assert!(
        matches!(
            e,
            Error::Invalid {
                arg: "block_size",
                ..
            }
        ),
        "{e}"
    );
}

/// Each call returns the path it took (the kernel, or the dense fallback below `min_len`, with
/// the reason), and logs the same (`tracing`, field `backend`) for people reading logs.
#[test]
fn the_path_taken_is_returned_and_logged() {
    let mut rng = rng("path_taken");
    let x = qkv(&mut rng, 1, 40, 40, 4, 2, 16, 16, DType::F32);
    let sel = block_selection(&mut rng, 1, 40, 2, 40, 8, 2);
    let below = NsaPath::Sdpa(SdpaReason::BelowMinLen {
        tk: 40,
        min_len: usize::MAX,
    });
    for (min_len, want, logged) in [
        (0, NsaPath::CpuKernel, "cpu"),
        (usize::MAX, below, "sdpa-fallback"),
    ] {
        let att = SelectionAttention::new().min_len(min_len);
        let (r, backends) = fp8nsa_test_support::trace::logged("backend", || {
            att.forward_with_path(&x.q, &x.k, &x.v, &sel)
        });
        let (o, _, path) = r.unwrap();
        assert_eq!(path, want, "min_len {min_len}");
        assert_eq!(backends, [logged], "min_len {min_len}");
        let (plain, _) = att.forward(&x.q, &x.k, &x.v, &sel).unwrap();
        assert_eq!(
            rms_ratio(&o, &plain),
            0.0,
            "forward and forward_with_path agree"
        );
    }
}

/// A `q_offset` whose positions `q_offset + i` would wrap is an error naming it (it had wrapped
/// in release builds and shifted causality); the largest one that fits sees every key, as a
/// query past the end does.
#[test]
fn q_offset_positions_that_overflow_are_errors() {
    let mut rng = rng("q_offset_overflow");
    let (tq, tk) = (3, 200);
    let x = qkv(&mut rng, 1, tq, tk, 4, 1, 64, 64, DType::F32);
    let sel = block_selection(&mut rng, 1, tq, 1, tk, 64, 2);
    for min_len in [0, usize::MAX] {
        let att = SelectionAttention::new().min_len(min_len).with_lse(true);
        for q_offset in [usize::MAX, usize::MAX - 2] {
            let e = err_of(
                att.clone()
                    .q_offset(q_offset)
                    .forward(&x.q, &x.k, &x.v, &sel),
            );
            assert!(
                matches!(
                    &e,
                    Error::Invalid {
                        arg: "q_offset",
                        ..
                    }
                ),
                "{e}"
            );
        }
        let far = att
            .clone()
            .q_offset(usize::MAX - 3)
            .forward(&x.q, &x.k, &x.v, &sel);
        let end = att.clone().q_offset(tk).forward(&x.q, &x.k, &x.v, &sel);
        let (far, end) = (far.unwrap(), end.unwrap());
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(flat(&far.0), flat(&end.0), "min_len {min_len}");
        assert_eq!(
            flat(&far.1.unwrap()),
            flat(&end.1.unwrap()),
            "min_len {min_len}"
        );
    }
}

/// One failure is one error variant whichever entry point reaches it (issue: decided once):
/// a query head count that is not a multiple of the key heads is `Error::Shape` on `q` through
/// `forward`, `forward_varlen` and `forward_paged`, on the kernel and the fallback alike.
#[test]
fn one_failure_is_one_variant_on_every_entry_point() {
    use fp8nsa::nsa::PagedKv;
    let z = |d: &[usize]| Tensor::zeros(d, DType::F32, &Device::Cpu).unwrap();
    let (t, hq, hkv, d) = (8, 3, 2, 16);
    let ranges = ranges(vec![vec![[0, 4]]; t * hkv], 1, t, hkv);
    for min_len in [0, usize::MAX] {
        let att = SelectionAttention::new().min_len(min_len);
        let (q, k) = (z(&[1, t, hq, d]), z(&[1, t, hkv, d]));
        let dense = err_of(att.forward(&q, &k, &k, &ranges));
        let (qv, kv) = (z(&[t, hq, d]), z(&[t, hkv, d]));
        let cu = tensor_i32(vec![0, t as i32], &[2]);
        let varlen = err_of(att.forward_varlen(&qv, &kv, &kv, &cu, &cu, &ranges));
        let pool = z(&[1, t, hkv, d]);
        let table = tensor_i32(vec![0], &[1, 1]);
        let paged = PagedKv {
            k_pages: &pool,
            v_pages: &pool,
            block_table: &table,
            seq_lens: &[t],
        };
        let paged = err_of(att.forward_paged(&q, &paged, &ranges));
        for (what, e) in [("forward", dense), ("varlen", varlen), ("paged", paged)] {
            assert!(
                matches!(&e, Error::Shape { arg: "q", expected, .. } if expected.contains("multiple")),
                "{what}, min_len {min_len}: {e:?}"
            );
        }
    }
}

fn ranges(rows: Vec<Vec<[i32; 2]>>, b: usize, tq: usize, hkv: usize) -> SelectionRanges {
    SelectionRanges::new(ranges_rows(rows, b, tq, hkv)).unwrap()
}
