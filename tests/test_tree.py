"""Tree rollouts: replay into a fresh kernel (ReplSession.replay), the ``tree`` estimator, the tree's shape and config.

The estimator tests are pure functions on hand-built trajectories (the worked example of docs/tree-rollouts.md, the
equivalence with ``outcome`` without branch points). The tree rollouts themselves are tested in tests/test_rollout.py
beside the flat ones, with the same scripted model and real kernels: every leaf token-exact, masks on sampled tokens
only, log-probs equal to a plain forward pass, shared prefixes, a diverging replay counted, an early end a leaf;
tests/test_tree_branching.py checks that children start when their parent branches (no level barrier), on rows
forked from its KV cache or in sessions of their own, and the children that fill a group.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import pytest
import torch

from replrl.advantages import batch_tensors, compute_advantages, line_advantage_stats
from replrl.backends.hf import HFGenerator
from replrl.config import Config, RewardConfig
from replrl.configlib import ConfigError, resolve
from replrl.models import load_tokenizer, tiny_model
from replrl.repl import ReplSession
from replrl.rewards import RewardModel
from replrl.rollout import Env, EpisodeRules, TreeShape, children_per_node, rollout, summarize
from replrl.types import Line, SamplingParams, Trajectory
from sandbox import run_sync
from tests.scripted import ScriptTask, script_sequences, teach_scripts

pytestmark = pytest.mark.timeout(600)
RULES = EpisodeRules(max_output_tokens=40, max_repeats=3, state_digest=False, max_lines=8, max_total_tokens=400)
SAMPLING = SamplingParams(temperature=0.3, max_line_tokens=20, seed=1)

TREE_SCRIPTS: dict[str, list[Any]] = {
    "steady": ["a = 2", "b = a * 3", "b", "c = b + 1", "d = c * 2", "submit(d)"],
    "dice": ["import random", "random.random()", "x = 3", "y = x + 1", "submit(y)"],
    "quick": ["submit(5)"],
}
TREE_ANSWERS = {"steady": 14, "dice": 4, "quick": 5}


@dataclasses.dataclass
class TreeScriptTask(ScriptTask):
    name: ClassVar[str] = "tree_scripts"

    def answer_of(self, row: dict) -> Any:
        return TREE_ANSWERS[row["script"]]

    def check(self, row: dict, submitted: Any) -> bool:
        return submitted == TREE_ANSWERS[row["script"]]


# ---------------------------------------------------------------------------------------------------------------
# The estimator (pure functions)


def leaf(group: int, reward: float, nodes: list[int], cuts: list[int], n_lines: int = 4, diverged: bool = False,
         line_reward: float = 0.0) -> Trajectory:
    """A finished leaf with ``n_lines`` one-token lines (token ids 10.., prompt of 2 tokens) and outcome ``reward``."""
    ids = [1, 2] + [10 + k for k in range(n_lines)]
    lines = [Line(code=f"x{k}", token_span=(2 + k, 3 + k), rewards={"t": line_reward}) for k in range(n_lines)]
    return Trajectory(token_ids=ids, loss_mask=[0, 0] + [1] * n_lines, logprobs=[0.0] * len(ids), prompt_len=2,
                      text="", lines=lines, group=group, outcome_rewards={"correct": reward}, tree_nodes=nodes,
                      tree_cuts=cuts, tree_diverged=diverged)


def line_advantages_of(adv: torch.Tensor, batch: dict[str, torch.Tensor]) -> list[list[float]]:
    """The advantage of each line (its one token) per episode."""
    return [[float(adv[i, t]) for t in range(adv.shape[1]) if batch["loss_mask"][i, t]] for i in range(len(adv))]


def test_worked_example_of_the_docs():
    """docs/tree-rollouts.md, "A worked example": 2 roots branching once after line 2 into 2 children each.
    Root 1 reached node A, root 2 node B; under A one leaf is correct (1) and one wrong (0), under B both are wrong.
    Group mean m = 0.25; V(A) = 0.5, V(B) = 0. Lines 0-1 lead root -> A or B, lines 2-3 A or B -> the leaf."""
    group = [leaf(0, 1.0, [0], [2]), leaf(0, 0.0, [0], [2]), leaf(0, 0.0, [1], [2]), leaf(0, 0.0, [1], [2])]
    batch = batch_tensors(group, pad_id=0)
    tree = line_advantages_of(compute_advantages("tree", batch, scale="none"), batch)
    assert tree == [[0.25, 0.25, 0.5, 0.5],      # a1: V(A) - m = 0.25, then 1 - V(A) = 0.5
                    [0.25, 0.25, -0.5, -0.5],    # a2: the lines into A still helped; its own last ones did not
                    [-0.25, -0.25, 0.0, 0.0],    # b1: B was worse than average; from B, no leaf did better
                    [-0.25, -0.25, 0.0, 0.0]]    # b2
    outcome = line_advantages_of(compute_advantages("outcome", batch, scale="none"), batch)
    assert outcome == [[0.75] * 4, [-0.25] * 4, [-0.25] * 4, [-0.25] * 4]
    # scale="std": the same numbers divided by the group's std of R (population: sqrt(0.1875) = 0.4330)
    std = compute_advantages("tree", batch, scale="std")
    torch.testing.assert_close(std, compute_advantages("tree", batch, scale="none") / (0.1875 ** 0.5 + 1e-6))
    # every leaf's segments add up to its outcome advantage (R_i - m)
    assert [sum(x) / 2 for x in tree] == [0.75, -0.25, -0.25, -0.25]


def test_without_branch_points_tree_equals_outcome_exactly():
    """Flat groups (no tree_nodes): bit-identical to the outcome estimator, line rewards included, both scales,
    with mixing too."""
    g = torch.Generator().manual_seed(0)
    trajs = [leaf(i // 4, float(torch.rand(1, generator=g)), [], [], n_lines=1 + i % 3,
                  line_reward=float(torch.randn(1, generator=g))) for i in range(12)]
    batch = batch_tensors(trajs, pad_id=0)
    for scale in ("std", "none"):
        expected = compute_advantages("outcome", batch, scale=scale)
        for weight in (1.0, 0.3):
            assert torch.equal(compute_advantages("tree", batch, scale=scale, tree_weight=weight), expected)
    assert line_advantage_stats(expected, batch)["adv/line_spread"] == 0.0


def test_a_diverged_leaf_gets_its_outcome_and_counts_in_no_node():
    """Under A: a1 = 1, a2 = 0 but a2's replay diverged. V(A) is then a1's alone (1); a2 gets its outcome advantage
    on every line, as in a flat group."""
    group = [leaf(0, 1.0, [0], [2]), leaf(0, 0.0, [0], [2], diverged=True), leaf(0, 0.0, [1], [2]),
             leaf(0, 0.0, [1], [2])]
    batch = batch_tensors(group, pad_id=0)
    assert batch["tree_credit"].tolist() == [True, False, True, True]
    tree = line_advantages_of(compute_advantages("tree", batch, scale="none"), batch)
    assert tree == [[0.75, 0.75, 0.0, 0.0], [-0.25] * 4, [-0.25, -0.25, 0.0, 0.0], [-0.25, -0.25, 0.0, 0.0]]


def test_two_groups_and_two_levels_keep_their_nodes_apart():
    """Node ids are per group: node 0 of group 0 and node 0 of group 1 are different nodes."""
    trajs = [leaf(0, 1.0, [0, 1], [1, 3]), leaf(0, 0.0, [0, 1], [1, 3]), leaf(0, 0.0, [0, 2], [1, 3]),
             leaf(0, 0.0, [0, 2], [1, 3]), leaf(1, 0.0, [0], [2]), leaf(1, 1.0, [0], [2])]
    batch = batch_tensors(trajs, pad_id=0)
    tree = line_advantages_of(compute_advantages("tree", batch, scale="none"), batch)
    # group 0: m = 0.25, V(0) = 0.25 (all four under it), V(1) = 0.5, V(2) = 0
    assert tree[0] == [0.0, 0.25, 0.25, 0.5] and tree[2] == [0.0, -0.25, -0.25, 0.0]
    # group 1: m = 0.5 = V(0): the shared first lines get 0, the last ones +-0.5
    assert tree[4] == [0.0, 0.0, -0.5, -0.5] and tree[5] == [0.0, 0.0, 0.5, 0.5]


def test_children_per_node_fills_the_group_at_the_last_branch_point():
    shape = TreeShape(roots=2, branch_at=(2, 4), width=2)
    assert shape.leaves == 8
    assert children_per_node(shape, 0, 2, 0) == [2, 2]
    assert children_per_node(shape, 1, 4, 0) == [2, 2, 2, 2]
    # one root ended before line 2 (1 leaf): its 3 children alive at line 4 share the 7 missing leaves
    assert children_per_node(shape, 1, 2, 1) == [4, 3]
    assert children_per_node(shape, 1, 1, 5) == [3]
    assert children_per_node(shape, 1, 0, 2) == []
    unfilled = TreeShape(roots=2, branch_at=(2, 4), width=2, fill=False)
    assert children_per_node(unfilled, 1, 2, 1) == [2, 2]      # 1 + 4 leaves: the group is 3 short
    assert children_per_node(unfilled, 0, 2, 0) == [2, 2]


def test_tree_config_validates_and_parses_from_the_command_line():
    cfg = resolve(Config, None, {"tree": {"branch_at": "[2, 4]", "roots": "2", "width": "2"},
                                 "rollout": {"group_size": "8"}})
    assert cfg.tree.branch_at == [2, 4] and cfg.tree.leaves == 8
    with pytest.raises(ConfigError, match="group_size"):
        resolve(Config, None, {"tree": {"branch_at": [2, 4]}, "rollout": {"group_size": 4}})
    with pytest.raises(ConfigError, match="increasing"):
        resolve(Config, None, {"tree": {"branch_at": [4, 2]}})
    # trees and dynamic sampling combine (tests/test_dynamic_sampling_tree.py)
    both = resolve(Config, None, {"tree": {"branch_at": [2, 4]},
                                  "rollout": {"group_size": 8, "dynamic_sampling": True}})
    assert both.rollout.dynamic_sampling and both.tree.leaves == 8
    assert resolve(Config, None, {}).tree.branch_at == []  # off by default


# ---------------------------------------------------------------------------------------------------------------
# Replay (real kernels)


def test_replay_rebuilds_the_state_and_detects_divergence(pool):
    async def go():
        async_pool = pool.pool  # the session's SyncKernelPool (conftest) wraps an asyncio KernelPool
        async with async_pool.acquire() as k1, async_pool.acquire() as k2, async_pool.acquire() as k3:
            original = ReplSession(k1, banner="")
            recorded = []
            for code in ["x = 41", "import random", "x + 1", "random.random()"]:
                step = await original.feed(code)
                recorded.append((code, step.output))
            same = ReplSession(k2, banner="")
            rep = await same.replay(recorded[:3])
            after = await same.feed("x")
            other = ReplSession(k3, banner="")
            diverged = await other.replay(recorded)
            return rep, after.output, diverged

    rep, x, diverged = run_sync(go())
    assert not rep.diverged and rep.lines == 3 and x == "41\n"
    assert diverged.diverged_at == 3 and diverged.diverged


# ---------------------------------------------------------------------------------------------------------------
# Wiring: config -> trainer -> tree rollout -> tree estimator -> metrics


def test_a_trainer_step_with_trees_logs_the_tree_figures(format_model_dir, tmp_path):
    """The format model submits at its first line, before the branch point after line 1: each tree is its 2 roots
    (2 leaves short of 4, logged), and a step trains on them with the tree estimator."""
    from replrl.metrics import read_metrics
    from replrl.trainer import Trainer

    cfg = resolve(Config, None, {
        "model": {"name": str(format_model_dir), "chat_template": False},
        "task": {"name": "tests.toy:EchoTask"},
        "rollout": {"group_size": 4, "problems_per_step": 2, "max_lines": 3, "max_line_tokens": 12,
                    "max_total_tokens": 256, "wall_s": 2.0, "temperature": 1.0},
        "tree": {"roots": 2, "branch_at": [1], "width": 2},
        "advantages": {"estimator": "tree"},
        "optim": {"lr": 1e-3, "micro_batch": 8},
        "run": {"max_steps": 1, "save_every": 0, "log_samples_every": 0, "eval_n": 0,
                "time_budget_min": 0},
    })
    Trainer(cfg, tmp_path / "run", progress=False).train()
    (row,) = read_metrics(tmp_path / "run")
    assert row["episodes"] == 4 and row["tree/leaf_shortfall"] == 4 and row["tree/branch_points"] == 0
    assert row["tree/generated_vs_leaf_tokens"] == 1.0  # nothing shared: every token sampled once per leaf
    assert row["adv/line_spread"] == 0.0  # one line per leaf: one advantage per episode


# ---------------------------------------------------------------------------------------------------------------
# A replay that diverges, in a real tree rollout (a tiny model that memorised one script)

DICE = {"dice": ["import random", "random.random()", "x = 3", "submit(x)"]}
"""Line 2 prints a new random number in every kernel: a copy's replay of it prints another one."""


class DiceTask(ScriptTask):
    def answer_of(self, row: dict) -> Any:
        return 3

    def check(self, row: dict, submitted: Any) -> bool:
        return submitted == 3


class SeededDiceTask(DiceTask):
    """The same problem, with a per-problem setup that seeds ``random`` in the kernel before the first line."""

    def setup(self, row: dict) -> str:
        return "import random\nrandom.seed(7)\n"


@pytest.fixture(scope="module")
def dice_model(pool):
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    model = tiny_model(tokenizer, seed=1, hidden_size=64, intermediate_size=128)
    teach_scripts(model, tokenizer, script_sequences(tokenizer, pool.pool, 40, DiceTask(DICE)))
    return model, tokenizer


def dice_tree(dice_model, pool, task: DiceTask) -> tuple[list[Trajectory], dict[str, float]]:
    model, tokenizer = dice_model
    rules = EpisodeRules(40, 3, state_digest=True, max_lines=6, max_total_tokens=300)
    env = Env(HFGenerator(model, tokenizer), pool.pool, task, rules, RewardModel(RewardConfig().weights),
              chat_template=False)
    trajs, stats = run_sync(rollout(env, list(enumerate(task.rows("x"))), SAMPLING,
                                    tree=TreeShape(roots=1, branch_at=(2,), width=2)))
    # both leaves share the first two lines and the branch point after them (what follows the printed random number
    # is the tiny model's guess: its teaching transcript printed another number)
    assert len(trajs) == 2 and all([ln.code for ln in t.lines[:2]] == DICE["dice"][:2] for t in trajs)
    assert all(t.tree_nodes == [0] and t.tree_cuts == [2] and len(t.lines) > 2 for t in trajs)
    return trajs, summarize(trajs, stats)


def test_a_replay_that_prints_something_else_is_counted_and_its_branch_gets_no_tree_credit(dice_model, pool):
    trajs, metrics = dice_tree(dice_model, pool, DiceTask(DICE))
    # the parent went on with its own kernel; its copy replayed `random.random()` and printed another number
    assert [t.tree_diverged for t in trajs].count(True) == 1
    assert metrics["tree/replays"] == 1 and metrics["tree/replays_diverged"] == 1
    batch = batch_tensors(trajs, 0)
    assert batch["tree_credit"].tolist() == [not t.tree_diverged for t in trajs]


def test_the_task_setup_runs_again_before_a_replay(dice_model, pool):
    """With ``random`` seeded by the task's setup, the copy's kernel (setup, then the replayed lines) prints the same
    number as its parent's: no divergence. Without the setup in the copy's kernel it would print another."""
    trajs, metrics = dice_tree(dice_model, pool, SeededDiceTask(DICE))
    assert metrics["tree/replays"] == 1 and metrics["tree/replays_diverged"] == 0
    assert not any(t.tree_diverged for t in trajs)
    assert all(t.timing["setup_s"] > 0 for t in trajs)  # the copy's own setup, timed apart
    # the first line after the branch starts from the same namespace digest in the parent and in its copy
    assert trajs[0].lines[2].state == trajs[1].lines[2].state != ""
