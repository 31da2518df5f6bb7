"""The public entry point, `LLM`: checks every argument before any device work, loads the
model, and drives the host engine for generate / chat / stream and the request-level API.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import os
import secrets
import threading
import time
from typing import Iterator, Optional, Sequence, Union

import jax
import jax.numpy as jnp

from jaxinfer import backends, quant, sharding
from jaxinfer.config import EngineConfig, MeshConfig, SpeculativeConfig
from jaxinfer.engine import memory, programs
from jaxinfer.engine.engine import Engine, SequenceState
from jaxinfer.engine.slot_pages import PagedSlots
from jaxinfer.engine.request import RequestMetrics, RequestOutput, SamplingParams
from jaxinfer.engine.textstream import TextStream
from jaxinfer.device.kv_cache import KV_DTYPES, ring_capacity
from jaxinfer.models import get_model
from jaxinfer.device.sampling import MAX_LOGPROBS
from jaxinfer.structured import Grammars
from jaxinfer.lora.llm_api import LoraAPI
from jaxinfer.trainer_sampler import TrainerSampler
from jaxinfer.user_input import check_text


@dataclasses.dataclass(frozen=True)
class EncodedPrompt:
    """A prompt tokenized and checked by LLM.encode_prompt (e.g. on a server's worker thread);
    add_request takes it as it is."""

    text: Optional[str]       # the prompt's text; None when it was given as token ids
    token_ids: tuple[int, ...]


Prompt = Union[str, Sequence[int], EncodedPrompt]
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def enable_compilation_cache() -> Optional[str]:
    """Turns on JAX's persistent compilation cache under the jaxinfer cache directory unless one
    is configured; JAXINFER_COMPILATION_CACHE=0 turns it off, another value is the directory."""
    from jaxinfer.loading.hub import cache_dir

    setting = os.environ.get("JAXINFER_COMPILATION_CACHE")
    if setting == "0":
        return None
    if jax.process_count() > 1:
        # Off in multi-process runs: a program one process loaded from it ran its collectives
        # in another order than the same program compiled fresh in another.
        return None
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    path = setting or os.path.join(cache_dir(), "xla")
    jax.config.update("jax_compilation_cache_dir", path)
    # Cache everything that took noticeable time to compile, not only the slowest programs.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    return path


class LLM(LoraAPI, TrainerSampler):
    """A model ready to generate. See the README for the arguments; each is checked here."""

    def __init__(self, model: str = "smollm2-135m", *, dtype: Optional[str] = None,
                 max_seq_len: Optional[int] = None, max_num_seqs: int = 16, page_size: int = 16,
                 num_pages: Optional[int] = None, quantization: Optional[str] = None,
                 kv_cache_dtype: Optional[str] = None, speculative=None,
                 mesh: Union[MeshConfig, jax.sharding.Mesh, None] = None,
                 mesh_axes: Optional[dict] = None, attention: str = "auto",
                 prefill_chunk: int = 128, decode_steps: int = 8,
                 max_num_batched_tokens: int = 512, hybrid_kv_cache: bool = True,
                 max_loras: int = 0, max_lora_rank: int = 16,
                 max_cpu_loras: Optional[int] = None):
        # Before anything starts a jax backend: XLA reads its flags once, when the first starts.
        backends.set_xla_flags()
        if quantization is not None and quantization not in quant.MODES:
            raise ValueError(f"quantization must be None or one of {quant.MODES}, got "
                             f"{quantization!r}")
        if kv_cache_dtype is not None and kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be None or one of {tuple(KV_DTYPES)}, got "
                             f"{kv_cache_dtype!r}")
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise ValueError(f"speculative must be a ji.SpeculativeConfig, got "
                             f"{type(speculative).__name__}")
        partitioner = None
        if mesh_axes is not None and not isinstance(mesh, jax.sharding.Mesh):
            raise ValueError("mesh_axes maps the axes of a jax.sharding.Mesh passed as mesh")
        if mesh is not None:
            view = None
            if isinstance(mesh, jax.sharding.Mesh):  # the caller's devices, our axis names
                view = sharding.view_mesh(mesh, mesh_axes)
                mesh = MeshConfig(**{a: int(view.shape[a]) for a in sharding.MESH_AXES})
            elif not isinstance(mesh, MeshConfig):
                raise ValueError(f"mesh must be a ji.MeshConfig or a jax.sharding.Mesh, got "
                                 f"{type(mesh).__name__}")
            if isinstance(max_num_seqs, int) and max_num_seqs % mesh.data:
                raise ValueError(f"max_num_seqs {max_num_seqs} is not a multiple of the data "
                                 f"degree {mesh.data} (each replica decodes its share of rows)")
            if (mesh.data, mesh.tensor, mesh.sequence) != (1, 1, 1):
                partitioner = sharding.Partitioner(view if view is not None
                                                   else sharding.make_mesh(mesh))
        if attention not in backends.ATTENTION:
            raise ValueError(f"attention must be one of {backends.ATTENTION}, got "
                             f"{attention!r}")
        dtype = dtype or os.environ.get("JAXINFER_DEFAULT_DTYPE") or backends.default_dtype()
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        for name, v, lo in (("max_num_seqs", max_num_seqs, 1), ("prefill_chunk", prefill_chunk, 1),
                            ("decode_steps", decode_steps, 1), ("page_size", page_size, 1),
                            ("max_num_batched_tokens", max_num_batched_tokens,
                             min(16, prefill_chunk if isinstance(prefill_chunk, int) else 16))):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        if not isinstance(hybrid_kv_cache, bool):
            raise ValueError(f"hybrid_kv_cache must be a bool, got {hybrid_kv_cache!r}")
        for name, v, lo in (("max_loras", max_loras, 0), ("max_lora_rank", max_lora_rank, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        if max_cpu_loras is not None and (isinstance(max_cpu_loras, bool) or not isinstance(
                max_cpu_loras, int) or max_cpu_loras < max(max_loras, 1)):
            raise ValueError(f"max_cpu_loras must be None or an int >= max_loras "
                             f"({max(max_loras, 1)}), got {max_cpu_loras!r}")
        if max_seq_len is not None and (isinstance(max_seq_len, bool)
                                        or not isinstance(max_seq_len, int) or max_seq_len < 2):
            raise ValueError(f"max_seq_len must be an int >= 2, got {max_seq_len!r}")

        from jaxinfer.loading import load_model

        enable_compilation_cache()
        # Resolved before the programs cache loads programs: it registers the kernels they call.
        backends.resolve(attention)
        # The programs an LLM of these arguments ran first load beside the weights.
        program_root = programs.directory() if partitioner is None else None
        program_index = None
        if program_root is not None:
            program_index = programs.startup_key(
                (model, dtype, max_seq_len, max_num_seqs, page_size, num_pages, quantization,
                 kv_cache_dtype, speculative, attention, prefill_chunk, decode_steps,
                 max_num_batched_tokens, hybrid_kv_cache, max_loras, max_lora_rank))
            programs.prefetch(program_root, program_index)
        loaded = load_model(model, dtype=_DTYPES[dtype], partitioner=partitioner,
                            quantization=quantization)
        cfg, params = loaded.config, loaded.params
        # Where 16-bit elementwise work is slow, a 16-bit dtype is the weights' and the KV
        # cache's while activations stay float32.
        self.backend = backends.resolve(attention, head_dim=cfg.head_dim)
        act_dtype = self.backend.activation_dtype(_DTYPES[dtype])
        weights_only = act_dtype != _DTYPES[dtype]
        if weights_only:
            params = get_model(cfg.architecture).with_float32_activations(params)
        draft = None
        if speculative is not None and speculative.method == "draft":
            drafter = load_model(speculative.draft_model, dtype=_DTYPES[dtype],
                                 partitioner=partitioner)
            if drafter.config.vocab_size != cfg.vocab_size:
                raise ValueError(
                    f"draft_model {speculative.draft_model!r} has a vocabulary of "
                    f"{drafter.config.vocab_size} tokens; the target's has {cfg.vocab_size} "
                    "(a draft must share the target's vocabulary)")
            drafter_model = get_model(drafter.config.architecture)
            draft = (drafter_model.with_float32_activations(drafter.params) if weights_only
                     else drafter.params, drafter.config)
        limit = cfg.max_position_embeddings
        if max_seq_len is None:
            max_seq_len = min(limit, 2048)
        elif max_seq_len > limit:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's context length "
                             f"{limit}")
        self.model_config = cfg
        self.tokenizer = loaded.tokenizer
        self.max_seq_len = max_seq_len
        self.max_num_seqs = max_num_seqs
        self.dtype = dtype
        # A sliding-window ring holds the window plus the most tokens a row writes in one step.
        extra = speculative.num_draft_tokens if speculative is not None else 0
        per_step = max(min(prefill_chunk, max_num_batched_tokens), extra + 1)
        capacity = max_seq_len if cfg.sliding_window is None else min(
            max_seq_len, ring_capacity(cfg.sliding_window, per_step))
        ring = memory.local_ring_capacity(cfg, max_seq_len, per_step, page_size) \
            if hybrid_kv_cache else 0
        paged, memory_left = None, None
        pool_split = mesh.data * mesh.sequence if partitioner is not None else 1
        data = mesh.data if partitioner is not None else 1
        if cfg.sliding_window is None:
            per_request = -(-max_seq_len // page_size)
            if num_pages is None:
                memory_left = memory.free_device_memory()
                # Sized below from device memory, else every slot at max_seq_len + null page.
                num_pages = data * (per_request + 1) if memory_left \
                    else max_num_seqs * per_request + 1
                num_pages = -(-num_pages // pool_split) * pool_split
            elif isinstance(num_pages, bool) or not isinstance(num_pages, int) \
                    or num_pages < data * (per_request + 1):
                per = " per data replica" if data > 1 else ""
                raise ValueError(
                    f"num_pages={num_pages!r} cannot hold one max_seq_len ({max_seq_len}) "
                    f"request{per}: it needs {per_request} pages of {page_size} tokens plus the "
                    f"null page, so num_pages >= {data * (per_request + 1)}")
            elif num_pages % pool_split:
                raise ValueError(f"num_pages {num_pages} is not a multiple of data * sequence "
                                 f"= {pool_split}, the devices the page pool is split over")
            # No prefix cache with a draft model (its cache is not paged) or a ring of local
            # layers (a cached prefix's keys would be the global layers' only).
            paged = PagedSlots(num_pages, page_size, max_seq_len,
                               enable_prefix_caching=draft is None and not ring,
                               num_partitions=data)
        elif num_pages is not None:
            raise NotImplementedError("num_pages: a model whose every layer has a sliding "
                                      "window runs on the ring-buffer cache; the paged cache "
                                      "serves layers with full attention only")
        self.engine_config = EngineConfig(max_seq_len=max_seq_len, max_num_seqs=max_num_seqs,
                                          prefill_chunk=prefill_chunk, decode_steps=decode_steps,
                                          max_num_batched_tokens=max_num_batched_tokens,
                                          dtype=dtype, attention=self.backend.attention,
                                          speculative=speculative)
        self._engine = Engine(cfg, params, loaded.tokenizer, self.engine_config,
                              capacity=capacity, dtype=act_dtype, paged=paged,
                              num_pages=num_pages or 0, draft=draft, partitioner=partitioner,
                              kv_dtype=KV_DTYPES.get(kv_cache_dtype, _DTYPES[dtype]),
                              ring_capacity=ring, program_index=program_index,
                              backend=self.backend,
                              lora=None if not max_loras else dict(
                                  max_loras=max_loras, max_lora_rank=max_lora_rank,
                                  max_cpu_loras=max_cpu_loras))
        if memory_left:
            self._engine.set_num_pages(memory.pages_from_memory(
                self._engine, memory_left, max_num_seqs, max_seq_len, page_size))
        self._data_degree = data
        self.quantization = quantization
        self._grammars: Optional[Grammars] = None
        self._grammars_lock = threading.Lock()
        self._ids = itertools.count()
        self._requests: dict[str, SequenceState] = {}

    @property
    def max_n(self) -> int:
        """The most sequences one request may hold (SamplingParams.n, beam_width): the slots
        of one data replica."""
        return self.max_num_seqs // self._data_degree

    # ---- validation --------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt) -> EncodedPrompt:
        """Tokenizes and checks a prompt without touching the engine: safe from any thread."""
        if isinstance(prompt, EncodedPrompt):
            return EncodedPrompt(prompt.text, tuple(self._check_ids(list(prompt.token_ids))))
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompts as lists of token ids")
            check_text(prompt, "prompt")
            bound = self.tokenizer.max_chars_per_token
            if bound is not None and len(prompt) >= self.max_seq_len * bound:
                # No need to tokenize: no token spans more than `bound` characters.
                raise ValueError(f"prompt has {len(prompt)} characters, at least "
                                 f"{len(prompt) // bound} tokens; max_seq_len is "
                                 f"{self.max_seq_len} (the prompt must leave room for at least "
                                 "one generated token)")
            return EncodedPrompt(prompt, tuple(self._check_ids(self.tokenizer.encode(prompt))))
        try:  # operator.index: ints (numpy ones too), never a float rounded to an id
            ids = [operator.index(t) for t in prompt]
        except TypeError:
            raise ValueError(f"a prompt must be a str or a sequence of integer token ids, "
                             f"got {type(prompt).__name__}") from None
        return EncodedPrompt(None, tuple(self._check_ids(ids)))

    def _check_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise ValueError("prompt is empty (0 tokens)")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_seq_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_seq_len is {self.max_seq_len} "
                             "(the prompt must leave room for at least one generated token)")
        return ids

    @property
    def grammars(self) -> Grammars:
        """The checked grammars of structured outputs for this model's tokenizer."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.model_config.vocab_size,
                                          self._engine.eos_ids)
            return self._grammars

    def check_structured(self, params: SamplingParams) -> Optional[str]:
        """params' structured-output grammar, checked and cached (None without one); a
        ValueError names what is wrong. Safe from any thread (the server calls it off the
        engine thread, so that the engine's own call finds it cached)."""
        if params.structured_outputs is None:
            return None
        return self.grammars.compile(params.structured_outputs)

    def _make_request(self, prompt: Prompt, params: SamplingParams,
                      request_id: Optional[str] = None,
                      lora: Optional[str] = None, seed: Optional[int] = None) -> SequenceState:
        self._check_awake()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        if lora is not None and lora not in self._loras().adapters:
            raise ValueError(f"no LoRA adapter named {lora!r} is loaded")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > MAX_LOGPROBS:
                raise ValueError(f"{name}={k} exceeds the limit of {MAX_LOGPROBS}")
        if params.n > self.max_n:
            raise ValueError(f"n={params.n} exceeds the {self.max_n} sequences one request may "
                             "hold (max_num_seqs per data replica)")
        grammar = self.check_structured(params)
        encoded = self.encode_prompt(prompt)
        text, ids = encoded.text, list(encoded.token_ids)
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in self._requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        if seed is None:
            seed = params.seed if params.seed is not None else secrets.randbits(32)
        metrics = RequestMetrics(arrival_time=time.perf_counter(), prompt_tokens=len(ids))
        # Sequence i of a request draws with seed + i: alone it equals a request of that seed.
        group = [SequenceState(request_id=rid, prompt=text, prompt_ids=ids, params=params,
                               seed=(seed + i) % 2**32,
                               max_new=min(params.max_tokens, self.max_seq_len - len(ids)),
                               stream=TextStream(self.tokenizer, params.stop_strings),
                               metrics=metrics, index=i,
                               guide=None if grammar is None else self.grammars.guide(grammar),
                               lora=lora, cache_namespace=b"" if lora is None
                               else self._engine.loras.salt(lora))
                 for i in range(params.n)]
        for req in group:
            req.group = group
        group[0].forks = group[1:]
        return group[0]

    # ---- request-level API -------------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None, lora: Optional[str] = None) -> str:
        """Queues a request (under LoRA adapter `lora`, None: the base model); returns its
        id."""
        req = self._make_request(prompt, params or SamplingParams(), request_id, lora)
        self._requests[req.request_id] = req
        self._engine.add(req)
        return req.request_id

    def step(self) -> list[RequestOutput]:
        """One scheduling step: RequestOutputs of the requests that progressed."""
        outs = []
        for req in {r.request_id: r.group[0] for r in self._engine.step()}.values():
            out = req.output()
            outs.append(out)
            if out.finished:
                self._requests.pop(req.request_id, None)
        return outs

    def abort(self, request_id: str) -> None:
        self._engine.abort(str(request_id))
        self._requests.pop(str(request_id), None)

    def has_unfinished_requests(self) -> bool:
        return self._engine.has_unfinished()

    # ---- batch API ---------------------------------------------------------------------------

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 lora: Union[str, Sequence[Optional[str]], None] = None
                 ) -> list[RequestOutput]:
        """Generates for each prompt (str: encoded as is; list[int]: token ids), under LoRA
        adapter `lora` (a name for every prompt, or one per prompt; None: the base model).
        Outputs come back in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            return []
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA names for {len(prompts)} prompts")
        # Validate every request before any of them touches the device.
        reqs = [self._make_request(p, sp, lora=a) for p, sp, a in zip(prompts, params, loras)]
        for req in reqs:
            self._requests[req.request_id] = req
            self._engine.add(req)
        pending = {r.request_id for r in reqs}
        try:
            while pending:
                for out in self.step():
                    if out.finished:
                        pending.discard(out.request_id)
        except BaseException:
            for rid in pending:
                self.abort(rid)
            raise
        return [r.output() for r in reqs]

    def chat(self, messages, params: Optional[SamplingParams] = None,
             lora: Optional[str] = None):
        """One conversation (a list of {"role", "content"} dicts) -> one RequestOutput; a list of
        conversations -> a list of them."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot chat")
        single = bool(messages) and isinstance(messages[0], dict)
        convs = [messages] if single else list(messages)
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in convs]
        outs = self.generate(texts, params, lora)
        return outs[0] if single else outs

    def stream(self, prompt: Prompt, params: Optional[SamplingParams] = None,
               lora: Optional[str] = None) -> Iterator[str]:
        """Yields text deltas as they are produced; closing the generator aborts the request.
        One sequence (n = 1); add_request and step serve n > 1."""
        if params is not None and params.n != 1:
            raise ValueError(f"stream() yields one sequence, got n={params.n}; use "
                             "add_request() and step() for n > 1")
        rid = self.add_request(prompt, params, lora=lora)
        req = self._requests[rid]
        try:
            while req.finish_reason is None:
                self.step()
                delta = req.stream.pop_delta()
                if delta:
                    yield delta
            delta = req.stream.pop_delta()
            if delta:
                yield delta
        finally:
            if req.finish_reason is None:
                self.abort(rid)

    def beam_search(self, prompts: Union[Prompt, Sequence[Prompt]], params=None) -> list:
        """A BeamSearchOutput per prompt, in order, its sequences best first (params: a
        BeamSearchParams). Needs an engine with no unfinished requests."""
        from jaxinfer.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams

        params = params or BeamSearchParams()
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"expected BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        encoded = [(e.text, list(e.token_ids)) for e in map(self.encode_prompt, prompts)]
        per_replica = self.max_n
        if params.beam_width > per_replica:
            raise ValueError(f"beam_width {params.beam_width} exceeds the {per_replica} slots "
                             "of a data replica (max_num_seqs)")
        self._check_awake()
        if self.has_unfinished_requests():
            raise RuntimeError("beam_search() needs an engine with no unfinished requests")
        at_once = self._data_degree * (per_replica // params.beam_width)
        out = []
        with self._engine.runner.on_mesh():
            self._engine.runner.ensure_state()
            for i in range(0, len(encoded), at_once):
                part = encoded[i:i + at_once]
                beams = BeamSearch(self, params).search([ids for _, ids in part])
                out += [BeamSearchOutput(prompt=text, prompt_token_ids=ids, sequences=seqs)
                        for (text, ids), seqs in zip(part, beams)]
        return out

    # ---- engine ------------------------------------------------------------------------------

    def warmup(self) -> float:
        """Compiles every shape the engine can use; returns the seconds it took."""
        return self._engine.warmup()

    def describe(self) -> dict:
        """Which implementation each op of the step uses on this platform (Backend.describe)."""
        return self.backend.describe()

    def stats(self) -> dict:
        """Counters and sizes of the engine (docs/api.md, Statistics)."""
        out = self._engine.stats()
        if self._grammars is not None:
            out.update(self._grammars.stats())
        return out

    @property
    def params(self):
        """The weights as placed on the device(s), the pytree every step reads; read-only."""
        return self._engine.params
