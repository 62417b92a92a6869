"""`replrl compare` and `replrl plot`: the table's numbers against hand-computed ones on run directories written here,
gaps where a metric is absent (never a line across them). The comparison of a real sweep's output is in
tests/test_sweep.py, beside the sweep it reads."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import matplotlib.colors
import numpy as np
import pandas as pd
import pytest

from replrl.cli import main
from replrl.compare import compare, mean_ci, t975
from replrl.metrics import read_metrics
from replrl.plot import run_figure

# Final held-out values (the last evaluation row) of the synthetic sweep. The `shaped` runs live in directories
# a, b, c whose config.toml says their seed: pairing must follow run.seed, not directory order.
BASE_ACC = {0: 0.2, 1: 0.4, 2: 0.9}
SHAPED_ACC = {0: 0.5, 1: 0.6, 2: 0.9}
BASE_SYNTAX = {0: 0.1, 1: 0.1, 2: 0.1}
SHAPED_SYNTAX = {0: 0.05, 1: 0.15, 2: None}  # seed 2's last evaluation lacks it


def write_run(path: Path, seed: int, acc: float, syntax: float | None, *, no_submit_steps: tuple[int, ...],
              named_seed: bool = True, wall_s: float | None = None) -> Path:
    """A run directory: evaluations at steps 0 and 4, training steps 1-4 (4 episodes each); reward/no_submit is
    logged only at ``no_submit_steps``."""
    path.mkdir(parents=True)
    final = {"eval/accuracy": acc, **({"eval/syntax_error_rate": syntax} if syntax is not None else {}),
             "eval/exception_rate": 0.2}
    rows = [{"step": 0, "eval/accuracy": 0.0, "eval/syntax_error_rate": 0.5, "eval/exception_rate": 0.3}]
    for step in range(1, 5):
        row = {"step": step, "episodes": 4, "reward_mean": 0.1 * step + seed, "accuracy": 0.25,
               "syntax_error_rate": 0.3, "exception_rate": 0.1, "lines_per_episode": 2.0, "reward/syntax_error": -0.1}
        if step in no_submit_steps:
            row["reward/no_submit"] = -0.2 * step
        rows.append(row)
    rows.append({"step": 4, **final})
    if not named_seed:
        (path / "config.toml").write_text(f"[run]\nseed = {seed}\n")
    return write_metrics(path, rows, wall_s)


def write_metrics(path: Path, rows: list[dict], wall_s: float | None) -> Path:
    """metrics.jsonl of ``rows``, and a sweep record of ``wall_s`` seconds when it is given."""
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if wall_s is not None:
        (path / "sweep.json").write_text(json.dumps({"status": "done", "wall_s": wall_s}))
    return path


@pytest.fixture
def synthetic(tmp_path: Path) -> Path:
    sweep = tmp_path / "sweep"
    for seed in (0, 1, 2):
        write_run(sweep / "base" / f"seed{seed}", seed, BASE_ACC[seed], BASE_SYNTAX[seed], no_submit_steps=(1, 4),
                  wall_s=10.0 + seed)
    for name, seed in zip("abc", (2, 0, 1)):
        write_run(sweep / "shaped" / name, seed, SHAPED_ACC[seed], SHAPED_SYNTAX[seed], no_submit_steps=(1, 2, 4),
                  named_seed=False)
    (sweep / "sweep.json").write_text(json.dumps({"variants": ["shaped", "base"]}))  # the sweep's own order
    return sweep


def test_t_quantiles_match_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 5, 29, 30, 31, 50, 200):
        assert t975(df) == pytest.approx(stats.t.ppf(0.975, df), rel=2e-4)


def test_mean_ci_by_hand() -> None:
    # 0.2, 0.4, 0.9: mean 0.5, sd sqrt((0.09 + 0.01 + 0.16) / 2) = 0.360555; half width
    # t(0.975, 2) * sd / sqrt(3) = 4.302653 * 0.360555 / 1.732051 = 0.895669
    mean, lo, hi = mean_ci([0.2, 0.4, 0.9])
    assert (mean, lo, hi) == pytest.approx((0.5, 0.5 - 0.895669, 0.5 + 0.895669), abs=1e-6)
    assert mean_ci([0.3, math.nan])[0] == 0.3 and math.isnan(mean_ci([0.3])[1])  # one value: no interval


def test_table_numbers_by_hand(synthetic: Path, tmp_path: Path) -> None:
    fig, table = compare(synthetic, out=tmp_path / "out", baseline="base")
    rows = table.set_index("variant")
    assert list(table.variant) == ["shaped", "base"]  # sweep.json's order
    base, shaped = rows.loc["base"], rows.loc["shaped"]
    assert base.accuracy_mean == pytest.approx(0.5)
    assert (base.accuracy_lo, base.accuracy_hi) == pytest.approx((0.5 - 0.895669, 0.5 + 0.895669), abs=1e-6)
    # shaped: 0.5, 0.6, 0.9 -> mean 0.666667; sd sqrt((0.027778 + 0.004444 + 0.054444) / 2) = 0.208167;
    # half width 4.302653 * 0.208167 / 1.732051 = 0.517114
    assert shaped.accuracy_mean == pytest.approx(2 / 3)
    assert (shaped.accuracy_lo, shaped.accuracy_hi) == pytest.approx((2 / 3 - 0.517114, 2 / 3 + 0.517114),
                                                                     abs=1e-6)
    # paired by seed: 0.5-0.2, 0.6-0.4, 0.9-0.9 = 0.3, 0.2, 0.0 -> mean 0.166667, sd sqrt((0.017778 + 0.001111 +
    # 0.027778) / 2) = 0.152753, paired t-interval half width 4.302653 * 0.152753 / 1.732051 = 0.379458 (a
    # percentile bootstrap would give [0.0, 0.3], the range of the three differences)
    assert shaped.accuracy_diff == pytest.approx(1 / 6) and shaped.accuracy_pairs == 3
    assert (shaped.accuracy_diff_lo, shaped.accuracy_diff_hi) == pytest.approx((1 / 6 - 0.379458, 1 / 6 + 0.379458),
                                                                               abs=1e-6)
    assert math.isnan(base.accuracy_diff) and base.accuracy_pairs == 0
    # syntax errors: base 0.1 x3 (sd 0: the interval is the point); shaped 0.05, 0.15 and one missing ->
    # mean 0.1, half width 12.706205 * 0.070711 / 1.414214 = 0.635310; paired: -0.05, +0.05 -> 0, the same half width
    assert (base.syntax_error_rate_lo, base.syntax_error_rate_hi) == pytest.approx((0.1, 0.1))
    assert shaped.syntax_error_rate_mean == pytest.approx(0.1)
    assert shaped.syntax_error_rate_hi == pytest.approx(0.1 + 0.635310, abs=1e-6)
    assert shaped.syntax_error_rate_pairs == 2 and shaped.syntax_error_rate_diff == pytest.approx(0.0)
    assert (shaped.syntax_error_rate_diff_lo, shaped.syntax_error_rate_diff_hi) == pytest.approx((-0.635310, 0.635310),
                                                                                                 abs=1e-6)
    # per run: 4 training steps of 4 episodes; wall-clock from the sweep's record where there is one
    runs = pd.DataFrame(table.attrs["runs"])
    assert set(runs.steps) == {4} and set(runs.episodes) == {16}
    assert base.wall_s_mean == pytest.approx(11.0) and math.isnan(shaped.wall_s_mean)
    assert sorted(runs[runs.variant == "shaped"].seed) == [0, 1, 2]
    # the files: the CSVs hold the same numbers, the markdown shows the paired difference and its CI
    out = tmp_path / "out"
    assert pd.read_csv(out / "variants.csv").accuracy_diff.iloc[0] == pytest.approx(1 / 6)
    assert len(pd.read_csv(out / "runs.csv")) == 6
    md = (out / "summary.md").read_text()
    assert "| measure | `shaped` | `base` (baseline) |" in md
    assert ("| held-out accuracy | 0.667 [0.150, 1.184]<br>Δ +0.167 [-0.213, +0.546] (3) | "
            "0.500 [-0.396, 1.396] |") in md
    assert "| seeds | 3 | 3 |" in md and "| wall-clock s/run | - | 11 |" in md
    # only what these runs logged: no levels, no transfer, no training means, no eval/lines_per_episode
    assert [c for c in table.columns if c.endswith("_pairs")] == ["accuracy_pairs", "syntax_error_rate_pairs",
                                                                 "exception_rate_pairs"]
    assert "level 1" not in md and "transfer" not in md and "lines/episode" not in md
    assert (out / "compare.png").stat().st_size > 10_000


def write_rich_run(path: Path, *, neg: tuple[float | None, ...], step_s: tuple[float, ...],
                   levels: tuple[float | None, ...], transfer: float, sweep_wall_s: float | None = None) -> Path:
    """A run with the newer keys: an evaluation at step 0 (with a level-3 accuracy the last one may lack), training
    steps 1-3 (8 episodes, ``step_s``, ``adv/correct_negative_frac`` where ``neg`` has a value), and a last
    evaluation at step 3 with per-level accuracies, then a transfer evaluation, each with its time."""
    path.mkdir(parents=True)
    rows: list[dict] = [{"step": 0, "eval/accuracy": 0.1, "eval/accuracy_level3": 0.05, "eval/wall_s": 5.0}]
    for step in range(1, 4):
        row = {"step": step, "episodes": 8, "accuracy": 0.5, "step_s": step_s[step - 1]}
        if neg[step - 1] is not None:
            row["adv/correct_negative_frac"] = neg[step - 1]
        rows.append(row)
    final = {"step": 3, "eval/accuracy": 0.5, "eval/syntax_error_rate": 0.1, "eval/exception_rate": 0.2,
             "eval/wall_s": 7.0}
    final.update({f"eval/accuracy_level{i}": v for i, v in enumerate(levels, 1) if v is not None})
    # the trainer writes the transfer evaluation as a row of its own at the same step
    rows += [final, {"step": 3, "transfer/accuracy": transfer, "transfer/syntax_error_rate": 0.0,
                     "transfer/wall_s": 2.0}]
    return write_metrics(path, rows, sweep_wall_s)


@pytest.fixture
def rich(tmp_path: Path) -> Path:
    sweep = tmp_path / "rich"
    write_rich_run(sweep / "base" / "seed0", neg=(0.5, None, 0.3), step_s=(10, 20, 30), levels=(0.8, 0.5, 0.2),
                   transfer=0.2)
    write_rich_run(sweep / "base" / "seed1", neg=(0.0, 0.2, 0.4), step_s=(11, 12, 13), levels=(0.9, 0.4, 0.1),
                   transfer=0.4)
    write_rich_run(sweep / "blocks" / "seed0", neg=(0.1, 0.1, 0.1), step_s=(1, 2, 3), levels=(1.0, 0.6, 0.3),
                   transfer=0.3)
    write_rich_run(sweep / "blocks" / "seed1", neg=(None, 0.3, None), step_s=(1, 2, 3), levels=(0.7, 0.5, None),
                   transfer=0.3, sweep_wall_s=100.0)
    return sweep


def test_measures_by_hand(rich: Path, tmp_path: Path) -> None:
    _, table = compare(rich, out=tmp_path / "out")
    rows, runs = table.set_index("variant"), pd.DataFrame(table.attrs["runs"]).set_index(["variant", "seed"])
    base, blocks = rows.loc["base"], rows.loc["blocks"]
    # correct_negative_frac: the mean over the training steps that logged it
    # base: (0.5 + 0.3) / 2 = 0.4, (0.0 + 0.2 + 0.4) / 3 = 0.2; blocks: 0.1, 0.3 (its one logged step)
    assert list(runs.correct_negative_frac) == pytest.approx([0.4, 0.2, 0.1, 0.3])
    # base 0.4, 0.2 -> mean 0.3, half width 12.706205 * (0.2 / sqrt 2) / sqrt 2 = 1.270621; blocks 0.2 likewise
    assert (base.correct_negative_frac_mean, base.correct_negative_frac_lo) == pytest.approx((0.3, 0.3 - 1.270621))
    # paired: 0.1 - 0.4 = -0.3, 0.3 - 0.2 = 0.1 -> -0.1, sd 0.282843, half width 12.706205 * 0.282843 / 1.414214
    # = 2.541241
    assert blocks.correct_negative_frac_diff == pytest.approx(-0.1) and blocks.correct_negative_frac_pairs == 2
    assert (blocks.correct_negative_frac_diff_lo, blocks.correct_negative_frac_diff_hi) == pytest.approx(
        (-0.1 - 2.541241, -0.1 + 2.541241), abs=1e-6)
    # levels from the last evaluation; blocks/seed1's lacks level 3, so it has none (not step 0's 0.05)
    assert list(runs.accuracy_level1) == pytest.approx([0.8, 0.9, 1.0, 0.7])
    assert list(runs.accuracy_level2) == pytest.approx([0.5, 0.4, 0.6, 0.5])
    assert runs.loc[("blocks", 0), "accuracy_level3"] == pytest.approx(0.3)
    assert math.isnan(runs.loc[("blocks", 1), "accuracy_level3"])
    assert blocks.accuracy_level3_mean == pytest.approx(0.3) and math.isnan(blocks.accuracy_level3_lo)
    assert blocks.accuracy_level3_pairs == 1 and blocks.accuracy_level3_diff == pytest.approx(0.3 - 0.2)
    assert base.accuracy_level1_mean == pytest.approx(0.85) and blocks.accuracy_level1_diff == pytest.approx(0.0)
    assert list(runs.transfer_accuracy) == pytest.approx([0.2, 0.4, 0.3, 0.3])
    # measures no run logged are left out of the tables and the files
    out = tmp_path / "out"
    for absent in ("lines_per_episode", "correct_block_frac"):
        assert absent not in runs.columns and f"{absent}_mean" not in table.columns
        assert absent not in pd.read_csv(out / "runs.csv").columns
        assert f"{absent}_mean" not in pd.read_csv(out / "variants.csv").columns
    # wall-clock: the sweep's record where there is one, else step_s + eval/wall_s + transfer/wall_s
    # base/seed0: 10 + 20 + 30 + 5 + 7 + 2 = 74; base/seed1: 36 + 14 = 50; blocks/seed0: 6 + 14 = 20
    assert list(runs.wall_s) == pytest.approx([74.0, 50.0, 20.0, 100.0])
    assert list(runs.wall_s_source) == ["logged", "logged", "logged", "sweep"]
    assert base.wall_s_mean == pytest.approx(62.0) and blocks.wall_s_mean == pytest.approx(60.0)
    # the markdown: one row per present measure, in MEASURES' order, then the run counts; a column per variant
    md = (out / "summary.md").read_text()
    variants_table = md.split("\n\n")[1].splitlines()
    assert variants_table[0] == "| measure | `base` (baseline) | `blocks` |"
    labels = [line.split(" | ")[0].removeprefix("| ") for line in variants_table[2:]]
    assert labels == ["held-out accuracy", "held-out accuracy, level 1", "held-out accuracy, level 2",
                      "held-out accuracy, level 3", "transfer accuracy", "syntax errors/line", "exceptions/line",
                      "correct episodes with advantage < 0 (training mean)", "seeds", "steps/run", "episodes/run",
                      "wall-clock s/run"]
    assert variants_table[1] == "|---|---|---|" and all(line.count(" | ") == 2 for line in variants_table[2:])
    assert ("| correct episodes with advantage < 0 (training mean) | 0.300 [-0.971, 1.571] | "
            "0.200 [-1.071, 1.471]<br>Δ -0.100 [-2.641, +2.441] (2) |") in variants_table
    # one value, one pair: no interval
    assert ("| held-out accuracy, level 3 | 0.150 [-0.485, 0.785] | 0.300<br>Δ +0.100 (1) |"
            in variants_table)
    assert "| wall-clock s/run | 62 | 60 |" in variants_table and "| steps/run | 3 | 3 |" in variants_table
    assert "training mean: over its training steps" in md.splitlines()[0]
    # the runs table: a column per measure; a logged wall-clock is marked and explained
    runs_table = md.split("\n\n")[2].splitlines()
    assert runs_table[0].startswith("| variant | seed | steps | episodes | wall-clock s | held-out accuracy |")
    assert len(runs_table) == 6
    assert runs_table[2].startswith("| `base` | 0 | 3 | 24 | 74* | 0.500 | 0.800 | 0.500 | 0.200 | 0.200 | 0.100 | "
                                    "0.200 | 0.400 | ")
    assert "| 100 |" in runs_table[5] and md.rstrip().splitlines()[-1].startswith("\\* no sweep.json")


def test_final_value_takes_the_last_row_of_the_keys_kind() -> None:
    from replrl.compare import final_value, train_mean

    train = {"step": 2, "episodes": 4, "accuracy": 0.5, "adv/correct_negative_frac": 0.25}
    separate = [{"step": 0, "eval/accuracy": 0.1, "transfer/accuracy": 0.0}, train,
                {"step": 2, "eval/accuracy": 0.3}, {"step": 2, "transfer/accuracy": 0.2}]
    same_row = [separate[0], train, {"step": 2, "eval/accuracy": 0.3, "transfer/accuracy": 0.2}]
    for rows in (separate, same_row):
        assert final_value(rows, "eval/accuracy") == 0.3 and final_value(rows, "transfer/accuracy") == 0.2
        assert final_value(rows, "accuracy") == 0.5 and train_mean(rows, "adv/correct_negative_frac") == 0.25
    # the last evaluation without the key: missing, not the earlier value; never evaluated: missing
    assert math.isnan(final_value([*separate, {"step": 4, "transfer/wall_s": 1.0}], "transfer/accuracy"))
    assert math.isnan(final_value([train], "eval/accuracy")) and math.isnan(train_mean(separate, "step_s"))


def test_figures_recomputed_from_transcripts_fill_what_the_run_did_not_log(tmp_path: Path) -> None:
    """A run made before a measure existed: bench/shaping_collect.py's eval_figures.json (recomputed from its
    transcripts) fills the measure in; a value the run logged is never replaced."""
    run = write_run(tmp_path / "sweep" / "base" / "seed0", 0, 0.5, 0.1, no_submit_steps=(), wall_s=1.0)
    (run / "eval_figures.json").write_text(json.dumps({
        "eval@4": {"block_syntax_error_frac": 0.25, "accuracy": 0.99},
        "eval@0": {"block_syntax_error_frac": 0.75},
        "transfer@4": {"accuracy": 0.6},  # no transfer evaluation was logged: nothing to fill
        "bad": {"accuracy": 1.0}}))
    _, table = compare(tmp_path / "sweep", out=tmp_path / "out")
    runs = pd.DataFrame(table.attrs["runs"]).set_index(["variant", "seed"])
    assert runs.loc[("base", 0), "block_syntax_error_frac"] == pytest.approx(0.25)  # step 4's, not step 0's
    assert runs.loc[("base", 0), "accuracy"] == pytest.approx(0.5)                   # logged, kept
    assert "transfer_accuracy" not in runs.columns
    assert "| episodes that opened a block and hit a syntax error in it | 0.250 |" in (
        tmp_path / "out" / "summary.md").read_text()


def test_absent_values_are_gaps_not_bridged(synthetic: Path) -> None:
    fig, _ = compare(synthetic)
    by_title = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    ax = by_title["reward/no_submit (mean per episode)"]
    lines = {line.get_label().split(" ")[0]: line for line in ax.lines}
    # base logged reward/no_submit at steps 1 and 4 only (every seed): steps 2-3 are NaN, so no segment joins 1-4
    x, y = lines["base"].get_xdata(), lines["base"].get_ydata()
    assert list(x) == [1, 2, 3, 4]
    assert y[0] == pytest.approx(-0.2) and y[3] == pytest.approx(-0.8) and np.isnan(y[1]) and np.isnan(y[2])
    # shaped logged it at 1, 2 and 4
    assert np.isnan(lines["shaped"].get_ydata()[2]) and not np.isnan(lines["shaped"].get_ydata()[1])
    # held-out accuracy is drawn over the evaluation steps (0 and 4), mean over seeds
    acc = {line.get_label().split(" ")[0]: line for line in by_title["held-out accuracy"].lines}
    assert list(acc["base"].get_xdata()) == [0, 4] and acc["base"].get_ydata()[1] == pytest.approx(0.5)
    # replrl plot (one run) leaves the same gap
    rows = read_metrics(synthetic / "base" / "seed0")
    run_fig = run_figure(rows)
    (panel,) = [a for a in run_fig.axes if a.get_title().startswith("reward terms")]
    (no_submit,) = [line for line in panel.lines if line.get_label() == "reward/no_submit"]
    assert list(no_submit.get_xdata()) == [1, 2, 3, 4] and np.isnan(no_submit.get_ydata()[1:3]).all()


def test_the_figure_shows_each_seed_and_scales_to_the_lines_not_the_bands(synthetic: Path) -> None:
    fig, _ = compare(synthetic)
    ax = {a.get_title(): a for a in fig.axes if a.get_visible()}["held-out accuracy"]
    seeds = [line for line in ax.lines if line.get_label().startswith("_")]      # thin, out of the legend
    assert sorted(line.get_label() for line in seeds) == ["_base seed"] * 3 + ["_shaped seed"] * 3
    # base's final accuracies 0.2, 0.4, 0.9: mean 0.5 +- 0.896, a band clipped to what a share can be
    ys = np.concatenate([c.get_paths()[0].vertices[:, 1] for c in ax.collections])
    assert ys.min() >= 0.0 and ys.max() <= 1.0 and ys.max() == pytest.approx(1.0)
    # the y-range is that of the lines (every seed's and mean's values), padded by 8%, not the band's [0, 1]
    drawn = np.concatenate([line.get_ydata() for line in ax.lines]).astype(float)
    lo, hi = np.nanmin(drawn), np.nanmax(drawn)
    assert ax.get_ylim() == pytest.approx((lo - 0.08 * (hi - lo), hi + 0.08 * (hi - lo)))


def test_two_seeds_get_their_lines_and_no_band(synthetic: Path) -> None:
    """With 2 seeds the band would be the mean +- 6.4 times their difference: the thin seed lines show it instead."""
    shutil.rmtree(synthetic / "base" / "seed2")
    fig, _ = compare(synthetic)
    ax = {a.get_title(): a for a in fig.axes if a.get_visible()}["held-out accuracy"]
    assert sorted(line.get_label() for line in ax.lines if line.get_label().startswith("_")) == \
        ["_base seed"] * 2 + ["_shaped seed"] * 3
    bands = [c for c in ax.collections if c.get_paths()]
    assert len(bands) == 1 and bands[0].get_facecolor()[0][:3] == pytest.approx(matplotlib.colors.to_rgb("C0"))


def test_markers_show_isolated_points_of_long_series() -> None:
    from replrl.plot import markevery

    assert markevery([1.0, math.nan, 2.0]) is None  # short: a marker on every point
    values = [1.0] * 10 + [math.nan, 5.0, math.nan] + [2.0] * 20 + [math.nan, 3.0]
    every = markevery(values)
    assert [i for i, shown in enumerate(every) if shown] == [11, 34]  # only points no segment would show


def test_single_runs_are_their_own_variants(synthetic: Path) -> None:
    _, table = compare([synthetic / "base" / "seed0", synthetic / "shaped" / "b"])
    assert list(table.variant) == ["seed0", "b"] and list(table.seeds) == [1, 1]
    # both have seed 0 (b's config says so): one pair, 0.5 - 0.2
    assert table.set_index("variant").loc["b", "accuracy_diff"] == pytest.approx(0.3)


def test_compare_cli(synthetic: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["compare", str(synthetic), "--out", str(tmp_path / "c"), "--baseline", "base"]) == 0
    assert "+0.167 [-0.213, +0.546] (3)" in capsys.readouterr().out
    for argv, message in [(["compare", str(tmp_path / "nothing"), "--out", str(tmp_path / "d")], "not a directory"),
                          (["compare", str(tmp_path / "c"), "--out", str(tmp_path / "d")], "no runs in"),
                          (["compare", str(synthetic), "--out", str(tmp_path / "d"), "--baseline", "bse"],
                           "baseline 'bse' is not a variant here")]:
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_transfer_rows_at_a_training_step_leave_the_training_curves_whole() -> None:
    """The trainer writes a step's training row, then its eval/ row and its transfer/ row: each metric is read
    from the rows of its own kind, so neither held-out row blanks the training value or the other's."""
    from replrl.plot import step_series

    rows = [{"step": 1, "episodes": 4, "reward_mean": 0.5}, {"step": 1, "eval/accuracy": 0.3},
            {"step": 1, "transfer/accuracy": 0.2}, {"step": 2, "episodes": 4, "reward_mean": 0.7}]
    assert step_series(rows, "reward_mean") == ([1, 2], [0.5, 0.7])
    assert step_series(rows, "eval/accuracy") == ([1], [0.3])
    assert step_series(rows, "transfer/accuracy") == ([1], [0.2])


def test_extra_held_out_rows_are_a_kind_of_their_own_and_drawn_beside_the_first() -> None:
    """A run.extra_eval task's row (eval_explore/...) is neither a training row nor the first held-out task's: the
    curves read each from its own kind, and the accuracy panel draws it beside eval/accuracy."""
    from replrl.metrics import held_out_labels, held_out_prefix
    from replrl.plot import run_figure, step_series

    rows = [{"step": 0, "eval/accuracy": 0.1}, {"step": 0, "eval_explore/accuracy": 0.2},
            {"step": 1, "episodes": 4, "reward_mean": 0.5, "accuracy": 0.5}, {"step": 1, "eval/accuracy": 0.3},
            {"step": 1, "eval_explore/accuracy": 0.4, "eval_explore/accuracy_level1": 1.0}]
    assert [held_out_prefix(k) for k in ("eval/accuracy", "eval_explore/accuracy", "reward/correct", "eval_x")] == \
        ["eval/", "eval_explore/", "", ""]
    assert held_out_labels(rows[-1]) == {"eval_explore"} and held_out_labels(rows[2]) == set()
    assert step_series(rows, "reward_mean") == ([1], [0.5])
    assert step_series(rows, "eval/accuracy") == ([0, 1], [0.1, 0.3])
    assert step_series(rows, "eval_explore/accuracy") == ([0, 1], [0.2, 0.4])
    panel = next(ax for ax in run_figure(rows).axes if ax.get_title() == "answer accuracy")
    assert {line.get_label(): list(line.get_ydata()) for line in panel.lines} == {
        "accuracy": [0.5], "eval/accuracy": [0.1, 0.3], "eval_explore/accuracy": [0.2, 0.4]}
