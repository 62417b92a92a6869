"""What holds on this host, in words: the boot path, the seccomp filter, the totals' mechanisms (``replrl env``)."""

from __future__ import annotations

from .budget import memory_mechanism
from .launch import seccomp_available
from .limits import Limits, is_root
from .zygote import boot_path


def mechanisms(limits: Limits | None = None) -> list[tuple[str, str]]:
    """(what, how it holds here) for each isolation mechanism a kernel made with ``limits`` gets on this host.
    Raises SandboxUnavailable when no kernel can start here at all."""
    limits = limits or Limits()
    level = limits.resolve_isolation()
    path, why = boot_path(level, limits)
    rows = [("kernel boot", f"{path} ({why})")]
    if seccomp_available():
        rows.append(("seccomp", "in force: no kernel keyrings (add_key, request_key, keyctl), no user namespaces"))
    else:
        rows.append(("seccomp", "NOT in force: libseccomp or its binding (pyseccomp) is missing here; kernels can "
                     "use keyrings and make user namespaces (apt-get install libseccomp2; pip install pyseccomp)"))
    kind, detail = memory_mechanism()
    if kind == "watchdog":
        rows.append(("memory of a kernel's processes together", f"the host's watchdog, every 0.25 s ({detail})"))
    else:
        rows.append(("memory of a kernel's processes together", f"{kind} ({detail})"))
    tmpfs = path == "forked" or level == "unshare" or (level == "bwrap" and is_root())
    rows.append(("kernel directory total", f"a tmpfs of {limits.max_dir_mb} MB in the kernel's own mount namespace"
                 if tmpfs else f"the host's watchdog sums it ({limits.max_dir_mb} MB; the kernel writes to the "
                 "host's disk at this level)"))
    rows.append(("terminals", "a devpts of each kernel's own" if level == "bwrap" else
                 "the host's /dev/pts (no filesystem view at this level)"))
    return rows
