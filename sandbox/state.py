"""The host's side of the state digest: the digest of a fresh kernel's namespace, computed by the kernel's own code."""

from __future__ import annotations

from collections.abc import Sequence

from ._kernel_digest import state_digest
from .result import StateDigest


def empty_state(tools: Sequence[str] = ()) -> StateDigest:
    """The state of a kernel before any line ran (only the tools defined, which are not state)."""
    return StateDigest(**state_digest({"__name__": "__main__", "__doc__": None}, tuple(tools)))
