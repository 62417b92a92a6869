"""Limits: what one sandboxed kernel may use, and how strongly it is isolated."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Literal

from .errors import SandboxUnavailable

Isolation = Literal["auto", "bwrap", "unshare", "rlimits"]
LEVELS = ("bwrap", "unshare", "rlimits")  # strongest first


@dataclass(frozen=True)
class Limits:
    """Per-kernel resource limits and isolation. Defaults suit RL rollouts of short Python lines."""

    wall_s: float = 5.0
    """Wall-clock seconds one execution may take before it is interrupted."""
    interrupt_grace_s: float = 1.0
    """After an interrupt, how long the kernel has to become idle before it is killed and replaced."""
    memory_mb: int | None = 2048
    """Memory of the kernel: each process's address space (RLIMIT_AS, so a huge allocation raises MemoryError
    instead of waking the OOM killer), and all of its processes together (a cgroup of its own, or the host's
    watchdog: ``sandbox/budget.py``); a kernel past the total is stopped and its episode ends as a crash."""
    max_procs: int = 64
    """Processes+threads the kernel's uid may have (RLIMIT_NPROC): stops fork bombs. Real when the kernel runs under
    its own uid (the host is root) or in a pid namespace."""
    max_file_mb: int = 64
    """Largest file the kernel may write (RLIMIT_FSIZE)."""
    max_dir_mb: int = 128
    """All the files in the kernel's working directory together: a tmpfs of this size in the kernel's own mount
    namespace (writing past it fails with ENOSPC; its pages count in the memory total), or, where the kernel has no
    mount namespace, the watchdog stops the kernel past it."""
    max_dir_inodes: int = 16384
    """Files and directories the working directory may hold (the tmpfs's inode count)."""
    max_open_files: int = 256
    """RLIMIT_NOFILE."""
    max_output_bytes: int = 64_000
    """Output kept per execution, enforced inside the kernel; the rest is dropped and the result says truncated."""
    network: bool = False
    """Allow network access. False needs a network namespace (bwrap or unshare)."""
    isolation: Isolation = "auto"
    """bwrap (namespaces + read-only filesystem view), unshare (namespaces), rlimits (limits + uid only), or auto:
    the strongest this machine offers. Asking for a level that is unavailable raises SandboxUnavailable."""
    uid_base: int = 70000
    """When the host runs as root, each kernel runs under its own uid from uid_base upwards (never root)."""
    ro_paths: tuple[str, ...] = ()
    """Host files or directories the kernel may read on purpose (e.g. a data file a task hands the model), mounted
    read-only at the same path. Only the bwrap level has a filesystem view; at the other levels everything the
    kernel's uid can read is readable anyway."""
    fork_server: bool = True
    """Fork each kernel from a pre-imported parent inside the sandbox (``sandbox/zygote.py``): a fresh kernel costs a
    fraction of a boot's CPU, with the same namespaces, view, uid and limits. Used at the bwrap level on a root host;
    elsewhere (or False) every kernel boots on its own, as bwrap + python."""

    def __post_init__(self) -> None:
        if self.isolation not in ("auto", *LEVELS):
            raise ValueError(f"Limits.isolation must be one of auto, {', '.join(LEVELS)}; got {self.isolation!r}")
        if self.wall_s <= 0 or self.interrupt_grace_s <= 0:
            raise ValueError("Limits.wall_s and Limits.interrupt_grace_s must be positive")
        if self.max_output_bytes < 1:
            raise ValueError("Limits.max_output_bytes must be positive")
        if self.max_dir_mb < 1 or self.max_dir_inodes < 16:
            raise ValueError("Limits.max_dir_mb must be positive and Limits.max_dir_inodes at least 16")
        if isinstance(self.ro_paths, str) or not all(isinstance(p, str) and p.startswith("/") for p in self.ro_paths):
            raise ValueError("Limits.ro_paths must be a tuple of absolute paths")

    def resolve_isolation(self) -> str:
        """The isolation level kernels will actually run under (raises SandboxUnavailable if it cannot be met)."""
        if self.isolation != "auto":
            if not available(self.isolation):
                raise SandboxUnavailable(f"isolation {self.isolation!r} is not available on this machine"
                                         f" ({_why_not(self.isolation)})")
            level = self.isolation
        else:
            level = next((lv for lv in LEVELS if available(lv)), None)
            if level is None:
                raise SandboxUnavailable(f"no sandbox can start here: {_why_not('bwrap')} and {_why_not('unshare')}; "
                                         f"fix: {fix_command()}")
        if not self.network and level == "rlimits":
            raise SandboxUnavailable("Limits(network=False) needs a network namespace, but neither bubblewrap nor "
                                     f"unshare works here ({_why_not('bwrap')}); fix: {fix_command()}")
        return level


def hides_host_files(level: str) -> bool:
    """Whether kernels at this isolation level see only an allowlist of host files (bwrap builds a filesystem
    view); at the other levels model-written code can read whatever the kernel's uid can read."""
    return level == "bwrap"


def is_root() -> bool:
    return os.geteuid() == 0


def _probe(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def python_reachable_by_others() -> bool:
    """Whether a process of another uid can run this interpreter and its packages without a filesystem view
    (bwrap builds one; unshare and rlimits need every directory on the way to be world-searchable)."""
    import sys

    for path in {sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))}:
        path = os.path.realpath(path)
        while path not in ("/", ""):
            if not os.stat(path).st_mode & 0o001:
                return False
            path = os.path.dirname(path)
    return True


@functools.cache
def available(level: str) -> bool:
    """Whether an isolation level works here (probed once per process by running ``true`` under it)."""
    if level != "bwrap" and is_root() and not python_reachable_by_others():
        return False  # the kernel drops to its own uid, which could not start this Python
    if level == "rlimits":
        return True
    if level == "bwrap":
        exe = shutil.which("bwrap")
        user = [] if is_root() else ["--unshare-user"]
        return bool(exe) and _probe([exe, "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", *user,
                                     "--unshare-pid", "--unshare-net", "--die-with-parent", "true"])
    if level == "unshare":
        exe = shutil.which("unshare")
        user = [] if is_root() else ["--user", "--map-root-user"]
        return bool(exe) and _probe([exe, *user, "--pid", "--fork", "--kill-child", "--mount-proc", "--net", "true"])
    raise ValueError(level)


def fix_command() -> str:
    """The command that gives this machine the strongest sandbox level."""
    apt = "apt-get install -y bubblewrap" if is_root() else "sudo apt-get install -y bubblewrap"
    return f"`{apt}` (Debian/Ubuntu; `dnf install bubblewrap` on Fedora)"


def _why_not(level: str) -> str:
    if level != "bwrap" and is_root() and not python_reachable_by_others():
        return (f"`{level}` cannot run this Python as the kernel's own uid (a parent directory of the interpreter "
                "is not world-searchable)")
    if level == "rlimits":
        return "rlimits needs nothing extra"
    tool = {"bwrap": "bwrap", "unshare": "unshare"}[level]
    if not shutil.which(tool):
        return "bubblewrap (`bwrap`) is not installed" if tool == "bwrap" else "`unshare` is not installed"
    return f"`{tool}` is installed but cannot create namespaces here (user namespaces disabled?)"
