"""How a sandboxed kernel process is started: the command line and environment for each isolation level."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from .limits import Limits, is_root

KERNEL_SOURCE = (Path(__file__).with_name("_kernel_side.py")).read_text()

# Host directories a sandboxed kernel must not see (homes hold keys and tokens; /run holds daemon sockets).
HIDDEN = ("/root", "/home", "/tmp", "/var/tmp", "/run")

_uid_counter = itertools.count()


@dataclass
class LaunchSpec:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    uid: int | None
    """The dedicated uid the kernel drops to (host is root), else None (the kernel runs as the host user)."""


def next_uid(limits: Limits) -> int | None:
    """A uid of the kernel's own when the host is root (so RLIMIT_NPROC and kill permissions are per kernel)."""
    return limits.uid_base + next(_uid_counter) % 20000 if is_root() else None


def python_paths() -> list[str]:
    """Directories the kernel's interpreter needs: prefixes, the executable's folder, and sys.path entries."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    paths.update(p for p in sys.path if p and os.path.isdir(p))
    return sorted(os.path.realpath(p) for p in paths)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def kernel_env(limits: Limits, kdir: str, uid: int | None, may_reap: bool) -> dict[str, str]:
    gid = uid
    config = {
        "uid": uid,
        "gid": gid,
        "max_output": limits.max_output_bytes,
        "may_reap": may_reap,
        "rlimits": {
            "as": limits.memory_mb * 2**20 if limits.memory_mb else None,
            "nproc": limits.max_procs,
            "fsize": limits.max_file_mb * 2**20,
            "nofile": limits.max_open_files,
            "core": 0,
        },
    }
    return {
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"]),
        "HOME": os.path.join(kdir, "work"),
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)),
        "PYTHONHASHSEED": "0",  # deterministic set/dict-of-str ordering: reproducible transcripts
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MALLOC_ARENA_MAX": "2",
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",  # else debugpy's import warning lands in the first output
        "REPLRL_SANDBOX": json.dumps(config),
    }


def launch_spec(level: str, limits: Limits, kdir: str, conn_file: str) -> LaunchSpec:
    uid = next_uid(limits)
    work = os.path.join(kdir, "work")
    may_reap = uid is not None or level in ("bwrap", "unshare")
    env = kernel_env(limits, kdir, uid, may_reap)
    python = [sys.executable, "-c", KERNEL_SOURCE, "-f", conn_file]
    if level == "bwrap":
        argv = [shutil.which("bwrap") or "bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        for hidden in HIDDEN:
            if os.path.isdir(hidden) and not os.path.islink(hidden):
                argv += ["--tmpfs", hidden]
        made: set[str] = set()
        for path in python_paths():
            hidden_root = next((h for h in HIDDEN if _under(path, h)), None)
            if hidden_root is None:
                continue
            # bwrap makes missing mount points 0700; the kernel's uid must be able to walk through them
            parts = path[len(hidden_root):].strip("/").split("/")[:-1]
            for i in range(len(parts)):
                parent = os.path.join(hidden_root, *parts[: i + 1])
                if parent not in made:
                    made.add(parent)
                    argv += ["--perms", "0755", "--dir", parent]
            argv += ["--ro-bind", path, path]
        argv += ["--bind", kdir, kdir]
        argv += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if not limits.network:
            argv += ["--unshare-net"]
        if not is_root():
            argv += ["--unshare-user"]
        argv += ["--die-with-parent", "--new-session", "--chdir", work, "--clearenv"]
        for key, value in env.items():
            argv += ["--setenv", key, value]
        return LaunchSpec(argv + ["--", *python], env={}, cwd=work, uid=uid)
    if level == "unshare":
        argv = [shutil.which("unshare") or "unshare"]
        if not is_root():
            argv += ["--user", "--map-root-user"]
        argv += ["--pid", "--fork", "--kill-child", "--mount-proc", "--ipc", "--uts"]
        if not limits.network:
            argv += ["--net"]
        return LaunchSpec(argv + ["--", *python], env=env, cwd=work, uid=uid)
    if level == "rlimits":
        return LaunchSpec(python, env=env, cwd=work, uid=uid)
    raise ValueError(level)


def kill_uid(uid: int) -> None:
    """SIGKILL every process owned by ``uid`` (host is root; used when no pid namespace holds the kernel)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass
