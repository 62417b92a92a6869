"""What a kernel host does with a request, apart from how the request arrives: one core, two transports.

``HostCore`` owns an ordinary ``KernelPool`` and answers the messages of ``host_protocol.py`` (``open``,
``acquire``, ``execute``, ``release``, ``stats``) with plain-data replies. The process host (``host_main.py``) reads
them from a unix socket and writes the replies back with the request's id; the Ray actor (``ray_hosts.py``) receives
them as an actor call's argument and returns the reply. Either way a request it cannot serve is answered (an
``execute`` with a ``crashed`` result, anything else with ``{"error": why}``), never raised.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable
from typing import Any

from .host_protocol import limits_from_data, result_to_data
from .kernel import Kernel
from .pool import KernelPool
from .result import ExecResult

log = logging.getLogger(__name__)


def load_post(spec: Any) -> Callable[[ExecResult], Any]:
    """The post-processor of an open request's ``post``: ``["module:callable", {arguments}]``, built once."""
    path, kwargs = spec
    module, _, name = str(path).partition(":")
    return getattr(importlib.import_module(module), name)(**dict(kwargs))


class HostCore:
    def __init__(self) -> None:
        self.pool: KernelPool | None = None
        self.leases: dict[int, tuple[Any, Kernel]] = {}
        self.next_lease = 0
        self.post: Callable[[ExecResult], Any] | None = None
        """The open request's post-processor: its data goes with every result (``host_protocol.py``)."""

    def stats(self) -> dict:
        pool = self.pool
        return {} if pool is None else {"boots": pool.boots, "boots_while_busy": pool.boots_while_busy,
                                        "failures": pool.failures, "warm": pool.warm, "in_use": pool.in_use}

    async def open(self, msg: dict) -> dict:
        """Start the pool the ``open`` message asks for: ``{"ok": True, "stats"}``, or ``{"error": why}``."""
        try:
            self.pool = KernelPool(size=int(msg["size"]), limits=limits_from_data(msg["limits"]),
                                   tools=[str(t) for t in msg.get("tools", [])], refill=msg.get("refill", "idle"),
                                   max_boots=msg.get("max_boots"))
            if msg.get("post"):
                try:
                    self.post = load_post(msg["post"])
                except Exception:  # an optimisation only: the trainer does the work itself
                    log.exception("kernel host: no post-processor %r", msg["post"])
            await self.pool.start()
        except Exception as err:
            return {"error": f"{type(err).__name__}: {err}"}
        return {"ok": True, "stats": self.stats()}

    async def handle(self, msg: dict) -> dict:
        """The reply to one request (without its id)."""
        op = msg.get("op")
        try:
            if op == "acquire":
                assert self.pool is not None
                scope = self.pool.acquire()
                kernel = await scope.__aenter__()
                self.next_lease += 1
                self.leases[self.next_lease] = (scope, kernel)
                return {"lease": self.next_lease, "stats": self.stats()}
            if op == "execute":
                _, kernel = self.leases[msg["lease"]]
                result = await kernel.execute(msg["code"], mode=msg.get("mode", "exec"), timeout=msg.get("timeout"),
                                              digest=bool(msg.get("digest")))
                data = result_to_data(result)
                if self.post is not None:
                    try:
                        data["post"] = self.post(result)
                    except Exception:  # the result goes on without it (the trainer does the work itself)
                        log.exception("kernel host: the post-processor failed")
                return {"result": data}
            if op == "stats":
                return {"stats": self.stats()}
            if op == "release":
                scope, _ = self.leases.pop(msg["lease"])
                await scope.__aexit__(None, None, None)
                return {"stats": self.stats()}
            return {"error": f"unknown op {op!r}"}
        except Exception as err:  # a request the host cannot serve: the trainer hears why, the host goes on
            if op == "execute":
                return {"result": result_to_data(ExecResult(
                    "crashed", restarted=True, limit=f"the kernel host could not run it: {type(err).__name__}"))}
            return {"error": f"{type(err).__name__}: {err}"}

    async def close(self) -> None:
        """Release every lease and close the pool: no kernel outlives the host."""
        for scope, _ in list(self.leases.values()):
            with contextlib.suppress(Exception):
                await scope.__aexit__(None, None, None)
        self.leases.clear()
        if self.pool is not None:
            await self.pool.close()
