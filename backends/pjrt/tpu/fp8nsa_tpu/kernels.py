"""TPU fp8 block-linear kernels (JAX Pallas), variants v1, v2, v3.

All three compute the contract of docs/numerics.md ("Output"):
    y[m, n] = sum_kb sx[m, kb] * Sw[n/bn, kb] * sum_{k in kb} xq[m, k] * W[n, k]
with f32 accumulation and both scales applied to each K-block's partial sum before it is added.

Split of work:
- The wrapper (plain jnp, inside the same jit) pads M/N/K with zeros (zeros change neither amax
  nor sums), bitcasts the uint8 weight bytes to float8_e4m3fn, and quantizes the activations
  (Group or Block2d, f32 division, saturate, round-to-nearest-even). Block2d needs an amax across
  rows of different M tiles, which is awkward inside a kernel; doing both modes here keeps the
  kernels identical for them (they only see one activation scale per row and K-block).
- The kernels take fp8 tiles, upcast them to bf16 in VMEM (exact: e4m3 has 3 mantissa bits) and
  run a bf16 x bf16 -> f32 MXU matmul per K-block, so the products and the f32 accumulation are
  exact up to f32 rounding on every TPU generation, with or without an fp8 MXU.

Variants:
- v1: BlockSpec tiling, grid (m, n, k), the pipeline double-buffers HBM->VMEM copies; weight
  scales as scalar prefetch (SMEM, flat), activation scales as a VMEM block.
- v2: fp8 activations and weights stay in HBM (memory_space=ANY); the kernel loops over K with
  explicit async DMAs into [2, ...] VMEM scratch, starting step k+1 before waiting for step k.
  Weight scales come as a per-column VMEM block (expanded from Sw in the wrapper).
- v3: v2, with the compact weight block scales DMA'd per K step into a [2, 1, r] SMEM double
  buffer next to the data copies (no per-column expansion, scalar reads).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .tiles import Tiles, cdiv, choose_tiles, round_up

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-12
VARIANTS = ("v1", "v2", "v3")
ACTS = ("group", "block2d")
_NT = (((1,), (1,)), ((), ()))  # x[tm, tk] . w[tn, tk]^T


# ------------------------------------------------------------------------------------------
# Wrapper-side preparation (plain jnp)
# ------------------------------------------------------------------------------------------


def quantize_activations(x, bk: int, act: str, bm: int | None = None):
    """x [M, K] (K a multiple of bk) -> (xq e4m3fn [M, K], sx f32 [M, K/bk], one per row).

    Block2d scales are computed per bm x bk block and repeated over the block's rows.
    """
    m, k = x.shape
    kb = k // bk
    x32 = x.astype(jnp.float32).reshape(m, kb, bk)
    amax = jnp.max(jnp.abs(x32), axis=-1)  # [M, Kb]
    if act == "block2d":
        mb = cdiv(m, bm)
        a = jnp.pad(amax, ((0, mb * bm - m), (0, 0)))  # zero rows change no amax
        a = jnp.max(a.reshape(mb, bm, kb), axis=1)
        amax = jnp.repeat(a, bm, axis=0)[:m]
    # XLA's algebraic simplifier rewrites A / broadcast(B) as A * broadcast(1 / B), which is
    # not the IEEE f32 quotient (1 ulp off in about half the cases, so some x/s land on the
    # other side of an fp8 rounding midpoint). Materializing the divisor behind an
    # optimization barrier keeps a true elementwise division.
    floor = jnp.maximum(amax, jnp.float32(AMAX_FLOOR))
    sx = floor / _opaque(jnp.full(floor.shape, E4M3_MAX, jnp.float32))
    den = _opaque(jnp.broadcast_to(sx[..., None], x32.shape))
    q = jnp.clip(x32 / den, -E4M3_MAX, E4M3_MAX)
    return q.astype(E4M3).reshape(m, k), sx


def _opaque(a):
    """a, hidden from XLA's simplifier (see quantize_activations)."""
    return jax.lax.optimization_barrier(a)


def _check_args(x, wq_u8, sw, block, act, bm, variant):
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if act not in ACTS:
        raise ValueError(f"act must be one of {ACTS}, got {act!r}")
    if act == "block2d" and (bm is None or bm <= 0):
        raise ValueError(f"act='block2d' needs bm > 0, got bm={bm!r}")
    if x.ndim != 2 or wq_u8.ndim != 2:
        raise ValueError(f"x must be [M, K] and wq_u8 [N, K], got {x.shape} and {wq_u8.shape}")
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise TypeError(f"x must be bfloat16 or float32, got {x.dtype}")
    if wq_u8.dtype != jnp.uint8:
        raise TypeError(f"wq_u8 must be uint8 (e4m3fn bytes), got {wq_u8.dtype}")
    (m, k), (n, kw) = x.shape, wq_u8.shape
    if k != kw:
        raise ValueError(f"K mismatch: x has K={k}, wq_u8 has K={kw}")
    want = (cdiv(n, block), cdiv(k, block))
    if tuple(sw.shape) != want:
        raise ValueError(f"sw must be {list(want)} for N={n}, K={k}, block={block}, got "
                         f"{list(sw.shape)}")


def _pad2(a, rows: int, cols: int):
    pr, pc = rows - a.shape[0], cols - a.shape[1]
    return a if pr == pc == 0 else jnp.pad(a, ((0, pr), (0, pc)))


# ------------------------------------------------------------------------------------------
# In-kernel helpers
# ------------------------------------------------------------------------------------------


def _block_dot(xq, w):
    """fp8 [tm, tk] . fp8 [tn, tk]^T -> f32 [tm, tn], via an exact upcast to bf16."""
    return jax.lax.dot_general(xq.astype(jnp.bfloat16), w.astype(jnp.bfloat16), _NT,
                               preferred_element_type=jnp.float32)


def _col(block, k):
    """Column k of a [tm, C] value as [tm, 1]. A one-hot lane reduction instead of a dynamic
    lane slice, which Mosaic does not lower for arbitrary offsets; cost tm*C << tm*tn*tk."""
    lane = jax.lax.broadcasted_iota(jnp.int32, block.shape, 1)
    return jnp.sum(jnp.where(lane == k, block, 0.0), axis=1, keepdims=True)


def _row(block, k):
    """Row k of a [R, tn] value as [1, tn] (one-hot sublane reduction, as _col)."""
    sub = jax.lax.broadcasted_iota(jnp.int32, block.shape, 0)
    return jnp.sum(jnp.where(sub == k, block, 0.0), axis=0, keepdims=True)


def _scalars_to_row(scalars, tn: int, bn: int):
    """[1, tn] row whose bn-wide column block q holds scalars[q] (one weight scale per block)."""
    if len(scalars) == 1:
        return jnp.full((1, tn), scalars[0], jnp.float32)
    # Compares, not `iota // bn`: integer floor division lowers through `sign`, whose Mosaic
    # rule asks for the TPU generation and so cannot be exported on a machine without one.
    col = jax.lax.broadcasted_iota(jnp.int32, (1, tn), 1)
    row = jnp.full((1, tn), scalars[0], jnp.float32)
    for q in range(1, len(scalars)):
        row = jnp.where(col >= q * bn, scalars[q], row)
    return row


# ------------------------------------------------------------------------------------------
# v1: BlockSpec pipeline, grid (m, n, k)
# ------------------------------------------------------------------------------------------


def _v1_kernel(sw_ref, xq_ref, w_ref, sx_ref, o_ref, acc_ref, *, tn, bn, r, kb, bug):
    j, k = pl.program_id(1), pl.program_id(2)
    nk = pl.num_programs(2)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    part = _block_dot(xq_ref[...], w_ref[...])
    # Sw is flat [Nbp * Kb] in SMEM: row (j*r + q), column k.
    sw_row = _scalars_to_row([sw_ref[(j * r + q) * kb + k] for q in range(r)], tn, bn)
    sx_col = _col(sx_ref[...], k)
    if bug:  # the known-bad kernel: sum unscaled partials, scale once with the last K-block's
        acc_ref[...] += part
    else:
        acc_ref[...] += part * sx_col * sw_row

    @pl.when(k == nk - 1)
    def _():
        acc = acc_ref[...]
        if bug:
            acc = acc * sx_col * sw_row
        o_ref[...] = acc.astype(o_ref.dtype)


def _call_v1(xq, w8, sxp, swp, t: Tiles, kb: int, out_dtype, interpret, bug):
    mp, kp = xq.shape
    np_ = w8.shape[0]
    grid = (mp // t.tm, np_ // t.tn, kb)
    kernel = functools.partial(_v1_kernel, tn=t.tn, bn=t.tk, r=t.r, kb=kb, bug=bug)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,  # flat Sw -> SMEM (1-D: 2-D SMEM arrays pad to 8x128 words)
            grid=grid,
            in_specs=[
                pl.BlockSpec((t.tm, t.tk), lambda i, j, k, sw: (i, k)),
                pl.BlockSpec((t.tn, t.tk), lambda i, j, k, sw: (j, k)),
                # All K-block scales of the m tile; the pipeline refetches only when i changes.
                pl.BlockSpec((t.tm, sxp.shape[1]), lambda i, j, k, sw: (i, 0)),
            ],
            out_specs=pl.BlockSpec((t.tm, t.tn), lambda i, j, k, sw: (i, j)),
            scratch_shapes=[pltpu.VMEM((t.tm, t.tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="fp8_linear_v1",
    )(swp.reshape(-1), xq, w8, sxp)


# ------------------------------------------------------------------------------------------
# v2 / v3: operands in HBM, manual double-buffered DMA over K inside the kernel
# ------------------------------------------------------------------------------------------


def _manual_kernel(*refs, t: Tiles, nk: int, smem_scales: bool, bug: bool):
    if smem_scales:
        (xq_hbm, w_hbm, sx_ref, sw_hbm, o_ref, xbuf, wbuf, sbuf, acc_ref, sem) = refs
    else:
        (xq_hbm, w_hbm, sx_ref, swc_ref, o_ref, xbuf, wbuf, acc_ref, sem) = refs
    i, j = pl.program_id(0), pl.program_id(1)
    row0 = pl.multiple_of(i * t.tm, t.tm)
    col0 = pl.multiple_of(j * t.tn, t.tn)

    def copies(k, slot):
        k0 = pl.multiple_of(k * t.tk, t.tk)
        cps = [
            pltpu.make_async_copy(xq_hbm.at[pl.ds(row0, t.tm), pl.ds(k0, t.tk)],
                                  xbuf.at[slot], sem.at[0, slot]),
            pltpu.make_async_copy(w_hbm.at[pl.ds(col0, t.tn), pl.ds(k0, t.tk)],
                                  wbuf.at[slot], sem.at[1, slot]),
        ]
        if smem_scales:
            # sw_hbm [nj, Kb, 1, r]: a leading-index copy moves whole minor dims (tile-aligned).
            cps.append(pltpu.make_async_copy(sw_hbm.at[j, k], sbuf.at[slot], sem.at[2, slot]))
        return cps

    # Every copy started here or in the loop is waited for exactly once, in the loop, before
    # its buffer is read; a slot is refilled only after the step that read it has finished.
    for c in copies(0, 0):
        c.start()
    acc_ref[...] = jnp.zeros_like(acc_ref)

    def step(k, carry):
        slot = jax.lax.rem(k, 2)

        @pl.when(k + 1 < nk)
        def _():
            for c in copies(k + 1, 1 - slot):
                c.start()

        for c in copies(k, slot):
            c.wait()
        part = _block_dot(xbuf[slot], wbuf[slot])
        if smem_scales:
            sw_row = _scalars_to_row([sbuf[slot, 0, q] for q in range(t.r)], t.tn, t.tk)
        else:
            sw_row = _row(swc_ref[...], k)
        sx_col = _col(sx_ref[...], k)
        if bug:  # the known-bad kernel: carry the scales, apply the last ones after the loop
            acc_ref[...] += part
            return (sx_col, sw_row)
        acc_ref[...] += part * sx_col * sw_row
        return carry

    if bug:
        zero = (jnp.zeros((t.tm, 1), jnp.float32), jnp.zeros((1, t.tn), jnp.float32))
        last_sx, last_sw = jax.lax.fori_loop(0, nk, step, zero)
        o_ref[...] = (acc_ref[...] * last_sx * last_sw).astype(o_ref.dtype)
    else:
        jax.lax.fori_loop(0, nk, step, 0)
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _call_manual(xq, w8, sxp, sw_arg, t: Tiles, kb: int, out_dtype, interpret, bug,
                 smem_scales: bool):
    mp, _ = xq.shape
    np_ = w8.shape[0]
    grid = (mp // t.tm, np_ // t.tn)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    sx_spec = pl.BlockSpec((t.tm, sxp.shape[1]), lambda i, j: (i, 0))
    scratch = [pltpu.VMEM((2, t.tm, t.tk), E4M3), pltpu.VMEM((2, t.tn, t.tk), E4M3)]
    if smem_scales:
        sw_spec = any_spec
        scratch.append(pltpu.SMEM((2, 1, t.r), jnp.float32))
    else:
        sw_spec = pl.BlockSpec((sw_arg.shape[0], t.tn), lambda i, j: (0, j))
    n_streams = 3 if smem_scales else 2
    scratch += [pltpu.VMEM((t.tm, t.tn), jnp.float32),
                pltpu.SemaphoreType.DMA((n_streams, 2))]
    kernel = functools.partial(_manual_kernel, t=t, nk=kb, smem_scales=smem_scales, bug=bug)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=grid,
        in_specs=[any_spec, any_spec, sx_spec, sw_spec],
        out_specs=pl.BlockSpec((t.tm, t.tn), lambda i, j: (i, j)),
        scratch_shapes=scratch,
        # Each grid step starts and drains its own DMAs, so both axes may be split over cores.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="fp8_linear_v3" if smem_scales else "fp8_linear_v2",
    )(xq, w8, sxp, sw_arg)


# ------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------


def _interpret_arg(interpret):
    """True -> TPU interpret mode (simulates DMAs, semaphores, SMEM on the CPU)."""
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret or False


@functools.partial(jax.jit, static_argnames=("block", "act", "bm", "variant", "interpret",
                                             "tiles", "_bug_last_kblock_scale"))
def fp8_linear(x, wq_u8, sw, *, block: int, act: str = "group", bm: int | None = None,
               variant: str = "v1", interpret=False, tiles: Tiles | None = None,
               _bug_last_kblock_scale: bool = False):
    """y [M, N] (dtype of x) = fp8 block linear of x [M, K] with W bytes [N, K] and Sw [Nb, Kb].

    block: bn = bk (128, 256, 512). act: 'group' (1 x bk scales) or 'block2d' (bm x bk).
    interpret: False on a TPU; True or a pltpu.InterpretParams to run TPU interpret mode on CPU.
    tiles: override the tile table (tk must equal block, tn a multiple of it).
    _bug_last_kblock_scale: the known wrong kernel (tests prove they catch it).
    """
    _check_args(x, wq_u8, sw, block, act, bm, variant)
    (m, k), n = x.shape, wq_u8.shape[0]
    t = tiles or choose_tiles(m, n, k, block)
    if t.tk != block or t.tn % block or t.tm % 8:
        raise ValueError(f"tiles {t} do not fit block {block}")
    kb = cdiv(k, block)
    mp, np_, kp = round_up(m, t.tm), round_up(n, t.tn), kb * block
    nbp = np_ // block

    xq, sx = quantize_activations(_pad2(x, mp, kp), block, act, bm)
    w8 = jax.lax.bitcast_convert_type(_pad2(wq_u8, np_, kp), E4M3)
    swp = _pad2(sw.astype(jnp.float32), nbp, kb)  # zero scales for padded N blocks
    # Activation scales [Mp, Kb] padded to whole lanes so the VMEM block is (tm, 128*c).
    sxp = _pad2(sx, mp, round_up(kb, 128))
    interp = _interpret_arg(interpret)

    if variant == "v1":
        y = _call_v1(xq, w8, sxp, swp, t, kb, x.dtype, interp, _bug_last_kblock_scale)
    elif variant == "v2":
        # Per-column weight scales [Kb (padded to 8 sublanes), Np]: row k is one K step's.
        swc = _pad2(jnp.repeat(swp, block, axis=0).T, round_up(kb, 8), np_)
        y = _call_manual(xq, w8, sxp, swc, t, kb, x.dtype, interp, _bug_last_kblock_scale,
                         smem_scales=False)
    else:
        # [nj, Kb, 1, r]: the r scales of n tile j at K step k, one DMA each step.
        sw4 = swp.reshape(np_ // t.tn, t.r, kb).transpose(0, 2, 1)[:, :, None, :]
        y = _call_manual(xq, w8, sxp, sw4, t, kb, x.dtype, interp, _bug_last_kblock_scale,
                         smem_scales=True)
    return y[:m, :n]


def fp8_linear_xla(x, wq_u8, sw, *, block: int, act: str = "group", bm: int | None = None):
    """The plain-XLA (jnp) implementation of the same contract, for benchmarks."""
    (m, k), n = x.shape, wq_u8.shape[0]
    kb, nb = cdiv(k, block), cdiv(n, block)
    kp, np_ = kb * block, nb * block
    xq, sx = quantize_activations(_pad2(x, m, kp), block, act, bm)
    w8 = jax.lax.bitcast_convert_type(_pad2(wq_u8, np_, kp), E4M3)
    # One dot per K-block (batched over kb), then the scales, then the sum over K-blocks.
    part = jnp.einsum("mbk,nbk->bmn", xq.reshape(m, kb, block).astype(jnp.bfloat16),
                      w8.reshape(np_, kb, block).astype(jnp.bfloat16),
                      preferred_element_type=jnp.float32)
    swc = jnp.repeat(sw.astype(jnp.float32), block, axis=0)[:np_]  # [Np, Kb]
    y = jnp.einsum("bmn,mb,nb->mn", part, sx, swc)
    return y[:, :n].astype(x.dtype)
