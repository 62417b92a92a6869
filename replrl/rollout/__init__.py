"""The episode's wing, its files in the order a line walks them:

    env.py         Env (generator, pool, task, rules, rewards: frozen); EpisodeRules, every episode limit (lines,
                   tokens, output, repeats); open_env(cfg): an Env from the config, closing what it opened
    transcript.py  the splice, text <-> ids: prompt, heal, encode/decode, the interpreter's tokens
    episode.py     THE loop: generate a line -> execute it -> splice the output -> repeat
    tree.py        groups whose episodes branch at line boundaries
    groups.py      rollout(env, rows, sampling): a group per problem, flat or a tree, episode functions scored
                   once; split_by_group; rollout_in_waves
    stats.py       rollout figures: RolloutStats, summarize, state_stats, the merges of waves' and ranks' figures

This face is the wing's one import path: ``from replrl.rollout import rollout, EpisodeRules, build_prompt, ...``.
"""

from __future__ import annotations

from .env import Env, EpisodeRules, open_env
from .episode import SUBMIT, Episode, finish_episode, play, run_episode, run_setup
from .groups import flat_rollout, rollout, rollout_in_waves, split_by_group
from .stats import (
    SLOW_DIGEST_MS,
    TREE_RATIOS,
    RolloutStats,
    line_timing,
    merge_tree_figures,
    merge_wave_stats,
    speculation_stats,
    state_stats,
    summarize,
    used_block,
)
from .transcript import EnvSplice, build_prompt, code_of, decode, encode, env_splice, env_token_ids, heal, line_text
from .tree import TreeShape, branch_line, children_per_node, stream_key, tree_rollout

__all__ = [
    "SLOW_DIGEST_MS", "SUBMIT", "TREE_RATIOS", "Env", "EnvSplice", "Episode", "EpisodeRules", "RolloutStats",
    "TreeShape", "branch_line", "build_prompt", "children_per_node", "code_of", "decode", "encode", "env_splice",
    "env_token_ids",
    "finish_episode", "flat_rollout", "heal", "line_text", "line_timing", "merge_tree_figures", "merge_wave_stats",
    "open_env", "play", "rollout", "rollout_in_waves", "run_episode", "run_setup", "speculation_stats",
    "split_by_group", "state_stats", "stream_key", "summarize", "tree_rollout", "used_block",
]
