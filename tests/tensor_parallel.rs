//! Tensor parallelism on the CPU (issue: tensor parallel, first step): world sizes 1..4 over
//! the contract's shapes (N = 576, K = 3884 in 128x128 blocks), every rank a thread with a
//! `HostGroup` handle. Column-parallel + all-gather equals the whole layer bit for bit;
//! row-parallel + all-reduce equals it up to the order of the sum; a sharded SwiGLU MLP equals
//! the unsharded one, and so do a sharded attention block (whole heads per rank) and an
//! expert-parallel MoE block; `load_shard` / `load_range` read exactly the blocks `shard` /
//! `slice` keep; a split that would cut a block or a head is an error naming the world sizes
//! that work.

use candle_core::{DType, Device, Tensor};
use fp8nsa::fp8::{
    ColumnParallel, Communicator, ExpertParallel, HostGroup, RowParallel, Shard, Split,
};
use fp8nsa::{ActQuant, Error, Fp8BlockWeight, Fp8Experts, Fp8Linear, Fp8Moe, MoeRouter};
use fp8nsa_test_support::*;

const BLOCK: [usize; 2] = [128, 128];

/// Runs `f(rank handle)` on one thread per rank; results in rank order.
fn on_ranks<T: Send>(world: usize, f: impl Fn(&HostGroup) -> T + Sync) -> Vec<T> {
    let handles = HostGroup::new(world);
    std::thread::scope(|s| {
        let jobs: Vec<_> = handles.iter().map(|c| s.spawn(|| f(c))).collect();
        jobs.into_iter().map(|j| j.join().unwrap()).collect()
    })
}

fn weight(rng: &mut rand::rngs::StdRng, n: usize, k: usize) -> Fp8BlockWeight {
    Fp8BlockWeight::quantize(&tensor(hetero(rng, n, k, 128, 128), &[n, k]), BLOCK).unwrap()
}

#[test]
fn column_and_row_parallel_equal_the_whole_layer() {
    let mut rng = rng("tp_layers");
    let (n, k) = (576, 3884);
    let w = weight(&mut rng, n, k);
    let bias = tensor(gaussian(&mut rng, n), &[n]);
    for act in [ActQuant::Group, ActQuant::Block2d { bm: 4 }] {
        let whole = Fp8Linear::new(w.clone(), Some(bias.clone()), act).unwrap();
        for m in [1, 7] {
            let x = tensor(hetero(&mut rng, m, k, 1, 128), &[m, k]);
            let want = whole.forward_t(&x).unwrap();
            for world in 1..=4 {
                let what = format!("{act:?} m={m} world={world}");
                let cols = on_ranks(world, |c| {
                    let shard = Shard {
                        rank: c.rank(),
                        world_size: world,
                    };
                    let layer = ColumnParallel::new(&w, Some(&bias), act, shard).unwrap();
                    c.all_gather(&layer.forward(&x).unwrap(), 1).unwrap()
                });
                for y in &cols {
                    let (a, b): (Vec<f32>, Vec<f32>) = (
                        y.flatten_all().unwrap().to_vec1().unwrap(),
                        want.flatten_all().unwrap().to_vec1().unwrap(),
                    );
                    assert_eq!(a, b, "column, {what}");
                }
                let rows = on_ranks(world, |c| {
                    let shard = Shard {
                        rank: c.rank(),
                        world_size: world,
                    };
                    let layer = RowParallel::new(&w, Some(&bias), act, shard).unwrap();
                    let x_r = x.narrow(1, layer.inputs.start, layer.inputs.len()).unwrap();
                    layer.forward(&x_r, c).unwrap()
                });
                for y in &rows {
                    let err = rel_frobenius(y, &want);
                    assert!(err < 1e-5, "row, {what}: {err:e}");
                    assert_eq!(
                        y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        rows[0].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        "row, {what}: ranks disagree"
                    );
                }
            }
        }
    }
    // a bias that is not [N] is refused before it is sliced
    let shard = Shard {
        rank: 1,
        world_size: 2,
    };
    let short = bias.narrow(0, 0, n - 1).unwrap();
    let e = ColumnParallel::new(&w, Some(&short), ActQuant::Group, shard)
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(&e, Error::Shape { arg: "bias", .. }), "{e}");
}

#[test]
fn a_sharded_mlp_equals_the_whole_one() {
    let mut rng = rng("tp_mlp");
    let (hidden, inter, m) = (576, 1408, 5);
    let (gate, up, down) = (
        weight(&mut rng, inter, hidden),
        weight(&mut rng, inter, hidden),
        weight(&mut rng, hidden, inter),
    );
    let x = tensor(gaussian(&mut rng, m * hidden), &[m, hidden]);
    let act = ActQuant::Group;
    let lin = |w: &Fp8BlockWeight| Fp8Linear::new(w.clone(), None, act).unwrap();
    let swiglu = |g: &Tensor, u: &Tensor| (candle_nn::ops::silu(g).unwrap() * u).unwrap();
    let h = swiglu(
        &lin(&gate).forward_t(&x).unwrap(),
        &lin(&up).forward_t(&x).unwrap(),
    );
    let want = lin(&down).forward_t(&h).unwrap();
    for world in 1..=4 {
        let got = on_ranks(world, |c| {
            let shard = Shard {
                rank: c.rank(),
                world_size: world,
            };
            let g = ColumnParallel::new(&gate, None, act, shard).unwrap();
            let u = ColumnParallel::new(&up, None, act, shard).unwrap();
            let d = RowParallel::new(&down, None, act, shard).unwrap();
            // the intermediate features this rank computes are the ones its down slice takes
            assert_eq!(g.outputs, d.inputs);
            let h_r = swiglu(&g.forward(&x).unwrap(), &u.forward(&x).unwrap());
            d.forward(&h_r, c).unwrap()
        });
        for y in &got {
            let err = rel_frobenius(y, &want);
            assert!(err < 1e-5, "world {world}: {err:e}");
        }
    }
}

#[test]
fn load_shard_reads_the_blocks_shard_keeps() {
    use candle_core::safetensors::MmapedSafetensors;
    use safetensors::tensor::{Dtype, TensorView};
    let mut rng = rng("tp_load");
    let (n, k) = (576, 3884);
    let w = weight(&mut rng, n, k);
    let codes = w.data().flatten_all().unwrap().to_vec1::<u8>().unwrap();
    let scales = f32_le_bytes(w.scales());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let tensors = vec![
        (
            "p.weight".to_string(),
            TensorView::new(Dtype::F8_E4M3, vec![n, k], &codes).unwrap(),
        ),
        (
            "p.weight_scale_inv".to_string(),
            TensorView::new(Dtype::F32, w.scales().dims().to_vec(), &scales).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(tensors, None, &path).unwrap();
    // SAFETY: the file is this test's own and is not modified while mapped.
    let st = unsafe { MmapedSafetensors::new(&path) }.unwrap();
    for split in [Split::Column, Split::Row] {
        for world in 1..=4 {
            for rank in 0..world {
                let shard = Shard {
                    rank,
                    world_size: world,
                };
                let got = Fp8BlockWeight::load_shard(&st, "p", BLOCK, split, shard, &Device::Cpu)
                    .unwrap();
                let want = w.shard(split, shard).unwrap();
                assert_eq!(got.shape(), want.shape());
                assert_eq!(
                    got.data().flatten_all().unwrap().to_vec1::<u8>().unwrap(),
                    want.data().flatten_all().unwrap().to_vec1::<u8>().unwrap()
                );
                assert_eq!(
                    got.scales()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap(),
                    want.scales()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                );
            }
        }
    }
    // explicit ranges (a rank's heads): on blocks, and the last one may end at N or K
    for (split, range) in [(Split::Column, 128..384), (Split::Row, 3840..3884)] {
        let got = Fp8BlockWeight::load_range(&st, "p", BLOCK, split, range.clone(), &Device::Cpu)
            .unwrap();
        let want = w.slice(split, range).unwrap();
        assert_eq!(
            got.data().flatten_all().unwrap().to_vec1::<u8>().unwrap(),
            want.data().flatten_all().unwrap().to_vec1::<u8>().unwrap()
        );
        assert_eq!(
            f32_le_bytes(got.scales()),
            f32_le_bytes(want.scales()),
            "{split:?}"
        );
    }
    for range in [64..256, 128..200, 256..256] {
        let e = Fp8BlockWeight::load_range(&st, "p", BLOCK, Split::Column, range, &Device::Cpu)
            .map(|_| ())
            .unwrap_err();
        assert!(matches!(&e, Error::Invalid { arg: "range", .. }), "{e}");
    }
    // N = 576 is 5 blocks of 128: 6 ranks would cut one
    let e = Fp8BlockWeight::load_shard(
        &st,
        "p",
        BLOCK,
        Split::Column,
        Shard {
            rank: 0,
            world_size: 6,
        },
        &Device::Cpu,
    )
    .map(|_| ())
    .unwrap_err();
    assert!(
        matches!(&e, Error::Invalid { arg: "shard", msg } if msg.contains("world sizes 1..=5")),
        "{e}"
    );
    let e = w
        .shard(
            Split::Row,
            Shard {
                rank: 3,
                world_size: 3,
            },
        )
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(&e, Error::Invalid { arg: "shard", .. }), "{e}");
}

/// Causal grouped-query attention of `q [T, Hq * D]` over `k`, `v` `[T, Hkv * D]`: `[T, Hq * D]`.
fn gqa(q: &Tensor, k: &Tensor, v: &Tensor, hq: usize, hkv: usize, d: usize) -> Tensor {
    let t = q.dims()[0];
    let heads = |x: &Tensor, h: usize| x.reshape((t, h, d)).unwrap().transpose(0, 1).unwrap();
    let (q, k, v) = (heads(q, hq), heads(k, hkv), heads(v, hkv));
    let group = hq / hkv;
    let mut outs = Vec::new();
    for h in 0..hq {
        let (qh, kh, vh) = (
            q.get(h).unwrap(),
            k.get(h / group).unwrap(),
            v.get(h / group).unwrap(),
        );
        let s = (qh.matmul(&kh.t().unwrap()).unwrap() / (d as f64).sqrt()).unwrap();
        let mask: Vec<f32> = (0..t * t)
            .map(|i| {
                if i % t > i / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let s = (s + Tensor::from_vec(mask, (t, t), &Device::Cpu).unwrap()).unwrap();
        let p = candle_nn::ops::softmax_last_dim(&s).unwrap();
        outs.push(p.matmul(&vh.contiguous().unwrap()).unwrap());
    }
    Tensor::stack(&outs, 1)
        .unwrap()
        .reshape((t, hq * d))
        .unwrap()
}

#[test]
fn a_sharded_attention_block_equals_the_whole_one() {
    let mut rng = rng("tp_attention");
    // Qwen3-style heads of 128: 8 query heads over 4 key/value heads, hidden 1024
    let (hidden, hq, hkv, d, t) = (1024, 8, 4, 128, 9);
    let (wq, wk, wv, wo) = (
        weight(&mut rng, hq * d, hidden),
        weight(&mut rng, hkv * d, hidden),
        weight(&mut rng, hkv * d, hidden),
        weight(&mut rng, hidden, hq * d),
    );
    let bias_o = tensor(gaussian(&mut rng, hidden), &[hidden]);
    let x = tensor(gaussian(&mut rng, t * hidden), &[t, hidden]);
    let act = ActQuant::Group;
    let lin = |w: &Fp8BlockWeight| Fp8Linear::new(w.clone(), None, act).unwrap();
    let o = gqa(
        &lin(&wq).forward_t(&x).unwrap(),
        &lin(&wk).forward_t(&x).unwrap(),
        &lin(&wv).forward_t(&x).unwrap(),
        hq,
        hkv,
        d,
    );
    let want = Fp8Linear::new(wo.clone(), Some(bias_o.clone()), act)
        .unwrap()
        .forward_t(&o)
        .unwrap();
    for world in [1, 2, 4] {
        let got = on_ranks(world, |c| {
            let shard = Shard {
                rank: c.rank(),
                world_size: world,
            };
            let heads = shard.heads(hq, hkv, d, BLOCK[0]).unwrap();
            let col = |w: &Fp8BlockWeight, rows| {
                ColumnParallel::with_outputs(w, None, act, rows).unwrap()
            };
            let (q, k, v) = (
                col(&wq, heads.q_rows(d)),
                col(&wk, heads.kv_rows(d)),
                col(&wv, heads.kv_rows(d)),
            );
            let bias = (c.rank() == 0).then_some(&bias_o);
            let out = RowParallel::with_inputs(&wo, bias, act, heads.q_rows(d)).unwrap();
            let o_r = gqa(
                &q.forward(&x).unwrap(),
                &k.forward(&x).unwrap(),
                &v.forward(&x).unwrap(),
                heads.q_heads.len(),
                heads.kv_heads.len(),
                d,
            );
            out.forward(&o_r, c).unwrap()
        });
        for y in &got {
            let err = rel_frobenius(y, &want);
            assert!(err < 1e-5, "world {world}: {err:e}");
        }
    }
    // 3 ranks cannot take 4 key/value heads whole; 8 would give each a half block of rows
    for world in [3, 8] {
        let e = Shard {
            rank: 0,
            world_size: world,
        }
        .heads(hq, hkv, d, BLOCK[0])
        .unwrap_err();
        assert!(
            matches!(&e, Error::Invalid { arg: "shard", msg } if msg.contains("world sizes [1, 2, 4]")),
            "{e}"
        );
    }
    // SmolLM2's heads of 64 in blocks of 128: pairs of heads per block
    let e = Shard {
        rank: 0,
        world_size: 3,
    }
    .heads(9, 3, 64, 128)
    .unwrap_err();
    assert!(
        matches!(&e, Error::Invalid { arg: "shard", msg } if msg.contains("[1]")),
        "{e}"
    );
    // a range off the blocks is refused by the slice itself
    let e = wq.slice(Split::Column, 64..192).map(|_| ()).unwrap_err();
    assert!(matches!(&e, Error::Invalid { arg: "range", .. }), "{e}");
}

#[test]
fn expert_parallel_equals_the_whole_moe_block() {
    let mut rng = rng("tp_experts");
    let (e, h, i, top_k, t) = (8, 256, 384, 2, 11);
    let mk = |rng: &mut rand::rngs::StdRng, n, k| -> Vec<Fp8BlockWeight> {
        (0..e).map(|_| weight(rng, n, k)).collect()
    };
    let (gate, up, down) = (mk(&mut rng, i, h), mk(&mut rng, i, h), mk(&mut rng, h, i));
    let router_w = tensor(gaussian(&mut rng, e * h), &[e, h]);
    let act = ActQuant::Group;
    let stack = |ws: &[Fp8BlockWeight]| Fp8Experts::new(ws, act).unwrap();
    let whole = Fp8Moe::new(
        router_w.clone(),
        stack(&gate),
        stack(&up),
        stack(&down),
        top_k,
        true,
    )
    .unwrap();
    let x = tensor(gaussian(&mut rng, t * h), &[t, h]);
    let want = whole.forward(&x).unwrap();
    for world in 1..=4 {
        let got = on_ranks(world, |c| {
            let mine = Shard {
                rank: c.rank(),
                world_size: world,
            }
            .experts(e)
            .unwrap();
            let router = MoeRouter::new(router_w.clone(), top_k, true).unwrap();
            let ep = ExpertParallel::new(
                router,
                stack(&gate[mine.clone()]),
                stack(&up[mine.clone()]),
                stack(&down[mine.clone()]),
                mine,
            )
            .unwrap();
            ep.forward(&x, c).unwrap()
        });
        for y in &got {
            let err = rel_frobenius(y, &want);
            assert!(err < 1e-5, "world {world}: {err:e}");
        }
    }
    // a rank whose experts no token picked contributes zeros, not an error
    let router = MoeRouter::new(router_w.clone(), 1, true).unwrap();
    let (picked, _) = router.route(&x.narrow(0, 0, 1).unwrap()).unwrap();
    let other = (picked[0] + 1) % e;
    let ep = ExpertParallel::new(
        router,
        stack(&gate[other..other + 1]),
        stack(&up[other..other + 1]),
        stack(&down[other..other + 1]),
        other..other + 1,
    )
    .unwrap();
    let y = ep.forward_partial(&x.narrow(0, 0, 1).unwrap()).unwrap();
    assert!(y
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .all(|&v| v == 0.0));
    // experts that do not match the range are refused
    let router = MoeRouter::new(router_w.clone(), top_k, true).unwrap();
    let e2 = ExpertParallel::new(
        router,
        stack(&gate[..2]),
        stack(&up[..2]),
        stack(&down[..2]),
        0..3,
    )
    .map(|_| ())
    .unwrap_err();
    assert!(matches!(&e2, Error::Shape { arg: "gate", .. }), "{e2}");
    // a router for another hidden size is refused when the layer is built, not on a call
    // (where one rank refusing would leave the others in the all-reduce)
    let narrow_router = MoeRouter::new(router_w.narrow(1, 0, h - 1).unwrap(), top_k, true).unwrap();
    let e4 = ExpertParallel::new(
        narrow_router,
        stack(&gate[..2]),
        stack(&up[..2]),
        stack(&down[..2]),
        0..2,
    )
    .map(|_| ())
    .unwrap_err();
    assert!(matches!(&e4, Error::Shape { arg: "router", .. }), "{e4}");
    let e3 = Shard {
        rank: 0,
        world_size: 9,
    }
    .experts(e)
    .unwrap_err();
    assert!(matches!(&e3, Error::Invalid { arg: "shard", .. }), "{e3}");
}

/// What the two ranks of a refusal test sent (rank, first call, second call), in rank order; a
/// rank that sends nothing within 60 s hung in the collective.
#[allow(clippy::type_complexity)]
fn two_ranks<A, B>(
    rx: &std::sync::mpsc::Receiver<(usize, Result<A, Error>, Result<B, Error>)>,
) -> [(Result<A, Error>, Result<B, Error>); 2] {
    let mut got: Vec<_> = (0..2)
        .map(|_| {
            rx.recv_timeout(std::time::Duration::from_secs(60))
                .expect("a rank hung in the collective")
        })
        .collect();
    got.sort_by_key(|g| g.0);
    let [(_, f0, s0), (_, f1, s1)] = <[_; 2]>::try_from(got).ok().unwrap();
    [(f0, s0), (f1, s1)]
}

/// A rank that refuses its input does not leave the others waiting (issue: reliability, third
/// round, item 1): on a 2-rank group where only rank 1's `x` has the wrong shape, rank 1
/// returns its error and rank 0 an error naming the group, and the group still works for the
/// next call. The ranks run on threads watched by a deadline, so a hang fails the test.
#[test]
fn a_rank_that_refuses_fails_the_whole_call() {
    use std::sync::mpsc;
    let mut rng = rng("tp_refusal");
    let w = weight(&mut rng, 256, 256);
    let handles = HostGroup::new(2);
    let (tx, rx) = mpsc::channel();
    for comm in handles {
        let (w, tx) = (w.clone(), tx.clone());
        std::thread::spawn(move || {
            let r = comm.rank();
            let shard = Shard {
                rank: r,
                world_size: 2,
            };
            let layer = RowParallel::new(&w, None, ActQuant::Group, shard).unwrap();
            let x = if r == 1 {
                Tensor::zeros((3, 100), DType::F32, &Device::Cpu).unwrap() // K_r is 128
            } else {
                Tensor::zeros((3, 128), DType::F32, &Device::Cpu).unwrap()
            };
            let first = layer.forward(&x, &comm).map(|_| ());
            let good = Tensor::ones((3, 128), DType::F32, &Device::Cpu).unwrap();
            let second = layer.forward(&good, &comm).map(|y| y.dims().to_vec());
            tx.send((r, first, second)).unwrap();
        });
    }
    let [(f0, s0), (f1, s1)] = two_ranks(&rx);
    assert!(
        matches!(&f0, Err(fp8nsa::Error::Invalid { arg: "comm", .. })),
        "{f0:?}"
    );
    assert!(
        matches!(&f1, Err(fp8nsa::Error::Shape { arg: "x", .. })),
        "{f1:?}"
    );
    assert_eq!((s0.unwrap(), s1.unwrap()), (vec![3, 256], vec![3, 256]));
}

/// The same for the expert-parallel MoE block (issue: reliability, third round, item 1): rank
/// 1's tokens have the wrong hidden size, every rank returns an error within the deadline, and
/// the next call works on both.
#[test]
fn an_expert_rank_that_refuses_fails_the_whole_call() {
    use std::sync::mpsc;
    let mut rng = rng("tp_expert_refusal");
    let (e, h, i, top_k) = (4, 256, 128, 2);
    let mk = |rng: &mut rand::rngs::StdRng, n, k| -> Vec<Fp8BlockWeight> {
        (0..e).map(|_| weight(rng, n, k)).collect()
    };
    let (gate, up, down) = (mk(&mut rng, i, h), mk(&mut rng, i, h), mk(&mut rng, h, i));
    let router_w = tensor(gaussian(&mut rng, e * h), &[e, h]);
    let handles = HostGroup::new(2);
    let (tx, rx) = mpsc::channel();
    for comm in handles {
        let (gate, up, down, router_w, tx) = (
            gate.clone(),
            up.clone(),
            down.clone(),
            router_w.clone(),
            tx.clone(),
        );
        std::thread::spawn(move || {
            let r = comm.rank();
            let mine = Shard {
                rank: r,
                world_size: 2,
            }
            .experts(e)
            .unwrap();
            let stack = |ws: &[Fp8BlockWeight]| Fp8Experts::new(ws, ActQuant::Group).unwrap();
            let ep = ExpertParallel::new(
                MoeRouter::new(router_w, top_k, true).unwrap(),
                stack(&gate[mine.clone()]),
                stack(&up[mine.clone()]),
                stack(&down[mine.clone()]),
                mine,
            )
            .unwrap();
            let width = if r == 1 { h - 1 } else { h };
            let x = Tensor::zeros((3, width), DType::F32, &Device::Cpu).unwrap();
            let first = ep.forward(&x, &comm).map(|_| ());
            let good = Tensor::ones((3, h), DType::F32, &Device::Cpu).unwrap();
            let second = ep.forward(&good, &comm).map(|y| y.dims().to_vec());
            tx.send((r, first, second)).unwrap();
        });
    }
    let [(f0, s0), (f1, s1)] = two_ranks(&rx);
    assert!(
        matches!(&f0, Err(fp8nsa::Error::Invalid { arg: "comm", .. })),
        "{f0:?}"
    );
    assert!(f1.is_err(), "{f1:?}");
    assert!(
        !matches!(&f1, Err(fp8nsa::Error::Invalid { arg: "comm", .. })),
        "rank 1 names its own argument: {f1:?}"
    );
    assert_eq!((s0.unwrap(), s1.unwrap()), (vec![3, h], vec![3, h]));
}
