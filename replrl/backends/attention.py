"""Packed attention for the sampler: each step is one flat sequence of every row's new tokens, no padding.

The sampler feeds a step as ``input_ids`` [1, N]: row after row, each row's new tokens (its last sampled token, or
the interpreter output being prefilled, or its prompt). The projections and MLPs, most of a forward's cost, run on
those N real tokens only. Attention is the one place rows must be kept apart: ``PackedKV.update`` (called by each
attention layer with the new keys/values) appends each row's slice after that row's cached tokens, and
``packed_attention_forward`` attends each row's queries to that row's tokens, causally. Rows never pad to a common
width and the cache holds no holes, so a row prefilling 60 tokens of a traceback adds its 60 tokens of work to the
step and nothing to the other rows.

transformers calls the attention through ``AttentionInterface`` (registered here under ``NAME``, with no mask
function, so it builds no mask) and the cache through ``past_key_values.update``; ``packed_attention`` switches a
model to it for the sampler's own forward calls. Training runs plain full sequences with the model's own attention.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

NAME = "replrl_packed"


@dataclass(frozen=True)
class Segment:
    """Row ``slot``'s ``count`` tokens at ``start`` of the packed step, after its ``cached`` tokens."""

    slot: int
    start: int
    count: int
    cached: int


class PackedKV(DynamicCache):
    """Per-layer key/value buffers [2, rows, kv_heads, capacity, head_dim]: row ``slot``'s tokens at columns
    ``0 .. lengths[slot]-1``, no holes. Capacity doubles when a row outgrows it; unused columns hold zeros.

    A DynamicCache only so transformers treats it as a cache; its own layer list stays empty. ``plan(segments)``
    sets the layout of the step about to run, ``commit()`` counts its tokens as cached once it has run.
    """

    def __init__(self, n_rows: int, device: torch.device):
        super().__init__()
        self.n_rows, self.device = n_rows, device
        self.lengths = [0] * n_rows
        self.buffers: list[torch.Tensor] = []
        self.segments: list[Segment] = []

    def plan(self, segments: list[Segment]) -> None:
        """Index tensors shared by every layer of the step (built once here, not per layer)."""
        dev = self.device
        self.segments = segments
        self._end = max(s.cached + s.count for s in segments)
        self._slot_of = torch.tensor([s.slot for s in segments for _ in range(s.count)], device=dev)  # [N]
        self._col_of = torch.cat([torch.arange(s.cached, s.cached + s.count, device=dev) for s in segments])  # [N]
        decode = [s for s in segments if s.count == 1]
        self.prefills = [s for s in segments if s.count > 1]
        self.prefill_masks = [  # per prefill: [n, n], True where a new token would see a later one
            torch.ones(s.count, s.count, dtype=torch.bool, device=dev).triu(1) for s in self.prefills
        ]
        self.decode = None
        if decode:  # one batched attention over the slot range spanning the decoding rows
            lo, hi = decode[0].slot, decode[-1].slot + 1
            width = max(s.cached + 1 for s in decode)
            local = torch.tensor([s.slot - lo for s in decode], device=dev)                # [R]
            lengths = torch.ones(hi - lo, dtype=torch.long, device=dev)                     # rows not decoding: 1
            lengths[local] = torch.tensor([s.cached + 1 for s in decode], device=dev)
            mask = torch.arange(width, device=dev)[None, :] < lengths[:, None]              # [hi-lo, width]
            starts = torch.tensor([s.start for s in decode], device=dev)                    # [R]
            self.decode = (lo, hi, width, local, starts, mask[:, None, None, :])

    def _ensure_capacity(self, layer_idx: int, like: torch.Tensor) -> torch.Tensor:
        while len(self.buffers) <= layer_idx:
            self.buffers.append(like.new_zeros(2, self.n_rows, like.shape[0], 0, like.shape[2]))
        buf = self.buffers[layer_idx]
        if buf.shape[3] < self._end:
            grown = buf.new_zeros(*buf.shape[:3], max(2 * self._end, 64), buf.shape[4])
            grown[:, :, :, : buf.shape[3]] = buf
            self.buffers[layer_idx] = buf = grown
        return buf

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        buf = self._ensure_capacity(layer_idx, key_states[0])
        buf[0, self._slot_of, :, self._col_of] = key_states[0].transpose(0, 1)          # [N, kv_heads, head_dim]
        buf[1, self._slot_of, :, self._col_of] = value_states[0].transpose(0, 1)
        return key_states, value_states

    def commit(self) -> None:
        """The step's forward is done: its tokens count as cached."""
        for seg in self.segments:
            self.lengths[seg.slot] = seg.cached + seg.count
        self.segments, self.decode, self.prefills, self.prefill_masks = [], None, [], []

    def free(self, slot: int) -> None:
        """Row ``slot`` is done (its columns are simply no longer read)."""
        self.lengths[slot] = 0

    def truncate(self, slot: int, length: int) -> None:
        """Row ``slot`` keeps its first ``length`` cached tokens (a rollback; the columns after are written over by
        the tokens it is fed next)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"row {slot} holds {self.lengths[slot]} cached tokens, not {length}")
        self.lengths[slot] = length

    def fork(self, src: int, dsts: list[int], length: int | None = None) -> int:
        """Rows ``dsts`` (new slots, or free ones) start with row ``src``'s first ``length`` cached tokens (default:
        all), copied: an episode that branches (a tree rollout) hands its children its prefix's keys and values
        instead of having them computed again (causal attention: a prefix's keys and values do not depend on what
        follows it). Slots past ``n_rows`` are added (the row dimension doubles, so a tree's forks grow it a few
        times). Returns the tokens copied per row."""
        if max(dsts) >= self.n_rows:
            self._grow_rows(max(max(dsts) + 1, 2 * self.n_rows))
        n = self.lengths[src] if length is None else length
        if not 0 <= n <= self.lengths[src]:
            raise ValueError(f"row {src} holds {self.lengths[src]} cached tokens, not {n}")
        index = torch.tensor(dsts, device=self.device)
        for buf in self.buffers:
            buf[:, index, :, :n] = buf[:, src : src + 1, :, :n]                    # [2, len(dsts), KV, n, D]
        for d in dsts:
            self.lengths[d] = n
        return n

    def _grow_rows(self, n_rows: int) -> None:
        for layer, buf in enumerate(self.buffers):
            grown = buf.new_zeros(buf.shape[0], n_rows, *buf.shape[2:])
            grown[:, : buf.shape[1]] = buf
            self.buffers[layer] = grown
        self.lengths += [0] * (n_rows - self.n_rows)
        self.n_rows = n_rows

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return max(self.lengths, default=0)


_active = threading.local()


def packed_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None,
                             dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [1, H, N, D] (the packed step) -> [1, N, H, D]; keys/values come from the active PackedKV.

    Rows decoding one token share one attention call over their slot range (query heads grouped by the KV head
    they share, so K/V are never copied per query head); a row feeding several tokens (a prompt, an interpreter
    output) gets its own call with a causal mask offset by its cache."""
    cache: PackedKV = _active.cache
    _, H, N, D = query.shape
    buf = cache.buffers[module.layer_idx]                                     # [2, B, KV, cap, D]
    kv_heads = buf.shape[2]
    g = H // kv_heads                                                         # query heads per KV head
    out = query.new_empty(N, H, D)
    if cache.decode is not None:
        lo, hi, width, local, starts, mask = cache.decode
        q = query.new_zeros(hi - lo, H, D)
        q[local] = query[0, :, starts].transpose(0, 1)                        # [R, H, D]
        o = F.scaled_dot_product_attention(q.view(hi - lo, kv_heads, g, D), buf[0, lo:hi, :, :width],
                                           buf[1, lo:hi, :, :width], attn_mask=mask, scale=scaling)
        out[starts] = o.reshape(hi - lo, H, D)[local]                         # CUDA's SDPA output is not contiguous
    scale = scaling if scaling is not None else D**-0.5
    for seg, causal in zip(cache.prefills, cache.prefill_masks, strict=True):
        # plain matmuls: SDPA with an explicit mask is ~3x slower here on a CPU (it scans the mask for -inf rows)
        n, end = seg.count, seg.cached + seg.count
        q = query[0, :, seg.start : seg.start + n].reshape(kv_heads, g * n, D)
        scores = torch.matmul(q, buf[0, seg.slot, :, :end].transpose(-1, -2)) * scale  # [KV, g*n, end]
        scores.view(kv_heads, g, n, end)[..., seg.cached :].masked_fill_(causal, float("-inf"))  # no peeking ahead
        probs = scores.softmax(-1, dtype=torch.float32).to(query.dtype)
        o = torch.matmul(probs, buf[1, seg.slot, :, :end])                    # [KV, g*n, D]
        out[seg.start : seg.start + n] = o.view(H, n, D).transpose(0, 1)
    return out[None], None


_registered = False


def _register() -> bool:
    global _registered
    if not _registered:
        try:
            from transformers import AttentionInterface

            AttentionInterface.register(NAME, packed_attention_forward)
            _registered = True
        except ImportError:
            return False
    return True


@contextlib.contextmanager
def packed_attention(model: Any, cache: PackedKV) -> Iterator[None]:
    """Run ``model``'s forward calls inside the block with packed attention over ``cache``."""
    config = model.config
    if not _register():
        raise RuntimeError("the transformers backend needs transformers' AttentionInterface (transformers >= 4.50)")
    previous = config._attn_implementation
    config._attn_implementation = NAME
    _active.cache = cache
    try:
        yield
    finally:
        config._attn_implementation = previous
        _active.cache = None
