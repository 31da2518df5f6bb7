"""Block sizes of the paged-attention kernel, one small table per backend: target keys per loop
step ([pages_per_block * page_size, H]), so one entry serves every page size.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    kv_tokens_per_block: int   # target keys per loop step (pages_per_block = this // page_size)
    min_kv_tokens_per_block: int   # a floor that also applies to an explicit pages_per_block
    min_q_rows: int            # the [G, H] query block is padded to at least this many rows
    num_warps: int | None = None
    num_stages: int | None = None


# Triton's dots need every dimension >= 16 and power-of-two blocks; interpret mode on CPU needs
# neither, and small steps keep its masked tail cheap.
BLOCK_SIZES = {
    "gpu": BlockSizes(kv_tokens_per_block=128, min_kv_tokens_per_block=16, min_q_rows=16,
                      num_warps=4, num_stages=2),
    "cpu": BlockSizes(kv_tokens_per_block=32, min_kv_tokens_per_block=1, min_q_rows=1),
}


def next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def block_sizes_for(backend: str) -> BlockSizes:
    return BLOCK_SIZES.get(backend, BLOCK_SIZES["cpu"])


def pages_per_block_for(backend: str, page_size: int, max_pages: int,
                        requested: int | None = None) -> int:
    """Pages per loop step: `requested`, or the table's target as a power of two at most the
    table width; raised to the backend's floor of keys per step."""
    sizes = block_sizes_for(backend)
    page_size = max(page_size, 1)
    if requested is None:
        target = max(1, sizes.kv_tokens_per_block // page_size)
        requested = min(1 << (target.bit_length() - 1), next_power_of_2(max_pages))
    return max(requested, next_power_of_2(-(-sizes.min_kv_tokens_per_block // page_size)))


def q_rows_for(backend: str, group: int, requested: int | None = None) -> int:
    """Rows of the query block for a GQA group of `group` heads (padded rows are discarded)."""
    rows = next_power_of_2(group) if requested is None else requested
    return max(rows, block_sizes_for(backend).min_q_rows)
