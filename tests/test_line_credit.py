"""The line-credit experiment's machinery (issue 34): both sweeps parse into the intended runs (through `replrl sweep
--print`, as a scheduler would run them), arm 1 keeps the committed control's protocol, the interval maths on fixed
numbers, and the collector end to end on a sweep directory built here."""

from __future__ import annotations

import shlex
import sys
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
            Config, args.config, overrides_from_args(args)
        )
    return configs


def differences(a: Config, b: Config) -> set[str]:
    """The section.field names whose values differ."""
    x, y = to_dict(a), to_dict(b)
    return {f"{s}.{f}" for s in x for f in x[s] if x[s][f] != y[s][f]}


def test_both_sweeps_parse_into_the_intended_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
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


def test_arm_1_differs_from_its_committed_control_only_where_the_variant_says(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The committed `outcome_only` runs of the shaping sweep are arm 1's control: each new run's config is the
    control's of the same seed but for the variant's own fields, the evaluation it adds (extra_eval), the "before"
    evaluation the control made, and the machine's copy of GSM8K."""
    monkeypatch.chdir(ROOT)
    arm1 = printed_configs(ARM1, tmp_path / "arm1", capsys)
    common = {"run.eval_before", "run.transfer_task", "run.extra_eval"}
    own = {
        "tree": {"advantages.estimator", "tree.branch_at"},
        "state": {"advantages.estimator"},
        "penalties_on_correct": {"rewards.weights", "rewards.gates"},
    }
    for (variant, seed), cfg in arm1.items():
        control = resolve(Config, str(CONTROL / f"seed{seed}" / "config.toml"), {})
        # the control saved run.tensorboard = true, which reads as report_to ["tensorboard"] only where tensorboard
        # is installed: which trackers a run reports to is not part of its protocol
        assert control.run.report_to in ([], ["tensorboard"]) and cfg.run.report_to == []
        control.run.report_to = cfg.run.report_to
        assert differences(cfg, control) == own[variant] | common, (variant, seed)
        assert {k: v for k, v in cfg.run.transfer_task.items() if k != "data"} == {
            k: v for k, v in control.run.transfer_task.items() if k != "data"
        }


# ---------------------------------------------------------------------------------------------------------------
# The interval maths, on fixed numbers


def test_t_interval_and_problem_bootstrap_on_fixed_numbers() -> None:
    from replrl.compare import mean_ci, paired_bootstrap

    # t-interval: mean 2, sd 1, n 3: 2 +- t(0.975, 2) / sqrt(3) = 2 +- 4.302653 / 1.732051 = 2 +- 2.484138
    assert mean_ci([1.0, 2.0, 3.0]) == pytest.approx((2.0, -0.484138, 4.484138), abs=1e-6)
    # every problem differs by one: no resample changes the mean
    assert paired_bootstrap([[1, 1, 1]], [[0, 0, 0]]) == (1.0, 1.0, 1.0)
    # two seed pairs over 4 problems: per problem, the mean over pairs of variant - control is D = [0, .5, .5, 0]
    # (the mean, .25, is the mean of the seeds' accuracy differences, .5 - .25 and .75 - .5). A resample's mean is
    # .125 k, k ~ Binomial(4, 1/2): 0 with probability 1/16 = 6.25% (> 2.5%) and .5 with 6.25%: the interval is [0, .5]
    variant, control = [[1, 1, 0, 0], [1, 1, 1, 0]], [[1, 0, 0, 0], [1, 1, 0, 0]]
    assert paired_bootstrap(variant, control) == (0.25, 0.0, 0.5)
    assert paired_bootstrap(variant, control, seed=1) == (0.25, 0.0, 0.5)  # not an accident of the resampling seed
    # D = [1, 0]: resample means 0, .5, 1 with 1/4, 1/2, 1/4
    assert paired_bootstrap([[1, 0]], [[0, 0]]) == (0.5, 0.0, 1.0)
    with pytest.raises(ValueError, match="one shape"):
        paired_bootstrap([[1, 0]], [[1, 0, 1]])


# ---------------------------------------------------------------------------------------------------------------
# The collector: figures read from transcripts, then the page from a sweep directory written here

BANNER = 'Python 3.11.7 (main) on linux\nType "help", "copyright", "credits" or "license" for more information.\n'
LOOKED = ">>> x = 3\n>>> x\n3\n>>> y = x * 2\n>>> submit(y)\n"  # looked, then coded (3 was typed before it showed)
USED = ">>> x = 3 * 7\n>>> x\n21\n>>> y = 21 * 2\n>>> submit(y)\n"  # looked, then typed the 21 it saw
PLAIN = ">>> submit(5)\n"
ERROR = (
    '>>> 1/0\nTraceback (most recent call last):\n  File "<stdin>", line 1, in <module>\n'
    "ZeroDivisionError: division by zero\n>>> z = 1\n>>> submit(z)\n"
)  # a traceback is no value
LAST_LOOK = ">>> 2 + 2\n4\n>>> submit(4)\n"  # only submit after it
BLOCK = ">>> for i in range(2):\n...     print(i)\n... \n0\n1\n>>> t = 1\n>>> submit(t)\n"  # a block printed


def load_collector():
    import importlib.util

    spec = importlib.util.spec_from_file_location("line_credit_collect", ROOT / "bench" / "line_credit_collect.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_looked_then_coded_and_typed_lines_read_from_the_text() -> None:
    lc = load_collector()
    header = "Problem: what is 6?\n>>> total = sum(i for i in range(4))\n>>> submit(total)\n"  # the header's example
    cases = {  # body: (looked, then coded; looked before submitting; carried a printed value on; typed lines)
        LOOKED: (True, True, False, 4),
        USED: (True, True, True, 4),
        PLAIN: (False, False, False, 1),
        ERROR: (False, False, False, 3),  # a traceback shows no value
        LAST_LOOK: (False, True, False, 2),  # submit(4) after 4 showed, but the header's example holds a 4
        ">>> 2 + 3\n5\n>>> submit(5)\n": (False, True, True, 2),
        BLOCK: (True, True, False, 5),  # its output is 0 and 1 only
        ">>> d\n{'a': 5, 'b': 7}\n>>> d['b']\n7\n": (True, False, True, 2),  # a key read off a printed dict; no submit
        # the 6 is the problem's
        ">>> import sys\n>>> sys.version\n'3.11.7'\n>>> x = 6\n>>> submit(x)\n": (True, True, False, 4),
        ">>> submit(2)\n>>> 2 + 2\n4\n>>> submit(4)\n": (False, False, False, 3),  # looked only after its first submit
    }
    for body, want in cases.items():
        text = header + BANNER + body
        got = (lc.looked_then_coded(text), lc.looked_then_submitted(text), lc.used_output(text), lc.typed_lines(text))
        assert got == want, body


def test_the_used_output_transcript_comes_from_any_seed_then_any_task_and_the_typical_one_from_the_first() -> None:
    """A variant's first seed has no correct episode that carried a printed value into a later line; its second has
    two: the shorter is shown, from seed 1, and the typical transcript stays the first seed's. Where the training
    task has none, the other held-out tasks are searched in order."""
    lc = load_collector()
    cfg = resolve(Config, None, {"run": {"extra_eval": [{"name": "explore", "level": 0, "n": 3}]}})
    header = "Problem: what is 6?\n" + BANNER

    def run(seed: int, bodies: list[tuple[str, bool]], explore: list[tuple[str, bool]] = ()):
        def eps(pairs):
            return [{"row": i, "correct": ok, "text": header + body} for i, (body, ok) in enumerate(pairs)]

        episodes = {("eval", 12): eps(bodies), ("eval_explore", 12): eps(explore)}
        return lc.RunRecords("tree", seed, Path(f"s{seed}"), cfg, [], episodes)

    longer = USED + ">>> y = 1\n"
    runs = [run(0, [(PLAIN, True), (USED, False)]), run(1, [(longer, True), (PLAIN, True), (USED, True)])]
    picks = lc.transcript_candidates({lc.CONTROL: [], "tree": runs}, "arithmetic", ["explore"])
    assert [(title, r.seed, e["row"]) for title, r, e in picks] == [
        ("Carried a printed value into a later line (held-out `arithmetic`)", 1, 2),
        ("Typical", 0, 0),
    ]
    # none on the training task (LOOKED looked, but typed nothing it saw): the explore evaluation's
    runs = [run(0, [(PLAIN, True), (LOOKED, True)], explore=[(PLAIN, True), (USED, True)])]
    picks = lc.transcript_candidates({"tree": runs}, "arithmetic", ["explore"])
    assert [(title, r.seed, e["row"]) for title, r, e in picks] == [
        ("Carried a printed value into a later line (held-out `explore`)", 0, 1),
        ("Typical", 0, 1),
    ]
    # none anywhere: only the typical transcript
    picks = lc.transcript_candidates({"tree": runs}, "arithmetic")
    assert [(title, r.seed) for title, r, _ in picks] == [("Typical", 0)]


def write_run(
    run_dir: Path,
    cfg: Config,
    evals: dict[tuple[str, int], list[tuple[int, str]]],
    train: dict[str, float],
    banner: str = BANNER,
) -> None:
    """A finished run's records as a sweep leaves them: config, metrics (2 training steps), sweep record and
    eval_samples.jsonl. ``evals``: {(label, step): [(correct 0/1, transcript body) per problem row]}."""
    import json

    from replrl.configlib import to_toml
    from replrl.types import Line, Trajectory

    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    rows = [
        {
            "step": s,
            "episodes": 16,
            "step_s": 10.0 * s,
            **{k: v[s - 1] if isinstance(v, list) else v for k, v in train.items()},
        }
        for s in (1, 2)
    ]
    samples = []
    for (label, step), episodes in evals.items():
        rows.append(
            {
                "step": step,
                f"{label}/accuracy": sum(c for c, _ in episodes) / len(episodes),
                f"{label}/episodes": len(episodes),
            }
        )
        for row, (correct, body) in enumerate(episodes):
            traj = Trajectory(
                [],
                [],
                [],
                0,
                "Problem: ?\n" + banner + body,
                correct=bool(correct),
                submitted=True,
                lines=[Line(code) for code in body.splitlines() if code.startswith(">>> ")],
                row=row,
            )
            samples.append(json.dumps({"step": step, "eval": label, **traj.to_dict()}))
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in sorted(rows, key=lambda r: r["step"]))
    )
    (run_dir / "eval_samples.jsonl").write_text("\n".join(samples) + "\n")
    (run_dir / "sweep.json").write_text(json.dumps({"status": "done", "steps": 2, "episodes": 32, "wall_s": 30.0}))


def test_the_collector_writes_the_page_from_a_sweep_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Two seeds per variant, 4 problems per held-out set; the figures worked out by hand."""
    from replrl.sweep import plan

    lc = load_collector()
    arm1, arm2 = plan(ARM1, tmp_path / "s1"), plan(ARM2, tmp_path / "s2")
    cfg = {(r.variant, r.seed): r.cfg for r in arm1 if r.seed < 2}
    cfg2 = {(r.variant, r.seed): r.cfg for r in arm2 if r.seed < 2}
    control_cfg = {s: resolve(Config, str(CONTROL / f"seed{s}" / "config.toml"), {}) for s in (0, 1)}

    def eps(pattern: str, body: str = PLAIN) -> list[tuple[int, str]]:
        return [
            (int(c), USED if c == "1" and body == "mixed" else PLAIN if body == "mixed" else body) for c in pattern
        ]

    # arm 1's control (programs: rows 0-3 of its test split, levels 3, 2, 2, 3): 25% and 50% after training
    for s, (before, after) in {0: ("0000", "1000"), 1: ("1000", "1100")}.items():
        write_run(
            tmp_path / "control" / "outcome_only" / f"seed{s}",
            control_cfg[s],
            {
                ("eval", 0): eps(before),
                ("transfer", 0): eps("00"),
                ("eval", 12): eps(after),
                ("transfer", 12): eps("10"),
            },
            {"adv/correct_negative_frac": 0.0, "model_tokens_per_episode": 80.0, "accuracy": [0.0, 0.25]},
        )
    # arm 1's tree: 50% and 75%, +25 points at both seeds; its correct episodes looked at a value, then coded
    for s, after in {0: "1100", 1: "1110"}.items():
        write_run(
            tmp_path / "s1" / "tree" / f"seed{s}",
            cfg[("tree", s)],
            {("eval", 12): eps(after, "mixed"), ("transfer", 12): eps("11"), ("eval_explore", 12): eps("0100")},
            {
                "adv/correct_negative_frac": 0.25,
                "tree/generated_tokens_per_leaf": 40.0,
                "model_tokens_per_episode": 90.0,
                "accuracy": 0.5,
                "groups_with_contrast": [1, 2],
                "grad_norm": [0.0, 3.0],
                "episodes": [16, 12],  # the second step's trees 4 leaves short
            },
        )
    # arm 2: the control evaluates the untrained model; the tree collapses at seed 1 (0% against the control's 50%)
    for s, (before, after, tree) in {0: ("0000", "0100", "1100"), 1: ("1000", "1100", "0000")}.items():
        write_run(
            tmp_path / "s2" / "outcome_only" / f"seed{s}",
            cfg2[("outcome_only", s)],
            {
                ("eval", 0): eps(before, "mixed"),  # seed 1's one correct untrained episode looked, then coded
                ("eval_programs", 0): eps("0000"),
                ("transfer", 0): eps("00"),
                ("eval", 12): eps(after),
                ("eval_programs", 12): eps("1000"),
                ("transfer", 12): eps("01"),
            },
            {"adv/correct_negative_frac": 0.0, "model_tokens_per_episode": 60.0},
        )
        write_run(
            tmp_path / "s2" / "tree" / f"seed{s}",
            cfg2[("tree", s)],
            {("eval", 12): eps(tree), ("eval_programs", 12): eps("1000"), ("transfer", 12): eps("00")},
            {"adv/correct_negative_frac": 0.5, "tree/generated_tokens_per_leaf": 30.0},
            banner=BANNER.replace("3.11.7", "3.12.1") if s == 1 else BANNER,  # seed 1 trained on another machine
        )
    out, page = tmp_path / "results", tmp_path / "line_credit.md"
    lc.main(
        [
            "--arm1",
            str(tmp_path / "s1"),
            "--arm2",
            str(tmp_path / "s2"),
            "--control",
            str(tmp_path / "control" / "outcome_only"),
            "--out",
            str(out),
            "--page",
            str(page),
        ]
    )
    assert sorted(p.relative_to(out).as_posix() for p in out.glob("*/*/seed*")) == [
        "arm1/tree/seed0",
        "arm1/tree/seed1",
        "arm2/outcome_only/seed0",
        "arm2/outcome_only/seed1",
        "arm2/tree/seed0",
        "arm2/tree/seed1",
    ]
    for arm in ("arm1", "arm2"):  # replrl compare's curves and tables, the control as its baseline
        summary = (out / arm / "compare" / "summary.md").read_text()
        assert "`outcome_only` (baseline)" in summary and "`tree`" in summary
    assert "explore accuracy" in (out / "arm1" / "compare" / "summary.md").read_text()
    text = page.read_text()
    arm1_text, arm2_text = text.split("## Arm 2")

    def rows(section: str, name: str) -> list[str]:
        """The lines of the section's tables whose first cell is ``name``: accuracy, then difference, tables."""
        return [line for line in section.splitlines() if line.startswith(f"| {name} |")]

    # accuracy: before 0% and 25% -> 12.5%; control 25% and 50% -> 37.5% (t = 12.7 with 2 seeds: clipped to 0-100)
    accuracy, difference = rows(arm1_text, "programs, all levels")
    assert accuracy == "| programs, all levels | 12.5% [0.0, 100.0] | 37.5% [0.0, 100.0] | 62.5% [0.0, 100.0] |"
    # the paired difference: +25 at both seeds (an interval of zero width), problems [0, +50] (worked out above)
    assert difference == "| programs, all levels | +25.0 [+25.0, +25.0] (2); problems [+0.0, +50.0] |"
    # level 2 (rows 1, 2): control 0% and 50%, tree 50% and 100%: +50 at both seeds, on both problems
    assert rows(arm1_text, "programs, level 2") == [
        "| programs, level 2 | 0.0% [0.0, 0.0] | 25.0% [0.0, 100.0] | 75.0% [0.0, 100.0] |",
        "| programs, level 2 | +50.0 [+50.0, +50.0] (2); problems [+50.0, +50.0] |",
    ]
    # explore: no control figure, so no difference; "before" from arm 2's control at step 0 (rows 0-3: 0% and 25%)
    assert rows(arm1_text, "explore, all levels") == [
        "| explore, all levels | 12.5% [0.0, 100.0] |  | 25.0% [25.0, 25.0] |"
    ]
    assert "\"before\" on explore: arm 2's `outcome_only` runs' evaluation of the untrained model" in arm1_text
    # GSM8K: control 1 of 2 at both seeds, tree 2 of 2: +50 at both; the problems are 1 (+1) and 0 (+0)
    assert rows(arm1_text, "GSM8K")[1] == "| GSM8K | +50.0 [+50.0, +50.0] (2); problems [+0.0, +100.0] |"
    # behaviour: the tree's correct episodes (5 of 8) looked at a value, then coded, each in 4 lines (USED)
    assert rows(arm1_text, "looked at a value, then wrote more code (share of episodes)")[0] == (
        "| looked at a value, then wrote more code (share of episodes) | 0.0% [0.0, 0.0] | 62.5% [0.0, 100.0] |"
    )
    assert rows(arm1_text, "looked at a value before submitting (share of episodes)")[0] == (
        "| looked at a value before submitting (share of episodes) | 0.0% [0.0, 0.0] | 62.5% [0.0, 100.0] |"
    )
    assert rows(arm1_text, "carried a printed value into a later line (share of episodes)")[0] == (
        "| carried a printed value into a later line (share of episodes) | 0.0% [0.0, 0.0] | 62.5% [0.0, 100.0] |"
    )
    assert rows(arm1_text, "lines per correct episode")[0].endswith("| 1.0 [1.0, 1.0] | 4.0 [4.0, 4.0] |")
    # lines per episode: tree seed 0 (4 + 4 + 1 + 1) / 4 = 2.5, seed 1 (4 * 3 + 1) / 4 = 3.25: the interval clipped
    assert rows(arm1_text, "lines per episode")[0].endswith("| 1.0 [1.0, 1.0] | 2.9 [0.0, 7.6] |")
    assert rows(arm1_text, "tokens generated per leaf (training)")[0].endswith("| 80 [80, 80] | 40 [40, 40] |")
    assert rows(arm1_text, "correct training episodes (leaves) with a negative advantage")[0].endswith(
        "| 0.0% [0.0, 0.0] | 25.0% [25.0, 25.0] |"
    )
    assert rows(arm1_text, "collapsed runs") == ["| collapsed runs | 0 of 2 | 0 of 2 |"]
    # training steps without a correct episode: the control's first step of two at both seeds, none of the tree's
    assert rows(arm1_text, "training steps without a correct episode (nothing to learn from)") == [
        "| training steps without a correct episode (nothing to learn from) | 50.0% [50.0, 50.0] | 0.0% [0.0, 0.0] |"
    ]
    # groups with a contrast: the tree's 1 + 2 of 2 steps x 2 problems (the sweep's problems_per_step); the control
    # did not log it
    # episodes per group over the sweep's 2 problems a step: the control 16 and 16, the tree 16 and 12
    assert rows(arm1_text, "episodes (leaves) per training group") == [
        "| episodes (leaves) per training group | 8.0 [8.0, 8.0] | 7.0 [7.0, 7.0] |"
    ]
    # a zero gradient: the tree's first step of two at both seeds; the control did not log grad_norm
    label = "training steps with a zero gradient (no group with a contrast)"
    assert rows(arm1_text, label) == [f"| {label} |  | 50.0% [50.0, 50.0] |"]
    assert rows(arm1_text, "training groups with a contrast (some leaves right, some wrong)") == [
        "| training groups with a contrast (some leaves right, some wrong) |  | 75.0% [75.0, 75.0] |"
    ]
    assert "| `outcome_only` | 0 | 2 | 1 of 2 | 25.0% | no |" in arm1_text
    assert "| `tree` | 1 | 2 | 0 of 2 | 75.0% | no |" in arm1_text
    assert rows(arm1_text, "wall-clock per step / the control's") == [
        "| wall-clock per step / the control's |  | 1.00x (machine not recorded) |"
    ]
    # the untrained model's behaviour beside the trained control's: arm 1's untrained episodes all PLAIN
    assert rows(arm1_text, "looked at a value, then wrote more code (share of episodes)")[1] == (
        "| looked at a value, then wrote more code (share of episodes) | 0.0% [0.0, 0.0] | 0.0% [0.0, 0.0] |"
    )
    # arm 2: 0 of 4 at seed 0, 1 of 4 (USED) at seed 1; the trained control's episodes all PLAIN
    assert rows(arm2_text, "carried a printed value into a later line (share of episodes)")[1] == (
        "| carried a printed value into a later line (share of episodes) | 12.5% [0.0, 100.0] | 0.0% [0.0, 0.0] |"
    )
    # arm 2: explore first; the tree collapsed at seed 1 (0% against its control's 50%)
    assert arm2_text.index("| explore, all levels |") < arm2_text.index("| programs, all levels |")
    assert rows(arm2_text, "collapsed runs") == ["| collapsed runs | 0 of 2 | 1 of 2 (seed 1) |"]
    assert (
        rows(arm2_text, "explore, all levels")[0] == "| explore, all levels | 12.5% [0.0, 100.0] | 37.5% [0.0, "
        "100.0] | 25.0% [0.0, 100.0] |"
    )
    # transcript candidates: the tree's shortest correct episode that typed a value it saw (seed 0, row 0), and a
    # typical one (the median by typed lines of its correct ones: rows 0 and 1 tie at 4 lines, so row 1)
    assert (
        "Carried a printed value into a later line (held-out `programs`): `tree` seed 0, problem row 0, correct:"
        in arm1_text
    )
    assert (
        "Typical: `tree` seed 0, problem row 1, correct:\n\n```\nProblem: ?\n\n>>> x = 3 * 7\n>>> x\n21\n" in arm1_text
    )
    # arm 2's tree seed 1 saw another Python banner in its prompts: the page says so (arm 1's runs all saw one)
    assert "differ in the Python banner" not in arm1_text
    assert "`tree`: `Python 3.11.7 (main) on linux`, `Python 3.12.1 (main) on linux`" in arm2_text
    # made again from the committed records alone (no sweep directories): the same page; --readme puts the
    # headline table between a README's markers, the runs counted against the committed sweep specs
    # a mistyped directory is a one-line error, and the page stays as it was
    for flag in ("--control", "--arm1"):
        with pytest.raises(SystemExit) as exit_:
            lc.main([flag, str(tmp_path / "nowhere"), "--out", str(out), "--page", str(page)])
        assert exit_.value.code == 2
        assert f"{flag} {tmp_path / 'nowhere'}: no such directory" in capsys.readouterr().err
        assert page.read_text() == text
    page.unlink()
    readme = tmp_path / "README.md"
    readme.write_text(f"# front\n\n{lc.README_BEGIN}\nold\n{lc.README_END}\n\n## next\n")
    lc.main(
        ["--control", str(tmp_path / "control" / "outcome_only"), "--out", str(out), "--page", str(page)]
        + ["--readme", str(readme)]
    )
    assert page.read_text() == text
    front = readme.read_text()
    assert front.startswith(f"# front\n\n{lc.README_BEGIN}\n\nRuns collected: arm 1 2 of 9 and arm 2 4 of 6 (arm 1's")
    assert front.endswith(f"{lc.README_END}\n\n## next\n") and "old" not in front
    arm1_head, arm2_head = front.split("| trained on `explore` level 1 |")
    assert rows(arm1_head, "held-out programs") == [
        "| held-out programs | 12.5% [0.0, 100.0] | 37.5% [0.0, 100.0] | 62.5% [0.0, 100.0] | not run yet | not run "
        "yet |"
    ]
    assert rows(arm1_head, "difference to `outcome_only` on programs") == [
        "| difference to `outcome_only` on programs |  |  | +25.0 [+25.0, +25.0] (2); problems [+0.0, +50.0] |  |  |"
    ]
    assert rows(arm2_head, "held-out explore")[0].startswith("| held-out explore | 12.5% [0.0, 100.0] | 37.5% [0.0, ")
    broken = tmp_path / "broken.md"
    broken.write_text("no markers\n")
    with pytest.raises(SystemExit, match="needs one"):
        lc.splice(broken, "table", lc.README_BEGIN, lc.README_END)


def test_the_readme_s_line_credit_table_is_made_from_the_committed_records() -> None:
    """The README's line-credit table is bench/line_credit_collect.py's headline of the committed records, byte for
    byte (a hand edit, or a run committed without re-running the collector with --readme, fails here)."""
    lc = load_collector()
    readme = (ROOT / "README.md").read_text()
    between = readme.split(lc.README_BEGIN, 1)[1].split(lc.README_END, 1)[0]
    arms = lc.load_arms(ROOT / "docs" / "results" / "line_credit", CONTROL)
    assert between == "\n\n" + lc.headline(arms).strip() + "\n\n"


def test_the_collector_reads_the_committed_control_as_its_run_logged_it() -> None:
    """On the committed control runs: accuracy per level from the transcripts and the task's own levels (what the
    problem bootstrap resamples) equals the logged eval/accuracy_level<k>, and the lines the model typed, read from
    the text, equal the logged lines_per_episode."""
    from replrl.metrics import read_metrics

    lc = load_collector()
    runs = lc.load_runs(CONTROL)
    assert [r.seed for r in runs] == [0, 1, 2]
    for run in runs:
        final = run.final("programs")
        assert len(final) == 102 and run.before("programs") is not None and run.final("explore") is None
        levels = lc.problem_levels("programs", run.cfg)
        logged = next(r for r in read_metrics(run.path) if r["step"] == 12 and "eval/accuracy" in r)
        for k in (1, 2, 3):
            rows = {p for p, lv in levels.items() if lv == k}
            assert lc.share(lc.scores(final, rows)) == pytest.approx(logged[f"eval/accuracy_level{k}"], abs=1e-6)
        typed = sum(lc.typed_lines(e["text"]) for e in final) / len(final)
        assert typed == pytest.approx(logged["eval/lines_per_episode"], abs=1e-6)


def test_problems_are_paired_only_where_the_runs_asked_the_same_questions() -> None:
    """Rows pair problems across runs; a run evaluated on another copy of a dataset (other questions under the same
    rows) is not paired with the control, it is reported."""
    lc = load_collector()
    cfg = resolve(Config, str(CONTROL / "seed0" / "config.toml"), {})

    def run(variant: str, questions: list[str], correct: list[int]) -> object:
        episodes = [
            {"row": k, "correct": bool(c), "text": f"Problem: {q}<|im_end|>\n{BANNER}>>> submit(1)\n"}
            for k, (q, c) in enumerate(zip(questions, correct))
        ]
        return lc.RunRecords(variant, 0, Path(variant), cfg, [], {("eval", 12): episodes})

    control = [run("outcome_only", ["a?", "b?"], [0, 1])]
    assert (
        lc.paired_cell([run("tree", ["a?", "b?"], [1, 1])], control, "programs", None)
        == "+50.0 (1); problems [+0.0, +100.0]"
    )
    assert lc.paired_cell([run("tree", ["a?", "c?"], [1, 1])], control, "programs", None).startswith(
        "not the same problems"
    )


def test_the_committed_control_was_asked_today_s_problems_and_the_page_notes_a_banner_that_differs() -> None:
    """Arm 1 pairs new runs with the committed control problem by problem: every held-out `programs` prompt the
    control saw holds the header today's task builds for that row. The REPL banner in the prompt is the trainer's
    sys.version, which another machine may change: the page says so when the runs' banners differ."""
    from replrl.tasks import load_task

    lc = load_collector()
    rows = load_task("programs", level=0, seed=0).rows("test")
    task = load_task("programs", level=0, seed=0)
    for run in lc.load_runs(CONTROL):
        for label, step in run.episodes:
            if label == "eval":
                assert all(task.header(rows[int(e["row"])]) in e["text"] for e in run.episodes[(label, step)])
    assert lc.banner("Problem: ?\n" + BANNER + PLAIN) == "Python 3.11.7 (main) on linux"
    assert lc.banner(PLAIN) == ""
