"""`replrl repl`: the model's REPL, for a person (interactive) or a pipe (prints the exact transcript)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING

from sandbox.limits import Limits  # light; the kernel machinery is imported when the REPL starts

if TYPE_CHECKING:
    from ..repl import ReplSession


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "repl",
        help="open the sandboxed REPL the model uses",
        description="Open the sandboxed Python REPL exactly as the model sees it. On a terminal it is interactive "
        "(prompts, line editing, Ctrl-C interrupts a running line, Ctrl-D exits). With stdin not a terminal it "
        "reads lines and writes the whole transcript (banner, prompts, lines, output) to stdout: the exact text "
        "a model would see.",
    )
    p.add_argument("--tools", default="submit", help="comma-separated tool functions to inject (default: submit)")
    p.add_argument("--wall-s", type=float, default=Limits.wall_s, help="seconds one statement may run")
    p.add_argument("--isolation", default="auto", choices=["auto", "bwrap", "unshare", "rlimits"],
                   help="sandbox isolation (auto: the strongest available)")
    p.add_argument("--network", action="store_true", help="allow network access from the kernel")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sandbox import Kernel, run_sync

    from ..repl import ReplSession

    limits = Limits(wall_s=args.wall_s, isolation=args.isolation, network=args.network)
    tools = [t for t in args.tools.split(",") if t]
    kernel = Kernel(limits, tools)
    run_sync(kernel.start())
    try:
        session = ReplSession(kernel)
        return _interactive(session) if sys.stdin.isatty() else _piped(session)
    finally:
        run_sync(kernel.shutdown())


def _piped(session: ReplSession) -> int:
    from sandbox import run_sync

    out = sys.stdout
    out.write(session.transcript)
    for raw in sys.stdin:
        line = raw.rstrip("\n")
        step = run_sync(session.feed(line))
        out.write(line + "\n" + step.env_text)
        out.flush()
    return 0


def _interactive(session: ReplSession) -> int:
    from sandbox import run_sync
    from sandbox.sync import loop_thread

    from ..repl import PS1

    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    print(session.banner.rstrip("\n"))
    print(f"[sandbox: {session.kernel.isolation}; tools: {', '.join(session.kernel.tools) or 'none'}]")
    prompt = PS1
    while True:
        try:
            line = input(prompt)
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print("\nKeyboardInterrupt")
            session.buffer.clear()
            prompt = PS1
            continue
        pending = asyncio.run_coroutine_threadsafe(session.feed(line), loop_thread().loop)
        while True:
            try:
                step = pending.result()
                break
            except KeyboardInterrupt:  # Ctrl-C while a statement runs: interrupt the kernel, show its traceback
                run_sync(session.kernel.interrupt())
        sys.stdout.write(step.output)
        for call in step.result.tool_calls if step.result else []:
            print(f"[tool call] {call.name}({', '.join(map(repr, call.args))})")
        prompt = step.next_prompt
