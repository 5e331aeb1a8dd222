//! Runtime SIMD dispatch. Kernels are written once as plain loops that LLVM vectorizes, generic
//! over [`Arith`]; [`simd_dispatch!`] compiles them a second time with AVX2+FMA enabled and picks
//! that copy when the CPU has it. The default x86-64 target only guarantees SSE2.

/// How a kernel multiplies and adds. `Fused` must only run where FMA exists (else `mul_add`
/// becomes a slow libm call), which the dispatch guarantees.
pub(crate) trait Arith {
    fn mul_add(a: f32, b: f32, c: f32) -> f32;
}

pub(crate) struct Plain;
impl Arith for Plain {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) struct Fused;
#[cfg(target_arch = "x86_64")]
impl Arith for Fused {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2_fma() -> bool {
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
}

#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx512() -> bool {
    std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512bw")
        && std::is_x86_feature_detected!("avx512vl")
        && has_avx2_fma()
}

/// `simd_dispatch!(vis fn name => impl_fn(args...) -> ret)` defines `name`, which calls
/// `impl_fn::<Fused>` compiled for AVX-512 or AVX2+FMA when available and `impl_fn::<Plain>`
/// otherwise.
/// `impl_fn` must be `#[inline(always)]` so it is compiled inside each copy.
macro_rules! simd_dispatch {
    ($(#[$meta:meta])* $vis:vis fn $name:ident => $imp:ident ( $($arg:ident : $ty:ty),* $(,)? ) $(-> $ret:ty)?) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
                fn fast512($($arg: $ty),*) $(-> $ret)? {
                    $imp::<$crate::simd::Fused>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn fast($($arg: $ty),*) $(-> $ret)? {
                    $imp::<$crate::simd::Fused>($($arg),*)
                }
                if $crate::simd::has_avx512() {
                    // SAFETY: AVX-512 F/BW/VL, AVX2 and FMA were detected on this CPU just above.
                    return unsafe { fast512($($arg),*) };
                }
                if $crate::simd::has_avx2_fma() {
                    // SAFETY: AVX2 and FMA were detected on this CPU just above.
                    return unsafe { fast($($arg),*) };
                }
            }
            $imp::<$crate::simd::Plain>($($arg),*)
        }
    };
}
pub(crate) use simd_dispatch;

/// Dot product with 16 independent lanes so that LLVM vectorizes it.
#[inline(always)]
pub(crate) fn dot<A: Arith>(a: &[f32], b: &[f32]) -> f32 {
    const L: usize = 16;
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; L];
    let (ca, cb) = (a.chunks_exact(L), b.chunks_exact(L));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..L {
            acc[i] = A::mul_add(x[i], y[i], acc[i]);
        }
    }
    let mut tail = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail = A::mul_add(*x, *y, tail);
    }
    acc.iter().sum::<f32>() + tail
}
