"""What a constrained request's output must match, its llguidance grammar, and the per-sequence
matcher that writes the packed mask of allowed tokens.

llguidance (Rust, the engine vLLM, SGLang and sglang-jax ship) does the parsing: JSON schema,
regex, choice, Lark and GBNF grammars all compile to one grammar form; a matcher computes the
allowed next tokens of a sequence as one bit per vocabulary entry in about 0.02-0.2 ms, and
refuses schema keywords it cannot enforce (uniqueItems, not, if/then, ...) rather than ignoring
them. docs/structured_outputs.md says why it over xgrammar.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
from typing import Any, Optional, Sequence, Union

import numpy as np

from jaxinfer.user_input import check_text, check_tree, loads_json, show

# Limits on what a request may ask for, checked before any grammar work: the longest schema
# (serialized), regex or grammar text, and the most strings a choice may list.
MAX_SPEC_CHARS = 1 << 20
MAX_CHOICES = 1024
# Checked grammars kept per tokenizer (the same schema again skips the check, ~0.5-50 ms).
CACHE_ENTRIES = 256
# JSON's whitespace between tokens: pretty-printing up to deep indentation, yet bounded, so a
# model cannot fill its token budget with blank lines (small models do). A schema's own
# "x-guidance" options override it; disable_any_whitespace allows none.
JSON_WHITESPACE = r"[ \t\n\r]{0,24}"
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """The output must match exactly one of: `json` a JSON schema (a dict, True, or its JSON
    text); `json_object` any JSON object; `regex` a regular expression (Rust regex syntax, the
    whole output matches); `choice` one of a list of strings; `grammar` a context-free grammar
    in Lark or GBNF syntax (llguidance's dialect). JSON allows at most 24 whitespace characters
    between tokens (none with disable_any_whitespace, as vLLM's option). Checked here for shape
    and size; the grammar itself is checked against the model's tokenizer when the request is
    made."""

    json: Optional[Union[dict, bool, str]] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[Sequence[str]] = None
    grammar: Optional[str] = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        given = [k for k in KINDS if (getattr(self, k) is not None if k != "json_object"
                                      else self.json_object is not False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {KINDS}, got "
                             f"{given or 'none'}")
        kind = given[0]
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be a boolean, got "
                             f"{show(self.disable_any_whitespace)}")
        if kind == "json_object" and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be true, got "
                             f"{show(self.json_object)}")
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                schema = loads_json(schema.encode("utf-8"), "structured_outputs.json")
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object or "
                                 f"a boolean), got {show(self.json)}")
            check_tree(schema, "structured_outputs.json")
            object.__setattr__(self, "json", schema)
        if kind in ("regex", "grammar"):
            text = getattr(self, kind)
            if not isinstance(text, str) or not text:
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got "
                                 f"{show(text)}")
            check_text(text, f"structured_outputs.{kind}")
        if kind == "choice":
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice \
                    or not all(isinstance(c, str) and c for c in choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of "
                                 f"non-empty strings, got {show(choice)}")
            if len(choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice has {len(choice)} strings; the "
                                 f"limit is {MAX_CHOICES}")
            for i, c in enumerate(choice):
                check_text(c, f"structured_outputs.choice[{i}]")
            object.__setattr__(self, "choice", tuple(choice))
        size = len(self.source())
        if size > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{kind} has {size} characters; the limit is "
                             f"{MAX_SPEC_CHARS}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if (getattr(self, k) is not None if k != "json_object"
                                          else self.json_object))

    def source(self) -> str:
        """The constraint as text (a schema serialized canonically): the cache key's body."""
        kind = self.kind
        if kind == "json":
            return json.dumps(self.json, sort_keys=True, ensure_ascii=False)
        if kind == "json_object":
            return ""
        if kind == "choice":
            return json.dumps(list(self.choice), ensure_ascii=False)
        return getattr(self, kind)

    def llguidance_grammar(self) -> str:
        """The llguidance grammar (unchecked: Grammars.compile checks it)."""
        import llguidance

        kind = self.kind
        options = {"whitespace_flexible": False} if self.disable_any_whitespace else \
            {"whitespace_pattern": JSON_WHITESPACE}
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(self.json, defaults=options)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                 defaults=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", self.source())
        return llguidance.grammar_from("grammar", self.grammar)


def mask_words(vocab_size: int) -> int:
    """32-bit words of one row's packed token mask."""
    return -(-vocab_size // 32)


class Guide:
    """One sequence's place in its grammar (an llguidance matcher)."""

    __slots__ = ("matcher",)

    def __init__(self, matcher):
        self.matcher = matcher

    def consume(self, token: int) -> bool:
        """Advances past a sampled token; True when the grammar is complete (nothing but EOS
        may follow). A token the grammar does not allow raises ValueError."""
        if not self.matcher.consume_token(int(token)):
            raise ValueError(f"token {token} does not continue the grammar: "
                             f"{self.matcher.get_error() or 'not allowed'}")
        return self.matcher.is_stopped()

    def copy(self) -> "Guide":
        return Guide(self.matcher.deep_copy())

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()


_EXECUTOR = None
_EXECUTOR_LOCK = threading.Lock()


def fill_masks(guides: Sequence[tuple[Guide, int]], out: np.ndarray) -> None:
    """Writes each guide's allowed-token mask into row `index` of out ([S, words] int32, one bit
    per token, little-endian within a word), several rows on llguidance's threads."""
    if not guides:
        return
    if len(guides) == 1:
        from llguidance.numpy import fill_next_token_bitmask

        guide, row = guides[0]
        fill_next_token_bitmask(guide.matcher, out, row)
        return
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            import llguidance

            _EXECUTOR = llguidance.LLExecutor()
    from llguidance.numpy import fill_next_token_bitmask_par

    fill_next_token_bitmask_par(_EXECUTOR, [(g.matcher, row) for g, row in guides], out)


class Grammars:
    """Checked llguidance grammars for one tokenizer and vocabulary, cached by constraint, and
    new guides from them. Thread-safe (the server checks requests off the engine thread)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]):
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer")
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._eos = [int(i) for i in eos_ids]
        self._ll = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict = collections.OrderedDict()  # key -> grammar
        self._starts: dict = {}  # grammar -> a matcher at its start, copied for each guide
        self.compiles, self.cache_hits, self.compile_s = 0, 0, 0.0

    @property
    def ll_tokenizer(self):
        """llguidance's view of the tokenizer (built once, ~0.2 s for a 49k vocabulary)."""
        with self._lock:
            if self._ll is None:
                import llguidance

                size = self._tokenizer.vocab_size
                if size > self.vocab_size:
                    raise ValueError(f"the tokenizer has {size} tokens, more than the model's "
                                     f"{self.vocab_size}: structured outputs cannot mask them")
                self._ll = llguidance.LLTokenizer(self._tokenizer.backend_json(),
                                                  n_vocab=self.vocab_size,
                                                  eos_token=self._eos or None)
            return self._ll

    def compile(self, spec: StructuredOutputs) -> str:
        """spec's grammar, checked against the tokenizer: ValueError naming the field and
        llguidance's complaint when it is invalid or uses what llguidance cannot enforce."""
        if not isinstance(spec, StructuredOutputs):
            raise ValueError(f"structured_outputs must be a StructuredOutputs, got "
                             f"{type(spec).__name__}")
        key = (spec.kind, spec.disable_any_whitespace, spec.source())
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return self._cache[key]
        import llguidance

        t0 = time.perf_counter()
        tokenizer = self.ll_tokenizer
        try:
            grammar = spec.llguidance_grammar()
        except ValueError as e:
            raise ValueError(f"structured_outputs.{spec.kind}: {e}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar,
                                                                                 tokenizer)
        if is_error:
            raise ValueError(f"structured_outputs.{spec.kind} is not usable: "
                             f"{_short(messages[0] if messages else 'invalid')}")
        start = self._matcher(grammar)
        with self._lock:
            self.compiles += 1
            self.compile_s += time.perf_counter() - t0
            self._cache[key] = grammar
            self._starts[grammar] = start
            while len(self._cache) > CACHE_ENTRIES:
                self._starts.pop(self._cache.popitem(last=False)[1], None)
        return grammar

    def _matcher(self, grammar: str):
        import llguidance

        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured outputs: {_short(matcher.get_error())}")
        return matcher

    def guide(self, grammar: str) -> Guide:
        """A guide at the start of a grammar compile() returned: a copy of the matcher compile
        built (building one can take a while for a large grammar; copying does not)."""
        with self._lock:
            start = self._starts.get(grammar)
        return Guide(start.deep_copy() if start is not None else self._matcher(grammar))

    def stats(self) -> dict[str, Any]:
        return {"structured_compiles": self.compiles, "structured_cache_hits": self.cache_hits,
                "structured_compile_s": self.compile_s}


def _short(message: str, limit: int = 500) -> str:
    message = " ".join(str(message).split())
    return message if len(message) <= limit else message[:limit] + "..."
