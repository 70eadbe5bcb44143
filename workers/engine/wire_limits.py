"""Limits on what crosses the wire, shared by the control plane (which enforces them) and the engine
(which keeps under them). Django-free and torch-free.

- one request-size limit for every HTTP body the control plane accepts;
- a nesting bound for every JSON body (checked before parsing: a deep body would exhaust the parser's stack);
- text that a database can store: no NUL (PostgreSQL refuses it in text and jsonb) and no lone surrogates
  (they cannot be encoded as UTF-8).
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_REQUEST_BYTES = 8 * 1024 * 1024
MAX_JSON_DEPTH = 32


class JsonBodyProblem(ValueError):
    """A body that is not JSON, or nests deeper than allowed; `message` says which, for a field error."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def json_depth(raw: str | bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (0 for a scalar), without parsing it.

    Brackets inside strings are skipped; the text need not be valid JSON.
    """
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes | bytearray) else raw
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def loads_bounded(raw: str | bytes, *, max_depth: int = MAX_JSON_DEPTH, allow_nan: bool = True) -> Any:
    """json.loads that refuses bodies nested deeper than `max_depth` instead of exhausting the stack, and with
    `allow_nan=False` the NaN and Infinity that JSON itself does not have (Python's parser takes them)."""
    if json_depth(raw) > max_depth:
        raise JsonBodyProblem(f"nested deeper than {max_depth} levels")
    try:
        return json.loads(raw) if allow_nan else json.loads(raw, parse_constant=_not_json, parse_float=_finite)
    except ValueError as exc:  # not JSON, not UTF-8, or an integer past Python's digit limit
        raise JsonBodyProblem(f"not valid JSON: {exc}") from None
    except RecursionError:  # pragma: no cover - the depth check comes first
        raise JsonBodyProblem(f"nested deeper than {max_depth} levels") from None


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON number (send a finite number, or null)")


def _finite(text: str) -> float:
    number = float(text)
    if math.isinf(number):
        raise ValueError(f"{text[:40]} is past a float's range (send a finite number, or null)")
    return number


def unstorable_reason(text: str) -> str | None:
    """Why this text cannot be stored as it is (a NUL, a lone surrogate), or None when it can."""
    if "\x00" in text:
        return "must not contain NUL characters"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "must be valid Unicode (no lone surrogates)"
    return None


def unstorable_in(value: Any, *, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """The first problem found in a JSON-like value's keys and strings (or its depth), else None."""
    found = unstorable_at(value, max_depth=max_depth)
    return found[1] if found else None


def unstorable_at(value: Any, *, max_depth: int = MAX_JSON_DEPTH) -> tuple[str, str] | None:
    """Where the first problem in a JSON-like value's keys and strings (or its depth) is, and what it is:
    (dotted path, reason); the path is "" for the value itself and, for a key, that of its mapping. None if none."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "")]
    while stack:
        item, depth, path = stack.pop()
        if depth > max_depth:
            return path, f"nested deeper than {max_depth} levels"
        if isinstance(item, str):
            reason = unstorable_reason(item)
            if reason:
                return path, reason
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and (reason := unstorable_reason(key)):
                    return path, f"key: {reason}"
                stack.append((child, depth + 1, f"{path}.{key}" if path else str(key)))
        elif isinstance(item, list | tuple):
            stack.extend((child, depth + 1, f"{path}.{i}" if path else str(i)) for i, child in enumerate(item))
    return None
