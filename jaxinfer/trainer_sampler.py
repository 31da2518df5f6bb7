"""What a JAX trainer needs of its sampler (docs/rl.md), as methods of `LLM`: weights swapped
in between steps (update_weights, weight_version), and device memory handed to the trainer
and back (sleep, wake_up). The conversion of the weights themselves is engine/weight_sync.py.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from jaxinfer.engine import weight_sync
from jaxinfer.engine.request import RequestOutput
from jaxinfer.models import get_model


class TrainerSampler:
    """LLM's trainer-facing methods; they use the LLM's engine, its request bookkeeping
    (step, abort, _make_request) and its LoRA checks."""

    _sleep_level = 0          # sleep(): 0 awake, else the level
    _weights_dropped = False  # sleep(level=2, keep_weights=False) until update_weights

    @property
    def weight_version(self) -> int:
        """How many weight updates (update_weights) the engine has taken; every output records
        the version its tokens were sampled under (CompletionOutput.weight_versions)."""
        return self._engine.weight_version

    def update_weights(self, weights, *, lora: Optional[str] = None, mode: str = "wait",
                       donate: bool = False) -> list[RequestOutput]:
        """Swaps in new weights between steps, with no recompilation (docs/rl.md).

        weights: the model's params pytree (jaxinfer.models.ModelParams, as sequence_logits
        takes it) or a mapping of weight names ("embed", "layers.3.wq", ...) to arrays, a
        subset allowed, any float dtype, on any devices and shardings; with lora=name, a
        jaxinfer.lora.LoraParams for adapter `name` (loaded if new). Checked before anything
        changes; converted to the engine's dtype, kv-head layout and quantization and resharded
        onto its mesh, on the devices (a quantized engine quantizes on the host). The engine
        owns the result: the caller's arrays are copied unless donate=True.

        mode, for unfinished requests (a LoRA update: those under that adapter): "wait" runs
        them to the end on the old weights first; "abort" ends them (finish_reason "abort");
        "keep" keeps their tokens and recomputes their KV under the new weights, then goes on;
        "restart" starts them over on the new weights (same id and seed). The prefix cache
        forgets what the old weights computed. Returns the outputs of the steps "wait" ran, or
        of the requests "abort" ended."""
        if mode not in weight_sync.MODES:
            raise ValueError(f"mode must be one of {weight_sync.MODES}, got {mode!r}")
        if not isinstance(donate, bool):
            raise ValueError(f"donate must be a bool, got {donate!r}")
        engine = self._engine
        if mode == "keep" and engine.paged is None:
            raise ValueError("mode='keep' recomputes KV in the paged cache; this model runs on "
                             "the ring-buffer cache: use 'wait', 'abort' or 'restart'")
        if lora is None:
            if self.quantization == "int4-awq":
                raise ValueError("update_weights: int4-awq weights need activation-aware "
                                 "calibration (minutes); serve with quantization='int4', "
                                 "'int8', 'fp8' or None to take a trainer's weights")
            cfg = self.model_config
            new = weight_sync.incoming(weights, cfg)
            if engine.runner.params_released():
                missing = set(weight_sync.named_leaves(engine.params)) - set(new)
                if missing:
                    raise ValueError(
                        f"the weights were freed by sleep(level=2): update_weights needs all of "
                        f"them, {len(missing)} are missing (such as {sorted(missing)[0]!r})")
            with engine.runner.on_mesh():
                params, old = weight_sync.convert(
                    new, engine.params, cfg, dtype=jnp.dtype(self.dtype),
                    quantization=self.quantization, donate=donate)
        else:
            adapter = self._adapter_from(lora, weights, donate)
        outs = self._settle(mode, lambda r: lora is None or r.lora == lora)
        if lora is None:
            engine.swap_params(params)
            weight_sync.delete(old)
            engine.drop_prefix_cache()
            self._weights_dropped = False
        else:
            loras = engine.loras
            (loras.replace if lora in loras.adapters else loras.add)(adapter)
            engine.weight_version += 1
            for r in list(engine.waiting) + engine.slots:
                if r is not None and r.lora == lora:
                    r.cache_namespace = loras.salt(lora)
        return outs

    def _adapter_from(self, name: str, weights, donate: bool):
        """A LoraParams as a LoRA Adapter of device arrays (float32 copies unless donate),
        checked against the model's adaptable fields and max_lora_rank."""
        from jaxinfer.lora.adapters import Adapter, adaptable
        from jaxinfer.lora.trainable import LoraParams

        self._check_lora_name(name)
        if not isinstance(weights, LoraParams):
            raise ValueError(f"a LoRA update takes a jaxinfer.lora.LoraParams, got "
                             f"{type(weights).__name__}")
        allowed = adaptable(get_model(self.model_config.architecture), self.model_config)
        L, r = self.model_config.num_layers, weights.rank
        if r > self._engine.loras.max_rank:
            raise ValueError(f"adapter {name!r} has rank {r}; max_lora_rank is "
                             f"{self._engine.loras.max_rank}")
        if set(weights.a) != set(weights.b) or not weights.a:
            raise ValueError(f"adapter {name!r}: a and b must name the same fields")
        a, b = {}, {}
        for field in weights.a:
            if field not in allowed:
                raise ValueError(f"adapter {name!r}: field {field!r} is not adaptable in this "
                                 f"model; adaptable: {sorted(allowed)}")
            (fan_in, fan_out), _ = allowed[field]
            for x, want, out in ((weights.a[field], (L, fan_in, r), a),
                                 (weights.b[field], (L, r, fan_out), b)):
                if tuple(x.shape) != want:
                    raise ValueError(f"adapter {name!r}: {field} has shape {tuple(x.shape)}; "
                                     f"the model and rank {r} need {want}")
                # On the engine's devices (replicated on its mesh), float32, its own buffer.
                mine = self._engine.runner.replicated(jnp.asarray(x))
                out[field] = mine if donate or not weight_sync.shares_buffers(mine, x) \
                    else jnp.copy(mine)
        return Adapter(name=name, rank=r, scale=float(weights.scale), a=a, b=b)

    def _settle(self, mode: str, affected) -> list[RequestOutput]:
        """Unfinished requests that `affected` picks, dealt with per update_weights' mode."""
        engine = self._engine
        groups = {r.request_id: r.group[0] for r in list(engine.waiting) + engine.slots
                  if r is not None and r.finish_reason is None and affected(r)}
        if not groups:
            return []
        if mode == "wait":
            outs = []
            # Bounded: every step advances some sequence; each has at most max_seq_len tokens.
            for _ in range(sum(len(g.group) for g in groups.values()) * self.max_seq_len + 1):
                if all(q.finish_reason is not None for g in groups.values() for q in g.group):
                    break
                outs += self.step()
            return outs
        if mode == "abort":
            for rid in groups:
                self.abort(rid)
            return [g.output() for g in groups.values()]
        if mode == "keep":
            engine.preempt_running(lambda r: r.request_id in groups)
            return []
        from jaxinfer.llm import EncodedPrompt

        for rid, g in groups.items():  # restart
            self.abort(rid)
            req = self._make_request(EncodedPrompt(g.prompt, tuple(g.prompt_ids)), g.params,
                                     rid, g.lora, seed=g.seed)
            self._requests[rid] = req
            engine.add(req)
        return []

    def sleep(self, level: int = 1, keep_weights: bool = True) -> None:
        """Frees device memory for a trainer: level 1 the KV page pool (and the prefix cache
        with it), level 2 the weights too, copied to the host first when keep_weights (else
        dropped: update_weights must bring a whole tree). Needs no unfinished requests; while
        asleep new requests are refused (RuntimeError) until wake_up()."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        if not isinstance(keep_weights, bool):
            raise ValueError(f"keep_weights must be a bool, got {keep_weights!r}")
        if self._sleep_level:
            raise RuntimeError(f"the engine is already asleep (level {self._sleep_level})")
        self._engine.sleep(level, keep_weights)
        self._sleep_level = level
        self._weights_dropped = level == 2 and not keep_weights

    def wake_up(self) -> None:
        """Restores what sleep() freed: the weights kept on the host and an empty page pool;
        the compiled programs serve as before."""
        if not self._sleep_level:
            return
        self._engine.wake_up()
        self._sleep_level = 0

    @property
    def is_sleeping(self) -> bool:
        return bool(self._sleep_level)

    def _check_awake(self) -> None:
        if self._sleep_level:
            raise RuntimeError(f"the engine is asleep (sleep level {self._sleep_level}): call "
                               "wake_up() before submitting requests")
        if self._weights_dropped:
            raise RuntimeError("the weights were dropped by sleep(level=2, keep_weights=False): "
                               "call update_weights(params) before submitting requests")
