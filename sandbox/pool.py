"""KernelPool: warm sandboxed kernels, handed out with fresh state and never reused across episodes."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

from . import budget, zygote
from .kernel import Kernel, KernelProcess, KernelStartError
from .limits import Limits, is_root

log = logging.getLogger(__name__)

Refill = Literal["idle", "eager"]
BOOT_NICE = 10
"""How much lower than the host's a booting kernel's priority is (``nice -n``; when the host is root it is set back
to the host's when the kernel is handed out)."""


class KernelPool:
    """Keeps up to ``size`` kernel processes started and idle, so ``acquire()`` costs milliseconds, not a cold start.

    ``acquire()`` hands out a kernel with fresh state; on release it is killed (never reused: no state leaks
    between episodes). A kernel that dies or is killed mid-episode is replaced from the same warm set. ``close()``
    kills everything the pool started.

    When replacements start (``refill``): ``"idle"`` (the default) starts them once no kernel is in use, i.e.
    between rollouts, while the trainer updates the model, so no rollout shares the CPU with kernels booting
    (a boot costs a few hundred CPU-milliseconds); ``"eager"`` starts one as soon as a kernel is taken. Either way
    an ``acquire()`` that finds no warm kernel starts one for itself at once. At most ``max_boots`` kernels boot at a
    time, and when the host is root they boot at a lower priority (``BOOT_NICE`` below the host's, set back to the
    host's when handed out).
    """

    def __init__(self, size: int = 4, limits: Limits | None = None, tools: Sequence[str] = (),
                 refill: Refill = "idle", max_boots: int | None = None):
        if size < 1:
            raise ValueError("KernelPool size must be >= 1")
        if refill not in ("idle", "eager"):
            raise ValueError(f"KernelPool refill must be 'idle' or 'eager', got {refill!r}")
        self.size = size
        self.limits = limits or Limits()
        self.isolation = self.limits.resolve_isolation()
        self.tools = tuple(tools)
        self.refill = refill
        self.max_boots = max_boots or max(2, os.cpu_count() or 2)
        self._idle: collections.deque[KernelProcess] = collections.deque()
        self._starting: set[asyncio.Task] = set()
        self._in_use: set[Kernel] = set()
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        """Acquirers that found no warm kernel, in order; a booted kernel is handed to the first one directly (never
        through ``_idle``, where a later acquirer could take it and leave this one waiting with no boot on its way)."""
        self._boot_slots: asyncio.Semaphore | None = None
        self._closed = False
        self._zygote = zygote.hold(self.limits) if zygote.fork_server_usable(self.isolation, self.limits) else None
        """The fork server the pool's kernels come from (when usable), held for the pool's life: it would close
        whenever a rollout's last kernel is killed before the refill starts the next (``zygote.release``)."""
        self.failures = 0
        """Boots that failed so far."""
        self._failed_in_a_row = 0
        self.boots = 0
        """Kernels started so far (the warm start included)."""
        self.boots_while_busy = 0
        """Of those, how many started while some kernel was in use (a rollout running beside the boot)."""

    # -- lifecycle -------------------------------------------------------------------------------------------
    async def start(self) -> KernelPool:
        """Start the warm kernels and wait until all of them answer."""
        self._refill()
        await asyncio.gather(*list(self._starting), return_exceptions=True)
        if not self._idle:
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
        self._fail_waiters(RuntimeError("KernelPool is closed"))
        for kernel in list(self._in_use):
            await kernel.shutdown()
        while self._idle:
            self._idle.popleft().kill()
        if self._zygote is not None:
            zygote.release(self._zygote)
            self._zygote = None
        await asyncio.get_running_loop().run_in_executor(None, budget.flush, 2.0)  # the kernels' cgroups

    @property
    def warm(self) -> int:
        """Kernels started and idle right now."""
        return len(self._idle)

    @property
    def in_use(self) -> int:
        """Kernels handed out and not yet released."""
        return len(self._in_use)

    async def wait_full(self, timeout: float = 60.0) -> bool:
        """Start what is missing and wait until the pool is back at full strength (``size`` idle kernels)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self._idle) < self.size and loop.time() < deadline:
            self._refill()
            await asyncio.sleep(0.02)
        return len(self._idle) >= self.size

    def fill(self) -> None:
        """Start (in the background) the kernels the pool is short of; returns at once."""
        self._refill()

    # -- kernels ---------------------------------------------------------------------------------------------
    def _refill(self) -> None:
        while not self._closed and len(self._idle) + len(self._starting) < self.size:
            self._boot()

    def _boot(self) -> None:
        task = asyncio.ensure_future(self._start_one())
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _start_one(self) -> None:
        """Boot one kernel and hand it to the first waiting acquirer (else it waits in ``_idle``). This boot leaves
        ``_starting`` before anything counts the boots on their way (a boot that still counted itself there would
        start one too few). A failed boot is retried for the acquirers still waiting; after ``3 * size`` failures in
        a row they get the error instead (the sandbox cannot start kernels: an acquire fails, it never hangs)."""
        proc, error = None, None
        try:
            if self._boot_slots is None:  # made on the running loop
                self._boot_slots = asyncio.Semaphore(self.max_boots)
            async with self._boot_slots:
                if self._closed:
                    return
                self.boots += 1
                self.boots_while_busy += bool(self._in_use)
                try:
                    proc = await KernelProcess(self.limits, self.isolation, nice=BOOT_NICE if is_root() else 0).start()
                    self._failed_in_a_row = 0
                except KernelStartError as err:
                    self.failures += 1
                    self._failed_in_a_row += 1
                    log.warning("%s", err)
                    error = err
                    if self._failed_in_a_row <= 3 * self.size:
                        await asyncio.sleep(min(0.1 * self._failed_in_a_row, 2.0))
        finally:
            self._starting.discard(asyncio.current_task())
        if proc is not None:
            if self._closed:
                proc.kill()
            else:
                self._hand(proc)
        elif error is not None and self._failed_in_a_row > 3 * self.size:
            self._fail_waiters(error)
        else:
            if self.refill == "eager" or not self._in_use:
                self._refill()
            self._for_waiters()

    def _hand(self, proc: KernelProcess) -> None:
        """``proc`` to the first acquirer still waiting, else to the warm set."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(proc)
                return
        self._idle.append(proc)

    def _fail_waiters(self, error: BaseException) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)

    def _for_waiters(self) -> None:
        """Start a kernel for each waiting acquirer that has none on its way."""
        waiting = sum(not w.done() for w in self._waiters)
        while not self._closed and len(self._starting) < waiting:
            self._boot()

    async def _take(self) -> KernelProcess:
        """A warm process (starting one if none is warm); in "eager" mode the pool refills behind it."""
        while True:
            if self._idle:
                proc = self._idle.popleft()
            else:
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
                self._for_waiters()
                try:
                    proc = await waiter
                except asyncio.CancelledError:
                    if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                        self._hand(waiter.result())  # handed over as this acquirer was cancelled: to the next one
                    else:
                        with contextlib.suppress(ValueError):
                            self._waiters.remove(waiter)
                    raise
            if self.refill == "eager":
                self._refill()
            if proc.alive:
                proc.renice()
                return proc
            proc.kill()

    def _released(self) -> None:
        if self.refill == "idle" and not self._in_use and not self._closed:
            self._refill()  # nothing runs now (between rollouts, or the update): the moment to boot

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[Kernel]:
        """A kernel with fresh state for one episode; killed when the block exits (and replaced, see ``refill``)."""
        if self._closed:
            raise RuntimeError("KernelPool is closed")
        kernel = Kernel(self.limits, self.tools, _spawn=self._take)
        self._in_use.add(kernel)
        try:
            await kernel.start()
            yield kernel
        finally:
            self._in_use.discard(kernel)
            await kernel.shutdown()
            self._released()
