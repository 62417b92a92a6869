"""The Generator protocol: what the rollout loop needs from a generation backend.

A session holds many rows (episodes). Each row alternates: the caller asks for one line (``next_line``), executes
it, and asks for the next line, passing the tokens the environment inserts (interpreter output, the next prompt).
Requests for different rows are awaited concurrently; a backend batches whatever rows are waiting, and keeps
generating for the other rows while one row's line is being executed.
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
    """A backend that opens generation sessions."""

    tokenizer: Any
    """A Hugging Face tokenizer: the ids it produces are the ids sessions take and return."""
    pad_id: int
    """Id that pads batches of trajectories (never attended to, never scored)."""

    def session(self, prompts: list[list[int]], sampling: SamplingParams) -> GenSession:
        """A session with one row per prompt (token ids, non-empty), all sampled with ``sampling``."""
        ...

    def sync_weights(self, model: Any) -> None:
        """Publish ``model``'s current weights to the sampler (after each optimizer step, between rollouts), and drop
        anything computed with the old ones (a prefix cache). HF: nothing to do, it samples from ``model`` itself."""
        ...
