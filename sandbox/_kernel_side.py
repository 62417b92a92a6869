"""The program that runs INSIDE the sandbox: a small ipykernel wrapper kernel.

It is never imported by the host. ``sandbox.kernel`` reads this file and starts it with ``python -c``, so it may use
the standard library and ipykernel only. Configuration arrives as JSON in the environment variable
``REPLRL_SANDBOX`` (uid/gid to drop to, resource limits, output cap).

Every ``execute_request`` runs through ``code.InteractiveInterpreter`` -- CPython's own interactive semantics
(``codeop`` compilation, ``repr`` display hook, plain tracebacks against ``<stdin>``) -- and the execute_reply
carries one extra key, ``replrl``, with everything the host needs: the captured output (stdout and stderr
interleaved in order, capped here, inside the kernel), the exception name, whether the source was incomplete,
and the calls made to injected tools. Options ride in ``user_expressions``:

    {"op": "run", "mode": "single" | "exec"}       run ``code``
    {"op": "tools", "names": [...]}               define recording tool functions in the namespace
    {"op": "reap"}                                kill stray processes the code left behind
"""

import json
import os
import resource
import sys

_CFG = json.loads(os.environ.pop("REPLRL_SANDBOX", "{}"))


def _drop_privileges(uid, gid):
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise SystemExit("sandbox: failed to drop privileges")


if _CFG.get("uid") is not None and os.getuid() == 0:
    _drop_privileges(_CFG["uid"], _CFG["gid"])

import asyncio  # noqa: E402
import builtins  # noqa: E402
import code  # noqa: E402
import io  # noqa: E402
import signal  # noqa: E402

from ipykernel.kernelapp import IPKernelApp  # noqa: E402
from ipykernel.kernelbase import Kernel  # noqa: E402

_RLIMITS = {
    "as": resource.RLIMIT_AS,
    "nproc": resource.RLIMIT_NPROC,
    "fsize": resource.RLIMIT_FSIZE,
    "nofile": resource.RLIMIT_NOFILE,
    "core": resource.RLIMIT_CORE,
}


def _apply_limits(limits):
    for name, value in limits.items():
        if value is not None:
            resource.setrlimit(_RLIMITS[name], (value, value))


class _Capture(io.TextIOBase):
    """The one sink for stdout and stderr: keeps order, keeps at most ``cap`` characters, drops the rest."""

    def __init__(self, cap):
        self.cap = cap
        self.parts = []
        self.size = 0
        self.truncated = False

    def write(self, s):
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        room = self.cap - self.size
        if room > 0:
            piece = s if len(s) <= room else s[:room]
            self.parts.append(piece)
            self.size += len(piece)
        if len(s) > max(room, 0):
            self.truncated = True
        return len(s)

    def take(self):
        text, truncated = "".join(self.parts), self.truncated
        self.parts, self.size, self.truncated = [], 0, False
        return text, truncated

    def writable(self):
        return True

    def isatty(self):
        return False

    @property
    def encoding(self):
        return "utf-8"

    def flush(self):
        pass


class _Interpreter(code.InteractiveInterpreter):
    """CPython's interactive interpreter, remembering the name of the last exception it showed."""

    error_name = None

    def showsyntaxerror(self, *args, **kwargs):
        self.error_name = sys.exc_info()[0].__name__
        super().showsyntaxerror(*args, **kwargs)

    def showtraceback(self):
        self.error_name = sys.exc_info()[0].__name__
        super().showtraceback()


def _jsonable(value):
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item) and type(value).__module__ == "numpy":
        try:
            return _jsonable(item())
        except Exception:
            pass
    if type(value).__name__ in ("Fraction", "Decimal"):
        return str(value)
    try:
        return repr(value)[:1000]
    except Exception:
        return "<unrepresentable>"


class ReplKernel(Kernel):
    implementation = "replrl-sandbox"
    implementation_version = "1"
    language = "python"
    language_info = {
        "name": "python",
        "version": sys.version.split()[0],
        "mimetype": "text/x-python",
        "file_extension": ".py",
    }
    banner = ""
    _execute_sleep = 0.0

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.pid = os.getpid()
        self.capture = _Capture(_CFG.get("max_output", 64_000))
        self.namespace = {"__name__": "__main__", "__doc__": None, "__builtins__": builtins}
        self.interp = _Interpreter(self.namespace)
        self.calls = []
        self._recursion_limit = None
        sys.stdin = io.StringIO("")  # input() fails at once with EOFError, as CPython's does without a stdin
        sys.displayhook = sys.__displayhook__
        sys.excepthook = sys.__excepthook__

    # SIGINT stays ignored while ipykernel's own code runs; it is the default handler only around user code.
    def pre_handler_hook(self):
        pass

    def post_handler_hook(self):
        pass

    def _reply(self, **payload):
        return {"status": "ok", "execution_count": self.execution_count, "payload": [], "user_expressions": {},
                "replrl": payload}

    async def do_execute(self, code, silent, store_history=True, user_expressions=None, allow_stdin=False,
                         **kwargs):
        opts = user_expressions or {}
        op = opts.get("op", "run")
        if op == "tools":
            for name in opts.get("names", []):
                self.namespace[name] = self._make_tool(name)
            return self._reply(ok=True)
        if op == "reap":  # only sent when this kernel owns its uid or pid namespace
            return self._reply(killed=_reap_strays(self.pid) if _CFG.get("may_reap") else 0)
        return self._reply(**self._run(code, opts.get("mode", "single")))

    def _set_recursion_headroom(self):
        """Give user code the recursion headroom of a plain interpreter (limit 1000 with its <stdin> frame at
        depth 1), although it runs below ipykernel's frames; a limit the user set is left alone."""
        if self._recursion_limit is not None and sys.getrecursionlimit() != self._recursion_limit:
            return
        depth, frame = 0, sys._getframe()
        while frame is not None:
            depth, frame = depth + 1, frame.f_back
        self._recursion_limit = 1000 + depth + 4  # calibrated: `python -i` shows "repeated 996 more times"
        sys.setrecursionlimit(self._recursion_limit)

    def _run(self, source, mode):
        self._set_recursion_headroom()
        sys.stdout = sys.stderr = self.capture
        sys.stdin = io.StringIO("")
        self.interp.error_name = None
        self.calls = []
        exited = interrupted = False
        more = False
        running_loop = asyncio.events._get_running_loop()
        asyncio.events._set_running_loop(None)  # user code sees no loop, as in a plain interpreter (asyncio.run)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            if mode == "single":
                more = self.interp.runsource(source, "<stdin>", "single")
            else:
                self._run_exec(source)
        except SystemExit:
            exited = True
        except KeyboardInterrupt:  # arrived outside the user's code (e.g. while compiling)
            interrupted = True
            self.capture.write("\nKeyboardInterrupt\n")
        finally:
            try:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            except KeyboardInterrupt:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            asyncio.events._set_running_loop(running_loop)
        if os.getpid() != self.pid:  # a fork of the kernel made by user code must not serve requests
            os._exit(0)
        output, truncated = self.capture.take()
        error = self.interp.error_name
        if interrupted:
            error = "KeyboardInterrupt"
        elif exited:
            error = "SystemExit"
        return {"output": output, "truncated": truncated, "error_name": error, "incomplete": bool(more),
                "calls": self.calls}

    def _run_exec(self, source):
        try:
            compiled = compile(source, "<stdin>", "exec")
        except (OverflowError, SyntaxError, ValueError):
            self.interp.showsyntaxerror("<stdin>")
            return
        self.interp.runcode(compiled)

    def _make_tool(self, name):
        calls = self  # the list is replaced per run, so look it up at call time

        def tool(*args, **kwargs):
            calls.calls.append({"name": name, "args": [_jsonable(a) for a in args],
                                "kwargs": {k: _jsonable(v) for k, v in kwargs.items()}})

        tool.__name__ = tool.__qualname__ = name
        return tool


def _reap_strays(me):
    """Kill every process of this uid except this one (pid 1 of a pid namespace is left alone)."""
    uid, killed = os.getuid(), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in (me, 1):
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid == uid:
                os.kill(int(entry), signal.SIGKILL)
                killed += 1
        except OSError:
            pass
    return killed


def main():
    app = IPKernelApp.instance(kernel_class=ReplKernel, capture_fd_output=False, quiet=True)
    app.initialize(sys.argv[1:])
    sys.stdout = sys.stderr = app.kernel.capture
    _apply_limits(_CFG.get("rlimits", {}))
    app.start()


if __name__ == "__main__":
    main()
