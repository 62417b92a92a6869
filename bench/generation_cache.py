"""Per-step cost of the HF backend's KV cache, side by side in one run.

1. Cache append: transformers' DynamicLayer (torch.cat of the whole layer at every step) vs the backend's
   _GrowingLayer (writes into spare capacity), for a decode step (w = 1) at several cache widths T.
2. A whole session of 8 rows: time per step in model.forward vs everything else (planning, mask, sampling).

    python bench/generation_cache.py [--model smollm2-135m-instruct] [--rows 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from replrl.backends.hf import HFGenerator, _GrowingLayer
from replrl.models import load_model_and_tokenizer
from replrl.types import SamplingParams


def step_ms(model, layer_class, rows: int, width: int, steps: int = 8) -> float:
    """Median ms of a decode step with a cache pre-filled to ``width`` columns (random keys/values)."""
    cfg = model.config
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache()
    cache.layers = []
    for _ in range(cfg.num_hidden_layers):
        layer = layer_class()
        keys, values = torch.randn(2, rows, kv_heads, width, head_dim).unbind(0)
        layer.update(keys, values)
        cache.layers.append(layer)
    times = []
    with torch.inference_mode():
        for k in range(steps):
            t = width + k
            mask = torch.zeros(rows, 1, 1, t + 1)
            ids = torch.randint(0, 1000, (rows, 1))
            start = time.perf_counter()
            model(input_ids=ids, attention_mask=mask, position_ids=torch.full((rows, 1), t), past_key_values=cache,
                  use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


async def session_profile(gen: HFGenerator, rows: int) -> dict:
    tok = gen.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "Sum the squares below 100 in Python."}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(chat + ">>> ", add_special_tokens=False)
    env = tok.encode("42\n>>> ", add_special_tokens=False)
    session = gen.session([prompt] * rows, SamplingParams(seed=0, max_line_tokens=32))

    async def episode(i: int) -> None:
        env_ids: list[int] = []
        for _ in range(4):
            line = await session.next_line(i, env_ids)
            if line.finish == "eos":
                break
            await asyncio.sleep(0.002)  # the kernel executes the line
            env_ids = env
        session.finish(i)

    start = time.perf_counter()
    await asyncio.gather(*(episode(i) for i in range(rows)))
    stats = dict(session.stats, wall_s=time.perf_counter() - start)
    await session.aclose()
    return stats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model_and_tokenizer(args.model)
    model.eval()

    print(f"1. decode step, {args.rows} rows, {args.threads} thread(s): torch.cat cache vs in-place growing cache")
    for width in (256, 1024, 2048):
        cat, grow = step_ms(model, DynamicLayer, args.rows, width), step_ms(model, _GrowingLayer, args.rows, width)
        print(f"   T={width:5d}: cat {cat:7.1f} ms   growing {grow:7.1f} ms   ratio {cat / grow:.2f}")

    gen = HFGenerator(model, tok, device="cpu", num_threads=args.threads)
    s = asyncio.run(session_profile(gen, args.rows))
    n = s["steps"]
    print(f"2. session: {args.rows} rows, {s['sampled_tokens']} sampled tokens, {s['fed_tokens']} fed, {n} steps, "
          f"{s['columns']} columns ({s['wall_s']:.1f} s)")
    print(f"   per step: forward {1e3 * s['forward_s'] / n:.1f} ms, rest of worker step (mask, sampling) "
          f"{1e3 * (s['worker_s'] - s['forward_s']) / n:.2f} ms, "
          f"loop thread (plan, apply) {1e3 * s['loop_s'] / n:.3f} ms, "
          f"other (handoff, waiting for requests) {1e3 * (s['wall_s'] - s['worker_s'] - s['loop_s']) / n:.2f} ms")


if __name__ == "__main__":
    main()
