"""Compiled-shape buckets (jaxinfer/engine/buckets.py): exact properties, no device work."""

import pytest

from jaxinfer.engine import buckets

CPU = (16, 64, 256, 512)  # the CPU's token buckets at the defaults (factor 4, budget 512)


def test_geometric_and_pick():
    assert buckets.geometric(512, 16, 4) == CPU
    assert buckets.geometric(48, 16) == (16, 32, 48)
    assert [buckets.pick(CPU, n) for n in (1, 16, 17, 64, 65, 512, 600)] == \
        [16, 16, 64, 64, 256, 512, 512]


@pytest.mark.parametrize("fixed,total,carried", [
    (15, 40, 40),     # 15 decodes + a 25-token prompt: padded to 64 (24) beats trimming to 16 (24)
    (15, 17, 16),     # one prefill token over 16: trimmed (1 left), not padded to 64 (47)
    (15, 68, 64),     # 4 over 64: trimmed, not 188 padding tokens up to 256
    (15, 215, 215),   # 41 padding tokens up to 256, where trimming to 64 would leave 151
    (0, 400, 400),    # 112 padding up to 512 against 144 left by trimming to 256
    (0, 384, 384),    # a tie (128 either way) pads up
    (0, 300, 256),    # 44 trimmed against 212 padding
    (20, 30, 30),     # no bucket below leaves room for a prefill token: padded to 64
    (15, 16, 16),     # a bucket exactly
    (0, 512, 512),
    (100, 600, 512),  # beyond the largest bucket: trimmed to it
])
def test_fill_takes_the_nearer_bucket(fixed, total, carried):
    assert buckets.fill(CPU, fixed, total) == carried


def test_fill_never_trims_a_decode_token_or_the_whole_prefill():
    for fixed in range(0, 40):
        for total in range(fixed + 1, 520):
            n = buckets.fill(CPU, fixed, total)
            assert fixed < n <= total
            if n < total:  # trimmed: exactly a bucket, nearer than the one above
                assert n in CPU
                above = buckets.pick(CPU, total)
                assert total > CPU[-1] or above - total > total - n
            else:  # carried whole: padding up to its bucket is no more than trimming would leave
                below = [b for b in CPU if fixed < b <= total]
                assert not below or buckets.pick(CPU, total) - total <= total - max(below)
