"""What an episode runs with: ``Env`` (generator, kernel pool, task, limits, rewards, chat template: one frozen
object) and ``EpisodeRules``, every per-episode limit beyond sampling in one home (defaults live in config.py);
``open_env(cfg, ...)`` builds an Env from a config and closes what it opened."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class EpisodeRules:
    """Per-episode limits beyond sampling; ``EpisodeRules.from_config(cfg.rollout)`` (defaults live in config.py)."""

    max_output_tokens: int
    max_repeats: int
    state_digest: bool
    """Record the interpreter state each line starts from (``Line.state``, ``Line.state_values``)."""
    speculate: bool = False
    """Sample a line's successor while the line runs, when it is predicted to print nothing (see
    ``episode.py``'s docstring; flat rollouts only, a tree rollout plays without)."""

    @classmethod
    def from_config(cls, rollout_cfg: Any) -> EpisodeRules:
        return cls(max_output_tokens=rollout_cfg.max_output_tokens, max_repeats=rollout_cfg.max_repeats,
                   state_digest=rollout_cfg.state_digest, speculate=getattr(rollout_cfg, "speculate", False))


@dataclass(frozen=True)
class Env:
    """What an episode runs with, gathered once: the generator, the kernel pool, the task, the episode's limits,
    the reward model and whether the prompt goes through the chat template. Whoever built its parts closes them
    (the Trainer its generator and pool)."""

    generator: Any
    """The ``Generator`` (``replrl.backends``) episodes sample their lines from."""
    pool: Any
    """The started ``KernelPool`` (with the task's tools) episodes execute their lines in."""
    task: Any
    """The ``Task``: a problem's header, its setup, its answer check."""
    rules: EpisodeRules
    rewards: Any
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
def open_env(cfg: Any, *, pool_size: int, generator: Any = None, task: Any = None, rewards: Any = None,
             step: int = 0) -> Iterator[Env]:
    """``with open_env(cfg, pool_size=8) as env:`` an Env composed from a ``Config``, for every door that rolls out
    outside the Trainer (``replrl.evaluate``, ``sample_episodes``, ``replrl eval``/``rollout``): a started kernel
    pool of ``pool_size`` kernels (``cfg.rollout``'s limits, the task's tools), ``EpisodeRules.from_config``, the
    reward model of ``cfg.rewards`` with the weights scheduled for ``step``, ``[model]``'s chat template options.

    ``generator``, ``task``, ``rewards``: parts the caller already holds (a Trainer's generator, a Python task), used
    as they are and left open; None: opened here from the config (the policy by ``policy.load_policy`` and
    ``backends.open_generator``, the task by ``task_from_config``). On exit, what was opened here is closed: the
    pool, and a generator made here (a vLLM engine holds processes and GPU memory)."""
    from sandbox import KernelPool, run_sync

    from ..backends import close_generator, open_generator
    from ..evaluation import task_from_config
    from ..rewards import RewardModel

    with contextlib.ExitStack() as opened:
        if generator is None:
            from ..policy import load_policy

            policy, tokenizer = load_policy(cfg.model, seed=cfg.run.seed)
            generator = open_generator(cfg.model, policy, tokenizer)
            opened.callback(close_generator, generator)
        task = task_from_config(cfg) if task is None else task
        pool = run_sync(KernelPool(size=pool_size, limits=cfg.rollout.limits(), tools=task.tools).start())
        opened.callback(lambda: run_sync(pool.close()))
        rewards = RewardModel.from_config(cfg.rewards).at(step) if rewards is None else rewards
        yield Env(generator, pool, task, EpisodeRules.from_config(cfg.rollout), rewards,
                  chat_template=cfg.model.chat_template, chat_template_kwargs=cfg.model.chat_template_kwargs)
