"""Moved to ``replrl/rollout/tree.py`` (and its figures' merge to ``replrl/rollout/stats.py``); this name keeps the old
import path working: ``from replrl.tree import TreeShape`` is ``from replrl.rollout import TreeShape``."""

from __future__ import annotations

from .rollout.stats import TREE_RATIOS, merge_tree_figures
from .rollout.tree import TreeShape, branch_line, children_per_node, stream_key, tree_rollout

__all__ = ["TREE_RATIOS", "TreeShape", "branch_line", "children_per_node", "merge_tree_figures", "stream_key",
           "tree_rollout"]
