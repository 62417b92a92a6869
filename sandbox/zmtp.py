"""The host's end of a kernel's socket: ZMTP 3 (ZeroMQ's wire protocol, rfc.zeromq.org/spec/23), read within budgets.

Everything a kernel sends is hostile: the kernel program shares its process with model-written code, which holds
its sockets and their HMAC key. pyzmq cannot bound what such a peer costs the host: libzmq's I/O thread reads a
message's frames into the host's memory before the application sees any of it (a multipart message is delivered
whole), its queue limit (HWM) counts whole messages, not frames or bytes, and ``ZMQ_MAXMSGSIZE`` bounds one frame.
One message of 100,000 frames that share one buffer costs the kernel nothing and the trainer ~450 MiB; a flood of
badly signed messages kept the old reader busy while every timer of the event loop waited.

So the host speaks the protocol itself, as a DEALER to the kernel's ROUTER over the unix socket (NULL mechanism: the
socket is private to the kernel's directory; Jupyter's HMAC signs the messages), and counts every byte before it
keeps it: frames per message, bytes per message, bytes and unanswered messages per window (the traffic since the
host last asked something). A peer past a budget is a ``WireFault`` (the caller kills the kernel and says why); the
reader yields to the event loop after each message. The host writes only its own small requests and never waits on
the kernel to read them.
"""

from __future__ import annotations

import asyncio
import errno
import struct
from dataclasses import dataclass

GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
"""ZMTP 3.0 greeting: signature, version 3.0, the NULL mechanism, not a server, filler (64 bytes)."""
MORE, LONG, COMMAND = 0x01, 0x02, 0x04
HANDSHAKE_BYTES = 4096
"""What the peer may send before its READY command (its greeting and metadata): libzmq sends ~100 bytes."""


class WireFault(Exception):
    """The peer broke the protocol or a budget: the text says which, in the host's own words (no peer bytes)."""


class WireClosed(Exception):
    """The peer closed the connection (a dying kernel)."""


@dataclass(frozen=True)
class WireBudget:
    """What one kernel socket may send the host."""

    message_bytes: int
    """All frames of one message together."""
    frames: int = 16
    """Frames of one message (a Jupyter reply has 6)."""
    window_bytes: int = 0
    """Bytes between two requests of the host (0: twice ``message_bytes``)."""
    strays: int = 8
    """Messages per window that answer nothing the host asked (forged, badly signed, replayed, unknown)."""

    @classmethod
    def for_output(cls, max_output_chars: int) -> WireBudget:
        """Room for a reply carrying ``max_output_chars`` of output, each JSON-escaped at its longest (an astral
        character as two ``\\uXXXX``: 12 bytes), plus 1 MiB for tool calls (the kernel keeps 64 kB), the digest and
        the headers."""
        return cls(message_bytes=2**20 + 12 * max_output_chars)


def _frame(data: bytes, more: bool) -> bytes:
    flags = MORE if more else 0
    if len(data) > 255:
        return struct.pack(">BQ", flags | LONG, len(data)) + data
    return struct.pack(">BB", flags, len(data)) + data


def _ready_command() -> bytes:
    name, value = b"Socket-Type", b"DEALER"
    body = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
    return struct.pack(">BB", COMMAND, len(body)) + body


class Channel:
    """One connection to a kernel's ROUTER socket. ``send`` frames; ``recv`` one message within the budget."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, budget: WireBudget):
        self._reader, self._writer, self.budget = reader, writer, budget
        self._window_limit = budget.window_bytes or 2 * budget.message_bytes
        self.window_bytes = 0
        self.strays = 0

    @classmethod
    async def connect(cls, path: str, budget: WireBudget, deadline: float,
                      gone: asyncio.Future | None = None) -> Channel:
        """Connect to the socket at ``path`` (retrying while it is not bound yet, until ``deadline`` on the loop's
        clock or until ``gone`` is done) and do the handshake. Raises WireFault, or TimeoutError past the deadline."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(path, limit=2**16)
                break
            except OSError as err:
                if err.errno not in (errno.ENOENT, errno.ECONNREFUSED) or loop.time() > deadline or \
                        (gone is not None and gone.done()):
                    raise
                await asyncio.sleep(0.005)
        chan = cls(reader, writer, budget)
        try:
            await asyncio.wait_for(chan._handshake(), max(deadline - loop.time(), 0.001))
        except BaseException:
            chan.close()
            raise
        return chan

    async def _handshake(self) -> None:
        self._writer.write(GREETING + _ready_command())
        greeting = await self._read_exactly(64, "greeting")
        if greeting[0] != 0xFF or greeting[9] & 0x01 != 0x01 or greeting[10] < 3 or \
                greeting[12:32].rstrip(b"\x00") != b"NULL":
            raise WireFault("the kernel's socket does not speak ZMTP 3 with the NULL mechanism")
        seen = 64
        while True:
            flags, size = await self._header()
            seen += size
            if not flags & COMMAND or seen > HANDSHAKE_BYTES:
                raise WireFault("the kernel's socket sent no READY command")
            body = await self._read_exactly(size, "command")
            if body[:6] == b"\x05READY":
                return
            if body[:6] == b"\x05ERROR":
                raise WireFault("the kernel's socket refused the connection (ZMTP ERROR)")

    async def _read_exactly(self, n: int, what: str) -> bytes:
        try:
            data = await self._reader.readexactly(n)
        except asyncio.IncompleteReadError:
            raise WireClosed(f"the kernel closed its socket in a {what}") from None
        except OSError as err:
            raise WireClosed(f"the kernel's socket failed: {err.strerror}") from None
        return data

    async def _header(self) -> tuple[int, int]:
        head = await self._read_exactly(2, "frame header")
        flags = head[0]
        if flags & ~(MORE | LONG | COMMAND):
            raise WireFault(f"a frame with reserved flag bits set ({flags:#04x})")
        if not flags & LONG:
            return flags, head[1]
        rest = await self._read_exactly(7, "frame header")
        return flags, struct.unpack(">Q", head[1:] + rest)[0]

    async def recv(self) -> list[bytes]:
        """The next message's frames. Commands between messages (PING, ...) are read within the same budgets and
        skipped. Raises WireFault past a budget (nothing past it is read), WireClosed at the end of the stream."""
        frames: list[bytes] = []
        size = 0
        while True:
            flags, n = await self._header()
            size += n
            self.window_bytes += n + 2
            if size > self.budget.message_bytes:
                raise WireFault(f"a message of more than {self.budget.message_bytes} bytes")
            if self.window_bytes > self._window_limit:
                raise WireFault(f"more than {self._window_limit} bytes between two requests")
            body = await self._read_exactly(n, "frame")
            if flags & COMMAND:
                if frames:
                    raise WireFault("a command inside a message")
                size = 0
                continue
            frames.append(body)
            if len(frames) > self.budget.frames:
                raise WireFault(f"a message of more than {self.budget.frames} frames")
            if not flags & MORE:
                return frames

    def stray(self) -> None:
        """Count a message that answered nothing the host asked; raises WireFault past the budget."""
        self.strays += 1
        if self.strays > self.budget.strays:
            raise WireFault(f"more than {self.budget.strays} messages that answer nothing between two requests")

    def send(self, frames: list[bytes]) -> None:
        """Write one message (never waits for the kernel to read it) and open a new window."""
        self.window_bytes = self.strays = 0
        if self._writer.transport.is_closing():
            return
        last = len(frames) - 1
        self._writer.write(b"".join(_frame(f, k < last) for k, f in enumerate(frames)))

    def close(self) -> None:
        self._writer.transport.abort()  # drop what is unsent; never wait on the peer
