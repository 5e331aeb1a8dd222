"""fp8 block-scaled GEMM peers on the GPU, same shapes as benches/gpu_fp8.rs:
torch bf16 matmul (cuBLAS) and torch's DeepSeek-style block-scaled fp8 GEMM (cuBLASLt,
1x128 activation and 128x128 weight scales), timed with pre-quantized operands (GEMM only)
and with the activation quantization done by torch ops (what a layer call costs).

    python3 benches/peers/fp8_gemm.py --json peers_fp8.jsonl
"""
import argparse

import torch
import torch.nn.functional as F

from common import emit, time_ms

SHAPES = [(2112, 7168), (24576, 1536), (7168, 16384), (4096, 7168), (7168, 2048)]
MS = [1, 16, 64, 128, 4096]
FP8 = torch.float8_e4m3fn


def quant_blocks(w):
    """[N, K] -> e4m3 codes and [N/128, K/128] dequantization scales (amax / 448)."""
    n, k = w.shape
    b = w.reshape(n // 128, 128, k // 128, 128)
    s = b.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (b / s[:, None, :, None]).to(FP8).reshape(n, k)
    return q, s.float()


def quant_groups(x):
    """[M, K] -> e4m3 codes and [M, K/128] scales, per token per 128-group."""
    m, k = x.shape
    g = x.float().reshape(m, k // 128, 128)
    s = g.abs().amax(dim=2).clamp(min=1e-12) / 448.0
    return (g / s[:, :, None]).to(FP8).reshape(m, k), s


def scaled_mm(xq, sx, wq, sw):
    """cuBLASLt block scaling through whichever API this torch has."""
    sa = sx.t().contiguous().t()  # [M, K/128], M contiguous
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        L = sw.shape[1]
        sb = F.pad(sw, (0, (-L) % 4)).t()  # [L4, N/128], rows of L4
        return F.scaled_mm(xq, wq.t(), sa, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise128x128,
                           swizzle_a=F.SwizzleType.NO_SWIZZLE, swizzle_b=F.SwizzleType.NO_SWIZZLE,
                           output_dtype=torch.bfloat16)
    return torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sw.t(), out_dtype=torch.bfloat16)


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
            ms = time_ms(lambda: x @ wb.t())
            emit(args.json, op="fp8_linear", impl="torch_bf16", gpu=gpu, m=m, n=n, k=k, ms=ms, tflops=flops / ms / 1e9)
            xq, sx = quant_groups(x)
            try:
                ref = (x.float() @ w.t()).float()
                got = scaled_mm(xq, sx, wq, sw).float()
                err = ((got - ref).norm() / ref.norm()).item()
                ms = time_ms(lambda: scaled_mm(xq, sx, wq, sw))
                emit(args.json, op="fp8_linear", impl="torch_scaled_mm", gpu=gpu, m=m, n=n, k=k, ms=ms,
                     tflops=flops / ms / 1e9, rel_err_vs_f32=err)
                ms = time_ms(lambda: scaled_mm(*quant_groups(x), wq, sw))
                emit(args.json, op="fp8_linear", impl="torch_scaled_mm_with_quant", gpu=gpu, m=m, n=n, k=k,
                     ms=ms, tflops=flops / ms / 1e9)
            except Exception as e:  # unsupported on this GPU / torch / shape: say so
                emit(args.json, op="fp8_linear", impl="torch_scaled_mm", gpu=gpu, m=m, n=n, k=k,
                     error=f"{type(e).__name__}: {e}"[:300])


if __name__ == "__main__":
    main()
