"""The engine's view of the paged KV cache: the pages each slot's request holds
(PageAllocator, keyed by seq_id) and the device's block tables.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.engine.page_allocator import OutOfPages, PageAllocator


class PagedSlots:
    def __init__(self, num_pages: int, page_size: int, max_seq_len: int,
                 enable_prefix_caching: bool = True, num_partitions: int = 1):
        self.page_size = page_size
        self.max_seq_len = max_seq_len
        self.table_width = -(-max_seq_len // page_size)           # pages of one full row
        # One partition of the pool per data replica: a slot's pages live on its devices.
        self.allocator = PageAllocator(num_pages, page_size, enable_prefix_caching,
                                       num_partitions)
        self.tables = np.zeros((0, self.table_width), np.int32)
        self.dirty = True

    def resize(self, num_slots: int, keep: bool = False) -> None:
        """Block tables for num_slots slots; keep: the existing slots keep theirs (growing)."""
        old = self.tables
        self.tables = np.zeros((num_slots, self.table_width), np.int32)
        if keep:
            self.tables[:len(old)] = old[:num_slots]
        self.dirty = True

    def _sync(self, req) -> None:
        """Copies req's block table into its slot row, marking the tables dirty if it changed."""
        table = self.allocator.block_table(req.seq_id)
        row = self.tables[req.slot]
        if row[len(table):].any() or not np.array_equal(row[:len(table)], table):
            row[:] = self.allocator.null_page
            row[:len(table)] = table
            self.dirty = True

    def admit(self, req, slot: int, partition: int = 0) -> int | None:
        """Takes pages for req's prefill tokens from `partition` (the slot's data replica);
        returns the tokens already cached, or None when pages are short."""
        try:
            cached = self.allocator.allocate(req.seq_id, req.prefill_ids, partition,
                                             getattr(req, "cache_namespace", b""))
        except OutOfPages:
            return None
        req.slot = slot
        self._sync(req)
        return cached

    def fork(self, source, req, num_tokens: int) -> list[tuple[int, int]] | None:
        """req shares source's first num_tokens tokens and gets room for one more; returns the
        page copies [(src, dst)] for the device, or None when pages are short."""
        try:
            copies = self.allocator.fork(source.seq_id, req.seq_id, num_tokens)
        except OutOfPages:
            return None
        if not self.grow(req, num_tokens + 1):
            self.allocator.free(req.seq_id)
            return None
        return copies

    def computed(self, req, num_tokens: int) -> None:
        """num_tokens of req (prefill ids, then generated) now have K/V in their pages."""
        have = self.allocator.num_tokens(req.seq_id)
        if num_tokens > have:
            # Sliced from each list: joining them would copy the whole context per step.
            P = len(req.prompt_ids)
            new = (req.prompt_ids[have:num_tokens]
                   + req.token_ids[max(have - P, 0):max(num_tokens - P, 0)])
            self.allocator.append(req.seq_id, new)
            self._sync(req)
        self.allocator.mark_computed(req.seq_id, num_tokens)

    def grow(self, req, num_tokens: int) -> bool:
        """Makes room for num_tokens (capped at max_seq_len); False when pages ran out."""
        try:
            self.allocator.ensure_capacity(req.seq_id, min(num_tokens, self.max_seq_len))
        except OutOfPages:
            return False
        self._sync(req)
        return True

    def release(self, req) -> None:
        if req.seq_id in self.allocator:
            self.allocator.free(req.seq_id)
        if req.slot is not None and req.slot < len(self.tables):
            self.tables[req.slot] = self.allocator.null_page
            self.dirty = True

    def take_tables(self) -> np.ndarray | None:
        """The block tables if they changed since the last call, else None."""
        if not self.dirty:
            return None
        self.dirty = False
        return self.tables.copy()

    def stats(self) -> dict:
        s = self.allocator.stats()
        usable = max(s["usable"], 1)
        return {"num_pages": s["num_pages"], "pages_used": s["used"],
                "peak_pages_used": s["peak_used"],
                "pages_cached": s["cached"], "page_utilization": s["used"] / usable,
                "prefix_cache_hit_tokens": s["prefix_cache_hits"],
                "prefix_cache_query_tokens": s["prefix_cache_queries"],
                "prefix_cache_hit_rate": s["hit_rate"]}
