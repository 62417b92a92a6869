"""The pre-registered figures of the loss.predict_output experiment (examples/predict_output_sweep.toml,
docs/results/predict_output.md) from a sweep directory, as markdown.

- Steps to the training-accuracy threshold, fixed before the runs: the first step s at which the mean training
  accuracy (``accuracy``: the share of the step's episodes that were correct) over steps s-4..s is >= 0.9; a run
  that never gets there is censored at its last step (shown ``>=``). Per variant: runs reached, mean; each variant
  against the control paired by seed (run.seed): the mean difference with its 95% t-interval over the seed pairs
  (censored runs counted at their budget, so a difference is a bound, said as such).
- Held-out accuracy (eval/ level 1, eval_level2/ level 2) at each evaluation step, and the paired difference.
- Output prediction: eval/predict_output/accuracy before training and at the last evaluation, per variant, and its
  paired difference to the control at the last evaluation (did learning the interpreter raise it?).

    python bench/predict_output_collect.py runs/predict_output [--baseline outcome_only] [--threshold 0.9]
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import Any

from replrl.compare import RunData, discover, mean_ci

WINDOW = 5
THRESHOLD = 0.9


def steps_to_threshold(rows: Sequence[dict[str, Any]], threshold: float = THRESHOLD,
                       window: int = WINDOW) -> tuple[int, bool]:
    """(the first step ending a window of ``window`` training steps whose mean accuracy is >= ``threshold``, True),
    or (the run's last training step, False): censored."""
    train = {int(r["step"]): float(r["accuracy"]) for r in rows if "accuracy" in r and "step" in r}
    steps = sorted(train)
    for i in range(window - 1, len(steps)):
        if sum(train[s] for s in steps[i - window + 1:i + 1]) / window >= threshold:
            return steps[i], True
    return (steps[-1] if steps else 0), False


def at_step(rows: Sequence[dict[str, Any]], key: str, step: int) -> float:
    """The value of ``key`` logged at ``step`` (the last such row), NaN if none. An output-prediction figure over
    no output tokens is NaN too (runs before 2026-11-28 logged it as 0: the episodes printed nothing)."""
    found = [r for r in rows if r.get("step") == step and key in r]
    if not found:
        return math.nan
    row = found[-1]
    if "predict_output" in key and not key.endswith("/tokens"):
        prefix = key.split("/")[0] + "/" if key.startswith("eval") else ""
        if row.get(prefix + "predict_output/tokens", 1.0) == 0:
            return math.nan
    return float(row[key])


def fmt(m: float, lo: float, hi: float, digits: int = 1, scale: float = 1.0) -> str:
    if math.isnan(m):
        return "-"
    if math.isnan(lo):
        return f"{m * scale:.{digits}f}"
    return f"{m * scale:.{digits}f} [{lo * scale:.{digits}f}, {hi * scale:.{digits}f}]"


def paired(variant: list[RunData], control: list[RunData], value: Any) -> tuple[float, float, float, int]:
    """Mean variant-minus-control difference of ``value(run)`` over the seeds both have, its 95% t-interval, pairs."""
    by_seed = {r.seed: value(r) for r in control}
    diffs = [value(r) - by_seed[r.seed] for r in variant if r.seed in by_seed]
    diffs = [d for d in diffs if not math.isnan(d)]
    return (*mean_ci(diffs), len(diffs))


def report(variants: dict[str, list[RunData]], baseline: str, threshold: float) -> str:
    control = variants[baseline]
    out = ["Runs: " + ", ".join(f"`{v}` {len(runs)}" for v, runs in variants.items()) + ".", ""]
    out += [f"**Steps to training accuracy >= {threshold:g}** (mean over {WINDOW} consecutive steps; censored at the "
            "budget):", "", "| variant | reached | steps, mean [95% t] | per seed | difference to control, paired |",
            "|---|---|---|---|---|"]
    for name, runs in variants.items():
        got = {r.seed: steps_to_threshold(r.rows, threshold) for r in runs}
        per_seed = ", ".join(f"{s}: {'' if ok else '>='}{n}" for s, (n, ok) in sorted(got.items()))
        diff = "" if name == baseline else fmt(*paired(runs, control,
                                                      lambda r: float(steps_to_threshold(r.rows, threshold)[0]))[:3])
        out.append(f"| `{name}` | {sum(ok for _, ok in got.values())}/{len(runs)} | "
                   f"{fmt(*mean_ci([float(n) for n, _ in got.values()]))} | {per_seed} | {diff} |")
    steps = sorted({int(r["step"]) for runs in variants.values() for run in runs for r in run.rows
                    if "eval/accuracy" in r})
    for key, label in (("eval/accuracy", "held-out accuracy, level 1"),
                       ("eval_level2/accuracy", "held-out accuracy, level 2"),
                       ("eval/predict_output/tokens", "held-out output tokens scored (all 50 episodes)"),
                       ("eval/predict_output/accuracy", "held-out output-prediction accuracy"),
                       ("eval/loss/predict_output", "held-out output cross-entropy (nats)")):
        pct, count = "accuracy" in key, key.endswith("/tokens")
        out += ["", f"**{label}** ({'%, ' if pct else ''}mean over seeds [95% t]; difference to control paired by "
                "seed):", "", "| variant | " + " | ".join(f"step {s}" for s in steps) + " |",
                "|---|" + "---|" * len(steps)]
        for name, runs in variants.items():
            cells = [fmt(*mean_ci([at_step(r.rows, key, s) for r in runs]), scale=100 if pct else 1,
                         digits=1 if pct else 0 if count else 3) for s in steps]
            out.append(f"| `{name}` | " + " | ".join(cells) + " |")
            if name != baseline:
                cells = [fmt(*paired(runs, control, lambda r, s=s, key=key: at_step(r.rows, key, s))[:3],
                             scale=100 if pct else 1, digits=1 if pct else 0 if count else 3) for s in steps]
                out.append(f"| `{name}` - control | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep", help="the sweep's --out directory")
    ap.add_argument("--baseline", default="outcome_only")
    ap.add_argument("--threshold", type=float, default=THRESHOLD)
    args = ap.parse_args()
    variants = discover(args.sweep)
    if args.baseline not in variants:
        raise SystemExit(f"no variant {args.baseline!r} in {args.sweep} (found: {', '.join(variants)})")
    print(report(variants, args.baseline, args.threshold), end="")


if __name__ == "__main__":
    sys.exit(main())
