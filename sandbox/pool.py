"""KernelPool: warm sandboxed kernels, handed out with fresh state and never reused across episodes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from .kernel import Kernel, KernelProcess, KernelStartError
from .limits import Limits

log = logging.getLogger(__name__)


class KernelPool:
    """Keeps ``size`` kernel processes started and idle, so ``acquire()`` costs milliseconds, not a cold start.

    ``acquire()`` hands out a kernel with fresh state; on release it is killed (never reused: no state leaks
    between episodes) and a replacement starts in the background. A kernel that dies or is killed mid-episode is
    replaced from the same warm set. ``close()`` kills everything the pool started.
    """

    def __init__(self, size: int = 4, limits: Limits | None = None, tools: Sequence[str] = ()):
        if size < 1:
            raise ValueError("KernelPool size must be >= 1")
        self.size = size
        self.limits = limits or Limits()
        self.isolation = self.limits.resolve_isolation()
        self.tools = tuple(tools)
        self._idle: asyncio.Queue[KernelProcess] = asyncio.Queue()
        self._starting: set[asyncio.Task] = set()
        self._in_use: set[Kernel] = set()
        self._closed = False
        self.failures = 0

    # -- lifecycle -------------------------------------------------------------------------------------------
    async def start(self) -> KernelPool:
        """Start the warm kernels and wait until all of them answer."""
        self._refill()
        await asyncio.gather(*list(self._starting), return_exceptions=True)
        if self._idle.empty():
            raise KernelStartError(f"no sandboxed kernel could be started ({self.isolation})")
        return self

    async def __aenter__(self) -> KernelPool:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        for task in list(self._starting):
            task.cancel()
        await asyncio.gather(*list(self._starting), return_exceptions=True)
        for kernel in list(self._in_use):
            await kernel.shutdown()
        while not self._idle.empty():
            self._idle.get_nowait().kill()

    @property
    def warm(self) -> int:
        """Kernels started and idle right now."""
        return self._idle.qsize()

    async def wait_full(self, timeout: float = 60.0) -> bool:
        """Wait until the pool is back at full strength (``size`` idle kernels)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._idle.qsize() < self.size and loop.time() < deadline:
            self._refill()
            await asyncio.sleep(0.02)
        return self._idle.qsize() >= self.size

    # -- kernels ---------------------------------------------------------------------------------------------
    def _refill(self) -> None:
        if self._closed:
            return
        while self._idle.qsize() + len(self._starting) < self.size:
            task = asyncio.ensure_future(self._start_one())
            self._starting.add(task)
            task.add_done_callback(self._starting.discard)

    async def _start_one(self) -> None:
        try:
            proc = await KernelProcess(self.limits, self.isolation).start()
        except KernelStartError as err:
            self.failures += 1
            log.warning("%s", err)
            if self.failures > 3 * self.size:
                raise
            await asyncio.sleep(min(0.1 * self.failures, 2.0))
            return self._refill()
        if self._closed:
            proc.kill()
        else:
            self._idle.put_nowait(proc)

    async def _take(self) -> KernelProcess:
        """A warm process (waiting for one if all are still starting); the pool refills behind it."""
        while True:
            if self._idle.empty():
                self._refill()
            proc = await self._idle.get()
            self._refill()
            if proc.alive:
                return proc
            proc.kill()

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[Kernel]:
        """A kernel with fresh state for one episode; killed and replaced when the block exits."""
        if self._closed:
            raise RuntimeError("KernelPool is closed")
        kernel = Kernel(self.limits, self.tools, _spawn=self._take)
        await kernel.start()
        self._in_use.add(kernel)
        try:
            yield kernel
        finally:
            self._in_use.discard(kernel)
            await kernel.shutdown()
