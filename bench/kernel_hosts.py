"""Kernel traffic in the trainer's process against kernel hosts, side by side in one run (issue 65).

``--episodes`` concurrent episodes, each on its own kernel, run ``--lines`` small interactive lines each (the
rollout's traffic without a model: what the trainer's process pays per line for the kernels alone). Three sides,
interleaved over ``--rounds``: the in-process ``KernelPool``, and ``HostedPool`` with 1 and 2 kernel hosts. Each
side's kernels are acquired before the timed window and released after it, so the window holds lines only.

Per line: the trainer process's CPU (``time.process_time``), the kernel hosts' CPU (``/proc/PID/stat``), the
kernels' CPU (every process under the pool's kernel uids), the wall time of the whole window divided by lines.

    python bench/kernel_hosts.py [--episodes 32] [--lines 40] [--rounds 3]

Prints a table, then one JSON line: ``trainer_cpu_ms_per_line`` per side, ``trainer_cpu_ratio_hosts2`` (in-process /
2 hosts: how many times less the trainer pays), ``all_cpu_ratio_hosts2`` (all processes per line, 2 hosts /
in-process), ``line_ms_ratio_hosts2`` (wall per line, 2 hosts / in-process).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import time

from sandbox import KernelPool, Limits
from sandbox.hosts import HostedPool
from sandbox.launch import UID_SPAN

LINES = ["x = 21", "y = x * 2", "y", "for i in range(3):\n    y += i\n", "print(y)", "s = 'abc' * 3", "len(s)"]
TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def uid_cpu(base: int) -> float:
    """CPU seconds of every live process whose uid is one of a pool's kernel uids."""
    total = 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (OSError, StopIteration, ValueError):
            continue
        if base <= uid < base + UID_SPAN:
            total += proc_cpu(int(pid))
    return total


async def side(name: str, episodes: int, lines: int, base: int) -> dict:
    limits = Limits(wall_s=10.0, uid_base=base)
    pool = KernelPool(size=episodes, limits=limits) if name == "in-process" else \
        HostedPool(size=episodes, limits=limits, hosts=int(name.split()[0]))
    async with pool, contextlib.AsyncExitStack() as stack:
        await pool.wait_full(300)
        kernels = [await stack.enter_async_context(pool.acquire()) for _ in range(episodes)]
        for k in kernels:
            await k.execute("0", mode="single")
        hosts = [h.proc.pid for h in getattr(pool, "hosts", [])]
        c0, h0, k0, t0 = time.process_time(), sum(map(proc_cpu, hosts)), uid_cpu(base), time.perf_counter()

        async def episode(k):
            for i in range(lines):
                await k.execute(LINES[i % len(LINES)], mode="single")

        await asyncio.gather(*(episode(k) for k in kernels))
        wall = time.perf_counter() - t0
        n = episodes * lines
        fig = {"trainer_cpu_ms": (time.process_time() - c0) / n * 1e3,
               "hosts_cpu_ms": (sum(map(proc_cpu, hosts)) - h0) / n * 1e3,
               "kernels_cpu_ms": (uid_cpu(base) - k0) / n * 1e3, "line_ms": wall / n * 1e3}
    fig["all_cpu_ms"] = fig["trainer_cpu_ms"] + fig["hosts_cpu_ms"] + fig["kernels_cpu_ms"]
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--lines", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sides = ["in-process", "1 host", "2 hosts"]
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(args.rounds):
        for k, name in enumerate(sides if r % 2 == 0 else sides[::-1]):
            runs[name].append(asyncio.run(side(name, args.episodes, args.lines, 500_000 + 20_000 * k)))
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in runs[name][-1].items()),
                  flush=True)
    med = {s: {k: statistics.median(f[k] for f in runs[s]) for k in runs[s][0]} for s in sides}
    print(f"\n{'per line (median of rounds)':34}" + "".join(f"{s:>12}" for s in sides))
    for key in ("trainer_cpu_ms", "hosts_cpu_ms", "kernels_cpu_ms", "all_cpu_ms", "line_ms"):
        print(f"{key:34}" + "".join(f"{med[s][key]:12.3f}" for s in sides))
    print(json.dumps({
        "episodes": args.episodes, "lines": args.lines, "rounds": args.rounds, "load": os.getloadavg()[0],
        "trainer_cpu_ms_per_line": {s: round(med[s]["trainer_cpu_ms"], 4) for s in sides},
        "all_cpu_ms_per_line": {s: round(med[s]["all_cpu_ms"], 4) for s in sides},
        "trainer_cpu_ratio_hosts2": round(med["in-process"]["trainer_cpu_ms"] / med["2 hosts"]["trainer_cpu_ms"], 3),
        "all_cpu_ratio_hosts2": round(med["2 hosts"]["all_cpu_ms"] / med["in-process"]["all_cpu_ms"], 3),
        "line_ms_ratio_hosts2": round(med["2 hosts"]["line_ms"] / med["in-process"]["line_ms"], 3),
    }))


if __name__ == "__main__":
    main()
