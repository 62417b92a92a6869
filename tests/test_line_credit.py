"""The line-credit experiment's machinery (issue 34): both sweeps parse into the intended runs (through `replrl sweep
--print`, as a scheduler would run them), arm 1 keeps the committed control's protocol, the interval maths on fixed
numbers, and the collector end to end on a sweep directory built here."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from replrl.cli import build_parser, main
from replrl.config import Config, ExtraEval
from replrl.configlib import overrides_from_args, resolve, to_dict

ROOT = Path(__file__).resolve().parent.parent
ARM1 = ROOT / "examples" / "line_credit_sweep.toml"
ARM2 = ROOT / "examples" / "line_credit_explore_sweep.toml"
CONTROL = ROOT / "docs" / "results" / "shaping_cpu" / "outcome_only"
PENALTIES = ("syntax_error", "exception", "timeout", "crash", "repeat_line")


def printed_configs(spec: Path, out: Path, capsys: pytest.CaptureFixture) -> dict[tuple[str, int], Config]:
    """{(variant, seed): the config `replrl train` resolves from each line `replrl sweep SPEC --print` writes}."""
    assert main(["sweep", str(spec), "--out", str(out), "--print"]) == 0
    parser, configs = build_parser(), {}
    for line in capsys.readouterr().out.splitlines():
        argv = shlex.split(line)
        assert argv[:2] == ["replrl", "train"] and "--resume" not in argv
        args = parser.parse_args(argv[1:])
        run_dir = Path(args.run_dir)
        configs[(run_dir.parent.name, int(run_dir.name.removeprefix("seed")))] = resolve(
            Config, args.config, overrides_from_args(args))
    return configs


def differences(a: Config, b: Config) -> set[str]:
    """The section.field names whose values differ."""
    x, y = to_dict(a), to_dict(b)
    return {f"{s}.{f}" for s in x for f in x[s] if x[s][f] != y[s][f]}


def test_both_sweeps_parse_into_the_intended_runs(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the printed commands name the base config relative to the working directory
    arm1 = printed_configs(ARM1, tmp_path / "arm1", capsys)
    arm2 = printed_configs(ARM2, tmp_path / "arm2", capsys)
    assert sorted(arm1) == [(v, s) for v in ("penalties_on_correct", "state", "tree") for s in (0, 1, 2)]
    assert sorted(arm2) == [(v, s) for v in ("outcome_only", "tree") for s in (0, 1, 2)]
    for (variant, seed), cfg in {**arm1, **arm2}.items():
        # the shaping sweep's protocol: the 0.5B, 12 steps x 2 problems x 8, lr 2e-6, T 0.7, held-out GSM8K
        assert cfg.model.name == "qwen2.5-coder-0.5b-instruct" and cfg.run.max_steps == 12
        assert (cfg.rollout.problems_per_step, cfg.rollout.group_size, cfg.rollout.temperature) == (2, 8, 0.7)
        assert cfg.optim.lr == 2e-6 and cfg.run.seed == cfg.rollout.seed == seed and cfg.task.level == 1
        assert cfg.run.transfer_task["name"] == "gsm8k" and cfg.run.transfer_n == 100
        assert cfg.run.eval_task == {"level": 0} and cfg.rewards.weights["no_submit"] == 0.0
        if variant == "tree":  # 8 leaves per problem: 2 roots branching in 2 after lines 2 and 4
            assert (cfg.tree.branch_at, cfg.tree.roots, cfg.tree.width, cfg.tree.leaves) == ([2, 4], 2, 2, 8)
            assert cfg.advantages.estimator == "tree"
        else:
            assert cfg.tree.branch_at == []
        if variant == "penalties_on_correct":  # the penalties of the base config, only on correct episodes
            assert all(cfg.rewards.weights[t] < 0 and cfg.rewards.gates[t] == "correct" for t in PENALTIES)
            assert cfg.advantages.estimator == "outcome"
        else:  # credit from outcomes alone
            assert all(cfg.rewards.weights[t] == 0.0 for t in PENALTIES) and cfg.rewards.gates == {}
        if variant == "state":
            assert cfg.advantages.estimator == "state" and cfg.rollout.state_digest
    for cfg in arm1.values():  # programs under its own limits, plus 100 explore problems of every level
        assert cfg.task.name == "programs" and cfg.run.eval_n == 102 and not cfg.run.eval_before
        assert (cfg.rollout.max_lines, cfg.rollout.max_total_tokens) == (24, 1536)
        assert cfg.run.extra_evals() == [ExtraEval("explore", {"name": "explore", "level": 0}, 100, {})]
    for (variant, _), cfg in arm2.items():  # explore (its own limits), plus arm 1's 102 programs problems
        assert cfg.task.name == "explore" and cfg.run.eval_n == 100
        assert (cfg.rollout.max_lines, cfg.rollout.max_total_tokens, cfg.rollout.max_output_tokens) == (16, 2048, 128)
        assert cfg.run.extra_evals() == [ExtraEval("programs", {"name": "programs", "level": 0}, 102, {})]
        assert cfg.run.eval_before == (variant == "outcome_only") and cfg.advantages.estimator in ("outcome", "tree")


def test_arm_1_differs_from_its_committed_control_only_where_the_variant_says(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The committed `outcome_only` runs of the shaping sweep are arm 1's control: each new run's config is the
    control's of the same seed but for the variant's own fields, the evaluation it adds (extra_eval), the "before"
    evaluation the control made, and the machine's copy of GSM8K."""
    monkeypatch.chdir(ROOT)
    arm1 = printed_configs(ARM1, tmp_path / "arm1", capsys)
    common = {"run.eval_before", "run.transfer_task", "run.extra_eval"}
    own = {"tree": {"advantages.estimator", "tree.branch_at"}, "state": {"advantages.estimator"},
           "penalties_on_correct": {"rewards.weights", "rewards.gates"}}
    for (variant, seed), cfg in arm1.items():
        control = resolve(Config, str(CONTROL / f"seed{seed}" / "config.toml"), {})
        assert differences(cfg, control) == own[variant] | common, (variant, seed)
        assert {k: v for k, v in cfg.run.transfer_task.items() if k != "data"} == \
            {k: v for k, v in control.run.transfer_task.items() if k != "data"}
