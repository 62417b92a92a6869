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
import hmac
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
    await serve_stream(reader, writer)


async def serve_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Serve the trainer on one connection (the process host's socket pair, or a Ray actor's TCP connection) until
    it closes or asks the host to; then close the pool."""
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


HELLO_TIMEOUT_S = 10.0
"""How long a connection to a listening host has to present the secret."""


async def serve_one(fd: int, secret: str) -> None:
    """Listen on the TCP socket ``fd`` (a Ray actor's host, ``ray_hosts.py``): the first connection whose first
    frame is ``{"secret": secret}`` is served, and the socket is closed; any other connection is dropped."""
    served = asyncio.get_running_loop().create_future()
    expected = secret.encode()

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await asyncio.wait_for(read_message(reader, 256), HELLO_TIMEOUT_S)
        except (asyncio.TimeoutError, ProtocolError):
            hello = None
        given = str((hello or {}).get("secret", "")).encode()
        if served.done() or not hmac.compare_digest(given, expected):
            writer.transport.abort()
            return
        served.set_result(None)
        server.close()
        try:
            await serve_stream(reader, writer)
        finally:
            done.set()

    done = asyncio.Event()
    server = await asyncio.start_server(client, sock=socket.socket(fileno=fd), limit=2**16)
    await done.wait()


def main(argv: list[str] | None = None) -> None:
    """``FD``: serve the trainer on the connected unix socket FD; ``--listen FD``: on the first connection to the
    listening TCP socket FD that presents the secret (read from stdin)."""
    argv = sys.argv[1:] if argv is None else argv
    _die_with_parent()
    # A host started from a thread that blocks SIGINT (Ray's do) inherits the mask, and so would its kernels: an
    # interrupt would never arrive and every timeout would kill the kernel. Kernels start with none blocked.
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    logging.basicConfig(level=logging.WARNING, format="kernel host %(process)d: %(message)s")
    if argv[0] == "--listen":
        secret = sys.stdin.readline().strip()
        asyncio.run(serve_one(int(argv[1]), secret))
    else:
        asyncio.run(serve(int(argv[0])))


if __name__ == "__main__":
    main()
