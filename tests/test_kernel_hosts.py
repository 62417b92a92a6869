"""Kernel hosts (issue 65): a pool whose kernels live in other processes gives the same results as the in-process
pool, holds every check of a kernel's bytes across the boundary, and turns a lost host into crashed lines, never a
hang; nothing is left after close.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from sandbox import KernelPool, Limits, run_sync
from sandbox.hosts import HostedPool
from sandbox.launch import UID_SPAN
from tests.test_sandbox_wire import FLOOD, SHARED_FRAMES, forge

LINES = ["x = 21", "x * 2", "for i in range(3):\n    print(i)\n", "1/0", "submit(x)", "print('é\\x00')",
         "import time; time.sleep(3)"]


BASES = (400_000, 420_000, 440_000)
"""Each test's ``uid_base``, UID_SPAN apart and far from other modules' (tests run in two processes at once)."""


def uids_running(base: int) -> list[int]:
    """Pids of processes whose uid is one a pool with ``uid_base`` base gives its kernels and fork servers."""
    lo, hi = base, base + UID_SPAN
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if lo <= uid < hi:
            found.append(int(pid))
    return found


def results(pool_cls, limits: Limits, **kw):
    async def go():
        async with pool_cls(size=2, limits=limits, tools=["submit"], **kw) as pool:
            async with pool.acquire() as k:
                return [await k.execute(code, mode="single", timeout=1.0) for code in LINES]

    return run_sync(go())


def test_a_hosted_pool_gives_what_the_in_process_pool_gives():
    limits = Limits(wall_s=5.0, uid_base=BASES[0])
    local, hosted = results(KernelPool, limits), results(HostedPool, limits, hosts=2)
    for a, b in zip(local, hosted, strict=True):
        assert (a.status, a.output, a.error_name, a.tool_calls, a.restarted) == \
               (b.status, b.output, b.error_name, b.tool_calls, b.restarted)
    assert [r.status for r in hosted] == ["ok", "ok", "ok", "error", "ok", "ok", "timeout"]
    assert hosted[5].output == "é\ufffd\n" and hosted[4].tool_calls[0].args == [21]
    assert not uids_running(BASES[0])


def test_the_checks_on_a_kernels_bytes_hold_across_the_host():
    """A forged reply, a message of shared frames and a flood, one after the other in one episode on a host: each
    ends its line as a crash that says why, and the next line runs on a fresh kernel."""
    attacks = [(forge("[1, 2]"), "malformed reply"), (SHARED_FRAMES, "16 frames"), (FLOOD, "answer nothing")]

    async def go():
        async with HostedPool(size=2, limits=Limits(wall_s=10.0, uid_base=BASES[1]), hosts=1) as pool:
            async with pool.acquire() as k:
                return [(await k.execute(attack), await k.execute("print('after')")) for attack, _ in attacks]

    for (_, words), (result, after) in zip(attacks, run_sync(go()), strict=True):
        assert result.status == "crashed" and result.restarted and words in (result.limit or ""), result
        assert after.output == "after\n"


def test_a_host_killed_mid_line_ends_that_line_as_a_crash_and_the_episode_goes_on():
    async def go():
        async with HostedPool(size=2, limits=Limits(wall_s=30.0, uid_base=BASES[2]), hosts=2) as pool:
            async with pool.acquire() as k:
                await k.execute("x = 1")
                victim = k.host.proc
                asyncio.get_running_loop().call_later(0.5, os.kill, victim.pid, signal.SIGKILL)
                t0 = time.perf_counter()
                lost = await k.execute("import time; time.sleep(20)")
                took = time.perf_counter() - t0
                after = await k.execute("print(x if 'x' in dir() else 'fresh')")
            for _ in range(100):  # the pool replaces the host
                if pool.hosts_lost == 1 and all(h.lost is None for h in pool.hosts):
                    break
                await asyncio.sleep(0.1)
            replaced = all(h.lost is None and h.proc.pid != victim.pid for h in pool.hosts)
            async with pool.acquire() as k2:
                again = await k2.execute("print(6 * 7)")
            return lost, took, after, replaced, again

    lost, took, after, replaced, again = run_sync(go())
    assert lost.status == "crashed" and lost.restarted and "kernel host was lost" in lost.limit, lost
    assert took < 5.0, f"the lost host held the line {took:.1f} s"
    assert after.output == "fresh\n"
    assert replaced and again.output == "42\n"
    deadline = time.time() + 10
    while uids_running(BASES[2]) and time.time() < deadline:  # the dead host's kernels die with it
        time.sleep(0.2)
    assert not uids_running(BASES[2])
