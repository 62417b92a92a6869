"""Untrained accuracy on the ``explore`` task, per level, for each model (issue 33's baseline).

For each (model, temperature) cell: one episode per problem on the first ``--per-level`` problems of each level of
the test split (the split cycles through every (family, level), so 30 per level is 6 per family), sampled with the
task's own rollout limits (``ExploreTask.rollout_defaults``, applied by the config as in training) and the default
rewards, through ``replrl.rollout.rollout`` and ``summarize``. The figures are those of ``programs_baseline.py``
plus two that say whether the model used what it saw:

- ``looked_then_more``: an episode with a line whose output was non-empty, followed by a line other than ``submit``
  (issue 33's definition: a traceback counts as output);
- ``looked_ok_then_more``: the same, counting only output of a line that ran without an error (a value, a print).

Level 1's problems are sampled first, so its accuracy is known early. Every wave's episodes are appended to
``--episodes DIR/<model>@<T>.jsonl``; a rerun skips finished problems, and ``--saved-only`` makes the figures from
what an interrupted run sampled (each level's count says how many). Printed: a markdown table, then one JSON line.

    python bench/explore_baseline.py [--models M ...] [--temperatures 0.7] [--per-level 30]
    (the 0.5B under the machine's heavy-job lock: flock /tmp/replrl-heavy.lock python bench/explore_baseline.py ...)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling bench script's helpers

from programs_baseline import _code_version, _limits, figures, resumed, run_cells, sample_waves  # noqa: E402

from replrl.api import load_config  # noqa: E402
from replrl.cli import run_script  # noqa: E402
from replrl.evaluation import split_rows  # noqa: E402
from replrl.tasks import task_from_config  # noqa: E402
from replrl.types import Trajectory  # noqa: E402

MODELS = ("qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct")
LEVELS = (1, 2, 3)


def _is_submit(code: str) -> bool:
    return code.lstrip().startswith("submit(")


def looked_then_more(traj: Trajectory, ok_only: bool = False) -> bool:
    """Whether a line showed output (only a line without an error, with ``ok_only``) and the next non-blank line is
    not a ``submit``: the model saw something and wrote more code."""
    lines = [ln for ln in traj.lines if ln.code.strip()]
    return any(a.output.strip() and (a.status == "ok" or not ok_only) and not _is_submit(b.code)
               for a, b in zip(lines, lines[1:]))


def explore_figures(trajs: list[Trajectory]) -> dict[str, float]:
    out = figures(trajs)
    n = max(len(trajs), 1)
    out["looked_then_more"] = sum(looked_then_more(t) for t in trajs) / n
    out["looked_ok_then_more"] = sum(looked_then_more(t, ok_only=True) for t in trajs) / n
    out["first_line_submits"] = sum(bool(t.lines) and _is_submit(t.lines[0].code) for t in trajs) / n
    return out


def run_cell(model: str, temperature: float, per_level: int, wave: int, episodes: Path, seed: int,
             code: str, sample: bool = True) -> dict[str, Any]:
    cfg = load_config(model={"name": model}, task={"name": "explore", "level": 0},
                      rollout={"temperature": temperature}, run={"seed": seed})
    task = task_from_config(cfg)
    rows = split_rows(task, cfg.task.eval_split)
    chosen: list[tuple[int, dict]] = []
    for lv in LEVELS:  # level 1 first: its accuracy (is level 1 too hard?) is known early
        chosen += [(i, row) for i, row in enumerate(rows) if row["level"] == lv][:per_level]
    done, timing = resumed(episodes)
    todo = [pair for pair in chosen if pair[0] not in {t.row for t in done}]
    print(f"{model} T={temperature}: {len(chosen)} problems, {len(chosen) - len(todo)} already done "
          f"(rollout limits: {_limits(cfg)})", flush=True)
    if todo and not sample:
        print(f"  --saved-only: {len(todo)} problems not sampled (the levels' counts say so)", flush=True)
        chosen = [pair for pair in chosen if pair not in todo]
    elif todo:
        sample_waves(cfg, task, todo, done, timing, episodes, wave, seed, code, total=len(chosen))
    wanted = {i for i, _ in chosen}
    done = [t for t in done if t.row in wanted]
    level_of = {i: row["level"] for i, row in chosen}
    family_of = {i: row["family"] for i, row in chosen}
    return {"model": model, "temperature": temperature, "per_level": per_level, "limits": _limits(cfg),
            "all": explore_figures(done),
            "levels": {str(lv): explore_figures([t for t in done if level_of[t.row] == lv]) for lv in LEVELS},
            "families": {f: explore_figures([t for t in done if family_of[t.row] == f])
                         for f in dict.fromkeys(family_of.values())},
            "tokens_per_s": timing["model_tokens"] / max(timing["wall_s"], 1e-9), "rollout_wall_s": timing["wall_s"],
            "setup_s_per_episode": timing.get("setup_s", 0.0) / max(len(done), 1), "code": timing.get("code", "")}


def table(cells: list[dict[str, Any]]) -> str:
    cols = ["model", "T", "level 1", "level 2", "level 3", "all", "submit", "lines/ep", "syntax err/line",
            "exceptions/line", "looked, then more code", "(output without error)", "first line submits", "tokens/s"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for c in cells:
        a, levels = c["all"], [c["levels"][str(lv)] for lv in LEVELS]
        out.append("| " + " | ".join([
            c["model"], f"{c['temperature']}",
            *(f"{round(x['accuracy'] * x['episodes'])}/{x['episodes']}" for x in levels),
            f"{a['accuracy']:.1%}", f"{a['submit_rate']:.0%}", f"{a['lines_per_episode']:.1f}",
            f"{a['syntax_error_rate']:.1%}", f"{a['exception_rate']:.1%}", f"{a['looked_then_more']:.0%}",
            f"{a['looked_ok_then_more']:.0%}", f"{a['first_line_submits']:.0%}", f"{c['tokens_per_s']:.1f}"]) + " |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.7])
    p.add_argument("--per-level", type=int, default=30, help="problems per level (30 = 6 per family)")
    p.add_argument("--wave", type=int, default=15, help="episodes sampled at once (kernels in the pool)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/results/explore_baseline.json", help="results, one entry per cell")
    p.add_argument("--episodes", default="/tmp/explore_baseline", help="directory for the episodes (JSON Lines)")
    p.add_argument("--saved-only", action="store_true",
                   help="figures from the episodes sampled so far (an interrupted run), sampling nothing")
    args = p.parse_args()
    if args.per_level < 1 or args.wave < 1:
        raise ValueError("--per-level and --wave must be >= 1")
    code = _code_version()

    def cell_of(model: str, temperature: float, episodes: Path) -> dict[str, Any]:
        return run_cell(model, temperature, args.per_level, args.wave, episodes, args.seed, code,
                        sample=not args.saved_only)

    run_cells("explore_baseline", args, cell_of, table, redo=args.saved_only)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
