"""The block-sparse kernel's launch configuration (:class:`Tiles`, with the defaults a call without
``tiles`` uses) and its flag table: what the kernel (:mod:`elasticfw.kernels.block_sparse_attention`)
and its work-list planner (:mod:`elasticfw.kernels.work_lists`) share. Plain torch, no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elasticfw.attention.layout import RowSelection

__all__ = ["DEFAULT_TILES", "SMALL_TILES", "Tiles", "default_tiles", "flag_table"]


@dataclass(frozen=True)
class Tiles:
    """The kernel's launch configuration: ``block_m`` query rows per program, key chunks of up to
    ``block_n`` keys (lowered to the largest power of two dividing the group size), warps, stages."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"Tiles.{name} must be a power of two >= 16, got {value}")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"Tiles: num_warps and num_stages must be positive, got {self.num_warps}, {self.num_stages}")


#: the defaults, the fastest measured on an H200 (bf16, head dim 128, 128-token blocks at 128K, full
#: density; without TMA: 128 x 128 x 8 warps x 3 stages 334 ms, 128 x 64 391 ms, 64 x 64 390 ms, 128 x 64
#: x 4 warps 489 ms, results/bench/block-sparse-tile-sweep/density.json; with TMA: 301 ms, 128 x 64 361 ms, 128 x 64 x 4
#: warps x 4 stages 380 ms, results/bench/block-sparse-kernel-options/kernel_options.json). Groups of 64 keys
#: (64-token block layouts) take :data:`SMALL_TILES` instead (:func:`default_tiles`).
DEFAULT_TILES = Tiles()
#: the configuration for 64-key chunks (key groups of 64: the paper's 64-token block layouts): 64-row
#: tiles, so that a tile covers one layout row and visits only what that row selects, not the union of
#: two rows. On an H200 at 128K (structured inputs, results/bench/block-sparse-64-row-tiles/tiles64.json) the
#: XAttention, NSA and streaming layouts of 64-token blocks took 69.3 / 42.1 / 12.5 ms with 64 x 64 x
#: 4 warps x 2 stages against 85.4 / 52.1 / 14.5 with the defaults (128-row tiles over 64-key chunks;
#: 3 stages 70.4 / 42.4 / 12.6, 8 warps 138.1 / 90.7 / 26.7).
SMALL_TILES = Tiles(block_m=64, block_n=64, num_warps=4, num_stages=2)


def default_tiles(selection: RowSelection) -> Tiles:
    """The launch configuration a call without ``tiles`` uses for ``selection``: :data:`SMALL_TILES`
    where its key groups are read in 64-key chunks (groups of 64, 192, ...: a multiple of 64 but not
    of 128), :data:`DEFAULT_TILES` otherwise."""
    if _chunk_size(selection.group_size, DEFAULT_TILES.block_n) == SMALL_TILES.block_n:
        return SMALL_TILES
    return DEFAULT_TILES


def _chunk_size(group_size: int, block_n: int) -> int | None:
    """The key chunk: the largest power of two <= ``block_n`` dividing ``group_size`` (>= 16), or None."""
    n = block_n
    while n >= 16:
        if group_size % n == 0:
            return n
        n //= 2
    return None


def flag_table(selected: torch.Tensor, batch: int) -> torch.Tensor:
    """A selection's flags as the kernels read them: bytes (a bool table viewed in place), and one
    table for every sample expanded over the batch (stride 0, no copy)."""
    flags = selected.view(torch.uint8) if selected.dtype == torch.bool else selected
    return flags.expand(batch, *flags.shape[1:]) if flags.shape[0] != batch else flags
