"""Config: defaults validate, TOML + dotted overrides, unknown keys and wrong types are one-line errors."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from replrl.config import Config
from replrl.configlib import (
    ConfigError,
    add_arguments,
    field_docs,
    load_file,
    overrides_from_args,
    resolve,
    settle_config_file,
    to_dict,
    to_toml,
)


def test_defaults_and_every_field_documented():
    cfg = Config()
    for section in vars(cfg).values():
        docs = field_docs(type(section))
        missing = [f for f in vars(section) if f not in docs]
        assert missing == [], f"{type(section).__name__} fields without a docstring: {missing}"


def test_file_then_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[rollout]\ntemperature = 0.7\ngroup_size = 4\n[rewards.weights]\nsyntax_error = -1.0\n")
    cfg = resolve(Config, str(path), {"rollout": {"temperature": "0.9"}, "optim": {"betas": "[0.9, 0.95]"}})
    assert cfg.rollout.temperature == 0.9 and cfg.rollout.group_size == 4
    assert cfg.optim.betas == (0.9, 0.95)
    # a weights table merges with the default table (issue 49: it used to replace it, silently zeroing `correct`)
    assert cfg.rewards.weights == {**Config().rewards.weights, "syntax_error": -1.0}


def test_saved_config_round_trips(tmp_path):
    options = '{"a": 1, "split": {"test": "train"}}'
    cfg = resolve(Config, None, {"task": {"name": "gsm8k", "options": options}, "run": {"max_steps": "7"}})
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    again = resolve(Config, str(path), {})
    assert again == cfg


@pytest.mark.parametrize("overrides, message", [
    ({"rollout": {"temprature": 1.0}},
     "unknown config key 'rollout.temprature' (did you mean 'rollout.temperature'?)"),
    ({"rolout": {"temperature": 1.0}}, "unknown config key 'rolout' (did you mean 'rollout'?)"),
    ({"rollout": {"group_size": "four"}}, "rollout.group_size must be int; got 'four'"),
    ({"rollout": {"group_size": 1}}, "rollout.group_size must be >= 2"),
    ({"loss": {"agg": "mean"}}, "loss.agg must be one of token_mean, seq_mean, constant; got 'mean'"),
    ({"rewards": {"weights": {"nope": 1.0}}}, "unknown reward term 'nope'"),
    ({"model": {"sync_transport": "nccl"}},
     "model.sync_transport must be one of auto, cuda_ipc, shm, rpc; got 'nccl'"),
    ({"rollout": {"kernel_backend": "k8s"}}, "rollout.kernel_backend must be one of local, ray; got 'k8s'"),
    ({"rollout": {"kernel_backend": "ray", "kernel_hosts": 2}}, "each node runs one host"),
])
def test_bad_values_are_one_line_errors(overrides, message):
    from replrl.rewards import RewardModel

    with pytest.raises(ConfigError if "reward term" not in message else ValueError) as err:
        cfg = resolve(Config, None, overrides)
        RewardModel.from_config(cfg.rewards)  # a term's name is looked up when a run starts: config.py is a leaf
    assert message in str(err.value) and "\n" not in str(err.value)


def test_extra_held_out_tasks_from_a_file_or_the_command_line_round_trip(tmp_path):
    from replrl.config import ExtraEval

    path = tmp_path / "c.toml"
    path.write_text('[run]\nextra_eval = [{name = "explore", level = 0, n = 100}, {name = "tests.toy:EchoTask", '
                    'label = "echo", rollout = {max_lines = 2}}]\n')
    cfg = resolve(Config, str(path), {})
    assert cfg.run.extra_evals() == [ExtraEval("explore", {"name": "explore", "level": 0}, 100, {}),
                                     ExtraEval("echo", {"name": "tests.toy:EchoTask"}, 100, {"max_lines": 2})]
    saved = tmp_path / "config.toml"
    saved.write_text(to_toml(cfg))
    assert resolve(Config, str(saved), {}) == cfg
    flag = resolve(Config, None, {"run": {"extra_eval": '[{"name": "explore", "n": 3}]'}})  # --run.extra_eval=JSON
    assert flag.run.extra_evals() == [ExtraEval("explore", {"name": "explore"}, 3, {})]
    assert Config().run.extra_evals() == []


@pytest.mark.parametrize("extra, message", [
    ([{"level": 0}], 'run.extra_eval[0] needs a task name, e.g. {name = "explore", level = 0, n = 100}'),
    ([{"name": "explore", "lvl": 0}], "run.extra_eval[0]: 'lvl' is not a [task] field, n, label or rollout"),
    ([{"name": "explore", "level": 9}], "run.extra_eval[0]: task.level must be between 0 and 5"),
    ([{"name": "explore", "n": 0}], "run.extra_eval[0]: n must be an integer >= 1; got 0"),
    ([{"name": "my_pkg.tasks:Mine"}], "run.extra_eval[0]: label 'my_pkg.tasks:Mine' must be lower-case letters"),
    ([{"name": "explore"}, {"name": "explore", "level": 2}], "run.extra_eval[1]: label 'explore' is used twice"),
    ([{"name": "explore", "rollout": {"temperature": 1.0}}], "rollout must be a table of max_lines"),
    ([{"name": "explore", "rollout": {"max_lines": 1.5}}], "rollout.max_lines must be an integer > 0; got 1.5"),
    (["explore"], "run.extra_eval must be dict; got 'explore'"),  # the type check comes first
])
def test_bad_extra_held_out_tasks_are_one_line_errors(extra, message):
    with pytest.raises(ConfigError) as err:
        resolve(Config, None, {"run": {"extra_eval": extra}})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_file(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[rollout\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_file(bad)


def test_command_line_options_are_generated_with_help():
    parser = argparse.ArgumentParser()
    add_arguments(parser, Config)
    args = parser.parse_args(["--rollout.temperature", "0.5", "--model.name", "tiny"])
    assert overrides_from_args(args) == {"rollout": {"temperature": "0.5"}, "model": {"name": "tiny"}}
    assert "Sampling temperature" in parser.format_help()


class LongEpisodesTask:
    """A task class that asks for longer episodes (as the built-in ``programs`` task does)."""

    rollout_defaults = {"max_lines": 24, "max_total_tokens": 1536}


def test_episode_limits_have_one_home_the_rules_with_rollout_s_defaults():
    """The episode's limits live in EpisodeRules, defaulting to ``rollout``'s; SamplingParams holds how a line is
    sampled, and no episode limit (its old max_lines and max_total_tokens fields are gone in 0.1)."""
    from replrl.rollout import EpisodeRules
    from replrl.types import SamplingParams

    rollout = Config().rollout
    made = EpisodeRules(max_output_tokens=40, max_repeats=3, state_digest=False)
    assert (made.max_lines, made.max_total_tokens) == (rollout.max_lines, rollout.max_total_tokens)
    assert EpisodeRules.from_config(dataclasses.replace(rollout, max_lines=7, max_total_tokens=64)).max_lines == 7
    assert rollout.sampling(seed=0) == SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p,
                                                       top_k=rollout.top_k, max_line_tokens=rollout.max_line_tokens,
                                                       seed=0)
    assert {f.name for f in dataclasses.fields(SamplingParams)} == {"temperature", "top_p", "top_k", "max_line_tokens",
                                                                     "seed"}
    with pytest.raises(ValueError, match="max_lines >= 1"):
        EpisodeRules(40, 3, False, max_lines=0)


def test_a_task_s_rollout_defaults_apply_where_the_user_set_nothing(tmp_path):
    task = {"task": {"name": "tests.test_config:LongEpisodesTask"}}
    cfg = resolve(Config, None, task)
    assert (cfg.rollout.max_lines, cfg.rollout.max_total_tokens) == (24, 1536)
    assert cfg.rollout.temperature == Config().rollout.temperature  # what the task does not name stays
    cfg = resolve(Config, None, {**task, "rollout": {"max_lines": 7}})
    assert (cfg.rollout.max_lines, cfg.rollout.max_total_tokens) == (7, 1536)  # the command line wins
    path = tmp_path / "c.toml"
    path.write_text('[task]\nname = "tests.test_config:LongEpisodesTask"\n[rollout]\nmax_total_tokens = 900\n')
    cfg = resolve(Config, str(path), {})
    assert (cfg.rollout.max_lines, cfg.rollout.max_total_tokens) == (24, 900)  # and so does the file
    saved = to_dict(resolve(Config, None, {**task, "rollout": {"max_lines": 9}}))
    assert resolve(Config, None, {}, base=saved).rollout.max_lines == 9  # a resumed run keeps its own values
    assert resolve(Config, None, {}).rollout.max_lines == Config().rollout.max_lines


def test_every_command_s_help_says_what_it_does_and_fits_a_terminal(capsys):
    """`replrl <command> --help` for every command: exit 0, a description of at least one sentence under the usage,
    no line wider than 120 columns (the hand-wrapped descriptions keep their own line breaks)."""
    from replrl.cli import build_parser, main

    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subs.choices) >= {"train", "eval", "rollout", "repl", "plot", "sweep", "compare", "env"}
    for name in subs.choices:
        with pytest.raises(SystemExit) as done:
            main([name, "--help"])
        text = capsys.readouterr().out
        assert done.value.code == 0 and text.startswith(f"usage: replrl {name}"), name
        description = text.split("\n\n")[1]
        assert len(description.split()) >= 8 and "." in description, (name, description)
        wide = [line for line in text.splitlines() if len(line) > 120]
        assert not wide, (name, wide)


def test_a_weights_table_merges_with_the_defaults_and_0_removes_a_term(tmp_path):
    from replrl.rewards import RewardModel

    path = tmp_path / "c.toml"
    path.write_text("[rewards.weights]\nran_and_printed = 0.05\nno_submit = 0\n")
    cfg = resolve(Config, str(path), {})
    weights = RewardModel.from_config(cfg.rewards).weights()
    # the shaping term is added; correct (1.0), syntax_error (-0.3) stay; no_submit is 0, ran_and_printed 0.05
    assert weights["correct"] == 1.0 and weights["syntax_error"] == -0.3
    assert weights["ran_and_printed"] == 0.05 and weights["no_submit"] == 0.0
    cfg = resolve(Config, str(path), {"rewards": {"weights": '{"exception": 0}'}})  # the command line merges too
    weights = RewardModel.from_config(cfg.rewards).weights()
    assert "exception" not in weights and weights["ran_and_printed"] == 0.05 and weights["correct"] == 1.0
    described = RewardModel.from_config(cfg.rewards).describe()
    assert described.startswith("correct=1 wrong=0 no_submit=0 syntax_error=-0.3")


def test_help_shows_type_default_and_choices_and_bools_are_bare_flags(tmp_path):
    parser = argparse.ArgumentParser()
    parser.add_argument("config", nargs="?")
    add_arguments(parser, Config)
    text = " ".join(parser.format_help().split())
    assert "(str, default: 'token_mean'; choices: token_mean, seq_mean, constant)" in text  # loss.agg
    assert "--rollout.group_size INT" in text and "(int, default: 8)" in text
    assert "--run.eval_before [BOOL]" in text and "--rewards.weights TABLE" in text
    args = parser.parse_args(["--run.eval_before", "--optim.gradient_checkpointing", "false", "--run.save_model"])
    assert overrides_from_args(args) == {"run": {"eval_before": "true", "save_model": "true"},
                                         "optim": {"gradient_checkpointing": "false"}}
    cfg = resolve(Config, None, overrides_from_args(args))
    assert cfg.run.eval_before is True and cfg.optim.gradient_checkpointing is False and cfg.run.save_model is True
    args = settle_config_file(parser.parse_args(["--model.chat_template", "my.toml"]))  # a bare flag, then a file
    assert args.config == "my.toml" and overrides_from_args(args) == {"model": {"chat_template": "true"}}


def test_time_budget_is_off_by_default_and_only_the_default_run_has_one(tmp_path, monkeypatch, capsys):
    from replrl.cli import main
    from replrl.config import DEFAULT_RUN_TIME_BUDGET_MIN

    assert Config().run.time_budget_min == 0 and DEFAULT_RUN_TIME_BUDGET_MIN == 15
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--print-config"]) == 0  # the no-argument default run: its 15 minutes
    printed = capsys.readouterr().out
    path = tmp_path / "printed.toml"
    path.write_text(printed)
    assert load_file(path)["run"]["time_budget_min"] == 15.0
    assert resolve(Config, str(path), {}).run.time_budget_min == 15.0  # the printed config is a loadable config
    assert main(["train", "--print-config", "--run.max_steps", "500"]) == 0  # any option: no budget
    again = tmp_path / "again.toml"
    again.write_text(capsys.readouterr().out)
    cfg = resolve(Config, str(again), {})
    assert cfg.run.time_budget_min == 0 and cfg.run.max_steps == 500
    assert to_toml(cfg) == again.read_text()  # the fully resolved config, every section
    assert not (tmp_path / "runs").exists()  # --print-config only prints


def test_eval_sampling_options():
    from replrl.config import GREEDY_TEMPERATURE

    cfg = Config()
    assert cfg.run.eval_samples == 1 and cfg.run.eval_sampling_temperature(0.7) == 0.7  # as before: training's
    cfg = resolve(Config, None, {"run": {"eval_temperature": "0", "eval_samples": "4"}})
    assert cfg.run.eval_sampling_temperature(0.7) == GREEDY_TEMPERATURE and cfg.run.eval_samples == 4
    assert resolve(Config, None, {"run": {"eval_temperature": 0.3}}).run.eval_sampling_temperature(0.7) == 0.3
    with pytest.raises(ConfigError, match="^run.eval_samples must be >= 1; got 0$"):
        resolve(Config, None, {"run": {"eval_samples": 0}})


def test_kernels_on_ray_without_ray_is_one_line(monkeypatch):
    """``kernel_backend = ray`` where Ray is not installed: the pool's builder says what to install, in one line."""
    import importlib.util

    from replrl.config import RolloutConfig

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs Ray >= 2.52: pip install 'replrl\[ray\]'$"):
        RolloutConfig(kernel_backend="ray").kernel_pool(2, [])
