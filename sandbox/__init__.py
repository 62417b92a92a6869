"""Sandboxed Jupyter kernels for running model-written Python. Standalone: imports nothing from replrl."""

from .kernel import Kernel, KernelStartError
from .limits import Limits, SandboxUnavailable
from .pool import KernelPool
from .result import ExecResult, ToolCall
from .sync import SyncKernel, SyncKernelPool, run_sync

__all__ = [
    "ExecResult", "Kernel", "KernelPool", "KernelStartError", "Limits", "SandboxUnavailable", "SyncKernel",
    "SyncKernelPool", "ToolCall", "run_sync",
]
