"""Per-line reward terms and the final-answer reward.

A line term is a plain function ``(line, trajectory) -> float`` registered by name; its value is multiplied by the
term's weight from the config and stored on the line under that name (``line.rewards["syntax_error"] == -0.3``), so
every term can be logged and ablated separately. ``trajectory.lines`` holds the lines before this one.

    @line_reward("prints_something")
    def prints_something(line, traj):
        return 1.0 if line.output else 0.0

A term can also be given in the config by import path (``"my_pkg.rewards:prints_something"``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

from .types import Line, Trajectory

LineReward = Callable[[Line, Trajectory], float]
LINE_REWARDS: dict[str, LineReward] = {}
OUTCOME_TERMS = ("correct", "wrong", "no_submit")
SYNTAX_ERRORS = ("SyntaxError", "IndentationError", "TabError")


def line_reward(name: str) -> Callable[[LineReward], LineReward]:
    """Register a per-line reward term under ``name``."""

    def register(fn: LineReward) -> LineReward:
        LINE_REWARDS[name] = fn
        return fn

    return register


@line_reward("syntax_error")
def syntax_error(line: Line, traj: Trajectory) -> float:
    return float(line.status == "error" and line.error_name in SYNTAX_ERRORS)


@line_reward("exception")
def exception(line: Line, traj: Trajectory) -> float:
    return float(line.status == "error" and line.error_name not in SYNTAX_ERRORS)


@line_reward("timeout")
def timeout(line: Line, traj: Trajectory) -> float:
    return float(line.status == "timeout")


@line_reward("crash")
def crash(line: Line, traj: Trajectory) -> float:
    return float(line.status == "crashed")


@line_reward("repeat_line")
def repeat_line(line: Line, traj: Trajectory) -> float:
    """The model typed exactly the previous line again (blank lines excepted)."""
    return float(bool(line.code.strip()) and bool(traj.lines) and traj.lines[-1].code == line.code)


def resolve(name: str) -> LineReward:
    """A registered term, or a function given as ``module:attr``."""
    if name in LINE_REWARDS:
        return LINE_REWARDS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"reward term {name!r} cannot be imported: {err}") from None
        if not callable(fn):
            raise ValueError(f"reward term {name!r} is not callable")
        return fn
    known = ", ".join(sorted(LINE_REWARDS) + list(OUTCOME_TERMS))
    raise ValueError(f"unknown reward term {name!r}: known terms are {known}, or give an import path module:attr")


class RewardModel:
    """Scores lines and outcomes with the weights of a config (``{term: weight}``; weight 0 switches a term off)."""

    def __init__(self, weights: Mapping[str, float]):
        self.line_terms = {name: (resolve(name), float(w)) for name, w in weights.items()
                           if name not in OUTCOME_TERMS and w != 0}
        self.outcome_weights = {name: float(weights.get(name, 0.0)) for name in OUTCOME_TERMS}

    def score_line(self, line: Line, traj: Trajectory) -> dict[str, float]:
        if line.status == "incomplete":
            return {}
        return {name: w * float(fn(line, traj)) for name, (fn, w) in self.line_terms.items()}

    def score_outcome(self, submitted: bool, correct: bool | None) -> dict[str, float]:
        term = "no_submit" if not submitted else ("correct" if correct else "wrong")
        return {term: self.outcome_weights[term]}
