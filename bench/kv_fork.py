"""A tree child's shared prefix on the HF backend: forked (its parent's KV cache rows copied) against prefilled again.

For prefixes of several lengths (a real prompt of ``programs`` and a transcript of lines after it): the time to
prefill the prefix into a fresh row of the sampler's packed cache (what a child cost before ``HFSession.fork``),
and the time to copy a row's cached prefix into a new row (``PackedKV.fork``, what it costs now), medians of
``--repeats``, side by side. The copy moves 2 * layers * kv_heads * head_dim numbers per token (46 KB per token for
SmolLM2-135M in float32); the prefill runs the whole model over the prefix.

    python bench/kv_fork.py [--model smollm2-135m-instruct] [--lengths 256 512 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from replrl.backends.hf import GEN_THREADS, _Batch
from replrl.cli import run_script
from replrl.models import load_model_and_tokenizer


def fork_and_prefill_ms(model: object, ids: list[int], repeats: int) -> tuple[float, float]:
    """Median ms to prefill ``ids`` into a fresh row, and to fork a row holding them into a new one."""
    prefill, fork = [], []
    with torch.inference_mode():
        for _ in range(repeats):
            batch = _Batch(model, 2, torch.device("cpu"))
            t0 = time.perf_counter()
            batch.forward({0: ids}, [0])
            prefill.append(1000 * (time.perf_counter() - t0))
            t0 = time.perf_counter()
            batch.fork([(0, [1])])
            fork.append(1000 * (time.perf_counter() - t0))
    return statistics.median(prefill), statistics.median(fork)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if GEN_THREADS is not None:
        torch.set_num_threads(GEN_THREADS)  # as the sampler's worker thread runs
    model, tok = load_model_and_tokenizer(args.model, dtype=torch.float32, device="cpu")
    model.eval()
    text = "x = 1\n>>> y = x + 2\n>>> print(y)\n3\n>>> " * 200
    ids = tok.encode(text, add_special_tokens=False)
    rows = {}
    print(f"{'prefix tokens':>14} {'prefill ms':>11} {'fork ms':>8} {'prefill / fork':>15}")
    for n in args.lengths:
        prefill, fork = fork_and_prefill_ms(model, ids[:n], args.repeats)
        rows[n] = {"prefill_ms": prefill, "fork_ms": fork, "prefill_vs_fork": prefill / max(fork, 1e-9)}
        print(f"{n:>14} {prefill:>11.1f} {fork:>8.2f} {prefill / max(fork, 1e-9):>15.0f}")
    print(json.dumps({"model": args.model, "threads": torch.get_num_threads(), "by_prefix_tokens": rows}))


if __name__ == "__main__":
    raise SystemExit(run_script(main))
