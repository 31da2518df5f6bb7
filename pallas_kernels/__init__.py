"""Pallas attention kernels for jaxinfer (flash attention for prefill, paged attention for decode).

The kernels and their pure-jnp references are not implemented yet; jaxinfer.attention serves the
reference attention meanwhile.
"""

__all__: list[str] = []
