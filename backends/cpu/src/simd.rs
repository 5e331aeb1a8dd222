//! Runtime SIMD dispatch. Kernels are written once as plain loops that LLVM vectorizes, generic
//! over [`Arith`]; [`simd_dispatch!`] compiles them a second time with AVX2+FMA enabled and picks
//! that copy when the CPU has it. The default x86-64 target only guarantees SSE2. What LLVM does
//! not turn into fast code on its own (the e4m3 decode) is written out in `x86` (AVX2) and
//! `avx512`.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

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

/// The instruction-set tier the CPU kernels run at: the best this CPU has, unless capped.
///
/// ```
/// use fp8nsa_cpu::simd::Tier;
/// assert!(Tier::current() <= Tier::detected());
/// assert_eq!(Tier::available()[0], Tier::Portable);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// Plain loops (any CPU; LLVM vectorizes them for SSE2).
    Portable,
    /// AVX2 + FMA + F16C: the plain loops compiled for it, and the explicit e4m3 kernels.
    Avx2,
    /// AVX-512 F / BW / VL on top of the AVX2 tier: the plain loops compiled for it, and the
    /// explicit e4m3 kernels on 16-lane vectors.
    Avx512,
    /// AVX-512 with BF16 and VBMI (Zen 4, Sapphire Rapids) on top of the AVX-512 tier: the W8A8
    /// decode GEMV multiplies bf16 pairs (`vdpbf16ps`), which hold e4m3 values exactly.
    Avx512Bf16,
}

static CAP: AtomicU8 = AtomicU8::new(Tier::Avx512Bf16 as u8);

impl Tier {
    /// The best tier this CPU has (detected once).
    pub fn detected() -> Tier {
        static DETECTED: OnceLock<Tier> = OnceLock::new();
        *DETECTED.get_or_init(detect)
    }

    /// The tier the kernels run at now: [`Tier::detected`], capped by [`Tier::cap`].
    #[inline]
    pub fn current() -> Tier {
        let cap = match CAP.load(Ordering::Relaxed) {
            0 => Tier::Portable,
            1 => Tier::Avx2,
            2 => Tier::Avx512,
            _ => Tier::Avx512Bf16,
        };
        cap.min(Self::detected())
    }

    /// Caps the tier for the whole process and returns the tier now in force. Tests use it to
    /// run every tier the machine has against the reference; a server has no reason to.
    pub fn cap(tier: Tier) -> Tier {
        CAP.store(tier as u8, Ordering::Relaxed);
        Self::current()
    }

    /// The tiers this machine can run, lowest first.
    pub fn available() -> Vec<Tier> {
        [Tier::Portable, Tier::Avx2, Tier::Avx512, Tier::Avx512Bf16]
            .into_iter()
            .filter(|t| *t <= Self::detected())
            .collect()
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Tier {
    use std::is_x86_feature_detected as has;
    let avx2 = has!("avx2") && has!("fma") && has!("f16c");
    let avx512 = avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vl");
    if avx512 && has!("avx512vbmi") && has!("avx512bf16") {
        Tier::Avx512Bf16
    } else if avx512 {
        Tier::Avx512
    } else if avx2 {
        Tier::Avx2
    } else {
        Tier::Portable
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Tier {
    Tier::Portable
}

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
