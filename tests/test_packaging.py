"""A plain (non-editable) `pip install .` into a fresh virtualenv gives a working `replrl` (issue 49): the package
data, the entry point and the sandbox all come from the installed copy, not from this checkout. The virtualenv
reuses this interpreter's packages (--system-site-packages) and pip may fetch nothing (--no-index): a dependency
the metadata forgets fails here instead of downloading."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from replrl.configlib import load_file

REPO = Path(__file__).resolve().parents[1]


def test_license_file_matches_the_metadata():
    meta = load_file(REPO / "pyproject.toml")["project"]
    assert meta["license"] == "MIT" and meta["license-files"] == ["LICENSE"]  # an SPDX expression (PEP 639)
    assert (REPO / "LICENSE").read_text().startswith("MIT License\n")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pip_install_into_a_fresh_venv_gives_a_working_replrl(tmp_path):
    src = tmp_path / "src"  # a copy of the tracked files: the build writes build/ and *.egg-info where it runs
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    for name in files.stdout.split("\0"):
        if name and (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    venv = tmp_path / "venv"
    # no pip of its own: the venv's bundled setuptools may predate bdist_wheel; this interpreter's pip and
    # setuptools (seen through --system-site-packages) install into the venv
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True,
                   timeout=300)
    py, exe = venv / "bin" / "python", venv / "bin" / "replrl"
    pip = subprocess.run([str(py), "-m", "pip", "install", "--no-index", "--no-build-isolation", str(src)],
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-2000:]
    away = tmp_path / "elsewhere"  # not the checkout: the current directory would shadow the installed package
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([str(py), "-c", "import replrl, sandbox; print(replrl.__file__); print(sandbox.__file__)"],
                           capture_output=True, text=True, cwd=away, env=env, timeout=120)
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(venv)) for line in where.stdout.split()), where.stdout  # the installed copy
    info = list((venv / "lib").glob("python3*/site-packages/replrl-*.dist-info"))
    assert info and any(p.name.startswith("LICENSE") for p in info[0].rglob("*")), "the wheel carries LICENSE"
    assert (info[0].parent / "replrl" / "py.typed").exists()
    helped = subprocess.run([str(exe), "--help"], capture_output=True, text=True, cwd=away, env=env, timeout=120)
    assert helped.returncode == 0 and "export" in helped.stdout and "train" in helped.stdout, helped.stderr
    repl = subprocess.run([str(exe), "repl"], input="x = 6 * 7\nx\n", capture_output=True, text=True, cwd=away,
                          env=env, timeout=300)
    assert repl.returncode == 0, repl.stderr[-2000:]
    assert ">>> x = 6 * 7\n>>> x\n42\n" in repl.stdout, repl.stdout
