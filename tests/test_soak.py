"""The soak of issue 64: a short training run in which every group holds kernels attacking the host (the classes of
tests/hostile_task.py) completes, on booted kernels in kernel-host processes (each attack on forked and booted
kernels in the trainer's process: tests/test_sandbox_wire.py); its transcripts stay bounded, the host's memory stays
flat, and no process or kernel directory is left.
"""

from __future__ import annotations

import os
import tempfile

import pytest

from replrl.config import Config
from replrl.configlib import resolve
from replrl.repl import TRUNCATED_MARKER
from replrl.trainer import StepResult, Trainer
from sandbox.kernel_dirs import PREFIX
from tests.hostile_task import ATTACKS

pytestmark = pytest.mark.timeout(600)
MAX_TOTAL, MAX_OUTPUT = 256, 48


def descendants(roots: set[int] | None = None) -> set[int]:
    """Pids of every live descendant of ``roots`` (default: this process)."""
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(pid))
    found, todo = set(), list(roots or {os.getpid()})
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def kernel_dirs(tmp: str) -> set[str]:
    return {name for name in os.listdir(tmp) if name.startswith(PREFIX)}


@pytest.mark.parametrize("boot,hosts", [("booted", 2)])  # forked, in the trainer's process: test_sandbox_wire.py
def test_a_training_run_among_hostile_kernels_completes_bounded_and_leaves_nothing(boot, hosts, format_model_dir,
                                                                                     tmp_path, monkeypatch):
    # A temp directory of the run's own: under pytest-xdist the other worker's kernels come and go in the shared one.
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(own_tmp))  # the kernel hosts' (they are started after this)
    monkeypatch.setattr(tempfile, "tempdir", str(own_tmp))  # this process's
    sections = {
        "model": {"name": str(format_model_dir), "chat_template": False},
        "task": {"name": "tests.hostile_task:HostileEchoTask"},
        "rollout": {"group_size": 6, "problems_per_step": 2, "max_lines": 3, "max_line_tokens": 12,
                    "max_total_tokens": MAX_TOTAL, "max_output_tokens": MAX_OUTPUT, "wall_s": 5.0,
                    "temperature": 1.0, "kernel_hosts": hosts, "kernel_fork_server": boot == "forked",
                    "state_digest": False},  # the first reply after the setup is the model's line
        "optim": {"lr": 1e-3, "warmup_steps": 0, "micro_batch": 12},
        "run": {"max_steps": 2, "save_every": 0, "log_samples_every": 0, "eval_n": 0, "time_budget_min": 0},
    }
    before, dirs_before = descendants(), kernel_dirs(str(own_tmp))
    steps: list[StepResult] = []
    memory: list[int] = []
    trainer = Trainer(resolve(Config, None, sections), tmp_path / "run", progress=False)
    seen: set[str] = set()
    trainer.train(on_step=lambda r: (steps.append(r), memory.append(rss()), seen.update(kernel_dirs(str(own_tmp)))))
    assert seen, "the run's kernels live in its own temp directory"
    assert [s.step for s in steps] == [1, 2]
    assert set(trainer.task.used) == set(ATTACKS)  # every class ran
    episodes = [t for s in steps for t in s.trajectories]
    assert len(episodes) == 24
    for traj in episodes:
        assert len(traj.token_ids) <= MAX_TOTAL
        longest = max((len(line.output) for line in traj.lines), default=0)
        assert longest <= 64_000 + 1 + len(TRUNCATED_MARKER), longest  # cut by the host, a newline, the marker
        traj.text.encode("utf-8")  # valid Unicode: the tokenizer took every output
        assert "\x00" not in traj.text
    crashed = [t for t in episodes if t.end_reason == "crash"]
    assert crashed, "the forged, frames and flood kernels end their episodes as crashes"
    said = [t.lines[-1].output for t in crashed]
    assert any("traffic broke the host's budget" in out for out in said), said  # the line says why (the record)
    assert any("malformed reply" in out for out in said), said
    assert memory[-1] - memory[0] < 96 * 2**20, f"the host grew {(memory[-1] - memory[0]) / 2**20:.0f} MiB"
    del trainer
    assert not (descendants() - before), "a process of the run outlived it"
    assert kernel_dirs(str(own_tmp)) - dirs_before == set(), "a kernel directory outlived the run"
