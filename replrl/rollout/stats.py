"""Rollout figures: wall-clock accounting (``RolloutStats``), the per-line and per-episode statistics a step logs
(``summarize``), how often interpreter states repeat within a group (``state_stats``), and the merges of several
rollouts' figures into one (a step's waves: ``merge_wave_stats``; every rank's trees: ``merge_tree_figures``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from ..rewards import SYNTAX_ERRORS
from ..types import Trajectory


@dataclass
class RolloutStats:
    """Wall-clock accounting of one rollout call."""

    wall_s: float = 0.0
    generation_s: float = 0.0
    """Wall time the backend spent in forward passes and sampling."""
    execution_s: float = 0.0
    """Kernel time summed over lines (overlaps with generation: episodes execute while others generate)."""
    model_tokens: int = 0
    env_tokens: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, float]:
        return {**{k: v for k, v in asdict(self).items() if k != "extra"}, **self.extra}

    def merge(self, other: RolloutStats) -> RolloutStats:
        """Two consecutive rollouts as one (times and counts add up)."""
        extra = {k: self.extra.get(k, 0.0) + other.extra.get(k, 0.0) for k in {*self.extra, *other.extra}}
        return RolloutStats(self.wall_s + other.wall_s, self.generation_s + other.generation_s,
                            self.execution_s + other.execution_s, self.model_tokens + other.model_tokens,
                            self.env_tokens + other.env_tokens, extra)


def used_block(traj: Trajectory) -> bool:
    """Whether the episode wrote a statement over several lines: code after a ``...`` prompt (a loop's or a
    function's body on its own line, a bracket continued). A one-line ``for x in xs: s += x`` and the blank line
    that closes it do not count."""
    return any(ln.prompt.startswith("...") and ln.code.strip() for ln in traj.lines)


def summarize(trajs: Sequence[Trajectory], stats: RolloutStats | None = None) -> dict[str, float]:
    """Per-line and per-episode statistics of a set of episodes (the numbers `replrl rollout` and training log)."""
    n = max(len(trajs), 1)
    lines = [ln for t in trajs for ln in t.lines if ln.status != "incomplete"]
    n_lines = max(len(lines), 1)
    out: dict[str, float] = {
        "episodes": len(trajs),
        "reward_mean": sum(t.reward for t in trajs) / n,
        "accuracy": sum(bool(t.correct) for t in trajs) / n,
        "submit_rate": sum(t.submitted for t in trajs) / n,
        "eof_line_ran": sum(t.end_reason == "eos" and bool(t.lines) and t.lines[-1].status != "incomplete"
                            for t in trajs) / n,
        "lines_per_episode": sum(len(t.lines) for t in trajs) / n,
        "syntax_error_rate": sum(ln.status == "error" and ln.error_name in SYNTAX_ERRORS for ln in lines) / n_lines,
        "exception_rate": sum(ln.status == "error" and ln.error_name not in SYNTAX_ERRORS for ln in lines) / n_lines,
        "timeout_rate": sum(ln.status == "timeout" for ln in lines) / n_lines,
        "crash_rate": sum(ln.status == "crashed" for ln in lines) / n_lines,
        "model_tokens_per_episode": sum(sum(t.loss_mask) for t in trajs) / n,
        "env_tokens_per_episode": sum(len(t.token_ids) - t.prompt_len - sum(t.loss_mask) for t in trajs) / n,
    }
    correct = [t for t in trajs if t.correct]
    out["block_rate"] = sum(map(used_block, trajs)) / n
    if correct:  # absent when nothing was right: a fraction of nothing is not 0
        out["correct_block_frac"] = sum(map(used_block, correct)) / len(correct)
    opened = [t for t in trajs if any(ln.prompt.startswith("...") for ln in t.lines)]
    if opened:  # the REPL's block rule: a SyntaxError at a "..." prompt (a statement typed before the blank line)
        out["block_syntax_error_frac"] = sum(any(ln.prompt.startswith("...") and ln.status == "error"
                                                 and ln.error_name in SYNTAX_ERRORS for ln in t.lines)
                                             for t in opened) / len(opened)
    rewards = [t.reward for t in trajs]
    mean = out["reward_mean"]
    out["reward_std"] = (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5
    terms: dict[str, float] = {}
    for t in trajs:
        for ln in t.lines:
            for k, v in ln.rewards.items():
                terms[k] = terms.get(k, 0.0) + v
        for k, v in t.outcome_rewards.items():
            terms[k] = terms.get(k, 0.0) + v
    out.update({f"reward/{k}": v / n for k, v in sorted(terms.items())})
    reasons: dict[str, int] = {}
    for t in trajs:
        reasons[t.end_reason] = reasons.get(t.end_reason, 0) + 1
    out.update({f"end/{k}": v / n for k, v in sorted(reasons.items())})
    out.update(state_stats(trajs))
    if stats is not None:
        out.update({k: v for k, v in stats.extra.items() if k.startswith("tree/")})
        out.update(speculation_stats(stats.extra))
        out.update({
            "wall_s": stats.wall_s, "generation_s": stats.generation_s, "execution_s": stats.execution_s,
            "other_s": max(stats.wall_s - stats.generation_s, 0.0),
            "setup_s": stats.extra.get("setup_s", 0.0),  # the tasks' setup, summed over episodes (not execution_s)
            "tokens_per_s": stats.model_tokens / max(stats.wall_s, 1e-9),
        })
        out.update(line_timing(stats.extra))
    return out


def speculation_stats(extra: dict[str, float]) -> dict[str, float]:
    """With speculation on (``EpisodeRules.speculate``): ``rollout/speculated_lines``, the lines whose successor
    was sampled while they ran, and ``rollout/speculation_hit_rate``, the share of those whose successor was kept
    (absent when none was speculated). Empty with speculation off."""
    if "speculated_lines" not in extra:
        return {}
    n = extra["speculated_lines"]
    out = {"rollout/speculated_lines": n}
    if n:
        out["rollout/speculation_hit_rate"] = extra.get("speculation_hits", 0.0) / n
    return out


def line_timing(extra: dict[str, float]) -> dict[str, float]:
    """Where a line's time went in the engine, from a session's counters (the vLLM backend's ``timing`` and
    ``stats``, summed over the rollout): ``time/line_ms``, from a line's input to its last token; with per-token
    outputs ``time/line_first_token_ms``, to its first token, and ``time/line_token_ms``, per later token (the
    engine's step as a row sees it); ``gen/context_reuse``, the share of line requests' transcripts not computed
    again. Empty for a backend without them."""
    out: dict[str, float] = {}
    if extra.get("gen_lines") and extra.get("gen_line_s"):
        out["time/line_ms"] = 1000 * extra["gen_line_s"] / extra["gen_lines"]
    if extra.get("gen_lines") and extra.get("gen_first_token_s"):
        out["time/line_first_token_ms"] = 1000 * extra["gen_first_token_s"] / extra["gen_lines"]
    if extra.get("gen_later_tokens"):
        out["time/line_token_ms"] = 1000 * extra.get("gen_later_tokens_s", 0.0) / extra["gen_later_tokens"]
    if extra.get("gen_prompt_tokens"):
        out["gen/context_reuse"] = extra.get("gen_cached_tokens", 0.0) / extra["gen_prompt_tokens"]
    return out


SLOW_DIGEST_MS = 2.0
"""A digest slower than this counts in ``state/slow_digest_frac``."""


def state_stats(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """How often states repeat in a batch, for each digest (``state``: with names; ``values``: without).

    ``state/repeat_frac[_values]``: the share of lines after the first of an episode whose start state another
    episode of the group (same row and group id: ranks number groups alike) also reached.
    ``state/step_groups[_values]``: the number of such shared (group, state) pairs (the first line's state, shared by
    construction, is in neither). ``state/fresh_frac``: the share of lines after the first typed in the fresh kernel's
    state (nothing assigned yet: every earlier line failed, printed or only looked), which is always shared with the
    group's first lines; ``repeat_frac - fresh_frac`` is the share that met another episode in a state of its making.
    ``state/digest_ms_mean``, ``state/digest_ms_max``, ``state/slow_digest_frac`` (executed lines whose digest took
    more than ``SLOW_DIGEST_MS``). Empty when no line has a state (digests off).
    """
    lines = [((tr.row, tr.group), i, k, ln) for i, tr in enumerate(trajectories) for k, ln in enumerate(tr.lines)]
    if not any(ln.state for *_, ln in lines):
        return {}
    out: dict[str, float] = {}
    for suffix, key in (("", "state"), ("_values", "state_values")):
        episodes: dict[tuple[tuple[int, int], str], set[int]] = {}
        for g, i, _, ln in lines:
            if getattr(ln, key):
                episodes.setdefault((g, getattr(ln, key)), set()).add(i)
        later = [(g, ln) for g, _, k, ln in lines if k > 0 and getattr(ln, key)]
        out[f"state/repeat_frac{suffix}"] = (sum(len(episodes[(g, getattr(ln, key))]) > 1 for g, ln in later)
                                             / max(len(later), 1))
        firsts = {(g, getattr(ln, key)) for g, _, k, ln in lines if k == 0}
        if key == "state":
            out["state/fresh_frac"] = sum((g, ln.state) in firsts for g, ln in later) / max(len(later), 1)
        out[f"state/step_groups{suffix}"] = float(sum(len(e) > 1 and gs not in firsts for gs, e in episodes.items()))
    ran = [ln.digest_ms for *_, ln in lines if ln.digest_ms > 0]
    if ran:
        out.update({"state/digest_ms_mean": sum(ran) / len(ran), "state/digest_ms_max": max(ran),
                    "state/slow_digest_frac": sum(ms > SLOW_DIGEST_MS for ms in ran) / len(ran)})
    return out


TREE_RATIOS = {  # each tree/ ratio and the count it is a mean over (the rest of tree/ are counts)
    "tree/generated_tokens_per_leaf": "tree/leaves", "tree/leaf_tokens_per_leaf": "tree/leaves",
    "tree/replay_ms_per_line": "tree/replayed_lines", "tree/cut_lines_back": "tree/branch_points",
}


def merge_tree_figures(parts: Sequence[tuple[dict[str, float], int]]) -> dict[str, float]:
    """The ``tree/`` figures of several rollouts (a step's waves, or every rank's share of a step) as one rollout's:
    ``parts`` holds each rollout's figures and its leaves. Counts add up; each ratio is the mean weighted by the count
    it is over (``TREE_RATIOS``: leaves, replayed lines, branch points; a rollout that logged no replayed lines is
    weighted by its replays), and generated against held tokens is recomputed from the summed tokens."""
    parts = [({k: v for k, v in extra.items() if k.startswith("tree/")}, leaves) for extra, leaves in parts]
    if not any(extra for extra, _ in parts):
        return {}
    weights = [{**extra, "tree/leaves": leaves,
                "tree/replayed_lines": extra.get("tree/replayed_lines", extra.get("tree/replays", 0.0))}
               for extra, leaves in parts]
    keys = {k for extra, _ in parts for k in extra}
    out = {k: float(sum(extra.get(k, 0.0) for extra, _ in parts)) for k in keys if k not in TREE_RATIOS}
    out["tree/leaves"] = float(sum(leaves for _, leaves in parts))
    for k, over in TREE_RATIOS.items():
        if k in keys:
            total = sum(w[over] for w in weights)
            summed = sum(extra.get(k, 0.0) * w[over] for (extra, _), w in zip(parts, weights))
            out[k] = summed / total if total else 0.0
    if "tree/generated_vs_leaf_tokens" in keys:
        generated = out.get("tree/generated_tokens_per_leaf", 0.0) * out["tree/leaves"]
        held = out.get("tree/leaf_tokens_per_leaf", 0.0) * out["tree/leaves"]
        out["tree/generated_vs_leaf_tokens"] = generated / held if held else 0.0
    return out


def merge_wave_stats(waves: Sequence[tuple[RolloutStats, int]]) -> RolloutStats:
    """The rollout statistics of a step's waves, ``(stats, episodes)`` each, as one rollout's: times and counts add
    up, the backends' maxima (``gen_max_*``) take the largest, and the tree's figures are merged by
    ``merge_tree_figures`` (counts summed, ratios weighted by what they are a mean over)."""
    out = RolloutStats()
    for stats, _ in waves:
        out = out.merge(stats)
    extra = out.extra
    for k in extra:
        if k.startswith("gen_max_"):
            extra[k] = max(s.extra.get(k, 0.0) for s, _ in waves)
    extra.update(merge_tree_figures([(s.extra, n) for s, n in waves]))
    return out
