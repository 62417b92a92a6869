"""Time of the trainer's update with and without skipping the backward of zero-gradient micro-batches, side by side.

A GRPO group whose episodes were all right or all wrong has no advantage: with no KL term its gradient is exactly
zero, and ``Trainer.update`` runs only its forward (the logged statistics) under ``no_grad``. Early in a run with an
outcome-only reward most groups are like that (the shaping sweep's `outcome_only` runs had whole steps with no
correct episode). This bench times ``Trainer.update`` itself on one batch, with ``skip_zero_gradient`` on and off,
interleaved, for batches where no group, half of the groups, and every group has zero advantage; the weights after
both settings are compared (they must be equal: tests/test_trainer.py proves it bit for bit on a tiny model).

The batch has the experiment's shape: ``--groups`` groups of 4 transcripts of ``--tokens`` tokens, a third of them
model-written lines (random ids: time depends on the shape, not the text). Prints a table, then one JSON line.

    python bench/zero_gradient_skip.py [--model smollm2-135m-instruct] [--tokens 384] [--groups 2] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch
from update_memory import synthetic_batch  # bench/update_memory.py: the experiment's token layout

from replrl.cli import run_script
from replrl.config import Config
from replrl.configlib import resolve
from replrl.trainer import Trainer


def as_sampled(trainer: Trainer, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` (random ids) as the sampler could have written it: a model-written id the sampler bans there (e.g. a
    newline inside a line) replaced by one it allows anywhere, and ``old_logprobs`` the policy's own (ratio 1)."""
    vocab = trainer._vocab()
    masks = trainer.banned(vocab)
    allowed = (~(masks.line_start | masks.anywhere)).nonzero()[:, 0]       # ids the sampler may write anywhere
    batch["old_logprobs"] = torch.zeros(batch["input_ids"].shape)
    for _ in range(2):
        old = trainer._logprobs_no_grad(trainer.scorer, batch, trainer.sampling)
        banned = (old == float("-inf")) & (batch["loss_mask"] > 0)
        batch["input_ids"][banned] = allowed[torch.randint(len(allowed), (int(banned.sum()),))]
    if banned.any():
        raise SystemExit("the synthetic batch still has tokens the sampler bans")
    batch["old_logprobs"] = old
    return batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=384)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    cfg = resolve(Config, None, {"model": {"name": args.model}, "task": {"name": "arithmetic"},
                                 "optim": {"lr": 1e-7, "warmup_steps": 0, "micro_batch": args.micro_batch},
                                 "run": {"tensorboard": False, "eval_n": 0}})
    B = 4 * args.groups
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        for name in ("skip", "full"):
            torch.manual_seed(0)
            trainers[name] = Trainer(cfg, f"{tmp}/{name}", progress=False)
        trainers["full"].skip_zero_gradient = False
        vocab = trainers["skip"]._vocab()
        batch = as_sampled(trainers["skip"], synthetic_batch(vocab, B, args.tokens))
        signs = torch.tensor([1.0, -1.0, -1.0, 1.0]).repeat(args.groups)[:, None]           # [B, 1]
        rows = []
        for zero_frac in (0.0, 0.5, 1.0):
            live = (torch.arange(B) >= round(zero_frac * args.groups) * 4).float()[:, None]  # [B, 1]
            adv = batch["loss_mask"] * signs * live                                          # [B, T]
            times: dict[str, list[float]] = {"skip": [], "full": []}
            for _ in range(args.repeats + 1):                                                # first round: warm-up
                for name, trainer in trainers.items():
                    t = time.perf_counter()
                    stats = trainer.update(batch, adv)
                    times[name].append(time.perf_counter() - t)
                    if name == "skip":
                        skipped = stats["backward_skipped_frac"]
            same = all(torch.equal(a, b) and bool(a.isfinite().all())
                       for a, b in zip(trainers["skip"].model.parameters(), trainers["full"].model.parameters(),
                                       strict=True))
            med = {k: statistics.median(v[1:]) for k, v in times.items()}
            rows.append({"zero_frac": zero_frac, "skipped": skipped, "skip_s": med["skip"], "full_s": med["full"],
                         "ratio": med["skip"] / med["full"], "same_weights": same})
    print(f"{args.model}: {B} transcripts of {args.tokens} tokens, micro-batch {args.micro_batch}, "
          f"median of {args.repeats} updates")
    print(f"{'groups with no advantage':>25s} {'skipped':>8s} {'skip s':>7s} {'full s':>7s} {'ratio':>6s} "
          "same weights")
    for r in rows:
        print(f"{r['zero_frac']:25.0%} {r['skipped']:8.0%} {r['skip_s']:7.2f} {r['full_s']:7.2f} {r['ratio']:6.3f} "
              f"{r['same_weights']}")
    if not all(r["same_weights"] for r in rows):
        raise SystemExit("the weights differ with and without skipping: the skip is not exact")
    print(json.dumps({"model": args.model, "tokens": args.tokens, "episodes": B, "micro_batch": args.micro_batch,
                      **{f"update_s_{k}_{int(100 * r['zero_frac'])}": round(r[f"{k}_s"], 2)
                         for r in rows for k in ("skip", "full")},
                      **{f"skip_time_ratio_{int(100 * r['zero_frac'])}": round(r["ratio"], 3) for r in rows}}))


if __name__ == "__main__":
    sys.exit(run_script(main))
