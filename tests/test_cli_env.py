"""`replrl env` starts one real kernel and runs 1+1 in it (issue 64): a machine where the mechanisms look fine but no
kernel can start says so in a FAILED line with the kernel's own reason, one error line on stderr, and exit code 1.
Real subprocesses, the way a user types the command."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sandbox.limits import available

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not available("bwrap"), reason="a kernel needs a sandbox level (bwrap here)")

# Every kernel (and fork server) of this process gets PYTHONHOME=/nonexistent: its interpreter cannot find its
# standard library and dies before the kernel program runs, as a kernel whose packages are out of its reach does.
BROKEN = textwrap.dedent("""
    import sys
    import sandbox.launch as launch
    real = launch.kernel_env
    launch.kernel_env = lambda *a, **k: {**real(*a, **k), "PYTHONHOME": "/nonexistent"}
    from replrl.cli import main
    sys.exit(main(["env"]))
""")


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))


def test_replrl_env_starts_a_kernel_and_runs_one_plus_one():
    done = _run(["-m", "replrl", "env"])
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("kernel start: "))
    assert line.startswith("kernel start: ok: started one (") and "ran 1+1 -> 2" in line, line


def test_replrl_env_says_loudly_when_no_kernel_can_start():
    done = _run(["-c", BROKEN])
    assert done.returncode == 1, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    line = next(line for line in done.stdout.splitlines() if line.startswith("kernel start: "))
    assert line.startswith("kernel start: FAILED: sandboxed kernel ("), line
    assert "encodings" in line, line  # the kernel's own words: Python could not find its standard library
    assert "\n" not in line and line.isascii()
    err = [line for line in done.stderr.splitlines() if line.startswith("replrl env: error: ")]
    assert len(err) == 1 and "no sandboxed kernel can start here" in err[0] and "encodings" in err[0], done.stderr
    # the rest of the report is still there, for the bug report
    assert "sandbox isolation: bwrap" in done.stdout and "default model (" in done.stdout
