"""What an episode runs with: ``Env`` (generator, kernel pool, task, limits, rewards, chat template: one frozen
object) and ``EpisodeRules``, every per-episode limit in one home (defaults live in config.py: ``RolloutConfig``);
``open_env(cfg, ...)`` builds an Env from a config and closes what it opened. ``SamplingParams`` is how a line's
tokens are drawn (temperature, top-p/k, ``max_line_tokens``: the backend cuts a line there); how long an episode
runs is the rules'."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from sandbox import run_sync
from sandbox.protocols import Pool

from ..backends import open_generator
from ..backends.base import Generator
from ..config import RolloutConfig
from ..rewards import RewardModel
from ..tasks.base import Task, task_from_config
from .host_splice import post_spec


@dataclass(frozen=True)
class EpisodeRules:
    """Every per-episode limit, in one home: ``EpisodeRules.from_config(cfg.rollout)`` (defaults live in config.py;
    a task's own limits, its ``rollout_defaults``, are in ``cfg.rollout`` already). The episode reads them from
    ``env.rules`` only (``SamplingParams`` holds how a line is sampled, and its line cut ``max_line_tokens``)."""

    max_output_tokens: int
    """Interpreter output past this many tokens is cut, with a visible marker."""
    max_repeats: int
    """The same line this many times in a row ends the episode: end reason ``repeat``."""
    state_digest: bool
    """Record the interpreter state each line starts from (``Line.state``, ``Line.state_values``)."""
    speculate: bool = False
    """Sample a line's successor while the line runs, when it is predicted to print nothing (see
    ``episode.py``'s docstring; flat rollouts only, a tree rollout plays without)."""
    max_lines: int = RolloutConfig.max_lines
    """Lines (executed statements, block lines included) per episode: end reason ``max_lines``."""
    max_total_tokens: int = RolloutConfig.max_total_tokens
    """Prompt plus everything generated and spliced: end reason ``max_tokens``."""

    def __post_init__(self) -> None:
        if self.max_lines < 1 or self.max_total_tokens < 16:
            raise ValueError("episode rules: max_lines >= 1, max_total_tokens >= 16")

    @classmethod
    def from_config(cls, rollout_cfg: RolloutConfig) -> EpisodeRules:
        return cls(max_output_tokens=rollout_cfg.max_output_tokens, max_repeats=rollout_cfg.max_repeats,
                   state_digest=rollout_cfg.state_digest, speculate=rollout_cfg.speculate,
                   max_lines=rollout_cfg.max_lines, max_total_tokens=rollout_cfg.max_total_tokens)


@dataclass(frozen=True)
class Env:
    """What an episode runs with, gathered once: the generator, the kernel pool, the task, the episode's limits,
    the reward model and whether the prompt goes through the chat template. Whoever built its parts closes them
    (the Trainer its generator and pool)."""

    generator: Generator
    """The ``Generator`` (``replrl.backends.base``) episodes sample their lines from: any backend that implements the
    protocol (hf, vllm, a test's scripted one)."""
    pool: Pool
    """The started kernel pool (``sandbox.protocols.Pool``, with the task's tools) episodes execute their lines in:
    ``KernelPool`` (kernels in this process) or ``HostedPool`` (kernel-host processes); the episode reads only the
    protocol."""
    task: Task
    """The ``Task`` (``replrl.tasks.base``): a problem's header, its setup, its answer check."""
    rules: EpisodeRules
    rewards: RewardModel
    """The ``RewardModel`` (with the weights of the step it is used at: ``at``)."""
    chat_template: bool = True
    """Whether the task's header is a user turn of the tokenizer's chat template (``model.chat_template``)."""
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """The chat template's options (``model.chat_template_kwargs``: Qwen3's enable_thinking), for every prompt."""

    @property
    def tokenizer(self) -> Any:
        return self.generator.tokenizer

    def at(self, step: int) -> Env:
        """The same Env with the reward weights scheduled for ``step``."""
        return replace(self, rewards=self.rewards.at(step))


@contextlib.contextmanager
def open_env(cfg: Any, *, pool_size: int, generator: Generator | None = None, task: Task | None = None,
             rewards: RewardModel | None = None, step: int = 0, uid_base: int | None = None) -> Iterator[Env]:
    """``with open_env(cfg, pool_size=8) as env:`` an Env composed from a ``Config``, for every door that rolls out
    (the Trainer's ``draw.Drawer``, ``replrl.evaluate``, ``sample_episodes``, ``replrl eval``/``rollout``, the bench
    scripts): a started kernel pool of ``pool_size`` kernels (``cfg.rollout.kernel_pool``: its limits,
    ``kernel_refill`` and ``kernel_hosts``; the task's tools; its kernels' uids from ``uid_base`` when given: the
    Trainer's, per rank of a machine), ``EpisodeRules.from_config``, the reward model of ``cfg.rewards`` with the
    weights scheduled for ``step``, ``[model]``'s chat template options.

    ``generator``, ``task``, ``rewards``: parts the caller already holds (a Trainer's generator, a Python task), used
    as they are and left open; None: opened here from the config (the policy by ``policy.load_policy`` and
    ``backends.open_generator``, the task by ``task_from_config``). On exit, what was opened here is closed: the
    pool, and a generator made here (a vLLM engine holds processes and GPU memory)."""
    with contextlib.ExitStack() as opened:
        # the reward model first: a term or function that does not resolve is one line before any model is loaded
        rewards = RewardModel.from_config(cfg.rewards).at(step) if rewards is None else rewards
        if generator is None:
            from ..policy import load_policy

            policy, tokenizer = load_policy(cfg.model, seed=cfg.run.seed)
            generator = open_generator(cfg.model, policy, tokenizer)
            opened.callback(generator.close)
        task = task_from_config(cfg) if task is None else task
        limits = None if uid_base is None else replace(cfg.rollout.limits(), uid_base=uid_base)
        pool = run_sync(cfg.rollout.kernel_pool(pool_size, task.tools, limits,
                                                post=lambda: post_spec(generator.tokenizer)).start())
        opened.callback(lambda: run_sync(pool.close()))
        yield Env(generator, pool, task, EpisodeRules.from_config(cfg.rollout), rewards,
                  chat_template=cfg.model.chat_template, chat_template_kwargs=cfg.model.chat_template_kwargs)
