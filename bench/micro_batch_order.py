"""Time of the trainer's update with each minibatch's rows by length against the order they were drawn, side by side.

A micro-batch is scored as long as its longest transcript. Rows in the order drawn (GRPO groups one after another)
put short and long transcripts together; ``Trainer.update`` orders each minibatch's rows by length (those without an
advantage first) before cutting it into micro-batches (``replrl.loss.rows_by_length``). This bench times
``Trainer.update`` on one batch whose transcripts have the lengths of a default run's first step (SmolLM2-135M-
Instruct, 2 problems x 8 episodes, measured 2026-11-29: 3,985 tokens), with the ordering on and replaced by the drawn
order, interleaved, and compares the weights after (equal up to the rounding of a sum in another order).

Random ids (time depends on the shape, not the text); a third of each transcript after its prompt is model-written.
Prints a table, then one JSON line.

    python bench/micro_batch_order.py [--model smollm2-135m-instruct] [--micro-batch 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch
from zero_gradient_skip import as_sampled  # bench/zero_gradient_skip.py

import replrl.trainer as trainer_module
from replrl.cli import run_script
from replrl.config import Config
from replrl.configlib import resolve
from replrl.trainer import Trainer

DEFAULT_RUN_LENGTHS = [222, 188, 196, 313, 327, 196, 208, 181, 417, 291, 263, 287, 185, 186, 300, 225]
"""Token counts of the 16 transcripts of a default run's first step (``replrl.sample_episodes`` with the default
config, group size 8, on the training split)."""


def batch_of(lengths: list[int], vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), T), generator=g)
    pos = torch.arange(T)
    att = (pos[None, :] < torch.tensor(lengths)[:, None]).long()
    loss_mask = (((pos % 48) < 16) & (pos >= 64)).float()[None, :] * att
    return {"input_ids": ids * att, "attention_mask": att, "loss_mask": loss_mask}


def drawn_order(attention_mask: torch.Tensor, first_last: torch.Tensor | None = None):  # noqa: ARG001
    return lambda rows: rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    cfg = resolve(Config, None, {"model": {"name": args.model}, "task": {"name": "arithmetic"},
                                 "optim": {"lr": 1e-7, "warmup_steps": 0, "micro_batch": args.micro_batch},
                                 "run": {"eval_n": 0}})
    lengths = DEFAULT_RUN_LENGTHS
    by_length = trainer_module.rows_by_length
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        for name in ("by_length", "drawn"):
            torch.manual_seed(0)
            trainers[name] = Trainer(cfg, f"{tmp}/{name}", progress=False)
        first = trainers["by_length"]
        batch = as_sampled(first, batch_of(lengths, first._vocab()))
        signs = torch.tensor([1.0, -1.0, -1.0, 1.0] * (len(lengths) // 4))[:, None]      # every group a contrast
        adv = batch["loss_mask"] * signs
        times: dict[str, list[float]] = {k: [] for k in trainers}
        for _ in range(args.repeats + 1):                                                # first round: warm-up
            for name, trainer in trainers.items():
                trainer_module.rows_by_length = by_length if name == "by_length" else drawn_order
                t = time.perf_counter()
                trainer.update(batch, adv)
                times[name].append(time.perf_counter() - t)
        trainer_module.rows_by_length = by_length
        drift = max(float((a - b).detach().abs().max()) for a, b in zip(
            trainers["by_length"].model.parameters(), trainers["drawn"].model.parameters(), strict=True))
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    real = sum(lengths)

    def scored(order: list[int]) -> int:
        mb = args.micro_batch
        return sum(max(lengths[k] for k in order[i:i + mb]) * len(order[i:i + mb]) for i in range(0, len(order), mb))

    pads = {"drawn": scored(list(range(len(lengths)))) / real,
            "by_length": scored(sorted(range(len(lengths)), key=lambda k: lengths[k])) / real}
    print(f"{args.model}: {len(lengths)} transcripts, {real} tokens, micro-batch {args.micro_batch}, median of "
          f"{args.repeats} updates (after a warm-up); weights after, largest difference: {drift:.2e}")
    print(f"{'order':>10s} {'scored/real tokens':>19s} {'update s':>9s}")
    for k in ("drawn", "by_length"):
        print(f"{k:>10s} {pads[k]:19.3f} {med[k]:9.2f}")
    print(json.dumps({"model": args.model, "micro_batch": args.micro_batch, "tokens": real,
                      "scored_ratio_drawn": round(pads["drawn"], 3),
                      "scored_ratio_by_length": round(pads["by_length"], 3),
                      "update_s_drawn": round(med["drawn"], 2), "update_s_by_length": round(med["by_length"], 2),
                      "update_time_ratio": round(med["by_length"] / med["drawn"], 3), "weights_max_diff": drift}))


if __name__ == "__main__":
    sys.exit(run_script(main))
