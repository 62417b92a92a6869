"""Shared fixtures: one warm kernel pool for the whole test session (real sandboxed ipykernels)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

THREAD_VARS: dict[str, str] = {}
"""Thread counts this file set for the test process and what it starts (under pytest-xdist only)."""
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # Share the cores between the test processes instead of oversubscribing them: with torch's default (every core)
    # in each process, OpenMP's spinning threads made a minute of tiny-model training take over five on 2 cores.
    threads = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if var not in os.environ:
            THREAD_VARS[var] = os.environ[var] = threads
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from sandbox import Limits, SyncKernelPool  # noqa: E402  (after the thread settings above)


@pytest.fixture(scope="session")
def pool():
    """A real sandboxed kernel pool (strongest isolation available), with the `submit` tool defined."""
    with SyncKernelPool(size=2, limits=Limits(wall_s=5.0), tools=["submit"]) as p:
        yield p


@pytest.fixture(scope="session")
def format_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama taught to type `submit(k)` lines, saved like any local model directory."""
    from replrl.models import load_tokenizer, tiny_model
    from tests.toy import teach_format

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    model = teach_format(tiny_model(tokenizer, seed=0), tokenizer)
    path = tmp_path_factory.mktemp("format-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


LONG_FIRST = ("test_vllm_env.py", "test_rollout.py", "test_learning.py", "test_notebooks.py", "test_multiprocess.py")
"""Modules that take minutes, started first so that the two test processes (``-n 2``) finish together. (A
longest-first order by measured time, test_sweep and test_trainer included, ran in 12 min 8 s once, when
test_learning's run collapsed there: that was the test's learning rate, since halved, not the order.)"""


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_terminal_summary(terminalreporter):
    """Show the vLLM backend's own test run (it happens in a second environment, see test_vllm_env.py); under
    pytest-xdist its lines come from the test's report (a property), not from this process."""
    from tests.test_vllm_env import SUMMARY, SUMMARY_KEY

    lines = list(SUMMARY)
    for reports in terminalreporter.stats.values():
        for report in reports:
            for key, value in getattr(report, "user_properties", ()):
                if key == SUMMARY_KEY and not lines:
                    lines = list(value)
    if lines:
        terminalreporter.section("vLLM backend tests (second environment)")
        for line in lines:
            terminalreporter.write_line(line)
