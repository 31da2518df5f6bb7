"""SequenceState: the host's record of one sequence of a request (its tokens, stop
conditions, stream, log-probabilities, weight versions) and the outputs built from it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from jaxinfer.engine import draft_policy
from jaxinfer.engine.request import (CompletionOutput, RequestMetrics, RequestOutput,
                                     SamplingParams)
from jaxinfer.engine.textstream import TextStream


@dataclasses.dataclass(eq=False)
class SequenceState:
    """One sequence of a request: the request's only one (n = 1), or sequence `index` of its
    group. Sequences of a group share request_id, metrics and the prompt's pages."""

    request_id: str
    prompt: Optional[str]
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_new: int
    stream: TextStream
    metrics: RequestMetrics
    slot: Optional[int] = None
    prefill_ids: list[int] = dataclasses.field(default_factory=list)  # prompt (+ recomputed)
    prefilled: int = 0         # tokens of prefill_ids in the cache
    admitted_order: int = -1   # admission counter: the newest running request is preempted first
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None
    logprobs: Optional[list] = None         # per generated token {token_id: logprob}
    prompt_logprobs: Optional[list] = None  # per prompt token (the first is None)
    spec_resume_at: int = 0          # drafting is paused until this many tokens are generated
    spec_pause: int = draft_policy.SPEC_PAUSE_TOKENS
    spec_window: tuple[int, int] = (0, 0)  # (steps, accepted) since the last judgement
    index: int = 0             # sequence index within the request (n > 1)
    group: list = dataclasses.field(default_factory=list)   # every sequence, index order
    # Fork (n > 1): sequence 0 prefills the prompt once; the others wait in their slots until
    # it has all but the last prompt token in the cache, then share those pages.
    forks: list = dataclasses.field(default_factory=list)   # sequence 0: sequences waiting
    waiting_fork: bool = False                               # a sequence waiting for its fork
    guide: Optional[Any] = None  # structured.Guide: the grammar its output must match
    lora: Optional[str] = None   # the LoRA adapter it runs under (None: the base model)
    lora_slot: int = -1          # that adapter's device slot while the sequence is admitted
    cache_namespace: bytes = b""  # prefix-cache namespace (its adapter's)
    sampling_lps: Optional[list] = None  # token_logprobs: per token, under the sampling law
    model_lps: Optional[list] = None     # and under the raw model
    versions: list = dataclasses.field(default_factory=list)  # [(first token, weight version)]
    stop_token_id: Optional[int] = None  # the stop id that ended it (not in token_ids)

    def __post_init__(self):
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        if self.params.token_logprobs:
            self.sampling_lps, self.model_lps = [], []
        if not self.group:
            self.group = [self]

    @property
    def seq_id(self):
        """This sequence's key in the page allocator."""
        return self.request_id if self.index == 0 else (self.request_id, self.index)

    @property
    def fork_at(self) -> int:
        """Prompt tokens sequence 0 prefills before its group forks (all but the last)."""
        return len(self.prompt_ids) - 1

    @property
    def wants_logprobs(self) -> bool:
        """Whether its steps fetch log-probabilities (top-k dicts or token_logprobs)."""
        return self.logprobs is not None or self.sampling_lps is not None

    def completion(self) -> CompletionOutput:
        arrays = lambda x: None if x is None else np.asarray(x, np.float32)  # noqa: E731
        return CompletionOutput(index=self.index, text=self.stream.text,
                                token_ids=list(self.token_ids), finish_reason=self.finish_reason,
                                logprobs=None if self.logprobs is None else list(self.logprobs),
                                sampling_logprobs=arrays(self.sampling_lps),
                                model_logprobs=arrays(self.model_lps),
                                weight_versions=list(self.versions),
                                stop_token_id=self.stop_token_id)

    def output(self) -> RequestOutput:
        """The whole request's output (every sequence of the group)."""
        first = self.group[0]
        outputs = [r.completion() for r in self.group]
        done = all(o.finish_reason is not None for o in outputs)
        return RequestOutput(request_id=first.request_id, prompt=first.prompt,
                             prompt_token_ids=list(first.prompt_ids), text=outputs[0].text,
                             token_ids=outputs[0].token_ids,
                             finish_reason=outputs[0].finish_reason if done else None,
                             metrics=first.metrics, logprobs=outputs[0].logprobs,
                             prompt_logprobs=None if first.prompt_logprobs is None
                             else list(first.prompt_logprobs), outputs=outputs)


def logprob_dict(k: int, ids, values, token: int, chosen: float) -> dict[int, float]:
    """The top k entries plus the token itself, as vLLM reports them."""
    out = {int(i): float(v) for i, v in zip(ids[:k], values[:k])}
    out[int(token)] = float(chosen)
    return out
