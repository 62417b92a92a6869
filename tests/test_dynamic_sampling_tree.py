"""Dynamic sampling with tree rollouts: a tree group is kept when its leaves' signal is not all equal.

The pure parts on hand-built lists (groups split where the id changes, a short tree counted by its leaves, the
waves' tree figures merged); the trainer on a tiny model that types ``x = 0`` and then ``submit(k)`` with k in 1-4
at random, ignoring the question, with real kernels. Branching after line 1 (``branch_at = [1]``, 2 roots of 2
children) gives trees of 4 leaves that differ only after the branch point; branching after line 2 comes after the
submit, so every tree is its 2 roots (2 leaves short of 4). ``EchoTask(digits=(1, 7))``: a tree asking for 7 never
has a contrast (the model never types 7), one asking for 1 usually does.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest

from replrl.config import Config
from replrl.configlib import resolve
from replrl.draw import ProblemStream
from replrl.dynamic_sampling import WaveRecord, group_has_contrast, wave_metrics
from replrl.metrics import read_metrics
from replrl.rollout import RolloutStats, merge_tree_figures, merge_wave_stats, split_by_group
from replrl.trainer import StepResult, Trainer
from replrl.types import Trajectory
from tests.scripted import ScriptTask, script_sequences, teach_scripts
from tests.test_dynamic_sampling import train

pytestmark = pytest.mark.timeout(600)

QUESTIONS = (1, 2, 3, 4, 7)
"""The numbers EchoTask questions may ask for (the model ignores them: each is taught every k)."""


class TwoLineTask(ScriptTask):
    """Teaching material only: for each question "Submit d." and each k in 1-4, the script ``x = 0; submit(k)``."""

    def rows(self, split: str) -> list[dict]:
        return [{"question": f"Submit {d}.", "script": f"{d}:{k}"} for d in QUESTIONS for k in (1, 2, 3, 4)]


@pytest.fixture(scope="module")
def two_line_model_dir(pool, tmp_path_factory) -> Path:
    """A tiny Llama that writes ``x = 0``, then ``submit(k)`` with k uniform in 1-4, saved like a local model."""
    from replrl.models import load_tokenizer, tiny_model

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    task = TwoLineTask({f"{d}:{k}": ["x = 0", f"submit({k})"] for d in QUESTIONS for k in (1, 2, 3, 4)})
    seqs = script_sequences(tokenizer, pool.pool, 40, task)
    # k is random, so its loss never falls under teach_scripts' bar: fixed steps, then a few at a lower rate, which
    # even out the last batches' pull towards one k (0.16-0.49 per k after the first phase alone, 0.22-0.26 after)
    model = teach_scripts(tiny_model(tokenizer, seed=0), tokenizer, seqs, steps=120)
    model = teach_scripts(model, tokenizer, seqs, steps=60, lr=3e-4)
    path = tmp_path_factory.mktemp("two-line-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tree_config(model_dir: Path, branch_at: list[int], **rollout_opts: Any) -> Config:
    return resolve(Config, None, {
        "model": {"name": str(model_dir), "chat_template": False},
        "task": {"name": "tests.toy:EchoTask", "options": {"digits": [1, 7]}},
        "rollout": {"group_size": 4, "problems_per_step": 2, "max_lines": 3, "max_line_tokens": 12,
                    "max_total_tokens": 256, "wall_s": 2.0, "temperature": 1.0, "dynamic_sampling": True,
                    "dynamic_sampling_extra_waves": 4, **rollout_opts},
        "tree": {"roots": 2, "branch_at": branch_at, "width": 2},
        "advantages": {"estimator": "tree"},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "micro_batch": 8},
        "run": {"max_steps": 1, "save_every": 1, "log_samples_every": 0, "eval_n": 0,
                "time_budget_min": 0},
    })


def leaf(group: int, outcome: float = 0.0) -> Trajectory:
    return Trajectory(token_ids=[1], loss_mask=[1], logprobs=[0.0], prompt_len=0, text="", group=group,
                      outcome_rewards={"correct": outcome})


# -- the pure parts ------------------------------------------------------------------------------------------------

def test_groups_are_split_where_the_group_id_changes():
    # a rollout's trees of 2, 4 and 2 leaves (the first and last fell short of group_size 4)
    trajs = [leaf(0, 1.0), leaf(0), leaf(1), leaf(1), leaf(1), leaf(1), leaf(2), leaf(2)]
    groups = split_by_group(trajs)
    assert [len(g) for g in groups] == [2, 4, 2] and [g[0].group for g in groups] == [0, 1, 2]
    assert [group_has_contrast(g) for g in groups] == [True, False, False]
    assert split_by_group([]) == []


def test_wave_figures_count_a_short_tree_by_its_leaves():
    # the worked example of docs/dynamic-sampling.md (trees). Wave 1 (30 s): tree A, short (2 leaves), with a
    # contrast: kept; tree B, 4 leaves, without: dropped (4 of the wave's 6 leaves -> 20 s). Wave 2 (20 s): trees C
    # and D, both with a contrast; C is kept, D not needed (4 of 8 leaves -> 10 s). 14 leaves for 2 kept trees.
    waves = [WaveRecord([True, False], 30.0, [2, 4]), WaveRecord([True, True], 20.0, [4, 4])]
    m = wave_metrics(waves, kept=[0, 2], group_size=4, bound_reached=False)
    assert m == {"dynsamp/waves": 2.0, "dynsamp/groups_drawn": 4.0, "dynsamp/groups_kept": 2.0,
                 "dynsamp/discarded_rollout_s": pytest.approx(30.0), "dynsamp/bound_reached": 0.0,
                 "dynsamp/short_groups_kept": 1.0, "dynsamp/episodes_per_kept_group": 7.0}


def test_the_waves_tree_figures_are_summed_and_their_ratios_recomputed():
    # wave 1: 8 leaves holding 20 tokens each, 10 of them sampled by the leaf itself; 4 replays of 12 lines in all
    # at 5 ms a line; 6 branch points, cut 0.5 lines back on average.
    # wave 2: 2 leaves (a short tree) of 30 tokens, all sampled; no replay, no branch point.
    one = RolloutStats(wall_s=10.0, model_tokens=80, extra={
        "tree/branch_points": 6.0, "tree/replays": 4.0, "tree/leaf_shortfall": 0.0, "tree/replay_ms_per_line": 5.0,
        "tree/generated_tokens_per_leaf": 10.0, "tree/leaf_tokens_per_leaf": 20.0, "tree/cut_lines_back": 0.5,
        "tree/generated_vs_leaf_tokens": 0.5, "tree/leaves": 8.0, "tree/replayed_lines": 12.0,
        "gen_max_step_tokens": 100.0, "gen_steps": 7.0})
    two = RolloutStats(wall_s=3.0, model_tokens=60, extra={
        "tree/branch_points": 0.0, "tree/replays": 0.0, "tree/leaf_shortfall": 2.0, "tree/replay_ms_per_line": 0.0,
        "tree/generated_tokens_per_leaf": 30.0, "tree/leaf_tokens_per_leaf": 30.0, "tree/cut_lines_back": 0.0,
        "tree/generated_vs_leaf_tokens": 1.0, "tree/leaves": 2.0, "tree/replayed_lines": 0.0,
        "gen_max_step_tokens": 300.0, "gen_steps": 2.0})
    merged = merge_wave_stats([(one, 8), (two, 2)])
    assert merged.wall_s == 13.0 and merged.model_tokens == 140
    # counts add up; the largest step is the largest of the two
    assert merged.extra["tree/branch_points"] == 6 and merged.extra["tree/replays"] == 4
    assert merged.extra["tree/leaf_shortfall"] == 2 and merged.extra["gen_steps"] == 9
    assert merged.extra["tree/leaves"] == 10 and merged.extra["tree/replayed_lines"] == 12
    assert merged.extra["gen_max_step_tokens"] == 300
    # 80 + 60 = 140 tokens sampled over 10 leaves; 160 + 60 = 220 held; the only replays and branch points were
    # wave 1's (a ratio is not summed: 0.5 lines cut back stays 0.5)
    assert merged.extra["tree/generated_tokens_per_leaf"] == pytest.approx(14.0)
    assert merged.extra["tree/leaf_tokens_per_leaf"] == pytest.approx(22.0)
    assert merged.extra["tree/generated_vs_leaf_tokens"] == pytest.approx(140 / 220)
    assert merged.extra["tree/replay_ms_per_line"] == pytest.approx(5.0)
    assert merged.extra["tree/cut_lines_back"] == pytest.approx(0.5)
    # one wave: unchanged
    assert merge_wave_stats([(one, 8)]).extra == pytest.approx(one.extra)


def test_every_rank_s_tree_figures_merge_as_one_rollout_s():
    """The ranks' shares of a step (what the trainer gathers under accelerate): replay time weighted by replayed
    lines, cut-back by branch points, tokens by leaves; a rollout without trees adds nothing."""
    rank0 = {"tree/replays": 1.0, "tree/replayed_lines": 1.0, "tree/replay_ms_per_line": 10.0, "tree/leaves": 4.0,
             "tree/branch_points": 1.0, "tree/cut_lines_back": 2.0, "tree/generated_tokens_per_leaf": 5.0}
    rank1 = {"tree/replays": 1.0, "tree/replayed_lines": 3.0, "tree/replay_ms_per_line": 2.0, "tree/leaves": 4.0,
             "tree/branch_points": 3.0, "tree/cut_lines_back": 0.0, "tree/generated_tokens_per_leaf": 9.0}
    merged = merge_tree_figures([(rank0, 4), (rank1, 4)])
    assert merged["tree/replay_ms_per_line"] == pytest.approx((10 + 3 * 2) / 4)  # 16 ms over 4 replayed lines
    assert merged["tree/cut_lines_back"] == pytest.approx(2 / 4)  # 2 lines over 4 branch points
    assert merged["tree/generated_tokens_per_leaf"] == pytest.approx(7.0)
    assert merged["tree/leaves"] == 8 and merged["tree/replays"] == 2 and merged["tree/branch_points"] == 4
    assert merge_tree_figures([({"gen_steps": 3.0}, 8)]) == {}


# -- the trainer ---------------------------------------------------------------------------------------------------

def check_tree_step(row: dict, result: StepResult) -> None:
    """A step's figures and kept groups, for trees that all branched at line 1 into 4 leaves."""
    drawn, kept = int(row["dynsamp/groups_drawn"]), int(row["dynsamp/groups_kept"])
    assert drawn == 2 * row["dynsamp/waves"] and (kept == 2 or row["dynsamp/bound_reached"] == 1)
    # every tree branched at line 1 into 4 leaves: the figures are the trees' of every wave, summed
    assert row["episodes"] == 4 * drawn and row["tree/leaf_shortfall"] == 0
    assert row["tree/branch_points"] == 2 * drawn and row["tree/replays"] == 2 * drawn  # a copy per root
    assert row["tree/generated_tokens_per_leaf"] < row["tree/leaf_tokens_per_leaf"]    # line 1 sampled once
    assert 0.5 < row["tree/generated_vs_leaf_tokens"] < 1  # a ratio over all waves (summed, it would pass 1)
    assert row["dynsamp/short_groups_kept"] == 0
    assert 0 <= row["dynsamp/discarded_rollout_s"] < row["rollout_s"]
    groups = split_by_group(result.trajectories)
    assert len(groups) == max(kept, 1) and (not kept or all(group_has_contrast(g) for g in groups))
    if kept:
        assert row["dynsamp/episodes_per_kept_group"] == pytest.approx(4 * drawn / kept)
    for k, g in enumerate(groups):  # whole trees (one problem, both branch points), renumbered in the order kept
        assert len(g) == 4 and {t.group for t in g} == {k} and len({t.row for t in g}) == 1
        assert len({tuple(t.tree_nodes) for t in g}) == 2 and all(len(t.tree_nodes) == 1 for t in g)


def test_tree_groups_are_kept_when_their_leaves_differ_and_a_resumed_run_draws_the_same_problems(two_line_model_dir,
                                                                                              tmp_path):
    cfg = tree_config(two_line_model_dir, branch_at=[1])
    _, (first,) = train(cfg, tmp_path / "run")
    (row,) = read_metrics(tmp_path / "run")
    check_tree_step(row, first)
    assert row["dynsamp/waves"] > 1, "the seed was picked so that the first wave is not enough"
    assert row["dynsamp/discarded_rollout_s"] > 0
    position = row["data_position"]
    assert position == 2 * row["dynsamp/waves"]

    cfg.run.max_steps = 2
    resumed = Trainer(cfg, tmp_path / "run", resume=True, progress=False)
    assert resumed.step == 1 and resumed.drawer.problems.position == position  # the stream goes on where it stopped
    results: list[StepResult] = []
    resumed.train(on_step=results.append)
    (second,) = results
    again = read_metrics(tmp_path / "run")[1]
    check_tree_step(again, second)
    # its waves come from the same seeded stream, in order: its trees are problems of the next 2 x waves positions
    # (tokens are not compared with a straight run's step 2: float rounding of step 1's update can flip a token, and
    # with it the waves; see test_dynamic_sampling.py)
    drawn = ProblemStream(resumed.train_rows, cfg.run.seed, position=position).take(2 * int(again["dynsamp/waves"]))
    assert again["data_position"] == position + len(drawn)
    assert {t.row for t in second.trajectories} <= {i for i, _ in drawn}


def test_a_tree_short_of_leaves_is_kept_with_the_leaves_it_has(two_line_model_dir, tmp_path):
    # The branch point after line 2 comes after the submit: a tree is its 2 roots, 2 leaves short of 4, unless a
    # root wrote something else at line 2 (temperature 1 now and then picks another token): then it branches and
    # the group has 3 or 4 leaves. A step can hold trees of several sizes; each is judged on the leaves it has.
    _, (result,) = train(tree_config(two_line_model_dir, branch_at=[2]), tmp_path / "run")
    (row,) = read_metrics(tmp_path / "run")
    drawn, kept = int(row["dynsamp/groups_drawn"]), int(row["dynsamp/groups_kept"])
    episodes = int(row["episodes"])  # every leaf drawn
    assert 2 * drawn <= episodes < 4 * drawn and row["tree/leaf_shortfall"] == 4 * drawn - episodes
    assert kept == 2, "the seed was picked so that the bound is not reached"
    assert row["dynsamp/episodes_per_kept_group"] == pytest.approx(episodes / kept)  # leaves, not group_size
    groups = split_by_group(result.trajectories)
    assert len(groups) == kept and [{t.group for t in g} for g in groups] == [{0}, {1}]
    assert all(group_has_contrast(g) and len({t.row for t in g}) == 1 for g in groups)
    assert row["dynsamp/short_groups_kept"] == sum(len(g) < 4 for g in groups) >= 1, "the seed: a short tree kept"
    # the short tree trains with the leaves it has (one right, one wrong): its advantages are not zero
    assert any(len(g) == 2 and sorted(bool(t.correct) for t in g) == [False, True] for g in groups)
    assert row["backward_skipped_frac"] < 1


def test_without_dynamic_sampling_short_trees_are_counted_by_their_own_leaves(two_line_model_dir, tmp_path):
    # groups_with_contrast (logged with dynamic sampling off too) groups leaves by their tree, not every group_size
    # episodes: three trees of 2 leaves are three groups (split every 4 episodes, 6 leaves were an error)
    cfg = tree_config(two_line_model_dir, branch_at=[2], dynamic_sampling=False, problems_per_step=3)
    _, (result,) = train(cfg, tmp_path / "run")
    (row,) = read_metrics(tmp_path / "run")
    trees: dict[int, list[Trajectory]] = {}
    for t in result.trajectories:
        trees.setdefault(t.group, []).append(t)
    assert len(trees) == 3 and row["episodes"] == len(result.trajectories) == 6 and row["data_position"] == 3
    assert all(len({t.row for t in g}) == 1 for g in trees.values())
    assert row["groups_with_contrast"] == sum(group_has_contrast(g) for g in trees.values())
    assert not any(k.startswith("dynsamp/") for k in row)


def test_two_processes_draw_their_tree_waves_alone_and_keep_trees_whole(two_line_model_dir, tmp_path):
    """``accelerate launch`` with 2 CPU processes: each rolls out its share of a wave's trees and draws waves until
    it holds its share of trees with a contrast (no collective while drawing); the learner's agreement gathers every
    tree's leaves for the figures and moves both streams to the furthest rank's position; trees are kept whole."""
    from tests.test_multiprocess import launch

    run = tmp_path / "run"
    args = ("--run-dir", str(run), "--run.eval_n", "0", "--model.name", str(two_line_model_dir),
            "--model.chat_template", "false", "--task.name", "tests.toy:EchoTask", "--rollout.max_lines", "3",
            "--rollout.max_line_tokens", "12", "--rollout.temperature", "1.0", "--rollout.dynamic_sampling",
            "true", "--rollout.dynamic_sampling_extra_waves", "3", "--tree.branch_at", "[1]",
            "--advantages.estimator", "tree")

    def rank1_lines(done) -> str:  # a failing rank's own lines (the other's are a barrier's "connection closed")
        return "\n".join(ln for ln in done.stderr.splitlines() if "[rank1]" in ln)[-2500:]

    done = launch(*args)
    if done.returncode != 0:
        # Failed once in three clean-clone suite runs (2026-11-25: rank 1 exited with 1 under the suite's load; its
        # error was cut from the report, and 3 + 16 runs alone or beside other tests passed). Until it is found: the
        # failure is reported as a warning with rank 1's lines, and the launch is run once more from scratch.
        warnings.warn(f"2-process tree/dynamic-sampling launch failed once, retrying:\n{rank1_lines(done)}",
                      stacklevel=1)
        shutil.rmtree(run, ignore_errors=True)
        done = launch(*args)
    assert done.returncode == 0, rank1_lines(done) + done.stderr[-1500:]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2], "only the main process writes metrics"
    waves = 0
    for r in rows:  # the step's waves are the furthest rank's; a rank that stopped earlier drew fewer trees
        waves += r["dynsamp/waves"]
        assert r["data_position"] == 2 * waves
        assert r["dynsamp/waves"] < r["dynsamp/groups_drawn"] <= 2 * r["dynsamp/waves"]
        assert r["dynsamp/groups_kept"] == 2 or r["dynsamp/bound_reached"] == 1
        assert r["episodes"] == 4 * r["dynsamp/groups_drawn"]  # every tree of both ranks, 4 leaves each
        assert r["rank_weight_drift"] == 0.0, "the ranks' weights diverged"
        assert r["tree/leaves"] == r["episodes"], "the tree figures are every rank's, not the main process's"
    # the samples of each step: the first leaf of the first two trees drawn (one per problem)
    samples = [json.loads(s) for s in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all(s["tree_nodes"] for s in samples)
