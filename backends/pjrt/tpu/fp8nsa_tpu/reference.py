"""float64 numpy reference of the fp8 block-linear numerics contract (docs/numerics.md, "Output").

Independent of the kernels on purpose: no padding, edge blocks handled by slicing, one loop over
K-blocks with both scales applied to each block's partial sum before it is added.
Activation quantization divides in float32, like every kernel (README: "Numerics").
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = np.float32(448.0)
AMAX_FLOOR = np.float32(1e-12)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def act_scales(x, bk: int, act: str, bm: int | None = None) -> np.ndarray:
    """sx per row and K-group, float32 [M, ceil(K/bk)] (Block2d: a bm-row block shares one)."""
    x32 = np.asarray(x).astype(np.float32)
    m, k = x32.shape
    kb = _cdiv(k, bk)
    amax = np.zeros((m, kb), np.float32)
    for b in range(kb):
        amax[:, b] = np.abs(x32[:, b * bk:(b + 1) * bk]).max(axis=1)
    if act == "block2d":
        if not bm or bm <= 0:
            raise ValueError("block2d needs bm > 0")
        for r0 in range(0, m, bm):
            amax[r0:r0 + bm] = amax[r0:r0 + bm].max(axis=0, keepdims=True)
    elif act != "group":
        raise ValueError(f"act must be 'group' or 'block2d', got {act!r}")
    return (np.maximum(amax, AMAX_FLOOR) / E4M3_MAX).astype(np.float32)


def quantize_act(x, bk: int, act: str, bm: int | None = None):
    """(xq as e4m3fn [M, K], sx float32 [M, Kb]): xq = sat(rne(x / sx)) with an f32 quotient."""
    x32 = np.asarray(x).astype(np.float32)
    sx = act_scales(x32, bk, act, bm)
    cols = np.repeat(sx, bk, axis=1)[:, : x32.shape[1]]
    q = np.clip(x32 / cols, -E4M3_MAX, E4M3_MAX)  # f32 / f32 -> f32, then saturate
    return q.astype(E4M3), sx  # ml_dtypes converts with round-to-nearest-even


def fp8_linear_ref(x, wq_u8, sw, *, block: int, act: str, bm: int | None = None) -> np.ndarray:
    """y [M, N] float64 = sum_kb sx[:, kb] * Sw[n/bn, kb] * (xq[:, kb] . W[:, kb]^T)."""
    wq_u8 = np.asarray(wq_u8)
    if wq_u8.dtype != np.uint8:
        raise TypeError(f"weights must be uint8 e4m3fn bytes, got {wq_u8.dtype}")
    n, k = wq_u8.shape
    bn = bk = block
    sw = np.asarray(sw, np.float64)
    if sw.shape != (_cdiv(n, bn), _cdiv(k, bk)):
        raise ValueError(f"sw must be [{_cdiv(n, bn)}, {_cdiv(k, bk)}], got {list(sw.shape)}")
    xq, sx = quantize_act(x, bk, act, bm)
    xq = xq.astype(np.float64)
    w = wq_u8.view(E4M3).astype(np.float64)
    col_block = np.arange(n) // bn
    y = np.zeros((xq.shape[0], n), np.float64)
    for b in range(sw.shape[1]):
        ks = slice(b * bk, (b + 1) * bk)
        part = xq[:, ks] @ w[:, ks].T
        y += sx[:, b:b + 1].astype(np.float64) * sw[col_block, b][None, :] * part
    return y


def quantize_weight(w, block: int):
    """Real weights [N, K] -> (e4m3fn bytes uint8 [N, K], Sw float32 [Nb, Kb]), Sw = amax/448."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    nb, kb = _cdiv(n, block), _cdiv(k, block)
    sw = np.zeros((nb, kb), np.float32)
    q = np.zeros((n, k), E4M3)
    for i in range(nb):
        for j in range(kb):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = np.maximum(np.abs(blk).max(), AMAX_FLOOR) / E4M3_MAX
            sw[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = np.clip(
                blk / s, -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return q.view(np.uint8), sw


def rel_fro(y, ref) -> float:
    """||y - ref|| / ||ref|| (Frobenius), in float64."""
    y = np.asarray(y, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-300))
