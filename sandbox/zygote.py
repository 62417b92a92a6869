"""The fork server: one pre-imported parent inside the sandbox that forks each kernel (``Limits.fork_server``).

A kernel's boot is mostly imports (ipykernel, IPython, jedi, prompt_toolkit). A zygote pays them once: it runs the
kernel program under bwrap with the same allowlist view a kernel gets (plus the one directory that holds its
kernels' directories), imports everything, and then forks a kernel per request (``_zygote_side.py``). Each kernel
gets fresh mount, pid, ipc, uts, cgroup and network namespaces of its own, a view in which the temp directory holds
only its own directory, a /proc of its own pid namespace, loopback up, its own uid and rlimits: what a kernel of
today's bwrap boot has (tests/test_zygote.py checks both boots side by side).

Used where that isolation is proven: the bwrap level with a root host (unshare and mount need the capabilities
bwrap keeps for root), wherever the interpreter lives (a virtualenv under the temp directory is bound into each
kernel's view of it, as a booted kernel's view has it). Elsewhere (a non-root host, the unshare and rlimits levels)
kernels boot as before, each its own bwrap; ``boot_path()`` says which and why (``replrl env``).

A zygote serves every kernel of one view (level, ro_paths, network, temp directory) in this process and lives while
one of its kernels (or a ``Kernel`` that uses it) does: the last one's end closes it, so a closed pool leaves no
process, directory or fd behind. It dies with its host (bwrap's --die-with-parent, started from a thread that lives
as long as the process, and the control socket's end), and a dead one is restarted by the next kernel's start.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import launch
from .kernel_dirs import KernelLog, make_kernel_dir, remove_kernel_dir
from .launch import KERNEL_SOURCE, bwrap_view, kernel_env, kernel_import_dirs, python_paths
from .limits import Limits, is_root

ZYGOTE_SOURCE = "_ZYGOTE = True\n" + KERNEL_SOURCE + "\n" + Path(__file__).with_name("_zygote_side.py").read_text()
"""The zygote program: the kernel program with ``_ZYGOTE`` set, then the fork server's loop."""

PREIMPORT = ("debugpy", "ipykernel.ipkernel", "ipykernel.zmqshell", "ipykernel.comm", "ipykernel.debugger",
             "ipykernel.eventloops", "ipykernel.heartbeat", "ipykernel.iostream", "ipykernel.parentpoller",
             "IPython.core.completer", "IPython.core.interactiveshell", "jupyter_client.session", "comm",
             "jedi", "sqlite3", "uuid", "hmac", "pickle", "code", "codeop", "reprlib", "hashlib", "errno", "ctypes")
"""Modules a kernel imports during its start (ipykernel imports some only then): the zygote imports them first."""
READY_TIMEOUT_S = 60.0


def fork_server_usable(level: str, limits: Limits) -> bool:
    """Whether kernels at ``level`` come from a zygote: asked for, the bwrap level, a root host, pidfds."""
    return boot_path(level, limits)[0] == "forked"


def boot_path(level: str, limits: Limits) -> tuple[str, str]:
    """("forked" or "booted", why): how a fresh kernel is made at ``level`` on this host."""
    if not limits.fork_server:
        return "booted", "Limits.fork_server is off"
    if level != "bwrap":
        return "booted", f"the fork server serves the bwrap level (this is {level})"
    if not is_root():
        return "booted", "the fork server needs a root host (it makes each kernel's namespaces with bwrap's rights)"
    if not hasattr(os, "pidfd_open"):
        return "booted", "this Python has no os.pidfd_open"
    return "forked", "from a pre-imported fork server (sandbox/zygote.py)"


def under_tmp(limits: Limits) -> list[str]:
    """The view's directories that live under the temp directory (the interpreter's, those of the kernel program's
    imports, ``Limits.ro_paths``): a forked kernel's view covers the temp directory and binds these back, as they are
    in the zygote's view."""
    tmp = os.path.realpath(tempfile.gettempdir())
    keep = set()
    for path in [*python_paths(), *kernel_import_dirs(), *limits.ro_paths]:
        for form in (os.path.abspath(path), os.path.realpath(path)):
            if form == tmp or form.startswith(tmp.rstrip("/") + "/"):
                keep.add(form)
    return sorted(p for p in keep if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in keep))


# -- a thread that lives as long as the process: bwrap's --die-with-parent follows the thread that started it ---------
_starter: queue.Queue | None = None
_starter_lock = threading.Lock()


def _popen_on_lasting_thread(argv: list[str], **kwargs: Any) -> concurrent.futures.Future:
    global _starter
    with _starter_lock:
        if _starter is None:
            _starter = queue.Queue()

            def serve(jobs: queue.Queue) -> None:
                while True:
                    job, fut = jobs.get()
                    try:
                        fut.set_result(job())
                    except BaseException as err:
                        fut.set_exception(err)

            threading.Thread(target=serve, args=(_starter,), name="replrl-zygote-starter", daemon=True).start()
    fut: concurrent.futures.Future = concurrent.futures.Future()
    _starter.put((lambda: subprocess.Popen(argv, **kwargs), fut))
    return fut


@dataclass
class Forked:
    """A kernel made by a zygote: the pidfd of its namespace's pid 1, and where its directory is in its view."""

    pidfd: int
    pid: int
    """pid 1 of the kernel's namespace, as this host sees it."""


class Zygote:
    """One fork server (see the module docstring)."""

    def __init__(self, key: tuple, limits: Limits):
        self.key = key
        self.limits = limits
        self.tmp = tempfile.gettempdir()
        self.users = 0
        self.proc: subprocess.Popen | None = None
        self.ctl: socket.socket | None = None
        self.dir: str | None = None
        self._dir_lock: int | None = None
        self._log: KernelLog | None = None
        self.keep = under_tmp(limits)
        """Directories of the view under the temp directory, bound into each forked kernel's view of it."""
        self._starting: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.ctl is not None

    def kernel_dir(self) -> tuple[str, int, str]:
        """A new kernel directory inside this zygote's directory: (host path, lock fd, path in the kernel's view)."""
        assert self.dir is not None
        kdir, lock = make_kernel_dir(self.dir)
        return kdir, lock, os.path.join(self.tmp, os.path.basename(kdir))

    async def ensure(self) -> None:
        loop = asyncio.get_running_loop()
        if self.alive:
            return
        if self._starting is not None and self._loop is loop and not self._starting.done():
            await asyncio.shield(self._starting)
            return
        self._loop = loop
        self._starting = loop.create_future()
        try:
            await self._start()
            self._starting.set_result(None)
        except BaseException as err:
            self._starting.set_exception(err)
            self._starting.exception()  # retrieved: the awaiting callers see it
            self._stop()
            raise

    async def _start(self) -> None:
        self._stop()
        self.dir, self._dir_lock = make_kernel_dir()
        os.chmod(self.dir, 0o711)  # kernels of other uids reach their own directories inside
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = kernel_env(self.limits, os.path.join(self.tmp, "replrl-kernel-zygote"), None, True)
        config = json.loads(env["REPLRL_SANDBOX"])
        env["REPLRL_SANDBOX"] = json.dumps({"import_path": config["import_path"],
                                            "zygote": {"ctl_fd": theirs.fileno(), "preimport": list(PREIMPORT),
                                                       "ptys": launch.PTYS_PER_KERNEL}})
        argv = [shutil.which("bwrap") or "bwrap", *bwrap_view(self.dir, self.limits.ro_paths, self.limits.network)]
        argv += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--hostname", launch.KERNEL_HOSTNAME,
                 "--unshare-cgroup-try"]  # a forked kernel's UTS namespace starts as a copy of this one
        if not self.limits.network:
            argv += ["--unshare-net"]
        argv += ["--die-with-parent", "--new-session", "--chdir", "/", "--clearenv"]
        for key, value in env.items():
            argv += ["--setenv", key, value]
        argv += ["--", sys.executable, "-c", ZYGOTE_SOURCE]
        self._log = KernelLog.create()
        try:
            self.proc = await asyncio.wrap_future(_popen_on_lasting_thread(
                argv, stdin=subprocess.DEVNULL, stdout=self._log.fd, stderr=subprocess.STDOUT,
                pass_fds=[theirs.fileno()], start_new_session=True))
        finally:
            theirs.close()
        ours.setblocking(False)
        self.ctl = ours
        msg = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(ours, 4096), READY_TIMEOUT_S)
        ready = json.loads(msg) if msg else {}
        if not ready.get("ready"):
            raise RuntimeError(f"the sandbox's fork server did not start: {self.log_tail()}")
        if ready.get("threads") != 1:
            raise RuntimeError(f"the sandbox's fork server has {ready.get('threads')} threads before forking")
        self.ctl.setblocking(True)
        self.ctl.settimeout(10.0)

    def log_tail(self, n: int = 600) -> str:
        return self._log.tail(n) if self._log is not None else "(no log)"

    async def fork(self, request: dict, log_fd: int, cgroup_fd: int | None, timeout: float) -> Forked:
        """Ask for one kernel; returns its pidfd once the zygote's child has made its namespaces. The zygote gets
        only the descriptors; the request goes to its child on the reply socket (the zygote keeps no history)."""
        await self.ensure()
        assert self.ctl is not None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        loop = asyncio.get_running_loop()
        try:
            fds = [theirs.fileno(), log_fd] + ([cgroup_fd] if cgroup_fd is not None else [])
            with theirs:
                socket.send_fds(self.ctl, [b"fork" if cgroup_fd is None else b"fork+cgroup"], fds)
            ours.send(json.dumps(request).encode())
            got: asyncio.Future = loop.create_future()

            def on_reply() -> None:
                if got.done():
                    return
                try:
                    got.set_result(socket.recv_fds(ours, 4096, 1))
                except OSError as err:
                    got.set_exception(err)

            loop.add_reader(ours.fileno(), on_reply)
            try:
                msg, fds, _, _ = await asyncio.wait_for(got, timeout)
            finally:
                loop.remove_reader(ours.fileno())
        finally:
            ours.close()
        reply = json.loads(msg) if msg else {"error": f"no reply (fork server dead?): {self.log_tail()}"}
        if "error" in reply or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise RuntimeError(f"the sandbox's fork server could not fork a kernel: {reply.get('error')}")
        return Forked(pidfd=fds[0], pid=_pidfd_pid(fds[0]))

    def _stop(self) -> None:
        if self.ctl is not None:
            self.ctl.close()
            self.ctl = None
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, 9)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.dir is not None:
            remove_kernel_dir(self.dir, self._dir_lock)
            self.dir = self._dir_lock = None

    def close(self) -> None:
        """Kill the zygote (its kernels' namespaces die with it) and remove its directory. Idempotent."""
        self._starting = None
        self._stop()


def _pidfd_pid(pidfd: int) -> int:
    with open(f"/proc/self/fdinfo/{pidfd}") as f:
        for line in f:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    return -1


_zygotes: dict[tuple, Zygote] = {}
_lock = threading.Lock()


def zygote_key(limits: Limits) -> tuple:
    return ("bwrap", tuple(limits.ro_paths), limits.network, tempfile.gettempdir())


def hold(limits: Limits) -> Zygote:
    """The zygote for ``limits``' view, counted as used until ``release``."""
    key = zygote_key(limits)
    with _lock:
        zygote = _zygotes.get(key)
        if zygote is None:
            zygote = _zygotes[key] = Zygote(key, limits)
        zygote.users += 1
        return zygote


def release(zygote: Zygote) -> None:
    """One user fewer; the last one's release closes the zygote (nothing of it outlives its kernels)."""
    with _lock:
        zygote.users -= 1
        if zygote.users > 0:
            return
        if _zygotes.get(zygote.key) is zygote:
            del _zygotes[zygote.key]
    zygote.close()
