"""The model runner: device state, inputs built in numpy at bucketed shapes, one dispatch and
one device-to-host fetch per step. Warmup compiles every program: the flat step per token bucket
and the decode loop per row bucket; attention walks each row's pages in a loop of dynamic trip
count, so nothing else is a compile-time shape.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import time
from typing import Optional

import jax
import numpy as np

from jaxinfer import backends, sharding
from jaxinfer.backends import Backend
from jaxinfer.device import state as device_state
from jaxinfer.device.loop import decode_loop
from jaxinfer.device.state import DecodeState, RowParams
from jaxinfer.device.step import step_jit
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine import buckets, programs
from jaxinfer.engine.programs import ProgramCache
from jaxinfer.device.kv_cache import PagedKVCache, kv_buffer, ring_tables
from jaxinfer.sharding import Partitioner, fetch
from jaxinfer.device.sampling import ALL_TOKENS
from jaxinfer.device.token_batch import host_batch
from jaxinfer.lora.adapters import adaptable
from jaxinfer.lora.weights import LoraSlots, write_slot
from jaxinfer.structured import fill_masks, mask_words

MAX_STOP_IDS = 8
# Programs warmup compiles at once (at most the usable CPUs); $JAXINFER_COMPILE_THREADS overrides.
COMPILE_THREADS = 2


def _delete(tree) -> None:
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


@dataclasses.dataclass
class StepResult:
    """A flat step's outputs on the host."""

    tokens: dict          # slot -> sampled token
    done: dict            # slot -> whether the row is done (a stop id, or max_new reached)
    logprobs: dict        # slot -> (ids, values, chosen, sampled), for rows that want them
    prompt_logprobs: Optional[tuple]  # (ids [T, k], values [T, k], chosen [T]) when wanted


class Runner:
    def __init__(self, cfg: ModelConfig, params, engine_cfg: EngineConfig, *, num_slots: int,
                 capacity: int, dtype, kv_dtype, page_size: int, num_pages: int,
                 paged: bool, draft: Optional[tuple] = None,
                 partitioner: Optional[Partitioner] = None, eos_ids: tuple = (),
                 ring_capacity: int = 0, program_index: Optional[str] = None,
                 backend: Optional[Backend] = None, lora: Optional[tuple] = None):
        self.cfg, self.engine_cfg = cfg, engine_cfg
        # The ops' implementations, a static argument of every program (jaxinfer.backends).
        self.backend = backend if backend is not None else backends.resolve(
            engine_cfg.attention, head_dim=cfg.head_dim)
        self.partitioner = partitioner
        # Weights and state are committed to the device (or to their shardings on the mesh):
        # jit keys its compiled programs on whether each argument is.
        self.device = jax.local_devices()[0]
        self.params = self._place_params(params, cfg)
        self._host_params = None  # the weights sleep(level=2) kept on the host
        self.draft_kw = {"draft_params": self._place_params(*draft) if draft else None,
                         "draft_cfg": draft[1] if draft else None}
        self.num_slots, self.capacity = num_slots, capacity
        self.dtype, self.kv_dtype = dtype, kv_dtype
        self.page_size, self.num_pages, self.paged = page_size, num_pages, paged
        # Slots per row of a hybrid cache's sliding-window ring; 0: every layer in the pool.
        self.ring_capacity = ring_capacity
        self.eos_ids = eos_ids
        self.spec = engine_cfg.speculative
        tune = self.backend.tuning
        self.query_tile = tune.query_tile
        budget = engine_cfg.max_num_batched_tokens
        self.token_buckets = buckets.geometric(budget, min(tune.min_tokens, budget),
                                               tune.bucket_growth)
        self.row_buckets = buckets.geometric(num_slots, 1, tune.bucket_growth)
        # Where padding costs what a real token does, prefilling steps fill buckets.
        self.fill_buckets = self.token_buckets if tune.fill_token_buckets else None
        self.state: Optional[DecodeState] = None
        self.mask_s = 0.0  # host time writing structured outputs' token masks
        # LoRA: (slots, rank) -> the adapter slots on the device (jaxinfer.lora), else None.
        self.lora = self._place_lora(*lora) if lora else None
        # The programs cache on one device (engine.programs); None: jit dispatches.
        root = programs.directory() if partitioner is None else None
        self.programs = ProgramCache(root, program_index) if root else None

    # ---- placement -----------------------------------------------------------------------

    def _place_params(self, params, cfg: ModelConfig):
        if self.partitioner is None:
            return jax.device_put(params, self.device)
        from jaxinfer.models import get_model
        return self.partitioner.put_tree(
            params, sharding.param_axes(cfg, params, get_model(cfg.architecture).param_specs))

    def _place_state(self, state: DecodeState) -> DecodeState:
        if self.partitioner is None:
            return jax.device_put(state, self.device)
        return self.partitioner.put_tree(state, state.logical_axes())

    def _place_lora(self, num_slots: int, rank: int) -> LoraSlots:
        from jaxinfer.models import get_model

        targets = adaptable(get_model(self.cfg.architecture), self.cfg)
        self.lora_targets = targets
        # The slots take the float weights' dtype (bf16 by default: half the bytes a step
        # reads for them); the products accumulate in float32.
        slots = LoraSlots.zeros({f: shape for f, (shape, _) in targets.items()},
                                self.cfg.num_layers, num_slots, rank,
                                dtype=self._weight_dtype())
        if self.partitioner is None:
            return jax.device_put(slots, self.device)
        return self.partitioner.put_tree(
            slots, slots.logical_axes({f: axes for f, (_, axes) in targets.items()}))

    def _weight_dtype(self):
        """The float dtype of the base weights (float32 for a quantized model)."""
        w = self.params.layers[0].wq
        dtype = getattr(w, "dtype", None)
        return dtype if dtype is not None and jax.numpy.issubdtype(
            dtype, jax.numpy.floating) else np.float32

    def write_lora(self, slot: int, adapter) -> None:
        """Writes an adapter (jaxinfer.lora.adapters.Adapter; None: zeros) into slot `slot`:
        its A and B padded with zeros to the slots' rank, zeros for fields it leaves alone."""
        L, R = self.cfg.num_layers, self.lora.rank
        a, b = {}, {}
        for field, ((fan_in, fan_out), _) in self.lora_targets.items():
            if adapter is not None and field in adapter.a and \
                    isinstance(adapter.a[field], jax.Array):
                # An adapter on the device (update_weights): padded there, no host copy.
                pad = R - adapter.rank
                a[field] = jax.numpy.pad(self.replicated(adapter.a[field]),
                                         ((0, 0), (0, 0), (0, pad)))
                b[field] = jax.numpy.pad(self.replicated(adapter.b[field]),
                                         ((0, 0), (0, pad), (0, 0)))
                continue
            a[field] = np.zeros((L, fan_in, R), np.float32)
            b[field] = np.zeros((L, R, fan_out), np.float32)
            if adapter is not None and field in adapter.a:
                a[field][:, :, :adapter.rank] = adapter.a[field]
                b[field][:, :adapter.rank, :] = adapter.b[field]
        scale = np.float32(0.0 if adapter is None else adapter.scale)
        with self.on_mesh():
            self.lora = self._dispatch(("lora_write",), (
                write_slot, (self.lora, np.int32(slot), a, b, scale), {}))

    def replicated(self, x: jax.Array) -> jax.Array:
        """A device array (from any devices) as a float32 program input beside the slots: on
        the engine's device, or whole on every device of its mesh."""
        x = x.astype(np.float32)
        if self.partitioner is None:
            return jax.device_put(x, self.device)
        return jax.device_put(x, jax.sharding.NamedSharding(self.partitioner.mesh,
                                                            jax.sharding.PartitionSpec()))

    def on_mesh(self):
        """The context of every dispatch: the mesh its sharding constraints resolve against."""
        return self.partitioner.active() if self.partitioner is not None \
            else contextlib.nullcontext()

    def _zeros(self, shape: tuple[int, ...]):
        """An empty K or V buffer: on the host, or made shard by shard on the mesh."""
        bits = dict(bits16=self.backend.kv_bits16, fp8_bits=self.backend.kv_fp8_bits)
        if self.partitioner is None:
            return kv_buffer(shape, self.kv_dtype, np.zeros, **bits)
        axes = PagedKVCache.KV_AXES
        return kv_buffer(shape, self.kv_dtype, lambda sh, dt: self.partitioner.zeros(
            sh, dt, tuple(axes)[:len(sh)]), **bits)

    def new_state(self) -> DecodeState:
        """The device state: the page pool (or one ring per slot), the sliding-window layers'
        ring of a hybrid cache, and empty rows."""
        B, L = self.num_slots, self.cfg.num_layers
        K, H = self.cfg.num_kv_heads, self.cfg.head_dim
        if self.paged:
            Z, M = self.page_size, -(-self.capacity // self.page_size)
            tables, P, wraps = np.zeros((B, M), np.int32), self.num_pages, False
        else:
            Z = min(self.page_size, self.capacity)
            M = -(-self.capacity // Z)
            tables, P, wraps = ring_tables(B, M), B * M, True
        ring = {}
        if self.ring_capacity:
            local = self.cfg.num_local_layers
            R = -(-self.ring_capacity // Z)
            L -= local
            ring = dict(local_k=self._zeros((local, B * R * Z, K, H)),
                        local_v=self._zeros((local, B * R * Z, K, H)), local_pages=R)
        shape = (L, P * Z, K, H)
        cache = PagedKVCache(k=self._zeros(shape), v=self._zeros(shape), block_tables=tables,
                             lengths=np.zeros(B, np.int32), page_size=Z, wraps=wraps, **ring)
        history = self.engine_cfg.max_seq_len if self.spec is not None and \
            self.spec.method == "ngram" else 0
        return self._place_state(DecodeState.create(
            self.cfg, B, self.capacity, self.dtype, cache=cache,
            draft_cfg=self.draft_kw["draft_cfg"], draft_capacity=self.engine_cfg.max_seq_len,
            history=history, num_stop_ids=MAX_STOP_IDS, lora=self.lora is not None, xp=np))

    def ensure_state(self) -> None:
        if self.state is None:
            self.state = self.new_state()

    # ---- weights and memory (LLM.update_weights, sleep, wake_up) ------------------------------

    def release_state(self) -> None:
        """Frees the device state (the KV page pool and the rows); ensure_state makes a new
        one, of the same shapes and shardings, so nothing recompiles."""
        if self.state is not None:
            _delete(self.state)
            self.state = None

    def release_params(self, keep: bool) -> None:
        """Frees the weights' device buffers, first copied to the host when keep."""
        self._param_shardings = jax.tree.map(lambda x: x.sharding, self.params)
        self._host_params = jax.device_get(self.params) if keep else None
        _delete(self.params)

    def restore_params(self) -> None:
        """Puts weights release_params kept back in their shardings."""
        if self._host_params is not None:
            self.params = jax.device_put(self._host_params, self._param_shardings)
            self._host_params = None

    def drop_host_params(self) -> None:
        """Forgets weights release_params kept on the host (new ones replaced them)."""
        self._host_params = None

    def params_released(self) -> bool:
        return any(x.is_deleted() for x in jax.tree.leaves(self.params))

    # ---- admission -------------------------------------------------------------------------

    def admit(self, admitted: list, tables) -> None:
        """Writes admitted rows: start (prefix-cache hits), tokens generated before a
        preemption, sampling parameters and n-gram history."""
        B = self.num_slots
        mask, start = np.zeros(B, bool), np.zeros(B, np.int32)
        generated = np.zeros(B, np.int32)
        rows = RowParams.empty(B, MAX_STOP_IDS)
        history = None if self.state.history is None else \
            np.zeros(self.state.history.shape, np.int32)
        lora_slot = None if self.lora is None else np.full(B, -1, np.int32)
        for req, cached in admitted:
            b, p = req.slot, req.params
            if b is None:  # numpy would take mask[None] as the whole array: every row
                raise ValueError(f"request {req.request_id!r} was admitted without a slot")
            mask[b], start[b], generated[b] = True, cached, len(req.token_ids)
            s = rows.sampling
            s.temperature[b], s.top_k[b], s.top_p[b] = p.temperature, p.top_k, p.top_p
            s.min_p[b], s.repetition_penalty[b], s.seed[b] = p.min_p, p.repetition_penalty, req.seed
            rows.max_new[b] = req.max_new
            rows.logprobs[b] = p.logprobs is not None or p.token_logprobs
            rows.sampled_logprobs[b] = p.token_logprobs
            rows.prompt_logprobs[b] = p.prompt_logprobs is not None
            if not p.ignore_eos:
                ids = self.eos_ids[:MAX_STOP_IDS]
                rows.stop_ids[b, :len(ids)] = ids
            if history is not None:
                ids = req.prefill_ids[:history.shape[1]]
                history[b, :len(ids)] = ids
            if lora_slot is not None:
                lora_slot[b] = req.lora_slot
        self.state = self._dispatch(("admit", tables is None), (
            device_state.admit_rows, (self.state, mask, start, generated, rows, history, tables,
                                      lora_slot), {}))

    def fork(self, rows: list, copies: list) -> None:
        """Forks rows [(source slot, slot)] with page copies [(src page, dst page)]."""
        B = self.num_slots
        src, dst = np.full(B, B, np.int32), np.full(B, B, np.int32)
        page_src, page_dst = np.zeros(B, np.int32), np.full(B, -1, np.int32)
        for i, (s, d) in enumerate(rows):
            src[i], dst[i] = s, d
        for i, (s, d) in enumerate(copies):
            page_src[i], page_dst[i] = s, d
        self.state = self._dispatch(("fork",), (
            device_state.fork_rows, (self.state, src, dst, page_src, page_dst), {}))

    def apply(self, admitted: list, tables, forks: list = (), copies: list = ()) -> None:
        """A plan's state changes before its dispatch: admissions [(request, start)] with the
        block tables (None: unchanged), then forks with their page copies."""
        if admitted:
            self.admit(admitted, tables)
        else:
            self.set_tables(tables)
        if forks:
            self.fork(forks, copies)

    def set_tables(self, tables) -> None:
        if tables is not None:
            self.state = self._dispatch(("tables",), (device_state.set_block_tables,
                                                      (self.state, tables), {}))

    # ---- the flat step -----------------------------------------------------------------------

    def step(self, segments: list, sample_slots: list, next_tokens: Optional[list] = None,
             want_logprobs: bool = False, guides: Optional[dict] = None) -> StepResult:
        """One flat step: segments [(slot, token ids)] in batch order; sample_slots: the slots
        that sample a token from their last one; next_tokens: per segment the prompt token
        after each of its tokens (-1: none), when a row wants prompt logprobs; guides: slot ->
        structured.Guide of the constrained rows, whose masks are written before the dispatch."""
        total = sum(len(ids) for _, ids in segments)
        T = buckets.pick(self.token_buckets, total)
        batch = host_batch(T, self.num_slots, segments)
        S = min(self.num_slots, T)
        sample_rows = np.full(S, self.num_slots, np.int32)
        sample_rows[:len(sample_slots)] = sorted(sample_slots)
        allowed = self._fill_masks(sample_rows, guides)
        nxt = np.full(T, -1, np.int32)
        if next_tokens is not None:
            t = 0
            for (_, ids), after in zip(segments, next_tokens):
                nxt[t:t + len(after)] = after
                t += len(ids)
        out, self.state = self._step(batch, sample_rows, nxt, allowed)
        tokens, done, lp, prompt_lp = fetch((
            out.tokens, out.done, out.logprobs if want_logprobs else None,
            out.prompt_logprobs if next_tokens is not None else None))
        listed = [(i, int(s)) for i, s in enumerate(sample_rows) if s < self.num_slots]
        return StepResult(tokens={s: int(tokens[i]) for i, s in listed},
                          done={s: bool(done[i]) for i, s in listed},
                          logprobs={} if lp is None else
                          {s: tuple(x[i] for x in lp) for i, s in listed},
                          prompt_logprobs=prompt_lp)

    def _masks(self, rows: int) -> np.ndarray:
        """Packed token masks [rows, words] allowing every token (structured.fill_masks
        writes the constrained rows')."""
        return np.full((rows, mask_words(self.cfg.vocab_size)), ALL_TOKENS, np.int32)

    def _fill_masks(self, rows: np.ndarray, guides: Optional[dict]) -> np.ndarray:
        """The packed token masks of the listed rows [R] (slots; B: padding): each guided
        slot's from its guide, every other row's all ones."""
        allowed = self._masks(len(rows))
        if guides:
            t0 = time.perf_counter()
            fill_masks([(guides[s], i) for i, s in enumerate(rows.tolist()) if s in guides],
                       allowed)
            self.mask_s += time.perf_counter() - t0
        return allowed

    def _step_call(self, state, batch, sample_rows, next_tokens, allowed) -> tuple:
        """The flat step's program and arguments: (jitted, args, kwargs)."""
        return step_jit, (self.params, state, batch, sample_rows, next_tokens, allowed,
                          self.lora), dict(
            cfg=self.cfg, backend=self.backend, query_tile=self.query_tile,
            **self.draft_kw)

    def _step(self, batch, sample_rows, next_tokens, allowed):
        call = self._step_call(self.state, batch, sample_rows, next_tokens, allowed)
        return self._dispatch(("step", batch.tokens.shape[0]), call)

    def _dispatch(self, name: tuple, call: tuple):
        """Runs call = (jitted, args, kwargs) through the programs cache under `name`, which
        fixes every argument's shape, or by jit. The small state updates go through it too:
        JAX's cache skips programs that compile fast, yet they delay a warm first token."""
        fn, args, kw = call
        if self.programs is None:
            return fn(*args, **kw)
        return self.programs.get(name, call)(args, kw)

    # ---- multi-step decode ------------------------------------------------------------------

    def decode(self, slots: list, draft_on: Optional[np.ndarray], exit_on_stop: bool,
               guides: Optional[dict] = None):
        """One decode dispatch for the listed slots (guides: slot -> structured.Guide of the
        constrained ones; then the dispatch is one step). Returns (out [B, W], num_out [B],
        done [B], logprobs or None (fetched when asked), counts or None (without speculation))."""
        rows = np.full(buckets.pick(self.row_buckets, len(slots)), self.num_slots, np.int32)
        rows[:len(slots)] = slots
        allowed = self._fill_masks(rows, guides)
        call = self._loop_call(self.state, rows, draft_on, exit_on_stop, allowed)
        self.state, out, num_out, done, lp, counts = self._dispatch(("loop", len(rows)), call)
        counts = fetch(counts) if self.spec is not None else None
        return fetch((out, num_out, done)) + (lp, counts)

    def _loop_call(self, state, rows, draft_on, exit_on_stop: bool, allowed=None) -> tuple:
        """The decode loop's (jitted, args, kwargs); draft_on [B]: rows that may draft;
        allowed: the rows' packed token masks (all ones when None)."""
        allowed = self._masks(len(rows)) if allowed is None else allowed
        kw = dict(cfg=self.cfg, num_steps=self.engine_cfg.decode_steps, backend=self.backend,
                  exit_on_stop=np.bool_(exit_on_stop), **self.draft_kw)
        if self.spec is None:
            return decode_loop, (self.params, state, rows, None, allowed, self.lora), kw
        return decode_loop, (self.params, state, rows, draft_on, allowed, self.lora), dict(
            kw, num_draft=self.spec.num_draft_tokens, ngram_max=self.spec.ngram_max,
            ngram_min=self.spec.ngram_min)

    # ---- compilation -------------------------------------------------------------------------

    def num_programs(self) -> int:
        """The model programs warmup compiles: a flat step per token bucket, a decode loop per
        row bucket."""
        return len(self.token_buckets) + len(self.row_buckets)

    def warmup(self, tables) -> None:
        """Compiles and runs every program on an idle state, which they leave unchanged
        (tables: the paged cache's block tables, None for a ring)."""
        self.ensure_state()
        B = self.num_slots
        self.admit([], tables)
        self.set_tables(tables)
        self.fork([], [])
        if self.lora is not None:  # compiles the slot writer (slot 0 is empty at warmup)
            self.write_lora(0, None)
        # Compiled the largest first, then each run once in increasing size.
        self._compile_all(list(zip(self._model_names(), self._model_calls(self.state)))[::-1])
        for T in self.token_buckets:
            out, self.state = self._step(*self._idle_step_inputs(T))
        for R in self.row_buckets:
            call = self._loop_call(self.state, np.full(R, B, np.int32), np.zeros(B, bool), False)
            self.state, *_ = self._dispatch(("loop", R), call)
        jax.block_until_ready(self.state)

    def _idle_step_inputs(self, T: int) -> tuple:
        """A flat step of T tokens that no row owns (batch, sample_rows, next_tokens,
        allowed)."""
        B = self.num_slots
        return (host_batch(T, B, []), np.full(min(B, T), B, np.int32), np.full(T, -1, np.int32),
                self._masks(min(B, T)))

    def _model_calls(self, state) -> list:
        """Every model program as (jitted, args, kwargs) over `state`, in _model_names' order."""
        B = self.num_slots
        return ([self._step_call(state, *self._idle_step_inputs(T)) for T in self.token_buckets]
                + [self._loop_call(state, np.full(R, B, np.int32), np.zeros(B, bool), False)
                   for R in self.row_buckets])

    def _model_names(self) -> list:
        """The flat steps by token bucket, then the decode loops by row bucket."""
        return [("step", T) for T in self.token_buckets] + [("loop", R) for R in self.row_buckets]

    def _compile_all(self, calls: list) -> None:
        """Compiles (or loads) calls [(name, (jitted, args, kwargs))] on up to COMPILE_THREADS
        threads: one XLA compile leaves cores idle and releases the GIL."""
        def compile_one(named_call):
            name, (fn, args, kw) = named_call
            if self.programs is not None:
                self.programs.get(name, (fn, args, kw), run=False)
                return
            with self.on_mesh():  # the mesh context is per thread
                fn.lower(*args, **kw).compile()

        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            (os.cpu_count() or 1)
        env = os.environ.get("JAXINFER_COMPILE_THREADS") or str(COMPILE_THREADS)
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"JAXINFER_COMPILE_THREADS must be a whole number >= 1, got {env!r}")
        wanted = int(env)
        threads = min(len(calls), wanted, cpus)
        if threads < 2:
            return  # the calls themselves compile
        with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(compile_one, calls))

    def step_scratch_bytes(self) -> int:
        """XLA's scratch bytes of the largest flat step and decode loop (compiled abstractly)."""
        calls = self._model_calls(jax.eval_shape(self.new_state))
        biggest = [calls[len(self.token_buckets) - 1], calls[-1]]
        return max(fn.lower(*args, **kw).compile().memory_analysis().temp_size_in_bytes
                   for fn, args, kw in biggest)
