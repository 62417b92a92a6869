"""Compare variants over seeds: curves with 95% bands, and a table of each run's final measures with confidence
intervals and differences to a baseline paired by seed.

    fig, table = compare("runs/sweep", out="runs/sweep/compare")     # or compare([run_a, run_b, ...])

Runs are grouped into variants by directory: a sweep directory holds ``<variant>/seed<k>`` runs, a variant
directory holds ``seed<k>`` runs, and a run directory given alone is a variant of its own. A run's seed is its
config's ``run.seed`` (else the k of ``seed<k>``); the paired difference to the baseline uses the seeds both have.

The table's measures (MEASURES), one number per run:
- from the run's last held-out evaluation: ``eval/accuracy``, ``eval/accuracy_level1..3`` (per difficulty level),
  ``eval/syntax_error_rate``, ``eval/exception_rate``, ``eval/lines_per_episode``, ``eval/correct_block_frac``
  (the share of correct episodes that used a multi-line block), ``eval/block_syntax_error_frac`` (the share of
  episodes that opened a block and hit a syntax error inside it: the REPL's block rule broken);
- from its last transfer evaluation (a second task): ``transfer/accuracy``;
- from the last evaluation of each run.extra_eval task: ``eval_<label>/accuracy`` and per level (EXTRA_KEYS), as
  ``<label>_accuracy``, ``<label>_accuracy_level<k>``;
- over its training steps, the mean of ``adv/correct_negative_frac`` (correct episodes given a negative advantage).
A value missing from that last evaluation is missing for the run (not taken from an earlier one). A measure no run
has is left out; accuracy, syntax_error_rate and exception_rate are always there. A run's wall-clock is its sweep's
record (``sweep.json``, the process's own) when there is one, else the sum of its logged ``step_s``, ``eval/wall_s``
and ``transfer/wall_s`` (which leaves out start-up, model loading and checkpoints).

Statistics, per variant, over its seeds (n of them):
- curves: at each step, the mean of the seeds that logged the measure there, and a 95% t-interval band
  (mean +- t(0.975, n-1) * sd / sqrt(n); drawn from 3 seeds on, see MIN_BAND_SEEDS). A step where no seed logged
  it is a gap.
- table: each measure's mean and 95% t-interval over seeds; the difference to the baseline paired by seed, mean
  and 95% paired t-interval over the seed pairs (no interval for one pair). Not a bootstrap: at the 2-5 seeds a
  sweep affords, a percentile bootstrap's "95%" interval is about the range of the differences (for 3 pairs,
  exactly [min, max]), which holds the mean about 75% of the time.
- ``paired_bootstrap``: a different question, for held-out accuracy where every run was evaluated on the same
  problems: a 95% interval from resampling the problems (not the seeds), paired across runs. It says how much a
  difference owes to which problems the held-out set holds (bench/line_credit_collect.py shows it beside the
  t-interval over seeds).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from .metrics import read_metrics
from .plot import markevery, row_kind, step_series

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CURVES = [  # (panel title, metric)
    ("reward (mean per episode)", "reward_mean"),
    ("held-out accuracy", "eval/accuracy"),
    ("accuracy (training episodes)", "accuracy"),
    ("syntax errors per line", "syntax_error_rate"),
    ("exceptions per line", "exception_rate"),
    ("lines per episode", "lines_per_episode"),
]
SHARES = {"eval/accuracy", "accuracy", "syntax_error_rate", "exception_rate"}
"""Curves that are shares (0 to 1): their bands are clipped to that range."""

MIN_BAND_SEEDS = 3
"""Seeds a variant needs for a band in the figure. With 2 the 95% t-interval is the mean +- 6.4 times the two
seeds' difference (t = 12.7): a band over the whole panel, hiding the other variants, where the two thin seed
lines already show the spread."""


class Measure(NamedTuple):
    col: str  # the table's column (``<col>_mean``, ``<col>_lo``, ... in the variants table)
    key: str  # the logged metric
    how: str  # "final": the run's last evaluation of the key's kind; "train_mean": mean over its training steps
    label: str  # its name in summary.md


MEASURES = [
    Measure("accuracy", "eval/accuracy", "final", "held-out accuracy"),
    Measure("accuracy_level1", "eval/accuracy_level1", "final", "held-out accuracy, level 1"),
    Measure("accuracy_level2", "eval/accuracy_level2", "final", "held-out accuracy, level 2"),
    Measure("accuracy_level3", "eval/accuracy_level3", "final", "held-out accuracy, level 3"),
    Measure("transfer_accuracy", "transfer/accuracy", "final", "transfer accuracy"),
    Measure("syntax_error_rate", "eval/syntax_error_rate", "final", "syntax errors/line"),
    Measure("exception_rate", "eval/exception_rate", "final", "exceptions/line"),
    Measure("lines_per_episode", "eval/lines_per_episode", "final", "lines/episode"),
    Measure("correct_block_frac", "eval/correct_block_frac", "final", "correct episodes using a block"),
    Measure("block_syntax_error_frac", "eval/block_syntax_error_frac", "final",
            "episodes that opened a block and hit a syntax error in it"),
    Measure("correct_negative_frac", "adv/correct_negative_frac", "train_mean",
            "correct episodes with advantage < 0 (training mean)"),
]
ALWAYS = ("accuracy", "syntax_error_rate", "exception_rate")
"""Measures kept in the tables even when no run has them (the columns callers have always had)."""
WALL_KEYS = ("step_s", "eval/wall_s", "transfer/wall_s")
"""Logged seconds whose sum is a run's wall-clock when its sweep recorded none (with each run.extra_eval task's
``eval_<label>/wall_s``)."""
EXTRA_KEYS = ("accuracy", "accuracy_level1", "accuracy_level2", "accuracy_level3")
"""What the tables take from each run.extra_eval task's last evaluation (``eval_<label>/accuracy`` ...)."""


def extra_measures(variants: dict[str, list[RunData]]) -> list[Measure]:
    """Measures of the run.extra_eval tasks some run logged: ``<label>_accuracy`` (``eval_<label>/accuracy``) and
    per level, labels in the order first met."""
    labels: dict[str, None] = {}
    for runs in variants.values():
        for r in runs:
            for row in r.rows:
                for key in row:
                    if (prefix := row_kind(key)).startswith("eval_"):
                        labels.setdefault(prefix[len("eval_"):-1])
    return [Measure(f"{label}_{k}", f"eval_{label}/{k}", "final",
                    f"{label} accuracy" + (f", level {k[-1]}" if k != "accuracy" else ""))
            for label in labels for k in EXTRA_KEYS]

T975 = [12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157, 2.228139,
        2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922, 2.093024, 2.085963,
        2.079614, 2.073873, 2.068658, 2.063899, 2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272]
"""The 0.975 quantile of Student's t with 1..30 degrees of freedom."""


@dataclass
class RunData:
    variant: str
    seed: int
    path: Path
    rows: list[dict[str, Any]] = field(repr=False)
    record: dict[str, Any] = field(default_factory=dict, repr=False)
    """The sweep's ``sweep.json`` of the run (wall-clock), empty for a run made outside a sweep."""


# -- statistics ---------------------------------------------------------------------------------------------------
def t975(df: int) -> float:
    """The 0.975 quantile of Student's t (beyond 30 degrees of freedom, the Cornish-Fisher expansion)."""
    if df < 1:
        return math.nan
    if df <= len(T975):
        return T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def mean_ci(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% t-interval of the mean of the finite values (NaN bounds for fewer than 2)."""
    import numpy as np

    x = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if len(x) == 0:
        return math.nan, math.nan, math.nan
    mean = float(x.mean())
    if len(x) < 2:
        return mean, math.nan, math.nan
    half = t975(len(x) - 1) * float(x.std(ddof=1)) / math.sqrt(len(x))
    return mean, mean - half, mean + half


def paired_bootstrap(variant: Sequence[Sequence[float]], control: Sequence[Sequence[float]], n_boot: int = 10000,
                     seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the difference variant minus control in a share over problems, averaged over seed pairs,
    with a 95% percentile interval from resampling the problems. ``variant[k][p]`` and ``control[k][p]``: the k-th
    seed pair's score on problem p (1 correct, 0 not); every run was evaluated on the same problems, so one resample
    of problems applies to every run (paired). The mean equals the mean over seed pairs of the accuracy differences.

    It says how much the difference depends on which problems the held-out set happens to hold; the t-interval over
    seeds (``mean_ci`` of the per-seed differences) says how much it depends on the seed. Report both: neither
    contains the other."""
    import numpy as np

    v, c = np.asarray(variant, dtype=float), np.asarray(control, dtype=float)  # [S, P] each
    if v.ndim != 2 or v.shape != c.shape or v.size == 0:
        raise ValueError(f"variant and control must be [seed pairs, problems] of one shape; got {v.shape}, {c.shape}")
    d = (v - c).mean(0)                                                     # [P]: mean over seed pairs
    picks = np.random.default_rng(seed).integers(0, len(d), size=(n_boot, len(d)))  # [n_boot, P]
    lo, hi = np.percentile(d[picks].mean(1), [2.5, 97.5])
    return float(d.mean()), float(lo), float(hi)


# -- runs on disk -------------------------------------------------------------------------------------------------
def _is_run(path: Path) -> bool:
    return (path / "metrics.jsonl").is_file()


def _run_seed(path: Path, fallback: int) -> int:
    try:
        with open(path / "config.toml", "rb") as f:
            return int(tomllib.load(f)["run"]["seed"])
    except (OSError, KeyError, ValueError, TypeError, tomllib.TOMLDecodeError):
        match = re.fullmatch(r"seed(\d+)", path.name)
        return int(match.group(1)) if match else fallback


def _load_run(variant: str, path: Path, index: int) -> RunData:
    try:
        record = json.loads((path / "sweep.json").read_text())
    except (OSError, json.JSONDecodeError):
        record = {}
    return RunData(variant, _run_seed(path, index), path, _fill_recomputed(read_metrics(path), path), record)


def _fill_recomputed(rows: list[dict[str, Any]], path: Path) -> list[dict[str, Any]]:
    """``rows`` with the held-out figures that the run's ``eval_figures.json`` has (recomputed from its transcripts
    by ``bench/shaping_collect.py``, e.g. a measure added after the run was made) and the logged row of that
    evaluation lacks. A logged value always wins."""
    try:
        figures = json.loads((path / "eval_figures.json").read_text())
    except (OSError, json.JSONDecodeError):
        return rows
    for key, values in figures.items() if isinstance(figures, dict) else ():
        kind, _, step = key.partition("@")
        if not step.isdigit() or not isinstance(values, dict):
            continue
        logged = [r for r in rows if r.get("step") == int(step) and any(k.startswith(f"{kind}/") for k in r)]
        if logged:  # the last row of that evaluation (a resumed run's repeated evaluation counts once, the last)
            for name, value in values.items():
                logged[-1].setdefault(f"{kind}/{name}", value)
    return rows


def _subdirs(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir())


def discover(paths: str | Path | Sequence[str | Path]) -> dict[str, list[RunData]]:
    """{variant: its runs}, variants in the order given (a sweep's own order, from its sweep.json, first)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    groups: dict[str, list[Path]] = {}
    for given in map(Path, paths):
        if not given.is_dir():
            raise FileNotFoundError(f"{given} is not a directory (expected a sweep, a variant or a run directory)")
        if _is_run(given):
            found = {given.name: [given]}
        elif any(_is_run(p) for p in _subdirs(given)):
            found = {given.name: [p for p in _subdirs(given) if _is_run(p)]}
        else:
            found = {v.name: runs for v in _subdirs(given) if (runs := [p for p in _subdirs(v) if _is_run(p)])}
            found = {k: found[k] for k in [*_sweep_order(given), *found] if k in found}
        if not found:
            raise FileNotFoundError(f"no runs in {given}: expected metrics.jsonl in it, in its subdirectories "
                                    "(seed<k>), or in theirs (<variant>/seed<k>)")
        for name, runs in found.items():
            key = name if name not in groups else f"{given.name}/{name}"
            if key in groups:
                raise ValueError(f"variant {key!r} given twice")
            groups[key] = runs
    return {v: [_load_run(v, p, i) for i, p in enumerate(runs)] for v, runs in groups.items()}


def _sweep_order(path: Path) -> list[str]:
    try:
        return list(json.loads((path / "sweep.json").read_text()).get("variants", []))
    except (OSError, json.JSONDecodeError, AttributeError):
        return []


def final_value(rows: Sequence[dict[str, Any]], key: str) -> float:
    """The metric in the run's last row of its kind: the last evaluation (``eval/``) or transfer evaluation
    (``transfer/``) for such a key, the last training row otherwise. NaN when there is none, or when that row lacks
    it. Rows repeated at one step (a resumed run's evaluation) count once, the last one."""
    steps, values = step_series(rows, key)
    return values[-1] if steps else math.nan


def _logged(rows: Sequence[dict[str, Any]], key: str) -> list[float]:
    """The finite values of one metric, one per step (the last row that has it)."""
    by_step = {int(r["step"]): r[key] for r in rows if "step" in r and isinstance(r.get(key), (int, float))}
    return [float(v) for v in by_step.values() if math.isfinite(v)]


def train_mean(rows: Sequence[dict[str, Any]], key: str) -> float:
    """The mean of a training metric over the steps that logged it (NaN when none did)."""
    values = _logged(rows, key)
    return sum(values) / len(values) if values else math.nan


def measure_value(rows: Sequence[dict[str, Any]], measure: Measure) -> float:
    return train_mean(rows, measure.key) if measure.how == "train_mean" else final_value(rows, measure.key)


def wall_clock(run: RunData) -> tuple[float, str]:
    """(seconds, source): the sweep's record of the process (``"sweep"``), else the sum of the logged step and
    evaluation times (``"logged"``), else (NaN, ``""``)."""
    recorded = run.record.get("wall_s")
    if isinstance(recorded, (int, float)):
        return float(recorded), "sweep"
    extra = sorted({k for row in run.rows for k in row if row_kind(k).startswith("eval_") and k.endswith("/wall_s")})
    logged = [v for key in (*WALL_KEYS, *extra) for v in _logged(run.rows, key)]
    return (float(sum(logged)), "logged") if logged else (math.nan, "")


def train_steps(rows: Sequence[dict[str, Any]]) -> tuple[int, int]:
    """(last training step, episodes over all training steps)."""
    by_step = {int(r["step"]): r for r in rows if "episodes" in r and "step" in r}
    return max(by_step, default=0), sum(int(r["episodes"]) for r in by_step.values())


# -- the comparison -----------------------------------------------------------------------------------------------
def variant_curve(runs: Sequence[RunData], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """(steps, mean, band low, band high) of one metric over a variant's seeds: at each step logged by any seed,
    the mean and 95% t-interval of the seeds that have a value there (NaN where none has)."""
    per_run = [dict(zip(*step_series(r.rows, key))) for r in runs]
    steps = sorted({s for d in per_run for s in d})
    mean, low, high = [], [], []
    for s in steps:
        m, lo, hi = mean_ci([d.get(s, math.nan) for d in per_run])
        mean.append(m)
        low.append(lo)
        high.append(hi)
    return steps, mean, low, high


def reward_terms(variants: dict[str, list[RunData]]) -> list[str]:
    return sorted({k for runs in variants.values() for r in runs for row in r.rows for k in row
                   if k.startswith("reward/")})


def figure(variants: dict[str, list[RunData]], title: str = "") -> Any:
    """One panel per measure (CURVES, then each reward term); per variant its mean over seeds (thick), each seed
    (thin, where there are several) and, from MIN_BAND_SEEDS seeds on, a 95% band. A panel's y-range is that of
    the lines, not of the bands: with 3 seeds a t-interval is often far wider than anything a seed logged, and a
    panel scaled to it shows nothing else; such a band then runs to the panel's edges."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = CURVES + [(f"{key} (mean per episode)", key) for key in reward_terms(variants)]
    cols = 3
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(5 * cols, 3.4 * rows))
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    colors = [f"C{i % 10}" for i in range(len(variants))]
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax, (name, key) in zip(axes, panels):
        drawn: list[float] = []  # every value a line shows: the y-range
        for color, (variant, runs) in zip(colors, variants.items()):
            steps, mean, low, high = variant_curve(runs, key)
            if not any(not math.isnan(v) for v in mean):
                continue
            if key in SHARES:
                low = [v if math.isnan(v) else max(v, 0.0) for v in low]
                high = [v if math.isnan(v) else min(v, 1.0) for v in high]
            if len(runs) > 1:
                for run in runs:
                    seed_steps, values = step_series(run.rows, key)
                    dots = "." if sum(not math.isnan(v) for v in values) < 3 else None  # a point is no line
                    ax.plot(seed_steps, values, color=color, linewidth=0.7, alpha=0.35, marker=dots,
                            label=f"_{variant} seed")
                    drawn += values
            every = markevery(mean)
            ax.plot(steps, mean, color=color, marker="o", ms=3, markevery=every, label=f"{variant} (n={len(runs)})")
            if len(runs) >= MIN_BAND_SEEDS:
                ax.fill_between(steps, low, high, color=color, alpha=0.2, linewidth=0)
            drawn += mean
        finite = [v for v in drawn if not math.isnan(v)]
        if finite:
            lo, hi = min(finite), max(finite)
            pad = 0.08 * (hi - lo) if hi > lo else 0.05 * max(abs(hi), 1.0)
            ax.set_ylim(lo - pad, hi + pad)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if not ax.lines:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
    with_lines = [ax for ax in axes if ax.lines]
    if with_lines:
        fig.legend(*with_lines[0].get_legend_handles_labels(), loc="upper right", fontsize=9)
    fig.suptitle(title or f"mean over seeds (thin: each seed), 95% t-interval band from {MIN_BAND_SEEDS} seeds",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0, 0.88, 0.97))
    return fig


def tables(variants: dict[str, list[RunData]], baseline: str) -> tuple[Any, Any]:
    """(one row per variant, one row per run) as DataFrames, with the measures some run has (and ALWAYS)."""
    import pandas as pd

    all_measures = [*MEASURES, *extra_measures(variants)]
    runs = []
    for variant, rs in variants.items():
        for r in rs:
            steps, episodes = train_steps(r.rows)
            wall_s, wall_source = wall_clock(r)
            runs.append({"variant": variant, "seed": r.seed, "steps": steps, "episodes": episodes,
                         "wall_s": wall_s, "wall_s_source": wall_source,
                         **{m.col: measure_value(r.rows, m) for m in all_measures}, "run_dir": str(r.path)})
    per_run = pd.DataFrame(runs)
    absent = [m.col for m in all_measures if m.col not in ALWAYS and per_run[m.col].isna().all()]
    per_run = per_run.drop(columns=absent)
    measures = [m for m in all_measures if m.col not in absent]
    base = per_run[per_run.variant == baseline].set_index("seed")
    rows = []
    for variant, group in per_run.groupby("variant", sort=False):
        row: dict[str, Any] = {"variant": variant, "seeds": len(group)}
        mine = group.set_index("seed")
        paired = [s for s in mine.index if s in base.index]
        for m in measures:
            col = m.col
            row[f"{col}_mean"], row[f"{col}_lo"], row[f"{col}_hi"] = mean_ci(list(group[col]))
            diffs = [mine.at[s, col] - base.at[s, col] for s in paired] if variant != baseline else []
            diffs = [d for d in diffs if not math.isnan(d)]
            row[f"{col}_diff"] = float(sum(diffs) / len(diffs)) if diffs else math.nan
            _, row[f"{col}_diff_lo"], row[f"{col}_diff_hi"] = mean_ci(diffs)
            row[f"{col}_pairs"] = len(diffs)
        for col in ("wall_s", "steps", "episodes"):
            row[f"{col}_mean"] = float(group[col].mean())
        rows.append(row)
    table = pd.DataFrame(rows)
    table.attrs["measures"] = measures
    return table, per_run


def markdown(table: Any, per_run: Any, baseline: str) -> str:
    """The two tables as markdown. Variants: one row per measure, one column per variant (mean and CI; below it,
    for the others, the paired difference to the baseline), then seeds, steps, episodes and wall-clock per run.
    Runs: one row each."""
    def num(v: float, sign: bool = False) -> str:
        return "-" if v is None or math.isnan(v) else (f"{v:+.3f}" if sign else f"{v:.3f}")

    def ci(lo: float, hi: float, sign: bool = False) -> str:
        return "" if math.isnan(lo) else f" [{num(lo, sign)}, {num(hi, sign)}]"

    def row(cells: list[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    measures = [m for m in table.attrs.get("measures", MEASURES) if f"{m.col}_mean" in table.columns]
    records = table.to_dict("records")
    head = ["measure"] + [f"`{r['variant']}`" + (" (baseline)" if r["variant"] == baseline else "") for r in records]
    notes = []
    if any(row_kind(m.key) == "transfer/" for m in measures):
        notes.append("transfer: its last evaluation on the transfer task")
    if any(row_kind(m.key).startswith("eval_") for m in measures):
        notes.append("<label> accuracy: its last evaluation on that run.extra_eval task")
    if any(m.how == "train_mean" for m in measures):
        notes.append("training mean: over its training steps")
    source = "Each run's last held-out evaluation" + (f" ({'; '.join(notes)})" if notes else "")
    lines = [f"{source}: mean over seeds [95% t-interval]. Δ: minus `{baseline}`, paired by seed, mean [95% "
             "paired t-interval] (n pairs).", "", row(head), "|" + "---|" * len(head)]
    for m in measures:
        cells = [m.label]
        for r in records:
            cell = num(r[f"{m.col}_mean"]) + ci(r[f"{m.col}_lo"], r[f"{m.col}_hi"])
            if r["variant"] != baseline:
                cell += (f"<br>Δ {num(r[f'{m.col}_diff'], True)}"
                         f"{ci(r[f'{m.col}_diff_lo'], r[f'{m.col}_diff_hi'], True)} ({r[f'{m.col}_pairs']})")
            cells.append(cell)
        lines.append(row(cells))
    lines.append(row(["seeds"] + [str(r["seeds"]) for r in records]))
    lines.append(row(["steps/run"] + [f"{r['steps_mean']:g}" for r in records]))
    lines.append(row(["episodes/run"] + [f"{r['episodes_mean']:g}" for r in records]))
    lines.append(row(["wall-clock s/run"] + ["-" if math.isnan(r["wall_s_mean"]) else f"{r['wall_s_mean']:.0f}"
                                             for r in records]))
    head = ["variant", "seed", "steps", "episodes", "wall-clock s", *(m.label for m in measures), "run"]
    lines += ["", row(head), "|" + "---|" * len(head)]
    for r in per_run.to_dict("records"):
        mark = "*" if r["wall_s_source"] == "logged" else ""
        wall = "-" if math.isnan(r["wall_s"]) else f"{r['wall_s']:.0f}{mark}"
        lines.append(row([f"`{r['variant']}`", str(r["seed"]), str(r["steps"]), str(r["episodes"]), wall,
                          *(num(r[m.col]) for m in measures), str(r["run_dir"])]))
    if (per_run.wall_s_source == "logged").any():
        lines += ["", "\\* no sweep.json: the sum of the run's logged step and evaluation times (start-up, model "
                  "loading and checkpoints not included)."]
    return "\n".join(lines) + "\n"


def compare(paths: str | Path | Sequence[str | Path], out: str | Path | None = None,
            baseline: str | None = None) -> tuple[Any, Any]:
    """(figure, table) for the runs under ``paths`` (sweep, variant or run directories); with ``out``, also writes
    ``compare.png``, ``summary.md`` (both tables), ``variants.csv`` and ``runs.csv`` there.

    The table has one row per variant: ``seeds``; for each measure of MEASURES that some run has (accuracy,
    syntax_error_rate and exception_rate always; accuracy_level1..3, transfer_accuracy, lines_per_episode,
    correct_block_frac, block_syntax_error_frac from the last evaluation; correct_negative_frac, the mean over
    training steps) ``<m>_mean``, ``<m>_lo``, ``<m>_hi`` (95% t-interval over seeds) and ``<m>_diff``, ``<m>_diff_lo``,
    ``<m>_diff_hi``, ``<m>_pairs`` (minus the baseline, paired by seed, 95% paired t-interval); and ``wall_s_mean``,
    ``steps_mean``, ``episodes_mean``. ``pd.DataFrame(table.attrs["runs"])`` has one row per run (variant, seed,
    steps, episodes, wall_s and wall_s_source: "sweep" for the sweep's record of the process, "logged" for the sum
    of the logged step_s, eval/wall_s and transfer/wall_s; the measures; run_dir) and ``table.attrs["baseline"]``
    names the baseline (default: the first variant)."""
    variants = discover(paths)
    baseline = baseline or next(iter(variants))
    if baseline not in variants:
        raise ValueError(f"baseline {baseline!r} is not a variant here; variants: {', '.join(variants)}")
    fig = figure(variants, title=f"{len(variants)} variants: mean over seeds (thin lines: each seed), with a 95% "
                                 f"t-interval band from {MIN_BAND_SEEDS} seeds on")
    table, per_run = tables(variants, baseline)
    table.attrs.update(runs=per_run.to_dict("records"), baseline=baseline)
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        fig.savefig(out / "compare.png", dpi=90)
        (out / "summary.md").write_text(markdown(table, per_run, baseline))
        table.to_csv(out / "variants.csv", index=False)
        per_run.to_csv(out / "runs.csv", index=False)
    return fig, table
