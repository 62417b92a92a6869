"""The one narrow protocol between the trainer and a kernel host: a line in, one bounded, checked result out.

A kernel host (``host_main.py``) is a process that owns a share of a pool's kernels: their sockets, HMAC, JSON, the
budgets and checks of ``zmtp.py`` and ``reply.py``, interrupts and replacements. The trainer's process sees only
these messages, each a length-prefixed JSON object over one unix socket per host:

    trainer -> host                                           host -> trainer
    {"op": "open", "size", "limits", "tools", "refill",       {"ok": true, "stats"} | {"error": why}
     "post"}
    {"id", "op": "acquire"}                                   {"id", "lease", "stats"} | {"id", "error"}
    {"id", "op": "execute", "lease", "code", "mode",          {"id", "result": ExecResult as data, its "post"
     "timeout", "digest"}                                      the post-processor's data or null}
    {"id", "op": "release", "lease"}                          {"id", "stats"}
    {"id", "op": "stats"}                                     {"id", "stats"}: boots, warm, in use
    {"op": "close"}                                           (the host closes its pool and exits)

``post`` (optional): ``["module:callable", {arguments}]``, a post-processor the host builds once at open and calls
on every result it sends, in the host (the rollout side's: ``replrl.rollout.host_splice`` tokenizes the output
there); what it returns travels as the result's ``post``, and the side that asked for it checks it.

Requests carry plain data only (no pickle: nothing in a message can run code on either side), and the trainer
checks each result's types and sizes again (``result_from_data``), so a kernel host is held to the same rules as a
kernel. A host on another machine (``ray_hosts.py``) speaks the same frames over TCP, after a first frame that
carries the pool's secret (``host_main.serve_one``)."""

from __future__ import annotations

import asyncio
import json
import math
import struct
from dataclasses import asdict, fields
from typing import Any, get_args

from .limits import Limits
from .reply import MAX_CALLS, Malformed, checked_calls, clean_text, state_digest
from .result import ExecResult, Status

HEADER = struct.Struct(">I")
STATUSES = get_args(Status)


class ProtocolError(Exception):
    """A message that breaks the protocol (too large, not JSON, not an object): the host's words."""


def max_frame(limits: Limits) -> int:
    """The largest message a host may send for ``limits``: a result with ``max_output_bytes`` characters of
    output at 6 JSON bytes each (a control character as ``\\u0001``), tool calls, digest and headers, and a
    post-processor's data about as large again (a token id a character, 7 bytes each)."""
    return 2**20 + 13 * limits.max_output_bytes


def encode(msg: dict) -> bytes:
    body = encode_body(msg)
    return HEADER.pack(len(body)) + body


async def read_message(reader: asyncio.StreamReader, limit: int) -> dict | None:
    """The next message, or None at the end of the stream; ProtocolError for one past ``limit`` bytes (nothing of
    it is read) or one that is not a JSON object."""
    try:
        head = await reader.readexactly(HEADER.size)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    (size,) = HEADER.unpack(head)
    if size > limit:
        raise ProtocolError(f"a message of {size} bytes (the limit is {limit})")
    try:
        body = await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    return decode(body, limit)


def decode(body: Any, limit: int) -> dict:
    """A message's body (JSON bytes) as an object; ProtocolError for one that is not bytes, is past ``limit`` bytes
    (nothing of it is parsed), is not JSON or not an object."""
    if not isinstance(body, bytes):
        raise ProtocolError(f"a message that is not bytes ({type(body).__name__})")
    if len(body) > limit:
        raise ProtocolError(f"a message of {len(body)} bytes (the limit is {limit})")
    try:
        msg = json.loads(body)
    except (ValueError, RecursionError):
        raise ProtocolError("a message that is not JSON") from None
    if not isinstance(msg, dict):
        raise ProtocolError("a message that is not an object")
    return msg


def encode_body(msg: dict) -> bytes:
    """A message's body, without the length header."""
    return json.dumps(msg, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def limits_to_data(limits: Limits) -> dict:
    return asdict(limits)


def limits_from_data(data: dict) -> Limits:
    known = {f.name for f in fields(Limits)}
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items() if k in known}
    return Limits(**kw)


def result_to_data(result: ExecResult) -> dict:
    return asdict(result)


def result_from_data(data: Any, tools: Any, max_output: int) -> ExecResult:
    """An ExecResult from a host's message, every field checked again (types, the output cap, the call rules);
    ``Malformed`` for one of the wrong shape."""
    if not isinstance(data, dict):
        raise Malformed("the result is not an object")
    status, output = data.get("status"), data.get("output", "")
    if status not in STATUSES or not isinstance(output, str):
        raise Malformed("the result's status or output has the wrong type")
    calls = data.get("tool_calls", [])
    if not isinstance(calls, list) or len(calls) > MAX_CALLS:
        raise Malformed("the result's tool calls are not a short list")
    error, limit = data.get("error_name"), data.get("limit")
    duration = data.get("duration_s", 0.0)
    if not (error is None or isinstance(error, str)) or not (limit is None or isinstance(limit, str)) or \
            not isinstance(duration, (int, float)) or isinstance(duration, bool) or not math.isfinite(duration):
        raise Malformed("the result's error, limit or duration has the wrong type")
    flags = [data.get(k, False) for k in ("truncated", "incomplete", "restarted")]
    if not all(isinstance(f, bool) for f in flags):
        raise Malformed("the result's flags are not booleans")
    truncated, incomplete, restarted = flags
    if len(output) > max_output:
        output, truncated = output[:max_output], True
    return ExecResult(status, output=clean_text(output), error_name=clean_text(error[:100]) if error else None,
                      duration_s=float(duration), truncated=truncated, incomplete=incomplete, restarted=restarted,
                      tool_calls=checked_calls(calls, tools), state=state_digest(data.get("state")),
                      limit=clean_text(limit[:500]) if limit else None)
