//! What fp8nsa's test suites share.
//!
//! - Test data: fresh random inputs each run (the seed is printed; `FP8NSA_TEST_SEED` replays
//!   one), with block magnitudes spread over 1e-3..1e3 so per-block scales are heterogeneous
//!   (docs/numerics.md, "Tolerances").
//! - Error metrics: relative Frobenius error and `calc_diff`.
//! - [`trace::logged`]: the values a `tracing` field took during a call.
//! - [`wrapped_message`]: the text of a layer's error that came back through candle's type.
//! - [`nsa`]: random selections and the comparisons the selection-attention suites share.
//! - [`gguf::tiny_llama`]: a small, complete llama GGUF for the loaders' suites.
//! - [`alloc::CountingAlloc`]: every thread's allocations counted, for the "allocates nothing
//!   once warm" checks.
//! - [`resource`]: the real parts a suite runs on (the XLA CPU PJRT plugin, the SmolLM2 GGUF,
//!   jax, a GPU); a missing one skips the suite, saying so, unless its `FP8NSA_REQUIRE_*` flag
//!   is set, as CI sets it: then it fails.
//!
//! ```
//! use fp8nsa_test_support::{hetero, rel_frobenius, rng, tensor};
//! let mut r = rng("doc");
//! let x = tensor(hetero(&mut r, 4, 256, 1, 128), &[4, 256]);
//! assert_eq!(rel_frobenius(&x, &x), 0.0);
//! ```

pub mod alloc;
pub mod gguf;
pub mod nsa;
pub mod resource;
pub mod trace;

use candle_core::{DType, Device, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

pub fn rng(test: &str) -> StdRng {
    let seed = std::env::var("FP8NSA_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    eprintln!("{test}: FP8NSA_TEST_SEED={seed}");
    StdRng::seed_from_u64(seed)
}

pub fn gaussian(rng: &mut StdRng, n: usize) -> Vec<f32> {
    let d = Normal::new(0f32, 1.0).unwrap();
    (0..n).map(|_| d.sample(rng)).collect()
}

/// `[rows, cols]` Gaussian data whose `br x bc` blocks each get a magnitude 10^U(-3, 3).
pub fn hetero(rng: &mut StdRng, rows: usize, cols: usize, br: usize, bc: usize) -> Vec<f32> {
    hetero_in(rng, rows, cols, br, bc, 3.0)
}

/// As [`hetero`], block magnitudes 10^U(-decades, decades).
pub fn hetero_in(
    rng: &mut StdRng,
    rows: usize,
    cols: usize,
    br: usize,
    bc: usize,
    decades: f32,
) -> Vec<f32> {
    let mags: Vec<f32> = (0..rows.div_ceil(br) * cols.div_ceil(bc))
        .map(|_| 10f32.powf(rng.random_range(-decades..decades)))
        .collect();
    let mut v = gaussian(rng, rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            v[r * cols + c] *= mags[(r / br) * cols.div_ceil(bc) + c / bc];
        }
    }
    v
}

pub fn tensor(v: Vec<f32>, dims: &[usize]) -> Tensor {
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

/// An i32 tensor on the CPU (block tables, selections).
pub fn tensor_i32(v: Vec<i32>, dims: &[usize]) -> Tensor {
    Tensor::from_vec(v, dims, &candle_core::Device::Cpu).unwrap()
}

/// `t`'s elements as f64, flattened.
pub fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_dtype(candle_core::DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The value of an e4m3fn code, decoded from the format's definition (sign, 4 exponent bits
/// with bias 7, 3 mantissa bits, subnormals below exponent 1, NaN at `0x7f` / `0xff`, no
/// infinities), independently of the crate's codec.
///
/// ```
/// use fp8nsa_test_support::e4m3_value;
/// assert_eq!(e4m3_value(0x38), 1.0);
/// assert_eq!(e4m3_value(0x7e), 448.0);
/// assert_eq!(e4m3_value(0x81), -(2f64.powi(-9)));
/// assert!(e4m3_value(0xff).is_nan());
/// ```
pub fn e4m3_value(code: u8) -> f64 {
    if code & 0x7f == 0x7f {
        return f64::NAN;
    }
    let (e, m) = (i32::from((code >> 3) & 15), f64::from(code & 7));
    let v = match e {
        0 => m / 8.0 * 2f64.powi(-6),
        _ => (1.0 + m / 8.0) * 2f64.powi(e - 7),
    };
    if code & 0x80 != 0 {
        -v
    } else {
        v
    }
}

/// The error of a call that must fail (the `Ok` value shown when it did not).
pub fn err_of<T: std::fmt::Debug, E>(r: Result<T, E>) -> E {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e,
    }
}

/// The largest `|a - b|` over all elements.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

pub fn rel_frobenius(y: &Tensor, want: &Tensor) -> f64 {
    let y = y.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let w = want.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let y = y.to_vec1::<f64>().unwrap();
    let w = w.to_vec1::<f64>().unwrap();
    assert_eq!(y.len(), w.len());
    let num: f64 = y.iter().zip(&w).map(|(a, b)| (a - b) * (a - b)).sum();
    let den: f64 = w.iter().map(|b| b * b).sum();
    (num / den).sqrt()
}

/// The little-endian bytes of an f32 tensor (e.g. scales to write into a safetensors file).
pub fn f32_le_bytes(t: &Tensor) -> Vec<u8> {
    let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The non-finite activation rule (docs/numerics.md) on a linear layer's `forward` over
/// `x [m, k]` (m >= 3): NaN, +Inf and -Inf put into rows 0, m / 2 and m - 1 make those rows'
/// outputs NaN (`exact_nan`; otherwise merely non-finite, as without activation quantization)
/// and leave every other row bit-for-bit as with zeros in their place.
pub fn check_non_finite_rows(
    forward: impl Fn(&Tensor) -> Tensor,
    x: &[f32],
    m: usize,
    k: usize,
    exact_nan: bool,
    what: &str,
) {
    let pokes = [
        (0, 3 % k, f32::NAN),
        (m / 2, k - 1, f32::INFINITY),
        (m - 1, 0, f32::NEG_INFINITY),
    ];
    let (mut bad, mut zero) = (x.to_vec(), x.to_vec());
    for &(r, c, v) in &pokes {
        bad[r * k + c] = v;
        zero[r * k + c] = 0.0;
    }
    let rows = |v: Vec<f32>| -> Vec<Vec<f32>> {
        forward(&tensor(v, &[m, k]))
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec2()
            .unwrap()
    };
    let (y, y0) = (rows(bad), rows(zero));
    for r in 0..m {
        if pokes.iter().any(|p| p.0 == r) {
            let ok = |v: &f32| {
                if exact_nan {
                    v.is_nan()
                } else {
                    !v.is_finite()
                }
            };
            assert!(
                y[r].iter().all(ok),
                "{what}: row {r} {:?}",
                &y[r][..4.min(y[r].len())]
            );
        } else {
            assert_eq!(y[r], y0[r], "{what}: row {r}");
        }
    }
}

/// DeepGEMM's `calc_diff`: 1 - 2Σxy / Σ(x² + y²).
pub fn calc_diff(y: &Tensor, want: &Tensor) -> f64 {
    let y = y.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let w = want.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let y = y.to_vec1::<f64>().unwrap();
    let w = w.to_vec1::<f64>().unwrap();
    let xy: f64 = y.iter().zip(&w).map(|(a, b)| a * b).sum();
    let sq: f64 = y.iter().zip(&w).map(|(a, b)| a * a + b * b).sum();
    1.0 - 2.0 * xy / sq
}

/// The message of an error that came back through `candle_core::Error` (a layer's
/// `Module::forward`, or an error raised inside a Candle custom op), looking through the
/// backtrace, context and path candle may add; `None` for candle's own errors. Candle keeps a
/// wrapped error only as `Display` (`Error::Wrapped(Box<dyn Display>)`, no downcast), so this
/// text is all a test can compare: match the typed error where the crate returns it (e.g.
/// `Fp8Linear::forward_t`) and compare this with its `to_string()`.
pub fn wrapped_message(e: &candle_core::Error) -> Option<String> {
    use candle_core::Error as E;
    match e {
        E::Wrapped(inner) => Some(inner.to_string()),
        E::WithBacktrace { inner, .. } | E::Context { inner, .. } | E::WithPath { inner, .. } => {
            wrapped_message(inner)
        }
        _ => None,
    }
}
