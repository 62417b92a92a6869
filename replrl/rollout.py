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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sandbox import KernelPool

from .answers import checkable
from .backends.base import Generator, GenSession
from .repl import BANNER, PS1, TRUNCATED_MARKER, ReplSession, ReplStep
from .rewards import SYNTAX_ERRORS, RewardModel
from .states import state_stats
from .tasks.base import SETUP_TIMEOUT_S, Task, TaskError, row_label, setup_source
from .types import Line, LineSample, SamplingParams, Trajectory

SUBMIT = "submit"


@dataclass(frozen=True)
class EpisodeRules:
    """Per-episode limits beyond sampling; ``EpisodeRules.from_config(cfg.rollout)`` (defaults live in config.py)."""

    max_output_tokens: int
    max_repeats: int
    state_digest: bool
    """Record the interpreter state each line starts from (``Line.state``, ``Line.state_values``)."""
    speculate: bool = False
    """Sample a line's successor while the line runs, when it is predicted to print nothing (see the module
    docstring; flat rollouts only, a tree rollout plays without)."""

    @classmethod
    def from_config(cls, rollout_cfg: Any) -> EpisodeRules:
        return cls(max_output_tokens=rollout_cfg.max_output_tokens, max_repeats=rollout_cfg.max_repeats,
                   state_digest=rollout_cfg.state_digest, speculate=getattr(rollout_cfg, "speculate", False))


@dataclass
class RolloutStats:
    """Wall-clock accounting of one rollout call."""

    wall_s: float = 0.0
    generation_s: float = 0.0
    """Wall time the backend spent in forward passes and sampling."""
    execution_s: float = 0.0
    """Kernel time summed over lines (overlaps with generation: episodes execute while others generate)."""
    model_tokens: int = 0
    env_tokens: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, float]:
        return {**{k: v for k, v in asdict(self).items() if k != "extra"}, **self.extra}

    def merge(self, other: RolloutStats) -> RolloutStats:
        """Two consecutive rollouts as one (times and counts add up)."""
        extra = {k: self.extra.get(k, 0.0) + other.extra.get(k, 0.0) for k in {*self.extra, *other.extra}}
        return RolloutStats(self.wall_s + other.wall_s, self.generation_s + other.generation_s,
                            self.execution_s + other.execution_s, self.model_tokens + other.model_tokens,
                            self.env_tokens + other.env_tokens, extra)


def build_prompt(tokenizer: Any, header: str, chat_template: bool = True) -> str:
    """The episode's prompt text: the task header as a user turn (chat template when the tokenizer has one), then
    the assistant turn opening with the REPL banner and the first prompt, healed: ``>>>`` (see ``heal``)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": header}], tokenize=False,
                                             add_generation_prompt=True)
        return text + BANNER + heal(PS1)
    return header.rstrip("\n") + "\n\n" + BANNER + heal(PS1)


def heal(prompt: str) -> str:
    """The prompt as the environment emits it: without its trailing space, which the line's first token carries
    (``>>>`` + `` print`` + ``(x)\n``), as a BPE tokenizer splits the text ``>>> print(x)``."""
    return prompt[:-1] if prompt.endswith(" ") else prompt


def line_text(code: str) -> str:
    """The text a model writes for one line of code: the prompt's space, the code, the newline."""
    return " " + code + "\n"


def code_of(text: str) -> str:
    """The code in a line's text (the inverse of ``line_text``, without the newline): drop the prompt's space."""
    return text[1:] if text.startswith(" ") else text


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """The text of ``ids`` as sampled: no clean-up of spaces before punctuation (``x ...`` stays ``x ...``; SmolLM2's
    GGUF tokenizer asks for the clean-up under transformers 4.x)."""
    return tokenizer.decode(ids, clean_up_tokenization_spaces=False)


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

    @classmethod
    def start(cls, prompt_ids: list[int], task: Task, sampling: SamplingParams) -> Episode:
        return cls(Trajectory(token_ids=list(prompt_ids), loss_mask=[0] * len(prompt_ids),
                              logprobs=[0.0] * len(prompt_ids), prompt_len=len(prompt_ids), text="", task=task.name,
                              sampling=asdict(sampling)))

    @property
    def ended(self) -> bool:
        return bool(self.traj.end_reason)


async def run_episode(gen: GenSession, i: int, tokenizer: Any, pool: KernelPool, task: Task, row: dict,
                      prompt_ids: list[int], rewards: RewardModel, sampling: SamplingParams,
                      rules: EpisodeRules) -> Trajectory:
    """One episode on row ``i`` of the generation session."""
    ep = Episode.start(prompt_ids, task, sampling)
    try:
        async with pool.acquire() as kernel:  # the pool defines the task's tools (KernelPool(tools=task.tools))
            ep.traj.timing["setup_s"] = await run_setup(kernel, task, row)
            ep.session = ReplSession(kernel, banner="", digest=rules.state_digest)
            if rules.state_digest and ep.traj.timing["setup_s"]:  # the setup's data is part of the first line's state
                await ep.session.refresh_state()
            await play(gen, i, ep, tokenizer, rewards, sampling, rules)
    finally:
        gen.finish(i)
    return finish_episode(ep, task, row, rewards, tokenizer)


async def play(gen: GenSession, i: int, ep: Episode, tokenizer: Any, rewards: RewardModel, sampling: SamplingParams,
               rules: EpisodeRules, stop_at: int | None = None) -> None:
    """Generate and execute lines of ``ep`` on row ``i`` of ``gen`` until the episode ends, or (``stop_at``) until
    it has executed ``stop_at`` statements and stands at a ``>>>`` prompt with the next prompt's tokens in ``traj``."""
    session = ep.session
    assert session is not None, "play() needs the episode's ReplSession"
    spec: _Speculation | None = None  # the next line, sampled while the last one ran, and confirmed
    try:
        while not ep.ended:
            if stop_at is not None and ep.executed >= stop_at and not session.buffer:
                return
            spec = await _play_line(gen, i, ep, tokenizer, rewards, sampling, rules, spec,
                                    speculate=rules.speculate and stop_at is None)
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


async def _play_line(gen: GenSession, i: int, ep: Episode, tokenizer: Any, rewards: RewardModel,
                     sampling: SamplingParams, rules: EpisodeRules, spec: _Speculation | None,
                     speculate: bool) -> _Speculation | None:
    """One line of ``play``: its sample (``spec``'s, when the line before confirmed it), its execution, its
    environment tokens. Returns the next line's speculation, if one was started and confirmed."""
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
    span = (start, len(traj.token_ids))
    state, state_values = session.start_state()
    if sample.finish == "length":  # cut by the token limit: it never runs
        # recorded even when empty, so every sampled token belongs to exactly one line
        traj.lines.append(Line(code=code_of(text), status="incomplete", token_span=span, prompt=session.prompt,
                               state=state, state_values=state_values))
        traj.end_reason = "overlong_line"
        return None
    at_eof = sample.finish == "eos"  # end of input: the pending line (or block) runs, as in `python -i`
    code = code_of(text[:-len(decode(tokenizer, sample.token_ids[-1:]))] if at_eof else text[:-1])
    if speculate and not at_eof:
        spec = await _speculate(gen, i, ep, tokenizer, sampling, rules, code)
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
                digest_ms=result.state.ms if result is not None and result.state is not None else 0.0)
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
    elif len(traj.lines) >= sampling.max_lines:
        traj.end_reason = "max_lines"
    env_ids: list[int] = []
    if not traj.end_reason:
        env_ids = env_token_ids(tokenizer, step.output, step.next_prompt, rules.max_output_tokens)
        if len(traj.token_ids) + len(env_ids) + 1 >= sampling.max_total_tokens:
            traj.end_reason = "max_tokens"
    if spec is not None:
        if traj.end_reason or env_ids != spec.env_ids:  # printed, raised, closed otherwise, ended: drop it
            await _drop(gen, i, spec)
            spec = None
        else:  # the session already has these tokens, and the next line after them is on its way
            ep.speculation_hits += 1
    if traj.end_reason:
        return None
    traj.token_ids += env_ids
    traj.loss_mask += [0] * len(env_ids)
    traj.logprobs += [0.0] * len(env_ids)
    ep.env_ids = env_ids if spec is None else []
    return spec


async def _speculate(gen: GenSession, i: int, ep: Episode, tokenizer: Any, sampling: SamplingParams,
                     rules: EpisodeRules, code: str) -> _Speculation | None:
    """Start sampling the line after ``code`` (the episode's last line, about to run) after the prompt predicted
    for it, where it is predicted silent and the episode can only end by what running it shows (an answer, an
    error, a crash...), not by a limit known now. None where it is not."""
    traj, session = ep.traj, ep.session
    assert session is not None
    prompt = session.silent_prompt(code)
    if prompt is None:
        return None
    repeats = ep.repeats + 1 if traj.lines and traj.lines[-1].code == code and code.strip() else 0
    env_ids = env_token_ids(tokenizer, "", prompt, rules.max_output_tokens)
    if (repeats + 1 >= rules.max_repeats or len(traj.lines) + 1 >= sampling.max_lines
            or len(traj.token_ids) + len(env_ids) + 1 >= sampling.max_total_tokens):
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


def finish_episode(ep: Episode, task: Task, row: dict, rewards: RewardModel, tokenizer: Any) -> Trajectory:
    """The ended episode's trajectory with its answer checked, the end-of-episode reward terms and its text."""
    traj = ep.traj
    if ep.submitted:
        traj.submitted = True
        traj.answer = ep.submitted[0]
        traj.correct = checkable(traj.answer) and bool(task.check(row, traj.answer))  # {"rejected": ...} is wrong
    rewards.finish(traj, bool(ep.submitted))  # end-of-episode terms, gates, the outcome terms
    traj.text = decode(tokenizer, traj.token_ids)
    traj.timing.update(generation_wait_s=ep.gen_s, execution_s=ep.exec_s)
    if ep.speculated:
        traj.timing.update(speculated_lines=ep.speculated, speculation_hits=ep.speculation_hits)
    return traj


async def run_setup(kernel: Any, task: Task, row: dict) -> float:
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


def env_token_ids(tokenizer: Any, output: str, next_prompt: str, max_output_tokens: int) -> list[int]:
    """Tokens of what the environment prints after a line and the next prompt (healed: ``>>>``, ``...``); long
    output is cut with a visible marker."""
    next_prompt = heal(next_prompt)
    ids = encode(tokenizer, output + next_prompt)
    if len(ids) <= max_output_tokens:
        return ids
    kept = decode(tokenizer, encode(tokenizer, output)[:max_output_tokens]).rstrip("\ufffd")
    return encode(tokenizer, kept + ("" if kept.endswith("\n") else "\n") + TRUNCATED_MARKER + next_prompt)


async def rollout(generator: Generator, pool: KernelPool, task: Task, rows: Sequence[tuple[int, dict]],
                  rewards: RewardModel, sampling: SamplingParams, rules: EpisodeRules,
                  group_size: int = 1, chat_template: bool = True,
                  progress: Any = None, tree: Any = None) -> tuple[list[Trajectory], RolloutStats]:
    """Sample ``group_size`` episodes for each ``(row_index, row)`` concurrently; return them grouped in order.

    ``tree`` (a ``replrl.tree.TreeShape`` with branch points): each group is a tree of episodes that branch at
    line boundaries instead (``replrl.tree.tree_rollout``; its leaves replace the ``group_size`` episodes)."""
    if tree is not None and tree.on:
        from .tree import tree_rollout

        trajs, stats = await tree_rollout(generator, pool, task, rows, rewards, sampling, rules, tree,
                                          chat_template, progress)
        await rewards.score_episodes(trajs, rows)  # episode-level reward functions (rewards.functions)
        return trajs, stats
    tok = generator.tokenizer
    prompts, meta = [], []
    for g, (row_index, row) in enumerate(rows):
        ids = encode(tok, build_prompt(tok, task.header(row), chat_template))
        for _ in range(group_size):
            prompts.append(ids)
            meta.append((g, row_index, row))
    t0 = time.perf_counter()
    gen = generator.session(prompts, sampling)
    try:
        async def one(i: int) -> Trajectory:
            g, row_index, row = meta[i]
            traj = await run_episode(gen, i, tok, pool, task, row, prompts[i], rewards, sampling, rules)
            traj.group, traj.row = g, row_index
            if progress is not None:
                progress.update(1)
            return traj

        episodes = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
        try:
            trajs = list(await asyncio.gather(*episodes))
        except BaseException:  # e.g. a task's setup failed: stop the other episodes before their kernels go
            for e in episodes:
                e.cancel()
            await asyncio.gather(*episodes, return_exceptions=True)
            raise
    finally:
        await gen.aclose()
    stats = RolloutStats(wall_s=time.perf_counter() - t0,
                         generation_s=float(getattr(gen, "stats", {}).get("worker_s", 0.0)),
                         execution_s=sum(t.timing["execution_s"] for t in trajs),
                         model_tokens=sum(sum(t.loss_mask) for t in trajs),
                         env_tokens=sum(len(t.token_ids) - t.prompt_len - sum(t.loss_mask) for t in trajs),
                         extra={"setup_s": sum(t.timing.get("setup_s", 0.0) for t in trajs),
                                **({k: float(sum(t.timing.get(k, 0) for t in trajs))
                                    for k in ("speculated_lines", "speculation_hits")} if rules.speculate else {}),
                                **{f"gen_{k}": float(v) for k, v in getattr(gen, "stats", {}).items()},
                                **{f"gen_{k}": float(v) for k, v in getattr(gen, "timing", {}).items()}})
    await rewards.score_episodes(trajs, rows)  # episode-level reward functions (rewards.functions), all at once
    return trajs, stats


def used_block(traj: Trajectory) -> bool:
    """Whether the episode wrote a statement over several lines: code after a ``...`` prompt (a loop's or a
    function's body on its own line, a bracket continued). A one-line ``for x in xs: s += x`` and the blank line
    that closes it do not count."""
    return any(ln.prompt.startswith("...") and ln.code.strip() for ln in traj.lines)


def summarize(trajs: Sequence[Trajectory], stats: RolloutStats | None = None) -> dict[str, float]:
    """Per-line and per-episode statistics of a set of episodes (the numbers `replrl rollout` and training log)."""
    n = max(len(trajs), 1)
    lines = [ln for t in trajs for ln in t.lines if ln.status != "incomplete"]
    n_lines = max(len(lines), 1)
    out: dict[str, float] = {
        "episodes": len(trajs),
        "reward_mean": sum(t.reward for t in trajs) / n,
        "accuracy": sum(bool(t.correct) for t in trajs) / n,
        "submit_rate": sum(t.submitted for t in trajs) / n,
        "eof_line_ran": sum(t.end_reason == "eos" and bool(t.lines) and t.lines[-1].status != "incomplete"
                            for t in trajs) / n,
        "lines_per_episode": sum(len(t.lines) for t in trajs) / n,
        "syntax_error_rate": sum(ln.status == "error" and ln.error_name in SYNTAX_ERRORS for ln in lines) / n_lines,
        "exception_rate": sum(ln.status == "error" and ln.error_name not in SYNTAX_ERRORS for ln in lines) / n_lines,
        "timeout_rate": sum(ln.status == "timeout" for ln in lines) / n_lines,
        "crash_rate": sum(ln.status == "crashed" for ln in lines) / n_lines,
        "model_tokens_per_episode": sum(sum(t.loss_mask) for t in trajs) / n,
        "env_tokens_per_episode": sum(len(t.token_ids) - t.prompt_len - sum(t.loss_mask) for t in trajs) / n,
    }
    correct = [t for t in trajs if t.correct]
    out["block_rate"] = sum(map(used_block, trajs)) / n
    if correct:  # absent when nothing was right: a fraction of nothing is not 0
        out["correct_block_frac"] = sum(map(used_block, correct)) / len(correct)
    opened = [t for t in trajs if any(ln.prompt.startswith("...") for ln in t.lines)]
    if opened:  # the REPL's block rule: a SyntaxError at a "..." prompt (a statement typed before the blank line)
        out["block_syntax_error_frac"] = sum(any(ln.prompt.startswith("...") and ln.status == "error"
                                                 and ln.error_name in SYNTAX_ERRORS for ln in t.lines)
                                             for t in opened) / len(opened)
    rewards = [t.reward for t in trajs]
    mean = out["reward_mean"]
    out["reward_std"] = (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5
    terms: dict[str, float] = {}
    for t in trajs:
        for ln in t.lines:
            for k, v in ln.rewards.items():
                terms[k] = terms.get(k, 0.0) + v
        for k, v in t.outcome_rewards.items():
            terms[k] = terms.get(k, 0.0) + v
    out.update({f"reward/{k}": v / n for k, v in sorted(terms.items())})
    reasons: dict[str, int] = {}
    for t in trajs:
        reasons[t.end_reason] = reasons.get(t.end_reason, 0) + 1
    out.update({f"end/{k}": v / n for k, v in sorted(reasons.items())})
    out.update(state_stats(trajs))
    if stats is not None:
        out.update({k: v for k, v in stats.extra.items() if k.startswith("tree/")})
        out.update(speculation_stats(stats.extra))
        out.update({
            "wall_s": stats.wall_s, "generation_s": stats.generation_s, "execution_s": stats.execution_s,
            "other_s": max(stats.wall_s - stats.generation_s, 0.0),
            "setup_s": stats.extra.get("setup_s", 0.0),  # the tasks' setup, summed over episodes (not execution_s)
            "tokens_per_s": stats.model_tokens / max(stats.wall_s, 1e-9),
        })
        out.update(line_timing(stats.extra))
    return out


def speculation_stats(extra: dict[str, float]) -> dict[str, float]:
    """With speculation on (``EpisodeRules.speculate``): ``rollout/speculated_lines``, the lines whose successor
    was sampled while they ran, and ``rollout/speculation_hit_rate``, the share of those whose successor was kept
    (absent when none was speculated). Empty with speculation off."""
    if "speculated_lines" not in extra:
        return {}
    n = extra["speculated_lines"]
    out = {"rollout/speculated_lines": n}
    if n:
        out["rollout/speculation_hit_rate"] = extra.get("speculation_hits", 0.0) / n
    return out


def line_timing(extra: dict[str, float]) -> dict[str, float]:
    """Where a line's time went in the engine, from a session's counters (the vLLM backend's ``timing`` and
    ``stats``, summed over the rollout): ``time/line_first_token_ms``, from a line's input to its first token;
    ``time/line_token_ms``, per later token (the engine's step as a row sees it); ``gen/context_reuse``, the share
    of line requests' transcripts not computed again. Empty for a backend without them."""
    out: dict[str, float] = {}
    if extra.get("gen_lines"):
        out["time/line_first_token_ms"] = 1000 * extra.get("gen_first_token_s", 0.0) / extra["gen_lines"]
    if extra.get("gen_later_tokens"):
        out["time/line_token_ms"] = 1000 * extra.get("gen_later_tokens_s", 0.0) / extra["gen_later_tokens"]
    if extra.get("gen_prompt_tokens"):
        out["gen/context_reuse"] = extra.get("gen_cached_tokens", 0.0) / extra["gen_prompt_tokens"]
    return out
