"""`replrl repl` with stdin not a terminal writes the exact transcript the model would see."""

from __future__ import annotations

import subprocess
import sys

from tests.test_repl_fidelity import SESSIONS, reference_transcript


def run_cli(args: list[str], stdin: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replrl.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=120)


def test_piped_repl_prints_the_interactive_console_transcript():
    lines = SESSIONS["for_block"] + SESSIONS["tracebacks"] + ["submit(3)"]
    proc = run_cli(["repl"], "".join(line + "\n" for line in lines))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == reference_transcript(lines)


def test_unknown_isolation_is_one_line_and_nonzero():
    proc = run_cli(["repl", "--isolation", "chroot"], "")
    assert proc.returncode != 0
    assert "invalid choice" in proc.stderr and "Traceback" not in proc.stderr
