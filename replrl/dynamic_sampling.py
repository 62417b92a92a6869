"""Dynamic sampling (DAPO's; verl's ``algorithm.filter_groups``): groups with nothing to learn are replaced before
the update.

A group-relative advantage is zero on every episode of a group whose rewards are all equal (all wrong, all right):
such a group costs a full rollout and teaches nothing. With ``rollout.dynamic_sampling`` a step draws problems in
waves of ``problems_per_step`` until it holds ``problems_per_step`` groups with a contrast, or the bound on extra
waves is spent, and trains on those. The decision is a small function over a group's rewards (``has_contrast``), so
any group shape plugs in: GRPO's episodes of one problem, or the leaves of a tree (``tree.branch_at``: a tree whose
leaves all got the same reward has nothing to teach either).

A tree group can hold fewer leaves than ``group_size`` (every episode ended before its last branch point). Such a
group is judged like any other, on the leaves it has, and kept with its real leaf count when they differ: the
estimators normalise within a group of any size and the loss averages over whatever episodes a batch holds, so it
trains as an ordinary, smaller GRPO group. (A group of one leaf compares with nothing: never a contrast.) The figures
count the episodes a group really has (``WaveRecord.episodes``).

``replrl/draw.py`` runs the waves (with the problem stream and the sampler, each rank on its own share, and merges
every rank's waves for the learner's agreement: ``merge_waves``); this module holds the pure
parts: which reward is compared (``CONTRAST_SIGNALS``), whether a group has a contrast, which groups a step keeps,
and the step's figures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .configlib import check_choice
from .types import Trajectory

CONTRAST_TOL = 1e-6
"""Rewards closer than this count as equal (float sums of the same terms can differ in the last bit, and a
std-scaled advantage would blow such a residue up into a full-size signal)."""

WAVE_SEED_STRIDE = 1_000_000_007
"""Wave w of a step samples with the step's seed + w * this (wave 0 uses the step's own seed, as without dynamic
sampling), far from the seeds of other steps."""

Signal = Callable[[Trajectory], float]

CONTRAST_SIGNALS: dict[str, Signal] = {}
"""Per-episode values compared within a group, by name (``rollout.dynamic_sampling_signal``)."""


def contrast_signal(name: str) -> Callable[[Signal], Signal]:
    """Register ``fn(trajectory) -> float`` as a signal named ``name`` (a later one replaces it)."""

    def register(fn: Signal) -> Signal:
        CONTRAST_SIGNALS[name] = fn
        return fn

    return register


@contrast_signal("outcome")
def outcome_signal(traj: Trajectory) -> float:
    """The final-answer terms (correct, wrong, no_submit): a group of all-wrong answers has no contrast."""
    return sum(traj.outcome_rewards.values())


@contrast_signal("reward")
def reward_signal(traj: Trajectory) -> float:
    """The episode's total reward, per-line terms included (what the outcome estimator normalises)."""
    return traj.reward


def check_signal(name: str) -> None:
    """A ConfigError (one line) unless ``name`` is a registered signal (``rollout.dynamic_sampling_signal``): checked
    when the run starts (the Trainer's set-up), where the registry, a user's signals included, is complete."""
    check_choice("rollout.dynamic_sampling_signal", name, tuple(CONTRAST_SIGNALS))


def has_contrast(rewards: Sequence[float], tol: float = CONTRAST_TOL) -> bool:
    """Whether a group's rewards are not all equal, the only case where a group-relative advantage moves anything.
    ``rewards``: one value per episode of the group (or per leaf of a tree)."""
    return len(rewards) > 1 and max(rewards) - min(rewards) > tol


def group_has_contrast(group: Sequence[Trajectory], signal: str = "outcome") -> bool:
    """``has_contrast`` over one group's episodes, comparing the named signal."""
    fn = CONTRAST_SIGNALS[signal]
    return has_contrast([fn(t) for t in group])


def select_groups(contrast: Sequence[bool], want: int, at_least: int = 1) -> list[int]:
    """Indices (in the order drawn) of the groups a step trains on: the first ``want`` with a contrast. When fewer
    than ``at_least`` have one (the bound was reached), the earliest groups without one top the set up to
    ``at_least`` (each process must hold a group; a group without contrast adds no gradient)."""
    kept = [i for i, c in enumerate(contrast) if c][:want]
    if len(kept) < at_least:
        kept += [i for i, c in enumerate(contrast) if not c][:at_least - len(kept)]
    return sorted(kept)


@dataclass
class WaveRecord:
    """One wave of a step (one rank's, or every rank's merged by ``draw.merge_waves``): its groups' contrast flags, its
    rollout wall time, and each group's episodes (``group_size`` for flat groups; a tree's leaves, fewer when it fell
    short)."""

    contrast: list[bool]
    wall_s: float
    episodes: list[int]


def screening_wave(problems_per_step: int, group_size: int, probe: int) -> int:
    """Problems a wave draws: ``problems_per_step``, or with a probe (``rollout.dynamic_sampling_probe``) as many as
    the same episodes screen, ``problems_per_step * group_size // probe``."""
    return max(problems_per_step, problems_per_step * group_size // probe) if probe else problems_per_step


def wave_metrics(waves: Sequence[WaveRecord], kept: Sequence[int], group_size: int,
                 bound_reached: bool, completion: dict[int, int] | None = None,
                 completion_s: float = 0.0) -> dict[str, float]:
    """The step's figures (``dynsamp/...``). ``kept``: indices of the groups trained on, over all waves in order.
    A wave's groups run at once, so its rollout time is shared by its episodes (equally by its groups when they are
    all whole): the time spent on discarded groups is each wave's wall time times the share of its episodes the step
    did not keep. ``group_size``: what a whole group holds (kept groups with fewer episodes are counted).
    ``completion`` (screening, ``rollout.dynamic_sampling_probe``; None without it): episodes added to a kept group
    after its probe, by group index, in ``completion_s`` of rollout; they count among the episodes per kept group
    (``dynsamp/screened_episodes`` are the probes' alone)."""
    flags = [c for w in waves for c in w.contrast]
    sizes = [n for w in waves for n in w.episodes]
    screened = sum(sizes)
    sizes = [n + (completion or {}).get(i, 0) for i, n in enumerate(sizes)]
    kept_set, start, discarded_s = set(kept), 0, 0.0
    for w in waves:
        n = len(w.contrast)
        dropped = sum(w.episodes[i - start] for i in range(start, start + n) if i not in kept_set)
        discarded_s += w.wall_s * dropped / max(sum(w.episodes), 1)
        start += n
    kept_contrast = [i for i in kept if flags[i]]
    out = {"dynsamp/waves": float(len(waves)), "dynsamp/groups_drawn": float(len(flags)),
           "dynsamp/groups_kept": float(len(kept_contrast)), "dynsamp/discarded_rollout_s": discarded_s,
           "dynsamp/bound_reached": float(bound_reached),
           "dynsamp/short_groups_kept": float(sum(sizes[i] < group_size for i in kept_contrast))}
    if kept_contrast:  # absent when nothing was kept: episodes per nothing is not a number
        out["dynsamp/episodes_per_kept_group"] = sum(sizes) / len(kept_contrast)
    if completion is not None:
        out.update({"dynsamp/screened_episodes": float(screened), "dynsamp/completion_s": completion_s})
    return out

