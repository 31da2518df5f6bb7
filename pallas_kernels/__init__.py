"""Pallas attention kernels: flash attention (prefill), paged attention (decode), and ragged
paged attention (the engine's flat step).

Each kernel is a portable `pallas_call` (interpret=True runs it on CPU; on GPU it lowers through
Triton) with a pure-jnp `*_reference` of the same contract beside it.
"""

from pallas_kernels.flash_attention import flash_attention, flash_attention_reference
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                   ragged_paged_attention_reference)

__all__ = ["flash_attention", "flash_attention_reference", "paged_attention",
           "paged_attention_reference", "ragged_paged_attention",
           "ragged_paged_attention_reference"]
