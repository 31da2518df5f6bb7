"""Per-backend tile sizes for the flash-attention kernel: upper bounds, a short sequence gets a
smaller power-of-two block (never below MIN_BLOCK, Triton's smallest dot) to spare padding.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_q: int
    block_k: int
    num_warps: int = 4     # Triton only
    num_stages: int = 2    # Triton only


MIN_BLOCK = 16

# backend -> {head_dim: BlockSizes} ("default": any other); small tiles keep interpret mode cheap.
BLOCK_SIZES: dict[str, dict[int | str, BlockSizes]] = {
    "cpu": {"default": BlockSizes(32, 32)},
    "gpu": {
        "default": BlockSizes(64, 64, num_warps=4, num_stages=2),
        256: BlockSizes(64, 32, num_warps=8, num_stages=2),
    },
}


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def default_block_sizes(backend: str, head_dim: int, q_len: int, kv_len: int) -> BlockSizes:
    """Tile sizes on `backend` (unknown: the CPU's), shrunk to the sequence length's power of
    two where smaller."""
    table = BLOCK_SIZES.get(backend, BLOCK_SIZES["cpu"])
    bs = table.get(head_dim, table["default"])
    block_q = min(bs.block_q, max(MIN_BLOCK, _next_pow2(q_len)))
    block_k = min(bs.block_k, max(MIN_BLOCK, _next_pow2(kv_len)))
    return dataclasses.replace(bs, block_q=block_q, block_k=block_k)
