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
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    trainer.train(on_step=results.append)  # a training step's prompts
    assert all("<think>\n\n</think>" in t.text for t in results[0].trajectories)
    # the step's episodes were sampled with the weights the run started from; the generator then took step 1's
    assert {t.policy_step for t in results[0].trajectories} == {0} and trainer.generator.version == 1


def test_open_env_composes_an_env_from_the_config_and_closes_only_what_it_opened(opened):
    """``open_env(cfg)``: the generator through ``open_generator`` (the one door), the task, a started pool, the
    rules, the reward weights of ``step``, the chat template's options; on exit the pool and the generator it made
    are closed, and parts the caller passed in are left open."""
    from replrl.backends import Generator
    from replrl.config import Config
    from replrl.rollout import EpisodeRules, open_env
    from replrl.tasks import Task
    from sandbox.protocols import Pool

    cfg = Config()
    cfg.model.name, cfg.model.chat_template_kwargs = "tiny", {"enable_thinking": False}
    cfg.rollout.max_repeats = 2
    with open_env(cfg, pool_size=1, step=3) as env:
        assert [o["backend"] for o in opened] == [cfg.model.backend]
        assert env.pool.size == 1 and env.rules == EpisodeRules.from_config(cfg.rollout) and env.rules.max_repeats == 2
        assert env.task.name == "arithmetic" and env.chat_template_kwargs == {"enable_thinking": False}
        assert env.rewards.step == 3
        # its parts are the protocols the episode reads (backends.base, sandbox.protocols, tasks.base)
        assert isinstance(env.generator, Generator) and isinstance(env.pool, Pool) and isinstance(env.task, Task)
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


# -- one rollout(env, rows, sampling), every episode limit in the Env's rules ---------------------------------------

class ScriptedGenerator:
    """A generator whose session rows 'sample' the lines of their problem's script (``tests.scripted.SCRIPTS``), as
    the tokenizer encodes them: the Env, the kernels and the splice are the real ones, no model is needed."""

    pad_id, version, own_weights, last_sync_transport = 0, 0, False, ""

    def __init__(self, tokenizer: Any, scripts: list[list[str]]):
        self.tokenizer, self.scripts = tokenizer, scripts

    def sync_weights(self, model: Any, version: int | None = None) -> None:
        pass

    def close(self) -> None:
        pass

    def session(self, prompts: list[list[int]], sampling: Any) -> Any:
        from replrl.rollout import encode, line_text
        from replrl.types import LineSample

        per_row = len(prompts) // len(self.scripts)
        lines = [[encode(self.tokenizer, line_text(c)) for c in self.scripts[i // per_row]]
                 for i in range(len(prompts))]

        class Session:
            stats: dict[str, float] = {}
            timing: dict[str, float] = {}

            async def next_line(self, i: int, env_ids: list[int]) -> LineSample:
                ids = lines[i].pop(0)
                return LineSample(token_ids=ids, logprobs=[0.0] * len(ids), finish="newline")

            async def rollback(self, i: int, length: int) -> None:
                raise AssertionError("no speculation here")

            def finish(self, i: int) -> None:
                pass

            async def aclose(self) -> None:
                pass

        return Session()


@pytest.fixture(scope="module")
def scripted_env():
    """An Env over the scripts `many` (7 lines, the answer last) and `bigprint` (600 characters printed), with
    rules of 5 lines and 400 tokens; the pool is closed after the module."""
    from replrl.config import RewardConfig
    from replrl.models import load_tokenizer
    from replrl.rewards import RewardModel
    from replrl.rollout import Env, EpisodeRules
    from sandbox import KernelPool, Limits, run_sync
    from tests.scripted import SCRIPTS, ScriptTask

    names = ("many", "bigprint")
    task = ScriptTask({name: SCRIPTS[name] for name in names})
    generator = ScriptedGenerator(load_tokenizer("smollm2-135m-instruct"), [SCRIPTS[name] for name in names])
    pool = run_sync(KernelPool(size=4, limits=Limits(wall_s=2.0), tools=["submit"]).start())
    rules = EpisodeRules(max_output_tokens=200, max_repeats=3, state_digest=False, max_lines=5, max_total_tokens=400)
    yield Env(generator, pool, task, rules, RewardModel(RewardConfig().weights), chat_template=False)
    run_sync(pool.close())


def run_rollout(env: Any, **kwargs: Any) -> list[Any]:
    from replrl.rollout import rollout
    from replrl.types import SamplingParams
    from sandbox import run_sync

    trajs, _ = run_sync(rollout(env, list(enumerate(env.task.rows("train"))), SamplingParams(seed=0), **kwargs))
    return trajs


def test_rollout_takes_an_env_and_the_old_form_is_gone(scripted_env):
    """Version 0.1 keeps one form: ``rollout(env, rows, sampling, *, group_size, progress, tree)``; the 12-argument
    form before the Env is a TypeError (an argument that is not an Env: one naming the new form)."""
    from replrl.rollout import rollout
    from replrl.types import SamplingParams
    from sandbox import run_sync

    env, rows, sampling = scripted_env, list(enumerate(scripted_env.task.rows("train"))), SamplingParams(seed=0)
    new, _ = run_sync(rollout(env, rows, sampling, group_size=2))
    assert [t.group for t in new] == [0, 0, 1, 1] and [t.row for t in new] == [0, 0, 1, 1]
    with pytest.raises(TypeError, match="takes 3 positional arguments"):
        rollout(env.generator, env.pool, env.task, rows, env.rewards, sampling, env.rules, group_size=2)
    with pytest.raises(TypeError, match=r"rollout\(env, rows, sampling, \*, group_size=1.*takes an Env first"):
        rollout(env.generator, rows, sampling)
    with pytest.raises(TypeError, match="takes 3 positional arguments"):
        rollout(env, rows, sampling, 2)  # group_size is a keyword


def test_every_episode_limit_is_the_env_s_rules(scripted_env):
    import dataclasses

    from replrl.types import SamplingParams

    many, bigprint = run_rollout(scripted_env)
    assert (many.end_reason, len(many.lines)) == ("max_lines", 5) and bigprint.end_reason == "submit"
    assert (many.sampling["max_lines"], many.sampling["max_total_tokens"]) == (5, 400)  # recorded, as before
    rules = scripted_env.rules
    short = dataclasses.replace(scripted_env, rules=dataclasses.replace(rules, max_lines=2, max_total_tokens=150))
    many, bigprint = run_rollout(short)
    assert (many.end_reason, len(many.lines)) == ("max_lines", 2)
    assert bigprint.end_reason == "max_tokens" and len(bigprint.lines) == 1 and len(bigprint.token_ids) < 150
    with pytest.raises(TypeError, match="max_lines"):  # the sampler holds no episode limit (gone in 0.1)
        SamplingParams(max_lines=3)


def test_a_task_s_own_limits_reach_the_rules():
    """The programs and explore tasks set longer episodes (their ``rollout_defaults``); the rules built from the
    config hold them, and what the user sets wins."""
    from replrl.config import Config
    from replrl.configlib import resolve
    from replrl.rollout import EpisodeRules

    programs = EpisodeRules.from_config(resolve(Config, None, {"task": {"name": "programs"}}).rollout)
    assert (programs.max_lines, programs.max_total_tokens, programs.max_output_tokens) == (24, 1536, 64)
    explore = EpisodeRules.from_config(resolve(Config, None, {"task": {"name": "explore"}}).rollout)
    assert (explore.max_lines, explore.max_total_tokens, explore.max_output_tokens) == (16, 2048, 128)
    mine = resolve(Config, None, {"task": {"name": "programs"}, "rollout": {"max_lines": 7}}).rollout
    assert (EpisodeRules.from_config(mine).max_lines, EpisodeRules.from_config(mine).max_total_tokens) == (7, 1536)


def test_held_out_evaluation_goes_through_an_env(scripted_env, format_model_dir, tmp_path, monkeypatch):
    """``evaluation.evaluate(env, cfg, n)``: the API's and the Trainer's evaluation alike roll out in an Env; the
    Trainer's holds its generator, the held-out task, that task's own rules and the reward weights of its step."""
    from types import SimpleNamespace

    import replrl.evaluation
    from replrl.config import Config
    from replrl.rollout import EpisodeRules

    cfg = Config()
    cfg.task.eval_split = "train"
    figures = replrl.evaluation.evaluate(scripted_env, cfg, n=2)
    assert figures["episodes"] == 2 and figures["accuracy"] == 0.5  # `bigprint` submits its answer, `many` runs out

    seen = []

    class Seen(Exception):
        pass

    def spy(env, rows, sampling, **kwargs):
        seen.append(env)
        raise Seen

    monkeypatch.setattr(replrl.evaluation, "rollout", spy)
    cfg = toy_config(format_model_dir, max_steps=1, extra_eval=[{"name": "explore", "level": 0, "n": 3,
                                                                 "rollout": {"max_lines": 2}}])
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    held = trainer.held_out[1]
    with pytest.raises(Seen):
        trainer.evaluate(SimpleNamespace(size=4), which="eval_explore")
    (env,) = seen
    assert env.generator is trainer.generator and env.task is held.task and env.rewards.step == trainer.step
    assert env.rules == EpisodeRules.from_config(held.cfg.rollout)
    assert (env.rules.max_lines, env.rules.max_total_tokens) == (2, 2048)  # explore's own, the table's max_lines
