"""Containment: hostile model-written code against real sandboxed kernels. For every case the host survives, the
result has the right status, the kernel (or its replacement) keeps working, the pool returns to full strength
and no process is left behind."""

from __future__ import annotations

import asyncio
import os
import socket
import textwrap
import threading
import time

import pytest

from sandbox import Kernel, Limits, SyncKernelPool, run_sync
from sandbox.limits import is_root

UID_BASE = 120000  # this module's kernels get uids no other test uses (host is root), so we can count them
LIMITS = Limits(wall_s=1.5, interrupt_grace_s=1.0, max_output_bytes=10_000, uid_base=UID_BASE)


def sandbox_pids() -> list[int]:
    """Live processes owned by this module's kernel uids."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if UID_BASE <= os.stat(f"/proc/{entry}").st_uid < UID_BASE + 20000:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def settled_count(expected: int, within_s: float = 3.0) -> int:
    """The number of kernel-uid processes once teardown (asynchronous for a pid namespace) has settled."""
    deadline = time.monotonic() + within_s
    while (n := len(sandbox_pids())) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


@pytest.fixture(scope="module")
def hostile_pool():
    with SyncKernelPool(size=2, limits=LIMITS, tools=["submit"]) as pool:
        yield pool
    if is_root():
        assert settled_count(0) == 0, "closing the pool must leave no kernel process behind"


def run_case(pool, code: str, then: str = "40 + 2", timeout: float | None = None):
    """Run hostile ``code`` then ``then`` on the same kernel; check the pool heals and nothing leaks."""
    with pool.acquire() as kernel:
        first = kernel.execute(code, timeout=timeout)
        second = kernel.execute(then, mode="single")
    assert pool.wait_full(60), "the pool did not return to full strength"
    if is_root():
        assert settled_count(pool.warm) == pool.warm, "a process outlived its kernel"
    return first, second


CASES = {
    # name: (code, expected status, expects a restart, expected error name or None)
    "python_loop": ("while True:\n    pass", "timeout", False, "KeyboardInterrupt"),
    "c_level_loop": ("sum(range(10**13))", "timeout", True, None),
    "sigint_ignored_loop": ("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass",
                            "timeout", True, None),
    "sleep": ("import time\ntime.sleep(100)", "timeout", False, "KeyboardInterrupt"),
    "fork_bomb": ("import os\nwhile True:\n    os.fork()", None, None, None),
    "huge_allocation": ("x = bytearray(10 * 2**30)", "error", False, "MemoryError"),
    "huge_print": ("print('x' * 10**8)", "ok", False, None),
    "endless_print": ("while True:\n    print('spam')", "timeout", False, "KeyboardInterrupt"),
    "huge_file": ("with open('big.bin', 'wb') as f:\n    for _ in range(4096):\n        f.write(b'x' * 2**20)",
                  "error", False, "OSError"),
    "kill_parent": ("import os\nos.kill(os.getppid(), 9)", None, False, None),
    "os_exit": ("import os\nos._exit(1)", "crashed", True, None),
    "segfault_recursion": ("import sys\nsys.setrecursionlimit(10**7)\nx = []\nfor _ in range(10**5):\n"
                           "    x = [x]\nrepr(x)", "crashed", True, None),
    "input": ("input('name? ')", "error", False, "EOFError"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_containment(hostile_pool, name):
    code, status, restarted, error = CASES[name]
    first, second = run_case(hostile_pool, code, timeout=15 if name == "segfault_recursion" else None)
    if status is not None:
        assert first.status == status, first
    if restarted is not None:
        assert first.restarted is restarted, first
    if error is not None:
        assert first.error_name == error, first
    assert second.status == "ok" and second.output.endswith("42\n"), second
    if name == "fork_bomb":  # the bomb hits the process limit (or the wall): either way it is contained
        assert first.status in ("error", "timeout", "crashed"), first
    if name == "huge_print":
        assert first.truncated and len(first.output) <= LIMITS.max_output_bytes
    if name == "endless_print":
        assert first.truncated and first.output.startswith("spam\n")
    if name == "kill_parent":
        # The host test process is alive (we are here). Under its own uid the kernel may not even signal its parent.
        assert first.status in ("ok", "crashed", "error"), first
        if is_root():
            assert first.error_name == "PermissionError", first
    if name == "input":
        assert first.duration_s < 1.0 and first.output.startswith("name? ")


def test_writing_outside_the_working_directory_does_not_reach_the_host(hostile_pool, tmp_path):
    target = tmp_path / "escaped.txt"
    code = textwrap.dedent(f"""
        import os
        results = []
        for path in [{str(target)!r}, "/etc/replrl-escape", "/usr/replrl-escape", os.path.expanduser("~/../x")]:
            try:
                open(path, "w").write("x")
                results.append("wrote")
            except OSError as e:
                results.append(type(e).__name__)
        print(results)
        open("inside.txt", "w").write("fine")
        print(os.listdir("."))
    """)
    first, _ = run_case(hostile_pool, code)
    assert first.status == "ok", first
    assert not target.exists()
    assert not os.path.exists("/etc/replrl-escape") and not os.path.exists("/usr/replrl-escape")
    assert "inside.txt" in first.output  # the working directory itself is writable


def test_host_secrets_are_hidden(hostile_pool):
    if hostile_pool.pool.isolation != "bwrap":
        pytest.skip("only bubblewrap hides host directories")
    first, _ = run_case(hostile_pool, "import os\nprint(os.path.exists('/root/.bashrc'), os.listdir('/root'))")
    assert first.output.startswith("False"), first


def test_background_thread_printing_after_the_cell_returns(hostile_pool):
    code = textwrap.dedent("""
        import threading, time
        def spam():
            while True:
                print('bg')
                time.sleep(0.001)
        threading.Thread(target=spam, daemon=True).start()
    """)
    with hostile_pool.acquire() as kernel:
        first = kernel.execute(code)
        later = [kernel.execute("6 * 7", mode="single") for _ in range(3)]
    assert first.status == "ok"
    assert all(r.status == "ok" and "42\n" in r.output for r in later), later
    assert hostile_pool.wait_full(60)
    if is_root():
        assert settled_count(hostile_pool.warm) == hostile_pool.warm


def test_network_is_unreachable_inside_the_namespace(hostile_pool):
    if hostile_pool.pool.isolation not in ("bwrap", "unshare"):
        pytest.skip("needs a network namespace")
    # A listener on the host's loopback: the kernel's own network namespace has a different (empty) loopback,
    # so the connection must fail and nothing must arrive here. No traffic ever leaves this machine.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    accepted = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    listener = threading.Thread(target=accept)
    listener.start()
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)"
    first, _ = run_case(hostile_pool, code)
    listener.join()
    server.close()
    assert first.status == "error" and first.error_name in ("ConnectionRefusedError", "OSError", "TimeoutError")
    assert accepted == []


def test_kernel_replaced_after_crash_keeps_tools():
    async def go():
        async with Kernel(LIMITS, tools=["submit"]) as kernel:
            crashed = await kernel.execute("import os; os._exit(3)")
            again = await kernel.execute("submit(7)", mode="single")
            return crashed, again

    crashed, again = run_sync(go())
    assert crashed.status == "crashed" and crashed.restarted
    assert again.status == "ok" and [c.args for c in again.tool_calls] == [[7]]


def test_a_kernel_that_dies_between_lines_says_so_at_the_next_line():
    """Code that leaves a timer behind ends its kernel after its line returned: the next line does not run on a
    fresh kernel as if nothing happened (its variables silently gone), it says crashed and restarted; the one after
    runs on the new kernel."""
    async def go():
        async with Kernel(LIMITS, tools=["submit"]) as kernel:
            first = await kernel.execute("import os, threading; x = 1; threading.Timer(0.2, os._exit, (3,)).start()")
            for _ in range(100):  # until the host has seen it go (the line after it takes the new path)
                if not kernel._proc.alive:
                    break
                await asyncio.sleep(0.1)
            return first, await kernel.execute("x", mode="single"), await kernel.execute("submit(2)", mode="single")

    first, lost, after = run_sync(go())
    assert first.status == "ok" and not first.restarted
    assert (lost.status, lost.restarted, lost.output) == ("crashed", True, "")
    assert after.status == "ok" and not after.restarted and [c.args for c in after.tool_calls] == [[2]]


def test_pool_close_leaves_nothing_behind(monkeypatch):
    import tempfile

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    with SyncKernelPool(size=1, limits=Limits(uid_base=UID_BASE + 14000)):
        pass  # the first pool creates the shared zmq context and loop thread, which live on by design
    # kernel directories go to a temp directory of this test's own (tests in other processes make theirs in /tmp)
    tmp = tempfile.mkdtemp(prefix="replrl-pool-test-")
    os.chmod(tmp, 0o711)  # a kernel dropped to its own uid must reach its directory inside
    monkeypatch.setattr(tempfile, "tempdir", tmp)
    fds = open_fds()
    for _ in range(2):
        with SyncKernelPool(size=2, limits=Limits(uid_base=UID_BASE + 15000)) as pool:
            with pool.acquire() as kernel:
                assert kernel.execute("1", mode="single").output == "1\n"
            assert any(name.startswith("replrl-kernel-") for name in os.listdir(tmp))  # the pool's kernels are here
    assert os.listdir(tmp) == [], "a kernel directory outlived its pool"
    os.rmdir(tmp)
    assert open_fds() <= fds, "pools leaked file descriptors (sockets, pidfds or logs)"


def test_unavailable_isolation_is_an_error_not_a_silent_downgrade():
    from sandbox.limits import SandboxUnavailable, available

    missing = [level for level in ("bwrap", "unshare", "rlimits") if not available(level)]
    for level in missing:
        with pytest.raises(SandboxUnavailable):
            Limits(isolation=level, network=True).resolve_isolation()
    with pytest.raises(ValueError):
        Limits(isolation="chroot")  # type: ignore[arg-type]


@pytest.mark.skipif(not is_root(), reason="kernels get uids of their own only when the host is root")
def test_two_host_processes_never_share_a_kernel_uid():
    """Two replrl processes on one host (two runs, a sweep's parallel runs) start kernels from the same uid_base: each
    kernel must still get a uid no other live kernel has, or one run's code could kill the other's kernels."""
    import subprocess
    import sys

    from sandbox.launch import claims_dir

    limits = Limits(uid_base=UID_BASE + 16000)
    child = textwrap.dedent(f"""
        import sys, time
        from sandbox import Limits, SyncKernelPool
        with SyncKernelPool(size=2, limits=Limits(uid_base={UID_BASE + 16000})) as pool:
            with pool.acquire() as a, pool.acquire() as b:  # both held (a released kernel gives its uid back)
                print(*(int(k.execute("import os; print(os.getuid())").output) for k in (a, b)), flush=True)
                sys.stdin.read()  # hold them until the parent has checked its own
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        theirs = set(map(int, proc.stdout.readline().split()))
        assert len(theirs) == 2, "the child process did not start its kernels"
        with SyncKernelPool(size=2, limits=limits) as pool, pool.acquire() as a, pool.acquire() as b:
            ours = {int(k.execute("import os; print(os.getuid())").output) for k in (a, b)}
            assert len(ours) == 2 and not ours & theirs, (ours, theirs)
            assert all(limits.uid_base <= u < limits.uid_base + 20000 for u in ours | theirs)
    finally:
        proc.communicate("", timeout=60)
    st = os.stat(claims_dir())
    assert st.st_uid == 0 and st.st_mode & 0o777 == 0o700  # no kernel uid can reach the claims


@pytest.mark.skipif(not is_root(), reason="kernels get uids of their own only when the host is root")
def test_a_claims_directory_someone_else_made_is_refused(tmp_path, monkeypatch):
    """A kernel (another uid) that made the claims directory first could hold or forge claims: refused, not used."""
    import tempfile

    from sandbox import launch

    monkeypatch.setattr(launch.os, "access", lambda *_: False)  # as on a host where /run is not writable
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    planted = tmp_path / "replrl-uids"
    planted.mkdir(mode=0o700)
    os.chown(planted, UID_BASE + 17000, UID_BASE + 17000)
    with pytest.raises(RuntimeError, match="must be a directory of uid 0 with mode 0700"):
        launch.next_uid(Limits(uid_base=UID_BASE + 17000))
    os.chown(planted, 0, 0)
    uid = launch.next_uid(Limits(uid_base=UID_BASE + 17000))
    assert (planted / str(uid)).exists()
    launch.release_uid(uid)


def test_a_killed_hosts_kernel_directories_are_removed_by_the_next_host(tmp_path):
    """A host killed with SIGKILL (the OOM killer) removes nothing: the next host's first kernel removes the kernel
    directories whose host is dead, and leaves a live host's alone (a dead host's lock is free, a live one's held)."""
    import signal
    import subprocess
    import sys

    os.chmod(tmp_path, 0o711)  # a kernel dropped to its own uid must reach its directory inside
    child = textwrap.dedent(f"""
        import sys
        from sandbox import Limits, SyncKernel
        with SyncKernel(Limits(uid_base={UID_BASE + 18000})) as k:
            print(k.execute("1", mode="single").output, end="", flush=True)
            sys.stdin.read()
    """)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def host() -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, cwd=repo, env={**os.environ, "TMPDIR": str(tmp_path)})
        assert proc.stdout.readline() == "1\n", "the host did not start its kernel"
        return proc

    def kernel_dirs() -> set[str]:
        return {p.name for p in tmp_path.glob("replrl-kernel-*") if p.is_dir()}

    dead = host()
    dead_dirs = kernel_dirs()
    dead.send_signal(signal.SIGKILL)
    dead.wait(timeout=30)
    assert len(dead_dirs) == 1 and kernel_dirs() == dead_dirs, "SIGKILL left the directory (nothing can remove it)"
    live = host()
    try:
        live_dirs = kernel_dirs()
        assert len(live_dirs) == 1 and not live_dirs & dead_dirs, "the dead host's directory was not removed"
        third = host()
        try:
            assert live_dirs <= kernel_dirs(), "a live host's kernel directory was removed"
            assert len(kernel_dirs()) == 2
        finally:
            third.communicate("", timeout=60)
    finally:
        live.communicate("", timeout=60)
    assert os.listdir(tmp_path) == [], "a directory or lock outlived its kernel"


@pytest.mark.skipif(not is_root(), reason="a lock of another uid needs a root host to make")
def test_only_this_users_free_locks_are_reaped(tmp_path):
    """A kernel at the rlimits level sees the temp directory: a lock it plants (its own uid) must not make the host
    delete anything, and a directory without a lock (an older version's) is left alone."""
    from sandbox.kernel_dirs import reap_stale_kernel_dirs

    for name, owner in (("forged", UID_BASE + 18001), ("stale", os.geteuid())):
        (tmp_path / f"replrl-kernel-{name}").mkdir()
        (tmp_path / f"replrl-kernel-{name}" / "kernel.log").write_text("x")
        (tmp_path / f"replrl-kernel-{name}.lock").touch()
        os.chown(tmp_path / f"replrl-kernel-{name}.lock", owner, owner)
    (tmp_path / "replrl-kernel-old").mkdir()
    assert reap_stale_kernel_dirs(str(tmp_path)) == [str(tmp_path / "replrl-kernel-stale")]
    assert sorted(os.listdir(tmp_path)) == ["replrl-kernel-forged", "replrl-kernel-forged.lock", "replrl-kernel-old"]


def test_a_directory_a_dying_kernel_wrote_into_keeps_its_lock_for_the_next_reap(tmp_path, monkeypatch):
    """A kernel killed as it starts can bind a socket in its directory while the host removes it (seen: directories
    left holding only `k-2` and `k-5` after a test suite): the directory stays, so its lock must stay too, released,
    or nothing would ever remove it."""
    import tempfile

    from sandbox import kernel_dirs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    kdir, fd = kernel_dirs.make_kernel_dir()
    remove_tree = kernel_dirs.remove_tree

    def racing_remove(path):  # the removal runs, then the dying kernel binds its socket
        remove_tree(path)
        os.mkdir(path)
        open(os.path.join(path, "k-2"), "w").close()
        return False

    monkeypatch.setattr(kernel_dirs, "remove_tree", racing_remove)
    kernel_dirs.remove_kernel_dir(kdir, fd)
    monkeypatch.setattr(kernel_dirs, "remove_tree", remove_tree)
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(kdir), os.path.basename(kdir) + ".lock"])
    assert kernel_dirs.reap_stale_kernel_dirs(str(tmp_path)) == [kdir]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fork_server", [True, False], ids=["forked", "booted"])
def test_a_kernel_starts_in_a_temp_directory_too_deep_for_a_unix_socket_path(tmp_path, monkeypatch, fork_server):
    """A unix socket's path holds 107 bytes: a kernel in ``<90 characters>/replrl-kernel-XXXXXXXX/sock/k-1`` binds
    its sockets through a descriptor of the directory instead (pytest's ``pytest-116`` made CI's paths too long)."""
    import tempfile

    deep = str(tmp_path) + "/" + "d" * max(1, 90 - len(str(tmp_path)) - 1)
    os.mkdir(deep)
    monkeypatch.setattr(tempfile, "tempdir", deep)
    assert len(os.path.join(deep, "replrl-kernel-XXXXXXXX", "sock", "k-1")) > 107

    async def main() -> None:
        async with Kernel(Limits(wall_s=5.0, fork_server=fork_server)) as kernel:
            assert (await kernel.execute("6 * 7", mode="single")).output == "42\n"
            assert any(name.startswith("replrl-kernel-") for name in os.listdir(deep))  # it is there, not elsewhere
    run_sync(main())
