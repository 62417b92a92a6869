"""The program that runs INSIDE the sandbox: a small ipykernel wrapper kernel.

It is never imported by the host. ``sandbox.kernel`` reads this file and starts it with ``python -c``, so it may use
the standard library and ipykernel only. Configuration arrives as JSON in the environment variable
``REPLRL_SANDBOX`` (uid/gid to drop to, resource limits, output cap). The fork server (``_zygote_side.py``) runs
this same source with ``_ZYGOTE = True``: nothing per kernel happens at import, and each forked kernel calls
``kernel_main`` with its own configuration.

Every ``execute_request`` runs through ``code.InteractiveInterpreter`` -- CPython's own interactive semantics
(``codeop`` compilation, ``repr`` display hook, plain tracebacks against ``<stdin>``) -- and the execute_reply
carries one extra key, ``replrl``, with everything the host needs: the captured output (stdout and stderr
interleaved in order, capped here, inside the kernel), the exception name, whether the source was incomplete,
and the calls made to injected tools. Options ride in ``user_expressions``:

    {"op": "run", "mode": "single" | "exec" | "eof",   run ``code`` (eof: what is pending at end of input);
     "digest": bool}                                   digest: a hash of the namespace after it (_kernel_digest.py)
    {"op": "tools", "names": [...]}                    define recording tool functions in the namespace
    {"op": "reap"}                                     kill stray processes the code left behind

What user code sees is a plain ``python -i`` of the same interpreter, not this process: ``sys.argv == ['']``,
``sys.path`` and ``builtins`` as the interpreter had them before ipykernel was imported (debugpy adds ``execfile``
and ``runfile``; the host's import directories, passed as ``import_path`` to find ipykernel, are taken out again).

A tool call is recorded as plain data, made here, at call time (see ``_jsonable``): the host never receives an object
of the code's making, so nothing the code defines (``__eq__``, ``__repr__``, ...) can run on the host or compare equal
by accident. Only calls made while a line runs count, from its own thread or a thread it started; a call from a
thread an earlier line left running, or from a forked child, is dropped.
"""

import builtins
import json
import os
import resource
import sys

_CFG = json.loads(os.environ.pop("REPLRL_SANDBOX", "{}"))
_START_ENV = dict(os.environ)  # what the imports below add (debugpy's settings) a forked kernel adds to its own
_PLAIN_PATH = list(sys.path)  # the interpreter's own (no PYTHONPATH is set): what `python -i` shows
_PLAIN_BUILTINS = dict(vars(builtins))
sys.path.extend(p for p in _CFG.get("import_path", []) if p not in sys.path)  # where the host found ipykernel


def _drop_privileges(uid, gid):
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise SystemExit("sandbox: failed to drop privileges")


_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 2, 4, 8, 16384, 1 << 18
_CLONE_NEWCGROUP = 0x02000000
_DEVPTS_OPTIONS = "newinstance,ptmxmode=0666,mode=620,max={}"
"""A devpts instance of the kernel's own (the options bwrap's ``--dev`` uses), holding at most ``max`` terminals
(``sandbox.launch.PTYS_PER_KERNEL``): a kernel that opens every pty it may runs out of its own, no one else's."""


def _mount(source, target, fstype, flags, data=None):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def enc(text):
        return None if text is None else text.encode()

    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _own_cgroup_namespace():
    """A cgroup namespace rooted at the cgroup the kernel just joined: ``/proc/self/cgroup`` says ``/``, not the
    host's name for it (which holds the host's pid and the kernel's number among its kernels)."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWCGROUP) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWCGROUP): {os.strerror(err)}")


def _confine(cfg):
    """What the kernel program does with its privileges before it drops them, before any model-written line:
    join the kernel's memory cgroup through the descriptor its host opened (``sandbox/budget.py``), and make its
    working directory a tmpfs of its own mount namespace, bounded in bytes and inodes (nothing the kernel writes
    reaches the host's disk, and its total is the kernel's limit); a booted bwrap kernel mounts a devpts with a
    bounded number of terminals over the one bwrap gave it (a forked kernel's init has mounted one already). Each step
    the host asked for must succeed, or the kernel does not start."""
    fd = cfg.get("cgroup_fd")
    if fd is not None:
        try:
            os.write(fd, b"0")
            if os.getuid() == 0:  # the capability to make the namespace goes with the uid
                _own_cgroup_namespace()
        except OSError as err:
            raise SystemExit(f"sandbox: could not join the kernel's cgroup: {err}") from None
        finally:
            os.close(fd)
    ptys = cfg.get("devpts_max")
    if ptys:
        try:
            _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
            _mount("devpts", "/dev/pts", "devpts", _MS_NOSUID | _MS_NOEXEC, _DEVPTS_OPTIONS.format(int(ptys)))
        except OSError as err:
            raise SystemExit(f"sandbox: could not give the kernel its terminals: {err}") from None
    work = cfg.get("work_tmpfs")
    if work is not None:
        here = os.getcwd()
        owner = f",uid={cfg['uid']},gid={cfg['gid']}" if cfg.get("uid") is not None else ""
        try:
            _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing mounted here is seen outside
            _mount("tmpfs", here, "tmpfs", _MS_NOSUID | _MS_NODEV,
                   f"size={work['bytes']},nr_inodes={work['inodes']},mode=0700{owner}")
        except OSError as err:
            raise SystemExit(f"sandbox: could not give the kernel its working directory: {err}") from None
        os.chdir(here)


_DENIED_SYSCALLS = {
    "EPERM": ("add_key", "request_key", "keyctl",  # keyrings: a channel between kernels, state a uid carries on
              "inotify_init", "inotify_init1",  # who opens which file of the shared stdlib and /usr, seen
              "perf_event_open"),  # a side channel and a large attack surface (the host's paranoid setting aside)
    "ENOSYS": ("io_setup", "io_submit", "io_getevents", "io_destroy", "io_cancel", "io_pgetevents",  # one kernel
               # could hold every AIO event of the machine (fs.aio-max-nr) and make everyone else's io_setup fail
               "io_uring_setup", "io_uring_enter", "io_uring_register"),  # a large attack surface
}
"""System calls every process of a kernel is refused, by the errno it gets. ENOSYS where the callers probe for the
feature and fall back when the kernel lacks it (libaio's users and liburing/libuv go to synchronous or threaded I/O
on ENOSYS, as on a kernel built without AIO or io_uring); EPERM where the call is one a permission may deny (GNU
``tail -f`` polls when inotify is refused; perf tools say they lack the permission)."""


def _install_seccomp():
    """A seccomp filter, made by libseccomp (its Python binding), that every process of the kernel inherits and
    none can remove: the calls of ``_DENIED_SYSCALLS`` fail with their errno, and new user namespaces (uid 0 of a
    namespace of its own) with EPERM; ``clone3``, whose flags a filter cannot read, says ENOSYS, so the C library
    falls back to ``clone``, whose flags it can. A call this libseccomp cannot name is left out (io_uring before
    libseccomp 2.4.2: kernels there may call it) rather than failing every kernel's start."""
    import errno

    seccomp = _import_seccomp()
    newuser = 0x10000000  # CLONE_NEWUSER
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for err, names in _DENIED_SYSCALLS.items():
        for name in names:
            if seccomp.resolve_syscall(seccomp.Arch.NATIVE, name) != -1:  # -1: __NR_SCMP_ERROR, an unknown name
                rules.add_rule(seccomp.ERRNO(getattr(errno, err)), name)
    for name in ("unshare", "clone"):  # flags are the first argument of both (x86-64, arm64)
        rules.add_rule(seccomp.ERRNO(errno.EPERM), name, seccomp.Arg(0, seccomp.MASKED_EQ, newuser, newuser))
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    rules.load()


def _import_seccomp():
    """libseccomp's own Python binding where installed, else pyseccomp (API-compatible, on PyPI). pyseccomp finds its
    libraries with ``ctypes.util.find_library``, which runs ``ldconfig``/``gcc`` (80 ms of CPU per kernel boot): the
    usual sonames are tried first."""
    try:
        import seccomp

        return seccomp
    except ImportError:
        pass
    import ctypes
    import ctypes.util

    slow = ctypes.util.find_library

    def fast(name):
        for soname in {"c": ("libc.so.6",), "seccomp": ("libseccomp.so.2",)}.get(name, ()):
            try:
                ctypes.CDLL(soname)
                return soname
            except OSError:
                pass
        return slow(name)

    ctypes.util.find_library = fast
    try:
        import pyseccomp
    finally:
        ctypes.util.find_library = slow
    return pyseccomp


def _before_serving(cfg):
    """Confine, drop to the kernel's uid, install the filter: in this order, for booted and forked kernels alike."""
    if os.getuid() == 0 or cfg.get("work_tmpfs") is not None or cfg.get("cgroup_fd") is not None:
        _confine(cfg)
    if cfg.get("uid") is not None and os.getuid() == 0:
        _drop_privileges(cfg["uid"], cfg["gid"])
    if cfg.get("seccomp"):
        try:
            _install_seccomp()
        except Exception as err:
            raise SystemExit(f"sandbox: could not install the seccomp filter: {type(err).__name__}: {err}") from None


if not globals().get("_ZYGOTE"):
    _before_serving(_CFG)

import __future__  # noqa: E402

import asyncio  # noqa: E402
import code  # noqa: E402
import functools  # noqa: E402
import io  # noqa: E402
import math  # noqa: E402
import operator  # noqa: E402
import reprlib  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402

from ipykernel.kernelapp import IPKernelApp  # noqa: E402
from ipykernel.kernelbase import Kernel  # noqa: E402

_DIGEST = {"__name__": "_kernel_digest"}
exec(compile(globals().get("_DIGEST_SOURCE", ""), "_kernel_digest.py", "exec"), _DIGEST)  # set by sandbox.launch
_state_digest = _DIGEST.get("state_digest")

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


_FUTURE_FLAGS = functools.reduce(operator.or_, (getattr(__future__, name).compiler_flag
                                                for name in __future__.all_feature_names))
"""The compiler flags that ``from __future__ import ...`` sets (codeop's own incomplete-input flags excluded)."""


class _Interpreter(code.InteractiveInterpreter):
    """CPython's interactive interpreter, remembering the name of the last exception it showed."""

    error_name = None

    def showsyntaxerror(self, *args, **kwargs):
        self.error_name = sys.exc_info()[0].__name__
        super().showsyntaxerror(*args, **kwargs)

    def showtraceback(self):
        self.error_name = sys.exc_info()[0].__name__
        super().showtraceback()


MAX_CALLS = 16
"""Tool calls recorded per line; later ones are dropped (the host reads the first ``submit``)."""
MAX_ARGS = 8
"""Arguments recorded per call (positional, then keyword); the rest are dropped."""
MAX_STR = 1000
"""Characters of a submitted string; a longer one is recorded as rejected."""
MAX_INT_BITS = 3322
"""A submitted int up to 1000 decimal digits is kept; a larger one is rejected (Python will not even print ints past
4300 digits, so json could not encode it)."""
MAX_CALLS_BYTES = 64_000
"""JSON bytes of all the calls recorded for one line; calls past it are dropped."""
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 200
_REPR.maxlevel = 3


def _rejected(reason, value):
    """The record of a value that is not plain data: a dict that no answer check reads as a number."""
    if isinstance(value, int) and int.bit_length(value) > MAX_INT_BITS:
        shown = f"<int of {int.bit_length(value)} bits>"  # repr() itself refuses past 4300 digits
    else:
        try:
            shown = _REPR.repr(value)[:MAX_STR]
        except Exception:
            shown = "<unrepresentable>"
    return {"rejected": reason, "repr": shown if isinstance(shown, str) else "<unrepresentable>"}


def _jsonable(value, numpy_ok=True):
    """A submitted value as plain JSON data, computed with the base types' own methods (never an override):

    None, bool, int (up to 1000 digits), finite float and str (up to 1000 characters) as themselves, subclasses as
    their base value (``class A(int)`` with a lying ``__eq__`` arrives as the int); Fraction and Decimal as their
    ``str`` ("3/4", "2.50"); numpy scalars as the Python value of ``item()``. Anything else -- containers, objects
    with ``__index__``/``__float__``/``__str__``, NaN and infinities, oversized ints and strings -- as
    ``{"rejected": why, "repr": short repr}``.
    """
    if value is None or type(value) is bool:
        return value
    if isinstance(value, int):
        if int.bit_length(value) > MAX_INT_BITS:
            return _rejected("int longer than 1000 digits", value)
        return int.__index__(value)
    if isinstance(value, float):
        number = float.__float__(value)
        return number if math.isfinite(number) else _rejected("float is not finite", value)
    if isinstance(value, str):
        text = str.__str__(value)
        return text if len(text) <= MAX_STR else _rejected(f"str longer than {MAX_STR} characters", text[:MAX_STR])
    fractions, decimal, numpy = (sys.modules.get(m) for m in ("fractions", "decimal", "numpy"))
    try:
        if fractions is not None and isinstance(value, fractions.Fraction):
            num, den = (_jsonable(getattr(fractions.Fraction, a).fget(value)) for a in ("numerator", "denominator"))
            if type(num) is not int or type(den) is not int:
                return _rejected("Fraction with a part that is not an int of at most 1000 digits", value)
            return str(num) if den == 1 else f"{num}/{den}"
        if decimal is not None and isinstance(value, decimal.Decimal):
            if not decimal.Decimal.is_finite(value):
                return _rejected("Decimal is not finite", value)
            return _jsonable(decimal.Decimal.__str__(value))
        if numpy_ok and numpy is not None and isinstance(value, numpy.generic):
            return _jsonable(numpy.generic.item(value), numpy_ok=False)
    except Exception:
        pass
    return _rejected(f"{type(value).__name__} is not a number or a string", value)


def _record(name, args, kwargs):
    """One call as plain data: at most MAX_ARGS values, each through ``_jsonable``."""
    items = [(None, a) for a in args] + list(kwargs.items())
    kept = items[:MAX_ARGS]
    return {"name": name, "args": [_jsonable(v) for k, v in kept if k is None],
            "kwargs": {str.__str__(k)[:100]: _jsonable(v) for k, v in kept if k is not None}}


def _plain(value):
    """Whether a recorded value is one ``_jsonable`` could have made."""
    if value is None or type(value) is bool:
        return True
    if type(value) is int:
        return int.bit_length(value) <= MAX_INT_BITS
    if type(value) is str:
        return len(value) <= MAX_STR
    if type(value) is float:
        return math.isfinite(value)
    return (type(value) is dict and set(value) == {"rejected", "repr"}
            and all(type(v) is str and len(v) <= MAX_STR for v in value.values()))


def _checked_calls(calls):
    """The calls of one line as they go into the reply: only well-formed plain records (the list is reachable from
    user code, e.g. through the tool's closure), at most MAX_CALLS of them and MAX_CALLS_BYTES of JSON."""
    out, size = [], 0
    for call in calls[:MAX_CALLS]:
        try:
            ok = (type(call) is dict and set(call) == {"name", "args", "kwargs"} and type(call["name"]) is str
                  and type(call["args"]) is list and type(call["kwargs"]) is dict
                  and len(call["args"]) + len(call["kwargs"]) <= MAX_ARGS
                  and all(map(_plain, call["args"])) and all(map(_plain, call["kwargs"].values()))
                  and all(type(k) is str for k in call["kwargs"]))
            size += len(json.dumps(call)) if ok else 0
        except Exception:
            ok = False
        if ok and size <= MAX_CALLS_BYTES:
            out.append(call)
    return out


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
        self.tool_names = frozenset()
        """Names of the injected tools: not part of the state digest."""
        self.calls = None
        """The calls of the line running now (None between lines); see ``_make_tool``."""
        self._calls_lock = threading.Lock()
        self._run_thread = None
        self._older_threads = frozenset()
        self._ran = False
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
            self.tool_names = self.tool_names | frozenset(opts.get("names", []))
            return self._reply(ok=True)
        if op == "reap":  # only sent when this kernel owns its uid or pid namespace
            return self._reply(killed=_reap_strays(self.pid) if _CFG.get("may_reap") else 0)
        reply = self._run(code, opts.get("mode", "single"))
        if opts.get("digest") and _state_digest is not None:
            try:
                reply["state"] = _state_digest(self.namespace, self.tool_names)
            except BaseException:  # a KeyboardInterrupt that arrives late, a MemoryError: no digest, never a failure
                reply["state"] = None
        return self._reply(**reply)

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
        if not self._ran:
            _look_like_python_i()
            self._ran = True
        self._set_recursion_headroom()
        sys.stdout = sys.stderr = self.capture
        sys.stdin = io.StringIO("")
        self.interp.error_name = None
        with self._calls_lock:
            self._run_thread = threading.get_ident()
            self._older_threads = frozenset(sys._current_frames())  # threads alive before this line began
            self.calls = []
        exited = interrupted = False
        more = False
        running_loop = asyncio.events._get_running_loop()
        asyncio.events._set_running_loop(None)  # user code sees no loop, as in a plain interpreter (asyncio.run)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            if mode == "single":
                more = self.interp.runsource(source, "<stdin>", "single")
            elif mode == "eof":
                self._run_at_eof(source)
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
            with self._calls_lock:  # from here on, a call (from a thread still running) belongs to no line
                calls, self.calls = self.calls, None
        if os.getpid() != self.pid:  # a fork of the kernel made by user code must not serve requests
            os._exit(0)
        output, truncated = self.capture.take()
        error = self.interp.error_name
        if interrupted:
            error = "KeyboardInterrupt"
        elif exited:
            error = "SystemExit"
        return {"output": output, "truncated": truncated, "error_name": error, "incomplete": bool(more),
                "calls": _checked_calls(calls or [])}

    def _run_at_eof(self, source):
        """End of input, as `python -i` meets it: the buffered statement is compiled as it stands (an unclosed
        block runs, an open bracket is CPython's SyntaxError) with the session's __future__ flags."""
        future = self.interp.compile.compiler.flags & _FUTURE_FLAGS  # earlier `from __future__ import ...`
        try:
            compiled = compile(source, "<stdin>", "single", future, True)
        except (OverflowError, SyntaxError, ValueError):
            self.interp.showsyntaxerror("<stdin>")
            return
        self.interp.runcode(compiled)

    def _run_exec(self, source):
        try:
            compiled = compile(source, "<stdin>", "exec")
        except (OverflowError, SyntaxError, ValueError):
            self.interp.showsyntaxerror("<stdin>")
            return
        self.interp.runcode(compiled)

    def _make_tool(self, name):
        kernel = self

        def tool(*args, **kwargs):
            if kernel._may_record() is None:
                return
            record = _record(name, args, kwargs)  # plain data, made now: the objects may change or lie later
            with kernel._calls_lock:
                calls = kernel._may_record()
                if calls is not None:
                    calls.append(record)

        tool.__name__ = tool.__qualname__ = name
        return tool

    def _may_record(self):
        """The list a tool call made now belongs to, or None: no line is running, the line has made MAX_CALLS calls
        already, or the caller is a forked child or a thread that an earlier line started (not this line's doing)."""
        calls, me = self.calls, threading.get_ident()
        if calls is None or len(calls) >= MAX_CALLS or os.getpid() != self.pid:
            return None
        if me != self._run_thread and me in self._older_threads:
            return None
        return calls


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


def _short_ipc_path(argv):
    """Where the kernel binds its sockets, ``/proc/self/fd/N/k`` (a descriptor of the socket directory), when the
    connection file's ``ip`` path is too long for a unix socket (108 bytes with the ``-N`` suffix: a deep temp
    directory); None when it fits. The host reaches the same directory through a descriptor of its own."""
    try:
        with open(argv[argv.index("-f") + 1]) as f:
            info = json.load(f)
    except (ValueError, IndexError, OSError):
        return None
    if info.get("transport") != "ipc" or len(info.get("ip", "").encode()) + 3 <= 100:
        return None
    head, name = os.path.split(info["ip"])
    fd = os.open(head, os.O_PATH | os.O_DIRECTORY)  # held for the kernel's life: its sockets live there
    return f"/proc/self/fd/{fd}/{name}"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    app = IPKernelApp.instance(kernel_class=ReplKernel, capture_fd_output=False, quiet=True)
    short = _short_ipc_path(argv)
    if short is not None:  # the connection file's ip is read in initialize(): the short one replaces it there
        load = app.load_connection_file

        def load_then_shorten(*args, **kwargs):
            load(*args, **kwargs)
            app.ip = short
        app.load_connection_file = load_then_shorten
        app.write_connection_file = lambda **kwargs: None  # the host's file stands (and is read-only here)
    app.initialize(argv)
    sys.stdout = sys.stderr = app.kernel.capture
    _apply_limits(_CFG.get("rlimits", {}))
    app.start()


def _look_like_python_i():
    """Make what user code can see of the process match a plain ``python -i`` of this interpreter. Done just before
    the first line runs: ipykernel imports debugpy (which adds builtins) as late as its first kernel_info_request."""
    sys.argv = [""]
    sys.orig_argv = [sys.orig_argv[0], "-i"]  # not `-c <this program> -f <connection file>`
    sys.path[:] = _PLAIN_PATH
    names = vars(builtins)
    for added in [n for n in names if n not in _PLAIN_BUILTINS]:  # execfile, runfile (debugpy)
        del names[added]
    names.update(_PLAIN_BUILTINS)


def kernel_main(cfg, conn_file):
    """A kernel forked from the fork server: take this kernel's configuration, drop to its uid, run."""
    _CFG.clear()
    _CFG.update(cfg)
    _before_serving(_CFG)
    main(["-f", conn_file])


if __name__ == "__main__" and not globals().get("_ZYGOTE"):
    main()
