"""The sampler's log-probs are the trainer's, at the scale of real episodes (issue 11, part 2).

The old log-probs of a step's first optimiser epoch are the sampler's, so any gap between what the HF backend returns
and what ``loss.token_logprobs`` recomputes over the recorded ids goes straight into the importance ratio. These
tests check that gap where the packed sampler is most exposed: 8 concurrent episodes of 500+ tokens, long interpreter
outputs prefilled (whole and in chunks), rows idle for several steps while others generate and rejoining at
different steps, rows finishing at different times, the per-row caches growing past several capacities; and in a
real trainer step, the ratio new/old at the first minibatch.

The model is a tiny Llama made context-sensitive (sharper attention and output than a default random init, whose
predictions hardly depend on the context): dropping one early token from the context or misplacing one position
moves its log-probs by 0.1 to 10 nats, so a cache, position or mask error cannot hide under the 1e-4 tolerance.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import replrl.trainer as trainer_module
from replrl.backends.hf import HFGenerator
from replrl.config import Config
from replrl.configlib import resolve
from replrl.contract import TokenMasks, eos_ids, token_masks
from replrl.loss import grpo_loss, token_logprobs
from replrl.models import tiny_model
from replrl.trainer import Trainer
from replrl.types import SamplingParams
from tests import test_backend_hf
from tests.helpers_models import smollm2_tokenizer, with_logit_bias
from tests.test_backend_hf import ids_of

TOL = 1e-4
"""fp32: the sampler's log-prob of every sampled token vs the trainer's recomputation."""


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def sensitive_tiny(tok, seed: int = 0):
    """A tiny Llama (6 query heads sharing 2 KV heads, 3 layers) whose next-token distribution depends on its
    context: weights drawn 2.5x wider than the default init, queries and keys x2 (sharper attention), the LM head x2.
    Measured over 600 tokens: one position off by one moves its top tokens' log-probs by 0.26 nats, one early token
    missing from the context by 0.08, while fp32 rounding (vs fp64) stays under 2e-6."""
    model = tiny_model(tok, seed=seed, hidden_size=96, intermediate_size=192, num_attention_heads=6,
                       num_key_value_heads=2, num_hidden_layers=3, initializer_range=0.05)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(2.0)
            layer.self_attn.k_proj.weight.mul_(2.0)
        model.lm_head.weight.mul_(2.0)
    return model.eval()


def line_bias(tok, newline: float = 6.0) -> dict[int, float]:
    """Output biases for ``sensitive_tiny``: newlines favoured so lines end (at 6, about 10 tokens a line), EOS
    ruled out so every episode runs its full length."""
    return {**{i: -100.0 for i in eos_ids(tok) if i < len(tok)}, ids_of(tok, "\n")[0]: newline}


TRACEBACK = ('Traceback (most recent call last):\n  File "<stdin>", line 1, in <module>\n  File "<stdin>", line 4, in '
             "total\nZeroDivisionError: division by zero\n>>>")
OUTPUTS = [
    TRACEBACK,
    "[" + ", ".join(str(i * i) for i in range(40)) + "]\n>>>",                      # ~120 tokens
    "42\n>>>",
    "...",
    "{'eggs': 16, 'eaten': 3, 'baked': 4, 'sold': 9, 'price': 2, 'total': 18}\n>>>",
    "NameError: name 'clips' is not defined\n>>>",
]


@dataclass
class Episode(test_backend_hf.Episode):
    idle_steps: list[int] = field(default_factory=list)
    """Per executed line: the session steps that ran while this row was away."""


async def run_rows(session, prompts: list[list[int]], n_lines: list[int], env_of, idle_of) -> list[Episode]:
    """Each row asks for a line, splices it, then 'executes' it: stays away for ``idle_of(i, k)`` of the session's
    steps (or until no row is left generating), and comes back with the interpreter's tokens ``env_of(i, k)``."""
    away: set[int] = set()
    active = set(range(len(prompts)))

    async def one(i: int) -> Episode:
        ep, env = Episode(list(prompts[i])), []
        try:
            for k in range(n_lines[i]):
                line = await session.next_line(i, env)
                ep.ids += env
                ep.sampled_at += range(len(ep.ids), len(ep.ids) + len(line.token_ids))
                ep.ids += line.token_ids
                ep.logprobs += line.logprobs
                ep.lines.append(line)
                if k == n_lines[i] - 1:
                    break
                away.add(i)
                start = session.stats["steps"]
                while session.stats["steps"] < start + idle_of(i, k) and active - away:
                    await asyncio.sleep(0.0005)
                away.discard(i)
                ep.idle_steps.append(session.stats["steps"] - start)
                env = env_of(i, k)
        finally:
            session.finish(i)
            active.discard(i)
            away.discard(i)
        return ep

    try:
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))
    finally:
        await session.aclose()


def trainer_logprobs(model, episodes: list[Episode], params: SamplingParams, masks: TokenMasks) -> list[list[float]]:
    """``loss.token_logprobs`` (the trainer's function) over the episodes right-padded into one batch, as
    ``batch_tensors`` lays them out: the log-prob of each sampled token, per episode."""
    B, T = len(episodes), max(len(ep.ids) for ep in episodes)
    input_ids = torch.zeros(B, T, dtype=torch.long)
    attention_mask = torch.zeros(B, T, dtype=torch.long)
    loss_mask = torch.zeros(B, T)
    for b, ep in enumerate(episodes):
        input_ids[b, : len(ep.ids)] = torch.tensor(ep.ids)
        attention_mask[b, : len(ep.ids)] = 1
        loss_mask[b, ep.sampled_at] = 1.0
    dev = next(model.parameters()).device
    with torch.no_grad():
        logp = token_logprobs(model, input_ids.to(dev), attention_mask.to(dev), params,
                              TokenMasks(*(m.to(dev) for m in masks)), loss_mask.to(dev)).cpu()  # [B, T]
    return [logp[b, ep.sampled_at].tolist() for b, ep in enumerate(episodes)]


LONG_CASES = {
    "default budgets": {},
    "chunked prefill": {"max_step_tokens": 48, "max_prefill_tokens": 96},
}


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("case", list(LONG_CASES))
def test_long_episodes_sampled_logprobs_equal_the_trainers(tok, case, device):
    model = with_logit_bias(sensitive_tiny(tok), line_bias(tok))
    gen = HFGenerator(model, tok, device=device, **LONG_CASES[case])
    params = SamplingParams(temperature=0.7, seed=11, max_line_tokens=14)
    rows = 8
    prompts = [ids_of(tok, f"Problem {i}: Janet's ducks lay {16 + i} eggs per day. She eats {3 + i % 4} for "
                           f"breakfast and bakes muffins with 4. How many are left?\n>>>") for i in range(rows)]
    n_lines = [14, 17, 12, 16, 15, 13, 18, 14]                                   # rows finish at different times
    env_of = lambda i, k: ids_of(tok, OUTPUTS[(3 * i + k) % len(OUTPUTS)])    # noqa: E731
    idle_of = lambda i, k: (0, 1, 3, 6, 10)[(i + 2 * k) % 5]                   # noqa: E731  steps away per line
    session = gen.session(prompts, params)
    episodes = asyncio.run(run_rows(session, prompts, n_lines, env_of, idle_of))

    masks = TokenMasks(*token_masks(tok, model.lm_head.out_features))
    recomputed = trainer_logprobs(model, episodes, params, masks)
    diffs = torch.cat([(torch.tensor(r) - torch.tensor(ep.logprobs)).abs() for r, ep in zip(recomputed, episodes)])
    # the scale this is about: 8 concurrent rows of 500+ tokens each, long outputs, rows away for several steps
    assert min(len(ep.ids) for ep in episodes) >= 500 and len(diffs) >= 1000
    assert sum(s >= 3 for ep in episodes for s in ep.idle_steps) >= 20       # rows idle while others generate...
    assert len({s for ep in episodes for s in ep.idle_steps}) >= 4            # ...for different numbers of steps
    assert session.stats["rows_freed"] >= rows - 1
    assert all(line.finish in ("newline", "length") for ep in episodes for line in ep.lines)
    if "max_step_tokens" in LONG_CASES[case]:
        assert session.stats["max_step_tokens"] <= 96                           # the 120-token output went in chunks
    assert diffs.max().item() <= TOL, f"max |sampled - recomputed| = {diffs.max().item():.2e} ({case})"


@pytest.mark.parametrize("case", list(LONG_CASES))
def test_rolled_back_rows_sample_after_the_true_context_only(tok, case):
    """Speculation's rollback (``HFSession.rollback``): 6 rows whose every line is requested after a guess of the
    environment's answer while it 'executes'; wrong guesses are dropped at once, after the speculative line ended, or
    while it is being sampled, and the line is sampled again after the true answer. The kept tokens' log-probs are
    the trainer's over the true transcript (a cache row not cut back, or cut one token off, moves them by far more
    than the tolerance with this model), and a seeded run is the same run twice (each rollback starts a stream of its
    own, whatever the dropped line consumed)."""
    model = with_logit_bias(sensitive_tiny(tok), line_bias(tok))
    gen = HFGenerator(model, tok, device="cpu", **LONG_CASES[case])
    params = SamplingParams(temperature=0.7, seed=5, max_line_tokens=14)
    prompts = [ids_of(tok, f"Problem {i}: {9 + i} apples, {i} eaten. How many are left?\n>>>") for i in range(6)]
    n_lines = [9, 12, 10, 11, 8, 12]
    env_of = lambda i, k: ids_of(tok, OUTPUTS[(2 * i + k) % len(OUTPUTS)])                # noqa: E731
    wrong_of = lambda i, k: ids_of(tok, OUTPUTS[(2 * i + k + 1) % len(OUTPUTS)])          # noqa: E731

    def run() -> tuple[list[Episode], dict[str, int], dict[str, float]]:
        counts: dict[str, int] = {}
        session = gen.session(prompts, params)
        eps = asyncio.run(test_backend_hf.run_speculating_rows(session, prompts, n_lines, env_of, wrong_of, counts))
        return eps, counts, session.stats

    episodes, counts, stats = run()
    assert set(counts) == set(test_backend_hf.SPECULATION_MODES) and min(counts.values()) >= 5
    assert stats["rollbacks"] == sum(v for k, v in counts.items() if k != "kept")
    assert stats["dropped_tokens"] > 10 * stats["rollbacks"]  # wrong guesses and whole lines, not only the guesses
    masks = TokenMasks(*token_masks(tok, model.lm_head.out_features))
    recomputed = trainer_logprobs(model, episodes, params, masks)
    diffs = torch.cat([(torch.tensor(r) - torch.tensor(ep.logprobs)).abs() for r, ep in zip(recomputed, episodes)])
    assert len(diffs) >= 400 and diffs.max().item() <= TOL, f"max |sampled - recomputed| = {diffs.max().item():.2e}"
    assert [ep.ids for ep in run()[0]] == [ep.ids for ep in episodes]


# ---- the trainer: at the first minibatch of a step, new == old on every model token ----


@pytest.fixture(scope="module")
def sensitive_model_dir(tok, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sensitive-tiny")
    sensitive_tiny(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("reuse", [False, True], ids=["sampler old", "recomputed old"])
def test_first_minibatch_ratio_is_one_on_every_model_token(sensitive_model_dir, tok, tmp_path, monkeypatch, reuse):
    """A real Trainer step (sandboxed kernels, arithmetic problems, 8 episodes of several lines with tracebacks
    spliced in, micro-batches of 3). Before the first optimizer step the policy is the sampler's, so exp(new - old)
    must be 1 on every token with loss_mask 1: old is the sampler's log-probs (one epoch, one minibatch) or the
    trainer's own recomputation (epochs and minibatches > 1)."""
    cfg = resolve(Config, None, {
        "model": {"name": str(sensitive_model_dir), "chat_template": False},
        "task": {"name": "arithmetic", "level": 1},
        "rollout": {"group_size": 4, "problems_per_step": 2, "max_lines": 8, "max_line_tokens": 24,
                    "max_total_tokens": 512, "max_output_tokens": 64, "wall_s": 2.0, "temperature": 0.7},
        "optim": {"lr": 1e-3, "micro_batch": 3, "epochs": 2 if reuse else 1, "minibatches": 2 if reuse else 1},
        "run": {"max_steps": 1, "save_every": 0, "eval_n": 0, "log_samples_every": 0,
                "time_budget_min": 0},
    })
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    bias = torch.zeros(policy.lm_head.out_features)
    for token_id, value in line_bias(tok, newline=8.0).items():
        bias[token_id] = value
    policy.lm_head.register_forward_hook(lambda module, args, out: out + bias)  # lines end; the sampler's too

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []   # per micro-batch of the first minibatch: (new, old) on-mask
    steps = []
    trainer.optimizer.optimizer.register_step_post_hook(lambda *args: steps.append(1))

    def recording_loss(logp, old_logp, adv, loss_mask, **kwargs):
        if not steps:
            on = loss_mask > 0
            seen.append((logp.detach()[on], old_logp[on]))
        return grpo_loss(logp, old_logp, adv, loss_mask, **kwargs)

    monkeypatch.setattr(trainer_module, "grpo_loss", recording_loss)
    result = {}
    trainer.train(on_step=lambda r: result.update(r.metrics, trajs=r.trajectories))

    trajs = result["trajs"]
    assert len(steps) == (4 if reuse else 1)                                   # optimizer steps: epochs x minibatches
    assert len(seen) == (2 if reuse else 3)                      # micro-batches of 3 in 4 episodes (reuse) or in 8
    assert sum(len(t.lines) >= 3 for t in trajs) >= 4                          # several lines, outputs spliced
    assert any(ln.status == "error" for t in trajs for ln in t.lines)
    new, old = torch.cat([n for n, _ in seen]), torch.cat([o for _, o in seen])
    assert len(new) >= 50 and (reuse or len(new) == sum(sum(t.loss_mask) for t in trajs))  # every model token
    ratio = (new - old).exp()
    assert (ratio - 1).abs().max().item() <= TOL, f"max |ratio - 1| = {(ratio - 1).abs().max().item():.2e}"
