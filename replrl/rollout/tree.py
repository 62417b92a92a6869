"""Tree rollouts: a GRPO group whose episodes branch at line boundaries and share everything before the branch.

``roots`` episodes start from the problem's prompt. When an episode has executed ``branch_at[0]`` statements (and
stands at a ``>>>`` prompt) it becomes a branch point: it goes on as its own first child, and ``width - 1`` copies
of it go on beside it. A copy starts from the parent's token ids, masks and log-probs and from the parent's
interpreter state, rebuilt in a fresh kernel of the pool by running the task's ``setup(row)`` (if it has one) and
replaying the parent's lines (``ReplSession.replay``).
With ``rule = "lowest_prob"`` the branch falls instead before the line since the previous branch point whose first
token was least likely (``branch_line``): the copies take the parent's trajectory up to that line and sample it
again, and the parent's own lines from there on are its segment after the branch.
A replay whose outputs differ from the parent's (``random``, time, ``id()``) is counted, and the copy goes on with
``tree_diverged`` set: the ``tree`` estimator gives it no tree credit. The next branch point is ``branch_at[1]``,
and so on; every leaf is an ordinary token-exact ``Trajectory`` with its path in ``tree_nodes`` / ``tree_cuts``.

No barrier: every episode is its own task, and a branch point's copies start the moment their parent reaches it,
while the other episodes go on generating. When the generation session can ``fork`` a row (the HF backend copies
the row's KV cache), the copies are new rows of the running session and nothing of the shared prefix is computed
again; otherwise (vLLM) they get a small session of their own whose prompt is the shared prefix (vLLM's prefix
cache serves it). A copy's random stream is named by its place in the tree, not by when it was made, so a seeded
tree does not depend on which episode reaches its branch point first.

An episode that ends before a branch point is a leaf where it ends. The group still has ``roots * width ** k``
leaves: the episodes alive at the last branch point get the missing children between them (spread evenly). That
is only known once every episode of the group has passed the last branch point or ended, so those extra children
start then, from a copy of their parent taken at the branch point (in a session of their own: the parent's row has
moved on). Only when no episode of a group is alive at its last branch point does the group have fewer leaves; the
shortfall is logged and counted (``tree/leaf_shortfall``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import time
import zlib
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from sandbox.protocols import Pool

from ..backends.base import ForkableSession, GenSession
from ..repl import ReplSession
from ..tasks.base import Task
from ..types import SamplingParams, Trajectory
from .env import Env
from .episode import Episode, finish_episode, play, run_setup
from .stats import RolloutStats
from .transcript import build_prompt, encode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TreeShape:
    """The shape of a tree group; ``TreeShape.from_config(cfg.tree)`` (defaults live in config.py)."""

    roots: int
    branch_at: tuple[int, ...]
    width: int
    rule: str = "fixed"
    """Where an episode branches when it has executed ``branch_at[k]`` statements: ``fixed``, there; ``lowest_prob``,
    before the line since its previous branch point (not its first line, and one typed at a ``>>>`` prompt) whose
    first token had the lowest probability (SPO's cutpoints: the children re-sample the line the policy was least
    sure of); there when no line qualifies."""

    fill: bool = True
    """Whether the episodes alive at the last branch point get the leaves that episodes ending earlier left missing
    (the group keeps ``leaves``), or ``width`` children each like every branch point (the group is short by the
    missing leaves, ``tree/leaf_shortfall``). Filling over-samples the long episodes (only they are alive there)."""

    @classmethod
    def from_config(cls, tree_cfg: Any) -> TreeShape:
        return cls(roots=tree_cfg.roots, branch_at=tuple(tree_cfg.branch_at), width=tree_cfg.width,
                   rule=getattr(tree_cfg, "branch_rule", "fixed"), fill=getattr(tree_cfg, "fill", True))

    @property
    def leaves(self) -> int:
        """Leaves per problem when no episode ends before a branch point."""
        return self.roots * self.width ** len(self.branch_at)

    @property
    def on(self) -> bool:
        return bool(self.branch_at)


@dataclass
class _Node:
    """An episode of the tree in progress: the episode, its problem, its place in the tree, the kernel it holds
    until its leaf ends, and the generation row it samples from."""

    ep: Episode
    group: int
    row_index: int
    row: dict
    path: tuple[int, ...]
    """The root's index, then the child's index at each branch point passed (the parent goes on as child 0)."""
    level: int = 0
    """Branch points passed."""
    branches: list[tuple[int, ...]] = field(default_factory=list)
    """The branch points passed, each named by the path of the episode that reached it (node ids at the end)."""
    kernel_scope: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    gen: GenSession | None = None
    slot: int = 0
    """The node's row in ``gen``."""
    inherited_tokens: int = 0
    """Sampled tokens copied from the parent (generated once, by the parent)."""


@dataclass
class _Group:
    """A problem's tree while it grows: what the leaf count at the last branch point needs to know."""

    open: int
    """Episodes neither ended nor past the last branch point yet."""
    ended_early: int = 0
    """Leaves that ended before the last branch point."""
    at_last: list[_Node] = field(default_factory=list)
    """A copy of each episode taken as it reached the last branch point (for the children that fill the group)."""
    filled: bool = False


def children_per_node(shape: TreeShape, level: int, alive: int, leaves_so_far: int) -> list[int]:
    """How many children each of ``alive`` episodes of one group gets at branch level ``level``: ``width`` each,
    except at the last branch point, where the group's missing leaves are spread over them (the first ones get one
    more when it does not divide): ``leaves_so_far`` leaves ended earlier, and the group should have
    ``shape.leaves``. Every alive episode keeps at least ``width`` children there. With ``shape.fill`` off:
    ``width`` each at every level (the group stays short)."""
    if level < len(shape.branch_at) - 1 or alive == 0 or not shape.fill:
        return [shape.width] * alive
    missing = max(shape.leaves - leaves_so_far, shape.width * alive)
    base, extra = divmod(missing, alive)
    return [base + (j < extra) for j in range(alive)]


def stream_key(group: int, path: tuple[int, ...]) -> int:
    """The random stream of the episode at ``path`` of group ``group``'s tree: its place, not when it was made
    (past every root row's index, which names the roots' streams)."""
    return (1 << 32) + zlib.crc32(repr((group, path)).encode())


async def tree_rollout(env: Env, rows: Sequence[tuple[int, dict]], sampling: SamplingParams, shape: TreeShape,
                       progress: Any = None) -> tuple[list[Trajectory], RolloutStats]:
    """A tree of ``shape`` for each ``(row_index, row)``; returns the leaves grouped in order (within a group, in
    tree order), and the statistics (``tree/...``: branch points, replays and how many diverged, replay time per
    line, tokens generated per leaf against the sampled tokens the leaves hold, which is what a flat group of as
    many episodes samples; ``gen_...``: the generation sessions' counters, summed)."""
    tree = _Tree(env, sampling, shape, progress)
    return await tree.run(rows)


class _Tree:
    """One tree rollout: the episodes' tasks, their generation sessions, the groups' leaf accounting."""

    def __init__(self, env: Env, sampling: SamplingParams, shape: TreeShape, progress: Any):
        # no speculation in trees (a branch point's rows and replays would need it too): lines run as they come
        self.env = dataclasses.replace(env, rules=dataclasses.replace(env.rules, speculate=False))
        self.generator, self.pool, self.task, self.rewards = env.generator, env.pool, env.task, env.rewards
        self.sampling, self.shape, self.progress = sampling, shape, progress
        self.rules = self.env.rules
        self.tok = env.tokenizer
        self.counters: dict[str, float] = {"branch_points": 0, "replays": 0, "replays_diverged": 0,
                                           "replayed_lines": 0, "replay_s": 0.0, "leaf_shortfall": 0,
                                           "child_sessions": 0, "cut_lines_back": 0}
        self.groups: list[_Group] = []
        self.leaves: list[_Node] = []
        self.sessions: list[GenSession] = []  # the open ones
        self.gen_stats: dict[str, float] = {}
        self.open_rows: dict[int, int] = {}  # per session (by id): rows not finished yet
        self.tasks: set[asyncio.Task] = set()
        self.changed = asyncio.Event()

    async def run(self, rows: Sequence[tuple[int, dict]]) -> tuple[list[Trajectory], RolloutStats]:
        t_start = time.perf_counter()
        roots: list[_Node] = []
        for g, (row_index, row) in enumerate(rows):
            ids = encode(self.tok, build_prompt(self.tok, self.task.header(row), self.env.chat_template,
                                                   self.env.chat_template_kwargs))
            self.groups.append(_Group(open=self.shape.roots))
            roots += [_Node(Episode.start(ids, self.env, self.sampling), g, row_index, row, path=(r,))
                      for r in range(self.shape.roots)]
        try:
            # the roots' streams are the rows of a flat session: row g * roots + r
            self._attach(roots, self.generator.session([list(n.ep.traj.token_ids) for n in roots], self.sampling))
            for node in roots:
                self._spawn(self._grow(node, replay=False))
            await self._wait_all()
        finally:
            for t in self.tasks:
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            gen_stats = await self._close_sessions()
        return self._result(rows, gen_stats, time.perf_counter() - t_start)

    # ---- the episodes' tasks ----

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        t = asyncio.ensure_future(coro)
        self.tasks.add(t)
        t.add_done_callback(lambda _: self.changed.set())

    async def _wait_all(self) -> None:
        """Until every episode's task is done (children are spawned while it waits); the first failure cancels the
        others and is raised as it is (e.g. a task's setup failed)."""
        while True:
            failed = [t for t in self.tasks if t.done() and not t.cancelled() and t.exception() is not None]
            if failed:
                raise failed[0].exception()
            if all(t.done() for t in self.tasks):
                return
            self.changed.clear()
            await self.changed.wait()

    async def _grow(self, node: _Node, replay: bool) -> None:
        """Play ``node`` from where it stands to its leaf, branching at every branch point on the way."""
        ep, levels = node.ep, len(self.shape.branch_at)
        try:
            rep = await _acquire(self.pool, self.task, node, replay=replay, digest=self.rules.state_digest)
            if rep is not None:
                self.counters["replays"] += 1
                self.counters["replayed_lines"] += rep.lines
                self.counters["replay_s"] += rep.duration_s
                if rep.diverged:
                    self.counters["replays_diverged"] += 1
                    ep.traj.tree_diverged = True
            while True:
                stop_at = self.shape.branch_at[node.level] if node.level < levels else None
                await play(node.gen, node.slot, ep, self.env, stop_at=stop_at)
                if ep.ended:
                    break
                self._branch(node)
        finally:
            await self._release(node)
        traj = finish_episode(ep, self.env, node.row)
        traj.group, traj.row = node.group, node.row_index
        self.leaves.append(node)
        if self.progress is not None:
            self.progress.update(1)
        if node.level < levels:  # a leaf before the last branch point
            group = self.groups[node.group]
            group.open -= 1
            group.ended_early += 1
            self._fill(group)

    def _branch(self, node: _Node) -> None:
        """``node`` stands at its next branch point: it goes on as child 0, and its copies start now (from the
        line the rule picked: this one, or an earlier one whose tokens they sample again)."""
        group, last = self.groups[node.group], node.level == len(self.shape.branch_at) - 1
        cut = branch_line(node.ep.traj, self.shape.rule)
        node.branches.append(node.path)
        node.ep.traj.tree_cuts.append(cut)
        self.counters["branch_points"] += 1
        self.counters["cut_lines_back"] += len(node.ep.traj.lines) - cut
        copies = [_copy(node, node.path + (j,), cut) for j in range(1, self.shape.width)]
        if last:  # kept for the children that fill the group, should some episodes end before this point
            group.at_last.append(_copy(node, node.path, cut))
            group.open -= 1
        else:
            group.open += len(copies)
        node.path, node.level = node.path + (0,), node.level + 1
        self._start(copies, parent=node)
        if last:
            self._fill(group)

    def _fill(self, group: _Group) -> None:
        """Once no episode of ``group`` can reach the last branch point any more: the children that make up for
        the leaves that ended earlier (``children_per_node``), each from the copy its parent left there."""
        if group.open or group.filled:
            return
        group.filled = True
        alive = sorted(group.at_last, key=lambda n: n.path)
        counts = children_per_node(self.shape, len(self.shape.branch_at) - 1, len(alive), group.ended_early)
        extra = [_copy(at, at.path + (self.shape.width + e,)) for at, count in zip(alive, counts, strict=True)
                 for e in range(count - self.shape.width)]
        group.at_last = []
        if extra:
            self._start(extra, parent=None)

    def _start(self, children: list[_Node], parent: _Node | None) -> None:
        """Give ``children`` generation rows (forked from ``parent``'s row when its session can, else a session of
        their own) and start them; each first gets a kernel and replays the lines it inherited."""
        if not children:
            return
        fork = parent.gen.fork if parent is not None and isinstance(parent.gen, ForkableSession) else None
        if fork is not None:
            keys = [stream_key(c.group, c.path) for c in children]
            cut_back = len(children[0].ep.traj.token_ids) < len(parent.ep.traj.token_ids)
            # children cut at an earlier line: their context is a prefix of the parent's row's
            slots = fork(parent.slot, keys, prefix=children[0].ep.traj.token_ids) if cut_back else fork(parent.slot,
                                                                                                         keys)
            self.open_rows[id(parent.gen)] += len(children)
            for c, slot in zip(children, slots, strict=True):
                c.gen, c.slot = parent.gen, slot
                c.ep.env_ids = [] if cut_back else list(parent.ep.env_ids)  # what the row has not been given yet
        else:
            sampling = self.sampling
            if sampling.seed is not None:
                sampling = dataclasses.replace(sampling, seed=(sampling.seed * 7919 + stream_key(
                    children[0].group, children[0].path)) % (2**31))
            self._attach(children, self.generator.session([list(c.ep.traj.token_ids) for c in children], sampling))
            self.counters["child_sessions"] += 1
        for c in children:
            self._spawn(self._grow(c, replay=True))

    # ---- generation sessions ----

    def _attach(self, nodes: list[_Node], session: GenSession) -> None:
        """``nodes`` sample from rows 0.. of ``session``, whose prompts are their token ids so far."""
        self.sessions.append(session)
        self.open_rows[id(session)] = len(nodes)
        for slot, n in enumerate(nodes):
            n.gen, n.slot, n.ep.env_ids = session, slot, []

    async def _release(self, node: _Node) -> None:
        """The node's leaf has ended (or failed): its generation row and its kernel go back; a session whose rows
        have all ended is closed (no row can be forked from it any more)."""
        try:
            if node.gen is not None:
                node.gen.finish(node.slot)
                self.open_rows[id(node.gen)] -= 1
                if not self.open_rows[id(node.gen)]:
                    await self._close(node.gen)
        finally:
            await node.kernel_scope.aclose()

    async def _close(self, session: GenSession) -> None:
        """Close ``session`` and add its counters to ``gen_stats`` (``max_...`` ones: the largest)."""
        self.sessions.remove(session)
        await session.aclose()
        for k, v in session.stats.items():
            old = self.gen_stats.get(k, 0.0)
            self.gen_stats[k] = max(old, float(v)) if k.startswith("max_") else old + float(v)

    async def _close_sessions(self) -> dict[str, float]:
        """Close the sessions still open (after a failure); the counters of all of them."""
        for s in list(self.sessions):
            await self._close(s)
        return self.gen_stats

    # ---- the result ----

    def _result(self, rows: Sequence[tuple[int, dict]], gen_stats: dict[str, float],
                wall_s: float) -> tuple[list[Trajectory], RolloutStats]:
        shape, counters = self.shape, self.counters
        for g in range(len(rows)):
            short = shape.leaves - sum(leaf.group == g for leaf in self.leaves)
            if short > 0:
                counters["leaf_shortfall"] += short
                log.info("tree of problem %d: %d leaves instead of %d (every episode ended before the last branch "
                         "point at line %d)", rows[g][0], shape.leaves - short, shape.leaves, shape.branch_at[-1])
        leaves = sorted(self.leaves, key=lambda n: (n.group, n.path))
        for g in range(len(rows)):  # node ids per group, breadth first: the roots' branch points, then theirs, ...
            mine = [n for n in leaves if n.group == g]
            names = sorted({b for n in mine for b in n.branches}, key=lambda p: (len(p), p))
            ids = {b: i for i, b in enumerate(names)}
            for n in mine:
                n.ep.traj.tree_nodes = [ids[b] for b in n.branches]
        trajs = [n.ep.traj for n in leaves]
        held = sum(sum(t.loss_mask) for t in trajs)
        generated = held - sum(n.inherited_tokens for n in leaves)
        stats = RolloutStats(wall_s=wall_s, generation_s=gen_stats.get("worker_s", 0.0),
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
            "tree/child_sessions": counters["child_sessions"],
            "tree/cut_lines_back": counters["cut_lines_back"] / max(counters["branch_points"], 1),
            "tree/leaves": len(trajs), "tree/replayed_lines": counters["replayed_lines"],
        })
        return trajs, stats


async def _acquire(pool: Pool, task: Task, node: _Node, replay: bool = False, digest: bool = False) -> Any:
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


def branch_line(traj: Trajectory, rule: str) -> int:
    """The index in ``traj.lines`` where an episode standing at a branch point branches (its children's first
    line): ``fixed``, the next one; ``lowest_prob``, the line since its previous branch point (not its first line,
    one typed at a ``>>>`` prompt) whose first token had the lowest log-probability, or the next one when none
    qualifies."""
    here = len(traj.lines)
    if rule == "fixed":
        return here
    start = max(traj.tree_cuts[-1] + 1 if traj.tree_cuts else 1, 1)
    candidates = [j for j in range(start, here) if traj.lines[j].prompt.startswith(">>>")
                  and traj.lines[j].token_span[1] > traj.lines[j].token_span[0]]
    if not candidates:
        return here
    return min(candidates, key=lambda j: traj.logprobs[traj.lines[j].token_span[0]])


def _copy(parent: _Node, path: tuple[int, ...], cut: int | None = None) -> _Node:
    """A child of ``parent`` at its branch point, at ``path``: the same trajectory so far (ids, masks, log-probs,
    lines, branch points passed), or its part before line ``cut``; no kernel and no generation row yet."""
    ep = parent.ep
    traj = copy.deepcopy(ep.traj)
    executed, repeats, pieces = ep.executed, ep.repeats, ep.pieces
    if cut is not None and cut < len(traj.lines):  # up to the first token of line `cut` (after its prompt)
        end = traj.lines[cut].token_span[0]
        traj.token_ids, traj.loss_mask, traj.logprobs = traj.token_ids[:end], traj.loss_mask[:end], traj.logprobs[:end]
        traj.lines = traj.lines[:cut]
        pieces = pieces[:2 * cut]  # each line before the cut: its text, then the environment's after it
        executed = sum(ln.status != "incomplete" for ln in traj.lines)  # a buffered line has not run yet
        repeats = 0
        for a, b in zip(traj.lines, traj.lines[1:]):
            repeats = repeats + 1 if a.code == b.code and b.code.strip() else 0
    child = Episode(traj=traj, env_ids=[], repeats=repeats, submitted=list(ep.submitted), executed=executed,
                    pieces=list(pieces), chars=sum(map(len, pieces)))
    child.traj.timing = {}  # its own setup, generation and execution times
    return _Node(child, parent.group, parent.row_index, parent.row, path=path, level=len(parent.branches),
                 branches=list(parent.branches), inherited_tokens=sum(traj.loss_mask))


__all__ = ["TreeShape", "branch_line", "children_per_node", "stream_key", "tree_rollout"]
