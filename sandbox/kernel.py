"""One sandboxed ipykernel: start, execute, interrupt, restart, shutdown.

The kernel process is started by us (not by jupyter_client's KernelManager) so that we own its isolation wrapper,
its process group and its death notification (a pidfd on the event loop). We talk to it with jupyter_client's
``Session`` over IPC sockets: the shell channel for requests and the control channel for message-mode interrupts.
The iopub channel is never subscribed: everything we need comes back in the execute_reply (see _kernel_side.py).

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

import zmq
import zmq.asyncio
from jupyter_client.session import Session

from . import zygote
from .errors import KernelStartError
from .kernel_dirs import make_kernel_dir, remove_kernel_dir
from .launch import kernel_env, kill_uid, launch_spec, next_uid, release_uid
from .limits import Limits
from .result import ExecResult, StateDigest, ToolCall

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0


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
        if self._zygote is None:
            self.kdir, self._kdir_lock = make_kernel_dir()
        else:
            self.nice = 0
        self.dead = asyncio.get_running_loop().create_future()
        self.pending: dict[str, asyncio.Future] = {}
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self._pidfd: int | None = None
        self._kdir_fd: int | None = None
        self._reader: asyncio.Task | None = None
        self._closed = False
        self.uid: int | None = None

    async def start(self) -> KernelProcess:
        try:
            return await self._start()
        except BaseException:  # cancelled or failed half-way: leave nothing behind
            self.kill()
            raise

    async def _start(self) -> KernelProcess:
        if self._zygote is not None:
            return await self._start_forked(self._zygote)
        loop = asyncio.get_running_loop()
        assert self.kdir is not None
        work = os.path.join(self.kdir, "work")
        os.mkdir(work)
        conn_file = os.path.join(self.kdir, "connection.json")
        spec = launch_spec(self.level, self.limits, self.kdir, conn_file)
        self.uid = spec.uid
        key = secrets.token_hex(16)
        ip = os.path.join(self.kdir, "k")
        ports = {"shell_port": 1, "iopub_port": 2, "stdin_port": 3, "control_port": 4, "hb_port": 5}
        with open(conn_file, "w") as f:
            json.dump({"transport": "ipc", "ip": ip, "key": key, "signature_scheme": "hmac-sha256", **ports}, f)
        if spec.uid is not None:  # the kernel drops to this uid: it must own its directory
            for path in (self.kdir, work, conn_file):
                os.chown(path, spec.uid, spec.uid)
        self.session = Session(key=key.encode(), signature_scheme="hmac-sha256", username="replrl")
        self._log = open(os.path.join(self.kdir, "kernel.log"), "wb")
        argv = spec.argv if not self.nice else [shutil.which("nice") or "nice", "-n", str(self.nice), *spec.argv]
        self.proc = subprocess.Popen(argv, env=spec.env or None, cwd=spec.cwd, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        self._pidfd = os.pidfd_open(self.proc.pid)
        loop.add_reader(self._pidfd, self._on_exit)
        return await self._connect(ip)

    async def _start_forked(self, server: zygote.Zygote) -> KernelProcess:
        """The kernel forked by ``server`` (see sandbox/zygote.py); its directory is ``view`` in its own view."""
        loop = asyncio.get_running_loop()
        await server.ensure()
        self.kdir, self._kdir_lock, view = server.kernel_dir()
        work = os.path.join(self.kdir, "work")
        os.mkdir(work)
        conn_file = os.path.join(self.kdir, "connection.json")
        self.uid = next_uid(self.limits)
        env = kernel_env(self.limits, view, self.uid, may_reap=True)
        cfg = json.loads(env.pop("REPLRL_SANDBOX"))
        key = secrets.token_hex(16)
        ports = {"shell_port": 1, "iopub_port": 2, "stdin_port": 3, "control_port": 4, "hb_port": 5}
        with open(conn_file, "w") as f:
            json.dump({"transport": "ipc", "ip": os.path.join(view, "k"), "key": key,
                       "signature_scheme": "hmac-sha256", **ports}, f)
        if self.uid is not None:
            for path in (self.kdir, work, conn_file):
                os.chown(path, self.uid, self.uid)
        self.session = Session(key=key.encode(), signature_scheme="hmac-sha256", username="replrl")
        self._log = open(os.path.join(self.kdir, "kernel.log"), "wb")
        request = {"cfg": cfg, "env": env, "kdir": self.kdir, "view_kdir": view, "tmp": server.tmp,
                   "work": os.path.join(view, "work"), "conn": os.path.join(view, "connection.json"),
                   "network": self.limits.network}
        try:
            forked = await server.fork(request, self._log.fileno(), START_TIMEOUT_S)
        except (RuntimeError, OSError, asyncio.TimeoutError) as err:
            raise KernelStartError(f"sandboxed kernel (bwrap, forked) did not start: {err}") from None
        self._pidfd, self.pid = forked.pidfd, forked.pid
        loop.add_reader(self._pidfd, self._on_exit)
        # the sockets' path through an fd of the directory: a kernel directory inside the fork server's is longer
        # than a unix socket's 108 bytes allow where the temp directory is deep (pytest's)
        self._kdir_fd = os.open(self.kdir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return await self._connect(f"/proc/self/fd/{self._kdir_fd}/k")

    async def _connect(self, ip: str) -> KernelProcess:
        ctx = zmq.asyncio.Context.instance()
        self.shell = ctx.socket(zmq.DEALER)
        self.control = ctx.socket(zmq.DEALER)
        for sock, port in ((self.shell, 1), (self.control, 4)):
            sock.linger = 0
            sock.connect(f"ipc://{ip}-{port}")
        self._reader = asyncio.ensure_future(self._read(self.shell))
        self._control_reader = asyncio.ensure_future(self._read(self.control))
        reply = await self.request("kernel_info_request", {}, timeout=START_TIMEOUT_S)
        if reply is None:
            tail = self.log_tail()
            raise KernelStartError(f"sandboxed kernel ({self.level}) did not start: {tail}")
        return self

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

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        with contextlib.suppress(asyncio.CancelledError, zmq.ZMQError):
            while True:
                frames = await sock.recv_multipart(copy=True)
                try:
                    _, frames = self.session.feed_identities(frames, copy=True)
                    msg = self.session.deserialize(frames, content=True, copy=True)
                except Exception:  # a malformed or forged message: ignore it
                    continue
                fut = self.pending.pop(msg["parent_header"].get("msg_id"), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def send(self, msg_type: str, content: dict, *, control: bool = False) -> asyncio.Future:
        msg = self.session.msg(msg_type, content)
        fut = asyncio.get_running_loop().create_future()
        self.pending[msg["header"]["msg_id"]] = fut
        self.session.send(self.control if control else self.shell, msg)
        return fut

    async def wait(self, fut: asyncio.Future, timeout: float) -> dict | None:
        """The reply, or None if the kernel died or ``timeout`` passed first."""
        if not fut.done():
            await asyncio.wait((fut, self.dead), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        return fut.result() if fut.done() else None

    async def request(self, msg_type: str, content: dict, timeout: float) -> dict | None:
        return await self.wait(self.send(msg_type, content), timeout)

    def log_tail(self, n: int = 600) -> str:
        try:
            with open(os.path.join(self.kdir or "", "kernel.log"), "rb") as f:
                return f.read()[-n:].decode(errors="replace").strip() or "(no output)"
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the whole process tree and free every resource. Idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        for task in (self._reader, getattr(self, "_control_reader", None)):
            if task is not None:
                task.cancel()
        for sock in (getattr(self, "shell", None), getattr(self, "control", None)):
            if sock is not None:
                sock.close(linger=0)
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
        if hasattr(self, "_log"):
            self._log.close()
        if self._kdir_fd is not None:
            os.close(self._kdir_fd)
            self._kdir_fd = None
        if self.kdir is not None:
            remove_kernel_dir(self.kdir, self._kdir_lock)
        if self._zygote is not None:
            zygote.release(self._zygote)
            self._zygote = None


Spawner = Callable[[], Awaitable[KernelProcess]]


class Kernel:
    """A sandboxed Python kernel with persistent state. Use ``async with Kernel(limits) as k``.

    A kernel that dies (or is killed by the recovery ladder) is replaced by a fresh one: the result of the call
    that lost it says ``restarted=True``, and later calls run on the new kernel.
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
        if self._replacing is not None:
            await self._replacing
            self._replacing = None
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
            if died:
                log.info("sandboxed kernel died: %s", proc.log_tail())
            self._lose(proc)
            return ExecResult("crashed" if died and status != "timeout" else status, restarted=True,
                              error_name=None, duration_s=time.perf_counter() - t0)
        return _result(reply, status, time.perf_counter() - t0)

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


def _result(reply: dict, status: str, duration: float) -> ExecResult:
    data = reply["content"].get("replrl")
    if data is None:  # the kernel answered but not with our payload: treat as a broken kernel
        return ExecResult("crashed", duration_s=duration, error_name=reply["content"].get("ename"))
    try:  # code running inside the kernel process could forge the payload: its shape is checked, never trusted
        error = data.get("error_name")
        if status == "ok" and error:
            status = "error"
        calls = [ToolCall(c["name"], list(c["args"]), dict(c.get("kwargs", {}))) for c in data["calls"]]
        if not isinstance(data["output"], str) or not all(isinstance(c.name, str) for c in calls):
            raise TypeError("malformed reply")
        return ExecResult(status, output=data["output"], error_name=error if isinstance(error, str) else None,
                          duration_s=duration, truncated=bool(data["truncated"]), incomplete=bool(data["incomplete"]),
                          tool_calls=calls, state=_state(data.get("state")))
    except (AttributeError, KeyError, TypeError, ValueError):
        return ExecResult("crashed", duration_s=duration, error_name="MalformedReply")


def _state(data: Any) -> StateDigest | None:
    """The digest in a reply, if it has the shape the kernel makes (user code could forge it: nothing else is read)."""
    if not isinstance(data, dict) or not all(isinstance(data.get(k), str) and len(data[k]) <= 64
                                             for k in ("named", "values")):
        return None
    number = (int, float)
    return StateDigest(data["named"], data["values"],
                       ms=float(data["ms"]) if isinstance(data.get("ms"), number) else 0.0,
                       marked=int(data["marked"]) if isinstance(data.get("marked"), int) else 0,
                       names=int(data["names"]) if isinstance(data.get("names"), int) else 0)
