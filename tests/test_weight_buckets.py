"""Planning a streamed weight sync's buckets (replrl.backends.weight_buckets; the 2-process FSDP2 stream is in
tests/test_fsdp.py)."""

from __future__ import annotations

import pytest
import torch

from replrl.backends.weight_buckets import layer_of, plan, stream

# float32 tensors of 4, 8, 8, 8, 8, 4 elements: 16, 32+32 (layer 0), 32+32 (layer 1), 16 bytes
NAMED = [("model.embed_tokens.weight", torch.zeros(4)),
         ("model.layers.0.q.weight", torch.zeros(8)), ("model.layers.0.k.weight", torch.zeros(8)),
         ("model.layers.1.q.weight", torch.zeros(8)), ("model.layers.1.k.weight", torch.zeros(8)),
         ("lm_head.weight", torch.zeros(4))]


def test_layer_of_names_the_decoder_layer_or_the_weight_itself():
    assert layer_of("model.layers.12.mlp.up_proj.weight") == "model.layers.12"
    assert layer_of("base_model.model.model.layers.0.q.weight") == "base_model.model.model.layers.0"
    assert layer_of("lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize("bound, expected", [
    (1, [[0], [1, 2], [3, 4], [5]]),          # smaller than anything: each layer whole, each other weight alone
    (80, [[0, 1, 2], [3, 4, 5]]),            # 16 + 64 fits; layer 1 (64) + head (16) fits
    (64, [[0], [1, 2], [3, 4], [5]]),         # 16 + 64 > 64: a layer is never split, nor joined past the bound
    (1000, [[0, 1, 2, 3, 4, 5]]),
])
def test_buckets_are_consecutive_bounded_and_never_split_a_layer(bound, expected):
    assert plan(NAMED, bound) == expected


def test_stream_hands_every_tensor_once_in_order_and_reports_the_largest_bucket():
    got: list[list[str]] = []

    class Recorder:
        def send(self, bucket):
            got.append([n for n, _ in bucket])

    figures = stream(NAMED, Recorder(), 80)
    assert got == [[n for n, _ in NAMED[:3]], [n for n, _ in NAMED[3:]]]
    assert (figures.buckets, figures.tensors, figures.bytes, figures.largest_bucket_bytes) == (2, 6, 160, 80)
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        plan(NAMED, 0)
