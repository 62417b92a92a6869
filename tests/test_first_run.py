"""A new user's first commands: with no sandbox possible, every command says so in one line and exits non-zero;
`replrl env` reports the machine. Each runs as a real subprocess, the way a user types it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(argv: list[str], env_path: str | None = None, stdin: str = "", timeout: float = 180):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if env_path is not None:
        env["PATH"] = env_path  # bwrap and unshare hidden: no isolation level can start
    return subprocess.run([sys.executable, *argv], input=stdin, capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=timeout)


NO_SANDBOX_COMMANDS = [
    ["-m", "replrl", "repl"],
    ["-m", "replrl", "rollout", "--model", "tiny", "--n", "2"],
    ["-m", "replrl", "train", "examples/smoke.toml", "--run-dir", "RUN_DIR"],
    ["-m", "replrl", "eval", "--model", "tiny", "--n", "2"],
    ["bench/kernel_latency.py"],
    ["bench/repl_tax.py"],
]


@pytest.mark.parametrize("argv", NO_SANDBOX_COMMANDS, ids=lambda a: " ".join(a[:3]))
def test_no_sandbox_is_one_line_and_a_nonzero_exit(argv, tmp_path):
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    run_dir = tmp_path / "run"
    done = run([str(run_dir) if a == "RUN_DIR" else a for a in argv], env_path=str(empty_bin), stdin="1\n")
    err = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert len(err) == 1, done.stderr[-2000:]  # one line, no traceback
    assert "SandboxUnavailable" in err[0] and "bubblewrap" in err[0] and "apt-get install -y bubblewrap" in err[0]
    assert not run_dir.exists(), "a run that cannot start must not leave a run directory behind"


def test_replrl_env_reports_sandbox_versions_and_model_cache():
    done = run(["-m", "replrl", "env"])
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for key in ("python:", "torch:", "transformers:", "jupyter_client:", "ipykernel:", "vllm:", "cpu:", "gpu:",
                "sandbox isolation:", "default model (smollm2-135m-instruct):"):
        assert key in out, (key, out)
    from sandbox import Limits
    from sandbox.limits import hides_host_files

    level = Limits().resolve_isolation()
    assert f"sandbox isolation: {level}" in out
    assert ("host files visible to model code: no" in out) == hides_host_files(level)


def test_replrl_env_without_a_sandbox_still_reports(tmp_path):
    done = run(["-m", "replrl", "env"], env_path=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "sandbox isolation: NONE" in done.stdout and "apt-get install -y bubblewrap" in done.stdout


def test_replrl_env_into_a_closed_pipe_is_quiet():
    """`replrl env | head -1`: the reader goes before replrl writes; a shell's tools exit quietly then, and so does
    replrl (exit 141, as a process killed by SIGPIPE), without an error line."""
    proc = subprocess.Popen([sys.executable, "-m", "replrl", "env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    proc.stdout.close()  # the reader is gone before the report is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=180) == 141, err
    assert err == ""


def test_replrl_env_names_the_git_commit_of_a_checkout():
    out = run(["-m", "replrl", "env"]).stdout
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if not head:
        pytest.skip("not a git checkout")
    assert f"(git {head}" in out.splitlines()[0], out


def test_held_out_results_reach_the_console_as_plain_lines():
    """The terminal shows held-out accuracy as it comes (the ``replrl.console`` logger) without a log prefix; other
    records keep their level and logger."""
    import logging

    from replrl.cli import _ConsoleFormatter

    fmt = _ConsoleFormatter("%(levelname)s %(name)s: %(message)s")
    record = lambda name, level, msg: logging.LogRecord(name, level, __file__, 1, msg, (), None)  # noqa: E731
    assert fmt.format(record("replrl.console", logging.INFO, "eval at step 2: accuracy 0.500")) == \
        "eval at step 2: accuracy 0.500"
    assert fmt.format(record("replrl.console", logging.WARNING, "x")) == "WARNING replrl.console: x"
    assert fmt.format(record("replrl.trainer", logging.INFO, "y")) == "INFO replrl.trainer: y"
