//! Tensor parallelism on the CPU (issue: tensor parallel, first step): world sizes 1..4 over
//! the contract's shapes (N = 576, K = 3884 in 128x128 blocks), every rank a thread with a
//! `HostGroup` handle. Column-parallel + all-gather equals the whole layer bit for bit;
//! row-parallel + all-reduce equals it up to the order of the sum; a sharded SwiGLU MLP equals
//! the unsharded one; `load_shard` reads exactly the blocks `shard` keeps; a split that would
//! cut a block is an error naming the world sizes that work.

use candle_core::{Device, Tensor};
use fp8nsa::fp8::{ColumnParallel, Communicator, HostGroup, RowParallel, Shard, Split};
use fp8nsa::{ActQuant, Error, Fp8BlockWeight, Fp8Linear};
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
