"""Each kernel's private directory in the temp directory, and the cleanup of those a dead host left behind.

A kernel's directory (its connection file, sockets, log and working directory) is removed when the kernel is
killed. A host that is itself killed (SIGKILL, the OOM killer) removes nothing, and a run that crashes over and
over would fill the temp directory with whatever its kernels wrote. So each directory ``replrl-kernel-XXXX`` has a
sibling ``replrl-kernel-XXXX.lock`` that its host holds an flock on for as long as the kernel lives; the lock dies
with the host's process. The first kernel a process starts (and one a minute after that) removes every directory
whose lock nobody holds.
The lock file lives beside the directory, not in it, so the kernel (which can write its own directory) cannot
touch it.

What a kernel leaves in its directory is hostile: a tree deeper than any recursion limit, links to anywhere, FIFOs,
directories without permissions. ``remove_tree`` walks it without recursion, through descriptors, never following a
link and never raising: what it cannot remove it leaves (and says so by its return value).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
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
        with contextlib.suppress(Exception):  # what cannot be reaped stays; it never stops a kernel from starting
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
            remove_tree(kdir)
        raise
    return kdir, fd


def remove_kernel_dir(kdir: str, fd: int | None) -> None:
    """Remove a kernel's directory, then its lock. Never raises. A kernel killed while it starts can still bind a
    socket in its directory after the removal began (its process dies a moment after the host's wait returns): then
    the directory stays, and so does its lock, released, for the next reap."""
    remove_tree(kdir)
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


class KernelLog:
    """A kernel's log file as its host made it: created here (never an existing name), handed to the kernel as its
    stdout and stderr, and read back only through this descriptor, by size and offset: whatever the kernel does to
    the name (a FIFO, a link to /dev/zero or to a root-only file), the host reads at most the last bytes of the file
    it created, and never blocks."""

    def __init__(self, fd: int):
        self.fd = fd

    @classmethod
    def create(cls, path: str) -> KernelLog:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND | os.O_CLOEXEC
        return cls(os.open(path, flags, 0o600))

    def tail(self, n: int = 600) -> str:
        """The last ``n`` bytes, decoded; never raises."""
        if self.fd < 0:
            return "(no log)"
        try:
            size = os.fstat(self.fd).st_size
            data = os.pread(self.fd, n, max(0, size - n))
        except OSError:
            return "(no log)"
        return data.decode(errors="replace").strip() or "(no output)"

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)


def remove_tree(path: str) -> bool:
    """Remove ``path`` and everything under it; True when it is gone. Never raises, never follows a symbolic link
    (a link is removed, not its target), never opens anything but directories (O_NOFOLLOW | O_DIRECTORY, so a FIFO
    cannot block it), holds two descriptors at most whatever the depth, and needs no recursion (``shutil.rmtree``
    recursed per level before Python 3.12.4: a deep tree raised RecursionError). A directory without permissions is
    given them first (the host owns what it removes, or is root)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(OSError):
            os.unlink(path)
        return not os.path.lexists(path)
    parent, name = os.path.split(os.path.abspath(path))
    try:
        top = os.open(parent, _DIR_FLAGS & ~os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        _remove_children_then(top, name)
    except Exception:  # never into the caller: whatever is left stays for the next reap
        pass
    finally:
        os.close(top)
    return not os.path.lexists(path)


def _remove_children_then(top: int, name: str) -> None:
    """Depth-first without recursion: descend into the first subdirectory found, remove a directory once it is
    empty, then climb to its parent through ``..`` checked against the (device, inode) remembered on the way down
    (so a directory moved meanwhile is never mistaken for the parent). Only one directory is open at a time."""
    chain: list[tuple[str, tuple[int, int]]] = []  # names from ``top`` down, and the identity of each directory
    fd = _open_dir(top, name)
    if fd is None:
        return
    chain.append((name, _ident(fd)))
    steps = 0
    while fd is not None:
        steps += 1
        if steps > 10_000_000:
            break
        child = _next_subdir_after_unlinking_files(fd)
        if child is not None:
            sub = _open_dir(fd, child)
            if sub is None:  # cannot open it (vanished, or not a directory any more): try to unlink it, go on
                with contextlib.suppress(OSError):
                    os.unlink(child, dir_fd=fd)
                with contextlib.suppress(OSError):
                    os.rmdir(child, dir_fd=fd)
                if _exists_at(fd, child):
                    break  # it stays: do not loop on it
                continue
            os.close(fd)
            fd = sub
            chain.append((child, _ident(fd)))
            continue
        done_name, _ = chain.pop()  # this directory is empty now: climb, then remove it
        if chain:
            try:
                up = os.open("..", _DIR_FLAGS & ~os.O_NOFOLLOW, dir_fd=fd)
            except OSError:
                break
            os.close(fd)
            fd = up
            if _ident(fd) != chain[-1][1]:
                break
            with contextlib.suppress(OSError):
                os.rmdir(done_name, dir_fd=fd)
            if _exists_at(fd, done_name):
                break
        else:
            os.close(fd)
            fd = None
            with contextlib.suppress(OSError):
                os.rmdir(done_name, dir_fd=top)
    if fd is not None:
        os.close(fd)


def _open_dir(dir_fd: int, name: str) -> int | None:
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        try:  # a directory the kernel made unreadable: the host may give it its permissions back
            os.chmod(name, 0o700, dir_fd=dir_fd, follow_symlinks=False)
            fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except (OSError, NotImplementedError):
            return None
    except OSError:
        return None
    with contextlib.suppress(OSError):
        if stat.S_IMODE(os.fstat(fd).st_mode) & 0o700 != 0o700:
            os.fchmod(fd, 0o700)
    return fd


def _ident(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _exists_at(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except OSError:
        return False


def _next_subdir_after_unlinking_files(fd: int) -> str | None:
    """Unlink every entry of the directory ``fd`` that is not a directory; return the name of a subdirectory, or
    None when the directory is empty (or nothing more can be removed from it)."""
    try:
        entries = os.scandir(fd)
    except OSError:
        return None
    with entries:
        for entry in entries:
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            if is_dir:
                return entry.name
            with contextlib.suppress(OSError):
                os.unlink(entry.name, dir_fd=fd)
    return None
