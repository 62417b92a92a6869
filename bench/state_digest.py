"""The interpreter-state digest: what it costs per line, and how often states repeat in real rollouts.

1. ``measure_digest_ms_per_line()``: a sequence of typical lines (assignments, a list, a dict, an import, a function,
   a print, an expression), run in one sandboxed kernel in REPL mode, each line twice in a row with and without the
   digest, alternating which goes first: the kernel's own digest time (``StateDigest.ms``) and the round trip with
   and without it, side by side.
2. Real rollouts (``--models``; the 0.5B under ``flock /tmp/replrl-heavy.lock``): ``--groups`` problems of
   ``--task`` (``programs`` by default, or ``explore``) at ``--level`` (default 1), ``--group-size`` episodes each,
   temperature 0.7, the task's rollout limits, digests on.
   Per model: how often a line's start state repeats in its group with and without names (lines after the first:
   the first line's fresh state is shared by construction), the step groups formed, and the share of lines that
   the ``state`` estimator credits differently from ``outcome``.

Prints a table, then one JSON line.

    python bench/state_digest.py --models none                                  # the cost alone, in seconds
    flock /tmp/replrl-heavy.lock python bench/state_digest.py                  # + SmolLM2-135M and the 0.5B
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from replrl.advantages import batch_tensors, compute_advantages
from replrl.api import load_config
from replrl.cli import run_script
from replrl.evaluation import split_rows
from replrl.rollout import open_env, rollout, state_stats
from replrl.tasks import task_from_config
from replrl.types import Trajectory
from replrl.viewer import save_jsonl
from sandbox import Kernel, Limits, run_sync

TYPICAL_LINES = (
    "price = 4175",
    "items = [price, 12, 7.5, 'widget']",
    "total = price * 12 + 7",
    "import math",
    "stock = {'apples': 12, 'pears': 30, 'plums': [1, 2, 3]}",
    "def share(n, k):\n    return n // k\n",
    "print(share(total, 7))",
    "math.sqrt(total)",
    "names = sorted(stock)",
    "left = total - share(total, 3)",
)
"""Lines like those the models write on `programs`: the namespace grows to about ten variables."""
MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _measure(rounds: int, lines: tuple[str, ...]) -> dict[str, float]:
    with_ms: list[float] = []
    without_ms: list[float] = []
    kernel_ms: list[float] = []
    async with Kernel(Limits()) as kernel:
        for r in range(rounds):
            for k, line in enumerate(lines):
                order = (True, False) if (r + k) % 2 == 0 else (False, True)
                for digest in order:  # the same line twice: the second run leaves the same state
                    t0 = time.perf_counter()
                    result = await kernel.execute(line, mode="single", digest=digest)
                    elapsed = (time.perf_counter() - t0) * 1000.0
                    if result.status != "ok":
                        raise RuntimeError(f"bench line failed: {line!r}: {result.output}")
                    (with_ms if digest else without_ms).append(elapsed)
                    if digest:
                        kernel_ms.append(result.state.ms if result.state else float("nan"))
    return {
        "state_digest_ms_per_line": statistics.mean(kernel_ms),
        "state_digest_ms_p99": _pct(kernel_ms, 0.99),
        "state_digest_ms_max": max(kernel_ms),
        "roundtrip_ms_p50_with_digest": _pct(with_ms, 0.5),
        "roundtrip_ms_p50_without_digest": _pct(without_ms, 0.5),
        "roundtrip_ms_mean_with_digest": statistics.mean(with_ms),
        "roundtrip_ms_mean_without_digest": statistics.mean(without_ms),
        "lines_measured": len(kernel_ms),
    }


def measure_digest_ms_per_line(rounds: int = 30, lines: tuple[str, ...] = TYPICAL_LINES) -> dict[str, float]:
    """The digest's cost on typical lines, in one kernel: ``state_digest_ms_per_line`` (the kernel's own time, mean),
    its p99 and max, and the round trip's p50 and mean with and without the digest (each line run both ways, in
    alternating order). Importable by other benches."""
    return asyncio.run(_measure(rounds, lines))


def _states_credited_apart(trajs: list[Trajectory], key: str) -> float:
    """Share of lines (after the first of an episode) whose ``state`` advantage differs from ``outcome``'s."""
    batch = batch_tensors(trajs, pad_id=0)
    state = compute_advantages("state", batch, scale="std", state_weight=0.5, state_key=key)
    outcome = compute_advantages("outcome", batch, scale="std")
    differ = total = 0
    for i, tr in enumerate(trajs):
        for ln in tr.lines[1:]:
            start, end = ln.token_span
            if end > start:
                total += 1
                differ += bool((state[i, start:end] != outcome[i, start:end]).any())
    return differ / max(total, 1)


def repeat_rates(model: str, groups: int = 4, group_size: int = 8, temperature: float = 0.7, level: int = 1,
                 seed: int = 0, episodes: Path | None = None, task_name: str = "programs") -> dict[str, Any]:
    """Roll out ``groups`` x ``group_size`` episodes of ``task_name`` at ``level`` with digests on; the repeat
    statistics of their start states (``replrl.rollout.state_stats``) and a few more figures. ``episodes``: a JSON
    Lines file to keep the episodes in."""
    cfg = load_config(model={"name": model}, task={"name": task_name, "level": level},
                      rollout={"temperature": temperature, "group_size": group_size, "state_digest": True},
                      run={"seed": seed})
    task = task_from_config(cfg)
    rows = list(enumerate(split_rows(task, cfg.task.train_split)))[:groups]
    t0 = time.perf_counter()
    with open_env(cfg, pool_size=min(groups * group_size, 16), task=task) as env:
        load_s = time.perf_counter() - t0  # the model loaded and the kernels started
        trajs, stats = run_sync(rollout(env, rows, cfg.rollout.sampling(seed=seed), group_size=group_size))
    if episodes is not None:
        episodes.parent.mkdir(parents=True, exist_ok=True)
        save_jsonl(trajs, episodes)
    figures = state_stats(trajs)
    lines = [ln for t in trajs for ln in t.lines]
    later = [ln for t in trajs for ln in t.lines[1:]]
    out = {
        "episodes": len(trajs), "lines": len(lines), "lines_after_first": len(later),
        "accuracy": sum(bool(t.correct) for t in trajs) / len(trajs),
        "repeat_frac_named": figures.get("state/repeat_frac", 0.0),
        "repeat_frac_values": figures.get("state/repeat_frac_values", 0.0),
        "fresh_frac": figures.get("state/fresh_frac", 0.0),
        "step_groups_named": figures.get("state/step_groups", 0.0),
        "step_groups_values": figures.get("state/step_groups_values", 0.0),
        "credited_apart_named": _states_credited_apart(trajs, "named"),
        "credited_apart_values": _states_credited_apart(trajs, "values"),
        "digest_ms_mean": figures.get("state/digest_ms_mean", 0.0),
        "digest_ms_max": figures.get("state/digest_ms_max", 0.0),
        "slow_digest_frac": figures.get("state/slow_digest_frac", 0.0),
        "rollout_wall_s": stats.wall_s, "load_s": load_s,
    }
    by_position: dict[int, list[int]] = {}  # line position -> [lines, lines whose values state repeats]
    shared = _shared_keys(trajs)
    for t in trajs:
        for k, ln in enumerate(t.lines[1:], start=1):
            slot = by_position.setdefault(k, [0, 0])
            slot[0] += 1
            slot[1] += (t.row, t.group, ln.state_values) in shared
    out["repeats_values_by_line"] = {str(k + 1): f"{v[1]}/{v[0]}" for k, v in sorted(by_position.items()) if v[1]}
    return out


def _shared_keys(trajs: list[Trajectory]) -> set[tuple[int, int, str]]:
    episodes: dict[tuple[int, int, str], set[int]] = {}
    for i, t in enumerate(trajs):
        for ln in t.lines:
            if ln.state_values:
                episodes.setdefault((t.row, t.group, ln.state_values), set()).add(i)
    return {key for key, eps in episodes.items() if len(eps) > 1}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30, help="passes over the typical lines (each line both ways)")
    p.add_argument("--models", nargs="+", default=list(MODELS), help="models to roll out ('none': the cost alone)")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--level", type=int, default=1)
    p.add_argument("--task", default="programs", help="the task rolled out (programs, explore)")
    p.add_argument("--episodes", default="/tmp/state_digest", help="directory for the episodes (JSON Lines)")
    args = p.parse_args()
    if args.rounds < 1 or args.groups < 1 or args.group_size < 2:
        raise ValueError("--rounds and --groups must be >= 1, --group-size >= 2")
    cost = measure_digest_ms_per_line(args.rounds)
    print(f"digest in the kernel: {cost['state_digest_ms_per_line']:.3f} ms a line (p99 "
          f"{cost['state_digest_ms_p99']:.3f}, max {cost['state_digest_ms_max']:.3f}); round trip p50 "
          f"{cost['roundtrip_ms_p50_with_digest']:.2f} ms with, {cost['roundtrip_ms_p50_without_digest']:.2f} ms "
          f"without ({cost['lines_measured']} lines)", flush=True)
    rollouts = {}
    for model in [m for m in args.models if m != "none"]:
        rollouts[model] = repeat_rates(model, args.groups, args.group_size, args.temperature, args.level,
                                       episodes=Path(args.episodes) / f"{model.replace('/', '_')}.jsonl",
                                       task_name=args.task)
        r = rollouts[model]
        print(f"{model}: {r['episodes']} episodes, {r['lines']} lines ({r['lines_after_first']} after the first), "
              f"accuracy {r['accuracy']:.0%}; start state repeats: named {r['repeat_frac_named']:.1%}, values "
              f"{r['repeat_frac_values']:.1%} (in the fresh state: {r['fresh_frac']:.1%}); "
              f"step groups {r['step_groups_named']:.0f} / "
              f"{r['step_groups_values']:.0f}; credited apart from outcome: {r['credited_apart_named']:.1%} / "
              f"{r['credited_apart_values']:.1%}; repeats by line {r['repeats_values_by_line']}; "
              f"rollout {r['rollout_wall_s']:.0f} s", flush=True)
    print(json.dumps({"task": args.task, "level": args.level,
                      "state_digest_ms_per_line": cost["state_digest_ms_per_line"],
                      "state_digest_overhead_ms_p50": cost["roundtrip_ms_p50_with_digest"]
                      - cost["roundtrip_ms_p50_without_digest"], "cost": cost,
                      **{f"repeat_frac_named/{m}": r["repeat_frac_named"] for m, r in rollouts.items()},
                      **{f"repeat_frac_values/{m}": r["repeat_frac_values"] for m, r in rollouts.items()},
                      "rollouts": rollouts}))


if __name__ == "__main__":
    raise SystemExit(run_script(main))
