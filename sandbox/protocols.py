"""What the rollout side reads of a pool and its kernels: the one contract that ``KernelPool`` (kernels in this
process), ``HostedPool`` (kernels in kernel-host processes) and, later, kernels on other machines implement."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Protocol, runtime_checkable

from .limits import Limits
from .result import ExecResult


@runtime_checkable
class PoolKernel(Protocol):
    """One episode's kernel: persistent state, replaced (``restarted``) when it dies."""

    limits: Limits
    tools: tuple[str, ...]

    async def execute(self, code: str, *, mode: str = "exec", timeout: float | None = None,
                      digest: bool = False) -> ExecResult: ...


@runtime_checkable
class Pool(Protocol):
    """Warm kernels handed out with fresh state, one per episode, never reused."""

    size: int
    limits: Limits
    tools: tuple[str, ...]

    @property
    def boots_while_busy(self) -> int: ...

    def acquire(self) -> AbstractAsyncContextManager[PoolKernel]: ...

    async def close(self) -> None: ...
