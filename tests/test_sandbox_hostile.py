"""Hostile kernels against the host and against each other (issue 53), on forked and booted kernels alike.

Each class of attack has its test: the host trusting paths in the kernel's own directory (its log, its sockets), a
tree the host cannot remove, channels between kernels running at the same time (terminals, keyrings), state carried
to a later kernel (keyrings, the fork server's memory), a user namespace of the kernel's own, and totals (memory of
all of a kernel's processes, bytes in its directory). Real kernels, real attacks; the fixes are described in
docs/sandbox.md ("The contract").
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from sandbox import Kernel, Limits, SyncKernelPool, run_sync
from sandbox import budget as budget_mod
from sandbox import zygote as zygote_mod
from sandbox.kernel_dirs import PREFIX, KernelLog, reap_stale_kernel_dirs, remove_tree
from sandbox.launch import seccomp_available
from sandbox.limits import available, is_root

ROOT_BWRAP = available("bwrap") and is_root()
needs_root_bwrap = pytest.mark.skipif(not ROOT_BWRAP, reason="kernels get uids, namespaces and a fork server of "
                                      "their own on a root host with bubblewrap")
BOOTS = {"forked": Limits(wall_s=10.0, uid_base=140000),
         "booted": Limits(wall_s=10.0, uid_base=141000, fork_server=False)}
boots = pytest.mark.parametrize("boot", list(BOOTS))


def limits(boot: str, **kw) -> Limits:
    from dataclasses import replace

    return replace(BOOTS[boot], **kw)


def run_on(boot_limits: Limits, *codes: str, timeout: float | None = None):
    async def go():
        async with Kernel(boot_limits) as k:
            return [await k.execute(code, timeout=timeout) for code in codes], k._proc is None or \
                k._proc._zygote is not None

    return run_sync(go())


# -- 1. the host never trusts the kernel's directory --------------------------------------------------------------
def test_the_log_is_a_pipe_with_no_name_and_the_host_keeps_a_bounded_quoted_tail():
    """A kernel's stdout and stderr are a pipe (issue 64): no name on the host's disk to replace with a FIFO, a link
    to /dev/zero or to a root-only file (the attacks on the file it was), nothing written to the host's disk. The
    host keeps the last bytes, reads without blocking, and quotes them: one line of printable ASCII."""
    log = KernelLog.create()
    try:
        assert os.readlink(f"/proc/self/fd/{log.fd}").startswith("pipe:")
        os.write(log.fd, b"x" * 50_000 + b"the kernel's\nlast words")
        t0 = time.monotonic()
        tail = log.tail(100)
        assert time.monotonic() - t0 < 1.0
        assert tail == ascii("x" * 77 + "the kernel's\nlast words"), tail  # the last 100 bytes, quoted
        assert log.received == 50_000 + 23 and log.dropped == log.received - log.KEEP
        assert log.tail(100) == tail  # nothing new: the same tail, no wait
    finally:
        log.close()
    assert log.tail() == "(no log)"


@needs_root_bwrap
@boots
def test_a_kernel_cannot_touch_its_log_sockets_or_connection_file_and_its_death_is_logged(boot, caplog, tmp_path):
    """The kernel's directory is root's: planting kernel.log (a FIFO, a link to /dev/zero or to a root-only host
    file; the log is a pipe now, with no name) or replacing a socket fails; the host logs the dead kernel's last
    words at INFO, drained from its pipe."""
    secret = tmp_path / "root-only"
    secret.write_text("TOPSECRET")
    secret.chmod(0o600)
    attack = textwrap.dedent(f"""
        import os
        kdir = os.path.dirname(os.getcwd())
        done = []
        for name, make in (('kernel.log', lambda p: os.mkfifo(p)),
                           ('kernel.log', lambda p: os.symlink('/dev/zero', p)),
                           ('kernel.log', lambda p: os.symlink({str(secret)!r}, p)),
                           ('sock/k-1', lambda p: os.symlink('/run/elsewhere', p)),
                           ('connection.json', lambda p: open(p, 'w').write('{{}}'))):
            path = os.path.join(kdir, name)
            try:
                os.rename(path, path + '.old')
            except OSError:
                pass
            try:
                make(path)
                done.append(name)
            except OSError:
                pass
        try:
            os.rename(os.path.join(kdir, 'sock'), os.path.join(kdir, 'elsewhere'))
            done.append('sock moved')
        except OSError:
            pass
        print(done)
    """)
    caplog.set_level(logging.INFO, logger="sandbox.kernel")
    t0 = time.monotonic()
    (changed, died, after), _ = run_on(BOOTS[boot], attack, "import os\nos.write(2, b'last words\\n')\nos._exit(3)",
                                       "6 * 7")
    assert changed.output == "[]\n", changed
    assert died.status == "crashed" and died.restarted, died
    assert after.status == "ok", after
    assert time.monotonic() - t0 < 60
    logged = "\n".join(r.getMessage() for r in caplog.records if "died" in r.getMessage())
    assert "last words" in logged and "TOPSECRET" not in logged, logged


@needs_root_bwrap
@boots
def test_the_hosts_sockets_never_reconnect_to_a_path(boot):
    """Once the kernel has answered, the host's connections are made for good (sandbox/zmtp.py connects once and
    never again): a listener put at the socket's path afterwards is never reached, and the lines still run."""
    import socket

    async def go():
        async with Kernel(BOOTS[boot]) as k:
            proc = k._proc
            sock_dir = os.path.join(proc.kdir, "sock")
            os.rename(os.path.join(sock_dir, "k-1"), os.path.join(sock_dir, "moved"))
            rogue = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            rogue.bind(os.path.join(sock_dir, "k-1"))
            rogue.listen()
            rogue.setblocking(False)
            outs = [(await k.execute(f"{n} + 1", mode="single")).output for n in range(3)]
            try:
                rogue.accept()
                reached = True
            except BlockingIOError:
                reached = False
            rogue.close()
            return outs, reached, os.stat(sock_dir).st_uid

    outs, reached, owner = run_sync(go())
    assert outs == ["1\n", "2\n", "3\n"] and not reached and owner == 0


# -- 2. a tree the host cannot remove --------------------------------------------------------------------------------
def test_remove_tree_takes_deep_trees_links_fifos_and_closed_directories(tmp_path):
    """Without recursion (5000 levels: shutil.rmtree raises RecursionError before Python 3.12.4), without following
    links (their targets stay), without opening FIFOs, through directories made unreadable."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("kept")
    top = tmp_path / "kdir"
    top.mkdir()
    fd = os.open(str(top), os.O_RDONLY)
    for i in range(5000):  # built through descriptors: the path is longer than PATH_MAX
        os.mkdir("d", dir_fd=fd)
        if i % 500 == 0:
            os.symlink(str(target), "link", dir_fd=fd)
            os.mkfifo("fifo", dir_fd=fd)
            os.close(os.open("f", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
        sub = os.open("d", os.O_RDONLY, dir_fd=fd)
        if i == 2:
            os.chmod("d", 0, dir_fd=fd)
        os.close(fd)
        fd = sub
    os.close(fd)
    try:
        assert remove_tree(str(top)) is True
    finally:  # never leave pytest a tree its own cleanup (shutil.rmtree) cannot remove
        _remove_deep(str(top))
    assert not top.exists() and (target / "keep").read_text() == "kept"
    assert remove_tree(str(top)) is True  # gone already: fine
    link = tmp_path / "link-to-target"
    os.symlink(str(target), str(link))
    assert remove_tree(str(link)) is True and target.exists()  # a link is removed, never followed


def _remove_deep(path: str) -> None:
    """Remove a deep tree a failed test left (by renaming each level up to the top: no recursion, no long path)."""
    if not os.path.isdir(path) or os.path.islink(path):
        return
    parent = os.path.dirname(path)
    while os.path.isdir(os.path.join(path, "d")):
        tmp = os.path.join(parent, f".deep-{time.monotonic_ns()}")
        os.rename(os.path.join(path, "d"), tmp)
        subprocess.run(["rm", "-rf", path], check=False)
        os.rename(tmp, path)
    subprocess.run(["rm", "-rf", path], check=False)


def test_a_stale_deep_kernel_directory_never_stops_a_later_kernel(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = tmp_path / f"{PREFIX}stale"
    (tmp_path / f"{PREFIX}stale.lock").write_text("")
    stale.mkdir()
    fd = os.open(str(stale), os.O_RDONLY)
    for _ in range(3000):
        os.mkdir("d", dir_fd=fd)
        sub = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = sub
    os.close(fd)
    try:
        assert reap_stale_kernel_dirs(str(tmp_path)) == [str(stale)]
    finally:
        _remove_deep(str(stale))
    assert os.listdir(tmp_path) == []


@needs_root_bwrap
@boots
def test_a_deep_tree_written_by_a_kernel_ends_nothing(boot, tmp_path, monkeypatch):
    """3000 nested directories (the release once raised RecursionError out of pool.acquire()): the episode ends,
    the pool hands out the next kernel, nothing is left in the temp directory."""
    deep = "import os\nfor _ in range(3000):\n    os.mkdir('d')\n    os.chdir('d')\nprint(len(os.getcwd()) > 6000)"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the pool's own (other test processes share /tmp)
    before = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(PREFIX)}
    with SyncKernelPool(size=1, limits=BOOTS[boot]) as pool:
        for _ in range(2):
            with pool.acquire() as kernel:
                assert kernel.execute(deep).output == "True\n"
        with pool.acquire() as kernel:
            assert kernel.execute("6 * 7", mode="single").output == "42\n"
    time.sleep(0.5)
    after = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(PREFIX)}
    assert after - before == set(), after - before


# -- 3, 4. no channels between kernels, no state between episodes ---------------------------------------------------
KEYS = textwrap.dedent("""
    import ctypes, errno, os
    libc = ctypes.CDLL(None, use_errno=True)
    out = []
    for number, args in ((248, (b'user', b'replrl-channel', b'hello', 5, ctypes.c_long(-4))),  # add_key, user ring
                         (249, (b'user', b'replrl-channel', None, ctypes.c_long(0))),           # request_key
                         (250, (ctypes.c_long(0), ctypes.c_long(-4), ctypes.c_long(0)))):      # keyctl GET_KEYRING_ID
        ret = libc.syscall(number, *args)
        out.append((ret, errno.errorcode.get(ctypes.get_errno())))
    print(out, open('/proc/keys').read().count('replrl-channel'))
""")


@needs_root_bwrap
@pytest.mark.skipif(not seccomp_available(), reason="libseccomp (pyseccomp) is not available here")
@boots
def test_no_kernel_keyrings(boot):
    """add_key, request_key and keyctl fail with EPERM: no key to publish to a kernel running beside it, nor to
    leave under a uid for a later kernel."""
    (first,), _ = run_on(BOOTS[boot], KEYS)
    (second,), _ = run_on(BOOTS[boot], KEYS)
    assert first.output == second.output == "[(-1, 'EPERM'), (-1, 'EPERM'), (-1, 'EPERM')] 0\n", first


USERNS = textwrap.dedent("""
    import ctypes, os, subprocess
    libc = ctypes.CDLL(None, use_errno=True)
    pid = os.fork()
    if pid == 0:  # a single-threaded child: unshare(CLONE_NEWUSER) would work here without the filter
        ok = libc.unshare(0x10000000)
        os._exit(0 if ok == 0 else ctypes.get_errno())
    _, status = os.waitpid(pid, 0)
    tool = subprocess.run(['unshare', '--user', '--map-root-user', 'id', '-u'], capture_output=True, text=True)
    print(os.waitstatus_to_exitcode(status), tool.returncode != 0, repr(tool.stdout))
""")


@needs_root_bwrap
@pytest.mark.skipif(not seccomp_available(), reason="libseccomp (pyseccomp) is not available here")
@boots
def test_no_user_namespace_of_the_kernels_own(boot):
    (out,), _ = run_on(BOOTS[boot], USERNS)
    assert out.output == "1 True ''\n", out  # EPERM in the child; unshare(1) fails, never prints uid 0


@needs_root_bwrap
@boots
def test_kernels_running_together_see_no_terminal_of_the_other(boot):
    """Each kernel has a devpts of its own: a pty another kernel opened (and made world-writable) is not there."""
    opener = "import os, stat\nm, s = os.openpty()\nname = os.ttyname(s)\nos.chmod(name, 0o666)\nprint(name)"

    async def go():
        async with Kernel(BOOTS[boot]) as a, Kernel(BOOTS[boot]) as b:
            name_a = (await a.execute(opener)).output.strip()
            seen_b = (await b.execute("import os\nprint(sorted(os.listdir('/dev/pts')))")).output
            write = await b.execute(f"open({name_a!r}, 'w').write('from b')")
            return name_a, seen_b, write

    name_a, seen_b, write = run_sync(go())
    assert name_a.startswith("/dev/pts/")
    assert seen_b == "['ptmx']\n", seen_b
    assert write.status == "error", write


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(c) for c in f.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def _memory_holds(pid: int, needle: bytes) -> bool:
    """Whether any writable mapping of process ``pid`` holds ``needle`` (the host is root: it may read it)."""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            parts = line.split()
            if not parts[1].startswith("rw"):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            try:
                mem.seek(lo)
                if needle in mem.read(hi - lo):
                    return True
            except (OSError, ValueError, OverflowError):
                continue
    return False


@needs_root_bwrap
def test_a_later_fork_learns_nothing_of_earlier_kernels():
    """The zygote never reads a request (the kernel's directory, uid, environment): after it forked a kernel, its
    memory -- which every later fork inherits -- holds nothing of that kernel's."""
    if not zygote_mod.fork_server_usable("bwrap", BOOTS["forked"]):
        pytest.skip("no fork server here")

    async def go():
        async with Kernel(BOOTS["forked"]) as k:
            server = k._proc._zygote
            name = os.path.basename(k._proc.kdir).encode()
            await k.execute("1")
            with open(f"/proc/{k._proc.pid}/stat") as f:
                helper = int(f.read().rsplit(")", 1)[1].split()[1])  # A, the kernel's own parent: it read the request
            zygote_pids = [p for p in _descendants(server.proc.pid) if p not in _descendants(k._proc.pid)
                           and p not in (k._proc.pid, helper)]
            return zygote_pids, [_memory_holds(pid, name) for pid in zygote_pids]

    zygote_pids, holds = run_sync(go())
    assert zygote_pids
    assert not any(holds), (zygote_pids, holds)


# -- 6. totals -------------------------------------------------------------------------------------------------------
HOG = textwrap.dedent("""
    import os, time
    kids = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:
            block = bytearray(250 * 2**20)  # each child under the per-process limit (its address space ~470 MB)
            for i in range(0, len(block), 4096):
                block[i] = 1
            time.sleep(30)
            os._exit(0)
        kids.append(pid)
    time.sleep(8)
    print('all four alive', all(os.waitpid(p, os.WNOHANG) == (0, 0) for p in kids))
""")


@needs_root_bwrap
@boots
@pytest.mark.parametrize("mechanism", ["cgroup", "watchdog"])
def test_the_memory_of_all_of_a_kernels_processes_is_bounded(boot, mechanism, monkeypatch):
    """4 children x 250 MB under memory_mb=600: each is within its own limit, together they are not. The kernel is
    stopped, the episode ends as a crash that says why, and the next line runs on a fresh kernel."""
    kind, _ = budget_mod.memory_mechanism()
    if mechanism == "cgroup" and kind == "watchdog":
        pytest.skip(f"no cgroup can be made here ({budget_mod.memory_mechanism()[1]})")
    if mechanism == "watchdog":
        monkeypatch.setattr(budget_mod, "_tree", None)
    (hog, after), _ = run_on(limits(boot, memory_mb=600, wall_s=20.0), HOG, "6 * 7")
    assert hog.status == "crashed" and hog.restarted, hog
    assert hog.limit is not None and hog.limit.startswith("memory limit"), hog
    assert after.status == "ok", after


@needs_root_bwrap
@boots
def test_the_bytes_in_a_kernels_directory_are_bounded_and_never_reach_the_hosts_disk(boot):
    """3 files of 24 MB under max_dir_mb=64 (each under max_file_mb): the third fails with ENOSPC; the host's copy
    of the working directory stays empty (the kernel's is a tmpfs of its own mount namespace)."""
    write = textwrap.dedent("""
        import os
        done = 0
        try:
            for i in range(3):
                with open(f'f{i}', 'wb') as f:
                    f.write(b'x' * (24 * 2**20))
                done += 1
        except OSError as err:
            print(done, err.errno)
    """)

    async def go():
        async with Kernel(limits(boot, max_dir_mb=64)) as k:
            out = (await k.execute(write)).output
            return out, os.listdir(os.path.join(k._proc.kdir, "work"))

    out, host_view = run_sync(go())
    assert out == "2 28\n", out  # ENOSPC
    assert host_view == []


def test_the_watchdog_sums_a_directory_without_following_links(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 100_000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"x" * 100_000)
    os.symlink("/usr", str(tmp_path / "link"))
    used = budget_mod.dir_usage(str(tmp_path), 10**9)
    assert 200_000 <= used < 300_000, used


# -- the fork server wherever the interpreter lives ------------------------------------------------------------------
@needs_root_bwrap
def test_the_fork_server_serves_an_interpreter_that_lives_in_the_temp_directory(tmp_path):
    """A virtualenv under the temp directory (CI runners, containers): kernels are forked, see the virtualenv, and
    see no other kernel's directory."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.getcwd()!r})
        from sandbox import Kernel, Limits, run_sync
        async def go():
            async with Kernel(Limits(uid_base=142000)) as a, Kernel(Limits(uid_base=142000)) as b:
                out = await a.execute("import os, sys\\nprint(sys.prefix, sorted(os.listdir('/tmp')))")
                return a._proc._zygote is not None, out.output
        print(*run_sync(go()))
    """)
    res = subprocess.run([str(venv / "bin" / "python"), "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=os.getcwd())
    assert res.returncode == 0, res.stderr[-2000:]
    forked, prefix, *listing = res.stdout.split(maxsplit=2)
    assert forked == "True", res.stdout
    assert prefix == str(venv)
    names = eval(listing[0])  # the kernel's /tmp: its own directory, and where the interpreter lives
    assert len([n for n in names if n.startswith(PREFIX)]) == 1, names


# -- the mechanisms are reported -------------------------------------------------------------------------------------
def test_replrl_env_names_the_mechanisms_in_force():
    from replrl.cli.env import sandbox_lines

    text = "\n".join(sandbox_lines())
    for needle in ("kernel boot:", "seccomp:", "memory of a kernel's processes together:", "kernel directory total:",
                   "terminals:"):
        assert needle in text, text


# -- soak: a pool under repeated hostile episodes --------------------------------------------------------------------
SOAK = [
    "import os\nwhile True:\n    os.fork()",
    "x = bytearray(10 * 2**30)",
    "import os\nos._exit(1)",
    "import os\nfor _ in range(500):\n    os.mkdir('d')\n    os.chdir('d')",
    "import os\ntry:\n    os.mkfifo('../kernel.log.x')\nexcept OSError as e:\n    print(e)",
    "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)",
    "while True:\n    pass",
    "import os\nos.kill(0, 9)",
    KEYS,
]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@needs_root_bwrap
def test_a_pool_survives_a_soak_of_hostile_episodes_and_leaks_nothing(tmp_path, monkeypatch):
    """Two rounds (at least 20 s, at most 45 s) of episodes that fork-bomb, allocate, exit, crash, loop, kill their
    process group, build deep trees and poke at their log; then: no process of the pool's uids, no kernel directory
    (the pool's own temp directory: other test processes share /tmp), no zygote, no cgroup, no host descriptor or
    memory growth."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    soak = Limits(wall_s=1.0, interrupt_grace_s=0.5, uid_base=143000, memory_mb=512)
    before_dirs = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(PREFIX)}
    before_cgroups = set(budget_mod._children(budget_mod._tree.parent)) if budget_mod._tree is not None else set()
    with SyncKernelPool(size=2, limits=soak, tools=["submit"]) as pool:
        with pool.acquire() as kernel:
            kernel.execute("1")
        pool.wait_full(60)
        fds, rss = _fds(), _rss_mb()
        start = time.monotonic()
        episodes = 0
        while time.monotonic() < start + 45 and (episodes < 2 * len(SOAK) or time.monotonic() < start + 20):
            with pool.acquire() as kernel:
                first = kernel.execute(SOAK[episodes % len(SOAK)])
                assert first.status in ("ok", "error", "timeout", "crashed"), first
                assert kernel.execute("6 * 7", mode="single").output == "42\n"
            episodes += 1
        assert pool.wait_full(60)
        time.sleep(1.0)
        assert _fds() <= fds + 2, (fds, _fds())
        assert _rss_mb() < rss + 60, (rss, _rss_mb())
        zygotes = [z for z in zygote_mod._zygotes.values() if z.tmp == str(tmp_path)]  # this pool's (other tests'
        assert len(zygotes) <= 1                                                        # of this process may live)
    assert episodes >= len(SOAK)
    time.sleep(1.0)
    uids = [e for e in os.listdir("/proc") if e.isdigit() and _uid(e) in range(143000, 163000)]
    assert uids == [], "a kernel process outlived the pool"
    after_dirs = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(PREFIX)}
    assert after_dirs - before_dirs == set()
    assert not any(z.alive for z in zygotes)
    if budget_mod._tree is not None:  # a fork-bombed namespace can take seconds to empty on a loaded machine
        assert budget_mod.flush(wait_s=10.0) == 0, "a kernel cgroup outlived its kernel"
        assert _empty_new_cgroups(before_cgroups) == [], "a kernel cgroup outlived its kernel"


def _empty_new_cgroups(before: set[str]) -> list[str]:
    """Kernel cgroups made since ``before`` that no process is in: left behind by a dead kernel. Other pools of this
    test process (the session's ``pool`` fixture, a module's) keep live kernels in theirs, and one of them may be
    starting a kernel right now (its cgroup exists a moment before the kernel joins it): asked again for a while."""
    parent = budget_mod._tree.parent
    deadline = time.monotonic() + 10
    while True:
        empty = []
        for name in sorted(set(budget_mod._children(parent)) - before):
            try:
                with open(os.path.join(parent, name, "cgroup.procs")) as f:
                    if not f.read().split():
                        empty.append(name)
            except FileNotFoundError:
                pass
        if not empty or time.monotonic() > deadline:
            return empty
        time.sleep(0.2)


def _uid(pid: str) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1





def test_a_kernel_stopped_by_a_total_says_so_in_the_transcript():
    from replrl.repl import render_output
    from sandbox import ExecResult

    stopped = ExecResult("crashed", output="partial", restarted=True, limit=budget_mod.memory_words(600 * 2**20))
    assert render_output(stopped) == ("partial\n[the Python process was stopped (memory limit: the kernel's processes "
                                      "together used more than 600 MB) and restarted: all variables are gone]\n")
    assert render_output(ExecResult("crashed", restarted=True)).startswith("[the Python process crashed")


@needs_root_bwrap
def test_a_kernel_that_cannot_be_replaced_ends_the_line_as_a_crash_never_an_exception(tmp_path, monkeypatch):
    """The replacement of a dead kernel fails (here: its temp directory is gone): ``execute`` returns crashed
    results, nothing raises into the caller, and a kernel starts again once it can."""
    async def go():
        async with Kernel(BOOTS["booted"]) as k:
            monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))
            died = await k.execute("import os\nos._exit(1)")
            again = await k.execute("1 + 1", mode="single")
            monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
            back = await k.execute("1 + 1", mode="single")
            return died, again, back

    died, again, back = run_sync(go())
    assert died.status == "crashed" and again.status == "crashed" and again.error_name == "KernelStartError"
    assert back.status == "ok" and back.output == "2\n", back


def test_each_run_starts_its_kernel_uids_at_a_random_place():
    """Uids repeat across runs only by chance (1 in 20000 per kernel), not at every run's first kernel."""
    code = "import sandbox.launch as l; print(next(l._uid_counter))"
    firsts = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
              for _ in range(3)}
    assert len(firsts) >= 2, firsts
