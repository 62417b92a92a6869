"""Weights streamed in bounded buckets, for a weight sync that never holds a second copy of the whole model.

The policy's weights are gathered one tensor at a time (under FSDP2 a DTensor's ``full_tensor()``: an all-gather
that every rank must run, in the same order), packed into buckets of about ``bucket_bytes``, and each bucket is
handed to a transport as soon as it is full, then dropped. A bucket never splits a decoder layer (every
``...layers.<i>.`` tensor of one layer goes in the same bucket): an inference engine that reloads and post-processes
its weights module by module (vLLM's in-place reload, whose fused q/k/v and gate/up projections need all their parts
at once) can take each bucket as a load of its own. What a sync holds beyond the model is therefore one bucket: at
most ``max(bucket_bytes, the largest layer)`` of gathered tensors (under DDP the tensors are the parameters
themselves, not copies), plus whatever the transport keeps (its buffer, sized for one bucket).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

Named = tuple[str, torch.Tensor]
"""(checkpoint name, tensor)."""

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


class Transport(Protocol):
    """Where a bucket goes (an engine's loader, a shared-memory buffer, a recorder in a test)."""

    def send(self, bucket: list[Named]) -> None:
        """Take the bucket's tensors (full, on any device); they may be freed when it returns."""
        ...


@dataclass
class StreamFigures:
    """What a streamed sync moved."""

    tensors: int = 0
    buckets: int = 0
    bytes: int = 0
    """All the tensors' bytes (the model's size in the sync's dtypes)."""
    largest_bucket_bytes: int = 0
    """The most a bucket held: the sync's extra memory, beyond the model, before the transport's own buffer."""


def layer_of(name: str) -> str:
    """The decoder layer a weight belongs to (``model.layers.3``), or the name itself outside the layers."""
    match = _LAYER.match(name)
    return match.group(1) if match else name


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole and detached: a DTensor (FSDP2's shard) all-gathered by ``full_tensor()``, which every rank must
    call for the same tensors in the same order; any other tensor as it is (no copy)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def plan(named: list[Named], bucket_bytes: int) -> list[list[int]]:
    """The buckets, as indices into ``named``, planned from the tensors' whole shapes (a DTensor's ``shape`` is the
    whole one: nothing is gathered to plan): consecutive tensors, at most ``bucket_bytes`` a bucket, a decoder layer
    never split (a layer larger than ``bucket_bytes`` is a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    groups: list[tuple[list[int], int]] = []  # (indices, bytes) of each layer, or of each tensor outside layers
    for i, (name, t) in enumerate(named):
        layer = layer_of(name)
        if groups and layer_of(named[groups[-1][0][-1]][0]) == layer and layer != name:
            groups[-1][0].append(i)
            groups[-1] = (groups[-1][0], groups[-1][1] + nbytes(t))
        else:
            groups.append(([i], nbytes(t)))
    out: list[list[int]] = []
    size = 0
    for indices, group_size in groups:
        if out and size + group_size <= bucket_bytes:
            out[-1] += indices
            size += group_size
        else:
            out.append(list(indices))
            size = group_size
    return out


def stream(named: Iterable[Named], transport: Transport, bucket_bytes: int) -> StreamFigures:
    """Send ``named`` (sharded or not) to ``transport`` bucket by bucket (``plan``), each bucket's tensors gathered
    (``whole``) just before it goes and dropped after: at most one bucket is held at a time. Returns what moved."""
    named = list(named)
    figures = StreamFigures()
    for indices in plan(named, bucket_bytes):
        bucket = [(named[i][0], whole(named[i][1])) for i in indices]
        size = sum(nbytes(t) for _, t in bucket)
        transport.send(bucket)
        del bucket
        figures.tensors += len(indices)
        figures.buckets += 1
        figures.bytes += size
        figures.largest_bucket_bytes = max(figures.largest_bucket_bytes, size)
    return figures
