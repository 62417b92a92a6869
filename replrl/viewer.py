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


BANNER_END = 'Type "help", "copyright", "credits" or "license" for more information.\n'
"""The banner's last line (its first names the Python version, which differs between machines): the prompt ends
right after it, with the first ``>>>``."""

Segment = tuple[str, str, Any]
"""(kind, text, line): kind is "head" (the prompt before the banner's end), "prompt" (what the environment wrote
between lines: a ``>>>``/``...`` prompt, a truncation marker), "model" (a line's sampled text; ``line`` is its Line) or
"env" (what the interpreter printed)."""


def segments(t: Trajectory) -> list[Segment] | None:
    """The transcript cut into what the prompt, the model and the interpreter wrote, by the character spans each
    line recorded at the splice (``Line.text_span``, ``Line.output_text_span``): nothing is decoded or searched.
    None where the episode has no such spans (recorded without them, or by a tokenizer whose decoding is not
    additive: see ``Line.text_span``)."""
    text, lines = t.text, t.lines
    if not lines or any(ln.text_span == (0, 0) for ln in lines):
        return None
    out = _head(text[:lines[0].text_span[0]])
    cursor = lines[0].text_span[0]
    for k, line in enumerate(lines):
        start, end = line.text_span
        if k:  # what the line before printed, then what the environment wrote (a marker, this line's prompt)
            printed_end = lines[k - 1].output_text_span[1]
            if not cursor <= printed_end <= start:
                return None
            out += [("env", text[cursor:printed_end], None), ("prompt", text[printed_end:start], None)]
        out.append(("model", text[start:end], line))
        cursor = end
    if cursor < len(text):
        out.append(("env", text[cursor:], None))
    return out


def _head(text: str) -> list[Segment]:
    """The prompt: the header and the banner (collapsed), then the first ``>>>`` (shown)."""
    end = text.rfind(BANNER_END)
    cut = end + len(BANNER_END) if end >= 0 else len(text)
    return [("head", text[:cut], None), ("prompt", text[cut:], None)]


def _badge(line: Any) -> str:
    """A line's status and reward terms, where there is something to say: not for a line that ran ("ok") with no
    reward, nor for an empty line at ``>>>`` (Enter at the prompt: nothing to run, as in Python)."""
    terms = ", ".join(f"{k} {v:+.2f}" for k, v in line.rewards.items() if v)
    enter = line.status == "incomplete" and not line.code.strip() and line.prompt.startswith(">>>")
    if (line.status == "ok" or enter) and not terms:
        return ""
    what = "" if enter else line.status + (": " + html.escape(line.error_name) if line.error_name else "")
    return (f' <span style="color:{STATUS.get(line.status, "#000")}; font-weight: normal; font-size: 10px">'
            f'[{what}{"; " if what and terms else ""}{terms}]</span>')


def trajectory_html(t: Trajectory, show_prompt: bool = False) -> str:
    """The episode's transcript as HTML (the prompt collapsed unless ``show_prompt``), cut by ``segments``."""
    parts = segments(t)
    if parts is None:
        return _searched_html(t, show_prompt)
    pieces = []
    for kind, text, line in parts:
        if kind == "head":
            pieces.append(_span(text, PROMPT) if show_prompt else
                          f"<details><summary>prompt</summary>{_span(text, PROMPT)}</details>")
        elif kind == "prompt":
            pieces.append(_span(text, PROMPT))
        elif kind == "env":
            pieces.append(_span(text, ENV))
        else:
            body = text[:-1] if text.endswith("\n") else text
            pieces.append(_span(body, MODEL) + _badge(line) + text[len(body):])
    return _framed(t, pieces)


def _framed(t: Trajectory, pieces: list[str]) -> str:
    outcome = ", ".join(f"{k} {v:+.2f}" for k, v in t.outcome_rewards.items())
    header = (f"<b>{html.escape(t.task)} row {t.row}</b> · end: {html.escape(t.end_reason)} · answer: "
              f"{html.escape(repr(t.answer))} · {'✔' if t.correct else '✘'} · reward {t.reward:+.2f} ({outcome})"
              + (f" · data loaded by the task's setup ({t.timing['setup_s']:.1f} s, not shown)"
                 if t.timing.get("setup_s") else ""))
    return f'<div>{header}<div style="{STYLE}">{"".join(pieces)}</div></div>'


def _searched_html(t: Trajectory, show_prompt: bool = False) -> str:
    """The transcript of an episode without character spans (see ``segments``): each line placed where its code is
    next found in the text."""
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
        pieces.append(_span(piece.rstrip("\n"), MODEL) + _badge(line) + ("\n" if piece.endswith("\n") else ""))
        cursor = at + len(piece)
    pieces.append(_span(t.text[cursor:], ENV))
    return _framed(t, pieces)


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
    """The first ``limit`` transcripts as one HTML object: the last expression of a notebook cell renders it (each
    cut by its lines' recorded spans, see ``segments``)."""
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
