"""Generation backends behind the Generator protocol (see base.py), picked by name: ``load_generator("vllm", ...)``;
``open_generator(cfg.model, model, tokenizer)`` opens the one a config asks for, with all of [model]'s options.
What a backend must do is base.py's protocols (``Generator``, ``GenSession``; optional: ``ForkableSession``,
``SleepingGenerator``): callers read nothing else of it.

hf.py is the transformers one (KV cache per row, packed steps, samples from the training module itself); vllm/
is vLLM's async engine (prefix caching, weights copied in by ``sync_weights``). Backend modules are imported only
when picked: vLLM is an optional dependency.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any

from replrl.backends.base import ForkableSession, Generator, GenSession, SleepingGenerator
from replrl.backends.vllm_check import VLLMInstallError
from replrl.config import check_vllm_table

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


def open_generator(model_cfg: Any, model: Any, tokenizer: Any, *, device: Any = None, max_rows: int | None = None,
                   **opts: Any) -> Generator:
    """The Generator a ``ModelConfig`` ([model]) asks for, over ``model`` and ``tokenizer``: the one place where
    [model]'s options reach a backend, for every door (the Trainer, ``replrl.evaluate``/``sample_episodes``,
    ``replrl eval``/``rollout``, bench/): ``backend``, ``device``, ``sync_timeout_s``, ``sync_transport``,
    ``gpu_memory_utilization``, and the engine arguments of ``vllm_engine_args`` ([model.vllm], ``compute_dtype``,
    ``vllm_sleep``), ``sync_bucket_mb``.

    ``device``: where to sample (the Trainer's accelerator device); None: ``model_cfg.device``, whose ``auto`` leaves
    the choice to the backend. ``max_rows``: the most episodes sampled at once (vLLM sizes its engine for them).
    ``opts``: further constructor options (a bench's), dropped where the backend does not declare them."""
    if device is None and model_cfg.device != "auto":
        device = model_cfg.device
    opts.setdefault("sync_bucket_bytes", int(model_cfg.sync_bucket_mb * 2**20))
    return load_generator(model_cfg.backend, model, tokenizer, device=device, sync_timeout_s=model_cfg.sync_timeout_s,
                          sync_transport=model_cfg.sync_transport,
                          gpu_memory_utilization=model_cfg.gpu_memory_utilization, max_rows=max_rows,
                          engine_args=vllm_engine_args(model_cfg), **opts)


__all__ = ["BACKENDS", "BackendError", "ForkableSession", "Generator", "GenSession", "SleepingGenerator",
           "backend_class", "load_generator", "open_generator", "vllm_engine_args"]


def vllm_engine_args(cfg: Any, known: set[str] | None = None) -> dict[str, Any]:
    """The engine arguments a ``ModelConfig`` adds to what the vLLM backend picks (they win there): its [model.vllm]
    table, ``enable_sleep_mode`` for ``vllm_sleep``, and ``dtype`` = ``compute_dtype`` when that is set and the table
    names no dtype (the engine samples in the dtype the update computes in). ``known``: vLLM's argument names, to
    refuse a misspelt one; None: looked up in the installed vLLM, if any (not for backend hf: nothing is imported).
    Otherwise a pure function of the config."""
    if known is None and cfg.backend != "hf":
        try:
            import dataclasses

            from vllm.engine.arg_utils import AsyncEngineArgs

            known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        except Exception:  # not installed (or not importable here): the backend says so when it is picked
            known = None
    check_vllm_table(cfg.vllm, known)
    args = dict(cfg.vllm)
    if cfg.compute_dtype and "dtype" not in args:
        args["dtype"] = cfg.compute_dtype
    if cfg.vllm_sleep:
        args["enable_sleep_mode"] = True
    return args
