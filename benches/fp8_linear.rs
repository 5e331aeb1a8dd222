//! CPU `Fp8Linear` vs Candle's f32 matmul (`candle_nn::Linear`) on the same, dequantized
//! weight, and vs Candle's own 8-bit path (`QMatMul` with Q8_0 weights, the format a Candle user
//! would pick instead), measured in the same run. Prints the ratios, the CPU model and the SIMD
//! tier at the end. It also runs W8A8 capped to each lower tier the machine has (AVX2, and
//! AVX-512 below AVX512-BF16), so what each tier's kernels gain is measured in the same run.
//!
//! `cargo bench --bench fp8_linear` (add `-- --quick` for a short run).

mod util;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use criterion::BenchmarkId;
use fp8nsa::cpu::Tier;
use fp8nsa::{ActQuant, Fp8BlockWeight, Fp8Linear};

const N: usize = 4096;
const K: usize = 4096;
const MS: [usize; 4] = [1, 4, 16, 128];
const BASELINE: &str = "candle_f32_matmul";
const PEER: &str = "candle_q8_0_qmatmul";
const OURS: [(&str, ActQuant); 2] = [
    ("fp8_w8a8_group", ActQuant::Group),
    ("fp8_w8a16", ActQuant::None),
];
/// W8A8 capped to the AVX2 tier, run only where the AVX-512 tier exists.
const OURS_AVX2: &str = "fp8_w8a8_group_avx2_tier";
/// W8A8 capped to the AVX-512 (F16C decode) tier, run only where the AVX512-BF16 tier exists.
const OURS_AVX512: &str = "fp8_w8a8_group_avx512_tier";

fn main() {
    let mut c = util::criterion(20, 4);
    let group = format!("fp8_linear_cpu_n{N}_k{K}");
    let dev = Device::Cpu;
    let w = Tensor::randn(0f32, 0.02, (N, K), &dev).unwrap();
    let wq = Fp8BlockWeight::quantize(&w, [128, 128]).unwrap();
    let dense = candle_nn::Linear::new(wq.dequantize(DType::F32).unwrap(), None);
    let q8 = QMatMul::from_qtensor(
        QTensor::quantize(&wq.dequantize(DType::F32).unwrap(), GgmlDType::Q8_0).unwrap(),
    )
    .unwrap();
    for m in MS {
        let x = Tensor::randn(0f32, 1.0, (m, K), &dev).unwrap();
        let mut g = c.benchmark_group(&group);
        g.throughput(criterion::Throughput::Elements((2 * m * N * K) as u64));
        g.bench_with_input(BenchmarkId::new(BASELINE, m), &x, |b, x| {
            b.iter(|| dense.forward(x).unwrap())
        });
        g.bench_with_input(BenchmarkId::new(PEER, m), &x, |b, x| {
            b.iter(|| q8.forward(x).unwrap())
        });
        for (name, act) in OURS {
            let layer = Fp8Linear::new(wq.clone(), None, act).unwrap();
            g.bench_with_input(BenchmarkId::new(name, m), &x, |b, x| {
                b.iter(|| layer.forward(x).unwrap())
            });
        }
        // the lower tiers' kernels on the same machine, in the same run: what the higher ones
        // gain
        for (name, tier) in [(OURS_AVX2, Tier::Avx2), (OURS_AVX512, Tier::Avx512)] {
            if Tier::detected() > tier && tier > Tier::Portable {
                let layer = Fp8Linear::new(wq.clone(), None, ActQuant::Group).unwrap();
                let top = Tier::detected();
                Tier::cap(tier);
                g.bench_with_input(BenchmarkId::new(name, m), &x, |b, x| {
                    b.iter(|| layer.forward(x).unwrap())
                });
                Tier::cap(top);
            }
        }
        g.finish();
    }
    c.final_summary();
    let params: Vec<String> = MS.iter().map(|m| m.to_string()).collect();
    let ours = [OURS[0].0, OURS[1].0, OURS_AVX2, OURS_AVX512];
    util::print_ratios(&group, BASELINE, &ours, &params);
    util::print_ratios(&group, PEER, &ours, &params);
    util::print_ratios(&group, OURS_AVX2, &ours[..1], &params);
    util::print_ratios(&group, OURS_AVX512, &ours[..1], &params);
    util::print_machine();
}
