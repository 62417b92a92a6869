"""The transformers backend's fork: a row branches between two lines, and its new rows start from copies of its KV
cache rows (tree rollouts), instead of prefilling the shared prefix again.

Real tokenizer and tiny models, as in tests/test_backend_hf.py: the forked rows' log-probs equal a plain forward
pass over each row's whole sequence (so the copied cache is exactly what a prefill would have computed), no prefix
token is fed twice, a fork's key names its random stream, and a fork mid-line is refused.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from replrl.backends.base import ForkableSession
from replrl.backends.hf import HFGenerator, _Batch
from replrl.contract import token_masks
from replrl.models import tiny_model
from replrl.types import SamplingParams
from tests.test_backend_hf import Episode, assert_line_rule, biased_tiny, ids_of, recomputed_logprobs


@pytest.fixture(scope="module")
def tok():
    from tests.helpers_models import smollm2_tokenizer

    return smollm2_tokenizer()


def test_forked_cache_rows_give_the_logits_of_a_plain_forward(tok):
    """Row 1 is forked into rows 2 (a new slot: the row dimension grows from 2 to 4) and 3, and its first 5 tokens
    into row 4 (the row dimension doubles to 8); then each of rows 1-4 is fed different tokens. Each row's logits
    equal a plain forward over its prefix and its own tokens."""
    model = tiny_model(tok, seed=3)
    batch = _Batch(model, 2, torch.device("cpu"))
    prefix = ids_of(tok, ">>> x = 41\n>>> x + 1\n42\n>>>")
    seen = {0: ids_of(tok, "a b c"), 1: list(prefix)}
    with torch.inference_mode():
        batch.forward(dict(seen), [0, 1])
        assert batch.fork([(1, [2, 3], None), (1, [4], 5)]) == 2 * len(prefix) + 5
        assert batch.cache.n_rows == 8 and batch.cache.lengths[:5] == [3, *[len(prefix)] * 3, 5]
        with pytest.raises(ValueError, match="cached tokens"):
            batch.fork([(0, [5], 4)])  # row 0 holds 3
        seen |= {2: list(prefix), 3: list(prefix), 4: prefix[:5]}
        for feed in ({1: [11], 2: [12, 13], 3: [14], 4: [20, 21]}, {0: [15], 2: [16], 3: [17, 18, 19], 4: [22]}):
            keep = sorted(feed)
            logits = batch.forward(feed, keep)
            for k, slot in enumerate(keep):
                seen[slot] += feed[slot]
                plain = model(torch.tensor([seen[slot]])).logits[0, -1]
                assert torch.allclose(logits[k], plain, atol=1e-4), (feed, slot)


async def fork_and_continue(session, prompts: list[list[int]], tok, keys: list[int], before: int = 2,
                            after: int = 3) -> tuple[list[Episode], list[int], int]:
    """Rows 0..: ``before`` lines each; then row 0 forks into one row per key, and every row (row 0 and the forks)
    goes on for ``after`` lines. The forks' episodes start as copies of row 0's. Returns the episodes (rows in
    order, then the forks in key order), the fork's rows and row 0's length at the fork."""
    env = ids_of(tok, "7\n>>>")
    eps = [Episode(list(p)) for p in prompts]

    async def lines(i: int, ep: Episode, n: int, pending: list[int]) -> list[int]:
        for _ in range(n):
            line = await session.next_line(i, pending)
            ep.ids += pending
            ep.sampled_at += range(len(ep.ids), len(ep.ids) + len(line.token_ids))
            ep.ids += line.token_ids
            ep.logprobs += line.logprobs
            ep.lines.append(line)
            pending = env
        return pending

    try:
        pending = await asyncio.gather(*(lines(i, ep, before, []) for i, ep in enumerate(eps)))
        assert isinstance(session, ForkableSession)
        rows, at_fork = session.fork(0, keys), len(eps[0].ids)
        forks = [Episode(list(eps[0].ids), list(eps[0].sampled_at), list(eps[0].logprobs), list(eps[0].lines))
                 for _ in keys]
        await asyncio.gather(*(lines(i, ep, after, pending[i]) for i, ep in enumerate(eps)),
                             *(lines(r, ep, after, pending[0]) for r, ep in zip(rows, forks, strict=True)))
        for i in [*range(len(eps)), *rows]:
            session.finish(i)
        return eps + forks, rows, at_fork
    finally:
        await session.aclose()


def test_forked_rows_are_token_exact_and_feed_no_prefix_token_twice(tok):
    model = biased_tiny(tok, {"\n": 9.0, " x": 8.0})
    gen = HFGenerator(model, tok, device="cpu")
    params = SamplingParams(seed=3, temperature=1.0, max_line_tokens=6)
    prompts = [ids_of(tok, f"Task {i}: add 1 + {i}\n>>>") for i in range(2)]
    session = gen.session(prompts, params)
    episodes, rows, at_fork = asyncio.run(fork_and_continue(session, prompts, tok, keys=[101, 102]))
    assert rows == [2, 3]
    banned = token_masks(tok, len(tok))
    for ep in episodes:  # the forks' sequences: row 0's up to the fork, then their own lines
        assert_line_rule(tok, ep)
        recomputed = recomputed_logprobs(model, ep, params, banned)
        assert torch.allclose(torch.tensor(recomputed), torch.tensor(ep.logprobs), atol=1e-4)
    assert episodes[2].ids != episodes[3].ids  # two streams: different samples after the fork
    stats = session.stats
    # row 0's cache held its sequence but its last sampled token at the fork: each fork got those by copy. Every
    # row's cache ends holding its sequence but the last sampled token, so copied + fed = what the four rows hold:
    # no token of the shared prefix was fed twice
    assert stats["forked_rows"] == 2 and stats["forked_tokens"] == 2 * (at_fork - 1)
    assert stats["forked_tokens"] + stats["fed_tokens"] == sum(len(ep.ids) - 1 for ep in episodes)


def test_a_fork_key_names_the_random_stream(tok):
    """The fork made with key 7 samples the same lines whichever order the keys come in, and whatever else runs."""
    model = biased_tiny(tok, {"\n": 9.0, " x": 8.0})
    gen = HFGenerator(model, tok, device="cpu")
    params = SamplingParams(seed=5, temperature=1.0, max_line_tokens=6)
    prompts = [ids_of(tok, "Task: add 2 + 2\n>>>")]

    def forked(keys: list[int]) -> dict[int, list[int]]:
        eps, _, _ = asyncio.run(fork_and_continue(gen.session(prompts, params), prompts, tok, keys))
        return {k: ep.ids for k, ep in zip(keys, eps[1:], strict=True)}

    a, b = forked([7, 8]), forked([9, 7])
    assert a[7] == b[7] and a[8] != a[7] and b[9] != b[7]


def test_fork_between_lines_only(tok):
    model = biased_tiny(tok, {" x": 40.0})  # lines never end by themselves: row 0's line is still running
    gen = HFGenerator(model, tok, device="cpu")

    async def main():
        session = gen.session([ids_of(tok, ">>>")] * 2, SamplingParams(max_line_tokens=96))
        await session.next_line(1, [])
        session.finish(1)
        with pytest.raises(ValueError):
            session.fork(1, [3])
        pending = asyncio.create_task(session.next_line(0, []))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="between two lines"):
            session.fork(0, [3])
        await session.aclose()
        await asyncio.gather(pending, return_exceptions=True)
        with pytest.raises(RuntimeError, match="closed"):
            session.fork(0, [3])

    asyncio.run(main())
