"""NSA selection peers on the GPU, same configuration as benches/gpu_nsa.rs (B = 1, Hq = 64,
Hkv = 4, D = 128, bf16, 16 selected blocks of 64; prefill at T in 4k..64k; decode B = 16 at
Tk = 64k): dense attention, PyTorch's flash SDPA (causal; decode attends to the whole cache),
and fla's Triton `parallel_nsa` selection kernel (PyPI fla-core; the forward alone, no
compression branch). Decode lasts microseconds, so it is timed from CUDA-graph replays
(eager time alongside); prefill is long enough for eager timing.

    python3 benches/peers/nsa.py --json peers_nsa.jsonl
"""
import argparse
import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import emit, time_graphed, time_ms

HQ, HKV, D, BS, S = 64, 4, 128, 64, 16


def block_indices(b, tq, tk, device):
    """[b, tq, HKV, S] sorted block ids, -1 first where fewer are visible (fla's test layout):
    block 0, the query's own block and random visible ones."""
    nb = -(-tk // BS)
    pos = torch.arange(tk - tq, tk, device=device)
    own = pos // BS
    visible = torch.arange(nb, device=device)[None, :] <= own[:, None]  # [tq, nb]
    r = torch.rand(b, tq, HKV, nb, device=device)
    r = r.masked_fill(~visible[None, :, None], -1.0)
    r[..., 0] = 2.0  # the initial block
    r.scatter_(3, own[None, :, None, None].expand(b, tq, HKV, 1), 2.0)  # the local block
    s = min(S, nb)
    val, idx = r.topk(s, dim=-1)
    idx = idx.masked_fill(val < 0, -1)
    if s < S:
        idx = torch.cat([idx, idx.new_full((b, tq, HKV, S - s), -1)], -1)
    return idx.sort(-1)[0]


def fla_forward():
    try:
        from fla.ops.nsa.parallel import parallel_nsa_fwd
    except Exception as e:
        return None, f"fla not importable: {type(e).__name__}: {e}"
    params = inspect.signature(parallel_nsa_fwd).parameters

    def run(q, k, v, idx, scale):
        kw = {}
        if "block_counts" in params:
            kw["block_counts"] = S
        if "block_size" in params:
            kw["block_size"] = BS
        if "scale" in params:
            kw["scale"] = scale
        return parallel_nsa_fwd(q=q, k=k, v=v, block_indices=idx, **kw)

    return run, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    fla, why = fla_forward()
    print(f"{gpu}, torch {torch.__version__}; fla: {'yes' if fla else why}")
    scale = D ** -0.5
    for t in [4096, 8192, 16384, 32768, 65536]:
        q = torch.randn(1, t, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, t, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, t, HKV, D, device="cuda", dtype=torch.bfloat16)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ms = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True))
        emit(args.json, op="nsa_prefill", impl="sdpa_flash_dense", gpu=gpu, t=t, ms=ms)
        if fla:
            idx = block_indices(1, t, t, "cuda")
            try:
                ms = time_ms(lambda: fla(q, k, v, idx, scale))
                emit(args.json, op="nsa_prefill", impl="fla_parallel_nsa", gpu=gpu, t=t, ms=ms)
            except Exception as e:
                emit(args.json, op="nsa_prefill", impl="fla_parallel_nsa", gpu=gpu, t=t, error=f"{type(e).__name__}: {e}"[:300])
        del q, k, v, qt, kt, vt
        torch.cuda.empty_cache()
    b, tk = 16, 65536
    q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, tk, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, tk, HKV, D, device="cuda", dtype=torch.bfloat16)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ms, eager = time_graphed(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=False, enable_gqa=True))
    emit(args.json, op="nsa_decode", impl="sdpa_flash_dense", gpu=gpu, b=b, tk=tk, ms=ms, ms_eager=eager)
    if fla:
        idx = block_indices(b, 1, tk, "cuda")
        try:
            ms, eager = time_graphed(lambda: fla(q, k, v, idx, scale))
            emit(args.json, op="nsa_decode", impl="fla_parallel_nsa", gpu=gpu, b=b, tk=tk, ms=ms, ms_eager=eager)
        except Exception as e:
            emit(args.json, op="nsa_decode", impl="fla_parallel_nsa", gpu=gpu, b=b, tk=tk, error=f"{type(e).__name__}: {e}"[:300])


if __name__ == "__main__":
    main()
