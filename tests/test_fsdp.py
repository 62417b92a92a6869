"""FSDP2 through accelerate on 2 CPU processes (gloo): an accelerate config with ``distributed_type: FSDP`` and
``fsdp_version: 2`` shards the policy's parameters, gradients and AdamW state (accelerate alone would run DDP on a
CPU: replrl corrects its state in ``policy.fsdp2_on_cpu``), the decoder layers are the wrapped units, and the update
equals one process's over the same batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_multiprocess import free_port

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(600)

FSDP2_CPU = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
use_cpu: true
num_machines: 1
num_processes: 2
machine_rank: 0
mixed_precision: 'no'
fsdp_config:
  fsdp_version: 2
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
"""
"""What a user with 2 CPU processes writes (no wrap policy, no layer class: replrl finds the decoder layers)."""


def fsdp2_launch(tmp_path: Path, *args: str) -> list[str]:
    config = tmp_path / "fsdp2_cpu.yaml"
    config.write_text(FSDP2_CPU)
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--main_process_port",
            str(free_port()), *args]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_fsdp2_update_over_two_cpu_processes_is_sharded_and_equals_one_process(format_model_dir, tmp_path):
    """The update of tests/ddp_update.py (ranks with 5 and 3 rows, a zero-advantage micro-batch on one rank only)
    under an FSDP2 config: accelerate's FSDP2 path ran (is_fsdp2; if a later accelerate ignores replrl's correction
    this fails here, loudly, instead of training under DDP), parameters are DTensors sharded over the 2 ranks, every
    rank ran the same forwards and backwards, and the gradients equal one process's over the whole batch."""
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    run([sys.executable, "-m", "tests.ddp_update", str(format_model_dir), str(one), "uneven"])
    run(fsdp2_launch(tmp_path, "-m", "tests.ddp_update", str(format_model_dir), str(two), "uneven"))
    a, r0, r1 = torch.load(one), torch.load(two), torch.load(f"{two}.rank1")
    assert (r0["fsdp"], r0["sharded"], r0["wrapper"]) == (True, True, "FSDPTokenScorer")
    assert r0["units"] == r1["units"] == ["", "lm.model.layers.0", "lm.model.layers.1"], \
        "the decoder layers are the wrapped units, the TokenScorer the root (with embeddings, norm and LM head)"
    assert r0["counts"] == r1["counts"] == {"forwards": 4, "no_grad_forwards": 2, "backwards": 4}
    for sa, sb in zip(a["stats"], r0["stats"], strict=True):
        assert sa["grad_norm"] > 0 and sa["grad_norm"] == pytest.approx(sb["grad_norm"], rel=1e-4)
    for ga, gb in zip(a["grads"], r0["grads"], strict=True):
        torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-6)
