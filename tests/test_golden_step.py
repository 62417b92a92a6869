"""Acceptance for moving code: a seeded training step on the tiny format model gives the same episodes and figures
as the step recorded in ``tests/data/golden_step.json`` (issue 55: recorded before the first move of the rollout
wing, compared after each).

Three steps, hf backend, real kernels: flat groups; tree groups (``tree.branch_at``; the format model submits at its
first line, so each tree is its roots, and the step goes through the tree rollout and the tree estimator); dynamic
sampling with probes (screening waves, then the probes with a contrast completed). For every episode trained on:
token ids, loss mask, the sampler's log-probs, each line (code, output, status, reward terms), the outcome terms,
group and row; and every metric of the step that is not a wall time.

The file is of one environment: token ids are exact, floats are compared to 1e-5 (relative; thread counts may reorder
a sum). Under other torch/transformers versions the test skips, naming them; write the file again there with
``REPLRL_WRITE_GOLDEN=1`` on a commit whose behaviour is the reference.
"""

from __future__ import annotations

import json
import os
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from replrl.config import Config
from replrl.configlib import resolve
from replrl.trainer import StepResult, Trainer

GOLDEN = Path(__file__).resolve().parent / "data" / "golden_step.json"
WRITE = os.environ.get("REPLRL_WRITE_GOLDEN") == "1"
pytestmark = pytest.mark.timeout(600)

CASES: dict[str, dict[str, Any]] = {
    "flat": {},
    "tree": {"tree": {"roots": 2, "branch_at": [1], "width": 2}, "advantages": {"estimator": "tree"}},
    "dynamic_sampling_probes": {"task": {"options": {"digits": [1, 7]}},
                                "rollout": {"dynamic_sampling": True, "dynamic_sampling_extra_waves": 4,
                                            "dynamic_sampling_probe": 2}},
}
"""Each case's sections over the base config below (``task.options.digits`` (1, 7): some groups without a contrast)."""

TIME_KEYS = ("_s", "_ms", "tokens_per_s", "_ms_mean", "_ms_max", "_ms_per_line", "slow_digest_frac")
"""Metric names ending so are wall times (or rates over them): not compared."""
TIME_PREFIXES = ("time/", "pool/", "gen_", "mem/")


def config(model_dir: Path, case: dict[str, Any]) -> Config:
    sections: dict[str, dict[str, Any]] = {
        "model": {"name": str(model_dir), "chat_template": False},
        "task": {"name": "tests.toy:EchoTask"},
        "rollout": {"group_size": 4, "problems_per_step": 2, "max_lines": 3, "max_line_tokens": 12,
                    "max_total_tokens": 256, "wall_s": 2.0, "temperature": 1.0},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "micro_batch": 8},
        "run": {"max_steps": 1, "save_every": 0, "log_samples_every": 0, "eval_n": 0, "time_budget_min": 0},
    }
    for section, fields in case.items():
        sections[section] = {**sections.get(section, {}), **fields}
    return resolve(Config, None, sections)


def versions() -> dict[str, str]:
    return {name: version(name) for name in ("torch", "transformers")}


def record(result: StepResult) -> dict[str, Any]:
    """What the step gave, as JSON: its episodes and its figures (wall times left out)."""
    episodes = [{
        "token_ids": t.token_ids, "loss_mask": t.loss_mask, "logprobs": t.logprobs, "prompt_len": t.prompt_len,
        "group": t.group, "row": t.row, "end_reason": t.end_reason, "correct": t.correct,
        "outcome_rewards": t.outcome_rewards, "tree_nodes": t.tree_nodes, "tree_cuts": t.tree_cuts,
        "lines": [{"code": ln.code, "output": ln.output, "status": ln.status, "token_span": list(ln.token_span),
                   "rewards": ln.rewards} for ln in t.lines],
    } for t in result.trajectories]
    metrics = {k: v for k, v in sorted(result.metrics.items())
               if not k.endswith(TIME_KEYS) and not k.startswith(TIME_PREFIXES)}
    return {"step": result.step, "metrics": metrics, "episodes": episodes}


def run_case(model_dir: Path, run_dir: Path, case: dict[str, Any]) -> dict[str, Any]:
    results: list[StepResult] = []
    Trainer(config(model_dir, case), run_dir, progress=False).train(on_step=results.append)
    (result,) = results
    return json.loads(json.dumps(record(result)))  # tuples as lists, as the file has them


def assert_same(got: Any, want: Any, where: str) -> None:
    """Exact for ints, strings and structure; floats to a relative 1e-5."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        if want and all(isinstance(x, int) and not isinstance(x, bool) for x in want):
            assert got == want, f"{where}: {got} != {want}"
            return
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{k}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), f"{where}: {got} != {want}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    if WRITE:
        return {"versions": versions(), "cases": {}}
    if not GOLDEN.exists():
        pytest.fail(f"{GOLDEN} is missing: write it with REPLRL_WRITE_GOLDEN=1 on the reference commit")
    data = json.loads(GOLDEN.read_text())
    if data["versions"] != versions():
        pytest.skip(f"golden step recorded under {data['versions']}, this is {versions()}: write it again with "
                    "REPLRL_WRITE_GOLDEN=1 on the reference commit")
    return data


@pytest.mark.parametrize("name", list(CASES))
def test_a_seeded_step_is_the_recorded_one(name, golden, format_model_dir, tmp_path):
    got = run_case(format_model_dir, tmp_path / "run", CASES[name])
    if WRITE:
        golden["cases"][name] = got
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(golden, indent=None, separators=(",", ":")) + "\n")
        return
    assert_same(got, golden["cases"][name], name)
