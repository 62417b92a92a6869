"""Tree rollouts on the vLLM backend: the leaves hold the invariants the flat episodes hold (tests/test_rollout.py
checks them on the HF backend), and vLLM's prefix cache serves the children's shared prefixes.

Real vLLM engine (CPU build, the second environment of .ci/vllm_env.sh), real sandboxed kernels, and a tiny Llama
(head_dim 64: vLLM's CPU attention has no kernel for smaller heads) that memorised two scripts (tests/scripted.py):
``many`` runs long enough to branch after lines 2 and 4, ``wrong`` submits at line 1, before the first branch point.
The same engine plays a flat group and a tree, and the same checks run on both: token-exact ids and masks, the
sampler's log-probs equal to the trainer's recomputation (``loss.token_logprobs``, the tolerance of
tests/test_backend_vllm.py). The engine logs its statistics here, so vLLM's own prefix-cache counters tell how many
prompt tokens of the children's first requests it found computed.
"""

from __future__ import annotations

import pytest

vllm_backend = pytest.importorskip(
    "replrl.backends.vllm", reason="vllm is not importable here (CPU: bash .ci/vllm_env.sh runs these tests)",
    exc_type=ImportError,
)

import torch  # noqa: E402

from replrl.config import RewardConfig  # noqa: E402
from replrl.contract import token_masks  # noqa: E402
from replrl.loss import token_logprobs  # noqa: E402
from replrl.models import load_tokenizer, tiny_model  # noqa: E402
from replrl.rewards import RewardModel  # noqa: E402
from replrl.rollout import (  # noqa: E402
    Env,
    EpisodeRules,
    TreeShape,
    build_prompt,
    decode,
    line_text,
    rollout,
    summarize,
)
from replrl.types import SamplingParams, Trajectory  # noqa: E402
from sandbox import KernelPool, Limits, run_sync  # noqa: E402
from tests.scripted import SCRIPTS, ScriptTask, script_sequences, teach_scripts  # noqa: E402
from tests.test_backend_vllm import ATOL, NO_COMPILE  # noqa: E402

pytestmark = pytest.mark.timeout(900)
TREE = TreeShape(roots=2, branch_at=(2, 4), width=2)
TASK = ScriptTask({name: SCRIPTS[name] for name in ("many", "wrong")})
RULES = EpisodeRules(max_output_tokens=40, max_repeats=3, state_digest=False, max_lines=8, max_total_tokens=400)
SAMPLING = SamplingParams(temperature=0.3, max_line_tokens=20, seed=1)
BLOCK = 32
"""The engine's KV block on the CPU (replrl/backends/vllm/engine.py): the prefix cache finds prompts in whole
blocks."""


@pytest.fixture(scope="module")
def pool():
    p = run_sync(KernelPool(size=4, limits=Limits(wall_s=1.0, interrupt_grace_s=1.0), tools=["submit"]).start())
    yield p
    run_sync(p.close())


@pytest.fixture(scope="module")
def scripted(pool):
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    model = tiny_model(tokenizer, seed=1, hidden_size=128, intermediate_size=256, head_dim=64)
    teach_scripts(model, tokenizer, script_sequences(tokenizer, pool, RULES.max_output_tokens, TASK))
    return model, tokenizer


@pytest.fixture(scope="module")
def engine(scripted):
    model, tokenizer = scripted
    gen = vllm_backend.VLLMGenerator(model, tokenizer, max_model_len=1024, kv_cache_gib=0.5,
                                     engine_args={"disable_log_stats": False,  # the prefix-cache counters below
                                                  **NO_COMPILE})
    yield gen
    gen.close()


def prefix_cache_counters() -> tuple[int, int]:
    """vLLM's prefix-cache counters so far (every engine of this process): (prompt tokens of fresh requests looked
    up, of which found computed). A row's later lines continue its request and are not looked up again."""
    from vllm.v1.metrics.reader import Counter, get_metrics_snapshot

    got = {"vllm:prefix_cache_queries": 0, "vllm:prefix_cache_hits": 0}
    for m in get_metrics_snapshot():
        if isinstance(m, Counter) and m.name in got:
            got[m.name] += m.value
    return got["vllm:prefix_cache_queries"], got["vllm:prefix_cache_hits"]


def play(engine, pool, tree: TreeShape | None, group_size: int = 1) -> tuple[list[Trajectory], dict, int, int]:
    """(episodes, summary, prefix-cache lookups, hits) of one rollout over TASK's rows on the engine."""
    rows = list(enumerate(TASK.rows("train")))
    before = prefix_cache_counters()
    env = Env(engine, pool, TASK, RULES, RewardModel(RewardConfig().weights), chat_template=False)
    trajs, stats = run_sync(rollout(env, rows, SAMPLING, group_size=group_size, tree=tree))
    engine.call(_settle())  # the engine's last step's statistics are recorded after its outputs
    after = prefix_cache_counters()
    return trajs, summarize(trajs, stats), after[0] - before[0], after[1] - before[1]


async def _settle() -> None:
    import asyncio

    await asyncio.sleep(0.2)


@pytest.fixture(scope="module")
def flat(engine, pool):
    return play(engine, pool, None, group_size=2)


@pytest.fixture(scope="module")
def tree(engine, pool):
    return play(engine, pool, TREE)


def by_script(trajs: list[Trajectory]) -> dict[str, list[Trajectory]]:
    rows = TASK.rows("train")
    out: dict[str, list[Trajectory]] = {}
    for t in trajs:
        out.setdefault(rows[t.group]["script"], []).append(t)
    return out


@pytest.fixture(params=["flat", "tree leaves"])
def named_episodes(request) -> list[tuple[str, Trajectory]]:
    """The flat episodes, then the tree leaves: the checks below hold for both."""
    trajs = request.getfixturevalue("flat" if request.param == "flat" else "tree")[0]
    return [(name, t) for name, ts in by_script(trajs).items() for t in ts]


def test_the_engine_caches_prefixes(engine):
    assert engine.engine.vllm_config.cache_config.enable_prefix_caching


def test_token_exact_splicing_and_masks(scripted, named_episodes):
    _, tokenizer = scripted
    for name, t in named_episodes:
        assert decode(tokenizer, t.token_ids) == t.text, name
        prompt = build_prompt(tokenizer, f"Run script {name}.", chat_template=False)
        assert decode(tokenizer, t.token_ids[:t.prompt_len]) == prompt
        assert len(t.token_ids) == len(t.loss_mask) == len(t.logprobs)
        sampled = {i for line in t.lines for i in range(*line.token_span)}
        assert {i for i, m in enumerate(t.loss_mask) if m} == sampled, name  # loss on sampled tokens, nowhere else
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if not m)
        for line in t.lines:
            text = decode(tokenizer, t.token_ids[slice(*line.token_span)])
            assert text == line_text(line.code), (name, text)  # " " (healed prompt) + code + "\n"
        assert [ln.code for ln in t.lines] == TASK.scripts[name][:len(t.lines)], name  # the memorised script


def test_sampler_logprobs_equal_the_trainers_recomputation(scripted, named_episodes):
    model, tokenizer = scripted
    masks = token_masks(tokenizer, model.get_output_embeddings().weight.shape[0])
    for name, t in named_episodes:
        ids = torch.tensor([t.token_ids])                                              # [1, T]
        loss_mask = torch.tensor(t.loss_mask, dtype=torch.bool)                        # [T]
        with torch.no_grad():
            logp = token_logprobs(model, ids, torch.ones_like(ids), SAMPLING, masks, loss_mask[None].long())[0]
        torch.testing.assert_close(logp[loss_mask], torch.tensor(t.logprobs)[loss_mask], atol=ATOL, rtol=0), name


def test_flat_group_is_as_many_independent_episodes(flat):
    episodes = by_script(flat[0])
    assert {name: len(ts) for name, ts in episodes.items()} == {"many": 2, "wrong": 2}
    assert all(t.tree_nodes == [] for ts in episodes.values() for t in ts)


def test_tree_has_the_shapes_leaves_and_the_early_end_is_a_leaf(tree):
    trajs, metrics, _, _ = tree
    leaves = by_script(trajs)
    many, wrong = leaves["many"], leaves["wrong"]
    assert len(many) == TREE.leaves == 8
    assert all(len(t.tree_nodes) == 2 and t.tree_cuts == [2, 4] and not t.tree_diverged for t in many)
    assert len({t.tree_nodes[0] for t in many}) == 2 and len({tuple(t.tree_nodes) for t in many}) == 4
    assert all(t.end_reason == "submit" and t.correct for t in many)  # submit(a), a == 1
    # `wrong` submitted at line 1, before the first branch point: its 2 roots are its leaves (6 short, logged)
    assert len(wrong) == 2 and all(t.tree_nodes == [] and len(t.lines) == 1 and t.correct is False for t in wrong)
    assert metrics["tree/leaf_shortfall"] == 6
    assert metrics["tree/branch_points"] == 2 + 4 and metrics["tree/replays"] == 2 + 4
    assert metrics["tree/replays_diverged"] == 0
    # the shared prefixes were sampled once: 2 roots x lines 1-2, 4 nodes x lines 3-4, 8 leaves x lines 5-7
    held = sum(sum(t.loss_mask) for t in many)
    line_tokens = [len(range(*ln.token_span)) for ln in many[0].lines]
    assert all([len(range(*ln.token_span)) for ln in t.lines] == line_tokens for t in many)
    expected = 2 * sum(line_tokens[:2]) + 4 * sum(line_tokens[2:4]) + 8 * sum(line_tokens[4:])
    generated = metrics["tree/generated_vs_leaf_tokens"] * (held + sum(sum(t.loss_mask) for t in wrong))
    assert round(generated) == expected + sum(sum(t.loss_mask) for t in wrong)


def test_children_continue_their_parents_ids(tree):
    """A leaf's ids, masks and log-probs are its ancestors' up to each branch point, then its own (sampled by vLLM
    in a later level's session from the parent's ids as a prompt)."""
    many = by_script(tree[0])["many"]
    for a in many:
        for b in many:
            shared = sum(x == y for x, y in zip(a.tree_nodes, b.tree_nodes, strict=True))  # nodes in common
            if shared:
                cut = a.lines[a.tree_cuts[shared - 1]].token_span[0]  # the first token after the branch point
                assert cut == b.lines[b.tree_cuts[shared - 1]].token_span[0]
                assert a.token_ids[:cut] == b.token_ids[:cut]
                assert a.loss_mask[:cut] == b.loss_mask[:cut] and a.logprobs[:cut] == b.logprobs[:cut]


def test_the_prefix_cache_serves_the_childrens_shared_prefixes(tree, flat):
    """Each row of a later level starts a fresh vLLM request whose prompt is its parent's ids at the branch point.
    The parent's request computed every one of those tokens but the last line's last (sampled, never fed) and the
    interpreter's reply after it, so at least the whole blocks before that token are found in the prefix cache."""
    trajs, _, lookups, hits = tree
    many = by_script(trajs)["many"]
    at_least = 0
    for level, cut in enumerate(TREE.branch_at, start=1):
        # the rows of the level after branch point `level`: one per node of the next branch point, or per leaf
        rows = {t.tree_nodes[level]: t for t in many} if level < len(TREE.branch_at) else dict(enumerate(many))
        for t in rows.values():
            computed = t.lines[cut - 1].token_span[1] - 1  # the parent's tokens that went through the model
            at_least += computed // BLOCK * BLOCK
    assert len(many) == 8 and at_least > 0
    assert hits >= at_least, (hits, at_least)
    # the flat group: the second episode of each problem may find the first's prompt; nothing else is looked up
    flat_lookups = sum(t.prompt_len for t in flat[0])
    assert flat[2] == flat_lookups and flat[3] <= flat_lookups // 2
    assert lookups > flat_lookups and hits / lookups > 0.5
