"""Generation with transformers: each row's KV cache is kept across lines; each step is one packed forward.

A step feeds each row's pending tokens (its last sampled token, the interpreter output being prefilled, or its
prompt) back to back as one sequence [1, N] with each row's own positions, so the step costs what its N real
tokens cost: no padding to a common width, no holes in the cache (see ``replrl.backends.attention``). A row
prefilling a 40-token traceback rides along in the same step as the rows decoding one token each, instead of
taking steps of its own or making every row pay for 40 columns (``bench/packed_step.py`` measures both). The
logits equal those of one plain forward pass over each row's tokens.

A row can be forked between two lines (``HFSession.fork``, for tree rollouts): the new rows get copies of its
cache rows (``PackedKV.fork``, a memory copy on the worker thread before the next forward) instead of prefilling
the shared prefix again, and join the running steps at once.

Threading: all row bookkeeping lives on the event loop thread; tensors (cache, forward, sampling) live on one
worker thread. The loop thread plans a step (which tokens each row feeds, who samples), the worker runs it, the
loop thread applies the sampled tokens and resolves the finished lines' futures. A row whose line just ended is
executing it; the next step waits a moment for it (at most ``join_wait_frac`` of the last step's time, and
``join_wait_max_s``) so it rejoins at once instead of a step later, without lockstep waiting on slow lines.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from replrl.backends.attention import PackedKV, Segment, packed_attention
from replrl.contract import (
    TokenMasks,
    eos_ids,
    line_end_ids,
    row_seed,
    sample,
    sampling_logprobs,
    token_masks,
)
from replrl.types import LineSample, SamplingParams

GEN_THREADS = 1 if (os.cpu_count() or 1) <= 4 else None
"""Default torch threads of the generation worker: one on a small CPU, where the sandbox kernels need the other
cores and two torch threads that wait on each other's scheduling make small decode steps 3-40x slower (measured on
a busy 2-core machine); None (torch's default) elsewhere."""


def cache_argument(model: Any) -> str:
    """The name a model's ``forward`` takes its KV cache by: ``cache`` from transformers 5.24 (which warns on every
    call given the old name), ``past_key_values`` before. A peft wrapper passes its keywords on: its base model's
    ``forward`` decides."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


class _Batch:
    """Worker-thread tensor state of a session: the per-row caches."""

    def __init__(self, model: Any, n_rows: int, device: torch.device):
        self.model, self.device = model, device
        self.cache = PackedKV(n_rows, device)
        self._cache_arg = cache_argument(model)

    def free(self, slots: list[int]) -> None:
        for slot in slots:
            self.cache.free(slot)

    def truncate(self, cuts: list[tuple[int, int]]) -> None:
        """Row ``slot`` keeps its first ``length`` cached tokens, for each ``(slot, length)`` (a rollback)."""
        for slot, length in cuts:
            self.cache.truncate(slot, length)

    def fork(self, forks: list[tuple[int, list[int], int | None]]) -> int:
        """Copy each source row's cache (or its first ``length`` tokens) into its new rows; returns the tokens copied
        (all rows together)."""
        return sum(self.cache.fork(src, dsts, length) * len(dsts) for src, dsts, length in forks)

    def forward(self, feed: dict[int, list[int]], keep: list[int]) -> torch.Tensor:
        """Feed row ``slot`` the tokens ``feed[slot]`` (rows in order); returns the next-token logits [K, V] of the
        rows ``keep`` (each fed at least one token), in that order."""
        segments, ids, positions, last = [], [], [], {}
        for slot, tokens in feed.items():
            cached = self.cache.lengths[slot]
            segments.append(Segment(slot, len(ids), len(tokens), cached))
            ids += tokens
            positions += range(cached, cached + len(tokens))
            last[slot] = len(ids) - 1
        self.cache.plan(segments)
        with packed_attention(self.model, self.cache):
            out = self.model(
                input_ids=torch.tensor([ids], device=self.device),
                position_ids=torch.tensor([positions], device=self.device),
                **{self._cache_arg: self.cache},
                use_cache=True,
                logits_to_keep=torch.tensor([last[s] for s in keep], dtype=torch.long, device=self.device),
            )
        self.cache.commit()
        return out.logits[0]


@dataclass
class _Row:
    """Loop-thread state of one row (episode)."""

    pending: list[int]
    """Tokens not yet in the cache, fed in order."""
    generator: torch.Generator
    ids: list[int]
    """The row's context: its prompt, the environment tokens given and the tokens sampled. The first
    ``len(ids) - len(pending)`` are in the cache, or being fed by the step in flight; ``pending`` is the rest."""
    key: int
    """Names the row's random stream (its index, or its fork key)."""
    restarts: int = 0
    """Rollbacks so far (each starts a stream of its own)."""
    future: asyncio.Future | None = None
    """The caller's pending next_line request."""
    line_ids: list[int] = field(default_factory=list)
    line_logprobs: list[float] = field(default_factory=list)
    finished: bool = False
    freed: bool = False
    """Its cache has been released (worker thread)."""


@dataclass
class _StepPlan:
    free_slots: list[int]
    """Finished rows whose caches are released first."""
    cuts: list[tuple[int, int]]
    """Rows rolled back since the last step: (row, cached tokens it keeps); applied before the forks."""
    forks: list[tuple[int, list[int], int | None]]
    """Rows forked since the last step: (source row, new rows, cached tokens to copy or None for all); their caches
    are copied before the forward."""
    feed: dict[int, list[int]]
    """Per row (in order) with tokens this step: the tokens fed."""
    sample_rows: list[int]
    generators: list[torch.Generator]
    line_starts: list[bool]
    """Per sampling row: the token sampled is the first of its line (prompt healing's mask applies)."""
    futures: list[asyncio.Future]
    """Per sampling row: the request its token is for (a row rolled back meanwhile drops the token)."""


class HFSession:
    """A GenSession over a transformers causal LM (see the module docstring)."""

    def __init__(self, gen: HFGenerator, prompts: list[list[int]], sampling: SamplingParams):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("HFSession needs at least one prompt, and every prompt needs at least one token")
        self._gen, self.sampling = gen, sampling
        vocab = gen.model.get_output_embeddings().weight.shape[0]
        self._masks = TokenMasks(*(m.to(gen.device) for m in token_masks(gen.tokenizer, vocab)))
        self._line_end = line_end_ids(gen.tokenizer)
        self._eos = eos_ids(gen.tokenizer, getattr(gen.model, "generation_config", None))
        self._rows = [_Row(list(p), self._row_generator(i), list(p), i) for i, p in enumerate(prompts)]
        self._forks: list[tuple[int, list[int], int | None]] = []
        self._cuts: list[tuple[int, int]] = []
        self._batch = _Batch(gen.model, len(prompts), gen.device)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self._error: BaseException | None = None
        self._last_step_s = 0.0
        self.stats = {"steps": 0, "fed_tokens": 0, "max_step_tokens": 0, "sampled_tokens": 0, "rows_freed": 0,
                      "worker_s": 0.0, "forward_s": 0.0, "loop_s": 0.0, "join_wait_s": 0.0, "forked_rows": 0,
                      "forked_tokens": 0, "fork_s": 0.0, "rollbacks": 0, "dropped_tokens": 0}
        """Counters: forward steps, real tokens fed (all of them, no padding exists), the most fed in one step,
        tokens sampled, caches released, seconds in the worker step / in model.forward / planning and applying on
        the loop thread / waiting for rows to come back from executing their line; rows forked, the cached tokens
        copied for them (fed to no forward), seconds copying; rollbacks, and the context tokens they dropped."""
        self.timing: dict[str, float] = {}
        """No per-line timings: a row's wait is the steps it rides in (``stats``)."""

    def _row_generator(self, key: int, restart: int = 0) -> torch.Generator:
        g = torch.Generator(device=self._gen.device)
        if self.sampling.seed is None:
            g.seed()
        else:  # one stream per row: a row's samples do not depend on which other rows share its steps
            g.manual_seed(row_seed(self.sampling.seed, key, restart))
        return g

    def _live_row(self, i: int) -> _Row:
        """Row ``i`` of a live session, not finished (else the error)."""
        if self._error is not None:
            raise RuntimeError(f"generation failed: {self._error!r}") from self._error
        if self._closed:
            raise RuntimeError("session is closed")
        row = self._rows[i]
        if row.finished:
            raise ValueError(f"row {i} is finished")
        return row

    def _idle_row(self, i: int, pending: str) -> _Row:
        """Row ``i`` of a live session, neither finished nor waiting for a line (else the error, ``pending`` saying
        what a waiting row means to the caller)."""
        row = self._live_row(i)
        if row.future is not None:
            raise RuntimeError(f"row {i} {pending}")
        return row

    # ---- the GenSession API (event loop thread) ----

    async def next_line(self, i: int, env_ids: list[int]) -> LineSample:
        row = self._idle_row(i, "already has a pending next_line request")
        loop = asyncio.get_running_loop()
        row.pending.extend(env_ids)
        row.ids.extend(env_ids)
        row.future = loop.create_future()
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._engine())
        self._wake.set()
        return await row.future

    def fork(self, i: int, keys: Sequence[int], prefix: Sequence[int] | None = None) -> list[int]:
        """New rows, one per key, that go on from row ``i``'s context as it stands between two lines (no pending
        request): its KV cache rows are copied (on the worker thread, before the next forward), not computed again,
        and the tokens it has not fed yet are theirs too. With ``prefix`` (a prefix of row ``i``'s context, at
        least one token), the new rows' context is that prefix instead: the first ``len(prefix) - 1`` cached tokens
        are copied and the last one is theirs to feed. A key names a new row's random stream (with the session's
        seed), so a row's samples do not depend on when it was forked. Returns the new rows' indices."""
        row = self._idle_row(i, "has a pending next_line request: fork it between two lines")
        if prefix is not None and not prefix:
            raise ValueError("a fork's prefix needs at least one token")
        pending, length = (list(row.pending), None) if prefix is None else ([prefix[-1]], len(prefix) - 1)
        ids = row.ids if prefix is None else list(prefix)
        new = []
        for key in keys:
            new.append(len(self._rows))
            self._rows.append(_Row(list(pending), self._row_generator(key), list(ids), key))
        if new:
            self._forks.append((i, new, length))
        if self._wake is not None:
            self._wake.set()
        return new

    async def rollback(self, i: int, length: int) -> None:
        """Drop row ``i``'s tokens after its first ``length`` (see ``GenSession.rollback``): its line in flight is
        cancelled (a token the running step samples for it is dropped), and its cache keeps at most its first
        ``length - 1`` tokens (cut on the worker thread before the next step; the columns after are written over
        later), the token at ``length - 1`` waiting to be fed with the next line's input."""
        row = self._live_row(i)
        if not 1 <= length <= len(row.ids):
            raise ValueError(f"row {i} holds {len(row.ids)} context tokens: cannot keep {length}")
        future, row.future = row.future, None
        if future is not None and not future.done():
            future.cancel()
        fed = len(row.ids) - len(row.pending)  # in the cache, or being fed by the step in flight
        keep = min(fed, length - 1)
        if keep < fed:
            self._cuts.append((i, keep))
        self.stats["rollbacks"] += 1
        self.stats["dropped_tokens"] += len(row.ids) - length
        row.ids = row.ids[:length]
        row.pending = row.ids[keep:]
        row.line_ids, row.line_logprobs = [], []
        row.restarts += 1
        row.generator = self._row_generator(row.key, row.restarts)  # a new object: the step in flight has the old

    def finish(self, i: int) -> None:
        row = self._rows[i]
        row.finished, row.pending = True, []
        if row.future is not None and not row.future.done():
            row.future.cancel()
        row.future = None
        if self._wake is not None:
            self._wake.set()

    async def aclose(self) -> None:
        self._closed = True
        if self._task is not None:
            self._wake.set()
            await asyncio.gather(self._task, return_exceptions=True)
        for row in self._rows:
            if row.future is not None and not row.future.done():
                row.future.set_exception(RuntimeError("session closed"))
        self._batch = None  # frees the cache

    # ---- the engine ----

    async def _engine(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await self._join(range(len(self._rows)), self._gen.join_wait_max_s)  # the first step: every row's prompt
            while not self._closed:
                t0 = time.perf_counter()
                plan = self._plan()
                self.stats["loop_s"] += time.perf_counter() - t0
                if plan is None:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                tokens, logprobs = await loop.run_in_executor(self._gen.executor, self._run_step, plan)
                t0 = time.perf_counter()
                returning = self._apply(plan, tokens, logprobs)
                self.stats["loop_s"] += time.perf_counter() - t0
                await self._join(returning)
        except BaseException as e:  # a failed forward fails every waiting request, never silently
            self._error = e
            for row in self._rows:
                if row.future is not None and not row.future.done():
                    row.future.set_exception(RuntimeError(f"generation failed: {e!r}"))
            if not isinstance(e, Exception):
                raise

    async def _join(self, returning: Iterable[int], budget: float | None = None) -> None:
        """Let the rows whose line just ended (now executing it) rejoin the next step, if they are quick."""
        await asyncio.sleep(0)  # callers that answer at once (e.g. a "... " prompt) join the next step
        if budget is None:
            budget = min(self._gen.join_wait_max_s, self._gen.join_wait_frac * self._last_step_s)
        t0 = time.perf_counter()
        while not self._closed and budget > 0:
            away = [r for r in returning if self._rows[r].future is None and not self._rows[r].finished]
            left = budget - (time.perf_counter() - t0)
            if not away or left <= 0:
                break
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except asyncio.TimeoutError:
                break
        self.stats["join_wait_s"] += time.perf_counter() - t0

    def _feedable(self, row: _Row) -> int:
        # A row with no request holds back its last pending token, so a request always has a token to feed and
        # the step that feeds it yields the row's next-token logits.
        if row.finished:
            return 0
        return len(row.pending) if row.future is not None else max(len(row.pending) - 1, 0)

    def _plan(self) -> _StepPlan | None:
        for i, row in enumerate(self._rows):
            if row.future is not None and row.future.cancelled():  # the caller gave up on this episode
                self.finish(i)
        feedable = [self._feedable(row) for row in self._rows]
        if not any(feedable):
            return None
        free = [i for i, row in enumerate(self._rows) if row.finished and not row.freed]
        for i in free:
            self._rows[i].freed = True
        first = not any(self._batch.cache.lengths)
        budget = self._gen.max_prefill_tokens if first else self._gen.max_step_tokens
        counts = [min(f, 1) for f in feedable]                     # every row with tokens moves this step...
        spare = max(budget - sum(counts), 0)
        for i, f in enumerate(feedable):                           # ...and the rest of the budget goes in order
            extra = min(f - counts[i], spare)
            counts[i] += extra
            spare -= extra
        plan = _StepPlan(free, self._cuts, self._forks, {}, [], [], [], [])
        self._forks, self._cuts = [], []
        for i, (row, n) in enumerate(zip(self._rows, counts, strict=True)):
            if not n:
                continue
            plan.feed[i] = row.pending[:n]
            del row.pending[:n]
            if row.future is not None and not row.pending:
                plan.sample_rows.append(i)
                plan.generators.append(row.generator)
                plan.line_starts.append(not row.line_ids)
                plan.futures.append(row.future)
        return plan

    def _run_step(self, plan: _StepPlan) -> tuple[list[int], list[float]]:
        """Worker thread: fork, free, forward, sample."""
        t0 = time.perf_counter()
        batch = self._batch
        with torch.inference_mode():
            batch.truncate(plan.cuts)  # before forking: a fork made after a rollback copies what the row kept
            if plan.forks:  # before freeing: a source row that finished since its fork still hands its cache on
                self.stats["forked_tokens"] += batch.fork(plan.forks)
                self.stats["forked_rows"] += sum(len(dsts) for _, dsts, _ in plan.forks)
                self.stats["fork_s"] += time.perf_counter() - t0
            batch.free(plan.free_slots)
            t1 = time.perf_counter()
            logits = batch.forward(plan.feed, plan.sample_rows)                   # [S, V]
            t2 = time.perf_counter()
            tokens: list[int] = []
            chosen: list[float] = []
            if plan.sample_rows:
                banned = self._masks.at(torch.tensor(plan.line_starts, device=logits.device))  # [S, V]
                logprobs = sampling_logprobs(logits, self.sampling, banned)                   # [S, V]
                sampled = sample(logprobs, plan.generators)                                    # [S]
                tokens = sampled.tolist()
                chosen = logprobs.gather(1, sampled[:, None])[:, 0].tolist()
        fed = sum(len(f) for f in plan.feed.values())
        self._last_step_s = time.perf_counter() - t0
        self.stats["forward_s"] += t2 - t1
        self.stats["worker_s"] += self._last_step_s
        self.stats["steps"] += 1
        self.stats["fed_tokens"] += fed
        self.stats["max_step_tokens"] = max(self.stats["max_step_tokens"], fed)
        self.stats["rows_freed"] += len(plan.free_slots)
        return tokens, chosen

    def _apply(self, plan: _StepPlan, tokens: list[int], logprobs: list[float]) -> list[int]:
        """Append the sampled tokens; resolve the lines that ended. Returns the rows whose line ended."""
        max_line = self.sampling.max_line_tokens
        self.stats["sampled_tokens"] += len(tokens)
        ended = []
        for r, tok, lp, future in zip(plan.sample_rows, tokens, logprobs, plan.futures, strict=True):
            row = self._rows[r]
            if row.finished or row.future is None or row.future is not future:  # rolled back since
                continue
            if row.future.done():  # cancelled by the caller
                self.finish(r)
                continue
            row.line_ids.append(tok)
            row.line_logprobs.append(lp)
            row.pending.append(tok)
            row.ids.append(tok)
            if tok in self._eos:
                finish = "eos"
            elif tok in self._line_end:
                finish = "newline"
            elif len(row.line_ids) >= max_line:
                finish = "length"
            else:
                continue
            row.future.set_result(LineSample(row.line_ids, row.line_logprobs, finish))
            row.future, row.line_ids, row.line_logprobs = None, [], []
            ended.append(r)
        return ended


class HFGenerator:
    """Generator over a transformers causal LM (full-attention decoders: Llama, Qwen2, SmolLM, ...).

    ``max_step_tokens`` bounds the tokens fed in one step after the first (every row with tokens feeds at least
    one; long interpreter outputs are prefilled in chunks), ``max_prefill_tokens`` the first step's, which prefills
    the prompts. ``join_wait_frac`` and ``join_wait_max_s`` bound how long a step waits for rows executing their
    line (see the module docstring; 0 never waits). ``num_threads`` sets torch's intra-op threads of the worker
    thread only (default ``GEN_THREADS``; None: torch's default); on a small CPU shared with busy processes (sandbox
    kernels), 1 avoids the stalls of a multi-threaded forward whose threads wait on each other.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        device: str | torch.device | None = None,
        max_step_tokens: int = 1024,
        max_prefill_tokens: int = 8192,
        num_threads: int | None = GEN_THREADS,
        join_wait_frac: float = 0.25,
        join_wait_max_s: float = 0.05,
    ):
        layer_types = set(getattr(model.config.get_text_config(), "layer_types", None) or [])
        if layer_types - {"full_attention"}:
            # packed attention is full causal attention: it would silently replace sliding-window (or linear) layers
            raise ValueError(f"HFGenerator needs a full-attention decoder, not one with {sorted(layer_types)} layers")
        if device is None:
            model_device = next(model.parameters()).device
            device = model_device if model_device.type != "cpu" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.tokenizer = tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.max_step_tokens, self.max_prefill_tokens = max(1, max_step_tokens), max(1, max_prefill_tokens)
        self.join_wait_frac, self.join_wait_max_s = join_wait_frac, join_wait_max_s
        self.num_threads = num_threads
        self._executor: ThreadPoolExecutor | None = None
        self.version = 0
        """The policy version sessions sample with (``sync_weights``'s)."""

    own_weights = False
    """Sessions sample from the module itself: no copy of the weights to fill."""
    last_sync_transport = ""
    """Nothing moves in a sync."""

    @classmethod
    def from_pretrained(
        cls, spec: str, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None, **kwargs: Any
    ) -> HFGenerator:
        """Load ``spec`` with ``replrl.models.load_model_and_tokenizer`` (hub id, directory, .gguf, alias)."""
        from replrl.models import load_model_and_tokenizer

        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        model, tokenizer = load_model_and_tokenizer(spec, dtype=dtype, device=device)
        return cls(model, tokenizer, device=device, **kwargs)

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The one worker thread that runs forward passes, off the event loop."""
        if self._executor is None:
            init = None if self.num_threads is None else (lambda: torch.set_num_threads(self.num_threads))
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replrl-hf", initializer=init)
        return self._executor

    def session(self, prompts: list[list[int]], sampling: SamplingParams) -> HFSession:
        """Open a session: one row per prompt. Puts the model in eval mode (no dropout while sampling)."""
        self.model.eval()
        return HFSession(self, prompts, sampling)

    def sync_weights(self, model: Any, version: int | None = None) -> None:
        """Nothing to copy: sessions sample from the module itself, and its cache lives only as long as a session.
        A different module than the one given at construction is sampled from from now on."""
        if model is not self.model:
            self.model = model.to(self.device)
        self.version = self.version + 1 if version is None else int(version)

    def close(self) -> None:
        """Stop the worker thread (a later session starts a new one)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
