//! What the selection-attention suites (CPU, CUDA, the CUDA emulator) share: random
//! selections, their tensors, and the comparisons against the f64 reference.

use candle_core::{DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

/// `n` disjoint random ranges inside `[0, tk)` in random order, plus a padding entry
/// (`[7, 3]`: start past end, selects nothing).
///
/// ```
/// let mut r = fp8nsa_test_support::rng("doc");
/// let rs = fp8nsa_test_support::nsa::random_ranges(&mut r, 40, 3);
/// assert_eq!(rs.len(), 4);
/// assert!(rs.iter().all(|&[s, e]| (s < e && e <= 40) || [s, e] == [7, 3]));
/// ```
pub fn random_ranges(rng: &mut StdRng, tk: usize, n: usize) -> Vec<[i32; 2]> {
    let n = n.min(tk.div_ceil(2));
    let mut pts: Vec<i32> = (0..=tk as i32).collect();
    pts.shuffle(rng);
    let mut pts = pts[..2 * n].to_vec();
    pts.sort();
    let mut rs: Vec<[i32; 2]> = pts.chunks(2).map(|p| [p[0], p[1]]).collect();
    rs.push([7, 3]);
    rs.shuffle(rng);
    rs
}

/// One row of ranges per (batch, query, kv head), in that order, as the `[b, tq, hkv, r, 2]`
/// i32 tensor of a `SelectionRanges` (`r` the longest row; shorter rows padded with `[0, 0]`).
///
/// ```
/// let t = fp8nsa_test_support::nsa::ranges_rows(vec![vec![[0, 4]], vec![[1, 2], [5, 9]]], 1, 2, 1);
/// assert_eq!(t.dims(), &[1, 2, 1, 2, 2]);
/// ```
pub fn ranges_rows(rows: Vec<Vec<[i32; 2]>>, b: usize, tq: usize, hkv: usize) -> Tensor {
    let r = rows.iter().map(|x| x.len()).max().unwrap();
    let flat: Vec<i32> = rows
        .into_iter()
        .flat_map(|row| (0..r).flat_map(move |i| row.get(i).copied().unwrap_or([0, 0])))
        .collect();
    Tensor::from_vec(flat, (b, tq, hkv, r, 2), &Device::Cpu).unwrap()
}

/// `rms(o - want) / rms(want)` in f64, on the host (0 when both are zero, infinite when only
/// `want` is).
///
/// ```
/// use fp8nsa_test_support::{nsa::rms_ratio, tensor};
/// let w = tensor(vec![3.0, 4.0], &[2]);
/// assert_eq!(rms_ratio(&tensor(vec![3.0, 4.5], &[2]), &w), 0.1);
/// assert_eq!(rms_ratio(&w.zeros_like().unwrap(), &w.zeros_like().unwrap()), 0.0);
/// ```
pub fn rms_ratio(o: &Tensor, want: &Tensor) -> f64 {
    let f = |t: &Tensor| -> Vec<f64> {
        t.to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let (o, w) = (f(o), f(want));
    assert_eq!(o.len(), w.len());
    let num: f64 = o.iter().zip(&w).map(|(a, b)| (a - b) * (a - b)).sum();
    let den: f64 = w.iter().map(|b| b * b).sum();
    if den == 0.0 {
        return if num == 0.0 { 0.0 } else { f64::INFINITY };
    }
    (num / den).sqrt()
}

/// Asserts log-sum-exps match the reference's: `-inf` exactly where it has `-inf` (rows that
/// see no key), elsewhere within `tol · (1 + |want|)`.
pub fn check_lse(lse: &Tensor, want: &Tensor, tol: f32, what: &str) {
    let f = |t: &Tensor| -> Vec<f32> {
        let t = t.to_device(&Device::Cpu).unwrap();
        t.flatten_all().unwrap().to_vec1().unwrap()
    };
    let (a, b) = (f(lse), f(want));
    assert_eq!(a.len(), b.len(), "{what}: lse sizes");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        if y.is_infinite() {
            assert!(
                x.is_infinite() && *x < 0.0,
                "{what}: lse[{i}] = {x}, want -inf"
            );
        } else {
            assert!(
                (x - y).abs() < tol * (1.0 + y.abs()),
                "{what}: lse[{i}] = {x}, want {y}"
            );
        }
    }
}

/// f64 softmax attention of the query row `q` (`d = q.len()`) over rows `rows` of `k` / `v`:
/// row `r`'s key is `k[(base + r) · d..][..d]`, its value `v[(base + r) · dv..][..dv]`. The
/// reference of the dense attention kernels' checks.
///
/// ```
/// use fp8nsa_test_support::nsa::f64_attention;
/// // two rows, equal scores: the mean of the values
/// let o = f64_attention(&[0.0, 0.0], &[1.0, 2.0, 3.0, 4.0], &[1.0, 3.0], (0, 1), &[0, 1], 1.0);
/// assert_eq!(o, vec![2.0]);
/// ```
pub fn f64_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    (base, dv): (usize, usize),
    rows: &[usize],
    scale: f32,
) -> Vec<f64> {
    let d = q.len();
    let s: Vec<f64> = rows
        .iter()
        .map(|&r| {
            let kr = &k[(base + r) * d..(base + r + 1) * d];
            scale as f64
                * q.iter()
                    .zip(kr)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
        })
        .collect();
    let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let p: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
    let z: f64 = p.iter().sum();
    (0..dv)
        .map(|c| {
            rows.iter()
                .zip(&p)
                .map(|(&r, p)| p * v[(base + r) * dv + c] as f64)
                .sum::<f64>()
                / z
        })
        .collect()
}
