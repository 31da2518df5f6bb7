"""PageAllocator: allocation, block tables, prefix caching, LRU eviction, and a randomized
property test against a shadow model of page contents. Model-free and host-only."""

import random

import pytest

from jaxinfer.engine.page_allocator import OutOfPages, PageAllocator, page_hash

PS = 4


def _snapshot(a):
    return (a.stats(), {s: a.block_table(s) for s in list(a._seqs)},
            [a.refcount(p) for p in range(a.num_pages)], a.cached_pages(),
            [list(f) for f in a._fresh], [list(e) for e in a._evictable],
            {s: list(q) for s, q in a._aside.items()}, [dict(d) for d in a._aside_pages])


def _runs(table):
    """A block table's runs of consecutive page ids, as their lengths."""
    runs = [1]
    for prev, page in zip(table, table[1:]):
        if page == prev + 1:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


def test_allocation_sizes_and_block_tables():
    a = PageAllocator(16, PS)
    for sid, n in enumerate([1, 3, 4, 5, 8, 9]):
        assert a.allocate(sid, list(range(100 * sid, 100 * sid + n))) == 0
        assert len(a.block_table(sid)) == -(-n // PS) and a.num_tokens(sid) == n
    tables = [p for s in range(6) for p in a.block_table(s)]
    assert len(set(tables)) == len(tables) and a.null_page not in tables
    assert a.stats()["used"] == len(tables) and a.num_free_pages == 15 - len(tables)


def test_append_across_page_boundaries_and_free():
    a = PageAllocator(8, PS)
    a.allocate("s", [1, 2, 3])
    a.append("s", [4])
    assert len(a.block_table("s")) == 1
    a.append("s", [5])
    assert len(a.block_table("s")) == 2 and a.num_tokens("s") == 5
    a.append("s", list(range(6, 15)))  # 14 tokens -> 4 pages
    assert len(a.block_table("s")) == 4
    a.ensure_capacity("s", 17)  # lookahead: a 5th page, no tokens recorded
    assert len(a.block_table("s")) == 5 and a.num_tokens("s") == 14
    a.free("s")
    assert a.num_free_pages == 7 and a.stats()["used"] == 0
    with pytest.raises(KeyError):
        a.free("s")


def test_out_of_pages_is_atomic_and_names_numbers():
    a = PageAllocator(6, PS)  # 5 usable
    a.allocate("a", list(range(12)))  # 3 pages
    a.mark_computed("a", 12)
    before = _snapshot(a)
    with pytest.raises(OutOfPages, match="needs 3 free KV pages, only 2 free") as e:
        a.allocate("b", list(range(100, 112)))
    assert (e.value.needed, e.value.free) == (3, 2)
    assert _snapshot(a) == before and "b" not in a
    with pytest.raises(OutOfPages, match="needs 3 .* only 2"):
        a.append("a", list(range(12, 24)))
    with pytest.raises(OutOfPages):
        a.ensure_capacity("a", 30)
    assert _snapshot(a) == before
    assert a.can_allocate(8) and not a.can_allocate(9)


def test_revived_hits_do_not_count_as_free():
    a = PageAllocator(5, PS)  # 4 usable
    a.allocate("a", list(range(9)))
    a.mark_computed("a", 9)
    a.free("a")  # 2 cached + 2 fresh pages free
    before = _snapshot(a)
    # 2 hits revive both cached pages, leaving 2 free for the 3 more pages needed.
    with pytest.raises(OutOfPages, match="needs 3 free KV pages, only 2 free"):
        a.allocate("b", list(range(8)) + list(range(50, 59)))
    assert _snapshot(a) == before
    assert a.allocate("b", list(range(8)) + list(range(50, 58))) == 2 * PS


def test_prefix_sharing_chained_and_never_whole_prompt():
    a = PageAllocator(32, PS)
    prefix = list(range(10))  # 2.5 pages
    assert a.allocate("a", prefix + [50, 51, 52]) == 0
    a.mark_computed("a", 13)
    assert a.allocate("b", prefix + [60, 61, 62, 63]) == 2 * PS
    ta, tb = a.block_table("a"), a.block_table("b")
    assert ta[:2] == tb[:2] and ta[2] != tb[2]
    assert [a.refcount(p) for p in ta[:3]] == [2, 2, 1]
    s = a.stats()
    assert (s["prefix_cache_queries"], s["prefix_cache_hits"]) == (13 + 14, 8)
    assert s["hit_rate"] == pytest.approx(8 / 27)
    # A fully cached 3-page prompt (a's first 12 tokens) still computes its last page.
    assert a.allocate("c", (prefix + [50, 51])) == 2 * PS
    # Page 1 differs: page 2 is identical but must not be shared (chained hash).
    other = prefix[:4] + [99] * 4 + prefix[8:] + [50, 51, 52]
    assert a.allocate("d", other) == PS
    assert a.block_table("d")[0] == ta[0] and not set(a.block_table("d")[1:]) & set(ta)
    # Once computed, d's page 2 is cached under its own key beside a's identical-token page 2.
    n = len(a.cached_pages())
    a.mark_computed("d", 13)
    assert len(a.cached_pages()) == n + 2
    assert a.cached_pages()[page_hash(page_hash(page_hash(b"", other[:4]), other[4:8]),
                                      other[8:12])] == a.block_table("d")[2]


def test_uncomputed_pages_are_not_shared_and_caching_can_be_off():
    a = PageAllocator(16, PS)
    a.allocate("a", list(range(12)))
    a.mark_computed("a", 4)  # chunked prefill: only the first chunk is written
    assert a.allocate("b", list(range(13))) == PS
    off = PageAllocator(16, PS, enable_prefix_caching=False)
    off.allocate("a", list(range(12)))
    off.mark_computed("a", 12)
    assert off.allocate("b", list(range(13))) == 0 and off.stats()["hit_rate"] == 0.0
    off.free("a")
    assert off.stats()["cached"] == 0


def test_cache_survives_free_and_preemption():
    a = PageAllocator(16, PS)
    toks = list(range(11))
    a.allocate("a", toks)
    a.mark_computed("a", 11)
    a.append("a", [11, 12])  # decode; token 12's KV not written yet
    a.mark_computed("a", 12)
    table = a.block_table("a")
    a.free("a")  # preemption: requeue for recompute
    assert a.stats()["cached"] == 3 and a.stats()["used"] == 0
    assert a.allocate("a", toks + [11, 12]) == 3 * PS
    assert a.block_table("a")[:3] == table[:3]
    assert [a.refcount(p) for p in table[:3]] == [1, 1, 1] and a.stats()["cached"] == 0


def test_lru_eviction_order_and_refresh_on_hit():
    a = PageAllocator(8, PS)  # 7 usable
    prompts = {sid: [10 * sid] * PS + [10 * sid + 1] * PS + [7] for sid in (0, 1)}
    t = {}
    for sid, toks in prompts.items():
        a.allocate(sid, toks)
        a.mark_computed(sid, len(toks))
        t[sid] = a.block_table(sid)
        a.free(sid)
    # Freed tail-first; partial last pages were never registered, so they are fresh again.
    assert list(a._evictable[0]) == [t[0][1], t[0][0], t[1][1], t[1][0]]
    assert a.stats()["cached"] == 4 and a.stats()["free"] == 7
    a.allocate("x", list(range(100, 116)))  # 4 pages: 3 fresh, then 1 eviction
    assert set(a.cached_pages().values()) == {t[0][0], t[1][0], t[1][1]}
    assert a.stats()["evictions"] == 1
    a.free("x")
    assert a.allocate("r", prompts[0]) == PS  # a hit revives seq 0's head page...
    a.free("r")  # ...so it is now the most recently used
    assert list(a._evictable[0]) == [t[1][1], t[1][0], t[0][0]]
    a.allocate("y", list(range(200, 220)))  # 5 pages: 4 fresh, then seq 1's tail
    assert set(a.cached_pages().values()) == {t[1][0], t[0][0]}
    a.free("y")
    assert a.allocate("p1", prompts[1]) == PS and a.allocate("p0", prompts[0]) == PS


# ---- randomized property test ------------------------------------------------------------

def _check(a, seqs, shadow, ever_used):
    fresh = [p for f in a._fresh for p in f]
    evict = [p for e in a._evictable for p in e]
    aside = [p for d in a._aside_pages for p in d]
    used = [p for p in range(1, a.num_pages) if a.refcount(p) > 0]
    states = fresh + evict + aside + used
    assert sorted(states) == list(range(1, a.num_pages)), "each page in exactly one state"
    assert all(a.refcount(p) == 0 for p in fresh + evict + aside)
    # Set-aside pages: each sequence's follow its newest page (in order), of its partition.
    assert sorted(p for q in a._aside.values() for p in q) == sorted(aside)
    for sid, q in a._aside.items():
        assert sid in seqs and all(a._aside_pages[a.partition(p)][p] == sid for p in q)
        if q:
            assert list(q) == list(range(a.block_table(sid)[-1] + 1,
                                         a.block_table(sid)[-1] + 1 + len(q)))
    counts = [0] * a.num_pages
    for sid in seqs:
        bt = a.block_table(sid)
        assert len(set(bt)) == len(bt) and a.null_page not in bt
        assert len(bt) >= -(-a.num_tokens(sid) // PS)
        for p in bt:
            counts[p] += 1
    assert counts == [a.refcount(p) for p in range(a.num_pages)]
    s = a.stats()
    assert s["free"] + s["used"] == a.num_usable_pages and s["cached"] == len(evict)
    # Shadow KV: slot content = the whole prefix ending at that token (KV depends on it all).
    for sid, toks in seqs.items():
        assert a.num_tokens(sid) == len(toks)
        bt = a.block_table(sid)
        for pos in range(a.num_computed(sid)):
            assert shadow[bt[pos // PS]][pos % PS] == tuple(toks[:pos + 1])
    cached = a.cached_pages()
    assert set(evict) <= set(cached.values())
    for h, p in cached.items():
        prefix = shadow[p][PS - 1]
        chain = b""
        for i in range(len(prefix) // PS):
            chain = page_hash(chain, prefix[i * PS:(i + 1) * PS])
        assert chain == h and len(prefix) % PS == 0
    ever_used.update(used)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_invariants(seed):
    rng = random.Random(seed)
    a = PageAllocator(33, PS)  # 32 usable pages of 4 tokens
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(3, 14))] for _ in range(4)]
    seqs, shadow, ever_used, next_id = {}, {}, set(), 0
    family = {}  # sequence -> the sequence its fork chain started from (a group)
    hits = forks = copies_made = 0

    def compute(sid, upto):
        bt, toks = a.block_table(sid), seqs[sid]
        for pos in range(a.num_computed(sid), upto):  # the model writes these slots
            shadow.setdefault(bt[pos // PS], [None] * PS)[pos % PS] = tuple(toks[:pos + 1])
        a.mark_computed(sid, upto)

    def admit(sid, toks):
        nonlocal hits
        before = _snapshot(a)
        try:
            cached = a.allocate(sid, toks)
        except OutOfPages:
            assert _snapshot(a) == before
            return False
        assert cached % PS == 0 and cached < len(toks)
        hits += cached > 0
        seqs[sid] = list(toks)
        family.setdefault(sid, sid)
        return True

    for _ in range(1000):
        op = rng.random()
        if op < 0.3 or not seqs:
            toks = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            if admit(next_id, toks):
                next_id += 1
        elif op < 0.55:  # prefill chunk or catch up to the known tokens
            sid = rng.choice(list(seqs))
            n = a.num_computed(sid)
            compute(sid, min(len(seqs[sid]), n + rng.randrange(1, 9)))
        elif op < 0.8:  # decode: tokens before the new ones are computed first
            sid = rng.choice(list(seqs))
            compute(sid, len(seqs[sid]))
            new = [rng.randrange(50) for _ in range(rng.randrange(1, 4))]
            before = _snapshot(a)
            try:
                a.append(sid, new)
                seqs[sid] += new
            except OutOfPages:
                assert _snapshot(a) == before
        elif op < 0.85:  # preempt and re-admit for recompute
            sid = rng.choice(list(seqs))
            toks = seqs.pop(sid)
            a.free(sid)
            if toks:  # an empty fork has nothing to recompute
                admit(sid, toks)
        elif op < 0.92:  # fork: a new sequence shares a computed prefix (n > 1, beams)
            sid = rng.choice(list(seqs))
            compute(sid, len(seqs[sid]))
            n = rng.randrange(0, len(seqs[sid]) + 1)
            before = _snapshot(a)
            try:
                copies = a.fork(sid, next_id, n)
            except OutOfPages:
                assert _snapshot(a) == before
                continue
            for src, dst in copies:  # the device copies the partly filled page
                shadow[dst] = list(shadow[src])
            assert len(copies) == (n % PS > 0)
            copies_made += len(copies)
            forks += 1
            seqs[next_id], family[next_id] = seqs[sid][:n], family[sid]
            next_id += 1
        elif op < 0.95:  # preempt a whole group: each frees only its own references
            root = family[rng.choice(list(seqs))]
            members = [sid for sid in seqs if family[sid] == root]
            for sid in members:
                a.free(sid)
            for sid in members:
                toks = seqs.pop(sid)
                if not toks or not admit(sid, toks):  # an empty fork has nothing to recompute
                    family.pop(sid)
        else:  # finish or abort
            sid = rng.choice(list(seqs))
            del seqs[sid]
            a.free(sid)
        _check(a, seqs, shadow, ever_used)
    assert hits > 10 and a.stats()["evictions"] > 0 and forks > 20 and copies_made >= 5
    for sid in list(seqs):
        a.free(sid)
        del seqs[sid]
        _check(a, seqs, shadow, ever_used)
    assert a.num_free_pages == a.num_usable_pages and a.stats()["used"] == 0
    assert len(ever_used) == a.num_usable_pages


def test_partitions_keep_each_sequence_in_its_own_range():
    """Data-parallel pools: 2 partitions of 8 pages (page 0, the null page, in the first). A
    sequence's pages all come from the partition it was allocated in; the same prompt in the
    other partition misses the prefix cache (no page is read across replicas); one partition
    running out raises OutOfPages even though the other has room."""
    a = PageAllocator(16, PS, num_partitions=2)
    assert [a.free_pages(i) for i in range(2)] == [7, 8] and a.num_free_pages == 15
    prompt = list(range(13))                           # 4 pages, 3 of them cacheable
    assert a.allocate("a", prompt, partition=1) == 0
    assert all(a.partition(p) == 1 for p in a.block_table("a"))
    a.mark_computed("a", 13)
    assert a.allocate("b", prompt, partition=0) == 0    # other replica: no hit
    assert all(a.partition(p) == 0 for p in a.block_table("b"))
    assert a.allocate("c", prompt, partition=1) == 12   # same replica: 3 pages hit
    assert a.block_table("c")[:3] == a.block_table("a")[:3]
    a.ensure_capacity("c", 28)                       # 7 pages: the partition is full
    assert all(a.partition(p) == 1 for p in a.block_table("c"))
    assert a.free_pages(1) == 0 and a.free_pages(0) == 3
    with pytest.raises(OutOfPages):
        a.allocate("d", [1, 2], partition=1)
    a.free("a")
    a.free("c")
    assert a.free_pages(1) == 8
    with pytest.raises(ValueError, match="do not split into 3 partitions"):
        PageAllocator(16, PS, num_partitions=3)
    with pytest.raises(ValueError, match=r"partition 2 outside \[0, 2\)"):
        a.allocate("e", [1], partition=2)


# ---- growth in runs ----------------------------------------------------------------------

@pytest.mark.parametrize("run", [1, 2, 4])
def test_sequences_growing_side_by_side_take_runs_of_pages(run):
    """Four sequences taking a page each in turn (decode rows crossing page boundaries) get
    their pages in runs of `run` consecutive ids; with run 1 they interleave."""
    a = PageAllocator(64, PS, growth_run=run)
    for sid in range(4):
        a.allocate(sid, [sid])
    for n in range(2, 13):  # every sequence grows to 12 pages, one page at a time
        for sid in range(4):
            a.ensure_capacity(sid, n * PS)
    for sid in range(4):
        assert _runs(a.block_table(sid)) == [run] * (12 // run)
    assert a.num_free_pages == 63 - 48
    for sid in range(4):
        a.free(sid)
    assert a.num_free_pages == 63 and not a._aside and not any(a._aside_pages)
    assert list(a._fresh[0]) == list(range(1, 64))


def test_set_aside_pages_are_free_and_taken_back_before_cached_ones():
    a = PageAllocator(12, PS)  # 11 usable, runs of 4
    a.allocate("c", list(range(2 * PS)))  # 2 pages, cached once computed and freed
    a.mark_computed("c", 2 * PS)
    a.free("c")
    a.allocate("g", [1])  # takes page 3 and sets aside 4, 5, 6
    assert a.block_table("g") == [3] and list(a._aside["g"]) == [4, 5, 6]
    assert a.num_free_pages == 10 and a.stats()["used"] == 1 and a.stats()["cached"] == 2
    a.ensure_capacity("g", PS + 1)  # its next page is the one set aside after its last
    assert a.block_table("g") == [3, 4] and list(a._aside["g"]) == [5, 6]
    # 7 pages for a new prompt: fresh 7..11 first, then g's set-aside pages (the last set
    # aside first), and no cached page is evicted while set-aside ones remain.
    a.allocate("p", list(range(100, 100 + 7 * PS)))
    assert a.block_table("p") == [7, 8, 9, 10, 11, 6, 5]
    assert a.stats()["evictions"] == 0 and a.stats()["cached"] == 2 and not a._aside["g"]
    a.ensure_capacity("g", 2 * PS + 1)  # nothing fresh or set aside: evicts a cached page
    assert a.stats()["evictions"] == 1
    with pytest.raises(OutOfPages, match="needs 2 free KV pages, only 1 free"):
        a.ensure_capacity("g", 5 * PS)


def test_freed_pages_are_reused_lowest_first():
    a = PageAllocator(16, PS, growth_run=1)
    for sid in range(5):
        a.allocate(sid, list(range(2 * PS)))  # pages 2s+1, 2s+2
    for sid in (3, 0, 4, 1):
        a.free(sid)
    a.allocate("n", list(range(5 * PS)))
    assert a.block_table("n") == [1, 2, 3, 4, 7]


def test_growth_run_is_checked():
    with pytest.raises(ValueError, match="growth_run must be >= 1, got 0"):
        PageAllocator(8, PS, growth_run=0)
