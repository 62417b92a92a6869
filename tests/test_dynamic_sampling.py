"""Dynamic sampling: groups with nothing to learn are replaced before the update.

The pure parts (which groups have a contrast, which a step keeps, the step's figures) on small lists worked out by
hand; the trainer on the tiny format model (it types ``submit(k)`` with k in 1-4 at random, ignoring the question)
with real kernels. ``EchoTask(digits=(7,))`` asks for a number the model never types: every group is all wrong, so
no group has a contrast; with digits (1, 7) about two groups in three asking for 1 have one, none asking for 7.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replrl.config import Config
from replrl.configlib import ConfigError, resolve
from replrl.draw import Drawn, ProblemStream, Waves, agree, merge_waves
from replrl.dynamic_sampling import (
    WaveRecord,
    check_signal,
    group_has_contrast,
    has_contrast,
    screening_wave,
    select_groups,
    wave_metrics,
)
from replrl.metrics import read_metrics
from replrl.rollout import RolloutStats, rollout, split_by_group
from replrl.trainer import StepResult, Trainer
from replrl.types import Trajectory
from sandbox import KernelPool, run_sync


def toy(model_dir: Path, digits: tuple[int, ...] = (1, 2, 3, 4), **rollout_opts: object) -> Config:
    return resolve(Config, None, {
        "model": {"name": str(model_dir), "chat_template": False},
        "task": {"name": "tests.toy:EchoTask", "options": {"digits": list(digits)}},
        "rollout": {"group_size": 4, "problems_per_step": 2, "max_lines": 3, "max_line_tokens": 12,
                    "max_total_tokens": 256, "wall_s": 2.0, "temperature": 1.0, **rollout_opts},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "micro_batch": 8},
        "run": {"max_steps": 1, "save_every": 1, "log_samples_every": 0, "eval_n": 0,
                "time_budget_min": 0},
    })


def train(cfg: Config, run_dir: Path, resume: bool = False) -> tuple[Trainer, list[StepResult]]:
    results: list[StepResult] = []
    trainer = Trainer(cfg, run_dir, resume=resume, progress=False)
    trainer.train(on_step=results.append)
    return trainer, results


def episode(outcome: float, line: float = 0.0) -> Trajectory:
    from replrl.types import Line

    return Trajectory(token_ids=[1], loss_mask=[1], logprobs=[0.0], prompt_len=0, text="",
                      lines=[Line(code="x", rewards={"syntax_error": line})], outcome_rewards={"correct": outcome})


# -- the pure parts ------------------------------------------------------------------------------------------------

def test_a_contrast_is_two_rewards_that_differ():
    assert not has_contrast([0.0, 0.0, 0.0, 0.0])                 # all wrong
    assert not has_contrast([1.0, 1.0])                           # all right
    assert not has_contrast([0.7])                                # one episode (or one leaf) compares with nothing
    assert not has_contrast([0.1 + 0.2, 0.3])                     # 5.6e-17 apart: the same sum, rounded
    assert has_contrast([0.0, 0.0, 1.0, 0.0])
    assert has_contrast([-0.2, 0.0])                              # no answer vs a wrong one: the outcome differs
    # the signal: the outcome by default; "reward" also sees per-line terms
    same_outcome = [episode(0.0, line=-0.3), episode(0.0, line=0.0)]
    assert not group_has_contrast(same_outcome) and group_has_contrast(same_outcome, "reward")


def test_the_first_groups_with_a_contrast_are_kept_in_the_order_drawn():
    flags = [False, True, False, True, True, False]
    assert select_groups(flags, want=2) == [1, 3]                 # the third contrast group (4) is not needed
    assert select_groups(flags, want=5) == [1, 3, 4]              # the bound was reached with 3: train on those
    # none at all: one group without contrast (zero advantage) per process, the earliest drawn
    assert select_groups([False, False, False], want=2, at_least=2) == [0, 1]
    assert select_groups([False, True, False], want=2, at_least=2) == [0, 1]
    episodes = [episode(0.0) for _ in range(6)]
    for k, t in enumerate(episodes):
        t.group = k // 3
    assert split_by_group(episodes) == [episodes[:3], episodes[3:]]


def test_wave_figures():
    # wave 1: 2 groups, 10 s, neither kept -> 10 s discarded; wave 2: 2 groups, 6 s, group 2 kept, group 3 not
    # -> 3 s discarded. 4 groups of 4 episodes drawn for 1 kept group: 16 episodes per kept group
    waves = [WaveRecord([False, False], 10.0, [4, 4]), WaveRecord([True, False], 6.0, [4, 4])]
    m = wave_metrics(waves, kept=[2], group_size=4, bound_reached=True)
    assert m == {"dynsamp/waves": 2.0, "dynsamp/groups_drawn": 4.0, "dynsamp/groups_kept": 1.0,
                 "dynsamp/discarded_rollout_s": 13.0, "dynsamp/bound_reached": 1.0, "dynsamp/short_groups_kept": 0.0,
                 "dynsamp/episodes_per_kept_group": 16.0}
    # nothing kept but a filler group without contrast: 0 kept, no ratio, the filler's wave share is not discarded
    m = wave_metrics([WaveRecord([False, False], 8.0, [4, 4])], kept=[0], group_size=4, bound_reached=True)
    assert m["dynsamp/groups_kept"] == 0 and m["dynsamp/discarded_rollout_s"] == 4.0
    assert "dynsamp/episodes_per_kept_group" not in m


def test_screening_figures():
    # a wave spends the episodes of problems_per_step whole groups on probes: 2 x 8 episodes screen 4 problems
    assert screening_wave(2, 8, 4) == 4 and screening_wave(2, 8, 3) == 5 and screening_wave(2, 8, 0) == 2
    assert screening_wave(3, 4, 2) == 6
    # one wave of 4 probes of 2 (8 s): probes 1 and 3 have a contrast, are kept and get 2 more episodes each (4 s);
    # 16 episodes for 2 kept groups; discarded: probes 0 and 2, half the wave's episodes
    m = wave_metrics([WaveRecord([False, True, False, True], 8.0, [2, 2, 2, 2])], kept=[1, 3], group_size=4,
                     bound_reached=False, completion={1: 2, 3: 2}, completion_s=4.0)
    assert m["dynsamp/episodes_per_kept_group"] == 6.0 and m["dynsamp/discarded_rollout_s"] == 4.0
    assert m["dynsamp/screened_episodes"] == 8.0 and m["dynsamp/completion_s"] == 4.0
    assert m["dynsamp/short_groups_kept"] == 0, "a completed probe is a whole group"
    # without screening the figures are today's (no screening keys)
    assert "dynsamp/screened_episodes" not in wave_metrics([WaveRecord([True], 1.0, [4])], [0], 4, False)


def test_every_rank_s_waves_merge_as_one_step_s():
    # rank 0 drew 2 waves (its groups 0, 1 | 2, 3; kept: 2, with a contrast), rank 1 one wave (groups 0, 1; kept: 1).
    # Merged wave 1 holds both ranks' first waves: rank 0's 0, 1 -> 0, 1, rank 1's 0, 1 -> 2, 3 (the longer wall,
    # 10 s); wave 2 rank 0's second wave: 2, 3 -> 4, 5. Kept: rank 0's 2 -> 4, rank 1's 1 -> 3.
    r0 = Waves([WaveRecord([False, False], 10.0, [4, 4]), WaveRecord([True, False], 6.0, [4, 4])], [2], False)
    r1 = Waves([WaveRecord([False, True], 7.0, [4, 4])], [1], False)
    m = merge_waves([r0, r1])
    assert m.records == [WaveRecord([False, False, False, True], 10.0, [4, 4, 4, 4]),
                         WaveRecord([True, False], 6.0, [4, 4])]
    assert m.kept == [3, 4] and not m.bound_reached and m.completion is None
    # 24 episodes for 2 kept groups; discarded: wave 1's 3 of 4 groups (7.5 s), wave 2's 1 of 2 (3 s)
    assert wave_metrics(m.records, m.kept, 4, m.bound_reached) == {
        "dynsamp/waves": 2.0, "dynsamp/groups_drawn": 6.0, "dynsamp/groups_kept": 2.0,
        "dynsamp/discarded_rollout_s": 10.5, "dynsamp/bound_reached": 0.0, "dynsamp/short_groups_kept": 0.0,
        "dynsamp/episodes_per_kept_group": 12.0}
    # screening: completions renumbered with the groups, the longest completion's time, the bound if any rank hit it
    r0 = Waves([WaveRecord([True, False], 2.0, [2, 2])], [0], False, {0: 2}, 1.5)
    r1 = Waves([WaveRecord([False, False], 2.5, [2, 2])], [0], True, {}, 0.1)
    m = merge_waves([r0, r1])
    assert (m.kept, m.completion, m.completion_s, m.bound_reached) == ([0, 2], {0: 2}, 1.5, True)
    assert merge_waves([r0]) is r0  # one rank: as it is


def test_the_learners_agreement_takes_every_rank_s_groups_and_the_furthest_position():
    def drawn(groups: int, position: int, waves: Waves | None) -> Drawn:
        gs = [[Trajectory(token_ids=[1], loss_mask=[1], logprobs=[0.0], prompt_len=0, text="", group=g)]
              for g in range(groups)]
        return Drawn([t for g in gs for t in g], gs, RolloutStats(), 3, position, waves)

    mine = drawn(1, 4, Waves([WaveRecord([True], 1.0, [1])], [0], False))
    other = drawn(2, 6, Waves([WaveRecord([False], 1.0, [1]), WaveRecord([True], 1.0, [1])], [1], False))
    agreed = agree(mine, [mine.summary(), other.summary()], group_size=1)
    assert agreed.position == 6 and len(agreed.groups) == 3 and agreed.mine == mine.mine
    assert agreed.policy_version == 3 and agreed.figures["dynsamp/waves"] == 2.0
    assert agreed.figures["dynsamp/groups_kept"] == 2.0
    # one rank, no dynamic sampling: the draw as it is, no figures
    flat = drawn(2, 2, None)
    assert agree(flat, [flat.summary()], group_size=1) == flat


def test_config_checks():
    with pytest.raises(ConfigError, match="dynamic_sampling_extra_waves"):
        resolve(Config, None, {"rollout": {"dynamic_sampling_extra_waves": -1}})
    with pytest.raises(ConfigError, match="dynamic_sampling_signal"):  # looked up when a run starts (the Trainer)
        check_signal(resolve(Config, None, {"rollout": {"dynamic_sampling_signal": "accuracy"}}).rollout
                     .dynamic_sampling_signal)
    assert Config().rollout.dynamic_sampling is False              # off by default: old configs mean what they meant
    assert Config().rollout.dynamic_sampling_probe == 0
    for probe, match in ((1, "compares with nothing"), (8, "between 2 and group_size - 1")):
        with pytest.raises(ConfigError, match=match):
            resolve(Config, None, {"rollout": {"dynamic_sampling": True, "group_size": 8,
                                               "dynamic_sampling_probe": probe}})
    with pytest.raises(ConfigError, match="needs rollout.dynamic_sampling = true"):
        resolve(Config, None, {"rollout": {"dynamic_sampling_probe": 2}})
    with pytest.raises(ConfigError, match="a tree .* is judged whole"):
        resolve(Config, None, {"rollout": {"dynamic_sampling": True, "group_size": 4, "dynamic_sampling_probe": 2},
                               "tree": {"branch_at": [2], "roots": 2, "width": 2}})


# -- the trainer ---------------------------------------------------------------------------------------------------

def test_off_is_today_s_step_and_on_equals_off_when_the_first_wave_suffices(format_model_dir, tmp_path):
    off, (r_off,) = train(toy(format_model_dir), tmp_path / "off")
    # today's stages 1-2, by hand: the stream's first problems, sampled with the step's seed
    again = Trainer(toy(format_model_dir), tmp_path / "again", progress=False)
    problems = ProblemStream(again.train_rows, again.cfg.run.seed).take(2)
    pool = run_sync(KernelPool(size=8, limits=again.cfg.rollout.limits(), tools=again.task.tools).start())
    try:
        trajs, _ = run_sync(rollout(again.env(pool), problems, again.sampling, group_size=4))
    finally:
        run_sync(pool.close())
    assert [t.token_ids for t in r_off.trajectories] == [t.token_ids for t in trajs]
    assert [t.row for t in r_off.trajectories] == [i for i, _ in problems for _ in range(4)]
    (row,) = read_metrics(tmp_path / "off")
    assert row["data_position"] == 2 and not any(k.startswith("dynsamp/") for k in row)
    assert row["groups_with_contrast"] == 2, "the seed was picked so that both first groups have a contrast"

    on, (r_on,) = train(toy(format_model_dir, dynamic_sampling=True), tmp_path / "on")
    (row_on,) = read_metrics(tmp_path / "on")
    assert row_on["dynsamp/waves"] == 1 and row_on["dynsamp/groups_kept"] == 2
    assert [t.token_ids for t in r_on.trajectories] == [t.token_ids for t in r_off.trajectories]
    for a, b in zip(on.model.parameters(), off.model.parameters(), strict=True):
        assert torch.equal(a, b), "the same groups must give the same update"


def test_the_bound_ends_the_waves_and_the_step_trains_on_what_it_has(format_model_dir, tmp_path):
    cfg = toy(format_model_dir, digits=(7,), dynamic_sampling=True, dynamic_sampling_extra_waves=2)
    _, (result,) = train(cfg, tmp_path / "run")
    (row,) = read_metrics(tmp_path / "run")
    # 1 + 2 waves of 2 problems, none with a contrast (nobody types 7)
    assert row["dynsamp/waves"] == 3 and row["dynsamp/groups_drawn"] == 6 and row["dynsamp/groups_kept"] == 0
    assert row["dynsamp/bound_reached"] == 1 and row["data_position"] == 6 and row["groups_with_contrast"] == 0
    assert row["episodes"] == 24 and row["accuracy"] == 0                # the figures are of every episode drawn
    assert "dynsamp/episodes_per_kept_group" not in row
    # one group without contrast stands in: zero advantage, so every backward is skipped
    assert len(result.trajectories) == 4 and row["backward_skipped_frac"] == 1.0
    # every wave's groups but the stand-in's share of the first were discarded
    assert 0 < row["dynsamp/discarded_rollout_s"] < row["rollout_s"]


def test_kept_groups_have_a_contrast_and_a_resumed_run_draws_the_same_problems(format_model_dir, tmp_path):
    cfg = toy(format_model_dir, digits=(1, 7), dynamic_sampling=True, dynamic_sampling_extra_waves=4)
    cfg.run.max_steps = 2
    _, straight = train(cfg, tmp_path / "straight")
    rows = read_metrics(tmp_path / "straight")
    for row, result in zip(rows, straight, strict=True):
        kept = int(row["dynsamp/groups_kept"])
        assert row["dynsamp/groups_drawn"] == 2 * row["dynsamp/waves"]          # waves of problems_per_step
        assert kept == 2 or row["dynsamp/bound_reached"] == 1
        assert row["dynsamp/episodes_per_kept_group"] == pytest.approx(4 * row["dynsamp/groups_drawn"] / kept)
        assert 0 <= row["dynsamp/discarded_rollout_s"] < row["rollout_s"]
        groups = split_by_group(result.trajectories)
        assert len(groups) == kept and all(group_has_contrast(g) for g in groups)
        assert all(len({t.row for t in g}) == 1 and {t.group for t in g} == {k} for k, g in enumerate(groups))
    assert rows[-1]["data_position"] == 2 * sum(r["dynsamp/waves"] for r in rows)
    assert sum(r["dynsamp/waves"] for r in rows) > 2, "the seed was picked so that some wave has no contrast"

    cfg.run.max_steps = 1
    train(cfg, tmp_path / "resumed")
    position = read_metrics(tmp_path / "resumed")[0]["data_position"]
    cfg.run.max_steps = 2
    resumed = Trainer(cfg, tmp_path / "resumed", resume=True, progress=False)
    assert resumed.step == 1 and resumed.drawer.problems.position == position  # the stream goes on where it stopped
    results: list[StepResult] = []
    resumed.train(on_step=results.append)
    (second,) = results
    again = read_metrics(tmp_path / "resumed")[1]
    # the resumed step's waves come from the same seeded stream, in order: its kept groups are problems of the next
    # 2 x waves positions. (Its tokens are not compared with the straight run's step 2: the two runs' step-1 updates
    # may differ in float rounding, lr 1e-3 amplifies that, and one flipped token changes the waves.)
    drawn = ProblemStream(resumed.train_rows, cfg.run.seed, position=position).take(2 * int(again["dynsamp/waves"]))
    assert again["data_position"] == position + len(drawn)
    assert {t.row for t in second.trajectories} <= {i for i, _ in drawn}
    if again["dynsamp/groups_kept"]:  # (with none, one group without a contrast stands in)
        assert all(group_has_contrast(g) for g in split_by_group(second.trajectories))


def test_screening_completes_the_probes_with_a_contrast_and_trains_on_whole_groups(format_model_dir, tmp_path):
    # probes of 2 episodes: a wave screens 2 x 4 // 2 = 4 problems; a probe with a contrast gets 2 more episodes
    cfg = toy(format_model_dir, digits=(1, 7), dynamic_sampling=True, dynamic_sampling_extra_waves=4,
              dynamic_sampling_probe=2)
    cfg.run.max_steps = 2
    _, results = train(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    for row, result in zip(rows, results, strict=True):
        kept = int(row["dynsamp/groups_kept"])
        assert row["dynsamp/groups_drawn"] == 4 * row["dynsamp/waves"]
        assert row["dynsamp/screened_episodes"] == 2 * row["dynsamp/groups_drawn"]
        # every episode drawn is counted: the probes and the completions
        assert row["episodes"] == row["dynsamp/screened_episodes"] + 2 * kept
        assert row["dynsamp/episodes_per_kept_group"] == pytest.approx(row["episodes"] / kept)
        assert 0 < row["dynsamp/completion_s"] < row["rollout_s"]
        groups = split_by_group(result.trajectories)
        assert len(groups) == kept and kept == 2 or row["dynsamp/bound_reached"] == 1
        for k, g in enumerate(groups):  # whole groups of one problem, with a contrast, ids 0..kept-1
            assert len(g) == 4 and len({t.row for t in g}) == 1 and {t.group for t in g} == {k}
            assert group_has_contrast(g) and group_has_contrast(g[:2]), "the probe itself had the contrast"
    assert rows[-1]["data_position"] == 4 * sum(r["dynsamp/waves"] for r in rows)
    assert sum(r["dynsamp/groups_kept"] for r in rows) >= 2
