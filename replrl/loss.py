"""The GRPO objective, and the per-token log-probabilities and entropies it is computed from.

Every tensor is [B, T] and aligned with ``input_ids``: position t holds the quantity for token t given tokens < t
(position 0 has no predecessor and gets 0). ``loss_mask`` is 1 exactly on policy-sampled tokens; nothing outside it
reaches the loss or its gradient, whatever values (nan, -inf) the other tensors hold there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from replrl.contract import TokenMasks, line_starts, sampling_logprobs
from replrl.predict_output import output_nll
from replrl.types import SamplingParams

Aggregation = Literal["token_mean", "seq_mean", "constant"]


def masked_mean(x: Tensor, loss_mask: Tensor) -> Tensor:
    """Mean of x [B, T] over the positions where loss_mask is 1 (0 when there are none); values elsewhere ignored."""
    on = loss_mask > 0                                                     # [B, T]
    return x.where(on, 0.0).sum() / on.sum().clamp(min=1)                  # []


def rows_by_length(attention_mask: Tensor, first_last: Tensor | None = None) -> Callable[[Tensor], Tensor]:
    """A function that orders row indices [n] by their length in attention_mask [B, T] (right-padded), shortest
    first, ties in the given order; with ``first_last`` [B] (bool), its False rows before its True rows. Cut into
    micro-batches, the order keeps like lengths together, and a micro-batch is scored as long as its longest row."""
    key = attention_mask.sum(1)                                            # [B]
    if first_last is not None:
        key = key + first_last.long() * (attention_mask.shape[1] + 1)      # [B]
    return lambda rows: rows[key[rows].argsort(stable=True)]


def agg_units(loss_mask: Tensor, agg: Aggregation) -> Tensor:
    """How many units ``aggregate`` averages over in loss_mask [B, T] (a [] tensor): masked tokens ("token_mean"),
    sequences with a masked token ("seq_mean"), sequences ("constant", whose loss divides by them times max_len).

    The one statement of the GRPO aggregation rule: ``aggregate`` divides by it, and the trainer weighs each
    micro-batch's and each rank's loss by it, so their weighted sum is the loss of the whole minibatch.
    """
    on = loss_mask > 0                                                     # [B, T]
    if agg == "token_mean":
        return on.sum()                                                    # []
    if agg == "seq_mean":
        return (on.sum(-1) > 0).sum()                                      # []
    if agg == "constant":
        return torch.tensor(on.shape[0])                                   # []
    raise ValueError(f"agg must be 'token_mean', 'seq_mean' or 'constant', got {agg!r}")


def aggregate(x: Tensor, loss_mask: Tensor, agg: Aggregation = "token_mean", max_len: int | None = None) -> Tensor:
    """Reduce per-token values x [B, T] over loss_mask to a scalar: the masked values' sum over ``agg_units``.

    "token_mean": sum / number of masked tokens in the batch (DAPO). "seq_mean": mean over each sequence's masked
    tokens, then over the sequences that have any (original GRPO). "constant": sum / (B * max_len), max_len
    defaulting to T (Dr. GRPO: no length normalisation, so long and short answers weigh the same per token).
    """
    units = agg_units(loss_mask, agg)                                      # []
    x = x.where(loss_mask > 0, 0.0)                                        # [B, T]
    if agg == "token_mean":
        return x.sum() / units.clamp(min=1)                                # []
    if agg == "seq_mean":
        per_seq = x.sum(-1) / (loss_mask > 0).sum(-1).clamp(min=1)         # [B]
        return per_seq.sum() / units.clamp(min=1)                          # []
    return x.sum() / (units * (max_len or x.shape[1]))                     # []  (constant)


def k3(log_ratio: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || q) from d = log q(x) - log pi(x), x ~ pi: exp(d) - d - 1 (>= 0)."""
    return log_ratio.exp() - log_ratio - 1


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    loss_mask: Tensor,
    clip: tuple[float, float] = (0.2, 0.28),
    agg: Aggregation = "token_mean",
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    max_len: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate with separate low/high clip (DAPO), optional k3 KL to a reference; all [B, T] -> scalar.

    Returns (loss, stats); stats (floats, masked tokens only): clip_frac (the clipped branch was the minimum),
    ratio_mean, approx_kl (k3 from the sampler's policy to the current one: off-policy drift), kl (k3 to the
    reference, when ref_logp is given).
    """
    on = loss_mask > 0                                                     # [B, T]
    logp, old_logp, adv = (x.where(on, 0.0) for x in (logp, old_logp, adv))  # [B, T]  off-mask: ratio 1, adv 0
    ratio = (logp - old_logp).exp()                                        # [B, T]
    unclipped = ratio * adv                                                # [B, T]
    clipped = ratio.clamp(1 - clip[0], 1 + clip[1]) * adv                  # [B, T]
    per_tok = -torch.min(unclipped, clipped)                               # [B, T]
    kl = None
    if ref_logp is not None:
        kl = k3(ref_logp.where(on, 0.0) - logp)                            # [B, T]
        if kl_coef:
            per_tok = per_tok + kl_coef * kl                               # [B, T]
    loss = aggregate(per_tok, loss_mask, agg, max_len)                     # []
    with torch.no_grad():
        names = ["clip_frac", "ratio_mean", "approx_kl"] + (["kl"] if kl is not None else [])
        values = [(clipped < unclipped).float(), ratio, k3(old_logp - logp)] + ([kl] if kl is not None else [])
        stats = dict(zip(names, torch.stack([masked_mean(v, loss_mask) for v in values]).tolist(), strict=True))
    return loss, stats


def token_logprobs_and_entropy(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    params: SamplingParams,
    banned: Tensor | TokenMasks | None = None,
    loss_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Log-prob of each token given the previous ones, and the entropy of that distribution: ([B, T], [B, T]).

    The distribution is the sampler's (``sampling_logprobs``: temperature, banned tokens, top-k/top-p), so these
    match the log-probs recorded at rollout (``banned``: one mask [V] for all positions, or the sampler's
    ``TokenMasks``, whose line-start mask applies where ``loss_mask`` goes from 0 to 1). Position 0 and padding
    (attention_mask 0) get 0. With ``loss_mask``, only tokens where it is 1 are scored (0 elsewhere): the LM head
    and the softmax then run on those positions only, which is most of the saving of a GRPO update over
    interpreter-heavy transcripts. Entropy is computed without gradient (it is logged, not optimised).
    """
    logp, entropy = _token_logprobs(model, input_ids, attention_mask, params, banned, True, loss_mask)
    assert entropy is not None
    return logp, entropy


def token_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    params: SamplingParams,
    banned: Tensor | TokenMasks | None = None,
    loss_mask: Tensor | None = None,
) -> Tensor:
    """Log-prob [B, T] of each token given the previous ones (see ``token_logprobs_and_entropy``)."""
    return _token_logprobs(model, input_ids, attention_mask, params, banned, False, loss_mask)[0]


class TokenScorer(torch.nn.Module):
    """A causal LM whose forward is the update's scoring: ``token_logprobs_and_entropy`` of the LM it holds.

    This is the module ``accelerate`` prepares (wraps in DDP, ...): every forward of the update goes through the
    wrapper, so DDP's hooks arm and its bucketed all-reduce overlaps the backward, while the scoring inside stays
    what the unwrapped path does (the decoder once, then the LM head in chunks on the scored tokens only: the
    [tokens, vocabulary] logits are never materialised at once). ``lm`` is the policy itself (its parameters are
    shared, not copied): generation and checkpoints use it directly.
    """

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: Tensor, attention_mask: Tensor, params: SamplingParams,
                banned: Tensor | TokenMasks | None = None, loss_mask: Tensor | None = None,
                with_entropy: bool = True, output_mask: Tensor | None = None,
                output_grad: bool = True) -> tuple[Tensor, ...]:
        """(log-probs [B, T], entropies [B, T] or None): see ``token_logprobs_and_entropy``. With ``output_mask``
        (the interpreter's output tokens: ``replrl.predict_output``), a third item from the same decoder pass: (the
        model's cross-entropy [B, T], greedy hits [B, T]) there, with gradient if ``output_grad``."""
        return _token_logprobs(self.lm, input_ids, attention_mask, params, banned, with_entropy, loss_mask,
                               output_mask=output_mask, output_grad=output_grad)

    def unused_parameters(self) -> list[str]:
        """Names of trainable parameters the scoring does not reach (neither in the decoder nor the LM head): DDP
        must be told to look for them (``find_unused_parameters``), else its reduction waits for them forever."""
        parts = _decoder_and_head(self.lm)
        if parts is None:  # the full forward runs: every parameter is reached
            return []
        used = {id(p) for part in parts for p in part.parameters()}
        return [n for n, p in self.lm.named_parameters() if p.requires_grad and id(p) not in used]


def _decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(decoder, LM head) of a causal LM (also under DDP or peft wrappers), or None if it does not split so."""
    base = getattr(model, "module", model)
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    if getattr(getattr(base, "config", None), "final_logit_softcapping", None):
        return None
    try:
        decoder, head = base.get_decoder(), base.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return (decoder, head) if decoder is not None and head is not None else None


def _token_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    params: SamplingParams,
    banned: Tensor | TokenMasks | None,
    with_entropy: bool,
    loss_mask: Tensor | None = None,
    chunk: int = 1024,
    output_mask: Tensor | None = None,
    output_grad: bool = True,
) -> tuple[Tensor, ...]:
    B, T = input_ids.shape
    scored = (attention_mask if loss_mask is None else loss_mask)[:, 1:] > 0    # [B, T-1]  targets to score
    rows, cols = scored.nonzero(as_tuple=True)                              # [N], [N]  target t = cols + 1
    parts = _decoder_and_head(model)
    if parts is not None:
        decoder, head = parts
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        states = hidden[rows, cols]                                         # [N, H]  state before each target
        def logits_of(i: slice) -> Tensor:
            return head(states[i])                                          # [n, V]
        def logits_at(r: Tensor, c: Tensor) -> Tensor:
            return head(hidden[r, c])                                       # [n, V]
    else:
        full = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # [B, T, V]
        def logits_of(i: slice) -> Tensor:
            return full[rows[i], cols[i]]                                   # [n, V]
        def logits_at(r: Tensor, c: Tensor) -> Tensor:
            return full[r, c]                                               # [n, V]
    targets = input_ids[:, 1:][rows, cols]                                  # [N]
    if isinstance(banned, TokenMasks):
        if loss_mask is None:
            raise ValueError("TokenMasks need the loss_mask, which tells where lines start")
        starts = line_starts(loss_mask)[:, 1:][rows, cols]                  # [N] target is a line's first token
    tok_logp, tok_ent = [], []
    for start in range(0, len(rows), chunk):                                # at most [chunk, V] floats at a time
        i = slice(start, start + chunk)
        logits = logits_of(i)
        if banned is None:
            banned = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        mask = banned.at(starts[i]) if isinstance(banned, TokenMasks) else banned  # [n, V] or [V]
        lp = sampling_logprobs(logits, params, mask)                        # [n, V] float
        tok_logp.append(lp.gather(-1, targets[i, None])[:, 0])              # [n]
        if with_entropy:
            with torch.no_grad():
                tok_ent.append(-(lp.exp() * lp.nan_to_num(neginf=0.0)).sum(-1))  # [n]  0 * -inf -> 0
    zeros = torch.zeros(B, T, device=input_ids.device)
    flat = torch.cat(tok_logp) if tok_logp else zeros.new_zeros(0)
    logp = zeros.index_put((rows, cols + 1), flat)                          # [B, T]
    entropy = zeros.index_put((rows, cols + 1), torch.cat(tok_ent)) if with_entropy and tok_ent else (
        zeros if with_entropy else None)                                    # [B, T]
    if output_mask is None:
        return logp, entropy
    return logp, entropy, output_nll(logits_at, input_ids, output_mask, chunk, output_grad)
