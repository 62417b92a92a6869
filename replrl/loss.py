"""The GRPO objective, and the per-token log-probabilities and entropies it is computed from.

Every tensor is [B, T] and aligned with ``input_ids``: position t holds the quantity for token t given tokens < t
(position 0 has no predecessor and gets 0). ``loss_mask`` is 1 exactly on policy-sampled tokens; nothing outside it
reaches the loss or its gradient, whatever values (nan, -inf) the other tensors hold there.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from replrl.backends.sampling import sampling_logprobs
from replrl.types import SamplingParams

Aggregation = Literal["token_mean", "seq_mean", "constant"]


def masked_mean(x: Tensor, loss_mask: Tensor) -> Tensor:
    """Mean of x [B, T] over the positions where loss_mask is 1 (0 when there are none); values elsewhere ignored."""
    on = loss_mask > 0                                                     # [B, T]
    return x.where(on, 0.0).sum() / on.sum().clamp(min=1)                  # []


def aggregate(x: Tensor, loss_mask: Tensor, agg: Aggregation = "token_mean", max_len: int | None = None) -> Tensor:
    """Reduce per-token values x [B, T] over loss_mask to a scalar.

    "token_mean": sum / number of masked tokens in the batch (DAPO). "seq_mean": mean over each sequence's masked
    tokens, then over the sequences that have any (original GRPO). "constant": sum / (B * max_len), max_len
    defaulting to T (Dr. GRPO: no length normalisation, so long and short answers weigh the same per token).
    """
    if agg == "token_mean":
        return masked_mean(x, loss_mask)                                   # []
    x = x.where(loss_mask > 0, 0.0)                                        # [B, T]
    n_tok = (loss_mask > 0).sum(-1)                                        # [B]
    if agg == "seq_mean":
        per_seq = x.sum(-1) / n_tok.clamp(min=1)                           # [B]
        return per_seq.sum() / (n_tok > 0).sum().clamp(min=1)              # []
    if agg == "constant":
        return x.sum() / (x.shape[0] * (max_len or x.shape[1]))            # []
    raise ValueError(f"agg must be 'token_mean', 'seq_mean' or 'constant', got {agg!r}")


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
    banned: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Log-prob of each token given the previous ones, and the entropy of that distribution: ([B, T], [B, T]).

    The distribution is the sampler's (``sampling_logprobs``: temperature, banned tokens, top-k/top-p), so these
    match the log-probs recorded at rollout. Position 0 and padding (attention_mask 0) get 0. Entropy is computed
    without gradient (it is logged, not optimised). Rows are processed one at a time, so at most one [T, V] float
    copy of the logits exists besides what autograd keeps.
    """
    logp, entropy = _token_logprobs(model, input_ids, attention_mask, params, banned, with_entropy=True)
    assert entropy is not None
    return logp, entropy


def token_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    params: SamplingParams,
    banned: Tensor | None = None,
) -> Tensor:
    """Log-prob [B, T] of each token given the previous ones (see ``token_logprobs_and_entropy``)."""
    return _token_logprobs(model, input_ids, attention_mask, params, banned, with_entropy=False)[0]


def _token_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    params: SamplingParams,
    banned: Tensor | None,
    with_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # [B, T, V]
    targets = input_ids[:, 1:]                                             # [B, T-1]
    if banned is None:
        banned = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)  # [V]
    rows_logp, rows_ent = [], []
    for b in range(input_ids.shape[0]):
        lp = sampling_logprobs(logits[b, :-1], params, banned)             # [T-1, V] float
        rows_logp.append(lp.gather(-1, targets[b, :, None])[:, 0])         # [T-1]
        if with_entropy:
            with torch.no_grad():
                rows_ent.append(-(lp.exp() * lp.nan_to_num(neginf=0.0)).sum(-1))  # [T-1]  0 * -inf -> 0
    real = attention_mask > 0                                              # [B, T]
    logp = F.pad(torch.stack(rows_logp), (1, 0)).where(real, 0.0)          # [B, T]
    entropy = F.pad(torch.stack(rows_ent), (1, 0)).where(real, 0.0) if with_entropy else None  # [B, T]
    return logp, entropy
