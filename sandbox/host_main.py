"""A kernel host: the process that owns a share of a pool's kernels (``python -m sandbox.host_main FD``).

It runs an ordinary ``KernelPool`` on its own event loop and serves the trainer through the unix socket it inherits
as ``FD`` (``host_protocol.py``): every kernel's sockets, HMAC, JSON, budgets, checks, interrupts and replacements
cost this process's CPU, not the trainer's. It ends when the trainer closes the socket or asks it to, or dies
(``PR_SET_PDEATHSIG``): its pool is closed, so no kernel outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

from .host_protocol import ProtocolError, encode, limits_from_data, read_message, result_to_data
from .kernel import Kernel
from .pool import KernelPool
from .result import ExecResult

REQUEST_LIMIT = 2**20 + 4 * 2**20
"""The largest request the host reads: a line of code is small; 5 MiB leaves room for a setup cell."""
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the trainer died before the line above
        os._exit(1)


def load_post(spec: Any) -> Callable[[ExecResult], Any]:
    """The post-processor of an open request's ``post``: ``["module:callable", {arguments}]``, built once."""
    path, kwargs = spec
    module, _, name = str(path).partition(":")
    return getattr(importlib.import_module(module), name)(**dict(kwargs))


class Host:
    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.pool: KernelPool | None = None
        self.leases: dict[int, tuple[Any, Kernel]] = {}
        self.next_lease = 0
        self.tasks: set[asyncio.Task] = set()
        self.post: Callable[[ExecResult], Any] | None = None

    def reply(self, msg: dict) -> None:
        if not self.writer.transport.is_closing():
            self.writer.write(encode(msg))

    def stats(self) -> dict:
        pool = self.pool
        return {} if pool is None else {"boots": pool.boots, "boots_while_busy": pool.boots_while_busy,
                                        "failures": pool.failures, "warm": pool.warm, "in_use": pool.in_use}

    async def open(self, msg: dict) -> None:
        self.pool = KernelPool(size=int(msg["size"]), limits=limits_from_data(msg["limits"]),
                               tools=[str(t) for t in msg.get("tools", [])], refill=msg.get("refill", "idle"),
                               max_boots=msg.get("max_boots"))
        if msg.get("post"):
            try:
                self.post = load_post(msg["post"])
            except Exception:  # an optimisation only: the trainer does the work itself
                logging.getLogger(__name__).exception("kernel host: no post-processor %r", msg["post"])
        await self.pool.start()
        self.reply({"ok": True, "stats": self.stats()})

    async def handle(self, msg: dict) -> None:
        rid = msg.get("id")
        try:
            op = msg.get("op")
            if op == "acquire":
                assert self.pool is not None
                scope = self.pool.acquire()
                kernel = await scope.__aenter__()
                self.next_lease += 1
                self.leases[self.next_lease] = (scope, kernel)
                self.reply({"id": rid, "lease": self.next_lease, "stats": self.stats()})
            elif op == "execute":
                _, kernel = self.leases[msg["lease"]]
                result = await kernel.execute(msg["code"], mode=msg.get("mode", "exec"), timeout=msg.get("timeout"),
                                              digest=bool(msg.get("digest")))
                data = result_to_data(result)
                if self.post is not None:
                    try:
                        data["post"] = self.post(result)
                    except Exception:  # the result goes on without it (the trainer does the work itself)
                        logging.getLogger(__name__).exception("kernel host: the post-processor failed")
                self.reply({"id": rid, "result": data})
            elif op == "stats":
                self.reply({"id": rid, "stats": self.stats()})
            elif op == "release":
                scope, _ = self.leases.pop(msg["lease"])
                await scope.__aexit__(None, None, None)
                self.reply({"id": rid, "stats": self.stats()})
            else:
                self.reply({"id": rid, "error": f"unknown op {op!r}"})
        except Exception as err:  # a request the host cannot serve: the trainer hears why, the host goes on
            if msg.get("op") == "execute":
                self.reply({"id": rid, "result": result_to_data(ExecResult(
                    "crashed", restarted=True, limit=f"the kernel host could not run it: {type(err).__name__}"))})
            else:
                self.reply({"id": rid, "error": f"{type(err).__name__}: {err}"})

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for scope, _ in list(self.leases.values()):
            with contextlib.suppress(Exception):
                await scope.__aexit__(None, None, None)
        self.leases.clear()
        if self.pool is not None:
            await self.pool.close()


async def serve(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    reader, writer = await asyncio.open_unix_connection(sock=sock, limit=2**16)
    host = Host(writer)
    try:
        first = await read_message(reader, REQUEST_LIMIT)
        if first is None or first.get("op") != "open":
            return
        try:
            await host.open(first)
        except Exception as err:
            host.reply({"error": f"{type(err).__name__}: {err}"})
            return
        while True:
            msg = await read_message(reader, REQUEST_LIMIT)
            if msg is None or msg.get("op") == "close":
                return
            task = asyncio.ensure_future(host.handle(msg))
            host.tasks.add(task)
            task.add_done_callback(host.tasks.discard)
    except ProtocolError as err:
        logging.getLogger(__name__).error("kernel host: %s from the trainer; closing", err)
    finally:
        await host.close()
        writer.transport.abort()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    _die_with_parent()
    logging.basicConfig(level=logging.WARNING, format="kernel host %(process)d: %(message)s")
    asyncio.run(serve(int(argv[0])))


if __name__ == "__main__":
    main()
