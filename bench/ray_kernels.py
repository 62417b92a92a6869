"""Kernels through Ray against the local pool, side by side in one run (issue 67).

Three sides, interleaved over ``--rounds``: the local ``KernelPool`` (kernels in this process), ``HostedPool`` with
one local kernel-host process (the same host over a unix socket: how much of Ray's figure is the host's hop), and
``RayPool`` (a ``KernelHost`` Ray actor on this machine's one Ray node, its host over loopback TCP, token
authentication on), each with the same ``Limits``. Per side and round:

- **latency**: one episode runs ``--latency-lines`` small interactive lines one after the other; a line's round
  trip from ``execute`` to its result. ``added_ms`` is Ray's median minus the local median (``added_ms_vs_host``:
  minus the local host's).
- **lines/s**: ``--episodes`` episodes at once, each on its own kernel, ``--lines`` lines each; lines over the
  window's wall time (kernels acquired before the window, released after it).
- **fresh kernels/s**: ``--fresh`` episodes, ``--episodes`` at a time, each acquiring a fresh kernel, running one
  line and releasing it, with ``refill = eager`` on a pool of ``--episodes`` kernels: episodes over wall time.

    python bench/ray_kernels.py [--episodes 8] [--lines 20] [--latency-lines 200] [--fresh 48] [--rounds 3]

Prints each round, then one JSON line: the medians per side, ``added_ms`` (target <= 1), ``lines_ratio`` (Ray /
local, target >= 0.8), ``fresh_ratio`` (Ray / local, target >= 0.9) and the load average (lowest, highest).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import statistics
import time

LINES = ["x = 21", "y = x * 2", "y", "for i in range(3):\n    y += i\n", "print(y)", "s = 'abc' * 3", "len(s)"]


def make_pool(side: str, size: int, base: int, refill: str = "idle"):
    from sandbox import KernelPool, Limits
    from sandbox.hosts import HostedPool
    from sandbox.ray_hosts import RayPool

    limits = Limits(wall_s=10.0, uid_base=base)
    if side == "local":
        return KernelPool(size=size, limits=limits, refill=refill)  # type: ignore[arg-type]
    if side == "host":
        return HostedPool(size=size, limits=limits, refill=refill, hosts=1)
    return RayPool(size=size, limits=limits, refill=refill)


async def latency(side: str, n: int, base: int) -> list[float]:
    async with make_pool(side, 1, base) as pool, pool.acquire() as k:
        await k.execute("0", mode="single")
        out = []
        for i in range(n):
            t0 = time.perf_counter()
            await k.execute(LINES[i % len(LINES)], mode="single")
            out.append((time.perf_counter() - t0) * 1e3)
        return out


async def throughput(side: str, episodes: int, lines: int, base: int) -> float:
    pool = make_pool(side, episodes, base)
    async with pool, contextlib.AsyncExitStack() as stack:
        await pool.wait_full(300)
        kernels = [await stack.enter_async_context(pool.acquire()) for _ in range(episodes)]
        for k in kernels:
            await k.execute("0", mode="single")
        t0 = time.perf_counter()

        async def episode(k):
            for i in range(lines):
                await k.execute(LINES[i % len(LINES)], mode="single")

        await asyncio.gather(*(episode(k) for k in kernels))
        return episodes * lines / (time.perf_counter() - t0)


async def fresh(side: str, episodes: int, total: int, base: int) -> float:
    pool = make_pool(side, episodes, base, refill="eager")
    async with pool:
        await pool.wait_full(300)
        todo = list(range(total))
        t0 = time.perf_counter()

        async def worker():
            while todo:
                todo.pop()
                async with pool.acquire() as k:
                    await k.execute("1 + 1", mode="single")

        await asyncio.gather(*(worker() for _ in range(episodes)))
        return total / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--lines", type=int, default=20)
    ap.add_argument("--latency-lines", type=int, default=200)
    ap.add_argument("--fresh", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--object-store-mb", type=int, default=80)
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # read once, when Ray is imported
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
    import ray

    from sandbox import run_sync

    ray.init(num_cpus=os.cpu_count(), object_store_memory=args.object_store_mb * 2**20, include_dashboard=False,
             log_to_driver=False)
    sides = ["local", "host", "ray"]
    figs: dict[str, dict[str, list[float]]] = {s: {"line_ms": [], "lines_per_s": [], "fresh_per_s": []} for s in sides}
    loads = [os.getloadavg()[0]]
    try:
        for r in range(args.rounds):
            for side in (sides if r % 2 == 0 else sides[::-1]):
                base = 700_000 + 40_000 * sides.index(side)
                lat = run_sync(latency(side, args.latency_lines, base))
                lps = run_sync(throughput(side, args.episodes, args.lines, base + 10_000))
                fps = run_sync(fresh(side, args.episodes, args.fresh, base + 20_000))
                figs[side]["line_ms"].append(statistics.median(lat))
                figs[side]["lines_per_s"].append(lps)
                figs[side]["fresh_per_s"].append(fps)
                loads.append(os.getloadavg()[0])
                print(f"round {r + 1} {side:5}: line {statistics.median(lat):.3f} ms median "
                      f"(p90 {statistics.quantiles(lat, n=10)[-1]:.3f}), {lps:.1f} lines/s, "
                      f"{fps:.2f} fresh kernels/s, load {loads[-1]:.1f}", flush=True)
    finally:
        ray.shutdown()
    med = {s: {k: statistics.median(v) for k, v in figs[s].items()} for s in sides}
    print(json.dumps({
        "episodes": args.episodes, "lines": args.lines, "latency_lines": args.latency_lines, "fresh": args.fresh,
        "rounds": args.rounds, "ray": ray.__version__, "load": [round(min(loads), 1), round(max(loads), 1)],
        "line_ms": {s: round(med[s]["line_ms"], 3) for s in sides},
        "lines_per_s": {s: round(med[s]["lines_per_s"], 1) for s in sides},
        "fresh_per_s": {s: round(med[s]["fresh_per_s"], 2) for s in sides},
        "added_ms": round(med["ray"]["line_ms"] - med["local"]["line_ms"], 3),
        "added_ms_vs_host": round(med["ray"]["line_ms"] - med["host"]["line_ms"], 3),
        "lines_ratio": round(med["ray"]["lines_per_s"] / med["local"]["lines_per_s"], 3),
        "fresh_ratio": round(med["ray"]["fresh_per_s"] / med["local"]["fresh_per_s"], 3),
    }))


if __name__ == "__main__":
    main()
