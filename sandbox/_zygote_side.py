"""The fork server (zygote) that runs INSIDE the sandbox: it imports the kernel program once, then forks kernels.

Never imported by the host: ``sandbox.zygote`` runs ``_kernel_side.py`` + this file with ``python -c`` under bwrap
(the same allowlist view as a kernel, plus the directory that holds this zygote's kernel directories), as root with
bwrap's capabilities, and with ``_ZYGOTE = True`` so the kernel program only defines and imports. The zygote makes
no zmq context and no thread; the kernels make theirs after the fork.

Per request (the fds only, on the control socket: a reply socket, the kernel's log, and the kernel's cgroup when
it has one) it forks, before it reads anything of the kernel's: the request itself (the kernel's directory, uid,
environment) travels on the reply socket to A, never through the zygote's memory, so no later fork inherits an
earlier kernel's request.

    A  reads the request, unshares mount, pid, ipc, uts, cgroup (and network, unless the network is allowed)
       namespaces, forks B, sends B's pidfd to the host over the reply socket, waits for B, exits. A dies with the
       zygote.
    B  pid 1 of the new pid namespace, root, as bwrap's own init is: makes every mount private, hides every other
       kernel's directory (a read-only tmpfs over the temp directory, holding only this kernel's directory and the
       interpreter's directories that live there, each bound from an fd), mounts a /proc of the new pid namespace
       and a devpts instance of its own (no kernel sees another's terminals), brings up loopback, forks C, then
       reaps until C exits (which ends the namespace: the kernel kills every process left in it). B dies with A.
    C  pid 2: the kernel. Its log on stdout/stderr, nothing else open, the kernel's environment, its working
       directory; then ``kernel_main`` drops to the kernel's uid, applies its rlimits and serves.
"""

import ctypes
import fcntl
import gc
import json
import os
import signal
import socket
import struct
import threading

_LIBC = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNS, _CLONE_NEWCGROUP, _CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
_CLONE_NEWIPC, _CLONE_NEWPID, _CLONE_NEWNET = 0x08000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MNT_DETACH = 2
_PR_SET_PDEATHSIG = 1


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    def enc(s):
        return None if s is None else s.encode()

    _check(_LIBC.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _die_with_parent():
    _check(_LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")


def _close_fds_except(keep):
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _loopback_up():
    """Bring up ``lo`` in a new network namespace, as bwrap does (127.0.0.1 works inside, reaches nothing outside)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, struct.pack("16sH14x", b"lo", 0)))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags | 0x1))  # SIOCSIFFLAGS: IFF_UP


def _hide_other_kernels(req):
    """This kernel's directory, alone, at its path in the view: a read-only tmpfs over the temp directory (which
    in the zygote's view holds the directory of all of this zygote's kernels) with this kernel's directory, and the
    interpreter's own directories under the temp directory (a virtualenv in /tmp), bound onto it from fds opened
    before the tmpfs covered them: what a kernel that boots on its own sees there."""
    fd = os.open(req["kdir"], os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
    shared = os.open(os.path.dirname(req["kdir"]), os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
    tmp, view = req["tmp"], req["view_kdir"]
    keep = [(path, os.open(path, os.O_PATH)) for path in req.get("keep", ()) if os.path.exists(path)]
    _mount("tmpfs", tmp, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=64k,nr_inodes=256")
    for path, kept in keep:
        _mkdirs(path, is_dir=os.path.isdir(f"/proc/self/fd/{kept}"))
        _mount(f"/proc/self/fd/{kept}", path, None, _MS_BIND | _MS_REC)
        _mount(None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
        os.close(kept)
    os.mkdir(view, 0o755)
    _mount(f"/proc/self/fd/{fd}", view, None, _MS_BIND)
    _mount(None, view, None, _MS_REMOUNT | _MS_BIND | _MS_NOSUID | _MS_NODEV)
    _mount(None, tmp, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    # the directory of all of this zygote's kernels, now covered, is taken out of this namespace altogether
    _check(_LIBC.umount2(f"/proc/self/fd/{shared}".encode(), _MNT_DETACH), "umount the kernels' directory")
    os.close(fd)
    os.close(shared)


def _mkdirs(path, is_dir):
    """A mount point at ``path`` on the fresh tmpfs: its parents as 0755 directories, itself a directory or a file."""
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        os.makedirs(parent, 0o755, exist_ok=True)
    if is_dir:
        os.makedirs(path, 0o755, exist_ok=True)
    elif not os.path.exists(path):
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))


def _own_devpts():
    """A devpts instance of this kernel's own at /dev/pts (bwrap's --dev made /dev/ptmx a link into it): terminals
    another kernel opens are not there, nor are their owners' uids; it holds at most ``PTYS_PER_KERNEL`` of them
    (``sandbox/launch.py``), so a kernel that opens all it may runs out of its own alone."""
    ptys = int(_CFG["zygote"]["ptys"])  # noqa: F821  (_kernel_side.py)
    _mount("devpts", "/dev/pts", "devpts", _MS_NOSUID | _MS_NOEXEC, _DEVPTS_OPTIONS.format(ptys))  # noqa: F821


def _fresh_proc():
    """A /proc of the kernel's own pid namespace, with the parts bwrap makes read-only made read-only."""
    _check(_LIBC.umount2(b"/proc", _MNT_DETACH), "umount /proc")
    _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    for sub in ("sys", "sysrq-trigger", "irq", "bus"):
        path = "/proc/" + sub
        try:
            _mount(path, path, None, _MS_BIND | _MS_REC)
            _mount(None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        except OSError:
            pass


def _kernel_c(req, log_fd, cgroup_fd):
    """pid 2 of the namespace: becomes the kernel."""
    _collect_before_the_first_line()
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    cfg = dict(req["cfg"])
    if cgroup_fd is not None:
        cfg["cgroup_fd"] = os.dup2(cgroup_fd, 3, inheritable=False)
    _close_fds_except((3,) if cgroup_fd is not None else ())
    added = {k: v for k, v in os.environ.items() if k not in _START_ENV}  # noqa: F821  (_kernel_side.py)
    os.environ.clear()
    os.environ.update(req["env"])
    os.environ["PWD"] = req["work"]  # as bwrap's --chdir sets it
    os.environ.update(added)
    import site

    site.USER_BASE = site.USER_SITE = None  # as the kernel's HOME makes them (none of them exist)
    site.getusersitepackages()
    os.chdir(req["work"])
    import random

    random.seed()  # already reseeded at fork; once more, explicitly: no kernel shares another's random state
    kernel_main(cfg, req["conn"])  # noqa: F821  (defined by _kernel_side.py, the first part of this source)
    os._exit(0)


def _init_b(req, log_fd, cgroup_fd):
    """pid 1 of the new pid namespace: builds the kernel's view, starts the kernel, reaps until it exits."""
    try:
        _die_with_parent()
        os.setsid()
        _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
        _hide_other_kernels(req)
        _fresh_proc()
        _own_devpts()
        if not req["network"]:
            _loopback_up()
        os.chdir("/")
        kernel = os.fork()
    except BaseException as err:
        os.write(log_fd, f"sandbox zygote: {type(err).__name__}: {err}\n".encode())
        os._exit(70)
    if kernel == 0:
        try:
            _kernel_c(req, log_fd, cgroup_fd)
        except BaseException as err:
            os.write(2, f"sandbox kernel: {type(err).__name__}: {err}\n".encode())
        os._exit(70)
    os.close(log_fd)
    if cgroup_fd is not None:
        os.close(cgroup_fd)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(0)
        except InterruptedError:
            continue
        if pid == kernel:
            os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def _fork_a(reply, log_fd, cgroup_fd, zygote_pid):
    """A: reads its request, makes new namespaces for one kernel, hands B's pidfd to the host, then lives as long
    as B."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        _die_with_parent()
        if os.getppid() != zygote_pid:
            os._exit(1)
        keep = (reply.fileno(), log_fd) + ((cgroup_fd,) if cgroup_fd is not None else ())
        _close_fds_except(keep)
        reply.settimeout(30.0)
        req = json.loads(reply.recv(1 << 20))
        reply.settimeout(None)
        flags = _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS | _CLONE_NEWCGROUP
        if not req["network"]:
            flags |= _CLONE_NEWNET
        _check(_LIBC.unshare(flags), "unshare")
        pid = os.fork()
        if pid == 0:
            reply.close()
            _init_b(req, log_fd, cgroup_fd)
        pidfd = os.pidfd_open(pid)
        socket.send_fds(reply, [json.dumps({"pid": pid}).encode()], [pidfd])
        os.close(pidfd)
    except BaseException as err:
        try:
            reply.send(json.dumps({"error": f"{type(err).__name__}: {err}"}).encode())
        finally:
            os._exit(1)
    reply.close()
    os.close(log_fd)
    if cgroup_fd is not None:
        os.close(cgroup_fd)
    while True:
        try:
            os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
        except ChildProcessError:
            break
    os._exit(0)


def _clean_heap():
    """Collect the zygote's garbage (imports leave cycles: ``sqlite3`` alone about 290 objects), then freeze what is
    left, before a fork: a kernel starts with no garbage of the zygote's, and the collections of its start never
    walk the zygote's objects (CPython's advice for fork servers, ``gc.freeze``; the kernel unfreezes them before
    its first line, ``_collect_before_the_first_line``). After the first call, a collection here only walks what
    the loop made since the last fork."""
    gc.collect()
    gc.freeze()


def _collect_before_the_first_line():
    """The kernel's own start (ipykernel's app, its sockets, its threads) leaves garbage too, and a fork of a zygote
    that has just collected runs no full collection of its own while it starts: its first ``gc.collect()`` printed
    what the start left (160 on the issue's host; 175 on the 2-core host with ``_clean_heap`` alone, where without
    it the start happened to collect). So just before the first line (where the kernel makes
    itself look like ``python -i``: ``_look_like_python_i``) the kernel collects what is young (the zygote's heap is
    frozen: only what the start made is walked, a few milliseconds), then unfreezes the zygote's heap: from then on
    every object is the kernel's own to collect, as in a booted kernel (``gc.get_freeze_count()`` is 0)."""
    plain = globals().get("_look_like_python_i")
    if plain is None:
        return

    def look_like_python_i():
        plain()
        gc.collect()
        gc.unfreeze()

    globals()["_look_like_python_i"] = look_like_python_i


def _serve(ctl_fd):
    """The zygote's loop: one request at a time, a fork each; exits when the host closes the control socket. A
    request is its descriptors alone (reply socket, log, cgroup or none): nothing of a kernel's is read here."""
    ctl = socket.socket(fileno=ctl_fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernels' A processes are reaped by the kernel, not by us
    me = os.getpid()
    _clean_heap()
    ctl.send(json.dumps({"ready": True, "threads": threading.active_count()}).encode())
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(ctl, 16, 3)
        except InterruptedError:
            continue
        if not msg:
            os._exit(0)  # the host is gone
        if msg not in (b"fork", b"fork+cgroup") or len(fds) != (3 if msg == b"fork+cgroup" else 2):
            for fd in fds:
                os.close(fd)
            continue
        reply = socket.socket(fileno=fds[0])
        _clean_heap()
        try:
            pid = os.fork()
        except BaseException as err:  # no fork (EAGAIN): this kernel fails to start, the zygote serves on
            reply.send(json.dumps({"error": f"{type(err).__name__}: {err}"}).encode())
            pid = -1
        if pid == 0:
            ctl.close()
            _fork_a(reply, fds[1], fds[2] if len(fds) == 3 else None, me)
        reply.close()
        for fd in fds[1:]:
            os.close(fd)


def _preimport():
    """What a kernel imports later anyway, imported once here (debugpy, the kernel's shell): a fork gets it free."""
    import importlib

    for name in _CFG.get("zygote", {}).get("preimport", []):  # noqa: F821  (_kernel_side.py)
        try:
            importlib.import_module(name)
        except Exception:
            pass
    try:
        _import_seccomp()  # noqa: F821  (_kernel_side.py): every fork installs its filter from it
    except Exception:
        pass


if globals().get("_ZYGOTE"):
    _preimport()
    _serve(_CFG["zygote"]["ctl_fd"])  # noqa: F821
