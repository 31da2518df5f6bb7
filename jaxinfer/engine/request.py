"""Host-side request objects: SamplingParams, RequestOutput, RequestMetrics."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Union

import numpy as np

from jaxinfer.structured.grammar import StructuredOutputs
from jaxinfer.user_input import check_text, show


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to generate for one request. Validates in the constructor.

    max_tokens: most tokens to generate (>= 1). temperature: 0 = greedy. top_k: 0 = off.
    top_p in (0, 1]. min_p in [0, 1). repetition_penalty > 0 (1 = off). seed: reproducible
    sampling (token i depends on (seed, i) alone). stop: strings that end generation (not
    included in the text). ignore_eos: keep going past EOS. logprobs / prompt_logprobs: top-k
    log-probabilities per generated / prompt token. n: sequences sampled from the prompt, which
    is prefilled once (sequence i draws with seed + i; see docs/api.md). structured_outputs:
    the output must match a JSON schema, regex, choice or grammar (docs/structured_outputs.md).
    token_logprobs: each output also carries, as float32 arrays, every sampled token's
    log-probability under the distribution it was drawn from (sampling_logprobs) and under the
    raw model at temperature 1 (model_logprobs) (docs/rl.md).
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    stop: Optional[Union[str, Sequence[str]]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    n: int = 1
    structured_outputs: Optional[StructuredOutputs] = None
    token_logprobs: bool = False

    def __post_init__(self):
        def number(name, integer=False):
            v = getattr(self, name)
            ok = isinstance(v, int) if integer else isinstance(v, (int, float))
            if isinstance(v, bool) or not ok or (not integer and not math.isfinite(v)):
                kind = "an int" if integer else "a finite number"
                raise ValueError(f"SamplingParams.{name} must be {kind}, got {v!r}")
            return v

        if number("n", integer=True) < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if number("max_tokens", integer=True) < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if number("temperature") < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if number("top_k", integer=True) < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < number("top_p") <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= number("min_p") < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if number("repetition_penalty") <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise ValueError(f"seed must be an int or None, got {self.seed!r}")
            if not 0 <= self.seed < 2**32:
                raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        stops = self.stop_strings
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of them, got "
                             f"{show(self.stop)}")
        for i, s in enumerate(stops):
            check_text(s, f"stop[{i}]")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be None or an int >= 0, got {v!r}")
        if not isinstance(self.token_logprobs, bool):
            raise ValueError(f"token_logprobs must be a bool, got {self.token_logprobs!r}")
        if self.structured_outputs is not None and \
                not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError("structured_outputs must be None or a ji.StructuredOutputs, got "
                             f"{type(self.structured_outputs).__name__}")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        if isinstance(self.stop, str):
            return (self.stop,)
        return tuple(self.stop)


@dataclasses.dataclass
class RequestMetrics:
    """Per-request timings (seconds, wall clock) and counts."""

    arrival_time: float = 0.0
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    prefix_cache_hit_tokens: int = 0  # prompt tokens served from the prefix cache (admissions)
    spec_steps: int = 0       # speculative verification steps in which the request had drafts
    draft_tokens: int = 0     # tokens proposed for it
    accepted_tokens: int = 0  # proposals accepted (each saved a target step)
    token_times: list = dataclasses.field(default_factory=list, repr=False)

    @property
    def queue_time_s(self) -> Optional[float]:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> Optional[float]:
        """Arrival to first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def itl_s(self) -> Optional[float]:
        """Mean inter-token latency over the tokens after the first."""
        if self.generated_tokens < 2 or self.finished_time is None:
            return None
        return (self.token_times[-1] - self.first_token_time) / (self.generated_tokens - 1)

    @property
    def decode_tokens_per_s(self) -> Optional[float]:
        itl = self.itl_s
        return None if not itl else 1.0 / itl

    @property
    def acceptance_rate(self) -> Optional[float]:
        """Accepted / proposed draft tokens (None before any proposal)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_accepted_tokens(self) -> Optional[float]:
        """Accepted draft tokens per verification step (each step also emits one token of the
        target's own)."""
        return self.accepted_tokens / self.spec_steps if self.spec_steps else None

    @property
    def e2e_s(self) -> Optional[float]:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclasses.dataclass
class CompletionOutput:
    """One sequence of a request: sequence `index` of its n."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]  # "stop" | "length" | "abort" | "error" | None while running
    logprobs: Optional[list] = None
    # The stop id (EOS) that ended the output, which token_ids and text leave out; None when
    # something else ended it (a stop string, max_tokens) or while running.
    stop_token_id: Optional[int] = None
    # With SamplingParams.token_logprobs, per sampled token (float32): the log-probability
    # under the distribution it was drawn from, and under the raw model. They cover
    # token_ids + [stop_token_id] (one more entry than token_ids when a stop id ended it): a
    # trainer learns when to stop from that last token.
    sampling_logprobs: Optional[np.ndarray] = None
    model_logprobs: Optional[np.ndarray] = None
    # The weight version (LLM.weight_version) each run of tokens was sampled under: pairs
    # (index of the run's first token, version); one pair unless update_weights(mode="keep")
    # swapped weights under the running sequence.
    weight_versions: list = dataclasses.field(default_factory=list)

    @property
    def weight_version(self) -> Optional[int]:
        """The version its newest token was sampled under (None before the first token)."""
        return self.weight_versions[-1][1] if self.weight_versions else None


@dataclasses.dataclass
class RequestOutput:
    """A request's state. text, token_ids, logprobs and finish_reason are sequence 0's (the
    only one when n = 1); `outputs` holds all n sequences in index order. With n > 1,
    finish_reason stays None until every sequence has finished."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]  # "stop" | "length" | "abort" | "error" | None while running
    metrics: RequestMetrics
    logprobs: Optional[list] = None
    prompt_logprobs: Optional[list] = None
    outputs: list = dataclasses.field(default_factory=list)  # [CompletionOutput] * n

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def weight_version(self) -> Optional[int]:
        """Sequence 0's CompletionOutput.weight_version."""
        return self.outputs[0].weight_version if self.outputs else None
