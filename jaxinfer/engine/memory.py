"""Sizing the paged KV cache from device memory (num_pages=None).

On a device that reports its memory (GPU), the pool gets what is left of `utilization` of the
device's memory after the weights (already resident) and the scratch memory of the largest
compiled step (XLA's memory analysis of the compiled programs). Where the backend reports no
memory (CPU), the caller falls back to room for every slot at max_seq_len.
"""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from jaxinfer.config import ModelConfig

UTILIZATION = 0.9  # fraction of device memory the engine may use, as vLLM's default


def kv_page_bytes(cfg: ModelConfig, page_size: int, dtype) -> int:
    """Bytes of one page: keys and values of page_size tokens in every layer (int8 / float8
    codes with a float32 scale per token and kv head: see kv_cache.QuantizedKV)."""
    per_token = cfg.kv_dim * np.dtype(dtype).itemsize
    if np.dtype(dtype).itemsize == 1:
        per_token += cfg.num_kv_heads * 4
    return 2 * cfg.num_layers * page_size * per_token


def free_device_memory(device: Optional[jax.Device] = None) -> Optional[tuple[int, int]]:
    """(bytes_limit, bytes_in_use) of the device, or None where the backend reports neither."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def pages_for_memory(limit: int, in_use: int, step_bytes: int, page_bytes: int,
                     utilization: float = UTILIZATION) -> int:
    """Pages that fit in utilization * limit after in_use bytes (weights) and step_bytes
    (the largest step's scratch memory); 0 when nothing is left."""
    left = int(limit * utilization) - in_use - step_bytes
    return max(left // page_bytes, 0)

