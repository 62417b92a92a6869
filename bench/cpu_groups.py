"""CPU seconds by process group over a stretch of a run: this process (replrl's host loop, its threads), the
sandboxed kernels (boots included), and every other child process (vLLM's engine). Exact without sampling:
kernels killed during the stretch are reaped by the host, so their CPU is in its RUSAGE_CHILDREN; live ones (the
warm pool, the engine) are read from /proc, their reaped descendants included.

    meter = CpuGroups(); ...; figures = meter.read()  # {"host": s, "kernels": s, "engine": s}
"""

from __future__ import annotations

import os
import resource

TICK = os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _cpu(pid: int) -> float:
    """utime + stime + cutime + cstime of ``pid`` in seconds (its reaped children included), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def _tree_cpu(pid: int) -> float:
    return _cpu(pid) + sum(_tree_cpu(c) for c in _children(pid))


def _is_kernel(pid: int) -> bool:
    """A sandboxed kernel's root process (nice, bwrap, unshare or the python kernel: its argv names its
    connection file)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"connection.json" in f.read()
    except OSError:
        return False


def live() -> dict[str, float]:
    """CPU seconds so far of the live children's trees, by group."""
    out = {"kernels": 0.0, "engine": 0.0}
    for child in _children(os.getpid()):
        out["kernels" if _is_kernel(child) else "engine"] += _tree_cpu(child)
    return out


class CpuGroups:
    """CPU seconds per group since it was made (or last ``reset``)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._self = resource.getrusage(resource.RUSAGE_SELF)
        self._reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
        self._live = live()

    def read(self) -> dict[str, float]:
        me, reaped, now = (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN),
                           live())
        reaped_s = (reaped.ru_utime + reaped.ru_stime) - (self._reaped.ru_utime + self._reaped.ru_stime)
        return {"host": round((me.ru_utime + me.ru_stime) - (self._self.ru_utime + self._self.ru_stime), 3),
                # a kernel that died in the stretch: all its CPU is in reaped_s (its earlier share was in _live)
                "kernels": round(now["kernels"] - self._live["kernels"] + reaped_s, 3),
                "engine": round(now["engine"] - self._live["engine"], 3)}
