"""Kernels on other machines (issue 67): kernel hosts as Ray actors on a two-node Ray mini-cluster on this machine
(``ray.cluster_utils.Cluster``, token authentication on). The pool gives what the local pool gives, line for line
over several kernels; the sandbox level a run checks is the nodes' (a Trainer starts without one here); a ``ray://``
address works as a GCS address does; a node removed mid-line ends that line as ``crashed`` within its deadline and
the episode goes on, its replacement asks Ray's autoscaler for room while it waits; no process is left after
shutdown. One cluster for the module (Ray's start is most of its time).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import socket
import time
from pathlib import Path

import pytest

# Token authentication on, with a token of this process's own (nothing written under ~/.ray): Ray reads the mode
# once, when it is imported, so it is set before the import, for this test process and the cluster it starts.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
ray = pytest.importorskip("ray", reason="kernels on Ray need the ray extra (pip install 'replrl[ray]')")

from replrl.cli.env import ray_lines  # noqa: E402
from replrl.config import RolloutConfig  # noqa: E402
from sandbox import KernelPool, Limits, run_sync  # noqa: E402
from sandbox.ray_hosts import RayPool  # noqa: E402
from tests.test_kernel_hosts import uids_running  # noqa: E402
from tests.test_soak import descendants  # noqa: E402  (its roots: Ray's processes)

pytestmark = pytest.mark.timeout(240)
LABEL = "replrl_kernels"
BASE = 460_000
"""The kernels' ``uid_base`` here (test_kernel_hosts uses 400,000-459,999)."""
LINES = ["x = 21", "x * 2", "for i in range(3):\n    print(i)\n", "1/0", "submit(x)", "print('é\\x00')",
         "import time; time.sleep(3)", "x"]
STORE = 78_643_200
ROOT = Path(__file__).resolve().parent.parent


def _children(pid: int) -> set[int]:
    found = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.update(int(c) for c in f.read().split())
    return found


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Mini:
    """The module's cluster: a head and one worker node, both offering one unit of ``LABEL``; token auth on."""

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        self.before = _children(os.getpid())  # (what this process had started before the cluster: not Ray's)
        self.cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=1, resources={LABEL: 1}, object_store_memory=STORE, include_dashboard=False))
        self.worker = self.cluster.add_node(num_cpus=1, resources={LABEL: 1}, object_store_memory=STORE)
        ray.init(address=self.cluster.address, log_to_driver=False)
        self.pids: set[int] = set()
        self.up = True

    def shutdown(self) -> None:
        if self.up:
            self.up = False
            # Ray's processes only: this test process has other descendants under pytest-xdist (the session pool's
            # kernels, other modules' fork servers), which this module does not own. Ray's are the children started
            # since the cluster was made whose command line names Ray, and everything under them.
            roots = {p for p in _children(os.getpid()) - self.before if b"ray" in _cmdline(p)}
            self.pids |= roots | descendants(roots)
            with contextlib.suppress(Exception):
                ray.shutdown()
            self.cluster.shutdown()


@pytest.fixture(scope="module")
def mini():
    m = Mini()
    try:
        yield m
    finally:
        m.shutdown()


def requested_room() -> list[dict]:
    """The bundles Ray's autoscaler is asked to make room for (``ray.autoscaler.sdk.request_resources``), read where
    Ray keeps them: the GCS's key-value store (autoscaler v1: this mini-cluster), or the GCS's cluster resource
    constraints (autoscaler v2: ``RAY_enable_autoscaler_v2=1``)."""
    from ray.autoscaler.v2.utils import is_autoscaler_v2
    from ray.experimental.internal_kv import internal_kv_get_gcs_client

    if is_autoscaler_v2():
        from ray.autoscaler.v2.sdk import get_cluster_resource_state

        state = get_cluster_resource_state(internal_kv_get_gcs_client())
        return [dict(r.request.resources_bundle) for c in state.cluster_resource_constraints
                for r in c.resource_requests for _ in range(r.count)]
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    return json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL) or b"[]")


def until(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.1)
    return check()


def local_results(limits: Limits) -> list[list]:
    async def go():
        async with KernelPool(size=2, limits=limits, tools=["submit"]) as pool:
            return await episodes(pool)

    return run_sync(go())


async def episodes(pool) -> list[list]:
    """Two episodes at once, each on its own kernel, the same lines (one shifted by one): what each line gave."""
    async def one(shift: int) -> list:
        async with pool.acquire() as k:
            return [await k.execute(code, mode="single", timeout=1.0) for code in LINES[shift:] + LINES[:shift]]

    return list(await asyncio.gather(one(0), one(1)))


def fields(r) -> tuple:
    return r.status, r.output, r.error_name, r.tool_calls, r.restarted, r.truncated


def test_kernels_on_two_ray_nodes_give_what_local_kernels_give(mini):
    limits = Limits(wall_s=5.0, uid_base=BASE)
    cfg = RolloutConfig(kernel_backend="ray", ray_resource=LABEL)
    pool = cfg.kernel_pool(2, ["submit"], limits)
    assert isinstance(pool, RayPool)

    gcs_host, gcs_port = mini.cluster.address.rsplit(":", 1)  # model code cannot reach Ray, nor read its token
    reach = (f"import socket\ntry:\n    socket.create_connection(({gcs_host!r}, {gcs_port}), timeout=2)\n"
             "    print('open')\nexcept OSError as e:\n    print('unreachable', type(e).__name__)\n")
    ray_env = "import os; sorted(k for k in os.environ if 'RAY' in k)"

    async def go():
        async with pool:
            nodes = pool.nodes()
            on_ray = await episodes(pool)
            async with pool.acquire() as k:
                probe = [await k.execute(reach), await k.execute(ray_env, mode="single")]
            return nodes, on_ray, probe

    nodes, on_ray, probe = run_sync(go())
    assert len({n["node_id"] for n in nodes}) == 2 and [n["kernels"] for n in nodes] == [1, 1]
    assert all(n["isolation"] == limits.resolve_isolation() for n in nodes)
    local = local_results(limits)
    for ep_local, ep_ray in zip(local, on_ray, strict=True):
        assert [fields(r) for r in ep_local] == [fields(r) for r in ep_ray]
    assert [r.status for r in on_ray[0]] == ["ok", "ok", "ok", "error", "ok", "ok", "timeout", "ok"]
    assert on_ray[0][5].output == "é\ufffd\n" and on_ray[0][4].tool_calls[0].args == [21]
    assert not uids_running(BASE)

    if limits.resolve_isolation() in ("bwrap", "unshare"):
        assert probe[0].output.startswith("unreachable"), probe[0]
    assert probe[1].output == "[]\n"

    lines = ray_lines(cfg)  # `replrl env` with rollout.kernel_backend = ray: one line per node
    assert len(lines) == 3 and "token authentication: token" in lines[0] and "2 node(s)" in lines[0]
    assert all(f"sandbox {limits.resolve_isolation()}" in line for line in lines[1:]), lines


@pytest.mark.timeout(600)  # the session's format model, where this test process has not made it yet: 1-3 minutes
def test_a_rollout_on_ray_kernels_gives_the_transcripts_of_local_kernels(mini, format_model_dir):
    """The one door (``open_env``, through ``replrl.api``) with ``rollout.kernel_backend = ray``: the same episodes,
    token for token, as with the local pool, the same seeds. (The tiny model taught to type ``submit(k)`` lines is
    the session's, which the suite's other modules make anyway; a random model's lines never end.)"""
    from replrl import api
    from replrl.config import Config
    from replrl.configlib import resolve

    def cfg(**rollout):
        return resolve(Config, None, {
            "model": {"name": str(format_model_dir), "chat_template": False},
            "task": {"name": "tests.toy:EchoTask"},
            "rollout": {"max_lines": 3, "max_line_tokens": 16, "max_total_tokens": 384, "wall_s": 2.0,
                        "temperature": 1.0, **rollout}})

    local = api.sample_episodes(str(format_model_dir), n=8, cfg=cfg(), group_size=4)
    on_ray = api.sample_episodes(str(format_model_dir), n=8, cfg=cfg(kernel_backend="ray", ray_resource=LABEL),
                                 group_size=4)
    assert [t.text for t in on_ray] == [t.text for t in local]
    assert [(t.token_ids, t.loss_mask, t.end_reason, t.reward) for t in on_ray] == \
           [(t.token_ids, t.loss_mask, t.end_reason, t.reward) for t in local]
    assert sum(len(t.lines) for t in local) >= 8 and any(t.submitted for t in local)  # lines ran in the kernels


def test_the_sandbox_level_of_ray_kernels_is_the_nodes_and_the_trainer_checks_it(mini, tmp_path, monkeypatch, caplog):
    """With rollout.kernel_backend = ray the level that matters is the kernel nodes': the weakest over the nodes that
    take kernels (``RolloutConfig.kernel_isolation``), so this machine needs no sandbox; no node with one is one line.
    The Trainer starts on it, its warning about a readable dataset names the nodes, environment.jsonl records them."""
    import logging

    import replrl.trainer as trainer_module
    from replrl.config import Config, ModelConfig, RunConfig, TaskConfig
    from sandbox.errors import SandboxUnavailable

    rollout = RolloutConfig(kernel_backend="ray", ray_resource=LABEL)
    level, nodes = rollout.kernel_isolation()
    ids = sorted([mini.cluster.head_node.node_id, mini.worker.node_id])
    assert level == Limits().resolve_isolation() and sorted(n["node_id"] for n in nodes) == ids, nodes
    for other, why in [(dict(isolation="rlimits"), "no Ray node that takes kernels has a sandbox (node "),
                       (dict(ray_resource="nobody"), "no live Ray node takes kernels (none offers the resource")]:
        with pytest.raises(SandboxUnavailable, match="^" + re.escape(why)) as err:
            RolloutConfig(**{"kernel_backend": "ray", "ray_resource": LABEL, **other}).kernel_isolation()
        assert "\n" not in str(err.value)

    def no_sandbox_here(self):
        raise SandboxUnavailable("no sandbox can start here")

    monkeypatch.setattr(Limits, "resolve_isolation", no_sandbox_here)  # this process's; the nodes' run in Ray workers
    monkeypatch.setattr(trainer_module, "hides_host_files", lambda level: False)  # as at the unshare level
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "What is 2 + 2?", "answer": "#### 4"}) + "\n")
    cfg = Config(model=ModelConfig(name="tiny"), task=TaskConfig(name="gsm8k", data=str(data)),
                 run=RunConfig(max_steps=1, eval_n=0), rollout=rollout)
    with caplog.at_level(logging.WARNING, logger="replrl.trainer"):
        trainer = trainer_module.Trainer(cfg, tmp_path / "run", progress=False)
    assert trainer.isolation == level and sorted(n["node_id"] for n in trainer.kernel_nodes) == ids
    warnings = [r.getMessage() for r in caplog.records if "dataset" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0] and str(data) in warnings[0], caplog.text
    assert all(i[:12] in warnings[0] for i in ids) and "can read files of those nodes" in warnings[0]
    record = json.loads((tmp_path / "run" / "environment.jsonl").read_text().splitlines()[-1])
    assert record["isolation"] == f"ray:{level}" and record["ray_nodes"] == dict.fromkeys(ids, level), record


CLIENT = """
import asyncio, json, sys
from replrl.config import RolloutConfig
from sandbox import Limits, run_sync

cfg = RolloutConfig(kernel_backend="ray", ray_address=sys.argv[1], ray_resource=sys.argv[2])
pool = cfg.kernel_pool(2, ["submit"], Limits(wall_s=5.0, uid_base=int(sys.argv[3])))

async def go():
    async with pool:  # joins the cluster at ray://... (and leaves it when it closes)
        async with pool.acquire() as k:
            lines = [(await k.execute(code, mode="single")).output for code in ("x = 6", "x * 7", "submit(x)")]
        level, nodes = await asyncio.get_running_loop().run_in_executor(None, cfg.kernel_isolation)
        await pool.request_room(2)
        print(json.dumps({"level": level, "nodes": sorted(n["node_id"] for n in nodes), "lines": lines,
                          "hosts": sorted(n["node_id"] for n in pool.nodes()), "requested": pool.requested}),
              flush=True)
        sys.stdin.readline()  # the test reads the autoscaler's request where Ray keeps it, then lets the pool close

run_sync(go())
"""


def test_a_ray_client_address_runs_kernels_as_a_gcs_address_does(mini, tmp_path):
    """rollout.ray_address = "ray://HOST:PORT" (Ray Client): Ray's calls go through a client server on the cluster,
    the lines over each host's own TCP connection as with a GCS address. The client server here is started by hand on
    the module's cluster (``--mode=legacy``: one server for its clients; ``ray start --head --ray-client-server-port``
    starts a proxy that forks one per client, which failed now and then on this machine: docs/ray.md). The client
    runs in a process of its own (this one is a driver already)."""
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    server = subprocess.Popen([sys.executable, "-m", "ray.util.client.server", f"--address={mini.cluster.address}",
                               "--host=127.0.0.1", f"--port={port}", "--mode=legacy"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client, log = None, (tmp_path / "client.err").open("w")
    try:
        assert until(lambda: _listening(port) or server.poll() is not None, 60.0) and server.poll() is None
        client = subprocess.Popen([sys.executable, "-c", CLIENT, f"ray://127.0.0.1:{port}", LABEL, str(BASE + 20_000)],
                                  env=env, cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=log, text=True)
        first = client.stdout.readline()  # (the test's own timeout bounds it)
        held = requested_room()
        client.communicate("close\n", timeout=60)
    finally:
        for proc in (client, server):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
                proc.kill()
        log.close()
    err = (tmp_path / "client.err").read_text()
    assert client.returncode == 0 and first, err[-3000:]
    out = json.loads(first)
    ids = sorted([mini.cluster.head_node.node_id, mini.worker.node_id])
    assert out["level"] == Limits().resolve_isolation() and out["nodes"] == ids and out["hosts"] == ids, out
    assert out["lines"] == ["", "42\n", ""] and out["requested"] == 2, (out, err[-2000:])
    assert held == [{LABEL: 1.0}] * 2 and requested_room() == [], (held, requested_room())  # made, then withdrawn
    assert until(lambda: not uids_running(BASE + 20_000), 10.0)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_node_removed_mid_line_ends_that_line_as_a_crash_and_the_episode_goes_on(mini):
    limits = Limits(wall_s=20.0, interrupt_grace_s=1.0, uid_base=BASE + 10_000)
    worker_id = mini.worker.node_id

    pool = run_sync(RayPool(size=2, limits=limits, resource=LABEL, start_timeout_s=60.0).start())

    async def lose_a_node():
        async with pool.acquire() as a, pool.acquire() as b:
            k = a if a.host.node_id == worker_id else b
            assert k.host.node_id == worker_id
            assert (await k.execute("x = 1")).status == "ok"
            t0 = time.monotonic()
            line = asyncio.ensure_future(k.execute("import time; time.sleep(15); print('slept')"))
            await asyncio.sleep(1.0)
            await asyncio.get_running_loop().run_in_executor(None, mini.cluster.remove_node, mini.worker)
            crashed = await line
            took = time.monotonic() - t0
            return crashed, took, await k.execute("print('after')"), pool.hosts_lost

    async def replaced() -> list:
        deadline = time.monotonic() + 60
        while len([h for h in pool.hosts if h.lost is None]) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        return sorted(h.node_id for h in pool.hosts if h.lost is None)

    try:
        crashed, took, after, lost = run_sync(lose_a_node())
        # the head's one unit of LABEL is taken: the replacement waits for room, and asks Ray's autoscaler for it (a
        # bundle for each of the pool's 2 hosts); a node that joins has it, and the request is withdrawn
        t0 = time.monotonic()
        asked = until(lambda: requested_room() == [{LABEL: 1.0}] * 2, 20.0)
        asked_s = time.monotonic() - t0
        new_node = mini.cluster.add_node(num_cpus=1, resources={LABEL: 1}, object_store_memory=STORE).node_id
        placed = run_sync(replaced())
        withdrawn = until(lambda: requested_room() == [], 10.0)
        run_sync(pool.request_room(2))  # a request the pool still holds when it closes is withdrawn by its close
        held = requested_room()
    finally:
        run_sync(pool.close())
    assert asked, (requested_room(), asked_s)
    assert withdrawn and held == [{LABEL: 1.0}] * 2 and requested_room() == [], (held, requested_room())
    assert crashed.status == "crashed" and crashed.restarted and "kernel host was lost" in crashed.limit, crashed
    assert took < 15.0, took  # Ray's word on the dead actor, not the line's end nor its deadline (36 s)
    assert after.status == "ok" and after.output == "after\n"  # a fresh kernel on the node that is left
    assert lost == 1 and ("ActorDiedError" in crashed.limit or "it exited" in crashed.limit), crashed.limit
    assert new_node in placed and worker_id not in placed and len(placed) == 2, placed
    deadline = time.monotonic() + 10
    while uids_running(BASE + 10_000) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not uids_running(BASE + 10_000)  # the lost node's kernels died with their host


def test_no_process_is_left_after_shutdown(mini):
    mini.shutdown()
    deadline = time.monotonic() + 15
    while any(map(alive, mini.pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in mini.pids if alive(pid)]
    assert mini.pids and not left, left
    assert not uids_running(BASE) and not uids_running(BASE + 10_000)
