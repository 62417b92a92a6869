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

from sandbox.protocols import Pool


def _rollout_default(name: str) -> Any:
    """A field whose default is ``RolloutConfig``'s (config.py: the one home of defaults), read when the object is
    made (config.py is imported then, not when this module is: it sits below config in the import order)."""

    def default() -> Any:
        from ..config import RolloutConfig

        return getattr(RolloutConfig, name)

    return field(default_factory=default)


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
    max_lines: int = _rollout_default("max_lines")
    """Lines (executed statements, block lines included) per episode: end reason ``max_lines``."""
    max_total_tokens: int = _rollout_default("max_total_tokens")
    """Prompt plus everything generated and spliced: end reason ``max_tokens``."""

    def __post_init__(self) -> None:
        if self.max_lines < 1 or self.max_total_tokens < 16:
            raise ValueError("episode rules: max_lines >= 1, max_total_tokens >= 16")

    @classmethod
    def from_config(cls, rollout_cfg: Any) -> EpisodeRules:
        return cls(max_output_tokens=rollout_cfg.max_output_tokens, max_repeats=rollout_cfg.max_repeats,
                   state_digest=rollout_cfg.state_digest, speculate=getattr(rollout_cfg, "speculate", False),
                   max_lines=rollout_cfg.max_lines, max_total_tokens=rollout_cfg.max_total_tokens)


@dataclass(frozen=True)
class Env:
    """What an episode runs with, gathered once: the generator, the kernel pool, the task, the episode's limits,
    the reward model and whether the prompt goes through the chat template. Whoever built its parts closes them
    (the Trainer its generator and pool)."""

    generator: Any
    """The ``Generator`` (``replrl.backends``) episodes sample their lines from."""
    pool: Pool
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
    outside the Trainer (``replrl.evaluate``, ``sample_episodes``, ``replrl eval``/``rollout``, the bench scripts): a
    started kernel pool of ``pool_size`` kernels (``cfg.rollout.kernel_pool``: its limits, ``kernel_refill`` and
    ``kernel_hosts``; the task's tools), ``EpisodeRules.from_config``, the reward model of ``cfg.rewards`` with the
    weights scheduled for ``step``, ``[model]``'s chat template options.

    ``generator``, ``task``, ``rewards``: parts the caller already holds (a Trainer's generator, a Python task), used
    as they are and left open; None: opened here from the config (the policy by ``policy.load_policy`` and
    ``backends.open_generator``, the task by ``task_from_config``). On exit, what was opened here is closed: the
    pool, and a generator made here (a vLLM engine holds processes and GPU memory)."""
    from sandbox import run_sync

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
        pool = run_sync(cfg.rollout.kernel_pool(pool_size, task.tools).start())
        opened.callback(lambda: run_sync(pool.close()))
        rewards = RewardModel.from_config(cfg.rewards).at(step) if rewards is None else rewards
        yield Env(generator, pool, task, EpisodeRules.from_config(cfg.rollout), rewards,
                  chat_template=cfg.model.chat_template, chat_template_kwargs=cfg.model.chat_template_kwargs)
