"""v1 / v2 / v3 in Pallas TPU interpret mode (CPU) against the float64 reference, the known
single-K-block-scale bug, the tpu export and its Mosaic dump, and (on a TPU only) native runs.

Inputs are fresh random numbers each run (seed in the pytest header and summary; replay with
FP8NSA_TEST_SEED), with heterogeneous block scales: every weight block and every activation
(row, K-group) gets a magnitude 10**U(-3, 3).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8nsa_tpu import export, kernels
from fp8nsa_tpu import reference as ref
from fp8nsa_tpu.tiles import Tiles, choose_tiles

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
TOL = {"f32": 1e-3, "bf16": 8e-3}  # docs/numerics.md "Tolerances": relative Frobenius error vs the f64 reference
DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
ON_TPU = jax.devices()[0].platform == "tpu"


def rng_for(seed: int, *key) -> np.random.Generator:
    """A generator per test case: same seed + same case -> same inputs, whatever runs first."""
    return np.random.default_rng([seed, zlib.crc32(repr(key).encode())])


def make_inputs(rng, m, n, k, block, dtype="f32"):
    """x [M, K], e4m3 weight bytes [N, K], Sw [Nb, Kb], all with per-block magnitudes spread
    over 1e-3..1e3 so that the K-blocks' scales differ by up to six orders of magnitude."""
    nb, kb = -(-n // block), -(-k // block)
    wmag = np.repeat(np.repeat(magnitudes(rng, (nb, kb)), block, 0), block, 1)
    wq, sw = ref.quantize_weight(rng.standard_normal((n, k)) * wmag[:n, :k], block)
    xmag = np.repeat(magnitudes(rng, (m, kb)), block, 1)[:, :k]
    x = (rng.standard_normal((m, k)) * xmag).astype(DTYPES[dtype])
    assert sw.max() / sw.min() > 1e4, "scales must be heterogeneous"
    return x, wq, sw


def magnitudes(rng, shape):
    """10**U(-3, 3) per entry, with both ends present (when there are two entries or more)."""
    e = rng.uniform(-3, 3, shape).ravel()
    if e.size >= 2:
        lo, hi = rng.choice(e.size, 2, replace=False)
        e[lo], e[hi] = -3.0, 3.0
    return (10.0 ** e).reshape(shape)


def run(x, wq, sw, **kw):
    y = kernels.fp8_linear(jnp.asarray(x), jnp.asarray(wq), jnp.asarray(sw), interpret=True,
                           **kw)
    assert y.shape == (x.shape[0], wq.shape[0]) and y.dtype == jnp.asarray(x).dtype
    return np.asarray(y.astype(jnp.float32))


def check(y, want, dtype, what):
    err = ref.rel_fro(y, want)
    assert np.isfinite(y).all(), f"{what}: non-finite output"
    assert err < TOL[dtype], f"{what}: rel Frobenius error {err:.3e} >= {TOL[dtype]}"
    return err


# (M, N, K, block, act, bm, dtype, tiles): every variant runs every case. Covers M 1/7/64,
# N and K off the tile grid (576 x 3884 at 128), 256 and 512 blocks, Group and Block2d
# (bm below, at and above M; partial row blocks), bf16 and f32, r=2 weight blocks per output
# tile (N >= 2048), and a forced tiling with several m and n tiles.
CASES = [
    (1, 576, 3884, 128, "group", None, "bf16", None),
    (7, 576, 3884, 128, "group", None, "bf16", None),
    (64, 576, 3884, 128, "group", None, "bf16", None),
    (1, 576, 3884, 128, "block2d", 128, "f32", None),
    (7, 576, 3884, 128, "block2d", 4, "f32", None),
    (64, 576, 3884, 128, "block2d", 32, "f32", None),
    (7, 2100, 260, 128, "group", None, "f32", None),
    (64, 2100, 260, 128, "block2d", 16, "bf16", None),
    (64, 576, 700, 128, "group", None, "f32", Tiles(tm=32, tn=256, tk=128)),
    (7, 600, 1000, 256, "group", None, "bf16", None),
    (64, 600, 1000, 256, "block2d", 16, "f32", None),
    (1, 700, 1200, 512, "group", None, "f32", None),
    (7, 700, 1200, 512, "block2d", 8, "bf16", None),
]


def _case_id(c):
    m, n, k, block, act, bm, dtype, tiles = c
    a = act if bm is None else f"{act}{bm}"
    t = "" if tiles is None else f"-t{tiles.tm}x{tiles.tn}"
    return f"m{m}-n{n}-k{k}-b{block}-{a}-{dtype}{t}"


@pytest.mark.parametrize("variant", kernels.VARIANTS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_interpret_matches_reference(seed, variant, case):
    m, n, k, block, act, bm, dtype, tiles = case
    x, wq, sw = make_inputs(rng_for(seed, case), m, n, k, block, dtype)
    want = ref.fp8_linear_ref(x, wq, sw, block=block, act=act, bm=bm)
    y = run(x, wq, sw, block=block, act=act, bm=bm, variant=variant, tiles=tiles)
    check(y, want, dtype, f"{variant} {_case_id(case)} seed={seed}")


@pytest.mark.parametrize("act,bm", [("group", None), ("block2d", 4)])
def test_xla_baseline_matches_reference(seed, act, bm):
    """bench.py's plain-jnp baseline computes the same contract."""
    case = (7, 576, 3884, 128)
    x, wq, sw = make_inputs(rng_for(seed, "xla", act, case), *case, "bf16")
    y = kernels.fp8_linear_xla(jnp.asarray(x), jnp.asarray(wq), jnp.asarray(sw), block=128,
                               act=act, bm=bm)
    want = ref.fp8_linear_ref(x, wq, sw, block=128, act=act, bm=bm)
    check(np.asarray(y.astype(jnp.float32)), want, "bf16", f"xla {act}")


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("act,bm", [("group", None), ("block2d", 3)])
def test_activation_quantization_is_bitwise_the_reference(seed, dtype, act, bm):
    """The wrapper's quantizer and the reference agree bit for bit (f32 quotient, RNE, sat)."""
    x, _, _ = make_inputs(rng_for(seed, "q", dtype, act), 11, 128, 700, 128, dtype)
    x = np.pad(x, ((0, 0), (0, 768 - 700)))  # the kernels see K padded to whole groups
    x[0, :5] = np.array([0.0, -0.0, 1e-30, 448.0, -1e30], DTYPES[dtype])  # zeros, saturation
    x[1, 128:256] = 0  # an all-zero group: scale 1e-12/448, exact zeros
    xq, sx = kernels.quantize_activations(jnp.asarray(x), 128, act, bm)
    xq_ref, sx_ref = ref.quantize_act(x, 128, act, bm)
    np.testing.assert_array_equal(np.asarray(sx), sx_ref)
    np.testing.assert_array_equal(np.asarray(xq).view(np.uint8), xq_ref.view(np.uint8))


@pytest.mark.parametrize("variant", kernels.VARIANTS)
def test_single_k_block_scale_bug_is_caught(seed, variant):
    """The known-bad kernel (last K-block's scales applied to the whole sum) fails the same
    check the real kernels pass, on the same heterogeneous inputs."""
    case = (7, 576, 3884, 128)
    x, wq, sw = make_inputs(rng_for(seed, "bug", case), *case, "f32")
    want = ref.fp8_linear_ref(x, wq, sw, block=128, act="group")
    kw = dict(block=128, act="group", variant=variant)
    check(run(x, wq, sw, **kw), want, "f32", f"{variant} seed={seed}")
    bad = run(x, wq, sw, _bug_last_kblock_scale=True, **kw)
    with pytest.raises(AssertionError):
        check(bad, want, "f32", f"broken {variant}")
    assert ref.rel_fro(bad, want) > 0.1, "the bug must be far outside the tolerance"


def test_uniform_scales_hide_the_bug(seed):
    """Why the scales must be heterogeneous: with one scale everywhere the bug is invisible."""
    rng = rng_for(seed, "uniform")
    m, n, k, block = 7, 256, 640, 128
    wq = (rng.standard_normal((n, k)) * 100).clip(-448, 448).astype(ref.E4M3).view(np.uint8)
    sw = np.full((2, 5), 0.01, np.float32)
    x = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    x[:, ::block] = 2.0  # the same amax in every (row, group): one activation scale
    want = ref.fp8_linear_ref(x, wq, sw, block=block, act="group")
    bad = run(x, wq, sw, block=block, act="group", variant="v1", _bug_last_kblock_scale=True)
    check(bad, want, "f32", "uniform scales")


@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_manual_dma_has_no_races(seed, variant):
    """Interpret mode's happy-before race detector over the double-buffered DMA loop."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc  # private

    from jax.experimental.pallas import tpu as pltpu
    x, wq, sw = make_inputs(rng_for(seed, "race", variant), 7, 300, 700, 128, "f32")
    y = kernels.fp8_linear(jnp.asarray(x), jnp.asarray(wq), jnp.asarray(sw), block=128,
                           act="group", variant=variant,
                           interpret=pltpu.InterpretParams(detect_races=True))
    jax.block_until_ready(y)
    assert ipc.races is not None and not ipc.races.races_found
    check(np.asarray(y), ref.fp8_linear_ref(x, wq, sw, block=128, act="group"), "f32", variant)


def test_bad_arguments_are_errors():
    x = jnp.zeros((3, 300), jnp.bfloat16)
    w = jnp.zeros((200, 300), jnp.uint8)
    with pytest.raises(ValueError, match="sw must be"):
        kernels.fp8_linear(x, w, jnp.ones((1, 3)), block=128)
    with pytest.raises(ValueError, match="variant"):
        kernels.fp8_linear(x, w, jnp.ones((2, 3)), block=128, variant="v4")
    with pytest.raises(TypeError, match="uint8"):
        kernels.fp8_linear(x, w.astype(jnp.int8), jnp.ones((2, 3)), block=128)
    with pytest.raises(ValueError, match="bm"):
        kernels.fp8_linear(x, w, jnp.ones((2, 3)), block=128, act="block2d")
    with pytest.raises(ValueError, match="multiple of 128"):
        choose_tiles(1, 1, 1, 64)


def test_tile_table():
    assert [choose_tiles(m, 576, 3884, 128).tm for m in (1, 32, 33, 100, 129, 4096)] == \
        [32, 32, 64, 128, 256, 256]
    assert choose_tiles(1, 576, 3884, 128).tn == 128
    assert choose_tiles(1, 4096, 4096, 128) == Tiles(tm=32, tn=256, tk=128)
    assert choose_tiles(1, 4096, 4096, 512) == Tiles(tm=32, tn=512, tk=512)


# ------------------------------------------------------------------------------------------
# Export for the tpu platform (no TPU needed) and the Mosaic text it carries
# ------------------------------------------------------------------------------------------

EXPORT_SHAPE = dict(m=16, n=576, k=3884, block=128, act="group", bm=None)
# Exported too, not inspected: two weight blocks per output tile (r=2), Block2d, f32, 512 blocks.
EXPORT_MORE = [(8, 2100, 260, 128, "block2d", 16, "f32"), (300, 1100, 1300, 512, "group", None,
                                                           "bf16")]
_MANIFEST = []


def _signature(text: str) -> str:
    """The kernel function's signature line (func.func @fp8_linear_vN(...))."""
    return next(l for l in text.splitlines() if "func.func @fp8_linear_" in l)


@pytest.mark.parametrize("variant", kernels.VARIANTS)
def test_export_for_tpu_and_mosaic_evidence(variant):
    s = EXPORT_SHAPE
    ARTIFACTS.mkdir(exist_ok=True)
    entry = export.write_entry(ARTIFACTS, variant, s["m"], s["n"], s["k"], s["block"], s["act"],
                               s["bm"], "bf16")
    _MANIFEST.append(entry)
    mlir_path, bin_path = ARTIFACTS / entry["mlir"], ARTIFACTS / entry["file"]
    print(f"\n{variant}: {mlir_path}\n{variant}: {bin_path}")

    exp = jax.export.deserialize(bytearray(bin_path.read_bytes()))
    assert exp.platforms == ("tpu",)
    assert [a.shape for a in exp.in_avals] == [(16, 3884), (576, 3884), (5, 31)]
    assert "tpu_custom_call" in exp.mlir_module()

    text = mlir_path.read_text()
    sig = _signature(text)
    assert "f8E4M3FN" in sig, "fp8 operands"
    assert re.search(r"arith\.extf .*f8E4M3FN.* to vector<[0-9x]+xbf16>", text)
    assert "tpu.matmul" in text
    dma_starts = len(re.findall(r"tpu\.enqueue_dma", text))
    dma_waits = len(re.findall(r"tpu\.wait_dma", text))
    smem_f32 = re.findall(r"memref<([0-9x]+)xf32, #tpu\.memory_space<smem>>", sig)
    for m, n, k, block, act, bm, dtype in EXPORT_MORE:
        _MANIFEST.append(export.write_entry(ARTIFACTS, variant, m, n, k, block, act, bm, dtype))
    (ARTIFACTS / "manifest.json").write_text(json.dumps({"entries": _MANIFEST}, indent=2))

    if variant == "v1":
        assert dma_starts == dma_waits == 0, "v1 leaves the copies to the pipeline"
        assert smem_f32, "v1 takes the flat weight scales as scalar prefetch (SMEM)"
        return
    # One prologue start and one in-loop start per stream; one in-loop wait per stream.
    streams = 3 if variant == "v3" else 2
    assert (dma_starts, dma_waits) == (2 * streams, streams)
    assert re.search(r"memref<\d+x\d+xf8E4M3FN, #tpu\.memory_space<any>>", sig), \
        "fp8 operands left in HBM (any)"
    assert len(re.findall(r"memref<2x\d+x\d+xf8E4M3FN, #tpu\.memory_space<vmem>>", sig)) == 2, \
        "double-buffered VMEM for activations and weights"
    assert re.search(r"memref<2x!tpu\.dma_semaphore|memref<\dx2x!tpu\.dma_semaphore", sig)
    if variant == "v3":
        assert any(s.startswith("2x") for s in smem_f32), "double-buffered f32 SMEM scales"
        assert re.search(r"tpu\.enqueue_dma source\(%\w+ : memref<[0-9x]+xf32, "
                         r"#tpu\.memory_space<any>>\) target\(%\w+ : memref<[0-9x]+xf32, "
                         r"#tpu\.memory_space<smem>>", text), "scales DMA'd HBM -> SMEM"
    else:
        assert not smem_f32


@pytest.mark.skipif(not os.environ.get("FP8NSA_BIN"),
                    reason="set FP8NSA_BIN=path/to/fp8nsa to run `fp8nsa inspect` on the dumps")
@pytest.mark.parametrize("variant", kernels.VARIANTS)
def test_rust_inspect_accepts_the_dumps(variant):
    entries = [e for e in _MANIFEST if e["variant"] == variant]
    if not entries:
        pytest.skip("the export test for this variant did not run")
    path = ARTIFACTS / entries[0]["mlir"]
    r = subprocess.run([os.environ["FP8NSA_BIN"], "inspect", str(path), "--expect", variant],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------------------------------
# Real TPU only
# ------------------------------------------------------------------------------------------


@pytest.mark.tpu
@pytest.mark.skipif(not ON_TPU, reason=f"no TPU: jax.devices()[0].platform is "
                                       f"{jax.devices()[0].platform!r}")
@pytest.mark.parametrize("variant", kernels.VARIANTS)
def test_native_tpu_matches_reference(seed, variant):
    for case in CASES + [(512, 4096, 4096, 128, "group", None, "bf16", None)]:
        m, n, k, block, act, bm, dtype, tiles = case
        x, wq, sw = make_inputs(rng_for(seed, "tpu", case), m, n, k, block, dtype)
        y = kernels.fp8_linear(jnp.asarray(x), jnp.asarray(wq), jnp.asarray(sw), block=block,
                               act=act, bm=bm, variant=variant, tiles=tiles, interpret=False)
        want = ref.fp8_linear_ref(x, wq, sw, block=block, act=act, bm=bm)
        check(np.asarray(y.astype(jnp.float32)), want, dtype, f"{variant} {_case_id(case)}")
