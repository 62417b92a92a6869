"""A flat group of 8 against a tree of 8 leaves: the same problems, model, sampling and kernels, side by side.

For each repeat and each problem: a flat group (``group_size`` independent episodes) and a tree group (``--roots``
episodes branching after the ``--branch-at`` executed lines into ``--width`` children: as many leaves), alternating
which goes first. Figures (sums over all groups):

- ``tree_vs_flat_tokens_generated``: tokens the policy sampled for the tree / for the flat group (target <= 0.8 with
  branch points at lines 2 and 4). The tree samples its shared prefixes once;
- ``tree_vs_flat_wall``: wall time of the tree rollouts / of the flat ones (target <= 1.0). A child starts when its
  parent branches, after a fresh kernel and a replay; on HF it is a row forked from its parent's, whose KV cache
  rows are copied (``tree_forked_tokens``, ``tree_fork_s``) instead of prefilled again
  (``tree_vs_flat_prefill_tokens``: tokens fed to the model, prompt included);
- ``replay_ms_per_line``: one replay at a time into a fresh kernel of the pool, of the tree's leaves' lines, per line
  (target <= 5 ms); ``replay_ms_per_line_in_tree``: the same inside the tree rollouts, where replays run
  concurrently with each other and with generation (what a training step pays); ``replay_ms_per_line_assignments``:
  20 plain assignments replayed, the floor (the kernel's round trip).

With ``--backend vllm`` (the CPU build of .ci/vllm_env.sh, or a GPU) the engine logs its statistics, and vLLM's own
prefix-cache counters give ``tree_prefix_cache_hit_rate`` / ``flat_prefix_cache_hit_rate``: of the prompt tokens of
the rollouts' fresh requests (a row's first line; its later lines continue its request and are not looked up), the
share found already computed. ``tree_vs_flat_prefill_tokens`` then counts the tokens vLLM computed (prompt tokens not
found in a cache, plus the sampled tokens fed back), the counterpart of the HF backend's fed tokens.

One flat rollout of the first problem runs first and is not counted (``--warmup``): the process's first forwards
and kernels are slower, and the first measured rollout is a flat one.

    python bench/tree_rollout.py [--model smollm2-135m-instruct] [--backend hf] [--problems 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from replrl.cli import run_script
from replrl.config import Config
from replrl.configlib import resolve
from replrl.repl import ReplSession
from replrl.rollout import Env, TreeShape, open_env, rollout
from replrl.tasks import task_from_config
from sandbox import run_sync
from sandbox.protocols import Pool


async def replay_assignments_ms_per_line(pool: Pool, n: int = 5) -> float:
    """Replay 20 assignments (``x3 = 3 * 3``), one replay at a time into a fresh kernel: ms per line (median)."""
    lines = [(f"x{i} = {i} * 3", "") for i in range(20)]
    per_line = []
    for _ in range(n):
        async with pool.acquire() as kernel:
            rep = await ReplSession(kernel, banner="").replay(lines)
        per_line.append(1000 * rep.duration_s / rep.lines)
    return statistics.median(per_line)


async def replay_ms_per_line(pool: Pool, trajs: list, n: int = 8) -> float:
    """Replay the lines of up to ``n`` leaves, one at a time, each into a fresh kernel: ms per line."""
    per_line = []
    for t in trajs[:n]:
        lines = [(ln.code, ln.output) for ln in t.lines if ln.status != "timeout"][:8]
        if not lines:
            continue
        async with pool.acquire() as kernel:
            rep = await ReplSession(kernel, banner="").replay(lines)
        per_line.append(1000 * rep.duration_s / rep.lines)
    return statistics.median(per_line) if per_line else float("nan")


def vllm_opts(backend: str) -> dict:
    """Engine arguments ([model.vllm]) for ``open_generator``: vLLM logs its statistics (the prefix-cache counters);
    none for hf."""
    return {"disable_log_stats": False} if backend == "vllm" else {}


def prefix_cache_counters(backend: str) -> tuple[int, int]:
    """vLLM's prefix-cache counters so far: (prompt tokens of fresh requests looked up, of which found computed);
    (0, 0) for hf."""
    if backend != "vllm":
        return 0, 0
    from vllm.v1.metrics.reader import Counter, get_metrics_snapshot

    got = {"vllm:prefix_cache_queries": 0, "vllm:prefix_cache_hits": 0}
    for m in get_metrics_snapshot():
        if isinstance(m, Counter) and m.name in got:
            got[m.name] += m.value
    return got["vllm:prefix_cache_queries"], got["vllm:prefix_cache_hits"]


def fed_tokens(extra: dict) -> float:
    """Tokens the backend put through the model in a rollout: HF's fed tokens; for vLLM, prompt tokens not found
    computed (in the row's request or the prefix cache) plus the sampled tokens fed back (all but a line's last)."""
    if "gen_fed_tokens" in extra:
        return extra["gen_fed_tokens"]
    return (extra.get("gen_prompt_tokens", 0.0) - extra.get("gen_cached_tokens", 0.0)
            + extra.get("gen_sampled_tokens", 0.0) - extra.get("gen_requests", 0.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--backend", default="hf", choices=("hf", "vllm"))
    ap.add_argument("--task", default="programs")
    ap.add_argument("--level", type=int, default=1)
    ap.add_argument("--problems", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--roots", type=int, default=2)
    ap.add_argument("--branch-at", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--width", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-lines", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=1, help="flat rollouts of one problem before measuring, not counted")
    args = ap.parse_args()

    shape = TreeShape(args.roots, tuple(args.branch_at), args.width)
    cfg = resolve(Config, None, {"model": {"name": args.model, "backend": args.backend},
                                 "task": {"name": args.task, "level": args.level},
                                 "rollout": {"group_size": shape.leaves, "temperature": args.temperature,
                                             "max_lines": args.max_lines}})
    task = task_from_config(cfg)
    rows = [(i, task.rows(cfg.task.train_split)[i]) for i in range(args.problems)]
    cfg.model.vllm.update(vllm_opts(cfg.model.backend))
    totals = {k: {"wall": 0.0, "generated": 0, "fed": 0.0, "leaves": 0, "lines": 0, "lookups": 0, "hits": 0,
                  "forked": 0.0, "fork_s": 0.0}
              for k in ("flat", "tree")}
    in_tree: list[float] = []
    leaves: list = []

    async def go(env: Env) -> tuple[float, float]:
        pool = env.pool
        for _ in range(args.warmup):  # not counted: the first forwards and kernels of the process are slower
            await pool.wait_full()
            await rollout(env, rows[:1], cfg.rollout.sampling(seed=999_999), group_size=shape.leaves)
        for rep in range(args.repeats):
            for p, row in enumerate(rows):
                sampling = cfg.rollout.sampling(seed=1000 * rep + p)
                order = ("flat", "tree") if (rep + p) % 2 == 0 else ("tree", "flat")
                for kind in order:
                    await pool.wait_full()  # both start from a full warm pool
                    cache_before = prefix_cache_counters(args.backend)
                    t0 = time.perf_counter()
                    trajs, stats = await rollout(env, [row], sampling, group_size=shape.leaves,
                                                 tree=shape if kind == "tree" else None)
                    tot = totals[kind]
                    tot["wall"] += time.perf_counter() - t0
                    tot["generated"] += stats.model_tokens  # a tree counts its shared prefixes once
                    tot["fed"] += fed_tokens(stats.extra)
                    cache_after = prefix_cache_counters(args.backend)
                    tot["lookups"] += cache_after[0] - cache_before[0]
                    tot["hits"] += cache_after[1] - cache_before[1]
                    tot["forked"] += stats.extra.get("gen_forked_tokens", 0.0)
                    tot["fork_s"] += stats.extra.get("gen_fork_s", 0.0)
                    tot["leaves"] += len(trajs)
                    tot["lines"] += sum(len(t.lines) for t in trajs)
                    if kind == "tree":
                        in_tree.append(stats.extra["tree/replay_ms_per_line"])
                        leaves.extend(trajs)
                    print(f"repeat {rep} problem {p} {kind}: {len(trajs)} episodes, {stats.model_tokens} tokens "
                          f"sampled, {sum(len(t.lines) for t in trajs) / len(trajs):.1f} lines each, "
                          f"{stats.wall_s:.1f} s", flush=True)
        return (await replay_ms_per_line(pool, [t for t in leaves if not t.tree_diverged]),
                await replay_assignments_ms_per_line(pool))

    with open_env(cfg, pool_size=shape.leaves, task=task) as env:  # vLLM's engine exits with it, not at teardown
        replay, replay_assignments = run_sync(go(env))
    flat, tree = totals["flat"], totals["tree"]
    figures = {
        "tree_vs_flat_tokens_generated": tree["generated"] / max(flat["generated"], 1),
        "tree_vs_flat_wall": tree["wall"] / flat["wall"],
        "replay_ms_per_line": replay,
        "replay_ms_per_line_in_tree": statistics.median(in_tree),
        "replay_ms_per_line_assignments": replay_assignments,
        "tree_vs_flat_prefill_tokens": tree["fed"] / flat["fed"] if flat["fed"] else None,
        "tree_prefix_cache_hit_rate": tree["hits"] / tree["lookups"] if tree["lookups"] else None,
        "flat_prefix_cache_hit_rate": flat["hits"] / flat["lookups"] if flat["lookups"] else None,
        "tree_forked_tokens": tree["forked"], "tree_fork_s": tree["fork_s"],
        "flat_lines_per_episode": flat["lines"] / max(flat["leaves"], 1),
        "tree_lines_per_leaf": tree["lines"] / max(tree["leaves"], 1),
        "tree_leaves_per_group": tree["leaves"] / (args.repeats * len(rows)),
        "flat_wall_s": flat["wall"], "tree_wall_s": tree["wall"],
        "model": args.model, "backend": args.backend, "task": f"{args.task} level {args.level}",
        "shape": {"roots": shape.roots, "branch_at": list(shape.branch_at), "width": shape.width},
        "groups": args.repeats * len(rows),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    raise SystemExit(run_script(main))
