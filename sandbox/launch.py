"""How a sandboxed kernel process is started: the command line and environment for each isolation level."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import itertools
import json
import os
import secrets
import shutil
import signal
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .limits import Limits, is_root

KERNEL_SOURCE = (f"_DIGEST_SOURCE = {Path(__file__).with_name('_kernel_digest.py').read_text()!r}\n"
                 + Path(__file__).with_name("_kernel_side.py").read_text())
"""The kernel program: _kernel_side.py, with the state digest's source (_kernel_digest.py) handed to it as a string."""

# The bwrap level's filesystem view is an allowlist: an empty root, then these read-only, then the interpreter's own
# directories, the kernel's working directory (writable) and Limits.ro_paths. Nothing else of the host is there: no
# checkout, datasets, caches, run directories, homes or other kernels' directories.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "nsswitch.conf", "passwd", "group",
             "hosts", "host.conf", "os-release", "mime.types", "ssl", "ca-certificates", "ca-certificates.conf")

_SIDE = Path(__file__).with_name("_kernel_side.py").read_text()
KERNEL_IMPORT_SECCOMP = _SIDE[_SIDE.index("def _import_seccomp():"):_SIDE.index("def _before_serving(cfg):")]
"""The kernel program's ``_import_seccomp``: the host asks the same import whether the filter can be installed."""
PTYS_PER_KERNEL = 16
"""Terminals one kernel may hold at a time (the ``max`` of its own devpts instance; ``os.openpty`` past it raises
ENOSPC): a kernel that opens every pty it may exhausts its own instance, never the machine's ``kernel.pty.max``."""
KERNEL_HOSTNAME = "localhost"
"""The host name a kernel sees (``socket.gethostname()``, ``os.uname().nodename``) at the bwrap level, which gives it
a UTS namespace of its own: not the machine's name, and one every kernel shares, so a transcript never shows it."""
KERNEL_HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
"""A kernel's ``/etc/hosts`` when its network is off (loopback is all it reaches): the host's names the machine, and
on a cluster its neighbours."""
KERNEL_PASSWD = "root:x:0:0:root:/root:/usr/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
KERNEL_GROUP = "root:x:0:\nnogroup:x:65534:\n"
"""A kernel's ``/etc/passwd`` and ``/etc/group``: root and nobody, not the host's accounts (their names, homes and
groups). On a host that is not root, whose kernels run as its own uid, that uid is there too, named ``sandbox``."""
UID_SPAN = 20000
"""Kernel uids are drawn from ``[uid_base, uid_base + UID_SPAN)``."""
_uid_counter = itertools.count(secrets.randbelow(UID_SPAN))
"""Each process starts at a random place in the span: a run does not hand its first kernels the uids the previous
run's first kernels had (nothing a kernel leaves to its uid reaches a later one anyway: no keyrings, see
``_kernel_side._install_seccomp``; a pid namespace or ``kill_uid`` ends its processes)."""
_claims: dict[int, int] = {}
"""uid -> the open lock file that claims it, held while a kernel of this process runs under that uid."""


@dataclass
class LaunchSpec:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    uid: int | None
    """The dedicated uid the kernel drops to (host is root), else None (the kernel runs as the host user)."""


def claims_dir() -> Path:
    """Where kernel uids are claimed: root's own directory (under /run when it can be written, else the temp
    directory). Kernels run under other uids, so none can hold, forge or remove a claim; a directory that is not
    root's alone (made by someone else first) is refused rather than used."""
    base = Path("/run") if os.access("/run", os.W_OK) else Path(tempfile.gettempdir())
    path = base / "replrl-uids"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise RuntimeError(f"sandbox: {path} must be a directory of uid {os.geteuid()} with mode 0700 (it claims "
                           "kernel uids): remove it")
    return path


def next_uid(limits: Limits) -> int | None:
    """A uid of the kernel's own when the host is root (so RLIMIT_NPROC and kill permissions are per kernel), None
    otherwise. The uid is claimed host-wide with an flock on ``claims_dir()/<uid>`` until ``release_uid``: two
    processes (two runs, a sweep's parallel runs, a notebook beside a run) never share a kernel uid, so one's kernel
    can neither signal the other's nor use up its process limit. A claim dies with its process."""
    if not is_root():
        return None
    where = claims_dir()
    for _ in range(UID_SPAN):
        uid = limits.uid_base + next(_uid_counter) % UID_SPAN
        if uid in _claims:
            continue
        fd = os.open(where / str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _claims[uid] = fd
        return uid
    raise RuntimeError(f"sandbox: all {UID_SPAN} kernel uids from {limits.uid_base} are in use")


def release_uid(uid: int | None) -> None:
    """Give back a uid from ``next_uid`` (once its kernel's processes are gone). Idempotent."""
    fd = _claims.pop(uid, None) if uid is not None else None
    if fd is not None:
        os.close(fd)


def python_paths() -> list[str]:
    """Directories the kernel's interpreter needs: its prefixes, the executable's folder, the standard library and
    site-packages, and sys.path entries inside those (a .pth file's extra directories). sys.path entries elsewhere
    (the checkout a test runner or an editable install put there) are left out."""
    import site
    import sysconfig

    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable),
             os.path.dirname(os.path.realpath(sys.executable))}
    roots.update(v for k, v in sysconfig.get_paths().items() if k in ("stdlib", "platstdlib", "purelib", "platlib"))
    roots.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    if site.ENABLE_USER_SITE and site.USER_SITE:
        roots.add(site.USER_SITE)
    paths = {p for p in roots if p and os.path.isdir(p)}
    real_roots = {os.path.realpath(p) for p in paths}
    paths.update(p for p in sys.path if p and os.path.isdir(p) and any(_under(os.path.realpath(p), r) for r in
                                                                        real_roots))
    return sorted(paths)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


KERNEL_MODULES = ("ipykernel", "jupyter_client", "zmq", "seccomp", "pyseccomp")
"""What the kernel program imports from outside the standard library (the seccomp binding: whichever is installed;
see ``_kernel_side._import_seccomp``). Their distributions and everything those require come with them."""
KERNEL_DISTRIBUTIONS = ("ipykernel", "jupyter_client", "pyzmq", "pyseccomp", "seccomp")


def kernel_import_dirs() -> list[str]:
    """The directories the kernel program imports from, wherever the host found them: the ``sys.path`` entries that
    hold ``KERNEL_MODULES`` and the distributions of ``KERNEL_DISTRIBUTIONS`` with everything they require (markers
    evaluated, extras not), and the real directories of those packages where an entry only links to them (a symlink
    farm such as a Spack view). A ``PYTHONPATH`` directory, a cluster module's or one a ``.pth`` file adds counts when
    it holds one of them; no other entry of ``sys.path`` does (a checkout, a dataset directory), and an entry that
    holds this project's checkout never does: replrl is not needed inside a kernel. Read-only in the kernel's view,
    and the entries on its import path (``kernel_env``)."""
    return list(_import_dirs(tuple(sys.path)))


@functools.lru_cache(maxsize=8)
def _import_dirs(path: tuple[str, ...]) -> tuple[str, ...]:
    import importlib.metadata
    import importlib.util

    entries = [(p, os.path.realpath(p)) for p in path if p and os.path.isdir(p)]

    def entry_of(file: str) -> str | None:  # the sys.path entry a file was imported through (the longest match)
        real = os.path.realpath(file)
        found = [(len(r), p) for p, r in entries if _under(real, r) or _under(os.path.abspath(file), p)]
        return max(found)[1] if found else None

    dirs: set[str] = set()

    def add_module(name: str) -> None:
        try:
            spec = importlib.util.find_spec(name)  # a top-level name: imports nothing
        except (ImportError, ValueError):
            return
        if spec is None or spec.origin in (None, "built-in", "frozen"):
            return  # not there, or a namespace package (found anywhere a directory of that name is)
        for place in [spec.origin, *(spec.submodule_search_locations or [])]:
            if os.path.isabs(place):
                entry = entry_of(place)
                if entry is not None:
                    dirs.add(entry)
                top = os.path.dirname(place) if spec.submodule_search_locations is None else place
                if entry is not None and not _under(os.path.realpath(top), os.path.realpath(entry)):
                    dirs.add(os.path.realpath(top) if os.path.isdir(top) else os.path.realpath(place))

    for name in KERNEL_MODULES:
        add_module(name)
    todo, seen = list(KERNEL_DISTRIBUTIONS), set()
    while todo:
        name = _canonical(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [req for req in map(_required, dist.requires or []) if req]
        home = str(dist.locate_file(""))
        if os.path.isdir(home):
            dirs.add(entry_of(home) or home)
        tops = {f.parts[0] for f in (dist.files or []) if f.parts and f.parts[0] not in ("..", "__pycache__")}
        for top in tops:
            where = str(dist.locate_file(top))
            if os.path.islink(where) and os.path.exists(where):  # a link farm: bind what it points to
                dirs.add(os.path.realpath(where))
            module = top.split(".")[0]
            if (top.endswith((".dist-info", ".egg-info", ".pth", ".data")) or not module.isidentifier()
                    or os.path.exists(where)):
                continue
            add_module(module)  # listed but not beside its metadata: an editable install, found through sys.path
    checkout = _checkout()
    keep = {d for d in dirs if os.path.isdir(d) or os.path.isfile(d)}
    if checkout is not None:
        keep = {d for d in keep if not _under(checkout, os.path.realpath(d))}
    return tuple(sorted(keep))


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _required(requirement: str) -> str | None:
    """The distribution a ``Requires-Dist`` line names, or None when its marker does not hold here (an extra's)."""
    try:
        from packaging.requirements import Requirement

        req = Requirement(requirement)
        return req.name if req.marker is None or req.marker.evaluate({"extra": ""}) else None
    except ImportError:  # no packaging: keep what is not an extra's (a platform marker that fails only adds a dir)
        head, _, marker = requirement.partition(";")
        name = head.strip().split("[")[0]
        for sep in "<>=!~ (":
            name = name.split(sep)[0]
        return None if "extra" in marker else (name.strip() or None)
    except Exception:
        return None


def _checkout() -> str | None:
    """This project's source checkout when the sandbox package runs from one (a pyproject.toml beside it), else None
    (an installed copy, in site-packages or a ``pip install --target`` directory)."""
    root = Path(__file__).resolve().parent.parent
    return str(root) if (root / "pyproject.toml").is_file() else None


def bwrap_view(kdir: str, ro_paths: tuple[str, ...] = (), network: bool = True) -> list[str]:
    """bwrap arguments that build the kernel's filesystem view (see SYSTEM_DIRS): an allowlist, nothing else. Without
    the network, ``/etc/hosts`` is ``KERNEL_HOSTS``; ``/etc/passwd`` and ``/etc/group`` are ``kernel_etc``'s."""
    args: list[str] = []
    for top in SYSTEM_DIRS:  # merged-/usr systems have /bin -> usr/bin: keep the link, bind the real directory
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
    binds: dict[str, str] = {}  # destination -> source
    for top in SYSTEM_DIRS:
        if os.path.isdir(top) and not os.path.islink(top):
            binds[top] = top
    for name in ETC_FILES:
        if os.path.exists(os.path.join("/etc", name)):
            binds[os.path.join("/etc", name)] = os.path.join("/etc", name)
    for name, text in kernel_etc(network).items():
        binds[os.path.join("/etc", name)] = _etc_file(name, text)
    for path in [*python_paths(), *kernel_import_dirs(), *ro_paths]:
        if os.path.exists(path):
            for dest in {os.path.abspath(path), os.path.realpath(path)}:  # a symlinked prefix is reached both ways
                binds[dest] = os.path.realpath(path)
    # keep only outermost mounts; create every missing parent as 0755 (bwrap would make it 0700, unwalkable by
    # the kernel's own uid)
    kept = [d for d in sorted(binds) if not any(_under(d, o) and d != o for o in binds)]
    made: set[str] = set()

    def parents(path: str) -> list[str]:  # the missing parent directories of a mount point, outermost first
        chain = []
        while (path := os.path.dirname(path)) not in ("/", "") and path not in made:
            chain.append(path)
        made.update(chain)
        return [a for d in reversed(chain) for a in ("--perms", "0755", "--dir", d)]

    for dest in kept:
        args += [*parents(dest), "--ro-bind", binds[dest], dest]
    args += [*parents(kdir), "--bind", kdir, kdir, "--dev", "/dev", "--proc", "/proc", "--remount-ro", "/"]
    return args


def kernel_etc(network: bool) -> dict[str, str]:
    """The files of a kernel's ``/etc`` made here instead of bound from the host's: name -> text."""
    passwd, group = KERNEL_PASSWD, KERNEL_GROUP
    if not is_root():
        passwd += f"sandbox:x:{os.getuid()}:{os.getgid()}:sandbox:/nonexistent:/usr/sbin/nologin\n"
        group += f"sandbox:x:{os.getgid()}:\n"
    return {"passwd": passwd, "group": group, **({} if network else {"hosts": KERNEL_HOSTS})}


def _etc_file(name: str, text: str) -> str:
    """``text`` in the file ``etc-<name>`` of ``claims_dir()`` (this user's alone, in no kernel's view), written once
    (replaced whole when it differs), for bwrap to bind read-only."""
    path = claims_dir() / f"etc-{name}"
    with contextlib.suppress(OSError):
        if path.read_text() == text:
            return str(path)
    fd, pending = tempfile.mkstemp(dir=path.parent, prefix=f".etc-{name}-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(pending, 0o644)
    os.replace(pending, path)
    return str(path)


@functools.cache
def seccomp_available() -> bool:
    """Whether the kernel program can install its seccomp filter here: libseccomp and a Python binding of it
    (``seccomp``, or ``pyseccomp``, a dependency of replrl on Linux) import in this interpreter, which the kernels
    run too."""
    try:
        namespace: dict = {"_ZYGOTE": True}  # the kernel program's own import, without starting anything
        exec(compile(KERNEL_IMPORT_SECCOMP, "_kernel_side.py", "exec"), namespace)
        seccomp = namespace["_import_seccomp"]()
        seccomp.SyscallFilter(seccomp.ALLOW)
        return True
    except Exception:
        return False


def kernel_env(limits: Limits, kdir: str, uid: int | None, may_reap: bool,
               extra_cfg: dict | None = None) -> dict[str, str]:
    gid = uid
    visible = python_paths()
    imports = kernel_import_dirs()
    config = {
        "uid": uid,
        "gid": gid,
        "max_output": limits.max_output_bytes,
        "may_reap": may_reap,
        # where the host finds ipykernel (a user site, a PYTHONPATH directory, say): the kernel imports it from there,
        # then gives user code the interpreter's own sys.path, as `python -i` has it (so no PYTHONPATH: it would show
        # through). Only directories of the view: the interpreter's, and those that hold the kernel program's
        # imports (kernel_import_dirs); the host's other entries, a checkout say, are not the kernel's to know
        "import_path": [p for p in sys.path if p and os.path.isdir(p)
                        and (p in imports or any(_under(p, v) for v in visible))],
        "rlimits": {
            "as": limits.memory_mb * 2**20 if limits.memory_mb else None,
            "nproc": limits.max_procs,
            "fsize": limits.max_file_mb * 2**20,
            "nofile": limits.max_open_files,
            "core": 0,
        },
        **(extra_cfg or {}),
    }
    return {
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"]),
        "HOME": os.path.join(kdir, "work"),
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


def launch_spec(level: str, limits: Limits, kdir: str, conn_file: str, extra_cfg: dict | None = None) -> LaunchSpec:
    uid = next_uid(limits)
    work = os.path.join(kdir, "work")
    may_reap = uid is not None or level in ("bwrap", "unshare")
    if level == "bwrap" and is_root():  # bwrap's --dev gave it a devpts of its own, with no bound on its ptys
        extra_cfg = {**(extra_cfg or {}), "devpts_max": PTYS_PER_KERNEL}
    env = kernel_env(limits, kdir, uid, may_reap, extra_cfg)
    python = [sys.executable, "-c", KERNEL_SOURCE, "-f", conn_file]
    if level == "bwrap":
        argv = [shutil.which("bwrap") or "bwrap", *bwrap_view(kdir, limits.ro_paths, limits.network)]
        argv += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--hostname", KERNEL_HOSTNAME,
                 "--unshare-cgroup-try"]
        if not limits.network:
            argv += ["--unshare-net"]
        if not is_root():
            argv += ["--unshare-user"]
        argv += ["--die-with-parent", "--new-session", "--chdir", work]
        if _setuid(argv[0]):  # glibc drops some variables (MALLOC_ARENA_MAX) from a setuid program's environment
            argv += ["--clearenv"]
            for key, value in env.items():
                argv += ["--setenv", key, value]
            env = {}
        # else the environment is bwrap's own, which it hands on: not on bwrap's command line, which is the
        # kernel's /proc/1/cmdline (its configuration, uid and descriptors were readable there)
        return LaunchSpec(argv + ["--", *python], env=env, cwd=work, uid=uid)
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


def _setuid(program: str) -> bool:
    try:
        return bool(os.stat(program).st_mode & stat.S_ISUID) and not is_root()
    except OSError:
        return False


def kill_uid(uid: int) -> None:
    """SIGKILL every process owned by ``uid`` (host is root; used when no pid namespace holds the kernel)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass
