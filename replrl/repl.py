"""CPython REPL semantics over a sandboxed kernel.

Feed a ``ReplSession`` one line at a time; it answers with what the interpreter printed and the next prompt
(``>>> `` or ``... ``), exactly as ``code.InteractiveConsole`` would: lines are buffered until ``codeop`` says the
statement is complete (a blank line closes a block), expression values are echoed with ``repr``, tracebacks are
CPython's plain ones against ``<stdin>``. The buffering decision is made here (no round trip for a ``... `` line);
complete statements run in the kernel through CPython's own ``code.InteractiveInterpreter``, which is therefore
the single authority on what is printed.
"""

from __future__ import annotations

import ast
import codeop
import hashlib
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from sandbox import ExecResult, StateDigest, ToolCall, empty_state
from sandbox.protocols import PoolKernel

PS1 = ">>> "
PS2 = "... "
BANNER = (f"Python {sys.version} on {sys.platform}\n"
          'Type "help", "copyright", "credits" or "license" for more information.\n')
TRUNCATED_MARKER = "[... output truncated ...]\n"
LOUD_CALLS = frozenset({"print", "pprint", "display", "help", "submit", "exit", "quit", "breakpoint", "input"})
"""Functions whose call prints, ends the episode or waits for input: a line that calls one is not predicted silent
(``ReplSession.silent_prompt``)."""
RESTART_MARKER = {
    "timeout": "[execution timed out and the kernel was restarted: all variables are gone]\n",
    "crashed": "[the Python process crashed and was restarted: all variables are gone]\n",
}


@dataclass
class ReplStep:
    """What happened after one line was fed."""

    line: str
    prompt: str
    """The prompt the line was typed at."""
    output: str
    """What the interpreter printed (empty while a block is being buffered)."""
    next_prompt: str
    result: ExecResult | None = None
    """The kernel's result when the line completed a statement; None when it was only buffered."""

    @property
    def status(self) -> str:
        """ok / error / timeout / crashed for executed statements, ``incomplete`` for a buffered line."""
        return "incomplete" if self.result is None else self.result.status

    @property
    def env_text(self) -> str:
        """The text the environment appends after the line's newline: output, then the next prompt."""
        return self.output + self.next_prompt


@dataclass
class ReplSession:
    """An interactive session on one kernel. ``transcript`` holds the text a person (or the model) would see."""

    kernel: PoolKernel
    banner: str = BANNER
    buffer: list[str] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    digest: bool = False
    """Ask the kernel for a digest of the namespace after every executed statement (see ``start_state``)."""

    def __post_init__(self) -> None:
        self._compiler = codeop.CommandCompiler()
        self.transcript = self.banner + PS1
        self.state: StateDigest | None = empty_state(self.kernel.tools) if self.digest else None
        """The namespace digest after the last executed statement (a fresh kernel's before the first); None when
        digests are off or the kernel did not send one (it crashed)."""

    def start_state(self) -> tuple[str, str]:
        """(named, values): the state the next line is typed in, as two hashes: the namespace digest (with names,
        or values only) and the block being buffered, if any (the same line means something else inside a block).
        ("", "") when the state is unknown."""
        if self.state is None:
            return "", ""
        if not self.buffer:
            return self.state.named, self.state.values
        pending = "\n".join(self.buffer).encode("utf-8", "surrogatepass")
        named, values = (hashlib.blake2b(d.encode() + b"\0" + pending, digest_size=8).hexdigest()
                         for d in (self.state.named, self.state.values))
        return named, values

    async def refresh_state(self) -> None:
        """Ask the kernel for the digest of its namespace now (after code run outside the session, e.g. a task's
        setup): the next line's start state."""
        self.state = (await self.kernel.execute("", mode="exec", digest=True)).state

    def _track(self, result: ExecResult) -> None:
        if result.restarted:
            self._compiler = codeop.CommandCompiler()
        if self.digest:  # a replaced kernel starts empty; a kernel that sent no digest leaves the state unknown
            self.state = result.state or (empty_state(self.kernel.tools) if result.restarted else None)

    @property
    def prompt(self) -> str:
        return PS2 if self.buffer else PS1

    def silent_prompt(self, line: str) -> str | None:
        """The prompt that follows ``line`` (typed at the current prompt, no newline) if the interpreter prints
        nothing for it, decided without running it, as ``feed`` buffers: ``... `` while a block or bracket stays
        open, ``>>> `` once the statement is complete (or the blank line closed the block). None where the line
        would likely print: a statement that does not compile, an expression whose value the REPL echoes (a bare
        name, an operation; a call is taken to return None), a call of one of ``LOUD_CALLS``. A guess for
        speculation (``rollout.play``): the line's real step decides, and a wrong guess costs only the tokens
        sampled after it."""
        if "\n" in line:
            return None
        source = "\n".join([*self.buffer, line])
        if self._needs_more(source):
            return PS2
        if _blank(source):
            return PS1
        return None if likely_prints(source) else PS1

    async def feed(self, line: str) -> ReplStep:
        """Type ``line`` (no newline) at the current prompt."""
        if "\n" in line:
            raise ValueError("ReplSession.feed takes one line without a newline")
        prompt = self.prompt
        self.buffer.append(line)
        source = "\n".join(self.buffer)
        result = None
        output = ""
        if self._needs_more(source):
            pass
        elif _blank(source):  # nothing to run: CPython compiles it to `pass`
            self.buffer.clear()
        else:
            result = await self.kernel.execute(source, mode="single", digest=self.digest)
            if result.incomplete:  # the kernel is the authority; keep buffering
                result = None
            else:
                self.buffer.clear()
                output = render_output(result)
                self.tool_calls.extend(result.tool_calls)
                self._track(result)
        step = ReplStep(line=line, prompt=prompt, output=output, next_prompt=self.prompt, result=result)
        self.transcript += line + "\n" + step.env_text
        return step

    async def end_of_input(self) -> ReplStep | None:
        """The input ends (the model's end-of-turn token) with ``buffer`` pending: what `python -i` does at EOF.

        The buffered statement is compiled as it stands and runs: an unclosed block runs, an open bracket is
        CPython's SyntaxError. None when nothing is pending. (``code.InteractiveConsole`` would drop the buffer.)
        """
        if not self.buffer:
            return None
        prompt, source = self.prompt, "\n".join(self.buffer)
        self.buffer.clear()
        if _blank(source):
            step = ReplStep(line="", prompt=prompt, output="", next_prompt=self.prompt)
        else:
            result = await self.kernel.execute(source, mode="eof", digest=self.digest)
            self.tool_calls.extend(result.tool_calls)
            self._track(result)
            step = ReplStep(line="", prompt=prompt, output=render_output(result), next_prompt=self.prompt,
                            result=result)
        self.transcript += step.output
        return step

    async def replay(self, lines: Sequence[tuple[str, str]]) -> Replay:
        """Rebuild a recorded session's state here: feed its ``(code, output)`` lines, compare the outputs
        (see ``replay_lines``). Call it on a fresh session, before any other line."""
        return await replay_lines(self, lines)

    def _needs_more(self, source: str) -> bool:
        try:
            with warnings.catch_warnings():  # the kernel shows compile warnings to the model; not the host's stderr
                warnings.simplefilter("ignore")
                return self._compiler(source, "<stdin>", "single") is None
        except (OverflowError, SyntaxError, ValueError):
            return False  # let the kernel compile it and print the error


@dataclass
class Replay:
    """What replaying recorded lines into a fresh session found (``ReplSession.replay``)."""

    lines: int
    """Lines fed (buffered block lines included)."""
    diverged_at: int | None
    """Index of the first line whose output differed from the recorded one; None when every output matched."""
    duration_s: float
    """Wall time of the replay (every line fed, outputs compared)."""

    @property
    def diverged(self) -> bool:
        return self.diverged_at is not None


async def replay_lines(session: ReplSession, lines: Sequence[tuple[str, str]]) -> Replay:
    """Feed recorded ``(code, output)`` lines into ``session`` (a fresh kernel) and compare each output with the
    recorded one: the state they rebuild is the recorded session's only if every output matches (``random``, time,
    ``id()`` or a file appended to differ). Every line is fed even after a difference, so the session ends where the
    recorded one did (same prompt, same buffer)."""
    t0 = time.perf_counter()
    diverged = None
    for k, (code, output) in enumerate(lines):
        step = await session.feed(code)
        if diverged is None and step.output != output:
            diverged = k
    return Replay(lines=len(lines), diverged_at=diverged, duration_s=time.perf_counter() - t0)


def render_output(result: ExecResult) -> str:
    """The text the REPL shows for an executed statement, with markers for truncation and restarts."""
    output = result.output
    if result.truncated:
        output += ("" if output.endswith("\n") else "\n") + TRUNCATED_MARKER
    if result.restarted and result.limit:  # a total ended the kernel: say which
        output += ("" if not output or output.endswith("\n") else "\n") + \
            f"[the Python process was stopped ({result.limit}) and restarted: all variables are gone]\n"
    elif result.restarted:
        output += RESTART_MARKER.get(result.status, RESTART_MARKER["crashed"])
    return output


def likely_prints(source: str) -> bool:
    """Whether a complete interactive statement likely prints when it runs: it does not compile (a SyntaxError is
    printed), an expression statement outside a function or class body is not a call (the REPL echoes its value:
    ``x``, ``a + b``, also in a loop's body), or it calls one of ``LOUD_CALLS`` outside a function or class body."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(source + "\n", "<stdin>", "single")
    except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError):
        return True
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo += node.decorator_list if not isinstance(node, ast.Lambda) else []  # run now; the body later
            continue
        if isinstance(node, ast.Expr) and not isinstance(node.value, (ast.Call, ast.Await)):
            return True
        if isinstance(node, ast.Call):
            f = node.func
            if (f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "") in LOUD_CALLS:
                return True
        todo += ast.iter_child_nodes(node)
    return False


def _blank(source: str) -> bool:
    return all(not s.strip() or s.strip().startswith("#") for s in source.split("\n"))
