"""The rollout loop's own cost per line, side by side in one run: what the host process spends on a row's line when
generation costs nothing.

A generator that answers every ``next_line`` at once with the next line of a fixed 10-line script (``ReplayGenerator``;
no model) drives ``replrl.rollout.rollout`` over real sandboxed kernels at batch B (B episodes at once, one kernel
each). Beside it, in the same run, the same lines are typed into B kernels through ``ReplSession`` alone (what an
episode's execution costs without the rollout's bookkeeping: tokenizing, the transcript, rewards). Per batch size:

- wall per line round: the run's wall time over the script's lines (every row types them in turn);
- host CPU per row-line: this process's CPU time (``time.process_time``) over B x lines, for the rollout and for the
  kernels alone. The rollout's event loop is one thread: at batch B a line round costs at least B times this.

On a GPU, vLLM's REPL rollouts cost ~16-25 ms per row-line more than generating the same tokens (docs/gpu.md); this
says how much of that the host loop can explain. Prints a table, then one JSON line.

    python bench/rollout_host.py [--batches 8 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from replrl.api import load_config
from replrl.cli import run_script
from replrl.evaluation import split_rows
from replrl.models import load_tokenizer
from replrl.repl import ReplSession
from replrl.rollout import encode, line_text, open_env, rollout
from replrl.types import LineSample, SamplingParams
from sandbox import run_sync
from sandbox.protocols import Pool

SCRIPT = [
    "n = 1234",
    "total = 0",
    "for i in range(n):",
    "    if i % 7 == 3:",
    "        total += i",
    "",
    "total",
    "half = total // 2",
    "print(half, n)",
    "submit(total)",
]
"""A typical short `programs` episode: assignments, a block, a value shown, a print, the submission."""


class ReplaySession:
    """Every row types SCRIPT, line by line, at once (no model, no waiting)."""

    def __init__(self, line_ids: list[list[int]], rows: int):
        self.line_ids, self.pos = line_ids, [0] * rows
        self.stats: dict[str, float] = {}
        self.timing: dict[str, float] = {}

    async def next_line(self, i: int, env_ids: list[int]) -> LineSample:
        ids = self.line_ids[min(self.pos[i], len(self.line_ids) - 1)]
        self.pos[i] += 1
        await asyncio.sleep(0)  # a real backend's await: let the other rows run
        return LineSample(list(ids), [0.0] * len(ids), "newline")

    async def rollback(self, i: int, length: int) -> None:
        raise NotImplementedError("the replay generator does not speculate")

    def finish(self, i: int) -> None:
        pass

    async def aclose(self) -> None:
        pass


class ReplayGenerator:
    """The Generator protocol over ReplaySession: the rollout loop with generation taken out."""

    own_weights = False
    last_sync_transport = ""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.line_ids = [encode(tokenizer, line_text(code)) for code in SCRIPT]
        self.version = 0

    def session(self, prompts: list[list[int]], sampling: SamplingParams) -> ReplaySession:
        return ReplaySession(self.line_ids, len(prompts))

    def sync_weights(self, model: Any, version: int | None = None) -> None:
        self.version = self.version + 1 if version is None else version

    def close(self) -> None:
        pass


async def kernels_alone(pool: Pool, batch: int) -> None:
    """SCRIPT typed into ``batch`` kernels at once through ReplSession (the execution a rollout does)."""

    async def one() -> None:
        async with pool.acquire() as kernel:
            session = ReplSession(kernel, banner="")
            for code in SCRIPT:
                await session.feed(code)

    await asyncio.gather(*(one() for _ in range(batch)))


def measure(batch: int, repeats: int) -> dict[str, float]:
    # kernel_hosts 0: the kernels' traffic in this process, as the figures recorded before kernel hosts (issue 65)
    cfg = load_config(model={"chat_template": False}, task={"name": "programs", "options": {"level": 1}},
                      rollout={"kernel_hosts": 0})
    generator = ReplayGenerator(load_tokenizer("smollm2-135m-instruct"))
    sampling = cfg.rollout.sampling()
    times: dict[str, list[tuple[float, float]]] = {"rollout": [], "kernels": []}
    with open_env(cfg, pool_size=batch, generator=generator) as env:
        rows = list(enumerate(split_rows(env.task, cfg.task.eval_split)[:batch]))
        run_sync(kernels_alone(env.pool, batch))  # warm: every kernel has run a line
        for _ in range(repeats):
            for name in ("kernels", "rollout"):  # alternating, so load drifts hit both alike
                wall, cpu = time.perf_counter(), time.process_time()
                if name == "kernels":
                    run_sync(kernels_alone(env.pool, batch))
                else:
                    trajs, _ = run_sync(rollout(env, rows, sampling))
                    lines = {len(t.lines) for t in trajs}
                    assert lines == {len(SCRIPT)}, f"every episode types the whole script, got {lines} lines"
                times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    out: dict[str, float] = {"batch": batch}
    for name, runs in times.items():
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        out[f"{name}_wall_ms_per_line_round"] = 1000 * wall / len(SCRIPT)
        out[f"{name}_host_cpu_ms_per_row_line"] = 1000 * cpu / (batch * len(SCRIPT))
    out["rollout_vs_kernels_wall"] = out["rollout_wall_ms_per_line_round"] / out["kernels_wall_ms_per_line_round"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", nargs="+", type=int, default=[8, 32])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if min(args.batches) < 1 or args.repeats < 1:
        raise ValueError("--batches and --repeats must be >= 1")
    results = [measure(b, args.repeats) for b in args.batches]
    print("| batch | wall per line round: rollout / kernels alone | host CPU per row-line: rollout / kernels alone |")
    print("|---|---|---|")
    for r in results:
        walls = f"{r['rollout_wall_ms_per_line_round']:.1f} / {r['kernels_wall_ms_per_line_round']:.1f} ms"
        cpus = f"{r['rollout_host_cpu_ms_per_row_line']:.2f} / {r['kernels_host_cpu_ms_per_row_line']:.2f} ms"
        print(f"| {r['batch']:.0f} | {walls} ({r['rollout_vs_kernels_wall']:.2f}x) | {cpus} |")
    figures = {}
    for r in results:
        b = int(r["batch"])
        figures[f"host_cpu_ms_per_row_line_b{b}"] = round(r["rollout_host_cpu_ms_per_row_line"], 3)
        figures[f"kernels_host_cpu_ms_per_row_line_b{b}"] = round(r["kernels_host_cpu_ms_per_row_line"], 3)
        figures[f"rollout_vs_kernels_wall_b{b}"] = round(r["rollout_vs_kernels_wall"], 2)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
