"""Flash attention for prefill: a Pallas kernel and its pure-jnp reference (same contract)."""

from .block_sizes import BLOCK_SIZES, BlockSizes, default_block_sizes
from .kernel import flash_attention
from .reference import flash_attention_reference

__all__ = ["flash_attention", "flash_attention_reference", "BLOCK_SIZES", "BlockSizes",
           "default_block_sizes"]
