"""The rollout side of a training step, one owner (``Drawer``): its Env (opened by ``open_env``: the kernel pool of
this rank's share, the Trainer's generator, task and reward model), the problem stream, and stages 1-2 of each step:
the problems, this rank's share of them, the group rollouts (flat or trees), dynamic sampling's waves and its
probes' completion.

A draw runs no collective: every rank draws the same problems and keeps its share (a GRPO group never spans ranks),
and decides on its own share alone, so a draw never waits for another rank (a producer that runs ahead of the
learner could not deadlock with the learner's collectives). ``Drawer.draw`` returns a ``Drawn``: this rank's
episodes to train on, its groups, its rollout statistics, what its waves found, the stream's position, and the
policy version the episodes were sampled with. The learner (the Trainer) agrees over the ranks once per step:
it gathers every rank's ``Drawn.summary()`` in one collective and ``agree`` merges them (every rank's groups for the
step's figures, the ``tree/`` and ``dynsamp/`` figures over all ranks, the furthest position of the stream).

Dynamic sampling under several ranks: each rank draws waves of its share until it holds its share of the groups
with a contrast (``problems_per_step`` dealt round-robin: rank r holds ``len(range(r, problems_per_step, world))``)
or the bound is spent, whatever the other ranks found; the agreement then moves every rank's stream to the furthest
rank's position (a rank that stopped earlier leaves its share of the later waves' problems undrawn).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sandbox import run_sync

from .backends.base import Generator
from .configlib import ConfigError
from .dynamic_sampling import WaveRecord, group_has_contrast, screening_wave, select_groups, wave_metrics
from .rewards import RewardModel
from .rollout import (
    Env,
    RolloutStats,
    TreeShape,
    merge_tree_figures,
    merge_wave_stats,
    open_env,
    rollout,
    split_by_group,
)
from .tasks.base import Task
from .types import SamplingParams, Trajectory

log = logging.getLogger(__name__)


class ProblemStream:
    """Training problems in a seeded order, reshuffled every pass; ``position`` is all the state there is."""

    def __init__(self, rows: Any, seed: int, position: int = 0):
        self.rows, self.seed, self.position = rows, seed, position
        if len(rows) == 0:
            raise ConfigError("the training split has no problems")

    def take(self, n: int) -> list[tuple[int, dict]]:
        out = []
        for _ in range(n):
            epoch, k = divmod(self.position, len(self.rows))
            order = list(range(len(self.rows)))
            random.Random(self.seed * 100003 + epoch).shuffle(order)
            out.append((order[k], self.rows[order[k]]))
            self.position += 1
        return out


@dataclass
class Waves:
    """What dynamic sampling's waves found on one rank (or, merged by ``agree``, on every rank)."""

    records: list[WaveRecord]
    """Each wave's groups: contrast flags, wall time, episodes."""
    kept: list[int]
    """Indices (over the waves' groups, in order) of the groups trained on."""
    bound_reached: bool
    """The bound (``dynamic_sampling_extra_waves``) was spent before enough groups had a contrast."""
    completion: dict[int, int] | None = None
    """Screening (a probe): episodes added to each completed group, by group index; None without a probe."""
    completion_s: float = 0.0


@dataclass
class Drawn:
    """A step's groups on this rank, as ``Drawer.draw`` returns them (``agree``: as the learner sees them)."""

    mine: list[Trajectory]
    """This rank's episodes to train on, whole groups, group ids local to this rank."""
    groups: list[list[Trajectory]]
    """Every group this rank drew this step, in the order drawn (after ``agree``: every rank's, in rank order; the
    step's figures are over them)."""
    stats: RolloutStats
    """This rank's rollout statistics (over the waves; after ``agree`` the ``tree/`` figures over every rank's)."""
    policy_version: int
    """The generator's ``version`` the episodes were sampled with (``Trajectory.policy_step``)."""
    position: int
    """The problem stream's position after the draw (after ``agree``: the furthest rank's)."""
    waves: Waves | None = None
    """What dynamic sampling's waves found (None without it)."""
    figures: dict[str, float] = field(default_factory=dict)
    """``dynsamp/`` figures over every rank, set by ``agree`` (empty without dynamic sampling)."""

    def summary(self) -> tuple[list[list[Trajectory]], dict[str, float], int, Waves | None, int]:
        """What the learner gathers from each rank once per step: the groups, the ``tree/`` figures and leaves, the
        waves, the position."""
        own = {k: v for k, v in self.stats.extra.items() if k.startswith("tree/")}
        return self.groups, own, int(own.get("tree/leaves", 0)), self.waves, self.position


def agree(drawn: Drawn, every: Sequence[tuple[list[list[Trajectory]], dict[str, float], int, Waves | None, int]],
          group_size: int) -> Drawn:
    """``drawn`` (this rank's) as the learner sees it once ``every`` rank's ``summary()`` is gathered (in rank
    order; this rank's alone with one process): every rank's groups, the ``tree/`` figures over every rank's trees,
    the ``dynsamp/`` figures over every rank's waves, the furthest position of the stream."""
    stats = drawn.stats
    if len(every) > 1 and any(part[1] for part in every):  # the tree/ figures of every rank's trees
        stats = replace(stats, extra={**stats.extra, **merge_tree_figures([(own, n) for _, own, n, _, _ in every])})
    waves = merge_waves([part[3] for part in every if part[3] is not None]) if drawn.waves is not None else None
    figures = {} if waves is None else wave_metrics(waves.records, waves.kept, group_size, waves.bound_reached,
                                                    waves.completion, waves.completion_s)
    return replace(drawn, groups=[g for part in every for g in part[0]], stats=stats, waves=waves, figures=figures,
                   position=max(part[4] for part in every))


def merge_waves(per_rank: Sequence[Waves]) -> Waves:
    """Every rank's waves as one step's: wave i holds every rank's groups of its wave i (ranks that stopped earlier
    hold none), its wall time the longest rank's (the ranks roll out side by side), the kept groups and completions
    renumbered over the merged order; the bound is reached when a rank reached it. One rank's: as they are."""
    if len(per_rank) == 1:
        return per_rank[0]
    records: list[WaveRecord] = []
    where: list[dict[int, int]] = [{} for _ in per_rank]  # per rank: its group index -> the merged index
    start = [0] * len(per_rank)
    for i in range(max(len(w.records) for w in per_rank)):
        merged = WaveRecord([], 0.0, [])
        for r, w in enumerate(per_rank):
            if i >= len(w.records):
                continue
            rec = w.records[i]
            first = sum(len(m.contrast) for m in records) + len(merged.contrast)
            for g in range(len(rec.contrast)):
                where[r][start[r] + g] = first + g
            start[r] += len(rec.contrast)
            merged.contrast += rec.contrast
            merged.episodes += rec.episodes
            merged.wall_s = max(merged.wall_s, rec.wall_s)
        records.append(merged)
    kept = sorted(where[r][k] for r, w in enumerate(per_rank) for k in w.kept)
    completion = None
    if any(w.completion is not None for w in per_rank):
        completion = {where[r][k]: n for r, w in enumerate(per_rank) for k, n in (w.completion or {}).items()}
    return Waves(records, kept, any(w.bound_reached for w in per_rank), completion,
                 max(w.completion_s for w in per_rank))


class Drawer:
    """The rollout side of training: ``with drawer.open(cfg, pool_size=..., uid_base=...):`` it opens its Env (the
    Trainer's generator, task and reward model; a kernel pool of its own), then ``draw(step)`` draws each step.
    ``rank``/``world``: this process's place (every rank draws the same problems and keeps its share);
    ``sampling(wave)`` the sampling of the step's wave; ``problems`` the stream (its position is the run's
    checkpointed data position)."""

    def __init__(self, rollout_cfg: Any, tree: TreeShape, sampling: Callable[[int], SamplingParams],
                 problems: ProblemStream, rank: int = 0, world: int = 1):
        self.cfg, self.tree, self.sampling, self.problems = rollout_cfg, tree, sampling, problems
        self.rank, self.world = rank, world
        self.env: Env | None = None
        """The Env draws roll out in (``open``), with the reward weights of the step being drawn."""

    @contextlib.contextmanager
    def open(self, cfg: Any, *, pool_size: int, generator: Generator, task: Task, rewards: RewardModel,
             uid_base: int | None = None) -> Iterator[Env]:
        """Open the Env (``rollout.open_env``: a started pool of ``pool_size`` kernels, under uids from ``uid_base``)
        for the run's draws; closed (the pool) on exit."""
        with open_env(cfg, pool_size=pool_size, generator=generator, task=task, rewards=rewards,
                      uid_base=uid_base) as env:
            self.env = env
            try:
                yield env
            finally:
                self.env = None

    def draw(self, step: int, stop: Callable[[], bool] = lambda: False) -> Drawn:
        """Stages 1-2 of step ``step + 1`` on this rank, with no collective (see the module docstring). ``stop()``:
        whether to train on what the step holds (Ctrl-C: no further wave)."""
        if self.env is None:
            raise RuntimeError("Drawer.draw needs its Env: inside `with drawer.open(...)`")
        env = self.env.at(step)  # the reward weights scheduled for this step
        version = env.generator.version
        if self.cfg.dynamic_sampling:  # 1-2 in waves, until this rank holds enough groups with a contrast
            return self._waves(env, step, stop, version)
        # 1. sample problems (every rank draws the same ones and keeps its share: whole groups stay on one rank)
        mine = self._share(self.problems.take(self.cfg.problems_per_step))
        # 2. group rollouts (a tree's group is its leaves: group_size of them, or fewer when it fell short)
        trajs, stats = _rollout(env, mine, self.sampling(0), self.cfg.group_size, self.tree)
        return Drawn(trajs, split_by_group(trajs), stats, version, self.problems.position)

    def _share(self, items: Sequence[Any]) -> list[Any]:
        """This rank's share of ``items`` (every rank holds the same list): items rank, rank + world, ..."""
        return list(items[self.rank::self.world])

    def _waves(self, env: Env, step: int, stop: Callable[[], bool], version: int) -> Drawn:
        """Stages 1-2 under dynamic sampling: waves of problems (every rank draws a wave's problems and rolls out
        its share) until this rank holds its share of problems_per_step groups with a contrast, or the bound is
        spent. A group is a problem's episodes, or its tree's leaves (possibly fewer than group_size: kept with the
        leaves it has, see dynamic_sampling.py)."""
        cfg = self.cfg
        G, probe = cfg.group_size, cfg.dynamic_sampling_probe
        want = len(range(self.rank, cfg.problems_per_step, self.world))  # this rank's share of the kept groups
        per_wave = screening_wave(cfg.problems_per_step, G, probe)  # problems a wave draws (more with a probe)
        drawn: list[list[Trajectory]] = []  # every group of every wave on this rank, in the order drawn
        problems_drawn: list[tuple[int, dict]] = []  # their problems, same order
        waves: list[WaveRecord] = []
        parts: list[tuple[RolloutStats, int]] = []  # each wave's rollout stats, and its episodes
        while True:
            t0 = time.perf_counter()
            mine = self._share(self.problems.take(per_wave))
            trajs, wave_stats = _rollout(env, mine, self.sampling(len(waves)), probe or G, self.tree)
            parts.append((wave_stats, len(trajs)))
            groups = split_by_group(trajs)
            assert len(groups) == len(mine), "every problem has a group (a tree has at least its roots)"
            drawn += groups
            problems_drawn += mine
            waves.append(WaveRecord([group_has_contrast(g, cfg.dynamic_sampling_signal) for g in groups],
                                    time.perf_counter() - t0, [len(g) for g in groups]))
            enough = sum(c for w in waves for c in w.contrast) >= want
            bound = len(waves) > cfg.dynamic_sampling_extra_waves
            if enough or bound or stop():  # Ctrl-C: train on what the step holds
                break
        contrast = [c for w in waves for c in w.contrast]
        kept = select_groups(contrast, want, at_least=1)  # each rank trains on a group at least
        completion, completion_s = None, 0.0
        if probe:  # screening: the probes kept with a contrast are completed to G episodes
            completion, completion_s = self._complete_probes(env, self.sampling(len(waves)), drawn, problems_drawn,
                                                             [i for i in kept if contrast[i]], parts)
        mine_kept = [drawn[i] for i in kept]
        for k, group in enumerate(mine_kept):  # group ids of this rank's batch (the advantage normalises within)
            for t in group:
                t.group = k
        local = [t for group in mine_kept for t in group]
        return Drawn(local, drawn, merge_wave_stats(parts), version, self.problems.position,
                     Waves(waves, kept, bound and not enough, completion, completion_s))

    def _complete_probes(self, env: Env, sampling: SamplingParams, drawn: list[list[Trajectory]],
                         problems_drawn: list[tuple[int, dict]], complete: list[int],
                         parts: list[tuple[RolloutStats, int]]) -> tuple[dict[int, int], float]:
        """Screening's last stage: each kept probe with a contrast (``complete``, indices into ``drawn``) gets
        group_size - probe more episodes, sampled with ``sampling`` (the seed of the wave after the last screening
        wave: new draws) and appended to its group. A kept probe without a contrast (a stand-in when the bound was
        reached) stays as it is: it adds no gradient either way. Returns the episodes added per group index and the
        wall time for them; adds its stats to ``parts``."""
        t0 = time.perf_counter()
        if not complete:
            return {}, time.perf_counter() - t0
        trajs, stats = _rollout(env, [problems_drawn[i] for i in complete], sampling,
                                self.cfg.group_size - self.cfg.dynamic_sampling_probe)
        parts.append((stats, len(trajs)))
        added = {}
        for i, group in zip(complete, split_by_group(trajs), strict=True):
            for t in group:
                t.group = drawn[i][0].group
            drawn[i] = drawn[i] + group
            added[i] = len(group)
        return added, time.perf_counter() - t0


def _rollout(env: Env, rows: Sequence[tuple[int, dict]], sampling: SamplingParams, group_size: int,
             tree: TreeShape | None = None) -> tuple[list[Trajectory], RolloutStats]:
    return run_sync(rollout(env, rows, sampling, group_size=group_size, tree=tree))
