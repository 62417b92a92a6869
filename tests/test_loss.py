import math

import pytest
import torch

from replrl.loss import agg_units, aggregate, grpo_loss, k3, masked_mean, token_logprobs, token_logprobs_and_entropy
from replrl.types import SamplingParams


def close(a, b, atol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float), torch.as_tensor(b, dtype=torch.float), atol=atol)


# ---------------------------------------------------------------------------------------------------------------
# grpo_loss: the clipped surrogate, worked token by token


def test_clip_inside_and_outside_range_both_signs():
    # clip = (0.2, 0.28): ratio is clamped to [0.8, 1.28]
    #   token  ratio  adv   ratio*adv  clamped*adv  min     clipped branch active?
    #   0      1.1    +2    2.2        2.2          2.2     no  (inside the range)
    #   1      1.5    +1    1.5        1.28         1.28    yes (too far up, adv > 0)
    #   2      0.5    +1    0.5        0.8          0.5     no  (pessimistic: keeps the unclipped value)
    #   3      0.5    -1    -0.5       -0.8         -0.8    yes (too far down, adv < 0)
    #   4      1.5    -1    -1.5       -1.28        -1.5    no
    #   5      masked (ratio 9, adv 9: ignored)
    # loss = -(2.2 + 1.28 + 0.5 - 0.8 - 1.5) / 5 = -1.68 / 5 = -0.336
    ratio = torch.tensor([[1.1, 1.5, 0.5, 0.5, 1.5, 9.0]])
    logp = ratio.log().requires_grad_()
    adv = torch.tensor([[2.0, 1.0, 1.0, -1.0, -1.0, 9.0]])
    loss_mask = torch.tensor([[1.0, 1, 1, 1, 1, 0]])
    loss, stats = grpo_loss(logp, torch.zeros(1, 6), adv, loss_mask, clip=(0.2, 0.28))
    assert close(loss, -0.336)
    assert close(stats["clip_frac"], 2 / 5)
    assert close(stats["ratio_mean"], (1.1 + 1.5 + 0.5 + 0.5 + 1.5) / 5)
    assert "kl" not in stats
    # d loss / d logp = -ratio * adv / 5 where the unclipped branch is active, 0 where clipped or masked:
    #   [-1.1 * 2, 0, -0.5 * 1, 0, -1.5 * -1, 0] / 5 = [-0.44, 0, -0.1, 0, 0.3, 0]
    loss.backward()
    assert close(logp.grad, [[-0.44, 0.0, -0.1, 0.0, 0.3, 0.0]])


def test_clip_is_asymmetric():
    # ratio 1.25 with adv +1: inside DAPO's (0.2, 0.28) -> 1.25, clipped by symmetric (0.2, 0.2) -> 1.2
    logp, old, adv, loss_mask = torch.tensor([[math.log(1.25)]]), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)
    assert close(grpo_loss(logp, old, adv, loss_mask, clip=(0.2, 0.28))[0], -1.25)
    assert close(grpo_loss(logp, old, adv, loss_mask, clip=(0.2, 0.2))[0], -1.2)


def test_aggregation_modes():
    # ratio 1 everywhere (logp == old_logp), so each token's loss is -adv
    #   masked tokens: row 0 {1, 2}, row 1 {4}; the 99s are masked out
    adv = torch.tensor([[1.0, 2.0, 99.0], [4.0, 99.0, 99.0]])
    loss_mask = torch.tensor([[1.0, 1, 0], [1, 0, 0]])
    logp = torch.zeros(2, 3)

    def run(agg, max_len=None):
        return grpo_loss(logp, logp, adv, loss_mask, agg=agg, max_len=max_len)[0]

    assert close(run("token_mean"), -(1 + 2 + 4) / 3)  # -7/3
    assert close(run("seq_mean"), -((1 + 2) / 2 + 4) / 2)  # -2.75
    assert close(run("constant"), -7 / (2 * 3))  # B * T = 6
    assert close(run("constant", max_len=7), -7 / (2 * 7))  # -0.5
    with pytest.raises(ValueError):
        run("sum")
    # seq_mean skips sequences with no sampled token: a third, empty row changes nothing
    x = torch.tensor([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
    assert close(aggregate(x, torch.cat([loss_mask, torch.zeros(1, 3)]), "seq_mean"), 2.75)


def test_agg_units_split_a_loss_into_parts_whose_weighted_sum_is_the_whole():
    # the trainer weighs micro-batches (and ranks) by agg_units: sum_k units_k / units * aggregate_k == aggregate
    #   rows: {1, 2} masked, {4} masked, none masked, {5} masked -> 4 tokens, 3 sequences with any, 4 sequences
    x = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0], [9.0, 9.0, 9.0], [5.0, 9.0, 9.0]])
    loss_mask = torch.tensor([[1.0, 1, 0], [1, 0, 0], [0, 0, 0], [1, 0, 0]])
    expected = {"token_mean": 4, "seq_mean": 3, "constant": 4}
    for agg, units in expected.items():
        assert int(agg_units(loss_mask, agg)) == units
        whole = aggregate(x, loss_mask, agg, max_len=5)
        parts = [slice(0, 1), slice(1, 3), slice(3, 4)]
        summed = sum(float(agg_units(loss_mask[p], agg)) / units * aggregate(x[p], loss_mask[p], agg, max_len=5)
                     for p in parts)
        assert close(summed, whole), agg
    with pytest.raises(ValueError):
        agg_units(loss_mask, "sum")


def test_kl_k3():
    # ref - logp = +ln 2: k3 = 2 - ln 2 - 1 = 0.306853;  ref - logp = -ln 2: k3 = 0.5 + ln 2 - 1 = 0.193147
    # mean over the two masked tokens = 0.25; kl_coef 0.1 -> loss 0.025 (adv 0, ratio 1: no policy term)
    assert close(k3(torch.tensor(math.log(2))), 1 - math.log(2))
    logp = torch.tensor([[math.log(0.25), math.log(0.5), -5.0]], requires_grad=True)
    ref = logp.detach() + torch.tensor([[math.log(2), -math.log(2), 3.0]])
    loss_mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = grpo_loss(logp, logp.detach(), torch.zeros(1, 3), loss_mask, ref_logp=ref, kl_coef=0.1)
    assert close(loss, 0.025)
    assert close(stats["kl"], 0.25)
    # d k3 / d logp = 1 - exp(ref - logp): 1 - 2 = -1 and 1 - 0.5 = 0.5; times kl_coef / 2 tokens
    loss.backward()
    assert close(logp.grad, [[-0.05, 0.025, 0.0]])
    # kl_coef 0: KL is reported but not in the loss
    loss0, stats0 = grpo_loss(logp, logp.detach(), torch.zeros(1, 3), loss_mask, ref_logp=ref)
    assert close(loss0, 0.0) and close(stats0["kl"], 0.25)


def test_masked_mean():
    x = torch.tensor([[1.0, float("nan"), 3.0], [float("-inf"), 5.0, 0.0]])
    loss_mask = torch.tensor([[1, 0, 1], [0, 1, 0]])
    assert close(masked_mean(x, loss_mask), 3.0)  # (1 + 3 + 5) / 3
    assert close(masked_mean(x, torch.zeros(2, 3)), 0.0)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "constant"])
def test_gradient_is_exactly_zero_off_the_loss_mask(agg):
    # Off-mask positions hold garbage the trainer can really see there (-inf: a banned token in interpreter
    # output; nan: uninitialised buffers). Neither the loss nor the gradient may notice.
    g = torch.Generator().manual_seed(0)
    loss_mask = (torch.rand(3, 7, generator=g) > 0.4).float()
    loss_mask[2] = 0  # an episode with no sampled token at all
    off = loss_mask == 0
    logp0 = -torch.rand(3, 7, generator=g) * 3
    old = logp0 + 0.3 * torch.randn(3, 7, generator=g)
    adv = torch.randn(3, 7, generator=g)
    ref = logp0 + 0.3 * torch.randn(3, 7, generator=g)

    def run(logp_values, old, adv, ref):
        logp = logp_values.clone().requires_grad_()
        loss, stats = grpo_loss(logp, old, adv, loss_mask, agg=agg, ref_logp=ref, kl_coef=0.05)
        loss.backward()
        return loss, stats, logp.grad

    loss, stats, grad = run(logp0, old, adv, ref)
    garbage = (
        logp0.masked_fill(off, float("-inf")),
        old.masked_fill(off, float("nan")),
        adv.masked_fill(off, float("nan")),
        ref.masked_fill(off, float("inf")),
    )
    loss_g, stats_g, grad_g = run(*garbage)
    assert torch.isfinite(loss_g) and torch.isfinite(grad_g).all()
    assert torch.equal(grad[off], torch.zeros(int(off.sum())))
    assert torch.equal(grad_g[off], torch.zeros(int(off.sum())))
    assert torch.equal(loss, loss_g) and torch.equal(grad, grad_g)
    assert stats == stats_g
    assert (grad[~off] != 0).any()


# ---------------------------------------------------------------------------------------------------------------
# token_logprobs on a tiny real model


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).eval()


def tiny_batch():
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, 100, (2, 9), generator=g)
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, 6:] = 0  # right padding
    input_ids[1, 6:] = 0
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 1, 0], [0, 1, 1, 0, 1, 1, 0, 0, 0]], dtype=torch.float)
    return input_ids, attention_mask, loss_mask


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_token_logprobs_match_manual_log_softmax(tiny_llama, temperature):
    input_ids, attention_mask, _ = tiny_batch()
    params = SamplingParams(temperature=temperature)
    with torch.no_grad():
        logp, entropy = token_logprobs_and_entropy(tiny_llama, input_ids, attention_mask, params, None)
        logits = tiny_llama(input_ids=input_ids, attention_mask=attention_mask).logits.float() / temperature
        lp = logits.log_softmax(-1)  # [B, T, V]
    # token t is predicted from position t - 1; position 0 and padding get 0
    manual = torch.zeros(2, 9)
    manual[:, 1:] = lp[:, :-1].gather(-1, input_ids[:, 1:, None])[..., 0]
    manual_ent = torch.zeros(2, 9)
    manual_ent[:, 1:] = -(lp.exp() * lp).sum(-1)[:, :-1]
    manual = manual * attention_mask
    manual_ent = manual_ent * attention_mask
    assert logp.shape == entropy.shape == (2, 9)
    assert close(logp, manual, atol=1e-5)
    assert close(entropy, manual_ent, atol=1e-5)
    with torch.no_grad():
        assert close(token_logprobs(tiny_llama, input_ids, attention_mask, params), logp, atol=0)


def test_loss_gradient_through_real_model_is_zero_off_mask(tiny_llama):
    input_ids, attention_mask, loss_mask = tiny_batch()
    tiny_llama.zero_grad()
    logp = token_logprobs(tiny_llama, input_ids, attention_mask, SamplingParams())
    logp.retain_grad()
    old = logp.detach() + 0.1 * torch.randn(2, 9, generator=torch.Generator().manual_seed(2))
    adv = torch.tensor([[1.0] * 9, [-0.5] * 9])
    loss, _ = grpo_loss(logp, old, adv, loss_mask, ref_logp=logp.detach() - 0.2, kl_coef=0.1)
    loss.backward()
    off = loss_mask == 0
    assert torch.equal(logp.grad[off], torch.zeros(int(off.sum())))
    assert (logp.grad[~off] != 0).all()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tiny_llama.parameters())


def test_banned_tokens_off_the_mask_are_harmless(tiny_llama):
    # Interpreter output contains tokens the sampler bans (a newline mid-token): their log-prob is -inf. They sit
    # where loss_mask is 0, so the loss, its gradient and the entropy must all stay finite.
    input_ids, attention_mask, loss_mask = tiny_batch()
    banned = torch.zeros(100, dtype=torch.bool)
    banned[input_ids[0, 4]] = True  # row 0, position 4: an off-mask token
    assert not banned[input_ids[loss_mask > 0]].any()
    tiny_llama.zero_grad()
    logp, entropy = token_logprobs_and_entropy(tiny_llama, input_ids, attention_mask, SamplingParams(), banned)
    assert logp[0, 4] == float("-inf") and torch.isfinite(entropy).all()
    loss, _ = grpo_loss(logp, logp.detach(), torch.ones(2, 9), loss_mask, ref_logp=logp.detach(), kl_coef=0.1)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in tiny_llama.parameters() if p.grad is not None)


def test_scoring_only_sampled_positions_equals_the_full_computation_there():
    from transformers import LlamaConfig, LlamaForCausalLM

    from replrl.loss import token_logprobs_and_entropy
    from replrl.types import SamplingParams

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    ids = torch.randint(0, 100, (2, 9))
    att = torch.ones_like(ids)
    att[1, 7:] = 0                                                   # row 1 is padded
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 1, 0, 0, 1], [0, 1, 1, 0, 0, 0, 1, 0, 0]], dtype=torch.float)
    params = SamplingParams(temperature=0.7, top_k=20)
    full_lp, full_ent = token_logprobs_and_entropy(model, ids, att, params)
    lp, ent = token_logprobs_and_entropy(model, ids, att, params, loss_mask=loss_mask)
    on = loss_mask.bool()
    torch.testing.assert_close(lp[on], full_lp[on])                 # same values where scored
    torch.testing.assert_close(ent[on], full_ent[on])
    assert (lp[~on] == 0).all() and (ent[~on] == 0).all()          # nothing elsewhere


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_recomputes_layers_and_gives_the_same_gradient(lora):
    """optim.gradient_checkpointing: the update scores tokens through the decoder called directly (not the
    model's forward); each layer must still run twice (forward, then again in backward) and the gradient must be
    the one computed without it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from replrl.config import ModelConfig
    from replrl.policy import _with_lora, enable_gradient_checkpointing

    if lora:
        pytest.importorskip("peft")

    def build():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        return _with_lora(model, ModelConfig(lora_rank=4)) if lora else model

    input_ids, attention_mask, loss_mask = tiny_batch()
    adv = torch.tensor([[1.0] * 9, [-0.5] * 9])
    grads, calls = [], []
    for checkpointed in (False, True):
        model = build()
        if checkpointed:
            enable_gradient_checkpointing(model)
        model.train()
        layer = (model.get_base_model() if lora else model).model.layers[0]
        runs = []                                                         # one entry per run of the layer
        layer.input_layernorm.register_forward_pre_hook(lambda *_, runs=runs: runs.append(1))
        logp = token_logprobs(model, input_ids, attention_mask, SamplingParams(temperature=0.7), loss_mask=loss_mask)
        loss, _ = grpo_loss(logp, logp.detach(), adv, loss_mask)
        loss.backward()
        calls.append(len(runs))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert calls == [1, 2]                                            # recomputed in backward only when enabled
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)
    assert any(g.abs().sum() > 0 for g in grads[1].values())


def test_gradient_checkpointing_on_a_model_without_it_is_a_clear_error():
    from replrl.policy import enable_gradient_checkpointing

    with pytest.raises(ValueError, match="optim.gradient_checkpointing: Linear does not support it"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2))


def test_rows_by_length_orders_a_minibatch_shortest_first_and_the_flagged_rows_last():
    from replrl.loss import rows_by_length

    lengths = [5, 2, 7, 2, 4, 6]
    att = torch.tensor([[1] * n + [0] * (8 - n) for n in lengths])
    assert rows_by_length(att)(torch.arange(6)).tolist() == [1, 3, 4, 0, 5, 2]  # ties keep their order
    assert rows_by_length(att)(torch.tensor([2, 0, 3])).tolist() == [3, 0, 2]  # a minibatch's own rows only
    flagged = torch.tensor([True, False, True, True, False, False])  # e.g. rows with an advantage to learn from
    assert rows_by_length(att, flagged)(torch.arange(6)).tolist() == [1, 4, 5, 3, 0, 2]
    # the tokens micro-batches of 2 score (each as long as its longest row): 28 in this order, 36 in the given one
    padded = lambda order: sum(max(lengths[k] for k in order[i:i + 2]) * 2 for i in range(0, 6, 2))  # noqa: E731
    assert (padded(rows_by_length(att)(torch.arange(6)).tolist()), padded(list(range(6)))) == (28, 36)
