"""Generation backends behind the Generator protocol (see base.py); hf.py is the transformers one."""

from replrl.backends.base import Generator, GenSession
from replrl.backends.sampling import eos_ids, line_end_ids, newline_banned_mask, sampling_logprobs

__all__ = ["Generator", "GenSession", "eos_ids", "line_end_ids", "newline_banned_mask", "sampling_logprobs"]
