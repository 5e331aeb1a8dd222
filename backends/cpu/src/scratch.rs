//! Per-thread scratch buffers for the temporaries of a call (quantized activations, dequantized
//! weight tiles, transposed GEMV outputs).
//!
//! Allocating those afresh on every call costs more than it seems: a buffer of a megabyte or more
//! comes from `mmap` (or a heap top that `free` trims), so each call pays a page fault and a page
//! clear per 4 KiB before the kernel touches it. Measured on a 512 x 576 x 576 product, that was
//! a quarter of the call. A thread keeps a few buffers it used before and hands them out again.

use std::cell::RefCell;

/// Buffers a thread keeps between calls, per element type.
const KEEP: usize = 4;
/// A buffer larger than this (in elements; 16 MiB of f32) is freed after use rather than kept,
/// so a big prefill does not pin its temporaries on every worker for the life of the pool (at
/// most `KEEP` such buffers per type stay per thread). Calls that large are long enough that a
/// fresh allocation costs little next to them.
const KEEP_MAX_LEN: usize = 4 << 20;

/// An element type with a per-thread pool of kept buffers.
pub(crate) trait Pooled: Copy + Default + 'static {
    /// Runs `f` on this thread's pool of `Self` buffers.
    fn pool<R>(f: impl FnOnce(&mut Vec<Vec<Self>>) -> R) -> R;
}

macro_rules! pooled {
    ($($t:ty => $pool:ident),*) => {
        thread_local! {
            $(static $pool: RefCell<Vec<Vec<$t>>> = const { RefCell::new(Vec::new()) };)*
        }
        $(impl Pooled for $t {
            fn pool<R>(f: impl FnOnce(&mut Vec<Vec<Self>>) -> R) -> R {
                $pool.with(|p| f(&mut p.borrow_mut()))
            }
        })*
    };
}

pooled!(f32 => POOL, u16 => POOL_U16, u32 => POOL_U32);

/// Runs `f` on a buffer of `len` f32s whose contents are unspecified (whatever an earlier call
/// left, or zeros): `f` must write every element it reads. Reentrant: a nested call gets a
/// buffer of its own.
///
/// ```ignore
/// let sum = with_f32(3, |b| { b.fill(1.0); b.iter().sum::<f32>() });
/// assert_eq!(sum, 3.0);
/// ```
pub(crate) fn with_f32<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    with_buf(len, f)
}

/// [`with_f32`] for any pooled element type.
pub(crate) fn with_buf<T: Pooled, R>(len: usize, f: impl FnOnce(&mut [T]) -> R) -> R {
    let mut buf = T::pool(|p| {
        // the smallest kept buffer that fits, else the largest (grown below)
        let at = p
            .iter()
            .enumerate()
            .filter(|(_, b)| b.len() >= len)
            .min_by_key(|(_, b)| b.len())
            .or_else(|| p.iter().enumerate().max_by_key(|(_, b)| b.len()))
            .map(|(i, _)| i);
        at.map(|i| p.swap_remove(i))
    })
    .unwrap_or_default();
    if buf.len() < len {
        buf.resize(len, T::default());
    }
    let r = f(&mut buf[..len]);
    if buf.len() <= KEEP_MAX_LEN {
        T::pool(|p| {
            if p.len() < KEEP {
                p.push(buf);
            }
        });
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_calls_get_distinct_buffers_of_the_asked_length() {
        let total = with_f32(5, |a| {
            a.fill(1.0);
            let inner = with_f32(7, |b| {
                assert_eq!(b.len(), 7);
                b.fill(2.0);
                b.iter().sum::<f32>()
            });
            // the inner call did not write into this buffer
            a.iter().sum::<f32>() + inner
        });
        assert_eq!(total, 5.0 + 14.0);
        // a later, smaller request reuses a kept buffer and sees exactly its length
        with_f32(3, |c| assert_eq!(c.len(), 3));
    }

    #[test]
    fn huge_buffers_are_not_kept() {
        with_f32(KEEP_MAX_LEN + 1, |b| b[0] = 1.0);
        POOL.with(|p| assert!(p.borrow().iter().all(|b| b.len() <= KEEP_MAX_LEN)));
    }
}
