"""`replrl rollout`: sample and score episodes without training; write them as JSON Lines and print a summary."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..config import Config
from ..configlib import add_arguments, overrides_from_args, resolve


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "rollout",
        help="sample and score REPL episodes with a model (no training)",
        description="Sample episodes of a task with a model in the sandboxed REPL, score every line, write the "
        "trajectories as JSON Lines and print a summary: lines per episode, syntax-error and exception rates per "
        "line, answer accuracy, tokens/s, and wall time split into generation / execution / other.",
    )
    p.add_argument("config", nargs="?", help="TOML config file (optional; options below override it)")
    p.add_argument("--model", help="model spec (hub id, directory, .gguf, smollm2-135m-instruct, tiny, or a run "
                                   "directory: its latest checkpoint)")
    p.add_argument("--task", help="task name or import path (module:Class)")
    p.add_argument("--data", help="dataset for data-backed tasks (hub id, .jsonl/.parquet, directory)")
    p.add_argument("--split", default=None, help="split to draw problems from (default: task.eval_split)")
    p.add_argument("--n", type=int, default=16, help="number of episodes (default 16)")
    p.add_argument("--group-size", type=int, default=1, help="episodes per problem (default 1)")
    p.add_argument("--out", default="rollouts.jsonl", help="output JSON Lines file (default rollouts.jsonl)")
    add_arguments(p, Config)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> Config:
    overrides = overrides_from_args(args)
    for flag, (sec, key) in {"model": ("model", "name"), "task": ("task", "name"), "data": ("task", "data")}.items():
        if getattr(args, flag, None):
            overrides.setdefault(sec, {})[key] = getattr(args, flag)
    return resolve(Config, args.config, overrides)


def run(args: argparse.Namespace) -> int:
    """``replrl rollout``: a shell over ``replrl.api.rollout_episodes``."""
    from tqdm.auto import tqdm

    from ..api import rollout_episodes
    from ..rollout import summarize

    cfg = config_from_args(args)
    if args.n < 1 or args.group_size < 1:
        raise ValueError("--n and --group-size must be >= 1")
    cfg.rollout.kernel_isolation()  # no sandbox where kernels run (here or on Ray): one line before a model loads
    n_problems = -(-args.n // args.group_size)
    with tqdm(total=n_problems * args.group_size, desc="rollout", unit="episode", file=sys.stderr) as bar:
        trajs, stats = rollout_episodes(cfg.model.name, args.n, cfg=cfg, group_size=args.group_size,
                                        split=args.split, progress=bar)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for t in trajs:
            f.write(t.to_json() + "\n")
    summary = summarize(trajs, stats)
    print(format_summary(summary))
    print(f"wrote {len(trajs)} episodes to {out}")
    print(json.dumps({k: round(v, 4) for k, v in summary.items()}))
    return 0


def format_summary(s: dict[str, float]) -> str:
    lines = [
        f"episodes            {s['episodes']:.0f}",
        f"accuracy            {s['accuracy']:.3f}   (submitted: {s['submit_rate']:.3f})",
        f"reward              {s['reward_mean']:+.3f} ± {s['reward_std']:.3f}",
        f"lines per episode   {s['lines_per_episode']:.2f}",
        f"per line            syntax errors {s['syntax_error_rate']:.3f}, exceptions {s['exception_rate']:.3f}, "
        f"timeouts {s['timeout_rate']:.3f}, crashes {s['crash_rate']:.3f}",
        f"tokens per episode  model {s['model_tokens_per_episode']:.1f}, "
        f"interpreter {s['env_tokens_per_episode']:.1f}",
        "end reasons         " + ", ".join(f"{k[4:]} {v:.2f}" for k, v in s.items() if k.startswith("end/")),
    ]
    levels = [k for k in s if k.startswith("accuracy_level")]
    if levels:
        lines.insert(2, "accuracy by level   " + ", ".join(f"{k[len('accuracy_level'):]}: {s[k]:.3f}" for k in levels))
    if "block_rate" in s:
        correct = f" (of the correct ones: {s['correct_block_frac']:.3f})" if "correct_block_frac" in s else ""
        lines.append(f"multi-line blocks   {s['block_rate']:.3f} of episodes{correct}")
    if "generation_s" not in s and "wall_s" in s:
        lines.append(f"time                {s['wall_s']:.1f} s wall")
    if "generation_s" in s:
        lines.append(f"time                {s['wall_s']:.1f} s wall: generation {s['generation_s']:.1f} s, "
                     f"execution {s['execution_s']:.1f} s (summed over episodes, overlaps generation), "
                     f"other {s['other_s']:.1f} s; {s['tokens_per_s']:.1f} model tokens/s")
    return "\n".join(lines)
