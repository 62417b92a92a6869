"""Old import path of the sampler/trainer contract, which lives in ``replrl.contract`` (outside ``backends/``: the
trainer's loss reads it as much as the samplers do). Every name is re-exported here."""

from __future__ import annotations

from replrl.contract import (
    LINE_PROMPT,
    LineRule,
    TokenMasks,
    eos_ids,
    line_end_ids,
    line_rule,
    line_starts,
    newline_banned_mask,
    row_seed,
    sample,
    sampling_logprobs,
    token_masks,
)

__all__ = ["LINE_PROMPT", "LineRule", "TokenMasks", "eos_ids", "line_end_ids", "line_rule", "line_starts",
           "newline_banned_mask", "row_seed", "sample", "sampling_logprobs", "token_masks"]
