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


class MapBudget:
    """Linux caps the memory maps of a process (vm.max_map_count, 65530 by default), and each
    compiled XLA:CPU program holds about three per kernel: about 940 for SmolLM2's 30 unrolled
    layers, twice that for a speculative loop. Past the cap LLVM fails to allocate and the
    process dies, so warmup checks after each program that one more as large as the largest so
    far still fits, and otherwise raises with the numbers (a clear error instead of a crash)."""

    def __init__(self, maps_path: str = "/proc/self/maps",
                 limit_path: str = "/proc/sys/vm/max_map_count"):
        self.maps_path = maps_path
        try:
            with open(limit_path) as f:
                self.limit: Optional[int] = int(f.read())
        except (OSError, ValueError):
            self.limit = None  # not Linux: nothing to watch
        self.last = self.count()
        self.largest = 0

    def count(self) -> int:
        if self.limit is None:
            return 0
        with open(self.maps_path) as f:
            return sum(1 for _ in f)

    def check(self, programs_left: int) -> None:
        """After a compile; programs_left: how many the caller still plans to compile."""
        if self.limit is None:
            return
        now = self.count()
        self.largest = max(self.largest, now - self.last)
        self.last = now
        if programs_left and now + self.largest > self.limit:
            raise RuntimeError(
                f"warmup stopped before the process runs out of memory maps: {now} of the "
                f"{self.limit} allowed (vm.max_map_count) are in use and each compiled program "
                f"takes up to {self.largest}, with {programs_left} programs left to compile. "
                "Lower max_num_seqs or max_seq_len (fewer shapes), or raise vm.max_map_count "
                "(sysctl -w vm.max_map_count=262144)")
