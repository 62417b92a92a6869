"""Episode-level reward functions (rewards.functions): the same registry and weights as line terms, the arguments a
function declares, None to skip, async ones, and a real run that logs them as reward/<name>."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from replrl.config import Config
from replrl.configlib import ConfigError, resolve
from replrl.metrics import read_metrics
from replrl.rewards import RewardModel
from replrl.types import Line, Trajectory

REPO = Path(__file__).resolve().parents[1]


def episode(correct: bool | None, answer: object = None, lines: int = 1, row: int = 0) -> Trajectory:
    traj = Trajectory(token_ids=[1], loss_mask=[0], logprobs=[0.0], prompt_len=1, text="", row=row,
                      lines=[Line(code="x") for _ in range(lines)], answer=answer, submitted=correct is not None,
                      correct=correct)
    RewardModel(Config().rewards.weights).finish(traj, traj.submitted)  # the outcome terms, as a rollout does
    return traj


def brevity(traj, correct):
    return 1.0 / len(traj.lines) if correct else None


async def judge(row, answer):
    await asyncio.sleep(0)
    return 1.0 if str(answer) == str(row["answer"]) else -1.0


def test_functions_get_the_arguments_they_declare_are_weighted_and_none_skips():
    model = RewardModel({**Config().rewards.weights, "brevity": 0.5}, functions=[brevity, judge])
    assert model.weights()["brevity"] == 0.5 and model.weights()["judge"] == 1.0  # default weight 1
    assert model.describe().endswith("brevity=0.5 (fn) judge=1 (fn)")
    right, long_right, wrong = episode(True, 7, lines=1, row=0), episode(True, 7, lines=4, row=0), episode(False, 3)
    nothing = episode(None, row=1)
    model.score_episodes_sync([right, long_right, wrong, nothing], [(0, {"answer": 7}), (1, {"answer": 2})])
    # brevity: 0.5 * 1/1 and 0.5 * 1/4 on the correct ones, None (no key) on the others; judge: +-1 by the row
    assert right.outcome_rewards == {"correct": 1.0, "brevity": 0.5, "judge": 1.0}
    assert long_right.outcome_rewards == {"correct": 1.0, "brevity": 0.125, "judge": 1.0}
    assert wrong.outcome_rewards == {"wrong": 0.0, "judge": -1.0}
    assert nothing.outcome_rewards == {"no_submit": -0.2, "judge": -1.0}
    assert nothing.reward == pytest.approx(-1.2)  # the total counts them: they are outcome terms


def test_a_weight_of_0_switches_a_function_off_and_a_schedule_applies():
    off = RewardModel({"brevity": 0}, functions=[brevity])
    traj = episode(True)
    off.score_episodes_sync([traj], [(0, {})])
    assert traj.outcome_rewards == {"correct": 1.0, "brevity": 0.0}
    ramp = RewardModel({"brevity": {"start": 0.0, "end": 1.0, "steps": 4}}, functions=[brevity]).at(2)
    traj = episode(True)
    ramp.score_episodes_sync([traj], [(0, {})])
    assert traj.outcome_rewards["brevity"] == 0.5 and ramp.scheduled_weights() == {"weight/brevity": 0.5}


def test_bad_functions_are_one_line_errors(tmp_path, monkeypatch):
    def needs_prompt(prompts, completions):
        return 0.0

    def says_yes(traj):
        return "yes"

    with pytest.raises(ConfigError, match="^reward function 'needs_prompt' declares 'prompts': it may declare only "
                                          "row, traj, answer, correct"):
        RewardModel({}, functions=[needs_prompt])
    with pytest.raises(ConfigError, match="like another term"):
        RewardModel({}, functions=[brevity, brevity])
    traj = episode(True)
    with pytest.raises(ValueError, match=r"^reward function 'says_yes' must return a float or None; got 'yes'$"):
        RewardModel({}, functions=[says_yes]).score_episodes_sync([traj], [(0, {})])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="cannot be imported"):  # looked up when a run starts (Trainer, open_env)
        RewardModel.from_config(resolve(Config, None, {"rewards": {"functions": '["no_such_module:f"]'}}).rewards)
    with pytest.raises(ConfigError, match="must be an import path module:function"):
        RewardModel.from_config(resolve(Config, None, {"rewards": {"functions": '["brevity"]'}}).rewards)


def test_functions_by_import_path_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "cwd_rewards.py").write_text("def one(correct):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    cfg = resolve(Config, None, {"rewards": {"functions": '["cwd_rewards:one"]', "weights": '{"one": 2}'}})
    model = RewardModel.from_config(cfg.rewards)
    traj = episode(False)
    model.score_episodes_sync([traj], [(0, {})])
    assert traj.outcome_rewards == {"wrong": 0.0, "one": 2.0}
    assert cfg.rewards.weights["correct"] == 1.0  # the weights table merged with the defaults


REWARDS = '''
import asyncio

def short(traj, correct):
    return 1.0 if correct and len(traj.lines) == 1 else None

async def judge(row, answer):
    await asyncio.sleep(0)
    return 1.0 if str(answer) == str(row["answer"]) else 0.0
'''


def test_a_run_on_a_jsonl_with_reward_functions_from_one_config_file(format_model_dir, tmp_path):
    """What issue 49 asks: a JSONL of problems, a reward function, one config file, no Python class; held-out
    results greedy with two samples per problem (pass@2), printed as they come."""
    rows = [{"question": f"Submit {k % 4}.", "answer": k % 4, "hint": [k % 4]} for k in range(12)]
    (tmp_path / "problems.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    (tmp_path / "run.toml").write_text(textwrap.dedent(f"""
        [model]
        name = "{format_model_dir}"
        chat_template = false
        [task]
        name = "dataset"
        data = "problems.jsonl"
        columns = {{data = "hint"}}
        train_split = "train[4:]"
        eval_split = "train[:4]"
        options = {{header_template = "{{question}}"}}
        [rollout]
        group_size = 2
        problems_per_step = 2
        max_lines = 2
        max_line_tokens = 12
        max_total_tokens = 256
        wall_s = 2.0
        temperature = 1.0
        [rewards]
        functions = ["my_rewards:short", "my_rewards:judge"]
        [rewards.weights]
        short = 0.5
        [optim]
        micro_batch = 8
        [run]
        max_steps = 1
        eval_n = 2
        eval_samples = 2
        eval_temperature = 0
        log_samples_every = 0
    """))
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's replrl, run from the run's own directory
    command = [sys.executable, "-m", "replrl.cli", "train", "run.toml", "--run-dir", "run", "--no-progress"]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reward weights: correct=1 wrong=0 no_submit=-0.2 syntax_error=-0.3" in proc.stdout
    assert "short=0.5 (fn) judge=1 (fn)" in proc.stdout
    assert "eval at step 0: accuracy" in proc.stderr and "pass@2" in proc.stderr, proc.stderr[-2000:]
    metrics = read_metrics(tmp_path / "run")
    step = next(r for r in metrics if "reward_mean" in r)
    assert "reward/judge" in step and 0.0 <= step["reward/judge"] <= 1.0
    evals = [r for r in metrics if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1] and all("eval/pass@2" in r for r in evals)
    assert all(r["eval/episodes"] == 4 for r in evals)  # 2 problems x 2 samples
    episodes = [json.loads(line) for line in (tmp_path / "run" / "eval_samples.jsonl").read_text().splitlines()]
    greedy = {}
    for e in episodes:  # greedy: the two samples of a problem are the same episode
        greedy.setdefault((e["step"], e["row"]), set()).add(e["text"])
        assert e["sampling"]["temperature"] == 1e-6
    assert all(len(texts) == 1 for texts in greedy.values())
    judged = [e for e in episodes if "judge" in e["outcome_rewards"]]
    assert len(judged) == len(episodes) and all(e["outcome_rewards"]["judge"] == float(bool(e["correct"]))
                                                for e in judged)
