//! Runtime SIMD dispatch. Kernels are written once as plain loops that LLVM vectorizes, generic
//! over [`Arith`]; [`simd_dispatch!`] compiles them a second time with AVX2+FMA enabled and picks
//! that copy when the CPU has it. The default x86-64 target only guarantees SSE2. What LLVM does
//! not turn into fast code on its own (the e4m3 decode) is written out in `x86` (AVX2) and
//! `avx512`.

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

/// The instruction-set tier: defined in `fp8nsa-types`, so that a call's reported path can
/// name it; detected and capped there too, once per process.
pub use fp8nsa_types::Tier;

/// `simd_dispatch!(vis fn name => impl_fn(args...) -> ret)` defines `name`, which calls
/// `impl_fn::<Fused>` compiled for AVX-512 or AVX2+FMA when [`Tier::current`] allows and
/// `impl_fn::<Plain>` otherwise.
/// `impl_fn` must be `#[inline(always)]` so it is compiled inside each copy.
macro_rules! simd_dispatch {
    ($(#[$meta:meta])* $vis:vis fn $name:ident => $imp:ident ( $($arg:ident : $ty:ty),* $(,)? ) $(-> $ret:ty)?) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
                fn fast512($($arg: $ty),*) $(-> $ret)? {
                    $imp::<$crate::simd::Fused>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma,f16c")]
                fn fast($($arg: $ty),*) $(-> $ret)? {
                    $imp::<$crate::simd::Fused>($($arg),*)
                }
                match $crate::simd::Tier::current() {
                    // SAFETY: the current tier never exceeds the detected one, and the AVX-512
                    // tiers are only detected with AVX-512 F/BW/VL, AVX2, FMA and F16C present.
                    $crate::simd::Tier::Avx512 | $crate::simd::Tier::Avx512Bf16 => {
                        return unsafe { fast512($($arg),*) }
                    }
                    // SAFETY: the AVX2 tier is only detected with AVX2, FMA and F16C present.
                    $crate::simd::Tier::Avx2 => return unsafe { fast($($arg),*) },
                    $crate::simd::Tier::Portable => {}
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
