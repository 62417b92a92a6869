"""Generation backends behind the Generator protocol (see base.py); hf.py is the transformers one."""

from replrl.backends.base import Generator, GenSession
from replrl.backends.sampling import (
    TokenMasks,
    eos_ids,
    line_end_ids,
    line_starts,
    newline_banned_mask,
    sampling_logprobs,
    token_masks,
)

__all__ = ["Generator", "GenSession", "TokenMasks", "eos_ids", "line_end_ids", "line_starts", "newline_banned_mask",
           "sampling_logprobs", "token_masks"]
