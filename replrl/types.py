"""The shared vocabulary: Line, Trajectory, SamplingParams, LineSample. Plain data, JSON-serialisable."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

LineStatus = Literal["ok", "error", "timeout", "crashed", "incomplete"]
FinishReason = Literal["newline", "eos", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are sampled. Defaults are plain sampling (temperature 1, no truncation), as GRPO expects.

    The log-probabilities a backend returns are those of the distribution it actually sampled from: logits divided
    by ``temperature``, tokens that contain a newline anywhere but at their end removed (the line rule), then
    top-k / top-p truncation. ``replrl.contract.sampling_logprobs`` computes that quantity, and the
    trainer calls the same function, so sampler and trainer agree exactly. How long an episode runs (lines, tokens)
    is its rules' (``EpisodeRules``, ``env.rules``), not the sampler's.
    """

    temperature: float = 1.0
    """Softmax temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 disables it."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables it."""
    max_line_tokens: int = 96
    """A line longer than this ends the episode (end reason ``overlong_line``)."""
    seed: int | None = None
    """Seed for the sampler's random generator (None: nondeterministic)."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError("sampling.temperature must be > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("sampling.top_p must be in (0, 1]")
        if self.top_k < 0 or self.max_line_tokens < 1:
            raise ValueError("sampling: top_k >= 0, max_line_tokens >= 1")


@dataclass
class LineSample:
    """One line as the policy sampled it."""

    token_ids: list[int]
    """Sampled ids; the last one contains the newline when ``finish == "newline"``."""
    logprobs: list[float]
    """Log-probability of each sampled id under the sampling distribution (see SamplingParams)."""
    finish: FinishReason


@dataclass
class Line:
    """One executed line (or the line that closed a block) of an episode, with its reward terms."""

    code: str
    """The model's text for this line, without the trailing newline."""
    output: str = ""
    """What the interpreter printed after this line (not including the next prompt)."""
    status: LineStatus = "ok"
    error_name: str | None = None
    rewards: dict[str, float] = field(default_factory=dict)
    """Reward terms by name (already weighted), e.g. {"syntax_error": -0.3}."""
    token_span: tuple[int, int] = (0, 0)
    """[start, end) of this line's model-sampled tokens in Trajectory.token_ids."""
    output_span: tuple[int, int] = (0, 0)
    """[start, end) in Trajectory.token_ids of the tokens of what the interpreter printed after this line, recorded
    at the splice (a token that starts in the printed text and runs on into the next prompt counts; the prompt and a
    truncation marker do not): the output-prediction loss and the viewer read it. Empty (start == end) when the line
    printed nothing or the episode ended at it."""
    text_span: tuple[int, int] = (0, 0)
    """[start, end) in Trajectory.text of this line's sampled text (``token_span``'s characters)."""
    output_text_span: tuple[int, int] = (0, 0)
    """[start, end) in Trajectory.text of what the interpreter printed after this line, as spliced (a long output's
    kept part). Both character spans are (0, 0) where the tokenizer's decoding of the pieces is not the transcript's
    (a decoder that is not additive) or the episode was recorded without them."""
    prompt: str = ">>> "
    """The prompt shown before this line (">>> " or "... ")."""
    state: str = ""
    """The interpreter state this line was typed in: a hash of the user's variables (names and values) and of the
    block being buffered ("" when unknown: digests off, or the kernel crashed). Lines of a group with equal states
    are compared by the ``state`` advantage estimator."""
    state_values: str = ""
    """The same state without variable names (the multiset of values): ``a = 4175`` and ``total = 4175`` match."""
    digest_ms: float = 0.0
    """Milliseconds the kernel spent digesting the state after this line ran (0 when nothing ran)."""


@dataclass
class Trajectory:
    """One episode: the exact token sequence the policy saw and produced, and everything scored about it."""

    token_ids: list[int]
    loss_mask: list[int]
    """1 exactly on tokens sampled by the policy; 0 on prompt, prompts, interpreter output."""
    logprobs: list[float]
    """Sampler log-probs aligned with token_ids (0.0 where loss_mask is 0)."""
    prompt_len: int
    text: str
    """== tokenizer.decode(token_ids, clean_up_tokenization_spaces=False) (``rollout.decode``)."""
    lines: list[Line] = field(default_factory=list)
    answer: Any = None
    """The value passed to submit(), JSON-friendly, or None."""
    submitted: bool = False
    """Whether a line called submit() (``answer`` may be None: ``submit()``, ``submit(None)``)."""
    correct: bool | None = None
    end_reason: str = ""
    task: str = ""
    row: int = -1
    """Index of the dataset row (problem) this episode was sampled for."""
    sampling: dict[str, Any] = field(default_factory=dict)
    group: int = -1
    """Episodes sampled for the same prompt share a group id (GRPO's group)."""
    policy_step: int = 0
    """The policy version the episode was sampled with (``Generator.version``: the optimizer steps behind the weights,
    0 for the weights a run started from): what a learner checks before training on it."""
    outcome_rewards: dict[str, float] = field(default_factory=dict)
    """Episode-level reward terms, weighted: the final-answer terms (correct / wrong / no_submit) and the reward
    functions of ``rewards.functions`` (by their names)."""
    timing: dict[str, float] = field(default_factory=dict)
    tree_nodes: list[int] = field(default_factory=list)
    """Tree rollouts: the branch points on this leaf's path, as node ids unique within its group, root first (the
    root itself has no id); empty for a flat episode. Episodes that share a node share every token before it."""
    tree_cuts: list[int] = field(default_factory=list)
    """Index into ``lines`` of the first line after each of ``tree_nodes`` (lines before ``tree_cuts[0]`` lead from
    the root to ``tree_nodes[0]``, the last ones from ``tree_nodes[-1]`` to this leaf)."""
    tree_diverged: bool = False
    """A replay on this leaf's path printed something other than the lines it replayed (``random``, time, ``id()``):
    its interpreter state is not its parent's, so the tree estimator gives it no tree credit."""

    @property
    def reward(self) -> float:
        """Total reward: every line term plus the outcome terms."""
        return sum(sum(line.rewards.values()) for line in self.lines) + sum(self.outcome_rewards.values())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["reward"] = self.reward
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def _repr_html_(self) -> str:
        from .viewer import trajectory_html

        return trajectory_html(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        d = dict(d)
        d.pop("reward", None)
        spans = ("token_span", "output_span", "text_span", "output_text_span")
        lines = [Line(**{**ln, **{k: tuple(ln[k]) for k in spans if k in ln}}) for ln in d.pop("lines", [])]
        return cls(lines=lines, **d)
