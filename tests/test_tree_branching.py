"""Tree rollouts without a level barrier: a branch point's children start when their parent reaches it, on rows
forked from its KV cache (HF), or in a session of their own on a backend that cannot fork; the children that fill
a group whose episodes ended early start once that is known.

A tiny real model memorised three scripts (tests/scripted.py): ``fast`` reaches its branch point (after line 2) at
once, ``slow`` sleeps 3 s in its line 2, and ``coin`` exits at its line 2 in half of the kernels. Real kernels, real
sampling; every leaf is checked token-exact (ids, masks, log-probs against a plain forward pass).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest
import torch

from replrl.backends.hf import HFGenerator
from replrl.config import Config, RewardConfig
from replrl.configlib import ConfigError, resolve
from replrl.contract import token_masks
from replrl.loss import token_logprobs
from replrl.models import load_tokenizer, tiny_model
from replrl.rewards import RewardModel
from replrl.rollout import (
    Env,
    EpisodeRules,
    TreeShape,
    branch_line,
    children_per_node,
    decode,
    rollout,
    summarize,
)
from replrl.types import Line, SamplingParams, Trajectory
from sandbox import run_sync
from tests.scripted import ScriptTask, script_sequences, teach_scripts

pytestmark = pytest.mark.timeout(900)
SCRIPTS = {
    "fast": ["a = 1", "b = a + 1", "c = b + 1", "submit(c)"],
    "slow": ["import time", "time.sleep(3)", "c = 3", "submit(c)"],
    "coin": ["import random", "random.random() < 0.5 or exit()", "c = 3", "submit(c)"],
}
RULES = EpisodeRules(max_output_tokens=40, max_repeats=3, state_digest=False, max_lines=6, max_total_tokens=400)
SAMPLING = SamplingParams(temperature=0.3, max_line_tokens=24, seed=1)


class BranchTask(ScriptTask):
    def answer_of(self, row: dict) -> Any:
        return 3

    def check(self, row: dict, submitted: Any) -> bool:
        return submitted == 3


class Recorded:
    """A Generator that hands everything to ``inner`` and records when each row of each session asks for a line;
    with ``fork=False`` its sessions have no ``fork`` (the path of a backend that cannot fork a row)."""

    def __init__(self, inner: HFGenerator, fork: bool = True):
        self.inner, self.forks = inner, fork
        self.tokenizer, self.pad_id = inner.tokenizer, inner.pad_id
        self.asks: list[tuple[float, int, int]] = []
        """(time, session number, row) of every next_line."""
        self.forked: dict[tuple[int, int], tuple[int, int]] = {}
        """(session number, new row) -> (session number, the row it was forked from)."""
        self.sessions = 0

    def session(self, prompts: list[list[int]], sampling: SamplingParams) -> Any:
        self.sessions += 1
        kind = _Forkable if self.forks else _Session
        return kind(self, self.inner.session(prompts, sampling), self.sessions - 1)

    def sync_weights(self, model: Any, version: int | None = None) -> None:
        self.inner.sync_weights(model, version)

    version = property(lambda self: self.inner.version)
    own_weights = False
    last_sync_transport = ""

    def close(self) -> None:
        self.inner.close()

    def first_ask(self, session: int, row: int, k: int = 0) -> float:
        """When row ``row`` of session ``session`` asked for its (k+1)-th line."""
        return [t for t, s, r in self.asks if (s, r) == (session, row)][k]


class _Session:
    def __init__(self, rec: Recorded, inner: Any, number: int):
        self.rec, self.inner, self.number = rec, inner, number

    @property
    def stats(self) -> dict[str, float]:
        return self.inner.stats

    timing: dict[str, float] = {}

    async def next_line(self, i: int, env_ids: list[int]) -> Any:
        self.rec.asks.append((time.perf_counter(), self.number, i))
        return await self.inner.next_line(i, env_ids)

    async def rollback(self, i: int, length: int) -> None:
        await self.inner.rollback(i, length)

    def finish(self, i: int) -> None:
        self.inner.finish(i)

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Forkable(_Session):
    def fork(self, i: int, keys: list[int], prefix: list[int] | None = None) -> list[int]:
        rows = self.inner.fork(i, keys, prefix)
        self.rec.forked.update({(self.number, r): (self.number, i) for r in rows})
        return rows


@pytest.fixture(scope="module")
def branch_model(pool):
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    model = tiny_model(tokenizer, seed=1, hidden_size=64, intermediate_size=128)
    teach_scripts(model, tokenizer, script_sequences(tokenizer, pool.pool, RULES.max_output_tokens,
                                                     BranchTask(SCRIPTS)))
    return model, tokenizer


def grow(branch_model, pool, scripts: list[str], shape: TreeShape, fork: bool = True
         ) -> tuple[list[Trajectory], dict[str, float], Recorded]:
    model, tokenizer = branch_model
    task = BranchTask({name: SCRIPTS[name] for name in scripts})
    gen = Recorded(HFGenerator(model, tokenizer), fork=fork)
    run_sync(pool.pool.wait_full())
    env = Env(gen, pool.pool, task, RULES, RewardModel(RewardConfig().weights), chat_template=False)
    trajs, stats = run_sync(rollout(env, list(enumerate(task.rows("x"))), SAMPLING, tree=shape))
    return trajs, summarize(trajs, stats) | stats.extra, gen


def assert_token_exact(branch_model, leaves: list[Trajectory]) -> None:
    """decode(ids) == text, loss on the sampled tokens only, log-probs those of a plain forward pass, the spans the
    splice recorded carried through copies and cuts (the text cut by them, the printed tokens decoding would find),
    and leaves under one branch point identical up to it."""
    from replrl.predict_output import output_spans
    from replrl.viewer import segments
    from tests.test_predict_output import spans_by_decoding

    model, tokenizer = branch_model
    banned = token_masks(tokenizer, model.get_output_embeddings().weight.shape[0])
    for t in leaves:
        assert decode(tokenizer, t.token_ids) == t.text
        parts = segments(t)
        assert parts is not None and "".join(text for _, text, _ in parts) == t.text
        assert [text for kind, text, _ in parts if kind == "model"] == [
            decode(tokenizer, t.token_ids[slice(*ln.token_span)]) for ln in t.lines]
        assert output_spans(t) == spans_by_decoding(t, tokenizer)
        assert len(t.token_ids) == len(t.loss_mask) == len(t.logprobs)
        sampled = {i for line in t.lines for i in range(*line.token_span)}
        assert {i for i, m in enumerate(t.loss_mask) if m} == sampled
        ids = torch.tensor([t.token_ids])
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)
        logp = token_logprobs(model, ids, torch.ones_like(ids), SAMPLING, banned, mask[None].long())[0]  # [T]
        torch.testing.assert_close(logp[mask], torch.tensor(t.logprobs)[mask], atol=2e-4, rtol=0)
    for a in leaves:
        for b in leaves:
            if a.group == b.group and a.tree_nodes[:1] == b.tree_nodes[:1] != []:
                cut = a.lines[a.tree_cuts[0]].token_span[0]
                assert a.token_ids[:cut] == b.token_ids[:cut] and a.logprobs[:cut] == b.logprobs[:cut]


@pytest.mark.parametrize("fork", [True, False], ids=["forked rows", "a session per branch point"])
def test_children_start_when_their_parent_branches_not_when_the_slowest_does(branch_model, pool, fork):
    """Problem 0 (``fast``) reaches its branch point at once; problem 1's root (``slow``) sleeps 3 s first. The fast
    tree's child asks for its first line before the slow root asks for its third (with a level barrier it could
    only start after the slow root's branch point). On HF the child is a row forked from its parent's: its shared
    prefix is copied, never fed again; without fork, each branch point's children get a session of their own."""
    trajs, metrics, gen = grow(branch_model, pool, ["fast", "slow"], TreeShape(roots=1, branch_at=(2,), width=2),
                               fork=fork)
    assert len(trajs) == 4 and metrics["tree/leaf_shortfall"] == 0 and metrics["tree/replays_diverged"] == 0
    assert all([ln.code for ln in t.lines] == SCRIPTS[["fast", "slow"][t.group]] for t in trajs)
    assert all(t.tree_nodes == [0] and t.tree_cuts == [2] and t.correct for t in trajs)
    slow_third_line = gen.first_ask(0, 1, k=2)  # main session: row g * roots + r
    if fork:
        (fast_child,) = [new for new, parent in gen.forked.items() if parent == (0, 0)]
        assert gen.first_ask(*fast_child) < slow_third_line
        assert gen.sessions == 1 and metrics["tree/child_sessions"] == 0
        # every row's cache ends holding its leaf's ids but the last sampled token; the two forked rows got their
        # prefix by copy: copied + fed = the leaves' tokens, each fed once
        assert metrics["gen_forked_rows"] == 2
        assert metrics["gen_forked_tokens"] + metrics["gen_fed_tokens"] == sum(len(t.token_ids) - 1 for t in trajs)
    else:
        assert gen.sessions == 3 and metrics["tree/child_sessions"] == 2  # the roots', then one per branch point
        fast_child_session = min(s for _, s, _ in gen.asks if s > 0)  # the fast tree branched first
        assert gen.first_ask(fast_child_session, 0) < slow_third_line
        # each leaf's row is fed its whole sequence (but the last sampled token): a child's prefix once more
        assert metrics["gen_fed_tokens"] == sum(len(t.token_ids) - 1 for t in trajs)
        assert "gen_forked_tokens" not in metrics or metrics["gen_forked_tokens"] == 0
    assert_token_exact(branch_model, trajs)


def test_children_that_fill_the_group_start_once_the_early_ends_are_known(branch_model, pool):
    """4 roots of ``coin`` branch after line 2 into 2 children; a root whose kernel exits at line 2 is a leaf there.
    The roots alive at the branch point share the missing leaves (``children_per_node``): their first children
    start at the branch point (forked rows), the extra ones once every root has branched or ended (one session of
    their own, from a copy taken at the branch point). The group keeps its 8 leaves, each token-exact."""
    shape = TreeShape(roots=4, branch_at=(2,), width=2)
    for _ in range(6):  # each root exits with probability 1/2: retry until some did and some did not
        trajs, metrics, gen = grow(branch_model, pool, ["coin"], shape)
        # the roots that ended before the branch point (the coin's exit at line 2): leaves that passed no branch
        # point. (Not "every exit": the tiny model may stray from its script, e.g. exit at line 3 after branching.)
        exited = [t for t in trajs if not t.tree_nodes]
        if 0 < len(exited) < shape.roots:
            break
    else:
        pytest.fail("the coin never split the roots in 6 trees")
    alive = shape.roots - len(exited)
    assert all(len(t.lines) <= 2 and t.end_reason != "max_lines" for t in exited)
    assert sum(t.end_reason == "exit" and len(t.lines) == 2 for t in exited) >= 1   # the coin did it
    assert len(trajs) == 8 and metrics["tree/leaf_shortfall"] == 0 and metrics["tree/branch_points"] == alive
    children = sorted(Counter(t.tree_nodes[0] for t in trajs if t.tree_nodes).values(), reverse=True)
    assert children == children_per_node(shape, 0, alive, len(exited))  # e.g. 1 exited: [3, 2, 2]
    assert metrics["gen_forked_rows"] == alive * (shape.width - 1)
    assert metrics["tree/child_sessions"] == 1 and gen.sessions == 2
    assert_token_exact(branch_model, trajs)


def test_without_fill_the_group_is_short_by_the_early_ends(branch_model, pool):
    """``tree.fill = false``: the roots alive at the branch point get ``width`` children each, no more; the leaves
    the early ends left missing are the group's shortfall, and no extra session starts."""
    shape = TreeShape(roots=4, branch_at=(2,), width=2, fill=False)
    for _ in range(6):
        trajs, metrics, gen = grow(branch_model, pool, ["coin"], shape)
        exited = [t for t in trajs if not t.tree_nodes]  # ended before the branch point
        if 0 < len(exited) < shape.roots:
            break
    else:
        pytest.fail("the coin never split the roots in 6 trees")
    alive = shape.roots - len(exited)
    assert len(trajs) == len(exited) + alive * shape.width
    assert metrics["tree/leaf_shortfall"] == shape.leaves - len(trajs) == len(exited)
    children = Counter(t.tree_nodes[0] for t in trajs if t.tree_nodes)
    assert sorted(children.values()) == [shape.width] * alive
    assert metrics["tree/child_sessions"] == 0 and gen.sessions == 1
    assert_token_exact(branch_model, trajs)


# ---------------------------------------------------------------------------------------------------------------
# The lowest_prob rule (SPO's cutpoints): branch before the line the policy was least sure of


def test_branch_line_picks_the_least_likely_first_token_after_the_last_cut():
    """Lines 0-4, one token each at ids 2..6 (a prompt of 2 tokens), first-token log-probs -0.1, -2.0, -0.5, -3.0,
    -0.2; line 3 was typed at a "..." prompt (inside a block: no branch point there)."""
    logprobs = [0.0, 0.0, -0.1, -2.0, -0.5, -3.0, -0.2]
    lines = [Line(code=f"x{k}", token_span=(2 + k, 3 + k), prompt="... " if k == 3 else ">>> ") for k in range(5)]
    traj = Trajectory(token_ids=list(range(7)), loss_mask=[0, 0] + [1] * 5, logprobs=logprobs, prompt_len=2,
                      text="", lines=lines)
    assert branch_line(traj, "fixed") == 5  # the next line
    assert branch_line(traj, "lowest_prob") == 1  # -2.0; line 0 is never a cut, line 3 (-3.0) is inside a block
    traj.tree_cuts = [1]
    assert branch_line(traj, "lowest_prob") == 2  # after the cut at 1: lines 2 (-0.5) and 4 (-0.2)
    traj.tree_cuts = [4]
    assert branch_line(traj, "lowest_prob") == 5  # nothing after line 4 qualifies: here


def test_branch_rule_is_checked():
    with pytest.raises(ConfigError, match="branch_rule"):
        resolve(Config, None, {"tree": {"branch_rule": "highest"}})
    cfg = resolve(Config, None, {"tree": {"branch_at": [3], "branch_rule": "lowest_prob"},
                                 "rollout": {"group_size": 4}})
    assert TreeShape.from_config(cfg.tree).rule == "lowest_prob"


def test_lowest_prob_children_sample_the_least_sure_line_again(branch_model, pool):
    """``fast`` branches when it has run 3 lines, before line 1 or 2, whichever first token was less likely. The
    copy's context is the parent's up to that line's first token (a prefix of the parent's row, forked: its cache's
    first columns copied), it replays the lines before it and samples that line again."""
    shape = TreeShape(roots=1, branch_at=(3,), width=2, rule="lowest_prob")
    trajs, metrics, gen = grow(branch_model, pool, ["fast"], shape)
    parent, child = trajs  # tree order: the parent went on as child 0
    cut = min((1, 2), key=lambda j: parent.logprobs[parent.lines[j].token_span[0]])
    assert parent.tree_cuts == child.tree_cuts == [cut] and parent.tree_nodes == child.tree_nodes == [0]
    assert metrics["tree/cut_lines_back"] == 3 - cut and metrics["tree/replays"] == 1
    start = parent.lines[cut].token_span[0]
    assert child.token_ids[:start] == parent.token_ids[:start] and child.lines[cut].token_span[0] == start
    assert all([ln.code for ln in t.lines] == SCRIPTS["fast"] and t.correct for t in trajs)
    # the child's row got the prefix but its last token by copy, and fed the rest: each token fed once
    assert metrics["gen_forked_rows"] == 1 and metrics["gen_forked_tokens"] == start - 1
    assert metrics["gen_forked_tokens"] + metrics["gen_fed_tokens"] == sum(len(t.token_ids) - 1 for t in trajs)
    assert_token_exact(branch_model, trajs)
