"""A kernel host: the process that owns a share of a pool's kernels (``python -m sandbox.host_main FD``).

It runs an ordinary ``KernelPool`` (``host_core.HostCore``, which the Ray actor of ``ray_hosts.py`` runs too) on
its own event loop and serves the trainer through the unix socket it inherits
as ``FD`` (``host_protocol.py``): every kernel's sockets, HMAC, JSON, budgets, checks, interrupts and replacements
cost this process's CPU, not the trainer's. It ends when the trainer closes the socket or asks it to, or dies
(``PR_SET_PDEATHSIG``): its pool is closed, so no kernel outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys

from .host_core import HostCore
from .host_protocol import ProtocolError, encode, read_message

REQUEST_LIMIT = 2**20 + 4 * 2**20
"""The largest request the host reads: a line of code is small; 5 MiB leaves room for a setup cell."""
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the trainer died before the line above
        os._exit(1)


class Host:
    """A ``HostCore`` behind the trainer's socket: each request is answered with its id, several at once."""

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.core = HostCore()
        self.tasks: set[asyncio.Task] = set()

    def reply(self, msg: dict) -> None:
        if not self.writer.transport.is_closing():
            self.writer.write(encode(msg))

    async def handle(self, msg: dict) -> None:
        self.reply({"id": msg.get("id"), **await self.core.handle(msg)})

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.core.close()


async def serve(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    reader, writer = await asyncio.open_unix_connection(sock=sock, limit=2**16)
    host = Host(writer)
    try:
        first = await read_message(reader, REQUEST_LIMIT)
        if first is None or first.get("op") != "open":
            return
        opened = await host.core.open(first)
        host.reply(opened)
        if "error" in opened:
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
