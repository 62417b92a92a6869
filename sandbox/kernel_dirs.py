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

import asyncio
import contextlib
import fcntl
import os
import stat
import struct
import tempfile
import termios
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
    """A kernel's stdout and stderr: a pipe, never a file. The kernel gets the write end (``fd``); the host holds the
    read end and keeps only the last ``keep`` bytes (4 KiB) in memory, so nothing a kernel writes to its descriptors
    1 and 2 (a flood, ``fallocate`` past the file-size limit, a subprocess's output) reaches the host's disk, and
    there is no name for the kernel to replace.

    The host drains the pipe on its event loop (``loop.add_reader``), at most once per ``HOLD_OFF_S`` however fast
    the kernel writes: a kernel writing flat out waits on a full pipe (1 MiB) for at most that long (about 20 MB/s
    gets through), so it is slowed, never blocked for good, and it costs the host about 1% of a core (measured on
    the 2-core host: 1.1% for one such kernel, 3.5% for four; plain reads every 10 ms cost 5.7% for one).
    ``tail()`` drains what is left first (a dead kernel's last words are still in the pipe). Bytes that fall out of
    the tail are counted (``dropped``). What ``tail()`` returns is quoted with ``ascii()``: one line, printable
    ASCII only, so no fake log line (a newline, a carriage return, terminal escapes) can be planted in the host's
    log."""

    KEEP = 4096
    """Bytes of a kernel's output the host keeps (the last ones)."""
    HOLD_OFF_S = 0.05
    """After each drain, how long the host waits before it reads the pipe again."""
    PIPE_BYTES = 1 << 20
    """The pipe's capacity, where the host may set it (``F_SETPIPE_SZ``; else the system's 64 KiB)."""
    READS_PER_DRAIN = 16
    """At most this many reads of 64 KiB per drain: a pipe's worth."""

    def __init__(self, read_fd: int, write_fd: int, keep: int = KEEP):
        self.fd = write_fd
        """The write end, handed to the kernel as its stdout and stderr (-1 once closed)."""
        self._rfd = read_fd
        self.keep = keep
        self._tail = bytearray()
        self.received = 0
        """Bytes the kernel wrote that the host has read."""
        self.dropped = 0
        """Of those, bytes no longer in the tail."""
        self._loop = None
        self._timer = None

    @classmethod
    def create(cls, keep: int = KEEP) -> KernelLog:
        """A new pipe; drained on the running event loop, if there is one (else only when ``tail()`` asks)."""
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(read_fd, False)  # the read end alone: the kernel's end (its own file description) blocks
        with contextlib.suppress(OSError):  # room for a burst between two drains; pages are taken only when written,
            fcntl.fcntl(read_fd, fcntl.F_SETPIPE_SZ, cls.PIPE_BYTES)  # and charged to the writer (the kernel)
        log = cls(read_fd, write_fd, keep)
        try:
            log._loop = asyncio.get_running_loop()
        except RuntimeError:
            return log
        log._loop.add_reader(read_fd, log._on_readable)
        return log

    def _on_readable(self) -> None:
        eof = self._drain()
        loop = self._loop
        if loop is None or self._rfd < 0:
            return
        with contextlib.suppress(Exception):
            loop.remove_reader(self._rfd)
            if not eof:
                self._timer = loop.call_later(self.HOLD_OFF_S, self._resume)

    def _resume(self) -> None:
        self._timer = None
        if self._loop is not None and self._rfd >= 0:
            with contextlib.suppress(Exception):
                self._loop.add_reader(self._rfd, self._on_readable)

    def _drain(self) -> bool:
        """Read what the pipe holds (at most ``READS_PER_DRAIN`` rounds) into the tail; True at end of file. Never
        raises, never blocks. What cannot end up in the tail never reaches the host's memory: it goes from the pipe
        to /dev/null inside the kernel (``splice``), and only the last ``keep`` bytes are read."""
        for _ in range(self.READS_PER_DRAIN):
            try:
                skip = _pending_bytes(self._rfd) - self.keep
                if skip > 0:
                    skipped = os.splice(self._rfd, _null(), skip, flags=os.SPLICE_F_NONBLOCK)
                    self.received += skipped
                    self.dropped += skipped
                data = os.read(self._rfd, 65536)
            except BlockingIOError:
                return False
            except OSError:
                return True
            if not data:
                return True
            self.received += len(data)
            self._tail += data[-self.keep:]
            self.dropped += len(data) - min(len(data), self.keep)
            over = len(self._tail) - self.keep
            if over > 0:
                del self._tail[:over]
                self.dropped += over
        return False

    def tail(self, n: int = 600) -> str:
        """The last ``n`` bytes (at most ``keep``), decoded and quoted with ``ascii()``; never raises, never blocks."""
        if self._rfd < 0:
            return "(no log)"
        self._drain()
        text = bytes(self._tail[-n:]).decode(errors="replace").strip()
        return ascii(text) if text else "(no output)"

    def close(self) -> None:
        """Close both ends; the reader goes from its loop, on that loop's thread where it runs in another (a fork
        server's log may be closed from a loop other than the one that started it). Idempotent, never raises."""
        loop, timer, read_fd, write_fd = self._loop, self._timer, self._rfd, self.fd
        self._loop = self._timer = None
        self._rfd = self.fd = -1
        if write_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(write_fd)
        if read_fd < 0:
            return

        def finish() -> None:
            if timer is not None:
                timer.cancel()
            if loop is not None:
                with contextlib.suppress(Exception):  # a loop closed meanwhile has no reader left to remove
                    loop.remove_reader(read_fd)
            with contextlib.suppress(OSError):
                os.close(read_fd)

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or loop is running or not loop.is_running():
            finish()
            return
        try:
            loop.call_soon_threadsafe(finish)
        except RuntimeError:  # closed meanwhile
            finish()


_null_fd = -1


def _null() -> int:
    """A descriptor of /dev/null, opened once per process (where a kernel's bytes past its tail go)."""
    global _null_fd
    if _null_fd < 0:
        _null_fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    return _null_fd


def _pending_bytes(fd: int) -> int:
    """Bytes waiting in the pipe ``fd`` (FIONREAD)."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


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
