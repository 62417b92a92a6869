"""Grouped-query attention for the sampler's decode steps, without copying K/V per query head.

transformers' SDPA path expands the KV heads to all query heads (``repeat_kv``) whenever an attention mask is given,
which the sampler always gives (holes, ragged rows). With a cache of T columns that is a fresh [B, H, T, D] copy of
K and V in every layer of every step, the largest cost of a CPU decode step after the weights (measured: ~60 ms of a
~270 ms step at B=8, T=600 for SmolLM2-135M). Here the query heads are grouped by the KV head they share and scored
against it directly; the [B, 1, q, T] mask is broadcast over the group.

Only the sampler uses it, around its own forward calls (``grouped_attention(model)``): training runs full sequences,
where SDPA's fused kernel saves memory that this plain version would spend on [B, H, T, T] scores.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

NAME = "replrl_grouped"


def grouped_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, scaling: float | None = None,
                              dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    B, H, q, D = query.shape
    KV, T = key.shape[1], key.shape[2]
    g = H // KV                                                               # query heads per KV head
    scale = scaling if scaling is not None else D ** -0.5
    scores = torch.matmul(query.reshape(B, KV, g * q, D), key.transpose(-1, -2)) * scale  # [B, KV, g*q, T]
    if attention_mask is not None:
        mask = attention_mask[:, :, None, :, :T]                              # [B, 1, 1, q, T]
        scores = (scores.view(B, KV, g, q, T) + mask).view(B, KV, g * q, T)
    probs = scores.softmax(-1, dtype=torch.float32).to(value.dtype)           # [B, KV, g*q, T]
    out = torch.matmul(probs, value)                                          # [B, KV, g*q, D]
    return out.view(B, H, q, D).transpose(1, 2).contiguous(), None            # [B, q, H, D]


_registered = False


def _register() -> bool:
    global _registered
    if not _registered:
        try:
            from transformers import AttentionInterface

            AttentionInterface.register(NAME, grouped_attention_forward)
            _registered = True
        except ImportError:  # older transformers: keep its own attention
            return False
    return True


@contextlib.contextmanager
def grouped_attention(model: Any) -> Iterator[None]:
    """Run ``model``'s forward calls inside the block with grouped attention (full-attention decoders only)."""
    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None)
    if config is None or previous in (None, "flash_attention_2", "flash_attention_3") or not _register():
        yield
        return
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
