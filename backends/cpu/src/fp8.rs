//! The fp8 e4m3fn codec: bias 7, 3 mantissa bits, max finite 448, no infinities,
//! NaN = 0x7f / 0xff.

/// Largest finite e4m3fn magnitude.
pub const E4M3_MAX: f32 = 448.0;
/// Floor of a block's amax before it becomes a scale, so an all-zero block never divides by 0.
pub const AMAX_FLOOR: f32 = 1e-12;

/// The dequantization multiplier of a block (or activation group) with this amax.
#[inline]
pub fn scale_for_amax(amax: f32) -> f32 {
    amax.max(AMAX_FLOOR) / E4M3_MAX
}

/// Decodes one e4m3fn byte without branches (the selects become blends), so loops over it
/// vectorize.
#[inline(always)]
pub fn e4m3_to_f32(b: u8) -> f32 {
    let b = b as u32;
    let sign = (b & 0x80) << 24;
    let mag = b & 0x7f;
    // Normal: move exponent and mantissa into place and rebias the exponent from 7 to 127.
    let normal = (mag << 20) + (120 << 23);
    // Subnormal (exponent field 0): mantissa * 2^-9, exact in f32.
    let sub = ((mag & 7) as f32 * (1.0 / 512.0)).to_bits();
    let bits = if mag == 0x7f {
        0x7fc0_0000
    } else if mag < 8 {
        sub
    } else {
        normal
    };
    f32::from_bits(bits | sign)
}

/// Encodes `x` as e4m3fn: round to nearest even, saturate to ±448 (infinities too), NaN stays
/// NaN.
#[inline]
pub fn f32_to_e4m3(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let a = f32::from_bits(bits & 0x7fff_ffff);
    if a.is_nan() {
        return sign | 0x7f;
    }
    if a >= E4M3_MAX {
        return sign | 0x7e;
    }
    if a < 1.0 / 64.0 {
        // Subnormal range: multiples of 2^-9. A result of 8 is the smallest normal, code 0x08.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // Round the 23-bit mantissa to 3 bits, ties to even, letting a carry bump the exponent.
    let abits = a.to_bits();
    let lsb = (abits >> 20) & 1;
    let r = (abits + 0x7ffff + lsb) >> 20;
    let code = r - ((127 - 7) << 3);
    sign | code.min(0x7e) as u8
}

/// `sat(rne(x / s))`, the quantization of the contract.
#[inline]
pub fn quantize(x: f32, s: f32) -> u8 {
    f32_to_e4m3(x / s)
}

/// `decode(quantize(x, s)) * mul`, computed in the value domain without branches so that it
/// vectorizes: round the mantissa to 3 bits (ties to even) for normals, to multiples of 2^-9
/// for subnormals, saturate to ±448, keep NaN.
#[inline(always)]
pub(crate) fn fake_quant(x: f32, s: f32, mul: f32) -> f32 {
    let q = x / s;
    let bits = q.to_bits();
    let normal = f32::from_bits(bits.wrapping_add(0x7ffff + ((bits >> 20) & 1)) & !0xfffff);
    let sub = (q * 512.0).round_ties_even() * (1.0 / 512.0);
    let r = if q.abs() < 1.0 / 64.0 { sub } else { normal };
    let r = r.clamp(-E4M3_MAX, E4M3_MAX);
    if q.is_nan() {
        q
    } else {
        r * mul
    }
}

#[inline(always)]
fn fake_quant_slice_impl<A: crate::simd::Arith>(x: &[f32], s: f32, mul: f32, out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = fake_quant(v, s, mul);
    }
}

crate::simd::simd_dispatch!(
    /// `out[i] = decode(quantize(x[i], s)) * mul`, vectorized; equal to going through the codes.
    pub fn fake_quant_slice => fake_quant_slice_impl(x: &[f32], s: f32, mul: f32, out: &mut [f32])
);

#[inline(always)]
fn decode_scaled_impl<A: crate::simd::Arith>(src: &[u8], scale: f32, dst: &mut [f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = e4m3_to_f32(s) * scale;
    }
}

crate::simd::simd_dispatch!(
    fn decode_scaled_loop => decode_scaled_impl(src: &[u8], scale: f32, dst: &mut [f32])
);

/// `dst[i] = decode(src[i]) * scale` over the common length, vectorized: through F16C on the
/// AVX2 tier (16 lanes on AVX-512), plain loops below; bit-identical on every tier (a NaN's
/// sign and payload aside).
///
/// ```
/// let mut out = [0f32; 3];
/// fp8nsa_cpu::fp8::decode_scaled(&[0x38, 0xb8, 0x7f], 2.0, &mut out);
/// assert_eq!(out[..2], [2.0, -2.0]);
/// assert!(out[2].is_nan());
/// ```
pub fn decode_scaled(src: &[u8], scale: f32, dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let tier = crate::simd::Tier::current();
        if tier >= crate::simd::Tier::Avx512 {
            // SAFETY: the AVX-512 tier is only in force where AVX-512 F/BW/VL, AVX2, FMA and
            // F16C were detected.
            return unsafe { crate::avx512::decode_scaled(src, scale, dst) };
        }
        if tier >= crate::simd::Tier::Avx2 {
            // SAFETY: the AVX2 tier is only in force where AVX2, FMA and F16C were detected.
            return unsafe { crate::x86::decode_scaled(src, scale, dst) };
        }
    }
    decode_scaled_loop(src, scale, dst)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Exact value of a code, straight from the definition of the format.
    fn by_definition(c: u8) -> f64 {
        let sign = if c & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = ((c >> 3) & 0xf) as i32;
        let m = (c & 7) as f64;
        if c & 0x7f == 0x7f {
            return f64::NAN;
        }
        if e == 0 {
            sign * m / 8.0 * 2f64.powi(-6)
        } else {
            sign * (1.0 + m / 8.0) * 2f64.powi(e - 7)
        }
    }

    #[test]
    fn decode_all_256_codes() {
        for c in 0..=255u8 {
            let ours = e4m3_to_f32(c);
            let def = by_definition(c);
            let theirs = float8::F8E4M3::from_bits(c).to_f32();
            if def.is_nan() {
                assert!(ours.is_nan() && theirs.is_nan(), "code {c:#x}");
            } else {
                assert_eq!(ours as f64, def, "code {c:#x}");
                assert_eq!(ours.to_bits(), theirs.to_bits(), "code {c:#x} vs float8");
            }
        }
        let mut buf = [0f32; 256];
        let codes: Vec<u8> = (0..=255).collect();
        decode_scaled(&codes, 1.0, &mut buf);
        for (c, v) in buf.iter().enumerate() {
            assert!(
                v.to_bits() == e4m3_to_f32(c as u8).to_bits() || (v.is_nan() && c & 0x7f == 0x7f)
            );
        }
    }

    #[test]
    fn fake_quant_equals_encode_then_decode() {
        use rand::Rng;
        let mut rng = rng();
        let mut xs: Vec<f32> = (0..100_000)
            .map(|_| rng.random_range(-1.0f32..1.0) * 2f32.powi(rng.random_range(-14..11)))
            .collect();
        for c in 0..0x7eu8 {
            let mid = (e4m3_to_f32(c) + e4m3_to_f32(c + 1)) / 2.0;
            xs.extend([
                mid,
                -mid,
                f32::from_bits(mid.to_bits() + 1),
                f32::from_bits(mid.to_bits() - 1),
            ]);
        }
        xs.extend([
            0.0,
            -0.0,
            448.0,
            464.0,
            500.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            1e-40,
        ]);
        for s in [1.0f32, 0.37, 3.0e-3] {
            let mut out = vec![0f32; xs.len()];
            fake_quant_slice(&xs, s, s, &mut out);
            for (x, o) in xs.iter().zip(&out) {
                let want = e4m3_to_f32(quantize(*x, s)) * s;
                assert_eq!(
                    o.to_bits(),
                    want.to_bits(),
                    "x = {x:e}, s = {s}: {o:e} vs {want:e}"
                );
            }
        }
        let mut out = [0f32];
        fake_quant_slice(&[f32::NAN], 1.0, 1.0, &mut out);
        assert!(out[0].is_nan());
    }

    #[test]
    fn encode_round_trips_every_code() {
        for c in 0..=255u8 {
            if c & 0x7f == 0x7f {
                assert_eq!(f32_to_e4m3(e4m3_to_f32(c)) & 0x7f, 0x7f);
            } else {
                assert_eq!(f32_to_e4m3(e4m3_to_f32(c)), c, "code {c:#x}");
            }
        }
    }

    #[test]
    fn encode_boundaries() {
        let v = |x: f32| e4m3_to_f32(f32_to_e4m3(x));
        // saturation, infinities, NaN, signed zero
        assert_eq!(v(448.0), 448.0);
        assert_eq!(v(449.0), 448.0);
        assert_eq!(v(464.0), 448.0);
        assert_eq!(v(1e9), 448.0);
        assert_eq!(v(f32::INFINITY), 448.0);
        assert_eq!(v(f32::NEG_INFINITY), -448.0);
        assert!(v(f32::NAN).is_nan());
        assert_eq!(f32_to_e4m3(-0.0), 0x80);
        // 416 and 448 are neighbours (mantissa 5 and 6); 432 is their tie -> even (448).
        assert_eq!(v(432.0), 448.0);
        assert_eq!(v(431.9), 416.0);
        // normal ties: 1.0625 between 1.0 (even) and 1.125; 1.1875 between 1.125 and 1.25 (even)
        assert_eq!(v(1.0625), 1.0);
        assert_eq!(v(1.0626), 1.125);
        assert_eq!(v(1.1875), 1.25);
        assert_eq!(v(-1.1875), -1.25);
        // mantissa carry into the exponent: 1.9375 is the tie of 1.875 and 2.0 (even)
        assert_eq!(v(1.9375), 2.0);
        // subnormals: step 2^-9; ties to even; the largest rounds up to the smallest normal
        let s = 2f32.powi(-9);
        assert_eq!(v(s), s);
        assert_eq!(v(0.5 * s), 0.0);
        assert_eq!(v(0.51 * s), s);
        assert_eq!(v(1.5 * s), 2.0 * s);
        assert_eq!(v(2.5 * s), 2.0 * s);
        assert_eq!(v(7.5 * s), 8.0 * s);
        assert_eq!(f32_to_e4m3(7.5 * s), 0x08);
        assert_eq!(v(2f32.powi(-6)), 2f32.powi(-6));
        assert_eq!(v(1e-30), 0.0);
        assert_eq!(v(f32::from_bits(1)), 0.0);
    }

    /// Nearest finite code by exhaustive search, ties to the even code; the obvious encoder.
    fn brute_force(x: f32) -> u8 {
        if x.is_nan() {
            return 0x7f;
        }
        let a = x.abs().min(E4M3_MAX) as f64;
        let mut best = 0u8;
        for c in 0..0x7fu8 {
            let (d, db) = (
                (by_definition(c) - a).abs(),
                (by_definition(best) - a).abs(),
            );
            if d < db || (d == db && c % 2 == 0) {
                best = c;
            }
        }
        if x.is_sign_negative() {
            best | 0x80
        } else {
            best
        }
    }

    /// A seeded rng; FP8NSA_TEST_SEED replays a failure.
    fn rng() -> rand::rngs::StdRng {
        fp8nsa_test_support::rng("cpu_fp8")
    }

    #[test]
    fn encode_matches_brute_force() {
        use rand::Rng;
        let mut rng = rng();
        for _ in 0..200_000 {
            let x: f32 = rng.random_range(-1.0f32..1.0) * 2f32.powi(rng.random_range(-12..10));
            assert_eq!(f32_to_e4m3(x), brute_force(x), "x = {x:e}");
        }
        // every midpoint and its neighbours
        for c in 0..0x7eu8 {
            let mid = ((by_definition(c) + by_definition(c + 1)) / 2.0) as f32;
            for x in [
                mid,
                f32::from_bits(mid.to_bits() - 1),
                f32::from_bits(mid.to_bits() + 1),
            ] {
                assert_eq!(f32_to_e4m3(x), brute_force(x), "x = {x:e}");
            }
        }
    }
}
