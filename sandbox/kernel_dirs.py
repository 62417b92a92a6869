"""Each kernel's private directory in the temp directory, and the cleanup of those a dead host left behind.

A kernel's directory (its connection file, sockets, log and working directory) is removed when the kernel is
killed. A host that is itself killed (SIGKILL, the OOM killer) removes nothing, and a run that crashes over and
over would fill the temp directory with whatever its kernels wrote. So each directory ``replrl-kernel-XXXX`` has a
sibling ``replrl-kernel-XXXX.lock`` that its host holds an flock on for as long as the kernel lives; the lock dies
with the host's process. The first kernel a process starts (and one a minute after that) removes every directory
whose lock nobody holds.
The lock file lives beside the directory, not in it, so the kernel (which can write its own directory) cannot
touch it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time

PREFIX = "replrl-kernel-"
LOCK = ".lock"
REAP_EVERY_S = 60.0
_reaped: dict[str, float] = {}
"""Temp directory -> when this process last cleaned it (a long run cleans up after its own kernels too)."""


def make_kernel_dir(parent: str | None = None) -> tuple[str, int]:
    """A new private directory and the fd of its held lock. The lock is created under another name, locked, then
    renamed into place, so no other process ever sees an unheld lock for a live directory. ``parent``: where (the
    temp directory by default; a fork server's own kernel directory for the kernels it forks, removed with it)."""
    tmp = parent or tempfile.gettempdir()
    if time.monotonic() - _reaped.get(tmp, -REAP_EVERY_S) >= REAP_EVERY_S:
        _reaped[tmp] = time.monotonic()
        reap_stale_kernel_dirs(tmp)
    fd, pending = tempfile.mkstemp(prefix=PREFIX, suffix=".pending", dir=tmp)
    kdir = None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        kdir = tempfile.mkdtemp(prefix=PREFIX, dir=tmp)
        os.rename(pending, kdir + LOCK)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(pending)
        if kdir is not None:
            shutil.rmtree(kdir, ignore_errors=True)
        raise
    return kdir, fd


def remove_kernel_dir(kdir: str, fd: int | None) -> None:
    """Remove a kernel's directory, then its lock. Never raises. A kernel killed while it starts can still bind a
    socket in its directory after the removal began (its process dies a moment after the host's wait returns): then
    the directory stays, and so does its lock, released, for the next reap."""
    shutil.rmtree(kdir, ignore_errors=True)
    if fd is not None:
        if not os.path.lexists(kdir):
            with contextlib.suppress(OSError):
                os.unlink(kdir + LOCK)
        with contextlib.suppress(OSError):
            os.close(fd)


def reap_stale_kernel_dirs(tmp: str) -> list[str]:
    """Remove every kernel directory in ``tmp`` whose lock is this user's and held by no live process; returns the
    removed ones. Directories without a lock file (made by an older version) are left alone."""
    removed = []
    try:
        names = os.listdir(tmp)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith(PREFIX) and name.endswith(LOCK)):
            continue
        lock = os.path.join(tmp, name)
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            free = os.fstat(fd).st_uid == os.geteuid()  # not another user's lock, nor a kernel's forgery
            if free:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while its host is alive
        except OSError:
            free = False
        if not free:
            os.close(fd)
            continue
        kdir = lock[: -len(LOCK)]
        was_dir = os.path.isdir(kdir) and not os.path.islink(kdir)
        remove_kernel_dir(kdir, fd)
        if was_dir and not os.path.lexists(kdir):
            removed.append(kdir)
    return removed
