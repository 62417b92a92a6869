"""A step's groups, stages 1-2 of a training step: the problem stream, each rank's share of it, the group rollouts
(flat or trees), dynamic sampling's waves and its probes' completion, and the figures merged over the ranks.

Every rank draws the same problems and keeps its share: a GRPO group never spans ranks, and every rank sees every
group (gathered), so all ranks decide alike. ``Ranks`` (ranks.py) holds the process's place and its collectives
(world size 1 needs no branch); ``draw_step`` returns a ``Drawn``: this rank's episodes to train on, every group
drawn (for the step's figures), this rank's rollout statistics and the ``dynsamp/`` figures.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sandbox import run_sync

from .configlib import ConfigError
from .dynamic_sampling import WaveRecord, group_has_contrast, screening_wave, select_groups, wave_metrics
from .ranks import Ranks
from .rollout import Env, RolloutStats, TreeShape, merge_tree_figures, merge_wave_stats, rollout, split_by_group
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
class Drawn:
    """A step's groups, as ``draw_step`` returns them."""

    mine: list[Trajectory]
    """This rank's episodes to train on, whole groups, group ids local to this rank."""
    groups: list[list[Trajectory]]
    """Every group drawn this step, on every rank, in the order drawn (the step's figures are over them)."""
    stats: RolloutStats
    """This rank's rollout statistics (over the waves; the ``tree/`` figures over every rank's trees)."""
    figures: dict[str, float] = field(default_factory=dict)
    """``dynsamp/`` figures (empty without dynamic sampling)."""


def draw_step(env: Env, problems: ProblemStream, cfg: Any, tree: TreeShape, sampling: Callable[[int], SamplingParams],
              ranks: Ranks, step: int, stop: Callable[[], bool] = lambda: False) -> Drawn:
    """Stages 1-2 of step ``step + 1``: ``cfg`` is the run's ``RolloutConfig``, ``sampling(wave)`` the sampling of
    the step's ``wave`` (dynamic sampling's later waves get seeds of their own), ``stop()`` whether to train on what
    the step holds (Ctrl-C: no further wave)."""
    if cfg.dynamic_sampling:  # 1-2 in waves, until the step holds enough groups with a contrast
        drawn = _waves(env, problems, cfg, tree, sampling, ranks, step, stop)
    else:
        # 1. sample problems (every rank draws the same ones and keeps its share: whole groups stay on one rank)
        mine = ranks.share(problems.take(cfg.problems_per_step))
        # 2. group rollouts (a tree's group is its leaves: group_size of them, or fewer when it fell short)
        trajs, stats = _rollout(env, mine, sampling(0), cfg.group_size, tree)
        drawn = Drawn(trajs, ranks.gather(split_by_group(trajs)), stats)
    if ranks.world > 1 and tree.on:  # the tree/ figures of every rank's trees, not this rank's alone
        own = {k: v for k, v in drawn.stats.extra.items() if k.startswith("tree/")}
        drawn.stats.extra.update(merge_tree_figures(ranks.gather([(own, int(own.get("tree/leaves", 0)))])))
    return drawn


def _rollout(env: Env, rows: Sequence[tuple[int, dict]], sampling: SamplingParams, group_size: int,
             tree: TreeShape | None = None) -> tuple[list[Trajectory], RolloutStats]:
    return run_sync(rollout(env, rows, sampling, group_size=group_size, tree=tree))


def _waves(env: Env, problems: ProblemStream, cfg: Any, tree: TreeShape, sampling: Callable[[int], SamplingParams],
           ranks: Ranks, step: int, stop: Callable[[], bool]) -> Drawn:
    """Stages 1-2 under dynamic sampling: waves of problems_per_step problems (each rank rolls out its share, as
    without it) until problems_per_step groups have a contrast or the bound is spent. Every rank sees every
    group (gathered), so all decide alike; the kept groups are then dealt to the ranks whole, in the order
    drawn. A group is a problem's episodes, or its tree's leaves (possibly fewer than group_size: kept with
    the leaves it has, see dynamic_sampling.py)."""
    G, want, probe = cfg.group_size, cfg.problems_per_step, cfg.dynamic_sampling_probe
    per_wave = screening_wave(want, G, probe)  # problems a wave draws (more, with a probe of fewer episodes)
    drawn: list[list[Trajectory]] = []  # every group of every wave, over all ranks, in stream order
    problems_drawn: list[tuple[int, dict]] = []  # their problems (every rank draws them all), same order
    waves: list[WaveRecord] = []
    parts: list[tuple[RolloutStats, int]] = []  # each wave's rollout stats on this rank, and its episodes
    while True:
        t0 = time.perf_counter()
        problems_drawn += problems.take(per_wave)
        mine = ranks.share(problems_drawn[-per_wave:])
        trajs, wave_stats = _rollout(env, mine, sampling(len(waves)), probe or G, tree)
        parts.append((wave_stats, len(trajs)))
        local_groups = split_by_group(trajs)
        assert len(local_groups) == len(mine), "every problem has a group (a tree has at least its roots)"
        # local group g is problem rank + g * world of the wave
        numbered = [(ranks.rank + g * ranks.world, group) for g, group in enumerate(local_groups)]
        groups = [group for _, group in sorted(ranks.gather(numbered), key=lambda x: x[0])]
        drawn += groups
        waves.append(WaveRecord([group_has_contrast(g, cfg.dynamic_sampling_signal) for g in groups],
                                time.perf_counter() - t0, [len(g) for g in groups]))
        enough = sum(c for w in waves for c in w.contrast) >= want
        bound = len(waves) > cfg.dynamic_sampling_extra_waves
        if enough or bound or ranks.any(stop()):  # Ctrl-C: train on what the step holds
            break
    contrast = [c for w in waves for c in w.contrast]
    kept = select_groups(contrast, want, at_least=ranks.world)
    if bound and not enough and ranks.main:
        log.info("step %d: %d of %d groups with a contrast after %d waves (the bound); training on those",
                 step + 1, sum(contrast), want, len(waves))
    completion, completion_s = None, 0.0
    if probe:  # screening: this rank completes the probes it trains on (those with a contrast) to G episodes
        completion, completion_s = _complete_probes(env, cfg, sampling(len(waves)), ranks, drawn, problems_drawn,
                                                    kept, contrast, parts)
    mine_kept = [drawn[i] for j, i in enumerate(kept) if ranks.owns(j)]
    for k, group in enumerate(mine_kept):  # group ids of this rank's batch (the advantage normalises within them)
        for t in group:
            t.group = k
    local = [t for group in mine_kept for t in group]
    figures = wave_metrics(waves, kept, G, bound_reached=bound and not enough, completion=completion,
                           completion_s=completion_s)
    return Drawn(local, drawn, merge_wave_stats(parts), figures)


def _complete_probes(env: Env, cfg: Any, sampling: SamplingParams, ranks: Ranks, drawn: list[list[Trajectory]],
                     problems_drawn: list[tuple[int, dict]], kept: list[int], contrast: list[bool],
                     parts: list[tuple[RolloutStats, int]]) -> tuple[dict[int, int], float]:
    """Screening's last stage: each kept probe with a contrast gets group_size - probe more episodes, rolled out
    by the rank that trains on it, sampled with ``sampling`` (the seed of the wave after the last screening wave:
    new draws), and appended to its group in ``drawn`` on every rank. A kept probe without a contrast (a stand-in
    when the bound was reached) stays as it is: it adds no gradient either way. Returns the episodes added per
    group index (over all ranks) and this rank's wall time for them; adds its stats to ``parts``."""
    t0 = time.perf_counter()
    mine = [i for j, i in enumerate(kept) if ranks.owns(j) and contrast[i]]
    more: list[list[Trajectory]] = []
    if mine:
        trajs, stats = _rollout(env, [problems_drawn[i] for i in mine], sampling,
                                cfg.group_size - cfg.dynamic_sampling_probe)
        parts.append((stats, len(trajs)))
        more = split_by_group(trajs)
    added = ranks.gather(list(zip(mine, more, strict=True)))
    for i, group in added:
        for t in group:
            t.group = drawn[i][0].group
        drawn[i] = drawn[i] + group
    return {i: len(group) for i, group in added}, time.perf_counter() - t0
