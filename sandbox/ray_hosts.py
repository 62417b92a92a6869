"""Kernels on other machines: kernel hosts as Ray actors, one per node, behind the pool protocol (docs/ray.md).

``RayPool`` is ``HostedPool`` (``hosts.py``: leases, a lost host's lines as ``crashed`` results, replacements, the
deadlines and the trainer-side checks of every frame) with hosts elsewhere: on each node that takes kernels a
``KernelHost`` Ray actor, pinned there, starts the kernel-host process (``python -m sandbox.host_main --listen``:
the same ``HostCore`` over an unchanged ``KernelPool``: zygote, bwrap, seccomp, cgroups, budgets) on a TCP port of
the node's address. The trainer connects once, presents a secret it handed the actor through Ray (the first frame;
any other connection is dropped), and speaks ``host_protocol.py`` to it: a line is one frame each way, read with
the same bounds and checks as a local host's, never an actor call (Ray's call path cost 1-3 ms a line on a loaded
2-core machine; docs/ray.md). Ray places the actors, reports their death (a pending ``wait`` call fails when the
actor or its node is lost), and kills them; the host process dies with its actor, its kernels with it. An actor or
node lost mid-line ends that line as ``crashed`` with Ray's reason, and the pool starts a new host on a node with
room.

Ray is imported when a ``RayPool`` is made (the ``ray`` extra: ``pip install 'replrl[ray]'``); nothing else of
replrl or ``sandbox`` needs it. Only the kernels' hosts run under Ray; the trainer stays on accelerate/torchrun.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import sys
from collections.abc import Sequence
from typing import Any

from . import host_protocol as hp
from .errors import SandboxUnavailable
from .hosts import _PACKAGE_ROOT, HostedPool, HostLost, _Host
from .limits import Limits

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0
"""How long the trainer has to connect to a host's port."""
CLOSE_TIMEOUT_S = 30.0
"""How long a host has to close its pool before its actor is killed."""
RAY_CALL_TIMEOUT_S = 30.0
"""How long one of Ray's own blocking calls (listing the nodes) may take."""
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
    """The kernel host's Ray actor (made with ``ray.remote`` by ``actor_class``): it places and holds a kernel-host
    process on its node. ``listen`` opens a TCP port on the node's address and starts ``python -m
    sandbox.host_main --listen`` on it (the process host's own loop over a ``HostCore``: an unchanged
    ``KernelPool``), which serves the first connection that presents the pool's secret and closes the port. So a
    line costs one frame each way, as with a local host, not an actor call; the host process dies with the actor
    (``PR_SET_PDEATHSIG``), and its kernels with it."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self.limits: dict | None = None

    async def listen(self, secret: str, limits: dict) -> list:
        import ray

        self.limits = limits
        address = ray.util.get_node_ip_address()
        listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((address, 0))
            listener.listen(4)
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT, *filter(None, [env.get("PYTHONPATH")])])
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "sandbox.host_main", "--listen", str(listener.fileno()),
                pass_fds=[listener.fileno()], env=env, stdin=asyncio.subprocess.PIPE)
            assert self.proc.stdin is not None
            self.proc.stdin.write(secret.encode() + b"\n")
            await self.proc.stdin.drain()
            self.proc.stdin.close()
            return [address, listener.getsockname()[1]]
        finally:
            listener.close()

    async def report(self) -> dict:
        return node_report(self.limits)

    async def wait(self) -> int | None:
        """Returns when the host process has exited (after the trainer's ``close``); fails if the actor dies."""
        return None if self.proc is None else await self.proc.wait()


_ACTOR: Any = None


def actor_class(ray: Any) -> Any:
    """``KernelHost`` as a Ray actor class (made once): async, never restarted by Ray (the pool replaces a lost
    host itself, so a line is never run twice)."""
    global _ACTOR
    if _ACTOR is None:
        _ACTOR = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=4)(KernelHost)
    return _ACTOR


def join(ray: Any, address: str | None) -> None:
    """Join the Ray cluster at ``address`` as a driver ("auto", "HOST:PORT", or "ray://HOST:PORT" through a Ray Client
    server; None: ``RAY_ADDRESS``, else "auto"); SandboxUnavailable in one line when it cannot."""
    where = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=where, log_to_driver=False, logging_level=logging.WARNING, configure_logging=False)
    except Exception as err:  # Ray's: ConnectionError, or a client server's traceback as text
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        gist = " ".join(lines[:1] + lines[-1:] if len(lines) > 1 and lines[0].endswith(":") else lines[:1])[:500]
        raise SandboxUnavailable(f"cannot join the Ray cluster at {where}: {type(err).__name__}: {gist}") from None


def kernel_nodes(ray: Any, resource: str = "") -> list[dict]:
    """The live nodes that take kernel hosts: every live node, or those offering ``resource``."""
    return [n for n in ray.nodes() if n.get("Alive") and (not resource or n.get("Resources", {}).get(resource, 0) > 0)]


class _RayHost(_Host):
    """One ``KernelHost`` actor, from the trainer's side: ``hosts._Host`` (the protocol, the deadlines, the checks
    of every frame) over a TCP connection to the actor; the actor's life is Ray's (``ray.kill``; a pending ``wait``
    call says when Ray finds it dead, its node included)."""

    def __init__(self, pool: RayPool, share: int, node_id: str | None):
        super().__init__(pool, share)
        self.ray = pool.ray
        self.node_id: str | None = node_id
        self.node: dict = {}
        self.actor: Any = None
        self._watch: asyncio.Future | None = None

    def _name(self) -> str:
        return f"on Ray node {str(self.node_id)[:12]}"

    async def _ray(self, ref: Any, timeout: float) -> Any:
        try:
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout)
        except asyncio.TimeoutError:
            raise HostLost(f"its actor did not answer within {timeout:.0f} s") from None
        except self.ray.exceptions.RayError as err:
            raise HostLost(f"Ray: {type(err).__name__}: {_first_line(err)}") from None

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        pool: RayPool = self.pool  # type: ignore[assignment]
        if self.node_id is None:  # a replacement: wherever the cluster has room now
            self.node_id = await pool._pick_node()
        opts: dict[str, Any] = {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(
            self.node_id, soft=False)}
        if pool.resource:
            opts["resources"] = {pool.resource: pool.resource_amount}
        self.actor = actor_class(self.ray).options(**opts).remote()
        secret = secrets.token_hex(32)
        try:
            address, port = await self._ray(self.actor.listen.remote(secret, hp.limits_to_data(pool.limits)),
                                            pool.start_timeout_s)
            self.node = await self._ray(self.actor.report.remote(), pool.start_timeout_s)
            reader, writer = await asyncio.wait_for(asyncio.open_connection(str(address), int(port), limit=2**16),
                                                    HELLO_TIMEOUT_S)
        except (HostLost, OSError, asyncio.TimeoutError, TypeError, ValueError) as err:
            self._stop()
            raise HostLost(f"it did not start on node {str(self.node_id)[:12]}: {err}") from None
        except BaseException:  # cancelled (the pool closing): no actor left pending or running
            self._stop()
            raise
        writer.write(hp.encode({"secret": secret}))
        self._watch = asyncio.ensure_future(self._watch_actor())
        pool._saw_node(self)
        return reader, writer

    async def _watch_actor(self) -> None:
        """Kill the link as soon as Ray finds the actor dead (its node lost, or killed)."""
        try:
            code = await asyncio.wrap_future(self.actor.wait.remote().future())
        except asyncio.CancelledError:
            return
        except Exception as err:
            self.kill(f"Ray: {type(err).__name__}: {_first_line(err)}")
        else:  # the host process ended (a no-op when the pool asked it to: the link is "closed" then)
            self.kill(f"its host process exited ({code})")

    def _stop(self) -> None:
        if self._watch is not None and self._watch is not asyncio.current_task():
            self._watch.cancel()
        if self.actor is not None:
            with contextlib.suppress(Exception):
                self.ray.kill(self.actor, no_restart=True)

    async def _wait_closed(self) -> None:
        """The host closes its pool when asked; then the actor goes (killed after ``CLOSE_TIMEOUT_S`` at most)."""
        try:
            if self._watch is not None:
                with contextlib.suppress(Exception):  # a timeout, or Ray's word that the actor is gone
                    await asyncio.wait_for(self._watch, CLOSE_TIMEOUT_S)
        finally:
            self._stop()


def _request_resources(bundles: list[dict]) -> None:
    """``ray.autoscaler.sdk.request_resources(bundles=...)``, from a Ray Client too: there this process has no GCS
    client of its own (the call fails: "GCS client is not available"), so a task on the cluster makes it."""
    import ray
    from ray.autoscaler.sdk import request_resources
    from ray.util.client import ray as client

    if client.is_connected():
        ray.get(ray.remote(num_cpus=0, max_retries=0)(_request_resources).remote(bundles), timeout=RAY_CALL_TIMEOUT_S)
    else:
        request_resources(bundles=bundles)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else "")[:300]


class RayPool(HostedPool):
    """The pool protocol over ``KernelHost`` actors, one per node (see the module docstring).

    ``address``: the Ray cluster to join when Ray is not yet initialized in this process ("auto", "ray://...", a
    GCS address; None: ``RAY_ADDRESS`` or "auto"). ``kernels_per_node``: each host's kernels (0: ``size`` spread
    over the nodes). ``resource``: only nodes offering this custom resource take a host (``ray start
    --resources='{"replrl_kernels": 1}'``), each host taking ``resource_amount`` of it; empty: every live node. A
    lost host's replacement that finds no node with room asks Ray's autoscaler for it (``request_room``).
    """

    def __init__(self, size: int = 4, limits: Limits | None = None, tools: Sequence[str] = (),
                 refill: str = "idle", max_boots: int | None = None, address: str | None = None,
                 kernels_per_node: int = 0, resource: str = "", resource_amount: float = 1.0,
                 start_timeout_s: float = 120.0, post: Any = None):
        self.ray = import_ray()
        if size < 1 or kernels_per_node < 0:
            raise ValueError("RayPool size must be >= 1 and kernels_per_node >= 0")
        # post: as HostedPool's (a host on a node where its files are missing runs without it: the trainer tokenizes)
        super().__init__(size=size, limits=limits, tools=tools, refill=refill, hosts=1, post=post)
        self.max_boots = max_boots  # type: ignore[assignment]  # None: each node's KernelPool sizes it by its CPUs
        self.address, self.kernels_per_node = address, kernels_per_node
        self.resource, self.resource_amount = resource, resource_amount
        self.start_timeout_s = start_timeout_s
        self.replace_attempts = REPLACE_ATTEMPTS
        self.requested = 0
        """Kernel hosts this pool has asked Ray's autoscaler room for (``request_room``; 0: no request of its own)."""
        self._owns_ray = False
        self._warned: set[str] = set()
        self._request_failed = False

    def _isolation(self) -> str:
        return "per node"  # each node resolves its own level (``nodes()``); this machine may have none

    def _connect(self) -> None:
        if not self.ray.is_initialized():
            join(self.ray, self.address)
            self._owns_ray = True

    async def start(self) -> RayPool:
        loop = asyncio.get_running_loop()
        try:  # Ray's own calls block: each in a thread, each with a deadline
            await asyncio.wait_for(loop.run_in_executor(None, self._connect), self.start_timeout_s)
            nodes = await asyncio.wait_for(loop.run_in_executor(None, kernel_nodes, self.ray, self.resource),
                                           RAY_CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise SandboxUnavailable(f"the Ray cluster at {self.address or 'auto'} did not answer in time") from None
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

    def _new_host(self, share: int) -> _Host:
        return _RayHost(self, share, None)  # placed when it starts: where the cluster has room then

    async def _pick_node(self) -> str:
        """The live node with the most room for a new host: with ``resource``, one whose units are not all taken by
        this pool's live hosts; without, one with none of them, else the one with the fewest. HostLost when no node
        has room (the pool tries again a little later: a node may join or come back)."""
        try:
            nodes = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                None, kernel_nodes, self.ray, self.resource), RAY_CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise HostLost(f"Ray did not list its nodes within {RAY_CALL_TIMEOUT_S:.0f} s") from None
        taken: dict[str, int] = {}
        for h in self.hosts:
            if h.lost is None:
                taken[h.node_id] = taken.get(h.node_id, 0) + 1

        def room(n: dict) -> float:
            if self.resource:
                return n["Resources"][self.resource] - taken.get(n["NodeID"], 0) * self.resource_amount
            return -taken.get(n["NodeID"], 0)

        fits = [n for n in nodes if not self.resource or room(n) >= self.resource_amount]
        if not fits:
            await self.request_room(len(self.hosts))  # a node the autoscaler adds (or one that comes back) takes it
            raise HostLost("no live Ray node has room for a kernel host" + (
                f" (none offers a free {self.resource!r})" if self.resource else ""))
        return max(fits, key=room)["NodeID"]

    async def request_room(self, hosts: int) -> None:
        """Ask Ray's autoscaler for room for ``hosts`` of this pool's kernel hosts, one bundle of ``resource`` each
        (``ray.autoscaler.sdk.request_resources``: the cluster is to fit them all, the hosts already placed
        included; 0 withdraws the request). Only with ``resource``: without, every live node takes a host. A hint
        the cluster keeps until the next request, anyone's (the GCS's key-value store, or with autoscaler v2 its
        resource constraint), which a cluster without an autoscaler never reads; made again at each try of a
        waiting replacement (another pool's request replaces it); a failure is logged once, never raised."""
        if not self.resource or not hosts and not self.requested:
            return
        try:
            await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                None, _request_resources, [{self.resource: self.resource_amount}] * hosts), RAY_CALL_TIMEOUT_S)
            self.requested = hosts
        except Exception as err:  # a timeout, or Ray's: the request is a hint, the replacement goes on without it
            if not self._request_failed:
                self._request_failed = True
                log.warning("Ray's autoscaler could not be asked for room for %d kernel host(s): %s: %s", hosts,
                            type(err).__name__, _first_line(err))

    async def _replace(self, old: _Host) -> None:
        try:
            await super()._replace(old)
        finally:  # placed, or given up: the autoscaler's request is withdrawn once no other replacement waits
            if not self._closed and not any(t is not asyncio.current_task() and not t.done()
                                            for t in self._replacing):
                await self.request_room(0)

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
        await self.request_room(0)
        if self._owns_ray:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, self.ray.shutdown),
                                       CLOSE_TIMEOUT_S)
            self._owns_ray = False


def cluster_report(address: str | None = None, resource: str = "", limits: Limits | None = None,
                   timeout: float = 60.0) -> list[dict]:
    """For ``replrl env``: what each node that takes kernels gives them (``node_report`` run there by a task
    pinned to it). Joins the cluster at ``address`` if Ray is not initialized here, and leaves it after."""
    ray = import_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    owns = not ray.is_initialized()
    if owns:
        join(ray, address)
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


def cluster_isolation(address: str | None = None, resource: str = "", limits: Limits | None = None,
                      timeout: float = 60.0) -> tuple[str, list[dict]]:
    """The sandbox level kernels get on the Ray cluster: the weakest over the nodes that take kernels
    (``cluster_report``'s rows), and those nodes' rows. A node without any sandbox is left out, as ``RayPool`` leaves
    it out (its host cannot start), and logged; SandboxUnavailable in one line when no node takes kernels or none of
    them has a sandbox."""
    from .limits import LEVELS

    rows = cluster_report(address, resource, limits, timeout)
    able = [r for r in rows if r.get("isolation") in LEVELS]
    for r in rows:
        if r not in able:
            log.warning("Ray node %s (%s) has no sandbox, so it takes no kernels: %s", str(r["node_id"])[:12],
                        r.get("address"), r.get("why"))
    if not rows:
        raise SandboxUnavailable("no live Ray node takes kernels" + (
            f" (none offers the resource {resource!r})" if resource else ""))
    if not able:
        raise SandboxUnavailable(f"no Ray node that takes kernels has a sandbox (node {str(rows[0]['node_id'])[:12]}: "
                                 f"{rows[0].get('why')})")
    return max((r["isolation"] for r in able), key=LEVELS.index), able
