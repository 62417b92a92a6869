"""Sandboxed Jupyter kernels for running model-written Python. Standalone: imports nothing from replrl."""

from .kernel import Kernel, KernelStartError
from .limits import Limits, SandboxUnavailable
from .pool import KernelPool
from .result import ExecResult, ToolCall

__all__ = ["ExecResult", "Kernel", "KernelPool", "KernelStartError", "Limits", "SandboxUnavailable", "ToolCall"]
