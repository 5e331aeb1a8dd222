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
    hsum16(acc) + tail
}

/// The sum of 16 lanes as a tree (8 + 8, 4 + 4, ...), which LLVM turns into a few vector adds
/// and shuffles; a left-to-right sum is a chain of 16 dependent scalar adds (IEEE order), which
/// cost more than the dot product itself at attention's head size of 64.
#[inline(always)]
pub(crate) fn hsum16(acc: [f32; 16]) -> f32 {
    let mut h8 = [0f32; 8];
    for i in 0..8 {
        h8[i] = acc[i] + acc[i + 8];
    }
    let mut h4 = [0f32; 4];
    for i in 0..4 {
        h4[i] = h8[i] + h8[i + 4];
    }
    (h4[0] + h4[2]) + (h4[1] + h4[3])
}

/// `e^x` for `x <= 0` (softmax's shifted scores), to within ~2 ulp of the rounded value, as
/// plain arithmetic that LLVM vectorizes over a slice: `x = n·ln2 + r` (Cody-Waite, two-part
/// ln2), `e^r` by a degree-7 polynomial on `|r| <= ln2/2`, and `2^n` built in the exponent
/// bits. Below -87.3 (where `e^x` leaves the normal range) it gives 0; `-inf` gives 0 and NaN
/// stays NaN. Positive inputs are not this function's domain (they are clamped to 0, i.e. 1).
#[inline(always)]
pub(crate) fn exp_nonpos(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // NaN compares false both ways and passes through the clamps unchanged
    let x = if x > 0.0 { 0.0 } else { x };
    let under = x < -87.3;
    let xc = if under { -87.3 } else { x };
    let n = (xc * LOG2E).round_ties_even();
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    // Taylor coefficients 1/k!; on |r| <= 0.347 the degree-7 remainder is below 2^-27
    let p = 1.0 / 5040.0;
    let p = p * r + 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    // n in [-126, 0]: 2^n is a normal f32. Its exponent bits come from n + 1.5·2^23, whose low
    // mantissa bits hold n as an integer, not from `n as i32`: that saturating conversion
    // vectorizes into a compare-and-fix sequence, a third of the blocked attention's own time.
    // (For a NaN n the bits are arbitrary, and p, NaN, makes the product NaN.)
    const ROUND: f32 = 12_582_912.0;
    let scale = f32::from_bits(((n + ROUND).to_bits().wrapping_add(127)) << 23);
    if under {
        0.0
    } else {
        p * scale
    }
}

/// `[f(0), f(1), .., f(N - 1)]`, built in place. `<[T; N]>::map` and `std::array::from_fn` go
/// through a generic `try_map` that stays a call inside the kernels' target-feature bodies:
/// three calls per four-row group of the decode GEMV, 2-3% of a SmolLM2 decode step in a
/// profile.
#[inline(always)]
pub(crate) fn lanes<const N: usize, T: Copy>(mut f: impl FnMut(usize) -> T) -> [T; N] {
    const { assert!(N > 0) };
    let mut out = [f(0); N];
    for (i, o) in out.iter_mut().enumerate().skip(1) {
        *o = f(i);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `exp_nonpos` against f64 over its whole domain, near the underflow cut and at the
    /// special values; a few ulp at most.
    #[test]
    fn exp_nonpos_matches_f64() {
        let mut worst = 0f64;
        let mut x = 0f32;
        while x > -90.0 {
            for v in [x, x - 1e-3, x * 0.999_9] {
                let got = exp_nonpos(v) as f64;
                let want = (v as f64).exp();
                if want >= f32::MIN_POSITIVE as f64 && v >= -87.3 {
                    worst = worst.max((got - want).abs() / want);
                } else {
                    assert!(got <= 2.0 * f32::MIN_POSITIVE as f64, "{v}: {got}");
                }
            }
            x -= 0.013_7;
        }
        assert!(
            worst < 3.0 * f32::EPSILON as f64,
            "worst relative error {worst:e}"
        );
        assert_eq!(exp_nonpos(0.0), 1.0);
        assert_eq!(exp_nonpos(f32::NEG_INFINITY), 0.0);
        assert!(exp_nonpos(f32::NAN).is_nan());
        assert_eq!(exp_nonpos(5.0), 1.0); // outside the domain: clamped
    }

    #[test]
    fn hsum16_sums() {
        let v: [f32; 16] = std::array::from_fn(|i| i as f32);
        assert_eq!(hsum16(v), 120.0);
    }
}
