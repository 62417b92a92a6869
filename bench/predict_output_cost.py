"""Time of the trainer's update with and without ``loss.predict_output`` (the cross-entropy on the interpreter's
output tokens), side by side on one batch.

The term costs the LM head and a log-softmax over the output tokens (forward and backward), in the decoder pass the
update already runs: no second pass of the decoder. This bench times ``Trainer.update`` on one synthetic batch (the
layout of bench/update_memory.py: a prompt, then lines of 16 model tokens each followed by 32 interpreter tokens, of
which ``--printed`` are printed text, the rest prompts), interleaving the two settings; the policy-gradient figures of
both must be equal in the first update (the term leaves that part alone; after it the weights differ). Rollouts
are the same with and without the term: the step's cost is this difference alone (and, at evaluations, one no-grad
scoring pass over the held-out episodes).

    python bench/predict_output_cost.py [--model smollm2-135m-instruct] [--tokens 384] [--groups 2] [--printed 16]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=384)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--printed", type=int, default=16, help="printed tokens of each 32 interpreter tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--weight", type=float, default=0.1)
    args = ap.parse_args()
    B = 4 * args.groups
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        for name, weight in (("off", 0.0), ("on", args.weight)):
            cfg = resolve(Config, None, {"model": {"name": args.model}, "task": {"name": "arithmetic"},
                                         "optim": {"lr": 1e-7, "warmup_steps": 0, "micro_batch": args.micro_batch},
                                         "loss": {"predict_output": weight},
                                         "run": {"eval_n": 0}})
            torch.manual_seed(0)
            trainers[name] = Trainer(cfg, f"{tmp}/{name}", progress=False)
        vocab = trainers["off"]._vocab()
        batch = synthetic_batch(vocab, B, args.tokens)
        pos = torch.arange(args.tokens)
        out = (((pos % 48) >= 16) & ((pos % 48) < 16 + args.printed)).float().expand(B, args.tokens).clone()
        out[:, :64] = 0                                                            # the prompt
        batch["output_mask"] = out
        batch["old_logprobs"] = torch.zeros(B, args.tokens)
        batch["old_logprobs"] = trainers["off"]._logprobs_no_grad(trainers["off"].scorer, batch,
                                                                  trainers["off"].sampling)
        batch["loss_mask"] = batch["loss_mask"] * batch["old_logprobs"].isfinite()  # ids the sampler bans: unscored
        batch["old_logprobs"] = batch["old_logprobs"].nan_to_num(neginf=0.0)
        adv = batch["loss_mask"] * torch.tensor([1.0, -1.0, -1.0, 1.0]).repeat(args.groups)[:, None]
        times: dict[str, list[float]] = {"off": [], "on": []}
        stats: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
        for _ in range(args.repeats + 1):                                          # first round: warm-up
            for name, trainer in trainers.items():
                t = time.perf_counter()
                stats[name].append(trainer.update(dict(batch), adv))
                times[name].append(time.perf_counter() - t)
        # the first update's only: after it the two settings' weights differ (the term has moved them)
        same = all(stats["on"][0][k] == stats["off"][0][k] for k in ("loss", "entropy", "clip_frac"))
        stats = {k: v[-1] for k, v in stats.items()}
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
    print(f"{args.model}: {B} transcripts of {args.tokens} tokens ({int(out.sum())} output tokens, "
          f"{int(batch['loss_mask'].sum())} model tokens), micro-batch {args.micro_batch}, median of {args.repeats}")
    ratio = med["on"] / med["off"]
    print(f"update without the term {med['off']:.2f} s, with it {med['on']:.2f} s: ratio {ratio:.3f}; "
          f"policy-gradient figures equal: {same}; loss/predict_output {stats['on']['loss/predict_output']:.3f}")
    print(json.dumps({"model": args.model, "tokens": args.tokens, "episodes": B, "micro_batch": args.micro_batch,
                      "output_tokens": int(out.sum()), "update_s_off": round(med["off"], 3),
                      "update_s_on": round(med["on"], 3), "ratio": round(med["on"] / med["off"], 3),
                      "policy_figures_equal": same}))


if __name__ == "__main__":
    sys.exit(run_script(main))
