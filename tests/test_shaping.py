"""Shaping that researchers ask for: weight schedules, gates on the outcome, the share of correct episodes pushed
down, the unbiased line_rtg estimator (checked against the exact policy gradient by enumeration), terms from files
and notebooks, and the three worked example terms."""

from __future__ import annotations

import itertools
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from replrl.advantages import batch_tensors, compute_advantages, correct_negative, line_rtg_advantages
from replrl.config import AdvantageConfig, Config, RewardConfig
from replrl.configlib import ConfigError, load_file, resolve, to_toml
from replrl.rewards import RewardModel, term_file
from replrl.rewards import resolve as resolve_term
from replrl.schedules import Schedule
from replrl.types import Line, Trajectory

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def episode(*lines: Line, correct: bool | None = None, submitted: bool = True, group: int = 0) -> Trajectory:
    """An episode scored line by line as the rollout does, then settled with ``finish``; one token per line."""
    return Trajectory(token_ids=[], loss_mask=[], logprobs=[], prompt_len=0, text="", lines=list(lines),
                      correct=correct, group=group)


def score(model: RewardModel, traj: Trajectory, submitted: bool = True) -> Trajectory:
    lines, traj.lines = traj.lines, []
    for line in lines:
        line.rewards = model.score_line(line, traj)
        traj.lines.append(line)
    model.finish(traj, submitted)
    n = len(lines)  # one sampled token per line, after a one-token prompt
    traj.token_ids, traj.loss_mask, traj.logprobs, traj.prompt_len = [0] * (n + 1), [0] + [1] * n, [0.0] * (n + 1), 1
    for k, line in enumerate(traj.lines):
        line.token_span = (k + 1, k + 2)
    return traj


# ---------------------------------------------------------------------------------------------------------------
# 1. schedules


def test_schedule_shapes():
    linear = Schedule(-0.3, 0.0, "linear", steps=50)
    assert [linear(s) for s in (0, 25, 50, 80)] == pytest.approx([-0.3, -0.15, 0.0, 0.0])
    cosine = Schedule(-0.3, 0.0, "cosine", steps=50)
    # -0.3 + 0.3 * (1 - cos(pi * s / 50)) / 2: 0 at s = 0, half way at 25, 0.3 * (1 - cos(pi / 5)) / 2 at 10
    assert [cosine(s) for s in (0, 10, 25, 50, 99)] == pytest.approx(
        [-0.3, -0.3 + 0.15 * (1 - math.cos(math.pi / 5)), -0.15, 0.0, 0.0])
    step = Schedule(0.0, -0.2, "step", at=20)
    assert [step(s) for s in (0, 19, 20, 500)] == [0.0, 0.0, -0.2, -0.2]
    assert Schedule(0.5)(10**6) == 0.5


def test_schedules_from_a_toml_file_and_back(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(textwrap.dedent("""
        [rewards.weights]
        correct = 1.0
        syntax_error = {start = -0.3, end = 0.0, steps = 50, shape = "linear"}
        exception = {start = -0.1, end = 0.0, steps = 10, shape = "cosine"}
        timeout = {start = 0.0, end = -0.2, at = 20, shape = "step", gate = "wrong"}
        repeat_line = {value = -0.1}
        [rewards.gates]
        syntax_error = "wrong"
    """))
    cfg = resolve(Config, str(path), {})
    model = RewardModel.from_config(cfg.rewards)
    assert model.terms["syntax_error"].gate == model.terms["timeout"].gate == "wrong"
    assert model.terms["repeat_line"].gate == "always"
    assert model.at(25).weights()["syntax_error"] == pytest.approx(-0.15)
    assert model.at(20).weights()["timeout"] == -0.2 and model.at(19).weights()["timeout"] == 0.0
    # the trainer logs the weight of each term that changes over steps (not the constants)
    assert model.at(5).scheduled_weights() == pytest.approx(
        {"weight/syntax_error": -0.27, "weight/exception": -0.05, "weight/timeout": 0.0})
    # the run's saved config.toml loads back to the same config
    saved = tmp_path / "saved.toml"
    saved.write_text(to_toml(cfg))
    again = resolve(Config, str(saved), {})
    assert again.rewards == cfg.rewards
    assert load_file(saved)["rewards"]["weights"]["exception"]["shape"] == "cosine"


def test_score_line_uses_the_weight_of_the_step():
    model = RewardModel({"syntax_error": {"start": -0.4, "end": 0.0, "steps": 4}})
    bad = Line("x = = 1", status="error", error_name="SyntaxError")
    assert [model.at(s).score_line(bad, episode())["syntax_error"] for s in range(6)] == pytest.approx(
        [-0.4, -0.3, -0.2, -0.1, 0.0, 0.0])
    assert model.step == 0  # at() is a copy: the trainer's model is not changed


@pytest.mark.parametrize("weights, gates, message", [
    ({"syntax_error": {"start": -0.3, "end": 0}}, {}, "needs start, end, steps (missing steps)"),
    ({"syntax_error": {"start": -0.3, "end": 0, "steps": 0}}, {}, "steps must be an integer >= 1"),
    ({"syntax_error": {"start": -0.3, "end": 0, "steps": 5, "shape": "exp"}}, {}, "shape must be one of"),
    ({"syntax_error": {"value": "a lot"}}, {}, "rewards.weights.syntax_error.value must be a number"),
    ({"syntax_error": "-0.3"}, {}, "rewards.weights.syntax_error must be a number"),
    ({"syntax_error": {"start": 1, "end": 0, "at": -1}}, {}, "at must be an integer step >= 0"),
    ({"syntax_error": {"start": 1, "end": 0, "steps": 5, "at": 3}}, {}, "'steps' does not apply to a step schedule"),
    ({"syntax_error": {"valu": 1}}, {}, "unknown key 'valu'"),
    ({"syntax_error": {"value": 1, "gate": "sometimes"}}, {}, "gate must be one of always, correct, wrong"),
    ({"syntax_error": -0.3}, {"syntax_error": "right"}, "rewards.gates.syntax_error must be one of"),
    ({"correct": 1.0}, {"correct": "wrong"}, "gates apply to line terms"),
    ({"correct": {"value": 1.0, "gate": "wrong"}}, {}, "gates apply to line terms"),
    # a weights table merges with the defaults (issue 49): a gate on a term weighted nowhere is the error
    ({"syntax_error": -0.3}, {"late_line": "wrong"}, "rewards.gates.late_line: no such term"),
    ({"syntax_error": {"value": -0.3, "gate": "wrong"}}, {"syntax_error": "correct"}, "says gate 'wrong'"),
    ({"late_line": 1.0, "replrl.rewards:late_line": 1.0}, {}, "would be logged as 'late_line', like another"),
])
def test_bad_schedules_and_gates_are_one_line_config_errors(weights, gates, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        RewardModel.from_config(resolve(Config, None, {"rewards": {"weights": weights, "gates": gates}}).rewards)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------------------------
# 2. gates


def test_gated_terms_are_zero_on_the_episodes_their_gate_excludes():
    model = RewardModel({"correct": 1.0, "no_submit": -0.2, "syntax_error": -0.3, "exception": -0.1},
                        gates={"syntax_error": "wrong", "exception": "correct"})

    def lines():
        return [Line("x = = 1", status="error", error_name="SyntaxError"),
                Line("1/0", status="error", error_name="ZeroDivisionError"), Line("submit(1)")]

    right = score(model, episode(*lines(), correct=True))
    wrong = score(model, episode(*lines(), correct=False))
    silent = score(model, episode(*lines()[:2], correct=None), submitted=False)
    # the keys stay (0 when gated off), so reward/<term> is the mean contribution per episode at every step
    assert [ln.rewards for ln in right.lines[:2]] == [{"syntax_error": 0.0, "exception": 0.0},
                                                      {"syntax_error": 0.0, "exception": -0.1}]
    assert [ln.rewards for ln in wrong.lines[:2]] == [{"syntax_error": -0.3, "exception": 0.0},
                                                      {"syntax_error": 0.0, "exception": 0.0}]
    assert silent.lines[0].rewards == {"syntax_error": -0.3, "exception": 0.0}  # no submission counts as wrong
    assert (right.outcome_rewards, wrong.outcome_rewards, silent.outcome_rewards) == (
        {"correct": 1.0}, {"wrong": 0.0}, {"no_submit": -0.2})
    assert (right.reward, wrong.reward, silent.reward) == pytest.approx((0.9, -0.3, -0.5))
    # the batch tensors are built from the stored rewards, so they carry the gate too
    batch = batch_tensors([right, wrong, silent], pad_id=0)
    assert torch.allclose(batch["line_rewards"], torch.tensor([[0.0, -0.1, 0.0], [-0.3, 0.0, 0.0], [-0.3, 0.0, 0.0]]))
    assert batch["correct"].tolist() == [True, False, False]


def test_an_ungated_per_line_penalty_makes_a_correct_episode_negative_and_the_wrong_gate_fixes_it():
    """AdaTIR's failure: a correct episode of many lines, each penalised, against short wrong ones."""
    def group(gates):
        model = RewardModel({"correct": 1.0, "wrong": 0.0, "late_line": -0.05}, gates=gates)
        long_right = episode(*(Line(f"x{k} = {k}") for k in range(8)), Line("submit(x7)"), correct=True)
        # 9 lines: penalties 0.05 * (0 + 1 + ... + 8) = 1.8 > the 1.0 the answer earns -> total -0.8
        short_wrong = [episode(Line("submit(0)"), correct=False), episode(Line("submit(1)"), correct=False),
                       episode(Line("y = 2"), Line("submit(y)"), correct=False)]
        return [score(model, t) for t in (long_right, *short_wrong)]

    for estimator in ("outcome", "line", "line_rtg"):
        cfg = AdvantageConfig(estimator=estimator)
        ungated = batch_tensors(group({}), pad_id=0)
        adv = compute_advantages(estimator, ungated, **vars(cfg))     # every option of the config, as the trainer
        assert correct_negative(adv, ungated["loss_mask"], ungated["correct"]) == (1, 1), estimator
        gated = batch_tensors(group({"late_line": "wrong"}), pad_id=0)
        adv = compute_advantages(estimator, gated, **vars(cfg))
        assert correct_negative(adv, gated["loss_mask"], gated["correct"]) == (0, 1), estimator
        assert (adv[0][gated["loss_mask"][0] > 0] > 0).all()
    assert group({})[0].reward == pytest.approx(-0.8) and group({"late_line": "wrong"})[0].reward == 1.0


def test_correct_negative_counts_only_sampled_tokens_of_correct_episodes():
    adv = torch.tensor([[-5.0, 1.0, 2.0], [-1.0, 0.0, 0.0], [1.0, 1.0, -0.1]])
    loss_mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # row 0: its negative token is a prompt token (mask 0) -> not negative; row 1 is wrong; row 2 is negative
    assert correct_negative(adv, loss_mask, torch.tensor([True, False, True])) == (1, 2)


# ---------------------------------------------------------------------------------------------------------------
# 3. line_rtg


def test_line_rtg_by_hand():
    # group 0: A lines [0.5, -1, 1] outcome 1 (R 1.5); B lines [-1, 0.5] outcome 0 (R -0.5); C [2] outcome 1 alone
    # tokens: p 0 0 o 1 2 2 x (A) ; p 0 0 0 o 1 . . (B) ; p 0 0 o . . . . (C)
    loss_mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0.0]])
    line_index = torch.tensor([[-1, 0, 0, -1, 1, 2, 2, -1], [-1, 0, 0, 0, -1, 1, -1, -1],
                               [-1, 0, 0, -1, -1, -1, -1, -1]])
    args = (torch.tensor([[0.5, -1.0, 1.0], [-1.0, 0.5, 0.0], [2.0, 0.0, 0.0]]), torch.tensor([3, 2, 1]),
            torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]), line_index, loss_mask)
    # baselines (mean return of the others): A -0.5, B 1.5, C 0 (alone)
    # returns-to-go incl. outcome: A [1.5, 1, 2], B [-0.5, 0.5], C [3]
    # A: [2, 1.5, 2.5], x = R - b = 2; B: [-2, -1]; C: [3]
    expected = [[0, 2, 2, 0, 1.5, 2.5, 2.5, 2], [0, -2, -2, -2, 0, -1, 0, 0], [0, 3, 3, 0, 0, 0, 0, 0]]
    assert torch.allclose(line_rtg_advantages(*args), torch.tensor(expected))
    # std: group 0's returns {1.5, -0.5} have population std 1; C (std 0) is not divided
    assert torch.allclose(line_rtg_advantages(*args, scale="std"), torch.tensor(expected))
    halved = line_rtg_advantages(args[0] * 2, args[1], args[2] * 2, *args[3:], scale="std")
    assert torch.allclose(halved[:2], torch.tensor(expected[:2]))  # std: invariant to the reward units


# A two-step policy whose episodes differ in length. Step 1: action a in {0, 1, 2}; a = 0 submits at once (one line).
# Otherwise step 2: action b in {0, 1, 2} (two lines). Each action is one sampled token and one line; line rewards
# r1[a], r2[a, b] and an outcome reward o(episode) arbitrary. Token layout: prompt, a, interpreter output, b.
EPISODES = [(0,)] + [(a, b) for a in (1, 2) for b in (0, 1, 2)]


def _problem(seed: int):
    g = torch.Generator().manual_seed(seed)
    theta1 = torch.randn(3, generator=g, dtype=torch.float64).requires_grad_()
    theta2 = torch.randn(3, 3, generator=g, dtype=torch.float64).requires_grad_()
    r1, r2 = torch.randn(3, generator=g, dtype=torch.float64), torch.randn(3, 3, generator=g, dtype=torch.float64)
    outcome = {ep: float(torch.randn(1, generator=g, dtype=torch.float64)) for ep in EPISODES}
    return theta1, theta2, r1, r2, outcome


def _logprob_tokens(theta1, theta2, ep):
    """log pi of each sampled token at its position [T = 4]."""
    zero = torch.zeros((), dtype=torch.float64)
    first = torch.log_softmax(theta1, -1)[ep[0]]
    second = torch.log_softmax(theta2[ep[0]], -1)[ep[1]] if len(ep) == 2 else zero
    return torch.stack([zero, first, zero, second])


def _true_gradient(theta1, theta2, r1, r2, outcome):
    """grad of J = sum over episodes of p(episode) * return(episode), exactly."""
    J = 0
    for ep in EPISODES:
        ret = r1[ep[0]] + (r2[ep] if len(ep) == 2 else 0) + outcome[ep]
        J = J + _logprob_tokens(theta1, theta2, ep).sum().exp() * ret
    return torch.cat([g.flatten() for g in torch.autograd.grad(J, (theta1, theta2))])


def _expected_estimate(estimator, opts, G, theta1, theta2, r1, r2, outcome):
    """E over groups of G independent episodes of (1/G) sum_i sum_t A_it grad log pi(a_it): every group enumerated,
    weighted by its probability."""
    with torch.no_grad():
        prob = {ep: float(_logprob_tokens(theta1, theta2, ep).sum().exp()) for ep in EPISODES}
    groups = list(itertools.product(EPISODES, repeat=G))
    rows = [ep for grp in groups for ep in grp]
    batch = {
        "loss_mask": torch.tensor([[0, 1, 0, len(ep) == 2] for ep in rows], dtype=torch.float64),
        "line_index": torch.tensor([[-1, 0, -1, 1 if len(ep) == 2 else -1] for ep in rows]),
        "line_rewards": torch.tensor([[float(r1[ep[0]]), float(r2[ep]) if len(ep) == 2 else 0.0] for ep in rows],
                                     dtype=torch.float64),
        "n_lines": torch.tensor([len(ep) for ep in rows]),
        "outcome": torch.tensor([outcome[ep] for ep in rows], dtype=torch.float64),
        "group": torch.arange(len(groups)).repeat_interleave(G),
    }
    adv = compute_advantages(estimator, batch, **opts).detach().double()   # [B, T]
    weight = torch.tensor([math.prod(prob[ep] for ep in grp) for grp in groups], dtype=torch.float64)
    weight = weight.repeat_interleave(G) / G                               # [B]
    logp = torch.stack([_logprob_tokens(theta1, theta2, ep) for ep in rows])  # [B, T]
    surrogate = (weight[:, None] * adv * logp).sum()
    return torch.cat([g.flatten() for g in torch.autograd.grad(surrogate, (theta1, theta2))])


@pytest.mark.parametrize("seed, G", [(0, 2), (1, 2), (2, 3)])
def test_line_rtg_expected_gradient_is_the_policy_gradient(seed, G):
    problem = _problem(seed)
    true = _true_gradient(*problem)
    assert true.abs().max() > 0.05  # a real gradient, not a vanishing one
    rtg = _expected_estimate("line_rtg", {"scale": "none"}, G, *problem)
    assert torch.allclose(rtg, true, atol=1e-6, rtol=0), (rtg - true).abs().max()
    # today's "line" estimator (per-index baselines among the episodes that reached the index) is not unbiased: not
    # even in direction (so no rescaling of the learning rate makes up for it)
    for opts in ({"scale": "none", "line_weight": 0.5}, {"scale": "none", "line_weight": 1.0}):
        line = _expected_estimate("line", opts, G, *problem)
        assert (line - true).abs().max() > 1e-2
        cosine = float(line @ true / (line.norm() * true.norm()))
        assert cosine < 0.999, cosine
    # dividing by the group's std (it includes the episode itself) is the GRPO compromise: biased
    assert (_expected_estimate("line_rtg", {"scale": "std"}, G, *problem) - true).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# 4. terms from files and notebooks

THRESHOLD = 3


def long_name(line):
    """1 when the line assigns a name longer than THRESHOLD characters (uses a module and a global constant)."""
    match = re.match(r"\s*([A-Za-z_]\w*)\s*=", line.code)
    return float(bool(match) and len(match.group(1)) > THRESHOLD)


def identity(fn):
    return fn


@identity
def decorated(line, traj):
    return 2.0


SOMETHING = object()


def uses_an_object(line):
    return float(SOMETHING is None)


def test_term_file_writes_a_function_that_another_process_imports(tmp_path):
    spec = term_file(long_name, tmp_path / "terms")
    path, _, attr = spec.rpartition(":")
    assert attr == "long_name" and path == str((tmp_path / "terms" / "long_name.py").resolve())
    source = Path(path).read_text()
    assert "import re\n" in source and "THRESHOLD = 3\n" in source
    # another process (as a sweep's `replrl train` runs), from another directory, with the spec in its config
    code = (f"from replrl.config import RewardConfig; from replrl.rewards import RewardModel; from replrl.types "
            f"import Line, Trajectory; m = RewardModel.from_config(RewardConfig(weights={{{spec!r}: -0.5}})); "
            f"t = Trajectory([], [], [], 0, ''); "
            f"print(m.score_line(Line('total = 1'), t), m.score_line(Line('x = 1'), t))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["{'long_name':", "-0.5}", "{'long_name':", "0.0}"]


def test_term_file_drops_decorators_and_refuses_globals_it_cannot_write(tmp_path):
    spec = term_file(decorated, tmp_path)
    assert "@identity" not in Path(spec.rpartition(":")[0]).read_text()
    assert resolve_term(spec)(Line("x"), episode()) == 2.0
    with pytest.raises(ValueError, match="uses the global 'SOMETHING'.*inside the function"):
        term_file(uses_an_object, tmp_path)
    with pytest.raises(ValueError, match="defined with def"):
        term_file(lambda line: 1.0, tmp_path)


def test_a_term_defined_in_a_notebook_cell(tmp_path):
    """IPython keeps a cell's source where inspect.getsource finds it: the notebook workflow, in a real shell."""
    script = textwrap.dedent(f"""
        from IPython.core.interactiveshell import InteractiveShell
        shell = InteractiveShell.instance(history_length=0)
        result = shell.run_cell('''
        import math
        from replrl.rewards import term_file

        def sqrt_of_index(index):
            return math.sqrt(index)

        spec = term_file(sqrt_of_index, {str(tmp_path / "terms")!r})
        ''')
        result.raise_error()
        print(shell.user_ns["spec"])
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={**ENV, "IPYTHONDIR": str(tmp_path / "ipython")})
    assert out.returncode == 0, out.stderr[-2000:]
    spec = out.stdout.strip().splitlines()[-1]
    assert spec.endswith("sqrt_of_index.py:sqrt_of_index")
    model = RewardModel({spec: 1.0})
    assert model.score_line(Line("x"), episode(Line("a"), Line("b"), Line("c"), Line("d"))) == {"sqrt_of_index": 2.0}


def test_a_file_path_spec_is_resolved_and_errors_are_one_line(tmp_path):
    (tmp_path / "t.py").write_text("def short(line):\n    return float(len(line.code) < 4)\n")
    assert resolve_term(f"{tmp_path}/t.py:short")(Line("x = 1")) == 0.0
    (tmp_path / "broken.py").write_text("def f(:\n")
    for spec, message in ((f"{tmp_path}/t.py:nope", "has no attribute 'nope'"),
                          (f"{tmp_path}/missing.py:f", "no file"),
                          (f"{tmp_path}/broken.py:f", "raised SyntaxError")):
        with pytest.raises(ValueError, match=message) as err:
            resolve_term(spec)
        assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------------------------
# 5. the worked examples


def test_late_line_grows_with_the_line_index():
    model = RewardModel({"late_line": -0.1})
    traj = score(model, episode(Line("a = 1"), Line("b = 2"), Line("c = 3"), Line("submit(c)"), correct=True))
    assert [ln.rewards["late_line"] for ln in traj.lines] == pytest.approx([0.0, -0.1, -0.2, -0.3])
    assert traj.reward == pytest.approx(-0.1 * 4 * 3 / 2)  # w * n(n-1)/2


def test_ran_and_printed_reads_the_interpreter_status():
    model = RewardModel({"ran_and_printed": 0.1})
    lines = [Line("x", output="3\n"), Line("y = 1"), Line("1/0", output="Traceback ...\nZeroDivisionError\n",
                                                             status="error", error_name="ZeroDivisionError"),
             Line("print('hi')", output="hi\n"), Line("while 1: pass", output="KeyboardInterrupt\n", status="timeout")]
    assert [model.score_line(ln, episode())["ran_and_printed"] for ln in lines] == [0.1, 0.0, 0.0, 0.1, 0.0]


def test_used_later_credits_the_line_whose_value_a_later_line_uses():
    model = RewardModel({"used_later": 0.2})
    traj = episode(
        Line("n = 10"),                                              # 0: n is read by line 1            -> bonus
        Line("unused = 5"),                                          # 1: never read again                -> 0
        Line("for i in range(n):", status="incomplete", prompt=">>> "),  # 2-3: buffered, carry no reward
        Line("    total += i", status="incomplete", prompt="... "),
        Line("", prompt="... "),                                     # 4: closes the block: total read at 5 -> bonus
        Line("total", output="45\n"),                                # 5: prints 45, typed again at 7     -> bonus
        Line("len('ab')", output="2\n"),                             # 6: prints 2 (< 10: too common)     -> 0
        Line("submit(45 + 2 * 0)"),                                  # 7: last line                       -> 0
        correct=True)
    traj = score(model, traj)
    assert [ln.rewards.get("used_later") for ln in traj.lines] == [0.2, 0.0, None, None, 0.2, 0.2, 0.0, 0.0]
    # scored only when the episode is over: during the rollout the term is absent
    assert model.score_line(Line("n = 1"), episode()) == {}


def test_used_later_sees_names_a_failed_or_printed_line_does_not_produce():
    model = RewardModel({"used_later": 1.0})
    traj = score(model, episode(Line("x = = 1", status="error", error_name="SyntaxError"),
                                Line("import math"), Line("print(math.pi)", output="3.141592653589793\n"),
                                Line("def f(k): return k"), Line("f(3.141592653589793)", output="3.14\n"),
                                correct=False))
    assert [ln.rewards["used_later"] for ln in traj.lines] == [0.0, 1.0, 1.0, 1.0, 0.0]


def test_computed_used_later_pays_nothing_for_an_import():
    """The import farming of the shaping experiment: `used_later` pays for `import m` when m is used, this does not;
    a computed value, a function and a loop still earn the bonus."""
    def lines() -> list[Line]:  # fresh each time: scoring writes each line's rewards
        return [Line("from typing import List"), Line("import math"), Line("def f(xs: List[int]): return sum(xs)"),
                Line("n = math.isqrt(50)"), Line("for i in range(n):", status="incomplete", prompt=">>> "),
                Line("    last = i", status="incomplete", prompt="... "), Line("", prompt="... "),
                Line("submit(f([n, last]))")]
    old = score(RewardModel({"used_later": 1.0}), episode(*lines(), correct=True))
    new = score(RewardModel({"computed_used_later": 1.0}), episode(*lines(), correct=True))
    assert [ln.rewards.get("used_later") for ln in old.lines] == [1.0, 1.0, 1.0, 1.0, None, None, 1.0, 0.0]
    assert [ln.rewards.get("computed_used_later") for ln in new.lines] == [0.0, 0.0, 1.0, 1.0, None, None, 1.0, 0.0]


def test_worked_examples_are_off_by_default():
    weights = RewardConfig().weights
    assert not {"late_line", "used_later", "computed_used_later", "ran_and_printed"} & set(weights)
    assert set(RewardModel(weights).terms) == {"syntax_error", "exception", "timeout", "crash", "repeat_line"}


# ---------------------------------------------------------------------------------------------------------------
# 6. through the trainer


@pytest.mark.slow  # the format model is taught once per session (a fixture shared with test_trainer.py)
def test_the_trainer_logs_scheduled_weights_gates_terms_and_correct_negative_frac(format_model_dir, tmp_path):
    from replrl.metrics import read_metrics
    from replrl.trainer import Trainer

    (tmp_path / "terms").mkdir()
    (tmp_path / "terms" / "every_line.py").write_text("def every_line(line):\n    return 1.0\n")
    every = f"{tmp_path / 'terms' / 'every_line.py'}:every_line"
    cfg = resolve(Config, None, {
        "model": {"name": str(format_model_dir), "chat_template": False},
        "task": {"name": "tests.toy:EchoTask"},
        "rollout": {"group_size": 4, "problems_per_step": 2, "max_lines": 2, "max_line_tokens": 12,
                    "max_total_tokens": 256, "wall_s": 2.0, "temperature": 1.0},
        "rewards": {"weights": {"correct": 1.0, "wrong": 0.0, "no_submit": -0.2,
                                "syntax_error": {"start": -0.3, "end": -0.1, "at": 1, "shape": "step"},
                                every: {"start": -2.0, "end": -1.0, "steps": 2}},
                    "gates": {"every_line": "wrong"}},
        "advantages": {"estimator": "line_rtg", "scale": "none"},
        "optim": {"lr": 1e-3, "micro_batch": 8},
        "run": {"max_steps": 2, "save_every": 2, "log_samples_every": 0, "eval_n": 0,
                "time_budget_min": 0},
    })
    steps = []
    Trainer(cfg, tmp_path / "run", progress=False).train(on_step=steps.append)
    rows = read_metrics(tmp_path / "run")
    assert [(r["weight/syntax_error"], r["weight/every_line"]) for r in rows] == [(-0.3, -2.0), (-0.1, -1.5)]
    for result, row in zip(steps, rows):
        for t in result.trajectories:
            expected = 0.0 if t.correct else row["weight/every_line"]
            assert all(ln.rewards["every_line"] == expected for ln in t.lines if ln.status != "incomplete")
        if any(t.correct for t in result.trajectories):
            # gated: a correct episode's total is 1 and every wrong one's is below 0: never a negative advantage
            assert row["adv/correct_negative_frac"] == 0.0
    assert any("adv/correct_negative_frac" in r for r in rows)
    saved = load_file(tmp_path / "run" / "config.toml")["rewards"]
    assert saved["gates"] == {"every_line": "wrong"} and saved["weights"][every]["steps"] == 2
