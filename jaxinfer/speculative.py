"""Speculative decoding configuration (the drafters and verification are not implemented yet)."""

from __future__ import annotations

import dataclasses
from typing import Optional

_METHODS = ("ngram", "draft")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"            # "ngram" | "draft"
    num_draft_tokens: int = 4
    draft_model: Optional[str] = None
    ngram_max: int = 3

    def __post_init__(self):
        if self.method not in _METHODS:
            raise ValueError(f"SpeculativeConfig.method must be one of {_METHODS}, "
                             f"got {self.method!r}")
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be an int >= 1, got {self.num_draft_tokens!r}")
        if not isinstance(self.ngram_max, int) or self.ngram_max < 1:
            raise ValueError(f"ngram_max must be an int >= 1, got {self.ngram_max!r}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("method 'draft' needs draft_model (an alias or a path)")
