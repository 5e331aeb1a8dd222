//! CPU `Fp8Linear` against the f64 reference on the contract's sweep, plus quantization bounds,
//! errors and loading from the Hugging Face layout.

use candle_core::{DType, Device, Module, Tensor};
use fp8nsa::cpu::Tier;
use fp8nsa::fp8::{bf16_tile_min_m, CpuFp8Kernel, CpuFp8Path, GEMV_MAX_M};
use fp8nsa::{reference, ActQuant, Error, Fp8BlockWeight, Fp8Linear, Fp8Path};
use fp8nsa_test_support::*;
use rand::rngs::StdRng;
use rand::Rng;

fn tol(dtype: DType) -> f64 {
    if dtype == DType::F32 {
        1e-3
    } else {
        8e-3
    }
}

/// Runs the layer on all `m` rows and compares rows `check` (whole `bm` blocks for Block2d, so
/// the reference sees the same activation blocks) with the reference.
#[allow(clippy::too_many_arguments)]
fn check_case(
    rng: &mut StdRng,
    m: usize,
    n: usize,
    k: usize,
    block: [usize; 2],
    act: ActQuant,
    dtype: DType,
    check: std::ops::Range<usize>,
    with_bias: bool,
) {
    let w = tensor(hetero(rng, n, k, block[0], block[1]), &[n, k]);
    let wq = Fp8BlockWeight::quantize(&w, block).unwrap();
    let bias = with_bias.then(|| tensor(gaussian(rng, n), &[n]));
    // f16 tops out at 65504: keep its products in range
    let x_mag = if dtype == DType::F16 { 1e-4 } else { 1.0 };
    let x = (tensor(hetero(rng, m, k, 1, block[1]), &[m, k]) * x_mag)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let layer = Fp8Linear::new(wq.clone(), bias.clone(), act).unwrap();
    let y = layer.forward(&x).unwrap();
    assert_eq!((y.dims(), y.dtype()), (&[m, n][..], dtype));
    let xs = x.narrow(0, check.start, check.len()).unwrap();
    let want = reference::fp8_linear(&xs, &wq, bias.as_ref(), act).unwrap();
    let got = y.narrow(0, check.start, check.len()).unwrap();
    let err = rel_frobenius(&got, &want);
    assert!(
        err < tol(dtype),
        "m={m} n={n} k={k} block={block:?} act={act:?} {dtype:?}: rel err {err:e}"
    );
}

/// Rows compared with the reference: all of them, except the last 128-row window for M = 512.
fn checked_rows(m: usize) -> std::ops::Range<usize> {
    if m > 128 {
        m - 128..m
    } else {
        0..m
    }
}

#[test]
fn sweep_576x3884_all_blocks_modes_dtypes() {
    let mut rng = rng("sweep_576x3884");
    let (n, k) = (576, 3884);
    for block in [[128, 128], [256, 256], [512, 512], [64, 128]] {
        for act in [
            ActQuant::None,
            ActQuant::Group,
            ActQuant::Block2d { bm: 64 },
        ] {
            for dtype in [DType::F32, DType::BF16] {
                for m in [1, 7, 8, 83, 512] {
                    let bias = m % 2 == 1;
                    check_case(&mut rng, m, n, k, block, act, dtype, checked_rows(m), bias);
                }
            }
        }
    }
}

#[test]
fn sweep_2112x7168() {
    let mut rng = rng("sweep_2112x7168");
    for dtype in [DType::F32, DType::BF16] {
        for m in [1, 8, 83] {
            check_case(
                &mut rng,
                m,
                2112,
                7168,
                [128, 128],
                ActQuant::Group,
                dtype,
                0..m,
                false,
            );
        }
        check_case(
            &mut rng,
            512,
            2112,
            7168,
            [128, 128],
            ActQuant::Block2d { bm: 128 },
            dtype,
            384..512,
            true,
        );
    }
}

#[test]
fn small_and_odd_shapes() {
    let mut rng = rng("small_and_odd_shapes");
    // blocks larger than the matrix, single elements, few-panel GEMM (small N, large M), f16
    for (m, n, k, block) in [
        (1, 1, 1, [128, 128]),
        (3, 5, 7, [128, 128]),
        (17, 3, 300, [2, 3]),
        (83, 40, 300, [16, 128]),
        (300, 24, 129, [8, 64]),
    ] {
        for act in [ActQuant::None, ActQuant::Group, ActQuant::Block2d { bm: 5 }] {
            for dtype in [DType::F32, DType::F16] {
                check_case(&mut rng, m, n, k, block, act, dtype, 0..m, true);
            }
        }
    }
}

/// The kernel is chosen once per call by the CPU plan and returned: the GEMV up to
/// `GEMV_MAX_M` rows (counting every leading dim), the panel GEMM past it; both match the
/// reference, and `forward` gives the same bytes as `forward_with_path`.
#[test]
fn the_path_taken_is_returned() {
    let mut rng = rng("the_path_taken_is_returned");
    let (n, k, block) = (576, 3884, [128, 128]);
    let w = tensor(hetero(&mut rng, n, k, block[0], block[1]), &[n, k]);
    let wq = Fp8BlockWeight::quantize(&w, block).unwrap();
    let layer = Fp8Linear::new(wq.clone(), None, ActQuant::Group).unwrap();
    let gemv_max = GEMV_MAX_M;
    for (dims, want) in [
        (vec![1, k], CpuFp8Kernel::Gemv),
        (vec![2, 4, k], CpuFp8Kernel::Gemv),
        // 16 rows: the GEMV, but the panel GEMM's one-tile micro-kernel on AVX512-BF16
        (vec![2, 8, k], CpuFp8Kernel::Gemv),
        (vec![gemv_max + 1, k], CpuFp8Kernel::PanelGemm),
        (vec![3, 11, k], CpuFp8Kernel::PanelGemm),
    ] {
        let m: usize = dims[..dims.len() - 1].iter().product();
        assert_eq!(want == CpuFp8Kernel::Gemv, m <= gemv_max, "{dims:?}");
        let tier = Tier::current();
        let want = if tier == Tier::Avx512Bf16 && m >= bf16_tile_min_m(k) {
            CpuFp8Kernel::PanelGemm
        } else {
            want
        };
        let x = tensor(hetero(&mut rng, m, k, 1, block[1]), &dims);
        let (y, path) = layer.forward_with_path(&x).unwrap();
        let want = CpuFp8Path { kernel: want, tier };
        assert_eq!(path, Fp8Path::Cpu(want), "{dims:?}");
        let y2 = layer.forward(&x).unwrap().flatten_all().unwrap();
        assert_eq!(
            y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            y2.to_vec1::<f32>().unwrap()
        );
        let want_y =
            reference::fp8_linear(&x.reshape((m, k)).unwrap(), &wq, None, ActQuant::Group).unwrap();
        let err = rel_frobenius(&y.reshape((m, n)).unwrap(), &want_y);
        assert!(err < 1e-3, "{dims:?}: rel err {err:e}");
    }
}

#[test]
fn batched_input_keeps_leading_dims() {
    let mut rng = rng("batched_input");
    let (n, k) = (64, 200);
    let wq =
        Fp8BlockWeight::quantize(&tensor(gaussian(&mut rng, n * k), &[n, k]), [32, 64]).unwrap();
    let layer = Fp8Linear::new(wq.clone(), None, ActQuant::Group).unwrap();
    let x = tensor(gaussian(&mut rng, 2 * 3 * k), &[2, 3, k]);
    let y = layer.forward(&x).unwrap();
    assert_eq!(y.dims(), &[2, 3, n]);
    let want = reference::fp8_linear(&x, &wq, None, ActQuant::Group).unwrap();
    assert!(rel_frobenius(&y, &want) < 1e-3);
    // a non-contiguous view gives the same answer
    let xt = tensor(gaussian(&mut rng, k * 5), &[k, 5]).t().unwrap();
    let yt = layer.forward(&xt).unwrap();
    let want =
        reference::fp8_linear(&xt.contiguous().unwrap(), &wq, None, ActQuant::Group).unwrap();
    assert!(rel_frobenius(&yt, &want) < 1e-3);
}

/// `Fp8Linear::forward_swiglu` is `silu_mul` of the two layers' outputs, bit for bit: gate and
/// up with different blockings (a bias on up), K = 3884, M = 1, odd M, around the GEMV / panel
/// boundary and past the GEMV, leading dims kept; bf16 input too (the unfused path); the f64
/// reference within the contract's tolerance; a width mismatch is `Error::Shape` naming `up`.
#[test]
fn swiglu_is_silu_of_gate_times_up() {
    let mut rng = rng("swiglu_is_silu_of_gate_times_up");
    let (n, k) = (576, 3884);
    let layer = |rng: &mut StdRng, block: [usize; 2], bias: bool| {
        let w = tensor(hetero(rng, n, k, block[0], block[1]), &[n, k]);
        let b = bias.then(|| tensor(gaussian(rng, n), &[n]));
        Fp8Linear::new(
            Fp8BlockWeight::quantize(&w, block).unwrap(),
            b,
            ActQuant::Group,
        )
        .unwrap()
    };
    let (gate, up) = (
        layer(&mut rng, [128, 128], false),
        layer(&mut rng, [64, 128], true),
    );
    let bits = |t: &Tensor| {
        t.flatten_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .into_iter()
            .map(f32::to_bits)
            .collect::<Vec<_>>()
    };
    for m in [1usize, 3, 7, 12, GEMV_MAX_M, GEMV_MAX_M + 1] {
        for dtype in [DType::F32, DType::BF16] {
            let x = tensor(hetero(&mut rng, m, k, 1, 128), &[1, m, k])
                .to_dtype(dtype)
                .unwrap();
            let y = Fp8Linear::forward_swiglu(&gate, &up, &x).unwrap();
            assert_eq!((y.dims(), y.dtype()), (&[1, m, n][..], dtype));
            let want =
                fp8nsa::silu_mul(&gate.forward(&x).unwrap(), &up.forward(&x).unwrap()).unwrap();
            assert_eq!(bits(&y), bits(&want), "m {m} {dtype:?}");
            if dtype == DType::F32 && m == 3 {
                let r = |l: &Fp8Linear| {
                    reference::fp8_linear(
                        &x.squeeze(0).unwrap(),
                        l.weight(),
                        l.bias(),
                        ActQuant::Group,
                    )
                    .unwrap()
                };
                let want = (candle_nn::ops::silu(&r(&gate)).unwrap() * r(&up)).unwrap();
                let err = rel_frobenius(&y.squeeze(0).unwrap(), &want);
                assert!(err < tol(dtype), "m {m}: rel err {err:e}");
            }
        }
    }
    let narrow = Fp8Linear::new(
        Fp8BlockWeight::quantize(&tensor(gaussian(&mut rng, 64 * k), &[64, k]), [128, 128])
            .unwrap(),
        None,
        ActQuant::Group,
    )
    .unwrap();
    let x = tensor(gaussian(&mut rng, k), &[1, k]);
    let e = err_of(Fp8Linear::forward_swiglu(&gate, &narrow, &x));
    assert!(matches!(e, Error::Shape { arg: "up", .. }), "{e:?}");
}

/// Weights straight from random codes and scales (what a checkpoint holds), not from
/// `quantize`: every finite code, scales spread over 1e-3..1e3 per block.
#[test]
fn from_parts_random_codes_and_scales() {
    let mut rng = rng("from_parts");
    let (m, n, k, block): (usize, usize, usize, [usize; 2]) = (9, 300, 1000, [128, 256]);
    let codes: Vec<u8> = (0..n * k)
        .map(|_| loop {
            let c: u8 = rng.random();
            if c & 0x7f != 0x7f {
                break c;
            }
        })
        .collect();
    let ns = [n.div_ceil(block[0]), k.div_ceil(block[1])];
    let scales: Vec<f32> = (0..ns[0] * ns[1])
        .map(|_| 10f32.powf(rng.random_range(-3.0..3.0)) / 448.0)
        .collect();
    let data = Tensor::from_vec(codes, (n, k), &Device::Cpu).unwrap();
    let wq = Fp8BlockWeight::from_parts(data, tensor(scales, &ns), block).unwrap();
    for act in [ActQuant::None, ActQuant::Group] {
        let x = tensor(hetero(&mut rng, m, k, 1, block[1]), &[m, k]);
        let y = Fp8Linear::new(wq.clone(), None, act)
            .unwrap()
            .forward(&x)
            .unwrap();
        let want = reference::fp8_linear(&x, &wq, None, act).unwrap();
        assert!(rel_frobenius(&y, &want) < 1e-3);
        // the dequantized weight in a plain matmul agrees too (W8A16)
        if act == ActQuant::None {
            let wd = wq.dequantize(DType::F32).unwrap();
            let yd = x.matmul(&wd.t().unwrap()).unwrap();
            assert!(rel_frobenius(&yd, &want) < 1e-5);
        }
    }
}

/// Quantized vs unquantized f32 math on Gaussian data: calc_diff < 1e-3 (contract).
#[test]
fn quantized_matches_unquantized_math() {
    let mut rng = rng("quantized_vs_f32");
    let (m, n, k) = (64, 576, 3884);
    let w = tensor(gaussian(&mut rng, n * k), &[n, k]);
    let x = tensor(gaussian(&mut rng, m * k), &[m, k]);
    let exact = x
        .to_dtype(DType::F64)
        .unwrap()
        .matmul(&w.to_dtype(DType::F64).unwrap().t().unwrap())
        .unwrap();
    for block in [[128, 128], [64, 128], [512, 512]] {
        for act in [
            ActQuant::None,
            ActQuant::Group,
            ActQuant::Block2d { bm: 128 },
        ] {
            let wq = Fp8BlockWeight::quantize(&w, block).unwrap();
            let y = Fp8Linear::new(wq, None, act).unwrap().forward(&x).unwrap();
            let d = calc_diff(&y, &exact);
            assert!(d < 1e-3, "block={block:?} act={act:?}: calc_diff {d:e}");
        }
    }
}

/// `|dequant(quant(w)) - w| <= max(|w| / 16, scale * 2^-10)`: half an ulp of a 3-bit mantissa,
/// or half the subnormal step, per element, with heterogeneous block magnitudes.
#[test]
fn quantization_round_trip_bounds() {
    let mut rng = rng("round_trip_bounds");
    for (n, k, block) in [
        (576, 3884, [128, 128]),
        (130, 70, [64, 32]),
        (5, 3, [512, 512]),
    ] {
        let wv = hetero(&mut rng, n, k, block[0], block[1]);
        let w = tensor(wv.clone(), &[n, k]);
        for dtype in [DType::F32, DType::BF16] {
            let w = w.to_dtype(dtype).unwrap();
            let wv: Vec<f32> = w
                .to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let q = Fp8BlockWeight::quantize(&w, block).unwrap();
            let back: Vec<f32> = q
                .dequantize(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let s: Vec<Vec<f32>> = q.scales().to_vec2().unwrap();
            for r in 0..n {
                for c in 0..k {
                    let sc = s[r / block[0]][c / block[1]];
                    let bound = (wv[r * k + c].abs() / 16.0).max(sc * 2f32.powi(-10)) * 1.000_01;
                    let e = (back[r * k + c] - wv[r * k + c]).abs();
                    assert!(e <= bound, "{r},{c}: err {e} > {bound}");
                }
            }
            // each block's amax lands on ±448 exactly
            for (bi, row) in s.iter().enumerate() {
                for (bj, &sc) in row.iter().enumerate() {
                    let mut amax = 0f32;
                    for r in bi * block[0]..((bi + 1) * block[0]).min(n) {
                        for c in bj * block[1]..((bj + 1) * block[1]).min(k) {
                            amax = amax.max(wv[r * k + c].abs());
                        }
                    }
                    assert_eq!(sc, amax.max(1e-12) / 448.0);
                }
            }
        }
    }
}

#[test]
fn nan_input_propagates_and_zero_rows_stay_zero() {
    let (n, k) = (4, 8);
    let w = tensor((0..n * k).map(|i| i as f32 - 10.0).collect(), &[n, k]);
    let layer = Fp8Linear::new(
        Fp8BlockWeight::quantize(&w, [2, 4]).unwrap(),
        None,
        ActQuant::Group,
    )
    .unwrap();
    let mut xv = vec![0f32; 2 * k];
    xv[k + 1] = f32::NAN;
    let y: Vec<Vec<f32>> = layer
        .forward(&tensor(xv, &[2, k]))
        .unwrap()
        .to_vec2()
        .unwrap();
    assert!(y[0].iter().all(|&v| v == 0.0));
    assert!(y[1].iter().all(|v| v.is_nan()));
}

/// One token holding NaN or ±Inf turns its own outputs NaN and no other token's, for every
/// activation scheme, `Block2d` included, where tokens share a scale (issue: reliability,
/// item 11), on every CPU path: M = 1, small M, the large-M GEMM, K not a multiple of 128.
#[test]
fn non_finite_activations_stay_in_their_token() {
    let mut rng = rng("non_finite_acts");
    let (n, k) = (48, 300);
    let w = Fp8BlockWeight::quantize(&tensor(hetero(&mut rng, n, k, 16, 128), &[n, k]), [16, 128])
        .unwrap();
    for act in [
        ActQuant::Group,
        ActQuant::Block2d { bm: 4 },
        ActQuant::Block2d { bm: 128 },
        ActQuant::None,
    ] {
        let layer = Fp8Linear::new(w.clone(), None, act).unwrap();
        for m in [1, 3, 9, 200] {
            let x = gaussian(&mut rng, m * k);
            let forward = |x: &Tensor| layer.forward(x).unwrap();
            if m == 1 {
                // one token: its own outputs NaN
                let mut bad = x.clone();
                bad[7] = f32::INFINITY;
                let y: Vec<f32> = forward(&tensor(bad, &[1, k]))
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                assert!(y.iter().all(|v| !v.is_finite()), "{act:?} m=1");
                continue;
            }
            check_non_finite_rows(
                forward,
                &x,
                m,
                k,
                act != ActQuant::None,
                &format!("{act:?} m={m}"),
            );
        }
    }
}

/// Non-finite weights are refused when quantizing, and NaN, negative or infinite scales when a
/// weight is built from parts (what loading a checkpoint does), each naming the block (issue:
/// reliability, item 9).
#[test]
fn non_finite_weights_and_bad_scales_are_errors() {
    let (n, k) = (40, 300);
    let mut rng = rng("non_finite_weights");
    for (bad, at) in [
        (f32::INFINITY, 0),
        (f32::NEG_INFINITY, 17 * k + 299),
        (f32::NAN, 39 * k + 5),
    ] {
        let mut v = hetero(&mut rng, n, k, 16, 128);
        v[at] = bad;
        let e = err_of(Fp8BlockWeight::quantize(&tensor(v, &[n, k]), [16, 128]));
        let (r, c) = (at / k, at % k);
        let block = format!("block [{}, {}]", r / 16, c / 128);
        assert!(
            matches!(&e, Error::Invalid { arg: "w", msg } if msg.contains(&format!("[{r}, {c}]")) && msg.contains(&block)),
            "{bad}: {e}"
        );
    }
    let good =
        Fp8BlockWeight::quantize(&tensor(hetero(&mut rng, n, k, 16, 128), &[n, k]), [16, 128])
            .unwrap();
    let scales: Vec<f32> = good.scales().flatten_all().unwrap().to_vec1().unwrap();
    let dims = good.scales().dims().to_vec();
    for bad in [f32::NAN, -1e-3, f32::INFINITY, -0.0 - 1.0] {
        let mut s = scales.clone();
        s[dims[1] + 2] = bad;
        let e = err_of(Fp8BlockWeight::from_parts(
            good.data().clone(),
            tensor(s, &dims),
            [16, 128],
        ));
        assert!(
            matches!(&e, Error::Invalid { arg: "scales", msg } if msg.contains("block [1, 2]")),
            "{bad}: {e}"
        );
    }
    // zero is a legal scale (an all-zero block)
    let mut s = scales.clone();
    s[0] = 0.0;
    assert!(Fp8BlockWeight::from_parts(good.data().clone(), tensor(s, &dims), [16, 128]).is_ok());
}

#[test]
fn bad_inputs_are_errors_that_name_the_argument() {
    let dev = Device::Cpu;
    let w = Tensor::ones((8, 16), DType::F32, &dev).unwrap();
    let wq = Fp8BlockWeight::quantize(&w, [4, 8]).unwrap();
    let layer = Fp8Linear::new(wq.clone(), None, ActQuant::Group).unwrap();

    // K mismatch
    let x15 = Tensor::ones((2, 15), DType::F32, &dev).unwrap();
    let e = err_of(layer.forward_t(&x15));
    assert!(
        matches!(&e, Error::Shape { arg: "x", expected, got }
            if got == &[2, 15] && expected.contains("16")),
        "{e}"
    );
    // wrong input dtype
    let e = err_of(layer.forward_t(&Tensor::ones((2, 16), DType::U32, &dev).unwrap()));
    assert!(
        matches!(
            e,
            Error::DType {
                arg: "x",
                got: DType::U32,
                ..
            }
        ),
        "{e}"
    );
    // empty input
    let e = err_of(layer.forward_t(&Tensor::ones((0, 16), DType::F32, &dev).unwrap()));
    assert!(
        matches!(&e, Error::Shape { arg: "x", expected, got }
            if got == &[0, 16] && expected.contains("at least one row")),
        "{e}"
    );
    // the Module impl returns the same errors through candle's type (as text: see
    // `wrapped_message`)
    let typed = err_of(layer.forward_t(&x15));
    let through_candle = layer.forward(&x15).unwrap_err();
    assert_eq!(
        wrapped_message(&through_candle),
        Some(typed.to_string()),
        "{through_candle}"
    );
    // bias shape
    let e = err_of(Fp8Linear::new(
        wq.clone(),
        Some(Tensor::ones(7, DType::F32, &dev).unwrap()),
        ActQuant::Group,
    ));
    assert!(
        matches!(&e, Error::Shape { arg: "bias", expected, got }
            if expected == "[8]" && got == &[7]),
        "{e}"
    );
    // zero activation row block
    let e = err_of(Fp8Linear::new(
        wq.clone(),
        None,
        ActQuant::Block2d { bm: 0 },
    ));
    assert!(
        matches!(
            e,
            Error::Invalid {
                arg: "act (Block2d bm)",
                ..
            }
        ),
        "{e}"
    );

    // quantize: zero block, wrong rank, empty, non-float
    let e = err_of(Fp8BlockWeight::quantize(&w, [0, 8]));
    assert!(matches!(e, Error::Invalid { arg: "block", .. }), "{e}");
    let e = err_of(Fp8BlockWeight::quantize(&w.flatten_all().unwrap(), [4, 8]));
    assert!(
        matches!(&e, Error::Shape { arg: "w", expected, got }
            if expected.starts_with("[N, K]") && got == &[128]),
        "{e}"
    );
    let e = err_of(Fp8BlockWeight::quantize(
        &Tensor::ones((0, 16), DType::F32, &dev).unwrap(),
        [4, 8],
    ));
    assert!(
        matches!(&e, Error::Shape { arg: "w", got, .. } if got == &[0, 16]),
        "{e}"
    );
    let e = err_of(Fp8BlockWeight::quantize(
        &Tensor::ones((8, 16), DType::U8, &dev).unwrap(),
        [4, 8],
    ));
    assert!(
        matches!(
            e,
            Error::DType {
                arg: "w",
                got: DType::U8,
                ..
            }
        ),
        "{e}"
    );

    // from_parts: scale shape, scale dtype, data dtype, zero block
    let data = wq.data().clone();
    let e = err_of(Fp8BlockWeight::from_parts(
        data.clone(),
        Tensor::ones((2, 3), DType::F32, &dev).unwrap(),
        [4, 8],
    ));
    assert!(
        matches!(&e, Error::Shape { arg: "scales", expected, got }
            if expected.starts_with("[2, 2]") && got == &[2, 3]),
        "{e}"
    );
    let e = err_of(Fp8BlockWeight::from_parts(
        data.clone(),
        Tensor::ones((2, 2), DType::F16, &dev).unwrap(),
        [4, 8],
    ));
    assert!(
        matches!(
            e,
            Error::DType {
                arg: "scales",
                expected: "f32",
                got: DType::F16
            }
        ),
        "{e}"
    );
    let e = err_of(Fp8BlockWeight::from_parts(
        w.clone(),
        wq.scales().clone(),
        [4, 8],
    ));
    assert!(
        matches!(&e, Error::DType { arg: "data", expected, got: DType::F32 }
            if expected.starts_with("u8")),
        "{e}"
    );
    let e = err_of(Fp8BlockWeight::from_parts(
        data.clone(),
        wq.scales().clone(),
        [4, 0],
    ));
    assert!(matches!(e, Error::Invalid { arg: "block", .. }), "{e}");
    // and the matching parts are accepted, as U8 or F8E4M3
    assert!(Fp8BlockWeight::from_parts(data.clone(), wq.scales().clone(), [4, 8]).is_ok());
    let f8: Vec<float8::F8E4M3> = data
        .flatten_all()
        .unwrap()
        .to_vec1::<u8>()
        .unwrap()
        .into_iter()
        .map(float8::F8E4M3::from_bits)
        .collect();
    let f8 = Tensor::from_vec(f8, (8, 16), &dev).unwrap();
    let back = Fp8BlockWeight::from_parts(f8, wq.scales().clone(), [4, 8]).unwrap();
    assert_eq!(
        back.data().to_vec2::<u8>().unwrap(),
        data.to_vec2::<u8>().unwrap()
    );
}

/// A safetensors file in the Hugging Face layout (`weight` F8_E4M3, `weight_scale_inv` f32 or
/// bf16) loads through a `VarBuilder` and computes what the reference says.
#[test]
fn loads_hugging_face_layout_from_safetensors() {
    use safetensors::tensor::{Dtype, TensorView};
    let mut rng = rng("hf_layout");
    let (n, k, block) = (200, 300, [128, 128]);
    let wq = Fp8BlockWeight::quantize(&tensor(hetero(&mut rng, n, k, 128, 128), &[n, k]), block)
        .unwrap();
    let bytes = wq.data().flatten_all().unwrap().to_vec1::<u8>().unwrap();
    let scales = wq.scales().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let scale_bytes: Vec<u8> = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
    let sdims = wq.scales().dims().to_vec();
    let tensors = vec![
        (
            "model.layers.0.mlp.up_proj.weight".to_string(),
            TensorView::new(Dtype::F8_E4M3, vec![n, k], &bytes).unwrap(),
        ),
        (
            "model.layers.0.mlp.up_proj.weight_scale_inv".to_string(),
            TensorView::new(Dtype::F32, sdims, &scale_bytes).unwrap(),
        ),
    ];
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    safetensors::serialize_to_file(tensors, None, &path).unwrap();

    let map = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let vb = candle_nn::VarBuilder::from_tensors(map, DType::F32, &Device::Cpu);
    let loaded = Fp8BlockWeight::load(vb.pp("model.layers.0.mlp.up_proj"), block).unwrap();
    assert_eq!(
        loaded.data().to_vec2::<u8>().unwrap(),
        wq.data().to_vec2::<u8>().unwrap()
    );
    assert_eq!(
        loaded.scales().to_vec2::<f32>().unwrap(),
        wq.scales().to_vec2::<f32>().unwrap()
    );

    let x = tensor(gaussian(&mut rng, 3 * k), &[3, k]);
    let y = Fp8Linear::new(loaded, None, ActQuant::Group)
        .unwrap()
        .forward(&x)
        .unwrap();
    let want = reference::fp8_linear(&x, &wq, None, ActQuant::Group).unwrap();
    assert!(rel_frobenius(&y, &want) < 1e-3);

    // a wrong block size for the file's scales is an error, not a panic
    let map = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let vb = candle_nn::VarBuilder::from_tensors(map, DType::F32, &Device::Cpu);
    let e = err_of(Fp8BlockWeight::load(
        vb.pp("model.layers.0.mlp.up_proj"),
        [64, 64],
    ));
    assert!(
        matches!(&e, Error::Shape { arg: "scales", got, .. } if got == &[2, 3]),
        "{e}"
    );
}

/// A weight stored as anything but F8_E4M3 is never converted by value (issue: reliability,
/// item 10): `load_safetensors` reads U8 as the codes they are and refuses f32 / i64;
/// `load` (a `VarBuilder`, which converts silently) refuses what is not e4m3-valued.
#[test]
fn stored_weight_dtypes_are_codes_or_refused() {
    use candle_core::safetensors::MmapedSafetensors;
    use safetensors::tensor::{Dtype, TensorView};
    let mut rng = rng("stored_dtypes");
    let (n, k, block) = (150, 300, [128, 128]);
    let w = hetero(&mut rng, n, k, 128, 128);
    let wq = Fp8BlockWeight::quantize(&tensor(w.clone(), &[n, k]), block).unwrap();
    let codes = wq.data().flatten_all().unwrap().to_vec1::<u8>().unwrap();
    let scale_bytes = f32_le_bytes(wq.scales());
    let f32_bytes: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
    let i64_bytes: Vec<u8> = codes
        .iter()
        .flat_map(|&c| (c as i64).to_le_bytes())
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let sdims = wq.scales().dims().to_vec();
    let mut tensors = Vec::new();
    for (p, dtype, bytes) in [
        ("fp8", Dtype::F8_E4M3, &codes),
        ("u8", Dtype::U8, &codes),
        ("f32", Dtype::F32, &f32_bytes),
        ("i64", Dtype::I64, &i64_bytes),
    ] {
        tensors.push((
            format!("{p}.weight"),
            TensorView::new(dtype, vec![n, k], bytes).unwrap(),
        ));
        tensors.push((
            format!("{p}.weight_scale_inv"),
            TensorView::new(Dtype::F32, sdims.clone(), &scale_bytes).unwrap(),
        ));
    }
    let path = dir.path().join("model.safetensors");
    safetensors::serialize_to_file(tensors, None, &path).unwrap();
    // SAFETY: the file is this test's own and is not modified while mapped.
    let st = unsafe { MmapedSafetensors::new(&path) }.unwrap();
    for p in ["fp8", "u8"] {
        let got = Fp8BlockWeight::load_safetensors(&st, p, block, &Device::Cpu).unwrap();
        assert_eq!(
            got.data().flatten_all().unwrap().to_vec1::<u8>().unwrap(),
            codes,
            "{p}"
        );
    }
    for p in ["f32", "i64"] {
        let e = err_of(Fp8BlockWeight::load_safetensors(
            &st,
            p,
            block,
            &Device::Cpu,
        ));
        assert!(
            matches!(&e, Error::Invalid { arg: "weight", msg } if msg.contains(&format!("{p}.weight is stored as"))),
            "{p}: {e}"
        );
    }
    let map = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let vb = candle_nn::VarBuilder::from_tensors(map, DType::F32, &Device::Cpu);
    let got = Fp8BlockWeight::load(vb.pp("fp8"), block).unwrap();
    assert_eq!(
        got.data().flatten_all().unwrap().to_vec1::<u8>().unwrap(),
        codes
    );
    for p in ["u8", "f32", "i64"] {
        let e = err_of(Fp8BlockWeight::load(vb.pp(p), block));
        assert!(
            matches!(&e, Error::Invalid { arg: "weight", msg } if msg.contains("not stored as F8_E4M3")),
            "{p}: {e}"
        );
    }
}

/// `E` experts with heterogeneous block scales (each expert its own magnitude on top).
fn experts(
    rng: &mut StdRng,
    e: usize,
    n: usize,
    k: usize,
    block: [usize; 2],
) -> Vec<Fp8BlockWeight> {
    (0..e)
        .map(|_| {
            let w = tensor(hetero(rng, n, k, block[0], block[1]), &[n, k]);
            Fp8BlockWeight::quantize(&w, block).unwrap()
        })
        .collect()
}

/// The grouped expert GEMM against the f64 reference: the contract's non-aligned shape, empty
/// experts, one row (decode), odd counts and a prefill-sized group in one call, every
/// activation scheme; the masked layout gives the same rows with zeros elsewhere.
#[test]
fn experts_grouped_gemm_matches_the_reference() {
    let mut rng = rng("experts_grouped_gemm");
    for (n, k, block, counts) in [
        (576, 3884, [128, 128], vec![0, 1, 3, 0, GEMV_MAX_M + 3, 1]),
        (43, 300, [16, 40], vec![2, 0, 0, 5, 1]),
        (576, 3884, [128, 128], vec![0, 0, 1, 0]),
    ] {
        let ws = experts(&mut rng, counts.len(), n, k, block);
        let t: usize = counts.iter().sum();
        for act in [ActQuant::Group, ActQuant::None, ActQuant::Block2d { bm: 2 }] {
            let layer = fp8nsa::Fp8Experts::new(&ws, act).unwrap();
            for dtype in [DType::F32, DType::BF16] {
                let x = tensor(hetero(&mut rng, t, k, 1, block[1]), &[t, k])
                    .to_dtype(dtype)
                    .unwrap();
                let y = layer.forward_contiguous(&x, &counts).unwrap();
                assert_eq!(y.dims(), [t, n]);
                assert_eq!(y.dtype(), dtype);
                let want = reference::fp8_experts(&x, &ws, &counts, act).unwrap();
                let err = rel_frobenius(&y, &want);
                assert!(
                    err < tol(dtype),
                    "{n}x{k} {counts:?} {act:?} {dtype:?}: {err:e}"
                );
            }
            // the masked layout: a slot of `mmax` rows per expert
            let mmax = *counts.iter().max().unwrap();
            let x = tensor(hetero(&mut rng, t, k, 1, block[1]), &[t, k]);
            let mut slots = vec![0f32; counts.len() * mmax * k];
            let xv: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
            let mut r = 0;
            for (e, &c) in counts.iter().enumerate() {
                slots[e * mmax * k..(e * mmax + c) * k].copy_from_slice(&xv[r * k..(r + c) * k]);
                r += c;
            }
            let xm = tensor(slots, &[counts.len(), mmax, k]);
            let ym = layer.forward_masked(&xm, &counts).unwrap();
            let yc: Vec<f32> = layer
                .forward_contiguous(&x, &counts)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let ym: Vec<f32> = ym.flatten_all().unwrap().to_vec1().unwrap();
            let mut r = 0;
            for (e, &c) in counts.iter().enumerate() {
                for i in 0..mmax {
                    let row = &ym[(e * mmax + i) * n..(e * mmax + i + 1) * n];
                    if i < c {
                        assert_eq!(row, &yc[(r + i) * n..(r + i + 1) * n], "expert {e} row {i}");
                    } else {
                        assert!(row.iter().all(|&v| v == 0.0), "expert {e} padding row {i}");
                    }
                }
                r += c;
            }
        }
    }
}

#[test]
fn experts_bad_calls_are_errors() {
    let mut rng = rng("experts_bad_calls");
    let ws = experts(&mut rng, 3, 8, 16, [4, 8]);
    let layer = fp8nsa::Fp8Experts::new(&ws, ActQuant::Group).unwrap();
    let x = tensor(gaussian(&mut rng, 4 * 16), &[4, 16]);
    let invalid = |r: Result<Tensor, Error>, arg: &str| {
        assert!(
            matches!(&r, Err(Error::Invalid { arg: a, .. }) if *a == arg),
            "{r:?}"
        );
    };
    invalid(layer.forward_contiguous(&x, &[1, 1]), "counts");
    invalid(layer.forward_contiguous(&x, &[1, 1, 1]), "counts");
    let xm = tensor(gaussian(&mut rng, 3 * 2 * 16), &[3, 2, 16]);
    invalid(layer.forward_masked(&xm, &[1, 3, 0]), "counts");
    assert!(matches!(
        layer.forward_contiguous(&xm, &[1, 1, 1]),
        Err(Error::Shape { arg: "x", .. })
    ));
    // experts of different shapes or blocks
    let mut mixed = ws.clone();
    mixed.push(experts(&mut rng, 1, 8, 16, [8, 8]).remove(0));
    invalid(
        fp8nsa::Fp8Experts::new(&mixed, ActQuant::Group).map(|_| x.clone()),
        "experts",
    );
    invalid(
        fp8nsa::Fp8Experts::new(&[], ActQuant::Group).map(|_| x.clone()),
        "experts",
    );
    // no rows: an empty result, as the masked layout gives zeros
    let empty = layer
        .forward_contiguous(&x.narrow(0, 0, 0).unwrap(), &[0, 0, 0])
        .unwrap();
    assert_eq!(empty.dims(), [0, 8]);
    invalid(layer.forward_contiguous(&x, &[usize::MAX, 2, 3]), "counts");
}

/// The MoE block against a per-token f64 computation: routing (softmax, top-k, renormalized)
/// in f64, each chosen expert through the reference linear, SwiGLU in f64, weighted sum.
#[test]
fn moe_block_matches_a_per_token_f64_reference() {
    let mut rng = rng("moe_block");
    let (e, h, i, block) = (6, 200, 136, [128, 128]);
    let gate = experts(&mut rng, e, i, h, block);
    let up = experts(&mut rng, e, i, h, block);
    let down = experts(&mut rng, e, h, i, block);
    let router = tensor(gaussian(&mut rng, e * h), &[e, h]);
    let rv: Vec<f64> = router
        .to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    for (act, tol) in [(ActQuant::None, 1e-4), (ActQuant::Group, 1e-2)] {
        let stack = |ws: &[Fp8BlockWeight]| fp8nsa::Fp8Experts::new(ws, act).unwrap();
        let moe = fp8nsa::Fp8Moe::new(
            router.clone(),
            stack(&gate),
            stack(&up),
            stack(&down),
            2,
            true,
        )
        .unwrap();
        for t in [1, 5] {
            let x = tensor(gaussian(&mut rng, t * h), &[t, h]);
            let y = moe.forward(&x).unwrap();
            let (chosen, _) = moe.route(&x).unwrap();
            let mut want = Vec::with_capacity(t * h);
            for tok in 0..t {
                let xt = x.narrow(0, tok, 1).unwrap().to_dtype(DType::F64).unwrap();
                let xv: Vec<f64> = xt
                    .to_dtype(DType::F64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                let logits: Vec<f64> = (0..e)
                    .map(|ex| (0..h).map(|c| rv[ex * h + c] * xv[c]).sum())
                    .collect();
                let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
                let mut order: Vec<usize> = (0..e).collect();
                order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
                assert_eq!(
                    &order[..2],
                    &chosen[tok * 2..tok * 2 + 2],
                    "routing of token {tok}"
                );
                let z: f64 = order[..2].iter().map(|&ex| p[ex]).sum();
                let mut acc = vec![0f64; h];
                for &ex in &order[..2] {
                    let g = reference::fp8_linear(&xt, &gate[ex], None, act).unwrap();
                    let u = reference::fp8_linear(&xt, &up[ex], None, act).unwrap();
                    let g: Vec<f64> = g
                        .to_dtype(DType::F64)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap();
                    let u: Vec<f64> = u
                        .to_dtype(DType::F64)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap();
                    let a: Vec<f64> = g
                        .iter()
                        .zip(&u)
                        .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                        .collect();
                    let a = Tensor::from_vec(a, (1, i), &Device::Cpu).unwrap();
                    let d = reference::fp8_linear(&a, &down[ex], None, act).unwrap();
                    let d: Vec<f64> = d
                        .to_dtype(DType::F64)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap();
                    for (o, v) in acc.iter_mut().zip(d) {
                        *o += p[ex] / z * v;
                    }
                }
                want.extend(acc);
            }
            let want = Tensor::from_vec(want, (t, h), &Device::Cpu).unwrap();
            let err = rel_frobenius(&y, &want);
            assert!(err < tol, "{act:?} T = {t}: {err:e}");
        }
    }
    // top_k outside 1..=E
    let stack = |ws: &[Fp8BlockWeight]| fp8nsa::Fp8Experts::new(ws, ActQuant::Group).unwrap();
    let bad = fp8nsa::Fp8Moe::new(router, stack(&gate), stack(&up), stack(&down), 7, true);
    assert!(
        matches!(bad, Err(Error::Invalid { arg: "top_k", .. })),
        "{bad:?}"
    );
}
