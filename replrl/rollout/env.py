"""What an episode runs with: ``Env`` (generator, kernel pool, task, limits, rewards, chat template: one frozen
object) and ``EpisodeRules``, every per-episode limit beyond sampling in one home (defaults live in config.py)."""

from __future__ import annotations

from collections.abc import Mapping
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
