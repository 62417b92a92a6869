"""The default `replrl train` as replrl ran it before issue 48 and now, side by side in one run: the same steps of the
same config with kernels booted beside each rollout (``before``: ``rollout.kernel_refill = eager``,
``kernel_fork_server = false``), forked from the fork server beside it (``eager``), and forked between rollouts,
during the update (``idle``, the default). Each run is its own `replrl train`
process with held-out evaluation off; the figures are the steps' own timings from metrics.jsonl, the first step
left out (the pool's warm start and the first compile of each shape).

    python bench/train_refill.py [--steps 6] [--model smollm2-135m-instruct] [--out /tmp/train_refill]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from replrl.cli import run_script

MODES = {"before": ["--rollout.kernel_refill", "eager", "--rollout.kernel_fork_server", "false"],
         "eager": ["--rollout.kernel_refill", "eager"], "idle": ["--rollout.kernel_refill", "idle"]}
"""before: kernels boot a Python of their own beside each rollout (replrl before issue 48); eager: forked from the
fork server, beside the rollout; idle: forked from the fork server between rollouts (the default now)."""


def run(mode: str, steps: int, model: str, out: Path) -> list[dict]:
    run_dir = out / mode
    cmd = [sys.executable, "-m", "replrl", "train", "--model.name", model, "--run.max_steps", str(steps),
           "--run.eval_n", "0", "--run.time_budget_min", "0", *MODES[mode], "--no-progress", "--run-dir",
           str(run_dir)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default="/tmp/train_refill")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = ap.parse_args()
    out = Path(args.out)
    fig: dict[str, float] = {}
    for mode in args.modes:
        rows = [r for r in run(mode, args.steps, args.model, out) if "step_s" in r][1:]
        for key in ("step_s", "rollout_s", "update_s", "pool/boots_in_rollout"):
            fig[f"{mode}_{key.replace('pool/', '')}"] = round(statistics.mean(r.get(key, 0.0) for r in rows), 2)
        print(f"{mode:5s}: step {fig[f'{mode}_step_s']:.1f} s (rollout {fig[f'{mode}_rollout_s']:.1f} s, update "
              f"{fig[f'{mode}_update_s']:.1f} s), kernels booted beside a rollout "
              f"{fig[f'{mode}_boots_in_rollout']:.1f} a step (mean of steps 2-{args.steps})")
    for base in ("before", "eager"):
        if {base, "idle"} <= set(args.modes):
            fig[f"step_speedup_vs_{base}"] = round(fig[f"{base}_step_s"] / fig["idle_step_s"], 3)
            fig[f"rollout_speedup_vs_{base}"] = round(fig[f"{base}_rollout_s"] / fig["idle_rollout_s"], 3)
            print(f"idle against {base}: steps {fig[f'step_speedup_vs_{base}']:.2f}x as fast, rollouts "
                  f"{fig[f'rollout_speedup_vs_{base}']:.2f}x")
    print(json.dumps({"model": args.model, "steps": args.steps, **fig}))


if __name__ == "__main__":
    sys.exit(run_script(main))
