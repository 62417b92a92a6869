"""The Generator protocol: everything the rollout wing and the Trainer read of a generation backend, typed here so
that nothing reads a backend by ``hasattr``: a new backend is one class against these protocols.

A session holds many rows (episodes). Each row alternates: the caller asks for one line (``next_line``), executes
it, and asks for the next line, passing the tokens the environment inserts (interpreter output, the next prompt).
Requests for different rows are awaited concurrently; a backend batches whatever rows are waiting, and keeps
generating for the other rows while one row's line is being executed.

The optional parts are protocols of their own, checked with ``isinstance``: ``ForkableSession`` (a tree rollout
branches rows in place) and ``SleepingGenerator`` (an engine that frees its GPU memory during the update).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from replrl.types import LineSample, SamplingParams


@runtime_checkable
class GenSession(Protocol):
    """Generation state for a fixed set of rows (one prompt each), e.g. the KV cache of a batch of episodes."""

    async def next_line(self, i: int, env_ids: list[int]) -> LineSample:
        """Append ``env_ids`` to row ``i``'s context (after its prompt, on the first call), then sample one line.

        The line ends at the first token whose text ends with a newline (finish "newline"), at an end-of-sequence
        token (finish "eos", the token included), or after ``max_line_tokens`` tokens (finish "length").
        The line's first token is one whose text begins with a space, or EOS (prompt healing: the environment's
        prompt ends without its space, see ``replrl.contract``).
        """
        ...

    async def rollback(self, i: int, length: int) -> None:
        """Drop everything of row ``i`` after its first ``length`` context tokens (prompt included): the line in
        flight, if any, is cancelled (its ``next_line`` raises ``asyncio.CancelledError``), and the tokens given or
        sampled after position ``length`` are forgotten, as if they had never been there. The row then stands between
        two lines: its next ``next_line`` passes the environment tokens that follow position ``length``, and the line
        it returns is sampled after that true context only, from a fresh random stream (seeded from the session's
        seed, the row and how many times it was rolled back). Speculation (``rollout.play``) uses it when the
        interpreter's answer to a line is not the prompt it predicted. 1 <= ``length`` <= the row's context length
        (its prompt, the environment tokens given and the tokens sampled so far)."""
        ...

    def finish(self, i: int) -> None:
        """Row ``i``'s episode is over: free its slot. No further ``next_line`` for it."""
        ...

    async def aclose(self) -> None:
        """Release everything the session holds; pending requests fail."""
        ...

    stats: dict[str, float]
    """The session's counters (steps, tokens fed, seconds in the forward...), added up by the rollout as its
    ``gen_<name>`` figures (``worker_s``: the generation time); ``max_...`` ones are maxima. May be empty."""
    timing: dict[str, float]
    """Per-line timings the backend measures (vLLM: seconds to a line's first token, between lines), added to the
    rollout's figures as ``gen_<name>`` too. May be empty."""


@runtime_checkable
class ForkableSession(GenSession, Protocol):
    """A session that can branch a row (optional: a tree rollout uses it when a session has it, and otherwise opens
    a session of its own for the children, whose prompt is the shared prefix)."""

    def fork(self, i: int, keys: Sequence[int], prefix: Sequence[int] | None = None) -> list[int]:
        """New rows, one per key, whose context is row ``i``'s as it stands between two lines (no ``next_line``
        pending for it); they go on with ``next_line`` like any row, the first call passing the environment tokens
        row ``i`` has not been given yet. With ``prefix`` (a prefix of row ``i``'s context), their context is that
        prefix instead, and their first call passes no environment tokens. A key names a new row's random stream
        (with the session's seed), so a fork's samples do not depend on the order rows were forked in. Returns the
        new rows' indices."""
        ...


@runtime_checkable
class Generator(Protocol):
    """A backend that opens generation sessions, and takes the policy's weights after each update."""

    tokenizer: Any
    """A Hugging Face tokenizer: the ids it produces are the ids sessions take and return."""
    pad_id: int
    """Id that pads batches of trajectories (never attended to, never scored)."""
    version: int
    """The policy version the sessions sample with: the value the last ``sync_weights`` was given (0: the weights
    the generator was opened with). Trajectories sampled now are of this version."""
    own_weights: bool
    """True: the generator samples from its own copy of the weights (an engine), which ``sync_weights`` fills;
    False: it samples from the module it was given (the Trainer's own, so FSDP2 gathers it for the rollouts)."""
    last_sync_transport: str
    """How the last ``sync_weights`` moved the weights (vLLM: ``cuda_ipc``, ``shm`` or ``rpc``; "": nothing moved)."""

    def session(self, prompts: list[list[int]], sampling: SamplingParams) -> GenSession:
        """A session with one row per prompt (token ids, non-empty), all sampled with ``sampling``."""
        ...

    def sync_weights(self, model: Any, version: int | None = None) -> None:
        """Publish ``model``'s current weights to the sampler (after each optimizer step, between rollouts), and drop
        anything computed with the old ones (a prefix cache); ``version`` becomes ``self.version`` (None: the next
        one, ``version + 1``). HF: nothing to copy, it samples from ``model`` itself."""
        ...

    def close(self) -> None:
        """Release what the generator holds (vLLM: the engine's processes, its directory, the shared weights; HF: its
        worker thread). A command calls it when it is done, so an engine shuts down while the interpreter still
        runs: left to the interpreter's exit, a CUDA IPC buffer's producer would exit before the engine released
        it."""
        ...


@runtime_checkable
class SleepingGenerator(Generator, Protocol):
    """A generator that can free its GPU memory while the update runs (vLLM with ``model.vllm_sleep``): ``sleep``
    before the update, ``wake`` and then ``sync_weights`` after it."""

    def sleep(self) -> None:
        """Free the KV cache and the weights (they are copied in again after the update)."""
        ...

    def wake(self) -> None:
        """Allocate them again (``sync_weights`` then fills the weights)."""
        ...
