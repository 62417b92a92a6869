"""A GenSession over vLLM's engine: each row is one resumable (streaming-input) request, fed one line at a time
(see the package docstring). What a session reads of its generator is ``SessionHost`` (``VLLMGenerator`` is one):
this module does not import ``engine.py``."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import vllm
from vllm.engine.protocol import StreamingInput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.exceptions import EngineDeadError

from replrl.backends import BackendError
from replrl.backends.vllm.engine_loop import EngineLoop
from replrl.backends.vllm.line_rule import LINE_RULE_KEY
from replrl.backends.vllm.line_stop import LINE_STOP_KEY
from replrl.contract import row_seed
from replrl.types import LineSample, SamplingParams

TIMING_KEYS = ("line_s", "first_token_s", "lines", "later_tokens_s", "later_tokens", "between_lines_s")
"""``VLLMSession.timing``'s counters."""

class EngineStopped(BackendError):
    """vLLM's engine process stopped (the line is ours; vLLM's own log, printed above it, names the cause)."""


class SessionHost(Protocol):
    """What a ``VLLMSession`` reads of the generator that opened it (``VLLMGenerator`` is one)."""

    engine: Any
    """vLLM's ``AsyncLLM``: ``generate`` takes a row's streaming request."""
    loop: EngineLoop
    """The engine's event loop thread: a row's request lives on it."""
    tasks: weakref.WeakSet[asyncio.Task]
    """Where a row's stream registers its task (the generator cancels them when the engine shuts down)."""
    eos: frozenset[int]
    """End-of-sequence ids (a line that ends with one: finish "eos")."""
    line_end: frozenset[int]
    """Ids whose text ends with a newline (finish "newline")."""
    stop_ids: list[int]
    """Both, sorted: a request's ``stop_token_ids`` (where ``line_stops`` is None)."""
    line_stops: str | None
    """The stop-id file a line's request names (``line_stop.py``: a set in the engine's scheduler); None: requests
    carry ``stop_ids``."""
    logit_bias: dict[int, float] | None
    """Added to the logits before anything else (tests make tiny random models end lines with it)."""
    max_model_len: int
    """Prompt plus line: a row's transcript must leave room for one more token."""
    per_token_outputs: bool
    """The engine hands a row every token as it comes (else one output a line: no first-token time)."""



@dataclass
class _Row:
    ids: list[int]
    """The row's transcript so far (prompt, sampled lines, environment tokens)."""
    lines: int = 0
    future: Any = None
    """The in-flight line (a concurrent.futures.Future on the engine's loop)."""
    stream: _Stream | None = None
    """The row's streaming request (created on the engine's loop by the first line)."""
    sent: int = 0
    """How many of ``ids`` the engine holds in the request's KV cache (all but the last sampled token)."""
    finished: bool = False
    restarts: int = 0
    """Rollbacks so far: each ends the row's request; the next line starts a new one (its own id and seed)."""
    params: Any = None
    """The row's ``vllm.SamplingParams``, built once per request and reused while ``max_tokens`` holds (building one
    with the 1,467 stop ids cost 0.2 CPU-ms a line). vLLM copies it shallowly per chunk (``skip_clone``) and its
    request path only adds the model's EOS ids to the shared stop set, which holds them already."""
    params_for: tuple[int, int] = (-1, -1)
    """The (restarts, max_tokens) ``params`` was built for (the seed depends on the restarts)."""


class _Stream:
    """One row's resumable request on the engine's loop: line requests in (``chunks``), lines out (``lines``).

    vLLM keeps a resumable request's KV blocks between its input chunks and continues it from there: the next
    chunk is appended to the request, so a line's request prefills only its new tokens (the token that ended the
    last line, which vLLM drops from a stopped turn, then the environment's). Lives and dies on the engine loop.
    """

    def __init__(self, gen: SessionHost, request_id: str, params: vllm.SamplingParams,
                 timing: dict[str, float] | None = None):
        self.chunks: asyncio.Queue[tuple[list[int], vllm.SamplingParams] | None] = asyncio.Queue()
        self.lines: asyncio.Queue[tuple[LineSample, int] | BaseException] = asyncio.Queue()
        self.timing = timing if timing is not None else dict.fromkeys(TIMING_KEYS, 0.0)
        self._sent = self._done = 0.0  # when the last chunk was handed over, when the last line came out
        self.task = asyncio.ensure_future(self._run(gen, request_id, params))
        gen.tasks.add(self.task)  # cancelled if the engine shuts down first

    async def _inputs(self) -> Any:
        while (chunk := await self.chunks.get()) is not None:
            ids, params = chunk
            yield StreamingInput(vllm.TokensPrompt(prompt_token_ids=ids), params)

    async def _run(self, gen: SessionHost, request_id: str, params: vllm.SamplingParams) -> None:
        tokens: list[int] = []
        logprobs: list[float] = []
        timing, first_at, first_n = self.timing, 0.0, 0
        per_token = gen.per_token_outputs  # else one output a line (tokens in bulk): no first-token time
        try:
            async for out in gen.engine.generate(self._inputs(), params, request_id=request_id):
                now = time.perf_counter()
                completion = out.outputs[0]
                new = list(completion.token_ids)
                if not tokens and new:  # the line's first token(s)
                    first_at, first_n = now, len(new)
                    if per_token:
                        timing["first_token_s"] += now - self._sent
                tokens += new
                logprobs += [step[t].logprob for step, t in zip(completion.logprobs or [], new, strict=True)]
                if completion.finish_reason is not None and tokens:
                    timing["lines"] += 1
                    timing["line_s"] += now - self._sent
                    if per_token:
                        timing["later_tokens_s"] += now - first_at
                        timing["later_tokens"] += len(tokens) - first_n
                    self._done = now
                    last = tokens[-1]
                    finish = "eos" if last in gen.eos else ("newline" if last in gen.line_end else "length")
                    self.lines.put_nowait((LineSample(tokens, logprobs, finish), out.num_cached_tokens or 0))
                    tokens, logprobs = [], []
        except BaseException as e:  # the engine failed the request (or it was cancelled): fail the waiting line
            self.lines.put_nowait(e if isinstance(e, Exception) else RuntimeError("request cancelled"))
            raise
        self.lines.put_nowait(RuntimeError("the row's request ended"))

    async def line(self, ids: list[int], params: vllm.SamplingParams) -> tuple[LineSample, int]:
        if self.task.done() and self.lines.empty():  # ended (aborted, failed) and its error already reported
            raise RuntimeError("the row's vLLM request has ended")
        self._sent = time.perf_counter()
        if self._done:
            self.timing["between_lines_s"] += self._sent - self._done
        self.chunks.put_nowait((ids, params))
        item = await self.lines.get()
        if isinstance(item, EngineDeadError):
            raise EngineStopped("vLLM's engine stopped (EngineDeadError): the engine's log above names the cause") \
                from item
        if isinstance(item, BaseException):
            raise RuntimeError(f"vLLM request failed: {item!r}") from item
        return item

    async def close(self) -> None:
        """End the request (vLLM frees its KV blocks) and wait until the engine has."""
        if not self.task.done():
            self.chunks.put_nowait(None)
            try:
                await asyncio.wait_for(asyncio.shield(self.task), timeout=30)
            except BaseException:  # not ended in time, or failed: abort it
                self.task.cancel()
                await asyncio.gather(self.task, return_exceptions=True)

    async def abort(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


class VLLMSession:
    """A GenSession over a ``SessionHost``'s engine (a ``VLLMGenerator``'s; see the module docstring)."""

    _ids = itertools.count()

    def __init__(self, gen: SessionHost, prompts: list[list[int]], sampling: SamplingParams):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("VLLMSession needs at least one prompt, and every prompt needs at least one token")
        self._gen, self.sampling = gen, sampling
        self._rows = [_Row(list(p)) for p in prompts]
        self._name = f"replrl-{os.getpid()}-{next(self._ids)}"
        self._closed = False
        self.stats = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "sampled_tokens": 0, "rollbacks": 0,
                      "dropped_tokens": 0}
        """Counters: line requests; their transcripts' tokens; of which not computed again (kept in the row's
        request, or found in the prefix cache); tokens sampled; rollbacks, and the context tokens they dropped."""
        self.timing: dict[str, float] = dict.fromkeys(TIMING_KEYS, 0.0)
        """Where a line's time goes, summed over rows (seconds; kept on the engine's loop): ``line_s``, from a line's
        input handed to the engine to its last token, over ``lines``; with ``per_token_outputs`` also
        ``first_token_s``, to its first sampled token (queueing, prefill, one step), and ``later_tokens_s``, from
        there to the line's last token, over ``later_tokens`` (so ``later_tokens_s / later_tokens`` is the engine's
        time per step as a row sees it); ``between_lines_s``, from a line out of the engine to the row's next input
        (the caller: running the line, and any wait)."""

    def _params(self, i: int, room: int) -> vllm.SamplingParams:
        row, max_tokens = self._rows[i], min(self.sampling.max_line_tokens, room)
        if row.params_for != (row.restarts, max_tokens):
            row.params, row.params_for = self._new_params(i, max_tokens), (row.restarts, max_tokens)
        return row.params

    def _new_params(self, i: int, max_tokens: int) -> vllm.SamplingParams:
        s = self.sampling
        # one random stream per row: vLLM seeds a request's generator from its first chunk and keeps it (a request
        # after a rollback: a stream of its own)
        seed = None if s.seed is None else row_seed(s.seed, i, self._rows[i].restarts)
        stops = self._gen.line_stops  # a set in the engine's scheduler (line_stop.py), or the list
        return vllm.SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=seed,
            max_tokens=max_tokens, logprobs=0, detokenize=False,
            stop_token_ids=None if stops else self._gen.stop_ids, skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA, logit_bias=self._gen.logit_bias,
            extra_args={LINE_RULE_KEY: True, LINE_STOP_KEY: stops} if stops else {LINE_RULE_KEY: True},
            # made for this row's request: vLLM need not deep-copy it (with the 1,467 stop ids that copy was
            # 1.6 of the trainer process's 8-10 CPU-ms a line, docs/results/host_profile.md)
            skip_clone=True,
        )

    async def next_line(self, i: int, env_ids: list[int]) -> LineSample:
        if self._closed:
            raise RuntimeError("session is closed")
        row = self._rows[i]
        if row.finished:
            raise ValueError(f"row {i} is finished")
        if row.future is not None:
            raise RuntimeError(f"row {i} already has a pending next_line request")
        row.ids.extend(env_ids)
        room = self._gen.max_model_len - len(row.ids)
        if room < 1:
            raise ValueError(f"row {i}'s transcript ({len(row.ids)} tokens) fills the engine's max_model_len")
        params = self._params(i, room)
        chunk = row.ids[row.sent:]
        request_id = f"{self._name}-{i}" + (f"-r{row.restarts}" if row.restarts else "")
        restarts = row.restarts
        row.future = future = self._start(self._line(row, request_id, chunk, params))
        try:
            sample, cached = await _wait(future)
        except asyncio.CancelledError:
            if self._closed:
                raise RuntimeError("session closed") from None
            raise
        finally:
            if row.future is future:
                row.future = None
        if row.restarts != restarts:  # rolled back after the engine answered, before this coroutine resumed
            raise asyncio.CancelledError
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(row.ids)
        self.stats["cached_tokens"] += cached if row.sent == 0 else row.sent
        self.stats["sampled_tokens"] += len(sample.token_ids)
        row.ids.extend(sample.token_ids)
        row.sent = len(row.ids) - 1
        row.lines += 1
        return sample

    async def _line(self, row: _Row, request_id: str, chunk: list[int], params: vllm.SamplingParams
                    ) -> tuple[LineSample, int]:
        """On the engine's loop: the row's next line (its request started by the first)."""
        if row.stream is None:
            row.stream = _Stream(self._gen, request_id, params, self.timing)
        stream = row.stream
        try:
            return await stream.line(chunk, params)
        except asyncio.CancelledError:  # the caller gave up on the line (or rolled it back): the request cannot go on
            await stream.abort()
            if row.stream is stream:
                row.stream = None
            raise

    async def rollback(self, i: int, length: int) -> None:
        """Drop row ``i``'s tokens after its first ``length`` (see ``GenSession.rollback``). A streaming request
        can only grow, so the row's request is aborted (its line in flight with it) and its next line starts a new
        request over the kept transcript: the prefix cache holds its whole blocks (the row's own, computed before),
        so the new request prefills about one block. The new request's seed is derived from the session's, the row
        and the restart count (never the first request's again)."""
        if self._closed:
            raise RuntimeError("session is closed")
        row = self._rows[i]
        if row.finished:
            raise ValueError(f"row {i} is finished")
        if not 1 <= length <= len(row.ids):
            raise ValueError(f"row {i} holds {len(row.ids)} context tokens: cannot keep {length}")
        future, stream = row.future, row.stream
        row.future, row.stream = None, None
        self.stats["rollbacks"] += 1
        self.stats["dropped_tokens"] += len(row.ids) - length
        row.ids, row.sent = row.ids[:length], 0
        row.restarts += 1
        if future is not None:
            future.cancel()  # its _line aborts the request on the engine's loop
        if stream is not None:  # gone from the engine before the row's next request
            await _wait(self._start(stream.abort()))

    def finish(self, i: int) -> None:
        row = self._rows[i]
        row.finished = True
        if row.future is not None:
            row.future.cancel()  # aborts the request in the engine
        elif row.stream is not None:
            self._start(row.stream.close())

    async def aclose(self) -> None:
        self._closed = True
        for row in self._rows:
            if row.future is not None:
                row.future.cancel()
        streams = [row.stream for row in self._rows if row.stream is not None]
        if streams:
            await _wait(self._start(_close_all(streams)))

    def _start(self, coro: Any) -> Any:
        """Run ``coro`` on the engine's loop: a task when the caller is on it (the episodes are, under
        ``sandbox.run_sync``: engine_loop.py), else a concurrent future handed over to it."""
        if self._gen.loop.here():
            task = asyncio.ensure_future(coro)
            _running.add(task)  # held until done (the loop keeps only weak references to tasks)
            task.add_done_callback(_running.discard)
            return task
        return self._gen.loop.submit(coro)


_running: set[asyncio.Task] = set()


async def _wait(future: Any) -> Any:
    return await (future if isinstance(future, asyncio.Future) else asyncio.wrap_future(future))


async def _close_all(streams: list[_Stream]) -> None:
    await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)
