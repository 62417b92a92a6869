"""THE loop: generate a line -> execute it -> splice the output -> repeat, for many episodes at once.

Every episode is an asyncio task with its own sandboxed kernel. The generation backend batches whatever episodes
are waiting for a line, so while one episode's line executes, the others keep generating. Token bookkeeping is
splice-by-concatenation (DESIGN.md invariant 1): the ids the model sampled are kept as sampled, the environment's
text (interpreter output, the next prompt) is tokenized on its own and appended with ``loss_mask`` 0. The full
transcript is never re-tokenized.

Speculation (``EpisodeRules.speculate``): most lines print nothing, and then the environment's only answer is the
next prompt, which ``ReplSession.silent_prompt`` predicts from the line (``codeop``). While such a line runs, its
episode's next line is already being sampled after the predicted prompt; when the kernel's answer is that prompt
(and the episode goes on), the speculative line is the next line, else ``GenSession.rollback`` drops it and the next
line is sampled after the true transcript. No line runs before the lines before it are confirmed: a speculative line
is only generated until then.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from sandbox.protocols import PoolKernel

from ..answers import checkable
from ..backends.base import GenSession
from ..repl import ReplSession, ReplStep
from ..tasks.base import SETUP_TIMEOUT_S, Task, TaskError, row_label, setup_source
from ..types import Line, LineSample, SamplingParams, Trajectory
from .env import Env
from .host_splice import take as take_host_splice
from .transcript import code_of, decode, env_splice, env_token_ids

SUBMIT = "submit"


@dataclass
class Episode:
    """An episode in progress: its trajectory so far and what the loop needs to go on (``play``). A tree rollout
    stops it at a branch point and continues it, and copies of it on rows forked from its own (or in a session of
    their own)."""

    traj: Trajectory
    session: ReplSession | None = None
    """The REPL on the episode's kernel (set once a kernel is acquired)."""
    env_ids: list[int] = field(default_factory=list)
    """Environment tokens already in ``traj`` that the generation session has not been given yet."""
    repeats: int = 0
    submitted: list[Any] = field(default_factory=list)
    executed: int = 0
    """Statements executed so far (a block counts once, when its closing line runs it)."""
    gen_s: float = 0.0
    exec_s: float = 0.0
    speculated: int = 0
    """Lines whose successor was sampled while they ran (speculation)."""
    speculation_hits: int = 0
    """Of those, the lines whose successor was kept (the prompt predicted was the interpreter's answer)."""
    pieces: list[str] = field(default_factory=list)
    """The text of each piece spliced after the prompt (a line's sampled text, the environment's after it), as the
    splice had it: the lines' character spans count along them (``Line.text_span``), and ``finish_episode`` checks
    them against the decoded transcript."""
    chars: int = 0
    """Characters of ``pieces`` (where the next piece starts, counted from the end of the prompt)."""

    @classmethod
    def start(cls, prompt_ids: list[int], env: Env, sampling: SamplingParams) -> Episode:
        """A new episode after ``prompt_ids``; its trajectory records the sampling and the episode's limits."""
        rules = env.rules
        record = {**asdict(sampling), "max_lines": rules.max_lines, "max_total_tokens": rules.max_total_tokens}
        return cls(Trajectory(token_ids=list(prompt_ids), loss_mask=[0] * len(prompt_ids),
                              logprobs=[0.0] * len(prompt_ids), prompt_len=len(prompt_ids), text="",
                              task=env.task.name, sampling=record, policy_step=env.generator.version))

    @property
    def ended(self) -> bool:
        return bool(self.traj.end_reason)


async def run_episode(gen: GenSession, i: int, env: Env, row: dict, prompt_ids: list[int],
                      sampling: SamplingParams) -> Trajectory:
    """One episode on row ``i`` of the generation session, in ``env`` (its pool, task, rules, rewards); ``sampling``
    (the session's) is recorded in the trajectory."""
    task, rules = env.task, env.rules
    ep = Episode.start(prompt_ids, env, sampling)
    try:
        async with env.pool.acquire() as kernel:  # the pool defines the task's tools (KernelPool(tools=task.tools))
            ep.traj.timing["setup_s"] = await run_setup(kernel, task, row)
            ep.session = ReplSession(kernel, banner="", digest=rules.state_digest)
            if rules.state_digest and ep.traj.timing["setup_s"]:  # the setup's data is part of the first line's state
                await ep.session.refresh_state()
            await play(gen, i, ep, env)
    finally:
        gen.finish(i)
    return finish_episode(ep, env, row)


async def play(gen: GenSession, i: int, ep: Episode, env: Env, stop_at: int | None = None) -> None:
    """Generate and execute lines of ``ep`` on row ``i`` of ``gen`` until the episode ends, or (``stop_at``) until
    it has executed ``stop_at`` statements and stands at a ``>>>`` prompt with the next prompt's tokens in ``traj``."""
    session = ep.session
    assert session is not None, "play() needs the episode's ReplSession"
    spec: _Speculation | None = None  # the next line, sampled while the last one ran, and confirmed
    try:
        while not ep.ended:
            if stop_at is not None and ep.executed >= stop_at and not session.buffer:
                return
            spec = await _play_line(gen, i, ep, env, spec, speculate=env.rules.speculate and stop_at is None)
    finally:
        if spec is not None and not spec.task.done():  # left by an error or a cancellation: not continued
            spec.task.cancel()


@dataclass
class _Speculation:
    """The next line, being sampled after the prompt predicted for the line that runs."""

    task: asyncio.Task
    env_ids: list[int]
    """The predicted environment tokens (the prompt alone) given to the session before the line."""
    mark: int
    """The row's context length before them (where a rollback cuts)."""


async def _play_line(gen: GenSession, i: int, ep: Episode, env: Env, spec: _Speculation | None,
                     speculate: bool) -> _Speculation | None:
    """One line of ``play``: its sample (``spec``'s, when the line before confirmed it), its execution, its
    environment tokens. Returns the next line's speculation, if one was started and confirmed."""
    tokenizer, rewards, rules = env.tokenizer, env.rewards, env.rules
    traj, session = ep.traj, ep.session
    assert session is not None
    t0 = time.perf_counter()
    sample = await (spec.task if spec is not None else gen.next_line(i, ep.env_ids))
    spec = None
    ep.env_ids = []
    ep.gen_s += time.perf_counter() - t0
    start = len(traj.token_ids)
    _append(traj, sample)
    text = decode(tokenizer, sample.token_ids)
    span, chars = (start, len(traj.token_ids)), (ep.chars, ep.chars + len(text))
    ep.pieces.append(text)
    ep.chars += len(text)
    state, state_values = session.start_state()
    if sample.finish == "length":  # cut by the token limit: it never runs
        # recorded even when empty, so every sampled token belongs to exactly one line
        traj.lines.append(Line(code=code_of(text), status="incomplete", token_span=span, prompt=session.prompt,
                               state=state, state_values=state_values, output_span=(span[1], span[1]),
                               text_span=chars, output_text_span=(chars[1], chars[1])))
        traj.end_reason = "overlong_line"
        return None
    at_eof = sample.finish == "eos"  # end of input: the pending line (or block) runs, as in `python -i`
    code = code_of(text[:-len(decode(tokenizer, sample.token_ids[-1:]))] if at_eof else text[:-1])
    if speculate and not at_eof:
        spec = await _speculate(gen, i, ep, env, code)
    t0 = time.perf_counter()
    try:
        step = await session.feed(code)
        if at_eof:
            step = _merge(step, await session.end_of_input())
    except BaseException:  # (cancelled: the row is not continued)
        if spec is not None:
            spec.task.cancel()
        raise
    ep.exec_s += time.perf_counter() - t0
    result = step.result
    ep.executed += result is not None
    line = Line(code=code, output=step.output, status=step.status, token_span=span, prompt=step.prompt,
                error_name=result.error_name if result else None, state=state, state_values=state_values,
                digest_ms=result.state.ms if result is not None and result.state is not None else 0.0,
                output_span=(span[1], span[1]), text_span=chars, output_text_span=(chars[1], chars[1]))
    line.rewards = rewards.score_line(line, traj)
    ep.repeats = ep.repeats + 1 if traj.lines and traj.lines[-1].code == code and code.strip() else 0
    traj.lines.append(line)
    # a submission is a call the kernel recorded (plain data, this line's own); printed text never is one
    calls = [c for c in (result.tool_calls if result else []) if c.name == SUBMIT]
    if calls:
        args = calls[0].args or list(calls[0].kwargs.values())
        ep.submitted.append(args[0] if args else None)
    if at_eof:  # `submit(x)<end of turn>`: the answer counts, the episode ended at end of input
        traj.end_reason = "eos"
    elif calls:
        traj.end_reason = "submit"
    elif result is not None and result.restarted:
        traj.end_reason = "crash" if result.status == "crashed" else "timeout"
    elif result is not None and result.error_name == "SystemExit":  # exit() ends a REPL session
        traj.end_reason = "exit"
    elif ep.repeats + 1 >= rules.max_repeats:
        traj.end_reason = "repeat"
    elif len(traj.lines) >= rules.max_lines:
        traj.end_reason = "max_lines"
    env_ids: list[int] = []
    if not traj.end_reason:
        splice = take_host_splice(step, rules.max_output_tokens, tokenizer) \
            or env_splice(tokenizer, step.output, step.next_prompt, rules.max_output_tokens)
        env_ids = splice.ids
        if len(traj.token_ids) + len(env_ids) + 1 >= rules.max_total_tokens:
            traj.end_reason = "max_tokens"
    if spec is not None:
        if traj.end_reason or env_ids != spec.env_ids:  # printed, raised, closed otherwise, ended: drop it
            await _drop(gen, i, spec)
            spec = None
        else:  # the session already has these tokens, and the next line after them is on its way
            ep.speculation_hits += 1
    if traj.end_reason:
        return None
    # what the interpreter printed: its tokens and characters, known here (DESIGN.md invariant 1: appended as is)
    line.output_span = (span[1], span[1] + splice.printed_tokens)
    line.output_text_span = (chars[1], chars[1] + splice.printed_chars)
    ep.pieces.append(splice.text)
    ep.chars += len(splice.text)
    traj.token_ids += env_ids
    traj.loss_mask += [0] * len(env_ids)
    traj.logprobs += [0.0] * len(env_ids)
    ep.env_ids = env_ids if spec is None else []
    return spec


async def _speculate(gen: GenSession, i: int, ep: Episode, env: Env, code: str) -> _Speculation | None:
    """Start sampling the line after ``code`` (the episode's last line, about to run) after the prompt predicted
    for it, where it is predicted silent and the episode can only end by what running it shows (an answer, an
    error, a crash...), not by a limit known now. None where it is not."""
    traj, session = ep.traj, ep.session
    assert session is not None
    prompt = session.silent_prompt(code)
    if prompt is None:
        return None
    rules = env.rules
    repeats = ep.repeats + 1 if traj.lines and traj.lines[-1].code == code and code.strip() else 0
    env_ids = env_token_ids(env.tokenizer, "", prompt, rules.max_output_tokens)
    if (repeats + 1 >= rules.max_repeats or len(traj.lines) + 1 >= rules.max_lines
            or len(traj.token_ids) + len(env_ids) + 1 >= rules.max_total_tokens):
        return None
    spec = _Speculation(asyncio.ensure_future(gen.next_line(i, env_ids)), env_ids, len(traj.token_ids))
    await asyncio.sleep(0)  # the request is the session's before the line runs (a rollback then finds it)
    ep.speculated += 1
    return spec


async def _drop(gen: GenSession, i: int, spec: _Speculation) -> None:
    """Roll the session's row back to before the speculation, and wait for its line to end (cancelled, or
    sampled and dropped)."""
    await gen.rollback(i, spec.mark)
    spec.task.cancel()  # (no-op when the rollback has already ended it)
    await asyncio.wait([spec.task])
    if not spec.task.cancelled():
        spec.task.exception()  # retrieved: an error of a dropped line is not the episode's


def finish_episode(ep: Episode, env: Env, row: dict) -> Trajectory:
    """The ended episode's trajectory with its answer checked (``env.task``), the end-of-episode reward terms
    (``env.rewards``) and its text."""
    traj, task, rewards = ep.traj, env.task, env.rewards
    if ep.submitted:
        traj.submitted = True
        traj.answer = ep.submitted[0]
        traj.correct = checkable(traj.answer) and bool(task.check(row, traj.answer))  # {"rejected": ...} is wrong
    rewards.finish(traj, bool(ep.submitted))  # end-of-episode terms, gates, the outcome terms
    traj.text = decode(env.tokenizer, traj.token_ids)
    _place_text_spans(traj, ep)
    traj.timing.update(generation_wait_s=ep.gen_s, execution_s=ep.exec_s)
    if ep.speculated:
        traj.timing.update(speculated_lines=ep.speculated, speculation_hits=ep.speculation_hits)
    return traj


def _place_text_spans(traj: Trajectory, ep: Episode) -> None:
    """The lines' character spans, counted from the end of the prompt at the splice, made positions in
    ``traj.text``: the decoded transcript ends with the pieces as spliced (a byte-level BPE's decoding is additive
    at the pieces' edges, which are whole characters: a newline, a prompt). Where it does not (a decoder that drops
    or merges characters), the character spans are left empty and the viewer finds the lines in the text."""
    joined = "".join(ep.pieces)
    base = len(traj.text) - len(joined)
    placed = base >= 0 and traj.text.endswith(joined)
    for line in traj.lines:
        (a, b), (c, d) = line.text_span, line.output_text_span
        line.text_span, line.output_text_span = ((a + base, b + base), (c + base, d + base)) if placed else \
            ((0, 0), (0, 0))


async def run_setup(kernel: PoolKernel, task: Task, row: dict) -> float:
    """Run the task's per-problem ``setup(row)`` source in ``kernel`` (before the first line; nothing of it enters
    the transcript, its output is discarded) and return its wall time; 0.0 when the task has none. A setup that
    raises, times out or kills the kernel is a TaskError naming the row."""
    source = setup_source(task, row)
    if not source.strip():
        return 0.0
    t0 = time.perf_counter()
    result = await kernel.execute(source, mode="exec", timeout=max(SETUP_TIMEOUT_S, kernel.limits.wall_s))
    if result.status != "ok":
        last = [ln for ln in result.output.strip().splitlines() if ln.strip()][-1:] or [result.error_name or ""]
        raise TaskError(f"task {task.name!r}: setup of {row_label(row)} failed ({result.status}): {last[0][:200]}")
    return time.perf_counter() - t0


def _merge(step: ReplStep, eof: ReplStep | None) -> ReplStep:
    """The last line's step and what end of input then ran (at most one of them executed anything)."""
    if eof is None:
        return step
    return ReplStep(line=step.line, prompt=step.prompt, output=step.output + eof.output, next_prompt=eof.next_prompt,
                    result=eof.result or step.result)


def _append(traj: Trajectory, sample: LineSample) -> None:
    traj.token_ids += sample.token_ids
    traj.loss_mask += [1] * len(sample.token_ids)
    traj.logprobs += sample.logprobs
