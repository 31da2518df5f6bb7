"""Paged attention for decode: a Pallas kernel and its pure-jnp reference."""

from pallas_kernels.paged_attention.kernel import paged_attention, paged_attention_kernel
from pallas_kernels.paged_attention.reference import paged_attention_reference

__all__ = ["paged_attention", "paged_attention_kernel", "paged_attention_reference"]
