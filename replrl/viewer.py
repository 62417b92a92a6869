"""Notebook display: trajectories as HTML (model text and interpreter output told apart by colour, each line's
reward terms beside it; ``Trajectory._repr_html_`` calls ``trajectory_html``), episodes to and from JSON Lines, and
``LiveCurve``, a learning curve redrawn in place after every training step."""

from __future__ import annotations

import dataclasses
import html
import io
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .types import Trajectory

STYLE = ("font-family: ui-monospace, monospace; font-size: 12px; white-space: pre-wrap; line-height: 1.35;"
         "border: 1px solid #ddd; padding: 8px; border-radius: 4px")
MODEL = "color: #0b5394; font-weight: 600"
ENV = "color: #666"
PROMPT = "color: #999"
STATUS = {"error": "#cc0000", "timeout": "#e69138", "crashed": "#990000", "ok": "#38761d", "incomplete": "#999"}


def _span(text: str, style: str) -> str:
    return f'<span style="{style}">{html.escape(text)}</span>' if text else ""


def trajectory_html(t: Trajectory, show_prompt: bool = False) -> str:
    """The episode's transcript as HTML (the prompt collapsed unless ``show_prompt``)."""
    pieces, cursor = [], 0
    for line in t.lines:
        unended = line is t.lines[-1] and t.end_reason in ("eos", "overlong_line")  # no newline was sampled
        piece = line.code + ("" if unended else "\n")
        at = t.text.find(piece, cursor)
        if at < 0:
            break
        before = t.text[cursor:at]
        if cursor == 0:
            head, sep, banner_tail = before.rpartition("\n>>> ") if not show_prompt else (before, "", "")
            pieces.append(f"<details><summary>prompt</summary>{_span(head + sep[:1], PROMPT)}</details>"
                          if not show_prompt else _span(before, PROMPT))
            pieces.append(_span(sep[1:] + banner_tail, PROMPT) if not show_prompt else "")
        else:
            pieces.append(_span(before, ENV))
        terms = ", ".join(f"{k} {v:+.2f}" for k, v in line.rewards.items() if v)
        badge = (f' <span style="color:{STATUS.get(line.status, "#000")}; font-weight: normal; font-size: 10px">'
                 f'[{line.status}{": " + html.escape(line.error_name) if line.error_name else ""}'
                 f'{"; " + terms if terms else ""}]</span>') if line.status != "ok" or terms else ""
        pieces.append(_span(piece.rstrip("\n"), MODEL) + badge + ("\n" if piece.endswith("\n") else ""))
        cursor = at + len(piece)
    pieces.append(_span(t.text[cursor:], ENV))
    outcome = ", ".join(f"{k} {v:+.2f}" for k, v in t.outcome_rewards.items())
    header = (f"<b>{html.escape(t.task)} row {t.row}</b> · end: {html.escape(t.end_reason)} · answer: "
              f"{html.escape(repr(t.answer))} · {'✔' if t.correct else '✘'} · reward {t.reward:+.2f} ({outcome})"
              + (f" · data loaded by the task's setup ({t.timing['setup_s']:.1f} s, not shown)"
                 if t.timing.get("setup_s") else ""))
    return f'<div>{header}<div style="{STYLE}">{"".join(pieces)}</div></div>'


def load_jsonl(path: str | Path) -> list[Trajectory]:
    """Episodes from JSON Lines: ``replrl rollout --out``, ``save_jsonl``, or a run's samples.jsonl (whose extra
    ``step`` key is dropped)."""
    known = {f.name for f in dataclasses.fields(Trajectory)} | {"reward"}
    with open(path) as f:
        return [Trajectory.from_dict({k: v for k, v in json.loads(line).items() if k in known})
                for line in f if line.strip()]


def save_jsonl(trajs: Iterable[Trajectory], path: str | Path) -> Path:
    """Write episodes as JSON Lines, one per line (the format of ``replrl rollout --out``); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.writelines(t.to_json() + "\n" for t in trajs)
    return path


def many_html(trajs: Iterable[Trajectory], show_prompt: bool = False) -> str:
    return "<br>".join(trajectory_html(t, show_prompt) for t in trajs)


def show(trajs: Trajectory | Iterable[Trajectory], limit: int = 8, show_prompt: bool = False) -> Any:
    """The first ``limit`` transcripts as one HTML object: the last expression of a notebook cell renders it."""
    from IPython.display import HTML

    trajs = [trajs] if isinstance(trajs, Trajectory) else list(trajs)
    return HTML(many_html(trajs[:limit], show_prompt))


class LiveCurve:
    """Learning curves redrawn in place after every training step: ``train(cfg, on_step=LiveCurve())``.

    Each metric in ``keys`` gets a panel. In a notebook the figure is one output, replaced at each step (an IPython
    display handle, so it also works when the notebook runs unattended); elsewhere nothing is drawn. ``history``
    keeps every step's metrics, and the object itself renders the final figure (``_repr_png_``)."""

    def __init__(self, keys: Sequence[str] = ("reward_mean", "accuracy", "syntax_error_rate"), dpi: int = 72):
        self.keys, self.dpi = tuple(keys), dpi
        self.history: list[dict[str, Any]] = []
        self._handle: Any = None

    def __call__(self, result: Any) -> None:
        self.history.append({"step": result.step, **result.metrics})
        if not _in_ipython():
            return
        from IPython.display import Image, display

        image = Image(data=self._repr_png_(), format="png")
        if self._handle is None:
            self._handle = display(image, display_id=True)
        else:
            self._handle.update(image)

    def figure(self) -> Any:
        """The curves as a matplotlib Figure (not registered with pyplot, so no backend is touched)."""
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        fig = Figure(figsize=(3.6 * len(self.keys), 2.6), dpi=self.dpi, layout="constrained")
        for ax, key in zip(fig.subplots(1, len(self.keys), squeeze=False)[0], self.keys):
            pts = [(r["step"], r[key]) for r in self.history if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, ms=3)
            ax.set_title(f"{key} {pts[-1][1]:.3g}" if pts else key, fontsize=10)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
        return fig

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.figure().savefig(buf, format="png")
        return buf.getvalue()


def _in_ipython() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None
