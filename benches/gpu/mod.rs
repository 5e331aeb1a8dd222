//! Shared by the GPU benches: CUDA-event timing on candle's stream and JSON-lines output.
#![allow(dead_code)]

use std::io::Write;
use std::sync::Arc;

use candle_core::Device;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaStream;

/// `--json PATH` (JSON lines appended there) and `--quick` (fewer shapes); cargo's own
/// `--bench` is ignored.
pub struct Args {
    pub json: Option<std::path::PathBuf>,
    pub quick: bool,
}

pub fn args() -> Args {
    let mut it = std::env::args().skip(1);
    let mut a = Args {
        json: None,
        quick: false,
    };
    while let Some(x) = it.next() {
        match x.as_str() {
            "--json" => a.json = it.next().map(Into::into),
            "--quick" => a.quick = true,
            _ => {}
        }
    }
    a
}

/// The GPU, or a message and exit code 2 (benchmarks need one).
pub fn gpu() -> (Device, Arc<CudaStream>, String) {
    let dev = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("this benchmark needs a CUDA device: {e}");
            std::process::exit(2);
        }
    };
    let stream = dev.as_cuda_device().unwrap().cuda_stream();
    let name = stream
        .context()
        .name()
        .unwrap_or_else(|_| "unknown GPU".into());
    (dev, stream, name)
}

/// Median milliseconds per call of `f` on `stream`: warm-up, then 15 samples of enough calls to
/// last about 2 ms each, timed with CUDA events.
pub fn time_ms(stream: &Arc<CudaStream>, mut f: impl FnMut()) -> f64 {
    let ctx = stream.context();
    // cudarc's default event flags disable timing; elapsed_ms needs a timing event.
    let event = || {
        ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .expect("CUDA event")
    };
    for _ in 0..3 {
        f();
    }
    stream.synchronize().unwrap();
    let once = {
        let (a, b) = (event(), event());
        a.record(stream).unwrap();
        f();
        b.record(stream).unwrap();
        b.synchronize().unwrap();
        a.elapsed_ms(&b).unwrap() as f64
    };
    let reps = ((2.0 / once.max(1e-3)).ceil() as usize).clamp(1, 200);
    let mut samples: Vec<f64> = (0..15)
        .map(|_| {
            let (a, b) = (event(), event());
            a.record(stream).unwrap();
            for _ in 0..reps {
                f();
            }
            b.record(stream).unwrap();
            b.synchronize().unwrap();
            a.elapsed_ms(&b).unwrap() as f64 / reps as f64
        })
        .collect();
    samples.sort_by(|a, b| a.total_cmp(b));
    samples[samples.len() / 2]
}

/// Median host milliseconds per call of `f`: the time to enqueue 50 calls without waiting for
/// the GPU, 5 samples. A call whose host time reaches its `time_ms` keeps the GPU waiting on
/// the CPU (launch-bound): its GPU time then measures the host, not the kernels.
pub fn host_ms(stream: &Arc<CudaStream>, mut f: impl FnMut()) -> f64 {
    const CALLS: usize = 50;
    f();
    stream.synchronize().unwrap();
    let mut samples: Vec<f64> = (0..5)
        .map(|_| {
            let t = std::time::Instant::now();
            for _ in 0..CALLS {
                f();
            }
            let ms = t.elapsed().as_secs_f64() * 1e3 / CALLS as f64;
            stream.synchronize().unwrap();
            ms
        })
        .collect();
    samples.sort_by(|a, b| a.total_cmp(b));
    samples[samples.len() / 2]
}

/// Appends one JSON object per line.
pub fn emit(path: &Option<std::path::PathBuf>, v: serde_json::Value) {
    if let Some(p) = path {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .unwrap();
        writeln!(f, "{v}").unwrap();
    }
}
