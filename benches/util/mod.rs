//! Shared by the benches: criterion settings and the ratio table read back from criterion's
//! own estimates, so every ratio compares two measurements of the same run.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use criterion::Criterion;

pub fn out_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/criterion")
}

pub fn criterion(samples: usize, measure_s: u64) -> Criterion {
    Criterion::default()
        .output_directory(&out_dir())
        .sample_size(samples)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(measure_s))
        .configure_from_args()
}

/// Median time in ns of `group/func/param` from the run that just finished.
pub fn median_ns(group: &str, func: &str, param: &str) -> Option<f64> {
    let p = out_dir()
        .join(group)
        .join(func)
        .join(param)
        .join("new/estimates.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()?;
    v["median"]["point_estimate"].as_f64()
}

/// Prints `baseline / candidate` for each (param, candidate).
pub fn print_ratios(group: &str, baseline: &str, candidates: &[&str], params: &[String]) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("\n{group}: speedup over {baseline} (median time ratio, >1 = fp8nsa faster), {threads} threads");
    for p in params {
        let Some(base) = median_ns(group, baseline, p) else {
            continue;
        };
        for c in candidates {
            if let Some(t) = median_ns(group, c, p) {
                println!(
                    "  {p:<12} {c:<18} {:>10.3} ms vs {:>10.3} ms  ratio {:.2}x",
                    t / 1e6,
                    base / 1e6,
                    base / t
                );
            }
        }
    }
}

/// The CPU model and the SIMD tier the kernels ran at, for the record next to the numbers.
pub fn print_machine() {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    println!(
        "machine: {model}; SIMD tier {:?}; {} threads",
        fp8nsa::cpu::Tier::current(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
}
