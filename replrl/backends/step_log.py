"""vLLM's per-step statistics, as replrl's benches read them (no vLLM import here: the figures are plain data)."""

from __future__ import annotations

import time
from typing import Any


class StepLog:
    """vLLM's own statistics of every engine step, kept only when asked (``VLLMGenerator(step_stats=True)``: vLLM
    then collects its per-step statistics, which it does not otherwise). Recorded in the front end as each step's
    outputs arrive: when (``time.perf_counter``), the step's prefill rows and tokens (new requests and resumed lines'
    input chunks) against its decoding rows and tokens, the engine core's own time for the step, the running and
    waiting requests, and the CUDA-graph mode where the vLLM version reports it (vLLM 0.32 with
    ``cudagraph_metrics``). ``summary(since)`` turns the steps after ``since`` into figures."""

    FIELDS = ("t", "ctx_rows", "ctx_tokens", "gen_rows", "gen_tokens", "engine_ms", "running", "waiting", "graph")

    def __init__(self) -> None:
        self.steps: list[tuple] = []

    def record(self, stats: Any, iteration: Any = None, now: float | None = None) -> None:
        """One step: vLLM's SchedulerStats (with ``iteration_details`` from vLLM 0.32) and IterationStats."""
        details = getattr(stats, "iteration_details", None)
        now = time.perf_counter() if now is None else now
        if details is None:  # a vLLM without per-step details (0.26): what the front end saw of the step
            if iteration is None or stats is None:
                return
            firsts = len(iteration.time_to_first_tokens_iter)
            self.steps.append((now, firsts, iteration.num_prompt_tokens,
                               len(iteration.inter_token_latencies_iter), iteration.num_generation_tokens,
                               float("nan"), stats.num_running_reqs, stats.num_waiting_reqs, ""))
            return
        graph = getattr(stats, "cudagraph_stats", None)
        self.steps.append((now, details.num_ctx_requests, details.num_ctx_tokens,
                           details.num_generation_requests, details.num_generation_tokens, details.elapsed_ms,
                           stats.num_running_reqs, stats.num_waiting_reqs,
                           str(getattr(graph, "runtime_mode", "")) if graph is not None else ""))

    def summary(self, since: int = 0) -> dict[str, Any]:
        """Figures of steps ``since`` onwards: how many; the share that carried prefill (a resumed line's input
        or a new request) beside decoding rows ("mixed"); the engine core's mean time per decode-only, mixed and
        prefill-only step; the mean interval between steps as the front end receives them, and how much of it
        is not the engine core's step (scheduling, the engine process's own work, the trip to the front end); the
        decoding rows per step; steps per CUDA-graph mode."""
        steps = self.steps[since:]
        if not steps:
            return {"steps": 0}
        kinds: dict[str, list[float]] = {"decode": [], "mixed": [], "prefill": []}
        for _, ctx, _, gen, _, ms, *_ in steps:
            kinds["mixed" if ctx and gen else "prefill" if ctx else "decode"].append(ms)
        gaps = [b[0] - a[0] for a, b in zip(steps, steps[1:])]
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        interval_ms = 1000 * mean(gaps)
        graphs: dict[str, int] = {}
        for step in steps:
            graphs[step[8] or "unreported"] = graphs.get(step[8] or "unreported", 0) + 1
        return {"steps": len(steps), "mixed_share": round(len(kinds["mixed"]) / len(steps), 3),
                "prefill_only_share": round(len(kinds["prefill"]) / len(steps), 3),
                **{f"{k}_step_ms": round(mean(v), 2) for k, v in kinds.items()},
                "interval_ms": round(interval_ms, 2),
                "outside_engine_ms": round(interval_ms - mean([s[5] for s in steps[1:]]), 2),
                "gen_rows_per_step": round(mean([s[3] for s in steps]), 1),
                "ctx_tokens_per_step": round(mean([s[2] for s in steps]), 1), "graph_modes": graphs}
