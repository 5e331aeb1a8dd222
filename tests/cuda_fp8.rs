//! `Fp8Linear` on CUDA (`--features cuda`, needs a GPU; without one every test says so and
//! returns, or fails when `FP8NSA_REQUIRE_GPU=1`): every path against the f64 reference on the
//! contract's sweep with heterogeneous block scales, outputs poisoned first (every element must
//! be written), errors for bad input.
//!
//! `FP8NSA_REQUIRE_GPU=1 cargo test --release --features cuda --test cuda_fp8`

use candle_core::{DType, Device, Module, Tensor};
use cudarc::driver::CudaStream;
use fp8nsa::cuda::fp8::{self as kernels, CudaFp8Path, PreparedWeight};
use fp8nsa::{reference, ActQuant, CudaFp8Kernel, Fp8BlockWeight, Fp8Linear, Fp8Path};
use fp8nsa_test_support::resource::gpu;
use fp8nsa_test_support::*;
use rand::rngs::StdRng;
use std::sync::Arc;

/// The CUDA path of a path the layer returned (panics on another backend's).
fn path_of(p: Fp8Path) -> CudaFp8Path {
    match p {
        Fp8Path::Cuda(c) => c,
        other => panic!("expected a CUDA path, got {other:?}"),
    }
}

fn stream(dev: &Device) -> Arc<CudaStream> {
    dev.as_cuda_device().unwrap().cuda_stream()
}

fn tol(dtype: DType) -> f64 {
    if dtype == DType::F32 {
        1e-3
    } else {
        8e-3
    }
}

const KERNELS: [CudaFp8Kernel; 5] = [
    CudaFp8Kernel::Auto,
    CudaFp8Kernel::CublasLt,
    CudaFp8Kernel::Mma,
    CudaFp8Kernel::SmallM,
    CudaFp8Kernel::Dequant,
];

/// Whether `kernel` applies on this device (the plan says so without running anything).
fn applies(
    dev: &Device,
    m: usize,
    n: usize,
    k: usize,
    block: [usize; 2],
    act: ActQuant,
    kernel: CudaFp8Kernel,
) -> bool {
    let info = fp8nsa::cuda::device_info(&stream(dev)).unwrap();
    let shape = fp8nsa::types::LinearShape::new(m, n, k, block[0], block[1]).unwrap();
    kernels::plan(&info, &shape, act, kernel).is_ok()
}

/// (weight scale, activation block-magnitude decades) of the test data. f16: weights scaled
/// down and activations over 3 decades rather than 6, so the output stays below f16's 65504 and
/// the activations mostly above its subnormals.
fn magnitudes(dtype: DType) -> (f64, f32) {
    if dtype == DType::F16 {
        (1e-2, 1.5)
    } else {
        (1.0, 3.0)
    }
}

/// Every kernel on the GPU vs one reference on the CPU, whole output. A forced kernel that
/// does not apply must say so.
#[allow(clippy::too_many_arguments)]
fn check_case(
    dev: &Device,
    rng: &mut StdRng,
    (m, n, k): (usize, usize, usize),
    block: [usize; 2],
    act: ActQuant,
    dtype: DType,
    with_bias: bool,
) {
    let (w_mag, x_decades) = magnitudes(dtype);
    let w = (tensor(hetero(rng, n, k, block[0], block[1]), &[n, k]) * w_mag).unwrap();
    let wq = Fp8BlockWeight::quantize(&w, block).unwrap();
    let bias = with_bias.then(|| tensor(gaussian(rng, n), &[n]));
    let x = tensor(hetero_in(rng, m, k, 1, block[1], x_decades), &[m, k])
        .to_dtype(dtype)
        .unwrap();
    let want = reference::fp8_linear(&x, &wq, bias.as_ref(), act).unwrap();
    let xg = x.to_device(dev).unwrap();
    for kernel in KERNELS {
        let layer = Fp8Linear::new(wq.clone(), bias.clone(), act)
            .unwrap()
            .with_cuda_kernel(kernel);
        let what = format!("m={m} n={n} k={k} block={block:?} act={act:?} {dtype:?} {kernel:?}");
        let got = layer.forward_with_path(&xg);
        if !applies(dev, m, n, k, block, act, kernel) {
            // refused by the plan, before anything ran: a typed error, not candle text
            let err = got.expect_err(&what);
            assert!(
                matches!(&err, fp8nsa::Error::Cuda(fp8nsa::cuda::Error::Unsupported { reason, .. })
                    if reason.contains("does not apply")),
                "{what}: {err}"
            );
            continue;
        }
        let (y, path) = got.unwrap_or_else(|e| panic!("{what}: {e}"));
        if kernel != CudaFp8Kernel::Auto {
            assert_eq!(path_of(path).kernel(), kernel, "{what}: ran {path:?}");
        }
        assert_eq!((y.dims(), y.dtype()), (&[m, n][..], dtype), "{what}");
        let got = y.to_device(&Device::Cpu).unwrap();
        let err = rel_frobenius(&got, &want);
        assert!(err < tol(dtype), "{what}: rel err {err:e}");
    }
}

#[test]
fn sweep_576x3884_every_path_block_mode_dtype() {
    let Some(dev) = gpu("sweep_576x3884") else {
        return;
    };
    let mut rng = rng("cuda_sweep_576x3884");
    for block in [[128, 128], [256, 256], [512, 512], [64, 128]] {
        for act in [
            ActQuant::None,
            ActQuant::Group,
            ActQuant::Block2d { bm: 64 },
        ] {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                for m in [1, 7, 8, 83, 512] {
                    check_case(
                        &dev,
                        &mut rng,
                        (m, 576, 3884),
                        block,
                        act,
                        dtype,
                        m % 2 == 1,
                    );
                }
            }
        }
    }
}

#[test]
fn model_shapes_every_path() {
    let Some(dev) = gpu("model_shapes") else {
        return;
    };
    let mut rng = rng("cuda_model_shapes");
    for (n, k) in [(2112, 7168), (7168, 2048), (24576, 1536)] {
        for m in [1, 16, 64, 129] {
            check_case(
                &dev,
                &mut rng,
                (m, n, k),
                [128, 128],
                ActQuant::Group,
                DType::BF16,
                false,
            );
        }
    }
}

#[test]
fn odd_shapes_and_tiny_blocks() {
    let Some(dev) = gpu("odd_shapes") else { return };
    let mut rng = rng("cuda_odd_shapes");
    for ((m, n, k), block) in [
        ((1, 1, 1), [128, 128]),
        ((3, 5, 7), [128, 128]),
        ((17, 3, 300), [2, 3]),
        ((83, 40, 300), [16, 128]),
        ((300, 24, 129), [8, 64]),
        ((33, 130, 1000), [128, 256]),
    ] {
        for act in [ActQuant::None, ActQuant::Group, ActQuant::Block2d { bm: 5 }] {
            check_case(&dev, &mut rng, (m, n, k), block, act, DType::F32, true);
        }
    }
}

/// The backend itself, output buffer filled with NaN first: every element must be written,
/// and the result must match the reference, on every path that applies, in every dtype
/// (M = 64 and 512 take cuBLASLt's direct write on sm_90, M = 1 and 7 the small-M kernel).
#[test]
fn every_path_writes_every_element() {
    let Some(dev) = gpu("poisoned_output") else {
        return;
    };
    let s = stream(&dev);
    let mut rng = rng("cuda_poisoned_output");
    for (m, n, k, block) in [
        (1, 576, 3884, [128, 128]),
        (7, 576, 3884, [128, 128]),
        (64, 576, 3884, [128, 128]),
        (83, 576, 3884, [256, 256]),
        (512, 576, 3884, [128, 128]),
        (1, 130, 384, [64, 128]),
        // the small-M kernel's 64- and 128-thread groups (4 and 2 groups per CTA), so that
        // compute-sanitizer's racecheck of this test reaches every group width
        (1, 1001, 1000, [128, 128]),
        (3, 1001, 1500, [128, 128]),
    ] {
        poisoned::<f32>(&s, &mut rng, (m, n, k), block);
        poisoned::<half::bf16>(&s, &mut rng, (m, n, k), block);
        poisoned::<half::f16>(&s, &mut rng, (m, n, k), block);
    }
}

fn poisoned<T: fp8nsa::cuda::Element + candle_core::WithDType>(
    s: &Arc<CudaStream>,
    rng: &mut StdRng,
    (m, n, k): (usize, usize, usize),
    block: [usize; 2],
) {
    let (w_mag, x_decades) = magnitudes(T::DTYPE);
    let w = (tensor(hetero(rng, n, k, block[0], block[1]), &[n, k]) * w_mag).unwrap();
    let wq = Fp8BlockWeight::quantize(&w, block).unwrap();
    let codes = s
        .clone_htod(&wq.data().flatten_all().unwrap().to_vec1::<u8>().unwrap())
        .unwrap();
    let scales = s
        .clone_htod(&wq.scales().flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .unwrap();
    let pw = PreparedWeight::new(s, &codes.as_view(), &scales.as_view(), [n, k], block).unwrap();
    let (pd, ps) = (pw.data_view(), pw.scales_view());
    let wref = pw.as_ref(&pd, &ps);
    let xh: Vec<T> = hetero_in(rng, m, k, 1, block[1], x_decades)
        .into_iter()
        .map(T::from_f32)
        .collect();
    let x = s.clone_htod(&xh).unwrap();
    let xt = Tensor::from_vec(xh, (m, k), &Device::Cpu).unwrap();
    let bias_h = gaussian(rng, n);
    let bias = s.clone_htod(&bias_h).unwrap();
    let bias_t = tensor(bias_h, &[n]);
    for act in [ActQuant::None, ActQuant::Group, ActQuant::Block2d { bm: 4 }] {
        let want = reference::fp8_linear(&xt, &wq, Some(&bias_t), act).unwrap();
        for kernel in KERNELS {
            let mut out = s.clone_htod(&vec![T::from_f32(f32::NAN); m * n]).unwrap();
            let r = kernels::fp8_linear(
                s,
                &x.as_view(),
                &wref,
                Some(&bias.as_view()),
                m,
                act,
                kernel,
                &mut out.as_view_mut(),
            );
            let what = format!(
                "m={m} n={n} k={k} {block:?} {act:?} {:?} {kernel:?}",
                T::DTYPE
            );
            let path: CudaFp8Path = match r {
                Ok(p) => p,
                Err(e) => {
                    assert!(
                        matches!(&e, fp8nsa::cuda::Error::Unsupported { reason, .. }
                            if reason.contains("does not apply")),
                        "{what}: {e}"
                    );
                    continue;
                }
            };
            let y = Tensor::from_vec(s.clone_dtoh(&out).unwrap(), (m, n), &Device::Cpu)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let unwritten = y
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .filter(|v| !v.is_finite())
                .count();
            assert_eq!(
                unwritten, 0,
                "{what} ({path}): unwritten or non-finite outputs"
            );
            let err = rel_frobenius(&y, &want);
            assert!(err < tol(T::DTYPE), "{what} ({path}): rel err {err:e}");
        }
    }
}

#[test]
fn quantized_matches_unquantized_math() {
    let Some(dev) = gpu("calc_diff") else { return };
    let mut rng = rng("cuda_calc_diff");
    let (m, n, k) = (64, 576, 3884);
    let w = tensor(gaussian(&mut rng, n * k), &[n, k]);
    let x = tensor(gaussian(&mut rng, m * k), &[m, k]);
    let exact = x.matmul(&w.t().unwrap()).unwrap();
    for kernel in [
        CudaFp8Kernel::Auto,
        CudaFp8Kernel::Mma,
        CudaFp8Kernel::Dequant,
    ] {
        let layer = Fp8Linear::new(
            Fp8BlockWeight::quantize(&w, [128, 128]).unwrap(),
            None,
            ActQuant::Group,
        )
        .unwrap()
        .with_cuda_kernel(kernel);
        let y = layer
            .forward(&x.to_device(&dev).unwrap())
            .unwrap()
            .to_device(&Device::Cpu)
            .unwrap();
        let d = calc_diff(&y, &exact);
        assert!(d < 1e-3, "{kernel:?}: calc_diff {d:e}");
    }
}

#[test]
fn weights_on_the_gpu_and_repeated_calls() {
    let Some(dev) = gpu("weights_on_gpu") else {
        return;
    };
    let mut rng = rng("cuda_weights_on_gpu");
    let (n, k) = (256, 512);
    let w = tensor(hetero(&mut rng, n, k, 128, 128), &[n, k]);
    let cpu_w = Fp8BlockWeight::quantize(&w, [128, 128]).unwrap();
    let gpu_w = Fp8BlockWeight::quantize(&w.to_device(&dev).unwrap(), [128, 128]).unwrap();
    assert!(gpu_w.device().is_cuda());
    let layer = Fp8Linear::new(gpu_w, None, ActQuant::Group).unwrap();
    let x = tensor(gaussian(&mut rng, 3 * 5 * k), &[3, 5, k]);
    let want = reference::fp8_linear(&x, &cpu_w, None, ActQuant::Group).unwrap();
    // the prepared weight is cached: the second call reuses it and agrees bit for bit
    let xg = x.to_device(&dev).unwrap();
    let y1 = layer.forward(&xg).unwrap();
    let y2 = layer.clone().forward(&xg).unwrap();
    assert_eq!(y1.dims(), &[3, 5, n]);
    assert_eq!(max_abs_diff(&y1, &y2), 0.0);
    let err = rel_frobenius(&y1.to_device(&Device::Cpu).unwrap(), &want);
    assert!(err < 1e-3, "rel err {err:e}");
}

#[test]
fn bad_input_is_an_error_not_a_crash() {
    let Some(dev) = gpu("bad_input") else { return };
    let w = Tensor::ones((64, 128), DType::F32, &Device::Cpu).unwrap();
    let layer = Fp8Linear::new(
        Fp8BlockWeight::quantize(&w, [128, 128]).unwrap(),
        None,
        ActQuant::Group,
    )
    .unwrap();
    let x = Tensor::ones((2, 100), DType::F32, &dev).unwrap();
    let e = layer.forward_t(&x).unwrap_err();
    assert!(
        matches!(&e, fp8nsa::Error::Shape { arg: "x", expected, .. }
            if expected.contains("K of the weight")),
        "{e}"
    );
    let xi = Tensor::ones((2, 128), DType::U32, &dev).unwrap();
    assert!(layer.forward(&xi).is_err());
    let forced = layer.clone().with_cuda_kernel(CudaFp8Kernel::SmallM);
    let big = Tensor::ones((17, 128), DType::F32, &dev).unwrap();
    let e = forced.forward_t(&big).unwrap_err();
    assert!(
        matches!(&e, fp8nsa::Error::Cuda(fp8nsa::cuda::Error::Unsupported { reason, .. })
            if reason.contains("M = 17")),
        "{e}"
    );
    // backend argument checks
    let s = stream(&dev);
    let codes = s.clone_htod(&vec![0x38u8; 64 * 128]).unwrap();
    let scales = s.clone_htod(&[1f32]).unwrap();
    assert!(PreparedWeight::new(
        &s,
        &codes.as_view(),
        &scales.as_view(),
        [64, 100],
        [128, 128]
    )
    .is_err());
    let pw = PreparedWeight::new(
        &s,
        &codes.as_view(),
        &scales.as_view(),
        [64, 128],
        [128, 128],
    )
    .unwrap();
    let (pd, ps) = (pw.data_view(), pw.scales_view());
    let wref = pw.as_ref(&pd, &ps);
    let x = s.clone_htod(&vec![1f32; 2 * 128]).unwrap();
    let mut short = s.alloc_zeros::<f32>(64).unwrap();
    let e = kernels::fp8_linear(
        &s,
        &x.as_view(),
        &wref,
        None,
        2,
        ActQuant::Group,
        CudaFp8Kernel::Auto,
        &mut short.as_view_mut(),
    );
    let e = e.unwrap_err();
    assert!(
        matches!(e, fp8nsa::cuda::Error::Invalid { arg: "out", .. }),
        "{e}"
    );
    let mut out = s.alloc_zeros::<f32>(2 * 64).unwrap();
    let e = kernels::fp8_linear(
        &s,
        &x.as_view(),
        &wref,
        None,
        2,
        ActQuant::Block2d { bm: 0 },
        CudaFp8Kernel::Auto,
        &mut out.as_view_mut(),
    );
    assert!(e.is_err());
}

/// The grouped expert GEMM on the GPU (one launch for all experts) against the f64 reference:
/// decode routing (one row to each of 8 of 16 experts), prefill routing (empty groups, groups
/// past one tile), forced kernels, the masked call shape, and the MoE block against its CPU run.
#[test]
fn experts_grouped_against_reference() {
    use fp8nsa::{Fp8Experts, Fp8Moe};
    let Some(dev) = gpu("experts_grouped_against_reference") else {
        return;
    };
    let mut rng = rng("cuda_experts");
    let stack = |rng: &mut StdRng, e: usize, n: usize, k: usize, w_mag: f64| {
        (0..e)
            .map(|_| {
                let w = (tensor(hetero(rng, n, k, 128, 128), &[n, k]) * w_mag).unwrap();
                Fp8BlockWeight::quantize(&w, [128, 128]).unwrap()
            })
            .collect::<Vec<_>>()
    };
    let mut decode = vec![0usize; 16];
    for e in [0, 3, 4, 7, 9, 12, 14, 15] {
        decode[e] = 1;
    }
    for (n, k, counts, act, dtype) in [
        (576, 3884, decode.clone(), ActQuant::Group, DType::BF16),
        (768, 2048, vec![0, 130, 7, 33], ActQuant::Group, DType::F32),
        (
            576,
            3884,
            vec![5, 0, 19, 2],
            ActQuant::Block2d { bm: 3 },
            DType::BF16,
        ),
        (256, 1000, vec![3, 0, 17], ActQuant::None, DType::F16),
    ] {
        let e = counts.len();
        // f16 needs the scaled-down weights too: the first H100 run (2026-11-26) compared an
        // f16 output that had overflowed to inf with the f64 reference (rel err inf)
        let (w_mag, x_decades) = magnitudes(dtype);
        let ws = stack(&mut rng, e, n, k, w_mag);
        let t: usize = counts.iter().sum();
        let x = tensor(hetero_in(&mut rng, t, k, 1, 128, x_decades), &[t, k])
            .to_dtype(dtype)
            .unwrap();
        let want = reference::fp8_experts(&x, &ws, &counts, act).unwrap();
        if dtype == DType::F16 {
            // the data must fit the output type, or the comparison says nothing
            let peak = want.abs().unwrap().max_all().unwrap();
            let peak: f64 = peak.to_dtype(DType::F64).unwrap().to_scalar().unwrap();
            assert!(peak < 6.0e4, "test data overflows f16: {peak}");
        }
        let xg = x.to_device(&dev).unwrap();
        for kernel in [
            CudaFp8Kernel::Auto,
            CudaFp8Kernel::SmallM,
            CudaFp8Kernel::Mma,
        ] {
            let what = format!("n={n} k={k} {counts:?} {act:?} {dtype:?} {kernel:?}");
            let layer = Fp8Experts::new(&ws, act).unwrap().with_cuda_kernel(kernel);
            let got = layer.forward_contiguous(&xg, &counts);
            if kernel == CudaFp8Kernel::Mma && act == ActQuant::None {
                let err = got.expect_err(&what);
                assert!(
                    matches!(
                        &err,
                        fp8nsa::Error::Cuda(fp8nsa::cuda::Error::Unsupported { .. })
                    ),
                    "{what}: {err}"
                );
                continue;
            }
            let y = got.unwrap_or_else(|err| panic!("{what}: {err}"));
            assert!(y.device().is_cuda(), "{what}");
            assert_eq!((y.dims(), y.dtype()), (&[t, n][..], dtype), "{what}");
            let err = rel_frobenius(&y.to_device(&Device::Cpu).unwrap(), &want);
            assert!(err < tol(dtype), "{what}: rel err {err:e}");
        }
        // no grouped cuBLASLt: a typed refusal
        let err = Fp8Experts::new(&ws, act)
            .unwrap()
            .with_cuda_kernel(CudaFp8Kernel::CublasLt)
            .forward_contiguous(&xg, &counts)
            .unwrap_err();
        assert!(
            matches!(&err, fp8nsa::Error::Cuda(fp8nsa::cuda::Error::Unsupported { reason, .. })
                if reason.contains("no grouped form")),
            "{err}"
        );
    }

    // the masked shape: slots of 4 rows, counts per expert, other rows zero
    let (e, n, k, m) = (5, 200, 384, 4);
    let ws = stack(&mut rng, e, n, k, 1.0);
    let layer = Fp8Experts::new(&ws, ActQuant::Group).unwrap();
    let x = tensor(gaussian(&mut rng, e * m * k), &[e, m, k]);
    let counts = [2, 0, 4, 1, 3];
    let cpu = layer.forward_masked(&x, &counts).unwrap();
    let gpu_y = layer
        .forward_masked(&x.to_device(&dev).unwrap(), &counts)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap();
    let err = rel_frobenius(&gpu_y, &cpu);
    assert!(err < 1e-4, "masked: rel err {err:e}");
    let rows: Vec<Vec<Vec<f32>>> = gpu_y.to_vec3().unwrap();
    for (i, &c) in counts.iter().enumerate() {
        assert!(
            rows[i][c..].iter().flatten().all(|&v| v == 0.0),
            "expert {i}: slot rows past {c}"
        );
    }

    // the MoE block: CUDA against its CPU run, bf16 in and out
    let (e, h, i, top_k) = (8, 256, 384, 2);
    let mk = |n: usize, k: usize, rng: &mut StdRng| {
        Fp8Experts::new(&stack(rng, e, n, k, 1.0), ActQuant::Group).unwrap()
    };
    let router = tensor(gaussian(&mut rng, e * h), &[e, h]);
    let moe = Fp8Moe::new(
        router,
        mk(i, h, &mut rng),
        mk(i, h, &mut rng),
        mk(h, i, &mut rng),
        top_k,
        true,
    )
    .unwrap();
    let x = tensor(gaussian(&mut rng, 5 * h), &[5, h])
        .to_dtype(DType::BF16)
        .unwrap();
    let cpu = moe.forward(&x).unwrap().to_dtype(DType::F32).unwrap();
    let y = moe.forward(&x.to_device(&dev).unwrap()).unwrap();
    assert!(y.device().is_cuda());
    let err = rel_frobenius(
        &y.to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap(),
        &cpu,
    );
    assert!(err < 8e-3, "moe: rel err {err:e}");
}

/// A whole decoder on the GPU (`ModelOptions::device`, what `fp8nsa serve --device cuda`
/// builds): a ragged batch step (two prefills of different lengths, then a decode token each)
/// gives the CPU model's logits, with dense and with fp8 W8A16 projections (no activation
/// rounding, so the two devices differ by f32 sums only: 1e-4 dense; 2e-3 fp8, this file's f32
/// bound for one projection, 1e-3, over four layers; a wrong kernel is order 1), the KV pages
/// live on the GPU, and the serving engine completes greedy requests there with every page
/// back at the end.
#[test]
fn decoder_and_engine_on_the_gpu() {
    use fp8nsa::models::{
        BatchSeq, Engine, EngineConfig, Event, LinearKind, Llama, LlamaConfig, Logits,
        ModelOptions, Request, Sampling, Weights,
    };
    let Some(dev) = gpu("decoder_and_engine_on_the_gpu") else {
        return;
    };
    let cfg = LlamaConfig::tiny();
    let w = Weights::random(&cfg, 17).unwrap();
    let fp8 = LinearKind::Fp8 {
        block: [128, 128],
        act: ActQuant::None,
    };
    for linear in [LinearKind::Dense, fp8] {
        let build = |device: Option<Device>| {
            let opts = ModelOptions {
                linear,
                device,
                ..ModelOptions::default()
            };
            Llama::new(&cfg, &w, &opts).unwrap()
        };
        let (host, on_gpu) = (build(None), build(Some(dev.clone())));
        assert!(on_gpu.device().is_cuda() && host.device().is_cpu());
        let steps: [&[&[u32]]; 2] = [&[&[1, 5, 9, 13, 17], &[2, 4, 6]], &[&[21], &[8]]];
        let mut got = Vec::new();
        for m in [&host, &on_gpu] {
            let pool = m.new_kv_pool(16, 16, DType::F32).unwrap();
            let (mut a, mut b) = (pool.new_seq(), pool.new_seq());
            let mut logits = Vec::new();
            for step in steps {
                let mut batch = [
                    BatchSeq {
                        tokens: step[0],
                        kv: &mut a,
                    },
                    BatchSeq {
                        tokens: step[1],
                        kv: &mut b,
                    },
                ];
                let out = m.forward_batch(&pool, &mut batch, Logits::All).unwrap();
                for l in out {
                    assert_eq!(l.device().is_cuda(), m.device().is_cuda());
                    logits.push(l.to_device(&Device::Cpu).unwrap());
                }
            }
            drop((a, b));
            assert_eq!(pool.free_pages(), 16, "{linear:?}: pages back");
            got.push(logits);
        }
        let bound = if linear == LinearKind::Dense {
            1e-4
        } else {
            2e-3
        };
        for (i, (h, g)) in got[0].iter().zip(&got[1]).enumerate() {
            let err = rel_frobenius(g, h);
            assert!(err < bound, "{linear:?} output {i}: {err:.2e}");
        }
    }
    // the engine on the GPU: greedy requests of mixed lengths complete, pages back to 0
    let model = Llama::new(
        &cfg,
        &w,
        &ModelOptions {
            device: Some(dev.clone()),
            ..ModelOptions::default()
        },
    )
    .unwrap();
    let mut engine = Engine::new(
        model,
        EngineConfig {
            kv_pages: 32,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    for id in 0..4u64 {
        let prompt: Vec<u32> = (0..3 + 5 * id as u32).map(|t| (7 * t + 3) % 500).collect();
        let req = Request {
            prompt,
            max_tokens: 6,
            sampling: Sampling::Greedy,
            stop_tokens: vec![],
        };
        engine.add(id, req).unwrap();
    }
    let (mut tokens, mut finished) = (0, 0);
    while engine.has_work() {
        for e in engine.step() {
            match e {
                Event::Token { .. } => tokens += 1,
                Event::Finished { .. } => finished += 1,
                Event::Failed { id, error } => panic!("request {id} failed on the GPU: {error}"),
            }
        }
    }
    assert_eq!((tokens, finished, engine.stats().pages_used), (24, 4, 0));
}
