"""Held-out evaluation: the first n problems of a split, one episode each (or k), in an ``Env`` (the one door every
rollout goes through: the Trainer's evaluation and ``replrl.evaluate``/``replrl eval`` alike), with the training
code's sampling at the evaluation's temperature (``run.eval_temperature``: the training one by default, 0 greedy).

``evaluate`` returns the figures of ``rollout.summarize`` (accuracy, per-line error rates, lines per episode, how
often a multi-line block was used ...), plus ``accuracy_level<k>`` where the problems have a level (the ``programs``
task) and ``wall_s``. ``eval_config`` builds the config of another held-out task: ``run.eval_task`` (the training
task with some fields changed, e.g. every level), ``run.transfer_task`` (another task, e.g. GSM8K), and
``extra_eval_config`` that of each ``run.extra_eval`` table (another task under its own rollout limits).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sandbox import run_sync

from .config import Config, ExtraEval, TaskConfig
from .rollout import Env, rollout, summarize
from .types import Trajectory

if TYPE_CHECKING:
    from .metrics import EvalWaves

log = logging.getLogger(__name__)


def split_rows(task: Any, split: str, limit: int = 0) -> Any:
    """The rows of a split, the first ``limit`` only when limit > 0 (lists and datasets.Dataset alike)."""
    rows = task.rows(split)
    if limit and len(rows) > limit:
        rows = rows.select(range(limit)) if hasattr(rows, "select") else rows[:limit]
    return rows


def eval_config(cfg: Config, task_fields: dict[str, Any], fresh: bool = False) -> Config:
    """``cfg`` with its [task] changed by ``task_fields``: on top of the training task's fields, or (``fresh``, for
    another task) on top of the defaults, keeping only the training task's seed."""
    base = {"seed": cfg.task.seed} if fresh else dataclasses.asdict(cfg.task)
    return dataclasses.replace(cfg, task=TaskConfig(**{**base, **task_fields}))


def extra_eval_config(cfg: Config, extra: ExtraEval) -> Config:
    """The config of one ``run.extra_eval`` task: its [task] fields on top of the defaults and the training task's
    seed (as ``transfer_task``), the training run's sampling, and the task's own rollout limits (its
    ``rollout_defaults``) overridden by the table's ``rollout``: an extra task is evaluated alike whatever limits the
    run trained under (a run trained on ``programs`` and one trained on ``explore`` see the same ``explore``
    evaluation)."""
    from .tasks.base import task_class

    held = eval_config(cfg, extra.task, fresh=True)
    limits = {**(getattr(task_class(extra.task["name"]), "rollout_defaults", None) or {}), **extra.rollout}
    return dataclasses.replace(held, rollout=dataclasses.replace(cfg.rollout, **limits))


class EvaluationStopped(Exception):
    """``evaluate`` was asked to stop (Ctrl-C in a run): its finished waves are recorded, the rest were not
    sampled; evaluating again with the same waves finishes it."""

    def __init__(self, done: int, total: int):
        super().__init__(f"stopped after {done} of {total} waves")
        self.done, self.total = done, total


def evaluate(env: Env, cfg: Config, n: int, samples_per_problem: int = 1, progress: Any = None,
             episodes: list[Trajectory] | None = None, waves: EvalWaves | None = None,
             stop: Callable[[], bool] | None = None) -> dict[str, float]:
    """Roll out the first ``n`` problems of ``env.task``'s eval split in ``env`` and summarise (accuracy, per-line
    error rates, ...). ``env``: what the episodes run with (``open_env``; ``Trainer.env``: its generator and pool, the
    held-out task, its rules, the reward weights of the current step); ``cfg``: the held-out task's config (its
    split, limit, the evaluation's sampling: ``cfg.rollout``'s at ``run.eval_temperature``).
    ``episodes``: a list the episodes are appended to (the trainer saves them as transcripts).
    ``waves``: where each wave (one rollout of as many episodes as the pool has kernels) is recorded as it ends, and
    where the waves an interrupted evaluation finished are taken from instead of being sampled again; ``wall_s``
    then counts this attempt only.
    ``stop``: asked before each wave is sampled (with ``waves`` only, which keep what is done); when it returns
    True, ``EvaluationStopped`` is raised instead of sampling the rest."""
    t0 = time.perf_counter()
    rows = split_rows(env.task, cfg.task.eval_split, cfg.task.limit)
    chosen = [(i, rows[i]) for i in range(min(n, len(rows)))]
    sampling = dataclasses.replace(cfg.rollout.sampling(seed=cfg.run.seed + 7),
                                   temperature=cfg.run.eval_sampling_temperature(cfg.rollout.temperature))
    trajs: list[Trajectory] = []
    chunk = max(1, env.pool.size // samples_per_problem)
    reused, total = 0, -(-len(chosen) // chunk)
    for start in range(0, len(chosen), chunk):
        wave = chosen[start:start + chunk]
        key = (start, start + len(wave), samples_per_problem, chunk, sampling.seed)
        part = waves.done(key, len(wave) * samples_per_problem) if waves is not None else None
        if part is not None:
            reused += 1
            if progress is not None:
                progress.update(len(part))
        else:
            if waves is not None and stop is not None and stop():
                raise EvaluationStopped(start // chunk, total)
            part, _ = run_sync(rollout(env, wave, sampling, group_size=samples_per_problem, progress=progress))
            if waves is not None:
                waves.add(key, part)
        trajs += part
    if reused:
        log.info("%d of %d waves of this evaluation were sampled before the run was resumed", reused, total)
    out = summarize(trajs)
    out.update(level_accuracy(trajs, {i: row for i, row in chosen}))
    if samples_per_problem > 1:
        out.update(pass_at_k(trajs, samples_per_problem))
    out["wall_s"] = time.perf_counter() - t0
    if episodes is not None:
        episodes += trajs
    return out


def pass_at_k(trajs: list[Trajectory], k: int) -> dict[str, float]:
    """``{"pass@k": share of problems with at least one correct episode}`` over episodes sampled k per problem
    (grouped by ``traj.row``); ``accuracy`` beside it is the mean over all episodes. E.g. two problems, k = 2, one
    with a correct episode: pass@2 = 0.5."""
    solved: dict[int, bool] = {}
    for t in trajs:
        solved[t.row] = solved.get(t.row, False) or bool(t.correct)
    return {f"pass@{k}": sum(solved.values()) / max(len(solved), 1)}


def level_accuracy(trajs: list[Trajectory], rows: dict[int, Any]) -> dict[str, float]:
    """``accuracy_level<k>`` for each level among the episodes' problems (rows with a "level" field), else {}."""
    by_level: dict[Any, list[bool]] = {}
    for t in trajs:
        row = rows.get(t.row)
        level = row.get("level") if hasattr(row, "get") else None
        if level is not None:
            by_level.setdefault(level, []).append(bool(t.correct))
    return {f"accuracy_level{k}": sum(v) / len(v) for k, v in sorted(by_level.items(), key=lambda kv: str(kv[0]))}
