"""Loading the policy for training or evaluation: a model spec, a checkpoint, a tiny model, optional LoRA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig
from .configlib import ConfigError
from .models import SMOLLM2_ALIAS, load_model_and_tokenizer, load_tokenizer, tiny_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_policy(cfg: ModelConfig, seed: int = 0, checkpoint: Path | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) on the CPU in cfg.dtype: from ``checkpoint/model`` when resuming, else from cfg.name
    (``tiny``: a tiny random Llama with SmolLM2's tokenizer). LoRA adapters are added when cfg.lora_rank > 0."""
    dtype = DTYPES[cfg.dtype]
    source = checkpoint / "model" if checkpoint is not None else None
    if source is not None and (source / "adapter_config.json").exists():
        return _load_lora_checkpoint(cfg, source, dtype, seed)
    if cfg.load_in_4bit:
        model, tokenizer = _load_4bit(cfg, str(source) if source is not None else cfg.name)
    elif cfg.name != "tiny" and reads_no_weights():
        model, tokenizer = _unread_model(str(source) if source is not None else cfg.name, dtype)
    elif source is not None:
        model, tokenizer = load_model_and_tokenizer(str(source), dtype=dtype)
    elif cfg.name == "tiny":
        tokenizer = load_tokenizer(SMOLLM2_ALIAS)
        model = tiny_model(tokenizer, seed=seed).to(dtype)
    else:
        model, tokenizer = load_model_and_tokenizer(cfg.name, dtype=dtype)
    if cfg.lora_rank > 0:
        model = _with_lora(model, cfg)
    return model, tokenizer


def reads_no_weights(environ: Any = None) -> bool:
    """Whether this process leaves the weights unread: a rank other than 0 under FSDP2 with
    ``fsdp_cpu_ram_efficient_loading: true``, where accelerate's ``prepare`` broadcasts rank 0's weights into every
    rank's shards (so 8 ranks of a node do not each read the whole model into host memory)."""
    import os

    env = os.environ if environ is None else environ
    return fsdp2_asked(env) and env.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "").lower() in ("1", "true", "yes") \
        and int(env.get("RANK", "0")) > 0


def _unread_model(spec: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """The model of ``spec`` built from its config alone, its weights allocated but neither read nor initialised
    (untouched pages: next to no host memory until accelerate writes this rank's shards), with the tokenizer and
    generation config ``load_model_and_tokenizer`` would give."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights

    from .models import resolve_model

    source = resolve_model(spec)
    tokenizer = load_tokenizer(source)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=dtype)
    try:
        model.generation_config = GenerationConfig.from_pretrained(source)
    except OSError:  # none saved: the one from_pretrained would derive from the config
        pass
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


def lora_config(cfg: ModelConfig) -> Any:
    """The ``peft.LoraConfig`` of ``cfg``'s adapters (rank, alpha, dropout, target modules)."""
    try:
        from peft import LoraConfig
    except ImportError:
        raise ValueError("model.lora_rank > 0 needs peft: pip install 'replrl[lora]'") from None
    targets = cfg.lora_target_modules
    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha or 2 * cfg.lora_rank, lora_dropout=cfg.lora_dropout,
                      target_modules="all-linear" if list(targets) == ["all-linear"] else list(targets),
                      task_type="CAUSAL_LM")


LORA_CARRIED = ("r", "lora_alpha", "lora_dropout", "target_modules", "task_type")
"""The ``peft.LoraConfig`` fields a run's config carries (model.lora_rank, lora_alpha, lora_dropout,
lora_target_modules); a LoraConfig that sets any other away from peft's default is refused."""


def apply_lora_config(cfg: ModelConfig, lora: Any) -> ModelConfig:
    """``cfg`` with its LoRA fields taken from a ``peft.LoraConfig`` (so config.toml records them and a resumed run
    rebuilds the same adapters). A field the config cannot carry, set away from peft's default, is a ConfigError."""
    from peft import LoraConfig

    if not isinstance(lora, LoraConfig):
        raise ConfigError(f"lora must be a peft.LoraConfig; got {type(lora).__name__}")
    default = LoraConfig()
    extra = sorted(k for k in vars(default) if k not in LORA_CARRIED and not k.startswith("_")
                   and getattr(lora, k, None) != getattr(default, k, None))
    if extra:
        raise ConfigError(f"lora: LoraConfig.{extra[0]} is not carried by replrl's config (it carries "
                          f"{', '.join(LORA_CARRIED[:4])}); leave it at peft's default")
    if lora.task_type not in (None, "CAUSAL_LM"):
        raise ConfigError(f"lora: task_type must be CAUSAL_LM; got {lora.task_type!r}")
    targets = lora.target_modules
    targets = ["all-linear"] if targets in (None, "all-linear") else [targets] if isinstance(targets, str) else \
        sorted(targets)
    return ModelConfig(**{**vars(cfg), "lora_rank": lora.r, "lora_alpha": float(lora.lora_alpha),
                          "lora_dropout": float(lora.lora_dropout), "lora_target_modules": targets})


def _with_lora(model: Any, cfg: ModelConfig) -> Any:
    from peft import get_peft_model

    config = lora_config(cfg)
    if cfg.load_in_4bit:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return get_peft_model(model, config)


def _load_4bit(cfg: ModelConfig, spec: str) -> tuple[Any, Any]:
    """QLoRA's base model: NF4 weights (bitsandbytes), computing in compute_dtype (default bfloat16)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from .models import resolve_model

    compute = DTYPES[cfg.compute_dtype or "bfloat16"]
    source = resolve_model(spec)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute,
                               bnb_4bit_use_double_quant=True)
    model = AutoModelForCausalLM.from_pretrained(source, quantization_config=quant, dtype=compute,
                                                 device_map={"": torch.cuda.current_device()})
    return model, load_tokenizer(source)


SUPPORTED_DISTRIBUTED = ("NO", "MULTI_CPU", "MULTI_GPU", "FSDP")
"""accelerate's distributed types replrl trains under: one process, DDP over processes (CPU or GPU), and FSDP2
(``fsdp_version: 2``: parameters, gradients and AdamW state sharded over the processes)."""


def _asked(environ: Any) -> str:
    """The distributed type an ``accelerate launch`` config asked for ("" if none of FSDP, DeepSpeed, Megatron)."""
    for asked in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
        if environ.get(f"ACCELERATE_USE_{asked}", "").lower() in ("1", "true", "yes"):
            return asked
    return ""


def fsdp2_asked(environ: Any = None) -> bool:
    """Whether the launch asked for FSDP2 (an accelerate config with ``distributed_type: FSDP``, ``fsdp_version:
    2``): what accelerate's launcher puts in the environment, since on a CPU accelerate itself forgets it."""
    import os

    env = os.environ if environ is None else environ
    return _asked(env) == "FSDP" and env.get("FSDP_VERSION", "1") == "2"


def check_distributed(distributed_type: Any, environ: Any = None) -> None:
    """Refuse, in one line, a distributed setting replrl does not train under (FSDP1, DeepSpeed, Megatron, XLA...)
    instead of bypassing it. ``environ`` (default ``os.environ``) is read too: on a machine without GPUs accelerate
    turns an FSDP config into plain DDP over CPU processes without a word (ACCELERATE_USE_FSDP stays set).
    ``distributed_type`` None: only what the launch asked (before the ``Accelerator``, which stops an FSDP1 config
    on a CPU with an error of its own)."""
    import os

    env = os.environ if environ is None else environ
    name = _asked(env) or ("NO" if distributed_type is None else str(getattr(distributed_type, "value",
                                                                               distributed_type)))
    if name == "FSDP" and env.get("FSDP_VERSION", "1") == "2":
        return
    if name not in SUPPORTED_DISTRIBUTED or name == "FSDP":
        what = "FSDP with fsdp_version 1" if name == "FSDP" else name
        raise ConfigError(f"accelerate's distributed type {what} is not supported by replrl; supported: one process, "
                          "DDP (accelerate launch --multi_gpu, also on CPUs) or FSDP2 (distributed_type: FSDP with "
                          "fsdp_version: 2); not FSDP1, DeepSpeed or Megatron (docs/training.md, 'Several GPUs and "
                          "nodes')")


def fsdp2_on_cpu(accelerator: Any, environ: Any = None) -> bool:
    """FSDP2 on a machine without GPUs, over gloo: the one place replrl corrects accelerate's state.

    accelerate selects FSDP only on accelerators: with ``Accelerator(cpu=True)`` (what the trainer passes on a CPU)
    an FSDP2 config becomes DDP over the CPU processes (``MULTI_CPU``). torch's ``fully_shard`` runs on the CPU, and
    accelerate's own FSDP2 path does too once its state says FSDP: both ``AcceleratorState`` and ``PartialState``
    (which ``save_state`` reads), with the FSDP plugin accelerate built from the launch's ``FSDP_*`` variables.
    Nothing happens unless FSDP2 was asked and accelerate chose ``MULTI_CPU``; returns whether it corrected. If the
    correction does not take (a later accelerate), a RuntimeError says so rather than a silent DDP run."""
    import accelerate
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if not fsdp2_asked(environ) or accelerator.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables, as accelerate reads them on a GPU
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    if not (accelerator.is_fsdp2 and PartialState().distributed_type == DistributedType.FSDP
            and accelerator.state.fsdp_plugin is plugin):
        raise RuntimeError(f"accelerate {accelerate.__version__} no longer takes replrl's FSDP2-on-CPU correction "
                           "(replrl.policy.fsdp2_on_cpu): the run would not be sharded")
    return True


def fsdp_wrap_decoder_layers(accelerator: Any, model: Any) -> None:
    """Under FSDP2, make the decoder layers the units ``fully_shard`` wraps, found from the model (its
    ``_no_split_modules``, under peft too), unless the accelerate config names a size-based policy or its own
    classes. The ``TokenScorer`` prepared around the model stays the root unit: it holds the embeddings, the final
    norm and the LM head, so its chunked LM head runs on parameters gathered once per forward."""
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if not getattr(accelerator, "is_fsdp2", False) or plugin is None:
        return
    if plugin.auto_wrap_policy is size_based_auto_wrap_policy or plugin.transformer_cls_names_to_wrap:
        return
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    layers = list(getattr(model, "_no_split_modules", None) or [])
    if not layers:
        raise ConfigError(f"FSDP2: {type(model).__name__} names no decoder layer class (_no_split_modules): set "
                          "fsdp_transformer_layer_cls_to_wrap in the accelerate config")
    plugin.auto_wrap_policy = transformer_auto_wrap_policy
    plugin.transformer_cls_names_to_wrap = layers


def same_adapters_on_every_rank(accelerator: Any, model: Any) -> None:
    """Under FSDP2, a peft model's adapter weights as rank 0 drew them, on every rank (a broadcast each: they are
    small). ``fully_shard`` keeps each rank's own slice of its own copy, where DDP would have broadcast rank 0's
    whole model: adapters drawn from a random stream that differs between ranks would make one model of several
    draws, silently. The base weights come from the same files on every rank."""
    import torch.distributed as dist

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if not getattr(accelerator, "is_fsdp2", False) or not hasattr(model, "peft_config") \
            or accelerator.num_processes < 2 or getattr(plugin, "cpu_ram_efficient_loading", False):
        return  # (cpu_ram_efficient_loading: accelerate broadcasts rank 0's whole model itself)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                dist.broadcast(p.data, src=0)


def shard_like(prepared: Any, module: Any, accelerator: Any) -> Any:
    """Under FSDP2, ``module`` (a frozen copy of the policy's scorer: the reference model's ``TokenScorer``) sharded
    as ``prepared`` is: ``fully_shard`` on the submodules of the same names (the decoder layers, then the root), on
    the same device mesh, with the accelerate config's reshard-after-forward and mixed precision. Every rank holds
    its part of the weights, copied from the policy's shards (call it before any update), and each no-grad forward
    gathers them unit by unit as the policy's does (a collective per unit: every rank must run the same forwards).
    Anything else: ``module`` as it is."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    if not getattr(accelerator, "is_fsdp2", False):
        return module
    plugin = accelerator.state.fsdp_plugin
    mesh = next(p for p in prepared.parameters() if isinstance(p, DTensor)).device_mesh
    units = [name for name, m in prepared.named_modules() if isinstance(m, FSDPModule)]
    for name in sorted(units, key=lambda n: (-n.count(".") if n else 1, n)):  # the deepest first, the root last
        fully_shard(module.get_submodule(name), mesh=mesh, reshard_after_forward=plugin.reshard_after_forward,
                    mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy())
    # the weights: each rank's shards copied from the policy's, as prepare left them (rank 0's, broadcast, where the
    # other ranks read none: ``reads_no_weights``); the same units and mesh, so the same local shapes
    policy = dict(prepared.named_parameters())
    with torch.no_grad():
        for name, p in module.named_parameters():
            mine, theirs = p, policy[name]
            mine = mine.to_local() if isinstance(mine, DTensor) else mine
            mine.copy_(theirs.to_local() if isinstance(theirs, DTensor) else theirs)
    return module


def mixed_precision(cfg: ModelConfig, cpu: bool) -> str:
    """accelerate's ``mixed_precision`` for model.dtype (storage) and model.compute_dtype: "no", "bf16" or "fp16"."""
    compute = cfg.compute_dtype or cfg.dtype
    if cfg.load_in_4bit:  # bitsandbytes computes in its compute dtype; the adapters are float32 under autocast
        return {"bfloat16": "bf16", "float16": "fp16"}.get(cfg.compute_dtype or "bfloat16", "no")
    if compute == cfg.dtype:  # as before compute_dtype existed: bfloat16 weights under bfloat16 autocast on a GPU
        return "bf16" if compute == "bfloat16" and not cpu else "no"
    return {"bfloat16": "bf16", "float16": "fp16"}.get(compute, "no")


def check_trainable(cfg: ModelConfig, cpu: bool) -> None:
    """Refuse, in one line, precision and adapter settings this machine cannot train with."""
    if cfg.dtype == "float16" and cfg.compute_dtype in ("", "float16"):
        raise ConfigError("model.dtype = float16 would train float16 weights without master weights or a gradient "
                          "scaler: set model.dtype = float32 with compute_dtype = float16 (GPU: autocast and a "
                          "gradient scaler) or bfloat16")
    if cfg.compute_dtype == "float16" and cpu:
        raise ConfigError("model.compute_dtype = float16 needs a GPU (float16 autocast with a gradient scaler); on "
                          "the CPU use bfloat16 or float32")
    if cfg.load_in_4bit:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise ConfigError("model.load_in_4bit (QLoRA) needs bitsandbytes, which is not installed here: pip "
                              "install bitsandbytes (on a CUDA GPU), or set load_in_4bit = false") from None
        if cpu:
            raise ConfigError("model.load_in_4bit (QLoRA) needs a CUDA GPU here: set load_in_4bit = false on the CPU")
    if cfg.vllm_sleep and cpu:
        raise ConfigError("model.vllm_sleep needs vLLM on a GPU (its sleep mode is CUDA only): set vllm_sleep = "
                          "false on the CPU")


def _load_lora_checkpoint(cfg: ModelConfig, source: Path, dtype: torch.dtype, seed: int) -> tuple[Any, Any]:
    from peft import PeftModel
    from transformers import AutoTokenizer

    if cfg.load_in_4bit:
        from peft import prepare_model_for_kbit_training

        base = prepare_model_for_kbit_training(_load_4bit(cfg, cfg.name)[0], use_gradient_checkpointing=False)
    else:
        base, _ = load_policy(ModelConfig(**{**vars(cfg), "lora_rank": 0}), seed=seed)
    return PeftModel.from_pretrained(base, str(source), is_trainable=True), AutoTokenizer.from_pretrained(source)
