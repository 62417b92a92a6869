"""The notebook viewer cuts a transcript into prompt, model lines and interpreter output by the spans each line
recorded at the splice (``replrl.viewer.segments``): an episode of empty lines under a chat prompt with newlines
(common before training) shows its prompt collapsed and its lines where they are, not the chat prompt as model
lines; an episode recorded without the spans is shown by searching its lines in the text."""

from __future__ import annotations

import dataclasses

from replrl.rollout import build_prompt, decode, encode, env_splice, line_text
from replrl.types import Line, Trajectory
from replrl.viewer import segments, trajectory_html
from tests.helpers_models import smollm2_tokenizer

LINES = [("", ">>> ", "", "incomplete"), ("x = 6 * 7", ">>> ", "", "ok"), ("x", ">>> ", "42\n", "ok"),
         ("submit(x)", ">>> ", "", "ok")]
"""(code, prompt, output, status) of each line: an empty line first (Enter at ``>>>``: nothing runs)."""


def episode(tokenizer) -> Trajectory:
    """The episode as the rollout splices it: sampled ids per line, the interpreter's ids after every line but
    the last (the episode ends there), and the spans the splice records."""
    prompt = encode(tokenizer, build_prompt(tokenizer, "Compute 6 * 7.\nThen submit it.", chat_template=True))
    ids, lines, chars = list(prompt), [], len(decode(tokenizer, prompt))
    for k, (code, at, output, status) in enumerate(LINES):
        sampled = encode(tokenizer, line_text(code))
        end, chars_end = len(ids) + len(sampled), chars + len(line_text(code))
        line = Line(code=code, output=output, status=status, prompt=at, token_span=(len(ids), end),
                    output_span=(end, end), text_span=(chars, chars_end), output_text_span=(chars_end, chars_end))
        lines.append(line)
        ids += sampled
        chars = chars_end
        if k < len(LINES) - 1:
            splice = env_splice(tokenizer, output, LINES[k + 1][1], 100)
            line.output_span = (end, end + splice.printed_tokens)
            line.output_text_span = (chars, chars + splice.printed_chars)
            ids += splice.ids
            chars += len(splice.text)
    mask = [0] * len(ids)
    for line in lines:
        mask[line.token_span[0]:line.token_span[1]] = [1] * (line.token_span[1] - line.token_span[0])
    return Trajectory(token_ids=ids, loss_mask=mask, logprobs=[0.0] * len(ids), prompt_len=len(prompt),
                      text=decode(tokenizer, ids), lines=lines, end_reason="submit", answer=42, correct=True)


def test_segments_follow_the_recorded_spans():
    tokenizer = smollm2_tokenizer()
    t = episode(tokenizer)
    parts = segments(t)
    assert parts is not None and "".join(text for _, text, _ in parts) == t.text
    kinds = [kind for kind, _, _ in parts]
    assert kinds == ["head", "prompt", "model", "env", "prompt", "model", "env", "prompt", "model", "env", "prompt",
                     "model"]
    assert [text for kind, text, _ in parts if kind == "model"] == [" \n", " x = 6 * 7\n", " x\n", " submit(x)\n"]
    assert [text for kind, text, _ in parts if kind == "env"] == ["", "", "42\n"]
    assert [text for kind, text, _ in parts if kind == "prompt"][1:] == [">>>"] * 3
    head = parts[0][1]
    assert "Compute 6 * 7.\nThen submit it." in head and head.endswith("for more information.\n")
    # the model's text and what the interpreter printed are the tokens' own (nothing decoded to find them)
    for kind, text, line in parts:
        if kind == "model":
            assert text == decode(tokenizer, t.token_ids[slice(*line.token_span)])
    printed = t.lines[2]
    assert decode(tokenizer, t.token_ids[slice(*printed.output_span)]) == "42\n"


def test_an_episode_recorded_without_spans_is_shown_by_search():
    """A record from before the spans (their default, (0, 0)): no segments; the page places each line where its code
    is found, the interpreter's output between."""
    t = episode(smollm2_tokenizer())
    t.lines = [dataclasses.replace(ln, text_span=(0, 0), output_text_span=(0, 0)) for ln in t.lines]
    assert segments(t) is None
    page = trajectory_html(Trajectory.from_dict(t.to_dict()))
    assert "42" in page and "submit(x)" in page and "<details>" in page


def test_the_prompt_is_collapsed_and_an_empty_line_at_the_prompt_is_not_called_incomplete():
    t = episode(smollm2_tokenizer())
    page = trajectory_html(t)
    assert "[incomplete" not in page
    details = page.split("<details>", 1)[1].split("</details>", 1)[0]
    assert "Compute 6 * 7." in details and "submit(x)" not in details  # the chat prompt, and only it, collapsed
    model = '<span style="color: #0b5394; font-weight: 600">'
    assert [part.split("</span>", 1)[0] for part in page.split(model)[1:]] == [" ", " x = 6 * 7", " x", " submit(x)"]
    # an empty line in a block (at "...") is still waiting for the block: incomplete, and it says so
    t.lines[1].prompt, t.lines[1].status, t.lines[1].code = "... ", "incomplete", ""
    assert "[incomplete]" in trajectory_html(t)
