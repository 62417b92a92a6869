"""Moved to ``replrl/rollout/stats.py``; this name keeps the old import path working."""

from __future__ import annotations

from .rollout.stats import SLOW_DIGEST_MS, state_stats

__all__ = ["SLOW_DIGEST_MS", "state_stats"]
