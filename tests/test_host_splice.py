"""A line's output tokenized in its kernel host (``replrl.rollout.host_splice``, issue 65): the tokens the episode
takes from a host are exactly those its own ``env_splice`` gives, for every kind of output a REPL shows; where they
cannot be (a cut output, a block still open) the episode tokenizes itself; data a host forges is refused."""

from __future__ import annotations

import dataclasses

import pytest

from replrl.models import load_tokenizer
from replrl.repl import PS1, PS2, ReplSession, ReplStep
from replrl.rollout.host_splice import digest, post_spec, take
from replrl.rollout.transcript import env_splice
from sandbox import ExecResult, Limits, run_sync
from sandbox.hosts import HostedPool

MAX_OUTPUT_TOKENS = 48
LINES = [  # (line, whether the host's tokens are the ones taken)
    ("x = 21", True),                             # nothing printed: the prompt alone
    ("x * 2", True),
    ("print('\u00e9\u4e2d\u6587 \\U0001f600\\t<|im_end|>')", True),  # non-ASCII, a special token's text
    ("1/0", True),                                # a traceback
    ("for i in range(2):", False),                # a block opens: `...`, nothing ran
    ("    print(i)", False),
    ("", True),                                   # the blank line runs the block
    ("print('word ' * 400)", False),              # past max_output_tokens: cut here, with the marker
    ("import os; os._exit(3)", True),             # the kernel died: the restart's words
]


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_a_hosts_tokens_are_the_episodes_own(name):
    tok = load_tokenizer(name)
    spec = post_spec(tok)
    assert spec is not None

    async def go() -> list[ReplStep]:
        async with HostedPool(size=1, limits=Limits(wall_s=5.0, uid_base=460_000), hosts=1, post=spec) as pool:
            async with pool.acquire() as kernel:
                session = ReplSession(kernel, banner="")
                return [await session.feed(line) for line, _ in LINES]

    steps = run_sync(go())
    for (line, hosted), step in zip(LINES, steps, strict=True):
        mine = env_splice(tok, step.output, step.next_prompt, MAX_OUTPUT_TOKENS)
        theirs = take(step, MAX_OUTPUT_TOKENS, tok)
        assert (theirs is not None) == hosted, (line, step.output)
        if theirs is not None:
            assert theirs == mine, line
    assert steps[7].output.startswith("word word") and steps[8].result.restarted
    assert steps[4].next_prompt == PS2 and steps[6].output == "0\n1\n"


def test_data_a_host_forges_is_refused():
    tok = load_tokenizer("smollm2-135m-instruct")
    output = "42\n"
    good = env_splice(tok, output, PS1, MAX_OUTPUT_TOKENS)
    post = {"ids": good.ids, "printed_tokens": good.printed_tokens, "digest": digest(output)}

    def step(**change) -> ReplStep:
        result = ExecResult("ok", output=output)
        result.post = {**post, **change}
        return ReplStep(line="x", prompt=PS1, output=output, next_prompt=PS1, result=result)

    assert take(step(), MAX_OUTPUT_TOKENS, tok) == good
    for forged in ({"digest": digest("43\n")}, {"ids": [*good.ids[:-1], len(tok)]}, {"ids": [-1]},
                   {"ids": [True]}, {"ids": [1.0]}, {"ids": "12"}, {"ids": []}, {"printed_tokens": 99},
                   {"printed_tokens": -1}, {"printed_tokens": None}, {"ids": good.ids * 40}):
        assert take(step(**forged), MAX_OUTPUT_TOKENS, tok) is None, forged
    assert take(dataclasses.replace(step(), next_prompt=PS2), MAX_OUTPUT_TOKENS, tok) is None
    no_post = step()
    no_post.result.post = None
    assert take(no_post, MAX_OUTPUT_TOKENS, tok) is None
