"""Streamed weight sync from FSDP2 shards (replrl.backends.weight_buckets) on 2 CPU processes over gloo:

    python -m torch.distributed.run --nproc_per_node 2 -m tests.weight_stream OUT_DIR [--teardown any]

A tiny Llama sharded with ``fully_shard`` (each decoder layer, then the root), streamed in buckets of 1.5 layers and
of 1 byte into a transport that records what it receives; every rank writes OUT_DIR/rank<r>.pt with, per bucket, the
names and the largest difference from the unsharded model, and the figures. It ends as ``replrl train`` does
(``Ranks.close``); ``--teardown any`` ends as replrl did before, with an all-reduce of a Python tensor (``ranks.any``)
then ``destroy_process_group``, for bench/teardown.py to count the SIGABRTs of that ending beside this one's."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from replrl.backends.weight_buckets import Named, nbytes, stream
from replrl.ranks import Ranks


class Recorder:
    """A transport that keeps, per bucket, its names, bytes and the largest difference from the reference."""

    def __init__(self, reference: dict[str, torch.Tensor]):
        self.reference, self.buckets = reference, []

    def send(self, bucket: list[Named]) -> None:
        assert not any(isinstance(t, DTensor) for _, t in bucket), "a bucket holds whole tensors"
        diff = max(float((t - self.reference[n]).abs().max()) for n, t in bucket)
        self.buckets.append({"names": [n for n, _ in bucket], "bytes": sum(nbytes(t) for _, t in bucket),
                             "diff": diff})


def main(out: str, teardown: str = "close") -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    reference = {n: t.detach().clone() for n, t in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    named = list(model.state_dict().items())
    assert isinstance(named[1][1], DTensor)
    layer_bytes = sum(nbytes(t) for n, t in named if n.startswith("model.layers.0."))
    result = {"layer_bytes": layer_bytes, "model_bytes": sum(nbytes(t) for _, t in named),
              "largest_tensor_bytes": max(nbytes(t) for _, t in named)}
    for label, bound in (("1.5 layers", int(1.5 * layer_bytes)), ("1 byte", 1)):
        recorder = Recorder(reference)
        figures = stream(named, recorder, bound)
        result[label] = {"bound": bound, "buckets": recorder.buckets, "figures": vars(figures)}
    torch.save(result, Path(out) / f"rank{rank}.pt")
    del named, model  # the DTensors and FSDP's state hold the group: gone before it is torn down
    ranks = Ranks(rank, dist.get_world_size(), "cpu")
    if teardown == "any":
        ranks.any(False)
        dist.destroy_process_group()
    else:
        ranks.close()  # every rank here, then the group torn down, as replrl train


if __name__ == "__main__":
    main(sys.argv[1], *(sys.argv[3:4] if sys.argv[2:3] == ["--teardown"] else []))
