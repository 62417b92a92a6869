"""A line's output tokenized through transformers' ``encode`` against ``rollout.transcript.encode`` (the fast
tokenizer's Rust call made directly), side by side, alternating, best of ``--repeats``.

    python bench/tokenize_line.py --model qwen2.5-coder-0.5b-instruct

The texts are what an interpreter prints after a line (the next prompt included): nothing, a number, a list, a
traceback. The last line is JSON: microseconds an encode each way, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import time

from replrl.models import load_tokenizer
from replrl.rollout.transcript import encode

TEXTS = [">>>", "42\n>>>", "[1, 2, 3]\n>>>", "...", "Traceback (most recent call last):\n  File \"<stdin>\", line 1, "
         "in <module>\nNameError: name 'x' is not defined\n>>>", "0.30000000000000004\n>>>"]


def per_call_us(fn, tok, rounds: int) -> float:
    t0 = time.perf_counter()
    for _ in range(rounds):
        for text in TEXTS:
            fn(tok, text)
    return (time.perf_counter() - t0) / (rounds * len(TEXTS)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tok = load_tokenizer(args.model)
    wrapper = lambda t, s: t.encode(s, add_special_tokens=False)  # noqa: E731
    assert all(encode(tok, s) == wrapper(tok, s) for s in TEXTS)
    best = {"wrapper": float("inf"), "direct": float("inf")}
    for _ in range(args.repeats):
        best["wrapper"] = min(best["wrapper"], per_call_us(wrapper, tok, args.rounds))
        best["direct"] = min(best["direct"], per_call_us(encode, tok, args.rounds))
    print(f"{args.model}: transformers' encode {best['wrapper']:.1f} us, direct {best['direct']:.1f} us a line's "
          f"output ({best['wrapper'] / best['direct']:.2f}x)")
    print(json.dumps({"model": args.model, "wrapper_us": round(best["wrapper"], 1),
                      "direct_us": round(best["direct"], 1), "ratio": round(best["wrapper"] / best["direct"], 2)}))


if __name__ == "__main__":
    main()
