"""A synchronous facade over the async sandbox that also works inside a running event loop (Jupyter).

The async objects live on a private event loop in a daemon thread; each call hands a coroutine to that loop and
waits for it. Nothing touches the caller's own loop, so the facade works the same in a script, a notebook cell
(where a loop is already running) and a thread.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import threading
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from .kernel import Kernel
from .limits import Limits
from .pool import KernelPool
from .result import ExecResult

T = TypeVar("T")


class LoopThread:
    """An event loop running forever in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="replrl-sandbox-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.run called from its own loop: await the coroutine instead")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


_shared: LoopThread | None = None
_lock = threading.Lock()


def loop_thread() -> LoopThread:
    """The process-wide background loop used by the sync facades."""
    global _shared
    with _lock:
        if _shared is None:
            _shared = LoopThread()
        return _shared


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from synchronous code (works inside a running notebook loop)."""
    return loop_thread().run(coro)


class SyncKernel:
    """Blocking wrapper of a Kernel: ``SyncKernel(limits).execute("1 + 1", mode="single")``."""

    def __init__(self, limits: Limits | None = None, tools: Sequence[str] = (), *, _kernel: Kernel | None = None):
        self._lt = loop_thread()
        self.kernel = _kernel or Kernel(limits, tools)
        if _kernel is None:
            self._lt.run(self.kernel.start())

    def execute(self, code: str, *, mode: str = "exec", timeout: float | None = None,
                digest: bool = False) -> ExecResult:
        return self._lt.run(self.kernel.execute(code, mode=mode, timeout=timeout, digest=digest))

    def restart(self) -> None:
        self._lt.run(self.kernel.restart())

    def shutdown(self) -> None:
        self._lt.run(self.kernel.shutdown())

    def __enter__(self) -> SyncKernel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


class SyncKernelPool:
    """Blocking wrapper of a KernelPool: ``with SyncKernelPool(4) as pool, pool.acquire() as k: k.execute(...)``."""

    def __init__(self, size: int = 4, limits: Limits | None = None, tools: Sequence[str] = ()):
        self._lt = loop_thread()
        self.pool = self._lt.run(_make_pool(size, limits, tools))
        atexit.register(self.close)

    @contextlib.contextmanager
    def acquire(self) -> Iterator[SyncKernel]:
        cm = self.pool.acquire()
        kernel = self._lt.run(cm.__aenter__())
        try:
            yield SyncKernel(_kernel=kernel)
        finally:
            self._lt.run(cm.__aexit__(None, None, None))

    def wait_full(self, timeout: float = 60.0) -> bool:
        return self._lt.run(self.pool.wait_full(timeout))

    @property
    def warm(self) -> int:
        return self.pool.warm

    def close(self) -> None:
        if not self.pool._closed:
            self._lt.run(self.pool.close())

    def __enter__(self) -> SyncKernelPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


async def _make_pool(size: int, limits: Limits | None, tools: Sequence[str]) -> KernelPool:
    return await KernelPool(size, limits, tools).start()
