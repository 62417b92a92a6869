"""Learning the interpreter: an optional cross-entropy on what the REPL printed (``loss.predict_output``).

The policy-gradient term sees only the tokens the policy sampled (``loss_mask``). The interpreter's output is the one
place where the transcript tells the model, token by token, what its code did; this term asks the model to predict
it: the mean over those tokens of -log p(token | everything before), under the model's own next-token distribution
(logits at temperature 1, nothing banned: interpreter text may hold tokens the sampler's line rule bans, and
temperature and truncation shape sampling, not prediction).

What counts (``Line.output_span``, recorded at the splice: ``rollout.transcript.env_splice``): the tokens of what the
REPL printed after a line (expression values, ``print`` output, tracebacks), as the transcript holds them. Not the
``>>>``/``...`` prompt after it (constant: predicting it teaches nothing about the code, and a line that prints
nothing would add a token of free loss), not the truncation marker of long output (the environment's text), not the
prompt, banner or task header. A token whose text starts in the printed part and runs into the prompt (a BPE merge of
``"\\n>>>"``) counts: it carries printed text. ``output_mask`` is its own mask: ``loss_mask`` and the sampled
log-probs are untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .types import SamplingParams, Trajectory


def output_spans(traj: Trajectory) -> list[tuple[int, int]]:
    """[start, end) in ``traj.token_ids`` of the tokens of what the interpreter printed after each line that printed
    something (``Line.output_span``)."""
    return [line.output_span for line in traj.lines if line.output_span[1] > line.output_span[0]]


def output_mask(trajectories: Sequence[Trajectory], T: int | None = None) -> Tensor:
    """[B, T] float, 1 exactly on the interpreter's printed tokens (``output_spans``), aligned with
    ``advantages.batch_tensors`` (right padding to T, default the longest trajectory)."""
    T = T or max(len(t.token_ids) for t in trajectories)
    out = torch.zeros(len(trajectories), T)
    for i, traj in enumerate(trajectories):
        for start, end in output_spans(traj):
            out[i, start:end] = 1.0
    return out


def output_nll(logits_at: Callable[[Tensor, Tensor], Tensor], input_ids: Tensor, output_mask: Tensor,
               chunk: int = 1024, grad: bool = True) -> tuple[Tensor, Tensor]:
    """(cross-entropy [B, T], greedy hit [B, T] float) of each token where ``output_mask`` is 1, 0 elsewhere.

    ``logits_at(rows, cols)`` gives the next-token logits [n, V] after position (row, col) (``loss.TokenScorer``'s
    decoder pass, then its LM head on those states only): at most [chunk, V] logits at a time, never [B, T, V].
    Position t holds the quantity for token t given tokens < t, as in ``loss``. ``grad`` False: no autograd graph
    (the figures only)."""
    B, T = input_ids.shape
    rows, cols = (output_mask[:, 1:] > 0).nonzero(as_tuple=True)          # [N], [N]  target t = cols + 1
    targets = input_ids[:, 1:][rows, cols]                                 # [N]
    nll, hit = [], []
    with contextlib.nullcontext() if grad else torch.no_grad():
        for start in range(0, len(rows), chunk):
            i = slice(start, start + chunk)
            logits = logits_at(rows[i], cols[i]).float()                   # [n, V]
            nll.append(-logits.log_softmax(-1).gather(-1, targets[i, None])[:, 0])  # [n]
            hit.append((logits.detach().argmax(-1) == targets[i]).float())   # [n]
        zeros = torch.zeros(B, T, device=input_ids.device)
        ce = zeros.index_put((rows, cols + 1), torch.cat(nll)) if nll else zeros   # [B, T]
    hits = zeros.index_put((rows, cols + 1), torch.cat(hit)) if hit else zeros     # [B, T]
    return ce, hits


class OutputPrediction:
    """The trainer's side of the term: the mask of a step's batch, the scale of each micro-batch's term, the
    figures. Off (``loss.predict_output`` 0 and no ``loss.predict_output_metrics``): nothing is added anywhere, and
    the update is the GRPO update exactly.

    The term is the mean over a minibatch's output tokens, on every rank together: each micro-batch adds
    ``weight * sum(nll) * ranks / N`` (N: the minibatch's output tokens summed over ranks), so that DDP's average of
    the ranks' gradients is the gradient of the mean. A rank with no output tokens adds 0 and runs the same forwards
    and backwards as the others (the policy-gradient term decides which it runs).

    The figures are the same mean over every rank's output tokens (sums over ranks, then divided: not the mean of the
    ranks' means, which would weigh a rank with few output tokens as much as one with many), so they equal one
    process's over the whole batch, and the trainer's mean over ranks of the update's figures leaves them as they
    are."""

    def __init__(self, weight: float, metrics: bool):
        self.weight = float(weight)
        self.on = self.weight > 0 or metrics
        self._scale = 0.0
        self._nll = self._hits = self._n = 0.0
        self._sum_over_ranks: Callable[[float], float] = lambda value: value

    def add_mask(self, batch: dict[str, Tensor], trajectories: Sequence[Trajectory]) -> None:
        """``batch["output_mask"]`` [B, T] for ``trajectories`` (the batch's rows), when on."""
        if self.on:
            batch["output_mask"] = output_mask(trajectories, batch["input_ids"].shape[1])

    def start_minibatch(self, batch: dict[str, Tensor], mb: Tensor, sum_over_ranks: Callable[[float], float],
                        ranks: int) -> None:
        """The scale of this minibatch's micro-batch terms (one collective on every rank, when the term is on).
        ``sum_over_ranks`` is kept for the figures (every rank calls ``figures`` at the end of the update)."""
        self._sum_over_ranks = sum_over_ranks
        if self.weight > 0:
            total = sum_over_ranks(float(batch["output_mask"][mb].sum()))
            self._scale = self.weight * ranks / total if total else 0.0

    def keep_backward(self, skips: list[bool], micros: Sequence[tuple[Tensor, float, bool]],
                      batch: dict[str, Tensor]) -> list[bool]:
        """``skips`` (backwards the policy-gradient term can skip) less the micro-batches with output tokens to
        learn (before the ranks agree on them)."""
        if self.weight == 0:
            return skips
        out = batch["output_mask"]
        return [s and (padding or not bool(out[m].any())) for s, (m, _, padding) in zip(skips, micros, strict=True)]

    def mask(self, batch: dict[str, Tensor], micro: Tensor, T: int, device: torch.device) -> Tensor | None:
        """The micro-batch's output mask [b, T] (None when off: the scorer computes nothing more)."""
        return batch["output_mask"][micro][:, :T].to(device) if self.on else None

    def term(self, nll: Tensor, hits: Tensor, out_mask: Tensor, padding: bool) -> Tensor | float:
        """What the micro-batch adds to the loss its backward runs on (already scaled), and its figures kept."""
        if not padding:
            with torch.no_grad():
                self._nll += float(nll.sum())
                self._hits += float(hits.sum())
                self._n += float(out_mask.sum())
        if self.weight == 0 or padding:
            return 0.0
        return nll.sum() * self._scale

    def figures(self) -> dict[str, float]:
        """The update's figures since the last call, over every rank's output tokens (three collectives, on every
        rank: the update calls it on each): the mean cross-entropy of the output tokens and the share predicted
        greedily (over every forward of the update), and how many tokens that was, when on."""
        if not self.on:
            return {}
        nll, hits, tokens = (self._sum_over_ranks(v) for v in (self._nll, self._hits, self._n))
        self._nll = self._hits = self._n = 0.0
        return _figures(nll, hits, tokens)


@torch.no_grad()
def score_episodes(scorer: torch.nn.Module, trajectories: Sequence[Trajectory], pad_id: int, micro_batch: int,
                   device: torch.device | str) -> dict[str, float]:
    """loss/predict_output and predict_output/accuracy of a model on ``trajectories``' output tokens (a held-out
    evaluation's episodes): one scoring pass without gradient through ``scorer`` (the Trainer's ``loss.TokenScorer``
    over its model), the LM head on the output tokens only."""
    from .advantages import batch_tensors

    if not trajectories:
        return {}
    nll = hits = n = 0.0
    for start in range(0, len(trajectories), micro_batch):
        part = trajectories[start:start + micro_batch]
        batch = batch_tensors(part, pad_id)
        out = output_mask(part, batch["input_ids"].shape[1])
        ids, att, out = batch["input_ids"].to(device), batch["attention_mask"].to(device), out.to(device)
        _, _, (ce, hit) = scorer(ids, att, SamplingParams(), loss_mask=torch.zeros_like(out), with_entropy=False,
                                 output_mask=out, output_grad=False)
        nll, hits, n = nll + float(ce.sum()), hits + float(hit.sum()), n + float(out.sum())
    return _figures(nll, hits, n)


def _figures(nll: float, hits: float, tokens: float) -> dict[str, float]:
    """The logged figures of ``tokens`` output tokens. With none (the episodes printed nothing: a trained model
    often writes only ``submit(...)``) there is no cross-entropy or accuracy to report, only the count: a 0 there
    would read as "predicts nothing right"."""
    if not tokens:
        return {"predict_output/tokens": 0.0}
    return {"loss/predict_output": nll / tokens, "predict_output/accuracy": hits / tokens,
            "predict_output/tokens": tokens}
