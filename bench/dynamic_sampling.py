"""Groups with a contrast per hour, with dynamic sampling on and off, side by side in one run.

Two short training runs of the same model on the same task from the same seed: one without dynamic sampling (each
step trains on its problems_per_step groups, contrast or not), one with it (each step draws waves of problems until
problems_per_step groups have a contrast, or the bound on extra waves is spent; with ``--probe N``, the default 4,
each wave screens problems with N episodes each and completes the kept ones to whole groups:
rollout.dynamic_sampling_probe). A group with a contrast (rewards not all equal, by
rollout.dynamic_sampling_signal) is the only kind a group-relative update learns from. Figures:

- ``signal_groups_per_rollout_hour_{on,off}``: groups with a contrast trained on, per hour of rollout;
  ``..._on_vs_off`` their ratio (null when the run without it trained on none);
- ``signal_groups_per_step_hour_*``: the same per hour of whole steps (rollout + update);
- ``signal_groups_per_step_*``, ``episodes_per_kept_group`` (episodes generated per group trained on, with it on),
  the contrast rate of every group drawn (``contrast_frac_*``), and the raw counts and times.

The 0.5B run is slow on a CPU (a wave of 2 x 8 episodes takes minutes); run it under the heavy lock, in the
background, with its output in a log file:

    flock /tmp/replrl-heavy.lock python bench/dynamic_sampling.py --steps 3 > LOG 2>&1 &

Prints a line per step, then one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import tempfile
import time

from replrl.cli import run_script
from replrl.config import Config
from replrl.configlib import resolve
from replrl.metrics import read_metrics
from replrl.trainer import Trainer


def config(args: argparse.Namespace, on: bool) -> Config:
    return resolve(Config, None, {
        "model": {"name": args.model},
        "task": {"name": args.task, "level": args.level},
        "rollout": {"group_size": args.group_size, "problems_per_step": args.problems, "temperature": args.temperature,
                    "dynamic_sampling": on, "dynamic_sampling_extra_waves": args.extra_waves,
                    "dynamic_sampling_probe": args.probe if on else 0},
        # programs_qwen.toml's rewards: an unsubmitted answer is no worse than a wrong one
        "rewards": {"weights": {"correct": 1.0, "wrong": 0.0, "no_submit": 0.0, "syntax_error": -0.3,
                                "exception": -0.1, "timeout": -0.2, "crash": -0.5, "repeat_line": -0.1}},
        "optim": {"lr": args.lr, "micro_batch": 2, "gradient_checkpointing": True},
        "run": {"max_steps": args.steps, "seed": args.seed, "eval_n": 0, "time_budget_min": args.budget_min,
                "save_every": 0, "log_samples_every": 0, "tensorboard": False},
    })


def groups_drawn(row: dict[str, float], args: argparse.Namespace) -> float:
    """Groups (probes, with --probe) a step drew: whole groups of group_size without dynamic sampling."""
    return row.get("dynsamp/groups_drawn", row["episodes"] / args.group_size)


def one_run(args: argparse.Namespace, on: bool, tmp: str) -> dict[str, float]:
    run_dir = f"{tmp}/{'on' if on else 'off'}"
    trainer = Trainer(config(args, on), run_dir, progress=False)
    trainer.train()
    del trainer
    gc.collect()
    rows = [r for r in read_metrics(run_dir) if "rollout_s" in r]
    for r in rows:
        print(f"{'on ' if on else 'off'} step {r['step']}: {r.get('dynsamp/waves', 1):.0f} wave(s), "
              f"{r['groups_with_contrast']:.0f} of {groups_drawn(r, args):.0f} groups with a contrast, "
              f"kept {r.get('dynsamp/groups_kept', r['groups_with_contrast']):.0f}; accuracy {r['accuracy']:.3f}; "
              f"rollout {r['rollout_s']:.0f} s, update {r['update_s']:.0f} s", flush=True)
    kept = sum(r.get("dynsamp/groups_kept", r["groups_with_contrast"]) for r in rows)
    rollout_s, step_s = sum(r["rollout_s"] for r in rows), sum(r["step_s"] for r in rows)
    drawn = sum(groups_drawn(r, args) for r in rows)
    return {"steps": len(rows), "groups_drawn": drawn, "groups_with_contrast": sum(r["groups_with_contrast"]
                                                                                     for r in rows),
            "signal_groups": kept, "episodes": sum(r["episodes"] for r in rows), "rollout_s": rollout_s,
            "step_s": step_s, "discarded_rollout_s": sum(r.get("dynsamp/discarded_rollout_s", 0.0) for r in rows),
            "accuracy": sum(r["accuracy"] * r["episodes"] for r in rows) / max(sum(r["episodes"] for r in rows), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--task", default="programs")
    ap.add_argument("--level", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--problems", type=int, default=2, help="rollout.problems_per_step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--extra-waves", type=int, default=2, help="rollout.dynamic_sampling_extra_waves")
    ap.add_argument("--probe", type=int, default=4,
                    help="rollout.dynamic_sampling_probe of the run with it on (0: whole groups, DAPO's filter)")
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-min", type=float, default=0.0,
                    help="run.time_budget_min of each run (0: --steps steps whatever they take)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        off = one_run(args, False, tmp)
        on = one_run(args, True, tmp)
    per_hour = {k: {name: r["signal_groups"] / (r[k] / 3600) for name, r in (("on", on), ("off", off))}
                for k in ("rollout_s", "step_s")}

    def ratio(d: dict[str, float]) -> float | None:
        return round(d["on"] / d["off"], 3) if d["off"] else None

    out = {"model": args.model, "task": f"{args.task} level {args.level}", "temperature": args.temperature,
           "problems_per_step": args.problems, "group_size": args.group_size, "extra_waves": args.extra_waves,
           "probe": args.probe, "seed": args.seed,
           "signal_groups_per_rollout_hour_on_vs_off": ratio(per_hour["rollout_s"]),
           "signal_groups_per_step_hour_on_vs_off": ratio(per_hour["step_s"]),
           "episodes_per_kept_group": round(on["episodes"] / on["signal_groups"], 2) if on["signal_groups"] else None,
           **{f"signal_groups_per_rollout_hour_{k}": round(v, 2) for k, v in per_hour["rollout_s"].items()},
           **{f"signal_groups_per_step_hour_{k}": round(v, 2) for k, v in per_hour["step_s"].items()},
           **{f"signal_groups_per_step_{k}": round(r["signal_groups"] / max(r["steps"], 1), 3)
              for k, r in (("on", on), ("off", off))},
           **{f"contrast_frac_{k}": round(r["groups_with_contrast"] / max(r["groups_drawn"], 1), 3)
              for k, r in (("on", on), ("off", off))},
           **{f"{k}_{name}": round(v, 3) if isinstance(v, float) else v
              for name, r in (("on", on), ("off", off)) for k, v in r.items()},
           "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(run_script(main))
