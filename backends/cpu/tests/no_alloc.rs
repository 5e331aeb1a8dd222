//! A decode step's kernels allocate nothing once warm: the fp8 products (one row, a few rows,
//! the small-batch panel, fused q/k/v and gate/up with SwiGLU), the decode attention over a
//! contiguous cache and over pages (f32 and f16, split between threads or not), RoPE and the
//! residual add with its norm, on every SIMD tier this CPU has. Each call's temporaries come
//! from per-thread buffers kept from earlier calls.
//!
//! The whole binary counts every thread's allocations, so it holds this one test.

use fp8nsa_cpu::linear::{plan, run_fused, run_swiglu, FusedPart};
use fp8nsa_cpu::nsa::{decode_attention, decode_attention_paged, HeadMajor, PagedSeq};
use fp8nsa_cpu::quant::quantize_weight;
use fp8nsa_test_support::alloc::CountingAlloc;
use fp8nsa_test_support::{gaussian, rng};
use fp8nsa_types::{ActQuant, AttnDims, LinearShape, RopeStyle, Tier};

#[global_allocator]
static COUNTER: CountingAlloc = CountingAlloc::new();

/// How many allocations `f` makes on any thread once warm. Warm means every thread of rayon's
/// pool has run `f` alone once (one thread at a time, the others held back, so each runs every
/// task of each call itself and fills its own kept buffers), and then two ordinary calls. The
/// counted calls run on a pool thread, as a model's step does: from outside, every parallel
/// kernel would queue its work in the pool's injector, which takes a new block of slots every
/// 63 jobs.
fn allocs_when_warm(f: impl FnMut() + Send) -> u64 {
    let f = std::sync::Mutex::new(f);
    let call = || {
        let mut f = f.lock().unwrap();
        (*f)()
    };
    rayon::broadcast(|_| call());
    rayon::scope(|_| {
        call();
        call();
        COUNTER.start();
        for _ in 0..3 {
            call();
        }
        COUNTER.stop().0
    })
}

/// An e4m3 weight `[n, k]` in 128 x 128 blocks of heterogeneous scales, and its scales.
fn weight(r: &mut rand::rngs::StdRng, n: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    let w: Vec<f32> = gaussian(r, n * k)
        .iter()
        .enumerate()
        .map(|(i, x)| x * 10f32.powi((i / k / 128 + i % k / 128) as i32 % 7 - 3))
        .collect();
    quantize_weight(&w, n, k, 128, 128).unwrap()
}

/// A head-major cache of 3 heads of `rows` rows of 64.
fn pool<T>(data: &[T], rows: usize) -> HeadMajor<'_, T> {
    HeadMajor {
        data,
        head_stride: rows * 64,
    }
}

#[test]
fn decode_kernels_allocate_nothing_once_warm() {
    let mut r = rng("decode_kernels_allocate_nothing_once_warm");
    // SmolLM2's shapes: hidden 576, q/k/v 576 + 192 + 192, MLP 1536; and an odd K
    let (h, inter) = (576, 1536);
    let (wq, sq) = weight(&mut r, 576, h);
    let (wk, sk) = weight(&mut r, 192, h);
    let (wv, sv) = weight(&mut r, 192, h);
    let (wg, sg) = weight(&mut r, inter, h);
    let (wu, su) = weight(&mut r, inter, h);
    let (wd, sd) = weight(&mut r, h, inter);
    let (wo, so) = weight(&mut r, 576, 300);
    // a 16-row batch's worth of activations, of which each call takes its rows
    let x = gaussian(&mut r, 16 * inter);
    let mut y = vec![0f32; 16 * inter];
    let mut y2 = vec![0f32; 16 * inter];
    let mut y3 = vec![0f32; 16 * inter];

    // decode attention: SmolLM2's 9 query / 3 kv heads of 64 (three units on two threads split
    // their keys), a 700-row cache, and a paged pool of the same rows
    let dims = AttnDims::new(9, 3, 64, 64).unwrap();
    let rows = 720;
    let kf = gaussian(&mut r, 3 * rows * 64);
    let vf = gaussian(&mut r, 3 * rows * 64);
    let kh: Vec<half::f16> = kf.iter().map(|&x| half::f16::from_f32(x)).collect();
    let vh: Vec<half::f16> = vf.iter().map(|&x| half::f16::from_f32(x)).collect();
    let q = gaussian(&mut r, 2 * 9 * 64);
    let mut o = vec![0f32; 2 * 9 * 64];
    let pages_a: Vec<usize> = (0..45).rev().collect();
    let pages_b: Vec<usize> = (0..20).collect();
    let seqs = [
        PagedSeq {
            pages: &pages_a,
            len: 700,
        },
        PagedSeq {
            pages: &pages_b,
            len: 300,
        },
    ];

    // RoPE tables and a norm's weights
    let (cos, sin) = (gaussian(&mut r, 1024 * 32), gaussian(&mut r, 1024 * 32));
    let alpha = gaussian(&mut r, h);
    let mut sum = vec![0f32; h];

    for tier in Tier::available() {
        Tier::cap(tier);
        let check = |what: &str, f: &mut (dyn FnMut() + Send)| {
            let n = allocs_when_warm(&mut *f);
            assert_eq!(
                n, 0,
                "{tier:?}: {what} allocated {n} times in three warm calls"
            );
        };
        for m in [1, 3, 8, 16] {
            let p = |n: usize, k: usize| {
                plan(
                    LinearShape::new(m, n, k, 128, 128).unwrap(),
                    ActQuant::Group,
                )
                .unwrap()
            };
            let (pq, pk, pv) = (p(576, h), p(192, h), p(192, h));
            let (pg, pu, pd, po) = (p(inter, h), p(inter, h), p(h, inter), p(576, 300));
            check(&format!("a {m}-row product"), &mut || {
                pd.run(&x[..m * inter], &wd, &sd, None, &mut y[..m * h])
                    .unwrap()
            });
            check(&format!("a {m}-row product, K = 300"), &mut || {
                po.run(&x[..m * 300], &wo, &so, None, &mut y[..m * 576])
                    .unwrap()
            });
            check(&format!("{m}-row q/k/v"), &mut || {
                let parts = [
                    FusedPart {
                        plan: pq,
                        w: &wq,
                        sw: &sq,
                        bias: None,
                    },
                    FusedPart {
                        plan: pk,
                        w: &wk,
                        sw: &sk,
                        bias: None,
                    },
                    FusedPart {
                        plan: pv,
                        w: &wv,
                        sw: &sv,
                        bias: None,
                    },
                ];
                let mut outs = [&mut y[..m * 576], &mut y2[..m * 192], &mut y3[..m * 192]];
                run_fused(&x[..m * h], &parts, &mut outs).unwrap()
            });
            check(&format!("{m}-row gate/up with SwiGLU"), &mut || {
                let gate = FusedPart {
                    plan: pg,
                    w: &wg,
                    sw: &sg,
                    bias: None,
                };
                let up = FusedPart {
                    plan: pu,
                    w: &wu,
                    sw: &su,
                    bias: None,
                };
                run_swiglu(&x[..m * h], gate, up, &mut y[..m * inter]).unwrap()
            });
        }
        check("decode attention, f32 cache", &mut || {
            let (k, v) = (pool(&kf, rows), pool(&vf, rows));
            decode_attention(&q[..9 * 64], k, v, dims, 700, 0.125, &mut o[..9 * 64]).unwrap()
        });
        check("decode attention, f16 cache", &mut || {
            let (k, v) = (pool(&kh, rows), pool(&vh, rows));
            decode_attention(&q[..9 * 64], k, v, dims, 700, 0.125, &mut o[..9 * 64]).unwrap()
        });
        check(
            "paged decode attention of two sequences, f16 pages",
            &mut || {
                let (k, v) = (pool(&kh, rows), pool(&vh, rows));
                decode_attention_paged(&q, k, v, dims, 16, &seqs, 0.125, &mut o).unwrap()
            },
        );
        check("RoPE of one token", &mut || {
            fp8nsa_cpu::rope::rope(
                &x[..9 * 64],
                9,
                64,
                &[700],
                &cos,
                &sin,
                RopeStyle::Half,
                &mut y[..9 * 64],
            )
            .unwrap()
        });
        check("residual add and RMSNorm of one row", &mut || {
            fp8nsa_cpu::act::add_rms_norm(
                &x[..h],
                &x[h..2 * h],
                &alpha,
                1e-5,
                &mut sum,
                &mut y[..h],
            )
            .unwrap()
        });
    }
    Tier::cap(Tier::Avx512Bf16);
}
