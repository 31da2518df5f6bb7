"""Text and JSON from users, checked at the boundary (server request bodies, batch lines, the
Python API's prompts): the caller gets a value every later step can handle, or an InputError
that names the problem and its place without echoing the offending text.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Union

# Far deeper than any OpenAI request body nests, far below the JSON parser's recursion limit.
MAX_JSON_DEPTH = 64
# Longest repr of a user value quoted in an error message.
MAX_SHOWN_CHARS = 120

# A lone UTF-16 surrogate ("\ud800" in JSON) cannot be encoded as UTF-8. json.loads joins a
# valid pair into one code point, so any surrogate left is a lone one.
_SURROGATE = re.compile("[\ud800-\udfff]")


class InputError(ValueError):
    """User input refused; the message names the problem and its place."""


def show(value: Any) -> str:
    """repr(value) for an error message, shortened past MAX_SHOWN_CHARS. repr escapes lone
    surrogates, so the result always encodes."""
    r = repr(value)
    if len(r) <= MAX_SHOWN_CHARS:
        return r
    return f"{r[:MAX_SHOWN_CHARS - 20]}... ({len(r)} characters)"


def check_text(text: str, where: str) -> str:
    """text, or InputError when it holds a lone surrogate (it does not round-trip through
    UTF-8)."""
    m = _SURROGATE.search(text)
    if m is not None:
        raise InputError(f"{where} is not valid Unicode text: it holds a lone UTF-16 surrogate "
                         f"(U+{ord(m.group()):04X}) at character {m.start()}")
    return text


def _reject_constant(name: str):
    raise InputError(f"{name} is not a JSON value (JSON has no NaN or Infinity)")


def _parse_float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise InputError(f"the number {s[:40]} is out of the range of a 64-bit float")
    return v


def loads_json(data: Union[bytes, bytearray, str], what: str = "the request body") -> Any:
    """JSON text -> value, every string in it (keys too) valid Unicode, containers nested at most
    MAX_JSON_DEPTH deep, numbers finite. InputError, naming `what`, otherwise."""
    if isinstance(data, (bytes, bytearray)):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{what} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        value = json.loads(data, parse_constant=_reject_constant, parse_float=_parse_float)
    except InputError as e:
        raise InputError(f"{what} is not valid JSON: {e}") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{what} is not valid JSON: {e.msg} at line {e.lineno} column "
                         f"{e.colno}") from None
    except RecursionError:
        raise InputError(f"{what} nests arrays or objects deeper than {MAX_JSON_DEPTH} "
                         "levels") from None
    except ValueError as e:  # an integer past Python's digit limit (sys.int_info)
        raise InputError(f"{what} is not valid JSON here: {str(e).split(':')[0]}") from None
    check_tree(value, what)
    return value


def check_tree(value: Any, what: str = "the request body") -> None:
    """InputError for a container nested deeper than MAX_JSON_DEPTH or a string (key or value)
    that is not valid Unicode. Iterative: any depth is safe to check."""
    stack = [(value, "", 1)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, str):
            check_text(v, f"{what}: {path or 'the value'}")
            continue
        if not isinstance(v, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise InputError(f"{what} nests arrays or objects deeper than {MAX_JSON_DEPTH} "
                             f"levels (at {path})")
        if isinstance(v, dict):
            for k, item in v.items():
                check_text(k, f"{what}: a field name in {path or 'the top-level object'}")
                name = k if len(k) <= 40 else k[:40] + "..."
                stack.append((item, f"{path}.{name}" if path else name, depth + 1))
        else:
            for i, item in enumerate(v):
                stack.append((item, f"{path}[{i}]", depth + 1))
