"""Speculative continuation of silent lines (``rollout.speculate``), off vs on, side by side in one run.

The same REPL rollouts (``replrl.rollout.rollout``: GSM8K prompts with the chat template and banner, real sandboxed
kernels, the default reward terms, seeded sampling at the config's temperature) with speculation off and on, in
alternating order (off, on, on, off, ...) so the machine's load falls on both alike, for each model and backend:

- ``hf`` on the CPU proxy (``proxy``: Qwen2.5's tokenizer over 2 random layers, bench/proxy_model.py), where an
  engine step is cheap and the loop's own costs show, and on ``smollm2-135m-instruct`` (real weights: lines a model
  writes, so a real share of silent lines);
- ``vllm`` on the same models when vLLM imports here (e.g. ``.venv-vllm/bin/python bench/speculation.py``).

Per model and backend: each setting's wall time (summed over repeats), model tokens, lines; ``wall_ratio_on_off``
(< 1: speculation is faster), the same per model token (``per_token_ratio_on_off``: a rollback changes what is
sampled, so the two settings' episodes differ), ``speculated_frac`` (lines whose successor was sampled while they
ran) and ``hit_rate`` (of those, kept). The last line is one JSON object with every figure.

``--guess silent`` guesses every line silent (``ReplSession.silent_prompt`` replaced: only the limits known before a
line runs stop a guess), so every line that prints or raises is a rollback: on the proxy, whose random lines are
never silent, that prices a miss.

    python bench/speculation.py [--models proxy smollm2-135m-instruct] [--backends hf vllm] [--batch 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from proxy_model import proxy_dir  # bench/, next to this script: the CPU proxy

from replrl.backends import open_generator
from replrl.backends.hf import GEN_THREADS
from replrl.config import Config, ModelConfig, RolloutConfig
from replrl.models import load_model_and_tokenizer
from replrl.repl import PS1, PS2, ReplSession
from replrl.rollout import Env, open_env, rollout, summarize
from replrl.tasks import load_task
from sandbox import Limits, run_sync

DATA = os.environ.get("REPLRL_GSM8K") or str(Path(__file__).resolve().parents[1] / "tests" / "data" / "gsm8k")


def vllm_importable() -> bool:
    try:
        import replrl.backends.vllm  # noqa: F401
    except ImportError:
        return False
    return True


def guess_every_line_silent(self: ReplSession, line: str) -> str:
    """``ReplSession.silent_prompt`` that never says "it prints" (``--guess silent``)."""
    return PS2 if self._needs_more("\n".join([*self.buffer, line])) else PS1


def run_pair(env: Env, rows: list, sampling: Any, repeats: int) -> dict[str, Any]:
    """Speculation off and on, ``repeats`` times each in alternating order; the summed figures of each."""
    pool, rules = env.pool, env.rules
    totals = {s: {"wall_s": 0.0, "model_tokens": 0.0, "lines": 0.0, "speculated": 0.0, "hits": 0.0}
              for s in ("off", "on")}
    run_sync(rollout(env, rows[: max(2, len(rows) // 4)], sampling))  # warm-up, untimed
    order = [("off", "on"), ("on", "off")]
    for r in range(repeats):
        for setting in order[r % 2]:
            run_sync(pool.wait_full(600))  # every run starts from a full pool (no kernel boots beside it)
            t0 = time.perf_counter()
            on = dataclasses.replace(env, rules=dataclasses.replace(rules, speculate=setting == "on"))
            trajs, stats = run_sync(rollout(on, rows, sampling))
            wall = time.perf_counter() - t0
            s = summarize(trajs, stats)
            t = totals[setting]
            t["wall_s"] += wall
            t["model_tokens"] += stats.model_tokens
            t["lines"] += sum(len(tr.lines) for tr in trajs)
            t["speculated"] += s.get("rollout/speculated_lines", 0.0)
            t["hits"] += s.get("rollout/speculation_hit_rate", 0.0) * s.get("rollout/speculated_lines", 0.0)
    off, on = totals["off"], totals["on"]
    return {
        "off_wall_s": round(off["wall_s"], 3), "on_wall_s": round(on["wall_s"], 3),
        "wall_ratio_on_off": round(on["wall_s"] / off["wall_s"], 3),
        "per_token_ratio_on_off": round((on["wall_s"] / max(on["model_tokens"], 1))
                                        / (off["wall_s"] / max(off["model_tokens"], 1)), 3),
        "off_model_tokens": int(off["model_tokens"]), "on_model_tokens": int(on["model_tokens"]),
        "off_lines": int(off["lines"]), "on_lines": int(on["lines"]),
        "speculated_frac": round(on["speculated"] / max(on["lines"], 1), 3),
        "hit_rate": round(on["hits"] / on["speculated"], 3) if on["speculated"] else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["proxy", "smollm2-135m-instruct"],
                    help="model specs, or `proxy` (bench/proxy_model.py)")
    ap.add_argument("--backends", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"],
                    help="vllm only where it imports (skipped otherwise)")
    ap.add_argument("--data", default=DATA, help="GSM8K: directory or .jsonl file ($REPLRL_GSM8K)")
    ap.add_argument("--batch", type=int, default=16, help="episodes a rollout")
    ap.add_argument("--repeats", type=int, default=2, help="timed rollouts per setting (alternating order)")
    ap.add_argument("--max-lines", type=int, default=12)
    ap.add_argument("--line-tokens", type=int, default=32)
    ap.add_argument("--guess", default="predict", choices=["predict", "silent"],
                    help="predict: ReplSession.silent_prompt; silent: every line guessed silent (prices misses)")
    args = ap.parse_args()
    if args.guess == "silent":
        ReplSession.silent_prompt = guess_every_line_silent  # type: ignore[method-assign]
    Limits().resolve_isolation()  # no sandbox: one line now, before a model is loaded
    if GEN_THREADS:
        torch.set_num_threads(GEN_THREADS)
    backends = [b for b in args.backends if b != "vllm" or vllm_importable()]
    skipped = sorted(set(args.backends) - set(backends))
    if skipped:
        print(f"skipped (not importable here): {', '.join(skipped)}")
    task = load_task("gsm8k", data=args.data)
    rows = list(enumerate(task.rows("test")))[: args.batch]
    cfg = Config(rollout=RolloutConfig(max_lines=args.max_lines, max_line_tokens=args.line_tokens,
                                       max_total_tokens=2048, max_output_tokens=64, wall_s=2.0))
    sampling = cfg.rollout.sampling(seed=0)
    figures: dict[str, Any] = {"guess": args.guess, "batch": args.batch, "repeats": args.repeats,
                               "max_lines": args.max_lines, "temperature": cfg.rollout.temperature,
                               "cpus": os.cpu_count(), "device": "cuda" if torch.cuda.is_available() else "cpu"}
    for spec in args.models:
        model, tokenizer = load_model_and_tokenizer(str(proxy_dir()) if spec == "proxy" else spec)
        model.eval()
        name = "proxy" if spec == "proxy" else spec.split("/")[-1]
        for backend in backends:
            gen = open_generator(ModelConfig(backend=backend), model, tokenizer)
            try:
                with open_env(cfg, pool_size=args.batch, generator=gen, task=task) as env:
                    fig = run_pair(env, rows, sampling, args.repeats)
            finally:
                gen.close()
            figures[f"{backend}/{name}"] = fig
            print(f"{backend:5s} {name:24s} off {fig['off_wall_s']:7.2f} s  on {fig['on_wall_s']:7.2f} s  "
                  f"ratio {fig['wall_ratio_on_off']:.3f} (per token {fig['per_token_ratio_on_off']:.3f})  "
                  f"speculated {fig['speculated_frac']:.0%} of lines, hit rate {fig['hit_rate']}", flush=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    sys.exit(main())
