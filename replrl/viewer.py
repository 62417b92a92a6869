"""HTML rendering of trajectories for notebooks: model text and interpreter output told apart by colour, each line's
reward terms beside it. ``Trajectory._repr_html_`` calls ``trajectory_html``."""

from __future__ import annotations

import html
import json
from collections.abc import Iterable
from pathlib import Path

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
        piece = line.code + ("\n" if line.status != "incomplete" or line is not t.lines[-1] else "")
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
              f"{html.escape(repr(t.answer))} · {'✔' if t.correct else '✘'} · reward {t.reward:+.2f} ({outcome})")
    return f'<div>{header}<div style="{STYLE}">{"".join(pieces)}</div></div>'


def load_jsonl(path: str | Path) -> list[Trajectory]:
    with open(path) as f:
        return [Trajectory.from_dict(json.loads(line)) for line in f if line.strip()]


def many_html(trajs: Iterable[Trajectory]) -> str:
    return "<br>".join(trajectory_html(t) for t in trajs)
