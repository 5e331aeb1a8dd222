"""Benchmark v1 / v2 / v3 against the plain-XLA (jnp) implementation of the same contract, on a
TPU. Without a TPU it says so and exits 0 (interpret-mode timings would measure the simulator).

    python3 bench.py [--shapes 576,3884;4096,4096] [--buckets 1,16,128,512] [--block 128]
                     [--act group] [--iters 50] [--seed N]

Every timing includes the wrapper (padding, activation quantization), for the kernels and for
XLA alike, and is the median over --iters calls after a warm-up; ratios are against XLA in the
same run. Weight GB/s = N*K fp8 bytes / time (decode is bound by it).
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from fp8nsa_tpu import kernels
from fp8nsa_tpu import reference as ref


def _median_time(f, args, iters: int) -> float:
    jax.block_until_ready(f(*args))  # compile + warm up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="576,3884;1536,576;4096,4096;14336,4096")
    p.add_argument("--buckets", default="1,16,128,512")
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--act", default="group", choices=kernels.ACTS)
    p.add_argument("--bm", type=int, default=128)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--seed", type=int, default=None)
    a = p.parse_args(argv)

    dev = jax.devices()[0]
    if dev.platform != "tpu":
        print(f"bench.py: no TPU here (jax.devices()[0] is {dev.platform!r}); nothing to "
              "benchmark. The kernels are checked in TPU interpret mode by tests/ instead.")
        return 0

    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(2**31)
    print(f"device: {dev.device_kind}; jax {jax.__version__}; seed {seed}; block {a.block}; "
          f"act {a.act}; median of {a.iters}")
    rng = np.random.default_rng(seed)
    bm = a.bm if a.act == "block2d" else None
    fns = {v: jax.jit(functools.partial(kernels.fp8_linear, block=a.block, act=a.act, bm=bm,
                                        variant=v)) for v in kernels.VARIANTS}
    fns["xla"] = jax.jit(functools.partial(kernels.fp8_linear_xla, block=a.block, act=a.act,
                                           bm=bm))
    print(f"{'N':>6} {'K':>6} {'M':>5} | " + " | ".join(
        f"{name:>22}" for name in fns) + "   (us, x vs xla, weight GB/s)")
    for part in a.shapes.split(";"):
        n, k = (int(v) for v in part.split(","))
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.02
        wq, sw = ref.quantize_weight(w, a.block)
        wq_d, sw_d = jnp.asarray(wq), jnp.asarray(sw)
        for m in (int(v) for v in a.buckets.split(",")):
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            base = np.asarray(fns["xla"](x, wq_d, sw_d).astype(jnp.float32))
            t = {name: _median_time(f, (x, wq_d, sw_d), a.iters) for name, f in fns.items()}
            cells = []
            for name, f in fns.items():
                err = ref.rel_fro(np.asarray(f(x, wq_d, sw_d).astype(jnp.float32)), base)
                flag = "" if err < 8e-3 else f" MISMATCH {err:.1e}"
                cells.append(f"{t[name] * 1e6:8.1f} {t['xla'] / t[name]:5.2f}x "
                             f"{n * k / t[name] / 1e9:6.0f}{flag}")
            print(f"{n:>6} {k:>6} {m:>5} | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
