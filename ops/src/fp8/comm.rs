//! The collectives a tensor-parallel layer calls ([`Communicator`]) and the in-process
//! transport for ranks that are threads ([`HostGroup`]); `NcclGroup` (feature `nccl`) is the
//! other implementation.

use std::sync::{Arc, Barrier, Mutex};

use candle_core::Tensor;

use crate::error::{invalid, Error, Result};

/// The collective operations a tensor-parallel layer needs. An implementation is one rank's
/// handle on a group: every rank calls each operation, in the same order.
pub trait Communicator: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// The elementwise sum over the ranks of `t` (same shape everywhere), on every rank.
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor>;
    /// The ranks' tensors concatenated along `dim`, in rank order, on every rank. The ranks'
    /// tensors may differ in size along `dim` (a column split that is not even), nowhere else.
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor>;
    /// Whether every rank is ready for the collective that follows: each rank passes its own
    /// answer and all get `true` only when all passed `true`. A layer asks before it reduces,
    /// so a rank that refuses its input makes every rank of the call return an error instead
    /// of leaving the others waiting in the reduction.
    fn all_ok(&self, ok: bool) -> Result<bool>;
}

/// Runs a collective on this rank's `part` only when every rank has its part: a rank whose
/// part is an error returns it, and the others return `Error::Invalid` naming the group, so
/// no rank waits for one that will not come.
pub(crate) fn agreed<T>(
    comm: &dyn Communicator,
    part: Result<T>,
    collective: impl FnOnce(T) -> Result<Tensor>,
) -> Result<Tensor> {
    let all = comm.all_ok(part.is_ok())?;
    match part {
        Err(e) => Err(e),
        Ok(_) if !all => Err(invalid(
            "comm",
            "another rank of the group refused its part of this call",
        )),
        Ok(p) => collective(p),
    }
}

/// Ranks as threads of one process, for CPU tensors (and tests): [`HostGroup::new`] returns
/// one handle per rank. Sums are taken in rank order, so every rank gets the same bits. As
/// with any collective, every rank must make each call: a rank that stops early leaves the
/// others waiting.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use fp8nsa_ops::fp8::{Communicator, HostGroup};
///
/// let handles = HostGroup::new(3);
/// let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
///     let jobs: Vec<_> = handles.iter().map(|c| s.spawn(move || {
///         let t = Tensor::new(&[c.rank() as f32, 1.0], &Device::Cpu).unwrap();
///         c.all_reduce_sum(&t).unwrap().to_vec1::<f32>().unwrap()
///     })).collect();
///     jobs.into_iter().map(|j| j.join().unwrap()).collect()
/// });
/// assert!(sums.iter().all(|s| s == &[3.0, 3.0]));
/// ```
pub struct HostGroup {
    rank: usize,
    shared: Arc<HostShared>,
}

struct HostShared {
    world: usize,
    slots: Mutex<Vec<Option<Tensor>>>,
    ready: Mutex<Vec<bool>>,
    barrier: Barrier,
}

impl HostGroup {
    /// Handles for ranks `0..world_size` (each to be moved to its own thread).
    pub fn new(world_size: usize) -> Vec<HostGroup> {
        let shared = Arc::new(HostShared {
            world: world_size,
            slots: Mutex::new(vec![None; world_size]),
            ready: Mutex::new(vec![false; world_size]),
            barrier: Barrier::new(world_size),
        });
        (0..world_size)
            .map(|rank| HostGroup {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    /// Every rank's tensor, in rank order: deposit, wait for all, copy out, wait again so the
    /// slots can be reused by the next operation.
    /// A rank whose tensor is not on the CPU still takes part (with nothing), so every rank
    /// returns from the exchange, all with an error.
    fn exchange(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        let cpu = t.device().is_cpu();
        let slots = &self.shared.slots;
        locked(slots)?[self.rank] = cpu.then(|| t.clone());
        self.shared.barrier.wait();
        let all: Option<Vec<Tensor>> = locked(slots)?.iter().cloned().collect();
        self.shared.barrier.wait();
        if !cpu {
            return Err(invalid("t", "HostGroup exchanges CPU tensors"));
        }
        all.ok_or_else(|| invalid("communicator", "a rank did not contribute a CPU tensor"))
    }
}

impl Communicator for HostGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        let all = self.exchange(t)?;
        let mut sum = all[0].clone();
        for (r, x) in all.iter().enumerate().skip(1) {
            if x.dims() != sum.dims() {
                return Err(Error::Shape {
                    arg: "t",
                    expected: format!("{:?} (rank 0's) on rank {r}", sum.dims()),
                    got: x.dims().to_vec(),
                });
            }
            sum = (sum + x)?;
        }
        Ok(sum)
    }

    fn all_ok(&self, ok: bool) -> Result<bool> {
        let ready = &self.shared.ready;
        locked(ready)?[self.rank] = ok;
        self.shared.barrier.wait();
        let all = locked(ready)?.iter().all(|&r| r);
        self.shared.barrier.wait();
        Ok(all)
    }

    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        let all = self.exchange(t)?;
        check_gather(
            &all.iter().map(|x| x.dims().to_vec()).collect::<Vec<_>>(),
            dim,
        )?;
        Ok(Tensor::cat(&all, dim)?)
    }
}

/// A slot vector of the group; poisoned means another rank panicked holding it.
fn locked<T>(m: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| invalid("communicator", "another rank panicked"))
}

/// Every communicator's rule for an all-gather: the ranks' shapes (in rank order) agree
/// except along `dim`. Every rank sees the same shapes, so all refuse together.
pub(crate) fn check_gather(shapes: &[Vec<usize>], dim: usize) -> Result<()> {
    let first = &shapes[0];
    if dim >= first.len() {
        return Err(invalid(
            "dim",
            format!("{dim} is past the rank of {first:?}"),
        ));
    }
    for (r, s) in shapes.iter().enumerate() {
        let same_elsewhere = s.len() == first.len()
            && s.iter()
                .zip(first)
                .enumerate()
                .all(|(d, (a, b))| d == dim || a == b);
        if !same_elsewhere {
            return Err(Error::Shape {
                arg: "t",
                expected: format!("{first:?} (rank 0's) except along dim {dim}, on rank {r}"),
                got: s.clone(),
            });
        }
    }
    Ok(())
}
