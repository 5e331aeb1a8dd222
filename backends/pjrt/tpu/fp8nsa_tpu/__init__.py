"""TPU fp8 block-linear kernels (JAX Pallas): v1 BlockSpec pipeline, v2 manual double-buffered
DMA, v3 v2 + block scales in SMEM. See ../README.md."""

from .kernels import ACTS, VARIANTS, fp8_linear, fp8_linear_xla, quantize_activations
from .tiles import Tiles, choose_tiles

__all__ = ["ACTS", "VARIANTS", "Tiles", "choose_tiles", "fp8_linear", "fp8_linear_xla",
           "quantize_activations"]
