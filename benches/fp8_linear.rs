//! CPU `Fp8Linear` vs Candle's f32 matmul (`candle_nn::Linear`) on the same, dequantized
//! weight, measured in the same run. Prints the ratios at the end.
//!
//! `cargo bench --bench fp8_linear` (add `-- --quick` for a short run).

use std::path::PathBuf;

use candle_core::{DType, Device, Module, Tensor};
use criterion::{BenchmarkId, Criterion};
use fp8nsa::{ActQuant, Fp8BlockWeight, Fp8Linear};

const N: usize = 4096;
const K: usize = 4096;
const MS: [usize; 2] = [1, 128];
const BASELINE: &str = "candle_f32_matmul";
const OURS: [(&str, ActQuant); 2] = [
    ("fp8_w8a8_group", ActQuant::Group),
    ("fp8_w8a16", ActQuant::None),
];

fn out_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/criterion")
}

fn bench(c: &mut Criterion) {
    let dev = Device::Cpu;
    let w = Tensor::randn(0f32, 0.02, (N, K), &dev).unwrap();
    let wq = Fp8BlockWeight::quantize(&w, [128, 128]).unwrap();
    let dense = candle_nn::Linear::new(wq.dequantize(DType::F32).unwrap(), None);
    for m in MS {
        let x = Tensor::randn(0f32, 1.0, (m, K), &dev).unwrap();
        let mut g = c.benchmark_group(format!("fp8_linear_cpu_n{N}_k{K}"));
        g.throughput(criterion::Throughput::Elements((2 * m * N * K) as u64));
        g.bench_with_input(BenchmarkId::new(BASELINE, m), &x, |b, x| {
            b.iter(|| dense.forward(x).unwrap())
        });
        for (name, act) in OURS {
            let layer = Fp8Linear::new(wq.clone(), None, act).unwrap();
            g.bench_with_input(BenchmarkId::new(name, m), &x, |b, x| {
                b.iter(|| layer.forward(x).unwrap())
            });
        }
        g.finish();
    }
}

fn median_ns(group: &str, func: &str, m: usize) -> Option<f64> {
    let p = out_dir()
        .join(group)
        .join(func)
        .join(m.to_string())
        .join("new/estimates.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()?;
    v["median"]["point_estimate"].as_f64()
}

fn main() {
    let mut c = Criterion::default()
        .output_directory(&out_dir())
        .sample_size(20)
        .warm_up_time(std::time::Duration::from_secs(1))
        .measurement_time(std::time::Duration::from_secs(4))
        .configure_from_args();
    bench(&mut c);
    c.final_summary();
    let group = format!("fp8_linear_cpu_n{N}_k{K}");
    println!(
        "\nspeedup over {BASELINE} (median time ratio, >1 = fp8nsa faster), threads = {}:",
        rayon_threads()
    );
    for m in MS {
        let Some(base) = median_ns(&group, BASELINE, m) else {
            continue;
        };
        for (name, _) in OURS {
            if let Some(t) = median_ns(&group, name, m) {
                println!(
                    "  M={m:<4} {name:<16} {:>8.3} ms vs {:>8.3} ms  ratio {:.2}x",
                    t / 1e6,
                    base / 1e6,
                    base / t
                );
            }
        }
    }
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
