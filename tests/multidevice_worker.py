"""Runs sharded checks on simulated CPU devices, in its own process (the device count is fixed
when jax starts): `python tests/multidevice_worker.py MODE` prints one JSON line of results,
which tests/test_sharding.py checks. XLA_FLAGS must set the device count before this runs.

Modes:
  meshes   the real model's HF greedy goldens on several meshes, per-device parameter bytes,
           shardings, a bad tensor degree, and no compile after warmup on one mesh;
  kvrep    a random model whose kv heads (2) are fewer than the tensor degree (4), loaded
           from an orbax checkpoint, against the same model on one device;
  kernels  the Pallas kernels (interpret mode) under shard_map on a (2, 2, 1) mesh against
           the reference attention on one device;
  context  sequence parallelism: ring and all-gather context-parallel attention against the
           reference; a random model on sequence meshes against one device; per-device
           prefill FLOPs with the chunk's tokens split over `sequence`;
  big      per-device bytes of Llama-3-8B and -70B (abstract: jax.eval_shape, nothing
           allocated) with a paged KV cache on a (1, 8, 1) mesh.
"""

import json
import logging
import os
import sys
import tempfile

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# (data, tensor, sequence): data with tensor, data with sequence. (1,3,1) and (1,1,2), each
# axis alone, also passed when they ran here; they were dropped to keep the slow run short (each
# mesh compiles its own programs), as the two kept cover every axis and the data split with each.
MESHES = [(2, 3, 1), (2, 1, 2)]


def device_bytes(tree) -> tuple[int, int]:
    """(bytes on device 0, bytes of the whole arrays) of a pytree of arrays."""
    dev = jax.devices()[0]
    local = total = 0
    for leaf in jax.tree.leaves(tree):
        total += leaf.nbytes
        local += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == dev)
    return local, total


class Compiles(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.seen = []

    def emit(self, record):
        if record.getMessage().startswith("Compiling"):
            self.seen.append(record.getMessage()[:120])


STRUCTURED_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n"],
                     "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}


def meshes() -> dict:
    import jaxinfer as ji

    with open(os.path.join(HERE, "data", "smollm2_greedy.json")) as f:
        golden = json.load(f)
    prompts = [c["prompt_ids"] for c in golden["cases"]]
    params = ji.SamplingParams(max_tokens=golden["max_new_tokens"])
    out = {"runs": {}}
    for d, t, s in MESHES:
        llm = ji.LLM("smollm2-135m", max_seq_len=256, max_num_seqs=4,
                     mesh=ji.MeshConfig(data=d, tensor=t, sequence=s))
        eng = llm._engine
        local, total = device_bytes(eng.params)
        outs = llm.generate(prompts, params)
        out["runs"][f"{d},{t},{s}"] = {
            "tokens": [o.token_ids for o in outs],
            "finish": [o.finish_reason for o in outs],
            "param_bytes_device0": local, "param_bytes_total": total,
            "wq_spec": str(eng.params.layers[0].wq.sharding.spec),
            "wo_spec": str(eng.params.layers[0].wo.sharding.spec),
            "embed_spec": str(eng.params.embed.sharding.spec),
            "pool_spec": str(eng.state.cache.k.sharding.spec),
            "rows_spec": str(eng.state.last_token.sharding.spec),
        }
        del llm, eng
        jax.clear_caches()
    try:
        ji.LLM("smollm2-135m", mesh=ji.MeshConfig(tensor=2))
        out["bad_tensor"] = None
    except ValueError as e:
        out["bad_tensor"] = str(e)
    # Steady state: after warmup, a mixed workload compiles nothing.
    llm = ji.LLM("smollm2-135m", max_seq_len=128, max_num_seqs=4, prefill_chunk=32,
                 mesh=ji.MeshConfig(data=2, tensor=3))
    llm.warmup()
    handler = Compiles()
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    jax.config.update("jax_log_compiles", True)
    mixed = [ji.SamplingParams(max_tokens=n, temperature=temp, top_k=k, seed=seed)
             for n, temp, k, seed in [(5, 0.0, 0, None), (9, 0.8, 20, 1), (3, 1.0, 0, 2),
                                      (12, 0.5, 5, 3), (7, 0.0, 0, None)]]
    # One constrained row (structured outputs: the decode dispatches with it run one step).
    mixed.append(ji.SamplingParams(max_tokens=40, structured_outputs=ji.StructuredOutputs(
        json=STRUCTURED_SCHEMA, disable_any_whitespace=True)))
    ask = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": 'Reply with JSON like {"n": 7}.'}]))
    outs = llm.generate([[1, 2, 3], list(range(10, 50)), [5] * 70, [7, 8],
                         list(range(100, 117)), ask], mixed)
    jax.config.update("jax_log_compiles", False)
    out["compiles_after_warmup"] = handler.seen
    out["structured"] = {"text": outs[-1].text, "finish": outs[-1].finish_reason}
    return out


def random_model_runs(shape: dict, variants: dict) -> dict:
    """A random float32 model of Llama-3-8B's config with `shape` overrides, saved as an orbax
    checkpoint and served under each variant's LLM keywords: greedy tokens, their logprobs,
    the kv heads the engine uses and wk's sharding."""
    import jax.numpy as jnp

    import jaxinfer as ji
    from jaxinfer.loading.checkpoint import save_checkpoint
    from jaxinfer.loading.safetensors import config_from_hf
    from jaxinfer.models import llama

    with open(os.path.join(ROOT, "configs", "models", "llama-3-8b.json")) as f:
        hf = json.load(f)
    hf.update(shape)
    cfg = config_from_hf(hf)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 17, 33, 2)]
    params = ji.SamplingParams(max_tokens=16, logprobs=1)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(tmp, cfg, llama.LLAMA.init_params(cfg, jax.random.key(0), jnp.float32))
        for name, kw in variants.items():
            kw = kw(tmp) if callable(kw) else kw  # a variant may need the checkpoint's path
            llm = ji.LLM(tmp, max_seq_len=64, max_num_seqs=4, **kw)
            outs = llm.generate(prompts, params)
            wk = llm._engine.params.layers[0].wk.sharding
            draft = llm._engine.draft_kw["draft_params"]
            out[name] = {"tokens": [o.token_ids for o in outs],
                         "draft_wq_spec": None if draft is None
                         else str(draft.layers[0].wq.sharding.spec),
                         "logprobs": [[lp[t] for lp, t in zip(o.logprobs, o.token_ids)]
                                      for o in outs],
                         "kv_heads": llm.model_config.num_kv_heads,
                         "attention": llm.engine_config.attention,
                         "wk_spec": str(getattr(wk, "spec", None))}
            del llm
            jax.clear_caches()
    return out


def kvrep() -> dict:
    import jaxinfer as ji

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)
    return random_model_runs(shape, {"single": {}, "tensor4": {"mesh": ji.MeshConfig(tensor=4)}})


def kernels() -> dict:
    import jaxinfer as ji

    import dataclasses

    from jaxinfer import backends, sharding
    from jaxinfer.backends.attention import ragged_attention
    from jaxinfer.device.ragged_meta import ragged_meta

    shape = dict(hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256)
    out = random_model_runs(shape, {
        "single": {"attention": "reference"},
        "pallas_mesh": {"attention": "pallas", "mesh": ji.MeshConfig(data=2, tensor=2)}})
    # The ragged kernel's call, traced on the mesh: a shard_map over heads.
    q = jax.ShapeDtypeStruct((8, 4, 32), np.float32)
    pool = jax.ShapeDtypeStruct((1, 64, 2, 32), np.float32)
    tables = jax.ShapeDtypeStruct((4, 4), np.int32)
    n = jax.ShapeDtypeStruct((4,), np.int32)
    part = sharding.Partitioner(sharding.make_mesh(ji.MeshConfig(data=2, tensor=2)))

    def call(q, k, v, tables, start, count, lengths):
        meta = ragged_meta(start, count, lengths, num_tokens=8, query_tile=4, num_tiles=6,
                           page_size=16)
        backend = dataclasses.replace(backends.default(), attention="pallas")
        return ragged_attention(backend, q, k, v, 0, tables, meta, page_size=16)
    with part.active():
        text = str(jax.make_jaxpr(call)(q, pool, pool, tables, n, n, n))
    out["kernel_shard_map"] = "shard_map" in text and "in_specs=(P(None, 'tensor'" in text
    return out


def replica_pages() -> dict:
    """The real model on a (data 2, sequence 2) mesh: each admitted request's pages, its slot's
    replica, and the replicas whose devices hold those pages of the pool."""
    import jaxinfer as ji

    llm = ji.LLM("smollm2-135m", max_seq_len=64, max_num_seqs=4,
                 mesh=ji.MeshConfig(data=2, sequence=2))
    eng = llm._engine
    admitted = []
    admit = eng.paged.admit

    def record(req, slot, partition=0):
        cached = admit(req, slot, partition)
        if cached is not None:
            admitted.append((slot, eng.paged.allocator.block_table(req.request_id)))
        return cached
    eng.paged.admit = record
    prompts = [list(range(5 + 7 * i, 30 + 9 * i)) for i in range(6)]
    outs = llm.generate(prompts, ji.SamplingParams(max_tokens=12, ignore_eos=True))
    # Which data replica holds each pool slot: from the pool's own sharding.
    k = eng.state.cache.k
    mesh = eng.partitioner.mesh
    holder = np.full(k.shape[1], -1)
    for device, index in k.sharding.devices_indices_map(k.shape).items():
        data_index = int(np.argwhere(mesh.devices == device)[0][0])
        holder[index[1]] = data_index
    Z = eng.paged.page_size
    B = len(eng.slots)
    return {"slots": B, "tokens": [len(o.token_ids) for o in outs],
            "requests": [{"slot": slot, "replica": slot * 2 // B,
                          "page_holders": sorted({int(holder[p * Z]) for p in pages})}
                         for slot, pages in admitted]}


def context() -> dict:
    """Sequence parallelism: the two context-parallel attentions against the reference, a
    random model served on sequence meshes against one device, and the per-device FLOPs of a
    prefill chunk whose tokens split over `sequence`."""
    import jax.numpy as jnp

    import jaxinfer as ji
    from jaxinfer import sharding
    from jaxinfer.backends.attention import reference_attention
    from jaxinfer.loading.safetensors import config_from_hf

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import context_parallel_attention as context_parallel
    import scaling

    B, T, N, K, H = 2, 64, 8, 2, 16
    key = jax.random.key(0)
    q, k, v = (jax.random.normal(jax.random.fold_in(key, i), (B, T, n, H))
               for i, n in enumerate((N, K, K)))
    pos = jnp.tile(jnp.arange(T, dtype=jnp.int32), (B, 1)).at[1, 50:].set(-1)
    out = {"attention": {}}
    for mesh in [(1, 1, 4), (2, 2, 2)]:
        part = sharding.Partitioner(sharding.make_mesh(ji.MeshConfig(*mesh)))
        for method in context_parallel.METHODS:
            for window in (None, 20):
                ref = reference_attention(q, pos, [(k, v, pos)], sliding_window=window)
                with part.active():
                    got = jax.jit(lambda *a: context_parallel.sequence_sharded_attention(
                        *a, method=method, sliding_window=window))(q, k, v, pos, pos)
                out["attention"][f"{mesh} {method} {window}"] = float(jnp.max(jnp.abs(got - ref)))
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)
    out["runs"] = random_model_runs(shape, {
        "single": {}, "seq2": {"mesh": ji.MeshConfig(sequence=2)},
        "data2_seq2": {"mesh": ji.MeshConfig(data=2, sequence=2)},
        # A draft model on a mesh: the model drafts for itself (greedy: the same tokens).
        "draft_data2_tensor2": lambda path: {
            "mesh": ji.MeshConfig(data=2, tensor=2),
            "speculative": ji.SpeculativeConfig("draft", num_draft_tokens=3, draft_model=path)}})
    out["replica_pages"] = replica_pages()
    with open(os.path.join(ROOT, "configs", "models", "llama-3-8b.json")) as f:
        hf = json.load(f)
    hf.update(shape)
    cfg = config_from_hf(hf)
    out["prefill_flops"] = {s: scaling.compile_step(cfg, ji.MeshConfig(sequence=s), 1, 64,
                                                    256, jnp.float32)["flops"] for s in (1, 2)}
    return out


def big() -> dict:
    import jax.numpy as jnp

    from jaxinfer import sharding
    from jaxinfer.config import MeshConfig
    from jaxinfer.device.state import DecodeState
    from jaxinfer.device.kv_cache import PagedKVCache
    from jaxinfer.loading.safetensors import config_from_hf
    from jaxinfer.models import llama

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import scaling

    part = sharding.Partitioner(sharding.make_mesh(MeshConfig(tensor=8)))
    out = {}
    # The stated KV budget: 64 sequences of 8,192 tokens in 16-token pages, bfloat16.
    seqs, seq_len, page = 64, 8192, 16
    for name in ("llama-3-8b", "llama-3-70b"):
        with open(os.path.join(ROOT, "configs", "models", name + ".json")) as f:
            cfg = config_from_hf(json.load(f))
        params = jax.eval_shape(lambda: llama.LLAMA.init_params(cfg, jax.random.key(0), jnp.bfloat16))
        axes = sharding.param_axes(cfg, params, llama.LLAMA.param_specs)
        pages = seqs * seq_len // page + 1
        cache = PagedKVCache(
            k=jax.ShapeDtypeStruct((cfg.num_layers, pages * page, cfg.num_kv_heads,
                                    cfg.head_dim), jnp.bfloat16),
            v=jax.ShapeDtypeStruct((cfg.num_layers, pages * page, cfg.num_kv_heads,
                                    cfg.head_dim), jnp.bfloat16),
            block_tables=jax.ShapeDtypeStruct((seqs, seq_len // page), jnp.int32),
            lengths=jax.ShapeDtypeStruct((seqs,), jnp.int32), page_size=page)
        state = jax.eval_shape(lambda: DecodeState.create(cfg, seqs, seq_len, jnp.bfloat16,
                                                          cache=cache))

        def per_device(tree, axes_tree):
            whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
            return scaling.per_device_bytes(part, tree, axes_tree), whole

        p_dev, p_all = per_device(params, axes)
        s_dev, s_all = per_device(state, state.logical_axes())
        out[name] = {"params_device": p_dev, "params_total": p_all, "state_device": s_dev,
                     "state_total": s_all, "kv_budget": f"{seqs} x {seq_len} tokens, bf16",
                     "q_heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads}
    return out


def hybrid() -> dict:
    """The tiny Gemma 3 (window 8; two sliding-window layers in a ring of 23 slots, the global
    one in the pool) on one device and on meshes, prompts long enough to wrap the ring: greedy
    tokens, their logprobs and the ring's shardings."""
    import jaxinfer as ji

    path = os.path.join(ROOT, "tests", "data", "tiny_models", "gemma3")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (20, 41, 9, 30)]
    params = ji.SamplingParams(max_tokens=16, logprobs=1, ignore_eos=True)
    out = {}
    for name, mesh in (("single", None), ("data2_tensor2", ji.MeshConfig(data=2, tensor=2)),
                       ("data2_seq2", ji.MeshConfig(data=2, sequence=2))):
        llm = ji.LLM(path, max_seq_len=64, max_num_seqs=4, prefill_chunk=16, decode_steps=4,
                     page_size=16, mesh=mesh)  # 16: the ring (2 pages) is below a row's 4
        outs = llm.generate(prompts, params)
        cache = llm._engine.state.cache
        out[name] = {"tokens": [o.token_ids for o in outs],
                     "logprobs": [[lp[t] for lp, t in zip(o.logprobs, o.token_ids)]
                                  for o in outs],
                     "ring_slots": llm.stats()["ring_slots"],
                     "ring_spec": str(getattr(cache.local_k.sharding, "spec", None))}
        del llm
        jax.clear_caches()
    return out


def lora() -> dict:
    """The tiny Llama with two random LoRA adapters (every projection) and base rows mixed in
    one batch, on one device and on (1,2,1) and (2,1,1) meshes: tokens, chosen logprobs and the
    adapter slots' shardings."""
    import jaxinfer as ji
    from jaxinfer.lora.adapters import from_peft_arrays
    from jaxinfer.models import get_model

    sys.path.insert(0, os.path.join(HERE, "lora"))
    from lora_util import HF_MODULES, peft_tensors, read_weights

    path = os.path.join(ROOT, "tests", "data", "tiny_models", "llama")
    weights = read_weights(path)
    prompts = [[1, 5, 9, 30, 41], [2, 7, 100], [3, 3, 3, 8, 120, 64, 9], [4, 50]]
    params = ji.SamplingParams(max_tokens=10, logprobs=1, ignore_eos=True)
    loras = ["a", None, "b", "a"]
    out = {}
    for name, mesh in (("single", None), ("tensor2", ji.MeshConfig(tensor=2)),
                       ("data2", ji.MeshConfig(data=2))):
        llm = ji.LLM(path, dtype="float32", max_seq_len=64, max_num_seqs=4, max_loras=2,
                     max_lora_rank=4, mesh=mesh)
        for k, ad in enumerate(("a", "b")):
            tensors = peft_tensors(weights, set(HF_MODULES), r=4, seed=k)
            llm.add_lora(from_peft_arrays(ad, tensors, r=4, lora_alpha=8.0,
                                          family=get_model("llama"), cfg=llm.model_config,
                                          max_rank=4))
        outs = llm.generate(prompts, params, lora=loras)
        slots = llm._engine.runner.lora
        out[name] = {"tokens": [o.token_ids for o in outs],
                     "logprobs": [[lp[t] for lp, t in zip(o.logprobs, o.token_ids)]
                                  for o in outs],
                     "a_spec": str(getattr(slots.a["wq"][0].sharding, "spec", None)),
                     "b_spec": str(getattr(slots.b["wq"][0].sharding, "spec", None))}
        del llm
        jax.clear_caches()
    return out


def rl() -> dict:
    """update_weights on meshes the caller built (jax.sharding.Mesh with its own axis names):
    the tiny Llama (4 heads, 2 kv heads) on (tensor 2), (data 2) and (tensor 4, kv heads
    repeated) views, fed a perturbed float32 tree sharded by the caller on other devices and
    on the engine's own; greedy tokens against a fresh LLM of the new weights on the same mesh,
    compiles after the first update, and a LoRA update from LoraParams on (tensor 2)."""
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jaxinfer as ji
    from jaxinfer.loading import load_model
    from jaxinfer.loading.checkpoint import save_checkpoint
    from jaxinfer.lora.trainable import LoraParams
    from jaxinfer.models import sequence_logits

    path = os.path.join(ROOT, "tests", "data", "tiny_models", "llama")
    source = load_model(path, dtype=jnp.float32)
    key = jax.random.key(3)
    leaves, treedef = jax.tree.flatten(source.params)
    tree = jax.tree.unflatten(treedef, [
        x + 0.5 * jnp.std(x) * jax.random.normal(jax.random.fold_in(key, i), x.shape)
        if x.ndim == 2 else x for i, x in enumerate(leaves)])
    prompts = [[1, 5, 9, 30, 41], [2, 7, 100], [3, 3, 3, 8, 120, 64, 9], [4, 50]]
    sp = ji.SamplingParams(max_tokens=10, ignore_eos=True)
    devs = jax.devices()
    trainer = Mesh(np.array(devs[4:8]).reshape(2, 2), ("fsdp", "model"))

    def trainer_sharded(t, mesh, axis):
        return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(
            mesh, P(axis) if x.shape[0] % mesh.shape[axis] == 0 else P())), t)

    out = {}
    views = {"tensor2": ((1, 2), ("replica", "tp"), {"data": "replica", "tensor": "tp"}),
             "data2": ((2, 1), ("dp", "tp"), {"data": "dp", "tensor": "tp"}),
             "tensor4": ((4,), ("tensor",), None)}
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(os.path.join(tmp, "new"), source.config, tree)
        for name, (shape, names, axes) in views.items():
            mesh = Mesh(np.array(devs[:int(np.prod(shape))]).reshape(shape), names)
            kw = dict(dtype="float32", max_seq_len=64, max_num_seqs=4, mesh=mesh,
                      mesh_axes=axes, max_loras=1 if name == "tensor2" else 0, max_lora_rank=4)
            llm = ji.LLM(path, **kw)
            before = [o.token_ids for o in llm.generate(prompts, sp)]
            llm.update_weights(trainer_sharded(tree, trainer, "fsdp"))  # other devices
            rec = Compiles()
            logging.getLogger("jax").addHandler(rec)
            jax.config.update("jax_log_compiles", True)
            after = [o.token_ids for o in llm.generate(prompts, sp)]
            llm.update_weights(trainer_sharded(tree, trainer, "fsdp"))  # a layout seen before
            again = [o.token_ids for o in llm.generate(prompts, sp)]
            jax.config.update("jax_log_compiles", False)
            logging.getLogger("jax").removeHandler(rec)
            # The engine's own devices in another layout: a mesh shared with a trainer.
            llm.update_weights(trainer_sharded(source.params, mesh, names[0]))
            llm.update_weights(trainer_sharded(tree, mesh, names[0]))
            shared = [o.token_ids for o in llm.generate(prompts, sp)]
            fresh = ji.LLM(os.path.join(tmp, "new"), **kw)
            want = [o.token_ids for o in fresh.generate(prompts, sp)]
            wk = llm.params.layers[0].wk
            out[name] = {"before": before, "after": after, "again": again, "want": want,
                         "shared": shared,
                         "compiles": rec.seen, "version": llm.weight_version,
                         "kv_heads": llm.model_config.num_kv_heads,
                         "wk_spec": str(wk.sharding.spec),
                         "wk_devices": sorted(d.id for d in wk.sharding.device_set)}
            if name == "tensor2":
                lp = LoraParams.init(jax.random.key(0), llm.model_config, 4,
                                     ("q_proj", "v_proj", "down_proj"), alpha=8)
                lp = lp.replace(b={f: 0.3 * jax.random.normal(jax.random.key(i), x.shape)
                                   for i, (f, x) in enumerate(sorted(lp.b.items()))})
                llm.update_weights(trainer_sharded(lp, trainer, "fsdp"), lora="p")
                got = llm.generate(prompts[:1], ji.SamplingParams(
                    max_tokens=10, ignore_eos=True, token_logprobs=True), lora="p")[0]
                ids = jnp.asarray([prompts[0] + got.token_ids], jnp.int32)
                ref = np.asarray(sequence_logits(jax.device_get(tree), source.config, ids,
                                                 lora=jax.device_get(lp)))[0]
                ref = ref[len(prompts[0]) - 1:-1]
                ref = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1))[:, None] \
                    - ref.max(-1, keepdims=True)
                out[name]["lora_logprob_error"] = float(np.abs(
                    ref[np.arange(10), got.token_ids] - got.outputs[0].model_logprobs).max())
            del llm, fresh
            jax.clear_caches()
    return out


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    result = {"meshes": meshes, "kvrep": kvrep, "kernels": kernels, "big": big,
              "context": context, "hybrid": hybrid, "lora": lora,
              "rl": rl}[sys.argv[1]]()
    print(json.dumps(result))
