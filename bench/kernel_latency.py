"""Kernel latency, side by side in one run.

Per-line round trip (p50/p99) of: the sandboxed kernel (replrl's, with its isolation), a bare jupyter_client
ipykernel (KernelManager defaults, no sandbox), and a plain pipe-based Python REPL (the lower bound). Then
acquire() from a warm pool, recovery from an interrupted loop and from a hard hang, and aggregate lines/s with
16 concurrent kernels. Prints a table, then one JSON line of figures.

    python bench/kernel_latency.py [--lines 300]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time

from jupyter_client.manager import AsyncKernelManager

from replrl.cli import run_script
from sandbox import Kernel, KernelPool, Limits

LINE = "x = 1 + 1"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def sandboxed_roundtrips(n: int) -> list[float]:
    async with Kernel(Limits()) as kernel:
        for _ in range(20):
            await kernel.execute(LINE, mode="single")
        out = []
        for _ in range(n):
            t = time.perf_counter()
            await kernel.execute(LINE, mode="single")
            out.append(time.perf_counter() - t)
        return out


async def bare_roundtrips(n: int) -> list[float]:
    km = AsyncKernelManager(kernel_name="python3")
    await km.start_kernel()
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=60)
    try:
        async def one() -> None:
            msg_id = kc.execute(LINE, store_history=False)
            while True:  # the reply on shell, and iopub drained up to idle (what a client must do)
                reply = await kc.get_shell_msg(timeout=10)
                if reply["parent_header"].get("msg_id") == msg_id:
                    break
            while True:
                msg = await kc.get_iopub_msg(timeout=10)
                if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                        and msg["content"]["execution_state"] == "idle"):
                    break

        for _ in range(20):
            await one()
        out = []
        for _ in range(n):
            t = time.perf_counter()
            await one()
            out.append(time.perf_counter() - t)
        return out
    finally:
        kc.stop_channels()
        await km.shutdown_kernel(now=True)


PIPE_REPL = r"""
import sys
ns = {}
for line in sys.stdin:
    exec(compile(line, "<stdin>", "single"), ns)
    sys.stdout.write("\x00\n"); sys.stdout.flush()
"""


def pipe_roundtrips(n: int) -> list[float]:
    proc = subprocess.Popen([sys.executable, "-u", "-c", PIPE_REPL], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, bufsize=1)
    out = []
    try:
        for i in range(n + 20):
            t = time.perf_counter()
            proc.stdin.write(LINE + "\n")
            proc.stdin.flush()
            while proc.stdout.readline() != "\x00\n":
                pass
            if i >= 20:
                out.append(time.perf_counter() - t)
    finally:
        proc.kill()
        proc.wait()
    return out


async def pool_figures(n_acquire: int) -> dict[str, float]:
    limits = Limits(wall_s=0.25, interrupt_grace_s=1.0)
    async with KernelPool(size=4, limits=limits) as pool:
        acquire = []
        for _ in range(n_acquire):
            await pool.wait_full()
            t = time.perf_counter()
            async with pool.acquire() as kernel:
                acquire.append(time.perf_counter() - t)
                await kernel.execute("1", mode="single")
        await pool.wait_full()
        interrupt, hang = [], []
        for _ in range(5):
            async with pool.acquire() as kernel:
                r = await kernel.execute("while True: pass", mode="exec")
                assert r.status == "timeout" and not r.restarted, r
                interrupt.append(r.duration_s - limits.wall_s)  # from the deadline to the result in hand
            await pool.wait_full()
        for _ in range(3):
            async with pool.acquire() as kernel:
                t = time.perf_counter()
                r = await kernel.execute("sum(range(10**13))", mode="single")
                assert r.status == "timeout" and r.restarted, r
                ok = await kernel.execute("1", mode="single")  # usable again (a warm replacement)
                assert ok.output == "1\n"
                hang.append(time.perf_counter() - t - limits.wall_s)
            await pool.wait_full()
    return {"acquire_p50_ms": 1000 * statistics.median(acquire), "interrupt_recovery_ms": 1000 * statistics.median(
        interrupt), "hang_recovery_ms": 1000 * statistics.median(hang)}


async def throughput(n_kernels: int, seconds: float) -> float:
    """Steady state: all kernels acquired and the pool's background refill finished before the clock starts."""
    async with KernelPool(size=n_kernels, limits=Limits()) as pool, contextlib.AsyncExitStack() as stack:
        kernels = [await stack.enter_async_context(pool.acquire()) for _ in range(n_kernels)]
        await pool.wait_full(120)
        for kernel in kernels:
            await kernel.execute("x = 0", mode="single")
        done = 0
        stop = time.perf_counter() + seconds

        async def worker(kernel: Kernel) -> None:
            nonlocal done
            while time.perf_counter() < stop:
                await kernel.execute("x = x + 1", mode="single")
                done += 1

        t = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in kernels))
        return done / (time.perf_counter() - t)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=300, help="round trips per kernel kind")
    ap.add_argument("--seconds", type=float, default=5.0, help="duration of the 16-kernel throughput run")
    args = ap.parse_args()
    isolation = Limits().resolve_isolation()
    sand = await sandboxed_roundtrips(args.lines)
    bare = await bare_roundtrips(args.lines)
    pipe = pipe_roundtrips(args.lines)
    pool = await pool_figures(30)
    lps = await throughput(16, args.seconds)
    rows = [("sandboxed kernel (" + isolation + ")", sand), ("bare jupyter_client kernel", bare),
            ("plain pipe REPL", pipe)]
    print(f"{'per-line round trip':34s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for name, xs in rows:
        print(f"{name:34s} {1000 * pct(xs, 0.5):8.3f} {1000 * pct(xs, 0.99):8.3f}")
    print(f"acquire() p50 from a warm pool      {pool['acquire_p50_ms']:8.2f} ms   (target <= 20)")
    print(f"interrupted-loop recovery          {pool['interrupt_recovery_ms']:8.1f} ms   (target <= 100)")
    print(f"hard-hang recovery                 {pool['hang_recovery_ms']:8.1f} ms   (target <= 1500)")
    print(f"16 kernels, aggregate               {lps:8.0f} lines/s (target >= 400)")
    ratio = statistics.median(sand) / statistics.median(bare)
    print(f"sandboxed / bare round trip         {ratio:8.2f}x    (target <= 1.3)")
    print(json.dumps({
        "isolation": isolation,
        "sandboxed_roundtrip_p50_ms": 1000 * pct(sand, 0.5), "sandboxed_roundtrip_p99_ms": 1000 * pct(sand, 0.99),
        "bare_roundtrip_p50_ms": 1000 * pct(bare, 0.5), "bare_roundtrip_p99_ms": 1000 * pct(bare, 0.99),
        "pipe_roundtrip_p50_ms": 1000 * pct(pipe, 0.5), "pipe_roundtrip_p99_ms": 1000 * pct(pipe, 0.99),
        "sandboxed_vs_bare_roundtrip_ratio": round(ratio, 3),
        "sandboxed_vs_pipe_roundtrip_ratio": round(statistics.median(sand) / statistics.median(pipe), 3),
        "acquire_p50_ms": round(pool["acquire_p50_ms"], 2),
        "interrupt_recovery_ms": round(pool["interrupt_recovery_ms"], 1),
        "hang_recovery_ms": round(pool["hang_recovery_ms"], 1),
        "lines_per_s_16_kernels": round(lps, 1),
    }))


if __name__ == "__main__":
    sys.exit(run_script(lambda: asyncio.run(main())))
