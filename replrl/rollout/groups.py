"""A step's groups of episodes: ``rollout()`` samples a GRPO group per problem, flat (``group_size`` episodes) or a
tree (``tree_rollout``), and scores the episode-level reward functions once for both; ``split_by_group`` cuts its
episodes into their groups; ``rollout_in_waves`` runs more problems than a pool holds, a wave at a time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from ..types import SamplingParams, Trajectory
from .env import Env
from .episode import run_episode
from .stats import RolloutStats
from .transcript import build_prompt, encode
from .tree import tree_rollout


def rollout(env: Env, rows: Sequence[tuple[int, dict]], sampling: SamplingParams, *, group_size: int = 1,
            progress: Any = None, tree: Any = None) -> Coroutine[Any, Any, tuple[list[Trajectory], RolloutStats]]:
    """``await rollout(env, rows, sampling, group_size=G)``: sample ``group_size`` episodes for each ``(row_index,
    row)`` in ``env`` concurrently; the episodes grouped in order, and the rollout's statistics. Episode-level reward
    functions (``env.rewards``) are scored once, here.

    ``tree`` (a ``TreeShape`` with branch points): each group is a tree of episodes that branch at line boundaries
    instead (``tree_rollout``; its leaves replace the ``group_size`` episodes). ``progress``: a bar, updated per
    episode. (A plain function returning the coroutine, so that what it refuses names the caller's line.)"""
    if not isinstance(env, Env):
        raise TypeError(f"rollout(env, rows, sampling, *, group_size=1, progress=None, tree=None) takes an Env first, "
                        f"not {type(env).__name__}: build one with open_env(cfg, pool_size=...) or Env(generator, "
                        f"pool, task, rules, rewards, ...)")
    return _rollout(env, rows, sampling, group_size, progress, tree)


async def _rollout(env: Env, rows: Sequence[tuple[int, dict]], sampling: SamplingParams, group_size: int,
                   progress: Any, tree: Any) -> tuple[list[Trajectory], RolloutStats]:
    if tree is not None and tree.on:
        trajs, stats = await tree_rollout(env, rows, sampling, tree, progress)
    else:
        trajs, stats = await flat_rollout(env, rows, sampling, group_size, progress)
    await env.rewards.score_episodes(trajs, rows)  # episode-level reward functions (rewards.functions), all at once
    return trajs, stats


async def flat_rollout(env: Env, rows: Sequence[tuple[int, dict]], sampling: SamplingParams, group_size: int = 1,
                       progress: Any = None) -> tuple[list[Trajectory], RolloutStats]:
    """``group_size`` independent episodes for each ``(row_index, row)``, all at once in one generation session;
    grouped in order, with the rollout's statistics (episode-level reward functions not scored yet: ``rollout``)."""
    tok, rules = env.tokenizer, env.rules
    prompts, meta = [], []
    for g, (row_index, row) in enumerate(rows):
        ids = encode(tok, build_prompt(tok, env.task.header(row), env.chat_template, env.chat_template_kwargs))
        for _ in range(group_size):
            prompts.append(ids)
            meta.append((g, row_index, row))
    t0 = time.perf_counter()
    gen = env.generator.session(prompts, sampling)
    try:
        async def one(i: int) -> Trajectory:
            g, row_index, row = meta[i]
            traj = await run_episode(gen, i, env, row, prompts[i], sampling)
            traj.group, traj.row = g, row_index
            if progress is not None:
                progress.update(1)
            return traj

        episodes = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
        try:
            trajs = list(await asyncio.gather(*episodes))
        except BaseException:  # e.g. a task's setup failed: stop the other episodes before their kernels go
            for e in episodes:
                e.cancel()
            await asyncio.gather(*episodes, return_exceptions=True)
            raise
    finally:
        await gen.aclose()
    stats = RolloutStats(wall_s=time.perf_counter() - t0,
                         generation_s=float(gen.stats.get("worker_s", 0.0)),
                         execution_s=sum(t.timing["execution_s"] for t in trajs),
                         model_tokens=sum(sum(t.loss_mask) for t in trajs),
                         env_tokens=sum(len(t.token_ids) - t.prompt_len - sum(t.loss_mask) for t in trajs),
                         extra={"setup_s": sum(t.timing.get("setup_s", 0.0) for t in trajs),
                                **({k: float(sum(t.timing.get(k, 0) for t in trajs))
                                    for k in ("speculated_lines", "speculation_hits")} if rules.speculate else {}),
                                **{f"gen_{k}": float(v) for k, v in gen.stats.items()},
                                **{f"gen_{k}": float(v) for k, v in gen.timing.items()}})
    return trajs, stats


def split_by_group(trajs: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """Episodes of one rollout call (grouped in order, ``traj.group`` set: flat episodes or tree leaves) -> one list
    per group, split where the group id changes: a tree group may hold fewer leaves than ``group_size``, so a fixed
    stride of ``group_size`` episodes would cut across groups."""
    groups: list[list[Trajectory]] = []
    for t in trajs:
        if not groups or groups[-1][0].group != t.group:
            groups.append([])
        groups[-1].append(t)
    return groups


async def rollout_in_waves(env: Env, rows: Sequence[tuple[int, dict]], sampling: SamplingParams, group_size: int = 1,
                           progress: Any = None) -> tuple[list[Trajectory], RolloutStats]:
    """``rollout`` over ``rows`` in waves of as many problems as ``env.pool``'s kernels hold whole groups (kernels
    stay warm between waves); the episodes in order, and the waves' statistics as one rollout's."""
    per_wave = max(1, env.pool.size // group_size)
    trajs: list[Trajectory] = []
    stats = RolloutStats()
    for start in range(0, len(rows), per_wave):
        part, st = await rollout(env, rows[start:start + per_wave], sampling, group_size=group_size,
                                 progress=progress)
        trajs += part
        stats = st if start == 0 else stats.merge(st)
    return trajs, stats
