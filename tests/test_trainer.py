"""The trainer on a tiny model built in the test: a real training step changes the weights and writes metrics and a
checkpoint; resume continues at the next step; checkpoints survive kills and full disks; bad input is one line."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
import transformers

from replrl import checkpoint
from replrl.advantages import batch_tensors
from replrl.config import Config
from replrl.configlib import resolve
from replrl.metrics import read_metrics
from replrl.provenance import read_environments
from replrl.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "examples" / "smoke.toml")


def toy_config(model_dir: Path, **run: object) -> Config:
    return resolve(Config, None, {
        "model": {"name": str(model_dir), "chat_template": False},
        "task": {"name": "tests.toy:EchoTask"},
        "rollout": {"group_size": 4, "problems_per_step": 2, "max_lines": 3, "max_line_tokens": 12,
                    "max_total_tokens": 256, "wall_s": 2.0, "temperature": 1.0},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "micro_batch": 8},
        "run": {"max_steps": 2, "save_every": 1, "log_samples_every": 1, "eval_n": 0,
                "time_budget_min": 0, **run},
    })


def test_two_steps_change_the_weights_and_write_metrics_and_checkpoints(format_model_dir, tmp_path):
    trainer = Trainer(toy_config(format_model_dir), tmp_path / "run", progress=False)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "training did not change the weights"
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward_mean", "accuracy", "syntax_error_rate", "exception_rate", "entropy", "clip_frac",
                "grad_norm", "lr", "rollout_s", "update_s", "tokens_per_s", "reward/correct", "time/sync_weights_s"):
        assert key in rows[0], key
    assert 0 <= rows[0]["time/sync_weights_s"] < 1  # HF samples from the trained module: nothing to copy
    assert rows[0]["lines_per_episode"] >= 1 and rows[0]["end/submit"] > 0  # the format model really submits
    assert checkpoint.latest(tmp_path / "run").name == "step-000002"
    assert (tmp_path / "run" / "config.toml").exists() and (tmp_path / "run" / "samples.jsonl").exists()


def test_a_step_with_the_state_estimator_logs_how_often_states_repeat(format_model_dir, tmp_path):
    cfg = toy_config(format_model_dir, max_steps=1, save_every=0)
    cfg.advantages.estimator, cfg.advantages.state_weight = "state", 1.0
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    trainer.train()
    row = read_metrics(tmp_path / "run")[0]
    for key in ("state/repeat_frac", "state/repeat_frac_values", "state/step_groups", "state/step_groups_values",
                "state/digest_ms_mean", "state/slow_digest_frac"):
        assert key in row, key
    assert 0 <= row["state/repeat_frac_values"] <= 1 and row["state/digest_ms_mean"] > 0


def test_resume_continues_at_the_next_step(format_model_dir, tmp_path):
    run = tmp_path / "run"
    Trainer(toy_config(format_model_dir), run, progress=False).train()
    resumed = Trainer(toy_config(format_model_dir, max_steps=3), run, resume=True, progress=False)
    assert resumed.step == 2 and resumed.drawer.problems.position == 4
    resumed.train()
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert json.loads((checkpoint.latest(run) / "state.json").read_text())["step"] == 3
    # each start recorded what it ran on: a figure is traceable to its code and libraries across resumes
    starts = read_environments(run)
    assert [e["step"] for e in starts] == [0, 2]
    for start in starts:
        # distributions' versions (PyPI's CUDA torch 2.4.0 is "2.4.0+cu121" in torch.__version__ only)
        assert start["packages"]["torch"] == version("torch") and start["packages"]["transformers"] == \
            transformers.__version__
        assert start["backend"] == "hf" and start["device"] == "cpu" and start["processes"] == 1
        assert start["commit"] is None or len(start["commit"].removesuffix("+dirty")) == 40


def test_the_time_budget_stops_the_run_after_the_step_that_spends_it(format_model_dir, tmp_path):
    run = tmp_path / "run"
    Trainer(toy_config(format_model_dir, max_steps=5, time_budget_min=1e-6), run, progress=False).train()
    assert [r["step"] for r in read_metrics(run)] == [1]                     # one step, not five
    assert json.loads((checkpoint.latest(run) / "state.json").read_text())["step"] == 1  # and it was saved


def test_a_run_directory_holding_another_run_is_refused(format_model_dir, tmp_path):
    Trainer(toy_config(format_model_dir, max_steps=1), tmp_path, progress=False).train()
    with pytest.raises(checkpoint.RunDirError, match="already holds a different run"):
        Trainer(toy_config(format_model_dir, max_steps=5), tmp_path, progress=False)


class _Tiny(torch.nn.Module):
    def __init__(self, fail: bool = False):
        super().__init__()
        self.w = torch.nn.Linear(2, 2)
        self.fail = fail

    def save_pretrained(self, path, **kwargs):
        os.makedirs(path, exist_ok=True)
        torch.save(self.state_dict(), os.path.join(path, "weights.pt"))
        if self.fail:
            raise OSError(28, "No space left on device")


class _Tok:
    def save_pretrained(self, path):
        Path(path, "tok.json").write_text("{}")


def _save(run: Path, step: int, model: torch.nn.Module) -> Path:
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return checkpoint.save(run, step, model, _Tok(), opt, sched, {"data_position": step})


def test_a_full_disk_mid_save_keeps_the_last_good_checkpoint(tmp_path):
    _save(tmp_path, 1, _Tiny())
    with pytest.raises(checkpoint.CheckpointError, match="No space left on device.*step-000001 is intact"):
        _save(tmp_path, 2, _Tiny(fail=True))
    assert checkpoint.latest(tmp_path).name == "step-000001"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*")), "the half-written checkpoint was not cleaned up"


def test_kill_9_during_checkpoint_writing_leaves_the_previous_one_loadable(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time, torch
        sys.path.insert(0, {str(REPO)!r})
        from tests.test_trainer import _Tiny, _save
        from pathlib import Path
        _save(Path({str(tmp_path)!r}), 1, _Tiny())

        class Slow(_Tiny):
            def save_pretrained(self, path, **kw):
                super().save_pretrained(path)
                print("writing", flush=True)
                time.sleep(60)

        _save(Path({str(tmp_path)!r}), 2, Slow())
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    last = checkpoint.latest(tmp_path)
    assert last is not None and last.name == "step-000001"
    opt = torch.optim.AdamW(_Tiny().parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    assert checkpoint.load_state(last, opt, sched)["step"] == 1


def replrl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replrl.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.mark.parametrize("args, message", [
    (["--rollout.temprature", "1"], "unrecognized arguments: --rollout.temprature"),
    (["--rollout.group_size", "four"], "rollout.group_size must be int; got 'four'"),
    (["--rollout.group_size", "1"], "rollout.group_size must be >= 2"),
    (["--model.name", "/no/such/model"], "model '/no/such/model' not found"),
    (["--task.name", "gsm8k", "--task.data", "/no/such/data.jsonl"], "not found"),
    (["--advantages.estimator", "line_rgt"], "unknown estimator 'line_rgt'; known: line, line_rtg, outcome"),
    (["--run.transfer_task", '{"name": "gsm8k", "data": "/no/such/gsm8k"}'], "not found"),
    (["--run.report_to", "tensorboard,neptune"], "run.report_to must be one of tensorboard, wandb, trackio, mlflow; "
                                                 "got 'neptune'"),
])
def test_bad_input_is_one_line_and_nonzero(args, message, tmp_path):
    proc = replrl("train", SMOKE, "--run-dir", str(tmp_path / "r"), *args)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len([ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]) == 1, proc.stderr


def test_a_config_error_is_reported_before_torch_or_the_sandbox_is_loaded(tmp_path):
    """A typo in an option fails at once (about 0.4 s here, against 6 s when torch, transformers and jupyter_client
    were imported first); `import sandbox` alone stays light too."""
    script = textwrap.dedent(f"""
        import sys
        import sandbox
        from replrl.cli import main
        code = main(["train", {SMOKE!r}, "--run-dir", {str(tmp_path / "r")!r}, "--rollout.group_size", "four"])
        print(code, sorted(m for m in ("torch", "transformers", "jupyter_client", "zmq") if m in sys.modules))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.stdout.split("\n")[0] == "1 []", (proc.stdout, proc.stderr)
    assert "rollout.group_size must be int; got 'four'" in proc.stderr


def test_unknown_key_in_a_config_file_and_a_dataset_without_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[rollout]\ntemprature = 0.5\n")
    proc = replrl("train", str(bad), "--run-dir", str(tmp_path / "r1"))
    assert proc.returncode == 1 and "did you mean 'rollout.temperature'" in proc.stderr, proc.stderr
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"problem": "1+1", "answer": "#### 2"}) + "\n")
    proc = replrl("train", SMOKE, "--run-dir", str(tmp_path / "r2"), "--task.name", "gsm8k", "--task.data",
                  str(data), "--task.options", '{"split": {"train": "train", "test": "train"}}')
    assert proc.returncode == 1 and "no field 'question'" in proc.stderr, proc.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_ctrl_c_or_sigterm_finishes_the_step_saves_and_exits_0(tmp_path, sig):
    """Ctrl-C or SIGTERM (`kill PID`): the step in flight finishes, a checkpoint is saved, the sandboxes close (their
    directories are gone: a SIGTERM used to kill the trainer on the spot and leave one per kernel in /tmp)."""
    run, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "replrl.cli", "train", SMOKE, "--run-dir", str(run),
                             "--run.max_steps", "50", "--run.save_every", "0", "--no-progress"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)})
    deadline = time.time() + 240
    # a training step has been logged (not only the untrained evaluation's row: a signal that arrives before the
    # first step begins leaves nothing to save), so the signal finds the run in a step
    while not any(r["step"] >= 1 for r in read_metrics(run)) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert list(tmp.glob("replrl-kernel-*")), "the run's kernels keep their directories in TMPDIR"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    assert ("Ctrl-C" if sig == signal.SIGINT else "SIGTERM") + ": finishing this step" in err, err
    steps = [r["step"] for r in read_metrics(run)]
    assert 1 <= len(steps) < 50
    assert json.loads((checkpoint.latest(run) / "state.json").read_text())["step"] == steps[-1]
    assert checkpoint.model_step(run / "model") == steps[-1]  # the final model is written at Ctrl-C too
    assert not list(tmp.glob("replrl-kernel-*")), "a sandbox's directory was left behind"


def test_eval_and_plot_commands_on_a_run(format_model_dir, tmp_path):
    """`replrl eval` on a run directory (scored with the reward weights scheduled for the checkpoint's step, not
    step 0's) and `replrl plot`."""
    from replrl.config import RewardConfig

    run = tmp_path / "run"
    cfg = toy_config(format_model_dir, max_steps=1)
    cfg.rewards = RewardConfig(weights={**Config().rewards.weights, "correct": {"start": 1.0, "end": 3.0, "steps": 1}})
    Trainer(cfg, run, progress=False).train()
    proc = replrl("eval", "--model", str(run), "--n", "16", "--out", str(tmp_path / "eval.json"))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "eval.json").read_text())
    assert summary["episodes"] == 16 and 0.0 <= summary["accuracy"] <= 1.0 and "syntax_error_rate" in summary
    assert summary["accuracy"] > 0 and summary["reward/correct"] == pytest.approx(3.0 * summary["accuracy"])
    proc = replrl("plot", str(run))
    assert proc.returncode == 0, proc.stderr
    png = run / "curves.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.filterwarnings("error:.*past_key_values.*:FutureWarning")  # generation through the peft wrapper
def test_lora_training_saves_adapters_and_resumes(format_model_dir, tmp_path):
    pytest.importorskip("peft")
    cfg = toy_config(format_model_dir, max_steps=1)
    cfg.model.lora_rank = 4
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n in trainable)
    trainer.train()
    assert (checkpoint.latest(tmp_path / "run") / "model" / "adapter_config.json").exists()
    cfg2 = toy_config(format_model_dir, max_steps=2)
    cfg2.model.lora_rank = 4
    resumed = Trainer(cfg2, tmp_path / "run", resume=True, progress=False)
    assert resumed.step == 1
    resumed.train()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]


def test_kl_reference_and_reused_batches_recompute_old_logprobs(format_model_dir, tmp_path):
    cfg = toy_config(format_model_dir, max_steps=1, save_every=0)
    cfg.loss.kl_coef = 0.1
    cfg.optim.epochs, cfg.optim.minibatches, cfg.optim.micro_batch = 2, 2, 2
    cfg.optim.gradient_checkpointing = True                            # the update recomputes layers (tests/test_loss)
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    assert trainer.ref_model is not None and not any(p.requires_grad for p in trainer.ref_model.parameters())
    layers = trainer.accelerator.unwrap_model(trainer.model).model.layers
    assert all(layer.gradient_checkpointing for layer in layers)
    assert not any(getattr(layer, "gradient_checkpointing", False) for layer in trainer.ref_model.model.layers)
    trainer.train()
    (row,) = read_metrics(tmp_path / "run")
    assert row["optimizer_steps"] == 4                                # 2 epochs x 2 minibatches
    assert "kl" in row and row["kl"] >= 0.0                          # k3 to the frozen reference
    assert 0.0 <= row["clip_frac"] <= 1.0


@pytest.mark.parametrize("kl_coef, checkpointing", [(0.0, False), (0.1, False), (0.0, True)])
def test_skipping_zero_gradient_backwards_leaves_the_update_unchanged(format_model_dir, tmp_path, kl_coef,
                                                                     checkpointing):
    """A micro-batch with no advantage on any token (a GRPO group that was all right or all wrong) and no KL term has
    a gradient of exactly zero: its backward is skipped, its forward still feeds the logged statistics, and the
    weights after the update are bit-identical to running every backward, also when a whole minibatch is skipped
    (AdamW still moves by momentum), and under gradient checkpointing (the skipped forward runs without autograd)."""
    trajs: list = []
    cfg = toy_config(format_model_dir, max_steps=1, save_every=0)
    Trainer(cfg, tmp_path / "probe", progress=False).train(on_step=lambda r: trajs.extend(r.trajectories))
    cfg.optim.micro_batch, cfg.loss.kl_coef, cfg.optim.gradient_checkpointing = 2, kl_coef, checkpointing
    fast, full = (Trainer(cfg, tmp_path / name, progress=False) for name in ("fast", "full"))
    full.skip_zero_gradient = False
    batch = batch_tensors(trajs, fast.pad_id)
    assert batch["input_ids"].shape[0] == 8
    sign = torch.tensor([0, 0, 0, 0, 1, -1, -1, 1], dtype=torch.float)[:, None]   # micro-batches 1 and 2: no signal
    for adv, skipped in ((batch["loss_mask"] * sign, 0.5), (torch.zeros_like(batch["loss_mask"]), 1.0)):
        before = [p.detach().clone() for p in fast.model.parameters()]
        stats_fast, stats_full = fast.update(batch, adv), full.update(batch, adv)
        assert stats_fast.pop("backward_skipped_frac") == (0.0 if kl_coef else skipped)
        assert stats_full.pop("backward_skipped_frac") == 0.0
        assert stats_fast == stats_full                      # entropy, clip_frac, approx_kl, loss, grad_norm
        after = list(fast.model.parameters())
        assert all(torch.equal(a, b) for a, b in zip(after, full.model.parameters(), strict=True))
        assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))  # the step moved the weights


def test_skip_empty_steps_leaves_weights_and_adamw_state_untouched_on_a_zero_gradient(format_model_dir, tmp_path):
    """optim.skip_empty_steps: after a step with a signal (AdamW now has momentum), a batch with no advantage anywhere
    leaves the weights and the optimizer's state bit-identical, where the default steps and moves them by momentum.
    (The decision is the summed gradient's norm, so a KL term, a gradient, is stepped on.)"""
    trajs: list = []
    cfg = toy_config(format_model_dir, max_steps=1, save_every=0)
    Trainer(cfg, tmp_path / "probe", progress=False).train(on_step=lambda r: trajs.extend(r.trajectories))
    step = Trainer(cfg, tmp_path / "step", progress=False)
    cfg = copy.deepcopy(cfg)
    cfg.optim.skip_empty_steps = True
    skip = Trainer(cfg, tmp_path / "skip", progress=False)
    batch = batch_tensors(trajs, skip.pad_id)
    signal = batch["loss_mask"] * torch.tensor([1, -1] * 4, dtype=torch.float)[:, None]
    for t in (skip, step):
        assert t.update(batch, signal)["optimizer_steps_skipped"] == 0
    weights = [p.detach().clone() for p in skip.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(step.model.parameters(), weights, strict=True))

    def adam_state(t: Trainer) -> list[torch.Tensor]:
        return [v.clone() for st in t.optimizer.state_dict()["state"].values() for v in st.values()]

    adam = adam_state(skip)
    assert adam
    zero = torch.zeros_like(batch["loss_mask"])
    stats_skip, stats_step = skip.update(batch, zero), step.update(batch, zero)
    assert stats_step["optimizer_steps"] == 1 and stats_step["optimizer_steps_skipped"] == 0
    assert stats_skip["grad_norm"] == 0.0
    assert stats_skip["optimizer_steps"] == 0 and stats_skip["optimizer_steps_skipped"] == 1
    assert all(torch.equal(a, b) for a, b in zip(skip.model.parameters(), weights, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(adam_state(skip), adam, strict=True))  # step count, moments
    assert any(not torch.equal(a, b) for a, b in zip(step.model.parameters(), weights, strict=True))  # momentum


def test_a_run_ends_with_a_before_after_summary_and_curves(format_model_dir, tmp_path):
    """The default run's contract (issue 10): held-out evaluation before the first step and after the last one, on
    the same problems, then a summary naming both and the curves PNG."""
    trainer = Trainer(toy_config(format_model_dir, max_steps=1, eval_n=4), tmp_path / "run", progress=False)
    trainer.train()
    before, after = trainer.evals["before"], trainer.evals["after"]
    assert before["episodes"] == after["episodes"] == 4
    evals = [r for r in read_metrics(tmp_path / "run") if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1]
    text = trainer.summary()
    assert f"{100 * before['accuracy']:3.0f}% -> {100 * after['accuracy']:3.0f}%" in text
    assert "syntax errors per line" in text and str(tmp_path / "run") in text
    assert trainer.curves is not None and trainer.curves.exists() and str(trainer.curves) in text


def test_held_out_on_another_task_config_and_a_transfer_task(format_model_dir, tmp_path):
    """run.eval_task changes the held-out task (per-level accuracy logged where problems have levels);
    run.transfer_task adds a second held-out task (here GSM8K, loaded from files through `datasets`), logged as
    transfer/<m>; every held-out episode is kept in eval_samples.jsonl; a resume finishes an evaluation a kill
    interrupted without repeating what was logged."""
    from tests.helpers_models import GSM8K_DIR

    cfg = toy_config(format_model_dir, max_steps=1, eval_n=4, eval_every=1, eval_task={"options": {"digits": [3]}},
                     transfer_task={"name": "gsm8k", "data": str(GSM8K_DIR / "test.jsonl")}, transfer_n=2)
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    trainer.train()
    rows = read_metrics(tmp_path / "run")
    evals = [r for r in rows if "eval/accuracy" in r]
    transfers = [r for r in rows if "transfer/accuracy" in r]
    assert [r["step"] for r in evals] == [r["step"] for r in transfers] == [0, 1]
    assert [r["eval/episodes"] for r in evals] == [4, 4] and [r["transfer/episodes"] for r in transfers] == [2, 2]
    # every eval problem asks for 3 (level 2 of the toy task): the level breakdown has exactly that level
    assert all("eval/accuracy_level2" in r and "eval/accuracy_level1" not in r for r in evals)
    assert all(r["eval/accuracy_level2"] == r["eval/accuracy"] for r in evals)
    assert all(r["eval/wall_s"] > 0 for r in evals) and all(r["transfer/wall_s"] > 0 for r in transfers)
    samples = [json.loads(line) for line in (tmp_path / "run" / "eval_samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["eval"]) for s in samples] == [(0, "eval")] * 4 + [(0, "transfer")] * 2 + \
        [(1, "eval")] * 4 + [(1, "transfer")] * 2
    assert all("Submit 3." in s["text"] for s in samples if s["eval"] == "eval")
    assert all("Problem:" in s["text"] and s["task"] == "gsm8k" for s in samples if s["eval"] == "transfer")
    assert "transfer (2 problems of gsm8k test)" in trainer.summary()

    # killed during the transfer evaluation after step 1 (its figures not logged, one of its episodes written) and
    # during a step 2 (its samples written, no checkpoint): the resumed run keeps the finished eval, redoes the
    # transfer evaluation, and leaves every file as one consistent series, nothing repeated
    run = tmp_path / "run"
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if "transfer/accuracy" not in r
                                               or r["step"] == 0))
    (run / "eval_samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples[:-1]))
    with open(run / "samples.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, "text": "from the killed step"}) + "\n")
    resumed = Trainer(cfg, run, resume=True, progress=False)
    resumed.train()
    assert "  - ->" not in resumed.summary()  # the untrained figures come from the metrics, not from this attempt
    assert resumed.evals["before"]["accuracy"] == evals[0]["eval/accuracy"]
    assert resumed.evals["transfer_before"]["accuracy"] == transfers[0]["transfer/accuracy"]
    again = read_metrics(run)
    assert [r for r in again if "eval/accuracy" in r] == evals                # kept as logged, not re-evaluated
    assert [r["step"] for r in again if "transfer/accuracy" in r] == [0, 1]
    resamples = [json.loads(line) for line in (run / "eval_samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["eval"]) for s in resamples] == [(s["step"], s["eval"]) for s in samples]
    assert max(json.loads(line)["step"] for line in (run / "samples.jsonl").read_text().splitlines()) == 1


def test_extra_held_out_tasks_are_evaluated_before_and_after_under_their_own_limits(format_model_dir, tmp_path):
    """run.extra_eval adds held-out tasks beside the first: a one-step run evaluates the echo task and 3 `explore`
    problems of every level (their data loaded by the task's setup), before and after, logging the second as
    eval_explore/<m> (per level too) under explore's own rollout limits (the table's max_lines over them); `replrl
    compare` and the sweep's completion check see it; a run killed during that evaluation finishes it on resume."""
    from replrl.compare import compare
    from replrl.sweep import Run, _evaluated_at

    cfg = toy_config(format_model_dir, max_steps=1, eval_n=4,
                     extra_eval=[{"name": "explore", "level": 0, "n": 3, "rollout": {"max_lines": 2}}])
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    held = trainer.held_out[1]
    assert (held.label, held.task.name, held.n) == ("eval_explore", "explore", 3)
    # explore's rollout_defaults (16 lines, 2048 tokens, 128 of output), then the table's max_lines
    assert (held.cfg.rollout.max_lines, held.cfg.rollout.max_total_tokens, held.cfg.rollout.max_output_tokens) == \
        (2, 2048, 128)
    assert held.cfg.rollout.temperature == cfg.rollout.temperature and held.cfg.task.seed == cfg.task.seed
    assert trainer.held_out[0].cfg.rollout.max_lines == 3  # the first held-out task keeps the training limits
    trainer.train()
    rows = read_metrics(tmp_path / "run")
    extra = [r for r in rows if "eval_explore/accuracy" in r]
    assert [r["step"] for r in extra] == [r["step"] for r in rows if "eval/accuracy" in r] == [0, 1]
    assert [r["eval_explore/episodes"] for r in extra] == [3, 3] and all(r["eval_explore/wall_s"] > 0 for r in extra)
    assert all(not any(k.startswith("eval/") for k in r) for r in extra)  # a row of its own
    levels = {row["level"] for row in held.task.rows("test")[:3]}  # accuracy per level of the problems evaluated
    assert {k for k in extra[0] if "accuracy_level" in k} == {f"eval_explore/accuracy_level{k}" for k in levels}
    samples = [json.loads(line) for line in (tmp_path / "run" / "eval_samples.jsonl").read_text().splitlines()]
    explore = [s for s in samples if s["eval"] == "eval_explore"]
    assert [s["step"] for s in explore] == [0] * 3 + [1] * 3 and {s["task"] for s in explore} == {"explore"}
    assert all(len(s["lines"]) <= 2 for s in explore)
    assert trainer.evals["eval_explore_before"]["episodes"] == trainer.evals["eval_explore_after"]["episodes"] == 3
    assert "eval_explore (3 problems of explore test):" in trainer.summary()
    _, table = compare(tmp_path / "run")
    assert table.explore_accuracy_mean.iloc[0] == extra[-1]["eval_explore/accuracy"]
    run = Run("v", 0, tmp_path / "run", cfg, [])
    assert _evaluated_at(run, rows, 1)
    assert not _evaluated_at(run, [r for r in rows if "eval_explore/accuracy" not in r or r["step"] == 0], 1)

    # killed during the explore evaluation after step 1: the resumed run does it (only it) again
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(
        json.dumps(r) + "\n" for r in rows if "eval_explore/accuracy" not in r or r["step"] == 0))
    resumed = Trainer(cfg, tmp_path / "run", resume=True, progress=False)
    assert resumed.evals["eval_explore_before"]["accuracy"] == extra[0]["eval_explore/accuracy"]
    resumed.train()
    again = read_metrics(tmp_path / "run")
    assert [r["step"] for r in again if "eval_explore/accuracy" in r] == [0, 1]
    assert [r for r in again if "eval/accuracy" in r] == [r for r in rows if "eval/accuracy" in r]


def record_eval_waves(monkeypatch) -> list[list[int]]:
    """The rows of every wave that held-out evaluations sample from now on (one list per rollout call)."""
    import replrl.evaluation

    real_rollout, sampled = replrl.evaluation.rollout, []

    def counted(env, rows, *args, **kwargs):
        sampled.append([i for i, _ in rows])
        return real_rollout(env, rows, *args, **kwargs)
    monkeypatch.setattr(replrl.evaluation, "rollout", counted)
    return sampled


def test_a_kill_mid_evaluation_loses_one_wave_at_most(format_model_dir, tmp_path, monkeypatch):
    """A held-out evaluation runs in waves (as many episodes as the pool has kernels: 8 here, so 20 problems are
    waves of 8, 8 and 4); each finished wave is written to eval_waves.jsonl. A run killed in its third wave resumes
    the evaluation there: only its 4 problems are sampled again, and the figures and transcripts are those of a run
    that was never interrupted."""
    from replrl.metrics import EvalWaves

    cfg = toy_config(format_model_dir, max_steps=1, eval_n=20, eval_every=1, eval_before=False)
    Trainer(cfg, tmp_path / "whole", progress=False).train()
    whole = [r for r in read_metrics(tmp_path / "whole") if "eval/accuracy" in r]
    assert [r["step"] for r in whole] == [1] and not (tmp_path / "whole" / "eval_waves.jsonl").read_text()

    real_add, written = EvalWaves.add, []

    def add_then_die(self, key, trajs):
        real_add(self, key, trajs)
        written.append(key)
        if len(written) == 2:
            raise KeyboardInterrupt  # killed after two waves were written
    monkeypatch.setattr(EvalWaves, "add", add_then_die)
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, run, progress=False).train()
    assert not [r for r in read_metrics(run) if "eval/accuracy" in r]  # no figures logged
    kept = [json.loads(line) for line in (run / "eval_waves.jsonl").read_text().splitlines()]
    assert [(r["step"], r["eval"], r["wave"][:2]) for r in kept] == [(1, "eval", [0, 8])] * 8 + \
        [(1, "eval", [8, 16])] * 8
    with open(run / "eval_waves.jsonl", "a") as f:
        f.write(json.dumps({**kept[0], "wave": [16, 20, 1, 8, kept[0]["wave"][4]]})[:-20])  # cut mid-write
    monkeypatch.setattr(EvalWaves, "add", real_add)

    sampled = record_eval_waves(monkeypatch)
    Trainer(cfg, run, resume=True, progress=False).train()
    assert sampled == [[16, 17, 18, 19]]                                 # the third wave only
    again = [r for r in read_metrics(run) if "eval/accuracy" in r]
    assert [untimed(r) for r in again] == [untimed(r) for r in whole]
    texts = [[json.loads(line)["text"] for line in (d / "eval_samples.jsonl").read_text().splitlines()]
             for d in (tmp_path / "whole", run)]
    assert texts[0] == texts[1] and len(texts[0]) == 20
    assert (run / "eval_waves.jsonl").read_text() == ""                   # emptied once the figures are logged


def test_a_run_killed_in_its_untrained_evaluation_starts_again_without_repeating_its_finished_waves(
        format_model_dir, tmp_path, monkeypatch):
    """Killed during the "before" evaluation there is no checkpoint to resume, so the run starts afresh in its
    directory (the same config): the untrained model's finished waves are kept, and nothing the killed attempt wrote
    is duplicated."""
    from replrl.metrics import EvalWaves

    cfg = toy_config(format_model_dir, max_steps=1, eval_n=12, eval_every=0, eval_before=True)
    real_add = EvalWaves.add

    def die(self, key, trajs):
        real_add(self, key, trajs)
        raise KeyboardInterrupt  # killed after the first wave (8 of 12 problems)
    monkeypatch.setattr(EvalWaves, "add", die)
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, run, progress=False).train()
    monkeypatch.setattr(EvalWaves, "add", real_add)
    (run / "samples.jsonl").write_text(json.dumps({"step": 1, "text": "from the killed attempt"}) + "\n")
    sampled = record_eval_waves(monkeypatch)
    Trainer(cfg, run, progress=False).train()
    assert sampled == [[8, 9, 10, 11], list(range(8)), [8, 9, 10, 11]]  # before: the rest; after: all of it
    rows = read_metrics(run)
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 1] and [r["eval/episodes"] for r in rows
                                                                         if "eval/accuracy" in r] == [12, 12]
    steps = [json.loads(line)["step"] for line in (run / "eval_samples.jsonl").read_text().splitlines()]
    assert steps == [0] * 12 + [1] * 12
    assert "from the killed attempt" not in (run / "samples.jsonl").read_text()


def test_ctrl_c_in_the_untrained_evaluation_says_there_is_nothing_to_save_and_stops(format_model_dir, tmp_path,
                                                                                      monkeypatch, caplog):
    """Ctrl-C during the "before" evaluation: the wave in flight finishes, nothing is trained or saved, and the
    messages say so (they used to promise a checkpoint); the same command then samples only the rest."""
    from replrl.metrics import EvalWaves

    cfg = toy_config(format_model_dir, max_steps=1, eval_n=12, eval_every=0, eval_before=True)
    real_add = EvalWaves.add

    def add_then_ctrl_c(self, key, trajs):
        real_add(self, key, trajs)
        os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setattr(EvalWaves, "add", add_then_ctrl_c)
    run = tmp_path / "run"
    with caplog.at_level("WARNING", logger="replrl.trainer"):
        Trainer(cfg, run, progress=False).train()
    assert "Ctrl-C: finishing the evaluation's wave in flight (finished waves are kept), then exiting (no step to " \
        "save yet)" in caplog.text
    assert "eval at step 0: stopped after 1 of 2 waves, which are kept; to finish it, run the same command " \
        "again" in caplog.text
    assert checkpoint.latest(run) is None and read_metrics(run) == []
    monkeypatch.setattr(EvalWaves, "add", real_add)
    sampled = record_eval_waves(monkeypatch)
    Trainer(cfg, run, progress=False).train()
    assert sampled[0] == [8, 9, 10, 11]  # the untrained evaluation's rest, then training


def test_ctrl_c_in_the_final_evaluation_stops_after_its_wave_and_resume_finishes_it(format_model_dir, tmp_path,
                                                                                   monkeypatch, caplog):
    """Ctrl-C (here the real signal, to this process) while the final held-out evaluation runs: the wave in flight
    finishes and is kept, the rest is not sampled, train() returns (exit 0 from the command line) with the checkpoint
    and no figures; `--resume` samples only the waves left, and its figures and transcripts equal an uninterrupted
    run's. It used to sample every remaining problem first (30 minutes for the 0.5B model on this CPU)."""
    from replrl.metrics import EvalWaves

    cfg = toy_config(format_model_dir, max_steps=1, eval_n=20, eval_every=0, eval_before=False)
    Trainer(cfg, tmp_path / "whole", progress=False).train()
    whole = [r for r in read_metrics(tmp_path / "whole") if "eval/accuracy" in r]
    assert [r["step"] for r in whole] == [1]

    real_add = EvalWaves.add

    def add_then_ctrl_c(self, key, trajs):
        real_add(self, key, trajs)
        os.kill(os.getpid(), signal.SIGINT)  # the trainer's handler: stop after this wave
    monkeypatch.setattr(EvalWaves, "add", add_then_ctrl_c)
    run = tmp_path / "run"
    with caplog.at_level("WARNING", logger="replrl.trainer"):
        stopped = Trainer(cfg, run, progress=False)
        stopped.train()
    assert "after" not in stopped.evals and not [r for r in read_metrics(run) if "eval/accuracy" in r]
    assert "Ctrl-C: finishing the evaluation's wave in flight (finished waves are kept), saving a checkpoint, then " \
        "exiting" in caplog.text
    assert f"eval at step 1: stopped after 1 of 3 waves, which are kept; to finish it, run `replrl train --resume " \
        f"{run}`" in caplog.text
    assert checkpoint.latest(run).name == "step-000001"
    kept = [json.loads(line)["wave"][:2] for line in (run / "eval_waves.jsonl").read_text().splitlines()]
    assert kept == [[0, 8]] * 8
    monkeypatch.setattr(EvalWaves, "add", real_add)

    sampled = record_eval_waves(monkeypatch)
    resumed = Trainer(cfg, run, resume=True, progress=False)
    resumed.train()
    assert sampled == [list(range(8, 16)), list(range(16, 20))]          # the two waves left, nothing else
    again = [r for r in read_metrics(run) if "eval/accuracy" in r]
    assert [untimed(r) for r in again] == [untimed(r) for r in whole]
    assert resumed.evals["after"]["episodes"] == 20
    texts = [[json.loads(line)["text"] for line in (d / "eval_samples.jsonl").read_text().splitlines()]
             for d in (tmp_path / "whole", run)]
    assert texts[0] == texts[1] and len(texts[0]) == 20


@pytest.mark.parametrize("transfer, message", [
    ({"nme": "gsm8k"}, "run.transfer_task: 'nme' is not a [task] field"),
    ({"level": 2}, "run.transfer_task needs a task name"),
])
def test_a_bad_transfer_task_is_a_config_error(transfer, message):
    from replrl.configlib import ConfigError

    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        resolve(Config, None, {"run": {"transfer_task": json.dumps(transfer)}})


def test_a_missing_transfer_dataset_fails_before_training(format_model_dir, tmp_path):
    from replrl.tasks import TaskError

    cfg = toy_config(format_model_dir, transfer_task={"name": "gsm8k", "data": str(tmp_path / "nowhere.jsonl")})
    with pytest.raises((TaskError, FileNotFoundError, ValueError)):
        Trainer(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


TIMED = ("eval/wall_s", "eval/state/digest_ms_mean", "eval/state/digest_ms_max", "eval/state/slow_digest_frac")


def untimed(row: dict) -> dict:
    """A metrics row without its wall-clock figures (the time a wave or a digest took is not reproducible)."""
    return {k: v for k, v in row.items() if k not in TIMED}
