"""One door into the episode (issue 55): every door opens its generator with ``backends.open_generator``, so
[model]'s options reach the backend from ``replrl eval``, ``replrl rollout`` and the API as from ``replrl train``;
``replrl eval`` and ``replrl.evaluate`` score a checkpoint with the reward weights of its step; a one-file dataset
with no test split trains, holding out its first rows. On the tiny format model, with real kernels."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

import replrl.backends
from replrl import api
from replrl.cli import main
from replrl.configlib import to_toml
from replrl.metrics import read_metrics
from replrl.trainer import Trainer
from tests.test_trainer import toy_config

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The options of every generator loaded (the real one is still made)."""
    seen: list[dict[str, Any]] = []
    real = replrl.backends.load_generator

    def spy(name: str, model: Any, tokenizer: Any, **opts: Any) -> Any:
        seen.append({"backend": name, **opts})
        return real(name, model, tokenizer, **opts)

    monkeypatch.setattr(replrl.backends, "load_generator", spy)
    return seen


def test_model_options_reach_the_backend_from_every_door(format_model_dir, tmp_path, opened):
    cfg = toy_config(format_model_dir)
    cfg.model.device, cfg.model.vllm, cfg.model.sync_transport = "cpu", {"max_model_len": 512}, "shm"
    cfg.model.gpu_memory_utilization, cfg.model.sync_timeout_s = 0.25, 60.0
    config = tmp_path / "config.toml"
    config.write_text(to_toml(cfg))
    api.sample_episodes(str(format_model_dir), n=2, cfg=cfg)
    api.evaluate(str(format_model_dir), n=2, cfg=cfg)
    model = ["--model", str(format_model_dir), "--n", "2"]
    assert main(["rollout", str(config), *model, "--out", str(tmp_path / "episodes.jsonl")]) == 0
    assert main(["eval", str(config), *model]) == 0
    Trainer(cfg, tmp_path / "run", progress=False)  # the reference: replrl train's door
    assert len(opened) == 5
    for opts in opened:  # the same [model] options at every door (the Trainer's device is its accelerator's)
        assert opts["backend"] == "hf" and str(opts["device"]) == "cpu"
        assert opts["engine_args"] == {"max_model_len": 512} and opts["sync_transport"] == "shm"
        assert opts["gpu_memory_utilization"] == 0.25 and opts["sync_timeout_s"] == 60.0
    assert opened[-1]["max_rows"] == 8  # group_size x problems_per_step: what the trainer samples at once


def test_replrl_eval_and_evaluate_score_a_checkpoint_with_the_weights_of_its_step(format_model_dir, tmp_path):
    cfg = toy_config(format_model_dir, max_steps=1, save_model=False)
    cfg.rewards.weights["correct"] = {"start": 1.0, "end": 3.0, "steps": 2}  # 1.0 at step 0, 2.0 at step 1
    run = tmp_path / "run"
    Trainer(cfg, run, progress=False).train()
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(run), "--n", "8", "--out", str(out)]) == 0
    by_cli = json.loads(out.read_text())
    by_api = api.evaluate(str(run), n=8)
    for key in ("reward_mean", "reward/correct", "accuracy"):
        assert by_cli[key] == pytest.approx(by_api[key]), key
    assert by_api["accuracy"] > 0, "the seed was picked so that some episode is right"
    assert by_api["reward/correct"] == pytest.approx(2.0 * by_api["accuracy"])  # the weight of step 1, not step 0's


def test_a_one_file_dataset_without_a_test_split_trains_and_evaluates_on_a_held_out_slice(format_model_dir, tmp_path,
                                                                                          caplog):
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"question": f"Submit {1 + k % 4}.", "answer": 1 + k % 4}) + "\n"
                            for k in range(40)))
    cfg = toy_config(format_model_dir, max_steps=1, save_every=0, eval_n=2, save_model=False)
    cfg.task.name, cfg.task.data, cfg.task.system_prompt = "dataset", str(data), "Submit the number."
    with caplog.at_level(logging.INFO, logger="replrl.console"):
        trainer = Trainer(cfg, tmp_path / "run", progress=False)
        trainer.train()
    assert len(trainer.train_rows) == 36  # 4 of 40 rows (a tenth) held out
    held = [r.message for r in caplog.records if "held out" in r.message]
    assert held == [f"dataset '{data}' is one file with one split: its first 4 rows are held out as 'test', 'train' "
                    "is the other 36 (task.options.holdout = 0: no hold-out)"]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 1] and rows[0]["eval/episodes"] == 2


def test_open_generator_honours_model_device(format_model_dir: Path):
    from replrl.policy import load_policy

    cfg = toy_config(format_model_dir)
    cfg.model.device = "cpu"
    model, tokenizer = load_policy(cfg.model, seed=0)
    generator = replrl.backends.open_generator(cfg.model, model, tokenizer)
    assert generator.device.type == "cpu"


SWITCHED_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n"
                     "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
                     "{% endif %}")
"""A chat template that reads a switch, as Qwen3's reads ``enable_thinking``."""


def test_chat_template_kwargs_reach_every_prompt_an_episode_builds(format_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from replrl.rollout import build_prompt

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for f in format_model_dir.iterdir():
        (model_dir / f.name).write_bytes(f.read_bytes())
    tokenizer = AutoTokenizer.from_pretrained(format_model_dir)
    tokenizer.chat_template = SWITCHED_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    assert "<think>" not in build_prompt(tokenizer, "Submit 3.")
    assert "<think>\n\n</think>" in build_prompt(tokenizer, "Submit 3.", template_kwargs={"enable_thinking": False})

    cfg = toy_config(model_dir, max_steps=1, save_every=0, save_model=False)
    cfg.model.chat_template = True
    (plain,) = api.sample_episodes(str(model_dir), n=1, cfg=cfg)
    cfg.model.chat_template_kwargs = {"enable_thinking": False}
    (switched,) = api.sample_episodes(str(model_dir), n=1, cfg=cfg)
    assert "<think>" not in plain.text and "<|im_start|>assistant\n<think>\n\n</think>\n\nPython " in switched.text
    results = []
    Trainer(cfg, tmp_path / "run", progress=False).train(on_step=results.append)  # a training step's prompts
    assert all("<think>\n\n</think>" in t.text for t in results[0].trajectories)


def test_open_env_composes_an_env_from_the_config_and_closes_only_what_it_opened(opened):
    """``open_env(cfg)``: the generator through ``open_generator`` (the one door), the task, a started pool, the
    rules, the reward weights of ``step``, the chat template's options; on exit the pool and the generator it made
    are closed, and parts the caller passed in are left open."""
    from replrl.config import Config
    from replrl.rollout import EpisodeRules, open_env

    cfg = Config()
    cfg.model.name, cfg.model.chat_template_kwargs = "tiny", {"enable_thinking": False}
    cfg.rollout.max_repeats = 2
    with open_env(cfg, pool_size=1, step=3) as env:
        assert [o["backend"] for o in opened] == [cfg.model.backend]
        assert env.pool.size == 1 and env.rules == EpisodeRules.from_config(cfg.rollout) and env.rules.max_repeats == 2
        assert env.task.name == "arithmetic" and env.chat_template_kwargs == {"enable_thinking": False}
        assert env.rewards.step == 3
        pool, generator = env.pool, env.generator
    assert pool._closed

    class Held:
        tokenizer = generator.tokenizer
        closed = False

        def close(self) -> None:
            self.closed = True

    held = Held()
    with open_env(cfg, pool_size=1, generator=held, task=env.task) as env2:
        assert env2.generator is held and env2.task is env.task
    assert not held.closed and env2.pool._closed and len(opened) == 1
