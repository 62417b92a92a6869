"""Kernels on other machines: kernel hosts as Ray actors, one per node, behind the pool protocol (docs/ray.md).

``RayPool`` is ``HostedPool`` (``hosts.py``: leases, a lost host's lines as ``crashed`` results, replacements, the
trainer-side checks of every result) with a different link to each host: a ``KernelHost`` Ray actor pinned to a
node, running the same ``HostCore`` a kernel-host process runs (an unchanged ``KernelPool``: zygote, bwrap, seccomp,
cgroups, budgets). The messages are those of ``host_protocol.py``: a request goes as the actor call's argument, the
reply comes back as JSON bytes that the trainer bounds (``max_frame``) and parses (``decode``) exactly as a frame
from a local host, then checks (``result_from_data``). Every call has a deadline; an actor or node lost mid-line
ends that line as ``crashed`` with Ray's reason, and the pool starts a new host on a node with room.

Ray is imported when a ``RayPool`` is made (the ``ray`` extra: ``pip install 'replrl[ray]'``); nothing else of
replrl or ``sandbox`` needs it. Only the kernels' hosts run under Ray; the trainer stays on accelerate/torchrun.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Sequence
from typing import Any

from . import host_protocol as hp
from .errors import SandboxUnavailable
from .host_core import HostCore
from .hosts import HostedPool, HostLost
from .limits import Limits

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 30.0
"""How long a host has to close its pool before its actor is killed."""
REPLACE_ATTEMPTS = 60
"""Tries at starting a lost host's replacement (about 5 s apart once the first few fail): a node may come back."""
NOT_RAY = "rollout.kernel_backend = ray needs Ray >= 2.52 (pip install 'replrl[ray]')"


def import_ray() -> Any:
    """The ``ray`` module, or SandboxUnavailable in one line when it is missing or too old."""
    try:
        import ray
    except ImportError:
        raise SandboxUnavailable(f"{NOT_RAY}: ray is not installed") from None
    major, minor = (int(x) for x in ray.__version__.split(".")[:2])
    if (major, minor) < (2, 52):
        raise SandboxUnavailable(f"{NOT_RAY}: ray {ray.__version__} is installed")
    return ray


def node_report(limits_data: dict | None = None) -> dict:
    """What this node gives kernels (run on the node): its address, the isolation level ``limits`` resolves to,
    whether host files are hidden and the network is a namespace of the kernel's own, and the mechanisms
    ``replrl env`` lists. Plain data; never raises."""
    from .limits import SandboxUnavailable as Unavailable
    from .limits import hides_host_files

    limits = hp.limits_from_data(limits_data) if limits_data else Limits()
    out: dict[str, Any] = {"host": socket.gethostname(), "cpus": os.cpu_count() or 0}
    try:
        level = limits.resolve_isolation()
        from .report import mechanisms

        out.update(isolation=level, hides_host_files=hides_host_files(level),
                   network_namespace=level in ("bwrap", "unshare") and not limits.network,
                   mechanisms=[list(row) for row in mechanisms(limits)])
    except Unavailable as err:
        out.update(isolation=None, why=str(err)[:500])
    return out


class KernelHost:
    """The kernel host as a Ray actor (made with ``ray.remote`` by ``actor_class``): a ``HostCore`` on the actor's
    event loop. Its methods take and return plain data; replies are JSON bytes for the trainer to check."""

    def __init__(self) -> None:
        self.core = HostCore()
        self.limits: dict | None = None

    async def open(self, msg: dict) -> bytes:
        # Ray's threads block SIGINT (its main thread takes it), and a blocked mask is inherited by every process
        # started from them: a kernel's interrupt would never arrive, and every timeout would kill the kernel. The
        # kernels (and the zygote) are started from this thread, the actor's event loop: unblock it here.
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        self.limits = msg.get("limits")
        reply = await self.core.open(msg)
        reply["node"] = node_report(self.limits)
        return hp.encode_body(reply)

    async def handle(self, msg: dict) -> bytes:
        return hp.encode_body(await self.core.handle(msg))

    async def report(self) -> bytes:
        return hp.encode_body({"node": node_report(self.limits), "stats": self.core.stats()})

    async def close(self) -> None:
        await self.core.close()


_ACTOR: Any = None


def actor_class(ray: Any) -> Any:
    """``KernelHost`` as a Ray actor class (made once): an async actor (lines of many episodes at once), never
    restarted by Ray (the pool replaces a lost host itself, so a line is never run twice)."""
    global _ACTOR
    if _ACTOR is None:
        _ACTOR = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=4096)(KernelHost)
    return _ACTOR


def kernel_nodes(ray: Any, resource: str = "") -> list[dict]:
    """The live nodes that take kernel hosts: every live node, or those offering ``resource``."""
    return [n for n in ray.nodes() if n.get("Alive") and (not resource or n.get("Resources", {}).get(resource, 0) > 0)]


class _RayHost:
    """One ``KernelHost`` actor, from the trainer's side: the link ``HostedPool`` drives (``start``, ``call``,
    ``kill``, ``close``, ``lost``, ``in_use``, ``stats``, ``share``)."""

    def __init__(self, pool: RayPool, share: int, node_id: str | None):
        self.pool, self.share = pool, share
        self.node_id: str | None = node_id
        self.actor: Any = None
        self.in_use = 0
        self.stats: dict[str, int] = {}
        self.node: dict = {}
        self.lost: str | None = None
        self.calls: set[Any] = set()

    async def _await(self, ref: Any, timeout: float) -> dict:
        """The reply of one actor call, bounded and parsed as a frame: HostLost for Ray's errors, a missed
        deadline (the actor is killed then) or a reply that breaks the protocol."""
        ray = self.pool.ray
        fut = asyncio.wrap_future(ref.future())
        self.calls.add(fut)
        try:
            body = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self.kill(f"it did not answer within {timeout:.0f} s")
            raise HostLost(self.lost) from None
        except asyncio.CancelledError:
            if self.lost is not None:
                raise HostLost(self.lost) from None
            raise
        except ray.exceptions.RayError as err:
            self.kill(f"Ray: {type(err).__name__}: {_first_line(err)}")
            raise HostLost(self.lost) from None
        finally:
            self.calls.discard(fut)
        try:
            msg = hp.decode(body, hp.max_frame(self.pool.limits))
        except hp.ProtocolError as err:
            self.kill(f"it broke the protocol: {err}")
            raise HostLost(self.lost) from None
        self._take_stats(msg)
        return msg

    def _take_stats(self, msg: dict) -> None:
        stats = msg.get("stats")
        if isinstance(stats, dict):
            self.stats = {k: v for k, v in stats.items() if isinstance(v, int) and not isinstance(v, bool)}

    async def start(self) -> _RayHost:
        ray = self.pool.ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self.node_id is None:  # a replacement: wherever the cluster has room now
            self.node_id = await self.pool._pick_node()

        opts: dict[str, Any] = {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(
            self.node_id, soft=False)}
        if self.pool.resource:
            opts["resources"] = {self.pool.resource: self.pool.resource_amount}
        self.actor = actor_class(ray).options(**opts).remote()
        limits = hp.limits_to_data(self.pool.limits)
        msg = {"op": "open", "size": self.share, "limits": limits, "tools": list(self.pool.tools),
               "refill": self.pool.refill, "max_boots": self.pool.max_boots}
        try:
            first = await self._await(self.actor.open.remote(msg), self.pool.start_timeout_s)
        except HostLost as err:
            raise HostLost(f"it did not start on node {str(self.node_id)[:12]}: {err}") from None
        node = first.get("node")
        self.node = node if isinstance(node, dict) else {}
        if not first.get("ok"):
            self.kill(f"it did not start: {str(first.get('error'))[:500]}")
            raise HostLost(self.lost)
        self.pool._saw_node(self)
        return self

    async def call(self, msg: dict, timeout: float) -> dict:
        if self.lost is not None:
            raise HostLost(self.lost)
        return await self._await(self.actor.handle.remote(msg), timeout)

    def kill(self, why: str) -> None:
        """End the actor now (idempotent): its waiters fail with HostLost; the pool starts a replacement."""
        if self.lost is not None:
            return
        self.lost = why
        log.warning("kernel host on node %s lost: %s", str(self.node_id)[:12], why)
        if self.actor is not None:
            with contextlib.suppress(Exception):
                self.pool.ray.kill(self.actor, no_restart=True)
        for fut in list(self.calls):
            fut.cancel()
        self.pool._host_lost(self)

    async def close(self) -> None:
        if self.lost is None and self.actor is not None:
            self.lost = "closed"
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.wrap_future(self.actor.close.remote().future()), CLOSE_TIMEOUT_S)
        if self.actor is not None:
            with contextlib.suppress(Exception):
                self.pool.ray.kill(self.actor, no_restart=True)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else "")[:300]


class RayPool(HostedPool):
    """The pool protocol over ``KernelHost`` actors, one per node (see the module docstring).

    ``address``: the Ray cluster to join when Ray is not yet initialized in this process ("auto", "ray://...", a
    GCS address; None: ``RAY_ADDRESS`` or "auto"). ``kernels_per_node``: each host's kernels (0: ``size`` spread
    over the nodes). ``resource``: only nodes offering this custom resource take a host (``ray start
    --resources='{"replrl_kernels": 1}'``), each host taking ``resource_amount`` of it; empty: every live node.
    """

    def __init__(self, size: int = 4, limits: Limits | None = None, tools: Sequence[str] = (),
                 refill: str = "idle", max_boots: int | None = None, address: str | None = None,
                 kernels_per_node: int = 0, resource: str = "", resource_amount: float = 1.0,
                 start_timeout_s: float = 120.0):
        self.ray = import_ray()
        if size < 1 or kernels_per_node < 0:
            raise ValueError("RayPool size must be >= 1 and kernels_per_node >= 0")
        super().__init__(size=size, limits=limits, tools=tools, refill=refill, hosts=1)
        self.max_boots = max_boots  # type: ignore[assignment]  # None: each node's KernelPool sizes it by its CPUs
        self.address, self.kernels_per_node = address, kernels_per_node
        self.resource, self.resource_amount = resource, resource_amount
        self.start_timeout_s = start_timeout_s
        self.replace_attempts = REPLACE_ATTEMPTS
        self._owns_ray = False
        self._warned: set[str] = set()

    def _isolation(self) -> str:
        return "per node"  # each node resolves its own level (``nodes()``); this machine may have none

    def _connect(self) -> None:
        if not self.ray.is_initialized():
            self.ray.init(address=self.address or os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False,
                          logging_level=logging.WARNING, configure_logging=False)
            self._owns_ray = True

    async def start(self) -> RayPool:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._connect)
        nodes = await loop.run_in_executor(None, kernel_nodes, self.ray, self.resource)
        if not nodes:
            raise SandboxUnavailable("no live Ray node takes kernels" + (
                f" (none offers the resource {self.resource!r})" if self.resource else ""))
        self.n_hosts = len(nodes)
        if self.kernels_per_node:
            shares = [self.kernels_per_node] * len(nodes)
        else:
            base, extra = divmod(max(self.size, len(nodes)), len(nodes))
            shares = [base + (k < extra) for k in range(len(nodes))]
        self.size = sum(shares)
        hosts = [_RayHost(self, share, n["NodeID"]) for share, n in zip(shares, nodes, strict=True)]
        started = await asyncio.gather(*(h.start() for h in hosts), return_exceptions=True)
        self.hosts = [h for h in started if isinstance(h, _RayHost)]
        failed = [str(e) for e in started if not isinstance(e, _RayHost)]
        if failed:
            for err in failed:
                log.error("kernel host did not start: %s", err)
            if not self.hosts:
                raise SandboxUnavailable(f"no kernel host started on the Ray cluster: {failed[0]}")
        return self

    def _new_host(self, share: int, replacing: Any = None) -> Any:
        return _RayHost(self, share, None)

    async def _pick_node(self) -> str:
        """A live node that has none of this pool's live hosts (a lost host's own node too, if it is still live),
        else the live node with the fewest; HostLost when no node takes kernels."""
        nodes = await asyncio.get_running_loop().run_in_executor(None, kernel_nodes, self.ray, self.resource)
        if not nodes:
            raise HostLost("no live Ray node takes kernels")
        taken: dict[str, int] = {}
        for h in self.hosts:
            if h.lost is None:
                taken[h.node_id] = taken.get(h.node_id, 0) + 1
        return min(nodes, key=lambda n: taken.get(n["NodeID"], 0))["NodeID"]

    def _saw_node(self, host: _RayHost) -> None:
        node = host.node
        level = node.get("isolation")
        if level != "bwrap" and host.node_id not in self._warned:
            self._warned.add(host.node_id)
            log.warning("Ray node %s (%s) runs kernels at the %s level%s", str(host.node_id)[:12], node.get("host"),
                        level, "" if node.get("network_namespace") else
                        ": no network namespace, so model code can reach the node's network, Ray's ports included")

    def nodes(self) -> list[dict]:
        """One row per live host: its node, the node's sandbox report (level, mechanisms) and kernel counts."""
        return [{"node_id": h.node_id, **h.node, "kernels": h.share, **h.stats}
                for h in self.hosts if h.lost is None]

    async def close(self) -> None:
        await super().close()
        if self._owns_ray:
            await asyncio.get_running_loop().run_in_executor(None, self.ray.shutdown)
            self._owns_ray = False


def cluster_report(address: str | None = None, resource: str = "", limits: Limits | None = None,
                   timeout: float = 60.0) -> list[dict]:
    """For ``replrl env``: what each node that takes kernels gives them (``node_report`` run there by a task
    pinned to it). Joins the cluster at ``address`` if Ray is not initialized here, and leaves it after."""
    ray = import_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    owns = not ray.is_initialized()
    if owns:
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False,
                 logging_level=logging.WARNING, configure_logging=False)
    try:
        task = ray.remote(num_cpus=0, max_retries=0)(node_report)
        nodes = kernel_nodes(ray, resource)
        refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
            hp.limits_to_data(limits or Limits())) for n in nodes]
        rows = []
        for n, ref in zip(nodes, refs, strict=True):
            try:
                rows.append({"node_id": n["NodeID"], "address": n.get("NodeManagerAddress"),
                             **ray.get(ref, timeout=timeout)})
            except Exception as err:  # a node that cannot answer: say so, go on
                rows.append({"node_id": n["NodeID"], "address": n.get("NodeManagerAddress"), "isolation": None,
                             "why": f"{type(err).__name__}: {_first_line(err)}"})
        return rows
    finally:
        if owns:
            ray.shutdown()
