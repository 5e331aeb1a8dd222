//! Loads a Hugging Face checkpoint directory and reports the loader's peak memory against the
//! checkpoint's size on disk, then runs one short forward pass (so the model is whole).
//!
//! ```text
//! python3 benches/load/gen_fp8_checkpoint.py /tmp/fp8ckpt     # ~2.9 GiB fp8 Llama
//! cargo run -p fp8nsa-models --example load_peak -- /tmp/fp8ckpt
//! ```
//!
//! Peak memory is the kernel's high-water mark of this process's resident set (`VmHWM` in
//! /proc/self/status, Linux only).

use std::path::PathBuf;
use std::time::Instant;

use fp8nsa_models::{Model, ModelOptions};

fn status_kib(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .ok_or("usage: load_peak CHECKPOINT_DIR")?,
    );
    let on_disk: u64 = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
        .sum();
    let t = Instant::now();
    let model = Model::load_hf(&dir, &ModelOptions::default())?;
    let load_s = t.elapsed().as_secs_f64();
    let after_load = status_kib("VmHWM:").unwrap_or(0);
    let mut cache = model.new_cache();
    let logits = model.forward(&[1, 2, 3, 4], &mut cache)?;
    let gib = |kib: u64| kib as f64 / (1u64 << 20) as f64;
    println!(
        "checkpoint {:.2} GiB on disk; load {load_s:.1} s; peak RSS after load {:.2} GiB \
         ({:.2}x the checkpoint); after a forward {:.2} GiB; {} fp8 projections; logits {:?}",
        on_disk as f64 / (1u64 << 30) as f64,
        gib(after_load),
        after_load as f64 * 1024.0 / on_disk.max(1) as f64,
        gib(status_kib("VmHWM:").unwrap_or(0)),
        model.llama().fp8_layer_count(),
        logits.dims()
    );
    Ok(())
}
