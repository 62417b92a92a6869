"""What a run ran on: replrl's commit is named only for a checkout of replrl itself, never for a repository that
merely contains an installed copy (a virtualenv inside a project's repository)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def commit_seen_from(package_parent: Path) -> str:
    code = "from replrl.provenance import source_commit; print(source_commit())"
    done = subprocess.run([sys.executable, "-c", code], cwd=package_parent, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(package_parent)}, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "project"
    repo.mkdir()
    git("init", "-q", cwd=repo)
    (repo / "notes.txt").write_text("a user's project\n")
    git("add", ".", cwd=repo)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first", cwd=repo)
    return repo


def test_an_installed_copy_inside_another_repository_names_no_commit(project: Path) -> None:
    site = project / ".venv" / "lib" / "site-packages"
    shutil.copytree(ROOT / "replrl", site / "replrl", ignore=shutil.ignore_patterns("__pycache__"))
    assert commit_seen_from(site) == "None"


def test_a_checkout_of_replrl_names_its_commit_and_whether_it_was_changed(project: Path) -> None:
    shutil.copytree(ROOT / "replrl", project / "replrl", ignore=shutil.ignore_patterns("__pycache__"))
    git("add", ".", cwd=project)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "replrl", cwd=project)
    head = git("rev-parse", "HEAD", cwd=project)
    assert commit_seen_from(project) == head
    with open(project / "replrl" / "provenance.py", "a") as f:
        f.write("\n# a local change\n")
    assert commit_seen_from(project) == head + "+dirty"
