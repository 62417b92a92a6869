"""Generation backends behind the Generator protocol (see base.py), picked by name: ``load_generator("vllm", ...)``.

hf.py is the transformers one (KV cache per row, packed steps, samples from the training module itself); vllm.py
is vLLM's async engine (prefix caching, weights copied in by ``sync_weights``). Backend modules are imported only
when picked: vLLM is an optional dependency.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any

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
from replrl.backends.vllm_check import VLLMInstallError

log = logging.getLogger(__name__)

BACKENDS: dict[str, str] = {
    "hf": "replrl.backends.hf:HFGenerator",
    "vllm": "replrl.backends.vllm:VLLMGenerator",
}
"""Backend names and the class each resolves to (imported when picked). ``auto`` is vllm when it imports, else hf."""


class BackendError(ValueError):
    """A backend that cannot be loaded; the message is one line saying what to fix."""


def backend_class(name: str) -> type:
    """The Generator class of a backend name (``auto``: vllm if vllm imports here, else hf, with a log line)."""
    if name == "auto":
        try:
            return backend_class("vllm")
        except BackendError as e:
            log.info("backend auto: %s; using hf", e)
            return backend_class("hf")
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}: choose {', '.join(BACKENDS)} or auto")
    module_name, _, attr = BACKENDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except VLLMInstallError as e:  # installed, but cannot start on this machine: the message says what to do
        raise BackendError(f"backend {name!r} cannot start here: {e}") from e
    except ImportError as e:  # installed against another torch, or a dependency missing
        hint = " (on a GPU pip install 'replrl[vllm]'; on a CPU see docs/gpu.md)" if name == "vllm" else ""
        raise BackendError(f"backend {name!r} cannot be imported: {e}{hint}") from e
    return getattr(module, attr)


def load_generator(name: str, model: Any, tokenizer: Any, **opts: Any) -> Generator:
    """A Generator of backend ``name`` (hf, vllm, auto) over ``model`` and ``tokenizer``.

    ``opts`` are constructor options; those the picked backend does not declare are dropped, so a caller may pass
    both backends' options (e.g. ``device`` for both, ``num_threads`` for hf, ``kv_cache_gib`` for vllm).
    """
    cls = backend_class(name)
    declared = inspect.signature(cls).parameters
    return cls(model, tokenizer, **{k: v for k, v in opts.items() if k in declared})


def close_generator(generator: Any) -> None:
    """Release what a generator holds (vLLM: the engine's processes, its config directory, the shared weights; HF:
    nothing). A command calls it when it is done, so the engine shuts down while the interpreter still runs: left to
    the interpreter's exit, a CUDA IPC buffer's producer would exit before the engine released it."""
    close = getattr(generator, "close", None)
    if callable(close):
        close()


__all__ = ["BACKENDS", "BackendError", "Generator", "GenSession", "TokenMasks", "backend_class", "close_generator",
           "eos_ids", "line_end_ids", "line_starts", "load_generator", "newline_banned_mask", "sampling_logprobs",
           "token_masks"]
