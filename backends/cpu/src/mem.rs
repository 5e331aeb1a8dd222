//! Weight buffers on huge pages.

/// Bytes of a transparent huge page on x86-64 and most arm64 kernels.
const HUGE: usize = 2 << 20;

/// Asks the kernel to back the 2 MiB-aligned interior of `buf` with transparent huge pages,
/// now (`MADV_HUGEPAGE`, then `MADV_COLLAPSE` for the pages already there; Linux 6.1 on). A
/// decode step streams every weight once, and on 4 KiB pages every 4 KiB of it costs a TLB
/// miss, a two-level page walk under a hypervisor: SmolLM2's decode with its 113 MB f32 head
/// on huge pages measured 86 -> 111 tok/s (Zen 4 VM, medians of 5 alternating runs; the fp8
/// weights there are under 2 MiB each and gain nothing). Best effort: returns whether the
/// kernel collapsed the range;
/// `false` for a buffer under 2 MiB, off Linux, or where the kernel declines (THP disabled, an
/// older kernel, memory too fragmented), which changes nothing but speed. The contents are
/// never changed.
///
/// ```
/// use fp8nsa_cpu::mem::advise_huge_pages;
///
/// let w = vec![1u8; 8 << 20];
/// let _ = advise_huge_pages(&w); // whether it took depends on the kernel
/// assert!(w.iter().all(|&b| b == 1));
/// assert!(!advise_huge_pages(&[0f32; 16])); // too small to hold a huge page
/// ```
pub fn advise_huge_pages<T>(buf: &[T]) -> bool {
    let (start, len) = (buf.as_ptr() as usize, std::mem::size_of_val(buf));
    let first = start.next_multiple_of(HUGE);
    let end = (start + len) / HUGE * HUGE;
    if end <= first {
        return false;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let (p, n) = (first as *mut libc::c_void, end - first);
        // SAFETY: FFI. [first, end) lies inside `buf`'s allocation (rounded inwards to whole
        // huge pages), so no other mapping is touched; both advices only change how the pages
        // are backed (a collapse copies them into a huge page under the page locks), never
        // their contents, so readers of `buf`, on any thread, see the same bytes throughout.
        unsafe {
            libc::madvise(p, n, libc::MADV_HUGEPAGE);
            libc::madvise(p, n, libc::MADV_COLLAPSE) == 0
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}
