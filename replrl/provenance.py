"""What software a run ran on: package versions and replrl's git commit, one line per start of a run.

A run that is resumed may continue on another machine or after an upgrade (a sweep's runs span days); each start
appends one JSON line to ``environment.jsonl`` in the run directory, with the step it started after, so a figure
can always be traced to the code and libraries that made it. ``replrl env`` prints the same versions.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import platform
import subprocess
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "transformers", "accelerate", "datasets", "jupyter_client", "ipykernel", "vllm", "peft")
ENVIRONMENT_FILE = "environment.jsonl"


def version(name: str) -> str | None:
    """The installed version of distribution ``name``, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def source_commit() -> str | None:
    """The git commit of the replrl source in use (``+dirty`` when tracked files differ from it), or None when it
    is not a git checkout (an installed wheel, even inside someone's repository) or git is missing."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        lines = head.stdout.split()
        if head.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != root:
            return None  # e.g. site-packages of a virtualenv that lives in a project's repository
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return lines[1] + ("+dirty" if status.returncode == 0 and status.stdout.strip() else "")


def environment(**extra: Any) -> dict[str, Any]:
    """replrl's version and commit, Python, the platform and the versions of ``PACKAGES`` (None: not installed),
    plus ``extra``."""
    return {"replrl": version("replrl"), "commit": source_commit(), "python": platform.python_version(),
            "platform": platform.platform(),
            "packages": {name: version(name) for name in PACKAGES}, **extra}


def record_environment(run_dir: Path, step: int, **extra: Any) -> dict[str, Any]:
    """Append this start's environment to ``run_dir/environment.jsonl``: ``step`` is the step the run starts after
    (0 for a fresh run). Returns the record."""
    record = {"time": datetime.datetime.now().isoformat(timespec="seconds"), "step": step, **environment(**extra)}
    with open(Path(run_dir) / ENVIRONMENT_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def read_environments(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``run_dir/environment.jsonl``, oldest first ([] when it has none)."""
    path = Path(run_dir) / ENVIRONMENT_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
