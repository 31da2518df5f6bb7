"""The device step: pure JAX programs over explicit state, donated through every call.

    state.py        DecodeState, RowParams, admission, forks, block tables; advance_rows
                    (the bookkeeping of new tokens, where stops are decided)
    step.py         the flat step: prefill chunks and decode tokens in one forward, then sampling
    loop.py         decode_loop: several decode steps per dispatch, with or without speculation
    drafting.py     n-gram and draft-model proposals, exact verification
    sampling.py     token sampling from per-row parameter arrays
    kv_cache.py     PagedKVCache: the page pool and block tables (a ring is a paged cache)
    token_batch.py  TokenBatch: one step's tokens, rows and per-row query ranges
    ragged_meta.py  a step's attention metadata, built once per forward

The models (jaxinfer.models) and the platform's ops (jaxinfer.backends) are what a step calls;
the host engine (jaxinfer.engine) builds the inputs and books the outputs.
"""
