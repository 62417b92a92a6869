"""Untrained accuracy on the ``programs`` task, per level, for each model and temperature (issue 15's baseline).

For each (model, temperature) cell: one episode per problem on the first ``--per-level`` problems of each level of
the test split (the split cycles through every (family, level), so 52 per level is 4 per family), sampled with the
task's own rollout limits (``ProgramsTask.rollout_defaults``, applied by the config as in training) and the default
rewards, through ``replrl.rollout.rollout`` and ``summarize``, as ``replrl eval`` does (``trainer.evaluate`` returns
only the summary; the figures per level and the opened blocks need the episodes). Printed per cell: accuracy per
level, submit rate, lines per episode, syntax errors per line, the fraction of episodes that opened a block (a line
ending with ':'), the fraction that broke the REPL's block rule (a statement typed unindented straight after a
block's body, a SyntaxError), the fraction whose last line ran at the end-of-turn token, and the model's tokens/s in
rollouts (every model token / rollout wall time, model load and kernel start excluded), as a markdown table; then
one JSON line.

Resumable: every wave's episodes are appended to ``--episodes DIR/<model>@<T>.jsonl`` as it finishes, and every
finished cell is written to ``--out`` at once; a rerun skips finished cells and finished problems.

    python bench/programs_baseline.py [--models M ...] [--temperatures 0.7 1.0] [--per-level 52] [--backend hf]
    .venv-vllm/bin/python bench/programs_baseline.py --backend vllm ...   (the 0.5B: ~20 GB of memory on a CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from replrl.api import load_config
from replrl.cli import run_script
from replrl.evaluation import split_rows
from replrl.rewards import SYNTAX_ERRORS
from replrl.rollout import open_env, rollout, summarize
from replrl.tasks import task_from_config
from replrl.types import Trajectory
from replrl.viewer import load_jsonl, save_jsonl
from sandbox import run_sync

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")
LEVELS = (1, 2, 3)


def opened_block(traj: Trajectory) -> bool:
    """Whether a line of the episode opens a block (``for ...:``, ``def ...:``; comments do not count)."""
    return any(ln.code.rstrip().endswith(":") and not ln.code.lstrip().startswith("#") for ln in traj.lines)


def block_rule_error(traj: Trajectory) -> bool:
    """Whether the episode typed a statement at the ``... `` prompt without indenting it and got a SyntaxError: the
    next statement straight after a block's body, where CPython's REPL wants a blank line to close the block."""
    return any(ln.prompt.startswith("...") and ln.status == "error" and ln.error_name in SYNTAX_ERRORS
               and ln.code[:1] not in ("", " ", "\t") for ln in traj.lines)


def figures(trajs: list[Trajectory]) -> dict[str, float]:
    """``summarize``'s figures, plus the fractions of episodes that opened a block and that broke the block rule."""
    s = summarize(trajs)
    keys = ("episodes", "accuracy", "submit_rate", "lines_per_episode", "syntax_error_rate", "exception_rate",
            "eof_line_ran", "model_tokens_per_episode")
    out = {k: s[k] for k in keys}
    n = max(len(trajs), 1)
    out["opened_block"] = sum(opened_block(t) for t in trajs) / n
    out["block_rule_error"] = sum(block_rule_error(t) for t in trajs) / n
    at_eot = [t for t in trajs if t.end_reason == "eos" and t.lines and t.lines[-1].status != "incomplete"]
    out["eof_submitted"] = sum(t.submitted for t in at_eot) / n  # episodes whose answer came from that last line
    out["eof_correct"] = sum(bool(t.correct) for t in at_eot) / n
    out.update({k: v for k, v in s.items() if k.startswith("end/")})
    return out


def run_cell(model: str, temperature: float, per_level: int, backend: str, wave: int, episodes: Path,
             seed: int, code: str) -> dict[str, Any]:
    """One (model, temperature) cell: its episodes (resumed from ``episodes`` if partly done) and figures. ``code``:
    the version of replrl that samples (recorded with the episodes)."""
    cfg = load_config(model={"name": model, "backend": backend}, task={"name": "programs", "options": {"level": 0}},
                      rollout={"temperature": temperature}, run={"seed": seed})
    task = task_from_config(cfg)
    rows = split_rows(task, cfg.task.eval_split)
    chosen: list[tuple[int, dict]] = []
    for lv in LEVELS:
        chosen += [(i, row) for i, row in enumerate(rows) if row["level"] == lv][:per_level]
    chosen.sort(key=lambda pair: pair[0])  # split order: every wave mixes levels and families
    done, timing = resumed(episodes)
    todo = [pair for pair in chosen if pair[0] not in {t.row for t in done}]
    print(f"{model} T={temperature}: {len(chosen)} problems, {len(chosen) - len(todo)} already done "
          f"(rollout limits: {_limits(cfg)}, backend {backend})", flush=True)
    if todo:
        sample_waves(cfg, task, todo, done, timing, episodes, wave, seed, code, total=len(chosen))
    wanted = {i for i, _ in chosen}
    done = [t for t in done if t.row in wanted]
    level_of = {i: row["level"] for i, row in chosen}
    cell = {"model": model, "temperature": temperature, "backend": backend, "per_level": per_level,
            "limits": _limits(cfg), "all": figures(done),
            "levels": {str(lv): figures([t for t in done if level_of[t.row] == lv]) for lv in LEVELS},
            "tokens_per_s": timing["model_tokens"] / max(timing["wall_s"], 1e-9), "rollout_wall_s": timing["wall_s"],
            "code": timing.get("code", "")}
    return cell


def resumed(episodes: Path) -> tuple[list[Trajectory], dict[str, Any]]:
    """The episodes a cell sampled so far (``episodes``, JSON Lines) and its rollout timing (``.timing.json``)."""
    done = load_jsonl(episodes) if episodes.exists() else []
    timing_file = episodes.with_suffix(".timing.json")
    timing = json.loads(timing_file.read_text()) if timing_file.exists() else {"wall_s": 0.0, "model_tokens": 0}
    return done, timing


def sample_waves(cfg: Any, task: Any, todo: list[tuple[int, dict]], done: list[Trajectory], timing: dict[str, Any],
                 episodes: Path, wave: int, seed: int, code: str, total: int) -> None:
    """Sample the ``todo`` problems with ``cfg``'s model, ``wave`` at a time, appending each wave's episodes to
    ``done`` and writing them (atomically) and ``timing`` to disk as the wave ends, so a rerun resumes there. The
    model and a pool of ``wave`` kernels are opened here (``open_env``) and closed at the end. ``code``: the replrl
    version."""
    episodes.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open_env(cfg, pool_size=wave, task=task) as env:
        print(f"  model loaded and kernels started in {time.perf_counter() - t0:.1f} s", flush=True)
        for start in range(0, len(todo), wave):
            sampling = cfg.rollout.sampling(seed=seed + 7 + len(done))
            part, stats = run_sync(rollout(env, todo[start:start + wave], sampling))
            done += part
            save_jsonl(done, episodes.with_suffix(".partial"))
            os.replace(episodes.with_suffix(".partial"), episodes)
            timing["wall_s"] += stats.wall_s
            timing["model_tokens"] += stats.model_tokens
            timing["setup_s"] = timing.get("setup_s", 0.0) + stats.extra.get("setup_s", 0.0)
            timing["code"] = code
            episodes.with_suffix(".timing.json").write_text(json.dumps(timing))
            print(f"  {len(done)}/{total} episodes, {sum(bool(t.correct) for t in done)} correct, "
                  f"{stats.model_tokens / max(stats.wall_s, 1e-9):.1f} tokens/s in this wave", flush=True)


def write_results(out: Path, results: dict[str, Any]) -> None:
    """``results`` to ``out`` as JSON, atomically (an interrupted write leaves the last whole file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp, out)


def _code_version() -> str:
    """The commit the cell ran at, and the files of replrl/ and sandbox/ then modified but not committed."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        return done.stdout.rstrip()

    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "replrl", "sandbox").splitlines()
    modified = " ".join(line[3:] for line in dirty if line.strip())
    return git("rev-parse", "--short", "HEAD") + (f" + uncommitted {modified}" if modified else "")


def _limits(cfg: Any) -> dict[str, int]:
    r = cfg.rollout
    return {"max_lines": r.max_lines, "max_line_tokens": r.max_line_tokens, "max_total_tokens": r.max_total_tokens,
            "max_output_tokens": r.max_output_tokens}


def table(cells: list[dict[str, Any]]) -> str:
    cols = ["model", "T", "level 1", "level 2", "level 3", "all", "submit", "lines/ep", "syntax err/line",
            "opened block", "block rule err", "EOT line ran", "tokens/s"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for c in cells:
        a, levels = c["all"], [c["levels"][str(lv)] for lv in LEVELS]
        out.append("| " + " | ".join([
            c["model"], f"{c['temperature']}",
            *(f"{round(x['accuracy'] * x['episodes'])}/{x['episodes']}" for x in levels),
            f"{a['accuracy']:.1%}", f"{a['submit_rate']:.0%}", f"{a['lines_per_episode']:.1f}",
            f"{a['syntax_error_rate']:.1%}", f"{a['opened_block']:.0%}", f"{a['block_rule_error']:.0%}",
            f"{a['eof_line_ran']:.1%}", f"{c['tokens_per_s']:.1f}"]) + " |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.7, 1.0])
    p.add_argument("--per-level", type=int, default=52, help="problems per level (52 = 4 per family)")
    p.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    p.add_argument("--wave", type=int, default=16, help="episodes sampled at once (kernels in the pool)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/results/programs_baseline.json", help="results, one entry per cell")
    p.add_argument("--episodes", default="/tmp/programs_baseline", help="directory for the episodes (JSON Lines)")
    p.add_argument("--refigure", action="store_true",
                   help="recompute finished cells from their episodes (sampling only what is missing)")
    args = p.parse_args()
    if args.per_level < 1 or args.wave < 1:
        raise ValueError("--per-level and --wave must be >= 1")
    code = _code_version()  # as this process imported it

    def cell_of(model: str, temperature: float, episodes: Path) -> dict[str, Any]:
        return run_cell(model, temperature, args.per_level, args.backend, args.wave, episodes, args.seed, code)

    run_cells("programs_baseline", args, cell_of, table, redo=args.refigure)
    return 0


def run_cells(name: str, args: argparse.Namespace, cell_of, table, redo: bool) -> None:
    """Every (model, temperature) cell of ``args`` into ``args.out``, one at a time and written after each (so an
    interrupted bench goes on where it stopped): a cell already there for the same ``--per-level`` is kept unless
    ``redo``; ``cell_of(model, temperature, episodes_path)`` makes one. Prints the table and one JSON line."""
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {"cells": {}}
    cells = []
    for model in args.models:
        for temperature in args.temperatures:
            key = f"{model}@{temperature}"
            cell = results["cells"].get(key)
            if cell is None or cell["per_level"] != args.per_level or redo:
                episodes = Path(args.episodes) / f"{model.replace('/', '_')}@{temperature}.jsonl"
                cell = cell_of(model, temperature, episodes)
                results["cells"][key] = cell
                write_results(out, results)
            cells.append(cell)
            print(table([cell]).splitlines()[-1], flush=True)
    print()
    print(table(cells))
    print(json.dumps({name: {k: {"accuracy_per_level": [c["levels"][str(lv)]["accuracy"] for lv in LEVELS],
                                 **c["all"], "tokens_per_s": c["tokens_per_s"]}
                             for k, c in results["cells"].items()}}))


if __name__ == "__main__":
    sys.exit(run_script(main))
