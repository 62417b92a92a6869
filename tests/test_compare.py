"""`replrl compare` and `replrl plot`: the table's numbers against hand-computed ones on run directories written here,
gaps where a metric is absent (never a line across them), and one comparison of a real sweep's output."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from replrl.cli import main
from replrl.compare import bootstrap_ci, compare, mean_ci, t975
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
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if not named_seed:
        (path / "config.toml").write_text(f"[run]\nseed = {seed}\n")
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


def test_mean_ci_and_bootstrap_by_hand() -> None:
    # 0.2, 0.4, 0.9: mean 0.5, sd sqrt((0.09 + 0.01 + 0.16) / 2) = 0.360555; half width
    # t(0.975, 2) * sd / sqrt(3) = 4.302653 * 0.360555 / 1.732051 = 0.895669
    mean, lo, hi = mean_ci([0.2, 0.4, 0.9])
    assert (mean, lo, hi) == pytest.approx((0.5, 0.5 - 0.895669, 0.5 + 0.895669), abs=1e-6)
    assert mean_ci([0.3, math.nan])[0] == 0.3 and math.isnan(mean_ci([0.3])[1])  # one value: no interval
    # Exact bootstrap of two values a, b: resampled means a, (a+b)/2, b with probabilities 1/4, 1/2, 1/4, so the
    # 2.5% and 97.5% points are a and b; at level 0.4 (30% and 70% points) both are (a+b)/2.
    assert bootstrap_ci([1.0, 3.0]) == (1.0, 3.0)
    assert bootstrap_ci([1.0, 3.0], level=0.4) == (2.0, 2.0)
    # Three values: all three draws equal to the smallest has probability 1/27 = 3.7% > 2.5%: [min, max].
    assert bootstrap_ci([0.3, 0.2, 0.0]) == pytest.approx((0.0, 0.3))
    # Five values: the exact distribution puts the 2.5% point above the minimum (1/3125 of the mass is there).
    five = [0.0, 1.0, 2.0, 3.0, 10.0]
    lo, hi = bootstrap_ci(five)
    assert 0.0 < lo < np.mean(five) < hi < 10.0
    # Many values: seeded resampling, the same every time, close to the normal interval of the mean.
    many = list(np.linspace(0, 1, 40))
    assert bootstrap_ci(many) == bootstrap_ci(many)
    se = np.std(many) / math.sqrt(40)
    assert bootstrap_ci(many) == pytest.approx((0.5 - 1.96 * se, 0.5 + 1.96 * se), abs=0.02)


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
    # paired by seed: 0.5-0.2, 0.6-0.4, 0.9-0.9 = 0.3, 0.2, 0.0 -> mean 0.166667, exact bootstrap [0.0, 0.3]
    assert shaped.accuracy_diff == pytest.approx(1 / 6) and shaped.accuracy_pairs == 3
    assert (shaped.accuracy_diff_lo, shaped.accuracy_diff_hi) == pytest.approx((0.0, 0.3))
    assert math.isnan(base.accuracy_diff) and base.accuracy_pairs == 0
    # syntax errors: base 0.1 x3 (sd 0: the interval is the point); shaped 0.05, 0.15 and one missing ->
    # mean 0.1, half width 12.706205 * 0.070711 / 1.414214 = 0.635310; paired: -0.05, +0.05 -> 0 [-0.05, 0.05]
    assert (base.syntax_error_rate_lo, base.syntax_error_rate_hi) == pytest.approx((0.1, 0.1))
    assert shaped.syntax_error_rate_mean == pytest.approx(0.1)
    assert shaped.syntax_error_rate_hi == pytest.approx(0.1 + 0.635310, abs=1e-6)
    assert shaped.syntax_error_rate_pairs == 2 and shaped.syntax_error_rate_diff == pytest.approx(0.0)
    assert (shaped.syntax_error_rate_diff_lo, shaped.syntax_error_rate_diff_hi) == pytest.approx((-0.05, 0.05))
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
    assert "| `shaped` | 3 | 0.667 [0.150, 1.184] | +0.167 [+0.000, +0.300] (3) |" in md
    assert (out / "compare.png").stat().st_size > 10_000


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
    assert "+0.167 [+0.000, +0.300] (3)" in capsys.readouterr().out
    for argv, message in [(["compare", str(tmp_path / "nothing"), "--out", str(tmp_path / "d")], "not a directory"),
                          (["compare", str(tmp_path / "c"), "--out", str(tmp_path / "d")], "no runs in"),
                          (["compare", str(synthetic), "--out", str(tmp_path / "d"), "--baseline", "bse"],
                           "baseline 'bse' is not a variant here")]:
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_compare_a_real_sweep(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The smoke sweep's own output (run once per test session, shared with tests/test_sweep.py)."""
    from tests.test_sweep import smoke_sweep_dir

    out, _ = smoke_sweep_dir(tmp_path_factory)
    fig, table = compare(out, out=tmp_path / "cmp")
    assert list(table.variant) == ["base", "no_syntax_penalty"] and list(table.seeds) == [2, 2]
    runs = pd.DataFrame(table.attrs["runs"])
    assert set(runs.steps) == {2} and (runs.wall_s > 0).all() and (runs.episodes == 4).all()
    assert table.accuracy_pairs.iloc[1] == 2 and not np.isnan(table.accuracy_mean).any()
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert "held-out accuracy" in titles and "reward/no_submit (mean per episode)" in titles
    assert (tmp_path / "cmp" / "compare.png").exists()
