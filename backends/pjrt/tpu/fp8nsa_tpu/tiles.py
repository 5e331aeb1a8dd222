"""Tile sizes per shape: a small table with sane defaults.

tk is always the K-block width bk, so every K step sees exactly one scale column and the
per-K-block scaling of the contract is a per-step multiply. tn is a multiple of bn so an
output tile never splits a weight block. tm starts at 32 because the kernels hold fp8
activation tiles, and 8-bit arrays tile as (32, 128) on TPU (8 sublanes x 4 packed bytes).
"""

from __future__ import annotations

import dataclasses

# (largest M, tm): the first row with M <= bound wins; bigger M gets the last tm.
TM_TABLE = ((32, 32), (64, 64), (128, 128))
TM_MAX = 256
# An output tile stays at most this wide: acc (tm x tn f32) + double-buffered inputs stay far
# below the default scoped VMEM (16 MiB on v5e) even at tm=256, bk=512.
TN_MAX = 512
# With 128-wide blocks, 256-wide output tiles fill the 256-wide MXU of v6e/v7x; only worth it
# when N is large enough that the extra padding of the last tile is small.
TN_WIDEN_MIN_N = 2048


@dataclasses.dataclass(frozen=True)
class Tiles:
    tm: int
    tn: int
    tk: int

    @property
    def r(self) -> int:
        """Weight blocks per output tile (bn = bk = tk)."""
        return self.tn // self.tk


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def choose_tiles(m: int, n: int, k: int, block: int) -> Tiles:
    """Tiles for y[m, n] = x[m, k] . W[n, k]^T with square bn = bk = block weight blocks."""
    if block <= 0 or block % 128:
        raise ValueError(f"block must be a positive multiple of 128 (lane width), got {block}")
    if min(m, n, k) <= 0:
        raise ValueError(f"empty problem: m={m}, n={n}, k={k}")
    tm = next((t for bound, t in TM_TABLE if m <= bound), TM_MAX)
    tn = block
    if block < 256 and n >= TN_WIDEN_MIN_N:
        tn = 2 * block
    tn = min(tn, max(TN_MAX, block))
    return Tiles(tm=tm, tn=tn, tk=block)
