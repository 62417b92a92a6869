"""The line rule and prompt healing's line-start mask inside vLLM: a logits processor in the engine's worker.

It is given the same masks the trainer uses (``token_masks``, written next to the engine's config as
``MASKS_FILE``); a request opts in with ``extra_args[LINE_RULE_KEY]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from replrl.backends.vllm.line_stop import install as install_line_stop
from replrl.contract import TokenMasks

LINE_RULE_KEY = "replrl_line_rule"
"""``SamplingParams.extra_args`` key: the request is one line (the line rule and line-start mask apply)."""
MASKS_FILE = "replrl_token_masks.pt"
"""The sampler's masks, written next to the engine's config for the logits processor to load."""


class LineRuleLogitsProcessor(LogitsProcessor):
    """The line rule and prompt healing inside vLLM (runs in the engine's worker process).

    For every request that opted in (``extra_args[LINE_RULE_KEY]``): its first sampled token (no output yet) is a
    line's first, masked with ``TokenMasks.line_start``; every later one with ``TokenMasks.anywhere``. Applied
    before temperature and truncation, like the ``banned`` argument of ``sampling_logprobs`` (a removed token
    stays removed under both).
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        masks = torch.load(Path(vllm_config.model_config.model) / MASKS_FILE)
        vocab = vllm_config.model_config.get_vocab_size()
        if masks["anywhere"].shape[0] != vocab:
            raise ValueError(f"replrl masks cover {masks['anywhere'].shape[0]} ids, the model's logits {vocab}")
        self._use(TokenMasks(masks["anywhere"], masks["line_start"]), device)

    @classmethod
    def for_masks(cls, masks: TokenMasks, device: str | torch.device = "cpu") -> LineRuleLogitsProcessor:
        """The processor over ``masks`` without an engine (tests and benches of ``apply``)."""
        proc = cls.__new__(cls)
        proc._use(masks, device)
        return proc

    def _use(self, masks: TokenMasks, device: str | torch.device) -> None:
        self.line_start = masks.line_start.to(device)                                             # [V] bool
        self.anywhere_ids = masks.anywhere.nonzero().squeeze(1).to(device)                        # [K] (K << V)
        self.outputs: dict[int, list[int]] = {}
        """Batch index -> the request's output ids (vLLM's live list): empty while sampling a line's first token."""

    def is_argmax_invariant(self) -> bool:
        return False  # removing tokens can change the most likely one

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.outputs, batch_update,
                             lambda params, _, out: out if (params.extra_args or {}).get(LINE_RULE_KEY) else None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # every step, in place: most rows are inside a line and lose only the few tokens banned anywhere (an index
        # write of R x K); a line's first token (one row in about twenty) takes the line-start mask, most of the
        # vocabulary, over its own row. (The first version gathered, masked and scattered whole [R, V] rows every
        # step: that made a step with 32 rows 1.9x slower on the CPU, bench/backends.py.)
        if not self.outputs:
            return logits
        inside: list[int] = []
        for i, out in self.outputs.items():
            if out:
                inside.append(i)
            else:
                logits[i].masked_fill_(self.line_start, float("-inf"))                          # [V]
        if inside:
            rows = torch.tensor(inside, device=logits.device)                                   # [R]
            logits[rows.unsqueeze(1), self.anywhere_ids] = float("-inf")                        # [R, K]
        return logits


install_line_stop()  # here: the engine's core imports this module (its config names the processor), see line_stop.py
