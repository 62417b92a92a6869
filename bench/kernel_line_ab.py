"""One kernel line's round trip, this checkout against an earlier commit, interleaved in one run (issue 53: the
hardening must not make the line loop slower).

A line's cost as the rollout pays it: ``Kernel.execute`` of a small interactive statement on a warm kernel (the
host's request, the kernel's run, the reply, and what the host checks after it). The earlier commit runs from a
temporary ``git worktree`` of it; each round starts one process per side, alternately, so load from elsewhere on the
machine falls on both sides alike. Each process starts a kernel, runs ``--warm`` lines, then times ``--lines`` lines
(wall per line, and the host process's CPU per line).

    python bench/kernel_line_ab.py --ref a7132e1 [--rounds 6] [--lines 300]

Prints a table, then one JSON line: ``line_ms_ratio`` (this checkout / the ref, medians over rounds; <= 1.0 means
not slower) and ``host_cpu_us_ratio``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

DRIVER = r"""
import json, sys, time
from sandbox import Kernel, Limits, run_sync
LINES = ["x = 21", "y = x * 2", "y", "for i in range(3):\n    y += i\n", "print(y)", "s = 'abc' * 3", "len(s)"]
async def go(warm, n):
    async with Kernel(Limits(wall_s=10.0)) as k:
        for i in range(warm):
            await k.execute(LINES[i % len(LINES)], mode="single")
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(n):
            await k.execute(LINES[i % len(LINES)], mode="single")
        return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n, k._proc._zygote is not None
wall, cpu, forked = run_sync(go(int(sys.argv[1]), int(sys.argv[2])))
print(json.dumps({"line_ms": wall * 1e3, "host_cpu_us": cpu * 1e6, "forked": forked}))
"""


def run_side(path: str, warm: int, lines: int) -> dict:
    env = {**os.environ, "PYTHONPATH": path}
    out = subprocess.run([sys.executable, "-c", DRIVER, str(warm), str(lines)], cwd=path, env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"kernel_line_ab: the side at {path} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", required=True, help="the earlier commit (e.g. main before the change)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--lines", type=int, default=300)
    ap.add_argument("--warm", type=int, default=30)
    args = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    where = tempfile.mkdtemp(prefix="replrl-ab-")
    ref = os.path.join(where, "ref")
    subprocess.run(["git", "-C", here, "worktree", "add", "--detach", ref, args.ref], check=True,
                   capture_output=True)
    try:
        sides: dict[str, list[dict]] = {"ref": [], "this": []}
        for r in range(args.rounds):
            order = [("ref", ref), ("this", here)] if r % 2 == 0 else [("this", here), ("ref", ref)]
            for name, path in order:
                sides[name].append(run_side(path, args.warm, args.lines))
    finally:
        subprocess.run(["git", "-C", here, "worktree", "remove", "--force", ref], capture_output=True)
        os.rmdir(where)
    med = {name: {k: statistics.median(r[k] for r in rows) for k in ("line_ms", "host_cpu_us")}
           for name, rows in sides.items()}
    title = f"per line (median of {args.rounds} rounds)"
    print(f"{title:34s} {args.ref[:10]:>12s} {'this':>12s} {'ratio':>7s}")
    for key, unit in (("line_ms", "wall ms"), ("host_cpu_us", "host CPU us")):
        a, b = med["ref"][key], med["this"][key]
        print(f"{unit:34s} {a:12.3f} {b:12.3f} {b / a:7.2f}")
    print(json.dumps({"ref": args.ref, "rounds": args.rounds, "lines": args.lines,
                      "forked": [sides["ref"][0]["forked"], sides["this"][0]["forked"]],
                      "line_ms_ref": round(med["ref"]["line_ms"], 3), "line_ms_this": round(med["this"]["line_ms"], 3),
                      "line_ms_ratio": round(med["this"]["line_ms"] / med["ref"]["line_ms"], 3),
                      "host_cpu_us_ratio": round(med["this"]["host_cpu_us"] / med["ref"]["host_cpu_us"], 3)}))


if __name__ == "__main__":
    main()
