"""The vLLM engine's event loop: the sandbox's shared loop thread, where the episodes and the kernels run too.

A line used to cross two event loops: an episode on the sandbox's loop handed its request to the engine's own loop
thread (``run_coroutine_threadsafe``) and waited on the answer there (``wrap_future``), each crossing a self-pipe
write that woke the other thread. On the CPU proxy at batch 128 the two loops' own work was 1.3-1.6 of the
trainer process's 6.8-8.2 CPU-ms a line (docs/results/host_profile.md). On one loop a line is an ``await``.

A caller on another thread (the trainer's main thread: weight sync, sleep and wake) still hands coroutines over
with ``submit``/``call``. The loop is shared (by the kernels, the episodes and every engine of the process), so
stopping an engine cancels only that engine's own tasks (``cancel``: vLLM's output handler, replrl's row streams);
vLLM's shutdown ends its client's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

from sandbox.sync import loop_thread

_T = TypeVar("_T")


class EngineLoop:
    """The engine's home: ``submit`` and ``call`` from another thread; ``here()`` says whether the caller already
    runs on it (then it awaits instead)."""

    def __init__(self) -> None:
        self._thread = loop_thread()
        self.loop = self._thread.loop

    def here(self) -> bool:
        """Whether the calling code runs on this loop (an episode, a session's coroutine)."""
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        if self.here():
            coro.close()
            raise RuntimeError("a blocking engine call from the engine's own loop would wait forever: await it")
        return self.submit(coro).result(timeout)

    def cancel(self, tasks: Iterable[asyncio.Future | None], timeout: float = 10) -> None:
        """Cancel ``tasks`` (an engine's own, on this loop) and wait until they are done; the loop runs on."""
        tasks = [t for t in tasks if t is not None and not t.done()]
        if tasks and self.loop.is_running() and not self.here():
            try:
                self.call(_cancel(tasks), timeout=timeout)
            except Exception:  # a loop that cannot answer: the engine's process is shut down all the same
                pass


async def _cancel(tasks: list[asyncio.Future]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
