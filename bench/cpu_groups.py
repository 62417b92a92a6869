"""CPU seconds by process group over a stretch of a run: this process (replrl's host loop and its threads; HF's
model too), the sandboxed kernels (boots included; the fork server's), the kernel-host processes themselves
(``rollout.kernel_hosts``, sandbox/host_main.py; their kernels count as kernels), and vLLM's engine processes.

A killed kernel's CPU never reaches this process's RUSAGE_CHILDREN (its bwrap parent dies with it, unwaited), so
the children's process trees are sampled from /proc every ``every`` seconds, and each process's last
sample counts (a process alive at the start counts from its first sample). What a kernel spends in the last
``every`` seconds before it is killed is missed: a few ms of an idle kernel's.

    meter = CpuGroups(); ...; figures = meter.read()  # {"host": s, "kernels": s, "hosts": s, "engine": s}

The sampler is a process of its own (``python bench/cpu_groups.py HOST_PID EVERY``), not counted in any group.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading

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


def _stat(pid: int) -> tuple[int, float] | None:
    """(start time, utime + stime in seconds) of ``pid`` itself, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[19]), (int(fields[11]) + int(fields[12])) / TICK
    except (OSError, IndexError, ValueError):
        return None


def _is_engine(pid: int) -> bool:
    """vLLM's engine (a process it spawns: ``multiprocessing.spawn`` or retitled ``VLLM::...``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    return b"multiprocessing" in cmd or cmd.startswith(b"VLLM")


def _is_kernel_host(pid: int) -> bool:
    """A kernel-host process (``python -m sandbox.host_main FD``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"sandbox.host_main" in f.read()
    except OSError:
        return False


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += _children(p)
    return out


class CpuGroups:
    """CPU seconds per group from its creation to ``read()``. The sampling runs in a process of its own (walking
    /proc for hundreds of kernel processes would otherwise cost this process CPU, and its event loop the GIL)."""

    def __init__(self, every: float = 0.5) -> None:
        self._self = resource.getrusage(resource.RUSAGE_SELF)
        self._sampler = subprocess.Popen([sys.executable, __file__, str(os.getpid()), str(every)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._sampler.stdout is not None
        self._sampler.stdout.readline()  # its first sample is taken

    def read(self) -> dict[str, float]:
        me = resource.getrusage(resource.RUSAGE_SELF)
        out, _ = self._sampler.communicate("")  # stdin closed: the last sample, then the sums
        return {"host": round((me.ru_utime + me.ru_stime) - (self._self.ru_utime + self._self.ru_stime), 3),
                **json.loads(out)}


def sample(host: int, every: float) -> None:
    """The sampler's loop (in its own process): every ``every`` s, each process under ``host`` but this one."""
    me = os.getpid()
    first: dict[tuple[int, int], float] = {}
    last: dict[tuple[int, int], tuple[str, float]] = {}

    def once(is_first: bool = False) -> None:
        for child in _children(host):
            if child == me:
                continue
            group = "engine" if _is_engine(child) else "kernels"
            kernel_host = group == "kernels" and _is_kernel_host(child)
            for pid in _tree(child):
                st = _stat(pid)
                if st is not None:
                    if is_first:
                        first[(pid, st[0])] = st[1]
                    last[(pid, st[0])] = ("hosts" if kernel_host and pid == child else group, st[1])

    once(is_first=True)
    print("ready", flush=True)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    while not done.wait(every):
        once()
    once()
    out = {"kernels": 0.0, "hosts": 0.0, "engine": 0.0}
    for key, (group, cpu) in last.items():
        out[group] += cpu - first.get(key, 0.0)
    print(json.dumps({k: round(v, 3) for k, v in out.items()}), flush=True)


if __name__ == "__main__":
    sample(int(sys.argv[1]), float(sys.argv[2]))
