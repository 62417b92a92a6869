"""The notebook viewer cuts a transcript into prompt, model lines and interpreter output from the episode's own
record (``replrl.viewer.segments``): an episode of empty lines under a chat prompt with newlines (common before
training) shows its prompt collapsed and its lines where they are, not the chat prompt as model lines."""

from __future__ import annotations

from replrl.rollout import build_prompt, decode, encode, env_token_ids, line_text
from replrl.types import Line, Trajectory
from replrl.viewer import segments, trajectory_html
from tests.helpers_models import smollm2_tokenizer

LINES = [("", ">>> ", "", "incomplete"), ("x = 6 * 7", ">>> ", "", "ok"), ("x", ">>> ", "42\n", "ok"),
         ("submit(x)", ">>> ", "", "ok")]
"""(code, prompt, output, status) of each line: an empty line first (Enter at ``>>>``: nothing runs)."""


def episode(tokenizer) -> Trajectory:
    """The episode as the rollout splices it: sampled ids per line, the interpreter's ids after every line but
    the last (the episode ends there)."""
    prompt = encode(tokenizer, build_prompt(tokenizer, "Compute 6 * 7.\nThen submit it.", chat_template=True))
    ids, lines = list(prompt), []
    for k, (code, at, output, status) in enumerate(LINES):
        sampled = encode(tokenizer, line_text(code))
        lines.append(Line(code=code, output=output, status=status, prompt=at,
                          token_span=(len(ids), len(ids) + len(sampled))))
        ids += sampled
        if k < len(LINES) - 1:
            ids += env_token_ids(tokenizer, output, LINES[k + 1][1], 100)
    mask = [0] * len(ids)
    for line in lines:
        mask[line.token_span[0]:line.token_span[1]] = [1] * (line.token_span[1] - line.token_span[0])
    return Trajectory(token_ids=ids, loss_mask=mask, logprobs=[0.0] * len(ids), prompt_len=len(prompt),
                      text=decode(tokenizer, ids), lines=lines, end_reason="submit", answer=42, correct=True)


def test_segments_follow_the_token_spans_with_or_without_the_tokenizer():
    tokenizer = smollm2_tokenizer()
    t = episode(tokenizer)
    by_lines, by_tokens = segments(t), segments(t, tokenizer)
    assert by_lines == by_tokens
    assert "".join(text for _, text, _ in by_lines) == t.text
    kinds = [kind for kind, _, _ in by_lines]
    assert kinds == ["head", "prompt", "model", "env", "prompt", "model", "env", "prompt", "model", "env", "prompt",
                     "model"]
    assert [text for kind, text, _ in by_lines if kind == "model"] == [" \n", " x = 6 * 7\n", " x\n", " submit(x)\n"]
    assert [text for kind, text, _ in by_lines if kind == "env"] == ["", "", "42\n"]
    head = by_lines[0][1]
    assert "Compute 6 * 7.\nThen submit it." in head and head.endswith("for more information.\n")


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
    assert "[incomplete]" in trajectory_html(t)  # (its text no longer follows the record: placed by search)
