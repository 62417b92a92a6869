"""Group-relative advantages: how line rewards and the final outcome become per-token advantages.

Every estimator is a pure function of a padded batch (see ``batch_tensors``) and returns ``adv [B, T]``, zero
wherever ``loss_mask`` is 0. Built-ins: ``"outcome"`` (GRPO: one number per episode), ``"line"`` (per-line
return-to-go, normalised per line index, mixed with the outcome advantage; biased when episodes differ in length) and
``"line_rtg"`` (per-line return-to-go minus the leave-one-out mean return of the group: unbiased) and ``"state"``
(lines typed in the same interpreter state form step groups: GiGPO's anchor states). Add your own by
name; it receives only the options it declares::

    @advantage_estimator("last_line_only")
    def last_line_only(batch, **opts): ...          # -> [B, T]

    adv = compute_advantages("last_line_only", batch)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor

from replrl.types import Trajectory

Scale = Literal["std", "none"]
Estimator = Callable[..., Tensor]

ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}
"""Advantage estimators by name; ``compute_advantages(kind, ...)`` looks ``kind`` up here."""


def advantage_estimator(name: str) -> Callable[[Estimator], Estimator]:
    """Register ``fn(batch: dict[str, Tensor], **opts) -> adv [B, T]`` under ``name`` (a later one replaces it)."""

    def register(fn: Estimator) -> Estimator:
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return register


def compute_advantages(kind: str, batch: dict[str, Tensor], **opts) -> Tensor:
    """Per-token advantages [B, T] from the estimator registered as ``kind`` ("outcome", "line", "line_rtg", or
    yours). Of ``opts`` the estimator gets the ones it declares (all of them if it takes ``**opts``), so the trainer
    passes every field of ``AdvantageConfig``: ``compute_advantages(cfg.estimator, batch, **vars(cfg))``."""
    if kind not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {kind!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}")
    fn = ADVANTAGE_ESTIMATORS[kind]
    params = inspect.signature(fn).parameters
    if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        opts = {k: v for k, v in opts.items() if k in params}
    return fn(batch, **opts)


def correct_negative(adv: Tensor, loss_mask: Tensor, correct: Tensor) -> tuple[int, int]:
    """(correct episodes with a negative advantage on any sampled token, correct episodes): the trainer logs the
    ratio as ``adv/correct_negative_frac``. Summed line penalties can push a correct episode below zero (AdaTIR)."""
    negative = ((adv < 0) & (loss_mask > 0)).any(-1)                       # [B]
    correct = correct.bool()                                               # [B]
    return int((negative & correct).sum()), int(correct.sum())


# ---------------------------------------------------------------------------------------------------------------
# Building blocks


def _group_norm(x: Tensor, present: Tensor, group: Tensor, scale: Scale, eps: float) -> Tensor:
    """Normalise each column of x [B, L] within groups, over the rows where ``present`` [B, L] is True.

    Deviations are means of pairwise differences, so equal values give exactly 0 (no rounding residue that a
    tiny std would blow up).
    """
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    dev, std = _group_dev_std(x, present, group)                           # [B, L], [B, L]
    if scale == "none":
        return dev                                                         # [B, L]
    return dev / (std + eps) * present.float()                             # [B, L]


def _group_dev_std(x: Tensor, present: Tensor, group: Tensor) -> tuple[Tensor, Tensor]:
    """Each column of x [B, L] minus its group mean over the present rows, and the group's population std -> [B, L]
    twice (``_group_norm`` divides one by the other; the ``tree`` estimator reuses both, bit for bit)."""
    x = x.float()                                                          # [B, L]
    present = present.float()                                              # [B, L]
    same = (group[:, None] == group[None, :]).float()                      # [B, B]
    peers = same[:, :, None] * present[None, :, :]                         # [B, B', L]
    count = peers.sum(1).clamp(min=1)                                      # [B, L]
    diff = x[:, None, :] - x[None, :, :]                                   # [B, B', L]
    dev = (peers * diff).sum(1) / count * present                          # [B, L]  x - group mean
    std = ((peers * dev[None, :, :] ** 2).sum(1) / count).sqrt()           # [B, L]  unbiased=False
    return dev, std


def group_normalize(x: Tensor, group: Tensor, scale: Scale = "std", eps: float = 1e-6) -> Tensor:
    """x [B] minus its group mean, divided by the group std (population) when scale="std" (GRPO); "none" is
    Dr. GRPO (no division). A group whose values are all equal (or a group of one) gives exactly 0."""
    present = torch.ones_like(x, dtype=torch.bool)                         # [B]
    return _group_norm(x[:, None], present[:, None], group, scale, eps)[:, 0]  # [B]


def _floating(x: Tensor) -> Tensor:
    """x as float32, or as itself when it is already float64 (the exact tests run in float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def per_token(adv: Tensor, loss_mask: Tensor) -> Tensor:
    """Broadcast one advantage per episode [B] onto its sampled tokens: [B, T], 0 where loss_mask is 0."""
    return adv[:, None] * loss_mask.float()                                # [B, T]


def outcome_advantages(outcome: Tensor, line_rewards: Tensor, group: Tensor, scale: Scale = "std") -> Tensor:
    """GRPO: the episode's total reward (outcome + every line reward) normalised within its group -> [B].

    ``line_rewards`` [B, L] must be 0-padded beyond each episode's lines (``batch_tensors`` does that).
    """
    total = outcome.float() + line_rewards.float().sum(-1)                 # [B]
    return group_normalize(total, group, scale)                            # [B]


def line_returns(line_rewards: Tensor, n_lines: Tensor, gamma: float = 1.0) -> Tensor:
    """Return-to-go per line: R_l = sum_{l <= k < n_lines} gamma^(k-l) r_k -> [B, L] (0 beyond n_lines)."""
    L = line_rewards.shape[1]
    ar = torch.arange(L, device=line_rewards.device)                       # [L]
    real = ar[None, :] < n_lines[:, None]                                  # [B, L]
    r = _floating(line_rewards) * real                                     # [B, L]
    power = (ar[None, :] - ar[:, None]).clamp(min=0).float()               # [L(l), L(k)]  k - l
    discount = torch.full((L, L), float(gamma), device=r.device, dtype=r.dtype).pow(power).triu()  # [L, L]
    return r @ discount.T                                                  # [B, L]


def line_advantages(
    line_rewards: Tensor,
    n_lines: Tensor,
    outcome: Tensor,
    group: Tensor,
    line_index: Tensor,
    loss_mask: Tensor,
    gamma: float = 1.0,
    line_weight: float = 0.5,
    scale: Scale = "std",
) -> Tensor:
    """Per-line credit: each line's return-to-go, normalised per line index within the group -> adv [B, T].

    Estimator. For episode i with lines 0..n_i-1 and line rewards r_ik, the return-to-go of line l is
    R_il = sum_{l <= k < n_i} gamma^(k-l) r_ik. Within a group, line l of episode i is compared with line l of
    the other episodes that *have* a line l: A_il = (R_il - mean_j R_jl) / (std_j R_jl + eps) (no division when
    scale="none"). That value goes on line l's sampled tokens, and the token's advantage is
    ``line_weight * A_il + (1 - line_weight) * A_i`` where A_i is the outcome (GRPO) advantage of the episode
    (``outcome_advantages``: outcome + all line rewards). The outcome reward is *not* in R_il; it reaches the lines
    only through A_i. Sampled tokens that belong to no line (``line_index == -1``, e.g. a line cut off before it
    ran) get A_i alone.

    Bias, concretely:
    - The baseline for line l is the group's mean at the same *index*, not the value of the state the line was
      written in. Line 2 of one episode may be ``import math`` while line 2 of another is ``submit(x)``; the
      comparison is between positions, not situations, so it is a crude (high-variance) baseline.
    - With different episode lengths it is biased. Episodes that stopped early (submitted, crashed, ran out)
      drop out of the baselines of later lines, so line l is compared with a shrinking, *selected* set: the
      episodes that chose to keep going. An episode's last line is often compared with nobody: a line index that
      only one episode of the group reached gets a line part of exactly 0, whatever it earned (e.g. episodes of
      3 and 2 lines: line 2 of the first gets only (1 - line_weight) * A_i).
    - gamma = 1: R_i0 is the episode's total line reward, so line 0 gets the same signal (minus the outcome) as
      the outcome estimator, while a later line is credited only with rewards from itself onwards. gamma < 1
      makes a line answer mostly for its own reward and its near successors (gamma = 0: its own reward only).
    - Normalising per index with "std" divides by a standard deviation estimated from few episodes (often 2-3
      at late indices), which inflates small differences to +-1; scale="none" avoids that (reward units).
    """
    L = line_rewards.shape[1]
    real = torch.arange(L, device=line_rewards.device)[None, :] < n_lines[:, None]   # [B, L]
    returns = line_returns(line_rewards, n_lines, gamma)                   # [B, L]
    line_adv = _group_norm(returns, real, group, scale, 1e-6)              # [B, L]
    has_line = (line_index >= 0) & (loss_mask > 0)                         # [B, T]
    line_part = line_adv.gather(1, line_index.clamp(min=0))                # [B, T]
    episode_adv = outcome_advantages(outcome, line_rewards, group, scale)  # [B]
    outcome_part = per_token(episode_adv, loss_mask)                       # [B, T]
    mixed = line_weight * line_part + (1 - line_weight) * outcome_part     # [B, T]
    return torch.where(has_line, mixed, outcome_part)                      # [B, T]


def line_rtg_advantages(
    line_rewards: Tensor,
    n_lines: Tensor,
    outcome: Tensor,
    group: Tensor,
    line_index: Tensor,
    loss_mask: Tensor,
    scale: Scale = "none",
    min_std: float = 1e-4,
) -> Tensor:
    """Unbiased per-line credit: each line's return-to-go minus a baseline its own episode does not affect -> [B, T].

    For episode i with line rewards r_ik (k < n_i), outcome reward o_i and return R_i = o_i + sum_k r_ik, line l gets
        A_il = G_il - b_i,   G_il = sum_{l <= k < n_i} r_ik + o_i   (its own and later line rewards, and the outcome)
        b_i  = mean of R_j over the other episodes j of i's group (leave-one-out; 0 in a group of one).
    Every sampled token of line l carries A_il; a sampled token in no line (``line_index == -1``) carries R_i - b_i.

    Why it is unbiased. The tokens of line l are sampled before line l runs, so the rewards of earlier lines are
    already fixed when they are chosen: dropping them from G_il removes only noise (E[grad log pi(a) * r] = 0 for a
    reward decided before a). b_i is computed from the other episodes, which are sampled independently of episode i,
    so E[grad log pi(a) * b_i] = E[b_i] * E[grad log pi(a)] = 0. Hence the expected gradient of
    sum_i sum_t A_it * log pi(a_it) over a group is exactly G times the gradient of the expected return, whatever
    the episodes' lengths (tests/test_shaping.py checks it by enumeration). The ``line`` estimator, which compares
    line l only with the episodes that reached line l, is not.

    scale="none" (the default here) is the exactly unbiased choice. scale="std" divides by the population std of the
    group's returns R (episode i included), GRPO's usual compromise: the advantage's size no longer depends on the
    reward units and no group dominates, but the divisor depends on episode i, so the estimate is biased (slightly, and
    in a way that is not a constant factor: a group whose returns differ little is amplified). A group whose std is
    below ``min_std`` is not divided (equal returns would otherwise blow up lines whose returns-to-go differ).

    Exactly unbiased also means the loss sums advantages over tokens (``loss.agg = "constant"``); ``token_mean``
    divides by the batch's token count, a random quantity, as every GRPO trainer does.
    """
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    L = line_rewards.shape[1]
    real = torch.arange(L, device=line_rewards.device)[None, :] < n_lines[:, None]   # [B, L]
    r = _floating(line_rewards) * real                                     # [B, L]
    o = outcome.to(r.dtype)                                                # [B]
    to_go = line_returns(r, n_lines, 1.0) + o[:, None]                     # [B, L]  G_il
    total = o + r.sum(-1)                                                  # [B]     R_i
    same = group[:, None] == group[None, :]                                # [B, B]
    others = (same & ~torch.eye(len(group), dtype=torch.bool, device=group.device)).to(r.dtype)  # [B, B]
    baseline = (others @ total) / others.sum(1).clamp(min=1)               # [B]     b_i (0 alone)
    line_adv = to_go - baseline[:, None]                                   # [B, L]
    episode_adv = total - baseline                                         # [B]
    if scale == "std":
        peers = same.to(r.dtype)                                           # [B, B]
        diff = total[:, None] - total[None, :]                             # [B, B]  exact 0 for equal returns
        std = ((peers * diff**2).sum(1) / (2 * peers.sum(1))).sqrt()       # [B]     population std of the group
        denom = torch.where(std > min_std, std, torch.ones_like(std))      # [B]
        line_adv, episode_adv = line_adv / denom[:, None], episode_adv / denom
    has_line = (line_index >= 0) & (loss_mask > 0)                         # [B, T]
    line_part = line_adv.gather(1, line_index.clamp(min=0))                # [B, T]
    return torch.where(has_line, line_part, per_token(episode_adv, loss_mask).to(r.dtype))  # [B, T]


def _reached(key: Tensor, known: Tensor, same_group: Tensor) -> Tensor:
    """[B, L, B']: whether episode j (of line (i, l)'s group) has some line with the same ``key`` [B, L]."""
    B, L = key.shape
    _, inverse = torch.unique(key, return_inverse=True)                    # [B, L]  0..S-1
    has = torch.zeros(B, int(inverse.max()) + 1, dtype=torch.bool, device=key.device)  # [B', S]
    has[torch.arange(B, device=key.device)[:, None].expand(B, L)[known], inverse[known]] = True
    return has.T[inverse] & same_group[:, None, :] & known[:, :, None]     # [B, L, B']


def state_advantages(
    line_state: Tensor,
    line_code: Tensor,
    line_rewards: Tensor,
    outcome: Tensor,
    group: Tensor,
    line_index: Tensor,
    loss_mask: Tensor,
    state_weight: float = 0.5,
    scale: Scale = "std",
    eps: float = 1e-6,
) -> Tensor:
    """Credit per line from repeated interpreter states (GiGPO's anchor states, with outcomes as returns) -> [B, T].

    ``line_state`` [B, L] numbers the state each line was typed in (-1: unknown or no line), ``line_code`` [B, L]
    the line's text; equal numbers mean equal states / texts (``batch_tensors`` interns them). Let R_j be episode j's
    return (outcome + line rewards, as in ``outcome_advantages``). For line l of episode i, typed in state s with text
    a, within i's group:
        visited(s) = the episodes with some line typed in s          (each episode counted once)
        took(s, a) = the episodes with some line a typed in s
        A_step     = mean_{j in took} R_j - mean_{k in visited} R_k  (computed as the mean of R_j - R_k: exactly 0
                                                                     when the returns are equal)
    divided by the population std of R over visited(s) when scale="std" (0 stays 0). The line's tokens get
    ``state_weight * A_step + (1 - state_weight) * A_i`` where A_i is the episode's outcome advantage; where only
    episode i reached s (a state visited once) or s is unknown, and on sampled tokens in no line, they get A_i alone.
    So with no state shared between episodes this is ``outcome`` exactly. The first line of every episode starts in
    the fresh kernel's state, shared by the whole group: with distinct first lines and scale="none" its A_step is
    R_i - mean R, the outcome advantage itself.
    """
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    B, L = line_state.shape
    R = outcome.to(torch.promote_types(line_rewards.dtype, torch.float32)) + _floating(line_rewards).sum(-1)  # [B]
    known = line_state >= 0                                                # [B, L]
    same_group = group[:, None] == group[None, :]                          # [B, B']
    pair = line_state * (int(line_code.max().clamp(min=0)) + 1) + line_code.clamp(min=0)  # [B, L]  (state, text)
    v = _reached(line_state, known, same_group).to(R.dtype)                # [B, L, B']  j visited s
    t = _reached(pair, known, same_group).to(R.dtype)                      # [B, L, B']  j took a in s
    diff = R[:, None] - R[None, :]                                         # [B', B'']  R_j - R_k
    n_v, n_t = v.sum(-1), t.sum(-1)                                        # [B, L]
    step = torch.einsum("ilj,jk,ilk->il", t, diff, v) / (n_t * n_v).clamp(min=1)  # [B, L]
    if scale == "std":
        var = torch.einsum("ilj,jk,ilk->il", v, diff**2, v) / (2 * n_v**2).clamp(min=1)  # [B, L]  population
        std = var.sqrt()
        step = torch.where(std > 0, step / (std + eps), torch.zeros_like(step))  # [B, L]
    shared = known & (n_v >= 2)                                            # [B, L]  another episode was there too
    episode_adv = outcome_advantages(outcome, line_rewards, group, scale).to(R.dtype)  # [B]
    mixed = state_weight * step + (1 - state_weight) * episode_adv[:, None]  # [B, L]
    line_adv = torch.where(shared, mixed, episode_adv[:, None].expand(B, L))  # [B, L]
    has_line = (line_index >= 0) & (loss_mask > 0)                         # [B, T]
    line_part = line_adv.gather(1, line_index.clamp(min=0))                # [B, T]
    return torch.where(has_line, line_part, per_token(episode_adv, loss_mask).to(R.dtype))  # [B, T]


def tree_advantages(
    outcome: Tensor,
    line_rewards: Tensor,
    group: Tensor,
    line_index: Tensor,
    loss_mask: Tensor,
    tree_from: Tensor,
    tree_to: Tensor,
    tree_credit: Tensor,
    scale: Scale = "std",
    tree_weight: float = 1.0,
    eps: float = 1e-6,
) -> Tensor:
    """Credit per tree segment: a line's tokens get V(node its segment leads to) - V(node it starts from) -> [B, T].

    A tree group (``replrl.rollout.tree``) has one root (the prompt), branch nodes (an episode's state after k executed
    statements, shared by its children) and leaves (the finished episodes). Line l of leaf i lies on the segment
    from node ``tree_from[i, l]`` to node ``tree_to[i, l]`` (batch-wide ids; -1 is the root). With R_i the leaf's
    total reward (outcome + line rewards, as ``outcome``) and m its group's mean:
        V(root) = m,   V(leaf i) = R_i,   V(branch node) = mean of R over the credited leaves under it,
        A_il = (V(tree_to[i, l]) - V(tree_from[i, l])) / (std of R in the group + eps)   (no division: scale="none")
    So the segments of a leaf sum to its outcome advantage (R_i - m, scaled), split by where the outcome changed:
    a segment that led from a state where most leaves failed to one where they succeed gets the credit.
    A leaf whose path holds a replay that diverged (``tree_credit`` False) counts in no node's value and gets its
    outcome advantage on every line, as in a flat group. The token advantage is ``tree_weight * A_il + (1 -
    tree_weight) * A_i`` (A_i: the outcome advantage); sampled tokens in no line get A_i. Without branch points every
    line leads from the root to its leaf: exactly the ``outcome`` estimator.
    """
    total = outcome.float() + line_rewards.float().sum(-1)                 # [B]  R_i
    ones = torch.ones_like(total, dtype=torch.bool)[:, None]               # [B, 1]
    dev, std = (t[:, 0] for t in _group_dev_std(total[:, None], ones, group))  # [B], [B]  R_i - m, std
    n_nodes = int(tree_to.max()) + 1 if tree_to.numel() else 0
    on_line = tree_to >= 0                                                 # [B, L]
    member = torch.zeros(n_nodes, len(total))                              # [N, B]  leaf i lies under node n
    rows = torch.arange(len(total))[:, None].expand_as(tree_to)            # [B, L]
    member[tree_to[on_line], rows[on_line]] = 1.0
    credited = member * tree_credit.float()[None, :]                       # [N, B]
    value = (credited @ dev) / credited.sum(1).clamp(min=1)                # [N]    V(n) - m
    leaf = tree_to.gather(1, (on_line.long().sum(1, keepdim=True) - 1).clamp(min=0))[:, 0]  # [B] leaf's own id
    has_leaf = on_line.any(1)                                              # [B]
    value[leaf[has_leaf]] = dev[has_leaf]                                  # V(leaf) - m = R_i - m exactly
    to_v = torch.where(on_line, value[tree_to.clamp(min=0)], 0.0)          # [B, L]
    from_v = torch.where(tree_from >= 0, value[tree_from.clamp(min=0)], 0.0)  # [B, L]  root: 0 = m - m
    seg = to_v - from_v                                                    # [B, L]
    seg = torch.where(tree_credit[:, None], seg, dev[:, None])             # [B, L]  diverged: outcome
    if scale == "std":
        seg, dev = seg / (std[:, None] + eps), dev / (std + eps)           # [B, L], [B]
    elif scale != "none":
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    outcome_part = per_token(dev, loss_mask)                               # [B, T]
    line_part = seg.gather(1, line_index.clamp(min=0))                     # [B, T]
    mixed = tree_weight * line_part + (1 - tree_weight) * outcome_part     # [B, T]
    mixed = torch.where(line_part == outcome_part, outcome_part, mixed)    # one segment: exactly outcome
    has_line = (line_index >= 0) & (loss_mask > 0)                         # [B, T]
    return torch.where(has_line, mixed, outcome_part)                      # [B, T]


def line_advantage_stats(adv: Tensor, batch: dict[str, Tensor]) -> dict[str, float]:
    """How much the advantage varies between lines (any estimator): ``adv/line_std``, the std over every line of
    the batch of its tokens' mean advantage, and ``adv/line_spread``, the mean over episodes of (largest - smallest)
    line advantage within the episode (0 for one number per episode, as ``outcome`` gives)."""
    line_index, loss_mask = batch["line_index"], batch["loss_mask"]
    L = batch["line_rewards"].shape[1]
    on = ((line_index >= 0) & (loss_mask > 0)).float()                     # [B, T]
    sums = torch.zeros(len(adv), L).scatter_add_(1, line_index.clamp(min=0), adv.float() * on)  # [B, L]
    counts = torch.zeros(len(adv), L).scatter_add_(1, line_index.clamp(min=0), on)              # [B, L]
    real = counts > 0                                                      # [B, L]
    if not real.any():
        return {}
    mean = sums / counts.clamp(min=1)                                      # [B, L]
    values = mean[real]
    spread = torch.where(real, mean, -torch.inf).amax(1) - torch.where(real, mean, torch.inf).amin(1)  # [B]
    return {"adv/line_std": float(values.std(unbiased=False)),
            "adv/line_spread": float(spread[real.any(1)].mean())}


# ---------------------------------------------------------------------------------------------------------------
# Built-in estimators


@advantage_estimator("outcome")
def _outcome(batch: dict[str, Tensor], scale: Scale = "std") -> Tensor:
    adv = outcome_advantages(batch["outcome"], batch["line_rewards"], batch["group"], scale)  # [B]
    return per_token(adv, batch["loss_mask"])                              # [B, T]


@advantage_estimator("line")
def _line(batch: dict[str, Tensor], gamma: float = 1.0, line_weight: float = 0.5, scale: Scale = "std") -> Tensor:
    keys = ("line_rewards", "n_lines", "outcome", "group", "line_index", "loss_mask")
    return line_advantages(*(batch[k] for k in keys), gamma=gamma, line_weight=line_weight, scale=scale)  # [B, T]


@advantage_estimator("line_rtg")
def _line_rtg(batch: dict[str, Tensor], scale: Scale = "none") -> Tensor:
    keys = ("line_rewards", "n_lines", "outcome", "group", "line_index", "loss_mask")
    return line_rtg_advantages(*(batch[k] for k in keys), scale=scale)  # [B, T]


@advantage_estimator("state")
def _state(batch: dict[str, Tensor], state_key: str = "values", state_weight: float = 0.5,
           scale: Scale = "std") -> Tensor:
    if state_key not in ("values", "named"):
        raise ValueError(f"state_key must be 'values' or 'named', got {state_key!r}")
    keys = ("line_code", "line_rewards", "outcome", "group", "line_index", "loss_mask")
    states = batch["line_state_values" if state_key == "values" else "line_state"]
    return state_advantages(states, *(batch[k] for k in keys), state_weight=state_weight, scale=scale)  # [B, T]


@advantage_estimator("tree")
def _tree(batch: dict[str, Tensor], scale: Scale = "std", tree_weight: float = 1.0) -> Tensor:
    keys = ("outcome", "line_rewards", "group", "line_index", "loss_mask", "tree_from", "tree_to", "tree_credit")
    return tree_advantages(*(batch[k] for k in keys), scale=scale, tree_weight=tree_weight)  # [B, T]


# ---------------------------------------------------------------------------------------------------------------
# Trajectories -> padded tensors


def batch_tensors(trajectories: Sequence[Trajectory], pad_id: int) -> dict[str, Tensor]:
    """Right-pad B trajectories to T = the longest one; L = the most lines (at least 1).

    Returns input_ids [B, T] long (pad_id), attention_mask [B, T] long, loss_mask [B, T] float (1 exactly on
    sampled tokens), old_logprobs [B, T] float (0 where loss_mask is 0), line_index [B, T] long (line of each
    sampled token from ``Line.token_span``, -1 elsewhere), line_rewards [B, L] float (sum of the line's terms,
    0-padded), n_lines [B] long, outcome [B] float (sum of ``outcome_rewards``), group [B] long, correct [B] bool,
    and the line ids the state estimator compares: line_state / line_state_values [B, L] long (the start state of
    each line with / without names, numbered in order of appearance, -1 where unknown or no line) and line_code
    [B, L] long (the line's text, numbered likewise).
    And the tree each episode belongs to (``tree_tensors``): tree_from, tree_to [B, L] long, tree_credit [B] bool.
    """
    if not trajectories:
        raise ValueError("batch_tensors needs at least one trajectory")
    B = len(trajectories)
    T = max(len(tr.token_ids) for tr in trajectories)
    L = max(1, max(len(tr.lines) for tr in trajectories))
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(B, T, dtype=torch.long)
    loss_mask = torch.zeros(B, T)
    old_logprobs = torch.zeros(B, T)
    line_index = torch.full((B, T), -1, dtype=torch.long)
    line_rewards = torch.zeros(B, L)
    ids: dict[str, dict[str, int]] = {"state": {}, "state_values": {}, "code": {}}
    numbered = {k: torch.full((B, L), -1, dtype=torch.long) for k in ids}
    for i, tr in enumerate(trajectories):
        n = len(tr.token_ids)
        if len(tr.loss_mask) != n or len(tr.logprobs) != n:
            raise ValueError(f"trajectory {i}: token_ids, loss_mask and logprobs differ in length")
        input_ids[i, :n] = torch.tensor(tr.token_ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(tr.loss_mask, dtype=torch.float)
        old_logprobs[i, :n] = torch.tensor(tr.logprobs, dtype=torch.float) * loss_mask[i, :n]
        for k, line in enumerate(tr.lines):
            start, end = line.token_span
            if not 0 <= start <= end <= n:
                raise ValueError(f"trajectory {i} line {k}: token_span {line.token_span} outside [0, {n}]")
            line_index[i, start:end] = k
            line_rewards[i, k] = sum(line.rewards.values())
            for key, table in ids.items():
                value = getattr(line, key)
                if value or key == "code":
                    numbered[key][i, k] = table.setdefault(value, len(table))
    line_index = line_index.masked_fill(loss_mask == 0, -1)                # [B, T]
    tree_from, tree_to = tree_tensors(trajectories, L)
    return {
        "tree_from": tree_from,
        "tree_to": tree_to,
        "tree_credit": torch.tensor([not tr.tree_diverged for tr in trajectories], dtype=torch.bool),
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "old_logprobs": old_logprobs,
        "line_index": line_index,
        "line_rewards": line_rewards,
        "n_lines": torch.tensor([len(tr.lines) for tr in trajectories], dtype=torch.long),
        "outcome": torch.tensor([float(sum(tr.outcome_rewards.values())) for tr in trajectories]),
        "group": torch.tensor([tr.group for tr in trajectories], dtype=torch.long),
        "correct": torch.tensor([bool(tr.correct) for tr in trajectories], dtype=torch.bool),
        "line_state": numbered["state"],
        "line_state_values": numbered["state_values"],
        "line_code": numbered["code"],
    }


def tree_tensors(trajectories: Sequence[Trajectory], n_lines: int) -> tuple[Tensor, Tensor]:
    """The tree segment of every line -> tree_from, tree_to [B, L] long: the batch-wide ids of the node the line's
    segment starts from (-1: the root, the group's prompt) and of the node it leads to; -1 in both beyond an
    episode's lines. Branch nodes (``Trajectory.tree_nodes``, unique per group) are numbered first, then one leaf per
    episode. A flat episode's lines all lead from the root to its leaf."""
    ids: dict[tuple[int, int], int] = {}
    for tr in trajectories:
        for node in tr.tree_nodes:
            ids.setdefault((tr.group, node), len(ids))
    B = len(trajectories)
    tree_from = torch.full((B, n_lines), -1, dtype=torch.long)
    tree_to = torch.full((B, n_lines), -1, dtype=torch.long)
    for i, tr in enumerate(trajectories):
        path = [-1] + [ids[(tr.group, n)] for n in tr.tree_nodes] + [len(ids) + i]      # root, branches, leaf
        cuts = [0, *tr.tree_cuts, len(tr.lines)]
        for k in range(len(path) - 1):
            tree_from[i, cuts[k]:cuts[k + 1]] = path[k]
            tree_to[i, cuts[k]:cuts[k + 1]] = path[k + 1]
    return tree_from, tree_to
