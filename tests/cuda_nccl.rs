//! The NCCL communicator on one GPU (`--features nccl`; needs a GPU and libnccl.so.2, which
//! the GPU machine has from its `nvidia-nccl-cu13` wheel; without a GPU every test says so and
//! returns, or fails when `FP8NSA_REQUIRE_GPU=1`). A one-rank group is all one GPU can hold
//! (NCCL refuses two ranks on one device), so this checks the plumbing: collectives return
//! their input (the uneven all-gather's header, pad and cut run, with one rank; their logic for
//! several ranks is tested on the CPU in `ops/src/fp8/gather.rs`), and the tensor-parallel layers of world
//! size 1 over NCCL equal the plain layer on the same GPU. Groups of several GPUs await a
//! machine with them.
//!
//! `FP8NSA_REQUIRE_GPU=1 cargo test --release --features nccl --test cuda_nccl`

use candle_core::{DType, Device, Tensor};
use fp8nsa::fp8::{ColumnParallel, Communicator, NcclGroup, RowParallel, Shard};
use fp8nsa::{ActQuant, Error, Fp8BlockWeight, Fp8Linear};
use fp8nsa_test_support::resource::gpu;
use fp8nsa_test_support::*;

fn one_rank(dev: &Device) -> NcclGroup {
    let cuda = dev.as_cuda_device().unwrap().clone();
    NcclGroup::for_devices(&[cuda]).unwrap().pop().unwrap()
}

fn host(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn one_rank_collectives_return_their_input() {
    let Some(dev) = gpu("one_rank_collectives_return_their_input") else {
        return;
    };
    let comm = one_rank(&dev);
    assert_eq!((comm.rank(), comm.world_size()), (0, 1));
    let mut rng = rng("nccl_collectives");
    for dims in [vec![1usize, 1], vec![3, 5], vec![2, 7, 9]] {
        let n: usize = dims.iter().product();
        let t = tensor(gaussian(&mut rng, n), &dims)
            .to_device(&dev)
            .unwrap();
        let sum = comm.all_reduce_sum(&t).unwrap();
        assert_eq!(sum.dims(), t.dims());
        assert_eq!(host(&sum), host(&t), "all_reduce {dims:?}");
        for dim in 0..dims.len() {
            let g = comm.all_gather(&t, dim).unwrap();
            assert_eq!(g.dims(), t.dims(), "all_gather {dims:?} dim {dim}");
            assert_eq!(host(&g), host(&t), "all_gather {dims:?} dim {dim}");
        }
    }
    // bf16 in, f32 out; a host tensor and a dim past the rank are errors
    let t = Tensor::ones((2, 3), DType::BF16, &dev).unwrap();
    assert_eq!(host(&comm.all_reduce_sum(&t).unwrap()), vec![1.0; 6]);
    let e = comm
        .all_reduce_sum(&Tensor::ones(4, DType::F32, &Device::Cpu).unwrap())
        .unwrap_err();
    assert!(matches!(&e, Error::Invalid { arg: "t", .. }), "{e}");
    let e = comm.all_gather(&t, 2).unwrap_err();
    assert!(matches!(&e, Error::Invalid { arg: "dim", .. }), "{e}");
}

#[test]
fn world_one_layers_over_nccl_equal_the_layer() {
    let Some(dev) = gpu("world_one_layers_over_nccl_equal_the_layer") else {
        return;
    };
    let comm = one_rank(&dev);
    let mut rng = rng("nccl_layers");
    let (n, k) = (576, 3884);
    let w = Fp8BlockWeight::quantize(
        &tensor(hetero(&mut rng, n, k, 128, 128), &[n, k]),
        [128, 128],
    )
    .unwrap();
    let shard = Shard {
        rank: 0,
        world_size: 1,
    };
    for m in [1, 7] {
        let x = tensor(hetero(&mut rng, m, k, 1, 128), &[m, k])
            .to_device(&dev)
            .unwrap();
        let act = ActQuant::Group;
        let want = Fp8Linear::new(w.clone(), None, act)
            .unwrap()
            .forward_t(&x)
            .unwrap();
        let col = ColumnParallel::new(&w, None, act, shard).unwrap();
        let got = comm.all_gather(&col.forward(&x).unwrap(), 1).unwrap();
        assert_eq!(host(&got), host(&want), "column, m = {m}");
        let row = RowParallel::new(&w, None, act, shard).unwrap();
        let got = row.forward(&x, &comm).unwrap();
        assert_eq!(host(&got), host(&want), "row, m = {m}");
    }
}
