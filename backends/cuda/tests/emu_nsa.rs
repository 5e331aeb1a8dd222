//! The NSA selection plan, kernels included, run on the CPU emulator against the f64
//! reference: block and range selections for each group size and head dim, decode splits
//! merged by lse, varlen with chunked prefill, and adversarial selections. Outputs are
//! poisoned first. (`cargo test -p fp8nsa-cuda --features emu`; no GPU involved.)

use candle_core::{DType, Device, Tensor};
use fp8nsa_cuda::emu::{execute, HostBuf};
use fp8nsa_cuda::fp8::device_info_for;
use fp8nsa_cuda::nsa::{plan_selection, PageLayout, SelKind, SeqArrays};
use fp8nsa_cuda::step::Dtype;
use fp8nsa_ops::nsa::{BlockSelection, SelectionRanges};
use fp8nsa_ops::reference;
use fp8nsa_test_support::nsa::random_ranges;
use fp8nsa_test_support::{f64s, rng};
use fp8nsa_types::{AttnDims, Seq};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;
use rand_distr::{Distribution, Normal};

fn gaussian(rng: &mut StdRng, dims: &[usize], dtype: DType) -> Tensor {
    let n: usize = dims.iter().product();
    let d = Normal::new(0f32, 1.0).unwrap();
    let v: Vec<f32> = (0..n).map(|_| d.sample(rng)).collect();
    Tensor::from_vec(v, dims, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn bytes_of(t: &Tensor) -> HostBuf {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::BF16 => HostBuf::from_slice(&t.to_vec1::<half::bf16>().unwrap()),
        DType::F16 => HostBuf::from_slice(&t.to_vec1::<half::f16>().unwrap()),
        DType::I64 => HostBuf::from_slice(
            &t.to_dtype(DType::I64)
                .unwrap()
                .to_vec1::<i64>()
                .unwrap()
                .iter()
                .map(|&x| x as i32)
                .collect::<Vec<_>>(),
        ),
        other => panic!("{other:?}"),
    }
}

/// The selection of one sequence `[1, tq, hkv, ..]`, or several concatenated along tokens.
enum Sel {
    Blocks(BlockSelection),
    Ranges(SelectionRanges),
}

impl Sel {
    fn host(&self) -> HostBuf {
        let t = match self {
            Sel::Blocks(s) => s.indices(),
            Sel::Ranges(s) => s.ranges(),
        };
        HostBuf::from_slice(&t.flatten_all().unwrap().to_vec1::<i32>().unwrap())
    }

    fn kind(&self) -> SelKind {
        match self {
            Sel::Blocks(s) => SelKind::Blocks {
                per_row: s.dims()[3],
                block_size: s.block_size(),
            },
            Sel::Ranges(s) => SelKind::Ranges {
                per_row: s.dims()[3],
            },
        }
    }
}

struct SeqData {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sel: Sel,
    q_offset: usize,
}

/// Runs the packed sequences through the plan on the emulator: `o [Σtq, hq, dv]` and
/// `lse [Σtq, hq]`. `sms` sets how eagerly the plan splits; `expect_split` is checked.
fn run_plan(
    seqs: &[SeqData],
    hq: usize,
    hkv: usize,
    sms: u32,
    expect_split: bool,
    what: &str,
) -> (Vec<f64>, Vec<f32>) {
    run_plan_with(seqs, hq, hkv, sms, expect_split, what, None, false)
}

/// [`run_plan`]; with `pages` (a page size and a shuffle), each sequence's keys and values
/// are scattered over the pages of a pool in random order, the table's unused entries hold
/// ids the pool does not have, and the kernel reads them through the table. `corrupt` also
/// puts such ids in used entries (what a host check refuses; the kernel must clamp them).
#[allow(clippy::too_many_arguments)]
fn run_plan_with(
    seqs: &[SeqData],
    hq: usize,
    hkv: usize,
    sms: u32,
    expect_split: bool,
    what: &str,
    pages: Option<(usize, &mut StdRng)>,
    corrupt: bool,
) -> (Vec<f64>, Vec<f32>) {
    let (d, dv) = (seqs[0].q.dims()[3], seqs[0].v.dims()[3]);
    let dtype = match seqs[0].q.dtype() {
        DType::BF16 => Dtype::Bf16,
        _ => Dtype::F16,
    };
    let mut ks = Vec::new();
    let (mut qs, mut kk, mut vs, mut sels) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut tq, mut tk) = (0, 0);
    for s in seqs {
        let (q_len, k_len) = (s.q.dims()[1], s.k.dims()[1]);
        ks.push(Seq {
            q_start: tq,
            q_len,
            k_start: tk,
            k_len,
            q_offset: s.q_offset,
        });
        tq += q_len;
        tk += k_len;
        qs.push(s.q.squeeze(0).unwrap());
        kk.push(s.k.squeeze(0).unwrap());
        vs.push(s.v.squeeze(0).unwrap());
        sels.push(s.sel.host().to_vec::<i32>());
    }
    let cat = |v: &[Tensor]| bytes_of(&Tensor::cat(v, 0).unwrap());
    let (mut k_arg, mut v_arg) = (cat(&kk), cat(&vs));
    let mut table_arg = None;
    let layout = pages.map(|(ps, rng)| {
        let counts: Vec<usize> = ks.iter().map(|s| s.k_len.div_ceil(ps)).collect();
        let max_pages = counts.iter().max().unwrap() + 1;
        let num_pages = counts.iter().sum::<usize>() + 3;
        let mut ids: Vec<usize> = (0..num_pages).collect();
        ids.shuffle(rng);
        // pool row -> row of the packed keys, or the filler row past them
        let mut src = vec![tk as u32; num_pages * ps];
        let mut table = Vec::new();
        let mut next = ids.into_iter();
        for (s, &n) in ks.iter().zip(&counts) {
            for slot in 0..max_pages {
                if slot < n {
                    let page = next.next().unwrap();
                    for j in slot * ps..((slot + 1) * ps).min(s.k_len) {
                        src[page * ps + j % ps] = (s.k_start + j) as u32;
                    }
                    let bad = [-3, i32::MAX, num_pages as i32 + 5][slot % 3];
                    table.push(if corrupt && slot % 2 == 1 {
                        bad
                    } else {
                        page as i32
                    });
                } else {
                    table.push([-1, i32::MAX, num_pages as i32][slot % 3]);
                }
            }
        }
        let src = Tensor::from_vec(src, num_pages * ps, &Device::Cpu).unwrap();
        let pool = |parts: &[Tensor]| {
            let mut all = parts.to_vec();
            all.push(parts[0].narrow(0, 0, 1).unwrap()); // the filler: any finite row
            bytes_of(&Tensor::cat(&all, 0).unwrap().index_select(&src, 0).unwrap())
        };
        (k_arg, v_arg) = (pool(&kk), pool(&vs));
        table_arg = Some(HostBuf::from_slice(&table));
        PageLayout {
            num_pages,
            page_size: ps,
            max_pages,
        }
    });
    let arrays = if layout.is_some() {
        SeqArrays::paged(&ks).unwrap()
    } else {
        SeqArrays::new(&ks).unwrap()
    };
    let info = device_info_for((9, 0), sms, 227 * 1024).unwrap();
    let dims = AttnDims::new(hq, hkv, d, dv).unwrap();
    let scale = 1.0 / (d as f32).sqrt();
    let (p, plan) = plan_selection(
        &info,
        dims,
        &arrays,
        seqs[0].sel.kind(),
        dtype,
        scale,
        layout,
    )
    .unwrap();
    assert_eq!(p.splits > 1, expect_split, "{what}: {p:?}");
    let mut args = vec![
        cat(&qs),
        k_arg,
        v_arg,
        HostBuf::from_slice(&sels.concat()),
        HostBuf::from_slice(&arrays.cu_q),
        HostBuf::from_slice(&arrays.cu_k),
        HostBuf::from_slice(&arrays.q_off),
        HostBuf::new(tq * hq * dv * 2),
        HostBuf::new(tq * hq * 4),
    ];
    args.extend(table_arg);
    let mut refs: Vec<&mut HostBuf> = args.iter_mut().collect();
    execute(&plan, &mut refs).unwrap_or_else(|e| panic!("{what}: {e}"));
    let o: Vec<f64> = match dtype {
        Dtype::Bf16 => args[7]
            .to_vec::<half::bf16>()
            .into_iter()
            .map(|x| x.to_f64())
            .collect(),
        _ => args[7]
            .to_vec::<half::f16>()
            .into_iter()
            .map(|x| x.to_f64())
            .collect(),
    };
    (o, args[8].to_vec::<f32>())
}

/// [`run_plan`], and each sequence through the reference; compares o (rms ratio) and lse.
fn check(seqs: &[SeqData], hq: usize, hkv: usize, sms: u32, expect_split: bool, what: &str) {
    let dv = seqs[0].v.dims()[3];
    let (o, lse) = run_plan(seqs, hq, hkv, sms, expect_split, what);
    assert!(o.iter().all(|x| x.is_finite()), "{what}: unwritten o");
    assert!(lse.iter().all(|x| !x.is_nan()), "{what}: unwritten lse");
    let mut row = 0;
    for (i, s) in seqs.iter().enumerate() {
        let q_len = s.q.dims()[1];
        if q_len == 0 {
            continue;
        }
        let (want, want_lse) = match &s.sel {
            Sel::Blocks(b) => reference::nsa_selection(&s.q, &s.k, &s.v, b, None, Some(s.q_offset)),
            Sel::Ranges(r) => reference::nsa_selection(&s.q, &s.k, &s.v, r, None, Some(s.q_offset)),
        }
        .unwrap();
        let (want, want_lse) = (f64s(&want), f64s(&want_lse));
        let got = &o[row * hq * dv..(row + q_len) * hq * dv];
        let num: f64 = got.iter().zip(&want).map(|(a, b)| (a - b) * (a - b)).sum();
        let den: f64 = want.iter().map(|b| b * b).sum();
        let err = if den == 0.0 {
            num.sqrt()
        } else {
            (num / den).sqrt()
        };
        assert!(err < 5e-3, "{what} seq {i}: rms ratio {err:e}");
        for (j, (&a, &b)) in lse[row * hq..(row + q_len) * hq]
            .iter()
            .zip(&want_lse)
            .enumerate()
        {
            if b.is_infinite() {
                assert!(
                    a == f32::NEG_INFINITY,
                    "{what} seq {i}: lse[{j}] = {a}, want -inf"
                );
            } else {
                assert!(
                    (a as f64 - b).abs() < 2e-3 * (1.0 + b.abs()),
                    "{what} seq {i}: lse[{j}] = {a}, want {b}"
                );
            }
        }
        row += q_len;
    }
}

fn blocks(rng: &mut StdRng, tq: usize, hkv: usize, tk: usize, bs: usize, s: usize) -> Sel {
    let nb = tk.div_ceil(bs);
    let v: Vec<i32> = (0..tq * hkv)
        .flat_map(|_| {
            let mut ids: Vec<i32> = (0..nb as i32).collect();
            ids.shuffle(rng);
            let mut row = ids[..s.min(nb)].to_vec();
            row.resize(s, -1);
            row.shuffle(rng);
            row
        })
        .collect();
    Sel::Blocks(
        BlockSelection::new(
            Tensor::from_vec(v, (1, tq, hkv, s), &Device::Cpu).unwrap(),
            bs,
        )
        .unwrap(),
    )
}

fn ranges(rows: Vec<Vec<[i32; 2]>>, tq: usize, hkv: usize) -> Sel {
    let r = rows.iter().map(|x| x.len()).max().unwrap();
    let flat: Vec<i32> = rows
        .into_iter()
        .flat_map(|row| (0..r).flat_map(move |i| row.get(i).copied().unwrap_or([0, 0])))
        .collect();
    Sel::Ranges(
        SelectionRanges::new(Tensor::from_vec(flat, (1, tq, hkv, r, 2), &Device::Cpu).unwrap())
            .unwrap(),
    )
}

/// A prefill sequence of `t` tokens with `(hq, hkv)` heads of dims `(d, dv)`.
fn prefill(
    rng: &mut StdRng,
    t: usize,
    (hq, hkv): (usize, usize),
    (d, dv): (usize, usize),
    dtype: DType,
    sel: Sel,
) -> SeqData {
    SeqData {
        q: gaussian(rng, &[1, t, hq, d], dtype),
        k: gaussian(rng, &[1, t, hkv, d], dtype),
        v: gaussian(rng, &[1, t, hkv, dv], dtype),
        sel,
        q_offset: 0,
    }
}

#[test]
fn blocks_for_each_group_size_and_head_dim() {
    let mut rng = rng("emu_nsa_blocks");
    for (hq, hkv) in [(1, 1), (8, 2), (16, 1), (40, 2), (64, 1)] {
        for (d, dv) in [
            (64, 64),
            (128, 128),
            (192, 128),
            (64, 128),
            (128, 64),
            (192, 64),
        ] {
            let t = 70;
            let bs = if d == 64 { 16 } else { 32 };
            let sel = blocks(&mut rng, t, hkv, t, bs, 3);
            let s = prefill(&mut rng, t, (hq, hkv), (d, dv), DType::BF16, sel);
            check(
                &[s],
                hq,
                hkv,
                4,
                false,
                &format!("hq={hq} hkv={hkv} d={d} dv={dv}"),
            );
        }
    }
}

#[test]
fn several_ranges_per_query_at_any_alignment() {
    let mut rng = rng("emu_nsa_ranges");
    for (t, hq, hkv, n, dtype) in [
        (90, 4, 1, 1, DType::BF16),
        (111, 16, 2, 5, DType::F16),
        (77, 8, 1, 12, DType::BF16),
    ] {
        let rows = (0..t * hkv)
            .map(|_| random_ranges(&mut rng, t, n))
            .collect();
        let s = prefill(
            &mut rng,
            t,
            (hq, hkv),
            (128, 128),
            dtype,
            ranges(rows, t, hkv),
        );
        check(
            &[s],
            hq,
            hkv,
            4,
            false,
            &format!("t={t} ranges={n} {dtype:?}"),
        );
    }
}

#[test]
fn decode_splits_merge_by_lse() {
    let mut rng = rng("emu_nsa_decode");
    let (hq, hkv, tk) = (32, 2, 700);
    // four decode sequences on a device with many SMs: few rows, so each row is split
    let seqs: Vec<SeqData> = (0..4)
        .map(|_| {
            let sel = blocks(&mut rng, 1, hkv, tk, 32, 9);
            SeqData {
                q: gaussian(&mut rng, &[1, 1, hq, 128], DType::BF16),
                k: gaussian(&mut rng, &[1, tk, hkv, 128], DType::BF16),
                v: gaussian(&mut rng, &[1, tk, hkv, 128], DType::BF16),
                sel,
                q_offset: tk - 1,
            }
        })
        .collect();
    check(&seqs, hq, hkv, 132, true, "decode x4 split");
}

#[test]
fn varlen_chunked_prefill_and_empty_sequences() {
    let mut rng = rng("emu_nsa_varlen");
    let (hq, hkv, d) = (8, 2, 64);
    let mut seqs = Vec::new();
    for (tq, tk, q_offset) in [
        (20, 20, 0),
        (0, 30, 30),
        (1, 120, 119),
        (9, 100, 60),
        (3, 2, 0),
    ] {
        let sel = blocks(&mut rng, tq, hkv, tk.max(1), 16, 4);
        seqs.push(SeqData {
            q: gaussian(&mut rng, &[1, tq, hq, d], DType::BF16),
            k: gaussian(&mut rng, &[1, tk, hkv, d], DType::BF16),
            v: gaussian(&mut rng, &[1, tk, hkv, d], DType::BF16),
            sel,
            q_offset,
        });
    }
    check(&seqs, hq, hkv, 4, false, "varlen");
}

/// No entries per row (a zero-length selection buffer): every row empty, o = 0 and lse = -inf.
#[test]
fn no_entries_per_row() {
    let mut rng = rng("emu_nsa_no_entries");
    let (hq, hkv, d) = (4, 2, 64);
    let seqs = [SeqData {
        q: gaussian(&mut rng, &[1, 5, hq, d], DType::BF16),
        k: gaussian(&mut rng, &[1, 40, hkv, d], DType::BF16),
        v: gaussian(&mut rng, &[1, 40, hkv, d], DType::BF16),
        sel: blocks(&mut rng, 5, hkv, 40, 16, 0),
        q_offset: 35,
    }];
    check(&seqs, hq, hkv, 132, false, "no entries");
}

/// Whatever the indices say: nothing read out of bounds (the emulator's buffers end at an
/// inaccessible page), every key counted once, the reference's answer; empty rows 0 / -inf.
#[test]
fn adversarial_selections() {
    let mut rng = rng("emu_nsa_adversarial");
    let (t, hq, hkv, bs) = (100, 16, 1, 16);
    let nb = (t / bs) as i32;
    let rows: Vec<i32> = (0..t)
        .flat_map(|i| {
            let a = rng.random_range(0..nb);
            match i % 5 {
                0 => vec![a, a, a, -1],
                1 => vec![nb + 3, 10_000, i32::MAX, a],
                2 => vec![-5, -1, i32::MIN, a],
                3 => vec![a, (a + 1) % nb, a, -7],
                _ => vec![-1, -1, -1, -1],
            }
        })
        .collect();
    let sel = Sel::Blocks(
        BlockSelection::new(
            Tensor::from_vec(rows, (1, t, hkv, 4), &Device::Cpu).unwrap(),
            bs,
        )
        .unwrap(),
    );
    let s = prefill(&mut rng, t, (hq, hkv), (128, 128), DType::BF16, sel);
    check(&[s], hq, hkv, 4, false, "adversarial blocks");
    let rows = (0..t)
        .map(|i| {
            let i = i as i32;
            vec![
                [-50, 30],
                [20, 40],
                [i - 5, i + 1000],
                [t as i32 + 5, t as i32 + 100],
                [i32::MAX - 10, i32::MAX],
                [i32::MIN, i32::MIN + 5],
                [10, 10],
            ]
        })
        .collect();
    let s = prefill(
        &mut rng,
        t,
        (hq, hkv),
        (128, 128),
        DType::F16,
        ranges(rows, t, hkv),
    );
    check(&[s], hq, hkv, 4, false, "adversarial ranges");
}

/// docs/nsa.md "Non-finite values": a NaN query, a NaN / Inf key or a NaN / Inf value reaches the
/// queries that attend it (NaN) and no other (bit-exact with the same inputs made finite),
/// in one-pass prefill and in split decode merged by lse; the CPU kernel gives the pattern.
#[test]
fn non_finite_inputs_reach_only_the_queries_that_attend_them() {
    use fp8nsa_ops::nsa::SelectionAttention;
    let mut rng = rng("emu_nsa_non_finite");
    let (hq, hkv, d) = (16, 2, 64);
    let poke = |x: &Tensor, at: &[(usize, usize, f32)]| {
        let dims = x.dims().to_vec();
        let mut v: Vec<f32> = x
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for &(tok, head, val) in at {
            v[(tok * dims[2] + head) * dims[3] + 7] = val;
        }
        Tensor::from_vec(v, dims, &Device::Cpu)
            .unwrap()
            .to_dtype(x.dtype())
            .unwrap()
    };
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    // prefill of 80 with blocks of 16, and one decode query over 900 keys (split)
    let cases = [(80, 80, 4, false), (1, 900, 132, true)];
    for (inf_only, (tq, tk, sms, split)) in [true, false]
        .into_iter()
        .flat_map(|i| cases.map(|c| (i, c)))
    {
        let sel = blocks(&mut rng, tq, hkv, tk, 16, 3);
        let base = SeqData {
            q: gaussian(&mut rng, &[1, tq, hq, d], DType::BF16),
            k: gaussian(&mut rng, &[1, tk, hkv, d], DType::BF16),
            v: gaussian(&mut rng, &[1, tk, hkv, d], DType::BF16),
            sel,
            q_offset: tk - tq,
        };
        // NaN and +-Inf keys (an Inf element gives a score of +-inf or NaN; -inf must not
        // vanish as a zero weight); every poke in kv head 0, so kv head 1's queries are always
        // the clean control
        let mut keys = vec![
            (0, 0, nan),
            (tk / 2, 0, nan),
            (tk - 1, 0, nan),
            (tk / 3, 0, -inf),
            (tk / 4, 0, inf),
        ];
        keys.extend((0..tk).step_by(37).map(|j| (j, 0, nan)));
        let (q_pokes, v_pokes) = if inf_only {
            // one +Inf key element, in a block the last query's kv head 0 selected (it sees
            // every key): the heads whose q is negative there score it -inf, which without the
            // kernel's check would vanish as a zero weight instead of making the row NaN
            let Sel::Blocks(b) = &base.sel else {
                unreachable!()
            };
            let ids: Vec<i32> = b.indices().flatten_all().unwrap().to_vec1().unwrap();
            let mine = &ids[(tq - 1) * hkv * 3..(tq - 1) * hkv * 3 + 3];
            let picked: Vec<usize> = mine
                .iter()
                .filter(|&&i| i >= 0)
                .map(|&i| i as usize)
                .collect();
            keys = vec![(picked[0] * 16 + 1, 0, inf)];
            (vec![], vec![])
        } else {
            (vec![(tq - 1, 3, nan)], vec![(3, 0, nan), (tk - 20, 0, inf)])
        };
        let bad = SeqData {
            q: poke(&base.q, &q_pokes),
            k: poke(&base.k, &keys),
            v: poke(&base.v, &v_pokes),
            sel: match &base.sel {
                Sel::Blocks(b) => Sel::Blocks(b.clone()),
                Sel::Ranges(r) => Sel::Ranges(r.clone()),
            },
            q_offset: base.q_offset,
        };
        let what = format!("tq={tq} tk={tk} inf_only={inf_only}");
        let (o, lse) = run_plan(std::slice::from_ref(&bad), hq, hkv, sms, split, &what);
        let (o0, lse0) = run_plan(std::slice::from_ref(&base), hq, hkv, sms, split, &what);
        let Sel::Blocks(b) = &bad.sel else {
            unreachable!()
        };
        let (oc, lc) = SelectionAttention::new()
            .min_len(0)
            .with_lse(true)
            .forward(&bad.q, &bad.k, &bad.v, b)
            .unwrap();
        let oc = f64s(&oc);
        let lc = f64s(&lc.unwrap());
        let mut seen = [0usize; 2];
        for r in 0..tq * hq {
            let row = |x: &[f64]| x[r * d..(r + 1) * d].to_vec();
            let clean = row(&oc).iter().all(|x| x.is_finite());
            seen[clean as usize] += 1;
            let at = format!("{what}: token {} head {}", r / hq, r % hq);
            assert_eq!(row(&o).iter().all(|x| x.is_finite()), clean, "o, {at}");
            assert_eq!(lse[r].is_nan(), lc[r].is_nan(), "lse, {at}");
            if clean {
                assert_eq!(row(&o), row(&o0), "o, {at}");
                assert_eq!(lse[r].to_bits(), lse0[r].to_bits(), "lse, {at}");
            }
        }
        assert!(seen[0] > 0 && seen[1] > 0, "{what}: {seen:?}");
        if inf_only {
            // the last query's kv-head-0 rows attend an Inf key and nothing else non-finite
            for h in 0..hq / hkv {
                let r = (tq - 1) * hq + h;
                assert!(
                    o[r * d..(r + 1) * d].iter().all(|x| x.is_nan()),
                    "{what}: head {h}"
                );
                assert!(lse[r].is_nan(), "{what}: lse, head {h}");
            }
        }
    }
}

fn clone_sel(s: &Sel) -> Sel {
    match s {
        Sel::Blocks(b) => Sel::Blocks(b.clone()),
        Sel::Ranges(r) => Sel::Ranges(r.clone()),
    }
}

/// `n` distinct random tokens of `tk` per row, some rows padded with -1 or holding a
/// duplicate, as a block selection of one-token blocks (what `TokenSelection` is).
fn tokens(rng: &mut StdRng, tq: usize, hkv: usize, tk: usize, n: usize) -> Sel {
    let v: Vec<i32> = (0..tq * hkv)
        .flat_map(|r| {
            let mut ids: Vec<i32> = (0..tk as i32).collect();
            ids.shuffle(rng);
            let mut row = ids[..n.min(tk)].to_vec();
            row.resize(n, -1);
            match r % 3 {
                0 => row[n / 2] = -1,
                1 => row[n - 1] = row[0],
                _ => {}
            }
            row.shuffle(rng);
            row
        })
        .collect();
    Sel::Blocks(
        BlockSelection::new(
            Tensor::from_vec(v, (1, tq, hkv, n), &Device::Cpu).unwrap(),
            1,
        )
        .unwrap(),
    )
}

/// Token-level selection (DeepSeek-V3.2's DSA: one-token blocks, up to 2048 per row): decode
/// of 2048 tokens of 5000 keys (split) and prefill with 64 per row, against the reference.
#[test]
fn token_selection_up_to_2048_per_row() {
    let mut rng = rng("emu_nsa_tokens");
    let (hq, hkv, d) = (16, 1, 128);
    let tk = 5000;
    let sel = tokens(&mut rng, 1, hkv, tk, 2048);
    let s = SeqData {
        q: gaussian(&mut rng, &[1, 1, hq, d], DType::BF16),
        k: gaussian(&mut rng, &[1, tk, hkv, d], DType::BF16),
        v: gaussian(&mut rng, &[1, tk, hkv, d], DType::BF16),
        sel,
        q_offset: tk - 1,
    };
    check(&[s], hq, hkv, 132, true, "2048 tokens, decode");
    let t = 70;
    let sel = tokens(&mut rng, t, 2, t, 64);
    let s = prefill(&mut rng, t, (8, 2), (64, 64), DType::F16, sel);
    check(&[s], 8, 2, 4, false, "64 tokens per row, prefill");
}

/// Paged KV (docs/nsa.md): keys and values scattered over a shuffled page pool, pages of 1,
/// 16, 64 and 7 (which does not divide the blocks of 16), garbage in the table's unused
/// entries: o and lse are bit for bit those of the same call on packed keys, for blocks,
/// ranges and tokens, varlen prefill and split decode.
#[test]
fn paged_keys_equal_packed_keys_bit_for_bit() {
    let mut rng = rng("emu_nsa_paged");
    let (hq, hkv, d) = (16, 2, 64);
    let mk = |rng: &mut StdRng, tq: usize, tk: usize, sel: Sel| SeqData {
        q: gaussian(rng, &[1, tq, hq, d], DType::BF16),
        k: gaussian(rng, &[1, tk, hkv, d], DType::BF16),
        v: gaussian(rng, &[1, tk, hkv, d], DType::BF16),
        sel,
        q_offset: tk - tq,
    };
    let mut cases: Vec<(Vec<SeqData>, u32, bool, &str)> = Vec::new();
    let varlen = [(30, 30), (1, 300), (5, 77)]
        .map(|(tq, tk)| {
            let sel = blocks(&mut rng, tq, hkv, tk, 16, 5);
            mk(&mut rng, tq, tk, sel)
        })
        .into();
    cases.push((varlen, 4, false, "blocks, varlen"));
    let decode = [700, 129, 64]
        .map(|tk| {
            let sel = tokens(&mut rng, 1, hkv, tk, 40);
            mk(&mut rng, 1, tk, sel)
        })
        .into();
    cases.push((decode, 132, true, "tokens, decode x3"));
    let rows = (0..20 * hkv)
        .map(|_| random_ranges(&mut rng, 90, 4))
        .collect();
    let ranged = vec![mk(&mut rng, 20, 90, ranges(rows, 20, hkv))];
    cases.push((ranged, 4, false, "ranges, chunked prefill"));
    for (seqs, sms, split, what) in &cases {
        let (o, lse) = run_plan(seqs, hq, hkv, *sms, *split, what);
        for ps in [1, 16, 64, 7] {
            let what = format!("{what}, pages of {ps}");
            let (po, plse) = run_plan_with(
                seqs,
                hq,
                hkv,
                *sms,
                *split,
                &what,
                Some((ps, &mut rng)),
                false,
            );
            assert!(
                o.iter().zip(&po).all(|(a, b)| a.to_bits() == b.to_bits()),
                "o, {what}"
            );
            assert!(
                lse.iter()
                    .zip(&plse)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "lse, {what}"
            );
        }
    }
    // the packed calls themselves against the reference
    for (seqs, sms, split, what) in &cases {
        let seqs: Vec<SeqData> = seqs
            .iter()
            .map(|s| SeqData {
                q: s.q.clone(),
                k: s.k.clone(),
                v: s.v.clone(),
                sel: clone_sel(&s.sel),
                q_offset: s.q_offset,
            })
            .collect();
        check(&seqs, hq, hkv, *sms, *split, what);
    }
}

/// Page ids outside the pool in used table entries (negative, past the pool, i32::MAX): the
/// kernel clamps them into the pool, so it reads nothing out of bounds (the emulator's buffers
/// end at an inaccessible page) and writes every output finite.
#[test]
fn out_of_pool_page_ids_never_read_out_of_bounds() {
    let mut rng = rng("emu_nsa_bad_pages");
    let (hq, hkv, d) = (8, 1, 64);
    let seqs: Vec<SeqData> = [(1, 200), (4, 90)]
        .map(|(tq, tk)| {
            let sel = blocks(&mut rng, tq, hkv, tk, 16, 6);
            SeqData {
                q: gaussian(&mut rng, &[1, tq, hq, d], DType::BF16),
                k: gaussian(&mut rng, &[1, tk, hkv, d], DType::BF16),
                v: gaussian(&mut rng, &[1, tk, hkv, d], DType::BF16),
                sel,
                q_offset: tk - tq,
            }
        })
        .into();
    for ps in [16, 7] {
        let what = format!("corrupt table, pages of {ps}");
        let (o, lse) = run_plan_with(&seqs, hq, hkv, 4, true, &what, Some((ps, &mut rng)), true);
        assert!(o.iter().all(|x| x.is_finite()), "{what}: o");
        assert!(lse.iter().all(|x| !x.is_nan()), "{what}: lse");
    }
}
