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
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

WATCH_EVERY_S = 0.25
"""How often the watchdog measures every kernel it watches."""
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


@dataclass
class _Tree:
    """Where this process puts its kernels' cgroups: ``parent`` is made once per process and removed at exit."""

    version: int
    parent: str
    swap_file: str | None


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
        parent = os.path.join(base, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        os.mkdir(parent)
        _write(os.path.join(parent, "cgroup.subtree_control"), "+memory")
    except OSError as err:
        return None, f"cgroup v2 not writable here ({err.strerror})"
    return _Tree(2, parent, "memory.swap.max"), "cgroup v2"


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
    return _Tree(1, parent, swap), "cgroup v1"


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

    @classmethod
    def open(cls, memory_bytes: int | None, dir_bytes: int | None, watch_dir: str | None = None) -> KernelBudget:
        global _counter
        budget = cls(memory_bytes, dir_bytes, watch_dir)
        mechanism, _ = memory_mechanism()
        flush()
        if memory_bytes is None or _tree is None:
            return budget
        with _tree_lock:
            _counter += 1
            name = f"k{_counter}"
        path = os.path.join(_tree.parent, name)
        try:
            os.mkdir(path)
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
            budget._procs_fd = os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
            events = "memory.events" if _tree.version == 2 else "memory.oom_control"
            budget._events_fd = os.open(os.path.join(path, events), os.O_RDONLY | os.O_CLOEXEC)
            budget.cgroup = path
        except OSError as err:
            log.warning("sandbox: could not make a %s for a kernel (%s): the watchdog bounds its memory", mechanism,
                        err)
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
        when no cgroup bounds its memory, or when its directory has no bounded tmpfs."""
        self._root_pid, self._uid, self._kill = root_pid, uid, kill
        if (self.cgroup is None and self.memory_bytes is not None) or (self.watch_dir and self.dir_bytes):
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
        while True:
            time.sleep(WATCH_EVERY_S)
            with self.lock:
                budgets = list(self.budgets)
            if not budgets:
                continue
            try:
                self.check(budgets)
            except Exception:  # the watchdog must outlive anything it measures
                log.debug("sandbox watchdog: measuring failed", exc_info=True)

    def check(self, budgets: list[KernelBudget]) -> None:
        procs = _processes() if any(b.cgroup is None and b.memory_bytes for b in budgets) else {}
        for budget in budgets:
            if budget.over is not None or budget._kill is None:
                continue
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
            with open(f"/proc/{entry}/status", "rb") as f:
                fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
            ppid = int(fields[b"PPid"])
            uid = int(fields[b"Uid"].split()[1])
            kb = sum(int(fields[k].split()[0]) for k in (b"RssAnon", b"RssShmem") if k in fields)
            out[int(entry)] = (ppid, uid, kb * 1024)
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return out


def _tree_of(procs: dict[int, tuple[int, int, int]], root: int, uid: int | None) -> set[int]:
    """``root`` and its descendants, and every process of ``uid`` (a kernel's own uid, when the host is root)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in found or pid not in procs:
            continue
        found.add(pid)
        todo.extend(children.get(pid, ()))
    if uid is not None:
        found.update(p for p, (_, u, _) in procs.items() if u == uid)
    return found


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

