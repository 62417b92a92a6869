"""ExecResult: what one execution returned. Data, never exceptions."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["ok", "error", "timeout", "crashed"]


@dataclass
class ToolCall:
    """A call the executed code made to a tool injected into the kernel (e.g. ``submit(18)``)."""

    name: str
    args: list[Any]
    """Positional arguments as plain data (int/float/str/bool/None kept, a subclass as its base value; Fraction,
    Decimal -> str; numpy scalars -> Python values; anything else -> {"rejected": why, "repr": short repr})."""
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class StateDigest:
    """A digest of the user's namespace after an execution (``Kernel.execute(..., digest=True)``), computed inside
    the kernel; only hashes leave it. See ``sandbox/_kernel_digest.py`` for what counts as state."""

    named: str
    """Hash of the user's variables, names and values (16 hex characters)."""
    values: str
    """Hash of the multiset of values alone: ``a = 4175`` and ``total = 4175`` give the same one."""
    ms: float = 0.0
    """Milliseconds the kernel spent computing both."""
    marked: int = 0
    """Values digested as a marker (their type name): too large, or not plain data (objects of user classes, ...)."""
    names: int = 0
    """Variables counted as state."""


@dataclass
class ExecResult:
    """The outcome of one ``Kernel.execute`` call.

    ``status`` is ``ok`` (ran to completion), ``error`` (raised: see ``error_name``), ``timeout`` (ran past
    ``Limits.wall_s`` and was interrupted) or ``crashed`` (the kernel died or had to be killed; it was replaced,
    so the state of earlier executions is gone: ``restarted`` is True).
    """

    status: Status
    output: str = ""
    """Everything the code printed, stdout and stderr interleaved in order, capped at ``Limits.max_output_bytes``."""
    error_name: str | None = None
    """Exception class name when status is ``error`` (``"ZeroDivisionError"``, ``"SyntaxError"``, ...)."""
    duration_s: float = 0.0
    truncated: bool = False
    """True when output went past the cap (the kernel stopped keeping it)."""
    incomplete: bool = False
    """REPL mode only: the source is an unfinished compound statement; nothing ran."""
    restarted: bool = False
    """The kernel was replaced during this call: variables from earlier executions are gone."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    state: StateDigest | None = None
    """The namespace digest after the execution, when it was asked for and the kernel answered."""
    limit: str | None = None
    """When a total ended the kernel (``crashed``): which, in words ("memory limit: ..."); else None."""
    post: Any = field(default=None, repr=False, compare=False)
    """What the pool's post-processor made of this result in its kernel host (``HostedPool(post=...)``, e.g. the
    output's tokens): plain data as the host sent it, unchecked here: whoever asked for it checks it. None for a
    kernel in this process, a host without a post-processor, or one whose post-processor failed."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
