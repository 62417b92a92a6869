"""What holds on this host, in words: the boot path, the seccomp filter, the totals' mechanisms (``replrl env``)."""

from __future__ import annotations

import re

from .budget import CPU_BURST_S, CPU_CORES, WATCH_EVERY_S, cpu_mechanism, memory_mechanism
from .launch import PTYS_PER_KERNEL, seccomp_available
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
        rows.append(("seccomp", "in force: no kernel keyrings (add_key, request_key, keyctl), no user namespaces, "
                     "no inotify, no perf_event_open (EPERM); no AIO (io_setup, ...), no io_uring (ENOSYS)"))
    else:
        rows.append(("seccomp", "NOT in force: libseccomp or its binding (pyseccomp) is missing here; kernels can "
                     "use keyrings, AIO, io_uring, inotify and perf_event_open and make user namespaces "
                     "(apt-get install libseccomp2; pip install pyseccomp)"))
    kind, detail = memory_mechanism()
    if kind == "watchdog":
        rows.append(("memory of a kernel's processes together", f"the host's watchdog, every 0.25 s ({detail})"))
    else:
        rows.append(("memory of a kernel's processes together", f"{kind} ({detail})"))
    kind, detail = cpu_mechanism()
    if kind == "watchdog":
        rows.append(("CPU of a kernel's processes together", f"the host's watchdog, every {WATCH_EVERY_S:g} s: "
                     f"all of them stopped (SIGSTOP) while they are more than {CPU_BURST_S:g} s of {CPU_CORES:g} CPU "
                     f"ahead ({detail})"))
    else:
        rows.append(("CPU of a kernel's processes together", f"{kind} ({detail})"))
    tmpfs = path == "forked" or level == "unshare" or (level == "bwrap" and is_root())
    rows.append(("kernel directory total", f"a tmpfs of {limits.max_dir_mb} MB in the kernel's own mount namespace"
                 if tmpfs else f"the host's watchdog sums it ({limits.max_dir_mb} MB; the kernel writes to the "
                 "host's disk at this level)"))
    if level != "bwrap":
        rows.append(("terminals", "the host's /dev/pts (no filesystem view at this level)"))
    elif is_root():
        rows.append(("terminals", f"a devpts of each kernel's own, at most {PTYS_PER_KERNEL} ptys"))
    else:
        rows.append(("terminals", "a devpts of each kernel's own (bwrap's), with no bound of its own on its ptys: "
                     "only a root host can mount one with a bound"))
    return rows


KERNEL_CHECK = "1+1"
KERNEL_CHECK_TIMEOUT_S = 120.0


def kernel_start(limits: Limits | None = None, timeout: float = KERNEL_CHECK_TIMEOUT_S) -> tuple[bool, str]:
    """Start one real kernel with ``limits``, as a run does, and run ``1+1`` in it: (it worked, what happened, in one
    line). A failure names its reason (the kernel log's last error line) and the log's tail, quoted with ``ascii()``:
    those are the kernel's bytes. Never raises (``replrl env`` asks this once; the mechanisms above say what would
    hold, this says whether a kernel starts at all)."""
    import asyncio
    import time

    from .errors import KernelStartError
    from .kernel import Kernel
    from .sync import run_sync

    limits = limits or Limits()

    async def attempt() -> tuple[bool, str]:
        t0 = time.perf_counter()
        kernel = Kernel(limits)
        try:
            await kernel.start()
            result = await kernel.execute(KERNEL_CHECK, mode="single")
            forked = getattr(kernel._proc, "_zygote", None) is not None
        finally:
            await kernel.shutdown()
        took = time.perf_counter() - t0
        if result.status == "ok" and result.output == "2\n":
            return True, f"ok: started one ({'forked' if forked else 'booted'}) and ran {KERNEL_CHECK} -> 2 in " \
                         f"{took:.1f} s"
        return False, (f"FAILED: a kernel started but {KERNEL_CHECK} gave status {result.status!r}, output "
                       f"{ascii(result.output[-300:])}")

    try:
        return run_sync(asyncio.wait_for(attempt(), timeout))
    except KernelStartError as err:
        return False, _start_failure(str(err))
    except (asyncio.TimeoutError, TimeoutError):
        return False, f"FAILED: no kernel started and ran {KERNEL_CHECK} within {timeout:.0f} s"
    except Exception as err:  # the report goes on: whatever stopped the kernel is its line
        return False, f"FAILED: {type(err).__name__}: {ascii(str(err))}"


def _start_failure(message: str) -> str:
    """One line for a kernel that did not start: the host's words, then the kernel's log (its bytes: ``ascii()``)."""
    head, sep, log = message.partition("did not start: ")
    if not sep:
        return f"FAILED: {ascii(message)}"
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    if len(lines) <= 1:
        return f"FAILED: {head}did not start: {ascii(lines[0] if lines else log)}"
    errors = [line for line in lines if _ERROR_LINE.match(line)]  # "ModuleNotFoundError: ...", "sandbox: ..."
    reason = errors[-1] if errors else lines[-1]
    return f"FAILED: {head}did not start: {ascii(reason)} (its log ends: {ascii(log[-600:])})"


_ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit)\b|sandbox:|Fatal Python error)")
