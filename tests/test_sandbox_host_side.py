"""What a kernel leaves on the host's side (issue 64), on forked and booted kernels alike: nothing of it on the host's
disk (its stdout and stderr are a pipe the host drains into a bounded tail), no more CPU for all of its processes
together than its bound (a cgroup, or the watchdog), and a forked kernel that starts as clean as a booted one (no
garbage of the fork server's). Real kernels; the fixes are described in docs/sandbox.md ("The contract").
"""

from __future__ import annotations

import asyncio
import logging
import os
import textwrap
import time

import pytest

from sandbox import Kernel, Limits, run_sync
from sandbox import budget as budget_mod
from sandbox.limits import available, is_root

ROOT_BWRAP = available("bwrap") and is_root()
needs_root_bwrap = pytest.mark.skipif(not ROOT_BWRAP, reason="kernels get uids, namespaces and a fork server of "
                                      "their own on a root host with bubblewrap")
BOOTS = {"forked": Limits(wall_s=10.0, uid_base=142000),
         "booted": Limits(wall_s=10.0, uid_base=143000, fork_server=False)}
boots = pytest.mark.parametrize("boot", list(BOOTS))


def run_on(boot_limits: Limits, *codes: str, timeout: float | None = None, look=None):
    """Run ``codes`` on one kernel; ``look(proc)`` is called on the host's side of it after the last one."""

    async def go():
        async with Kernel(boot_limits) as k:
            results = [await k.execute(code, timeout=timeout) for code in codes]
            return results, (look(k._proc) if look is not None else None)

    return run_sync(go())


# -- 1. nothing of a kernel on the host's disk ------------------------------------------------------------------------
FLOOD = textwrap.dedent("""
    import ctypes, os, subprocess
    libc = ctypes.CDLL(None, use_errno=True)
    reserved = libc.fallocate(1, 1, ctypes.c_long(0), ctypes.c_long(1 << 30))  # FALLOC_FL_KEEP_SIZE, 1 GiB
    print(reserved, ctypes.get_errno() != 0)
    for _ in range(160):
        os.write(1, b'x' * 65536)  # 10 MiB to stdout
    subprocess.run(['head', '-c', '4000000', '/dev/zero'], stderr=subprocess.STDOUT)  # a child's, to fd 1 and 2
    os.write(2, b'the last words')
""")


def _host_bytes_under(path: str) -> int:
    """Bytes of disk the files under ``path`` hold, as the host sees them (allocated blocks: a reservation too)."""
    total = 0
    for top, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(top, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


@needs_root_bwrap
@boots
def test_what_a_kernel_writes_to_its_stdout_never_reaches_the_hosts_disk(boot):
    """A kernel's descriptors 1 and 2 were a file in its directory on the host's disk: 14 MB written there stayed
    (up to the file-size limit), and ``fallocate(KEEP_SIZE)`` reserved 1 GiB more. Now they are a pipe: fallocate
    fails, the host keeps the last 4 KiB in memory and counts the rest, and nothing of it is on the host's disk."""

    def look(proc):
        tail = proc.log_tail(40)  # drains what is still in the pipe first
        return _host_bytes_under(proc.kdir), getattr(proc.log, "received", 0), getattr(proc.log, "dropped", 0), tail

    t0 = time.monotonic()
    (flood, after), (on_disk, received, dropped, tail) = run_on(BOOTS[boot], FLOOD, "6 * 7", look=look)
    assert time.monotonic() - t0 < 30
    assert after.status == "ok", after
    assert on_disk < 64 * 1024, on_disk
    assert flood.status == "ok" and flood.output == "-1 True\n", flood  # no reservation on a pipe
    assert received >= 160 * 65536 + 4_000_000 and dropped >= received - 4096, (received, dropped)
    assert tail.endswith("the last words'"), tail


FAKE = ("import os\nos.write(2, b'bye\\n2026-11-29 12:00:00 INFO replrl: step 9 reward 1.0\\r\\x1b[2K\\x07')\n"
        "os._exit(3)")


@needs_root_bwrap
@boots
def test_a_dying_kernels_last_words_cannot_plant_a_line_in_the_hosts_log(boot, caplog):
    """The host logs a dead kernel's last bytes at INFO; they went in verbatim, so a kernel could end the line and
    write one of its own (a fake step, a reward), or terminal escapes. They are quoted with ``ascii()`` now."""
    caplog.set_level(logging.INFO, logger="sandbox.kernel")
    (died, after), _ = run_on(BOOTS[boot], FAKE, "6 * 7")
    assert died.status == "crashed" and after.status == "ok", (died, after)
    logged = [r.getMessage() for r in caplog.records if "died" in r.getMessage()]
    assert len(logged) == 1, logged
    assert "INFO replrl: step 9" in logged[0], logged  # what the kernel wrote is there, quoted
    assert not any(c in logged[0] for c in "\n\r\x1b\x07"), logged


# -- 2. CPU of all of a kernel's processes together -------------------------------------------------------------------
SPIN = textwrap.dedent("""
    import subprocess, sys
    for _ in range(6):  # busy processes in sessions of their own, left behind: the line returns at once
        subprocess.Popen([sys.executable, '-c', 'while 1: pass'], start_new_session=True)
""")
SHORT = "import time\nt0 = time.perf_counter()\nsum(range(300_000))\nprint(time.perf_counter() - t0)"


def _cpu_of_uid(uid: int) -> tuple[float, list[int]]:
    """CPU seconds of every process of ``uid`` on this host, and their pids."""
    total, pids = 0, []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
        pids.append(int(entry))
    return total / os.sysconf("SC_CLK_TCK"), pids


def _line_s(result) -> float:
    assert result.status == "ok", result
    return float(result.output)


def _spin_and_measure(limits: Limits, window_s: float = 3.0) -> tuple[float, float, float, int]:
    """Kernel A leaves 6 busy processes behind; over ``window_s`` of wall (kernel B running short lines meanwhile),
    the CPUs' worth A's processes used; the median time of a short line on B before A's line and during the window;
    how many times the watchdog stopped A."""

    async def go():
        async with Kernel(limits) as a, Kernel(limits) as b:
            quiet = sorted([_line_s(await b.execute(SHORT)) for _ in range(5)])[2]
            assert (await a.execute(SPIN)).status == "ok"
            uid = a._proc.uid
            await asyncio.sleep(1.0)  # the spinners are up, and past the watchdog's burst where it holds
            cpu0, _ = _cpu_of_uid(uid)
            t0 = time.monotonic()
            busy = []
            while time.monotonic() - t0 < window_s:
                busy.append(_line_s(await b.execute(SHORT)))
                await asyncio.sleep(0.1)
            cpu1, _ = _cpu_of_uid(uid)
            rate = (cpu1 - cpu0) / (time.monotonic() - t0)
            return rate, quiet, sorted(busy)[len(busy) // 2], getattr(a._proc.budget, "stops", 0)

    return run_sync(go())


@needs_root_bwrap
@boots
def test_busy_processes_a_kernel_leaves_behind_get_one_cpu_in_all(boot):
    """A line returns at once and leaves 6 processes spinning in sessions of their own (on the issue's 2-core host
    such a kernel made another kernel's line take 168 ms instead of 3 ms). All of a kernel's processes together get
    one CPU's worth (``budget.CPU_CORES``), by whichever mechanism this host has (``budget.cpu_mechanism()``: the
    kernel's cgroup, or the watchdog's stops), and another kernel's line stays fast."""
    rate, quiet, busy, stops = _spin_and_measure(BOOTS[boot])
    assert rate <= budget_mod.CPU_CORES * 1.2, (rate, budget_mod.cpu_mechanism())
    if budget_mod.cpu_mechanism()[0] == "watchdog":
        assert stops > 0
    if (os.cpu_count() or 1) >= 2:
        assert busy < max(10 * quiet, quiet + 0.1), (quiet, busy)  # loose: other work shares this host


@needs_root_bwrap
@boots
def test_where_no_cgroup_bounds_the_cpu_the_watchdog_does(boot, monkeypatch):
    """Without a cgroup that bounds CPU (cgroup v1 with cpu mounted apart from memory, containers without
    delegation), the watchdog stops all of a kernel's processes while they are ahead of one CPU's worth: the same
    bound, in slices of its tick. (Where this host has the cgroup, it is taken away for the test.)"""
    budget_mod.cpu_mechanism()
    if budget_mod._tree is not None:
        monkeypatch.setattr(budget_mod._tree, "cpu", False)
    rate, quiet, busy, stops = _spin_and_measure(BOOTS[boot])
    assert stops > 0 and rate <= budget_mod.CPU_CORES * 1.2, (rate, stops)
    if (os.cpu_count() or 1) >= 2:
        assert busy < max(10 * quiet, quiet + 0.1), (quiet, busy)  # loose: other work shares this host


def test_replrl_env_names_the_cpu_bound():
    from sandbox.report import mechanisms

    rows = dict(mechanisms())
    kind, _ = budget_mod.cpu_mechanism()
    assert rows["CPU of a kernel's processes together"].startswith("the host's watchdog" if kind == "watchdog"
                                                                     else kind), rows


# -- 3. a forked kernel starts as clean as a booted one ---------------------------------------------------------------
@needs_root_bwrap
def test_a_forked_kernel_carries_no_garbage_of_the_fork_server():
    """Imports leave cyclic garbage (``sqlite3``, which the fork server imports, about 290 objects) and a fork
    inherits it: on the issue's host a forked kernel's first ``gc.collect()`` printed 160 where CPython's console
    and a booted kernel print next to nothing. The zygote collects, then freezes its heap before each fork: the
    kernel's first collection finds nothing of the zygote's, and no collection in the kernel walks (and so copies)
    the zygote's objects. (On this test's host the kernel's own start already collected the carried garbage; the
    frozen heap is what a fork without the fix lacks.)"""

    async def first_collect(limits: Limits) -> tuple[int, int, bool]:
        async with Kernel(limits) as k:
            await k.execute("import gc", mode="single")
            collected = (await k.execute("gc.collect()", mode="single")).output
            frozen = (await k.execute("gc.get_freeze_count()", mode="single")).output
            return int(collected), int(frozen), k._proc._zygote is not None

    forked, frozen, was_forked = run_sync(first_collect(BOOTS["forked"]))
    booted, _, _ = run_sync(first_collect(BOOTS["booted"]))
    assert was_forked
    assert forked == 0 and forked <= booted < 20, (forked, booted)
    assert frozen == 0, frozen
