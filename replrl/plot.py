"""Learning curves of a run as one PNG: reward, accuracy, per-line error rates, each reward term."""

from __future__ import annotations

from pathlib import Path

from .metrics import read_metrics

PANELS = [
    ("reward", ["reward_mean"]),
    ("answer accuracy", ["accuracy", "submit_rate", "eval/accuracy"]),
    ("per-line error rates", ["syntax_error_rate", "exception_rate", "timeout_rate", "crash_rate"]),
    ("reward terms (mean per episode)", None),  # every reward/<term>
    ("lines per episode", ["lines_per_episode"]),
    ("policy", ["entropy", "clip_frac", "approx_kl", "kl"]),
]


def plot_run(run_dir: str | Path, out: str | Path | None = None, title: str | None = None) -> Path:
    from matplotlib.figure import Figure  # no pyplot: no global backend switch (a notebook keeps its inline plots)

    rows = read_metrics(run_dir)
    if not rows:
        raise FileNotFoundError(f"no metrics in {run_dir} (expected {Path(run_dir) / 'metrics.jsonl'})")
    fig = Figure(figsize=(15, 8))
    axes = fig.subplots(2, 3)
    for ax, (name, keys) in zip(axes.flat, PANELS):
        keys = keys or sorted({k for r in rows for k in r if k.startswith("reward/")})
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, ms=3, label=key)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(title or f"replrl run: {Path(run_dir).resolve().name}")
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=100)
    return out
