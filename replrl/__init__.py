"""replrl: reinforcement learning for language models that reason inside a live Python REPL.

The Python API (what the ``replrl`` command does, for notebooks and scripts; each name is imported on first use, so
``import replrl`` stays fast):

    cfg = replrl.load_config("examples/smoke.toml", run={"max_steps": 5})   # or replrl.Config(model=...)
    curve = replrl.LiveCurve()                                 # learning curves redrawn after every step
    trainer = replrl.train(cfg, "runs/nb", on_step=curve)      # -> Trainer; metrics.jsonl, checkpoints in runs/nb
    replrl.evaluate(trainer, n=20)                             # held-out accuracy, per-line error rates
    trajs = replrl.sample_episodes(trainer, n=8)               # scored episodes without training
    replrl.show(trajs)                                         # transcripts as HTML, coloured by who wrote them
    replrl.save_jsonl(trajs, "r.jsonl"); replrl.load_jsonl("r.jsonl")
    replrl.plot_run("runs/nb")                                 # the run's curves as a PNG
    replrl.sweep("examples/sweep_smoke.toml", "runs/sw", parallel=2)   # variants x seeds, each its own process
    fig, table = replrl.compare("runs/sw", out="runs/sw/compare")       # curves with 95% bands, a table with CIs
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "config": ["Config", "ModelConfig", "TaskConfig", "RolloutConfig", "RewardConfig", "AdvantageConfig",
               "LossConfig", "OptimConfig", "RunConfig"],
    "configlib": ["ConfigError"],
    "api": ["load_config", "train", "evaluate", "sample_episodes"],
    "trainer": ["Trainer", "StepResult"],
    "types": ["Trajectory", "Line"],
    "rollout": ["summarize"],
    "viewer": ["show", "load_jsonl", "save_jsonl", "LiveCurve", "trajectory_html"],
    "plot": ["plot_run"],
    "metrics": ["read_metrics"],
    "sweep": ["sweep"],
    "compare": ["compare"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = [  # the names of _EXPORTS, spelled out for linters and editors
    "AdvantageConfig", "Config", "ConfigError", "Line", "LiveCurve", "LossConfig", "ModelConfig", "OptimConfig",
    "RewardConfig", "RolloutConfig", "RunConfig", "StepResult", "TaskConfig", "Trainer", "Trajectory", "compare",
    "evaluate", "load_config", "load_jsonl", "plot_run", "read_metrics", "sample_episodes", "save_jsonl", "show",
    "summarize", "sweep", "train", "trajectory_html",
]
# Imported now, not on first use: these functions share their module's name, and a lazy export would be shadowed by
# the module itself once anything imports replrl.sweep or replrl.compare (both are light: no torch, no pandas).
from .compare import compare  # noqa: E402
from .sweep import sweep  # noqa: E402

if TYPE_CHECKING:
    from .api import evaluate, load_config, sample_episodes, train
    from .config import (
        AdvantageConfig,
        Config,
        LossConfig,
        ModelConfig,
        OptimConfig,
        RewardConfig,
        RolloutConfig,
        RunConfig,
        TaskConfig,
    )
    from .configlib import ConfigError
    from .metrics import read_metrics
    from .plot import plot_run
    from .rollout import summarize
    from .trainer import StepResult, Trainer
    from .types import Line, Trajectory
    from .viewer import LiveCurve, load_jsonl, save_jsonl, show, trajectory_html


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'replrl' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
