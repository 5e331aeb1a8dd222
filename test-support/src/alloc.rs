//! [`CountingAlloc`]: the system allocator, counting every thread's allocations on demand.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

/// The system allocator, counting the allocations (and their bytes) of every thread while
/// counting is on: installed as a test binary's or an example's `#[global_allocator]`, it shows
/// whether a warm call allocates. Off, it costs one relaxed load per allocation.
///
/// ```
/// use fp8nsa_test_support::alloc::CountingAlloc;
///
/// static COUNTER: CountingAlloc = CountingAlloc::new(); // `#[global_allocator]` in real use
/// COUNTER.start();
/// assert_eq!(COUNTER.stop(), (0, 0)); // this doc test's allocator is the default one
/// ```
pub struct CountingAlloc {
    counting: AtomicBool,
    allocs: AtomicU64,
    bytes: AtomicU64,
}

impl CountingAlloc {
    pub const fn new() -> Self {
        Self {
            counting: AtomicBool::new(false),
            allocs: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        }
    }

    /// Counts from zero, from now on.
    pub fn start(&self) {
        self.allocs.store(0, Relaxed);
        self.bytes.store(0, Relaxed);
        self.counting.store(true, Relaxed);
    }

    /// Stops counting; the allocations and bytes counted since [`Self::start`].
    pub fn stop(&self) -> (u64, u64) {
        self.counting.store(false, Relaxed);
        (self.allocs.load(Relaxed), self.bytes.load(Relaxed))
    }

    fn note(&self, bytes: usize) {
        if self.counting.load(Relaxed) {
            self.allocs.fetch_add(1, Relaxed);
            self.bytes.fetch_add(bytes as u64, Relaxed);
        }
    }
}

impl Default for CountingAlloc {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: every call goes to `System` with the caller's arguments unchanged; counting touches
// only atomics and never allocates.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        self.note(l.size());
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { System.alloc(l) }
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        self.note(l.size());
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(l) }
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from this allocator, that is from `System`, with layout `l`.
        unsafe { System.dealloc(p, l) }
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        self.note(n);
        // SAFETY: as for `dealloc`, and the caller's contract for `realloc`.
        unsafe { System.realloc(p, l, n) }
    }
}
