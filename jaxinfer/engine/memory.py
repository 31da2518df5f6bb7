"""Sizing the paged KV cache from device memory (num_pages=None): what `utilization` of the
device's memory leaves after the weights and the largest compiled step's scratch. Where the
backend reports no memory (CPU) the caller gives every slot room for max_seq_len instead.
"""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from jaxinfer.config import MeshConfig, ModelConfig
from jaxinfer.device.kv_cache import ring_capacity

UTILIZATION = 0.9  # fraction of device memory the engine may use, as vLLM's default


def kv_page_bytes(cfg: ModelConfig, page_size: int, dtype,
                  num_layers: Optional[int] = None) -> int:
    """Bytes of one page: keys and values of page_size tokens in every layer, or in num_layers
    (a hybrid pool's global layers); 1-byte codes carry a float32 scale per token and kv head."""
    per_token = cfg.kv_dim * np.dtype(dtype).itemsize
    if np.dtype(dtype).itemsize == 1:
        per_token += cfg.num_kv_heads * 4
    layers = cfg.num_layers if num_layers is None else num_layers
    return 2 * layers * page_size * per_token


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


def local_ring_capacity(cfg: ModelConfig, max_seq_len: int, tokens_per_step: int,
                        page_size: int) -> int:
    """Slots per row of a hybrid cache's ring for the sliding-window layers of a model that
    mixes them with global ones; 0 (all in the pool) otherwise or where it saves no pages."""
    windows = cfg.windows
    local = [w for w in windows if w is not None]
    if not local or None not in windows:
        return 0
    slots = ring_capacity(max(local), tokens_per_step)
    return slots if -(-slots // page_size) < -(-max_seq_len // page_size) else 0


def ring_bytes(cfg: ModelConfig, num_slots: int, slots: int, page_size: int, dtype) -> int:
    """Bytes of a hybrid cache's ring: slots per row (rounded up to pages) of num_slots rows in
    every sliding-window layer."""
    pages = -(-slots // page_size) * num_slots
    return kv_page_bytes(cfg, page_size, dtype, num_layers=cfg.num_local_layers) * pages


def pages_from_memory(engine, memory_left: tuple[int, int], max_num_seqs: int,
                      max_seq_len: int, page_size: int) -> int:
    """num_pages=None on a device that reports memory: the pages that what the weights and
    the engine's largest step's scratch leave can hold; ValueError when that cannot hold one
    max_seq_len request."""
    limit, in_use = memory_left
    step = engine.step_scratch_bytes()
    # Per device: each holds 1/(data*sequence) of the pool's pages, 1/tensor of kv heads.
    partitioner = engine.partitioner
    mesh = partitioner.mesh_config if partitioner is not None else MeshConfig()
    cfg, kv_dtype = engine.runner.cfg, engine.kv_dtype
    split = mesh.data * mesh.sequence * mesh.tensor
    ring = engine.runner.ring_capacity
    global_layers = cfg.num_layers - cfg.num_local_layers if ring else None
    page = kv_page_bytes(cfg, page_size, kv_dtype, global_layers) // split
    # A hybrid cache's ring of local layers is a fixed size: it comes off the top.
    if ring:
        step += ring_bytes(cfg, max_num_seqs, ring, page_size, kv_dtype) // split
    pages = pages_for_memory(limit, in_use, step, page)
    pages -= pages % (mesh.data * mesh.sequence)
    need = (-(-max_seq_len // page_size) + 1) * mesh.data  # one request per replica
    if pages < need:
        raise ValueError(
            f"the KV cache does not fit: of {UTILIZATION:.0%} of {limit} device bytes, "
            f"{in_use} are in use (weights) and the largest step needs {step} more, leaving "
            f"{pages} pages of {page} bytes; one max_seq_len ({max_seq_len}) request "
            f"needs {need} (lower max_seq_len or max_num_seqs, or pass num_pages)")
    return pages
