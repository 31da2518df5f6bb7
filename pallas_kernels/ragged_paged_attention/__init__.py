"""Ragged paged attention for mixed prefill / decode batches: a Pallas kernel and its pure-jnp
reference."""

from pallas_kernels.ragged_paged_attention.kernel import (ragged_paged_attention,
                                                          ragged_paged_attention_kernel)
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

__all__ = ["ragged_paged_attention", "ragged_paged_attention_kernel",
           "ragged_paged_attention_reference"]
