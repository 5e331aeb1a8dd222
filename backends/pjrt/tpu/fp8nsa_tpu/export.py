"""Export the kernels for the `tpu` platform with jax.export (no TPU needed) and dump them.

    python3 -m fp8nsa_tpu.export --out DIR --shapes 576,3884[;N,K...] --buckets 1,16,128 \
        --block 128 --act group --variants v1,v2,v3 [--dtype bf16] [--bm 128]

Per (variant, shape, M bucket) it writes
    <stem>.bin            exported.serialize() bytes (jax.export.deserialize reads them back)
    <stem>.mlir           the Mosaic TPU MLIR of the Pallas kernel, as text: the StableHLO
                          module carries it only as base64 bytecode inside tpu_custom_call,
                          so this is what `fp8nsa inspect --expect v1|v2|v3` needs to see
    <stem>.stablehlo      the exported StableHLO module (padding, quantization, the call);
                          not named .mlir, so a glob over *.mlir finds only kernels
and DIR/manifest.json listing {variant, m_bucket, n, k, block, act, bm, dtype, file, mlir,
stablehlo}, paths relative to DIR.
"""

from __future__ import annotations

import argparse
import base64
import functools
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from . import kernels
from .tiles import cdiv

_BODY = re.compile(r'\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22')


def mosaic_texts(stablehlo_text: str) -> list[str]:
    """The Mosaic modules embedded in the tpu_custom_calls of a StableHLO text, as MLIR text."""
    # jax private modules: the same ones jax uses to serialize these bodies.
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib import tpu
    from jax._src.lib.mlir import ir, passmanager

    out = []
    ctx = jax_mlir.make_ir_context()
    tpu.register_dialect(ctx)
    with ctx, ir.Location.unknown():
        ctx.allow_unregistered_dialects = True
        for body in _BODY.findall(stablehlo_text):
            module = ir.Module.parse(base64.b64decode(body))
            # The body is versioned ("mosaic-serde" serialized); undo that to print current ops.
            passmanager.PassManager.parse(
                "builtin.module(mosaic-serde{serialize=false})").run(module.operation)
            out.append(str(module))
    return out


def export_one(variant: str, m: int, n: int, k: int, block: int, act: str, bm: int | None,
               dtype=jnp.bfloat16):
    """jax.export.Exported of fp8_linear for the tpu platform at one static shape."""
    f = functools.partial(kernels.fp8_linear, block=block, act=act, bm=bm, variant=variant,
                          interpret=False)
    args = (jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((n, k), jnp.uint8),
            jax.ShapeDtypeStruct((cdiv(n, block), cdiv(k, block)), jnp.float32))
    return jax.export.export(jax.jit(f), platforms=["tpu"])(*args)


def stem(variant, m, n, k, block, act, bm, dtype_name) -> str:
    a = act if act == "group" else f"block2d{bm}"
    return f"fp8_linear_{variant}_m{m}_n{n}_k{k}_b{block}_{a}_{dtype_name}"


def write_entry(out: Path, variant, m, n, k, block, act, bm, dtype_name) -> dict:
    dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32}[dtype_name]
    exp = export_one(variant, m, n, k, block, act, bm, dtype)
    s = stem(variant, m, n, k, block, act, bm, dtype_name)
    shlo = exp.mlir_module()
    mosaic = mosaic_texts(shlo)
    if len(mosaic) != 1:
        raise RuntimeError(f"{s}: expected one Mosaic kernel in the export, found {len(mosaic)}")
    (out / f"{s}.bin").write_bytes(exp.serialize())
    (out / f"{s}.mlir").write_text(mosaic[0])
    (out / f"{s}.stablehlo").write_text(shlo)
    return {"variant": variant, "m_bucket": m, "n": n, "k": k, "block": block, "act": act,
            "bm": bm, "dtype": dtype_name, "file": f"{s}.bin", "mlir": f"{s}.mlir",
            "stablehlo": f"{s}.stablehlo"}


def _ints(s: str, what: str) -> list[int]:
    try:
        v = [int(p) for p in s.split(",") if p.strip()]
    except ValueError:
        raise SystemExit(f"--{what}: expected comma-separated integers, got {s!r}")
    if not v or min(v) <= 0:
        raise SystemExit(f"--{what}: expected positive integers, got {s!r}")
    return v


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m fp8nsa_tpu.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--shapes", required=True, help="N,K[;N,K...] (weight [N, K])")
    p.add_argument("--buckets", default="1,16,128", help="M values, one program each")
    p.add_argument("--block", type=int, default=128, help="bn = bk")
    p.add_argument("--act", default="group", choices=kernels.ACTS)
    p.add_argument("--bm", type=int, default=None, help="rows per block for --act block2d")
    p.add_argument("--variants", default="v1,v2,v3")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "f32"), help="activations")
    a = p.parse_args(argv)

    shapes = []
    for part in a.shapes.split(";"):
        if part.strip():
            nk = _ints(part, "shapes")
            if len(nk) != 2:
                raise SystemExit(f"--shapes: each entry is N,K, got {part!r}")
            shapes.append(tuple(nk))
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in kernels.VARIANTS]
    if bad or not variants or not shapes:
        raise SystemExit(f"--variants must list {kernels.VARIANTS} entries and --shapes at "
                         f"least one N,K (got variants={variants}, shapes={shapes})")
    if a.act == "block2d" and not a.bm:
        a.bm = 128
    bm = a.bm if a.act == "block2d" else None

    a.out.mkdir(parents=True, exist_ok=True)
    entries = []
    for variant in variants:
        for n, k in shapes:
            for m in _ints(a.buckets, "buckets"):
                e = write_entry(a.out, variant, m, n, k, a.block, a.act, bm, a.dtype)
                entries.append(e)
                print(f"{variant} m={m} n={n} k={k}: {a.out / e['file']}, {a.out / e['mlir']}")
    manifest = {"jax": jax.__version__, "platforms": ["tpu"], "entries": entries}
    (a.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"{len(entries)} program(s); manifest: {a.out / 'manifest.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
