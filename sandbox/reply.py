"""A kernel's reply, checked on the host: every field's type and size, the output cap, the tool calls.

The kernel program keeps its own caps (``_kernel_side.py``: the output cap, the tool-call filter), but it shares its
process with model-written code, which can replace them. What counts is decided here, on the host's side, from data
alone: a reply whose shape is wrong is ``Malformed`` (the line ends as a crash that says why, and the kernel is
replaced); within a well-formed reply, output past the cap is cut (``truncated``), calls past the rules are dropped,
and text is made valid Unicode without NUL before anything tokenizes it. Nothing here raises for any input.
The kernel-host processes (docs/rollouts.md) run the same checks: keep them in this one place.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection
from typing import Any

from .result import ExecResult, StateDigest, ToolCall

MAX_CALLS = 16
"""Tool calls kept per line (the first ones); the host reads the first ``submit``."""
MAX_ARGS = 8
"""Arguments of one call (positional and keyword together)."""
MAX_STR = 1000
"""Characters of a submitted string, of a rejected value's repr."""
MAX_INT_BITS = 3322
"""Bits of a submitted int (1000 decimal digits)."""
MAX_KWARG_NAME = 100
"""Characters of a keyword argument's name."""
MAX_CALLS_BYTES = 64_000
"""JSON bytes of all the calls kept for one line."""
MAX_ERROR_NAME = 100
"""Characters of an exception's name kept (a class's ``__name__`` may be any string)."""

_INVALID = re.compile("[\x00\ud800-\udfff]")


def clean_text(text: str) -> str:
    """``text`` as valid Unicode without NUL: each lone surrogate (which no encoder accepts, so a tokenizer raises on
    it) and each NUL becomes U+FFFD. The common case (ASCII without NUL) costs one scan."""
    if text.isascii() and "\x00" not in text:
        return text
    return _INVALID.sub("\ufffd", text)


class Malformed(ValueError):
    """A reply that is not of the shape the kernel program makes: the host's words, no bytes of the kernel's."""


def exec_result(content: Any, status: str, duration_s: float, max_output: int,
                tools: Collection[str]) -> ExecResult:
    """The ExecResult of an execute_reply's ``content``. Raises ``Malformed`` (and only that) for a reply of the
    wrong shape; caps and rules are applied, never trusted."""
    if not isinstance(content, dict):
        raise Malformed("the reply's content is not an object")
    data = content.get("replrl")
    if not isinstance(data, dict):
        raise Malformed("the reply carries no replrl payload")
    output = data.get("output")
    if not isinstance(output, str):
        raise Malformed("the reply's output is not a string")
    calls = data.get("calls")
    if not isinstance(calls, list):
        raise Malformed("the reply's calls are not a list")
    error = data.get("error_name")
    if error is not None and not isinstance(error, str):
        raise Malformed("the reply's error name is not a string")
    flags = [data.get(k, False) for k in ("truncated", "incomplete")]
    if not all(isinstance(f, bool) for f in flags):
        raise Malformed("the reply's flags are not booleans")
    truncated, incomplete = flags
    if len(output) > max_output:  # the cap is the host's
        output, truncated = output[:max_output], True
    if status == "ok" and error:
        status = "error"
    error = clean_text(error[:MAX_ERROR_NAME]) if error else None  # a class's __name__ may be any string
    return ExecResult(status, output=clean_text(output), error_name=error, duration_s=duration_s,
                      truncated=truncated, incomplete=incomplete, tool_calls=checked_calls(calls, tools),
                      state=state_digest(data.get("state")))


def checked_calls(calls: list, tools: Collection[str]) -> list[ToolCall]:
    """The calls that follow the rules, in order: a tool the host defined, plain arguments, at most ``MAX_CALLS``
    calls and ``MAX_CALLS_BYTES`` of JSON; the others are dropped, as the kernel program drops them."""
    out: list[ToolCall] = []
    size = 0
    for call in calls:
        if len(out) == MAX_CALLS:
            break
        if not (type(call) is dict and set(call) <= {"name", "args", "kwargs"} and type(call.get("name")) is str
                and call["name"] in tools and type(call.get("args")) is list
                and type(call.get("kwargs", {})) is dict):
            continue
        args, kwargs = call["args"], call.get("kwargs", {})
        if len(args) + len(kwargs) > MAX_ARGS or not all(map(plain, args)) or not all(map(plain, kwargs.values())) \
                or not all(type(k) is str and len(k) <= MAX_KWARG_NAME for k in kwargs):
            continue
        size += len(json.dumps(call))
        if size > MAX_CALLS_BYTES:
            break
        out.append(ToolCall(call["name"], [_clean(a) for a in args],
                            {_clean(k): _clean(v) for k, v in kwargs.items()}))
    return out


def plain(value: Any) -> bool:
    """Whether a recorded value is one the kernel program's ``_jsonable`` makes: None, bool, an int of at most
    ``MAX_INT_BITS``, a finite float, a str of at most ``MAX_STR`` characters, or ``{"rejected": .., "repr": ..}``
    of two such strings."""
    if value is None or type(value) is bool:
        return True
    if type(value) is int:
        return value.bit_length() <= MAX_INT_BITS
    if type(value) is str:
        return len(value) <= MAX_STR
    if type(value) is float:
        return math.isfinite(value)
    return (type(value) is dict and set(value) == {"rejected", "repr"}
            and all(type(v) is str and len(v) <= MAX_STR for v in value.values()))


def _clean(value: Any) -> Any:
    if type(value) is str:
        return clean_text(value)
    if type(value) is dict:
        return {k: clean_text(v) for k, v in value.items()}
    return value


def state_digest(data: Any) -> StateDigest | None:
    """The digest in a reply, if it has the shape the kernel makes (user code could forge it: nothing else is read)."""
    if not isinstance(data, dict) or not all(isinstance(data.get(k), str) and len(data[k]) <= 64
                                             for k in ("named", "values")):
        return None
    number = (int, float)
    ms = data.get("ms")
    return StateDigest(clean_text(data["named"]), clean_text(data["values"]),
                       ms=float(ms) if isinstance(ms, number) and not isinstance(ms, bool) and math.isfinite(ms)
                       else 0.0,
                       marked=int(data["marked"]) if type(data.get("marked")) is int else 0,
                       names=int(data["names"]) if type(data.get("names")) is int else 0)
