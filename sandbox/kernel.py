"""One sandboxed ipykernel: start, execute, interrupt, restart, shutdown.

The kernel process is started by us (not by jupyter_client's KernelManager) so that we own its isolation wrapper,
its process group and its death notification (a pidfd on the event loop). We talk to it over its unix sockets: the
shell channel for requests and the control channel for message-mode interrupts, each a ZMTP connection the host
reads itself within budgets (``zmtp.py``: frames and bytes per message, bytes and unanswered messages between two
requests), with jupyter_client's ``Session`` signing and parsing the messages and ``reply.py`` checking every field
of a reply. The iopub channel is never subscribed: everything we need comes back in the execute_reply (see
_kernel_side.py). A kernel whose traffic breaks a budget, or whose reply has the wrong shape, is killed; its line
ends as a crash that says why.

Recovery ladder for an execution past ``Limits.wall_s``: interrupt; if the kernel is not idle within
``Limits.interrupt_grace_s``, kill its whole process tree and replace it. Nothing here raises into the caller for
anything the executed code does: every outcome is an ExecResult.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from jupyter_client.session import Session

from . import zmtp, zygote
from .budget import KernelBudget
from .errors import KernelStartError
from .kernel_dirs import KernelLog, make_kernel_dir, remove_kernel_dir
from .launch import kernel_env, kill_uid, launch_spec, next_uid, release_uid, seccomp_available
from .limits import Limits, is_root
from .reply import Malformed, exec_result
from .result import ExecResult

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
PORTS = {"shell_port": 1, "iopub_port": 2, "stdin_port": 3, "control_port": 4, "hb_port": 5}


class KernelProcess:
    """One live kernel process and its sockets. Replaced wholesale when it dies."""

    def __init__(self, limits: Limits, level: str, nice: int = 0):
        self.limits = limits
        self.level = level
        self.nice = nice
        """How much lower than the host's the kernel's priority is while it boots (``nice -n``; see ``renice``). A
        fork of the zygote is cheap: it boots at the host's."""
        self._zygote = zygote.hold(limits) if zygote.fork_server_usable(level, limits) else None
        """The fork server this kernel comes from, or None: a boot of its own (bwrap + python)."""
        self.kdir: str | None = None
        self._kdir_lock: int | None = None
        if self._zygote is not None:
            self.nice = 0
        self.dead = asyncio.get_running_loop().create_future()
        self.pending: dict[str, asyncio.Future] = {}
        self.channels: dict[str, zmtp.Channel] = {}
        """``shell`` and ``control``: the host's connections to the kernel's sockets."""
        self.fault: str | None = None
        """Why the host killed this kernel for its traffic or its reply (the host's words), or None."""
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self._pidfd: int | None = None
        self._readers: list[asyncio.Task] = []
        self._closed = False
        self.uid: int | None = None
        self._sock_fd: int | None = None
        self.log: KernelLog | None = None
        self.budget: KernelBudget | None = None
        self._work_tmpfs = self._zygote is not None or level == "unshare" or (level == "bwrap" and is_root())
        """Whether the working directory is a bounded tmpfs of the kernel's own mount namespace (a mount needs one,
        and the privileges to make it); else the watchdog sums the directory (``sandbox/budget.py``)."""

    async def start(self) -> KernelProcess:
        """Start the kernel; a failure of any kind is a KernelStartError (which ``Kernel.execute`` turns into a
        crashed result), never another exception into the caller."""
        try:
            return await self._start()
        except KernelStartError:
            self.kill()
            raise
        except Exception as err:  # a full disk, no uid left, a cgroup gone: the kernel did not start
            self.kill()
            raise KernelStartError(f"sandboxed kernel ({self.level}) did not start: {type(err).__name__}: {err}") \
                from None
        except BaseException:  # cancelled half-way: leave nothing behind
            self.kill()
            raise

    async def _start(self) -> KernelProcess:
        if self._zygote is not None:
            await self._zygote.ensure()
            self.kdir, self._kdir_lock, view = self._zygote.kernel_dir()
            self.uid = next_uid(self.limits)
        else:
            self.kdir, self._kdir_lock = make_kernel_dir()
            view = self.kdir
        self._layout(view)
        if self._zygote is not None:
            return await self._start_forked(self._zygote, view)
        spec = launch_spec(self.level, self.limits, self.kdir, os.path.join(self.kdir, "connection.json"),
                           extra_cfg=self._cfg(work_tmpfs=self._work_tmpfs))
        self.uid = spec.uid
        self._own_dirs()
        argv = spec.argv if not self.nice else [shutil.which("nice") or "nice", "-n", str(self.nice), *spec.argv]
        fds = [self.budget.procs_fd] if self.budget.procs_fd is not None else []
        self.proc = subprocess.Popen(argv, env=spec.env or None, cwd=spec.cwd, stdin=subprocess.DEVNULL,
                                     stdout=self.log.fd, stderr=subprocess.STDOUT, start_new_session=True,
                                     pass_fds=fds)
        self.pid = self.proc.pid
        self._pidfd = os.pidfd_open(self.proc.pid)
        asyncio.get_running_loop().add_reader(self._pidfd, self._on_exit)
        return await self._connect()

    def _layout(self, view: str) -> None:
        """The kernel's directory, made by the host before the kernel exists: ``work`` (its working directory),
        ``sock`` (where it binds its sockets), ``connection.json``, and ``kernel.log``, created here and read back
        only through the descriptor made now (``KernelLog``: the kernel may replace the name, never what the host
        reads). The host keeps a descriptor of ``sock`` too and reaches the sockets through it."""
        assert self.kdir is not None
        for name in ("work", "sock"):
            os.mkdir(os.path.join(self.kdir, name), 0o700)
        self._sock_fd = os.open(os.path.join(self.kdir, "sock"), os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW
                                | os.O_CLOEXEC)
        key = secrets.token_hex(16)
        self.session = Session(key=key.encode(), signature_scheme="hmac-sha256", username="replrl")
        with open(os.path.join(self.kdir, "connection.json"), "x") as f:
            json.dump({"transport": "ipc", "ip": os.path.join(view, "sock", "k"), "key": key,
                       "signature_scheme": "hmac-sha256", **PORTS}, f)
        self.log = KernelLog.create()  # a pipe drained into a bounded tail: nothing of the kernel on the host's disk
        memory = self.limits.memory_mb * 2**20 if self.limits.memory_mb else None
        watch = None if self._work_tmpfs else os.path.join(self.kdir, "work")
        self.budget = KernelBudget.open(memory, self.limits.max_dir_mb * 2**20, watch_dir=watch)

    def _own_dirs(self) -> None:
        """With a uid of its own, the kernel owns only ``work``, ``sock`` (until it answers) and may read its
        connection file; the directory itself is root's and its group's (the kernel's gid): it cannot rename,
        replace or add anything there."""
        if self.uid is None:
            return
        assert self.kdir is not None
        os.chown(self.kdir, 0, self.uid)
        os.chmod(self.kdir, 0o750)
        for name in ("work", "sock", "connection.json"):
            os.chown(os.path.join(self.kdir, name), self.uid, self.uid)
        os.chmod(os.path.join(self.kdir, "connection.json"), 0o400)

    def _cfg(self, work_tmpfs: bool) -> dict:
        """What the kernel program does before it serves (``_kernel_side._before_serving``)."""
        cfg: dict[str, Any] = {"seccomp": seccomp_available()}
        if self.budget.procs_fd is not None:
            cfg["cgroup_fd"] = self.budget.procs_fd
        if work_tmpfs:
            cfg["work_tmpfs"] = {"bytes": self.limits.max_dir_mb * 2**20, "inodes": self.limits.max_dir_inodes}
        return cfg

    async def _start_forked(self, server: zygote.Zygote, view: str) -> KernelProcess:
        """The kernel forked by ``server`` (see sandbox/zygote.py); its directory is ``view`` in its own view."""
        loop = asyncio.get_running_loop()
        assert self.kdir is not None
        self._own_dirs()
        env = kernel_env(self.limits, view, self.uid, may_reap=True)
        cfg = {**json.loads(env.pop("REPLRL_SANDBOX")), **self._cfg(work_tmpfs=self._work_tmpfs)}
        cfg.pop("cgroup_fd", None)  # the zygote hands the kernel the descriptor it receives
        request = {"cfg": cfg, "env": env, "kdir": self.kdir, "view_kdir": view, "tmp": server.tmp,
                   "work": os.path.join(view, "work"), "conn": os.path.join(view, "connection.json"),
                   "network": self.limits.network, "keep": server.keep}
        try:
            forked = await server.fork(request, self.log.fd, self.budget.procs_fd, START_TIMEOUT_S)
        except (RuntimeError, OSError, asyncio.TimeoutError) as err:
            raise KernelStartError(f"sandboxed kernel (bwrap, forked) did not start: {err}") from None
        self._pidfd, self.pid = forked.pidfd, forked.pid
        loop.add_reader(self._pidfd, self._on_exit)
        return await self._connect()

    async def _channels(self, deadline: float) -> None:
        """Connect to the shell and control sockets, reached through the host's descriptor of ``sock`` (the path
        through an fd is also shorter than a unix socket's 108 bytes where the temp directory is deep), retrying
        until the kernel has bound them; then read each within the kernel's budget."""
        budget = zmtp.WireBudget.for_output(self.limits.max_output_bytes)
        for name, port in (("shell", 1), ("control", 4)):
            self.channels[name] = await zmtp.Channel.connect(f"/proc/self/fd/{self._sock_fd}/k-{port}", budget,
                                                             deadline, self.dead)
        self._readers = [asyncio.ensure_future(self._read(chan)) for chan in self.channels.values()]

    def _close_sockets(self) -> None:
        for task in self._readers:
            task.cancel()
        for chan in self.channels.values():
            chan.close()

    async def _connect(self) -> KernelProcess:
        """Connect once, wait for the kernel's answer, then lock ``sock`` (root's alone, when the kernel has a uid of
        its own). The connections are never made again: no path the kernel can write is resolved after it answers,
        whatever model-written code later does to its files."""
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        try:
            await self._channels(deadline)
        except (zmtp.WireFault, zmtp.WireClosed, OSError, asyncio.TimeoutError) as err:
            raise KernelStartError(f"sandboxed kernel ({self.level}) did not start: {err}; "
                                   f"{self.log_tail()}") from None
        reply = await self.request("kernel_info_request", {}, timeout=max(deadline - asyncio.get_running_loop().time(),
                                                                           0.001))
        if reply is None:
            raise KernelStartError(f"sandboxed kernel ({self.level}) did not start: {self.fault or self.log_tail()}")
        if self.uid is not None:
            os.chown(f"/proc/self/fd/{self._sock_fd}", 0, 0)
            os.chmod(f"/proc/self/fd/{self._sock_fd}", 0o700)
        self.budget.started()
        uid = self.uid if self.level == "rlimits" else None
        self.budget.watch(self.pid or -1, uid, self._kill_from_any_thread)
        return self

    def _kill_from_any_thread(self) -> None:
        """SIGKILL the kernel's process tree (the watchdog's thread calls it); the event loop sees the death."""
        if self.proc is not None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            if self.uid is not None and self.level == "rlimits":
                kill_uid(self.uid)
        elif self._pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def renice(self) -> None:
        """Give the kernel's processes (those of its own uid) the host's niceness: a kernel that booted at a lower
        priority (``nice`` above the host's) runs its episode at the host's. Needs the host to be root (a kernel uid
        of its own); else a no-op."""
        if self.nice and self.uid is not None:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_USER, self.uid, os.getpriority(os.PRIO_PROCESS, 0))
                self.nice = 0

    def _on_exit(self) -> None:
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(self._pidfd)
        if not self.dead.done():
            self.dead.set_result(True)

    @property
    def alive(self) -> bool:
        return not self.dead.done() and not self._closed

    async def _read(self, chan: zmtp.Channel) -> None:
        """Deliver each reply to the request it answers, yielding to the event loop after each message; a message
        that answers nothing (forged, badly signed, replayed) counts against the window's budget. A budget broken
        kills the kernel (``fault`` says why); the kernel closing its socket ends the reader (its death follows)."""
        try:
            while True:
                frames = await chan.recv()
                msg_id, msg = self._parse(frames)
                fut = self.pending.pop(msg_id, None) if msg_id is not None else None
                if fut is None:
                    chan.stray()
                elif not fut.done():
                    fut.set_result(msg)
                await asyncio.sleep(0)
        except (asyncio.CancelledError, zmtp.WireClosed):
            pass
        except zmtp.WireFault as fault:
            self.end(f"its traffic broke the host's budget: {fault}")

    def _parse(self, frames: list[bytes]) -> tuple[str | None, dict | None]:
        """(the id of the request a message answers, the message) if it is signed with this kernel's key and has a
        request id; else (None, None). Never raises."""
        try:
            _, frames = self.session.feed_identities(frames, copy=True)
            msg = self.session.deserialize(frames, content=True, copy=True)
            parent = msg.get("parent_header")
            msg_id = parent.get("msg_id") if isinstance(parent, dict) else None
            return (msg_id, msg) if isinstance(msg_id, str) else (None, None)
        except Exception:  # a malformed, forged or replayed message: it answers nothing
            return None, None

    def ended_by(self) -> str | None:
        """What ended it, in words: what it sent (``fault``), else a total it broke (its budget's reason); None if
        neither (it exited, crashed or is alive)."""
        return self.fault or (self.budget.reason() if self.budget is not None else None)

    def end(self, why: str) -> None:
        """Kill the kernel now for what it sent (``why``, the host's words: no bytes of the kernel's); waiters see it
        dead at once, and ``fault`` says why."""
        if self.fault is None:
            self.fault = why
            log.warning("sandboxed kernel %s killed: %s", self.pid, why)
        self._kill_from_any_thread()
        if not self.dead.done():
            self.dead.set_result(True)

    def send(self, msg_type: str, content: dict, *, control: bool = False) -> asyncio.Future:
        msg = self.session.msg(msg_type, content)
        fut = asyncio.get_running_loop().create_future()
        self.pending[msg["header"]["msg_id"]] = fut
        chan = self.channels.get("control" if control else "shell")
        if chan is not None:
            chan.send(self.session.serialize(msg))
        return fut

    async def wait(self, fut: asyncio.Future, timeout: float) -> dict | None:
        """The reply, or None if the kernel died or ``timeout`` passed first."""
        if not fut.done():
            await asyncio.wait((fut, self.dead), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        return fut.result() if fut.done() and not fut.cancelled() else None

    async def request(self, msg_type: str, content: dict, timeout: float) -> dict | None:
        return await self.wait(self.send(msg_type, content), timeout)

    def log_tail(self, n: int = 600) -> str:
        """The last ``n`` bytes the kernel wrote to its stdout and stderr (a pipe the host drains into a tail of 4 KiB,
        ``KernelLog``), quoted with ``ascii()``: safe to put in a log line."""
        return self.log.tail(n) if self.log is not None else "(no log)"

    def kill(self) -> None:
        """SIGKILL the whole process tree and free every resource. Idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        self._close_sockets()
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            if self.uid is not None and self.level == "rlimits":  # no pid namespace: find strays by uid
                kill_uid(self.uid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
        elif self._pidfd is not None:  # forked: pid 1 of the kernel's pid namespace; its death ends the namespace
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            poll = select.poll()  # not select.select: it refuses fds above 1023 (a pool of 128 kernels has them)
            poll.register(self._pidfd, select.POLLIN)
            poll.poll(5000)
        release_uid(self.uid)
        if self._pidfd is not None:
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if not self.dead.done():
            self.dead.set_result(True)
        for fut in self.pending.values():
            fut.cancel()
        self.pending.clear()
        if self.log is not None:
            self.log.close()
        if self.budget is not None:
            self.budget.close()
        if self._sock_fd is not None:
            os.close(self._sock_fd)
            self._sock_fd = None
        if self.kdir is not None:
            remove_kernel_dir(self.kdir, self._kdir_lock)
        if self._zygote is not None:
            zygote.release(self._zygote)
            self._zygote = None


Spawner = Callable[[], Awaitable[KernelProcess]]


class Kernel:
    """A sandboxed Python kernel with persistent state. Use ``async with Kernel(limits) as k``.

    A kernel that dies (or is killed by the recovery ladder) is replaced by a fresh one: the result of the call
    that lost it says ``restarted=True``, and later calls run on the new kernel. One that died between calls (a
    thread or timer its code left running ended it) is found at the next call, which does not run its code and
    says ``crashed``, ``restarted=True``.
    """

    def __init__(self, limits: Limits | None = None, tools: Sequence[str] = (), *, _spawn: Spawner | None = None):
        self.limits = limits or Limits()
        self.isolation = self.limits.resolve_isolation()
        self.tools = tuple(tools)
        self._spawn_fn = _spawn
        self._proc: KernelProcess | None = None
        self._replacing: asyncio.Task | None = None
        self.restarts = 0
        self._held: zygote.Zygote | None = None
        """A kernel of its own keeps its fork server between restarts (a pool's idle kernels keep the pool's)."""

    async def _spawn(self) -> KernelProcess:
        proc = await (self._spawn_fn() if self._spawn_fn else KernelProcess(self.limits, self.isolation).start())
        if self.tools:
            await proc.request("execute_request", _exec_content("", op="tools", names=list(self.tools)), 30.0)
        return proc

    async def start(self) -> Kernel:
        if self._spawn_fn is None and self._held is None and zygote.fork_server_usable(self.isolation, self.limits):
            self._held = zygote.hold(self.limits)
        if self._proc is None:
            self._proc = await self._spawn()
        return self

    async def __aenter__(self) -> Kernel:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    async def set_tools(self, names: Sequence[str]) -> None:
        """Define recording functions (e.g. ``submit``) in the namespace; their calls come back as ToolCalls."""
        self.tools = tuple(names)
        proc = await self._ready()
        await proc.request("execute_request", _exec_content("", op="tools", names=list(self.tools)), 30.0)

    async def _ready(self) -> KernelProcess:
        replacing, self._replacing = self._replacing, None
        if replacing is not None:
            with contextlib.suppress(KernelStartError):  # a replacement that failed is tried again just below
                await replacing
        if self._proc is None or not self._proc.alive:
            await self.restart()
        assert self._proc is not None
        return self._proc

    def _lose(self, proc: KernelProcess) -> None:
        """Kill ``proc`` and start its replacement in the background."""
        proc.kill()
        self.restarts += 1
        self._proc = None
        self._replacing = asyncio.ensure_future(self._replace())

    async def _replace(self) -> None:
        self._proc = await self._spawn()

    async def execute(self, code: str, *, mode: str = "exec", timeout: float | None = None,
                      digest: bool = False) -> ExecResult:
        """Run ``code`` and return what happened. ``mode="single"`` is the interactive REPL mode (expression
        values are echoed with repr, an unfinished compound statement returns ``incomplete=True``); ``"eof"`` is
        the same at end of input, as `python -i` ends: an unfinished statement is compiled as it stands.
        ``digest=True``: the result's ``state`` is a digest of the namespace afterwards (hashes only)."""
        t0 = time.perf_counter()
        lost = self._proc
        if lost is not None and not lost.alive:
            # it died since its last line (code that line left running ended it, or a total between lines): this
            # line does not run, and says the state is gone, as the line that crashed it would have (run on a
            # fresh kernel instead, it would meet a namespace emptied without a word)
            limit = lost.ended_by()
            self._lose(lost)
            return ExecResult("crashed", restarted=True, duration_s=time.perf_counter() - t0, limit=limit)
        try:
            proc = await self._ready()
        except KernelStartError as err:
            return ExecResult("crashed", output="", error_name=type(err).__name__, restarted=True,
                              duration_s=time.perf_counter() - t0)
        wall = self.limits.wall_s if timeout is None else timeout
        fut = proc.send("execute_request", _exec_content(code, op="run", mode=mode, digest=digest))
        reply = await proc.wait(fut, wall)
        status = "ok"
        if reply is None and proc.alive:  # ran past the wall limit: interrupt, then give it a moment
            status = "timeout"
            proc.send("interrupt_request", {}, control=True)
            reply = await proc.wait(fut, self.limits.interrupt_grace_s)
            if reply is not None and (proc.level != "rlimits" or proc.uid is not None):  # kill strays
                await proc.request("execute_request", _exec_content("", op="reap"), 1.0)
        if reply is None:  # died, or would not stop
            died = not proc.alive
            if died and log.isEnabledFor(logging.INFO):  # the log is read only when it will be shown
                log.info("sandboxed kernel died: %s", proc.log_tail())
            limit = proc.ended_by() if died else proc.fault
            self._lose(proc)
            return ExecResult("crashed" if died and status != "timeout" else status, restarted=True,
                              error_name=None, duration_s=time.perf_counter() - t0, limit=limit)
        try:
            result = exec_result(reply.get("content"), status, time.perf_counter() - t0,
                                 self.limits.max_output_bytes, self.tools)
        except Malformed as err:  # code inside the kernel forged it: the kernel goes, the line says why
            proc.end(f"a malformed reply ({err})")
            result = ExecResult("crashed", duration_s=time.perf_counter() - t0)
        limit = proc.ended_by()
        if limit is not None:  # a total was hit during the line (one of its processes was killed for it), or its
            self._lose(proc)   # traffic broke a budget: the kernel goes with it, and the line is a crash that says why
            result.status, result.restarted, result.limit = "crashed", True, limit
        return result

    async def interrupt(self) -> None:
        """Send a message-mode interrupt (KeyboardInterrupt in the running code)."""
        if self._proc is not None and self._proc.alive:
            self._proc.send("interrupt_request", {}, control=True)

    async def restart(self) -> None:
        """Replace the kernel process with a fresh one (all state is lost)."""
        if self._proc is not None:
            self._proc.kill()
            self.restarts += 1
        self._proc = None
        self._proc = await self._spawn()

    async def shutdown(self) -> None:
        """Kill the kernel and remove its files. Safe to call twice."""
        if self._replacing is not None:
            self._replacing.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._replacing
            self._replacing = None
        if self._proc is not None:
            self._proc.kill()
            self._proc = None
        if self._held is not None:
            zygote.release(self._held)
            self._held = None


def _exec_content(code: str, **opts: Any) -> dict:
    return {"code": code, "silent": True, "store_history": False, "user_expressions": opts,
            "allow_stdin": False, "stop_on_error": False}
