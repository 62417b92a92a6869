"""`accelerate launch` with 2 CPU processes (gloo): each rank rolls out its share of the step's problems with its own
kernel pool, the update runs through the DDP wrapper accelerate prepared (which reduces the gradients), only the main
process writes, and resume continues both ranks. Settings replrl does not train under (FSDP1) are refused."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replrl import checkpoint
from replrl.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*args: str) -> subprocess.CompletedProcess:
    # accelerate's --cpu flag always starts one process (its simple launcher); --multi_gpu on a machine without
    # GPUs starts N processes that run on the CPU with gloo (DistributedType.MULTI_CPU), as torchrun does.
    # A port of its own: two launches on the suite's two workers at once must not meet on the default 29500.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--main_process_port", str(free_port()),
           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "replrl", "train",
           "examples/smoke.toml", "--no-progress", "--model.device", "cpu", *args]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=500)


def accelerate_launch(*args: str, processes: int = 2) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
            "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
            "--dynamo_backend", "no", *args]


def test_ddp_update_over_two_processes_equals_one_process_over_the_whole_batch(format_model_dir, tmp_path):
    """The same batch, split over 2 ranks (each scoring through DDP, skipping and reordering its zero-advantage
    micro-batches, reducing in its last backward) or whole in one process: the same gradients and weights after two
    AdamW steps, to float tolerance. Without the reduction, rank 0 would hold its half's gradient only."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    for cmd, out in (([sys.executable, "-m", "tests.ddp_update"], one),
                     (accelerate_launch("-m", "tests.ddp_update"), two)):
        done = subprocess.run([*cmd, str(format_model_dir), str(out)], capture_output=True, text=True, cwd=ROOT,
                              env=env, timeout=500)
        assert done.returncode == 0, done.stderr[-3000:]
    a, b = torch.load(one), torch.load(two)
    assert (a["world"], b["world"]) == (1, 2)
    assert b["wrapper"] == "DistributedDataParallel", "the update must score through accelerate's DDP wrapper"
    for sa, sb in zip(a["stats"], b["stats"], strict=True):
        assert sa["grad_norm"] > 0 and sa["grad_norm"] == pytest.approx(sb["grad_norm"], rel=1e-4)
    for ga, gb in zip(a["grads"], b["grads"], strict=True):
        torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-6)
    # AdamW divides each step by the gradient's running RMS, which magnifies the two reductions' rounding where a
    # gradient is small: under torch 2.4 one weight of 8192 ends 6e-6 apart (gradients within the tolerance above)
    for pa, pb in zip(a["params"], b["params"], strict=True):
        torch.testing.assert_close(pb, pa, rtol=1e-4, atol=1e-5)


def test_ranks_look_at_the_run_directory_before_the_main_process_writes_and_stop_together(tmp_path):
    """tests/ranks_agree.py: rank 0 writes config.toml slowly and visibly, rank 1 looks 0.5 s later; both accept
    the new run and the file is whole (a rank that looked mid-write refused the run alone: CI's one failure of the
    dynamic-sampling test below). A directory with another run, or nothing to resume, is refused by both ranks with
    the same message; an error only one rank found stops both with its message (neither waits for the other)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run(accelerate_launch("-m", "tests.ranks_agree", str(tmp_path)), capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = [json.loads((tmp_path / f"outcome.rank{k}.json").read_text()) for k in (0, 1)]
    for outcome in outcomes:
        assert outcome["race"] == "ok" and outcome["race_config"], outcome
        assert outcome["other"].startswith("RunDirError: run directory ")
        assert "already holds a different run" in outcome["other"]
        assert outcome["nothing"].startswith("RunDirError: nothing to resume in ")
        assert outcome["agree_0"] == "ConfigError: found by rank 0 only"
        assert outcome["agree_1"] == "ConfigError: found by rank 1 only"
    assert outcomes[0] == outcomes[1]


def test_a_tracker_missing_on_the_main_process_stops_every_rank_with_its_one_line(format_model_dir, tmp_path):
    """Only the main process reports to trackers, so only it checks them; the other rank stops with the same line
    instead of a gloo traceback ("Connection closed by peer") at its next collective."""
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here: the test needs a tracker that is not")
    done = launch("--run-dir", str(tmp_path / "run"), "--model.name", str(format_model_dir), "--run.report_to",
                  "wandb", "--run.eval_n", "0")
    assert done.returncode != 0
    line = "replrl train: error: ConfigError: run.report_to names wandb, which is not installed"
    assert done.stderr.count(line) == 2, done.stderr[-3000:]
    assert "Connection closed by peer" not in done.stderr and "[rank1]: Traceback" not in done.stderr


@pytest.mark.parametrize("split", ["strided", "uneven"])
def test_ddp_update_with_predict_output_equals_one_process(format_model_dir, tmp_path, split):
    """loss.predict_output 0.5 under DDP (tests/ddp_update.py's extra "po": 6 output tokens on rank 0's rows, 16 on
    rank 1's under the strided split; micro-batches without advantage but with output tokens): the term is the mean
    over every rank's output tokens (each rank scales its sum by ranks / all ranks' tokens, DDP averages), so the
    gradients and weights after two AdamW steps equal one process's over the whole batch, and so do the figures, on
    both ranks: sums over ranks divided, not the mean of the ranks' means (which would be (m0 + m1) / 2 here)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    for cmd, out in (([sys.executable, "-m", "tests.ddp_update"], one),
                     (accelerate_launch("-m", "tests.ddp_update"), two)):
        done = subprocess.run([*cmd, str(format_model_dir), str(out), split, "po"], capture_output=True, text=True,
                              cwd=ROOT, env=env, timeout=500)
        assert done.returncode == 0, done.stderr[-3000:]
    a, r0, r1 = torch.load(one), torch.load(two), torch.load(f"{two}.rank1")
    assert (a["world"], r0["world"], r0["wrapper"]) == (1, 2, "DistributedDataParallel")
    assert r0["counts"] == r1["counts"]
    for sa, s0, s1 in zip(a["stats"], r0["stats"], r1["stats"], strict=True):
        assert sa["predict_output/tokens"] == s0["predict_output/tokens"] == s1["predict_output/tokens"] == 22
        assert sa["loss/predict_output"] > 0
        for k in ("loss/predict_output", "predict_output/accuracy"):
            assert s0[k] == s1[k] == pytest.approx(sa[k], rel=1e-5), k
        assert sa["grad_norm"] > 0 and sa["grad_norm"] == pytest.approx(s0["grad_norm"], rel=2e-3)
    for p0, p1 in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(p0, p1), "the ranks' weights diverged"
    if split == "strided":  # one process ran the ranks' micro-batches (tests/ddp_update.py): float tolerance
        assert [s["grad_norm"] for s in a["stats"]] == pytest.approx([s["grad_norm"] for s in r0["stats"]], rel=1e-5)
        for ga, gb in zip(a["grads"], r0["grads"], strict=True):
            torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-6)
        for pa, pb in zip(a["params"], r0["params"], strict=True):
            torch.testing.assert_close(pb, pa, rtol=1e-4, atol=1e-5)
    else:  # other micro-batches (rank 0's third holds one row): the term's float32 rounding differs by ~4e-4 of the
        for ga, gb in zip(a["grads"], r0["grads"], strict=True):  # norm; a wrong weighting of the ranks by far more
            assert float((gb - ga).norm()) <= 2e-3 * float(ga.norm()) + 1e-9


@pytest.mark.parametrize("split", ["uneven", "minibatches"])
def test_ranks_with_different_shares_of_the_batch_run_the_same_collectives(format_model_dir, tmp_path, split):
    """Ranks dealt different numbers of rows (trees, dynamic sampling) and zero-advantage micro-batches on one rank
    only: every rank runs as many forwards and backwards as the other (padding with zero-weight stand-ins, skipping a
    backward only where both skip it) and as many optimizer steps, which FSDP needs (each forward and backward
    gathers the parameters); the gradients still equal one process's over the whole batch (tests/ddp_update.py)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    runs = [(accelerate_launch("-m", "tests.ddp_update"), two)]
    if split == "uneven":
        runs.append(([sys.executable, "-m", "tests.ddp_update"], one))
    for cmd, out in runs:
        done = subprocess.run([*cmd, str(format_model_dir), str(out), split], capture_output=True, text=True,
                              cwd=ROOT, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    r0, r1 = torch.load(two), torch.load(f"{two}.rank1")
    assert (r0["rows"], r1["rows"]) == ((5, 3) if split == "uneven" else (6, 2))
    assert r0["counts"] == r1["counts"], "a rank ran another number of forwards or backwards"
    for p0, p1 in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(p0, p1), "the ranks' weights diverged"
    if split == "uneven":  # per update 3 micro-batches: 0-1 and 2-3 (rank 1: 5-6, 7) back-propagated, the third not
        assert r0["counts"] == {"forwards": 4, "no_grad_forwards": 2, "backwards": 4}
        a = torch.load(one)
        for sa, sb in zip(a["stats"], r0["stats"], strict=True):
            assert sa["grad_norm"] > 0 and sa["grad_norm"] == pytest.approx(sb["grad_norm"], rel=1e-4)
        for ga, gb in zip(a["grads"], r0["grads"], strict=True):
            torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-6)
    else:  # rank 0: 6 rows in 3 minibatches of 2; rank 1: 2 of 1 and a stand-in one; old log-probs: 3 passes each
        assert all(s["optimizer_steps"] == 3 for s in r0["stats"] + r1["stats"])
        assert r0["counts"]["no_grad_forwards"] + r0["counts"]["forwards"] == 2 * (3 + 3)


def test_fsdp1_is_refused_in_one_line_at_start(tmp_path):
    """An accelerate config asking for FSDP1 is refused before any work, not bypassed (nor DeepSpeed, Megatron...):
    read from what the launch asked, before accelerate stops it on a CPU with an error of its own (FSDP2:
    tests/test_fsdp.py)."""
    config = tmp_path / "fsdp.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_machines: 1\n"
                      "num_processes: 2\nmixed_precision: 'no'\nfsdp_config:\n  fsdp_version: 1\n")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--main_process_port",
           str(free_port()), "-m", "replrl", "train", "examples/smoke.toml", "--no-progress", "--model.device",
           "cpu", "--run-dir", str(tmp_path / "run")]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))
    assert done.returncode != 0
    assert "accelerate's distributed type FSDP with fsdp_version 1 is not supported by replrl; supported: one " \
        "process, DDP" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_two_processes_train_write_once_and_resume(format_model_dir, tmp_path):
    run = tmp_path / "run"
    toy = ["--model.name", str(format_model_dir), "--model.chat_template", "false",  # conftest: types submit(k)
           "--task.name", "tests.toy:EchoTask", "--rollout.max_lines", "3", "--rollout.max_line_tokens", "12",
           "--rollout.temperature", "1.0"]
    first = launch("--run-dir", str(run), "--run.eval_n", "0", *toy)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2], "only the main process writes metrics"
    # smoke.toml: 2 problems x 4 episodes per step, one problem per rank, gathered before summarizing
    assert all(r["episodes"] == 8 for r in rows), [r["episodes"] for r in rows]
    assert rows[0]["grad_norm"] > 0, "the episodes' rewards differ, so the update must move the weights"
    assert all(r["rank_weight_drift"] == 0.0 for r in rows), "the ranks' weights diverged: gradients not summed"
    assert checkpoint.latest(run).name == "step-000002"
    samples = (run / "samples.jsonl").read_text().splitlines()
    assert len({json.loads(s)["step"] for s in samples}) == 2 and len(samples) == 4, "samples written once per step"

    resumed = launch("--resume", str(run), "--run.max_steps", "3", "--run.eval_n", "0", *toy)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["data_position"] == 6  # both ranks continued at the saved data position: 2 problems a step
    state = json.loads((checkpoint.latest(run) / "state.json").read_text())
    assert state["step"] == 3 and state["data_position"] == 6


@pytest.mark.parametrize("probe", [0, 2])
def test_two_processes_with_dynamic_sampling_draw_their_shares_alone_and_train_kept_groups(format_model_dir, tmp_path,
                                                                                          probe):
    # each rank draws waves of its share until it holds its one group with a contrast (draw.py: no collective while
    # drawing); the learner's agreement after the draw moves both streams to the furthest rank's position.
    # probe 2 (screening): a wave screens 4 problems with 2 episodes each, split over the ranks; a rank completes
    # the kept probes it trains on, and both ranks count every completion
    run = tmp_path / "run"
    toy = ["--model.name", str(format_model_dir), "--model.chat_template", "false", "--task.name",
           "tests.toy:EchoTask", "--rollout.max_lines", "3", "--rollout.max_line_tokens", "12",
           "--rollout.temperature", "1.0", "--rollout.dynamic_sampling", "true",
           "--rollout.dynamic_sampling_extra_waves", "3", "--rollout.dynamic_sampling_probe", str(probe),
           "--run.max_steps", "3"]
    done = launch("--run-dir", str(run), "--run.eval_n", "0", *toy)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3], "only the main process writes metrics"
    waves, per_wave = 0, 4 if probe else 2
    for r in rows:  # the step's waves are the furthest rank's; a rank that stopped earlier drew fewer groups
        waves += r["dynsamp/waves"]
        assert r["data_position"] == per_wave * waves
        share = per_wave // 2  # each rank's groups of a wave
        assert share * r["dynsamp/waves"] < r["dynsamp/groups_drawn"] <= per_wave * r["dynsamp/waves"]
        assert r["dynsamp/groups_drawn"] % share == 0
        completed = 2 * r["dynsamp/groups_kept"] if probe else 0
        assert r["episodes"] == (probe or 4) * r["dynsamp/groups_drawn"] + completed
        assert r["dynsamp/groups_kept"] == 2 or r["dynsamp/bound_reached"] == 1
        assert r["rank_weight_drift"] == 0.0, "the ranks' weights diverged"
        assert (r["grad_norm"] > 0) == (r["dynsamp/groups_kept"] > 0)
    assert waves > 3, "smoke.toml's seed draws a wave without enough contrast at least once"
    logged = done.stderr.count("groups with a contrast after")
    assert logged == sum(r["dynsamp/bound_reached"] for r in rows), "the bound is logged once, by the main process"
