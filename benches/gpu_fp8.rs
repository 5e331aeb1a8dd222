//! `Fp8Linear` on CUDA vs candle's bf16 matmul (cuBLAS) on the same weights, measured in the
//! same binary; the PyTorch peers (bf16 matmul, `torch._scaled_mm` with 1x128 / 128x128 block
//! scales) come from benches/peers/fp8_gemm.py in the same device command
//! (benches/peers/run_gpu.sh), and benches/peers/report.py puts them side by side.
//!
//! Shapes: M in {1, 16, 64, 128, 4096} x (N, K) in the DeepSeek-V3 set. Ours includes the
//! activation quantization (a layer call); TFLOPS = 2MNK / t; for M <= 16 also the weight
//! bandwidth N*K / t against the weight-read floor N*K / (device copy bandwidth), and the host's
//! time to enqueue one call ("host ms": where it reaches "ours ms", the call is bound by the
//! CPU's launches, not by the GPU). Successive
//! calls cycle through distinct copies of the weights (256 MiB or more in all, for both sides),
//! so that they come from HBM as a model's layers do, not from the 50 MB L2.
//!
//! `cargo bench --features cuda --bench gpu_fp8 -- [--json out.jsonl] [--quick]`

mod gpu;

use candle_core::{DType, Module, Tensor};
use fp8nsa::{ActQuant, CudaFp8Kernel, Fp8BlockWeight, Fp8Linear};
use serde_json::json;

const SHAPES: [(usize, usize); 5] = [
    (2112, 7168),
    (24576, 1536),
    (7168, 16384),
    (4096, 7168),
    (7168, 2048),
];
const MS: [usize; 5] = [1, 16, 64, 128, 4096];
/// Weight bytes cycled through per shape: several times the L2 cache of any current GPU.
const ROTATE_BYTES: usize = 256 << 20;

fn main() {
    let args = gpu::args();
    let (dev, stream, gpu_name) = gpu::gpu();
    let info = fp8nsa::cuda::device_info(&stream).unwrap();
    // device copy bandwidth (bytes read + written per second), the floor's yardstick
    let bytes = 1usize << 30;
    let src = stream.alloc_zeros::<u8>(bytes).unwrap();
    let mut dst = stream.alloc_zeros::<u8>(bytes).unwrap();
    let copy_ms = gpu::time_ms(&stream, || stream.memcpy_dtod(&src, &mut dst).unwrap());
    drop((src, dst));
    let copy_gbs = 2.0 * bytes as f64 / copy_ms / 1e6;
    println!(
        "{gpu_name}: sm_{}{}, {} SMs; copy bandwidth {copy_gbs:.0} GB/s",
        info.cc.0, info.cc.1, info.sms
    );
    gpu::emit(
        &args.json,
        json!({"op": "copy", "gpu": gpu_name, "gbs": copy_gbs}),
    );
    println!(
        "{:>5} {:>6} {:>6}  {:<22} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9} {:>9}",
        "M",
        "N",
        "K",
        "path",
        "ours ms",
        "bf16 ms",
        "TFLOPS",
        "x bf16",
        "GB/s",
        "x floor",
        "host ms"
    );
    let shapes: &[(usize, usize)] = if args.quick { &SHAPES[..1] } else { &SHAPES };
    for &(n, k) in shapes {
        let w = Tensor::randn(0f32, 0.02, (n, k), &dev).unwrap();
        let wq = Fp8BlockWeight::quantize(&w, [128, 128]).unwrap();
        let wt = w.to_dtype(DType::BF16).unwrap().t().unwrap();
        drop(w);
        let copies = ROTATE_BYTES.div_ceil(n * k).max(2);
        let autos: Vec<Fp8Linear> = (0..copies)
            .map(|_| {
                let data = wq.data().copy().unwrap();
                let scales = wq.scales().copy().unwrap();
                Fp8Linear::new(
                    Fp8BlockWeight::from_parts(data, scales, [128, 128]).unwrap(),
                    None,
                    ActQuant::Group,
                )
                .unwrap()
                .with_cuda_kernel(CudaFp8Kernel::Auto)
            })
            .collect();
        let wts: Vec<Tensor> = (0..copies).map(|_| wt.copy().unwrap()).collect();
        drop(wt);
        let mma = Fp8Linear::new(wq, None, ActQuant::Group)
            .unwrap()
            .with_cuda_kernel(CudaFp8Kernel::Mma);
        for &m in &MS {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            let mut i = 0;
            let t_bf16 = gpu::time_ms(&stream, || {
                drop(x.matmul(&wts[i % copies]).unwrap());
                i += 1;
            });
            // one layer call, on the next copy of the weights each time
            let mut i = 0;
            let mut ours = || {
                drop(autos[i % copies].forward(&x).unwrap());
                i += 1;
            };
            let t_ours = gpu::time_ms(&stream, &mut ours);
            // host time per call where the GPU time is short enough for the host to matter
            let host = (m <= 16).then(|| gpu::host_ms(&stream, &mut ours));
            // the path that really ran (cuBLASLt may refuse at run time and fall back)
            let path = match autos[0].forward_with_path(&x).unwrap().1 {
                fp8nsa::Fp8Path::Cuda(p) => p.to_string(),
                other => format!("{other:?}"),
            };
            let flops = 2.0 * (m * n * k) as f64;
            let tflops = flops / t_ours / 1e9;
            let gbs = (n * k) as f64 / t_ours / 1e6;
            let floor_ms = (n * k) as f64 / (copy_gbs * 1e6);
            let (gbs_s, floor_s, host_s) = match host {
                Some(h) => (
                    format!("{gbs:.0}"),
                    format!("{:.2}", t_ours / floor_ms),
                    format!("{h:.4}"),
                ),
                None => ("-".into(), "-".into(), "-".into()),
            };
            println!(
                "{m:>5} {n:>6} {k:>6}  {:<22} {t_ours:>9.4} {t_bf16:>9.4} {tflops:>9.1} {:>8.2} {gbs_s:>8} {floor_s:>9} {host_s:>9}",
                path,
                t_bf16 / t_ours
            );
            gpu::emit(
                &args.json,
                json!({"op": "fp8_linear", "impl": "fp8nsa", "path": path, "m": m, "n": n, "k": k, "ms": t_ours, "tflops": tflops, "gbs": gbs, "floor_ms": floor_ms, "host_ms": host}),
            );
            gpu::emit(
                &args.json,
                json!({"op": "fp8_linear", "impl": "candle_bf16", "m": m, "n": n, "k": k, "ms": t_bf16, "tflops": flops / t_bf16 / 1e9}),
            );
            if m > 16 && !path.starts_with("mma") {
                if let Ok(t_mma) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    gpu::time_ms(&stream, || drop(mma.forward(&x).unwrap()))
                })) {
                    println!(
                        "{:>5} {:>6} {:>6}  {:<22} {t_mma:>9.4} {:>9} {:>9.1} {:>8.2}",
                        "",
                        "",
                        "",
                        "(forced mma)",
                        "",
                        flops / t_mma / 1e9,
                        t_bf16 / t_mma
                    );
                    gpu::emit(
                        &args.json,
                        json!({"op": "fp8_linear", "impl": "fp8nsa_mma", "m": m, "n": n, "k": k, "ms": t_mma, "tflops": flops / t_mma / 1e9}),
                    );
                }
            }
        }
    }
}
