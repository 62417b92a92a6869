"""Reward-term weights over training steps, and per-term gates: how one ``rewards.weights`` entry is read.

A weight is a number (constant) or a table::

    [rewards.weights]
    correct = 1.0
    syntax_error = {start = -0.3, end = 0.0, steps = 50}                 # linear (the default shape) over 50 steps
    exception = {start = -0.1, end = 0.0, steps = 50, shape = "cosine"}
    timeout = {start = 0.0, end = -0.2, at = 20, shape = "step"}         # 0 before step 20, -0.2 from step 20 on
    repeat_line = {value = -0.1, gate = "wrong"}                         # constant, only on wrong episodes

``step`` is the number of optimizer steps done before the rollout being scored (0 for the first step); a linear or
cosine schedule holds ``end`` from ``steps`` on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .configlib import ConfigError

SHAPES = ("constant", "linear", "cosine", "step")
GATES = ("always", "correct", "wrong")
"""always: every episode; correct: only episodes whose submitted answer is correct; wrong: only the others (a wrong
answer or no submission)."""
KEYS = ("value", "start", "end", "steps", "shape", "at", "gate")
NEEDS = {"constant": ("value",), "linear": ("start", "end", "steps"), "cosine": ("start", "end", "steps"),
         "step": ("start", "end", "at")}


@dataclass(frozen=True)
class Schedule:
    """A weight as a function of the training step."""

    start: float
    end: float | None = None
    """None: constant ``start``."""
    shape: str = "constant"
    steps: int = 0
    """linear / cosine: steps from ``start`` to ``end``."""
    at: int = 0
    """step: the first step with ``end``."""

    def __call__(self, step: int) -> float:
        if self.shape == "constant" or self.end is None:
            return self.start
        if self.shape == "step":
            return self.start if step < self.at else self.end
        frac = min(max(step, 0) / self.steps, 1.0)
        if self.shape == "cosine":
            frac = 0.5 * (1 - math.cos(math.pi * frac))
        return self.start + (self.end - self.start) * frac

    @property
    def constant(self) -> bool:
        return self.shape == "constant" or self.start == self.end

    @property
    def always_zero(self) -> bool:
        return self.start == 0 and (self.end is None or self.end == 0)


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} must be a number; got {value!r}")
    return float(value)


def parse_weight(name: str, value: Any) -> tuple[Schedule, str | None]:
    """``rewards.weights.<name>`` as a schedule and the gate its table names (None when it names none)."""
    where = f"rewards.weights.{name}"
    if not isinstance(value, Mapping):
        return Schedule(_number(where, value)), None
    unknown = [k for k in value if k not in KEYS]
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; a weight table takes {', '.join(KEYS)}")
    shape = value.get("shape", "constant" if "value" in value else "step" if "at" in value else "linear")
    if shape not in SHAPES:
        raise ConfigError(f"{where}.shape must be one of {', '.join(SHAPES)}; got {shape!r}")
    needed = NEEDS[shape]
    missing = [k for k in needed if k not in value]
    if missing:
        raise ConfigError(f"{where}: a {shape} schedule needs {', '.join(needed)} (missing {', '.join(missing)})")
    extra = [k for k in value if k not in needed and k not in ("shape", "gate")]
    if extra:
        raise ConfigError(f"{where}: {extra[0]!r} does not apply to a {shape} schedule (it takes {', '.join(needed)})")
    gate = value.get("gate")
    if gate is not None:
        check_gate(f"{where}.gate", gate)
    if shape == "constant":
        return Schedule(_number(f"{where}.value", value["value"])), gate
    start, end = _number(f"{where}.start", value["start"]), _number(f"{where}.end", value["end"])
    if shape == "step":
        at = value["at"]
        if isinstance(at, bool) or not isinstance(at, int) or at < 0:
            raise ConfigError(f"{where}.at must be an integer step >= 0; got {at!r}")
        return Schedule(start, end, shape, at=at), gate
    steps = value["steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"{where}.steps must be an integer >= 1; got {steps!r}")
    return Schedule(start, end, shape, steps=steps), gate


def check_gate(where: str, gate: Any) -> str:
    if gate not in GATES:
        raise ConfigError(f"{where} must be one of {', '.join(GATES)}; got {gate!r}")
    return gate
