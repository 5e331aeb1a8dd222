"""fp8 block-scaled GEMM peers on the GPU, same shapes as benches/gpu_fp8.rs:
torch bf16 matmul (cuBLAS) and torch's DeepSeek-style block-scaled fp8 GEMM (cuBLASLt,
1x128 activation and 128x128 weight scales), timed with pre-quantized operands (GEMM only)
and with the activation quantization done by torch ops (what a layer call costs). Times are
taken from CUDA-graph replays where capture works (no Python launch overhead: at M <= 16 a
GEMM lasts a few microseconds), with the eager time alongside.

    python3 benches/peers/fp8_gemm.py --json peers_fp8.jsonl
"""
import argparse

import torch
import torch.nn.functional as F

from common import emit, time_graphed

SHAPES = [(2112, 7168), (24576, 1536), (7168, 16384), (4096, 7168), (7168, 2048)]
MS = [1, 16, 64, 128, 4096]
FP8 = torch.float8_e4m3fn


def quant_blocks(w):
    """[N, K] -> e4m3 codes and [ceil(N/128), K/128] dequantization scales (amax / 448);
    N need not be a multiple of 128 (N = 2112): the last block row is padded with zeros."""
    n, k = w.shape
    rows = -(-n // 128) * 128
    b = F.pad(w, (0, 0, 0, rows - n)).reshape(rows // 128, 128, k // 128, 128)
    s = b.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (b / s[:, None, :, None]).to(FP8).reshape(rows, k)[:n].contiguous()
    return q, s.float()


def quant_groups(x):
    """[M, K] -> e4m3 codes and [M, K/128] scales, per token per 128-group."""
    m, k = x.shape
    g = x.float().reshape(m, k // 128, 128)
    s = g.abs().amax(dim=2).clamp(min=1e-12) / 448.0
    return (g / s[:, :, None]).to(FP8).reshape(m, k), s


def operands(sx, wq, sw):
    """The layouts torch._scaled_mm's block-wise path checks: b = W^T column-major, scale_a
    [M, K/128] with M contiguous, scale_b [K/128, ceil(N/128)] with K/128 contiguous."""
    return sx.t().contiguous().t(), wq.t(), sw.t()


def scaled_mm(xq, sa, wt, sb):
    """cuBLASLt block scaling (1x128 activations, 128x128 weights) through torch."""
    return torch._scaled_mm(xq, wt, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}, torch {torch.__version__}")
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda") * 0.02
        wb = w.bfloat16()
        wq, sw = quant_blocks(w)
        for m in MS:
            x = torch.randn(m, k, device="cuda").bfloat16()
            flops = 2 * m * n * k
            ms, eager = time_graphed(lambda: x @ wb.t())
            emit(args.json, op="fp8_linear", impl="torch_bf16", gpu=gpu, m=m, n=n, k=k, ms=ms, ms_eager=eager,
                 tflops=flops / ms / 1e9)
            xq, sx = quant_groups(x)
            try:
                sa, wt, sb = operands(sx, wq, sw)
                ref = (x.float() @ w.t()).float()
                got = scaled_mm(xq, sa, wt, sb).float()
                err = ((got - ref).norm() / ref.norm()).item()
                ms, eager = time_graphed(lambda: scaled_mm(xq, sa, wt, sb))
                emit(args.json, op="fp8_linear", impl="torch_scaled_mm", gpu=gpu, m=m, n=n, k=k, ms=ms,
                     ms_eager=eager, tflops=flops / ms / 1e9, rel_err_vs_f32=err)

                def with_quant():
                    q, s = quant_groups(x)
                    return scaled_mm(q, s.t().contiguous().t(), wt, sb)

                ms, eager = time_graphed(with_quant)
                emit(args.json, op="fp8_linear", impl="torch_scaled_mm_with_quant", gpu=gpu, m=m, n=n, k=k,
                     ms=ms, ms_eager=eager, tflops=flops / ms / 1e9)
            except Exception as e:  # unsupported on this GPU / torch / shape: say so
                emit(args.json, op="fp8_linear", impl="torch_scaled_mm", gpu=gpu, m=m, n=n, k=k,
                     error=f"{type(e).__name__}: {e}"[:300])


if __name__ == "__main__":
    main()
