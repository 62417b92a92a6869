"""Tree rollouts: a GRPO group whose episodes branch at line boundaries and share everything before the branch.

``roots`` episodes start from the problem's prompt. When an episode has executed ``branch_at[0]`` statements (and
stands at a ``>>>`` prompt) it becomes a branch point: it goes on as its own first child, and ``width - 1`` copies
of it go on beside it. A copy starts from the parent's token ids, masks and log-probs (a plain prompt to the
generation backend, whose prefix cache or re-prefill takes care of the shared prefix) and from the parent's
interpreter state, rebuilt in a fresh kernel of the pool by running the task's ``setup(row)`` (if it has one) and
replaying the parent's lines (``ReplSession.replay``).
A replay whose outputs differ from the parent's (``random``, time, ``id()``) is counted, and the copy goes on with
``tree_diverged`` set: the ``tree`` estimator gives it no tree credit. The next branch point is ``branch_at[1]``,
and so on; every leaf is an ordinary token-exact ``Trajectory`` with its path in ``tree_nodes`` / ``tree_cuts``.

An episode that ends before a branch point is a leaf where it ends. The group still has ``roots * width ** k``
leaves: the episodes alive at the last branch point get the missing children between them (spread evenly). Only
when no episode of a group is alive at its last branch point does the group have fewer leaves; the shortfall is
logged and counted (``tree/leaf_shortfall``).

The levels run one after the other (every episode of a level reaches its branch point or ends, then the next level
starts in a new generation session), so the backend sees nothing tree-specific: ordinary prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sandbox import KernelPool

from .backends.base import Generator
from .repl import ReplSession
from .rewards import RewardModel
from .rollout import Episode, EpisodeRules, RolloutStats, build_prompt, encode, finish_episode, play, run_setup
from .tasks.base import Task
from .types import SamplingParams, Trajectory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TreeShape:
    """The shape of a tree group; ``TreeShape.from_config(cfg.tree)`` (defaults live in config.py)."""

    roots: int
    branch_at: tuple[int, ...]
    width: int

    @classmethod
    def from_config(cls, tree_cfg: Any) -> TreeShape:
        return cls(roots=tree_cfg.roots, branch_at=tuple(tree_cfg.branch_at), width=tree_cfg.width)

    @property
    def leaves(self) -> int:
        """Leaves per problem when no episode ends before a branch point."""
        return self.roots * self.width ** len(self.branch_at)

    @property
    def on(self) -> bool:
        return bool(self.branch_at)


@dataclass
class _Node:
    """An episode of the tree in progress: the episode, its problem, and the kernel it holds across levels."""

    ep: Episode
    group: int
    row_index: int
    row: dict
    kernel_scope: contextlib.AsyncExitStack
    inherited_tokens: int = 0
    """Sampled tokens copied from the parent (generated once, by the parent)."""


def children_per_node(shape: TreeShape, level: int, alive: int, leaves_so_far: int) -> list[int]:
    """How many children each of ``alive`` episodes of one group gets at branch level ``level``: ``width`` each,
    except at the last branch point, where the group's missing leaves are spread over them (the first ones get one
    more when it does not divide): ``leaves_so_far`` leaves ended earlier, and the group should have
    ``shape.leaves``. Every alive episode keeps at least ``width`` children there."""
    if level < len(shape.branch_at) - 1 or alive == 0:
        return [shape.width] * alive
    missing = max(shape.leaves - leaves_so_far, shape.width * alive)
    base, extra = divmod(missing, alive)
    return [base + (j < extra) for j in range(alive)]


async def tree_rollout(generator: Generator, pool: KernelPool, task: Task, rows: Sequence[tuple[int, dict]],
                       rewards: RewardModel, sampling: SamplingParams, rules: EpisodeRules, shape: TreeShape,
                       chat_template: bool = True, progress: Any = None) -> tuple[list[Trajectory], RolloutStats]:
    """A tree of ``shape`` for each ``(row_index, row)``; returns the leaves grouped in order, and the statistics
    (``tree/...``: branch points, replays and how many diverged, replay time per line, tokens generated per leaf
    against the sampled tokens the leaves hold, which is what a flat group of as many episodes samples)."""
    tok = generator.tokenizer
    t_start = time.perf_counter()
    counters: dict[str, float] = {"branch_points": 0, "replays": 0, "replays_diverged": 0, "replayed_lines": 0,
                                  "replay_s": 0.0, "leaf_shortfall": 0, "levels": 0}
    gen_stats: dict[str, float] = {}
    leaves: list[_Node] = []
    nodes: list[_Node] = []
    everyone: list[_Node] = []  # to release every kernel, whatever fails
    node_ids = [0] * len(rows)  # next node id per group
    try:
        for g, (row_index, row) in enumerate(rows):
            ids = encode(tok, build_prompt(tok, task.header(row), chat_template))
            for _ in range(shape.roots):
                nodes.append(_Node(Episode.start(ids, task, sampling), g, row_index, row, contextlib.AsyncExitStack()))
        everyone += nodes
        await asyncio.gather(*(_acquire(pool, task, n, digest=rules.state_digest) for n in nodes))
        for level in range(len(shape.branch_at) + 1):
            stop_at = shape.branch_at[level] if level < len(shape.branch_at) else None
            await _play_level(generator, pool, task, nodes, tok, rewards, sampling, rules, level, stop_at,
                              gen_stats, counters)
            counters["levels"] += 1
            alive = [n for n in nodes if not n.ep.ended]
            for n in nodes:
                if n.ep.ended:
                    await _finish(n, task, rewards, tok, leaves, progress)
            if stop_at is None:
                break
            nodes, copies = [], []
            for g in range(len(rows)):
                mine = [n for n in alive if n.group == g]
                done = sum(leaf.group == g for leaf in leaves)
                for n, count in zip(mine, children_per_node(shape, level, len(mine), done), strict=True):
                    node_id = node_ids[g]
                    node_ids[g] += 1
                    n.ep.traj.tree_nodes.append(node_id)
                    n.ep.traj.tree_cuts.append(len(n.ep.traj.lines))
                    counters["branch_points"] += 1
                    nodes.append(n)  # the parent goes on as its own first child, on its own kernel
                    copies += [_copy(n) for _ in range(count - 1)]
                    nodes += copies[len(copies) - count + 1:]
            everyone += copies
    finally:
        for n in everyone:
            await n.kernel_scope.aclose()
    for g in range(len(rows)):
        short = shape.leaves - sum(leaf.group == g for leaf in leaves)
        if short > 0:
            counters["leaf_shortfall"] += short
            log.info("tree of problem %d: %d leaves instead of %d (every episode ended before the last branch point "
                     "at line %d)", rows[g][0], shape.leaves - short, shape.leaves, shape.branch_at[-1])
    leaves.sort(key=lambda n: n.group)  # stable: within a group, in the order the leaves ended
    trajs = [n.ep.traj for n in leaves]
    generated = sum(sum(t.loss_mask) for t in trajs) - sum(n.inherited_tokens for n in leaves)
    held = sum(sum(t.loss_mask) for t in trajs)
    stats = RolloutStats(wall_s=time.perf_counter() - t_start, generation_s=gen_stats.get("worker_s", 0.0),
                         execution_s=sum(t.timing["execution_s"] for t in trajs), model_tokens=generated,
                         env_tokens=sum(len(t.token_ids) - t.prompt_len - sum(t.loss_mask) for t in trajs),
                         extra={"setup_s": sum(t.timing.get("setup_s", 0.0) for t in trajs),
                                **{f"gen_{k}": v for k, v in gen_stats.items()}})
    n_leaves = max(len(trajs), 1)
    stats.extra.update({
        "tree/branch_points": counters["branch_points"], "tree/replays": counters["replays"],
        "tree/replays_diverged": counters["replays_diverged"], "tree/leaf_shortfall": counters["leaf_shortfall"],
        "tree/replay_ms_per_line": 1000 * counters["replay_s"] / max(counters["replayed_lines"], 1),
        "tree/generated_tokens_per_leaf": generated / n_leaves,
        "tree/leaf_tokens_per_leaf": held / n_leaves,
        "tree/generated_vs_leaf_tokens": generated / max(held, 1),
    })
    return trajs, stats


async def _acquire(pool: KernelPool, task: Task, node: _Node, replay: bool = False, digest: bool = False) -> Any:
    """Give ``node`` a fresh kernel of the pool (held until its leaf ends) and run the task's setup there; with
    ``replay``, then rebuild its parent's state by replaying the lines its trajectory holds."""
    kernel = await node.kernel_scope.enter_async_context(pool.acquire())
    node.ep.traj.timing["setup_s"] = node.ep.traj.timing.get("setup_s", 0.0) + await run_setup(kernel, task, node.row)
    node.ep.session = ReplSession(kernel, banner="", digest=digest)
    if digest and node.ep.traj.timing["setup_s"]:  # the setup's data is part of the first line's state
        await node.ep.session.refresh_state()
    if replay:
        return await node.ep.session.replay([(ln.code, ln.output) for ln in node.ep.traj.lines])
    return None


def _copy(parent: _Node) -> _Node:
    """A child of ``parent`` at its branch point: the same trajectory so far (ids, masks, log-probs, lines), no
    kernel yet."""
    ep = parent.ep
    child = Episode(traj=copy.deepcopy(ep.traj), env_ids=[], repeats=ep.repeats, submitted=list(ep.submitted),
                    executed=ep.executed)
    child.traj.timing = {}  # its own setup, generation and execution times
    return _Node(child, parent.group, parent.row_index, parent.row, contextlib.AsyncExitStack(),
                 inherited_tokens=sum(ep.traj.loss_mask))


async def _play_level(generator: Generator, pool: KernelPool, task: Task, nodes: list[_Node], tok: Any,
                      rewards: RewardModel, sampling: SamplingParams, rules: EpisodeRules, level: int,
                      stop_at: int | None, gen_stats: dict[str, float], counters: dict[str, float]) -> None:
    """Play every node until its next branch point (``stop_at`` statements) or its end, in one generation session
    whose prompts are the nodes' token ids so far. A copy without a kernel first gets one and replays its parent's
    lines there, while the others already generate."""
    todo = [n for n in nodes if not n.ep.ended]
    if not todo:
        return
    level_sampling = sampling
    if sampling.seed is not None:  # a stream per level: rows are numbered from 0 again in each level's session
        level_sampling = dataclasses.replace(sampling, seed=(sampling.seed * 7919 + level) % (2**31))
    gen = generator.session([list(n.ep.traj.token_ids) for n in todo], level_sampling)
    try:
        async def one(i: int, n: _Node) -> None:
            n.ep.env_ids = []  # already in the prompt
            try:
                if n.ep.session is None:
                    rep = await _acquire(pool, task, n, replay=True, digest=rules.state_digest)
                    counters["replays"] += 1
                    counters["replayed_lines"] += rep.lines
                    counters["replay_s"] += rep.duration_s
                    if rep.diverged:
                        counters["replays_diverged"] += 1
                        n.ep.traj.tree_diverged = True
                await play(gen, i, n.ep, tok, rewards, sampling, rules, stop_at=stop_at)
            finally:
                gen.finish(i)

        episodes = [asyncio.ensure_future(one(i, n)) for i, n in enumerate(todo)]
        try:
            await asyncio.gather(*episodes)
        except BaseException:  # e.g. a task's setup failed: stop the others before their kernels go
            for e in episodes:
                e.cancel()
            await asyncio.gather(*episodes, return_exceptions=True)
            raise
    finally:
        await gen.aclose()
    for k, v in getattr(gen, "stats", {}).items():
        if k.startswith("max_"):
            gen_stats[k] = max(gen_stats.get(k, 0.0), float(v))
        else:
            gen_stats[k] = gen_stats.get(k, 0.0) + float(v)


async def _finish(node: _Node, task: Task, rewards: RewardModel, tok: Any, leaves: list[_Node],
                  progress: Any) -> None:
    await node.kernel_scope.aclose()
    traj = finish_episode(node.ep, task, node.row, rewards, tok)
    traj.group, traj.row = node.group, node.row_index
    leaves.append(node)
    if progress is not None:
        progress.update(1)


__all__ = ["TreeShape", "children_per_node", "tree_rollout"]
