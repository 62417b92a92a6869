"""The transformers backend: token-exact log-probs, the line rule, finishes, determinism, batching, model loading.

Real tokenizer (SmolLM2's byte-level BPE, which merges newlines with indentation) and tiny Llama models built here;
one test runs the real SmolLM2-135M weights.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import pytest
import torch

from replrl.backends.base import ForkableSession, Generator, GenSession, SleepingGenerator
from replrl.backends.hf import HFGenerator, _Batch, cache_argument
from replrl.contract import (
    TokenMasks,
    eos_ids,
    line_end_ids,
    newline_banned_mask,
    sampling_logprobs,
    token_masks,
)
from replrl.models import ModelNotFoundError, load_model_and_tokenizer, tiny_model
from replrl.types import LineSample, SamplingParams
from tests.helpers_models import smollm2, smollm2_tokenizer, with_logit_bias


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def ids_of(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def one_id(tok, text: str) -> int:
    (token_id,) = ids_of(tok, text)
    return token_id


def biased_tiny(tok, bias_text: dict[str, float], seed: int = 0, **overrides):
    """A tiny model whose logits favour the tokens of ``bias_text`` (text -> bias), so lines end now and then."""
    return with_logit_bias(tiny_model(tok, seed=seed, **overrides), {one_id(tok, t): b for t, b in bias_text.items()})


@dataclass
class Episode:
    ids: list[int]
    sampled_at: list[int] = field(default_factory=list)
    """Positions in ids of the sampled tokens."""
    logprobs: list[float] = field(default_factory=list)
    lines: list[LineSample] = field(default_factory=list)


async def run_episodes(session: GenSession, prompts, n_lines, env_ids) -> list[Episode]:
    """Each row: ask for a line, splice it, let the fake environment answer with env_ids(i, k), n_lines[i] times."""

    async def one(i: int) -> Episode:
        ep = Episode(list(prompts[i]))
        env: list[int] = []
        for k in range(n_lines[i]):
            line = await session.next_line(i, env)
            ep.ids += env
            ep.sampled_at += range(len(ep.ids), len(ep.ids) + len(line.token_ids))
            ep.ids += line.token_ids
            ep.logprobs += line.logprobs
            ep.lines.append(line)
            if line.finish == "eos":
                break
            await asyncio.sleep(0.001 * (i % 3))  # "executing": rows come back at different times
            env = env_ids(i, k)
        session.finish(i)
        return ep

    try:
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))
    finally:
        await session.aclose()


SPECULATION_MODES = ("dropped at once", "dropped after its line ended", "dropped mid-line", "kept")
"""What ``run_speculating_rows`` does with a speculative line, by (row + line) % 4."""


async def run_speculating_rows(session: GenSession, prompts, n_lines, env_ids, wrong_ids,
                               counts: dict[str, int] | None = None) -> list[Episode]:
    """``run_episodes`` as speculation drives a session: after each line the next one is requested at once, after a
    guess of the environment's answer, while the line 'executes'. A wrong guess (``wrong_ids(i, k)``) is rolled back
    (``GenSession.rollback`` to the context before the guess) at once, after the speculative line has ended, or
    while it is being sampled, and the line is then asked for after the true ``env_ids(i, k)``; a right guess (every
    fourth line) is kept: the speculative line is the next line. ``counts``: how often each mode ran."""

    async def one(i: int) -> Episode:
        ep = Episode(list(prompts[i]))
        env: list[int] = []
        spec = None
        for k in range(n_lines[i]):
            line = await (spec if spec is not None else session.next_line(i, env))
            spec = None
            ep.ids += env
            ep.sampled_at += range(len(ep.ids), len(ep.ids) + len(line.token_ids))
            ep.ids += line.token_ids
            ep.logprobs += line.logprobs
            ep.lines.append(line)
            if line.finish == "eos" or k == n_lines[i] - 1:
                break
            env = env_ids(i, k)
            mode = SPECULATION_MODES[(i + k) % 4]
            if counts is not None:
                counts[mode] = counts.get(mode, 0) + 1
            spec = asyncio.ensure_future(session.next_line(i, env if mode == "kept" else wrong_ids(i, k)))
            await asyncio.sleep(0)  # the request is the session's
            if mode == "kept":
                continue
            if mode == "dropped after its line ended":
                await asyncio.wait([spec])
            elif mode == "dropped mid-line":
                await asyncio.sleep(0.003 * (1 + i % 3))
            await session.rollback(i, len(ep.ids))
            await asyncio.wait([spec])
            assert spec.cancelled() or spec.exception() is None
            spec = None
        session.finish(i)
        return ep

    try:
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))
    finally:
        await session.aclose()


def recomputed_logprobs(model, ep: Episode, params: SamplingParams, masks: TokenMasks) -> list[float]:
    """The trainer's view: one plain forward over the whole sequence (no cache, no holes); each line's first token
    under the line-start mask."""
    with torch.no_grad():
        logits = model(torch.tensor([ep.ids])).logits[0]                     # [T, V]
    starts, k = set(), 0
    for line in ep.lines:
        starts.add(ep.sampled_at[k])
        k += len(line.token_ids)
    is_start = torch.tensor([t + 1 in starts for t in range(len(ep.ids))])  # row t predicts token t+1
    logprobs = sampling_logprobs(logits, params, masks.at(is_start))
    return [logprobs[t - 1, ep.ids[t]].item() for t in ep.sampled_at]


def assert_line_rule(tok, ep: Episode) -> None:
    eos = eos_ids(tok)
    for line in ep.lines:
        text = tok.decode(line.token_ids)
        assert text.startswith(" ") or line.token_ids[0] in eos, repr(text)  # prompt healing
        if line.finish == "newline":
            assert text.endswith("\n") and "\n" not in text[:-1], repr(text)
        else:
            assert "\n" not in text, repr(text)


# ---- sampling_logprobs: small tensors, numbers worked out by hand ----


def test_sampling_logprobs_small():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    banned = torch.tensor([False, False, False, True])
    # banned id 3 -> -inf; softmax over [0, 1, 2]: e^x / (1 + e + e^2) = [0.0900, 0.2447, 0.6652]
    lp = sampling_logprobs(logits, SamplingParams(), banned)
    assert torch.allclose(lp.exp(), torch.tensor([0.0900, 0.2447, 0.6652, 0.0]), atol=1e-4)
    # temperature 2: [0, .5, 1] -> [0.1863, 0.3072, 0.5065]
    lp = sampling_logprobs(logits, SamplingParams(temperature=2.0), banned)
    assert torch.allclose(lp.exp(), torch.tensor([0.1863, 0.3072, 0.5065, 0.0]), atol=1e-4)
    # top_k 2 keeps ids 1, 2: [e/(e+e^2), e^2/(e+e^2)] = [0.2689, 0.7311]
    lp = sampling_logprobs(logits, SamplingParams(top_k=2), banned)
    assert torch.allclose(lp.exp(), torch.tensor([0.0, 0.2689, 0.7311, 0.0]), atol=1e-4)
    # top_p 0.6: id 2 alone has 0.6652 >= 0.6 -> kept alone; top_p 0.7: ids 2, 1 (mass before id 1 = 0.665 < 0.7)
    assert sampling_logprobs(logits, SamplingParams(top_p=0.6), banned).exp().tolist() == [0.0, 0.0, 1.0, 0.0]
    lp = sampling_logprobs(logits, SamplingParams(top_p=0.7), banned)
    assert torch.allclose(lp.exp(), torch.tensor([0.0, 0.2689, 0.7311, 0.0]), atol=1e-4)
    # batched [..., V] and the input is not modified
    batch = logits.repeat(2, 3, 1)
    assert sampling_logprobs(batch, SamplingParams(top_k=2), banned).shape == (2, 3, 4)
    assert batch[0, 0, 3] == 3.0


def test_line_rule_token_sets(tok):
    banned = newline_banned_mask(tok)
    assert banned.shape == (len(tok),) and banned.dtype == torch.bool
    for inner in ["\n    ", "\n\n", "\n\t"]:                                   # newline not at the end: banned
        assert banned[one_id(tok, inner)], repr(inner)
    for ok in ["\n", "x", " return"]:
        assert not banned[one_id(tok, ok)]
    ends = line_end_ids(tok)
    assert one_id(tok, "\n") in ends and one_id(tok, "\n    ") not in ends
    assert all(tok.decode([i]).endswith("\n") and not banned[i] for i in ends)
    assert {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")} <= eos_ids(tok)
    padded = newline_banned_mask(tok, len(tok) + 64)                         # padded embedding rows: no token
    assert padded[len(tok):].all() and torch.equal(padded[: len(tok)], banned)
    start = newline_banned_mask(tok, line_start=True)                        # a line's first token: prompt healing
    for ok in [" print", " \n", "    ", " x", "<|im_end|>"]:
        assert not start[one_id(tok, ok)], repr(ok)
    for bad in ["print", "\n", "x", "(", "\n    "]:
        assert start[one_id(tok, bad)], repr(bad)
    assert (start | ~banned).all()                                          # never allows what the rule bans


# ---- the session ----

TOKEN_EXACT_CASES = {
    "plain": (SamplingParams(seed=1, max_line_tokens=12), {}, "sdpa"),
    "truncated": (SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=2, max_line_tokens=12), {}, "sdpa"),
    "chunked": (
        SamplingParams(temperature=1.3, seed=3, max_line_tokens=12),
        dict(max_step_tokens=8, max_prefill_tokens=8),
        "sdpa",
    ),
    "eager+chunked": (
        SamplingParams(temperature=0.8, top_k=100, seed=4, max_line_tokens=12),
        dict(max_step_tokens=8, max_prefill_tokens=8, join_wait_max_s=0.0),
        "eager",
    ),
}


@pytest.mark.parametrize("case", list(TOKEN_EXACT_CASES))
def test_token_exact(tok, case):
    params, gen_kwargs, attn = TOKEN_EXACT_CASES[case]
    model = biased_tiny(tok, {"\n": 9.0, "<|im_end|>": 6.5, " x": 8.0}, attn_implementation=attn)
    gen = HFGenerator(model, tok, device="cpu", **gen_kwargs)
    assert isinstance(gen, Generator)
    prompts = [ids_of(tok, f"Task {i}: add {'1 + ' * i}1\n>>> ") for i in range(6)]
    n_lines = [2, 6, 3, 5, 1, 4]                                              # rows finish at different times
    outputs = ["42\n>>> ", "Traceback (most recent call last):\n  File \"<stdin>\", line 1\n>>> ", "... "]
    session = gen.session(prompts, params)
    episodes = asyncio.run(
        run_episodes(session, prompts, n_lines, lambda i, k: ids_of(tok, outputs[(i + k) % len(outputs)]))
    )

    banned = token_masks(tok, len(tok))
    finishes = {line.finish for ep in episodes for line in ep.lines}
    assert "newline" in finishes
    for ep in episodes:
        assert_line_rule(tok, ep)
        assert len(ep.logprobs) == len(ep.sampled_at) > 0
        recomputed = recomputed_logprobs(model, ep, params, banned)
        assert torch.allclose(torch.tensor(recomputed), torch.tensor(ep.logprobs), atol=1e-4), case
    assert session.stats["rows_freed"] > 0  # rows that finished early were released
    if gen_kwargs:
        assert session.stats["max_step_tokens"] == 8 < sum(len(p) for p in prompts)  # prompts chunked too


def test_newline_inside_token_never_sampled(tok):
    inner = ["\n    ", "\n\n", "\n\t", "\n        "]
    # without the line rule these would take nearly all the mass (+30 on the logits)
    model = biased_tiny(tok, {**{t: 30.0 for t in inner}, "\n": 9.0})
    gen = HFGenerator(model, tok, device="cpu")
    params = SamplingParams(seed=5, max_line_tokens=8)
    prompts = [ids_of(tok, f"def f{i}(x):\n") for i in range(4)]
    session = gen.session(prompts, params)
    episodes = asyncio.run(run_episodes(session, prompts, [6] * 4, lambda i, k: ids_of(tok, "... ")))
    inner_ids = {one_id(tok, t) for t in inner}
    sampled = [t for ep in episodes for line in ep.lines for t in line.token_ids]
    assert len(sampled) > 20 and not inner_ids & set(sampled)
    assert any(line.finish == "newline" for ep in episodes for line in ep.lines)
    for ep in episodes:
        assert_line_rule(tok, ep)


def test_seeded_determinism(tok):
    model = biased_tiny(tok, {"\n": 9.0})
    gen = HFGenerator(model, tok, device="cpu")
    prompts = [ids_of(tok, f">>> x = {i}\n>>> ") for i in range(3)]
    env = lambda i, k: ids_of(tok, ">>>")  # noqa: E731

    def lines(seed: int, rows: int) -> list[list[int]]:
        params = SamplingParams(seed=seed, max_line_tokens=10)
        eps = asyncio.run(run_episodes(gen.session(prompts[:rows], params), prompts[:rows], [3] * rows, env))
        return [ep.ids for ep in eps]

    first = lines(7, 3)
    assert lines(7, 3) == first
    assert lines(8, 3) != first
    assert lines(7, 1) == first[:1]  # a row's samples do not depend on which rows share its steps


def test_eos_and_length(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    x = one_id(tok, "x")

    async def first_lines(model, params, rows=2, calls=1):
        session = HFGenerator(model, tok, device="cpu").session([ids_of(tok, ">>>")] * rows, params)
        out = [[await session.next_line(i, []) for _ in range(calls)] for i in range(rows)]
        await session.aclose()
        return out

    for token_id in (eos, endoftext):
        model = with_logit_bias(tiny_model(tok), {token_id: 40.0})
        for (line,) in asyncio.run(first_lines(model, SamplingParams(seed=0))):
            assert line.finish == "eos" and line.token_ids == [token_id] and line.logprobs[0] > -1e-3

    space_x = one_id(tok, " x")
    model = with_logit_bias(tiny_model(tok), {x: 40.0, space_x: 20.0})  # " x" only where "x" may not start a line
    for row in asyncio.run(first_lines(model, SamplingParams(seed=0, max_line_tokens=5), calls=2)):
        for line in row:  # a "length" line may be followed by another request
            assert line.finish == "length" and line.token_ids == [space_x] + [x] * 4 and len(line.logprobs) == 5


async def one_row_executes_while_two_generate(gen, tok, timeout: float) -> LineSample:
    """Three rows: row 0's first line is 'executing' until rows 1 and 2 have each sampled three lines; then row 0
    asks for its next line. Returns that line (a backend where one row waits for all never gets there)."""
    session = gen.session([ids_of(tok, ">>>")] * 3, SamplingParams(seed=0, max_line_tokens=6))
    others_done = asyncio.Event()
    done = 0

    async def slow_row():
        await session.next_line(0, [])
        await others_done.wait()  # executing a long line
        return await session.next_line(0, ids_of(tok, ">>>"))

    async def fast_row(i):
        nonlocal done
        env: list[int] = []
        for _ in range(3):
            await session.next_line(i, env)
            env = ids_of(tok, "1\n>>> ")
        done += 1
        if done == 2:
            others_done.set()

    results = await asyncio.wait_for(asyncio.gather(slow_row(), fast_row(1), fast_row(2)), timeout=timeout)
    await session.aclose()
    return results[0]


def test_rows_generate_while_one_row_executes(tok):
    """Row 0's line is 'executing' until rows 1 and 2 have each finished three lines: no step waits for all rows."""
    model = biased_tiny(tok, {"\n": 9.0})
    gen = HFGenerator(model, tok, device="cpu")
    threads: set[str] = set()
    model.register_forward_pre_hook(lambda module, args: threads.add(threading.current_thread().name))

    assert isinstance(asyncio.run(one_row_executes_while_two_generate(gen, tok, timeout=60)), LineSample)
    assert threads and all(name.startswith("replrl-hf") for name in threads)  # forwards run off the event loop


def test_cache_argument_follows_the_model_s_forward():
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` and warns on every call given the old name; older
    releases (the vLLM environment pins <5.20) take only the old one."""

    class New:
        def forward(self, input_ids=None, cache=None, use_cache=None): ...

    class Old:
        def forward(self, input_ids=None, past_key_values=None, use_cache=None): ...

    class Wrapper:  # peft's PeftModel: forward(*args, **kwargs), the base model's names behind it
        def __init__(self, base):
            self.base = base

        def forward(self, *args, **kwargs): ...

        def get_base_model(self):
            return self.base

    assert cache_argument(New()) == "cache"
    assert cache_argument(Old()) == "past_key_values"
    assert cache_argument(Wrapper(New())) == "cache"
    assert cache_argument(Wrapper(Old())) == "past_key_values"


@pytest.mark.filterwarnings("error::FutureWarning")  # a deprecated argument name would warn on every step
def test_packed_step_logits_equal_plain_forward(tok):
    """Mixed packed steps: rows decoding, a row prefilling, an idle row inside the decoding rows' slot range, rows of
    different lengths. Each kept row's logits equal a plain forward over that row's tokens."""
    model = tiny_model(tok, seed=3)
    batch = _Batch(model, 4, torch.device("cpu"))
    rows = [ids_of(tok, t) for t in ["a b c", "x = 1 + 2", ">>> print(3)", "def f(x):"]]
    steps = [
        {0: rows[0], 1: rows[1], 2: rows[2], 3: rows[3]},                    # the prompts
        {0: [11], 1: [12, 13, 14, 15, 16], 3: [17]},                          # row 2 idle between decoding rows
        {2: [18], 3: [19, 20]},
        {0: [21], 1: [22], 2: [23], 3: [24]},
    ]
    seen = [[] for _ in rows]
    with torch.inference_mode():
        for feed in steps:
            keep = sorted(feed)
            logits = batch.forward(feed, keep)
            for k, slot in enumerate(keep):
                seen[slot] += feed[slot]
                plain = model(torch.tensor([seen[slot]])).logits[0, -1]
                assert torch.allclose(logits[k], plain, atol=1e-4), (feed, slot)
    assert batch.cache.lengths == [len(r) for r in seen]


def test_step_count_vs_tokens(tok):
    """4 rows, 5-token prompts, one 6-token line each: 1 prefill step (which samples token 1) + 5 decode steps."""
    model = with_logit_bias(tiny_model(tok), {one_id(tok, "x"): 40.0})
    gen = HFGenerator(model, tok, device="cpu")
    prompts = [ids_of(tok, "a b c d e")] * 4
    assert all(len(p) == 5 for p in prompts)
    session = gen.session(prompts, SamplingParams(seed=0, max_line_tokens=6))
    episodes = asyncio.run(run_episodes(session, prompts, [1] * 4, lambda i, k: []))
    assert [len(ep.lines[0].token_ids) for ep in episodes] == [6] * 4
    stats = session.stats
    assert stats["steps"] == 6 and stats["sampled_tokens"] == 24
    assert stats["fed_tokens"] == 4 * 5 + 4 * 5 and stats["max_step_tokens"] == 4 * 5  # the prompts, packed


def test_long_environment_output_is_chunked(tok):
    """A 40-token interpreter output is prefilled in chunks of at most max_step_tokens, exactly."""
    model = biased_tiny(tok, {"\n": 9.0})
    gen = HFGenerator(model, tok, device="cpu", max_step_tokens=8)
    params = SamplingParams(seed=0, max_line_tokens=6)
    prompts = [ids_of(tok, ">>>")] * 2
    long_output = ids_of(tok, "[" + ", ".join(str(i) for i in range(14)) + "]\n>>> ")
    assert len(long_output) >= 40
    session = gen.session(prompts, params)
    episodes = asyncio.run(run_episodes(session, prompts, [3, 3], lambda i, k: long_output))
    banned = token_masks(tok, len(tok))
    for ep in episodes:
        assert torch.allclose(torch.tensor(recomputed_logprobs(model, ep, params, banned)), torch.tensor(ep.logprobs),
                              atol=1e-4)
    assert session.stats["max_step_tokens"] == 8  # chunked


def check_session_errors_and_close(gen, tok) -> None:
    """A session refuses an empty prompt and a finished row; aclose() fails a pending line and any later one.
    ``gen`` must favour a token that never ends a line (so row 1's 96-token line is still running at aclose)."""
    with pytest.raises(ValueError):
        gen.session([[]], SamplingParams())

    async def main():
        session = gen.session([ids_of(tok, ">>>")] * 2, SamplingParams(max_line_tokens=96))
        await session.next_line(0, [])
        session.finish(0)
        with pytest.raises(ValueError):
            await session.next_line(0, [])
        pending = asyncio.create_task(session.next_line(1, []))
        await asyncio.sleep(0)
        await session.aclose()  # the 96-token line of row 1 is not done yet
        with pytest.raises(RuntimeError):
            await pending
        with pytest.raises(RuntimeError):
            await session.next_line(1, [])

    asyncio.run(main())


def test_session_errors_and_close(tok):
    check_session_errors_and_close(HFGenerator(with_logit_bias(tiny_model(tok), {one_id(tok, "x"): 40.0}), tok,
                                               device="cpu"), tok)


# ---- models ----


def test_model_not_found_is_one_line():
    for spec in ["/no/such/model", "./missing-model", "weights.gguf", "a/b/c"]:
        with pytest.raises(ModelNotFoundError) as info:
            load_model_and_tokenizer(spec)
        message = str(info.value)
        assert message.startswith(f"model {spec!r} not found") and "\n" not in message
        assert info.value.__cause__ is None and (info.value.__context__ is None or info.value.__suppress_context__)


def test_tiny_model_is_seeded(tok):
    a, b, c = tiny_model(tok, seed=0), tiny_model(tok, seed=0), tiny_model(tok, seed=1)
    assert a.config.vocab_size == len(tok) and a.config.num_hidden_layers == 2
    assert torch.equal(a.lm_head.weight, b.lm_head.weight) and not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert tiny_model(tok, num_hidden_layers=1).config.num_hidden_layers == 1


@pytest.mark.slow
def test_converted_gguf_copy_matches_gguf(tok):
    """The cached save_pretrained copy gives the same logits as dequantizing the GGUF itself."""
    from transformers import AutoModelForCausalLM

    from replrl.models import _smollm2_gguf

    model, tokenizer = smollm2()
    gguf = _smollm2_gguf()
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    ids = torch.tensor([ids_of(tok, ">>> def f(x):\n...     return x * 2\n")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, direct(ids).logits)
    assert tokenizer.encode("a\n\n    b") == tok.encode("a\n\n    b")


@pytest.mark.slow
def test_real_smollm2_token_exact():
    model, tok = smollm2()
    gen = HFGenerator(model, tok, device="cpu")
    params = SamplingParams(temperature=0.9, seed=0, max_line_tokens=16)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Compute 12 * 7 in Python."}], add_generation_prompt=True, tokenize=False
    )
    prompts = [ids_of(tok, chat + ">>>"), ids_of(tok, chat + ">>> # the answer\n>>>")]
    session = gen.session(prompts, params)
    episodes = asyncio.run(run_episodes(session, prompts, [2, 2], lambda i, k: ids_of(tok, "84\n>>>")))
    banned = token_masks(tok, model.config.vocab_size)
    for ep in episodes:
        assert_line_rule(tok, ep)
        recomputed = recomputed_logprobs(model, ep, params, banned)
        assert torch.allclose(torch.tensor(recomputed), torch.tensor(ep.logprobs), atol=1e-4)


# ---- the backend registry ----


def test_load_generator_by_name(tok):
    from replrl.backends import BackendError, backend_class, load_generator

    model = tiny_model(tok)
    gen = load_generator("hf", model, tok, device="cpu", num_threads=1, kv_cache_gib=1.0)  # vllm's option: dropped
    assert isinstance(gen, HFGenerator) and isinstance(gen, Generator) and gen.num_threads == 1
    assert gen.pad_id == model.config.pad_token_id  # the tokenizer's pad, else its EOS (no pad: transformers 4.x)
    gen.sync_weights(model)  # the same module: nothing to copy
    assert gen.model is model
    with pytest.raises(BackendError, match="unknown backend 'jax'"):
        load_generator("jax", model, tok)
    try:
        import vllm  # noqa: F401
    except Exception:  # auto falls back to hf where vllm does not import; asking for vllm says why, in one line
        assert backend_class("auto") is HFGenerator
        with pytest.raises(BackendError, match="backend 'vllm' cannot (be imported|start here)") as info:
            backend_class("vllm")
        assert "\n" not in str(info.value)


def test_the_hf_generator_is_the_generator_protocol_and_closes_its_worker_thread(tok):
    """HFGenerator and its sessions implement ``Generator`` and ``GenSession`` (what the rollout and the Trainer
    read of a backend, nothing else), and ForkableSession; ``sync_weights`` sets the policy version (given, or the
    next one); ``close`` (what replrl train, eval and rollout call when done) stops the worker thread, and a later
    session starts a new one."""
    model = tiny_model(tok)
    gen = HFGenerator(model, tok)
    assert isinstance(gen, Generator) and not isinstance(gen, SleepingGenerator)
    assert gen.version == 0 and not gen.own_weights and gen.last_sync_transport == ""
    gen.sync_weights(model)
    gen.sync_weights(model, 7)
    assert gen.version == 7
    gen.sync_weights(model)
    assert gen.version == 8
    session = gen.session([[1, 2, 3]], SamplingParams(seed=0, max_line_tokens=4))
    assert isinstance(session, GenSession) and isinstance(session, ForkableSession)

    async def one_line() -> None:
        await session.next_line(0, [])
        await session.aclose()

    asyncio.run(one_line())
    worker = gen.executor
    gen.close()
    gen.close()  # twice: nothing left to release
    assert worker._shutdown and gen.executor is not worker
