"""The vLLM backend's line-rule logits processor, per engine step: its in-place masking against the dense one it
replaced (gather every opted-in row, mask it with ``TokenMasks.at``, scatter it back), on the same logits, with
the 0.5B's vocabulary (151,936 ids; 712 banned anywhere, 99,108 at a line's start) and one row in twenty at a
line's first token. Checks the two give the same logits, then times both (one thread, as vLLM's CPU worker).

    .venv-vllm/bin/python bench/line_rule_mask.py [--rows 8 32 128]

Ends with one JSON line: ``dense_ms_<R>``, ``inplace_ms_<R>`` and ``speedup_<R>`` per batch of R rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from replrl.backends.vllm import LineRuleLogitsProcessor
from replrl.cli import run_script
from replrl.contract import TokenMasks, token_masks
from replrl.models import QWEN_CODER_ALIAS, load_tokenizer


def dense(masks: TokenMasks, outputs: dict[int, list[int]], logits: torch.Tensor) -> torch.Tensor:
    """The first version of ``LineRuleLogitsProcessor.apply``."""
    rows = torch.tensor(list(outputs))                                                         # [R]
    is_start = torch.tensor([not out for out in outputs.values()])                             # [R]
    logits[rows] = logits[rows].masked_fill(masks.at(is_start), float("-inf"))                 # [R, V]
    return logits


def timed(fn, *args, repeats: int) -> float:
    fn(*args)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    return 1000 * (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = load_tokenizer(QWEN_CODER_ALIAS)
    masks = token_masks(tok)
    proc = LineRuleLogitsProcessor.for_masks(masks)
    figures: dict[str, float] = {}
    for r in args.rows:
        proc.outputs = {i: [] if i % 20 == 0 else [1] for i in range(r)}
        logits = torch.randn(r, masks.anywhere.shape[0], generator=torch.Generator().manual_seed(r))  # [R, V]
        if not torch.equal(dense(masks, proc.outputs, logits.clone()), proc.apply(logits.clone())):
            raise SystemExit(f"the two maskings differ at {r} rows")
        d = timed(dense, masks, proc.outputs, logits, repeats=args.repeats)
        i = timed(proc.apply, logits, repeats=args.repeats)
        print(f"{r:4d} rows: dense {d:7.2f} ms a step, in place {i:6.2f} ms ({d / i:.1f}x)", file=sys.stderr)
        figures |= {f"dense_ms_{r}": round(d, 2), f"inplace_ms_{r}": round(i, 2), f"speedup_{r}": round(d / i, 1)}
    print(json.dumps(figures))


if __name__ == "__main__":
    sys.exit(run_script(main))
