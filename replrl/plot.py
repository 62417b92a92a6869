"""Learning curves of a run as one PNG: reward, accuracy, per-line error rates, each reward term.

A metric is drawn over the steps that logged its kind of row (training steps, evaluations for ``eval/...``, transfer
evaluations for ``transfer/...``), with
a gap where a row lacks it: ``reward/no_submit`` is only logged at steps where some episode did not submit, and no
line is drawn across the steps where it is absent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .metrics import held_out_prefix, read_metrics

PANELS = [
    ("reward", ["reward_mean"]),
    ("answer accuracy", ["accuracy", "submit_rate", "eval/accuracy", "transfer/accuracy"]),
    ("per-line error rates", ["syntax_error_rate", "exception_rate", "timeout_rate", "crash_rate"]),
    ("reward terms (mean per episode)", None),  # every reward/<term>
    ("lines per episode", ["lines_per_episode"]),
    ("policy", ["entropy", "clip_frac", "approx_kl", "kl"]),
    ("output prediction", ["predict_output/accuracy", "eval/predict_output/accuracy", "loss/predict_output",
                           "eval/loss/predict_output"]),
]
OPTIONAL_PANELS = {"output prediction"}
"""Panels drawn only when the run logged one of their metrics (loss.predict_output: replrl/predict_output.py)."""


def row_kind(key: str) -> str:
    """"eval/", "transfer/", "eval_<label>/" (a run.extra_eval task) or "" (a training metric)."""
    return held_out_prefix(key)


def is_eval_key(key: str) -> bool:
    return row_kind(key) != ""


def step_series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric: every step that logged a row of the metric's kind (an evaluation row for
    ``eval/...``, a transfer row for ``transfer/...``, a training row otherwise), NaN where that row lacks the
    metric. Rows repeated at one step (a resumed run's evaluation) count once, the last one."""
    by_step: dict[int, float] = {}
    kind = row_kind(key)
    for row in rows:
        if "step" not in row or not any(k != "step" and row_kind(k) == kind for k in row):
            continue
        value = row.get(key)
        by_step[int(row["step"])] = float(value) if isinstance(value, (int, float)) else math.nan
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def markevery(values: Sequence[float]) -> list[bool] | None:
    """Markers for a line: on every point of a short series, else on the isolated points (no finite neighbour),
    which a line alone would not show."""
    if len(values) <= 30:
        return None
    finite = [not math.isnan(v) for v in values]
    return [f and not (i > 0 and finite[i - 1]) and not (i + 1 < len(finite) and finite[i + 1])
            for i, f in enumerate(finite)]


def plot_run(run_dir: str | Path, out: str | Path | None = None, title: str | None = None) -> Path:
    """The run's curves as a PNG (default ``RUN_DIR/curves.png``); returns its path."""
    rows = read_metrics(run_dir)
    if not rows:
        raise FileNotFoundError(f"no metrics in {run_dir} (expected {Path(run_dir) / 'metrics.jsonl'})")
    fig = run_figure(rows, title or f"replrl run: {Path(run_dir).resolve().name}")
    out = Path(out) if out else Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=100)
    return out


def run_figure(rows: Sequence[dict[str, Any]], title: str = "") -> Any:
    """A matplotlib Figure of a run's metrics rows, one panel per entry of PANELS."""
    from matplotlib.figure import Figure  # no pyplot: no global backend switch (a notebook keeps its inline plots)

    logged = {k for r in rows for k in r}
    panels = [(name, keys) for name, keys in PANELS if name not in OPTIONAL_PANELS or logged & set(keys or ())]
    cols = math.ceil(len(panels) / 2)
    fig = Figure(figsize=(5 * cols, 8))
    axes = fig.subplots(2, cols)
    extra = sorted({k for r in rows for k in r if row_kind(k).startswith("eval_") and k.endswith("/accuracy")})
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (name, keys) in zip(axes.flat, panels):
        keys = keys or sorted({k for r in rows for k in r if k.startswith("reward/")})
        if "eval/accuracy" in keys:  # each run.extra_eval task's accuracy beside the first held-out task's
            keys = [*keys, *extra]
        for key in keys:
            steps, values = step_series(rows, key)
            if any(not math.isnan(v) for v in values):
                ax.plot(steps, values, marker="o", ms=3, markevery=markevery(values), label=key)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
