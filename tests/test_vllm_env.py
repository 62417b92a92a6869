"""The vLLM backend's tests, run by the main test command in their own environment.

vLLM's CPU build pins torch 2.13.0+cpu and transformers<5.20, so its tests (tests/test_backend_vllm.py) run in a
second environment that `.ci/vllm_env.sh` creates once (.venv-vllm, about 2.5 GB, ~2 minutes) and reuses. Their
pytest summary is printed at the end of this session's report, so CI's log shows them running. Set
REPLRL_VLLM_TESTS=0 to skip them (the reason is printed).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUMMARY: list[str] = []  # printed by conftest's pytest_terminal_summary
SUMMARY_KEY = "vllm_env_summary"


@pytest.mark.timeout(900)
def test_vllm_backend_tests_pass_in_their_own_environment(record_property):
    if os.environ.get("REPLRL_VLLM_TESTS", "1") == "0":
        pytest.skip("REPLRL_VLLM_TESTS=0: the vLLM backend's tests were not run")
    argv = ["bash", str(ROOT / ".ci" / "vllm_env.sh"), "-q", "-m", "not slow", "-p", "no:cacheprovider",
            "-n", "0"]  # one process: the main suite runs beside it
    from tests.conftest import THREAD_VARS

    env = {k: v for k, v in os.environ.items()  # a plain pytest run: vLLM's CPU engine sizes its own threads
           if k not in THREAD_VARS and not k.startswith("PYTEST_XDIST_")}
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=880, env=env)
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    SUMMARY.extend(ln for ln in lines if ln.startswith("vllm env:") or re.search(r"\d+ (passed|failed|skipped)", ln)
                   or ln.startswith(("SKIPPED", "FAILED", "ERROR")))
    record_property(SUMMARY_KEY, list(SUMMARY))  # travels with the report to the main process under pytest-xdist
    if done.returncode != 0 and "vllm env: vllm" not in done.stdout:  # the environment itself could not be made
        pytest.skip(f"vllm could not be installed here: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(r"\d+ passed", done.stdout), lines[-5:]
    skipped = [ln for ln in lines if ln.startswith("SKIPPED")]  # -rs: one line per reason, with its count
    assert all(ln.endswith("on a GPU") for ln in skipped), skipped  # only tests that need a GPU may skip here
    counts = [int(n) for ln in skipped for n in re.findall(r"^SKIPPED \[(\d+)\]", ln)]
    assert f"{sum(counts)} skipped" in lines[-1] or (not counts and "skipped" not in lines[-1]), lines[-5:]
