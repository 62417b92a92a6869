"""A kernel pool under repeated hostile episodes for a while: does anything leak? (issue 53; the suite runs a minute
of it in tests/test_sandbox_hostile.py).

Each episode runs one attack (fork bomb, 10 GB allocation, os._exit, SIGSEGV, a deep tree, an endless loop,
kill(0, 9), keyring calls, four children over the memory total), then checks the next line runs on a working kernel.
At the end: processes of the pool's kernel uids, kernel directories in the pool's temp directory, live zygotes,
kernel cgroups, and the host's open descriptors and resident memory against the start.

    python bench/sandbox_soak.py [--seconds 300] [--size 4]

Prints one line per attack kind (episodes, statuses), then one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time

from sandbox import Limits, SyncKernelPool, budget, zygote
from sandbox.kernel_dirs import PREFIX

ATTACKS = {
    "fork_bomb": "import os\nwhile True:\n    os.fork()",
    "huge_allocation": "x = bytearray(10 * 2**30)",
    "os_exit": "import os\nos._exit(1)",
    "segfault": "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)",
    "deep_tree": "import os\nfor _ in range(2000):\n    os.mkdir('d')\n    os.chdir('d')",
    "endless_loop": "while True:\n    pass",
    "kill_group": "import os\nos.kill(0, 9)",
    "keyring": "import ctypes\nprint(ctypes.CDLL(None, use_errno=True).syscall(248, b'user', b'k', b'v', 1, -4))",
    "memory_total": ("import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n"
                     "        b = bytearray(200 * 2**20)\n"
                     "        for i in range(0, len(b), 4096):\n            b[i] = 1\n"
                     "        time.sleep(20)\n        os._exit(0)\ntime.sleep(5)"),
}
UID_BASE = 150000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--size", type=int, default=4)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="replrl-soak-")
    tempfile.tempdir = tmp
    limits = Limits(wall_s=2.0, interrupt_grace_s=0.5, uid_base=UID_BASE, memory_mb=600)
    statuses: dict[str, collections.Counter] = {k: collections.Counter() for k in ATTACKS}
    healthy = episodes = 0
    with SyncKernelPool(size=args.size, limits=limits) as pool:
        with pool.acquire() as kernel:
            kernel.execute("1")
        pool.wait_full(60)
        fds0, rss0 = len(os.listdir("/proc/self/fd")), _rss_mb()
        t0 = time.monotonic()
        names = list(ATTACKS)
        while time.monotonic() - t0 < args.seconds:
            name = names[episodes % len(names)]
            with pool.acquire() as kernel:
                statuses[name][kernel.execute(ATTACKS[name], timeout=10).status] += 1
                healthy += kernel.execute("6 * 7", mode="single").output == "42\n"
            episodes += 1
        pool.wait_full(60)
        time.sleep(1.0)
        fds1, rss1 = len(os.listdir("/proc/self/fd")), _rss_mb()
        zygotes = list(zygote._zygotes.values())
    time.sleep(1.0)
    left = {
        "processes": sum(1 for e in os.listdir("/proc") if e.isdigit() and UID_BASE <= _uid(e) < UID_BASE + 20000),
        "kernel_dirs": sum(1 for n in os.listdir(tmp) if n.startswith(PREFIX)),
        "zygotes_alive": sum(z.alive for z in zygotes),
        "cgroups": len(budget._children(budget._tree.parent)) if budget._tree is not None else 0,
    }
    for name, counts in statuses.items():
        print(f"{name:16s} {sum(counts.values()):5d} episodes  {dict(counts)}")
    print(json.dumps({"seconds": args.seconds, "episodes": episodes, "next_line_ok": healthy,
                      "host_fds_growth": fds1 - fds0, "host_rss_growth_mb": round(rss1 - rss0, 1),
                      "memory_mechanism": budget.memory_mechanism()[0], **{f"left_{k}": v for k, v in left.items()}}))
    os.rmdir(tmp)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _uid(pid: str) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


if __name__ == "__main__":
    main()
