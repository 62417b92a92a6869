"""A line's end inside vLLM's scheduler, looked up in a set instead of a 1,467-id list (issue 65).

A line ends at the first token whose text ends with a newline: 1,467 of Qwen2.5's ids, 1,000-odd of SmolLM2's.
Given to vLLM as ``SamplingParams.stop_token_ids``, that list cost three times over (bench/stop_ids.py,
docs/benchmarks.md): the scheduler's ``check_stop`` scans it for every row at every step (15.7 ms a 128-row step on
the CPU, 15-17% of plain generation on an H200), and the trainer's process validates and serializes it, and the
engine's decodes it, with every line's input (a twelfth of the trainer's event loop at batch 128).

So the engine's scheduler gets a wrapped ``check_stop`` (``install``, run where this module is imported: the
trainer's process, whose engine-core process is forked from it or imports this module to rebuild the engine's
config, which names ``LineRuleLogitsProcessor``). A request that names a stop-id file in
``extra_args[LINE_STOP_KEY]`` stops at any id of that file's set, exactly where the list would have stopped it
(before the length cap, the end-of-sequence id first, as vLLM orders its checks); every other request is left to
vLLM. The engine asks its core once at start whether the wrapper is in place there (``READY``); where it is not (a
vLLM whose scheduler no longer calls ``check_stop``, an engine core started otherwise), requests carry the list as
before. tests/test_backend_vllm.py holds both ways to the same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LINE_STOP_KEY = "replrl_line_stops"
"""``SamplingParams.extra_args`` key: the path of a JSON list of ids the request stops at (``STOPS_FILE``)."""
STOPS_FILE = "replrl_line_stops.json"
"""The stop ids, written next to the engine's config."""
READY = "replrl_line_stops_ready"
"""The engine core's utility method (``EngineCore``) that answers whether the wrapper stops requests there."""

_SETS: dict[str, frozenset[int]] = {}


def _stops(extra: dict) -> frozenset[int] | None:
    path = extra.get(LINE_STOP_KEY)
    if not isinstance(path, str):
        return None
    found = _SETS.get(path)
    if found is None:
        found = _SETS[path] = frozenset(int(i) for i in json.loads(Path(path).read_text()))
    return found


def install() -> bool:
    """Wrap vLLM's scheduler's ``check_stop`` in this process (once) and give ``EngineCore`` the ``READY``
    method; False where this vLLM has neither (then nothing is changed)."""
    try:
        from vllm.v1.core.sched import scheduler
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.request import RequestStatus
    except ImportError:
        return False
    original = getattr(scheduler, "check_stop", None)
    if original is None:
        return False
    if getattr(original, "_replrl", False):
        return True

    def check_stop(request: Any, *args: Any, **kwargs: Any) -> bool:
        params = request.sampling_params
        extra = params.extra_args if params is not None else None
        if extra:
            stops = _stops(extra)
            tokens = request.output_token_ids
            if stops is not None and tokens and tokens[-1] in stops and tokens[-1] != params.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = tokens[-1]
                return True
        return original(request, *args, **kwargs)

    check_stop._replrl = True  # type: ignore[attr-defined]
    scheduler.check_stop = check_stop
    EngineCore.replrl_line_stops_ready = _ready  # type: ignore[attr-defined]
    return True


def _ready(self: Any) -> bool:
    """In the engine core: the wrapper is the scheduler module's, and the scheduler calls it by that name."""
    from vllm.v1.core.sched import scheduler

    methods = vars(getattr(scheduler, "Scheduler", object)).values()
    calls = any("check_stop" in getattr(getattr(m, "__code__", None), "co_names", ()) for m in methods)
    return bool(getattr(scheduler.check_stop, "_replrl", False) and calls)


async def engine_ready(engine: Any) -> bool:
    """Whether ``engine``'s core stops requests at ``LINE_STOP_KEY``'s ids (False on any error: the list then)."""
    try:
        return bool(await engine.engine_core.call_utility_async(READY))
    except Exception:
        return False
