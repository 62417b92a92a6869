"""Loading the policy for training or evaluation: a model spec, a checkpoint, a tiny model, optional LoRA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig
from .models import SMOLLM2_ALIAS, load_model_and_tokenizer, load_tokenizer, tiny_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_policy(cfg: ModelConfig, seed: int = 0, checkpoint: Path | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) on the CPU in cfg.dtype: from ``checkpoint/model`` when resuming, else from cfg.name
    (``tiny``: a tiny random Llama with SmolLM2's tokenizer). LoRA adapters are added when cfg.lora_rank > 0."""
    dtype = DTYPES[cfg.dtype]
    source = checkpoint / "model" if checkpoint is not None else None
    if source is not None and (source / "adapter_config.json").exists():
        return _load_lora_checkpoint(cfg, source, dtype, seed)
    if source is not None:
        model, tokenizer = load_model_and_tokenizer(str(source), dtype=dtype)
    elif cfg.name == "tiny":
        tokenizer = load_tokenizer(SMOLLM2_ALIAS)
        model = tiny_model(tokenizer, seed=seed).to(dtype)
    else:
        model, tokenizer = load_model_and_tokenizer(cfg.name, dtype=dtype)
    if cfg.lora_rank > 0:
        model = _with_lora(model, cfg.lora_rank)
    return model, tokenizer


def enable_gradient_checkpointing(model: Any) -> None:
    """Checkpoint every decoder layer of ``model`` (also under a peft wrapper): activations are recomputed in the
    backward pass. Active in training mode only, so generation and no-grad scoring are unchanged."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(f"optim.gradient_checkpointing: {type(base).__name__} does not support it")
    enable = getattr(base, "activation_checkpointing_enable", None)  # transformers >= 5.23; older: the old name
    if enable is not None:
        enable({"use_reentrant": False})
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _with_lora(model: Any, rank: int) -> Any:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ValueError("model.lora_rank > 0 needs peft: pip install 'replrl[lora]'") from None
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                            task_type="CAUSAL_LM"))


def _load_lora_checkpoint(cfg: ModelConfig, source: Path, dtype: torch.dtype, seed: int) -> tuple[Any, Any]:
    from peft import PeftModel
    from transformers import AutoTokenizer

    base, _ = load_policy(ModelConfig(**{**vars(cfg), "lora_rank": 0}), seed=seed)
    return PeftModel.from_pretrained(base, str(source), is_trainable=True), AutoTokenizer.from_pretrained(source)
