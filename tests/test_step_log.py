"""StepLog: vLLM's per-step statistics turned into the figures bench/backends.py prints (a pure function of the
records; the records are stand-ins with the fields vLLM's SchedulerStats and IterationStats carry)."""

from __future__ import annotations

import math
from types import SimpleNamespace as NS

from replrl.backends.step_log import StepLog


def step(ctx_rows: int, ctx_tokens: int, gen_rows: int, ms: float, graph: str | None = None) -> NS:
    details = NS(num_ctx_requests=ctx_rows, num_ctx_tokens=ctx_tokens, num_generation_requests=gen_rows,
                 num_generation_tokens=gen_rows, elapsed_ms=ms)
    return NS(iteration_details=details, num_running_reqs=gen_rows + ctx_rows, num_waiting_reqs=0,
              cudagraph_stats=NS(runtime_mode=graph) if graph else None)


def test_summary_splits_decode_mixed_and_prefill_steps():
    log = StepLog()
    # t (s):       0.000        0.010                     0.025                0.040
    records = [step(0, 0, 4, 8.0, "FULL"), step(2, 80, 3, 12.0, "PIECEWISE"), step(1, 40, 0, 6.0), step(0, 0, 4, 8.0)]
    for t, r in zip((0.0, 0.010, 0.025, 0.040), records):
        log.record(r, now=t)
    s = log.summary()
    assert s["steps"] == 4
    assert s["mixed_share"] == 0.25 and s["prefill_only_share"] == 0.25
    assert s["decode_step_ms"] == 8.0 and s["mixed_step_ms"] == 12.0 and s["prefill_step_ms"] == 6.0
    # intervals 10, 15, 15 ms -> 13.33; the engine's own time of steps 2-4: (12 + 6 + 8) / 3 = 8.67 -> 4.67 outside
    assert s["interval_ms"] == 13.33 and s["outside_engine_ms"] == 4.67
    assert s["gen_rows_per_step"] == 2.8  # (4 + 3 + 0 + 4) / 4 = 2.75, rounded to one decimal
    assert s["ctx_tokens_per_step"] == 30.0
    assert s["graph_modes"] == {"FULL": 1, "PIECEWISE": 1, "unreported": 2}
    assert log.summary(since=3)["steps"] == 1 and log.summary(since=4) == {"steps": 0}


def test_a_vllm_without_step_details_is_read_from_the_front_ends_iteration_stats():
    log = StepLog()
    old = NS(num_running_reqs=3, num_waiting_reqs=1)  # vLLM 0.26: no iteration_details
    it = NS(time_to_first_tokens_iter=[0.1], num_prompt_tokens=50, inter_token_latencies_iter=[0.01, 0.01],
            num_generation_tokens=3)
    log.record(old, it, now=1.0)
    log.record(old, None, now=1.1)  # nothing to read: no step recorded
    assert log.steps == [(1.0, 1, 50, 2, 3, log.steps[0][5], 3, 1, "")] and math.isnan(log.steps[0][5])
    assert log.summary()["mixed_share"] == 1.0
