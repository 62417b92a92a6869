"""Sandboxed Jupyter kernels for running model-written Python. Standalone: imports nothing from replrl.

Each name is imported on first use (``from sandbox import KernelPool`` works as usual), so ``import sandbox`` and
``sandbox.errors`` stay light: a command line that fails on a bad option never loads jupyter_client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import KernelStartError, SandboxUnavailable

_MODULE_OF = {
    "Kernel": "kernel", "KernelPool": "pool", "Limits": "limits", "ExecResult": "result", "ToolCall": "result",
    "StateDigest": "result", "empty_state": "state",
    "SyncKernel": "sync", "SyncKernelPool": "sync", "run_sync": "sync",
}

__all__ = [
    "ExecResult", "Kernel", "KernelPool", "KernelStartError", "Limits", "SandboxUnavailable", "StateDigest",
    "SyncKernel", "SyncKernelPool", "ToolCall", "empty_state", "run_sync",
]

if TYPE_CHECKING:
    from .kernel import Kernel
    from .limits import Limits
    from .pool import KernelPool
    from .result import ExecResult, StateDigest, ToolCall
    from .state import empty_state
    from .sync import SyncKernel, SyncKernelPool, run_sync


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'sandbox' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
