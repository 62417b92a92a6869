"""The fork server (Limits.fork_server, sandbox/zygote.py): kernels forked from one pre-imported parent are as
isolated from each other and from the host as kernels that boot on their own. Real kernels, both boots side by side.
"""

from __future__ import annotations

import asyncio
import json
import os
import textwrap

import pytest

from sandbox import Kernel, Limits, run_sync
from sandbox import zygote as zygote_mod
from sandbox.kernel import KernelProcess
from sandbox.limits import available, is_root

FORK = Limits(wall_s=5.0, uid_base=130000)
pytestmark = [
    pytest.mark.skipif(not (available("bwrap") and is_root()), reason="the fork server serves the bwrap level on a "
                       "root host"),
    pytest.mark.skipif(available("bwrap") and is_root() and not zygote_mod.fork_server_usable("bwrap", FORK),
                       reason="this interpreter lives under the temp directory, which a forked kernel's view covers: "
                       "kernels boot on their own here"),
]
BOOT = Limits(wall_s=5.0, uid_base=131000, fork_server=False)

# what user code can see of its process and its view; per-kernel names (directory, uid) are normalised
PROBE = textwrap.dedent("""
    import os, sys, json, socket, random
    status = {k: v.strip() for k, v in (l.split(':', 1) for l in open('/proc/self/status'))
              if k in ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb', 'NoNewPrivs', 'Seccomp', 'Groups')}
    kdir = os.path.dirname(os.getcwd())
    print(json.dumps({
        'root': sorted(os.listdir('/')), 'tmp': [n.startswith('replrl-kernel-') for n in os.listdir('/tmp')],
        'cwd_parent': os.path.dirname(kdir), 'home': os.environ['HOME'] == os.getcwd(),
        'pids': sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), 'ids': [os.getpid(), os.getppid()],
        'pgid_sid': [os.getpgid(0), os.getsid(0)], 'status': status, 'uid_is_gid': os.getuid() == os.getgid(),
        'root_uid': os.getuid() == 0, 'ifaces': socket.if_nameindex(), 'env': sorted(os.environ),
        'path': sys.path, 'argv': sys.argv, 'hash': hash('replrl'), 'hostname': os.uname().nodename,
        'proc1_uid': os.stat('/proc/1').st_uid, 'kdir_listing': sorted(os.listdir(kdir)),
        # open files by what they are (how many sockets and event fds ipykernel holds depends on its threads'
        # timing): no host file may be open in either
        # (the kernel's log, opened by its host, is named by the host's path to it: its directory's name differs)
        'fds': sorted({(lambda t: os.path.basename(t) if 'replrl-kernel-' in t else t if t.startswith('/')
                        else t.split(':')[0])(os.readlink('/proc/self/fd/' + f))
                       for f in os.listdir('/proc/self/fd') if os.path.exists('/proc/self/fd/' + f)}),
    }))
""")


def probe(limits: Limits) -> tuple[dict, bool]:
    async def go():
        async with Kernel(limits) as kernel:
            forked = kernel._proc._zygote is not None
            out = (await kernel.execute(PROBE)).output
            return json.loads(out), forked

    return run_sync(go())


def test_a_forked_kernel_sees_what_a_booted_kernel_sees():
    """Same namespaces (pid 2 under a root-owned pid 1, own session), same capabilities (none), no_new_privs,
    the same filesystem view (the temp directory holds only the kernel's own directory), the same environment,
    sys.path, argv, hash seed, interfaces (loopback only), open fds."""
    forked, was_forked = probe(FORK)
    booted, was_booted = probe(BOOT)
    assert was_forked and not was_booted
    assert forked == booted
    assert forked["ids"] == [2, 1] and forked["pids"][:2] == [1, 2] and forked["proc1_uid"] == 0
    assert forked["status"]["CapEff"] == "0000000000000000" and forked["status"]["NoNewPrivs"] == "1"
    assert forked["tmp"] == [True] and not forked["root_uid"]
    assert [name for _, name in forked["ifaces"]] == ["lo"]


KERNEL_A = textwrap.dedent("""
    import os, socket, threading
    open('secret.txt', 'w').write('episode A')
    tcp = socket.socket(); tcp.bind(('127.0.0.1', 0)); tcp.listen(); port = tcp.getsockname()[1]
    ab = socket.socket(socket.AF_UNIX); ab.bind('\\0replrl-zygote-test'); ab.listen()
    import subprocess, sys
    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
    print(os.getcwd(), port, os.getuid(), child.pid)
""")


def test_two_forked_kernels_cannot_see_each_others_files_processes_or_sockets():
    async def go():
        async with Kernel(FORK) as a, Kernel(FORK) as b:
            assert a._proc._zygote is b._proc._zygote is not None  # one zygote, two kernels
            cwd, port, uid_a, child = (await a.execute(KERNEL_A)).output.split()
            probe_b = textwrap.dedent(f"""
                import os, socket
                seen = [os.path.exists({cwd!r}), os.path.exists({cwd!r} + '/secret.txt'), sorted(os.listdir('/tmp'))]
                procs = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
                reached = []
                for family, addr in ((socket.AF_INET, ('127.0.0.1', {port})),
                                     (socket.AF_UNIX, '\\0replrl-zygote-test')):
                    try:
                        socket.socket(family).connect(addr)
                        reached.append(True)
                    except OSError:
                        reached.append(False)
                print(seen[0], seen[1], len(seen[2]), procs, reached, os.getuid())
            """)
            out_b = (await b.execute(probe_b)).output
            still_a = (await a.execute("print(open('secret.txt').read())")).output
            return uid_a, out_b, still_a

    uid_a, out_b, still_a = run_sync(go())
    assert out_b.startswith("False False 1 [1, 2] [False, False]"), out_b  # nothing of A; only its own 2 processes
    assert out_b.split()[-1] != uid_a  # a uid of its own
    assert still_a == "episode A\n"


def test_killing_what_a_forked_kernel_can_reach_hurts_neither_host_nor_next_kernel():
    """pid 1 (root) refuses the signal; kill(-1) ends only the kernel's own processes; the zygote is invisible."""
    async def go():
        async with Kernel(FORK) as k:
            parent = await k.execute("import os\nos.kill(os.getppid(), 9)")
            group = await k.execute("import os\nos.kill(0, 9)")  # its process group: pid 1 refuses, itself dies
            after = await k.execute("6 * 7", mode="single")
            more = await KernelProcess(FORK, "bwrap").start()
            more.kill()
            return parent, group, after

    parent, group, after = run_sync(go())
    assert parent.status == "error" and parent.error_name == "PermissionError", parent
    assert group.status == "crashed" and group.restarted, group
    assert after.status == "ok" and after.output == "42\n", after


def test_a_dead_zygote_is_restarted_and_its_kernels_are_replaced():
    async def go():
        async with Kernel(FORK) as k:
            first = await k.execute("x = 1")
            server = k._proc._zygote
            os.killpg(server.proc.pid, 9)  # the zygote's bwrap; its kernels die with it
            await asyncio.sleep(0.5)
            assert not k._proc.alive  # its kernel died with it (found, and replaced, at the next line)
            lost = await k.execute("x")
            again = await k.execute("40 + 2", mode="single")
            fresh = await KernelProcess(FORK, "bwrap").start()  # and a new kernel starts from a new zygote
            fresh.kill()
            return first, lost, again, server.alive, k.restarts

    first, lost, again, alive, restarts = run_sync(go())
    assert first.status == "ok"
    # the state went with the kernel: the next line says so (it does not run) and the one after runs on a new one
    assert (lost.status, lost.restarted, restarts) == ("crashed", True, 1), lost
    assert again.status == "ok" and again.output == "42\n", again
    assert alive


def test_forked_kernels_have_their_own_random_state():
    async def go():
        async with Kernel(FORK) as a, Kernel(FORK) as b:
            code = "import random\nprint(random.getrandbits(64), hash('replrl'))"
            return (await a.execute(code)).output.split(), (await b.execute(code)).output.split()

    a, b = run_sync(go())
    assert a[0] != b[0]  # own random state
    assert a[1] == b[1]  # PYTHONHASHSEED=0 in both


def test_the_zygote_ends_with_its_last_kernel():
    own = Limits(wall_s=5.0, uid_base=132000, ro_paths=("/etc/os-release",))  # a view no other test's pool shares

    async def go():
        async with Kernel(own) as k:
            server = k._proc._zygote
            assert server.alive and os.path.isdir(server.dir)
            where = server.dir
        return server, where

    server, where = run_sync(go())
    assert not server.alive and not os.path.exists(where)
    assert zygote_mod.zygote_key(own) not in zygote_mod._zygotes


def test_fork_server_off_or_unusable_boots_as_before():
    assert not zygote_mod.fork_server_usable("bwrap", BOOT)
    assert not zygote_mod.fork_server_usable("unshare", FORK)
    assert not zygote_mod.fork_server_usable("rlimits", FORK)
