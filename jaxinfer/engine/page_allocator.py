"""Host-side page allocator for a paged KV cache: reference counts and prefix caching.

Each sequence owns a block table of page ids. Full, computed pages are registered under a
chained hash of their tokens so a later sequence with the same prefix shares them; freed, they
stay cached (evictable, LRU) until needed. Page 0 (`null_page`) is never handed out, so padded
block tables never point at a live page. A sequence taking a fresh page sets aside the next
`growth_run - 1` for itself, so rows decoding side by side get runs of consecutive pages for
the decode attention to read. With num_partitions > 1 (one per data replica) the pool splits
into contiguous ranges, each with its own free lists and prefix cache. A fork shares its
source's full pages and copies the partly filled last one at once.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import heapq
from typing import Sequence

import numpy as np

_ROOT_HASH = b""  # parent of a sequence's first page
# A sequence's pages come in runs of up to this many consecutive page ids (PageAllocator).
GROWTH_RUN = 4


def page_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """sha256(parent hash || token ids as int64): chained, so a page matches only with its whole
    prefix; cryptographic, since a collision would serve another prompt's KV."""
    return hashlib.sha256(parent + np.asarray(token_ids, dtype=np.int64).tobytes()).digest()


class _FreshPages:
    """A partition's fresh pages, handed out lowest id first (so freed pages are reused in
    runs), with membership tests and removal of any one."""

    def __init__(self, pages):
        self._set = set(pages)
        self._heap = sorted(self._set)  # may also hold pages removed since (skipped on pop)

    def __len__(self) -> int:
        return len(self._set)

    def __iter__(self):
        return iter(sorted(self._set))

    def __contains__(self, page: int) -> bool:
        return page in self._set

    def pop(self) -> int:
        while True:
            page = heapq.heappop(self._heap)
            if page in self._set:
                self._set.remove(page)
                return page

    def remove(self, page: int) -> None:
        self._set.remove(page)
        if len(self._heap) > 2 * len(self._set) + 64:  # drop the removed pages' entries
            self._heap = sorted(self._set)

    def add(self, page: int) -> None:
        self._set.add(page)
        heapq.heappush(self._heap, page)


class OutOfPages(RuntimeError):
    """Not enough free pages; the allocator state is unchanged. `needed`/`free` are in pages."""

    def __init__(self, what: str, needed: int, free: int):
        super().__init__(f"{what}: needs {needed} free KV pages, only {free} free")
        self.needed, self.free = needed, free


@dataclasses.dataclass
class _Seq:
    tokens: list[int]  # every known token id of the sequence
    pages: list[int]  # block table; may run ahead of the tokens (see ensure_capacity)
    hashes: list[bytes]  # chained hash of each full, computed page, in order
    num_computed: int  # tokens whose KV is written (watermark for registering pages)
    partition: int = 0  # the pool partition (data replica) its pages come from
    root: bytes = b""   # the parent hash of its first page (partition and namespace)


class PageAllocator:
    """Allocates KV pages to sequences, with optional prefix caching. num_pages includes the
    reserved `null_page`; growth_run: pages per run of consecutive ids (1: none set aside)."""

    null_page = 0

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 num_partitions: int = 1, growth_run: int = GROWTH_RUN):
        if num_pages < 2 or page_size < 1:
            raise ValueError(f"need num_pages >= 2 and page_size >= 1, "
                             f"got {num_pages} and {page_size}")
        if num_partitions < 1 or num_pages % num_partitions or num_pages // num_partitions < 2:
            raise ValueError(f"{num_pages} pages do not split into {num_partitions} partitions "
                             "of at least 2 pages each")
        if growth_run < 1:
            raise ValueError(f"growth_run must be >= 1, got {growth_run}")
        self.growth_run = growth_run
        self.num_pages, self.page_size = num_pages, page_size
        self.num_partitions = num_partitions
        self.partition_size = num_pages // num_partitions
        self.num_usable_pages = num_pages - 1
        self.enable_prefix_caching = enable_prefix_caching
        self._refcount = [0] * num_pages
        # Per partition: fresh pages, and cached-but-evictable ones in LRU order.
        self._fresh = [_FreshPages(p for p in self._range(i) if p != self.null_page)
                       for i in range(num_partitions)]
        # Pages set aside, per sequence and per partition (page -> sequence, in order).
        self._aside: dict[object, collections.deque[int]] = {}
        self._aside_pages: list[collections.OrderedDict[int, object]] = [
            collections.OrderedDict() for _ in range(num_partitions)]
        self._evictable: list[collections.OrderedDict[int, None]] = [
            collections.OrderedDict() for _ in range(num_partitions)]
        self._hash_to_page: dict[bytes, int] = {}
        self._page_to_hash: dict[int, bytes] = {}
        self._seqs: dict[object, _Seq] = {}
        self._queries = self._hits = self._evictions = 0
        self._epoch = 0  # drop_cache calls: part of every root hash
        self._peak_used = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Free pages over all partitions: fresh, set aside and cached-but-evictable."""
        return sum(self.free_pages(i) for i in range(self.num_partitions))

    def free_pages(self, partition: int = 0) -> int:
        """Pages an allocation in `partition` may take: fresh, set aside (for any sequence)
        and cached-but-evictable."""
        return (len(self._fresh[partition]) + len(self._aside_pages[partition])
                + len(self._evictable[partition]))

    def partition(self, page: int) -> int:
        """The partition (data replica) a page belongs to."""
        return page // self.partition_size

    def _range(self, partition: int) -> range:
        return range(partition * self.partition_size, (partition + 1) * self.partition_size)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold num_tokens tokens: ceil(num_tokens / page_size)."""
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_tokens: int, partition: int = 0) -> bool:
        """Whether a new sequence of num_tokens tokens fits in `partition`, assuming no
        prefix-cache hit."""
        return self.pages_for(num_tokens) <= self.free_pages(partition)

    def block_table(self, seq_id) -> list[int]:
        """Page ids of the sequence, in token order (pad with `null_page` for fixed shapes)."""
        return list(self._seqs[seq_id].pages)

    def num_tokens(self, seq_id) -> int:
        return len(self._seqs[seq_id].tokens)

    def num_computed(self, seq_id) -> int:
        return self._seqs[seq_id].num_computed

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def cached_pages(self) -> dict[bytes, int]:
        """Prefix cache contents: chained page hash -> page id (in use or evictable)."""
        return dict(self._hash_to_page)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def stats(self) -> dict:
        """Pool usage in pages (free includes cached) and prefix-cache traffic in tokens."""
        free = self.num_free_pages
        return dict(
            num_pages=self.num_pages, usable=self.num_usable_pages, free=free,
            used=self.num_usable_pages - free, peak_used=self._peak_used,
            cached=sum(map(len, self._evictable)),
            evictions=self._evictions, prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
            hit_rate=self._hits / self._queries if self._queries else 0.0)

    # ---- mutation ------------------------------------------------------------------------
    def allocate(self, seq_id, token_ids: Sequence[int], partition: int = 0,
                 namespace: bytes = b"") -> int:
        """Admits a sequence with its prompt, its pages from `partition`; returns how many
        prompt tokens are already cached: a multiple of page_size below len(token_ids), since
        the last token must be computed for its logits. Pages are shared only within a
        namespace (b"": the base model's; a LoRA adapter's sequences have their own, their
        keys and values being the adapter's). OutOfPages (state unchanged)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        if not 0 <= partition < self.num_partitions:
            raise ValueError(f"partition {partition} outside [0, {self.num_partitions})")
        tokens = [int(t) for t in token_ids]
        if not tokens:
            raise ValueError("cannot allocate an empty prompt")
        ps = self.page_size
        hits: list[int] = []
        hashes: list[bytes] = []
        root = self._root(partition)
        if namespace:
            root = hashlib.sha256(root + b"namespace" + namespace).digest()
        if self.enable_prefix_caching:
            parent = root
            for i in range((len(tokens) - 1) // ps):  # never the page holding the last token
                h = page_hash(parent, tokens[i * ps:(i + 1) * ps])
                page = self._hash_to_page.get(h)
                if page is None:
                    break  # chained: nothing after a miss can hit
                hits.append(page)
                hashes.append(h)
                parent = h
        needed = self.pages_for(len(tokens)) - len(hits)
        # Revived hits leave the evictable pool, so they cannot also pay for the fresh pages.
        free = self.free_pages(partition) - sum(self._refcount[p] == 0 for p in hits)
        if needed > free:
            raise OutOfPages(f"allocating {len(tokens)} tokens for {seq_id!r}", needed, free)
        for page in hits:
            if self._refcount[page] == 0:
                del self._evictable[partition][page]
            self._refcount[page] += 1
        pages = hits + self._take(needed, partition, seq_id)
        num_cached = len(hits) * ps
        if self.enable_prefix_caching:
            self._queries += len(tokens)
            self._hits += num_cached
        self._seqs[seq_id] = _Seq(tokens, pages, hashes, num_cached, partition, root)
        return num_cached

    def fork(self, source_id, seq_id, num_tokens: int) -> list[tuple[int, int]]:
        """A new sequence sharing source's first num_tokens computed tokens' full pages; returns
        the copy of a partly filled one [(src page, dst page)]. OutOfPages (state unchanged)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        src = self._seqs[source_id]
        if not 0 <= num_tokens <= src.num_computed:
            raise ValueError(f"fork of {num_tokens} tokens: {source_id!r} has "
                             f"{src.num_computed} computed")
        full, partial = divmod(num_tokens, self.page_size)
        if partial and self.free_pages(src.partition) < 1:
            raise OutOfPages(f"forking {seq_id!r}", 1, 0)
        shared = src.pages[:full]
        for page in shared:
            self._refcount[page] += 1
        pages, copies = list(shared), []
        if partial:
            pages += self._take(1, src.partition, seq_id)
            copies.append((src.pages[full], pages[-1]))
        self._seqs[seq_id] = _Seq(src.tokens[:num_tokens], pages, src.hashes[:full],
                                  num_tokens, src.partition, src.root)
        return copies

    def ensure_capacity(self, seq_id, num_tokens: int) -> None:
        """Grows the block table to num_tokens tokens in all, recording no tokens. OutOfPages
        (state unchanged)."""
        seq = self._seqs[seq_id]
        partition = seq.partition
        needed = self.pages_for(num_tokens) - len(seq.pages)
        if needed > self.free_pages(partition):
            raise OutOfPages(f"growing {seq_id!r} to {num_tokens} tokens", needed,
                             self.free_pages(partition))
        if needed > 0:
            seq.pages += self._take(needed, partition, seq_id)

    def append(self, seq_id, token_ids: Sequence[int]) -> None:
        """Records new tokens, taking pages as needed; their KV counts once `mark_computed`
        says so. OutOfPages (state unchanged)."""
        seq = self._seqs[seq_id]
        new = [int(t) for t in token_ids]
        self.ensure_capacity(seq_id, len(seq.tokens) + len(new))
        if new:
            ps = self.page_size
            for i in range(len(seq.tokens) // ps, (len(seq.tokens) + len(new) - 1) // ps + 1):
                page = seq.pages[i]  # no copy-on-write: the pages written are ours alone
                assert self._refcount[page] == 1 and page not in self._page_to_hash, page
            seq.tokens += new

    def mark_computed(self, seq_id, num_computed: int) -> None:
        """Declares the KV of the first num_computed tokens written and registers their full
        pages: never earlier, so no sequence hits a page a pending chunk has not written."""
        seq = self._seqs[seq_id]
        if not seq.num_computed <= num_computed <= len(seq.tokens):
            raise ValueError(f"{seq_id!r}: num_computed {num_computed} outside "
                             f"[{seq.num_computed}, {len(seq.tokens)}]")
        seq.num_computed = num_computed
        if not self.enable_prefix_caching:
            return
        ps = self.page_size
        for i in range(len(seq.hashes), num_computed // ps):
            parent = seq.hashes[-1] if seq.hashes else (seq.root or self._root(seq.partition))
            h = page_hash(parent, seq.tokens[i * ps:(i + 1) * ps])
            seq.hashes.append(h)
            page = seq.pages[i]
            # Same contents computed twice concurrently: keep the first copy cached; this page
            # stays unregistered and goes back to the fresh pool when freed.
            if h not in self._hash_to_page and page not in self._page_to_hash:
                self._hash_to_page[h] = page
                self._page_to_hash[page] = h

    def free(self, seq_id) -> None:
        """Releases a sequence; its registered pages stay cached (evictable)."""
        seq = self._seqs.pop(seq_id)
        # Reversed: a sequence's tail pages become least recently used, so they are evicted
        # before its head pages, which more prompts share and whose loss orphans the tail.
        for page in reversed(seq.pages):
            assert self._refcount[page] > 0, f"page {page} double-freed"
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                if page in self._page_to_hash:
                    self._evictable[self.partition(page)][page] = None
                else:
                    self._fresh[self.partition(page)].add(page)
        for page in self._aside.pop(seq_id, ()):
            del self._aside_pages[seq.partition][page]
            self._fresh[seq.partition].add(page)

    def _root(self, partition: int) -> bytes:
        """The parent hash of a sequence's first page: partitions never share pages, nor do
        pages computed before and after drop_cache."""
        root = _ROOT_HASH if partition == 0 else b"partition %d" % partition
        return root + (b"epoch %d" % self._epoch if self._epoch else b"")

    def drop_cache(self) -> int:
        """Forgets every cached page (their keys and values came from weights since replaced,
        or from a pool since freed): evictable pages become fresh, and pages sequences still
        hold are never matched again. Returns how many cached pages were dropped."""
        self._epoch += 1
        dropped = len(self._page_to_hash)
        for partition, evictable in enumerate(self._evictable):
            for page in evictable:
                self._fresh[partition].add(page)
            evictable.clear()
        self._hash_to_page.clear()
        self._page_to_hash.clear()
        return dropped

    def _take(self, n: int, partition: int, seq_id) -> list[int]:
        """n free pages of a partition for seq_id (the caller checked they exist): its own
        set-aside pages, then fresh ones, then others' set-aside ones, then LRU eviction."""
        fresh, evictable = self._fresh[partition], self._evictable[partition]
        aside_pages = self._aside_pages[partition]
        own = self._aside.get(seq_id)
        out = []
        for _ in range(n):
            if own:
                page = own.popleft()
                del aside_pages[page]
            elif fresh:
                page = fresh.pop()
                own = self._set_aside(seq_id, page, partition)
            elif aside_pages:
                page, owner = aside_pages.popitem(last=True)
                self._aside[owner].remove(page)
            else:
                page, _ = evictable.popitem(last=False)
                del self._hash_to_page[self._page_to_hash.pop(page)]
                self._evictions += 1
            self._refcount[page] = 1
            out.append(page)
        self._peak_used = max(self._peak_used, self.num_usable_pages - self.num_free_pages)
        return out

    def _set_aside(self, seq_id, page: int, partition: int):
        """Sets up to growth_run - 1 fresh pages after `page` aside for seq_id; returns all
        its set-aside pages."""
        own = self._aside.setdefault(seq_id, collections.deque())
        fresh = self._fresh[partition]
        for nxt in range(page + 1, page + self.growth_run):
            if nxt not in fresh:
                break
            fresh.remove(nxt)
            own.append(nxt)
            self._aside_pages[partition][nxt] = seq_id
        return own
