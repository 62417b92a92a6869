"""loss.predict_output: the cross-entropy on the interpreter's output tokens (replrl/predict_output.py).

Worked numbers for the term and its gradient; the term through the chunked LM head of a tiny real model (plain and
LoRA) against the full softmax; the trainer's update at weight 0 (bit-identical, figures or not) and at weight > 0
(the gradient is GRPO's plus the weight times the mean cross-entropy's, over micro-batches; under LoRA the adapters'
only); a real step with the tree and the state estimator; and the mask on a real episode from a real kernel: exactly
what the REPL printed, never the prompts or the truncation marker. Elsewhere: 2 ranks under DDP
(tests/test_multiprocess.py) and FSDP2 (tests/test_fsdp.py), the vLLM backend (tests/test_backend_vllm.py).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from replrl.advantages import batch_tensors
from replrl.loss import TokenScorer, token_logprobs_and_entropy
from replrl.predict_output import output_mask, output_nll, output_spans
from replrl.types import LineSample, SamplingParams
from tests.toy import EchoTask

pytestmark = pytest.mark.timeout(600)


def test_cross_entropy_and_its_gradient_worked_by_hand():
    # V = 3; two output tokens (positions 2 and 4 of one row; targets 2 and 1), predicted from positions 1 and 3:
    #   logits [0, 0, ln 2] -> p = [1/4, 1/4, 1/2]; target 2: nll = ln 2; argmax 2: a hit
    #   logits [ln 3, 0, 0] -> p = [3/5, 1/5, 1/5]; target 1: nll = ln 5; argmax 0: a miss
    # mean nll = (ln 2 + ln 5) / 2 = ln 10 / 2 = 1.151293; accuracy 1/2
    # d mean / d logits = (p - onehot(target)) / 2: [1/8, 1/8, -1/4] and [3/10, -2/5, 1/10]
    table = torch.zeros(1, 5, 3)
    table[0, 1] = torch.tensor([0.0, 0.0, math.log(2)])
    table[0, 3] = torch.tensor([math.log(3), 0.0, 0.0])
    table.requires_grad_()
    ids = torch.tensor([[0, 0, 2, 0, 1]])
    out_mask = torch.tensor([[0.0, 0, 1, 0, 1]])
    nll, hit = output_nll(lambda r, c: table[r, c], ids, out_mask, chunk=1)  # one token a chunk
    assert torch.allclose(nll, torch.tensor([[0, 0, math.log(2), 0, math.log(5)]]))
    assert hit.tolist() == [[0, 0, 1, 0, 0]]
    mean = nll.sum() / out_mask.sum()
    assert math.isclose(mean.item(), math.log(10) / 2, rel_tol=1e-6)
    mean.backward()
    expected = torch.zeros(1, 5, 3)
    expected[0, 1] = torch.tensor([1 / 8, 1 / 8, -1 / 4])
    expected[0, 3] = torch.tensor([3 / 10, -2 / 5, 1 / 10])
    assert torch.allclose(table.grad, expected, atol=1e-7)
    nll, _ = output_nll(lambda r, c: table[r, c], ids, out_mask, grad=False)
    assert not nll.requires_grad


def tiny_llama(lora: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    if lora:
        from replrl.config import ModelConfig
        from replrl.policy import _with_lora

        pytest.importorskip("peft")
        model = _with_lora(model, ModelConfig(lora_rank=4))
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 100, (2, 9), generator=g)
    att = torch.ones(2, 9, dtype=torch.long)
    att[1, 6:] = 0
    ids[1, 6:] = 0
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1, 0], [0, 1, 1, 0, 0, 1, 0, 0, 0]], dtype=torch.float)
    out_mask = torch.tensor([[0, 0, 0, 0, 1, 1, 0, 0, 1], [0, 0, 0, 1, 1, 0, 0, 0, 0]], dtype=torch.float)
    return ids, att, loss_mask, out_mask


@pytest.mark.parametrize("lora", [False, True])
def test_the_scorers_term_is_the_full_softmax_cross_entropy_and_leaves_the_policy_term_alone(lora):
    """One decoder pass gives both: the log-probs and entropies on loss_mask are bit-identical to scoring without
    the term, and the term's value and gradient (LM head in chunks of 2 states) are those of a plain log_softmax of
    the model's full logits at the output positions (adapters only, under LoRA)."""
    model = tiny_llama(lora).train()
    ids, att, loss_mask, out_mask = batch()
    params = SamplingParams(temperature=0.7, top_k=20)
    lp0, ent0 = token_logprobs_and_entropy(model, ids, att, params, loss_mask=loss_mask)
    scorer = TokenScorer(model)
    from replrl import loss as loss_module

    lp, ent, (nll_s, _) = scorer(ids, att, params, loss_mask=loss_mask, output_mask=out_mask)
    assert torch.equal(lp, lp0) and torch.equal(ent, ent0)
    _, _, (nll, hit) = loss_module._token_logprobs(model, ids, att, params, None, True, loss_mask, chunk=2,
                                                   output_mask=out_mask)
    torch.testing.assert_close(nll, nll_s.detach())
    model.zero_grad()
    (nll.sum() / out_mask.sum()).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=att).logits.float()              # [B, T, V] (the manual way)
    manual = -logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # [B, T-1]  token t from t - 1
    on = out_mask[:, 1:] > 0
    torch.testing.assert_close(nll[:, 1:][on], manual[on])
    assert (nll[out_mask == 0] == 0).all()
    assert torch.equal(hit[:, 1:][on], (logits[:, :-1].argmax(-1) == ids[:, 1:])[on].float())
    (manual[on].sum() / on.sum()).backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and got
    assert all(("lora_" in n) for n in got) if lora else True
    for n in got:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)


# ---------------------------------------------------------------------------------------------------------------
# the trainer's update


def toy_config(model_dir: Path, model: dict | None = None, **loss: object):
    from replrl.config import Config
    from replrl.configlib import resolve

    return resolve(Config, None, {
        "model": {"name": str(model_dir), "chat_template": False, **(model or {})},
        "task": {"name": "tests.toy:EchoTask"},
        "rollout": {"group_size": 4, "problems_per_step": 2, "max_lines": 3, "max_line_tokens": 12,
                    "max_total_tokens": 256, "wall_s": 2.0, "temperature": 1.0},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "micro_batch": 2, "grad_clip": 0.0},
        "loss": loss,
        "run": {"max_steps": 1, "save_every": 0, "log_samples_every": 0, "eval_n": 0, "time_budget_min": 0},
    })


@pytest.fixture(scope="module")
def probe(format_model_dir, tmp_path_factory) -> list:
    """The episodes of one training step of the toy model (the batch the updates below run on)."""
    from replrl.trainer import Trainer

    trajs: list = []
    Trainer(toy_config(format_model_dir), tmp_path_factory.mktemp("probe"), progress=False).train(
        on_step=lambda r: trajs.extend(r.trajectories))
    return trajs


def test_the_update_adds_the_weighted_mean_cross_entropy_and_nothing_at_weight_0(format_model_dir, probe, tmp_path):
    """Three trainers from the same weights update on the same batch (4 micro-batches of 2; one row without output
    tokens): weight 0 with the figures on leaves the weights and gradients bit-identical to weight 0 without them;
    weight 0.5 leaves every policy figure (loss, clip_frac, entropy, approx_kl) as it was, and its gradient is the
    GRPO gradient plus 0.5 x the gradient of the mean cross-entropy over all the minibatch's output tokens,
    computed by hand from the full logits of the initial model."""
    from replrl.trainer import Trainer

    plain = Trainer(toy_config(format_model_dir), tmp_path / "plain", progress=False)
    figures = Trainer(toy_config(format_model_dir, predict_output_metrics=True), tmp_path / "figures", progress=False)
    term = Trainer(toy_config(format_model_dir, predict_output=0.5), tmp_path / "term", progress=False)
    alone = Trainer(toy_config(format_model_dir, predict_output=0.5), tmp_path / "alone", progress=False)
    initial = copy.deepcopy(plain.model)
    b = batch_tensors(probe, plain.pad_id)
    B, T = b["input_ids"].shape
    assert B == 8
    # stand-in output spans (the toy model submits at its first line: its episodes print nothing): prompt tokens of
    # each row but the third, a different number per row
    out = torch.zeros(B, T)
    for i in range(B):
        if i != 2:
            out[i, 3:6 + i] = 1.0
    assert not (out * b["loss_mask"]).any()
    b["output_mask"] = out
    adv = b["loss_mask"] * torch.tensor([1, -1, 0, 0, 1, 1, -1, 0], dtype=torch.float)[:, None]
    stats = {name: t.update(dict(b), adv) for name, t in (("plain", plain), ("figures", figures), ("term", term))}
    alone.update(dict(b), torch.zeros_like(adv))                     # no advantage: the term's gradient alone
    grads = {name: [p.grad for p in t.model.parameters()] for name, t in
             (("plain", plain), ("figures", figures), ("term", term), ("alone", alone))}
    assert all(torch.equal(a, c) for a, c in zip(plain.model.parameters(), figures.model.parameters(), strict=True))
    assert all(torch.equal(a, c) for a, c in zip(grads["plain"], grads["figures"], strict=True))
    assert "loss/predict_output" not in stats["plain"]
    for k in ("loss", "clip_frac", "entropy", "approx_kl", "ratio_mean"):
        assert stats["term"][k] == stats["plain"][k] == stats["figures"][k], k
    # by hand: the mean over the 2 + ... output tokens of -log p, at the initial weights (one minibatch, one epoch)
    ids, att = b["input_ids"], b["attention_mask"]
    logits = initial(input_ids=ids, attention_mask=att).logits.float()                # [B, T, V]
    nll = -logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]       # [B, T-1]
    on = out[:, 1:] > 0
    mean = nll[on].sum() / on.sum()
    mean.backward()
    assert math.isclose(stats["term"]["loss/predict_output"], mean.item(), rel_tol=1e-5)
    assert stats["figures"]["loss/predict_output"] == pytest.approx(mean.item(), rel=1e-5)
    accuracy = float((logits[:, :-1].argmax(-1) == ids[:, 1:])[on].float().mean())
    assert stats["term"]["predict_output/accuracy"] == pytest.approx(accuracy)
    assert stats["term"]["predict_output/tokens"] == float(on.sum())
    # float32 sums in another order (chunks of the LM head, micro-batches trimmed to their own length): a few of the
    # 3.1M entries of the (tied) embedding's gradient differ by up to ~1e-4; a wrong scale or a missed token would
    # be off by far more, in norm
    def same(got, want):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=2e-4)
        assert float((got - want).norm()) <= 1e-3 * float(want.norm()) + 1e-9

    for p_hand, g_alone, g_term, g_plain in zip(initial.parameters(), grads["alone"], grads["term"], grads["plain"],
                                                strict=True):
        same(g_alone, 0.5 * p_hand.grad)
        same(g_term, g_plain + g_alone)   # with the policy gradient: the sum of the two
    assert any(float(p.grad.abs().sum()) > 0 for p in initial.parameters())


def test_under_lora_the_update_gives_the_adapters_the_terms_gradient(format_model_dir, probe, tmp_path):
    """model.lora_rank 4 and loss.predict_output 0.5, no advantage anywhere (the term's gradient alone), on the
    probe's batch with stand-in output spans: the update's figure is the mean cross-entropy over the output tokens
    (4 micro-batches of 2, the LM head in chunks on those tokens only), and its gradient reaches the adapters only,
    equal to 0.5 x the gradient of that mean computed by hand from the full logits of the same peft model."""
    from replrl.trainer import Trainer

    pytest.importorskip("peft")
    t = Trainer(toy_config(format_model_dir, {"lora_rank": 4}, predict_output=0.5), tmp_path / "t", progress=False)
    initial = copy.deepcopy(t.model)
    b = batch_tensors(probe, t.pad_id)
    B, T = b["input_ids"].shape
    out = torch.zeros(B, T)
    for i in range(B):
        out[i, 2:4 + i] = 1.0                                                          # prompt tokens as output
    b["output_mask"] = out
    stats = t.update(dict(b), torch.zeros_like(b["loss_mask"]))
    ids, att = b["input_ids"], b["attention_mask"]
    logits = initial(input_ids=ids, attention_mask=att).logits.float()                # [B, T, V]
    nll = -logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]       # [B, T-1]
    on = out[:, 1:] > 0
    (0.5 * nll[on].mean()).backward()
    assert stats["loss/predict_output"] == pytest.approx(float(nll[on].mean().detach()), rel=1e-5)
    assert stats["predict_output/tokens"] == float(on.sum()) and stats["grad_norm"] > 0
    got = {n: p.grad for n, p in t.model.named_parameters() if p.grad is not None}
    want = {n: p.grad for n, p in initial.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and all("lora_" in n for n in got)
    assert any(float(g.abs().sum()) > 0 for g in got.values())
    for n in got:
        torch.testing.assert_close(got[n], want[n], rtol=1e-3, atol=2e-5, msg=n)


def test_every_micro_batch_with_output_tokens_runs_its_backward(format_model_dir, probe, tmp_path):
    """With no advantage anywhere, GRPO skips every backward; with the term, the micro-batches holding output tokens
    run theirs (a zero-advantage group still learns the interpreter), the others are still skipped."""
    from replrl.trainer import Trainer

    t = Trainer(toy_config(format_model_dir, predict_output=0.1), tmp_path / "t", progress=False)
    b = batch_tensors(probe, t.pad_id)
    b["output_mask"] = torch.zeros_like(b["loss_mask"])
    b["output_mask"][0, 3:5] = 1.0                                                    # micro-batch 0 only
    stats = t.update(b, torch.zeros_like(b["loss_mask"]))
    assert stats["backward_skipped_frac"] == 0.75 and stats["grad_norm"] > 0


def assert_figures_by_hand(row: dict, trajs: list, pad_id: int, initial: torch.nn.Module) -> None:
    """A step's logged term, accuracy and token count are ``initial``'s (the policy before the step) over the
    step's output mask, computed by hand from the full logits; the mask covers output tokens and never a sampled one
    (also used by tests/test_backend_vllm.py)."""
    b = batch_tensors(trajs, pad_id)
    out = output_mask(trajs, b["input_ids"].shape[1])                                              # [B, T]
    on = out[:, 1:] > 0
    assert on.sum() > 0 and not (out * b["loss_mask"]).any()
    with torch.no_grad():
        logits = initial(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float()  # [B, T, V]
    nll = -logits.log_softmax(-1)[:, :-1].gather(-1, b["input_ids"][:, 1:, None])[..., 0]         # [B, T-1]
    assert row["predict_output/tokens"] == float(on.sum())
    assert row["loss/predict_output"] == pytest.approx(float(nll[on].mean()), rel=1e-5)
    hits = (logits[:, :-1].argmax(-1) == b["input_ids"][:, 1:])[on].float().mean()
    assert row["predict_output/accuracy"] == pytest.approx(float(hits), abs=1e-6)


class PrintingEchoTask(EchoTask):
    """EchoTask whose setup shadows the submit tool with a function that prints: the format model's ``submit(k)``
    prints ``k * 111`` and the next prompt follows (output tokens on every line), until rollout.max_lines."""

    def setup(self, row: dict) -> str:
        return "def submit(k):\n    print(k * 111)\n"


@pytest.mark.parametrize("estimator", ["tree", "state"])
def test_a_step_with_the_tree_or_state_estimator_learns_the_output_by_hand(format_model_dir, tmp_path, estimator):
    """A real training step (real kernels; the format model's lines print a number each: PrintingEchoTask) with
    advantages.estimator = tree (2 roots, branching after line 1) or state, and loss.predict_output 0.5: the logged
    term and accuracy are the mean cross-entropy and greedy hits of the initial model over the step's output mask
    (``output_mask`` of its episodes, by hand from the full logits), the mask never touches a sampled token, and the
    term moves the weights."""
    from transformers import AutoModelForCausalLM

    from replrl.config import Config
    from replrl.configlib import resolve
    from replrl.metrics import read_metrics
    from replrl.trainer import Trainer

    extra = {"tree": {"roots": 2, "branch_at": [1], "width": 2}} if estimator == "tree" else {}
    cfg = resolve(Config, None, {
        "model": {"name": str(format_model_dir), "chat_template": False},
        "task": {"name": "tests.test_predict_output:PrintingEchoTask"},
        "rollout": {"group_size": 4, "problems_per_step": 2, "max_lines": 3, "max_line_tokens": 12,
                    "max_total_tokens": 256, "wall_s": 2.0, "temperature": 1.0},
        "advantages": {"estimator": estimator}, **extra,
        "optim": {"lr": 1e-3, "warmup_steps": 0, "micro_batch": 4, "grad_clip": 0.0},
        "loss": {"predict_output": 0.5},
        "run": {"max_steps": 1, "save_every": 0, "log_samples_every": 0, "eval_n": 0, "time_budget_min": 0},
    })
    trajs: list = []
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    trainer.train(on_step=lambda r: trajs.extend(r.trajectories))
    (row,) = read_metrics(tmp_path / "run")
    if estimator == "tree":
        assert row["tree/branch_points"] > 0, "the trees branched: leaves share their first line"
    initial = AutoModelForCausalLM.from_pretrained(format_model_dir).float()
    assert_figures_by_hand(row, trajs, trainer.pad_id, initial)
    assert row["grad_norm"] > 0
    moved = any(not torch.equal(a, c) for a, c in zip(initial.parameters(), trainer.model.parameters()))
    assert moved


# ---------------------------------------------------------------------------------------------------------------
# the mask on a real episode from a real kernel


SCRIPT = ["x = 6 * 7", "x", "print('hi'); print(x + 1)", "for i in range(2):", "    i", "", "1/0",
          "print('ab' * 300)", "y = x", "submit(x)"]
"""Values, print output, a block (its `...` prompts and the values it prints), a traceback, output long enough to
be cut (the truncation marker), a silent line, the answer."""


class ScriptedSession:
    """A GenSession that 'samples' the script's lines as the tokenizer encodes them (the splice, the kernel and the
    REPL are the real ones; no model is needed to know which tokens the interpreter wrote)."""

    stats: dict[str, float] = {}
    timing: dict[str, float] = {}

    def __init__(self, tokenizer, lines):
        from replrl.rollout import encode, line_text

        self.lines = [encode(tokenizer, line_text(code)) for code in lines]

    async def next_line(self, i, env_ids):
        ids = self.lines.pop(0)
        return LineSample(token_ids=ids, logprobs=[0.0] * len(ids), finish="newline")

    async def rollback(self, i, length):
        raise AssertionError("no speculation here")

    def finish(self, i):
        pass

    async def aclose(self):
        pass


def test_episodes_that_printed_nothing_log_no_output_prediction_figure_only_the_count(format_model_dir, probe,
                                                                                     tmp_path):
    """The toy model submits at its first line: no output tokens. The update and the held-out scoring log
    ``predict_output/tokens`` 0 and no cross-entropy or accuracy (a 0 there would read as "predicts nothing")."""
    from replrl.predict_output import output_mask, score_episodes
    from replrl.trainer import Trainer

    trainer = Trainer(toy_config(format_model_dir, predict_output_metrics=True), tmp_path, progress=False)
    b = batch_tensors(probe, trainer.pad_id)
    b["output_mask"] = output_mask(probe, b["input_ids"].shape[1])
    assert not b["output_mask"].any()
    stats = trainer.update(b, b["loss_mask"] * 0.5)
    assert stats["predict_output/tokens"] == 0 and math.isfinite(stats["loss"])
    assert "loss/predict_output" not in stats and "predict_output/accuracy" not in stats
    scored = score_episodes(TokenScorer(trainer.model), probe, trainer.pad_id, 4, "cpu")
    assert scored == {"predict_output/tokens": 0.0}


@pytest.fixture(scope="module")
def episode():
    from replrl.config import RewardConfig
    from replrl.models import load_tokenizer
    from replrl.rewards import RewardModel
    from replrl.rollout import Env, EpisodeRules, build_prompt, encode, run_episode
    from sandbox import KernelPool, Limits, run_sync
    from tests.scripted import ScriptTask

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    class DemoTask(ScriptTask):
        def check(self, row, submitted):
            return submitted == 42

    task = DemoTask({"demo": SCRIPT})
    row = task.rows("train")[0]
    prompt = encode(tokenizer, build_prompt(tokenizer, task.header(row), chat_template=False))
    pool = run_sync(KernelPool(size=1, limits=Limits(wall_s=5.0), tools=["submit"]).start())
    try:
        env = Env(SimpleNamespace(tokenizer=tokenizer, version=0), pool, task,  # the session is the scripted one
                  EpisodeRules(max_output_tokens=40, max_repeats=3, state_digest=False, max_lines=20),
                  RewardModel(RewardConfig().weights), chat_template=False)
        traj = run_sync(run_episode(ScriptedSession(tokenizer, SCRIPT), 0, env, row, prompt,
                                    SamplingParams()))
    finally:
        run_sync(pool.close())
    return traj, tokenizer


def spans_by_decoding(traj, tokenizer) -> list[tuple[int, int]]:
    """The printed tokens found after the fact by decoding token prefixes (how they were found before the splice
    recorded them): the environment's tokens after line k are those up to line k + 1's first token, the printed text
    then the next prompt (with the truncation marker before it when the output was cut, after a newline of the
    environment's if the cut fell mid-line); the printed part is the tokens that start before the prompt."""
    from replrl.repl import TRUNCATED_MARKER
    from replrl.rollout import decode, heal

    spans = []
    for line, nxt in zip(traj.lines, traj.lines[1:]):
        start, end = line.token_span[1], nxt.token_span[0]
        if not line.output or end <= start:
            continue
        env = traj.token_ids[start:end]
        text, tail = decode(tokenizer, env), heal(nxt.prompt)
        if text != line.output + tail and text.endswith(TRUNCATED_MARKER + tail):
            tail = TRUNCATED_MARKER + tail
        printed = len(text) - len(tail) if text.endswith(tail) else len(text)
        if tail.startswith(TRUNCATED_MARKER) and not line.output.startswith(text[:printed]):
            printed -= 1
        n = next((k + 1 for k in range(len(env) - 1, -1, -1) if len(decode(tokenizer, env[:k])) < printed), 0)
        if n:
            spans.append((start, start + n))
    return spans


def test_the_mask_covers_exactly_what_the_repl_printed(episode):
    from replrl.repl import TRUNCATED_MARKER
    from replrl.rollout import decode

    traj, tokenizer = episode
    assert traj.end_reason == "submit" and [ln.code for ln in traj.lines] == SCRIPT
    printed = [ln.output for ln in traj.lines]
    assert printed[1] == "42\n" and printed[2] == "hi\n43\n" and printed[5] == "0\n1\n"
    assert printed[6].startswith("Traceback") and "ZeroDivisionError" in printed[6]
    mask = output_mask([traj])[0]                                                     # [T]
    assert not (mask * torch.tensor(traj.loss_mask, dtype=torch.float)).any()
    assert not mask[:traj.prompt_len].any()
    spans = output_spans(traj)
    assert [int(i) for i in mask.nonzero()[:, 0]] == [t for s, e in spans for t in range(s, e)]
    assert spans == spans_by_decoding(traj, tokenizer)  # recorded at the splice: what decoding would find
    for k, line in enumerate(traj.lines):  # and their characters in the transcript's text
        (a, b), (c, d), b_tok = line.text_span, line.output_text_span, line.token_span[1]
        assert traj.text[a:b] == decode(tokenizer, traj.token_ids[slice(*line.token_span)]) == " " + line.code + "\n"
        assert b == c and traj.text[c:d] == (line.output if k != 7 else line.output[:d - c]), k
        assert traj.text[c:d] == decode(tokenizer, traj.token_ids[b_tok:line.output_span[1]])[:d - c], k
    assert traj.lines[7].output_text_span[1] - traj.lines[7].output_text_span[0] < len(traj.lines[7].output)
    ids = traj.token_ids
    span_of = {next(k for k, ln in enumerate(traj.lines) if ln.token_span[1] == s): (s, e) for s, e in spans}
    # every line that printed has a span, the others none; its tokens are its output, the rest the next prompt
    assert sorted(span_of) == [k for k, text in enumerate(printed) if text]
    for k, (s, e) in span_of.items():
        text, rest = decode(tokenizer, ids[s:e]), decode(tokenizer, ids[e:traj.lines[k + 1].token_span[0]])
        if k == 7:  # 600 characters cut at 40 tokens: a prefix of the output, then the marker and the prompt
            assert printed[k].startswith(text) and len(text) < len(printed[k])
            assert rest.strip("\n") == TRUNCATED_MARKER + ">>>"
        else:
            assert text == printed[k], k
            assert rest == traj.lines[k + 1].prompt.rstrip(" "), k             # ">>>" or "..."
    # tokens between lines that are not printed text: prompts (and the marker), nothing else
    unmasked_env = [t for t in range(traj.prompt_len, len(ids)) if not traj.loss_mask[t] and not mask[t]]
    assert decode(tokenizer, [ids[t] for t in unmasked_env]).replace(TRUNCATED_MARKER, "").replace(
        ">>>", "").replace("...", "").strip("\n") == ""


def test_replrl_plot_draws_the_output_prediction_panel_only_for_runs_that_logged_it():
    from replrl.plot import run_figure

    rows = [{"step": 1, "reward_mean": 0.1, "accuracy": 0.2, "loss/predict_output": 1.5,
             "predict_output/accuracy": 0.4},
            {"step": 1, "eval/accuracy": 0.3, "eval/predict_output/accuracy": 0.5, "eval/loss/predict_output": 1.2}]
    panels = {ax.get_title(): ax for ax in run_figure(rows).axes if ax.get_visible()}
    labels = {line.get_label() for line in panels["output prediction"].lines}
    assert labels == {"predict_output/accuracy", "eval/predict_output/accuracy", "loss/predict_output",
                      "eval/loss/predict_output"}
    plain = [{"step": 1, "accuracy": 0.2}]
    assert "output prediction" not in {ax.get_title() for ax in run_figure(plain).axes}


def test_a_negative_weight_is_a_config_error():
    from replrl.config import LossConfig
    from replrl.configlib import ConfigError

    with pytest.raises(ConfigError, match="predict_output"):
        LossConfig(predict_output=-0.1)
