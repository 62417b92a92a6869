"""The sampler/trainer contract: the sampling distribution both compute, the line rule's token sets, and where lines
start in a trajectory. Every backend samples by it and the trainer's loss recomputes it (``replrl.loss``); it
imports nothing from ``backends/``.

``sampling_logprobs`` is the one definition of "the distribution the policy sampled from": the HF backend samples
from it and the trainer recomputes it on the same token sequence, so their log-probabilities agree exactly
(invariant 1). The line rule (invariant 2) is a vocabulary mask: a token whose text contains a newline anywhere
but at its very end can never be sampled, so a line always ends on a token boundary.

Prompt healing: the environment's prompts end without their space (``>>>``, ``...``) and the first token of every
line must begin with a space (or be an end-of-sequence token). A BPE tokenizer splits ``>>> print(x)`` into
``>>>``, `` print``, ...: this is the tokenization the model saw in pretraining, so its first token of a line is
a natural one, not a word-start token after a stray space (which would make ``>>>  x``, an IndentationError).
The transcript text is unchanged; the line's code is its text minus that one leading space.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from replrl.types import SamplingParams


def sampling_logprobs(logits: torch.Tensor, params: SamplingParams, banned: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the distribution tokens are sampled from.

    logits [..., V] -> logprobs [..., V] (float32): ``logits / temperature``, ``banned`` ids removed, then top-k and
    top-p truncation, then log_softmax. Removed tokens get -inf. ``banned`` is a BoolTensor [V] (or [..., V], a
    mask per row) on the same device.
    """
    x = logits.float()                                                       # [..., V]
    if params.temperature != 1.0:
        x = x / params.temperature
    x = x.masked_fill(banned, float("-inf"))                                 # a new tensor: logits untouched
    if 0 < params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]                  # [..., 1]  k-th largest (ties kept)
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)                   # [..., V]
        probs = sorted_x.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs                           # mass of strictly more likely tokens
        drop_sorted = mass_before >= params.top_p                            # the most likely token always stays
        x = x.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return x.log_softmax(dim=-1)


def row_seed(seed: int, key: int, restart: int = 0) -> int:
    """The seed of one row's random stream: a session's ``seed`` and the row's ``key`` (its index, or a fork's key),
    so a row's samples do not depend on which other rows share its steps. ``restart`` counts the row's rollbacks
    (``GenSession.rollback``): the line after a rollback is drawn from a stream of its own, never the one the dropped
    tokens came from again, and still the same on every run of a seeded rollout."""
    if not restart:
        return (seed * 1_000_003 + key) % (2**63)
    digest = hashlib.blake2b(f"{seed}/{key}/{restart}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**63)


def sample(logprobs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of ``logprobs`` [S, V], row k drawing its uniform from ``generators[k]`` -> ids [S].

    Inverse-CDF sampling (exact, like ``torch.multinomial``), vectorised over rows while each row keeps its own
    random stream, so a row's samples do not depend on which other rows happen to share the step.
    """
    u = torch.cat([torch.rand(1, generator=g, device=g.device, dtype=torch.float64) for g in generators])  # [S]
    cdf = torch.cumsum(logprobs.exp(), dim=-1, dtype=torch.float64)          # [S, V]
    target = (1.0 - u.to(cdf.device)) * cdf[:, -1]                           # in (0, total]: never a 0-prob token
    return torch.searchsorted(cdf, target[:, None]).clamp_(max=cdf.shape[-1] - 1)[:, 0]


@dataclass(frozen=True)
class LineRule:
    """The line rule's token sets for one tokenizer (see ``line_rule``)."""

    banned: torch.Tensor
    """BoolTensor [len(tokenizer)]: the token's text contains a newline not at its very end."""
    start_banned: torch.Tensor
    """BoolTensor [len(tokenizer)]: may not be a line's first token: banned, or its text does not begin with a
    space (prompt healing; end-of-sequence ids excepted)."""
    line_end: frozenset[int]
    """Ids whose text ends with a newline (and contains no other): sampling one ends the line."""
    eos: frozenset[int]
    """Ids that end the episode: tokenizer.eos_token_id, the chat end-of-turn token (e.g. <|im_end|>), ..."""


_RULES: weakref.WeakKeyDictionary[Any, LineRule] = weakref.WeakKeyDictionary()
_RULES_BY_ID: dict[int, tuple[Any, LineRule]] = {}  # for tokenizers that cannot be weakly referenced

LINE_PROMPT = "\n>>>"
"""What precedes a line's first token in a transcript: a healed prompt (its space belongs to the line)."""

_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>")


def line_rule(tokenizer: Any) -> LineRule:
    """Token sets of the line rule, computed once per tokenizer (one decode of each id, ~0.7 s for 49k ids)."""
    try:
        return _RULES[tokenizer]
    except KeyError:
        pass
    except TypeError:
        if id(tokenizer) in _RULES_BY_ID:
            return _RULES_BY_ID[id(tokenizer)][1]
    n = len(tokenizer)
    # each id decoded after a prompt, as it appears in a transcript (a SentencePiece tokenizer drops the leading
    # space of a token decoded alone)
    prefix = tokenizer.encode(LINE_PROMPT, add_special_tokens=False)
    skip = len(tokenizer.decode(prefix, skip_special_tokens=False, clean_up_tokenization_spaces=False))
    texts = [t[skip:] for t in tokenizer.batch_decode(
        [[*prefix, i] for i in range(n)], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )]
    banned = torch.tensor(["\n" in t[:-1] for t in texts], dtype=torch.bool)
    line_end = frozenset(i for i, t in enumerate(texts) if t.endswith("\n") and not banned[i])
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    vocab = tokenizer.get_vocab()
    eos |= {vocab[t] for t in _END_OF_TURN if t in vocab}
    start_banned = banned | torch.tensor([not t.startswith(" ") for t in texts], dtype=torch.bool)
    start_banned[sorted(i for i in eos if i < n)] = False
    rule = LineRule(banned=banned, start_banned=start_banned, line_end=line_end, eos=frozenset(eos))
    try:
        _RULES[tokenizer] = rule
    except TypeError:
        _RULES_BY_ID[id(tokenizer)] = (tokenizer, rule)
    return rule


def newline_banned_mask(tokenizer: Any, vocab_size: int | None = None, line_start: bool = False) -> torch.Tensor:
    """BoolTensor [vocab_size]: ids that may never be sampled (``line_start``: as the first token of a line).

    Tokens whose text contains a newline anywhere but at its end (the line rule), and ids >= len(tokenizer) (rows a
    model's embedding matrix carries as padding; they are no token). At a line start, also every token whose text
    does not begin with a space, EOS excepted (prompt healing). ``vocab_size`` defaults to len(tokenizer); pass
    the model's logits width (``logits.shape[-1]``), as the sampler does, so the trainer builds the same mask.
    """
    rule = line_rule(tokenizer)
    banned = rule.start_banned if line_start else rule.banned
    vocab_size = len(banned) if vocab_size is None else vocab_size
    if vocab_size <= len(banned):
        return banned[:vocab_size].clone()
    return torch.cat([banned, torch.ones(vocab_size - len(banned), dtype=torch.bool)])


def line_end_ids(tokenizer: Any) -> frozenset[int]:
    """Ids whose text ends with a newline: sampling one of them ends the line."""
    return line_rule(tokenizer).line_end


def eos_ids(tokenizer: Any, generation_config: Any = None) -> frozenset[int]:
    """Ids that end the episode: the tokenizer's EOS, the chat end-of-turn token, generation_config.eos_token_id."""
    ids = set(line_rule(tokenizer).eos)
    extra = getattr(generation_config, "eos_token_id", None)
    if isinstance(extra, int):
        ids.add(extra)
    elif extra is not None:
        ids.update(int(i) for i in extra)
    return frozenset(ids)


class TokenMasks(NamedTuple):
    """The two masks of the sampler, for recomputing its distribution over a whole sequence (the trainer)."""

    anywhere: torch.Tensor
    """BoolTensor [V]: never sampled (``newline_banned_mask``)."""
    line_start: torch.Tensor
    """BoolTensor [V]: never sampled as a line's first token (``newline_banned_mask(..., line_start=True)``)."""

    def at(self, is_line_start: torch.Tensor) -> torch.Tensor:
        """BoolTensor [N, V]: the mask of each of N positions, given which are line starts (BoolTensor [N])."""
        return torch.where(is_line_start[:, None], self.line_start, self.anywhere)


def token_masks(tokenizer: Any, vocab_size: int | None = None) -> TokenMasks:
    """Both masks for a tokenizer and a logits width (see ``newline_banned_mask``)."""
    return TokenMasks(newline_banned_mask(tokenizer, vocab_size), newline_banned_mask(tokenizer, vocab_size, True))


def line_starts(loss_mask: torch.Tensor) -> torch.Tensor:
    """BoolTensor [..., T]: the token is a line's first (sampled, after a token that was not: every line follows
    the environment's prompt)."""
    start = loss_mask > 0
    start[..., 1:] &= loss_mask[..., :-1] <= 0
    return start
