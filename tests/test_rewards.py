"""Per-line reward terms: each built-in term, weights, user terms by name and by import path."""

from __future__ import annotations

import pytest

from replrl.rewards import LINE_REWARDS, RewardModel, line_reward, resolve
from replrl.types import Line, Trajectory

WEIGHTS = {"correct": 1.0, "wrong": 0.0, "no_submit": -0.2, "syntax_error": -0.3, "exception": -0.1,
           "timeout": -0.2, "crash": -0.5, "repeat_line": -0.1}


def traj(*lines: Line) -> Trajectory:
    return Trajectory(token_ids=[], loss_mask=[], logprobs=[], prompt_len=0, text="", lines=list(lines))


@pytest.mark.parametrize("line, expected", [
    (Line("x = = 1", status="error", error_name="SyntaxError"), {"syntax_error": -0.3}),
    (Line("  y = 1", status="error", error_name="IndentationError"), {"syntax_error": -0.3}),
    (Line("1/0", status="error", error_name="ZeroDivisionError"), {"exception": -0.1}),
    (Line("while 1: pass", status="timeout", error_name="KeyboardInterrupt"), {"timeout": -0.2}),
    (Line("import os; os._exit(1)", status="crashed"), {"crash": -0.5}),
    (Line("x = 1", status="ok"), {}),
])
def test_each_term_fires_on_its_line(line, expected):
    scores = RewardModel(WEIGHTS).score_line(line, traj())
    assert {k: v for k, v in scores.items() if v} == expected
    assert set(scores) == {"syntax_error", "exception", "timeout", "crash", "repeat_line"}  # all terms kept by name


def test_repeat_line_only_for_an_identical_non_blank_previous_line():
    model = RewardModel(WEIGHTS)
    assert model.score_line(Line("x = 1"), traj(Line("x = 1")))["repeat_line"] == -0.1
    assert model.score_line(Line("x = 2"), traj(Line("x = 1")))["repeat_line"] == 0.0
    assert model.score_line(Line(""), traj(Line("")))["repeat_line"] == 0.0


def test_incomplete_lines_carry_no_reward_and_zero_weight_terms_are_off():
    assert RewardModel(WEIGHTS).score_line(Line("for i in x:", status="incomplete"), traj()) == {}
    assert "crash" not in RewardModel({**WEIGHTS, "crash": 0.0}).score_line(Line("x"), traj())


def test_outcome_terms():
    model = RewardModel(WEIGHTS)
    assert model.score_outcome(True, True) == {"correct": 1.0}
    assert model.score_outcome(True, False) == {"wrong": 0.0}
    assert model.score_outcome(False, None) == {"no_submit": -0.2}


def prints_something(line: Line, trajectory: Trajectory) -> float:
    return 1.0 if line.output else 0.0


def test_user_terms_by_registration_and_import_path():
    @line_reward("short_line")
    def short_line(line, trajectory):
        return float(len(line.code) < 10)

    try:
        scores = RewardModel({"short_line": 0.5, "tests.test_rewards:prints_something": 2.0}).score_line(
            Line("x", output="1\n"), traj())
        assert scores == {"short_line": 0.5, "prints_something": 2.0}  # logged under the attribute's name
    finally:
        LINE_REWARDS.pop("short_line")


def test_unknown_term_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown reward term 'syntax_eror'"):
        resolve("syntax_eror")
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve("no_such_module_xyz:fn")
