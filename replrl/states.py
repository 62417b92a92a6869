"""How often the interpreter states that lines start from repeat within a group (logged every step)."""

from __future__ import annotations

from collections.abc import Sequence

from .types import Trajectory

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
