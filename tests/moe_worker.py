"""Expert parallelism on simulated CPU devices, in its own process (the device count is fixed
when jax starts): `python tests/moe_worker.py` prints one JSON line of results, which
tests/test_expert_parallel.py checks. XLA_FLAGS must set 8 devices before this runs.

The tiny Mixtral (8 experts, top 2) and Qwen3-MoE (16 experts, top 4) of tests/data/tiny_models
are served on one device and on meshes whose data x tensor devices split the experts, greedy
with logprobs; each mesh run also reports the experts' sharding and the bytes of the expert
weights on device 0, and whether the step's HLO holds the shard_map's all-reduce.
"""

import json
import os
import sys

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# (data, tensor, sequence): experts over data x tensor.
MESHES = {"single": None, "tensor4": (1, 4, 1), "data2_tensor4": (2, 4, 1), "data8": (8, 1, 1),
          "data2_tensor2_seq2": (2, 2, 2),
          # 6 devices do not divide 8 experts: experts whole on every device, their ffn width
          # split over tensor instead (the partitioner's all-reduce, no shard_map).
          "data3_tensor2": (3, 2, 1)}


def run(name: str) -> dict:
    import jaxinfer as ji

    path = os.path.join(HERE, "data", "tiny_models", name)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 17, 33, 2, 9, 24, 12, 40)]
    params = ji.SamplingParams(max_tokens=12, logprobs=1, ignore_eos=True)
    out = {}
    for label, mesh in MESHES.items():
        kw = {} if mesh is None else {"mesh": ji.MeshConfig(*mesh)}
        llm = ji.LLM(path, max_seq_len=64, max_num_seqs=6 if mesh == (3, 2, 1) else 8,
                     prefill_chunk=32, decode_steps=4, **kw)
        outs = llm.generate(prompts, params)
        w = llm._engine.params.layers[0].w_gate
        dev = jax.devices()[0]
        local = sum(s.data.nbytes for s in w.addressable_shards if s.device == dev)
        out[label] = {"tokens": [o.token_ids for o in outs],
                      "logprobs": [[lp[t] for lp, t in zip(o.logprobs, o.token_ids)]
                                   for o in outs],
                      "expert_spec": str(getattr(w.sharding, "spec", None)),
                      "expert_bytes_device0": local, "expert_bytes_total": w.nbytes}
        del llm
        jax.clear_caches()
    return out


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    print(json.dumps({name: run(name) for name in ("mixtral", "qwen3_moe")}))
