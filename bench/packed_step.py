"""What one row's interpreter output costs the other rows' decode step, packed vs padded, side by side.

A step where B-1 rows decode one token each and one row prefills k tokens (say a traceback), over caches of T
tokens per row:

- packed (replrl's HF backend): one sequence of B-1+k real tokens, each row attending to its own cache;
- padded (the usual batched forward: transformers' DynamicCache, a [B, k] batch, a 2-D attention mask): every row
  pays k columns, and every row's cache grows by k.

Also the decode-only step (k = 0) of each. Median ms over a few steps; random keys/values (cost does not depend on
them). Ends with one JSON line.

    python bench/packed_step.py [--model smollm2-135m-instruct] [--rows 8] [--threads 1] [--device cuda]
        [--random-weights]   # --model is then a directory with the model's config.json only (cost does not
                             # depend on the weights; for a machine the weights cannot be copied to)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from transformers import DynamicCache

from replrl.backends.hf import _Batch
from replrl.cli import run_script
from replrl.models import load_model_and_tokenizer


def _dims(model) -> tuple[int, int, int]:
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def packed_ms(model, rows: int, context: int, k: int, steps: int = 5) -> float:
    """Median ms of a packed step over caches of ``context`` tokens: row 0 feeds k tokens, the others one (k = 0:
    a plain decode step of every row)."""
    layers, kv_heads, head_dim = _dims(model)
    device, dtype = model.device, model.dtype
    times = []
    for _ in range(steps):
        batch = _Batch(model, rows, device)
        batch.cache.buffers = [torch.randn(2, rows, kv_heads, context + k + 1, head_dim, device=device, dtype=dtype)
                               for _ in range(layers)]
        batch.cache.lengths = [context] * rows
        feed = {r: [1] * (k if r == 0 and k else 1) for r in range(rows)}
        with torch.inference_mode():
            _sync(device)
            t = time.perf_counter()
            batch.forward(feed, list(range(rows)))
            _sync(device)
            times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def padded_ms(model, rows: int, context: int, k: int, steps: int = 5) -> float:
    layers, kv_heads, head_dim = _dims(model)
    device, dtype = model.device, model.dtype
    width = max(k, 1)
    times = []
    for _ in range(steps):
        cache = DynamicCache()
        for layer in range(layers):
            kv = torch.randn(2, rows, kv_heads, context, head_dim, device=device, dtype=dtype)
            cache.update(*kv.unbind(0), layer)
        ids = torch.ones(rows, width, dtype=torch.long, device=device)
        mask = torch.ones(rows, context + width, dtype=torch.long, device=device)
        mask[1:, context : context + width - 1] = 0  # the decoding rows' holes
        with torch.inference_mode():
            _sync(device)
            t = time.perf_counter()
            model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
            _sync(device)
            times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--random-weights", action="store_true", help="build the model from --model's config.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.random_weights:
        from transformers import AutoConfig, AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model), dtype=torch.float32)
    else:
        model, _ = load_model_and_tokenizer(args.model)
    model.to(args.device).eval()
    for _ in range(2):  # warm-up (CUDA kernels, allocator)
        packed_ms(model, args.rows, 200, 8, steps=1), padded_ms(model, args.rows, 200, 8, steps=1)
    figures: dict = {"device": torch.cuda.get_device_name(0) if model.device.type == "cuda" else "cpu"}
    print(f"{args.rows} rows on {figures['device']}; one row prefills k tokens while the others decode one (ms/step)")
    print(f"{'context':>8s} {'k':>4s} {'packed':>9s} {'padded':>9s} {'padded/packed':>14s}")
    for context in (200, 2000):
        for k in (0, 8, 32, 64):
            packed, padded = packed_ms(model, args.rows, context, k), padded_ms(model, args.rows, context, k)
            print(f"{context:8d} {k:4d} {packed:9.1f} {padded:9.1f} {padded / packed:13.2f}x")
            figures[f"packed_ms_T{context}_k{k}"] = round(packed, 1)
            figures[f"padded_ms_T{context}_k{k}"] = round(padded, 1)
    for context in (200, 2000):
        extra = figures[f"packed_ms_T{context}_k32"] / figures[f"packed_ms_T{context}_k0"]
        figures[f"packed_k32_vs_decode_T{context}"] = round(extra, 3)
        print(f"context {context}: a 32-token prefill riding along costs the packed step {extra:.2f}x a decode step")
    print(json.dumps(figures))


if __name__ == "__main__":
    sys.exit(run_script(main))
