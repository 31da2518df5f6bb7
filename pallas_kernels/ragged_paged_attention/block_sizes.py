"""Block sizes of the ragged paged-attention kernel, one small table per backend.

A program holds [block_q * group_rows, H] query rows (group_rows: the GQA group padded to a
power of two); a loop step reads [pages_per_block * page_size, H] keys. The table gives target
rows and keys, so one entry serves every GQA ratio and page size.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    kv_tokens_per_block: int       # target keys per loop step (pages_per_block = this // page_size)
    min_kv_tokens_per_block: int   # a floor that also applies to an explicit pages_per_block
    q_rows_per_block: int          # target query rows per program (block_q = this // group_rows)
    min_q_rows: int                # a floor on block_q * group_rows, also for an explicit block_q
    num_warps: int | None = None
    num_stages: int | None = None
    max_kv_block_bytes: int | None = None  # caps the target: keys per step * H * itemsize


# Triton's dots need every dimension >= 16 and power-of-two blocks; interpret mode on CPU needs
# neither, and small blocks keep its masked tails cheap. GPU entries measured on an H200
# (docs/gpu.md): 128 keys a step beat 64 and 256, a key block capped at 64 KiB so that the
# pipelined K and V blocks fit shared memory, and 16-token query blocks beat 8 and 32.
BLOCK_SIZES = {
    "gpu": BlockSizes(kv_tokens_per_block=128, min_kv_tokens_per_block=16, q_rows_per_block=64,
                      min_q_rows=16, num_warps=4, num_stages=2, max_kv_block_bytes=64 * 1024),
    "cpu": BlockSizes(kv_tokens_per_block=32, min_kv_tokens_per_block=1, q_rows_per_block=16,
                      min_q_rows=1),
}


def next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def block_sizes_for(backend: str) -> BlockSizes:
    return BLOCK_SIZES.get(backend, BLOCK_SIZES["cpu"])


def pages_per_block_for(backend: str, page_size: int, max_pages: int,
                        requested: int | None = None, key_bytes: int | None = None) -> int:
    """Pages per loop step: `requested`, or the table's target (capped by max_kv_block_bytes /
    key_bytes) as a power of two at most the table width; raised to the backend's floor."""
    sizes = block_sizes_for(backend)
    page_size = max(page_size, 1)
    if requested is None:
        tokens = sizes.kv_tokens_per_block
        if sizes.max_kv_block_bytes and key_bytes:
            tokens = min(tokens, max(1, sizes.max_kv_block_bytes // key_bytes))
        target = max(1, tokens // page_size)
        requested = min(1 << (target.bit_length() - 1), next_power_of_2(max_pages))
    return max(requested, next_power_of_2(-(-sizes.min_kv_tokens_per_block // page_size)))


def group_rows_for(group: int) -> int:
    """Rows one query token takes in a block: the GQA group padded to a power of two."""
    return next_power_of_2(group)


def block_q_for(backend: str, group_rows: int, tokens_per_row: int,
                requested: int | None = None) -> int:
    """Query tokens per program: `requested`, or the table's target rows / group_rows as a
    power of two at most the mean tokens per row; raised to the backend's floor of rows."""
    sizes = block_sizes_for(backend)
    if requested is None:
        target = max(1, sizes.q_rows_per_block // group_rows)
        requested = min(1 << (target.bit_length() - 1), next_power_of_2(tokens_per_row))
    return max(requested, next_power_of_2(-(-sizes.min_q_rows // group_rows)))
