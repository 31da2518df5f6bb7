"""Structured outputs: decoding constrained to a JSON schema, a regex, a choice of strings or a
context-free grammar, by the llguidance grammar engine (docs/structured_outputs.md).

`StructuredOutputs` says what a request's output must match (SamplingParams.structured_outputs).
`Grammars` turns it into an llguidance grammar for one tokenizer, checked and cached; a `Guide`
follows one sequence through it and writes the packed bitmask of the tokens allowed next, which
the jitted sampler applies (jaxinfer.device.sampling.apply_token_mask).
"""

from jaxinfer.structured.grammar import (MAX_CHOICES, MAX_SPEC_CHARS, Grammars, Guide,
                                         StructuredOutputs, fill_masks, mask_words)

__all__ = ["StructuredOutputs", "Grammars", "Guide", "fill_masks", "mask_words",
           "MAX_SPEC_CHARS", "MAX_CHOICES"]
