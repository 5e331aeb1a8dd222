//! The NCCL communicator (`nccl` feature): tensor-parallel reductions of CUDA tensors through
//! NCCL, by cudarc's bindings. Built in CI; it needs GPUs (and the NCCL library, from the
//! `nvidia-nccl-cu13` wheel) to run.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{CudaStorage, DType, Storage, Tensor};
use cudarc::driver::CudaStream;
use cudarc::nccl::{Comm, Id, ReduceOp};

use super::comm::Communicator;
use crate::cuda::{view, with_storage};
use crate::error::{invalid, Result};

/// One rank's NCCL communicator, on the CUDA device (and stream) candle runs that rank's
/// tensors on. Collectives take and return f32 tensors (other float dtypes are converted).
/// Each collective holds the communicator's lock from its first NCCL call to its last, so
/// threads sharing one handle issue whole collectives one after another, never interleaved.
pub struct NcclGroup {
    comm: Mutex<CommOwned>,
    rank: usize,
    world_size: usize,
    device: candle_core::CudaDevice,
}

/// The communicator, reachable only through `NcclGroup`'s lock.
struct CommOwned(Comm);

// SAFETY: NCCL lets any thread call a communicator; what it forbids is concurrent calls on one
// communicator, and `CommOwned` is only ever reached through `NcclGroup::comm`'s `Mutex`, which
// serializes them. (`Comm` is not `Send` only because it holds raw NCCL and stream pointers.)
unsafe impl Send for CommOwned {}

fn nccl_err(e: cudarc::nccl::result::NcclError) -> crate::error::Error {
    invalid("nccl", format!("{e:?}"))
}

fn alloc_err(e: cudarc::driver::DriverError) -> crate::error::Error {
    invalid("nccl", format!("allocating the output: {e:?}"))
}

impl NcclGroup {
    /// A fresh group id, made by one rank (rank 0) and shared with the others out of band
    /// (its 128 bytes: `Id::internal`, `Id::uninit`).
    pub fn new_id() -> Result<Id> {
        Id::new().map_err(nccl_err)
    }

    /// This process's rank of a `world_size` group whose id rank 0 made.
    pub fn from_rank(
        device: &candle_core::CudaDevice,
        rank: usize,
        world_size: usize,
        id: Id,
    ) -> Result<Self> {
        if rank >= world_size {
            return Err(invalid(
                "rank",
                format!("{rank} is not below the world size {world_size}"),
            ));
        }
        let comm = Comm::from_rank(device.cuda_stream(), rank, world_size, id).map_err(nccl_err)?;
        Ok(Self::own(comm, device))
    }

    fn own(comm: Comm, device: &candle_core::CudaDevice) -> Self {
        Self {
            rank: comm.rank(),
            world_size: comm.world_size(),
            comm: Mutex::new(CommOwned(comm)),
            device: device.clone(),
        }
    }

    /// The communicator, for one whole collective. A collective that panicked may have left
    /// the ranks at different steps, so a poisoned lock is an error, not a wait that may hang.
    fn lock(&self) -> Result<MutexGuard<'_, CommOwned>> {
        self.comm.lock().map_err(|_| {
            invalid(
                "nccl",
                "a collective on this communicator panicked; the group must be rebuilt",
            )
        })
    }

    /// One group over several GPUs of this process, one handle per device, in order.
    pub fn for_devices(devices: &[candle_core::CudaDevice]) -> Result<Vec<Self>> {
        let streams: Vec<Arc<CudaStream>> = devices.iter().map(|d| d.cuda_stream()).collect();
        let comms = Comm::from_devices(streams).map_err(nccl_err)?;
        Ok(comms
            .into_iter()
            .zip(devices)
            .map(|(comm, d)| Self::own(comm, d))
            .collect())
    }

    /// `t` as a contiguous f32 tensor on this rank's device.
    fn f32_on_device(&self, t: &Tensor) -> Result<Tensor> {
        if !t
            .device()
            .same_device(&candle_core::Device::Cuda(self.device.clone()))
        {
            return Err(invalid("t", "must be on this rank's CUDA device"));
        }
        Ok(t.to_dtype(DType::F32)?.contiguous()?)
    }

    fn wrap(&self, out: cudarc::driver::CudaSlice<f32>, dims: &[usize]) -> Tensor {
        let storage = CudaStorage::wrap_cuda_slice(out, self.device.clone());
        Tensor::from_storage(
            Storage::Cuda(storage),
            dims,
            candle_core::op::BackpropOp::none(),
            false,
        )
    }
}

impl Communicator for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        let t = self.f32_on_device(t)?;
        let n = t.elem_count();
        let stream = self.device.cuda_stream();
        let mut out = stream.alloc_zeros::<f32>(n).map_err(alloc_err)?;
        let comm = self.lock()?;
        with_storage("t", &t, |s, l| {
            let src = view::<f32>("t", s, l)?;
            comm.0
                .all_reduce(&src, &mut out, &ReduceOp::Sum)
                .map_err(nccl_err)?;
            Ok(())
        })?;
        Ok(self.wrap(out, t.dims()))
    }

    fn all_ok(&self, ok: bool) -> Result<bool> {
        // the count of refusing ranks, summed on the device: 0 means every rank is ready
        let device = candle_core::Device::Cuda(self.device.clone());
        let refused = Tensor::new(&[if ok { 0f32 } else { 1f32 }], &device)?;
        let total: Vec<f32> = self.all_reduce_sum(&refused)?.to_vec1()?;
        Ok(total.first() == Some(&0.0))
    }

    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        use super::gather::{gather_cut, gather_header, gather_send, read_gather_headers};
        let t = self.f32_on_device(t)?;
        // NCCL gathers equal buffers: first every rank's fixed-size header (its shape and the
        // dim asked for, checked only once all ranks hold all headers, so they refuse
        // together), then the tensors padded to the longest along `dim`, cut back apart
        let header = Tensor::new(&gather_header(t.dims(), dim)[..], t.device())?;
        // both exchanges under one lock: another thread's collective must not come between
        let comm = self.lock()?;
        let words: Vec<f32> = self.gather_flat(&comm, &header)?.to_vec1()?;
        let (shapes, dim) = read_gather_headers(&words)?;
        let longest = shapes.iter().map(|s| s[dim]).max().unwrap_or(0);
        let gathered = self.gather_flat(&comm, &gather_send(&t, dim, longest)?)?;
        drop(comm);
        gather_cut(&gathered, &shapes, dim)
    }
}

impl NcclGroup {
    /// NCCL's all-gather of a contiguous 1-D f32 tensor of the same length on every rank.
    fn gather_flat(&self, comm: &CommOwned, t: &Tensor) -> Result<Tensor> {
        let n = t.elem_count();
        let world = self.world_size();
        let stream = self.device.cuda_stream();
        let mut out = stream.alloc_zeros::<f32>(n * world).map_err(alloc_err)?;
        with_storage("t", t, |s, l| {
            let src = view::<f32>("t", s, l)?;
            comm.0.all_gather(&src, &mut out).map_err(nccl_err)?;
            Ok(())
        })?;
        Ok(self.wrap(out, &[n * world]))
    }
}
