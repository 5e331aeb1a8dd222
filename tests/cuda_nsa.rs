//! NSA selection attention on CUDA (`--features cuda`, needs a GPU; without one every test
//! says so and returns, or fails when `FP8NSA_REQUIRE_GPU=1`): the kernel and the GPU
//! fallback against the f64 reference for the CPU test list, decode splits, varlen, and
//! adversarial selections that must not crash and must compute what the reference computes
//! (each row clamped to the visible keys, each key once) while `validate()` reports them.
//! Which path ran is the returned `NsaPath`, so a silent fallback fails the kernel checks.
//!
//! `FP8NSA_REQUIRE_GPU=1 cargo test --release --features cuda --test cuda_nsa`

use candle_core::{DType, Device, Tensor};
use fp8nsa::nsa::{
    BlockSelection, NsaPath, PagedKv, SdpaReason, Selection, SelectionAttention, SelectionRanges,
    TokenSelection,
};
use fp8nsa::reference;
use fp8nsa_test_support::nsa::{check_lse, random_ranges, ranges_rows, rms_ratio};
use fp8nsa_test_support::resource::gpu;
use fp8nsa_test_support::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;

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

fn to(x: &Qkv, dev: &Device) -> Qkv {
    Qkv {
        q: x.q.to_device(dev).unwrap(),
        k: x.k.to_device(dev).unwrap(),
        v: x.v.to_device(dev).unwrap(),
    }
}

/// Whether the kernel takes these inputs, by the contract (independent of the library's own
/// check): bf16/f16, D in {64, 128, 192}, Dv in {64, 128}, up to 64 query heads per kv head.
fn kernel_takes(x: &Qkv) -> bool {
    let (d, dv) = (x.q.dims()[3], x.v.dims()[3]);
    let group = x.q.dims()[2] / x.k.dims()[2];
    x.q.dtype() != DType::F32
        && [64, 128, 192].contains(&d)
        && [64, 128].contains(&dv)
        && (1..=64).contains(&group)
}

/// The same selection with its tensor on `dev`.
enum OnDevice {
    Blocks(BlockSelection),
    Ranges(SelectionRanges),
}

fn on_device<'s>(sel: impl Into<Selection<'s>>, dev: &Device) -> OnDevice {
    match sel.into() {
        Selection::Blocks(b) => OnDevice::Blocks(
            BlockSelection::new(b.indices().to_device(dev).unwrap(), b.block_size()).unwrap(),
        ),
        Selection::Ranges(r) => {
            OnDevice::Ranges(SelectionRanges::new(r.ranges().to_device(dev).unwrap()).unwrap())
        }
    }
}

impl OnDevice {
    fn get(&self) -> Selection<'_> {
        match self {
            OnDevice::Blocks(b) => b.into(),
            OnDevice::Ranges(r) => r.into(),
        }
    }
}

/// Whether a returned path is the one a case expects.
type PathCheck<'a> = &'a dyn Fn(&NsaPath) -> bool;

/// The CUDA kernel (min_len 0; selection on the host, then on the GPU) and the GPU fallback
/// (min_len max) against the reference; each must log the path it is meant to take.
fn check<'s>(
    dev: &Device,
    x: &Qkv,
    sel: impl Into<Selection<'s>> + Copy,
    q_offset: Option<usize>,
    what: &str,
) {
    let tol = if x.q.dtype() == DType::F32 {
        1e-4
    } else {
        5e-3
    };
    let (want, want_lse) = reference::nsa_selection(&x.q, &x.k, &x.v, sel, None, q_offset).unwrap();
    let g = to(x, dev);
    let gpu_sel = on_device(sel, dev);
    let takes = kernel_takes(x);
    let kernel = move |p: &NsaPath| {
        if takes {
            *p == NsaPath::CudaKernel
        } else {
            matches!(p, NsaPath::Sdpa(SdpaReason::NoKernel(_)))
        }
    };
    let fallback = |p: &NsaPath| matches!(p, NsaPath::Sdpa(SdpaReason::BelowMinLen { .. }));
    let cases: [(&str, usize, Selection<'_>, PathCheck<'_>); 3] = [
        ("kernel", 0, sel.into(), &kernel),
        ("kernel, selection on the GPU", 0, gpu_sel.get(), &kernel),
        ("fallback", usize::MAX, gpu_sel.get(), &fallback),
    ];
    for (path, min_len, sel, expect) in cases {
        let mut att = SelectionAttention::new().min_len(min_len).with_lse(true);
        if let Some(o) = q_offset {
            att = att.q_offset(o);
        }
        let (o, lse, ran) = att
            .forward_with_path(&g.q, &g.k, &g.v, sel)
            .unwrap_or_else(|e| panic!("{what} {path}: {e}"));
        assert!(expect(&ran), "{what} {path}: the path that ran was {ran:?}");
        assert!(o.device().is_cuda(), "{what} {path}");
        assert_eq!(
            (o.dims(), o.dtype()),
            (want.dims(), x.q.dtype()),
            "{what} {path}"
        );
        let err = rms_ratio(&o, &want);
        assert!(err < tol, "{what} {path}: rms ratio {err:e}");
        check_lse(&lse.unwrap(), &want_lse, 2e-3, &format!("{what} {path}"));
    }
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
        .flat_map(|_| {
            let mut ids: Vec<i32> = (0..nb as i32).collect();
            ids.shuffle(rng);
            let mut row: Vec<i32> = ids[..s.min(nb)].to_vec();
            row.resize(s, -1);
            row.shuffle(rng);
            row
        })
        .collect();
    BlockSelection::new(
        Tensor::from_vec(v, (b, tq, hkv, s), &Device::Cpu).unwrap(),
        bs,
    )
    .unwrap()
}

#[test]
fn several_ranges_per_query_at_any_alignment() {
    let Some(dev) = gpu("ranges") else { return };
    let mut rng = rng("cuda_ranges");
    for (b, t, hq, hkv, n) in [(1, 96, 4, 1, 1), (2, 200, 8, 2, 5), (1, 333, 16, 1, 12)] {
        let x = qkv(&mut rng, b, t, t, hq, hkv, 128, 128, DType::BF16);
        let rows = (0..b * t * hkv)
            .map(|_| random_ranges(&mut rng, t, n))
            .collect();
        check(
            &dev,
            &x,
            &ranges(rows, b, t, hkv),
            None,
            &format!("b={b} t={t} ranges={n}"),
        );
    }
}

#[test]
fn random_blocks_for_each_group_size_and_head_dim() {
    let Some(dev) = gpu("blocks") else { return };
    let mut rng = rng("cuda_blocks");
    for (hq, hkv) in [(1, 1), (4, 2), (16, 1), (34, 2), (32, 1), (64, 1), (64, 4)] {
        for (d, dv) in [
            (64, 64),
            (64, 128),
            (128, 64),
            (128, 128),
            (192, 64),
            (192, 128),
        ] {
            for bs in [16, 64] {
                let t = 300;
                let x = qkv(&mut rng, 1, t, t, hq, hkv, d, dv, DType::BF16);
                let sel = block_selection(&mut rng, 1, t, hkv, t, bs, 4);
                check(
                    &dev,
                    &x,
                    &sel,
                    None,
                    &format!("hq={hq} hkv={hkv} d={d} dv={dv} bs={bs}"),
                );
            }
        }
    }
}

#[test]
fn block_aligned_ranges_equal_the_blocks() {
    let Some(dev) = gpu("block_ranges") else {
        return;
    };
    let mut rng = rng("cuda_block_ranges");
    let x = qkv(&mut rng, 2, 130, 130, 16, 2, 64, 64, DType::F16);
    let sel = block_selection(&mut rng, 2, 130, 2, 130, 32, 3);
    let ranges = sel.to_ranges().unwrap();
    check(&dev, &x, &sel, None, "f16 blocks");
    check(&dev, &x, &ranges, None, "f16 block-aligned ranges");
    let g = to(&x, &dev);
    let att = SelectionAttention::new().min_len(0);
    let (a, _) = att.forward(&g.q, &g.k, &g.v, &sel).unwrap();
    let (b, _) = att.forward(&g.q, &g.k, &g.v, &ranges).unwrap();
    assert_eq!(rms_ratio(&a, &b), 0.0);
}

#[test]
fn bf16_and_f16_inputs() {
    let Some(dev) = gpu("half_inputs") else {
        return;
    };
    let mut rng = rng("cuda_half_inputs");
    for dtype in [DType::BF16, DType::F16] {
        let (b, t, hq, hkv) = (1, 150, 8, 2);
        let x = qkv(&mut rng, b, t, t, hq, hkv, 128, 64, dtype);
        let sel = block_selection(&mut rng, b, t, hkv, t, 16, 5);
        check(&dev, &x, &sel, None, &format!("{dtype:?}"));
    }
}

/// The case the original Triton kernel could not compile, and adjacent / padding ranges.
#[test]
fn fixed_mixed_alignment_and_padding_ranges() {
    let Some(dev) = gpu("mixed_ranges") else {
        return;
    };
    let mut rng = rng("cuda_mixed_ranges");
    let (b, t, hq, hkv) = (1, 160, 4, 1);
    let x = qkv(&mut rng, b, t, t, hq, hkv, 128, 128, DType::BF16);
    let fixed = vec![vec![[0, 16], [32, 48], [64, 80]]; b * t * hkv];
    check(
        &dev,
        &x,
        &ranges(fixed, b, t, hkv),
        None,
        "[[0,16],[32,48],[64,80]]",
    );
    let (b, t, hq, hkv) = (2, 130, 8, 2);
    let x = qkv(&mut rng, b, t, t, hq, hkv, 64, 64, DType::F16);
    let rows = (0..b * t * hkv)
        .map(|i| match i % 3 {
            0 => vec![[0, 64], [64, 128]],
            1 => random_ranges(&mut rng, t, 3),
            _ => vec![[5, 5], [17, 29], [1000, 999]],
        })
        .collect();
    check(&dev, &x, &ranges(rows, b, t, hkv), None, "mixed");
}

/// A varlen sequence with no keys, and a selection with no entries per row: zero rows and
/// -inf lse on both paths, no crash on zero-sized buffers.
#[test]
fn no_keys_or_no_selected_entries() {
    let Some(dev) = gpu("degenerate") else {
        return;
    };
    let mut rng = rng("cuda_degenerate");
    let (hq, hkv, d) = (4, 2, 64);
    let h = |n: usize, dims: (usize, usize, usize), rng: &mut StdRng| {
        tensor(gaussian(rng, n), &[dims.0, dims.1, dims.2])
            .to_dtype(DType::BF16)
            .unwrap()
            .to_device(&dev)
            .unwrap()
    };
    let q = h(3 * hq * d, (3, hq, d), &mut rng);
    let k = h(5 * hkv * d, (5, hkv, d), &mut rng);
    let v = h(5 * hkv * d, (5, hkv, d), &mut rng);
    let cu = |v: Vec<u32>| Tensor::new(v, &dev).unwrap();
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
        let o: Vec<Vec<Vec<f32>>> = o.to_dtype(DType::F32).unwrap().to_vec3().unwrap();
        let lse: Vec<Vec<f32>> = lse.unwrap().to_vec2().unwrap();
        assert!(
            o[2].iter().flatten().all(|&x| x == 0.0),
            "min_len {min_len}: keyless rows"
        );
        assert!(lse[2].iter().all(|&x| x == f32::NEG_INFINITY));
        assert!(o[..2].iter().flatten().flatten().all(|x| x.is_finite()));
        assert!(lse[0].iter().all(|x| x.is_finite()));
    }
    let x = qkv(&mut rng, 1, 4, 8, 4, 2, 64, 64, DType::BF16);
    let g = to(&x, &dev);
    let none = BlockSelection::new(
        Tensor::zeros((1, 4, 2, 0), DType::I32, &Device::Cpu).unwrap(),
        4,
    )
    .unwrap();
    for min_len in [0, usize::MAX] {
        let (o, lse) = SelectionAttention::new()
            .min_len(min_len)
            .with_lse(true)
            .forward(&g.q, &g.k, &g.v, &none)
            .unwrap_or_else(|e| panic!("no entries, min_len {min_len}: {e}"));
        let sum = o
            .to_dtype(DType::F32)
            .unwrap()
            .abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(sum, 0.0, "no entries, min_len {min_len}");
        let lse: Vec<f32> = lse.unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert!(lse.iter().all(|&x| x == f32::NEG_INFINITY));
    }
}

/// Bad shapes and arguments on CUDA tensors are errors, not crashes.
#[test]
fn shape_and_argument_errors() {
    let Some(dev) = gpu("shape_errors") else {
        return;
    };
    let mut rng = rng("cuda_shape_errors");
    let x = to(&qkv(&mut rng, 1, 4, 16, 4, 2, 64, 64, DType::BF16), &dev);
    let sel = block_selection(&mut rng, 1, 4, 2, 16, 4, 2);
    let att = SelectionAttention::new().min_len(0);
    let wrong = block_selection(&mut rng, 1, 3, 2, 16, 4, 2);
    assert!(att.forward(&x.q, &x.k, &x.v, &wrong).is_err());
    let q3 = Tensor::zeros((1, 4, 3, 64), DType::BF16, &dev).unwrap();
    assert!(att.forward(&q3, &x.k, &x.v, &sel).is_err());
    let kf = x.k.to_dtype(DType::F16).unwrap();
    assert!(att.forward(&x.q, &kf, &x.v, &sel).is_err());
    // k on the host, q on the GPU
    let kh = x.k.to_device(&Device::Cpu).unwrap();
    assert!(att.forward(&x.q, &kh, &x.v, &sel).is_err());
    // Tq > Tk without an explicit offset
    let long = to(&qkv(&mut rng, 1, 20, 16, 4, 2, 64, 64, DType::BF16), &dev);
    let sel20 = block_selection(&mut rng, 1, 20, 2, 16, 4, 2);
    let e = att.forward(&long.q, &long.k, &long.v, &sel20).unwrap_err();
    assert!(
        matches!(
            e,
            fp8nsa::Error::Invalid {
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
}

#[test]
fn decode_and_chunked_prefill_with_q_offset() {
    let Some(dev) = gpu("decode_chunked") else {
        return;
    };
    let mut rng = rng("cuda_decode_chunked");
    for (b, tq, tk, q_offset) in [
        (2, 1, 500, None),
        (2, 7, 300, None),
        (2, 5, 300, Some(100)),
        (1, 3, 2, Some(0)),
    ] {
        let x = qkv(&mut rng, b, tq, tk, 16, 1, 128, 128, DType::BF16);
        let sel = block_selection(&mut rng, b, tq, 1, tk, 64, 3);
        check(
            &dev,
            &x,
            &sel,
            q_offset,
            &format!("tq={tq} tk={tk} q_offset={q_offset:?}"),
        );
        let rows = (0..b * tq)
            .map(|_| random_ranges(&mut rng, tk, 2))
            .collect();
        check(
            &dev,
            &x,
            &ranges(rows, b, tq, 1),
            q_offset,
            &format!("ranges tq={tq} tk={tk}"),
        );
    }
}

/// Decode with few rows splits each row's spans over several blocks, merged by lse.
#[test]
fn decode_batch_splits_and_merges() {
    let Some(dev) = gpu("decode_split") else {
        return;
    };
    let mut rng = rng("cuda_decode_split");
    let (b, tk, hq, hkv) = (16, 5000, 64, 4);
    let x = qkv(&mut rng, b, 1, tk, hq, hkv, 128, 128, DType::BF16);
    let sel = block_selection(&mut rng, b, 1, hkv, tk, 64, 16);
    check(&dev, &x, &sel, None, "decode b=16 tk=5000 (split)");
    // and the same through the backend, which reports the split
    let stream = dev.as_cuda_device().unwrap().cuda_stream();
    let info = fp8nsa::cuda::device_info(&stream).unwrap();
    let plan = fp8nsa::cuda::nsa::plan(
        &info,
        128,
        128,
        16,
        16,
        b * hkv,
        fp8nsa::cuda::nsa::max_tiles(16, Some(64), tk),
    )
    .unwrap();
    assert!(plan.splits > 1, "{plan:?}");
}

#[test]
fn empty_rows_and_all_padding() {
    let Some(dev) = gpu("empty_rows") else { return };
    let mut rng = rng("cuda_empty_rows");
    let (b, t, hq, hkv, d) = (1, 40, 4, 1, 64);
    let x = qkv(&mut rng, b, t, t, hq, hkv, d, d, DType::BF16);
    let rows = (0..t)
        .map(|i| {
            if i % 2 == 0 {
                vec![[30, 40]]
            } else {
                vec![[3, 3]]
            }
        })
        .collect();
    check(&dev, &x, &ranges(rows, b, t, hkv), None, "empty rows");
    let all_pad = BlockSelection::new(
        Tensor::full(-1i32, (b, t, hkv, 3), &Device::Cpu).unwrap(),
        16,
    )
    .unwrap();
    check(&dev, &x, &all_pad, None, "all -1");
}

#[test]
fn varlen_matches_each_sequence_alone() {
    let Some(dev) = gpu("varlen") else { return };
    let mut rng = rng("cuda_varlen");
    let (hq, hkv, d) = (8, 2, 64);
    let lens = [(40, 40), (1, 250), (17, 120), (0, 30)];
    let parts: Vec<(Qkv, BlockSelection)> = lens
        .iter()
        .map(|&(tq, tk)| {
            (
                qkv(&mut rng, 1, tq, tk, hq, hkv, d, d, DType::BF16),
                block_selection(&mut rng, 1, tq, hkv, tk, 16, 4),
            )
        })
        .collect();
    let cat = |f: &dyn Fn(&Qkv) -> Tensor| {
        Tensor::cat(
            &parts
                .iter()
                .map(|(x, _)| f(x).squeeze(0).unwrap())
                .collect::<Vec<_>>(),
            0,
        )
        .unwrap()
        .to_device(&dev)
        .unwrap()
    };
    let (q, k, v) = (
        cat(&|x| x.q.clone()),
        cat(&|x| x.k.clone()),
        cat(&|x| x.v.clone()),
    );
    let idx = Tensor::cat(
        &parts
            .iter()
            .map(|(_, s)| s.indices().clone())
            .collect::<Vec<_>>(),
        1,
    )
    .unwrap();
    let sel = BlockSelection::new(idx, 16).unwrap();
    let cu = |f: fn(&(usize, usize)) -> usize| {
        let mut acc = 0u32;
        let v: Vec<u32> = std::iter::once(0)
            .chain(lens.iter().map(|l| {
                acc += f(l) as u32;
                acc
            }))
            .collect();
        Tensor::new(v, &dev).unwrap()
    };
    let (cq, ck) = (cu(|l| l.0), cu(|l| l.1));
    for min_len in [0, usize::MAX] {
        let (o, lse, ran) = SelectionAttention::new()
            .min_len(min_len)
            .with_lse(true)
            .forward_varlen_with_path(&q, &k, &v, &cq, &ck, &sel)
            .unwrap();
        if min_len == 0 {
            assert_eq!(ran, NsaPath::CudaKernel, "varlen min_len={min_len}");
        } else {
            assert!(
                matches!(ran, NsaPath::Sdpa(SdpaReason::BelowMinLen { .. })),
                "varlen min_len={min_len}: {ran:?}"
            );
        }
        let mut start = 0;
        for ((x, s), (tq, _)) in parts.iter().zip(lens) {
            if tq == 0 {
                continue;
            }
            let (want, want_lse) =
                reference::nsa_selection(&x.q, &x.k, &x.v, s, None, None).unwrap();
            let got = o.narrow(0, start, tq).unwrap().unsqueeze(0).unwrap();
            assert!(
                rms_ratio(&got, &want) < 5e-3,
                "varlen min_len={min_len} seq at {start}"
            );
            check_lse(
                &lse.as_ref().unwrap().narrow(0, start, tq).unwrap(),
                &want_lse,
                2e-3,
                "varlen lse",
            );
            start += tq;
        }
    }
}

/// Out-of-range, negative, duplicated and overlapping entries: no crash, the reference's
/// answer (each row clamped to the visible keys, each key once), and `validate()` says why.
#[test]
fn adversarial_selections() {
    let Some(dev) = gpu("adversarial") else {
        return;
    };
    let mut rng = rng("cuda_adversarial");
    let (b, t, hq, hkv, bs) = (1, 200, 16, 1, 16);
    let x = qkv(&mut rng, b, t, t, hq, hkv, 128, 128, DType::BF16);
    let nb = (t / bs) as i32;
    let rows: Vec<Vec<i32>> = (0..t)
        .map(|_| {
            let a = rng.random_range(0..nb);
            match rng.random_range(0..5) {
                0 => vec![a, a, a, -1],                 // duplicates
                1 => vec![nb + 3, 10_000, i32::MAX, a], // past tk
                2 => vec![-5, -1, i32::MIN, a],         // negative
                3 => vec![a, (a + 1) % nb, a, -7],      // duplicate and negative
                _ => vec![-1, -1, -1, -1],              // nothing
            }
        })
        .collect();
    let flat: Vec<i32> = rows.concat();
    let sel = BlockSelection::new(
        Tensor::from_vec(flat, (b, t, hkv, 4), &Device::Cpu).unwrap(),
        bs,
    )
    .unwrap();
    assert!(
        sel.validate(t).is_err(),
        "validate must report the bad entries"
    );
    check(&dev, &x, &sel, None, "adversarial blocks");
    let rows: Vec<Vec<[i32; 2]>> = (0..t)
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
    let sel = ranges(rows, b, t, hkv);
    assert!(sel.validate(t).is_err());
    check(&dev, &x, &sel, None, "adversarial ranges");
}

/// What the kernel does not take runs the GPU fallback: f32 inputs, an unsupported head dim.
#[test]
fn fallbacks_on_the_gpu() {
    let Some(dev) = gpu("fallbacks") else { return };
    let mut rng = rng("cuda_fallbacks");
    let x = qkv(&mut rng, 1, 100, 100, 8, 2, 64, 64, DType::F32);
    check(
        &dev,
        &x,
        &block_selection(&mut rng, 1, 100, 2, 100, 16, 3),
        None,
        "f32",
    );
    let x = qkv(&mut rng, 1, 100, 100, 8, 2, 96, 80, DType::BF16);
    check(
        &dev,
        &x,
        &block_selection(&mut rng, 1, 100, 2, 100, 16, 3),
        None,
        "d=96 dv=80",
    );
}

/// The backend with o and lse poisoned: every element written.
#[test]
fn backend_writes_every_element() {
    let Some(dev) = gpu("poisoned") else { return };
    use fp8nsa::cuda::nsa::{selection_attention, Selection as Sel};
    use fp8nsa::types::{AttnDims, Seq};
    let mut rng = rng("cuda_nsa_poisoned");
    let stream = dev.as_cuda_device().unwrap().cuda_stream();
    let (tq, tk, hq, hkv, d) = (33, 257, 20, 2, 64); // G = 10: padded MMA rows
    let h = |n: usize, rng: &mut StdRng| {
        gaussian(rng, n)
            .into_iter()
            .map(half::bf16::from_f32)
            .collect::<Vec<_>>()
    };
    let q = stream.clone_htod(&h(tq * hq * d, &mut rng)).unwrap();
    let k = stream.clone_htod(&h(tk * hkv * d, &mut rng)).unwrap();
    let v = stream.clone_htod(&h(tk * hkv * d, &mut rng)).unwrap();
    let idx: Vec<i32> = (0..tq * hkv * 3).map(|i| (i % 17) as i32 - 1).collect();
    let idx = stream.clone_htod(&idx).unwrap();
    let mut o = stream
        .clone_htod(&vec![half::bf16::NAN; tq * hq * d])
        .unwrap();
    let mut lse = stream.clone_htod(&vec![f32::NAN; tq * hq]).unwrap();
    let seqs = [Seq {
        q_start: 0,
        q_len: tq,
        k_start: 0,
        k_len: tk,
        q_offset: tk - tq,
    }];
    let sel = Sel::Blocks {
        indices: idx.as_view(),
        per_row: 3,
        block_size: 16,
    };
    selection_attention(
        &stream,
        &q.as_view(),
        &k.as_view(),
        &v.as_view(),
        &sel,
        &seqs,
        AttnDims::new(hq, hkv, d, d).unwrap(),
        0.125,
        &mut o.as_view_mut(),
        &mut lse.as_view_mut(),
    )
    .unwrap();
    let o = stream.clone_dtoh(&o).unwrap();
    let lse = stream.clone_dtoh(&lse).unwrap();
    assert!(o.iter().all(|x| !x.is_nan()), "unwritten o");
    assert!(lse.iter().all(|x| !x.is_nan()), "unwritten lse");
}

/// `n` distinct random tokens below `len` per row, `-1` past them.
fn token_rows(rng: &mut StdRng, rows: usize, len: usize, n: usize) -> Vec<i32> {
    (0..rows)
        .flat_map(|_| {
            let mut t: Vec<i32> = (0..len as i32).collect();
            t.shuffle(rng);
            t.truncate(n);
            t.resize(n, -1);
            t
        })
        .collect()
}

/// A server's decode step on the GPU (issue 19): sequences of mixed lengths whose keys lie in
/// a shuffled page pool (pages of 16, and of 7, which divides no block), one and three queries
/// each, blocks and tokens: the kernel reads the pages in place (`NsaPath::CudaKernel`) and
/// matches the CPU kernel on the same pool. Then DSA-sized token selection (2048 of 6000
/// keys per query) against the reference.
#[test]
fn paged_kv_and_token_selection() {
    let Some(dev) = gpu("paged_kv_and_token_selection") else {
        return;
    };
    let mut rng = rng("cuda_paged");
    let (hq, hkv, d) = (16, 2, 64);
    let lens = [300usize, 33, 5, 129];
    let b = lens.len();
    let host = Device::Cpu;
    for (ps, tq) in [(16, 1), (7, 3)] {
        let need: Vec<usize> = lens.iter().map(|l| l.div_ceil(ps)).collect();
        let max_pages = need.iter().max().unwrap() + 1;
        let total = need.iter().sum::<usize>() + 2;
        let mut ids: Vec<i32> = (0..total as i32).collect();
        ids.shuffle(&mut rng);
        let mut table = Vec::new();
        let mut next = 0;
        for &n in &need {
            let mut r = ids[next..next + n].to_vec();
            next += n;
            r.resize(max_pages, -1);
            table.extend(r);
        }
        let table = Tensor::from_vec(table, (b, max_pages), &host).unwrap();
        let pool = |rng: &mut StdRng| {
            tensor(gaussian(rng, total * ps * hkv * d), &[total, ps, hkv, d])
                .to_dtype(DType::BF16)
                .unwrap()
        };
        let (kp, vp) = (pool(&mut rng), pool(&mut rng));
        let q = tensor(gaussian(&mut rng, b * tq * hq * d), &[b, tq, hq, d])
            .to_dtype(DType::BF16)
            .unwrap();
        let mut blocks = Vec::new();
        let mut toks = Vec::new();
        for &l in &lens {
            for _ in 0..tq * hkv {
                let mut bl: Vec<i32> = (0..l.div_ceil(32) as i32).collect();
                bl.shuffle(&mut rng);
                bl.resize(3.min(bl.len()), -1);
                bl.resize(3, -1);
                blocks.extend(bl);
            }
            toks.extend(token_rows(&mut rng, tq * hkv, l, 40));
        }
        let bsel = BlockSelection::new(
            Tensor::from_vec(blocks, (b, tq, hkv, 3), &host).unwrap(),
            32,
        )
        .unwrap();
        let tsel =
            TokenSelection::new(Tensor::from_vec(toks, (b, tq, hkv, 40), &host).unwrap()).unwrap();
        let (gk, gv, gt, gq) = (
            kp.to_device(&dev).unwrap(),
            vp.to_device(&dev).unwrap(),
            table.to_device(&dev).unwrap(),
            q.to_device(&dev).unwrap(),
        );
        for (kind, sel) in [
            ("blocks", Selection::from(&bsel)),
            ("tokens", Selection::from(&tsel)),
        ] {
            let what = format!("pages of {ps}, tq {tq}, {kind}");
            let att = SelectionAttention::new().min_len(0).with_lse(true);
            let on_cpu = PagedKv {
                k_pages: &kp,
                v_pages: &vp,
                block_table: &table,
                seq_lens: &lens,
            };
            let (want, want_lse, _) = att.forward_paged_with_path(&q, &on_cpu, sel).unwrap();
            let on_gpu = PagedKv {
                k_pages: &gk,
                v_pages: &gv,
                block_table: &gt,
                seq_lens: &lens,
            };
            let (o, lse, path) = att
                .forward_paged_with_path(&gq, &on_gpu, sel)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(path, NsaPath::CudaKernel, "{what}");
            let err = rms_ratio(&o, &want);
            assert!(err < 5e-3, "{what}: rms ratio {err:e}");
            check_lse(&lse.unwrap(), &want_lse.unwrap(), 2e-3, &what);
        }
    }
    let x = qkv(&mut rng, 2, 1, 6000, 16, 1, 128, 128, DType::BF16);
    let rows = token_rows(&mut rng, 2, 6000, 2048);
    let tsel =
        TokenSelection::new(Tensor::from_vec(rows, (2, 1, 1, 2048), &host).unwrap()).unwrap();
    check(&dev, &x, &tsel, None, "2048 tokens of 6000");
}

fn ranges(rows: Vec<Vec<[i32; 2]>>, b: usize, tq: usize, hkv: usize) -> SelectionRanges {
    SelectionRanges::new(ranges_rows(rows, b, tq, hkv)).unwrap()
}
