"""vLLM engines on FSDP2 ranks (the CPU build, gloo): every rank holds a shard of a tiny Llama (head size 64, each
decoder layer then the root under ``fully_shard``) and an engine of its own.

    python -m torch.distributed.run --nproc_per_node 2 -m tests.vllm_fsdp_sync OUT_DIR [lora]

The engine starts from the shards (``VLLMGenerator.__init__`` syncs), the sharded model takes one SGD step (the same
rows on every rank: its reduced gradient is one process's), then ``sync_weights`` streams it into each rank's engine
one decoder layer a bucket (every rank gathering the same tensors in the same order: ``full_tensor()``; LoRA: the
adapters merged on the shards first). Each rank samples a probe line from its engine and writes OUT_DIR/rank<r>.pt:
the engine's log-probs, the trainer's on an unsharded twin stepped alike (LoRA: merged by peft), the stale ones (the
model before the step) and the prompt tokens found in the prefix cache."""

from __future__ import annotations

import copy
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from replrl.backends.vllm import VLLMGenerator
from replrl.models import tiny_model
from replrl.types import SamplingParams
from tests.helpers_models import smollm2_tokenizer, with_logit_bias
from tests.test_backend_hf import ids_of, one_id
from tests.test_backend_vllm import probe_logprobs, trained_logprobs


def sgd_step(model: torch.nn.Module, ids: torch.Tensor, start: int, lr: float) -> None:
    """One SGD step raising the log-probs of ``ids[:, start:]``."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    logits = model(input_ids=ids).logits[0, start - 1:-1]                      # [L, V]
    loss = -logits.log_softmax(-1).gather(1, ids[0, start:, None]).mean()
    loss.backward()
    optimizer.step()
    model.eval()


def main(out: str, variant: str = "") -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))  # the engines start at their own pace
    rank, world = dist.get_rank(), dist.get_world_size()
    lora = variant == "lora"
    tok = smollm2_tokenizer()
    model = tiny_model(tok, seed=11, head_dim=64)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)  # the same adapters on every rank (fully_shard keeps each rank's slice of its own)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    twin = copy.deepcopy(model)  # unsharded, stepped alike: what one process would hold
    mesh = init_device_mesh("cpu", (world,))
    base = model.get_base_model() if lora else model
    for layer in base.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert isinstance(base.model.layers[0].self_attn.o_proj.weight if not lora else
                      base.model.layers[0].self_attn.o_proj.base_layer.weight, DTensor)
    gen = VLLMGenerator(model, tok, max_model_len=512, kv_cache_gib=0.25, sync_bucket_bytes=1)  # one layer a bucket
    gen.logit_bias = {one_id(tok, "\n"): 6.0}
    params = SamplingParams(seed=3, max_line_tokens=8)
    prompt = ids_of(tok, "Compute 6 * 7 in the REPL.\n" * 8 + ">>>")
    line, before, _ = probe_logprobs(gen, tok, prompt, params)
    stale_model = copy.deepcopy(twin)
    ids = torch.tensor([prompt + line])
    lr = 20.0 if lora else 2.0
    sgd_step(model, ids, len(prompt), lr)
    sgd_step(twin, ids, len(prompt), lr)
    gen.sync_weights(model)
    line_again, after, cached = probe_logprobs(gen, tok, prompt, params)

    def biased(m: torch.nn.Module) -> torch.nn.Module:
        return with_logit_bias(m.merge_and_unload() if lora else m, gen.logit_bias)

    result = {"world": world, "before": torch.tensor(before),
              "before_expected": trained_logprobs(biased(copy.deepcopy(stale_model)), prompt, line, params),
              "after": torch.tensor(after), "cached": cached, "sync_s": gen.weights.last_sync_s,
              "expected": trained_logprobs(biased(twin), prompt, line_again, params),
              "stale": trained_logprobs(biased(stale_model), prompt, line_again, params)}
    gen.close()
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
