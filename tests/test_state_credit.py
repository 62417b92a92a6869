"""The ``state`` advantage estimator (lines typed in the same interpreter state form step groups) and the
repeat statistics, on hand-built batches; the worked example of docs/state-credit.md, also with real kernels."""

import asyncio

import pytest
import torch

from replrl.advantages import batch_tensors, compute_advantages, state_advantages
from replrl.config import Config
from replrl.configlib import ConfigError
from replrl.rollout import state_stats
from replrl.types import Line, Trajectory

# The worked example of docs/state-credit.md: one group of four episodes of "What is 4175 * 2?".
EXAMPLE = [
    (["a = 4175", "4175 * 2", "submit(8350)"], 1.0),
    (["total = 4175", "4175 * 2", "submit(8305)"], 0.0),
    (["x = 4175", "submit(x + 2)"], 0.0),
    (["n = 8350", "submit(n)"], 1.0),
]
# start states (values digest): S0 fresh; S1 = {4175} after line 1 of episodes 0-2 (`4175 * 2` leaves it as it is);
# S2 = {8350}. With names, S1 splits into {a: 4175}, {total: 4175}, {x: 4175}.
VALUES_STATES = [["S0", "S1", "S1"], ["S0", "S1", "S1"], ["S0", "S1"], ["S0", "S2"]]
NAMED_STATES = [["S0", "a", "a"], ["S0", "total", "total"], ["S0", "x"], ["S0", "n"]]
# Returns R = 1, 0, 0, 1; group mean 0.5; outcome advantage (scale none) A = +.5, -.5, -.5, +.5.
# values, state_weight 1 (the step part alone):
#   line 1 (S0, visited by all 4, every text different): Q = R_i, V = 0.5 -> A_step = A_i
#   `4175 * 2` in S1 (visited by e0, e1, e2: V = 1/3; taken by e0, e1: Q = 1/2)    -> +1/6 for e0 and e1
#   e0 `submit(8350)` in S1 (Q = 1) -> +2/3;  e1 `submit(8305)` (Q = 0) -> -1/3;  e2 `submit(x + 2)` -> -1/3
#   e3 `submit(n)` in S2: only e3 was there -> falls back to A_3 = +0.5
STEP_ONLY = [[0.5, 1 / 6, 2 / 3], [-0.5, 1 / 6, -1 / 3], [-0.5, -1 / 3], [0.5, 0.5]]
# state_weight 0.5: 0.5 * A_step + 0.5 * A_i where another episode shared the state, A_i where none did
HALF = [[0.5, 1 / 3, 7 / 12], [-0.5, -1 / 6, -5 / 12], [-0.5, -5 / 12], [0.5, 0.5]]


def episode(lines, reward, states_named, states_values, group=0, row=0, line_rewards=None):
    """A trajectory whose line k is one sampled token, with the given start states."""
    n = len(lines)
    tr = Trajectory(token_ids=[0] + list(range(1, n + 1)), loss_mask=[0] + [1] * n, logprobs=[0.0] * (n + 1),
                    prompt_len=1, text="", group=group, row=row, outcome_rewards={"correct": reward})
    for k, code in enumerate(lines):
        rewards = {"term": line_rewards[k]} if line_rewards else {}
        tr.lines.append(Line(code=code, token_span=(k + 1, k + 2), state=states_named[k],
                             state_values=states_values[k], rewards=rewards))
    return tr


def example_batch(values=VALUES_STATES, named=NAMED_STATES):
    return [episode(lines, r, n, v) for (lines, r), n, v in zip(EXAMPLE, named, values)]


def per_line(adv, trajs):
    """The advantage on each line's token, as nested lists."""
    return [[float(adv[i, k + 1]) for k in range(len(tr.lines))] for i, tr in enumerate(trajs)]


def assert_lines(got, want, tol=1e-6):
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=tol), (got, want)


def test_worked_example_numbers():
    trajs = example_batch()
    batch = batch_tensors(trajs, pad_id=0)
    for weight, want in ((1.0, STEP_ONLY), (0.5, HALF)):
        adv = compute_advantages("state", batch, scale="none", state_weight=weight, state_key="values")
        assert_lines(per_line(adv, trajs), want)
    # with names, no state after line 1 is shared: every line gets the outcome advantage, exactly as `outcome`
    named = compute_advantages("state", batch, scale="none", state_weight=0.5, state_key="named")
    assert torch.equal(named, compute_advantages("outcome", batch, scale="none"))
    assert_lines(per_line(named, trajs), [[0.5] * 3, [-0.5] * 3, [-0.5] * 2, [0.5] * 2])


def test_worked_example_std_scale():
    # scale std divides A_step by the std of R over the episodes that visited the state, A_i by the group's std.
    # S1: R = 1, 0, 0 -> std sqrt(2/9) = 0.4714; `4175 * 2`: (1/6) / 0.4714 = 0.35355
    # S0: R = 1, 0, 0, 1 -> std 0.5; line 1: A_step = 0.5 / 0.5 = 1 = A_i (GRPO's +-1)
    trajs = example_batch()
    adv = compute_advantages("state", batch_tensors(trajs, 0), scale="std", state_weight=1.0)
    s1 = (2 / 9) ** 0.5
    assert_lines(per_line(adv, trajs), [[1.0, 1 / 6 / s1, 2 / 3 / s1], [-1.0, 1 / 6 / s1, -1 / 3 / s1],
                                        [-1.0, -1 / 3 / s1], [1.0, 1.0]], tol=1e-5)  # eps 1e-6 in the divisor


@pytest.mark.parametrize("scale", ["std", "none"])
def test_all_states_distinct_equals_outcome_exactly(scale):
    # three groups of different sizes, line rewards included, every state unique: `state` must be `outcome`
    gen = torch.Generator().manual_seed(0)
    trajs, uid = [], 0
    for g, size in enumerate((4, 3, 5)):
        for _ in range(size):
            n = int(torch.randint(1, 5, (1,), generator=gen))
            states = [f"s{uid + k}" for k in range(n)]
            uid += n
            rewards = torch.randn(n, generator=gen).tolist()
            trajs.append(episode([f"x = {k}" for k in range(n)], float(torch.rand(1, generator=gen)), states, states,
                                 group=g, row=g, line_rewards=rewards))
    batch = batch_tensors(trajs, 0)
    for weight in (0.0, 0.5, 1.0):
        for key in ("values", "named"):
            adv = compute_advantages("state", batch, scale=scale, state_weight=weight, state_key=key)
            assert torch.equal(adv, compute_advantages("outcome", batch, scale=scale))


def test_states_are_compared_within_a_group_only():
    # the same two episodes, once in one group and once split into two groups: split, nothing is shared
    lines, states = ["a = 1", "a"], ["S0", "S1"]
    together = [episode(lines, 1.0, states, states), episode(["a = 1", "b"], 0.0, states, states)]
    apart = [episode(lines, 1.0, states, states, group=0), episode(["a = 1", "b"], 0.0, states, states, group=1)]
    adv = compute_advantages("state", batch_tensors(together, 0), scale="none", state_weight=1.0)
    # S0: both took `a = 1` -> Q = V -> 0; S1: `a` (Q 1) vs `b` (Q 0), V = 0.5 -> +-0.5
    assert_lines(per_line(adv, together), [[0.0, 0.5], [0.0, -0.5]])
    adv = compute_advantages("state", batch_tensors(apart, 0), scale="none", state_weight=1.0)
    assert torch.equal(adv, torch.zeros_like(adv))  # groups of one: outcome advantage 0


def test_unknown_states_and_tokens_outside_lines_get_the_outcome_advantage():
    trajs = example_batch(values=[["", "", ""], ["", "", ""], ["", ""], ["", ""]])
    trajs[0].token_ids.append(9)
    trajs[0].loss_mask.append(1)  # a sampled token in no line
    trajs[0].logprobs.append(0.0)
    batch = batch_tensors(trajs, 0)
    assert (batch["line_state_values"] == -1).all()
    adv = compute_advantages("state", batch, scale="none", state_weight=1.0)
    assert torch.equal(adv, compute_advantages("outcome", batch, scale="none"))
    assert float(adv[0, 4]) == 0.5


def test_revisiting_a_state_counts_the_episode_once():
    # e0 types two lines in S1 (an inspection leaves the state as it was); e1 one. V(S1) = mean(1, 0) = 0.5, not 2/3
    s = ["S0", "S1", "S1"]
    trajs = [episode(["a = 1", "a", "submit(a)"], 1.0, s, s), episode(["a = 1", "submit(2)"], 0.0, s[:2], s[:2])]
    adv = state_advantages(*(batch_tensors(trajs, 0)[k] for k in ("line_state", "line_code", "line_rewards",
                                                                   "outcome", "group", "line_index", "loss_mask")),
                           state_weight=1.0, scale="none")
    assert_lines(per_line(adv, trajs), [[0.0, 0.5, 0.5], [0.0, -0.5]])


def test_repeat_statistics_of_the_worked_example():
    stats = state_stats(example_batch())
    # lines after the first: 6. values: the 5 in S1 are shared (e3's S2 is not) -> 5/6; one step group (S1)
    assert stats["state/repeat_frac_values"] == pytest.approx(5 / 6)
    assert stats["state/step_groups_values"] == 1.0
    assert stats["state/repeat_frac"] == 0.0 and stats["state/step_groups"] == 0.0
    assert stats["state/fresh_frac"] == 0.0  # no later line is typed in S0
    s0 = ["S0", "S0"]
    stuck = state_stats([episode(["1/0", "1/0"], 0.0, s0, s0), episode(["a = 1"], 1.0, s0[:1], s0[:1])])
    assert stuck["state/fresh_frac"] == stuck["state/repeat_frac"] == 1.0 and stuck["state/step_groups"] == 0.0
    assert "state/digest_ms_mean" not in stats  # no line recorded a digest time
    assert state_stats([episode(["a"], 1.0, [""], [""])]) == {}


def test_config_needs_the_digest_for_the_state_estimator():
    from replrl.config import AdvantageConfig, RolloutConfig

    with pytest.raises(ConfigError, match="state_digest"):
        Config(advantages=AdvantageConfig(estimator="state"), rollout=RolloutConfig(state_digest=False))
    with pytest.raises(ConfigError, match="state_key"):
        AdvantageConfig(state_key="names")
    with pytest.raises(ConfigError, match="state_weight"):
        AdvantageConfig(state_weight=1.5)
    assert Config(advantages=AdvantageConfig(estimator="state", state_key="named")).advantages.state_key == "named"


def test_worked_example_with_real_kernels():
    """The four episodes typed into real kernels: their recorded start states reproduce the table's."""
    from replrl.repl import ReplSession
    from sandbox import KernelPool

    async def run():
        async with KernelPool(size=4, tools=("submit",)) as pool:
            async def one(lines):
                async with pool.acquire() as kernel:
                    session, states = ReplSession(kernel, banner="", digest=True), []
                    for code in lines:
                        states.append(session.start_state())
                        await session.feed(code)
                    return states

            return await asyncio.gather(*(one(lines) for lines, _ in EXAMPLE))

    recorded = asyncio.run(run())
    named = [[n for n, _ in ep] for ep in recorded]
    values = [[v for _, v in ep] for ep in recorded]
    for table, got in ((VALUES_STATES, values), (NAMED_STATES, named)):  # table label <-> recorded hash, one to one
        pairs = {(label, h) for labels, hashes in zip(table, got) for label, h in zip(labels, hashes)}
        assert len({label for label, _ in pairs}) == len({h for _, h in pairs}) == len(pairs), pairs
    trajs = example_batch(values=values, named=named)
    adv = compute_advantages("state", batch_tensors(trajs, 0), scale="none", state_weight=0.5)
    assert_lines(per_line(adv, trajs), HALF)
