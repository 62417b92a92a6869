"""What a kernel reaches of the machine beyond its own share (issue 64), on forked and booted kernels alike.

Three classes, each with its test: system calls that hold or reveal something of the whole machine (AIO events,
io_uring, inotify, perf events), terminals (a devpts instance of each kernel's own, with a bound), and the names and
paths a kernel can read (host name, the host's pid and the kernel's number in its cgroup's name, the configuration on
its init's command line). Real kernels, real calls; the contract is in docs/sandbox.md ("The contract").
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from sandbox import Kernel, Limits, run_sync
from sandbox.launch import KERNEL_HOSTNAME, PTYS_PER_KERNEL, seccomp_available
from sandbox.limits import available, is_root

ROOT_BWRAP = available("bwrap") and is_root()
needs_root_bwrap = pytest.mark.skipif(not ROOT_BWRAP, reason="kernels get namespaces, a devpts and a fork server of "
                                      "their own on a root host with bubblewrap")
BOOTS = {"forked": Limits(wall_s=10.0, uid_base=144000),
         "booted": Limits(wall_s=10.0, uid_base=145000, fork_server=False)}
boots = pytest.mark.parametrize("boot", list(BOOTS))


def run_on(limits: Limits, *codes: str) -> list:
    async def go():
        async with Kernel(limits) as k:
            return [await k.execute(code) for code in codes]

    return run_sync(go())


# -- 1. system calls that hold or reveal something of the whole machine ---------------------------------------------
SYSCALLS = {  # the numbers the C library would use (libc.syscall: no wrapper of glibc's falls back on its own)
    "x86_64": {"io_setup": 206, "io_destroy": 207, "io_getevents": 208, "io_submit": 209, "io_cancel": 210,
               "io_pgetevents": 333, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
               "inotify_init": 253, "inotify_init1": 294, "perf_event_open": 298},
    "aarch64": {"io_setup": 0, "io_destroy": 1, "io_submit": 2, "io_cancel": 3, "io_getevents": 4,
                "io_pgetevents": 292, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
                "inotify_init1": 26, "perf_event_open": 241},
}.get(platform.machine())
CALLS = textwrap.dedent("""
    import ctypes, errno, struct
    libc = ctypes.CDLL(None, use_errno=True)
    numbers = {numbers!r}
    ctx = ctypes.c_ulong(0)
    params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    attr = ctypes.create_string_buffer(128)    # struct perf_event_attr: a software clock of this process, user only
    struct.pack_into('IIQ', attr, 0, 1, 128, 0)          # PERF_TYPE_SOFTWARE, size, PERF_COUNT_SW_CPU_CLOCK
    struct.pack_into('Q', attr, 40, (1 << 5) | (1 << 6))  # exclude_kernel, exclude_hv: allowed at paranoid 2
    zero = ctypes.c_ulong(0)
    args = {{'io_setup': (1, ctypes.byref(ctx)), 'io_destroy': (zero,), 'io_submit': (zero, 0, None),
            'io_getevents': (zero, 0, 0, None, None), 'io_cancel': (zero, None, None),
            'io_pgetevents': (zero, 0, 0, None, None, None), 'io_uring_setup': (1, params),
            'io_uring_enter': (-1, 0, 0, 0, None, 0), 'io_uring_register': (-1, 0, None, 0),
            'inotify_init': (), 'inotify_init1': (0,), 'perf_event_open': (attr, 0, -1, -1, 0)}}
    out = {{}}
    for name, number in numbers.items():
        ctypes.set_errno(0)
        ret = libc.syscall(number, *args[name])
        out[name] = 'ok' if ret >= 0 else errno.errorcode.get(ctypes.get_errno())
    print(sorted(out.items()))
""")


@needs_root_bwrap
@pytest.mark.skipif(not seccomp_available(), reason="libseccomp (pyseccomp) is not available here")
@pytest.mark.skipif(SYSCALLS is None, reason=f"no system call numbers for {platform.machine()} in this test")
@boots
def test_no_aio_io_uring_inotify_or_perf_events(boot):
    """AIO (one kernel could take every event of fs.aio-max-nr and fail everyone else's io_setup) and io_uring (a
    large attack surface) say ENOSYS, as on a kernel built without them, so libraries fall back; inotify (which
    files of the shared /usr and stdlib others open) and perf_event_open (a side channel) say EPERM. Without the
    filter io_setup, io_uring_setup, inotify_init1 and perf_event_open all succeed here."""
    (out,) = run_on(BOOTS[boot], CALLS.format(numbers=SYSCALLS))
    assert out.status == "ok", out
    want = {name: "ENOSYS" if name.startswith("io_") else "EPERM" for name in SYSCALLS}
    assert out.output == f"{sorted(want.items())}\n", out.output


# -- 2. terminals: a devpts of each kernel's own, with a bound -------------------------------------------------------
PTYS = textwrap.dedent("""
    import errno, os
    held, err = [], None
    for _ in range({tries}):
        try:
            held.append(os.openpty())
        except OSError as e:
            err = errno.errorcode.get(e.errno)
            break
    print(len(held), err)
""")


@needs_root_bwrap
@boots
def test_a_kernel_that_opens_every_pty_runs_out_of_its_own_alone(boot):
    """A kernel that opens ptys until it cannot gets PTYS_PER_KERNEL of them, then ENOSPC (its devpts instance's
    ``max``); a kernel running beside it, while it holds them all, still opens its own. Without the bound a kernel
    opened every pty it asked for, up to the machine's kernel.pty.max (shared by every devpts instance)."""
    tries = 3 * PTYS_PER_KERNEL

    async def go():
        async with Kernel(BOOTS[boot]) as a, Kernel(BOOTS[boot]) as b:
            greedy = await a.execute(PTYS.format(tries=tries))  # `held` stays: a keeps its ptys open
            beside = await b.execute("import os\nm, s = os.openpty()\nprint(os.ttyname(s))")
            return greedy, beside

    greedy, beside = run_sync(go())
    assert greedy.output == f"{PTYS_PER_KERNEL} ENOSPC\n", greedy
    assert beside.status == "ok" and beside.output.startswith("/dev/pts/"), beside


# -- 3. names and paths: nothing of the host a kernel does not need -------------------------------------------------
LOOK = textwrap.dedent("""
    import json, os, socket, sys
    def read(path):
        try:
            with open(path, 'rb') as f:
                return f.read().decode(errors='replace')
        except OSError as e:
            return type(e).__name__
    print(json.dumps({'hostname': socket.gethostname(), 'nodename': os.uname().nodename,
                      'hosts': read('/etc/hosts'), 'passwd': read('/etc/passwd'), 'group': read('/etc/group'),
                      'cgroup': read('/proc/self/cgroup'),
                      'init_cmdline': read('/proc/1/cmdline'), 'environ': read('/proc/self/environ'),
                      'env': dict(os.environ), 'argv': sys.argv, 'path': sys.path, 'cwd': os.getcwd(),
                      'ppid': os.getppid()}))
""")


@needs_root_bwrap
@boots
def test_a_kernel_sees_no_name_of_the_host_its_run_or_its_count(boot):
    """The host name (its UTS namespace's, and ``/etc/hosts`` without the network) is KERNEL_HOSTNAME; ``/etc/passwd``
    and ``/etc/group`` hold root and nobody, not the host's accounts; the cgroup it is in is ``/`` of a cgroup
    namespace of its own, not ``replrl-<host pid>-.../k<its number>``; its init's command line (bwrap's, for a booted
    kernel) carries no environment or configuration; no path of the checkout shows. Before: the machine's name (in
    ``/etc/hosts`` too), every account of the host, ``memory:/replrl-<pid>-<hex>/k<N>``, and ``--setenv
    REPLRL_SANDBOX {...uid...}`` on /proc/1/cmdline."""
    import grp
    import pwd

    (out,) = run_on(BOOTS[boot], LOOK)
    assert out.status == "ok", out
    seen = json.loads(out.output)
    text = out.output
    assert seen["hostname"] == seen["nodename"] == KERNEL_HOSTNAME, seen["hostname"]
    host = socket.gethostname()
    if host not in ("localhost", KERNEL_HOSTNAME):
        assert host not in seen["hosts"].split(), seen["hosts"]
    own = {"root", "nobody", "nogroup", "sandbox"}
    assert {line.split(":")[0] for line in seen["passwd"].splitlines()} <= own, seen["passwd"]
    assert {line.split(":")[0] for line in seen["group"].splitlines()} <= own, seen["group"]
    others = {p.pw_name for p in pwd.getpwall()} | {g.gr_name for g in grp.getgrall()}
    assert not (others - own) & set(seen["passwd"].replace(":", " ").split()), seen["passwd"]
    assert all(line.rsplit(":", 1)[1] == "/" for line in seen["cgroup"].splitlines()), seen["cgroup"]
    assert f"replrl-{os.getpid()}-" not in text
    init_argv = seen["init_cmdline"].split("\0")
    assert "--setenv" not in init_argv and not any(a.startswith('{"uid"') for a in init_argv), init_argv[:3]
    assert seen["environ"] == "PermissionError"  # its own initial environment: root's once it dropped its uid
    assert seen["ppid"] == 1 and seen["argv"] == [""]
    checkout = str(Path(__file__).resolve().parents[1])
    if not any(p.startswith(checkout + os.sep) for p in (sys.prefix, sys.base_prefix, sys.executable)):
        assert checkout not in text, [k for k, v in seen.items() if checkout in json.dumps(v)]


def test_replrl_env_says_what_the_filter_and_the_terminals_hold():
    from sandbox.report import mechanisms

    rows = dict(mechanisms())
    if seccomp_available():
        assert all(word in rows["seccomp"] for word in ("AIO", "io_uring", "inotify", "perf_event_open")), rows
    if ROOT_BWRAP:
        assert f"at most {PTYS_PER_KERNEL} ptys" in rows["terminals"], rows
