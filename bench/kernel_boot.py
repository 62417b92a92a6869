"""CPU-seconds and wall time to provide one fresh sandboxed kernel: today's boot (bwrap + python per kernel) and the
fork server (Limits.fork_server, sandbox/zygote.py), side by side in one run.

A kernel's CPU is that of every process involved: this host process (time.process_time: its event loop, zmq's
threads, Popen), and every descendant process (utime + stime + the children's times they reaped, read from
/proc/<pid>/stat) -- bwrap, the kernels, and for the fork server the zygote's share (its own time and its forked
helpers). Kernels are held alive until every one of a round has started, so no process's time is lost to an exit.
"Ready" adds the first line each kernel runs (what a rollout pays next: ipykernel imports some modules only then).
The zygote's own start, paid once per pool, is reported beside (``zygote_boot_cpu_s``).

    python bench/kernel_boot.py [--kernels 8] [--rounds 2]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

from sandbox import Limits
from sandbox import zygote as zygote_mod
from sandbox.kernel import KernelProcess, _exec_content

TICK = os.sysconf("SC_CLK_TCK")


def descendants_cpu(root: int) -> float:
    """CPU-seconds of every live descendant of ``root`` (with what each reaped of its own children)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = sum(int(x) for x in fields[11:15]) / TICK  # utime stime cutime cstime
    total = 0.0
    for pid, cpu in times.items():
        p = parents.get(pid)
        while p and p != root:
            p = parents.get(p)
        if p == root:
            total += cpu
    return total


def cpu_now() -> float:
    return time.process_time() + descendants_cpu(os.getpid())


async def one_round(limits: Limits, n: int) -> dict:
    kernels: list[KernelProcess] = []
    walls = []
    c0 = cpu_now()
    try:
        for _ in range(n):
            t = time.perf_counter()
            kernels.append(await KernelProcess(limits, "bwrap").start())
            walls.append(time.perf_counter() - t)
        c1 = cpu_now()
        for k in kernels:
            reply = await k.request("execute_request", _exec_content("1", op="run", mode="single"), 30.0)
            assert reply is not None and reply["content"]["replrl"]["output"] == "1\n", reply
        c2 = cpu_now()
    finally:
        for k in kernels:
            k.kill()
    return {"cpu_s": (c1 - c0) / n, "cpu_ready_s": (c2 - c0) / n, "wall_s": statistics.median(walls)}


async def main(n: int, rounds: int) -> dict:
    boot = Limits(fork_server=False)
    fork = Limits(fork_server=True)
    assert boot.resolve_isolation() == "bwrap", "this bench compares the bwrap level's two boots"
    if not zygote_mod.fork_server_usable("bwrap", fork):
        raise SystemExit("the fork server is not available here (needs bwrap and a root host)")
    held = zygote_mod.hold(fork)  # one zygote for the whole run, as a pool has
    try:
        c0 = cpu_now()
        t0 = time.perf_counter()
        await held.ensure()
        zygote_boot = {"cpu_s": cpu_now() - c0, "wall_s": time.perf_counter() - t0}
        await one_round(boot, 1)  # warm the page cache and this process for both
        await one_round(fork, 1)
        results: dict[str, list[dict]] = {"before": [], "after": []}
        for _ in range(rounds):
            results["before"].append(await one_round(boot, n))
            results["after"].append(await one_round(fork, n))
    finally:
        zygote_mod.release(held)

    def med(side: str, key: str) -> float:
        return statistics.median(r[key] for r in results[side])

    print(f"{'per fresh kernel':<34}{'boot (today)':>14}{'fork server':>14}{'ratio':>8}")
    for key, label in (("cpu_s", "CPU-s to start"), ("cpu_ready_s", "CPU-s to start + first line"),
                       ("wall_s", "wall s to start (median)")):
        b, a = med("before", key), med("after", key)
        print(f"{label:<34}{b:>14.3f}{a:>14.3f}{a / b:>8.2f}")
    print(f"zygote start (once per pool): {zygote_boot['cpu_s']:.3f} CPU-s, {zygote_boot['wall_s']:.2f} s wall")
    return {
        "kernels_per_round": n, "rounds": rounds,
        "cpu_s_per_kernel_before": round(med("before", "cpu_s"), 4),
        "cpu_s_per_kernel_after": round(med("after", "cpu_s"), 4),
        "cpu_ratio": round(med("after", "cpu_s") / med("before", "cpu_s"), 3),
        "cpu_ready_s_per_kernel_before": round(med("before", "cpu_ready_s"), 4),
        "cpu_ready_s_per_kernel_after": round(med("after", "cpu_ready_s"), 4),
        "wall_s_per_kernel_before": round(med("before", "wall_s"), 4),
        "wall_s_per_kernel_after": round(med("after", "wall_s"), 4),
        "zygote_boot_cpu_s": round(zygote_boot["cpu_s"], 3), "zygote_boot_wall_s": round(zygote_boot["wall_s"], 3),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", type=int, default=8, help="kernels started per round and side")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per side (the median is reported)")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(main(args.kernels, args.rounds))))
