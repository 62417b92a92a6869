"""Generation with transformers: one shared KV cache for all rows of a session, one line at a time.

Every forward step appends the same number of columns ``w`` to every row of the cache [B, heads, T, dim]. A row
feeds up to ``w`` of its pending tokens (its last sampled token, or environment tokens being prefilled),
right-aligned in the step; the columns it does not use are "holes": a pad token that no later query attends to.
Each row keeps its own positions (``position_ids`` skip holes) and the set of its valid cache columns, from which
an explicit 4-D attention mask is built every step, so holes are invisible: the logits equal those of one plain
forward pass over the row's tokens. Rows whose pending tokens run out in a step sample their next token from
the step's last column. Finished rows and accumulated holes are compacted away from time to time.

Threading: all row bookkeeping lives on the event loop thread; tensors (cache, forward, sampling) live on one
worker thread. The loop thread plans a step (which tokens each row feeds, who samples), the worker runs it, the
loop thread applies the sampled tokens and resolves the finished lines' futures.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from replrl.backends.attention import grouped_attention
from replrl.backends.sampling import TokenMasks, eos_ids, line_end_ids, sample, sampling_logprobs, token_masks
from replrl.types import LineSample, SamplingParams


class _GrowingLayer(DynamicLayer):
    """A DynamicLayer that appends into spare capacity instead of ``torch.cat`` (which copies the whole layer's
    cache at every step); keys/values are views [B, heads, T, dim] of buffers [B, heads, capacity, dim]."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._set(key_states[:, :, :0], value_states[:, :, :0])
        self.is_initialized = True

    def _set(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._kbuf, self._vbuf, self._len = keys, values, keys.shape[-2]
        self.keys, self.values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t, n = self._len, key_states.shape[-2]
        if t + n > self._kbuf.shape[-2]:
            b, h, _, d = key_states.shape
            capacity = max(2 * (t + n), 64)
            kbuf = key_states.new_empty(b, h, capacity, d)
            vbuf = value_states.new_empty(b, value_states.shape[1], capacity, value_states.shape[-1])
            kbuf[:, :, :t], vbuf[:, :, :t] = self._kbuf[:, :, :t], self._vbuf[:, :, :t]
            self._kbuf, self._vbuf = kbuf, vbuf
        self._kbuf[:, :, t : t + n] = key_states
        self._vbuf[:, :, t : t + n] = value_states
        self._len = t + n
        self.keys, self.values = self._kbuf[:, :, : t + n], self._vbuf[:, :, : t + n]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len if self.is_initialized else 0

    def reset(self) -> None:
        super().reset()
        self._kbuf = self._vbuf = None
        self._len = 0

    def select_rows(self, slots: torch.Tensor) -> None:
        """Keep only the rows ``slots`` (LongTensor [B'])."""
        if self.is_initialized:
            self._set(self.keys.index_select(0, slots), self.values.index_select(0, slots))

    def gather_columns(self, columns: torch.Tensor) -> None:
        """Row b's new column j is its old column ``columns[b, j]`` (LongTensor [B, T'])."""
        if self.is_initialized:
            b, h, _, d = self.keys.shape
            index = columns[:, None, :, None]                                 # [B, 1, T', 1]
            self._set(
                self.keys.gather(2, index.expand(b, h, -1, d)),
                self.values.gather(2, index.expand(b, self.values.shape[1], -1, self.values.shape[-1])),
            )


class _Batch:
    """Worker-thread tensor state of a session: the shared cache, each row's valid columns and next position."""

    def __init__(self, model: Any, n_rows: int, pad_id: int, device: torch.device):
        self.model, self.pad_id, self.device = model, pad_id, device
        self.cache = DynamicCache()
        self.cache.layer_class_to_replicate = _GrowingLayer
        self.valid = torch.zeros(n_rows, 0, dtype=torch.bool, device=device)  # [B, T] column holds a real token
        self.pos = torch.zeros(n_rows, dtype=torch.long, device=device)       # [B] next position of each row
        self.min_value = torch.finfo(model.dtype).min

    def select_rows(self, slots: list[int]) -> None:
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            layer.select_rows(index)
        self.valid, self.pos = self.valid[index], self.pos[index]

    def compact_columns(self) -> None:
        """Move each row's valid columns to the right end (in order), holes to the left; T becomes the longest row."""
        n_valid = self.valid.sum(1)                                            # [B]
        width = int(n_valid.max()) if len(n_valid) else 0
        rows, cols = self.valid.nonzero(as_tuple=True)
        rank = self.valid.cumsum(1)[rows, cols] - 1                           # index among the row's valid columns
        columns = torch.zeros(len(n_valid), width, dtype=torch.long, device=self.device)
        columns[rows, width - n_valid[rows] + rank] = cols                     # holes copy column 0, never read
        for layer in self.cache.layers:
            layer.gather_columns(columns)
        self.valid = torch.arange(width, device=self.device)[None, :] >= (width - n_valid)[:, None]

    def forward(self, feed: list[list[int]], width: int) -> torch.Tensor:
        """Append ``width`` columns: row b's tokens ``feed[b]`` right-aligned, holes before. Returns the logits of
        the last column [B, V] (the next-token logits of every row that fed at least one token)."""
        b, t, w = len(feed), self.valid.shape[1], width
        n = torch.tensor([len(f) for f in feed], device=self.device)          # [B] real tokens this step
        ids = torch.tensor([[self.pad_id] * (w - len(f)) + f for f in feed], device=self.device)  # [B, w]
        col = torch.arange(w, device=self.device)
        first = (w - n)[:, None]                                               # [B, 1] first real column
        new_valid = col[None, :] >= first                                      # [B, w]
        position_ids = self.pos[:, None] + (col[None, :] - first).clamp(min=0)  # [B, w] holes: any position
        causal = col[None, :] <= col[:, None]                                  # [w(query), w(key)]
        chunk = (causal[None] & new_valid[:, None, :]) | torch.eye(w, dtype=torch.bool, device=self.device)
        allowed = torch.cat([self.valid[:, None, :].expand(b, w, t), chunk], dim=-1)  # [B, w, T+w]
        attention_mask = torch.zeros(b, 1, w, t + w, dtype=self.model.dtype, device=self.device)
        attention_mask.masked_fill_(~allowed[:, None], self.min_value)       # [B, 1, w, T+w] additive
        with grouped_attention(self.model):
            out = self.model(
                input_ids=ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=1,
            )
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        self.pos += n
        return out.logits[:, -1]


@dataclass
class _Row:
    """Loop-thread state of one row (episode)."""

    pending: list[int]
    """Tokens not yet in the cache, fed in order."""
    generator: torch.Generator
    n_valid: int = 0
    """Tokens of this row in the cache."""
    future: asyncio.Future | None = None
    """The caller's pending next_line request."""
    line_ids: list[int] = field(default_factory=list)
    line_logprobs: list[float] = field(default_factory=list)
    finished: bool = False


@dataclass
class _StepPlan:
    keep_slots: list[int] | None
    """Drop finished rows first: the slots to keep, in order (None: keep all)."""
    compact_columns: bool
    width: int
    feed: list[list[int]]
    """Per slot (after dropping), the tokens fed this step."""
    sample_slots: list[int]
    sample_rows: list[int]
    generators: list[torch.Generator]
    line_starts: list[bool]
    """Per sampling slot: the token sampled is the first of its line (prompt healing's mask applies)."""


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
        self._rows = [_Row(list(p), self._row_generator(i)) for i, p in enumerate(prompts)]
        self._slots = list(range(len(prompts)))  # slot -> row index
        self._width = 0  # T, columns in the cache
        self._batch = _Batch(gen.model, len(prompts), gen.pad_id, gen.device)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self._error: BaseException | None = None
        self.stats = {"steps": 0, "columns": 0, "fed_tokens": 0, "sampled_tokens": 0, "row_drops": 0,
                      "column_compactions": 0, "worker_s": 0.0, "forward_s": 0.0, "loop_s": 0.0}
        """Counters: forward steps, cache columns appended (B*w summed), real tokens fed, tokens sampled,
        compactions, seconds in the worker step / in model.forward / planning and applying on the loop thread."""

    def _row_generator(self, i: int) -> torch.Generator:
        g = torch.Generator(device=self._gen.device)
        if self.sampling.seed is None:
            g.seed()
        else:  # one stream per row: a row's samples do not depend on which other rows share its steps
            g.manual_seed((self.sampling.seed * 1_000_003 + i) % (2**63))
        return g

    # ---- the GenSession API (event loop thread) ----

    async def next_line(self, i: int, env_ids: list[int]) -> LineSample:
        if self._error is not None:
            raise RuntimeError(f"generation failed: {self._error!r}") from self._error
        if self._closed:
            raise RuntimeError("session is closed")
        row = self._rows[i]
        if row.finished:
            raise ValueError(f"row {i} is finished")
        if row.future is not None:
            raise RuntimeError(f"row {i} already has a pending next_line request")
        loop = asyncio.get_running_loop()
        row.pending.extend(env_ids)
        row.future = loop.create_future()
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._engine())
        self._wake.set()
        return await row.future

    def finish(self, i: int) -> None:
        row = self._rows[i]
        row.finished, row.pending = True, []
        if row.future is not None and not row.future.done():
            row.future.cancel()
        row.future = None

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
                self._apply(plan, tokens, logprobs)
                self.stats["loop_s"] += time.perf_counter() - t0
                await asyncio.sleep(0)  # callers that answer at once (e.g. a "... " prompt) join the next step
        except BaseException as e:  # a failed forward fails every waiting request, never silently
            self._error = e
            for row in self._rows:
                if row.future is not None and not row.future.done():
                    row.future.set_exception(RuntimeError(f"generation failed: {e!r}"))
            if not isinstance(e, Exception):
                raise

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
        feedable = [self._feedable(self._rows[r]) for r in self._slots]
        if not any(feedable):
            return None
        gen = self._gen
        keep = None
        n_finished = sum(self._rows[r].finished for r in self._slots)
        if self._width > 0 and n_finished and n_finished >= gen.compact_finished_frac * len(self._slots):
            keep = [s for s, r in enumerate(self._slots) if not self._rows[r].finished]
            self._slots = [self._slots[s] for s in keep]
            feedable = [feedable[s] for s in keep]
        longest = max(self._rows[r].n_valid for r in self._slots)
        compact = self._width - longest >= gen.compact_min_holes and self._width > gen.compact_hole_factor * longest
        if compact:
            self._width = longest
        n_slots = len(self._slots)
        if self._width == 0:  # the first step prefills the prompts
            width = min(max(feedable), max(1, gen.max_prefill_tokens // n_slots))
        else:
            width = choose_width(feedable, max(1, gen.max_step_tokens // n_slots), gen.step_overhead_tokens)
        feed, sample_slots, sample_rows, generators, line_starts = [], [], [], [], []
        for s, r in enumerate(self._slots):
            row = self._rows[r]
            n = min(feedable[s], width)
            feed.append(row.pending[:n])
            del row.pending[:n]
            row.n_valid += n
            if n and row.future is not None and not row.pending:
                sample_slots.append(s)
                sample_rows.append(r)
                generators.append(row.generator)
                line_starts.append(not row.line_ids)
        self._width += width
        return _StepPlan(keep, compact, width, feed, sample_slots, sample_rows, generators, line_starts)

    def _run_step(self, plan: _StepPlan) -> tuple[list[int], list[float]]:
        """Worker thread: compact, forward, sample."""
        t0 = time.perf_counter()
        batch = self._batch
        with torch.inference_mode():
            if plan.keep_slots is not None:
                batch.select_rows(plan.keep_slots)
            if plan.compact_columns:
                batch.compact_columns()
            t1 = time.perf_counter()
            logits = batch.forward(plan.feed, plan.width)                      # [B, V]
            t2 = time.perf_counter()
            tokens: list[int] = []
            chosen: list[float] = []
            if plan.sample_slots:
                slots = torch.tensor(plan.sample_slots, device=logits.device)
                banned = self._masks.at(torch.tensor(plan.line_starts, device=logits.device))  # [S, V]
                logprobs = sampling_logprobs(logits[slots], self.sampling, banned)            # [S, V]
                sampled = sample(logprobs, plan.generators)                            # [S]
                tokens = sampled.tolist()
                chosen = logprobs.gather(1, sampled[:, None])[:, 0].tolist()
        self.stats["forward_s"] += t2 - t1
        self.stats["worker_s"] += time.perf_counter() - t0
        self.stats["steps"] += 1
        self.stats["columns"] += len(plan.feed) * plan.width
        self.stats["fed_tokens"] += sum(len(f) for f in plan.feed)
        self.stats["row_drops"] += plan.keep_slots is not None
        self.stats["column_compactions"] += plan.compact_columns
        return tokens, chosen

    def _apply(self, plan: _StepPlan, tokens: list[int], logprobs: list[float]) -> None:
        max_line = self.sampling.max_line_tokens
        self.stats["sampled_tokens"] += len(tokens)
        for r, tok, lp in zip(plan.sample_rows, tokens, logprobs, strict=True):
            row = self._rows[r]
            if row.finished or row.future is None:
                continue
            if row.future.done():  # cancelled by the caller
                self.finish(r)
                continue
            row.line_ids.append(tok)
            row.line_logprobs.append(lp)
            row.pending.append(tok)
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


def choose_width(feedable: list[int], cap: int, overhead: float) -> int:
    """Columns of the next step: the width w <= cap that feeds the most real tokens per unit of cost.

    Every row gets w columns, so a row with fewer than w tokens to feed pays for holes. A step costs about
    ``overhead + rows * w`` token-columns (``overhead``: the fixed cost of a forward, in token-columns), and feeds
    ``sum(min(f, w))`` real tokens. When most rows decode one token while one row prefills a long output, w = 1
    wins: the prefilling row feeds a token per step alongside the others instead of making every row pay for its
    chunk; when many rows have output to prefill, wide steps win.
    """
    best, best_rate = 1, -1.0
    w, top = 1, min(max(feedable), cap)
    while True:
        rate = sum(min(f, w) for f in feedable) / (overhead + len(feedable) * w)
        if rate > best_rate:
            best, best_rate = w, rate
        if w >= top:
            return best
        w = min(2 * w, top)


class HFGenerator:
    """Generator over a transformers causal LM (full-attention decoders: Llama, Qwen2, SmolLM, ...).

    ``max_step_tokens`` bounds B*w of a step after the first (B rows, w columns; w >= 1), ``max_prefill_tokens``
    the first step's, which prefills the prompts. Finished rows are dropped from the cache once they are
    ``compact_finished_frac`` of its rows; the cache is re-packed when its width exceeds ``compact_hole_factor``
    times the longest row (and by at least ``compact_min_holes`` columns). A step's width is chosen by
    ``choose_width`` with ``step_overhead_tokens``, the fixed cost of a forward in token-columns. ``num_threads``
    sets torch's intra-op threads of the worker thread only (None: torch's default); on a small CPU shared with
    busy processes (sandbox kernels), 1 avoids the stalls of a multi-threaded forward whose threads wait on each
    other.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        device: str | torch.device | None = None,
        max_step_tokens: int = 64,
        max_prefill_tokens: int = 8192,
        compact_finished_frac: float = 0.25,
        compact_hole_factor: float = 2.0,
        compact_min_holes: int = 32,
        num_threads: int | None = None,
        step_overhead_tokens: float = 16.0,
    ):
        layer_types = set(getattr(model.config.get_text_config(), "layer_types", None) or [])
        if layer_types - {"full_attention"}:
            # the explicit 4-D mask would silently replace sliding-window (or linear) attention
            raise ValueError(f"HFGenerator needs a full-attention decoder, not one with {sorted(layer_types)} layers")
        if device is None:
            model_device = next(model.parameters()).device
            device = model_device if model_device.type != "cpu" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.tokenizer = tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.max_step_tokens, self.max_prefill_tokens = max_step_tokens, max_prefill_tokens
        self.compact_finished_frac, self.compact_hole_factor = compact_finished_frac, compact_hole_factor
        self.compact_min_holes = compact_min_holes
        self.step_overhead_tokens = step_overhead_tokens
        self.num_threads = num_threads
        self._executor: ThreadPoolExecutor | None = None

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
