import math

import pytest
import torch

from replrl.advantages import (
    ADVANTAGE_ESTIMATORS,
    advantage_estimator,
    batch_tensors,
    compute_advantages,
    group_normalize,
    line_advantages,
    line_returns,
    outcome_advantages,
    per_token,
)
from replrl.types import Line, Trajectory


def close(a, b, atol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float), torch.as_tensor(b, dtype=torch.float), atol=atol)


# ---------------------------------------------------------------------------------------------------------------
# group_normalize


def test_group_normalize_two_groups():
    x = torch.tensor([1.0, 2.0, 3.0, 5.0, 7.0])
    group = torch.tensor([0, 0, 0, 1, 1])
    # group 0: mean 2, deviations [-1, 0, 1], population std sqrt(2/3) = 0.816497 -> [-1.224745, 0, 1.224745]
    # group 1: mean 6, deviations [-1, 1], std 1 -> [-1, 1]
    s = 1 / math.sqrt(2 / 3)
    assert close(group_normalize(x, group, "std"), [-s, 0.0, s, -1.0, 1.0])
    # Dr. GRPO: deviations only
    assert close(group_normalize(x, group, "none"), [-1.0, 0.0, 1.0, -1.0, 1.0])


def test_group_normalize_interleaved_and_arbitrary_ids():
    # the same two groups as above, interleaved and with ids 7 and 3
    x = torch.tensor([1.0, 5.0, 2.0, 7.0, 3.0])
    group = torch.tensor([7, 3, 7, 3, 7])
    s = 1 / math.sqrt(2 / 3)
    assert close(group_normalize(x, group, "std"), [-s, -1.0, 0.0, 1.0, s])


def test_group_normalize_identical_rewards_and_singletons_give_exactly_zero():
    x = torch.tensor([0.1, 0.1, 0.1, 0.7, -3.3])
    group = torch.tensor([0, 0, 0, 1, 2])  # one group of equal values, two groups of one
    for scale in ("std", "none"):
        assert torch.equal(group_normalize(x, group, scale), torch.zeros(5))


def test_group_normalize_rejects_unknown_scale():
    with pytest.raises(ValueError):
        group_normalize(torch.zeros(2), torch.zeros(2, dtype=torch.long), "mad")


# ---------------------------------------------------------------------------------------------------------------
# outcome and line advantages on a hand-made batch
#
# Group 0 has episodes A (3 lines) and B (2 lines); group 1 has episode C alone.
#   A: rewards per line [0.5, -1, 1], outcome 1  -> total 1.5
#   B: rewards per line [-1, 0.5],    outcome 0  -> total -0.5
#   C: rewards per line [2],          outcome 1  -> total 3
# Token layout (T = 9), "p" prompt, "o" interpreter output, "." padding, digits = line index of a sampled token,
# "x" = sampled but in no line (a line cut off before it ran):
#   A: p p 0 0 o 1 2 2 x
#   B: p p 0 0 0 o 1 . .
#   C: p p 0 0 o . . . .


def make_batch():
    loss_mask = torch.tensor(
        [
            [0, 0, 1, 1, 0, 1, 1, 1, 1],
            [0, 0, 1, 1, 1, 0, 1, 0, 0],
            [0, 0, 1, 1, 0, 0, 0, 0, 0],
        ],
        dtype=torch.float,
    )
    line_index = torch.tensor(
        [
            [-1, -1, 0, 0, -1, 1, 2, 2, -1],
            [-1, -1, 0, 0, 0, -1, 1, -1, -1],
            [-1, -1, 0, 0, -1, -1, -1, -1, -1],
        ]
    )
    return {
        "loss_mask": loss_mask,
        "line_index": line_index,
        "line_rewards": torch.tensor([[0.5, -1.0, 1.0], [-1.0, 0.5, 0.0], [2.0, 0.0, 0.0]]),
        "n_lines": torch.tensor([3, 2, 1]),
        "outcome": torch.tensor([1.0, 0.0, 1.0]),
        "group": torch.tensor([0, 0, 1]),
    }


def test_outcome_advantages():
    b = make_batch()
    # totals [1.5, -0.5 | 3]: group 0 mean 0.5, std 1 -> [1, -1]; C alone -> 0
    adv = outcome_advantages(b["outcome"], b["line_rewards"], b["group"], "std")
    assert close(adv, [1.0, -1.0, 0.0])
    tok = per_token(adv, b["loss_mask"])
    assert close(tok, adv[:, None] * b["loss_mask"])
    assert close(compute_advantages("outcome", b), tok)


def test_line_returns():
    r = torch.tensor([[0.5, -1.0, 1.0], [-1.0, 0.5, 99.0]])  # 99 is beyond B's 2 lines: ignored
    n = torch.tensor([3, 2])
    # gamma 1: A [0.5 - 1 + 1, -1 + 1, 1] = [0.5, 0, 1]; B [-1 + 0.5, 0.5, 0] = [-0.5, 0.5, 0]
    assert close(line_returns(r, n, 1.0), [[0.5, 0.0, 1.0], [-0.5, 0.5, 0.0]])
    # gamma 0.5: A R2 = 1, R1 = -1 + 0.5 * 1 = -0.5, R0 = 0.5 + 0.5 * -0.5 = 0.25; B R1 = 0.5, R0 = -1 + 0.25
    assert close(line_returns(r, n, 0.5), [[0.25, -0.5, 1.0], [-0.75, 0.5, 0.0]])
    # gamma 0: each line's own reward
    assert close(line_returns(r, n, 0.0), [[0.5, -1.0, 1.0], [-1.0, 0.5, 0.0]])


def test_line_advantages_gamma_1_std():
    b = make_batch()
    # returns (gamma 1): A [0.5, 0, 1], B [-0.5, 0.5], C [2]
    # line 0 of group 0: {0.5, -0.5}: mean 0, std 0.5     -> A +1, B -1
    # line 1 of group 0: {0, 0.5}:    mean 0.25, std 0.25 -> A -1, B +1
    # line 2 of group 0: only A has it                    -> A 0
    # C is alone in group 1                               -> 0
    # outcome part: A +1, B -1, C 0 (test_outcome_advantages)
    # token = 0.5 * line + 0.5 * outcome; "x" (no line) = outcome alone
    #   A: line0 0.5 + 0.5 = 1, line1 -0.5 + 0.5 = 0, line2 0 + 0.5 = 0.5, x = 1
    #   B: line0 -0.5 - 0.5 = -1, line1 0.5 - 0.5 = 0
    expected = [
        [0, 0, 1, 1, 0, 0, 0.5, 0.5, 1],
        [0, 0, -1, -1, -1, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 0],
    ]
    adv = line_advantages(**b, gamma=1.0, line_weight=0.5, scale="std")
    assert close(adv, expected)
    assert close(compute_advantages("line", b, gamma=1.0, line_weight=0.5, scale="std"), expected)


def test_line_advantages_gamma_half_none():
    b = make_batch()
    # returns (gamma 0.5): A [0.25, -0.5, 1], B [-0.75, 0.5]
    # line 0: mean -0.25 -> A +0.5, B -0.5; line 1: mean 0 -> A -0.5, B +0.5; line 2: A alone -> 0
    # outcome part (no std): totals 1.5, -0.5, mean 0.5 -> A +1, B -1; C alone -> 0
    #   A: line0 0.25 + 0.5 = 0.75, line1 -0.25 + 0.5 = 0.25, line2 0 + 0.5 = 0.5, x = 1
    #   B: line0 -0.25 - 0.5 = -0.75, line1 0.25 - 0.5 = -0.25
    expected = [
        [0, 0, 0.75, 0.75, 0, 0.25, 0.5, 0.5, 1],
        [0, 0, -0.75, -0.75, -0.75, 0, -0.25, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 0],
    ]
    assert close(line_advantages(**b, gamma=0.5, line_weight=0.5, scale="none"), expected)


def test_line_weight_extremes():
    b = make_batch()
    outcome_only = compute_advantages("outcome", b, scale="none")
    assert close(line_advantages(**b, line_weight=0.0, scale="none"), outcome_only)
    # line_weight 1, gamma 1, no std: A line tokens get [0.5, -0.25, 0] (deviations of [0.5, 0, 1] vs [-0.5, 0.5])
    adv = line_advantages(**b, line_weight=1.0, scale="none")
    assert close(adv[0], [0, 0, 0.5, 0.5, 0, -0.25, 0, 0, 1])


def test_registry():
    @advantage_estimator("test_constant")
    def constant(batch, value=2.0):
        return value * batch["loss_mask"]

    try:
        b = make_batch()
        assert close(compute_advantages("test_constant", b, value=3.0), 3.0 * b["loss_mask"])
        with pytest.raises(ValueError, match="known"):
            compute_advantages("nope", b)
    finally:
        ADVANTAGE_ESTIMATORS.pop("test_constant")
    assert {"outcome", "line"} <= set(ADVANTAGE_ESTIMATORS)


# ---------------------------------------------------------------------------------------------------------------
# batch_tensors


def test_batch_tensors():
    t1 = Trajectory(
        token_ids=[10, 11, 12, 13, 14, 15],
        loss_mask=[0, 0, 1, 1, 0, 1],
        logprobs=[0.0, 0.0, -0.5, -0.25, 0.0, -1.0],
        prompt_len=2,
        text="",
        lines=[
            Line("a", rewards={"syntax_error": -0.3, "ok": 0.1}, token_span=(2, 4)),
            Line("b", token_span=(5, 6)),
        ],
        outcome_rewards={"correct": 1.0, "length": -0.25},
        correct=True,
        group=3,
    )
    t2 = Trajectory(
        token_ids=[20, 21, 22, 23],
        loss_mask=[0, 1, 1, 0],
        logprobs=[0.0, -2.0, -3.0, 0.0],
        prompt_len=1,
        text="",
        lines=[Line("c", rewards={"ok": 0.2}, token_span=(1, 3))],
        group=4,
    )
    b = batch_tensors([t1, t2], pad_id=0)
    assert set(b) == {
        "input_ids", "attention_mask", "loss_mask", "old_logprobs", "line_index",
        "line_rewards", "n_lines", "outcome", "group", "correct", "line_state", "line_state_values", "line_code",
        "tree_from", "tree_to", "tree_credit",
    }  # fmt: skip
    # no line recorded a state: unknown (-1) on every line; texts "a", "b", "c" numbered 0, 1, 2; padding -1
    assert b["line_state"].tolist() == b["line_state_values"].tolist() == [[-1, -1], [-1, -1]]
    assert b["line_code"].tolist() == [[0, 1], [2, -1]]
    # T = 6 (longest), L = 2 (most lines); t2 right-padded with pad_id
    assert b["input_ids"].tolist() == [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    assert b["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 1], [0, 1, 1, 0, 0, 0]]
    assert b["old_logprobs"].tolist() == [[0, 0, -0.5, -0.25, 0, -1], [0, -2, -3, 0, 0, 0]]
    assert b["line_index"].tolist() == [[-1, -1, 0, 0, -1, 1], [-1, 0, 0, -1, -1, -1]]
    # line rewards: t1 [-0.3 + 0.1, 0 (no terms)], t2 [0.2, pad 0]; outcome: 1 - 0.25 and 0 (no terms)
    assert close(b["line_rewards"], [[-0.2, 0.0], [0.2, 0.0]])
    assert b["n_lines"].tolist() == [2, 1]
    assert b["outcome"].tolist() == [0.75, 0.0]
    assert b["group"].tolist() == [3, 4]
    assert b["correct"].tolist() == [True, False]  # t2 never submitted: correct is None
    assert b["input_ids"].dtype == b["line_index"].dtype == b["group"].dtype == torch.long
    # total reward agrees with Trajectory.reward
    totals = b["outcome"] + b["line_rewards"].sum(-1)
    assert close(totals, [t1.reward, t2.reward])


def test_batch_tensors_rejects_bad_spans_and_lengths():
    ok = dict(token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0], prompt_len=1, text="")
    with pytest.raises(ValueError, match="token_span"):
        batch_tensors([Trajectory(**ok, lines=[Line("a", token_span=(1, 3))])], pad_id=0)
    with pytest.raises(ValueError, match="length"):
        batch_tensors([Trajectory(**{**ok, "logprobs": [0.0]})], pad_id=0)
