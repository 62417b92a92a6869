"""HostedPool: a pool whose kernels live in kernel-host processes, so the trainer's process sees one checked
message per line and nothing else of a kernel (docs/rollouts.md, "Processes").

Same protocol as ``KernelPool`` for ``replrl/rollout/``: ``acquire()`` hands out a kernel with fresh state and an
``execute`` of the same signature; ``size``, ``limits``, ``tools``, the boot counters. Each of ``hosts`` processes
(``host_main.py``) owns about ``size / hosts`` kernels; an acquire goes to the host with the fewest kernels in use.
A host that dies, breaks the protocol or misses a line's deadline is killed: its lines end as ``crashed`` results
that say so, its episodes go on with a fresh kernel on another host, and a new host takes its place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from . import host_protocol as hp
from .limits import Limits
from .pool import KernelPool
from .reply import Malformed
from .result import ExecResult

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
"""How long a host has to start its share of kernels."""
SLACK_S = 15.0
"""What a line's deadline adds to the kernel's own (wall + interrupt grace): the host's reap, kill and restart."""
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class HostLost(Exception):
    """The kernel host died or was killed (the text says why)."""


class _Host:
    """One kernel-host process and its socket, from the trainer's side. What is the process's own (``_connect``,
    ``_stop``, ``_wait_closed``) is apart from the protocol, so a host elsewhere (``ray_hosts._RayHost``: an actor
    and a TCP connection) is driven by the same code."""

    def __init__(self, pool: HostedPool, share: int):
        self.pool, self.share = pool, share
        self.proc: subprocess.Popen | None = None
        self.pending: dict[int, asyncio.Future] = {}
        self.next_id = 0
        self.in_use = 0
        self.stats: dict[str, int] = {}
        self.lost: str | None = None
        self._reader_task: asyncio.Task | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Start the host and connect to it (the process host: a child on one end of a socket pair)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT, *filter(None, [env.get("PYTHONPATH")])])
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "sandbox.host_main", str(theirs.fileno())],
                                         pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        return await asyncio.open_unix_connection(sock=mine, limit=2**16)

    def _stop(self) -> None:
        """Kill the host now."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.kill()

    async def _wait_closed(self) -> None:
        """Wait for the host, asked to close, to be gone; kill it if it has not within 10 s."""
        if self.proc is not None:
            loop = asyncio.get_running_loop()
            try:
                await asyncio.wait_for(loop.run_in_executor(None, self.proc.wait), 10.0)
            except asyncio.TimeoutError:
                self.proc.kill()
                await loop.run_in_executor(None, self.proc.wait)

    def _name(self) -> str:
        return str(self.proc.pid if self.proc else None)

    async def start(self) -> _Host:
        reader, self._writer = await self._connect()
        limit = hp.max_frame(self.pool.limits)
        self._writer.write(hp.encode({"op": "open", "size": self.share, "limits": hp.limits_to_data(self.pool.limits),
                                      "tools": list(self.pool.tools), "refill": self.pool.refill,
                                      "max_boots": self.pool.max_boots, "post": self.pool.post}))
        try:
            first = await asyncio.wait_for(hp.read_message(reader, limit), self.pool.start_timeout_s)
        except (asyncio.TimeoutError, hp.ProtocolError) as err:
            self.kill(f"it did not start: {type(err).__name__}")
            raise HostLost(self.lost) from None
        if first is None or not first.get("ok"):
            why = first.get("error") if isinstance(first, dict) else "it exited"
            self.kill(f"it did not start: {why}")
            raise HostLost(self.lost)
        self._take_stats(first)
        self._reader_task = asyncio.ensure_future(self._read(reader, limit))
        return self

    def _take_stats(self, msg: dict) -> None:
        stats = msg.get("stats")
        if isinstance(stats, dict):
            self.stats = {k: v for k, v in stats.items() if isinstance(v, int) and not isinstance(v, bool)}

    async def _read(self, reader: asyncio.StreamReader, limit: int) -> None:
        try:
            while True:
                msg = await hp.read_message(reader, limit)
                if msg is None:
                    self.kill("it exited")
                    return
                self._take_stats(msg)
                fut = self.pending.pop(msg.get("id"), None) if isinstance(msg.get("id"), int) else None
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except asyncio.CancelledError:
            pass
        except hp.ProtocolError as err:
            self.kill(f"it broke the protocol: {err}")

    async def call(self, msg: dict, timeout: float) -> dict:
        """Send ``msg`` and wait for its answer; HostLost if the host is gone, dies or misses ``timeout`` (then it
        is killed: a host that cannot answer in time holds its kernels hostage)."""
        if self.lost is not None:
            raise HostLost(self.lost)
        self.next_id += 1
        rid = self.next_id
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        assert self._writer is not None
        self._writer.write(hp.encode({**msg, "id": rid}))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self.kill(f"it did not answer within {timeout:.0f} s")
            raise HostLost(self.lost) from None
        except asyncio.CancelledError:
            if self.lost is not None:
                raise HostLost(self.lost) from None
            raise
        finally:
            self.pending.pop(rid, None)

    def kill(self, why: str) -> None:
        """End the host now (idempotent): its waiters fail with HostLost; the pool starts a replacement."""
        if self.lost is not None:
            return
        self.lost = why
        log.warning("kernel host %s lost: %s", self._name(), why)
        self._stop()
        for fut in self.pending.values():
            if not fut.done():
                fut.cancel()
        self.pending.clear()
        if self._writer is not None:
            self._writer.transport.abort()
        if self._reader_task is not None and self._reader_task is not asyncio.current_task():
            self._reader_task.cancel()
        self.pool._host_lost(self)

    async def close(self) -> None:
        """Ask the host to close its pool and exit; kill it if it has not within 10 s."""
        if self.lost is None and self._writer is not None:
            self.lost = "closed"
            self._writer.write(hp.encode({"op": "close"}))
            with contextlib.suppress(Exception):
                await self._writer.drain()
        if self._reader_task is not None:
            self._reader_task.cancel()
        await self._wait_closed()
        if self._writer is not None:
            self._writer.transport.abort()


class HostedKernel:
    """A kernel of a host, for one episode: ``execute`` as ``Kernel.execute``. If its host is lost, the line that
    was running ends as a crash that says so, and the next line runs on a fresh kernel of another host."""

    def __init__(self, pool: HostedPool):
        self.pool = pool
        self.limits, self.tools = pool.limits, pool.tools
        self.host: _Host | None = None
        self.lease: int | None = None
        self.restarts = 0

    async def _lease(self) -> None:
        self.host, self.lease = await self.pool._acquire_lease()

    async def execute(self, code: str, *, mode: str = "exec", timeout: float | None = None,
                      digest: bool = False) -> ExecResult:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        if self.host is None or self.host.lost is not None:
            try:
                await self._lease()
            except (HostLost, RuntimeError) as err:  # no host could hand out a kernel in time: this line's crash
                self.restarts += 1
                self.host = None
                return ExecResult("crashed", restarted=True, duration_s=loop.time() - t0,
                                  limit=f"no kernel host could hand out a kernel: {err}")
        try:
            assert self.host is not None
            wall = self.limits.wall_s if timeout is None else timeout
            msg = await self.host.call({"op": "execute", "lease": self.lease, "code": code, "mode": mode,
                                        "timeout": timeout, "digest": digest},
                                       wall + self.limits.interrupt_grace_s + self.pool.slack_s)
            data = msg.get("result")
            result = hp.result_from_data(data, self.tools, self.limits.max_output_bytes)
            result.post = data.get("post")  # checked by whoever asked for it (HostedPool's post)
            return result
        except (HostLost, Malformed) as err:
            if isinstance(err, Malformed) and self.host is not None:
                self.host.kill(f"it sent a malformed result ({err})")
            self.restarts += 1
            self.host = None
            return ExecResult("crashed", restarted=True, duration_s=loop.time() - t0,
                              limit=f"its kernel host was lost: {err}")

    async def release(self) -> None:
        host, lease, self.host, self.lease = self.host, self.lease, None, None
        if host is not None and host.lost is None:
            host.in_use -= 1
            with contextlib.suppress(HostLost):
                await host.call({"op": "release", "lease": lease}, SLACK_S + 10.0)


class HostedPool:
    """``KernelPool``'s protocol, served by ``hosts`` kernel-host processes (see the module docstring)."""

    def __init__(self, size: int = 4, limits: Limits | None = None, tools: Sequence[str] = (),
                 refill: str = "idle", max_boots: int | None = None, hosts: int = 2,
                 post: tuple[str, dict] | Callable[[], tuple[str, dict] | None] | None = None):
        if size < 1 or hosts < 1:
            raise ValueError("HostedPool size and hosts must be >= 1")
        self.size, self.limits, self.tools, self.refill = size, limits or Limits(), tuple(tools), refill
        post = post() if callable(post) else post
        self.post = list(post) if post else None
        """``["module:callable", {arguments}]``: a post-processor each host builds once and calls on every result,
        its data the result's ``post`` (``host_protocol.py``; the rollout side's tokenizes a line's output there)."""
        self.isolation = self._isolation()
        self.n_hosts = min(hosts, size)
        self.max_boots = max_boots or max(1, math.ceil(max(2, os.cpu_count() or 2) / self.n_hosts))
        self.hosts: list[_Host] = []
        """The hosts' links (``_Host`` here; its subclass ``ray_hosts._RayHost`` for kernels on other machines)."""
        self.slack_s = SLACK_S
        self.start_timeout_s = START_TIMEOUT_S
        self.replace_attempts = 3
        self._replacing: set[asyncio.Task] = set()
        self._closed = False
        self.hosts_lost = 0
        """Kernel hosts lost so far (died, killed for the protocol or a deadline)."""

    def _isolation(self) -> str:
        return self.limits.resolve_isolation()

    def _shares(self) -> list[int]:
        base, extra = divmod(self.size, self.n_hosts)
        return [base + (k < extra) for k in range(self.n_hosts)]

    def _new_host(self, share: int) -> _Host:
        """A link to a new host of ``share`` kernels, not started."""
        return _Host(self, share)

    async def start(self) -> HostedPool:
        self.hosts = list(await asyncio.gather(*(self._new_host(share).start() for share in self._shares())))
        return self

    async def __aenter__(self) -> HostedPool:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def _host_lost(self, host: _Host) -> None:
        if self._closed or host.lost == "closed" or host not in self.hosts:
            return
        self.hosts_lost += 1
        task = asyncio.ensure_future(self._replace(host))
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    async def _replace(self, old: _Host) -> None:
        for attempt in range(self.replace_attempts):
            try:
                new = await self._new_host(old.share).start()
            except HostLost:
                await asyncio.sleep(min(5.0, 0.5 * (attempt + 1)))
                continue
            if self._closed:
                await new.close()
                return
            self.hosts[self.hosts.index(old)] = new
            return
        log.error("kernel host could not be replaced: %s", old.lost)

    async def _acquire_lease(self) -> tuple[_Host, int]:
        """A lease on the live host with the fewest kernels in use (waiting for a replacement if none is live)."""
        for _ in range(100):
            live = [h for h in self.hosts if h.lost is None]
            if not live:
                if self._closed:
                    raise RuntimeError("HostedPool is closed")
                await asyncio.sleep(0.1)
                continue
            host = min(live, key=lambda h: h.in_use)
            host.in_use += 1
            try:
                msg = await host.call({"op": "acquire"}, self.start_timeout_s)
            except HostLost:
                continue
            if "lease" not in msg:
                host.in_use -= 1
                raise RuntimeError(f"kernel host: {msg.get('error')}")
            return host, msg["lease"]
        raise RuntimeError("no kernel host could hand out a kernel")

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[HostedKernel]:
        if self._closed:
            raise RuntimeError("HostedPool is closed")
        kernel = HostedKernel(self)
        try:
            await kernel._lease()
            yield kernel
        finally:
            await kernel.release()

    async def close(self) -> None:
        self._closed = True
        for task in list(self._replacing):
            task.cancel()
        await asyncio.gather(*self._replacing, return_exceptions=True)
        await asyncio.gather(*(h.close() for h in self.hosts), return_exceptions=True)

    def _sum(self, key: str) -> int:
        return sum(h.stats.get(key, 0) for h in self.hosts)

    @property
    def boots(self) -> int:
        return self._sum("boots")

    @property
    def boots_while_busy(self) -> int:
        return self._sum("boots_while_busy")

    @property
    def failures(self) -> int:
        return self._sum("failures")

    @property
    def warm(self) -> int:
        return self._sum("warm")

    @property
    def in_use(self) -> int:
        return sum(h.in_use for h in self.hosts)

    async def wait_full(self, timeout: float = 60.0) -> bool:
        """Wait until every host reports its share warm (the counters come with each host's answers)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            live = [h for h in self.hosts if h.lost is None]
            with contextlib.suppress(HostLost):
                await asyncio.gather(*(h.call({"op": "stats"}, 10.0) for h in live))
            if len(live) == len(self.hosts) and self.warm >= self.size:
                return True
            await asyncio.sleep(0.05)
        return False


def auto_hosts(cpus: int | None = None) -> int:
    """Kernel hosts for ``kernel_hosts = -1``: one per 16 CPUs, at most 8, on a machine of more than 4 CPUs; else 0
    (on a small machine a host's own CPU per line costs more than the trainer's process saves)."""
    cpus = cpus or os.cpu_count() or 1
    return 0 if cpus <= 4 else min(8, max(1, cpus // 16))


def open_pool(size: int, limits: Limits, tools: Sequence[str] = (), refill: str = "idle",
              hosts: int = -1, post: Any = None) -> KernelPool | HostedPool:
    """The pool for ``hosts`` (-1: ``auto_hosts()``; 0: a ``KernelPool`` in this process; N: a ``HostedPool`` of N
    hosts, ``post`` its post-processor), not started: ``await pool.start()`` or ``async with``."""
    hosts = auto_hosts() if hosts < 0 else hosts
    if hosts == 0:
        return KernelPool(size=size, limits=limits, tools=tools, refill=refill)  # type: ignore[arg-type]
    return HostedPool(size=size, limits=limits, tools=tools, refill=refill, hosts=hosts, post=post)
