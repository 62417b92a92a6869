"""Totals per kernel: the memory of all of a kernel's processes together, and the bytes in its working directory.

``Limits.memory_mb`` as RLIMIT_AS bounds one process; a kernel may run ``max_procs`` of them. The total is bounded by
the strongest of these this host offers (``memory_mechanism()``, shown by ``replrl env``):

- **cgroup v2**: a child of this process's own cgroup when its ``memory`` controller is delegated to us (our
  cgroup's ``cgroup.subtree_control`` has it, or we may add it); ``memory.max`` per kernel, ``memory.swap.max`` 0.
- **cgroup v1**: a child of this process's cgroup in the ``memory`` hierarchy; ``memory.limit_in_bytes`` (and
  ``memory.memsw.limit_in_bytes`` where swap accounting is on) per kernel.
- **watchdog**: a host thread that sums the anonymous and shared-memory pages of the kernel's process tree every
  ``WATCH_EVERY_S`` and kills the kernel past its budget (containers without delegation).

A kernel joins its cgroup itself, before it drops its privileges and before any model-written line: the host opens
the cgroup's ``cgroup.procs`` and hands the kernel program that descriptor, which writes ``0`` (itself) to it. The
descriptor is closed before the kernel serves, and a kernel's uid may not write any cgroup file: the limit is not one
the kernel can lift. What the kernel's processes allocate (tmpfs pages of its working directory included) is charged
there; the kernel's OOM kill stays inside its cgroup.

The working directory is a tmpfs of ``Limits.max_dir_mb`` mounted in the kernel's own mount namespace (see
``_kernel_side.py``), so its total needs no watching; where a kernel has no mount namespace (the rlimits level, a
non-root host) the watchdog also sums the directory's bytes.

**CPU of all of a kernel's processes together** (``CPU_CORES``, one CPU's worth; ``cpu_mechanism()``): a line may
return at once and leave busy processes behind, in sessions of their own; on the 2-core host of issue 64 they made
the host 28x slower for the rest of the episode, and another kernel's line took 168 ms instead of 3 ms. Bounded by

- **cgroup v2**: ``cpu.max`` on the kernel's cgroup (its memory cgroup, with the cpu controller enabled beside
  memory), or **cgroup v1** with ``cpu`` mounted together with ``memory``: ``cpu.cfs_quota_us`` per period. The
  kernel joins that cgroup itself, before its cgroup namespace is made (``_kernel_side._confine``);
- **watchdog** everywhere else (cgroup v1 with ``cpu`` mounted apart, as on the 2-core host; containers without
  delegation): every ``CPU_EVERY_S`` the host's watchdog sums the CPU time of the kernel's processes (its tree
  from its first process and its uid's; a process reaped inside the tree stays counted in its parent's children's
  time) and keeps a bucket of ``CPU_CORES`` CPU-seconds per second, at most ``CPU_BURST_S`` worth. While the
  bucket is empty every process of the kernel is stopped (SIGSTOP, which no process can catch), and continued
  (SIGCONT) once it has refilled; a kernel it stopped is measured every ``CPU_HOT_EVERY_S`` for a while. On the
  2-core host six spinners left behind get 0.98 CPU. Less exact than a cgroup: a process that is born, burns and
  is reaped by a parent that ignores SIGCHLD between two measurements is not counted, and a stop lasts at most
  about ``CPU_BURST_S``, so on a host of many cores a kernel that keeps every core busy gets more than its bound
  (about ``cores * CPU_HOT_EVERY_S`` CPU-seconds per ``CPU_BURST_S`` stopped).

A cpu cgroup of its own in a v1 ``cpu`` hierarchy apart from ``memory`` would need the kernel to join it through
a second descriptor before it makes its cgroup namespace (the host moving it later shows the cgroup's host name,
``replrl-<pid>-<hex>/k<N>``, in the kernel's ``/proc/self/cgroup``); the kernel program joins one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

WATCH_EVERY_S = 0.25
"""How often the watchdog measures every kernel it watches."""
CPU_CORES = 1.0
"""CPUs' worth of time all of a kernel's processes together may use (a line that spreads over processes of its own
gets one CPU in total): ``cpu.max`` / ``cpu.cfs_quota_us`` of ``CPU_CORES * CPU_PERIOD_US`` per period."""
CPU_PERIOD_US = 100_000
CPU_BURST_S = 0.5
"""The watchdog's bucket (no cpu cgroup): a kernel may run ``CPU_BURST_S`` seconds' worth of ``CPU_CORES`` ahead of
its bound before it is stopped (a line that starts a few processes for a moment is not stopped at once), and owes at
most as much: one stop lasts at most about ``CPU_BURST_S`` (a fork bomb reaped after its line's timeout does not
leave the kernel stopped for seconds)."""
CPU_HOT_EVERY_S = 0.05
"""How often the watchdog measures a kernel it stopped in the last ``CPU_HOT_S`` (so that on a host of many cores
the CPU a kernel takes between two measurements, and its stops, stay short)."""
CPU_EVERY_S = 1.0
"""How often the watchdog measures the CPU of a kernel it has not stopped lately: a kernel's tree is a few /proc files
a process and thread, so every 0.25 s across 128 kernels cost the trainer's process 10% of a core (4.9 of its 8.3
CPU-s in a batch-128 rollout of bench/backends.py); every second, a quarter of that. A kernel past its bucket is
stopped at the next measurement: on a host of many cores it may take up to ``cores * CPU_EVERY_S`` CPU-seconds
first, then ``CPU_HOT_EVERY_S`` measurements keep its stops short."""
CPU_HOT_S = 2.0
_PREFIX = "replrl-"


def _own_cgroup(controller: str | None) -> str | None:
    """This process's cgroup path in the hierarchy of ``controller`` (v1), or the unified one (None)."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, names, path = line.rstrip("\n").split(":", 2)
                if (controller is None and names == "") or (controller is not None and controller in names.split(",")):
                    return path
    except OSError:
        return None
    return None


def _mounts() -> list[tuple[str, str, list[str]]]:
    try:
        with open("/proc/self/mounts") as f:
            return [(p[1], p[2], p[3].split(",")) for p in (line.split() for line in f) if len(p) >= 4]
    except OSError:
        return []


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _read_proc(path: str) -> bytes:
    """A /proc file's bytes by ``os.open``/``os.read``: 2 us against 17 for ``open().read()``, which the watchdog
    does for every process and thread of every kernel each second (``_descendants``, ``_cpu_seconds``)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


@dataclass
class _Tree:
    """Where this process puts its kernels' cgroups: ``parent`` is made once per process and removed at exit."""

    version: int
    parent: str
    swap_file: str | None
    cpu: bool = False
    """Whether the same cgroups bound CPU too (v2 with the cpu controller, v1 with cpu mounted with memory)."""


def _try_v2() -> tuple[_Tree | None, str]:
    mount = next((m for m, fstype, _ in _mounts() if fstype == "cgroup2"), None)
    own = _own_cgroup(None)
    if mount is None or own is None:
        return None, "no cgroup v2 hierarchy"
    base = os.path.join(mount, own.lstrip("/"))
    try:
        controllers = _read(os.path.join(base, "cgroup.controllers")).split()
        if "memory" not in controllers:
            return None, "cgroup v2 without the memory controller delegated"
        if "memory" not in _read(os.path.join(base, "cgroup.subtree_control")).split():
            _write(os.path.join(base, "cgroup.subtree_control"), "+memory")  # EBUSY while our cgroup has processes
        cpu = "cpu" in controllers
        if cpu and "cpu" not in _read(os.path.join(base, "cgroup.subtree_control")).split():
            try:
                _write(os.path.join(base, "cgroup.subtree_control"), "+cpu")
            except OSError:
                cpu = False
        parent = os.path.join(base, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        os.mkdir(parent)
        _write(os.path.join(parent, "cgroup.subtree_control"), "+memory")
        if cpu:
            try:
                _write(os.path.join(parent, "cgroup.subtree_control"), "+cpu")
            except OSError:
                cpu = False
    except OSError as err:
        return None, f"cgroup v2 not writable here ({err.strerror})"
    return _Tree(2, parent, "memory.swap.max", cpu), "cgroup v2"


def _try_v1() -> tuple[_Tree | None, str]:
    mount = next((m for m, fstype, opts in _mounts() if fstype == "cgroup" and "memory" in opts), None)
    own = _own_cgroup("memory")
    if mount is None or own is None:
        return None, "no cgroup v1 memory hierarchy"
    parent = os.path.join(mount, own.lstrip("/"), f"{_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.mkdir(parent)
    except OSError as err:
        return None, f"cgroup v1 memory hierarchy not writable here ({err.strerror})"
    swap = "memory.memsw.limit_in_bytes" if os.path.exists(os.path.join(parent, "memory.memsw.limit_in_bytes")) \
        else None
    cpu = os.path.exists(os.path.join(parent, "cpu.cfs_quota_us"))  # cpu mounted together with memory
    return _Tree(1, parent, swap, cpu), "cgroup v1"


_tree: _Tree | None = None
_tree_lock = threading.Lock()
_counter = 0


@functools.cache
def memory_mechanism() -> tuple[str, str]:
    """(mechanism, why) for this process: "cgroup v2", "cgroup v1" or "watchdog", and why the stronger ones are not
    in force. Made once per process (the parent cgroup is created here and removed at exit)."""
    global _tree
    reasons = []
    if os.environ.get("REPLRL_SANDBOX_BUDGET") != "watchdog":  # tests force the fallback this way
        for attempt in (_try_v2, _try_v1):
            tree, why = attempt()
            if tree is not None:
                _tree = tree
                import atexit

                atexit.register(_remove_tree)
                reap_stale_cgroups()  # those of earlier processes that were killed before they could remove theirs
                return why, "memory of all of a kernel's processes together, in a cgroup of its own"
            reasons.append(why)
    else:
        reasons.append("REPLRL_SANDBOX_BUDGET=watchdog")
    return "watchdog", "; ".join(reasons) or "no cgroup"


def _remove_tree() -> None:
    flush(wait_s=0.5)
    if _tree is not None:
        for name in _children(_tree.parent):
            _rmdir_cgroup(os.path.join(_tree.parent, name), wait_s=0.5)
        _rmdir_cgroup(_tree.parent, wait_s=0.5)


@functools.cache
def cpu_mechanism() -> tuple[str, str]:
    """(mechanism, why) for the CPU of a kernel's processes together: "cgroup v2" or "cgroup v1" where the kernel's
    memory cgroup bounds its CPU too, else "watchdog" (see the module docstring)."""
    kind, _ = memory_mechanism()
    if _tree is not None and _tree.cpu:
        return kind, f"cpu.max of {CPU_CORES:g} CPU on the kernel's cgroup" if _tree.version == 2 else \
            f"cpu.cfs_quota_us of {CPU_CORES:g} CPU on the kernel's cgroup"
    if kind == "watchdog":
        why = "no cgroup for the kernel"
    elif _tree is not None and _tree.version == 2:
        why = "the cpu controller is not delegated to this process's cgroup"
    else:
        why = "cgroup v1 with cpu mounted apart from memory"
    return "watchdog", why


def _children(path: str) -> list[str]:
    try:
        return [e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _rmdir_cgroup(path: str, wait_s: float) -> bool:
    """Remove a cgroup once its processes are gone (a pid namespace dies a moment after its init). Never raises."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


def reap_stale_cgroups() -> list[str]:
    """Remove the kernel cgroups of processes that died without removing them (SIGKILL, the OOM killer)."""
    removed: list[str] = []
    if _tree is None:
        return removed
    base = os.path.dirname(_tree.parent)
    for name in _children(base):
        if not name.startswith(_PREFIX) or os.path.join(base, name) == _tree.parent:
            continue
        pid = name[len(_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and os.path.exists(f"/proc/{pid}"):
            continue
        path = os.path.join(base, name)
        for child in _children(path):
            _rmdir_cgroup(os.path.join(path, child), wait_s=0.0)
        if _rmdir_cgroup(path, wait_s=0.0):
            removed.append(path)
    return removed


@dataclass
class KernelBudget:
    """One kernel's totals: its cgroup (or a place in the watchdog) from before it starts until it is gone."""

    memory_bytes: int | None
    dir_bytes: int | None
    watch_dir: str | None = None
    """The kernel's working directory as the host sees it, summed by the watchdog where no tmpfs bounds it."""
    cgroup: str | None = None
    over: str | None = None
    """Why the watchdog stopped the kernel, in words (None while it has not)."""
    _procs_fd: int | None = None
    _events_fd: int | None = None
    """Held open on the cgroup's OOM counters (v2 ``memory.events``, v1 ``memory.oom_control``)."""
    _root_pid: int | None = None
    _uid: int | None = None
    _kill: Callable[[], None] | None = field(default=None, repr=False)
    cpu_cores: float | None = None
    """CPUs' worth of time all of the kernel's processes may use together (``CPU_CORES``; None: unbounded)."""
    cpu_bounded: bool = False
    """Whether the kernel's cgroup bounds its CPU (else the watchdog does)."""
    stopped: bool = False
    """Whether the watchdog holds the kernel's processes stopped (its CPU bucket is empty)."""
    stops: int = 0
    """How many times the watchdog stopped the kernel for its CPU."""
    _cpu_last: tuple[float, float] | None = field(default=None, repr=False)
    """The watchdog's last (time, CPU seconds of the kernel's processes)."""
    _cpu_bucket: float = 0.0
    _cpu_hot_until: float = 0.0
    _cpu_next: float = 0.0
    """When the watchdog measures this kernel's CPU next (``CPU_EVERY_S``; one it stopped: ``CPU_HOT_EVERY_S``)."""

    @classmethod
    def open(cls, memory_bytes: int | None, dir_bytes: int | None, watch_dir: str | None = None,
             cpu_cores: float | None = CPU_CORES) -> KernelBudget:
        budget = cls(memory_bytes, dir_bytes, watch_dir, cpu_cores=cpu_cores)
        mechanism, _ = memory_mechanism()
        cpu_mechanism()
        flush()
        cpu_here = cpu_cores is not None and _tree is not None and _tree.cpu
        if _tree is not None and (memory_bytes is not None or cpu_here):
            path = _new_cgroup(_tree.parent)
            try:
                os.mkdir(path)
                if memory_bytes is not None:
                    _limit_memory(path, memory_bytes)
                if cpu_here:
                    _limit_cpu(path, _tree.version, cpu_cores)
                    budget.cpu_bounded = True
                budget._procs_fd = os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
                events = "memory.events" if _tree.version == 2 else "memory.oom_control"
                budget._events_fd = os.open(os.path.join(path, events), os.O_RDONLY | os.O_CLOEXEC)
                budget.cgroup = path
            except OSError as err:
                log.warning("sandbox: could not make a %s for a kernel (%s): the watchdog bounds its memory and CPU",
                            mechanism, err)
                budget.cpu_bounded = False
                _rmdir_cgroup(path, wait_s=0.0)
        return budget

    @property
    def procs_fd(self) -> int | None:
        """The descriptor the kernel program joins its cgroup through (None under the watchdog)."""
        return self._procs_fd

    def started(self) -> None:
        """The kernel has joined (it answered): the host's copy of the descriptor is no longer needed."""
        if self._procs_fd is not None:
            os.close(self._procs_fd)
            self._procs_fd = None

    def joined(self) -> bool:
        """Whether any process is in the kernel's cgroup (False under the watchdog)."""
        if self.cgroup is None:
            return False
        try:
            return bool(_read(os.path.join(self.cgroup, "cgroup.procs")).split())
        except OSError:
            return False

    def watch(self, root_pid: int, uid: int | None, kill: Callable[[], None]) -> None:
        """Have the watchdog measure this kernel (its process tree from ``root_pid``, and every process of ``uid``)
        when no cgroup bounds its memory or its CPU, or when its directory has no bounded tmpfs."""
        self._root_pid, self._uid, self._kill = root_pid, uid, kill
        if (self.cgroup is None and self.memory_bytes is not None) or (self.watch_dir and self.dir_bytes) or \
                (self.cpu_cores is not None and not self.cpu_bounded):
            _watchdog().add(self)

    def reason(self) -> str | None:
        """Why the kernel was stopped, when a total did it: in words for the transcript; else None. Asked after every
        line: a ``pread`` of a descriptor held open (about 2 microseconds), no open or parse of a path."""
        if self.over:
            return self.over
        if self._events_fd is None or self.memory_bytes is None:
            return None
        try:
            data = b"\n" + os.pread(self._events_fd, 512, 0)
        except OSError:
            return None
        at = data.find(b"\noom_kill ")
        if at < 0 or data[at + 10:at + 12] in (b"0\n", b"0"):
            return None
        return memory_words(self.memory_bytes)

    def close(self) -> None:
        """The kernel is dead: forget it, remove its cgroup. Never raises, never waits: a cgroup whose last process
        is still going (a pid namespace ends a moment after its init) is removed by a later ``close``/``open`` or
        ``flush``, at the latest when this process exits."""
        self.started()
        _watchdog_forget(self)
        if self._events_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._events_fd)
            self._events_fd = None
        if self.cgroup is not None:
            _pending.append(self.cgroup)
            self.cgroup = None
        flush()


_pending: list[str] = []
"""Kernel cgroups whose removal found a process still in them."""


def _new_cgroup(parent: str) -> str:
    global _counter
    with _tree_lock:
        _counter += 1
        return os.path.join(parent, f"k{_counter}")


def _limit_memory(path: str, memory_bytes: int) -> None:
    assert _tree is not None
    if _tree.version == 2:
        _write(os.path.join(path, "memory.max"), str(memory_bytes))
        with contextlib.suppress(OSError):
            _write(os.path.join(path, "memory.swap.max"), "0")
        with contextlib.suppress(OSError):
            _write(os.path.join(path, "memory.oom.group"), "1")
    else:
        _write(os.path.join(path, "memory.limit_in_bytes"), str(memory_bytes))
        if _tree.swap_file:
            with contextlib.suppress(OSError):
                _write(os.path.join(path, _tree.swap_file), str(memory_bytes))


def _limit_cpu(path: str, version: int, cores: float) -> None:
    quota = max(1000, int(cores * CPU_PERIOD_US))
    if version == 2:
        _write(os.path.join(path, "cpu.max"), f"{quota} {CPU_PERIOD_US}")
    else:
        _write(os.path.join(path, "cpu.cfs_period_us"), str(CPU_PERIOD_US))
        _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))


def flush(wait_s: float = 0.0) -> int:
    """Remove the kernel cgroups left pending (waiting up to ``wait_s`` for each); returns how many remain."""
    for path in list(_pending):
        if _rmdir_cgroup(path, wait_s):
            with contextlib.suppress(ValueError):
                _pending.remove(path)
    return len(_pending)


def memory_words(limit: int) -> str:
    return f"memory limit: the kernel's processes together used more than {limit // 2**20} MB"


def dir_words(limit: int) -> str:
    return f"directory limit: the kernel's files together took more than {limit // 2**20} MB"


# -- the watchdog -----------------------------------------------------------------------------------------------------
class _Watchdog:
    def __init__(self) -> None:
        self.budgets: list[KernelBudget] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="replrl-sandbox-watchdog", daemon=True)
        self.thread.start()

    def add(self, budget: KernelBudget) -> None:
        with self.lock:
            self.budgets.append(budget)

    def forget(self, budget: KernelBudget) -> None:
        with self.lock:
            if budget in self.budgets:
                self.budgets.remove(budget)

    def _run(self) -> None:
        last_full = 0.0
        while True:
            with self.lock:
                budgets = list(self.budgets)
            now = time.monotonic()
            hot = [b for b in budgets if b._cpu_hot_until > now and _cpu_watched(b)]
            time.sleep(CPU_HOT_EVERY_S if hot else WATCH_EVERY_S)
            if not budgets:
                continue
            try:
                if time.monotonic() - last_full >= WATCH_EVERY_S * 0.9:
                    last_full = time.monotonic()
                    self.check(budgets)
                else:  # between two full rounds: only the CPU of the kernels that were stopped a moment ago
                    for budget in hot:
                        if budget.over is None and budget._root_pid is not None:
                            _check_cpu(budget, _descendants(budget._root_pid) if budget._uid is None else
                                       _tree_of(_processes(), budget._root_pid, budget._uid))
            except Exception:  # the watchdog must outlive anything it measures
                log.debug("sandbox watchdog: measuring failed", exc_info=True)

    def check(self, budgets: list[KernelBudget]) -> None:
        now = time.monotonic()
        live = [b for b in budgets if b.over is None and b._kill is not None]
        watched = [b for b in live if _cpu_watched(b) and b._root_pid is not None]
        if any(now >= b._cpu_next for b in watched):  # a round's CPU checks: every kernel due within half a period
            due = {id(b) for b in watched if now >= b._cpu_next - CPU_EVERY_S / 2}  # (one /proc scan serves all)
        else:
            due = set()
        # every process of the host: to sum memory without a memory cgroup, or to find a kernel uid's processes
        # (only in a round with CPU checks due: a scan of a busy host's /proc is tens of ms, 4 a second was 5.7
        # CPU-ms a line of the trainer's process at batch 128 on the CPU proxy)
        full = any(b.cgroup is None and b.memory_bytes for b in live) or \
            any(b._uid is not None for b in watched if id(b) in due)
        procs = _processes() if full else {}
        for budget in live:
            if id(budget) in due:
                budget._cpu_next = now + CPU_EVERY_S * 0.95
                _check_cpu(budget, _tree_of(procs, budget._root_pid, budget._uid) if budget._uid is not None
                           else _descendants(budget._root_pid))
            if budget.cgroup is None and budget.memory_bytes and budget._root_pid is not None:
                used = sum(procs[p][2] for p in _tree_of(procs, budget._root_pid, budget._uid))
                if used > budget.memory_bytes:
                    budget.over = memory_words(budget.memory_bytes)
            if budget.over is None and budget.watch_dir and budget.dir_bytes:
                if dir_usage(budget.watch_dir, budget.dir_bytes) > budget.dir_bytes:
                    budget.over = dir_words(budget.dir_bytes)
            if budget.over is not None:
                log.info("sandbox: kernel stopped: %s", budget.over)
                with contextlib.suppress(Exception):
                    budget._kill()


def _cpu_watched(budget: KernelBudget) -> bool:
    return budget.cpu_cores is not None and not budget.cpu_bounded


def _check_cpu(budget: KernelBudget, pids: set[int]) -> None:
    """The watchdog's CPU bound (no cpu cgroup): a bucket refilled with ``cpu_cores`` CPU-seconds per second (at
    most ``CPU_BURST_S`` worth) pays for what the kernel's processes used since the last tick; while it is empty,
    they are all stopped."""
    assert budget.cpu_cores is not None
    now, used = time.monotonic(), _cpu_seconds(pids)
    last, budget._cpu_last = budget._cpu_last, (now, used)
    full = budget.cpu_cores * CPU_BURST_S
    if last is None:
        budget._cpu_bucket = full
        return
    bucket = min(full, budget._cpu_bucket + budget.cpu_cores * (now - last[0])) - max(0.0, used - last[1])
    budget._cpu_bucket = max(bucket, -full)
    stop = bucket < 0
    if stop or budget.stopped:  # stopped: again, for a process that escaped the last round; continued: every one
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP if stop else signal.SIGCONT)
    if stop and not budget.stopped:
        budget.stops += 1
    if stop:
        budget._cpu_hot_until = now + CPU_HOT_S
    budget.stopped = stop


def _descendants(root: int) -> set[int]:
    """``root`` and its descendants, through each thread's ``children`` (a few files a kernel, where a scan of every
    process of a busy host costs 30 ms)."""
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        found.add(pid)
        for tid in tids:
            with contextlib.suppress(OSError, ValueError):
                todo += [int(c) for c in _read_proc(f"/proc/{pid}/task/{tid}/children").split()]
    return found


def _cpu_seconds(pids: set[int]) -> float:
    """CPU seconds of ``pids`` and of their children that they have reaped (utime, stime, cutime, cstime): a child
    that ended inside the kernel's tree stays counted."""
    ticks = 0
    for pid in pids:
        try:
            fields = _read_proc(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()
            ticks += sum(int(v) for v in fields[11:15])  # fields 14-17 of stat(5)
        except (OSError, IndexError, ValueError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


_dog: _Watchdog | None = None


def _watchdog() -> _Watchdog:
    global _dog
    with _tree_lock:
        if _dog is None:
            _dog = _Watchdog()
        return _dog


def _watchdog_forget(budget: KernelBudget) -> None:
    if _dog is not None:
        _dog.forget(budget)


def _processes() -> dict[int, tuple[int, int, int]]:
    """pid -> (parent pid, uid, bytes of anonymous + shared memory) for every process of this host's pid namespace."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = dict(line.split(b":", 1) for line in _read_proc(f"/proc/{entry}/status").splitlines()
                          if b":" in line)
            ppid = int(fields[b"PPid"])
            uid = int(fields[b"Uid"].split()[1])
            kb = sum(int(fields[k].split()[0]) for k in (b"RssAnon", b"RssShmem") if k in fields)
            out[int(entry)] = (ppid, uid, kb * 1024)
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return out


def _tree_of(procs: dict[int, tuple[int, int, int]], root: int, uid: int | None) -> set[int]:
    """``root`` and its descendants, and every process of ``uid`` (a kernel's own uid, when the host is root)."""
    children, by_uid = _index(procs)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in found or pid not in procs:
            continue
        found.add(pid)
        todo.extend(children.get(pid, ()))
    if uid is not None:
        found.update(by_uid.get(uid, ()))
    return found


_INDEX: tuple[dict, dict[int, list[int]], dict[int, list[int]]] | None = None


def _index(procs: dict[int, tuple[int, int, int]]) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """(children by parent, pids by uid) of one ``_processes()`` scan, made once for all the kernels a round checks
    (it was made again for each: 128 kernels, 128 passes over every process of the host)."""
    global _INDEX
    index = _INDEX
    if index is not None and index[0] is procs:
        return index[1], index[2]
    children: dict[int, list[int]] = {}
    by_uid: dict[int, list[int]] = {}
    for pid, (ppid, uid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
        by_uid.setdefault(uid, []).append(pid)
    _INDEX = (procs, children, by_uid)
    return children, by_uid


def dir_usage(path: str, stop_at: int) -> int:
    """Bytes (allocated blocks) under ``path``, without following links or recursion; stops counting past
    ``stop_at``. Never raises."""
    total, todo, seen = 0, [path], 0
    while todo and total <= stop_at and seen < 1_000_000:
        try:
            entries = os.scandir(todo.pop())
        except OSError:
            continue
        with entries:
            for entry in entries:
                seen += 1
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                total += st.st_blocks * 512 + 4096  # an inode costs something too
                if entry.is_dir(follow_symlinks=False):
                    todo.append(entry.path)
    return total

