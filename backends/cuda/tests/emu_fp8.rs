//! The fp8 linear plans, kernels included, run on the CPU emulator against the f64 reference:
//! every path on non-aligned shapes, M = 1 and odd M, heterogeneous block scales, outputs
//! poisoned first. (`cargo test -p fp8nsa-cuda --features emu`; no GPU involved.)

use candle_core::{DType, Device, Tensor};
use fp8nsa_cuda::emu::{execute, HostBuf};
use fp8nsa_cuda::fp8::{plan_fp8_linear, plan_pad_rows, CudaFp8Path, MmaTile, WeightLayout};
use fp8nsa_cuda::step::Dtype;
use fp8nsa_ops::{reference, ActQuant, Fp8BlockWeight};
use fp8nsa_test_support::{hetero, rng};
use rand::rngs::StdRng;

/// Relative Frobenius error of host results against the f64 reference.
fn rel_frobenius(y: &[f64], want: &[f64]) -> f64 {
    let num: f64 = y.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
    let den: f64 = want.iter().map(|b| b * b).sum();
    (num / den).sqrt()
}

fn dtype_of(d: Dtype) -> DType {
    match d {
        Dtype::F32 => DType::F32,
        Dtype::Bf16 => DType::BF16,
        Dtype::F16 => DType::F16,
    }
}

/// Host bytes of a candle tensor in its own dtype.
fn bytes_of(t: &Tensor) -> HostBuf {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::F32 => HostBuf::from_slice(&t.to_vec1::<f32>().unwrap()),
        DType::BF16 => HostBuf::from_slice(&t.to_vec1::<half::bf16>().unwrap()),
        DType::F16 => HostBuf::from_slice(&t.to_vec1::<half::f16>().unwrap()),
        DType::U8 => HostBuf::from_slice(&t.to_vec1::<u8>().unwrap()),
        other => panic!("{other:?}"),
    }
}

fn to_f64(b: &HostBuf, d: Dtype) -> Vec<f64> {
    match d {
        Dtype::F32 => b.to_vec::<f32>().into_iter().map(f64::from).collect(),
        Dtype::Bf16 => b
            .to_vec::<half::bf16>()
            .into_iter()
            .map(|x| x.to_f64())
            .collect(),
        Dtype::F16 => b
            .to_vec::<half::f16>()
            .into_iter()
            .map(|x| x.to_f64())
            .collect(),
    }
}

struct Case {
    m: usize,
    n: usize,
    k: usize,
    block: [usize; 2],
    act: ActQuant,
    dtype: Dtype,
    bias: bool,
}

fn scheme(a: ActQuant) -> ActQuant {
    match a {
        ActQuant::None => ActQuant::None,
        ActQuant::Group => ActQuant::Group,
        ActQuant::Block2d { bm } => ActQuant::Block2d { bm },
    }
}

/// The paths that apply to a case (as the planner's rules say), with K splits to exercise.
fn paths(c: &Case) -> Vec<CudaFp8Path> {
    let mut p = vec![CudaFp8Path::Dequant];
    if c.m <= 16 && c.block[1].is_multiple_of(16) {
        p.push(CudaFp8Path::SmallM {
            tokens: c.m.next_power_of_two(),
        });
    }
    if c.act != ActQuant::None && c.block[1].is_multiple_of(128) {
        for tile in [MmaTile::M16, MmaTile::M64, MmaTile::M128] {
            for splits in [1, 3] {
                p.push(CudaFp8Path::Mma { tile, splits });
            }
        }
    }
    if c.block == [128, 128] && c.act == ActQuant::Group && c.n.is_multiple_of(16) {
        p.push(CudaFp8Path::CublasLt);
    }
    p
}

/// The weight in the kernels' layout, padded by the backend's own plans: (layout, codes,
/// scales).
fn kernel_weight(wq: &Fp8BlockWeight) -> (WeightLayout, HostBuf, HostBuf) {
    let [n, k] = wq.shape();
    let layout = WeightLayout::new([n, k], wq.block()).unwrap();
    let [nb, kb] = layout.scale_dims();
    let (mut codes, mut scales) = (bytes_of(wq.data()), bytes_of(wq.scales()));
    let mut wd = HostBuf::new(n * layout.ld);
    let mut ws = HostBuf::new(4 * nb * layout.scale_ld);
    execute(
        &plan_pad_rows::<u8>(n, k, layout.ld),
        &mut [&mut codes, &mut wd],
    )
    .unwrap();
    execute(
        &plan_pad_rows::<f32>(nb, kb, layout.scale_ld),
        &mut [&mut scales, &mut ws],
    )
    .unwrap();
    (layout, wd, ws)
}

/// The f64 reference output, flattened.
fn reference_f64(x: &Tensor, wq: &Fp8BlockWeight, b: Option<&Tensor>, act: ActQuant) -> Vec<f64> {
    reference::fp8_linear(x, wq, b, act)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn run(rng: &mut StdRng, c: &Case) {
    let Case {
        m,
        n,
        k,
        block,
        act,
        dtype,
        bias,
    } = *c;
    let w = Tensor::from_vec(hetero(rng, n, k, block[0], block[1]), (n, k), &Device::Cpu).unwrap();
    let wq = Fp8BlockWeight::quantize(&w, block).unwrap();
    let x_mag = if dtype == Dtype::F16 { 1e-4 } else { 1.0 };
    let x = (Tensor::from_vec(hetero(rng, m, k, 1, block[1]), (m, k), &Device::Cpu).unwrap()
        * x_mag)
        .unwrap()
        .to_dtype(dtype_of(dtype))
        .unwrap();
    let b = bias.then(|| {
        Tensor::from_vec(
            (0..n).map(|i| (i as f32 * 0.37).sin()).collect::<Vec<_>>(),
            n,
            &Device::Cpu,
        )
        .unwrap()
    });
    let want = reference_f64(&x, &wq, b.as_ref(), act);

    let (layout, mut wd, mut ws) = kernel_weight(&wq);

    let mut xb = bytes_of(&x);
    let mut bb = match &b {
        Some(b) => bytes_of(b),
        None => HostBuf::new(4),
    };
    let tol = if dtype == Dtype::F32 { 1e-3 } else { 8e-3 };
    for path in paths(c) {
        let what = format!("m={m} n={n} k={k} {block:?} {act:?} {dtype:?} bias={bias} {path}");
        let mut out = HostBuf::new(m * n * dtype.size());
        let plan = plan_fp8_linear(&layout, m, scheme(act), path, dtype, bias, true);
        execute(&plan, &mut [&mut xb, &mut wd, &mut ws, &mut bb, &mut out])
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let y = to_f64(&out, dtype);
        assert!(
            y.iter().all(|v| v.is_finite()),
            "{what}: unwritten or non-finite output"
        );
        let err = rel_frobenius(&y, &want);
        assert!(err < tol, "{what}: rel err {err:e}");
    }
}

#[test]
fn contract_shapes_every_path() {
    let mut rng = rng("emu_contract_shapes");
    // N = 576 (not a multiple of 128), K = 3884 (not a multiple of 16), M = 1 and odd M
    for (m, block, act, dtype) in [
        (1, [128, 128], ActQuant::Group, Dtype::Bf16),
        (7, [128, 128], ActQuant::Group, Dtype::F32),
        (7, [256, 256], ActQuant::Block2d { bm: 4 }, Dtype::F16),
        (1, [64, 128], ActQuant::None, Dtype::Bf16),
        (17, [512, 512], ActQuant::Group, Dtype::Bf16),
    ] {
        run(
            &mut rng,
            &Case {
                m,
                n: 576,
                k: 3884,
                block,
                act,
                dtype,
                bias: m % 2 == 1,
            },
        );
    }
}

#[test]
fn tiles_rows_and_splits() {
    let mut rng = rng("emu_tiles");
    // M past one 128-row tile, partial tiles in M and N, K not a multiple of 128
    for (m, n, k, block, act, dtype) in [
        (130, 136, 300, [128, 128], ActQuant::Group, Dtype::Bf16),
        (
            83,
            130,
            520,
            [64, 128],
            ActQuant::Block2d { bm: 5 },
            Dtype::F32,
        ),
        (16, 24, 1000, [8, 256], ActQuant::Group, Dtype::F16),
        (2, 5, 7, [2, 3], ActQuant::Group, Dtype::F32),
        // a token count cuBLASLt takes as it is (no padding tokens, output written directly)
        (32, 144, 384, [128, 128], ActQuant::Group, Dtype::Bf16),
        (3, 40, 300, [16, 16], ActQuant::None, Dtype::F32),
    ] {
        run(
            &mut rng,
            &Case {
                m,
                n,
                k,
                block,
                act,
                dtype,
                bias: true,
            },
        );
    }
}

/// A forgotten wait, a missing barrier or a divergent collective must fail loudly in the
/// emulator rather than compute garbage quietly: a deliberately broken launch (block size
/// not a multiple of 32 for a kernel with warp collectives) is reported as an error.
#[test]
fn emulator_reports_bad_launches() {
    use fp8nsa_cuda::step::{Kernel, Step};
    let layout = WeightLayout::new([16, 128], [128, 128]).unwrap();
    let mut plan = plan_fp8_linear(
        &layout,
        1,
        ActQuant::Group,
        CudaFp8Path::SmallM { tokens: 1 },
        Dtype::F32,
        false,
        true,
    );
    for s in &mut plan.steps {
        if let Step::Kernel(Kernel { block, .. }) = s {
            *block = 48;
        }
    }
    let mut x = HostBuf::from_slice(&[1f32; 128]);
    let mut w = HostBuf::from_slice(&[0x38u8; 16 * 128]);
    let mut s = HostBuf::from_slice(&[1f32; 4]);
    let mut b = HostBuf::new(4);
    let mut o = HostBuf::new(4 * 16);
    let e = execute(&plan, &mut [&mut x, &mut w, &mut s, &mut b, &mut o]).unwrap_err();
    assert!(e.to_string().contains("full warp"), "{e}");
}

/// The activation kernel covers any number of scale tiles with any grid (warps stride over
/// the tiles): with its grid cut to one block, every path still matches the reference.
#[test]
fn activation_tiles_beyond_the_grid() {
    use fp8nsa_cuda::step::{Kernel, Step};
    let mut rng = rng("emu_act_stride");
    let (m, n, k, block) = (37, 64, 700, [64, 128]);
    let w = Tensor::from_vec(hetero(&mut rng, n, k, 64, 128), (n, k), &Device::Cpu).unwrap();
    let wq = Fp8BlockWeight::quantize(&w, block).unwrap();
    let x = Tensor::from_vec(hetero(&mut rng, m, k, 1, 128), (m, k), &Device::Cpu).unwrap();
    let (layout, mut wd, mut ws) = kernel_weight(&wq);
    let mut xb = bytes_of(&x);
    let mut bias = HostBuf::new(4);
    for (act, path) in [
        (
            ActQuant::Group,
            CudaFp8Path::Mma {
                tile: MmaTile::M64,
                splits: 1,
            },
        ),
        (
            ActQuant::Block2d { bm: 3 },
            CudaFp8Path::Mma {
                tile: MmaTile::M16,
                splits: 2,
            },
        ),
        (ActQuant::Group, CudaFp8Path::Dequant),
    ] {
        let mut plan = plan_fp8_linear(&layout, m, scheme(act), path, Dtype::F32, false, true);
        for s in &mut plan.steps {
            if let Step::Kernel(Kernel { name, grid, .. }) = s {
                if name.starts_with("fp8nsa_act_quant") {
                    *grid = (1, 1, 1);
                }
            }
        }
        let mut out = HostBuf::new(4 * m * n);
        execute(&plan, &mut [&mut xb, &mut wd, &mut ws, &mut bias, &mut out]).unwrap();
        let want = reference_f64(&x, &wq, None, act);
        let err = rel_frobenius(&to_f64(&out, Dtype::F32), &want);
        assert!(err < 1e-3, "{act:?} {path}: rel err {err:e}");
    }
}

/// Stacked expert weights in the kernels' layout, each expert padded by the backend's own plan.
fn kernel_experts(ws: &[Fp8BlockWeight]) -> (WeightLayout, HostBuf, HostBuf) {
    let mut codes = Vec::new();
    let mut scales = Vec::new();
    let mut layout = None;
    for w in ws {
        let (l, wd, sd) = kernel_weight(w);
        layout = Some(l);
        codes.extend(wd.to_vec::<u8>());
        scales.extend(sd.to_vec::<f32>());
    }
    (
        layout.expect("at least one expert"),
        HostBuf::from_slice(&codes),
        HostBuf::from_slice(&scales),
    )
}

/// The grouped expert GEMM (both kernels' grouped forms) against the f64 reference: empty
/// groups, a group of one, groups past one 16-row chunk and one 64-row tile, non-aligned N
/// and K, every activation scheme, outputs poisoned first.
#[test]
fn grouped_experts_every_path() {
    use fp8nsa_cuda::fp8::{plan_fp8_grouped, row_offsets};
    let mut rng = rng("emu_grouped");
    for (e, n, k, block, act, dtype, counts) in [
        // decode: one row to each of a few experts
        (
            6,
            576,
            3884,
            [128, 128],
            ActQuant::Group,
            Dtype::Bf16,
            vec![1, 0, 0, 1, 1, 0],
        ),
        (
            4,
            72,
            300,
            [64, 128],
            ActQuant::Block2d { bm: 3 },
            Dtype::F32,
            vec![5, 0, 19, 2],
        ),
        (
            3,
            130,
            520,
            [128, 256],
            ActQuant::Group,
            Dtype::F16,
            vec![0, 70, 9],
        ),
        (
            5,
            40,
            200,
            [16, 16],
            ActQuant::None,
            Dtype::F32,
            vec![3, 1, 0, 18, 2],
        ),
    ] {
        let experts: Vec<Fp8BlockWeight> = (0..e)
            .map(|_| {
                let w = Tensor::from_vec(
                    hetero(&mut rng, n, k, block[0], block[1]),
                    (n, k),
                    &Device::Cpu,
                )
                .unwrap();
                Fp8BlockWeight::quantize(&w, block).unwrap()
            })
            .collect();
        let t: usize = counts.iter().sum();
        let x_mag = if dtype == Dtype::F16 { 1e-4 } else { 1.0 };
        let x = (Tensor::from_vec(hetero(&mut rng, t, k, 1, block[1]), (t, k), &Device::Cpu)
            .unwrap()
            * x_mag)
            .unwrap()
            .to_dtype(dtype_of(dtype))
            .unwrap();
        let want: Vec<f64> = reference::fp8_experts(&x, &experts, &counts, act)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let (layout, mut wd, mut ws) = kernel_experts(&experts);
        let mut xb = bytes_of(&x);
        let mut offsets = HostBuf::from_slice(&row_offsets(&counts));
        let most = *counts.iter().max().unwrap();
        let mut paths = vec![CudaFp8Path::SmallM {
            tokens: most.min(16).next_power_of_two(),
        }];
        if act != ActQuant::None && block[1] % 128 == 0 {
            paths.extend(
                [MmaTile::M16, MmaTile::M64, MmaTile::M128]
                    .map(|tile| CudaFp8Path::Mma { tile, splits: 1 }),
            );
        }
        let tol = if dtype == Dtype::F32 { 1e-3 } else { 8e-3 };
        for path in paths {
            let what = format!("e={e} n={n} k={k} {block:?} {act:?} {dtype:?} {counts:?} {path}");
            let plan = plan_fp8_grouped(&layout, &counts, scheme(act), path, dtype).unwrap();
            let mut out = HostBuf::new(t * n * dtype.size());
            execute(
                &plan,
                &mut [&mut xb, &mut wd, &mut ws, &mut offsets, &mut out],
            )
            .unwrap_or_else(|err| panic!("{what}: {err}"));
            let y = to_f64(&out, dtype);
            assert!(
                y.iter().all(|v| v.is_finite()),
                "{what}: unwritten or non-finite output"
            );
            let err = rel_frobenius(&y, &want);
            assert!(err < tol, "{what}: rel err {err:e}");
        }
    }
}

/// docs/numerics.md, non-finite activations: on every path, a token holding NaN or ±Inf gets
/// NaN outputs and leaves every other token bit-for-bit as with zeros in its place, with
/// `Block2d` too, where tokens share a scale.
#[test]
fn non_finite_activations_stay_in_their_token() {
    let mut rng = rng("emu_fp8_non_finite");
    let (m, n, k, block) = (9, 64, 384, [128, 128]);
    let w = Tensor::from_vec(hetero(&mut rng, n, k, 128, 128), (n, k), &Device::Cpu).unwrap();
    let wq = Fp8BlockWeight::quantize(&w, block).unwrap();
    let (layout, mut wd, mut ws) = kernel_weight(&wq);
    let x: Vec<f32> = hetero(&mut rng, m, k, 1, 128);
    let pokes = [
        (0, 3, f32::NAN),
        (4, k - 1, f32::INFINITY),
        (8, 0, f32::NEG_INFINITY),
    ];
    let (mut bad, mut zero) = (x.clone(), x);
    for &(r, c, v) in &pokes {
        bad[r * k + c] = v;
        zero[r * k + c] = 0.0;
    }
    for act in [ActQuant::Group, ActQuant::Block2d { bm: 4 }] {
        let c = Case {
            m,
            n,
            k,
            block,
            act,
            dtype: Dtype::F32,
            bias: false,
        };
        for path in paths(&c) {
            let what = format!("{act:?} {path}");
            let plan = plan_fp8_linear(&layout, m, scheme(act), path, Dtype::F32, false, true);
            let mut run = |x: &[f32]| {
                let (mut xb, mut bb) = (HostBuf::from_slice(x), HostBuf::new(4));
                let mut out = HostBuf::new(m * n * 4);
                execute(&plan, &mut [&mut xb, &mut wd, &mut ws, &mut bb, &mut out])
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                out.to_vec::<f32>()
            };
            let (y, y0) = (run(&bad), run(&zero));
            for r in 0..m {
                let (a, b) = (&y[r * n..(r + 1) * n], &y0[r * n..(r + 1) * n]);
                if pokes.iter().any(|p| p.0 == r) {
                    assert!(
                        a.iter().all(|v| v.is_nan()),
                        "{what}: row {r} {:?}",
                        &a[..4]
                    );
                } else {
                    assert!(b.iter().all(|v| v.is_finite()), "{what}: row {r}");
                    assert_eq!(a, b, "{what}: row {r}");
                }
            }
        }
    }
}

/// The dense small-M kernel at every group width its launch rule picks (K of 200, 1000, 1500,
/// 3884 columns: 32, 64, 128, 256 threads per group, so 8, 4, 2, 1 groups per CTA), N odd
/// (the last CTA's groups partly past N), 1 to 5 tokens, against the f64 reference.
#[test]
fn small_m_every_group_width() {
    let mut rng = rng("emu_fp8_small_m_widths");
    for (k, m, dtype) in [
        (200, 1, Dtype::Bf16),
        (1000, 2, Dtype::F32),
        (1500, 3, Dtype::F16),
        (3884, 4, Dtype::Bf16),
        (1000, 5, Dtype::F32),
    ] {
        run(
            &mut rng,
            &Case {
                m,
                n: 1001,
                k,
                block: [128, 128],
                act: ActQuant::Group,
                dtype,
                bias: true,
            },
        );
    }
}
